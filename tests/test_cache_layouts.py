"""check_kvcache on caches in the layouts other kernels keep: FlashInfer's HND and vLLM's
paged_attention layout (keys split into vectors of x values), and q without its queries' axis (one
query a sequence, vLLM's). A correct step passes in each; a paging bug is named as in flash-attn's
layout; a kernel that reads the pools in another layout than they are in is named
(cache_layout_misread); arrays passed in one layout and declared in another are refused with the
layout they fit."""
from __future__ import annotations

import re

import numpy as np
import pytest

from helpers.kv_cache_programs import DecodeCase, decode, decode_splits
from helpers.vllm_programs import VllmCase, paged_attention, paged_attention_v2, reshape_and_cache
import attnstep

SEQLENS = [37, 45, 20]


def _hnd(a: np.ndarray) -> np.ndarray:
    """A cache in flash-attn's layout, (pages, slots, kv_heads, dim), laid out as FlashInfer's HND."""
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3))


def _failing(report, sequence=None):
    return [r for r in report.results if not r.passed and sequence in (None, r.sequence)]


def _first_codes(report):
    return {r.diagnosis[0].code if r.diagnosis else None for r in _failing(report)}


# ---- vLLM's paged_attention layout -------------------------------------------------------------

def _vllm(case: VllmCase, bug=None, **kwargs):
    k, v = reshape_and_cache(case, bug)
    out = paged_attention(case, k, v, bug)
    return attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {"output": out},
                                  cache_seqlens=np.asarray(case.seq_lens) - 1, block_table=case.block_tables,
                                  k_new=case.key, v_new=case.value, k_cache_after=k, v_cache_after=v,
                                  cache_layout="vllm", **kwargs)


@pytest.mark.parametrize("block_size, x, kv_heads", [(16, 4, 2), (8, 8, 1), (32, 2, 4)])
def test_a_correct_vllm_step_passes(block_size, x, kv_heads):
    report = _vllm(VllmCase(SEQLENS, block_size=block_size, x=x, kv_heads=kv_heads))
    assert report, attnstep.format_report(report)
    assert [c.passed for c in report.run_checks] == [True, True]


MISREAD_WORDS = {
    "vector_order": "read its keys with each row's vectors and their x = 4 lanes swapped",
    "keys_unsplit": "read its keys as (num_blocks, kv_heads, block_size, head_size), without their rows' split into "
                    "vectors of x = 4",
    "values_transposed": "read its values as (num_blocks, kv_heads, block_size, head_size), where they are",
}


@pytest.mark.parametrize("bug, code", [("wrong_block", "paged_wrong_page"), ("past_length", "paged_past_length"),
                                       *((bug, "cache_layout_misread") for bug in MISREAD_WORDS)])
def test_a_vllm_kernel_s_bug_is_named(bug, code):
    report = _vllm(VllmCase(SEQLENS), bug)
    assert not report
    assert _first_codes(report) == {code}, attnstep.format_report(report)
    if bug in MISREAD_WORDS:
        assert MISREAD_WORDS[bug] in _failing(report)[0].diagnosis[0].message
        assert code in attnstep.format_report(report)


def test_a_vllm_cache_write_one_slot_late_is_named_in_the_cache_after_the_step():
    report = _vllm(VllmCase(SEQLENS), "write_offset")
    k_after = report.run_checks[0]
    assert not k_after.passed and k_after.message.startswith("k_cache_after: sequence 0, page ")
    assert k_after.detail["diagnosis"][0]["code"] == "cache_write_offset"
    assert re.search(r"\(k_new\[\d, \d, \d\]\)", k_after.message)  # (the new keys as given: (batch, kv_heads, dim))


# ---- FlashInfer's HND --------------------------------------------------------------------------

def _hnd_check(case: DecodeCase, bug=None, **kwargs):
    out, lse, k_after, v_after = decode(case, bug)
    return attnstep.check_kvcache(case.q, _hnd(case.k_cache), _hnd(case.v_cache),
                                  {"flash_output": out, "flash_lse": lse}, **case.arguments(),
                                  k_cache_after=_hnd(k_after), v_cache_after=_hnd(v_after), cache_layout="hnd",
                                  **kwargs)


@pytest.mark.parametrize("page_size", [16, None])
def test_a_correct_hnd_step_passes_paged_and_dense(page_size):
    report = _hnd_check(DecodeCase(SEQLENS, n_new=2, nq=4, causal=True, page_size=page_size))
    assert report, attnstep.format_report(report)
    assert [c.passed for c in report.run_checks] == [True, True]


@pytest.mark.parametrize("bug, code", [("wrong_page", "paged_wrong_page"), ("page_shift", "paged_page_shift"),
                                       ("past_length", "paged_past_length")])
def test_a_paging_bug_in_an_hnd_cache_is_named(bug, code):
    report = _hnd_check(DecodeCase(SEQLENS, n_new=1), bug)
    assert not report and code in _first_codes(report), attnstep.format_report(report)


def test_an_hnd_cache_written_one_slot_late_is_named_as_in_flash_attn_s_layout():
    case = DecodeCase(SEQLENS, n_new=2)
    hnd = _hnd_check(case, "write_offset").run_checks
    out, lse, k_after, v_after = decode(case, "write_offset")
    nhd = attnstep.check_kvcache(case.q, case.k_cache, case.v_cache, {"flash_output": out, "flash_lse": lse},
                                 **case.arguments(), k_cache_after=k_after, v_cache_after=v_after).run_checks
    assert not hnd[0].passed and hnd[0].detail["diagnosis"][0]["code"] == "cache_write_offset"
    assert [(c.message, c.detail) for c in hnd] == [(c.message, c.detail) for c in nhd]
    assert re.match(r"k_cache_after: sequence \d, page \d+ \(block_table\[\d, \d\]\), slot \d+ \(key \d+\), K/V head 0",
                    hnd[0].message)


# ---- a kernel reading the pools in another layout -----------------------------------------------

def _misread_output(case: DecodeCase, pools, heads_first_memory: bool):
    """The program's flash stages when it reads `pools` ("k", "v" or "kv") of the cache in the other
    of the two layouts: heads_first_memory: the cache is HND in memory and read as flash-attn's."""
    P, S, Hk, d = case.k_cache.shape
    program = DecodeCase(case.seqlens, n_new=case.n_new, nq=case.nq, page_size=case.page_size)
    for name in ("k_cache", "v_cache"):
        right = getattr(case, name)
        read = _hnd(right).reshape(P, S, Hk, d) if heads_first_memory else \
            right.reshape(P, Hk, S, d).transpose(0, 2, 1, 3)
        setattr(program, name, read if name[0] in pools else right)
    out, lse, _, _ = decode(program)
    return {"flash_output": out, "flash_lse": lse}


@pytest.mark.parametrize("pools, words", [("k", "its keys as"), ("v", "its values as"),
                                          ("kv", "its keys as (num_blocks, kv_heads, page_size, dim), heads before "
                                                 "slots and its values as")])
def test_a_cache_read_in_the_other_layout_is_named(pools, words):
    case = DecodeCase(SEQLENS, nq=2)
    report = attnstep.check_kvcache(case.q, case.k_cache, case.v_cache, _misread_output(case, pools, False),
                                    **case.arguments())
    assert _first_codes(report) == {"cache_layout_misread"}, attnstep.format_report(report)
    message = _failing(report)[0].diagnosis[0].message
    assert words in message and "(num_blocks, kv_heads, page_size, dim), heads before slots" in message


@pytest.mark.parametrize("pools, words", [("k", "its keys as"), ("v", "its values as"), ("kv", "and its values as")])
def test_an_hnd_cache_read_as_flash_attn_s_is_named(pools, words):
    case = DecodeCase(SEQLENS, nq=2)
    report = attnstep.check_kvcache(case.q, _hnd(case.k_cache), _hnd(case.v_cache),
                                    _misread_output(case, pools, True), **case.arguments(), cache_layout="HND")
    assert _first_codes(report) == {"cache_layout_misread"}, attnstep.format_report(report)
    message = _failing(report)[0].diagnosis[0].message
    assert words in message and "(num_blocks, page_size, kv_heads, dim), slots before heads" in message


@pytest.mark.parametrize("declared, given", [("nhd", _hnd), ("hnd", lambda a: a)])
def test_a_correct_step_checked_in_the_wrong_layout_names_the_layout_it_is_in(declared, given):
    """Page size 2 and 4 K/V heads: either layout reads the pools (no refusal); a correct step read in
    the other fails, and the check names the layout it passes in."""
    case = DecodeCase([7, 9, 4], heads=8, kv_heads=4, page_size=2)
    out, lse, _, _ = decode(case)
    report = attnstep.check_kvcache(case.q, given(case.k_cache), given(case.v_cache),
                                    {"flash_output": out, "flash_lse": lse}, **case.arguments(), cache_layout=declared)
    assert not report
    assert _first_codes(report) == {"cache_layout_declared"}, attnstep.format_report(report)
    other = "hnd" if declared == "nhd" else "nhd"
    assert f"the step passes with cache_layout='{other}'" in _failing(report)[0].diagnosis[0].message


def test_a_failing_step_is_not_checked_again_in_a_layout_that_does_not_come_closer(monkeypatch):
    """The same ambiguous shapes, a program right in its layout but for a noisy output: the other
    layout's forward lies no closer, so the step is checked once, not again in that layout."""
    import verify.api as api
    calls = []
    real = api._decode_step
    monkeypatch.setattr(api, "_decode_step", lambda *a: calls.append(1) or real(*a))
    case = DecodeCase([7, 9, 4], heads=8, kv_heads=4, page_size=2)
    out, lse, _, _ = decode(case, "noise")
    report = attnstep.check_kvcache(case.q, case.k_cache, case.v_cache, {"flash_output": out, "flash_lse": lse},
                                    **case.arguments())
    assert not report and "cache_layout_declared" not in _first_codes(report) and len(calls) == 1


@pytest.mark.parametrize("bug", ["noise", "scaled"])
def test_a_wrong_output_of_another_cause_is_not_named_a_misread(bug):
    case = DecodeCase(SEQLENS, n_new=1)
    out, lse, _, _ = decode(case, bug)
    report = attnstep.check_kvcache(case.q, case.k_cache, case.v_cache, {"flash_output": out, "flash_lse": lse},
                                    **case.arguments())
    assert not report
    assert not any(d.code == "cache_layout_misread" for r in _failing(report) for d in r.diagnosis)


# ---- q without its queries' axis ------------------------------------------------------------------

def test_one_query_a_sequence_without_the_queries_axis():
    case = DecodeCase(SEQLENS, n_new=1)
    out, lse, _, _ = decode(case)
    stages = {"flash_output": out[:, 0], "flash_lse": lse[:, :, 0]}
    assert attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, stages, **case.arguments())
    args = {**case.arguments(), "k_new": case.k_new[:, 0], "v_new": case.v_new[:, 0]}  # (batch, kv_heads, dim)
    assert attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, stages, **args)
    with pytest.raises(ValueError, match=r"^k_new is \(3, 3, 16\): expected \(batch, kv_heads, dim\) = \(3, 2, 16\)$"):
        attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, stages,
                               **{**args, "k_new": np.zeros((3, 3, 16), np.float32)})
    with pytest.raises(ValueError, match=r"^flash_output is \(3, 1, 4, 16\): expected \(batch, heads, dim\) = "
                                         r"\(3, 4, 16\)$"):
        attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, {"flash_output": out}, **case.arguments())


def test_splits_without_the_queries_axis():
    case = DecodeCase(SEQLENS, n_new=1)
    out_s, lse_s = decode_splits(case, 16)
    report = attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, {}, **case.arguments(),
                                    split_output=out_s[:, :, :, 0], split_lse=lse_s[:, :, :, 0], split_size=16)
    assert report, attnstep.format_report(report)
    with pytest.raises(ValueError, match=r"^split_lse is \(\d+, 3, 4, 1\): expected \(num_splits, batch, heads\)"):
        attnstep.check_kvcache(case.q[:, 0], case.k_cache, case.v_cache, {}, **case.arguments(), split_output=None,
                               split_lse=lse_s, split_size=16)


# ---- refusals -------------------------------------------------------------------------------------

def test_an_hnd_cache_passed_without_its_layout_is_refused_with_the_layout_it_fits():
    case = DecodeCase(SEQLENS, n_new=2)
    out, lse, _, _ = decode(case)
    with pytest.raises(ValueError, match=r"^k_cache has 16 K/V heads and q 4: grouped K/V heads must divide the query "
                                         r"heads; the arrays would fit cache_layout='hnd' \(FlashInfer's HND: k_cache "
                                         r"\(num_blocks, kv_heads, page_size, dim\)\)$"):
        attnstep.check_kvcache(case.q, _hnd(case.k_cache), _hnd(case.v_cache), {"flash_output": out},
                               **case.arguments())


def test_a_vllm_cache_passed_without_its_layout_is_refused_with_the_layout_it_fits():
    case = VllmCase(SEQLENS)
    with pytest.raises(ValueError, match=r"^k_cache is \(\d+, 2, 4, 16, 4\): expected \(num_blocks, page_size, "
                                         r"kv_heads, dim\) with block_table; the arrays would fit "
                                         r"cache_layout='vllm' \(vLLM's paged_attention kernels': k_cache"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {}, cache_seqlens=case.seq_lens,
                               block_table=case.block_tables, split_output=np.zeros((1, 3, 4, 16)), split_size=64)


def test_layout_refusals():
    case = VllmCase(SEQLENS)
    args = dict(cache_seqlens=case.seq_lens, block_table=case.block_tables)
    out = paged_attention(case, case.key_cache, case.value_cache)
    with pytest.raises(ValueError, match=r"^cache_layout='vllm' \(vLLM's paged_attention kernels'\) is a paged "
                                         "cache: pass block_table=$"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {"output": out}, cache_layout="vllm",
                               cache_seqlens=case.seq_lens)
    with pytest.raises(ValueError, match=r"^cache_layout 'flash': expected one of nhd, hnd, vllm$"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {"output": out}, cache_layout="flash",
                               **args)
    with pytest.raises(ValueError, match=r"^k_cache has a page size of 16, v_cache a page size of 32: they must match "
                                         r"\(cache_layout='vllm': k_cache \(num_blocks, kv_heads, dim / x, block_size, "
                                         r"x\), v_cache \(num_blocks, kv_heads, dim, block_size\)\)$"):
        wide = VllmCase(SEQLENS, head_size=32)
        attnstep.check_kvcache(wide.query, wide.key_cache, wide.value_cache.transpose(0, 1, 3, 2), {},
                               cache_layout="vllm", cache_seqlens=wide.seq_lens, block_table=wide.block_tables,
                               split_output=np.zeros((1, 3, 4, 32)), split_size=64)
    with pytest.raises(ValueError, match=r"^v_cache is \(\d+, 2, 16, 16, 1\): expected \(num_blocks, kv_heads, dim, "
                                         r"block_size\)$"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache[..., None], {"output": out},
                               cache_layout="vllm", **args)
    with pytest.raises(ValueError, match=r"^k_cache_after is \(2, 2\), the cache \(\d+, 2, 4, 16, 4\): the cache "
                                         "after the step has the cache's shape$"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {"output": out}, cache_layout="vllm",
                               k_cache_after=np.zeros((2, 2)), **args)


# ---- bf16: a reading, not a precision convention fitted by chance ---------------------------------

@pytest.mark.parametrize("seed", [3, 0])
def test_a_bf16_length_bug_is_named_on_every_sequence_not_a_rounding_convention(seed):
    """Every sequence attends one key too many; at bf16 the extra key moves some heads' output by
    about one unit of the format, which a rounding convention (half_truncation) fits on such a head
    (seed 3): the length is named on every failing result all the same, and no convention."""
    case = VllmCase([209, 130, 138], heads=8, kv_heads=2, head_size=64, x=8, half=True, seed=seed)
    report = _vllm(case, "lengths_plus_one", precision="bf16")
    assert not report
    assert {tuple(d.code for d in r.diagnosis) for r in _failing(report)} == {("cache_length_off_by_one",)}, \
        attnstep.format_report(report)


# ---- vLLM's paged_attention_v2 partitions -----------------------------------------------------

def _vllm_v2(case: VllmCase, partition: int, bug=None):
    tmp_out, max_logits, exp_sums, out = paged_attention_v2(case, case.key_cache, case.value_cache, partition, bug)
    with np.errstate(invalid="ignore"):  # (the unused partitions' garbage: never read)
        lse = max_logits + np.log(exp_sums)
    return attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {"flash_output": out},
                                  cache_seqlens=case.seq_lens, block_table=case.block_tables, cache_layout="vllm",
                                  split_output=tmp_out, split_lse=lse, split_size=partition)


def test_vllm_v2_partitions_pass_whatever_the_unused_ones_hold():
    report = _vllm_v2(VllmCase([37, 100, 20]), 32)
    assert report, attnstep.format_report(report)
    assert {"split_output", "split_lse", "flash_output"} <= set(report.stages)


@pytest.mark.parametrize("bug, stage", [("not_rescaled", "flash_output"), ("wrong_block", "split_output")])
def test_a_vllm_v2_bug_is_placed(bug, stage):
    report = _vllm_v2(VllmCase([37, 100, 20]), 32, bug)
    assert not report
    first = _failing(report)[0]
    assert first.stage == stage, attnstep.format_report(report)
    if bug == "wrong_block":
        assert first.sequence == 1 and first.diagnosis[0].code == "paged_wrong_page", attnstep.format_report(report)
    else:  # (the reduce weighs each partition's exp_sum without exp(max_logits − max): named in the combine)
        failing = [r for r in _failing(report) if r.stage == "flash_output"]
        assert all(r.diagnosis[0].code == "split_not_rescaled" and r.diagnosis[0].detail.get("own_maximum")
                   for r in failing), attnstep.format_report(report)


def test_vllm_v2_partitions_of_the_wrong_shape_are_named():
    case = VllmCase([37, 100, 20])
    tmp_out, max_logits, exp_sums, out = paged_attention_v2(case, case.key_cache, case.value_cache, 32)
    with pytest.raises(ValueError, match=r"^split_output is \(3, 4, 2, 16\): expected vLLM's \(num_seqs, num_heads, "
                                         r"max_num_partitions, head_size\) = \(3, 4, 4 or more, 16\): partitions of 32 "
                                         r"keys$"):
        attnstep.check_kvcache(case.query, case.key_cache, case.value_cache, {}, cache_seqlens=case.seq_lens,
                               block_table=case.block_tables, cache_layout="vllm", split_output=tmp_out[:, :, :2],
                               split_size=32)


def test_torch_tensors_in_each_layout():
    torch = pytest.importorskip("torch", reason="torch is not installed: the NumPy tests cover the same path")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device)  # noqa: E731
    case = VllmCase(SEQLENS)
    k_after, v_after = reshape_and_cache(case)
    out = paged_attention(case, k_after, v_after)
    assert attnstep.check_kvcache(t(case.query), t(case.key_cache), t(case.value_cache), {"output": t(out)},
                                  cache_seqlens=t(np.asarray(case.seq_lens) - 1), block_table=t(case.block_tables),
                                  k_new=t(case.key), v_new=t(case.value), k_cache_after=t(k_after),
                                  v_cache_after=t(v_after), cache_layout="vllm")
    flash = DecodeCase(SEQLENS, n_new=2, nq=4, causal=True)
    out, lse, k_after, v_after = decode(flash, "wrong_page")
    report = attnstep.check_kvcache(t(flash.q), t(_hnd(flash.k_cache)), t(_hnd(flash.v_cache)),
                                    {"flash_output": t(out), "flash_lse": t(lse)}, cache_layout="hnd",
                                    **{n: t(x) if isinstance(x, np.ndarray) else x for n, x in flash.arguments().items()})
    assert not report and "paged_wrong_page" in _first_codes(report), attnstep.format_report(report)

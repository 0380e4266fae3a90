"""check_arrays on packed (varlen) tensors, flash-attn's flash_attn_varlen_func layout: q, k, v,
the outputs and the gradients (total, heads, dim), lse (heads, total), cu_seqlens_q/k and
seqused_k as ints, NumPy arrays or torch tensors. A correct program passes; one that leaks
across a sequence boundary fails naming the sequence; arrays that do not fit the offsets are
named in one line."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.packed_programs import PackedCase, program_stages
import attnstep

f32 = np.float32
SHAPE = dict(seqlens_q=[5, 6, 7, 3], seqlens_k=[6, 4, 5, 9], seqused_k=[4, 4, 5, 5], heads=4, kv_heads=2)


def varlen(bug=None, shape=SHAPE):
    """(q, k, v, do, stages, offsets) in flash-attn's varlen layout."""
    case = PackedCase(**shape)
    whole, _ = program_stages(case, bug)
    thd = lambda x: np.ascontiguousarray(x.transpose(1, 0, 2))  # (heads, total, d) -> (total, heads, d)
    stages = {"flash_output": thd(whole["flash_output"]), "flash_lse": whole["flash_lse"][..., 0],
              "dQ": thd(whole["dQ"]), "dK": thd(whole["dK"]), "dV": thd(whole["dV"])}
    offsets = dict(cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k, seqused_k=case.seqused_k)
    return (*(thd(case.inputs[n]) for n in ("Q", "K", "V", "dO")), stages, offsets)


def test_a_correct_varlen_program_passes():
    q, k, v, do, stages, offsets = varlen()
    report = attnstep.check_arrays(q, k, v, stages, do=do, **offsets)
    assert report, attnstep.format_report(report)
    assert {r.sequence for r in report.stage_results("flash_output")} == {0, 1, 2, 3}
    assert "4 packed sequences" in attnstep.format_report(report)


def test_offsets_as_numpy_int32_and_layout_thd_said():
    q, k, v, do, stages, offsets = varlen()
    offsets = {n: np.asarray(x, np.int32) for n, x in offsets.items()}
    assert attnstep.check_arrays(q, k, v, stages, do=do, layout="thd", **offsets)


def test_a_leak_across_the_boundary_fails_naming_the_sequence():
    q, k, v, do, stages, offsets = varlen("leak")
    report = attnstep.check_arrays(q, k, v, stages, do=do, **offsets)
    assert not report
    assert report.first_failing_stage == "flash_output"
    assert report.first_failure.sequence == 1
    assert "flash_output, all 4 heads, sequences 1-3 alike; head 0, sequence 1 (token" in attnstep.format_report(report)
    with pytest.raises(AssertionError, match="sequence 1"):
        attnstep.assert_attention_stages(q, k, v, stages, do=do, **offsets)


def test_results_alike_in_some_heads_of_each_sequence_claim_no_other_pairing():
    """Head 0 of sequence 1 and heads 0-1 of sequence 2 left unwritten: one block, which names the
    heads of each sequence, not every pairing of heads 0-1 with sequences 1-2."""
    q, k, v, do, stages, offsets = varlen()
    cu = offsets["cu_seqlens_q"]
    out = stages["flash_output"].copy()
    out[cu[1]:cu[2], 0] = 0.0
    out[cu[2]:cu[3], :2] = 0.0
    text = attnstep.format_report(attnstep.check_arrays(q, k, v, {"flash_output": out}, do=do, **offsets))
    assert "FAIL flash_output, head 0, sequence 1; heads 0-1, sequence 2 alike; head 0, sequence 1 (token" in text, text


def test_a_wrong_kv_head_map_is_named_so_where_a_sequence_has_one_key():
    """A sequence of one key: each query head's output is its K/V head's value row, which another
    query head's reference also is. The map h % Hk is the cause, named in every failing result."""
    q, k, v, do, stages, offsets = varlen("kv_modulo", dict(SHAPE, seqlens_k=[6, 1, 5, 9], seqused_k=None))
    report = attnstep.check_arrays(q, k, v, {"flash_output": stages["flash_output"]}, do=do, **offsets)
    failed = [r for r in report.results if not r.passed]
    assert failed and {r.diagnosis[0].code for r in failed} == {"kv_head_map"}, attnstep.format_report(report)
    assert {r.sequence for r in failed} >= {1}


def test_keys_read_at_the_queries_offsets_are_named():
    q, k, v, do, stages, offsets = varlen("cu_q_for_keys", dict(SHAPE, seqused_k=None))
    report = attnstep.check_arrays(q, k, v, {"flash_output": stages["flash_output"]}, **offsets)
    failed = [r for r in report.results if not r.passed]
    assert failed and {r.diagnosis[0].code for r in failed} == {"sequence_offsets_swapped"}, \
        attnstep.format_report(report)
    assert "cu_seqlens_q used for the keys" in failed[0].diagnosis[0].message


def _backward_reading_one_key_more(q, k, v, do, out, lse, cu_q, cu_k, causal=False):
    """A flash-attn-2 style backward (float32, (total, heads, d)) that recomputes P from the stored
    lse over one key past each sequence's (its key loop's bound `<=`), the forward right: (dQ, dK,
    dV), dK and dV added at the key rows it read (the next sequence's first key gets its share).
    causal: bottom-right over the keys it read."""
    H, Hk, d = q.shape[1], k.shape[1], q.shape[2]
    scale, dq, dk, dv = f32(1 / np.sqrt(d)), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], min(cu_k[b + 1] + 1, k.shape[0]))
        for h in range(H):
            kh = h // (H // Hk)
            p = np.exp((q[rows, h] @ k[keys, kh].T).astype(f32) * scale - lse[h, rows][:, None]).astype(f32)
            n, m = p.shape
            p[np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n) if causal else np.zeros(p.shape, bool)] = 0
            dp = (do[rows, h] @ v[keys, kh].T).astype(f32)
            ds = p * (dp - (do[rows, h] * out[rows, h]).sum(axis=1, keepdims=True, dtype=f32))
            dq[rows, h] = (ds @ k[keys, kh]).astype(f32) * scale
            dk[keys, kh] += (ds.T @ q[rows, h]).astype(f32) * scale
            dv[keys, kh] += (p.T @ do[rows, h]).astype(f32)
    return dq, dk, dv


def test_a_backward_alone_reading_one_key_more_is_named():
    """The forward right, its backward's key range one key long: flash_dQ, recomputed from the
    program's own output and lse over the keys it read, is named in the backward alone."""
    q, k, v, do, stages, offsets = varlen(shape=dict(SHAPE, seqused_k=None))
    out, lse = stages["flash_output"], stages["flash_lse"]
    dq, _, _ = _backward_reading_one_key_more(q, k, v, do, out, lse, offsets["cu_seqlens_q"], offsets["cu_seqlens_k"])
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse, "flash_dQ": dq}, do=do, **offsets)
    failed = [r for r in report.results if not r.passed]
    assert failed and {r.stage for r in failed} == {"flash_dQ"}, attnstep.format_report(report)
    named = [r for r in failed if r.diagnosis and r.diagnosis[0].code == "sequence_boundary"]
    assert named and "keys end 1 row late" in named[0].diagnosis[0].message
    assert "in the backward alone" in named[0].diagnosis[0].message, attnstep.format_report(report)


def test_the_key_rows_of_a_backward_alone_reading_one_key_more_are_named():
    """The same backward's dK and dV (a K/V head's sums over its group of query heads): each
    sequence's key rows hold its own misread gradients and, in its first row, the previous
    sequence's share of the key it read past its end. Every failing sequence's key rows are named
    as that reading, in the backward alone; the last sequence's too, which no own reading moves."""
    q, k, v, do, stages, offsets = varlen(shape=dict(SHAPE, seqlens_q=[20, 9, 40], seqlens_k=[27, 13, 53],
                                                     seqused_k=None, causal=True))
    out, lse = stages["flash_output"], stages["flash_lse"]
    dq, dk, dv = _backward_reading_one_key_more(q, k, v, do, out, lse, offsets["cu_seqlens_q"],
                                                offsets["cu_seqlens_k"], causal=True)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse, "flash_dQ": dq, "flash_dK": dk,
                                             "flash_dV": dv}, do=do, causal="bottom-right", **offsets)
    failed = [r for r in report.results if not r.passed and r.stage in ("flash_dK", "flash_dV")]
    assert {r.sequence for r in failed} == {0, 1, 2}, attnstep.format_report(report)
    for r in failed:
        d = r.diagnosis[0] if r.diagnosis else None
        assert d is not None and d.code == "sequence_boundary" and d.detail["backward_only"], \
            attnstep.format_report(report)
        assert "keys end 1 row late" in d.message and d.detail["sequence"] == min(r.sequence, 1), d.message


def test_key_rows_no_reading_explains_are_searched_on_a_few_sequences_only(monkeypatch):
    """dK wrong by noise in every one of ten sequences: each reading recomputes the problems around a
    sequence, so every rule is tried on the key rows of a job's first few failing sequences only;
    the check still fails, unnamed."""
    from verify.diagnose import sequence_keys
    searched = set()
    real = sequence_keys._candidate
    monkeypatch.setattr(sequence_keys, "_candidate", lambda *a: searched.add(a[-1].start) or real(*a))
    shape = dict(SHAPE, seqlens_q=[6, 5, 7, 4, 6, 5, 7, 4, 6, 5], seqlens_k=[8, 6, 9, 5, 8, 6, 9, 5, 8, 6],
                 seqused_k=None, heads=1, kv_heads=1)
    q, k, v, do, stages, offsets = varlen(shape=shape)
    dk = stages["dK"] + f32(1e-3) * np.random.default_rng(5).standard_normal(stages["dK"].shape).astype(f32)
    report = attnstep.check_arrays(q, k, v, {"dK": dk}, do=do, **offsets)
    assert {r.sequence for r in report.results if not r.passed} == set(range(10)), attnstep.format_report(report)
    assert 0 < len(searched) <= sequence_keys.MAX_KEY_ROW_SEARCHES, sorted(searched)


def test_a_key_loop_from_the_stream_s_first_key_is_named():
    """Each sequence's keys read from packed row 0 to its own last (the loop's start not offset by
    cu_seqlens_k[b]), causal bottom-right over what it read: in the third sequence, neither its
    neighbour's leak nor a causal mask over the whole stream gives that (in the last, the whole
    stream's mask does, and is named); named as the loop's start."""
    q, k, v, do, _, offsets = varlen(shape=dict(SHAPE, seqlens_q=[6, 5, 7, 4], seqlens_k=[8, 6, 9, 5],
                                                seqused_k=None))
    cu_q, cu_k, d = offsets["cu_seqlens_q"], offsets["cu_seqlens_k"], q.shape[2]
    out = np.zeros_like(q)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(0, cu_k[b + 1])
        for h in range(q.shape[1]):
            s = (q[rows, h] @ k[keys, h // 2].T).astype(f32) * f32(d ** -0.5)
            n, m = s.shape
            s[np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n)] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[rows, h] = (p / p.sum(axis=1, keepdims=True)) @ v[keys, h // 2]
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, causal="bottom-right", **offsets)
    later = [r for r in report.results if not r.passed and r.sequence == 2]
    assert later and all(r.diagnosis[0].code == "sequence_leak" and "starts at key 0, not at cu_seqlens_k"
                         in r.diagnosis[0].message for r in later), attnstep.format_report(report)


def test_a_query_head_s_unnamed_gradient_borrows_its_k_v_head_s_cause():
    """Gradients only, the map h % Hk: dQ (a query head's) is unnamed where dK and dV (its K/V
    head's sums over the group) name kv_head_map; the verdict says so."""
    q, k, v, do, stages, offsets = varlen("kv_modulo", dict(SHAPE, seqused_k=None, heads=8, kv_heads=2))
    report = attnstep.check_arrays(q, k, v, {n: stages[n] for n in ("dQ", "dK", "dV")}, do=do, **offsets)
    verdict = attnstep.format_report(report).splitlines()[-1]
    assert "first failing stage: dQ" in verdict and "unnamed there; dK, failing on its K/V head 0, names kv_head_map" \
        in verdict, verdict


def test_tensors_that_do_not_fit_the_offsets_are_named():
    q, k, v, do, stages, offsets = varlen()
    with pytest.raises(ValueError, match="^q has 22 tokens, cu_seqlens_q ends at 21$"):
        attnstep.check_arrays(np.concatenate([q, q[:1]]), k, v, stages, do=do, **offsets)
    with pytest.raises(ValueError, match="^k has 23 tokens, cu_seqlens_k ends at 24$"):
        attnstep.check_arrays(q, k[:-1], v, stages, do=do, **offsets)
    with pytest.raises(ValueError, match=r"q is \(1, 21, 4, 16\): packed tensors are \(total, heads, dim\)"):
        attnstep.check_arrays(q[None], k, v, stages, do=do, **offsets)
    with pytest.raises(ValueError, match='layout="bhsd" with cu_seqlens_q'):
        attnstep.check_arrays(q, k, v, stages, do=do, layout="bhsd", **offsets)
    with pytest.raises(ValueError, match="cu_seqlens_q without cu_seqlens_k"):
        attnstep.check_arrays(q, k, v, stages, do=do, cu_seqlens_q=offsets["cu_seqlens_q"])
    with pytest.raises(ValueError, match="seqused_k\\[0\\] = 7 is outside 0..6"):
        attnstep.check_arrays(q, k, v, stages, do=do, **dict(offsets, seqused_k=[7, 4, 5, 5]))
    with pytest.raises(ValueError, match="stage 'QK' is an n x m block per sequence"):
        attnstep.check_arrays(q, k, v, {"QK": np.zeros((4, 21, 24))}, **offsets)
    with pytest.raises(ValueError, match='layout="thd" \\(packed sequences\\) needs cu_seqlens_q'):
        attnstep.check_arrays(q, k, v, stages, do=do, layout="thd")
    with pytest.raises(TypeError, match="cu_seqlens_k: expected a 1-d sequence of whole numbers"):
        attnstep.check_arrays(q, k, v, stages, do=do, **dict(offsets, cu_seqlens_k=[0.0, 6.5]))
    # A bool among ints would pass as 1 once NumPy made an int array of the list.
    cu_q = list(offsets["cu_seqlens_q"])
    with pytest.raises(TypeError, match="^cu_seqlens_q: expected .* got a list with a bool$"):
        attnstep.check_arrays(q, k, v, stages, do=do, **dict(offsets, cu_seqlens_q=[cu_q[0], True, *cu_q[2:]]))


def test_torch_varlen_tensors():
    torch = pytest.importorskip("torch", reason="torch is not installed: the NumPy tests cover the same path")
    q, k, v, do, stages, offsets = varlen()
    t = lambda x: torch.from_numpy(np.asarray(x))
    cu = {n: torch.tensor(x, dtype=torch.int32) for n, x in offsets.items()}
    assert attnstep.check_arrays(t(q), t(k), t(v), {n: t(x) for n, x in stages.items()}, do=t(do), **cu)
    q, k, v, do, stages, offsets = varlen("off_by_one")
    report = attnstep.check_arrays(t(q), t(k), t(v), {n: t(x) for n, x in stages.items()}, do=t(do), **cu)
    assert report.first_failure.sequence == 1


def test_a_packed_stage_of_the_wrong_shape_is_named_in_packed_terms():
    q, k, v, do, stages, offsets = varlen(shape=dict(SHAPE, heads=8, kv_heads=2))
    wrong = {"flash_output": (stages["flash_output"].transpose(1, 0, 2),
                              r"^flash_output is \(8, 21, 16\): expected \(total_q, heads, dim\) = \(21, 8, 16\)"),
             "flash_lse": (stages["flash_lse"].T, r"^flash_lse is \(21, 8\): expected \(heads, total_q\) = \(8, 21\)"),
             "dK": (np.zeros((24, 8, 16), f32), r"^dK is \(24, 8, 16\): expected \(total_k, kv_heads, dim\) = "
                                                r"\(24, 2, 16\)")}
    for name, (x, message) in wrong.items():
        with pytest.raises(ValueError, match=message + ", as packed sequences are$"):
            attnstep.check_arrays(q, k, v, {name: x}, do=do, **offsets)

"""check_arrays with a split-KV program's splits in flash-attn's layouts: out_accum (num_splits,
batch, heads, seqlen_q, d) and lse_accum (num_splits, batch, heads, seqlen_q); packed (thd):
(num_splits, total_q, heads, d) and (num_splits, heads, total_q). A correct program passes, a
combine that forgets the weights fails where it begins with its name, and arguments that do not
fit are refused in one line naming them."""
from __future__ import annotations

import numpy as np
import pytest

import attnstep
from helpers.split_programs import SplitCase, program
from verify.check.results import INHERITED

HEADS, KV_HEADS, D = 4, 2, 16


def _case(**kw) -> SplitCase:
    case = SplitCase(heads=HEADS, kv_heads=KV_HEADS, d=D, **kw)
    rng = np.random.default_rng(3)
    rows = {"Q": sum(case.seqlens_q) if case.packed else case.seq_q,
            "K": sum(case.seqlens_k) if case.packed else case.seq_k}
    for name, count in (("Q", HEADS), ("K", KV_HEADS), ("V", KV_HEADS)):
        for i in range(count):
            case.inputs[f"{name}{i}"] = rng.standard_normal((rows.get(name, rows["K"]), D)).astype(np.float32)
    return case


def _dense_arrays(case: SplitCase, bug=None):
    """q, k, v (1, H, N, d), the flash stages and flash-attn's out_accum, lse_accum."""
    res = program(case, bug)
    heads = lambda n, c: np.stack([case.inputs[f"{n}{i}"] for i in range(c)])[None]  # noqa: E731
    out_accum = np.stack([np.stack(res["split_output"][h]) for h in range(HEADS)], axis=1)[:, None]
    lse_accum = np.stack([np.stack(res["split_lse"][h])[..., 0] for h in range(HEADS)], axis=1)[:, None]
    stages = {"flash_output": np.stack(res["flash_output"])[None], "flash_lse": np.stack(res["flash_lse"])[None][..., 0]}
    return heads("Q", HEADS), heads("K", KV_HEADS), heads("V", KV_HEADS), stages, out_accum, lse_accum


def test_flash_attn_split_layouts_of_a_correct_program_pass():
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case)
    assert out_accum.shape == (5, 1, HEADS, 8, D) and lse_accum.shape == (5, 1, HEADS, 8)
    report = attnstep.check_arrays(q, k, v, stages, causal="bottom-right", split_output=out_accum,
                                   split_lse=lse_accum, split_size=8)
    assert report.passed, attnstep.format_report(report)
    assert report.stages == ["split_output", "split_lse", "flash_output", "flash_lse"]


def test_trailing_splits_of_no_key_are_left_out():
    """flash-attn launches num_splits splits whatever the keys fill: the trailing ones hold no key."""
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case)
    out_accum = np.concatenate([out_accum, np.zeros((3,) + out_accum.shape[1:], np.float32)])
    lse_accum = np.concatenate([lse_accum, np.full((3,) + lse_accum.shape[1:], -np.inf, np.float32)])
    report = attnstep.check_arrays(q, k, v, stages, causal="bottom-right", split_output=out_accum,
                                   split_lse=lse_accum, split_size=8)
    assert report.passed, attnstep.format_report(report)


def test_the_splits_alone_are_checked():
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, _, out_accum, lse_accum = _dense_arrays(case)
    report = attnstep.check_arrays(q, k, v, {}, causal="bottom-right", split_lse=lse_accum, split_size=8)
    assert report.passed and report.stages == ["split_lse"]


def test_a_combine_without_weights_is_named_and_the_splits_pass():
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case, "not_rescaled")
    report = attnstep.check_arrays(q, k, v, stages, causal="bottom-right", split_output=out_accum,
                                   split_lse=lse_accum, split_size=8)
    assert report.first_failing_stage == "flash_output"
    assert {d.code for r in report.stage_results("flash_output") for d in r.diagnosis} == {"split_not_rescaled"}
    assert all(r.passed for s in ("split_output", "split_lse") for r in report.stage_results(s))


def test_packed_thd_split_layouts_place_a_boundary_bug_in_the_splits():
    case = _case(split_size=4, seqlens_q=[2, 1, 3], seqlens_k=[9, 13, 5], causal="bottom-right")
    cu_q, cu_k = np.cumsum([0, 2, 1, 3]), np.cumsum([0, 9, 13, 5])
    for bug in (None, "overlap"):
        res = program(case, bug)
        q = np.stack([case.inputs[f"Q{i}"] for i in range(HEADS)], axis=1)          # (total_q, H, d)
        k = np.stack([case.inputs[f"K{i}"] for i in range(KV_HEADS)], axis=1)
        v = np.stack([case.inputs[f"V{i}"] for i in range(KV_HEADS)], axis=1)
        out_accum = np.stack([np.stack(res["split_output"][h]) for h in range(HEADS)], axis=2)  # (S, total_q, H, d)
        lse_accum = np.stack([np.stack(res["split_lse"][h])[..., 0] for h in range(HEADS)], axis=1)  # (S, H, total_q)
        stages = {"flash_output": np.stack(res["flash_output"], axis=1), "flash_lse": np.stack(res["flash_lse"])[..., 0]}
        report = attnstep.check_arrays(q, k, v, stages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="bottom-right",
                                       split_output=out_accum, split_lse=lse_accum, split_size=4)
        if bug is None:
            assert report.passed, attnstep.format_report(report)
            continue
        assert report.first_failing_stage == "split_output"
        assert "split_overlap" in {d.code for r in report.stage_results("split_output") for d in r.diagnosis}
        assert {r.status for r in report.stage_results("flash_output") if not r.passed} == {INHERITED}


def test_torch_tensors_are_accepted_as_the_other_arrays():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case)
    report = attnstep.check_arrays(*(torch.from_numpy(x) for x in (q, k, v)),
                                   {n: torch.from_numpy(x) for n, x in stages.items()}, causal="bottom-right",
                                   split_output=torch.from_numpy(out_accum), split_lse=torch.from_numpy(lse_accum),
                                   split_size=8)
    assert report.passed


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(split_lse="L"), ValueError, "pass split_size= too"),
    (dict(split_size=8), ValueError, "pass split_output= and/or split_lse="),
    (dict(split_lse="L", split_size=0), ValueError, "split_size = 0: must be a number of keys >= 1"),
    (dict(split_lse="L", split_size=True), TypeError, "split_size: expected a whole number"),
    (dict(split_lse="L", split_size=16), ValueError, "split_lse: shape (5, 1, 4, 8), expected (3, 1, 4, 8) "
                                                     "(num_splits, batch, heads, seqlen_q)"),
    (dict(stages={"split_lse": "L"}), ValueError, "pass the split stages as split_lse="),
])
def test_split_arguments_that_do_not_fit_are_refused_naming_them(kwargs, error, words):
    case = _case(split_size=8, causal="bottom-right")
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case)
    kwargs = {n: lse_accum if x == "L" else x for n, x in kwargs.items()}
    if "stages" in kwargs:
        kwargs["stages"] = {n: lse_accum for n in kwargs["stages"]}
    with pytest.raises(error) as raised:
        attnstep.check_arrays(q, k, v, kwargs.pop("stages", stages), causal="bottom-right", **kwargs)
    assert words in str(raised.value)


def test_a_left_out_split_of_one_key_is_named_where_its_effect_is_a_few_bounds():
    """M = 8 keys in splits of 7, logits in the tens: the last split's one key moves the output by a
    few dozen bounds only. Its reading, the combine of the program's own splits without it,
    reproduces the output to float32 rounding: named."""
    case = _case(split_size=7, seq_q=4, seq_k=8)
    for name in [n for n in case.inputs if n[0] in "QK"]:
        case.inputs[name] = (case.inputs[name] * 6).astype(np.float32)
    q, k, v, stages, out_accum, lse_accum = _dense_arrays(case, "loop_one_short")
    report = attnstep.check_arrays(q, k, v, stages, split_output=out_accum, split_lse=lse_accum, split_size=7)
    failed = [r for r in report.stage_results("flash_output") if not r.passed]
    assert failed and all(r.diagnosis and r.diagnosis[0].code == "split_left_out" for r in failed), \
        attnstep.format_report(report)

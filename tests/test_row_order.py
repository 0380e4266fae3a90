"""A row statistic written in (rows, heads) order into the (heads, rows) array the check reads (a
program that keeps its lse per token, every head together, and stores it as it is): named
rows_heads_transposed, dense and packed; a correct lse, or one wrong otherwise, is not."""
from __future__ import annotations

import numpy as np
import pytest

import attnstep
from helpers.packed_programs import PackedCase, program_stages

f32 = np.float32


def _dense(B=2, H=3, N=20, M=24, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(f32) for s in ((B, H, N, d), (B, H, M, d), (B, H, M, d)))
    s = (q @ k.swapaxes(-1, -2)).astype(f32) * f32(1 / np.sqrt(d))
    m = s.max(axis=-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(s - m).sum(axis=-1, dtype=f32))).astype(f32)  # (B, H, N)
    return q, k, v, lse


def _codes(report):
    return {r.diagnosis[0].code if r.diagnosis else None for r in report.results if not r.passed}


def _in_row_order(lse: np.ndarray) -> np.ndarray:
    """The (…, rows, heads) values stored into the (…, heads, rows) array, as they lie in memory."""
    return np.ascontiguousarray(lse.swapaxes(-1, -2)).reshape(lse.shape)


def test_a_dense_lse_in_rows_heads_order_is_named():
    q, k, v, lse = _dense()
    assert attnstep.check_arrays(q, k, v, {"flash_lse": lse})
    report = attnstep.check_arrays(q, k, v, {"flash_lse": _in_row_order(lse)})
    assert _codes(report) == {"rows_heads_transposed"}, attnstep.format_report(report)
    assert "flash_lse holds its values in (rows, heads) order" in attnstep.format_report(report)


def test_a_packed_lse_in_tokens_heads_order_is_named():
    case = PackedCase(seqlens_q=[5, 6, 7, 3], seqlens_k=[6, 4, 5, 9], heads=8, kv_heads=2)
    whole, _ = program_stages(case)
    q, k, v = (np.ascontiguousarray(case.inputs[n].transpose(1, 0, 2)) for n in ("Q", "K", "V"))  # (total, heads, d)
    offsets = dict(cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k)
    report = attnstep.check_arrays(q, k, v, {"flash_lse": _in_row_order(whole["flash_lse"][..., 0])}, **offsets)
    assert not report and _codes(report) == {"rows_heads_transposed"}, attnstep.format_report(report)


@pytest.mark.parametrize("wrong", ["noise", "log2"])
def test_an_lse_wrong_otherwise_is_not_named_so(wrong):
    q, k, v, lse = _dense()
    bad = lse + f32(0.01) * np.random.default_rng(1).standard_normal(lse.shape).astype(f32) if wrong == "noise" \
        else lse / f32(np.log(2))
    report = attnstep.check_arrays(q, k, v, {"flash_lse": bad})
    assert not report and "rows_heads_transposed" not in _codes(report)


def test_a_torch_lse_in_rows_heads_order_is_named():
    torch = pytest.importorskip("torch", reason="torch is not installed: the NumPy tests cover the same path")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, lse = _dense()
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device)  # noqa: E731
    report = attnstep.check_arrays(t(q), t(k), t(v), {"flash_lse": t(_in_row_order(lse))})
    assert _codes(report) == {"rows_heads_transposed"}, attnstep.format_report(report)


def test_a_wrong_decode_lse_fails_without_an_error():
    """One query a sequence (a decode step, the lse (B, H, 1)): there is no other order to read it
    in; a wrong lse is a FAIL report, not a refusal of a reordered array."""
    q, k, v, lse = _dense(N=1)
    report = attnstep.check_arrays(q, k, v, {"flash_lse": lse - f32(0.1)})
    assert not report and report.first_failing_stage == "flash_lse", attnstep.format_report(report)
    assert "rows_heads_transposed" not in _codes(report)


def test_a_column_lse_in_rows_heads_order_is_named():
    """An lse given as (B, H, N, 1) columns, written in (rows, heads) order: its trailing axis kept."""
    q, k, v, lse = _dense()
    report = attnstep.check_arrays(q, k, v, {"flash_lse": _in_row_order(lse)[..., None]})
    assert _codes(report) == {"rows_heads_transposed"}, attnstep.format_report(report)

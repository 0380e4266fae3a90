"""Rows that see no key, computed as 0/0: named for what they are, and a NaN that spreads from them
into a later stage is not taken as evidence for another bug."""
from __future__ import annotations

import numpy as np

import attnstep
from verify.stages import FLASH_GRAD_VALUES as FLASH_DV, FLASH_LSE, FLASH_OUTPUT, WEIGHTS

N, M, D = 12, 5, 8  # bottom-right with N > M: rows 0..6 see no key


def _unguarded_program(seed: int = 0):
    """A float32 softmax with no guard for a row whose every score is masked, and its backward."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for shape in ((N, D), (M, D), (M, D), (N, D)))
    s = (q @ k.T) * np.float32(D ** -0.5)
    s[np.arange(M)[None, :] > np.arange(N)[:, None] + (M - N)] = -np.inf
    with np.errstate(invalid="ignore"):
        mx = s.max(axis=1, keepdims=True)
        e = np.exp(s - mx)
        total = e.sum(axis=1, keepdims=True)
        p = e / total
        stages = {WEIGHTS: p, FLASH_OUTPUT: p @ v, FLASH_LSE: (mx + np.log(total))[:, 0], FLASH_DV: p.T @ do}
    return q, k, v, do, stages


def _diagnoses(report, stage):
    return [d for r in report.results if r.stage == stage and not r.passed for d in r.diagnosis]


def test_rows_that_see_no_key_computed_as_zero_over_zero_are_named():
    q, k, v, do, stages = _unguarded_program()
    report = attnstep.check_arrays(q, k, v, stages, do=do, causal="bottom-right")
    assert report.first_failing_stage == WEIGHTS
    for stage in (WEIGHTS, FLASH_OUTPUT, FLASH_LSE):
        found = _diagnoses(report, stage)
        assert found[0].code == "empty_rows_nan", (stage, [d.code for d in found])
        assert "rows 0..6" in found[0].message and "unwritten" not in [d.code for d in found]
    assert "holds -inf" in _diagnoses(report, FLASH_LSE)[0].message


def test_a_nan_spread_from_the_programs_own_rows_names_no_other_bug():
    """Every dV entry sums a NaN row: a candidate recomputed from the program's own NaN files is NaN
    too, which is no evidence for the bug it stands for (a missing mask matched it exactly)."""
    q, k, v, do, stages = _unguarded_program()
    assert np.isnan(stages[FLASH_DV]).all()
    report = attnstep.check_arrays(q, k, v, stages, do=do, causal="bottom-right")
    codes = {d.code for d in _diagnoses(report, FLASH_DV)}
    assert "nonfinite" in codes and not codes & {"mask_missing", "mask_file_ignored", "mask_offset"}


def test_guarded_rows_pass():
    q, k, v, do, stages = _unguarded_program()
    guarded = {n: np.nan_to_num(a, nan=-np.inf if n == FLASH_LSE else 0.0) for n, a in stages.items()}
    guarded[FLASH_DV] = np.nan_to_num(stages[WEIGHTS], nan=0.0).T @ do
    assert attnstep.check_arrays(q, k, v, guarded, do=do, causal="bottom-right").passed


def test_nan_rows_that_see_keys_are_not_taken_for_rows_that_see_none():
    """Rows whose reference is 0 because their dO is (not the mask): NaN there is no 0/0 of a row
    that sees no key."""
    q, k, v, do, _ = _unguarded_program()
    do[3:6] = 0.0
    d = (np.full((N, 1), np.nan, np.float32))
    d[:3] = d[6:] = 1.0  # (wrong anyway: the name is what is asked)
    report = attnstep.check_arrays(q, k, v, {"D": d}, do=do)
    assert "empty_rows_nan" not in [x.code for x in _diagnoses(report, "D")]


def test_an_lse_never_written_beside_an_output_is_no_row_without_weight():
    """An lse buffer left at −inf beside a correct output, and gradients never computed (zeros):
    the gradients are not taken as right for an lse whose rows hold no weight."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for shape in ((16, 8), (16, 8), (16, 8), (16, 8)))
    s = (q.astype(np.float64) @ k.T) / np.sqrt(8)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    stages = {FLASH_OUTPUT: (p @ v).astype(np.float32), FLASH_LSE: np.full(16, -np.inf, np.float32),
              "flash_dQ": np.zeros((16, 8), np.float32), "flash_dK": np.zeros((16, 8), np.float32),
              FLASH_DV: np.zeros((16, 8), np.float32)}
    report = attnstep.check_arrays(q, k, v, stages, do=do)
    assert all(r.status == "FAIL" for r in report.results if r.stage.startswith("flash_d")), \
        [(r.stage, r.status) for r in report.results]

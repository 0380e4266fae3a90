"""Reference-free checks: silent on correct float32 results, each violation found where planted."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.simulated_float32 import flash32, sample, simulate
from verify.check.invariants import check_invariants, head_context
from verify.stages import INPUT_NAMES, Dims

N, M, D = 24, 40, 16


def make(causal=False, dist="normal", seed=0):
    rng = np.random.default_rng(seed)
    Q, K, V = (sample(rng, dist, sh) for sh in ((N, D), (M, D), (M, D)))
    scale = float(np.float32(1 / np.sqrt(D)))
    got = simulate(Q, K, V, scale, causal)
    O, lse = flash32(Q, K, V, scale, causal, 16)
    got.update(flash_output=O, flash_lse=lse, Q=Q, K=K, V=V, KT=K.T)
    got = {k: np.asarray(v, np.float64) for k, v in got.items()}
    ctx = head_context(Dims(1, 1, N, M, D, D), scale, causal, inputs={n: got[n] for n in INPUT_NAMES}, got=got)
    return got, ctx


def check(stage, got, ctx):
    return check_invariants(stage, got[stage], ctx)


CORRECT = [(c, d) for c in (False, True) for d in ("uniform", "normal", "large")]


@pytest.mark.parametrize("causal,dist", CORRECT, ids=[f"{'causal' if c else 'full'}-{d}" for c, d in CORRECT])
def test_correct_results_violate_nothing(causal, dist):
    for seed in range(3):
        got, ctx = make(causal, dist, seed)
        for stage in ("Q", "K", "V", "KT", "QK", "QK_scaled", "attention_weights", "output",
                      "flash_output", "flash_lse"):
            assert check(stage, got, ctx) == [], stage


def _plant(stage, fn, causal=False):
    got, ctx = make(causal)
    bad = dict(got)
    bad[stage] = fn(got[stage].copy(), got)
    ctx.got = bad
    return check_invariants(stage, bad[stage], ctx)


def _set(x, idx, v):
    x[idx] = v
    return x


PLANTS = [
    ("weights-negative", "attention_weights", False, lambda x, g: _set(x, (2, 3), -1e-3), "negative_weights"),
    ("weights-row-sum", "attention_weights", False, lambda x, g: _set(x, (4, 5), x[4, 5] + 1e-5), "row_sum"),
    ("weights-masked-nonzero", "attention_weights", True, lambda x, g: _set(x, (0, 5), 1e-3), "mask_missing"),
    ("scores-masked-finite", "QK_scaled", True, lambda x, g: _set(x, (1, 7), 0.5), "mask_missing"),
    ("KT-not-transpose", "KT", False, lambda x, g: _set(x, (1, 2), x[1, 2] + 1e-6), "not_transpose"),
    ("Q-echo-one-ulp", "Q", False, lambda x, g: _set(x, (3, 3), np.nextafter(np.float32(x[3, 3]), np.float32(9))),
     "echo_mismatch"),
    ("QK-nan", "QK", False, lambda x, g: _set(x, (6, 1), np.nan), "nonfinite"),
    ("output-inf", "output", False, lambda x, g: _set(x, (6, 1), np.inf), "nonfinite"),
    ("scores-neg-inf-unmasked", "QK_scaled", True, lambda x, g: _set(x, (9, 2), -np.inf), "nonfinite"),
    ("flash-vs-output", "flash_output", False, lambda x, g: _set(x, (5, 5), x[5, 5] * (1 + 1e-4)), "flash_vs_output"),
    ("lse-vs-scores", "flash_lse", False, lambda x, g: x + 1e-4, "lse_vs_scores"),
    ("lse-nan", "flash_lse", False, lambda x, g: _set(x, (0, 0), np.nan), "nonfinite"),
]


@pytest.mark.parametrize("stage,causal,fn,code", [p[1:] for p in PLANTS], ids=[p[0] for p in PLANTS])
def test_planted_violation_is_found(stage, causal, fn, code):
    found = _plant(stage, fn, causal)
    # a planted weight also breaks its row's sum; nothing else may fire
    assert code in [v.code for v in found], [(v.code, v.message) for v in found]
    assert {v.code for v in found} <= {code, "row_sum"}
    v = next(v for v in found if v.code == code)
    assert v.count >= 1 and "\n" not in v.message and stage in v.message


def test_violation_names_its_first_location():
    found = _plant("QK", lambda x, g: _set(_set(x, (6, 1), np.nan), (9, 0), np.nan))
    assert found[0].where == (6, 1) and found[0].count == 2


def test_flash_checks_need_the_stage_path_stage():
    got, ctx = make()
    bad = got["flash_output"] + 1.0
    ctx.got = {k: v for k, v in got.items() if k != "output"}
    assert check_invariants("flash_output", bad, ctx) == []  # nothing to agree with: skipped
    ctx.got = got
    assert [v.code for v in check_invariants("flash_output", bad, ctx)] == ["flash_vs_output"]

"""Each diagnosis code found on its planted pattern, and nothing found on correct or noisy results.

Patterns are planted into the float64 reference of random Q/K/V (what a buggy binary would have
written), with the isolated reference and the tolerance model's bound as verify.check.compare passes them.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers.simulated_float32 import flash32, sample, simulate
from verify.check import tolerance
from verify.check.reference import compute_stage, reference_chain, softmax_rows
from verify.diagnose.hypotheses import Suspect, diagnose
from verify.stages import FORWARD_STAGES, STAGES, Dims

HEADS = 4
SHAPES = {"square": (32, 32, 16), "rect": (24, 40, 16)}


def make_case(shape="rect", causal=False, dist="normal", seed=0):
    """{head: chain} of float64 references, plus dims and scale."""
    N, M, d = SHAPES[shape]
    rng = np.random.default_rng(seed)
    scale = float(np.float32(1 / np.sqrt(d)))
    chains = {}
    for h in range(HEADS):
        qkv = {n: sample(rng, dist, sh).astype(np.float64) for n, sh in (("Q", (N, d)), ("K", (M, d)), ("V", (M, d)))}
        chains[h] = reference_chain(qkv, scale, causal, list(FORWARD_STAGES))
        chains[h].update(qkv)
    return chains, Dims(1, HEADS, N, M, d, d), scale


def run(stage, got, chains, dims, scale, causal, head=1, tiles=None):
    """diagnose() as verify.check.compare calls it: isolated src = the reference chain's upstream."""
    src = {n: chains[head][n] for n in (("Q", "K", "V") if STAGES[stage].flash else STAGES[stage].inputs)}
    want = compute_stage(stage, src, scale, causal)
    bound = tolerance.stage_bound(stage, src, want, scale=scale, causal=causal)
    ctx = Suspect(dims=dims, scale=scale, causal=causal, head=head, src=src,
                  ref_of_head=lambda h: chains[h][stage], flash_tiles=tiles, bound=bound)
    return diagnose(stage, got, want, ctx)


def codes(found):
    return [d.code for d in found]


def _col_major_K(c, scale):
    N, d = c["Q"].shape
    return c["Q"] @ c["K"].reshape(d, -1)


def _unwritten_rows(c, stage):
    got = c[stage].copy()
    got[8:16, :] = 0.0
    return got


def _nan_rect(c, stage):
    got = c[stage].copy()
    got[4:9, 3:12] = np.nan
    return got


def _one_nan(c, stage):
    got = c[stage].copy()
    got[5, 7] = np.nan
    return got


def _boundary_rows(c, stage, p=4):
    got = c[stage].copy()
    got[p - 1::p, :] += 0.05 * np.abs(got[p - 1::p, :]).max()
    return got


def _tail_tile(c, stage, p=16):
    got = c[stage].copy()
    n = got.shape[0]
    got[(n // p) * p:, :] *= 1.1
    return got


def _mask_shift(c, scale, k):
    S = c["QK"] * scale
    return np.where(np.triu(np.ones(S.shape, bool), k + 1), -np.inf, S)


def _flash_unmasked(c, scale):
    return softmax_rows(c["QK"] * scale) @ c["V"]


def _flash_bottom_right(c, scale):
    S = c["QK"] * scale
    N, M = S.shape
    S = np.where(np.triu(np.ones(S.shape, bool), M - N + 1), -np.inf, S)
    return softmax_rows(S) @ c["V"]


def _lse_base2(c):
    """flash_lse as a float32 kernel working in base 2 writes it: log2 Σ 2^(s·log2 e)."""
    return (c["flash_lse"] / np.log(2)).astype(np.float32).astype(np.float64)


# (id, stage, shape, causal, builder(chain, scale) -> got, expected code, detail check)
PLANTS = [
    ("QK-transposed-square", "QK", "square", False, lambda c, s: c["QK"].T, "transposed", None),
    ("QK-transposed-rect", "QK", "rect", False, lambda c, s: c["QK"].T.reshape(c["QK"].shape), "transposed", None),
    ("QK-layout-colmajor-write", "QK", "rect", False, lambda c, s: c["QK"].T.reshape(c["QK"].shape), "layout", None),
    ("QK-layout-K-lda", "QK", "rect", False, _col_major_K, "layout", lambda d: "K" in d["how"]),
    ("output-layout-V-colmajor", "output", "rect", False,
     lambda c, s: c["attention_weights"] @ c["V"].reshape(c["V"].shape[1], -1).T, "layout", lambda d: "V" in d["how"]),
    ("QK-scaled-sqrt-dk", "QK", "rect", False, lambda c, s: c["QK"] * 4.0, "scaled", lambda d: "√d_k" in d["names"]),
    ("QK_scaled-twice", "QK_scaled", "rect", False, lambda c, s: c["QK_scaled"] * s, "scaled",
     lambda d: any("twice" in n for n in d["names"])),
    ("QK_scaled-missing", "QK_scaled", "rect", True, lambda c, s: np.where(np.isinf(c["QK_scaled"]), -np.inf, c["QK"]),
     "scaled", lambda d: any("missing" in n for n in d["names"])),
    ("flash_output-scale-twice", "flash_output", "rect", False,
     lambda c, s: softmax_rows(c["QK"] * s * s) @ c["V"], "scaled", lambda d: "scale applied twice" in d["names"]),
    ("attention_weights-softmax-columns", "attention_weights", "square", False,
     lambda c, s: softmax_rows(c["QK_scaled"].T).T, "softmax_axis", None),
    ("attention_weights-softmax-columns-rect", "attention_weights", "rect", False,
     lambda c, s: softmax_rows(c["QK_scaled"].T).reshape(c["QK_scaled"].shape), "softmax_axis", None),
    ("output-unwritten-rows", "output", "rect", False, lambda c, s: _unwritten_rows(c, "output"), "unwritten",
     lambda d: d["rows"] == [8, 15]),
    ("QK-unwritten-nan-block", "QK", "rect", False, lambda c, s: _nan_rect(c, "QK"), "unwritten",
     lambda d: d["rows"] == [4, 8] and d["cols"] == [3, 11] and d["values"] == ["NaN"]),
    ("QK-nonfinite", "QK", "rect", False, lambda c, s: _one_nan(c, "QK"), "nonfinite", lambda d: d["first"] == [5, 7]),
    ("QK_scaled-mask-missing", "QK_scaled", "rect", True, lambda c, s: c["QK"] * s, "mask_missing", None),
    ("attention_weights-mask-missing", "attention_weights", "rect", True,
     lambda c, s: softmax_rows(c["QK"] * s), "mask_missing", None),
    ("flash_output-mask-missing", "flash_output", "rect", True, lambda c, s: _flash_unmasked(c, s), "mask_missing", None),
    ("QK_scaled-mask-offset+1", "QK_scaled", "rect", True, lambda c, s: _mask_shift(c, s, 1), "mask_offset",
     lambda d: d["offset"] == 1),
    ("QK_scaled-mask-offset-2", "QK_scaled", "rect", True, lambda c, s: _mask_shift(c, s, -2), "mask_offset",
     lambda d: d["offset"] == -2),
    ("flash_output-bottom-right-mask", "flash_output", "rect", True, lambda c, s: _flash_bottom_right(c, s),
     "mask_offset", lambda d: d["offset"] == 16),
    ("output-tile-boundary-rows", "output", "square", False, lambda c, s: _boundary_rows(c, "output"),
     "tile_boundary", lambda d: d["period"] == 4),
    ("flash_output-tail-tile", "flash_output", "rect", False, lambda c, s: _tail_tile(c, "flash_output"),
     "tile_boundary", lambda d: d["period"] == 16 and d["range"] == [16, 23]),
    ("flash_lse-log2", "flash_lse", "rect", False, lambda c, s: _lse_base2(c), "lse_log2", None),
    ("flash_lse-log2-causal", "flash_lse", "square", True, lambda c, s: _lse_base2(c), "lse_log2", None),
]


@pytest.mark.parametrize("stage,shape,causal,build,code,check", [p[1:] for p in PLANTS], ids=[p[0] for p in PLANTS])
def test_planted_pattern_is_named(stage, shape, causal, build, code, check):
    chains, dims, scale = make_case(shape, causal)
    got = build(chains[1], scale)
    found = run(stage, got, chains, dims, scale, causal, tiles=(16, 16))
    assert code in codes(found), f"{code} not in {[(d.code, d.message) for d in found]}"
    d = next(x for x in found if x.code == code)
    assert "\n" not in d.message and stage in d.message
    if check is not None:
        assert check(d.detail), d.detail
    import json
    json.dumps(d.detail)  # JSON-able


def test_head_permuted_names_the_head():
    chains, dims, scale = make_case("rect")
    found = run("output", chains[3]["output"], chains, dims, scale, False, head=1)
    assert codes(found)[0] == "head_permuted"
    assert found[0].detail["matches_head"] == 3


def test_transposed_is_most_confident_and_message_reads_well():
    chains, dims, scale = make_case("square")
    found = run("QK", chains[1]["QK"].T, chains, dims, scale, False)
    assert found[0].code == "transposed"
    assert found[0].message.startswith("QK looks transposed: got[i,j] ≈ want[j,i] (max diff")


def _correct_float32(chains, dims, scale, causal, head=1):
    c = chains[head]
    got = simulate(c["Q"], c["K"], c["V"], scale, causal)
    O, lse = flash32(c["Q"], c["K"], c["V"], scale, causal, 16)
    got.update(flash_output=O, flash_lse=lse)
    return {k: np.asarray(v, np.float64) for k, v in got.items()}


NO_FIRE = [(shape, causal, dist) for shape in SHAPES for causal in (False, True) for dist in ("uniform", "normal", "large")]


@pytest.mark.parametrize("shape,causal,dist", NO_FIRE, ids=[f"{s}-{'causal' if c else 'full'}-{d}" for s, c, d in NO_FIRE])
def test_nothing_fires_on_correct_or_noisy_results(shape, causal, dist):
    """Correct float32 results, and the same with noise of 3 tolerance widths on 5% of the elements:
    no hypothesis may claim a bug pattern (a noisy result is simply out of tolerance)."""
    chains, dims, scale = make_case(shape, causal, dist, seed=5)
    got_all = _correct_float32(chains, dims, scale, causal)
    rng = np.random.default_rng(9)
    for stage in ("QK", "QK_scaled", "attention_weights", "output", "flash_output", "flash_lse"):
        got = got_all[stage]
        assert run(stage, got, chains, dims, scale, causal, tiles=(16, 16)) == []
        src = {n: chains[1][n] for n in (("Q", "K", "V") if STAGES[stage].flash else STAGES[stage].inputs)}
        want = compute_stage(stage, src, scale, causal)
        bound = tolerance.stage_bound(stage, src, want, scale=scale, causal=causal)
        hit = (rng.random(got.shape) < 0.05) & np.isfinite(want)
        noisy = np.where(hit, want + 3 * bound * rng.choice([-1.0, 1.0], got.shape), got)
        found = run(stage, noisy, chains, dims, scale, causal, tiles=(16, 16))
        assert found == [], f"{stage}: {[(d.code, d.message) for d in found]}"
        # Without the run's tile sizes (no run.toml) no tile size may be guessed either.
        found = run(stage, noisy, chains, dims, scale, causal, tiles=None)
        assert found == [], f"{stage} (no tiles known): {[(d.code, d.message) for d in found]}"


@pytest.mark.parametrize("rows", [slice(1, None, 2), slice(2, 4), slice(0, 2)], ids=["every-other-row", "rows-2-3", "rows-0-1"])
def test_no_tile_size_is_invented_without_the_runs_tiles(rows):
    """Errors on alternating rows or on a pair of rows fit a 'tile' of 2, which no kernel tiles by:
    without the run's own tile sizes nothing may be named a tile boundary."""
    chains, dims, scale = make_case("square", False)
    got = chains[1]["output"].copy()
    got[rows, :] += 0.05 * np.abs(got).max()
    assert "tile_boundary" not in codes(run("output", got, chains, dims, scale, False, tiles=None))


@pytest.mark.parametrize("shape,rows,period,words", [
    ("rect", (16, 24), 16, "the tail tile"),        # 24 rows: a dropped partial tail of a 16-row tile
    ("square", (8, 16), 8, "tile 1 "),               # exactly one 8-row tile
    ("square", (16, 32), 16, "tile 1 "),             # exactly one 16-row tile
], ids=["tail-of-16", "one-8-tile", "one-16-tile"])
def test_a_wrong_block_names_the_tile_a_kernel_would_have(shape, rows, period, words):
    """Without the run's tile sizes, a block that 4 divides is not '2 tiles of 4': the size named
    is the one that makes it a partial tail tile, else one whole tile."""
    chains, dims, scale = make_case(shape, False)
    got = chains[1]["flash_output"].copy()
    got[rows[0]:rows[1], :] *= 1.1
    found = [d for d in run("flash_output", got, chains, dims, scale, False, tiles=None) if d.code == "tile_boundary"]
    assert found and found[0].detail["period"] == period and words in found[0].message, \
        [(d.code, d.message) for d in found]


def _weights_mask_shift(c, scale, k, guarded):
    """The softmax of a causal mask shifted by k; a row with no visible key is NaN (0/0), or 0 in a
    program that guards the division."""
    with np.errstate(all="ignore"):
        w = softmax_rows(_mask_shift(c, scale, k))
    return np.nan_to_num(w, nan=0.0) if guarded else w


@pytest.mark.parametrize("shape", ["rect", "square"])
@pytest.mark.parametrize("k", [1, -1, -2])
@pytest.mark.parametrize("guarded", [False, True], ids=["nan-row", "zero-row"])
def test_a_shifted_mask_in_the_weights_is_named_first_with_its_direction(shape, k, guarded):
    """The diagonal masked too (-1) leaves row 0 with no visible key: its NaN (or zeros) and the
    block of renormalized rows are the shift's doing, not a finding of their own."""
    chains, dims, scale = make_case(shape, True)
    found = run("attention_weights", _weights_mask_shift(chains[1], scale, k, guarded), chains, dims, scale, True)
    assert found and found[0].code == "mask_offset" and found[0].detail["offset"] == k, \
        [(d.code, d.message) for d in found]
    assert "tile_boundary" not in codes(found) and "unwritten" not in codes(found)
    words = {1: "each query sees 1 key past the diagonal", -1: "the diagonal masked too: each query sees 1 key fewer",
             -2: "each query sees 2 keys fewer"}[k]
    assert words in found[0].message


def test_nonfinite_counts_only_where_the_reference_is_finite():
    """NaN inputs (check --allow-nonfinite) make NaN reference rows: a NaN there is no finding."""
    chains, dims, scale = make_case()
    chains[1]["Q"][2, 0] = np.nan  # reference row 2 of QK is NaN
    got = compute_stage("QK", {n: chains[1][n] for n in STAGES["QK"].inputs}, scale, False)
    got[5, 7] = np.nan
    found = [d for d in run("QK", got, chains, dims, scale, False) if d.code == "nonfinite"]
    assert len(found) == 1 and found[0].detail["nan"] == 1 and found[0].detail["first"] == [5, 7]


LSE_NOT_BASE_2 = {
    "correct": lambda want, bound, rng: want,
    "noisy": lambda want, bound, rng: want + 3 * bound * rng.choice([-1.0, 1.0], want.shape),
    "other-factor": lambda want, bound, rng: want * 1.5,
    "base-2-and-noisy": lambda want, bound, rng: want / np.log(2) + 1e3 * bound * rng.standard_normal(want.shape),
}


@pytest.mark.parametrize("how", list(LSE_NOT_BASE_2))
def test_lse_log2_needs_the_base_2_factor(how):
    """lse_log2 fires on want·log2(e) alone: not on a correct, noisy, otherwise scaled lse, nor on a
    base-2 lse that carries far more than rounding error."""
    chains, dims, scale = make_case("rect", False)
    src = {n: chains[1][n] for n in ("Q", "K", "V")}
    want = compute_stage("flash_lse", src, scale, False)
    bound = tolerance.stage_bound("flash_lse", src, want, scale=scale, causal=False)
    got = LSE_NOT_BASE_2[how](want, bound, np.random.default_rng(3))
    assert "lse_log2" not in codes(run("flash_lse", got, chains, dims, scale, False))


def test_an_exact_candidate_does_not_make_every_near_one_loose():
    """A candidate 100 times looser than the closest is dropped, but an exact match (max diff 0)
    drops no candidate that differs from it by a float32 rounding of got."""
    from verify.diagnose.hypotheses import Diagnosis, _closest
    exact, near, loose = (Diagnosis(c, c, {"max_diff": d}) for c, d in (("a", 0.0), ("b", 5e-6), ("c", 1.0)))
    assert [d.code for d in _closest([exact, near, loose], 1e-7)] == ["a", "b"]


def test_a_mask_reproduced_to_rounding_is_named_where_the_widest_bound_is_wide():
    """A shifted mask that moves the output by less than a hundred widths of the stage's widest
    bound (over many keys, or where one entry's bound is wide) is still the cause when got
    reproduces it to its own rounding, far closer than it lies to the reference."""
    chains, dims, scale = make_case("square", causal=True)
    c = chains[1]
    s = np.where(np.triu(np.ones((32, 32), bool), k=2), -np.inf, c["Q"] @ c["K"].T * scale)  # one key past
    got = (softmax_rows(s) @ c["V"]).astype(np.float32).astype(np.float64)
    src = {n: c[n] for n in ("Q", "K", "V")}
    want = compute_stage("flash_output", src, scale, True)
    bound = tolerance.stage_bound("flash_output", src, want, scale=scale, causal=True)
    wide = bound.copy()
    wide[0, 0] = np.abs(got - want).max()  # one entry's bound as wide as the whole change
    for b in (bound, wide):
        ctx = Suspect(dims=dims, scale=scale, causal=True, head=1, src=src, bound=b)
        assert codes(diagnose("flash_output", got, want, ctx))[:1] == ["mask_offset"]


def test_wrong_scales_and_masks_are_recomputed_whole_only_where_the_worst_rows_fit(monkeypatch):
    """Each wrong scale and each candidate mask is first tried on got's four worst rows; the whole
    stage is recomputed only for a candidate those rows fit (the same names, far less work on a
    long head's slab)."""
    from verify.diagnose import masks, scales
    chains, dims, scale = make_case("square", causal=True)
    c = chains[1]
    whole = {"scale": 0, "mask": 0}
    recomputed, explains_rows = scales.recomputed, masks._explains_empty_rows
    monkeypatch.setattr(scales, "recomputed", lambda *a: whole.__setitem__("scale", whole["scale"] + 1) or recomputed(*a))
    monkeypatch.setattr(masks, "_explains_empty_rows",
                        lambda *a: whole.__setitem__("mask", whole["mask"] + 1) or explains_rows(*a))
    s = c["Q"] @ c["K"].T  # the scale missing
    got = softmax_rows(np.where(np.triu(np.ones((32, 32), bool), k=1), -np.inf, s)) @ c["V"]
    assert codes(run("flash_output", got.astype(np.float32).astype(np.float64), chains, dims, scale, True))[0] == "scaled"
    assert whole["scale"] == 1, whole
    whole.update(scale=0, mask=0)
    s = np.where(np.triu(np.ones((32, 32), bool), k=4), -np.inf, c["Q"] @ c["K"].T * scale)  # three keys past
    got = softmax_rows(s) @ c["V"]
    assert codes(run("flash_output", got.astype(np.float32).astype(np.float64), chains, dims, scale, True))[0] == \
        "mask_offset"
    assert whole["mask"] == 1, whole


def test_a_factor_is_named_only_where_it_takes_the_failure_away():
    """got ≈ f·want within the match's widths is a `scaled` stage only where f·want lies much closer
    to got than want does: errors that lean one way (a gradient from another head's D) fit a
    factor near 1 as loosely as they fit the reference, and are no factor."""
    rng = np.random.default_rng(0)
    want = rng.standard_normal((64, 32))
    width = 0.01
    ctx = Suspect(bound=np.full(want.shape, width))
    # a true factor: f·want reproduces got to its rounding
    found = diagnose("output", 1.25 * want + width * 0.1 * rng.standard_normal(want.shape), want, ctx)
    assert [d.code for d in found][:1] == ["scaled"] and abs(found[0].detail["factor"] - 1.25) < 1e-3
    # errors of up to 6 widths, positive on the large elements: a factor 1 + ε fits within 8 widths
    # but leaves got as far from f·want as from want
    lean = 6 * width * np.sign(want) * (np.abs(want) > 1.0) * rng.random(want.shape)
    got = want + lean
    f = float(got.ravel() @ want.ravel()) / float(want.ravel() @ want.ravel())
    assert np.abs(got - f * want).max() <= 8 * width and abs(f - 1) > 1e-3
    assert "scaled" not in [d.code for d in diagnose("output", got, want, ctx)]


def test_the_closest_reading_within_its_bounds_is_named_and_none_where_two_fit_alike():
    """best_within_bound: of the candidates got lies within two bounds of, the closest, where it lies
    four bounds from the reference at four elements at least and no other fits within 1.5× as
    closely (a runner-up just past two bounds counts)."""
    from verify.diagnose.base import best_within_bound
    want, bound = np.zeros(8), np.ones(8)
    got = np.full(8, 10.0)
    assert best_within_bound(got, want, bound, [("A", got - 1.9)]) == ("A", pytest.approx(1.9))
    assert best_within_bound(got, want, bound, [("A", got - 1.9), ("B", got + 0.5)]) == ("B", pytest.approx(0.5))
    assert best_within_bound(got, want, bound, [("A", got - 1.9), ("B", got + 2.05)]) is None
    assert best_within_bound(got, want, bound, [("A", got - 2.5)]) is None  # (beyond two bounds)
    near = np.where(np.arange(8) < 3, 9.5, 1.0)  # (four bounds from want at three elements only)
    assert best_within_bound(np.where(np.arange(8) < 3, 10.0, 1.5), want, bound, [("A", near)]) is None


def test_zeros_where_values_belong_are_said_to_be_unwritten_or_computed_over_no_key():
    """Zeros alone are also what a row that sees no key holds (a mask that hid every key): the
    message says both; NaN is said to be unwritten alone."""
    chains, dims, scale = make_case()
    zeros = next(d for d in run("output", _unwritten_rows(chains[1], "output"), chains, dims, scale, False)
                 if d.code == "unwritten")
    assert "never written, or computed as if no key were seen" in zeros.message
    nan = next(d for d in run("QK", _nan_rect(chains[1], "QK"), chains, dims, scale, False) if d.code == "unwritten")
    assert "never written (" in nan.message and "no key" not in nan.message


def test_a_head_s_bug_carries_no_tile_pattern_beside_it():
    """A K/V group not summed (or another head read) is wrong everywhere; the tile lines its errors
    happen to fill are no second finding."""
    from verify.diagnose.hypotheses import Diagnosis, _settled
    found = [Diagnosis("kv_group_not_summed", "the group's last part only", {"max_diff": 1e-7}, 0.95),
             Diagnosis("tile_boundary", "errors fill tile 1", {"period": 4}, 0.75)]
    assert [d.code for d in _settled(found, set(), 0.0)] == ["kv_group_not_summed"]

"""The tolerance model against simulated correct float32 computations, and its tightness.

A "correct computation" is the stage done in numpy float32 arithmetic, as the binary would do it,
in several summation orders: index order (the CPU backend's loops), reverse, FMA, BLAS (SIMD
blocks), pairwise, 8 interleaved accumulators; softmax with a sequential or a pairwise row sum; a
tiled online-softmax flash accumulating key by key. Zero false failures are required over all of
them (hundreds of computations, every generator distribution), and a single element off by 10×
the typical error (the RMS error of the index-order computation) must fail.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from verify.check import tolerance as T
from verify.check.reference import compute_stage, reference_chain
from verify.model.softmax import EqualTerms, correlated_sum

from helpers.simulated_float32 import (MATMULS, flash32, mm_pairwise, mm_seq, sample, scale_mask32, simulate,
                                       softmax32)

f32 = np.float32


def error(got, ref):
    got = np.asarray(got, np.float64)
    same = got == ref
    with np.errstate(invalid="ignore"):
        return np.where(same, 0.0, np.abs(got - ref))


def iso_bound(stage, got_all, inputs, scale, causal, backend="cpu"):
    """(ref, bound) of `stage` from the binary's own upstream (isolated checking)."""
    from verify.stages import STAGES
    src = {n: np.asarray(got_all.get(n, inputs.get(n)), np.float64) for n in STAGES[stage].inputs}
    ref = compute_stage(stage, src, scale, causal)
    return ref, T.stage_bound(stage, src, ref, scale=scale, causal=causal, backend=backend)


SHAPES = [(8, 8, 16), (17, 33, 16), (32, 48, 32), (40, 24, 64)]
DISTS = ["uniform", "normal", "large"]
STAGE_PATH = ["QK", "QK_scaled", "attention_weights", "output"]


def seed_of(*parts):
    """A seed from the case's parameters that does not depend on PYTHONHASHSEED (hash() of a
    tuple with strings does: with PYTHONHASHSEED=3 N40-M24-d64-normal-full drew data on which
    OpenBLAS's sgemm exceeded the QK bound of the time, 1.10×, and CI was flaky)."""
    return zlib.crc32(repr(parts).encode())


def case_id(shape, dist, causal):
    return f"N{shape[0]}-M{shape[1]}-d{shape[2]}-{dist}-{'causal' if causal else 'full'}"


CASES = [(s, d, c) for s in SHAPES for d in DISTS for c in (False, True)]


@pytest.mark.parametrize("shape,dist,causal", CASES, ids=[case_id(*c) for c in CASES])
def test_no_false_failures_stage_path(shape, dist, causal):
    """Every stage-path stage, isolated and chained, in six summation orders: nothing fails."""
    N, M, d = shape
    rng = np.random.default_rng(seed_of(shape, dist, causal))
    scale = float(f32(1 / np.sqrt(d)))
    worst = 0.0
    for order in MATMULS:
        Q, K, V = (sample(rng, dist, sh) for sh in ((N, d), (M, d), (M, d)))
        inputs = {"Q": Q, "K": K, "V": V}
        got = simulate(Q, K, V, scale, causal, order, seq_softmax=order != "pairwise")
        chain = reference_chain({n: x.astype(np.float64) for n, x in inputs.items()}, scale, causal,
                                ["Q", "K", "V"] + STAGE_PATH)
        for stage in STAGE_PATH:
            ref, bound = iso_bound(stage, got, inputs, scale, causal)
            cb = T.chained_bound(stage, chain, scale=scale, causal=causal, backend="cpu")
            for want, allowed, how in ((ref, bound, "isolated"), (chain[stage], cb, "chained")):
                err = error(got[stage], want)
                assert (err <= allowed).all(), (
                    f"{stage} {how} {order}: {(err > allowed).sum()} false failures, "
                    f"max err/bound {np.max(err / np.where(allowed > 0, allowed, np.inf)):.2f}")
                with np.errstate(invalid="ignore", divide="ignore"):
                    worst = max(worst, float(np.max(np.where(allowed > 0, err / allowed, 0.0))))
    assert worst < 0.9  # headroom: the worst correct error uses < 90% of the bound


# --- the dot products in every summation order a float32 GEMM uses ------------------------------

def mm_fma_lanes(A, B, lanes):
    """`lanes` interleaved FMA accumulators (k ≡ i mod lanes), then added in order: numpy's
    OpenBLAS sgemm (Haswell kernel) sums some row tiles so, with lanes = 2."""
    A, B = A.astype(np.float64), B.astype(np.float64)
    acc = [np.zeros((A.shape[0], B.shape[1]), f32) for _ in range(lanes)]
    for k in range(A.shape[1]):  # float64 product exact, one rounding per FMA
        acc[k % lanes] = (acc[k % lanes] + A[:, k, None] * B[None, k, :]).astype(f32)
    out = acc[0]
    for a in acc[1:]:
        out = out + a
    return out


def mm_blocked(A, B, block, fma=True):
    """Blocks of `block` consecutive k, each accumulated from 0 (FMA), block sums added in order:
    restarted k-tiles, split-K."""
    return sum_in_order([mm_seq(A[:, k:k + block], B[k:k + block], fma=fma)
                         for k in range(0, A.shape[1], block)])


def sum_in_order(parts):
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


GEMM_ORDERS = {
    "seq": mm_seq, "fma": lambda A, B: mm_seq(A, B, fma=True),
    "reverse_fma": lambda A, B: mm_seq(A, B, reverse=True, fma=True),
    "blas": lambda A, B: A.astype(f32) @ B.astype(f32), "pairwise": mm_pairwise,
    "fma_lanes2": lambda A, B: mm_fma_lanes(A, B, 2), "fma_lanes4": lambda A, B: mm_fma_lanes(A, B, 4),
    "fma_lanes32": lambda A, B: mm_fma_lanes(A, B, 32),
    "blocks4": lambda A, B: mm_blocked(A, B, 4, fma=False), "fma_blocks16": lambda A, B: mm_blocked(A, B, 16),
    "split3": lambda A, B: mm_blocked(A, B, -(-A.shape[1] // 3)),
}


def test_qk_bound_holds_for_the_data_pythonhashseed_3_drew():
    """The case the hash()-seeded suite drew with PYTHONHASHSEED=3 (N40-M24-d64-normal-full, seed
    4058651962): OpenBLAS's two-accumulator sgemm order reached 1.10× the QK bound of the time
    (index, reverse and random orders only); 0.51 now."""
    rng = np.random.default_rng(4058651962)
    for order in MATMULS:  # the draws the stage-path test made, up to the "blas" order
        Q, K, V = (sample(rng, "normal", sh) for sh in ((40, 64), (24, 64), (24, 64)))
        if order == "blas":
            break
    Q64, K64 = Q.astype(np.float64), K.astype(np.float64)
    ref = Q64 @ K64.T
    bound = T.stage_bound("QK", {"Q": Q64, "K": K64}, ref, scale=1.0, causal=False, backend="cpu")
    for got in (Q @ K.T, mm_fma_lanes(Q, K.T, 2)):
        assert np.max(error(got, ref) / bound) < 0.7


ORDER_SHAPES = [(8, 8, 16), (17, 33, 16), (32, 48, 32), (40, 24, 64), (24, 40, 128), (9, 11, 7),
                (10, 100, 24)]


@pytest.mark.parametrize("dist", DISTS)
def test_dot_product_bound_covers_every_gemm_summation_order(dist):
    """QK and output (the two GEMMs) in 11 summation orders, 4 draws per shape: max err/bound stays
    below 0.75 (measured 0.66 worst over 216 such cases; before the strided and blocked orders
    entered dot_var: 1.00 for OpenBLAS, 0.97 for FMA blocks of 16, 0.78 for split-K in 3)."""
    worst = {}
    for shape in ORDER_SHAPES:
        N, M, d = shape
        for draw in range(4):
            rng = np.random.default_rng(seed_of(shape, dist, draw, "orders"))
            Q, K, V = (sample(rng, dist, sh) for sh in ((N, d), (M, d), (M, d)))
            P = softmax32(scale_mask32(Q @ K.T, 1 / np.sqrt(d), False))
            for stage, A, B in (("QK", Q, K.T), ("output", P, V)):
                A64, B64 = A.astype(np.float64), B.astype(np.float64)
                ref = A64 @ B64
                bound = T.LAMBDA * np.sqrt(T.dot_var(A64, B64, T.UNIT_ROUNDOFF["fp32"])) + T.FLUSH
                for order, mm in GEMM_ORDERS.items():
                    r = float(np.max(error(mm(A, B), ref) / bound))
                    worst[stage, order] = max(worst.get((stage, order), 0.0), r)
    bad = {k: round(v, 2) for k, v in worst.items() if v >= 0.75}
    assert not bad, f"max err/bound per (stage, order): {bad}"


ROWDOT_SHAPES = [(40, 64), (24, 128), (30, 7), (16, 100), (9, 33)]


def test_rowdot_var_is_dot_var_of_each_row():
    from verify.model.dot import dot_var, rowdot_var
    rng = np.random.default_rng(11)
    u = T.UNIT_ROUNDOFF["fp32"]
    for R, K in ROWDOT_SHAPES:
        A, B = sample(rng, "normal", (R, K)).astype(np.float64), sample(rng, "large", (R, K)).astype(np.float64)
        rows = np.vstack([dot_var(A[i:i + 1], B[i:i + 1].T, u, 0.5) for i in range(R)])
        # (float32 sums of the variances, added in another order for one row than for many)
        np.testing.assert_allclose(rowdot_var(A, B, u, 0.5), rows, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dist", DISTS)
def test_rowdot_bound_covers_the_summation_orders(dist):
    """Row-wise dot products (the backward pass's rowsum(dO∘O)) in float32, in the GEMM summation
    orders (each row summed as one element of a product): max err/bound as for the GEMMs."""
    from verify.model.dot import rowdot_var
    worst = {}
    for R, K in ROWDOT_SHAPES:
        for draw in range(3):
            rng = np.random.default_rng(seed_of(R, K, dist, draw, "rowdot"))
            A, B = sample(rng, dist, (R, K)), sample(rng, dist, (R, K))
            A64, B64 = A.astype(np.float64), B.astype(np.float64)
            ref = (A64 * B64).sum(axis=1, keepdims=True)
            bound = T.LAMBDA * np.sqrt(rowdot_var(A64, B64, T.UNIT_ROUNDOFF["fp32"])) + T.FLUSH
            for order, mm in GEMM_ORDERS.items():
                got = np.diag(mm(A, B.T))[:, None]   # element (i, i): row i's dot in that order
                worst[order] = max(worst.get(order, 0.0), float(np.max(error(got, ref) / bound)))
    bad = {k: round(v, 2) for k, v in worst.items() if v >= 0.75}
    assert not bad, f"max err/bound per order: {bad}"


def test_rowdot_var_of_long_rows_uses_the_expected_energy_and_stays_safe(monkeypatch):
    from verify.model import dot
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1)
    rng = np.random.default_rng(12)
    for dist in DISTS:
        A, B = sample(rng, dist, (24, 256)), sample(rng, dist, (24, 256))
        ref = (A.astype(np.float64) * B.astype(np.float64)).sum(axis=1, keepdims=True)
        bound = T.LAMBDA * np.sqrt(dot.rowdot_var(A, B, T.UNIT_ROUNDOFF["fp32"])) + T.FLUSH
        for order in ("seq", "interleaved"):
            assert (error(np.diag(MATMULS[order](A, B.T))[:, None], ref) <= bound).all()


FLASH_CASES = [(s, d, c) for s in [(17, 33, 16), (32, 48, 32), (24, 40, 64)] for d in DISTS for c in (False, True)]


@pytest.mark.parametrize("shape,dist,causal", FLASH_CASES, ids=[case_id(*c) for c in FLASH_CASES])
def test_no_false_failures_flash(shape, dist, causal):
    N, M, d = shape
    rng = np.random.default_rng(seed_of(shape, dist, causal, "flash"))
    scale = float(f32(1 / np.sqrt(d)))
    for Bc, sequential in ((16, True), (8, False), (32, "3xtf32")):
        Q, K, V = (sample(rng, dist, sh).astype(np.float64) for sh in ((N, d), (M, d), (M, d)))
        src = {"Q": Q, "K": K, "V": V}
        O, lse = flash32(Q, K, V, scale, causal, Bc, sequential)
        backends = ("cuda", None) if sequential == "3xtf32" else ("cpu", "cuda", None)
        for stage, got in (("flash_output", O), ("flash_lse", lse)):
            ref = compute_stage(stage, src, scale, causal)
            for backend in backends:
                bound = T.stage_bound(stage, src, ref, scale=scale, causal=causal, backend=backend)
                err = error(got, ref)
                assert (err <= bound).all(), \
                    f"{stage} Bc={Bc} {backend}: max err/bound {np.max(err / bound):.2f}"


# --- tightness: 10× the typical error in one element fails -------------------------------------
# The typical correct error AT an element is the RMS, over independent correct computations, of
# its error: the same index-order algorithm with EVERY reduction index permuted (mathematically
# the same result, a different sequence of roundings): the key index of the sums over keys and
# the head-dim index of the dot products, the flash stages' logits included. Permuting only the
# keys left each logit's dot-product error the same in every run, so "typical" was one sample
# of that error, not its RMS: wherever it dominates (flash_output of normal data), the sample
# was often a small one, and 10× it lay inside any honest bound (10× caught at 67% of those
# elements, against 99% now). TYPICAL_RUNS computations: the RMS of n samples scatters by
# ~1/√(2n), 20% for the 12 runs once used, 9% for 64; since an element is caught iff
# 10·typical > 6.5·σ, that scatter alone moved ~10% of the elements across the line.
# What no reordering randomizes stays one fixed rounding in every run (a product p_j·v_j, exp of
# a fixed input, a final division whose operands agree to the bit): in one-hot rows of `large`
# data an element's whole error is one to three such roundings, and "typical" is their realized
# value, anywhere in [0, 1.5] ulp.
TYPICAL_RUNS = 64


def _stage_once(stage, up, scale, perm, dperm):
    """`stage` in float32 from fixed float32 upstream `up`, reducing the keys in the order `perm`
    and the head dimension in the order `dperm`."""
    if stage == "QK":
        return mm_seq(up["Q"][:, dperm], up["K"][:, dperm].T)
    if stage == "attention_weights":
        out = np.empty_like(up["QK_scaled"])
        out[:, perm] = softmax32(up["QK_scaled"][:, perm])
        return out
    if stage == "output":
        return mm_seq(up["attention_weights"][:, perm], up["V"][perm])
    Q, K = up["Q"][:, dperm], up["K"][perm][:, dperm]
    return flash32(Q, K, up["V"][perm], scale, False, 16)[stage == "flash_lse"]


def _typical_case(stage, dist, rng, N=24, M=48, d=48, runs=TYPICAL_RUNS):
    """(got, ref, bound, typical) for one correct computation of `stage` (not causal)."""
    scale = float(f32(1 / np.sqrt(d)))  # d = 48: a scale that is not a power of two
    Q, K, V = (sample(rng, dist, sh) for sh in ((N, d), (M, d), (M, d)))
    up = simulate(Q, K, V, scale, False)
    up.update(Q=Q, K=K, V=V)
    from verify.stages import STAGES
    src = {n: up[n].astype(np.float64) for n in (("Q", "K", "V") if stage.startswith("flash")
                                                  else STAGES[stage].inputs)}
    ref = compute_stage(stage, src, scale, False)
    bound = T.stage_bound(stage, src, ref, scale=scale, causal=False, backend="cpu")
    if stage == "QK_scaled":  # one rounding per element: typical = RMS relative error × |ref|
        got = up[stage].astype(np.float64)
        err = error(got, ref)
        typical = np.sqrt(np.mean((err / np.abs(ref)) ** 2)) * np.abs(ref)
        return got, ref, bound, typical
    # Run 0 is the index order (the CPU backend's): the result the error is planted into.
    orders = [(np.arange(M), np.arange(d))] + [(rng.permutation(M), rng.permutation(d))
                                               for _ in range(runs - 1)]
    gots = [np.asarray(_stage_once(stage, up, scale, *order), np.float64) for order in orders]
    typical = np.sqrt(np.mean([error(g, ref) ** 2 for g in gots], axis=0))
    return gots[0], ref, bound, typical


TIGHT = [(s, d) for s in STAGE_PATH + ["flash_output", "flash_lse"] for d in DISTS]
# Fraction of elements that must catch a single-element error of 10× and 20× its typical error.
# Measured (N=M=d=48, flash_lse 192 rows; λ = 6.5; before → after the estimator and model changes
# of the verifier's calibration, 10×): QK 0.95/0.82/0.85 → 1.00/0.92/0.92 (uniform/normal/large),
# attention_weights 0.94/0.93 → 0.99/0.95, output 0.94/0.83 → 1.00/0.92, flash_output
# 0.91/0.67 → 1.00/0.99, flash_lse 0.73/0.80 → 0.86/0.85; 20× ≥ 0.97 everywhere but flash_lse
# uniform (0.90). Held with a little margin below. Once dot_var took the largest over strided,
# blocked and split-K orders too (OpenBLAS's order exceeded the bound): QK 1.00/0.92/0.92 →
# 1.00/0.89/0.89, output 1.00/0.92 → 1.00/0.90 (large 0.71 unchanged); still above 0.88.
# What stays below: an element is caught iff 10·typical > 6.5·σ, i.e. σ < 1.54× its RMS, and the
# model's σ is an envelope (the larger of index, reverse and random summation orders; its
# Benford-averaged roundings), ~1.1-1.2× the RMS at the median, so its upper tail misses.
# `large` (10× 0.71-0.93, 20× ≥ 0.85): in one-hot rows (the softmax of logits ~100 apart) an
# element's error is one to three roundings that no reordering randomizes (the product
# p_j·v_j; exp of a fixed input; the flash division by l ≈ 1), so "typical" is their realized
# value, uniform in [0, ulp/2] each, while 6.5σ of one rounding is 6.5/√12 = 1.9 ulp: elements
# whose rounding happened to err by less than ~0.19 ulp cannot be caught by a Gaussian λσ at all
# (only a worst-case bound of ulp/2 could, and only down to 0.05 ulp). flash_lse (one element a
# row, 10× 0.85): lse = m + log l is a few roundings of values ~5 (the log is held to 1 ulp, not
# one rounding, because numpy's float32 log in the simulations errs by up to 3.7 ulp).
CATCH = {"default": (0.88, 0.99), "flash_lse": (0.8, 0.87), "large": (0.65, 0.8)}


def catch_fractions(stage, dist):
    """{factor: (caught, total)}: of the elements where `factor`× the typical error is
    representable in float32 (≥ 1 ulp of ref and above the floor: a one-hot row of weights is
    computed exactly), how many fail once it is added to a correct result (the CPU backend's
    arithmetic, bounds for backend "cpu"). flash_lse has one element per row: 192 rows."""
    rng = np.random.default_rng(7)
    got, ref, bound, typical = _typical_case(stage, dist, rng, N=192 if stage == "flash_lse" else 48)
    ulp = 2 * T.UNIT_ROUNDOFF["fp32"] * np.abs(ref)  # an error smaller than one ulp of the value
    out = {}
    for factor in (10, 20):
        live = (factor * typical >= ulp) & (factor * typical > T.FLUSH)  # ... is not representable
        planted = error(got + np.where(got >= ref, 1.0, -1.0) * factor * typical, ref)
        out[factor] = int((planted[live] > bound[live]).sum()), int(live.sum())
    return out, ref.size


@pytest.mark.parametrize("stage,dist", TIGHT, ids=[f"{s}-{d}" for s, d in TIGHT])
def test_ten_times_typical_error_in_one_element_fails(stage, dist):
    """Adding 10× the element's typical correct error to a correct result must fail there, at
    (nearly) every element where such an error is representable."""
    fractions, size = catch_fractions(stage, dist)
    needs = CATCH["large" if dist == "large" else stage if stage in CATCH else "default"]
    for (factor, (caught, total)), need in zip(fractions.items(), needs):
        assert total >= (0.5 if stage != "flash_lse" else 0.2) * size or dist == "large"
        assert total > 0
        assert caught / total >= need, f"only {caught}/{total} elements catch {factor}x typical"


def test_nan_never_passes_and_masked_entries_are_exact():
    rng = np.random.default_rng(3)
    Q, K = sample(rng, "normal", (6, 16)), sample(rng, "normal", (6, 16))
    s = scale_mask32(mm_seq(Q, K.T), 0.25, True)
    ref = compute_stage("QK_scaled", {"QK": mm_seq(Q, K.T)}, 0.25, True)
    bound = T.stage_bound("QK_scaled", {"QK": mm_seq(Q, K.T)}, ref, scale=0.25, causal=True)
    masked = ~np.isfinite(ref)
    assert masked.any() and (bound[masked] == 0).all()
    got = s.astype(np.float64)
    got[0, 0] = np.nan
    assert not (error(got, ref) <= bound)[0, 0]


@pytest.mark.parametrize("stage", ["Q", "K", "V", "KT"])
def test_copies_must_be_bit_exact(stage):
    x = np.arange(12.0).reshape(3, 4)
    src = {"K": x} if stage == "KT" else {}
    ref = x.T if stage == "KT" else x
    assert (T.stage_bound(stage, src, ref, scale=0.5, causal=False) == 0).all()


def test_precision_only_changes_u():
    rng = np.random.default_rng(4)
    Q, K = rng.standard_normal((5, 8)), rng.standard_normal((6, 8))
    ref = Q @ K.T
    b32 = T.stage_bound("QK", {"Q": Q, "K": K}, ref, scale=1.0, causal=False, precision="fp32")
    b19 = T.stage_bound("QK", {"Q": Q, "K": K}, ref, scale=1.0, causal=False, precision="tf32")
    ratio = (b19 - T.FLUSH) / (b32 - T.FLUSH)
    assert np.all(ratio > 2**12) and np.all(ratio <= 2**13 + 1e-6)  # the min(u²s², t²) terms cap it


def test_unknown_precision_and_missing_input_are_clear_errors():
    with pytest.raises(T.ToleranceError, match="unknown precision 'fp8'"):
        T.stage_bound("QK", {"Q": np.ones((2, 2)), "K": np.ones((2, 2))}, np.ones((2, 2)),
                      scale=1.0, causal=False, precision="fp8")
    with pytest.raises(T.ToleranceError, match="needs input.*K"):
        T.stage_bound("QK", {"Q": np.ones((2, 2))}, np.ones((2, 2)), scale=1.0, causal=False)


def test_large_heads_use_the_expected_energy_and_stay_safe(monkeypatch):
    """Above ENERGY_EXACT_MAX_MACS the model switches to its random-order expectation."""
    from verify.model import dot
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1)
    rng = np.random.default_rng(5)
    for dist in DISTS:
        Q, K = sample(rng, dist, (24, 64)), sample(rng, dist, (40, 64))
        ref = Q.astype(np.float64) @ K.astype(np.float64).T
        bound = T.stage_bound("QK", {"Q": Q, "K": K}, ref, scale=1.0, causal=False)
        for order in ("seq", "interleaved"):
            assert (error(MATMULS[order](Q, K.T), ref) <= bound).all()


@pytest.mark.parametrize("backend", ["cuda", "cpu", None])
def test_bounds_are_magnitudes_for_a_negative_scale(backend):
    """A negative scale is legal (--scale -0.74): every bound must still be >= 0. The flash bounds
    once carried the scale's sign into the tensor-core truncation term, so on the CUDA backend a
    negative scale failed every flash_lse element of a correct run (GPU false-alarm sweep)."""
    rng = np.random.default_rng(129)
    Q, K, V = (sample(rng, "large", sh) for sh in ((9, 128), (5, 128), (5, 128)))
    for scale in (-0.7434457540512085, 0.7434457540512085):
        chain = reference_chain({"Q": Q, "K": K, "V": V}, scale, True,
                                ["Q", "K", "V", "QK", "QK_scaled", "attention_weights", "output",
                                 "flash_output", "flash_lse"])
        src = {n: chain[n] for n in ("Q", "K", "V")}
        for stage in ("QK_scaled", "attention_weights", "output", "flash_output", "flash_lse"):
            inputs = dict(src, **{n: chain[n] for n in T.STAGES[stage].inputs})
            bound = T.stage_bound(stage, inputs, chain[stage], scale=scale, causal=True, backend=backend)
            assert (bound >= 0).all(), (stage, scale, float(bound.min()))
            assert (T.chained_bound(stage, chain, scale=scale, causal=True, backend=backend) >= 0).all(), stage


def test_a_relative_error_over_a_subnormal_reference_is_inf_without_a_warning():
    """An fp16 softmax weight of 6e-8 (its smallest subnormal) where the float64 reference holds a
    float64 subnormal (scores in the hundreds): the relative error overflows to +inf, which is what
    max_rel reports, with no overflow warning (the GPU half sweep printed one per such case)."""
    import warnings

    from verify.check.results import compare_arrays
    got, want, allowed = np.array([[6e-8, 1.0]]), np.array([[5e-324, 1.0]]), np.array([[1e-7, 1e-7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = compare_arrays(got, want, allowed)
    assert c.passed and c.max_rel == np.inf


def test_equal_terms_count_as_one_error_repeated():
    """correlated_sum: a row with repeated terms sums (Σ σ)² over each group of equal terms (zeros
    included, −0 with +0), a row without sums the variances as they are; checked against the
    definition on random rows with few distinct values."""
    rng = np.random.default_rng(1)
    for _ in range(40):
        rows, cols = int(rng.integers(1, 12)), int(rng.integers(2, 200))
        terms = rng.choice(rng.random(int(rng.integers(1, 30))).astype(np.float32), size=(rows, cols))
        terms[rng.random((rows, cols)) < 0.2] = 0
        terms[rng.random((rows, cols)) < 0.1] = -0.0
        terms[0] = np.arange(1, cols + 1, dtype=np.float32)  # no repeats: left as it is
        var = rng.random((rows, cols))
        want = var.sum(axis=1)
        for r in range(1, rows):
            values = terms[r]
            if np.unique(values[values != 0]).size < np.count_nonzero(values):
                want[r] = sum(np.sqrt(var[r, values == x]).sum() ** 2 for x in np.unique(values))
        got = correlated_sum(var, EqualTerms(terms))
        np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(TypeError, match="float32"):  # (float64 terms would find no group)
        EqualTerms(terms.astype(np.float64))

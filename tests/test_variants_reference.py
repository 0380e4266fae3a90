"""The verifier's references, error bounds and invariants under every attention variant (causal
alignment, sliding windows, softcap, ALiBi, mask and bias files, dropout), through
compute_stage / reference_chain / tolerance directly.

* The references agree with a direct NumPy computation written here (loops and einsum, none of
  the verifier's code) to 1e-12.
* Correct float32 programs of each variant (tests/helpers/variant_float32.py: the stage path, a
  tiled flash forward and backward, reordered routes, an approximate tanh, flash-attn's causal
  ALiBi) are within every chained and isolated bound, the half pipeline's and TF32's too; the
  largest fraction of a bound used is printed (pytest -s).
* Wrong values (the cap missing, ALiBi's sign flipped, a window off by one, top-left instead of
  bottom-right, dropout's rescale missing) exceed the bounds; rows that see no key; the causal
  ALiBi lse shift is accepted, another shift is not.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

import numpy as np
import pytest

from helpers.simulated_float32 import tf32
from helpers.variant_float32 import Head, Route, flash_stages, stage_path
from verify.check import invariants, tolerance
from verify.check.reference import compute_stage, reference_chain
from verify.model import kernels
from verify.model.half import round_to_format32
from verify.specs import sources_of
from verify.stages import (BACKWARD_STAGES, FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE,
                           FLASH_OUTPUT, GRAD_KEYS, GRAD_OUTPUT, GRAD_QUERIES, GRAD_SCORES, GRAD_VALUES,
                           GRAD_WEIGHTS, KEYS, KEYS_T, OUTPUT, QUERIES, ROW_DOT, SCALED_SCORES, SCORES, STAGES,
                           VALUES, WEIGHTS, Dims)
from verify.variant import BOTTOM_RIGHT, PER_HEAD, TOP_LEFT, Variant, alibi_slopes

f32 = np.float32
N, M, D = 37, 53, 24
COMPUTED = [s for s in STAGES if STAGES[s].inputs and not STAGES[s].split]  # but the echoes and splits
FLASH = (FLASH_OUTPUT, FLASH_LSE, FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)
HEADROOM: Dict[str, float] = {}                               # case/route -> largest fraction of a bound


# ---- the cases ----------------------------------------------------------------------------------

def _document_mask(n: int, m: int) -> np.ndarray:
    """Keys and queries in three documents (FlexAttention's document mask), with the last query
    row seeing nothing (padding)."""
    qdoc = np.minimum(np.arange(n) * 3 // n, 2)
    kdoc = np.minimum(np.arange(m) * 3 // m, 2)
    mask = (qdoc[:, None] == kdoc[None, :]).astype(f32)
    mask[-1] = 0
    return mask


def make_head(name: str, seed: int = 0, n: int = N, m: int = M, std: float = 1.0) -> Head:
    rng = np.random.default_rng(seed)
    x = {k: (rng.standard_normal(shape) * std).astype(f32)
         for k, shape in (("q", (n, D)), ("k", (m, D)), ("v", (m, D)), ("do", (n, D)))}
    h = Head(x["q"], x["k"], x["v"], x["do"], scale=D ** -0.5)
    slope = float(alibi_slopes(6)[1])
    bias = (rng.standard_normal((n, m)) * 2).astype(f32)
    bias[rng.random((n, m)) < 0.05] = -np.inf
    keep = (rng.random((n, m)) >= 0.25).astype(f32)
    variants = {
        "causal-bottom-right": (Variant(causal=True, align=BOTTOM_RIGHT), {}),
        "causal-top-left": (Variant(causal=True), {}),
        "window": (Variant(window=(5, 3)), {}),
        "window-causal-bottom-right": (Variant(causal=True, align=BOTTOM_RIGHT, window=(7, -1)), {}),
        "softcap": (Variant(softcap=2.0), {}),
        "alibi": (Variant(alibi=True, align=BOTTOM_RIGHT), dict(slope=slope)),
        "alibi-causal": (Variant(causal=True, alibi=True, align=BOTTOM_RIGHT), dict(slope=slope)),
        "bias": (Variant(bias=PER_HEAD), dict(bias=bias)),
        "mask": (Variant(mask=PER_HEAD), dict(mask=_document_mask(n, m))),
        "dropout": (Variant(dropout=0.25), dict(keep=keep)),
        "everything": (Variant(causal=True, align=BOTTOM_RIGHT, window=(9, -1), softcap=3.0, alibi=True,
                               bias=PER_HEAD, mask=PER_HEAD, dropout=0.25),
                       dict(slope=slope, bias=bias, mask=_document_mask(n, m), keep=keep)),
    }
    variant, extra = variants[name]
    return replace(h, variant=variant, **extra)


CASES = ("causal-bottom-right", "causal-top-left", "window", "window-causal-bottom-right", "softcap", "alibi",
         "alibi-causal", "bias", "mask", "dropout", "everything")


# ---- a direct NumPy reference (none of the verifier's code) -------------------------------------

def direct(h: Head) -> Dict[str, np.ndarray]:
    """Every stage by loops over the rows and einsum, in float64."""
    q, k, v, do = (x.astype(np.float64) for x in (h.q, h.k, h.v, h.do))
    var = h.variant
    qk = np.einsum("id,jd->ij", q, k)
    s0 = qk * h.scale
    scores = np.full((h.n, h.m), -np.inf)
    offset = h.m - h.n if var.align == BOTTOM_RIGHT else 0
    right = 0 if var.causal else var.window[1]
    for i in range(h.n):
        diag = i + offset
        for j in range(h.m):
            if (var.window[0] >= 0 and j < diag - var.window[0]) or (right >= 0 and j > diag + right):
                continue
            if h.mask is not None and h.mask[i, j] == 0:
                continue
            if h.bias is not None and h.bias[i, j] == -np.inf:
                continue
            s = s0[i, j]
            if var.softcap:
                s = var.softcap * np.tanh(s / var.softcap)
            if var.alibi:
                s -= h.slope * abs(diag - j)
            if h.bias is not None:
                s += float(h.bias[i, j])
            scores[i, j] = s
    p = np.zeros((h.n, h.m))
    lse = np.full((h.n, 1), -np.inf)
    for i in range(h.n):
        seen = np.isfinite(scores[i])
        if seen.any():
            top = scores[i][seen].max()
            e = np.exp(scores[i][seen] - top)
            p[i, seen] = e / e.sum()
            lse[i, 0] = top + np.log(e.sum())
    keep = np.ones((h.n, h.m)) if h.keep is None else h.keep.astype(np.float64)
    r = 1.0 / (1.0 - var.dropout)
    o = np.einsum("ij,jd->id", p * keep * r, v)
    d = np.einsum("id,id->i", do, o)[:, None]
    dp = np.einsum("id,jd->ij", do, v)
    ds = p * (dp * keep * r - d)
    g = ds * (1.0 - np.tanh(s0 / var.softcap) ** 2) if var.softcap else ds
    dq = h.scale * np.einsum("ij,jd->id", g, k)
    dk = h.scale * np.einsum("ij,id->jd", g, q)
    dv = np.einsum("ij,id->jd", p * keep * r, do)
    return {SCORES: qk, KEYS_T: k.T, SCALED_SCORES: scores, WEIGHTS: p, OUTPUT: o, FLASH_OUTPUT: o, FLASH_LSE: lse,
            ROW_DOT: d, GRAD_WEIGHTS: dp, GRAD_SCORES: ds, GRAD_QUERIES: dq, GRAD_KEYS: dk, GRAD_VALUES: dv,
            FLASH_GRAD_QUERIES: dq, FLASH_GRAD_KEYS: dk, FLASH_GRAD_VALUES: dv}


# ---- the verifier's view of a head --------------------------------------------------------------

def inputs_of(h: Head) -> Dict[str, np.ndarray]:
    out = {QUERIES: h.q, KEYS: h.k, VALUES: h.v, GRAD_OUTPUT: h.do}
    return {**{n: x.astype(np.float64) for n, x in out.items()}, **h.tensors()}


def chain_of(h: Head, stages=COMPUTED) -> Dict[str, np.ndarray]:
    inputs = inputs_of(h)
    return {**inputs, **reference_chain(inputs, h.scale, h.variant.causal, stages, variant=h.variant, slope=h.slope)}


def _ratio(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> float:
    """The largest |got − want| / bound (inf where they differ and the bound is 0, or where one is
    non-finite and the other differs)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    with np.errstate(invalid="ignore"):
        err = np.where(got == want, 0.0, np.abs(got - want))
    err = np.where(np.isnan(err), np.inf, err)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(err == 0, 0.0, err / np.broadcast_to(bound, err.shape))
    return float(np.max(np.where(np.isnan(r), np.inf, r), initial=0.0))


class Verifier:
    """The chained and isolated comparisons and the invariants of one head's stages."""

    def __init__(self, h: Head, backend: Optional[str] = "cpu", precision: str = "fp32",
                 inputs: Optional[Dict[str, np.ndarray]] = None, math: str = "ieee") -> None:
        self.h, self.backend, self.precision, self.math = h, backend, precision, math
        self.inputs = inputs_of(h) if inputs is None else inputs
        self.chain = {**self.inputs, **reference_chain(self.inputs, h.scale, h.variant.causal, COMPUTED,
                                                       variant=h.variant, slope=h.slope)}
        self.cache = tolerance.HeadCache()
        self.kw = dict(scale=h.scale, causal=h.variant.causal, precision=precision, backend=backend, math=math,
                       cache=self.cache, variant=h.variant, slope=h.slope)

    def context(self, got: Dict[str, np.ndarray]):
        """The head's context with got in the reference's convention (each stage's `canonical`,
        applied as the engine applies it on reading a stage)."""
        dims = Dims(1, 1, self.h.n, self.h.m, D, D)
        ctx = invariants.head_context(dims, self.h.scale, self.h.variant.causal, precision=self.precision,
                                      backend=self.backend, math=self.math, inputs=self.inputs, chain=self.chain,
                                      got={}, quanta={}, cache=self.cache, variant=self.h.variant, slope=self.h.slope)
        for stage, x in got.items():
            ctx.got[stage] = invariants.canonical(stage, np.asarray(x, np.float64), ctx)
        return ctx

    def ratios(self, got: Dict[str, np.ndarray]) -> Dict[str, tuple]:
        """stage -> (chained ratio, isolated ratio) for every stage in got."""
        got = self.context(got).got
        out = {}
        for stage, x in got.items():
            chained = tolerance.chained_bound(stage, self.chain, **self.kw)
            src = {n: got[n] if n in got else self.chain[n] for n in sources_of(stage, self.h.variant)}
            src.update(self.h.tensors())
            want = compute_stage(stage, src, self.h.scale, self.h.variant.causal, variant=self.h.variant,
                                 slope=self.h.slope)
            isolated = tolerance.stage_bound(stage, src, want, **self.kw)
            out[stage] = (_ratio(x, self.chain[stage], chained), _ratio(x, want, isolated))
        return out

    def violations(self, got: Dict[str, np.ndarray]):
        ctx = self.context(got)
        return {stage: invariants.check_invariants(stage, x, ctx) for stage, x in ctx.got.items()}


def _assert_within(label: str, ratios: Dict[str, tuple], other_route=()) -> None:
    """Every stage within its chained and isolated bounds; other_route: stages the program computes
    by another route than from the upstream stages it wrote (only the chained bound applies, as
    in the check engine)."""
    ratios = {s: (r[0], 0.0) if s in other_route else r for s, r in ratios.items()}
    worst = max(max(r) for r in ratios.values())
    HEADROOM[label] = max(worst, HEADROOM.get(label, 0.0))
    bad = {s: r for s, r in ratios.items() if not max(r) < 1.0}
    assert not bad, f"{label}: beyond the bounds (chained, isolated fraction): {bad}"


@pytest.fixture(scope="module", autouse=True)
def _report_headroom():
    yield
    if HEADROOM:
        print("\nlargest fraction of a bound used by correct float32 programs of each variant:")
        for label, worst in sorted(HEADROOM.items()):
            print(f"  {label:58s} {worst:.3f}")


# ---- the references -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_the_references_agree_with_a_direct_numpy_computation(case):
    h = make_head(case, std=3.0 if case == "softcap" else 1.0)
    want = direct(h)
    got = chain_of(h)
    for stage in COMPUTED:
        ref = got[stage]
        assert ref.shape == want[stage].shape, stage
        inf = ~np.isfinite(want[stage])
        assert (ref[inf] == want[stage][inf]).all(), f"{case}: {stage}'s masked entries"
        tol = 1e-12 * (1.0 + np.abs(np.where(inf, 0.0, want[stage])))
        diff = np.abs(np.where(inf, 0.0, ref) - np.where(inf, 0.0, want[stage]))
        assert (diff <= tol).all(), f"{case}: {stage}"


def test_the_isolated_references_read_the_variant_sources():
    """compute_stage from a stage's own sources (sources_of) equals the chain's value."""
    h = make_head("everything")
    chain = chain_of(h)
    for stage in COMPUTED:
        src = {n: chain[n] for n in sources_of(stage, h.variant)}
        src.update(h.tensors())
        got = compute_stage(stage, src, h.scale, True, variant=h.variant, slope=h.slope)
        np.testing.assert_array_equal(got, chain[stage], err_msg=stage)


# ---- correct float32 programs are within the bounds ---------------------------------------------

ROUTES = {  # route, backend, math
    "plain": (Route(), "cpu", "ieee"),
    "reordered": (Route(reciprocal_cap=True, bias_first=True, fold_scale=True), None, "ieee"),
    "approx-tanh": (Route(approx_tanh=True, reciprocal_cap=True), None, "fast"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES)
def test_correct_float32_programs_are_within_every_bound(case, route):
    rt, backend, math = ROUTES[route]
    if rt.approx_tanh and "softcap" not in case and case != "everything":
        pytest.skip("no tanh without a softcap")
    for seed, std in ((0, 1.0), (1, 4.0)):
        h = make_head(case, seed, std=std)
        got = {**stage_path(h, rt), **flash_stages(h, rt, block=16 if seed == 0 else 7)}
        verifier = Verifier(h, backend, math=math)
        _assert_within(f"{case} / {route}", verifier.ratios(got), (SCALED_SCORES,) if rt.fold_scale else ())
        found = {s: v for s, v in verifier.violations(got).items() if v}
        assert not found, f"{case} / {route}: invariants violated: {found}"


@pytest.mark.parametrize("case", ("softcap", "alibi-causal", "window-causal-bottom-right", "everything"))
def test_an_approximate_tanh_is_fast_math_at_float32_and_any_half_program_s(case):
    """tanh.approx.f32 (flash-attn's softcap) errs ~2^-11: allowed under `--math fast`, and to a
    bf16 or fp16 program we did not write; not to an IEEE float32 program (tanhf, 2 ulps) nor to
    the CPU backend's model, where the cap bites."""
    h = make_head(case, 1, std=4.0)
    got = stage_path(h, Route(approx_tanh=True))
    _assert_within(f"{case} / approx tanh, fast math", Verifier(h, None, math="fast").ratios(got))
    if h.variant.softcap:
        for verifier in (Verifier(h, "cpu"), Verifier(h, None)):
            ratios = verifier.ratios({SCALED_SCORES: got[SCALED_SCORES]})
            assert max(ratios[SCALED_SCORES]) > 1.0
    half = kernels.kernel_for(None, "ieee", None, "bf16")
    assert half.tanh_rel == kernels.TANH_APPROX_REL and kernels.kernel_for(None).tanh_rel == 0.0


def test_a_tanh_from_the_exponential_is_allowed_its_absolute_error():
    """sign(x)·(1 − 2/(e^(2|x|) + 1)) (the half flash kernel's tanh) cancels near 0: small scores under
    a large cap carry an absolute error that tanhf's 2 ulps of t do not cover. Any program is allowed
    it; the CPU backend, which calls tanhf, is not."""
    rng = np.random.default_rng(136)
    q, k, v, do = (rng.uniform(-1, 1, shape).astype(np.float32) for shape in ((85, 64), (6, 64), (6, 64), (85, 64)))
    h = Head(q, k, v, do, scale=0.00518385972827673, variant=Variant(softcap=46.59))
    got = {SCALED_SCORES: stage_path(h, Route(tanh_from_exp=True))[SCALED_SCORES]}
    _assert_within("tanh from exp, foreign model", Verifier(h, None).ratios(got))
    assert max(Verifier(h, "cpu").ratios(got)[SCALED_SCORES]) > 1.0


@pytest.mark.parametrize("precision", ("bf16", "fp16"))
@pytest.mark.parametrize("case", ("softcap", "alibi-causal", "bias", "dropout", "everything"))
def test_the_half_pipelines_are_within_every_bound(case, precision):
    """The stage path storing every stage in the format, each computed from the stored values
    before it (docs/contract.md, Half precision), under the variant: the modified scores are
    rounded to the format, the weights too before P·V."""
    h = make_head(case, 2, std=2.0)
    rnd = lambda x: round_to_format32(x, precision)  # noqa: E731
    h = replace(h, q=rnd(h.q), k=rnd(h.k), v=rnd(h.v), do=rnd(h.do))
    got = _half_stage_path(h, rnd)
    _assert_within(f"{case} / {precision} stage path", Verifier(h, "cpu", precision).ratios(got))


def _half_stage_path(h: Head, rnd) -> Dict[str, np.ndarray]:
    from helpers.variant_float32 import cap_factor32, dropped32, scores, softmax32
    qk = rnd(h.q @ h.k.T)
    s = rnd(scores(h, qk * f32(h.scale), Route()))
    p = rnd(softmax32(s))
    o = rnd(rnd(dropped32(h, p)) @ h.v)
    d = (h.do * o).sum(axis=1, keepdims=True, dtype=f32)
    dp = rnd(h.do @ h.v.T)
    ds = rnd(p * (dropped32(h, dp) - d))
    f = cap_factor32(h, Route(), qk)
    g = ds if f is None else ds * f
    return {SCORES: qk, SCALED_SCORES: s, WEIGHTS: p, OUTPUT: o, ROW_DOT: d, GRAD_WEIGHTS: dp, GRAD_SCORES: ds,
            GRAD_QUERIES: rnd((g * f32(h.scale)) @ h.k), GRAD_KEYS: rnd((g * f32(h.scale)).T @ h.q),
            GRAD_VALUES: rnd(rnd(dropped32(h, p)).T @ h.do)}


@pytest.mark.parametrize("case", ("softcap", "alibi", "everything"))
def test_tf32_gemms_are_within_every_bound(case):
    """TF32 (--precision tf32): the GEMMs' operands rounded to TF32, the rest float32."""
    h = make_head(case, 3)
    t = replace(h, q=tf32(h.q), k=tf32(h.k), v=tf32(h.v), do=tf32(h.do))
    got = stage_path(t)
    got[OUTPUT] = tf32(got[WEIGHTS] if h.keep is None else got[WEIGHTS] * h.keep * f32(1 / 0.75)) @ t.v
    _assert_within(f"{case} / tf32", Verifier(h, "cpu", "tf32").ratios(
        {n: got[n] for n in (SCORES, SCALED_SCORES, WEIGHTS, OUTPUT)}))


# ---- wrong values exceed them -------------------------------------------------------------------

def _wrong(h: Head, stage: str, **variant_changes) -> Dict[str, tuple]:
    """The ratios of a program that computes `stage` (and what follows) under another variant."""
    wrong = replace(h, variant=h.variant.with_(**variant_changes))
    got = stage_path(wrong, backward=False)
    return Verifier(h).ratios({n: got[n] for n in (SCALED_SCORES, WEIGHTS, OUTPUT)})


@pytest.mark.parametrize("case,changes", [
    ("softcap", dict(softcap=0.0)),                      # the cap missing
    ("everything", dict(softcap=0.0)),
    ("window", dict(window=(6, 3))),                     # a window off by one on either side
    ("window", dict(window=(5, 2))),
    ("window-causal-bottom-right", dict(window=(8, -1))),
    ("causal-bottom-right", dict(align=TOP_LEFT)),       # top-left instead of bottom-right
    ("everything", dict(align=TOP_LEFT)),
])
def test_a_program_under_another_variant_fails_its_scores(case, changes):
    ratios = _wrong(make_head(case, std=3.0 if "softcap" in changes else 1.0), SCALED_SCORES, **changes)
    assert ratios[SCALED_SCORES][1] > 1.0 and ratios[OUTPUT][0] > 1.0, ratios


@pytest.mark.parametrize("case", ("alibi", "alibi-causal", "everything"))
def test_alibi_with_its_sign_flipped_fails(case):
    h = make_head(case)
    flipped = replace(h, slope=-h.slope)
    got = stage_path(flipped, backward=False)
    ratios = Verifier(h).ratios({n: got[n] for n in (SCALED_SCORES, WEIGHTS, OUTPUT)})
    assert ratios[SCALED_SCORES][1] > 1.0 and ratios[OUTPUT][0] > 1.0
    flash = flash_stages(flipped, backward=False)
    assert max(Verifier(h).ratios(flash)[FLASH_OUTPUT]) > 1.0


def test_a_window_off_by_one_is_a_mask_violation():
    """One key too many is a masked entry that is not −inf: the invariants name it."""
    h = make_head("window")
    got = stage_path(replace(h, variant=h.variant.with_(window=(6, 3))), backward=False)
    found = Verifier(h).violations({SCALED_SCORES: got[SCALED_SCORES], WEIGHTS: got[WEIGHTS]})
    assert [v.code for v in found[SCALED_SCORES]] == [invariants.MASK_MISSING]
    assert invariants.MASK_MISSING in [v.code for v in found[WEIGHTS]]


def test_dropout_without_its_rescale_fails():
    h = make_head("dropout")
    got = stage_path(h)
    got[OUTPUT] = (got[WEIGHTS] * h.keep) @ h.v
    got[GRAD_VALUES] = (got[WEIGHTS] * h.keep).T @ h.do
    ratios = Verifier(h).ratios({n: got[n] for n in (OUTPUT, GRAD_VALUES)})
    assert ratios[OUTPUT][1] > 1.0 and ratios[GRAD_VALUES][1] > 1.0


def test_the_softcap_factor_missing_in_the_gradients_fails():
    h = make_head("softcap", std=3.0)
    got = stage_path(h)
    dS = got[GRAD_SCORES]
    got[GRAD_QUERIES] = (dS * f32(h.scale)) @ h.k
    got[GRAD_KEYS] = (dS * f32(h.scale)).T @ h.q
    ratios = Verifier(h).ratios({n: got[n] for n in (SCORES, GRAD_SCORES, GRAD_QUERIES, GRAD_KEYS)})
    assert ratios[GRAD_QUERIES][1] > 1.0 and ratios[GRAD_KEYS][1] > 1.0


# ---- rows that see no key ----------------------------------------------------------------------

def test_rows_that_see_no_key():
    """Bottom-right causal with N > M: the first N − M rows see nothing (weights, output, D, dS, dQ 0;
    lse −inf, or flash-attn's +inf)."""
    h = make_head("causal-bottom-right", n=M, m=N)
    empty = M - N
    chain = chain_of(h)
    for stage in (WEIGHTS, OUTPUT, FLASH_OUTPUT, ROW_DOT, GRAD_SCORES, GRAD_QUERIES, FLASH_GRAD_QUERIES):
        assert (chain[stage][:empty] == 0).all(), stage
    assert (chain[FLASH_LSE][:empty] == -np.inf).all() and np.isfinite(chain[FLASH_LSE][empty:]).all()
    for route in (Route(), Route(plus_inf_lse=True)):
        got = {**stage_path(h), **flash_stages(h, route)}
        verifier = Verifier(h)
        _assert_within(f"empty rows / lse {'+inf' if route.plus_inf_lse else '-inf'}", verifier.ratios(got))
        assert not any(verifier.violations(got).values())
    got = stage_path(h, backward=False)
    got[OUTPUT] = got[OUTPUT].copy()
    got[OUTPUT][0, 0] = np.nan  # an empty row's output must be 0
    assert Verifier(h).ratios({OUTPUT: got[OUTPUT]})[OUTPUT][1] == np.inf


def test_a_mask_file_row_that_sees_no_key():
    h = make_head("mask")
    got = {**stage_path(h), **flash_stages(h)}
    assert (got[WEIGHTS][-1] == 0).all()
    _assert_within("mask file with an empty row", Verifier(h).ratios(got))
    got[WEIGHTS] = got[WEIGHTS].copy()
    got[WEIGHTS][-1, 0] = 1.0
    found = Verifier(h).violations({WEIGHTS: got[WEIGHTS]})[WEIGHTS]
    assert invariants.MASK_MISSING in [v.code for v in found]


# ---- flash-attn's causal ALiBi ------------------------------------------------------------------

@pytest.mark.parametrize("slope", (None, 0.5))
@pytest.mark.parametrize("case", ("alibi-causal", "everything"))
def test_the_causal_alibi_lse_shift_is_accepted(case, slope):
    """flash-attn's causal kernel adds slope·j: its lse exceeds the reference by slope·diag(i),
    which is accepted; its output and gradients are within their bounds (their logits' roundings
    see magnitudes raised by the shift: up to 0.5·160 here)."""
    h = make_head(case, 4, n=96, m=160)
    h = h if slope is None else replace(h, slope=slope)
    got = flash_stages(h, Route(flash_attn_alibi=True, plus_inf_lse=True))
    shift = h.slope * (np.arange(h.n) + h.m - h.n)[:, None]
    ref = chain_of(h, [FLASH_LSE])[FLASH_LSE]
    seen = np.isfinite(ref[:, 0])
    assert np.allclose(got[FLASH_LSE][seen] - shift[seen], ref[seen], atol=1e-3)
    verifier = Verifier(h, None)
    _assert_within(f"{case} / flash-attn causal ALiBi, slope {h.slope:g}", verifier.ratios(got))
    assert not any(verifier.violations(got).values())
    wrong = got[FLASH_LSE] + (h.slope * 0.5 * np.arange(h.n))[:, None].astype(f32)
    assert max(verifier.ratios({FLASH_LSE: wrong})[FLASH_LSE]) > 1.0


def test_the_lse_shift_is_refused_without_causal_alibi():
    h = make_head("alibi", 4)
    got = flash_stages(h, backward=False)
    shifted = got[FLASH_LSE] + (h.slope * (np.arange(h.n) + h.m - h.n))[:, None].astype(f32)
    assert max(Verifier(h).ratios({FLASH_LSE: shifted})[FLASH_LSE]) > 1.0


# ---- invariants under the variants --------------------------------------------------------------

def test_dk_columns_sum_to_zero_only_without_a_softcap():
    h = make_head("softcap", std=3.0)
    got = stage_path(h)
    assert np.abs(got[GRAD_KEYS].sum(axis=0)).max() > 1e-3       # the cap weighs dS's entries
    assert not Verifier(h).violations({GRAD_KEYS: got[GRAD_KEYS]})[GRAD_KEYS]
    plain = make_head("causal-bottom-right")
    got = stage_path(plain)
    dk = got[GRAD_KEYS].copy()
    dk[3] += 1e-3
    found = Verifier(plain).violations({GRAD_KEYS: dk})[GRAD_KEYS]
    assert invariants.COLUMN_SUM in [v.code for v in found]


def test_the_backward_invariants_hold_under_dropout_and_masks():
    h = make_head("everything")
    got = stage_path(h)
    found = Verifier(h).violations({n: got[n] for n in BACKWARD_STAGES if n in got})
    assert not any(found.values()), found
    ds = got[GRAD_SCORES].copy()
    hidden = np.argwhere(h.hidden())[0]
    ds[tuple(hidden)] = 1e-3
    found = Verifier(h).violations({GRAD_SCORES: ds})[GRAD_SCORES]
    assert invariants.MASK_MISSING in [v.code for v in found]


def test_the_plain_case_is_unchanged_by_the_variant_arguments():
    """variant=None and slope=0 give the same references and bounds as before variants existed."""
    h = make_head("causal-top-left")
    inputs = inputs_of(h)
    a = reference_chain(inputs, h.scale, True, COMPUTED)
    b = reference_chain(inputs, h.scale, True, COMPUTED, variant=Variant(causal=True))
    for s in COMPUTED:
        np.testing.assert_array_equal(a[s], b[s])
        kw = dict(scale=h.scale, causal=True, backend="cpu")
        np.testing.assert_array_equal(tolerance.chained_bound(s, {**inputs, **a}, **kw),
                                      tolerance.chained_bound(s, {**inputs, **a}, variant=Variant(causal=True), **kw))


# ---- the diagnoses' hooks -----------------------------------------------------------------------

@pytest.mark.parametrize("changes", [dict(align=TOP_LEFT), dict(window=(10, -1)), dict(softcap=0.0),
                                     dict(alibi=False), dict(dropout=0.0)])
def test_a_stage_from_the_inputs_under_another_variant(changes):
    """from_inputs / with_mask take variant= (a diagnosis asks for the stage under another
    alignment, window, without the cap) and rows= (some of the head's query rows)."""
    from verify.specs import SPECS
    h = make_head("everything")
    other = h.variant.with_(**changes)
    src = inputs_of(h)
    want = reference_chain(src, h.scale, True, COMPUTED, variant=other, slope=h.slope)
    for stage in (OUTPUT, FLASH_OUTPUT, FLASH_LSE):
        got = SPECS[stage].from_inputs(src, h.scale, None, variant=other, slope=h.slope)
        np.testing.assert_allclose(got, want[stage], rtol=1e-12, atol=1e-14, err_msg=stage)
    flash_src = {**src, FLASH_OUTPUT: want[FLASH_OUTPUT], FLASH_LSE: want[FLASH_LSE]}
    for stage in (FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES):
        got = SPECS[stage].with_mask(flash_src, h.scale, None, variant=other, slope=h.slope)
        np.testing.assert_allclose(got, want[stage], rtol=1e-12, atol=1e-12, err_msg=stage)
    rows = np.arange(5, 30, 3)
    some = SPECS[OUTPUT].from_inputs({**src, QUERIES: src[QUERIES][rows]}, h.scale, None, variant=other,
                                     slope=h.slope, rows=rows, n=h.n)
    np.testing.assert_allclose(some, want[OUTPUT][rows], rtol=1e-12, atol=1e-14)


def test_an_explicit_mask_replaces_the_variants():
    from verify.specs import SPECS
    h = make_head("alibi")
    src = inputs_of(h)
    masked = np.triu(np.ones((h.n, h.m), bool), 1 + h.m - h.n)  # bottom-right causal, built here
    got = SPECS[FLASH_LSE].from_inputs(src, h.scale, masked, variant=h.variant, slope=h.slope)
    want = chain_of(replace(h, variant=h.variant.with_(causal=True)), [FLASH_LSE])[FLASH_LSE]
    np.testing.assert_allclose(got, want, rtol=1e-12)


# ---- grouped K/V heads: dK and dV summed over the group -----------------------------------------

@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_a_group_sum_is_within_its_bound(precision):
    """dK of a K/V head = Σ over its group's query heads, summed in float32 in order of h: within
    both bounds the check gives the sum (verify/check/groups.py GroupSum, from each query head's
    Term), and a head of the group left out is not."""
    from verify.check.groups import GroupSum, Term
    from verify.files.outputs import RunInfo
    heads = [make_head("everything", seed) for seed in range(3)]
    heads = [replace(h, k=heads[0].k, v=heads[0].v) for h in heads]   # one K/V head for the group
    group, parts = GroupSum(), []
    for h in heads:
        verifier = Verifier(h, "cpu", precision)
        want = verifier.chain[GRAD_KEYS]   # isolated from the chain's own sources: the same matrix
        group.add(Term(want, want, tolerance.stage_bound_parts(GRAD_KEYS, verifier.chain, want, **verifier.kw),
                       chained=tolerance.chained_bound(GRAD_KEYS, verifier.chain, **verifier.kw)))
        parts.append(stage_path(h)[GRAD_KEYS])
    run = RunInfo(None, {}, Dims(1, len(heads), heads[0].n, heads[0].m, D, D, kv_heads=1), {}, precision=precision)
    bounds = group.bounds(run, GRAD_KEYS)
    total = parts[0]
    for part in parts[1:]:
        total = (total + part).astype(f32)
    if precision == "bf16":
        total = round_to_format32(total, precision)
    for bound in bounds:   # isolated, chained
        assert _ratio(total, group.want_chain, bound) < 1.0
        assert _ratio(parts[0] + parts[1], group.want_chain, bound) > 1.0   # a head of the group left out


@pytest.mark.parametrize("case", ("softcap", "alibi-causal", "dropout", "everything"))
def test_flash_attns_eager_baseline_computes_the_variant(case):
    """The baseline of flash-attn's test criterion (verify/check/baseline.py) under the variant:
    within a few bf16 units of the reference, and far from it without the variant."""
    from verify.check.baseline import eager_half_attention
    from verify.specs.base import head_variant
    h = make_head(case, std=3.0 if case == "softcap" else 1.0)
    rnd = lambda x: round_to_format32(x, "bf16")  # noqa: E731
    h = replace(h, q=rnd(h.q), k=rnd(h.k), v=rnd(h.v), do=rnd(h.do))
    chain = chain_of(h)
    head = head_variant(h.variant, h.slope, h.tensors())
    got = eager_half_attention(h.q, h.k, h.v, h.do, h.scale, head, "bf16")
    plain = eager_half_attention(h.q, h.k, h.v, h.do, h.scale, h.variant.causal, "bf16")
    for stage in (OUTPUT, GRAD_QUERIES, GRAD_KEYS, GRAD_VALUES):
        top = np.abs(chain[stage]).max()
        assert np.abs(got[stage] - chain[stage]).max() < 0.05 * top, stage
    assert np.abs(plain[OUTPUT] - chain[OUTPUT]).max() > 0.05 * np.abs(chain[OUTPUT]).max()

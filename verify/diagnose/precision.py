"""Precision diagnoses: a stage that fails because the program computed in another arithmetic than
the bounds assumed, not because it computed the wrong thing.

Each names what a real program does and what would check it: GEMMs on TF32 tensor cores (`tf32`),
stages stored in bf16/fp16 (`half_storage`), a float32→bf16/fp16 conversion that truncates
(`half_truncation`), sums accumulated in fp16 (`half_accumulation`). The evidence is twofold: a
signature of that arithmetic in the values themselves (values of the half format, a one-signed
shrink toward zero, a closer match with TF32-rounded operands or fp16 partial sums), and the
verifier's own error model re-run at that precision (`check --precision`, `--half-rounding`): the
stage must pass there. A bug fails both ways, so a wrong result is never excused as imprecision.
`half_accumulation` is the exception: no precision option bounds fp16 sums, so its evidence is the
replay alone (fp16 partial sums leave at most a quarter of the float32 error), and it names only a
stage that failed already: the verdict stays FAIL, the name says why.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis, Suspect
from ..check.half_rounding import stored_in_format
from ..check.reference import compute_stage, reference_chain
from ..check.results import compare_arrays
from ..model.half import (HALF_FORMATS, NEAREST, TOWARD_ZERO, is_half, round_mantissa32, round_to_format)
from ..model.rounding import HeadCache
from ..specs import SPECS, upstream
from ..stages import (GRAD_OUTPUT, GRAD_VALUES, GRAD_WEIGHTS, KEYS, OUTPUT, QUERIES, SCORES,
                      STAGES, VALUES, WEIGHTS)
from . import score_rounding
from .base import FAR_BETTER, PRECISION_CONFIDENCE, gap

CODES = ("tf32", "half_storage", "half_truncation", "half_accumulation") + score_rounding.CODES
CONFIDENCE = PRECISION_CONFIDENCE

# TF32 keeps 10 of float32's 23 stored mantissa bits.
TF32_DROPPED_BITS = 13
# Values whose printed resolution is finer than this fraction of the format's ulp tell whether
# they are values of the format; at least MIN_EVIDENCE such values must all be.
EVIDENCE_FRACTION = 0.125
MIN_EVIDENCE = 16
# Truncation shrinks |x| by half an ulp on average, rounding to nearest by none.
TRUNCATION_BIAS = 0.25
# Values nearer 0 than the float32 result's own error may take the other sign (an output's small
# entries under a P rounded to the format); more of them than this is no truncation.
MAX_SIGN_FLIPS = 0.01
# TF32 moves a result by a few of its units (2^-11) of the stage's magnitude; a bug by far more.
TF32_GATE = 2.0 ** -11 * 64
# TF32 operands move nearly every element past float32's bound; a few wrong elements are a bug.
TF32_WIDESPREAD = 0.25
# fp16 accumulation is replayed up to this many terms a sum (it is a loop over them).
MAX_REPLAYED_TERMS = 8192

# The GEMMs whose operands the signatures rebuild: stage -> (A, B) with stage = A·B (from sources).
_GEMMS = {
    SCORES: lambda s: (s[QUERIES], s[KEYS].T),
    OUTPUT: lambda s: (s[WEIGHTS], s[VALUES]),
    GRAD_WEIGHTS: lambda s: (s[GRAD_OUTPUT], s[VALUES].T),
    GRAD_VALUES: lambda s: (s[WEIGHTS].T, s[GRAD_OUTPUT]),
}
_HALF_TYPES = {"bf16": "torch.bfloat16 tensors, __nv_bfloat16 buffers", "fp16": "torch.float16 tensors, __half buffers"}


# ---------------------------------------------------------------------------------------------
# The model re-run at another precision
# ---------------------------------------------------------------------------------------------

def recheck(stage: str, got: np.ndarray, ctx: Suspect, precision: str, rounding: str = NEAREST
            ) -> Tuple[float, Optional[np.ndarray]]:
    """The stage's error as a fraction of the bounds `check --precision P --half-rounding R` would
    give it (< 1: it would pass), the better of the isolated and chained comparison, and the
    isolated reference there; (inf, None) without the head's context."""
    head = ctx.head_ctx
    if head is None or not head.raw_inputs:
        return np.inf, None
    inputs = {n: round_to_format(x, precision, rounding) if is_half(precision) else x
              for n, x in head.raw_inputs.items()}
    tensors = head.variant_tensors()  # the mask and bias files, the program's keep-mask
    inputs = {**tensors, **inputs}
    variant = dict(variant=head.effective_variant, slope=head.slope)
    needed = [s for s in STAGES if s == stage or s in upstream(stage)]
    chain = {**inputs, **reference_chain(inputs, head.scale, head.causal, needed, **variant)}
    kw = dict(scale=head.scale, causal=head.causal, precision=precision, backend=head.backend, math=head.math,
              flash_kernel=head.flash_kernel, cache=HeadCache(), half_rounding=rounding, **variant)
    quantum = head.quanta.get(stage)
    names = STAGES[stage].inputs or (stage,)
    src = {n: head.got[n] if n in head.got and n != stage and not SPECS[n].echo else chain[n] for n in names}
    src = {**tensors, **src}
    want = compute_stage(stage, src, head.scale, head.causal, **variant)
    q_src = {n: head.quanta[n] for n in names if n in head.got and n != stage and head.quanta.get(n) is not None}
    allowed = tolerance.stage_bound(stage, src, want, **kw) + _resolution(quantum) \
        + tolerance.quantization_bound(stage, src, q_src, head.scale, head.causal, **variant)
    isolated = compare_arrays(got, want, allowed, nan_agrees=True).tol_used
    if isolated < 1:
        return isolated, want
    allowed = tolerance.chained_bound(stage, chain, **kw) + _resolution(quantum)
    return min(isolated, compare_arrays(got, chain[stage], allowed).tol_used), want


def _resolution(quantum) -> object:
    return 0.0 if quantum is None else quantum


def _stored(stage: str) -> bool:
    """Whether the stage holds computed or echoed values (not KT, a transpose that moves them)."""
    return SPECS[stage].isolated is not None or SPECS[stage].echo


# ---------------------------------------------------------------------------------------------
# Signatures in the values
# ---------------------------------------------------------------------------------------------

def _ulp(x: np.ndarray, precision: str) -> np.ndarray:
    """One unit in the format's last place at |x| (the subnormal step below its normal range)."""
    p, emin = HALF_FORMATS[precision]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(x)))
    return 2.0 ** (np.maximum(e, emin) - (p - 1))


def _informative(x: np.ndarray, quantum, precision: str) -> np.ndarray:
    """Where x's printed resolution can tell a value of the format from its neighbours."""
    finite = np.isfinite(x) & (x != 0)
    fine = np.asarray(_resolution(quantum)) <= EVIDENCE_FRACTION * _ulp(np.where(finite, x, 1.0), precision)
    return finite & fine


def holds_format(x: np.ndarray, quantum, precision: str) -> bool:
    """Whether every informative value of x is one of the format's within x's printed resolution,
    with at least MIN_EVIDENCE distinct values that tell: informative ones, or exact values of the
    format (an fp16 .npy file's are, though its resolution is half an fp16 unit)."""
    finite = np.isfinite(x) & (x != 0)
    exact = finite & (round_to_format(np.where(finite, x, 0.0), precision) == x)
    where = _informative(x, quantum, precision)
    if np.unique(x[where | exact]).size < MIN_EVIDENCE:
        return False
    v = x[where]
    q = np.broadcast_to(np.asarray(_resolution(quantum), np.float64), x.shape)[where]
    return bool(np.all(np.abs(round_to_format(v, precision) - v) <= q))


def half_format_of(stage: str, got: np.ndarray, ctx: Suspect) -> Optional[str]:
    """The half format the program stores its values in, from this stage's values where it is
    stored in the format, else from the other stored stages it wrote; bf16 before fp16 (a bf16
    value is usually an fp16 one too)."""
    head = ctx.head_ctx
    if stored_in_format(stage) or SPECS[stage].echo:
        evidence = [(got, head.quanta.get(stage) if head else None)]
    elif head is not None:
        evidence = [(np.asarray(x, np.float64), head.quanta.get(n)) for n, x in head.got.items()
                    if n != stage and stored_in_format(n)]
    else:
        evidence = []
    for fmt in HALF_FORMATS:
        if evidence and all(holds_format(x, q, fmt) for x, q in evidence):
            return fmt
    return None


def truncation_bias(got: np.ndarray, want: np.ndarray, precision: str) -> float:
    """The median shrink of |got| below |want| in units of the format's last place (≈ 0.5 for a
    truncating conversion, ≈ 0 for rounding to nearest), over the entries of one sign in both (the
    median: an entry near 0, far below its error, may be many of its tiny units off); -inf where
    more than MAX_SIGN_FLIPS of them differ in sign."""
    where = np.isfinite(got) & np.isfinite(want) & (want != 0)
    g, w = got[where], want[where]
    flips = g * w < 0
    if not g.size or np.mean(flips) > MAX_SIGN_FLIPS:
        return -np.inf
    g, w = g[~flips], w[~flips]
    return float(np.median((np.abs(w) - np.abs(g)) / _ulp(w, precision)))


def tf32_operands(x: np.ndarray, toward_zero: bool) -> np.ndarray:
    """float32 values with their 13 low mantissa bits rounded off (nearest even) or dropped."""
    return round_mantissa32(x, TF32_DROPPED_BITS, toward_zero).astype(np.float64)


def tf32_explains(stage: str, got: np.ndarray, want: np.ndarray, src: Dict[str, np.ndarray]) -> bool:
    """Whether the product of TF32-rounded operands (either rounding) explains got far better than
    want does. Only the GEMM stages have operands to round: a flash kernel's TF32 products leave
    no signature apart from its float32 roundings' (the tf32 bounds, which are loose enough to
    cover a storage in fp16 too), so it is never named."""
    if stage not in _GEMMS or not all(n in src for n in STAGES[stage].inputs):
        return False
    base = gap(got, want)
    for toward_zero in (False, True):
        a, b = (tf32_operands(x, toward_zero) for x in _GEMMS[stage](src))
        if gap(got, a @ b) <= FAR_BETTER * base:
            return True
    return False


def fp16_accumulated(a: np.ndarray, b: np.ndarray, fused: bool) -> np.ndarray:
    """a·b of fp16 operands summed term by term in index order, each partial sum rounded to fp16
    (fused: a·b + acc rounded once, as __hfma; else the product rounded first)."""
    h = lambda x: round_to_format(x, "fp16")  # noqa: E731
    a, b = h(a), h(b)
    acc = np.zeros((a.shape[0], b.shape[1]))
    for k in range(a.shape[1]):
        term = a[:, k, None] * b[None, k, :]
        acc = h(acc + (term if fused else h(term)))
    return acc


# ---------------------------------------------------------------------------------------------
# The diagnoses
# ---------------------------------------------------------------------------------------------

def _widespread(got: np.ndarray, want: np.ndarray, bound: Optional[np.ndarray]) -> bool:
    """Whether at least TF32_WIDESPREAD of the finite elements lie beyond the bound checked."""
    if bound is None:
        return False
    fin = np.isfinite(want) & np.isfinite(got)
    beyond = np.abs(got - want)[fin] > np.broadcast_to(bound, got.shape)[fin]
    return bool(np.count_nonzero(beyond) >= TF32_WIDESPREAD * np.count_nonzero(fin))


def _tf32(stage, got, want, ctx) -> List[Diagnosis]:
    if not (_widespread(got, want, ctx.bound) and tf32_explains(stage, got, want, ctx.src)):
        return []
    ratio, _ = recheck(stage, got, ctx, "tf32")
    if not ratio < 1:
        return []
    return [Diagnosis("tf32", f"{stage} is off by TF32's error, not float32's: its products carry operands "
                      "rounded to 10 mantissa bits, and it passes under --precision tf32 (at "
                      f"{ratio:.2g} of those bounds). The GEMMs likely ran on TF32 tensor cores: cuBLAS "
                      "with CUBLAS_TF32_TENSOR_OP_MATH or a TF32 cublasLt compute type, PyTorch with "
                      "torch.backends.cuda.matmul.allow_tf32 = True or "
                      "torch.set_float32_matmul_precision('high'). Check with --precision tf32, or turn "
                      "TF32 off for float32 results", {"precision": "tf32", "tol_used": ratio}, CONFIDENCE)]


def _half(stage, got, want, ctx, fmt: str, current: Tuple[str, str]) -> List[Diagnosis]:
    """half_storage (passes at fmt, to nearest) or half_truncation (only toward zero, with the
    one-signed shrink), for a program whose values are fmt's; current: the check's (precision,
    rounding)."""
    if current != (fmt, NEAREST):
        ratio, _ = recheck(stage, got, ctx, fmt)
        if ratio < 1:
            how = " and conversions to nearest (without --half-rounding toward-zero)" if current[0] == fmt else ""
            holds = f"holds {fmt} values (each one of the format's)" if stored_in_format(stage) else \
                f"(float32, as a {fmt} program keeps it) is computed from {fmt} values"
            return [Diagnosis("half_storage", f"{stage} {holds} and passes under --precision {fmt}{how} (at "
                              f"{ratio:.2g} of those bounds): the program stores its values in {fmt} "
                              f"({_HALF_TYPES[fmt]}). Check with --precision {fmt}{how}",
                              {"precision": fmt, "tol_used": ratio}, CONFIDENCE)]
    if current == (fmt, TOWARD_ZERO):
        return []  # the check itself assumed truncation
    ratio, want_rz = recheck(stage, got, ctx, fmt, TOWARD_ZERO)
    if not ratio < 1:
        return []
    detail = {"precision": fmt, "rounding": TOWARD_ZERO, "tol_used": ratio}
    passes = (f"It passes under --precision {fmt} --half-rounding toward-zero (at {ratio:.2g} of those bounds); "
              "or convert with rounding to nearest (__float2bfloat16, __float2half)")
    if not stored_in_format(stage):  # (a float32 stage: its inputs' truncation alone, which the re-check shows)
        return [Diagnosis("half_truncation", f"{stage} (float32, as a {fmt} program keeps it) is computed from "
                          f"{fmt} values truncated, not rounded, as converting by dropping the low bits "
                          f"(bits >> 16) does. {passes}", detail, CONFIDENCE)]
    bias = truncation_bias(got, want_rz, fmt) if want_rz is not None else -np.inf
    if not bias > TRUNCATION_BIAS:
        return []
    return [Diagnosis("half_truncation", f"{stage}: the {fmt} values are truncated, not rounded: each lies "
                      f"up to one unit of {fmt}'s last place closer to zero than the float32 result (a median of "
                      f"{bias:.2f} units; a few entries near 0 may cross it), as converting by "
                      f"dropping the low bits (bits >> 16) does. {passes}", {**detail, "bias_ulps": bias},
                      CONFIDENCE)]


def _accumulation(stage, got, want, ctx) -> List[Diagnosis]:
    """Sums accumulated in fp16: got matches the fp16-accumulated product far better than want."""
    if stage not in _GEMMS or not all(n in ctx.src for n in STAGES[stage].inputs):
        return []
    a, b = _GEMMS[stage]({n: np.asarray(x, np.float64) for n, x in ctx.src.items()})
    if a.shape[1] > MAX_REPLAYED_TERMS:
        return []
    base = gap(got, want)
    for fused in (True, False):
        left = gap(got, fp16_accumulated(a, b, fused))
        if left <= FAR_BETTER * base:
            return [Diagnosis("half_accumulation", f"{stage} holds fp16 values whose error grows along the "
                              f"sum of {a.shape[1]} terms: it matches a sum accumulated in fp16 (each partial "
                              f"sum rounded to fp16) to {left:.2g}, against {base:.2g} for the float32 result. "
                              "The program accumulates in fp16 (a __half accumulator, __hfma, "
                              "CUBLAS_COMPUTE_16F), which no --precision covers: accumulate in float32 "
                              "(CUBLAS_COMPUTE_32F, a float accumulator)",
                              {"precision": "fp16", "terms": int(a.shape[1]), "max_diff": left,
                               "float32_diff": base}, CONFIDENCE)]
    return []


@np.errstate(all="ignore")
def diagnose(stage: str, got: np.ndarray, want: np.ndarray, ctx: Suspect,
             found: List[Diagnosis]) -> List[Diagnosis]:
    """The precision diagnosis that explains a failing stage × head, if any (at most one). None when
    a bug pattern other than one a precision mimics explains it already (found). A program's NaN
    and inf are judged, not warned about."""
    head = ctx.head_ctx
    mimicked = {m for ms in _MIMICKED_BY.values() for m in ms}
    if head is None or any(d.code not in mimicked for d in found) or not _stored(stage):
        return []
    fmt = half_format_of(stage, got, ctx)
    if fmt is None and is_half(head.precision):  # (a half run's float32 values: its flash lse, its flash gradients)
        rounded = score_rounding.diagnose if score_rounding.from_scores(stage) else score_rounding.gradients
        return rounded(stage, got, want, ctx, head.precision)
    if fmt is None:
        small = gap(got, want) <= TF32_GATE * float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
        return _tf32(stage, got, want, ctx) if head.precision == "fp32" and small else []
    found = _half(stage, got, want, ctx, fmt, (head.precision, head.half_rounding))
    if not found and fmt == "fp16" and stored_in_format(stage):
        found = _accumulation(stage, got, want, ctx)
    if not found and score_rounding.from_scores(stage):
        found = score_rounding.diagnose(stage, got, want, ctx, fmt)
    if not found and STAGES[stage].flash and STAGES[stage].backward:
        found = score_rounding.gradients(stage, got, want, ctx, fmt)
    return found


# The hypotheses a precision mimics: a truncating conversion shrinks every value by about half a
# unit of the format (got ≈ 0.998·want), and a rounding program checked as truncating looks
# scaled the other way. Every precision diagnosis passes its re-check, which a real scale cannot.
_MIMICKED_BY = {code: ("scaled",) for code in CODES}


def settle(found: List[Diagnosis]) -> List[Diagnosis]:
    """found without the hypotheses a precision diagnosis explains better."""
    mimics = {m for d in found for m in _MIMICKED_BY.get(d.code, ())}
    return [d for d in found if d.code not in mimics]

"""What a stage spec is, and what its checks are given: StageSpec, HeadContext, Violation.

A stage's spec (one module per stage or stage family in this package) says how it is computed
(its float64 reference), how far a correct float32 program may be from that (its isolated and
chained error bounds, its underflow floor, how a coarsely printed source moves it), what holds of
every correct result without a reference (its invariants), and which bug patterns can explain it.
The engine (verify/check/compare.py) iterates specs; it never branches on a stage's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

import numpy as np

from ..model.kernels import Kernel
from ..model.rounding import FLUSH, HeadCache
from ..model.scores import HeadVariant
from ..stages import Dims
from ..variant import Variant
from .variants import (VARIANT_SOURCES, Src, cap_sources, dropout_sources, flash_sources,  # noqa: F401 (re-exported)
                       head_variant, no_variant_sources, resolve_variant, score_sources)

# Violation codes: the ones that describe the same fault as a diagnosis share its code.
NONFINITE = "nonfinite"
NEGATIVE_WEIGHTS = "negative_weights"
ROW_SUM = "row_sum"
MASK_MISSING = "mask_missing"           # a masked weight is not 0 / a masked score not -inf
NOT_TRANSPOSE = "not_transpose"
ECHO_MISMATCH = "echo_mismatch"
FLASH_VS_OUTPUT = "flash_vs_output"
LSE_VS_SCORES = "lse_vs_scores"
COLUMN_SUM = "column_sum"               # dK's columns do not sum to 0
FLASH_VS_STAGES = "flash_vs_stages"     # a flash gradient disagrees with the stage path's


@dataclass
class Violation:
    code: str
    message: str
    count: int
    where: Optional[Tuple[int, ...]]


class Bounds(Protocol):
    """The check engine's bounds and references, as a reference-free check compares with them (a
    flash stage with the stage path's, a row sum with its roundings). The engine (verify/check/)
    builds on the specs and hands them this through HeadContext.bounds: the specs never import it."""

    def stage_bound(self, stage: str, src: Src, ref: np.ndarray, **arithmetic) -> np.ndarray:
        """The isolated bound of `stage` computed from `src` (verify/check/tolerance.py)."""

    def chained_bound(self, stage: str, chain: Src, **arithmetic) -> np.ndarray:
        """The bound of `stage` from the reference chain of the original inputs."""

    def reference_chain(self, inputs: Src, scale: float, causal: bool, needed: Iterable[str], *,
                        variant: Optional[Variant] = None, slope: float = 0.0) -> Src:
        """The float64 references of `needed` (and what they depend on) from the inputs (with the
        head's VARIANT_SOURCES where the variant has them)."""

    def invariant_quantum(self, stage: str, got: np.ndarray, ctx: "HeadContext") -> Optional[np.ndarray]:
        """What a sum of `stage`'s values may miss by beyond its float32 model: the printed
        resolution and the half pipelines' roundings (verify/check/half_rounding.py)."""

    def combine_allowance(self, stage: str, ctx: "HeadContext"):
        """What a run that splits the keys adds to a flash stage's bound from Q, K, V: its float32
        combine's error (verify/check/splits.py); 0 otherwise."""


@dataclass
class HeadContext:
    """What one head's checks see: the problem, the inputs, the reference chain from them, the
    binary's own stages so far with their printed resolutions, the head's bound cache, and the
    engine's bounds and references (bounds) for the checks that compare with them. bounds has no
    default, so that no context lacks them: verify.check.invariants.head_context builds one with
    the engine's."""
    dims: Dims
    scale: float
    causal: bool
    precision: str = "fp32"
    backend: Optional[str] = None
    math: str = "ieee"
    flash_kernel: Optional[str] = None
    inputs: Src = field(default_factory=dict)
    chain: Src = field(default_factory=dict)
    got: Src = field(default_factory=dict)
    quanta: Dict[str, Optional[np.ndarray]] = field(default_factory=dict)
    cache: Optional[HeadCache] = None
    allow_nonfinite: bool = False
    half_rounding: str = "nearest"
    raw_inputs: Src = field(default_factory=dict)  # the inputs as read, before any half rounding
    variant: Variant = Variant()   # the case's variant; its causal is `causal` above
    slope: float = 0.0             # this query head's ALiBi slope (variant.alibi)
    # A run that splits the keys: each split's references and bounds, computed once for both split
    # stages and the combine (verify/check/splits.py).
    splits: Dict[str, Any] = field(default_factory=dict)
    bounds: Bounds = field(kw_only=True)

    def bound_args(self) -> dict:
        """The tolerance model's keyword arguments for this head."""
        return dict(scale=self.scale, causal=self.causal, precision=self.precision,
                    backend=self.backend, math=self.math, flash_kernel=self.flash_kernel, cache=self.cache,
                    half_rounding=self.half_rounding, variant=self.effective_variant, slope=self.slope)

    @property
    def effective_variant(self) -> Variant:
        """The head's variant with the run's causal flag (resolve_variant)."""
        return resolve_variant(self.variant, self.causal)

    def variant_tensors(self) -> Src:
        """The head's VARIANT_SOURCES that exist: the mask and bias from the inputs, the keep-mask
        the program wrote (else the one handed in with the inputs or the chain)."""
        out = {}
        for name in VARIANT_SOURCES:
            for where in (self.got, self.inputs, self.chain):
                if name in where:
                    out[name] = where[name]  # as stored: its identity keys the head's cached bounds
                    break
        return out

    def head(self) -> HeadVariant:
        """The HeadVariant of this head (verify/model/scores.py)."""
        return head_variant(self.effective_variant, self.slope, self.variant_tensors())

    def hidden(self, n: int, m: int) -> np.ndarray:
        """True where the head's variant hides key j from row i (verify/variant.py's mask, the
        mask file's zeros, the bias file's −inf)."""
        return self.head().hidden(n, m)

    def own(self, name: str) -> np.ndarray:
        """The binary's `name` where it wrote it, else the input or the reference's."""
        if name in self.got:
            return self.got[name]
        return self.inputs[name] if name in self.inputs else self.chain[name]

    def quantum(self, *names: str):
        """The summed printed resolution of the binary's `names` (0 where exact or absent)."""
        total = 0.0
        for n in names:
            q = self.quanta.get(n)
            if q is not None:
                total = total + q
        return total


@dataclass(frozen=True)
class Problem:
    """What a stage's reference and error model depend on beyond its sources: the problem (the
    score scale, causal masking) and, for the bounds, the arithmetic assumed (u: the unit roundoff
    of the precision's operands, kernel: verify/model/kernels.py's Kernel) with the head's bound
    cache. A variant of the problem (grouped K/V heads, a window, a softcap) is a field here, not
    another argument of every callback."""
    scale: float
    causal: bool
    u: Optional[float] = None
    kernel: Optional[Kernel] = None
    cache: Optional[HeadCache] = None
    variant: Variant = Variant()   # its causal is `causal` above (verify/variant.py)
    slope: float = 0.0             # the query head's ALiBi slope when variant.alibi
    # The head's tensors (mask, bias, dropout keep-mask) with the variant and slope; None: the
    # variant without tensors (head_variant builds one from a stage's sources).
    tensors: Optional[HeadVariant] = None

    @property
    def head(self) -> HeadVariant:
        """One head's variant as the error model takes it (verify/model/scores.py)."""
        if self.tensors is not None:
            return self.tensors
        return HeadVariant(resolve_variant(self.variant, self.causal), self.slope)

    @property
    def key(self) -> tuple:
        """What a cached bound depends on besides its arrays (model/rounding.py's memo)."""
        return self.scale, self.causal, self.u, self.kernel, self.head

    @property
    def model_args(self) -> tuple:
        """(scale, head, u, kernel, cache): the arguments the error model's functions take (head:
        the HeadVariant, where a case without variants has its causal flag)."""
        return self.scale, self.head, self.u, self.kernel, self.cache

    @classmethod
    def of(cls, scale: float, causal: bool, src: Src, variant: Optional[Variant] = None, slope: float = 0.0,
           u: Optional[float] = None, kernel: Optional[Kernel] = None, cache: Optional[HeadCache] = None) -> "Problem":
        """The problem of a stage computed from `src` under `variant` (resolve_variant), with the
        head's tensors from src."""
        v = resolve_variant(variant, causal)
        return cls(scale, v.causal, u, kernel, cache, v, float(slope), head_variant(v, slope, src))


Quanta = Dict[str, np.ndarray]   # a source's printed resolution per element, by name

# The callbacks of a StageSpec (see its doc):
Reference = Callable[[Src, Problem], np.ndarray]                             # (sources, problem)
IsolatedModel = Callable[[Src, np.ndarray, Problem], Tuple[np.ndarray, np.ndarray]]  # (sources, reference, problem)
ChainedModel = Callable[[Tuple[np.ndarray, ...], Problem], np.ndarray]      # (the chain's inputs, problem)
Floor = Callable[[Src], object]                                             # (sources)
QuantizationModel = Callable[[Src, Quanta, Problem], object]                # (sources, their quanta, problem)
Invariant = Callable[[str, np.ndarray, HeadContext], List[Violation]]       # (stage, got, head)
# (sources, scale, masked, *, variant=Variant(), slope=0.0, rows=None): the stage under any mask
# (masked: True hides; the whole mask, the variant's own not added; None: the variant's own with
# the mask file in the sources) and the variant's score modifications and dropout.
MaskedReference = Callable[..., np.ndarray]
Canonical = Callable[[np.ndarray, np.ndarray, "HeadContext"], np.ndarray]    # (got, reference, head)
PassedOn = Callable[[np.ndarray, np.ndarray, Src, "HeadContext"], np.ndarray]  # (got, isolated ref, sources, head)
VariantSources = Callable[[Variant], Tuple[str, ...]]                        # (variant)
Rebuild = Callable[[Any], np.ndarray]                                       # (backward/reference.py's Gradients)


def two_flushes(src: Src):
    """The default underflow floor: the result and one term may flush to zero."""
    return 2 * FLUSH


def exact_quantization(src: Src, quanta: Quanta, problem: Problem):
    return 0.0


def product_quantization(src: Src, quanta: Quanta, a: str, b: str):
    """How far A·Bᵀ moves when A or B is known only to within its printed resolution."""
    out = 0.0
    if a in quanta:
        out = out + quanta[a] @ np.abs(src[b]).T
    if b in quanta:
        out = out + np.abs(src[a]) @ quanta[b].T
    return out


@dataclass(frozen=True)
class StageSpec:
    """One stage: its reference, its error bounds, its invariants, its diagnoses (see the module doc).

    Each callback is given the sources it reads and the Problem (scale, masking, arithmetic); the
    invariants the head's HeadContext.
    isolated: (variance, one-signed part) of a correct float32 result's error from the given
    sources; None for an exact copy (echoes, the transpose), which must match bit for bit.
    chained: the bound from the original inputs with the upstream stages' errors propagated
    (sources: the chain); None where the isolated bound on the chain's sources is that bound.
    masked_value: what causal masking writes (-inf scores, 0 weights); None: masking only
    removes terms. echo: the stage repeats an input file. scaled: it applies the scale and the
    mask itself. linear: a wrong factor shows as got ≈ f·want. partner: the stage-path stage a
    flash stage's consistency check compares with. with_mask: the reference under another mask
    (for the mask diagnoses of stages that hold no masked entries). given_upstream: the codes of
    its invariants that hold only when its upstream stages are right (dS's rows sum to 0 because
    D = Σ P·dP): after an upstream failure their violations are notes, blamed on that stage.
    given_partner: the codes of its invariants that compare it with its partner: after the
    partner's failure their violations are notes too.
    from_inputs: the stage recomputed from the case's Q, K, V under any scale, mask and keys
    (query rows independent), for the diagnoses of a program that wrote no upstream stage: what
    it would hold with the mask of another alignment, keys read past a tile's end or left out, a
    wrong scale. Both with_mask and from_inputs take keyword arguments variant= and slope= (the
    stage under another alignment, window, without the cap: the default is a plain head) and rows=
    (the head's query rows the sources' Q rows are, for ALiBi's distances and the mask and bias
    files' rows; all by default); masked=None takes the variant's own mask.
    variant_sources: what the stage reads besides its table inputs under a variant (the mask and
    bias files, the dropout keep-mask, QK for the softcap's derivative): the engine adds them to
    its sources (verify/specs/__init__.py sources_of).
    canonical: the program's values in the reference's convention where a correct program may
    write the same result otherwise (flash_lse: +inf for a row that sees no key, as flash-attn
    stores it; under causal ALiBi flash-attn's row shift): applied before every comparison.
    stands_for: the stage-path stage holding the same values (flash_output: output), which a
    program's file of this one stands in for as a source where the program wrote only this one (D
    of a flash-only backward is computed from its flash_output).
    passed_on: the isolated reference in the program's form where a correct stage may pass on what a
    faulty upstream gave it otherwise than the reference computes it (attention_weights: a row its
    own scores leave without a key that the head's mask shows keys normalizes 0/0, NaN where the
    program does not guard such a row); applied to the isolated comparison only.
    keyless: what every element of a row that sees no key holds when no dense case can hold the
    row (a packed sequence that reads no key): 0 for the outputs and gradients, −inf for the
    log-sum-exp (+inf accepted, as canonical says); an echo repeats its input instead.
    dropped: the sources it multiplies by dropout's keep-mask and 1/(1 − p) before a GEMM (the
    weights, for output and dV): a half pipeline may round that product to the format once more.
    rebuild: a backward stage from what it is computed from (specs/backward/reference.py's
    Gradients: P, dP, D, dS), which the backward diagnoses call with a part replaced by a bug's.
    diagnoses: the bug patterns (verify/diagnose/hypotheses.py hypothesis names) that can explain it.
    baseline: the tensor of FlashAttention's test baseline (verify/check/baseline.py: the stage-path
    stage whose value this stage holds) when flash-attn's own tests compare this stage (the
    output and dQ, dK, dV, by either path); None for the stages they do not compare.
    """
    name: str
    reference: Reference
    isolated: Optional[IsolatedModel] = None
    chained: Optional[ChainedModel] = None
    floor: Floor = two_flushes
    quantization: QuantizationModel = exact_quantization
    invariants: Tuple[Invariant, ...] = ()
    masked_value: Optional[float] = None
    echo: bool = False
    scaled: bool = False
    linear: bool = False
    partner: Optional[str] = None
    with_mask: Optional[MaskedReference] = None  # reference under any mask
    from_inputs: Optional[MaskedReference] = None
    given_upstream: Tuple[str, ...] = ()
    given_partner: Tuple[str, ...] = ()
    rebuild: Optional[Rebuild] = None
    diagnoses: Tuple[str, ...] = ()
    baseline: Optional[str] = None
    variant_sources: VariantSources = no_variant_sources
    canonical: Optional[Canonical] = None
    passed_on: Optional[PassedOn] = None
    dropped: Tuple[str, ...] = ()
    keyless: float = 0.0
    stands_for: Optional[str] = None


# ---- helpers the invariants share -----------------------------------------------------------

def first(mask: np.ndarray) -> Optional[Tuple[int, ...]]:
    idx = np.argwhere(mask)
    return tuple(int(i) for i in idx[0]) if len(idx) else None


def at(where: Optional[Tuple[int, ...]]) -> str:
    return f"[{', '.join(map(str, where))}]" if where else ""


def violation(code: str, stage: str, bad: np.ndarray, what: str) -> Optional[Violation]:
    """One Violation for the True entries of `bad`, or None when there are none."""
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    where = first(bad)
    return Violation(code, f"{stage}: {count} of {bad.size} entries {what}; first at {at(where)}",
                     count, where)


def nonfinite(stage: str, got: np.ndarray, allowed_neg_inf: np.ndarray) -> Optional[Violation]:
    nan = np.isnan(got)
    inf = np.isinf(got) & ~(allowed_neg_inf & (got == -np.inf))
    bad = nan | inf
    if not bad.any():
        return None
    where = first(bad)
    return Violation(NONFINITE, f"{stage}: {int(nan.sum())} NaN and {int(inf.sum())} Inf where none "
                     f"is allowed; first at {at(where)} = {float(got[where])}", int(bad.sum()), where)


def consistency(code: str, stage: str, got: np.ndarray, other: np.ndarray, allowed: np.ndarray,
                other_name: str) -> Optional[Violation]:
    """|got - other| within `allowed` everywhere, else a Violation at the worst entry."""
    if other.shape != got.shape:
        return Violation(code, f"{stage} is {got.shape[0]}x{got.shape[1]} but {other_name} is "
                         f"{other.shape[0]}x{other.shape[1]}", 1, None)
    with np.errstate(invalid="ignore"):
        # Both NaN: where allowed non-finite inputs made the references NaN too (else the
        # non-finite check has failed the stage already), the two agree.
        diff = np.where((got == other) | (np.isnan(got) & np.isnan(other)), 0.0, np.abs(got - other))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN disagrees most, and must be locatable
    bad = ~(diff <= allowed)
    if not bad.any():
        return None
    where = first(np.where(bad, diff, -1.0) == np.max(np.where(bad, diff, -1.0)))
    return Violation(code, f"{stage} disagrees with {other_name} at {int(bad.sum())} of {bad.size} "
                     f"entries beyond both stages' error bounds; worst at {at(where)}: "
                     f"{got[where]:.9g} vs {other[where]:.9g}", int(bad.sum()), where)


def bitwise_equal(got: np.ndarray, want: np.ndarray, quantum) -> np.ndarray:
    """Where got equals want bit for bit (NaN with NaN), or within the printed resolution."""
    with np.errstate(invalid="ignore"):
        near = np.abs(got - want) <= quantum if np.ndim(quantum) else np.zeros(got.shape, bool)
    return (got == want) | (np.isnan(got) & np.isnan(want)) | near

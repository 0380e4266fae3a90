"""The float64 NumPy reference for every stage.

`compute_stage` computes one stage from the matrices named in its table entry
(verify.stages.STAGES[name].inputs, and what the case's variant adds: verify.specs.sources_of) by
its spec's reference (verify/specs/); the verifier calls it twice per stage: with the reference
chain (from the original inputs) and with the binary's own upstream outputs (isolated checking).
Under a variant (verify/variant.py) the sources also hold the head's mask and bias files and the
program's dropout keep-mask (verify.specs.VARIANT_SOURCES), and `slope` is the query head's ALiBi
slope.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import numpy as np

from ..model.attention import causal_mask, log_sum_exp_rows, scaled_scores, softmax_rows
from ..model.rounding import ToleranceError
from ..specs import SPECS, VARIANT_SOURCES, sources_of
from ..specs.base import Problem, resolve_variant
from ..stages import STAGES
from ..variant import NONE, Variant

__all__ = ["compute_stage", "reference_chain", "causal_mask", "scaled_scores", "softmax_rows",
           "log_sum_exp_rows"]


def compute_stage(name: str, src: Dict[str, np.ndarray], scale: float, causal: bool, *,
                  variant: Optional[Variant] = None, slope: float = 0.0) -> np.ndarray:
    """float64 reference of stage `name` from its inputs `src` (float64 or float32 arrays) under
    `variant` (default: the plain case of `causal`; its causal flag is `causal`)."""
    src64 = {k: np.asarray(v, dtype=np.float64) for k, v in src.items()}
    problem = Problem.of(scale, causal, src64, variant, slope)
    # A faulty binary's upstream may hold NaN/Inf: the reference then holds them too, quietly;
    # the comparison reports them.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.ascontiguousarray(SPECS[name].reference(src64, problem))


def reference_chain(inputs: Dict[str, np.ndarray], scale: float, causal: bool, needed: Iterable[str], *,
                    variant: Optional[Variant] = None, slope: float = 0.0) -> Dict[str, np.ndarray]:
    """Every stage in `needed` (and what it depends on) computed from the original Q, K, V (and
    dO), with the head's VARIANT_SOURCES from `inputs` where the variant has them."""
    variant = resolve_variant(variant, causal)
    out: Dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in inputs.items()}
    # A stage that exists only under dropout (the keep-mask) is no stage of a case without it.
    needed = {n for n in needed if not STAGES[n].dropout or variant.dropout > 0 or n in out}

    def want(name: str) -> np.ndarray:
        if name not in out:
            if name in VARIANT_SOURCES:
                raise ToleranceError(f"the {name} of this head is needed for the {variant_name(variant)} "
                                 "reference but was not given")
            src = {d: want(d) for d in sources_of(name, variant)}
            out[name] = compute_stage(name, src, scale, variant.causal, variant=variant, slope=slope)
        return out[name]

    for name in STAGES:  # table order: dependencies first
        if name in needed:
            want(name)
    return {k: out[k] for k in needed}


def variant_name(variant: Variant) -> str:
    """A few words for the variant's parts that read a tensor of the head."""
    parts = [w for w, on in (("masked", variant.mask != NONE), ("biased", variant.bias != NONE),
                             ("dropout", variant.dropout > 0)) if on]
    return " and ".join(parts) or "case's"

"""One spec per stage (verify/specs/base.py says what a spec holds), registered here.

The stage table (verify/stages.py) names the stages, their shapes and what each is computed from;
this package says how each is computed, bounded, checked and diagnosed, one module per stage or
family of stages (the backward pass, larger, a package with a module per job). Adding a stage is
a table entry (its name a constant there), a spec here, and its kernels.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from ..stages import CASE_INPUTS, DROPOUT_MASK, STAGES
from ..variant import Variant
from . import backward, copies, dropout, flash, output, scores, splits, weights
from .base import VARIANT_SOURCES, HeadContext, StageSpec, Violation

SPECS: Dict[str, StageSpec] = {s.name: s for module in (copies, scores, weights, dropout, output, splits, flash, backward)
                               for s in module.SPECS}
assert set(SPECS) == set(STAGES), "every stage of verify/stages.py needs a spec"


def upstream(stage: str) -> List[str]:
    """Every stage this one is computed from, transitively, in table order."""
    out: List[str] = []
    for name in STAGES[stage].inputs:
        for up in upstream(name) + [name]:
            if up not in out:
                out.append(up)
    return out


def chain_inputs(stage: str) -> List[str]:
    """The original inputs a stage's chained bound starts from."""
    ups = set(upstream(stage)) | set(STAGES[stage].inputs)
    return [n for n in CASE_INPUTS if n in ups]


def sources_of(stage: str, variant: Variant) -> Tuple[str, ...]:
    """What the stage's reference and bounds read under `variant`: its table inputs, then what the
    variant adds (StageSpec.variant_sources: the mask and bias files, the dropout keep-mask, QK for
    the softcap's derivative)."""
    extra = tuple(n for n in SPECS[stage].variant_sources(variant) if n not in STAGES[stage].inputs)
    return STAGES[stage].inputs + extra


def reads_dropout_mask(stage: str, variant: Variant) -> bool:
    """Whether the stage's reference under `variant` depends on the program's dropout keep-mask
    (itself or upstream): it cannot be checked without it."""
    return any(DROPOUT_MASK in sources_of(s, variant) for s in [stage] + upstream(stage))


def uses_scale_and_mask(stage: str) -> bool:
    """Whether the stage depends on the scale and the causal mask (itself or upstream)."""
    return any(SPECS[s].scaled for s in [stage] + upstream(stage))


__all__ = ["SPECS", "StageSpec", "HeadContext", "Violation", "upstream", "chain_inputs", "uses_scale_and_mask",
           "sources_of", "VARIANT_SOURCES", "reads_dropout_mask"]

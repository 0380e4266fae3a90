"""flash-attn's test criterion, reported next to attnstep's verdict for half-precision runs.

FlashAttention's own test suite (tests/test_flash_attn.py) accepts an output tensor X when

    max|X - X_ref| <= factor · max|X_baseline - X_ref| + slack

with X_ref its reference computed in float32 and stored in the half format, and X_baseline the
same attention run eagerly in that format (verify/check/baseline.py). Its tests compare the output and
dQ, dK, dV; the factors and slack, per tensor, are the ones its tests use: the output within 2×
the baseline's error (its causal and split-KV tests add 1e-5), dQ, dK and dV within 3×
(test_flash_attn_output, the dense test with the backward). Here X_ref is attnstep's float64
reference from the same half inputs, rounded to the format, and the maxima run over every head,
as flash-attn's do over the whole tensor.

It is informational: attnstep's bounds (verify/check/tolerance.py) alone decide PASS/FAIL. The two
answer different questions: the bounds, whether each element is within what correct arithmetic
of this precision can give; flash-attn's criterion, whether the worst element is no worse than a
few times an eager half-precision program's worst.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..model.half import is_half, round_to_format
from ..model.rounding import memo
from ..specs import SPECS, HeadContext
from ..stages import GRAD_INPUT, KEYS, QUERIES, STAGES, VALUES
from ..text import number as _g
from ..text import plural
from .baseline import eager_half_attention
from .results import FLASH_ATTN_KEY, Report, elementwise_error

# (factor, slack) by Stage.backward: the output's, and the gradients' (tests/test_flash_attn.py).
CRITERIA = {False: (2.0, 1e-5), True: (3.0, 0.0)}
TITLE = "flash-attn's test criterion"


@dataclass
class StageCriterion:
    """flash-attn's criterion for one stage over every head: the worst |error| of the program's
    values and of the eager half baseline's, both against the reference in the format."""
    stage: str
    error: float
    baseline_error: float
    factor: float
    slack: float

    @property
    def allowed(self) -> float:
        return self.factor * self.baseline_error + self.slack

    @property
    def meets(self) -> bool:
        # An inf error (a NaN in the values) never meets it; nor does anything when the baseline
        # overflowed (fp16 scores past 65504 make its softmax NaN): flash-attn's test compares
        # against that NaN and fails.
        return math.isfinite(self.baseline_error) and self.error <= self.allowed

    @property
    def ratio(self) -> float:
        """error / baseline error (0 when both are 0, inf when only the baseline's is 0 or when it
        is not finite)."""
        if not math.isfinite(self.baseline_error):
            return math.inf
        if self.baseline_error == 0:
            return 0.0 if self.error == 0 else math.inf
        return self.error / self.baseline_error

    @property
    def baseline_overflowed(self) -> bool:
        return not math.isfinite(self.baseline_error)

    def rule(self) -> str:
        return f"{self.factor:g} x baseline" + (f" + {self.slack:.0e}".replace("e-0", "e-") if self.slack else "")

    def outcome(self, fmt: str) -> str:
        """The table's verdict: meets or misses, with the rule, or why no program can meet it."""
        if self.baseline_overflowed:
            return f"misses: the eager {fmt} baseline overflowed (NaN), so flash-attn's test fails on these inputs"
        return f"{'meets' if self.meets else 'misses'} ({self.rule()} allowed)"

    def to_json(self) -> dict:
        return {"stage": self.stage, "error": self.error, "baseline_error": self.baseline_error,
                "ratio": self.ratio, "factor": self.factor, "slack": self.slack, "allowed": self.allowed,
                "baseline_overflowed": self.baseline_overflowed, "meets": self.meets}


def _max_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want|, a NaN where want has none counting as inf."""
    worst = float(np.max(elementwise_error(got, want, nan_agrees=True), initial=0.0))
    return math.inf if math.isnan(worst) else worst


def _quiet_baseline(q, k, v, do, ctx: HeadContext) -> Dict[str, np.ndarray]:
    """The baseline without NumPy's overflow warnings: an fp16 baseline may overflow where the
    program did not, which the criterion reports as not met."""
    with np.errstate(all="ignore"):
        return eager_half_attention(q, k, v, do, ctx.scale, _head(ctx), ctx.precision)


def _head(ctx):
    """The head's variant (HeadContext.head), or the causal flag of a context without one."""
    return ctx.head() if hasattr(ctx, "head") else ctx.causal


def head_baseline(stage: str, ctx: HeadContext) -> Optional[np.ndarray]:
    """The eager half baseline's value of `stage` for one query head (a K/V head's gradient: this
    query head's part); None where the criterion does not apply (fp32/tf32, a stage flash-attn's
    tests do not compare). Computed once per head (the head cache), for every stage."""
    key = SPECS[stage].baseline
    if key is None or not is_half(ctx.precision):
        return None
    q, k, v, do = ctx.inputs[QUERIES], ctx.inputs[KEYS], ctx.inputs[VALUES], ctx.inputs.get(GRAD_INPUT)
    baseline = memo(ctx.cache, "eager half baseline", tuple(ctx.inputs.values()),
                    (ctx.scale, _head(ctx), ctx.precision),
                    lambda: _quiet_baseline(q, k, v, do, ctx))
    return baseline[key]


def head_errors(stage: str, got: np.ndarray, ctx: HeadContext) -> Optional[Tuple[float, float]]:
    """(the program's, the baseline's) worst |error| on one head against the reference rounded to
    the format; None where the criterion does not apply."""
    base = head_baseline(stage, ctx)
    if base is None:
        return None
    ref = round_to_format(ctx.chain[stage], ctx.precision)
    return _max_error(got, ref), _max_error(base, ref)


def summed_errors(got: np.ndarray, reference: np.ndarray, baseline: np.ndarray, precision: str) -> Tuple[float, float]:
    """head_errors of a K/V head's gradient summed over its query heads: the baseline's parts
    summed and rounded once to the format (an eager program's reduction over the repeated K/V
    heads), against the summed reference rounded to it."""
    ref = round_to_format(reference, precision)
    return _max_error(got, ref), _max_error(round_to_format(baseline, precision), ref)


def stage_criteria(report: Report) -> List[StageCriterion]:
    """The criterion per stage that has it, over the heads whose values could be read."""
    errors: Dict[str, List[Tuple[float, float]]] = {}
    for r in report.results:
        if r.flash_attn is not None:
            errors.setdefault(r.stage, []).append(r.flash_attn)
    return [StageCriterion(stage, max(e for e, _ in pairs), max(b for _, b in pairs), *CRITERIA[STAGES[stage].backward])
            for stage, pairs in errors.items()]


def text_lines(report: Report, quiet: bool = False) -> List[str]:
    """The block after the verdict (one line with quiet); nothing where the criterion does not apply."""
    crits = stage_criteria(report)
    if not crits:
        return []
    missed = [c for c in crits if not c.meets]
    if quiet:
        if not missed:
            return [f"{TITLE} (informational): met by all {plural(len(crits), 'stage')}"]
        return [f"{TITLE} (informational): missed by {', '.join(c.stage for c in missed)} "
                f"({_quiet_reason(missed, report.run.precision)})"]
    fmt = report.run.precision
    rows = [(c.stage, _g(c.error), _g(c.baseline_error), _g(c.ratio), c.outcome(fmt)) for c in crits]
    cols = ("stage", "yours", "baseline", "ratio", "flash-attn's test")
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    line = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [f"{TITLE} (for comparison; the verdict above is attnstep's):",
            f"  largest |error| against the reference rounded to {fmt}: yours, and an eager {fmt} "
            "attention's (flash-attn's baseline)",
            line.format(*cols).rstrip()] + [line.format(*r).rstrip() for r in rows]


def _quiet_reason(missed: List[StageCriterion], fmt: str) -> str:
    """Why the criterion was missed, in a few words: the baseline's overflow, or the worst ratio."""
    if any(c.baseline_overflowed for c in missed):
        return f"the eager {fmt} baseline overflowed on these inputs"
    worst = max(missed, key=lambda c: c.ratio)
    return f"error {_g(worst.ratio)} x the baseline's, {worst.rule()} allowed"


def json_block(report: Report) -> Optional[dict]:
    """The criterion for --json (None where it does not apply)."""
    crits = stage_criteria(report)
    if not crits:
        return None
    fmt = report.run.precision
    return {"informational": True, "meets": all(c.meets for c in crits),
            "rule": "max|X - X_ref| <= factor * max|X_baseline - X_ref| + slack",
            "reference": f"the float64 reference rounded to {fmt}",
            "baseline": f"eager {fmt} attention: every op's result stored in {fmt}, float32 accumulation and softmax",
            "stages": [c.to_json() for c in crits]}


def junit_properties(report: Report) -> List[Tuple[str, str]]:
    """(name, value) suite properties for --junit: the overall answer, then each stage's numbers."""
    crits = stage_criteria(report)
    if not crits:
        return []
    props = [(FLASH_ATTN_KEY, "meets" if all(c.meets for c in crits) else "misses")]
    for c in crits:
        props += [(f"{FLASH_ATTN_KEY}.{c.stage}.{k}", repr(v) if isinstance(v, float) else str(v).lower())
                  for k, v in (("error", c.error), ("baseline_error", c.baseline_error), ("ratio", c.ratio),
                               ("allowed", c.allowed), ("meets", c.meets))]
    return props

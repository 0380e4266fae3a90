"""The attention variants' goals `attnstep bench` reports, each a ratio of two rows of one run
against the same kernel without the variant, and the preset (`--variants goals`) that measures
exactly those rows in one invocation:

* GQA (H = 32, Hk = 8, N = M = 8192, d 128, bf16): the flash forward's TFLOP/s within 5% of MHA's
  at the same H (ratio >= 0.95; the same FLOP count, so the inverse of the time ratio);
* a sliding window (1024, 0), N = M = 16384, bf16: at most 1/8 of the full causal run's time, the
  flash forward and the flash backward;
* softcap 50 (B4 H16 N = M = 4096 d 128, bf16 and fp32): within 10% of the time without it (ratio
  <= 1.10), the flash forward and the flash backward at both precisions.

A grouped run's flash rows include the copy of the K/V heads to their query heads (the binary's
kernels read one K/V per query head; cuda_src/bench/bench_variant.cu says what is timed).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .report import BACKWARD, FLASH_BACKWARD, FLASH_DISPATCHER, FORWARD, Row
from .shape import Shape

TIME, TFLOPS = "time", "tflops"
COMPARISONS = {">=": operator.ge, "<=": operator.le}
# The preset's name (attnstep bench --variants), and the value that runs the shapes given instead.
GOALS_PRESET = "goals"
BOTH = "both"


@dataclass(frozen=True)
class RatioGoal:
    """The variant's row over the base's (same kernel and precision): `measure` TIME is the
    variant's ms over the base's, TFLOPS its TFLOP/s over the base's."""
    name: str
    kernel: str
    shape: Shape
    base: Shape
    precision: str
    measure: str
    threshold: float
    comparison: str
    claim: str

    @property
    def passes(self) -> str:
        return BACKWARD if self.kernel == FLASH_BACKWARD else FORWARD


_GQA = Shape(1, 32, 8192, 8192, 128, False, kv_heads=8)
_WINDOW = Shape(4, 16, 16384, 16384, 128, False, window=(1024, 0))
_CAUSAL = Shape(4, 16, 16384, 16384, 128, True)
_SOFTCAP = Shape(4, 16, 4096, 4096, 128, False, softcap=50.0)
_SOFTCAP_CLAIM = "time within 10% of the run without it"

VARIANT_GOALS: Tuple[RatioGoal, ...] = (
    RatioGoal("GQA", FLASH_DISPATCHER, _GQA, _GQA.base, "bf16", TFLOPS, 0.95, ">=",
              "TFLOP/s within 5% of MHA at the same H"),
    *(RatioGoal("window (1024, 0)", k, _WINDOW, _CAUSAL, "bf16", TIME, 1 / 8, "<=",
                "at most 1/8 of the full causal run's time") for k in (FLASH_DISPATCHER, FLASH_BACKWARD)),
    *(RatioGoal("softcap 50", k, _SOFTCAP, _SOFTCAP.base, p, TIME, 1.10, "<=", _SOFTCAP_CLAIM)
      for p in ("bf16", "fp32") for k in (FLASH_DISPATCHER, FLASH_BACKWARD)),
)


def preset_runs(goals: Sequence[RatioGoal] = VARIANT_GOALS) -> List[Tuple[Shape, str, str]]:
    """(shape, precision, passes) of every run the goals compare, each once, in the goals' order;
    a shape and precision timed forward and backward is one run of both passes."""
    runs: Dict[Tuple[Shape, str], set] = {}
    for g in goals:
        for shape in (g.shape, g.base):
            runs.setdefault((shape, g.precision), set()).add(g.passes)
    return [(shape, prec, passes.pop() if len(passes) == 1 else BOTH) for (shape, prec), passes in runs.items()]


def _find(rows: Sequence[Row], shape: Shape, goal: RatioGoal) -> Optional[Row]:
    """The goal kernel's row of a shape's run; else a failed run's row of the shape, if any."""
    runs = [r for r in rows if (r.shape, r.precision) == (shape.id, goal.precision)]
    return next((r for r in runs if r.kernel == goal.kernel), None) or next(
        (r for r in runs if r.status.startswith("failed")), None)


def _figure(row: Row, measure: str) -> str:
    return f"{row.ms:.3f} ms" if measure == TIME else f"{row.rate:.1f} TFLOP/s"


def goal_record(goal: RatioGoal, rows: Sequence[Row]) -> Optional[dict]:
    """The goal's verdict from the rows, or None when the variant's run is not among them: ratio
    (None when a row did not run), met, and the line the table prints."""
    variant, base = _find(rows, goal.shape, goal), _find(rows, goal.base, goal)
    if variant is None:
        return None
    head = f"{goal.precision} {goal.kernel} {goal.name}: {goal.claim} ({goal.comparison} {goal.threshold:.3g}x)"
    record = {"goal": goal.name, "kernel": goal.kernel, "precision": goal.precision, "shape": goal.shape.id,
              "base": goal.base.id, "measure": goal.measure, "threshold": goal.threshold,
              "comparison": goal.comparison, "ratio": None, "met": False}
    missing = [(s, r) for s, r in ((goal.shape, variant), (goal.base, base)) if r is None or r.status != "ok"]
    if missing:
        shape, row = missing[0]
        record["line"] = f"MISSED {head}: {shape.id} {'not run' if row is None else row.status}"
        return record
    ratio = variant.ms / base.ms if goal.measure == TIME else variant.rate / base.rate
    met = COMPARISONS[goal.comparison](ratio, goal.threshold)
    record.update(ratio=ratio, met=met)
    record["line"] = (f"{'met   ' if met else 'MISSED'} {head}: {ratio:.3f}x, {goal.shape.id} "
                      f"{_figure(variant, goal.measure)} vs {goal.base.id} {_figure(base, goal.measure)}")
    return record


def variant_goal_records(rows: Sequence[Row], goals: Sequence[RatioGoal] = VARIANT_GOALS) -> List[dict]:
    records = (goal_record(g, rows) for g in goals)
    return [r for r in records if r is not None]

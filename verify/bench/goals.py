"""The goals `attnstep bench` reports as met or missed (speed, and accuracy at bf16/fp16): one table
of records, one function that decides them; the variants' goals, ratios of two rows, are
variant_goals.py's and follow them."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

from ..stages import HALF_PRECISIONS, KEYS_T, OUTPUT, SCALED_SCORES, SCORES, WEIGHTS
from .report import FLASH_BACKWARD, FLASH_DISPATCHER, Row, parse_shape_id
from .sdpa import CUDNN
from .variant_goals import VARIANT_GOALS, RatioGoal, variant_goal_records


@dataclass(frozen=True)
class Metric:
    """What a goal measures: the row's field (with `backend`, that backend's entry of it), how the
    goal words it (formatted with the goal as `g`), and how the figure is printed (formatted with
    the row as `r` and the value as `v`)."""
    field: str
    claim: str
    figure: str
    backend: Optional[str] = None


METRICS = {
    "vs_sdpa": Metric("vs_sdpa", "{g.precision} {g.kernel} {g.comparison} {g.threshold:g}x SDPA",
                      "{r.vs_sdpa:.2f}x ({r.rate:.1f} TFLOP/s)"),
    "vs_sdpa_backward": Metric("vs_sdpa", "{g.precision} {g.kernel} {g.comparison} {g.threshold:g}x SDPA's backward",
                               "{r.vs_sdpa:.2f}x ({r.rate:.1f} TFLOP/s)"),
    # At bf16/fp16 the run's SDPA is the fastest of its backends, each timed in the same process.
    "vs_sdpa_fastest": Metric("vs_sdpa",
                              "{g.precision} {g.kernel} {g.comparison} {g.threshold:g}x SDPA's fastest backend",
                              "{r.vs_sdpa:.2f}x ({r.rate:.1f} TFLOP/s)"),
    # At bf16/fp16 the flash backward against one backend, cuDNN's, timed in the same process.
    "vs_sdpa_backward_cudnn": Metric("vs_backends",
                                     "{g.precision} {g.kernel} {g.comparison} {g.threshold:g}x SDPA's cuDNN backward",
                                     "{v:.2f}x ({r.rate:.1f} TFLOP/s)", backend=CUDNN),
    # The max relative error against float64 over SDPA's, same inputs and measure (accuracy.py).
    "err_vs_sdpa": Metric("err_vs_sdpa",
                          "{g.precision} {g.kernel} error {g.comparison} {g.threshold:g}x SDPA's on the same inputs",
                          "{r.max_rel_err:.2e} against SDPA's {r.sdpa_err:.2e}"),
    "tflops": Metric("rate", "{g.precision} {g.kernel} {g.comparison} {g.threshold:.0f} TFLOP/s",
                     "{r.rate:.1f} TFLOP/s"),
    "sgemm_fraction": Metric("fraction", "{g.kernel} {g.comparison} {g.threshold:.0%} of cuBLAS SGEMM",
                             "{r.fraction:.0%}"),
    "copy_fraction": Metric("fraction", "{g.kernel} {g.comparison} {g.threshold:.0%} of copy bandwidth",
                            "{r.fraction:.0%}"),
}
COMPARISONS = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Goal:
    kernel: str                 # a flash kernel or a stage, as the binary's JSON names it
    shape: Mapping[str, Any]    # the Shape fields a row's shape must have
    precision: str
    metric: str                 # a key of METRICS
    threshold: float
    comparison: str = ">="      # a key of COMPARISONS


_LARGE = {"batch": 4, "heads": 16, "seq_q": 4096, "seq_k": 4096}
# "No worse than SDPA's error": the binary's float64 reference and NumPy's differ in their last
# bits, so two equal errors (the same rounded output) differ by up to about 1e-11 relative (measured
# on an H100: 7.5e-12); 1e-9 keeps a tie a tie, far below any real difference of half-format errors.
_NO_WORSE = 1.0 + 1e-9
_LARGE_D64 = {**_LARGE, "d": 64, "causal": False}

# "flash" is what users get by default (the binary's dispatcher), so the flash goals are about it.
# The flash backward's: at d 64 and 128, causal and not (at bf16/fp16 against cuDNN's backward at
# the same format); so the half formats' forward, in speed and in accuracy (against float64, no
# worse than PyTorch's SDPA at the same format).
GOALS = (
    Goal(FLASH_DISPATCHER, _LARGE, "fp32", "vs_sdpa", 1.5),
    Goal(FLASH_DISPATCHER, {**_LARGE, "d": 64}, "tf32", "tflops", 150.0),
    *(Goal(FLASH_DISPATCHER, {**_LARGE, "d": d}, p, "vs_sdpa_fastest", 1.0)
      for p in HALF_PRECISIONS for d in (64, 128)),
    *(Goal(FLASH_DISPATCHER, {**_LARGE, "d": d}, p, "err_vs_sdpa", _NO_WORSE, "<=")
      for p in HALF_PRECISIONS for d in (64, 128)),
    *(Goal(FLASH_BACKWARD, {**_LARGE, "d": d}, "fp32", "vs_sdpa_backward", 2.0) for d in (64, 128)),
    *(Goal(FLASH_BACKWARD, {**_LARGE, "d": d}, "tf32", "tflops", 200.0) for d in (64, 128)),
    *(Goal(FLASH_BACKWARD, {**_LARGE, "d": d}, p, "vs_sdpa_backward_cudnn", 1.0)
      for p in HALF_PRECISIONS for d in (64, 128)),
    Goal(SCORES, _LARGE_D64, "fp32", "sgemm_fraction", 0.9),
    Goal(OUTPUT, _LARGE_D64, "fp32", "sgemm_fraction", 0.9),
    Goal(KEYS_T, _LARGE_D64, "fp32", "copy_fraction", 0.8),
    Goal(SCALED_SCORES, _LARGE_D64, "fp32", "copy_fraction", 0.8),
    Goal(WEIGHTS, _LARGE_D64, "fp32", "copy_fraction", 0.8),
)


def _applies(goal: Goal, row: Row) -> bool:
    if (row.status, row.kernel, row.precision) != ("ok", goal.kernel, goal.precision):
        return False
    shape = parse_shape_id(row.shape)
    # A shape with a variant decides only the variants' goals (variant_goals.py).
    return shape.plain and all(getattr(shape, key) == value for key, value in goal.shape.items())


def goal_line(goal: Goal, row: Row) -> Optional[str]:
    """'met'/'MISSED' with the figure; 'not measured' when SDPA ran on the row's shape but not the
    backend the goal names; None when the row does not decide the goal."""
    metric = METRICS[goal.metric]
    value = getattr(row, metric.field)
    if metric.backend is not None:
        if _applies(goal, row) and value is not None and value.get(metric.backend) is None:
            return (f"not measured {metric.claim.format(g=goal)} at {row.shape}: SDPA's {metric.backend} "
                    f"backend did not run (its row says why)")
        value = (value or {}).get(metric.backend)
    if not _applies(goal, row) or value is None:
        return None
    met = COMPARISONS[goal.comparison](value, goal.threshold)
    return (f"{'met   ' if met else 'MISSED'} {metric.claim.format(g=goal)} at {row.shape}: "
            f"{metric.figure.format(r=row, v=value)}")


def evaluate_goals(rows: Sequence[Row], goals: Sequence[Goal] = GOALS,
                   ratio_goals: Sequence[RatioGoal] = VARIANT_GOALS) -> List[str]:
    """One line per goal and row that decides it, goal by goal; then the variants' goals."""
    return [record["line"] for record in goal_records(rows, goals, ratio_goals)]


def goal_records(rows: Sequence[Row], goals: Sequence[Goal] = GOALS,
                 ratio_goals: Sequence[RatioGoal] = VARIANT_GOALS) -> List[dict]:
    """The goals' verdicts for the results JSON: each with its line and whether it is met (a
    variant's goal also with its ratio, rows and threshold)."""
    lines = (goal_line(goal, row) for goal in goals for row in rows)
    plain = [{"line": line, "met": line.startswith("met")} for line in lines if line is not None]
    return plain + variant_goal_records(rows, ratio_goals)

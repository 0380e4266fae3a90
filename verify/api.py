"""The Python API: check attention stages held in arrays (PyTorch, Triton, CuPy, ctypes code).

    import attnstep
    report = attnstep.check_arrays(q, k, v, {"output": o, "flash_lse": lse}, causal=True)
    attnstep.assert_attention_stages(q, k, v, {"output": o})   # in a pytest test
    attnstep.check_arrays(q, k, v, {"dQ": q.grad, "dK": k.grad, "dV": v.grad}, do=o.grad)  # backward

Arrays are NumPy arrays (or anything np.asarray takes: a CPU tensor's `.detach().cpu().numpy()`),
shaped (N, d) for one head, (H, N, d) or (B, H, N, d); each stage with the same leading axes and
the stage's own last two (an N×1 stage may drop its last axis). The report is the one `attnstep
check` prints and writes: the same tolerance model, chained and isolated references, diagnoses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from . import flash_attn_criterion as fa_criterion
from .case import CaseError, InputCase, check_scale, validate_dims
from .compare import Options, Report, check_run
from .outputs import MATH_MODES, RunInfo, StageSource
from .report import failure_lines, header_lines, summary_lines, table_lines
from .stages import DIM_KEYS, GRAD_INPUT, INPUT_NAMES, PRECISIONS, STAGES, Dims, default_scale
from .words import plural

ARRAYS = Path("<arrays>")  # what the report names as the run's and the inputs' place


def _leading(x: np.ndarray, name: str) -> Tuple[int, int]:
    """(batch, heads) from an input's leading axes."""
    if x.ndim == 2:
        return 1, 1
    if x.ndim == 3:
        return 1, x.shape[0]
    if x.ndim == 4:
        return x.shape[0], x.shape[1]
    raise ValueError(f"{name}: {x.ndim}-d array; expected (N, d), (H, N, d) or (B, H, N, d)")


def _heads(x: np.ndarray, total: int, rows: int, cols: int, name: str) -> np.ndarray:
    """x as (heads, rows, cols); an N×1 stage may come without its last axis."""
    x = np.asarray(x)
    want = total * rows * cols
    if x.size != want or (x.ndim >= 2 and x.shape[-2:] != (rows, cols) and not (cols == 1 and x.shape[-1] == rows)):
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {plural(total, 'head')} of {rows}x{cols}")
    if x.dtype not in (np.float16, np.float32, np.float64):
        raise ValueError(f"{name}: dtype {x.dtype}; expected float16, float32 or float64 (convert bfloat16 "
                         "with .float())")
    return x.reshape(total, rows, cols)


def _problem(q, k, v, causal: bool, scale: Optional[float], allow_nonfinite: bool = False,
             do=None) -> Tuple[Dims, Dict[str, np.ndarray], float]:
    q, k, v = (np.asarray(x) for x in (q, k, v))
    arrays = dict(zip(INPUT_NAMES, (q, k, v)))
    if do is not None:
        arrays[GRAD_INPUT] = np.asarray(do)
    B, H = _leading(q, "q")
    N, d_k = q.shape[-2:]
    M, d_v = v.shape[-2:]
    try:
        dims = validate_dims(dict(zip(DIM_KEYS, (B, H, N, M, d_k, d_v))), "q, k, v")
        if scale is not None:
            check_scale(scale, "scale")
    except CaseError as exc:
        raise ValueError(str(exc)) from None
    heads = {n: _heads(arrays[n], dims.total_heads, *STAGES[n].shape(dims), n.lower()) for n in arrays}
    bad = [n for n in heads if not allow_nonfinite and not np.isfinite(heads[n]).all()]
    if bad:
        raise ValueError(f"{bad[0].lower()} holds NaN or Inf; pass allow_nonfinite=True to check a kernel on such "
                         "inputs (NaN then passes where the reference has NaN)")
    return dims, heads, default_scale(d_k) if scale is None else float(scale)


def check_arrays(q, k, v, stages: Mapping[str, object], *, do=None, causal: bool = False,
                 scale: Optional[float] = None, precision: str = "fp32", math: str = "ieee",
                 atol: Optional[float] = None, rtol: Optional[float] = None, jobs: int = 1,
                 allow_nonfinite: bool = False) -> Report:
    """Checks each stage in `stages` ({stage name: array}) computed from q, k, v, as `attnstep
    check` does; returns the Report (report.passed, report.first_failing_stage, report.results).
    do: the output gradient dL/d(output), shaped like the output, for the backward stages (dQ, dK,
    dV, D, dP, dS, flash_dQ, ...); causal: top-left aligned masking; scale: default 1/sqrt(d_k); precision and math: the
    arithmetic the program used (fp32/tf32; ieee/fast). Raises ValueError for arrays that do not
    fit together."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if math not in MATH_MODES:
        raise ValueError(f"math {math!r}: expected one of {', '.join(MATH_MODES)}")
    backward = sorted(n for n in stages if n in STAGES and STAGES[n].backward)
    if backward and do is None:
        raise ValueError(f"stage {backward[0]!r} is a gradient: pass do= (the output gradient it was computed from)")
    dims, inputs, scale = _problem(q, k, v, causal, scale, allow_nonfinite, do)
    sources = {}
    for name in STAGES:
        if name in stages:
            arr = _heads(stages[name], dims.total_heads, *STAGES[name].shape(dims), name)
            sources[name] = StageSource(name, None, name, arrays=arr)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; stages are: {', '.join(STAGES)}")
    if not sources:
        raise ValueError("no stage to check: pass at least one of " + ", ".join(STAGES))
    case = InputCase(ARRAYS, dims, "npy", bool(causal), scale, manifest=True, arrays=inputs,
                     allow_nonfinite=allow_nonfinite, backward=do is not None)
    run = RunInfo(None, {}, dims, sources, causal=bool(causal), scale=scale, precision=precision,
                  math=math)
    return check_run(run, case, Options(atol=atol, rtol=rtol, jobs=jobs, allow_nonfinite=allow_nonfinite))


def format_report(report: Report, per_head: bool = False) -> str:
    """The report as `attnstep check` prints it."""
    return "\n".join(header_lines(report) + table_lines(report, per_head) + failure_lines(report)
                     + summary_lines(report) + fa_criterion.text_lines(report))


def flash_attn_criterion(report: Report) -> List[fa_criterion.StageCriterion]:
    """flash-attn's test criterion for a half-precision report (precision="bf16"/"fp16"), per stage
    its tests compare (output, flash_output, dQ, dK, dV, flash_dQ, ...): .error and .baseline_error
    (the largest |error| of your values and of an eager half-precision attention against the
    reference rounded to the format), .ratio, .allowed, .meets. Empty for fp32/tf32. Informational:
    report.passed is attnstep's verdict."""
    return fa_criterion.stage_criteria(report)


def assert_attention_stages(q, k, v, stages: Mapping[str, object], **kwargs) -> Report:
    """check_arrays, raising AssertionError with the stage table when a stage fails (for pytest)."""
    report = check_arrays(q, k, v, stages, **kwargs)
    if not report.passed:
        raise AssertionError("attention stages differ from the float64 reference:\n" + format_report(report))
    return report

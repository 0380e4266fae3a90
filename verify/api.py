"""The Python API: check attention stages held in arrays (PyTorch, Triton, CuPy, ctypes code).

    import attnstep
    report = attnstep.check_arrays(q, k, v, {"output": o, "flash_lse": lse}, causal=True)
    assert attnstep.check_arrays(q, k, v, {"output": o})        # a report is true when every stage passes
    attnstep.assert_attention_stages(q, k, v, {"output": o})   # in a pytest test: the report in the message
    attnstep.check_arrays(q, k, v, {"dQ": q.grad, "dK": k.grad, "dV": v.grad}, do=o.grad)  # backward

Arrays are NumPy arrays (or anything np.asarray takes: a CPU tensor's `.detach().cpu().numpy()`),
shaped (N, d) for one head, (H, N, d) or (B, H, N, d); each stage with the same leading axes and
the stage's own last two (an N×1 stage may drop its last axis). The report is the one `attnstep
check` prints and writes: the same tolerance model, chained and isolated references, diagnoses.
"""
from __future__ import annotations

import math as _math
import numbers
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .check import flash_attn_criterion as fa_criterion
from .check.compare import Options, Report, check_run
from .diagnose.hypotheses import diagnose
from .files.case import InputCase, check_scale, validate_dims
from .files.kinds import CaseError
from .files.outputs import MATH_MODES, RunInfo, StageSource, half_rounding_for
from .model.half import HALF_ROUNDINGS, rounding_refusal
from .report.text import failure_lines, header_lines, summary_lines, table_lines
from .stages import DIM_KEYS, GRAD_INPUT, INPUT_NAMES, PRECISIONS, STAGES, Dims, default_scale
from .text import plural

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
    x = _native_float(np.asarray(x), name)
    want = total * rows * cols
    if x.size != want or (x.ndim >= 2 and x.shape[-2:] != (rows, cols) and not (cols == 1 and x.shape[-1] == rows)):
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {plural(total, 'head')} of {rows}x{cols}")
    return x.reshape(total, rows, cols)


_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
# What a refused dtype is, in words (np.dtype.kind).
_DTYPE_KINDS = {"b": "boolean", "i": "integer", "u": "unsigned integer", "c": "complex", "O": "Python objects",
                "U": "strings", "S": "bytes", "V": "structured", "M": "dates", "m": "time spans"}


def _native_float(x: np.ndarray, name: str) -> np.ndarray:
    """x as float16/32/64 in this machine's byte order: a big-endian array ('>f4', from a file or
    another machine) holds the same values, converted; any other dtype is refused by name."""
    if x.dtype.kind == "f" and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if x.dtype not in _FLOAT_DTYPES:
        kind = _DTYPE_KINDS.get(x.dtype.kind)
        raise ValueError(f"{name}: dtype {x.dtype}{f' ({kind})' if kind else ''}; expected float16, float32 or "
                         "float64 (convert bfloat16 with .float())")
    return x


# ----------------------------------------------------------------------------------------------
# The keyword arguments, validated as the command line validates its options: every error a
# TypeError (the wrong kind of value) or a ValueError (a value out of range), one line naming it.

def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    """A real number (NumPy's scalars included), not a bool: True is not the scale 1."""
    return isinstance(x, numbers.Real) and not _is_bool(x)


def _expect_bool(name: str, x) -> bool:
    if not _is_bool(x):
        raise TypeError(f"{name}: expected True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def _expect_real(name: str, x) -> float:
    if not _is_real(x):
        raise TypeError(f"{name}: expected a number, got {type(x).__name__} {x!r}")
    return float(x)


def _expect_tolerance(name: str, x) -> Optional[float]:
    """None (the error model), or a finite number >= 0 (NaN or inf would make every comparison
    fail or pass), as check's --atol and --rtol."""
    if x is None:
        return None
    value = _expect_real(name, x)
    if not 0 <= value < _math.inf:
        raise ValueError(f"{name} = {x!r}: a tolerance must be finite and >= 0")
    return value


def _expect_scale(name: str, x) -> Optional[float]:
    """None (1/sqrt(d_k)), or what the binary can use: finite and non-zero in float32."""
    if x is None:
        return None
    value = _expect_real(name, x)
    try:
        return check_scale(value, name)
    except CaseError as exc:
        raise ValueError(str(exc)) from None


def _expect_jobs(name: str, x) -> int:
    """Processes checking heads: 0 (as many as cores and memory allow) or more, as check's --jobs."""
    if not isinstance(x, numbers.Integral) or _is_bool(x):
        raise TypeError(f"{name}: expected a whole number >= 0, got {type(x).__name__} {x!r}")
    if x < 0:
        raise ValueError(f"{name} = {x!r}: expected 0 (as many as cores and memory allow) or more")
    return int(x)


def _expect_choice(choices: Tuple[str, ...]) -> Callable[[str, Any], str]:
    def expect(name: str, x) -> str:
        if not isinstance(x, str):
            raise TypeError(f"{name}: expected one of {', '.join(choices)}, got {type(x).__name__} {x!r}")
        if x not in choices:
            raise ValueError(f"{name} {x!r}: expected one of {', '.join(choices)}")
        return x
    return expect


def _expect_mapping(name: str, x) -> Mapping:
    if not isinstance(x, Mapping):
        raise TypeError(f"{name}: expected a mapping of stage name to array, such as {{'output': o}}, got "
                        f"{type(x).__name__}")
    return x


# check_arrays' arguments other than the arrays, and the rule each obeys.
_ARGUMENT_RULES: Dict[str, Callable[[str, Any], Any]] = {
    "stages": _expect_mapping,
    "causal": _expect_bool,
    "scale": _expect_scale,
    "precision": _expect_choice(PRECISIONS),
    "math": _expect_choice(MATH_MODES),
    "half_rounding": lambda name, x: None if x is None else _expect_choice(HALF_ROUNDINGS)(name, x),
    "atol": _expect_tolerance,
    "rtol": _expect_tolerance,
    "jobs": _expect_jobs,
    "allow_nonfinite": _expect_bool,
}


def _validated(**arguments) -> Dict[str, Any]:
    """The arguments, each checked by its rule (and converted: a NumPy bool to bool, a number to float)."""
    return {name: _ARGUMENT_RULES[name](name, value) for name, value in arguments.items()}


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
    except CaseError as exc:
        raise ValueError(str(exc)) from None
    heads = {n: _heads(arrays[n], dims.total_heads, *STAGES[n].shape(dims), n.lower()) for n in arrays}
    bad = [n for n in heads if not allow_nonfinite and not np.isfinite(heads[n]).all()]
    if bad:
        raise ValueError(f"{bad[0].lower()} holds NaN or Inf; pass allow_nonfinite=True to check a kernel on such "
                         "inputs (NaN then passes where the reference has NaN)")
    return dims, heads, default_scale(d_k) if scale is None else scale


def check_arrays(q, k, v, stages: Mapping[str, object], *, do=None, causal: bool = False,
                 scale: Optional[float] = None, precision: str = "fp32", math: str = "ieee",
                 atol: Optional[float] = None, rtol: Optional[float] = None, jobs: int = 1,
                 allow_nonfinite: bool = False, half_rounding: Optional[str] = None) -> Report:
    """Checks each stage in `stages` ({stage name: array}) computed from q, k, v, as `attnstep
    check` does; returns the Report (report.passed, report.first_failing_stage, report.results),
    whose truth value is report.passed: `assert check_arrays(...)` fails when a stage fails
    (assert_attention_stages also puts the report in the message).
    do: the output gradient dL/d(output), shaped like the output, for the backward stages (dQ, dK,
    dV, D, dP, dS, flash_dQ, ...); causal: top-left aligned masking; scale: default 1/sqrt(d_k); precision and math: the
    arithmetic the program used (fp32/tf32/bf16/fp16; ieee/fast); half_rounding: how a bf16/fp16
    program converts to its format ("nearest", the default, or "toward-zero"; half precisions
    only). At fp32 or tf32 a stage of half-precision values (a float16 array; a float32 array of
    bfloat16 values, such as a bf16 tensor's .float()) gets a note, and a hint in the failure line,
    to pass precision='bf16' or 'fp16'; a float16 array counts as float32 results stored in float16
    (half a float16 unit allowed per value). Raises ValueError for arrays that
    do not fit together or a value out of range, TypeError for an argument of the wrong kind
    (causal="no", scale="0.25"), each one line naming the argument."""
    args = _validated(stages=stages, causal=causal, scale=scale, precision=precision, math=math, atol=atol,
                      rtol=rtol, jobs=jobs, allow_nonfinite=allow_nonfinite, half_rounding=half_rounding)
    refusal = rounding_refusal(args["precision"], args["half_rounding"], "half_rounding")
    if refusal:
        raise ValueError(refusal)
    causal, scale, atol, rtol, jobs = args["causal"], args["scale"], args["atol"], args["rtol"], args["jobs"]
    allow_nonfinite = args["allow_nonfinite"]
    backward = sorted(n for n in stages if n in STAGES and STAGES[n].backward)
    if backward and do is None:
        raise ValueError(f"stage {backward[0]!r} is a gradient: pass do= (the output gradient it was computed from)")
    dims, inputs, scale = _problem(q, k, v, causal, scale, allow_nonfinite, do)
    sources = {}
    for name in STAGES:
        if name in stages:
            arr = _heads(stages[name], dims.total_heads, *STAGES[name].shape(dims), name)
            sources[name] = StageSource(name, None, name, arrays=arr)
    unknown = [n for n in stages if n not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; stages are: {', '.join(STAGES)}")
    if not sources:
        raise ValueError("no stage to check: pass at least one of " + ", ".join(STAGES))
    case = InputCase(ARRAYS, dims, "npy", causal, scale, manifest=True, arrays=inputs,
                     allow_nonfinite=allow_nonfinite, backward=do is not None)
    run = RunInfo(None, {}, dims, sources, causal=causal, scale=scale, precision=precision,
                  math=math, half_rounding=half_rounding_for(args["precision"], args["half_rounding"]))
    return check_run(run, case, Options(atol=atol, rtol=rtol, jobs=jobs, allow_nonfinite=allow_nonfinite),
                     diagnoser=diagnose)


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

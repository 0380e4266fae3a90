"""The Python API's keyword arguments (verify/api.py), validated as the command line validates its
options: every error a TypeError (the wrong kind of value) or a ValueError (a value out of range),
one line naming the argument."""
from __future__ import annotations

import math as _math
import numbers
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .check.compare import Report
from .files.arrays import LAYOUTS
from .files.cache_layouts import CACHE_LAYOUTS
from .files.case import check_scale
from .files.kinds import CaseError
from .files.outputs import MATH_MODES
from .files.packed_arrays import PACKED_LAYOUT
from .model.arrays import device_argument
from .model.half import HALF_ROUNDINGS
from .stages import PRECISIONS
from .variant import ALIGNMENTS, MAX_WINDOW, UNBOUNDED, dropout_problem, softcap_problem


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
    try:
        return float(x)
    except OverflowError:  # an int past float's range (10**400)
        raise ValueError(f"{name}: a number beyond a float's range") from None


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


def _expect_causal(name: str, x):
    """False, True (top-left, PyTorch's is_causal) or an alignment."""
    if _is_bool(x):
        return bool(x)
    if isinstance(x, str) and x in ALIGNMENTS:
        return x
    raise TypeError(f"{name}: expected True or False, got {type(x).__name__} {x!r}; or the alignment of the causal "
                    f"mask: {' or '.join(map(repr, ALIGNMENTS))}")


def _expect_window(name: str, x) -> Tuple[int, int]:
    """None (no window) or (left, right), each a number of keys (0..MAX_WINDOW) or -1 (unbounded), as
    flash-attn's window_size."""
    if x is None:
        return (UNBOUNDED, UNBOUNDED)
    if not isinstance(x, (tuple, list)) or len(x) != 2 or not all(isinstance(b, numbers.Integral) and not _is_bool(b)
                                                                  for b in x):
        raise TypeError(f"{name}: expected (left, right), two whole numbers (-1: unbounded), got {x!r}")
    if min(x) < UNBOUNDED or max(x) > MAX_WINDOW:
        raise ValueError(f"{name} = {tuple(x)!r}: each side is a number of keys from 0 to {MAX_WINDOW}, "
                         "or -1 (unbounded)")
    return int(x[0]), int(x[1])


def _expect_softcap(name: str, x) -> float:
    """None or 0 (none), or a finite cap > 0."""
    value = 0.0 if x is None else _expect_real(name, x)
    why = softcap_problem(value)
    if why:
        raise ValueError(f"{name} = {x!r}: {why}")
    return value


def _expect_probability(name: str, x) -> float:
    value = _expect_real(name, x)
    why = dropout_problem(value)
    if why:
        raise ValueError(f"{name} = {x!r}: {why}")
    return value


def _expect_alibi(name: str, x):
    """False, True (the standard slopes) or the slopes (an array or tensor, checked with the shapes)."""
    if _is_bool(x):
        return bool(x)
    if x is None or isinstance(x, (str, bytes, numbers.Number)):
        raise TypeError(f"{name}: expected True, False or the slopes ((H,) or (B, H)), got {type(x).__name__} {x!r}")
    return x


# check_arrays' arguments other than the arrays, and the rule each obeys.
_ARGUMENT_RULES: Dict[str, Callable[[str, Any], Any]] = {
    "stages": _expect_mapping,
    "causal": _expect_causal,
    "align": lambda name, x: None if x is None else _expect_choice(ALIGNMENTS)(name, x),
    "window": _expect_window,
    "softcap": _expect_softcap,
    "alibi": _expect_alibi,
    "dropout_p": _expect_probability,
    "layout": lambda name, x: None if x is None else _expect_choice(LAYOUTS + (PACKED_LAYOUT,))(name, x),
    # (FlashInfer spells its layouts "NHD" and "HND")
    "cache_layout": lambda name, x: _expect_choice(tuple(CACHE_LAYOUTS))(name, x.lower() if isinstance(x, str) else x),
    "scale": _expect_scale,
    "precision": _expect_choice(PRECISIONS),
    "math": _expect_choice(MATH_MODES),
    "half_rounding": lambda name, x: None if x is None else _expect_choice(HALF_ROUNDINGS)(name, x),
    "atol": _expect_tolerance,
    "rtol": _expect_tolerance,
    "jobs": _expect_jobs,
    "device": device_argument,
    "allow_nonfinite": _expect_bool,
    "per_head": _expect_bool,
}


def validated(**arguments) -> Dict[str, Any]:
    """The arguments, each checked by its rule (and converted: a NumPy bool to bool, a number to float)."""
    return {name: _ARGUMENT_RULES[name](name, value) for name, value in arguments.items()}


def expect_report(x) -> Report:
    """The report a check returned (format_report's and flash_attn_criterion's argument)."""
    if not isinstance(x, Report):
        raise TypeError(f"report: expected the Report that check_arrays returns, got {type(x).__name__} {x!r}")
    return x

"""The scale's bugs: a stage that is a factor off the reference (a known factor named), or one
recomputed under a scale programs use by mistake (1/d_k, the scale twice or missing, the default
1/√d_k for the case's own, an exp2 softmax without log2(e))."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from ..check.diagnosis import Diagnosis
from ..check.reference import compute_stage
from ..model.half import is_half, storage_unit
from ..specs import SPECS
from ..stages import INPUT_NAMES, KEYS, QUERIES, STAGES
from .base import MATCH_WIDTHS, SCALE_NAME_RTOL, explains_closely, maxdiff
from .inputs import case_inputs, rebuilder, rows_fit, run_hidden, slope_of, variant_of, variant_tensors, worst_rows


def _feeds_the_scale(stage: str) -> bool:
    """Whether the stage is what a scaling stage scales (QK: a scale found there came too early)."""
    return any(SPECS[s].scaled and stage in STAGES[s].inputs for s in SPECS)


# A program that ignores the case's own scale (a manifest's, or --scale) for the usual 1/√d_k.
_DEFAULT_USED = "the default 1/√d_k used, not the case's scale"
# A softmax by exp2 whose scale does not fold in log2(e): exp2(s·x) = exp(s·ln 2·x).
_EXP2_WITHOUT_LOG2E = "exp2 used without log2(e) folded into the scale (scale·ln 2)"


def wrong_scales(scale: float, d_k: int) -> Dict[str, float]:
    """The scales a program uses by mistake, each with what it is: dividing by d_k instead of √d_k
    first (with the default scale 1/√d_k it is also the scale applied twice: both are named), the
    default 1/√d_k where the case gives another scale (the case's scale ignored), and an exp2
    softmax without log2(e) in its scale."""
    return {"1/d_k used as the scale (divided by d_k, not √d_k)": 1.0 / d_k,
            "scale applied twice": scale * scale, "scale missing": 1.0,
            "multiplied by √d_k instead of divided": d_k ** 0.5,
            _DEFAULT_USED: d_k ** -0.5, _EXP2_WITHOUT_LOG2E: scale * np.log(2.0)}



def scale_names_of(value: float, named: Dict[str, float]) -> List[str]:
    return [n for n, v in named.items() if abs(value - v) <= SCALE_NAME_RTOL * abs(v)]


def _scale_names(f: float, scale: float, d_k: int, stage: str) -> List[str]:
    """What a factor f between got and want is: a known factor, or a known wrong scale used."""
    named = {"√d_k": d_k ** 0.5, "1/√d_k": d_k ** -0.5, "d_k": float(d_k), "1/d_k": 1.0 / d_k}
    if scale != 0.0:
        if SPECS[stage].scaled:
            used = [n for n in scale_names_of(f * scale, wrong_scales(scale, d_k))
                    if n.startswith("1/d_k") or n == _DEFAULT_USED]
            named = {**{n: f for n in used}, **named}  # the scale it used, named first
            named["scale (scale applied twice)"] = scale
            named["1/scale (scale missing)"] = 1.0 / scale
        elif _feeds_the_scale(stage):
            named["scale (QK already scaled)"] = scale
        else:
            named["scale"] = scale
            named["1/scale"] = 1.0 / scale
    return scale_names_of(f, named)


def _factor_words(f: float, names: List[str]) -> str:
    """The factor f's names as a message says them: ` (f = 1/√d_k = scale): what the program did,
    or another reading` (a value is `scale` of `scale (scale applied twice)`)."""
    values, readings = [], []
    for name in names:
        value, _, reading = name.partition(" (")
        if " " in value:  # a whole reading: "1/d_k used as the scale (divided by d_k, not √d_k)"
            readings.append(name)
            continue
        values.append(value)
        readings += [reading.removesuffix(")")] if reading else []
    said = f" ({f:.6g}{''.join(f' = {v}' for v in dict.fromkeys(values))})" if values else ""
    return said + (f": {', or '.join(readings)}" if readings else "")


# A factor this near 1 is no scale: a fraction of a float32 result, or a few units of a half
# format's last place, which a bias of its conversions can give a whole stage (a bf16 kernel that
# rounds an operand of its recomputed scores moves its gradients by 1.002-1.01).
_NEAR_ONE = 1e-3
_NEAR_ONE_UNITS = 4
# A factor names a stage's failure only where it takes away most of it: f·want at least this much
# closer to got than want is. A fit within the match widths that leaves got as far from f·want as
# from want (a bug whose errors lean one way: D from another head's O) is no factor.
_EXPLAINED = 0.5


def _near_one(ctx) -> float:
    head = ctx.head_ctx
    if head is None or not is_half(head.precision):
        return _NEAR_ONE
    return max(_NEAR_ONE, _NEAR_ONE_UNITS * storage_unit(head.precision))


def linear_factor(stage, got, want, ctx, width) -> List[Diagnosis]:
    """got ≈ f·want, f fitted on the entries that are not blank."""
    d_k = ctx.dims.d_k if ctx.dims is not None else 1
    # Entries left blank (0 or NaN where want is not) belong to an unwritten region, not to the
    # scaling: fit the factor on the rest.
    blank = (np.isnan(got) | (got == 0)) & (want != 0) & np.isfinite(want)
    fin = np.isfinite(got) & np.isfinite(want) & ~blank
    if not fin.any() or (np.isfinite(want) != np.isfinite(got))[~blank].any():
        return []
    g, w = got[fin], want[fin]
    ww = float(w @ w)
    if ww <= 0:
        return []
    f = float(g @ w) / ww
    if f == 0 or abs(f - 1) <= _near_one(ctx):
        return []
    diff = maxdiff(got[fin], f * want[fin])
    if diff > MATCH_WIDTHS * width * max(1.0, abs(f)) or diff > _EXPLAINED * maxdiff(got[fin], want[fin]):
        return []
    names = _scale_names(f, ctx.scale, d_k, stage)
    rest = f", apart from {int(blank.sum())} blank entries" if blank.any() else ""
    return [Diagnosis("scaled", f"{stage} is off by a constant factor: got ≈ {f:.6g}·want"
                      f"{_factor_words(f, names)}{rest} (max diff {diff:.2g})",
                      {"factor": f, "names": names, "max_diff": diff}, 0.9)]


def recomputed(stage: str, src: Dict[str, np.ndarray], scale: float, ctx) -> np.ndarray:
    """The stage from `src` at `scale` under the run's variant."""
    v = variant_of(ctx)
    return compute_stage(stage, src, scale, v.causal, variant=v, slope=slope_of(ctx))


def _rescaler(stage, ctx, width):
    """(the stage recomputed under another scale, the width to match it with): from the stage's
    sources when it applies the scale itself, else from the case's inputs; None if neither."""
    if SPECS[stage].scaled and ctx.src:
        return (lambda s2: recomputed(stage, ctx.src, s2, ctx)), width
    built = rebuilder(stage, ctx, width)
    if built is None:
        return None
    qkv, from_inputs = case_inputs(ctx), SPECS[stage].from_inputs
    v, slope = variant_of(ctx), slope_of(ctx)
    qkv = {**variant_tensors(ctx), **qkv}
    return (lambda s2: from_inputs(qkv, s2, None, variant=v, slope=slope)), built[1]


def _row_screen(stage, got, want, ctx, width) -> Optional[Callable[[float], bool]]:
    """A test of a scale on got's worst rows recomputed alone, for a stage the rescaler recomputes
    from the inputs (None where it does not, or where a row's place changes its scores: ALiBi's
    distances, the mask and bias files' rows)."""
    from_inputs, qkv, v = SPECS[stage].from_inputs, case_inputs(ctx), variant_of(ctx)
    # (_rescaler's recomputation from the stage's sources: the inputs' rows stand for it only where
    # those sources are the inputs, not the program's own upstream stages)
    own_sources = SPECS[stage].scaled and ctx.src and not set(STAGES[stage].inputs) <= set(INPUT_NAMES)
    if from_inputs is None or qkv is None or v.alibi or variant_tensors(ctx) or own_sources:
        return None
    n, m = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]
    if got.ndim != 2 or got.shape[0] != n:
        return None
    rows, hidden, slope = worst_rows(got, want), run_hidden(ctx, n, m), slope_of(ctx)

    def at(s2: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        return lambda r, h: from_inputs({**qkv, QUERIES: qkv[QUERIES][r]}, s2, h, variant=v, slope=slope)
    return lambda s2: rows_fit(at(s2), got, rows, hidden.__getitem__, width)


def _wrong_scale(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The stage recomputed with each wrong scale a program uses; every name of the one that fits."""
    d_k, scale = (ctx.dims.d_k if ctx.dims is not None else 1), ctx.scale
    rescaled = _rescaler(stage, ctx, width)
    if rescaled is None:
        return []
    recompute, width = rescaled
    screen = _row_screen(stage, got, want, ctx, width)
    for s2 in dict.fromkeys(wrong_scales(scale, d_k).values()):
        if abs(s2 - scale) <= 1e-6 * abs(scale) or (screen is not None and not screen(s2)):
            continue
        try:
            cand = recompute(s2)
        except (KeyError, ValueError):
            continue
        # (closely: over many keys a wrong scale moves the output little, but its float64 candidate
        # reproduces the program's float32 to its own rounding)
        diff = explains_closely(got, cand, want, width)
        if diff is not None:
            names = scale_names_of(s2, wrong_scales(scale, d_k))
            return [Diagnosis("scaled", f"{stage} used scale {s2:.6g} instead of {scale:.6g}: "
                              f"{', or '.join(names)} (max diff {diff:.2g})",
                              {"factor": s2 / scale, "used_scale": s2, "names": names, "max_diff": diff}, 0.9)]
    return []


def scaled(stage, got, want, ctx, width) -> List[Diagnosis]:
    """got ≈ f·want (linear stages), or the stage recomputed with a wrong scale (nonlinear ones)."""
    found = linear_factor(stage, got, want, ctx, width) if SPECS[stage].linear else []
    return found or _wrong_scale(stage, got, want, ctx, width)

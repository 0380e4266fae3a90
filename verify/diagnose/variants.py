"""The classic bugs of the scores' variants and of dropout, each the stage recomputed as the bug
would have it (verify/diagnose/inputs.py alternatives: from the stage's own sources, or from the
case's inputs where the program wrote no upstream stage), named when that explains got and the
reference does not. Hypotheses of verify/diagnose/hypotheses.py, tried wherever the specs name
"scaled" or "mask" (the stages a wrong score or weight reaches).

Codes: softcap_missing (S not capped), softcap_before_scale (C·tanh(QK/C)·scale: the cap applied
to the unscaled QK), softcap_derivative_missing (dQ, dK from dS without the cap's 1 − t²), alibi_missing, alibi_sign (+slope·|i − j|: the bias grows with the
distance), alibi_alignment (the distance measured from the other alignment's diagonal: top-left
|i − j| in a bottom-right case, or flash-attn's bottom-right one in a top-left case),
alibi_slope_order (another head's slope: the slopes reversed, or shifted by a head),
bias_ignored, bias_transposed (the bias file read transposed), dropout_unscaled (the kept weights
not divided by 1 − p), dropout_not_applied (the keep-mask written but not applied),
dropout_mask_inverted (1 − Z applied: the mask's 1 read as "dropped").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import numpy as np

from ..check.diagnosis import Diagnosis, Suspect
from ..specs import reads_dropout_mask
from ..stages import BIAS_INPUT, DROPOUT_MASK, KEYS, QUERIES, STAGES
from ..variant import ALIGNMENTS, NONE, PER_HEAD, TOP_LEFT, Variant, alibi_bias, alibi_slopes
from .base import explains_closely
from .inputs import alternatives, case_inputs, slope_of, variant_of, variant_tensors
from .mask_words import CONVENTIONS


# The other heads whose slope a head's bias is tried with: the reversed order's, then the nearest.
MAX_SLOPE_HEADS = 6
CODES = ("softcap_missing", "softcap_before_scale", "softcap_derivative_missing", "alibi_missing", "alibi_sign",
         "alibi_alignment", "alibi_slope_order", "bias_ignored", "bias_transposed", "dropout_unscaled",
         "dropout_not_applied", "dropout_mask_inverted")


@dataclass
class Bug:
    """A bug of a variant: its code, what the program did (a user's words), and how the stage is
    recomputed as it would have it: another variant, slope or variant tensor."""
    code: str
    words: str
    variant: Optional[Variant] = None
    slope: Optional[float] = None
    replace: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)


# ---- the candidates -------------------------------------------------------------------------------

def _softcap(v: Variant, scale: float, stage: str) -> Iterator[Bug]:
    cap = v.softcap
    if cap <= 0:
        return
    if STAGES[stage].backward and not STAGES[stage].flash:
        # A stage-path gradient from the program's own dS: without the cap, only its derivative is left out.
        yield Bug("softcap_derivative_missing", f"dS is not multiplied by the softcap's derivative 1 − t² "
                  f"(t = tanh(scale·QK/C), C = {cap:g}) on its way to dQ and dK", v.with_(softcap=0.0),
                  detail={"softcap": cap})
        return
    yield Bug("softcap_missing", f"the softcap C = {cap:g} is not applied: got matches the result without it",
              v.with_(softcap=0.0), detail={"softcap": cap})
    # C·tanh(QK/C)·scale = (C·|scale|)·tanh(scale·QK / (C·|scale|)): a cap of C·|scale| after the scale.
    yield Bug("softcap_before_scale", f"the softcap is applied before the scale: C·tanh(QK/C)·scale instead of "
              f"C·tanh(scale·QK/C) (C = {cap:g}, scale = {scale:.6g})", v.with_(softcap=cap * abs(scale)),
              detail={"softcap": cap, "scale": scale})


def _slopes_of_batch(ctx: Suspect) -> Optional[np.ndarray]:
    """The ALiBi slopes of the head's batch element, by head (the case's, else the standard ones)."""
    dims = ctx.dims
    if dims is None or ctx.head is None:
        return None
    b, _ = dims.decode_head(ctx.head)
    if ctx.slope_of_head is None:
        return alibi_slopes(dims.heads)
    return np.array([ctx.slope_of_head(b * dims.heads + h) for h in range(dims.heads)], np.float64)


def _alibi(v: Variant, ctx: Suspect) -> Iterator[Bug]:
    if not v.alibi:
        return
    slope = slope_of(ctx)
    yield Bug("alibi_missing", f"ALiBi is not applied (slope {slope:.6g}): got matches the result without it",
              v.with_(alibi=False), detail={"slope": slope})
    yield Bug("alibi_sign", f"the ALiBi bias has the wrong sign: +slope·|diag(i) − j| instead of −slope·|diag(i) − j| "
              f"(slope {slope:.6g}): far keys gain instead of lose", slope=-slope, detail={"slope": slope})
    yield from _alibi_alignment(v, ctx, slope)
    slopes = _slopes_of_batch(ctx)
    if slopes is None:
        return
    _, h = ctx.dims.decode_head(ctx.head)
    H = len(slopes)
    others = [o for o in range(H) if o != h and slopes[o] != slope]
    for other in sorted(others, key=lambda o: (o != H - 1 - h, abs(o - h)))[:MAX_SLOPE_HEADS]:
        order = f"head {other}'s slope" + (" (the slopes in reverse head order)" if other == H - 1 - h else "")
        yield Bug("alibi_slope_order", f"the ALiBi slope of head {h} is {slopes[other]:.6g}, {order}, instead of "
                  f"{slope:.6g}", slope=float(slopes[other]),
                  detail={"used_slope": float(slopes[other]), "slope": slope, "used_head": other,
                          "reversed": other == H - 1 - h})


def _alibi_alignment(v: Variant, ctx: Suspect, slope: float) -> Iterator[Bug]:
    """ALiBi's distance measured from the other alignment's diagonal than the mask's: a program that
    aligns its mask one way and its bias the other (flash-attn's ALiBi is bottom-right whatever the
    mask). No variant holds two alignments: the bias is the other alignment's ALiBi term added as a
    bias file, ALiBi off."""
    qkv = case_inputs(ctx)
    if qkv is None or ctx.rows_of_head is not None:  # (a slab's rows: not the whole head's diagonals)
        return
    n, m = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]
    if n == m:
        return
    other = next(a for a in ALIGNMENTS if a != v.align)
    own = variant_tensors(ctx).get(BIAS_INPUT) if v.bias != NONE else None
    bias = alibi_bias(slope, n, m, align=other) + (0.0 if own is None else own)
    yield Bug("alibi_alignment", f"the ALiBi distance is measured from the {other} diagonal, {_distance(other, n, m)} "
              f"({CONVENTIONS[other]}); this case is aligned {v.align}, where it is {_distance(v.align, n, m)} "
              f"({CONVENTIONS[v.align]}) (slope {slope:.6g})",
              v.with_(alibi=False, bias=PER_HEAD if v.bias == NONE else v.bias), replace={BIAS_INPUT: bias},
              detail={"slope": slope, "alignment": other, "case_alignment": v.align})


def _distance(align: str, n: int, m: int) -> str:
    """Row i's distance to key j from the alignment's diagonal, M − N written out."""
    diag = "i" if align == TOP_LEFT else f"i + {m - n}" if m >= n else f"i − {n - m}"
    return f"|{diag} − j|"


def _bias(v: Variant, ctx: Suspect) -> Iterator[Bug]:
    bias = variant_tensors(ctx).get(BIAS_INPUT)
    if v.bias == NONE or bias is None:
        return
    yield Bug("bias_ignored", f"the bias file ({v.bias}) is not added: got matches the result without it",
              v.with_(bias=NONE), detail={"coverage": v.bias})
    n, m = bias.shape
    read = bias.T if n == m else bias.reshape(m, n).T if n > 1 and m > 1 else None
    if read is not None:
        how = "transposed (bias[j, i] for row i, key j)" if n == m else "as column-major (transposed strides)"
        yield Bug("bias_transposed", f"the bias file ({v.bias}) is read {how}", replace={BIAS_INPUT: read},
                  detail={"coverage": v.bias, "how": how})


def _dropout(v: Variant, ctx: Suspect, stage: str) -> Iterator[Bug]:
    keep = variant_tensors(ctx).get(DROPOUT_MASK)
    if v.dropout <= 0 or keep is None or not reads_dropout_mask(stage, v):
        return
    yield Bug("dropout_not_applied", f"the keep-mask the program wrote is not applied (dropout {v.dropout:g}): got "
              "matches attention without dropout", v.with_(dropout=0.0), detail={"dropout": v.dropout})
    yield Bug("dropout_mask_inverted", "the keep-mask is applied inverted: the entries it keeps (1) are dropped and "
              "the dropped ones kept", replace={DROPOUT_MASK: 1.0 - keep}, detail={"dropout": v.dropout})


def bugs(stage: str, ctx: Suspect) -> Iterator[Bug]:
    v = variant_of(ctx)
    yield from _softcap(v, ctx.scale, stage)
    yield from _alibi(v, ctx)
    yield from _bias(v, ctx)
    yield from _dropout(v, ctx, stage)


# ---- the hypothesis -------------------------------------------------------------------------------

def _unscaled(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Dropout's kept weights not divided by 1 − p: every stage they reach linearly (the output, dV)
    is want·(1 − p)."""
    v = variant_of(ctx)
    p = v.dropout
    if p <= 0 or not reads_dropout_mask(stage, v):
        return []
    diff = explains_closely(got, want * (1.0 - p), want, width)
    if diff is None:
        return []
    return [Diagnosis("dropout_unscaled", f"{stage}: the kept weights are not divided by 1 − p = {1 - p:g} "
                      f"(dropout {p:g}): got ≈ want·(1 − p) (max diff {diff:.2g})",
                      {"dropout": p, "factor": 1.0 - p, "max_diff": diff}, 0.96)]


def variants(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The first of the variants' bugs that explains got."""
    found = _unscaled(stage, got, want, ctx, width)
    if found:
        return found
    for bug in bugs(stage, ctx):
        for cand, w in alternatives(stage, ctx, width, bug.variant, bug.slope, bug.replace):
            diff = explains_closely(got, cand, want, w)
            if diff is not None:
                return [Diagnosis(bug.code, f"{stage}: {bug.words} (max diff {diff:.2g})",
                                  {**bug.detail, "max_diff": diff}, 0.95)]
    return []

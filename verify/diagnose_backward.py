"""The backward pass's classic bugs, as hypotheses of verify/diagnose.py: D from the wrong O, dS
without its P factor, a gradient missing the scale, dV from P instead of Pᵀ, and a flash backward
whose lse is in the wrong base. Each rebuilds the failing stage the way the bug would have computed
it, from the program's own upstream files where it wrote them (else the reference chain), and fires
when that explains got while the correct computation does not.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .diagnose_base import LOG2_E, Diagnosis, explains
from .model.attention import causal_mask, softmax_rows
from .specs.backward import (FLASH_SOURCES, DP, DS, DSTAT, FLASH_DK, FLASH_DQ, FLASH_GRADS, FLASH_LSE,
                             GRAD_INDEX, GRAD_OUT, KEYS, PARTNERS, QUERIES, VALUES, WEIGHTS, d_reference, ds_reference,
                             flash_backward)

Own = Callable[[str], np.ndarray]
DQ, DK = PARTNERS[FLASH_DQ], PARTNERS[FLASH_DK]


def _own(ctx) -> Optional[Own]:
    head = ctx.get("head_ctx")
    if head is None:
        return None
    return lambda name: np.asarray(head.own(name), np.float64)


def _flash_src(own: Own) -> Dict[str, np.ndarray]:
    """What the flash backward computes from: the inputs and the program's saved output and lse."""
    return {n: own(n) for n in FLASH_SOURCES}


def _masked(own: Own, causal: bool) -> np.ndarray:
    n, m = own(QUERIES).shape[0], own(KEYS).shape[0]
    return causal_mask(n, m) if causal else np.zeros((n, m), bool)


def _width(ctx, stage: str, width: float) -> float:
    """Candidates built from the reference chain (where the program wrote no upstream file) carry
    the chain's error: allow the chained bound's width as well."""
    head = ctx.get("head_ctx")
    if head is None:
        return width
    from . import tolerance
    try:
        chained = tolerance.chained_bound(stage, head.chain, **head.bound_args())
    except (KeyError, ValueError):
        return width
    finite = chained[np.isfinite(chained)]
    return max(width, float(finite.max()) if finite.size else 0.0)


def _downstream(stage: str, own: Own, scale: float, causal: bool, D=None, dS=None) -> Optional[np.ndarray]:
    """The stage recomputed with D (or, on the stage path, dS) replaced: the stage path from the
    program's own P, dP, K, Q; the flash gradients from its saved output and lse."""
    if stage in FLASH_GRADS:
        return flash_backward(_flash_src(own), scale, _masked(own, causal), D=D)[GRAD_INDEX[stage]]
    if stage == DSTAT:
        return D
    if dS is None:
        dS = ds_reference(own(WEIGHTS), own(DP), D)
    if stage == DS:
        return dS
    if stage == DQ:
        return scale * dS @ own(KEYS)
    if stage == DK:
        return scale * dS.T @ own(QUERIES)
    return None


def _wrong_os(own: Own, scale: float, causal: bool) -> Iterable[Tuple[str, np.ndarray]]:
    """The tensors a program may take for O when it computes D = rowsum(dO∘O)."""
    dO = own(GRAD_OUT)
    yield "dO instead of O (D = rowsum(dO∘dO))", dO
    Q, K, V = own(QUERIES), own(KEYS), own(VALUES)
    S = (Q @ K.T) * scale
    masked = _masked(own, causal)
    S_m = np.where(masked, -np.inf, S)
    m = np.max(S_m, axis=1, keepdims=True)
    e = np.where(masked, 0.0, np.exp(S_m - m))
    yield "O before the division by the row sum (unnormalized)", e @ V
    if causal:
        yield "O without the causal mask", softmax_rows(S) @ V
    if V.shape[0] == Q.shape[0]:
        yield "V instead of O", V


def _problem(ctx) -> Optional[Tuple[Own, float, bool]]:
    """(own, scale, causal) of the head being diagnosed, or None without its context."""
    own = _own(ctx)
    if own is None:
        return None
    return own, float(ctx.get("scale", 1.0)), bool(ctx.get("causal", False))


def _first_match(got, want, width: float, cands: Iterable[Tuple[str, Optional[np.ndarray]]]):
    """(how, max diff) of the first candidate that explains got (see explains), or None."""
    for how, cand in cands:
        diff = None if cand is None else explains(got, cand, want, width)
        if diff is not None:
            return how, diff
    return None


def d_wrong_o(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, causal = problem
    dO = own(GRAD_OUT)
    cands = ((how, _downstream(stage, own, scale, causal, D=d_reference(dO, O)))
             for how, O in _wrong_os(own, scale, causal) if O.shape == dO.shape)
    hit = _first_match(got, want, _width(ctx, stage, width), cands)
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("D_wrong_O", f"{stage}: D = rowsum(dO∘O) was computed from the wrong tensor: "
                      f"{how} (max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.95)]


def _missing_p_candidates(stage, own: Own, scale, causal):
    """The stage with dS = dP − D, masked entries zeroed or not (the flash gradients from the
    program's saved output and lse, the stage path from its dP and D)."""
    masked = _masked(own, causal)
    if stage in FLASH_GRADS:
        _, _, _, _, dP, D, _ = flash_backward(_flash_src(own), scale, masked)
        K, Q = own(KEYS), own(QUERIES)
        for dS in (np.where(masked, 0.0, dP - D), dP - D):
            yield "", scale * dS @ K if stage == FLASH_DQ else scale * dS.T @ Q
        return
    raw = own(DP) - own(DSTAT)
    for dS in (np.where(masked, 0.0, raw), raw):
        yield "", _downstream(stage, own, scale, causal, dS=dS)


def ds_missing_p(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = _problem(ctx)
    if problem is None:
        return []
    hit = _first_match(got, want, _width(ctx, stage, width), _missing_p_candidates(stage, *problem))
    if hit is None:
        return []
    return [Diagnosis("dS_missing_P", f"{stage}: dS lacks its P factor: dS = dP − D instead of P∘(dP − D) "
                      f"(max diff {hit[1]:.2g})", {"max_diff": hit[1]}, 0.95)]


def grad_unscaled(stage, got, want, ctx, width) -> List[Diagnosis]:
    scale = float(ctx.get("scale", 1.0))
    if scale in (0.0, 1.0) or not np.isfinite(scale):
        return []
    hit = _first_match(got, want, width * max(1.0, 1.0 / abs(scale)),
                       (("the scale is missing: got ≈ want/scale", want / scale),
                        ("the scale is applied twice: got ≈ want·scale", want * scale)))
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("grad_unscaled", f"{stage}: {how} (scale {scale:.6g}; dQ = scale·dS·K and "
                      f"dK = scale·dSᵀ·Q) (max diff {diff:.2g})",
                      {"how": how, "scale": scale, "max_diff": diff}, 0.95)]


def dv_untransposed_p(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, causal = problem
    P = flash_backward(_flash_src(own), scale, _masked(own, causal))[3] if stage in FLASH_GRADS else own(WEIGHTS)
    dO = own(GRAD_OUT)
    if P.shape[1] != dO.shape[0]:
        return []  # P·dO needs N = M
    hit = _first_match(got, want, _width(ctx, stage, width), (("", P @ dO),))
    if hit is None:
        return []
    return [Diagnosis("dV_untransposed_P", f"{stage}: dV = P·dO instead of Pᵀ·dO (max diff {hit[1]:.2g})",
                      {"max_diff": hit[1]}, 0.96)]


def flash_lse_base(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The flash backward feeds the natural-log lse into exp2 (or a base-2 one into exp)."""
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, causal = problem
    src = _flash_src(own)
    cands = ((how, flash_backward(src, scale, _masked(own, causal), lse=src[FLASH_LSE] * factor)[GRAD_INDEX[stage]])
             for how, factor in (("the natural-log lse is used as a base-2 one (exp2 without ·log2(e))", np.log(2.0)),
                                 ("a base-2 lse is used as a natural one", LOG2_E)))
    hit = _first_match(got, want, _width(ctx, stage, width), cands)
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("lse_log2", f"{stage}: P = exp(S − lse) with lse in the wrong base: {how} "
                      f"(max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.93)]


HYPOTHESES: Dict[str, Callable] = {"D_wrong_O": d_wrong_o, "dS_missing_P": ds_missing_p,
                                   "grad_unscaled": grad_unscaled, "dV_untransposed_P": dv_untransposed_p}

"""More of the backward's bugs, hypotheses of verify/diagnose/hypotheses.py beside backward.py's:

* grad_wrong_operand: a gradient's GEMM with a wrong operand of the same shape: dQ = scale·dS·V
  (V for K), dK = scale·dSᵀ·dO (dO for Q), dV = dSᵀ·dO (dS for P).
* lse_sum_missing (in a flash backward): P recomputed as exp(S − m), the row maximum alone where
  the lse belongs (log l, the log of the row sum, left out).
* lse_wrong_head: a flash backward that recomputes P against another head's lse.
* dK_untransposed_dS: dK from dS untransposed, dS·Q (square heads) or tile by tile, dV_untransposed_P's
  twin.
* grad_first_tile_only: a gradient summed over its loop's first tile alone (dQ over the first key
  tile, dK and dV over the first query tile: a loop that stops after one).
* grad_scores_scaled: a flash backward that recomputes the scores for P under a wrong scale (the
  scale missing, 1/d_k, applied twice, ...: scales.wrong_scales), its forward right.

Each rebuilds the failing stage the way the bug computes it, from the program's own upstream files
(a flash gradient recomputing P from its saved output and lse), and fires when that explains got
while the correct computation does not.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import LSE_SUM_MISSING, Diagnosis
from ..specs import SPECS
from ..specs.backward.reference import Gradients, grad_keys, grad_queries, grad_values
from ..stages import FLASH_LSE, GRAD_KEYS, GRAD_OUTPUT, KEYS, QUERIES, STAGES, VALUES
from .backward_base import (first_match, gradients, hidden_by, other_heads_stage, problem_of, untransposed_finding,
                            width_for)
from .inputs import key_tiles
from .scales import scale_names_of, wrong_scales

GRAD_WRONG_OPERAND, LSE_WRONG_HEAD = "grad_wrong_operand", "lse_wrong_head"
DK_UNTRANSPOSED, GRAD_FIRST_TILE = "dK_untransposed_dS", "grad_first_tile_only"
GRAD_SCORES_SCALED = "grad_scores_scaled"
CODES = (GRAD_WRONG_OPERAND, LSE_WRONG_HEAD, DK_UNTRANSPOSED, GRAD_FIRST_TILE, GRAD_SCORES_SCALED)

Build = Callable[[Gradients], np.ndarray]
# Each gradient (its spec's rebuild) and the GEMMs with a wrong operand a program may write for it.
_WRONG_OPERANDS: Dict[Callable, Tuple[Tuple[str, Build], ...]] = {
    grad_queries: (("dQ = scale·dS·V instead of scale·dS·K", lambda g: g.scale * g.G @ g.own(VALUES)),),
    grad_keys: (("dK = scale·dSᵀ·dO instead of scale·dSᵀ·Q", lambda g: g.scale * g.G.T @ g.own(GRAD_OUTPUT)),),
    grad_values: (("dV = dSᵀ·dO instead of Pᵀ·dO", lambda g: g.dS.T @ g.own(GRAD_OUTPUT)),),
}


def _setting(stage, ctx):
    """(the head's Gradients, its problem) or None without the head's context."""
    problem = problem_of(ctx)
    if problem is None:
        return None
    return gradients(stage, *problem), problem


def _fits(cand: np.ndarray, got: np.ndarray) -> Optional[np.ndarray]:
    return cand if np.shape(cand) == got.shape else None


def grad_operand(stage, got, want, ctx, width) -> List[Diagnosis]:
    setting = _setting(stage, ctx)
    operands = _WRONG_OPERANDS.get(SPECS[stage].rebuild, ())
    if setting is None or not operands:
        return []
    g = setting[0]

    def cands() -> Iterator[Tuple[str, Optional[np.ndarray]]]:
        for how, build in operands:
            try:
                yield how, _fits(build(g), got)
            except ValueError:  # (operands whose shapes do not multiply: d_k ≠ d_v)
                continue
    hit = first_match(got, want, width_for(ctx, stage, width), cands())
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis(GRAD_WRONG_OPERAND, f"{stage}: a GEMM with the wrong operand: {how} (max diff {diff:.2g})",
                      {"how": how, "max_diff": diff}, 0.95)]


def grad_lse(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A flash backward's P recomputed against the row maximum alone, or against another head's lse."""
    setting = _setting(stage, ctx)
    if setting is None or not STAGES[stage].flash or SPECS[stage].rebuild is None:
        return []
    g, (own, scale, head) = setting
    lse = own(FLASH_LSE)
    scores = np.where(hidden_by(own, head), -np.inf, head.modified((own(QUERIES) @ own(KEYS).T) * scale))
    top = np.max(scores, axis=1, initial=-np.inf).reshape(lse.shape)
    rebuild, width = SPECS[stage].rebuild, width_for(ctx, stage, width)
    hit = first_match(got, want, width, (("", _fits(rebuild(g.replaced(lse=top)), got)),))
    if hit is not None:
        return [Diagnosis(LSE_SUM_MISSING, f"{stage}: P is recomputed as exp(S − m), the row maximum where the lse "
                          "belongs: log l, the log of the row sum, is left out (the lse is m + log l) "
                          f"(max diff {hit[1]:.2g})", {"max_diff": hit[1]}, 0.93)]
    read: Dict[str, int] = {}

    def others() -> Iterator[Tuple[str, Optional[np.ndarray]]]:  # (each head's lse only when those before fail)
        for how, other_lse, other in other_heads_stage(FLASH_LSE, ctx, "lse"):
            if np.shape(other_lse) == np.shape(lse):
                read[how] = other
                yield how, _fits(rebuild(g.replaced(lse=np.asarray(other_lse, np.float64))), got)
    hit = first_match(got, want, width, others())
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis(LSE_WRONG_HEAD, f"{stage}: P is recomputed against another head's lse: {how} "
                      f"(max diff {diff:.2g})", {"how": how, "read_head": read[how], "max_diff": diff}, 0.93)]


def grad_scores_scale(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A flash backward that recomputes S = scale·Q·Kᵀ under a wrong scale (its P = exp(S − lse)
    against the forward's right lse)."""
    setting = _setting(stage, ctx)
    if setting is None or not STAGES[stage].flash or SPECS[stage].rebuild is None or ctx.scale in (0.0,):
        return []
    g, (own, scale, _) = setting
    qk, rebuild = own(QUERIES) @ own(KEYS).T, SPECS[stage].rebuild
    used = {s2: n for n, s2 in wrong_scales(scale, own(QUERIES).shape[1]).items() if abs(s2 - scale) > 1e-6 * scale}
    cands = ((s2, _fits(rebuild(g.replaced(qk=qk * (s2 / scale))), got)) for s2 in used)
    with np.errstate(all="ignore"):
        hit = first_match(got, want, width_for(ctx, stage, width), cands)
    if hit is None:
        return []
    s2, diff = hit
    names = scale_names_of(s2, wrong_scales(scale, own(QUERIES).shape[1]))
    return [Diagnosis(GRAD_SCORES_SCALED, f"{stage}: the backward recomputes the scores with scale {s2:.6g} instead of "
                      f"{scale:.6g}: {', or '.join(names)} (its P = exp(S − lse) against the forward's lse) "
                      f"(max diff {diff:.2g})", {"used_scale": s2, "factor": s2 / scale, "names": names,
                                                 "max_diff": diff}, 0.9)]


def dk_untransposed(stage, got, want, ctx, width) -> List[Diagnosis]:
    setting = _setting(stage, ctx)
    if setting is None or SPECS[stage].rebuild is not grad_keys:
        return []
    g, (own, scale, _) = setting
    return untransposed_finding(stage, got, want, ctx, width, g.G, own(QUERIES), scale, DK_UNTRANSPOSED,
                                (GRAD_KEYS, "scale·dS", QUERIES))


def _first_tiles(rebuild, g: Gradients, tile: int) -> Optional[np.ndarray]:
    """The gradient summed over its loop's first tile of `tile` alone: dQ over the first key tile,
    dK and dV over the first query tile; None where the loop has one tile only."""
    n, m = g.G.shape
    if rebuild is grad_queries:
        return g.scale * g.G[:, :tile] @ g.own(KEYS)[:tile] if tile < m else None
    if tile >= n:
        return None
    if rebuild is grad_keys:
        return g.scale * g.G[:tile].T @ g.own(QUERIES)[:tile]
    if rebuild is grad_values:
        return g.head.dropped(g.P)[:tile].T @ g.own(GRAD_OUTPUT)[:tile]
    return None


def grad_first_tile(stage, got, want, ctx, width) -> List[Diagnosis]:
    setting = _setting(stage, ctx)
    rebuild = SPECS[stage].rebuild
    if setting is None or rebuild not in _WRONG_OPERANDS:
        return []
    g = setting[0]
    cands = ((tile, _first_tiles(rebuild, g, tile)) for tile in key_tiles(ctx))
    hit = first_match(got, want, width_for(ctx, stage, width), ((t, _fits(c, got) if c is not None else None)
                                                               for t, c in cands))
    if hit is None:
        return []
    tile, diff = hit
    loop, rows = ("key", "keys") if rebuild is grad_queries else ("query", "queries")
    return [Diagnosis(GRAD_FIRST_TILE, f"{stage}: summed over the first {loop} tile alone ({tile} {rows}): its loop "
                      f"over the {loop} tiles stops after one (max diff {diff:.2g})",
                      {"tile": tile, "loop": loop, "max_diff": diff}, 0.93)]


# Keys: the hypothesis names the specs list (verify/specs/backward/); each finding's code is its own.
HYPOTHESES: Dict[str, Callable] = {"grad_operand": grad_operand, "grad_lse": grad_lse, "grad_scale": grad_scores_scale,
                                   "dk_untransposed": dk_untransposed, "grad_first_tile": grad_first_tile}

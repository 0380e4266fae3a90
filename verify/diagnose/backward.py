"""The backward pass's classic bugs, as hypotheses of verify/diagnose/hypotheses.py: D from the wrong O
(another head's among them: verify/diagnose/heads.py's other_head_stage), dS without its P factor,
a gradient missing the scale, dV from P instead of Pᵀ (whole, or tile by tile), and a flash backward
whose lse is in the wrong base, whose dQ and dK leave out the softcap's derivative, or whose dQ is
accumulated at the key tile's rows. Each rebuilds the failing stage the way the bug would have
computed it, from the program's own upstream files where it wrote them (else the reference chain),
and fires when that explains got while the correct computation does not.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis
from ..model.attention import softmax_rows
from ..model.scores import HeadVariant
from ..specs.backward import d_reference
from ..stages import FLASH_LSE, GRAD_OUTPUT, GRAD_VALUES, KEYS, OUTPUT, QUERIES, VALUES
from .backward_base import (Own, chained_width, first_match, gradients, hidden_by, other_heads_stage, problem_of,
                            rebuilt, untransposed_finding, width_for)
from .base import LOG2_E


def _wrong_os(own: Own, scale: float, head: HeadVariant) -> Iterable[Tuple[str, np.ndarray]]:
    """The tensors a program may take for O when it computes D = rowsum(dO∘O)."""
    dO = own(GRAD_OUTPUT)
    yield "dO instead of O (D = rowsum(dO∘dO))", dO
    Q, K, V = own(QUERIES), own(KEYS), own(VALUES)
    S = head.modified((Q @ K.T) * scale)
    hidden = hidden_by(own, head)
    S_m = np.where(hidden, -np.inf, S)
    m = np.max(S_m, axis=1, keepdims=True)
    e = np.where(hidden, 0.0, np.exp(S_m - np.where(np.isfinite(m), m, 0.0)))
    yield "O before the division by the row sum (unnormalized)", head.dropped(e) @ V
    if hidden.any():
        yield "O without the mask", head.dropped(softmax_rows(S)) @ V
    if V.shape[0] == Q.shape[0]:
        yield "V instead of O", V


def d_wrong_o(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = problem_of(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    dO = own(GRAD_OUTPUT)
    g = gradients(stage, own, scale, head)
    cands = ((how, rebuilt(stage, g.replaced(D=d_reference(dO, O))))
             for how, O in _wrong_os(own, scale, head) if O.shape == dO.shape)
    hit = first_match(got, want, width_for(ctx, stage, width), cands)
    read = {}
    if hit is None:  # (another head's O is the reference chain's: its width is the chained bound's)
        def others():  # (each head's O computed only when the heads before it fail)
            for how, O, other in other_heads_stage(OUTPUT, ctx, "O"):
                if O.shape == dO.shape:
                    read[how] = other
                    yield how, rebuilt(stage, g.replaced(D=d_reference(dO, O)))
        hit = first_match(got, want, chained_width(ctx, stage, width), others())
    if hit is None:
        return []
    how, diff = hit
    detail = {"how": how, "max_diff": diff, **({"read_head": read[how]} if how in read else {})}
    return [Diagnosis("D_wrong_O", f"{stage}: D = rowsum(dO∘O) was computed from the wrong tensor: "
                      f"{how} (max diff {diff:.2g})", detail, 0.95)]


def _missing_p_candidates(stage, own: Own, scale, head):
    """The stage with dS = dP − D, masked entries zeroed or not (from the program's dP and D on
    the stage path; the flash backward's recomputed from its saved output and lse)."""
    g = gradients(stage, own, scale, head)
    raw = g.dP - g.D
    for dS in (np.where(g.masked, 0.0, raw), raw):
        yield "", rebuilt(stage, g.replaced(dS=dS))


def ds_missing_p(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = problem_of(ctx)
    if problem is None:
        return []
    hit = first_match(got, want, width_for(ctx, stage, width), _missing_p_candidates(stage, *problem))
    if hit is None:
        return []
    return [Diagnosis("dS_missing_P", f"{stage}: dS lacks its P factor: dS = dP − D instead of P∘(dP − D) "
                      f"(max diff {hit[1]:.2g})", {"max_diff": hit[1]}, 0.95)]


def grad_unscaled(stage, got, want, ctx, width) -> List[Diagnosis]:
    scale = ctx.scale
    if scale in (0.0, 1.0) or not np.isfinite(scale):
        return []
    hit = first_match(got, want, width * max(1.0, 1.0 / abs(scale)),
                       (("the scale is missing: got ≈ want/scale", want / scale),
                        ("the scale is applied twice: got ≈ want·scale", want * scale)))
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("grad_unscaled", f"{stage}: {how} (scale {scale:.6g}; dQ = scale·dS·K and "
                      f"dK = scale·dSᵀ·Q) (max diff {diff:.2g})",
                      {"how": how, "scale": scale, "max_diff": diff}, 0.95)]


def dv_untransposed_p(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = problem_of(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    return untransposed_finding(stage, got, want, ctx, width, gradients(stage, own, scale, head).P, own(GRAD_OUTPUT),
                                1.0, "dV_untransposed_P", (GRAD_VALUES, "P", GRAD_OUTPUT))


def flash_lse_base(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The flash backward feeds the natural-log lse into exp2 (or a base-2 one into exp)."""
    problem = problem_of(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    g = gradients(stage, own, scale, head)
    cands = ((how, rebuilt(stage, g.replaced(lse=own(FLASH_LSE) * factor)))
             for how, factor in (("the natural-log lse is used as a base-2 one (exp2 without ·log2(e))", np.log(2.0)),
                                 ("a base-2 lse is used as a natural one", LOG2_E)))
    hit = first_match(got, want, width_for(ctx, stage, width), cands)
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("lse_log2", f"{stage}: P = exp(S − lse) with lse in the wrong base: {how} "
                      f"(max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.93)]


def flash_cap_derivative(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A flash backward whose forward caps the logits (P from C·tanh(S/C)) but whose dQ and dK
    leave out the cap's derivative 1 − t². (The stage path's, from the program's own dS, is a
    variant's bug: verify/diagnose/variants.py.)"""
    problem = problem_of(ctx)
    if problem is None or problem[2].cap <= 0:
        return []
    own, scale, head = problem
    cand = rebuilt(stage, gradients(stage, own, scale, head).replaced(cap_slope=False))
    hit = first_match(got, want, width_for(ctx, stage, width), (("", cand),))
    if hit is None:
        return []
    return [Diagnosis("softcap_derivative_missing", f"{stage}: dS is not multiplied by the softcap's derivative "
                      f"1 − t² (t = tanh(scale·QK/C), C = {head.cap:g}) on its way to dQ and dK "
                      f"(max diff {hit[1]:.2g})", {"softcap": head.cap, "max_diff": hit[1]}, 0.95)]


# The query and key tiles a flash backward's dQ accumulation is tried with (each pair).
DQ_TILES = (16, 32, 64, 128)


def _dq_at_key_rows(G: np.ndarray, K: np.ndarray, scale: float, rows: int, keys: int) -> np.ndarray:
    """dQ as a flash backward that adds each (query tile, key tile) term scale·G[tile]·K[keys] at
    the key tile's first row instead of the query tile's: the rows from keys·b on receive the
    terms of every query tile with key tile b."""
    n, m = G.shape
    out = np.zeros((n, K.shape[1]))
    for c0 in range(0, min(m, n), keys):
        g = G[:, c0:c0 + keys]
        stacked = np.vstack([g, np.zeros(((-n) % rows, g.shape[1]))]).reshape(-1, rows, g.shape[1]).sum(axis=0)
        end = min(c0 + rows, n)
        out[c0:end] += (stacked @ K[c0:c0 + keys])[:end - c0]
    return scale * out


def dq_key_tile_rows(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A flash backward that accumulates dQ at the rows of the key tile (dQ[k0 + r]) where the
    query tile's belong (dQ[q0 + r]), as a loop over key tiles that mixes up its two offsets."""
    problem = problem_of(ctx)
    if problem is None or ctx.rows_of_head is not None:
        return []  # (on a slab of a long head's rows: the bug mixes the terms of every query tile)
    own, scale, head = problem
    G, K = gradients(stage, own, scale, head).G, own(KEYS)
    if G.shape[0] <= min(DQ_TILES):
        return []
    cands = (((rows, keys), _dq_at_key_rows(G, K, scale, rows, keys)) for rows in DQ_TILES for keys in DQ_TILES
             if rows < G.shape[0] or keys < G.shape[1])
    hit = first_match(got, want, width_for(ctx, stage, width), cands)
    if hit is None:
        return []
    (rows, keys), diff = hit
    return [Diagnosis("dq_key_tile_rows", f"{stage}: dQ is accumulated at the key tile's rows: the term of query "
                      f"tile q and key tile k (tiles of {rows} queries and {keys} keys) is added at row {keys}·k "
                      f"instead of {rows}·q (max diff {diff:.2g})",
                      {"query_tile": rows, "key_tile": keys, "max_diff": diff}, 0.95)]


# The codes only the backward's hypotheses give (lse_log2 is the forward's too).
CODES = ("D_wrong_O", "dS_missing_P", "grad_unscaled", "dV_untransposed_P", "softcap_derivative_missing",
         "dq_key_tile_rows")
# Keys: the hypothesis names the specs list (verify/specs/); each finding's code is its own.
HYPOTHESES: Dict[str, Callable] = {"grad_lse_log2": flash_lse_base, "D_wrong_O": d_wrong_o,
                                   "dS_missing_P": ds_missing_p, "grad_unscaled": grad_unscaled,
                                   "dV_untransposed_P": dv_untransposed_p, "cap_derivative": flash_cap_derivative,
                                   "dq_rows": dq_key_tile_rows}

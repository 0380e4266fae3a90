"""The backward pass's classic bugs, as hypotheses of verify/diagnose/hypotheses.py: D from the wrong O
(another head's among them: verify/diagnose/heads.py's other_head_stage), dS without its P factor,
a gradient missing the scale, dV from P instead of Pᵀ (whole, or tile by tile), and a flash backward
whose lse is in the wrong base, whose dQ and dK leave out the softcap's derivative, or whose dQ is
accumulated at the key tile's rows. Each rebuilds the failing stage the way the bug would have
computed it, from the program's own upstream files where it wrote them (else the reference chain),
and fires when that explains got while the correct computation does not.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis
from ..model.attention import softmax_rows
from ..model.scores import HeadVariant
from ..specs import SPECS
from ..specs.backward import Gradients, d_reference
from ..stages import FLASH_LSE, GRAD_OUTPUT, KEYS, OUTPUT, QUERIES, STAGES, VALUES
from .base import LOG2_E, MAX_HEAD_OFFSET, explains_closely
from .heads import neighbours, other_head_stage
from .inputs import key_tiles

Own = Callable[[str], np.ndarray]


def _own(ctx) -> Optional[Own]:
    head = ctx.head_ctx
    if head is None:
        return None
    return lambda name: np.asarray(head.own(name), np.float64)


def _masked(own: Own, head: HeadVariant) -> np.ndarray:
    """Where the head's variant hides a key (the causal mask, the window, the mask and bias files)."""
    return head.hidden(own(QUERIES).shape[0], own(KEYS).shape[0])


def _gradients(stage: str, own: Own, scale: float, head: HeadVariant) -> Gradients:
    """What the stage is computed from: the program's own P, dP, D on the stage path; recomputed
    from its saved output and lse in the flash backward (under the head's variant)."""
    return Gradients(own, scale, _masked(own, head), recompute=STAGES[stage].flash, head=head)


def _rebuilt(stage: str, g: Gradients) -> Optional[np.ndarray]:
    """The stage from g (its spec's rebuild), None where it has none."""
    rebuild = SPECS[stage].rebuild
    return None if rebuild is None else rebuild(g)


def _width(ctx, stage: str, width: float) -> float:
    """Candidates built from the reference chain (where the program wrote no upstream file) carry
    the chain's error: allow the chained bound's width as well."""
    head = ctx.head_ctx
    if head is None or all(n in head.got for n in STAGES[stage].inputs):
        return width  # every candidate is built from the program's own files
    return _chained_width(ctx, stage, width)


def _chained_width(ctx, stage: str, width: float) -> float:
    """The width of a candidate built from the reference chain: the chained bound's, at least."""
    head = ctx.head_ctx
    try:
        chained = tolerance.chained_bound(stage, head.chain, **head.bound_args())
    except (KeyError, ValueError):
        return width
    finite = chained[np.isfinite(chained)]
    return max(width, float(finite.max()) if finite.size else 0.0)


def _wrong_os(own: Own, scale: float, head: HeadVariant) -> Iterable[Tuple[str, np.ndarray]]:
    """The tensors a program may take for O when it computes D = rowsum(dO∘O)."""
    dO = own(GRAD_OUTPUT)
    yield "dO instead of O (D = rowsum(dO∘dO))", dO
    Q, K, V = own(QUERIES), own(KEYS), own(VALUES)
    S = head.modified((Q @ K.T) * scale)
    masked = _masked(own, head)
    S_m = np.where(masked, -np.inf, S)
    m = np.max(S_m, axis=1, keepdims=True)
    e = np.where(masked, 0.0, np.exp(S_m - np.where(np.isfinite(m), m, 0.0)))
    yield "O before the division by the row sum (unnormalized)", head.dropped(e) @ V
    if masked.any():
        yield "O without the mask", head.dropped(softmax_rows(S)) @ V
    if V.shape[0] == Q.shape[0]:
        yield "V instead of O", V


def _problem(ctx) -> Optional[Tuple[Own, float, HeadVariant]]:
    """(own, scale, the head's variant) of the head being diagnosed, or None without its context."""
    own = _own(ctx)
    if own is None:
        return None
    return own, ctx.scale, ctx.head_ctx.head()


def rebuilt_with(stage: str, ctx, replaced: Dict[str, np.ndarray], qk: Optional[np.ndarray] = None
                 ) -> Optional[np.ndarray]:
    """The stage rebuilt from the program's own files (a flash gradient recomputing P from its
    saved lse) with some sources replaced (an operand as a kernel rounded it), or the Q·Kᵀ its
    scores are recomputed from (qk), None without the head's context."""
    problem = _problem(ctx)
    if problem is None:
        return None
    own, scale, head = problem
    return _rebuilt(stage, _gradients(stage, lambda name: replaced[name] if name in replaced else own(name),
                                      scale, head).replaced(qk=qk))


def _first_match(got, want, width: float, cands: Iterable[Tuple[str, Optional[np.ndarray]]]):
    """(how, max diff) of the first candidate that explains got (see explains_closely), or None."""
    for how, cand in cands:
        diff = None if cand is None else explains_closely(got, cand, want, width)
        if diff is not None:
            return how, diff
    return None


def _other_heads_os(ctx) -> Iterable[Tuple[str, np.ndarray, int]]:
    """(how, O, the head) of another query head's O (its reference), as a program whose offset into
    O is off reads it: the heads next to it, the first and the last, then those up to
    MAX_HEAD_OFFSET away, nearest first."""
    dims, head = ctx.dims, ctx.head
    if dims is None or head is None:
        return
    near = neighbours(dims.total_heads, head)
    rest = sorted((j for j in range(max(0, head - MAX_HEAD_OFFSET), min(dims.total_heads, head + MAX_HEAD_OFFSET + 1))
                   if j != head and j not in near), key=lambda j: abs(j - head))
    for other in near + rest:
        O = other_head_stage(OUTPUT, ctx, other)
        if O is not None:
            which = {head + 1: "the next head's", head - 1: "the previous head's", 0: "the first head's",
                     dims.total_heads - 1: "the last head's"}.get(other, f"{other - head:+d} heads away")
            yield f"the O of head {other} ({which}) instead of its own, head {head}", O, other


def d_wrong_o(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    dO = own(GRAD_OUTPUT)
    g = _gradients(stage, own, scale, head)
    cands = ((how, _rebuilt(stage, g.replaced(D=d_reference(dO, O))))
             for how, O in _wrong_os(own, scale, head) if O.shape == dO.shape)
    hit = _first_match(got, want, _width(ctx, stage, width), cands)
    read = {}
    if hit is None:  # (another head's O is the reference chain's: its width is the chained bound's)
        def others():  # (each head's O computed only when the heads before it fail)
            for how, O, other in _other_heads_os(ctx):
                if O.shape == dO.shape:
                    read[how] = other
                    yield how, _rebuilt(stage, g.replaced(D=d_reference(dO, O)))
        hit = _first_match(got, want, _chained_width(ctx, stage, width), others())
    if hit is None:
        return []
    how, diff = hit
    detail = {"how": how, "max_diff": diff, **({"read_head": read[how]} if how in read else {})}
    return [Diagnosis("D_wrong_O", f"{stage}: D = rowsum(dO∘O) was computed from the wrong tensor: "
                      f"{how} (max diff {diff:.2g})", detail, 0.95)]


def _missing_p_candidates(stage, own: Own, scale, head):
    """The stage with dS = dP − D, masked entries zeroed or not (from the program's dP and D on
    the stage path; the flash backward's recomputed from its saved output and lse)."""
    g = _gradients(stage, own, scale, head)
    raw = g.dP - g.D
    for dS in (np.where(g.masked, 0.0, raw), raw):
        yield "", _rebuilt(stage, g.replaced(dS=dS))


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
    scale = ctx.scale
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


def _untransposed_tiles(P: np.ndarray, dO: np.ndarray, tile: int) -> np.ndarray:
    """dV as a flash backward over square tiles of `tile` queries and keys that adds P_tile·dO_tile
    where P_tileᵀ·dO_tile belongs: dV[c·t + a] = Σ_r Σ_b P[r·t + a, c·t + b]·dO[r·t + b], the tiles
    past the ends padded with zeros (a kernel's masked P and unread dO rows)."""
    n, m = P.shape
    rows, cols = -(-n // tile), -(-m // tile)
    padded = np.zeros((rows * tile, cols * tile))
    padded[:n, :m] = P
    d_out = np.zeros((rows * tile, dO.shape[1]))
    d_out[:n] = dO
    blocks = np.einsum("racb,rbd->cad", padded.reshape(rows, tile, cols, tile), d_out.reshape(rows, tile, -1))
    return blocks.reshape(cols * tile, -1)[:m]


def _untransposed_candidates(P: np.ndarray, dO: np.ndarray, ctx):
    """(the square tile's width, 0 for the whole matrix; dV from P untransposed): P·dO where N = M,
    then tile by tile for the run's own key tile width and the usual ones, below N or M."""
    n, m = P.shape
    if n == m:
        yield 0, P @ dO
    for tile in key_tiles(ctx):
        if tile < max(n, m):
            yield tile, _untransposed_tiles(P, dO, tile)


def dv_untransposed_p(stage, got, want, ctx, width) -> List[Diagnosis]:
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    P = _gradients(stage, own, scale, head).P
    dO = own(GRAD_OUTPUT)
    if P.shape[0] != dO.shape[0] or P.shape[1] != got.shape[0]:
        return []
    hit = _first_match(got, want, _width(ctx, stage, width), _untransposed_candidates(P, dO, ctx))
    if hit is None:
        return []
    tile, diff = hit
    how = ("dV = P·dO instead of Pᵀ·dO" if not tile else
           f"dV accumulated tile by tile as P_tile·dO_tile instead of P_tileᵀ·dO_tile (square tiles of {tile} "
           "queries and keys: each tile of P used untransposed)")
    return [Diagnosis("dV_untransposed_P", f"{stage}: {how} (max diff {diff:.2g})",
                      {"tile": tile, "max_diff": diff}, 0.96)]


def flash_lse_base(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The flash backward feeds the natural-log lse into exp2 (or a base-2 one into exp)."""
    problem = _problem(ctx)
    if problem is None:
        return []
    own, scale, head = problem
    g = _gradients(stage, own, scale, head)
    cands = ((how, _rebuilt(stage, g.replaced(lse=own(FLASH_LSE) * factor)))
             for how, factor in (("the natural-log lse is used as a base-2 one (exp2 without ·log2(e))", np.log(2.0)),
                                 ("a base-2 lse is used as a natural one", LOG2_E)))
    hit = _first_match(got, want, _width(ctx, stage, width), cands)
    if hit is None:
        return []
    how, diff = hit
    return [Diagnosis("lse_log2", f"{stage}: P = exp(S − lse) with lse in the wrong base: {how} "
                      f"(max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.93)]


def flash_cap_derivative(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A flash backward whose forward caps the logits (P from C·tanh(S/C)) but whose dQ and dK
    leave out the cap's derivative 1 − t². (The stage path's, from the program's own dS, is a
    variant's bug: verify/diagnose/variants.py.)"""
    problem = _problem(ctx)
    if problem is None or problem[2].cap <= 0:
        return []
    own, scale, head = problem
    cand = _rebuilt(stage, _gradients(stage, own, scale, head).replaced(cap_slope=False))
    hit = _first_match(got, want, _width(ctx, stage, width), (("", cand),))
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
    problem = _problem(ctx)
    if problem is None or ctx.rows_of_head is not None:
        return []  # (on a slab of a long head's rows: the bug mixes the terms of every query tile)
    own, scale, head = problem
    G, K = _gradients(stage, own, scale, head).G, own(KEYS)
    if G.shape[0] <= min(DQ_TILES):
        return []
    cands = (((rows, keys), _dq_at_key_rows(G, K, scale, rows, keys)) for rows in DQ_TILES for keys in DQ_TILES
             if rows < G.shape[0] or keys < G.shape[1])
    hit = _first_match(got, want, _width(ctx, stage, width), cands)
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

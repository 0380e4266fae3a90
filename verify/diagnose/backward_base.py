"""What the backward's hypotheses (verify/diagnose/backward.py, backward_operands.py) share: the
failing stage rebuilt from the program's own upstream files (a flash gradient recomputing P from
its saved lse) with a part replaced by a bug's, the width a candidate is matched with, and the first
candidate that explains got."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis
from ..model.scores import HeadVariant
from ..specs import SPECS
from ..specs.backward import Gradients
from ..stages import KEYS, QUERIES, STAGES
from .base import MAX_HEAD_OFFSET, explains_closely
from .heads import neighbours, other_head_stage
from .inputs import key_tiles

Own = Callable[[str], np.ndarray]


def own_files(ctx) -> Optional[Own]:
    head = ctx.head_ctx
    if head is None:
        return None
    return lambda name: np.asarray(head.own(name), np.float64)


def hidden_by(own: Own, head: HeadVariant) -> np.ndarray:
    """Where the head's variant hides a key (the causal mask, the window, the mask and bias files)."""
    return head.hidden(own(QUERIES).shape[0], own(KEYS).shape[0])


def gradients(stage: str, own: Own, scale: float, head: HeadVariant) -> Gradients:
    """What the stage is computed from: the program's own P, dP, D on the stage path; recomputed
    from its saved output and lse in the flash backward (under the head's variant)."""
    return Gradients(own, scale, hidden_by(own, head), recompute=STAGES[stage].flash, head=head)


def rebuilt(stage: str, g: Gradients) -> Optional[np.ndarray]:
    """The stage from g (its spec's rebuild), None where it has none."""
    rebuild = SPECS[stage].rebuild
    return None if rebuild is None else rebuild(g)


def width_for(ctx, stage: str, width: float) -> float:
    """Candidates built from the reference chain (where the program wrote no upstream file) carry
    the chain's error: allow the chained bound's width as well."""
    head = ctx.head_ctx
    if head is None or all(n in head.got for n in STAGES[stage].inputs):
        return width  # every candidate is built from the program's own files
    return chained_width(ctx, stage, width)


def chained_width(ctx, stage: str, width: float) -> float:
    """The width of a candidate built from the reference chain: the chained bound's, at least."""
    head = ctx.head_ctx
    try:
        chained = tolerance.chained_bound(stage, head.chain, **head.bound_args())
    except (KeyError, ValueError):
        return width
    finite = chained[np.isfinite(chained)]
    return max(width, float(finite.max()) if finite.size else 0.0)


def problem_of(ctx) -> Optional[Tuple[Own, float, HeadVariant]]:
    """(own, scale, the head's variant) of the head being diagnosed, or None without its context."""
    own = own_files(ctx)
    if own is None:
        return None
    return own, ctx.scale, ctx.head_ctx.head()


def rebuilt_with(stage: str, ctx, replaced: Dict[str, np.ndarray], qk: Optional[np.ndarray] = None
                 ) -> Optional[np.ndarray]:
    """The stage rebuilt from the program's own files (a flash gradient recomputing P from its
    saved lse) with some sources replaced (an operand as a kernel rounded it), or the Q·Kᵀ its
    scores are recomputed from (qk), None without the head's context."""
    problem = problem_of(ctx)
    if problem is None:
        return None
    own, scale, head = problem
    return rebuilt(stage, gradients(stage, lambda name: replaced[name] if name in replaced else own(name),
                                      scale, head).replaced(qk=qk))


def first_match(got, want, width: float, cands: Iterable[Tuple[str, Optional[np.ndarray]]]):
    """(how, max diff) of the first candidate that explains got (see explains_closely), or None."""
    for how, cand in cands:
        diff = None if cand is None else explains_closely(got, cand, want, width)
        if diff is not None:
            return how, diff
    return None


def other_heads_stage(stage: str, ctx, label: str) -> Iterable[Tuple[str, np.ndarray, int]]:
    """(how, the stage, the head) of another query head's `stage` (its reference: O, the lse; said
    as `label`), as a program whose offset into it is off reads it: the heads next to it, the first
    and the last, then those up to MAX_HEAD_OFFSET away, nearest first."""
    dims, head = ctx.dims, ctx.head
    if dims is None or head is None:
        return
    near = neighbours(dims.total_heads, head)
    rest = sorted((j for j in range(max(0, head - MAX_HEAD_OFFSET), min(dims.total_heads, head + MAX_HEAD_OFFSET + 1))
                   if j != head and j not in near), key=lambda j: abs(j - head))
    for other in near + rest:
        O = other_head_stage(stage, ctx, other)
        if O is not None:
            which = {head + 1: "the next head's", head - 1: "the previous head's", 0: "the first head's",
                     dims.total_heads - 1: "the last head's"}.get(other, f"{other - head:+d} heads away")
            yield f"the {label} of head {other} ({which}) instead of its own, head {head}", O, other


def untransposed_tiles(P: np.ndarray, dO: np.ndarray, tile: int) -> np.ndarray:
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


def untransposed_candidates(P: np.ndarray, dO: np.ndarray, ctx):
    """(the square tile's width, 0 for the whole matrix; dV from P untransposed): P·dO where N = M,
    then tile by tile for the run's own key tile width and the usual ones, below N or M."""
    n, m = P.shape
    if n == m:
        yield 0, P @ dO
    for tile in key_tiles(ctx):
        if tile < max(n, m):
            yield tile, untransposed_tiles(P, dO, tile)


def untransposed_finding(stage: str, got, want, ctx, width: float, X: np.ndarray, Y: np.ndarray, factor: float,
                         code: str, names: Tuple[str, str, str]) -> List[Diagnosis]:
    """A gradient summed over the query rows, factor·Xᵀ·Y (dV: P and dO; dK: dS and Q, the scale),
    computed with X untransposed: factor·X·Y where N = M, or tile by tile over square tiles
    (untransposed_candidates); names: how the message says the gradient, X and Y ("dK", "scale·dS",
    "Q")."""
    if X.shape[0] != Y.shape[0] or X.shape[1] != got.shape[0]:
        return []
    cands = ((tile, factor * c) for tile, c in untransposed_candidates(X, Y, ctx))
    hit = first_match(got, want, width_for(ctx, stage, width), cands)
    if hit is None:
        return []
    tile, diff = hit
    grad, x, y = names
    bare = x.split("·")[-1]
    how = (f"{grad} = {x}·{y} instead of {x}ᵀ·{y}" if not tile else
           f"{grad} accumulated tile by tile as {bare}_tile·{y}_tile instead of {bare}_tileᵀ·{y}_tile (square tiles "
           f"of {tile} queries and keys: each tile of {bare} used untransposed)")
    return [Diagnosis(code, f"{stage}: {how} (max diff {diff:.2g})", {"tile": tile, "max_diff": diff}, 0.96)]

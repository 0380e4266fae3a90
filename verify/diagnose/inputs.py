"""Bugs seen where a program wrote no upstream stage: the stage recomputed from the case's Q, K, V
(its spec's from_inputs) as the bug would have it. Hypotheses of verify/diagnose/hypotheses.py.

overflow: a softmax without the row max subtracted; exp overflows float32 where a row's logits
pass log(FLT_MAX) ≈ 88.7, and inf/inf is NaN. keys_past_end: a key tile read past the end of the
keys (the next head's first keys, or zero padding) enters every row's softmax unmasked.
keys_dropped: the keys past the last full tile are left out of every row.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis, Suspect
from ..model.attention import causal_mask, log_sum_exp_rows
from ..specs import SPECS
from ..stages import INPUT_NAMES, KEYS, QUERIES, SCALED_SCORES, STAGES, VALUES
from ..text import plural
from .base import DISTINCT_WIDTHS, KEY_TILES, LOG_FLOAT32_MAX, MATCH_WIDTHS, OVERFLOW_SLACK, maxdiff, width_of

Rebuild = Callable[[Dict[str, np.ndarray], np.ndarray], np.ndarray]  # (Q, K, V), masked -> the stage


def case_inputs(ctx: Suspect) -> Optional[Dict[str, np.ndarray]]:
    """This head's Q, K, V (float64): the head's context, else the sources when they are the inputs."""
    have = ctx.head_ctx.inputs if ctx.head_ctx is not None else ctx.src
    if not all(n in have for n in INPUT_NAMES):
        return None
    return {n: np.asarray(have[n], dtype=np.float64) for n in INPUT_NAMES}


def run_mask(n: int, m: int, causal: bool) -> np.ndarray:
    """The mask the run asks for (top-left causal, or none) on an n×m problem."""
    return causal_mask(n, m) if causal else np.zeros((n, m), bool)


def rebuilder(stage: str, ctx: Suspect, width: float) -> Optional[Tuple[Rebuild, float]]:
    """(the stage from any Q, K, V and mask at the run's scale, one tolerance width for matching
    it), or None where the stage cannot be recomputed from the inputs or the program wrote a stage
    it is computed from. A stage whose isolated
    reference starts from upstream stages (output from the weights) carries the whole chain's
    error when recomputed from the inputs: its width is then the chained bound's."""
    from_inputs = SPECS[stage].from_inputs
    if from_inputs is None or case_inputs(ctx) is None:
        return None
    hc = ctx.head_ctx
    upstream = set(STAGES[stage].inputs) - set(INPUT_NAMES)
    if hc is not None and any(n in hc.got for n in upstream):
        return None  # its own upstream files explain it, or name the bug where it began
    if hc is not None and upstream and stage in hc.chain:
        chained = tolerance.chained_bound(stage, hc.chain, **hc.bound_args())
        width = max(width, width_of(chained, hc.chain[stage]))
    return (lambda qkv, masked: from_inputs(qkv, ctx.scale, masked)), width


def explains_rows(got: np.ndarray, cand: np.ndarray, want: np.ndarray, width: float,
                  judged: np.ndarray) -> Optional[float]:
    """max|got - cand| over the judged rows when cand explains them and differs from want there by
    far more than rounding, else None. At least half of the rows must be judged."""
    if cand.shape != got.shape or judged.sum() < max(1, got.shape[0] / 2):
        return None
    diff = maxdiff(got[judged], cand[judged])
    if not diff <= MATCH_WIDTHS * width or not maxdiff(cand[judged], want[judged]) > DISTINCT_WIDTHS * width:
        return None
    return diff


def blank_rows(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Rows holding only zeros or NaN where the reference does not: never written (the unwritten
    diagnosis names them), so no other bug is judged there."""
    blank = (np.isnan(got) | (got == 0)) & ~((got == want) | (np.isnan(got) & np.isnan(want)))
    return blank.all(axis=1)


# ---- overflow -----------------------------------------------------------------------------------

def logits(ctx: Suspect) -> Optional[np.ndarray]:
    """The scaled, masked scores (-inf where masked): the sources' or recomputed from the inputs."""
    own = ctx.src.get(SCALED_SCORES)  # the softmax's: the program's own scores
    if own is not None:
        return np.asarray(own, dtype=np.float64)
    qkv = case_inputs(ctx)
    if qkv is None:
        return None
    s = (qkv[QUERIES] @ qkv[KEYS].T) * ctx.scale
    return np.where(run_mask(*s.shape, ctx.causal), -np.inf, s)


def overflow(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Non-finite values only in rows whose exp sum overflows float32 (and, in a stage of the
    scores' shape, only at logits that overflow exp themselves): a softmax computed without the
    row max subtracted. A region never written follows no logits."""
    bad = ~np.isfinite(got) & np.isfinite(want)
    s = logits(ctx) if bad.any() else None
    if s is None or s.shape[0] != got.shape[0]:
        return []
    limit = LOG_FLOAT32_MAX - OVERFLOW_SLACK
    with np.errstate(invalid="ignore", over="ignore"):
        row_lse = log_sum_exp_rows(s)[:, 0]
    over_rows = row_lse > limit
    if not over_rows[bad.any(axis=1)].all():
        return []
    if s.shape == got.shape and not (s[bad] > limit).all():
        return []
    rows = np.flatnonzero(bad.any(axis=1))
    return [Diagnosis("overflow", f"{stage}: {plural(int(bad.sum()), 'non-finite value')} in "
                      f"{plural(len(rows), 'row')} whose logits reach {float(s[rows].max()):.4g} (exp overflows "
                      f"float32 past {LOG_FLOAT32_MAX:.4g}): the softmax did not subtract the row max before exp, "
                      "and inf/inf is NaN", {"count": int(bad.sum()), "rows": len(rows),
                                              "max_logit": float(s[rows].max())}, 0.96)]


# ---- keys past the end of the last tile, or left out ---------------------------------------------

def _tiles(ctx: Suspect) -> List[int]:
    """Key tile widths to try: the run's own first, then the usual ones."""
    own = [int(ctx.flash_tiles[1])] if ctx.flash_tiles and ctx.flash_tiles[1] else []
    return own + [t for t in KEY_TILES if t not in own]


def _by_count(tiles: List[int], count: Callable[[int], int]) -> Dict[int, List[int]]:
    """Tile widths grouped by the number of keys they would drop or add (0: none)."""
    out: Dict[int, List[int]] = {}
    for t in tiles:
        k = count(t)
        if k > 0:
            out.setdefault(k, []).append(t)
    return out


def _tile_words(tiles: List[int]) -> str:
    """'32', '16 or 32', '32, 64 or 128' (every width that drops or adds the same keys)."""
    names = [str(t) for t in tiles]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _past_end_sources(ctx: Suspect, extra: int):
    """What a tile reading `extra` keys past the end finds: the next head's first keys (heads lie one
    after another in memory), or zero padding."""
    head, dims = ctx.head, ctx.dims
    if ctx.inputs_of_head is not None and head is not None and dims is not None and head + 1 < dims.total_heads:
        nxt = ctx.inputs_of_head(head + 1)
        if np.asarray(nxt[KEYS]).shape[0] >= extra:
            yield f"the next head's first {plural(extra, 'key')}", nxt[KEYS][:extra], nxt[VALUES][:extra]
    yield f"{plural(extra, 'zero key')} (padding, not masked)", 0.0, 0.0


def _past_end_judged(got, want, ctx, extra: int):
    """The rows to judge: every written row, then, for a head after the first, all but its first
    `extra`, where the previous head's tile wrote its rows past the end (its output's overrun)."""
    judged = ~blank_rows(got, want)
    yield judged, 0
    if ctx.head:
        rest = judged.copy()
        rest[:extra] = False
        yield rest, min(extra, got.shape[0])


def _extended(qkv, extra: int, k_tail, v_tail) -> Dict[str, np.ndarray]:
    out = {QUERIES: qkv[QUERIES]}
    for name, tail in ((KEYS, k_tail), (VALUES, v_tail)):
        x = qkv[name]
        out[name] = np.concatenate([x, np.broadcast_to(np.asarray(tail, np.float64), (extra, x.shape[1]))])
    return out


def _keys_past_end(stage, got, want, ctx, rebuild, width, qkv) -> List[Diagnosis]:
    m, n = qkv[KEYS].shape[0], got.shape[0]
    for extra, tiles in _by_count(_tiles(ctx), lambda t: -m % t).items():
        for words, k_tail, v_tail in _past_end_sources(ctx, extra):
            cand = rebuild(_extended(qkv, extra, k_tail, v_tail), run_mask(n, m + extra, ctx.causal))
            for judged, overrun in _past_end_judged(got, want, ctx, extra):
                diff = explains_rows(got, cand, want, width, judged)
                if diff is None:
                    continue
                rest = f"; rows 0..{overrun - 1} hold other values (the previous head's overrun)" if overrun else ""
                return [Diagnosis("keys_past_end", f"{stage}: the last key tile reads past the end of the keys "
                                  f"(a tile of {_tile_words(tiles)} keys): {words} enter every row's softmax "
                                  f"(max diff {diff:.2g}){rest}", {"extra_keys": extra, "tiles": tiles,
                                                                   "source": words, "max_diff": diff}, 0.92)]
    return []


def _keys_dropped(stage, got, want, ctx, rebuild, width, qkv) -> List[Diagnosis]:
    m = qkv[KEYS].shape[0]
    n = got.shape[0]
    for dropped, tiles in _by_count(_tiles(ctx), lambda t: m % t if t < m else 0).items():
        kept = m - dropped
        cut = {QUERIES: qkv[QUERIES], KEYS: qkv[KEYS][:kept], VALUES: qkv[VALUES][:kept]}
        judged = ~blank_rows(got, want)
        diff = explains_rows(got, rebuild(cut, run_mask(n, m, ctx.causal)[:, :kept]), want, width, judged)
        if diff is None:
            continue
        blank = int((~judged).sum())
        rest = f"; {plural(blank, 'row')} never written" if blank else ""
        return [Diagnosis("keys_dropped", f"{stage}: keys {kept}..{m - 1} are left out of every row, the keys "
                          f"past the last full tile of {_tile_words(tiles)} keys (max diff {diff:.2g}){rest}",
                          {"dropped": [kept, m - 1], "tiles": tiles, "max_diff": diff}, 0.92)]
    return []


def keys(stage, got, want, ctx, width) -> List[Diagnosis]:
    """got is attention over keys the tiling got wrong: keys read past the end, or left out."""
    built = rebuilder(stage, ctx, width)
    qkv = case_inputs(ctx)
    if built is None or qkv[QUERIES].shape[0] != got.shape[0]:
        return []
    rebuild, width = built
    with np.errstate(all="ignore"):
        return (_keys_dropped(stage, got, want, ctx, rebuild, width, qkv)
                or _keys_past_end(stage, got, want, ctx, rebuild, width, qkv))

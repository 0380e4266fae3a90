"""Bugs seen where a program wrote no upstream stage: the stage recomputed from the case's Q, K, V
(its spec's from_inputs) as the bug would have it. Hypotheses of verify/diagnose/hypotheses.py.

overflow: a softmax without the row max subtracted; exp overflows float32 where a row's logits
pass log(FLT_MAX) ≈ 88.7, and inf/inf is NaN. keys_past_end: a key tile read past the end of the
keys (the next head's first keys, or zero padding) enters every row's softmax unmasked.
keys_dropped: the keys past the last full tile are left out of every row.

Every recomputation here runs under the case's variant (verify/variant.py: the alignment, window,
softcap, ALiBi, mask and bias files, the program's dropout keep-mask): `variant_of`, `slope_of`
and `variant_tensors` read it off the head's context, and `alternatives` recomputes a stage under
another variant, slope or inputs, as a bug of a variant would have it (verify/diagnose/variants.py,
heads.py, masks.py).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis, Suspect
from ..check.reference import compute_stage
from ..model.attention import log_sum_exp_rows
from ..specs import SPECS, VARIANT_SOURCES
from ..specs.base import head_variant
from ..stages import BIAS_INPUT, DROPOUT_MASK, INPUT_NAMES, KEYS, MASK_INPUT, QUERIES, SCALED_SCORES, STAGES, VALUES
from ..text import plural
from ..variant import TOP_LEFT, Variant
from .base import (KEY_TILES, LOG_FLOAT32_MAX, MATCH_WIDTHS, MAX_RUN_KEY_TILE, MIN_KEY_TILE, OVERFLOW_SLACK,
                   explains, explains_closely, maxdiff, width_of)

Tensors = Dict[str, np.ndarray]
# (Q, K, V with the head's variant tensors), masked (None: the variant's own), variant, slope -> the stage
Rebuild = Callable[..., np.ndarray]


# ---- the head's variant ---------------------------------------------------------------------------

def variant_of(ctx: Suspect) -> Variant:
    """The variant the run asks of this head: the head context's, else the Suspect's (a K/V head's
    sums), else a plain case of ctx.causal."""
    if ctx.head_ctx is not None:
        return ctx.head_ctx.effective_variant
    v = ctx.variant or Variant()
    return v if v.causal == bool(ctx.causal) else v.with_(causal=bool(ctx.causal))


def slope_of(ctx: Suspect) -> float:
    """This query head's ALiBi slope (0 without the head's context)."""
    return float(ctx.head_ctx.slope) if ctx.head_ctx is not None else 0.0


def variant_tensors(ctx: Suspect) -> Tensors:
    """The head's mask and bias files and the program's dropout keep-mask, where the case has them."""
    if ctx.head_ctx is not None:
        return ctx.head_ctx.variant_tensors()
    return {n: np.asarray(ctx.src[n], np.float64) for n in VARIANT_SOURCES if ctx.src.get(n) is not None}


def structural_hidden(v: Variant, n: int, m: int, offset: int) -> np.ndarray:
    """True where v's causal flag and window hide key j from row i when row i's diagonal is key
    i + offset (v.offset(n, m): the case's own; another: a shifted mask). Variant.visible of v's
    top-left twin on a grid whose first rows (or first columns) are cut off, so that its diagonal
    falls there."""
    top_left = v.with_(align=TOP_LEFT)
    if offset >= 0:
        return ~top_left.visible(n + offset, m, rows=slice(offset, None))
    return ~top_left.visible(n, m - offset, cols=slice(-offset, None))


def file_hidden(v: Variant, tensors: Tensors, n: int, m: int) -> np.ndarray:
    """True where the head's mask file holds 0 or its bias file −inf (v's structural mask apart)."""
    return head_variant(v.with_(causal=False, window=(-1, -1)), 0.0, tensors).hidden(n, m)


def run_hidden(ctx: Suspect, n: int, m: int, extra: int = 0) -> np.ndarray:
    """The whole mask the run asks for on n query rows and m keys, and `extra` keys past them (at
    the same diagonals, hidden by no file: keys a tile read past the end)."""
    v, tensors = variant_of(ctx), variant_tensors(ctx)
    out = structural_hidden(v, n, m + extra, v.offset(n, m))
    out[:, :m] |= file_hidden(v, tensors, n, m)
    return out


# ---- the stage recomputed -------------------------------------------------------------------------

def case_inputs(ctx: Suspect) -> Optional[Dict[str, np.ndarray]]:
    """This head's Q, K, V (float64): the head's context, else the sources when they are the inputs."""
    have = ctx.head_ctx.inputs if ctx.head_ctx is not None else ctx.src
    if not all(n in have for n in INPUT_NAMES):
        return None
    return {n: np.asarray(have[n], dtype=np.float64) for n in INPUT_NAMES}


def rebuilder(stage: str, ctx: Suspect, width: float) -> Optional[Tuple[Rebuild, float]]:
    """(the stage from any Q, K, V and mask at the run's scale, one tolerance width for matching
    it), or None where the stage cannot be recomputed from the inputs or the program wrote a stage
    it is computed from. The rebuild takes the inputs (the head's variant tensors are added where
    they are not given), the whole mask (None: the variant's own) and, optionally, another variant
    and slope. A stage whose isolated reference starts from upstream stages (output from the
    weights) carries the whole chain's error when recomputed from the inputs: its width is then
    the chained bound's."""
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
    run_variant, run_slope, tensors = variant_of(ctx), slope_of(ctx), variant_tensors(ctx)

    def rebuild(qkv, masked, variant: Optional[Variant] = None, slope: Optional[float] = None):
        v = run_variant if variant is None else variant
        keys = np.shape(qkv[KEYS])[0]
        given = {n: _keys_cut(n, t, keys) for n, t in tensors.items()}
        return from_inputs({**given, **qkv}, ctx.scale, masked, variant=v, slope=run_slope if slope is None else slope)
    return rebuild, width


# What a variant tensor holds for a key it does not cover (a key read past the end): kept, no bias.
_NEUTRAL = {MASK_INPUT: 1.0, BIAS_INPUT: 0.0, DROPOUT_MASK: 1.0}


def _keys_cut(name: str, t: np.ndarray, keys: int) -> np.ndarray:
    """A variant tensor (N×M) cut or padded to `keys` columns: the keys a rebuild is given."""
    if t.shape[1] >= keys:
        return t[:, :keys]
    return np.concatenate([t, np.full((t.shape[0], keys - t.shape[1]), _NEUTRAL[name])], axis=1)


def alternatives(stage: str, ctx: Suspect, width: float, variant: Optional[Variant] = None,
                 slope: Optional[float] = None, replace: Optional[Tensors] = None) -> Iterator[Tuple[np.ndarray, float]]:
    """The stage as a program that computed it under another variant, slope or inputs (`replace`:
    Q, K, V, a variant tensor) would have written it, each with the width to match it with: from
    the stage's own sources (the isolated reference's, where they hold what changed or the stage
    applies the variant itself), then from the case's inputs where the program wrote no upstream
    stage. Computed when asked for: the first that explains got ends the search."""
    v = variant_of(ctx) if variant is None else variant
    s = slope_of(ctx) if slope is None else slope
    replace = replace or {}
    src = ctx.src
    if src and (variant is not None or slope is not None or any(src.get(n) is not None for n in replace)):
        # (a variant tensor the bug adds, a bias where the case has none, goes in; Q, K, V only
        # where the stage reads them itself)
        changed = {**src, **{n: x for n, x in replace.items()
                             if src.get(n) is not None or n in VARIANT_SOURCES}}
        try:
            yield compute_stage(stage, changed, ctx.scale, v.causal, variant=v, slope=s), width
        except (KeyError, ValueError):
            pass
    built = rebuilder(stage, ctx, width)
    qkv = case_inputs(ctx)
    if built is not None:
        rebuild, wide = built
        with np.errstate(all="ignore"):
            yield rebuild({**qkv, **replace}, None, v, s), wide


def explains_rows(got: np.ndarray, cand: np.ndarray, want: np.ndarray, width: float,
                  judged: np.ndarray, nan_evidence: bool = False, closely: bool = False) -> Optional[float]:
    """explains() over the judged rows (explains_closely() where `closely`), else None. At least
    half of the rows must be judged."""
    if cand.shape != got.shape or judged.sum() < max(1, got.shape[0] / 2):
        return None
    match = explains_closely if closely else explains
    return match(got[judged], cand[judged], want[judged], width, nan_evidence)


def worst_rows(got: np.ndarray, want: np.ndarray, count: int = 4) -> np.ndarray:
    """got's `count` most wrong rows, most wrong first: where a candidate is tried before the whole
    stage is recomputed under it."""
    err = np.nan_to_num(np.abs(got - want), nan=np.inf).max(axis=1)
    return np.argsort(-err, kind="stable")[:count]


def rows_fit(part: Callable[[np.ndarray, np.ndarray], np.ndarray], got: np.ndarray, rows: np.ndarray,
             hidden: Callable[[np.ndarray], np.ndarray], width: float) -> bool:
    """Whether the rows of got that see a key under the candidate's mask (hidden(rows): those rows
    of it) match part(rows, their mask), the candidate's stage on those rows, as a candidate that
    explains the whole stage must (one that cannot is not recomputed whole)."""
    masked = hidden(rows)
    seeing = ~masked.all(axis=1)
    if not seeing.any():
        return True
    with np.errstate(all="ignore"):
        return bool(maxdiff(got[rows[seeing]], part(rows[seeing], masked[seeing])) <= MATCH_WIDTHS * width)


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
    return head_variant(variant_of(ctx), slope_of(ctx), variant_tensors(ctx)).scores(
        (qkv[QUERIES] @ qkv[KEYS].T) * ctx.scale)


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

def run_key_tile(ctx: Suspect) -> Optional[int]:
    """The run's own key tile width (run.toml's flash_block_k), where it gives one to try."""
    return int(ctx.flash_tiles[1]) if ctx.flash_tiles and 0 < ctx.flash_tiles[1] <= MAX_RUN_KEY_TILE else None


def key_tiles(ctx: Suspect) -> List[int]:
    """Key tile widths to try: the run's own first, then the usual ones."""
    own = [] if run_key_tile(ctx) is None else [run_key_tile(ctx)]
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


def _as_written(stage: str, cand: np.ndarray, m: int) -> np.ndarray:
    """A rebuilt N×M stage (the weights) over another key count, as the program writes it into its
    N×M buffer: the first m columns (keys past the end), or the kept ones and 0 (keys left out)."""
    if STAGES[stage].cols != "M" or cand.shape[1] == m:
        return cand
    if cand.shape[1] > m:
        return cand[:, :m]
    return np.concatenate([cand, np.zeros((cand.shape[0], m - cand.shape[1]))], axis=1)


def _keys_past_end(stage, got, want, ctx, rebuild, width, qkv) -> List[Diagnosis]:
    m, n = qkv[KEYS].shape[0], got.shape[0]
    for extra, tiles in _by_count(key_tiles(ctx), lambda t: -m % t).items():
        for words, k_tail, v_tail in _past_end_sources(ctx, extra):
            cand = _as_written(stage, rebuild(_extended(qkv, extra, k_tail, v_tail), run_hidden(ctx, n, m, extra)), m)
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
    for dropped, tiles in _by_count(key_tiles(ctx), lambda t: m % t if t < m else 0).items():
        kept = m - dropped
        cut = {QUERIES: qkv[QUERIES], KEYS: qkv[KEYS][:kept], VALUES: qkv[VALUES][:kept]}
        judged = ~blank_rows(got, want)
        diff = explains_rows(got, _as_written(stage, rebuild(cut, run_hidden(ctx, n, m)[:, :kept]), m), want, width,
                             judged)
        if diff is None:
            continue
        blank = int((~judged).sum())
        rest = f"; {plural(blank, 'row')} never written" if blank else ""
        # (the same keys are past the last full tile of any width t with m mod t = dropped)
        others = [t for t in range(MIN_KEY_TILE, m) if m % t == dropped and t not in tiles]
        also = f" (as of any tile width t with M mod t = {dropped}: also {_tile_words(others[:6])}" \
               f"{', ...' if len(others) > 6 else ''})" if others else ""
        return [Diagnosis("keys_dropped", f"{stage}: keys {kept}..{m - 1} are left out of every row, the keys "
                          f"past the last full tile of {_tile_words(tiles)} keys{also} (max diff {diff:.2g}){rest}",
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

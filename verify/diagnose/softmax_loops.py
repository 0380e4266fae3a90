"""Bugs of the loops that compute a softmax: the mask applied after it, a key of every tile left
out, the online softmax's rescale forgotten, its normalization left out. Hypotheses of
verify/diagnose/hypotheses.py, each tried on the stages whose spec names it (the weights, the
outputs, the lse), where the program wrote no scores of its own (the stage recomputed from the
case's Q, K, V under its variant), or, for the weights, from the program's own scaled scores.

mask_after_softmax: the softmax over every key, then the hidden entries zeroed and the rows not
renormalized (the causal mask, window or mask file applied to the weights instead of the scores).
tile_keys_skipped: a key tile's loop stops one key short (or starts one late), so the last (first)
key of every tile of T keys is left out of every row. online_rescale_missing: a flash kernel that
keeps a running maximum m, sum l and output acc over its key tiles, and, when a tile raises m, does
not multiply l or acc (or either) by exp(m_old − m_new). softmax_unnormalized, lse_sum_missing,
lse_max_missing: the last step left out, the division by the row sum l, or a term of lse = m + log l.
running_max_zero: the row maximum (running or not) started at 0 instead of −inf, so that a row whose
scores all lie below about −104 (−87 where subnormals are flushed to 0) sums float32 exponentials
that underflow to 0.

A kernel's key tile may be any width: each width from 2 keys up to MAX_TILE_SEARCHED is tried on a
few sampled rows first (loop_screen), and the stage recomputed whole only for the widths those rows
fit closely enough to be told from the reference. The online softmax is computed in closed form,
not tile by tile.
"""
from __future__ import annotations

import copy
from typing import Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import (LSE_SUM_MISSING, ONLINE_RESCALE_MISSING, SOFTMAX_UNNORMALIZED, TILE_KEYS_SKIPPED,
                               Diagnosis, Suspect)
from ..check.splits import FLASH_OF
from ..model.attention import log_sum_exp_rows, softmax_rows
from ..specs import SPECS
from ..specs.output import scores_from_inputs
from ..stages import KEYS, QUERIES, STAGES, VALUES
from ..text import indices
from .base import MATCH_WIDTHS, MIN_SEARCHED_VALUES, maxdiff
from .inputs import (blank_rows, case_inputs, explains_rows, rebuilder, run_hidden, slope_of, variant_of,
                     variant_tensors)
from .screens import loop_rows, loop_screen
from .splits import split_cols

MASK_AFTER_SOFTMAX = "mask_after_softmax"
LSE_MAX_MISSING = "lse_max_missing"
RUNNING_MAX_ZERO = "running_max_zero"
CODES = (MASK_AFTER_SOFTMAX, TILE_KEYS_SKIPPED, ONLINE_RESCALE_MISSING, SOFTMAX_UNNORMALIZED, LSE_SUM_MISSING,
         LSE_MAX_MISSING, RUNNING_MAX_ZERO)
# A key of every tile left out is not named on fewer rows than this (nor on fewer values than
# MIN_SEARCHED_VALUES: a search over every tile width).
MIN_ROWS = 4
MAX_TILE_SEARCHED = 256
# What a stage holds, by its table entry's columns: the weights (one per key), one log-sum-exp a
# row, or the attention's output (V's columns).
PROBABILITIES, LOG_SUM_EXP, ATTENTION = "probabilities", "log-sum-exp", "attention"


class _Head:
    """One head's logits with nothing hidden (the scale and the variant's softcap, ALiBi and bias
    applied), the run's whole mask, V, the stage's kind (from its table entry: the weights hold
    the keys' columns, the lse one column, the output V's) and the width to match with."""

    def __init__(self, stage: str, ctx: Suspect, width: float) -> None:
        self.ok = False
        st = STAGES[stage]
        self.kind = PROBABILITIES if st.cols == "M" else LOG_SUM_EXP if st.cols == "1" else ATTENTION
        built = rebuilder(stage, ctx, width)
        qkv = case_inputs(ctx)
        got = ctx.head_ctx.got if ctx.head_ctx is not None else {}
        # The program's own scores, where it wrote those the stage is the softmax of.
        own = [n for n in st.inputs if SPECS[n].masked_value == -np.inf and n in got and n in ctx.src]
        if built is None and own and self.kind == PROBABILITIES:
            self.logits, self.values, self.width = np.asarray(ctx.src[own[0]], np.float64), None, width
        elif built is not None and qkv is not None and not variant_of(ctx).dropout:
            # (under dropout the program's keep-mask multiplies P: not modelled here)
            self.logits = _input_logits(ctx, qkv)
            self.values, self.width = qkv[VALUES], built[1]
        else:
            return
        self.hidden = run_hidden(ctx, *self.logits.shape)
        self.ok = self.kind == PROBABILITIES or self.values is not None

    def keys(self, first: int, end: int) -> "_Head":
        """This head over its keys [first, end) alone (a split of a split-KV run)."""
        part = copy.copy(self)
        part.logits, part.hidden = self.logits[:, first:end], self.hidden[:, first:end]
        part.values = None if self.values is None else self.values[first:end]
        return part

    def from_weights(self, weights: np.ndarray) -> np.ndarray:
        """The stage as the program writes it from these weights (normalized or not)."""
        return weights if self.kind == PROBABILITIES else weights @ self.values

    def from_state(self, lse: np.ndarray, out: Optional[np.ndarray], masked: np.ndarray) -> np.ndarray:
        """The stage from a softmax's log-sum-exp (a column) and output over the keys it read, and
        its logits with the hidden and unread keys −inf (the weights: exp(s − lse))."""
        if self.kind == LOG_SUM_EXP:
            return lse
        if self.kind == ATTENTION:
            return out
        return np.exp(masked - np.where(np.isfinite(lse), lse, 0.0))

    def softmax_stage(self, logits: np.ndarray, rows=slice(None)) -> np.ndarray:
        """The stage from these logits of `rows` under the run's mask."""
        s = np.where(self.hidden[rows], -np.inf, logits)
        if self.kind == LOG_SUM_EXP:
            return log_sum_exp_rows(s)
        return self.from_weights(softmax_rows(s))


def _input_logits(ctx: Suspect, qkv) -> np.ndarray:
    """The scores from the case's Q and K with nothing hidden (the scale, softcap, ALiBi, bias)."""
    n, m = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]
    return scores_from_inputs({**variant_tensors(ctx), **qkv}, ctx.scale, np.zeros((n, m), bool), variant_of(ctx),
                              slope_of(ctx))


def loop_head(stage, got, ctx, width) -> Optional[_Head]:
    if got.ndim != 2:
        return None
    head = _Head(stage, ctx, width)
    return head if head.ok and head.logits.shape[0] == got.shape[0] else None


def loop_matches(got, want, head: _Head, cand: np.ndarray) -> Optional[float]:
    """explains_closely() on the written rows: a half program's output bound is wide (its P rounded
    to the format before P·V), and a loop's bug moves the output by less than DISTINCT_WIDTHS of
    them, while its float64 candidate reproduces got to the output's own rounding."""
    return explains_rows(got, cand, want, head.width, ~blank_rows(got, want), closely=True)


def _widths(m: int) -> range:
    """The tile widths below m keys searched."""
    return range(2, min(m, MAX_TILE_SEARCHED + 1))


# ---- the mask after the softmax -------------------------------------------------------------------

def mask_after_softmax(stage, got, want, ctx, width) -> List[Diagnosis]:
    head = loop_head(stage, got, ctx, width)
    if head is None or head.kind == LOG_SUM_EXP or not (head.hidden.any(axis=1) & ~head.hidden.all(axis=1)).any():
        return []
    logits = head.logits
    if head.values is None:  # the program's own masked scores: the hidden ones are the inputs' scores
        qkv = case_inputs(ctx)
        if qkv is None:
            return []
        logits = np.where(head.hidden, _input_logits(ctx, qkv), logits)
    with np.errstate(invalid="ignore"):
        weights = np.where(head.hidden, 0.0, softmax_rows(logits))
    diff = loop_matches(got, want, head, head.from_weights(weights))
    if diff is None:
        return []
    return [Diagnosis(MASK_AFTER_SOFTMAX, f"{stage}: the mask is applied after the softmax: the weights are the "
                      "softmax over every key with the hidden ones then set to 0, so a row's visible weights do "
                      f"not sum to 1 (mask the scores with -inf before the softmax; max diff {diff:.2g})",
                      {"max_diff": diff}, 0.93)]


# ---- a key of every tile left out ----------------------------------------------------------------

def _skipped_keys(m: int, tile: int) -> Iterator[Tuple[str, np.ndarray]]:
    """(what the loop does, the keys it leaves out) for key tiles of `tile` keys."""
    cols = np.arange(m)
    last = cols % tile == tile - 1
    yield f"stops one key short of each tile: the last key of every full tile of {tile} keys", last
    if m % tile:
        yield f"stops one key short of each tile: the last key of every tile of {tile} keys (the partial last " \
            "tile's included)", last | (cols == m - 1)
    yield f"starts one key late in each tile: the first key of every tile of {tile} keys", cols % tile == 0


def tile_keys(stage, got, want, ctx, width) -> List[Diagnosis]:
    head = loop_head(stage, got, ctx, width)
    # A few rows (a decode step's one) leave the keys they weigh little free to fit some tiling.
    if head is None or got.size < MIN_SEARCHED_VALUES or got.shape[0] < MIN_ROWS:
        return []
    m = head.logits.shape[1]
    rows = loop_rows(got, want)
    sampled, fits = head.logits[rows], loop_screen(got, want, head)
    for tile in _widths(m // 2):  # (at least two full tiles: one tile's key is no pattern)
        for how, skipped in _skipped_keys(m, tile):
            with np.errstate(invalid="ignore", over="ignore"):
                if not fits(head.softmax_stage(np.where(skipped, -np.inf, sampled), rows), rows):
                    continue
                diff = loop_matches(got, want, head, head.softmax_stage(np.where(skipped, -np.inf, head.logits)))
            if diff is not None:
                keys = np.flatnonzero(skipped)
                return [Diagnosis(TILE_KEYS_SKIPPED, f"{stage}: the key loop {how} is left out of every row "
                                  f"(keys {indices(keys)}; max diff {diff:.2g})",
                                  {"tile": tile, "skipped": int(skipped.sum()), "first": int(keys[0]),
                                   "max_diff": diff}, 0.92)]
    return []


# ---- the online softmax's rescale ----------------------------------------------------------------

_RESCALES = (  # (what the kernel does, rescale the running sum, rescale the running output)
    ("does not rescale the running output acc by exp(m_old − m_new) (the running sum is rescaled)", True, False),
    ("does not rescale the running sum l by exp(m_old − m_new) (the running output is rescaled)", False, True),
    ("rescales neither the running sum l nor the running output acc by exp(m_old − m_new)", False, False),
)
# The lse is m + log l: whether the output was rescaled does not reach it.
_LSE_RESCALES = (("does not rescale the running sum l by exp(m_old − m_new)", False, True),)


def _online(head: _Head, tile: int, sum_scaled: bool, out_scaled: bool, rows=slice(None)) -> np.ndarray:
    """The stage from an online softmax of `rows` over key tiles of `tile` keys, with its running
    sum and output rescaled when a tile raises the row maximum, or not (_online_rows), a block of
    rows of at most _ONLINE_BLOCK scores at a time: its few N×M temporaries stay small."""
    idx = np.arange(head.logits.shape[0])[rows]
    step = max(1, _ONLINE_BLOCK // max(1, head.logits.shape[1]))
    parts = [_online_rows(head, tile, sum_scaled, out_scaled, idx[i:i + step]) for i in range(0, idx.size, step)]
    return np.concatenate(parts) if parts else _online_rows(head, tile, sum_scaled, out_scaled, idx)


_ONLINE_BLOCK = 1 << 22


def _online_rows(head: _Head, tile: int, sum_scaled: bool, out_scaled: bool, rows: np.ndarray) -> np.ndarray:
    """_online's rows. A rescaled sum (output) is the one over every key against the final maximum;
    one never rescaled weighs each key against the running maximum its tile was read under: both in
    closed form, not a loop over the tiles."""
    logits = np.where(head.hidden[rows], -np.inf, head.logits[rows])
    m = logits.shape[1]
    starts = np.arange(0, m, tile)
    running = np.maximum.accumulate(np.maximum.reduceat(logits, starts, axis=1), axis=1)
    final = running[:, -1:]

    def weighed(mx: np.ndarray) -> np.ndarray:  # exp(s − mx), 0 under a maximum no key has raised
        seen = np.isfinite(mx)
        return np.where(seen, np.exp(logits - np.where(seen, mx, 0.0)), 0.0)
    at_final = weighed(final)
    at_read = weighed(np.repeat(running, np.diff(np.append(starts, m)), axis=1)) if not (sum_scaled and out_scaled) \
        else at_final
    total = (at_final if sum_scaled else at_read).sum(axis=1)
    if head.kind == LOG_SUM_EXP:  # (the running output does not reach it)
        return final + np.log(total)[:, None]
    return ((at_final if out_scaled else at_read) @ head.values) / total[:, None]


def online_rescale(stage, got, want, ctx, width) -> List[Diagnosis]:
    head = loop_head(stage, got, ctx, width)
    if head is None or head.values is None or head.kind == PROBABILITIES or got.size < MIN_SEARCHED_VALUES:
        return []
    found = _online_search(head, got, want)
    return [_online_diagnosis(stage, *found)] if found else []


@np.errstate(all="ignore")  # (a failing split may hold NaN: judged, not warned about)
def online_rescale_in_splits(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The online softmax's rescale forgotten inside the splits of a split-KV run: a failing split's
    rows recomputed over its own keys, its tiles counted from its first key (each split is a loop
    of its own)."""
    view, flash = ctx.splits, FLASH_OF.get(stage)
    if view is None or view.kind != "split" or flash is None:
        return []
    head = loop_head(flash, got, ctx, width)
    if head is None or head.values is None:
        return []
    cols = split_cols(stage, view, got)
    for s, ref in enumerate(view.references):
        part = slice(s * cols, (s + 1) * cols)
        if (ref.end - ref.first < 2 or got[:, part].size < MIN_SEARCHED_VALUES
                or maxdiff(got[:, part], want[:, part]) <= MATCH_WIDTHS * head.width):
            continue  # (a split of one key has no tiles to rescale between, one of a few values fits
            # some width by chance; this one is right)
        found = _online_search(head.keys(ref.first, ref.end), got[:, part], want[:, part])
        if found:
            d = _online_diagnosis(stage, *found)
            d.message += f", in split {s} (keys {ref.first}..{ref.end - 1}, its tiles from its first key)"
            return [d]
    return []


def _online_search(head: _Head, got, want) -> Optional[Tuple[int, str, bool, bool, float]]:
    """(tile, what the loop does, sum rescaled, output rescaled, max diff) of the first tiling whose
    online softmax without a rescale explains got; None where none does."""
    rows, fits = loop_rows(got, want), loop_screen(got, want, head)
    for tile in _widths(head.logits.shape[1]):
        for how, sum_scaled, out_scaled in _LSE_RESCALES if head.kind == LOG_SUM_EXP else _RESCALES:
            with np.errstate(invalid="ignore", over="ignore"):
                if not fits(_online(head, tile, sum_scaled, out_scaled, rows), rows):
                    continue
                diff = loop_matches(got, want, head, _online(head, tile, sum_scaled, out_scaled))
            if diff is not None:
                return tile, how, sum_scaled, out_scaled, diff
    return None


def _online_diagnosis(stage: str, tile: int, how: str, sum_scaled: bool, out_scaled: bool, diff: float) -> Diagnosis:
    return Diagnosis(ONLINE_RESCALE_MISSING, f"{stage}: the online softmax over key tiles of {tile} {how} when a "
                     f"tile raises the row maximum (max diff {diff:.2g})",
                     {"tile": tile, "sum_rescaled": sum_scaled, "output_rescaled": out_scaled, "max_diff": diff},
                     0.93)


# ---- the row sum left out -------------------------------------------------------------------------

def _normalizations(head: _Head) -> List[Tuple[str, str, np.ndarray]]:
    """(code, what the stage then is, the stage so computed) for each part of the softmax's
    normalization a program leaves out: the division by the row sum l = Σ exp(s − max), or in the
    lse (max + log l) either term."""
    s = np.where(head.hidden, -np.inf, head.logits)
    mx = s.max(axis=1, keepdims=True)
    seen = np.isfinite(mx)
    p = np.where(seen, np.exp(s - np.where(seen, mx, 0.0)), 0.0)
    if head.kind == LOG_SUM_EXP:
        return [(LSE_SUM_MISSING, "is the row maximum alone: log l, the log of the row sum of exp(s - max), is "
                 "not added", mx),
                (LSE_MAX_MISSING, "is log l alone, the log of the row sum of exp(s - max): the row maximum is not "
                 "added back", np.log(p.sum(axis=1, keepdims=True)))]
    what = "output" if head.kind == ATTENTION else "weights"
    return [(SOFTMAX_UNNORMALIZED, f"is not divided by the row sum l = sum of exp(s - max): the {what} of the "
             "unnormalized exponentials", head.from_weights(p))]


# Below this an exponential is subnormal in float32, which a GPU's fast exp flushes to 0.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _max_from_zero(head: _Head, flush: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(the stage with the row maximum started at 0, not −inf, its exponentials float32's, the
    subnormal ones flushed to 0 where `flush`; the rows that see a key whose sum underflows to 0):
    those rows 0/0 (NaN) in the weights and output, −inf in the lse."""
    s = np.where(head.hidden, -np.inf, head.logits)
    mx = np.maximum(s.max(axis=1, keepdims=True), 0.0)
    p = np.exp(s - mx).astype(np.float32).astype(np.float64)
    if flush:
        p[p < _FLOAT32_TINY] = 0.0
    total = p.sum(axis=1, keepdims=True)
    empty = (total[:, 0] == 0) & ~head.hidden.all(axis=1)
    if head.kind == LOG_SUM_EXP:
        return mx + np.log(total), empty
    return head.from_weights(p / total), empty


def normalization(stage, got, want, ctx, width) -> List[Diagnosis]:
    head = loop_head(stage, got, ctx, width)
    if head is None:
        return []
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        for code, what, cand in _normalizations(head):
            diff = loop_matches(got, want, head, cand)
            if diff is not None:
                return [Diagnosis(code, f"{stage} {what} (max diff {diff:.2g})", {"max_diff": diff}, 0.93)]
        every = np.ones(got.shape[0], bool)  # (the rows it empties are its evidence: none is left out)
        for flush, below in ((False, -104), (True, -87)):
            cand, empty = _max_from_zero(head, flush)
            if not empty.any():
                continue
            for fill in ((np.nan, 0.0) if head.kind != LOG_SUM_EXP else (-np.inf, np.inf)):  # (+inf: guarded)
                diff = explains_rows(got, np.where(empty[:, None], fill, cand), want, head.width, every,
                                     nan_evidence=True)
                if diff is not None:
                    rows = f"{'row' if empty.sum() == 1 else 'rows'} {indices(np.flatnonzero(empty))}"
                    return [Diagnosis(RUNNING_MAX_ZERO, f"{stage}: the row maximum starts at 0, not -inf: in {rows}, "
                                      f"whose scores all lie below about {below}, exp(s - 0) underflows float32"
                                      f"{' (subnormals flushed to 0)' if flush else ''} and the row's sum is 0 "
                                      f"(max diff {diff:.2g})", {"rows": int(empty.sum()), "max_diff": diff}, 0.93)]
    return []


HYPOTHESES = {"mask_after_softmax": mask_after_softmax, "tile_keys": tile_keys, "online_rescale": online_rescale,
              "normalization": normalization}
# The searches over the tile widths (verify/diagnose/hypotheses.py tries them last).
SEARCHES = ("tile_keys", "online_rescale")

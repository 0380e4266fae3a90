"""The softmax's error: exponent errors, the row sum's rounding, and their propagation through the
normalization and P·V.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np

from .arrays import (clip, concat_rows, isfinite, namespace, ordered_bits, put, segment_sums,
                     sort_rows_with_columns, take_along_rows)
from .attention import scaled_scores
from .kernels import SOFTMAX_FINAL_ROUNDINGS, Kernel
from .rounding import ROUND_VAR, UNIT_ROUNDOFF, HeadCache, ToleranceError, everywhere, memo, step_var
from .scores import as_head


# Rows per block of the row-sum variance: a block's temporaries stay in the CPU cache.
_ROW_BLOCK_ELEMS = 1 << 16

# The most groups of equal terms in a row that EqualTerms finds by comparing the row with each
# group's value (a few at thousands of keys); rows of more search for each term's value.
_FEW_GROUPS = 16


def need(src: Dict[str, np.ndarray], stage: str, *names: str) -> Tuple[np.ndarray, ...]:
    missing = [n for n in names if n not in src]
    if missing:
        raise ToleranceError(f"stage {stage}: the tolerance model needs input{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)}; got {', '.join(sorted(src)) or 'none'}")
    return tuple(np.asarray(src[n], dtype=np.float64) for n in names)


def scaled_logits(Q: np.ndarray, K: np.ndarray, scale: float, head) -> np.ndarray:
    """The scores the softmax reads from Q and K (verify/model/attention.py scaled_scores); head:
    a HeadVariant, or the causal bool of a plain case."""
    return scaled_scores(Q @ K.T, scale, head)


def logits(Q: np.ndarray, K: np.ndarray, scale: float, head, cache: Optional[HeadCache], product=None) -> np.ndarray:
    """scaled_logits, kept in the cache; product(): Q·Kᵀ, where the caller has it."""
    head = as_head(head)
    return memo(cache, "logits", (Q, K), (scale, head),
                lambda: scaled_logits(Q, K, scale, head) if product is None else scaled_scores(product(), scale, head))


def raw_logits(Q: np.ndarray, K: np.ndarray, scale: float, cache: Optional[HeadCache]) -> np.ndarray:
    """scale·Q·Kᵀ, before any variant's modification or mask (the softcap's argument)."""
    return memo(cache, "raw logits", (Q, K), (scale,), lambda: np.multiply(Q @ K.T, scale))


def softmax_parts(S: np.ndarray):
    """p = softmax rows of S (masked -inf -> 0), d = S - rowmax (0 where masked), finite mask."""
    xp = namespace(S)
    finite = isfinite(S)
    # An unmasked head skips every where() (NumPy's; on a device the test would wait for the
    # tile's kernels, and the where()s keep what they are given).
    masked = None if xp is np and bool(xp.all(finite)) else ~finite
    m = xp.max(S if masked is None else xp.where(finite, S, -math.inf), axis=1, keepdims=True)
    m = xp.where(isfinite(m), m, 0.0)
    d = S - m                                  # where(finite, S - m, 0)
    if masked is not None:
        d = put(d, 0.0, masked)
    e = xp.exp(d)                              # where(finite, exp(d), 0)
    if masked is not None:
        e = put(e, 0.0, masked)
    l = xp.sum(e, axis=1, keepdims=True)
    if xp is np:
        return np.divide(e, np.where(l > 0, l, 1.0), out=e), d, m, finite
    return e / xp.where(l > 0, l, 1.0), d, m, finite


def softmax(S: np.ndarray, cache: Optional[HeadCache]):
    return memo(cache, "softmax", (S,), (), lambda: softmax_parts(S))


def finite_logits(S: np.ndarray, cache: Optional[HeadCache]):
    """Where S is finite (not hidden), kept in the cache: the softmax's own test where it ran on
    these logits, else a pass of its own."""
    kept = cache.peek("softmax", (S,), ()) if cache is not None else None
    return kept[3] if kept is not None else memo(cache, "finite logits", (S,), (), lambda: isfinite(S))


def exponent_var(d: np.ndarray, finite: np.ndarray, u: float, kernel: Kernel,
                  S: Optional[np.ndarray] = None, logit_roundings: int = 0) -> np.ndarray:
    """Variance of the relative error η_j of e_j = exp(d_j): the subtraction S_j - m rounds
    (u|d_j|), exp errs (kernel.exp_var), and each rounding of the logit itself adds u|S_j|. S:
    the logits' magnitudes, 0 where hidden (logit_magnitude's)."""
    # var = ROUND_VAR·(u·d)² + exp_var·u·u (in place on NumPy's: a head's N×M temporaries)
    xp = namespace(d)
    if xp is np:
        var = np.multiply(d, u)
        np.multiply(var, var, out=var)
        var *= ROUND_VAR
        var += kernel.exp_var * u * u
        if kernel.exp_slope_var:
            var = var + kernel.exp_slope_var * (u * d) ** 2
        if S is not None and logit_roundings:  # var += logit_roundings·ROUND_VAR·(u·S)²
            var = _add_logit_var(var, np.multiply(S, u), logit_roundings)
    else:
        # A device's: the same sums grouped as u²·(ROUND_VAR + exp_slope_var)·d² + exp_var·u², in
        # place on its own tensor (each operation a pass over the tile: three, not six).
        var = d * d
        var *= u * u * (ROUND_VAR + kernel.exp_slope_var)
        var += kernel.exp_var * u * u
        if S is not None and logit_roundings:
            var.addcmul_(S, S, value=u * u * logit_roundings * ROUND_VAR)
    return var if everywhere(finite) else put(var, 0.0, ~finite)  # where(finite, var, 0)


def _add_logit_var(var: np.ndarray, s2: np.ndarray, logit_roundings: int) -> np.ndarray:
    """var += logit_roundings·ROUND_VAR·s2² (s2 = u·S), in place on NumPy's arrays (s2 too)."""
    np.multiply(s2, s2, out=s2)
    s2 *= logit_roundings * ROUND_VAR
    var += s2
    return var


def f32_subtraction_error(S: np.ndarray, m: np.ndarray, d: np.ndarray, u: float) -> np.ndarray:
    """|fl(S - m) - (S - m)| for float32 S and m (IEEE subtraction, the same on CPU and GPU);
    bounded by u|d| in precisions whose inputs are not float32."""
    if u != UNIT_ROUNDOFF["fp32"]:
        return u * np.abs(d)
    with np.errstate(invalid="ignore", over="ignore"):
        err = (S.astype(np.float32) - m.astype(np.float32)).astype(np.float64)
    inexact = ~np.isfinite(err)           # where(isfinite(d32), |d32 - d|, u|d|)
    err -= d
    np.abs(err, out=err)
    if inexact.any():
        np.copyto(err, u * np.abs(d), where=inexact)
    return err


def _rowsum_step_var(p: np.ndarray, u: float) -> np.ndarray:
    """max(index order, reverse order) of Σ_k var(rounding of s_k)/l² for each row's sum
    l = Σ_k e_k (N,), block by block of rows (each row's sums are its own, so blocking changes no
    bit). The binary sums e_k = exp(S_k - m), not p_k: e = p·l with e = 1 at the row max (exp(0)
    is exact), so l = 1/max(p). The roundings are those of the e-sums' binades: the p-sums lie
    in [1/l, 1), a binade below the e-sums in [1, l) whenever l < 2, and their ulp is half
    (found by the false-alarm suite: a row of `large` data whose ~100 keys add to l ≈ 1.009
    rounded 8.7u off, twice the σ the p-sums gave). Equal terms err alike (correlated_sum)."""
    xp = namespace(p)
    N, M = p.shape
    # On a device the whole row tile is one block (its temporaries are the tile's own size).
    rows = max(1, _ROW_BLOCK_ELEMS // max(1, M)) if xp is np else max(1, N)
    out = []
    for r0 in range(0, N, rows):
        top = xp.max(p[r0:r0 + rows], axis=1, keepdims=True)
        l = 1.0 / xp.where(top > 0, top, 1.0)  # a wholly masked row (p = 0) sums nothing
        eb = p[r0:r0 + rows] * l
        equal = EqualTerms(eb.astype(np.float32) if xp is np else xp.astype(eb, xp.float32))  # as added
        s = np.cumsum(eb, axis=1) if xp is np else xp.cumulative_sum(eb, axis=1)
        t2 = eb * eb
        fwd = correlated_sum(step_var(s, eb, u, t2), equal)
        s = l - s + eb if xp is not np else np.add(np.subtract(l, s, out=s), eb, out=s)  # l - s + e: reverse order's
        bwd = correlated_sum(step_var(s, eb, u, t2), equal)
        out.append(xp.maximum(fwd, bwd) / (l[:, 0] * l[:, 0]))
    return concat_rows(out) if out else xp.zeros((0,), dtype=xp.float64)


class EqualTerms:
    """The groups of equal terms in the rows of a sum that has repeated nonzero terms, in the
    terms' namespace. At thousands of keys most rows have some: two of 8192 float32 exponentials in
    a few binades share a value more often than not; but few of a row's terms do, and only they are
    regrouped (correlated_sum). NumPy's: `rows` (a NumPy array) the rows with repeats, and of their
    terms that share their value with another of their row (zeros too), `at` their flat index in
    the rows × terms array, `label` their group, `group_rows` each group's row. A device's: the same
    groups, found without reading the rows back (a read waits for every kernel queued before it):
    `columns` the column of each term of the rows sorted, `member` whether it belongs to a group (it
    equals a neighbour there, in a row with repeats), `label` its run of equal terms, numbered
    across the rows."""

    def __init__(self, terms):
        xp = namespace(terms)
        if xp is np:
            self._numpy(terms)
            return
        ordered, columns = sort_rows_with_columns(terms)  # (equal terms in column order)
        same = ordered[:, 1:] == ordered[:, :-1]
        repeats = xp.any(same & (ordered[:, 1:] != 0), axis=1)
        self._on_device(xp, ordered, columns, same, repeats)

    def _numpy(self, terms) -> None:
        if terms.dtype != np.float32:  # (a float64 term would equal no float32 group value)
            raise TypeError(f"EqualTerms groups float32 terms, not {terms.dtype}")
        # The values alone are sorted (a float32 sort, where a sort of 64-bit keys that carry each
        # term's column took twice as long); each group's members are then found in column order
        # by comparing the rows with their few repeated values.
        ordered = np.sort(terms, axis=1)
        same = ordered[:, 1:] == ordered[:, :-1]
        self.rows = np.flatnonzero(np.any(same & (ordered[:, 1:] != 0), axis=1))
        if not self.rows.size:
            return
        same = same[self.rows]
        first = same.copy()  # the first pair of each run of equal terms
        first[:, 1:] &= ~same[:, :-1]
        row, k = np.nonzero(first)  # each group, row by row, in value order
        self.group_rows = self.rows[row]
        values, sub = ordered[self.rows[row], k], terms[self.rows]
        counts = np.bincount(row, minlength=self.rows.size)
        if counts.max() > _FEW_GROUPS:  # (a row of many repeated values: each term searched for)
            groups = _row_value_keys(row, values)
            keys = _row_value_keys(np.arange(self.rows.size)[:, None], sub)
            at = np.minimum(np.searchsorted(groups, keys), groups.size - 1)
            row_of, column = np.nonzero(groups[at] == keys)
            self.label = at[row_of, column]
        else:
            first_group = np.cumsum(counts) - counts
            table = np.full((self.rows.size, int(counts.max())), np.nan, np.float32)  # (NaN equals no term)
            table[row, np.arange(row.size) - first_group[row]] = values
            slot = np.full(sub.shape, -1, np.int8)
            for g in range(table.shape[1]):
                np.copyto(slot, g, where=sub == table[:, g:g + 1])
            row_of, column = np.nonzero(slot >= 0)
            self.label = first_group[row_of] + slot[row_of, column]
        self.at = self.rows[row_of] * terms.shape[1] + column

    def _on_device(self, xp, ordered, columns, same, repeats) -> None:
        R, M = ordered.shape
        self.columns = columns
        none = xp.zeros((R, 1), dtype=xp.bool, device=ordered.device)  # (same[:, :1] has no column at M = 1)
        self.member = (_concat_cols(xp, [same, none]) | _concat_cols(xp, [none, same])) & repeats[:, None]
        # Row r's runs numbered r·M + 0, 1, …: their sums land in row r's M slots of an R×M array,
        # whose row sums are then each row's own.
        starts = _concat_cols(xp, [xp.ones_like(none), ~same])
        runs = xp.cumulative_sum(xp.astype(starts, xp.int64), axis=1) - 1
        self.label = xp.reshape(runs + xp.reshape(xp.arange(R, dtype=xp.int64, device=ordered.device) * M, (R, 1)),
                                (-1,))


def _row_value_keys(row, values):
    """(row, value) as int64 keys that sort by row, then as the float32 values do (−0 as +0: the two
    are equal terms)."""
    bits = ordered_bits((values + np.float32(0.0)).view(np.int32))
    return (np.asarray(row, np.int64) << 32) | (bits.astype(np.int64) + (1 << 31))


def _concat_cols(xp, parts):
    """parts side by side (along the last axis)."""
    return np.concatenate(parts, axis=-1) if xp is np else xp.concat(parts, axis=-1)


def correlated_sum(var: np.ndarray, equal: EqualTerms) -> np.ndarray:
    """Σ_k var_k over each row of a sum's rounding variances, where the roundings of adding equal
    terms count as one error repeated: (Σ_k∈g σ_k)² for each group g of equal terms. The partial
    sums are floats, multiples of their binade's ulp, so s + t rounds by an amount that t's low
    bits alone decide: equal terms err alike, however they interleave with others (found by the
    false-alarm suite: a softcap of 1.91 saturated 106 of a row's 128 scores at ±C, and the
    float32 sum of their 70 equal exp(−2C) ran 18.5u off, 7.7σ of independent roundings). Rows
    without repeated terms are not regrouped; in a row with some, each group of equal terms adds
    (Σ σ)² − Σ σ² to the row's Σ var (the terms alone in their value add nothing), from the group
    members only, so that a regrouped row costs its repeated terms, not all of its terms."""
    xp = namespace(var)
    total = xp.sum(var, axis=1)
    if xp is not np:  # (each run of equal terms sums its members alone: others add 0² − 0)
        v = xp.where(equal.member, take_along_rows(var, equal.columns), 0.0)
        flat = xp.reshape(v, (-1,))
        extra = segment_sums(equal.label, xp.sqrt(flat), flat.shape[0]) ** 2 \
            - segment_sums(equal.label, flat, flat.shape[0])
        return total + xp.sum(xp.reshape(extra, v.shape), axis=1)
    if not equal.rows.size:
        return total
    v = xp.reshape(var, (-1,))[equal.at]
    sigma = xp.sqrt(v)
    groups = int(equal.group_rows.shape[0])
    extra = segment_sums(equal.label, sigma, groups) ** 2 - segment_sums(equal.label, v, groups)
    return total + segment_sums(equal.group_rows, extra, total.shape[0])


def rowsum_rel_var(p: np.ndarray, u: float, extra_roundings: float = 1.0,
                    cache: Optional[HeadCache] = None) -> np.ndarray:
    """Relative variance of l = Σ_j e_j (N×1), from the partial sums of e in index or reverse
    order (positive terms: any other order's partial sums are no larger on average)."""
    steps = memo(cache, "rowsum", (p,), (u,), lambda: _rowsum_step_var(p, u))
    return (extra_roundings * steps)[:, None]


def p2_eta(p: np.ndarray, eta_var: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    """p²·var(η): the exponent errors' weight in the weights, the output and lse."""
    return memo(cache, "p2 eta", (p, eta_var), (), lambda: p * p * eta_var)


def weights_var(p: np.ndarray, eta_var: np.ndarray, l_var: np.ndarray, u: float,
                 cache: Optional[HeadCache] = None, div_var: float = 0.0) -> np.ndarray:
    """Variance of Δp_j = p_j[(η_j - Σ_k p_k η_k) - ε_l] + final roundings, with independent η."""
    w = p2_eta(p, eta_var, cache)
    others = np.subtract(w.sum(axis=1, keepdims=True), w)     # Σ_k p_k²η_k - p_j²η_j
    np.maximum(others, 0.0, out=others)
    var = np.subtract(1.0, p)                                 # own = (1 - p)²·η
    np.multiply(var, var, out=var)
    var *= eta_var
    var += others                                             # p²·(own + others + l + final)
    var += l_var
    var += (SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR + div_var) * u * u
    var *= np.multiply(p, p)
    return var


def mixed_output_var(p: np.ndarray, eta_var: np.ndarray, V: np.ndarray, O: np.ndarray,
                      cache: Optional[HeadCache] = None, keep: Optional[np.ndarray] = None,
                      rescale: float = 1.0) -> np.ndarray:
    """Variance of Σ_j p_j η_j (v_j - O) (the exponent errors after normalization: a common error
    of all η cancels), for independent η_j: Σ_j w_j (v_j - O)² with w = p²·var(η), by three GEMMs.
    Under dropout the value of key j in row i is r·Z_ij·v_j (keep Z, rescale r = 1/(1 − p))."""
    w = p2_eta(p, eta_var, cache)
    xp = namespace(w)
    if keep is None:
        var = w @ (V * V) - 2.0 * O * (w @ V) + O * O * xp.sum(w, axis=1, keepdims=True)
    else:
        wz = w * keep
        var = (rescale * rescale) * (wz @ (V * V)) - 2.0 * rescale * O * (wz @ V) \
            + O * O * xp.sum(w, axis=1, keepdims=True)
    return clip(var, low=0.0)

"""One head's variant as the error model sees it (HeadVariant), the scores its softmax reads, and
the float32 error of what the variants add: the softcap, ALiBi, a bias file, dropout's rescaling.

A program computes the scores as verify/variant.py defines them: S0 = scale·QK, c = C·tanh(S0/C),
S = c − slope·|diag(i) − j| + bias, −inf where hidden. Besides the error of S0 (the dot product's,
reaching S through the cap's derivative 1 − t²), each step rounds once in float32:
* the cap: S0/C (or S0·(1/C): 2u|S0/C|, through C·(1 − t²)), tanh's own error (kernel.tanh_ulps
  ulps of t, or kernel.tanh_rel·|t| for an approximate tanh such as tanh.approx.f32), the
  product by C (u|c|);
* ALiBi: the float32 slope and its product with the distance (an integer, exact): 2u·slope·|dist|;
* each addition (the ALiBi term, the bias): u·(|c| + |alibi| + |bias|) in whatever order the
  program adds them.
These bounds are one-signed (det); masked entries are exact (−inf). Dropout multiplies the kept
weights by the float32 1/(1 − p): a relative error of at most (2 + p/(1 − p))·u common to the
head (p itself, 1 − p and the reciprocal rounded), and one rounding of each product.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np

from ..variant import NONE, UNBOUNDED, Variant, alibi_bias, hidden, modified_scores
from .arrays import like, namespace
from .kernels import Kernel
from .rounding import ULP_IN_U

Rows = Union[slice, np.ndarray]  # some query rows of a head: a slice or an integer index array


class HeadVariant:
    """The case's Variant with one query head's ALiBi slope, its mask and bias files (N×M; mask:
    nonzero keeps) and the program's dropout keep-mask (N×M, 1 kept). Equal when the variant and
    slope are equal and the arrays given are the same objects, so that it keys a HeadCache entry
    as the arrays themselves do (verify/model/rounding.py): an entry's key holds it, and with it
    the arrays, alive."""

    __slots__ = ("variant", "slope", "mask", "bias", "keep", "_given", "_hidden", "origin")

    def __init__(self, variant: Variant = Variant(), slope: float = 0.0, mask: Optional[np.ndarray] = None,
                 bias: Optional[np.ndarray] = None, keep: Optional[np.ndarray] = None) -> None:
        self.variant, self.slope = variant, float(slope)
        mask = None if variant.mask == NONE else mask
        bias = None if variant.bias == NONE else bias
        keep = None if variant.dropout == 0 else keep
        self._given = (mask, bias, keep)  # identity: the caller's arrays, whatever their type
        self.mask = None if mask is None else np.asarray(mask)
        self.bias = None if bias is None else np.asarray(bias, np.float64)
        self.keep = None if keep is None else np.asarray(keep, np.float64)
        self._hidden = {}
        # A row tile's (first row, the head's row count): its methods take the tile's rows and row
        # count and answer for those rows of the whole head (rows_of).
        self.origin: Optional[Tuple[int, int]] = None

    def _key(self) -> tuple:
        return (self.variant, self.slope, self.origin) + tuple(x if isinstance(x, tuple) else id(x) for x in self._given)

    def rows_of(self, start: int, stop: int, n: int) -> "HeadVariant":
        """Query rows start..stop of this head of n rows, as a head of their own: every method
        takes the tile's rows (n: the tile's count, rows: within the tile) and answers what the
        whole head holds there (the mask, the window and ALiBi's distances, the files' rows), so
        that the error model runs on a row tile unchanged (verify/model/tiles.py)."""
        tile = HeadVariant(self.variant, self.slope, *(None if x is None else x[start:stop]
                                                       for x in (self.mask, self.bias, self.keep)))
        if self.origin is not None:  # a tile of a tile: rows of the whole head
            start, stop, n = start + self.origin[0], stop + self.origin[0], self.origin[1]
        # Equal to another tile of the same rows of the same head's files (a cache key).
        tile._given = tuple(None if x is None else (x[0] if isinstance(x, tuple) else id(x), start, stop)
                            for x in self._given)
        tile.origin = (start, n)
        return tile

    def _whole(self, n: int, rows: Optional[Rows]) -> Tuple[int, Rows]:
        """(the head's row count, its rows) for the tile's n rows (or `rows` of them)."""
        if self.origin is None:
            return n, slice(None) if rows is None else rows
        start, total = self.origin
        if rows is None:
            return total, slice(start, start + n)
        if isinstance(rows, slice):
            first, last, step = rows.indices(n)
            return total, slice(start + first, start + last, step)
        return total, start + np.arange(n)[rows]

    def __eq__(self, other) -> bool:
        return isinstance(other, HeadVariant) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"HeadVariant({self.variant}, slope={self.slope})"

    @property
    def causal(self) -> bool:
        return self.variant.causal

    @property
    def modifies(self) -> bool:
        """Whether the scores are more than scale·QK masked (softcap, ALiBi, a bias file)."""
        return self.variant.softcap > 0 or self.variant.alibi or self.bias is not None

    @property
    def cap(self) -> float:
        return self.variant.softcap

    # ---- the mask ---------------------------------------------------------------------------
    def hidden(self, n: int, m: int, rows: Optional[Rows] = None) -> np.ndarray:
        """True where row i may not see key j: the causal flag and window, a 0 in the mask file, a
        −inf in the bias file. Rows of the n×m head (all by default)."""
        key = (n, m) if rows is None else None
        if key in self._hidden:
            return self._hidden[key]
        r = slice(None) if rows is None else rows
        total, whole = self._whole(n, rows)
        out = hidden(self.variant, total, m, None if self.mask is None else self.mask[r], whole)
        if self.bias is not None:
            out |= self.bias[r] == -np.inf
        if key is not None:
            out.setflags(write=False)
            self._hidden[key] = out
        return out

    def hidden_like(self, x, n: int, m: int):
        """hidden(n, m) on x's namespace and device. A device builds the mask of the causal flag
        and window itself from the rows' and keys' indices (no N×M array built by NumPy and moved
        there for each tile); a mask or bias file's rows are moved."""
        if isinstance(x, np.ndarray) or self.mask is not None or self.bias is not None:
            return like(x, self.hidden(n, m))
        xp = namespace(x)
        total, whole = self._whole(n, None)
        first = whole.start or 0
        i = xp.reshape(xp.arange(first, first + n, device=x.device), (n, 1)) + self.variant.offset(total, m)
        j = xp.reshape(xp.arange(m, device=x.device), (1, m))
        out = xp.zeros((n, m), dtype=xp.bool, device=x.device)
        if self.variant.left != UNBOUNDED:
            out = out | (j < i - self.variant.left)
        if self.variant.right != UNBOUNDED:
            out = out | (j > i + self.variant.right)
        return out

    # ---- the scores -------------------------------------------------------------------------
    def modified(self, scaled: np.ndarray, n: Optional[int] = None, rows: Optional[Rows] = None) -> np.ndarray:
        """scale·QK (float64, rows of an n×m head) after the softcap, ALiBi and the bias, unmasked."""
        if not self.modifies:
            return scaled
        r = slice(None) if rows is None else rows
        n = scaled.shape[0] if n is None else n
        bias = None if self.bias is None else np.where(np.isfinite(self.bias[r]), self.bias[r], 0.0)
        total, whole = self._whole(n, rows)
        return modified_scores(scaled, self.variant, self.slope, bias, whole, slice(None), total, scaled.shape[1])

    def scores(self, scaled: np.ndarray, n: Optional[int] = None, rows: Optional[Rows] = None) -> np.ndarray:
        """The scores the softmax reads: modified, −inf where hidden (a new array)."""
        if not isinstance(scaled, np.ndarray):  # another namespace's (verify/model/arrays.py)
            return self._device_scores(scaled, n, rows)
        s = self.modified(scaled, n, rows)
        s = np.array(s, dtype=np.float64, copy=s is scaled)
        n = s.shape[0] if n is None else n
        np.copyto(s, -np.inf, where=self.hidden(n, s.shape[1], rows))
        return s

    def _device_scores(self, scaled, n: Optional[int], rows: Optional[Rows]):
        """scores() of a device's scale·QK: the mask, built by NumPy, moved there. The softcap, ALiBi
        and bias are NumPy's only (the check keeps such heads there: on_device_of)."""
        if self.modifies or self.dropout > 0:
            raise ValueError("this variant's scores are computed with NumPy only")
        n = scaled.shape[0] if n is None else n
        if not (self.variant.structural or self.mask is not None):
            return scaled
        xp = namespace(scaled)
        masked = self.hidden_like(scaled, n, scaled.shape[1]) if rows is None else \
            like(scaled, self.hidden(n, scaled.shape[1], rows))
        return xp.where(masked, -math.inf, scaled)

    def tanh(self, scaled: np.ndarray) -> Optional[np.ndarray]:
        """t = tanh(scale·QK / C) (None without a softcap)."""
        return np.tanh(scaled / self.cap) if self.cap > 0 else None

    def cap_slope(self, scaled: np.ndarray) -> Optional[np.ndarray]:
        """dS/dS0 = 1 − t², the softcap's derivative (None without one): the gradients of Q and K
        carry it, and so does every error of scale·QK on its way to the scores."""
        t = self.tanh(scaled)
        return None if t is None else 1.0 - t * t

    def alibi_terms(self, n: int, m: int, rows: Optional[Rows] = None) -> Optional[np.ndarray]:
        if not self.variant.alibi:
            return None
        total, whole = self._whole(n, rows)
        return alibi_bias(self.slope, total, m, whole, slice(None), self.variant.align)

    def flash_shift(self, n: int, m: int) -> Optional[np.ndarray]:
        """slope·diag(i) (N×1) under causal ALiBi, else None: flash-attn's causal kernel adds
        slope·j instead of −slope·|diag(i) − j|, which the softmax does not see but which raises
        every score of row i, its maximum and its lse by this much (docs/contract.md)."""
        if not (self.variant.alibi and self.variant.causal) or self.slope == 0:
            return None
        total, whole = self._whole(n, None)
        return self.slope * (np.arange(total, dtype=np.float64)[whole] + self.variant.offset(total, m))[:, None]

    # ---- dropout ----------------------------------------------------------------------------
    @property
    def dropout(self) -> float:
        return self.variant.dropout

    @property
    def rescale(self) -> float:
        """1/(1 − p): what dropout multiplies the kept weights by."""
        return 1.0 / (1.0 - self.dropout)

    def dropped(self, x: np.ndarray, rows: Optional[Rows] = None) -> np.ndarray:
        """x∘Z/(1 − p): the weights (or dP) as dropout keeps and rescales them; x without dropout."""
        if self.dropout == 0:
            return x
        if self.keep is None:
            raise ValueError("dropout needs the program's keep-mask (its dropout_mask stage)")
        keep = self.keep if rows is None else self.keep[rows]
        return x * keep * self.rescale


PLAIN = HeadVariant()


def as_head(x) -> HeadVariant:
    """A HeadVariant from itself, a Variant, or the causal bool of a case without variants."""
    if isinstance(x, HeadVariant):
        return x
    if isinstance(x, Variant):
        return HeadVariant(x)
    return HeadVariant(Variant(causal=bool(x)))


def tanh_error(t: np.ndarray, u: float, kernel: Kernel) -> np.ndarray:
    """Bound on |fl(tanh(x)) − tanh(x)|: tanh_ulps ulps of t, an approximation's relative error, and
    the absolute error of a tanh computed from the exponential (near 0, where it cancels)."""
    return (kernel.tanh_ulps * ULP_IN_U * u + kernel.tanh_rel) * np.abs(t) + kernel.tanh_abs


def modification_det(scaled: np.ndarray, head: HeadVariant, u: float, kernel: Kernel, flash: bool = False,
                     rows: Optional[Rows] = None, n: Optional[int] = None) -> Optional[np.ndarray]:
    """Bound on the float32 error the softcap, ALiBi and the bias add to each score (the module
    doc), from scale·QK (`scaled`, float64); None for a head that modifies nothing. 0 where hidden.
    flash: the flash stages, whose logits may carry flash-attn's causal ALiBi (slope·j, each score
    raised by slope·diag(i)): the magnitudes the roundings see grow by that much."""
    if not head.modifies:
        return None
    n = scaled.shape[0] if n is None else n
    m = scaled.shape[1]
    cap = head.cap
    c = cap * np.tanh(scaled / cap) if cap > 0 else scaled
    det = np.zeros(scaled.shape)
    if cap > 0:
        t = c / cap
        det += cap * tanh_error(t, u, kernel) + u * np.abs(c) + 2 * u * (1.0 - t * t) * np.abs(scaled)
    magnitude = np.abs(c)
    adds = 0
    alibi = head.alibi_terms(n, m, rows)
    if alibi is not None:
        adds += 1
        reach = np.abs(alibi)
        shift = head.flash_shift(n, m) if flash else None
        if shift is not None:  # slope·j: the product's magnitude is the key index's
            shift = shift if rows is None else shift[rows]
            reach = np.maximum(reach, head.slope * np.arange(m, dtype=np.float64)[None, :])
            magnitude = magnitude + np.abs(shift)
        det += 2 * u * reach
        magnitude = magnitude + reach
    if head.bias is not None:
        adds += 1
        b = head.bias if rows is None else head.bias[rows]
        magnitude = magnitude + np.where(np.isfinite(b), np.abs(b), 0.0)
    det += adds * u * magnitude
    np.copyto(det, 0.0, where=head.hidden(n, m, rows))
    return det


def cap_factor_error(scaled: np.ndarray, head: HeadVariant, u: float, kernel: Kernel) -> np.ndarray:
    """Bound on the float32 error of the cap's derivative f = 1 − t² as a program computes it
    from its float32 scale·QK: t errs by (1 − t²)·4u|S0/C| (the scale's and the division's
    roundings) and by tanh's own error; f = 1 − t·t by 2|t|·Δt and two roundings (≤ 2u)."""
    t = np.tanh(scaled / head.cap)
    dt = (1.0 - t * t) * 4 * u * np.abs(scaled / head.cap) + tanh_error(t, u, kernel)
    return 2 * np.abs(t) * dt + 2 * u


def dropout_factor_error(head: HeadVariant, u: float) -> float:
    """Relative bound on the float32 1/(1 − p) (the module doc); 0 without dropout."""
    p = head.dropout
    return 0.0 if p == 0 else (2.0 + p / (1.0 - p)) * u * (1.0 + 1e-6)

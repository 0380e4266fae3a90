"""The Python API's arrays: tensors converted, layouts read, heads split out, masks and biases
checked (verify/api.py uses these; the command line reads files instead).

Arrays are NumPy arrays, anything np.asarray takes, or PyTorch tensors (CPU or CUDA, any float
dtype: bf16 and fp16 included), converted as `.detach().float().cpu()` would (float64 kept)
without importing torch: an object with `.detach()` and `.cpu()` is taken for a tensor.

Layouts: "bhsd" (batch, heads, seq, dim), as PyTorch's SDPA; "bshd" (batch, seq, heads, dim), as
flash-attn's q, k, v and out. A layout applies to the tensors of a sequence by a head dimension
(Q, K, V, dO, output and the gradients); scores (N×M: the weights, the dropout mask, masks and
biases) and row statistics (N×1: lse, D) are (batch, heads, ...) in both, as flash-attn returns
its softmax_lse and S_dmask.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..stages import STAGES, Dims
from ..text import plural

BHSD, BSHD = "bhsd", "bshd"
LAYOUTS = (BHSD, BSHD)
_OTHER = {BHSD: BSHD, BSHD: BHSD}
# The dimension symbols of a head dimension (verify/stages.py): a stage with such columns and
# rows of a sequence is laid out as q, k and v are.
_HEAD_DIM_SYMBOLS = ("DK", "DV")
_SEQUENCE_SYMBOLS = ("N", "M")

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
# What a refused dtype is, in words (np.dtype.kind).
_DTYPE_KINDS = {"b": "boolean", "i": "integer", "u": "unsigned integer", "c": "complex", "O": "Python objects",
                "U": "strings", "S": "bytes", "V": "structured", "M": "dates", "m": "time spans"}


def is_tensor(x) -> bool:
    """A PyTorch tensor, or anything that converts as one (.detach() and .cpu())."""
    return not isinstance(x, np.ndarray) and hasattr(x, "detach") and hasattr(x, "cpu")


def as_array(x, name: str) -> np.ndarray:
    """x as a NumPy array: a tensor detached, its floats as float32 (float64 and float16 kept, so
    that a float16 tensor reads as the same NumPy array does: results stored in float16; bf16 has
    no NumPy dtype), moved to the CPU; anything else np.asarray.
    ValueError naming the argument `name` where it cannot be one (nested lists of unequal
    lengths, a tensor with no values to read: meta, nested or sparse)."""
    try:
        if not is_tensor(x):
            return np.asarray(x)
        t = x.detach()
        if t.is_floating_point():
            kept = str(t.dtype).endswith(("float64", "float16")) and not str(t.dtype).endswith("bfloat16")
            t = t if kept else t.float()
        return np.asarray(t.cpu().numpy())
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # PyTorch's, on the GPU: the command's own line
            raise
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{name}: cannot be read as an array of values ({why})") from None


def native_float(x: np.ndarray, name: str) -> np.ndarray:
    """x as float16/32/64 in this machine's byte order: a big-endian array ('>f4', from a file or
    another machine) holds the same values, converted; any other dtype is refused by name."""
    if x.dtype.kind == "f" and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if x.dtype not in _FLOAT_DTYPES:
        kind = _DTYPE_KINDS.get(x.dtype.kind)
        raise ValueError(f"{name}: dtype {x.dtype}{f' ({kind})' if kind else ''}; expected float16, float32 or "
                         "float64 (convert bfloat16 with .float())")
    return x


# ----------------------------------------------------------------------------------------------
# Layouts.

def _bhsd_shape(shape: Tuple[int, ...], layout: str) -> Optional[Tuple[int, int, int, int]]:
    """(batch, heads, seq, dim) of an input of `shape` read in `layout`; None for another rank."""
    if len(shape) == 2:
        return (1, 1) + tuple(shape)
    if len(shape) == 3:
        return (1, shape[0], shape[1], shape[2]) if layout == BHSD else (1, shape[1], shape[0], shape[2])
    if len(shape) == 4:
        return tuple(shape) if layout == BHSD else (shape[0], shape[2], shape[1], shape[3])
    return None


def _misfit(q, k, v, layout: str) -> Optional[str]:
    """Why q, k, v (shapes) do not fit together read in `layout`, or None."""
    sq, sk, sv = (_bhsd_shape(s, layout) for s in (q, k, v))
    if sq is None:
        return f"q: {len(q)}-d; expected (N, d), (H, N, d) or (B, H, N, d) in BHSD, (N, H, d) or (B, N, H, d) in BSHD"
    if len(k) != len(q) or len(v) != len(q):
        return f"q, k, v have {len(q)}, {len(k)} and {len(v)} axes: give them the same"
    for name, shape in (("q", q), ("k", k), ("v", v)):
        if 0 in shape:
            return f"{name} is {tuple(shape)}: every axis needs at least one element"
    (B, H, _, dk), (Bk, Hk, M, dk2), (Bv, Hv, Mv, _) = sq, sk, sv
    if not B == Bk == Bv:
        return f"batch {B}, {Bk} and {Bv} in q, k and v"
    if Hk != Hv:
        return f"k has {plural(Hk, 'head')}, v {Hv}: K and V share their heads"
    if Hk > H or H % Hk:
        return (f"k and v have {plural(Hk, 'head')} and q {H}: grouped K/V heads (GQA) must divide the query heads")
    if dk2 != dk:
        return f"q's head dimension is {dk}, k's {dk2}: Q and K must share d_k"
    if Mv != M:
        return f"k has {M} keys, v {Mv}: K and V must share seq_k"
    return None


def dims_of(q: np.ndarray, k: np.ndarray, v: np.ndarray, layout: str) -> Tuple[Tuple[int, ...], Optional[str]]:
    """(B, H, Hk, N, M, d_k, d_v) from q, k, v in `layout`, and a note when the other layout fits
    them too and reads them as fewer heads than rows (an unnamed BSHD tensor is the usual case).
    A layout that does not fit is a ValueError naming the layout that does."""
    shapes = tuple(tuple(x.shape) for x in (q, k, v))
    why = _misfit(*shapes, layout)
    other = _OTHER[layout]
    if why:
        if _misfit(*shapes, other) is None:
            raise ValueError(f'q is {shapes[0]}: that is {other.upper()}; pass layout="{other}"'
                             + (" (flash-attn's (batch, seq, heads, dim))" if other == BSHD else ""))
        raise ValueError(f"q {shapes[0]}, k {shapes[1]}, v {shapes[2]} read as {layout.upper()}: {why}")
    (B, H, N, dk), (_, Hk, M, _), (_, _, _, dv) = (_bhsd_shape(s, layout) for s in shapes)
    note = None
    if len(shapes[0]) > 2 and _misfit(*shapes, other) is None:
        _, H2, N2, _ = _bhsd_shape(shapes[0], other)
        if H > N and H2 < N2:
            note = (f"q is {shapes[0]}: read as {layout.upper()}, {plural(H, 'head')} of {plural(N, 'row')}; if it "
                    f'is {other.upper()}, pass layout="{other}"')
    return (B, H, Hk, N, M, dk, dv), note


def follows_layout(stage: str) -> bool:
    """Whether the stage's arrays are laid out as q, k and v (a sequence by a head dimension)."""
    s = STAGES[stage]
    return s.rows in _SEQUENCE_SYMBOLS and s.cols in _HEAD_DIM_SYMBOLS


def _to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == BSHD and x.ndim == 4:
        return x.transpose(0, 2, 1, 3)
    if layout == BSHD and x.ndim == 3:
        return x.transpose(1, 0, 2)
    return x


def stage_heads(x, stage: str, dims: Dims, layout: str, name: Optional[str] = None, packed: bool = False
                ) -> np.ndarray:
    """A stage's (or an input's) array as (heads, rows, cols): B·H query heads, or B·Hk for the
    stages of K/V heads; an N×1 stage may come without its last axis. packed: arrays of packed
    sequences, (total, heads, dim) read as `layout` is, a refusal worded so."""
    name = name or stage
    x = native_float(as_array(x, name), name)
    count, (rows, cols) = dims.heads_of(stage), STAGES[stage].shape(dims)
    laid = follows_layout(stage)
    y = _to_bhsd(x, layout) if laid else x
    if _fits(y, count, rows, cols):
        return y.reshape(count, rows, cols)
    per_batch = dims.kv if STAGES[stage].kv else dims.heads
    if packed:  # (flash-attn's varlen layouts: tokens first where q's are, an lse (heads, total))
        total, heads = ("total_k", "kv_heads") if STAGES[stage].kv else ("total_q", "heads")
        if laid:
            want, words = (rows, per_batch, cols), f"({total}, {heads}, dim)"
        else:
            want, words = ((per_batch, rows), f"({heads}, {total})") if cols == 1 else \
                ((per_batch, rows, cols), "(heads, rows, cols)")
        raise ValueError(f"{name} is {tuple(x.shape)}: expected {words} = {want}, as packed sequences are")
    if laid and x.ndim >= 3 and _fits(_to_bhsd(x, _OTHER[layout]), count, rows, cols):
        raise ValueError(f'{name} is {tuple(x.shape)}: that is {_OTHER[layout].upper()}, and q, k, v are '
                         f'{layout.upper()}; pass every array in one layout (layout="{layout}")')
    want = (dims.batch, per_batch, rows, cols) if layout == BHSD or not laid else (dims.batch, rows, per_batch, cols)
    raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {plural(count, 'head')} of {rows}x{cols}, such as "
                     f"{want}")


def _fits(x: np.ndarray, count: int, rows: int, cols: int) -> bool:
    if x.size != count * rows * cols:
        return False
    return x.ndim < 2 or x.shape[-2:] == (rows, cols) or (cols == 1 and x.shape[-1] == rows)


# ----------------------------------------------------------------------------------------------
# Masks, biases, slopes.

def _broadcast_heads(x: np.ndarray, name: str, dims: Dims) -> Tuple[np.ndarray, bool]:
    """(x as a (B, H, N, M) view, whether one matrix serves every head) for PyTorch's attn_mask
    shapes: (N, M), (B, H, N, M), or anything that broadcasts to it."""
    full = (dims.batch, dims.heads, dims.seq_q, dims.seq_k)
    if not 2 <= x.ndim <= 4:
        raise ValueError(f"{name}: {x.ndim}-d array; expected (N, M) = {full[2:]}, (B, H, N, M) = {full} or a shape "
                         "that broadcasts to it")
    try:
        view = np.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), full)
    except ValueError:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not broadcast to (B, H, N, M) = {full}") from None
    return view, int(np.prod(x.shape[:-2], dtype=np.int64)) == 1


def _first(bad: np.ndarray) -> str:
    return str(tuple(int(i) for i in np.argwhere(bad)[0]))


def mask_heads(attn_mask, dims: Dims) -> Tuple[np.ndarray, bool]:
    """attn_mask (True/1 visible, False/0 hidden) as a (B, H, N, M) view of 0/1; whether broadcast."""
    x = as_array(attn_mask, "attn_mask")
    if x.dtype.kind not in "biuf":
        raise ValueError(f"attn_mask: dtype {x.dtype}; expected bool (True: visible) or 0/1")
    if x.dtype.kind != "b":
        bad = (x != 0) & (x != 1)
        if bad.any():
            raise ValueError(f"attn_mask holds {float(x[tuple(np.argwhere(bad)[0])]):g} at {_first(bad)}: a mask holds "
                             "True/False or 0/1; PyTorch adds a float attn_mask to the scores: pass that as attn_bias=")
    return _broadcast_heads(x.astype(np.float64), "attn_mask", dims)


def bias_heads(attn_bias, dims: Dims) -> Tuple[np.ndarray, bool]:
    """attn_bias (added to the scores; −inf hides the entry) as a (B, H, N, M) view; whether broadcast."""
    x = as_array(attn_bias, "attn_bias")
    if x.dtype.kind not in "iuf":
        raise ValueError(f"attn_bias: dtype {x.dtype}; expected floats (added to the scores)")
    x = x.astype(np.float64)
    bad = np.isnan(x) | (x == np.inf)
    if bad.any():
        raise ValueError(f"attn_bias holds {float(x[tuple(np.argwhere(bad)[0])]):g} at {_first(bad)}: a bias holds "
                         "finite values or -inf (which hides the entry), never +inf or NaN")
    return _broadcast_heads(x, "attn_bias", dims)


def slopes_rows(alibi, dims: Dims) -> np.ndarray:
    """alibi's slopes as (1, H) or (B, H) float64 (flash-attn's alibi_slopes: (H,) or (B, H))."""
    x = native_float(as_array(alibi, "alibi"), "alibi").astype(np.float64)
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    if rows.ndim != 2 or rows.shape[1] != dims.heads or rows.shape[0] not in (1, dims.batch):
        raise ValueError(f"alibi: slopes of shape {tuple(x.shape)}; expected ({dims.heads},) or "
                         f"({dims.batch}, {dims.heads}): a slope per query head")
    if not np.isfinite(rows).all():
        raise ValueError(f"alibi: {float(rows[~np.isfinite(rows)][0]):g} among the slopes; slopes must be finite")
    return rows

"""Packed sequences given as arrays (the Python API's cu_seqlens_q=, cu_seqlens_k=, seqused_k=):
the offsets as ints, NumPy arrays or torch tensors, the packed tensors in flash-attn's varlen layout
(total tokens, heads, dim), and what a packed case cannot have; each refusal one line naming it.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ..sequences import CU_SEQLENS_K, CU_SEQLENS_Q, SEQUSED_K, Sequences, packed_sequences
from ..stages import STAGES, per_sequence
from ..text import plural
from .arrays import BSHD, LAYOUTS, as_array, is_tensor

# flash-attn's varlen layout: (total tokens, heads, dim), the sequences packed along the tokens.
PACKED_LAYOUT = "thd"


def offsets(name: str, x) -> Optional[Tuple[int, ...]]:
    """Offsets or lengths given as ints, a NumPy array or a torch tensor (int32 on the GPU, as
    flash-attn takes them): a tuple of ints; None when not given."""
    if x is None:
        return None
    if is_tensor(x):
        x = x.detach().cpu().numpy()
    # A bool among Python ints would become an int in the array: look at the items as given.
    given_bools = isinstance(x, (list, tuple)) and any(isinstance(i, (bool, np.bool_)) for i in x)
    values = np.asarray(x)
    if given_bools or values.ndim != 1 or not (values.dtype.kind in "iu" or (values.dtype == object and all(
            isinstance(i, numbers.Integral) and not isinstance(i, (bool, np.bool_)) for i in values))):
        got = "a list with a bool" if given_bools else f"{type(x).__name__} {values.dtype} of shape {values.shape}"
        raise TypeError(f"{name}: expected a 1-d sequence of whole numbers (a list, an int32 array or tensor), got {got}")
    return tuple(int(i) for i in values)


def packing(args: Dict[str, Any], cu_seqlens_q, cu_seqlens_k, seqused_k) -> Optional[Sequences]:
    """The sequences the arguments pack (None: not packed), and the layout they ask for checked."""
    cu_q, cu_k, used = (offsets(n, x) for n, x in ((CU_SEQLENS_Q, cu_seqlens_q), (CU_SEQLENS_K, cu_seqlens_k),
                                                    (SEQUSED_K, seqused_k)))
    if cu_q is None and cu_k is None:
        if used is not None:
            raise ValueError(f"{SEQUSED_K} without {CU_SEQLENS_Q} and {CU_SEQLENS_K}: it counts the keys of packed "
                             "sequences")
        if args["layout"] == PACKED_LAYOUT:
            raise ValueError(f'layout="{PACKED_LAYOUT}" (packed sequences) needs {CU_SEQLENS_Q}= and {CU_SEQLENS_K}=')
        args["layout"] = args["layout"] or LAYOUTS[0]
        return None
    if cu_q is None or cu_k is None:
        given, missing = (CU_SEQLENS_Q, CU_SEQLENS_K) if cu_k is None else (CU_SEQLENS_K, CU_SEQLENS_Q)
        raise ValueError(f"{given} without {missing}: packed sequences need both (B + 1 offsets each)")
    if args["layout"] not in (None, PACKED_LAYOUT):
        raise ValueError(f'layout="{args["layout"]}" with {CU_SEQLENS_Q}: packed tensors are (total, heads, dim), '
                         f'layout="{PACKED_LAYOUT}"')
    args["layout"] = PACKED_LAYOUT
    return packed_sequences(cu_q, cu_k, used)


def packed_tokens(seqs: Sequences, arrays: Dict[str, Any]) -> None:
    """Each packed tensor (total, heads, dim) with as many tokens as its offsets end at."""
    for name, x in arrays.items():
        if x is None:
            continue
        shape = tuple(as_array(x, name).shape) if not hasattr(x, "shape") else tuple(x.shape)
        if len(shape) != 3:
            raise ValueError(f'{name} is {shape}: packed tensors are (total, heads, dim) (layout="{PACKED_LAYOUT}")')
        cu, total = (CU_SEQLENS_K, seqs.total_k) if name in ("k", "v") else (CU_SEQLENS_Q, seqs.total_q)
        if shape[0] != total:
            raise ValueError(f"{name} has {plural(shape[0], 'token')}, {cu} ends at {total}")


def refuse_with_packing(stages: Mapping[str, object], attn_mask, attn_bias, dropout_p: float) -> None:
    """What a packed case cannot have: the N×M stages (a block per sequence, which arrays do not
    hold), mask and bias tensors, dropout."""
    blocks = [n for n in stages if n in STAGES and per_sequence(n)]
    if blocks:
        raise ValueError(f"stage {blocks[0]!r} is an n x m block per sequence: not accepted with {CU_SEQLENS_Q} "
                         "(pass the per-token stages: output, flash_lse, dQ, ...)")
    for name, given in (("attn_mask", attn_mask is not None), ("attn_bias", attn_bias is not None),
                        ("dropout_p", bool(dropout_p))):
        if given:
            raise ValueError(f"{name} with {CU_SEQLENS_Q}: packed sequences are checked without masks, biases or "
                             "dropout")


def packed_layout(seqs: Sequences, stages: Mapping[str, object], attn_mask, attn_bias, dropout_p: float,
                  arrays: Dict[str, Any]) -> str:
    """The layout packed arrays are read in, (total, heads, dim) read as BSHD's (seq, heads, dim)
    without the batch, once they are found to fit the offsets and the case's other arguments."""
    refuse_with_packing(stages, attn_mask, attn_bias, dropout_p)
    packed_tokens(seqs, arrays)
    return BSHD

"""An input case's tensors as PyTorch's attention functions take them, and what they compute written
as another program's output folder: what verify/bench/sdpa_outputs.py (SDPA) and
verify/bench/flex_outputs.py (FlexAttention) share. No torch here.

The tensors: Q and dO as (B, H, N, ·), K and V as (B, Hk, M, ·) (Hk = H without grouped K/V heads),
every value rounded to the format as the verifier rounds it (verify/model/half.py, nearest even,
which torch's .to(torch.bfloat16) and .half() do too), so the program and the references start from
the same values; the case's scale and variant (verify/variant.py); its mask and bias files as
(B, H, N, M), or (1, 1, N, M) when one matrix covers every head; the ALiBi slopes of its query heads
as (B, H) (the case's slopes file, else the standard slopes); a packed case's packing
(verify/sequences.py), its tensors over the packed tokens as the case holds them (batch 1); a paged
case's K and V the pool of pages, as the case holds them (verify/bench/sequence_outputs.py gathers
each sequence's keys).

The files: one `<stage>.npy` per stage holding every head as (B, heads, rows, cols), as a PyTorch user
saves a tensor: the contract's one-file form, so `check` needs no name map. The stages indexed by
K/V head (dK, dV and their flash twins) hold Hk heads, as autograd gives them. bf16 values are saved
as float32 (.npy has no bfloat16; the values are exact), fp16 values as float16, float32 results and
the row statistics (the lse) as float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ..files.case import InputCase, load_input_case
from ..files.stage_files import STACKED_SUFFIX
from ..model.half import round_to_format
from ..runs.watched import fresh_out
from ..stages import (BIAS_INPUT, FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES,
                      FLASH_LSE, FLASH_OUTPUT, GRAD_KEYS, GRAD_QUERIES, GRAD_VALUES, HALF_PRECISIONS, KEYS,
                      MASK_INPUT, OUTPUT, QUERIES, STAGES, Dims, default_scale)
from ..variant import BROADCAST, NONE, Variant

# What a run gives -> the stage that holds it: a FlashAttention-style kernel's (scores and softmax
# in float32, P rounded to the format before P·V, the log-sum-exp kept) as the flash stages, a
# composition of matmul and softmax (SDPA's math backend) as the stage path's.
FUSED_STAGES = {"out": FLASH_OUTPUT, "lse": FLASH_LSE, "dq": FLASH_GRAD_QUERIES, "dk": FLASH_GRAD_KEYS,
                "dv": FLASH_GRAD_VALUES}
COMPOSED_STAGES = {"out": OUTPUT, "dq": GRAD_QUERIES, "dk": GRAD_KEYS, "dv": GRAD_VALUES}
GRADS = ("dq", "dk", "dv")


class BackendUnavailable(Exception):
    """The program cannot run this case here (no torch or GPU, a kernel that refuses the shape, the
    dtype or the variant); the message says why, in torch's words where torch gave them."""


@dataclass(frozen=True)
class CaseTensors:
    """One case as the attention functions take it (see the module doc); `with_` gives a copy with
    some fields changed (the tests plant bugs so: another variant, slopes in another order)."""
    dims: Dims
    inputs: Dict[str, np.ndarray]
    scale: float
    variant: Variant = Variant()
    mask: Optional[np.ndarray] = None    # nonzero keeps (PyTorch's boolean attn_mask: True keeps)
    bias: Optional[np.ndarray] = None    # added to the scores; -inf masks
    slopes: Optional[np.ndarray] = None  # with variant.alibi
    sequences: Optional[Any] = None      # a packed case's packing (Sequences; a paged case's too); None: dense

    @property
    def grouped(self) -> bool:
        """Whether K and V have fewer heads than Q (GQA/MQA: torch's enable_gqa)."""
        return self.inputs[KEYS].shape[1] != self.inputs[QUERIES].shape[1]

    @property
    def backward(self) -> bool:
        """Whether the case has the output gradient dO (the runs compute the gradients)."""
        return any(STAGES[name].backward for name in self.inputs)

    @property
    def shape(self):
        """(B, H, N, M)."""
        b, h, n, _ = self.inputs[QUERIES].shape
        return b, h, n, self.inputs[KEYS].shape[2]

    def with_(self, **changes) -> "CaseTensors":
        return replace(self, **changes)


@dataclass
class Results:
    """What one run gave, as float32 arrays of the format's values: out (B, H, N, d_v), lse (B, H, N),
    grads "dq" (B, H, N, d_k), "dk", "dv" (B, Hk, M, ·); `notes` says what was left out and why."""
    out: np.ndarray
    lse: Optional[np.ndarray] = None
    grads: Dict[str, np.ndarray] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# The case's tensors.

def in_format(x: np.ndarray, precision: str) -> np.ndarray:
    """x rounded to the format (bf16, fp16) as float32 holding the values; float32 as it is."""
    if precision in HALF_PRECISIONS:
        return round_to_format(x, precision).astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def case_inputs(case: InputCase, precision: str) -> Dict[str, np.ndarray]:
    """Q, K, V (and dO) in the format, as float32 (B, heads, rows, cols): K and V with the case's
    K/V heads, Q and dO with its query heads."""
    dims = case.dims
    out = {}
    for name in case.inputs:
        count = dims.heads_of(name)
        heads = [in_format(case.load(name, i), precision) for i in range(count)]
        out[name] = np.stack(heads).reshape(dims.batch, count // dims.batch, *heads[0].shape)
    return out


def case_tensors(case: InputCase, precision: str, scale: Optional[float] = None) -> CaseTensors:
    """The case IN as the attention functions take it; `scale` the case's unless given."""
    if scale is None:
        scale = case.scale if case.scale is not None else default_scale(case.dims.d_k)
    variant = case.variant
    return CaseTensors(case.dims, case_inputs(case, precision), float(scale), variant,
                       mask=_head_tensor(case, MASK_INPUT, variant.mask),
                       bias=_head_tensor(case, BIAS_INPUT, variant.bias),
                       slopes=_slopes(case) if variant.alibi else None, sequences=case.sequences)


def load_case_tensors(in_dir: Path, precision: str, scale: Optional[float] = None) -> CaseTensors:
    """The case in the folder IN (a packed or paged one included) as the attention functions take it."""
    return case_tensors(load_input_case(in_dir), precision, scale)


def _head_tensor(case: InputCase, name: str, coverage: str) -> Optional[np.ndarray]:
    """The case's mask or bias files as (B, H, N, M), or (1, 1, N, M) for one file of every head."""
    if coverage == NONE:
        return None
    dims = case.dims
    if coverage == BROADCAST:
        return case.variant_input(name, 0)[None, None]
    heads = [case.variant_input(name, i) for i in range(dims.total_heads)]
    return np.stack(heads).reshape(dims.batch, dims.heads, dims.seq_q, dims.seq_k)


def _slopes(case: InputCase) -> np.ndarray:
    """The ALiBi slope of every query head, (B, H): the case's slopes file, else the standard ones."""
    dims = case.dims
    return np.array([case.alibi_slope(i) for i in range(dims.total_heads)]).reshape(dims.batch, dims.heads)


# ----------------------------------------------------------------------------------------------
# The files.

def stage_arrays(results: Results, fused: bool) -> Dict[str, np.ndarray]:
    """{stage: array} of what the run gave, named by the kind of kernel (module doc)."""
    names = FUSED_STAGES if fused else COMPOSED_STAGES
    given = {"out": results.out, "lse": results.lse, **results.grads}
    return {names[k]: x for k, x in given.items() if x is not None and k in names}


def write_stage_files(out_dir: Path, stages: Dict[str, np.ndarray], precision: str,
                      in_dir: Optional[Path] = None) -> List[Path]:
    """One `<stage>.npy` per stage into OUT (an earlier run's stage files moved aside first, as
    `attnstep run` does): fp16 values as float16, everything else as float32."""
    out_dir = Path(out_dir)
    fresh_out(out_dir, in_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stage, x in stages.items():
        half = precision == "fp16" and not STAGES[stage].float32
        path = out_dir / (stage + STACKED_SUFFIX)
        np.save(path, x.astype(np.float16 if half else np.float32))
        written.append(path)
    return written

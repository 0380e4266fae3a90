"""The backward pass's specs: D, dP, dS, dQ, dK, dV on the stage path, and the FlashAttention
backward's flash_dQ, flash_dK, flash_dV (P recomputed from the logits and the saved flash_lse).

One job per module: reference.py computes them (float64), bounds.py bounds a correct float32
program's error (isolated from the program's own upstream files, chained from Q, K, V and dO),
quantization.py adds what coarsely printed sources move, checks.py holds the reference-free
checks (masked dS exactly 0, dS rows and dK columns summing to 0, the flash gradients agreeing
with the stage path's). This module puts each stage's parts together.
"""
from __future__ import annotations

import numpy as np

from ...model.dot import flush_sum
from ...model.rounding import FLUSH
from ...stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, GRAD_KEYS, GRAD_OUTPUT, GRAD_QUERIES,
                       GRAD_SCORES, GRAD_VALUES, GRAD_WEIGHTS, KEYS, OUTPUT, QUERIES, ROW_DOT, VALUES, WEIGHTS)
from ..base import COLUMN_SUM, FLASH_VS_STAGES, ROW_SUM, StageSpec, cap_sources, dropout_sources, flash_sources
from ..copies import PATTERNS
from .bounds import (d_chained, d_isolated, dk_chained, dk_isolated, dp_isolated, dq_chained, dq_isolated, ds_chained,
                     ds_isolated, dv_chained, dv_isolated, floor_d)
from .checks import agrees_with, dk_column_sums, ds_checks, flash_dk_column_sums
from .flash_bounds import flash_floor, flash_isolated
from .flash_chain_pass import flash_chained
from .quantization import (d_quantization, dp_quantization, ds_quantization, dv_quantization, flash_quantization,
                           grad_quantization)
from .flash_tiles import flash_reference
from .reference import (FLASH_SOURCES, Gradients, d_reference, dk_reference, dq_reference, ds_reference, dv_reference,
                        flash_backward, flash_with_mask, grad_keys, grad_queries, grad_values)

__all__ = ["SPECS", "FLASH_SOURCES", "Gradients", "d_reference", "ds_reference", "flash_backward"]

# The bug hypotheses (verify/diagnose/backward.py) of the stages they can explain.
D_BUGS = ("D_wrong_O",)
DS_BUGS = D_BUGS + ("dS_missing_P",)
SCALE_BUGS = ("grad_unscaled",)
CAP_BUGS = ("cap_derivative",)  # the flash backward's dQ and dK without the softcap's derivative
DQ_BUGS = ("dq_rows",)  # the flash backward's dQ accumulated at the key tile's rows
OPERAND_BUGS = ("grad_operand",)  # a gradient's GEMM with a wrong operand (verify/diagnose/backward_operands.py)
DK_BUGS = ("dk_untransposed",)  # dK from dS untransposed
# the flash backward's P against a wrong lse or from scores under a wrong scale, and a gradient's loop
# stopped after its first tile
FLASH_BUGS = OPERAND_BUGS + ("grad_lse", "grad_scale", "grad_first_tile")
_GRAD_PATTERNS = PATTERNS + ("scaled",)
_FLASH_PATTERNS = _GRAD_PATTERNS + ("mask", "grad_lse_log2")
# (the stage path's dQ, dK, dV: a mask their program applied wrong, named where it wrote them alone)
_STAGE_GRAD_PATTERNS = _GRAD_PATTERNS + ("mask",)


def _flash_spec(name: str, index: int, partner: str, rebuild, invariants=(), given_upstream=(), bugs=()):
    """A flash gradient: index in (dQ, dK, dV) of the flash backward, partner its stage-path twin."""
    return StageSpec(name, reference=flash_reference(index), isolated=flash_isolated(index),
                     chained=flash_chained(index), floor=flash_floor, quantization=flash_quantization(index),
                     invariants=(agrees_with(partner),) + invariants, given_upstream=given_upstream,
                     partner=partner, given_partner=(FLASH_VS_STAGES,), scaled=True, linear=True,
                     with_mask=flash_with_mask(index), rebuild=rebuild, diagnoses=_FLASH_PATTERNS + bugs,
                     baseline=partner, variant_sources=flash_sources)


SPECS = (
    StageSpec(ROW_DOT, reference=lambda src, problem: d_reference(src[GRAD_OUTPUT], src[OUTPUT]),
              isolated=d_isolated, chained=d_chained, floor=lambda src: floor_d(src[GRAD_OUTPUT], src[OUTPUT]),
              quantization=d_quantization, linear=True, rebuild=lambda g: g.D, diagnoses=_GRAD_PATTERNS + D_BUGS),
    StageSpec(GRAD_WEIGHTS, reference=lambda src, problem: src[GRAD_OUTPUT] @ src[VALUES].T,
              isolated=dp_isolated, floor=lambda src: flush_sum(src[GRAD_OUTPUT], np.asarray(src[VALUES]).T) + FLUSH,
              quantization=dp_quantization, linear=True, diagnoses=_GRAD_PATTERNS),
    StageSpec(GRAD_SCORES,
              reference=lambda src, problem: ds_reference(src[WEIGHTS], src[GRAD_WEIGHTS], src[ROW_DOT], problem.head),
              isolated=ds_isolated, chained=ds_chained, floor=lambda src: 6 * FLUSH,
              quantization=ds_quantization, invariants=(ds_checks,), given_upstream=(ROW_SUM,), masked_value=0.0,
              rebuild=lambda g: g.dS, diagnoses=PATTERNS + DS_BUGS + ("mask",), variant_sources=dropout_sources),
    StageSpec(GRAD_QUERIES, reference=dq_reference, isolated=dq_isolated, chained=dq_chained,
              floor=lambda src: flush_sum(src[GRAD_SCORES], src[KEYS]) + FLUSH,
              quantization=grad_quantization(KEYS, False), scaled=True, linear=True,
              rebuild=grad_queries, diagnoses=_STAGE_GRAD_PATTERNS + DS_BUGS + SCALE_BUGS + OPERAND_BUGS,
              baseline=GRAD_QUERIES,
              variant_sources=cap_sources),
    StageSpec(GRAD_KEYS, reference=dk_reference, isolated=dk_isolated, chained=dk_chained,
              floor=lambda src: flush_sum(np.asarray(src[GRAD_SCORES]).T, src[QUERIES]) + FLUSH,
              quantization=grad_quantization(QUERIES, True), invariants=(dk_column_sums,),
              given_upstream=(COLUMN_SUM,), scaled=True, linear=True, rebuild=grad_keys,
              diagnoses=_STAGE_GRAD_PATTERNS + DS_BUGS + SCALE_BUGS + OPERAND_BUGS + DK_BUGS, baseline=GRAD_KEYS,
              variant_sources=cap_sources),
    StageSpec(GRAD_VALUES, reference=dv_reference, isolated=dv_isolated, chained=dv_chained,
              floor=lambda src: flush_sum(np.asarray(src[WEIGHTS]).T, src[GRAD_OUTPUT]) + FLUSH,
              quantization=dv_quantization, linear=True, rebuild=grad_values,
              diagnoses=_STAGE_GRAD_PATTERNS + ("dV_untransposed_P",) + OPERAND_BUGS, baseline=GRAD_VALUES,
              variant_sources=dropout_sources,
              dropped=(WEIGHTS,)),
    _flash_spec(FLASH_GRAD_QUERIES, 0, GRAD_QUERIES, grad_queries,
                bugs=DS_BUGS + SCALE_BUGS + CAP_BUGS + DQ_BUGS + FLASH_BUGS),
    _flash_spec(FLASH_GRAD_KEYS, 1, GRAD_KEYS, grad_keys, invariants=(flash_dk_column_sums,),
                given_upstream=(COLUMN_SUM,), bugs=DS_BUGS + SCALE_BUGS + CAP_BUGS + DK_BUGS + FLASH_BUGS),
    _flash_spec(FLASH_GRAD_VALUES, 2, GRAD_VALUES, grad_values, bugs=("dV_untransposed_P",) + FLASH_BUGS),
)

"""A mask bug in a program that wrote only its gradients (dQ, dK, dV, or the flash backward's): its
forward and backward both ran under the wrong mask, so the gradient it wrote is the whole chain's
under that mask, from the case's inputs and dO. verify/diagnose/masks.py tries each candidate mask
through this, where no file the program wrote (its output, lse, weights, dS) would tell the forward
from the backward; a gradient whose upstream files the program wrote keeps the stage's own
recomputation from them (a backward that alone misapplies the mask)."""
from __future__ import annotations

import numpy as np

from ..check import tolerance
from ..model.attention import log_sum_exp_rows
from ..specs.backward.reference import flash_with_mask
from ..specs.output import attention_from_inputs, scores_from_inputs
from ..stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT, GRAD_KEYS,
                      GRAD_OUTPUT, GRAD_QUERIES, GRAD_VALUES, KEYS, QUERIES)
from .base import width_of
from .inputs import case_inputs, slope_of, variant_of, variant_tensors

# Each gradient's place in the flash backward's (dQ, dK, dV): the stage path's are the same values.
_INDEX = {GRAD_QUERIES: 0, FLASH_GRAD_QUERIES: 0, GRAD_KEYS: 1, FLASH_GRAD_KEYS: 1, GRAD_VALUES: 2,
          FLASH_GRAD_VALUES: 2}


def gradient_recompute(stage: str, ctx, width: float):
    """(the gradient under any whole mask, None, (N, M), the width to match with) for a query head
    whose program wrote gradients alone; None otherwise (a K/V head's sum, dropout, no dO)."""
    head = ctx.head_ctx
    if stage not in _INDEX or head is None or any(n not in _INDEX for n in head.got):
        return None
    qkv, v, slope = case_inputs(ctx), variant_of(ctx), slope_of(ctx)
    dO = head.inputs.get(GRAD_OUTPUT)
    if qkv is None or dO is None or v.dropout:
        return None
    src = {**variant_tensors(ctx), **qkv, GRAD_OUTPUT: np.asarray(dO, np.float64)}
    if stage in head.chain:  # (recomputed from the inputs: the whole chain's error)
        width = max(width, width_of(tolerance.chained_bound(stage, head.chain, **head.bound_args()),
                                    head.chain[stage]))
    gradient = flash_with_mask(_INDEX[stage])

    def whole(masked) -> np.ndarray:
        forward = {FLASH_OUTPUT: attention_from_inputs(src, ctx.scale, masked, v, slope),
                   FLASH_LSE: log_sum_exp_rows(scores_from_inputs(src, ctx.scale, masked, v, slope))}
        return gradient({**src, **forward}, ctx.scale, masked, variant=v, slope=slope)
    return whole, None, (qkv[QUERIES].shape[0], qkv[KEYS].shape[0]), width


__all__ = ["gradient_recompute"]

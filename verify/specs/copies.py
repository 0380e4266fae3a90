"""Q, K, V (the binary's echo of its input files) and KT (K transposed): exact copies.

They move bits without arithmetic, so they must match bit for bit (within a file's printed
resolution, when printed coarsely). An echo that differs from its input file means the program
read its input wrongly (a layout, a parser, a wrong head); KT that is not the binary's own K
transposed is a transpose kernel's bug.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..stages import CASE_INPUTS, KEYS_T, STAGES
from .base import (ECHO_MISMATCH, NOT_TRANSPOSE, HeadContext, Problem, StageSpec, Violation, bitwise_equal,
                   nonfinite, violation)

PATTERNS = ("nonfinite", "empty_rows_nan", "unwritten", "transposed", "layout", "head_permuted", "tile_boundary")


def _echo_check(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    want = np.asarray(ctx.inputs[stage], dtype=np.float64)
    if want.shape != got.shape:
        return [Violation(ECHO_MISMATCH, f"{stage}: the echo is {got.shape[0]}x{got.shape[1]} but the input "
                          f"file is {want.shape[0]}x{want.shape[1]}", 1, None)]
    q = ctx.quantum(stage)
    out = [violation(ECHO_MISMATCH, stage, ~bitwise_equal(got, want, q),
                     "differ from the input file (must be bit-exact)" if np.ndim(q) == 0 else
                     "differ from the input file by more than the printed resolution")]
    # a non-finite input (--allow-nonfinite) echoes as such: the echo check judges it
    out.append(nonfinite(stage, np.where(np.isfinite(want), got, 0.0), np.zeros(got.shape, bool)))
    return [v for v in out if v]


def _transpose_check(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    (source,) = STAGES[stage].inputs
    X = np.asarray(ctx.own(source), dtype=np.float64)
    if X.T.shape != got.shape:
        return [Violation(NOT_TRANSPOSE, f"{stage} is {got.shape[0]}x{got.shape[1]} but {source} is "
                          f"{X.shape[0]}x{X.shape[1]}: not its transpose", 1, None)]
    qx = ctx.quanta.get(source)
    q = ctx.quantum(stage) + (qx.T if qx is not None else 0.0)
    v = violation(NOT_TRANSPOSE, stage, ~bitwise_equal(got, X.T, q),
                  f"differ from {source} transposed (must be bit-exact)" if np.ndim(q) == 0 else
                  f"differ from {source} transposed by more than the printed resolution")
    return [v] if v else []


def _echo(name: str) -> StageSpec:
    return StageSpec(name, reference=lambda src, problem: src[name], invariants=(_echo_check,),
                     echo=True, diagnoses=PATTERNS)


(TRANSPOSED,) = STAGES[KEYS_T].inputs  # K


def _transpose_reference(src, problem: Problem):
    return src[TRANSPOSED].T


def _transpose_quantization(src, quanta, problem: Problem):
    return quanta[TRANSPOSED].T if TRANSPOSED in quanta else 0.0


SPECS = tuple(_echo(name) for name in CASE_INPUTS) + (
    StageSpec(KEYS_T, reference=_transpose_reference, quantization=_transpose_quantization,
              invariants=(_transpose_check,), diagnoses=PATTERNS),
)

"""The float64 flash gradients a run of the binary should have written, for the GPU backward tests."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from verify.check.reference import reference_chain
from verify.files.case import read_matrix
from verify.stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT,
                           GRAD_OUTPUT, INPUT_NAMES, stage_file)

FLASH_GRADS = (FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)

# The fp32 flash backward's largest gradient error, relative to the largest gradient: the accuracy of
# a plain FP32 kernel, which its 3xTF32 tensor-core products are held to.
FP32_GRADIENT_ERROR = 2e-6


def flash_gradient_reference(in_dir, run, head: int, causal: bool,
                             convert: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> Dict[str, np.ndarray]:
    """dQ, dK and dV of one head in float64: the case's inputs and dO as `convert` gives them (the
    values the kernels read), and the run's own flash_output and flash_lse, the forward the
    backward recomputes from (run: verify.files.outputs.load_run of the output folder)."""
    inputs = {n: convert(read_matrix(in_dir / stage_file(n, head, "npy"))) for n in (*INPUT_NAMES, GRAD_OUTPUT)}
    inputs[FLASH_OUTPUT] = read_matrix(run.file(FLASH_OUTPUT, head))
    inputs[FLASH_LSE] = read_matrix(run.file(FLASH_LSE, head))
    return reference_chain(inputs, float(run.values["scale"]), causal, FLASH_GRADS)

"""The false-alarm suite: hundreds of random CORRECT runs must all pass.

Each case draws a shape from the whole generator space (batch, heads; seq_q and seq_k from 1 to
a few hundred, 1 and non-multiples of every tile included; d_k = d_v at each flash width, odd and
unequal head dims up to MAX_HEAD_DIM), causal or not, every distribution of
verify.files.generate.DISTRIBUTIONS, both file formats, sometimes an explicit random scale, and about a
third with the output gradient dO (the backward stages, where the backend computes them); then
generate -> binary -> check, and every stage of every head must pass (chained and isolated).
The tolerance model promises ~1e-10 false failures per element, so one failure here is a bug in
the model or in the binary, never bad luck.

The CUDA backend is swept at every precision: fp32 with each flash kernel, tf32, and the half
pipelines bf16 and fp16 (their stage path; the flash stages too where the binary has a half flash
kernel, else it leaves them out with a notice and the sweep checks what it wrote). The CPU
backend's half pipelines have their own, smaller sweep in tests/test_half.py.

ATTNSTEP_FALSE_ALARM_CASES sets the number of cases per backend (default 200: about a minute on
the CPU backend with 2 cores); scripts/gpu_check.sh runs 300 per CUDA configuration. The first 25
run by default, the others are marked slow (`-m slow`). Case i is the same
for every count and backend (its generator is seeded by i), so a failing case is reproduced by
its parameters, which the assertion prints.
"""
from __future__ import annotations

import os
import shutil

import pytest

from verify.files.generate import DISTRIBUTIONS
from verify.stages import FLASH_HEAD_DIMS, FORMATS, HALF_PRECISIONS

from helpers.end_to_end import BACKENDS, run_and_check
from helpers.random_cases import draw_case, failures

CASES = int(os.environ.get("ATTNSTEP_FALSE_ALARM_CASES", "200"))
CHUNK = 25        # cases per test function: one binary fixture, one report line per chunk
# The end-to-end backends and the CUDA half pipelines (which write no half flash stage where the
# binary has no half flash kernel, so they are not end-to-end backends, whose tests require them).
SWEPT = BACKENDS + [pytest.param(("cuda", ("--precision", p)), id=f"cuda-{p}", marks=pytest.mark.gpu)
                    for p in HALF_PRECISIONS]
# The first chunk runs by default; the rest of the sweep is marked slow (python3 -m pytest -m slow).
CHUNKS = [pytest.param(c, id=f"cases{c * CHUNK}-{min(CASES, (c + 1) * CHUNK) - 1}",
                       marks=pytest.mark.slow if c else ())
          for c in range((CASES + CHUNK - 1) // CHUNK)]


def test_the_sweep_covers_the_generator_space():
    """The draw reaches every distribution, format, flash width, causal mode, explicit scales,
    length-1 sequences, head dims the flash stages do not support and the backward, causal or not,
    with the flash backward (checked on the first 200)."""
    cases = [draw_case(i) for i in range(200)]
    assert {c.distribution for c in cases} == set(DISTRIBUTIONS)
    assert {c.fmt for c in cases} == set(FORMATS)
    assert {c.dims.d_k for c in cases if c.dims.flash_supported} == set(FLASH_HEAD_DIMS)
    assert {c.causal for c in cases} == {False, True}
    assert any(c.scale is not None for c in cases) and any(c.scale is None for c in cases)
    assert any(c.dims.seq_q == 1 for c in cases) and any(c.dims.seq_k == 1 for c in cases)
    assert any(c.dims.d_k != c.dims.d_v for c in cases)
    assert any(c.dims.d_k == c.dims.d_v and not c.dims.flash_supported for c in cases)
    assert any(c.dims.batch > 1 for c in cases)
    backward = [c for c in cases if c.backward]
    assert backward and len(backward) < len(cases)
    assert {c.causal for c in backward} == {False, True} and any(c.dims.flash_supported for c in backward)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend", SWEPT)
def test_random_correct_runs_never_fail(binary, tmp_path, backend, chunk):
    for index in range(chunk * CHUNK, min(CASES, (chunk + 1) * CHUNK)):
        case = draw_case(index)
        work = tmp_path / str(index)
        report = run_and_check(binary, work, case.dims, case.causal, backend, seed=case.index,
                               distribution=case.distribution, fmt=case.fmt, scale=case.scale,
                               backward=case.backward)
        assert report.passed, f"false alarm on {backend[0]} {' '.join(backend[1])}: {case}: {failures(report)}"
        shutil.rmtree(work)  # hundreds of cases: keep the disk use of one

"""The half pipelines (--precision bf16 / fp16): the binary's roundings, the verifier's model.

The CPU backend emulates what a bf16/fp16 attention does (inputs rounded to the format, GEMMs on
half values with float32 accumulation, the softmax in float32, every stage but the row statistics
stored in the format, the flash kernels' P and dS rounded before their GEMMs). Random correct runs
of it must pass under the half model, an independent NumPy emulation with other summation orders
(a foreign program's output, no run.toml) must pass with `check --precision`, and the classic bugs
must still fail at half precision.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from verify.check.reference import reference_chain
from verify.files.case import read_matrix
from verify.files.generate import generate_case
from verify.files.outputs import load_run
from verify.model.half import round_to_format, storage_unit
from verify.runs.runner import run_binary
from verify.stages import (FLASH_LSE, FLASH_OUTPUT, HALF_PRECISIONS, INPUT_NAMES, OUTPUT, QUERIES,
                           RUN_MANIFEST, SCALED_SCORES, STAGES, WEIGHTS, Dims, stage_file)

from helpers.end_to_end import run_and_check
from helpers.foreign_routes import mm_blas, mm_pairwise, mm_reverse
from helpers.half_programs import half_program_case
from helpers.random_cases import draw_case, failures
from helpers.reports import check_verdict

f32 = np.float32
HALF_CASES = int(os.environ.get("ATTNSTEP_HALF_FALSE_ALARM_CASES", "12"))  # per format


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_inputs_and_stage_values_are_rounded_to_the_format(binary, tmp_path, precision):
    """The echoes hold the inputs rounded as NumPy (fp16) and the verifier (bf16) round them, nearest
    even, subnormals, overflow and ties included; every stage but flash_lse and D holds values of
    the format; run.toml names the precision."""
    dims = Dims(1, 1, 9, 70, 64, 64)
    generate_case(tmp_path / "in", dims, seed=3, backward=True, fmt="npy")
    q = np.load(tmp_path / "in" / stage_file(QUERIES, 0, "npy"))
    q[0, :8] = [65519.0, 65520.0, 1e-7, 3e-8, 2.0**-24 * 1.5, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -3.3e38]
    q[1, :4] = [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6.1e-5, -1e5]
    np.save(tmp_path / "in" / stage_file(QUERIES, 0, "npy"), q.astype(f32))
    run_binary(binary, tmp_path / "in", tmp_path / "out", backend="cpu",
               extra=("--precision", precision, "--allow-nonfinite"))
    out = tmp_path / "out"
    echo = np.load(out / stage_file(QUERIES, 0, "npy"))
    with np.errstate(over="ignore"):  # 65520 and beyond are inf in fp16
        want = q.astype(np.float16).astype(f32) if precision == "fp16" else round_to_format(q, precision).astype(f32)
    np.testing.assert_array_equal(echo, want)
    for name in STAGES:
        path = out / stage_file(name, 0, "npy")
        if not path.exists():
            continue
        x = np.load(path)
        held = np.array_equal(round_to_format(x, precision), x.astype(np.float64), equal_nan=True)
        assert held != STAGES[name].float32, name
    assert f'precision = "{precision}"' in (out / RUN_MANIFEST).read_text()


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_a_run_toml_naming_the_half_flash_kernel_is_checked_under_its_model(binary, tmp_path, precision):
    """run.toml names the Hopper half kernel (split or not) as a GPU run writes it: the verifier
    knows that kernel's model, so the same correct values pass under it, without a GPU."""
    generate_case(tmp_path / "in", Dims(1, 2, 40, 70, 64, 64), seed=6, distribution="normal")
    run_binary(binary, tmp_path / "in", tmp_path / "out", backend="cpu", extra=("--precision", precision))
    toml = tmp_path / "out" / RUN_MANIFEST
    cpu = toml.read_text()
    assert 'flash_kernel = "cpu-tiled"' in cpu
    for kernel in (f"cuda-wgmma-{precision}", f"cuda-wgmma-{precision}-split3"):
        toml.write_text(cpu.replace('backend = "cpu"', 'backend = "cuda"').replace('"cpu-tiled"', f'"{kernel}"'))
        code, verdict = check_verdict(tmp_path / "in", tmp_path / "out")
        assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), (kernel, verdict)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("dims,causal", [(Dims(1, 3, 128, 128, 64, 64), False), (Dims(2, 2, 77, 200, 40, 24), True),
                                         (Dims(1, 2, 300, 129, 128, 128), True)])
def test_the_cuda_backend_at_half_precision_passes(binary, tmp_path, precision, dims, causal):
    """The CUDA backend at bf16/fp16, forward and backward: the stage path (cublasGemmEx on half
    operands, float32 accumulation, each stage rounded to the format) and, on a Hopper GPU, the
    wgmma flash forward and backward pass under the half model; elsewhere the flash stages are left
    out with a notice."""
    generate_case(tmp_path / "in", dims, seed=4, causal=causal, backward=True, distribution="normal")
    proc = subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                           "--backend", "cuda", "--precision", precision], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    toml = (tmp_path / "out" / RUN_MANIFEST).read_text()
    assert 'backend = "cuda"' in toml and f'precision = "{precision}"' in toml
    stages = load_run(tmp_path / "out").stages
    if FLASH_OUTPUT in stages:  # a Hopper GPU: the half flash forward and backward ran
        assert f'flash_kernel = "cuda-wgmma-{precision}' in toml, toml
        assert "flash_dQ" in stages and "skipping them" not in proc.stderr, proc.stderr
    elif dims.flash_supported:
        assert f"--precision {precision}: the cuda backend has no half-precision kernel for" in proc.stderr, proc.stderr
        assert "flash_dQ" in proc.stderr and "skipping them" in proc.stderr, proc.stderr
    code, verdict = check_verdict(tmp_path / "in", tmp_path / "out")
    assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), verdict


def _run_half_flash(binary, in_dir, out_dir, precision, causal, *extra):
    """The flash forward at `precision` with the wgmma kernel forced; skips where this GPU has no
    half flash kernel (it needs compute capability 9.0)."""
    res = run_binary(binary, in_dir, out_dir, backend="cuda", check=False,
                     extra=["--poison", "--stages", "flash", "--flash-kernel", "wgmma", "--precision", precision,
                            *(["--causal"] if causal else []), *extra])
    if res.returncode == 2 and "no wgmma variant" in res.stderr:
        pytest.skip(f"this GPU has no half-precision flash kernel: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    return load_run(out_dir)


# Tails in N and M, one key, causal tiles across the diagonal, few blocks (the KV loop split and
# merged, the merge rounding to the format) and enough blocks that it is not (the kernel rounds);
# 21 heads: the causal kernel orders its blocks in groups of 8 heads, and the last group is short.
HALF_FLASH_SHAPES = [Dims(1, 1, 1, 1, 64, 64), Dims(1, 2, 127, 333, 64, 64), Dims(2, 1, 200, 97, 128, 128),
                     Dims(1, 40, 600, 300, 64, 64), Dims(1, 40, 600, 300, 128, 128), Dims(3, 7, 450, 520, 64, 64)]
VERIFIED_MAX_HEADS = 2  # the verifier's exact bounds cost seconds a head at the larger shapes


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("dims", HALF_FLASH_SHAPES, ids=[str(d) for d in HALF_FLASH_SHAPES])
def test_the_wgmma_flash_forward_at_half_precision_passes(binary, tmp_path, precision, dims):
    """The Hopper flash forward at bf16/fp16: its output holds values of the format, lse stays
    float32, the verifier passes it under the half model, and every head is within a few units of
    the format of the float64 reference (the split and unsplit paths both)."""
    in_dir = generate_case(tmp_path / "in", dims, seed=5, distribution="normal", fmt="npy")
    for causal in (False, True):
        run = _run_half_flash(binary, in_dir, tmp_path / f"out-{causal}", precision, causal)
        assert run.values["flash_kernel"].startswith(f"cuda-wgmma-{precision}"), run.values["flash_kernel"]
        if dims.total_heads <= VERIFIED_MAX_HEADS:
            code, verdict = check_verdict(in_dir, tmp_path / f"out-{causal}", "--causal" if causal else "--no-causal")
            assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), verdict
        unit = storage_unit(precision)
        for head in range(dims.total_heads):
            inputs = {n: round_to_format(read_matrix(in_dir / stage_file(n, head, "npy")), precision)
                      for n in INPUT_NAMES}
            ref = reference_chain(inputs, float(run.values["scale"]), causal, [FLASH_OUTPUT, FLASH_LSE])
            got = read_matrix(run.file(FLASH_OUTPUT, head))
            assert np.array_equal(round_to_format(got, precision), got), f"head {head}: O not in {precision}"
            err = np.abs(got - ref[FLASH_OUTPUT]).max() / np.abs(ref[FLASH_OUTPUT]).max()
            assert err < 8 * unit, f"{precision} causal={causal} head {head}: O off by {err:.3g}"
            lse_err = np.abs(read_matrix(run.file(FLASH_LSE, head)) - ref[FLASH_LSE]).max()
            assert lse_err < 1e-3, f"{precision} causal={causal} head {head}: lse off by {lse_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("scale", [-0.2, 0.05])
@pytest.mark.parametrize("d", [64, 128])
def test_the_wgmma_flash_forward_at_half_precision_takes_either_sign_of_scale(binary, tmp_path, precision, scale, d):
    """A positive scale goes into the exponent's FFMA (the row max taken of the unscaled scores); a
    negative one is applied before the mask, which it would otherwise turn from -inf to +inf. Each
    must match the float64 reference, causal or not, in both widths' configurations."""
    dims = Dims(1, 2, 300, 260, d, d)
    in_dir = generate_case(tmp_path / "in", dims, seed=11, distribution="normal", fmt="npy")
    unit = storage_unit(precision)
    for causal in (False, True):
        run = _run_half_flash(binary, in_dir, tmp_path / f"out-{causal}", precision, causal, "--scale", str(scale))
        assert np.float32(float(run.values["scale"])) == np.float32(scale)
        for head in range(dims.total_heads):
            inputs = {n: round_to_format(read_matrix(in_dir / stage_file(n, head, "npy")), precision)
                      for n in INPUT_NAMES}
            ref = reference_chain(inputs, float(run.values["scale"]), causal, [FLASH_OUTPUT, FLASH_LSE])
            got = read_matrix(run.file(FLASH_OUTPUT, head))
            err = np.abs(got - ref[FLASH_OUTPUT]).max() / np.abs(ref[FLASH_OUTPUT]).max()
            assert err < 8 * unit, f"scale {scale} causal={causal} head {head}: O off by {err:.3g}"
            lse_err = np.abs(read_matrix(run.file(FLASH_LSE, head)) - ref[FLASH_LSE]).max()
            assert lse_err < 1e-3, f"scale {scale} causal={causal} head {head}: lse off by {lse_err:.3g}"


# The first chunk of each format runs by default, the others are marked slow (-m slow).
CHUNKS = [pytest.param(p, c, id=f"{p}-{c}", marks=pytest.mark.slow if c else ())
          for p in HALF_PRECISIONS for c in range((HALF_CASES + 5) // 6)]


@pytest.mark.parametrize("precision,chunk", CHUNKS)
def test_random_correct_half_runs_never_fail(binary, tmp_path, precision, chunk):
    """Random cases of the false-alarm sweep's generator space (every distribution, shape kind,
    causal mode, scale and the backward) at half precision on the CPU backend: every stage passes
    under the half model, and the verdict names it."""
    for index in range(chunk * 6, min(HALF_CASES, (chunk + 1) * 6)):
        case = draw_case(1000 + index)
        work = tmp_path / str(index)
        report = run_and_check(binary, work, case.dims, case.causal, ("cpu", ("--precision", precision)),
                               seed=case.index, distribution=case.distribution, fmt=case.fmt, scale=case.scale,
                               backward=case.backward)
        assert report.passed, f"false alarm at {precision}: {case}: {failures(report)}"
        shutil.rmtree(work)


# ---- an independent half-precision program (tests/helpers/half_programs.py) -------------------

@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("mm,causal,fmt", [(mm_reverse, False, "npy"), (mm_pairwise, True, "txt"),
                                          (mm_blas, True, "npy")], ids=["reverse", "pairwise-causal-txt",
                                                                        "blas-causal"])
def test_an_independent_half_program_passes(tmp_path, precision, mm, causal, fmt):
    in_dir, out_dir = half_program_case(tmp_path, precision, mm, causal, fmt=fmt)
    code, verdict = check_verdict(in_dir, out_dir, "--precision", precision, *(["--causal"] if causal else []))
    assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), verdict


def test_an_fp16_stage_read_from_a_float16_array_is_bounded_as_its_text_is(tmp_path):
    """A float16 .npy holds exactly what an fp16 program stored; the bound already holds that
    storage's rounding, so reading the file adds nothing (half a unit more would let a value one
    unit off through): the same values as %.9g text and as '<f2' use the same share of their bound."""
    from verify.check.compare import Options, check
    used = {}
    for fmt in ("npy", "txt"):
        in_dir, out_dir = half_program_case(tmp_path / fmt, "fp16", mm_blas, False, fmt=fmt)
        report = check(in_dir, out_dir, Options(jobs=1, precision="fp16"))
        used[fmt] = {(r.stage, r.head): round(r.chained.tol_used, 6) for r in report.results
                     if r.stage in (FLASH_OUTPUT, OUTPUT, WEIGHTS)}
    assert used["npy"] == used["txt"], used


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_a_missing_scale_fails_at_half_precision(tmp_path, precision):
    in_dir, out_dir = half_program_case(tmp_path, precision, mm_blas, False, bug="unscaled")
    code, verdict = check_verdict(in_dir, out_dir, "--precision", precision)
    assert code == 1 and verdict.startswith(f"FAIL (bounds for {precision}): first failing stage: {SCALED_SCORES}"), \
        verdict


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("bug,code", [("no_rescale", "online_rescale_missing"), ("skip_key_tile", "key_tile_skipped")])
def test_a_flash_loop_bug_is_named_at_half_precision(tmp_path, precision, bug, code):
    """The flash loop's bug is named on flash_output, the first failing stage: its P rounded to the
    format before P·V widens the output's bound until the bug moves it by fewer than a hundred
    widths, but the bug's candidate reproduces it to the output's own rounding."""
    in_dir, out_dir = half_program_case(tmp_path, precision, mm_blas, False, bug=bug)
    status, verdict = check_verdict(in_dir, out_dir, "--precision", precision)
    assert status == 1 and verdict.startswith(f"FAIL (bounds for {precision}): first failing stage: {FLASH_OUTPUT} "
                                              f"(both heads); {code}:"), verdict


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_one_wrong_element_fails_when_it_exceeds_the_half_bound(tmp_path, precision):
    """One output element off by 2% (five half ulps of bf16, forty of fp16) fails, at that element;
    the same program run at fp32 bounds fails everywhere (its values are half-rounded)."""
    in_dir, out_dir = half_program_case(tmp_path, precision, mm_blas, False)
    path = out_dir / stage_file(OUTPUT, 1, "npy")
    x = np.load(path)
    x[3, 5] = x[3, 5] * 1.02 + np.sign(x[3, 5]) * 0.02 * np.abs(x).max()
    np.save(path, x)
    json_path = tmp_path / "r.json"
    code, verdict = check_verdict(in_dir, out_dir, "--precision", precision, "--json", json_path)
    assert code == 1 and f"first failing stage: {OUTPUT}" in verdict, verdict
    failed = [r for r in json.loads(json_path.read_text())["results"] if not r["passed"]]
    assert [(r["stage"], r["head"]) for r in failed] == [(OUTPUT, 1)], failed
    code, verdict = check_verdict(in_dir, out_dir, "--precision", "fp32")
    assert code == 1, verdict


def test_half_runs_of_the_binary_name_their_bounds(binary, tmp_path):
    generate_case(tmp_path / "in", Dims(1, 2, 33, 40, 32, 32), seed=2, backward=True)
    run_binary(binary, tmp_path / "in", tmp_path / "out", backend="cpu", extra=("--precision", "fp16"))
    code, verdict = check_verdict(tmp_path / "in", tmp_path / "out")
    assert code == 0 and verdict.startswith("PASS (bounds for fp16)"), verdict
    code, verdict = check_verdict(tmp_path / "in", tmp_path / "out", "--precision", "fp32")
    assert code == 1 and verdict.startswith("FAIL (bounds for fp32)"), verdict


def test_fp16_npy_inputs_are_read_exactly(binary, tmp_path):
    """An fp16 case saved as '<f2' .npy: every binary16 value (all 65,536 bit patterns, subnormals,
    ±inf and NaN included) is read as the float32 that equals it, by the binary and the verifier
    alike, and a correct fp16 run of such a case passes."""
    dims = Dims(1, 1, 256, 256, 256, 256)
    generate_case(tmp_path / "in", dims, seed=1, fmt="npy")
    every = np.arange(2**16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    np.save(tmp_path / "in" / stage_file(QUERIES, 0, "npy"), every)
    run_binary(binary, tmp_path / "in", tmp_path / "echo", backend="cpu",
               extra=("--stages", QUERIES, "--allow-nonfinite"))
    echo = np.load(tmp_path / "echo" / stage_file(QUERIES, 0, "npy"))
    np.testing.assert_array_equal(echo, every.astype(f32))
    code, verdict = check_verdict(tmp_path / "in", tmp_path / "echo", "--allow-nonfinite")
    assert code == 0, verdict

    small = Dims(1, 2, 40, 50, 32, 32)
    generate_case(tmp_path / "in2", small, seed=6, fmt="npy", backward=True)
    for name in INPUT_NAMES:
        for i in range(small.total_heads):
            path = tmp_path / "in2" / stage_file(name, i, "npy")
            np.save(path, np.load(path).astype(np.float16))
    run_binary(binary, tmp_path / "in2", tmp_path / "out2", backend="cpu", extra=("--precision", "fp16"))
    code, verdict = check_verdict(tmp_path / "in2", tmp_path / "out2")
    assert code == 0 and verdict.startswith("PASS (bounds for fp16)"), verdict

"""The backward stages of the binary against a float64 NumPy reference (the CPU backend, and the
CUDA backend under the gpu marker), and how a case with or without the output gradient dO selects
them.

The reference is computed here from the input files; the bound is loose float32 (the verifier's
tolerance model is not under test). Shapes are small and take tail tiles (N, M not multiples of 64).
"""
from __future__ import annotations

import subprocess
import tomllib

import numpy as np
import pytest

from verify.stages import (BACKWARD_STAGES, CASE_INPUTS, FORWARD_STAGES, GRAD_INPUT, INPUT_MANIFEST,
                           RUN_MANIFEST, STAGES, Dims, stage_file)

from helpers.flash_gradients import FLASH_GRADS, FP32_GRADIENT_ERROR
from helpers.shapes import shape_id

GRADS = ("dQ", "dK", "dV")

BACKWARD_SHAPES = [
    (Dims(batch=1, heads=2, seq_q=70, seq_k=130, d_k=16, d_v=16), True),
    (Dims(batch=1, heads=1, seq_q=130, seq_k=70, d_k=64, d_v=64), False),
    (Dims(batch=1, heads=1, seq_q=130, seq_k=70, d_k=64, d_v=64), True),
    (Dims(batch=1, heads=1, seq_q=65, seq_k=129, d_k=64, d_v=64), False),
]


def write_case(path, dims: Dims, *, grad=True, seed=0, manifest_extra=""):
    """An .npy case with Q, K, V (and dO) for every head and a manifest; returns the matrices."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = CASE_INPUTS if grad else tuple(n for n in CASE_INPUTS if n != GRAD_INPUT)
    mats = {}
    for i in range(dims.total_heads):
        for name in names:
            mats[name, i] = rng.standard_normal(STAGES[name].shape(dims)).astype(np.float32)
            np.save(path / stage_file(name, i, "npy"), mats[name, i])
    dim_lines = "".join(f"{k} = {getattr(dims, k)}\n" for k in ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v"))
    (path / INPUT_MANIFEST).write_text(dim_lines + manifest_extra)
    return mats


# Every backend computes the backward stages; the CUDA one only where a GPU is.
BACKENDS = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def run_binary(binary, in_dir, out_dir, *extra, backend="cpu"):
    return subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", backend,
                           *map(str, extra)], capture_output=True, text=True, timeout=600)


def run_ok(binary, in_dir, out_dir, *extra, backend="cpu"):
    proc = run_binary(binary, in_dir, out_dir, *extra, backend=backend)
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads((out_dir / RUN_MANIFEST).read_text())


def backward_reference(q, k, v, do, scale, causal):
    """float64 backward of one head: the stage path's intermediates and gradients."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    mask = np.triu(np.ones((q.shape[0], k.shape[0]), bool), 1) if causal else np.zeros((q.shape[0], k.shape[0]), bool)
    s = np.where(mask, -np.inf, q @ k.T * scale)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    o = p @ v
    D = (do * o).sum(axis=1, keepdims=True)
    dp = do @ v.T
    ds = p * (dp - D)
    grads = {"dQ": scale * ds @ k, "dK": scale * ds.T @ q, "dV": p.T @ do}
    ref = {"dO": do, "D": D, "dP": dp, "dS": ds, **grads, **{f"flash_{g}": x for g, x in grads.items()}}
    return ref, mask


def assert_close(name, got, ref):
    assert got.shape == ref.shape, name
    err = np.abs(got.astype(np.float64) - ref).max()
    bound = 1e-4 * np.abs(ref).max() + 1e-6
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def load(out_dir, name, head):
    return np.load(out_dir / stage_file(name, head, "npy"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims,causal", [pytest.param(d, c, id=shape_id(d, c)) for d, c in BACKWARD_SHAPES])
def test_backward_stages_match_float64_reference(binary, tmp_path, dims, causal, backend):
    mats = write_case(tmp_path / "in", dims)
    r = run_ok(binary, tmp_path / "in", tmp_path / "out", "--poison", *(["--causal"] if causal else []),
               backend=backend)
    assert r["stages"].split(",") == list(FORWARD_STAGES + BACKWARD_STAGES)
    for i in range(dims.total_heads):
        ref, mask = backward_reference(mats["Q", i], mats["K", i], mats["V", i], mats["dO", i], r["scale"], causal)
        for name in BACKWARD_STAGES:
            assert_close(f"{name} head {i}", load(tmp_path / "out", name, i), ref[name])
        ds = load(tmp_path / "out", "dS", i)
        assert (ds[mask] == 0).all() and not np.signbit(ds[mask]).any(), "dS is not exactly 0 where masked"
        for g in GRADS:  # the flash backward agrees with the stage path
            assert_close(f"flash_{g} vs {g}", load(tmp_path / "out", f"flash_{g}", i),
                         load(tmp_path / "out", g, i).astype(np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_deterministic(binary, tmp_path, backend):
    dims = Dims(batch=1, heads=3, seq_q=300, seq_k=350, d_k=32, d_v=32)
    write_case(tmp_path / "in", dims)
    for out in ("a", "b"):
        run_ok(binary, tmp_path / "in", tmp_path / out, "--causal", backend=backend)
    for name in BACKWARD_STAGES:
        for i in range(dims.total_heads):
            a, b = ((tmp_path / out / stage_file(name, i, "npy")).read_bytes() for out in ("a", "b"))
            assert a == b, f"{name} head {i} differs between two runs"


def written_files(out_dir):
    return sorted(p.name for p in out_dir.iterdir() if p.name != RUN_MANIFEST)


def test_one_backward_stage_pulls_in_its_sources(binary, tmp_path):
    dims = Dims(batch=1, heads=1, seq_q=40, seq_k=50, d_k=16, d_v=16)
    mats = write_case(tmp_path / "in", dims)
    r = run_ok(binary, tmp_path / "in", tmp_path / "out", "--stages", "dQ", "--causal")
    assert r["stages"] == "dQ"
    assert written_files(tmp_path / "out") == [stage_file("dQ", 0, "npy")]
    ref, _ = backward_reference(mats["Q", 0], mats["K", 0], mats["V", 0], mats["dO", 0], r["scale"], True)
    assert_close("dQ", load(tmp_path / "out", "dQ", 0), ref["dQ"])


def test_one_flash_gradient_computes_the_flash_backward(binary, tmp_path):
    dims = Dims(batch=1, heads=1, seq_q=70, seq_k=90, d_k=16, d_v=16)
    mats = write_case(tmp_path / "in", dims)
    r = run_ok(binary, tmp_path / "in", tmp_path / "out", "--stages", "flash_dK")
    assert r["stages"] == "flash_dK"
    assert r["flash_block_q"] > 0 and r["flash_block_k"] > 0
    assert written_files(tmp_path / "out") == [stage_file("flash_dK", 0, "npy")]
    ref, _ = backward_reference(mats["Q", 0], mats["K", 0], mats["V", 0], mats["dO", 0], r["scale"], False)
    assert_close("flash_dK", load(tmp_path / "out", "flash_dK", 0), ref["flash_dK"])


@pytest.mark.parametrize("group,expected", [
    ("all", FORWARD_STAGES + BACKWARD_STAGES),
    ("stages", tuple(n for n in FORWARD_STAGES + BACKWARD_STAGES if not STAGES[n].flash)),
    ("flash", tuple(n for n in FORWARD_STAGES + BACKWARD_STAGES if STAGES[n].flash)),
])
def test_groups_take_the_backward_stages_only_with_dO(binary, tmp_path, group, expected):
    dims = Dims(batch=1, heads=1, seq_q=9, seq_k=11, d_k=16, d_v=16)
    write_case(tmp_path / "with", dims)
    write_case(tmp_path / "without", dims, grad=False)
    r = run_ok(binary, tmp_path / "with", tmp_path / "out_with", "--stages", group)
    assert r["stages"].split(",") == list(expected)
    r = run_ok(binary, tmp_path / "without", tmp_path / "out_without", "--stages", group)
    assert r["stages"].split(",") == [n for n in expected if not STAGES[n].backward]


def assert_bad_input(proc, *words):
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("main: error:")]
    assert len(errors) == 1, proc.stderr
    for w in words:
        assert w in errors[0], proc.stderr


@pytest.mark.parametrize("stages", ["dQ", "flash_dV", "Q,dS"])
def test_backward_stage_without_dO_is_an_error(binary, tmp_path, stages):
    dims = Dims(batch=1, heads=1, seq_q=9, seq_k=11, d_k=16, d_v=16)
    write_case(tmp_path / "in", dims, grad=False)
    proc = run_binary(binary, tmp_path / "in", tmp_path / "out", "--stages", stages)
    assert_bad_input(proc, stages.split(",")[-1], "has no dO")
    assert "attnstep generate --backward" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_dO_for_one_head_names_the_file(binary, tmp_path):
    dims = Dims(batch=1, heads=3, seq_q=9, seq_k=11, d_k=16, d_v=16)
    write_case(tmp_path / "in", dims)
    (tmp_path / "in" / stage_file("dO", 1, "npy")).unlink()
    proc = run_binary(binary, tmp_path / "in", tmp_path / "out")
    assert_bad_input(proc, stage_file("dO", 1, "npy"), "missing")
    assert not (tmp_path / "out").exists()


def test_manifest_backward_requires_dO(binary, tmp_path):
    dims = Dims(batch=1, heads=1, seq_q=9, seq_k=11, d_k=16, d_v=16)
    write_case(tmp_path / "in", dims, grad=False, manifest_extra="backward = true\n")
    proc = run_binary(binary, tmp_path / "in", tmp_path / "out")
    assert_bad_input(proc, stage_file("dO", 0, "npy"), "backward = true")


def test_dO_of_the_wrong_shape_is_an_error(binary, tmp_path):
    dims = Dims(batch=1, heads=1, seq_q=9, seq_k=11, d_k=16, d_v=16)
    write_case(tmp_path / "in", dims)
    np.save(tmp_path / "in" / stage_file("dO", 0, "npy"), np.zeros((11, 16), np.float32))
    proc = run_binary(binary, tmp_path / "in", tmp_path / "out")
    assert_bad_input(proc, stage_file("dO", 0, "npy"), "seq_q x d_v")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_over_several_head_groups_matches_one_group(binary, tmp_path, backend):
    dims = Dims(batch=1, heads=5, seq_q=128, seq_k=128, d_k=64, d_v=64)
    write_case(tmp_path / "in", dims)
    run_ok(binary, tmp_path / "in", tmp_path / "one", "--causal", backend=backend)
    # (2 MiB: one head a group on the GPU, whose Hopper fp32 flash backward takes 1.2 MiB a head here.)
    run_ok(binary, tmp_path / "in", tmp_path / "many", "--causal", "--max-memory-mb", "2", backend=backend)
    for name in BACKWARD_STAGES:
        for i in range(dims.total_heads):
            one, many = load(tmp_path / "one", name, i), load(tmp_path / "many", name, i)
            if backend == "cuda" and not STAGES[name].flash:
                # cuBLAS may pick another GEMM algorithm for another batch count.
                assert_close(f"{name} head {i}", many, one.astype(np.float64))
            else:
                assert np.array_equal(one, many), (name, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_in_tf32_with_poison_writes_every_element(binary, tmp_path, backend):
    dims = Dims(batch=1, heads=1, seq_q=70, seq_k=130, d_k=32, d_v=32)
    mats = write_case(tmp_path / "in", dims)
    r = run_ok(binary, tmp_path / "in", tmp_path / "out", "--causal", "--precision", "tf32", "--poison",
               backend=backend)
    ref, _ = backward_reference(mats["Q", 0], mats["K", 0], mats["V", 0], mats["dO", 0], r["scale"], True)
    for name in BACKWARD_STAGES:
        got = load(tmp_path / "out", name, 0).astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: an element was not written"
        err, bound = np.abs(got - ref[name]).max(), 1e-2 * np.abs(ref[name]).max()
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_flash_backward_in_fp32_is_fp32_accurate(binary, tmp_path, d, causal):
    """The flash backward's fp32 (3xTF32) gradients within 2e-6 of float64, relative to the largest
    magnitude of each: the accuracy of a plain FP32 kernel."""
    dims = Dims(batch=1, heads=2, seq_q=700, seq_k=900, d_k=d, d_v=d)
    mats = write_case(tmp_path / "in", dims, seed=4)
    r = run_ok(binary, tmp_path / "in", tmp_path / "out", "--stages", "flash", *(["--causal"] if causal else []),
               backend="cuda")
    for i in range(dims.total_heads):
        ref, _ = backward_reference(mats["Q", i], mats["K", i], mats["V", i], mats["dO", i], r["scale"], causal)
        for name in FLASH_GRADS:
            got = load(tmp_path / "out", name, i).astype(np.float64)
            rel = np.abs(got - ref[name]).max() / np.abs(ref[name]).max()
            assert rel <= FP32_GRADIENT_ERROR, f"{name} head {i}: relative error {rel:.3g}"

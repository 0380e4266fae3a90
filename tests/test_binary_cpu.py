"""The CPU backend's numbers against a float64 NumPy reference, through the binary.

Loose checks only (the real verifier, verify/check/compare.py, owns the tolerance model): every stage
within a relative bound, masked entries exactly -inf / 0, flash equal to the stage path, TF32
rounding visible, and --poison leaving no NaN behind. Shapes from tests/helpers/shapes.py (irregular on
purpose: tail tiles, N > M causal, d_k != d_v).
"""
from __future__ import annotations

import subprocess
import tomllib

import numpy as np
import pytest

from verify.check.compare import Options, check
from verify.files.outputs import load_run
from verify.stages import INPUT_NAMES, RUN_MANIFEST, STAGES, Dims, stage_file

from helpers.nan_case import NAN_DIMS, nan_case, nan_row_failures
from helpers.shapes import shape_params


def write_npy_case(path, dims: Dims, seed=0, scale_inputs=1.0):
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = {"Q": (dims.seq_q, dims.d_k), "K": (dims.seq_k, dims.d_k), "V": (dims.seq_k, dims.d_v)}
    mats = {}
    for i in range(dims.total_heads):
        for name in INPUT_NAMES:
            mats[name, i] = (rng.standard_normal(shapes[name]) * scale_inputs).astype(np.float32)
            np.save(path / stage_file(name, i, "npy"), mats[name, i])
    (path / "manifest.toml").write_text(
        "".join(f"{k} = {getattr(dims, k)}\n" for k in ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v")))
    return mats


def run_cpu(binary, in_dir, out_dir, *extra):
    proc = subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                           *map(str, extra)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads((out_dir / RUN_MANIFEST).read_text())


def reference(q, k, v, scale, causal):
    """float64 stage-by-stage reference of one head."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    qk = q @ k.T
    mask = np.triu(np.ones(qk.shape, bool), 1) if causal else np.zeros(qk.shape, bool)
    s = np.where(mask, -np.inf, qk * scale)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    p = e / e.sum(axis=1, keepdims=True)
    o = p @ v
    lse = (mx + np.log(e.sum(axis=1, keepdims=True)))
    return {"Q": q, "K": k, "V": v, "KT": k.T, "QK": qk, "QK_scaled": s, "attention_weights": p,
            "output": o, "flash_output": o, "flash_lse": lse}, mask


def assert_close(name, got, ref, d, rtol):
    """|got - ref| <= rtol * (|ref| + typical magnitude): a loose float32 bound."""
    assert got.shape == ref.shape, name
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), f"{name}: non-finite pattern differs"
    assert np.array_equal(got[~fin], ref[~fin]), f"{name}: masked values differ"
    typical = {"QK": np.sqrt(d), "QK_scaled": 1.0, "flash_lse": 1.0}.get(name, 1.0)
    err = np.abs(got[fin] - ref[fin])
    bound = rtol * (np.abs(ref[fin]) + typical)
    assert (err <= bound).all(), f"{name}: max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dims,causal", shape_params())
def test_stages_match_float64_reference(binary, tmp_path, dims, causal):
    mats = write_npy_case(tmp_path / "in", dims)
    args = ["--causal"] if causal else []
    r = run_cpu(binary, tmp_path / "in", tmp_path / "out", *args)
    assert r["causal"] is causal
    written = r["stages"].split(",")
    assert ("flash_output" in written) == dims.flash_supported
    for i in range(dims.total_heads):
        ref, mask = reference(mats["Q", i], mats["K", i], mats["V", i], r["scale"], causal)
        for name in written:
            got = np.load(tmp_path / "out" / stage_file(name, i, "npy")).astype(np.float64)
            assert got.shape == STAGES[name].shape(dims)
            assert_close(f"{name}[head {i}]", got, ref[name], dims.d_k, rtol=2e-5)
        if causal:
            p = np.load(tmp_path / "out" / stage_file("attention_weights", i, "npy"))
            assert (p[mask] == 0).all()
            s = np.load(tmp_path / "out" / stage_file("QK_scaled", i, "npy"))
            assert np.isneginf(s[mask]).all() and np.isfinite(s[~mask]).all()


def test_echoes_are_bit_exact(binary, tmp_path):
    dims = Dims(1, 2, 33, 47, 24, 40)
    mats = write_npy_case(tmp_path / "in", dims)
    run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "Q,K,V,KT")
    for i in range(2):
        for name in INPUT_NAMES:
            assert np.array_equal(np.load(tmp_path / "out" / stage_file(name, i, "npy")), mats[name, i])
        assert np.array_equal(np.load(tmp_path / "out" / stage_file("KT", i, "npy")), mats["K", i].T)


def tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 to TF32, nearest even (what the binary should do to GEMM operands)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32)


def test_tf32_rounds_gemm_operands(binary, tmp_path):
    dims = Dims(1, 1, 70, 90, 64, 64)
    mats = write_npy_case(tmp_path / "in", dims)
    r = run_cpu(binary, tmp_path / "in", tmp_path / "tf32", "--precision", "tf32", "--stages", "QK,flash")
    run_cpu(binary, tmp_path / "in", tmp_path / "fp32", "--stages", "QK")
    assert r["precision"] == "tf32"
    q, k = mats["Q", 0], mats["K", 0]
    got = np.load(tmp_path / "tf32" / "QK_head_0.npy").astype(np.float64)
    exact_tf32 = tf32(q).astype(np.float64) @ tf32(k).astype(np.float64).T
    exact_fp32 = q.astype(np.float64) @ k.astype(np.float64).T
    # The TF32 result is far closer to the product of rounded operands than to the fp32 product.
    err_tf32 = np.abs(got - exact_tf32).max()
    err_fp32 = np.abs(got - exact_fp32).max()
    assert err_tf32 < 1e-4 < err_fp32
    fp32 = np.load(tmp_path / "fp32" / "QK_head_0.npy").astype(np.float64)
    assert np.abs(fp32 - exact_fp32).max() < 1e-4
    # Flash in TF32 stays within TF32's accuracy (2^-11 relative per operand).
    ref, _ = reference(q, k, mats["V", 0], r["scale"], False)
    o = np.load(tmp_path / "tf32" / "flash_output_head_0.npy")
    assert np.abs(o - ref["output"]).max() < 5e-3


def test_poison_leaves_no_nan(binary, tmp_path):
    dims = Dims(2, 1, 130, 65, 32, 32)
    write_npy_case(tmp_path / "in", dims)
    r = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--poison", "--causal")
    assert r["poison"] is True
    for p in (tmp_path / "out").glob("*.npy"):
        a = np.load(p)
        assert not np.isnan(a).any(), p.name


def test_scale_from_manifest_and_cli(binary, tmp_path):
    dims = Dims(1, 1, 9, 11, 16, 16)
    mats = write_npy_case(tmp_path / "in", dims)
    with open(tmp_path / "in" / "manifest.toml", "a") as f:
        f.write("scale = 0.125\ncausal = true\n")
    r = run_cpu(binary, tmp_path / "in", tmp_path / "m", "--stages", "QK,QK_scaled")
    assert r["scale"] == 0.125 and r["causal"] is True
    r = run_cpu(binary, tmp_path / "in", tmp_path / "c", "--scale", "2", "--stages", "QK,QK_scaled,flash_lse")
    assert r["scale"] == 2.0
    qk = np.load(tmp_path / "c" / "QK_head_0.npy")
    s = np.load(tmp_path / "c" / "QK_scaled_head_0.npy")
    low = np.tril(np.ones_like(qk, bool))
    assert np.array_equal(s[low], qk[low] * np.float32(2))
    ref, _ = reference(mats["Q", 0], mats["K", 0], mats["V", 0], 2.0, True)
    assert_close("flash_lse", np.load(tmp_path / "c" / "flash_lse_head_0.npy"), ref["flash_lse"], 16, 2e-5)


def test_large_logits_do_not_overflow(binary, tmp_path):
    """Inputs scaled by 30 give logits in the thousands: online softmax must rescale, not overflow."""
    dims = Dims(1, 1, 100, 200, 32, 32)
    mats = write_npy_case(tmp_path / "in", dims, scale_inputs=30.0)
    r = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "flash,output")
    ref, _ = reference(mats["Q", 0], mats["K", 0], mats["V", 0], r["scale"], False)
    o = np.load(tmp_path / "out" / "flash_output_head_0.npy")
    assert np.isfinite(o).all()
    assert np.abs(o - ref["output"]).max() < 1e-2 * np.abs(ref["output"]).max()
    lse = np.load(tmp_path / "out" / "flash_lse_head_0.npy")
    assert np.abs(lse - ref["flash_lse"]).max() < 1e-5 * np.abs(ref["flash_lse"]).max() + 1e-3


def test_progress_reports_every_unit_of_work_once_up_to_the_total(binary, tmp_path):
    """--progress: units (a head read, a head computed, a stage file written) that only grow and
    end at their total; without it no progress line, so ordinary stderr stays as it was."""
    dims = Dims(batch=1, heads=3, seq_q=17, seq_k=9, d_k=16, d_v=16)
    write_npy_case(tmp_path / "in", dims)
    base = [str(binary), "--in", str(tmp_path / "in"), "--backend", "cpu", "--stages", "QK,output"]
    proc = subprocess.run([*base, "--out", str(tmp_path / "a"), "--progress"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    reports = [line.split()[-1].split("/") for line in proc.stderr.splitlines() if line.startswith("main: progress:")]
    done = [int(d) for d, _ in reports]
    # written: Q, K, V echoes are not asked for; QK and output are, so 3 heads x (read + compute + 2 files)
    assert {int(t) for _, t in reports} == {3 * (2 + 2)}
    assert done == sorted(set(done)) and done[-1] == 12
    quiet = subprocess.run([*base, "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and "progress" not in quiet.stderr


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_input_reaches_its_rows_whole(binary, tmp_path, causal):
    """--allow-nonfinite: a NaN in Q or K makes every row that sees it NaN in attention_weights,
    output, flash_output and flash_lse (the row maximum keeps the NaN: a row of NaN scores is not
    a row with no visible key), no other row; the verifier passes the run under --allow-nonfinite."""
    in_dir, nan_rows = nan_case(tmp_path / "in", causal)
    run_cpu(binary, in_dir, tmp_path / "out", "--allow-nonfinite", *(["--causal"] if causal else []))
    run = load_run(tmp_path / "out")
    failures = nan_row_failures(lambda s, h: np.load(run.file(s, h)), run.stages, nan_rows, NAN_DIMS.seq_q)
    assert not failures, failures
    report = check(in_dir, tmp_path / "out", Options(causal=causal, allow_nonfinite=True))
    assert report.passed, [(r.stage, r.head, r.status, r.message) for r in report.results if not r.passed]


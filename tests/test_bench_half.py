"""`attnstep bench` at bf16/fp16: the binary's --precision, the NumPy twin of its input generator,
the accuracy comparison with SDPA on the same inputs (a NumPy stand-in for torch), the rows, goals
and JSON from canned results; and (gpu) real runs of the binary and of PyTorch's SDPA."""
from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from verify.bench import measure as vb
from verify.bench import sdpa as bench_sdpa
from verify.bench.accuracy import (half_accuracy, head_inputs, input_seed, inputs_checksum, normwise_error,
                                   reference_rows, uniform_inputs)
from verify.bench.report import (ACCURACY, SDPA, SDPA_BACKENDS, SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS, VS_SDPA,
                                 sdpa_backend_row)
from verify.bench.sdpa import SDPA_BACKENDS as BACKEND_NAMES
from verify.bench.sdpa import rejection_reason
from verify.cli import bench as cb
from verify.model.half import round_to_format, storage_unit
from verify.stages import HALF_PRECISIONS, PRECISIONS

from helpers.environment import compute_capability

REPO = Path(__file__).resolve().parents[1]
LARGE = {"batch": 4, "heads": 16, "seq_q": 4096, "seq_k": 4096, "d": 64, "causal": False, "scale": 0.125}
CUDNN, FLASH, EFFICIENT = BACKEND_NAMES
REFUSED = "unsupported: Flash attention requires the last dimension to be at most 256"


# ---- the binary's options ------------------------------------------------------------------------
def _bench_cli(binary, *args):
    """`main --bench ARGS` on a tiny shape; skips on a CPU-only build (it refuses --bench first)."""
    proc = subprocess.run([str(binary), "--bench", "--batch", "1", "--heads", "1", "--seq-q", "8", "--seq-k", "8",
                           "--d", "16", "--warmup", "0", "--reps", "1", "--no-ceilings", "--pass", "forward", *args],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == 2 and "needs a CUDA build" in proc.stderr:
        pytest.skip("a CPU-only build: --bench is refused before its options are read")
    return proc


def test_binary_bench_takes_every_precision_and_refuses_others(binary):
    """Each precision of the table parses (then the run needs a GPU: exit 0 on one, else the
    one-line 'no CUDA device'); anything else is exit 2 naming --precision and the choices."""
    for precision in PRECISIONS:
        proc = _bench_cli(binary, "--precision", precision)
        assert proc.returncode == 0 or "no CUDA device found" in proc.stderr, (precision, proc.stderr)
    for bad in ("fp64", "BF16", "half", ""):
        proc = _bench_cli(binary, "--precision", bad)
        assert proc.returncode == 2, (bad, proc.stderr)
        first = proc.stderr.splitlines()[0]
        assert "--precision" in first and ", ".join(PRECISIONS) in first and "Traceback" not in proc.stderr


def test_binary_bench_help_lists_the_precisions(binary):
    res = subprocess.run([str(binary), "--bench", "--help"], capture_output=True, text=True, timeout=60)
    if res.returncode == 2 and "CUDA build" in res.stderr:
        pytest.skip("a CPU-only build has no --bench")
    assert f"--precision {'|'.join(PRECISIONS)}" in res.stdout


# ---- the inputs ----------------------------------------------------------------------------------
_TWIN_PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include "bench/bench_inputs.h"
using namespace attnstep::bench;
int main() {
    const unsigned long long idx[] = {0ull, 1ull, 4095ull, 262143ull, 4294967301ull, 123456789012ull};
    const unsigned long long seeds[] = {input_seed(1234, BenchInput::Q), input_seed(1234, BenchInput::K),
                                        input_seed(1234, BenchInput::V), input_seed(0, BenchInput::Q),
                                        input_seed(1073741824ull, BenchInput::V)};
    for (unsigned long long s : seeds) {
        std::printf("seed %llu\n", s);
        for (unsigned long long i : idx) {
            const float x = uniform_input(i, s);
            unsigned bits;
            std::memcpy(&bits, &x, 4);
            std::printf("%llu %u\n", i, bits);
        }
    }
}
"""


def test_numpy_twin_reproduces_the_binary_input_generator(tmp_path):
    """bench_inputs.h compiled as it is (the file the --bench fill kernel calls) and the NumPy twin
    give the same float32 bits for the same index and seed, seeds from input_seed() included."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler")
    src, exe = tmp_path / "twin.cpp", tmp_path / "twin"
    src.write_text(_TWIN_PROGRAM)
    subprocess.run([cxx, "-std=c++17", "-I", str(REPO / "cuda_src"), str(src), "-o", str(exe)], check=True,
                   timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
    want_seeds = [input_seed(1234, w) for w in "QKV"] + [input_seed(0, "Q"), input_seed(1 << 30, "V")]
    seeds = [int(line.split()[1]) for line in out if line.startswith("seed")]
    assert seeds == want_seeds
    seed, checked = None, 0
    for line in filter(None, out):
        if line.startswith("seed"):
            seed = int(line.split()[1])
            continue
        i, bits = (int(t) for t in line.split())
        assert uniform_inputs(i, 1, seed).view(np.uint32)[0] == bits, (i, seed)
        checked += 1
    assert checked == 30


def test_twin_values_and_head_layout():
    x = uniform_inputs(0, 100000, 7)
    assert x.dtype == np.float32 and x.min() >= -1 and x.max() < 1 and abs(x.mean()) < 0.01
    assert np.array_equal(np.round((x.astype(np.float64) + 1) * 2**23), (x.astype(np.float64) + 1) * 2**23)
    shape = vb.Shape(2, 3, 5, 7, 4, False)
    q, k, v = head_inputs(shape, 11, 4)
    assert q.shape == (5, 4) and k.shape == v.shape == (7, 4)
    assert np.array_equal(q.ravel(), uniform_inputs(4 * 20, 20, input_seed(11, "Q")))
    assert np.array_equal(v.ravel(), uniform_inputs(4 * 28, 28, input_seed(11, "V")))


# ---- the accuracy comparison ---------------------------------------------------------------------
SMALL = vb.Shape(1, 3, 37, 53, 16, True)
HEADS, ROWS = [0, 2], [0, 1, 5, 17, 36]


def _small_binary(precision="bf16", flash_err=2e-3, checksum_offset=0.0):
    shape = {"batch": SMALL.batch, "heads": SMALL.heads, "seq_q": SMALL.seq_q, "seq_k": SMALL.seq_k,
             "d": SMALL.d, "causal": SMALL.causal, "scale": float(np.float32(0.25))}
    checksum = inputs_checksum([head_inputs(SMALL, 99, h) for h in HEADS]) + checksum_offset
    flash = {"name": "flash", "kind": "attention", "pass": "forward", "status": "ok", "ms": 1.0, "tflops": 300.0,
             "check": {"passed": True, "max_rel_err": flash_err, "max_lse_err": 1e-6}}
    return {"device": "NVIDIA H100", "shape": shape, "precision": precision, "seed": 99, "ceilings": {},
            "check_sample": {"heads": HEADS, "rows": ROWS, "inputs_checksum": checksum}, "kernels": [flash]}


def _numpy_sdpa(precision, refused=(EFFICIENT,)):
    """A stand-in for bench_sdpa.sdpa_output: float64 attention of the rounded inputs, its output
    rounded to the format (as a correct half kernel stores it); `refused` backends refuse."""
    def sdpa(q, k, v, rows, backend):
        if backend in refused:
            return REFUSED
        heads = [reference_rows(*(round_to_format(x[h], precision) for x in (q, k, v)), rows, 0.25, True)
                 for h in range(q.shape[0])]
        return np.stack([round_to_format(o.astype(np.float32), precision) for o in heads])

    return sdpa


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_accuracy_compares_sdpa_on_the_binary_inputs(precision):
    acc = half_accuracy(_small_binary(precision), _numpy_sdpa(precision), tuple(BACKEND_NAMES))
    assert acc["heads"] == HEADS and acc["rows"] == len(ROWS) and acc["kernels"] == {"flash": 2e-3}
    assert precision in acc["reference"]
    # The stand-in stores a correctly rounded output: at most half an ulp of the largest value.
    assert 0 < acc[SDPA] <= storage_unit(precision)
    assert acc[SDPA_BACKENDS][EFFICIENT] == REFUSED
    assert acc[SDPA_BACKENDS][CUDNN] == acc[SDPA_BACKENDS][FLASH] == acc[SDPA]


def test_accuracy_refuses_other_inputs():
    with pytest.raises(vb.BenchError, match="differ from the binary's"):
        half_accuracy(_small_binary(checksum_offset=1.0), _numpy_sdpa("bf16"), ())
    no_sample = _small_binary()
    del no_sample["check_sample"]
    with pytest.raises(vb.BenchError, match="check_sample"):
        half_accuracy(no_sample, _numpy_sdpa("bf16"), ())


def test_reference_rows_and_the_measure():
    rng = np.random.default_rng(3)
    q, k, v = rng.uniform(-1, 1, (9, 4)), rng.uniform(-1, 1, (6, 4)), rng.uniform(-1, 1, (6, 4))
    s = q @ k.T * 0.5
    s[np.triu_indices(9, 1, 6)] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    dense = p @ v / p.sum(axis=1, keepdims=True)
    rows = [0, 3, 8]
    assert np.allclose(reference_rows(q, k, v, rows, 0.5, True), dense[rows], rtol=1e-14, atol=0)
    ref = np.array([[1.0, -4.0], [2.0, 0.5]])
    assert normwise_error(ref + [[0, 0.2], [0, 0]], ref) == pytest.approx(0.05)
    assert normwise_error(np.array([[np.nan, 0], [0, 0]]), ref) == np.inf


def test_rejection_reason_is_torch_reasons():
    warnings = ["Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:1.)",
                "Flash attention requires q,k,v to have the same last dimension and to be less than or equal "
                "to 256. Got Query.size(-1): 512. (Triggered internally at sdp_utils.cpp:2.)",
                "Flash attention requires q,k,v to have the same last dimension and to be less than or equal "
                "to 256. Got Query.size(-1): 512. (Triggered internally at sdp_utils.cpp:2.)"]
    reason = rejection_reason(warnings, "No available kernel. Aborting execution.")
    assert reason.startswith("Flash attention requires") and reason.endswith("512.") and "Triggered" not in reason
    assert rejection_reason([], "No available kernel. Aborting execution.\nmore") == \
        "No available kernel. Aborting execution."
    # Forcing one backend, torch also says another one is switched off: not this refusal's reason.
    assert rejection_reason(["cuDNN attention has been runtime disabled."] + warnings[:2], "x") == warnings[1].split(
        " (Triggered")[0]


# ---- rows, goals, JSON ---------------------------------------------------------------------------
def _half_binary(precision="bf16", flash_tflops=300.0, err=3e-3, d=64):
    def k(name, kind, rate, **extra):
        return {"name": name, "kind": kind, "pass": "forward", "status": "ok", "ms": 1.0,
                ("gbps" if kind == "memory" else "tflops"): rate, "fraction": 0.9, **extra}

    check = {"passed": True, "max_rel_err": err, "max_lse_err": 1e-6}
    return {"device": "NVIDIA H100", "shape": {**LARGE, "d": d}, "precision": precision, "seed": 1234,
            "ceilings": {"sgemm_tflops": 500.0, "copy_gbps": 3000.0}, "passed": True,
            "kernels": [k("QK", "gemm", 450.0), k("QK_scaled", "memory", 2000.0),
                        k("flash", "attention", flash_tflops, tiles=f"128x64, cuda-wgmma-{precision}", check=check),
                        {"name": "flash_fast", "kind": "attention", "pass": "forward", "status": "unsupported",
                         "reason": f"no {precision} fast variant"},
                        {"name": "flash_backward", "kind": "attention", "pass": "backward", "status": "unsupported",
                         "reason": f"the flash backward at {precision} needs compute capability 9.0"}]}


def _backends(cudnn=250.0, flash=280.0):
    ok = {"status": "ok", "ms": 1.0, "torch": "2.11", "dtype": "bf16"}
    return {CUDNN: {**ok, "tflops": cudnn}, FLASH: {**ok, "tflops": flash}, EFFICIENT: {"status": REFUSED}}


def _half_run(sdpa_err=4e-3, **kw):
    binary = _half_binary(**kw)
    backends = _backends()
    return {"binary": binary, SDPA: vb.fastest_sdpa(backends), SDPA_BACKENDS: backends,
            VS_SDPA: vb.ratios_to_backends(binary, backends),
            ACCURACY: {SDPA: sdpa_err, SDPA_BACKENDS: {CUDNN: 3.5e-3, FLASH: sdpa_err, EFFICIENT: REFUSED}}}


def _half_results(**kw):
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H100", "date": "2026-11-26T00:00:00Z",
            "torch": "2.11", "runs": [_half_run(**kw)]}


def test_half_rows_name_the_fastest_backend_and_each_ratio():
    rows = {r.kernel: r for r in vb.rows_from_results(_half_results())}
    flash = rows["flash"]
    assert flash.vs_sdpa == pytest.approx(300 / 280) and flash.max_rel_err == 3e-3 and flash.sdpa_err == 4e-3
    assert "vs sdpa_cudnn 1.20x, sdpa_flash 1.07x" in flash.note and "cuda-wgmma-bf16" in flash.note
    assert "SDPA's err 4.0e-03" in flash.note
    assert rows[SDPA].rate == 280.0 and "sdpa_flash (fastest)" in rows[SDPA].note and "bf16" in rows[SDPA].note
    cudnn = rows[sdpa_backend_row(CUDNN)]
    assert cudnn.rate == 250.0 and cudnn.vs_sdpa == pytest.approx(250 / 280)
    assert "err 3.5e-03 on the binary's inputs" in cudnn.note
    assert rows[sdpa_backend_row(EFFICIENT)].status == REFUSED
    table = vb.format_table(list(rows.values()))
    assert "unsupported: no bf16 fast variant" in table and REFUSED in table
    assert "unsupported: the flash backward at bf16 needs compute capability 9.0" in table
    assert cb._exit_status(list(rows.values())) == 0  # refusals are not failures


def test_failures_are_told_by_what_failed_and_counted_by_shape(capsys):
    """An SDPA backend and the accuracy comparison failing on one shape, the binary on another: exit
    1, each source named once with the shapes it failed on (not rows, not all blamed on the binary)."""
    def row(shape, kernel):
        return vb.Row(shape, 4096, 64, False, "bf16", kernel, "attention", "failed: boom")
    rows = [row("B1-H1-N4096-M4096-d64", sdpa_backend_row(CUDNN)), row("B1-H1-N4096-M4096-d64", ACCURACY),
            row("B1-H1-N4096-M4096-d64", sdpa_backend_row(EFFICIENT)), row("B1-H1-N8192-M8192-d64", "main --bench")]
    assert cb._exit_status(rows) == 1
    err = capsys.readouterr().err
    assert "bench: SDPA failed on 1 shape; see the table" in err
    assert "bench: the accuracy comparison failed on 1 shape; see the table" in err
    assert "bench: main --bench failed on 1 shape; see the table" in err


def test_ratios_to_each_backend_in_the_json():
    run = _half_run()
    assert run[VS_SDPA] == {"flash": pytest.approx({CUDNN: 1.2, FLASH: 300 / 280, "fastest": 300 / 280})}
    assert run[SDPA]["backend"] == FLASH
    assert vb.fastest_sdpa({EFFICIENT: {"status": REFUSED}})["status"].startswith("unsupported")


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_half_goals_speed_and_accuracy(precision):
    text = "\n".join(vb.evaluate_goals(vb.rows_from_results(_half_results(precision=precision))))
    assert (f"met    {precision} flash >= 1x SDPA's fastest backend at B4-H16-N4096-M4096-d64: 1.07x "
            "(300.0 TFLOP/s)") in text
    assert (f"met    {precision} flash error <= 1x SDPA's on the same inputs at B4-H16-N4096-M4096-d64: "
            "3.00e-03 against SDPA's 4.00e-03") in text
    worse = vb.evaluate_goals(vb.rows_from_results(_half_results(precision=precision, flash_tflops=200.0,
                                                                 err=5e-3, d=128)))
    assert [line[:6] for line in worse] == ["MISSED", "MISSED"] and all("-d128" in line for line in worse)


# An fp16 d128 run on an H100: the same output (equal rounded values), the binary's float64
# reference and NumPy's; then an error larger in its 7th digit.
_SAME = (3.6106667779859714e-4, 3.6106667779697745e-4)


@pytest.mark.parametrize("ours, met", [(_SAME[0], True), (_SAME[1] * (1 + 1e-6), False)])
def test_an_error_equal_to_sdpas_meets_the_goal_and_a_larger_one_does_not(ours, met):
    lines = vb.evaluate_goals(vb.rows_from_results(_half_results(err=ours, sdpa_err=_SAME[1])))
    accuracy = [line for line in lines if "error <=" in line]
    assert len(accuracy) == 1 and accuracy[0].startswith("met" if met else "MISSED")


def test_a_failed_accuracy_comparison_fails_the_bench(tmp_path):
    results = _half_results()
    results["runs"][0][ACCURACY] = {"error": "the inputs recomputed for the accuracy comparison differ"}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code == 1 and "failed: the inputs recomputed" in res.output


def test_from_json_and_plot_at_half(tmp_path):
    pytest.importorskip("matplotlib")
    src, png = tmp_path / "r.json", tmp_path / "p.png"
    src.write_text(json.dumps(_half_results()))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "ceilings (bf16, B4-H16-N4096-M4096-d64): cuBLAS GEMM bf16 500.0 TFLOP/s" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("key, value, named", [
    (SDPA_BACKENDS, ["cudnn"], "runs[0].sdpa_backends: expected an object"),
    (SDPA_BACKENDS, {"cudnn": {"status": "ok", "ms": 1.0}}, "runs[0].sdpa_backends.cudnn: lacks a number 'tflops'"),
    (SDPA_BACKENDS, {"cudnn": {"status": "ok", "ms": 1.0, "tflops": "fast"}}, "lacks a number 'tflops'"),
    (ACCURACY, "0.003", "runs[0].accuracy: expected an object"),
    (SDPA, "ok", "runs[0].sdpa: expected an object")])
def test_from_json_names_a_malformed_sdpa_section(tmp_path, key, value, named):
    """A hand-edited or truncated results file: one line naming the run and the key, exit 1, no
    traceback."""
    results = _half_results()
    results["runs"][0][key] = value
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit), res.exception
    assert named in res.output and "Traceback" not in res.output, res.output


def test_the_plot_draws_sdpa_fastest_not_each_backend():
    """At bf16/fp16 the plot's yardstick is SDPA's fastest backend (the `sdpa` row); the backends one
    by one stay in the table only, and the binary's flash rows are drawn."""
    from verify.bench.plot import _plotted
    rows = vb.rows_from_results(_half_results())
    drawn = {r.kernel for r in _plotted(rows)}
    assert SDPA in drawn and "flash" in drawn
    assert not drawn & {sdpa_backend_row(b) for b in (CUDNN, FLASH, EFFICIENT)}
    assert {sdpa_backend_row(CUDNN)} <= {r.kernel for r in rows}  # in the table


def test_parse_takes_every_precision():
    for precision in PRECISIONS:
        vb.parse_binary_json({**_half_binary(), "precision": precision})
    with pytest.raises(vb.BenchError, match="fp64"):
        vb.parse_binary_json({**_half_binary(), "precision": "fp64"})


# ---- collect and the command line ----------------------------------------------------------------
def _fake_machine(monkeypatch):
    """The binary, torch and SDPA replaced: the binary answers _small_binary at any precision; the
    SDPA timers record the precisions (and, per backend, the passes) they were asked for; the fp32
    backward's must not run at bf16/fp16."""
    seen = {"binary": [], "backends": [], "fp32 sdpa": []}

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, monitor=None, passes="both",
                 ceilings=True):
        seen["binary"].append((prec, check, passes))
        return {**_small_binary(prec), "passed": True}

    def backends(shape, prec, warmup, reps, pass_="forward"):
        seen["backends"].append((prec, pass_))
        return _backends()

    def no_backward(*a):
        raise AssertionError("SDPA's backward is timed per backend at bf16/fp16")

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    monkeypatch.setattr(vb, "torch_available", lambda: "2.11")
    monkeypatch.setattr(vb, "time_sdpa_backends", backends)
    monkeypatch.setattr(vb, "sdpa_output", lambda q, k, v, rows, scale, causal, prec, backend:
                        _numpy_sdpa(prec)(q, k, v, rows, backend))
    monkeypatch.setitem(vb._SDPA_TIMERS, "forward",
                        (SDPA, lambda shape, prec, *a: seen["fp32 sdpa"].append(prec) or {"status": "ok", "ms": 1.0,
                                                                                          "tflops": 9.0}))
    monkeypatch.setitem(vb._SDPA_TIMERS, "backward", ("sdpa_backward", no_backward))
    return seen


def test_collect_at_half_writes_backends_ratios_and_accuracy(monkeypatch):
    seen = _fake_machine(monkeypatch)
    res = vb.collect(Path("main"), [SMALL], HALF_PRECISIONS, 0, 1, True, use_torch=True, only="all",
                     log=lambda m: None, passes="both")
    assert seen["backends"] == [(p, pass_) for p in HALF_PRECISIONS for pass_ in ("forward", "backward")]
    assert seen["fp32 sdpa"] == []
    for run, precision in zip(res["runs"], HALF_PRECISIONS):
        assert set(run) == {"binary", SDPA, SDPA_BACKENDS, SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS, VS_SDPA, ACCURACY}
        assert run[SDPA]["backend"] == FLASH and run[SDPA_BACKENDS][EFFICIENT]["status"] == REFUSED
        assert set(run[VS_SDPA]["flash"]) == {CUDNN, FLASH, "fastest"}
        acc = run[ACCURACY]
        assert set(acc) >= {"reference", "heads", "rows", "kernels", SDPA, SDPA_BACKENDS} and "error" not in acc
        assert 0 < acc[SDPA] <= storage_unit(precision)
    json.dumps(res)  # JSON-ready


@pytest.mark.parametrize("choice, precisions", [("half", list(HALF_PRECISIONS)), ("all", list(PRECISIONS)),
                                                ("both", ["fp32", "tf32"]), ("fp16", ["fp16"])])
def test_cli_precision_groups(tmp_path, monkeypatch, choice, precisions):
    seen = _fake_machine(monkeypatch)
    main = tmp_path / "main"
    main.write_text("")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--shape", "1,3,37,53,16,causal", "--pass", "forward",
                                        "--precision", choice, "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert [p for p, _, _ in seen["binary"]] == precisions
    assert seen["backends"] == [(p, "forward") for p in precisions if p in HALF_PRECISIONS]
    assert seen["fp32 sdpa"] == [p for p in precisions if p not in HALF_PRECISIONS]
    runs = json.loads(out.read_text())["runs"]
    assert [ACCURACY in r for r in runs] == [p in HALF_PRECISIONS for p in precisions]


def test_an_sdpa_output_with_a_nan_is_written_as_json_and_read_back(tmp_path, monkeypatch):
    """SDPA's error is inf when its output holds a NaN: --json writes it as the string "inf" (JSON
    has no Infinity), and --from-json reads it back as SDPA's error, so ours still compares."""
    _fake_machine(monkeypatch)
    sdpa = _numpy_sdpa("bf16")

    def nan_sdpa(q, k, v, rows, scale, causal, prec, backend):
        out = sdpa(q, k, v, rows, backend)
        return out if isinstance(out, str) else out * np.nan  # a refused backend stays refused

    monkeypatch.setattr(vb, "sdpa_output", nan_sdpa)
    main, out = tmp_path / "main", tmp_path / "r.json"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--shape", "1,3,37,53,16,causal", "--pass", "forward",
                                        "--precision", "bf16", "--json", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "Infinity" not in text and json.loads(text)["runs"][0][ACCURACY][SDPA] == "inf"
    again = CliRunner().invoke(cb.bench, ["--from-json", str(out)])
    assert again.exit_code == 0 and "SDPA's err inf" in again.output, again.output


class _FakeTorch:
    class cuda:
        class OutOfMemoryError(RuntimeError):
            pass


def test_only_torchs_no_kernel_error_is_a_refusal():
    """A forced backend that torch has no kernel for is 'unsupported' with torch's reason; any other
    error (a kernel that crashed, out of memory) stays an error, which bench reports as failed."""
    def refuse():
        warnings.warn("Flash attention kernel not used because:")
        warnings.warn("Flash attention does not support is_causal with seq_q != seq_k (Triggered internally at x.cpp)")
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(bench_sdpa._Refused, match="^Flash attention does not support is_causal"):
        bench_sdpa._probe(_FakeTorch, refuse)
    for error in (RuntimeError("CUDA error: an illegal memory access was encountered"),
                  _FakeTorch.cuda.OutOfMemoryError("CUDA out of memory")):
        def crash(error=error):
            raise error
        with pytest.raises(type(error)):
            bench_sdpa._probe(_FakeTorch, crash)


def test_cli_refuses_an_unknown_precision():
    res = CliRunner().invoke(cb.bench, ["--precision", "fp64"])
    assert res.exit_code == 2 and "--precision" in res.output


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_half_flash_takes_more_heads_than_one_launch_holds(binary, tmp_path, precision, causal):
    """More heads than a grid dimension holds (65535) go in several launches, each with its own
    tensor maps of the inputs in the format from its first head on (the causal order's head groups
    then end short); --check compares the first and the last head with float64."""
    if not compute_capability().startswith("9."):
        pytest.skip("the half-precision flash forward needs compute capability 9.0")
    out = tmp_path / "bench.json"
    cmd = [str(binary), "--bench", "--precision", precision, "--batch", "1", "--heads", "65537", "--seq-q", "16",
           "--seq-k", "16", "--d", "64", "--only", "flash", "--pass", "forward", "--no-ceilings", "--check",
           "--warmup", "0", "--reps", "1", "--json", str(out)] + (["--causal"] if causal else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flash = {k["name"]: k for k in json.loads(out.read_text())["kernels"]}["flash"]
    assert flash["status"] == "ok" and flash["check"]["passed"] is True, flash
    assert flash["check"]["max_rel_err"] < 4 * storage_unit(precision), flash


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_gpu_bench_half_forward(binary, tmp_path, precision, causal, d):
    """`main --bench --precision bf16|fp16 --check --check-rows 0` on a small irregular shape: the
    stage path timed; on Hopper at d 64 and 128 the flash forward and backward run in the format and
    every row of every head passes against float64 (elsewhere 'unsupported' with a reason); the
    backward stage path is marked; the checked heads' inputs are the ones the NumPy twin computes."""
    out = tmp_path / "bench.json"
    cmd = [str(binary), "--bench", "--precision", precision, "--check", "--check-rows", "0", "--no-ceilings",
           "--batch", "1", "--heads", "3", "--seq-q", "127", "--seq-k", "333", "--d", str(d), "--warmup", "1",
           "--reps", "3", "--json", str(out)] + (["--causal"] if causal else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {k["name"]: k for k in data["kernels"]}
    assert data["precision"] == precision and data["passed"] is True
    for name in ("KT", "QK", "QK_scaled", "attention_weights", "output"):
        assert rows[name]["status"] == "ok" and rows[name]["ms"] > 0, rows[name]
    path = rows["stages_backward"]
    assert path["status"] == "unsupported" and "fp32 and tf32" in path["reason"], path
    flash = rows["flash"]
    if compute_capability().startswith("9.") and d in (64, 128):
        assert flash["status"] == "ok", flash
        assert f"-{precision}" in flash["tiles"] and flash["check"]["passed"] is True
        assert flash["check"]["max_rel_err"] < 4 * storage_unit(precision)
        assert rows["flash_backward"]["status"] == "ok" and f"-{precision}" in rows["flash_backward"]["tiles"]
    else:
        assert flash["status"] == "unsupported" and flash["reason"], flash
    for k in rows.values():  # every flash kernel timed in the format was checked and passed
        if k["status"] == "ok" and k["name"].startswith("flash"):
            assert k["check"]["passed"] is True, k
    sample = data["check_sample"]
    assert sample["heads"] == [0, 1, 2] and sample["rows"] == list(range(127))
    shape = vb.Shape(1, 3, 127, 333, d, causal)
    assert inputs_checksum([head_inputs(shape, data["seed"], h) for h in sample["heads"]]) == \
        pytest.approx(sample["inputs_checksum"], rel=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_gpu_half_bench_against_sdpa(binary, tmp_path, precision):
    """`attnstep bench --precision bf16|fp16 --check`: each SDPA backend timed or refused with a
    reason, the flash row's ratio to each, and SDPA's error on the binary's inputs beside the binary's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cb.bench, ["--binary", str(binary), "--shape", "1,2,320,320,64,causal",
                                        "--precision", precision, "--pass", "forward", "--reps", "3", "--warmup", "1",
                                        "--json", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())["runs"][0]
    for status in (b["status"] for b in run[SDPA_BACKENDS].values()):
        assert status == "ok" or status.startswith("unsupported: "), status
    acc = run[ACCURACY]
    assert "error" not in acc, acc
    assert 0 < acc[SDPA] < 4 * storage_unit(precision), acc
    for err in acc[SDPA_BACKENDS].values():
        assert isinstance(err, str) or 0 < err < 4 * storage_unit(precision), acc
    if any(k["name"] == "flash" and k["status"] == "ok" for k in run["binary"]["kernels"]):
        assert 0 < acc["kernels"]["flash"] < 4 * storage_unit(precision)
        assert run[VS_SDPA]["flash"]["fastest"] > 0

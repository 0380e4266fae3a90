"""The backward rows of `attnstep bench`: the binary's backward rows parsed, their ratios to SDPA's
backward, the goals, SDPA's backward timed per --pass, runs without ceilings; and (gpu) the
binary's `--bench --pass backward --check` on small irregular shapes, every gradient of every head
against float64."""
from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner

from verify.bench import measure as vb
from verify.cli import bench as cb
from verify.bench.report import (FLASH_BACKWARD, SDPA, SDPA_BACKWARD, STAGE_PATH_BACKWARD, STAGE_PATH_SKIPPED,
                                 ceiling_lines)
from verify.stages import BACKWARD_STAGES, GRAD_INPUT, STAGES

SHAPE = {"batch": 4, "heads": 16, "seq_q": 4096, "seq_k": 4096, "d": 64, "causal": False, "scale": 0.125}
# The backward stage path's stages, from the stage table: the backward's, but its input and the flash ones.
PATH_STAGES = tuple(n for n in BACKWARD_STAGES if n != GRAD_INPUT and not STAGES[n].flash)
D, DP, DS = PATH_STAGES[:3]  # the table's order: a row sum, a GEMM, an element-wise product


def _bwd_check(err=1.5e-6, passed=True):
    return {"passed": passed, "max_rel_err": err, "max_dq_err": err, "max_dk_err": err / 2, "max_dv_err": err / 3}


def _binary_json(precision="fp32", flash_bwd_tflops=70.0, ceilings=True, path_skipped=False, passed=True):
    """What `main --bench --pass both --json` writes: one forward row, then the backward rows."""
    def k(name, kind, ms, rate, pass_="backward", **extra):
        row = {"name": name, "kind": kind, "pass": pass_, "status": "ok", "ms": ms,
               ("gbps" if kind == "memory" else "tflops"): rate, **extra}
        if ceilings:
            row["fraction"] = 0.5
        return row

    path = [k(n, "memory" if n in (D, DS) else "gemm", 1.0, 40.0) for n in PATH_STAGES]
    path.append(k(STAGE_PATH_BACKWARD, "attention", 9.0, 30.0, check=_bwd_check()))
    if path_skipped:
        path = [{"name": r["name"], "kind": r["kind"], "pass": "backward", "status": STAGE_PATH_SKIPPED} for r in path]
    return {
        "tool": "attnstep bench", "format": 1, "device": "NVIDIA H100", "sm_count": 132, "shape": dict(SHAPE),
        "precision": precision, "warmup": 3, "reps": 20, "passed": passed,
        "ceilings": {"sgemm_tflops": 50.0, "copy_gbps": 3000.0} if ceilings else {},
        "kernels": [k("flash", "attention", 3.0, 90.0, "forward", tiles="128x64"), *path,
                    k(FLASH_BACKWARD, "attention", 6.0, flash_bwd_tflops, tiles="64x64, cuda-bwd-3xtf32",
                      check=_bwd_check(passed=passed))],
    }


def _results(**kw):
    sdpa = {"status": "ok", "ms": 7.9, "tflops": 35.0, "torch": "2.11"}
    sdpa_bwd = {"status": "ok", "ms": 20.0, "tflops": 34.0, "torch": "2.11"}
    runs = [{"binary": _binary_json("fp32", **kw), SDPA: sdpa, SDPA_BACKWARD: sdpa_bwd},
            {"binary": _binary_json("tf32", **{**kw, "flash_bwd_tflops": 210.0}), SDPA: sdpa,
             SDPA_BACKWARD: sdpa_bwd}]
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H100", "date": "2026-11-25T04:00:00Z",
            "torch": "2.11", "runs": runs}


def _row(rows, kernel, precision="fp32"):
    return next(r for r in rows if r.kernel == kernel and r.precision == precision)


def test_backward_rows_ratios_to_sdpa_backward_and_the_table():
    rows = vb.rows_from_results(_results())
    assert {r.kernel for r in rows} >= set(PATH_STAGES) | {STAGE_PATH_BACKWARD, FLASH_BACKWARD, SDPA_BACKWARD}
    assert _row(rows, FLASH_BACKWARD).vs_sdpa == pytest.approx(70.0 / 34.0)
    assert _row(rows, STAGE_PATH_BACKWARD).vs_sdpa == pytest.approx(30.0 / 34.0)
    assert _row(rows, "flash").vs_sdpa == pytest.approx(90.0 / 35.0)  # the forward's yardstick stays SDPA's forward
    assert _row(rows, SDPA_BACKWARD).vs_sdpa == 1.0 and _row(rows, SDPA_BACKWARD).rate == 34.0
    assert _row(rows, DP).vs_sdpa is None and _row(rows, DS).kind == "memory"
    assert "err 1.5e-06" in _row(rows, FLASH_BACKWARD).note and "cuda-bwd-3xtf32" in _row(rows, FLASH_BACKWARD).note
    table = vb.format_table(rows)
    assert "2.06x" in table and "sdpa_backward" in table and "40 GB/s" in table


def test_backward_goals_met_and_missed():
    text = "\n".join(vb.evaluate_goals(vb.rows_from_results(_results())))
    assert "met    fp32 flash_backward >= 2x SDPA's backward at B4-H16-N4096-M4096-d64: 2.06x (70.0 TFLOP/s)" in text
    assert "met    tf32 flash_backward >= 200 TFLOP/s at B4-H16-N4096-M4096-d64: 210.0 TFLOP/s" in text
    slow = vb.evaluate_goals(vb.rows_from_results(_results(flash_bwd_tflops=50.0)))
    assert any(line.startswith("MISSED fp32 flash_backward >= 2x SDPA's backward") for line in slow)


def test_a_skipped_backward_path_and_a_failed_gradient_check():
    rows = vb.rows_from_results(_results(path_skipped=True, passed=False))
    assert all(_row(rows, n).status == STAGE_PATH_SKIPPED for n in PATH_STAGES + (STAGE_PATH_BACKWARD,))
    assert "FAIL" in _row(rows, FLASH_BACKWARD).note
    assert cb._exit_status(rows) == 1


def test_without_ceilings_no_fraction_and_no_ceiling_line(tmp_path):
    results = _results(ceilings=False)
    rows = vb.rows_from_results(results)
    assert all(r.fraction is None for r in rows)
    assert ceiling_lines(results) == []
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code == 0, res.output
    assert "ceilings (" not in res.output and "flash_backward" in res.output


def test_plot_draws_the_backward(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    vb.write_plot(vb.rows_from_results(_results()), png, "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _record_binary_runs(monkeypatch) -> list:
    """Replaces the binary's bench run by one that records (passes, ceilings) of each call."""
    seen = []

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, monitor=None, passes="both",
                 ceilings=True):
        seen.append((passes, ceilings))
        return _binary_json(prec)

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    return seen


@pytest.mark.parametrize("passes, timed", [("both", {SDPA, SDPA_BACKWARD}), ("forward", {SDPA}),
                                           ("backward", {SDPA_BACKWARD})])
def test_collect_times_sdpa_for_each_pass_asked(monkeypatch, passes, timed):
    seen = _record_binary_runs(monkeypatch)
    monkeypatch.setattr(vb, "torch_available", lambda: "2.11")
    monkeypatch.setitem(vb._SDPA_TIMERS, "forward", (SDPA, lambda *a: {"status": "ok", "ms": 1.0, "tflops": 1.0}))
    monkeypatch.setitem(vb._SDPA_TIMERS, "backward",
                        (SDPA_BACKWARD, lambda *a: {"status": "ok", "ms": 2.0, "tflops": 2.0}))
    res = vb.collect("main", [vb.Shape(1, 1, 8, 8, 16, False)], ("fp32",), 0, 1, False, use_torch=True,
                     only="all", log=lambda m: None, passes=passes, ceilings=False)
    assert seen == [(passes, False)]
    assert set(res["runs"][0]) - {"binary"} == timed


def test_cli_pass_and_no_ceilings_reach_the_binary(tmp_path, monkeypatch):
    seen = _record_binary_runs(monkeypatch)
    main = tmp_path / "main"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--shape", "1,1,8,8,16", "--no-torch",
                                        "--pass", "backward", "--no-ceilings", "--precision", "fp32"])
    assert res.exit_code == 0, res.output
    assert seen == [("backward", False)]
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--pass", "sideways"])
    assert res.exit_code == 2 and "--pass" in res.output


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_gpu_bench_backward_checks_every_gradient(binary, tmp_path, precision, causal, d):
    """`main --bench --pass backward --check --check-rows 0` on a small irregular shape: every row
    of dQ, dK, dV of every head, by the stage path and the flash backward, within the tolerance of
    float64; every backward row timed."""
    out = tmp_path / "bench.json"
    cmd = [str(binary), "--bench", "--pass", "backward", "--check", "--check-rows", "0", "--no-ceilings",
           "--batch", "1", "--heads", "3", "--seq-q", "127", "--seq-k", "333", "--d", str(d),
           "--precision", precision, "--warmup", "1", "--reps", "3", "--json", str(out)]
    if causal:
        cmd.append("--causal")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["ceilings"] == {}
    rows = {k["name"]: k for k in data["kernels"]}
    assert set(rows) == set(PATH_STAGES) | {STAGE_PATH_BACKWARD, FLASH_BACKWARD}
    tol = 1e-4 if precision == "fp32" else 5e-3
    for k in rows.values():
        assert k["pass"] == "backward" and k["status"] == "ok" and k["ms"] > 0, k
        assert "fraction" not in k
    for name in (STAGE_PATH_BACKWARD, FLASH_BACKWARD):
        check = rows[name]["check"]
        assert check["passed"] is True, (name, check)
        assert max(check["max_dq_err"], check["max_dk_err"], check["max_dv_err"]) < tol, (name, check)
    if precision == "fp32":  # FP32-accurate: 3xTF32 flash and FP32 cuBLAS, far under the tolerance
        assert rows[FLASH_BACKWARD]["check"]["max_rel_err"] < 1e-5


@pytest.mark.gpu
def test_gpu_bench_forward_pass_is_the_forward_alone(binary, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([str(binary), "--bench", "--pass", "forward", "--batch", "1", "--heads", "2", "--seq-q",
                           "128", "--seq-k", "128", "--d", "64", "--warmup", "0", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {k["pass"] for k in data["kernels"]} == {"forward"} and data["ceilings"]["copy_gbps"] > 0
    assert {"KT", "QK", "flash"} <= {k["name"] for k in data["kernels"]}

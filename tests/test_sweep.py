"""`attnstep sweep` (verify/bench/sweep.py, its command verify/cli/sweep.py): the d × N grid against a
fake `main --bench` (rows forward and backward, OOM rows, CSV/JSON, peak memory through a fake
nvidia-smi, errors before any work, Ctrl-C), and (gpu) a tiny real grid."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from verify.bench import sweep as vs
from verify.bench.device_memory import used_mib
from verify.bench.report import (BACKWARD, FLASH_BACKWARD, FLASH_DISPATCHER, FORWARD, OOM, STAGE_PATH_BACKWARD,
                                 STAGE_PATH_SKIPPED, Shape)
from verify.cli import sweep as cs
from verify.stages import BACKWARD_STAGES, GRAD_INPUT, STAGES

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = json.loads((REPO / "docs" / "bench_h100.json").read_text())["runs"][0]["binary"]
STAGE_MS = sum(k["ms"] for k in TEMPLATE["kernels"] if k["kind"] != "attention")
FLASH_MS = next(k["ms"] for k in TEMPLATE["kernels"] if k["name"] == FLASH_DISPATCHER)
# The backward rows `main --bench --pass backward` adds: the stage path's six stages and its whole,
# the flash backward (times made up; the whole path is not the sum of its stages).
STAGE_BWD_MS, FLASH_BWD_MS = 9.5, 4.25
BACKWARD_KERNELS = [
    *({"name": n, "kind": "gemm", "pass": BACKWARD, "status": "ok", "ms": 1.0, "tflops": 1.0}
      for n in BACKWARD_STAGES if n != GRAD_INPUT and not STAGES[n].flash),
    {"name": STAGE_PATH_BACKWARD, "kind": "attention", "pass": BACKWARD, "status": "ok", "ms": STAGE_BWD_MS,
     "tflops": 1.0, "check": {"passed": True, "max_rel_err": 1e-6}},
    {"name": FLASH_BACKWARD, "kind": "attention", "pass": BACKWARD, "status": "ok", "ms": FLASH_BWD_MS, "tflops": 1.0,
     "check": {"passed": True, "max_rel_err": 2e-6}},
]

# A stand-in for `main --bench`: the real JSON format (one run of docs/bench_h100.json, its shape
# fields set from the options), --only stages or flash, CUDA's out of memory from CONFIG's oom_from on, exit 2
# when it has no GPU; it logs each run, and can stand still (for a fake nvidia-smi to see it) or
# interrupt its parent.
FAKE_MAIN = r'''#!{python}
import json, os, signal, sys, time
CONFIG = json.loads({config!r})
data = json.loads({template!r})
backward = json.loads({backward!r})
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
seq, only, passes = int(opt("--seq-q")), opt("--only"), opt("--pass")
with open(CONFIG["log"], "a") as f:
    f.write(f"{{seq}} {{only}} {{passes}}{{' --no-ceilings' if '--no-ceilings' in args else ''}}\n")
if CONFIG.get("no_gpu"):
    print("main: error: --bench: no CUDA device found\nHINT: run it on a machine with an NVIDIA GPU", file=sys.stderr)
    sys.exit(2)
if seq >= CONFIG.get("refuse_from", 1 << 40):
    print(f"main: error: --seq-q {{seq}}: refused by this binary", file=sys.stderr)
    sys.exit(2)
if CONFIG.get("smi_state"):
    with open(CONFIG["smi_state"], "w") as f:
        f.write(f"{{os.getpid() + 1}}, 99999\n{{os.getpid()}}, {{seq}}\n")
    time.sleep(0.4)
if seq == CONFIG.get("interrupt_at"):
    # Ctrl-C as the sweep sees it; again every half second in case a loaded machine delays the
    # first past the point where it counts (the sweep kills this process once it has one), and never
    # once the sweep is gone (the parent is then another process).
    parent = os.getppid()
    for _ in range(60):
        if os.getppid() != parent:
            break
        os.kill(parent, getattr(signal, CONFIG.get("interrupt_signal", "SIGINT")))
        time.sleep(0.5)
if seq >= CONFIG.get("oom_from", 1 << 40):
    # as the binary says it (cuda_src/cuda/cuda_check.cuh): exit 1, CUDA's error name and string
    print("main: error: bench.cu:319: cudaMalloc(&p, bytes) failed: cudaErrorMemoryAllocation: out of memory",
          file=sys.stderr)
    sys.exit(1)
data["shape"].update(batch=int(opt("--batch")), heads=int(opt("--heads")), seq_q=seq,
                     seq_k=int(opt("--seq-k")), d=int(opt("--d")), causal="--causal" in args)
data["precision"] = opt("--precision")
stages = only == "stages"
if passes == "backward":
    data["kernels"] = [k for k in backward if (k["name"] != "flash_backward") == stages]
else:
    data["kernels"] = [k for k in data["kernels"] if (k["kind"] != "attention") == stages]
if stages and seq in CONFIG.get("stages_skipped_at", []):
    data["kernels"] = [dict(name=k["name"], kind=k["kind"], status={skipped!r},
                            **({{"pass": k["pass"]}} if "pass" in k else {{}})) for k in data["kernels"]]
with open(opt("--json"), "w") as f:
    json.dump(data, f)
'''


def fake_main(tmp_path: Path, **config) -> Path:
    path = tmp_path / "fake_main"
    config.setdefault("log", str(tmp_path / "runs.log"))
    path.write_text(FAKE_MAIN.format(python=sys.executable, config=json.dumps(config),
                                     template=json.dumps(TEMPLATE), backward=json.dumps(BACKWARD_KERNELS),
                                     skipped=STAGE_PATH_SKIPPED))
    path.chmod(0o755)
    return path


def runs(tmp_path: Path) -> list:
    log = tmp_path / "runs.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(autouse=True)
def no_torch_no_smi(monkeypatch, tmp_path):
    """SDPA rows only where a test asks for them; no nvidia-smi but a test's fake one."""
    monkeypatch.setattr(cs, "torch_available", lambda: None)
    empty = tmp_path / "no-smi"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def invoke(main: Path, *args: str):
    return CliRunner().invoke(cs.sweep, ["--binary", str(main), *args])


def read_csv(path: Path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


GRID = ["--d", "16", "--d", "32", "--seq", "128", "--seq", "256", "--seq", "512"]


def test_every_row_oom_rows_and_the_files(tmp_path):
    main = fake_main(tmp_path, oom_from=512)
    out_csv, out_json = tmp_path / "sweep.csv", tmp_path / "sweep.json"
    res = invoke(main, *GRID, "--csv", str(out_csv), "--json", str(out_json))
    assert res.exit_code == 0, res.output
    rows = read_csv(out_csv)
    assert list(rows[0]) == list(vs.COLUMNS)
    assert len(rows) == 2 * 3 * 2 * 4  # d × N × masking × (stage path, flash) × (forward, backward)
    assert {(r["d"], r["seq"], r["causal"], r["kernel"], r["direction"]) for r in rows} == {
        (str(d), str(n), str(c), k, p) for d in (16, 32) for n in (128, 256, 512) for c in (False, True)
        for k in (vs.STAGE_PATH, FLASH_DISPATCHER) for p in (FORWARD, BACKWARD)}
    ms_of = {(vs.STAGE_PATH, FORWARD): STAGE_MS, (FLASH_DISPATCHER, FORWARD): FLASH_MS,
             (vs.STAGE_PATH, BACKWARD): STAGE_BWD_MS, (FLASH_DISPATCHER, BACKWARD): FLASH_BWD_MS}
    for r in rows:
        assert (r["batch"], r["heads"], r["precision"]) == ("8", "1", "fp32")
        if r["seq"] == "512":
            assert r["status"] == OOM and r["ms"] == r["tflops"] == "", r
            continue
        assert r["status"] == "ok", r
        shape = Shape(8, 1, int(r["seq"]), int(r["seq"]), int(r["d"]), r["causal"] == "True")
        ms = ms_of[r["kernel"], r["direction"]]
        flop = shape.flash_flop if r["direction"] == FORWARD else 2.5 * shape.flash_flop
        assert float(r["ms"]) == pytest.approx(ms)
        assert float(r["tflops"]) == pytest.approx(flop / (ms * 1e-3) / 1e12)
        assert r["peak_mib"] == ""  # no nvidia-smi
    # Each row its own process, of its own pass, without the ceilings' microbenchmarks.
    assert all(line.endswith("--no-ceilings") for line in runs(tmp_path))
    assert sorted({tuple(line.split()[1:3]) for line in runs(tmp_path)}) == [
        ("flash", BACKWARD), ("flash", FORWARD), ("stages", BACKWARD), ("stages", FORWARD)]
    doc = json.loads(out_json.read_text())
    assert doc["device"] == TEMPLATE["device"] and doc["columns"] == list(vs.COLUMNS)
    assert [{k: str(v) if v is not None else "" for k, v in row.items()} for row in doc["rows"]] == rows
    table = res.stdout.splitlines()
    assert sum(OOM in line for line in table) == 16 and len(table) == 2 + 1 + len(rows)
    assert "err 7.3e-07" in res.stdout  # the flash row carries the binary's float64 check


def test_a_stage_path_skipped_for_memory_is_an_oom_row_beside_a_timed_flash(tmp_path):
    main = fake_main(tmp_path, stages_skipped_at=[256])
    out_csv = tmp_path / "s.csv"
    res = invoke(main, "--d", "64", "--seq", "128", "--seq", "256", "--causal", "no", "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    status = {(r["seq"], r["kernel"], r["direction"]): r["status"] for r in read_csv(out_csv)}
    assert status == {(n, k, p): OOM if (n, k) == ("256", "stages") else "ok"
                      for n in ("128", "256") for k in ("stages", "flash") for p in (FORWARD, BACKWARD)}


def test_peak_memory_is_the_binary_process_own_from_nvidia_smi(tmp_path, monkeypatch):
    state = tmp_path / "smi_state"
    main = fake_main(tmp_path, smi_state=str(state))
    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    smi = smi_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n/bin/cat '{state}' 2>/dev/null\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi_dir))
    out_csv = tmp_path / "s.csv"
    res = invoke(main, "--d", "16", "--seq", "128", "--seq", "256", "--causal", "no", "--kernel", "flash",
                 "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    assert [(r["seq"], r["peak_mib"]) for r in read_csv(out_csv)] == [("128", "128"), ("256", "256")]


def test_without_nvidia_smi_the_peak_column_says_dash(tmp_path):
    res = invoke(fake_main(tmp_path), "--d", "16", "--seq", "128", "--causal", "no", "--kernel", "flash")
    assert res.exit_code == 0, res.output
    row = res.stdout.splitlines()[-1].split()
    assert row[:5] == ["16", "128", "no", "flash", "forward"] and row[8] == "-"


def test_nvidia_smi_lines_of_other_processes_and_na_figures_are_ignored():
    assert used_mib("12, 300\n34, 500\n12, 200\n", 12) == 500
    assert used_mib("34, 500\n", 12) is None
    assert used_mib("12, [N/A]\n", 12) is None


@pytest.mark.parametrize("option", ["--csv", "--json", "--plot"])
def test_a_bad_output_path_is_one_line_before_any_run(tmp_path, option):
    main = fake_main(tmp_path)
    res = invoke(main, "--d", "16", "--seq", "128", option, str(tmp_path / "missing" / "x"))
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"Error: {option} {tmp_path / 'missing' / 'x'}: cannot write: folder "
                                               f"{tmp_path / 'missing'} does not exist"]
    assert runs(tmp_path) == []


def test_two_outputs_on_one_file_are_refused_before_any_run(tmp_path):
    main = fake_main(tmp_path)
    same = tmp_path / "r.txt"
    res = invoke(main, "--d", "16", "--seq", "128", "--csv", str(same), "--json", str(same))
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"Error: --csv {same}: is also the --json file; HINT: give each its "
                                               "own file"]
    assert runs(tmp_path) == [] and not same.exists()


def test_an_unusable_binary_is_one_line_and_no_file(tmp_path):
    main = fake_main(tmp_path, no_gpu=True)
    out_csv = tmp_path / "s.csv"
    res = invoke(main, *GRID, "--csv", str(out_csv))
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "main --bench exited 2: main: error: --bench: no CUDA device found" in lines[0]
    assert len(runs(tmp_path)) == 1 and not out_csv.exists()


def test_a_shape_the_binary_refuses_after_rows_it_timed_keeps_those_rows(tmp_path):
    """Exit 2 from N = 512 on: those rows fail naming it; the rows timed before stay."""
    out_csv = tmp_path / "s.csv"
    res = invoke(fake_main(tmp_path, refuse_from=512), *GRID, "--csv", str(out_csv))
    assert "Traceback" not in res.output, res.output
    rows = read_csv(out_csv)
    assert {r["status"] for r in rows if r["seq"] != "512"} == {"ok"}
    refused = [r["status"] for r in rows if r["seq"] == "512"]
    assert refused and all("exited 2: main: error: --seq-q 512: refused by this binary" in s for s in refused)


def test_sdpa_alone_without_torch_is_one_line(tmp_path):
    res = invoke(fake_main(tmp_path), "--kernel", "sdpa")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "--kernel sdpa: needs PyTorch" in res.output and runs(tmp_path) == []


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_mid_sweep_writes_no_file(tmp_path, sig):
    """Ctrl-C (or SIGTERM) mid-sweep: one line, 128 + the signal, and no file written or replaced."""
    main = fake_main(tmp_path, interrupt_at=256, interrupt_signal=sig)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.csv").write_text("an earlier sweep\n")
    cmd = [sys.executable, "-m", "verify", "sweep", "--binary", str(main), "--d", "16", "--seq", "128",
           "--seq", "256", "--seq", "512", "--kernel", "stages", "--kernel", "flash",
           "--csv", str(out / "sweep.csv"), "--json", str(out / "sweep.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # A shell that starts the tests in the background ignores SIGINT, and the sweep would inherit
    # that; a user's terminal delivers it, so the sweep starts with the default action restored.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("interrupted after 2 of 12 rows; nothing written")
    assert sorted(p.name for p in out.iterdir()) == ["sweep.csv"]
    assert (out / "sweep.csv").read_text() == "an earlier sweep\n"
    assert "512" not in " ".join(runs(tmp_path))


def test_plot_has_a_panel_per_d_and_masking(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    res = invoke(fake_main(tmp_path, oom_from=512), *GRID, "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sweep")) == ["sweep.png"]


def test_kernel_flash_backward_alone(tmp_path):
    out_csv = tmp_path / "s.csv"
    res = invoke(fake_main(tmp_path), "--d", "64", "--seq", "128", "--causal", "yes", "--kernel", "flash-backward",
                 "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    [row] = read_csv(out_csv)
    assert (row["kernel"], row["direction"], row["status"]) == (FLASH_DISPATCHER, BACKWARD, "ok")
    assert float(row["ms"]) == FLASH_BWD_MS and "err 2.0e-06" in row["note"]
    assert runs(tmp_path) == ["128 flash backward --no-ceilings"]


def test_sdpa_rows_forward_and_backward_from_torch(tmp_path, monkeypatch):
    """SDPA's rows come from its own timer per pass; TFLOP/s by the pass's FLOPs; OOM stays a row."""
    monkeypatch.setattr(cs, "torch_available", lambda: "2.11")
    monkeypatch.setitem(vs.SDPA_TIMERS, FORWARD, lambda *a: {"status": "ok", "ms": 2.0, "peak_mib": 8.0,
                                                             "torch": "2.11"})
    monkeypatch.setitem(vs.SDPA_TIMERS, BACKWARD,
                        lambda shape, *a: {"status": OOM} if shape.seq_q > 128 else
                        {"status": "ok", "ms": 4.0, "peak_mib": 16.0, "torch": "2.11"})
    out_csv = tmp_path / "s.csv"
    res = invoke(fake_main(tmp_path), "--d", "64", "--seq", "128", "--seq", "256", "--causal", "no",
                 "--kernel", "sdpa", "--kernel", "sdpa-backward", "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    rows = {(r["seq"], r["direction"]): r for r in read_csv(out_csv)}
    shape = Shape(8, 1, 128, 128, 64, False)
    assert float(rows["128", FORWARD]["tflops"]) == pytest.approx(shape.flash_flop / 2e-3 / 1e12)
    assert float(rows["128", BACKWARD]["tflops"]) == pytest.approx(2.5 * shape.flash_flop / 4e-3 / 1e12)
    assert rows["128", BACKWARD]["peak_mib"] == "16.0" and rows["256", BACKWARD]["status"] == OOM
    assert runs(tmp_path) == []


def test_pass_picks_the_rows_of_one_pass(tmp_path):
    out_csv = tmp_path / "s.csv"
    res = invoke(fake_main(tmp_path), "--d", "16", "--seq", "128", "--causal", "no", "--pass", "backward",
                 "--csv", str(out_csv))
    assert res.exit_code == 0, res.output
    assert [(r["kernel"], r["direction"]) for r in read_csv(out_csv)] == [("stages", BACKWARD), ("flash", BACKWARD)]
    res = invoke(fake_main(tmp_path), "--kernel", "flash", "--pass", "backward")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1 and "--pass backward" in res.output


def test_sdpa_backward_alone_without_torch_is_one_line(tmp_path):
    res = invoke(fake_main(tmp_path), "--kernel", "sdpa-backward")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "--kernel sdpa-backward: needs PyTorch" in res.output


def test_plot_names_the_backward_as_bench_does():
    rows = [vs.SweepRow(k.name, k.direction, 64, 128, False, 8, 1, "fp32", "ok", 1.0, 1.0) for k in vs.KERNELS]
    assert [r.kernel for r in vs.plot_rows(rows)] == ["stages", "flash", "sdpa", STAGE_PATH_BACKWARD, FLASH_BACKWARD,
                                                     "sdpa_backward"]


def test_default_grid_is_the_assignment_one():
    shapes = vs.grid(vs.SWEEP_D, vs.SWEEP_SEQ, vs.MASKINGS["both"], vs.SWEEP_BATCH, vs.SWEEP_HEADS)
    assert vs.SWEEP_SEQ == (128, 256, 512, 1024, 2048, 4096, 8192, 16384) and vs.SWEEP_D == (16, 32, 64, 128)
    assert len(shapes) == 64 and {(s.batch, s.heads) for s in shapes} == {(8, 1)}
    assert all(s.seq_q == s.seq_k for s in shapes)


@pytest.mark.gpu
def test_gpu_tiny_grid_against_the_real_binary(binary, tmp_path, monkeypatch):
    """Real timings and nvidia-smi's sampling: every row ok with a time, a rate and a peak."""
    monkeypatch.undo()  # the real PATH (nvidia-smi) and torch
    out_csv = tmp_path / "s.csv"
    res = CliRunner().invoke(cs.sweep, ["--binary", str(binary), "--d", "16", "--d", "64", "--seq", "128",
                                        "--seq", "1024", "--batch", "2", "--reps", "3", "--csv", str(out_csv)])
    assert res.exit_code == 0, res.output
    rows = read_csv(out_csv)
    assert {r["kernel"] for r in rows} >= {vs.STAGE_PATH, FLASH_DISPATCHER}
    for r in rows:
        assert r["status"] == "ok" and float(r["ms"]) > 0 and float(r["tflops"]) > 0, r
        assert float(r["peak_mib"]) > 0, r


def test_the_failed_rows_line_counts_one_in_the_singular(capsys):
    from types import SimpleNamespace

    from verify.cli.sweep import _exit_status
    row = SimpleNamespace(status="failed: exit 1", note="")
    assert _exit_status([row]) == 1 and "sweep: 1 row failed; see the table" in capsys.readouterr().err
    assert _exit_status([row, row]) == 1 and "sweep: 2 rows failed; see the table" in capsys.readouterr().err

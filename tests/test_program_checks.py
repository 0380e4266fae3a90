"""What values cannot show, in the same report: `attnstep run --sanitize` (compute-sanitizer's
tools) and `--repeat K` (the same case K times, compared bit for bit), folded by `check` into the
text, JSON and JUnit reports. Without a GPU the plumbing runs through a stand-in compute-sanitizer
that runs the program and writes a log in the tool's format; on a GPU, the real tool on real
programs of the gallery."""
from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from verify.cli.group import cli
from verify.files.generate import generate_case
from verify.runs import sanitizer
from verify.runs.program_checks import repeat_check
from verify.stages import PROGRAM_CHECKS, Dims

SMALL = Dims(1, 3, 24, 40, 16, 16)

MEMCHECK_OOB = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    ========= Invalid __global__ read of size 4 bytes
    =========     at attention_forward_kernel2(float *, const float *, int, int, int)+0x1a0 in /src/attention_forward.cu:123
    =========     by thread (3,0,0) in block (1,0,0)
    =========     Address 0x7f2c0e000400 is out of bounds
    =========
    ========= ERROR SUMMARY: 30 errors
    """)
MEMCHECK_NO_LINES = MEMCHECK_OOB.replace(" in /src/attention_forward.cu:123", "")
RACECHECK_RACE = textwrap.dedent("""\
    ========= COMPUTE-SANITIZER
    ========= Warning: Race reported between Write access at void flash_fwd<64>(const float *, float *)+0x3f0 in /src/hw4.cu:88
    =========     and Read access at void flash_fwd<64>(const float *, float *)+0x2c0 in /src/hw4.cu:71 [1024 hazards]
    =========
    ========= RACECHECK SUMMARY: 32 hazards displayed (0 errors, 32 warnings)
    """)
CLEAN = {"memcheck": "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n",
         "racecheck": "========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
         "initcheck": "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"}


# ------------------------------------------------------------------ reading the tool's log
def test_an_out_of_bounds_read_names_its_kernel_and_line():
    c = sanitizer.read_log("memcheck", MEMCHECK_OOB, 1)
    assert not c.passed and c.count == 30 and c.summary == "30 errors"
    assert c.first == "Invalid __global__ read of size 4 bytes"
    assert (c.kernel, c.source) == ("attention_forward_kernel2", "attention_forward.cu:123")
    assert "in attention_forward_kernel2 at attention_forward.cu:123" in c.line()


def test_without_line_information_the_kernel_is_still_named():
    c = sanitizer.read_log("memcheck", MEMCHECK_NO_LINES, 1)
    assert (c.kernel, c.source) == ("attention_forward_kernel2", "")


@pytest.mark.parametrize("signature,name", [
    ("void seed::load_kv_tile<(int)64>(float *, float *, const float *, const float *, int, int)",
     "seed::load_kv_tile<(int)64>"),
    ("attention_forward_kernel2(float *, const float *, int, int, int)", "attention_forward_kernel2"),
    ("void flash<std::pair<int, int>>(float *)", "flash<std::pair<int, int>>"),
    ("kernel", "kernel")])
def test_a_function_is_named_without_its_parameters_and_return_type(signature, name):
    assert sanitizer._function_name(signature) == name


def test_a_race_counts_warnings_too():
    c = sanitizer.read_log("racecheck", RACECHECK_RACE, 0)
    assert not c.passed and c.count == 32 and c.summary == "32 hazards (0 errors, 32 warnings)"
    assert (c.kernel, c.source) == ("flash_fwd<64>", "hw4.cu:88")


@pytest.mark.parametrize("tool", list(CLEAN))
def test_a_clean_log_passes(tool):
    assert sanitizer.read_log(tool, CLEAN[tool], 0).passed


def test_a_clean_log_of_a_run_that_failed_does_not_pass():
    c = sanitizer.read_log("memcheck", CLEAN["memcheck"], 1)
    assert not c.passed and c.summary == "0 errors, but the program exited with status 1 under it"


def test_a_run_stopped_under_the_tool_stops_everything(tmp_path, monkeypatch):
    """Ctrl-C or --timeout during a sanitized run: no verdict from it, and no further run."""
    from verify.runs.repeats import sanitized_runs
    from verify.runs.runner import RunnerError
    monkeypatch.setattr(sanitizer, "find_sanitizer", lambda: Path("compute-sanitizer"))
    import verify.runs.repeats as program_runs
    monkeypatch.setattr(program_runs, "find_sanitizer", lambda: Path("compute-sanitizer"))
    calls = []

    def stopped(under, out):
        calls.append(under)
        raise RunnerError("stopped by SIGINT", exit_code=130, stopped=True)
    with pytest.raises(RunnerError, match="stopped by SIGINT"):
        sanitized_runs(stopped, ["memcheck", "racecheck"], tmp_path / "out", chooses_out=True)
    assert len(calls) == 1


def test_a_log_without_a_summary_fails_saying_so():
    c = sanitizer.read_log("memcheck", "========= COMPUTE-SANITIZER\n========= Error: No attachable process\n", 1)
    assert not c.passed and "printed no summary" in c.summary


def test_repeat_names_the_stages_and_heads_that_differ():
    a = {("output", 0): "x", ("output", 1): "y", ("QK", 0): "z"}
    assert repeat_check([a, dict(a), dict(a)]).passed
    c = repeat_check([a, {**a, ("output", 1): "w"}, a])
    assert not c.passed and c.first == "differ: output (1 head: 1)" and c.count == 1


# ------------------------------------------------------------------ through attnstep run and check
STANDIN = textwrap.dedent("""\
    #!{python}
    # A stand-in for compute-sanitizer: runs the program, then writes the log a real tool would
    # (errors for the tools named in ATTNSTEP_STANDIN_FINDS, a clean summary otherwise).
    import os, subprocess, sys
    args = sys.argv[1:]
    opts = {{}}
    while args and args[0].startswith("--"):
        opts[args[0]] = args[1]
        args = args[2:]
    code = subprocess.call(args)
    tool = opts["--tool"]
    logs = {logs!r}
    finds = os.environ.get("ATTNSTEP_STANDIN_FINDS", "").split(",")
    with open(opts["--log-file"], "w") as f:
        f.write(logs["found"][tool] if tool in finds else logs["clean"][tool])
    sys.exit(code)
    """)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    folder = tmp_path / "standin"
    folder.mkdir()
    tool = folder / sanitizer.SANITIZER
    found = {"memcheck": MEMCHECK_OOB, "racecheck": RACECHECK_RACE, "initcheck": MEMCHECK_OOB}
    tool.write_text(STANDIN.format(python=sys.executable, logs={"found": found, "clean": CLEAN}))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return tool


def _case(tmp_path):
    return generate_case(tmp_path / "in", SMALL, seed=3)


def _run(runner, binary, in_dir, out_dir, *extra):
    return runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                               "--binary", str(binary), *extra])


def test_sanitizer_findings_fail_the_check_beside_passing_stages(runner, binary, tmp_path, standin, monkeypatch):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    monkeypatch.setenv("ATTNSTEP_STANDIN_FINDS", "memcheck")
    res = _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck,racecheck")
    assert res.exit_code == 0, res.output
    assert "FAIL memcheck: 30 errors; first: Invalid __global__ read" in res.output
    assert "PASS racecheck: 0 hazards (0 errors, 0 warnings)" in res.output
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".attnstep-sanitize")]  # scratch removed
    rep, junit = tmp_path / "r.json", tmp_path / "r.xml"
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json", str(rep),
                              "--junit", str(junit)])
    assert res.exit_code == 1, res.output
    assert "FAIL: every stage passes its bounds (bounds for fp32), but memcheck: 30 errors" in res.output
    assert "in attention_forward_kernel2 at attention_forward.cu:123" in res.output
    data = json.loads(rep.read_text())
    assert data["passed"] is False and data["first_failing_stage"] is None
    assert [(c["kind"], c["passed"], c["count"]) for c in data["program_checks"]] == [
        ("memcheck", False, 30), ("racecheck", True, 0)]
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase") if c.get("classname") == "attnstep.program"}
    assert cases["memcheck"].find("failure") is not None and cases["racecheck"].find("failure") is None


def test_clean_sanitizer_runs_pass(runner, binary, tmp_path, standin):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    assert _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck,initcheck").exit_code == 0
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert res.exit_code == 0 and "PASS memcheck: 0 errors" in res.output and "PASS initcheck" in res.output


def test_findings_of_an_earlier_run_are_not_folded(runner, binary, tmp_path, standin, monkeypatch):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    monkeypatch.setenv("ATTNSTEP_STANDIN_FINDS", "memcheck")
    _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck")
    # A file rewritten since (even with the same bytes): the findings are not about it.
    qk = out_dir / "QK_head_1.txt"
    qk.write_bytes(qk.read_bytes())
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert res.exit_code == 0 and f"{PROGRAM_CHECKS} describes other files" in res.output, res.output
    # The binary run by hand afterwards removes them as it puts its run in place.
    import subprocess
    _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck")
    subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu"], check=True,
                   capture_output=True)
    assert not (out_dir / PROGRAM_CHECKS).exists()
    # And so does a later `attnstep run` without --sanitize.
    _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck")
    assert _run(runner, binary, in_dir, out_dir).exit_code == 0
    assert not (out_dir / PROGRAM_CHECKS).exists()


@pytest.mark.parametrize("takes_args", [False, True], ids=["attnsteps-arguments", "own-arguments"])
def test_a_program_that_writes_nothing_under_the_tool_stops_the_run(runner, tmp_path, standin, takes_args):
    """Exit 0 and no stage file under the first tool: the run stops at once, with the line and
    exit status of a plain run (not a tool's finding, and no further tool runs)."""
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    silent = tmp_path / "silent.sh"
    silent.write_text(f"#!/bin/sh\necho ran >> {tmp_path / 'runs.txt'}\n")
    silent.chmod(0o755)
    args = ["--", str(in_dir), str(out_dir)] if takes_args else []
    plain = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(silent), *args])
    assert plain.exit_code == 1 and "wrote no stage file" in plain.output, plain.output
    (tmp_path / "runs.txt").unlink()
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(silent),
                              "--sanitize", "memcheck,racecheck", *args])
    assert (res.exit_code, res.output) == (plain.exit_code, plain.output)
    assert "0 errors" not in res.output and "exited with status" not in res.output
    assert (tmp_path / "runs.txt").read_text() == "ran\n"  # under memcheck only: nothing more ran


def test_sanitize_without_the_tool_is_one_line(runner, binary, tmp_path, monkeypatch):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sanitizer, "_DEFAULT_TOOLKIT", tmp_path / "no-toolkit")
    res = _run(runner, binary, in_dir, out_dir, "--sanitize", "memcheck")
    assert res.exit_code == 2 and "compute-sanitizer not found" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_an_unknown_tool_is_refused(runner, binary, tmp_path):
    res = _run(runner, binary, _case(tmp_path), tmp_path / "out", "--sanitize", "memcheck,leakcheck")
    assert res.exit_code == 2 and "--sanitize memcheck,leakcheck: expected a comma list of memcheck" in res.output


def test_repeat_of_a_deterministic_run_passes(runner, binary, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    res = _run(runner, binary, in_dir, out_dir, "--repeat", "3")
    assert res.exit_code == 0 and "PASS repeat: 3 runs, bit-identical" in res.output, res.output
    assert runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)]).exit_code == 0


NONDETERMINISTIC = textwrap.dedent("""\
    #!{python}
    # output = P·V, correct, but head 1's last element is summed in a varying order, as a kernel
    # with floating-point atomics would: a value that changes by an ulp from run to run.
    import os, sys, numpy as np
    case, out = sys.argv[1], sys.argv[2]
    for i in range(3):
        q, k, v = (np.loadtxt(os.path.join(case, f"{{n}}_head_{{i}}.txt"), dtype=np.float32, ndmin=2) for n in "QKV")
        s = (q @ k.T) / np.float32(4)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        o = (p / p.sum(axis=1, keepdims=True)) @ v
        if i == 1:
            o[-1, -1] = np.nextafter(o[-1, -1], np.float32(np.inf if os.urandom(1)[0] % 2 else -np.inf))
        np.savetxt(os.path.join(out, f"output_head_{{i}}.txt"), o, fmt="%.9g")
    """)


def test_repeat_names_the_stage_and_head_that_change_between_runs(runner, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    out_dir.mkdir()
    prog = tmp_path / "prog.py"
    prog.write_text(NONDETERMINISTIC.format(python=sys.executable))
    prog.chmod(0o755)
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(prog),
                              "--repeat", "6", "--", str(in_dir), str(out_dir)])
    assert res.exit_code == 0, res.output
    # Six runs: the chance that all six draw the same direction is 1/32.
    if "PASS repeat" in res.output:
        pytest.skip("six runs drew the same rounding (probability 1/32)")
    assert "FAIL repeat: 6 runs, not bit-identical in 1 stage; first: differ: output (1 head: 1)" in res.output
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert res.exit_code == 1 and "but repeat: 6 runs, not bit-identical" in res.output, res.output


def test_the_python_api_report_has_no_program_checks():
    import numpy as np

    import attnstep
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(3))
    assert attnstep.check_arrays(q, k, v, {"Q": q}).program_checks == []


# ------------------------------------------------------------------ the real tool, on a GPU
@pytest.mark.gpu
def test_the_real_sanitizer_on_attnsteps_cuda_backend(runner, binary, tmp_path):
    if not shutil.which(sanitizer.SANITIZER) and not Path("/usr/local/cuda/bin/compute-sanitizer").exists():
        pytest.skip("compute-sanitizer is not installed")
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    res = runner.invoke(cli, ["run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cuda", "--binary",
                              str(binary), "--sanitize", "memcheck,racecheck,initcheck", "--repeat", "2"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert res.exit_code == 0, res.output
    for line in ("PASS memcheck: 0 errors", "PASS racecheck: 0 hazards", "PASS initcheck: 0 errors",
                 "PASS repeat: 2 runs, bit-identical"):
        assert line in res.output, res.output

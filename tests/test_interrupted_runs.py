"""A failed or interrupted run never verifies, and the previous run survives it (docs/contract.md,
"A run is complete or it is not there"): the binary writes into a staging folder and puts the
finished run in place at once; until then the output folder carries a marker that `check` refuses.
Signals sent at several points of real runs, a file-size limit, a full filesystem, exit 3, a run
still writing, `attnstep run` stopped, and other people's programs that fail."""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verify.files.case import CaseError
from verify.files.generate import generate_case
from verify.files.unfinished import Unfinished, mark_unfinished, process_start_ticks, read_marker, refuse_unfinished
from verify.stages import Dims

from helpers.interrupting import (PREVIOUS_DIR, REPO, UNFINISHED_MARKER, binary_command, check, leftovers,
                         paused_while_staging, signal_when, snapshot, staged_a_file, staging_folders)

BIG = Dims(1, 8, 384, 384, 32, 32)     # long enough to be caught while writing, on any machine
SMALL = Dims(1, 3, 24, 40, 16, 16)
# A finished run of BIG is accepted: check one stage (every stage of BIG takes seconds more, and the
# numbers are the end-to-end tests' job; here the run's protocol is under test).
ACCEPTED = ("--stage", "QK")


def _case(tmp_path: Path, dims: Dims = BIG, name: str = "in", fmt: str = "npy") -> Path:
    return generate_case(tmp_path / name, dims, fmt=fmt, seed=1)


def _run(binary, in_dir, out_dir, *extra, **kw):
    return subprocess.run(binary_command(binary, in_dir, out_dir, *extra), capture_output=True, text=True,
                          timeout=300, **kw)


def _finished(binary, in_dir, out_dir, *extra):
    """A complete run in OUT; returns its files."""
    proc = _run(binary, in_dir, out_dir, *extra)
    assert proc.returncode == 0, proc.stderr
    assert not (out_dir / UNFINISHED_MARKER).exists()
    return snapshot(out_dir)


def _error_lines(stderr: str):
    return [ln for ln in stderr.splitlines() if ln.startswith("main: error:")]


def _assert_refused(in_dir, out_dir, *words):
    res = check(in_dir, out_dir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "did not finish" in res.stderr and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ------------------------------------------------------------------ the binary
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1],
                         ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_writing_keeps_the_previous_run(binary, tmp_path, sig):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir, "--stages", "QK,output")
    signalled, rc, err = signal_when(binary_command(binary, in_dir, out_dir), lambda: staged_a_file(out_dir), sig)
    assert signalled, "five runs ended before a file was staged"
    name = signal.Signals(sig).name
    assert rc == 128 + sig, err
    assert _error_lines(err) == [f"main: error: interrupted by signal {int(sig)} ({name})"], err
    assert snapshot(out_dir) == before  # untouched, byte for byte
    assert leftovers(out_dir) == []
    marker = read_marker(out_dir)
    assert marker.state == "failed" and name in marker.reason
    _assert_refused(in_dir, out_dir, name)


@pytest.mark.gpu
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_the_cuda_backend_writes_keeps_the_previous_run(binary, tmp_path, sig):
    in_dir, out_dir = _case(tmp_path, Dims(1, 16, 1024, 1024, 64, 64)), tmp_path / "out"
    cuda = ("--backend", "cuda")
    before = _finished(binary, in_dir, out_dir, *cuda, "--stages", "flash")
    cmd = binary_command(binary, in_dir, out_dir)[:-2] + list(cuda)
    signalled, rc, err = signal_when(cmd, lambda: staged_a_file(out_dir), sig)
    assert signalled, "five runs ended before a file was staged"
    assert rc == (-sig if sig == signal.SIGKILL else 128 + sig), err
    assert snapshot(out_dir) == before
    _assert_refused(in_dir, out_dir)
    _finished(binary, in_dir, out_dir, *cuda)
    assert leftovers(out_dir) == [] and check(in_dir, out_dir, "--stage", "flash_output").returncode == 0


def test_sigkill_while_writing_keeps_the_previous_run_and_the_next_run_cleans_up(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir, "--stages", "QK")
    signalled, rc, _ = signal_when(binary_command(binary, in_dir, out_dir), lambda: staged_a_file(out_dir),
                                   signal.SIGKILL)
    assert signalled and rc == -signal.SIGKILL
    assert snapshot(out_dir) == before and staging_folders(out_dir)
    marker = read_marker(out_dir)
    assert marker.state == "running" and not marker.writer_alive()
    _assert_refused(in_dir, out_dir, f"process {marker.pid} ended before it finished")
    again = _run(binary, in_dir, out_dir, "--stages", "QK")
    assert again.returncode == 0 and "removed 1 staging folder" in again.stderr, again.stderr
    assert leftovers(out_dir) == [] and not (out_dir / UNFINISHED_MARKER).exists()
    assert check(in_dir, out_dir).returncode == 0


def test_a_failed_run_keeps_the_previous_run_and_says_why(binary, tmp_path):
    """Heads 0 and 1 are computed and written (staged) before head 2's broken file is read."""
    in_dir, out_dir = _case(tmp_path, Dims(1, 3, 192, 192, 64, 64), fmt="txt"), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir)
    (out_dir / "notes.txt").write_text("the user's own file")
    v2 = in_dir / "V_head_2.txt"
    good = v2.read_text()
    v2.write_text("".join(good.splitlines(keepends=True)[:-1]))
    proc = _run(binary, in_dir, out_dir, "--max-memory-mb", "1")
    assert proc.returncode == 2 and "V_head_2.txt:192:1" in _error_lines(proc.stderr)[0]
    assert {k: v for k, v in snapshot(out_dir).items() if k != "notes.txt"} == before
    assert (out_dir / "notes.txt").read_text() == "the user's own file" and leftovers(out_dir) == []
    _assert_refused(in_dir, out_dir, "V_head_2.txt:192:1")
    v2.write_text(good)
    _finished(binary, in_dir, out_dir)
    assert check(in_dir, out_dir).returncode == 0
    assert (out_dir / "notes.txt").exists() and (out_dir / PREVIOUS_DIR / "run.toml").exists()


def test_exit_3_marks_the_folder(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path, Dims(1, 1, 512, 512, 16, 16)), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir, "--stages", "flash")
    proc = _run(binary, in_dir, out_dir, "--max-memory-mb", "1")
    assert proc.returncode == 3, proc.stderr
    assert snapshot(out_dir) == before
    _assert_refused(in_dir, out_dir, "not enough host memory")


def test_a_file_size_limit_ends_the_run_with_a_message(binary, tmp_path):
    """SIGXFSZ would end the binary without a word: the write fails instead, and says so."""
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir, "--stages", "K")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    proc = _run(binary, in_dir, out_dir, preexec_fn=limit)
    assert proc.returncode == 1 and "File too large" in _error_lines(proc.stderr)[0], proc.stderr
    assert snapshot(out_dir) == before and leftovers(out_dir) == []
    _assert_refused(in_dir, out_dir, "File too large")


def _unshare_works() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-rm", "true"],
                                                           capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` to mount a small tmpfs without root")
def test_a_full_filesystem_keeps_the_previous_run(binary, tmp_path):
    """On a 1 MiB tmpfs: a small run fits, a larger one runs out of space while writing."""
    large = _case(tmp_path, Dims(1, 4, 256, 256, 32, 32), "large")
    mnt, after = tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    script = textwrap.dedent(f"""\
        mount -t tmpfs -o size=1m tmpfs "{mnt}" || exit 90
        "{binary}" --in "{large}" --out "{mnt}/out" --backend cpu --stages K || exit 91
        cp -a "{mnt}/out" "{tmp_path}/before"
        "{binary}" --in "{large}" --out "{mnt}/out" --backend cpu 2>"{tmp_path}/err"
        echo $? > "{tmp_path}/rc"
        cp -a "{mnt}/out" "{after}"
        """)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1" and "No space left" in _error_lines(err)[0], err
    assert snapshot(after) == snapshot(tmp_path / "before") and leftovers(after) == []
    _assert_refused(large, after)


def test_check_refuses_a_folder_while_the_run_writes(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    _finished(binary, in_dir, out_dir, "--stages", "QK")
    with paused_while_staging(binary_command(binary, in_dir, out_dir), out_dir) as run:
        res = check(in_dir, out_dir)
        assert res.returncode == 2 and f"still writing into this folder (process {run.pid}" in res.stderr, res.stderr
    assert run.returncode == 0
    assert check(in_dir, out_dir, *ACCEPTED).returncode == 0


def test_an_output_folder_holding_another_case_is_refused(binary, tmp_path):
    in_dir, other = _case(tmp_path, SMALL), _case(tmp_path, SMALL, "other", "txt")
    before = snapshot(other)
    assert "holds an input case (manifest.toml)" in _error_lines(_run(binary, in_dir, other).stderr)[0]
    (other / "manifest.toml").unlink()
    del before["manifest.toml"]
    assert "holds an input case (" in _error_lines(_run(binary, in_dir, other).stderr)[0]
    assert snapshot(other) == before
    # An output folder echoes Q, K, V beside the stages it computed: that one is taken.
    out_dir = tmp_path / "out"
    _finished(binary, in_dir, out_dir)
    (out_dir / "run.toml").unlink()
    assert _run(binary, in_dir, out_dir).returncode == 0


# ------------------------------------------------------------------ the marker
def test_a_live_writer_is_told_from_a_reused_process_id(tmp_path):
    me = os.getpid()
    assert Unfinished(pid=me, pid_start=process_start_ticks(me), state="running").writer_alive()
    assert not Unfinished(pid=me, pid_start=process_start_ticks(me) + 1, state="running").writer_alive()
    assert not Unfinished(pid=me, pid_start=process_start_ticks(me), state="failed").writer_alive()
    mark_unfinished(tmp_path, "a-run")
    with pytest.raises(CaseError, match="a-run is still writing into this folder"):
        refuse_unfinished(tmp_path)


def test_an_unreadable_marker_still_refuses(tmp_path):
    (tmp_path / UNFINISHED_MARKER).write_bytes(b"\x00\xff not toml")
    with pytest.raises(CaseError, match="did not finish"):
        refuse_unfinished(tmp_path)


# ------------------------------------------------------------------ attnstep run
def _attnstep(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verify", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_sigterm_to_attnstep_run_stops_the_binary_too(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    before = _finished(binary, in_dir, out_dir, "--stages", "QK")
    run = _attnstep("run", "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu")  # builds build/main
    try:
        deadline = time.monotonic() + 120
        while not staged_a_file(out_dir) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        writer = read_marker(out_dir)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    if writer is None or writer.pid == run.pid:
        pytest.skip("the run finished before it could be stopped")
    assert run.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err
    with pytest.raises(ProcessLookupError):  # no orphan: the binary ended before attnstep did
        os.kill(writer.pid, 0)
    time.sleep(0.5)
    assert snapshot(out_dir) == before and leftovers(out_dir) == []
    _assert_refused(in_dir, out_dir, "SIGTERM")


def _program(tmp_path: Path, body: str) -> Path:
    prog = tmp_path / "prog.py"
    prog.write_text(f"#!{sys.executable}\nimport sys, os, numpy as np\nout = sys.argv[1]\n{body}\n")
    prog.chmod(0o755)
    return prog


@pytest.mark.parametrize("body,words", [
    ("np.savetxt(os.path.join(out, 'output_head_0.txt'), np.zeros((24, 16)))\nsys.exit(1)", "exited with status 1"),
    ("np.savetxt(os.path.join(out, 'output_head_0.txt'), np.zeros((24, 16)))\nos.kill(os.getpid(), 9)",
     "killed by signal 9"),
    ("pass", "wrote no stage file"),
], ids=["exit-1", "killed", "wrote-nothing"])
def test_another_program_that_fails_leaves_the_folder_refused(tmp_path, body, words):
    in_dir, out_dir = _case(tmp_path, SMALL, fmt="txt"), tmp_path / "out"
    prog = _program(tmp_path, body)
    run = _attnstep("run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(prog), "--", str(out_dir))
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and words in err, err
    _assert_refused(in_dir, out_dir, words)


def test_another_program_that_succeeds_clears_the_marker(tmp_path):
    in_dir, out_dir = _case(tmp_path, SMALL, fmt="txt"), tmp_path / "out"
    prog = _program(tmp_path, "q = [np.loadtxt(os.path.join(sys.argv[2], f'Q_head_{i}.txt')) for i in range(3)]\n"
                              "[np.savetxt(os.path.join(out, f'Q_head_{i}.txt'), q[i], fmt='%.9g') for i in range(3)]")
    run = _attnstep("run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(prog), "--", str(out_dir),
                    str(in_dir))
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert not (out_dir / UNFINISHED_MARKER).exists()
    assert check(in_dir, out_dir).returncode == 0


def test_a_timing_that_is_not_a_number_is_named(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path, SMALL), tmp_path / "out"
    _finished(binary, in_dir, out_dir, "--stages", "QK")
    toml = out_dir / "run.toml"
    toml.write_text(toml.read_text().replace("time_ms_QK = ", 'time_ms_QK = "abc" #'))
    res = check(in_dir, out_dir, "--json", str(tmp_path / "r.json"))
    assert res.returncode == 2 and "'time_ms_QK' must be a number" in res.stderr, res.stderr


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (reaped or not, a zombie runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_timeout_stops_the_programs_whole_process_group(tmp_path):
    """A program started by a wrapper script: --timeout stops what the script started too."""
    from verify.runs.runner import RunnerError, run_program
    prog = tmp_path / "wrapper.sh"
    prog.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path}/pid\nwait\n")
    prog.chmod(0o755)
    with pytest.raises(RunnerError, match="did not finish within 1 s"):
        run_program(prog, [], tmp_path, timeout=1)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_second_run_into_a_folder_being_written_is_refused(binary, tmp_path):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    _finished(binary, in_dir, out_dir, "--stages", "QK")
    with paused_while_staging(binary_command(binary, in_dir, out_dir), out_dir) as first:
        second = _run(binary, in_dir, out_dir, "--stages", "QK")
        assert second.returncode == 2, second.stderr
        assert _error_lines(second.stderr) == [f"main: error: {out_dir}: another run (process {first.pid}) is "
                                               "writing into this folder"]
    assert first.returncode == 0 and check(in_dir, out_dir, *ACCEPTED).returncode == 0


def test_a_folder_a_killed_commit_left_with_inputs_only_is_still_a_run_folder(binary, tmp_path):
    """Killed while it put the run in place, a run may leave only the echoed Q, K, V beside its
    marker: that is its output folder, not an input case, and the next run takes it."""
    in_dir, out_dir = _case(tmp_path, SMALL), tmp_path / "out"
    _finished(binary, in_dir, out_dir, "--stages", "Q,K,V")
    (out_dir / "run.toml").unlink()
    mark_unfinished(out_dir, "killed-run", "failed", "killed")
    again = _run(binary, in_dir, out_dir)
    assert again.returncode == 0, again.stderr
    assert check(in_dir, out_dir).returncode == 0


def test_a_run_moves_aside_only_the_names_it_writes(binary, tmp_path):
    """Head numbers as the binary writes them: a user's `QK_head_01.txt` is not the run's to move."""
    in_dir, out_dir = _case(tmp_path, SMALL), tmp_path / "out"
    _finished(binary, in_dir, out_dir, "--stages", "QK")
    mine = out_dir / "QK_head_01.txt"
    mine.write_text("the user's own notes")
    _finished(binary, in_dir, out_dir, "--stages", "QK")
    assert mine.read_text() == "the user's own notes"
    assert not (out_dir / PREVIOUS_DIR / mine.name).exists() and (out_dir / PREVIOUS_DIR / "QK_head_1.npy").exists()


def test_another_programs_earlier_files_moved_aside_under_the_marker(tmp_path):
    """Moving the earlier run's files aside can fail half-way: the folder is marked before it starts."""
    in_dir, out_dir = _case(tmp_path, SMALL, fmt="txt"), tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "output_head_0.txt").write_text("0\n")
    (out_dir / PREVIOUS_DIR).write_text("a file where the folder of the run before goes")
    prog = _program(tmp_path, "pass")
    run = _attnstep("run", "--in", str(in_dir), "--out", str(out_dir), "--binary", str(prog), "--", str(out_dir))
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and "cannot move the previous run's files aside" in err, err
    _assert_refused(in_dir, out_dir, "cannot move the previous run's files aside")


# ------------------------------------------------------------------ generate
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_generating_leaves_no_new_folder(tmp_path, sig):
    """generate stopped by a signal while it writes into a folder it created: the folder is gone,
    one line in the binary's words, and 128 + the signal."""
    out = tmp_path / "new"
    cmd = [sys.executable, "-m", "verify", "generate", "--out", str(out), "--heads", "8", "--seq-q", "384",
           "--seq-k", "384", "--d-k", "32", "--d-v", "32", "--backward"]

    def writing() -> bool:
        return out.is_dir() and any(any(p.iterdir()) for p in out.iterdir() if p.is_dir())
    signalled, rc, err = signal_when(cmd, writing, sig)
    assert signalled, "five runs of generate ended before a file was written"
    name = signal.Signals(sig).name
    assert rc == 128 + sig and err.strip().splitlines() == [f"Error: interrupted by signal {int(sig)} ({name})"], err
    assert not out.exists()


def test_ctrl_c_while_generating_removes_the_folder_it_created(tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while generate writes: one line, 130, and no folder left; into a
    folder that was there before, the folder stays (with nothing of this generate in it)."""
    from helpers.cli import invoke
    from verify.files import generate as gen

    def interrupted(staging, *args, **kwargs):
        (staging / "Q_head_0.txt").write_text("1\n")
        raise KeyboardInterrupt
    monkeypatch.setattr(gen, "_write_inputs", interrupted)
    args = ["--heads", "2", "--seq-q", "4", "--seq-k", "4", "--d-k", "4", "--d-v", "4"]
    res = invoke("generate", "--out", tmp_path / "new", *args)
    assert res.exit_code == 130 and res.output.strip().splitlines()[-1] == "Error: interrupted by signal 2 (SIGINT)"
    assert not (tmp_path / "new").exists()
    assert invoke("generate", "--out", tmp_path / "p" / "a" / "new", *args).exit_code == 130
    assert not (tmp_path / "p").exists()  # (the parents it made too)
    (tmp_path / "kept").mkdir()
    assert invoke("generate", "--out", tmp_path / "kept", *args).exit_code == 130
    assert list((tmp_path / "kept").iterdir()) == []


def test_ctrl_c_before_a_command_starts_ends_in_one_line_and_130(monkeypatch, capsys):
    """click turns a Ctrl-C while it parses (or a command's module loads) into "Aborted!" and exit 1,
    a failing check's status; the entry point says what happened and exits 130."""
    from verify.cli import group
    import click

    def aborted(*args, **kwargs):
        raise click.Abort()
    monkeypatch.setattr(group.cli, "main", aborted)
    with pytest.raises(SystemExit) as stop:
        group.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == "Error: interrupted by signal 2 (SIGINT)"


def test_the_marker_replaces_a_link_in_the_folder_not_the_file_it_points_to(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / UNFINISHED_MARKER).symlink_to(outside)
    mark_unfinished(folder, "r1")
    assert outside.read_text() == "keep\n"
    assert not (folder / UNFINISHED_MARKER).is_symlink() and read_marker(folder) is not None


@pytest.mark.parametrize("moved", [1, 2, 4])
def test_a_generate_stopped_while_it_moves_its_files_leaves_no_case_that_verifies(binary, tmp_path, monkeypatch,
                                                                                    moved):
    """Stopped where Python sees it, it clears what it moved; stopped by SIGKILL (no cleanup: here the
    clearing made a no-op), what is left has the manifest and not all of its files, which the binary
    and the Python side both refuse."""
    from verify.files import case as case_files
    from verify.files.case import load_input_case
    dims = Dims(1, 4, 8, 8, 8, 8)
    real_replace = os.replace
    calls = []

    def stop_after(src, dst):  # (os.replace is every module's: only the moves out of the staging folder count)
        if Path(src).parent.name.startswith(".attnstep-generate") and Path(dst).parent == Path(src).parent.parent:
            if len(calls) == moved:
                raise KeyboardInterrupt
            calls.append(dst)
        real_replace(src, dst)
    monkeypatch.setattr(case_files.os, "replace", stop_after)
    for folder in ("cleared", "killed"):  # a folder of the user's, which a failed generate keeps
        (tmp_path / folder).mkdir()
    with pytest.raises(KeyboardInterrupt):
        generate_case(tmp_path / "cleared", dims, seed=1)
    assert not [p.name for p in (tmp_path / "cleared").iterdir() if not p.name.startswith(".")]
    calls.clear()
    monkeypatch.setattr(case_files, "clear_input_files", lambda folder: None)
    with pytest.raises(KeyboardInterrupt):
        generate_case(tmp_path / "killed", dims, seed=1)
    with pytest.raises(CaseError, match="missing|not found"):
        load_input_case(tmp_path / "killed")
    ran = subprocess.run([str(binary), "--in", str(tmp_path / "killed"), "--out", str(tmp_path / "out"),
                          "--backend", "cpu"], capture_output=True, text=True)
    assert ran.returncode != 0, ran.stderr


def test_a_second_program_run_into_a_folder_a_live_run_writes_is_refused(tmp_path):
    """As the binary refuses it: the second run would move the first one's files aside and clear
    its marker while it writes, and check would then read a folder still being written."""
    from helpers.cli import invoke
    in_dir = tmp_path / "in"
    generate_case(in_dir, Dims(1, 2, 8, 8, 8, 8), seed=1)
    out = tmp_path / "out"
    out.mkdir()
    mark_unfinished(out, "the-first-run")  # (this process: alive)
    program = tmp_path / "prog.sh"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    r = invoke("run", "--in", in_dir, "--out", out, "--binary", program, "--", "x")
    assert r.exit_code == 2 and "run the-first-run is still writing into this folder" in r.output, r.output
    assert read_marker(out).run_id == "the-first-run"

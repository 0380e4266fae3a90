"""Building the binary with CMake and running it as a subprocess (no bindings)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from ..stages import PREVIOUS_DIR, RUN_MANIFEST
from . import gpu

REPO = Path(__file__).resolve().parents[2]  # verify/runs/runner.py
DEFAULT_BUILD_DIR = REPO / "build"
BINARY_NAME = "main"
EXAMPLES_DIR = REPO / "examples"  # the gallery: one program per .cu file, a CMake target each


def example_names() -> List[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.cu"))
BUILD_TIMEOUT_S = 1800
DEFAULT_RUN_TIMEOUT_S = 600
# After --timeout the program's process group gets SIGTERM (on which attnstep's binary stops and
# marks its run unfinished), and SIGKILL if it has not ended within this grace period.
TERMINATE_GRACE_S = 30
# The binary's exit statuses (docs/contract.md).
EXIT_BAD_INPUT = 2
EXIT_NO_MEMORY = 3


class RunnerError(Exception):
    """A build or run failure, already worded for the user (one line plus the tool's own output)."""

    def __init__(self, message: str, detail: str = "", exit_code: int = 2, stopped: bool = False):
        super().__init__(message)
        self.detail = detail
        self.exit_code = exit_code
        self.stopped = stopped  # by a signal to attnstep or by --timeout: nothing more may run


class NothingWritten(RunnerError):
    """A program that exited 0 but wrote no stage file into OUT: an error of the program's use (where
    it writes), not a finding of a tool it ran under, so every run stops at it."""

    def __init__(self, program: str, out_dir: Path):
        super().__init__(f"{program} exited 0 but wrote no stage file into {out_dir}; HINT: pass --out DIR "
                         "where it writes <stage>_head_<i>.txt (or .npy) files", exit_code=1)
        self.program = program
        self.out_dir = out_dir


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# The lines of a CMake build worth showing while it works: Makefiles' "[ 42%] Building CUDA object
# ..." and Ninja's "[3/20] Building ...", and attnstep's own configure lines (what gets built).
_PROGRESS_LINE = re.compile(r"^\[\s*\d+(%|/\d+)\]\s+(Building|Linking)|^-- attnstep: ")

Progress = Optional[Callable[[str], None]]


def _run_tool(cmd: Sequence[str], what: str, timeout: float, progress: Progress = None) -> None:
    """Runs a build tool with its output captured (shown in full only when it fails); its progress
    lines go to `progress` as they come."""
    try:
        child = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace")
    except FileNotFoundError:
        raise RunnerError(f"{what}: '{cmd[0]}' not found; install it (see README.md, Prerequisites)")
    timed_out = threading.Event()

    def stop() -> None:  # a build that hangs silently still ends
        timed_out.set()
        child.kill()
    stopper = threading.Timer(timeout, stop)
    stopper.start()
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if progress is not None and _PROGRESS_LINE.search(line):
                progress(line.rstrip())
        code = child.wait()
    finally:
        stopper.cancel()
    if timed_out.is_set():
        raise RunnerError(f"{what}: timed out after {timeout:.0f} s")
    if code != 0:
        raise RunnerError(f"{what} failed (exit {code})", _tail("".join(lines), 40))


def _cache_entries(cache: Path) -> dict:
    """NAME -> value of a CMakeCache.txt (`NAME:TYPE=value` lines); {} when it cannot be read."""
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        return {}
    return dict(m.groups() for m in re.finditer(r"^([A-Za-z_][\w.+-]*):[A-Z]+=(.*)$", text, re.M))


def _configured_before_a_gpu(build_dir: Path) -> bool:
    """A build folder configured without a GPU, building no CUDA, on a machine that has a GPU now
    (and not configured with ATTNSTEP_CUDA=OFF): the default build would have the CUDA backend
    here. CMakeLists.txt caches what the last configure found; once configured with the GPU in
    sight (CUDA built or, without a toolkit, not), this is false, so it happens once. A cache from
    before those entries: configured without a GPU when no CUDA compiler was even looked for."""
    cache = _cache_entries(build_dir / "CMakeCache.txt")
    if not cache or cache.get("ATTNSTEP_CUDA", "AUTO").upper() == "OFF":
        return False
    if "ATTNSTEP_CONFIGURED_GPU" in cache:
        without_gpu = cache["ATTNSTEP_CONFIGURED_GPU"] == "OFF" and cache.get("ATTNSTEP_CUDA_BUILT") == "OFF"
    else:
        without_gpu = "CMAKE_CUDA_COMPILER" not in cache
    return without_gpu and gpu.no_gpu_reason() is None  # nvidia-smi asked only for such a folder


def require_cuda_backend(build_dir: Optional[Path] = None) -> None:
    """`--backend cuda` refused before anything is written, in the binary's words: no GPU here, or
    (`build_dir`, attnstep's own binary once built) a build folder whose cache says it built no
    CUDA. The binary refuses the same, but only once it runs, after `demo` has generated its case."""
    if build_dir is not None:
        if _cache_entries(Path(build_dir) / "CMakeCache.txt").get("ATTNSTEP_CUDA_BUILT") == "OFF":
            raise RunnerError(f"--backend cuda: the binary in {build_dir} was built without CUDA; HINT: configure "
                              "it with -DATTNSTEP_CUDA=ON (docs/cli.md, Building), or use --backend cpu")
        return
    why = gpu.no_gpu_reason()
    if why:
        raise RunnerError(f"--backend cuda: no CUDA device found: {why}; HINT: run on a machine with an NVIDIA GPU, "
                          "or use --backend cpu")


def ensure_built(build_dir: Path = DEFAULT_BUILD_DIR, cmake_args: Sequence[str] = (),
                 target: str = BINARY_NAME, progress: Progress = None) -> Path:
    """Configure (once) and build (incrementally) the binary, or another target (an example of
    examples/); returns its path. A folder configured without a GPU is configured again when one
    appears, so that the default build gets the CUDA backend (once; not with ATTNSTEP_CUDA=OFF).
    `progress` receives a line per configure result and compiled file as the build goes (nothing
    when the build is up to date)."""
    build_dir = Path(build_dir)
    if shutil.which("cmake") is None:
        raise RunnerError("cmake not found on PATH; install CMake >= 3.24 (see README.md)")
    configured = (build_dir / "CMakeCache.txt").exists()
    again = configured and not cmake_args and _configured_before_a_gpu(build_dir)
    if again and progress is not None:
        progress(f"attnstep: {build_dir} was configured without a GPU and builds no CUDA; a GPU is here now: "
                 "configuring it again for the CUDA backend")
    if not configured or cmake_args or again:
        _run_tool(["cmake", "-S", str(REPO), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                   *cmake_args], "CMake configure", BUILD_TIMEOUT_S, progress)
    jobs = str(max(1, os.cpu_count() or 1))
    _run_tool(["cmake", "--build", str(build_dir), "--parallel", jobs, "--target", target], "CMake build",
              BUILD_TIMEOUT_S, progress)
    binary = build_dir / target
    if not binary.exists():
        raise RunnerError(f"the build finished but {binary} is missing")
    return binary


# The binary's `--progress` lines: units of work done and in all.
_BINARY_PROGRESS = re.compile(r"^main: progress: (\d+)/(\d+)$")
RunProgress = Optional[Callable[[int, int], None]]


def _read_lines(stream, sink: List[str], progress: RunProgress = None) -> threading.Thread:
    """A thread that keeps the lines of `stream` in `sink`, except progress lines, which go to
    `progress(done, total)` as they come."""
    def pump() -> None:
        for line in stream:
            match = _BINARY_PROGRESS.match(line.rstrip("\n")) if progress else None
            if match:
                progress(int(match[1]), int(match[2]))
            else:
                sink.append(line)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


# The signals that stop `attnstep run` stop the program it runs: passed on to it (it runs in a
# process group of its own, so a Ctrl-C at the terminal reaches it once, through here), and the run
# ends only once the program has.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen):
    """Passes FORWARDED_SIGNALS that reach this process on to `child`; yields the list of those
    received. Only the main thread can take signals: elsewhere nothing is forwarded."""
    received: List[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(sig, _frame) -> None:
        received.append(sig)
        _signal_group(child, sig)
    before = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _finish_or_stop(child: subprocess.Popen, timeout: Optional[float], who: str, after: str = "",
                    progress: RunProgress = None) -> Tuple[str, str]:
    """child's (stdout, stderr) once it exits (empty where not piped), its stderr read as it comes
    so that progress lines reach `progress` while it works; after `timeout` seconds it gets SIGTERM
    (on which attnstep's binary stops and marks its run unfinished), SIGKILL after
    TERMINATE_GRACE_S more, and the run is an error. A signal that stops this process is passed on
    to the child, which is waited for, and the run is an error."""
    out: List[str] = []
    err: List[str] = []
    readers = [_read_lines(stream, sink, report)
               for stream, sink, report in ((child.stdout, out, None), (child.stderr, err, progress))
               if stream is not None]
    try:
        with _forwarding_signals(child) as received:
            _wait_or_stop(child, timeout, who, after)
    finally:
        for reader in readers:
            reader.join()
    if received and child.returncode != 0:  # 0: it finished all the same (the signal came too late)
        sig = signal.Signals(received[0])
        raise RunnerError(f"stopped by {sig.name}: {who} was stopped too (exit status {_status(child)})",
                          "".join(err), exit_code=128 + sig.value, stopped=True)
    return "".join(out), "".join(err)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    """`sig` to the child's process group (it leads one of its own): a program started by a
    wrapper script, or under compute-sanitizer, is stopped with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


def _status(child: subprocess.Popen) -> str:
    code = child.returncode
    return f"signal {-code}" if code < 0 else str(code)


def _wait_or_stop(child: subprocess.Popen, timeout: Optional[float], who: str, after: str) -> None:
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGTERM)
        try:
            child.wait(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.wait()
        raise RunnerError(f"{who} did not finish within {timeout:.0f} s (--timeout) and was stopped{after}",
                          exit_code=1, stopped=True) from None


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    notices: List[str] = field(default_factory=list)


def run_binary(binary: Path, in_dir: Path, out_dir: Path, *, backend: str = "auto",
               extra: Sequence[str] = (), timeout: Optional[float] = DEFAULT_RUN_TIMEOUT_S,
               check: bool = True, cwd: Optional[Path] = None, progress: RunProgress = None,
               under: Sequence[str] = ()) -> RunResult:
    """Runs `binary --in IN --out OUT --backend B EXTRA...` (under `under`, a tool such as
    compute-sanitizer that runs the command it is given). With check, a non-zero exit raises
    RunnerError carrying the binary's stderr and the binary's own exit status. With `progress`, the
    binary reports its progress, passed on as progress(done, total)."""
    if cwd is not None:  # the folders as the caller means them, wherever the binary runs
        in_dir, out_dir = Path(in_dir).absolute(), Path(out_dir).absolute()
    cmd = [*under, str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", backend, *extra]
    if progress is not None:
        cmd.append("--progress")
    try:
        # errors="replace": the binary quotes bad input bytes back in its messages
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 errors="replace", cwd=cwd, process_group=0)
    except FileNotFoundError:
        raise RunnerError(f"binary not found: {binary}; run 'attnstep run' to build it")
    except OSError as exc:
        raise RunnerError(f"cannot run {binary}: {exc.strerror or exc}")
    stdout, stderr = _finish_or_stop(child, timeout, "the binary", "; the output folder is marked unfinished",
                                     progress)
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    notices = [ln for ln in proc.stderr.splitlines() if ": notice:" in ln]
    result = RunResult(proc.returncode, proc.stdout, proc.stderr, notices)
    if check and proc.returncode != 0:
        first, rest = _binary_error(proc.stderr)
        code = proc.returncode if proc.returncode in (EXIT_BAD_INPUT, EXIT_NO_MEMORY) else 1
        if proc.returncode < 0:
            first = f"{Path(binary).name} was killed by signal {-proc.returncode}" + (f": {first}" if first else "")
        raise RunnerError(first or f"{Path(binary).name} exited with status {proc.returncode}", rest, exit_code=code)
    return result


def _binary_error(stderr: str) -> Tuple[str, str]:
    """The binary's error as one line, its HINT lines joined on as the verifier's own errors word
    them, and the rest of its stderr (notices, anything else), which the one line does not say."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    said = [next((ln for ln in lines if ": error:" in ln), lines[0])] if lines else []
    said += [ln for ln in lines if ln.startswith("HINT:")]
    rest = _tail("\n".join(ln for ln in lines if ln not in said))
    if said:  # ("main: error: X" reads "Error: X" once the command prints it)
        said[0] = re.sub(r"^[\w.-]+: error: ", "", said[0])
    return "; ".join(said), rest


# ----------------------------------------------------------------------------------------------
# What running anyone's program is made of (verify/runs/watched.py runs it and tells what it wrote
# apart from what was there): an earlier run's files moved aside, and the program run with its own
# arguments.


def set_aside_previous(out_dir: Path, names: Sequence[str]) -> None:
    """Moves the files `names` of OUT (an earlier run's stage files and run.toml) into
    OUT/.attnstep-previous, replacing what an earlier move left there, so that whatever OUT holds
    after the next run was written by that run."""
    out_dir = Path(out_dir)
    if not names:
        return
    previous = out_dir / PREVIOUS_DIR
    try:
        if previous.is_dir() and not previous.is_symlink():
            shutil.rmtree(previous)
        previous.mkdir()
        # run.toml first: no moment shows it beside some of its files gone
        for name in sorted(names, key=lambda n: n != RUN_MANIFEST):
            os.replace(out_dir / name, previous / name)
    except OSError as exc:
        raise RunnerError(f"{out_dir}: cannot move the previous run's files aside: {exc.strerror or exc}")


def run_program(binary: Path, args: Sequence[str], cwd: Optional[Path],
                timeout: Optional[float] = DEFAULT_RUN_TIMEOUT_S, under: Sequence[str] = ()) -> float:
    """Runs `binary ARGS...` in `cwd` (under `under`, as run_binary) with its output passed through;
    returns its wall time in seconds. A non-zero exit, a signal or the timeout raises RunnerError."""
    cmd = [*under, str(Path(binary).absolute()), *args]  # as the caller names it, wherever it runs
    t0 = time.monotonic()
    try:
        child = subprocess.Popen(cmd, cwd=cwd, process_group=0)
    except FileNotFoundError:
        raise RunnerError(f"program not found: {binary}")
    except OSError as exc:
        raise RunnerError(f"cannot run {binary}: {exc.strerror or exc}; HINT: is it executable "
                          "(chmod +x), with a #! line if it is a script?")
    _finish_or_stop(child, timeout, binary.name)
    code = child.returncode
    if code < 0:
        raise RunnerError(f"{binary.name} was killed by signal {-code}", exit_code=1)
    if code != 0:
        raise RunnerError(f"{binary.name} exited with status {code}",
                          exit_code=code if code in (EXIT_BAD_INPUT, EXIT_NO_MEMORY) else 1)
    return time.monotonic() - t0

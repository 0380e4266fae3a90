"""What a new user sees: the first build (what it compiles, its progress), the commands' own
lines (run's summary, progress bars, --quiet), help texts and plots."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from verify import terminal as terminal_module
from verify.check import tolerance
from verify.cli import generate as cli_generate
from verify.cli import run as cli_run
from verify.cli.group import cli
from verify.report.heatmaps import tile_axis_name
from verify.report.text import plural
from verify.runs import runner as runner_module
from verify.stages import FORWARD_STAGES, STAGE_NAMES

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--heads", "2", "--seq-q", "9", "--seq-k", "13", "--d-k", "16", "--d-v", "16"]


# ---- what the first build compiles -------------------------------------------------------------

def _path_with_nvidia_smi(tmp_path: Path, script: str) -> str:
    """PATH with a fake nvidia-smi first and no real one after it."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    rest = [d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    return os.pathsep.join([str(fake), *rest])


def _configure(tmp_path: Path, path_env: str, *args: str) -> tuple[str, str]:
    """A fresh configure's output and its CMakeCache.txt, with PATH = path_env."""
    build = tmp_path / "build"
    env = dict(os.environ, PATH=path_env)
    env.pop("CUDAARCHS", None)
    env.pop("CUDACXX", None)
    proc = subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr, (build / "CMakeCache.txt").read_text()


def _configured_architectures(tmp_path: Path, path_env: str, *args: str) -> str:
    """CMAKE_CUDA_ARCHITECTURES as a fresh configure caches it (CUDA off: no compiler check, fast)."""
    _, cache = _configure(tmp_path, path_env, "-DATTNSTEP_CUDA=OFF", *args)
    return re.search(r"^CMAKE_CUDA_ARCHITECTURES:[A-Z]+=(.*)$", cache, re.M).group(1)


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not on PATH")


@needs_cmake
def test_without_a_gpu_cmake_compiles_for_one_architecture(tmp_path):
    path = _path_with_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    assert _configured_architectures(tmp_path, path) == "75"


@needs_cmake
def test_with_a_gpu_cmake_compiles_for_that_gpu(tmp_path):
    path = _path_with_nvidia_smi(tmp_path, "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    assert _configured_architectures(tmp_path, path) == "native"


@needs_cmake
def test_the_users_architectures_always_win(tmp_path):
    path = _path_with_nvidia_smi(tmp_path, "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    assert _configured_architectures(tmp_path, path, "-DCMAKE_CUDA_ARCHITECTURES=90") == "90"


@needs_cmake
def test_without_a_gpu_the_default_build_compiles_no_cuda_and_says_how(tmp_path):
    """A first build on a machine without a GPU is the CPU-only binary, whether or not the CUDA
    toolkit is installed (no CUDA compiler is even looked for); one line says how to get CUDA."""
    path = _path_with_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    out, cache = _configure(tmp_path, path)
    assert "building the CPU-only binary" in out and "-DATTNSTEP_CUDA=ON" in out, out
    assert not re.search(r"^CMAKE_CUDA_COMPILER:", cache, re.M)


@needs_cmake
def test_with_a_gpu_the_default_build_looks_for_cuda(tmp_path):
    """With a GPU listed, the default build goes for CUDA: here with no CUDA compiler on PATH, so it
    says that the toolkit is missing (where CMake still finds one, it reports the CUDA build)."""
    path = _path_with_nvidia_smi(tmp_path, "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    path = os.pathsep.join(d for d in path.split(os.pathsep) if not (Path(d) / "nvcc").exists())
    out, _ = _configure(tmp_path, path)
    assert "no CUDA toolkit found" in out or re.search(r"attnstep: CUDA [\d.]+, architectures native", out), out
    assert "-DATTNSTEP_CUDA=ON" not in out


def _path_without_nvcc(path_env: str) -> str:
    return os.pathsep.join(d for d in path_env.split(os.pathsep) if not (Path(d) / "nvcc").exists())


def _configures_and_fake_builds(monkeypatch):
    """runner._run_tool with real configures (recorded) and a build that only makes the binary."""
    configures, real = [], runner_module._run_tool

    def tool(cmd, what, timeout, progress=None):
        if cmd[1] == "--build":
            (Path(cmd[2]) / "main").write_text("")
            return
        configures.append(cmd)
        real(cmd, what, timeout, progress)
    monkeypatch.setattr(runner_module, "_run_tool", tool)
    return configures


@needs_cmake
def test_a_folder_configured_without_a_gpu_is_configured_again_once_one_appears(tmp_path, monkeypatch):
    """build/ configured on a machine without a GPU (CPU-only) and run once a GPU is there: it is
    configured again, with one line, so that the default build looks for CUDA (here no toolkit on
    PATH, so it stays CPU-only) and for that GPU's architecture; then not again."""
    (tmp_path / "none").mkdir()
    (tmp_path / "one").mkdir()
    no_gpu = _path_without_nvcc(_path_with_nvidia_smi(tmp_path / "none", "exit 9\n"))
    gpu = _path_without_nvcc(_path_with_nvidia_smi(tmp_path / "one", "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n"))
    for name in ("CUDAARCHS", "CUDACXX", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    configures, build, lines = _configures_and_fake_builds(monkeypatch), tmp_path / "build", []
    monkeypatch.setenv("PATH", no_gpu)
    runner_module.ensure_built(build, progress=lines.append)
    runner_module.ensure_built(build, progress=lines.append)
    assert len(configures) == 1 and not [ln for ln in lines if "again" in ln]
    cache = runner_module._cache_entries(build / "CMakeCache.txt")
    assert (cache["ATTNSTEP_CONFIGURED_GPU"], cache["ATTNSTEP_CUDA_BUILT"], cache["CMAKE_CUDA_ARCHITECTURES"]) == (
        "OFF", "OFF", "75")
    monkeypatch.setenv("PATH", gpu)
    runner_module.ensure_built(build, progress=lines.append)
    again = [ln for ln in lines if "configuring it again" in ln]
    assert len(configures) == 2 and again == [
        f"attnstep: {build} was configured without a GPU and builds no CUDA; a GPU is here now: "
        "configuring it again for the CUDA backend"], lines
    cache = runner_module._cache_entries(build / "CMakeCache.txt")
    assert (cache["ATTNSTEP_CONFIGURED_GPU"], cache["CMAKE_CUDA_ARCHITECTURES"]) == ("ON", "native")
    runner_module.ensure_built(build, progress=lines.append)
    assert len(configures) == 2  # once: no toolkit here, and no configure on every run for it


@pytest.mark.parametrize("cache, again", [
    ("ATTNSTEP_CUDA:STRING=AUTO\nATTNSTEP_CONFIGURED_GPU:INTERNAL=OFF\nATTNSTEP_CUDA_BUILT:INTERNAL=OFF\n", True),
    ("ATTNSTEP_CUDA:STRING=OFF\nATTNSTEP_CONFIGURED_GPU:INTERNAL=OFF\nATTNSTEP_CUDA_BUILT:INTERNAL=OFF\n", False),
    ("ATTNSTEP_CUDA:STRING=ON\nATTNSTEP_CONFIGURED_GPU:INTERNAL=OFF\nATTNSTEP_CUDA_BUILT:INTERNAL=ON\n", False),
    ("ATTNSTEP_CUDA:STRING=AUTO\nATTNSTEP_CONFIGURED_GPU:INTERNAL=ON\nATTNSTEP_CUDA_BUILT:INTERNAL=OFF\n", False),
    ("ATTNSTEP_CUDA:STRING=AUTO\n", True),  # a cache from before those entries, CUDA never looked for
    ("ATTNSTEP_CUDA:STRING=AUTO\nCMAKE_CUDA_COMPILER:FILEPATH=/usr/local/cuda/bin/nvcc\n", False),
], ids=["cpu-only-auto", "cuda-off", "cuda-built", "gpu-seen-no-toolkit", "older-cache", "older-cache-cuda"])
def test_which_folders_are_configured_again_for_a_gpu(tmp_path, monkeypatch, cache, again):
    monkeypatch.setattr("verify.runs.gpu.no_gpu_reason", lambda: None)
    (tmp_path / "CMakeCache.txt").write_text("# This is the CMakeCache file.\n" + cache)
    assert runner_module._configured_before_a_gpu(tmp_path) is again
    monkeypatch.setattr("verify.runs.gpu.no_gpu_reason", lambda: "no nvidia-smi on PATH (no NVIDIA driver)")
    assert runner_module._configured_before_a_gpu(tmp_path) is False


def test_a_cpu_only_binary_says_how_to_get_cuda(binary, tmp_path):
    """--backend cuda and --bench on a CPU-only build (the default without a GPU): exit 2, and the
    hint names both ways to a CUDA build."""
    probe = subprocess.run([str(binary), "--in", str(REPO / "tests" / "data" / "tiny_test"), "--out",
                            str(tmp_path / "out"), "--backend", "cuda"], capture_output=True, text=True, timeout=60)
    if "built without CUDA" not in probe.stderr:
        pytest.skip("a binary built with CUDA")
    bench = subprocess.run([str(binary), "--bench"], capture_output=True, text=True, timeout=60)
    for proc in (probe, bench):
        assert proc.returncode == 2, proc.stderr
        hint = proc.stderr.splitlines()[-1]
        assert hint.startswith("HINT:") and "a GPU" in hint and "-DATTNSTEP_CUDA=ON" in hint, proc.stderr


def test_a_cpu_only_binarys_automatic_backend_names_the_build(binary, tmp_path):
    """--backend auto on a CPU-only build: one notice that the binary was built without CUDA and
    how to get it (not that no device was found: none was looked for), and the run goes on."""
    case = REPO / "tests" / "data" / "tiny_test"
    probe = subprocess.run([str(binary), "--in", str(case), "--out", str(tmp_path / "probe"), "--backend", "cuda"],
                           capture_output=True, text=True, timeout=60)
    if "built without CUDA" not in probe.stderr:
        pytest.skip("a binary built with CUDA (its --backend auto notice names a missing device)")
    proc = subprocess.run([str(binary), "--in", str(case), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    notices = [ln for ln in proc.stderr.splitlines() if ln.startswith("main: notice:")]
    assert len(notices) == 1 and notices == proc.stderr.splitlines(), proc.stderr
    assert notices[0].startswith("main: notice: this binary was built without CUDA; using the CPU backend; "), notices
    assert "-DATTNSTEP_CUDA=ON" in notices[0] and "no CUDA device" not in notices[0]
    assert (tmp_path / "out" / "run.toml").exists()


# ---- the build talks while it works ------------------------------------------------------------

def _fake_tool(lines, code=0):
    body = "".join(f"print({line!r}, flush=True)\n" for line in lines) + f"raise SystemExit({code})\n"
    return [sys.executable, "-c", body]


def test_build_progress_lines_are_streamed_and_the_rest_kept_for_errors():
    seen = []
    out = ["-- The CXX compiler identification is GNU", "-- attnstep: CUDA 13.0, architectures 75",
           "[ 10%] Building CUDA object CMakeFiles/main.dir/cuda_src/cuda/gemm.cu.o",
           "[3/20] Building CXX object main.cpp.o", "[100%] Linking CXX executable main",
           "[100%] Built target main"]
    runner_module._run_tool(_fake_tool(out), "CMake build", 60, seen.append)
    assert seen == out[1:5]
    with pytest.raises(runner_module.RunnerError) as err:
        runner_module._run_tool(_fake_tool(["[ 10%] Building CXX object a.o", "a.cpp:1: error: boom"], 2),
                                "CMake build", 60, seen.append)
    assert "exit 2" in str(err.value) and "a.cpp:1: error: boom" in err.value.detail


def test_a_silent_hung_build_is_stopped_at_its_timeout():
    with pytest.raises(runner_module.RunnerError, match="timed out after 1 s"):
        runner_module._run_tool([sys.executable, "-c", "import time; time.sleep(30)"], "CMake build", 1)


def _fake_build(binary):
    def ensure_built(build_dir, cmake_args=(), target="main", progress=None):
        if progress:
            progress("[ 50%] Building CUDA object CMakeFiles/main.dir/cuda_src/cuda/gemm.cu.o")
        return binary
    return ensure_built


@pytest.mark.parametrize("quiet", [False, True])
def test_demo_shows_the_build_as_it_goes_unless_quiet(runner, tmp_path, binary, monkeypatch, quiet):
    monkeypatch.setattr(cli_run, "ensure_built", _fake_build(binary))
    res = runner.invoke(cli, ["demo", "--data-dir", str(tmp_path), "--backend", "cpu",
                              "--build-dir", str(tmp_path / "b")] + (["--quiet"] if quiet else []))
    assert res.exit_code == 0, res.output
    assert ("Building CUDA object" in res.stderr) is not quiet
    if quiet:
        assert [ln.split(":")[0] for ln in res.stdout.splitlines()] == ["PASS (bounds for fp32)"]
    else:
        assert re.search(r"main: \d+\.\d\d s; cpu backend .*12 heads, 10 stages; written to", res.stdout)


# ---- run's summary, progress bars, --quiet ------------------------------------------------------

def _generate(runner, folder, *extra):
    res = runner.invoke(cli, ["generate", "--out", str(folder), *SMALL, *extra])
    assert res.exit_code == 0, res.output
    return res


def test_run_ends_with_one_summary_line(runner, tmp_path, binary):
    _generate(runner, tmp_path / "in")
    args = ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu",
            "--binary", str(binary)]
    res = runner.invoke(cli, args)
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"main: \d+\.\d\d s; cpu backend \(.+\), flash kernel \S+, 2 heads, "
                        rf"{len(FORWARD_STAGES)} stages; written to {re.escape(str(tmp_path / 'out'))}", last), last
    quiet = runner.invoke(cli, args + ["--quiet"])
    assert quiet.exit_code == 0 and quiet.stdout == ""


def test_run_summary_counts_the_stages_written(runner, tmp_path, binary):
    _generate(runner, tmp_path / "in", "--heads", "1")
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu", "--binary", str(binary), "--stages", "flash"])
    assert res.exit_code == 0, res.output
    assert ", 1 head, 2 stages; written to" in res.stdout


@pytest.mark.parametrize("terminal", [False, True])
def test_generate_shows_a_progress_bar_on_a_terminal_only(runner, tmp_path, monkeypatch, terminal):
    monkeypatch.setattr(terminal_module, "on_terminal", lambda: terminal)
    monkeypatch.setattr(cli_generate, "GENERATE_PROGRESS_MIN_VALUES", 0)
    res = _generate(runner, tmp_path / "in")
    assert ("generating heads" in res.stderr) is terminal


def test_generate_says_one_head_in_the_singular(runner, tmp_path):
    res = _generate(runner, tmp_path / "in", "--heads", "1")
    assert res.stdout.startswith("wrote 1 head (")
    assert plural(1, "head") == "1 head" and plural(2, "head") == "2 heads" and plural(0, "map") == "0 maps"


@pytest.fixture
def good_run(runner, tmp_path, binary):
    _generate(runner, tmp_path / "in")
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                              "--backend", "cpu", "--binary", str(binary)])
    assert res.exit_code == 0, res.output
    return tmp_path / "in", tmp_path / "out"


def test_check_quiet_prints_only_the_verdict(runner, good_run):
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet"])
    assert res.exit_code == 0, res.output
    assert [ln.split(":")[0] for ln in res.output.splitlines()] == ["PASS (bounds for fp32)"]
    loud = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert len(loud.output.splitlines()) > 5


def test_plot_of_a_passing_run_says_nothing_failed(runner, good_run, tmp_path):
    in_dir, out_dir = good_run
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--plot", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert f"no stage failed: no error map written to {tmp_path / 'p'}" in res.output.splitlines()
    assert not (tmp_path / "p").exists()


# ---- help texts and documents ---------------------------------------------------------------------

def _all_help(runner):
    texts = [runner.invoke(cli, ["--help"]).output]
    for name in cli.commands:
        res = runner.invoke(cli, [name, "--help"])
        assert res.exit_code == 0, res.output
        texts.append(res.output)
    return texts


def test_no_help_text_or_user_document_speaks_of_issues(runner):
    docs = [(REPO / p).read_text() for p in ("README.md", "docs/contract.md", "docs/tolerances.md")]
    for text in _all_help(runner) + docs:
        assert not re.search(r"\bissues?\b|\bissue's\b", text, re.I), re.search(r".*issue.*", text, re.I).group(0)


def test_the_tolerance_document_states_the_models_constants():
    text = (REPO / "docs" / "tolerances.md").read_text()
    assert f"bound = {tolerance.LAMBDA:g}·σ + det + floor" in text
    assert f"log ({tolerance.LOG_ULPS:g} ulp)" in text
    for word in STAGE_NAMES + ("2^-24", "floor", "--math fast", "IEEE float32"):
        assert word in text, word


# ---- plots ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage, rows, cols", [
    ("QK", "query tile", "key tile"), ("attention_weights", "query tile", "key tile"),
    ("output", "query tile", "column tile"), ("KT", "row tile", "key tile"),
    ("flash_lse", "query tile", None)])
def test_tile_axes_are_named_after_what_the_stage_holds(stage, rows, cols):
    assert tile_axis_name(stage, "row") == rows and tile_axis_name(stage, "column") == cols


@pytest.mark.parametrize("stage, shape", [("output", (130, 64)), ("flash_lse", (130, 1)), ("QK", (3, 2))])
def test_error_figures_have_integer_ticks_and_named_axes(stage, shape):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verify.report.heatmaps import error_figure
    fig = error_figure(stage, 0, np.full(shape, 2.0), (64, 64))
    try:
        fig.canvas.draw()
        grid = fig.axes[1]  # then the two colour bars
        for ax in (fig.axes[0], grid):
            for ticks in (ax.get_xticks(), ax.get_yticks()):
                assert all(float(t).is_integer() for t in ticks), (stage, list(ticks))
        assert grid.get_xlabel() == (tile_axis_name(stage, "column") or "")
        assert grid.get_ylabel() == tile_axis_name(stage, "row")
    finally:
        plt.close(fig)

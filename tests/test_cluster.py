"""`check --scheduler`: heads checked on a Dask cluster (verify/check/cluster.py) give a local
check's report (text, JSON and JUnit) on the binary's run (grouped K/V heads, backward stages) and on a
foreign program's files (no run.toml, %.9g text), a planted bug's diagnosis included; a worker
killed in a task costs a retry, not the check; the CPU path never imports dask; a missing dask and
an unreachable scheduler are one line each. Two-process LocalClusters, a few seconds each."""
from __future__ import annotations

import gc
import json
import os
import tempfile
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import buggy_programs as bp
from helpers import foreign_routes as foreign
from helpers.cli import generate_input, invoke
from verify.check import cluster
from verify.check.compare import Options, check_run
from verify.diagnose.hypotheses import diagnose
from verify.files.case import load_input_case
from verify.files.kinds import CaseError
from verify.files.outputs import open_run
from verify.report.json_file import write_json
from verify.stages import Dims, default_scale

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = Dims(1, 3, 48, 64, 16, 16)   # causal top-left, N < M: a mask at M - N is the bug
FOREIGN_STAGES = ("QK", "QK_scaled", "attention_weights", "output")


def _distributed():
    return pytest.importorskip("distributed", reason="dask.distributed is not installed (pip install "
                               "'attnstep[cluster]')")


@pytest.fixture(scope="module")
def scheduler():
    """The address of a LocalCluster of two one-thread worker processes."""
    _distributed()
    with cluster.local_cluster(2) as c:
        yield c.scheduler_address


def _checks(tmp: Path, in_dir: Path, out_dir: Path, where: list, *args):
    """(exit status, text, JSON report, JUnit XML) of `check` here (one process) and `where`."""
    got = []
    for name, extra in (("local", ["--jobs", 1]), ("cluster", where)):
        path, junit = tmp / f"{name}.json", tmp / f"{name}.xml"
        r = invoke("check", "--in", in_dir, "--out", out_dir, "--json", path, "--junit", junit, *args, *extra)
        got.append((r.exit_code, r.output, json.loads(path.read_text()), junit.read_text()))
    return got


def _on_cluster(scheduler: str, jobs: int, checks):
    """checks(), asserting that the cluster of `scheduler` ran `jobs` of a check's tasks meanwhile
    and holds none of its runs after."""
    distributed = _distributed()
    with distributed.Client(scheduler) as client, distributed.get_task_stream(client) as stream:
        got = checks()
        held = client.run(lambda: len(cluster._OPENED))
    ran = [t["key"] for t in stream.data if str(t["key"]).startswith(cluster.TASK_PREFIX)]
    assert len(ran) == jobs, ran
    assert set(held.values()) == {0}, held  # the workers let go of the run once the check is over
    return got


def _pretended_gpus():
    """Dask's own GPU diagnostics off for workers given GPUs "0" and "1" that a machine may not have
    (on one GPU, NVML refuses the second and the worker does not start)."""
    import dask
    return dask.config.set({"distributed.diagnostics.nvml": False})


def _binary_run(tmp: Path, binary: Path) -> Path:
    r = invoke("generate", "--out", tmp / "in", "--heads", 4, "--kv-heads", 2, "--seq-q", 40, "--seq-k", 56,
               "--d-k", 16, "--d-v", 16, "--causal", "--backward")
    assert r.exit_code == 0, r.output
    subprocess.run([str(binary), "--in", str(tmp / "in"), "--out", str(tmp / "out"), "--backend", "cpu"],
                   check=True, capture_output=True)
    return tmp


@pytest.mark.parametrize("where", ["address", "local"])
def test_the_binarys_run_checks_on_a_cluster_as_here(binary, scheduler, tmp_path, where):
    tmp = _binary_run(tmp_path, binary)
    option = ["--scheduler", scheduler] if where == "address" else ["--scheduler", "local", "--jobs", 2]
    checks = lambda: _checks(tmp, tmp / "in", tmp / "out", option, "--per-head")  # noqa: E731
    here, there = _on_cluster(scheduler, 2, checks) if where == "address" else checks()  # 2 K/V heads' groups
    assert here[0] == 0, here[1]
    assert there == here


@pytest.mark.parametrize("offset", [0, FOREIGN.seq_k - FOREIGN.seq_q], ids=["correct", "mask-bottom-right"])
def test_a_foreign_programs_files_check_on_a_cluster_as_here(scheduler, tmp_path, offset):
    in_dir = generate_input(tmp_path / "in", FOREIGN, "normal", 5, True)
    heads = bp.masked_program(foreign.read_inputs(in_dir, FOREIGN.total_heads), default_scale(FOREIGN.d_k), offset)
    foreign.write_outputs(tmp_path / "out", heads, FOREIGN, "g9", only=FOREIGN_STAGES)
    here, there = _on_cluster(scheduler, FOREIGN.heads, lambda: _checks(tmp_path, in_dir, tmp_path / "out",
                                                                          ["--scheduler", scheduler]))
    assert there == here
    status, _, report, _ = there
    if offset == 0:
        assert status == 0, here[1]
        return
    assert status == 1 and report["first_failing_stage"] == "QK_scaled", there[1]
    firsts = {e["diagnosis"][0]["code"] for e in report["results"] if e["stage"] == "QK_scaled"}
    assert firsts == {"mask_offset"}, there[1]


def test_the_cluster_is_given_a_few_tasks_a_worker_at_a_time(scheduler, tmp_path, monkeypatch):
    """Tasks go to the cluster as workers free up (at most IN_FLIGHT_PER_THREAD a worker thread at
    once), not all at the start: a task that asks for a GPU is placed when it is submitted, so
    handing out all at once can leave one GPU with the last several. Every job still runs once."""
    distributed = _distributed()
    dims = Dims(1, 6, 16, 24, 8, 8)
    in_dir = generate_input(tmp_path / "in", dims, "normal", 5, True)
    heads = bp.masked_program(foreign.read_inputs(in_dir, dims.total_heads), default_scale(dims.d_k), 0)
    foreign.write_outputs(tmp_path / "out", heads, dims, "g9", only=FOREIGN_STAGES)
    monkeypatch.setattr(cluster, "IN_FLIGHT_PER_THREAD", 1)
    submitted, real = [], distributed.Client.submit

    def counted(client, *args, **kwargs):
        future = real(client, *args, **kwargs)
        if str(kwargs.get("key", "")).startswith(cluster.TASK_PREFIX):
            submitted.append(future)
            assert sum(not f.done() for f in submitted) <= 2  # the fixture's two one-thread workers
        return future
    monkeypatch.setattr(distributed.Client, "submit", counted)
    here, there = _on_cluster(scheduler, dims.heads, lambda: _checks(tmp_path, in_dir, tmp_path / "out",
                                                                      ["--scheduler", scheduler]))
    assert len(submitted) == dims.heads and here[0] == 0 and there == here, there[1]


def _check_through(scheduler: str, tmp: Path, progress=None, gpus=()):
    """The report of check_run on tmp's run with its jobs on the cluster of `scheduler`."""
    opts = Options()
    with cluster.heads_on_cluster(scheduler, 0, tmp / "in", tmp / "out", opts, diagnose, gpus):
        case = load_input_case(tmp / "in")
        return check_run(open_run(tmp / "out", case, opts.overrides()), case, opts, progress, diagnoser=diagnose)


def test_a_worker_lost_in_a_task_is_replaced_and_its_task_run_again(binary, tmp_path):
    """A worker dies as it starts the check's first task: Dask runs that task on another worker
    (allowed-failures), and the check counts each job once and reports what a local one does."""
    distributed = _distributed()
    from helpers.cluster_workers import DieInFirstTask

    tmp = _binary_run(tmp_path, binary)
    marker = tmp / "died"
    with cluster.local_cluster(2) as c, distributed.Client(c) as client:
        client.register_plugin(DieInFirstTask(str(marker)))
        counted = []
        report = _check_through(c.scheduler_address, tmp, counted.append)
    assert marker.exists()  # a worker did die in a task
    assert sorted(counted) == [0, 1, 2, 3]  # each query head once, as the pool counts them
    local = invoke("check", "--in", tmp / "in", "--out", tmp / "out", "--json", tmp / "local.json")
    assert local.exit_code == 0 and report.passed
    write_json(report, tmp / "cluster.json")
    assert json.loads((tmp / "cluster.json").read_text()) == json.loads((tmp / "local.json").read_text())


def test_a_task_that_kills_every_worker_it_is_given_stops_the_check_in_one_line(binary, tmp_path):
    """With no failure allowed, the first lost worker is the task's last: one line, exit 2."""
    distributed = _distributed()
    import dask
    from helpers.cluster_workers import DieInFirstTask

    tmp = _binary_run(tmp_path, binary)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), cluster.local_cluster(2) as c, \
            distributed.Client(c) as client:
        client.register_plugin(DieInFirstTask(str(tmp / "died")))
        r = invoke("check", "--in", tmp / "in", "--out", tmp / "out", "--scheduler", c.scheduler_address)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "workers died each time" in r.output, r.output


def test_without_dask_the_option_says_how_to_install_it(binary, tmp_path, monkeypatch):
    tmp = _binary_run(tmp_path, binary)
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed: ImportError
    r = invoke("check", "--in", tmp / "in", "--out", tmp / "out", "--scheduler", "local")
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "--scheduler" in r.output and "pip install 'attnstep[cluster]'" in r.output


def test_an_unreachable_scheduler_is_one_line_naming_it(binary, tmp_path, monkeypatch):
    _distributed()
    tmp = _binary_run(tmp_path, binary)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1)
    r = invoke("check", "--in", tmp / "in", "--out", tmp / "out", "--scheduler", address)
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and address in r.output and "no Dask scheduler answered within 1 s" in r.output


class _Server:
    """A TCP server on a free local port that is not a Dask scheduler: it accepts each connection,
    then sends `reply` (None: nothing) and keeps it open until the test ends."""

    def __init__(self, reply):
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.conns.append(conn)
                if reply is not None:
                    conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


# A port that accepts and then stays silent (another server) must not hold the check; one that
# answers bytes that are not Dask's (here a frame of 2^60 bytes) must not read as out of memory.
@pytest.mark.parametrize("reply, words", [(None, "no Dask scheduler answered within 1 s"),
                                          (b"\xff" * 64, "what answers there does not speak Dask's protocol")],
                         ids=["silent", "garbage"])
def test_an_address_that_is_not_a_scheduler_is_one_line_within_the_timeout(binary, tmp_path, monkeypatch, reply,
                                                                           words):
    _distributed()
    tmp = _binary_run(tmp_path, binary)
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1)
    server = _Server(reply)
    try:
        r = invoke("check", "--in", tmp / "in", "--out", tmp / "out", "--scheduler", server.address)
    finally:
        server.close()
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and server.address in r.output and words in r.output, r.output


def test_the_scheduler_is_asked_who_it_is_even_from_a_running_event_loop(scheduler):
    """A notebook runs its cells in an event loop: the question still goes out (on its own thread),
    a scheduler is taken, and one of its workers is told apart from it."""
    import asyncio
    distributed = _distributed()

    async def in_a_loop(address):
        cluster._is_scheduler(address, distributed)

    asyncio.run(in_a_loop(scheduler))
    with distributed.Client(scheduler) as client:
        worker = next(iter(client.scheduler_info()["workers"]))
    with pytest.raises(cluster.NotAScheduler, match="^a Dask (worker|nanny) answers there, not its scheduler$"):
        asyncio.run(in_a_loop(worker))


def test_a_worker_that_cannot_see_the_folders_says_they_must_be_shared(tmp_path):
    recipe = cluster.Recipe(str(tmp_path / "in"), str(tmp_path / "out"), Options(), None, "t")
    with pytest.raises(CaseError, match="every worker must see .* at these paths"):
        cluster.check_job(recipe, 0)


def test_the_cpu_path_never_imports_dask(binary, tmp_path):
    tmp = _binary_run(tmp_path, binary)
    code = ("import sys; from click.testing import CliRunner; from verify.cli.group import cli; "
            f"r = CliRunner().invoke(cli, ['check', '--in', {str(tmp / 'in')!r}, '--out', {str(tmp / 'out')!r}]); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("per_gpu", [1, 2])
def test_a_local_cluster_for_gpus_has_its_workers_on_each_gpu_seeing_it_alone(binary, tmp_path, monkeypatch, per_gpu):
    """The hook for a multi-GPU host, on the CPU: workers_per_gpu workers per (here pretended) GPU,
    each with its GPU's CUDA_VISIBLE_DEVICES and a GPU to give; the tasks ask for one each, and the
    check is a local one's."""
    distributed = _distributed()
    tmp = _binary_run(tmp_path, binary)
    monkeypatch.setattr(cluster, "workers_per_gpu", lambda gpus: per_gpu)
    with _pretended_gpus(), cluster.local_cluster(0, ["0", "1"]) as c, distributed.Client(c) as client:
        seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        assert sorted(seen.values()) == ["0"] * per_gpu + ["1"] * per_gpu
        assert [w["resources"] for w in client.scheduler_info()["workers"].values()] == [cluster.GPU_TASK] * 2 * per_gpu
        assert _check_through(c.scheduler_address, tmp, gpus=["0", "1"]).passed


@pytest.mark.parametrize("gpus", [(), ("0", "1")], ids=["cores", "gpus"])
def test_a_local_clusters_workers_run_without_dasks_sampling_profiler(gpus):
    """Dask's profiler stops a worker's threads every 10 ms to read their stacks (for a dashboard the
    local cluster has not): its workers run without it."""
    distributed = _distributed()
    import dask

    with _pretended_gpus(), cluster.local_cluster(2, list(gpus)) as c, distributed.Client(c) as client:
        on = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
    assert set(on.values()) == {False}, on
    assert dask.config.get("distributed.worker.profile.enabled")  # (this process's own setting as it was)


@pytest.mark.parametrize("memory_gb, host_gb, cores, gpus, per_gpu", [
    (80, 1000, 16, 1, 4), (141, 1000, 16, 1, 4), (80, 1000, 16, 8, 2), (80, 1000, 64, 4, 4), (40, 1000, 16, 1, 3),
    (24, 1000, 16, 1, 2), (12, 1000, 16, 1, 1), (80, 1000, 1, 4, 1), (80, 64, 64, 4, 1), (80, 40, 16, 1, 2),
    (None, None, 2, 2, 1), (None, None, 16, 1, 4)])
def test_a_local_cluster_puts_as_many_workers_on_a_gpu_as_memory_and_cores_allow(
        monkeypatch, memory_gb, host_gb, cores, gpus, per_gpu):
    """Up to four workers a GPU (their kernels run while another's host works): each needs 10 GiB of
    the smallest GPU used, 8 GiB of half the host's available memory and a core; at least one."""
    asked = []
    monkeypatch.setattr(cluster, "gpu_memory_bytes",
                        lambda count: asked.append(count) or (None if memory_gb is None else memory_gb * 10**9))
    monkeypatch.setattr(cluster, "_available_memory_bytes", lambda: None if host_gb is None else host_gb * 10**9)
    monkeypatch.setattr(cluster, "_usable_cores", lambda: cores)
    assert cluster.workers_per_gpu([str(i) for i in range(gpus)]) == per_gpu
    assert asked == [gpus]  # (the GPUs the workers go to, not every one the machine has)


def test_local_takes_a_worker_per_visible_gpu_only_for_heads_checked_on_a_gpu(monkeypatch):
    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["2", "5", "7"])
    for where, jobs, gpus in (("cuda", 0, ["2", "5", "7"]), ("cuda", 2, ["2", "5"]), ("cpu", 0, []), (None, 0, [])):
        monkeypatch.setattr(cluster, "target", lambda: where)
        assert cluster.local_gpus(jobs) == gpus, (where, jobs)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["numpy", "gpus"])
def test_local_starts_its_cluster_for_the_device_the_heads_are_checked_on(binary, tmp_path, monkeypatch, on_gpu):
    """check --scheduler local on a host of (here pretended) GPUs: where check_run checks the heads
    on a GPU, the cluster it starts has workers_per_gpu workers a GPU, each seeing its own, and the
    tasks ask for one each; elsewhere a worker a core (--jobs). Either way the report is a local check's."""
    _distributed()
    tmp = _binary_run(tmp_path, binary)
    started, seen = [], []
    real = cluster.local_cluster

    def recorded(workers, gpus=()):
        started.append((workers, list(gpus)))
        return real(workers, gpus)

    real_route = cluster.DaskRoute.map

    def seen_workers(route, *args):
        client, _ = route.connect()
        seen.append(sorted(client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", "all")).values()))
        return real_route(route, *args)

    monkeypatch.setattr(cluster, "local_cluster", recorded)
    monkeypatch.setattr(cluster.DaskRoute, "map", seen_workers)
    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(cluster, "workers_per_gpu", lambda gpus: 2)
    if on_gpu:  # (the workers themselves check on NumPy: this machine has no GPU)
        monkeypatch.setattr(cluster, "target", lambda: "cuda")
    with _pretended_gpus():
        here, there = _checks(tmp_path, tmp / "in", tmp / "out", ["--scheduler", "local", "--jobs", 2])
    assert started == ([(2, ["0", "1"])] if on_gpu else [(2, [])])
    per_gpu = 2
    assert seen == ([["0"] * per_gpu + ["1"] * per_gpu] if on_gpu else [["all", "all"]])
    assert here[0] == 0 and there == here, there[1]


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
def test_a_worker_checks_on_the_device_its_check_run_chose(binary, tmp_path, device):
    """--device reaches the workers: a task runs on the device the worker's own check_run chose (the
    device the check's block left would otherwise be NumPy's). "torch-cpu" is PyTorch's float64 on
    the CPU, the GPU path's code, as the tests of the device references run it."""
    r = invoke("generate", "--out", tmp_path / "in", "--heads", 2, "--seq-q", 40, "--seq-k", 56, "--d-k", 16,
               "--d-v", 16, "--backward")
    assert r.exit_code == 0, r.output
    subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu",
                    "--stages", "flash"], check=True, capture_output=True)
    recipe = cluster.Recipe(str(tmp_path / "in"), str(tmp_path / "out"), Options(device=device), diagnose, device)
    try:
        if device == "torch-cpu":
            pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'attnstep[gpu]')")
            pytest.importorskip("array_api_compat", reason="array-api-compat is not installed")
        check, chosen = cluster._checker(recipe)
        assert chosen == device
        frozen = gc.get_freeze_count()
        # What the worker held once the run was open (its libraries too) is out of the garbage
        # collector's walks for the check's heads, as in attnstep's own process.
        assert frozen > 1000  # (the interpreter's objects, the libraries' and the run's)
        seen = []
        real = cluster.on_device
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cluster, "on_device", lambda d: (seen.append(d), real(d))[1])
            results = cluster.check_job(recipe, 0)
        assert seen == [device] and all(res.passed for res in results)
    finally:
        cluster.forget_check(device)
    assert gc.get_freeze_count() < frozen // 10  # let go with the run


def test_a_local_cluster_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """Dask's scratch space (the workers' folders, its locks) lies in a folder of the cluster's own,
    removed when it closes: nothing outside the output folder is left behind."""
    distributed = _distributed()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with cluster.local_cluster(2) as c, distributed.Client(c) as client:
        assert client.submit(lambda: 1).result() == 1
        assert [p.name.startswith("attnstep-dask-") for p in tmp_path.iterdir()] == [True]
    assert list(tmp_path.iterdir()) == []

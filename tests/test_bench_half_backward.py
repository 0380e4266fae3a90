"""`attnstep bench` of the backward at bf16/fp16: SDPA's backward timed once per backend (a fake
binary's JSON and fake SDPA timings, no torch), the flash backward's ratio to the fastest and to
each, the goal against cuDNN's backward, the JSON keys, a backend's refusal with its reason, a run
without torch, the plot's rows; and (gpu) a real run against PyTorch's backward."""
from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from verify.bench import measure as vb
from verify.bench import sdpa as bench_sdpa
from verify.bench.goals import goal_records
from verify.bench.plot import _plotted
from verify.bench.report import (FLASH_BACKWARD, SDPA, SDPA_BACKENDS, SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS,
                                 STAGE_PATH_BACKWARD, VS_SDPA, sdpa_backend_row)
from verify.bench.sdpa import SDPA_BACKENDS as BACKEND_NAMES
from verify.cli import bench as cb
from verify.stages import HALF_PRECISIONS

CUDNN, FLASH, EFFICIENT = BACKEND_NAMES
GOAL_SHAPES = [(d, causal) for d in (64, 128) for causal in (False, True)]
REFUSED = "unsupported: Memory efficient attention requires attn_mask to be None for this dtype"
CUDNN_REFUSED = "unsupported: cuDNN attention requires compute capability 8.0 or newer"


def _binary(precision="bf16", d=64, causal=False, bwd_tflops=330.0, only_backward=True):
    """What `main --bench --pass backward` writes at bf16/fp16 on Hopper: the stage path's whole-pass
    row marked, the flash backward timed and checked (the forward's flash row first with both)."""
    bwd = {"name": FLASH_BACKWARD, "kind": "attention", "pass": "backward", "status": "ok", "ms": 2.0,
           "tflops": bwd_tflops, "tiles": f"64x128, cuda-bwd-wgmma-{precision}",
           "check": {"passed": True, "max_rel_err": 4e-3, "max_dq_err": 4e-3, "max_dk_err": 3e-3, "max_dv_err": 2e-3}}
    path = {"name": STAGE_PATH_BACKWARD, "kind": "attention", "pass": "backward", "status": "unsupported",
            "reason": f"the backward stage path is timed at fp32 and tf32 only, not {precision}"}
    fwd = {"name": "flash", "kind": "attention", "pass": "forward", "status": "ok", "ms": 1.0, "tflops": 500.0}
    shape = {"batch": 4, "heads": 16, "seq_q": 4096, "seq_k": 4096, "d": d, "causal": causal, "scale": d ** -0.5}
    return {"device": "NVIDIA H100", "shape": shape, "precision": precision, "seed": 1234, "ceilings": {},
            "passed": True, "kernels": ([] if only_backward else [fwd]) + [path, bwd]}


def _backends(cudnn=300.0, flash=250.0, efficient=REFUSED):
    ok = {"status": "ok", "ms": 1.0, "torch": "2.11", "dtype": "bf16"}
    out = {CUDNN: {**ok, "tflops": cudnn} if cudnn else {"status": CUDNN_REFUSED}, FLASH: {**ok, "tflops": flash}}
    out[EFFICIENT] = {"status": efficient}
    return out


def _fake_machine(monkeypatch, backends=_backends, torch="2.11", **binary):
    """The binary answers _binary; SDPA's per-backend timers record (precision, pass); the fp32
    timers must not run at bf16/fp16."""
    seen = []

    def fake_run(binary_path, shape, prec, warmup, reps, check, only="all", timeout=0, monitor=None, passes="both",
                 ceilings=True):
        return _binary(prec, shape.d, shape.causal, only_backward=passes == "backward", **binary)

    def timed(shape, prec, warmup, reps, pass_="forward"):
        seen.append((prec, pass_))
        return backends()

    def fp32_timer(*a):
        raise AssertionError("at bf16/fp16 SDPA is timed per backend")

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    monkeypatch.setattr(vb, "torch_available", lambda: torch)
    monkeypatch.setattr(vb, "time_sdpa_backends", timed)
    for pass_ in ("forward", "backward"):
        monkeypatch.setitem(vb._SDPA_TIMERS, pass_, (vb._SDPA_TIMERS[pass_][0], fp32_timer))
    return seen


def _collect(passes="backward", precisions=("bf16",), use_torch=True, d=64, causal=False):
    return vb.collect(Path("main"), [vb.Shape(4, 16, 4096, 4096, d, causal)], precisions, 0, 1, False,
                      use_torch=use_torch, only="all", log=lambda m: None, passes=passes)


def _results(run_list):
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H100", "date": "2026-11-27T00:00:00Z",
            "torch": "2.11", "runs": run_list}


def _rows(**kw):
    return {r.kernel: r for r in vb.rows_from_results(_results(_collect(**kw)["runs"]))}


# ---- collect -------------------------------------------------------------------------------------
def test_the_half_backward_times_sdpa_backward_per_backend(monkeypatch):
    seen = _fake_machine(monkeypatch)
    run = _collect("backward", HALF_PRECISIONS)["runs"]
    assert seen == [(p, "backward") for p in HALF_PRECISIONS]
    for r in run:
        assert set(r) == {"binary", SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS, VS_SDPA}
        assert r[SDPA_BACKWARD]["backend"] == CUDNN and r[SDPA_BACKWARD]["tflops"] == 300.0
        assert r[SDPA_BACKWARD_BACKENDS][EFFICIENT] == {"status": REFUSED}  # the refusal, with torch's reason
        assert r[VS_SDPA] == {FLASH_BACKWARD: pytest.approx({CUDNN: 1.1, FLASH: 1.32, "fastest": 1.1})}
    json.dumps(run)  # JSON-ready


def test_both_passes_time_both_and_keep_each_pass_to_its_own(monkeypatch):
    seen = _fake_machine(monkeypatch)
    run = _collect("both")["runs"][0]
    assert seen == [("bf16", "forward"), ("bf16", "backward")]
    assert {SDPA, SDPA_BACKENDS, SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS, VS_SDPA} <= set(run)
    # The forward flash kernel against the forward's backends, the backward against the backward's.
    assert set(run[VS_SDPA]) == {"flash", FLASH_BACKWARD}
    assert run[VS_SDPA]["flash"]["fastest"] == pytest.approx(500 / 300)


def test_a_run_without_torch_still_reports_the_binary(monkeypatch):
    seen = _fake_machine(monkeypatch, torch=None)
    results = _collect("backward")
    assert seen == [] and set(results["runs"][0]) == {"binary"}
    rows = {r.kernel: r for r in vb.rows_from_results(results)}
    assert rows[FLASH_BACKWARD].rate == 330.0 and rows[FLASH_BACKWARD].vs_sdpa is None
    assert SDPA_BACKWARD not in rows and not vb.evaluate_goals(list(rows.values()))
    assert cb._exit_status(list(rows.values())) == 0


# ---- rows, goals, plot ---------------------------------------------------------------------------
def test_the_flash_backward_row_against_the_fastest_and_each_backend(monkeypatch):
    _fake_machine(monkeypatch)
    rows = _rows()
    bwd = rows[FLASH_BACKWARD]
    assert bwd.vs_sdpa == pytest.approx(1.1) and bwd.vs_backends == pytest.approx({CUDNN: 1.1, FLASH: 1.32})
    assert "vs sdpa_backward_cudnn 1.10x, sdpa_backward_flash 1.32x" in bwd.note
    assert "cuda-bwd-wgmma-bf16" in bwd.note and "err 4.0e-03" in bwd.note
    fastest = rows[SDPA_BACKWARD]
    assert fastest.rate == 300.0 and "sdpa_backward_cudnn (fastest)" in fastest.note and "bf16" in fastest.note
    assert rows[sdpa_backend_row(FLASH, SDPA_BACKWARD)].vs_sdpa == pytest.approx(250 / 300)
    refused = rows[sdpa_backend_row(EFFICIENT, SDPA_BACKWARD)]
    assert refused.status == REFUSED and refused.rate is None
    table = vb.format_table(list(rows.values()))
    assert f"{sdpa_backend_row(EFFICIENT, SDPA_BACKWARD)} " in table and REFUSED in table
    assert cb._exit_status(list(rows.values())) == 0  # a refusal is no failure


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("d, causal", GOAL_SHAPES)
def test_the_goal_is_cudnns_backward_at_each_goal_shape(monkeypatch, precision, d, causal):
    _fake_machine(monkeypatch)
    shape = f"B4-H16-N4096-M4096-d{d}" + ("-causal" if causal else "")
    rows = list(_rows(precisions=(precision,), d=d, causal=causal).values())
    assert [r["line"] for r in goal_records(rows)] == [
        f"met    {precision} flash_backward >= 1x SDPA's cuDNN backward at {shape}: 1.10x (330.0 TFLOP/s)"]


def test_the_goal_names_cudnn_not_the_fastest_and_can_be_missed(monkeypatch):
    # The flash backend fastest: the goal still compares with cuDNN's.
    _fake_machine(monkeypatch, backends=lambda: _backends(cudnn=300.0, flash=400.0))
    records = goal_records(list(_rows().values()))
    assert len(records) == 1 and records[0]["met"] and ": 1.10x" in records[0]["line"]
    _fake_machine(monkeypatch, bwd_tflops=270.0)
    records = goal_records(list(_rows().values()))
    assert len(records) == 1 and not records[0]["met"] and records[0]["line"].startswith("MISSED")


def test_no_cudnn_backward_leaves_the_goal_undecided_and_says_so(monkeypatch):
    _fake_machine(monkeypatch, backends=lambda: _backends(cudnn=None))
    rows = _rows()
    assert rows[FLASH_BACKWARD].vs_sdpa == pytest.approx(330 / 250)
    assert goal_records(list(rows.values())) == [
        {"line": "not measured bf16 flash_backward >= 1x SDPA's cuDNN backward at B4-H16-N4096-M4096-d64: "
                 "SDPA's cudnn backend did not run (its row says why)", "met": False}]
    assert rows[sdpa_backend_row(CUDNN, SDPA_BACKWARD)].status == CUDNN_REFUSED


def test_a_run_without_sdpa_leaves_the_cudnn_goal_unprinted(monkeypatch):
    _fake_machine(monkeypatch, backends=dict)
    assert goal_records(list(_rows().values())) == []


def test_the_plot_draws_the_fastest_backward_not_each_backend(monkeypatch):
    _fake_machine(monkeypatch)
    rows = list(_rows(passes="both").values())
    drawn = {r.kernel for r in _plotted(rows)}
    assert {FLASH_BACKWARD, SDPA_BACKWARD, "flash", SDPA} <= drawn
    backend_rows = {sdpa_backend_row(b, s) for b in BACKEND_NAMES for s in (SDPA, SDPA_BACKWARD)}
    assert not drawn & backend_rows and {sdpa_backend_row(CUDNN, SDPA_BACKWARD)} <= {r.kernel for r in rows}


# ---- the command line and the results file -------------------------------------------------------
def test_cli_writes_the_backward_backends_and_the_goal(tmp_path, monkeypatch):
    _fake_machine(monkeypatch)
    main, out = tmp_path / "main", tmp_path / "r.json"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--shape", "4,16,4096,4096,128,causal",
                                        "--precision", "half", "--pass", "backward", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [set(r[SDPA_BACKWARD_BACKENDS]) for r in data["runs"]] == [set(BACKEND_NAMES)] * 2
    assert [g["met"] for g in data["goals"]] == [True, True]
    assert "SDPA's cuDNN backward" in res.output and "sdpa_backward_efficient" in res.output
    again = CliRunner().invoke(cb.bench, ["--from-json", str(out)])
    assert again.exit_code == 0 and again.output.count("met    ") == 2, again.output


def test_from_json_names_a_malformed_backward_backend(tmp_path, monkeypatch):
    _fake_machine(monkeypatch)
    results = _results(_collect()["runs"])
    results["runs"][0][SDPA_BACKWARD_BACKENDS][CUDNN] = {"status": "ok", "ms": 1.0}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(results))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit), res.exception
    assert "runs[0].sdpa_backward_backends.cudnn: lacks a number 'tflops'" in res.output


# ---- timing one backend's backward ---------------------------------------------------------------
def _fake_torch(monkeypatch, forced: list):
    """Just enough of torch for sdpa._timed with a forced backend (no GPU, no real kernels)."""
    torch = types.ModuleType("torch")
    torch.__version__ = "0.fake"
    matmul = types.SimpleNamespace(allow_tf32=False)
    torch.backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=matmul))

    class OutOfMemoryError(RuntimeError):
        pass

    torch.cuda = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, empty_cache=lambda: None,
                                       synchronize=lambda: None)
    nn, functional, attention = (types.ModuleType(n) for n in ("torch.nn", "torch.nn.functional", "torch.nn.attention"))
    attention.SDPBackend = types.SimpleNamespace(**{v: k for k, v in bench_sdpa.SDPA_BACKENDS.items()})

    class _Kernel:
        def __init__(self, member):
            forced.append(member)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    attention.sdpa_kernel = _Kernel
    torch.nn, nn.functional, nn.attention = nn, functional, attention
    for name, module in (("torch", torch), ("torch.nn", nn), ("torch.nn.functional", functional),
                         ("torch.nn.attention", attention)):
        monkeypatch.setitem(sys.modules, name, module)


def test_a_backend_refusing_the_backwards_forward_is_a_refusal_with_torchs_reason(monkeypatch):
    """The backward's forward runs in setup, under the forced backend: torch's "No available kernel"
    there is the backend's refusal (its reason kept), not a failure of the run."""
    forced = []
    _fake_torch(monkeypatch, forced)

    def setup(torch, F):
        warnings.warn("Flash attention kernel not used because:")
        warnings.warn("Flash attention requires the last dimension to be at most 256 (Triggered internally at x)")
        raise RuntimeError("No available kernel. Aborting execution.")

    out = bench_sdpa._timed(vb.Shape(1, 1, 8, 8, 512, False), "bf16", 1.0, setup, backend=FLASH)
    assert forced == [FLASH]
    assert out["status"] == "unsupported: Flash attention requires the last dimension to be at most 256", out


def test_each_backend_of_the_backward_is_forced_in_turn(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_sdpa, "time_sdpa_backward", lambda *a, backend=None: calls.append(("bwd", backend))
                        or {"status": "ok", "ms": 1.0, "tflops": 1.0})
    monkeypatch.setattr(bench_sdpa, "time_sdpa", lambda *a, backend=None: calls.append(("fwd", backend)))
    shape = vb.Shape(1, 1, 8, 8, 16, False)
    assert set(bench_sdpa.time_sdpa_backends(shape, "fp16", 0, 1, "backward")) == set(BACKEND_NAMES)
    assert calls == [("bwd", b) for b in BACKEND_NAMES]


# ---- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_gpu_half_backward_against_sdpa_backward(binary, tmp_path, precision):
    """`attnstep bench --pass backward --precision bf16|fp16`: each SDPA backend's backward timed or
    refused with a reason; where the binary has a flash backward, its ratio to each that ran."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cb.bench, ["--binary", str(binary), "--shape", "1,2,320,320,64,causal",
                                        "--precision", precision, "--pass", "backward", "--reps", "3",
                                        "--warmup", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())["runs"][0]
    statuses = [b["status"] for b in run[SDPA_BACKWARD_BACKENDS].values()]
    assert all(s == "ok" or s.startswith("unsupported: ") for s in statuses), statuses
    assert SDPA_BACKENDS not in run and SDPA not in run
    flash = {k["name"]: k for k in run["binary"]["kernels"]}[FLASH_BACKWARD]
    if flash["status"] == "ok" and "ok" in statuses:
        ran = {b for b, t in run[SDPA_BACKWARD_BACKENDS].items() if t["status"] == "ok"}
        assert set(run[VS_SDPA][FLASH_BACKWARD]) == ran | {"fastest"}

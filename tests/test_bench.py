"""`attnstep bench` (verify/bench/measure.py, its command verify/cli/bench.py): parsing, table, goals
and plot from canned results, forward and backward; the binary's --bench options on the CPU build;
and (gpu) tiny real runs whose float64 checks must pass."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from verify.bench import measure as vb
from verify.cli import bench as cb

SHAPE = {"batch": 4, "heads": 16, "seq_q": 4096, "seq_k": 4096, "d": 64, "causal": False, "scale": 0.125}


def _binary_json(precision="fp32", flash_tflops=60.0, check_passed=True, err=2e-7):
    """What `main --bench --json` writes, trimmed to one shape."""
    def k(name, kind, ms, rate, fraction, **extra):
        key = "gbps" if kind == "memory" else "tflops"
        return {"name": name, "kind": kind, "status": "ok", "ms": ms, key: rate, "fraction": fraction, **extra}

    return {
        "tool": "attnstep bench", "format": 1, "device": "NVIDIA H200", "sm_count": 132,
        "shape": dict(SHAPE), "precision": precision, "warmup": 3, "reps": 20,
        "ceilings": {"sgemm_ms": 1.0, "sgemm_tflops": 50.0, "copy_ms": 0.5, "copy_gbps": 4000.0,
                     "mma_tf32_tflops": 140.0, "mma_bf16_tflops": 560.0},
        "passed": check_passed,
        "kernels": [
            k("KT", "memory", 0.05, 3500.0, 0.875),
            k("QK", "gemm", 1.0, 45.0, 0.9),
            k("QK_scaled", "memory", 1.2, 3000.0, 0.75),
            {"name": "attention_weights", "kind": "memory", "status": "skipped (memory)"},
            k("output", "gemm", 1.1, 40.0, 0.8),
            k("flash", "attention", 4.6, flash_tflops, 1.2, tiles="128x64",
              check={"passed": check_passed, "max_rel_err": err, "max_lse_err": 1e-7}),
            k("flash_fast", "attention", 20.0, 14.0, 0.28, tiles="64x64, splits 1",
              check={"passed": True, "max_rel_err": err, "max_lse_err": 1e-7}),
            k("flash_wgmma", "attention", 4.6, flash_tflops, 1.2, tiles="128x64, splits 1",
              check={"passed": check_passed, "max_rel_err": err, "max_lse_err": 1e-7}),
        ],
    }


def _results(**kw):
    runs = [{"binary": _binary_json("fp32", **kw), "sdpa": {"status": "ok", "ms": 7.9, "tflops": 35.0, "torch": "2.11"}},
            {"binary": _binary_json("tf32", flash_tflops=160.0),
             "sdpa": {"status": "ok", "ms": 7.9, "tflops": 35.0, "torch": "2.11"}}]
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H200", "date": "2026-11-22T04:00:00Z",
            "torch": "2.11", "runs": runs}


def test_default_shape_list():
    shapes = vb.default_shapes()
    assert len(shapes) == 13
    big = {(s.seq_q, s.d, s.causal) for s in shapes[1:]}
    assert big == {(n, d, c) for n in (1024, 4096, 16384) for d in (64, 128) for c in (False, True)}
    assert all((s.batch, s.heads, s.seq_q) == (4, 16, s.seq_k) for s in shapes[1:])


def test_shape_id_flops_and_parse():
    s = cb.parse_shape("4,16,4096,4096,64,causal")
    assert s.id == "B4-H16-N4096-M4096-d64-causal"
    assert s.flash_flop == 4 * 4 * 16 * 64 * (4096 * 4097 // 2)  # the visible entries: N(N+1)/2 of a causal head
    assert vb.parse_shape_id(s.id) == s
    with pytest.raises(Exception, match="B,H,N,M,D"):
        cb.parse_shape("4,16,0,4096,64")


def test_binary_args_carry_every_setting(tmp_path):
    args = vb.binary_args(vb.Shape(1, 2, 3, 4, 16, True), "tf32", 1, 5, tmp_path / "x.json", True, "flash")
    joined = " ".join(args)
    for part in ("--bench", "--batch 1", "--heads 2", "--seq-q 3", "--seq-k 4", "--d 16",
                 "--precision tf32", "--warmup 1", "--reps 5", "--only flash", "--causal", "--check",
                 "--pass both"):
        assert part in joined
    assert "--no-ceilings" not in joined
    args = vb.binary_args(vb.Shape(1, 2, 3, 4, 16, True), "fp32", 1, 5, tmp_path / "x.json", False, "all",
                          "backward", ceilings=False)
    assert "--pass backward" in " ".join(args) and "--no-ceilings" in args


def test_reps_shrink_only_for_large_work():
    assert vb.reps_for(vb.Shape(1, 12, 128, 128, 64, False), 20) == 20
    assert vb.reps_for(vb.Shape(4, 16, 16384, 16384, 128, False), 20) == 5


def test_parse_rejects_missing_fields():
    data = _binary_json()
    del data["ceilings"]
    with pytest.raises(vb.BenchError, match="ceilings"):
        vb.parse_binary_json(data, "x")
    data = _binary_json()
    del data["kernels"][1]["tflops"]
    with pytest.raises(vb.BenchError, match="QK"):
        vb.parse_binary_json(data, "x")


def test_rows_table_and_ratios():
    rows = vb.rows_from_results(_results())
    ff = [r for r in rows if r.kernel == "flash_wgmma" and r.precision == "fp32"][0]
    assert ff.vs_sdpa == pytest.approx(60.0 / 35.0)
    assert "err 2.0e-07" in ff.note
    table = vb.format_table(rows)
    assert "skipped (memory)" in table
    assert "1.71x" in table and "60.00 TFLOP/s" in table and "3500 GB/s" in table


def test_goals_report_met_and_missed():
    lines = vb.evaluate_goals(vb.rows_from_results(_results()))
    text = "\n".join(lines)
    assert "met    fp32 flash >= 1.5x SDPA" in text
    assert "met    tf32 flash >= 150 TFLOP/s" in text
    assert "MISSED QK_scaled >= 80% of copy bandwidth" in text  # 75 %
    assert "met    QK >= 90% of cuBLAS SGEMM" in text
    slow = vb.evaluate_goals(vb.rows_from_results(_results(flash_tflops=40.0)))
    assert any(line.startswith("MISSED fp32 flash ") for line in slow)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    vb.write_plot(vb.rows_from_results(_results()), path, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_from_json(tmp_path):
    src = tmp_path / "results.json"
    src.write_text(json.dumps(_results()))
    png = tmp_path / "p.png"
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "NVIDIA H200" in res.output and "goals:" in res.output
    assert ("ceilings (fp32, B4-H16-N4096-M4096-d64): cuBLAS SGEMM 50.0 TFLOP/s, copy 4000 GB/s, "
            "mma.sync TF32 140 TFLOP/s, mma.sync BF16 560 TFLOP/s") in res.output
    assert png.exists()


def test_cli_failed_check_exits_1(tmp_path):
    src = tmp_path / "results.json"
    src.write_text(json.dumps(_results(check_passed=False, err=0.3)))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code == 1
    assert "FAIL" in res.output


def test_failed_shape_keeps_the_others(tmp_path):
    results = _results()
    results["runs"].append({"shape": "B4-H16-N16384-M16384-d128", "precision": "fp32",
                            "error": "main --bench exited 1: out of memory"})
    rows = vb.rows_from_results(results)
    assert rows[-1].status.startswith("failed: main --bench exited 1") and rows[-1].n == 16384
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(src)])
    assert res.exit_code == 1
    assert "60.00 TFLOP/s" in res.output and "failed on 1 shape" in res.output


def test_collect_goes_on_after_a_failing_shape(tmp_path, monkeypatch):
    """A shape whose binary run fails is recorded and the sweep continues."""
    calls = []

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, **kw):
        calls.append(shape.id)
        if shape.seq_q == 7:
            raise vb.BenchError("boom")
        data = _binary_json(prec)
        data["shape"] = {**SHAPE, "seq_q": shape.seq_q, "seq_k": shape.seq_k}
        return data

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    shapes = [vb.Shape(1, 1, 7, 7, 64, False), vb.Shape(1, 1, 9, 9, 64, False)]
    res = vb.collect(Path("main"), shapes, ("fp32",), 0, 1, False, use_torch=False, only="all", log=lambda m: None)
    assert len(calls) == 2 and res["runs"][0]["error"] == "boom" and "binary" in res["runs"][1]
    assert res["device"] == "NVIDIA H200"


@pytest.mark.parametrize("refused_first", [True, False])
def test_a_shape_the_binary_refuses_is_unusable_only_before_any_measure(monkeypatch, refused_first):
    """Exit 2 (BenchUnusable) on the first shape: the binary cannot bench, the bench ends there;
    after a shape it measured, only that shape failed and the measured one is kept."""
    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, **kw):
        if (shape.seq_q == 7) == refused_first:
            raise vb.BenchUnusable("exited 2: refused")
        return _binary_json(prec)

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    shapes = [vb.Shape(1, 1, 7, 7, 64, False), vb.Shape(1, 1, 9, 9, 64, False)]
    collect = lambda: vb.collect(Path("main"), shapes, ("fp32",), 0, 1, False, use_torch=False, only="all",
                                 log=lambda m: None)
    if refused_first:
        with pytest.raises(vb.BenchUnusable):
            collect()
    else:
        res = collect()
        assert "binary" in res["runs"][0] and res["runs"][1]["error"] == "exited 2: refused"


def test_cli_bad_results_file_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"binary": {"device": "x"}}]}))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(bad)])
    assert res.exit_code == 2
    assert "shape" in res.output
    res = CliRunner().invoke(cb.bench, ["--shape", "1,2,3"])
    assert res.exit_code == 2


def test_binary_bench_rejects_bad_options(binary):
    """Bad --bench options are exit 2 with one line naming the option (a CPU-only build refuses
    --bench itself, also with exit 2)."""
    stub = subprocess.run([str(binary), "--bench"], capture_output=True, text=True, timeout=60)
    if "needs a CUDA build" in stub.stderr:
        assert stub.returncode == 2
        pytest.skip("a CPU-only build: --bench is refused before its options are read")
    for args, what in ((["--precision", "fp64"], "--precision"), (["--d", "0"], "--d"),
                       (["--bogus"], "--bogus"), (["--reps"], "--reps"), (["--pass", "sideways"], "--pass"),
                       (["--pass"], "--pass")):
        proc = subprocess.run([str(binary), "--bench", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert what in proc.stderr.splitlines()[0]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_bench_tiny_shape_checks(binary, tmp_path, precision, causal):
    """A real run on a tiny irregular shape: every kernel timed, every flash row checked (all rows)."""
    shape = vb.Shape(1, 3, 127, 333, 64, causal)
    data = vb.run_binary_bench(binary, shape, precision, warmup=1, reps=3, check=True)
    assert data["passed"] is True
    names = {k["name"]: k for k in data["kernels"]}
    flash = {"flash", "flash_fast", "flash_wgmma"}
    assert set(names) >= {"KT", "QK", "QK_scaled", "attention_weights", "output"} | flash
    for k in names.values():
        assert k["status"] == "ok" and k["ms"] > 0
    tol = 1e-4 if precision == "fp32" else 5e-3
    for name in flash:
        assert names[name]["check"]["passed"] is True, name
        assert names[name]["check"]["max_rel_err"] < tol, name
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["sgemm_tflops"] > 0


def test_cli_checks_output_paths_before_running(tmp_path):
    res = CliRunner().invoke(cb.bench, ["--shape", "1,1,8,8,16", "--json", str(tmp_path / "no" / "x.json"),
                                        "--build-dir", str(tmp_path / "never-built")])
    assert res.exit_code == 2 and f"--json {tmp_path / 'no' / 'x.json'}: cannot write: folder" in res.output
    same = tmp_path / "r.json"
    res = CliRunner().invoke(cb.bench, ["--shape", "1,1,8,8,16", "--json", str(same), "--plot", str(same),
                                        "--build-dir", str(tmp_path / "never-built")])
    assert res.exit_code == 2 and f"--json {same}: is also the --plot file" in res.output, res.output
    assert not (tmp_path / "never-built").exists()


def test_goal_table_names_known_kernels_metrics_and_fields():
    from verify.bench.goals import COMPARISONS, GOALS, METRICS
    from verify.bench.report import FLASH_BACKWARD, FLASH_KERNELS
    from verify.stages import PRECISIONS, STAGE_NAMES

    shape_fields = set(vb.Shape.__dataclass_fields__)
    for goal in GOALS:
        assert goal.kernel in FLASH_KERNELS + (FLASH_BACKWARD,) + STAGE_NAMES, goal
        assert goal.precision in PRECISIONS and goal.metric in METRICS and goal.comparison in COMPARISONS, goal
        assert set(goal.shape) <= shape_fields, goal


def test_goals_are_records_decided_by_one_function():
    """A goal of any kernel, shape, metric and comparison needs a record, not code."""
    from verify.bench.goals import Goal

    rows = vb.rows_from_results(_results())
    at_most = Goal("flash_fast", {"d": 64, "causal": False}, "fp32", "tflops", 10.0, "<=")
    elsewhere = Goal("flash_fast", {"d": 128}, "fp32", "tflops", 10.0)
    assert vb.evaluate_goals(rows, [at_most, elsewhere]) == [
        "MISSED fp32 flash_fast <= 10 TFLOP/s at B4-H16-N4096-M4096-d64: 14.0 TFLOP/s"]


def test_cli_timeout_reaches_every_run(tmp_path, monkeypatch):
    seen = []

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, **kw):
        seen.append(timeout)
        data = _binary_json(prec)
        data["shape"] = {**SHAPE, "seq_q": shape.seq_q, "seq_k": shape.seq_k}
        return data

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    main = tmp_path / "main"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--shape", "1,1,8,8,16", "--no-torch",
                                        "--timeout", "5"])
    assert res.exit_code == 0, res.output
    assert seen == [5.0, 5.0]
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--timeout", "0"])
    assert res.exit_code == 2 and "--timeout" in res.output


def test_cli_build_failure_shows_the_build_output(tmp_path, monkeypatch):
    from verify.runs.runner import RunnerError

    def failing_build(build_dir):
        raise RunnerError("build failed: cmake --build exited 1", detail="main.cu:3: error: bad thing")

    monkeypatch.setattr(cb, "ensure_built", failing_build)
    res = CliRunner().invoke(cb.bench, ["--shape", "1,1,8,8,16", "--build-dir", str(tmp_path / "b")])
    assert res.exit_code == 2
    assert "build failed: cmake --build exited 1" in res.output and "main.cu:3: error: bad thing" in res.output


def test_the_binarys_bench_help_lists_every_option_it_parses(binary):
    """`main --bench --help` names each option bench_options.cu accepts (read from its source), and
    an unknown option points to it."""
    source = (Path(__file__).resolve().parents[1] / "cuda_src" / "bench" / "bench_options.cu").read_text()
    parsed = set(re.findall(r'a == "(--[a-z-]+)"', source)) - {"--bench", "--help"}
    res = subprocess.run([str(binary), "--bench", "--help"], capture_output=True, text=True, timeout=60)
    if res.returncode == 2 and "CUDA build" in res.stderr:
        pytest.skip("a CPU-only build has no --bench")
    assert res.returncode == 0, res.stderr
    assert parsed and all(opt in res.stdout for opt in parsed), sorted(o for o in parsed if o not in res.stdout)
    bad = subprocess.run([str(binary), "--bench", "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "main --bench --help" in bad.stderr


def _edited(path: Path, edit) -> dict:
    data = json.loads(path.read_text())
    edit(data)
    return data


@pytest.mark.parametrize("source, edit, words", [
    ("bench_h100.json", lambda d: d["runs"].__setitem__(0, None), "not a results file as attnstep bench writes it"),
    ("bench_h100.json", lambda d: d["runs"][0]["binary"]["shape"].__setitem__("seq_q", None),
     "not a results file as attnstep bench writes it"),
    ("bench_h100.json", lambda d: d["runs"][0]["binary"]["kernels"][0].__setitem__("fraction", "x"),
     "not a results file as attnstep bench writes it"),
    ("bench_h100_decode.json", lambda d: d["runs"][0]["binary"].pop("kernel_ms"),
     "not a results file as attnstep bench writes it"),
    ("bench_h100.json", lambda d: d.__setitem__("format", 99), "results format 99, where this attnstep reads 1"),
], ids=["run-null", "seq-null", "fraction-text", "decode-no-kernel-ms", "format-99"])
def test_a_results_file_edited_by_hand_is_one_line(tmp_path, source, edit, words):
    """--from-json on a results file changed by hand: one line naming the file, exit 2, no traceback."""
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(_edited(Path(__file__).resolve().parents[1] / "docs" / source, edit)))
    res = CliRunner().invoke(cb.bench, ["--from-json", str(edited)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith(f"Error: {edited}: ") and words in last, last


def test_a_plot_over_the_results_file_it_reads_is_refused(tmp_path):
    results = tmp_path / "r.json"
    results.write_text((Path(__file__).resolve().parents[1] / "docs" / "bench_h100.json").read_text())
    res = CliRunner().invoke(cb.bench, ["--from-json", str(results), "--plot", str(results)])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        f"Error: --plot {results}: is the --from-json file; HINT: give the plot its own file"], res.output
    assert json.loads(results.read_text())["runs"]

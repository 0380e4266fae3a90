"""The decode bench's Python side, without a GPU (`attnstep bench --decode goals`,
verify/bench/decode_goals.py): the binary's arguments and JSON, the goals from a binary's result
and SDPA's timings (met, missed, not run), the table, the results file and its re-printing, and the
command with a stand-in binary (a script that writes the JSON the decode bench writes)."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from verify.bench.decode_goals import (COPY_FRACTION_GOAL, DECODE_SHAPES, DecodeShape, collect_decode,
                                       decode_binary_args, decode_goal_records, decode_table, parse_decode_json)
from verify.bench.measure import BenchUnusable
from verify.bench.report import BenchError
from verify.cli.group import cli

SHAPE = DecodeShape(64, 32, 8, 8192, 64, 128)


def binary_result(shape: DecodeShape = SHAPE, kernel_gbps: float = 2600.0, copy_gbps: float = 3000.0) -> dict:
    """What main --bench-decode writes for `shape`: kernel and copy of the same K/V bytes."""
    kv = shape.kv_bytes
    return {"device": "NVIDIA H100 80GB HBM3", "batch": shape.batch, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "cache_len": shape.cache_len, "page_size": shape.page_size, "d": shape.d,
            "precision": shape.precision, "queries": shape.queries, "splits": 16,
            "kernel_ms": kv / kernel_gbps / 1e6, "kv_bytes": kv, "kernel_gbps": kernel_gbps,
            "copy_ms": kv / copy_gbps / 1e6, "copy_gbps": copy_gbps, "fraction_of_copy": kernel_gbps / copy_gbps}


def sdpa_runs(ms: float, **others) -> dict:
    runs = {"auto": {"status": "ok", "ms": ms}, "cudnn": {"status": "unsupported: no GQA"},
            "flash": {"status": "ok", "ms": ms * 1.2}, "efficient": {"status": "ok", "ms": ms * 3}}
    runs.update(others)
    return runs


def test_the_goal_shapes_and_the_binary_arguments():
    assert [s.cache_len for s in DECODE_SHAPES] == [8192, 32768]
    assert {(s.batch, s.heads, s.kv_heads, s.d, s.page_size, s.precision, s.queries) for s in DECODE_SHAPES} == \
        {(64, 32, 8, 128, 64, "bf16", 1)}
    assert SHAPE.kv_bytes == 2 * 64 * 8 * 8192 * 128 * 2  # K and V, bf16
    args = decode_binary_args(SHAPE, 20, Path("out.json"))
    assert args[:1] == ["--bench-decode"]
    pairs = dict(zip(args[1::2], args[2::2]))
    assert pairs == {"--batch": "64", "--heads": "32", "--kv-heads": "8", "--cache-len": "8192", "--page-size": "64",
                     "--d": "128", "--precision": "bf16", "--queries": "1", "--reps": "20", "--json": "out.json"}


def test_both_goals_met():
    kernel = binary_result(kernel_gbps=2700.0, copy_gbps=3000.0)
    records = decode_goal_records({"shape": SHAPE.id, "binary": kernel, "sdpa": sdpa_runs(kernel["kernel_ms"] * 1.5)})
    assert [r["met"] for r in records] == [True, True]
    assert records[0]["value"] == pytest.approx(0.9) and records[1]["value"] == pytest.approx(1 / 1.5)
    assert records[0]["line"].startswith("met") and "2700 GB/s vs copy 3000 GB/s" in records[0]["line"]
    assert "SDPA auto" in records[1]["line"]  # the fastest that ran


def test_goals_missed_below_the_copy_fraction_and_slower_than_sdpa():
    kernel = binary_result(kernel_gbps=0.7 * 3000.0, copy_gbps=3000.0)
    faster = sdpa_runs(kernel["kernel_ms"] * 2, flash={"status": "ok", "ms": kernel["kernel_ms"] * 0.9})
    records = decode_goal_records({"shape": SHAPE.id, "binary": kernel, "sdpa": faster})
    assert [r["met"] for r in records] == [False, False]
    assert records[0]["value"] == pytest.approx(0.7) and records[0]["value"] < COPY_FRACTION_GOAL
    assert records[1]["value"] == pytest.approx(1 / 0.9) and "SDPA flash" in records[1]["line"]
    assert all(r["line"].startswith("MISSED") for r in records)


def test_a_goal_without_its_measure_is_missed_saying_why():
    no_sdpa = decode_goal_records({"shape": SHAPE.id, "binary": binary_result()})
    assert no_sdpa[0]["met"] and not no_sdpa[1]["met"] and no_sdpa[1]["value"] is None
    assert "SDPA did not run" in no_sdpa[1]["line"]
    refused = decode_goal_records({"shape": SHAPE.id, "binary": binary_result(),
                                   "sdpa": {"auto": {"status": "OOM"}}})
    assert not refused[1]["met"]
    failed = decode_goal_records({"shape": SHAPE.id, "error": "main --bench-decode exited 2: no GPU",
                                  "sdpa": sdpa_runs(1.0)})
    assert not any(r["met"] for r in failed) and all("exited 2: no GPU" in r["line"] for r in failed)


def test_collect_writes_each_shape_and_its_goals_and_goes_on_after_a_failure():
    def run_binary(binary, shape, reps, timeout):
        if shape.cache_len == 32768:
            raise BenchError(f"{shape.id}: main --bench-decode exited 3: out of memory")
        return binary_result(shape)

    def timer(shape, warmup, reps, backend):
        return {"status": "ok", "ms": 1.0 if backend is None else 2.0}

    results = collect_decode(Path("main"), DECODE_SHAPES, 3, 20, True, log=lambda m: None, run_binary=run_binary,
                             sdpa_timer=timer, torch_version="2.x")
    assert results["device"] == "NVIDIA H100 80GB HBM3" and results["torch"] == "2.x"
    first, second = results["runs"]
    assert set(first["sdpa"]) == {"auto", "cudnn", "flash", "efficient"} and "error" not in first
    assert "out of memory" in second["error"] and "binary" not in second
    assert len(results["goals"]) == 4 and not any(g["met"] for g in results["goals"][2:])
    lines = decode_table(results)
    assert lines[0].split()[:3] == ["cache", "splits", "kernel"]
    assert lines[2].split()[0] == "8192" and lines[3].split()[:2] == ["32768", "-"]
    assert lines[-5] == "goals:"
    json.dumps(results)  # JSON-ready


FAKE_BINARY = '''#!{python}
"""A stand-in for main --bench-decode: writes the JSON the decode bench writes, or fails."""
import json, sys
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
if {fail} and args["--cache-len"] in {failing!r}:
    print("main: error: " + ("no CUDA device" if {fail} == 2 else "CUDA error: an illegal memory access"),
          file=sys.stderr)
    sys.exit({fail})
b, hk, l, d = (int(args[k]) for k in ("--batch", "--kv-heads", "--cache-len", "--d"))
kv = 2 * b * hk * l * d * 2
result = {{"device": "stand-in GPU", "batch": b, "heads": int(args["--heads"]), "kv_heads": hk, "cache_len": l,
          "page_size": int(args["--page-size"]), "d": d, "precision": args["--precision"],
          "queries": int(args["--queries"]), "splits": 8, "kernel_ms": kv / 2.5e12 * 1e3, "kv_bytes": kv,
          "kernel_gbps": 2500.0, "copy_ms": kv / 3e12 * 1e3, "copy_gbps": 3000.0, "fraction_of_copy": 2500 / 3000}}
open(args["--json"], "w").write(json.dumps(result))
'''


def _fake_binary(tmp_path: Path, fail: int = 0, failing=("32768",)) -> Path:
    """fail: the exit status of the shapes whose cache length is in `failing` (0: none fails)."""
    path = tmp_path / "main"
    path.write_text(FAKE_BINARY.format(python=sys.executable, fail=fail, failing=tuple(failing)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_command_runs_the_binary_prints_the_table_and_writes_the_json(tmp_path):
    out = tmp_path / "decode.json"
    r = CliRunner().invoke(cli, ["bench", "--decode", "goals", "--binary", str(_fake_binary(tmp_path)), "--no-torch",
                                 "--reps", "5", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "device: stand-in GPU" in r.output and "torch: not timed" in r.output
    assert "met    decode GB/s of the copy (>= 0.80) at B64 H32 Hk8 L8192 P64 d128 bf16: 0.833x" in r.output
    assert "MISSED decode time vs SDPA (<= 1.00) at B64 H32 Hk8 L32768 P64 d128 bf16: SDPA did not run" in r.output
    saved = json.loads(out.read_text())
    assert [run["binary"]["cache_len"] for run in saved["runs"]] == [8192, 32768]
    assert [g["met"] for g in saved["goals"]] == [True, False, True, False]
    again = CliRunner().invoke(cli, ["bench", "--from-json", str(out)])

    def table(output: str):  # from the header on (the run's progress lines on stderr come before)
        lines = output.splitlines()
        return lines[next(i for i, ln in enumerate(lines) if ln.startswith("cache")):]

    assert again.exit_code == 0 and table(again.output) == table(r.output), again.output


def test_a_failing_binary_is_one_line_per_shape_and_exit_status_1(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "--decode", "goals", "--binary", str(_fake_binary(tmp_path, fail=1)),
                                 "--no-torch"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "exited 1: main: error: CUDA error: an illegal memory access" in r.output
    assert "main --bench-decode failed on 1 shape" in r.output


def test_a_binary_that_cannot_bench_at_all_is_one_line_and_exit_status_2(tmp_path):
    """The binary refuses --bench-decode itself (exit 2: no CUDA build or no GPU): no shape can run,
    so one line and exit 2, as bench without --decode, not a table of goals missed."""
    fake = _fake_binary(tmp_path, fail=2, failing=("8192", "32768"))
    r = CliRunner().invoke(cli, ["bench", "--decode", "goals", "--binary", str(fake), "--no-torch"])
    assert r.exit_code == 2 and "Traceback" not in r.output and "goals:" not in r.output, r.output
    assert r.output.strip().splitlines()[-1] == ("Error: B64 H32 Hk8 L8192 P64 d128 bf16: main --bench-decode "
                                                "exited 2: main: error: no CUDA device")


def test_a_shape_the_binary_refuses_after_one_it_measured_keeps_the_measured_one(tmp_path):
    """Exit 2 on the second shape only: that shape failed (exit 1), the first's row and goals stay."""
    out = tmp_path / "decode.json"
    fake = _fake_binary(tmp_path, fail=2, failing=("32768",))
    r = CliRunner().invoke(cli, ["bench", "--decode", "goals", "--binary", str(fake), "--no-torch", "--json", str(out)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "met    decode GB/s of the copy (>= 0.80) at B64 H32 Hk8 L8192 P64 d128 bf16: 0.833x" in r.output
    assert "main --bench-decode failed on 1 shape" in r.output
    first, second = json.loads(out.read_text())["runs"]
    assert first["binary"]["cache_len"] == 8192 and "exited 2: main: error: no CUDA device" in second["error"]


def test_a_binary_unusable_after_shapes_that_only_failed_is_unusable():
    """Exit 1 on the first shape, exit 2 on the second: nothing was measured, so the bench is
    unusable (one line, exit 2), not a table of failures."""
    def run_binary(binary, shape, reps, timeout):
        if shape.cache_len == 8192:
            raise BenchError(f"{shape.id}: main --bench-decode exited 1: CUDA error")
        raise BenchUnusable(f"{shape.id}: main --bench-decode exited 2: no CUDA device")

    with pytest.raises(BenchUnusable, match="no CUDA device"):
        collect_decode(Path("main"), DECODE_SHAPES, 3, 20, False, log=lambda m: None, run_binary=run_binary)


def test_options_the_decode_goals_would_ignore_are_refused(tmp_path):
    r = CliRunner().invoke(cli, ["bench", "--decode", "goals", "--shape", "1,1,64,64,64", "--binary",
                                 str(_fake_binary(tmp_path))])
    assert r.exit_code == 2 and "drop --shape" in r.output and "Traceback" not in r.output, r.output


def test_a_malformed_binary_json_names_the_key():
    data = binary_result()
    del data["copy_gbps"]
    with pytest.raises(BenchError, match="'copy_gbps' missing or not a number"):
        parse_decode_json(data, "main --bench-decode")
    with pytest.raises(BenchError, match="'splits' missing or not int"):
        parse_decode_json({**binary_result(), "splits": 1.5}, "main --bench-decode")

"""`main --bench` and `attnstep bench` with the attention variants: the bench's option parser and
FLOP count compiled from cuda_src/bench/bench_options.cu on the host (no CUDA needed) and checked
against brute-force counts of verify/variant.py's mask; shape ids with variants; the variants'
goals and their ratios from canned results; the preset's runs; the command's refusals; the
binary's --bench refusals; and (gpu) tiny checked runs of each variant."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from verify.bench import measure as vb
from verify.bench.goals import goal_records
from verify.bench.shape import Shape, parse_shape_id, shape_of_binary, visible_entries
from verify.bench.variant_goals import VARIANT_GOALS, preset_runs
from verify.cli import bench as cb
from verify.variant import BOTTOM_RIGHT, Variant

REPO = Path(__file__).resolve().parents[1]

# Prints what parse_options made of argv, or the error's line and exit status, as main() would.
_DRIVER = r"""
#include <cstdio>
#include "bench/bench_options.h"
#include "common.h"
using namespace attnstep;
int main(int argc, char** argv) {
    try {
        const bench::Options o = bench::parse_options(argc, argv);
        std::printf("{\"kv_heads\": %d, \"grouped\": %s, \"causal\": %s, \"align\": %d, \"left\": %lld, "
                    "\"right\": %lld, \"softcap\": %.9g, \"alibi\": %s, \"visible\": %.17g, \"flops\": %.17g, "
                    "\"text\": \"%s\"}\n",
                    o.kv_heads, bench::grouped(o) ? "true" : "false", o.variant.causal ? "true" : "false",
                    static_cast<int>(o.variant.align), o.variant.window_left, o.variant.window_right,
                    o.variant.softcap, o.variant.alibi ? "true" : "false", bench::visible_entries(o),
                    bench::attention_flops(o, o.batch * o.heads), bench::variant_text(o).c_str());
    } catch (const Error& e) {
        std::fprintf(stderr, "main: error: %s\n", e.what());
        return e.exit_code;
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def options_driver(tmp_path_factory) -> Path:
    """bench_options.cu compiled as C++ with a driver (and the rules of io/variant_manifest.cpp)."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("bench_options")
    driver, exe = tmp / "driver.cpp", tmp / "driver"
    driver.write_text(_DRIVER)
    src = REPO / "cuda_src"
    subprocess.run([cxx, "-std=c++17", "-O1", "-ffunction-sections", "-Wl,--gc-sections", "-I", str(src),
                    str(driver), "-x", "c++", str(src / "bench" / "bench_options.cu"), "-x", "none",
                    str(src / "io" / "variant_manifest.cpp"), "-o", str(exe)], check=True, timeout=300)
    return exe


def _parse(driver: Path, *args: str):
    proc = subprocess.run([str(driver), "--bench", *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


def _brute_force(n: int, m: int, variant: Variant) -> int:
    return int(variant.visible(n, m).sum())


# (options, N, M, the same variant in verify/variant.py): irregular sizes, both alignments, windows
# on either side, rows that see nothing (bottom-right with N > M).
_MASKS = [
    ([], 37, 53, Variant()),
    (["--causal"], 37, 53, Variant(causal=True)),
    (["--causal", "--align", BOTTOM_RIGHT], 37, 53, Variant(causal=True, align=BOTTOM_RIGHT)),
    (["--causal", "--align", BOTTOM_RIGHT], 53, 37, Variant(causal=True, align=BOTTOM_RIGHT)),
    (["--window", "5,3"], 37, 53, Variant(window=(5, 3))),
    (["--window", "-1,4"], 53, 37, Variant(window=(-1, 4))),
    (["--window", "7,-1", "--align", BOTTOM_RIGHT], 37, 53, Variant(window=(7, -1), align=BOTTOM_RIGHT)),
    (["--causal", "--window", "1024,0"], 2000, 2000, Variant(causal=True, window=(1024, 0))),
    (["--window", "0,0", "--align", BOTTOM_RIGHT], 53, 37, Variant(window=(0, 0), align=BOTTOM_RIGHT)),
    (["--window", "100000,100000"], 37, 53, Variant(window=(100000, 100000))),
]


@pytest.mark.parametrize("args,n,m,variant", _MASKS, ids=[" ".join(a) or "none" for a, *_ in _MASKS])
def test_flop_count_counts_the_visible_entries(options_driver, args, n, m, variant):
    """The binary's and Python's visible-entry counts equal a brute-force count of the mask, and the
    forward FLOPs are 4·d per visible entry of each query head (a grouped run's too)."""
    want = _brute_force(n, m, variant)
    rc, got = _parse(options_driver, "--batch", "2", "--heads", "6", "--kv-heads", "2", "--seq-q", str(n),
                     "--seq-k", str(m), "--d", "24", *args)
    assert rc == 0, got
    assert got["visible"] == want
    assert got["flops"] == 4 * 2 * 6 * 24 * want
    assert visible_entries(n, m, variant) == want
    shape = Shape(2, 6, n, m, 24, variant.causal, kv_heads=2, align=variant.align, window=variant.window)
    assert shape.flash_flop == 4 * 2 * 6 * 24 * want and shape.backward_flop == 2.5 * shape.flash_flop


def test_square_causal_counts_n_n_plus_1_over_2():
    assert Shape(4, 16, 4096, 4096, 64, True).flash_flop == 4 * 4 * 16 * 64 * 4096 * 4097 / 2
    assert Shape(1, 1, 8, 8, 16, False).flash_flop == 4 * 16 * 64


def test_options_parse_the_variant(options_driver):
    rc, o = _parse(options_driver, "--heads", "32", "--kv-heads", "8", "--causal", "--align", BOTTOM_RIGHT,
                   "--window", "1024,0", "--softcap", "50", "--alibi")
    assert rc == 0, o
    assert (o["kv_heads"], o["grouped"], o["causal"], o["align"], o["left"], o["right"]) == (8, True, True, 1, 1024, 0)
    assert (o["softcap"], o["alibi"]) == (50, True)
    assert o["text"] == "kv_heads 8, causal, align bottom-right, window (1024, 0), softcap 50, alibi"
    rc, o = _parse(options_driver, "--heads", "6", "--kv-heads", "6")
    assert rc == 0 and o["grouped"] is False and o["text"] == "none"


def test_a_window_takes_every_side_a_manifest_takes(options_driver):
    """Each side up to 2^31 - 1 keys, as in a case's manifest; one more is refused in one line."""
    rc, o = _parse(options_driver, "--window", "2147483647,0")
    assert rc == 0 and (o["left"], o["right"]) == (2147483647, 0)
    rc, err = _parse(options_driver, "--window", "0,2147483648")
    assert rc == 2 and "must be -1 (unbounded) or a number of keys from 0 to 2147483647" in err.splitlines()[0], err


@pytest.mark.parametrize("args,words", [
    (["--heads", "12", "--kv-heads", "5"], "--kv-heads 5 must divide --heads 12"),
    (["--heads", "4", "--kv-heads", "8"], "--kv-heads 8 must divide --heads 4"),
    (["--kv-heads", "0"], "--kv-heads needs an integer"),
    (["--window", "3"], "--window needs LEFT,RIGHT"),
    (["--window", "-2,0"], "--window '-2,0': must be -1 (unbounded)"),
    (["--window", "a,0"], "--window LEFT needs an integer"),
    (["--causal", "--window", "4,2"], "--window right = 2 with --causal: a causal mask sees no key right"),
    (["--softcap", "-1"], "--softcap '-1': must be a finite number"),
    (["--softcap", "nan"], "--softcap needs a finite number"),
    (["--align", "middle"], "--align must be top-left or bottom-right, got 'middle'"),
    (["--align"], "--align needs a value"),
    (["--dropout", "0.1"], "unknown option '--dropout'"),
])
def test_options_refuse_bad_variants(options_driver, args, words):
    """One line naming the option and the rule, exit 2, as every --bench option."""
    rc, err = _parse(options_driver, *args)
    assert rc == 2
    assert words in err.splitlines()[0], err


def test_shape_ids_carry_the_variant_and_parse_back():
    shapes = [Shape(1, 32, 8192, 8192, 128, False, kv_heads=8),
              Shape(4, 16, 16384, 16384, 128, False, window=(1024, 0)),
              Shape(2, 6, 37, 53, 24, True, kv_heads=3, align=BOTTOM_RIGHT, window=(-1, 0), softcap=0.5, alibi=True),
              Shape(1, 2, 8, 8, 16, False, softcap=1e-5)]
    ids = [s.id for s in shapes]
    assert ids[:2] == ["B1-H32-N8192-M8192-d128-kv8", "B4-H16-N16384-M16384-d128-window1024,0"]
    assert ids[2] == "B2-H6-N37-M53-d24-kv3-bottom-right-window-1,0-softcap0.5-alibi-causal"
    assert [parse_shape_id(i) for i in ids] == shapes
    assert parse_shape_id("B4-H16-N4096-M4096-d64-causal") == Shape(4, 16, 4096, 4096, 64, True)
    assert Shape(1, 4, 8, 8, 16, False, kv_heads=4) == Shape(1, 4, 8, 8, 16, False)  # H K/V heads: not grouped
    assert shapes[0].base == Shape(1, 32, 8192, 8192, 128, False) and not shapes[0].plain and shapes[0].base.plain
    for bad in ("B1-H2-N3-M4", "B1-H2-N3-M4-d5-sideways", "B1-H2-N3-M4-d5-kv3"):
        with pytest.raises(ValueError):
            parse_shape_id(bad)


def test_binary_args_carry_the_variant(tmp_path):
    shape = Shape(2, 6, 37, 53, 24, True, kv_heads=3, align=BOTTOM_RIGHT, window=(-1, 0), softcap=50.0, alibi=True)
    args = " ".join(vb.binary_args(shape, "bf16", 1, 5, tmp_path / "x.json", False, "flash"))
    for part in ("--kv-heads 3", "--causal", "--align bottom-right", "--window -1,0", "--softcap 50.0", "--alibi"):
        assert part in args
    assert vb.variant_args(Shape(1, 4, 8, 8, 16, False)) == []


# ---- the variants' goals from canned results -----------------------------------------------------

def _binary_json(shape: Shape, precision: str, flash_ms: float, backward_ms=None, status="ok") -> dict:
    """What `main --bench --json` writes for one run with a variant, trimmed to its flash rows."""
    def row(name, ms, flop, pass_):
        if status != "ok":
            return {"name": name, "kind": "attention", "pass": pass_, "status": status, "reason": "no kernel"}
        return {"name": name, "kind": "attention", "pass": pass_, "status": "ok", "ms": ms, "flops": flop,
                "tflops": flop / (ms * 1e-3) / 1e12, "tiles": "128x128, cuda-wgmma"}

    kernels = [row("flash", flash_ms, shape.flash_flop, "forward")]
    if backward_ms is not None:
        kernels.append(row("flash_backward", backward_ms, shape.backward_flop, "backward"))
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H100 80GB HBM3", "sm_count": 132,
            "shape": {"batch": shape.batch, "heads": shape.heads, "seq_q": shape.seq_q, "seq_k": shape.seq_k,
                      "d": shape.d, "causal": shape.causal, "scale": 0.088},
            "variant": {"kv_heads": shape.kv_heads or shape.heads, "align": shape.align,
                        "window_left": shape.window[0], "window_right": shape.window[1], "softcap": shape.softcap,
                        "alibi": shape.alibi, "visible_entries": shape.visible_entries},
            "precision": precision, "warmup": 3, "reps": 20, "ceilings": {}, "passed": True, "kernels": kernels}


# The preset's runs with the times a run gave: (variant ms, base ms) per goal, forward then backward.
_TIMES = {("GQA", "bf16"): (2.00, 1.95), ("window (1024, 0)", "bf16"): (1.10, 9.00),
          ("softcap 50", "bf16"): (1.20, 1.00), ("softcap 50", "fp32"): (5.2, 5.0)}
_BACKWARD = (14.0, 13.0)


def _preset_results(times=_TIMES) -> dict:
    runs = {}
    timed_backward = {(s, p) for s, p, passes in preset_runs() if passes == "both"}
    for g in VARIANT_GOALS:
        v_ms, b_ms = times[(g.name, g.precision)]
        back = _BACKWARD if (g.shape, g.precision) in timed_backward else (None, None)
        runs[(g.shape, g.precision)] = _binary_json(g.shape, g.precision, v_ms, back[0])
        runs[(g.base, g.precision)] = _binary_json(g.base, g.precision, b_ms, back[1])
    return {"tool": "attnstep bench", "format": 1, "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T00:00:00Z",
            "torch": None, "runs": [{"binary": data} for data in runs.values()]}


def test_preset_runs_exactly_what_the_goals_compare():
    runs = preset_runs()
    ids = [(s.id, p, passes) for s, p, passes in runs]
    assert ids == [("B1-H32-N8192-M8192-d128-kv8", "bf16", "forward"), ("B1-H32-N8192-M8192-d128", "bf16", "forward"),
                   ("B4-H16-N16384-M16384-d128-window1024,0", "bf16", "both"),
                   ("B4-H16-N16384-M16384-d128-causal", "bf16", "both"),
                   ("B4-H16-N4096-M4096-d128-softcap50", "bf16", "both"),
                   ("B4-H16-N4096-M4096-d128", "bf16", "both"),
                   ("B4-H16-N4096-M4096-d128-softcap50", "fp32", "both"), ("B4-H16-N4096-M4096-d128", "fp32", "both")]


def test_goal_ratios_and_verdicts_from_canned_results():
    rows = vb.rows_from_results(_preset_results())
    records = {(r["goal"], r["precision"], r["kernel"]): r for r in goal_records(rows) if "ratio" in r}
    gqa = records[("GQA", "bf16", "flash")]
    assert gqa["ratio"] == pytest.approx(1.95 / 2.00) and gqa["met"] is True and gqa["comparison"] == ">="
    window = records[("window (1024, 0)", "bf16", "flash")]
    assert window["ratio"] == pytest.approx(1.10 / 9.00) and window["met"] is True and window["threshold"] == 1 / 8
    assert records[("softcap 50", "bf16", "flash")]["met"] is False  # 1.20x
    assert records[("softcap 50", "fp32", "flash")]["ratio"] == pytest.approx(5.2 / 5.0)
    for precision in ("fp32", "bf16"):
        back = records[("softcap 50", precision, "flash_backward")]
        assert back["ratio"] == pytest.approx(14.0 / 13.0) and back["met"] is True
        assert back["shape"] == "B4-H16-N4096-M4096-d128-softcap50" and back["base"] == "B4-H16-N4096-M4096-d128"
    window_back = records[("window (1024, 0)", "bf16", "flash_backward")]
    assert window_back["ratio"] == pytest.approx(14.0 / 13.0) and window_back["met"] is False
    assert window_back["base"] == "B4-H16-N16384-M16384-d128-causal"
    lines = [r["line"] for r in goal_records(rows)]
    assert any(line.startswith("met    bf16 flash GQA: TFLOP/s within 5% of MHA at the same H (>= 0.95x): 0.975x")
               for line in lines), lines
    assert any(line.startswith("MISSED bf16 flash softcap 50: time within 10% of the run without it (<= 1.1x): 1.200x")
               for line in lines), lines
    # The plain goals (verify/bench/goals.py) are not decided by rows of a shape with a variant.
    assert all("ratio" in r for r in goal_records(rows))


def test_variant_rows_note_their_time_over_the_base_run():
    rows = vb.rows_from_results(_preset_results())
    softcap = next(r for r in rows if r.shape == "B4-H16-N4096-M4096-d128-softcap50" and r.precision == "bf16")
    assert "1.200x the time without the variant" in softcap.note
    window = next(r for r in rows if r.shape.endswith("window1024,0"))
    assert "without the variant" not in window.note  # its goal's base is the causal run, not this shape's base
    table = vb.format_table(rows)
    assert "B1-H32-N8192-M8192-d128-kv8" in table and "1.026x the time without the variant" in table


def test_a_goal_whose_run_failed_is_missed_with_the_reason():
    results = _preset_results()
    gqa = next(r for r in results["runs"] if r["binary"]["variant"]["kv_heads"] == 8)
    gqa["binary"] = _binary_json(VARIANT_GOALS[0].shape, "bf16", 1.0, status="unsupported")
    window = VARIANT_GOALS[1].shape
    results["runs"] = [r for r in results["runs"] if shape_of_binary(r["binary"]) != window]
    results["runs"].append({"shape": window.id, "precision": "bf16", "error": "main --bench exited 1: boom"})
    lines = [r["line"] for r in goal_records(vb.rows_from_results(results))]
    assert "MISSED bf16 flash GQA: TFLOP/s within 5% of MHA at the same H (>= 0.95x): " \
           "B1-H32-N8192-M8192-d128-kv8 unsupported" in lines
    assert any(line.startswith("MISSED bf16 flash window (1024, 0)")
               and line.endswith("failed: main --bench exited 1: boom") for line in lines), lines
    # Without the variant's run the goal says nothing (a plain sweep holds some goals' bases).
    results["runs"] = [r for r in results["runs"] if "binary" in r and shape_of_binary(r["binary"]).plain]
    assert all("ratio" not in r for r in goal_records(vb.rows_from_results(results)))


def test_cli_variants_goals_runs_the_preset_and_writes_the_ratios(tmp_path, monkeypatch):
    """One invocation: every preset run with its variant, the flash rows only; the table, the goal
    lines and the JSON's goals with their ratios."""
    canned = {(shape_of_binary(r["binary"]), r["binary"]["precision"]): r["binary"] for r in _preset_results()["runs"]}
    calls = []

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, passes="both", **kw):
        calls.append((shape.id, prec, only, passes, " ".join(vb.binary_args(shape, prec, 0, 1, Path("x"), check,
                                                                            only, passes)), reps))
        return canned[(shape, prec)]

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    main = tmp_path / "main"
    main.write_text("")
    out = tmp_path / "goals.json"
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--variants", "goals", "--no-torch", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert [(c[0], c[1], c[3]) for c in calls] == [(s.id, p, passes) for s, p, passes in preset_runs()]
    assert all(c[2] == "flash" and c[5] == 20 for c in calls)  # the large causal run too: compared runs, same reps
    assert "--kv-heads 8" in calls[0][4] and "--window 1024,0" in calls[2][4] and "--softcap 50.0" in calls[4][4]
    assert "goals:" in res.output and "met    bf16 flash window (1024, 0)" in res.output
    goals = json.loads(out.read_text())["goals"]
    assert {g["goal"] for g in goals} == {"GQA", "window (1024, 0)", "softcap 50"}
    assert all(isinstance(g["ratio"], float) for g in goals)
    again = CliRunner().invoke(cb.bench, ["--from-json", str(out)])
    assert again.exit_code == 0 and "0.975x" in again.output


@pytest.mark.parametrize("args,words", [
    (["--variants", "goals", "--shape", "1,1,8,8,16"], "drop --shape"),
    (["--variants", "goals", "--precision", "fp32", "--softcap", "5"], "drop --precision, --softcap"),
    (["--variants", "goals", "--only", "all"], "drop --only"),
    (["--shape", "1,12,8,8,16", "--kv-heads", "5"], "shape B1-H12-N8-M8-d16: kv_heads = 5: must divide heads = 12"),
    (["--shape", "1,2,8,8,16,causal", "--window", "4,2"], "a causal mask sees no key right of the diagonal"),
    (["--window", "4"], "expected LEFT,RIGHT"),
    (["--softcap", "-3"], "--softcap': '-3': must be a finite number > 0"),
])
def test_cli_refuses_what_it_cannot_run(tmp_path, args, words):
    main = tmp_path / "main"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--no-torch", *args])
    assert res.exit_code == 2, res.output
    assert words in res.output


def test_cli_variant_options_reach_every_shape(tmp_path, monkeypatch):
    seen = []

    def fake_run(binary, shape, prec, warmup, reps, check, only="all", timeout=0, passes="both", **kw):
        seen.append(shape)
        return _binary_json(shape, prec, 1.0)

    monkeypatch.setattr(vb, "run_binary_bench", fake_run)
    main = tmp_path / "main"
    main.write_text("")
    res = CliRunner().invoke(cb.bench, ["--binary", str(main), "--no-torch", "--shape", "1,4,37,53,16",
                                        "--shape", "1,8,64,64,32,causal", "--kv-heads", "2", "--align", BOTTOM_RIGHT,
                                        "--window", "8,-1", "--softcap", "30", "--alibi", "--precision", "bf16"])
    assert res.exit_code == 0, res.output
    assert [s.id for s in seen] == ["B1-H4-N37-M53-d16-kv2-bottom-right-window8,-1-softcap30-alibi",
                                    "B1-H8-N64-M64-d32-kv2-bottom-right-window8,-1-softcap30-alibi-causal"]
    assert "B1-H4-N37-M53-d16-kv2-bottom-right-window8,-1-softcap30-alibi" in res.output


def test_results_of_a_binary_without_variants_still_read():
    data = _binary_json(Shape(4, 16, 4096, 4096, 64, True), "fp32", 1.0)
    del data["variant"]
    rows = vb.rows_from_results({"runs": [{"binary": data}]})
    assert rows[0].shape == "B4-H16-N4096-M4096-d64-causal"
    data["variant"] = "bad"
    with pytest.raises(vb.BenchError, match="variant"):
        vb.rows_from_results({"runs": [{"binary": data}]})


# ---- the binary ----------------------------------------------------------------------------------

def test_the_binarys_bench_refuses_bad_variants(binary):
    """A CUDA build refuses a bad variant option with one line naming it (exit 2) before it looks
    for a GPU; a CPU-only build refuses --bench itself (exit 2), saying it needs CUDA."""
    stub = subprocess.run([str(binary), "--bench", "--kv-heads", "4"], capture_output=True, text=True, timeout=60)
    if "needs a CUDA build" in stub.stderr:
        assert stub.returncode == 2 and stub.stderr.startswith("main: error: --bench: bench needs a CUDA build")
        pytest.skip("a CPU-only build: --bench is refused before its options are read")
    for args, words in ((["--heads", "12", "--kv-heads", "5"], "--kv-heads 5 must divide --heads 12"),
                        (["--causal", "--window", "4,2"], "--window right = 2 with --causal"),
                        (["--window", "1"], "--window needs LEFT,RIGHT"), (["--softcap", "-1"], "--softcap '-1'"),
                        (["--align", "up"], "--align must be top-left or bottom-right")):
        proc = subprocess.run([str(binary), "--bench", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr.splitlines()[0]


_GPU_VARIANTS = [
    Shape(1, 6, 37, 53, 64, False, kv_heads=2),
    Shape(1, 6, 53, 37, 64, True, kv_heads=3, align=BOTTOM_RIGHT),
    Shape(1, 3, 130, 77, 64, False, window=(9, 4), align=BOTTOM_RIGHT),
    Shape(1, 3, 127, 333, 64, True, window=(40, 0), softcap=5.0),
    Shape(1, 4, 100, 100, 64, False, alibi=True, kv_heads=1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", _GPU_VARIANTS, ids=[s.id for s in _GPU_VARIANTS])
def test_gpu_bench_checks_each_variant(binary, shape, precision):
    """A real run of each variant on a tiny irregular shape, sampled rows of the first and last head
    (and K/V head) checked: the flash rows and the gradients (fp32) match float64 through the
    variant; the JSON records it."""
    data = vb.run_binary_bench(binary, shape, precision, warmup=1, reps=3, check=True, only="all", ceilings=False)
    assert data["passed"] is True, [k for k in data["kernels"] if not (k.get("check") or {}).get("passed", True)]
    assert data["variant"]["visible_entries"] == shape.visible_entries
    assert vb.parse_binary_json(data) and vb.rows_from_results({"runs": [{"binary": data}]})[0].shape == shape.id
    names = {k["name"]: k for k in data["kernels"]}
    if precision == "bf16" and names["flash"]["status"] == "unsupported":
        pytest.skip(f"no bf16 flash kernel on this GPU: {names['flash'].get('reason')}")
    assert names["flash"]["status"] == "ok" and names["flash"]["check"]["passed"] is True
    assert names["flash"]["flops"] == pytest.approx(shape.flash_flop)
    if shape.grouped:
        assert names["kv_expand"]["status"] == "ok"
        if precision == "fp32":
            assert names["kv_group_sum"]["status"] == "ok" and names["flash_backward"]["check"]["passed"] is True

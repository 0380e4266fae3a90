"""States the report explains in words of their own: a report's truth value is its verdict,
half-precision values checked at fp32 are named, files written over an earlier run are told in one
line, a failure every head shares is one block, the gallery's GPU programs need a GPU, and a check
of a folder against itself is refused from Python too."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import attnstep
from helpers import foreign_routes as foreign
from helpers.cli import invoke
from verify.check import compare
from verify.cli import run as cli_run
from verify.files.case import CaseError, crc32_hex
from verify.model.half import round_to_format
from verify.report.junit import write_junit
from verify.report.text import failure_lines, summary_lines
from verify.runs import gpu
from verify.runs.gpu import no_gpu_reason
from verify.stages import stage_file

f32 = np.float32
H, N, M, D = 3, 20, 28, 16
SCALE = 0.25
SMALL = ["--heads", "3", "--seq-q", "9", "--seq-k", "13", "--d-k", "16", "--d-v", "16"]


def _inputs(seed=1):
    rng = np.random.default_rng(seed)
    return tuple(rng.random((H, n, D)).astype(f32) for n in (N, M, M))


def _stages(q, k, v, names, bug=None, bad_heads=range(H)):
    heads = [foreign.compute_head(q[i], k[i], v[i], SCALE, False, bug=bug if i in bad_heads else None)
             for i in range(H)]
    return {s: np.stack([h[s] for h in heads]) for s in names}


# ---- a report's truth value is its verdict ----------------------------------------------------

def test_a_report_is_true_only_when_every_stage_passes():
    q, k, v = _inputs()
    good = _stages(q, k, v, ("output",))
    assert attnstep.check_arrays(q, k, v, good, scale=SCALE)
    bad = {"output": good["output"] * f32(1.01)}
    report = attnstep.check_arrays(q, k, v, bad, scale=SCALE)
    assert not report and not report.passed
    with pytest.raises(AssertionError):
        assert attnstep.check_arrays(q, k, v, bad, scale=SCALE)


# ---- half-precision values checked at fp32 ------------------------------------------------------

def _text(report) -> str:
    return attnstep.format_report(report)


def test_a_float16_array_at_fp32_says_what_its_storage_allows():
    q, k, v = _inputs()
    out = _stages(q, k, v, ("output",))["output"].astype(np.float16)
    report = attnstep.check_arrays(q, k, v, {"output": out}, scale=SCALE)
    text = _text(report)
    assert report.passed, text
    assert "note: output holds float16 values: checked as float32 arithmetic stored in float16" in text
    assert "a half-precision program? pass precision='fp16'" in text
    assert "the file's resolution" not in text  # the note for coarse printing does not apply to an array
    assert {r.half_values for r in report.results} == {"fp16"}


def test_bfloat16_values_in_a_float32_array_fail_at_fp32_and_say_why():
    q, k, v = _inputs()
    out = round_to_format(_stages(q, k, v, ("output",))["output"], "bf16").astype(f32)  # a bf16 tensor's .float()
    report = attnstep.check_arrays(q, k, v, {"output": out}, scale=SCALE)
    verdict = summary_lines(report)[-1]
    assert not report
    assert verdict.startswith("FAIL (bounds for fp32): first failing stage: output")
    assert verdict.endswith("; output holds bfloat16 values: a half-precision program? pass precision='bf16'")
    assert "each value is exactly a bfloat16 though the exact results are not" in _text(report)
    assert attnstep.check_arrays(q, k, v, {"output": out}, scale=SCALE, precision="bf16")


def test_float32_results_are_not_taken_for_half_values():
    """Inputs that are bfloat16 values make KT bfloat16 values too: the exact results are, so that
    says nothing about the program; the float32 products are not."""
    q, k, v = (round_to_format(x, "bf16").astype(f32) for x in _inputs())
    report = attnstep.check_arrays(q, k, v, _stages(q, k, v, ("KT", "QK", "output")), scale=SCALE)
    assert report.passed and "holds" not in _text(report)
    assert {r.half_values for r in report.results} == {None}


def test_weights_of_zeros_and_ones_are_not_taken_for_half_values():
    """A softmax that underflows to 0 and saturates at 1 (large logits, the max not subtracted)
    holds values every format has: that is no sign of a half-precision program."""
    q, k, v = (x * f32(40) for x in _inputs())
    s = (q @ np.swapaxes(k, -1, -2)) * f32(SCALE)
    weights = (s == s.max(axis=-1, keepdims=True)).astype(f32)  # one-hot rows: 0 and 1 only
    report = attnstep.check_arrays(q, k, v, {"attention_weights": weights}, scale=SCALE)
    assert not report.passed and "holds bfloat16" not in _text(report) and "holds float16" not in _text(report)
    assert {r.half_values for r in report.results} == {None}


def _case(tmp_path) -> Path:
    r = invoke("generate", "--out", tmp_path / "in", *SMALL)
    assert r.exit_code == 0, r.output
    return tmp_path / "in"


def _write_npy(out: Path, heads, stage, dtype):
    out.mkdir(exist_ok=True)
    for i, h in enumerate(heads):
        np.save(out / stage_file(stage, i, "npy"), h[stage].astype(dtype))


def test_float16_stage_files_name_the_option_that_checks_them_as_half_precision(tmp_path):
    in_dir = _case(tmp_path)
    inputs = foreign.read_inputs(in_dir, 3)
    heads = foreign.compute_heads(inputs, SCALE, False)
    _write_npy(tmp_path / "out", heads, "output", np.float16)
    r = invoke("check", "--in", in_dir, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "output holds float16 values" in r.output and "check with --precision fp16" in r.output
    r = invoke("check", "--in", in_dir, "--out", tmp_path / "out", "--precision", "fp16")
    assert "holds float16 values" not in r.output  # checked as what it is


# ---- files written over an earlier run ----------------------------------------------------------

@pytest.fixture
def overwritten(tmp_path, binary):
    """An earlier run of attnstep's binary, its files then written over by another program (%g)."""
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    r = invoke("run", "--in", in_dir, "--out", out_dir, "--backend", "cpu", "--binary", binary)
    assert r.exit_code == 0, r.output
    files = sorted(out_dir.glob("*_head_*.txt"))
    for path in files:
        np.savetxt(path, np.loadtxt(path, ndmin=2), fmt="%g")
    return in_dir, out_dir, len(files)


def test_files_written_over_an_earlier_run_are_told_in_one_line(overwritten, tmp_path):
    in_dir, out_dir, n = overwritten
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--json", tmp_path / "r.json")
    assert r.exit_code == 1
    told = [ln for ln in r.output.splitlines() if "run.toml's CRC-32" in ln]
    assert told == [f"FAIL (bounds for fp32): {n} of {n} files differ from run.toml's CRC-32: files written over "
                    f"an earlier run of attnstep's binary? HINT: remove {out_dir / 'run.toml'} (the files are then "
                    "checked as your program's), or write into a fresh --out"], r.output
    assert "first failing stage" not in r.output and "STALE Q head" not in r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert {x["status"] for x in rep["results"]} == {"STALE"} and len(rep["results"]) == n  # per file still
    (out_dir / "run.toml").unlink()  # the fix the line gives
    assert invoke("check", "--in", in_dir, "--out", out_dir).exit_code == 0


def test_a_real_failure_among_the_files_that_match_is_still_named(tmp_path, binary):
    in_dir, out_dir = _case(tmp_path), tmp_path / "out"
    assert invoke("run", "--in", in_dir, "--out", out_dir, "--backend", "cpu", "--binary", binary).exit_code == 0
    for i in range(3):  # another program's output over the run's
        path = out_dir / stage_file("output", i, "txt")
        np.savetxt(path, np.loadtxt(path, ndmin=2), fmt="%g")
    qk = out_dir / stage_file("QK", 1, "txt")  # a bug in a file of the run itself (its CRC listed)
    lines = qk.read_text().splitlines()
    qk.write_text(lines[0] + "\n" + "\n".join(" ".join(f"{2 * x:.9g}" for x in row)
                                             for row in np.loadtxt(qk, ndmin=2)) + "\n")
    toml = out_dir / "run.toml"
    toml.write_text("".join(f'crc32_QK_head_1 = "{crc32_hex(qk.read_bytes())}"\n' if ln.startswith("crc32_QK_head_1 ")
                            else ln for ln in toml.read_text().splitlines(keepends=True)))
    r = invoke("check", "--in", in_dir, "--out", out_dir)
    verdict = r.output.splitlines()
    stale = next(i for i, ln in enumerate(verdict) if "files differ from run.toml's CRC-32" in ln)
    assert verdict[stale].startswith("FAIL (bounds for fp32): 3 of 30 files differ"), r.output
    assert verdict[stale + 1].startswith("      and among the files that match it: first failing stage: QK "
                                         "(head 1: batch 0, head 1)"), r.output


# ---- one failure every head shares --------------------------------------------------------------

def test_a_failure_every_head_shares_is_one_block():
    q, k, v = _inputs()
    report = attnstep.check_arrays(q, k, v, _stages(q, k, v, ("QK_scaled", "attention_weights"), bug="axis"),
                                   scale=SCALE)
    blocks = [ln for ln in failure_lines(report) if not ln.startswith(" ")]
    assert blocks == [next(ln for ln in blocks if ln.startswith(
        "FAIL attention_weights, all 3 heads alike; head 0 (batch 0, head 0) shown: "))]
    assert "first failing stage: attention_weights (all 3 heads); softmax_axis:" in summary_lines(report)[-1]
    assert sum(r.stage == "attention_weights" and not r.passed for r in report.results) == H


def test_heads_that_fail_alike_are_named_and_json_and_junit_keep_every_head(tmp_path):
    q, k, v = _inputs()
    report = attnstep.check_arrays(q, k, v, _stages(q, k, v, ("attention_weights",), bug="axis", bad_heads=(0, 2)),
                                   scale=SCALE)
    blocks = [ln for ln in failure_lines(report) if not ln.startswith(" ")]
    assert len(blocks) == 1 and blocks[0].startswith("FAIL attention_weights, heads 0, 2 alike; head 0 ")
    write_junit(report, tmp_path / "r.xml")
    failed = ET.parse(tmp_path / "r.xml").getroot().findall(".//testcase[failure]")
    assert [c.get("name") for c in failed] == ["head_0", "head_2"]


# ---- the gallery's programs need a GPU ----------------------------------------------------------

def test_demo_example_without_a_gpu_says_so_before_building(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: "nvidia-smi -L lists no GPU")
    monkeypatch.setattr(cli_run, "_build", lambda *a, **kw: pytest.fail("built without a GPU"))
    r = invoke("demo", "--example", "bug_qk_leading_dim", "--build-dir", tmp_path / "build")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines() == [
        "Error: demo --example bug_qk_leading_dim needs an NVIDIA GPU: the examples gallery's programs run on "
        "CUDA only, and here nvidia-smi -L lists no GPU; HINT: 'attnstep demo' runs attnstep's own binary, "
        "which falls back to its CPU backend"]


def test_demo_on_cuda_refuses_a_build_without_cuda_before_generating(monkeypatch, tmp_path):
    """The binary would refuse `--backend cuda` too, but only after the demo had generated its case."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text("ATTNSTEP_CUDA_BUILT:INTERNAL=OFF\n")
    monkeypatch.setattr(cli_run, "_build", lambda *a, **kw: build / "main")
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: None)
    r = invoke("demo", "--backend", "cuda", "--build-dir", build, "--data-dir", tmp_path / "data")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == (
        f"Error: --backend cuda: the binary in {build} was built without CUDA; HINT: configure it with "
        "-DATTNSTEP_CUDA=ON (docs/cli.md, Building), or use --backend cpu")
    assert not (tmp_path / "data").exists()


def test_demo_on_cuda_without_a_gpu_says_so_before_generating(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "no_gpu_reason", lambda: "nvidia-smi -L lists no GPU")
    (tmp_path / "theirs").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "theirs").chmod(0o755)
    r = invoke("demo", "--backend", "cuda", "--binary", tmp_path / "theirs", "--data-dir", tmp_path / "data")
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        "Error: --backend cuda: no CUDA device found: nvidia-smi -L lists no GPU; HINT: run on a machine with an "
        "NVIDIA GPU, or use --backend cpu")
    assert not (tmp_path / "data").exists()


def test_a_gpu_hidden_from_cuda_is_no_gpu(monkeypatch):
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert "hides every GPU" in no_gpu_reason()


# ---- a folder checked against itself ------------------------------------------------------------

def test_the_python_check_refuses_a_folder_checked_against_itself(tmp_path):
    in_dir = _case(tmp_path)
    with pytest.raises(CaseError, match="are the same folder"):
        compare.check(in_dir, in_dir)


def test_a_first_failure_named_only_by_a_symptom_says_so():
    """A block of output rows never written: the verdict gives where (unwritten) and says that no
    cause is named; a finding that names a cause says nothing of the kind."""
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((1, 2, 64, 16)).astype(np.float32) for _ in range(3))
    s = np.einsum("bhnd,bhmd->bhnm", q.astype(np.float64), k) / 4.0
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = ((p / p.sum(axis=-1, keepdims=True)) @ v).astype(np.float32)
    out[:, :, 32:48] = 0.0
    verdict = attnstep.format_report(attnstep.check_arrays(q, k, v, {"flash_output": out})).splitlines()[-1]
    assert "unwritten" in verdict and verdict.endswith("(a symptom: no cause named)"), verdict
    pc = np.exp(s - s.max(axis=-2, keepdims=True))  # (the softmax over the queries: a cause)
    out2 = ((pc / pc.sum(axis=-2, keepdims=True)) @ v).astype(np.float32)
    verdict = attnstep.format_report(attnstep.check_arrays(q, k, v, {"flash_output": out2})).splitlines()[-1]
    assert "softmax_axis" in verdict and "no cause named" not in verdict, verdict

"""The check engine on grouped K/V heads (GQA/MQA) and dropout, against programs written here in
NumPy: each computes every stage in float64 and writes it as float32, as a correct program's
results would be (or with one bug planted), and `attnstep check` judges the folder.

GQA: a job is a K/V head and its query heads; K, V, KT, dK, dV and their flash twins are one file
per K/V head, dK and dV the sum over the group, and the report names their heads as K/V heads.
Dropout: the program's keep-mask is a stage (0 or 1 only), the stages after it are checked against
that mask, its keep rate is tested once over the run, and the stages that read it cannot be
checked without it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pytest

from helpers.cli import invoke
from verify.files.case import load_input_case
from verify.files.generate import generate_case
from verify.stages import DROPOUT_MASK, STAGES, Dims, default_scale, stage_file
from verify.variant import Variant

f32, f64 = np.float32, np.float64
N, M, D = 37, 53, 24   # irregular: no tile, warp or power of two fits


# ---- the NumPy program ----------------------------------------------------------------------------

def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _query_head(q, k, v, do, scale: float, keep: Optional[np.ndarray], p: float, rescale: bool,
                hidden: np.ndarray) -> Dict[str, np.ndarray]:
    """Every stage of one query head, float64: the stage path, the flash twins (the same values),
    and the head's parts of dK and dV. keep: the dropout keep-mask (None: no dropout); rescale
    False: the bug of dropping without 1/(1 − p); hidden: the keys each row may not see."""
    s = np.where(hidden, -np.inf, (q @ k.T) * scale)
    w = _softmax(s)
    kept = w if keep is None else w * keep / ((1.0 - p) if rescale else 1.0)
    out = {"Q": q, "QK": q @ k.T, "QK_scaled": s, "attention_weights": w, "output": kept @ v, "dO": do}
    lse = np.log(np.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) + s.max(axis=1, keepdims=True)
    dp = do @ v.T
    d = (do * out["output"]).sum(axis=1, keepdims=True)
    ds = w * ((dp if keep is None else dp * keep / (1.0 - p)) - d)
    out.update({"flash_output": out["output"], "flash_lse": lse, "D": d, "dP": dp, "dS": ds,
                "dQ": scale * ds @ k, "flash_dQ": scale * ds @ k,
                "dK": scale * ds.T @ q, "dV": kept.T @ do})
    out["flash_dK"], out["flash_dV"] = out["dK"], out["dV"]
    if keep is not None:
        out[DROPOUT_MASK] = keep
    return out


def run_program(in_dir: Path, out_dir: Path, keeps=None, p: float = 0.0, rescale: bool = True,
                group_sum=None, kv_per_query_head: bool = False) -> None:
    """The program: every stage of every head into out_dir as float32 .npy. keeps[i]: query head
    i's keep-mask (dropout); group_sum(parts) -> what the program writes as dK/dV of a K/V head
    from its query heads' parts (the sum, or a bug's); kv_per_query_head: K (and the other K/V
    stages) written once per query head."""
    case = load_input_case(in_dir)
    dims, scale = case.dims, case.scale or default_scale(case.dims.d_k)
    hidden = ~case.variant.visible(dims.seq_q, dims.seq_k)   # the causal mask at the case's alignment
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = []
    for i in range(dims.total_heads):
        j = dims.kv_head_of(i)
        k, v = case.load("K", j).astype(f64), case.load("V", j).astype(f64)
        heads.append(_query_head(case.load("Q", i).astype(f64), k, v, case.load("dO", i).astype(f64), scale,
                                 None if keeps is None else keeps[i], p, rescale, hidden))
        heads[-1].update({"K": k, "V": v, "KT": k.T})
    summed = group_sum or (lambda parts: sum(parts))

    def write(stage: str, index: int, x: np.ndarray) -> None:
        np.save(out_dir / stage_file(stage, index, "npy"), np.asarray(x, f64).astype(f32))

    for stage in heads[0]:
        if not STAGES[stage].kv:
            for i, h in enumerate(heads):
                write(stage, i, h[stage])
        elif kv_per_query_head:
            for i, h in enumerate(heads):
                write(stage, i, h[stage])
        else:
            for j in range(dims.total_kv_heads):
                parts = [heads[i][stage] for i in dims.query_heads_of(j)]
                write(stage, j, summed(parts) if STAGES[stage].backward else parts[0])


def make_case(folder: Path, dims: Dims, variant: Optional[Variant] = None) -> Path:
    return generate_case(folder, dims, seed=11, backward=True, fmt="npy", variant=variant)


def check(tmp: Path, in_dir: Path, out_dir: Path, *extra):
    """attnstep check: (exit code, output, JSON report)."""
    report = tmp / "report.json"
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--json", report, *extra)
    return r.exit_code, r.output, (json.loads(report.read_text()) if report.exists() else None)


def results(report: dict, stage: str):
    return [r for r in report["results"] if r["stage"] == stage]


# ---- GQA / MQA --------------------------------------------------------------------------------------

BOTTOM_RIGHT = Variant(causal=True, align="bottom-right")


@pytest.mark.parametrize("batch, kv_heads, variant", [(1, 2, None), (2, 2, None), (1, 1, None), (2, 3, BOTTOM_RIGHT)],
                         ids=["gqa", "gqa-batch2", "mqa", "gqa-causal-bottom-right"])
def test_a_correct_grouped_program_passes(tmp_path, batch, kv_heads, variant):
    dims = Dims(batch, 6, N, M, D, D, kv_heads=kv_heads)
    in_dir = make_case(tmp_path / "in", dims, variant)
    run_program(in_dir, tmp_path / "out")
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 0 and report["passed"], output
    for stage in (s["stage"] for s in report["stages"]):
        rs = results(report, stage)
        if STAGES[stage].kv:   # one per K/V head, naming the query heads it serves
            assert [r["head"] for r in rs] == list(range(dims.total_kv_heads)), stage
            assert all(r["kv_head"] and r["query_heads"] == list(dims.query_heads_of(r["head"])) for r in rs)
        else:
            assert [r["head"] for r in rs] == list(range(dims.total_heads)), stage
    assert f"{dims.total_kv_heads}/{dims.total_kv_heads}" in next(line for line in output.splitlines()
                                                               if line.startswith("dK "))


def test_dk_of_one_query_head_fails_at_dk_naming_the_kv_head(tmp_path):
    """dK (and its flash twin) written as the first query head's part only: the group not summed."""
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    in_dir = make_case(tmp_path / "in", dims)
    run_program(in_dir, tmp_path / "out", group_sum=lambda parts: parts[0])
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 1 and report["first_failing_stage"] == "dK", output
    first = report["first_failure"]
    assert first["kv_head"] and first["head"] == 0 and first["query_heads"] == [0, 1, 2]
    assert first["status"] == "FAIL" and first["isolated"]["passed"] is False
    assert "K/V head" in output.splitlines()[-2] + output.splitlines()[-1], output
    assert all(r["passed"] for r in report["results"] if not STAGES[r["stage"]].kv or not STAGES[r["stage"]].backward)


def test_kv_stages_written_per_query_head_are_refused(tmp_path):
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    in_dir = make_case(tmp_path / "in", dims)
    run_program(in_dir, tmp_path / "out", kv_per_query_head=True)
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code != 0 and report is None and "Traceback" not in output
    line = output.strip().splitlines()[-1]
    assert "per K/V head" in line and "per query head" in line, output


def test_the_text_report_names_kv_heads(tmp_path):
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    in_dir = make_case(tmp_path / "in", dims)
    run_program(in_dir, tmp_path / "out", group_sum=lambda parts: 2 * sum(parts))  # summed twice
    code, output, _ = check(tmp_path, in_dir, tmp_path / "out", "--junit", tmp_path / "j.xml")
    assert code == 1
    block = next(line for line in output.splitlines() if line.startswith("FAIL dK"))
    assert "K/V heads" in block and "query heads" in block, block
    junit = (tmp_path / "j.xml").read_text()
    assert 'classname="attnstep.dK" name="kv_head_1"' in junit


def test_the_heat_maps_of_a_kv_stage_are_its_groups(tmp_path):
    pytest.importorskip("matplotlib")
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    in_dir = make_case(tmp_path / "in", dims)
    run_program(in_dir, tmp_path / "out", group_sum=lambda parts: parts[0])
    code, output, _ = check(tmp_path, in_dir, tmp_path / "out", "--stage", "dK", "--plot", tmp_path / "plots")
    assert code == 1, output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["dK_head_0.png", "dK_head_1.png"]


def test_a_group_is_one_job_across_workers(tmp_path):
    """--jobs shares out K/V groups: the report is the same as one process's."""
    dims = Dims(2, 6, N, M, D, D, kv_heads=2)
    in_dir = make_case(tmp_path / "in", dims)
    run_program(in_dir, tmp_path / "out", group_sum=lambda parts: parts[0] + parts[1])
    reports = {}
    for jobs in (1, 3):
        (tmp_path / str(jobs)).mkdir()
        code, output, reports[jobs] = check(tmp_path / str(jobs), in_dir, tmp_path / "out", "--jobs", jobs)
        assert code == 1, output
    assert reports[1]["results"] == reports[3]["results"]


def test_group_memory_and_jobs_follow_the_groups(monkeypatch):
    from verify.check import pool, sizing
    from verify.check.compare import RunInfo

    monkeypatch.setattr(pool, "_usable_cores", lambda: 16)
    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: 64 << 30)
    grouped = RunInfo(Path("."), {}, Dims(1, 12, 512, 512, 64, 64, kv_heads=3), {})
    plain = RunInfo(Path("."), {}, Dims(1, 12, 512, 512, 64, 64), {})
    assert pool.head_jobs(grouped) == 3 and pool.head_jobs(plain) == 12   # a worker a group
    assert pool.head_jobs(grouped, requested=8) == 3
    assert sizing.head_bytes(grouped) > sizing.head_bytes(plain)   # a group's sums and parts besides a head's


# ---- dropout --------------------------------------------------------------------------------------

P = 0.1


def _keeps(dims: Dims, rate: float, seed: int = 5):
    rng = np.random.default_rng(seed)
    return [(rng.random((N, M)) < rate).astype(f64) for _ in range(dims.total_heads)]


@pytest.fixture
def dropout_case(tmp_path):
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    return dims, make_case(tmp_path / "in", dims, Variant(dropout=P, dropout_seed=3))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal-bottom-right"])
def test_a_correct_dropout_program_passes(tmp_path, causal):
    dims = Dims(1, 6, N, M, D, D, kv_heads=2)
    variant = BOTTOM_RIGHT if causal else Variant()
    in_dir = make_case(tmp_path / "in", dims, variant.with_(dropout=P, dropout_seed=3))
    run_program(in_dir, tmp_path / "out", _keeps(dims, 1 - P), P)
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 0 and report["passed"], output
    (rate,) = report["run_checks"]
    visible = int(variant.visible(N, M).sum())   # the hidden entries' draws are not counted
    assert rate["passed"] and rate["visible"] == dims.total_heads * visible
    assert "keeps 90.0000% or 89.8438% ±" in output, output


def test_a_mask_holding_2_fails_at_dropout_mask(tmp_path, dropout_case):
    dims, in_dir = dropout_case
    keeps = _keeps(dims, 1 - P)
    keeps[4][3, 7] = 2.0
    run_program(in_dir, tmp_path / "out", keeps, P)
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 1 and report["first_failing_stage"] == DROPOUT_MASK, output
    first = report["first_failure"]
    assert first["head"] == 4 and first["violations"][0]["code"] == "dropout_not_binary"
    assert "[3, 7] = 2" in first["violations"][0]["message"]


def test_a_mask_keeping_70_percent_at_p_01_fails_the_keep_rate(tmp_path, dropout_case):
    """Every stage is consistent with the program's mask; only its keep rate is wrong."""
    dims, in_dir = dropout_case
    run_program(in_dir, tmp_path / "out", _keeps(dims, 0.7), P)
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 1 and not report["passed"], output
    assert all(r["passed"] for r in report["results"])
    (rate,) = report["run_checks"]
    assert not rate["passed"] and rate["code"] == "dropout_keep_rate"
    assert report["first_failing_stage"] == DROPOUT_MASK
    assert f"kept {rate['kept']} of {rate['visible']}" in output and "± " in output, output


def test_output_without_the_rescale_fails_at_output(tmp_path, dropout_case):
    dims, in_dir = dropout_case
    run_program(in_dir, tmp_path / "out", _keeps(dims, 1 - P), P, rescale=False)
    code, output, report = check(tmp_path, in_dir, tmp_path / "out")
    assert code == 1 and report["first_failing_stage"] == "output", output


def test_without_the_mask_the_stages_that_read_it_are_not_checkable(tmp_path, dropout_case):
    dims, in_dir = dropout_case
    out = tmp_path / "out"
    run_program(in_dir, out, _keeps(dims, 1 - P), P)
    for i in range(dims.total_heads):
        (out / stage_file(DROPOUT_MASK, i, "npy")).unlink()
    code, output, report = check(tmp_path, in_dir, out)
    assert code == 1 and not report["passed"], output
    unchecked = {r["stage"] for r in report["results"] if r["status"] == "UNCHECKABLE"}
    assert {"output", "flash_output", "dS", "dV", "dK", "flash_dV"} <= unchecked
    assert all(r["passed"] for r in report["results"] if r["stage"] in ("QK", "attention_weights", "dP", "flash_lse"))
    lines = [line for line in output.splitlines() if "not checkable" in line]
    assert len(lines) == 2, output   # the failure block and the verdict: one line each


def test_a_flash_attn_8_bit_draw_at_p_01_passes_the_keep_rate_and_a_rate_off_by_more_fails():
    """flash-attn keeps an entry when a random byte is ≤ ⌊255·0.9⌋ = 229: a keep rate of 230/256 =
    89.84%, which over 4M entries is farther from 90% than Hoeffding's band; it must pass, naming
    nothing, while a rate off from both by more still fails, naming both rates."""
    from verify.variant import dropout_keep_band, dropout_keep_rates, dropout_keep_tolerance
    p, total = 0.1, 4_200_000
    assert dropout_keep_rates(p)[1] == 230 / 256
    assert abs(230 / 256 - 0.9) > dropout_keep_band(total)
    byte = np.random.default_rng(3).integers(0, 256, size=total, dtype=np.uint8)
    kept = int(np.count_nonzero(byte <= int(np.floor(np.float32(1 - np.float32(p)) * 255.0))))
    assert dropout_keep_tolerance(kept, total, p) is None
    off = int(round(total * (230 / 256 - 2 * dropout_keep_band(total))))
    why = dropout_keep_tolerance(off, total, p)
    assert why and "90.0000%" in why and "89.8438%" in why, why

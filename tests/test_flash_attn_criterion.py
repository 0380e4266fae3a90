"""flash-attn's test criterion, reported next to the verdict of half-precision checks.

The baseline (verify/check/baseline.py: attention run eagerly in bf16/fp16, as flash-attn's tests run
`attention_ref(..., upcast=False, reorder_ops=True)`) against a computation by hand, rounding step
by step; the criterion in the text, JSON and JUnit reports of correct and planted half runs; none
for fp32; the Python API.
"""
from __future__ import annotations

import json
import math
import struct
import warnings
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import attnstep
from verify.check.baseline import eager_half_attention
from verify.check.flash_attn_criterion import StageCriterion, _quiet_baseline
from verify.check.reference import reference_chain
from verify.check.results import FLASH_ATTN_KEY
from verify.cli.group import cli
from verify.files.case import crc32_hex
from verify.files.generate import generate_case
from verify.model.half import round_to_format
from verify.runs.runner import run_binary
from verify.specs import SPECS
from helpers.foreign_routes import mm_reverse, write_text
from helpers.half_programs import half_program_case
from verify.stages import (CASE_INPUTS, FLASH_OUTPUT, GRAD_KEYS, GRAD_QUERIES, GRAD_VALUES, HALF_PRECISIONS, OUTPUT,
                           RUN_MANIFEST, STAGES, VALUES, Dims, stage_file)

COMPARED = [n for n in STAGES if SPECS[n].baseline is not None]  # what flash-attn's tests compare


# ---- the baseline, by hand ------------------------------------------------------------------

def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _bf16(x: float) -> float:
    """Nearest even of 8 significant bits (normal values, as this test's are)."""
    if x == 0 or math.isinf(x):
        return x
    m, e = math.frexp(x)
    return math.ldexp(round(m * 256), e - 8)  # round(): ties to even, exact on m·256


def _fp16(x: float) -> float:
    return struct.unpack("e", struct.pack("e", x))[0]


def _dot(a, b) -> float:
    """Σ a_i·b_i in float32 (two terms here, so any order rounds alike)."""
    acc = 0.0
    for x, y in zip(a, b):
        acc = _f32(acc + _f32(x * y))
    return acc


def _by_hand(q, k, v, do, scale, causal, h):
    """flash-attn's eager half attention, one rounding at a time: every op's float32 result stored
    in the format (h), the softmax in float32; then autograd through the same ops."""
    n, m = len(q), len(k)
    col = lambda a, j: [row[j] for row in a]  # noqa: E731
    ks = [[h(_f32(x * scale)) for x in row] for row in k]
    s = [[-math.inf if causal and j > i else h(_dot(q[i], ks[j])) for j in range(m)] for i in range(n)]
    p = []
    for row in s:
        top = max(row)
        e = [0.0 if x == -math.inf else _f32(math.exp(_f32(x - top))) for x in row]
        total = _dot(e, [1.0] * m)
        p.append([h(_f32(x / total)) for x in e])
    out = [[h(_dot(p[i], col(v, c))) for c in range(len(v[0]))] for i in range(n)]
    dp = [[h(_dot(do[i], v[j])) for j in range(m)] for i in range(n)]
    dv = [[h(_dot(col(p, j), col(do, c))) for c in range(len(do[0]))] for j in range(m)]
    ds = []
    for pi, dpi in zip(p, dp):
        g = [h(_f32(x * y)) for x, y in zip(pi, dpi)]  # P∘dP, stored: softmax's backward at half
        rowsum = _dot(g, [1.0] * m)
        ds.append([h(_f32(gx - _f32(x * rowsum))) for gx, x in zip(g, pi)])
    dq = [[h(_dot(ds[i], col(ks, c))) for c in range(len(k[0]))] for i in range(n)]
    dk = [[h(_f32(h(_dot(col(ds, j), col(q, c))) * scale)) for c in range(len(k[0]))] for j in range(m)]
    return {OUTPUT: out, GRAD_QUERIES: dq, GRAD_KEYS: dk, GRAD_VALUES: dv}


@pytest.mark.parametrize("precision,causal", [("bf16", False), ("fp16", True), ("bf16", True)])
def test_the_baseline_rounds_every_op_as_eager_half_attention(precision, causal):
    """On 2x2 cases (two-term sums: every summation order rounds alike) the baseline equals the
    computation by hand bit for bit, and differs from the exact attention rounded once at the end."""
    h = _bf16 if precision == "bf16" else _fp16
    scale = _f32(0.7)
    rounded_once = []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        q, k, v, do = (round_to_format(rng.uniform(-2, 2, (2, 2)).astype(np.float32), precision) for _ in range(4))
        want = _by_hand(q.tolist(), k.tolist(), v.tolist(), do.tolist(), scale, causal, h)
        got = eager_half_attention(q, k, v, do, scale, causal, precision)
        assert set(got) == set(want)
        for name, mat in want.items():
            np.testing.assert_array_equal(got[name], np.array(mat, np.float32), err_msg=f"{name}, seed {seed}")
        exact = reference_chain(dict(zip(CASE_INPUTS, (q, k, v, do))), scale, causal, want)
        rounded_once += [np.array_equal(got[n], round_to_format(exact[n], precision)) for n in want]
        assert set(eager_half_attention(q, k, v, None, scale, causal, precision)) == {OUTPUT}
    assert not all(rounded_once)


def test_an_overflowing_fp16_baseline_meets_nothing_and_warns_nothing():
    """Scores past fp16's 65504 make the eager baseline's softmax NaN (flash-attn's test then
    compares with NaN and fails): the criterion is missed, its ratio infinite, and NumPy's overflow
    warnings stay out of the user's output."""
    big = np.full((4, 8), 200.0, np.float32)
    ctx = SimpleNamespace(scale=1.0, causal=False, precision="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        baseline = _quiet_baseline(big, big, big, big, ctx)
    assert np.isnan(baseline[OUTPUT]).all()
    missed = StageCriterion(OUTPUT, error=0.0, baseline_error=math.inf, factor=2.0, slack=1e-5)
    assert not missed.meets and missed.ratio == math.inf
    # Said as the baseline's failure, not as an infinite allowance the program somehow missed.
    assert missed.outcome("fp16").startswith("misses: the eager fp16 baseline overflowed")
    assert missed.to_json()["baseline_overflowed"] is True
    met = StageCriterion(OUTPUT, error=2e-3, baseline_error=1e-3, factor=2.0, slack=1e-5)
    assert met.meets and met.ratio == 2.0 and met.rule() == "2 x baseline + 1e-5"
    assert met.outcome("fp16") == "meets (2 x baseline + 1e-5 allowed)" and not met.to_json()["baseline_overflowed"]


def _torch_reference(torch, q, k, v, do, causal):
    """flash-attn's tests' `attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)`
    for one head without padding or dropout (the mask top-left aligned, as attnstep's), autograd
    for the gradients: (output, dQ, dK, dV) as float32 NumPy arrays."""
    d = q.shape[-1]
    scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if causal:
        scores.masked_fill_(torch.triu(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device), 1),
                            float("-inf"))
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bhts,bshd->bthd", attention, v * 1.0)
    out.backward(do)
    return [x.detach().float().cpu().numpy()[0, :, 0, :] for x in (out, q.grad, k.grad, v.grad)]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("d,causal", [(64, False), (40, True)])
def test_the_baseline_is_flash_attns_pytorch_reference(precision, d, causal):
    """The NumPy baseline against flash-attn's own reference code run by PyTorch on the GPU: the
    same roundings, so the values agree but where a float32 sum in another order rounds to another
    half value (a few elements, a few half units at most)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    rng = np.random.default_rng(d)
    n, m = 113, 203
    q, k, v, do = (round_to_format(rng.standard_normal(s).astype(np.float32), precision).astype(np.float32)
                   for s in ((n, d), (m, d), (m, d), (n, d)))
    tensors = [torch.tensor(x[None, :, None, :], dtype=dtype, device="cuda", requires_grad=i < 3)
               for i, x in enumerate((q, k, v, do))]
    theirs = _torch_reference(torch, *tensors, causal)
    scale = float(np.float32(1.0) / np.float32(math.sqrt(d)))  # PyTorch divides by multiplying so
    ours = eager_half_attention(q, k, v, do, scale, causal, precision)
    unit = 2.0 ** -(8 if precision == "bf16" else 11)
    for name, mat in zip((OUTPUT, GRAD_QUERIES, GRAD_KEYS, GRAD_VALUES), theirs):
        same = np.mean(ours[name] == mat)
        worst = np.max(np.abs(ours[name] - mat)) / (unit * np.max(np.abs(mat)))
        assert same >= 0.95 and worst <= 8, f"{name}: {same:.1%} equal, up to {worst:.2g} half units apart"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_a_cuda_half_run_meets_flash_attns_criterion(binary, tmp_path, precision):
    """The CUDA backend's half stages (cuBLAS GEMMs on half operands; a half flash kernel where the
    build and GPU have one) are within flash-attn's criterion, which the report gives for each."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    generate_case(in_dir, Dims(1, 4, 256, 512, 64, 64), seed=8, causal=True, backward=True, distribution="normal")
    run_binary(binary, in_dir, out_dir, backend="cuda", extra=("--precision", precision))
    code, output, rep, props = _check(in_dir, out_dir, tmp_path)
    assert code == 0, output
    stages = [s["stage"] for s in rep[FLASH_ATTN_KEY]["stages"]]
    assert OUTPUT in stages and GRAD_QUERIES in stages and rep[FLASH_ATTN_KEY]["meets"], output
    assert props[FLASH_ATTN_KEY] == "meets"


# ---- the reports ----------------------------------------------------------------------------

def _half_run(binary, tmp_path, precision="bf16", dims=Dims(1, 2, 40, 50, 32, 32), v_scale=None):
    """A correct CPU-backend run with the backward (npy files); v_scale: head 0's V times it."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    generate_case(in_dir, dims, seed=5, backward=True, distribution="normal", fmt="npy")
    if v_scale is not None:
        path = in_dir / stage_file(VALUES, 0, "npy")
        np.save(path, np.load(path) * np.float32(v_scale))
    run_binary(binary, in_dir, out_dir, backend="cpu", extra=("--precision", precision))
    return in_dir, out_dir


def _check(in_dir, out_dir, tmp_path, *args):
    json_path, junit_path = tmp_path / "r.json", tmp_path / "r.xml"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--json", str(json_path),
                                 "--junit", str(junit_path), *args], catch_exceptions=False)
    suite = ET.parse(junit_path).getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    return r.exit_code, r.output, json.loads(json_path.read_text()), props


def _plant(out_dir, stage, head, at, delta):
    """Adds delta to one element of a stage file, and its CRC to run.toml, as a buggy binary would."""
    path = out_dir / stage_file(stage, head, "npy")
    x = np.load(path)
    x[at] += np.float32(delta)
    np.save(path, x)
    key = f"crc32_{stage}_head_{head}"
    lines = [f'{key} = "{crc32_hex(path.read_bytes())}"' if ln.startswith(key + " ") else ln
             for ln in (out_dir / RUN_MANIFEST).read_text().splitlines()]
    (out_dir / RUN_MANIFEST).write_text("\n".join(lines) + "\n")


def _criterion_rows(output):
    """stage -> (yours, baseline, ratio, verdict word) from the text block."""
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("flash-attn's test criterion"))
    return {f[0]: (f[1], f[2], f[3], f[4]) for f in (ln.split() for ln in lines[start + 3:]) if f and f[0] in STAGES}


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_a_correct_half_run_meets_flash_attns_criterion(binary, tmp_path, precision):
    in_dir, out_dir = _half_run(binary, tmp_path, precision)
    code, output, rep, props = _check(in_dir, out_dir, tmp_path)
    assert code == 0, output
    block = rep[FLASH_ATTN_KEY]
    assert block["informational"] and block["meets"] and precision in block["reference"]
    assert [s["stage"] for s in block["stages"]] == COMPARED
    rows = _criterion_rows(output)
    for s in block["stages"]:
        assert s["meets"] and 0 < s["baseline_error"] and s["error"] <= s["allowed"], s
        assert s["factor"] == (3.0 if STAGES[s["stage"]].backward else 2.0)
        per_head = [r[FLASH_ATTN_KEY] for r in rep["results"] if r["stage"] == s["stage"]]
        assert s["error"] == max(x["error"] for x in per_head)
        assert s["baseline_error"] == max(x["baseline_error"] for x in per_head)
        assert rows[s["stage"]][3] == "meets"
        assert float(rows[s["stage"]][0]) == pytest.approx(s["error"], rel=5e-3)
        assert float(props[f"{FLASH_ATTN_KEY}.{s['stage']}.baseline_error"]) == s["baseline_error"]
    assert props[FLASH_ATTN_KEY] == "meets"
    quiet = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet"]).output
    assert quiet.splitlines()[-1] == f"flash-attn's test criterion (informational): met by all {len(COMPARED)} stages"


def test_a_planted_error_beyond_twice_the_baseline_misses_it(binary, tmp_path):
    """One flash_output element moved by 5x the baseline's largest error: flash-attn's criterion
    misses there, in every report, and attnstep's verdict fails that stage."""
    in_dir, out_dir = _half_run(binary, tmp_path)
    b = next(s for s in _check(in_dir, out_dir, tmp_path)[2][FLASH_ATTN_KEY]["stages"]
             if s["stage"] == FLASH_OUTPUT)["baseline_error"]
    x = np.load(out_dir / stage_file(FLASH_OUTPUT, 1, "npy"))
    at = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    _plant(out_dir, FLASH_OUTPUT, 1, at, 5 * b * np.sign(x[at]))
    code, output, rep, props = _check(in_dir, out_dir, tmp_path)
    assert code == 1 and rep["first_failing_stage"] == FLASH_OUTPUT, output
    stages = {s["stage"]: s for s in rep[FLASH_ATTN_KEY]["stages"]}
    assert not stages[FLASH_OUTPUT]["meets"] and stages[FLASH_OUTPUT]["ratio"] > 2
    assert stages[FLASH_OUTPUT]["error"] > 2 * b + 1e-5 and not rep[FLASH_ATTN_KEY]["meets"]
    assert all(s["meets"] for n, s in stages.items() if n != FLASH_OUTPUT)
    assert _criterion_rows(output)[FLASH_OUTPUT][3] == "misses"
    assert props[FLASH_ATTN_KEY] == "misses" and props[f"{FLASH_ATTN_KEY}.{FLASH_OUTPUT}.meets"] == "false"
    quiet = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet"]).output
    assert quiet.splitlines()[-1].startswith(f"flash-attn's test criterion (informational): missed by {FLASH_OUTPUT} ")


def test_a_small_error_failing_the_verdict_shows_both_values(binary, tmp_path):
    """flash-attn's criterion takes the largest error over all heads: with head 0's values 64x
    larger, an error on head 1 far beyond its own bounds is still within twice the baseline's
    (head 0's) error. attnstep fails it; the criterion meets it; both reports say so, with the same
    numbers, and the planted error is the one the criterion measured on head 1."""
    in_dir, out_dir = _half_run(binary, tmp_path, v_scale=64)
    clean = {s["stage"]: s for s in _check(in_dir, out_dir, tmp_path)[2][FLASH_ATTN_KEY]["stages"]}
    b = clean[OUTPUT]["baseline_error"]
    x = np.load(out_dir / stage_file(OUTPUT, 1, "npy"))
    at = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    _plant(out_dir, OUTPUT, 1, at, b / 2 * np.sign(x[at]))
    code, output, rep, props = _check(in_dir, out_dir, tmp_path)
    assert code == 1 and rep["first_failing_stage"] == OUTPUT, output
    crit = next(s for s in rep[FLASH_ATTN_KEY]["stages"] if s["stage"] == OUTPUT)
    head1 = next(r for r in rep["results"] if r["stage"] == OUTPUT and r["head"] == 1)
    assert head1["status"] == "FAIL" and head1[FLASH_ATTN_KEY]["error"] >= 0.45 * b
    assert crit["meets"] and crit["baseline_error"] == b
    assert crit["error"] == max(clean[OUTPUT]["error"], head1[FLASH_ATTN_KEY]["error"])
    assert _criterion_rows(output)[OUTPUT][3] == "meets"
    assert props[f"{FLASH_ATTN_KEY}.{OUTPUT}.meets"] == "true"


def test_fp32_runs_have_no_flash_attn_criterion(binary, tmp_path):
    in_dir, out_dir = _half_run(binary, tmp_path, precision="fp32")
    code, output, rep, props = _check(in_dir, out_dir, tmp_path)
    assert code == 0 and "flash-attn" not in output, output
    assert rep[FLASH_ATTN_KEY] is None and not any(FLASH_ATTN_KEY in r for r in rep["results"])
    assert not any(name.startswith("flash_attn") for name in props)


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_a_program_we_did_not_write_gets_the_criterion(tmp_path, precision):
    """Another bf16/fp16 program (NumPy, sums in reverse order, FlashAttention-style key tiles of
    32), no run.toml, its outputs alone, printed with %g: `check --precision` passes it and reports
    flash-attn's criterion for both output stages, met."""
    in_dir, out_dir = half_program_case(tmp_path, precision, mm_reverse, False, fmt="txt")
    for path in out_dir.iterdir():
        if path.name not in {stage_file(n, h, "txt") for n in (OUTPUT, FLASH_OUTPUT) for h in range(2)}:
            path.unlink()
        else:
            write_text(path, np.loadtxt(path, ndmin=2), "%g")
    json_path = tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--precision", precision,
                                 "--json", str(json_path)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    block = json.loads(json_path.read_text())[FLASH_ATTN_KEY]
    assert [s["stage"] for s in block["stages"]] == [OUTPUT, FLASH_OUTPUT] and block["meets"], block
    assert all(0 < s["baseline_error"] and math.isfinite(s["ratio"]) for s in block["stages"]), block
    assert "flash-attn's test criterion" in r.output


def test_a_correct_program_on_inputs_that_overflow_the_fp16_baseline_is_told_why_it_misses(tmp_path):
    """Scores past fp16's range make the eager baseline NaN, whatever the program: `check` passes an
    exactly rounded output and says the criterion is missed because the baseline overflowed, in
    the table, the one-line summary and the JSON (with no bare Infinity)."""
    dims = Dims(1, 1, 16, 24, 64, 64)
    in_dir = tmp_path / "in"
    generate_case(in_dir, dims, seed=4, distribution="normal")
    inputs = {}
    for n in CASE_INPUTS[:3]:
        x = np.loadtxt(in_dir / stage_file(n, 0, "txt"), ndmin=2) * (150.0 if n != CASE_INPUTS[2] else 1.0)
        inputs[n] = round_to_format(x.astype(np.float32), "fp16")
        write_text(in_dir / stage_file(n, 0, "txt"), inputs[n], "%.9g")
    ref = reference_chain(inputs, dims.d_k ** -0.5, False, [FLASH_OUTPUT])[FLASH_OUTPUT]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    write_text(out_dir / stage_file(FLASH_OUTPUT, 0, "txt"), round_to_format(ref, "fp16"), "%g")
    json_path = tmp_path / "r.json"
    args = ["check", "--in", str(in_dir), "--out", str(out_dir), "--precision", "fp16"]
    r = CliRunner().invoke(cli, args + ["--json", str(json_path)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "misses: the eager fp16 baseline overflowed (NaN)" in r.output, r.output
    text = json_path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    stage = json.loads(text)[FLASH_ATTN_KEY]["stages"][0]
    assert stage["baseline_overflowed"] is True and stage["meets"] is False
    quiet = CliRunner().invoke(cli, args + ["--quiet"], catch_exceptions=False)
    assert "the eager fp16 baseline overflowed on these inputs" in quiet.output, quiet.output


def test_the_python_api_reports_the_criterion():
    """The baseline's own output, checked as a program's, is exactly as far from the reference as
    the baseline: ratio 1, and it meets the criterion; at fp32 there is none."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 24, 16)).astype(np.float32) for _ in range(3))
    h = [round_to_format(x, "bf16") for x in (q, k, v)]
    o = np.stack([eager_half_attention(*(x[i] for x in h), None, 0.25, True, "bf16")[OUTPUT] for i in range(2)])
    report = attnstep.check_arrays(q, k, v, {OUTPUT: o}, causal=True, scale=0.25, precision="bf16")
    (crit,) = attnstep.flash_attn_criterion(report)
    assert crit.stage == OUTPUT and crit.meets and crit.ratio == 1.0 and crit.error > 0
    assert "flash-attn's test criterion" in attnstep.format_report(report)
    assert attnstep.flash_attn_criterion(attnstep.check_arrays(q, k, v, {OUTPUT: o}, causal=True, scale=0.25)) == []


def test_a_grouped_k_v_head_s_gradients_get_the_criterion():
    """K/V with fewer heads (GQA): dK and dV are the group's sums, and flash-attn's criterion covers
    them too, against the eager baseline's parts summed: the baseline itself, checked as a program
    (each query head's part, summed and rounded once), meets it at ratio 1."""
    rng = np.random.default_rng(4)
    q, do = (round_to_format(rng.standard_normal((1, 4, 24, 16)), "bf16").astype(np.float32) for _ in range(2))
    k, v = (round_to_format(rng.standard_normal((1, 2, 30, 16)), "bf16").astype(np.float32) for _ in range(2))
    parts = [eager_half_attention(q[0, h], k[0, h // 2], v[0, h // 2], do[0, h], 0.25, False, "bf16") for h in range(4)]
    summed = {n: np.stack([round_to_format(parts[2 * g][n].astype(np.float64) + parts[2 * g + 1][n], "bf16")
                           for g in range(2)])[None] for n in (GRAD_KEYS, GRAD_VALUES)}
    stages = {"flash_dQ": np.stack([p[GRAD_QUERIES] for p in parts])[None], "flash_dK": summed[GRAD_KEYS],
              "flash_dV": summed[GRAD_VALUES]}
    report = attnstep.check_arrays(q, k, v, stages, do=do, scale=0.25, precision="bf16")
    crits = {c.stage: c for c in attnstep.flash_attn_criterion(report)}
    assert set(crits) == {"flash_dQ", "flash_dK", "flash_dV"}, attnstep.format_report(report)
    assert all(c.meets and c.ratio == 1.0 for c in crits.values()), [(c.stage, c.ratio) for c in crits.values()]


@pytest.mark.parametrize("fn", [attnstep.format_report, attnstep.flash_attn_criterion])
@pytest.mark.parametrize("given", ["a report's text", None, {"passed": True}])
def test_the_report_functions_refuse_what_is_not_a_report_in_one_line(fn, given):
    with pytest.raises(TypeError, match=r"^report: expected the Report that check_arrays returns, got "):
        fn(given)


def test_format_report_wants_per_head_as_true_or_false():
    q, k, v, o = (np.full((1, 4, 8), 0.5, np.float32) for _ in range(4))
    report = attnstep.check_arrays(q, k, v, {OUTPUT: o})
    with pytest.raises(TypeError, match=r"^per_head: expected True or False, got str 'no'$"):
        attnstep.format_report(report, per_head="no")
    assert attnstep.format_report(report, per_head=np.bool_(True))

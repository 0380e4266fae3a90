"""The precision mistakes real programs make, each planted by a NumPy program of its own kind.

A program that runs its GEMMs on TF32 tensor cores (llm.c's cuBLAS attention, PyTorch's allow_tf32),
one that stores its stages in bf16 or fp16, one that accumulates its sums in fp16, and a bf16 one that
converts by truncation (`bits >> 16`): each fails under the bounds that do not fit it, naming what it
did first, and passes under the ones that do (check --precision, --half-rounding). Each emulation is
written here, independent of the verifier's own rounding code.
"""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import attnstep
from verify.cli.group import cli
from verify.files.generate import generate_case
from verify.model.half import round_to_format32
from verify.stages import INPUT_NAMES, OUTPUT, SCALED_SCORES, SCORES, WEIGHTS, Dims, stage_file
from verify.text import number_pair

from helpers.foreign_routes import write_text

f32 = np.float32
HEADS, N, M, D = 2, 48, 64, 64
SCALE = D ** -0.5
PATH = (SCORES, SCALED_SCORES, WEIGHTS, OUTPUT)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((HEADS, rows, D)).astype(f32) for rows in (N, M, M))


# ---- roundings, written from their definitions -------------------------------------------------

def tf32(x):
    """float32 → TF32 (10 stored mantissa bits), nearest even, as a tensor core's operand."""
    bits = np.ascontiguousarray(x, f32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) >> 13 << 13).astype(np.uint32).view(f32)


def bf16_nearest(x):
    bits = np.ascontiguousarray(x, f32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(f32)


def bf16_truncated(x):
    """The `bits >> 16` conversion: the 16 low bits dropped, toward zero."""
    return (np.ascontiguousarray(x, f32).view(np.uint32) >> 16 << 16).astype(np.uint32).view(f32)


def fp16(x):
    return np.asarray(x, f32).astype(np.float16).astype(f32)


def fp16_accumulating_matmul(a, b):
    """A kernel with a __half accumulator: products and partial sums in fp16, k in index order."""
    a, b = np.asarray(a, np.float16), np.asarray(b, np.float16)
    acc = np.zeros((a.shape[0], b.shape[1]), np.float16)
    for k in range(a.shape[1]):
        acc = acc + a[:, k, None] * b[None, k, :]
    return acc.astype(f32)


# ---- the programs: the stage path, one head, with their arithmetic -----------------------------

def softmax32(s):
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True, dtype=f32)).astype(f32)


def program(q, k, v, matmul, store):
    """QK, QK_scaled, attention_weights, output: each GEMM by `matmul`, each stage stored by `store`."""
    q, k, v = store(q), store(k), store(v)
    qk = store(matmul(q, k.T))
    s = store(qk * f32(SCALE))
    p = store(softmax32(s))
    return {SCORES: qk, SCALED_SCORES: s, WEIGHTS: p, OUTPUT: store(matmul(p, v))}


PROGRAMS = {
    "tf32-gemm": (lambda a, b: (tf32(a) @ tf32(b)).astype(f32), lambda x: np.asarray(x, f32)),
    "bf16-storage": (lambda a, b: (a @ b).astype(f32), bf16_nearest),
    "fp16-storage": (lambda a, b: (a @ b).astype(f32), fp16),
    "fp16-accumulation": (fp16_accumulating_matmul, fp16),
    "bf16-truncation": (lambda a, b: (a @ b).astype(f32), bf16_truncated),
}


def stages_of(name, seed=0):
    matmul, store = PROGRAMS[name]
    q, k, v = inputs(seed)
    heads = [program(q[h], k[h], v[h], matmul, store) for h in range(HEADS)]
    return (q, k, v), {s: np.stack([h[s] for h in heads]) for s in PATH}


def check(name, **kw):
    (q, k, v), stages = stages_of(name)
    return attnstep.check_arrays(q, k, v, stages, **kw)


def first_diagnosis(report):
    first = report.first_failure
    return first.stage, [d.code for d in first.diagnosis], first


def tol_used(report):
    return max(r.main.tol_used for r in report.results if r.main is not None)


# (program, diagnosis named at fp32, the check it passes under)
PLANTED = [
    ("tf32-gemm", "tf32", dict(precision="tf32")),
    ("bf16-storage", "half_storage", dict(precision="bf16")),
    ("fp16-storage", "half_storage", dict(precision="fp16")),
    ("bf16-truncation", "half_truncation", dict(precision="bf16", half_rounding="toward-zero")),
]


@pytest.mark.parametrize("name,code,passes_under", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_precision_mistake_is_named_and_its_precision_passes(name, code, passes_under):
    report = check(name)
    stage, codes, first = first_diagnosis(report)
    assert not report.passed and stage == SCORES and codes[:1] == [code], (stage, codes)
    assert "scaled" not in codes
    words = passes_under["precision"] if code != "half_truncation" else "--half-rounding toward-zero"
    assert words in first.diagnosis[0].message, first.diagnosis[0].message
    passed = check(name, **passes_under)
    assert passed.passed, attnstep.format_report(passed)


def test_fp16_accumulation_is_named_for_what_no_precision_covers():
    report = check("fp16-accumulation")
    stage, codes, first = first_diagnosis(report)
    assert stage == SCORES and codes[:1] == ["half_accumulation"], (stage, codes)
    assert "CUBLAS_COMPUTE_32F" in first.diagnosis[0].message
    assert not check("fp16-accumulation", precision="fp16").passed  # its errors exceed one fp16 rounding
    out = check("fp16-accumulation", precision="fp16").first_failure
    assert [d.code for d in out.diagnosis][:1] == ["half_accumulation"], [d.message for d in out.diagnosis]


def test_truncation_checked_as_rounding_is_named_truncation_not_a_scale():
    """A truncating bf16 program checked at --precision bf16 (to nearest): every value shrinks by
    half a bf16 unit on average, which looks like a factor 0.998; it is named truncation."""
    report = check("bf16-truncation", precision="bf16")
    stage, codes, first = first_diagnosis(report)
    assert stage == SCORES and codes == ["half_truncation"], [d.message for d in first.diagnosis]
    assert first.diagnosis[0].detail["bias_ulps"] > 0.25


def test_truncation_of_bf16_inputs_fails_qk_by_twice_its_bound_and_is_not_a_scale():
    """Inputs that are bf16 values already (truncating them changes nothing): the truncated QK
    misses the bf16 bound by about 2x, the shape of a factor 0.998, and is named truncation."""
    q, k, v = (bf16_nearest(x) for x in inputs(0))
    matmul, store = PROGRAMS["bf16-truncation"]
    heads = [program(q[h], k[h], v[h], matmul, store) for h in range(HEADS)]
    stages = {s: np.stack([h[s] for h in heads]) for s in PATH}
    report = attnstep.check_arrays(q, k, v, stages, precision="bf16")
    qk = [r for r in report.results if r.stage == SCORES]
    assert all(1 < r.main.tol_used < 4 and [d.code for d in r.diagnosis] == ["half_truncation"] for r in qk), \
        [(r.main.tol_used, [d.message for d in r.diagnosis]) for r in qk]
    assert attnstep.check_arrays(q, k, v, stages, precision="bf16", half_rounding="toward-zero").passed


def _truncated(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 by dropping the low 16 bits (toward zero)."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def test_a_truncating_flash_output_with_entries_near_zero_is_named_truncation():
    """A bf16 flash forward that truncates its inputs, P and output: its output's entries near 0
    (below the error of P in bf16) may take the other sign, the rest lie up to a bf16 unit nearer
    0. Checked as rounding to nearest, the output is named truncation all the same, and so is its
    float32 lse, from the truncated inputs."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 100, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 130, 64)).astype(np.float32) for _ in range(2))
    out, lse = [], []
    for h in range(2):
        s = (_truncated(q[h]) @ _truncated(k[h]).T) * np.float32(0.125)
        mx = s.max(axis=1, keepdims=True)
        p = np.exp(s - mx)
        l = p.sum(axis=1, keepdims=True)
        out.append(_truncated((_truncated(p) @ _truncated(v[h])) / l))
        lse.append((mx + np.log(l))[:, 0])
    stages = {"flash_output": np.stack(out), "flash_lse": np.stack(lse)}
    assert (np.stack(out) * np.stack(out) < 1e-6).any()  # (entries near 0)
    report = attnstep.check_arrays(q, k, v, stages, precision="bf16")
    first = report.first_failure
    assert first.stage == "flash_output" and [d.code for d in first.diagnosis][:1] == ["half_truncation"], \
        [d.message for d in first.diagnosis]
    lse = [r for r in report.results if r.stage == "flash_lse"]  # (float32, from the truncated Q and K)
    assert lse and all(r.status == "FAIL" and [d.code for d in r.diagnosis] == ["half_truncation"] for r in lse), \
        [(r.status, [d.message for d in r.diagnosis]) for r in lse]
    assert "computed from bf16 values truncated" in lse[0].diagnosis[0].message
    assert attnstep.check_arrays(q, k, v, stages, precision="bf16", half_rounding="toward-zero").passed


def _rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    return x.astype(np.float32).astype(np.float16).astype(np.float32) if fmt == "fp16" else \
        round_to_format32(x.astype(np.float32), "bf16")


def _half_inputs(seed: int, n: int, m: int, d: int):
    """Two heads of queries at logits of a few tens (three times N(0, 1)), keys and values."""
    rng = np.random.default_rng(seed)
    q = (3 * rng.standard_normal((2, n, d))).astype(np.float32)
    return (q, *(rng.standard_normal((2, m, d)).astype(np.float32) for _ in range(2)))


def _half_flash_forward(q, k, v, fmt: str, scores_rounded: bool, before_scale: bool = False, exp2_prescaled=None,
                        rounded_sum: bool = False):
    """A half flash forward as a kernel computes it (inputs, P and output in the format; the row sum
    and lse in float32), its score tile kept in the format where scores_rounded (Q·Kᵀ rounded before
    the scale where before_scale); exp2_prescaled (False or True): Q times the scale (and log2 e:
    an exp2 kernel) stored in the format before Q·Kᵀ, as Triton's fused-attention tutorial did;
    rounded_sum: the row sum l of P after its conversion to the format."""
    out, lse = [], []
    scale = np.float32(1 / np.sqrt(q.shape[2]))
    for h in range(q.shape[0]):
        if exp2_prescaled is not None:
            c = scale * np.float32(1 / np.log(2)) if exp2_prescaled else scale
            s = _rounded(_rounded(q[h], fmt) * c, fmt) @ _rounded(k[h], fmt).T  # (in units of c/scale)
            ex, log, unit = (np.exp2, np.log2, np.float32(np.log(2))) if exp2_prescaled else (np.exp, np.log, 1)
        else:
            s = _rounded(q[h], fmt) @ _rounded(k[h], fmt).T
            s = _rounded(s, fmt) * scale if scores_rounded and before_scale else s * scale
            s = _rounded(s, fmt) if scores_rounded and not before_scale else s
            ex, log, unit = np.exp, np.log, 1
        mx = s.max(axis=1, keepdims=True)
        p = ex(s - mx)
        l = (_rounded(p, fmt) if rounded_sum else p).sum(axis=1, keepdims=True)
        out.append(_rounded((_rounded(p, fmt) @ _rounded(v[h], fmt)) / l, fmt))
        lse.append(((mx + log(l)) * unit)[:, 0])
    return {"flash_output": np.stack(out), "flash_lse": np.stack(lse)}


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_scores_kept_in_the_half_format_are_named(fmt):
    """A half flash kernel that keeps its score tile in the format (a bf16 S buffer, a cast before
    the exponent): the lse fails at a hundred of its bounds or more, the output at a few (logits of
    a few tens), both named; the same kernel with float32 scores passes."""
    q, k, v = _half_inputs(5, 100, 130, 64)
    assert attnstep.check_arrays(q, k, v, _half_flash_forward(q, k, v, fmt, False), precision=fmt).passed
    report = attnstep.check_arrays(q, k, v, _half_flash_forward(q, k, v, fmt, True), precision=fmt)
    failed = [r for r in report.results if r.status == "FAIL"]
    assert {r.stage for r in failed} == {"flash_output", "flash_lse"}, \
        [(r.stage, r.chained.tol_used) for r in report.results]
    assert all([d.code for d in r.diagnosis] == ["scores_rounded"] for r in failed), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    assert f"scores rounded to {fmt} before the softmax" in failed[0].diagnosis[0].message
    alone = attnstep.check_arrays(q, k, v, {"flash_lse": _half_flash_forward(q, k, v, fmt, True)["flash_lse"]},
                                  precision=fmt)  # (no stage of the format's values to tell it by)
    assert all([d.code for d in r.diagnosis] == ["scores_rounded"] for r in alone.results), alone.results


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_scores_rounded_before_a_scale_that_is_no_power_of_two_are_named(fmt):
    """d = 128: Q·Kᵀ rounded to the format, then scaled by 2^-3.5 (not the same values as the
    scaled scores rounded)."""
    q, k, v = _half_inputs(6, 90, 110, 128)
    report = attnstep.check_arrays(q, k, v, _half_flash_forward(q, k, v, fmt, True, before_scale=True), precision=fmt)
    failed = [r for r in report.results if r.status == "FAIL"]
    assert failed and all([d.code for d in r.diagnosis] == ["scores_rounded"] for r in failed), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    assert "Q·Kᵀ rounded, then scaled" in failed[0].diagnosis[0].message


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("exp2", [False, True])
def test_a_query_scaled_and_stored_in_the_half_format_is_named(fmt, exp2):
    """Triton's fused-attention tutorial: q = (q * qk_scale).to(fp16), qk_scale the softmax scale
    times log2 e for its exp2 (or the scale alone, for exp): every product of a score carries a
    rounding of the format. Named on the stages that fail, with the factor; not scores_rounded.
    (d = 128: a scale of 2^-3.5, which Q's values do not keep exactly.)"""
    q, k, v = _half_inputs(7, 100, 130, 128)
    report = attnstep.check_arrays(q, k, v, _half_flash_forward(q, k, v, fmt, False, exp2_prescaled=exp2),
                                   precision=fmt)
    failed = [r for r in report.results if r.status == "FAIL"]
    lse = [r for r in failed if r.stage == "flash_lse"]
    assert len(lse) == 2 and all([d.code for d in r.diagnosis] == ["prescaled_rounded"] for r in lse), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    # (an output that fails by a few of its bounds is named where the candidate is far closer)
    assert all([d.code for d in r.diagnosis] in (["prescaled_rounded"], []) for r in failed), failed
    words = "Q·scale·log2 e" if exp2 else "Q·scale in"
    assert words in lse[0].diagnosis[0].message, lse[0].diagnosis[0].message


@pytest.mark.parametrize("fmt", ["bf16"])
def test_a_row_sum_of_the_rounded_weights_is_named(fmt):
    """l summed from P after its conversion to the format (the P that P·V reads): the lse moves by
    the weights' roundings, far past its float32 bound, and is named for it. (At fp16 the same
    kernel fails its lse by a few bounds, where the candidate, whose weights round on either side
    of a tie as float64 values do, is not four times closer than the reference: unnamed.)"""
    q, k, v = _half_inputs(8, 100, 130, 64)
    report = attnstep.check_arrays(q, k, v, _half_flash_forward(q, k, v, fmt, False, rounded_sum=True),
                                   precision=fmt)
    lse = [r for r in report.results if r.stage == "flash_lse"]
    assert all(r.status == "FAIL" and [d.code for d in r.diagnosis] == ["row_sum_rounded"] for r in lse), \
        [(r.stage, r.status, [d.message for d in r.diagnosis]) for r in report.results]


def test_a_rounding_bf16_program_checked_as_truncating_is_told_to_round():
    """toward-zero bounds assume the inputs were truncated too: a program that rounds them fails
    there, and is told that rounding to nearest explains it."""
    assert check("bf16-storage", precision="bf16").passed
    report = check("bf16-storage", precision="bf16", half_rounding="toward-zero")
    stage, codes, first = first_diagnosis(report)
    assert codes[:1] == ["half_storage"] and "without --half-rounding" in first.diagnosis[0].message, codes


@pytest.mark.parametrize("bug", ["unscaled-qk", "v-transposed"])
def test_a_real_bug_in_a_tf32_program_is_not_excused(bug):
    """A TF32 program with a real bug still fails under --precision tf32, and at fp32 the bug, not
    the precision, is named."""
    (q, k, v), stages = stages_of("tf32-gemm")
    if bug == "unscaled-qk":
        bugged, code = SCALED_SCORES, "scaled"
        stages[SCALED_SCORES] = stages[SCORES].copy()
    else:
        bugged, code = OUTPUT, "layout"
        stages[OUTPUT] = np.stack([(tf32(stages[WEIGHTS][h]) @ tf32(v[h].T.reshape(M, D))).astype(f32)
                                   for h in range(HEADS)])
    for precision in ("fp32", "tf32"):
        report = attnstep.check_arrays(q, k, v, stages, precision=precision)
        bad = [r for r in report.results if r.stage == bugged]
        named = [[d.code for d in r.diagnosis] for r in bad]
        assert all(not r.passed and "tf32" not in c for r, c in zip(bad, named)), named
        if precision == "tf32":  # the bounds that fit the program's arithmetic name the bug
            assert all(c[:1] == [code] for c in named), named


def test_half_rounding_is_refused_where_nothing_is_converted(tmp_path):
    (q, k, v), stages = stages_of("tf32-gemm")
    with pytest.raises(ValueError, match="half-precision checks only"):
        attnstep.check_arrays(q, k, v, stages, half_rounding="toward-zero")
    generate_case(tmp_path / "in", Dims(1, 1, 8, 8, 8, 8), seed=1)
    (tmp_path / "out").mkdir()
    write_text(tmp_path / "out" / stage_file(SCORES, 0, "txt"), np.zeros((8, 8), f32), "%.9g")
    r = CliRunner().invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                                 "--precision", "tf32", "--half-rounding", "toward-zero"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "half-precision checks only" in r.output, r.output


def test_failure_lines_print_got_and_want_apart(tmp_path):
    """A bf16 program's %g files at fp32: its QK line must show two different numbers."""
    dims = Dims(1, 1, N, M, D, D)
    generate_case(tmp_path / "in", dims, seed=2)
    (tmp_path / "out").mkdir()
    q, k, v = (np.loadtxt(tmp_path / "in" / stage_file(n, 0, "txt"), ndmin=2).astype(f32) for n in INPUT_NAMES)
    for name, x in program(q, k, v, *PROGRAMS["bf16-storage"]).items():
        write_text(tmp_path / "out" / stage_file(name, 0, "txt"), x, "%.9g")
    r = CliRunner().invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    line = next(x for x in r.output.splitlines() if x.startswith("FAIL QK head 0"))
    got, want = line.split("got ")[1].split(", want ")
    assert got != want.split(",")[0], line
    assert "diagnosis half_storage" in r.output


@pytest.mark.parametrize("got,want,shown", [(9.92001, 9.92003, ("9.92001", "9.92003")),
                                            (1.0, 1.0 + 2.0**-23, ("1", "1.0000001")),
                                            (2.5e-7, 2.5000001e-7, ("2.5000000e-07", "2.5000001e-07")),
                                            (3.0, 4.0, ("3", "4"))])
def test_number_pair_widens_until_the_two_differ(got, want, shown):
    assert number_pair(got, want) == shown


def _half_flash_backward(q, k, v, do, fmt: str, k_prescaled: bool, d_head_shift: int = 0, ds_without_p: bool = False,
                        scores_rounded: bool = False, stored: bool = True):
    """A half flash backward as a kernel computes it (inputs in the format, float32 products, P and dS
    rounded for their GEMMs, the gradients stored in the format, or kept in float32 where not
    `stored`) from a float32 forward's output and lse; k_prescaled: K times scale·log2 e stored in
    the format for the recomputed scores and dQ (the Triton tutorial's backward, with exp2);
    d_head_shift: D = rowsum(dO∘O) from the O of head h + shift (a head offset off by one: a bug);
    ds_without_p: dS = dP − D, P left out (a bug); scores_rounded: the recomputed scores rounded to
    the format before the exponent (a bug)."""
    scale = np.float32(1 / np.sqrt(q.shape[2]))
    c = scale * np.float32(1 / np.log(2))
    stages = {n: [] for n in ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")}
    heads = q.shape[0]
    for h in range(heads):
        qh, kh, vh = (_rounded(x[h], fmt) for x in (q, k, v))
        s = (qh @ kh.T) * scale
        mx = s.max(axis=1, keepdims=True)
        stages["flash_lse"].append(mx + np.log(np.exp(s - mx).sum(axis=1, keepdims=True)))
        stages["flash_output"].append(_rounded(np.exp(s - stages["flash_lse"][h]) @ vh, fmt))
    for h in range(heads):
        qh, kh, vh, doh = (_rounded(x[h], fmt) for x in (q, k, v, do))
        lse, o = stages["flash_lse"][h], stages["flash_output"][(h + d_head_shift) % heads]
        k_used = _rounded(kh * c, fmt) if k_prescaled else kh
        p = np.exp2(qh @ k_used.T - lse * np.float32(1 / np.log(2))) if k_prescaled else \
            np.exp((_rounded((qh @ kh.T) * scale, fmt) if scores_rounded else (qh @ kh.T) * scale) - lse)
        ds = (1.0 if ds_without_p else p) * (doh @ vh.T - (doh * o).sum(axis=1, keepdims=True))
        dq = (_rounded(ds, fmt) @ k_used) * (np.float32(np.log(2)) if k_prescaled else scale)
        for name, x in (("flash_dQ", dq), ("flash_dK", (_rounded(ds, fmt).T @ qh) * scale),
                        ("flash_dV", _rounded(p, fmt).T @ doh)):
            stages[name].append(_rounded(x, fmt) if stored else x)
    stages["flash_lse"] = [x[:, 0] for x in stages["flash_lse"]]
    return {n: np.stack(x) for n, x in stages.items()}


def test_a_key_scaled_and_stored_in_the_half_format_in_the_backward_is_named():
    """Triton's fused-attention tutorial's backward: k * (sm_scale * log2 e) stored in bf16 for the
    recomputed scores and dQ; named on the gradients that fail (not `scaled`), where the same
    backward with K as given passes."""
    q, k, v = _half_inputs(9, 64, 96, 128)
    do = np.random.default_rng(10).standard_normal(q.shape).astype(np.float32)
    assert attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", False), do=do,
                                 precision="bf16").passed
    report = attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", True), do=do, precision="bf16")
    failed = [r for r in report.results if r.status == "FAIL"]
    named = [r for r in failed if r.diagnosis]
    # (a gradient that fails by a few of its bounds stays unnamed where the candidate is not far closer;
    # none is taken for a scale: got ≈ 1.0024·want is a bias of the format's roundings)
    assert named and all([d.code for d in r.diagnosis] == ["prescaled_rounded"] for r in named), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    assert "K·scale·log2 e" in named[0].diagnosis[0].message


@pytest.mark.parametrize("stored", [True, False], ids=["gradients-in-bf16", "gradients-in-float32"])
def test_scores_recomputed_in_the_half_format_in_the_backward_are_named(stored):
    """A bf16 flash backward that keeps the scores it recomputes in bf16 before the exponent: named
    scores_rounded on the gradients, whether it stores them in bf16 or in float32; the same backward
    with float32 scores passes."""
    q, k, v = _half_inputs(9, 64, 96, 128)
    do = np.random.default_rng(10).standard_normal(q.shape).astype(np.float32)
    right = _half_flash_backward(q, k, v, do, "bf16", False, stored=stored)
    assert attnstep.check_arrays(q, k, v, right, do=do, precision="bf16").passed
    wrong = _half_flash_backward(q, k, v, do, "bf16", False, scores_rounded=True, stored=stored)
    report = attnstep.check_arrays(q, k, v, wrong, do=do, precision="bf16")
    failed = [r for r in report.results if r.status == "FAIL"]
    named = [r for r in failed if r.diagnosis]
    assert named and all([d.code for d in r.diagnosis] == ["scores_rounded"] for r in named), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    assert report.first_failing_stage in {r.stage for r in named}


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_d_from_the_next_heads_output_in_a_bf16_backward_is_named_on_every_head(seed):
    """A bf16 flash backward whose D reads the next head's O (its offset off by a head), at logits
    of a few: every failing gradient of every head is named D_wrong_O with the head it read, none
    `scaled`. The bug leans the gradients one way, so a factor fits them within its widths while
    taking little of the failure away; the candidate, within the program's bf16 roundings, is some
    50-120 times closer to got than the reference is."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 128, 64)).astype(np.float32) for _ in range(3))
    do = np.random.default_rng(seed + 100).standard_normal(q.shape).astype(np.float32)
    report = attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", False, d_head_shift=1),
                                   do=do, precision="bf16")
    failed = [r for r in report.results if r.status == "FAIL"]
    assert {r.stage for r in failed} == {"flash_dQ", "flash_dK"}, [(r.stage, r.status) for r in report.results]
    for r in failed:
        assert r.diagnosis and r.diagnosis[0].code == "D_wrong_O", (r.stage, r.head, [d.message for d in r.diagnosis])
        assert r.diagnosis[0].detail["read_head"] == (r.head + 1) % q.shape[0]
        assert "scaled" not in [d.code for d in r.diagnosis]


def test_ds_without_p_in_a_bf16_backward_over_many_keys_is_named():
    """dS = dP − D without P, at bf16 over 1024 keys: the gradients grow a hundredfold and each is
    rounded to bf16 at that size, far past a correct run's widths; the candidate is matched within
    widths grown as its values are, and named on dQ and dK."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 64)).astype(np.float32) for n in (128, 1024, 1024))
    do = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    report = attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", False, ds_without_p=True),
                                   do=do, precision="bf16")
    failed = {(r.stage, r.head): [d.code for d in r.diagnosis] for r in report.results if r.status == "FAIL"}
    assert {s for s, _ in failed} >= {"flash_dQ", "flash_dK"}, failed
    for (stage, head), codes in failed.items():
        if stage in ("flash_dQ", "flash_dK"):
            assert "dS_missing_P" in codes, failed


def test_d_from_a_head_two_away_is_named_with_the_head_it_read():
    """D read from head h + 2 of 4 (an offset off by two heads): every head's failing gradients are
    named D_wrong_O with the head read, the heads beside each and the first and last tried first,
    then the others by distance."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 128, 64)).astype(np.float32) for _ in range(3))
    do = np.random.default_rng(103).standard_normal(q.shape).astype(np.float32)
    report = attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", False, d_head_shift=2),
                                   do=do, precision="bf16")
    failed = [r for r in report.results if r.status == "FAIL"]
    assert {r.head for r in failed} == {0, 1, 2, 3}, [(r.stage, r.head) for r in failed]
    for r in failed:
        assert r.diagnosis and r.diagnosis[0].code == "D_wrong_O", (r.stage, r.head, [d.message for d in r.diagnosis])
        assert r.diagnosis[0].detail["read_head"] == (r.head + 2) % 4, r.diagnosis[0].message


def test_d_from_another_head_tries_the_heads_nearby_not_every_head(monkeypatch):
    """Each other head tried costs its whole forward: beyond the heads beside it, the first and the
    last, only those up to four heads away are tried (D read from six heads away, of 12, is left
    unnamed rather than searched through every head)."""
    from verify.diagnose import backward_base
    tried = []
    real = backward_base.other_head_stage
    monkeypatch.setattr(backward_base, "other_head_stage",
                        lambda stage, ctx, other: tried.append((ctx.head, other)) or real(stage, ctx, other))
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((12, 32, 16)).astype(np.float32) for _ in range(3))
    do = np.random.default_rng(103).standard_normal(q.shape).astype(np.float32)
    report = attnstep.check_arrays(q, k, v, _half_flash_backward(q, k, v, do, "bf16", False, d_head_shift=6),
                                   do=do, precision="bf16")
    assert any(r.status == "FAIL" for r in report.results)
    assert tried and all(abs(h - o) <= 4 or o in (0, 11) for h, o in tried), sorted(set(tried))

"""Any correct float32 implementation passes `check`; classic bugs fail it, whoever wrote the files.

The programs here are not the project's binary: tests/helpers/foreign_routes.py computes every stage by other
valid routes (summation orders, exp2, reciprocals, online and tiled softmax, a FlashAttention-2
style forward) and writes the files the way users' programs do (%.9g, %g, %.6f, mixed, .npy per
head or for all heads, subsets of the stages), with no run.toml. `check` is given only the input
case, the output folder and, on its command line, causal and scale.

Case i draws its routes, distribution, causal shape (N < M or N > M), writer, stage subset and
scale from a generator seeded by i, so a failing case is reproduced by its id.
ATTNSTEP_FOREIGN_CASES sets the number of cases (default COVERED: under a minute on one core); the
first DEFAULT_RUN run by default, the others are marked slow (`-m slow`).

The float64 sanity tests below pin each route, writer and bug down independently of the
verifier, so a failure of the sweep is the verifier's, not the implementation's.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from helpers import foreign_routes as foreign
from helpers.cli import check_folder, generate_input, invoke
from helpers.foreign_routes import Route
from verify.files.generate import DISTRIBUTIONS
from verify.stages import FORWARD_STAGES, INPUT_NAMES, Dims, default_scale, stage_file

COVERED = 100  # the first COVERED draws reach every route, writer, subset and shape
DEFAULT_RUN = 25  # cases run by default; the others are marked slow (-m slow)
CASES = int(os.environ.get("ATTNSTEP_FOREIGN_CASES", str(COVERED)))
SWEEP_SEED = 20260412
MAX_SEQ = 80
HEAD_DIMS = (16, 64)
LAYOUTS = ((1, 2), (1, 3), (2, 1))   # (batch, heads)
CAUSAL_SHAPES = ("none", "N<M", "N>M")
EXPLICIT_SCALES = (0.37, 0.09, 1.3)
EPS32 = float(np.finfo(np.float32).eps)
SEED_PROGRAM = Path(__file__).resolve().parent / "helpers" / "seed_program.py"


# ---- the case draw -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    index: int
    dims: Dims
    causal_shape: str
    distribution: str
    scale: Optional[float]      # None: check's default 1/√d_k
    route: Route
    writer: str
    subset: str
    manifest: bool              # False: the input manifest is removed (shapes inferred)

    @property
    def causal(self) -> bool:
        return self.causal_shape != "none"

    @property
    def effective_scale(self) -> float:
        return default_scale(self.dims.d_k) if self.scale is None else self.scale

    def __str__(self) -> str:
        d = self.dims
        return (f"case {self.index}: batch={d.batch} heads={d.heads} N={d.seq_q} M={d.seq_k} d={d.d_k} "
                f"causal={self.causal_shape} dist={self.distribution} scale={self.scale!r} "
                f"writer={self.writer} subset={self.subset} manifest={self.manifest} routes: {self.route}")


def _pick(rng: np.random.Generator, choices):
    return choices[int(rng.integers(len(choices)))]


def _seq_lens(rng: np.random.Generator, causal_shape: str):
    if causal_shape == "none":
        return int(rng.integers(1, MAX_SEQ + 1)), int(rng.integers(1, MAX_SEQ + 1))
    short = int(rng.integers(2, MAX_SEQ))
    long = int(rng.integers(short + 1, MAX_SEQ + 1))
    return (short, long) if causal_shape == "N<M" else (long, short)


def draw_case(index: int) -> Case:
    rng = np.random.default_rng([SWEEP_SEED, index])
    route = Route(**{stage: _pick(rng, choices) for stage, choices in foreign.ROUTE_CHOICES.items()})
    causal_shape = _pick(rng, CAUSAL_SHAPES)
    seq_q, seq_k = _seq_lens(rng, causal_shape)
    d = _pick(rng, HEAD_DIMS)
    batch, heads = _pick(rng, LAYOUTS)
    subset = "all" if rng.random() < 0.6 else _pick(rng, tuple(s for s in foreign.SUBSETS if s != "all"))
    return Case(index, Dims(batch, heads, seq_q, seq_k, d, d), causal_shape,
                _pick(rng, tuple(DISTRIBUTIONS)),
                None if rng.random() < 0.5 else _pick(rng, EXPLICIT_SCALES), route,
                _pick(rng, foreign.WRITERS), subset, batch > 1 or rng.random() < 0.6)


def write_case(tmp: Path, dims: Dims, distribution: str, seed: int, causal: bool, scale: float,
               route: Route, writer: str, subset: str, bug: Optional[str] = None, manifest: bool = True):
    in_dir = generate_input(tmp / "in", dims, distribution, seed, causal, manifest)
    heads = foreign.compute_heads(foreign.read_inputs(in_dir, dims.total_heads), scale, causal, route, bug)
    written = foreign.write_outputs(tmp / "out", heads, dims, writer, subset)
    return in_dir, tmp / "out", written


# ---- the sweep: correct routes x distributions x causal shapes x printing x scales -------------

def test_the_sweep_covers_every_route_writer_and_shape():
    cases = [draw_case(i) for i in range(COVERED)]
    for stage, choices in foreign.ROUTE_CHOICES.items():
        assert {getattr(c.route, stage) for c in cases} == set(choices), stage
    assert {c.writer for c in cases} == set(foreign.WRITERS)
    assert {c.subset for c in cases} == set(foreign.SUBSETS)
    assert {(c.distribution, c.causal_shape) for c in cases} == \
        {(d, s) for d in DISTRIBUTIONS for s in CAUSAL_SHAPES}
    assert {c.scale is None for c in cases} == {False, True}
    assert {c.dims.d_k for c in cases} == set(HEAD_DIMS)
    assert {c.manifest for c in cases} == {False, True}
    assert any(c.writer == "npy_4d" and c.dims.batch > 1 for c in cases)


@pytest.mark.parametrize("index", [pytest.param(i, id=f"case{i}", marks=pytest.mark.slow if i >= DEFAULT_RUN else ())
                                   for i in range(CASES)])
def test_a_correct_foreign_route_passes(tmp_path, index):
    case = draw_case(index)
    in_dir, out_dir, written = write_case(tmp_path, case.dims, case.distribution, index, case.causal,
                                          case.effective_scale, case.route, case.writer, case.subset,
                                          manifest=case.manifest)
    result, report = check_folder(tmp_path, in_dir, out_dir, case.causal, case.scale)
    assert result.exit_code == 0, f"false alarm on {case}:\n{result.output}"
    assert report is not None and report["passed"], f"{case}: no passing JSON report"
    assert [s["stage"] for s in report["stages"]] == written, f"{case}: checked stages != written files"
    assert all(s["status"] == "PASS" for s in report["stages"]), f"{case}: {report['stages']}"


# ---- the negative companion: one classic bug each ----------------------------------------------

@dataclass(frozen=True)
class Bug:
    bug: str
    stage: str                   # the first failing stage check must name
    code: Optional[str]          # the diagnosis it must give (None: no pattern names this bug)
    causal: bool = False
    subset: str = "all"

    @property
    def id(self) -> str:
        return self.bug + ("" if self.subset == "all" else f"-only-{self.subset}")


BUGS = (
    Bug("layout", "QK", "layout"),                          # K read column-major
    Bug("scale", "QK_scaled", "scaled"),                    # scale missing
    Bug("axis", "attention_weights", "softmax_axis"),       # softmax over columns
    Bug("mask+1", "QK_scaled", "mask_offset", causal=True),
    Bug("mask-1", "QK_scaled", "mask_offset", causal=True),
    Bug("lse_log2", "flash_lse", "lse_log2"),
    Bug("head_swap", "output", "head_permuted"),
    Bug("one_element", "output", None),                     # one element 1e-3 of max|output| off
    Bug("head_swap", "output", "head_permuted", subset="output"),
    Bug("flash_scale", "flash_output", "scaled", subset="flash"),
)
BUG_DIMS = Dims(batch=1, heads=3, seq_q=40, seq_k=56, d_k=16, d_v=16)
BUG_PRINTING = ("g9", "g6")  # a bug must be caught at 6-digit resolution as well


@pytest.mark.parametrize("writer", BUG_PRINTING)
@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.id)
def test_a_classic_bug_is_caught(tmp_path, bug, writer):
    scale = default_scale(BUG_DIMS.d_k)
    in_dir, out_dir, _ = write_case(tmp_path, BUG_DIMS, "normal", 5, bug.causal, scale, Route(), writer,
                                    bug.subset, bug.bug)
    result, report = check_folder(tmp_path, in_dir, out_dir, bug.causal, None)
    assert result.exit_code == 1, result.output
    assert f"first failing stage: {bug.stage} " in result.output, result.output
    assert report["first_failing_stage"] == bug.stage
    if bug.code:
        codes = [d["code"] for d in report["first_failure"]["diagnosis"]]
        assert bug.code in codes, f"diagnosis {codes}, want {bug.code}:\n{result.output}"


# ---- sanity: every route against float64, independent of the verifier --------------------------

def _inputs(distribution: str, n: int, m: int, d: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return [DISTRIBUTIONS[distribution](rng, (rows, d)) for rows in (n, m, m)]


def _matmul_bound(a, b) -> np.ndarray:
    """A generous float32 dot-product bound: 2·k·eps·(|A|·|B|), plus underflow."""
    return 2 * a.shape[1] * EPS32 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))) + 1e-37


def _assert_within(got, want, bound, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):  # inf - inf where same: replaced by 0
        err = np.where(same, 0.0, np.abs(got - want))
    assert (err <= bound).all(), f"{what}: max error {np.nanmax(err):.3g} over its bound"


def _softmax64(s):
    s = np.asarray(s, np.float64)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


SHAPE_SETS = [("normal", 37, 80, 64, True), ("large", 80, 41, 16, True), ("uniform", 50, 50, 64, False)]


@pytest.mark.parametrize("distribution,n,m,d,causal", SHAPE_SETS)
def test_every_route_matches_float64(distribution, n, m, d, causal):
    q, k, v = _inputs(distribution, n, m, d)
    scale = default_scale(d)
    for name, mm in foreign.MATMULS.items():
        _assert_within(mm(q, k.T), q.astype(np.float64) @ k.T.astype(np.float64), _matmul_bound(q, k.T),
                       f"QK {name}")
    masked = foreign.masked_where(n, m) if causal else np.zeros((n, m), bool)
    want_s = np.where(masked, -np.inf, (q.astype(np.float64) @ k.T) * scale)
    qk = foreign.mm_blas(q, k.T)
    for route in foreign.SCALED_ROUTES:
        s = foreign.apply_mask(foreign.scaled_scores(route, q, k, qk, scale, "blas"), causal)
        _assert_within(s, want_s, _matmul_bound(q, k.T) * scale + 2 * EPS32 * np.abs(want_s), f"scaled {route}")
    s32 = foreign.apply_mask(qk * np.float32(scale), causal)
    span = np.abs(s32 - s32.max(axis=1, keepdims=True))
    want_w = _softmax64(s32)
    for route, softmax in foreign.SOFTMAXES.items():
        # exp's argument carries a rounding relative to its size, the row sum one per key
        bound = EPS32 * (4 * m + 4 * np.where(masked, 0, span)) * want_w + 1e-37
        _assert_within(softmax(s32), want_w, bound, f"softmax {route}")
    w32 = foreign.SOFTMAXES["exp"](s32)
    for route in foreign.OUTPUT_ROUTES:
        _assert_within(foreign.MATMULS[route](w32, v), w32.astype(np.float64) @ v, _matmul_bound(w32, v),
                       f"output {route}")
    want_o = _softmax64(want_s) @ v
    finite = np.where(masked, -np.inf, want_s)
    want_lse = finite.max(axis=1, keepdims=True) + np.log(
        np.exp(finite - finite.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
    logits = (np.abs(q.astype(np.float64)) @ np.abs(k.T)).max() * scale
    for route in foreign.FLASH_ROUTES:
        use_exp2, block = foreign.parse_flash_route(route)
        o, lse = foreign.flash_forward(q, k, v, scale, causal, block, use_exp2)
        # the scores carry d·eps·|Q||K|·scale, the running sums m·eps
        _assert_within(o, want_o, 4 * EPS32 * (d * logits + 2 * m) * np.abs(v).max(), f"flash_output {route}")
        _assert_within(lse, want_lse, 4 * EPS32 * (d * logits + m + np.abs(want_lse)), f"flash_lse {route}")


def test_kt_and_echoes_are_exact():
    q, k, v = _inputs("normal", 9, 13, 16)
    head = foreign.compute_head(q, k, v, 0.25, False)
    assert np.array_equal(head["KT"], k.T) and head["KT"].flags.c_contiguous
    for name, x in zip(INPUT_NAMES, (q, k, v)):
        assert np.array_equal(head[name], x)


def test_routes_differ_in_their_roundings():
    """The routes are not one computation under other names: their float32 results differ."""
    q, k, v = _inputs("normal", 64, 64, 64)
    qks = {name: mm(q, k.T) for name, mm in foreign.MATMULS.items()}
    assert len({r.tobytes() for r in qks.values()}) == len(qks)
    qk = qks["blas"]
    scaled = {r: foreign.scaled_scores(r, q, k, qk, 0.125 * 1.1, "blas") for r in foreign.SCALED_ROUTES}
    assert not np.array_equal(scaled["folded"], scaled["mul"])
    assert not np.array_equal(scaled["regemm"], scaled["mul"])
    assert not np.array_equal(scaled["div"], scaled["mul"])
    s = scaled["mul"]
    weights = {r: f(s) for r, f in foreign.SOFTMAXES.items()}
    assert len({w.tobytes() for w in weights.values()}) >= len(weights) - 1


def _two_heads(bug: Optional[str], b: Bug):
    q, k, v = _inputs("normal", BUG_DIMS.seq_q, BUG_DIMS.seq_k, BUG_DIMS.d_k)
    inputs = [{"Q": q, "K": k, "V": v}, {"Q": q[::-1].copy(), "K": k, "V": v[::-1].copy()}]
    return foreign.compute_heads(inputs, default_scale(BUG_DIMS.d_k), b.causal, Route(), bug)


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.id)
def test_each_bug_changes_its_stage_far_beyond_rounding(bug):
    """The planted stage is wrong by at least 5e-4 of its largest value, a hundred times the
    rounding of 6-digit printing (5e-6 relative), and every stage before it is untouched."""
    right, wrong = _two_heads(None, bug), _two_heads(bug.bug, bug)
    for h, (r, w) in enumerate(zip(right, wrong)):
        # The forward stages of a case without dropout (what compute_heads computes), in order.
        for stage in FORWARD_STAGES[:FORWARD_STAGES.index(bug.stage)]:
            assert np.array_equal(r[stage], w[stage]), (stage, h)
    r = np.concatenate([h[bug.stage].ravel() for h in right]).astype(np.float64)
    w = np.concatenate([h[bug.stage].ravel() for h in wrong]).astype(np.float64)
    fin = np.isfinite(r) & np.isfinite(w)
    off = (np.isfinite(r) != np.isfinite(w)).any() or \
        np.abs(r[fin] - w[fin]).max() >= 5e-4 * np.abs(r[fin]).max()
    assert off, bug


@pytest.mark.parametrize("writer", foreign.WRITERS)
def test_writers_print_what_they_claim(tmp_path, writer):
    dims = Dims(batch=2, heads=1, seq_q=7, seq_k=5, d_k=16, d_v=16)
    q, k, v = _inputs("large", 7, 5, 16)
    heads = foreign.compute_heads([{"Q": q, "K": k, "V": v}, {"Q": -q, "K": k, "V": v}], 0.25, True)
    written = foreign.write_outputs(tmp_path, heads, dims, writer)
    assert written == list(FORWARD_STAGES)
    for stage in written:
        if writer in ("npy_flat", "npy_4d"):
            got = np.load(tmp_path / f"{stage}.npy")
            lead = (2,) if writer == "npy_flat" else (2, 1)
            assert got.dtype == np.float32 and got.shape == lead + heads[0][stage].shape
            assert np.array_equal(got.reshape(2, *heads[0][stage].shape),
                                  np.stack([h[stage] for h in heads]))
            continue
        for i, h in enumerate(heads):
            fmt = foreign.printed_format(writer, stage, i)
            path = tmp_path / stage_file(stage, i, "txt" if fmt else "npy")
            got = np.load(path) if fmt is None else np.loadtxt(path, ndmin=2)
            want = h[stage].astype(np.float64)
            if fmt in (None, "%.9g"):
                assert np.array_equal(np.asarray(got, np.float32), h[stage]), (stage, i)
            else:
                tol = 5e-7 if fmt == "%.6f" else 5e-6 * np.abs(np.where(np.isfinite(want), want, 0))
                _assert_within(got, want, tol + 1e-300, f"{writer} {stage}[{i}]")
    assert not (tmp_path / "run.toml").exists()


@pytest.mark.parametrize("subset", foreign.SUBSETS)
def test_subsets_write_only_their_stages(tmp_path, subset):
    dims = Dims(batch=1, heads=2, seq_q=4, seq_k=6, d_k=16, d_v=16)
    q, k, v = _inputs("uniform", 4, 6, 16)
    heads = foreign.compute_heads([{"Q": q, "K": k, "V": v}] * 2, 0.25, False)
    written = foreign.write_outputs(tmp_path, heads, dims, "g6", subset)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(stage_file(s, i, "txt") for s in foreign.SUBSETS[subset] for i in range(2))
    assert written == list(foreign.SUBSETS[subset])


# ---- the seed-style program: ./main random_test from build/ ----------------------------------

SEED_DIMS = Dims(batch=1, heads=2, seq_q=48, seq_k=40, d_k=16, d_v=16)
SEED_BUGS = {"layout": ("QK", "layout"), "scale": ("QK_scaled", "scaled"),
             "axis": ("attention_weights", "softmax_axis")}


@pytest.fixture
def seed_tree(tmp_path):
    """<tmp>/build and <tmp>/data/random_test without a manifest, as the original workflow."""
    generate_input(tmp_path / "data" / "random_test", SEED_DIMS, "uniform", 7, False, manifest=False)
    (tmp_path / "build").mkdir()
    return tmp_path


def _run_seed_directly(tree: Path, *flags):
    return subprocess.run([sys.executable, str(SEED_PROGRAM), "random_test", *flags], cwd=tree / "build",
                          capture_output=True, text=True, timeout=120)


def test_the_seed_program_is_an_executable_script():
    assert SEED_PROGRAM.stat().st_mode & stat.S_IXUSR
    assert SEED_PROGRAM.read_text().startswith("#!/usr/bin/env python3\n")


def _significant_digits(token: str) -> int:
    mantissa = token.lstrip("+-").split("e")[0].replace(".", "")
    return len(mantissa.lstrip("0"))


def test_the_seed_program_computes_the_eight_stages_in_six_digits(seed_tree):
    proc = _run_seed_directly(seed_tree)
    assert proc.returncode == 0, proc.stderr
    out = seed_tree / "data" / "random_verify"
    want = sorted(stage_file(s, i, "txt") for s in foreign.SUBSETS["seed"] for i in range(SEED_DIMS.total_heads))
    assert sorted(p.name for p in out.iterdir()) == want
    inputs = foreign.read_inputs(seed_tree / "data" / "random_test", SEED_DIMS.total_heads)
    for i, x in enumerate(inputs):
        q, k, v = (x[n].astype(np.float64) for n in INPUT_NAMES)
        ref = _softmax64(q @ k.T * default_scale(SEED_DIMS.d_k)) @ v
        got = np.loadtxt(out / stage_file("output", i, "txt"), ndmin=2)
        _assert_within(got, ref, 1e-5 * np.abs(ref).max(), f"seed output[{i}]")
        tokens = (out / stage_file("QK", i, "txt")).read_text().split()
        assert max(_significant_digits(t) for t in tokens) == 6


def test_the_seed_program_writes_only_output_when_asked(seed_tree):
    assert _run_seed_directly(seed_tree, "--stages", "output").returncode == 0
    assert sorted(p.name for p in (seed_tree / "data" / "random_verify").iterdir()) == \
        [stage_file("output", i, "txt") for i in range(SEED_DIMS.total_heads)]


def _run_and_check_seed(tree: Path, *flags):
    r = invoke("run", "--binary", SEED_PROGRAM, "--cwd", tree / "build", "--out", tree / "data" / "random_verify",
               "--", "random_test", *flags)
    assert r.exit_code == 0, r.output
    return check_folder(tree, tree / "data" / "random_test", tree / "data" / "random_verify", False, None)


def test_the_seed_program_passes_through_run_and_check(seed_tree):
    result, report = _run_and_check_seed(seed_tree)
    assert result.exit_code == 0, result.output
    assert [s["stage"] for s in report["stages"]] == list(foreign.SUBSETS["seed"])


def test_the_seed_program_with_only_output_passes(seed_tree):
    result, report = _run_and_check_seed(seed_tree, "--stages", "output")
    assert result.exit_code == 0, result.output
    assert [s["stage"] for s in report["stages"]] == ["output"]


@pytest.mark.parametrize("bug", SEED_BUGS)
def test_the_seed_program_s_bugs_are_caught(seed_tree, bug):
    stage, code = SEED_BUGS[bug]
    result, report = _run_and_check_seed(seed_tree, "--bug", bug)
    assert result.exit_code == 1, result.output
    assert report["first_failing_stage"] == stage, result.output
    assert code in [d["code"] for d in report["first_failure"]["diagnosis"]], result.output

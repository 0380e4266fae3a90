"""The false-alarm suite: hundreds of random CORRECT runs must all pass.

Each case draws a shape from the whole generator space (batch, heads; seq_q and seq_k from 1 to
a few hundred, 1 and non-multiples of every tile included; d_k = d_v at each flash width, odd and
unequal head dims up to MAX_HEAD_DIM), causal or not, every distribution of
verify.files.generate.DISTRIBUTIONS, both file formats, sometimes an explicit random scale, and about a
third with the output gradient dO (the backward stages, where the backend computes them), and an
attention variant over it (tests/helpers/random_cases.py draw_variant_case; a fifth stay textbook, and a
share are packed sequences):
grouped K/V heads (MQA included), either causal alignment, sliding windows (narrow ones, ones that
leave rows with no key), softcap (caps that saturate, and 30-50), ALiBi (standard or random
slopes), mask files (document, prefix-LM, random, with empty rows), bias files, dropout, and several
at once; a share of the forward ones are paged KV caches (pages of 16 .. 256 keys and odd small ones,
decode steps, last pages partial or whole); then generate -> binary -> check, and every stage of
every head must pass (chained and isolated), the dropout keep rate included. Split-KV runs are swept
twice: from a NumPy float32 split program's files (split sizes drawn with the variants, packed ones
too), and from the binary on every backend (`--split-size K`, tests/helpers/split_runs.py: the
sweep's cases made ones a split run takes, dense, packed and paged, split sizes of one key, a few,
a third of the keys and more than every key). A failure prints the `attnstep generate` options of
its case, which write it again, and the `attnstep run` options (the binary's where `run` has no
such option) that run it.

The tolerance model promises ~1e-10 false failures per element, so one failure here is a bug in
the model or in the binary, never bad luck.

The CUDA backend is swept at every precision: fp32 with each flash kernel, tf32, and the half
pipelines bf16 and fp16 (their stage path; the flash stages too where the binary has a half flash
kernel, else it leaves them out with a notice and the sweep checks what it wrote), and bf16 and fp16
with the flash forward alone, where a packed case runs in one launch over its sequences. A flash kernel
forced by name that has no variant for the case's mask or bias files or dropout (every kernel but
the clean one) refuses the case in one line, as documented; the sweep requires exactly that refusal
there. The CPU backend's half pipelines have their own, smaller sweep in tests/test_half.py.

The binary's split runs are swept on the CPU backend at fp32 (and at bf16 and fp16 with the slow
tests), and on the CUDA backend, whose split stages come from its paged decode kernel
(cuda_src/cuda/decode.cu), at fp32 (tf32 on the stage path), bf16 and fp16; that kernel takes no mask
or bias files, and refuses them in one line, which the sweep requires there.

ATTNSTEP_FALSE_ALARM_CASES sets the number of cases per backend and sweep (default 200: about a
minute on the CPU backend with 2 cores); scripts/gpu_check.sh runs 300 per CUDA configuration. The
first 25 run by default, the others are marked slow (`-m slow`); without it set, the split sweeps
stop at 50 on the CPU (25 for each CPU half pipeline). Case i is the same for every count
and backend (its generator is seeded by i), so a failing case is reproduced by its parameters,
which the assertion prints.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from verify.files.generate import DISTRIBUTIONS
from verify.files.patterns import MASK_PATTERNS, SLOPE_CHOICES, VariantInputs
from verify.model.rounding import LAMBDA, UNIT_ROUNDOFF
from verify.model.softmax import rowsum_rel_var, softmax_parts
from verify.runs.runner import EXIT_BAD_INPUT, RunnerError
from verify.stages import FLASH_HEAD_DIMS, FORMATS, HALF_PRECISIONS, SPLIT_LSE, SPLIT_OUTPUT
from verify.variant import ALIGNMENTS, TENSOR_COVERAGE, UNBOUNDED, Variant

from helpers.end_to_end import BACKENDS, run_and_check, run_command
from helpers.random_cases import MODEL_CAP, SATURATING_CAP, draw_case, draw_variant_case, failures
from helpers.split_programs import draw_split_case, run_program, write_case
from helpers.split_runs import MAX_SPLITS, SPLIT_KINDS, draw_split_run
from verify.check.compare import Options, check
from verify.cli.group import cli
from verify.diagnose.hypotheses import diagnose
from verify.files.generate import generate_case

CASES = int(os.environ.get("ATTNSTEP_FALSE_ALARM_CASES", "200"))
# Without a sweep size asked for, the split sweeps stop at SPLIT_CASES_HERE (CI's time; the chunks
# past it skip with the reason); the GPU machine's sweep asks for 300.
SWEEP_SIZE_ASKED = "ATTNSTEP_FALSE_ALARM_CASES" in os.environ
SPLIT_CASES_HERE = 50
CHUNK = 25        # cases per test function: one binary fixture, one report line per chunk
# The end-to-end backends and the CUDA half pipelines (which write no half flash stage where the
# binary has no half flash kernel, so they are not end-to-end backends, whose tests require them).
SWEPT = BACKENDS + [pytest.param(("cuda", ("--precision", p)), id=f"cuda-{p}", marks=pytest.mark.gpu)
                    for p in HALF_PRECISIONS]
# The half flash forward alone (--stages flash): a packed case of the plain masks then runs in one
# kernel launch over the whole batch (cuda_src/packed_run.h), a dense one as in the configurations
# above. Forward cases without mask or bias files or dropout; a width the half kernel lacks is
# refused in one line, as documented.
FLASH_ONLY = [pytest.param(("cuda", ("--precision", p, "--stages", "flash")), id=f"cuda-{p}-flash",
                           marks=pytest.mark.gpu) for p in HALF_PRECISIONS]
# The first chunk runs by default; the rest of the sweep is marked slow (python3 -m pytest -m slow).
CHUNKS = [pytest.param(c, id=f"cases{c * CHUNK}-{min(CASES, (c + 1) * CHUNK) - 1}",
                       marks=pytest.mark.slow if c else ())
          for c in range((CASES + CHUNK - 1) // CHUNK)]


def test_the_sweep_covers_the_generator_space():
    """The draw reaches every distribution, format, flash width, causal mode, explicit scales,
    length-1 sequences, head dims the flash stages do not support and the backward, causal or not,
    with the flash backward (checked on the first 200)."""
    cases = [draw_case(i) for i in range(200)]
    assert {c.distribution for c in cases} == set(DISTRIBUTIONS)
    assert {c.fmt for c in cases} == set(FORMATS)
    assert {c.dims.d_k for c in cases if c.dims.flash_supported} == set(FLASH_HEAD_DIMS)
    assert {c.causal for c in cases} == {False, True}
    assert any(c.scale is not None for c in cases) and any(c.scale is None for c in cases)
    assert any(c.dims.seq_q == 1 for c in cases) and any(c.dims.seq_k == 1 for c in cases)
    assert any(c.dims.d_k != c.dims.d_v for c in cases)
    assert any(c.dims.d_k == c.dims.d_v and not c.dims.flash_supported for c in cases)
    assert any(c.dims.batch > 1 for c in cases)
    backward = [c for c in cases if c.backward]
    assert backward and len(backward) < len(cases)
    assert {c.causal for c in backward} == {False, True} and any(c.dims.flash_supported for c in backward)


def _rows_without_a_key(case) -> bool:
    """Whether the causal flag and window leave some query row of `case` with no key."""
    d, v = case.dims, case.variant
    return any(first >= end for first, end in (v.key_range(d.seq_q, d.seq_k, i) for i in range(d.seq_q)))


def test_the_sweep_draws_every_variant():
    """The variants' draw reaches grouped heads (MQA and groups of several), both alignments, narrow
    windows and windows leaving rows with no key, saturating and model-size softcaps, ALiBi with
    either slopes, every mask pattern (random with empty rows), per-head and broadcast files, bias,
    dropout, several at once, textbook cases, all of them forward and backward (checked on the first
    200)."""
    cases = [draw_variant_case(i) for i in range(200)]
    for backward in (False, True):
        drawn = [c for c in cases if c.backward == backward]
        grouped = [c.dims for c in drawn if c.dims.kv_heads]
        assert {d.kv == 1 for d in grouped} == {True, False} and any(d.group_size > 1 for d in grouped)
        assert {c.variant.align for c in drawn if c.variant.structural} == set(ALIGNMENTS)
        windows = [c for c in drawn if c.variant.window != (UNBOUNDED, UNBOUNDED)]
        assert any(max(c.variant.window) <= 2 for c in windows) and any(c.variant.causal for c in windows)
        assert any(_rows_without_a_key(c) for c in windows)
        caps = [c.variant.softcap for c in drawn if c.variant.softcap]
        assert any(SATURATING_CAP[0] <= cap <= SATURATING_CAP[1] for cap in caps)
        assert any(MODEL_CAP[0] <= cap <= MODEL_CAP[1] for cap in caps)
        assert {c.inputs.slopes for c in drawn if c.variant.alibi} == set(SLOPE_CHOICES)
        assert {c.inputs.mask for c in drawn if c.inputs.mask} == set(MASK_PATTERNS)
        assert any(c.inputs.empty_rows for c in drawn)
        assert {c.inputs.mask_heads for c in drawn if c.inputs.mask} == set(TENSOR_COVERAGE)
        assert {c.inputs.bias_heads for c in drawn if c.inputs.bias} == set(TENSOR_COVERAGE)
        assert any(c.variant.dropout for c in drawn)
        assert any(c.variant == Variant(causal=c.causal) and c.inputs == VariantInputs() and not c.dims.kv_heads
                   for c in drawn)  # textbook attention
    assert any(c.dims.kv_heads and c.variant.softcap and c.variant.alibi and c.inputs.mask and c.variant.dropout
               for c in cases)  # combined


def test_the_sweep_draws_packed_cases():
    """Packed cases (checked on the first 200), forward and backward, with variants and grouped
    heads, sequences without queries, without keys, padded key slots; never with mask or bias files
    or dropout (not supported with packing); at least one among the cases run by default."""
    cases = [draw_variant_case(i) for i in range(200)]
    packed = [c for c in cases if c.sequences is not None]
    assert any(c.sequences is not None for c in cases[:CHUNK])
    assert {c.backward for c in packed} == {False, True}
    assert any(c.variant.structural for c in packed) and any(c.dims.kv_heads for c in packed)
    assert any(c.sequences.count > 1 for c in packed)
    for empty in (lambda s, b: s.n(b) == 0, lambda s, b: s.m(b) == 0):
        assert any(empty(c.sequences, b) for c in packed for b in range(c.sequences.count))
    assert any(c.sequences.used_k is not None for c in packed)
    assert not any(c.per_element_inputs for c in packed)


def _partial_last_page(seqs, b) -> bool:
    return seqs.m(b) % seqs.page_size != 0


def test_the_sweep_draws_paged_cases():
    """Paged KV caches (checked on the first 200), forward only, never with mask or bias files or
    dropout: page sizes of 16 and less and of 128 and more (odd ones too), several pages a
    sequence, sequences of fewer pages than their table row (seqused_k short of the slot), last pages
    partial and whole, decode steps of one query, sequences without queries or keys, pages dealt out
    of the pool's order, with grouped heads (MQA too) and the structural variants, softcap and
    ALiBi; at least one among the cases run by default."""
    cases = [draw_variant_case(i) for i in range(200)]
    paged = [c for c in cases if c.sequences is not None and c.sequences.paged]
    assert any(c.sequences is not None and c.sequences.paged for c in cases[:CHUNK])
    assert not any(c.backward or c.per_element_inputs for c in paged)
    sizes = {c.sequences.page_size for c in paged}
    assert min(sizes) <= 16 and max(sizes) >= 128 and sizes - {16, 32, 64, 128, 256}
    each = [(c.sequences, b) for c in paged for b in range(c.sequences.count)]
    assert any(-(-s.m(b) // s.page_size) > 2 for s, b in each)                    # several pages
    assert any(s.m(b) < len(s.block_table[b]) * s.page_size for s, b in each)     # short of the slot
    assert any(_partial_last_page(s, b) for s, b in each)
    assert any(s.m(b) and not _partial_last_page(s, b) for s, b in each)
    assert any(s.n(b) == 1 for s, b in each) and any(s.n(b) == 0 for s, b in each) and any(s.m(b) == 0 for s, b in each)
    assert any(list(s.block_table[b][:2]) != [s.block_table[b][0], s.block_table[b][0] + 1]
               for s, b in each if s.m(b) > s.page_size)                            # out of the pool's order
    assert any(c.sequences.count > 1 for c in paged)
    grouped = [c.dims for c in paged if c.dims.kv_heads]
    assert any(d.kv == 1 for d in grouped) and any(d.group_size > 1 for d in grouped)
    assert any(c.variant.causal for c in paged) and any(c.variant.window != (UNBOUNDED, UNBOUNDED) for c in paged)
    assert {c.variant.align for c in paged if c.variant.structural} == set(ALIGNMENTS)
    assert any(c.variant.softcap for c in paged) and any(c.variant.alibi for c in paged)


@pytest.mark.parametrize("kind", ["paged", "packed"])
def test_a_drawn_case_is_written_again_by_the_generate_options_it_prints(tmp_path, kind):
    """The options a failure prints write the very case the sweep ran: the same files, byte for byte."""
    case = next(c for c in map(draw_variant_case, range(200))
                if c.sequences is not None and c.sequences.paged == (kind == "paged") and c.variant.structural)
    generate_case(tmp_path / "sweep", case.dims, causal=case.causal, **case.generate_args())
    res = CliRunner().invoke(cli, ["generate", "--out", str(tmp_path / "cli"), *case.generate_command()])
    assert res.exit_code == 0, res.output
    files = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert all((tmp_path / "sweep" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes() for f in files), case


def _forced_kernel_refuses(backend, case) -> bool:
    """Whether `backend` forces a flash kernel by name that has no variant for the case's mask or
    bias files or dropout (every CUDA flash kernel but the clean one): it refuses the case."""
    name, extra = backend
    forced = dict(zip(extra[::2], extra[1::2])).get("--flash-kernel")
    return name == "cuda" and forced not in (None, "clean") and case.per_element_inputs and case.dims.flash_supported


def _run(binary, work, case, backend, where: str):
    """The report of `case` run on `backend`; a run the binary fails says how to run it again."""
    try:
        return run_and_check(binary, work, case.dims, case.causal, backend, **case.generate_args())
    except RunnerError as exc:
        pytest.fail(f"{where}: the binary failed: {exc}")


def _flash_only_skips(backend, case) -> bool:
    """Whether a flash-only run leaves `case` to the other configurations (it has dO, or inputs the
    half flash kernel does not take)."""
    return "flash" in backend[1] and (case.backward or case.per_element_inputs)


# How the binary refuses a flash-only run whose widths have no flash kernel (d_k != d_v, or a width
# the half-precision kernel lacks), as documented: one line, exit 2.
FLASH_REFUSALS = ("flash stages need d_k = d_v", "backend has no half-precision kernel for flash_output,flash_lse")


def _check_flash_only(binary, work, case, backend, where: str) -> None:
    try:
        report = run_and_check(binary, work, case.dims, case.causal, backend, **case.generate_args())
    except RunnerError as exc:
        assert exc.exit_code == EXIT_BAD_INPUT and any(r in str(exc) for r in FLASH_REFUSALS), f"{where}: {exc}"
        return
    assert report.passed, f"false alarm {where}: {failures(report)}"


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend", SWEPT + FLASH_ONLY)
def test_random_correct_runs_never_fail(binary, tmp_path, backend, chunk):
    for index in range(chunk * CHUNK, min(CASES, (chunk + 1) * CHUNK)):
        case = draw_variant_case(index)
        work = tmp_path / str(index)
        where = f"{case}; {run_command(backend)}"
        if _flash_only_skips(backend, case):
            continue
        if "flash" in backend[1]:
            _check_flash_only(binary, work, case, backend, where)
        elif _forced_kernel_refuses(backend, case):
            with pytest.raises(RunnerError) as refused:
                run_and_check(binary, work, case.dims, case.causal, backend, **case.generate_args())
            assert refused.value.exit_code == EXIT_BAD_INPUT, f"{where}: {refused.value}"
            assert "variant for mask or bias files or dropout" in str(refused.value), f"{where}: {refused.value}"
        else:
            report = _run(binary, work, case, backend, where)
            assert report.passed, f"false alarm {where}: {failures(report)}"
        shutil.rmtree(work)  # hundreds of cases: keep the disk use of one


# ---- split-KV runs ---------------------------------------------------------------------------------
# Another program's split runs: a float32 NumPy split program's (tests/helpers/split_programs.py: each
# split in float32, P rounded at bf16/fp16, a float32 combine), checked as another program's folder
# (no run.toml) with --split-size. The binary's own split runs are swept below.

def test_the_split_sweep_draws_split_sizes_and_variants():
    """Split sizes of one key, a few, a third of the keys and more than every key; packed and dense,
    grouped heads, both alignments, windows, softcaps, ALiBi and every precision (the first 200)."""
    cases = [draw_split_case(i) for i in range(200)]
    most = lambda c: max(c.seqlens_k) if c.packed else c.seq_k  # noqa: E731
    assert any(c.split_size == 1 for c, _ in cases) and any(c.split_size > most(c) for c, _ in cases)
    assert any(1 < c.split_size < most(c) for c, _ in cases)
    assert any(c.packed for c, _ in cases[:CHUNK]) and any(not c.packed for c, _ in cases[:CHUNK])
    assert {c.causal for c, _ in cases} == {False, "top-left", "bottom-right"}
    assert any(c.window != (-1, -1) for c, _ in cases) and any(c.softcap for c, _ in cases)
    assert any(c.alibi for c, _ in cases) and any(c.kv_heads < c.heads for c, _ in cases)
    assert {p for _, p in cases} == {"fp32", "bf16", "fp16"}


def _skip_past_split_cases(chunk: int, cases: int) -> None:
    if not SWEEP_SIZE_ASKED and chunk * CHUNK >= cases:
        pytest.skip(f"the split sweep runs {cases} cases here unless ATTNSTEP_FALSE_ALARM_CASES is set")


@pytest.mark.parametrize("chunk", CHUNKS)
def test_random_correct_split_runs_never_fail(tmp_path, chunk):
    _skip_past_split_cases(chunk, SPLIT_CASES_HERE)
    for index in range(chunk * CHUNK, min(CASES, (chunk + 1) * CHUNK)):
        case, precision = draw_split_case(index)
        work = tmp_path / str(index)
        write_case(case, work / "in")
        run_program(case, work / "out", precision=precision)
        report = check(work / "in", work / "out", Options(jobs=1, precision=precision, split_size=case.split_size),
                       diagnoser=diagnose)
        assert report.passed, f"false alarm at {precision}: {case!r}: {failures(report)}"
        shutil.rmtree(work)


# ---- split-KV runs of the binary -------------------------------------------------------------------
# The sweep's cases run with `--split-size K` (tests/helpers/split_runs.py): the CPU backend splits
# every variant; the CUDA backend's split stages come from its paged decode kernel
# (cuda_src/cuda/decode.cu) at fp32 (tf32 on the stage path) and at bf16/fp16, which takes no mask or
# bias files: there it refuses the case in one line, as documented, and the sweep requires exactly that.
# The CPU backend's half pipelines are swept too, with the slow tests only (CI runs its fp32 sweep);
# without a sweep size asked for, the CPU backend stops at SPLIT_CASES_HERE (each half pipeline at
# one chunk).
SPLIT_SWEPT = [pytest.param(("cpu", ()), id="cpu")] + [
    pytest.param(("cpu", ("--precision", p)), id=f"cpu-{p}", marks=pytest.mark.slow) for p in HALF_PRECISIONS] + [
    pytest.param(("cuda", extra), id="-".join(("cuda",) + extra[1:]), marks=pytest.mark.gpu)
    for extra in [()] + [("--precision", p) for p in ("tf32",) + HALF_PRECISIONS]]


def test_the_binary_split_sweep_draws_every_layout_and_split_size():
    """Dense, packed and paged cases, each with split sizes of one key, a few, a third of the keys
    and more than every key (one split), at most MAX_SPLITS splits; grouped heads, the structural
    variants, softcap and ALiBi, the backward in dense and packed cases, mask and bias files in a
    few dense ones; the flash stages' head widths and no dropout (checked on the first 200); every
    layout among the cases run by default."""
    runs = [draw_split_run(i) for i in range(200)]
    assert {(r.layout, r.kind) for r in runs} == {(lay, k) for lay in ("dense", "packed", "paged") for k in SPLIT_KINDS}
    assert {r.layout for r in runs[:CHUNK]} == {"dense", "packed", "paged"}
    assert all(r.case.dims.flash_supported and not r.case.variant.dropout for r in runs)
    assert all(1 <= r.splits <= MAX_SPLITS for r in runs) and max(r.splits for r in runs) == MAX_SPLITS
    assert any(r.split_size == 1 and r.most_keys > 1 for r in runs)
    assert any(1 < r.split_size < r.most_keys // 2 for r in runs)
    assert any(r.split_size == r.most_keys // 3 and r.splits >= 3 for r in runs)
    assert any(r.split_size > r.most_keys for r in runs)
    for layout in ("dense", "packed", "paged"):
        drawn = [r.case for r in runs if r.layout == layout]
        assert any(c.dims.kv_heads for c in drawn) and any(c.variant.structural for c in drawn)
        assert any(c.variant.softcap for c in drawn) and any(c.variant.alibi for c in drawn)
        assert any(c.backward for c in drawn) == (layout != "paged")
    assert any(r.case.per_element_inputs for r in runs) and all(r.layout == "dense" for r in runs
                                                                 if r.case.per_element_inputs)
    # rows that see no key of some split: those of a sequence shorter than the longest
    uneven = lambda s: len({s.m(b) for b in range(s.count)}) > 1  # noqa: E731
    assert any(r.layout != "dense" and r.splits > 1 and uneven(r.case.sequences) for r in runs)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("backend", SPLIT_SWEPT)
def test_random_correct_binary_split_runs_never_fail(binary, tmp_path, backend, chunk):
    name, extra = backend
    if name == "cpu":
        _skip_past_split_cases(chunk, CHUNK if extra else SPLIT_CASES_HERE)
    for index in range(chunk * CHUNK, min(CASES, (chunk + 1) * CHUNK)):
        run = draw_split_run(index)
        case, work, where = run.case, tmp_path / str(index), run.describe(backend)
        split = (name, tuple(extra) + tuple(run.run_options()))
        if name == "cuda" and case.per_element_inputs:
            with pytest.raises(RunnerError) as refused:
                run_and_check(binary, work, case.dims, case.causal, split, **case.generate_args())
            assert refused.value.exit_code == EXIT_BAD_INPUT, f"{where}: {refused.value}"
            assert "split kernel takes no mask file, bias file or dropout" in str(refused.value), \
                f"{where}: {refused.value}"
        else:
            report = _run(binary, work, case, split, where)
            assert report.passed, f"false alarm {where}: {failures(report)}"
            assert {SPLIT_OUTPUT, SPLIT_LSE} <= {r.stage for r in report.results}, f"{where}: no split stage checked"
        shutil.rmtree(work)


# ---- false alarms the sweep found, pinned ----------------------------------------------------------

# Cases of the sweep that failed under an earlier error model, and pass since it was fixed.
FOUND = {
    # A softcap of 1.91 saturated 106 of a row's 128 scores at ±C: the float32 sum of its 70 equal
    # exponentials exp(−2C) erred alike at every addition, 18.5u in all, where independent
    # roundings allowed 15.6u (verify/model/softmax.py correlated_sum).
    794: "attention_weights row_sum, 1.04 of the bound",
}


@pytest.mark.parametrize("index", list(FOUND), ids=[f"case{i}" for i in FOUND])
def test_a_false_alarm_the_sweep_found_stays_fixed(binary, tmp_path, index):
    case = draw_variant_case(index)
    report = run_and_check(binary, tmp_path, case.dims, case.causal, ("cpu", ()), **case.generate_args())
    assert report.passed, f"{case}: {failures(report)}"


# Split runs of the binary (index, precision) that the checker failed, and pass since it was fixed.
SPLIT_FOUND = {
    # Paged, ALiBi, scores near ±200, 4 splits: a correct float32 combine's weights exp(lse_s − lse)
    # are off by ~u·|lse|, which moved flash_output 8.8 times the unsplit forward's chained bound
    # (verify/check/splits.py combine_allowance).
    (10, "fp32"): "flash_output chained 8.8 of the bound, and flash_vs_output",
    # A sequence without keys at bf16: its Q echo holds the queries rounded to bf16, as the contract
    # says, where the check of a keyless sequence wanted them as read (verify/check/packed.py).
    (59, "bf16"): "Q of sequence 1 (m = 0) not the input",
}


@pytest.mark.parametrize("index, precision", list(SPLIT_FOUND), ids=[f"split{i}-{p}" for i, p in SPLIT_FOUND])
def test_a_split_false_alarm_the_sweep_found_stays_fixed(binary, tmp_path, index, precision):
    run, backend = draw_split_run(index), ("cpu", ("--precision", precision))
    split = (backend[0], backend[1] + tuple(run.run_options()))
    report = run_and_check(binary, tmp_path, run.case.dims, run.case.causal, split, **run.case.generate_args())
    assert report.passed, f"{run.describe(backend)}: {failures(report)}"


def test_a_row_sum_of_equal_terms_stays_within_its_bound():
    """Rows capped by a softcap (many scores exactly ±C, so many equal exponentials) summed in
    float32 in index order, reversed and shuffled: each sum within LAMBDA standard deviations of
    the row sum's modeled rounding (independent roundings gave 8σ: equal terms round alike)."""
    u = UNIT_ROUNDOFF["fp32"]
    worst = 0.0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        m, cap = int(rng.integers(20, 300)), np.float32(rng.uniform(0.5, 5))
        raw = rng.standard_normal(m).astype(np.float32) * np.float32(rng.choice([1, 10, 100]))
        s = (cap * np.tanh(raw / cap)).astype(np.float32)
        e = np.exp(s - s.max()).astype(np.float32)
        sigma = np.sqrt(rowsum_rel_var(softmax_parts(s.astype(np.float64)[None, :])[0], u)[0, 0])
        exact = e.astype(np.float64).sum()
        for order in [np.arange(m), np.arange(m)[::-1]] + [rng.permutation(m) for _ in range(4)]:
            total = float(np.cumsum(e[order], dtype=np.float32)[-1])  # sequential float32 additions
            worst = max(worst, abs(total - exact) / exact / sigma)
    assert worst < LAMBDA, worst

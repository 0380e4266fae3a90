"""check of a split-KV (flash-decoding) run: another program's split files (split_output and
split_lse per head and split, %.9g text, no run.toml or one holding only split_size) and the
flash stages combined from them. A correct program passes (grouped K/V heads, either causal
alignment with splits no key of which a row sees, a window, softcap, ALiBi, packed sequences, bf16
and fp16); each split bug fails where it begins, a split's or the combine's, with its name; the
reports name the head, the split and the row (and the sequence and token of a packed case); a
folder that does not say its split size, or says two, is refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.split_programs import SplitCase, run_program, write_case, write_text
from verify.check.compare import Options, check
from verify.check.results import INHERITED, MISSING, PASS, SHAPE
from verify.diagnose.hypotheses import diagnose
from verify.model.half import round_to_format
from verify.report.json_file import to_json
from verify.report.text import failure_lines, header_lines, summary_lines, table_lines
from verify.stages import (FLASH_OUTPUT, FORWARD_STAGES, SPLIT_LSE, SPLIT_OUTPUT, STAGE_NAMES, STAGES,
                           parse_stage_file, stage_file)

SPLITS = (SPLIT_OUTPUT, SPLIT_LSE)
# N=8, M=37, K=8: 5 splits, the last partial; bottom-right causal leaves rows 0-2 without a key of split 4.
DECODE = dict(split_size=8, causal="bottom-right")
PACKED = dict(split_size=3, seqlens_q=[1, 4, 2], seqlens_k=[17, 9, 0], causal="bottom-right")


def split_run(tmp_path, shape, bug=None, precision="fp32", run_toml=False, opts=None, **kw):
    case = SplitCase(**shape)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", bug, precision, run_toml=run_toml, **kw)
    options = Options(jobs=1, precision=precision, split_size=None if run_toml else case.split_size, **(opts or {}))
    return check(tmp_path / "in", tmp_path / "out", options, diagnoser=diagnose)


def text(report) -> str:
    return "\n".join(header_lines(report) + table_lines(report) + failure_lines(report) + summary_lines(report))


def codes(report, stage):
    return {d.code for r in report.stage_results(stage) for d in r.diagnosis}


def statuses(report):
    return {s: {r.status for r in report.stage_results(s)} for s in report.stages}


# ---- the stage table and the file names ----------------------------------------------------------

def test_the_split_stages_stand_right_before_the_combine_and_only_in_a_run_that_splits():
    i = STAGE_NAMES.index(FLASH_OUTPUT)
    assert STAGE_NAMES[i - 2:i] == SPLITS
    for stage in SPLITS:
        st = STAGES[stage]
        assert st.split and st.flash and st.float32 and not st.backward and stage not in FORWARD_STAGES
    assert (STAGES[SPLIT_OUTPUT].cols, STAGES[SPLIT_LSE].cols) == ("SDV", "S")


def test_a_split_file_name_reads_back_and_keeps_the_old_callers_tuple():
    name = stage_file(SPLIT_LSE, 3, "npy", split=2)
    assert name == "split_lse_head_3_split_2.npy"
    parsed = parse_stage_file(name)
    assert (parsed.stage, parsed.head, parsed.fmt, parsed.split, parsed.seq) == (SPLIT_LSE, 3, "npy", 2, None)
    assert parsed.name == name and parsed != (SPLIT_LSE, 3, "npy")  # not the head's file
    assert parse_stage_file("flash_lse_head_3.txt") == ("flash_lse", 3, "txt")
    assert parse_stage_file("flash_lse_head_3.txt").split is None
    assert parse_stage_file("split_lse_head_3_split_x.txt") is None


# ---- correct programs pass ----------------------------------------------------------------------

@pytest.mark.parametrize("shape,precision", [
    (DECODE, "fp32"),
    (DECODE, "bf16"),
    (dict(split_size=8, causal="top-left"), "fp32"),                       # splits 1-4 empty for every row
    (dict(split_size=5, causal="bottom-right", alibi=True), "fp32"),
    (dict(split_size=4, softcap=5.0, causal="top-left"), "fp16"),
    (dict(split_size=7, window=(6, 2), seq_q=20, seq_k=30), "fp32"),
    (dict(split_size=1, seq_q=3, seq_k=5, heads=2, kv_heads=1), "fp32"),     # one key per split, MQA
    (dict(split_size=64, seq_q=4, seq_k=37), "fp32"),                       # one split holds every key
    (PACKED, "fp32"),
    (dict(split_size=16, seqlens_q=[3, 1], seqlens_k=[40, 70]), "bf16"),
], ids=["decode", "decode-bf16", "top-left", "alibi", "softcap-fp16", "window", "K1-mqa", "one-split", "packed",
        "packed-bf16"])
def test_a_correct_split_program_passes(tmp_path, shape, precision):
    report = split_run(tmp_path, shape, precision=precision)
    assert report.passed, text(report)
    assert report.stages == [SPLIT_OUTPUT, SPLIT_LSE, "flash_output", "flash_lse"]


@pytest.mark.parametrize("shape", [DECODE, PACKED], ids=["decode", "packed"])
def test_a_correct_split_program_printing_six_digits_passes(tmp_path, shape):
    report = split_run(tmp_path, shape, fmt="%g")
    assert report.passed, text(report)


def test_a_split_run_is_read_from_its_run_toml_and_each_split_is_a_column_block(tmp_path):
    report = split_run(tmp_path, DECODE, run_toml=True)
    assert report.passed, text(report)
    assert report.run.dims.split_size == 8 and report.run.dims.splits == 5
    r = report.stage_results(SPLIT_OUTPUT)[0]
    assert r.main.total == 8 * 5 * 16 and r.split_cols == 16


# ---- planted bugs: named, and placed in a split or in the combine --------------------------------

@pytest.mark.parametrize("bug,culprits,code,combine", [
    ("not_rescaled", ("flash_output",), "split_not_rescaled", "FAIL"),
    ("last_not_rescaled", ("flash_output",), "split_not_rescaled", "FAIL"),
    ("unnormalized", ("flash_output",), "split_not_rescaled", "FAIL"),
    ("exp2", ("flash_output", "flash_lse"), "split_exp2", "FAIL"),
    ("last_left_out", ("flash_output", "flash_lse"), "split_left_out", "FAIL"),
    ("first_only", ("flash_output", "flash_lse"), "split_left_out", "FAIL"),
    ("loop_one_short", ("flash_output", "flash_lse"), "split_left_out", "FAIL"),
    ("empty_counted", ("flash_output", "flash_lse"), "empty_split", "FAIL"),
    ("empty_lse_zero", (SPLIT_LSE,), "empty_split", INHERITED),
    ("empty_nan", SPLITS, "empty_split", INHERITED),
    ("overlap", SPLITS, "split_overlap", INHERITED),
    ("gap", SPLITS, "split_gap", INHERITED),
    ("tile_not_rescaled", SPLITS, "online_rescale_missing", INHERITED),
    ("split_unnormalized", (SPLIT_OUTPUT,), "softmax_unnormalized", INHERITED),
    ("lse_is_max", ("flash_lse",), "lse_sum_missing", PASS),
])
def test_a_split_bug_is_named_where_it_begins(tmp_path, bug, culprits, code, combine):
    report = split_run(tmp_path, DECODE, bug)
    assert not report.passed
    assert report.first_failing_stage == culprits[0], text(report)
    for stage in culprits:
        assert statuses(report)[stage] == {"FAIL"}, text(report)
        assert code in codes(report, stage), text(report)
    for stage in ("flash_output", "flash_lse"):
        if stage not in culprits:
            assert statuses(report)[stage] <= {combine, PASS}, text(report)
    for stage in set(SPLITS) - set(culprits):
        assert statuses(report)[stage] == {PASS}, text(report)


@pytest.mark.parametrize("shape", [DECODE, dict(split_size=8)], ids=["bottom-right", "not-causal"])
@pytest.mark.parametrize("bug, code, how", [
    ("exp2", "split_exp2", {"log": "log2"}),
    ("last_left_out", "split_left_out", {"split": "last"}),
    ("first_only", "split_left_out", {"split": "first"}),
    ("loop_one_short", "split_left_out", {"split": 4}),
])
@pytest.mark.parametrize("fmt", ["%.9g", "%g"])
def test_a_combine_bug_is_named_first_with_what_it_did(tmp_path, shape, bug, code, how, fmt):
    """Named first on both combined stages, with the split (or the logarithm) it took, from files
    printed with nine or six digits; where each row sees every split, the run's last split is each
    row's last (named as the loop one short)."""
    report = split_run(tmp_path, shape, bug, fmt=fmt)
    if shape is not DECODE and bug == "last_left_out":
        how = {"split": 4}
    for stage in ("flash_output", "flash_lse"):
        firsts = [r.diagnosis[0] for r in report.stage_results(stage) if not r.passed]
        assert firsts and {d.code for d in firsts} == {code}, text(report)
        detail = how if stage == "flash_lse" or code != "split_exp2" else {}
        assert all({k: d.detail.get(k) for k in detail} == detail for d in firsts), [d.detail for d in firsts]


@pytest.mark.parametrize("shape", [DECODE, dict(split_size=64, seq_q=4, seq_k=37),
                                   dict(split_size=8, causal="top-left")])
def test_an_unwritten_combined_output_is_not_named_a_split_left_out(tmp_path, shape):
    report = split_run(tmp_path, shape, "unwritten_output")
    assert not report.passed
    assert "split_left_out" not in codes(report, "flash_output"), text(report)


def test_a_gap_is_named_with_the_key_it_leaves_out_and_the_split_and_row(tmp_path):
    report = split_run(tmp_path, DECODE, "gap")
    lines = failure_lines(report)
    gap = next(d for r in report.stage_results(SPLIT_OUTPUT) for d in r.diagnosis if d.code == "split_gap")
    assert gap.detail["keys"] == [8, 16] and gap.detail["covered"] == [9, 16] and gap.detail["missed_keys"] == [8]
    fail = next(line for line in lines if line.startswith("FAIL split_output"))
    assert ", split " in fail and "(row " in fail and "worst at split " in fail
    assert any("split" in line and line.startswith("split_output") for line in table_lines(report))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("bug, code", [("gap", "split_gap"), ("overlap", "split_overlap")])
def test_a_split_boundary_at_half_precision_is_named_on_the_split_output(tmp_path, bug, code, precision):
    """A key more or fewer in a split of 64 moves its output by some ten of a half pipeline's bounds,
    not the hundred a float32 one gives: the split's output names it as its lse does."""
    report = split_run(tmp_path, dict(split_size=64, seq_q=4, seq_k=300, d=64, causal="bottom-right"), bug, precision)
    assert report.first_failing_stage == SPLIT_OUTPUT, text(report)
    for stage in SPLITS:
        assert code in codes(report, stage), (stage, text(report))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_correct_split_program_that_stores_its_partial_outputs_in_the_format_passes(tmp_path, precision):
    """vLLM's paged attention keeps its partial outputs in the query's dtype: split_output rounded to
    the format (the lse float32) passes, its storage's rounding added to the bound."""
    case = SplitCase(**DECODE, d=64)
    write_case(case, tmp_path / "in")
    res = run_program(case, tmp_path / "out", precision=precision)
    for h in range(case.heads):
        for s, mat in enumerate(res[SPLIT_OUTPUT][h]):
            write_text(tmp_path / "out" / f"split_output_head_{h}_split_{s}.txt", round_to_format(mat, precision))
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, precision=precision, split_size=8),
                   diagnoser=diagnose)
    assert report.passed, text(report)


def test_a_correct_split_program_at_bf16_fails_when_its_splits_are_rounded_like_its_output(tmp_path):
    """Split outputs stored in the format are bounded as stored so, not more loosely: a bf16 program's
    rounded splits moved by 1e-3 first do not pass (the check is not blind to the split stages'
    values)."""
    case = SplitCase(**DECODE, d=64)
    write_case(case, tmp_path / "in")
    res = run_program(case, tmp_path / "out", precision="bf16")
    for h in range(case.heads):
        for s, mat in enumerate(res[SPLIT_OUTPUT][h]):
            write_text(tmp_path / "out" / f"split_output_head_{h}_split_{s}.txt",
                       round_to_format(mat + np.float32(1e-3) * np.sign(mat), "bf16"))
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, precision="bf16", split_size=8),
                   diagnoser=diagnose)
    assert statuses(report)[SPLIT_OUTPUT] == {"FAIL"}


# ---- packed and grouped ------------------------------------------------------------------------

def test_a_packed_split_bug_names_the_sequence_token_split_and_packed_row(tmp_path):
    report = split_run(tmp_path, PACKED, "gap")
    assert report.first_failing_stage == SPLIT_OUTPUT
    failing = [r for r in report.stage_results(SPLIT_OUTPUT) if not r.passed]
    assert {r.sequence for r in failing} == {0, 1}  # sequence 2 reads no key: nothing to leave out
    line = next(x for x in failure_lines(report) if x.startswith("FAIL split_output"))
    assert "sequence " in line and "token " in line and "packed row " in line and "split " in line
    entry = next(e for e in to_json(report)["results"] if e["stage"] == SPLIT_OUTPUT and not e["passed"])
    assert entry["sequence"] is not None and entry["split"] is not None
    assert {"split", "split_col", "packed_row"} <= set(entry["worst"])


def test_grouped_heads_with_splits_catch_one_head_read_from_another_group(tmp_path):
    case = SplitCase(**DECODE)
    write_case(case, tmp_path / "in")
    case.inputs["K0"], case.inputs["K1"] = case.inputs["K1"], case.inputs["K0"].copy()  # query heads read the wrong group
    run_program(case, tmp_path / "out")
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, split_size=8), diagnoser=diagnose)
    assert report.first_failing_stage == SPLIT_OUTPUT
    assert statuses(report)["flash_output"] == {INHERITED}
    # No split diagnosis sees a wrong K/V head; the combine passes the error on, and there the
    # diagnoses of a run that does not split name it, for the splits too: only K is another
    # group's here, so the outputs read K of the other K/V head and V of their own, and the lse,
    # which reads no V, the other K/V head.
    failing = [r for r in report.stage_results(SPLIT_LSE) if not r.passed]
    assert failing and all([d.code for d in r.diagnosis][:2] == ["operand_head", "kv_head_map"] for r in failing)
    assert all(r.diagnosis[0].detail["operand"] == "K" for r in failing)
    assert "in flash_lse, the combine of the splits" in failing[0].diagnosis[1].message


def test_the_json_report_carries_the_split(tmp_path):
    report = split_run(tmp_path, DECODE, "overlap")
    entries = [e for e in to_json(report)["results"] if e["stage"] in SPLITS and not e["passed"]]
    assert entries and all(e["split"] in range(5) for e in entries)
    assert all(e["worst"]["split"] == e["split"] for e in entries)
    passing = [e for e in to_json(report)["results"] if e["stage"] == "flash_output"]
    assert all("split" not in e for e in passing)


# ---- reading: the split size, the files --------------------------------------------------------

def _folders(tmp_path, **kw):
    case = SplitCase(**DECODE)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", **kw)
    return tmp_path / "in", tmp_path / "out"


def test_the_command_line_checks_a_split_run_with_split_size(tmp_path):
    in_dir, out_dir = _folders(tmp_path)
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8, "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["passed"]
    assert "split-KV in splits of 8 keys" in r.output.splitlines()[0], r.output  # (the bounds it is checked with)


def test_split_files_without_a_split_size_are_refused_in_one_line(tmp_path):
    in_dir, out_dir = _folders(tmp_path)
    r = invoke("check", "--in", in_dir, "--out", out_dir)
    assert r.exit_code == 2
    assert "split_output_head_0_split_0.txt (a split stage) but no split size is known" in r.output
    assert "--split-size K" in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_a_split_size_that_disagrees_with_run_toml_names_both(tmp_path):
    in_dir, out_dir = _folders(tmp_path, run_toml=True)
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 4)
    assert r.exit_code == 2
    assert "split_size = 8 but --split-size 4" in r.output and "Traceback" not in r.output
    (out_dir / "run.toml").write_text("split_size = 0\n")
    r = invoke("check", "--in", in_dir, "--out", out_dir)
    assert r.exit_code == 2 and "split_size = 0: must be a number of keys >= 1" in r.output


def test_a_split_past_the_split_count_is_refused_naming_the_file(tmp_path):
    in_dir, out_dir = _folders(tmp_path)
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 16)  # 3 splits, 5 written
    assert r.exit_code == 2
    assert "split_3.txt: split 3 holds keys (e.g. " in r.output
    assert "but 16 keys per split makes 3 splits (0..2) of the longest row's keys" in r.output


def test_a_combine_that_guards_against_nan_splits_is_given_no_combine_bug(tmp_path):
    """Splits that hold NaN where a row sees no key (named on the split stages), combined by a
    program that gives a row with a NaN split output 0 and lse −inf: the combine of the program's
    own splits is NaN there, and no reading of the combine is evidence against it."""
    case = SplitCase(split_size=8, causal="bottom-right", window=(10, 0), d=64, seq_q=3, seq_k=100)
    write_case(case, tmp_path / "in")
    res = run_program(case, tmp_path / "out", "empty_nan")
    for h in range(case.heads):
        lses = np.hstack([np.asarray(x, np.float64).reshape(-1, 1) for x in res[SPLIT_LSE][h]])
        nan_rows = np.isnan(lses).any(axis=1)
        out = np.where(nan_rows[:, None], 0.0, res["flash_output"][h])
        lse = np.where(nan_rows[:, None], -np.inf, np.asarray(res["flash_lse"][h]).reshape(-1, 1))
        write_text(tmp_path / "out" / f"flash_output_head_{h}.txt", out.astype(np.float32))
        write_text(tmp_path / "out" / f"flash_lse_head_{h}.txt", lse.astype(np.float32))
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, split_size=8), diagnoser=diagnose)
    assert "empty_split" in codes(report, SPLIT_OUTPUT)
    for stage in ("flash_output", "flash_lse"):
        assert not codes(report, stage) & {"split_exp2", "split_not_rescaled", "split_left_out"}, text(report)


def test_a_split_lse_written_in_base_2_is_named(tmp_path):
    in_dir, out_dir = _folders(tmp_path)
    for h in range(4):
        for s in range(5):
            path = out_dir / f"split_lse_head_{h}_split_{s}.txt"
            write_text(path, (np.loadtxt(path, ndmin=2) * np.log2(np.e)).astype(np.float32))
    report = check(in_dir, out_dir, Options(jobs=1, split_size=8), diagnoser=diagnose)
    assert report.first_failing_stage == SPLIT_LSE
    assert "lse_log2" in codes(report, SPLIT_LSE), text(report)


def test_a_split_size_smaller_than_the_programs_hints_at_the_split_size(tmp_path):
    in_dir, out_dir = _folders(tmp_path)  # written 8 keys per split: files 0..4
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 4)  # 10 splits asked
    assert r.exit_code == 1
    assert ("split_output_head_0_split_5.txt is missing (the run splits the keys 4 per split: 10 splits per head, "
            "0..9); HINT: the split size the program used?") in r.output, r.output
    (out_dir / "split_output_head_0_split_2.txt").unlink()  # a file missing among others: no hint
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8)
    assert r.exit_code == 1 and "split_2.txt is missing" in r.output and "HINT: the split size" not in r.output


def test_a_stand_in_for_the_splits_of_a_sequence_without_keys_passes(tmp_path):
    """A packed case whose last sequence has no key: its splits' lse −FLT_MAX passes as −inf does."""
    case = SplitCase(**PACKED)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out")
    for h in range(case.heads):
        for s in range(case.splits):
            path = tmp_path / "out" / f"split_lse_head_{h}_split_{s}.txt"
            lse = np.loadtxt(path, ndmin=2)
            write_text(path, np.where(np.isneginf(lse), -3.4028235e38, lse).astype(np.float32))
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, split_size=case.split_size), diagnoser=diagnose)
    assert report.passed, text(report)


def test_a_stand_in_must_lie_far_below_the_rows_lse():
    """−1000 weighs 0 beside a row whose log-sum-exp is near 0, not beside one near −950: a stand-in
    is read as −inf only STAND_IN_GAP below the row's log-sum-exp over its splits."""
    from verify.check.split_values import stand_ins_read_as_empty
    keyless = np.array([[False, True], [False, True]])
    want = np.array([[2.0, -np.inf], [-950.0, -np.inf]])
    got = np.array([[2.0, -1000.0], [-950.0, -1000.0]])
    assert np.array_equal(stand_ins_read_as_empty(got, keyless, want), [[2.0, -np.inf], [-950.0, -1000.0]])


def test_trailing_split_files_that_hold_no_key_are_left_out_and_said(tmp_path):
    """A kernel that launches a fixed number of splits writes the ones past the keys too: lse −inf
    (or a stand-in for it) and output 0 in every row. Those pass, said in a note; one that holds a
    value is refused (another split size)."""
    in_dir, out_dir = _folders(tmp_path)  # 37 keys, 8 per split: splits 0..4
    n = 8
    for h in range(4):
        for s in (5, 6):
            write_text(out_dir / f"split_output_head_{h}_split_{s}.txt", np.zeros((n, 16), np.float32))
            write_text(out_dir / f"split_lse_head_{h}_split_{s}.txt",
                       np.full((n, 1), -np.inf if s == 5 else -3.4028235e38, np.float32))
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8)
    assert r.exit_code == 0, r.output
    assert "split_lse: the files of splits 5, 6 hold no key (lse −inf, output 0): past the 5 splits" in r.output
    for values, said in ((np.full((n, 16), 0.5), "holds keys (e.g. 0.5)"), (np.full((n, 16), np.nan), "holds NaN"),
                         (np.zeros((3, 5)), "is 3x5, not 8x16")):
        write_text(out_dir / "split_output_head_2_split_6.txt", values.astype(np.float32))
        r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8)
        assert r.exit_code == 2 and f"split_output_head_2_split_6.txt: split 6 {said}, but" in r.output, r.output


def test_a_finite_stand_in_for_an_empty_splits_lse_passes(tmp_path):
    """−FLT_MAX or −1e30 where a row sees no key of a split (a running maximum started there), not
    −inf: the split is empty all the same and the combine weighs it 0. A stand-in above −1000 (lse 0)
    is still an empty split mishandled."""
    in_dir, out_dir = _folders(tmp_path)  # bottom-right: rows 0-2 see no key of split 4
    for stand_in, passes in ((-3.4028235e38, True), (-1e30, True), (0.0, False)):
        for h in range(4):
            path = out_dir / f"split_lse_head_{h}_split_4.txt"
            lse = np.loadtxt(path, ndmin=2)
            write_text(path, np.where(np.isneginf(lse) | (lse < -1e3), stand_in, lse).astype(np.float32))
        report = check(in_dir, out_dir, Options(jobs=1, split_size=8), diagnoser=diagnose)
        assert report.passed == passes, (stand_in, text(report))
        if not passes:
            assert "empty_split" in codes(report, SPLIT_LSE)


def test_a_split_past_the_split_count_of_a_packed_case_counts_its_longest_sequence(tmp_path):
    case = SplitCase(**PACKED)  # the longest sequence has 17 keys: 6 splits of 3, the packed keys 26
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out")
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--split-size", 4)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "split 5 holds keys (e.g. " in r.output
    assert "but 4 keys per split makes 5 splits (0..4) of the longest row's keys" in r.output


def test_a_mask_bug_in_a_split_run_is_not_named_an_empty_split(tmp_path):
    in_dir, out_dir = _folders(tmp_path)  # a right bottom-right program, checked as top-left
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8, "--causal", "top-left")
    assert r.exit_code == 1, r.output
    assert "empty_split" not in r.output, r.output
    assert "mask_offset" in r.output.split("FAIL split_output", 1)[1].split("\nFAIL ", 1)[0], r.output


def test_nan_in_the_rows_of_a_sequence_without_keys_is_an_empty_split(tmp_path):
    report = split_run(tmp_path, PACKED, "empty_nan")  # sequence 2 reads no key: every split of it is empty
    keyless = [r for r in report.stage_results(SPLIT_OUTPUT) if r.sequence == 2 and not r.passed]
    assert keyless and all(r.diagnosis and r.diagnosis[0].code == "empty_split" for r in keyless)
    assert "sequence 2 holds" in keyless[0].diagnosis[0].message


def test_a_missing_split_file_and_one_of_the_wrong_shape_are_named(tmp_path):
    in_dir, out_dir = _folders(tmp_path)
    (out_dir / "split_output_head_1_split_4.txt").unlink()
    write_text(out_dir / "split_lse_head_2_split_0.txt", np.zeros((7, 1)))
    report = check(in_dir, out_dir, Options(jobs=1, split_size=8), diagnoser=diagnose)
    missing = [r for r in report.stage_results(SPLIT_OUTPUT) if r.status == MISSING]
    assert [r.head for r in missing] == [1] and "split_output_head_1_split_4.txt is missing" in missing[0].message
    shape = [r for r in report.stage_results(SPLIT_LSE) if r.status == SHAPE]
    assert [r.head for r in shape] == [2] and "is 7x1, expected 8x1" in shape[0].message
    # the flash stages of those heads are checked without the combine (their split files unread)
    assert {r.status for r in report.stage_results("flash_output")} == {PASS}


def test_a_program_that_writes_only_its_splits_is_checked(tmp_path):
    report = split_run(tmp_path, DECODE, stages=SPLITS)
    assert report.passed and report.stages == list(SPLITS)


def test_a_failing_split_run_writes_its_reports_and_error_maps(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the plot extra)")
    in_dir, out_dir = _folders(tmp_path, bug="gap")
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--split-size", 8, "--junit", tmp_path / "r.xml",
               "--plot", tmp_path / "maps", "--quiet")
    assert r.exit_code == 1, r.output
    assert "split_gap" in r.output and "split_gap" in (tmp_path / "r.xml").read_text()
    assert any(p.name.startswith("split_output_head_0") for p in (tmp_path / "maps").iterdir())

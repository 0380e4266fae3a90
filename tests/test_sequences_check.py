"""check of a packed (varlen) run: another program's files (%g text, no run.toml) of sequences
packed along the tokens, each sequence checked as a dense case of its own. A correct program
passes (grouped K/V heads, padded key slots, a sequence without keys, one without queries); each
classic varlen bug fails at the stage and in the sequence where it begins, and the reports name
the sequence, the token within it and the packed row."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.packed_programs import (BACKWARD, FLASH, FORWARD, PackedCase, check_packed, run_program,
                                     write_case, write_text)
from verify.check.compare import Options
from verify.check.packed import UNREAD_KEY_ROW
from verify.check.results import PASS
from verify.report.json_file import to_json
from verify.report.junit import write_junit
from verify.report.text import failure_lines, header_lines, summary_lines, table_lines

ALL = FORWARD + BACKWARD
# Four sequences: padded slots (seqused_k), a sequence of no key (2), grouped K/V heads.
MIXED = dict(seqlens_q=[5, 6, 7, 3], seqlens_k=[6, 4, 0, 9], seqused_k=[4, 4, 0, 5], heads=4, kv_heads=2)
# n(b) != m(b) in every sequence, no padding: the causal alignment matters in each.
CAUSAL = dict(seqlens_q=[5, 3, 7], seqlens_k=[8, 6, 9], heads=2, kv_heads=1, causal=True)
BOTTOM_RIGHT = dict(jobs=1, causal=True, variant={"align": "bottom-right"})


def packed_run(tmp_path, shape, stages=ALL, bug=None, opts=None):
    case = PackedCase(**shape)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", stages, bug)
    return check_packed(tmp_path / "in", tmp_path / "out", Options(**(opts or {"jobs": 1})))


def text(report) -> str:
    return "\n".join(header_lines(report) + table_lines(report) + failure_lines(report) + summary_lines(report))


def failing(report, stage):
    return [r for r in report.stage_results(stage) if not r.passed]


def test_a_correct_packed_run_passes_sequence_by_sequence(tmp_path):
    report = packed_run(tmp_path, MIXED)
    assert report.passed, text(report)
    assert "4 packed sequences" in header_lines(report)[0]
    # every (head, sequence) with queries, each of its own size; sequence 2 reads no key
    out = report.stage_results("flash_output")
    assert sorted({(r.head, r.sequence) for r in out}) == [(h, b) for h in range(4) for b in range(4)]
    assert {r.sequence: r.main.total for r in out if r.head == 0} == {0: 5 * 16, 1: 6 * 16, 2: 7 * 16, 3: 3 * 16}
    # dK: per K/V head and sequence, and its key rows no query reads (padding, and sequence 2's slot)
    dk = report.stage_results("dK")
    assert {(r.head, r.sequence, r.padding_rows) for r in dk} >= {(0, 0, False), (1, 3, False), (0, None, True)}
    # the table counts heads, not head x sequence pairs
    assert any(line.startswith("flash_output") and " 4/4 " in line for line in table_lines(report))
    assert any(line.startswith("dK ") and " 2/2 " in line for line in table_lines(report))


def test_each_sequence_is_causal_at_its_own_bottom_right_corner(tmp_path):
    report = packed_run(tmp_path, CAUSAL, opts=BOTTOM_RIGHT)
    assert report.passed, text(report)


def test_the_causal_mask_aligned_top_left_fails_at_the_scores_of_the_sequences_it_moves(tmp_path):
    report = packed_run(tmp_path, CAUSAL, bug="top_left", opts=BOTTOM_RIGHT)
    assert report.first_failing_stage == "QK_scaled"
    first = report.first_failure
    assert (first.head, first.sequence) == (0, 0)
    assert any(d.code == "mask_offset" for d in first.diagnosis), text(report)
    assert all(r.passed for r in report.stage_results("QK"))


@pytest.mark.parametrize("bug, sequences", [("leak", {1, 2, 3}), ("off_by_one", {1, 2, 3})])
def test_attention_across_a_sequence_boundary_fails_in_the_sequences_that_read_it(tmp_path, bug, sequences):
    report = packed_run(tmp_path, dict(MIXED, seqlens_k=[6, 4, 3, 9], seqused_k=None), FLASH, bug)
    assert report.first_failing_stage == "flash_output"
    assert {r.sequence for r in failing(report, "flash_output")} == sequences
    assert all(r.passed for r in report.stage_results("flash_output") if r.sequence == 0)
    first = report.first_failure
    assert (first.head, first.sequence) == (0, 1)
    assert first.offsets == (5, 0)
    out = text(report)
    assert "FAIL flash_output, all 4 heads, sequences 1-3 alike; head 0, sequence 1 (token " in out
    assert f"packed row {5 + first.main.worst[0]})" in out
    assert "first failing stage: flash_output (all 4 heads, sequences 1-3)" in out


def test_padding_keys_read_fail_in_the_padded_sequences_and_their_padding_rows(tmp_path):
    report = packed_run(tmp_path, MIXED, FLASH, bug="padding_read")
    assert report.first_failing_stage == "flash_output"
    assert {r.sequence for r in failing(report, "flash_output")} == {0, 3}   # the two padded slots
    pad = [r for r in failing(report, "flash_dK") if r.padding_rows]
    assert pad and pad[0].diagnosis[0].code == UNREAD_KEY_ROW


def test_a_nonzero_padding_row_of_dK_fails_naming_the_row(tmp_path):
    report = packed_run(tmp_path, MIXED, bug="padding_dk")
    assert report.first_failing_stage == "dK"
    bad = failing(report, "dK")
    assert [(r.head, r.padding_rows) for r in bad] == [(0, True)]
    assert "packed key row 4 (padding of sequence 0: key 4 of its slot of 6, past the 4 it uses)" in bad[0].message
    assert all(r.passed for r in report.stage_results("dK") if not r.padding_rows)
    assert "dK K/V head 0 (query heads 0-1), key rows no query reads: packed row 4" in text(report)
    write_junit(report, tmp_path / "junit.xml")
    assert 'name="kv_head_0_padding_rows"' in (tmp_path / "junit.xml").read_text()


def test_a_sequence_without_keys_must_output_zero(tmp_path):
    case = PackedCase(**MIXED)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", FLASH)
    path = tmp_path / "out" / "flash_output_head_1.txt"
    mat = np.loadtxt(path)
    mat[12] = 0.25   # packed row 12: token 1 of sequence 2, which reads no key
    write_text(path, mat)
    report = check_packed(tmp_path / "in", tmp_path / "out")
    bad = failing(report, "flash_output")
    assert [(r.head, r.sequence, r.main.worst[0]) for r in bad] == [(1, 2, 1)]
    assert "reads no key" in bad[0].message
    assert "flash_output head 1, sequence 2 (token 1, packed row 12)" in text(report)


def test_json_and_junit_name_the_sequence(tmp_path):
    report = packed_run(tmp_path, dict(MIXED, seqlens_k=[6, 4, 3, 9], seqused_k=None), FLASH, "leak")
    data = json.loads(json.dumps(to_json(report)))
    assert data["sequences"]["cu_seqlens_q"] == [0, 5, 11, 18, 21]
    first = data["first_failure"]
    assert (first["stage"], first["head"], first["sequence"]) == ("flash_output", 0, 1)
    assert first["worst"]["packed_row"] == first["worst"]["row"] + 5
    stage = next(s for s in data["stages"] if s["stage"] == "flash_output")
    assert (stage["heads"], stage["heads_passed"]) == (4, 0)
    write_junit(report, tmp_path / "junit.xml")
    xml = (tmp_path / "junit.xml").read_text()
    assert 'name="head_0_seq_1"' in xml and 'name="kv_head_1_seq_3"' in xml


def test_a_missing_sequence_file_is_named(tmp_path):
    case = PackedCase(**CAUSAL)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", ("QK", "QK_scaled", "output"))
    (tmp_path / "out" / "QK_head_1_seq_2.txt").unlink()
    report = check_packed(tmp_path / "in", tmp_path / "out", Options(**BOTTOM_RIGHT))
    bad = failing(report, "QK")
    assert [(r.head, r.sequence, r.status) for r in bad] == [(1, 2, "MISSING")]
    assert "QK_head_1_seq_2.txt is missing" in bad[0].message
    assert all(r.status == PASS for r in report.stage_results("QK_scaled") if r.sequence != 2 or r.head != 1)


def test_a_per_token_stage_written_one_file_per_sequence_is_told_how_it_is_stored(tmp_path):
    """flash_output_head_0_seq_1.txt and the like: a per-token stage is one file per head over every
    sequence's tokens; the message says so, and which stages are per sequence."""
    case = PackedCase(**CAUSAL)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", ("flash_output",))
    for h in range(case.heads):
        whole = np.loadtxt(tmp_path / "out" / f"flash_output_head_{h}.txt", ndmin=2)
        (tmp_path / "out" / f"flash_output_head_{h}.txt").unlink()
        for b in range(case.count):
            write_text(tmp_path / "out" / f"flash_output_head_{h}_seq_{b}.txt", whole[case.cu_q[b]:case.cu_q[b + 1]])
    report = check_packed(tmp_path / "in", tmp_path / "out", Options(**BOTTOM_RIGHT))
    bad = failing(report, "flash_output")
    assert bad and all(r.status == "MISSING" for r in bad)
    assert ("HINT: flash_output is stored packed, one file per head over every sequence's tokens; the _seq_<b> "
            "files are for the N×M stages (QK, ") in bad[0].message, bad[0].message


# ---- K, V and KT on the key rows no query reads: echoed as read -----------------------------------

# A sequence without queries (1) beside a padded slot (2): key rows 3-7 and 12 are read by no query.
UNREAD = dict(seqlens_q=[3, 0, 4], seqlens_k=[3, 5, 5], seqused_k=[3, 5, 4], heads=2, kv_heads=1)


def _run_with(tmp_path, shape, path, edit):
    """A correct run of `shape` whose file `path` (in the run) `edit` changes, checked."""
    case = PackedCase(**shape)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", ALL)
    mat = np.loadtxt(tmp_path / "out" / path, ndmin=2)
    edit(mat)
    write_text(tmp_path / "out" / path, mat)
    return check_packed(tmp_path / "in", tmp_path / "out")


def test_a_correct_run_echoes_k_v_and_kt_on_the_key_rows_no_query_reads(tmp_path):
    report = packed_run(tmp_path, UNREAD)
    assert report.passed, text(report)
    for stage in ("K", "V", "KT", "dK", "flash_dV"):
        unread = [r for r in report.stage_results(stage) if r.padding_rows]
        assert len(unread) == 1 and unread[0].main.total == 6 * 16, stage


def test_a_garbage_k_row_in_a_padded_slot_fails_naming_the_packed_row(tmp_path):
    def garbage(mat):
        mat[5] = 7.0   # packed key row 5: key 5 of sequence 0's slot of 6, which reads 4
    report = _run_with(tmp_path, MIXED, "K_head_1.txt", garbage)
    bad = failing(report, "K")
    assert [(r.head, r.padding_rows) for r in bad] == [(1, True)], text(report)
    assert bad[0].diagnosis[0].code == UNREAD_KEY_ROW
    assert ("packed key row 5 (padding of sequence 0: key 5 of its slot of 6, past the 4 it uses) is not the "
            "input's: no query reads it, but its K is still the input as read") in bad[0].message
    assert "K K/V head 1 (query heads 2-3), key rows no query reads: packed row 5" in text(report)
    assert all(r.passed for r in report.stage_results("K") if not r.padding_rows)


def test_a_garbage_kt_column_of_a_sequence_without_queries_fails_naming_the_packed_row(tmp_path):
    def garbage(mat):
        mat[2, 6] += 0.5   # packed key row 6: a key of sequence 1, which has no queries
    report = _run_with(tmp_path, UNREAD, "KT_head_0.txt", garbage)
    bad = failing(report, "KT")
    assert [(r.head, r.padding_rows, r.main.worst) for r in bad] == [(0, True, (2, 6))], text(report)
    assert ("packed key row 6 (a key of sequence 1, which has no queries) is not the input's: no query reads it, "
            "but its KT is still K transposed, as read") in bad[0].message
    assert "KT K/V head 0 (query heads 0-1), key rows no query reads: packed row 6" in text(report)
    assert report.first_failing_stage == "KT"

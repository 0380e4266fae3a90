"""The varlen bugs named: a packed run whose sequence read the wrong rows of the packed stream fails
with sequence_leak, sequence_boundary or padding_read (verify/diagnose/sequences.py), in the JSON
report and in the text; a correct run, and a bug of another kind in a packed run, carry none."""
from __future__ import annotations

import json

import numpy as np

import helpers.packed_programs as programs
from helpers.packed_programs import (BACKWARD, FLASH, FORWARD, PackedCase, check_packed, run_program, write_case,
                                     write_text)
from verify.check.compare import Options
from verify.diagnose.sequences import CODES
from verify.report.json_file import to_json
from verify.report.text import failure_lines, summary_lines, table_lines

# Slots of 6, 4, 3 and 9 keys, no padding (the neighbours' keys are there to be read).
SLOTS = dict(seqlens_q=[5, 6, 7, 3], seqlens_k=[6, 4, 3, 9], heads=2, kv_heads=1)
# Padded slots (seqused_k), a sequence without keys.
PADDED = dict(seqlens_q=[5, 6, 7, 3], seqlens_k=[6, 4, 0, 9], seqused_k=[4, 4, 0, 5], heads=2, kv_heads=1)
CAUSAL = dict(seqlens_q=[5, 3, 7], seqlens_k=[8, 6, 9], heads=2, kv_heads=1, causal=True)
BOTTOM_RIGHT = dict(jobs=1, causal=True, variant={"align": "bottom-right"})


def packed_run(tmp_path, shape, stages=FLASH, bug=None, opts=None, case_type=PackedCase):
    case = case_type(**shape)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", stages, bug)
    return check_packed(tmp_path / "in", tmp_path / "out", Options(**(opts or {"jobs": 1})))


def text(report) -> str:
    return "\n".join(table_lines(report) + failure_lines(report) + summary_lines(report))


def json_codes(report, stage=None) -> dict:
    """{(stage, head, sequence): [codes]} of the failing results in the JSON report."""
    data = json.loads(json.dumps(to_json(report)))
    return {(r["stage"], r["head"], r["sequence"]): [d["code"] for d in r.get("diagnosis", [])]
            for r in data["results"] if r["status"] != "PASS" and stage in (None, r["stage"])}


def sequence_codes(report) -> set:
    return {c for codes in json_codes(report).values() for c in codes if c in CODES}


def assert_named(report, code, stages=("flash_output", "flash_lse", "flash_dQ")):
    """Every failing result of `stages` names `code` first, in the JSON and in the text."""
    for stage in stages:
        found = json_codes(report, stage)
        assert found, stage
        for where, codes in found.items():
            assert codes[:1] == [code], (where, codes)
    assert f"diagnosis {code}: flash_output: " in text(report)


def test_a_leak_into_the_previous_sequence_is_named(tmp_path):
    report = packed_run(tmp_path, SLOTS, bug="leak")
    assert {s for _, _, s in json_codes(report, "flash_output")} == {1, 2, 3}
    assert_named(report, "sequence_leak")
    first = report.first_failure
    assert (first.stage, first.sequence) == ("flash_output", 1)
    assert first.diagnosis[0].detail["read_sequence"] == 0
    assert ("sequence 1's queries also attend to the keys of sequence 0 before it (sequence 0's keys 0..5 and its "
            "keys 0..3 instead of its keys 0..3; packed key rows 0-9 instead of 6-9)") in first.diagnosis[0].message
    assert "; sequence_leak: flash_output: sequence 1's" in "\n".join(summary_lines(report))


def test_a_leak_under_a_causal_mask_is_named(tmp_path):
    report = packed_run(tmp_path, CAUSAL, bug="leak", opts=BOTTOM_RIGHT)
    assert_named(report, "sequence_leak")


def test_boundary_one_row_early_names_the_sequence_and_the_shift(tmp_path):
    report = packed_run(tmp_path, SLOTS, bug="off_by_one")
    assert_named(report, "sequence_boundary")
    for r in report.stage_results("flash_output"):
        if not r.passed:
            d = r.diagnosis[0]
            assert (d.detail["sequence"], d.detail["shift"], d.detail["side"]) == (r.sequence, -1, "keys start")
    assert ("sequence 1's keys start 1 row early (sequence 0's key 5 and its keys 0..3 instead of its keys 0..3; "
            "packed key rows 5-9 instead of 6-9)") in text(report)


def _key_rows_with(monkeypatch, bugs):
    """The program's key rows for sequence b with more planted bugs (name -> rows of b, or None: the
    sequence's own)."""
    own = programs._key_rows

    def key_rows(case, b, bug):
        rows = bugs[bug](case, b) if bug in bugs else None
        return own(case, b, None if bug in bugs else bug) if rows is None else rows
    monkeypatch.setattr(programs, "_key_rows", key_rows)


def test_a_boundary_two_rows_late_is_named(tmp_path, monkeypatch):
    _key_rows_with(monkeypatch, {"late_2": lambda case, b: range(case.cu_k[b] + 2, case.cu_k[b] + case.used(b))})
    report = packed_run(tmp_path, SLOTS, bug="late_2")
    assert_named(report, "sequence_boundary")
    d = report.first_failure.diagnosis[0]
    assert (d.detail["sequence"], d.detail["shift"]) == (0, 2)
    assert "sequence 0's keys start 2 rows late (its keys 2..5 instead of 0..5; packed key rows 2-5 instead of 0-5)" \
        in d.message


def test_dense_attention_over_every_packed_key_is_named(tmp_path, monkeypatch):
    _key_rows_with(monkeypatch, {"dense": lambda case, b: range(0, case.cu_k[-1])})
    report = packed_run(tmp_path, SLOTS, bug="dense")
    assert_named(report, "sequence_leak")
    assert report.first_failure.diagnosis[0].detail["how"] == "dense over every key"
    assert "the packing is ignored: sequence 0's queries attend to all 22 packed keys" in text(report)


def test_a_causal_mask_over_the_whole_stream_is_named(tmp_path):
    """A program that ignores the packing of a causal case: one causal attention over every token."""
    shape = dict(seqlens_q=[4, 6, 5], seqlens_k=[4, 6, 5], heads=1, kv_heads=1, causal=True)
    case = PackedCase(**shape)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", ("flash_output",))
    q, k, v = (case.inputs[n][0].astype(np.float64) for n in ("Q", "K", "V"))
    s = np.where(np.triu(np.ones((15, 15), bool), 1), -np.inf, q @ k.T * case.scale)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    out = (p / p.sum(axis=1, keepdims=True)) @ v
    write_text(tmp_path / "out" / "flash_output_head_0.txt", out.astype(np.float32))
    report = check_packed(tmp_path / "in", tmp_path / "out", Options(**BOTTOM_RIGHT))
    assert {s for _, _, s in json_codes(report, "flash_output")} == {1, 2}   # sequence 0 sees only its own keys
    assert_named(report, "sequence_leak", ("flash_output",))
    # sequence 1 sees sequence 0's keys and its own, causally: the previous sequence's leak, exactly
    details = {r.sequence: r.diagnosis[0].detail for r in report.stage_results("flash_output") if not r.passed}
    assert details[1]["read_sequence"] == 0 and details[2]["how"] == "causal over the whole stream"
    assert "attend to every earlier key of the packed stream, as a causal mask over all 15 queries" in \
        report.stage_results("flash_output")[2].diagnosis[0].message


def test_padding_keys_read_are_named(tmp_path):
    report = packed_run(tmp_path, PADDED, bug="padding_read")
    assert {s for _, _, s in json_codes(report, "flash_output")} == {0, 3}
    assert_named(report, "padding_read")
    d = report.first_failure.diagnosis[0]
    assert (d.detail["sequence"], d.detail["padding_keys"]) == (0, 2)
    assert ("sequence 0 reads the 2 padding keys of its slot past seqused_k = 4 (its padding keys 4..5; packed key "
            "rows 4-5)") in d.message


class LargeLogits(PackedCase):
    """Logits of tens: weights near one-hot."""
    def draw(self) -> None:
        super().draw()
        self.inputs["Q"] *= np.float32(12)


def test_padding_keys_read_at_large_logits_are_named_first(tmp_path):
    """Near one-hot weights: the padding keys read, a bottom-right causal mask shifted past the
    diagonal and the packing ignored may all give the same rows. The padding read is named wherever
    it fits: first, or after the mask's shift that gives the same rows (named first)."""
    shape = dict(seqlens_q=[30, 3, 20], seqlens_k=[34, 50, 20], seqused_k=[30, 21, 20], heads=2, kv_heads=1,
                 causal=True, d=64)
    report = packed_run(tmp_path, shape, bug="padding_read", opts=BOTTOM_RIGHT, case_type=LargeLogits)
    found = json_codes(report, "flash_output")
    assert {s for _, _, s in found} == {0, 1}
    assert all(codes[0] == "padding_read" or codes[:2] == ["mask_offset", "padding_read"]
               for codes in found.values()), found
    assert found[("flash_output", 0, 0)][:2] == ["mask_offset", "padding_read"]  # (4 keys past the diagonal)


def test_the_other_planted_bugs_keep_their_own_names(tmp_path):
    report = packed_run(tmp_path / "dk", PADDED, FORWARD + BACKWARD, bug="padding_dk")
    assert json_codes(report) == {(s, 0, None): ["unread_key_row"] for s in ("dK", "flash_dK")}
    assert "diagnosis unread_key_row: " in text(report)
    report = packed_run(tmp_path / "tl", CAUSAL, FORWARD, bug="top_left", opts=BOTTOM_RIGHT)
    codes = json_codes(report)
    assert all(c[0] == "mask_offset" for (stage, _, _), c in codes.items() if stage in ("QK_scaled", "flash_output"))
    assert not sequence_codes(report), text(report)


def test_a_correct_run_names_no_sequence_bug(tmp_path):
    report = packed_run(tmp_path, PADDED, FORWARD + BACKWARD)
    assert report.passed and not sequence_codes(report)


class _WrongScale(PackedCase):
    @property
    def scale(self) -> float:
        return 1.0 / self.d   # 1/d_k for 1/√d_k


def test_a_wrong_scale_in_a_packed_run_is_no_sequence_bug(tmp_path):
    report = packed_run(tmp_path, PADDED, bug=None, case_type=_WrongScale)
    assert report.first_failing_stage == "flash_output"
    codes = json_codes(report, "flash_output")
    assert codes and all(c[:1] == ["scaled"] for c in codes.values()), codes
    assert not sequence_codes(report)


def test_a_wrong_scale_in_long_packed_sequences_tries_no_sequence_reading(tmp_path, monkeypatch):
    """A stage already explained by a wrong scale is not recomputed as each sequence reading."""
    import verify.diagnose.sequences as sequence_bugs
    tried = []
    readings = sequence_bugs.readings
    monkeypatch.setattr(sequence_bugs, "readings", lambda *a: tried.append(a[1]) or readings(*a))
    shape = dict(seqlens_q=[300, 200, 256], seqlens_k=[300, 200, 256], heads=2, kv_heads=1)
    report = packed_run(tmp_path, shape, stages=("flash_output", "flash_lse"), case_type=_WrongScale)
    codes = json_codes(report)
    assert {s for _, _, s in codes} == {0, 1, 2}
    assert codes and all(c[:1] == ["scaled"] for c in codes.values()), codes
    assert not sequence_codes(report) and not tried


def test_one_padding_key_read_is_said_in_the_singular(tmp_path):
    shape = dict(seqlens_q=[5, 6], seqlens_k=[6, 4], seqused_k=[5, 4], heads=2, kv_heads=1)
    report = packed_run(tmp_path, shape, bug="padding_read")
    assert_named(report, "padding_read")
    assert "reads the 1 padding key of its slot" in text(report) and "packed key row 5)" in text(report), text(report)


# ---- at bf16: a half pipeline's output bound is wide beside a misread sequence's effect --------------

BF16_FORWARD = ("flash_output", "flash_lse")
BF16 = {"jobs": 1, "precision": "bf16"}
BF16_SLOTS = dict(seqlens_q=[20, 30, 17], seqlens_k=[20, 30, 17], heads=2, kv_heads=1, d=64, precision="bf16")
# Decode: one query a sequence, padded key slots.
BF16_DECODE = dict(seqlens_q=[1, 1, 1], seqlens_k=[100, 64, 50], seqused_k=[70, 64, 33], heads=2, kv_heads=1,
                   d=64, precision="bf16")


def test_bf16_correct_packed_runs_pass(tmp_path):
    for i, shape in enumerate((BF16_SLOTS, BF16_DECODE)):
        for seed in range(3):
            report = packed_run(tmp_path / f"{i}_{seed}", {**shape, "seed": seed}, BF16_FORWARD, opts=BF16)
            assert report.passed, [(r.stage, r.head, r.sequence, r.message) for r in report.results if not r.passed]


def test_bf16_sequence_bugs_are_named_on_the_output(tmp_path):
    """The output, not only the lse (whose bound is a float32 one): a decode step's lse is one value a
    sequence, which no reading is named on."""
    for bug, shape, code in (("leak", BF16_SLOTS, "sequence_leak"), ("off_by_one", BF16_SLOTS, "sequence_boundary"),
                             ("padding_read", BF16_DECODE, "padding_read")):
        report = packed_run(tmp_path / bug, shape, BF16_FORWARD, bug=bug, opts=BF16)
        found = json_codes(report, "flash_output")
        assert found and all(codes[:1] == [code] for codes in found.values()), (bug, found)


def test_bf16_a_boundary_one_key_off_is_not_named_a_leak_that_fits_less_closely(tmp_path):
    """Sequence 1 reads one key of sequence 0 (two keys long): reading both of them (a leak) fits
    the bf16 output within a few bounds too, less closely. The closest reading is named, never the
    first that fits; where two fit about as closely, neither."""
    shape = dict(seqlens_q=[1, 1, 1, 1], seqlens_k=[2, 60, 3, 80], heads=2, kv_heads=1, d=64, precision="bf16")
    named = []
    for seed in (13, 0, 1, 2, 3):
        report = packed_run(tmp_path / str(seed), {**shape, "seed": seed}, BF16_FORWARD, bug="off_by_one", opts=BF16)
        named += [codes[0] for codes in json_codes(report, "flash_output").values() if codes]
    assert named and set(named) == {"sequence_boundary"}, named

"""Checking programs other than attnstep's binary: no run.toml, any subset of stages, printed
resolution, one .npy for every head, name maps, the input case deciding causal/scale, claims in
run.toml, underflow at tiny magnitudes, fast-math intrinsics, run --binary -- ARGS, and the Python
API. tests/test_foreign_routes.py sweeps the correct routes and classic bugs; this file pins each
feature down on its own.
"""
from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

import attnstep
from helpers import foreign_routes as foreign
from helpers.cli import generate_input, invoke
from verify.check.reference import reference_chain
from verify.model.half import round_to_format
from verify.files.resolution import EXACT, Resolution, text_resolution
from verify.stages import Dims, default_scale, stage_file
from verify.variant import Variant, hidden

DIMS = Dims(1, 2, 24, 40, 16, 16)
f32 = np.float32


def make_input(folder: Path, dims: Dims = DIMS, causal: bool = False, manifest: bool = True, seed: int = 3):
    """`attnstep generate` into FOLDER (uniform values); the heads' Q, K, V as read back."""
    generate_input(folder, dims, "uniform", seed, causal, manifest)
    return foreign.read_inputs(folder, dims.total_heads)


def correct_heads(inputs, causal=False, scale=None):
    return foreign.compute_heads(inputs, default_scale(DIMS.d_k) if scale is None else scale, causal)


def write_heads(folder: Path, heads, stages, fmt="%.9g"):
    folder.mkdir(parents=True, exist_ok=True)
    for i, h in enumerate(heads):
        for s in stages:
            np.savetxt(folder / stage_file(s, i, "txt"), np.asarray(h[s], f32).astype(np.float64), fmt=fmt)


def check(in_dir, out_dir, *extra, json_path=None):
    args = ["check", "--in", in_dir, "--out", out_dir, *extra]
    if json_path:
        args += ["--json", json_path]
    r = invoke(*args)
    return r, (json.loads(Path(json_path).read_text()) if json_path and Path(json_path).exists() else None)


# ---- printed resolution -------------------------------------------------------------------------

@pytest.mark.parametrize("text,kind,count", [
    (b"0.123457 1\n2.5e-07 -3.14159\n", "digits", 6),   # %g
    (b"0.123457 1.000000\n0.000000 -3.141593\n", "decimals", 6),  # %.6f
    (b"# attnstep stage=QK\n0.123456791 1\n", "exact", 0),  # %.9g
    (b"1 0\n0 1\n", "digits", 6),                        # integers only: C's default assumed
    (b"1.235e-05 2.000e+00\n", "digits", 4),             # %.3e
])
def test_printed_resolution_is_read_from_the_file(text, kind, count):
    r = text_resolution(text)
    assert (r.kind, r.count) == (kind, count)


def test_the_quantum_is_half_a_unit_in_the_last_place():
    g = Resolution("digits", 6)
    q = g.quantum(np.array([0.123457, 12345.6, 0.0]))
    assert q[0] == pytest.approx(0.5e-6, rel=0.02) and q[1] == pytest.approx(0.05, rel=0.02) and q[2] == 0
    assert Resolution("decimals", 6).quantum(np.array([1e-9]))[0] == pytest.approx(0.5e-6)
    assert EXACT.quantum(np.ones(3)) is None


@pytest.mark.parametrize("fmt", ["%g", "%.6f", "%.9g"])
def test_coarse_printing_passes_and_is_shown(tmp_path, fmt):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), foreign.SUBSETS["seed"], fmt)
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    want = {"%g": "6 significant digits", "%.6f": "6 decimals", "%.9g": "exact"}[fmt]
    assert {s["resolution"] for s in rep["stages"]} == {want}
    if fmt != "%.9g":
        assert "resolution" in r.output.splitlines()[1] and "%.9g" in r.output  # column and note


def test_rows_that_see_no_key_do_not_make_an_exact_file_look_coarse(tmp_path):
    """An lse written with 8 decimals, its values in [1, 10) (9 digits: float32's own) and -inf where
    a row sees no key (bottom-right, N > M), whose bound is 0: no note that the file's resolution
    limits the check."""
    r = invoke("generate", "--out", tmp_path / "in", "--heads", 2, "--seq-q", 40, "--seq-k", 24, "--d-k", 16,
               "--d-v", 16, "--causal", "bottom-right", "--format", "npy")
    assert r.exit_code == 0, r.output
    (tmp_path / "out").mkdir()
    for i in range(2):
        q, k = (np.load(tmp_path / "in" / f"{n}_head_{i}.npy").astype(f32) for n in "QK")
        s = (q @ k.T) * f32(default_scale(16))
        s[np.arange(40)[:, None] - 16 < np.arange(24)[None, :]] = -np.inf
        with np.errstate(divide="ignore", invalid="ignore"):
            m = s.max(axis=1, keepdims=True)
            lse = m + np.log(np.exp(s - m).sum(axis=1, keepdims=True))
        lse[~np.isfinite(m[:, 0])] = -np.inf
        np.savetxt(tmp_path / "out" / f"lse_{i}.txt", lse.astype(np.float64), fmt="%.8f")
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--name", "flash_lse=lse_{i}.txt")
    assert r.exit_code == 0, r.output
    assert "8 decimals" in r.output and "limits what can be checked" not in r.output, r.output


@pytest.mark.parametrize("bug", ["layout", "scale", "axis"])
def test_bugs_are_caught_at_six_digits(tmp_path, bug):
    inputs = make_input(tmp_path / "in")
    heads = foreign.compute_heads(inputs, default_scale(DIMS.d_k), False, bug=bug)
    write_heads(tmp_path / "out", heads, foreign.SUBSETS["seed"], "%g")
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1, r.output
    stage, code = {"layout": ("QK", "layout"), "scale": ("QK_scaled", "scaled"),
                   "axis": ("attention_weights", "softmax_axis")}[bug]
    assert rep["first_failing_stage"] == stage
    assert code in [d["code"] for d in rep["first_failure"]["diagnosis"]]


@pytest.mark.parametrize("bug,stage,code", [("axis", "attention_weights", "softmax_axis"),
                                            ("mask-1", "QK_scaled", "mask_offset")])
def test_causal_bugs_with_fewer_queries_than_keys_are_named_first(tmp_path, bug, stage, code):
    """Causal, N < M: a softmax over columns leaves the columns no query sees 0/0 (NaN), and a
    mask shifted by -1 leaves row 0 with no visible key. The bug is named first, not the NaN it
    makes nor a region never written, and what follows only inherits it."""
    inputs = make_input(tmp_path / "in", causal=True)
    heads = foreign.compute_heads(inputs, default_scale(DIMS.d_k), True, bug=bug)
    write_heads(tmp_path / "out", heads, foreign.SUBSETS["seed"], "%g")
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == stage, r.output
    found = [d["code"] for d in rep["first_failure"]["diagnosis"]]
    assert found[0] == code and "unwritten" not in found, found
    later = [s for s in rep["stages"] if foreign.SUBSETS["seed"].index(s["stage"]) > foreign.SUBSETS["seed"].index(stage)]
    assert later and {s["status"] for s in later} == {"INHERITED"}, later


@pytest.mark.parametrize("causal", [False, True])
def test_a_softmax_along_the_wrong_axis_is_named_from_the_output_alone(tmp_path, causal):
    """A program that writes only its output (%g text, no run.toml) from weights normalized over
    the queries: the output names the softmax's axis (N < M: under causal, columns no query sees
    are 0/0 in the weights, NaN in every output row)."""
    inputs = make_input(tmp_path / "in", causal=causal)
    heads = foreign.compute_heads(inputs, default_scale(DIMS.d_k), causal, bug="axis")
    if causal:  # (a program that guards its empty columns: 0, not NaN)
        heads = [{**h, "output": np.nan_to_num(h["attention_weights"]) @ x["V"]} for h, x in zip(heads, inputs)]
    write_heads(tmp_path / "out", heads, ("output",), "%g")
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "output", r.output
    for entry in rep["results"]:
        assert entry["diagnosis"][0]["code"] == "softmax_axis", entry["diagnosis"]
    assert "softmax along the wrong axis" in r.output, r.output


def test_nan_weights_in_a_row_the_case_empties_are_the_weights_own_failure(tmp_path):
    """Bottom-right, N > M: the first N - M rows see no key, and the contract asks weights 0 there.
    An unguarded softmax writes 0/0 = NaN: the weights fail on their own (the NaN passed on is
    inherited only where a wrong mask upstream emptied a row the case's mask shows keys, above)."""
    dims = Dims(1, 2, 40, 24, 16, 16)
    inputs = make_input(tmp_path / "in", dims)
    hide = hidden(Variant(causal=True, align="bottom-right"), dims.seq_q, dims.seq_k)
    heads = []
    for x in inputs:
        s = np.where(hide, f32(-np.inf), (x["Q"] @ x["K"].T) * f32(default_scale(dims.d_k))).astype(f32)
        with np.errstate(invalid="ignore"):
            e = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append({"QK_scaled": s, "attention_weights": e / e.sum(axis=1, keepdims=True)})
    write_heads(tmp_path / "out", heads, ("QK_scaled", "attention_weights"))
    r, rep = check(tmp_path / "in", tmp_path / "out", "--causal", "bottom-right", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "attention_weights", r.output
    assert "nonfinite" in [d["code"] for d in rep["first_failure"]["diagnosis"]], r.output


# ---- subsets, stacked .npy, name maps ------------------------------------------------------------

def test_only_output_without_run_toml(tmp_path):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), ["output"])
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert [s["stage"] for s in rep["stages"]] == ["output"] and "no run.toml" in r.output


def test_a_missing_head_file_is_named_with_its_folder(tmp_path):
    """A program that wrote head 0's output but not head 1's: the report names the file where the
    user looks for it, in the output folder."""
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs)[:1], ["output"])
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    missing = [x for x in rep["results"] if x["status"] == "MISSING"]
    path = tmp_path / "out" / stage_file("output", 1, "txt")
    assert r.exit_code == 1 and [x["head"] for x in missing] == [1], r.output
    assert f"{path} is missing (the other output files exist)" in r.output, r.output


def test_a_missing_file_adds_no_resolution_of_its_own(tmp_path):
    """The resolution reported is the files' that were read: a missing one is not "exact"."""
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs)[:1], ["output"], fmt="%g")
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["stages"][0]["resolution"] == "6 significant digits", r.output
    assert "exact" not in r.output, r.output


@pytest.mark.parametrize("text", ["", "# written by my program\n"])
def test_a_run_toml_without_keys_is_named_as_such(tmp_path, text):
    """An empty (or comments-only) run.toml says nothing, as no run.toml says nothing, but the note
    names what is there, not a file that is absent."""
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), ["output"])
    (tmp_path / "out" / "run.toml").write_text(text)
    r, _ = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 0 and "note: run.toml without keys: shapes from the input case" in r.output, r.output
    assert "no run.toml" not in r.output


def test_a_stage_checks_without_its_upstream_files(tmp_path):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), foreign.SUBSETS["seed"])
    r, _ = check(tmp_path / "in", tmp_path / "out", "--stage", "QK_scaled")
    assert r.exit_code == 0, r.output
    for i in range(DIMS.total_heads):
        (tmp_path / "out" / stage_file("QK", i, "txt")).unlink()
    r, _ = check(tmp_path / "in", tmp_path / "out")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("layout", ["flat", "4d"])
def test_flash_stages_in_one_npy_each(tmp_path, layout):
    dims = Dims(2, 2, 24, 40, 16, 16)
    inputs = make_input(tmp_path / "in", dims)
    heads = foreign.compute_heads(inputs, default_scale(16), False)
    out = tmp_path / "out"
    out.mkdir()
    for s in ("flash_output", "flash_lse"):
        arr = np.stack([h[s] for h in heads]).astype(f32)
        if s == "flash_lse":
            arr = arr[..., 0]  # PyTorch's lse is (B, H, N)
        np.save(out / f"{s}.npy", arr.reshape(2, 2, *arr.shape[1:]) if layout == "4d" else arr)
    r, rep = check(tmp_path / "in", out, json_path=tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert [s["stage"] for s in rep["stages"]] == ["flash_output", "flash_lse"]
    wrong = np.load(out / "flash_output.npy")
    wrong[..., 0] *= 2
    np.save(out / "flash_output.npy", wrong)
    r, rep = check(tmp_path / "in", out, json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "flash_output"


def test_a_name_map_and_half_precision(tmp_path):
    inputs = make_input(tmp_path / "in")
    heads = correct_heads(inputs)
    out = tmp_path / "out"
    out.mkdir()
    for i, h in enumerate(heads):
        np.savetxt(out / f"O_{i}.txt", h["output"].astype(np.float64), fmt="%.9g")
        np.save(out / f"P{i}.npy", h["attention_weights"].astype(np.float16))
    names = tmp_path / "names.toml"
    names.write_text('attention_weights = "P{i}.npy"\n')
    r, rep = check(tmp_path / "in", out, "--name", "output=O_{i}.txt", "--names", names, json_path=tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert {s["stage"]: s["resolution"] for s in rep["stages"]} == {"attention_weights": "float16",
                                                                     "output": "exact"}
    bad = invoke("check", "--in", tmp_path / "in", "--out", out, "--name", "outptu=O_{i}.txt")
    assert bad.exit_code == 2 and "unknown stage 'outptu'" in bad.output


def test_a_name_map_entry_that_names_no_file_is_a_stage_not_written(tmp_path):
    """One names file serves runs that write different stages; a pattern that matches nothing is
    said in a note (a typo shows there), and is an error only where nothing else would be checked."""
    inputs = make_input(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    for i, h in enumerate(correct_heads(inputs)):
        np.savetxt(out / f"O_{i}.txt", h["output"].astype(np.float64), fmt="%.9g")
    names = tmp_path / "names.toml"
    names.write_text('output = "O_{i}.txt"\nflash_output = "FO_{i}.txt"\n')
    r, rep = check(tmp_path / "in", out, "--names", names, json_path=tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert [s["stage"] for s in rep["stages"]] == ["output"]
    assert f"note: the name map's flash_output=FO_{{i}}.txt: no file in {out} matches it: not checked" in r.output
    write_heads(tmp_path / "own", correct_heads(inputs), ["output"])
    own = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "own", "--name", "output=Out_{i}.txt")
    assert own.exit_code == 2 and "but output's own files are there" in own.output, own.output
    typo = invoke("check", "--in", tmp_path / "in", "--out", out, "--name", "output=Out_{i}.txt")
    assert typo.exit_code == 2 and typo.output.strip().splitlines()[-1].startswith(
        f"Error: {out}: no file matches the name map's output=Out_{{i}}.txt; nothing would be checked")
    assert "named alike" not in typo.output
    case = invoke("check", "--in", tmp_path / "in", "--out", out, "--name", "output=o_{i}.txt")  # (the files: O_0.txt)
    assert case.exit_code == 2 and case.output.strip().endswith(
        "named alike but for case: O_0.txt, O_1.txt (names are case-sensitive)"), case.output


def test_files_for_heads_the_case_does_not_have_are_noted(tmp_path):
    inputs = make_input(tmp_path / "in")
    out = tmp_path / "out"
    write_heads(out, correct_heads(inputs), ["output"])
    (out / "output_head_2.txt").write_text((out / "output_head_1.txt").read_text())  # a third head
    r, _ = check(tmp_path / "in", out)
    assert r.exit_code == 0, r.output
    assert ("note: 1 stage file for heads the input case does not have (2 query heads) ignored, e.g. "
            "output_head_2.txt: is --in the case the program ran on?") in r.output


@pytest.mark.parametrize("axis,amplitude", [(1, 1.0), (0, 1.0), (1, 6.0)],
                         ids=["softmax-right", "softmax-over-columns", "logits-in-the-tens"])
def test_a_stage_whose_source_is_not_written_is_judged_from_the_stage_the_program_wrote(tmp_path, axis, amplitude):
    """A program writing QK (one row wrong), its weights and output, but not QK_scaled: the weights'
    isolated reference starts from the program's own QK scaled (and allows the rounding of that
    scaling, which the program did in float32, by a float32 scale: 1/√24 is not exact), not from the
    reference's, so they only inherit QK's error; a softmax wrong on its own (over the columns) still
    fails there, named."""
    dims = Dims(1, 2, 24, 40, 24, 16)
    inputs = make_input(tmp_path / "in", dims)
    heads = []
    for x in inputs:
        qk = ((x["Q"] * f32(amplitude)) @ (x["K"] * f32(amplitude)).T).astype(f32)
        qk[5] *= f32(1.5)
        s = (qk * f32(default_scale(dims.d_k))).astype(f32)
        e = np.exp(s - s.max(axis=axis, keepdims=True))
        p = (e / e.sum(axis=axis, keepdims=True)).astype(f32)
        heads.append({"QK": qk, "attention_weights": p, "output": (p @ x["V"]).astype(f32)})
    write_heads(tmp_path / "out", heads, ("QK", "attention_weights", "output"))
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "QK", r.output
    status = {s["stage"]: s["status"] for s in rep["stages"]}
    assert status == {"QK": "FAIL", "attention_weights": "INHERITED" if axis == 1 else "FAIL",
                      "output": "INHERITED"}, r.output
    if axis == 0:
        weights = [x for x in rep["results"] if x["stage"] == "attention_weights"]
        assert {x["diagnosis"][0]["code"] for x in weights} == {"softmax_axis"}, r.output


@pytest.mark.parametrize("bug, code", [("scale", "scaled"), ("keys", "keys_past_end")])
def test_the_weights_name_a_bug_of_their_scores_where_no_scores_are_written(tmp_path, bug, code):
    """A program writing its weights and output but not its scores: the first failing stage, the
    weights, is recomputed from the inputs (with the scale missing; with the next head's first
    keys entering the last key tile's softmax) and named, as the output alone would be."""
    dims = Dims(1, 2, 24, 40, 16, 16)
    inputs = make_input(tmp_path / "in", dims)
    out = tmp_path / "out"
    out.mkdir()
    for i, x in enumerate(inputs):
        k, v = x["K"], x["V"]
        if bug == "keys":  # a tile of 16 keys reads 8 past the end: the next head's first (zeros after the last)
            tail = inputs[i + 1] if i + 1 < len(inputs) else {"K": np.zeros_like(k), "V": np.zeros_like(v)}
            k, v = np.vstack([k, tail["K"][:8]]), np.vstack([v, tail["V"][:8]])
        s = (x["Q"] @ k.T) * f32(1.0 if bug == "scale" else default_scale(16))
        e = np.exp(s - s.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        np.save(out / f"P_{i}.npy", p[:, :40])
        np.save(out / f"O_{i}.npy", p @ v)
    r, rep = check(tmp_path / "in", out, "--name", "attention_weights=P_{i}.npy", "--name", "output=O_{i}.npy",
                   json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "attention_weights", r.output
    first = [x for x in rep["results"] if x["stage"] == "attention_weights" and x["head"] == 0][0]
    assert first["diagnosis"][0]["code"] == code, first["diagnosis"]


@pytest.mark.parametrize("causal", [False, True])
def test_exp_of_the_row_max_divided_by_column_sums_is_the_wrong_axis(tmp_path, causal):
    """A student's softmax: exp(S − max over the row) divided by the column sums. Under a causal mask
    with N < M the columns no row sees are 0/0: NaN that is the wrong axis, not an unwritten block."""
    dims = Dims(1, 2, 24, 40, 16, 16)
    inputs = make_input(tmp_path / "in", dims, causal=causal)
    out = tmp_path / "out"
    out.mkdir()
    for i, x in enumerate(inputs):
        s = (x["Q"] @ x["K"].T) * f32(default_scale(16))
        if causal:
            s[np.triu(np.ones(s.shape, bool), 1)] = -np.inf
        e = np.exp(s - s.max(axis=1, keepdims=True))
        with np.errstate(invalid="ignore"):
            np.save(out / f"P_{i}.npy", e / e.sum(axis=0, keepdims=True))
    r, rep = check(tmp_path / "in", out, "--name", "attention_weights=P_{i}.npy", json_path=tmp_path / "r.json")
    assert r.exit_code == 1, r.output
    assert {x["diagnosis"][0]["code"] for x in rep["results"]} == {"softmax_axis"}, r.output


@pytest.mark.parametrize("stages", [["attention_weights", "output"], ["output"]])
def test_a_causal_program_checked_against_a_case_that_is_not_names_the_extra_mask(tmp_path, stages):
    """The case without a manifest (so not causal) and --causal forgotten: named, with the hint."""
    inputs = make_input(tmp_path / "in", manifest=False)
    write_heads(tmp_path / "out", correct_heads(inputs, causal=True), stages)
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1, r.output
    first = [x for x in rep["results"] if x["stage"] == stages[0]]
    assert {x["diagnosis"][0]["code"] for x in first} == {"mask_extra"}, r.output
    assert "a case without one is not causal unless checked with --causal [ALIGN]" in r.output
    assert check(tmp_path / "in", tmp_path / "out", "--causal")[0].exit_code == 0


def test_both_naming_forms_for_one_stage_is_an_error(tmp_path):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), ["output"])
    np.save(tmp_path / "out" / "output.npy", np.zeros((2, 24, 16), f32))
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "both" in r.output and "Traceback" not in r.output


# ---- what the run is checked against -------------------------------------------------------------

def test_causal_from_the_command_line_without_a_manifest(tmp_path):
    inputs = make_input(tmp_path / "in", manifest=False)
    write_heads(tmp_path / "out", correct_heads(inputs, causal=True), foreign.SUBSETS["seed"], "%g")
    assert check(tmp_path / "in", tmp_path / "out", "--causal")[0].exit_code == 0
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "QK_scaled"


def test_a_tf32_run_of_the_cpu_backend_is_checked_under_tf32_and_says_so(tmp_path, binary):
    """The CPU backend emulates TF32 (GEMM operands rounded): its run is checked, not refused, and
    the verdict line names the precision the bounds assume."""
    make_input(tmp_path / "in")
    subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu",
                    "--precision", "tf32"], check=True, capture_output=True)
    toml = tmp_path / "out" / "run.toml"
    assert 'precision = "tf32"' in toml.read_text()
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("attnstep check: run ") and "(tf32, attnstep's cpu backend" in r.output
    toml.write_text(toml.read_text().replace('precision = "tf32"', 'precision = "fp32"')
                    .replace('backend = "cpu"', 'backend = "bogus"'))
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "backend = 'bogus'" in r.output and "Traceback" not in r.output


def test_the_precision_the_bounds_assume_is_printed_and_settable(tmp_path):
    """The verdict line itself (all --quiet shows), the JSON and the JUnit report name the precision
    the bounds assume; --precision sets it; a claim no run can make is refused."""
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), ["QK"])
    r, rep = check(tmp_path / "in", tmp_path / "out", "--quiet", "--junit", tmp_path / "r.xml",
                   json_path=tmp_path / "r.json")
    assert r.output.splitlines()[-1].startswith("PASS (bounds for fp32): ") and rep["precision"] == "fp32"
    assert '<property name="precision" value="fp32" />' in (tmp_path / "r.xml").read_text()
    r, rep = check(tmp_path / "in", tmp_path / "out", "--precision", "tf32", json_path=tmp_path / "r.json")
    assert r.exit_code == 0 and "tf32" in r.output.splitlines()[0] and rep["precision"] == "tf32"
    assert r.output.splitlines()[-1].startswith("PASS (bounds for tf32): ")
    (tmp_path / "out" / "run.toml").write_text('precision = "tf32"\n')
    r, rep = check(tmp_path / "in", tmp_path / "out", "--quiet", json_path=tmp_path / "r.json")
    assert r.output.splitlines()[-1].startswith("PASS (bounds for tf32): ") and rep["precision"] == "tf32"
    r, _ = check(tmp_path / "in", tmp_path / "out", "--quiet", "--precision", "fp32")
    assert r.output.splitlines()[-1].startswith("PASS (bounds for fp32): ")
    write_heads(tmp_path / "out", [{"QK": h["QK"] * 1.001} for h in correct_heads(inputs)], ["QK"])
    r, _ = check(tmp_path / "in", tmp_path / "out", "--quiet", "--precision", "fp32")
    assert r.exit_code == 1 and r.output.splitlines()[-1].startswith("FAIL (bounds for fp32): first failing stage: QK")
    for claim in ('precision = "fp8"', 'backend = "gpu"'):
        (tmp_path / "out" / "run.toml").write_text(claim + "\n")
        r, _ = check(tmp_path / "in", tmp_path / "out")
        assert r.exit_code == 2 and claim.split()[0] in r.output and len(r.output.strip().splitlines()) == 1, r.output


# ---- tiny magnitudes: a bug at any representable magnitude fails ----------------------------------

def _tiny_problem(factor=1e-18):
    rng = np.random.default_rng(5)
    q = (rng.random((2, 16, 16)) * factor).astype(f32)
    k = (rng.random((2, 20, 16)) * factor).astype(f32)
    v = rng.random((2, 20, 16)).astype(f32)
    return q, k, v, np.stack([foreign.mm_blas(q[h], k[h].T) for h in range(2)])


@pytest.mark.parametrize("bug", ["zeros", "negated", "column-major", "shuffled"])
def test_bugs_in_tiny_scores_fail(bug):
    q, k, v, qk = _tiny_problem()
    assert attnstep.check_arrays(q, k, v, {"QK": qk}).passed
    wrong = {"zeros": np.zeros_like(qk), "negated": -qk,
             "column-major": np.stack([foreign.mm_blas(q[h], k[h].reshape(16, 20)) for h in range(2)]),
             "shuffled": np.random.default_rng(0).permutation(qk.ravel()).reshape(qk.shape)}[bug]
    report = attnstep.check_arrays(q, k, v, {"QK": wrong})
    assert not report.passed and report.first_failing_stage == "QK"


# ---- fast-math intrinsics -----------------------------------------------------------------------

def _fast_exp(x: np.ndarray, rng) -> np.ndarray:
    """exp with an error near what the CUDA C++ Programming Guide allows __expf: 2 + 1.173|x| ulp."""
    e = np.exp(x.astype(np.float64))
    ulps = 0.9 * (2 + 1.173 * np.abs(x)) * rng.choice([-1.0, 1.0], size=x.shape)
    return (e * (1 + ulps * 2.0**-23)).astype(f32)


def test_fast_math_softmax_needs_the_fast_profile():
    """A softmax through __expf-like exp (errors growing with |x|) is outside the IEEE bound of the
    stage computed from its own QK_scaled, and inside the fast-math one."""
    from verify.check import tolerance
    from verify.check.reference import softmax_rows
    rng = np.random.default_rng(2)
    s = (rng.normal(0, 6, (64, 96))).astype(f32)
    e = _fast_exp(s - s.max(axis=1, keepdims=True), rng)
    p = (e / e.sum(axis=1, keepdims=True)).astype(f32).astype(np.float64)
    src = {"QK_scaled": s.astype(np.float64)}
    want = softmax_rows(src["QK_scaled"])
    err = np.abs(p - want)
    kw = dict(scale=1.0, causal=False, backend=None)
    ieee = tolerance.stage_bound("attention_weights", src, want, **kw)
    fast = tolerance.stage_bound("attention_weights", src, want, math="fast", **kw)
    assert (err > ieee).any() and (err <= fast).all()


# ---- run --binary PROGRAM -- ARGS ---------------------------------------------------------------

def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_program_that_writes_nothing_fails_the_run(tmp_path, binary):
    make_input(tmp_path / "in")
    fake = _script(tmp_path / "fake.sh", "exit 0\n")
    ok = invoke("run", "--in", tmp_path / "in", "--out", tmp_path / "out", "--backend", "cpu", "--binary", binary)
    assert ok.exit_code == 0, ok.output
    r = invoke("run", "--in", tmp_path / "in", "--out", tmp_path / "out", "--binary", fake)
    assert r.exit_code == 1 and "wrote no stage file" in r.output
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 2, r.output  # the earlier run's files were moved aside, never re-checked
    assert (tmp_path / "out" / ".attnstep-previous" / "run.toml").exists()
    r = invoke("run", "--binary", fake, "--out", tmp_path / "out", "--", "anything")
    assert r.exit_code == 1 and "wrote no stage file" in r.output
    r = invoke("demo", "--data-dir", tmp_path / "demo", "--binary", fake)
    assert r.exit_code == 1 and "wrote no stage file" in r.output


def test_program_arguments_need_a_binary(tmp_path):
    r = invoke("run", "--", "random_test")
    assert r.exit_code == 2 and "--binary" in r.output


# ---- the Python API -----------------------------------------------------------------------------

def test_the_python_api_reports_like_check():
    rng = np.random.default_rng(4)
    q, k, v = (rng.random((2, 3, n, 16)).astype(f32) for n in (20, 30, 30))
    heads = [foreign.compute_head(q.reshape(6, 20, 16)[i], k.reshape(6, 30, 16)[i], v.reshape(6, 30, 16)[i],
                                  0.25, True) for i in range(6)]
    stages = {s: np.stack([h[s] for h in heads]).reshape(2, 3, *heads[0][s].shape)
              for s in ("QK_scaled", "attention_weights", "output", "flash_output", "flash_lse")}
    report = attnstep.check_arrays(q, k, v, stages, causal=True)
    assert report.passed and report.stages == list(stages)
    stages["output"] = stages["output"].copy()
    stages["output"][1, 2, 3, 4] += 0.01
    with pytest.raises(AssertionError) as err:
        attnstep.assert_attention_stages(q, k, v, stages, causal=True)
    text = str(err.value)
    assert "output" in text and "FAIL" in text and "b1 h2 [3,4]" in text
    with pytest.raises(ValueError, match="expected 6 head"):
        attnstep.check_arrays(q, k, v, {"output": stages["output"][0]}, causal=True)
    with pytest.raises(ValueError, match="unknown stage"):
        attnstep.check_arrays(q, k, v, {"outptu": stages["output"]})


def test_the_flash_kernel_named_in_run_toml_must_be_one_the_verifier_knows(tmp_path, binary):
    make_input(tmp_path / "in")
    subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu"],
                   check=True, capture_output=True)
    toml = tmp_path / "out" / "run.toml"
    good = toml.read_text()
    assert 'flash_kernel = "cpu-tiled"' in good
    for claim, words in (('"cuda-bogus"', "expected one of"), ('"cuda-wgmma-3xtf32-split4"', "cpu backend has no")):
        toml.write_text(good.replace('"cpu-tiled"', claim))
        r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    toml.write_text(good.replace('backend = "cpu"', 'backend = "cuda"').replace('"cpu-tiled"', '"cuda-fast-3xtf32-split2"'))
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output  # a looser, known kernel's model: still no false alarm


@pytest.mark.parametrize("scale", ["nan", "inf", "0"])
def test_a_scale_that_cannot_be_used_is_refused_before_checking(tmp_path, scale):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", correct_heads(inputs), ["QK_scaled"])
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--scale", scale)
    assert r.exit_code == 2 and "--scale" in r.output and "attnstep check:" not in r.output, r.output


def test_run_refuses_to_write_into_the_input_case(tmp_path, binary):
    """Its Q/K/V files would be moved aside as an earlier run's echoes: refused, nothing moved."""
    make_input(tmp_path / "in")
    before = sorted(p.name for p in (tmp_path / "in").iterdir())
    r = invoke("run", "--in", tmp_path / "in", "--out", tmp_path / "in", "--binary", binary, "--backend", "cpu")
    assert r.exit_code == 2 and "input case" in r.output, r.output
    fake = _script(tmp_path / "fake.sh", "exit 0\n")
    r = invoke("run", "--binary", fake, "--out", tmp_path / "in", "--", "x")
    assert r.exit_code == 2 and "input case" in r.output, r.output
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == before


def test_review_findings_on_reading_foreign_files(tmp_path):
    """%.8f with values over 1 is not exact; float16 zeros and printed powers of ten get their
    resolution; (b, h, r, c) arrays of a manifest-less case; a listed stage in one .npy."""
    assert text_resolution(b"-1.64740086 0.00376000\n").kind == "decimals"
    from verify.files.resolution import HALF
    assert HALF.quantum(np.zeros(1))[0] == 2.0**-25
    q = Resolution("digits", 3).quantum(np.array([float(np.float32(0.01))]))[0]
    assert q >= 0.5e-4 * 0.999
    dims = Dims(2, 2, 16, 24, 16, 16)
    inputs = make_input(tmp_path / "in", dims, manifest=False)  # read back as B = 1, H = 4
    heads = foreign.compute_heads(inputs, default_scale(16), False)
    out = tmp_path / "out"
    out.mkdir()
    np.save(out / "output.npy", np.stack([h["output"] for h in heads]).reshape(2, 2, 16, 16))
    assert check(tmp_path / "in", out)[0].exit_code == 0
    (out / "run.toml").write_text('stages = "output"\nformat = "npy"\n')
    r, _ = check(tmp_path / "in", out)
    assert r.exit_code == 0 and "run None" not in r.output, r.output


@pytest.mark.parametrize("pattern,words", [("O_{i[0]}.txt", "only placeholders"), ("O_{i:03d}.txt", "only placeholders"),
                                           ("O_{h}.txt", "several heads"),
                                           ("O_{j}.txt", "for a stage of the K/V heads, {j}")])
def test_name_maps_take_plain_head_fields_that_tell_heads_apart(tmp_path, pattern, words):
    dims = Dims(2, 2, 8, 8, 16, 16)
    make_input(tmp_path / "in", dims)
    (tmp_path / "out").mkdir()
    item = pattern if "=" in pattern else f"output={pattern}"
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--name", item)
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output


def test_a_k_v_stage_s_files_may_be_named_by_their_k_v_head_j(binary, tmp_path):
    """K_{j}: the contract's name for K/V head j, which a K/V stage's {i} counts."""
    r = invoke("generate", "--out", tmp_path / "in", "--heads", 4, "--kv-heads", 2, "--seq-q", 8, "--seq-k", 8,
               "--d-k", 16, "--d-v", 16)
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    assert subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(run), "--backend", "cpu",
                           "--stages", "K,output"], capture_output=True).returncode == 0
    out = tmp_path / "out"
    out.mkdir()
    for j in range(2):
        (out / f"key_{j}.txt").write_bytes((run / f"K_head_{j}.txt").read_bytes())
    for i in range(4):
        (out / f"O{i}.txt").write_bytes((run / f"output_head_{i}.txt").read_bytes())
    r = invoke("check", "--in", tmp_path / "in", "--out", out, "--name", "K=key_{j}.txt", "--name", "output=O{i}.txt")
    assert r.exit_code == 0 and any(line.split()[:2] == ["K", "2/2"] for line in r.output.splitlines()), r.output


def test_one_wrong_element_of_a_stage_given_alone_is_counted_once():
    """With no upstream stage of the program's, the isolated bound would take the references it is
    computed from as exact, and count correct elements outside: the chained comparison applies."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(f32) for shape in ((33, 64), (47, 64), (47, 64)))
    o = foreign.compute_heads([{"Q": q, "K": k, "V": v}], default_scale(64), False)[0]["output"].astype(np.float64)
    o[20, 7] += 0.5
    for precision, stored in (("fp32", o), ("bf16", round_to_format(o, "bf16"))):
        report = attnstep.check_arrays(q, k, v, {"output": stored}, precision=precision)
        main = report.results[0].main
        assert (main.mismatched, main.worst) == (1, (20, 7)), precision


def test_the_python_api_refuses_nonfinite_inputs_unless_allowed():
    q = np.ones((4, 16), f32)
    q[1, 2] = np.nan
    k = v = np.ones((5, 16), f32)
    with pytest.raises(ValueError, match="q holds NaN"):
        attnstep.check_arrays(q, k, v, {"output": np.ones((4, 16), f32)})
    report = attnstep.check_arrays(q, k, v, {"output": np.where(np.arange(4)[:, None] == 1, np.nan, np.ones((4, 16)))},
                                   allow_nonfinite=True)
    assert report.passed


def test_run_knows_a_programs_own_file_names(tmp_path):
    """With the name map check uses, run moves the program's earlier files aside and requires new ones."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "O_0.txt").write_text("old\n")
    writes = _script(tmp_path / "p.sh", f'echo 1 > "{out}/O_0.txt"\n')
    r = invoke("run", "--binary", writes, "--out", out, "--name", "output=O_{i}.txt", "--", "x")
    assert r.exit_code == 0 and "(output)" in r.output, r.output
    assert (out / ".attnstep-previous" / "O_0.txt").read_text() == "old\n"
    silent = _script(tmp_path / "q.sh", "exit 0\n")
    r = invoke("run", "--binary", silent, "--out", out, "--name", "output=O_{i}.txt", "--", "x")
    assert r.exit_code == 1 and "wrote no stage file" in r.output
    assert not (out / "O_0.txt").exists()  # the earlier file went aside: check cannot judge it


def test_files_of_attnstep_s_binary_are_exact_whatever_they_look_like(tmp_path, binary):
    """A file whose CRC-32 run.toml lists was written by attnstep's binary (%.9g): compared bit for
    bit, even if its numbers happen to look like coarser printing."""
    import zlib
    make_input(tmp_path / "in")
    subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu"],
                   check=True, capture_output=True)
    q = tmp_path / "out" / stage_file("Q", 0, "txt")
    header = q.read_text().splitlines()[0]
    body = "\n".join(" ".join(f"{x:.6f}" for x in row) for row in np.loadtxt(q, ndmin=2))
    data = (header + "\n" + body + "\n").encode()
    q.write_bytes(data)
    toml = tmp_path / "out" / "run.toml"
    toml.write_text("\n".join(f'crc32_Q_head_0 = "{zlib.crc32(data):08x}"' if ln.startswith("crc32_Q_head_0 ")
                              else ln for ln in toml.read_text().splitlines()) + "\n")
    r, rep = check(tmp_path / "in", tmp_path / "out", json_path=tmp_path / "r.json")
    assert r.exit_code == 1 and rep["first_failing_stage"] == "Q", r.output


def test_the_no_run_toml_note_says_the_precision_values_are_stored_in(tmp_path):
    inputs = make_input(tmp_path / "in")
    write_heads(tmp_path / "out", [{k: round_to_format(v, "bf16") for k, v in h.items()}
                                   for h in correct_heads(inputs)], ["output"])
    r, _ = check(tmp_path / "in", tmp_path / "out", "--precision", "bf16")
    assert r.exit_code == 0 and "any correct IEEE float32 arithmetic accepted (values stored in bf16)" in r.output


@pytest.mark.parametrize("stages", [("attention_weights", "output"), ("output",)])
def test_the_case_s_own_scale_ignored_for_the_default_is_named(stages):
    """A program that uses 1/√d_k where the case says 0.37: named where it begins, the stage
    recomputed at the scale it used."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((17, 24), (29, 24), (29, 24)))
    wrong = reference_chain({"Q": q, "K": k, "V": v}, 24 ** -0.5, False, ("attention_weights", "output"))
    report = attnstep.check_arrays(q, k, v, {s: wrong[s].astype(np.float32) for s in stages}, scale=0.37)
    assert not report and report.first_failing_stage == stages[0]
    first = [r.diagnosis[0] for r in report.results if not r.passed and r.stage == stages[0]]
    named = "the default 1/√d_k used, not the case's scale"
    assert first and first[0].code == "scaled" and named in first[0].message, attnstep.format_report(report)

"""Variant cases on disk: what `attnstep generate` writes for each variant option, how an input
case with grouped K/V heads, mask, bias and slopes files is read (with and without a manifest),
how a run's variant is resolved and a run.toml that disagrees is named, and every refusal (one
line, exit status 2, nothing written). No binary needed: the output folders are written here."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from helpers import foreign_routes as foreign
from helpers.cli import invoke
from helpers.variants import set_manifest, write_heads
from verify.files.case import load_input_case, read_matrix
from verify.files.kinds import CaseError
from verify.files.outputs import Mismatch, Overrides, open_run
from verify.files.stage_files import StageSource
from verify.stages import (BIAS_INPUT, DROPOUT_MASK, INPUT_MANIFEST, INPUT_NAMES, KEYS, MASK_INPUT,
                           OUTPUT, RUN_MANIFEST, SCALED_SCORES, VALUES, default_scale, stage_file)
from verify.variant import BOTTOM_RIGHT, BROADCAST, NONE, PER_HEAD, TOP_LEFT, Variant, alibi_slopes

# Irregular sizes: 2 K/V heads of 6 query heads, N != M, d not a power of two.
N, M, D = 37, 53, 24
GQA = ("--batch", 1, "--heads", 6, "--kv-heads", 2, "--seq-q", N, "--seq-k", M, "--d-k", D, "--d-v", D)
SMALL = ("--batch", 2, "--heads", 3, "--seq-q", 9, "--seq-k", 13, "--d-k", 8, "--d-v", 8)


def generate(folder: Path, *args):
    """`attnstep generate --out FOLDER ARGS`, which must succeed."""
    r = invoke("generate", "--out", folder, *args)
    assert r.exit_code == 0, r.output
    return folder


def manifest(folder: Path) -> dict:
    import tomllib
    return tomllib.loads((folder / INPUT_MANIFEST).read_text())


def one_line_error(result, *words):
    """Exit status 2, one line (no traceback) holding every word."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for w in words:
        assert w in lines[0], lines[0]


# ---- generate: the files and the manifest of each option ---------------------------------------

def test_grouped_kv_heads_are_generated_per_kv_head(tmp_path):
    case = generate(tmp_path / "c", *GQA, "--seed", 5)
    names = {p.name for p in case.iterdir()}
    assert {stage_file("Q", i, "txt") for i in range(6)} <= names
    assert {stage_file(n, j, "txt") for n in (KEYS, VALUES) for j in range(2)} <= names
    assert stage_file(KEYS, 2, "txt") not in names
    assert manifest(case)["kv_heads"] == 2
    loaded = load_input_case(case)
    assert loaded.dims.kv == 2 and loaded.dims.group_size == 3 and loaded.dims.heads_of(KEYS) == 2
    assert loaded.load(KEYS, 1).shape == (M, D)


def test_kv_heads_equal_to_heads_is_the_plain_case_and_variants_leave_qkv_alone(tmp_path):
    plain = generate(tmp_path / "plain", *SMALL, "--seed", 3)
    same = generate(tmp_path / "same", *SMALL, "--kv-heads", 3, "--seed", 3)
    masked = generate(tmp_path / "masked", *SMALL, "--seed", 3, "--mask", "random", "--bias", "random",
                      "--alibi", "--alibi-slopes", "random", "--backward")
    assert "kv_heads" not in manifest(same)
    for name in INPUT_NAMES:
        for i in range(6):
            a = (plain / stage_file(name, i, "txt")).read_bytes()
            assert a == (same / stage_file(name, i, "txt")).read_bytes()
            assert a == (masked / stage_file(name, i, "txt")).read_bytes()


@pytest.mark.parametrize("args, keys, files", [
    (("--causal",), {"causal": True}, ()),
    (("--causal", "bottom-right"), {"causal": True, "align": BOTTOM_RIGHT}, ()),
    (("--align", "bottom-right"), {"causal": False, "align": BOTTOM_RIGHT}, ()),
    (("--causal", "--align", "bottom-right"), {"causal": True, "align": BOTTOM_RIGHT}, ()),
    (("--window", "4,0"), {"window_left": 4, "window_right": 0}, ()),
    (("--causal", "--window", "4,-1"), {"causal": True, "window_left": 4, "window_right": -1}, ()),
    (("--softcap", "30"), {"softcap": 30.0}, ()),
    (("--alibi",), {"alibi": True}, ()),
    (("--alibi", "--alibi-slopes", "random"), {"alibi": True}, ("alibi_slopes.txt",)),
    (("--mask", "document"), {"mask": BROADCAST}, ("mask.txt",)),
    (("--mask", "random", "--mask-heads", "per-head"), {"mask": PER_HEAD}, ("mask_head_0.txt", "mask_head_5.txt")),
    (("--bias", "random"), {"bias": BROADCAST}, ("bias.txt",)),
    (("--bias", "random", "--bias-heads", "per-head"), {"bias": PER_HEAD}, ("bias_head_5.txt",)),
    (("--dropout", "0.25", "--dropout-seed", "7"), {"dropout": 0.25, "dropout_seed": 7}, ()),
    (("--kv-heads", "1"), {"kv_heads": 1}, ()),
], ids=lambda x: " ".join(x) if isinstance(x, tuple) and x and isinstance(x[0], str) and x[0].startswith("--")
   else None)
def test_each_option_is_recorded_in_the_manifest_and_read_back(tmp_path, args, keys, files):
    case = generate(tmp_path / "c", *SMALL, *args)
    written = manifest(case)
    for key, value in keys.items():
        assert written[key] == value, (key, written)
    for name in files:
        assert (case / name).is_file(), name
    loaded = load_input_case(case)
    v = loaded.variant
    assert loaded.causal == v.causal == written["causal"]
    assert v.align == written.get("align", TOP_LEFT)
    assert v.window == (written.get("window_left", -1), written.get("window_right", -1))
    assert (v.softcap, v.alibi, v.dropout) == (written.get("softcap", 0.0), written.get("alibi", False),
                                               written.get("dropout", 0.0))
    assert (v.mask, v.bias) == (written.get("mask", NONE), written.get("bias", NONE))


def test_the_random_slopes_file_holds_a_slope_per_head_of_each_batch_element(tmp_path):
    case = load_input_case(generate(tmp_path / "c", *SMALL, "--alibi", "--alibi-slopes", "random", "--format", "npy"))
    slopes = read_matrix(tmp_path / "c" / "alibi_slopes.npy")
    assert slopes.shape == (2, 3) and (slopes > 0).all() and (slopes <= 1).all()
    assert case.alibi_slope(4) == pytest.approx(float(slopes[1, 1]))
    standard = load_input_case(generate(tmp_path / "s", *SMALL, "--alibi"))
    assert standard.alibi_slope(4) == alibi_slopes(3)[1]


def _masks(folder: Path, heads: int, name: str = MASK_INPUT):
    case = load_input_case(folder)
    return case, [case.variant_input(name, i) for i in range(heads)]


def test_document_masks_are_block_diagonal_on_the_case_alignment(tmp_path):
    for align in (TOP_LEFT, BOTTOM_RIGHT):
        case, masks = _masks(generate(tmp_path / align, *GQA, "--mask", "document", "--mask-heads", "per-head",
                                      "--causal", align, "--seed", 2), 6)
        offset = case.variant.offset(N, M)
        for mask in masks:
            for i in range(N):
                seen = np.flatnonzero(mask[i])
                assert seen.size and (np.diff(seen) == 1).all()  # one document: contiguous keys
                assert seen[0] <= min(i + offset, M - 1) <= seen[-1]  # ... the row's own
        assert any(not np.array_equal(masks[0], m) for m in masks[1:])  # per head: drawn apart


def test_prefix_lm_masks_are_a_prefix_then_causal(tmp_path):
    case, masks = _masks(generate(tmp_path / "c", *GQA, "--mask", "prefix-lm", "--align", "bottom-right"), 6)
    assert case.variant.mask == BROADCAST and all(m is masks[0] for m in masks)
    j, diag = np.arange(M)[None, :], (np.arange(N) + M - N)[:, None]
    assert any(np.array_equal(masks[0] != 0, (j < p) | (j <= diag)) for p in range(1, M + 1))


def test_random_masks_keep_about_four_in_five_and_a_key_in_every_row(tmp_path):
    case, masks = _masks(generate(tmp_path / "c", *GQA, "--mask", "random", "--mask-heads", "per-head",
                                  "--causal", "--window", "2,0"), 6)
    visible = case.variant.visible(N, M)
    for mask in masks:
        assert ((mask != 0) & visible).any(axis=1).all()  # no row left without a key by chance
    share = np.mean([m.mean() for m in masks])
    assert 0.72 < share < 0.88
    _, empty = _masks(generate(tmp_path / "e", *GQA, "--mask", "random", "--mask-empty-rows"), 1)
    assert (~empty[0].any(axis=1)).any()


def test_random_biases_hold_no_nan_or_plus_inf_and_hide_no_row(tmp_path):
    _, biases = _masks(generate(tmp_path / "c", *GQA, "--bias", "random", "--bias-heads", "per-head"), 6, BIAS_INPUT)
    for bias in biases:
        assert not np.isnan(bias).any() and not (bias == np.inf).any()
        assert np.isfinite(bias).any(axis=1).all()


def test_a_case_generated_again_without_a_mask_loses_its_mask_files(tmp_path):
    case = generate(tmp_path / "c", *SMALL, "--mask", "random", "--mask-heads", "per-head", "--alibi",
                    "--alibi-slopes", "random")
    generate(case, *SMALL)
    assert not list(case.glob("mask*")) and not list(case.glob("alibi*"))
    assert load_input_case(case).variant == Variant()


@pytest.mark.parametrize("args, words", [
    (("--kv-heads", "2"), "--kv-heads 2 does not divide --heads 3"),
    (("--kv-heads", "4"), "--kv-heads 4 does not divide --heads 3"),
    (("--causal", "--window", "3,2"), "window_right = 2: a causal mask sees no key right of the diagonal"),
    (("--causal", "top-left", "--align", "bottom-right"), "--causal top-left with --align bottom-right"),
    (("--causal", "--no-causal"), "--causal and --no-causal: choose one"),
    (("--mask", "prefix-lm", "--causal"), "a prefix-LM mask is causal after its prefix by itself"),
    (("--mask-heads", "per-head"), "--mask-heads needs --mask"),
    (("--bias-heads", "broadcast"), "--bias-heads needs --bias"),
    (("--mask", "document", "--mask-empty-rows"), "--mask-empty-rows needs --mask random"),
    (("--mask-empty-rows",), "--mask-empty-rows needs --mask random"),
    (("--alibi-slopes", "random"), "--alibi-slopes random needs --alibi"),
    (("--dropout-seed", "3"), "--dropout-seed needs --dropout"),
], ids=lambda x: " ".join(x) if isinstance(x, tuple) else None)
def test_bad_combinations_are_refused_in_one_line_before_writing(tmp_path, args, words):
    one_line_error(invoke("generate", "--out", tmp_path / "c", *SMALL, *args), words)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args, words", [
    (("--window", "3"), "expected LEFT,RIGHT"), (("--window", "-2,0"), "'-2,0': window_left = -2: must be -1 (unbounded)"),
    (("--window", "a,b"), "expected LEFT,RIGHT"), (("--softcap", "-1"), "must be a finite number > 0"),
    (("--softcap", "nan"), "must be a finite number > 0"), (("--dropout", "1"), "must be a probability in [0, 1)"),
    (("--dropout", "-0.1"), "must be a probability in [0, 1)"), (("--mask", "zigzag"), "--mask"),
    (("--causal", "middle"), "expected top-left or bottom-right"), (("--kv-heads", "0"), "--kv-heads"),
], ids=lambda x: " ".join(x) if isinstance(x, tuple) else None)
def test_bad_values_are_usage_errors_before_writing(tmp_path, args, words):
    r = invoke("generate", "--out", tmp_path / "c", *SMALL, *args)
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "c").exists()


# ---- reading a case: grouped heads, variant keys and files -------------------------------------

def test_grouped_heads_without_a_manifest_come_from_the_k_files(tmp_path):
    case = generate(tmp_path / "c", *GQA)
    (case / INPUT_MANIFEST).unlink()
    loaded = load_input_case(case)
    assert (loaded.dims.heads, loaded.dims.kv, loaded.manifest) == (6, 2, False)
    (case / stage_file(KEYS, 1, "txt")).unlink()  # a gap below the last K/V head: a missing file
    with pytest.raises(CaseError, match=r"K_head_1.txt: missing file \(2 K/V heads per batch element"):
        load_input_case(case)
    for j in (1, 2, 3):
        (case / stage_file(KEYS, j, "txt")).write_bytes((case / stage_file(KEYS, 0, "txt")).read_bytes())
        (case / stage_file(VALUES, j, "txt")).write_bytes((case / stage_file(VALUES, 0, "txt")).read_bytes())
    with pytest.raises(CaseError, match="6 query heads .* and 4 K/V heads .*: the K/V heads must divide the query"):
        load_input_case(case)


@pytest.mark.parametrize("edit, words", [
    (lambda c: (c / stage_file(KEYS, 1, "txt")).unlink(),
     "K_head_1.txt: missing file (2 K/V heads per batch element (kv_heads = 2 of 6 heads), 2 in all expected)"),
    (lambda c: (c / stage_file(VALUES, 2, "txt")).write_text("1\n"),
     "V_head_2.txt: unexpected file: the case has 2 K/V heads per batch element"),
    (lambda c: set_manifest(c, kv_heads=4), "kv_heads = 4: must be 1..heads and divide heads = 6"),
    (lambda c: set_manifest(c, kv_heads=-1), "kv_heads = -1: must be 1..heads and divide heads = 6"),
    (lambda c: set_manifest(c, kv_heads=0), "kv_heads = 0: must be 1..heads and divide heads = 6"),
], ids=["missing-k", "extra-v", "kv-not-dividing", "kv-negative", "kv-zero"])
def test_grouped_layouts_are_checked_head_by_head(tmp_path, edit, words):
    case = generate(tmp_path / "c", *GQA)
    edit(case)
    with pytest.raises(CaseError) as exc:
        load_input_case(case)
    assert words in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("line, words", [
    ('align = "middle"', ": align = 'middle': must be top-left or bottom-right"),
    ("window_left = -2", ": window_left = -2: must be -1 (unbounded)"),
    ("window_right = -5", ": window_right = -5"),
    ("softcap = -1.0", ": softcap = -1.0: must be a finite number > 0"),
    ("softcap = nan", ": softcap = nan"),
    ("softcap = 1e39", ": softcap = 1e+39: must be a finite number > 0"),
    ('mask = "some"', ": mask = 'some': must be none, per-head or broadcast"),
    ("bias = 3", "'bias' must be a quoted string"),
    ("dropout = 1.0", ": dropout = 1.0: must be a probability in [0, 1)"),
    ("dropout = 0.99999999999", ": dropout = 0.99999999999: must be a probability in [0, 1)"),
    ("dropout_seed = -1", ": dropout_seed = -1: must be an integer >= 0"),
    ("alibi = 1", "'alibi' must be true or false"),
    ("window_right = 2\ncausal = true", ": window_right = 2: a causal mask sees no key right of the diagonal (use 0 or -1) "
                                        "(causal from "),
], ids=lambda x: x.split(" =")[0] if isinstance(x, str) and "=" in x else None)
def test_a_bad_variant_key_is_one_line_naming_the_file_and_key(tmp_path, line, words):
    case = generate(tmp_path / "c", *SMALL)
    path = case / INPUT_MANIFEST
    path.write_text(path.read_text().replace("causal = false\n", "") + line + "\n")
    with pytest.raises(CaseError) as exc:
        load_input_case(case)
    assert str(path) in str(exc.value) and words in str(exc.value) and "\n" not in str(exc.value)
    r = invoke("check", "--in", case, "--out", tmp_path / "out")
    one_line_error(r, words)


@pytest.mark.parametrize("fmt", ["txt", "npy"])
@pytest.mark.parametrize("name, value, words", [
    (MASK_INPUT, 0.5, "0.5 in a mask (1 such value); HINT: a mask holds 0 (hidden) or 1 (visible) only"),
    (MASK_INPUT, np.nan, "nan in a mask"),
    (MASK_INPUT, -np.inf, "-inf in a mask"),
    (BIAS_INPUT, np.inf, "inf in a bias (1 such value); HINT: a bias holds finite values or -inf"),
    (BIAS_INPUT, np.nan, "nan in a bias"),
])
def test_mask_and_bias_files_are_read_strictly_with_file_line_and_column(tmp_path, fmt, name, value, words):
    case = generate(tmp_path / "c", *SMALL, f"--{name}", "random", "--format", fmt)
    path = case / f"{name}.{fmt}"
    values = read_matrix(path).astype(np.float32)
    values[2, 3] = value
    if fmt == "npy":
        np.save(path, values)
        where = f"{path}:row 2, col 3: "
    else:
        np.savetxt(path, values, fmt="%.9g", header="a comment line first")
        where = f"{path}:4:4: "  # the comment, then rows 1-based; values counted 1-based
    loaded = load_input_case(case)
    with pytest.raises(CaseError) as exc:
        loaded.variant_input(name, 0)
    assert str(exc.value).startswith(where) and words in str(exc.value)


def test_a_bias_may_hide_entries_with_minus_inf(tmp_path):
    case = generate(tmp_path / "c", *SMALL, "--bias", "random")
    values = read_matrix(case / "bias.txt")
    values[:, 0] = -np.inf
    np.savetxt(case / "bias.txt", values, fmt="%.9g")
    assert (load_input_case(case).variant_input(BIAS_INPUT, 5)[:, 0] == -np.inf).all()


@pytest.mark.parametrize("text, words", [
    ("0.5 0.25 inf\n", "inf in the ALiBi slopes"),
    ("0.5 0.25\n", "shape 1x2, expected 1 or 2 x 3"),
    ("0.5 0.25 0.1\n0.5 0.25 0.1\n0.5 0.25 0.1\n", "shape 3x3, expected 1 or 2 x 3"),
])
def test_the_slopes_file_is_read_when_the_case_is(tmp_path, text, words):
    case = generate(tmp_path / "c", *SMALL, "--alibi", "--alibi-slopes", "random")
    (case / "alibi_slopes.txt").write_text(text)
    with pytest.raises(CaseError, match=None) as exc:
        load_input_case(case)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_one_row_of_slopes_serves_every_batch_element(tmp_path):
    case = generate(tmp_path / "c", *SMALL, "--alibi", "--alibi-slopes", "random")
    (case / "alibi_slopes.txt").write_text("0.5 0.25 0.125\n")
    loaded = load_input_case(case)
    assert [loaded.alibi_slope(i) for i in range(6)] == [0.5, 0.25, 0.125] * 2


@pytest.mark.parametrize("args, edit, words", [
    (("--mask", "random"), lambda c: set_manifest(c, mask='"per-head"'),
     'mask_head_0.txt: missing file (manifest.toml says mask = "per-head": one file per query head)'),
    (("--mask", "random", "--mask-heads", "per-head"), lambda c: (c / "mask_head_4.txt").unlink(),
     "mask_head_4.txt: missing file"),
    (("--mask", "random", "--mask-heads", "per-head"), lambda c: set_manifest(c, mask='"none"'),
     'mask_head_0.txt: a mask per head, but '),
    (("--mask", "random"), lambda c: set_manifest(c, mask='"none"'), 'mask.txt: one mask for every head, but '),
    (("--bias", "random"), lambda c: (c / "bias.txt").unlink(), 'bias.txt: missing file ('),
    (("--bias", "random"), lambda c: (c / "bias.txt").rename(c / "bias.npy"), "bias.npy: a .npy file in a .txt case"),
    (("--alibi", "--alibi-slopes", "random"), lambda c: set_manifest(c, alibi="false"),
     "alibi_slopes.txt: exists but the run has no ALiBi (its slopes would be unused); HINT: turn ALiBi on"),
], ids=["per-head-without-files", "per-head-missing-one", "files-but-none", "broadcast-but-none",
        "broadcast-missing", "other-format", "slopes-without-alibi"])
def test_mask_bias_and_slopes_files_agree_with_the_manifest(tmp_path, args, edit, words):
    case = generate(tmp_path / "c", *SMALL, *args)
    edit(case)
    one_line_error(invoke("check", "--in", case, "--out", tmp_path / "out"), words)


def test_without_a_manifest_the_mask_and_bias_files_say_how_they_cover_the_heads(tmp_path):
    case = generate(tmp_path / "c", "--heads", 4, "--seq-q", 9, "--seq-k", 13, "--d-k", 8, "--d-v", 8,
                    "--mask", "random", "--mask-heads", "per-head", "--bias", "random")
    (case / INPUT_MANIFEST).unlink()
    loaded = load_input_case(case)
    assert (loaded.variant.mask, loaded.variant.bias, loaded.variant.causal) == (PER_HEAD, BROADCAST, False)
    (case / "mask.txt").write_bytes((case / "mask_head_0.txt").read_bytes())
    with pytest.raises(CaseError, match="both mask_head_0.txt and mask.txt"):
        load_input_case(case)


# ---- output folders: the run's variant, mismatches, K/V heads, the dropout mask ----------------

def _plain_run(tmp_path: Path, *generate_args, run_toml: str = "", causal: bool = False) -> tuple:
    """An input case and a correct output folder for it (output and QK_scaled per head, written
    here), with run.toml holding `run_toml` when given."""
    case = generate(tmp_path / "in", "--heads", 2, "--seq-q", 9, "--seq-k", 13, "--d-k", 8, "--d-v", 8,
                    *generate_args)
    inputs = foreign.read_inputs(case, 2)
    heads = foreign.compute_heads(inputs, default_scale(8), causal)
    out = write_heads(tmp_path / "out", {s: [h[s] for h in heads] for s in (SCALED_SCORES, OUTPUT)})
    if run_toml:
        (out / RUN_MANIFEST).write_text(run_toml)
    return case, out


@pytest.mark.parametrize("line, key, shown", [
    ('align = "bottom-right"', "align", "the run computed align = bottom-right (run.toml) but the input case asks "
                                        "for align = top-left; HINT: run again, or pass --align"),
    ("window_left = 3\nwindow_right = 0", "window", "the run computed window = 3,0 (run.toml) but the input case "
                                                    "asks for window = -1,-1"),
    ("softcap = 30.0", "softcap", "the run computed softcap = 30 (run.toml)"),
    ("alibi = true", "alibi", "the run computed alibi = true (run.toml) but the input case asks for alibi = false"),
    ('mask = "broadcast"', "mask", "the run computed mask = broadcast (run.toml) but the input case asks for "
                                   "mask = none; HINT: run it again on this case"),
], ids=["align", "window", "softcap", "alibi", "mask"])
def test_a_run_toml_that_disagrees_on_a_variant_key_is_a_named_mismatch(tmp_path, line, key, shown):
    case, out = _plain_run(tmp_path, run_toml=f"stages = \"{SCALED_SCORES},{OUTPUT}\"\nformat = \"txt\"\n{line}\n")
    run = open_run(out, load_input_case(case))
    assert [m.key for m in run.mismatches] == [key] and run.mismatches[0].message().startswith(shown)
    report = tmp_path / "r.json"
    r = invoke("check", "--in", case, "--out", out, "--json", report)
    assert r.exit_code == 1 and shown in r.output, r.output
    assert json.loads(report.read_text())["first_failure"]["diagnosis"][0]["code"] == f"{key}_mismatch"


def test_the_command_line_overrides_and_the_seed_never_mismatches(tmp_path):
    case, out = _plain_run(tmp_path, run_toml='align = "bottom-right"\ndropout_seed = 9\n')
    loaded = load_input_case(case)
    run = open_run(out, loaded, Overrides(variant={"align": BOTTOM_RIGHT}))
    assert run.mismatches == [] and run.variant.align == BOTTOM_RIGHT
    assert [m.key for m in open_run(out, loaded).mismatches] == ["align"]
    assert Mismatch("causal", True, False).message().startswith(
        "the run computed causal = true (run.toml) but the input case asks for causal = false")


def test_without_a_manifest_run_toml_says_the_variant_and_the_command_line_overrides_it(tmp_path):
    case, out = _plain_run(tmp_path, run_toml="window_left = 3\nwindow_right = 0\nsoftcap = 20.0\ncausal = true\n")
    (case / INPUT_MANIFEST).unlink()
    loaded = load_input_case(case)
    run = open_run(out, loaded)
    assert (run.variant.window, run.variant.softcap, run.causal, run.mismatches) == ((3, 0), 20.0, True, [])
    run = open_run(out, loaded, Overrides(causal=False, variant={"window": (5, 5), "alibi": True}))
    assert (run.variant.window, run.variant.alibi, run.causal) == ((5, 5), True, False)
    with pytest.raises(CaseError, match=r"the command line: window_right = 5: a causal mask sees no key right of the "
                                        r"diagonal \(use 0 or -1\) \(causal from \S*run.toml\)"):
        open_run(out, loaded, Overrides(variant={"window": (5, 5)}))


@pytest.mark.parametrize("args, words", [
    (("--causal", "--no-causal"), "--causal and --no-causal: choose one"),
    (("--causal", "bottom-right", "--align", "top-left"), "--causal bottom-right with --align top-left"),
    (("--causal", "--window", "0,3"), "the command line: window_right = 3: a causal mask sees no key right"),
], ids=["both", "two-alignments", "causal-window"])
def test_checks_variant_options_are_refused_in_one_line(tmp_path, args, words):
    case, out = _plain_run(tmp_path)
    one_line_error(invoke("check", "--in", case, "--out", out, *args), words)


def test_check_options_set_the_variant_checked(tmp_path):
    case, out = _plain_run(tmp_path, causal=True)
    (case / INPUT_MANIFEST).unlink()
    assert invoke("check", "--in", case, "--out", out).exit_code == 1  # not causal: the scores differ
    assert invoke("check", "--in", case, "--out", out, "--causal").exit_code == 0
    r = invoke("check", "--in", case, "--out", out, "--window", "x")
    assert r.exit_code == 2 and "expected LEFT,RIGHT" in r.output


def test_run_toml_variant_values_are_validated(tmp_path):
    case, out = _plain_run(tmp_path, run_toml="softcap = -3.0\n")
    one_line_error(invoke("check", "--in", case, "--out", out), f"{out / RUN_MANIFEST}: softcap = -3.0: must be")


def _gqa_output(tmp_path: Path, heads_written: int, **kv) -> tuple:
    case = generate(tmp_path / "in", "--heads", 6, "--kv-heads", 2, "--seq-q", 5, "--seq-k", 7, "--d-k", 4,
                    "--d-v", 4)
    loaded = load_input_case(case)
    out = write_heads(tmp_path / "out", {KEYS: [np.zeros((7, 4))] * heads_written})
    return loaded, out


def test_stages_of_kv_heads_are_read_per_kv_head(tmp_path):
    loaded, out = _gqa_output(tmp_path, 2)
    run = open_run(out, loaded)
    assert run.dims.heads_of(KEYS) == 2 and run.read(KEYS, 1)[0].shape == (7, 4)
    assert StageSource(KEYS, out, "K_{b}_{h}.txt").name(1, loaded.dims) == "K_0_1.txt"


def test_stages_of_kv_heads_written_per_query_head_name_the_grouped_layout(tmp_path):
    loaded, out = _gqa_output(tmp_path, 6)
    with pytest.raises(CaseError) as exc:
        open_run(out, loaded)
    assert "K_head_2.txt: one K file per query head, but the case has 2 K/V heads per batch element (kv_heads = 2 " \
           "of 6 heads), so K has one matrix per K/V head j = b*2 + h // 3" in str(exc.value)
    r = invoke("check", "--in", tmp_path / "in", "--out", out)
    one_line_error(r, "one K file per query head")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    np.save(stacked / "K.npy", np.zeros((6, 7, 4), np.float32))
    with pytest.raises(CaseError, match=r"shape \(6, 7, 4\), expected \(2, 7, 4\) .*: written per query head, but "
                                        r"the case has 2 K/V heads"):
        open_run(stacked, loaded).read(KEYS, 0)


def test_a_run_toml_with_other_kv_heads_is_from_another_case(tmp_path):
    loaded, out = _gqa_output(tmp_path, 2)
    (out / RUN_MANIFEST).write_text("kv_heads = 3\n")
    with pytest.raises(CaseError, match="kv_heads = 3 but the input case .* has 2 K/V heads per batch element"):
        open_run(out, loaded)
    (out / RUN_MANIFEST).write_text("kv_heads = 2\n")
    assert open_run(out, loaded).dims.kv == 2


def test_the_dropout_mask_exists_only_with_dropout(tmp_path):
    case, out = _plain_run(tmp_path)
    write_heads(out, {DROPOUT_MASK: [np.ones((9, 13))] * 2})
    loaded = load_input_case(case)
    with pytest.raises(CaseError, match=f"holds {DROPOUT_MASK} .* but the case has no dropout; HINT: check with "
                                        "--dropout P"):
        open_run(out, loaded)
    run = open_run(out, loaded, Overrides(variant={"dropout": 0.1}))
    assert DROPOUT_MASK in run.stages and run.variant.dropout == 0.1
    set_manifest(case, dropout=0.2)
    assert open_run(out, load_input_case(case)).variant.dropout == 0.2


# ---- run: the variant passed on to attnstep's binary ------------------------------------------

def test_run_passes_the_variant_options_to_the_binary(tmp_path):
    case = generate(tmp_path / "in", *SMALL)
    args = tmp_path / "args.txt"
    fake = tmp_path / "fake.sh"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args}\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    invoke("run", "--in", case, "--out", tmp_path / "out", "--binary", fake, "--causal", "--align", "bottom-right",
           "--window", "4,0", "--softcap", "30", "--alibi", "--dropout", "0.1", "--dropout-seed", "5")
    passed = args.read_text().split()
    for flags in (["--causal"], ["--align", "bottom-right"], ["--window", "4,0"], ["--softcap", "30.0"], ["--alibi"],
                  ["--dropout", "0.1"], ["--dropout-seed", "5"]):
        at = passed.index(flags[0])
        assert passed[at:at + len(flags)] == flags, passed
    r = invoke("run", "--out", tmp_path / "o2", "--binary", fake, "--window", "1,0", "--", "x")
    assert r.exit_code == 2 and "--window is an option of attnstep's binary" in r.output

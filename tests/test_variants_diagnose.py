"""The variants' classic bugs, caught at the stage where they begin and named: each planted by the
float32 NumPy program of tests/helpers/variant_programs.py on a small irregular grouped case
(N = 37, M = 53, d = 24, H = 6 query heads over Hk = 2 K/V heads), written as a user's program
writes its files (.npy, no run.toml) and checked as a user checks it. The same program without
its bug passes every variant with no diagnosis at all.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.variant_programs import BUGS, Program, write_run
from verify.diagnose.inputs import structural_hidden
from verify.files.case import load_input_case
from verify.variant import Variant, hidden

SIZES = ("--heads", 6, "--kv-heads", 2, "--seq-q", 37, "--seq-k", 53, "--d-k", 24, "--d-v", 24)
M_MINUS_N = 53 - 37

# Each case: `attnstep generate` options beside SIZES.
CASES: Dict[str, Sequence[str]] = {
    "gqa-backward": ("--causal", "bottom-right", "--backward"),
    "bottom-right": ("--causal", "bottom-right"),
    "top-left": ("--causal", "top-left"),
    "window": ("--window", "7,4", "--align", "bottom-right"),
    "window-backward": ("--window", "7,4", "--align", "bottom-right", "--backward"),
    "causal-window": ("--causal", "bottom-right", "--window", "7,-1"),
    "softcap": ("--softcap", "2", "--causal", "top-left"),
    "softcap-backward": ("--softcap", "2", "--backward"),
    "alibi": ("--alibi", "--causal", "bottom-right"),
    "alibi-slopes-file": ("--alibi", "--alibi-slopes", "random"),
    "alibi-top-left": ("--alibi", "--causal", "top-left"),
    "mask": ("--mask", "random", "--mask-heads", "per-head", "--causal", "bottom-right"),
    "bias": ("--bias", "random", "--bias-heads", "per-head"),
    "dropout-backward": ("--dropout", "0.2", "--causal", "bottom-right", "--backward"),
    "everything-backward": ("--causal", "bottom-right", "--window", "9,-1", "--softcap", "3", "--alibi",
                            "--alibi-slopes", "random", "--mask", "random", "--bias", "random",
                            "--dropout", "0.1", "--backward"),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Dict[str, Path]:
    """Every case's input folder, generated when first asked for."""
    root = tmp_path_factory.mktemp("variant-cases")

    class Cases(dict):
        def __missing__(self, name):
            folder = root / name
            r = invoke("generate", "--out", folder, *SIZES, "--dist", "normal", "--seed", 5, "--format", "npy",
                       *CASES[name])
            assert r.exit_code == 0, r.output
            self[name] = folder
            return folder
    return Cases()


def _check(tmp: Path, in_dir: Path, program: Program, only: Optional[Sequence[str]] = None):
    write_run(tmp / "out", load_input_case(in_dir), program, only)
    report = tmp / "r.json"
    result = invoke("check", "--in", in_dir, "--out", tmp / "out", "--json", report)
    return result, json.loads(report.read_text())


def _named(report: dict, stage: str, code: str, heads: Optional[Sequence[int]] = None):
    """The first failing stage is `stage`, and each of its failing results (those of `heads` where
    given) names `code` first; their first diagnoses by head."""
    assert report["first_failing_stage"] == stage, report["first_failing_stage"]
    failing = [e for e in report["results"] if e["stage"] == stage and e["status"] == "FAIL"]
    if heads is not None:
        assert sorted(e["head"] for e in failing) == sorted(heads)
    assert failing
    for e in failing:
        assert e["diagnosis"] and e["diagnosis"][0]["code"] == code, \
            (e["head"], [(d["code"], d["message"]) for d in e["diagnosis"]])
    return {e["head"]: e["diagnosis"][0] for e in failing}


# ---- the correct program -------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_the_correct_program_passes_every_variant_with_no_diagnosis(tmp_path, cases, case):
    result, report = _check(tmp_path, cases[case], Program())
    assert result.exit_code == 0, result.output
    assert not [(e["stage"], e["head"], e["diagnosis"]) for e in report["results"] if e["diagnosis"]]


# ---- GQA -------------------------------------------------------------------------------------------

def test_the_modulo_head_map_is_named_with_the_k_v_head_read(tmp_path, cases):
    """h % Hk for h // (H/Hk): query heads 1 and 4 read K/V heads 1 and 0 (the others, by chance,
    their own)."""
    found = _named(_check(tmp_path, cases["gqa-backward"], Program("kv_modulo"))[1], "QK", "kv_head_map", [1, 4])
    assert [(found[h]["detail"]["read_kv_head"], found[h]["detail"]["kv_head"]) for h in (1, 4)] == [(1, 0), (0, 1)]
    assert all("modulo" in d["detail"]["maps"] and "h % Hk" in d["message"] for d in found.values())


def test_the_modulo_head_map_is_named_at_the_scaled_scores_of_a_program_that_wrote_no_qk(tmp_path, cases):
    """The first stage a program of h % Hk writes is QK_scaled: recomputed from the K/V head the
    query head read, it names the map there (not only from the output on)."""
    found = _named(_check(tmp_path, cases["gqa-backward"], Program("kv_modulo"), ("QK_scaled", "flash_output"))[1],
                   "QK_scaled", "kv_head_map", [1, 4])
    assert [(found[h]["detail"]["read_kv_head"], found[h]["detail"]["kv_head"]) for h in (1, 4)] == [(1, 0), (0, 1)]


def test_the_modulo_head_map_is_named_on_the_k_v_heads_gradients(tmp_path, cases):
    """dK and dV of a K/V head under h % Hk are the sum over the query heads that map sends to it
    (0, 2, 4 and 1, 3, 5), not over its group (0..2, 3..5): named as the map, with the heads."""
    report = _check(tmp_path, cases["gqa-backward"], Program("kv_modulo"))[1]
    sums = [e for e in report["results"] if e["stage"] in ("dK", "dV", "flash_dK", "flash_dV")]
    assert sums and all(e["status"] == "FAIL" for e in sums)
    for e in sums:
        first = e["diagnosis"][0] if e["diagnosis"] else {}
        assert first.get("code") == "kv_head_map", (e["stage"], e["head"], e["diagnosis"])
        assert first["detail"]["read_by"] == [e["head"], e["head"] + 2, e["head"] + 4] and "h % Hk" in first["message"]


def test_k_v_heads_not_shared_are_named_also_past_the_last_k_v_head(tmp_path, cases):
    """Query head i reads K/V head i, clamped to the last one past it: heads 1 and 2 read K/V head 1."""
    found = _named(_check(tmp_path, cases["gqa-backward"], Program("kv_unshared"))[1], "QK", "kv_head_map", [1, 2])
    assert "unshared" in found[1]["detail"]["maps"]
    assert found[2]["detail"]["maps"] == ["unshared_clamped"] and "clamped" in found[2]["message"]


@pytest.mark.parametrize("bug,query_heads", [("group_first", (0, 3)), ("group_last", (2, 5))])
def test_a_k_v_group_not_summed_names_the_query_head_it_holds(tmp_path, cases, bug, query_heads):
    found = _named(_check(tmp_path, cases["gqa-backward"], Program(bug))[1], "dK", "kv_group_not_summed", [0, 1])
    assert tuple(found[kv]["detail"]["query_head"] for kv in (0, 1)) == query_heads
    assert all("K/V head" in d["message"] for d in found.values())


def test_a_k_v_group_summed_twice_is_named_not_scaled(tmp_path, cases):
    result, report = _check(tmp_path, cases["gqa-backward"], Program("group_twice"))
    _named(report, "dK", "kv_group_summed_twice", [0, 1])
    assert not [e for e in report["results"] if any(d["code"] == "scaled" for d in e["diagnosis"])]


# ---- the mask: alignment, window, mask file ---------------------------------------------------------

ALIGNMENTS = [  # (case, stages written, the stage named, the alignment the program used, its shift)
    ("bottom-right", None, "QK_scaled", "top-left", -M_MINUS_N),
    ("top-left", None, "QK_scaled", "bottom-right", M_MINUS_N),
    ("causal-window", None, "QK_scaled", "top-left", -M_MINUS_N),
    ("window", ("flash_output",), "flash_output", "top-left", -M_MINUS_N),
    ("top-left", ("output",), "output", "bottom-right", M_MINUS_N),
]


@pytest.mark.parametrize("case,only,stage,used,shift", ALIGNMENTS,
                         ids=[f"{a[0]}-{a[2]}" for a in ALIGNMENTS])
def test_the_other_alignment_is_named_as_such_both_ways(tmp_path, cases, case, only, stage, used, shift):
    found = _named(_check(tmp_path, cases[case], Program("align_swapped"), only)[1], stage, "mask_offset")
    for d in found.values():
        assert d["detail"]["alignment"] == used and d["detail"]["offset"] == shift
        assert f"is {used} aligned" in d["message"]


WINDOWS = [  # (case, bug, by, stages written, the stage named, code, the window the program applied)
    ("window", "window_left", 1, None, "QK_scaled", "window_off", [8, 4]),
    ("window", "window_left", -2, None, "QK_scaled", "window_off", [5, 4]),
    ("window", "window_right", 2, None, "QK_scaled", "window_off", [7, 6]),
    ("window", "window_right", -1, ("flash_output",), "flash_output", "window_off", [7, 3]),
    ("causal-window", "window_left", 3, None, "QK_scaled", "window_off", [10, -1]),
    ("causal-window", "window_left", -1, ("output",), "output", "window_off", [6, -1]),
    ("window", "window_swapped", 0, None, "QK_scaled", "window_off", [4, 7]),
    ("window", "window_ignored", 0, None, "QK_scaled", "window_missing", [-1, -1]),
    ("window", "window_left_ignored", 0, ("output",), "output", "window_missing", [-1, 4]),
    ("causal-window", "window_ignored", 0, ("flash_output",), "flash_output", "window_missing", [-1, -1]),
]


@pytest.mark.parametrize("case,bug,by,only,stage,code,window", WINDOWS,
                         ids=[f"{w[0]}-{w[1]}{w[2]:+d}-{w[4]}" for w in WINDOWS])
def test_a_window_off_by_a_few_keys_or_ignored_is_named(tmp_path, cases, case, bug, by, only, stage, code, window):
    found = _named(_check(tmp_path, cases[case], Program(bug, by), only)[1], stage, code)
    assert all(d["detail"]["window"] == window for d in found.values())


def test_a_window_off_by_one_is_named_on_the_k_v_heads_gradients(tmp_path, cases):
    """A K/V head's flash dK and dV under a window one key too wide on the left: the sum over its
    group's query heads, each under that window, names it there too."""
    flash = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")
    report = _check(tmp_path, cases["window-backward"], Program("window_left", 1), flash)[1]
    sums = [e for e in report["results"] if e["stage"] in ("flash_dK", "flash_dV")]
    assert len(sums) == 4 and all(e["status"] == "FAIL" for e in sums)
    for e in sums:
        first = e["diagnosis"][0] if e["diagnosis"] else {}
        assert first.get("code") == "window_off" and first["detail"]["window"] == [8, 4], (e["stage"], e["diagnosis"])


def test_a_causal_diagonal_moved_under_a_window_is_named_with_the_window_kept(tmp_path, cases):
    """A causal window whose right bound (the causal diagonal) is one key late: the diagonal moved,
    the window's left bound where it belongs."""
    found = _named(_check(tmp_path, cases["causal-window"], Program("window_right", 1))[1], "QK_scaled",
                   "mask_offset", range(6))
    assert all(d["detail"]["offset"] == 1 and d["detail"]["window_kept"] for d in found.values())


@pytest.mark.parametrize("bug,code", [("mask_transposed", "mask_file_transposed"), ("mask_ignored", "mask_file_ignored"),
                                      ("mask_inverted", "mask_file_inverted")])
@pytest.mark.parametrize("only,stage", [(None, "QK_scaled"), (("flash_output",), "flash_output")])
def test_the_mask_file_ignored_read_transposed_or_inverted_is_named(tmp_path, cases, bug, code, only, stage):
    _named(_check(tmp_path, cases["mask"], Program(bug), only)[1], stage, code)


# ---- the scores: softcap, ALiBi, bias -------------------------------------------------------------------

SCORES = [  # (case, bug, code)
    ("softcap", "softcap_missing", "softcap_missing"),
    ("softcap", "softcap_before_scale", "softcap_before_scale"),
    ("alibi", "alibi_missing", "alibi_missing"),
    ("alibi", "alibi_sign", "alibi_sign"),
    ("alibi", "alibi_other_alignment", "alibi_alignment"),
    ("alibi", "alibi_reversed", "alibi_slope_order"),
    ("alibi-slopes-file", "alibi_next_head", "alibi_slope_order"),
    ("bias", "bias_ignored", "bias_ignored"),
    ("bias", "bias_transposed", "bias_transposed"),
]


@pytest.mark.parametrize("only,stage", [(None, "QK_scaled"), (("flash_output", "flash_lse"), "flash_output")],
                         ids=["stage-path", "flash-only"])
@pytest.mark.parametrize("case,bug,code", SCORES, ids=[s[1] for s in SCORES])
def test_a_wrong_score_is_named_where_it_begins(tmp_path, cases, case, bug, code, only, stage):
    found = _named(_check(tmp_path, cases[case], Program(bug), only)[1], stage, code, range(6))
    if bug == "alibi_reversed":
        assert all(d["detail"]["used_head"] == 5 - h and d["detail"]["reversed"] for h, d in found.items())
    if bug == "alibi_other_alignment":  # named with the diagonal it used
        assert all(d["detail"]["alignment"] == "top-left" and "from the top-left diagonal, |i − j|" in d["message"]
                   and "where it is |i + 16 − j|" in d["message"] for d in found.values())
    if bug == "alibi_next_head":  # head 2's next is head 3 = H - 1 - 2: named reversed as well
        assert all(d["detail"]["used_head"] == (h + 1) % 6 for h, d in found.items())


@pytest.mark.parametrize("only,stage", [(None, "QK_scaled"), (("flash_output", "flash_lse"), "flash_lse")],
                         ids=["stage-path", "flash-only"])
def test_alibi_from_flash_attn_s_bottom_right_diagonal_in_a_top_left_case_is_named(tmp_path, cases, only, stage):
    """Under the top-left causal mask, ALiBi measured from the bottom-right diagonal moves each row's
    visible scores alike: the weights and output are right, the scores and the lse are not."""
    found = _named(_check(tmp_path, cases["alibi-top-left"], Program("alibi_other_alignment"), only)[1], stage,
                   "alibi_alignment", range(6))
    assert all(d["detail"]["alignment"] == "bottom-right" and "from the bottom-right diagonal, |i + 16 − j|"
               in d["message"] for d in found.values())


def test_a_gradient_without_the_softcap_s_derivative_is_named(tmp_path, cases):
    _named(_check(tmp_path, cases["softcap-backward"], Program("softcap_grad_missing"))[1], "dQ",
           "softcap_derivative_missing", range(6))


def test_the_gradients_of_a_softcap_before_the_scale_name_it_first_and_nothing_looser(tmp_path, cases):
    """The flash gradients of a program that caps before the scale, checked against its own wrong
    output and lse: a bound wide where those disagree lets loose candidates fit too. The cause,
    which reproduces got most closely, comes first, and none 100 times looser is listed."""
    flash = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")
    in_dir = tmp_path / "in"
    r = invoke("generate", "--out", in_dir, "--heads", "4", "--seq-q", "128", "--seq-k", "128", "--d-k", "64", "--d-v",
               "64", "--dist", "normal", "--seed", 0, "--format", "npy", "--softcap", "50", "--backward")
    assert r.exit_code == 0, r.output
    for f in [*in_dir.glob("Q_head_*.npy"), *in_dir.glob("K_head_*.npy")]:  # logits in the tens: the cap bends them
        np.save(f, 2 * np.load(f))
    report = _check(tmp_path, in_dir, Program("softcap_before_scale"), flash)[1]
    for e in report["results"]:
        if e["status"] != "FAIL":
            continue
        found = e["diagnosis"]
        assert found and found[0]["code"] == "softcap_before_scale", (e["stage"], [d["code"] for d in found])
        diffs = [d["detail"]["max_diff"] for d in found if "max_diff" in d["detail"]]
        assert max(diffs) <= 100 * min(diffs), (e["stage"], [(d["code"], d["detail"].get("max_diff")) for d in found])


# ---- dropout ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bug,code", [("dropout_unscaled", "dropout_unscaled"),
                                      ("dropout_not_applied", "dropout_not_applied"),
                                      ("dropout_inverted", "dropout_mask_inverted")])
def test_a_dropout_bug_is_named_at_the_output(tmp_path, cases, bug, code):
    result, report = _check(tmp_path, cases["dropout-backward"], Program(bug))
    found = _named(report, "output", code, range(6))
    if bug == "dropout_unscaled":
        assert all(abs(d["detail"]["factor"] - 0.8) < 1e-12 for d in found.values())
        assert not [e for e in report["results"] if any(d["code"] == "scaled" for d in e["diagnosis"])]


# ---- the pieces ------------------------------------------------------------------------------------------

def test_every_planted_bug_is_tested():
    planted = {bug for _, bug, *_ in WINDOWS} | {bug for _, bug, _ in SCORES} | {"softcap_grad_missing"} | {
        "kv_modulo", "kv_unshared", "group_first", "group_last", "group_twice", "align_swapped", "mask_transposed",
        "mask_ignored", "mask_inverted", "dropout_unscaled", "dropout_not_applied", "dropout_inverted"}
    assert planted == set(BUGS)


def _hidden_at(v: Variant, n: int, m: int, offset: int) -> np.ndarray:
    """docs/contract.md's rule with row i's diagonal at key i + offset."""
    diag, j = np.arange(n)[:, None] + offset, np.arange(m)[None, :]
    visible = np.ones((n, m), bool)
    if v.left != -1:
        visible &= j >= diag - v.left
    if v.right != -1:
        visible &= j <= diag + v.right
    return ~visible


@pytest.mark.parametrize("v", [Variant(causal=True), Variant(causal=True, align="bottom-right", window=(5, -1)),
                               Variant(window=(3, 9), align="bottom-right"), Variant(window=(0, 0))],
                         ids=["causal", "causal-window-bottom-right", "window-bottom-right", "diagonal-only"])
@pytest.mark.parametrize("n,m", [(37, 53), (53, 37), (16, 16)])
def test_the_structural_mask_at_any_offset_is_the_rule_s(v, n, m):
    """At the case's own offset, verify/variant.py's mask; at any other, the rule's with every row's
    diagonal moved there (the candidates of a shifted mask or another alignment)."""
    own = v.offset(n, m)
    assert (structural_hidden(v, n, m, own) == hidden(v, n, m)).all()
    for offset in (own - 3, own + 2, m - n, 0, -n, m):
        assert (structural_hidden(v, n, m, offset) == _hidden_at(v, n, m, offset)).all(), offset


# ---- another program's files: %g text, a subset of stages ----------------------------------------

def _as_g_text(folder: Path) -> None:
    """Each .npy stage file rewritten as text with %g (six significant digits), as a C program's
    printf would: the printed resolution must be part of the check."""
    for path in sorted(folder.glob("*.npy")):
        np.savetxt(path.with_suffix(".txt"), np.load(path), fmt="%g")
        path.unlink()


@pytest.mark.parametrize("plant,fails", [(None, None), ("softcap_missing", "flash_output")])
def test_a_g_text_program_with_a_subset_of_stages_is_judged_by_its_arithmetic(tmp_path, cases, plant, fails):
    """No run.toml, %g text, only the flash stages and dV: a correct program passes every variant at
    once; the same program without its softcap fails where the cap was left out."""
    in_dir = cases["everything-backward"]
    only = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV", "dropout_mask")
    write_run(tmp_path / "out", load_input_case(in_dir), Program(plant) if plant else Program(), only)
    _as_g_text(tmp_path / "out")
    report = tmp_path / "r.json"
    result = invoke("check", "--in", in_dir, "--out", tmp_path / "out", "--json", report)
    data = json.loads(report.read_text())
    assert {e["stage"] for e in data["results"]} == set(only)
    if fails is None:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 1 and data["first_failing_stage"] == fails, result.output



@pytest.mark.parametrize("kv_heads, cap", [(2, 2), (6, 2), (2, 50), (6, 50)])
def test_a_flash_gradient_without_the_softcap_s_derivative_is_named(tmp_path, kv_heads, cap):
    """The flash backward (its P recomputed from the saved lse) leaving out 1 − t² on dQ and dK:
    named on flash_dQ, and on flash_dK where each head has its own K (a group's sum is not
    searched for it). At Gemma-2's cap of 50 the bug changes the gradients by well under an
    approximate tanh's error, which an IEEE float32 program is not allowed."""
    sizes = [str(kv_heads) if SIZES[i - 1] == "--kv-heads" else str(a) for i, a in enumerate(SIZES)]
    r = invoke("generate", "--out", tmp_path / "in", *sizes, "--dist", "normal", "--seed", 5, "--format", "npy",
               "--softcap", cap, "--backward")
    assert r.exit_code == 0, r.output
    only = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")
    report = _check(tmp_path, tmp_path / "in", Program("softcap_grad_missing"), only)[1]
    found = _named(report, "flash_dQ", "softcap_derivative_missing", range(6))
    assert all(d["detail"]["softcap"] == cap for d in found.values())
    assert {e["status"] for e in report["results"] if e["stage"] == "flash_dV"} == {"PASS"}
    failing_dk = [e for e in report["results"] if e["stage"] == "flash_dK" and e["status"] == "FAIL"]
    assert len(failing_dk) == kv_heads
    if kv_heads == 6:
        assert all(e["diagnosis"][0]["code"] == "softcap_derivative_missing" for e in failing_dk)

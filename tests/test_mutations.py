"""The mutation suite: plant each bug pattern into correct outputs of the binary and
check that `attnstep check` catches it, blames the planted stage, names the pattern, and reports
the stage downstream of it as inherited rather than as a new fault.

A planted stage file is rewritten keeping its header line, and run.toml's CRC entry is updated
(except for `stale`, which is the point of that test). As a buggy binary would, every stage-path
stage downstream of the planted one (the backward's included, in the cases with dO) is recomputed
from it in float32 (the CPU backend's arithmetic), so downstream stages are correct given their
input and fail only chained; every other stage passes.
A false-alarm suite runs correct cases over many seeds, shapes and distributions.

The attention variants' bugs (tests/helpers/variant_programs.py's, each with its diagnosis code)
are planted the same way into correct runs of grouped variant cases, at fp32 and bf16: the
program computes the stage path with its bug from the run's own inputs (see the section below).
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest

from helpers import foreign_routes as foreign
from helpers.cli import invoke
from helpers.simulated_float32 import mm_seq, scale_mask32, softmax32
from helpers.variant_programs import BUGS, Program
from verify.check.reference import softmax_rows
from verify.diagnose import heads as head_bugs, masks as mask_bugs, variants as variant_bugs
from verify.files.case import InputCase, load_input_case, read_matrix, read_toml
from verify.specs import upstream
from verify.stages import BACKWARD_STAGES, DROPOUT_MASK, STAGES, stage_file

f32 = np.float32
SHAPES = {  # name: (heads, N, M, d, causal, backward)
    "rect": (3, 48, 80, 16, False, False),
    "square-causal": (2, 64, 64, 32, True, False),
    "tiles": (2, 130, 70, 16, False, False),  # the CPU backend's flash tiles are 64: a 2-row tail tile
    "tall-causal": (2, 80, 48, 16, True, False),  # N > M: the last N - M rows see every key
    # With the output gradient dO: every backward stage.
    "backward-square-causal": (2, 64, 64, 32, True, True),  # N = M: dV = P·dO has dV's shape
    "backward-tiles": (2, 130, 70, 16, False, True),
}


def _generate_and_run(binary, base: Path, out: str, generate_options, extra) -> None:
    """`attnstep generate` into base/in, then the binary's CPU backend into base/<out>."""
    r = invoke("generate", "--out", base / "in", *generate_options)
    assert r.exit_code == 0, r.output
    subprocess.run([str(binary), "--in", str(base / "in"), "--out", str(base / out), "--backend", "cpu", *extra],
                   check=True, capture_output=True)


def _correct_cases(binary, root, *extra):
    """One correct output case per shape, computed by the binary's CPU backend."""
    out = {}
    for name, (heads, N, M, d, causal, backward) in SHAPES.items():
        base = root / name
        _generate_and_run(binary, base, "out", ("--heads", heads, "--seq-q", N, "--seq-k", M, "--d-k", d, "--d-v", d,
                                                "--dist", "normal", "--seed", 11, "--causal" if causal else "--no-causal",
                                                *(("--backward",) if backward else ())), extra)
        out[name] = base
    return out


@pytest.fixture(scope="module")
def cases(binary, tmp_path_factory):
    return _correct_cases(binary, tmp_path_factory.mktemp("mutations"))


@pytest.fixture(scope="module")
def bf16_cases(binary, tmp_path_factory):
    """The same cases computed in bf16 (its bounds the loosest of the half formats')."""
    return _correct_cases(binary, tmp_path_factory.mktemp("mutations-bf16"), "--precision", "bf16")


# How the binary computes each stage-path stage from its inputs (verify/stages.py's `inputs`, in
# that order), in float32: what a buggy binary computes downstream of a bug.
def _rowdot32(a, b):
    return (a * b).sum(axis=1, keepdims=True, dtype=f32)


RECOMPUTE = {
    "QK_scaled": lambda c, qk: scale_mask32(qk, c.scale, c.causal),
    "attention_weights": lambda c, s: softmax32(s),
    "output": lambda c, p, v: mm_seq(p, v),
    "D": lambda c, do, o: _rowdot32(do, o),
    "dP": lambda c, do, v: mm_seq(do, v.T),
    "dS": lambda c, p, dp, d: p * (dp - d),
    "dQ": lambda c, ds, k: mm_seq(ds, k) * f32(c.scale),
    "dK": lambda c, ds, q: mm_seq(ds.T, q) * f32(c.scale),
    "dV": lambda c, p, do: mm_seq(p.T, do),
}


def downstream(stage: str):
    """The stages computed from `stage`, directly or not, in table order."""
    return [s for s in STAGES if stage in upstream(s)]


class Case:
    """A writable copy of a correct output case."""

    def __init__(self, base: Path, work: Path, run: str = "out"):
        self.input = base / "in"
        self.out = work / "out"
        shutil.copytree(base / run, self.out)
        self.run = read_toml(self.out / "run.toml")
        self.scale = float(self.run["scale"])
        self.causal = bool(self.run["causal"])
        self.heads = int(self.run["batch"]) * int(self.run["heads"])

    def path(self, stage: str, head: int) -> Path:
        return self.out / stage_file(stage, head, "txt")

    def has(self, stage: str) -> bool:
        return self.path(stage, 0).exists()

    def load(self, stage: str, head: int) -> np.ndarray:
        """A stage the binary wrote (Q, K, V and dO: its echo of the input file)."""
        return np.loadtxt(self.path(stage, head), ndmin=2)

    def load32(self, stage: str, head: int) -> np.ndarray:
        return self.load(stage, head).astype(f32)

    def write(self, stage: str, head: int, mat: np.ndarray, update_crc: bool = True) -> None:
        """Rewrite a stage file keeping its header line; optionally re-stamp its CRC in run.toml."""
        path = self.path(stage, head)
        header = path.read_text().splitlines()[0]
        body = "\n".join(" ".join(f"{v:.9g}" for v in row) for row in np.asarray(mat, f32))
        data = (header + "\n" + body + "\n").encode()
        path.write_bytes(data)
        if update_crc:
            key = f"crc32_{stage}_head_{head}"
            toml = self.out / "run.toml"
            lines = [f'{key} = "{zlib.crc32(data):08x}"' if ln.startswith(key + " ") else ln
                     for ln in toml.read_text().splitlines()]
            toml.write_text("\n".join(lines) + "\n")

    def plant(self, stage: str, head: int, mat: np.ndarray) -> None:
        """Write the planted stage, then recompute in float32 every stage-path stage downstream of
        it from the files as now written."""
        self.write(stage, head, mat)
        changed = {stage: np.asarray(mat, f32)}
        for nxt in downstream(stage):
            if nxt not in RECOMPUTE or not self.has(nxt):
                continue
            args = [changed[n] if n in changed else self.load32(n, head) for n in STAGES[nxt].inputs]
            with np.errstate(invalid="ignore"):  # (NaN plants propagate quietly)
                changed[nxt] = RECOMPUTE[nxt](self, *args)
            self.write(nxt, head, changed[nxt])

    def check(self, tmp: Path) -> dict:
        report = tmp / "report.json"
        r = invoke("check", "--in", self.input, "--out", self.out, "--json", report)
        data = json.loads(report.read_text())
        data["exit_code"] = r.exit_code
        data["output"] = r.output
        return data


def _results(report: dict, stage: str, head: int = None):
    return [e for e in report["results"] if e["stage"] == stage and (head is None or e["head"] == head)]


HEAD = 1  # the planted head


def _transposed(c: Case):
    qk = c.load("QK", HEAD)
    return "QK", qk.T.reshape(qk.shape)


def _scaled_twice(c: Case):
    return "QK_scaled", c.load("QK_scaled", HEAD) * c.scale


def _softmax_columns(c: Case):
    return "attention_weights", softmax_rows(c.load("QK_scaled", HEAD).T).T


def _head_permuted(c: Case):
    return "QK", c.load("QK", 0)


def _layout(c: Case):
    Q, K = c.load32("Q", HEAD), c.load32("K", HEAD)
    return "QK", mm_seq(Q, K.reshape(K.shape[1], K.shape[0]))  # K read as a d×M (column-major) buffer


def _unwritten(c: Case):
    o = c.load("output", HEAD)
    o[8:16, :] = 0.0
    return "output", o


def _poison(c: Case):
    o = c.load("flash_output", HEAD)
    o[3:7, 2:9] = np.nan
    return "flash_output", o


def _nonfinite(c: Case):
    qk = c.load("QK", HEAD)
    qk[5, 7] = np.inf
    return "QK", qk


def _mask_missing(c: Case):
    return "QK_scaled", c.load("QK", HEAD) * c.scale


def _mask_offset(c: Case):
    s = c.load("QK", HEAD) * c.scale
    return "QK_scaled", np.where(np.triu(np.ones(s.shape, bool), 2), -np.inf, s)  # c > r + 1


def _flash_mask_offset(c: Case):
    """flash_output under a causal mask shifted by -2 (its own stage: the flash path writes no scores)."""
    q, k, v = (c.load32(n, HEAD) for n in ("Q", "K", "V"))
    with np.errstate(invalid="ignore"):  # rows 0 and 1 see no key: -inf - -inf, as a kernel gets
        return "flash_output", foreign.flash_forward(q, k, v, c.scale, True, 64, False, mask_offset=-2)[0]


def _tail_tile_by(factor: float):
    def build(c: Case):
        o = c.load("flash_output", HEAD)
        o[128:, :] *= factor  # the last 64-row query tile (rows 128..129)
        return "flash_output", o
    return build


_tail_tile = _tail_tile_by(1.01)


def _mixture(c: Case):
    qk = c.load("QK", HEAD) * 4.0  # scaled by √d_k … and an unwritten block on top
    qk[0:4, :] = 0.0
    return "QK", qk


# ---- the backward pass: planted into the backward cases ----------------------------------------

def _own_inputs(c: Case, stage: str):
    return [c.load32(n, HEAD) for n in STAGES[stage].inputs]


def _d_from_do(c: Case):
    do = c.load32("dO", HEAD)
    return "D", _rowdot32(do, do)  # rowsum(dO∘dO): dO passed where O belongs


def _ds_without_p(c: Case):
    return "dS", c.load32("dP", HEAD) - c.load32("D", HEAD)  # nor masked: P carried the mask


def _unscaled(stage: str):
    def build(c: Case):  # the stage's own computation with a scale of 1
        return stage, RECOMPUTE[stage](SimpleNamespace(scale=1.0), *_own_inputs(c, stage))
    return build


def _dv_untransposed(c: Case):
    return "dV", mm_seq(c.load32("attention_weights", HEAD), c.load32("dO", HEAD))


def _flash_bug(stage: str, bug: str):
    """A flash gradient of the float32 flash backward of tests/helpers/foreign_routes.py with a bug of its
    BACKWARD_BUGS, from the binary's own sources (Q, K, V, dO, flash_output, flash_lse)."""
    def build(c: Case):
        return stage, foreign.flash_backward(*_own_inputs(c, stage), c.scale, c.causal, bug=bug)[stage]
    return build


def _column_major(stage: str):
    def build(c: Case):
        x = c.load(stage, HEAD)
        return stage, x.T.reshape(x.shape)  # the row-major buffer holds xᵀ
    return build


def _unwritten_tile(stage: str, tile: int):
    def build(c: Case):
        x = c.load(stage, HEAD)
        rows = int(c.run["flash_block_q"])  # the query tile the binary recorded
        x[tile * rows:(tile + 1) * rows] = 0.0
        return stage, x
    return build


EVERY = "every stage downstream"

# id: (shape, builder, expected code(s) (the first one is the first diagnosis), the stage downstream
# that must be INHERITED (EVERY: all), or None)
MUTATIONS = {
    "transposed-QK": ("rect", _transposed, "transposed", "QK_scaled"),
    "scaled-QK_scaled-twice": ("rect", _scaled_twice, "scaled", "attention_weights"),
    "softmax_axis-weights": ("square-causal", _softmax_columns, "softmax_axis", "output"),
    "head_permuted-QK": ("rect", _head_permuted, "head_permuted", "attention_weights"),
    "layout-QK-K-column-major": ("rect", _layout, "layout", "QK_scaled"),
    "unwritten-output-rows": ("rect", _unwritten, "unwritten", None),
    "unwritten-flash-poison": ("tiles", _poison, "unwritten", None),
    "nonfinite-QK": ("rect", _nonfinite, "nonfinite", None),
    "mask_missing-QK_scaled": ("square-causal", _mask_missing, "mask_missing", "output"),
    "mask_offset-QK_scaled": ("square-causal", _mask_offset, "mask_offset", "output"),
    "mask_offset-QK_scaled-N>M": ("tall-causal", _mask_offset, "mask_offset", "output"),
    "mask_offset-flash_output-N>M": ("tall-causal", _flash_mask_offset, "mask_offset", None),
    "tile_boundary-flash-tail": ("tiles", _tail_tile, "tile_boundary", None),
    "mixture-scaled-and-unwritten-QK": ("rect", _mixture, ("unwritten", "scaled"), "QK_scaled"),
    "D_wrong_O-dO-for-O": ("backward-square-causal", _d_from_do, "D_wrong_O", EVERY),
    "dS_missing_P": ("backward-square-causal", _ds_without_p, "dS_missing_P", EVERY),
    "grad_unscaled-dQ": ("backward-tiles", _unscaled("dQ"), "grad_unscaled", EVERY),
    "grad_unscaled-dK": ("backward-tiles", _unscaled("dK"), "grad_unscaled", EVERY),
    "dV_untransposed_P": ("backward-square-causal", _dv_untransposed, "dV_untransposed_P", EVERY),
    "mask_missing-flash_dQ": ("backward-square-causal", _flash_bug("flash_dQ", "bwd_mask"), "mask_missing", EVERY),
    "lse_log2-flash_dV": ("backward-tiles", _flash_bug("flash_dV", "bwd_lse_log2"), "lse_log2", EVERY),
    "dq_key_tile_rows-flash_dQ": ("backward-tiles", _flash_bug("flash_dQ", "dq_key_rows"), "dq_key_tile_rows", EVERY),
    "grad_wrong_operand-flash_dQ": ("backward-tiles", _flash_bug("flash_dQ", "dq_uses_v"), "grad_wrong_operand", EVERY),
    "grad_wrong_operand-flash_dV": ("backward-tiles", _flash_bug("flash_dV", "dv_uses_ds"), "grad_wrong_operand",
                                    EVERY),
    "dK_untransposed_dS-flash_dK": ("backward-square-causal", _flash_bug("flash_dK", "dk_untransposed_tile"),
                                    "dK_untransposed_dS", EVERY),
    "lse_sum_missing-flash_dQ": ("backward-tiles", _flash_bug("flash_dQ", "bwd_lse_max"), "lse_sum_missing", EVERY),
    "grad_scores_scaled-flash_dQ": ("backward-tiles", _flash_bug("flash_dQ", "bwd_scores_1_over_d"), "grad_scores_scaled",
                                    EVERY),
    "grad_first_tile_only-flash_dQ": ("backward-tiles", _flash_bug("flash_dQ", "dq_first_key_tile"),
                                      "grad_first_tile_only", EVERY),
    "grad_first_tile_only-flash_dK": ("backward-tiles", _flash_bug("flash_dK", "dkdv_first_query_tile"),
                                      "grad_first_tile_only", EVERY),
    "transposed-dK-column-major": ("backward-tiles", _column_major("dK"), "transposed", EVERY),
    "unwritten-flash_dQ-tile": ("backward-tiles", _unwritten_tile("flash_dQ", 1), "unwritten", EVERY),
}


@pytest.mark.parametrize("name", list(MUTATIONS), ids=list(MUTATIONS))
def test_planted_bug_is_caught_localized_and_named(cases, tmp_path, name):
    _assert_caught(cases, tmp_path, MUTATIONS[name])


# A 1% error in two rows of flash_output is 2.5 half-ulps of bf16 (2^-8), within what a correct
# bf16 run may err there: at bf16 the tail tile is planted 10% off.
BF16_MUTATIONS = {**MUTATIONS, "tile_boundary-flash-tail": ("tiles", _tail_tile_by(1.10), "tile_boundary", None)}


@pytest.mark.parametrize("name", list(BF16_MUTATIONS), ids=list(BF16_MUTATIONS))
def test_planted_bug_is_caught_at_half_precision(bf16_cases, tmp_path, name):
    """The same bugs in a bf16 run (its stages rounded to bf16, its bounds bf16's) are caught,
    blamed and named alike."""
    _assert_caught(bf16_cases, tmp_path, BF16_MUTATIONS[name])


def _assert_caught(cases, tmp_path, mutation):
    shape, build, code, inherited = mutation
    case = Case(cases[shape], tmp_path)
    stage, mat = build(case)
    case.plant(stage, HEAD, mat)
    report = case.check(tmp_path)
    assert report["exit_code"] == 1, report["output"]
    assert report["first_failing_stage"] == stage, report["output"]
    planted = _results(report, stage, HEAD)[0]
    assert planted["status"] == "FAIL"
    found = [d["code"] for d in planted["diagnosis"]]
    wanted = code if isinstance(code, tuple) else (code,)  # a mixture: each of its patterns named
    assert found[:1] == [wanted[0]] and set(wanted) <= set(found), \
        (found, [d["message"] for d in planted["diagnosis"]])
    after = [s for s in downstream(stage) if case.has(s)]
    must_inherit = after if inherited == EVERY else [inherited] if inherited else []
    for entry in report["results"]:
        if entry["head"] != HEAD or entry["stage"] not in [stage] + after:
            # Untouched: passes. A flash stage's disagreement with a faulty stage-path partner is
            # blamed on the partner (a note), never reported as a flash failure.
            assert entry["passed"], (entry["stage"], entry["head"], entry["status"], entry["violations"])
        elif entry["stage"] in must_inherit:
            assert entry["status"] == "INHERITED" and entry["inherited"], (entry["stage"], entry["status"])
            assert entry["isolated"]["passed"] and not entry["chained"]["passed"], entry["stage"]


# ---- the variants' bugs: planted by the float32 program of tests/helpers/variant_programs.py ----
#
# Each variant case (irregular: H = 6 query heads over Hk = 2 K/V heads, N = 37, M = 53, d = 32, so
# the flash stages run too) is run correctly by the binary. The program, fed the run's own inputs
# (its echoes of Q, K, V and dO: rounded to the format in a half run) and the run's keep-mask, then
# computes every stage-path stage with its bug, and they replace the binary's files (CRCs
# re-stamped): downstream stages are correct given their input, as a buggy binary's would be. The
# binary's flash stages stay, correct.

VARIANT_SIZES = ("--heads", 6, "--kv-heads", 2, "--seq-q", 37, "--seq-k", 53, "--d-k", 32, "--d-v", 32)
VARIANT_CASES = {  # name: `attnstep generate` options beside VARIANT_SIZES
    "gqa": ("--causal", "bottom-right"),
    "gqa-backward": ("--causal", "bottom-right", "--backward"),
    "top-left": ("--causal", "top-left"),
    "window": ("--window", "7,4", "--align", "bottom-right"),
    "causal-window": ("--causal", "top-left", "--window", "7,-1"),
    "softcap-backward": ("--softcap", "2", "--backward"),
    "alibi": ("--alibi", "--causal", "bottom-right"),
    "alibi-slopes-file": ("--alibi", "--alibi-slopes", "random"),
    "mask": ("--mask", "random", "--mask-heads", "per-head", "--causal", "bottom-right"),
    "bias": ("--bias", "random", "--bias-heads", "per-head"),
    "dropout-backward": ("--dropout", "0.2", "--causal", "bottom-right", "--backward"),
}
# Stage-path stages the binary computes and the program replaces (the flash stages and the
# echoes of the inputs stay the binary's).
PROGRAM_STAGES = ("QK", "QK_scaled", "attention_weights", "output", "D", "dP", "dS", "dQ", "dK", "dV")


def _variant_runs(binary, root: Path, *extra) -> dict:
    """name -> the folder of one variant case's input (in/) and the binary's correct run with the
    correct program's stage path planted (out/: what each bug is planted into)."""
    out = {}
    for name, options in VARIANT_CASES.items():
        base = root / name
        _generate_and_run(binary, base, "binary", (*VARIANT_SIZES, "--dist", "normal", "--seed", 5, *options), extra)
        VariantRun(base, base, "binary").plant_program(None, 1)
        out[name] = base
    return out


@pytest.fixture(scope="module")
def variant_runs(binary, tmp_path_factory):
    return _variant_runs(binary, tmp_path_factory.mktemp("variant-mutations"))


@pytest.fixture(scope="module")
def bf16_variant_runs(binary, tmp_path_factory):
    return _variant_runs(binary, tmp_path_factory.mktemp("variant-mutations-bf16"), "--precision", "bf16")


@dataclass
class RunInputs(InputCase):
    """The input case as a run read it: Q, K, V and dO (and the keep-mask) from the run's files."""
    run_dir: Optional[Path] = None

    def load(self, name: str, head: int) -> np.ndarray:
        return read_matrix(self.run_dir / stage_file(name, head, "txt"), STAGES[name].shape(self.dims))


class RunsKeepMask:
    """Draws that make the program keep exactly the entries the run's keep-mask keeps (its rule
    keeps a draw r when r >= p: 1 kept, 0 dropped)."""

    def __init__(self, case: RunInputs, head: int):
        self.case, self.head = case, head

    def random(self, shape) -> np.ndarray:
        return self.case.load(DROPOUT_MASK, self.head).astype(np.float64)


class ProgramOnRun(Program):
    """The program with the run's keep-mask instead of draws of its own."""

    def query_head(self, case: RunInputs, head: int, rng):
        return super().query_head(case, head, RunsKeepMask(case, head))


def _rule_ignored(case: InputCase) -> InputCase:
    """The case as a program that applies no causal mask or window reads it."""
    return dataclasses.replace(case, causal=False, variant=case.variant.with_(causal=False, window=(-1, -1)))


# The variants' diagnosis codes: the K/V heads' (heads.py), the masks' and the scores' and dropout's
# (a causal kernel's tile skip is a mask of the kernel's tiles: tests/test_program_bugs.py plants it).
VARIANT_CODES = tuple(c for c in head_bugs.CODES if c.startswith("kv_")) + \
    tuple(c for c in mask_bugs.CODES if c != "causal_tile_skip") + variant_bugs.CODES

def _causal_added(case: InputCase) -> InputCase:
    """The case as a program that masks causally (top-left) where the case does not reads it."""
    return dataclasses.replace(case, causal=True, variant=case.variant.with_(causal=True, align="top-left"))


# Bugs the suite plants by changing the case the correct program reads (beside the program's BUGS).
CASE_BUGS = {"rule_ignored": _rule_ignored, "causal_added": _causal_added}

# id: (case, bug (variant_programs.BUGS or CASE_BUGS), by, the stage it begins at, its code, other
# stages the same bug writes wrong on their own)
VARIANT_MUTATIONS = {
    "kv_head_map-modulo": ("gqa", "kv_modulo", 1, "QK", "kv_head_map", ("output",)),  # K and V read
    "kv_head_map-unshared": ("gqa", "kv_unshared", 1, "QK", "kv_head_map", ("output",)),
    "kv_group_not_summed-first": ("gqa-backward", "group_first", 1, "dK", "kv_group_not_summed", ("dV",)),
    "kv_group_not_summed-last": ("gqa-backward", "group_last", 1, "dK", "kv_group_not_summed", ("dV",)),
    "kv_group_summed_twice": ("gqa-backward", "group_twice", 1, "dK", "kv_group_summed_twice", ("dV",)),
    "mask_offset-bottom-right-as-top-left": ("gqa", "align_swapped", 1, "QK_scaled", "mask_offset", ()),
    "mask_offset-top-left-as-bottom-right": ("top-left", "align_swapped", 1, "QK_scaled", "mask_offset", ()),
    "mask_missing-bottom-right": ("gqa", "rule_ignored", 1, "QK_scaled", "mask_missing", ()),
    "mask_extra-top-left": ("bias", "causal_added", 1, "QK_scaled", "mask_extra", ()),
    "window_off-left+1": ("window", "window_left", 1, "QK_scaled", "window_off", ()),
    "window_off-left-2": ("window", "window_left", -2, "QK_scaled", "window_off", ()),
    "window_off-right+2": ("window", "window_right", 2, "QK_scaled", "window_off", ()),
    "window_off-causal-left+3": ("causal-window", "window_left", 3, "QK_scaled", "window_off", ()),
    "window_off-swapped": ("window", "window_swapped", 0, "QK_scaled", "window_off", ()),
    "window_missing": ("window", "window_ignored", 0, "QK_scaled", "window_missing", ()),
    "window_missing-left": ("window", "window_left_ignored", 0, "QK_scaled", "window_missing", ()),
    "mask_file_ignored": ("mask", "mask_ignored", 1, "QK_scaled", "mask_file_ignored", ()),
    "mask_file_transposed": ("mask", "mask_transposed", 1, "QK_scaled", "mask_file_transposed", ()),
    "mask_file_inverted": ("mask", "mask_inverted", 1, "QK_scaled", "mask_file_inverted", ()),
    "bias_ignored": ("bias", "bias_ignored", 1, "QK_scaled", "bias_ignored", ()),
    "bias_transposed": ("bias", "bias_transposed", 1, "QK_scaled", "bias_transposed", ()),
    "softcap_missing": ("softcap-backward", "softcap_missing", 1, "QK_scaled", "softcap_missing", ()),
    "softcap_before_scale": ("softcap-backward", "softcap_before_scale", 1, "QK_scaled", "softcap_before_scale", ()),
    "softcap_derivative_missing": ("softcap-backward", "softcap_grad_missing", 1, "dQ", "softcap_derivative_missing",
                                   ("dK",)),
    "alibi_missing": ("alibi", "alibi_missing", 1, "QK_scaled", "alibi_missing", ()),
    "alibi_sign": ("alibi", "alibi_sign", 1, "QK_scaled", "alibi_sign", ()),
    "alibi_alignment": ("alibi", "alibi_other_alignment", 1, "QK_scaled", "alibi_alignment", ()),
    "alibi_slope_order-reversed": ("alibi", "alibi_reversed", 1, "QK_scaled", "alibi_slope_order", ()),
    "alibi_slope_order-next-head": ("alibi-slopes-file", "alibi_next_head", 1, "QK_scaled", "alibi_slope_order", ()),
    "dropout_unscaled": ("dropout-backward", "dropout_unscaled", 1, "output", "dropout_unscaled", ("dV",)),
    "dropout_not_applied": ("dropout-backward", "dropout_not_applied", 1, "output", "dropout_not_applied", ("dV",)),
    "dropout_mask_inverted": ("dropout-backward", "dropout_inverted", 1, "output", "dropout_mask_inverted", ("dV",)),
}


def test_every_variant_bug_is_planted():
    """Each bug of the variants' program, and each variant diagnosis code, has its mutation."""
    planted = {bug for _, bug, *_ in VARIANT_MUTATIONS.values()}
    assert planted == set(BUGS) | set(CASE_BUGS)
    assert {code for *_, code, _ in VARIANT_MUTATIONS.values()} == set(VARIANT_CODES)


class VariantRun(Case):
    """A writable copy of a variant run, into which a program's stage path is planted."""

    def program_case(self) -> RunInputs:
        case = load_input_case(self.input)
        values = {f.name: getattr(case, f.name) for f in dataclasses.fields(InputCase) if f.init}
        return RunInputs(**values, run_dir=self.out)

    def plant_program(self, bug: Optional[str], by: int) -> dict:
        """The program's stage path with `bug` written where it differs from the correct
        program's, which the run holds (the base run: the binary's, where the correct program's
        replaces it); {stage: the heads where the bug changes the stage}."""
        case = self.program_case()
        buggy = ProgramOnRun().run(CASE_BUGS[bug](case)) if bug in CASE_BUGS else ProgramOnRun(bug, by).run(case)
        correct = ProgramOnRun().run(case)
        whole = bug is None  # the base run: every stage-path stage becomes the program's
        changed = {}
        for stage in (s for s in PROGRAM_STAGES if self.has(s)):
            k = int(STAGES[stage].kv)
            for head, (mat, right) in enumerate(zip(buggy[k], correct[k])):
                if whole or not np.array_equal(mat[stage], right[stage], equal_nan=True):
                    self.write(stage, head, mat[stage])
                if _differs(mat[stage], right[stage]):
                    changed.setdefault(stage, []).append(head)
        return changed


def _differs(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether `got` differs from `want` by more than a thousandth of want's largest finite
    magnitude somewhere, or holds an infinity elsewhere (float32 orders differ far less)."""
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(got[~finite], want[~finite]):
        return True
    scale = np.abs(want[finite]).max(initial=0.0)
    return bool((np.abs(got[finite] - want[finite]) > 1e-3 * scale).any())


def _assert_variant_bug_caught(runs, tmp_path, mutation):
    """The bug fails the stage it begins at, in exactly the heads it changes there, named first by
    its code; the other stages it writes wrong on their own fail in the heads it changes; the
    stages downstream of them are computed right from their input (inherited, or failing the checks
    that need no input: weights not 0 where the mask hides them), some inherited; every other stage
    passes, the binary's flash stages included."""
    name, bug, by, stage, code, also = mutation
    run = VariantRun(runs[name], tmp_path)
    changed = run.plant_program(bug, by)
    report = run.check(tmp_path)
    assert report["exit_code"] == 1, report["output"]
    assert report["first_failing_stage"] == stage, report["output"]
    own = (stage,) + also
    for s in own:
        failing = [e for e in _results(report, s) if e["status"] == "FAIL"]
        assert sorted(e["head"] for e in failing) == changed[s], (s, changed)
    firsts = {e["head"]: [(d["code"], d["message"]) for d in e["diagnosis"]][:1]
              for e in _results(report, stage) if e["status"] == "FAIL"}
    assert all(f and f[0][0] == code for f in firsts.values()), firsts
    after = {d for s in own for d in downstream(s)} - set(own)
    for e in report["results"]:
        if e["stage"] in after and not e["passed"]:
            assert e["isolated"]["passed"], (e["stage"], e["head"], e["status"], e["diagnosis"])
        elif e["stage"] not in own:
            assert e["passed"], (e["stage"], e["head"], e["status"], e["violations"], e["diagnosis"])
    inherited = [e for e in report["results"] if e["status"] == "INHERITED"]
    assert inherited or not [s for s in after if run.has(s)], "nothing downstream inherited"


@pytest.mark.parametrize("name", list(VARIANT_MUTATIONS))
def test_a_variant_bug_is_caught_localized_and_named(variant_runs, tmp_path, name):
    _assert_variant_bug_caught(variant_runs, tmp_path, VARIANT_MUTATIONS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANT_MUTATIONS))
def test_a_variant_bug_is_caught_at_half_precision(bf16_variant_runs, tmp_path, name):
    """The same bugs planted into bf16 runs (the inputs as the run rounded them, its bounds bf16's;
    slow: the fp32 ones run by default). A bf16 width is 0.4-1% of the stage's largest value, more
    than some of these bugs change (ALiBi's bias at small slopes, dropout's factor 1 − p, a K/V
    group's sum against one part); their candidates, computed as the bug would from the program's
    own files, reproduce got far more closely than that, which names them (verify/diagnose/base.py
    explains_closely)."""
    _assert_variant_bug_caught(bf16_variant_runs, tmp_path, VARIANT_MUTATIONS[name])


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_correct_program_planted_into_a_variant_run_passes(request, tmp_path, precision):
    """The mechanism without a bug: each run the bugs are planted into (the binary's, the correct
    program's stage path in place of its own) passes with no diagnosis."""
    runs = request.getfixturevalue("variant_runs" if precision == "fp32" else "bf16_variant_runs")
    for name in VARIANT_CASES:
        report = VariantRun(runs[name], tmp_path / name).check(tmp_path / name)
        assert report["exit_code"] == 0, (name, report["output"])
        assert not [(e["stage"], e["head"]) for e in report["results"] if e["diagnosis"]], name


WRONG_ELEMENT = (5, 7)


def test_one_wrong_element_in_each_gradient_is_found_where_it_is(cases, tmp_path):
    """No gradient is computed from another: one element off in each fails each, at that element,
    and the checks name nothing they did not find."""
    case = Case(cases["backward-tiles"], tmp_path)
    gradients = [s for s in BACKWARD_STAGES if not downstream(s)]
    for stage in gradients:
        x = case.load(stage, HEAD)
        x[WRONG_ELEMENT] += 1e-4 * np.abs(x).max()  # a hundred times float32's rounding, and more
        case.plant(stage, HEAD, x)
    report = case.check(tmp_path)
    assert report["exit_code"] == 1 and report["first_failing_stage"] == gradients[0], report["output"]
    for entry in report["results"]:
        if entry["head"] != HEAD or entry["stage"] not in gradients:
            assert entry["passed"], (entry["stage"], entry["head"], entry["violations"])
            continue
        assert entry["status"] == "FAIL", entry["stage"]
        worst = entry["isolated"]["worst"]
        assert (worst["row"], worst["col"]) == WRONG_ELEMENT and entry["isolated"]["mismatched"] == 1, entry["stage"]
        assert {d["code"] for d in entry["diagnosis"]} <= {v["code"] for v in entry["violations"]}, entry["stage"]


def test_stale_file_from_an_earlier_run(cases, tmp_path):
    """A file left by another run (its CRC differs from run.toml) is `stale`, not a numeric bug."""
    case = Case(cases["rect"], tmp_path)
    earlier = case.load("attention_weights", HEAD)
    earlier[0, 0] += 1e-3
    case.write("attention_weights", HEAD, earlier, update_crc=False)
    report = case.check(tmp_path)
    assert report["exit_code"] == 1
    assert report["first_failing_stage"] == "attention_weights"
    planted = _results(report, "attention_weights", HEAD)[0]
    assert planted["status"] == "STALE"
    assert "stale" in [d["code"] for d in planted["diagnosis"]]


def test_the_scale_factor_is_reported(cases, tmp_path):
    case = Case(cases["rect"], tmp_path)
    case.plant("QK_scaled", HEAD, case.load("QK_scaled", HEAD) * case.scale)
    report = case.check(tmp_path)
    d = next(d for d in _results(report, "QK_scaled", HEAD)[0]["diagnosis"] if d["code"] == "scaled")
    assert abs(d["detail"]["factor"] - case.scale) < 1e-3 * case.scale
    assert any("twice" in n for n in d["detail"]["names"])


FALSE_ALARM = [(N, M, d, dist, causal, seed)
               for seed, (N, M, d) in enumerate([(1, 1, 16), (7, 33, 16), (64, 64, 64), (100, 37, 32),
                                                 (33, 129, 128), (128, 96, 16), (65, 65, 32), (3, 200, 64),
                                                 (96, 17, 48), (50, 50, 16)])
               for dist in ("uniform", "normal", "large") for causal in (False, True)]


@pytest.mark.parametrize("N,M,d,dist,causal,seed", FALSE_ALARM,
                         ids=[f"N{c[0]}-M{c[1]}-d{c[2]}-{c[3]}-{'causal' if c[4] else 'full'}" for c in FALSE_ALARM])
def test_no_false_alarm_on_correct_cpu_runs(binary, tmp_path, N, M, d, dist, causal, seed):
    r = invoke("generate", "--out", tmp_path / "in", "--heads", 2, "--seq-q", N, "--seq-k", M,
                "--d-k", d, "--d-v", d, "--dist", dist, "--seed", 100 + seed,
                "--causal" if causal else "--no-causal")
    assert r.exit_code == 0, r.output
    subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                    "--backend", "cpu"], check=True, capture_output=True)
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output  # 60 cases x 2 heads x 10 stages: zero false failures


def test_parallel_check_reports_exactly_what_one_process_does(cases, tmp_path):
    """Heads checked by worker processes (--jobs) give the report of a sequential check, failure,
    diagnosis (head_permuted compares with other heads' references) and inheritance included."""
    case = Case(cases["rect"], tmp_path)
    case.plant("QK", HEAD, case.load("QK", 0))  # head 1's QK is head 0's
    reports = {}
    for jobs in (1, 3):
        path = tmp_path / f"report_{jobs}.json"
        r = invoke("check", "--in", case.input, "--out", case.out, "--json", path, "--jobs", jobs)
        assert r.exit_code == 1, r.output
        reports[jobs] = json.loads(path.read_text())
    assert reports[3] == reports[1]
    planted = _results(reports[3], "QK", HEAD)[0]
    assert "head_permuted" in [d["code"] for d in planted["diagnosis"]]
    assert _results(reports[3], "QK_scaled", HEAD)[0]["status"] == "INHERITED"


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_head_jobs_follow_the_request_the_size_and_the_memory(monkeypatch):
    from verify.check import compare, pool
    from verify.stages import Dims

    def run(heads, n, d=64):
        return compare.RunInfo(Path("."), {}, Dims(1, heads, n, n, d, d), {})

    monkeypatch.setattr(pool, "_usable_cores", lambda: 16)
    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: 64 << 30)
    assert compare.head_jobs(run(1, 4096)) == 1            # one head: nothing to share out
    assert compare.head_jobs(run(12, 16)) == 1             # small: a pool costs more than it saves
    assert compare.head_jobs(run(12, 16), requested=4) == 4
    assert compare.head_jobs(run(3, 16), requested=8) == 3  # never more workers than heads
    assert compare.head_jobs(run(12, 128)) == 12           # the default case: a core a head
    # 16 heads of 4096²: ~5.3 GB a worker (its head and 8 cached references of other heads), half
    # of 64 GB available → 6 workers, not 16.
    assert compare.head_jobs(run(16, 4096)) == 6
    monkeypatch.setattr(pool, "_available_memory_bytes", lambda: None)
    assert compare.head_jobs(run(16, 4096)) == 16          # memory unknown: the cores decide


def _blas_threads(head):  # module level: the pool sends workers its function by name
    from verify.check import blas
    return [_openblas_threads(lib) for lib in blas._loaded_openblas()]


def _openblas_threads(lib):
    from verify.check.blas import _OPENBLAS_SET_THREADS
    return next(getattr(lib, n.replace("set", "get")) for n in _OPENBLAS_SET_THREADS if hasattr(lib, n))()


def _openblas_setters():
    """The loaded OpenBLAS libraries' thread-count setters (skips where numpy's BLAS is another)."""
    from verify.check import blas
    libs = blas._loaded_openblas()
    if not libs:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    return libs, [next(getattr(lib, n) for n in blas._OPENBLAS_SET_THREADS if hasattr(lib, n)) for lib in libs]


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_workers_use_one_blas_thread_each():
    """Each worker is one of as many processes as cores: BLAS threads of its own would compete
    with the other workers."""
    from verify.check import pool
    libs, setters = _openblas_setters()
    before = [_openblas_threads(lib) for lib in libs]
    for setter in setters:
        setter(2)  # what a forked worker would inherit on a machine of two or more cores
    try:
        assert pool.map_heads(_blas_threads, 2, 2) == [1] * len(libs) * 2
    finally:
        for setter, n in zip(setters, before):
            setter(n)


def test_a_heads_row_tiles_run_blas_on_one_thread_and_give_its_threads_back():
    """The row tiles' threads each call BLAS: within their block it runs on one thread of its own,
    and after it on as many as before."""
    from verify.check import blas
    libs, setters = _openblas_setters()
    before = [_openblas_threads(lib) for lib in libs]
    for setter in setters:
        setter(3)
    try:
        with blas.blas_on_one_thread():
            assert [_openblas_threads(lib) for lib in libs] == [1] * len(libs)
        assert [_openblas_threads(lib) for lib in libs] == [3] * len(libs)
    finally:
        for setter, n in zip(setters, before):
            setter(n)


def test_the_commands_head_takes_the_cores_for_its_row_tiles_but_not_under_a_profiler(monkeypatch):
    """One head checked in the command's own process: its row tiles on a thread a core it may use;
    under a profiler (which sees its own thread alone) on that thread."""
    from verify.check import pool
    from verify.model import tiles
    monkeypatch.setattr(pool, "_usable_cores", lambda: 3)
    with pool.tile_threads():
        assert tiles._WORKERS.get()[0] == 3
    sys.setprofile(lambda *args: None)
    try:
        with pool.tile_threads():
            assert tiles._WORKERS.get()[0] == 1
    finally:
        sys.setprofile(None)


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (<malloc.h>), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _large_block_on_the_heap(head):  # module level: the pool sends workers its function by name
    """Whether a 64 MB block (above glibc's largest threshold for using the heap) is a heap chunk,
    reused when freed, rather than a chunk of its own, mapped and unmapped (mallinfo2's hblkhd
    counts the bytes of those)."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    block = np.empty(8 << 20)
    own_chunks = mallinfo2().hblkhd
    del block
    return [own_chunks < (8 << 20) * 8]


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_workers_reuse_freed_memory():
    """A worker's large temporaries come from its heap, so a freed one is reused rather than
    returned to the OS and faulted in afresh, zeroed, for the next."""
    from verify.check import pool
    if not pool.keep_freed_memory(False):
        pytest.skip("the C library is not glibc")
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert pool.map_heads(_large_block_on_the_heap, 2, 2) == [True, True]
    assert pool.map_heads(_large_block_on_the_heap, 1, 1, tune_process=True) == [True]  # attnstep's own process
    assert pool.map_heads(_large_block_on_the_heap, 1, 1) == [False]  # a caller's (the Python API's): untouched
    assert _large_block_on_the_heap(0) == [False]                     # and only while checking


class _Cycle:
    def __init__(self):
        self.me = self  # freed only by the cyclic garbage collector


_CYCLES = []


def _leaves_a_cycle(head):
    alive = [ref() is not None for ref in _CYCLES]
    _CYCLES.append(weakref.ref(_Cycle()))
    return alive


def test_a_heads_garbage_is_freed_before_the_next_head(monkeypatch):
    """A head's matrices held in reference cycles are freed before the next head starts, not
    whenever the collector next runs (they raised the peak memory of a 4096² check by 0.4 GB)."""
    from verify.check import pool
    gc.disable()  # what would otherwise collect them is the collector's own timing
    try:
        _CYCLES.clear()
        assert pool.map_heads(_leaves_a_cycle, 3, 1) == [False, False, False]
        _CYCLES.clear()
        monkeypatch.setattr(pool, "_CHECK", _leaves_a_cycle)  # a worker's loop
        assert pool._check_in_worker(0) + pool._check_in_worker(1) == [False]
    finally:
        gc.enable()


def _die(head):  # module level: the pool sends workers its function by name
    os._exit(9)


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_dead_worker_is_a_one_line_error(cases, tmp_path, monkeypatch):
    """A worker killed mid-check (the kernel's OOM killer, say) ends in exit 2 and a hint, not a
    traceback or a partial report."""
    from verify.check import pool

    monkeypatch.setattr(pool, "_check_in_worker", _die)
    case = Case(cases["rect"], tmp_path)
    report = tmp_path / "report.json"
    r = invoke("check", "--in", case.input, "--out", case.out, "--json", report, "--jobs", 2)
    assert r.exit_code == 2, r.output
    assert "--jobs 1" in r.output and "Traceback" not in r.output
    assert not report.exists()


def test_container_limits_cap_the_workers(monkeypatch):
    """cgroup limits (docker, k8s) count, not only the host's free memory and cores."""
    from verify.check import sizing as compare

    fake = {("/sys/fs/cgroup/memory.max", 0): 4 << 30, ("/sys/fs/cgroup/memory.current", 0): 1 << 30,
            ("/sys/fs/cgroup/cpu.max", 0): 150000, ("/sys/fs/cgroup/cpu.max", 1): 100000}
    monkeypatch.setattr(compare, "_read_int", lambda path, field=0: fake.get((path, field)))
    assert compare._available_memory_bytes() <= 3 << 30   # 4 GB limit, 1 GB in use
    assert compare._usable_cores() <= 2                   # a quota of 1.5 CPUs
    fake.clear()                                          # no limits: the host decides
    assert compare._usable_cores() == len(os.sched_getaffinity(0))


_ORPHAN_SCRIPT = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from verify.check.pool import _die_with_parent

def report(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)

pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_die_with_parent)
pool.submit(report, sys.argv[1])
while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read():
    time.sleep(0.05)
os.kill(os.getpid(), 9)  # the checking process is killed outright
"""


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_workers_do_not_outlive_a_killed_check(tmp_path):
    pid_file = tmp_path / "worker.pid"
    subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT, str(pid_file)], timeout=60,
                   cwd=Path(__file__).resolve().parents[1])
    pid = int(pid_file.read_text())
    for _ in range(100):  # the worker gets SIGTERM as its parent dies
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail(f"worker {pid} outlived its killed parent")


def _slow_after_the_first(head: int) -> list:
    if head > 0:
        time.sleep(600)  # a head still being checked when the check is stopped
    return [head]


def _stop_after_the_first_head(head: int) -> None:
    raise KeyboardInterrupt  # (as Ctrl-C, or SIGTERM turned into an exception, would)


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_stopped_parallel_check_ends_its_workers_without_waiting_for_their_heads():
    """A check stopped while workers still check heads ends them and returns at once: it does not
    wait for each head begun (leaving the executor waits for them), which a signal's sender would
    take for a hang."""
    from helpers.cli import time_limit
    from verify.check import pool
    before = set(multiprocessing_children())
    with time_limit(120, "the stopped check"), pytest.raises(KeyboardInterrupt):
        pool.map_heads(_slow_after_the_first, 3, 2, progress=_stop_after_the_first_head)
    # Gone within seconds (on a loaded machine an ended worker can take a moment to be reaped),
    # where a worker left checking its head would live on for its 600 s.
    deadline = time.monotonic() + 15
    while not set(multiprocessing_children()) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(multiprocessing_children()) <= before


def multiprocessing_children() -> list:
    import multiprocessing
    return [p.pid for p in multiprocessing.active_children()]

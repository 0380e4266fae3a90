"""The binary and the verifier read a case folder alike (docs/contract.md): each case here is run by
the binary (CPU backend) and checked by `attnstep check` on the same folder, with the same variant
options; both refuse it, in the same words after each reader's own way of naming the place (the
binary adds the manifest's line and column), or both accept it (the check then passes the
binary's run).

The rules: kv_heads 1..heads and a divisor of heads (0 refused); an ALiBi slopes file where the
run has no ALiBi refused, ALiBi as the command line, else the manifest (else, for the check,
run.toml) says; a softcap finite and 0 or normal as a float32, a dropout below 1 and 0 or
positive as a float32; each value named by
its manifest key (window_left, window_right).
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.variant_cases import GqaCase, write_gqa_case, write_slopes
from helpers.variants import write_heads
from verify.stages import OUTPUT, Dims
from verify.variant import alibi_slopes

CASE = GqaCase(Dims(batch=1, heads=2, seq_q=5, seq_k=7, d_k=16, d_v=16))
NO_MANIFEST = None
SLOPES = "exists but the run has no ALiBi (its slopes would be unused)"
TURN_ON = "turn ALiBi on to use them (alibi = true in manifest.toml, or --alibi), or remove the file"
CAUSAL_WINDOW = "a causal mask sees no key right of the diagonal (use 0 or -1) (causal from "


# (id, manifest lines (NO_MANIFEST: none), slopes file, the binary's options, check's options, the
# words both must say, each with {case} for the case folder; () when both accept the case).
CASES: List[Tuple[str, Optional[str], bool, list, list, tuple]] = [
    ("kv_heads-0", "kv_heads = 0", False, [], [],
     ("{case}/manifest.toml", "kv_heads = 0: must be 1..heads and divide heads = 2 (each K/V head serves heads / "
      "kv_heads query heads)", "use a divisor of heads: 1 (one K/V head for all), ..., heads (one each)")),
    ("kv_heads-3", "kv_heads = 3", False, [], [], ("kv_heads = 3: must be 1..heads and divide heads = 2",)),
    ("kv_heads-all", "kv_heads = 2", False, [], [], ()),
    ("softcap-beyond-float32", "softcap = 1e39", False, [], [],
     ("{case}/manifest.toml", "softcap = 1e+39: must be a finite number > 0 (0: none)")),
    ("dropout-rounds-to-1", "dropout = 0.99999999999", False, [], [],
     ("{case}/manifest.toml", "dropout = 0.99999999999: must be a probability in [0, 1), below 1 as a float32 "
      "(it rounds to 1)")),
    ("softcap-0-as-float32", "softcap = 1e-46", False, [], [],
     ("{case}/manifest.toml", "softcap = 1e-46: must be 0 (none) or a positive float32 (at least 1.18e-38)")),
    ("softcap-subnormal", "softcap = 1e-40", False, [], [],
     ("{case}/manifest.toml", "softcap = 1e-40: must be 0 (none) or a positive float32 (at least 1.18e-38)")),
    ("softcap-smallest-normal", "softcap = 1.2e-38", False, [], [], ()),
    ("dropout-0-as-float32", "dropout = 1e-46", False, [], [],
     ("{case}/manifest.toml", "dropout = 1e-46: must be 0 (none) or a positive float32 (at least 1.4e-45)")),
    ("window_left", "window_left = -2", False, [], [],
     ("{case}/manifest.toml", "window_left = -2: must be -1 (unbounded) or a number of keys from 0 to 2147483647")),
    ("causal-window_right", "causal = true\nwindow_right = 3", False, [], [],
     ("{case}/manifest.toml", "window_right = 3: " + CAUSAL_WINDOW)),
    ("causal-option-window", "causal = true", False, ["--window", "1,4"], ["--window", "1,4"],
     ("window_right = 4: " + CAUSAL_WINDOW + "{case}/manifest.toml",)),
    ("window-option", "", False, ["--window", "-2,1"], ["--window", "-2,1"],
     ("'-2,1': window_left = -2: must be -1 (unbounded) or a number of keys from 0 to 2147483647",)),
    # Past a 32-bit count of keys (diag ± bound would wrap around near 2^63).
    ("window_right-too-wide", "window_right = 2147483648", False, [], [],
     ("{case}/manifest.toml",
      "window_right = 2147483648: must be -1 (unbounded) or a number of keys from 0 to 2147483647")),
    ("window-option-too-wide", "", False, ["--window", "2147483648,0"], ["--window", "2147483648,0"],
     ("'2147483648,0': window_left = 2147483648: must be -1 (unbounded) or a number of keys from 0 to 2147483647",)),
    ("softcap-option", "", False, ["--softcap", "1e39"], ["--softcap", "1e39"],
     ("'1e39': must be a finite number > 0 (0: none)",)),
    ("dropout-option", "", False, ["--dropout", "0.99999999999"], ["--dropout", "0.99999999999"],
     ("'0.99999999999': must be a probability in [0, 1), below 1 as a float32 (it rounds to 1)",)),
    ("softcap-option-0-as-float32", "", False, ["--softcap", "1e-46"], ["--softcap", "1e-46"],
     ("'1e-46': must be 0 (none) or a positive float32 (at least 1.18e-38)",)),
    ("slopes-manifest-without-alibi", "", True, [], [], ("{case}/alibi_slopes.txt: " + SLOPES, TURN_ON)),
    ("slopes-manifest-alibi", "alibi = true", True, [], [], ()),
    ("slopes-manifest-and-option", "", True, ["--alibi"], ["--alibi"], ()),
    ("slopes-no-manifest", NO_MANIFEST, True, [], [], ("{case}/alibi_slopes.txt: " + SLOPES, TURN_ON)),
    ("slopes-no-manifest-option", NO_MANIFEST, True, ["--alibi"], ["--alibi"], ()),
    # The check without --alibi: run.toml records the binary's --alibi.
    ("slopes-no-manifest-run-toml", NO_MANIFEST, True, ["--alibi"], [], ()),
]


def write_case(folder: Path, manifest: Optional[str], slopes: bool) -> Path:
    write_gqa_case(folder, CASE, manifest=manifest is not NO_MANIFEST)
    if manifest:
        with open(folder / "manifest.toml", "a") as f:
            f.write(manifest + "\n")
    if slopes:
        write_slopes(folder, alibi_slopes(CASE.dims.heads)[::-1], "txt")
    return folder


def run_binary(binary: Path, case: Path, out: Path, options: list) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", *options],
                          capture_output=True, text=True, timeout=300)


def stand_in_output(folder: Path) -> Path:
    """A program's output without run.toml, for the check of a case the binary refused: its refusal
    must come from the case, whatever the output holds."""
    d = CASE.dims
    return write_heads(folder, {OUTPUT: [np.zeros((d.seq_q, d.d_v))] * d.total_heads})


@pytest.mark.parametrize("manifest, slopes, binary_options, check_options, words",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_binary_and_the_check_refuse_and_accept_the_same_cases(binary, tmp_path, manifest, slopes,
                                                                    binary_options, check_options, words):
    case = write_case(tmp_path / "case", manifest, slopes)
    out = tmp_path / "out"
    ran = run_binary(binary, case, out, binary_options)
    checked = invoke("check", "--in", case, "--out", out if ran.returncode == 0 else stand_in_output(out),
                     *check_options)
    if not words:
        assert ran.returncode == 0, ran.stderr
        assert checked.exit_code == 0, checked.output
        return
    assert ran.returncode == 2 and "main: error: " in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
    assert checked.exit_code == 2 and "Traceback" not in checked.output, checked.output
    for w in (w.format(case=case) for w in words):
        assert w in ran.stderr, (w, ran.stderr)
        assert w in checked.output, (w, checked.output)


def test_a_window_past_64_bits_is_one_line_from_check_and_generate(binary, tmp_path):
    """A window side too large for any integer the readers hold: one line naming the side and its
    range from `check --window` and `generate --window`, and generate writes nothing."""
    case = write_case(tmp_path / "case", "", False)
    assert run_binary(binary, case, tmp_path / "out", []).returncode == 0
    words = ("'99999999999999999999,0': window_left = 99999999999999999999: must be -1 (unbounded) or a number "
             "of keys from 0 to 2147483647")
    checked = invoke("check", "--in", case, "--out", tmp_path / "out", "--window", "99999999999999999999,0")
    made = invoke("generate", "--out", tmp_path / "new", "--heads", "2", "--seq-q", "4", "--seq-k", "4", "--d-k", "4",
                  "--d-v", "4", "--window", "99999999999999999999,0")
    for result in (checked, made):
        assert result.exit_code == 2 and "Traceback" not in result.output and words in result.output, result.output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("name, value, words", [
    ("mask", 0.5, ("{file}:4:5: 0.5 in a mask (1 such value)",
                   "a mask holds 0 (hidden) or 1 (visible) only; additive values go in a bias file")),
    ("mask", np.nan, ("{file}:4:5: nan in a mask (1 such value)",)),
    ("bias", np.inf, ("{file}:4:5: inf in a bias (1 such value)",
                      "a bias holds finite values or -inf (which hides the entry), never +inf or NaN")),
])
def test_the_binary_and_the_check_name_a_bad_mask_or_bias_value_alike(binary, tmp_path, name, value, words):
    """A mask or bias file's bad value: the same words from both readers, at file:line:col (its line,
    the comment counted; its value, 1-based), with the count of such values and the rule."""
    case = write_case(tmp_path / "case", f'{name} = "per-head"', False)
    d = CASE.dims
    for head in range(d.total_heads):
        values = np.ones((d.seq_q, d.seq_k)) if name == "mask" else np.zeros((d.seq_q, d.seq_k))
        if head == 1:
            values[2, 4] = value
        np.savetxt(case / f"{name}_head_{head}.txt", values, fmt="%.9g", header="a comment line first")
    ran = run_binary(binary, case, tmp_path / "out", [])
    checked = invoke("check", "--in", case, "--out", stand_in_output(tmp_path / "stand_in"))
    assert ran.returncode == 2 and checked.exit_code == 2, (ran.stderr, checked.output)
    for w in (w.format(file=case / f"{name}_head_1.txt") for w in words):
        assert w in ran.stderr, (w, ran.stderr)
        assert w in checked.output, (w, checked.output)

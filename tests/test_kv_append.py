"""A decode step that appends new keys (docs/contract.md, "New keys: a decode step"), end to end:
`attnstep generate --new-keys` writes the case, the binary (CPU backend) writes the new keys into
the cache before attention and echoes the cache after the step as K and V, and `attnstep check`
checks attention over the appended keys and the cache exactly. Another program's folder (the NumPy
program of tests/helpers/kv_append_programs.py: %g text, no run.toml, any subset of stages) checks
the same way, and each planted bug fails with its name: new keys written one slot late, to the
wrong page, not written, an old entry clobbered, attention that does not see them."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.kv_append_programs import run_program
from verify.check.new_keys import _KeyScan, _as_is, _equal
from verify.files.case import InputCase
from verify.model.half import echoed, round_to_format
from verify.stages import INPUT_MANIFEST, Dims

HEADS, KV_HEADS, D = 4, 2, 16
# Three sequences of 2, 1, 3 queries; paged: pages of 4, keys 9, 4, 7 after the step (3 pages a row);
# packed: slots of 6, 4, 8 keys, 4, 3, 5 of them after the step.
PAGED = ["--seqlens", "2,1,3", "--seqlens-k", "9,4,7", "--page-size", "4"]
PACKED = ["--seqlens", "2,1,3", "--seqlens-k", "6,4,8", "--seqused-k", "4,3,5"]
NEW = 2


def generate(folder: Path, layout, fmt: str = "txt", *extra) -> Path:
    r = invoke("generate", "--out", folder, "--heads", HEADS, "--kv-heads", KV_HEADS, "--d-k", D, "--d-v", D,
               "--format", fmt, *layout, "--new-keys", NEW, *extra)
    assert r.exit_code == 0, r.output
    return folder


def check(case: Path, out: Path, *options):
    """`attnstep check`: (exit code, output, {stage: [diagnosis codes of its failing results]}): those
    that fail on their own or inherit an upstream stage's error (the output computed from a cache
    the program wrote wrong is right for that cache: it inherits K's error, and carries its name)."""
    report = out.parent / f"{out.name}.json"
    r = invoke("check", "--in", case, "--out", out, "--json", report, *options)
    codes = {}
    for res in json.loads(report.read_text())["results"]:
        if res["status"] in ("FAIL", "INHERITED"):
            codes.setdefault(res["stage"], []).extend(d["code"] for d in res["diagnosis"])
    return r.exit_code, r.output, codes


# ----------------------------------------------------------------------------------------------
# The generator.

def test_generate_writes_the_cache_before_the_step_and_the_new_keys(tmp_path):
    case = generate(tmp_path / "case", PAGED)
    assert "new_keys = 2" in (case / INPUT_MANIFEST).read_text()
    assert np.loadtxt(case / "seqused_k.txt", dtype=int).tolist() == [7, 2, 5]  # the cache before the step
    for j in range(KV_HEADS):
        for name in ("K_new", "V_new"):
            assert np.loadtxt(case / f"{name}_head_{j}.txt").shape == (3 * NEW, D)


@pytest.mark.parametrize("args, words", [
    (["--new-keys", 2], "--new-keys 2 needs --seqlens or --random-seqlens"),
    (PACKED + ["--new-keys", 2, "--backward"], "the backward pass is not supported with new keys"),
    (PACKED + ["--new-keys", 4], "--new-keys 4: sequence 1 attends to 3 keys, fewer than its 4 new keys "
                                 "(--seqused-k)"),
    (PAGED + ["--new-keys", 5], "--new-keys 5: sequence 1 attends to 4 keys, fewer than its 5 new keys (--seqlens-k)"),
    # random lengths (seed 0 draws 1, 3, 2): a hint that can be followed
    (["--random-seqlens", "3,4", "--seed", 0, "--new-keys", 2],
     "--new-keys 2: sequence 0 attends to 1 key, fewer than its 2 new keys (--random-seqlens 3,4); HINT: give the "
     "lengths with --seqlens and --seqlens-k (at least 2 keys each), or a larger MAX or another --seed"),
])
def test_generate_refuses_a_step_that_cannot_be_in_one_line(tmp_path, args, words):
    r = invoke("generate", "--out", tmp_path / "case", "--heads", 2, "--d-k", 8, "--d-v", 8, *args)
    assert r.exit_code == 2 and words in r.output and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "case").exists()


# ----------------------------------------------------------------------------------------------
# The binary.

@pytest.mark.parametrize("layout, fmt", [(PAGED, "txt"), (PACKED, "npy")], ids=["paged-txt", "packed-npy"])
def test_the_binary_appends_the_new_keys_and_its_run_passes(binary, tmp_path, layout, fmt):
    case = generate(tmp_path / "case", layout, fmt, "--causal", "--align", "bottom-right")
    out = tmp_path / "out"
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    load = (lambda p: np.load(p)) if fmt == "npy" else (lambda p: np.loadtxt(p, ndmin=2))
    before, after = load(case / f"K_head_1.{fmt}"), load(out / f"K_head_1.{fmt}")
    new = load(case / f"K_new_head_1.{fmt}")
    changed = np.flatnonzero((before != after).any(axis=1))
    assert len(changed) == 3 * NEW and np.isin(after[changed], new).all()
    code, output, codes = check(case, out)
    assert code == 0 and not codes, output


def test_the_binary_s_cache_written_wrong_is_caught(binary, tmp_path):
    """The binary's K file with one new key moved a slot: the check fails K with cache_write_offset."""
    case = generate(tmp_path / "case", PAGED)
    out = tmp_path / "out"
    assert subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", "--stages",
                           "K,output"], capture_output=True, timeout=300).returncode == 0
    (out / "run.toml").unlink()  # (its CRC table would call the edited file stale)
    planted = run_program(case, tmp_path / "planted", "one_late", stages=("K",))
    (out / "K_head_0.txt").write_bytes((planted / "K_head_0.txt").read_bytes())
    code, output, codes = check(case, out)
    assert code == 1 and set(codes) == {"K"} and codes["K"][0] == "cache_write_offset", output
    assert "cache_clobbered" not in codes["K"], output


# ----------------------------------------------------------------------------------------------
# Another program's folder.

@pytest.mark.parametrize("layout", [PAGED, PACKED], ids=["paged", "packed"])
@pytest.mark.parametrize("stages", [("output", "flash_output", "flash_lse", "K", "V"), ("flash_lse",), ("V",)])
def test_a_correct_foreign_program_passes_with_any_subset_of_stages(tmp_path, layout, stages):
    case = generate(tmp_path / "case", layout)
    out = run_program(case, tmp_path / "out", fmt="%g", stages=stages)
    code, output, codes = check(case, out)
    assert code == 0 and not codes, output
    assert all(s in output for s in stages)


# (bug, layout, the diagnoses K's failing results carry first, those output's carry first)
BUGS = [
    ("one_late", PAGED, "cache_write_offset", "cache_write_offset"),
    ("one_late", PACKED, "cache_write_offset", "cache_write_offset"),
    ("wrong_page", PAGED, "cache_write_page", None),
    ("not_written", PAGED, "cache_not_written", "new_keys_unseen"),
    ("not_written", PACKED, "cache_not_written", "new_keys_unseen"),
    ("clobber", PACKED, "cache_clobbered", None),
    ("unseen", PAGED, None, "new_keys_unseen"),
    ("stale", PACKED, None, "new_keys_unseen"),
]


@pytest.mark.parametrize("bug, layout, k_code, output_code", BUGS,
                         ids=[f"{b[0]}-{'paged' if b[1] is PAGED else 'packed'}" for b in BUGS])
def test_a_planted_bug_fails_with_its_name(tmp_path, bug, layout, k_code, output_code):
    case = generate(tmp_path / "case", layout)
    out = run_program(case, tmp_path / "out", bug, fmt="%g")
    code, output, codes = check(case, out)
    assert code == 1, output
    if k_code is None:
        assert "K" not in codes and "V" not in codes, codes
    else:
        assert codes["K"][0] == k_code and codes["V"][0] == k_code, codes
        assert k_code in output
    if output_code is not None:  # (flash_lse fails too, or is INHERITED where K, its upstream, fails)
        assert codes["output"][0] == output_code, codes


def test_a_wrong_page_names_the_page_written_and_the_page_meant(tmp_path):
    case = generate(tmp_path / "case", PAGED)
    out = run_program(case, tmp_path / "out", "wrong_page", stages=("K",))
    report = tmp_path / "report.json"
    invoke("check", "--in", case, "--out", out, "--json", report)
    found = [d for r in json.loads(report.read_text())["results"] for d in r["diagnosis"]
             if d["code"] == "cache_write_page"]
    assert found and "instead of page" in found[0]["message"], found
    assert found[0]["detail"]["row"] // 4 != found[0]["detail"]["expected_row"] // 4


def test_attention_that_does_not_see_the_new_keys_is_caught_without_the_cache_stages(tmp_path):
    """A program that writes only its output: the check still reads the new keys (a check that
    ignored them would pass it), and names the reading."""
    case = generate(tmp_path / "case", PAGED)
    out = run_program(case, tmp_path / "out", "unseen", stages=("output",))
    code, output, codes = check(case, out)
    assert code == 1 and set(codes) == {"output"} and codes["output"][0] == "new_keys_unseen", output


def test_a_half_precision_cache_not_written_is_named_so(tmp_path):
    """A bf16 program echoes the cache rounded to bf16: its new keys' slots still holding the cache
    before the step (rounded) are cache_not_written, and the rest (rounded too) no clobbering."""
    case = generate(tmp_path / "case", PAGED)
    out = run_program(case, tmp_path / "out", "not_written", stages=("K", "V"))
    for j in range(KV_HEADS):
        for name in ("K", "V"):
            path = out / f"{name}_head_{j}.txt"
            np.savetxt(path, round_to_format(np.loadtxt(path, ndmin=2), "bf16"), fmt="%.9g")
    code, output, codes = check(case, out, "--precision", "bf16")
    assert code == 1 and codes["K"][0] == "cache_not_written" and codes["V"][0] == "cache_not_written", codes
    assert "cache_clobbered" not in codes["K"] + codes["V"], codes


# ----------------------------------------------------------------------------------------------
# The classifier's comparisons.

def test_equal_infinities_agree_and_nan_agrees_with_nan():
    a = np.array([[np.inf, -np.inf, np.nan, 1.0]])
    assert _equal(a, a.copy(), 0.0).all()
    assert not _equal(a, np.array([[np.inf, np.inf, np.nan, 1.0]]), 0.0).any()
    assert not _equal(a, np.array([[np.inf, -np.inf, 0.0, 1.0]]), 0.0).any()


@pytest.mark.parametrize("echo", [_as_is, lambda g, w: echoed(g, w, "bf16")], ids=["as-read", "bf16"])
def test_the_key_scan_finds_what_a_scan_of_every_row_finds(echo):
    """The sorted first column finds exactly the rows a comparison with every row finds (within
    each row's allowed, NaN and infinities included, keys as read or rounded)."""
    rng = np.random.default_rng(3)
    got = np.round(rng.normal(size=(200, 4)), 1)
    got[::17, 0], got[5::23, 0], got[7::29, 1] = np.nan, np.inf, -np.inf
    big = 1000 * got[20:30] + 0.3  # (bf16 rounds these by more than the allowed 0.05)
    got[100:110] = round_to_format(big, "bf16") if echo is not _as_is else big
    allowed = np.full(got.shape, 0.05)
    scan = _KeyScan(got, allowed, echo)
    keys = np.concatenate([got[:20], got[:20] + 0.03, big, rng.normal(size=(5, 4))])
    for key in keys:
        every = [h for h in range(len(got)) if _equal(got[h][None], echo(got[h][None], key[None]), allowed[h][None])[0]]
        assert scan.hits(key) == every


def test_an_array_case_s_cache_before_the_step_is_its_array(tmp_path):
    """An array case (the Python API's) reads no file for the cache before the step."""
    k = np.arange(12.0).reshape(1, 3, 4)
    case = InputCase(tmp_path / "no-such-folder", Dims(1, 1, 2, 3, 4, 4), "npy", arrays={"K": k})
    got = case.load_before("K", 0)
    assert np.shares_memory(got, k) and np.array_equal(got, k[0])

"""The binary's side of the attention variants, run as a subprocess on the CPU backend
(docs/contract.md): the manifest's variant keys and kv_heads with their rules, the command line's
variant options, run.toml's record of them, grouped K/V heads (K/V files per K/V head, the K/V
stages written per K/V head, dK and dV summed over the group, head groups that split a K/V group),
and the mask, bias and slopes files (declared and missing, present and undeclared, values they
cannot hold): every rejection one `main: error:` line, exit 2, before the output folder is touched.

What the backend computes from a variant (masks, softcap, ALiBi, dropout) is the CPU backend's
tests' business; here grouped heads are checked against the same case expanded to one K/V head
per query head, which the backend computes as ordinary attention.
"""
from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest

from verify.stages import (DROPOUT_MASK, FORMATS, KEYS, KV_HEADS_KEY, KV_STAGES, RUN_MANIFEST, STAGE_NAMES, STAGES, Dims,
                           stage_file)
from verify.variant import VARIANT_KEYS, Variant, alibi_slopes

from helpers.matrix_files import load, save
from helpers.variant_cases import (GqaCase, expand_to_mha, tensor_file, write_bias, write_gqa_case, write_mask,
                                   write_slopes)

GQA = GqaCase(Dims(batch=2, heads=6, seq_q=37, seq_k=53, d_k=16, d_v=16, kv_heads=2))
SMALL = GqaCase(Dims(batch=1, heads=2, seq_q=5, seq_k=7, d_k=16, d_v=16))


def run_cpu(binary, in_dir, out_dir, *extra):
    return subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                           *map(str, extra)], capture_output=True, text=True, timeout=300)


def error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("main: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def refused(binary, in_dir, out_dir, *extra) -> str:
    """The one error line of a run that must fail before touching the output folder."""
    line = error_line(run_cpu(binary, in_dir, out_dir, *extra))
    assert not Path(out_dir).exists(), "a refused run created the output folder"
    return line


def run_toml(out_dir: Path) -> dict:
    return tomllib.loads((out_dir / RUN_MANIFEST).read_text())


def small_case(tmp_path: Path, extra: str = "") -> Path:
    in_dir = tmp_path / "in"
    write_gqa_case(in_dir, SMALL)
    with open(in_dir / "manifest.toml", "a") as f:
        f.write(extra)
    return in_dir


def manifest_value(v: Variant, key: str):
    """A Variant's value under its manifest key (the window is two keys)."""
    return {"window_left": v.window[0], "window_right": v.window[1]}.get(key, getattr(v, key, None))


# ------------------------------------------------------------------ run.toml records the variant
def test_run_toml_records_the_defaults(binary, tmp_path):
    out = tmp_path / "out"
    assert run_cpu(binary, small_case(tmp_path), out).returncode == 0
    rec = run_toml(out)
    assert rec[KV_HEADS_KEY] == SMALL.dims.heads
    for key, kind in VARIANT_KEYS.items():
        assert type(rec[key]) is kind and rec[key] == manifest_value(Variant(), key), key


MANIFEST_VARIANT = {"align": "bottom-right", "window_left": 3, "window_right": 0, "softcap": 20.0, "alibi": True,
                    "dropout": 0.25, "dropout_seed": 7}


def toml_line(key, value) -> str:
    text = f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key} = {text}\n"


def test_manifest_variant_keys_reach_run_toml(binary, tmp_path):
    extra = "".join(toml_line(k, v) for k, v in MANIFEST_VARIANT.items())
    out = tmp_path / "out"
    proc = run_cpu(binary, small_case(tmp_path, extra), out)
    assert proc.returncode == 0, proc.stderr
    rec = run_toml(out)
    for key, value in MANIFEST_VARIANT.items():
        assert rec[key] == value, key


OPTIONS = [(["--align", "bottom-right"], {"align": "bottom-right"}),
           (["--window", "4,2"], {"window_left": 4, "window_right": 2}),
           (["--window", "-1,0"], {"window_left": -1, "window_right": 0}),
           (["--softcap", "30"], {"softcap": 30.0}),
           (["--alibi"], {"alibi": True}),
           (["--dropout", "0.125"], {"dropout": 0.125}),
           (["--dropout", "0.25", "--dropout-seed", "12345"], {"dropout": 0.25, "dropout_seed": 12345}),
           (["--causal", "--align=bottom-right", "--window", "5,0"],
            {"causal": True, "align": "bottom-right", "window_left": 5, "window_right": 0})]


@pytest.mark.parametrize("args, expect", OPTIONS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_options_reach_run_toml(binary, tmp_path, args, expect):
    out = tmp_path / "out"
    proc = run_cpu(binary, small_case(tmp_path), out, *args)
    assert proc.returncode == 0, proc.stderr
    rec = run_toml(out)
    for key, value in expect.items():
        assert rec[key] == value, key


def test_options_override_the_manifest(binary, tmp_path):
    extra = 'align = "bottom-right"\nwindow_left = 2\nwindow_right = 2\nsoftcap = 5.0\ndropout = 0.5\ndropout_seed = 3\n'
    out = tmp_path / "out"
    proc = run_cpu(binary, small_case(tmp_path, extra), out, "--align", "top-left", "--window", "-1,-1",
                   "--softcap", "0", "--dropout", "0", "--dropout-seed", "9")
    assert proc.returncode == 0, proc.stderr
    rec = run_toml(out)
    assert (rec["align"], rec["window_left"], rec["window_right"], rec["softcap"], rec["dropout"],
            rec["dropout_seed"]) == ("top-left", -1, -1, 0.0, 0.0, 9)


def test_dropout_seed_alone_reseeds_the_cases_dropout(binary, tmp_path):
    out = tmp_path / "out"
    proc = run_cpu(binary, small_case(tmp_path, "dropout = 0.5\ndropout_seed = 3\n"), out, "--dropout-seed", "9")
    assert proc.returncode == 0, proc.stderr
    rec = run_toml(out)
    assert (rec["dropout"], rec["dropout_seed"]) == (0.5, 9)


def test_help_names_every_option(binary):
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    for opt in ("--align", "--window", "--softcap", "--alibi", "--dropout", "--dropout-seed"):
        assert opt in text, opt


# ------------------------------------------------------------------ the rules, each a one-line error
# (key, value as written in the manifest, words of the message).
MANIFEST_ERRORS = [
    ("align", '"diagonal"', "align = 'diagonal': must be top-left or bottom-right"),
    ("window_left", "-2", "window_left = -2: must be -1 (unbounded) or a number of keys from 0 to 2147483647"),
    ("window_right", "-7", "window_right = -7: must be -1 (unbounded)"),
    ("window_left", "9223372036854775807",
     "window_left = 9223372036854775807: must be -1 (unbounded) or a number of keys from 0 to 2147483647"),
    ("softcap", "-1.0", "softcap = -1.0: must be a finite number > 0 (0: none)"),
    ("softcap", "inf", "softcap = inf: must be a finite number"),
    ("softcap", "1e39", "softcap = 1e+39: must be a finite number"),
    ("mask", '"sometimes"', "mask = 'sometimes': must be none, per-head or broadcast"),
    ("bias", '"all"', "bias = 'all': must be none, per-head or broadcast"),
    ("dropout", "1.0", "dropout = 1.0: must be a probability in [0, 1)"),
    ("dropout", "-0.5", "dropout = -0.5: must be a probability in [0, 1)"),
    ("dropout", "nan", "dropout = nan: must be a probability"),
    ("dropout_seed", "-1", "dropout_seed = -1: must be an integer >= 0"),
    ("kv_heads", "3", "kv_heads = 3: must be 1..heads and divide heads = 2"),
    ("kv_heads", "0", "kv_heads = 0: must be 1..heads and divide heads = 2"),
    ("alibi", "1", "'alibi' must be true or false"),
    ("window_left", "1.5", "'window_left' must be an integer"),
    ("align", "1", "'align' must be a double-quoted string"),
]


@pytest.mark.parametrize("key, value, words", MANIFEST_ERRORS, ids=[f"{k}={v}" for k, v, _ in MANIFEST_ERRORS])
def test_manifest_rule_errors(binary, tmp_path, key, value, words):
    in_dir = small_case(tmp_path, f"{key} = {value}\n")
    line_no = (in_dir / "manifest.toml").read_text().splitlines().index(f"{key} = {value}") + 1
    msg = refused(binary, in_dir, tmp_path / "out")
    assert f"manifest.toml:{line_no}:" in msg and words in msg, msg


def test_unknown_key_lists_the_variant_keys(binary, tmp_path):
    msg = refused(binary, small_case(tmp_path, "windw_left = 3\n"), tmp_path / "out")
    assert "unknown key 'windw_left'" in msg


def test_causal_with_a_right_window_in_the_manifest(binary, tmp_path):
    in_dir = small_case(tmp_path, "causal = true\nwindow_right = 2\n")
    lines = (in_dir / "manifest.toml").read_text().splitlines()
    causal, window = lines.index("causal = true") + 1, lines.index("window_right = 2") + 1
    msg = refused(binary, in_dir, tmp_path / "out")
    assert f"manifest.toml:{window}:" in msg and "window_right = 2: a causal mask sees no key right of the diagonal" in msg
    assert f"(causal from {in_dir}/manifest.toml:{causal}:" in msg, msg


@pytest.mark.parametrize("extra, args, words", [
    ("window_right = 3\n", ["--causal"], "(causal from --causal)"),
    ("causal = true\n", ["--window", "1,4"], "--window 1,4: window_right = 4"),
], ids=["manifest-window", "option-window"])
def test_causal_with_a_right_window_across_manifest_and_options(binary, tmp_path, extra, args, words):
    msg = refused(binary, small_case(tmp_path, extra), tmp_path / "out", *args)
    assert words in msg and "a causal mask sees no key right of the diagonal" in msg, msg


OPTION_ERRORS = [
    (["--align", "diagonal"], "--align: 'diagonal' is not one of top-left or bottom-right"),
    (["--window", "3"], "--window: '3' is not LEFT,RIGHT"),
    (["--window", "a,1"], "--window LEFT: 'a' is not an integer"),
    (["--window", "-2,1"], "--window: '-2,1': window_left = -2: must be -1 (unbounded)"),
    (["--window", "1,-3"], "--window: '1,-3': window_right = -3: must be -1 (unbounded)"),
    (["--softcap", "-2"], "--softcap: '-2': must be a finite number > 0 (0: none)"),
    (["--softcap", "inf"], "--softcap: 'inf' is not a finite number"),
    (["--alibi=yes"], "--alibi takes no value"),
    (["--dropout", "1"], "--dropout: '1': must be a probability in [0, 1)"),
    (["--dropout", "0.99999999999"], "--dropout: '0.99999999999': must be a probability in [0, 1)"),
    (["--dropout-seed", "-4"], "--dropout-seed: '-4': must be an integer >= 0"),
    (["--dropout-seed", "1.5"], "--dropout-seed: '1.5' is not an integer"),
    (["--softcap"], "--softcap needs a value"),
    (["--dropout-seed", "7"], "--dropout-seed 7: the run has no dropout (neither --dropout P nor the case's manifest"),
]


@pytest.mark.parametrize("args, words", OPTION_ERRORS, ids=[" ".join(a) for a, _ in OPTION_ERRORS])
def test_option_errors(binary, tmp_path, args, words):
    msg = refused(binary, small_case(tmp_path), tmp_path / "out", *args)
    assert words in msg, msg


# ------------------------------------------------------------------ grouped K/V heads
def gqa_and_mha_runs(binary, tmp_path, case: GqaCase, *extra):
    """Runs the grouped case and the same case expanded to one K/V head per query head."""
    write_gqa_case(tmp_path / "gqa", case)
    expand_to_mha(tmp_path / "gqa", tmp_path / "mha", case)
    for name in ("gqa", "mha"):
        proc = run_cpu(binary, tmp_path / name, tmp_path / f"{name}_out", *extra)
        assert proc.returncode == 0, proc.stderr
    return tmp_path / "gqa_out", tmp_path / "mha_out"


def check_grouped_outputs(gqa_out: Path, mha_out: Path, d: Dims, fmt: str):
    """The K/V stages per K/V head: K, V, KT the group's, the gradients the sum over the group in
    order of h (float32 exactly as the binary adds them; float64 to rounding); every other stage
    per query head, as the ungrouped run's."""
    written = run_toml(gqa_out)["stages"].split(",")
    for stage in written:
        heads = d.total_kv_heads if STAGES[stage].kv else d.total_heads
        names = sorted(p.name for p in gqa_out.glob(f"{stage}_head_*"))
        assert names == sorted(stage_file(stage, h, fmt) for h in range(heads)), stage
        for h in range(heads):
            got = load(gqa_out / stage_file(stage, h, fmt))
            if not STAGES[stage].kv:
                np.testing.assert_array_equal(got, load(mha_out / stage_file(stage, h, fmt)), err_msg=stage)
                continue
            parts = [load(mha_out / stage_file(stage, q, fmt)) for q in d.query_heads_of(h)]
            if not STAGES[stage].backward:
                np.testing.assert_array_equal(got, parts[0], err_msg=stage)
                continue
            in_order = parts[0].copy()
            for p in parts[1:]:
                in_order += p
            np.testing.assert_array_equal(got, in_order, err_msg=stage)
            exact = np.sum([p.astype(np.float64) for p in parts], axis=0)
            np.testing.assert_allclose(got, exact, rtol=0, atol=1e-6 * np.abs(exact).max(), err_msg=stage)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_heads_files_and_sums(binary, tmp_path, fmt):
    case = GqaCase(GQA.dims, fmt=fmt)
    gqa_out, mha_out = gqa_and_mha_runs(binary, tmp_path, case)
    check_grouped_outputs(gqa_out, mha_out, case.dims, fmt)
    assert set(KV_STAGES) <= set(run_toml(gqa_out)["stages"].split(","))
    assert run_toml(gqa_out)[KV_HEADS_KEY] == case.dims.kv_heads


def test_grouped_heads_stage_path_width_24(binary, tmp_path):
    case = GqaCase(Dims(batch=1, heads=6, seq_q=37, seq_k=53, d_k=24, d_v=24, kv_heads=2))
    gqa_out, mha_out = gqa_and_mha_runs(binary, tmp_path, case)
    check_grouped_outputs(gqa_out, mha_out, case.dims, "txt")


def test_mqa_one_kv_head(binary, tmp_path):
    case = GqaCase(Dims(batch=2, heads=3, seq_q=9, seq_k=11, d_k=16, d_v=16, kv_heads=1), backward=True)
    gqa_out, mha_out = gqa_and_mha_runs(binary, tmp_path, case)
    check_grouped_outputs(gqa_out, mha_out, case.dims, "txt")


# Host bytes of one head of this case are about 1.6 MiB (five 256×256 stages): caps of 2, 4, 7 and
# 12 MiB give head groups of 1 and 2 heads (a K/V group of 3 split over head groups), 3 and 6.
@pytest.mark.parametrize("cap", [2, 4, 7, 12])
def test_head_groups_that_split_a_kv_group(binary, tmp_path, cap):
    case = GqaCase(Dims(batch=1, heads=6, seq_q=256, seq_k=256, d_k=16, d_v=16, kv_heads=2), fmt="npy")
    write_gqa_case(tmp_path / "gqa", case)
    stages = ["--stages", ",".join(KV_STAGES)]
    whole = run_cpu(binary, tmp_path / "gqa", tmp_path / "whole", *stages)
    split = run_cpu(binary, tmp_path / "gqa", tmp_path / "split", *stages, "--max-memory-mb", cap)
    assert whole.returncode == 0 and split.returncode == 0, split.stderr
    for stage in KV_STAGES:
        for j in range(case.dims.total_kv_heads):
            np.testing.assert_array_equal(load(tmp_path / "split" / stage_file(stage, j, "npy")),
                                          load(tmp_path / "whole" / stage_file(stage, j, "npy")))


def test_kv_heads_inferred_without_a_manifest(binary, tmp_path):
    case = GqaCase(Dims(batch=1, heads=6, seq_q=7, seq_k=9, d_k=16, d_v=16, kv_heads=3))
    write_gqa_case(tmp_path / "in", case, manifest=False)
    write_gqa_case(tmp_path / "with", case)
    for name in ("in", "with"):
        assert run_cpu(binary, tmp_path / name, tmp_path / f"{name}_out").returncode == 0
    assert run_toml(tmp_path / "in_out")[KV_HEADS_KEY] == 3
    for stage in STAGE_NAMES:
        for f in (tmp_path / "with_out").glob(f"{stage}_head_*"):
            np.testing.assert_array_equal(load(tmp_path / "in_out" / f.name), load(f))


def test_kv_heads_that_do_not_divide_without_a_manifest(binary, tmp_path):
    case = GqaCase(Dims(batch=1, heads=6, seq_q=5, seq_k=7, d_k=16, d_v=16, kv_heads=6), backward=False)
    write_gqa_case(tmp_path / "in", case, manifest=False)
    for name in ("K", "V"):
        for j in (4, 5):
            (tmp_path / "in" / stage_file(name, j, "txt")).unlink()
    msg = refused(binary, tmp_path / "in", tmp_path / "out")
    assert "K_head_4.txt: missing" in msg and "divides the heads" in msg, msg


@pytest.mark.parametrize("edit, words", [
    (lambda d: (d / stage_file("V", 3, "txt")).unlink(), "V_head_3.txt: missing (the case has the manifest's "
                                                         "batch*kv_heads = 4)"),
    (lambda d: save(d / stage_file(KEYS, 4, "txt"), np.zeros((53, 16)), "txt"),
     "K_head_4.txt: exists beyond the manifest's batch*kv_heads = 4"),
], ids=["missing-V", "K-beyond"])
def test_kv_files_against_the_manifest(binary, tmp_path, edit, words):
    write_gqa_case(tmp_path / "in", GQA)
    edit(tmp_path / "in")
    assert words in refused(binary, tmp_path / "in", tmp_path / "out")


def test_case_limits_count_kv_stages_per_kv_head(binary, tmp_path):
    """65536 heads of M = 2^24 keys, d 256: the K/V stages alone pass 2^48 elements with a K/V head
    per query head; with one K/V head the case is within the limits (and then misses its files)."""
    def manifest(kv):
        return (f"batch = 1\nheads = 65536\nseq_q = 1\nseq_k = {1 << 24}\nd_k = 256\nd_v = 256\n"
                f'format = "txt"\n' + (f"kv_heads = {kv}\n" if kv else ""))
    for kv, too_large in ((0, True), (1, False)):
        in_dir = tmp_path / f"in{kv}"
        in_dir.mkdir()
        (in_dir / "manifest.toml").write_text(manifest(kv))
        msg = refused(binary, in_dir, tmp_path / "out")
        assert ("too large" in msg) == too_large, msg


def _unwritten_npy(path: Path, rows: int, cols: int) -> None:
    """A float32 .npy of rows x cols whose values were never written (a sparse file: no disk)."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, cols)})
        f.truncate(f.tell() + 4 * rows * cols)


def test_case_limits_count_the_keep_mask_only_with_dropout(binary, tmp_path):
    """N = 2^24, M = 2^22, d 1: three N×M stages fit in 2^48 elements, the keep-mask's fourth does
    not. The case with dropout (its manifest's, or --dropout) is refused as too large, in the words
    the verifier says for the same case; without dropout the verifier reads it."""
    from verify.files.case import CaseError, load_input_case
    dims = Dims(1, 1, 2**24, 2**22, 1, 1)
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    manifest = "".join(f"{k} = {v}\n" for k, v in zip(("batch", "heads", "seq_q", "seq_k", "d_k", "d_v"),
                                                      (1, 1, dims.seq_q, dims.seq_k, 1, 1))) + 'format = "npy"\n'
    (in_dir / "manifest.toml").write_text(manifest)
    for name, rows in (("Q", dims.seq_q), ("K", dims.seq_k), ("V", dims.seq_k)):
        _unwritten_npy(in_dir / stage_file(name, 0, "npy"), rows, 1)
    load_input_case(in_dir)  # within the limits without dropout
    words = "the case is too large: 1 head of 281475056402432 stage elements each"
    assert words in refused(binary, in_dir, tmp_path / "out", "--dropout", "0.1")
    (in_dir / "manifest.toml").write_text(manifest + "dropout = 0.1\n")
    assert words in refused(binary, in_dir, tmp_path / "out")
    with pytest.raises(CaseError, match=words):
        load_input_case(in_dir)


# ------------------------------------------------------------------ mask, bias and slopes files
def test_declared_mask_and_bias_files_are_read(binary, tmp_path):
    in_dir = small_case(tmp_path, 'mask = "per-head"\nbias = "broadcast"\n')
    write_mask(in_dir, SMALL.dims, "txt", per_head=True)
    write_bias(in_dir, SMALL.dims, "txt", per_head=False)
    out = tmp_path / "out"
    proc = run_cpu(binary, in_dir, out)
    assert proc.returncode == 0, proc.stderr
    assert (run_toml(out)["mask"], run_toml(out)["bias"]) == ("per-head", "broadcast")


def test_mask_and_bias_inferred_without_a_manifest(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_gqa_case(in_dir, SMALL, manifest=False)
    write_mask(in_dir, SMALL.dims, "txt", per_head=False)
    write_bias(in_dir, SMALL.dims, "txt", per_head=True)
    out = tmp_path / "out"
    assert run_cpu(binary, in_dir, out).returncode == 0
    assert (run_toml(out)["mask"], run_toml(out)["bias"]) == ("broadcast", "per-head")
    write_mask(in_dir, SMALL.dims, "txt", per_head=True)
    assert "both mask.txt and mask_head_0.txt exist" in refused(binary, in_dir, tmp_path / "out2")


def _remove(name):
    return lambda d: (d / name).unlink()


def _put(name, value=1.0, shape=(SMALL.dims.seq_q, SMALL.dims.seq_k), fmt="txt"):
    return lambda d: save(d / name, np.full(shape, value), fmt)


def _set(name, r, c, value):
    def edit(d):
        a = load(d / name)
        a[r, c] = value
        save(d / name, a, "txt")
    return edit


FILE_ERRORS = [
    ('mask = "per-head"', _remove("mask_head_1.txt"), "mask_head_1.txt: missing (the manifest says mask = per-head"),
    ('mask = "broadcast"', _remove("mask.txt"), "mask.txt: missing (the manifest says mask = broadcast)"),
    ('bias = "per-head"', _remove("bias_head_0.txt"), "bias_head_0.txt: missing"),
    ("", _put("mask_head_0.txt"), "mask_head_0.txt: exists but the manifest says mask = none"),
    ("", _put("bias.txt"), "bias.txt: exists but the manifest says bias = none"),
    ('mask = "per-head"', _put("mask.txt"), "mask.txt: exists but the manifest says mask = per-head"),
    ('bias = "broadcast"', _put("bias_head_0.txt"), "bias_head_0.txt: exists but the manifest says bias = broadcast"),
    ('mask = "per-head"', _put("mask_head_2.txt"), "mask_head_2.txt: exists beyond the case's batch*heads = 2"),
    ('mask = "broadcast"', _put("mask.npy", fmt="npy"), "mask.npy: a .npy file in a .txt case"),
    ('mask = "per-head"', _set("mask_head_0.txt", 2, 3, 0.5),
     "mask_head_0.txt:3:4: 0.5 in a mask (1 such value)"),
    ('mask = "broadcast"', _set("mask.txt", 0, 0, np.nan), "mask.txt:1:1: nan in a mask"),
    ('bias = "broadcast"', _set("bias.txt", 4, 6, np.inf),
     "bias.txt:5:7: inf in a bias (1 such value)"),
    ('bias = "per-head"', _set("bias_head_0.txt", 1, 1, np.nan), "bias_head_0.txt:2:2: nan in a bias"),
    ('mask = "per-head"', _put("mask_head_0.txt", shape=(5, 8)), "mask_head_0.txt:1:"),
    ('bias = "broadcast"', _put("bias.txt", shape=(4, 7)), "bias.txt:"),
    ("", _put("alibi_slopes.txt", shape=(1, 2)), "alibi_slopes.txt: exists but the run has no ALiBi"),
    ("alibi = true", _put("alibi_slopes.txt", shape=(1, 3)), "alibi_slopes.txt: holds 1 x 3 values; expected 1 x 2"),
    ("alibi = true", _put("alibi_slopes.txt", np.inf, shape=(1, 2)),
     "alibi_slopes.txt:1:1: inf in the ALiBi slopes (2 such values)"),
    ("alibi = true", _put("alibi_slopes.npy", fmt="npy", shape=(1, 2)), "alibi_slopes.npy: a .npy file in a .txt case"),
]


@pytest.mark.parametrize("declare, edit, words", FILE_ERRORS, ids=[w[:45] for _, _, w in FILE_ERRORS])
def test_variant_file_errors_leave_the_output_untouched(binary, tmp_path, declare, edit, words):
    in_dir = small_case(tmp_path, declare + "\n")
    for key, write in (("mask", write_mask), ("bias", write_bias)):
        if f'{key} = "' in declare:
            write(in_dir, SMALL.dims, "txt", per_head="per-head" in declare)
    edit(in_dir)
    # A previous run's output stays as it was: the error comes before the folder is touched.
    out = tmp_path / "out"
    assert run_cpu(binary, small_case(tmp_path / "plain"), out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    msg = error_line(run_cpu(binary, in_dir, out))
    assert words in msg, msg
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("rows", [1, 2])
def test_slopes_file_one_row_or_one_per_batch(binary, tmp_path, rows):
    case = GqaCase(Dims(batch=2, heads=3, seq_q=5, seq_k=7, d_k=16, d_v=16))
    in_dir = tmp_path / "in"
    write_gqa_case(in_dir, case)
    write_slopes(in_dir, np.tile(alibi_slopes(3), (rows, 1)), "txt")
    proc = run_cpu(binary, in_dir, tmp_path / "out", "--alibi")
    assert proc.returncode == 0, proc.stderr
    assert run_toml(tmp_path / "out")["alibi"] is True
    write_slopes(in_dir, np.ones((3, 3)), "txt")
    assert "expected 1 x 3 or 2 x 3" in refused(binary, in_dir, tmp_path / "bad", "--alibi")


def test_mask_files_in_npy_cases(binary, tmp_path):
    case = GqaCase(SMALL.dims, fmt="npy")
    in_dir = tmp_path / "in"
    write_gqa_case(in_dir, case)
    with open(in_dir / "manifest.toml", "a") as f:
        f.write('mask = "per-head"\n')
    write_mask(in_dir, case.dims, "npy", per_head=True)
    assert run_cpu(binary, in_dir, tmp_path / "out").returncode == 0
    save(in_dir / tensor_file("mask", 1, "npy"), np.ones((5, 6)), "npy")
    assert "mask_head_1.npy: holds 5 x 6 values; expected 5 x 7" in refused(binary, in_dir, tmp_path / "bad")


# ------------------------------------------------------------------ dropout's stage
@pytest.mark.skipif(DROPOUT_MASK not in STAGE_NAMES, reason="the stage table has no dropout_mask row yet")
def test_dropout_mask_only_in_a_run_with_dropout(binary, tmp_path):
    in_dir = small_case(tmp_path)
    assert run_cpu(binary, in_dir, tmp_path / "out").returncode == 0
    assert not list((tmp_path / "out").glob(f"{DROPOUT_MASK}_head_*"))
    assert DROPOUT_MASK not in run_toml(tmp_path / "out")["stages"].split(",")
    msg = refused(binary, in_dir, tmp_path / "named", "--stages", DROPOUT_MASK)
    assert f"{DROPOUT_MASK} exists only in a run with dropout" in msg, msg


@pytest.mark.parametrize("stages", ["flash_output", "output", "flash_dV"])
def test_a_dropout_run_writes_its_keep_mask_beside_the_stages_computed_through_it(binary, tmp_path, stages):
    """Without the keep-mask no stage computed through it can be checked, so it comes with them;
    a stage that does not read it (flash_lse) comes alone."""
    in_dir = small_case(tmp_path, "dropout = 0.25\ndropout_seed = 5\n")
    proc = run_cpu(binary, in_dir, tmp_path / "out", "--stages", stages)
    assert proc.returncode == 0, proc.stderr
    assert DROPOUT_MASK in run_toml(tmp_path / "out")["stages"].split(",")
    proc = run_cpu(binary, in_dir, tmp_path / "lse", "--stages", "flash_lse")
    assert proc.returncode == 0, proc.stderr
    assert DROPOUT_MASK not in run_toml(tmp_path / "lse")["stages"].split(",")

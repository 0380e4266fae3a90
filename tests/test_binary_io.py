"""The binary's file contract, run as a subprocess on the CPU backend (docs/contract.md).

Strict input reading (each rejection: exit 2, one `main: error:` line naming file and line, nothing
written), --stages selection, atomic outputs, CRC-32s, the original `./main random_test` form,
head groups under --max-memory-mb, exit 3, and .npy round trips. Cases are written here with
NumPy directly, independent of verify/files/generate.py.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
import zlib
from pathlib import Path

import numpy as np
import pytest

from verify.stages import (DIM_KEYS, FLASH_HEAD_DIMS, FORWARD_STAGES, INPUT_NAMES, MAX_HEAD_DIM, RUN_MANIFEST,
                           UNFINISHED_MARKER, stage_file)

from helpers.environment import GPU_PRESENT


# ------------------------------------------------------------------ helpers
def write_case(path: Path, heads=2, n=5, m=7, dk=16, dv=16, fmt="txt", manifest=True, seed=0,
               extra_manifest="", batch=1):
    """Writes a random case; returns {(name, head): float32 array}."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = {"Q": (n, dk), "K": (m, dk), "V": (m, dv)}
    mats = {}
    for i in range(batch * heads):
        for name in INPUT_NAMES:
            a = rng.standard_normal(shapes[name]).astype(np.float32)
            mats[name, i] = a
            if fmt == "txt":
                np.savetxt(path / stage_file(name, i, "txt"), a, fmt="%.6f")
                mats[name, i] = np.loadtxt(path / stage_file(name, i, "txt"), dtype=np.float32, ndmin=2)
            else:
                np.save(path / stage_file(name, i, "npy"), a)
    if manifest:
        (path / "manifest.toml").write_text(
            f"batch = {batch}\nheads = {heads}\nseq_q = {n}\nseq_k = {m}\nd_k = {dk}\nd_v = {dv}\n"
            f'format = "{fmt}"\n' + extra_manifest)
    return mats


def run(binary, *args, cwd=None):
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def run_cpu(binary, in_dir, out_dir, *extra):
    return run(binary, "--in", in_dir, "--out", out_dir, "--backend", "cpu", *extra)


def error_line(proc, code=2):
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("main: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def read_run(out_dir: Path) -> dict:
    return tomllib.loads((out_dir / RUN_MANIFEST).read_text())


def files_in(path: Path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def written_in(path: Path):
    """What a run left in `path` besides the marker of a run that did not finish."""
    return [f for f in files_in(path) if f != UNFINISHED_MARKER]


def set_token(path: Path, line: int, col_index: int, token: str):
    """Replaces the col_index-th value on 1-based `line`."""
    lines = path.read_text().splitlines()
    vals = lines[line - 1].split()
    vals[col_index] = token
    lines[line - 1] = " ".join(vals)
    path.write_text("\n".join(lines) + "\n")


def drop_line(path: Path, line: int):
    lines = path.read_text().splitlines()
    del lines[line - 1]
    path.write_text("\n".join(lines) + "\n")


def edit_line(path: Path, line: int, fn):
    lines = path.read_text().splitlines()
    lines[line - 1] = fn(lines[line - 1])
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------ strict input: rejections
def _truncated(d):
    drop_line(d / "Q_head_1.txt", 5)


def _ragged(d):
    edit_line(d / "K_head_0.txt", 4, lambda s: " ".join(s.split()[:-1]))


def _extra_value(d):
    edit_line(d / "V_head_1.txt", 2, lambda s: s + " 1.5")


def _extra_row(d):
    p = d / "Q_head_0.txt"
    p.write_text(p.read_text() + " ".join(["0.5"] * 16) + "\n")


def _non_numeric(d):
    set_token(d / "V_head_0.txt", 3, 2, "1.2.3")


def _nan(d):
    set_token(d / "Q_head_0.txt", 2, 0, "nan")


def _inf(d):
    set_token(d / "K_head_1.txt", 6, 15, "-inf")


def _blank_inside(d):
    edit_line(d / "K_head_1.txt", 3, lambda s: s + "\n")


def _empty(d):
    (d / "V_head_1.txt").write_text("")


def _missing_head_file(d):
    (d / "K_head_1.txt").unlink()


def _beyond_manifest(d):
    for name in INPUT_NAMES:
        shutil.copy(d / f"{name}_head_0.txt", d / f"{name}_head_2.txt")


def _manifest_edit(old=None, new="", append=None):
    """A manifest mutation: replace `old` by `new`, or append the line `append`."""
    def mutate(d):
        p = d / "manifest.toml"
        text = p.read_text()
        p.write_text(text + append + "\n" if append else text.replace(old, new))
    return mutate


_manifest_mismatch = _manifest_edit("seq_q = 5", "seq_q = 6")
_unknown_key = _manifest_edit(append="colour = 3")
_bad_type = _manifest_edit(append="causal = 1")
_zero_dim = _manifest_edit("heads = 2", "heads = 0")
_negative_dim = _manifest_edit("seq_k = 7", "seq_k = -7")
_dk_too_big = _manifest_edit("d_k = 16", "d_k = 300")
_scale_overflows_float32 = _manifest_edit(append="scale = 1e39")
_scale_underflows_float32 = _manifest_edit(append="scale = 1e-50")
_scale_nan = _manifest_edit(append="scale = nan")


_leading_zero = _manifest_edit("seq_q = 5", "seq_q = 05")
_scale_no_int_part = _manifest_edit(append="scale = .5")
_scale_no_fraction = _manifest_edit(append="scale = 5.")
_scale_beyond_int64 = _manifest_edit(append="scale = 99999999999999999999")
_heads_overflow_int32 = _manifest_edit("batch = 1\nheads = 2", "batch = 641\nheads = 6700417")
_heads_wrap_to_zero = _manifest_edit("batch = 1\nheads = 2", "batch = 65536\nheads = 65536")
_dim_over_limit = _manifest_edit("seq_k = 7", "seq_k = 16777217")
_huge_rows_small_files = _manifest_edit("seq_q = 5", "seq_q = 16777216")


def _stray_npy_beside_txt(d):
    np.save(d / "K_head_1.npy", np.zeros((7, 16), np.float32))


def _control_char_in_comment(d):
    p = d / "manifest.toml"
    p.write_bytes(b"# a note\x00 with a NUL\n" + p.read_bytes())


# (id, mutation, file named in the message, its 1-based line or None for file-level errors, words)
REJECTIONS = [
    ("truncated", _truncated, "Q_head_1.txt", 5, "ends after 4 rows"),
    ("ragged", _ragged, "K_head_0.txt", 4, "has 15 values"),
    ("extra-value", _extra_value, "V_head_1.txt", 2, "has 17 values"),
    ("extra-row", _extra_row, "Q_head_0.txt", 6, "extra row"),
    ("non-numeric", _non_numeric, "V_head_0.txt", 3, "not a number: '1.2.3'"),
    ("nan", _nan, "Q_head_0.txt", 2, "non-finite"),
    ("inf", _inf, "K_head_1.txt", 6, "non-finite"),
    ("blank-line", _blank_inside, "K_head_1.txt", 4, "blank line"),
    ("empty", _empty, "V_head_1.txt", 1, "empty file"),
    ("missing-head-file", _missing_head_file, "K_head_1.txt", None, "missing"),
    ("beyond-manifest", _beyond_manifest, "_head_2.txt", None, "beyond"),
    ("manifest-mismatch", _manifest_mismatch, "Q_head_0.txt", 6, "expected 6 x 16 (seq_q x d_k from the manifest)"),
    ("unknown-key", _unknown_key, "manifest.toml", 8, "unknown key 'colour'"),
    ("bad-type", _bad_type, "manifest.toml", 8, "must be true or false"),
    ("zero-dim", _zero_dim, "manifest.toml", 2, "heads = 0"),
    ("negative-dim", _negative_dim, "manifest.toml", 4, "seq_k = -7"),
    ("dk-over-256", _dk_too_big, "manifest.toml", 5, "exceeds 256"),
    ("scale-inf-as-float32", _scale_overflows_float32, "manifest.toml", 8, "float32 value must be finite"),
    ("scale-zero-as-float32", _scale_underflows_float32, "manifest.toml", 8, "float32 value must be finite"),
    ("scale-nan", _scale_nan, "manifest.toml", 8, "scale = nan"),
    ("manifest-control-char", _control_char_in_comment, "manifest.toml", 1, "byte 0x00"),
    ("leading-zero", _leading_zero, "manifest.toml", 3, "leading zeros are not allowed"),
    ("scale-no-int-part", _scale_no_int_part, "manifest.toml", 8, "cannot read value '.5'"),
    ("scale-no-fraction", _scale_no_fraction, "manifest.toml", 8, "a point needs digits on both sides"),
    ("scale-beyond-int64", _scale_beyond_int64, "manifest.toml", 8,
     "'scale' = 99999999999999999999: integer is out of the 64-bit range"),
    ("heads-overflow-int32", _heads_overflow_int32, "manifest.toml", None, "batch x heads = 4294967297 heads"),
    ("heads-wrap-to-zero", _heads_wrap_to_zero, "manifest.toml", None, "batch x heads = 4294967296 heads"),
    ("dim-over-limit", _dim_over_limit, "manifest.toml", 4, "seq_k = 16777217 is out of range (dimensions are 1..16777216)"),
    ("huge-rows-small-files", _huge_rows_small_files, "Q_head_0.txt", None, "bytes cannot hold 16777216 x 16"),
    ("stray-other-format", _stray_npy_beside_txt, "K_head_1.npy", None, "a .npy file in a .txt case"),
]


@pytest.mark.parametrize("mutate,fname,line,words",
                         [pytest.param(*r[1:], id=r[0]) for r in REJECTIONS])
def test_bad_input_is_rejected_naming_file_and_line(binary, tmp_path, mutate, fname, line, words):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    write_case(in_dir)
    mutate(in_dir)
    proc = run_cpu(binary, in_dir, out_dir)
    msg = error_line(proc)
    assert fname in msg and words in msg, msg
    if line is not None:
        assert re.search(re.escape(fname) + rf":{line}:\d+: ", msg), msg
    assert "HINT:" in proc.stderr or "manifest.toml" in fname
    # Nothing half-written: no run.toml, no stage file, no temporary file; an error found once the
    # run began (a head's file read in its turn) leaves the marker of a run that did not finish.
    assert written_in(out_dir) == []


def test_nonfinite_inputs_run_with_allow_nonfinite(binary, tmp_path):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    write_case(in_dir)
    _nan(in_dir)
    assert "--allow-nonfinite" in run_cpu(binary, in_dir, out_dir).stderr
    proc = run_cpu(binary, in_dir, out_dir, "--allow-nonfinite", "--stages", "Q")
    assert proc.returncode == 0, proc.stderr
    q = np.loadtxt(out_dir / "Q_head_0.txt", ndmin=2)
    assert np.isnan(q[1, 0]) and np.isfinite(np.delete(q.ravel(), 16)).all()


def test_nonfinite_npy_input_is_named_at_its_numpy_index(binary, tmp_path):
    """In a .npy input the element is named as NumPy indexes it (0-based), as the verifier and the
    binary's integer readers name theirs."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    mats = write_case(in_dir, fmt="npy")
    k = mats["K", 1].copy()
    k[3, 5] = np.inf
    np.save(in_dir / stage_file("K", 1, "npy"), k)
    proc = run_cpu(binary, in_dir, out_dir)
    assert proc.returncode != 0
    assert error_line(proc).endswith(f"{stage_file('K', 1, 'npy')}:row 3, col 5: non-finite value inf"), proc.stderr
    assert written_in(out_dir) == []


def test_head_gap_without_manifest_is_rejected(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=4, manifest=False)
    for name in INPUT_NAMES:
        (in_dir / f"{name}_head_2.txt").unlink()
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    assert "Q_head_3.txt" in msg and "gap" in msg, msg


def test_q_without_k_is_rejected(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=3, manifest=False)
    (in_dir / "K_head_2.txt").unlink()
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    assert "K_head_2.txt: missing" in msg, msg


def test_no_inputs_at_all(binary, tmp_path):
    (tmp_path / "in").mkdir()
    msg = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out"))
    assert "Q_head_0" in msg


def test_out_equal_to_in_is_refused(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir)
    before = {p.name: p.read_bytes() for p in in_dir.iterdir()}
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "." / "in"))
    assert "input folder" in msg
    assert {p.name: p.read_bytes() for p in in_dir.iterdir()} == before


def test_output_folder_symlinked_to_the_input_is_refused(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir)
    before = files_in(in_dir)
    (tmp_path / "link").symlink_to(in_dir)
    assert "is the input folder" in error_line(run_cpu(binary, in_dir, tmp_path / "link"))
    assert files_in(in_dir) == before


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(),
                    reason="needs `unshare -rm` (user and mount namespaces) for a bind mount without root")
def test_output_folder_bind_mounted_on_the_input_is_refused(binary, tmp_path):
    """A bind mount has another path but is the same folder: compared by device and inode."""
    in_dir, mount = tmp_path / "in", tmp_path / "mnt"
    write_case(in_dir)
    mount.mkdir()
    before = files_in(in_dir)
    script = f'mount --bind "{in_dir}" "{mount}" && exec "{binary}" --in "{in_dir}" --out "{mount}" --backend cpu'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert "is the input folder" in error_line(proc)
    assert files_in(in_dir) == before


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_temporary_files_of_killed_runs_are_removed(binary, tmp_path):
    """Only `.tmp-<run id>` names whose run's process is gone; anything else stays."""
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    write_case(in_dir)
    out_dir.mkdir()
    dead = f"QK_head_0.txt.tmp-20250101T000000Z-{_dead_pid()}-0badf00d"
    alive = f"QK_head_1.txt.tmp-20250101T000000Z-{os.getpid()}-0badf00d"  # this test's process runs
    others = ["notes.tmp-1234", "V_head_0.txt.tmp-20250101T000000Z-x-0badf00d"]
    for name in [dead, alive, *others]:
        (out_dir / name).write_text("partial")
    proc = run_cpu(binary, in_dir, out_dir)
    assert proc.returncode == 0, proc.stderr
    assert "removed 1 temporary file left in" in proc.stderr
    left = files_in(out_dir)
    assert dead not in left and alive in left and all(o in left for o in others)


@pytest.mark.parametrize("target", ["K_head_1.txt", "manifest.toml"])
@pytest.mark.parametrize("kind,words", [("fifo", "is a FIFO"), ("dev-zero", "is a character device"),
                                        ("folder", "is a folder")])
def test_input_that_is_not_a_regular_file_is_refused(binary, tmp_path, target, kind, words):
    """A FIFO would block the read, /dev/zero never ends: refused before reading, naming the file."""
    in_dir = tmp_path / "in"
    write_case(in_dir)
    path = in_dir / target
    path.unlink()
    {"fifo": lambda: os.mkfifo(path), "dev-zero": lambda: path.symlink_to("/dev/zero"),
     "folder": path.mkdir}[kind]()
    proc = subprocess.run([str(binary), "--in", str(in_dir), "--out", str(tmp_path / "out"), "--backend", "cpu"],
                          capture_output=True, text=True, timeout=60)
    assert error_line(proc) == f"main: error: {path}: {words}, not a regular file"
    assert files_in(tmp_path / "out") == []


def test_oversized_text_input_is_refused_before_reading(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir)
    with open(in_dir / "V_head_1.txt", "ab") as fh:  # sparse: 1 GiB of zero bytes, never read
        fh.truncate(1 << 30)
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    assert "V_head_1.txt: 1073741824 bytes is more than a text matrix of 7 x 16" in msg, msg


def test_non_ascii_input_path_is_escaped_in_run_toml(binary, tmp_path):
    from verify.files.outputs import load_run

    in_dir, out_dir = tmp_path / "café_ü𝄞", tmp_path / "out"
    write_case(in_dir)
    assert run_cpu(binary, in_dir, out_dir).returncode == 0
    raw = (out_dir / RUN_MANIFEST).read_bytes()
    assert raw.isascii() and b"caf\\u00E9_\\u00FC\\U0001D11E" in raw
    assert load_run(out_dir).values["input"] == str(in_dir)


@pytest.mark.parametrize("kernel", ["wgmma", "fast", "clean"])
def test_forcing_a_flash_kernel_on_the_cpu_backend_is_exit_2(binary, tmp_path, kernel):
    write_case(tmp_path / "in")
    msg = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", "--flash-kernel", kernel))
    assert f"--flash-kernel {kernel}: no {kernel} variant on the CPU backend" in msg
    assert files_in(tmp_path / "out") == []


def test_uncreatable_output_folder_is_refused(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    msg = error_line(run_cpu(binary, in_dir, blocker / "out"))
    assert str(blocker / "out") in msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only folder")
def test_unwritable_output_folder_is_refused(binary, tmp_path):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    write_case(in_dir)
    out_dir.mkdir()
    out_dir.chmod(0o500)
    try:
        msg = error_line(run_cpu(binary, in_dir, out_dir))
    finally:
        out_dir.chmod(0o700)
    assert "not writable" in msg


@pytest.mark.parametrize("args,words", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--backend", "tpu"], "'tpu' is not one of auto|cuda|cpu"),
    (["--scale", "abc"], "--scale"),
    (["--format", "csv"], "--format"),
    (["--precision", "fp8"], "--precision"),
    (["--max-memory-mb", "0"], "--max-memory-mb"),
    (["--stages", "QK,softmax"], "unknown stage 'softmax'"),
    (["--stages"], "--stages needs a value"),
    (["--scale", "1e39"], "--scale: '1e39': its float32 value must be finite"),
    (["--scale", "-1e39"], "--scale: '-1e39': its float32 value must be finite"),
    (["--scale", "1e-50"], "--scale: '1e-50': its float32 value must be finite"),
    (["--scale", "0"], "--scale: '0'"),
    (["--scale", "nan"], "--scale: 'nan'"),
    (["--max-memory-mb", "17592186044416"], "--max-memory-mb: '17592186044416' exceeds 1073741824"),
    (["--max-memory-mb", "1073741825"], "--max-memory-mb: '1073741825' exceeds"),
], ids=["unknown-option", "backend", "scale", "format", "precision", "max-memory", "stage", "no-value",
        "scale-inf-as-float32", "scale-neg-inf-as-float32", "scale-zero-as-float32", "scale-zero", "scale-nan",
        "max-memory-wraps", "max-memory-over-1PiB"])
def test_bad_usage_is_one_line_exit_2(binary, tmp_path, args, words):
    write_case(tmp_path / "in")
    msg = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", *args))
    assert words in msg, msg
    assert files_in(tmp_path / "out") == []


@pytest.mark.parametrize("scale", ["3.4e38", "-1e-40", "1e-44"])
def test_extreme_scales_that_fit_float32_run(binary, tmp_path, scale):
    """The float32 check rejects only what would become inf or 0, not large or subnormal scales."""
    write_case(tmp_path / "in")
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--scale", scale, "--stages", "Q")
    assert proc.returncode == 0, proc.stderr
    assert read_run(tmp_path / "out")["scale"] == float(np.float32(float(scale)))


def test_largest_max_memory_mb_runs(binary, tmp_path):
    """1 PiB is accepted and caps nothing: one group holds every head."""
    write_case(tmp_path / "in", heads=3)
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--max-memory-mb", str(1 << 30))
    assert proc.returncode == 0, proc.stderr
    assert len([f for f in files_in(tmp_path / "out") if f.startswith("QK_head_")]) == 3


def test_help_exits_0(binary):
    proc = run(binary, "--help")
    assert proc.returncode == 0 and "--max-memory-mb" in proc.stdout


@pytest.mark.skipif(GPU_PRESENT, reason="checks the no-GPU behaviour")
def test_backend_cuda_without_gpu_is_exit_2_and_auto_falls_back(binary, tmp_path):
    write_case(tmp_path / "in")
    proc = run(binary, "--in", tmp_path / "in", "--out", tmp_path / "out", "--backend", "cuda")
    assert "cuda" in error_line(proc)
    cpu_only = "built without CUDA" in error_line(proc)
    proc = run(binary, "--in", tmp_path / "in", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    # One line: a CPU-only build names the build (test_first_run.py checks its hint), a CUDA build
    # the missing device.
    notice = proc.stderr.strip()
    assert len(notice.splitlines()) == 1, notice
    if cpu_only:
        assert notice.startswith("main: notice: this binary was built without CUDA; using the CPU backend; "), notice
    else:
        assert notice == "main: notice: no CUDA device found; using the CPU backend"
    assert read_run(tmp_path / "out")["backend"] == "cpu"


# ------------------------------------------------------------------ outputs
def test_run_manifest_keys_and_crc32_match_zlib(binary, tmp_path):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    write_case(in_dir, batch=2, heads=2)
    assert run_cpu(binary, in_dir, out_dir).returncode == 0
    r = read_run(out_dir)
    for key in ("run_id", "backend", "device", "precision", "format", "input", "batch", "heads",
                "seq_q", "seq_k", "d_k", "d_v", "causal", "scale", "stages", "flash_block_q",
                "flash_block_k", "poison"):
        assert key in r, key
    assert (r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["d_k"], r["d_v"]) == (2, 2, 5, 7, 16, 16)
    assert r["scale"] == pytest.approx(0.25) and r["causal"] is False and r["poison"] is False
    assert r["stages"].split(",") == list(FORWARD_STAGES)
    assert (r["flash_block_q"], r["flash_block_k"]) == (64, 64)
    assert all(f"time_ms_{s}" in r for s in FORWARD_STAGES)
    crcs = {k[len("crc32_"):]: v for k, v in r.items() if k.startswith("crc32_")}
    expected = {stage_file(s, i, "txt") for s in FORWARD_STAGES for i in range(4)}
    assert {k + ".txt" for k in crcs} == expected
    assert set(files_in(out_dir)) == expected | {RUN_MANIFEST}
    for key, crc in crcs.items():
        assert crc == f"{zlib.crc32((out_dir / (key + '.txt')).read_bytes()):08x}", key
    header = (out_dir / "QK_head_3.txt").read_text().splitlines()[0]
    assert header == f"# attnstep stage=QK head=3 rows=5 cols=7 run={r['run_id']}"


def test_run_ids_are_unique(binary, tmp_path):
    write_case(tmp_path / "in")
    ids = set()
    for _ in range(3):
        assert run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "Q").returncode == 0
        ids.add(read_run(tmp_path / "out")["run_id"])
    assert len(ids) == 3


@pytest.mark.parametrize("stages,written", [
    ("QK_scaled", ["QK_scaled"]),
    ("flash", ["flash_output", "flash_lse"]),
    ("flash_lse", ["flash_lse"]),
    ("stages", [s for s in FORWARD_STAGES if not s.startswith("flash")]),
    ("output,KT", ["KT", "output"]),
], ids=["one-stage", "flash", "flash-lse", "stage-path", "list"])
def test_stages_selection_writes_only_the_named(binary, tmp_path, stages, written):
    write_case(tmp_path / "in")
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", stages)
    assert proc.returncode == 0, proc.stderr
    r = read_run(tmp_path / "out")
    assert r["stages"].split(",") == written
    assert set(files_in(tmp_path / "out")) == {stage_file(s, i, "txt") for s in written for i in range(2)} | {RUN_MANIFEST}
    # Dependencies are computed (timed) but not written.
    if stages == "QK_scaled":
        assert "time_ms_QK" in r


# (id, {input: shape} overriding a 5 x 16 / 7 x 16 / 7 x 16 case, file named, shape words)
EMPTY_NPY = [
    ("seq_q-0", {"Q": (0, 16)}, "Q_head_0.npy", "empty 0 x 16 array (seq_q x d_k)"),
    ("d_k-0", {"Q": (5, 0), "K": (7, 0)}, "Q_head_0.npy", "empty 5 x 0 array (seq_q x d_k)"),
    ("seq_k-0", {"K": (0, 16), "V": (0, 16)}, "K_head_0.npy", "empty 0 x 16 array (seq_k x d_k)"),
    ("d_v-0", {"V": (7, 0)}, "V_head_0.npy", "empty 7 x 0 array (seq_k x d_v)"),
]


@pytest.mark.parametrize("shapes,fname,words", [pytest.param(*e[1:], id=e[0]) for e in EMPTY_NPY])
def test_empty_npy_without_manifest_is_rejected(binary, tmp_path, shapes, fname, words):
    """Without a manifest the dimensions come from head 0's .npy shapes; none may be 0."""
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=2, fmt="npy", manifest=False)
    for name, shape in shapes.items():
        for i in range(2):
            np.save(in_dir / stage_file(name, i, "npy"), np.zeros(shape, np.float32))
    proc = run_cpu(binary, in_dir, tmp_path / "out")
    msg = error_line(proc)
    assert f"main: error: {in_dir / fname}: holds an {words}; every dimension must be >= 1" == msg, msg
    assert files_in(tmp_path / "out") == []


def test_head_dim_limits_match_verify_stages(binary, tmp_path):
    """The C++ limits (stages.h kMaxHeadDim, kFlashHeadDims) agree with verify/stages.py."""
    write_case(tmp_path / "max", heads=1, n=2, m=3, dk=MAX_HEAD_DIM, dv=MAX_HEAD_DIM)
    assert run_cpu(binary, tmp_path / "max", tmp_path / "max_out", "--stages", "Q,V").returncode == 0
    write_case(tmp_path / "over", heads=1, n=2, m=3, dk=MAX_HEAD_DIM + 1, dv=16)
    assert f"exceeds {MAX_HEAD_DIM}" in error_line(run_cpu(binary, tmp_path / "over", tmp_path / "o2"))
    widths = "{" + ", ".join(map(str, FLASH_HEAD_DIMS)) + "}"
    for d in sorted({*FLASH_HEAD_DIMS, min(FLASH_HEAD_DIMS) - 1, max(FLASH_HEAD_DIMS) + 1}):
        write_case(tmp_path / f"d{d}", heads=1, n=3, m=4, dk=d, dv=d)
        proc = run_cpu(binary, tmp_path / f"d{d}", tmp_path / f"d{d}_out", "--stages", "flash")
        if d in FLASH_HEAD_DIMS:
            assert proc.returncode == 0, proc.stderr
            assert read_run(tmp_path / f"d{d}_out")["stages"] == "flash_output,flash_lse"
        else:
            assert f"flash stages need d_k = d_v in {widths}; this case has d_k = {d}" in error_line(proc)


def test_run_toml_lists_the_dimension_keys_in_order(binary, tmp_path):
    """run.toml writes the same dimension keys as manifest.toml reads (stages.h kDimKeys = DIM_KEYS)."""
    write_case(tmp_path / "in", batch=2, heads=3, n=4, m=6, dk=8, dv=12)
    assert run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "Q").returncode == 0
    r = read_run(tmp_path / "out")
    assert [k for k in r if k in DIM_KEYS] == list(DIM_KEYS)
    assert [r[k] for k in DIM_KEYS] == [2, 3, 4, 6, 8, 12]


def test_unsupported_flash_dims(binary, tmp_path):
    write_case(tmp_path / "in", dk=24, dv=40)
    msg = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "QK,flash_output"))
    assert "d_k = 24, d_v = 40" in msg
    assert files_in(tmp_path / "out") == []
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if "notice" in ln and "flash" in ln]
    r = read_run(tmp_path / "out")
    assert "flash" not in r["stages"] and r["flash_block_q"] == 0


# ------------------------------------------------------------------ inputs in other forms
def test_savetxt_case_without_manifest_runs(binary, tmp_path):
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    mats = write_case(in_dir, heads=3, n=9, m=11, dk=8, dv=12, manifest=False)
    proc = run_cpu(binary, in_dir, out_dir, "--causal", "--scale", "0.5")
    assert proc.returncode == 0, proc.stderr
    r = read_run(out_dir)
    assert (r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["d_k"], r["d_v"]) == (1, 3, 9, 11, 8, 12)
    assert r["causal"] is True and r["scale"] == 0.5 and r["format"] == "txt"
    # The echo round-trips the float32 values exactly.
    q = np.loadtxt(out_dir / "Q_head_2.txt", dtype=np.float32, ndmin=2)
    assert np.array_equal(q, mats["Q", 2])


def test_inconsistent_heads_without_manifest(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=2, manifest=False)
    np.savetxt(in_dir / "K_head_1.txt", np.ones((8, 16)), fmt="%.6f")
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    assert "K_head_1.txt:8:1" in msg and "from head 0" in msg, msg


def test_original_workflow_from_build_dir(binary, tmp_path):
    """`./main random_test` from build/ reads ../data/random_test and writes ../data/random_verify."""
    write_case(tmp_path / "data" / "random_test", manifest=False)
    build = tmp_path / "build"
    build.mkdir()
    shutil.copy(binary, build / "main")
    proc = run("./main", "random_test", "--backend", "cpu", cwd=build)
    assert proc.returncode == 0, proc.stderr
    r = read_run(tmp_path / "data" / "random_verify")
    assert r["input"] == "../data/random_test"
    # ... and from the repository root, ./data comes first.
    proc = run(build / "main", "random_test", "--backend", "cpu", "--stages", "Q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_run(tmp_path / "data" / "random_verify")["input"] == "data/random_test"
    msg = error_line(run(build / "main", "nope_test", cwd=tmp_path))
    assert "nope_test" in msg


def _matrices(out_dir: Path, fmt: str):
    """Every stage file's values (the header line holds the run id, so compare values)."""
    load = (lambda p: np.load(p)) if fmt == "npy" else (lambda p: np.loadtxt(p, dtype=np.float32, ndmin=2))
    return {p.name: load(p) for p in sorted(out_dir.iterdir()) if p.suffix == "." + fmt}


@pytest.mark.parametrize("fmt", ["txt", "npy"])
def test_several_groups_give_identical_outputs(binary, tmp_path, fmt):
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=5, n=192, m=192, dk=64, dv=64, fmt=fmt, extra_manifest="causal = true\n")
    assert run_cpu(binary, in_dir, tmp_path / "one").returncode == 0
    assert run_cpu(binary, in_dir, tmp_path / "many", "--max-memory-mb", "1").returncode == 0
    one, many = _matrices(tmp_path / "one", fmt), _matrices(tmp_path / "many", fmt)
    assert one.keys() == many.keys() and len(one) == 5 * len(FORWARD_STAGES)
    for name in one:
        assert np.array_equal(one[name], many[name], equal_nan=True), name
    if fmt == "npy":  # no header line: the bytes, and so the CRCs, agree too
        c1 = {k: v for k, v in read_run(tmp_path / "one").items() if k.startswith("crc32_")}
        assert c1 == {k: v for k, v in read_run(tmp_path / "many").items() if k.startswith("crc32_")}


def test_exit_3_when_one_head_does_not_fit(binary, tmp_path):
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=1, n=512, m=512, dk=16, dv=16)
    proc = run_cpu(binary, in_dir, tmp_path / "out", "--max-memory-mb", "1")
    msg = error_line(proc, code=3)
    assert "MiB" in msg and "--stages flash" in proc.stderr
    assert written_in(tmp_path / "out") == []
    # The flash path holds no N x M buffer, so it fits.
    proc = run_cpu(binary, in_dir, tmp_path / "out", "--max-memory-mb", "1", "--stages", "flash")
    assert proc.returncode == 0, proc.stderr


def test_the_memory_hint_names_the_n_x_m_stages_only_where_they_weigh(binary, tmp_path):
    """A wide head whose N×M stages are a small part of its need is told of the case and the budget,
    not of --stages flash; a long one is told what its N×M stages take."""
    write_case(tmp_path / "wide", heads=1, n=128, m=128, dk=256, dv=256)
    proc = run_cpu(binary, tmp_path / "wide", tmp_path / "out", "--max-memory-mb", "1")
    error_line(proc, code=3)
    assert "--stages flash" not in proc.stderr and "a larger --max-memory-mb" in proc.stderr
    write_case(tmp_path / "long", heads=1, n=512, m=512, dk=16, dv=16)
    proc = run_cpu(binary, tmp_path / "long", tmp_path / "out", "--max-memory-mb", "1")
    error_line(proc, code=3)
    assert "the N x M stages take 3.0 MiB of it: --stages flash" in proc.stderr


def test_npy_round_trip_and_format_switch(binary, tmp_path):
    in_dir = tmp_path / "in"
    mats = write_case(in_dir, heads=2, n=6, m=9, dk=32, dv=32, fmt="npy")
    assert run_cpu(binary, in_dir, tmp_path / "npy").returncode == 0
    r = read_run(tmp_path / "npy")
    assert r["format"] == "npy"
    for i in range(2):
        for name in INPUT_NAMES:
            got = np.load(tmp_path / "npy" / stage_file(name, i, "npy"))
            assert got.dtype == np.dtype("<f4") and np.array_equal(got, mats[name, i])
    assert np.load(tmp_path / "npy" / "flash_lse_head_1.npy").shape == (6, 1)
    # npy in, txt out: values round-trip exactly through %.9g.
    assert run_cpu(binary, in_dir, tmp_path / "txt", "--format", "txt").returncode == 0
    for name in ("QK_scaled_head_1", "output_head_0"):
        t = np.loadtxt(tmp_path / "txt" / f"{name}.txt", dtype=np.float32, ndmin=2)
        assert np.array_equal(t, np.load(tmp_path / "npy" / f"{name}.npy"))
    # txt out read back in as an npy case: the binary reads its own npy output.
    case2 = tmp_path / "case2"
    case2.mkdir()
    for name in INPUT_NAMES:
        for i in range(2):
            shutil.copy(tmp_path / "npy" / stage_file(name, i, "npy"), case2)
    assert run_cpu(binary, case2, tmp_path / "again").returncode == 0
    assert read_run(tmp_path / "again")["crc32_Q_head_0"] == r["crc32_Q_head_0"]


def _npy_with_header(a: np.ndarray, header: str) -> bytes:
    """An .npy v1.0 file with the given header dict text (padded as np.save pads)."""
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + a.astype("<f4").tobytes()


@pytest.mark.parametrize("bad,words", [
    (lambda a, p: np.save(p, a.astype(np.float64)), "'<f8'"),
    (lambda a, p: np.save(p, np.asfortranarray(a)), "fortran_order"),
    (lambda a, p: np.save(p, a.ravel()), "not 2-D"),
    (lambda a, p: (np.save(p, a), p.write_bytes(p.read_bytes()[:-4])), "data bytes"),
    (lambda a, p: p.write_bytes(_npy_with_header(a, "{'descr': '<f4', 'fortran_order': False, "
                                                    f"'shape': {a.shape}, 'extra': 1, }}")),
     "unexpected key 'extra'"),
    (lambda a, p: p.write_bytes(_npy_with_header(a, "{'descr': '<f4', 'shape': %s, }" % (a.shape,))),
     "no 'fortran_order' entry"),
    (lambda a, p: p.write_bytes(_npy_with_header(a, "{'descr': '<f4', 'fortran_order': False, "
                                                    "'shape': (09, 16), }")), "leading zero"),
], ids=["float64", "fortran", "1-d", "truncated", "extra-key", "missing-key", "leading-zero"])
def test_bad_npy_is_rejected(binary, tmp_path, bad, words):
    in_dir = tmp_path / "in"
    mats = write_case(in_dir, fmt="npy", n=6, m=9)
    bad(mats["K", 1], in_dir / "K_head_1.npy")
    msg = error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    assert "K_head_1.npy" in msg and words in msg, msg
    assert files_in(tmp_path / "out") == []


def test_the_binary_counts_one_in_the_singular(binary, tmp_path):
    """'file ends after 1 row', '1 head (Q_head_0..0 ...)': a count of one takes the singular."""
    in_dir = tmp_path / "in"
    write_case(in_dir, heads=1, n=3)
    q = in_dir / stage_file("Q", 0, "txt")
    q.write_text(q.read_text().splitlines()[0] + "\n")
    assert "file ends after 1 row; expected 3 x 16" in error_line(run_cpu(binary, in_dir, tmp_path / "out"))
    write_case(in_dir, heads=1, n=3, manifest=False)
    (in_dir / "manifest.toml").unlink()
    np.savetxt(in_dir / stage_file("K", 1, "txt"), np.ones((7, 16)), fmt="%.6f")
    assert "(the case has 1 head (Q_head_0..0 with no gaps))" in error_line(run_cpu(binary, in_dir, tmp_path / "out"))

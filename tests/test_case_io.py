"""The verifier's own strict reading of matrices and cases (no binary needed)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from verify.cli.group import cli
from verify.files.case import (CaseError, load_input_case, matrix_bytes, matrix_max_bytes, parse_text_matrix,
                               read_matrix, write_matrix)
from verify.files.generate import generate_case
from verify.files.matrix_io import QUOTED_TOKEN_LIMIT
from verify.stages import Dims, parse_stage_file, stage_file
from verify.text import printable


def test_float32_text_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((17, 9)) * 10.0 ** rng.integers(-30, 30, (17, 9))).astype(np.float32)
    a[0, 0], a[0, 1] = np.float32(np.inf) * -1, np.float32(1e-45)
    write_matrix(tmp_path / "m.txt", a, "txt", header="attnstep test")
    back = read_matrix(tmp_path / "m.txt")
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, a)


def test_npy_round_trip(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    write_matrix(tmp_path / "m.npy", a, "npy")
    np.testing.assert_array_equal(read_matrix(tmp_path / "m.npy", (3, 4)), a)
    assert np.load(tmp_path / "m.npy").dtype == np.float32


@pytest.mark.parametrize("text, shape, message", [
    (b"1 2 3\n4 5\n", None, "m.txt:2: missing values: 2 values on this row, expected 3"),
    (b"1 2\n4 5 6\n", None, "m.txt:2: extra values"),
    (b"1 2\n3 x\n", None, "m.txt:2:3: not a number: 'x'"),  # character columns, as the binary
    (b"1 2\n3 4\n", (3, 2), "m.txt:2: 2 rows, expected 3"),
    (b"1 2\n", (3, 2), "m.txt:1: 1 row, expected 3"),
    (b"1 2 3\n4\n", None, "m.txt:2: missing values: 1 value on this row, expected 3"),
    (b"# only a comment\n", None, "m.txt: empty file"),
    (b"1 2\n\n3 4\n", None, "m.txt:2: blank line inside the matrix"),
    (b"1 2\xff\n", None, "not a text matrix"),
    (b"1 0x1.701d22p-1\n", None, "m.txt:1:3: not a number: '0x1.701d22p-1'; HINT: hexadecimal floats (%a) are not "
                              "read: print %.9g"),
], ids=["ragged", "extra", "non-numeric", "truncated", "truncated-to-one-row", "one-value", "empty",
        "blank-line", "binary", "hexadecimal"])
def test_strict_text_errors_name_line_and_column(text, shape, message):
    with pytest.raises(CaseError, match=None) as exc:
        parse_text_matrix(text, "m.txt", shape)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_nonfinite_inputs_rejected_with_location():
    with pytest.raises(CaseError) as exc:
        parse_text_matrix(b"# header\n1 2\n3 nan\n", "q.txt", allow_nonfinite=False)
    assert "q.txt:3:2" in str(exc.value)
    assert parse_text_matrix(b"1 inf\n", "ok.txt").shape == (1, 2)


@pytest.mark.parametrize("token", ["1e400", "-1E999", "1e0400", "1e39", "9" * 400])
def test_a_number_past_float32_is_an_overflow_not_an_infinity(token):
    """Written as a number, it overflows float32, even past float64's range where NumPy reads it as
    inf: named as the binary names it (the token, its character column); a spelled-out inf stays a
    non-finite input, and 1e-400 is a zero."""
    text = f"# header\n1 2\n3  {token}\n".encode()
    for allow in (True, False):
        with pytest.raises(CaseError) as exc:
            parse_text_matrix(text, "q.txt", allow_nonfinite=allow)
        assert str(exc.value) == f"q.txt:3:4: value '{printable(token, QUOTED_TOKEN_LIMIT)}' overflows float32"
    assert parse_text_matrix(b"1 1e-400\n", "q.txt", allow_nonfinite=False)[0, 1] == 0.0
    with pytest.raises(CaseError, match="q.txt:3:2: -inf in an input"):
        parse_text_matrix(b"# header\n1 2\n3 -inf\n", "q.txt", allow_nonfinite=False)


def test_npy_wrong_dtype_and_shape(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((2, 2)))
    with pytest.raises(CaseError, match="dtype float64, expected float32"):
        read_matrix(tmp_path / "a.npy")
    np.save(tmp_path / "b.npy", np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(CaseError, match="shape 2x3, expected 3x2"):
        read_matrix(tmp_path / "b.npy", (3, 2))
    (tmp_path / "c.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(CaseError, match="not a valid .npy file"):
        read_matrix(tmp_path / "c.npy")


def test_stage_file_names_round_trip():
    assert parse_stage_file(stage_file("QK_scaled", 11, "txt")) == ("QK_scaled", 11, "txt")
    assert parse_stage_file("run.toml") is None
    assert parse_stage_file("Q_head_x.txt") is None


def _seed_style_case(folder, heads=3, n=5, m=7, d=4):
    """What the original workflow wrote: np.savetxt(fmt='%.6f'), no manifest."""
    rng = np.random.default_rng(0)
    for i in range(heads):
        for name, rows in (("Q", n), ("K", m), ("V", m)):
            np.savetxt(folder / f"{name}_head_{i}.txt", rng.random((rows, d)), fmt="%.6f")


def test_case_without_manifest_is_inferred(tmp_path):
    _seed_style_case(tmp_path)
    case = load_input_case(tmp_path)
    assert case.dims == Dims(1, 3, 5, 7, 4, 4)
    assert case.load("K", 2).shape == (7, 4)


def test_case_gaps_and_extras_are_errors(tmp_path):
    _seed_style_case(tmp_path)
    (tmp_path / "K_head_1.txt").unlink()
    with pytest.raises(CaseError, match="K_head_1.txt: missing file"):
        load_input_case(tmp_path)


def test_manifest_disagreeing_with_files(tmp_path):
    generate_case(tmp_path, Dims(1, 2, 4, 6, 8, 8))
    np.savetxt(tmp_path / "Q_head_1.txt", np.zeros((5, 8)), fmt="%.6f")
    case = load_input_case(tmp_path)
    with pytest.raises(CaseError, match=r"Q_head_1.txt:5: 5 rows, expected 4"):
        case.load("Q", 1)


def test_manifest_unknown_key_and_bad_dims(tmp_path):
    generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2))
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(manifest.read_text() + "heeds = 3\n")
    with pytest.raises(CaseError, match="unknown key 'heeds'"):
        load_input_case(tmp_path)
    manifest.write_text(manifest.read_text().replace("heeds = 3\n", "").replace("seq_q = 2", "seq_q = 0"))
    with pytest.raises(CaseError, match="'seq_q' = 0: dimensions must be in 1.."):
        load_input_case(tmp_path)


def test_generate_replaces_an_earlier_case(tmp_path):
    generate_case(tmp_path, Dims(1, 4, 3, 3, 2, 2))
    generate_case(tmp_path, Dims(1, 2, 3, 3, 2, 2), fmt="npy")
    case = load_input_case(tmp_path)
    assert case.dims.heads == 2 and case.fmt == "npy"
    assert not list(tmp_path.glob("*.txt"))


def test_large_distribution_reaches_hundreds(tmp_path):
    generate_case(tmp_path, Dims(1, 1, 64, 64, 64, 64), distribution="large", seed=3)
    case = load_input_case(tmp_path)
    q, k = case.load("Q", 0).astype(np.float64), case.load("K", 0).astype(np.float64)
    logits = q @ k.T / 8.0
    assert np.abs(logits).max() > 200  # exp() of these overflows float32 without max-subtraction


def test_matrix_bytes_header_is_a_comment():
    data = matrix_bytes(np.ones((1, 2), np.float32), "txt", header="attnstep stage=Q head=0")
    assert data.splitlines()[0] == b"# attnstep stage=Q head=0"


@pytest.mark.parametrize("line, message", [
    ("causal = \"yes\"", "'causal' must be true or false"),
    ("scale = 0.0", "scale = 0.0: must be finite and non-zero in float32"),
    ("scale = 1e-50", "must be finite and non-zero in float32"),
    ("scale = 1e39", "must be finite and non-zero in float32"),
    ("seed = 99999999999999999999", "'seed' = 99999999999999999999: integer is out of the 64-bit range"),
    ("scale = 99999999999999999999", "'scale' = 99999999999999999999: integer is out of the 64-bit range"),
], ids=["causal-string", "scale-zero", "scale-underflow", "scale-overflow", "seed-huge", "scale-huge-int"])
def test_manifest_value_types_and_scale(tmp_path, line, message):
    generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2))
    manifest = tmp_path / "manifest.toml"
    key = line.split(" =")[0]
    kept = [ln for ln in manifest.read_text().splitlines() if not ln.startswith(key + " =")]
    manifest.write_text("\n".join(kept + [line]) + "\n")
    with pytest.raises(CaseError, match=message):
        load_input_case(tmp_path)


def test_manifest_without_format_follows_the_files(tmp_path):
    generate_case(tmp_path, Dims(1, 2, 3, 4, 2, 2), fmt="npy")
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(manifest.read_text().replace('format = "npy"\n', ""))
    assert load_input_case(tmp_path).fmt == "npy"


def test_text_reader_takes_only_the_contract_syntax():
    for bad, col in ((b"1 2 # note\n", 5), (b"1 2\f\n", 3), (b"0x1p3 1\n", 1), (b"1_0 1\n", 1)):
        with pytest.raises(CaseError, match=f"m.txt:1:{col}: not a number"):
            parse_text_matrix(bad, "m.txt")
    assert parse_text_matrix(b"1 2\r\n3 4\r\n", "m.txt").shape == (2, 2)  # CRLF, as the binary


def test_interrupted_generate_leaves_the_earlier_case_whole(tmp_path, monkeypatch):
    import verify.files.generate as gen
    generate_case(tmp_path, Dims(1, 3, 4, 4, 2, 2), seed=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = []

    def failing_write(path, mat, fmt):
        calls.append(path)
        if len(calls) == 4:  # after head 0 and one file of head 1
            raise CaseError(f"{path}: cannot write: disk full")
        return write_matrix(path, mat, fmt)

    monkeypatch.setattr(gen, "write_matrix", failing_write)
    with pytest.raises(CaseError, match="disk full"):
        generate_case(tmp_path, Dims(1, 2, 5, 5, 2, 2), seed=2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # untouched, no staging left


@pytest.mark.parametrize("junk", [b"\x00", b"\xc3\xa9", b"\x1b"], ids=["nul", "utf8", "escape"])
def test_manifest_is_ascii_text(tmp_path, junk):
    generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2))
    manifest = tmp_path / "manifest.toml"
    manifest.write_bytes(b"# note " + junk + b"\n" + manifest.read_bytes())
    with pytest.raises(CaseError, match=r"manifest.toml:1:8: byte 0x.. in the manifest"):
        load_input_case(tmp_path)


def test_writes_go_through_symlinks_and_never_over_special_files(tmp_path):
    import os
    import stat
    (tmp_path / "real").mkdir()
    (tmp_path / "m.txt").symlink_to(tmp_path / "real" / "m.txt")  # dangling: the write creates it
    write_matrix(tmp_path / "m.txt", np.ones((2, 2), np.float32), "txt")
    assert (tmp_path / "m.txt").is_symlink() and read_matrix(tmp_path / "real" / "m.txt").shape == (2, 2)
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(CaseError, match=r"pipe.txt: is a FIFO, not a regular file"):
        write_matrix(tmp_path / "pipe.txt", np.ones((2, 2), np.float32), "txt")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe.txt").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.txt", "pipe.txt", "real"]


def test_generate_takes_the_seeds_a_manifest_holds(tmp_path):
    with pytest.raises(CaseError, match=r"seed -1: must be in 0\.\."):
        generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2), seed=-1)
    with pytest.raises(CaseError, match=f"seed {2**63}: must be in 0"):
        generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2), seed=2**63)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind,words", [("fifo", "is a FIFO"), ("dev-zero", "is a character device"),
                                        ("folder", "is a folder")])
def test_only_regular_files_are_read(tmp_path, no_hang, kind, words):
    import os
    path = tmp_path / "m.txt"
    {"fifo": lambda: os.mkfifo(path), "dev-zero": lambda: path.symlink_to("/dev/zero"),
     "folder": path.mkdir}[kind]()
    with pytest.raises(CaseError) as exc:
        read_matrix(path, (2, 2))
    assert str(exc.value).startswith(f"{path}: {words}, not a regular file; HINT:")


def test_manifest_folder_is_named_as_the_binary_names_it(tmp_path):
    generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2))
    (tmp_path / "manifest.toml").unlink()
    (tmp_path / "manifest.toml").mkdir()
    with pytest.raises(CaseError, match=r"manifest.toml: is a folder, not a regular file"):
        load_input_case(tmp_path)


@pytest.mark.parametrize("fmt", ["txt", "npy"])
def test_file_larger_than_its_shape_allows_is_refused_unread(tmp_path, fmt):
    path = tmp_path / f"m.{fmt}"
    write_matrix(path, np.zeros((2, 2), np.float32), fmt)
    with open(path, "ab") as fh:
        fh.truncate(1 << 30)  # sparse: reading it would take a GiB of memory
    with pytest.raises(CaseError, match=r"1073741824 bytes is more than a .* matrix of 2 x 2 values"):
        read_matrix(path, (2, 2))


def test_npy_with_bytes_after_the_data_or_not_npy_at_all(tmp_path):
    import zipfile
    path = tmp_path / "m.npy"
    path.write_bytes(matrix_bytes(np.zeros((2, 2), np.float32), "npy") + b"\0\0\0\0")
    with pytest.raises(CaseError, match="4 bytes after the array data"):
        read_matrix(path)
    with zipfile.ZipFile(path, "w") as z:  # np.load would hand back an NpzFile
        z.writestr("a.npy", matrix_bytes(np.zeros((2, 2), np.float32), "npy"))
    with pytest.raises(CaseError, match="an .npz archive, not an .npy file"):
        read_matrix(path)


@pytest.mark.parametrize("array, words", [
    (np.zeros((256, 128)), r"Q_head_0.npy: dtype float64, expected float32 \('<f4'\) or float16 \('<f2'\); HINT: "),
    (np.full((256, 128), 0.5, dtype=object), r"holds Python objects \(dtype '\|O': a pickled array\), not numbers"),
    (np.zeros((512, 128), np.float32), r"Q_head_0.npy: shape 512x128, expected 256x128$"),
    (np.zeros((256, 128, 2), np.float32), r"Q_head_0.npy: 3-d array, expected a 2-d matrix$"),
], ids=["float64", "pickled", "other-shape", "3-d"])
def test_an_npy_too_large_for_its_matrix_says_what_it_holds(tmp_path, array, words):
    """NumPy's default float64, a pickled array of Python objects, another shape: each named from
    the file's header (as a file small enough to be read is), where the size alone would only say
    that the file is not this matrix."""
    path = tmp_path / "Q_head_0.npy"
    np.save(path, array, allow_pickle=True)
    assert path.stat().st_size > matrix_max_bytes((256, 128), "npy")  # refused before it is read
    with pytest.raises(CaseError, match=words):
        read_matrix(path, (256, 128))


def test_a_small_pickled_npy_is_named_not_called_damaged(tmp_path):
    path = tmp_path / "Q_head_0.npy"
    np.save(path, np.full((2, 2), 0.5, dtype=object), allow_pickle=True)
    with pytest.raises(CaseError, match=r"Q_head_0.npy: holds Python objects .*; HINT: convert them before"):
        read_matrix(path, (2, 2))
    with pytest.raises(CaseError, match="holds Python objects"):
        read_matrix(path)


def test_check_names_a_float64_input_in_one_line(runner, tmp_path):
    generate_case(tmp_path / "in", Dims(1, 1, 256, 6, 128, 8), fmt="npy")
    (tmp_path / "out").mkdir()
    np.save(tmp_path / "out" / "output_head_0.npy", np.zeros((256, 8), np.float32))  # another program's output
    q = tmp_path / "in" / "Q_head_0.npy"
    np.save(q, np.load(q).astype(np.float64))
    res = runner.invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.output.count("\n") == 1 and "Q_head_0.npy: dtype float64, expected float32" in res.output, res.output


def test_npy_descr_must_be_spelled_little_endian_float32(tmp_path):
    header = "{'descr': 'f4', 'fortran_order': False, 'shape': (2, 2), }"
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    path = tmp_path / "m.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(16))
    with pytest.raises(CaseError, match="dtype descr 'f4', expected '<f4'"):
        read_matrix(path)


@pytest.mark.parametrize("dims,words", [
    (Dims(641, 6700417, 1, 1, 1, 1), "batch x heads = 4294967297 heads; at most 16777216"),
    (Dims(1, 1, 2**24 + 1, 1, 1, 1), "'seq_q' = 16777217: dimensions must be in 1..16777216"),
    (Dims(4, 4, 2**24, 2**24, 1, 1), "16 heads of 844425047572480 stage elements each"),
], ids=["heads-beyond-int32", "dim-over-limit", "elements"])
def test_case_limits_are_the_binarys(dims, words):
    from verify.files.case import validate_dims
    with pytest.raises(CaseError, match=re.escape(words)):
        validate_dims({**dims.__dict__, "kv_heads": dims.kv}, "manifest.toml")


def test_case_limits_count_kv_stages_per_kv_head():
    """65536 heads of M = 2^24 keys, d 256: the K/V stages pass 2^48 elements once per query head,
    not once per K/V head with one K/V head; with 32768 K/V heads they do, said per kind of head, in
    the binary's words (stages.h case_limit_violation)."""
    from verify.files.case import validate_dims
    dims = Dims(1, 65536, 1, 2**24, 256, 256)
    validate_dims({**dims.__dict__, "kv_heads": 1}, "manifest.toml")
    with pytest.raises(CaseError, match="65536 heads of "):
        validate_dims({**dims.__dict__, "kv_heads": dims.heads}, "manifest.toml")
    with pytest.raises(CaseError, match="65536 query heads of 50332417 stage elements each and 32768 K/V heads of "
                                        "12884901888 each; at most 281474976710656 elements in all"):
        validate_dims({**dims.__dict__, "kv_heads": 32768}, "manifest.toml")


@pytest.mark.parametrize("line", ['generator = """x"""', "generator = '''x'''", 'scale = 5.', "seq_q = 02"])
def test_manifest_refuses_what_the_binary_refuses(tmp_path, line):
    generate_case(tmp_path, Dims(1, 1, 2, 2, 2, 2))
    manifest = tmp_path / "manifest.toml"
    key = line.split(" =")[0]
    kept = [ln for ln in manifest.read_text().splitlines() if not ln.startswith(key + " =")]
    manifest.write_text("\n".join(kept + [line]) + "\n")
    with pytest.raises(CaseError):
        load_input_case(tmp_path)


def test_a_file_of_the_other_format_is_an_error(tmp_path):
    generate_case(tmp_path, Dims(1, 2, 3, 4, 2, 2), fmt="npy")
    write_matrix(tmp_path / "K_head_1.txt", np.zeros((4, 2), np.float32), "txt")
    with pytest.raises(CaseError, match=r"K_head_1.txt: a .txt file in a .npy case"):
        load_input_case(tmp_path)


def test_counts_in_messages_agree_with_their_nouns(tmp_path):
    """'1 head', '1 significant digit': a count of one takes the singular."""
    from verify.files.resolution import Resolution
    from verify.text import plural
    assert [plural(n, "head") for n in (0, 1, 2)] == ["0 heads", "1 head", "2 heads"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    assert Resolution("digits", 1).describe() == "1 significant digit"
    assert Resolution("decimals", 1).describe() == "1 decimal" and Resolution("decimals", 2).describe() == "2 decimals"
    generate_case(tmp_path / "c", Dims(1, 1, 4, 5, 8, 8), fmt="txt", seed=0)
    (tmp_path / "c" / stage_file("K", 0, "txt")).unlink()
    with pytest.raises(CaseError, match=r"\(1 head expected\)"):
        load_input_case(tmp_path / "c")


def test_a_program_npy_whose_header_is_not_a_dict_is_one_line(tmp_path):
    """Another program's .npy stage whose header dict never closes (numpy parses it as Python source):
    `check` reports the stage unreadable, naming the file and why, as for any file it cannot read."""
    from helpers.cli import invoke
    case, out = tmp_path / "in", tmp_path / "out"
    assert invoke("generate", "--out", case, "--heads", "1", "--seq-q", "4", "--seq-k", "4", "--d-k", "8", "--d-v",
                  "8", "--format", "npy").exit_code == 0
    out.mkdir()
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), ".ljust(117) + b"\n"
    (out / "output_head_0.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
                                            + np.zeros((4, 8), np.float32).tobytes())
    r = invoke("check", "--in", case, "--out", out)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "UNREADABLE output head 0" in r.output
    assert "output_head_0.npy: not a valid .npy file (its header is not a dict literal)" in r.output

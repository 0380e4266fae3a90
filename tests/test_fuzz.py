"""Property-based fuzzing: corrupt valid case files at random and require that the
binary and the verifier either accept valid data or fail cleanly: a non-zero exit with a one-line
message, never a signal, never a traceback, never exit 0 on corrupt data. A variant case (grouped
K/V heads, a bottom-right causal window, softcap, ALiBi with a slopes file, per-head mask files, a
broadcast bias file, dropout) is fuzzed too: its variant inputs, its manifest's variant keys, and
its run's stage files (the keep-mask, the K/V heads' gradients)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from helpers.cli import invoke, time_limit  # noqa: E402
from verify.files.case import CaseError, load_input_case, read_matrix  # noqa: E402
from verify.files.generate import generate_case  # noqa: E402
from verify.files.patterns import VariantInputs  # noqa: E402
from verify.files.variant_inputs import TENSOR_INPUTS  # noqa: E402
from verify.runs.runner import run_binary  # noqa: E402
from verify.stages import FORMATS, GRAD_INPUT, STAGES, Dims, stage_file  # noqa: E402
from verify.variant import ALIGNMENTS, BOTTOM_RIGHT, NONE, TENSOR_COVERAGE, VARIANT_KEYS, Variant  # noqa: E402

DIMS = Dims(batch=1, heads=2, seq_q=5, seq_k=7, d_k=16, d_v=16)
# CI runs the same 60 examples per test every time (a submission's verdict does not depend on
# luck); ATTNSTEP_FUZZ_EXAMPLES=400 makes a longer local sweep over new random examples. The
# property sweeps are marked slow (`-m slow`); the fixed corruptions below run by default.
FUZZ_EXAMPLES = int(os.environ.get("ATTNSTEP_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="ATTNSTEP_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENS = [b"nan", b"inf", b"-inf", b"1e999", b"0x1p3", b"abc", b"1,5", b"--1", b"1e", b"", b" ", b"\t",
          b"\n", b"\x00", b"\xff", b"#", b"1.0.0", b"+-2", b"1_0", b"\r\n", b"9" * 400]
OPS = ("truncate", "delete_line", "insert", "replace", "duplicate_line", "empty")  # what _corrupt does


@st.composite
def corruption(draw):
    target = draw(st.sampled_from(["Q_head_0.txt", "K_head_1.txt", "V_head_1.txt", "manifest.toml"]))
    op = draw(st.sampled_from(OPS))
    return target, op, draw(st.floats(0, 1)), draw(st.sampled_from(TOKENS))


def _corrupt(data: bytes, op: str, where: float, token: bytes) -> bytes:
    pos = int(where * len(data))
    lines = data.split(b"\n")
    k = min(int(where * len(lines)), len(lines) - 1)
    if op == "truncate":
        return data[:pos]
    if op == "delete_line":
        return b"\n".join(lines[:k] + lines[k + 1:])
    if op == "insert":
        return data[:pos] + token + data[pos:]
    if op == "replace":
        return data[:pos] + token + data[pos + 1:]
    if op == "duplicate_line":
        return b"\n".join(lines[:k + 1] + lines[k:])
    return b""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pristine")
    generate_case(folder, DIMS, seed=11)
    return folder


def _python_error(folder) -> str:
    """The verifier's message on the input case (every input of every head: Q and dO per query
    head, K and V per K/V head, the variant's mask, bias and slopes), '' when it accepts it."""
    try:
        case = load_input_case(folder)
        for name in case.inputs:
            for i in range(case.dims.heads_of(name)):
                case.load(name, i)
        for i in range(case.dims.total_heads):
            for name in TENSOR_INPUTS:
                case.variant_input(name, i)
            if case.variant.alibi:
                case.alibi_slope(i)
        return ""
    except CaseError as exc:
        return str(exc)


def _assert_readers_agree(binary, folder, names: str = "") -> str:
    """The binary exits 0 or 2 (one error line, no run.toml) and accepts exactly what the verifier
    accepts; when both refuse, both messages name `names` (a file). Returns the binary's error line
    ('' when it ran)."""
    res = run_binary(binary, folder, folder / "out", backend="cpu", check=False, timeout=60)
    assert res.returncode in (0, 2), f"exit {res.returncode} (signal if < 0): {res.stderr[-400:]}"
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("main: error:")]
    if res.returncode == 2:
        assert len(lines) == 1, res.stderr
        assert not (folder / "out" / "run.toml").exists()
    python = _python_error(folder)
    assert (res.returncode == 0) == (python == ""), (res.stderr[-300:], python)
    if python:
        assert names in lines[0] and names in python, (lines[0], python)
    return lines[0] if lines else ""


def _copy(pristine, tmp_path_factory, name="case"):
    folder = tmp_path_factory.mktemp(name)
    shutil.copytree(pristine, folder, dirs_exist_ok=True)
    return folder


@pytest.mark.slow
@FUZZ
@given(corruption())
def test_binary_fails_cleanly_on_corrupt_inputs(binary, pristine, tmp_path_factory, c):
    target, op, where, token = c
    folder = _copy(pristine, tmp_path_factory)
    path = folder / target
    path.write_bytes(_corrupt(path.read_bytes(), op, where, token))
    _assert_readers_agree(binary, folder)


def _backward_case(tmp_path_factory, fmt: str):
    """A case with the output gradient dO."""
    folder = tmp_path_factory.mktemp(f"pristine_backward_{fmt}")
    generate_case(folder, DIMS, seed=13, fmt=fmt, backward=True)
    return folder


@pytest.fixture(scope="module", params=FORMATS)
def pristine_backward(request, tmp_path_factory):
    return _backward_case(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def pristine_backward_txt(tmp_path_factory):
    return _backward_case(tmp_path_factory, "txt")


def _grad_file(folder, head: int) -> Path:
    (path,) = folder.glob(stage_file(GRAD_INPUT, head, "*"))
    return path


@pytest.mark.slow
@FUZZ
@given(st.integers(0, DIMS.total_heads - 1), st.sampled_from(OPS), st.floats(0, 1), st.sampled_from(TOKENS))
def test_both_readers_refuse_a_corrupt_dO_alike(binary, pristine_backward, tmp_path_factory, head, op, where,
                                                token):
    """Bad tokens, NaN, a row too many or too few, a truncated .npy: the binary and the verifier
    accept or refuse dO together, with one line naming the file."""
    folder = _copy(pristine_backward, tmp_path_factory)
    path = _grad_file(folder, head)
    path.write_bytes(_corrupt(path.read_bytes(), op, where, token))
    _assert_readers_agree(binary, folder, path.name)


@pytest.mark.parametrize("change", ["missing", "wrong-shape", "nan", "transposed"])
def test_both_readers_refuse_a_dO_of_one_head_alike(binary, pristine_backward, tmp_path_factory, change):
    folder = _copy(pristine_backward, tmp_path_factory)
    path = _grad_file(folder, DIMS.total_heads - 1)
    if change == "missing":
        path.unlink()
    else:
        rows, cols = STAGES[GRAD_INPUT].shape(DIMS)
        x = read_matrix(path, (rows, cols))
        x = {"wrong-shape": x[:, 1:], "nan": np.where(np.arange(cols) == 3, np.nan, x),
             "transposed": x.T}[change]
        np.save(path, x.astype(np.float32)) if path.suffix == ".npy" else np.savetxt(path, x, fmt="%.9g")
    assert _assert_readers_agree(binary, folder, path.name)


@pytest.mark.parametrize("garble", [b"6na", b"1x)", b"16("])
def test_a_garbled_npy_header_is_a_one_line_error_of_both(binary, tmp_path_factory, garble):
    """A header dict that numpy's parser cannot even tokenize is a bad file, not a crash."""
    folder = _backward_case(tmp_path_factory, "npy")
    path = _grad_file(folder, 0)
    path.write_bytes(path.read_bytes().replace(b"16)", garble, 1))  # the shape (5, 16), same length
    assert _assert_readers_agree(binary, folder, path.name)


@pytest.mark.parametrize("comment", [b"#", b"# x"])
def test_a_comment_in_an_npy_header_is_refused_by_both(binary, tmp_path_factory, comment):
    """numpy reads the header dict as Python source, where '#' starts a comment; the contract's
    header (and the binary) has none: a damaged file, refused by both."""
    folder = _backward_case(tmp_path_factory, "npy")
    path = _grad_file(folder, 0)
    data = path.read_bytes()
    end = data.index(b"\n", 10)  # the header's padding spaces end at its newline
    path.write_bytes(data[:end - len(comment)] + comment + data[end:])
    assert _assert_readers_agree(binary, folder, path.name)


# The shapes of TOML values where a hand-written reader drifts from tomllib: leading zeros, points
# without digits, underscores, prefixed integers, 64-bit overflow, special floats, string escapes.
_INT_PARTS = ["0", "5", "05", "00", "+5", "-5", "1_0", "1__0", "_1", "1_", "9223372036854775807",
              "9223372036854775808", "99999999999999999999"]
_FRACTIONS = ["", "", ".", ".5", ".5_0", "._5", ".05"]
_EXPONENTS = ["", "", "e3", "E+3", "e-0_1", "e", "e+", "e400", "e-400"]
_WORDS = ["inf", "+inf", "-nan", "nan", "Inf", "infinity", "0x10", "0X10", "0x_1", "0o17", "0o8", "0b10",
          "0b2", "0x", "-0x1", "0xffffffffffffffff", ".5", "5.", "1e5.0", "true", "True", "false",
          "1979-05-27", "[5]", "{}", "", "1 2", "5#c"]
_STRINGS = ['"x"', "'x'", '"""x"""', "'''x'''", r'"\u00e9"', r'"\ud800"', r'"\U0010FFFF"', r'"\U00110000"',
            r'"\x41"', r'"a\tb"', r'"\e"', r'"\u00E"', '"open', '"x" y', "'it''s'", '""', '"#"', r'"\u0000"']
manifest_values = st.one_of(
    st.builds(lambda i, f, e: i + f + e, st.sampled_from(_INT_PARTS), st.sampled_from(_FRACTIONS),
              st.sampled_from(_EXPONENTS)),
    st.sampled_from(_WORDS), st.sampled_from(_STRINGS))


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["seq_q", "scale", "seed", "generator", "causal"]), manifest_values,
       st.sampled_from(["{}", '"{}"', "'{}'"]), st.sampled_from(["", " # note", "\t#"]))
def test_both_readers_agree_on_manifest_values(binary, pristine, tmp_path_factory, key, value, key_form,
                                                comment):
    folder = _copy(pristine, tmp_path_factory)
    manifest = folder / "manifest.toml"
    kept = [ln for ln in manifest.read_text().splitlines() if not ln.startswith(key + " =")]
    manifest.write_text("\n".join(kept + [f"{key_form.format(key)} = {value}{comment}"]) + "\n")
    _assert_readers_agree(binary, folder)


@pytest.fixture(scope="module")
def pristine_npy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pristine_npy")
    generate_case(folder, DIMS, seed=12, fmt="npy")
    return folder


@st.composite
def npy_headers(draw):
    """Header dicts around np.save's `{'descr': '<f4', 'fortran_order': False, 'shape': (7, 16), }`."""
    values = {"descr": draw(st.sampled_from(["'<f4'", '"<f4"', "'f4'", "'>f4'", "'<f8'"])),
              "fortran_order": draw(st.sampled_from(["False", "False", "True", "0", "false"])),
              "shape": draw(st.sampled_from(["(7, 16)", "(7,16)", "(7, 16,)", "( 7 , 16 )", "(07, 16)", "(7, 1_6)",
                                             "[7, 16]", "(112,)", "(7, 16, 1)", "(112)", "(-7, 16)"]))}
    keys = draw(st.permutations(list(values)))
    dropped = draw(st.sampled_from([None, None, *values]))
    extra = draw(st.sampled_from(["", "", "'extra': 1, ", "'descr': '<f4', "]))
    quote = draw(st.sampled_from(["'", '"']))
    sep = draw(st.sampled_from([", ", ",", " , "]))
    body = sep.join(f"{quote}{k}{quote}: {values[k]}" for k in keys if k != dropped)
    return "{" + extra + body + draw(st.sampled_from(["", ",", ", "])) + "}"


@pytest.mark.slow
@FUZZ
@given(npy_headers())
def test_both_readers_agree_on_npy_headers(binary, pristine_npy, tmp_path_factory, header):
    folder = _copy(pristine_npy, tmp_path_factory)
    path = folder / "K_head_1.npy"
    data = np.load(path).tobytes()
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data)
    _assert_readers_agree(binary, folder)


@pytest.mark.parametrize("stray", ["K_head_1.txt", "Q_head_0.txt", "V_head_2.txt"])
def test_a_stray_file_of_the_other_format_is_refused_by_both(binary, pristine_npy, tmp_path_factory, stray):
    folder = _copy(pristine_npy, tmp_path_factory)
    (folder / stray).write_text("1 2\n")
    assert _assert_readers_agree(binary, folder)


def test_a_folder_named_manifest_gets_the_same_message_from_both(binary, pristine, tmp_path_factory):
    folder = _copy(pristine, tmp_path_factory)
    (folder / "manifest.toml").unlink()
    (folder / "manifest.toml").mkdir()
    line = _assert_readers_agree(binary, folder)
    assert line == "main: error: " + _python_error(folder).split("; HINT:")[0]
    assert line.endswith("manifest.toml: is a folder, not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_check_refuses_a_stage_file_that_is_not_a_regular_file(binary, pristine, tmp_path_factory, kind):
    """A FIFO would block check, /dev/zero would fill memory: both are unreadable stage files."""
    folder = tmp_path_factory.mktemp("run")
    run_binary(binary, pristine, folder, backend="cpu")
    path = folder / "QK_head_1.txt"
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    res = subprocess.run([sys.executable, "-m", "verify", "check", "--in", str(pristine), "--out", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 1, res.stdout[-1500:] + res.stderr[-500:]
    assert "not a regular file" in res.stdout + res.stderr


def _corrupted_run_never_passes(binary, case: Path, folder: Path, target: str, op, where, token) -> None:
    """The binary's run of `case` into `folder`, its file `target` corrupted, checked: never a
    traceback, and never a pass once a stage file changed (run.toml may change harmlessly).
    `check` runs in this process (a new Python per example would spend most of the sweep starting
    up): an exception that escapes it, what `attnstep check` would print as a traceback, fails the
    example with that traceback."""
    run_binary(binary, case, folder, backend="cpu")
    path = folder / target
    before = path.read_bytes()
    after = _corrupt(before, op, where, token)
    path.write_bytes(after)
    with time_limit(120, "check of a corrupted folder"):  # a hang fails the example
        res = invoke("check", "--in", case, "--out", folder)  # an exception propagates
    assert res.exit_code in (0, 1, 2), res.output[-1500:]
    if after != before and target != "run.toml":
        assert res.exit_code != 0, res.output[-1500:]


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["QK_head_0.txt", "attention_weights_head_1.txt", "flash_lse_head_0.txt", "dO_head_1.txt",
                        "D_head_0.txt", "dS_head_1.txt", "dK_head_0.txt", "flash_dQ_head_1.txt",
                        "flash_dV_head_0.txt", "run.toml"]),
       st.sampled_from(OPS), st.floats(0, 1), st.sampled_from(TOKENS))
def test_verifier_never_passes_corrupt_outputs(binary, pristine_backward_txt, tmp_path_factory, target, op, where,
                                               token):
    """Forward and backward stage files of a case with dO."""
    _corrupted_run_never_passes(binary, pristine_backward_txt, tmp_path_factory.mktemp("run"), target, op, where,
                                token)


# ------------------------------------------------------------------ a variant case
VARIANT_DIMS = Dims(batch=2, heads=4, seq_q=5, seq_k=7, d_k=16, d_v=16, kv_heads=2)
VARIANT = Variant(causal=True, align=BOTTOM_RIGHT, window=(3, -1), softcap=5.0, alibi=True, dropout=0.2,
                  dropout_seed=3)
VARIANT_INPUTS = VariantInputs(mask="random", mask_heads="per-head", bias="random", bias_heads="broadcast",
                               slopes="random")
# Its files the input fuzz corrupts: a mask of the first and of the last query head, the broadcast
# bias, the slopes, the last K/V head's K, the manifest.
VARIANT_TARGETS = ["mask_head_0.txt", "mask_head_7.txt", "bias.txt", "alibi_slopes.txt", "K_head_3.txt",
                   "manifest.toml"]
# The manifest's variant keys with values of their own kind beside the generic ones.
VARIANT_WORDS = [f'"{w}"' for w in ALIGNMENTS + TENSOR_COVERAGE + (NONE,)] + ["-1", "-2", "0", "1", "2", "3", "4",
                                                                            "0.2", "1.0", "true", "false"]


@pytest.fixture(scope="module")
def pristine_variant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pristine_variant")
    generate_case(folder, VARIANT_DIMS, seed=17, backward=True, variant=VARIANT, inputs=VARIANT_INPUTS)
    return folder


def test_the_variant_case_is_read_alike_by_both(binary, pristine_variant, tmp_path_factory):
    """The pristine variant case: both readers accept it (the fuzz below starts from agreement)."""
    assert _assert_readers_agree(binary, _copy(pristine_variant, tmp_path_factory)) == ""


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(VARIANT_TARGETS), st.sampled_from(OPS), st.floats(0, 1), st.sampled_from(TOKENS))
def test_both_readers_refuse_corrupt_variant_inputs_alike(binary, pristine_variant, tmp_path_factory, target, op,
                                                          where, token):
    """A mask, bias or slopes file, a K/V head's K or the manifest of a variant case corrupted: the
    binary and the verifier accept or refuse it together, in one line."""
    folder = _copy(pristine_variant, tmp_path_factory)
    path = folder / target
    path.write_bytes(_corrupt(path.read_bytes(), op, where, token))
    _assert_readers_agree(binary, folder)


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(sorted(VARIANT_KEYS) + ["kv_heads"]), st.one_of(manifest_values, st.sampled_from(VARIANT_WORDS)),
       st.sampled_from(["", " # note"]))
def test_both_readers_agree_on_variant_manifest_values(binary, pristine_variant, tmp_path_factory, key, value,
                                                       comment):
    """Any value of a variant key (valid or not, of its type or not) in a variant case's manifest:
    both readers accept it or refuse it alike."""
    folder = _copy(pristine_variant, tmp_path_factory)
    manifest = folder / "manifest.toml"
    kept = [ln for ln in manifest.read_text().splitlines() if not ln.startswith(key + " =")]
    manifest.write_text("\n".join(kept + [f"{key} = {value}{comment}"]) + "\n")
    _assert_readers_agree(binary, folder)


@pytest.mark.slow
@settings(FUZZ, max_examples=max(1, FUZZ_EXAMPLES // 3))  # a check each: a third of the examples
@given(st.sampled_from(["dropout_mask_head_1.txt", "QK_scaled_head_0.txt", "attention_weights_head_7.txt",
                        "dK_head_3.txt", "dV_head_0.txt", "flash_lse_head_2.txt", "flash_dK_head_1.txt",
                        "flash_output_head_5.txt", "run.toml"]),
       st.sampled_from(OPS), st.floats(0, 1), st.sampled_from(TOKENS))
def test_verifier_never_passes_corrupt_variant_outputs(binary, pristine_variant, tmp_path_factory, target, op, where,
                                                       token):
    """A variant run's stage files corrupted (the keep-mask, masked scores, a K/V head's gradient,
    the flash lse): never a traceback, never a pass."""
    _corrupted_run_never_passes(binary, pristine_variant, tmp_path_factory.mktemp("run"), target, op, where, token)


# ------------------------------------------------------------------ interrupted runs
INTERRUPTS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGKILL")
RUN_DIMS = Dims(batch=1, heads=6, seq_q=256, seq_k=256, d_k=32, d_v=32)


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory, binary):
    """An input case, a complete earlier run of it, and how long a full run takes."""
    import time
    folder = tmp_path_factory.mktemp("interrupted")
    generate_case(folder / "in", RUN_DIMS, seed=5, fmt="npy")
    first = run_binary(binary, folder / "in", folder / "out", backend="cpu", extra=["--stages", "QK,flash_lse"],
                       check=False)
    assert first.returncode == 0, first.stderr
    t0 = time.monotonic()
    full = run_binary(binary, folder / "in", folder / "full", backend="cpu", check=False)
    assert full.returncode == 0, full.stderr
    return folder, time.monotonic() - t0


@pytest.mark.slow
@FUZZ
@given(when=st.floats(0, 1.2), sig=st.sampled_from(INTERRUPTS))
def test_interrupted_runs_never_verify_and_keep_the_previous_run(binary, previous_run, tmp_path_factory, when, sig):
    """A signal at any moment of a run: either the run finished (and its files are complete), or
    the previous run's files are there byte for byte and the folder is refused as unfinished."""
    import signal
    import time

    from verify.files.outputs import open_run
    from verify.files.unfinished import read_marker
    from helpers.interrupting import PREVIOUS_DIR, leftovers, snapshot

    folder, seconds = previous_run
    out = tmp_path_factory.mktemp("run") / "out"
    shutil.copytree(folder / "out", out)
    before = snapshot(out)
    proc = subprocess.Popen([str(binary), "--in", str(folder / "in"), "--out", str(out), "--backend", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(when * seconds)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=300)
    case = load_input_case(folder / "in")
    killed = sig == "SIGKILL"
    if read_marker(out) is not None:  # the run did not finish: refused, the previous run kept
        with pytest.raises(CaseError, match="did not finish"):
            open_run(out, case)
        if killed:  # perhaps while the finished run was put in place: each earlier file kept whole
            kept = snapshot(out), snapshot(out / PREVIOUS_DIR) if (out / PREVIOUS_DIR).is_dir() else {}
            assert all(any(k.get(n) == data for k in kept) for n, data in before.items())
        else:
            assert snapshot(out) == before, f"{sig} at {when:.2f} of the run changed the previous run's files"
            assert proc.returncode == 128 + getattr(signal, sig) and "main: error: interrupted by" in err, err
            assert leftovers(out) == []
    elif (out / "run.toml").read_bytes() == before["run.toml"]:  # stopped before the run began
        assert snapshot(out) == before
        assert proc.returncode < 0 or "the run had not begun" in err, err
        assert killed or leftovers(out) == []
    else:  # finished: the signal came after the run was in place
        assert open_run(out, case).stages and (killed or proc.returncode == 0), err
        assert killed or leftovers(out) == []

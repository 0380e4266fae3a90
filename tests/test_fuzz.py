"""Property-based fuzzing (issue #4): corrupt valid case files at random and require that the
binary and the verifier either accept valid data or fail cleanly: a non-zero exit with a one-line
message, never a signal, never a traceback, never exit 0 on corrupt data."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from verify.case import CaseError, load_input_case  # noqa: E402
from verify.generate import generate_case  # noqa: E402
from verify.runner import run_binary  # noqa: E402
from verify.stages import Dims  # noqa: E402

DIMS = Dims(batch=1, heads=2, seq_q=5, seq_k=7, d_k=16, d_v=16)
# CI runs 60 examples per test; ATTNSTEP_FUZZ_EXAMPLES=400 makes a longer local sweep.
FUZZ_EXAMPLES = int(os.environ.get("ATTNSTEP_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENS = [b"nan", b"inf", b"-inf", b"1e999", b"0x1p3", b"abc", b"1,5", b"--1", b"1e", b"", b" ", b"\t",
          b"\n", b"\x00", b"\xff", b"#", b"1.0.0", b"+-2", b"1_0", b"\r\n", b"9" * 400]


@st.composite
def corruption(draw):
    target = draw(st.sampled_from(["Q_head_0.txt", "K_head_1.txt", "V_head_1.txt", "manifest.toml"]))
    op = draw(st.sampled_from(["truncate", "delete_line", "insert", "replace", "duplicate_line", "empty"]))
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


def _python_accepts(folder) -> bool:
    try:
        case = load_input_case(folder)
        for i in range(case.dims.total_heads):
            for name in ("Q", "K", "V"):
                case.load(name, i)
        return True
    except CaseError:
        return False


@FUZZ
@given(corruption())
def test_binary_fails_cleanly_on_corrupt_inputs(binary, pristine, tmp_path_factory, c):
    target, op, where, token = c
    folder = tmp_path_factory.mktemp("case")
    shutil.copytree(pristine, folder, dirs_exist_ok=True)
    path = folder / target
    path.write_bytes(_corrupt(path.read_bytes(), op, where, token))
    res = run_binary(binary, folder, folder / "out", backend="cpu", check=False, timeout=60)
    assert res.returncode in (0, 2), f"exit {res.returncode} (signal if < 0): {res.stderr[-400:]}"
    if res.returncode == 2:
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("main: error:")]
        assert len(lines) == 1, res.stderr
        assert not (folder / "out" / "run.toml").exists()
    # The two readers agree on what is valid: the binary never accepts what the verifier rejects.
    assert (res.returncode == 0) == _python_accepts(folder), (res.returncode, res.stderr[-300:])


@FUZZ
@given(st.sampled_from(["QK_head_0.txt", "attention_weights_head_1.txt", "flash_lse_head_0.txt",
                        "run.toml"]), st.sampled_from(["truncate", "delete_line", "insert", "replace",
                                                       "duplicate_line", "empty"]),
       st.floats(0, 1), st.sampled_from(TOKENS))
def test_verifier_never_passes_corrupt_outputs(binary, pristine, tmp_path_factory, target, op, where, token):
    folder = tmp_path_factory.mktemp("run")
    run_binary(binary, pristine, folder, backend="cpu")
    path = folder / target
    before = path.read_bytes()
    after = _corrupt(before, op, where, token)
    path.write_bytes(after)
    res = subprocess.run([sys.executable, "-m", "verify", "check", "--in", str(pristine), "--out", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode in (0, 1, 2)
    if after != before and target != "run.toml":
        assert res.returncode != 0, res.stdout[-1500:]

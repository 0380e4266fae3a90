"""The one-pass kernel of tensor-core truncation's model on a CUDA device (verify/model/fused.py).

* Run by Triton's interpreter on the CPU, in a process of its own: the running sum and the sum of its magnitudes after
  each MMA_K-long chunk equal NumPy's chunk-by-chunk loop (verify/model/mma.py) to 1e-12 relative
  to the magnitudes, for short and long sums, sums cut into segments, a last chunk shorter than
  MMA_K, a transposed operand, and a running sum carried in from an earlier tile.
* Where it cannot run (tensors off CUDA, or Triton failing), the PyTorch composition computes the
  same sums instead, and a failure is not retried; shapes it does not take (an empty product,
  running sums of another shape, elements beyond its 32-bit offsets) go to the composition too,
  the kernel kept for the rest.
* On a GPU (marked gpu): the kernel runs, and equals the composition on the shapes a 32768-key
  head's tiles give it.
Without PyTorch (or Triton, for the interpreter) the tests skip with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from verify.model import fused, mma
from verify.model.kernels import MMA_K


def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'attnstep[gpu]')")


# Triton reads TRITON_INTERPRET as it compiles its own library, at its import: the interpreted
# kernel runs in a process of its own, started with it set. Each case: (R, K, C, a carried running
# sum, A given as a transposed view, B and the carried sums likewise); long sums are cut into
# segments even at these sizes.
_INTERPRETED_CASES = {"short": (5, 37, 7, False, False, False), "carried": (33, 100, 40, True, False, False),
                      "segments": (16, 8 * 70, 9, False, False, False),
                      "segments-short-last-chunk": (3, 8 * 200 + 3, 5, True, False, False),
                      "transposed": (24, 40, 6, False, True, False),
                      "transposed-b-and-carried": (12, 80, 10, True, False, True),
                      "column-tiles": (40, 8 * 3 + 1, 129, True, True, True),
                      "nonfinite": (9, 8 * 5 + 2, 70, False, False, False)}
_INTERPRETER = """
import json, sys
import numpy as np, torch, triton, triton.language as tl
from verify.model import fused, mma
from verify.model.kernels import MMA_K

# Some Triton releases' interpreters cannot run a loop bounded by a kernel argument (3.6 turns the
# bound into a one-element array that NumPy refuses as an index): nothing to test there.
@triton.jit
def probe(out, n):
    count = 0
    for i in range(0, n):
        count += 1
    tl.store(out, count)
try:
    probe[(1,)](torch.zeros(1, dtype=torch.int32), 3)
except Exception as exc:
    print(json.dumps({"unavailable": f"Triton {triton.__version__}'s interpreter cannot run a loop over a kernel "
                                     f"argument ({type(exc).__name__})"}))
    sys.exit(0)
fused.PROGRAMS_WANTED, fused.MIN_SEGMENT_CHUNKS = 64, 4
out = {}
def view(x, transposed):
    return torch.tensor(x.T.copy()).T if transposed else torch.tensor(x)
for name, (R, K, C, carried, a_t, b_t) in json.loads(sys.argv[1]).items():
    rng = np.random.default_rng(R * K)
    A, B = rng.standard_normal((R, K)), rng.standard_normal((K, C))
    if name == "nonfinite":  # (an inf and a NaN: the same entries non-finite, none spread by padding)
        A[1, 20], B[33, 65] = np.inf, np.nan
    partial = rng.standard_normal((R, C)) if carried else np.zeros((R, C))
    total = np.abs(rng.standard_normal((R, C))) if carried else np.zeros((R, C))
    want_p, want_t = mma.mma_running_sums(A, B, partial.copy(), total.copy())
    got_p, got_t = fused._launch(view(A, a_t), view(B, b_t), view(partial, b_t), view(total, b_t), MMA_K)
    got_t, got_p = got_t.numpy(), got_p.numpy()
    if not (np.array_equal(np.isnan(got_t), np.isnan(want_t)) and np.array_equal(np.isnan(got_p), np.isnan(want_p))
            and np.array_equal(np.isinf(got_t), np.isinf(want_t))):
        out[name] = [np.inf, np.inf]
        continue
    ok = np.isfinite(want_t) & np.isfinite(want_p)
    # (a running sum near 0: its difference against the magnitudes)
    out[name] = [float(np.max(np.abs(got_t - want_t)[ok] / want_t[ok])),
                 float(np.max(np.abs(got_p - want_p)[ok] / want_t[ok]))]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    """Each case's largest relative differences (total, running sum) of the kernel under Triton's
    interpreter (CPU tensors) from NumPy's loop."""
    _torch()
    pytest.importorskip("triton", reason="Triton is not installed (it comes with PyTorch's CUDA builds)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _INTERPRETER, json.dumps(_INTERPRETED_CASES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    if "unavailable" in result:
        pytest.skip(result["unavailable"])
    return result


@pytest.mark.parametrize("case", list(_INTERPRETED_CASES))
def test_the_interpreted_kernel_sums_as_numpy_does(interpreted, case):
    """Short and long sums, segments, a last chunk shorter than MMA_K, a running sum carried in,
    operands given as transposed views (dK's and dV's Xᵀ·Y over the queries), strides and all, more
    than one tile of columns, and non-finite entries (where they spread, as in NumPy's loop)."""
    total, running = interpreted[case]
    assert total < 1e-12 and running < 1e-12, (total, running)


def test_off_cuda_the_composition_sums(monkeypatch):
    """PyTorch on the CPU (the tests' device): no kernel, the batched composition, the same sums."""
    torch = _torch()
    rng = np.random.default_rng(5)
    A, B = rng.standard_normal((9, 64)), rng.standard_normal((64, 11))
    zeros = torch.zeros(9, 11, dtype=torch.float64)
    assert fused.running_sums(torch.tensor(A), torch.tensor(B), zeros, zeros, MMA_K) is None
    launched = []
    monkeypatch.setattr(fused, "_launch", lambda *a: launched.append(a))
    got_p, got_t = mma.mma_running_sums(torch.tensor(A), torch.tensor(B), zeros, zeros)
    want_p, want_t = mma.mma_running_sums(A, B, np.zeros((9, 11)), np.zeros((9, 11)))  # (NumPy: the loop)
    assert not launched
    assert float(np.max(np.abs(got_t.numpy() - want_t) / want_t)) < 1e-12
    assert float(np.max(np.abs(got_p.numpy() - want_p) / want_t)) < 1e-12


def _failing_kernel(monkeypatch, error: Exception) -> list:
    """running_sums with a kernel that raises `error` at launch; the launches tried, listed."""
    calls: list = []

    def failing(*args):
        calls.append(args)
        raise error
    monkeypatch.setattr(fused, "_usable", lambda *xs: True)
    monkeypatch.setattr(fused, "_kernel", lambda: (None, None))
    monkeypatch.setattr(fused, "_launch", failing)
    monkeypatch.setattr(fused, "_BROKEN", [False])
    return calls


def test_a_kernel_that_fails_leaves_the_composition_for_good(monkeypatch):
    """Triton failing to compile or launch (an old driver, a missing compiler) is not the check's
    error: the composition sums, a warning says so once, and the kernel is not tried again."""
    calls = _failing_kernel(monkeypatch, RuntimeError("no compiler here"))
    with pytest.warns(RuntimeWarning, match="no compiler here.*PyTorch's operations compute it instead"):
        assert fused.running_sums(None, None, None, None, MMA_K) is None
    assert fused.running_sums(None, None, None, None, MMA_K) is None
    assert len(calls) == 1 and fused._BROKEN == [True]


def test_the_gpus_memory_running_out_is_the_checks_error(monkeypatch):
    """Out of the GPU's memory is not a kernel that fails here: it reaches the check (one line,
    exit status 3), and the kernel stays on."""
    class OutOfMemoryError(RuntimeError):  # (PyTorch's, by name: the check's handler knows it so)
        pass
    _failing_kernel(monkeypatch, OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(OutOfMemoryError):
        fused.running_sums(None, None, None, None, MMA_K)
    assert fused._BROKEN == [False]


class _Operand:
    """What running_sums asks of a CUDA tensor, without one: a float64 operand's shape and strides."""

    def __init__(self, *shape, strides=None):
        self.shape, self._strides = shape, strides or (shape[1], 1)
        self.is_cuda, self.dtype = True, SimpleNamespace(is_floating_point=True)

    def element_size(self):
        return 8

    def stride(self, axis):
        return self._strides[axis]


@pytest.mark.parametrize("why, operands, offsets", [
    ("an empty product", (_Operand(0, 8), _Operand(8, 5), _Operand(0, 5), _Operand(0, 5)), None),
    ("nothing to sum", (_Operand(4, 0), _Operand(0, 5), _Operand(4, 5), _Operand(4, 5)), None),
    ("running sums of another shape", (_Operand(4, 8), _Operand(8, 5), _Operand(1, 5), _Operand(4, 5)), None),
    ("elements beyond its offsets", (_Operand(4, 8), _Operand(8, 5), _Operand(4, 5), _Operand(4, 5)), 30)],
    ids=lambda x: x if isinstance(x, str) else "")
def test_the_kernel_leaves_to_the_composition(monkeypatch, why, operands, offsets):
    """Shapes the kernel does not take (an empty grid would fail to launch and turn the kernel off
    for the rest of the check; 32-bit offsets would wrap) go to the composition, the kernel kept."""
    if offsets is not None:
        monkeypatch.setattr(fused, "_MAX_OFFSET", offsets)
    monkeypatch.setattr(fused, "_kernel", lambda: pytest.fail("the kernel was asked for"))
    monkeypatch.setattr(fused, "_BROKEN", [False])
    assert fused.running_sums(*operands, MMA_K) is None
    assert fused._BROKEN == [False]
    monkeypatch.setattr(fused, "_MAX_OFFSET", 2**31 - 1)
    assert fused._usable(_Operand(4, 8), _Operand(8, 5), _Operand(4, 5), _Operand(4, 5), MMA_K)  # (the control)


# The operands a 32768-key head's row tiles of 1024 rows give the kernel (d 128): the logits'
# Q·Kᵀ (a short sum, a long output), P·V (a long sum, a short output: in segments), dK's Xᵀ·Y.
_TILE_SHAPES = {"QK": ((1024, 128), (128, 32768), False), "PV": ((1024, 32768), (32768, 128), False),
                "dK": ((32768, 1024), (1024, 128), True)}


@pytest.mark.gpu
@pytest.mark.parametrize("which", list(_TILE_SHAPES))
def test_on_a_gpu_the_kernel_runs_and_sums_as_the_composition(cuda_torch, monkeypatch, which):
    torch = cuda_torch
    pytest.importorskip("triton", reason="Triton is not installed (it comes with PyTorch's CUDA builds)")
    a_shape, b_shape, transposed = _TILE_SHAPES[which]
    g = torch.Generator(device="cuda").manual_seed(1)
    A = torch.randn(a_shape[::-1] if transposed else a_shape, dtype=torch.float64, device="cuda", generator=g)
    A = A.T if transposed else A
    B = torch.randn(b_shape, dtype=torch.float64, device="cuda", generator=g)
    partial = torch.randn(a_shape[0], b_shape[1], dtype=torch.float64, device="cuda", generator=g)
    total = partial.abs()
    monkeypatch.setattr(fused, "_BROKEN", [False])
    got = fused.running_sums(A, B, partial, total, MMA_K)
    assert got is not None and fused._BROKEN == [False]
    monkeypatch.setattr(fused, "_BROKEN", [True])  # the composition
    want = mma.mma_running_sums(A, B, partial, total)
    scale = want[1]
    assert float(((got[1] - want[1]).abs() / scale).max()) < 1e-12
    assert float(((got[0] - want[0]).abs() / scale).max()) < 1e-12

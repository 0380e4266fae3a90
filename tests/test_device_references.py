"""The flash stages' float64 references on another array namespace (verify/model/arrays.py).

The same model code runs on NumPy and, through array_api_compat, on PyTorch; here PyTorch's
float64 on the CPU, which is the code `check --device cuda` runs on a GPU.

* flash_output and flash_lse references from PyTorch equal NumPy's to 1e-12 (relative to each
  row's largest magnitude) on plain, causal, bottom-right, windowed and grouped heads, whole and in
  row tiles, and the device path does run on PyTorch tensors (a reference that stayed in NumPy is
  caught).
* The check of the CPU binary's flash run (forward and backward, grouped K/V heads, causal) and of
  a NumPy program's flash output with no run.toml reports the same verdicts and bounds on either;
  a planted bug (a base-2 lse) fails with the same diagnosis.
* `--device cpu` never imports PyTorch; `--device cuda` without a GPU is one line, exit 2; auto
  keeps small heads, and a check asked for several processes, on NumPy.
* On a GPU (marked gpu): `check --device cuda` reports what `--device cpu` does.
Without PyTorch (or array_api_compat) the PyTorch tests skip with the reason.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import attnstep

from helpers.cli import invoke
from helpers.reports import assert_same_report
from verify.check import tolerance
from verify.check.devices import device_for
from verify.check.sizing import NO_MEMORY_EXIT
from verify.check.reference import compute_stage, reference_chain
from verify.cli import check as check_cli
from verify.model import arrays, dot, mma, tiles
from verify.model.dot import rowdot_var, rowdot_var_later
from verify.specs import flash as flash_spec
from verify.specs.backward import flash_bounds, flash_chain_pass, flash_tiles
from verify.stages import FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT
from verify.model.scores import HeadVariant
from verify.model.softmax import EqualTerms, correlated_sum
from verify.variant import BOTTOM_RIGHT, Variant


def _torch():
    pytest.importorskip("array_api_compat", reason="array-api-compat is not installed (pip install 'attnstep[gpu]')")
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'attnstep[gpu]')")


@pytest.fixture
def cuda_arrays(cuda_torch):
    """PyTorch with a CUDA device and the array namespace the device references run through
    (array-api-compat, the gpu extra): skipped with the reason where either is missing."""
    _torch()
    return cuda_torch


FLASH = (FLASH_OUTPUT, FLASH_LSE, FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)
VARIANTS = {
    "plain": Variant(),
    "causal": Variant(causal=True),
    "bottom-right": Variant(causal=True, align=BOTTOM_RIGHT),
    "window": Variant(window=(7, 3)),
}


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Equal to 1e-12 of the largest finite magnitude (a row that cancels to 0, a gradient of a
    query that sees one key, is 0 only to its roundings on either); the same infinities."""
    assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(a[~np.isfinite(a)], b[~np.isfinite(b)])
    fa, fb = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(b), b, 0.0)
    assert np.all(np.abs(fa - fb) <= 1e-12 * np.max(np.abs(fa), initial=0.0))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("tile_bytes", [1 << 40, 8 * 70 * 8], ids=["whole", "tiles"])
def test_torch_references_equal_numpy(name, tile_bytes, monkeypatch):
    _torch()
    monkeypatch.setattr(tiles, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", tile_bytes)
    rng = np.random.default_rng(1)
    src = {k: rng.normal(size=(n, 16)).astype(np.float32) for k, n in (("Q", 45), ("K", 70), ("V", 70))}
    variant = VARIANTS[name]
    for stage in (FLASH_OUTPUT, FLASH_LSE):
        flash_spec._LAST_LSE.clear()  # (flash_lse's own pass, not flash_output's kept lse)
        want = compute_stage(stage, src, 0.3, variant.causal, variant=variant)
        seen = []
        to_numpy = arrays.to_numpy
        monkeypatch.setattr("verify.specs.flash.to_numpy", lambda x: (seen.append(type(x).__module__), to_numpy(x))[1])
        flash_spec._LAST_LSE.clear()
        with arrays.on_device("torch-cpu"):
            got = compute_stage(stage, src, 0.3, variant.causal, variant=variant)
        assert seen and set(seen) == {"torch"}, seen  # the reference was computed on PyTorch tensors
        assert isinstance(got, np.ndarray) and got.dtype == np.float64
        _close(want, got)


@pytest.mark.parametrize("name", VARIANTS)
def test_torch_gradient_references_equal_numpy(name, monkeypatch):
    """flash_dQ, flash_dK, flash_dV's references (a row tile at a time) on PyTorch tensors."""
    _torch()
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", 8 * 70 * 8)
    rng = np.random.default_rng(4)
    x = {k: rng.normal(size=(n, 16)) for k, n in (("Q", 45), ("K", 70), ("V", 70), ("dO", 45))}
    variant, grads = VARIANTS[name], (FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)
    want = reference_chain(x, 0.3, variant.causal, grads, variant=variant)
    moved = []
    to_numpy = arrays.to_numpy
    monkeypatch.setattr(flash_tiles, "to_numpy", lambda v: (moved.append(type(v).__module__), to_numpy(v))[1])
    flash_tiles._LAST.clear()  # (the last head's gradients, kept by the ids of its sources)
    with arrays.on_device("torch-cpu"):
        got = reference_chain(x, 0.3, variant.causal, grads, variant=variant)
    flash_tiles._LAST.clear()
    assert moved == ["torch"] * 3
    for st in grads:
        _close(want[st], got[st])


def _first_leaf(x) -> str:
    """The module of the first array in nested tuples."""
    while isinstance(x, tuple):
        x = x[0]
    return type(x).__module__


KERNELS = {"cpu": {}, "gpu-fast-tf32": dict(backend="cuda", flash_kernel="cuda-fast-tf32", precision="tf32")}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("exact", [False, True], ids=["expected-model", "exact-model"])
def test_torch_bounds_equal_numpy(name, kernel, exact, monkeypatch):
    """Every flash stage's chained and isolated bounds (the isolated from a program's float32
    flash_output and flash_lse), in row tiles, with rows of equal terms (repeated keys: their
    roundings grouped). exact: small heads' exact dot-product model, which the device hands to
    NumPy; else the long heads' expected one."""
    _torch()
    if not exact:
        monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 10)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", 8 * 70 * 8)
    rng = np.random.default_rng(3)
    x = {k: rng.normal(size=(n, 16)).astype(np.float32).astype(np.float64)
         for k, n in (("Q", 45), ("K", 70), ("V", 70), ("dO", 45))}
    x["K"][10:20] = x["K"][3]  # equal scores in every row
    variant = VARIANTS[name]
    args = dict(scale=0.3, causal=variant.causal, variant=variant, **KERNELS[kernel])
    bounds, moved = [], []
    numpy, numpy_all = flash_spec._numpy, flash_bounds.to_numpy_all
    monkeypatch.setattr(flash_spec, "_numpy", lambda v: (moved.append(type(v).__module__), numpy(v))[1])
    for module in (flash_bounds, flash_chain_pass):
        monkeypatch.setattr(module, "to_numpy_all", lambda v: (moved.append(_first_leaf(v)), numpy_all(v))[1])
    for device in (None, "torch-cpu"):
        flash_tiles._LAST.clear()
        with arrays.on_device(device):
            chain = reference_chain(x, 0.3, variant.causal, FLASH, variant=variant)
            full = {**x, **chain}
            own = {**x, **{s: chain[s].astype(np.float32).astype(np.float64) for s in (FLASH_OUTPUT, FLASH_LSE)}}
            bounds.append([tolerance.chained_bound(st, full, cache=tolerance.HeadCache(), **args) for st in FLASH]
                          + [tolerance.stage_bound(st, own, chain[st], cache=tolerance.HeadCache(), **args)
                             for st in FLASH])
    flash_tiles._LAST.clear()
    # the device's results were PyTorch tensors: the forward's rows, the backward's chain and own
    assert moved and set(moved) == {"torch"} and len(moved) >= 4, moved
    for a, b in zip(*bounds):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=0)


@pytest.mark.parametrize("batch", [1 << 25, 3 * 5 * 7, 1], ids=["one-batch", "batches", "chunk-by-chunk"])
def test_the_device_truncation_model_batches_its_chunks(batch, monkeypatch):
    """On a device the tensor-core chunks' running sums come from batched GEMMs (a few launches,
    not one per 8-long chunk): the same as NumPy's chunk by chunk, a short last chunk included,
    carried across calls as the row tiles carry them."""
    torch = _torch()
    monkeypatch.setattr(mma, "_MMA_BATCH_ELEMS", batch)
    rng = np.random.default_rng(5)
    A, B = rng.normal(size=(5, 61)), rng.normal(size=(61, 7))
    want = dot.mma_truncation_det(A, B, 2.0**-24, 2)
    got = dot.mma_truncation_det(torch.as_tensor(A), torch.as_tensor(B), 2.0**-24, 2)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=0)
    carry = [tiles.MmaCarry() for _ in range(2)]
    for a, b in ((0, 16), (16, 61)):  # two row tiles of X (61 rows)
        carry[0].add(A.T[a:b], B[a:b])
        carry[1].add(torch.as_tensor(A.T[a:b]), torch.as_tensor(B[a:b]))
    np.testing.assert_allclose(carry[1].det(2.0**-24, 2).numpy(), carry[0].det(2.0**-24, 2), rtol=1e-12, atol=0)


def test_equal_terms_regroup_alike_on_a_device():
    """correlated_sum's groups of equal terms (zeros among them), found and summed on the device
    without reading the rows back, give NumPy's sums; rows without repeated nonzero terms (zeros
    repeated alone) are left as they are, and one of a single term too."""
    torch = _torch()
    rng = np.random.default_rng(4)
    for cols in (60, 1):
        terms = rng.choice(rng.random(9).astype(np.float32), size=(7, cols))
        terms[rng.random(terms.shape) < 0.2] = 0
        terms[0] = np.arange(1, cols + 1, dtype=np.float32)
        terms[1] = np.where(np.arange(cols) % 3 == 0, 0, np.arange(1, cols + 1)).astype(np.float32)
        var = rng.random(terms.shape)
        want = correlated_sum(var, EqualTerms(terms))
        got = correlated_sum(torch.as_tensor(var), EqualTerms(torch.as_tensor(terms)))
        assert isinstance(got, torch.Tensor) and want[0] == var[0].sum() and want[1] == var[1].sum()
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=0)


def test_equal_terms_on_a_device_read_nothing_back(monkeypatch):
    """Finding and summing the groups on a device reads nothing back to the host: a read would
    wait for every kernel queued before it, once a row tile."""
    torch = _torch()
    rng = np.random.default_rng(5)
    terms = torch.as_tensor(rng.choice(rng.random(5).astype(np.float32), size=(4, 30)))
    var = torch.as_tensor(rng.random((4, 30)))

    def read_back(*args, **kwargs):
        raise AssertionError("read back to the host")
    for name in ("cpu", "numpy", "item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    monkeypatch.setattr(torch, "nonzero", read_back)
    assert correlated_sum(var, EqualTerms(terms)).shape == (4,)


def _rows_to_sort():
    """float32 rows with negative values, both zeros, infinities, repeats and a strided view."""
    rng = np.random.default_rng(8)
    x = rng.choice(np.float32([-3.5, -1, -0.0, 0.0, 1e-40, 0.25, 2, np.inf, -np.inf]), size=(6, 90))
    x[0] = rng.standard_normal(90).astype(np.float32)
    return x[:, ::-1]  # (not contiguous)


def test_rows_sort_with_their_columns_in_one_sort():
    """sort_rows_with_columns gives NumPy's sorted values and the columns they came from: equal
    values in column order (a stable argsort's), −0 just before +0; float32 only."""
    x = _rows_to_sort()
    values, columns = arrays.sort_rows_with_columns(x)
    np.testing.assert_array_equal(values, np.sort(x, axis=1))
    np.testing.assert_array_equal(np.take_along_axis(x, columns, axis=1), values)
    for row, cols in zip(x, columns):
        nonzero = [c for c in np.argsort(row, kind="stable") if row[c] != 0]
        zeros = [c for c in range(row.size) if row[c] == 0 and np.signbit(row[c])] + \
                [c for c in range(row.size) if row[c] == 0 and not np.signbit(row[c])]
        assert [c for c in cols if row[c] != 0] == nonzero
        assert [c for c in cols if row[c] == 0] == zeros
    with pytest.raises(TypeError, match="float32"):
        arrays.sort_rows_with_columns(x.astype(np.float64))


def test_rows_sort_alike_on_a_device():
    torch = _torch()
    x = _rows_to_sort()
    want = arrays.sort_rows_with_columns(x)
    got = arrays.sort_rows_with_columns(torch.as_tensor(x.copy()))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_clip_takes_python_bounds():
    """A bound given as a Python float, on NumPy's arrays and scalars; NaN stays NaN."""
    x = np.array([np.nan, -2.0, 0.5, 3.0])
    np.testing.assert_array_equal(arrays.clip(x, low=0.0), [np.nan, 0.0, 0.5, 3.0])
    np.testing.assert_array_equal(arrays.clip(x, high=1.0), [np.nan, -2.0, 0.5, 1.0])
    assert arrays.clip(np.float64(5.0), high=1.0) == 1.0 and arrays.clip(2.0, low=3.0) == 3.0


def test_clip_takes_python_bounds_on_a_device():
    """On PyTorch's tensors too, with no copy of the bound to the device (a copy waits for it)."""
    torch = _torch()
    x = torch.as_tensor([np.nan, -2.0, 0.5, 3.0])
    copies = []
    real = torch.as_tensor
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "as_tensor", lambda *a, **k: copies.append(a) or real(*a, **k))
        mp.setattr(torch, "asarray", lambda *a, **k: copies.append(a) or real(*a, **k))
        got = arrays.clip(x, low=0.0, high=1.0)
    np.testing.assert_array_equal(got.numpy(), [np.nan, 0.0, 0.5, 1.0])
    assert not copies


def test_isfinite_is_numpys_on_a_device_in_two_passes():
    """arrays.isfinite: NumPy's isfinite on PyTorch's tensors (NaN and ±inf, float64 and float32),
    from two element-wise kernels where PyTorch's own isfinite launches four."""
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))
    x = np.array([np.nan, -np.inf, np.inf, -0.0, 1e308, -1e-320, np.finfo(np.float64).max])
    for dtype in (np.float64, np.float32):
        with np.errstate(over="ignore"):
            y = x.astype(dtype)
        t = torch.as_tensor(y)
        np.testing.assert_array_equal(arrays.isfinite(y), np.isfinite(y))
        with Kernels() as seen:
            got = arrays.isfinite(t)
        np.testing.assert_array_equal(got.numpy(), np.isfinite(y))
        assert len(seen.calls) == 2, seen.calls
    assert arrays.isfinite(torch.arange(3)).all()


def test_common_factor_logits_stay_finite_under_a_cap():
    """An infinite input under a softcap: the capped logit is ±C, finite, but scale·QK before the cap
    is infinite and its slope 0, so the factor's product is NaN; the logits a common scale factor
    multiplies are 0 there (a NaN would make its row's Σ p·S, and every bound of the row, NaN)."""
    from verify.model.flash import common_factor_logits  # noqa: PLC0415
    Q = np.array([[1.0, np.inf], [0.5, -0.25]])
    K = np.array([[1.0, 2.0], [-1.0, 0.5], [0.25, 0.0]])
    with np.errstate(invalid="ignore", over="ignore"):
        out = common_factor_logits(Q, K, 0.3, HeadVariant(Variant(softcap=2.0)), None)
    assert len(out) == 2
    for S in out:
        assert np.isfinite(S).all(), S


@pytest.mark.parametrize("name", VARIANTS)
def test_a_device_builds_the_mask_of_a_row_tile_itself(name, monkeypatch):
    """The causal flag's and window's mask of a row tile, built on the device from the indices, is
    the tile's rows of the head's mask (NumPy's); none is built by NumPy for it."""
    torch = _torch()
    head = HeadVariant(VARIANTS[name])
    n, m = 37, 53
    whole = head.hidden(n, m)
    monkeypatch.setattr(HeadVariant, "hidden", lambda *a, **k: pytest.fail("a mask built by NumPy"))
    x = torch.zeros((1, 1), dtype=torch.float64)
    for a, b in ((0, n), (0, 16), (16, 32), (32, 37)):
        tile = head.rows_of(a, b, n)
        got = tile.hidden_like(x, b - a, m)
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), whole[a:b])
        inner = tile.rows_of(1, 3, b - a)  # a tile of a tile
        assert np.array_equal(inner.hidden_like(x, 2, m).numpy(), whole[a + 1:a + 3])


def test_a_device_takes_larger_row_tiles():
    """A few MB of scores a tile in NumPy; hundreds of MB on a GPU (its launches amortized)."""
    n = m = 1 << 14
    cpu = tiles.row_tiles(n, m, 128)
    with arrays.on_device("torch-cpu"):
        gpu = tiles.row_tiles(n, m, 128)
    assert len(cpu) == 8 * n * m // tiles.TILE_BYTES and len(gpu) == 8 * n * m // tiles.DEVICE_TILE_BYTES
    assert all(a % 16 == 0 for a, _ in gpu) and gpu[-1][1] == n


def test_a_variant_the_device_path_lacks_stays_with_numpy():
    _torch()
    rng = np.random.default_rng(2)
    src = {k: rng.normal(size=(20, 8)) for k in ("Q", "K", "V")}
    softcap = Variant(softcap=2.0)
    want = compute_stage(FLASH_OUTPUT, src, 0.3, False, variant=softcap)
    with arrays.on_device("torch-cpu"):
        assert np.array_equal(compute_stage(FLASH_OUTPUT, src, 0.3, False, variant=softcap), want)


def _check_json(tmp_path, case, out, device: str, monkeypatch, *extra) -> dict:
    """check's JSON report with the flash references on `device` (torch-cpu: PyTorch on the CPU)."""
    monkeypatch.setattr(check_cli, "_device", lambda name: device)
    path = tmp_path / f"{device}.json"
    r = invoke("check", "--in", case, "--out", out, "--json", path, *extra)
    assert r.exit_code in (0, 1), r.output
    return json.loads(path.read_text())


def test_the_binary_flash_run_reports_the_same(tmp_path, binary, monkeypatch):
    _torch()
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 4, "--kv-heads", 2, "--seq-q", 45, "--seq-k", 70, "--d-k", 16,
               "--d-v", 16, "--causal", "bottom-right", "--backward", "--format", "npy")
    assert r.exit_code == 0, r.output
    done = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", "--stages", "flash"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", 8 * 70 * 8)
    reports = [_check_json(tmp_path, case, out, d, monkeypatch) for d in ("cpu", "torch-cpu")]
    assert reports[0]["passed"]
    assert_same_report(*reports, rtol=1e-12)


def _flash_program(case, out, log2: bool, heads: int = 2) -> None:
    """A NumPy program's flash forward in float32, %.9g text of its own names, no run.toml; with
    log2, its lse in base 2 (a classic bug)."""
    out.mkdir()
    for h in range(heads):
        q, k, v = (np.loadtxt(case / f"{x}_head_{h}.txt", ndmin=2).astype(np.float32) for x in "QKV")
        s = (q @ k.T) * np.float32(0.25)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        l = e.sum(axis=1, keepdims=True)
        lse = (m + np.log(l)) / (np.float32(np.log(2)) if log2 else 1)
        np.savetxt(out / f"o{h}.txt", (e / l) @ v, fmt="%.9g")
        np.savetxt(out / f"lse{h}.txt", lse, fmt="%.9g")


@pytest.mark.parametrize("log2", [False, True], ids=["correct", "lse-log2"])
def test_a_foreign_program_reports_the_same(tmp_path, monkeypatch, log2):
    _torch()
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 2, "--seq-q", 30, "--seq-k", 50, "--d-k", 16, "--d-v", 16)
    assert r.exit_code == 0, r.output
    _flash_program(case, out, log2)
    names = ("--scale", 0.25, "--name", "flash_output=o{i}.txt", "--name", "flash_lse=lse{i}.txt")
    reports = [_check_json(tmp_path, case, out, d, monkeypatch, *names) for d in ("cpu", "torch-cpu")]
    assert_same_report(*reports, rtol=1e-12)
    assert reports[0]["passed"] is not log2
    if log2:
        assert reports[0]["first_failing_stage"] == FLASH_LSE
        assert "lse_log2" in json.dumps([x for x in reports[1]["results"] if x["stage"] == FLASH_LSE])


def _flash_backward_program(case, out, scale_dk: bool) -> None:
    """A NumPy program's gradients in float32, its own order of arithmetic (the whole softmax, then
    D from its own output), %.9g text of its own names, no run.toml, the gradients alone; without
    scale_dk, dK misses the scale (a classic bug)."""
    out.mkdir()
    for h in range(2):
        q, k, v, do = (np.loadtxt(case / f"{x}_head_{h}.txt", ndmin=2).astype(np.float32) for x in ("Q", "K", "V", "dO"))
        s = (q @ k.T) * np.float32(0.25)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        ds = p * (do @ v.T - np.sum(do * (p @ v), axis=1, keepdims=True))
        np.savetxt(out / f"gq{h}.txt", (ds @ k) * np.float32(0.25), fmt="%.9g")
        np.savetxt(out / f"gk{h}.txt", (ds.T @ q) * np.float32(0.25 if scale_dk else 1.0), fmt="%.9g")
        np.savetxt(out / f"gv{h}.txt", p.T @ do, fmt="%.9g")


@pytest.mark.parametrize("scale_dk", [True, False], ids=["correct", "dk-unscaled"])
def test_a_foreign_programs_gradients_report_the_same(tmp_path, monkeypatch, scale_dk):
    """The gradients of a program we did not write, checked a row tile at a time on a device (the
    chain's tiles, their equal terms and D's rows read back later) and with NumPy: the same report,
    a pass where it is right and dK named where it is wrong."""
    _torch()
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 2, "--seq-q", 40, "--seq-k", 70, "--d-k", 16, "--d-v", 16,
               "--backward")
    assert r.exit_code == 0, r.output
    _flash_backward_program(case, out, scale_dk)
    # Row tiles of 8 (a head's sums over 40 queries past the exact model), D's rows in the exact one.
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 40 * 16)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", 8 * 70 * 8)
    names = ("--scale", 0.25, "--name", "flash_dQ=gq{i}.txt", "--name", "flash_dK=gk{i}.txt",
             "--name", "flash_dV=gv{i}.txt")
    reports = [_check_json(tmp_path, case, out, d, monkeypatch, *names) for d in ("cpu", "torch-cpu")]
    assert_same_report(*reports, rtol=1e-12)
    assert reports[0]["passed"] is scale_dk
    if not scale_dk:
        assert reports[1]["first_failing_stage"] == FLASH_GRAD_KEYS


def test_the_cpu_path_never_imports_torch(tmp_path):
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 1, "--seq-q", 8, "--seq-k", 8, "--d-k", 8, "--d-v", 8)
    assert r.exit_code == 0, r.output
    _flash_program(case, out, False, heads=1)
    code = ("import sys; from verify.cli.group import main\n"
            f"sys.argv = ['attnstep', 'check', '--in', {str(case)!r}, '--out', {str(out)!r}, '--quiet', '--device', "
            "'cpu', '--scale', '0.25', '--name', 'flash_output=o{i}.txt', '--name', 'flash_lse=lse{i}.txt']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules and 'array_api_compat' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    if arrays.cuda_visible():
        pytest.skip("a CUDA device is visible here")
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--device", "cuda")
    assert r.exit_code == 2
    assert "--device cuda:" in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("missing", ("torch", "array_api_compat"))
def test_a_gpu_extra_module_missing_is_one_line_and_auto_keeps_to_numpy(tmp_path, monkeypatch, missing):
    """Either module of the gpu extra absent (PyTorch installed without array-api-compat, say):
    --device cuda names it in one line, and auto checks with NumPy, whatever GPU there is."""
    real, present = importlib.util.find_spec, object()  # (the other module: installed, whatever this machine has)
    gpu_modules = dict(arrays._GPU_MODULES)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else
                        present if name in gpu_modules else real(name, *a))
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--device", "cuda")
    pip_name = dict(arrays._GPU_MODULES)[missing]
    assert r.exit_code == 2 and f"--device cuda: {pip_name} is not installed" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    with arrays.on_device("auto", arrays.AUTO_MIN_SCORES, 0) as device:
        assert device == "cpu"


def test_a_pytorch_that_fails_to_load_is_one_line_and_auto_keeps_to_numpy(tmp_path, monkeypatch):
    """PyTorch installed but failing to load (a CUDA library missing raises OSError, not ImportError):
    --device cuda says so in one line; auto, the default, checks with NumPy on a machine with a GPU."""
    def broken():
        raise OSError("libcudnn.so.9: cannot open shared object file")
    monkeypatch.setattr(arrays, "_torch", broken)
    monkeypatch.setattr(arrays, "_gpu_extra_missing", lambda: None)
    monkeypatch.setattr(arrays, "_gpu_may_exist", lambda: True)
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--device", "cuda")
    assert r.exit_code == 2 and "--device cuda: PyTorch could not be loaded (libcudnn" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    with arrays.on_device("auto", arrays.AUTO_MIN_SCORES, 0) as device:
        assert device == "cpu"


def test_the_gpu_out_of_memory_is_one_line(tmp_path, monkeypatch):
    """PyTorch's out-of-memory error (a RuntimeError of its own) ends the check in one line, exit 3."""
    oom = type("OutOfMemoryError", (RuntimeError,), {})

    def check_and_report(*args, **kwargs):
        raise oom("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(check_cli, "check_and_report", check_and_report)
    monkeypatch.setattr(check_cli, "check_folders_apart", lambda *a: None)
    monkeypatch.setattr(check_cli, "check_reports_apart", lambda *a: None)
    r = invoke("check", "--in", tmp_path / "in", "--out", tmp_path / "out", "--device", "cpu")
    assert r.exit_code == NO_MEMORY_EXIT and "out of GPU memory while checking the stages" in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_runs_the_gpu_does_not_compute_stay_with_numpy():
    """The GPU computes the flash stages' references of the plain variants: a run of other stages, or
    under a softcap, ALiBi, bias files or dropout, is NumPy's even when cuda is asked; auto takes the
    GPU only for a run without N×M stages."""
    flash = ("flash_output", "flash_lse")
    run = lambda stages, **v: SimpleNamespace(stages=stages, precision="fp32", variant=Variant(**v))  # noqa: E731
    assert device_for(run(flash), "auto") == "auto" and device_for(run(flash), "cuda") == "cuda"
    assert device_for(run(flash + ("QK",)), "auto") == "cpu" and device_for(run(flash + ("QK",)), "cuda") == "cuda"
    for variant in ({"softcap": 30.0}, {"alibi": True}, {"dropout": 0.1}):
        assert device_for(run(flash, **variant), "cuda") == "cpu", variant
    assert device_for(run(("output",)), "cuda") == "cpu" and device_for(run(flash), "cpu") == "cpu"


def test_auto_keeps_small_heads_and_several_processes_on_numpy():
    for scores, jobs in ((arrays.AUTO_MIN_SCORES - 1, 0), (arrays.AUTO_MIN_SCORES, 2)):
        with arrays.on_device("auto", scores, jobs) as device:
            assert device == "cpu" and arrays.target() is None
    if not arrays.cuda_visible():
        with arrays.on_device("auto", arrays.AUTO_MIN_SCORES, 0) as device:
            assert device == "cpu"


def test_the_python_api_takes_a_device():
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(2, 20, 8)).astype(np.float32) for _ in range(3))
    s = np.einsum("hnd,hmd->hnm", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(8)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    stages = {"flash_output": ((p / p.sum(axis=-1, keepdims=True)) @ v).astype(np.float32)}
    assert attnstep.check_arrays(q, k, v, stages, device="cpu").passed
    with pytest.raises(TypeError, match="^device: expected one of auto, cpu, cuda"):
        attnstep.check_arrays(q, k, v, stages, device=1)
    if not arrays.cuda_visible():
        with pytest.raises(ValueError, match="^device='cuda': "):
            attnstep.check_arrays(q, k, v, stages, device="cuda")


@pytest.mark.gpu
def test_check_on_the_gpu_reports_what_the_cpu_does(tmp_path, binary, cuda_arrays):
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 4, "--seq-q", 300, "--seq-k", 400, "--d-k", 64, "--d-v", 64,
               "--causal", "--backward", "--format", "npy")
    assert r.exit_code == 0, r.output
    done = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--stages", "flash"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reports = []
    for device in ("cpu", "cuda"):
        r = invoke("check", "--in", case, "--out", out, "--device", device, "--json", tmp_path / f"{device}.json")
        assert r.exit_code == 0, r.output
        reports.append(json.loads((tmp_path / f"{device}.json").read_text()))
    assert_same_report(*reports, rtol=1e-12)


def test_the_visible_gpus_are_named_as_a_child_process_would_see_them(monkeypatch):
    """check --scheduler local gives each GPU's worker CUDA_VISIBLE_DEVICES of one of these: this
    process's own entries where it has them (as many as CUDA counts), else the indices."""
    monkeypatch.setattr(arrays, "cuda_visible", lambda: True)
    monkeypatch.setattr(arrays, "_torch", lambda: SimpleNamespace(cuda=SimpleNamespace(device_count=lambda: 2)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")  # (CUDA counts the first two: say 7 is not there)
    assert arrays.visible_gpus() == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert arrays.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(arrays, "cuda_visible", lambda: False)
    assert arrays.visible_gpus() == []


def test_the_gpus_memory_is_the_smallest_of_those_asked_for(monkeypatch):
    sizes = [80, 40, 24]

    def properties(i):
        if sizes[i] is None:
            raise RuntimeError("CUDA error: initialization error")
        return SimpleNamespace(total_memory=sizes[i])
    monkeypatch.setattr(arrays, "cuda_visible", lambda: True)
    monkeypatch.setattr(arrays, "_torch", lambda: SimpleNamespace(
        cuda=SimpleNamespace(device_count=lambda: len(sizes), get_device_properties=properties)))
    assert [arrays.gpu_memory_bytes(n) for n in (1, 2, 3, 5)] == [80, 40, 24, 24]
    sizes[0] = None
    assert arrays.gpu_memory_bytes(2) is None  # (a GPU that cannot start: the caller's default)
    monkeypatch.setattr(arrays, "cuda_visible", lambda: False)
    assert arrays.gpu_memory_bytes(1) is None


def test_rows_read_back_later_give_the_rows_model():
    """rowdot_var_later (the flash chain's D rows, NumPy's exact model for a device's rows): the
    model of rowdot_var, on NumPy and on a device."""
    torch = _torch()
    rng = np.random.default_rng(6)
    A, B = rng.normal(size=(12, 64)), rng.normal(size=(12, 64))
    want = rowdot_var(A, B, 2.0**-24)
    assert np.array_equal(rowdot_var_later(A, B, 2.0**-24)(), want)
    got = rowdot_var_later(torch.as_tensor(A), torch.as_tensor(B), 2.0**-24)()
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)


@pytest.mark.gpu
def test_on_a_gpu_copies_that_do_not_wait_carry_the_values(cuda_torch):
    """arrays.to_numpy_later's copy, started before more kernels are queued, holds the values as
    they were; arrays.like's copy to the GPU (from page-locked memory, not waiting) those given."""
    torch = cuda_torch
    x = torch.arange(1 << 20, dtype=torch.float64, device="cuda")
    later = arrays.to_numpy_later(x)
    x.mul_(2.0)  # (queued after the copy: not in it)
    y = x @ x
    np.testing.assert_array_equal(later(), np.arange(1 << 20, dtype=np.float64))
    mask = np.arange(1000) % 3 == 0
    np.testing.assert_array_equal(arrays.like(y, mask).cpu().numpy(), mask)


@pytest.mark.gpu
def test_on_a_gpu_results_come_back_as_numpy_arrays_of_their_values_and_dtype(cuda_torch):
    """arrays.to_numpy of a GPU tensor (copied into an array NumPy allocates): the same values and
    dtype as PyTorch's own copy, for the dtypes the model brings back, a 0-d tensor and a
    transposed (not contiguous) one; a NumPy array and a CPU tensor as they are."""
    torch = cuda_torch
    base = torch.arange(24, device="cuda").reshape(4, 6)
    for x in (base.to(torch.float64) / 7, base.to(torch.float32), base, base % 3 == 0,
              (base.to(torch.float64) / 7).T, torch.tensor(2.5, dtype=torch.float64, device="cuda")):
        got, want = arrays.to_numpy(x), x.cpu().numpy()
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    host = np.ones(3)
    assert arrays.to_numpy(host) is host
    cpu = torch.ones(3, dtype=torch.float64)
    assert np.shares_memory(arrays.to_numpy(cpu), cpu.numpy())  # (PyTorch on the CPU: no copy)


@pytest.mark.gpu
def test_on_a_gpu_a_tiles_host_work_queues_without_waiting(cuda_arrays):
    """Grouping and summing equal terms, arrays.like's upload and arrays.to_numpy_later's copy
    queue their work without waiting for the GPU (a wait would make a tile's host work and the
    GPU's take turns): PyTorch's sync debug mode raises on an operation that waits."""
    torch = cuda_arrays
    rng = np.random.default_rng(7)
    terms = torch.as_tensor(rng.choice(rng.random(5).astype(np.float32), size=(6, 50)), device="cuda")
    var = torch.as_tensor(rng.random((6, 50)), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = correlated_sum(var, EqualTerms(terms))
        mask = arrays.like(var, np.arange(50) % 2 == 0)
        later = arrays.to_numpy_later(got)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = correlated_sum(var.cpu().numpy(), EqualTerms(terms.cpu().numpy()))
    np.testing.assert_allclose(later(), want, rtol=1e-13, atol=0)
    assert mask.cpu().numpy().tolist() == (np.arange(50) % 2 == 0).tolist()

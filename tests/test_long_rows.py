"""The power of the check on long rows: the dot products' exact partial-sum energies, where
dot.ENERGY_EXACT_MAX_MACS allows them (raised here to 2^26, a head of 32 query rows at 32768 keys,
d = 64: the shipped limit is 2^24, for time), computed in blocks of bounded memory with the same bits; and the CPU flash kernel's row sum modelled in its
own tile order (verify/model/rowsum.py), which a float32 simulation of that order stays within,
and which run.toml's kernel must name (the binary's own tile width; not split; not another
program's)."""
from __future__ import annotations

import tomllib

import numpy as np
import pytest

from helpers.catch_rate import load_script
from verify.check.tolerance import stage_bound
from verify.model import dot
from verify.model.kernels import KERNELS, kernel_for
from verify.model.rounding import LAMBDA
from verify.model.rowsum import tiled_rowsum_var
from verify.model.softmax import _rowsum_step_var

U = 2.0**-24


def _qk(rng, rows: int, keys: int, d: int):
    Q = rng.uniform(-1, 1, (rows, d)).astype(np.float32).astype(np.float64)
    K = rng.uniform(-1, 1, (keys, d)).astype(np.float32).astype(np.float64)
    return Q, K


def test_the_long_row_head_takes_the_exact_energy(monkeypatch):
    """A row of a 32-row head at 32768 keys, d = 64 (2^26 multiply-adds) under a limit of 2^26:
    its variance in column blocks is the exact path's to 1e-12, not the random-order expectation
    (≈ 8× it) that the shipped limit of 2^24 gives."""
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 26)
    assert dot.exact_energy(32, 64, 32768) and not dot.exact_energy(33, 64, 32768)
    Q, K = _qk(np.random.default_rng(0), 1, 32768, 64)
    with dot.head_rows(32):
        shipped = dot.dot_var(Q, K.T, U)
        monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 40)
        exact = dot.dot_var(Q, K.T, U)
        monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 24)
        capped = dot.dot_var(Q, K.T, U)
    assert np.allclose(shipped, exact, rtol=1e-12, atol=0)
    assert np.median(capped / exact) > 4


def test_a_narrow_exact_head_is_still_tiled(monkeypatch):
    """The exact model of the query sums keeps a head whole, but never one of more scores than 2^24
    (under a limit of 2^26 multiply-adds: N = 4096, M = 8192, d = 1 is exact and tiled; d = 64,
    M = 32768 whole)."""
    from verify.model import tiles
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 26)
    assert dot.exact_energy(8192, 4096, 1) and len(tiles.row_tiles(4096, 8192, 1)) > 1
    assert tiles.row_tiles(32, 32768, 64) == [(0, 32)]


@pytest.mark.parametrize("shape", [(3, 64, 700), (2, 900, 37), (1, 4100, 9)])
def test_column_blocks_give_the_same_bits(monkeypatch, shape):
    """B's columns taken a few at a time (as a long sum of many columns is) change no bit."""
    R, K, C = shape
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((R, K)), rng.standard_normal((K, C)) + 0.2
    whole = dot.dot_var(A, B, U)
    monkeypatch.setattr(dot, "_MAX_BLOCK_ELEMS", 3 * K)
    assert len(dot._column_blocks(K, C)) > 1
    assert np.array_equal(dot.dot_var(A, B, U), whole)


def test_a_10x_error_beats_the_bound_of_a_head_above_the_old_cap(monkeypatch):
    """QK of a head above the old cap (32 rows, 8448 keys, d = 64), two of its rows: a float32 error
    10× the typical one exceeds most elements' bounds under the exact model (a limit of 2^26: all but
    those whose own error is large); the expectation of the shipped limit lets nearly all by."""
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 26)
    rng = np.random.default_rng(2)
    Q, K = _qk(rng, 32, 8448, 64)
    Q = Q[:2]
    ref = Q @ K.T
    typical = np.sqrt(np.mean(((Q.astype(np.float32) @ K.astype(np.float32).T) - ref) ** 2))

    def share_caught():
        with dot.head_rows(32):
            bound = stage_bound("QK", {"Q": Q, "K": K}, ref, scale=1.0, causal=False, backend="cpu")
        return np.mean(10 * typical > bound)
    assert share_caught() > 0.75
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 1 << 24)
    assert share_caught() < 0.1


def _kernel_row_sum(S32: np.ndarray, tile: int) -> np.ndarray:
    """lse of each row as the CPU flash kernel forms m and l (OnlineRows: a tile of keys summed
    from 0, the running sum rescaled by α = exp(m_old − m_new) and added), exp correctly rounded;
    without the final log's rounding."""
    n, M = S32.shape
    m, l = np.full(n, -np.inf, np.float32), np.zeros(n, np.float32)
    f32 = np.float32
    for c0 in range(0, M, tile):
        m_new = np.maximum(m, S32[:, c0:c0 + tile].max(axis=1))
        seen = m != -np.inf
        alpha = np.where(seen, np.exp(np.where(seen, m - m_new, f32(0)).astype(np.float64)).astype(f32), f32(0))
        rowsum = np.zeros(n, f32)
        for k in range(c0, min(M, c0 + tile)):
            rowsum = rowsum + np.exp((S32[:, k] - m_new).astype(np.float64)).astype(f32)
        l, m = alpha * l + rowsum, m_new
    return m.astype(np.float64) + np.log(l.astype(np.float64))


def _one_key(rng, n, M):
    """One key at the maximum, the others ~0.9·2^-24 of it: the first tile's 63 fall below half an ulp
    of its partial sum (1) and are dropped whole, an error of the same sign every time."""
    S = -16.74 + 0.01 * rng.standard_normal((n, M))
    S[:, 0] = 0.0
    return S


@pytest.mark.parametrize("dist", ["uniform", "normal", "large", "rising", "one_key"])
def test_the_kernels_row_sum_stays_within_its_tiled_bound(dist):
    """The float32 row sum in the kernel's order errs within 6.5σ of the tiled model (its exp
    roundings counted as the model counts them), and that σ is far below the index order's."""
    rng = np.random.default_rng(3)
    n, M = 48, 1500
    S = {"uniform": lambda: rng.uniform(-8, 8, (n, M)), "normal": lambda: 3 * rng.standard_normal((n, M)),
         "large": lambda: rng.uniform(-400, 400, (n, M)),
         "rising": lambda: np.sort(rng.uniform(-5, 5, (n, M)), axis=1),
         "one_key": lambda: _one_key(rng, n, M)}[dist]().astype(np.float32)
    S64 = S.astype(np.float64)
    top = S64.max(axis=1, keepdims=True)
    e = np.exp(S64 - top)
    exact = top[:, 0] + np.log(e.sum(axis=1))
    p = e / e.sum(axis=1, keepdims=True)
    exp_part = (p * p * (0.18 + (S64 - top) ** 2 / 3)).sum(axis=1) * U * U
    tiled = tiled_rowsum_var(p, U, 64, KERNELS["cpu-tiled"].exp_var)
    err = np.abs(_kernel_row_sum(S, 64) - exact)
    assert (err <= LAMBDA * np.sqrt(tiled + exp_part)).all()
    assert np.sqrt(np.mean(err**2)) > 0.5 * np.sqrt(np.mean(tiled + exp_part))  # (a σ, not a loose bound)
    if dist in ("uniform", "normal", "rising"):  # (elsewhere a few keys make the sum in either order)
        assert np.median(_rowsum_step_var(p, U) / tiled) > 4


def test_one_tile_or_none_is_the_index_orders_sum():
    """Up to one tile the kernel's order is index order; no visible key sums nothing."""
    rng = np.random.default_rng(4)
    p = rng.uniform(0, 1, (5, 50))
    p /= p.sum(axis=1, keepdims=True)
    forward = tiled_rowsum_var(p, U, 64, 0.18)
    assert forward.shape == (5,) and (forward <= _rowsum_step_var(p, U) * (1 + 1e-12)).all()
    assert (tiled_rowsum_var(np.zeros((2, 130)), U, 64, 0.18) == 0).all()


def test_only_the_binarys_unsplit_cpu_kernel_takes_the_tile_order(binary, tmp_path):
    """run.toml of the binary's CPU run names the kernel whose tile width the model takes; a split
    run, a backend named alone and a program of its own keep the order of any program."""
    assert kernel_for("cpu", flash_kernel="cpu-tiled").row_sum_tile == 64
    for kernel in (kernel_for("cpu", flash_kernel="cpu-tiled-split3"), kernel_for("cpu"), kernel_for(None),
                   kernel_for("cuda", flash_kernel="cuda-clean"), kernel_for(None, math="fast")):
        assert kernel.row_sum_tile == 0
    cr = load_script()
    _, out_dir = cr.make_run(tmp_path, binary, "uniform", 130, 3, 16, seed=1)
    run = tomllib.loads((out_dir / "run.toml").read_text())
    assert run["flash_kernel"] == "cpu-tiled"
    assert run["flash_block_k"] == KERNELS["cpu-tiled"].row_sum_tile


@pytest.mark.slow
def test_a_wrong_lse_of_a_long_row_is_caught(binary, tmp_path):
    """One lse element 10× the typical error off, 2048 keys: caught in the binary's run, where the
    index order's bound let every one by (the whole check's own per-stage step, as
    scripts/catch_rate.py runs it)."""
    cr = load_script()
    head = cr.Head(*cr.make_run(tmp_path, binary, "uniform", 2048, 8, 16, seed=0))
    cell = cr.plant_trials(head, "flash_lse", "uniform", 2048, 20, np.random.default_rng(5))
    assert cell.clean_passes and cell.rate() >= 0.9

"""The power of the check on long rows: the dot products' exact partial-sum energies, where
dot.ENERGY_EXACT_MAX_MACS allows them (raised here to 2^26, a head of 32 query rows at 32768 keys,
d = 64: the shipped limit is 2^24, for time), computed in blocks of bounded memory with the same bits."""
from __future__ import annotations

import numpy as np
import pytest

from verify.check.tolerance import stage_bound
from verify.model import dot

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

"""The online softmax the loops' diagnoses rebuild (verify/diagnose/softmax_loops.py): its closed
form against the kernel's loop over key tiles, step by step."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from verify.diagnose import screens, softmax_loops


def _loop(logits, values, tile: int, sum_scaled: bool, out_scaled: bool, lse: bool) -> np.ndarray:
    """A flash kernel's key loop: a running maximum, sum and output, each rescaled by
    exp(m_old − m_new) when a tile raises the maximum, or not."""
    n, m = logits.shape
    mx, total, acc = np.full(n, -np.inf), np.zeros(n), np.zeros((n, values.shape[1]))
    for k0 in range(0, m, tile):
        s = logits[:, k0:k0 + tile]
        new = np.maximum(mx, s.max(axis=1))
        seen = np.isfinite(new)
        factor = np.where(seen, np.exp(mx - new), 1.0)
        p = np.where(seen[:, None], np.exp(s - np.where(seen, new, 0.0)[:, None]), 0.0)
        total = (factor if sum_scaled else 1.0) * total + p.sum(axis=1)
        acc = (factor[:, None] if out_scaled else 1.0) * acc + p @ values[k0:k0 + tile]
        mx = new
    return (mx + np.log(total))[:, None] if lse else acc / total[:, None]


@pytest.mark.parametrize("seed", range(40))
def test_the_closed_form_is_the_loop(seed, monkeypatch):
    """(odd seeds: in blocks of a few rows, as a long head's rows are)"""
    if seed % 2:
        monkeypatch.setattr(softmax_loops, "_ONLINE_BLOCK", 64)
    rng = np.random.default_rng(seed)
    n, m, d = int(rng.integers(1, 9)), int(rng.integers(1, 300)), int(rng.integers(1, 5))
    head = SimpleNamespace(logits=rng.standard_normal((n, m)) * rng.choice([1, 5, 50]),
                           hidden=rng.random((n, m)) < rng.choice([0.0, 0.3, 0.9, 1.0]),
                           values=rng.standard_normal((m, d)))
    for kind in (softmax_loops.LOG_SUM_EXP, softmax_loops.ATTENTION):
        head.kind = kind
        for tile in (1, 2, 3, 7, 64, 500):
            for sum_scaled, out_scaled in ((True, False), (False, True), (False, False), (True, True)):
                with np.errstate(all="ignore"):
                    got = softmax_loops._online(head, tile, sum_scaled, out_scaled)
                    want = _loop(np.where(head.hidden, -np.inf, head.logits), head.values, tile, sum_scaled,
                                 out_scaled, kind == softmax_loops.LOG_SUM_EXP)
                assert got.shape == want.shape
                assert (np.isnan(got) == np.isnan(want)).all() and (np.isinf(got) == np.isinf(want)).all()
                fin = np.isfinite(want)
                scale = np.abs(head.values).max() if kind == softmax_loops.ATTENTION else np.abs(want[fin]).max(initial=1)
                assert np.abs(got[fin] - want[fin]).max(initial=0) <= 1e-13 * scale


def test_the_screen_never_drops_a_candidate_the_whole_stage_would_take():
    """loop_screen decides on a few rows; whatever loop_matches takes on the whole stage, it lets
    through (candidates from far to close to got, about bugs of 1 to 1000 widths, some rows never
    written), and it drops some: the screen is not empty either way."""
    taken = dropped = 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n, m = int(rng.integers(4, 40)), int(rng.integers(2, 30))
        width = 10.0 ** rng.uniform(-4, -1)
        want = rng.standard_normal((n, m))
        bug = rng.standard_normal((n, m)) * width * 10.0 ** rng.uniform(0, 3)
        got = want + bug + rng.standard_normal((n, m)) * width * 10.0 ** rng.uniform(-3, 0)
        head = SimpleNamespace(width=width)
        got[rng.random(n) < 0.1] = 0.0  # rows never written
        rows = screens.loop_rows(got, want)
        fits = screens.loop_screen(got, want, head)
        for noise in 10.0 ** np.linspace(-5, 1, 40):
            cand = want + bug + np.clip(rng.standard_normal((n, m)), -9, 9) * head.width * noise
            if softmax_loops.loop_matches(got, want, head, cand) is not None:
                taken += 1
                assert fits(cand[rows], rows), (seed, noise)
            dropped += not fits(cand[rows], rows)
    assert taken > 100 and dropped > 100, (taken, dropped)

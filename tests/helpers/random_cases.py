"""The false-alarm sweep's random cases: shapes from the whole generator space (batch, heads; seq_q
and seq_k from 1 to a few hundred; d_k = d_v at each flash width, odd and unequal head dims),
causal or not, every distribution and file format, sometimes an explicit scale, about a third with
the output gradient dO. Case i's generator is seeded by i."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from verify.files.generate import DISTRIBUTIONS
from verify.stages import FLASH_HEAD_DIMS, FORMATS, MAX_HEAD_DIM, Dims

SWEEP_SEED = 20260311
MAX_SEQ = 300     # rows/keys: tail tiles of every tile size, yet milliseconds per case
MAX_MACS = 2_000_000  # batch·heads·seq_q·seq_k·(d_k + d_v): keeps a case near 0.3 s on the CPU
BACKWARD_SHARE = 1 / 3  # of the cases have dO


@dataclass(frozen=True)
class Case:
    index: int
    dims: Dims
    causal: bool
    distribution: str
    fmt: str
    scale: Optional[float]  # None: the default 1/√d_k
    backward: bool          # the case has dO

    def __str__(self) -> str:
        d = self.dims
        return (f"case {self.index}: batch={d.batch} heads={d.heads} seq_q={d.seq_q} seq_k={d.seq_k} "
                f"d_k={d.d_k} d_v={d.d_v} causal={self.causal} dist={self.distribution} "
                f"format={self.fmt} scale={self.scale!r} backward={self.backward} seed={self.index}")


def _seq_len(rng: np.random.Generator) -> int:
    """1 (a single row/key), a small length, or one up to MAX_SEQ; never rounded to a tile."""
    kind = rng.integers(4)
    if kind == 0:
        return 1
    return int(rng.integers(2, 20 if kind == 1 else MAX_SEQ + 1))


def _head_dims(rng: np.random.Generator):
    """d_k = d_v at a flash width (the flash stages run), equal but odd, or unequal."""
    kind = rng.integers(4)
    if kind <= 1:
        d = int(rng.choice(FLASH_HEAD_DIMS))
        return d, d
    d_k = int(rng.integers(1, MAX_HEAD_DIM + 1))
    return d_k, (d_k if kind == 2 else int(rng.integers(1, MAX_HEAD_DIM + 1)))


def _scale(rng: np.random.Generator) -> Optional[float]:
    """Mostly the default; sometimes an explicit scale over four decades, now and then negative."""
    if rng.random() < 0.7:
        return None
    return float(np.float32(10.0 ** rng.uniform(-2.5, 0.5) * (-1 if rng.random() < 0.1 else 1)))


def draw_case(index: int) -> Case:
    """Case `index` of the sweep: the same for every case count and backend."""
    rng = np.random.default_rng([SWEEP_SEED, index])
    d_k, d_v = _head_dims(rng)
    batch, heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    seq_q, seq_k = _seq_len(rng), _seq_len(rng)
    while batch * heads * seq_q * seq_k * (d_k + d_v) > MAX_MACS:  # halve the longer side (+1: odd)
        if seq_q >= seq_k:
            seq_q = max(1, seq_q // 2 + 1)
        else:
            seq_k = max(1, seq_k // 2 + 1)
    causal = bool(rng.integers(2))
    dist, fmt, scale = str(rng.choice(list(DISTRIBUTIONS))), str(rng.choice(FORMATS)), _scale(rng)
    # Drawn last: the forward parameters of case i are those of the sweep before it had dO.
    return Case(index, Dims(batch, heads, seq_q, seq_k, d_k, d_v), causal, dist, fmt, scale,
                bool(rng.random() < BACKWARD_SHARE))


def failures(report) -> list:
    """(stage, head, status, tolerance used) of each result of a check report that failed."""
    return [(r.stage, r.head, r.status, r.main.tol_used if r.main else None)
            for r in report.results if not r.passed]

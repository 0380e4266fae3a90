"""The shape set every backend is tested on: irregular on purpose.

N and M are chosen to be multiples of no tile size, to exercise tail tiles; d_k != d_v exercises
the stage path (the flash stages need d_k = d_v in {16, 32, 64, 128} and are skipped otherwise).
"""
import pytest

from verify.stages import Dims

SHAPES = [
    Dims(batch=1, heads=1, seq_q=1, seq_k=5, d_k=16, d_v=16),
    Dims(batch=1, heads=1, seq_q=300, seq_k=1, d_k=32, d_v=32),
    Dims(batch=1, heads=1, seq_q=127, seq_k=333, d_k=64, d_v=64),
    Dims(batch=2, heads=3, seq_q=65, seq_k=129, d_k=128, d_v=128),
    Dims(batch=1, heads=12, seq_q=128, seq_k=128, d_k=64, d_v=64),
    Dims(batch=2, heads=2, seq_q=33, seq_k=47, d_k=24, d_v=40),
]


def shape_id(d: Dims, causal: bool) -> str:
    return (f"b{d.batch}-heads{d.heads}-N{d.seq_q}-M{d.seq_k}-dk{d.d_k}-dv{d.d_v}"
            + ("-causal" if causal else ""))


def shape_params():
    return [pytest.param(d, causal, id=shape_id(d, causal)) for d in SHAPES for causal in (False, True)]

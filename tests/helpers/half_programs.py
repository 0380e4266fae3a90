"""An independent bf16/fp16 attention program: NumPy, other summation orders, no run.toml.

It computes every forward stage as PyTorch's eager mode would at half precision and writes the
files such a program writes, so the verifier's half model is tried on output it did not make.
"""
from __future__ import annotations

import numpy as np

from verify.files.generate import generate_case
from verify.model.half import round_to_format
from verify.stages import (FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, OUTPUT, SCALED_SCORES, SCORES, STAGES, WEIGHTS, Dims,
                           stage_file)

from helpers.foreign_routes import write_text

f32 = np.float32


def half(x, precision):
    return round_to_format(np.asarray(x, f32), precision).astype(f32)


def emulate(q, k, v, scale, causal, precision, mm, bug=None):
    """A bf16/fp16 attention as PyTorch's eager mode runs it (each op's result in the format,
    float32 inside), its GEMMs summed in `mm`'s order, and a FlashAttention-style forward over
    key tiles of 32 with P rounded before P·V. Its bugs: "unscaled" (the scores' scale left out),
    and in the flash loop "no_rescale" (the running sum and output not rescaled when a tile raises
    the row maximum) and "skip_key_tile" (the second key tile, keys 32..63, never read)."""
    h = lambda x: half(x, precision)  # noqa: E731
    q, k, v = h(q), h(k), h(v)
    qk = h(mm(q, k.T))
    s = h(qk * f32(scale if bug != "unscaled" else 1.0))
    if causal:
        s = np.where(np.triu(np.ones(s.shape, bool), 1), -np.inf, s).astype(f32)
    e = np.exp(s - s.max(axis=1, keepdims=True), dtype=f32)
    p = h(e / e.sum(axis=1, keepdims=True, dtype=f32))
    out = {SCORES: qk, SCALED_SCORES: s, WEIGHTS: p, OUTPUT: h(mm(p, v))}
    m = np.full((q.shape[0], 1), -np.inf, f32)
    l, acc = np.zeros_like(m), np.zeros((q.shape[0], v.shape[1]), f32)
    full = (mm(q, k.T) * f32(scale)).astype(f32)  # the flash scores stay float32
    if causal:
        full = np.where(np.triu(np.ones(full.shape, bool), 1), -np.inf, full).astype(f32)
    for c0 in range(0, k.shape[0], 32):
        if bug == "skip_key_tile" and c0 == 32:
            continue
        t = full[:, c0:c0 + 32]
        m_new = np.maximum(m, t.max(axis=1, keepdims=True))
        alpha = np.where(m == -np.inf, f32(0), np.exp(m - m_new, dtype=f32)).astype(f32)
        alpha = np.ones_like(alpha) if bug == "no_rescale" else alpha
        pt = np.exp(t - m_new, dtype=f32)
        l = (alpha * l + pt.sum(axis=1, keepdims=True, dtype=f32)).astype(f32)
        acc = (alpha * acc + mm(h(pt), v[c0:c0 + 32])).astype(f32)
        m = m_new
    out[FLASH_OUTPUT] = h(acc / l)
    out[FLASH_LSE] = (m + np.log(l)).astype(f32)
    return out


def half_program_case(tmp_path, precision, mm, causal, bug=None, fmt="npy"):
    """A case (2 heads, 50×77, d 64) in tmp_path/in and this program's output in tmp_path/out
    (.npy, '<f2' for fp16's half stages, or %.9g text); returns (in, out)."""
    dims = Dims(1, 2, 50, 77, 64, 64)
    generate_case(tmp_path / "in", dims, seed=5, causal=causal, distribution="normal")
    out = tmp_path / "out"
    out.mkdir()
    for i in range(dims.total_heads):
        q, k, v = (np.loadtxt(tmp_path / "in" / stage_file(n, i, "txt"), ndmin=2).astype(f32) for n in INPUT_NAMES)
        for name, x in emulate(q, k, v, dims.d_k ** -0.5, causal, precision, mm, bug).items():
            if fmt == "txt":
                write_text(out / stage_file(name, i, "txt"), x, "%.9g")
            elif precision == "fp16" and not STAGES[name].float32:
                np.save(out / stage_file(name, i, "npy"), x.astype(np.float16))  # '<f2', as such programs save
            else:
                np.save(out / stage_file(name, i, "npy"), x)
    return tmp_path / "in", out

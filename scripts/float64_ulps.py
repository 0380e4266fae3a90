#!/usr/bin/env python3
"""float64_ulps.py [--device cuda|cpu] [--rows R] [--keys M] [--d D ...] — how far PyTorch's
float64 on a device differs from NumPy's float64 in the operations the flash stages' references
and error model use (matmul of the sizes a row tile takes, exp, log, tanh, row sums and running
sums), in float64 ulps: the largest and the median over the elements, and the largest as a
fraction of a float32 rounding (2^-24 relative), against which the check's bounds are drawn.

A matmul's element may cancel (a small result of large products), where an ulp of the result
says little: its difference is also given in ulps of Σ_k |a_k·b_k|, the scale the float32 bound
of that element is drawn at. Needs PyTorch (pip install 'attnstep[gpu]').
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def ulps(got: np.ndarray, want: np.ndarray, scale: np.ndarray = None) -> np.ndarray:
    """|got - want| in float64 ulps of `scale` (of want by default), over the finite elements."""
    scale = np.abs(want) if scale is None else scale
    keep = np.isfinite(want) & np.isfinite(got) & (scale > 0)
    return np.abs(got[keep] - want[keep]) / np.spacing(scale[keep])


def rows(name: str, u: np.ndarray) -> str:
    worst = float(u.max()) if u.size else 0.0
    typical = float(np.median(u)) if u.size else 0.0
    # a float64 ulp is 2^-52 of its binade; a float32 rounding is 2^-24: ulps·2^-28 of one
    return f"{name:<34} {worst:>10.3g} {typical:>10.3g} {worst * 2.0**-28:>14.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="PyTorch's device (cuda, cpu) [cuda]")
    ap.add_argument("--rows", type=int, default=512, help="query rows of a tile [512]")
    ap.add_argument("--keys", type=int, default=8192, help="keys M [8192]")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head dimensions [64 128]")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("float64_ulps: PyTorch is not installed (pip install 'attnstep[gpu]')", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"float64_ulps: PyTorch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    rng = np.random.default_rng(args.seed)

    def on(x):
        return torch.as_tensor(x, device=dev)

    def back(t):
        return t.cpu().numpy()

    print(f"PyTorch {torch.__version__} float64 on {name} against NumPy {np.__version__} float64 "
          f"(tile {args.rows} rows x {args.keys} keys)")
    print(f"{'operation':<34} {'max ulps':>10} {'median':>10} {'max/f32 round':>14}")
    n, m = args.rows, args.keys
    for d in args.d:
        q = rng.normal(size=(n, d)).astype(np.float32).astype(np.float64)
        k = rng.normal(size=(m, d)).astype(np.float32).astype(np.float64)
        v = rng.normal(size=(m, d)).astype(np.float32).astype(np.float64)
        s = (q @ k.T) * d ** -0.5
        got = back(on(q) @ on(k).T) * d ** -0.5
        print(rows(f"Q.K^T d={d} (of the result)", ulps(got, s)))
        print(rows(f"Q.K^T d={d} (of sum |q.k|)", ulps(got, s, (np.abs(q) @ np.abs(k).T) * d ** -0.5)))
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        o = p @ v
        got = back(on(p) @ on(v))
        print(rows(f"P.V d={d} (of the result)", ulps(got, o)))
        print(rows(f"P.V d={d} (of sum |p.v|)", ulps(got, o, p @ np.abs(v))))
        print(rows(f"(P*P).(V*V) d={d}", ulps(back((on(p) * on(p)) @ (on(v) * on(v))), (p * p) @ (v * v))))
    x = rng.uniform(-30.0, 0.0, size=(n, m))
    print(rows("exp on [-30, 0]", ulps(back(torch.exp(on(x))), np.exp(x))))
    y = rng.uniform(1.0, float(m), size=(n, 1))
    print(rows("log on [1, M]", ulps(back(torch.log(on(y))), np.log(y))))
    z = rng.normal(scale=3.0, size=(n, m))
    print(rows("tanh of N(0, 3)", ulps(back(torch.tanh(on(z))), np.tanh(z))))
    e = np.exp(x)
    print(rows("row sums of exp", ulps(back(on(e).sum(dim=1)), e.sum(axis=1))))
    print(rows("running sums of exp (cumsum)", ulps(back(torch.cumsum(on(e), dim=1)), np.cumsum(e, axis=1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

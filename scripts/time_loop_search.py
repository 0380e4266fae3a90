#!/usr/bin/env python3
"""time_loop_search.py [--rows N] [--keys M] [--heads H] [--precision bf16|fp16|fp32] — how long a
failing check takes when its cause is found by the key loops' searches (every tile width from 2 to
256 keys, then each key tile): a flash forward that skips its second key tile of 64, written as a
user's program writes it (its flash_output alone, in the format), checked by attnstep.check_arrays
in this process. Prints the wall time and the diagnosis (docs/performance.md quotes a run).

    python3 scripts/time_loop_search.py --rows 256 --keys 4096
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attnstep  # noqa: E402
from verify.model.half import round_to_format32  # noqa: E402


def _stored(x: np.ndarray, precision: str) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x if precision == "fp32" else round_to_format32(x, precision)


def skipped_tile_output(q, k, v, precision: str, tile: int = 64) -> np.ndarray:
    """Each head's output with keys tile..2·tile − 1 never read, its operands and P in the format."""
    out = []
    for h in range(q.shape[0]):
        s = (_stored(q[h], precision) @ _stored(k[h], precision).T) / np.sqrt(q.shape[2])
        s[:, tile:2 * tile] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out.append(_stored(_stored(p / p.sum(axis=1, keepdims=True), precision) @ _stored(v[h], precision), precision))
    return np.stack(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="query rows N (default 256)")
    parser.add_argument("--keys", type=int, default=4096, help="keys M (default 4096)")
    parser.add_argument("--heads", type=int, default=2, help="heads (default 2)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    args = parser.parse_args()
    if args.keys < 256 or args.rows < 4:
        parser.error("--keys must be at least 256 and --rows at least 4 (two key tiles of 64 skipped and read)")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((args.heads, n, 64)).astype(np.float32) for n in (args.rows, args.keys, args.keys))
    out = skipped_tile_output(q, k, v, args.precision)
    start = time.perf_counter()
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, precision=args.precision)
    wall = time.perf_counter() - start
    failed = [r for r in report.results if r.status == "FAIL"]
    named = sorted({d.code for r in failed for d in r.diagnosis[:1]})
    print(f"N={args.rows} M={args.keys} {args.heads} heads {args.precision}: check {wall:.1f} s, "
          f"{len(failed)} failing heads, named {', '.join(named) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

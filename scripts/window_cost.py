#!/usr/bin/env python3
"""window_cost.py [--binary build/main] [--reps N] — where a sliding window's time goes in the
binary's bf16 flash forward and backward: each pass timed at windows (L, 0) of 256 to 4096 keys
and under the full causal mask (B 4, H 16, N = M = 16384, d 128, `main --bench --only flash`), and
a least-squares fit of time = fixed + per_1024 · L / 1024. per_1024 is the cost of the keys a row
sees; fixed is what a window pays whatever its length (the tiles its edges cut, each block's start
and end). The goal of `attnstep bench --variants goals` is the (1024, 0) window at most 1/8 of the
causal run's time (docs/performance.md quotes a run).

    python3 scripts/window_cost.py --binary build/main
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WINDOWS = (256, 512, 1024, 2048, 4096)
SHAPE = ["--batch", "4", "--heads", "16", "--seq-q", "16384", "--seq-k", "16384", "--d", "128"]


def _times(binary: str, mask: list, reps: int) -> dict:
    """{pass: ms} of the flash kernels for one mask."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [binary, "--bench", *SHAPE, "--precision", "bf16", "--only", "flash", "--pass", "both",
               "--no-ceilings", "--reps", str(reps), "--json", str(out), *mask]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            sys.exit(f"window_cost.py: cannot run {binary}: {exc.strerror} (build it with CUDA first)")
        said = (run.stderr or run.stdout).strip().splitlines()
        if run.returncode != 0:
            sys.exit(f"window_cost.py: {binary} --bench {' '.join(mask)} failed: {said[0] if said else 'no output'}")
        try:
            kernels = {k["name"]: k for k in json.loads(out.read_text())["kernels"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"window_cost.py: {binary} --bench {' '.join(mask)} wrote no readable results ({exc})")
    for name in ("flash", "flash_backward"):
        k = kernels.get(name, {"status": "not run"})
        if k.get("status") != "ok":
            sys.exit(f"window_cost.py: {name} {k.get('status')} under {' '.join(mask)}: {k.get('reason', '')}".rstrip(": "))
    return {name: kernels[name]["ms"] for name in ("flash", "flash_backward")}


def _fit(xs, ys):
    """(intercept, slope) of the least-squares line."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default="build/main", help="the CUDA build's main (default build/main)")
    parser.add_argument("--reps", type=int, default=10, help="timed runs of each kernel (default 10)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    causal = _times(args.binary, ["--causal"], args.reps)
    windows = {w: _times(args.binary, ["--window", f"{w},0"], args.reps) for w in WINDOWS}
    print(f"{'mask':>14} {'forward ms':>11} {'backward ms':>12}")
    print(f"{'causal':>14} {causal['flash']:11.4f} {causal['flash_backward']:12.4f}")
    for w, t in windows.items():
        print(f"{f'window {w},0':>14} {t['flash']:11.4f} {t['flash_backward']:12.4f}")
    for kernel, name in (("flash", "forward"), ("flash_backward", "backward")):
        fixed, slope = _fit([w / 1024 for w in WINDOWS], [windows[w][kernel] for w in WINDOWS])
        c = causal[kernel]
        print(f"{name}: time = {fixed:.3f} ms + {slope:.3f} ms per 1024 keys of window; (1024, 0) over causal "
              f"{windows[1024][kernel] / c:.3f}, its per-key part alone {slope / c:.3f}, fixed {fixed / c:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

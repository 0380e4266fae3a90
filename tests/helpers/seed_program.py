#!/usr/bin/env python3
"""A stand-in for a user's own attention program, run as `./main random_test` from build/.

Like the original C++ program it reads ../data/<case>/{Q,K,V}_head_{i}.txt (no manifest: the
head count from the files, the shapes from the matrices), computes Q, K, V, KT, QK, QK_scaled,
attention_weights and output in float32 with scale 1/√d_k, not causal, and writes
../data/<case with _test replaced by _verify>/<stage>_head_{i}.txt with C++ ostream's default
6 significant digits and no run.toml.

  --bug layout|scale|axis   K read column-major, scale missing, softmax over columns
  --stages output           write only output
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for tests/helpers/foreign_routes.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the verify package it names

from helpers import foreign_routes as foreign  # noqa: E402
from verify.stages import Dims  # noqa: E402

SEED_BUGS = ("layout", "scale", "axis")


def main() -> int:
    parser = argparse.ArgumentParser(prog="main")
    parser.add_argument("case")
    parser.add_argument("--bug", choices=SEED_BUGS)
    parser.add_argument("--stages", choices=("seed", "output"), default="seed")
    args = parser.parse_args()
    data = Path("..") / "data"
    in_dir = data / args.case
    heads = 0
    while (in_dir / f"Q_head_{heads}.txt").exists():
        heads += 1
    if heads == 0:
        print(f"main: error: {in_dir}: no Q_head_0.txt", file=sys.stderr)
        return 2
    inputs = foreign.read_inputs(in_dir, heads)
    scale = 1.0 / math.sqrt(inputs[0]["Q"].shape[1])  # 1.0f / sqrtf(d_k)
    results = foreign.compute_heads(inputs, scale, False, foreign.Route(), args.bug)
    out_dir = data / (args.case.replace("_test", "_verify") if "_test" in args.case else args.case + "_verify")
    q, k, v = (inputs[0][name] for name in ("Q", "K", "V"))
    dims = Dims(1, heads, q.shape[0], k.shape[0], q.shape[1], v.shape[1])
    foreign.write_outputs(out_dir, results, dims, "g6", args.stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Your own attention program, checked by attnstep: plain NumPy in float32, no GPU needed.

It stands for any program that computes attention its own way. It reads an input case written
by `attnstep generate` (Q_head_<i>.txt, K_head_<i>.txt, V_head_<i>.txt, no causal mask), and
writes three of the stages under names of its own, printed with `%g` (6 significant digits), and
no run.toml:

    scores_<i>.txt    Q·Kᵀ, unscaled                      (attnstep's stage QK)
    probs_<i>.txt     row softmax of the scaled scores    (attention_weights)
    out_<i>.txt       probs·V                             (output)

Run and check it (from the repository root):

    attnstep generate --heads 4 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
    python3 examples/my_attention.py data/random_test my_out
    attnstep check --out my_out --name QK=scores_{i}.txt \\
        --name attention_weights=probs_{i}.txt --name output=out_{i}.txt

`--bug` plants a classic bug (the line marked BUG): the softmax normalised over each column
instead of each row. `attnstep check` then fails attention_weights with the diagnosis
`softmax_axis`.
"""
import argparse
import pathlib

import numpy as np


def attention(q, k, v, bug=False):
    """One head in float32: the scores, the softmax weights and the output."""
    scores = q @ k.T                                   # S = Q·Kᵀ
    scaled = scores * np.float32(1 / np.sqrt(q.shape[1]))
    e = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    if bug:
        probs = e / e.sum(axis=0, keepdims=True)       # BUG: normalises each column
    else:
        probs = e / e.sum(axis=1, keepdims=True)       # P = softmax of each row
    return scores, probs, probs @ v                    # O = P·V


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", type=pathlib.Path, help="input case folder (Q/K/V_head_<i>.txt)")
    parser.add_argument("out", type=pathlib.Path, help="folder to write the stages into")
    parser.add_argument("--bug", action="store_true", help="plant the softmax-axis bug")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    heads = len(list(args.case.glob("Q_head_*.txt")))
    for i in range(heads):
        q, k, v = (np.loadtxt(args.case / f"{name}_head_{i}.txt", dtype=np.float32, ndmin=2)
                   for name in ("Q", "K", "V"))
        scores, probs, out = attention(q, k, v, bug=args.bug)
        for name, values in (("scores", scores), ("probs", probs), ("out", out)):
            np.savetxt(args.out / f"{name}_{i}.txt", values, fmt="%g")
    print(f"my_attention: {heads} heads written to {args.out}")


if __name__ == "__main__":
    main()

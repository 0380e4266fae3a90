#!/usr/bin/env python3
"""flex_variant_ratios.py [--reps N] [--json FILE] — the variants' goal ratios as PyTorch's
FlexAttention reaches them on this GPU: each variant's time over the same FlexAttention call
without it, on the shapes of `attnstep bench --variants goals` (verify/bench/variant_goals.py), so
that the binary's own ratios can be read against another implementation's.

    python3 scripts/flex_variant_ratios.py --json flex.json

What is timed: torch.compile(flex_attention), the kernel FlexAttention users run, forward alone
and backward alone (torch.autograd.grad of one forward's output, its graph kept), CUDA events,
the median of --reps after warm-up; the block masks are built before the timing (a user builds
them once per shape). The variant and its base are each the same call but for the variant: the
window (1024, 0) as a sliding-window causal block mask against the causal block mask, softcap 50
as the score_mod 50·tanh(s/50) against none, GQA (H 32, Hk 8, enable_gqa) against MHA at H 32.
Needs a CUDA GPU and PyTorch 2.5 or later (docs/performance.md quotes a run).
"""
import argparse
import json
import os
import sys
from typing import Dict, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verify.bench.sdpa import median_ms  # noqa: E402 (the bench's own timing: CUDA events, the median)

WINDOW_LEFT, SOFTCAP = 1024, 50.0
# (goal, shape of the variant's run: B, H, Hk, N, d, precision, what it is timed against)
GOALS = (
    ("window (1024, 0)", (4, 16, 16, 16384, 128, "bf16"), "the causal block mask"),
    ("softcap 50", (4, 16, 16, 4096, 128, "bf16"), "no score_mod"),
    ("softcap 50", (4, 16, 16, 4096, 128, "fp32"), "no score_mod"),
    ("GQA, Hk = 8", (1, 32, 8, 8192, 128, "bf16"), "MHA at H 32"),
)


def _forward_backward(torch, flex, q, k, v, reps: int, **kw) -> Tuple[float, float]:
    """(forward ms, backward ms) of one FlexAttention call."""
    fwd = median_ms(torch, lambda: flex(q, k, v, **kw), 3, reps)
    out = flex(q, k, v, **kw)
    grad = torch.randn_like(out)
    bwd = median_ms(torch, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), 3, reps)
    return fwd, bwd


def _inputs(torch, B: int, H: int, Hk: int, N: int, d: int, precision: str):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    make = lambda heads: torch.randn(B, heads, N, d, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    return make(H), make(Hk), make(Hk)


def measure(reps: int) -> Dict[str, dict]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch.manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=False)
    out = {}
    for goal, (B, H, Hk, N, d, precision), against in GOALS:
        q, k, v = _inputs(torch, B, H, Hk, N, d, precision)
        if goal.startswith("window"):
            causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, N, N)
            window = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= WINDOW_LEFT), None, None, N, N)
            variant, base = _forward_backward(torch, flex, q, k, v, reps, block_mask=window), \
                _forward_backward(torch, flex, q, k, v, reps, block_mask=causal)
        elif goal.startswith("softcap"):
            variant = _forward_backward(torch, flex, q, k, v, reps,
                                        score_mod=lambda s, b, h, i, j: SOFTCAP * torch.tanh(s / SOFTCAP))
            base = _forward_backward(torch, flex, q, k, v, reps)
        else:
            variant = _forward_backward(torch, flex, q, k, v, reps, enable_gqa=True)
            base = _forward_backward(torch, flex, *_inputs(torch, B, H, H, N, d, precision), reps)
        name = f"{goal}, B{B} H{H} Hk{Hk} N=M={N} d{d} {precision}"
        out[name] = {"against": against, "forward_ms": [variant[0], base[0]], "backward_ms": [variant[1], base[1]],
                     "forward_ratio": variant[0] / base[0], "backward_ratio": variant[1] / base[1]}
        del q, k, v
        torch.cuda.empty_cache()
    return out


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="timed runs of each call (default 10)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    try:
        import torch
    except ImportError:
        sys.exit("flex_variant_ratios.py: needs PyTorch with CUDA (pip install torch)")
    if not torch.cuda.is_available():
        sys.exit("flex_variant_ratios.py: PyTorch sees no CUDA device")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        sys.exit(f"flex_variant_ratios.py: needs FlexAttention (PyTorch 2.5 or later; this is {torch.__version__})")
    results = measure(args.reps)
    print(f"FlexAttention on {torch.cuda.get_device_name()}, torch {torch.__version__}: the variant's time over "
          "the same call without it")
    print(f"{'variant':58} {'forward':>24} {'backward':>24}")
    for name, r in results.items():
        fwd = f"{r['forward_ms'][0]:.3f}/{r['forward_ms'][1]:.3f} ms = {r['forward_ratio']:.3f}x"
        bwd = f"{r['backward_ms'][0]:.3f}/{r['backward_ms'][1]:.3f} ms = {r['backward_ratio']:.3f}x"
        print(f"{name:58} {fwd:>24} {bwd:>24}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

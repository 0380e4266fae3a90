"""Times the CUDA backend's flash backward through the binary against PyTorch SDPA's fp32 backward.

    python3 scripts/time_backward.py        (from the repository root, after building build/main)

For B=4, H=16, N=M=4096 and d in 64, 128, causal and not: the binary's flash backward (D, the dK/dV
kernel and the dQ kernel, as run.toml's time_ms_flash_dQ: device events around every kernel of the
pass, after an untimed warm-up) in fp32 (3xTF32) and tf32, and SDPA's backward (torch.autograd.grad
of F.scaled_dot_product_attention with a given dO on fp32 inputs, graph built once; median of 10
after 3 warm-ups). TFLOP/s count 2.5x the forward's 4·B·H·N·M·d, halved when causal.
"""
import shutil
import statistics
import subprocess
import sys
import tomllib

import torch
import torch.nn.functional as F

B, H, N = 4, 16, 4096
rows = []
def sdpa_bwd_ms(d, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(4))
    for x in (q, k, v): x.requires_grad_(True)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ts = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); torch.autograd.grad(o, (q, k, v), do, retain_graph=True); e.record(); torch.cuda.synchronize()
        if i >= 3: ts.append(s.elapsed_time(e))
    return statistics.median(ts)
for d in (64, 128):
    case = f"/tmp/bt{d}"
    subprocess.run([sys.executable, "-m", "verify", "generate", "--out", case, "--backward", "--batch", str(B), "--heads", str(H),
                    "--seq-q", str(N), "--seq-k", str(N), "--d-k", str(d), "--d-v", str(d), "--format", "npy", "--force"],
                   check=True, stdout=subprocess.DEVNULL)
    for causal in (False, True):
        flops = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
        for prec in ("fp32", "tf32"):
            o = f"/tmp/bto{d}{causal}{prec}"
            shutil.rmtree(o, ignore_errors=True)
            r = subprocess.run(["build/main", "--in", case, "--out", o, "--backend", "cuda", "--format", "npy", "--stages", "flash_dQ",
                                "--precision", prec] + (["--causal"] if causal else []), capture_output=True, text=True)
            if r.returncode: print(r.stderr); continue
            t = tomllib.loads(open(f"{o}/run.toml").read())
            ms, fwd = t["time_ms_flash_dQ"], t["time_ms_flash_output"]
            rows.append((d, causal, prec, ms, flops / ms / 1e9, fwd))
            shutil.rmtree(o, ignore_errors=True)
        sd = sdpa_bwd_ms(d, causal)
        rows.append((d, causal, "sdpa", sd, flops / sd / 1e9, 0))
        for row in rows[-3:]:
            print("d=%d causal=%s %-5s bwd %8.3f ms %7.2f TFLOP/s (fwd %.3f ms)" % row, flush=True)

#!/usr/bin/env bash
# gpu_smoke.sh — device check of the CUDA backend, in one call on the GPU machine:
#   1. configure + build build/main for sm_90 (-j16)
#   2. correctness: a shape set (heads 1 and 12, batch 2, N != M, 127x333, 1x5, 300x1, d_k != d_v,
#      every flash d, causal and not, rows past the softmax kernel's register cache) through
#      --backend cuda --poison and --backend cpu; every stage file is compared with the other
#      backend and with a float64 NumPy reference (max |err| / max |ref|); NaN never passes;
#      plus TF32 vs FP32, several head groups vs one, and poison vs no poison
#   3. bandwidth of KT, QK_scaled and attention_weights against a device-to-device copy
#   4. compute-sanitizer memcheck and racecheck on small shapes
#   5. pytest -m gpu: tests/test_gpu_backend.py (verdict) and tests/test_end_to_end.py (reported)
# Usage: scripts/gpu_smoke.sh  (logs under $OUT, default /tmp/gpu_smoke; compact tables last)
set -uo pipefail

OUT=${OUT:-/tmp/gpu_smoke}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
BIN=$REPO/build/main
WORK=$(mktemp -d /tmp/gpu_smoke.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1
status=0

nvidia-smi -L || { echo "gpu_smoke: no GPU visible (nvidia-smi -L failed)"; exit 2; }

echo "== build (log: build.log)"
if ! timeout 240 bash -c "cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DATTNSTEP_CUDA=ON && cmake --build build -j16" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    echo "gpu_smoke: build failed"
    exit 1
fi
grep -iE "warning" "$OUT/build.log" | head -10

echo "== correctness (log: correctness.log)"
timeout 120 python3 - "$BIN" "$WORK/cases" <<'PY' >"$OUT/correctness.log" 2>&1 || status=1
import os, subprocess, sys, tomllib
import numpy as np

binary, work = sys.argv[1], sys.argv[2]
FP32_TOL, TF32_TOL = 1e-4, 1e-2
SHORT = {"Q": "Q", "K": "K", "V": "V", "KT": "KT", "QK": "QK", "QK_scaled": "QKs",
         "attention_weights": "AW", "output": "out", "flash_output": "fo", "flash_lse": "lse"}
# name: (batch, heads, N, M, d_k, d_v, causal)
CASES = {
    "b1h1-64x64-d64":        (1, 1, 64, 64, 64, 64, False),
    "b2h12-128x96-d64":      (2, 12, 128, 96, 64, 64, False),
    "b2h12-128x96-d64-c":    (2, 12, 128, 96, 64, 64, True),
    "b1h3-127x333-d16":      (1, 3, 127, 333, 16, 16, False),
    "b1h3-127x333-d16-c":    (1, 3, 127, 333, 16, 16, True),
    "b1h2-127x333-d32-c":    (1, 2, 127, 333, 32, 32, True),
    "b1h2-127x333-d64":      (1, 2, 127, 333, 64, 64, False),
    "b1h2-127x333-d128":     (1, 2, 127, 333, 128, 128, False),
    "b1h2-127x333-d128-c":   (1, 2, 127, 333, 128, 128, True),
    "b1h1-1x5-d32":          (1, 1, 1, 5, 32, 32, False),
    "b1h1-1x5-d32-c":        (1, 1, 1, 5, 32, 32, True),
    "b1h1-300x1-d64":        (1, 1, 300, 1, 64, 64, False),
    "b1h1-300x1-d64-c":      (1, 1, 300, 1, 64, 64, True),
    "b1h2-70x50-dk48dv24-c": (1, 2, 70, 50, 48, 24, True),
    "b1h1-33x1029-dk8dv40":  (1, 1, 33, 1029, 8, 40, False),
    "b1h2-70x4100-d32-c":    (1, 2, 70, 4100, 32, 32, True),
    "b1h1-4x40000-d16":      (1, 1, 4, 40000, 16, 16, False),
    "b1h1-200x180-d128-c":   (1, 1, 200, 180, 128, 128, True),
}

def write_case(folder, b, h, n, m, dk, dv, causal, seed):
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(b * h):
        for name, shape in (("Q", (n, dk)), ("K", (m, dk)), ("V", (m, dv))):
            np.save(f"{folder}/{name}_head_{i}.npy", rng.standard_normal(shape).astype(np.float32))
    with open(f"{folder}/manifest.toml", "w") as f:
        f.write(f"batch = {b}\nheads = {h}\nseq_q = {n}\nseq_k = {m}\nd_k = {dk}\nd_v = {dv}\n"
                f"causal = {'true' if causal else 'false'}\nformat = \"npy\"\nseed = {seed}\n")

def reference(q, k, v, scale, causal):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    qk = q @ k.T
    s = qk * scale
    if causal:
        s = np.where(np.triu(np.ones(s.shape, dtype=bool), 1), -np.inf, s)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    p = e / e.sum(axis=1, keepdims=True)
    out = p @ v
    return {"Q": q, "K": k, "V": v, "KT": k.T, "QK": qk, "QK_scaled": s, "attention_weights": p,
            "output": out, "flash_output": out, "flash_lse": mx + np.log(e.sum(axis=1, keepdims=True))}

def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf")
    if np.isnan(got).any():
        return float("nan")
    masked = np.isinf(ref)
    if not np.array_equal(np.isinf(got), masked) or not np.array_equal(got[masked], ref[masked]):
        return float("inf")
    fin = ~masked
    if not fin.any():
        return 0.0
    return float(np.abs(got[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))

def run(in_dir, out_dir, backend, *extra):
    cmd = [binary, "--in", in_dir, "--out", out_dir, "--backend", backend, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {' '.join(cmd)}\n{p.stderr.strip()}")
    with open(f"{out_dir}/run.toml", "rb") as f:
        return tomllib.load(f)

def load(out_dir, stage, head):
    return np.load(f"{out_dir}/{stage}_head_{head}.npy")

def worst(errs):
    return max(errs, key=lambda e: float("inf") if e != e else e)

ok_all = True
rows = []
stage_cols = ["KT", "QK", "QK_scaled", "attention_weights", "output", "flash_output", "flash_lse"]
for seed, (name, (b, h, n, m, dk, dv, causal)) in enumerate(CASES.items()):
    folder = f"{work}/{name}"
    write_case(f"{folder}/in", b, h, n, m, dk, dv, causal, seed)
    try:
        cu = run(f"{folder}/in", f"{folder}/cuda", "cuda", "--poison")
        cp = run(f"{folder}/in", f"{folder}/cpu", "cpu")
    except RuntimeError as exc:
        print(f"{name}: RUN FAILED: {exc}")
        rows.append((name, {}, float("inf"), "FAIL(run)"))
        ok_all = False
        continue
    stages = [s for s in cu["stages"].split(",") if s]
    per_stage, vs_cpu = {}, []
    for head in range(b * h):
        ins = {x: np.load(f"{folder}/in/{x}_head_{head}.npy") for x in "QKV"}
        ref = reference(ins["Q"], ins["K"], ins["V"], float(cu["scale"]), causal)
        for s in stages:
            got = load(f"{folder}/cuda", s, head)
            e = rel_err(got, ref[s])
            c = rel_err(got, load(f"{folder}/cpu", s, head))
            per_stage[s] = worst([per_stage.get(s, 0.0), e])
            vs_cpu.append(c)
            if not (e <= FP32_TOL and c <= FP32_TOL):
                print(f"{name}: {s} head {head}: vs ref {e:.3g}, vs cpu {c:.3g}")
    cpu_err = worst(vs_cpu)
    ok = all(e <= FP32_TOL for e in per_stage.values()) and cpu_err <= FP32_TOL
    ok_all &= ok
    rows.append((name, per_stage, cpu_err, "ok" if ok else "FAIL"))
    print(f"{name}: stages={','.join(stages)} flash_tiles={cu.get('flash_block_q')}x{cu.get('flash_block_k')} "
          + " ".join(f"time_{SHORT[s]}={cu.get('time_ms_' + s, 0):.3f}ms" for s in stages))

# TF32 vs FP32 on QK, several groups vs one, poison vs no poison.
extra = []
try:
    name, (b, h, n, m, dk, dv, causal) = "b1h2-127x333-d64", CASES["b1h2-127x333-d64"]
    folder = f"{work}/{name}"
    ins = {x: np.load(f"{folder}/in/{x}_head_0.npy") for x in "QKV"}
    for prec in ("fp32", "tf32"):
        r = run(f"{folder}/in", f"{folder}/{prec}", "cuda", "--precision", prec, "--stages", "QK,output")
        ref = reference(ins["Q"], ins["K"], ins["V"], float(r["scale"]), causal)
        e_qk = rel_err(load(f"{folder}/{prec}", "QK", 0), ref["QK"])
        e_out = rel_err(load(f"{folder}/{prec}", "output", 0), ref["output"])
        extra.append((f"precision {prec} (QK, output)", f"{e_qk:.2e}, {e_out:.2e}",
                      e_qk < (1e-5 if prec == "fp32" else TF32_TOL) and e_out < (FP32_TOL if prec == "fp32" else TF32_TOL)))

    name = "b2h12-128x96-d64-c"
    folder = f"{work}/{name}"
    r = run(f"{folder}/in", f"{folder}/groups", "cuda", "--poison", "--max-memory-mb", "1")
    stages = [s for s in r["stages"].split(",") if s]
    e = worst([rel_err(load(f"{folder}/groups", s, i), load(f"{folder}/cuda", s, i)) for s in stages for i in range(24)])
    extra.append(("24 heads in groups (--max-memory-mb 1) vs one group", f"{e:.2e}", e <= 1e-6))
    r = run(f"{folder}/in", f"{folder}/nopoison", "cuda")
    same = all(np.array_equal(load(f"{folder}/nopoison", s, i), load(f"{folder}/cuda", s, i)) for s in stages for i in range(24))
    extra.append(("--poison vs no poison: identical bits", str(same), same))

except (RuntimeError, OSError) as exc:
    print(f"extra runs failed: {exc}")
    extra.append((f"extra runs: {exc}".splitlines()[0][:52], "-", False))

print()
print("CORRECTNESS: max |cuda - ref| / max |ref| per stage (float64 NumPy reference); cpu = vs --backend cpu")
print(f"{'case':24s} " + " ".join(f"{SHORT[s]:>8s}" for s in stage_cols) + f" {'vs cpu':>8s}  status")
for name, per_stage, cpu_err, st in rows:
    cells = " ".join(f"{per_stage[s]:8.1e}" if s in per_stage else f"{'-':>8s}" for s in stage_cols)
    print(f"{name:24s} {cells} {cpu_err:8.1e}  {st}")
for what, val, ok in extra:
    ok_all &= ok
    print(f"{what:52s} {val:>20s}  {'ok' if ok else 'FAIL'}")
print("CORRECTNESS:", "PASS" if ok_all else "FAIL")
sys.exit(0 if ok_all else 1)
PY
tail -32 "$OUT/correctness.log"

echo "== bandwidth (log: perf.log)"
timeout 90 python3 - "$BIN" "$WORK/perf" <<'PY' >"$OUT/perf.log" 2>&1
import os, subprocess, sys, tomllib
import numpy as np

binary, work = sys.argv[1], sys.argv[2]
env = dict(os.environ, CUDA_MODULE_LOADING="EAGER")  # module loading out of the timed stages

def copy_ceiling_gbs(nbytes=1 << 30):
    try:
        import torch
    except ImportError:
        return None
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); e.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * nbytes / (sorted(times)[len(times) // 2] * 1e-3) / 1e9

def case(name, h, n, m, d, causal=False):
    folder = f"{work}/{name}/in"
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(h):
        for x, rows in (("Q", n), ("K", m), ("V", m)):
            np.save(f"{folder}/{x}_head_{i}.npy", rng.standard_normal((rows, d), dtype=np.float32))
    with open(f"{folder}/manifest.toml", "w") as f:
        f.write(f"batch = 1\nheads = {h}\nseq_q = {n}\nseq_k = {m}\nd_k = {d}\nd_v = {d}\n"
                f"causal = {'true' if causal else 'false'}\nformat = \"npy\"\n")
    return folder

def best_ms(folder, stages, reps=3):
    best = {}
    for r in range(reps):
        out = f"{os.path.dirname(folder)}/out"
        p = subprocess.run([binary, "--in", folder, "--out", out, "--backend", "cuda", "--stages", stages],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0:
            print("run failed:", p.stderr.strip()); return {}
        with open(f"{out}/run.toml", "rb") as f:
            t = tomllib.load(f)
        for k, v in t.items():
            if k.startswith("time_ms_"):
                best[k[8:]] = min(best.get(k[8:], float("inf")), float(v))
    return best

ceiling = copy_ceiling_gbs()
print(f"device-to-device copy (torch, 1 GiB, median of 20): "
      + (f"{ceiling:.0f} GB/s" if ceiling else "torch not available"))
rows = []
H, N, M, D = 32, 2048, 2048, 64
a = case("scores", H, N, M, D, causal=True)
t = best_ms(a, "attention_weights")
nm_bytes = 2 * H * N * M * 4
for s in ("QK_scaled", "attention_weights"):
    if s in t:
        rows.append((f"{s} H{H} {N}x{M} causal", t[s], nm_bytes / (t[s] * 1e-3) / 1e9))
Hk, Mk, Dk = 64, 16384, 64
kt = case("kt", Hk, 16, Mk, Dk)
t = best_ms(kt, "KT")
if "KT" in t:
    rows.append((f"KT H{Hk} M{Mk} d{Dk}", t["KT"], 2 * Hk * Mk * Dk * 4 / (t["KT"] * 1e-3) / 1e9))
t = best_ms(case("softmax_long", 8, 512, 30000, 16), "attention_weights")
if "attention_weights" in t:
    rows.append(("attention_weights H8 512x30000 (cached)", t["attention_weights"], 2 * 8 * 512 * 30000 * 4 / (t["attention_weights"] * 1e-3) / 1e9))
t = best_ms(case("kt16", 64, 16, 16384, 16), "KT")
if "KT" in t:
    rows.append(("KT H64 M16384 d16", t["KT"], 2 * 64 * 16384 * 16 * 4 / (t["KT"] * 1e-3) / 1e9))
t = best_ms(case("flash", 16, 2048, 2048, 64), "flash")
flash_row = None
if "flash_output" in t:
    flash_row = (t["flash_output"], 4 * 16 * 2048 * 2048 * 64 / (t["flash_output"] * 1e-3) / 1e12)
print()
print("BANDWIDTH: best of 3 runs, bytes read + written over the stage's CUDA-event time")
print(f"{'stage':44s} {'ms':>8s} {'GB/s':>8s} {'% copy':>7s}")
for what, ms, gbs in rows:
    pct = f"{100 * gbs / ceiling:6.0f}%" if ceiling else "    -"
    print(f"{what:44s} {ms:8.3f} {gbs:8.0f} {pct}")
if flash_row:
    print(f"{'flash_fwd (clean) H16 2048x2048 d64':44s} {flash_row[0]:8.3f} {flash_row[1]:7.1f} TFLOP/s (4·H·N·M·d)")
PY
tail -12 "$OUT/perf.log"

echo "== compute-sanitizer (log: sanitizer.log)"
python3 - "$WORK/san" <<'PY'
import os, sys
import numpy as np
for name, (n, m, d, causal) in {"mem": (127, 333, 64, True), "race": (70, 50, 32, False)}.items():
    folder = f"{sys.argv[1]}/{name}"
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(2):
        for x, rows in (("Q", n), ("K", m), ("V", m)):
            np.save(f"{folder}/{x}_head_{i}.npy", rng.standard_normal((rows, d), dtype=np.float32))
    with open(f"{folder}/manifest.toml", "w") as f:
        f.write(f"batch = 1\nheads = 2\nseq_q = {n}\nseq_k = {m}\nd_k = {d}\nd_v = {d}\n"
                f"causal = {'true' if causal else 'false'}\nformat = \"npy\"\n")
PY
{
    for tool in memcheck racecheck; do
        in=$WORK/san/mem; [ "$tool" = racecheck ] && in=$WORK/san/race
        echo "-- $tool ($in)"
        timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 9 "$BIN" --in "$in" --out "$WORK/san/out_$tool" --backend cuda --poison
        echo "$tool exit: $?"
    done
} >"$OUT/sanitizer.log" 2>&1
grep -E "^-- |ERROR SUMMARY|RACECHECK SUMMARY|exit:" "$OUT/sanitizer.log"
grep -qE "(memcheck|racecheck) exit: [^0]" "$OUT/sanitizer.log" && status=1

echo "== pytest -m gpu (logs: pytest.log, pytest_e2e.log)"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_backend.py >"$OUT/pytest.log" 2>&1 || status=1
tail -6 "$OUT/pytest.log"
# The verifier's end-to-end GPU cases (other files of the project): reported, not part of this verdict.
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_end_to_end.py >"$OUT/pytest_e2e.log" 2>&1
tail -4 "$OUT/pytest_e2e.log"

echo "== gpu_smoke: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status

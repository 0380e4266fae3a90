#!/usr/bin/env bash
# profile_backward_kernels.sh [--binary PATH] [OUT-DIR]
#
# Nsight Compute's view of the Hopper (wgmma) flash backward's two kernels, dK/dV and dQ, at each
# precision docs/performance.md quotes: 4 heads at N = M = 4096 (not causal), one launch of each
# kernel, the sections that say what limits it (speed of light, compute and memory workloads,
# occupancy, warp states, launch). One text report a precision and head dimension in OUT-DIR
# (default ./ncu-backward). The clocks are left as they are (--clock-control none). Needs an sm_90
# GPU, ncu on the PATH and the binary built with CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
binary=build/main
if [[ "${1:-}" == "--binary" ]]; then binary=$2; shift 2; fi
out=${1:-ncu-backward}
command -v ncu >/dev/null || { echo "profile_backward_kernels.sh: ncu (Nsight Compute) is not on the PATH" >&2; exit 2; }
[[ -x "$binary" ]] || { echo "profile_backward_kernels.sh: no binary at $binary (build it, or give --binary PATH)" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for d in 64 128; do
    python3 -m verify generate --out "$work/d$d" --heads 4 --seq-q 4096 --seq-k 4096 --d-k "$d" --d-v "$d" \
        --backward --format npy --no-causal >/dev/null
done
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
          --section Occupancy --section WarpStateStats --section LaunchStats)
for run in fp32:64 tf32:64 tf32:128 bf16:64 bf16:128; do
    precision=${run%:*} d=${run#*:}
    ncu --clock-control none "${sections[@]}" --kernel-name regex:"dkdv_kernel|dq_kernel" --launch-count 2 \
        "$binary" --in "$work/d$d" --out "$work/out-$precision-$d" --backend cuda --precision "$precision" \
        --flash-kernel wgmma --stages flash_dQ,flash_dK,flash_dV --format npy >"$out/ncu_${precision}_d$d.txt" 2>&1
    echo "$out/ncu_${precision}_d$d.txt"
done

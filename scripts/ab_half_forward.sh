#!/usr/bin/env bash
# ab_half_forward.sh PATCH [ROUNDS] — the bf16 flash forward of this tree against the same tree with
# PATCH applied (a kernel experiment on cuda_src/), on the GPU machine: both built from scratch
# (`cmake -DATTNSTEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90`, the `main` target, in build-ab/), then
# timed alternately ROUNDS times (default 3) by `main --bench ... --reps 20` on the cases below. One
# line a case, binary and round: "round tree case ms". docs/performance.md's persistent-grid table:
#
#   scripts/ab_half_forward.sh docs/experiments/persistent_half_forward.patch
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/ab_half_forward.sh PATCH [ROUNDS]"
[[ $# -ge 1 && $# -le 2 ]] || { echo "ab_half_forward.sh: $usage" >&2; exit 2; }
patch=$(realpath -m "$1") rounds=${2:-3}
[[ -f $patch ]] || { echo "ab_half_forward.sh: $1: no such patch file" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ab_half_forward.sh: ROUNDS must be a whole number >= 1, got '$rounds'" >&2; exit 2; }
command -v patch > /dev/null || { echo "ab_half_forward.sh: needs the patch tool (not found on PATH)" >&2; exit 2; }
patch -p1 --dry-run -s -f < "$patch" > /dev/null 2>&1 || { echo "ab_half_forward.sh: $1 does not apply to this tree" >&2; exit 2; }

out=build-ab
rm -rf "$out" && mkdir -p "$out/patched"
tar --exclude='./build*' --exclude=./.git -cf - . | tar -xf - -C "$out/patched"  # (the sources, no builds)
patch -p1 -s -f -d "$out/patched" < "$patch"  # (patch, not git apply: in a clone it skips paths under build-ab/)
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DATTNSTEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
(cmake -S . -B "$out/base-build" "${cmake_args[@]}" && cmake --build "$out/base-build" -j "$jobs" --target main) \
    > "$out/base.log" 2>&1 &
(cmake -S "$out/patched" -B "$out/patched-build" "${cmake_args[@]}" && \
    cmake --build "$out/patched-build" -j "$jobs" --target main) > "$out/patched.log" 2>&1 &
wait -n || { echo "ab_half_forward.sh: a build failed (see $out/base.log, $out/patched.log)" >&2; exit 1; }
wait -n || { echo "ab_half_forward.sh: a build failed (see $out/base.log, $out/patched.log)" >&2; exit 1; }

# N, d, and the mask's options: the window goal's shape, the plain and causal forward, the softcap.
cases=("16384 128 --window 1024,0" "16384 64 --window 1024,0" "4096 64 --window 256,0" "4096 64" "4096 128"
       "4096 128 --causal" "4096 128 --softcap 50")
for round in $(seq "$rounds"); do
    for tree in base patched; do
        for c in "${cases[@]}"; do
            read -r n d mask <<< "$c"
            line=$("$out/$tree-build/main" --bench --batch 4 --heads 16 --seq-q "$n" --seq-k "$n" --d "$d" \
                   --precision bf16 --only flash --pass forward --no-ceilings --reps 20 $mask 2>&1 | grep -E "^flash " || true)
            [[ -n $line ]] || { echo "ab_half_forward.sh: $tree's main --bench gave no flash row (no GPU?)" >&2; exit 1; }
            echo "$round $tree N=$n d=$d ${mask:-plain} $(awk '{print $2}' <<< "$line")"
        done
    done
done

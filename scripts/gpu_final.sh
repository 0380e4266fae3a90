#!/usr/bin/env bash
# The one device call of the final check, trimmed to fit the remaining device time:
# a prebuilt sm_90 binary (build-gpu/, built here) when it runs there, else a build; the GPU tests;
# memcheck; the large bounded-memory case. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_final_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/env.log"
B=$PWD/build-gpu/main
if ! "$B" --help >/dev/null 2>&1; then
    echo "prebuilt binary does not run here; building" | tee -a "$OUT/env.log"
    (cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build /tmp/b -j16) >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    B=/tmp/b/main
fi
export ATTNSTEP_BINARY=$B
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests -k "not seeds" >"$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -n 15 "$OUT/tests.log"
san() { python3 -m verify generate --out /tmp/s$1 --heads 2 --seq-q $2 --seq-k $3 --d-k $4 --d-v $4 $5 >/dev/null
        compute-sanitizer --tool $6 --error-exitcode 99 "$B" --in /tmp/s$1 --out /tmp/s$1.o --backend cuda $7 2>&1 | tail -n 2; }
{ san 1 127 333 64 --causal memcheck ""; san 2 65 129 128 --no-causal memcheck ""; san 3 33 47 32 --causal memcheck "--flash-kernel clean";
  san 4 70 90 64 --causal racecheck ""; } > "$OUT/sanitizer.log" 2>&1; cat "$OUT/sanitizer.log"
python3 -m verify generate --out /tmp/L --heads 16 --seq-q 4096 --seq-k 4096 --d-k 64 --d-v 64 --format npy >/dev/null
python3 scripts/measure.py "$B" --in /tmp/L --out /tmp/L.o --backend cuda --format npy 2>&1 | tail -n 3 | tee "$OUT/large.log"
grep time_ms /tmp/L.o/run.toml | tee -a "$OUT/large.log"; cp /tmp/L.o/run.toml "$OUT/large_run.toml"
du -sh /tmp/L /tmp/L.o | tee -a "$OUT/large.log"

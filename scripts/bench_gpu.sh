#!/usr/bin/env bash
# bench_gpu.sh — the flash-kernel work on the GPU machine in one call: build with the exploration
# variants of flash_fast.cu compiled in, check every variant against float64 on irregular shapes
# (all rows, both precisions, causal and not, forced KV splits), time the variants on the bench's
# goal shapes, then run the full `bench` sweep (stage path, flash kernels, PyTorch SDPA).
#
#   scripts/bench_gpu.sh [build] [correct] [variants] [goal] [full]   (default: all but goal)
# goal: the full bench on the four goal shapes only (B4 H16 N=M=4096, d 64/128, causal or not).
#
# VARIANTS="0" limits both loops to the shipped configuration; BENCH_ARGS go to the full sweep.
# Logs go to $OUT (or ./bench_gpu_out): correct.log, variants.log, full.log, bench.json, bench.png.
# The last lines printed are the variant table and the full sweep's goals.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
BUILD=build-gpu
MAIN=$BUILD/main
VARIANTS=${VARIANTS:-0 1 2 3}  # flash_fast configurations checked and timed (0 = shipped)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build correct variants full)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
nvcc --version | tail -n 1

if want build; then
    t0=$SECONDS
    defs=""; [ "$VARIANTS" != "0" ] && defs="-DATTNSTEP_FLASH_FAST_VARIANTS"
    if ! { cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DATTNSTEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
             -DCMAKE_CUDA_FLAGS="$defs -Xptxas -v" >"$OUT/build.log" 2>&1 \
           && cmake --build $BUILD --parallel 16 >>"$OUT/build.log" 2>&1; }; then
        tail -n 40 "$OUT/build.log"; echo "build FAILED"; exit 1
    fi
    echo "build: $((SECONDS - t0)) s"
    grep -A3 "flash_fast_kernel" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | head -n 20
fi

# One --bench run: prints its flash rows prefixed by a label; a failed check or crash sets status.
run() {  # run LABEL ARGS...
    local label=$1; shift
    local log
    log=$(timeout 120 $MAIN --bench --only flash --pass forward --warmup 0 --reps 1 --check --check-rows 0 "$@" 2>&1)
    local rc=$?
    echo "$log" | grep -E "^flash" | sed "s|^|$label  |"
    if [ $rc -ne 0 ]; then echo "$label  FAILED rc=$rc: $(echo "$log" | grep -E 'error' | head -n 2)"; status=1; fi
}

if want correct; then
    {
        for prec in fp32 tf32; do
            for spec in "1 3 127 333 64" "2 2 200 77 128" "1 2 1 1 64" "1 1 65 129 16" "1 1 65 129 32" \
                        "1 1 1000 500 64" "1 1 500 1000 128"; do
                set -- $spec
                for causal in "" "--causal"; do
                    for variant in $VARIANTS; do
                        [ $variant -gt 0 ] && [ $5 -lt 64 ] && continue
                        run "correct B$1 H$2 N$3 M$4 d$5 $prec ${causal:-full} v$variant" \
                            --batch $1 --heads $2 --seq-q $3 --seq-k $4 --d $5 --precision $prec $causal \
                            --fast-variant $variant
                    done
                done
            done
            # Forced KV splits (the combine step) on shapes that would not split by themselves.
            for d in 64 128; do
                for causal in "" "--causal"; do
                    run "split3 B1 H2 N300 M700 d$d $prec ${causal:-full}" --batch 1 --heads 2 --seq-q 300 \
                        --seq-k 700 --d $d --precision $prec $causal --splits 3
                done
            done
            # A large shape, sampled rows (the check of the timing runs).
            run "sampled B4 H16 N1024 d64 $prec" --batch 4 --heads 16 --seq-q 1024 --seq-k 1024 --d 64 \
                --precision $prec --check-rows 24
        done
    } 2>&1 | tee "$OUT/correct.log" | grep -E "FAIL|error" | head -n 40
    n_ok=$(grep -c " ok" "$OUT/correct.log"); n_fail=$(grep -cE "FAIL" "$OUT/correct.log")
    echo "correct: $n_ok checks ok, $n_fail failed (correct.log)"
    [ "$n_fail" -gt 0 ] && status=1
    grep -E "flash_fast" "$OUT/correct.log" | awk '{for(i=1;i<=NF;i++) if($i=="err") print $(i+1)}' \
        | sort -g | tail -n 1 | sed 's/^/correct: largest flash_fast max rel err /'
fi

if want variants; then
    {
        for d in 64 128; do
            for causal in "" "--causal"; do
                for prec in fp32 tf32; do
                    for variant in $VARIANTS; do
                        out=$(timeout 120 $MAIN --bench --only flash --pass forward --batch 4 --heads 16 --seq-q 4096 \
                              --seq-k 4096 --d $d $causal --precision $prec --warmup 2 --reps 10 --check \
                              --fast-variant $variant 2>&1)
                        rc=$?
                        echo "$out" | grep -E "^flash_fast|^flash " | \
                            sed "s|^|d$d ${causal:-full} $prec v$variant  |"
                        [ $rc -ne 0 ] && { echo "d$d ${causal:-full} $prec v$variant FAILED rc=$rc"; status=1; }
                    done
                done
            done
        done
    } 2>&1 | tee "$OUT/variants.log" >/dev/null
fi

if want goal; then
    python3 -m verify.cli.bench --build-dir $BUILD --json "$OUT/bench.json" --plot "$OUT/bench.png" \
        --shape 4,16,4096,4096,64 --shape 4,16,4096,4096,64,causal \
        --shape 4,16,4096,4096,128 --shape 4,16,4096,4096,128,causal >"$OUT/goal.log" 2>&1 || status=1
    grep -vE "^bench: B" "$OUT/goal.log" | cut -c1-160 | head -n 80
fi

if want full; then
    python3 -m verify.cli.bench --build-dir $BUILD --json "$OUT/bench.json" --plot "$OUT/bench.png" \
        ${BENCH_ARGS:-} >"$OUT/full.log" 2>&1 || status=1
    grep -E "^B4-H16-N4096|^device|^ceilings|goals|met|MISSED|Error|error" "$OUT/full.log" | cut -c1-150 | head -n 90
fi

if want variants; then
    echo "== variants (B4 H16 N=M=4096; flash = the dispatcher, flash_fast = variant vI)"
    grep -E "flash_fast" "$OUT/variants.log" | tr -s ' ' | cut -c1-150
    grep -E " v0  flash " "$OUT/variants.log" | tr -s ' ' | sed 's/ flash / clean-or-dispatched flash /' | cut -c1-150
fi
exit $status

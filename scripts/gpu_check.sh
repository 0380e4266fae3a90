#!/usr/bin/env bash
# gpu_check.sh — everything that needs the GPU, in one call: build with CUDA, the GPU tests, the
# cross-checks against PyTorch's attention, the demo on the CUDA backend, compute-sanitizer
# (memcheck, racecheck), the large bounded-memory cases, and the benchmarks.
#
#   scripts/gpu_check.sh [build] [tests] [gputests] [alarms] [sdpa] [xcheck] [demo] [example] [sanitize|memcheck|racecheck]
#                        [large] [bigbwd] [bench] [halfbench] [variants] [decode] [varlen] [sweep]
#                        (default: build tests demo example sanitize large bigbwd bench halfbench)
#   tests: the whole suite; gputests: only the tests marked gpu, false-alarm sweep aside; alarms:
#   the CUDA false-alarm sweep alone (fp32 with each flash kernel, tf32, bf16, fp16); sdpa:
#   PyTorch's own SDPA backends at bf16 and fp16 checked as another program's output (no build
#   needed); xcheck: the variants of attention (GQA, both causal alignments, windows, softcap, ALiBi,
#   mask and bias files) cross-checked against PyTorch's SDPA and FlexAttention, with planted bugs
#   (tests/test_gpu_cross_checks.py), packed and paged cases likewise (tests/test_gpu_sequences.py),
#   and tests/test_sdpa_cases.py whole;
#   example: `attnstep demo --example bug_qk_leading_dim`; sanitize: memcheck and racecheck (each
#   also a step of its own).
#   GPU_TESTS="tests/test_examples.py ..." limits gputests to those files.
#   ATTNSTEP_BINARY=build-gpu/main scripts/gpu_check.sh tests sanitize large   (a prebuilt binary)
#   bigbwd: the flash backward on 16 heads at N = M = 16384, d = 64 (a run of the binary and its
#   --bench), each with its peak device memory under BIGBWD_MAX_MIB (default 4096) MiB.
#   BENCH_ARGS="--shape 4,16,4096,4096,64" scripts/gpu_check.sh bench          (other shapes)
#   BENCH_ARGS="--pass backward" scripts/gpu_check.sh bench                    (the backward rows alone)
#   BENCH_ARGS="--precision bf16 --pass forward" scripts/gpu_check.sh bench    (any bench options)
#   halfbench: the bf16 and fp16 forward and backward at the goal shapes (B 4, H 16, N = M = 4096,
#   d 64 and 128, causal and not) against PyTorch SDPA's forward and backward at the same dtype,
#   each backend, with the float64 checks (output and gradients) and the forward's accuracy
#   comparison on the same inputs; into $OUT/bench_half.json and .png.
#   HALF_BENCH_ARGS="--precision bf16" scripts/gpu_check.sh halfbench            (added to those)
#   HALF_BENCH_ARGS="--pass forward" scripts/gpu_check.sh halfbench              (one pass alone)
#   variants: the variants' goals (attnstep bench --variants goals: GQA, a window (1024, 0) and
#   softcap 50, each against the same kernel without it, flash forward and backward); into
#   $OUT/bench_variants.json; then a window's cost by its length (scripts/window_cost.py) and
#   FlexAttention's own ratios on the same shapes (scripts/flex_variant_ratios.py, flex_variants.json).
#   decode: the paged decode kernel's goals (attnstep bench --decode goals: B 64, H 32, Hk 8, d 128,
#   bf16, caches of 8192 and 32768 keys in pages of 64) against a device copy and PyTorch SDPA on the
#   gathered cache; into $OUT/bench_decode.json; DECODE_BENCH_ARGS="--reps 50" adds options.
#   varlen: the packed (varlen) prefill goal: main --bench-varlen (65536 tokens in sequences of
#   random length 1..8192, 16 heads, d 128, bf16, causal) against the dense kernel at the mean
#   length, goal >= 0.90 of its TFLOP/s; then d 64 and fp16; into $OUT/bench_varlen*.json.
#   sweep: the d × N table (attnstep sweep), CSV/JSON/PNG into $OUT; SWEEP_ARGS="--d 64"
#   narrows it.
#
# Logs go to $OUT (or ./gpu_check_out); the last lines printed are a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ATTNSTEP="python3 -m verify"
BUILD=build
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests demo example sanitize large bigbwd bench halfbench)
declare -A result

want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
step() {  # step NAME CMD...: runs CMD, logs to $OUT/NAME.log, records PASS/FAIL with seconds
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then result[$name]="PASS ($((SECONDS - t0)) s)"
    else result[$name]="FAIL rc=$? ($((SECONDS - t0)) s), see $name.log"; tail -n 30 "$OUT/$name.log"; fi
}

{ nvidia-smi -L; nvcc --version | tail -n 1; python3 -c 'import numpy, click; print("numpy", numpy.__version__, "click", click.__version__)'; } >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# ATTNSTEP_BINARY: a binary built elsewhere for sm_90 (carried along); used when it runs here.
if [ -n "${ATTNSTEP_BINARY:-}" ] && "$ATTNSTEP_BINARY" --help >/dev/null 2>&1; then
    BUILD=$(dirname "$(realpath "$ATTNSTEP_BINARY")")
    echo "using the prebuilt $ATTNSTEP_BINARY"
elif want build; then
    unset ATTNSTEP_BINARY
    step build bash -c "cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DATTNSTEP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        && cmake --build $BUILD --parallel 16"
fi

if want tests; then
    # The whole suite: GPU tests run here (CUDA backend), CPU tests too.
    step tests env ATTNSTEP_FALSE_ALARM_CASES=${ATTNSTEP_FALSE_ALARM_CASES:-300} python3 -m pytest -q -x -m "slow or not slow" -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests
    grep -E "passed|failed" "$OUT/tests.log" | tail -n 1
fi

if want gputests; then
    # In GPU_TEST_WORKERS processes (pytest-xdist, where installed): one after another they take
    # over 8 minutes on an H100, 8 side by side 4 (the GPU is shared, the checks are CPU work).
    workers=(); python3 -c 'import xdist' 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-8}")
    step gputests python3 -m pytest -q -m gpu "${workers[@]}" -p no:cacheprovider --junitxml="$OUT/gputests.xml" \
        --deselect tests/test_false_alarms.py ${GPU_TESTS:-tests}
    grep -E "passed|failed" "$OUT/gputests.log" | tail -n 1
fi

if want alarms; then
    # Every chunk of cases in its own pytest process, 12 side by side: each case is a short run of
    # the binary and a check on the CPU, so the sweep is bound by the host's cores, not the GPU.
    alarms() {
        local ids="$OUT/alarms.ids"
        export ATTNSTEP_FALSE_ALARM_CASES=${ATTNSTEP_FALSE_ALARM_CASES:-300} ATTNSTEP_BINARY=$BUILD/main
        python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_false_alarms.py 2>/dev/null \
            | grep '::' > "$ids"
        [ -s "$ids" ] || { echo "no GPU false-alarm tests collected"; return 1; }
        echo "$(wc -l < "$ids") chunks of cases, $ATTNSTEP_FALSE_ALARM_CASES cases per CUDA configuration"
        # Each chunk's verdict is appended as it ends, so a sweep stopped by a time limit still
        # shows what it found.
        xargs -P 12 -I{} sh -c 'out=$(python3 -m pytest -q -m gpu -p no:cacheprovider "$1" 2>&1) \
                   && echo "passed $1" || printf "FAILED %s\n%s\n" "$1" "$(echo "$out" | grep -E "^E +AssertionError" | head -n 3)"' \
            _ {} < "$ids"
        unset ATTNSTEP_FALSE_ALARM_CASES ATTNSTEP_BINARY
        rm -f "$ids"
        ! grep -q "^FAILED" "$OUT/alarms.log"
    }
    step alarms alarms
    grep -c "^passed" "$OUT/alarms.log"; grep -A3 "^FAILED" "$OUT/alarms.log"
fi

if want sdpa; then
    # Each SDPA backend (flash, memory-efficient, cuDNN, math) x bf16/fp16 x shapes, forward and
    # backward, written as another program's stage files: every stage must pass `check
    # --precision`, the planted bugs must fail; a backend torch cannot run here is a skip with
    # torch's reason (listed in the log).
    step sdpa python3 -m pytest -q -m gpu -rs -p no:cacheprovider --junitxml="$OUT/sdpa.xml" tests/test_sdpa_cases.py
    grep -E "passed|failed|skipped|error" "$OUT/sdpa.log" | tail -n 1
fi

if want xcheck; then
    # test_gpu_cross_checks.py in two pytest processes, SDPA's runs apart from FlexAttention's
    # compiled ones and the planted bugs, then the packed and paged cases (test_gpu_sequences.py),
    # then test_sdpa_cases.py (its GPU runs and the variants'
    # stand-ins); a backend torch cannot run here is a skip with torch's reason (listed in the log).
    xcheck() {
        local rc=0 pytest=(python3 -m pytest -q -rs -p no:cacheprovider)
        "${pytest[@]}" -m gpu --junitxml="$OUT/xcheck_sdpa.xml" -k "sdpa_passes" tests/test_gpu_cross_checks.py || rc=1
        "${pytest[@]}" -m gpu --junitxml="$OUT/xcheck_flex.xml" -k "not sdpa_passes" tests/test_gpu_cross_checks.py || rc=1
        "${pytest[@]}" -m gpu --junitxml="$OUT/xcheck_sequences.xml" tests/test_gpu_sequences.py || rc=1
        "${pytest[@]}" --junitxml="$OUT/xcheck_sdpa_cases.xml" tests/test_sdpa_cases.py || rc=1
        return $rc
    }
    step xcheck xcheck
    grep -E "passed|failed|skipped|error" "$OUT/xcheck.log" | tail -n 3
fi

if want demo; then
    step demo $ATTNSTEP demo --backend cuda --binary $BUILD/main --data-dir "$OUT/demo_data" --json "$OUT/demo.json"
    grep -E "^(PASS|FAIL)" "$OUT/demo.log"
    rm -rf "$OUT/demo_data"
fi

if want example; then
    # The README's failing example: a gallery program with a cuBLAS leading-dimension bug.
    # It must fail (exit 1), naming the bug.
    caught() { $ATTNSTEP demo --example bug_qk_leading_dim --build-dir $BUILD --json "$OUT/example.json"
               [ $? -eq 1 ] && grep -q '"code": "layout"' "$OUT/example.json"; }
    step example caught
    sed -n '1,40p' "$OUT/example.log"
fi

if want sanitize || want memcheck || want racecheck; then
    # Small irregular shapes, causal and not and under the variants; every stage, forward and
    # backward, and the flash kernels, in each precision of SANITIZE_PRECISIONS (default fp32,
    # tf32 and bf16: each family of Hopper backward kernels, and the half pipeline's).
    sanitize() {
        local tool=$1 rc=0
        # 333 query rows: the flash backward's key-block kernels stream several query tiles through
        # each of their two stages, so a stage is released and filled again.
        for spec in "1 2 127 333 64 64" "1 1 333 127 64 64" "2 1 65 129 128 128" "1 1 333 127 128 128" \
                    "1 1 1 5 16 16" "1 2 33 47 24 40"; do
            set -- $spec
            # The masks: none, causal, and the variants' kernels (bottom-right, a window, a softcap,
            # ALiBi; grouped K/V heads where the heads allow).
            local kv=""; [ "$2" -gt 1 ] && kv="--kv-heads 1"
            for mask in --no-causal --causal "--causal bottom-right --window 7,0 --softcap 30 --alibi $kv"; do
                local case=/tmp/san_${1}_${2}_${3}_${4}_${5}_${6}$(echo "$mask" | tr -d ' ,-')
                $ATTNSTEP generate --out "$case" --batch $1 --heads $2 --seq-q $3 --seq-k $4 --d-k $5 --d-v $6 $mask \
                    --backward >/dev/null || return 1
                for precision in ${SANITIZE_PRECISIONS:-fp32 tf32 bf16}; do
                    compute-sanitizer --tool "$tool" --error-exitcode 99 $BUILD/main --in "$case" --out "$case.$precision" \
                        --backend cuda --precision $precision || rc=1
                done
            done
        done
        # The split-KV decode kernels, on page sizes the tensor copies take (16) and not (24): a
        # paged case's run in splits of 64 keys (the split stages, their layout copy, the combine),
        # and the decode bench's step of one split (its blocks store the output themselves).
        for page in 16 24; do
            local case=/tmp/san_paged_$page
            $ATTNSTEP generate --out "$case" --heads 4 --kv-heads 2 --seqlens 1,3,2 --seqlens-k 200,129,77 \
                --page-size $page --d-k 128 --d-v 128 --causal bottom-right >/dev/null || return 1
            for precision in fp32 bf16; do
                compute-sanitizer --tool "$tool" --error-exitcode 99 $BUILD/main --in "$case" \
                    --out "$case.$precision" --backend cuda --precision $precision --split-size 64 || rc=1
                compute-sanitizer --tool "$tool" --error-exitcode 99 $BUILD/main --bench-decode --batch 3 --heads 4 \
                    --kv-heads 2 --cache-len 200 --page-size $page --d 128 --precision $precision --queries 2 \
                    --warmup 1 --reps 1 >/dev/null || rc=1
            done
        done
        return $rc
    }
    { want sanitize || want memcheck; } && step memcheck sanitize memcheck
    { want sanitize || want racecheck; } && step racecheck sanitize racecheck
    grep -hsE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log" | sort | uniq -c
fi

if want large; then
    # 16 heads, N = M = 4096, d = 64: bounded memory, npy, and the verifier streaming head by head.
    large() {
        local case=/tmp/large_in out=/tmp/large_out
        local m="python3 scripts/measure.py"
        $m $ATTNSTEP generate --out $case --heads 16 --seq-q 4096 --seq-k 4096 --d-k 64 --d-v 64 --format npy || return 1
        $m $BUILD/main --in $case --out $out --backend cuda --format npy || return 1
        $m $ATTNSTEP check --in $case --out $out --json "$OUT/large_check.json" | tail -n 3
    }
    step large large
    grep -h "^measure:" "$OUT/large.log"
fi

if want bigbwd; then
    # No N×M buffer in the flash backward: one for 16 heads at N = M = 16384 would be 16 GiB, one
    # head's alone 1 GiB; the bound leaves room for the inputs, outputs, workspaces and the CUDA
    # context (nvidia-smi's figure includes it). First the run a user makes (the flash stages,
    # forward and backward, read and written as files), then --bench's flash backward rows.
    bigbwd() {
        local case=/tmp/bigbwd_in out=/tmp/bigbwd_out rc=0
        local peak="python3 scripts/peak_device_memory.py --max-mib ${BIGBWD_MAX_MIB:-4096}"
        $ATTNSTEP generate --out $case --heads 16 --seq-q 16384 --seq-k 16384 --d-k 64 --d-v 64 --format npy \
            --backward >/dev/null || return 1
        $peak $BUILD/main --in $case --out $out --backend cuda --format npy --stages flash_dQ,flash_dK,flash_dV || rc=1
        $peak $BUILD/main --bench --pass backward --only flash --no-ceilings --batch 1 --heads 16 \
            --seq-q 16384 --seq-k 16384 --d 64 --warmup 1 --reps 3 --check || rc=1
        rm -rf $case $out
        return $rc
    }
    step bigbwd bigbwd
    grep -hE "^peak device memory:|^flash_backward" "$OUT/bigbwd.log"
fi

if want bench; then
    step bench $ATTNSTEP bench --binary $BUILD/main --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-}
    tail -n 40 "$OUT/bench.log"
fi

if want halfbench; then
    goal_shapes=()
    for d in 64 128; do for mask in "" ",causal"; do goal_shapes+=(--shape "4,16,4096,4096,$d$mask"); done; done
    step halfbench $ATTNSTEP bench --binary $BUILD/main --precision half --pass both "${goal_shapes[@]}" \
        --json "$OUT/bench_half.json" --plot "$OUT/bench_half.png" ${HALF_BENCH_ARGS:-}
    tail -n 40 "$OUT/halfbench.log"
fi

if want variants; then
    step variants $ATTNSTEP bench --variants goals --binary $BUILD/main --json "$OUT/bench_variants.json"
    sed -n '/^goals:/,$p' "$OUT/variants.log"
    # Where a window's time goes, and FlexAttention's own ratios on the goals' shapes.
    step window_cost python3 scripts/window_cost.py --binary $BUILD/main
    tail -n 2 "$OUT/window_cost.log"
    step flex_variants python3 scripts/flex_variant_ratios.py --json "$OUT/flex_variants.json"
    tail -n 5 "$OUT/flex_variants.log"
fi

if want decode; then
    step decode $ATTNSTEP bench --decode goals --binary $BUILD/main --json "$OUT/bench_decode.json" ${DECODE_BENCH_ARGS:-}
    tail -n 20 "$OUT/decode.log"
fi

if want varlen; then
    varlen() {
        local rc=0 args
        for args in "" "--d 64" "--precision fp16"; do
            local json="$OUT/bench_varlen$(echo "$args" | tr -d ' -').json"
            $BUILD/main --bench-varlen $args --reps 20 --json "$json" || rc=1
            # The goal is the bf16 d128 row's; the others are reported.
            python3 - "$json" "$args" <<'PY' || rc=1
import json, sys
ratio = json.load(open(sys.argv[1]))["ratio"]
print("goal (packed >= 0.90 of dense TFLOP/s): %.3f, %s" % (ratio, "met" if ratio >= 0.90 else "MISSED"))
sys.exit(0 if ratio >= 0.90 or sys.argv[2] else 1)
PY
        done
        return $rc
    }
    step varlen varlen
    grep -hE "^varlen|packed|dense|goal" "$OUT/varlen.log"
fi

if want sweep; then
    step sweep $ATTNSTEP sweep --binary $BUILD/main --csv "$OUT/sweep.csv" --json "$OUT/sweep.json" \
        --plot "$OUT/sweep.png" ${SWEEP_ARGS:-}
    tail -n 80 "$OUT/sweep.log"
fi

echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1))"
rc=0
for name in build tests gputests alarms sdpa xcheck demo example memcheck racecheck large bigbwd bench halfbench variants window_cost flex_variants decode sweep; do
    [ -n "${result[$name]:-}" ] || continue
    printf '%-10s %s\n' "$name" "${result[$name]}"
    case "${result[$name]}" in FAIL*) rc=1 ;; esac
done
exit $rc

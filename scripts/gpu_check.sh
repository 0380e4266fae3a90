#!/usr/bin/env bash
# gpu_check.sh — everything that needs the GPU, in one call: build with CUDA, the GPU tests, the
# demo on the CUDA backend, compute-sanitizer (memcheck, racecheck), the large bounded-memory case,
# and the benchmarks.
#
#   scripts/gpu_check.sh [build] [tests] [demo] [sanitize] [large] [bench]   (default: all)
#   ATTNSTEP_BINARY=build-gpu/main scripts/gpu_check.sh tests sanitize large   (a prebuilt binary)
#   BENCH_ARGS="--shape 4,16,4096,4096,64" scripts/gpu_check.sh bench          (other shapes)
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
[ ${#steps[@]} -eq 0 ] && steps=(build tests demo sanitize large bench)
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
    step build bash -c "cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        && cmake --build $BUILD --parallel 16"
fi

if want tests; then
    # The whole suite: GPU tests run here (CUDA backend), CPU tests too.
    step tests env ATTNSTEP_FALSE_ALARM_CASES=${ATTNSTEP_FALSE_ALARM_CASES:-300} python3 -m pytest -q -x -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests
    grep -E "passed|failed" "$OUT/tests.log" | tail -n 1
fi

if want demo; then
    step demo $ATTNSTEP demo --backend cuda --binary $BUILD/main --data-dir "$OUT/demo_data" --json "$OUT/demo.json"
    grep -E "^(PASS|FAIL)" "$OUT/demo.log"
    rm -rf "$OUT/demo_data"
fi

if want sanitize; then
    # Small irregular shapes, causal and not; every stage and the flash kernel.
    sanitize() {
        local tool=$1 rc=0
        for spec in "1 2 127 333 64 64" "2 1 65 129 128 128" "1 1 1 5 16 16" "1 2 33 47 24 40"; do
            set -- $spec
            for causal in --no-causal --causal; do
                local case=/tmp/san_${1}_${2}_${3}_${4}_${5}_${6}${causal}
                $ATTNSTEP generate --out "$case" --batch $1 --heads $2 --seq-q $3 --seq-k $4 --d-k $5 --d-v $6 $causal >/dev/null || return 1
                compute-sanitizer --tool "$tool" --error-exitcode 99 $BUILD/main --in "$case" --out "$case.out" --backend cuda || rc=1
            done
        done
        return $rc
    }
    step memcheck sanitize memcheck
    step racecheck sanitize racecheck
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log" | sort | uniq -c
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

if want bench; then
    step bench $ATTNSTEP bench --binary $BUILD/main --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-}
    tail -n 40 "$OUT/bench.log"
fi

echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1))"
rc=0
for name in build tests demo memcheck racecheck large bench; do
    [ -n "${result[$name]:-}" ] || continue
    printf '%-10s %s\n' "$name" "${result[$name]}"
    case "${result[$name]}" in FAIL*) rc=1 ;; esac
done
exit $rc

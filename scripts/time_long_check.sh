#!/usr/bin/env bash
# time_long_check.sh [--device cpu|cuda] [--backend cpu|cuda] [--binary PATH] [--profile FILE] [--keep DIR]
#                    [--scheduler WHERE]... [--plant 'ARGS'] [--keys M] [--causal ALIGN] HEADS N D
#
# Times `attnstep check` of a long flash run, as docs/performance.md quotes it: generates HEADS
# heads at N = M = N (--keys M: M keys), d_k = d_v = D with the output gradient (not causal;
# --causal top-left|bottom-right: causal so aligned), npy, runs the binary's
# flash forward and backward on it (flash_output, flash_lse, flash_dQ, flash_dK, flash_dV), then
# checks the run with scripts/measure.py (wall time, peak memory). --profile FILE: the check runs
# under cProfile instead, its statistics written to FILE (FILE.txt: the top entries by cumulative
# and internal time; the head's row tiles then run on the profiled thread, not one a core). The case and run live in a temporary folder (--keep DIR: there, and kept).
# --scheduler WHERE (repeatable): the same run is checked once for each, in turn, with
# `check --scheduler WHERE` (local: a Dask cluster started for the check, workers on each GPU where
# the heads are checked on GPUs), and `none` without a cluster; the default is `none` alone. Under a
# cluster measure.py's peak RSS is the largest one process's (the check's or a worker's), and its
# process tree's total is what they hold together.
# --profile profiles the check without a cluster (it refuses --scheduler).
# --plant 'ARGS': a bug planted in the run, for the time and memory of checking a failing one: the
# binary runs with ARGS added (e.g. '--scale 1': the scale missing) and its run.toml is removed, so
# that the check reads its files as another program's, against the case's own attention.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu backend=cpu binary=build/main profile="" keep="" plant="" keys="" causal=(--no-causal) schedulers=()
while [[ $# -gt 3 ]]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --backend) backend=$2; shift 2 ;;
        --binary) binary=$2; shift 2 ;;
        --profile) profile=$2; shift 2 ;;
        --keep) keep=$2; shift 2 ;;
        --scheduler) schedulers+=("$2"); shift 2 ;;
        --plant) plant=$2; shift 2 ;;
        --keys) keys=$2; shift 2 ;;
        --causal) causal=(--causal "$2"); shift 2 ;;
        *) echo "time_long_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
if [[ $# -ne 3 ]]; then
    echo "usage: time_long_check.sh [--device D] [--backend B] [--binary PATH] [--profile FILE] [--keep DIR]" \
         "[--scheduler WHERE]... [--plant 'ARGS'] [--keys M] [--causal ALIGN] HEADS N D" >&2
    exit 2
fi
if [[ -n "$profile" && ${#schedulers[@]} -gt 0 ]]; then
    echo "time_long_check.sh: --profile profiles the check in this process; leave out --scheduler" >&2
    exit 2
fi
heads=$1 n=$2 d=$3 m=${keys:-$2}
work=${keep:-$(mktemp -d)}
[[ -n "$keep" ]] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
python3 -m verify generate --out "$work/in" --heads "$heads" --seq-q "$n" --seq-k "$m" --d-k "$d" --d-v "$d" \
    --backward --format npy "${causal[@]}" >/dev/null
t0=$(date +%s.%N)
"$binary" --in "$work/in" --out "$work/out" --backend "$backend" \
    --stages flash_output,flash_lse,flash_dQ,flash_dK,flash_dV --format npy $plant >/dev/null
t1=$(date +%s.%N)
[[ -z "$plant" ]] || rm -f "$work/out/run.toml"
python3 -c "import sys; print(f'binary ({sys.argv[1]} backend): {float(sys.argv[3]) - float(sys.argv[2]):.2f} s: '
           f'{sys.argv[4]} heads, N = {sys.argv[5]}, M = {sys.argv[7]}, d {sys.argv[6]}')" \
    "$backend" "$t0" "$t1" "$heads" "$n" "$d" "$m"
check=(python3 -m verify check --in "$work/in" --out "$work/out" --device "$device" --quiet)
if [[ -n "$profile" ]]; then
    python3 -m cProfile -o "$profile" -m verify check --in "$work/in" --out "$work/out" --device "$device" --quiet
    python3 - "$profile" <<'EOF'
import pstats, sys
with open(sys.argv[1] + ".txt", "w") as f:
    for key in ("cumulative", "tottime"):
        pstats.Stats(sys.argv[1], stream=f).sort_stats(key).print_stats(70)
EOF
else
    [[ ${#schedulers[@]} -gt 0 ]] || schedulers=(none)
    for where in "${schedulers[@]}"; do
        if [[ "$where" == none ]]; then python3 scripts/measure.py "${check[@]}"
        else python3 scripts/measure.py "${check[@]}" --scheduler "$where"; fi
    done
fi

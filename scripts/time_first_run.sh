#!/usr/bin/env bash
# time_first_run.sh — the first run as a new user meets it, timed: a fresh clone of this
# repository's HEAD (committed work only) in a temporary folder, a virtual environment that sees the
# system's packages, then `pip install -e .` and the first `attnstep demo` (which configures and
# builds build/main, then generates, runs and checks the default case), each timed, and the two
# together. Nothing is warmed up or turned off: no build folder, no compiler cache set up, the
# build as the defaults choose it (CPU only without a GPU, CUDA for this GPU with one).
#   scripts/time_first_run.sh           the first demo
#   scripts/time_first_run.sh --tests   also README's test command, `pip install -e '.[test,plot]'`
#                                       then the README test command, in a second fresh clone
# Prints the machine (cores, load, GPU, CUDA toolkit), the demo's own output, then the seconds.
# The temporary folder is removed at the end, whatever happens.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && git rev-parse --show-toplevel)
work=$(mktemp -d "${TMPDIR:-/tmp}/attnstep-first-run.XXXXXX")
trap 'rm -rf "$work"' EXIT

gpu=$(nvidia-smi -L 2>/dev/null | grep GPU || true)
nvcc_version=$( (nvcc --version 2>/dev/null || true) | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p')
echo "machine: $(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)), load" \
     "$(cut -d ' ' -f 1-3 /proc/loadavg) (1, 5, 15 min)"
echo "GPU: ${gpu:-none (nvidia-smi lists none)}"
echo "CUDA toolkit: ${nvcc_version:-none found}"
echo "commit: $(git -C "$repo" rev-parse --short HEAD) (uncommitted changes are not in the clone)"

git clone --quiet --no-hardlinks "$repo" "$work/attnstep"
cd "$work/attnstep"
python3 -m venv --system-site-packages "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"

now() { date +%s.%N; }
t0=$(now)
pip install --quiet -e .
t1=$(now)
# The clone's package, not another install that the system's packages may hold.
where=$(python3 -c 'import verify, pathlib; print(pathlib.Path(verify.__file__).resolve().parent.parent)')
[ "$where" = "$(pwd -P)" ] || { echo "time_first_run: verify imports from $where, not the clone" >&2; exit 1; }
attnstep demo
t2=$(now)

seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f s", b - a }'; }
echo "pip install -e .:       $(seconds "$t0" "$t1")"
echo "first attnstep demo:    $(seconds "$t1" "$t2")"
echo "together:               $(seconds "$t0" "$t2")"

[ "${1:-}" = "--tests" ] || exit 0
# A second clone, so that the tests meet no build folder either (their first test builds it).
deactivate
git clone --quiet --no-hardlinks "$repo" "$work/attnstep-tests"
cd "$work/attnstep-tests"
python3 -m venv --system-site-packages "$work/venv-tests"
# shellcheck disable=SC1091
. "$work/venv-tests/bin/activate"
pip install --quiet -e '.[test,plot]'
t3=$(now)
python3 -m pytest -q -n 2 --dist loadfile -p no:cacheprovider | tail -n 1
t4=$(now)
echo "python3 -m pytest -q -n 2 --dist loadfile:   $(seconds "$t3" "$t4") (the build included)"

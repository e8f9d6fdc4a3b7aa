#!/usr/bin/env bash
# Everything GPU-side in one command, for a lent GPU (an H200, ~15 minutes):
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Phases, by value, each under its own timeout: environment, the CUDA tests, attention kernel
# figures, end-to-end decode figures, a summary. A failing phase is logged and recorded, and the
# next one runs. Writes three files: OUTDIR/gpu_check.log (everything), OUTDIR/cuda_tests.log
# (pytest's output) and OUTDIR/figures.json (rewritten after every phase and every measurement,
# so a run cut short keeps what it had). The last phases get what is left of TOTAL seconds, so
# the whole run stays under the 9 minutes it may take.
#
# GPU_CHECK_SMOKE=1 runs the same phases with tiny shapes (a dry run where there is no GPU).
set -u -o pipefail

OUTDIR=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUTDIR/gpu_check.log
FIG=$OUTDIR/figures.json
: >"$LOG"
rm -f "$FIG"
SMOKE=()
[ "${GPU_CHECK_SMOKE:-0}" = 1 ] && SMOKE=(--smoke)

# The repo is not pip-installed there; only built-ins load as plugins; nothing can be fetched.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 MODSERVE_LOAD_PLUGINS=modserve HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_SECONDS:-525}

# left CAP: CAP seconds, or fewer if the run's TOTAL would be overrun (less 15 s for the summary)
left() {
    local rest=$((TOTAL - SECONDS - 15))
    [ "$rest" -lt "$1" ] && echo $((rest > 20 ? rest : 20)) || echo "$1"
}

say() { echo "$*" | tee -a "$LOG"; }

# phase NAME SECONDS CMD...: CMD under `timeout`, its output to the log (the screen gets only the
# headers, so the device call's output tail ends with the summary); then its seconds, rc and log
# tail go into the figures. Returns CMD's rc.
phase() {
    local name=$1 secs=$2 start=$SECONDS rc
    shift 2
    local out=/tmp/gpu_check.$name.out
    say "=== $name (timeout ${secs}s) at $(date -u +%T)"
    timeout -k 10 "$secs" "$@" 2>&1 | tee "$out" >>"$LOG"
    rc=${PIPESTATUS[0]}
    say "=== $name: rc=$rc after $((SECONDS - start))s"
    timeout 30 "$PY" scripts/gpu_bench.py --out "$FIG" record "$name" "$rc" "$out" --seconds $((SECONDS - start)) \
        >>"$LOG" 2>&1 || say "(could not record $name in $FIG)"
    return "$rc"
}

# 0. Missing pure-Python packages (pydantic, ...) travel as wheels in .whl (scripts/gpu_wheels.sh).
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    if phase wheels 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
fi

# 1. Environment (`timeout` runs commands, not shell functions: hence bash -c).
export PY FIG
# shellcheck disable=SC2016  # expanded by the inner bash
phase env 30 bash -c 'nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
    df -h /dev/shm /tmp
    "$PY" scripts/gpu_bench.py --out "$FIG" "$@" env' env "${SMOKE[@]}"

# 2. The CUDA tests (files being written elsewhere join when they exist). -v: one line per test,
# so counts survive a timeout; --maxfail rather than -x, so one failure does not hide the rest.
TESTS=()
for f in tests/test_cuda.py tests/test_triton_attention.py tests/test_cuda_graphs.py \
         tests/test_lora_triton.py; do  # the last: the LoRA kernel compiled, not interpreted
    [ -f "$f" ] && TESTS+=("$f")
done
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60)
phase cuda_tests 150 "$PY" -m pytest -v --maxfail=5 -p no:cacheprovider "${PER_TEST[@]}" "${TESTS[@]}"
cp /tmp/gpu_check.cuda_tests.out "$OUTDIR/cuda_tests.log" 2>/dev/null

# 3. Attention kernels: Triton backend against SDPA flash; copy bandwidth first.
secs=$(left 90)
phase kernels "$secs" "$PY" scripts/gpu_bench.py --out "$FIG" "${SMOKE[@]}" --budget $((secs - 15)) kernels

# 4. End-to-end decode of a random Llama-3-8B-shaped model: modserve against transformers.
# Its budget leaves the last run ~30 s before the timeout.
secs=$(left 300)
phase decode "$secs" "$PY" scripts/gpu_bench.py --out "$FIG" "${SMOKE[@]}" --budget $((secs - 30)) decode

# 5. The summary table, last in the log and on the screen.
timeout 30 "$PY" scripts/gpu_bench.py --out "$FIG" summary 2>&1 | tee -a "$LOG"
say "total ${SECONDS}s; files in $OUTDIR: $(find "$OUTDIR" -maxdepth 1 -type f -printf '%f ')"
exit 0

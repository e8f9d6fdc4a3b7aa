#!/usr/bin/env bash
# Data parallel as engine processes: `-dp 2` against `-dp 1`, one thread per engine core, the
# same workload and arrivals, interleaved by `modserve bench serve --baseline-url`
# (docs/parallelism.md, "What data parallelism buys here").
#
#   scripts/dp_scaling.sh MODEL [OUT_DIR] [extra `bench serve` flags...]
#
# Default workload: 32 random prompts of 512 tokens, 32 tokens out each, all at once
# (prefill-heavy: the engines' arithmetic, not HTTP, is the work).
set -euo pipefail
MODEL=${1:?usage: scripts/dp_scaling.sh MODEL [OUT_DIR] [bench serve flags...]}
OUT=${2:-build/dp_scaling}
shift $(( $# >= 2 ? 2 : 1 ))
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
# No prefix caching: every run computes every prompt (the repeats send the same prompts).
NAME=$(basename "$MODEL")
COMMON=(--served-model-name "$NAME" --num-threads 1 --max-model-len 1024 --num-kv-blocks 1024 --data-parallel-routing load
        --no-enable-prefix-caching)

$PY -m modserve serve "$MODEL" "${COMMON[@]}" -dp 2 --port 8601 >"$OUT/dp2.log" 2>&1 &
DP2=$!
$PY -m modserve serve "$MODEL" "${COMMON[@]}" -dp 1 --port 8602 >"$OUT/dp1.log" 2>&1 &
DP1=$!
trap 'kill -TERM $DP2 $DP1 2>/dev/null; wait $DP2 $DP1 2>/dev/null || true' EXIT
for port in 8601 8602; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done

$PY -m modserve bench serve --base-url http://127.0.0.1:8601 --baseline-url http://127.0.0.1:8602 \
  --names "dp=2" "dp=1" --model "$NAME" --tokenizer "$MODEL" --workload random --input-len 512 --output-len 32 \
  --num-prompts 32 --repeats 3 --warmups 2 --output-json "$OUT/result.json" --plot "$OUT/dp_scaling.png" "$@"

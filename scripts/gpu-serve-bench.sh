#!/usr/bin/env bash
# `nibble serve` on the GPU under load: starts the server on a dummy model (or a model
# directory), then `nibble bench serve` sends ShareGPT prompts at several request rates (TTFT,
# TPOT, ITL p50/p99 per rate in OUTDIR/serve-RATE.json), and stops it.
#   scripts/gpu-serve-bench.sh NIBBLE DUMMY_MODEL|MODEL_DIR TOKENIZER_JSON SHAREGPT_JSON OUTDIR
set -euo pipefail
bin=${1:?usage: gpu-serve-bench.sh NIBBLE MODEL TOKENIZER_JSON SHAREGPT_JSON OUTDIR}
model=$2 tok=$3 ds=$4 out=$5
if [ -d "$model" ]; then source=(--model "$model"); else source=(--dummy-weights "$model"); fi
port=8124
"$bin" --device cuda "${source[@]}" --tokenizer "$tok" serve --port $port \
  --served-model-name bench --max-waiting 4096 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 400); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server did not come up"; exit 1; }
for rate in 4 16 64 inf; do
  n=$([ "$rate" = 4 ] && echo 200 || echo 500)
  "$bin" --tokenizer "$tok" bench serve --base-url "http://127.0.0.1:$port" \
    --served-model-name bench --dataset "$ds" --num-prompts "$n" --request-rate "$rate" \
    --json "$out/serve-$rate.json" 2>&1 | grep -v "^\s*$" | tail -14
done

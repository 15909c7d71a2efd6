#!/usr/bin/env bash
# `nibble serve` on the GPU under load: starts the server on a dummy model (or a model
# directory), then `nibble bench serve` sends ShareGPT prompts at several request rates (TTFT,
# TPOT, ITL p50/p99 per rate in OUTDIR/serve-RATE.json), and stops it.
#   scripts/gpu-serve-bench.sh NIBBLE DUMMY_MODEL|MODEL_DIR TOKENIZER_JSON SHAREGPT_JSON OUTDIR
set -euo pipefail
bin=${1:?usage: gpu-serve-bench.sh NIBBLE MODEL TOKENIZER_JSON SHAREGPT_JSON OUTDIR}
model=$2 tok=$3 ds=$4 out=$5
source "$(dirname "$0")/gpu-lib.sh"
port=8124
start_server $port 400 "$bin" --device cuda $(model_flags "$model") --tokenizer "$tok" serve \
  --port $port --served-model-name bench --max-waiting 4096
for rate in 4 16 64 inf; do
  n=$([ "$rate" = 4 ] && echo 200 || echo 500)
  "$bin" --tokenizer "$tok" bench serve --base-url "http://127.0.0.1:$port" \
    --served-model-name bench --dataset "$ds" --num-prompts "$n" --request-rate "$rate" \
    --json "$out/serve-$rate.json" 2>&1 | grep -v "^\s*$" | tail -14
done

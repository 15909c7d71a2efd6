#!/usr/bin/env bash
# The server on the GPU: starts `nibble serve --device cuda` on a Llama-3-8B-shaped model with
# random weights, or on a model directory, sends a completion and a streaming completion with
# curl, and stops it.
#   scripts/gpu-serve-check.sh NIBBLE_BINARY [DUMMY_MODEL | MODEL_DIR]
# DUMMY_MODEL defaults to llama-3-8b; llama-3-8b:w4a16-g128 or llama-3-8b:w8a8 serve it on the
# quantized kernels.
set -euo pipefail
bin=${1:?usage: gpu-serve-check.sh NIBBLE_BINARY [DUMMY_MODEL]}
dummy=${2:-llama-3-8b}
source "$(dirname "$0")/gpu-lib.sh"
port=8123
start_server $port 240 "$bin" --device cuda $(model_flags "$dummy") serve --port $port \
  --kv-cache-tokens 65536 --served-model-name llama-3-8b
curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"llama-3-8b","prompt":"Hello","max_tokens":16,"temperature":0}'
echo
curl -sfN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"llama-3-8b","prompt":"Hello","max_tokens":8,"stream":true}' | tail -3
echo "serve check: ok"

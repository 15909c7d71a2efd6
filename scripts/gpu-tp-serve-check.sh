#!/usr/bin/env bash
# The tensor-parallel server on two GPUs: `nibble serve --tensor-parallel-size 2` on a model
# directory (default: the tiny Llama 3 fixture), then 8 greedy completions sent at once and the
# same 8 one by one, which must give the same texts (rank 0's engine and rank 1's, mirrored,
# stay in step whatever the batching), and a streaming completion.
#   scripts/gpu-tp-serve-check.sh NIBBLE_BINARY [MODEL_DIR]
set -euo pipefail
bin=${1:?usage: gpu-tp-serve-check.sh NIBBLE_BINARY [MODEL_DIR]}
model=${2:-crates/nibble-model/tests/fixtures/tiny-llama3}
source "$(dirname "$0")/gpu-lib.sh"
port=8124
start_server $port 240 "$bin" --device cuda --tensor-parallel-size 2 --model "$model" serve \
  --port $port --kv-cache-tokens 16384 --served-model-name tp
ask() {
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"tp\",\"prompt\":\"$1\",\"max_tokens\":24,\"temperature\":0}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"].replace("\n", " "))'
}
prompts=("The quick brown fox" "Once upon a time" "Hello" "In 1999" "The capital of" "Water is"
  "My name is" "Tensor parallelism")
tmp=$(mktemp -d)
pids=()
for i in "${!prompts[@]}"; do ask "${prompts[$i]}" > "$tmp/together-$i" & pids+=($!); done
# Wait for the requests only: a bare `wait` would wait for the server too (it hung the first run).
for p in "${pids[@]}"; do wait "$p"; done
for i in "${!prompts[@]}"; do ask "${prompts[$i]}" > "$tmp/alone-$i"; done
for i in "${!prompts[@]}"; do
  echo "$i together: $(cat "$tmp/together-$i")"
  cmp -s "$tmp/together-$i" "$tmp/alone-$i" || { echo "prompt $i differs alone: $(cat "$tmp/alone-$i")"; exit 1; }
done
curl -sfN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"tp","prompt":"Hello","max_tokens":8,"stream":true,"temperature":0.8}' | tail -2
echo "tensor-parallel serve check: ok"

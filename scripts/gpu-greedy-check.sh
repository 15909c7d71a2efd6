#!/usr/bin/env bash
# The real default model, greedy, 32 tokens: CPU and GPU (bf16 and f16) must write the same
# text. Run by scripts/gpu-run.sh when the default model reached the GPU machine
# (scripts/gpu-default-model.sh).   scripts/gpu-greedy-check.sh NIBBLE_BINARY MODEL.gguf
set -euo pipefail
bin=$1 model=$2
status=0
for prompt in "The capital of France is" "Once upon a time"; do
  cpu=$("$bin" --device cpu --model "$model" generate --prompt "$prompt" --max-tokens 32 2>/dev/null)
  echo "cpu:      $cpu"
  for dtype in f16 bf16; do
    gpu=$("$bin" --device cuda --dtype $dtype --model "$model" generate --prompt "$prompt" --max-tokens 32 2>/dev/null)
    echo "cuda $dtype: $gpu"
    if [ "$gpu" == "$cpu" ]; then echo "  same 32 tokens"; else echo "  DIFFERENT"; status=1; fi
  done
done
exit $status

#!/usr/bin/env bash
# Llama-3-8B decode steps (gpu-bench --decode-steps, contexts 512 and 1024) of two staged builds,
# alternated, for the given precisions: how a kernel change shows in whole steps.
#   from the repo root on the GPU machine: bash bench/probe/decode_steps_ab.sh DIR BATCHES SPEC...
#   (stages in stage/base and stage/gpu; e.g. DIR 32,64 w8a8 fp8)
set -u
out=${1:?usage: bench/probe/decode_steps_ab.sh DIR BATCHES SPEC...}; batches=$2; shift 2
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
for spec in "$@"; do
  for stage in base gpu; do
    "stage/$stage/gpu-bench" "$out/steps-$spec-$stage.json" --decode-steps "$batches" --spec "$spec" \
      > "$out/steps-$spec-$stage.log" 2>&1
    echo "$spec $stage exit $?: $(grep -c 'decode step' "$out/steps-$spec-$stage.log") steps"
  done
done

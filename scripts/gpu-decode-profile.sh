#!/usr/bin/env bash
# Where a batch-1 decode step's device time goes, kernel by kernel: Nsight Compute's duration of
# every kernel in a window of decode steps (eager, CUDA graphs off, so each kernel is its own
# launch; caches and clocks left alone), Llama-3-8B shape in BF16, one GPU. From the repo root
# on the GPU machine, with scripts/gpu-stage.sh's stage/gpu/nibble:
#   scripts/gpu-decode-profile.sh OUTDIR [MODEL]
# Writes OUTDIR/ncu-decode.csv; bench/decode_profile.py turns it into a table by kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-decode-profile.sh OUTDIR [MODEL]}
model=${2:-llama-3-8b}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
# A 128-token prompt, then decode steps; the window skips the load, the warm-up and the prefill
# and takes 20 decode steps' worth of launches.
NIBBLE_CUDA_GRAPHS=0 timeout 500 "$ncu" --metrics gpu__time_duration.sum --cache-control none \
  --clock-control none --launch-skip "${SKIP:-4000}" --launch-count "${COUNT:-8000}" --csv \
  --log-file "$out/ncu-decode.csv" stage/gpu/nibble --device cuda --dummy-weights "$model" \
  --tokenizer .gpu-data/tokenizer/tokenizer.json bench throughput --input-len 128 \
  --output-len 128 --num-prompts 1 --max-num-seqs 1 > "$out/ncu-run.log" 2>&1 || true
tail -5 "$out/ncu-run.log"
wc -l "$out/ncu-decode.csv"

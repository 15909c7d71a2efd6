#!/usr/bin/env bash
# Per-kernel breakdown of Llama-3-8B-shaped decode steps on the GPU machine (Nsight Compute times
# each kernel in isolation, graphs off), one CSV per precision, summarized by
# bench/step_breakdown.py.  Run from the repo root with what scripts/gpu-stage.sh staged:
#   scripts/gpu-profile-step.sh OUTDIR [PRECISION...]     (default: bf16 w4a16-g128 w8a8)
# SKIP and COUNT set the window of launches (default 3000 and 700: about one and a half steps;
# COUNT=8000 takes 19 or so whole steps). BATCH=N profiles decode steps of N sequences instead of
# one (`bench throughput` on N synthetic prompts of INPUT_LEN tokens, default 256, all admitted
# together; set SKIP past their prefill chunks). NIBBLE_BIN picks the binary (default
# stage/gpu/nibble). KERNELS=REGEX times only the kernels whose names match (SKIP and COUNT then
# count those). MODEL names another shipped config or a config.json (default llama-3-8b).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-profile-step.sh OUTDIR [PRECISION...]}
shift
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels} NIBBLE_CUDA_GRAPHS=0
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
source scripts/gpu-lib.sh
seed_kernel_cache
precisions=("$@")
[ ${#precisions[@]} -gt 0 ] || precisions=(bf16 w4a16-g128 w8a8)
if [ -n "${BATCH:-}" ]; then
  workload=(bench throughput --input-len "${INPUT_LEN:-256}" --output-len 64 --num-prompts "$BATCH"
    --max-num-seqs "$BATCH" --max-batched-tokens $(( BATCH * ${INPUT_LEN:-256} )))
else
  workload=(generate --prompt "The capital of France is" --max-tokens 48)
fi
for p in "${precisions[@]}"; do
  model=${MODEL:-llama-3-8b}; [ "$p" = bf16 ] || model=$model:$p
  # Skip the load and the prompt; time a window of kernels well inside the decode steps.
  # shellcheck disable=SC2046 # KERNELS: a name regex, as one -k argument
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    $([ -n "${KERNELS:-}" ] && echo "-k regex:$KERNELS") \
    --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-700}" \
    "${NIBBLE_BIN:-stage/gpu/nibble}" --device cuda --dummy-weights "$model" "${workload[@]}" \
    >"$out/ncu-$p.csv" 2>"$out/ncu-$p.err"
  echo "$p: exit $?, $(grep -c gpu__time_duration "$out/ncu-$p.csv") kernels"
  python3 bench/step_breakdown.py "$out/ncu-$p.csv" | tee "$out/breakdown-$p.txt"
done

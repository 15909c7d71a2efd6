#!/usr/bin/env bash
# Nsight Compute's full sections for one decode-step gate/up GEMM of 256 sequences (W4A8 g128,
# Llama-3-8B shape), with the SwiGLU epilogue and without (NIBBLE_SWIGLU=0), to see where the
# epilogue's time goes: bench/probe/swiglu_ncu.sh OUTDIR [NIBBLE_BIN]   (GPU machine, repo root)
set -uo pipefail
out=${1:?usage: bench/probe/swiglu_ncu.sh OUTDIR [NIBBLE_BIN]}
bin=${2:-stage/gpu/nibble}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels} NIBBLE_CUDA_GRAPHS=0
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
work=(bench throughput --input-len 256 --output-len 16 --num-prompts 256 --max-num-seqs 256
  --max-batched-tokens 65536)
# The prefill pass launches the layer's 256-token GEMMs first (4 a layer without the epilogue,
# one gate/up with it); skip past them to a decode step's gate/up.
for v in 1 0; do
  if [ $v = 1 ]; then k=w4a8_wgmma_swiglu_bf16 skip=40; else k=w4a8_wgmma_f32 skip=140; fi
  NIBBLE_SWIGLU=$v timeout 200 "$ncu" --clock-control none --set full --csv --page details \
    -k "$k" --launch-skip $skip --launch-count 1 \
    "$bin" --device cuda --dummy-weights llama-3-8b:w4a8-g128 "${work[@]}" \
    >"$out/ncu-swiglu$v.csv" 2>"$out/ncu-swiglu$v.err"
  echo "swiglu=$v: exit $?, $(wc -l <"$out/ncu-swiglu$v.csv") lines"
done

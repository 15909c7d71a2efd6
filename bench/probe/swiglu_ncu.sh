#!/usr/bin/env bash
# Nsight Compute's full sections for one decode-step gate/up GEMM of 256 sequences (W4A8 g128,
# Llama-3-8B shape), with the SwiGLU epilogue (NIBBLE_SWIGLU=1) and without, to see where the
# epilogue's time goes: bench/probe/swiglu_ncu.sh OUTDIR [NIBBLE_BIN]   (GPU machine, repo root)
# NOT YET RUN as written: its first run (2026-11-27) skipped too few launches and caught two
# prefill GEMMs (the engine's warm-up pass of 65536 tokens launches each layer's GEMMs too).
set -uo pipefail
out=${1:?usage: bench/probe/swiglu_ncu.sh OUTDIR [NIBBLE_BIN]}
bin=${2:-stage/gpu/nibble}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels} NIBBLE_CUDA_GRAPHS=0
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
work=(bench throughput --input-len 256 --output-len 16 --num-prompts 256 --max-num-seqs 256
  --max-batched-tokens 65536)
# Launches before the second decode step's first gate/up GEMM, per kernel name: the warm-up pass
# and the prompts' prefill pass (65536 tokens each) launch each of the 32 layers' 256-token-tile
# GEMMs (the gate/up alone with the epilogue, all four without), then a decode step of 256
# sequences launches one gate/up GEMM a layer on 256-token tiles (the others take 128).
for v in 1 0; do
  if [ $v = 1 ]; then k=w4a8_wgmma_swiglu_bf16 skip=$((32 + 32 + 32)); else k=w4a8_wgmma_f32 skip=$((128 + 128 + 32)); fi
  NIBBLE_SWIGLU=$v timeout 200 "$ncu" --clock-control none --set full --csv --page details \
    -k "$k" --launch-skip $skip --launch-count 1 \
    "$bin" --device cuda --dummy-weights llama-3-8b:w4a8-g128 "${work[@]}" \
    >"$out/ncu-swiglu$v.csv" 2>"$out/ncu-swiglu$v.err"
  echo "swiglu=$v: exit $?, $(grep -c '"Duration"' "$out/ncu-swiglu$v.csv") kernel(s)"
done

#!/usr/bin/env bash
# The wgmma tier's tile order: how many token blocks a column of tiles walks before the next
# weights (WGQ_RASTER), at M = 8192 where the tokens of 16 blocks outgrow L2. GPU machine, nvcc.
set -euo pipefail
cd "$(dirname "$0")/../.."
for r in 4 8 16 32; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DWGQ_RASTER=$r -o /tmp/wgr$r \
    bench/probe/wgmma_gemm_probe.cu -lcuda -lcublas
done
for shape in "8192 28672 4096" "8192 4096 14336" "1024 28672 4096"; do
  for r in 4 8 16 32; do
    echo "== raster $r: $shape"
    /tmp/wgr$r $shape | grep -v "128-token\|cublas" | sed 's/, tiled.*//'
  done
done

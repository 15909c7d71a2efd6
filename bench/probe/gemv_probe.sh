#!/usr/bin/env bash
# Builds bench/probe/gemv_probe.cu in several stage geometries and runs each (GPU machine, nvcc).
set -euo pipefail
cd "$(dirname "$0")/../.."
run() {  # run STAGES CODES PARAMS U CHAINS
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DSK_STAGES=$1 -DSK_STAGE_CODES=$2 \
    -DSK_STAGE_PARAMS=$3 -DPROBE_U=$4 -DSK_CHAINS=$5 -o /tmp/gemv_probe bench/probe/gemv_probe.cu
  echo "chains $5"
  /tmp/gemv_probe 28672 4096
  /tmp/gemv_probe 4096 14336
}
run 4 2048 320 4 2
run 4 2048 320 4 4
run 4 2048 320 4 8

#!/usr/bin/env bash
# Where the W4A16 wgmma kernel's time goes: the probe built from copies of the kernel with parts of
# the A-fragment conversion removed (results then wrong, timing only). GPU machine, nvcc.
set -euo pipefail
cd "$(dirname "$0")/../.."
k=crates/nibble-cuda/kernels
variant() {  # variant NAME SED-SCRIPT [PYTHON-EDIT]
  mkdir -p /tmp/wgv/$1/crates/nibble-cuda/kernels /tmp/wgv/$1/bench/probe
  cp $k/common.cuh $k/qgemm.cu /tmp/wgv/$1/crates/nibble-cuda/kernels/
  sed "$2" $k/qgemm_wgmma.cu > /tmp/wgv/$1/crates/nibble-cuda/kernels/qgemm_wgmma.cu
  if [ -n "${3:-}" ]; then python3 -c "$3" /tmp/wgv/$1/crates/nibble-cuda/kernels/qgemm_wgmma.cu; fi
  cp bench/probe/wgmma_gemm_probe.cu /tmp/wgv/$1/bench/probe/
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgv/$1/probe /tmp/wgv/$1/bench/probe/wgmma_gemm_probe.cu -lcuda -lcublas
  echo "== $1"
  /tmp/wgv/$1/probe 4096 4096 14336 | grep -v g32
}
# Measured 2026-11-22 (H200, 4096x4096x14336): full 474 TFLOPS, no transpose 503, no dequant 495,
# neither 495: the conversion is not what bounds it.
# Fewer copies per stage (weights wrong, timing only): params not copied; codes of the 8 tiles as
# one copy.
edit='import sys; p = sys.argv[1]; s = open(p).read()'
variant no-params 's/^XX//' "$edit"'
s = s.replace("return min(8, tiles - tile0) * (512 + groups_in(c) * 64);", "return min(8, tiles - tile0) * 512;")
s = s.replace("        bulk_load(w + CODES + tl * 128, params + ((long)tile * groups + first_group(c)) * 8,\n                  groups_in(c) * 64, bar);\n", "")
open(p, "w").write(s)'
variant one-copy 's/^XX//' "$edit"'
s = s.replace("return min(8, tiles - tile0) * (512 + groups_in(c) * 64);", "return 8 * 512;")
s = s.replace("        bulk_load(w + tl * 512, codes + ((long)tile * chunks + c) * 32, 512, bar);\n        bulk_load(w + CODES + tl * 128, params + ((long)tile * groups + first_group(c)) * 8,\n                  groups_in(c) * 64, bar);\n", "        if (tl == 0) bulk_load(w, codes + ((long)tile * chunks + c) * 32, 8 * 512, bar);\n")
open(p, "w").write(s)'
# No token copies at all (the stage's token tile is whatever shared memory holds).
variant no-x 's/^XX//' "$edit"'
s = s.replace("mbar_expect_tx(full(s), WGQ_X_BYTES + f.weight_bytes(c, tile0));", "mbar_expect_tx(full(s), f.weight_bytes(c, tile0));")
s = s.replace("                tma_load_2d(base + s * F::STAGE, xmap, c * F::K_PER_STAGE, m0, full(s));\n", "")
open(p, "w").write(s)'

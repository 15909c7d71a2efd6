#!/usr/bin/env bash
# The standalone quantizers' wide entries (quantize_*_wide_*, 512 threads of 32 values for rows
# of 8196 to 16384) on the GPU machine in one call, from the repo root with the candidate staged
# in stage/gpu and the build before it in stage/base (its `nibble` only):
#   scripts/gpu-wide-quant-check.sh OUTDIR
# 1. the GPU tests of the row ops and 8-bit activation codes, and the SwiGLU path that feeds the
#    14336-wide quantizer; 2. end to end, base against candidate at 256 sequences (SEQS);
# 3. the 256-sequence decode step's quantizers and SwiGLU GEMM under Nsight Compute, both builds.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-wide-quant-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
stage/gpu/gpu-tests standalone_act8 row_ops fp8_activation w8a8_fused swiglu quantized_models \
  --test-threads 1 >"$out/tests.log" 2>&1 || status=1
grep -E "^test |test result" "$out/tests.log"
SEQS=${SEQS:-256} scripts/gpu-e2e-ab.sh "$out/e2e" base=stage/base wide=stage/gpu || status=1
for st in base gpu; do
  NIBBLE_BIN=stage/$st/nibble BATCH=256 SKIP=300 COUNT=300 KERNELS='quantize|swiglu' \
    timeout 150 scripts/gpu-profile-step.sh "$out/prof-$st" w4a8-g128 >/dev/null 2>&1 || status=1
done
python3 bench/ncu_kernel_means.py base="$out/prof-base/ncu-w4a8-g128.csv" \
  wide="$out/prof-gpu/ncu-w4a8-g128.csv" | tee "$out/kernels.md"
tar czf "$out/prof.tgz" -C "$out" prof-base prof-gpu && rm -rf "$out"/prof-base "$out"/prof-gpu
exit $status

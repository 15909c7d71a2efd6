#!/usr/bin/env bash
# The GPU tests of what was built on 2026-11-27 without a GPU run (device time spent), in one
# device call, from the repo root with stage/gpu staged (scripts/gpu-stage.sh):
#   scripts/gpu-unrun-check.sh OUTDIR
# - COMET W4A4A8 on its own kernels (comet_is_bit_exact_with_the_reference), and the load-note
#   test that used COMET as its format without a kernel (split_k_is_deterministic);
# - the SwiGLU epilogue's W8A8 and FP8 entries (swiglu_epilogue_is_the_gemm_then_the_silu_gate
#   covers all three families), and the quantized models with every family's epilogue on and
#   COMET's kernel taken by the loader (NIBBLE_SWIGLU=1 NIBBLE_COMET=1: quantized_models_match_cpu
#   then adds a w4a4a8 model);
# - FP8's wgmma tiers adding each stage's fragment at once (RETIRE_AT_ONCE: ptxas had serialized
#   every FP8 wgmma, C7514): the fp8 tests;
# - the standalone 8-bit codes at every width (standalone_act8), since the wide quantizers it
#   first ran with were reverted;
# - kernels_compile for every architecture (the comet module among them).
# If they pass: `scripts/gpu-swiglu-check.sh OUT perf8` decides W8A8's and FP8's default, and
# `scripts/gpu-engine-run.sh OUT qgemm-kernels` times COMET against W4A8 and cuBLAS BF16 (the
# dequantized path NIBBLE_COMET=1 would replace by default) and FP8 against `torch._scaled_mm`
# (issue 18's FP8 goal: 0.72x before the change) (gpu-bench's
# `comet_with_quant_ms`, its quantizer included, against `w4a8_with_quant_ms`).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-unrun-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
stage/gpu/gpu-tests comet swiglu split_k_is_deterministic fp8 standalone_act8 --test-threads 1 >"$out/tests.log" 2>&1 || status=1
NIBBLE_SWIGLU=1 NIBBLE_COMET=1 stage/gpu/gpu-tests quantized_models greedy --test-threads 1 \
  >"$out/tests-knobs.log" 2>&1 || status=1
stage/gpu/kernels-compile >"$out/kernels-compile.log" 2>&1 || status=1
grep -E "^test |test result" "$out"/*.log
exit $status

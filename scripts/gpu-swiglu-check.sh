#!/usr/bin/env bash
# The SwiGLU epilogue's check on the GPU machine (on by default for W4A8, W8A8 and FP8;
# NIBBLE_SWIGLU=0 turns it off), from the repo root with stage/gpu staged (scripts/gpu-stage.sh) and .gpu-data
# (scripts/gpu-engine-data.sh):
#   scripts/gpu-swiglu-check.sh OUTDIR tests   the GPU tests the change touches, then the quantized
#                                              checkpoints with NIBBLE_SWIGLU=0 (about 5 min)
#   scripts/gpu-swiglu-check.sh OUTDIR perf    end to end with the epilogue on and off at 64 and
#                                              256 sequences (ROUNDS, default 1), then the
#                                              decode-step kernels of 256 sequences both ways
#                                              (about 5 min warm)
#   scripts/gpu-swiglu-check.sh OUTDIR batch1  one sequence at a time (256-token prompts, 256
#                                              output tokens), on and off: single-stream decode
#   scripts/gpu-swiglu-check.sh OUTDIR perf8   W8A8 and FP8 end to end at 64 and 256 sequences
#                                              with their epilogue (NIBBLE_SWIGLU=1) and
#                                              without (about 6 min warm; 4 min more cold)
# Each part fits one device call; `perf` leaves summary.md, kernels.md and kernels.png in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-swiglu-check.sh OUTDIR tests|perf|perf8|batch1}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
case ${2:?tests, perf, perf8 or batch1} in
  tests)
    stage/gpu/gpu-tests swiglu row_ops greedy quantized_models graph_replay --test-threads 1 \
      >"$out/tests.log" 2>&1 || status=1
    # The checkpoints again with the epilogue off: the separate GEMM and SiLU-gate stay right.
    NIBBLE_SWIGLU=0 stage/gpu/gpu-tests quantized_models --test-threads 1 \
      >"$out/tests-swiglu0.log" 2>&1 || status=1
    grep -E "^test |test result" "$out/tests.log" "$out/tests-swiglu0.log" ;;
  perf)
    SEQS=64,256 scripts/gpu-e2e-ab.sh "$out/e2e" fused=stage/gpu off=stage/gpu@NIBBLE_SWIGLU=0 || status=1
    cp "$out/e2e/summary.md" "$out/summary.md" 2>/dev/null
    if [ -z "${NO_PROFILE:-}" ]; then
      for v in 0 1; do
        NIBBLE_SWIGLU=$v BATCH=256 SKIP=700 COUNT=700 KERNELS='w4a8|silu|quantize|rms_norm' \
          timeout 200 scripts/gpu-profile-step.sh "$out/prof-swiglu$v" w4a8-g128 >/dev/null 2>&1 || status=1
      done
      python3 bench/ncu_kernel_means.py plain="$out/prof-swiglu0/ncu-w4a8-g128.csv" \
        swiglu="$out/prof-swiglu1/ncu-w4a8-g128.csv" --plot "$out/kernels.png" \
        --title "W4A8 decode step of 256 sequences: SwiGLU epilogue against GEMM + SiLU-gate" \
        | tee "$out/kernels.md"
      gzip -f "$out"/prof-swiglu*/*.csv
    fi ;;
  perf8)
    PART=w8a8-fp8 SEQS=64,256 scripts/gpu-e2e-ab.sh "$out/e2e8" on=stage/gpu@NIBBLE_SWIGLU=1 \
      off=stage/gpu@NIBBLE_SWIGLU=0 || status=1
    cp "$out/e2e8/summary.md" "$out/summary8.md" 2>/dev/null ;;
  batch1)
    for v in 1 0 1 0; do
      NIBBLE_SWIGLU=$v timeout 120 stage/gpu/nibble --device cuda --dummy-weights llama-3-8b:w4a8-g128 \
        bench throughput --input-len 256 --output-len 256 --num-prompts 4 --max-num-seqs 1 \
        2>&1 | grep -E "^throughput" | sed "s|^|NIBBLE_SWIGLU=$v: |" | tee -a "$out/batch1.txt" || status=1
    done ;;
  *) echo "gpu-swiglu-check.sh: tests, perf, perf8 or batch1" >&2; exit 2 ;;
esac
exit $status

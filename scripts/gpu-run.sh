#!/usr/bin/env bash
# Runs every GPU test and benchmark in one go, on the GPU machine, from the repo root, using
# what scripts/gpu-stage.sh staged in stage/gpu. Logs and JSON results go to OUTDIR.
#   scripts/gpu-run.sh OUTDIR [--quick] [--tests-only] [--compile-check] [--qgemm]
# --qgemm: only the quantized-GEMM tests and benchmarks (nibble's and PyTorch's), then generate
# and serve on quantized models; --kernels-first / --engine-after split that run in two calls of
# under 10 minutes (the first ends with the report, the second runs generate and serve).
# Exits non-zero if any test failed (benchmarks still run).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-run.sh OUTDIR [--quick] [--tests-only]}
shift
quick=""; tests_only=""; compile_check=""; qgemm=""; kernels_first=""; engine_after=""
for a in "$@"; do
  case $a in
    --quick) quick="--quick" ;;
    --tests-only) tests_only=1 ;;
    --compile-check) compile_check=1 ;;
    --qgemm) qgemm=1 ;;
    --kernels-first) qgemm=1; kernels_first=1 ;;
    --engine-after) qgemm=1; engine_after=1 ;;
  esac
done
mkdir -p "$out"
stage=stage/gpu
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
export PYTHONUNBUFFERED=1
status=0
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(cat stage/gpu/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$out/device.txt"

source scripts/gpu-lib.sh

# Every architecture's compile is checked by test.sh without a GPU (NVRTC from pip); here only
# on request, since it costs a minute of GPU-machine time.
if [ -n "$compile_check" ]; then step kernels-compile "$stage/kernels-compile" --test-threads 8; fi
if [ -n "$qgemm" ]; then
  if [ -z "$engine_after" ]; then
    step gpu-tests "$stage/gpu-tests" qgemm --test-threads 1
    grep -E "^test |test result" "$out/gpu-tests.log" || true
    step gpu-bench "$stage/gpu-bench" "$out/gpu-bench.json" --qgemm $quick
    step peer python3 bench/gpu_peer.py "$out/gpu-peer.json" --qgemm
    python3 bench/qgemm_report.py "$out" > /dev/null || status=1
  fi
  if [ -z "$kernels_first" ]; then
    for p in w4a16-g128 w8a8; do
      step generate-$p "$stage/nibble" --device cuda --dummy-weights llama-3-8b:$p generate \
        --prompt "The capital of France is" --max-tokens 64
      tail -3 "$out/generate-$p.log"
    done
    step serve-w4a16 bash scripts/gpu-serve-check.sh "$stage/nibble" llama-3-8b:w4a16-g128
    tail -4 "$out/serve-w4a16.log"
  fi
  tar czf "$out/logs${engine_after:+-engine}.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
  exit $status
fi
warm_kv "$stage"
step gpu-tests "$stage/gpu-tests" --test-threads 1
grep -E "^test |test result|free-running" "$out/gpu-tests.log" || true
scripts/gpu-default-model.sh collect >/dev/null 2>&1 || true
if model=$(scripts/gpu-default-model.sh path); then
  step greedy-default-model scripts/gpu-greedy-check.sh "$stage/nibble" "$model"
  cat "$out/greedy-default-model.log"
else
  echo "== greedy-default-model: skipped (the default model is not on this machine: docs/gpu.md)"
fi
if [ -z "$tests_only" ]; then
  step gpu-bench "$stage/gpu-bench" "$out/gpu-bench.json" $quick
  step peer python3 bench/gpu_peer.py "$out/gpu-peer.json"
  for p in "" :w4a16-g128 :w8a8; do
    step generate$p "$stage/nibble" --device cuda --dummy-weights llama-3-8b$p generate \
      --prompt "The capital of France is" --max-tokens 32
    tail -3 "$out/generate$p.log"
  done
  step serve bash scripts/gpu-serve-check.sh "$stage/nibble"
  tail -8 "$out/serve.log"
  python3 bench/gpu_report.py "$out" > /dev/null || status=1
  python3 bench/qgemm_report.py "$out" > /dev/null || status=1
fi
# Logs go back as one archive (the device tool returns at most 8 files).
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
exit $status

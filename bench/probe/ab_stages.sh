#!/usr/bin/env bash
# A/B of several staged builds' wgmma kernels in one device call: optionally the first stage's
# qgemm GPU tests (AB_TEST_STAGE=stage/x), then `gpu-bench --qgemm --kernels-only` at the plan's
# splits for every stage, ROUNDS times alternated so clock drift shows as spread. GPU machine:
#   bench/probe/ab_stages.sh OUTDIR MS STAGE...
# `python3 bench/probe/wgmma_splits_report.py OUTDIR/rN` tabulates each round.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: OUTDIR MS STAGE...}; ms=${2:?MS}; shift 2
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$out/device.txt"
date -u +%FT%TZ >> "$out/device.txt"
for st in "$@"; do echo "$st $(cat "$st/COMMIT")" >> "$out/device.txt"; done
if [ -n "${AB_TEST_STAGE:-}" ]; then
  # The other stages' kernels compile (NVRTC) while the tests run.
  for st in "$@"; do "$st/gpu-bench" /tmp/warm.json --qgemm --kernels-only --ms 64,256 >/dev/null 2>&1; done &
  "$AB_TEST_STAGE/gpu-tests" qgemm --test-threads 1 > "$out/tests.log" 2>&1
  echo "tests exit $?: $(grep 'test result' "$out/tests.log")" | tee -a "$out/device.txt"
  wait
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  bench/probe/wgmma_splits_probe.sh "$out/r$r" "$ms" plan "$@"
  python3 bench/probe/wgmma_splits_report.py "$out/r$r" > /dev/null
done

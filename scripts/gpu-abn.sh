#!/usr/bin/env bash
# A/B/N of several staged builds in one device call: the GPU tests of one of them
# (AB_TEST_STAGE, filter AB_TESTS, default qgemm), then one benchmark (AB_BENCH, default
# `--qgemm --kernels-only`) from every stage, alternated ROUNDS times (default 2) so clock drift
# shows as run-to-run spread. The other stages' kernels compile while the tests run.
#   scripts/gpu-abn.sh OUTDIR STAGE...        (GPU machine, repo root; stages: scripts/gpu-stage.sh)
# Writes OUTDIR/bench-<stage>-<round>.json; `python3 bench/ab_report.py` takes any two stages
# once their files are named bench-base-* and bench-cand-* (scripts/abn-pairs.sh does that).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-abn.sh OUTDIR STAGE...}; shift
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
source scripts/gpu-lib.sh
seed_kernel_cache
bench=${AB_BENCH:---qgemm --kernels-only}
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  for st in "$@"; do echo "$(basename "$st") $(cat "$st/COMMIT" 2>/dev/null)"; done
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$out/device.txt"
if [ -n "${AB_TEST_STAGE:-}" ]; then
  for st in "$@"; do
    [ "$st" = "$AB_TEST_STAGE" ] || "$st/gpu-bench" /tmp/warm.json $bench >/dev/null 2>&1
  done &
  warm=$!
  STEP_SUMMARY="test result|FAILED|panicked" step tests "$AB_TEST_STAGE/gpu-tests" ${AB_TESTS:-qgemm} --test-threads 1
  wait $warm
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for st in "$@"; do
    step "bench-$(basename "$st")-$round" "$st/gpu-bench" "$out/bench-$(basename "$st")-$round.json" $bench
  done
done
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
exit $status

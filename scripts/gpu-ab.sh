#!/usr/bin/env bash
# A/B of two staged builds' kernels on one GPU, in one device call: the candidate's GPU tests
# (qgemm by default), then a benchmark (`gpu-bench --qgemm --kernels-only` by default) from the
# base build and from the candidate, alternated twice so that clock drift shows as run-to-run
# spread, not as a difference.
#   scripts/gpu-ab.sh OUTDIR BASE_STAGE CAND_STAGE [MS]
# A stage is a folder holding gpu-bench (and, for the candidate, gpu-tests), e.g. stage/gpu from
# scripts/gpu-stage.sh on main and another from the branch. MS: the token counts (default
# 1,4,16,17,24,32). AB_ENGINE=1 adds the engine's decode steps per precision (the Llama-3-8B
# shape) to each bench run. AB_BENCH replaces the bench's arguments (e.g. "--moe-experts", with
# NIBBLE_BENCH_FORMATS / NIBBLE_BENCH_TOKENS to narrow it, or "--kv-attention") and AB_TESTS the
# test filters (default qgemm). `python3 bench/ab_report.py OUTDIR` makes the table and plot.
# Logs and JSON go to OUTDIR (a tarball of the logs: a call returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-ab.sh OUTDIR BASE_STAGE CAND_STAGE [MS]}
base=${2:?base stage}; cand=${3:?candidate stage}; ms=${4:-1,4,16,17,24,32}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
source scripts/gpu-lib.sh
seed_kernel_cache
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "base $(cat "$base/COMMIT" 2>/dev/null) candidate $(cat "$cand/COMMIT" 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$out/device.txt"
# The base's kernels compile (NVRTC, about a minute) while the candidate's tests run: one run of
# the bench (the qgemm one at a single size by default).
"$base/gpu-bench" "$out/warm-base.json" ${AB_BENCH:---qgemm --kernels-only --ms 1} >"$out/warm-base.log" 2>&1 &
warm=$!
STEP_SUMMARY="test result|FAILED|panicked" step cand-tests "$cand/gpu-tests" ${AB_TESTS:-qgemm} --test-threads 1
wait $warm
kernels_only=--kernels-only; [ "${AB_ENGINE:-0}" = 1 ] && kernels_only=
args=${AB_BENCH:---qgemm $kernels_only --ms $ms}
for round in 1 2; do
  for side in base cand; do
    dir=$base; [ $side = cand ] && dir=$cand
    STEP_SUMMARY="^qgemm|^moe" step "bench-$side-$round" "$dir/gpu-bench" "$out/bench-$side-$round.json" $args
  done
done
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
exit $status

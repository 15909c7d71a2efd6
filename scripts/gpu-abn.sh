#!/usr/bin/env bash
# A/B/N of several staged builds in one device call: the GPU tests of one of them
# (AB_TEST_STAGE, filter AB_TESTS, default qgemm, environment AB_TEST_ENV), then one benchmark (AB_BENCH, default
# `--qgemm --kernels-only`) from every stage, alternated ROUNDS times (default 2) so clock drift
# shows as run-to-run spread. The other stages' kernels compile while the tests run.
#   scripts/gpu-abn.sh OUTDIR STAGE...        (GPU machine, repo root; stages: scripts/gpu-stage.sh)
# A STAGE is a folder (its files are named after it) or NAME=FOLDER, either followed by
# @VAR=VALUE[,VAR=VALUE] to run that build with probe knobs set (the same build A/B'd against
# itself, e.g. sk0=stage/cand@NIBBLE_WGMMA_STREAM_K=0). Writes
# OUTDIR/bench-NAME-ROUND.json (and peer.json with AB_PEER); `python3 bench/ab_report.py OUTDIR --base A --cand B` compares two.
# scripts/gpu-ab.sh is this for one candidate against main.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-abn.sh OUTDIR STAGE...}; shift
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
source scripts/gpu-lib.sh
seed_kernel_cache
bench=${AB_BENCH:---qgemm --kernels-only}
names=(); dirs=(); knobs=()
for st in "$@"; do
  knob=""
  if [[ $st == *@* ]]; then knob=${st#*@}; st=${st%%@*}; fi
  if [[ $st == *=* ]]; then names+=("${st%%=*}"); dirs+=("${st#*=}"); else names+=("$(basename "$st")"); dirs+=("$st"); fi
  knobs+=("${knob//,/ }")
done
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  for i in "${!dirs[@]}"; do echo "${names[$i]} $(cat "${dirs[$i]}/COMMIT" 2>/dev/null) ${knobs[$i]}"; done
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee "$out/device.txt"
if [ -n "${AB_TEST_STAGE:-}" ]; then
  # Every other build's kernels (a stage's knobs may be define sets) compile while the tests run.
  for i in "${!dirs[@]}"; do
    d=${dirs[$i]}
    if [ "$d" = "$AB_TEST_STAGE" ] && [ -z "${knobs[$i]}" ]; then continue; fi
    # shellcheck disable=SC2086 # knobs: VAR=VALUE words for env
    env ${knobs[$i]} "$d/nibble" kernels >/dev/null 2>&1 || env ${knobs[$i]} "$d/gpu-bench" /tmp/warm.json $bench >/dev/null 2>&1
  done &
  warm=$!
  # shellcheck disable=SC2086 # AB_TEST_ENV: VAR=VALUE words (a variant's defines) for the tests
  case "${AB_TESTS:-qgemm}" in
    *kv*) (if [ -n "${AB_TEST_ENV:-}" ]; then export ${AB_TEST_ENV}; fi; warm_kv "$AB_TEST_STAGE") ;;
  esac
  # shellcheck disable=SC2086
  STEP_SUMMARY="test result|FAILED|panicked" step tests env ${AB_TEST_ENV:-} "$AB_TEST_STAGE/gpu-tests" \
    ${AB_TESTS:-qgemm} --test-threads 1
  wait $warm
fi
# The peer on the same GPU in the same call, for ratios against PyTorch's kernels (AB_PEER:
# bench/gpu_peer.py's options, e.g. "--qgemm --ms=256,1024"); before the rounds, so a call cut
# short keeps it.
if [ -n "${AB_PEER:-}" ]; then
  # shellcheck disable=SC2086 # AB_PEER: options
  STEP_SUMMARY="^\{" step peer python3 bench/gpu_peer.py "$out/peer.json" $AB_PEER
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!dirs[@]}"; do
    # shellcheck disable=SC2086 # knobs: VAR=VALUE words for env
    STEP_SUMMARY="^qgemm|^moe" step "bench-${names[$i]}-$round" env ${knobs[$i]} "${dirs[$i]}/gpu-bench" \
      "$out/bench-${names[$i]}-$round.json" $bench
  done
done
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
exit $status

#!/usr/bin/env bash
# A KV-attention kernel change checked and timed in one device call, from the repo root:
#   scripts/gpu-kv-ab.sh OUTDIR NAME=STAGE...      (the first stage is the candidate)
# 1. the candidate's kv GPU tests (attention against the CPU in every format, pages as the CPU's
#    records, greedy serving alone = batched = chunked = preempted = prefix-cached, the errors);
# 2. gpu-bench --kv-attention from every stage (KV_FORMATS, default kv16,kv8,kv4,k8v4,kv4c,kv2c),
#    two rounds alternated (scripts/gpu-abn.sh), then one table: each stage's best time per
#    format and shape, and the candidate against every other stage.
# A STAGE may end in @VAR=VALUE (a define set through NIBBLE_NVRTC_DEFINES, names joined by +);
# the candidate's knobs apply to its tests too.
# Stage the candidate with scripts/gpu-stage.sh; an older build's gpu-bench (and COMMIT) in
# another folder is its base. Kernels compile in seconds on a fresh machine where the seed lacks them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-kv-ab.sh OUTDIR NAME=STAGE...}; shift
[ $# -ge 2 ] || { echo "gpu-kv-ab: a candidate and at least one base" >&2; exit 2; }
first=${1#*=}; first_knob=""
if [[ $first == *@* ]]; then first_knob=${first#*@}; first=${first%%@*}; fi
status=0
# The candidate's tests run with its knobs (a variant's NIBBLE_NVRTC_DEFINES).
AB_TEST_STAGE=$first AB_TEST_ENV="${first_knob//,/ }" AB_TESTS=kv:: \
  AB_BENCH="--kv-attention --kv-formats=${KV_FORMATS:-kv16,kv8,kv4,k8v4,kv4c,kv2c}" \
  scripts/gpu-abn.sh "$out" "$@" || status=1
names=()
for st in "$@"; do names+=("${st%%=*}"); done
python3 bench/kv_ab_table.py "$out" "${names[@]}" | tee "$out/table.md" || status=1
exit $status

#!/usr/bin/env bash
# The wgmma tiles' K splits swept: `gpu-bench --qgemm --kernels-only` with NIBBLE_WGMMA_SPLITS
# forced to each count (and the plan's choice, "plan"), for one or more staged builds, so a
# split plan can be chosen from one call. GPU machine, from the repo root:
#   bench/probe/wgmma_splits_probe.sh OUTDIR MS SPLITS STAGE...
# e.g. ... OUT 48,64,128,256 plan,1,2,4,8 stage/base stage/cand. Then
# `python3 bench/probe/wgmma_splits_report.py OUTDIR` tabulates them.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: OUTDIR MS SPLITS STAGE...}; ms=${2:?MS}; splits=${3:?SPLITS}; shift 3
mkdir -p "$out"
for st in "$@"; do
  name=$(basename "$st")
  for s in ${splits//,/ }; do
    if [ "$s" = plan ]; then unset NIBBLE_WGMMA_SPLITS; else export NIBBLE_WGMMA_SPLITS=$s; fi
    t0=$(date +%s)
    "$st/gpu-bench" "$out/$name-splits-$s.json" --qgemm --kernels-only --ms "$ms" > "$out/$name-splits-$s.log" 2>&1
    echo "$name splits $s: exit $? after $(( $(date +%s) - t0 ))s"
  done
done
unset NIBBLE_WGMMA_SPLITS

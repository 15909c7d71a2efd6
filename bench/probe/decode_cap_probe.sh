#!/usr/bin/env bash
# Where the decode gemv should hand over to the 64-token wgmma tiles: `gpu-bench --qgemm
# --kernels-only` at each token count with NIBBLE_DECODE_MAX_M unset ("plan") and set to each cap
# (the gemv up to the cap, wgmma tiles past it whatever the layer's size). GPU machine, repo root:
#   bench/probe/decode_cap_probe.sh OUTDIR MS CAPS STAGE...
# e.g. ... OUT 8,12,16,20,24,28,32 plan,16,8 stage/gpu. Then
# `python3 bench/probe/wgmma_splits_report.py OUTDIR` tabulates them (columns "STAGE dCAP").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: OUTDIR MS CAPS STAGE...}; ms=${2:?MS}; caps=${3:?CAPS}; shift 3
mkdir -p "$out"
for st in "$@"; do
  name=$(basename "$st")
  for c in ${caps//,/ }; do
    if [ "$c" = plan ]; then unset NIBBLE_DECODE_MAX_M; else export NIBBLE_DECODE_MAX_M=$c; fi
    t0=$(date +%s)
    "$st/gpu-bench" "$out/$name-splits-d$c.json" --qgemm --kernels-only --ms "$ms" > "$out/$name-d$c.log" 2>&1
    echo "$name decode cap $c: exit $? after $(( $(date +%s) - t0 ))s"
  done
done
unset NIBBLE_DECODE_MAX_M

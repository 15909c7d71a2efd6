#!/usr/bin/env bash
# `gpu-bench --qgemm --kernels-only` for one or more staged builds with a probe knob (an
# environment variable the dispatch reads once) unset ("plan") or set to each value, so a plan
# can be chosen from one device call. GPU machine, from the repo root:
#   bench/probe/knob_probe.sh OUTDIR MS VAR TAG VALUES STAGE...
# writes OUTDIR/<stage>-splits-<TAG><value>.json; `python3 bench/probe/wgmma_splits_report.py
# OUTDIR` tabulates them (columns "<stage> <TAG><value>"). wgmma_splits_probe.sh and
# decode_cap_probe.sh are this with their knobs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: OUTDIR MS VAR TAG VALUES STAGE...}; ms=${2:?MS}; var=${3:?VAR}; tag=${4?TAG}
values=${5:?VALUES}; shift 5
mkdir -p "$out"
for st in "$@"; do
  name=$(basename "$st")
  for v in ${values//,/ }; do
    if [ "$v" = plan ]; then unset "$var"; else export "$var=$v"; fi
    t0=$(date +%s)
    "$st/gpu-bench" "$out/$name-splits-$tag$v.json" --qgemm --kernels-only --ms "$ms" > "$out/$name-$tag$v.log" 2>&1
    echo "$name $var=$v: exit $? after $(( $(date +%s) - t0 ))s"
  done
done
unset "$var"

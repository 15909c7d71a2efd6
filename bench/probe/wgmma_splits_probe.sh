#!/usr/bin/env bash
# The wgmma tiles' K splits swept: NIBBLE_WGMMA_SPLITS forced to each count (and the plan's
# choice, "plan"), for one or more staged builds (bench/probe/knob_probe.sh). GPU machine:
#   bench/probe/wgmma_splits_probe.sh OUTDIR MS SPLITS STAGE...
# e.g. ... OUT 48,64,128,256 plan,1,2,4,8 stage/base stage/cand. Then
# `python3 bench/probe/wgmma_splits_report.py OUTDIR` tabulates them.
set -uo pipefail
out=${1:?usage: OUTDIR MS SPLITS STAGE...}; ms=${2:?MS}; splits=${3:?SPLITS}; shift 3
exec "$(dirname "$0")/knob_probe.sh" "$out" "$ms" NIBBLE_WGMMA_SPLITS "" "$splits" "$@"

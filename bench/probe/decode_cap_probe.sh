#!/usr/bin/env bash
# Where the decode gemv should hand over to the 64-token wgmma tiles: NIBBLE_DECODE_MAX_M unset
# ("plan") and set to each cap (the gemv up to the cap, the wgmma tiles past it), for one or more
# staged builds (bench/probe/knob_probe.sh). GPU machine, repo root:
#   bench/probe/decode_cap_probe.sh OUTDIR MS CAPS STAGE...
# e.g. ... OUT 8,12,16,20,24,28,32 plan,16,8 stage/gpu. Then
# `python3 bench/probe/wgmma_splits_report.py OUTDIR` tabulates them (columns "STAGE dCAP").
set -uo pipefail
out=${1:?usage: OUTDIR MS CAPS STAGE...}; ms=${2:?MS}; caps=${3:?CAPS}; shift 3
exec "$(dirname "$0")/knob_probe.sh" "$out" "$ms" NIBBLE_DECODE_MAX_M d "$caps" "$@"

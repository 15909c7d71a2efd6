#!/usr/bin/env bash
# Nsight Compute on W4A16's decode gemvs at one token (28672x4096 unless LAYER): the TMA-fed stream
# (w4a16_tdec) and the register-streamed decode gemv (w4a16_dec1), one launch each, full sections.
#   bench/probe/w4_stream_ncu.sh OUTDIR   (stage/gpu/gpu-bench from scripts/gpu-stage.sh)
set -uo pipefail
out=${1:?usage: bench/probe/w4_stream_ncu.sh OUTDIR}
mkdir -p "$out"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
export NIBBLE_BENCH_LAYERS=${LAYER:-gate_up}
for k in w4a16_tdec w4a16_dec1; do
  timeout 300 "$ncu" --clock-control none --set full -k "regex:^$k" --launch-skip 5 --launch-count 1 \
    stage/gpu/gpu-bench /tmp/ncu-bench.json --w4-stream >"$out/ncu-$k.txt" 2>"$out/ncu-$k.err"
  echo "$k: exit $?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued|Eligible Warps|L2 Hit|Registers Per|Achieved Occupancy" "$out/ncu-$k.txt" | head -40
done

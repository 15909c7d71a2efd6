#!/usr/bin/env bash
# Nsight Compute on W4A16's decode gemvs at one token (28672x4096 unless LAYER): the TMA-fed stream
# (w4a16_tdec) and the register-streamed decode gemv (w4a16_dec1; KERNELS picks), one launch each:
# speed of light, scheduler and warp-state statistics and every stall reason per issued
# instruction.
#   bench/probe/w4_stream_ncu.sh OUTDIR   (stage/gpu/gpu-bench from scripts/gpu-stage.sh)
set -uo pipefail
out=${1:?usage: bench/probe/w4_stream_ncu.sh OUTDIR}
mkdir -p "$out"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
export NIBBLE_BENCH_LAYERS=${LAYER:-gate_up}
for k in ${KERNELS:-w4a16_tdec w4a16_dec1}; do
  timeout 300 "$ncu" --clock-control none --section SpeedOfLight --section SchedulerStats \
    --section WarpStateStats --section LaunchStats --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    -k "regex:^$k" --launch-skip 5 --launch-count 1 \
    stage/gpu/gpu-bench /tmp/ncu-bench.json --w4-stream >"$out/ncu-$k.txt" 2>"$out/ncu-$k.err"
  echo "$k: exit $?"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp|Warp Cycles Per Issued|Executed Instructions  |Block Size" "$out/ncu-$k.txt" | head -12
  grep -E "issue_stalled" "$out/ncu-$k.txt" | awk '$NF+0 > 0.2' | sort -k3 -n -r | head -12
done

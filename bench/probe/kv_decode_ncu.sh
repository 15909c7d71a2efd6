#!/usr/bin/env bash
# Nsight Compute's full sections for the quantized pools' register-direct decode attention
# (kvq_decode_hd128_g4: Llama-3-8B heads, batch 64, context 4096), one launch per format, to see
# what holds kv4 at about 60% of HBM on an H200 and kv2c at 38% while kv8 streams at 89%
# (BENCHMARKS.md, issue 19): issue slots, stall reasons, occupancy.
#   bench/probe/kv_decode_ncu.sh OUTDIR [FORMAT...]      (GPU machine, repo root; default kv4 kv2c kv8)
set -uo pipefail
out=${1:?usage: bench/probe/kv_decode_ncu.sh OUTDIR [FORMAT...]}; shift
[ $# -gt 0 ] || set -- kv4 kv2c kv8
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for f in "$@"; do
  # Launch 0 is the eager warm-up call; 1 is the first of the graph's calls.
  timeout 150 "$ncu" --clock-control none --set full --import-source yes -f -o "/tmp/ncu-$f" \
    -k regex:kvq_decode_hd128 --launch-skip 1 --launch-count 1 \
    stage/gpu/gpu-bench /tmp/ncu-bench.json --kv-attention --kv-formats="$f" >"$out/ncu-$f.err" 2>&1
  "$ncu" --import "/tmp/ncu-$f.ncu-rep" --csv --page details >"$out/ncu-$f.csv" 2>>"$out/ncu-$f.err"
  "$ncu" --import "/tmp/ncu-$f.ncu-rep" --csv --page raw >"$out/ncu-$f-raw.csv" 2>>"$out/ncu-$f.err"
  [ "$f" = kv4 ] && "$ncu" --import "/tmp/ncu-$f.ncu-rep" --csv --page source --print-source sass \
    >"$out/ncu-$f-sass.csv" 2>>"$out/ncu-$f.err"
  echo "$f: exit $?, $(grep -c '"Duration"' "$out/ncu-$f.csv") kernel(s)"
  grep -E '"(Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|Executed Ipc Active|Block Limit Registers|Block Limit Shared Mem|Warp Cycles Per Issued Instruction|No Eligible|One or More Eligible)"' \
    "$out/ncu-$f.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF " " $(NF-1)}' | tr -d '"'
done

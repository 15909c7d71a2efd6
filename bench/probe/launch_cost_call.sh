#!/usr/bin/env bash
# What a quantized GEMM's launch costs beyond its time inside the kernel: Nsight Compute's
# isolated duration of each launch (caches flushed, clocks unlocked) and its DRAM bytes, against
# gpu-bench's graph-timed time per call of the same kernels in the same call (back to back, 20
# calls a graph at one token, 3 at 256). Kernels: the W4A16 decode gemv at one token, the W4A8
# and W8A8 wgmma tiles at 256 tokens. Tables: python3 bench/launch_cost_report.py DIR.
#   from the repo root on the GPU machine, with a staged build: bash bench/probe/launch_cost_call.sh DIR
set -u
out=${1:?usage: bench/probe/launch_cost_call.sh DIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
bin=${BENCH_BIN:-stage/gpu/gpu-bench}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$bin" "$out/bench.json" --qgemm --kernels-only --ms 1,256 > "$out/bench.log" 2>&1
echo "bench exit $?"
for spec in "w4a16_dec1 1 2000" "w4a8_wgmma 256 400" "w8a8_wgmma 256 400"; do
  set -- $spec
  timeout 200 "$ncu" --clock-control none --csv -k "regex:$1" -c "$3" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,sm__cycles_active.avg \
    "$bin" /tmp/ncu.json --qgemm --kernels-only --ms "$2" > "$out/ncu-$1-$2.csv" 2> "$out/ncu-$1-$2.err"
  echo "ncu $1 at $2: exit $?, $(grep -c gpu__time_duration "$out/ncu-$1-$2.csv") rows"
done
# The peer's kernels at 256 tokens (torch._scaled_mm FP8, cuBLAS BF16): names, grids, durations.
timeout 200 "$ncu" --clock-control none --csv -c 300 -k "regex:gemm|Gemm|GEMM|cutlass|nvjet|xmma" \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size,sm__cycles_active.avg \
  python3 bench/gpu_peer.py /tmp/peer.json --qgemm --ms=256 > "$out/ncu-peer-256.csv" 2> "$out/ncu-peer-256.err"
echo "ncu peer at 256: exit $?, $(grep -c gpu__time_duration "$out/ncu-peer-256.csv") rows"

#!/usr/bin/env bash
# Why the 64-token wgmma tiles (17 to 64 tokens) are slow: ptxas's report on the qgemm module's
# wgmma64 entries (registers, spills, serialization warnings), then the W8A8 / W4A8 / FP8 GEMMs at
# M = 64 on Llama-3-8B's shapes with the split-K count forced (NIBBLE_WGMMA_SPLITS) against the
# plan's. GPU machine, from the repo root, with scripts/gpu-stage.sh's stage/gpu/gpu-bench.
#   bench/probe/wgmma64_probe.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/probe/wgmma64_probe.sh OUTDIR}
mkdir -p "$out"
k=crates/nibble-cuda/kernels
cat $k/common.cuh $k/qgemm.cu $k/qgemv.cu $k/hopper.cuh $k/qgemm_wgmma.cu $k/qgemm_fp8.cu > /tmp/qgemm_full.cu
nvcc -std=c++17 -arch=sm_90a -cubin -o /tmp/qgemm.cubin -Xptxas -v /tmp/qgemm_full.cu > "$out/ptxas.txt" 2>&1
grep -iE "warn" "$out/ptxas.txt" | sort | uniq -c | head -20 > "$out/ptxas-warnings.txt"
grep -A2 -E "Compiling entry function '(w8a8|w4a8|fp8)_wgmma(64|128)?_f32'" "$out/ptxas.txt" > "$out/ptxas-wgmma.txt"
for s in plan 1 2 4 8; do
  if [ $s = plan ]; then unset NIBBLE_WGMMA_SPLITS; else export NIBBLE_WGMMA_SPLITS=$s; fi
  stage/gpu/gpu-bench "$out/m64-splits-$s.json" --qgemm --kernels-only --ms 48,64 > "$out/m64-splits-$s.log" 2>&1
done
python3 - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
lines = ["| splits | N x K | M | W8A8 µs | W4A8 µs | FP8 µs | cuBLAS BF16 µs |", "|---|---|---|---|---|---|---|"]
for s in ["plan", "1", "2", "4", "8"]:
    f = f"{out}/m64-splits-{s}.json"
    if not os.path.exists(f):
        continue
    for r in json.load(open(f))["qgemm"]:
        lines.append(f"| {s} | {r['n']} x {r['k']} | {r['m']} | {r['w8a8_ms']*1e3:.1f} | {r['w4a8_ms']*1e3:.1f} | {r['nibble_fp8_ms']*1e3:.1f} | {r['cublas_bf16_ms']*1e3:.1f} |")
open(f"{out}/m64.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

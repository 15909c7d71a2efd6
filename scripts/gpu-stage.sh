#!/usr/bin/env bash
# Builds, on a machine without CUDA, everything the GPU machine runs, and stages it in stage/gpu
# (git-ignored, well under the 64 MiB a device call carries):
#   stage/gpu/nibble            the release binary
#   stage/gpu/gpu-tests         the GPU test binary (crates/nibble-cuda/tests/gpu.rs)
#   stage/gpu/gpu-tp-tests      the two-GPU tensor-parallel tests (crates/nibble-cuda/tests/gpu_tp.rs)
#   stage/gpu/kernels-compile   the NVRTC compile test for every architecture
#   stage/gpu/gpu-bench         the kernel and decode-step benchmark (crates/nibble-cuda/examples)
# The model fixtures, bench scripts and configs travel with the working tree. Then the kernels:
# scripts/gpu-precompile.sh compiles every module for sm_90a here into .gpu-cache (the seed the
# GPU scripts unpack), with the kernel variants named in GPU_VARIANTS (define sets, e.g.
# GPU_VARIANTS="A B A+B"), so the GPU machine compiles nothing.
# Then, on the GPU machine, from the repo root: scripts/gpu-run.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=stage/gpu
rm -rf "$out" && mkdir -p "$out"
cargo build --release --locked -q -p nibble-cli
cp target/release/nibble "$out/nibble"
# Test and example binaries: take their paths from cargo's JSON messages.
pick() { python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == want and m.get("executable"):
        print(m["executable"])' "$1"; }
msgs=$(cargo test --release --locked -q -p nibble-cuda --features gpu-tests --no-run --message-format=json 2>/dev/null)
cp "$(echo "$msgs" | pick gpu)" "$out/gpu-tests"
cp "$(echo "$msgs" | pick gpu_tp)" "$out/gpu-tp-tests"
cp "$(echo "$msgs" | pick kernels_compile)" "$out/kernels-compile"
msgs=$(cargo build --release --locked -q -p nibble-cuda --example gpu_bench --message-format=json 2>/dev/null)
cp "$(echo "$msgs" | pick gpu_bench)" "$out/gpu-bench"
strip "$out"/* 2>/dev/null || true
# shellcheck disable=SC2086 # GPU_VARIANTS: one argument a define set
scripts/gpu-precompile.sh ${GPU_VARIANTS:-}
# The GPU machine's copy of the tree may not carry this commit's history: record it.
git describe --always --dirty > "$out/COMMIT"
du -ch "$out"/* | tail -1
size=$(du -sm "$out" | cut -f1)
if [ "$size" -gt 48 ]; then
  echo "gpu-stage: $out is ${size} MiB; a device call carries 64 MiB with the tree" >&2
  exit 1
fi

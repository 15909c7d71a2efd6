#!/usr/bin/env bash
# Compiles here, without a GPU, every kernel module a GPU call needs (sm_90a: H100 and H200) with
# pip's NVRTC and headers (test.sh installs them in .cuda-tk), and packs them as
# .gpu-cache/kernels.tar.xz.NN, the seed every GPU script unpacks (gpu-lib.sh seed_kernel_cache):
# a fresh GPU machine then compiles nothing, where it spent 1 to 4 minutes of device time on a
# cold call. The cache key leaves out where the headers were found (compile::cache_key), so these
# cubins are the GPU machine's as long as its NVRTC has the same version (13.0 both).
#   scripts/gpu-precompile.sh [DEFINES...]      (then scripts/gpu-pack.sh NAME)
# EXTRA_BINS="stage/base/nibble ..." adds the default modules of other binaries (an A/B's base
# build).
# Each DEFINES (names joined by +, as NIBBLE_NVRTC_DEFINES takes them) adds a kernel variant's
# modules to the default's: a define changes every module's options, so each variant an A/B
# runs would otherwise compile all of them again on the GPU machine. Compiles are kept in
# .gpu-kernels (git-ignored), so a re-run compiles only what changed: about 2 minutes a set from
# cold on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
tk=$PWD/.cuda-tk/nvidia/cu13
if [ ! -f "$tk/lib/libnvrtc.so.13" ]; then
  python3 -m pip install -q --no-deps --target .cuda-tk "nvidia-cuda-nvrtc==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-crt==13.0.88"
fi
cache=$PWD/.gpu-kernels
mkdir -p "$cache" .gpu-cache
cargo build --release --locked -q -p nibble-cli
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/nibble-kernels"
modules() {  # modules BINARY DEFINES: compiled into the cache, their files copied
  list=$(NIBBLE_NVRTC_DEFINES=$2 NIBBLE_KERNEL_CACHE=$cache CUDA_HOME=$tk LD_LIBRARY_PATH=$tk/lib \
    "$1" kernels --arch sm_90a --list)
  for f in $list; do cp "$cache/$f" "$work/nibble-kernels/"; done
}
for defines in "" "$@"; do modules target/release/nibble "$defines"; done
# An A/B's base build runs its default kernels only.
for bin in ${EXTRA_BINS:-}; do modules "$bin" ""; done
rm -f .gpu-cache/kernels.tar.xz.*
tar cf - -C "$work" nibble-kernels | xz -T0 -6 | split -b 15000000 -d - .gpu-cache/kernels.tar.xz.
echo "gpu-precompile: $(ls "$work/nibble-kernels" | wc -l) cubins, $(du -ch .gpu-cache/kernels.tar.xz.* | tail -1 | cut -f1) in .gpu-cache"

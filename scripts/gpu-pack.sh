#!/usr/bin/env bash
# Packs what a device call needs from the git-ignored folders into one xz archive, about a third
# of their size (the staged binaries are about 41 MiB of a call's 64), from the repo root:
#   scripts/gpu-pack.sh NAME [PATH...]
# PATHs default to what scripts/gpu-stage.sh staged, .gpu-data (scripts/gpu-engine-data.sh) and
# .gpu-cache (NVRTC's kernels brought back from an earlier call: run a script with SAVE_KERNELS=1,
# then copy the OUTDIR's kernels.tar.xz.* to .gpu-cache/; every GPU script seeds its kernel cache from
# it, so a fresh machine skips the 2 to 4 minutes of compiling what did not change). Then carry
# ["stage/pack"] and start the command with `tar xJf stage/pack/NAME.tar.xz && ...`. Old packs
# are removed so only this one travels.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/gpu-pack.sh NAME [PATH...]}; shift
if [ $# -eq 0 ]; then
  set -- stage/gpu
  for p in .gpu-data .gpu-cache; do [ -e "$p" ] && set -- "$@" "$p"; done
fi
mkdir -p stage/pack
rm -f stage/pack/*.tar.xz
tar cJf "stage/pack/$name.tar.xz" "$@"
size=$(du -m "stage/pack/$name.tar.xz" | cut -f1)
echo "stage/pack/$name.tar.xz: ${size} MiB ($*)"
if [ "$size" -gt 56 ]; then
  echo "gpu-pack: over what a device call carries with the tree (64 MiB)" >&2
  exit 1
fi

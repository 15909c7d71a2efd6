#!/usr/bin/env bash
# The default model on the GPU machine, which cannot fetch it: its GGUF file travels in three
# carried parts (.gpu-model-a/b/c, each under the per-call size limit), collected in
# /tmp/nibble-model by consecutive calls while the machine stays warm, then joined and verified.
#   here:  scripts/gpu-default-model.sh split     (makes .gpu-model-a, -b, -c)
#   there: scripts/gpu-default-model.sh collect   (in each call that carries a part)
#   there: scripts/gpu-default-model.sh path      (prints the joined, verified file, or fails)
set -euo pipefail
cd "$(dirname "$0")/.."
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dir=/tmp/nibble-model
case ${1:-} in
  split)
    src=$(target/release/nibble fetch)
    rm -rf .gpu-model-a .gpu-model-b .gpu-model-c /tmp/nibble-split && mkdir -p /tmp/nibble-split
    split -b 33000000 -a 1 "$src" /tmp/nibble-split/part.
    for p in a b c; do mkdir -p .gpu-model-$p && mv /tmp/nibble-split/part.$p .gpu-model-$p/; done ;;
  collect)
    mkdir -p $dir
    for p in a b c; do [ -d .gpu-model-$p ] && cp .gpu-model-$p/part.* $dir/ || true; done
    ls $dir ;;
  path)
    f=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -f $f ]; then
      [ -f $dir/part.a ] && [ -f $dir/part.b ] && [ -f $dir/part.c ] || { echo "model parts missing" >&2; exit 1; }
      cat $dir/part.a $dir/part.b $dir/part.c > $f
    fi
    echo "$sha  $f" | sha256sum -c --quiet - >&2 || { rm -f $f; echo "model hash mismatch" >&2; exit 1; }
    echo $f ;;
  *) echo "usage: $0 split|collect|path" >&2; exit 2 ;;
esac

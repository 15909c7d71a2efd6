#!/usr/bin/env bash
# The quantized KV cache on the GPU with the real default model: greedy text on the CPU and on the
# GPU for each GPU KV format (kv8, kvfp8, kv4, k8v4), then a QoQ W4A8KV4 (g64) checkpoint quantized
# here (QServe's format: 4-bit weights with INT8 activations, 4-bit KV) decoded on both, and
# served from the GPU. Run on the GPU machine once the default model is there
# (scripts/gpu-default-model.sh) with a calibration slice (bench/sharegpt_slice.py):
#   scripts/gpu-kv-check.sh NIBBLE_BINARY MODEL.gguf CALIBRATION.json OUTDIR
# KV_FORMATS="kv8 kv4" picks the formats compared first ("" for none).
# Text may part ways after some tokens where two logits are near-equal (the GPU's operands are
# 16-bit); the script prints how many leading words agree and fails only if a run fails.
set -uo pipefail
bin=${1:?usage} model=${2:?usage} calib=${3:?usage} out=${4:?usage}
mkdir -p "$out"
status=0
agree() {
  python3 -c 'import sys
a, b = sys.argv[1].split(), sys.argv[2].split()
n = 0
while n < min(len(a), len(b)) and a[n] == b[n]: n += 1
print(f"{n} of {max(len(a), len(b))} words agree")' "$1" "$2"
}
compare() {  # compare LABEL MODEL [ARGS...]
  local label=$1 m=$2; shift 2
  echo "== $label"
  for prompt in "The capital of France is" "Once upon a time"; do
    cpu=$("$bin" --device cpu --model "$m" "$@" generate --prompt "$prompt" --max-tokens 32 2>/dev/null)
    gpu=$("$bin" --device cuda --model "$m" "$@" generate --prompt "$prompt" --max-tokens 32 2>"$out/gpu-$label.err")
    if [ -z "$gpu" ]; then echo "  GPU generate failed"; tail -3 "$out/gpu-$label.err"; status=1; continue; fi
    echo "  cpu:  $cpu"
    echo "  cuda: $gpu"
    echo "  $(agree "$cpu" "$gpu")"
  done
}
for kv in ${KV_FORMATS-kv8 kvfp8 kv4 k8v4}; do
  compare "$kv" "$model" --kv "$kv"
done
ckpt=$out/ckpt-w4a8-kv4-qoq
t0=$(date +%s)
if "$bin" quantize --model "$model" --format w4a8-g64-kv4 --method qoq --dataset "$calib" \
    --out "$ckpt" --overwrite >"$out/quantize-qoq.log" 2>&1; then
  echo "== QoQ W4A8KV4 quantized in $(( $(date +%s) - t0 ))s, $(du -sm "$ckpt" | cut -f1) MB"
  compare w4a8-kv4-qoq "$ckpt"
  # Its KV format comes with it: the GPU pool says so.
  "$bin" --device cuda --model "$ckpt" generate --prompt "Hi" --max-tokens 4 2>&1 >/dev/null \
    | grep -i "kv cache" | head -2
else
  echo "QoQ quantize failed"; tail -5 "$out/quantize-qoq.log"; status=1
fi
exit $status

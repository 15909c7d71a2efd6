#!/usr/bin/env bash
# Real quantized checkpoints on the GPU: quantizes the default model with `nibble quantize`
# (W4A16 round-to-nearest, AWQ and GPTQ; W8A8 round-to-nearest and SmoothQuant) on the GPU
# machine's CPU, then decodes each greedily on the CPU and on the GPU's quantized kernels and
# compares the text, and serves the AWQ checkpoint from the GPU to curl.
#   scripts/gpu-quantized-check.sh NIBBLE_BINARY MODEL.gguf CALIBRATION.json OUTDIR
# SPECS="FORMAT:METHOD ..." picks other checkpoints, and SERVE the one `nibble serve` runs (a
# FORMAT-METHOD of SPECS): SPECS=issue18 is issue 18's, QoQ W4A8 (progressive g128), LiquidQuant,
# COMET (fmpq, on its own kernel) and FP8 round-to-nearest and SmoothQuant, serving the QoQ one.
# CALIBRATION.json: ShareGPT records (the GPU machine has no network; `python3
# bench/sharegpt_slice.py` writes the file's first 600 to .gpu-calib/, whose calibration half
# gives the same sequences as the whole file).
# Text may part ways after some tokens where two logits are near-equal: the GPU rounds
# activations to bf16 (W4A16) or quantizes the bf16 output of RMSNorm / SiLU-gate (W8A8), the
# CPU its f32 value. The script prints how many leading words agree.
set -uo pipefail
bin=${1:?usage} model=${2:?usage} calib=${3:?usage} out=${4:?usage}
mkdir -p "$out"
status=0
specs=${SPECS:-w4a16-g64:rtn w4a16-g64:awq w4a16-g64:gptq w8a8:rtn w8a8:smoothquant}
serve=${SERVE:-w4a16-g64-awq}
if [ "$specs" = issue18 ]; then
  specs="w4a8-g128:qoq w4a8-lqq-g64:lqq w4a4a8-g128:fmpq fp8:rtn fp8:smoothquant"
  serve=${SERVE:-w4a8-g128-qoq}
fi
for spec in $specs; do
  fmt=${spec%%:*} method=${spec##*:}
  dir=$out/ckpt-$fmt-$method
  t0=$(date +%s)
  if ! "$bin" quantize --model "$model" --format "$fmt" --method "$method" --dataset "$calib" \
      --out "$dir" --overwrite >"$out/quantize-$fmt-$method.log" 2>&1; then
    echo "$fmt $method: quantize failed"; tail -5 "$out/quantize-$fmt-$method.log"; status=1; continue
  fi
  echo "== $fmt $method: quantized in $(( $(date +%s) - t0 ))s, $(du -sm "$dir" | cut -f1) MB"
  for prompt in "The capital of France is" "Once upon a time"; do
    cpu=$("$bin" --device cpu --model "$dir" generate --prompt "$prompt" --max-tokens 32 2>/dev/null)
    gpu=$("$bin" --device cuda --model "$dir" generate --prompt "$prompt" --max-tokens 32 2>"$out/gpu-$fmt-$method.err")
    if [ -z "$gpu" ]; then echo "  GPU generate failed"; tail -3 "$out/gpu-$fmt-$method.err"; status=1; continue; fi
    same=$(python3 -c 'import sys
a, b = sys.argv[1].split(), sys.argv[2].split()
n = 0
while n < min(len(a), len(b)) and a[n] == b[n]: n += 1
print(f"{n} of {max(len(a), len(b))} words agree")' "$cpu" "$gpu")
    echo "  cpu:  $cpu"
    echo "  cuda: $gpu"
    echo "  $same"
  done
done
scripts/gpu-serve-check.sh "$bin" "$out/ckpt-$serve" || status=1
exit $status

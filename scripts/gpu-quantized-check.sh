#!/usr/bin/env bash
# Real quantized checkpoints on the GPU: quantizes the default model with `nibble quantize`
# (W4A16 round-to-nearest, AWQ and GPTQ; W8A8 round-to-nearest and SmoothQuant) on the GPU
# machine's CPU, then decodes each greedily on the CPU and on the GPU's quantized kernels and
# compares the text, and serves the AWQ checkpoint from the GPU to curl.
#   scripts/gpu-quantized-check.sh NIBBLE_BINARY MODEL.gguf CALIBRATION.json OUTDIR
# SPECS="FORMAT:METHOD ..." picks other checkpoints, and SERVE the one `nibble serve` runs (a
# FORMAT-METHOD of SPECS): SPECS=issue18 is issue 18's, QoQ W4A8 (progressive g64, since the
# default model's 576 input channels take no g128, and per channel), LiquidQuant, COMET (fmpq
# g64, on its own kernel) and FP8 round-to-nearest and SmoothQuant, serving the QoQ one, after
# W8A8 round-to-nearest as the yardstick of agreement.
# CALIBRATION.json: ShareGPT records (the GPU machine has no network; `python3
# bench/sharegpt_slice.py` writes the file's first 600 to .gpu-calib/, whose calibration half
# gives the same sequences as the whole file).
# Text may part ways after some tokens where two logits are near-equal: the GPU rounds
# activations to bf16 (W4A16) or quantizes the bf16 output of RMSNorm / SiLU-gate (W8A8), the
# CPU its f32 value. The script prints how many leading words agree, and, the firmer check, each
# checkpoint's perplexity on PPL_SEQS (default 16) held-out ShareGPT sequences of 512 tokens on
# the CPU and on the GPU beside the unquantized model's (a kernel that read its weights wrong
# would part from the CPU's by far more than the activations' rounding does).
set -uo pipefail
bin=${1:?usage} model=${2:?usage} calib=${3:?usage} out=${4:?usage}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source "$(dirname "$0")/gpu-lib.sh"
(cd "$(dirname "$0")/.." && seed_kernel_cache)  # (.gpu-cache is at the repo root)
status=0
specs=${SPECS:-w4a16-g64:rtn w4a16-g64:awq w4a16-g64:gptq w8a8:rtn w8a8:smoothquant}
serve=${SERVE:-w4a16-g64-awq}
if [ "$specs" = issue18 ]; then
  specs="w8a8:rtn w4a8-g64:qoq w4a8:qoq w4a8-lqq-g64:lqq w4a4a8-g64:fmpq fp8:rtn fp8:smoothquant"
  serve=${SERVE:-w4a8-g64-qoq}
fi
ppl_seqs=${PPL_SEQS:-16}
# ppl DEVICE MODEL: the perplexity of MODEL on DEVICE over the held-out ShareGPT sequences.
ppl() {
  timeout "${PPL_TIMEOUT:-120}" "$bin" --device "$1" --model "$2" eval ppl --sharegpt "$ppl_seqs" \
    --dataset "$calib" --json \
    2>>"$out/ppl.err" | python3 -c 'import json, sys; print("%.4f" % json.load(sys.stdin)["sharegpt"]["ppl"])' \
    2>>"$out/ppl.err"
}
dense_ppl=$(ppl cpu "$model")
[ -n "$dense_ppl" ] || { echo "perplexity of the unquantized model failed"; tail -3 "$out/ppl.err"; status=1; }
echo "== unquantized model: perplexity $dense_ppl on the CPU ($ppl_seqs held-out ShareGPT sequences of 512 tokens)"
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
  p_cpu=$(ppl cpu "$dir") p_gpu=$(ppl cuda "$dir")
  if [ -z "$p_cpu" ] || [ -z "$p_gpu" ]; then
    echo "  perplexity failed"; tail -3 "$out/ppl.err"; status=1; continue
  fi
  echo "  perplexity: cpu $p_cpu, cuda $p_gpu ($(python3 -c "print(f'{$p_gpu / $p_cpu:.4f}')")x the CPU's; unquantized $dense_ppl)"
done
"$(dirname "$0")/gpu-serve-check.sh" "$bin" "$out/ckpt-$serve" || status=1
exit $status

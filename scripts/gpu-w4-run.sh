#!/usr/bin/env bash
# W4A16's TMA-fed decode gemv (kernels/qgemv_stream.cu, issue 18) on one GPU, from the repo root,
# with what scripts/gpu-stage.sh staged in stage/gpu and scripts/gpu-engine-data.sh wrote in
# .gpu-data:
#   scripts/gpu-w4-run.sh OUTDIR [PART...]
# Parts (default: all, in this order):
#   tests   the quantized-GEMM GPU tests (every tier, the stream and the register-streamed decode
#           gemv against the reference; determinism) and the quantized models against the CPU
#   bench   gpu-bench --w4-stream: the stream, the register-streamed decode gemv and cuBLAS BF16
#           on Llama-3-8B's layers and a TP=2 rank's halves at 1, 2 and 4 tokens
#   steps   decode steps of 1 and 4 sequences (W4_SEQS), Llama-3-8B shape in W4A16 g128 with the
#           stream on and off (NIBBLE_W4A16_STREAM), and BF16 beside them
#   70b     Llama-2-70B shape in W4A16 g128 on one GPU (35 GB), stream on and off, 1 sequence
# Carry .gpu-cache (kernels.tgz from an earlier run's SAVE_KERNELS=1) to skip most of NVRTC's
# first compile. Results: OUTDIR/*.json, the logs as one archive, device.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-w4-run.sh OUTDIR [PART...]}
shift
parts=${*:-tests bench steps 70b}
mkdir -p "$out"
bin=stage/gpu/nibble
tok=.gpu-data/tokenizer/tokenizer.json
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(cat stage/gpu/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
} | tee -a "$out/device.txt"

source scripts/gpu-lib.sh
seed_kernel_cache
STEP_SUMMARY="^throughput|^steps|seqs:|^test |test result|FAILED|panicked|error"

throughput() {  # throughput NAME MODEL ARGS...
  local name=$1 model=$2; shift 2
  step "$name" timeout "${TIMEOUT:-300}" "$bin" --device cuda --dummy-weights "$model" --tokenizer "$tok" \
    bench throughput --json "$out/$name.json" "$@"
}

for part in $parts; do
  case $part in
    tests)
      step w4-tests timeout 500 stage/gpu/gpu-tests --test-threads 1 \
        ${W4_TESTS:-w4a16_matches quantized_gemms_on_real_layer_shapes split_k_is_deterministic quantized_models_match_cpu awq_and_gptq} ;;
    bench)
      step w4-bench timeout 300 stage/gpu/gpu-bench "$out/w4-stream.json" --w4-stream
      python3 - "$out/w4-stream.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["w4_stream"]
print(f"{'layer':10} {'M':>2} {'stream us':>9} {'regs us':>8} {'cuBLAS16':>8} {'stream/HBM':>10} {'regs/HBM':>8} {'gain':>5}")
for r in rows:
    print(f"{r['layer']:10} {r['tokens']:>2} {r['stream_us']:>9.1f} {r['register_decode_us']:>8.1f} {r['cublas_bf16_us']:>8.1f}"
          f" {r['stream_hbm_share']:>10.2f} {r['register_decode_hbm_share']:>8.2f} {r['stream_vs_register_decode']:>5.2f}")
PY
      ;;
    steps)
      for seqs in ${W4_SEQS:-1 4}; do
        for on in 1 0; do
          NIBBLE_W4A16_STREAM=$on throughput "w4-b$seqs-stream$on" llama-3-8b:w4a16-g128 \
            --input-len 128 --output-len 256 --num-prompts "$seqs" --max-num-seqs "$seqs" --profile
        done
        throughput "bf16-b$seqs" llama-3-8b --input-len 128 --output-len 256 --num-prompts "$seqs" \
          --max-num-seqs "$seqs" --profile
      done ;;
    70b)
      # Llama-2-70B's vocabulary (32,000) is below the SmolLM2 tokenizer's: byte-level tokens.
      for on in 1 0; do
        NIBBLE_W4A16_STREAM=$on step "llama-2-70b-w4a16-stream$on" timeout 300 "$bin" --device cuda \
          --dummy-weights llama-2-70b:w4a16-g128 bench throughput \
          --json "$out/llama-2-70b-w4a16-stream$on.json" --input-len 128 --output-len 64 \
          --num-prompts 2 --max-num-seqs 1 --profile
      done ;;
    *) echo "unknown part $part" >&2; status=1 ;;
  esac
done
# A device call brings back 8 files: the logs travel as one archive.
tar czf "$out/logs-$(echo $parts | tr ' ' '-').tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
save_kernel_cache
exit $status

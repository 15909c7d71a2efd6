#!/usr/bin/env bash
# The serving engine end to end on the GPU machine, from the repo root, with what
# scripts/gpu-stage.sh staged in stage/gpu (or $STAGE) and what scripts/gpu-engine-data.sh put in .gpu-data
# (a ShareGPT slice and the default model's tokenizer, so token counts are a real tokenizer's).
#   scripts/gpu-engine-run.sh OUTDIR PART...
# PARTs, run in the order given:
#   tests       every GPU test (device sampling against the reference among them)
#   tests=NAME  the GPU tests whose names contain NAME
#   prefill     causal prefill attention, 1k to 16k tokens: both of nibble's kernel tiers and
#               PyTorch's flash SDPA
#   steps       BF16 Llama-3-8B decode steps at batch 1, 64, 256 (the engine's own rate)
#   profile     host vs device time per step at batch 1, 64, 256, in lockstep (--no-run-ahead:
#               each step waits for its tokens) and running ahead (step n+1 queued first)
#   throughput  1000 ShareGPT prompts offline: BF16 at 64 and 256 sequences (running ahead and
#               in lockstep), W4A16-g128 and W8A8 at 256
#   moe-group   the moe part's batch-1 run with the two routed experts of a step grouped
#               (NIBBLE_MOE_GROUP_MIN=2) and one by one (3, the default)
#   serve       `nibble serve` (BF16) under `nibble bench serve` at several request rates
#   qgemm       the quantized GEMMs (W4A16, W8A8, W4A8) on Llama-3-8B's layer shapes against
#               cuBLAS BF16 and PyTorch's int4 / int8 / fp8 matmuls (report-qgemm.md, qgemm.png),
#               then decode steps per precision; qgemm-kernels: the kernels alone
#   w4a8        1000 ShareGPT prompts offline at 64 and 256 sequences: W4A8 (QoQ g128) and BF16
#               in the same session (the W4A8 issue's end-to-end ratio; SEQS=256: one size)
#   kv-attention  decode attention per GPU KV format (kv16, kv8, kvfp8, kv4, mixes) at batch 64 /
#               ctx 4k and batch 8 / ctx 32k, and PyTorch's flash SDPA (bf16, FP8 dequantized)
#   kv-long     4k-token prompts, 512-token outputs offline: W4A8-KV4 and BF16-KV16, and the pool
#               sizes each fits in the same memory (the low-bit KV issue's end-to-end ratio)
#               (KV_LONG_RUNS: other "name model kv" runs, comma-separated)
#   w8a16       the same for W8A16 and W4A16-g128, with BF16 in the same session
#   fp8         the same for FP8 W8A8 (run it with w4a8 for a BF16 figure from the same session)
#   comet       the same for COMET W4A4A8 (g128) at SEQS (default 64,256; COMET_PROMPTS prompts,
#               default 1000), no BF16; its kernels
#               against the dequantized path: scripts/gpu-e2e-ab.sh with PART=comet and stages
#               gemv=stage/gpu tiled=stage/gpu@NIBBLE_COMET_GEMV=0 dequant=stage/gpu@NIBBLE_COMET=0
#   w8a8-fp8    1000 ShareGPT prompts offline at SEQS (default 64,256): W8A8 and FP8, no BF16
#               (for A/Bs of one build: scripts/gpu-e2e-ab.sh with PART=w8a8-fp8)
#   moe-experts one Mixtral-8x7B expert layer in W4A16, W8A8 and BF16 at 1 to 64 tokens: the
#               grouped GEMMs, the grouped layer, the experts one by one, and cuBLAS BF16 over
#               the same bytes (gpu-bench --moe-experts)
#   moe         Mixtral-8x7B shape in W4A16-g128 (its vocabulary widened to the tokenizer's 49,152,
#               bench/configs): ShareGPT prompts one sequence at a time (batch-1 decode) and
#               offline at 64 and 256 sequences (MOE_PROMPTS, default 400)
# Logs and JSON go to OUTDIR; exits non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-engine-run.sh OUTDIR PART...}
shift
mkdir -p "$out"
stage=${STAGE:-stage/gpu}  # STAGE: another staged build (an A/B in one call)
bin=$stage/nibble
ds=.gpu-data/sharegpt.json
tok=.gpu-data/tokenizer/tokenizer.json
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
status=0
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(cat "$stage/COMMIT" 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} | tee -a "$out/device.txt"

source scripts/gpu-lib.sh
seed_kernel_cache
STEP_SUMMARY="^throughput|^steps|seqs:|with prefill|^test result|FAILED|panicked"

throughput() {  # throughput NAME MODEL ARGS...
  local name=$1 model=$2; shift 2
  step "$name" "$bin" --device cuda --dummy-weights "$model" --tokenizer "$tok" \
    bench throughput --dataset "$ds" --json "$out/$name.json" "$@"
}

for part in "$@"; do
  case $part in
    tests)
      step gpu-tests $stage/gpu-tests --test-threads 1 ;;
    tests=*)
      step "gpu-tests-${part#tests=}" $stage/gpu-tests "${part#tests=}" --test-threads 1 ;;
    prefill)
      step prefill-attention $stage/gpu-bench "$out/prefill-attention.json" --prefill-attention
      step prefill-peer python3 bench/gpu_peer.py "$out/prefill-peer.json" --prefill-attention ;;
    steps)
      step decode-steps $stage/gpu-bench "$out/decode-steps.json" --decode-steps 1,64,256 ;;
    profile)
      for mode in lockstep ahead; do
        flag=$([ $mode = lockstep ] && echo --no-run-ahead || true)
        throughput profile-$mode-b1 llama-3-8b --num-prompts 16 --max-num-seqs 1 --profile $flag
        throughput profile-$mode llama-3-8b --num-prompts 256 --sweep-seqs 64,256 --profile $flag
      done ;;
    throughput)
      throughput throughput-bf16 llama-3-8b --num-prompts 1000 --sweep-seqs 64,256 --profile
      throughput throughput-bf16-lockstep llama-3-8b --num-prompts 1000 --sweep-seqs 64,256 \
        --profile --no-run-ahead
      throughput throughput-w4a16 llama-3-8b:w4a16-g128 --num-prompts 1000 --profile
      throughput throughput-w8a8 llama-3-8b:w8a8 --num-prompts 1000 --profile ;;
    qgemm|qgemm-kernels)
      step gpu-bench $stage/gpu-bench "$out/gpu-bench.json" --qgemm \
        $([ $part = qgemm-kernels ] && echo --kernels-only)
      step peer python3 bench/gpu_peer.py "$out/gpu-peer.json" --qgemm
      python3 bench/qgemm_report.py "$out" > /dev/null 2>"$out/qgemm-report.err" || status=1 ;;
    kv-attention)
      step kv-attention $stage/gpu-bench "$out/kv-attention.json" --kv-attention
      step kv-attention-peer python3 bench/gpu_peer.py "$out/kv-attention-peer.json" --kv-attention
      python3 bench/kv_report.py "$out" > "$out/report-kv.md" 2>"$out/report-kv.err" || status=1 ;;
    kv-long)
      IFS=, read -ra runs <<< "${KV_LONG_RUNS:-long-w4a8-kv4 llama-3-8b:w4a8-g128 kv4,long-bf16-kv16 llama-3-8b kv16}"
      for run in "${runs[@]}"; do
        read -r name model kv <<< "$run"
        throughput "$name" "$model" --kv "$kv" --num-prompts "${KV_LONG_PROMPTS:-256}" \
          --input-len 4096 --output-len 512 --sweep-seqs 64,256 --profile
      done ;;
    w4a8)
      throughput throughput-w4a8 llama-3-8b:w4a8-g128 --num-prompts 1000 --sweep-seqs "${SEQS:-64,256}" --profile
      throughput throughput-bf16 llama-3-8b --num-prompts 1000 --sweep-seqs "${SEQS:-64,256}" --profile ;;
    w8a16)
      for spec in w8a16 w4a16-g128; do
        throughput "throughput-$spec" "llama-3-8b:$spec" --num-prompts 1000 --sweep-seqs 64,256 --profile
      done
      throughput throughput-bf16 llama-3-8b --num-prompts 1000 --sweep-seqs 64,256 --profile ;;
    fp8)
      throughput throughput-fp8 llama-3-8b:fp8 --num-prompts 1000 --sweep-seqs 64,256 --profile ;;
    comet)
      throughput throughput-comet llama-3-8b:w4a4a8-g128 --num-prompts "${COMET_PROMPTS:-1000}" --sweep-seqs "${SEQS:-64,256}" --profile ;;
    w8a8-fp8)
      throughput throughput-w8a8 llama-3-8b:w8a8 --num-prompts 1000 --sweep-seqs "${SEQS:-64,256}" --profile
      throughput throughput-fp8 llama-3-8b:fp8 --num-prompts 1000 --sweep-seqs "${SEQS:-64,256}" --profile ;;
    moe-experts)
      step moe-experts $stage/gpu-bench "$out/moe-experts.json" --moe-experts ;;
    moe)
      mixtral=bench/configs/mixtral-8x7b-vocab-49152.json:w4a16-g128
      throughput moe-mixtral-w4a16-b1 "$mixtral" --num-prompts 16 --max-num-seqs 1 --profile
      throughput moe-mixtral-w4a16 "$mixtral" --num-prompts "${MOE_PROMPTS:-400}" \
        --sweep-seqs 64,256 --profile ;;
    moe-group)
      mixtral=bench/configs/mixtral-8x7b-vocab-49152.json:w4a16-g128
      for least in 2 3; do
        export NIBBLE_MOE_GROUP_MIN=$least
        throughput "moe-mixtral-w4a16-b1-group$least" "$mixtral" --num-prompts 16 \
          --max-num-seqs 1 --profile
      done
      unset NIBBLE_MOE_GROUP_MIN ;;
    serve)
      step serve-bf16 bash scripts/gpu-serve-bench.sh "$bin" llama-3-8b "$tok" "$ds" "$out" ;;
    *) echo "unknown part $part" >&2; status=1 ;;
  esac
done
python3 bench/throughput_report.py "$out" > "$out/report.md" 2>"$out/report.err" || true
tar czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
save_kernel_cache
exit $status

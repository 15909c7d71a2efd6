#!/usr/bin/env bash
# Tensor parallelism on a two-GPU machine (issue 24), from the repo root, with what
# scripts/gpu-stage.sh staged in stage/gpu and scripts/gpu-engine-data.sh wrote in .gpu-data:
#   scripts/gpu-tp-run.sh OUTDIR [PART...]
# Parts (default: all, in this order):
# Carry .gpu-cache (kernels.tar.xz.* from an earlier run's SAVE_KERNELS=1) to skip NVRTC's first
# compile of every kernel (about 100 s on a fresh machine).
#   tests     the two-GPU tests (stage/gpu/gpu-tp-tests): exact NCCL sums, fixtures and quantized
#             shards against one GPU, graphs replaying the all-reduces, a failed rank
#   peer      the peer sum's two-GPU tests alone (the `tests` part runs them too)
#   arlat     NCCL's all-reduce latency for a decode step's row, under its protocol choices
#   serve     the server at TP=2 on the tiny Llama 3 fixture: 8 greedy completions at once give
#             what they give one by one (scripts/gpu-tp-serve-check.sh)
#   b1        Llama-3-8B shape, one sequence (256 output tokens): decode step at TP=1 and TP=2,
#             TP=2 also without the peer sum (twice each); B1_SWIGLU=1 adds TP=1 and TP=2 without
#             the SwiGLU epilogue (NIBBLE_SWIGLU=0); B1_VARIANTS="A B+C" adds TP=1 and TP=2 with
#             each kernel define set (NIBBLE_NVRTC_DEFINES); B1_ALL=1 adds TP=2 without the
#             symmetric window, without the split head, with NCCL_PROTO=LL
#             B1_QUICK=1 runs TP=1 and TP=2 once each, nothing else; B1_BASE=BINARY adds TP=1 and
#             TP=2 with another build (an A/B's base), each twice, alternated with this one's;
#             B1_ENVS="NAME=VALUE ..." adds TP=1 and TP=2 once with each setting
#   rank      one TP=2 rank's work without its sums, on one GPU: the batch-1 decode of
#             bench/configs/llama-3-8b-tp2-rank.json (half the heads, MLP and vocabulary), and
#             Nsight Compute's isolated kernel times of its decode steps and of the whole model's
#             (scripts/gpu-profile-step.sh; RANK_NCU=0 skips them)
#   offline   Llama-3-8B shape, ShareGPT offline throughput at TP=1 and TP=2 (256 sequences),
#             TP=2 also without the peer sum (unless TP_NOPEER=0) and without all three levers
#             (unless TP_BASE=0); OFFLINE_ENVS="NAME=VALUE ..." adds TP=2 once with each setting
#   prefill   Llama-3-8B shape, prompts alone (one output token): PREFILL_RUNS="LENxN ..." (default
#             "1024x64 128x256 1024x8": N prompts of LEN tokens) in steps of up to PREFILL_TOKENS
#             (default 8192) at TP=1 and TP=2; PREFILL_ENVS="NAME=VALUE ..." adds TP=2 with each
#   batch     Llama-3-8B shape, decode steps of BATCH_SEQS sequences (default "16 64 256"; 128-token
#             prompts, 256 output tokens) at TP=1 and TP=2; BATCH_ENVS="NAME=VALUE ..." adds TP=2
#             once with each setting
#   kv        quantized KV pools at TP=2 (each rank its heads' shard, kv8, kvfp8, kv4, k8v4): greedy
#             text of the tiny dummy shape at TP=1 and TP=2, and how much of it agrees
#   70b       Llama-2-70B shape at TP=2 in BF16 and W4A16 (one sequence, then 16)
#   mixtral   Mixtral-8x7B shape at TP=2 in BF16 (every expert split; one sequence, then 16)
# Parts for nibble's dense decode gemv (one GPU is enough; TP=2 runs when there are two):
#   gemv-tests   its GPU tests and the linear, graph and greedy tests (stage/gpu/gpu-tests)
#   gemv-bench   gpu-bench --dense-gemv: cuBLAS, dense_gemv and b16_gdec on the TP=1 and TP=2
#                layer shapes at 1, 2, 4 and 16 tokens
#   gemv-b1      decode steps of 1 and 4 sequences (GEMV_SEQS), Llama-3-8B shape, with cuBLAS
#                (NIBBLE_DENSE_GEMV=0) and with dense_gemv, at TP=1 (and TP=2)
# Results: OUTDIR/*.json and *.log, device.txt (GPUs and how they are linked).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-tp-run.sh OUTDIR [PART...]}
shift
parts=${*:-tests serve b1 offline 70b}
mkdir -p "$out"
bin=stage/gpu/nibble
ds=.gpu-data/sharegpt.json
tok=.gpu-data/tokenizer/tokenizer.json
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
# NVLink multicast stays off on shared machines (the device README says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NCCL from the nvidia-nccl-cu13 wheel PyTorch brought, if the loader's search misses it.
if [ -z "${NIBBLE_NCCL_LIB:-}" ]; then
  lib=$(python3 -c 'import nvidia.nccl, os; d = os.path.dirname(nvidia.nccl.__file__ or nvidia.nccl.__path__[0]); print(os.path.join(d, "lib", "libnccl.so.2"))' 2>/dev/null || true)
  [ -f "$lib" ] && export NIBBLE_NCCL_LIB=$lib
fi
status=0
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(cat stage/gpu/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null
  echo "NIBBLE_NCCL_LIB=${NIBBLE_NCCL_LIB:-}"
} | tee -a "$out/device.txt"

source scripts/gpu-lib.sh
seed_kernel_cache
STEP_SUMMARY="^throughput|^steps|seqs:|with prefill|^test |test result|FAILED|panicked|loaded its shard|NCCL|error"

# with_envs FN NAME TP "NAME=VALUE ...": FN NAME-<setting> TP once under each setting.
with_envs() {
  local fn=$1 name=$2 tp=$3 e
  for e in $4; do eval "$e $fn $name-$(echo "$e" | tr '=A-Z_' '-a-z-') $tp"; done
}

throughput() {  # throughput NAME MODEL TP ARGS...
  local name=$1 model=$2 tp=$3; shift 3
  step "$name" timeout "${TIMEOUT:-300}" "$bin" --device cuda --dummy-weights "$model" --tokenizer "$tok" \
    --tensor-parallel-size "$tp" bench throughput --json "$out/$name.json" "$@"
}

for part in $parts; do
  case $part in
    tests)
      step gpu-tp-tests timeout 400 stage/gpu/gpu-tp-tests --test-threads 1 --nocapture ;;
    peer)
      step gpu-tp-peer-tests timeout 300 stage/gpu/gpu-tp-tests peer_sum --test-threads 1 --nocapture ;;
    arlat)
      # NCCL's decode-sized all-reduce latency under its protocol choices (the test prints it).
      for env in "" NCCL_PROTO=LL; do
        echo "== all-reduce latency ${env:-default}"
        env $env timeout 60 stage/gpu/gpu-tp-tests nccl_all_reduce --nocapture 2>&1 | grep -E 'us each|symmetric window|test result'
      done ;;
    serve)
      step tp-serve timeout 300 scripts/gpu-tp-serve-check.sh "$bin"; tail -12 "$out/tp-serve.log" ;;
    b1)
      b1() { throughput "$1" llama-3-8b "$2" --input-len 128 --output-len 256 --num-prompts 2 \
        --max-num-seqs 1 --profile; }
      b1 b1-tp1 1
      # An A/B against another build (B1_BASE=its binary, e.g. stage/base/nibble), alternated.
      if [ -n "${B1_BASE:-}" ]; then
        bin=$B1_BASE b1 b1-tp1-base 1
        bin=$B1_BASE b1 b1-tp2-base 2
      fi
      # TP=2 by default: the output head split by vocabulary, one-token row-parallel outputs
      # summed peer to peer by the gemvs (the peer sum), the rest in NCCL symmetric memory. Then
      # without the peer sum, twice each alternated (run-to-run spread); with B1_ALL=1 also
      # without the window and the split head, and with NCCL's low-latency protocol.
      b1 b1-tp2 2
      if [ "${B1_QUICK:-0}" != 1 ]; then
        NIBBLE_TP_PEER_SUM=0 b1 b1-tp2-nopeer 2
        b1 b1-tp2-r2 2
        NIBBLE_TP_PEER_SUM=0 b1 b1-tp2-nopeer-r2 2
      fi
      # B1_ENVS="NAME=VALUE ...": TP=1 and TP=2 once with each setting.
      for tp in 1 2; do with_envs b1 "b1-tp$tp" "$tp" "${B1_ENVS:-}"; done
      if [ -n "${B1_BASE:-}" ]; then
        bin=$B1_BASE b1 b1-tp2-base-r2 2
        bin=$B1_BASE b1 b1-tp1-base-r2 1
        b1 b1-tp1-r2 1
      fi
      # Kernel variants (define sets staged with GPU_VARIANTS), TP=1 and TP=2 each.
      for v in ${B1_VARIANTS:-}; do
        NIBBLE_NVRTC_DEFINES=$v b1 "b1-tp1-$v" 1
        NIBBLE_NVRTC_DEFINES=$v b1 "b1-tp2-$v" 2
      done
      if [ "${B1_SWIGLU:-0}" = 1 ]; then
        NIBBLE_SWIGLU=0 b1 b1-tp1-noswiglu 1
        NIBBLE_SWIGLU=0 b1 b1-tp2-noswiglu 2
      fi
      if [ "${B1_ALL:-0}" = 1 ]; then
        NIBBLE_TP_WINDOW=0 b1 b1-tp2-nowindow 2
        NIBBLE_TP_WINDOW=0 NIBBLE_TP_SPLIT_HEAD=0 NIBBLE_TP_PEER_SUM=0 b1 b1-tp2-base 2
        NCCL_PROTO=LL b1 b1-tp2-ll 2
      fi ;;
    rank)
      b1() { throughput "$1" "$2" 1 --input-len 128 --output-len 256 --num-prompts 2 \
        --max-num-seqs 1 --profile; }
      b1 b1-rank bench/configs/llama-3-8b-tp2-rank.json
      if [ "${RANK_NCU:-1}" = 1 ]; then
        for m in llama-3-8b bench/configs/llama-3-8b-tp2-rank.json; do
          name=$(basename "$m" .json)
          CUDA_VISIBLE_DEVICES=0 MODEL=$m COUNT=${RANK_COUNT:-470} scripts/gpu-profile-step.sh "$out/ncu-$name" bf16
          tar czf "$out/ncu-$name.tgz" -C "$out" "ncu-$name" && rm -rf "$out/ncu-$name"
        done
      fi ;;
    offline)
      offline() { throughput "$1" llama-3-8b "$2" --dataset "$ds" \
        --num-prompts "${TP_PROMPTS:-500}" --max-num-seqs 256 --profile; }
      offline offline-tp1 1
      offline offline-tp2 2
      [ "${TP_NOPEER:-1}" = 0 ] || NIBBLE_TP_PEER_SUM=0 offline offline-tp2-nopeer 2
      [ "${TP_BASE:-1}" = 0 ] || NIBBLE_TP_WINDOW=0 NIBBLE_TP_SPLIT_HEAD=0 NIBBLE_TP_PEER_SUM=0 offline offline-tp2-base 2
      with_envs offline offline-tp2 2 "${OFFLINE_ENVS:-}" ;;
    prefill)
      for run in ${PREFILL_RUNS:-1024x64 128x256 1024x8}; do
        len=${run%x*} n=${run#*x}
        pf() { throughput "$1" llama-3-8b "$2" --input-len "$len" --output-len 1 --num-prompts "$n" \
          --max-num-seqs "$n" --max-batched-tokens "${PREFILL_TOKENS:-8192}" --profile; }
        pf "prefill$run-tp1" 1
        pf "prefill$run-tp2" 2
        with_envs pf "prefill$run-tp2" 2 "${PREFILL_ENVS:-}"
      done ;;
    batch)
      for n in ${BATCH_SEQS:-16 64 256}; do
        bn() { throughput "$1" llama-3-8b "$2" --input-len 128 --output-len 256 --num-prompts "$n" \
          --max-num-seqs "$n" --profile; }
        bn "batch$n-tp1" 1
        bn "batch$n-tp2" 2
        with_envs bn "batch$n-tp2" 2 "${BATCH_ENVS:-}"
      done ;;
    kv)
      # The tiny dummy shape (head_dim 64): quantized pools have kernels for head_dim 64 and 128
      # (the Llama 3 fixture's 16 is refused, on both ranks, with that reason).
      for kv in kv16 kv8 kvfp8 kv4 k8v4; do
        for tp in 1 2; do
          timeout 120 "$bin" --device cuda --dummy-weights tiny-dummy --kv "$kv" \
            --tensor-parallel-size "$tp" generate --prompt "The quick brown fox" --max-tokens 48 \
            > "$out/kv-$kv-tp$tp.txt" 2> "$out/kv-$kv-tp$tp.log" || { status=1; tail -5 "$out/kv-$kv-tp$tp.log"; }
        done
        python3 - "$out/kv-$kv-tp1.txt" "$out/kv-$kv-tp2.txt" "$kv" <<'PY'
import sys
a, b = (open(p, "rb").read() for p in sys.argv[1:3])
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f"{sys.argv[3]}: TP=2 writes {len(b)} bytes, the first {same} as TP=1's ({len(a)})")
PY
      done
      rm -f "$out"/kv-*.txt ;;
    70b)
      # Llama-2-70B's vocabulary (32,000) is below the SmolLM2 tokenizer's: byte-level tokens.
      for p in "" :w4a16-g128; do
        step "llama-2-70b${p#:}-tp2" timeout 240 "$bin" --device cuda \
          --dummy-weights "llama-2-70b$p" --tensor-parallel-size 2 bench throughput \
          --json "$out/llama-2-70b${p#:}-tp2.json" --input-len 128 --output-len 64 \
          --num-prompts 16 --sweep-seqs 1,16 --max-batched-tokens 4096 --profile
      done ;;
    mixtral)
      # Mixtral-8x7B in BF16 (93 GB) does not fit one H100: every expert split over two GPUs.
      # Its vocabulary (32,000) is below the SmolLM2 tokenizer's too: byte-level tokens.
      step mixtral-tp2 timeout 300 "$bin" --device cuda --dummy-weights mixtral-8x7b \
        --tensor-parallel-size 2 bench throughput --json "$out/mixtral-tp2.json" \
        --input-len 128 --output-len 64 --num-prompts 16 --sweep-seqs 1,16 --profile ;;
    gemv-tests)
      step gemv-tests timeout 400 stage/gpu/gpu-tests --test-threads 1 \
        ${GEMV_TESTS:-dense_decode_gemv linear_matches graph_replay greedy_generation} ;;
    gemv-bench)
      step gemv-bench timeout 300 stage/gpu/gpu-bench "$out/dense-gemv.json" --dense-gemv
      python3 - "$out/dense-gemv.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["dense_gemv"]
print(f"{'layer':10} {'M':>3} {'cuBLAS us':>10} {'dense us':>9} {'gdec us':>8} {'dense/HBM':>9} {'speedup':>8}")
for r in rows:
    d = r.get("dense_us")
    print(f"{r['layer']:10} {r['tokens']:>3} {r['cublas_us']:>10.1f} {d or 0:>9.1f} {r.get('gemv_us') or 0:>8.1f}"
          f" {r.get('dense_hbm_share') or 0:>9.2f} {(r['cublas_us'] / d) if d else 0:>8.2f}"
          f"  16k stages {r.get('dense_16k_us') or 0:.1f}")
PY
      ;;
    gemv-b1)
      gpus=$(nvidia-smi -L | wc -l)
      for tp in 1 2; do
        [ "$tp" -le "$gpus" ] || continue
        for seqs in ${GEMV_SEQS:-1 4}; do
          for on in 0 1; do
            NIBBLE_DENSE_GEMV=$on throughput "gemv-b$seqs-tp$tp-dense$on" llama-3-8b "$tp" \
              --input-len 128 --output-len 256 --num-prompts "$seqs" --max-num-seqs "$seqs" --profile
          done
        done
      done ;;
    *) echo "unknown part $part" >&2; status=1 ;;
  esac
done
# A device call brings back 8 files: the logs travel as one archive, and the JSON results too
# when there are more than five.
tar czf "$out/logs-$(echo $parts | tr ' ' '-').tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
if [ "$(ls "$out"/*.json 2>/dev/null | wc -l)" -gt 5 ]; then
  tar czf "$out/results-$(echo $parts | tr ' ' '-').tgz" -C "$out" $(cd "$out" && ls *.json) && rm -f "$out"/*.json
fi
save_kernel_cache
exit $status

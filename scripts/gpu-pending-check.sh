#!/usr/bin/env bash
# What was built on 2026-11-27 (thirteenth session) without a GPU run, checked and measured in one
# device call, from the repo root with stage/gpu staged (scripts/gpu-stage.sh, then
# scripts/gpu-pack.sh):
#   scripts/gpu-pending-check.sh OUTDIR
# NIBBLE_KVQ_BIAS_WITH_ZEROS (kernels/kv_quant.cu, a define: NIBBLE_NVRTC_DEFINES): the
# channel-wise keys' bias MMA (kv4c, kv2c) as -1024 / M in the zeros' accumulator instead of -1024
# in the codes' one, whose chain of two dependent MMAs a k-tile cost kv4c 3 to 9% on an H100 at
# 94180ad (BENCHMARKS.md, issue 19). The same arithmetic (-64 and -16 are exact in f16).
# 1. the channel-wise kv tests with the define (attention against the CPU, pages, greedy serving);
# 2. gpu-bench --kv-attention with and without it, two rounds alternated.
# If it passes and is faster on both GPUs, drop the #ifdef and keep its branch.
# Module compiles run side by side at a context's start now (compile::cubins): note the first
# bench's time against the 190 s a cold H100 took at 94180ad.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-pending-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
t0=$(date +%s)
NIBBLE_NVRTC_DEFINES=NIBBLE_KVQ_BIAS_WITH_ZEROS warm_kv stage/gpu  # the variant's modules
warm_kv stage/gpu  # the default's, for the A/B's base
NIBBLE_NVRTC_DEFINES=NIBBLE_KVQ_BIAS_WITH_ZEROS timeout 400 stage/gpu/gpu-tests kv::channel --test-threads 1 \
  >"$out/tests-kv-channel.log" 2>&1 || status=1
grep -E "^test |test result|panicked" "$out/tests-kv-channel.log"
echo "tests: $(( $(date +%s) - t0 ))s"
AB_BENCH=--kv-attention scripts/gpu-abn.sh "$out/ab" base=stage/gpu \
  zeros=stage/gpu@NIBBLE_NVRTC_DEFINES=NIBBLE_KVQ_BIAS_WITH_ZEROS || status=1
python3 - "$out/ab" <<'PY' || status=1
import glob, json, sys
rows = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/bench-*.json")):
    name = f.rsplit("/", 1)[1].split("-")[1]
    for r in json.load(open(f))["kv_attention"]:
        rows.setdefault((r["kv"], r["batch"], r["ctx"]), {}).setdefault(name, []).append(r["ms"])
print("| KV | batch x ctx | base us | zeros us | zeros speed |")
print("|---|---|---|---|---|")
for (kv, b, c), v in rows.items():
    base, cand = min(v["base"]), min(v["zeros"])
    print(f"| {kv} | {b} x {c} | {base * 1e3:.1f} | {cand * 1e3:.1f} | {base / cand:.3f}x |")
PY
save_kernel_cache
exit $status

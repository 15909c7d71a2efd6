#!/usr/bin/env bash
# What was built on 2026-11-27 (thirteenth session) without a GPU run, checked and measured in one
# device call, from the repo root with stage/gpu staged with the variants' kernels precompiled:
#   GPU_VARIANTS="NIBBLE_KVQ_BIAS_WITH_ZEROS NIBBLE_KVQ_OCCUPANCY NIBBLE_KVQ_BIAS_WITH_ZEROS+NIBBLE_KVQ_OCCUPANCY" \
#     scripts/gpu-stage.sh && scripts/gpu-pack.sh NAME
# (the seed then holds every module of the four stages: the first test and bench lines should
# show no compiling; `gpu-bench` prints how long its kernels took to get ready), then:
#   scripts/gpu-pending-check.sh OUTDIR
# Two defines of kernels/kv_quant.cu (NIBBLE_NVRTC_DEFINES), each the same arithmetic:
# - NIBBLE_KVQ_BIAS_WITH_ZEROS: the channel-wise keys' bias MMA (kv4c, kv2c) split between the
#   codes' accumulator (-1024) and the zeros' (-1024 / M), 12 MMAs in each chain instead of 16
#   and 8 (kv4c lost 3 to 9% on an H100 at 94180ad, BENCHMARKS.md, issue 19);
# - NIBBLE_KVQ_OCCUPANCY: the register-direct decode stages Q in 8 rows (in a stage slot where
#   they fit) and the per-token kernel is held to 80 registers: 12 CTAs an SM instead of 8 (kv4
#   is latency-bound at 25% occupancy now; ptxas spills 32 bytes for kv4 at 80 registers).
# 1. the kv tests with both defines (attention against the CPU in every format, pages, greedy
#    serving), after every module is compiled side by side (`nibble kernels`; with the seed, nothing to do);
# 2. gpu-bench --kv-attention for the default, each define and both, two rounds alternated.
# Keep (drop the #ifdef of) whatever passes and is faster on both GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-pending-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
both=NIBBLE_KVQ_BIAS_WITH_ZEROS+NIBBLE_KVQ_OCCUPANCY  # (+: gpu-abn.sh's knobs split at commas)
t0=$(date +%s)
NIBBLE_NVRTC_DEFINES=$both warm_kv stage/gpu
NIBBLE_NVRTC_DEFINES=$both timeout 420 stage/gpu/gpu-tests kv:: --test-threads 1 \
  >"$out/tests-kv.log" 2>&1 || status=1
grep -E "^test |test result|panicked" "$out/tests-kv.log"
echo "warm-up and tests: $(( $(date +%s) - t0 ))s"
AB_BENCH="--kv-attention --kv-formats=kv16,kv8,kv4,k8v4,kv4c,kv2c" scripts/gpu-abn.sh "$out/ab" \
  base=stage/gpu zeros=stage/gpu@NIBBLE_NVRTC_DEFINES=NIBBLE_KVQ_BIAS_WITH_ZEROS \
  occ=stage/gpu@NIBBLE_NVRTC_DEFINES=NIBBLE_KVQ_OCCUPANCY both=stage/gpu@NIBBLE_NVRTC_DEFINES=$both \
  || status=1
python3 - "$out/ab" <<'PY' || status=1
import glob, json, sys
rows, names = {}, ["base", "zeros", "occ", "both"]
for f in sorted(glob.glob(f"{sys.argv[1]}/bench-*.json")):
    name = f.rsplit("/", 1)[1].split("-")[1]
    try:
        report = json.load(open(f))
    except ValueError:
        print(f"{f}: not JSON (a run cut short?)")
        continue
    for r in report["kv_attention"]:
        rows.setdefault((r["kv"], r["batch"], r["ctx"]), {}).setdefault(name, []).append(r["ms"])
print("| KV | batch x ctx | " + " | ".join(f"{n} us" for n in names) + " | best vs base |")
print("|---|---|" + "---|" * (len(names) + 1))
for (kv, b, c), v in rows.items():
    t = {n: min(v[n]) * 1e3 for n in names if n in v}
    best = min(t, key=t.get)
    cells = " | ".join(f"{t[n]:.1f}" if n in t else "-" for n in names)
    print(f"| {kv} | {b} x {c} | {cells} | {best} {t.get('base', float('nan')) / t[best]:.3f}x |")
PY
save_kernel_cache
exit $status

#!/usr/bin/env bash
# What was built on 2026-11-27 (eleventh session) without a GPU run, checked and measured in one
# device call (give it the call's 600 s: a cold machine compiles every module twice, once with
# the define), from the repo root with stage/gpu staged
# (scripts/gpu-stage.sh, then scripts/gpu-pack.sh):
#   scripts/gpu-pending-check.sh OUTDIR
# 1. COMET's decode gemv (comet_gemv*, opt-in NIBBLE_COMET_GEMV=1): comet_is_bit_exact_with_the_reference
#    runs it and the tiled GEMM for every token count up to 32, and quantized_models decodes its
#    w4a4a8 model through it (NIBBLE_COMET_GEMV=1); then gpu-bench --qgemm
#    --kernels-only gives comet_gemv_with_quant_ms beside comet_with_quant_ms (the tiled GEMM) and
#    W4A8 (BENCHMARKS.md, issue 18: the tiled one took 163 us for 4096x14336 at one token).
# 2. FP8's consumers taking turns (NIBBLE_NVRTC_DEFINES=FP8_PING_PONG): the fp8 tests and the
#    quantized models (FP8 with its SwiGLU epilogue) with the define, then gpu-bench's FP8 column with and without
#    it in the same call (issue 18's goal: >= 1.0x torch._scaled_mm at M >= 1024; 0.85x at
#    d22f72f).
# If the gemv passes and is faster, make it COMET's default (comet::gemv_by_default); if the
# ping-pong passes and pays, make PING_PONG unconditional in WgqFp8 and rerun the FP8 end to end
# (scripts/gpu-engine-run.sh OUT fp8, or gpu-swiglu-check.sh's perf8).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-pending-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
NIBBLE_COMET_GEMV=1 timeout 200 stage/gpu/gpu-tests comet quantized_models --test-threads 1 \
  >"$out/tests-comet.log" 2>&1 || status=1
NIBBLE_NVRTC_DEFINES=FP8_PING_PONG timeout 240 stage/gpu/gpu-tests fp8 quantized_models \
  --test-threads 1 >"$out/tests-pingpong.log" 2>&1 || status=1
grep -E "^test |test result" "$out"/tests-*.log
for v in default FP8_PING_PONG; do
  defines=$([ $v = default ] || echo $v)
  NIBBLE_NVRTC_DEFINES=$defines timeout 60 stage/gpu/gpu-bench "$out/bench-$v.json" --qgemm \
    --kernels-only >"$out/bench-$v.log" 2>&1 || status=1
done
python3 - "$out" <<'PY' || status=1
import json, sys
out = sys.argv[1]
def rows(v):
    d = json.load(open(f"{out}/bench-{v}.json"))
    return {(r["n"], r["k"], r["m"]): r for r in (d["qgemm"] if isinstance(d, dict) else d)}
base, pp = rows("default"), rows("FP8_PING_PONG")
print("| N x K | M | FP8 us | FP8 ping-pong us | gain | COMET tiled us | COMET gemv us | W4A8 + quant us |")
print("|---|---|---|---|---|---|---|---|")
for key in sorted(base):
    b, p = base[key], pp.get(key, {})
    f8, f8p = b["nibble_fp8_ms"] * 1e3, p.get("nibble_fp8_ms", float("nan")) * 1e3
    gv = b.get("comet_gemv_with_quant_ms")
    print(f"| {key[0]} x {key[1]} | {key[2]} | {f8:.1f} | {f8p:.1f} | {f8 / f8p:.3f}x | "
          f"{b['comet_with_quant_ms'] * 1e3:.1f} | {'-' if gv is None else f'{gv * 1e3:.1f}'} | "
          f"{b['w4a8_with_quant_ms'] * 1e3:.1f} |")
PY
save_kernel_cache  # (SAVE_KERNELS=1: seeds .gpu-cache for the next calls)
exit $status

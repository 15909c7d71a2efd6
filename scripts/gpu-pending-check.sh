#!/usr/bin/env bash
# What was built on 2026-11-27 (twelfth session) without a GPU run, checked and measured in one
# device call, from the repo root with stage/gpu staged (scripts/gpu-stage.sh, then
# scripts/gpu-pack.sh):
#   scripts/gpu-pending-check.sh OUTDIR
# COMET W4A4A8 past its decode gemv on the wgmma tier (comet_wgmma{64,128}_*, groups of 128,
# opt-in NIBBLE_COMET_WGMMA=1):
# 1. comet_wgmma_is_bit_exact_with_the_reference (64- and 128-token tiles against the reference,
#    bit for bit) and comet_is_bit_exact_with_the_reference (the gemv and tiled GEMM, whose
#    quantizer now takes the scales' strides); the model test's w4a4a8 fixture is g64, which the
#    wgmma tier does not take;
# 2. gpu-bench --qgemm --kernels-only: COMET's time with its quantizer on the wgmma tier
#    (comet_wgmma_with_quant_ms, every token count, the gemv off) against its tiled GEMM and decode
#    gemv, W4A8 and cuBLAS BF16 in the same run (BENCHMARKS.md, issue 18: the tiled GEMM was 2.4x
#    to 11x slower than W4A8).
# If it passes and is faster, make it the default (comet::wgmma_by_default) and rerun COMET end
# to end: PART=comet SEQS=256 scripts/gpu-e2e-ab.sh OUT wgmma=stage/gpu@NIBBLE_COMET_WGMMA=1
# tiled=stage/gpu dequant=stage/gpu@NIBBLE_COMET=0 (0.35x BF16 at 256 sequences on the tiled GEMM,
# which every batch past 32 sequences takes without the knob).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-pending-check.sh OUTDIR}
mkdir -p "$out"
export NIBBLE_KERNEL_CACHE=${NIBBLE_KERNEL_CACHE:-/tmp/nibble-kernels}
source scripts/gpu-lib.sh
seed_kernel_cache
status=0
timeout 400 stage/gpu/gpu-tests comet --test-threads 1 >"$out/tests-comet.log" 2>&1 || status=1
grep -E "^test |test result|panicked" "$out"/tests-*.log
timeout 90 stage/gpu/gpu-bench "$out/bench.json" --qgemm --kernels-only >"$out/bench.log" 2>&1 || status=1
python3 - "$out" <<'PY' || status=1
import json, sys
d = json.load(open(f"{sys.argv[1]}/bench.json"))
rows = {(r["n"], r["k"], r["m"]): r for r in (d["qgemm"] if isinstance(d, dict) else d)}
print("| N x K | M | COMET tiled us | gemv us | wgmma us | wgmma vs tiled | W4A8 + quant us | wgmma vs W4A8 | cuBLAS BF16 us | wgmma vs BF16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows):
    r = rows[key]
    wg = r.get("comet_wgmma_with_quant_ms")
    if wg is None:
        continue
    ct, wg, gv = r["comet_with_quant_ms"] * 1e3, wg * 1e3, r.get("comet_gemv_with_quant_ms")
    w48, bf = r["w4a8_with_quant_ms"] * 1e3, r["cublas_bf16_ms"] * 1e3
    gv = "-" if gv is None else f"{gv * 1e3:.1f}"
    print(f"| {key[0]} x {key[1]} | {key[2]} | {ct:.1f} | {gv} | {wg:.1f} | {ct / wg:.2f}x | {w48:.1f} | "
          f"{w48 / wg:.2f}x | {bf:.1f} | {bf / wg:.2f}x |")
PY
save_kernel_cache
exit $status

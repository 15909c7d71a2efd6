#!/usr/bin/env python3
"""Turns one quantized-GEMM run (scripts/gpu-run.sh OUTDIR --qgemm, or a full run) into the
BENCHMARKS.md tables, the goal lines of the quantized-GEMM issue, and a roofline plot per shape
class (decode, M <= 16; prefill, M >= 1024).

    python3 bench/qgemm_report.py OUTDIR     # writes OUTDIR/report-qgemm.md and OUTDIR/qgemm.png

Every ratio compares numbers from the same run on the same GPU: nibble's gpu-bench.json
(`qgemm`, `engine_precisions`) and PyTorch's gpu-peer.json (`qgemm`), with the ceilings (HBM
bandwidth, cuBLAS BF16 rate) measured at the start of the run. "cuBLAS BF16" is PyTorch's
`x @ w.t()` (bf16 output, as the quantized kernels' outputs here).
"""
import json
import math
import sys
from pathlib import Path


def geomean(v):
    v = [x for x in v if x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def main():
    out = Path(sys.argv[1])
    ours = json.loads((out / "gpu-bench.json").read_text())
    peer = json.loads((out / "gpu-peer.json").read_text())
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else ""
    bw, peak = ours["hbm_bytes_per_s"], ours["cublas_bf16_flops"]
    pk = {(r["n"], r["k"], r["m"]): r for r in peer["qgemm"]}
    us = lambda ms: f"{ms * 1e3:.1f}" if ms == ms else "-"  # noqa: E731
    ratio = lambda x: f"{x:.2f}x" if x == x else "-"  # noqa: E731 (no peer time: NaN)
    lines = ["```", device, "```", "",
             f"HBM {bw / 1e12:.2f} TB/s (device copy), cuBLAS BF16 {peak / 1e12:.0f} TFLOP/s (8192³).",
             "", "Times in µs; ratios are cuBLAS BF16 time over the kernel's time (higher is faster).",
             "", "| N x K | M | cuBLAS BF16 | nibble W4A16 | torch int4 | nibble W8A8 | W8A8 + act. quant | torch int8 | torch fp8 | W4A16 ratio | W8A8 ratio | W4A16 % HBM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    small4, small8, big4, big8, hbm_large = [], [], [], [], []
    for r in ours["qgemm"]:
        key = (r["n"], r["k"], r["m"])
        p = pk.get(key, {})
        bf = p.get("bf16_ms", float("nan"))
        r4, r8 = bf / r["w4a16_ms"], bf / r["w8a8_ms"]
        if r["m"] <= 16:
            small4.append(r4)
            small8.append(r8)
            if (r["n"], r["k"]) in [(28672, 4096), (4096, 14336)]:
                hbm_large.append((key, r["w4a16_hbm_fraction"]))
        if r["m"] >= 1024:
            big4.append(r4)
            big8.append(r8)
        lines.append(
            f"| {r['n']} x {r['k']} | {r['m']} | {us(bf)} | {us(r['w4a16_ms'])} | {us(p.get('int4_ms', float('nan')))} "
            f"| {us(r['w8a8_ms'])} | {us(r['w8a8_with_quant_ms'])} | {us(p.get('int8_ms', float('nan')))} "
            f"| {us(p.get('fp8_ms', float('nan')))} | {ratio(r4)} | {ratio(r8)} | {100 * r['w4a16_hbm_fraction']:.0f}% |")
    w48 = [r for r in ours["qgemm"] if "w4a8_ms" in r]
    w48_big_w8, w48_big_fp8, w48_small = [], [], []
    if w48:
        lines += ["", "W4A8 (QoQ g128: 4-bit codes widened to INT8 in registers, INT8 tensor cores; the same kernel "
                  "serves LiquidQuant and INT4 per channel) against nibble's W8A8 and W4A16 and PyTorch's FP8 "
                  "(`torch._scaled_mm`, row-wise scales). Times in µs; ratios are the other kernel's time over W4A8's "
                  "(higher: W4A8 faster); % HBM counts W4A8's weight and activation bytes.", "",
                  "| N x K | M | nibble W4A8 | W4A8 + act. quant | nibble W8A8 | nibble W4A16 | torch fp8 | vs W8A8 | vs W4A16 | vs fp8 | W4A8 % HBM |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in w48:
            p = pk.get((r["n"], r["k"], r["m"]), {})
            fp8 = p.get("fp8_ms", float("nan"))
            v8, v4, vf = r["w8a8_ms"] / r["w4a8_ms"], r["w4a16_ms"] / r["w4a8_ms"], fp8 / r["w4a8_ms"]
            if r["m"] >= 256:
                w48_big_w8.append(v8)
                if vf == vf:
                    w48_big_fp8.append(vf)
            if r["m"] <= 16:
                w48_small.append(v4)
            lines.append(f"| {r['n']} x {r['k']} | {r['m']} | {us(r['w4a8_ms'])} | {us(r['w4a8_with_quant_ms'])} | {us(r['w8a8_ms'])} "
                         f"| {us(r['w4a16_ms'])} | {us(fp8)} | {ratio(v8)} | {ratio(v4)} | {ratio(vf)} | {100 * r['w4a8_hbm_fraction']:.0f}% |")
    f8 = [r for r in ours["qgemm"] if "nibble_fp8_ms" in r]
    f8_big = []
    if f8:
        lines += ["", "FP8 W8A8 (e4m3 weights per channel, e4m3 activations per token; kernels/qgemm_fp8.cu: the W8A8 "
                  "packing and pipeline on e4m3 tensor cores, 128-product partial sums promoted to f32) against "
                  "PyTorch's `torch._scaled_mm` (cuBLASLt, row-wise scales, no fast accumulation) and nibble's INT8 "
                  "W8A8. Times in µs; ratios are the other kernel's time over nibble FP8's (higher: nibble FP8 faster).", "",
                  "| N x K | M | nibble FP8 | FP8 + act. quant | torch fp8 | nibble W8A8 | vs torch fp8 | vs W8A8 | of floor |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in f8:
            p = pk.get((r["n"], r["k"], r["m"]), {})
            tf = p.get("fp8_ms", float("nan"))
            vt, v8 = tf / r["nibble_fp8_ms"], r["w8a8_ms"] / r["nibble_fp8_ms"]
            if r["m"] >= 1024 and vt == vt:
                f8_big.append(vt)
            lines.append(f"| {r['n']} x {r['k']} | {r['m']} | {us(r['nibble_fp8_ms'])} | {us(r['nibble_fp8_with_quant_ms'])} "
                         f"| {us(tf)} | {us(r['w8a8_ms'])} | {ratio(vt)} | {ratio(v8)} | {100 * r['nibble_fp8_floor_ms'] / r['nibble_fp8_ms']:.0f}% |")
    w816 = [r for r in ours["qgemm"] if "w8a16_ms" in r]
    if w816:
        lines += ["", "W8A16 (INT8 weights per channel made exact 16-bit values in registers, bf16 activations: the "
                  "W4A16 machinery with 8-bit codes; the decode gemv up to 16 tokens, wgmma tiles beyond) against "
                  "cuBLAS BF16 and nibble's W4A16. Times in µs; ratios are the other kernel's time over W8A16's "
                  "(higher: W8A16 faster); % HBM counts its weight and activation bytes.", "",
                  "| N x K | M | nibble W8A16 | cuBLAS BF16 | nibble W4A16 | vs BF16 | vs W4A16 | W8A16 % HBM | of floor |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in w816:
            p = pk.get((r["n"], r["k"], r["m"]), {})
            bf = p.get("bf16_ms", float("nan"))
            lines.append(f"| {r['n']} x {r['k']} | {r['m']} | {us(r['w8a16_ms'])} | {us(bf)} | {us(r['w4a16_ms'])} "
                         f"| {ratio(bf / r['w8a16_ms'])} | {ratio(r['w4a16_ms'] / r['w8a16_ms'])} "
                         f"| {100 * r['w8a16_hbm_fraction']:.0f}% | {100 * r['w8a16_floor_ms'] / r['w8a16_ms']:.0f}% |")
    tiers = [r for r in ours["qgemm"] if r.get("w4a16_mma_sync_ms")]
    if tiers:
        lines += ["", "Up to 64 tokens on both tiers: the Hopper tier (up to 16 tokens the persistent decode gemv: "
                  "stream-K over every SM, activations staged in shared memory, scales after the MMA, kernels/qgemv.cu; "
                  "17 to 64 tokens the wgmma kernel in 64-token tiles, kernels/qgemm_wgmma.cu) and the mma.sync tier "
                  "(split-K gemv, or 128-token tiles past 32 tokens on large layers; sm_80 and later). Times in µs; the "
                  "main table's nibble columns are the default choice.", "",
                  "| N x K | M | W4A16 mma.sync | W4A16 Hopper | Hopper speedup | W8A8 mma.sync | W8A8 Hopper | Hopper speedup | Hopper W4A16 % HBM |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tiers:
            lines.append(
                f"| {r['n']} x {r['k']} | {r['m']} | {us(r['w4a16_mma_sync_ms'])} | {us(r['w4a16_hopper_ms'])} "
                f"| {r['w4a16_mma_sync_ms'] / r['w4a16_hopper_ms']:.2f}x | {us(r['w8a8_mma_sync_ms'])} | {us(r['w8a8_hopper_ms'])} "
                f"| {r['w8a8_mma_sync_ms'] / r['w8a8_hopper_ms']:.2f}x | {100 * r['w4a16_hbm_fraction'] * r['w4a16_ms'] / r['w4a16_hopper_ms']:.0f}% |")
    g_small4 = geomean(small4)
    lines += ["", "| goal | measured | met |", "|---|---|---|",
              f"| W4A16, M <= 16: >= 3.3x cuBLAS BF16 (geomean over the 4 layer shapes) | {g_small4:.2f}x | {'yes' if g_small4 >= 3.3 else 'no'} |"]
    for key, f in hbm_large:
        lines.append(f"| W4A16 {key[0]}x{key[1]} M={key[2]}: >= 85% of HBM bandwidth in weight bytes | {100 * f:.0f}% | {'yes' if f >= 0.85 else 'no'} |")
    lines.append(f"| W4A16, M >= 1024: >= 0.95x cuBLAS BF16 | {min(big4):.2f}x to {max(big4):.2f}x | {'yes' if min(big4) >= 0.95 else 'no'} |")
    lines.append(f"| W8A8, M >= 1024: >= 1.6x cuBLAS BF16 | {min(big8):.2f}x to {max(big8):.2f}x | {'yes' if min(big8) >= 1.6 else 'no'} |")
    for name, vals, goal in [("W4A8, M >= 256: >= 1.1x nibble W8A8", w48_big_w8, 1.1),
                             ("W4A8, M >= 256: >= 1.0x torch fp8", w48_big_fp8, 1.0),
                             ("W4A8, M <= 16: >= 0.9x nibble W4A16", w48_small, 0.9),
                             ("FP8 W8A8, M >= 1024: >= 1.0x torch fp8", f8_big, 1.0)]:
        if vals:
            lines.append(f"| {name} | {min(vals):.2f}x to {max(vals):.2f}x (geomean {geomean(vals):.2f}x) | {'yes' if min(vals) >= goal else 'no'} |")
    eng = ours.get("engine_precisions", [])
    if eng:
        base = {r["batch"]: r["tokens_per_s"] for r in eng if r["precision"] == "bf16"}
        lines += ["", "Decode steps of Llama-3-8B-shaped models with random weights (ctx 1024, CUDA graphs, host sampling excluded):", "",
                  "| precision | weights GB | batch | step ms | tokens/s | vs BF16 | of floor |", "|---|---|---|---|---|---|---|"]
        for r in eng:
            lines.append(f"| {r['precision']} | {r['weight_bytes'] / 1e9:.2f} | {r['batch']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} "
                         f"| {r['tokens_per_s'] / base.get(r['batch'], float('nan')):.2f}x | {100 * r['of_floor']:.0f}% |")
    (out / "report-qgemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (title, sel) in zip(axes, [("decode, M <= 16", lambda m: m <= 16), ("prefill, M >= 1024", lambda m: m >= 1024)]):
        xs = [10 ** (i / 20) for i in range(-20, 100)]
        ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", lw=1, label="roofline (BF16 peak, HBM)")
        series = {"cuBLAS BF16": ("bf16_ms", "o", 2.0), "nibble W4A16": ("w4a16_ms", "s", None),
                  "nibble W8A8": ("w8a8_ms", "^", 1.0), "nibble W4A8": ("w4a8_ms", "v", 0.5 + 4 / 128),
                  "nibble FP8": ("nibble_fp8_ms", "P", 1.0), "nibble W8A16": ("w8a16_ms", "*", 1.0),
                  "torch int4": ("int4_ms", "x", 0.5 + 3 / 128),
                  "torch fp8": ("fp8_ms", "d", 1.0)}
        for name, (field, marker, bpe) in series.items():
            pts = []
            for r in ours["qgemm"]:
                if not sel(r["m"]):
                    continue
                src = r if field in r else pk.get((r["n"], r["k"], r["m"]), {})
                t = src.get(field)
                if not t:
                    continue
                flops = 2 * r["m"] * r["n"] * r["k"]
                wbytes = r["w4a16_weight_bytes"] if bpe is None else r["n"] * r["k"] * bpe
                byts = wbytes + 2 * r["m"] * (r["n"] + r["k"])
                pts.append((flops / byts, flops / (t / 1e3) / 1e12))
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"Llama-3-8B layers, {title}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "qgemm.png", dpi=110)


if __name__ == "__main__":
    main()

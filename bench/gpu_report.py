#!/usr/bin/env python3
"""Turns one GPU run (scripts/gpu-run.sh OUTDIR) into the BENCHMARKS.md tables and a plot.

    python3 bench/gpu_report.py OUTDIR      # writes OUTDIR/report.md and OUTDIR/gpu.png

Every ratio compares numbers from the same run on the same GPU: nibble's gpu-bench.json and
PyTorch's gpu-peer.json, and the ceilings (HBM bandwidth, cuBLAS BF16 rate) measured at its start.
"""
import json
import sys
from pathlib import Path


def load(p):
    return json.loads(Path(p).read_text()) if Path(p).exists() else None


def main():
    out = Path(sys.argv[1])
    ours = load(out / "gpu-bench.json")
    peer = load(out / "gpu-peer.json")
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").exists() else ""
    if ours is None:
        sys.exit("no gpu-bench.json in " + str(out))
    lines = ["```", device, "```", ""]
    bw, peak = ours["hbm_bytes_per_s"], ours["cublas_bf16_flops"]
    lines += ["| ceiling | nibble's measurement | PyTorch's |", "|---|---|---|"]
    lines.append(f"| HBM bandwidth (device copy, read + write) | {bw / 1e12:.2f} TB/s | "
                 + (f"{peer['hbm_bytes_per_s'] / 1e12:.2f} TB/s |" if peer else "- |"))
    lines.append(f"| BF16 GEMM 8192³ (cuBLAS) | {peak / 1e12:.0f} TFLOP/s | "
                 + (f"{peer['cublas_bf16_flops'] / 1e12:.0f} TFLOP/s |" if peer else "- |"))
    lines.append("")

    def peer_row(kind, batch, ctx):
        if not peer:
            return None
        for r in peer["attention"]:
            if r["kind"] == kind and r["batch"] == batch and r["ctx"] == ctx:
                return r
        return None

    lines += ["Decode attention, one layer of Llama-3-8B (32 query heads, 8 KV heads, head_dim 128), "
              "bf16 KV; nibble reads a paged cache (16-token blocks), PyTorch SDPA (flash) a "
              "contiguous one:", "",
              "| batch | context | nibble µs | of HBM bw | PyTorch µs | of HBM bw | nibble speedup |",
              "|---|---|---|---|---|---|---|"]
    dec = [r for r in ours["attention"] if r["kind"] == "decode"]
    for r in dec:
        p = peer_row("decode", r["batch"], r["ctx"])
        pf = p["bandwidth_fraction"] if p else float("nan")
        pm = p["ms"] if p else float("nan")
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['ms'] * 1e3:.1f} | {r['bandwidth_fraction']:.0%} | "
                     f"{pm * 1e3:.1f} | {pf:.0%} | {pm / r['ms']:.2f}x |")
    lines += ["", "Prefill attention (causal, batch 1):", "",
              "| context | nibble ms | TFLOP/s | PyTorch ms | TFLOP/s | nibble / PyTorch time |",
              "|---|---|---|---|---|---|"]
    for r in [r for r in ours["attention"] if r["kind"] == "prefill"]:
        p = peer_row("prefill", r["batch"], r["ctx"])
        pm = p["ms"] if p else float("nan")
        pt = p["tflops"] if p else float("nan")
        lines.append(f"| {r['ctx']} | {r['ms']:.3f} | {r['tflops']:.1f} | {pm:.3f} | {pt:.1f} | {r['ms'] / pm:.1f}x |")
    steps = [s for s in ours.get("decode_steps", []) if "ms" in s]
    if steps:
        lines += ["", "Decode step of a Llama-3-8B-shaped model (random bf16 weights, CUDA graph), "
                  "against its floor (weight bytes + KV bytes read) / measured HBM bandwidth:", "",
                  "| batch | context | step ms | floor ms | of floor | tokens/s |", "|---|---|---|---|---|---|"]
        for s in steps:
            lines.append(f"| {s['batch']} | {s['ctx']} | {s['ms']:.2f} | {s['floor_ms']:.2f} | {s['of_floor']:.0%} | {s['tokens_per_s']:.0f} |")
    for s in ours.get("decode_steps", []):
        if "skipped" in s:
            lines.append(f"\nbatch {s['batch']}, context {s['ctx']}: {s['skipped']}.")
    # Goals of the CUDA issue.
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    b64 = next((r for r in dec if r["batch"] == 64 and r["ctx"] == 4096), None)
    if b64:
        lines.append(f"| paged decode attention b64 ctx4096 >= 85% of HBM bandwidth | {b64['bandwidth_fraction']:.0%} | "
                     f"{'yes' if b64['bandwidth_fraction'] >= 0.85 else 'no'} |")
    b1 = next((r for r in dec if r["batch"] == 1 and r["ctx"] == 4096), None)
    p1 = peer_row("decode", 1, 4096)
    if b1 and p1:
        sp = p1["ms"] / b1["ms"]
        lines.append(f"| decode attention b1 ctx4096 >= 2x faster than PyTorch | {sp:.2f}x | {'yes' if sp >= 2 else 'no'} |")
    s1 = [s for s in steps if s["batch"] == 1]
    for s in s1:
        lines.append(f"| decode step b1 ctx{s['ctx']} >= 80% of floor | {s['of_floor']:.0%} | {'yes' if s['of_floor'] >= 0.8 else 'no'} |")
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    print(report)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    labels = [f"b{r['batch']}\nctx{r['ctx']}" for r in dec]
    x = range(len(dec))
    ax.bar([i - 0.2 for i in x], [r["bandwidth_fraction"] * 100 for r in dec], 0.4, label="nibble (paged)")
    pf = [(peer_row("decode", r["batch"], r["ctx"]) or {}).get("bandwidth_fraction", 0) * 100 for r in dec]
    ax.bar([i + 0.2 for i in x], pf, 0.4, label="PyTorch SDPA flash (contiguous)")
    ax.axhline(85, color="gray", ls="--", lw=1, label="goal at b64 ctx4096: 85%")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("% of measured HBM bandwidth")
    ax.set_title("Decode attention, Llama-3-8B layer")
    ax.legend(fontsize=8)
    ax = axes[1]
    for ctx, mark in [(1024, "o"), (4096, "s")]:
        ss = [s for s in steps if s["ctx"] == ctx]
        if ss:
            ax.plot([s["batch"] for s in ss], [s["ms"] for s in ss], marker=mark, label=f"step, ctx {ctx}")
            ax.plot([s["batch"] for s in ss], [s["floor_ms"] for s in ss], marker=mark, ls=":", color="gray",
                    label=f"floor, ctx {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Llama-3-8B decode step vs. bandwidth floor")
    ax.legend(fontsize=8)
    fig.suptitle(device.splitlines()[-1] if device else "")
    fig.tight_layout()
    fig.savefig(out / "gpu.png", dpi=110)


if __name__ == "__main__":
    main()

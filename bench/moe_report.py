#!/usr/bin/env python3
"""Report of the mixture-of-experts expert benchmark (scripts/gpu-engine-run.sh OUT moe-experts,
`gpu-bench --moe-experts`): a markdown table of one Mixtral-8x7B expert layer in W4A16 at decode
sizes, grouped launches against the experts one by one and a cuBLAS BF16 GEMM over the same
bytes, and a chart of the share of HBM bandwidth each reaches (moe-experts.png).

    python3 bench/moe_report.py FILE.json [OUT.png]
"""
import json
import sys
from pathlib import Path

GOAL = 0.70  # the issue's share of HBM bandwidth over the routed experts' weights


def main():
    path = Path(sys.argv[1])
    d = json.loads(path.read_text())
    bw = d["hbm_bytes_per_s"]
    rows = d["moe_experts"]
    print(f"{d['device']}, HBM {bw / 1e9:.0f} GB/s (copy)\n")
    print("| tokens | experts routed | weight MB | grouped µs | one by one µs | BF16 same bytes µs "
          "| grouped of HBM | BF16 of HBM | grouped vs one by one | goal 70% |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = r["grouped_hbm_share"]
        print(f"| {r['tokens']} | {r['experts_routed']} | {r['weight_bytes'] / 1e6:.0f} | "
              f"{r['grouped_us']:.1f} | {r['one_by_one_us']:.1f} | {r['bf16_same_bytes_us']:.1f} | "
              f"{share:.0%} | {r['bf16_hbm_share']:.0%} | "
              f"{r['one_by_one_us'] / r['grouped_us']:.2f}x | {'yes' if share >= GOAL else 'no'} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    tokens = [str(r["tokens"]) for r in rows]
    x = range(len(rows))
    one = [r["weight_bytes"] / (r["one_by_one_us"] * 1e-6) / bw for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w = 0.27
    ax.bar([i - w for i in x], [r["grouped_hbm_share"] for r in rows], w, label="grouped W4A16")
    ax.bar(list(x), one, w, label="W4A16 expert by expert")
    ax.bar([i + w for i in x], [r["bf16_hbm_share"] for r in rows], w, label="cuBLAS BF16, same bytes")
    ax.axhline(GOAL, color="k", ls="--", lw=0.8, label="goal 70%")
    ax.set_xticks(list(x), tokens)
    ax.set_xlabel("tokens (top 2 of 8 experts)")
    ax.set_ylabel("share of HBM bandwidth")
    ax.set_ylim(0, 1)
    gpu = d["device"].split("(")[-1].split(",")[0]
    ax.set_title(f"Mixtral-8x7B expert layer in W4A16-g128, {gpu}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else path.with_suffix(".png")
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()

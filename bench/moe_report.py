#!/usr/bin/env python3
"""Report of the mixture-of-experts expert benchmark (scripts/gpu-engine-run.sh OUT moe-experts,
`gpu-bench --moe-experts`): markdown tables of one Mixtral-8x7B expert layer (W4A16-g128, W8A8,
BF16) at decode sizes. Per format and size: the two grouped GEMMs (graph-replayed) and their share
of HBM bandwidth over the routed experts' weights against a cuBLAS BF16 GEMM of the same bytes,
and the whole grouped layer against the experts one by one (host-timed, as the eager MoE steps
run); and a chart of the shares (moe-experts.png).

    python3 bench/moe_report.py FILE.json [OUT.png]
"""
import json
import sys
from pathlib import Path

GOAL = 0.70  # the issue's share of HBM bandwidth over the routed experts' weights


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    path = Path(sys.argv[1])
    d = json.loads(path.read_text())
    bw = d["hbm_bytes_per_s"]
    rows = d["moe_experts"]
    formats = list(dict.fromkeys(r["format"] for r in rows))
    print(f"{d['device']}, HBM {bw / 1e9:.0f} GB/s (copy)\n")
    for f in formats:
        print(f"\n**{f}**\n")
        print("| tokens | experts | most rows | kernel | weight MB | grouped GEMMs µs | of HBM "
              "| BF16 same bytes µs | of HBM | grouped layer µs | one by one µs | layer gain "
              "| goal 70% |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["format"] == f):
            share = r["grouped_hbm_share"]
            gain = (None if r["grouped_layer_us"] is None
                    else r["one_by_one_layer_us"] / r["grouped_layer_us"])
            goal = "-" if share is None else ("yes" if share >= GOAL else "no")
            print(f"| {r['tokens']} | {r['experts_routed']} | {r['max_rows']} | "
                  f"{(r['kernel'] or 'none').split(' {')[0]} | {r['weight_bytes'] / 1e6:.0f} | "
                  f"{fmt(r['grouped_gemms_us'], '.1f')} | {fmt(share, '.0%')} | "
                  f"{r['bf16_same_bytes_us']:.1f} | {r['bf16_hbm_share']:.0%} | "
                  f"{fmt(r['grouped_layer_us'], '.1f')} | {r['one_by_one_layer_us']:.1f} | "
                  f"{fmt(gain, '.2f')}x | {goal} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for f in formats:
        rs = [r for r in rows if r["format"] == f and r["grouped_hbm_share"] is not None]
        ax.plot([r["tokens"] for r in rs], [r["grouped_hbm_share"] for r in rs], "o-",
                label=f"grouped {f}")
    rs = [r for r in rows if r["format"] == formats[0]]
    ax.plot([r["tokens"] for r in rs], [r["bf16_hbm_share"] for r in rs], "k:",
            label="cuBLAS BF16, same bytes")
    ax.axhline(GOAL, color="k", ls="--", lw=0.8, label="goal 70%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (top 2 of 8 experts)")
    ax.set_ylabel("share of HBM bandwidth")
    ax.set_ylim(0, 1)
    gpu = d["device"].split("(")[-1].split(",")[0]
    ax.set_title(f"Mixtral-8x7B expert layer, grouped GEMMs, {gpu}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else path.with_suffix(".png")
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()

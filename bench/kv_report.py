#!/usr/bin/env python3
"""Report of the low-bit KV attention benchmark (scripts/gpu-engine-run.sh OUT kv-attention):
a markdown table of decode attention per GPU KV format against nibble's kv16 and PyTorch's
flash SDPA from the same run, and a bar chart of the speedups (kv-attention.png).

    python3 bench/kv_report.py DIR     (DIR holds kv-attention.json and, when the peer ran,
                                        kv-attention-peer.json; without it the SDPA columns go)
"""
import json
import sys
from pathlib import Path

# The goals: speedup over kv16 per format.
GOALS = {"kv8": 1.8, "kvfp8": 1.8, "kv4": 3.4, "kv4c": 3.4, "kv2c": 6.0}


def main():
    d = Path(sys.argv[1])
    ours = json.loads((d / "kv-attention.json").read_text())
    peer_file = d / "kv-attention-peer.json"
    peer = json.loads(peer_file.read_text()) if peer_file.exists() else None
    sdpa = {(r["batch"], r["ctx"], r["kv"]): r["ms"] for r in peer["kv_attention"]} if peer else {}
    rows = ours["kv_attention"]
    print(f"{ours['device']}, HBM {ours['hbm_bytes_per_s'] / 1e9:.0f} GB/s (copy)\n")
    head = "| batch x ctx | KV | ms | KV bytes (MB) | of HBM | vs kv16 | goal |"
    print(head + (" vs SDPA bf16 | vs SDPA fp8 |" if peer else ""))
    print("|---" * (9 if peer else 7) + "|")
    for r in rows:
        b, c = r["batch"], r["ctx"]
        goal = GOALS.get(r["kv"])
        line = (f"| {b} x {c} | {r['kv']} | {r['ms']:.3f} | {r['kv_bytes'] / 1e6:.0f} | "
                f"{r['bandwidth_fraction']:.0%} | {r['speedup_vs_kv16']:.2f}x | "
                f"{f'{goal}x' if goal else '-'} |")
        if peer:
            line += (f" {sdpa[(b, c, 'bf16')] / r['ms']:.2f}x | "
                     f"{sdpa[(b, c, 'fp8-dequantized')] / r['ms']:.1f}x |")
        print(line)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    shapes = sorted({(r["batch"], r["ctx"]) for r in rows}, key=lambda s: -s[0])
    kvs = [r["kv"] for r in rows if (r["batch"], r["ctx"]) == shapes[0]]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(shapes)
    for i, (b, c) in enumerate(shapes):
        sp = [next(r["speedup_vs_kv16"] for r in rows if (r["batch"], r["ctx"], r["kv"]) == (b, c, k))
              for k in kvs]
        ax.bar([x + i * w for x in range(len(kvs))], sp, w, label=f"batch {b}, ctx {c}")
    for x, k in enumerate(kvs):
        if k in GOALS:
            ax.plot([x - 0.1, x + 0.9 - w], [GOALS[k]] * 2, "k--", lw=1)
    ax.set_xticks([x + w * (len(shapes) - 1) / 2 for x in range(len(kvs))], kvs)
    ax.set_ylabel("decode attention speedup over kv16")
    ax.set_title(f"nibble decode attention by KV format ({ours['device'].split('(')[1].split(',')[0]}); dashes: goals")
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "kv-attention.png", dpi=120)


if __name__ == "__main__":
    main()

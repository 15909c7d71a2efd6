#!/usr/bin/env python3
"""The peer sum of several rows against NCCL's all-reduce at TP=2 (scripts/gpu-tp-run.sh OUT
offline batch prefill with OFFLINE_ENVS / BATCH_ENVS / PREFILL_ENVS naming NIBBLE_TP_PEER_ROWS=0
and NIBBLE_TP_SUM_BF16=1): for every workload with a TP=1 run, output tokens/s (total for
prefill-only runs) of each TP=2 variant over TP=1's, as a table and a bar chart.

    python3 bench/peer_rows_report.py DIR... [--png OUT.png]

DIR holds the runs' JSON (or the results-*.tgz the script packs them into)."""
import json
import sys
import tarfile
from pathlib import Path

VARIANTS = [  # (file suffix, label)
    ("-nibble-tp-peer-rows-0", "NCCL all-reduce (NIBBLE_TP_PEER_ROWS=0)"),
    ("", "peer sum (default)"),
    ("-nibble-tp-sum-bf16-1", "peer sum in bf16 (NIBBLE_TP_SUM_BF16=1)"),
]


def runs(d):
    d = Path(d)
    out = {}
    for t in d.glob("results-*.tgz"):
        with tarfile.open(t) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    out[Path(m.name).stem] = json.load(tf.extractfile(m))
    for f in d.glob("*.json"):
        out[f.stem] = json.loads(f.read_text())
    return out


def rate(j, name):
    return j["total_tok_s"] if name.startswith("prefill") else j["output_tok_s"]


def main(args):
    png = None
    if "--png" in args:
        i = args.index("--png")
        png = args[i + 1]
        args = args[:i] + args[i + 2:]
    rows = []
    for d in args:
        r = runs(d)
        tag = Path(d).name if Path(d).name != "perf" else Path(d).parent.name
        for name in sorted(k for k in r if k.endswith("-tp1")):
            base = name[: -len("-tp1")]
            one = rate(r[name], base)
            got = [(label, rate(r[base + "-tp2" + sfx], base) / one)
                   if base + "-tp2" + sfx in r else (label, None) for sfx, label in VARIANTS]
            rows.append((f"{base} ({tag.split('-')[-1]})", one, got))
    print("| workload (call) | TP=1 tok/s | " + " | ".join(l for _, l in VARIANTS) + " |")
    print("|---|---|" + "---|" * len(VARIANTS))
    for w, one, got in rows:
        cells = " | ".join("-" if v is None else f"{v:.2f}x" for _, v in got)
        print(f"| {w} | {one:,.0f} | {cells} |")
    if not png:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    width = 0.8 / len(VARIANTS)
    for k, (_, label) in enumerate(VARIANTS):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        ys = [got[k][1] or 0 for _, _, got in rows]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(1.7, color="gray", ls="--", label="issue 24's offline goal (1.7x)")
    ax.axhline(2.0, color="lightgray", ls=":")
    ax.set_xticks(range(len(rows)), [w for w, _, _ in rows], rotation=30, ha="right")
    ax.set_ylabel("TP=2 tok/s over TP=1's")
    ax.set_ylim(1.0, 2.1)
    ax.set_title("Llama-3-8B shape, BF16, two H100s: the sums of several rows")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"\n![the peer sum of several rows]({png})")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Mean Nsight Compute duration per kernel and grid of one or more `scripts/gpu-profile-step.sh`
CSVs (plain or gzipped), launches shorter than --under-us only (a decode step's kernels, not the
prefill passes'), side by side, with an optional bar chart.

    python3 bench/ncu_kernel_means.py NAME=CSV... [--under-us 300] [--plot PNG --title TEXT]"""
import argparse
import collections
import csv
import gzip


def ncu_rows(path):
    """The rows of an Nsight Compute `--csv` file (plain or gzipped) as dicts, from its header
    line on (ncu prints its own lines before it); a cut-short row's missing cells are None. No
    rows where ncu wrote no table (a failed run)."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    return [] if start is None else list(csv.DictReader(lines[start:]))


def means(path, under_us):
    times = collections.defaultdict(list)
    for r in ncu_rows(path):
        if r.get("Metric Value") is None:
            continue
        us = float(r["Metric Value"].replace(",", "")) / 1000
        if us < under_us:
            times[(r["Kernel Name"].split("(")[0], r["Grid Size"])].append(us)
    return {k: (sum(v) / len(v), len(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="NAME=CSV")
    ap.add_argument("--under-us", type=float, default=300.0)
    ap.add_argument("--plot")
    ap.add_argument("--title", default="decode-step kernels")
    a = ap.parse_args()
    runs = [(r.split("=", 1)[0], means(r.split("=", 1)[1], a.under_us)) for r in a.runs]
    keys = sorted({k for _, m in runs for k in m})
    print("| kernel | grid | " + " | ".join(f"{n} µs (launches)" for n, _ in runs) + " |")
    print("|---|---|" + "---|" * len(runs))
    for k in keys:
        cells = [f"{m[k][0]:.2f} ({m[k][1]})" if k in m else "-" for _, m in runs]
        print(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    if not a.plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(keys)), 4.5))
    width = 0.8 / len(runs)
    for i, (n, m) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [m[k][0] if k in m else 0 for k in keys], width=width, label=n)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{k[0]}\n{k[1]}" for k in keys], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("µs a launch (Nsight Compute)")
    ax.set_title(a.title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    print(f"\n![{a.title}]({a.plot})")


if __name__ == "__main__":
    main()

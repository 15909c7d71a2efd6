#!/usr/bin/env python3
"""Table of a decode step's device time by kernel, from scripts/gpu-decode-profile.sh's Nsight
Compute CSV (one row per kernel launch, `gpu__time_duration.sum` in ns or us): launches, total
and mean time per kernel name, and each kernel's share, per decode step.

    python3 bench/decode_profile.py OUT/ncu-decode.csv [STEPS]
"""
import csv
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                 "ms": 1e3}[r.get("Metric Unit", "nsecond")]
        us = v * scale
        rows.append((r["Kernel Name"].split("(")[0], us))
    if not rows:
        sys.exit("no kernel durations in the CSV")
    by = defaultdict(lambda: [0, 0.0])
    for name, us in rows:
        by[name][0] += 1
        by[name][1] += us
    # A decode step launches the embedding once: count steps by it, unless given.
    embeds = [n for n in by if "embed" in n]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else (by[embeds[0]][0] if embeds else 1)
    total = sum(t for _, t in by.values())
    print(f"{len(rows)} launches, {steps} decode steps, {total / steps:.1f} us of kernel time a step\n")
    print("| kernel | launches a step | us a step | mean us | share |")
    print("|---|---|---|---|---|")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{name[:60]}` | {n / steps:.1f} | {t / steps:.1f} | {t / n:.2f} | {t / total:.1%} |")


if __name__ == "__main__":
    main()

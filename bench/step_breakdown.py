#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (gpu__time_duration per kernel, scripts/gpu-profile-step.sh) by
kernel name and grid: calls, total and per-call time, and share of the window. The window is a
run of consecutive kernels inside the decode steps, so shares are those of a decode step; where
it holds whole steps (each launches the embedding once), the time a step too.

    python3 bench/step_breakdown.py NCU.csv"""
import sys
from collections import defaultdict

from ncu_kernel_means import ncu_rows


def main(path):
    rows = []
    for r in ncu_rows(path):
        if r.get("Metric Name") != "gpu__time_duration.sum" or r.get("Metric Value") is None:
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        name = r["Kernel Name"].split("(")[0]
        grid = r.get("Grid Size", "")
        rows.append((name, grid, v * scale))
    if not rows:
        print("no kernels")
        return
    total = sum(t for _, _, t in rows)
    by = defaultdict(lambda: [0, 0.0])
    for name, grid, t in rows:
        k = f"{name} {grid}"
        by[k][0] += 1
        by[k][1] += t
    print(f"{len(rows)} kernels, {total:.1f} us in all")
    steps = sum(1 for name, _, _ in rows if name.startswith("embed"))
    if steps:
        print(f"{steps} decode steps (embedding launches): {total / steps:.1f} us of kernels a step")
    print(f"{'kernel (grid)':60} {'calls':>6} {'us':>10} {'us/call':>8} {'share':>6}")
    for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{k[:60]:60} {n:6d} {t:10.1f} {t / n:8.2f} {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env python3
"""Tables of bench/probe/launch_cost_call.sh's run: per kernel and DRAM bytes read (which tell the
layer shapes apart), Nsight Compute's isolated duration of a launch (median over its launches) and
the time gpu-bench measured per call back to back in a graph; the difference is what a launch costs
outside the kernel's own run.

    python3 bench/launch_cost_report.py DIR
"""
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ncu_kernel_means import ncu_rows


def launches(path):
    """{(kernel, grid, block): {metric: [values per launch]}} of an ncu --csv file."""
    rows = defaultdict(lambda: defaultdict(dict))
    for r in ncu_rows(path):
        if r.get("Metric Value") is None:
            continue
        v = float(r["Metric Value"].replace(",", ""))
        rows[r["ID"]][(r["Kernel Name"], r["Grid Size"], r["Block Size"])][r["Metric Name"]] = v
    out = defaultdict(lambda: defaultdict(list))
    for per in rows.values():
        for key, metrics in per.items():
            for name, v in metrics.items():
                out[key][name].append(v)
    return out


def by_bytes(path):
    """[(kernel, grid, MB read, launches, median µs)] grouping launches by DRAM bytes (to 1 MB)."""
    groups = defaultdict(list)
    for (name, grid, block), m in launches(path).items():
        for b, t in zip(m["dram__bytes_read.sum"], m["gpu__time_duration.sum"]):
            groups[(name[:60], grid, block, round(b / 1e6))].append(t / 1e3)
    return sorted(((n, g, bl, mb, len(ts), statistics.median(ts)) for (n, g, bl, mb), ts in groups.items()),
                  key=lambda r: (r[0], r[3]))


def main():
    d = Path(sys.argv[1])
    bench = json.loads((d / "bench.json").read_text())
    bw = bench["hbm_bytes_per_s"]
    print(f"{bench['device']}, copy rate {bw / 1e12:.2f} TB/s\n")
    rows = {(r["n"], r["k"], r["m"]): r for r in bench["qgemm"]}
    print("gpu-bench, graph-timed per call (µs):\n")
    print("| N x K | M | w4a16 | w4a8 | w8a8 |\n|---|---|---|---|---|")
    for (n, k, m), r in sorted(rows.items(), key=lambda x: (x[0][2], -x[0][0] * x[0][1])):
        print(f"| {n} x {k} | {m} | {r['w4a16_ms'] * 1e3:.1f} | {r['w4a8_ms'] * 1e3:.1f} | {r['w8a8_ms'] * 1e3:.1f} |")
    for f in sorted([*d.glob("ncu-*.csv"), *d.glob("ncu-*.csv.gz")]):
        print(f"\n{f.name}: isolated launches, median duration\n")
        print("| kernel | grid | block | MB read | launches | µs | of copy rate |\n|---|---|---|---|---|---|---|")
        for name, grid, block, mb, count, us in by_bytes(f):
            if count < 3 and "peer" not in f.name:
                continue
            share = mb * 1e6 / (us * 1e-6) / bw if us > 0 else 0
            print(f"| {name} | {grid} | {block} | {mb} | {count} | {us:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main()

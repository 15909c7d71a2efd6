#!/usr/bin/env python3
"""Tabulates scripts/gpu-e2e-ab.sh runs: RUNS/<stage>-<round>/throughput-<precision>.json, one
row per stage, round, precision and batch size, with W4A8 / BF16 of the same stage and round.

    python3 bench/e2e_ab_report.py RUNS"""
import json
import os
import sys


def results(path):
    d = json.load(open(path))
    return d if isinstance(d, list) else [d]


def main(runs):
    rows = {}
    for name in sorted(os.listdir(runs)):
        folder = os.path.join(runs, name)
        if not os.path.isdir(folder):
            continue
        stage, _, rnd = name.rpartition("-")
        commit = "?"
        dev = os.path.join(folder, "device.txt")
        if os.path.exists(dev):
            for line in open(dev):
                if line.startswith("commit "):
                    commit = line.split()[1]
        for prec in ("w4a8", "bf16"):
            p = os.path.join(folder, f"throughput-{prec}.json")
            if not os.path.exists(p):
                continue
            for r in results(p):
                rows[(stage, rnd, commit, r["max_num_seqs"], prec)] = r["output_tok_s"]
    if not rows:
        print("no runs finished")
        return
    print("| stage | round | commit | seqs | W4A8 output tok/s | BF16 output tok/s | W4A8 / BF16 |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted({k[:4] for k in rows}):
        w, b = rows.get(key + ("w4a8",)), rows.get(key + ("bf16",))
        ratio = f"{w / b:.3f}x" if w and b else "-"
        fmt = lambda v: f"{v:,.1f}" if v else "-"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {fmt(w)} | {fmt(b)} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])

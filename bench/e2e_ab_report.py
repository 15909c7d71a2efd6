#!/usr/bin/env python3
"""Tabulates scripts/gpu-e2e-ab.sh runs: RUNS/<stage>-<round>/throughput-<precision>.json, one
row per stage, round and batch size: each precision's output tok/s, and each quantized one over
BF16 of the same stage and round where BF16 ran.

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
        for name_ in sorted(os.listdir(folder)):
            if not (name_.startswith("throughput-") and name_.endswith(".json")):
                continue
            prec = name_[len("throughput-"):-len(".json")]
            try:
                for r in results(os.path.join(folder, name_)):
                    rows[(stage, rnd, commit, r["max_num_seqs"], prec)] = r["output_tok_s"]
            except (ValueError, KeyError, TypeError) as e:  # a run cut short: skip it, say so
                print(f"{folder}/{name_}: skipped ({e})", file=sys.stderr)
    if not rows:
        print("no runs finished")
        return
    # Quantized precisions first (W4A8, then the rest by name), BF16 last; a ratio to BF16 for each.
    precs = sorted({k[4] for k in rows}, key=lambda p: (p == "bf16", p != "w4a8", p))
    quant = [p for p in precs if p != "bf16"]
    ratios = quant if "bf16" in precs else []
    head = [f"{p.upper()} output tok/s" for p in precs] + [f"{p.upper()} / BF16" for p in ratios]
    print("| stage | round | commit | seqs | " + " | ".join(head) + " |")
    print("|---|---|---|---|" + "---|" * len(head))
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"
    for key in sorted({k[:4] for k in rows}):
        vals = [rows.get(key + (p,)) for p in precs]
        b = rows.get(key + ("bf16",))
        cells = [fmt(v) for v in vals]
        for p in ratios:
            w = rows.get(key + (p,))
            cells.append(f"{w / b:.3f}x" if w is not None and b else "-")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])

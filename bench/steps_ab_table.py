#!/usr/bin/env python3
"""Decode steps (`gpu-bench --decode-steps`) of an A/B/N run (scripts/gpu-abn.sh): the fastest
round of each build per (batch, context), and each build's speed against the base's.

    python3 bench/steps_ab_table.py OUTDIR BASE NAME...

Reads OUTDIR/bench-NAME-ROUND.json; prints a markdown table (ms a step; ratio = base ms / ms,
above 1 faster than the base)."""
import glob
import json
import os
import sys


def best_steps(out, name):
    """{(batch, ctx): (ms, floor ms)}: the fastest round's step."""
    steps = {}
    for f in sorted(glob.glob(os.path.join(out, f"bench-{name}-*.json"))):
        try:
            runs = json.load(open(f)).get("decode_steps", [])
        except json.JSONDecodeError:
            print(f"{f}: not JSON (a run cut short), skipped", file=sys.stderr)
            continue
        for s in runs:
            if "ms" not in s:
                continue
            key = (s["batch"], s["ctx"])
            if key not in steps or s["ms"] < steps[key][0]:
                steps[key] = (s["ms"], s["floor_ms"])
    return steps


def main(out, base, names):
    sides = {n: best_steps(out, n) for n in [base] + names}
    head = " | ".join(f"{n} ms | {n} vs {base}" for n in names)
    print(f"| batch | ctx | floor ms | {base} ms | {head} |")
    print("|---|---|---|---|" + "---|---|" * len(names))
    for key in sorted(sides[base]):
        ms, floor = sides[base][key]
        cells = []
        for n in names:
            got = sides[n].get(key)
            cells.append(f"{got[0]:.3f} | {ms / got[0]:.3f}x" if got else "- | -")
        print(f"| {key[0]} | {key[1]} | {floor:.3f} | {ms:.3f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

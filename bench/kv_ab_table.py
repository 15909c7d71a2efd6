"""The table of a KV-attention A/B (scripts/gpu-kv-ab.sh): each stage's best time of its rounds
per KV format and shape, and the first stage (the candidate) against each other one.
`python3 bench/kv_ab_table.py OUTDIR CANDIDATE BASE...` reads OUTDIR/bench-NAME-ROUND.json."""
import glob
import json
import sys


def best_times(out, names):
    """{(kv, batch, ctx): {name: best us}} over the rounds' JSON files."""
    rows = {}
    for name in names:
        for path in sorted(glob.glob(f"{out}/bench-{name}-*.json")):
            try:
                report = json.load(open(path))
            except ValueError:
                print(f"{path}: not JSON (a run cut short?)", file=sys.stderr)
                continue
            for r in report.get("kv_attention", []):
                cell = rows.setdefault((r["kv"], r["batch"], r["ctx"]), {})
                us = r["ms"] * 1e3
                cell[name] = min(cell.get(name, us), us)
    return rows


def table(rows, names):
    cand, bases = names[0], names[1:]
    head = ["KV", "batch x ctx"] + [f"{n} us" for n in names] + [f"{cand} vs {b}" for b in bases]
    kv16 = {(b, c): t for (kv, b, c), t in rows.items() if kv == "kv16"}
    head.append(f"{cand} vs kv16")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kv, b, c), t in rows.items():
        cells = [kv, f"{b} x {c}"] + [f"{t[n]:.1f}" if n in t else "-" for n in names]
        for base in bases:
            ok = cand in t and base in t
            cells.append(f"{t[base] / t[cand]:.3f}x" if ok else "-")
        ref = kv16.get((b, c), {}).get(cand)
        cells.append(f"{ref / t[cand]:.2f}x" if ref and cand in t else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    out, names = sys.argv[1], sys.argv[2:]
    rows = best_times(out, names)
    if not rows:
        sys.exit(f"{out}: no kv_attention results")
    print(table(rows, names))

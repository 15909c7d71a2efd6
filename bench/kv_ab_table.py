"""The table of a KV-attention A/B/N (scripts/gpu-kv-ab.sh): each build's best time of its rounds
per KV format and shape (bench/ab_report.py's reading of the runs), the first build (the
candidate) against each other one, and the candidate against its own kv16 (the issue's ratio).
`python3 bench/kv_ab_table.py OUTDIR CANDIDATE BASE...` reads OUTDIR/bench-NAME-ROUND.json."""
import sys
from pathlib import Path

from ab_report import best, load_named


def table(runs, names):
    """Markdown rows from load_named's {name: {(kv, shape): [(µs, share), ...]}}."""
    cand, bases = names[0], names[1:]
    keys = list(dict.fromkeys(k for name in names for k in runs[name]))
    t = {k: {n: best(runs[n], k)[0] for n in names if k in runs[n]} for k in keys}
    head = ["KV", "batch x ctx"] + [f"{n} us" for n in names]
    head += [f"{cand} vs {b}" for b in bases] + [f"{cand} vs kv16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        kv, shape = key
        row = t[key]
        cells = [kv, shape.replace("x", " x ")] + [f"{row[n]:.1f}" if n in row else "-" for n in names]
        cells += [f"{row[b] / row[cand]:.3f}x" if cand in row and b in row else "-" for b in bases]
        ref = t.get(("kv16", shape), {}).get(cand)
        cells.append(f"{ref / row[cand]:.2f}x" if ref and cand in row else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    out, names = Path(sys.argv[1]), sys.argv[2:]
    runs, device, kind = load_named(out, "", names)
    if kind != "kv":
        sys.exit(f"{out}: no kv_attention results")
    print(f"{device}\n")
    print(table(runs, names))

#!/usr/bin/env python3
"""Report of an A/B run (scripts/gpu-ab.sh): main's build ("base") against a candidate's,
each benchmarked twice alternately in one device call. Takes the faster of each pair and prints
a markdown table of times, speedups and shares of the measured copy bandwidth; draws the shares
of both builds side by side (OUTDIR/ab.png, or OUT.png).

    python3 bench/ab_report.py OUTDIR [--field w4a16] [--base NAME] [--cand NAME] [OUT.png]

NAME picks the files bench-NAME-*.json (default base and cand; scripts/gpu-abn.sh names them
after the stages' folders).

qgemm runs (`gpu-bench --qgemm`): FIELD picks the format (`w4a16`, `w8a8`, `w4a8`, `w8a16`,
`nibble_fp8`); moe runs (`gpu-bench --moe-experts`): the grouped GEMMs of each format and size;
kv runs (`gpu-bench --kv-attention`): decode attention of each KV format at batch x context;
steps runs (`gpu-bench --decode-steps`): whole decode steps at batch x context (µs a step, and the
share is the step's floor over its time).
"""
import json
import sys
from pathlib import Path


def best(runs, key):
    """The fastest of the runs' rows with this key: (time µs, share of the copy rate)."""
    return min(runs[key], key=lambda r: r[0])


def load_named(out, field, names):
    """{name: {key: [(µs, share), ...]}} over each name's bench-NAME-*.json, the device name,
    and the kind of run ("qgemm", "moe" or "kv"). A file that is not JSON (a run cut short) is
    skipped with a word on stderr."""
    sides, device, kind = {name: {} for name in names}, "", ""
    for name in names:
        for path in sorted(out.glob(f"bench-{name}-*.json")):
            try:
                d = json.loads(path.read_text())
            except ValueError:
                print(f"{path}: not JSON (a run cut short?)", file=sys.stderr)
                continue
            device = d["device"]
            if d.get("kv_attention"):
                kind = "kv"
                for r in d["kv_attention"]:
                    key = (r["kv"], f"{r['batch']}x{r['ctx']}")
                    sides[name].setdefault(key, []).append((r["ms"] * 1e3, r["bandwidth_fraction"]))
            elif d.get("decode_steps"):
                kind = "steps"
                for r in d["decode_steps"]:
                    if "ms" in r:
                        key = (r["batch"], r["ctx"])
                        sides[name].setdefault(key, []).append((r["ms"] * 1e3, r["of_floor"]))
            elif "moe_experts" in d and d["moe_experts"]:
                kind = "moe"
                for r in d["moe_experts"]:
                    key = (r["format"], r["tokens"])
                    sides[name].setdefault(key, []).append((r["grouped_gemms_us"], r["grouped_hbm_share"]))
            else:
                kind = "qgemm"
                for r in d["qgemm"]:
                    key = (f"{r['n']}x{r['k']}", r["m"])
                    share = r.get(f"{field}_hbm_fraction")
                    sides[name].setdefault(key, []).append((r[f"{field}_ms"] * 1e3, share))
    return sides, device, kind


def load(out, field, names=("base", "cand")):
    """load_named for two builds, as sides "base" and "cand"."""
    named, device, kind = load_named(out, field, names)
    return {"base": named[names[0]], "cand": named[names[1]]}, device, kind


def main():
    args = [a for a in sys.argv[1:]]
    field = "w4a16"
    names = ["base", "cand"]
    for flag in ["--field", "--base", "--cand"]:
        if flag in args:
            i = args.index(flag)
            if flag == "--field":
                field = args[i + 1]
            else:
                names[flag == "--cand"] = args[i + 1]
            del args[i : i + 2]
    out = Path(args[0])
    png = Path(args[1]) if len(args) > 1 else out / "ab.png"
    sides, device, kind = load(out, field, names)
    keys = [k for k in sides["base"] if k in sides["cand"]]
    if not keys:
        sys.exit(f"no rows both builds ran in {out}")
    what = {"moe": "grouped expert GEMMs", "kv": "decode attention", "steps": "decode steps"}.get(kind, field)
    print(f"{device}: {what}, the faster of each build's runs\n")
    head = {"kv": "| KV | batch x ctx", "moe": "| format | tokens", "steps": "| batch | ctx"}.get(
        kind, "| shape | tokens"
    )
    print(f"{head} | base µs | candidate µs | speedup | of copy rate, base / candidate |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        b, c = best(sides["base"], k), best(sides["cand"], k)
        share = "-" if b[1] is None else f"{b[1] * 100:.0f} / {c[1] * 100:.0f}%"
        print(f"| {k[0]} | {k[1]} | {b[0]:.1f} | {c[0]:.1f} | {b[0] / c[0]:.2f}x | {share} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    labels = [f"{k[0]} {k[1]}" for k in keys]
    xs = range(len(keys))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(keys)), 4.5))
    for off, side, name in [(-0.2, "base", "main"), (0.2, "cand", "candidate")]:
        vals = [(best(sides[side], k)[1] or 0) * 100 for k in keys]
        ax.bar([x + off for x in xs], vals, width=0.4, label=name)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7, rotation=60, ha="right")
    ax.set_xlabel("shape (N x K or format), tokens", fontsize=8)
    ax.set_ylabel("% of the measured copy bandwidth")
    ax.set_title(f"{what} on {device}: main against the candidate", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"\n![{what}: main against the candidate]({png})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Several builds' quantized GEMMs against PyTorch's, from one scripts/gpu-abn.sh call with
AB_PEER (bench-NAME-ROUND.json of each build, peer.json): for each format, the fastest run of
every build in µs, and each build's ratio to `torch._scaled_mm` (FP8, row-wise scales) and to
the first build. Draws the ratios to torch per shape as grouped bars (OUT.png, if matplotlib is
there).

    python3 bench/abn_peer_report.py OUTDIR NAME... [--fields nibble_fp8,w4a8,w8a8] [--png OUT.png]

The first NAME is the base of the speedup column.
"""
import json
import sys
from pathlib import Path

from qgemm_report import geomean


def fastest(out, name):
    """{(n, k, m): row} keeping, per field, the fastest of the build's rounds."""
    best = {}
    for f in sorted(Path(out).glob(f"bench-{name}-*.json")):
        try:
            rows = json.loads(f.read_text())["qgemm"]
        except (json.JSONDecodeError, KeyError) as e:
            print(f"{f}: skipped ({e})", file=sys.stderr)
            continue
        for r in rows:
            key = (r["n"], r["k"], r["m"])
            have = best.setdefault(key, dict(r))
            for field, v in r.items():
                if field.endswith("_ms") and isinstance(v, (int, float)):
                    old = have.get(field)
                    if not isinstance(old, (int, float)) or v < old:
                        have[field] = v
    return best


def main():
    args = sys.argv[1:]
    fields, png = ["nibble_fp8", "w4a8", "w8a8"], None
    if "--fields" in args:
        i = args.index("--fields")
        fields = args[i + 1].split(",")
        del args[i : i + 2]
    if "--png" in args:
        i = args.index("--png")
        png = args[i + 1]
        del args[i : i + 2]
    out, names = args[0], args[1:]
    builds = {name: fastest(out, name) for name in names}
    peer = {(r["n"], r["k"], r["m"]): r for r in json.loads((Path(out) / "peer.json").read_text())["qgemm"]}
    device = (Path(out) / "device.txt").read_text().strip().splitlines()
    print("\n".join(f"    {line}" for line in device))
    ratios = {}
    for field in fields:
        print(f"\n{field}, µs (x torch._scaled_mm FP8; x {names[0]})\n")
        print("| N x K | M | " + " | ".join(names) + " | torch FP8 |")
        print("|---|---|" + "---|" * (len(names) + 1))
        for key in sorted(builds[names[0]], key=lambda k: (k[2], -k[0] * k[1])):
            n, k, m = key
            torch_ms = peer.get(key, {}).get("fp8_ms")
            cells = []
            for name in names:
                v = builds[name].get(key, {}).get(f"{field}_ms")
                if not isinstance(v, (int, float)):
                    cells.append("-")
                    continue
                base = builds[names[0]][key][f"{field}_ms"]
                vs_torch = torch_ms / v if torch_ms else float("nan")
                ratios.setdefault((field, name, m), []).append(vs_torch)
                cells.append(f"{v * 1e3:.1f} ({vs_torch:.2f}x; {base / v:.2f}x)")
            t = f"{torch_ms * 1e3:.1f}" if torch_ms else "-"
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + f" | {t} |")
    print("\nGeomean x torch FP8, by M:\n")
    ms = sorted({m for (_, _, m) in ratios})
    print("| format | build | " + " | ".join(f"M = {m}" for m in ms) + " |")
    print("|---|---|" + "---|" * len(ms))
    for field in fields:
        for name in names:
            cells = [f"{geomean(ratios.get((field, name, m), [])):.2f}x" for m in ms]
            print(f"| {field} | {name} | " + " | ".join(cells) + " |")
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(matplotlib missing: no plot)", file=sys.stderr)
            return
        keys = sorted(builds[names[0]], key=lambda k: (k[2], -k[0] * k[1]))
        fig, axes = plt.subplots(len(fields), 1, figsize=(max(8, len(keys) * 1.1), 3.2 * len(fields)), squeeze=False)
        width = 0.8 / len(names)
        for ax, field in zip(axes[:, 0], fields):
            for j, name in enumerate(names):
                vals = []
                for key in keys:
                    v = builds[name].get(key, {}).get(f"{field}_ms")
                    t = peer.get(key, {}).get("fp8_ms")
                    vals.append(t / v if isinstance(v, (int, float)) and t else 0)
                ax.bar([i + j * width for i in range(len(keys))], vals, width, label=name)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
            ax.set_xticklabels([f"{n}x{k}\nM={m}" for n, k, m in keys], fontsize=7)
            ax.set_ylabel(f"{field}\nx torch FP8")
            ax.legend(fontsize=7, ncol=len(names))
        fig.suptitle(device[-1] if device else "")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"\n![ratios]({png})")


if __name__ == "__main__":
    main()

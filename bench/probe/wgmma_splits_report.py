"""Tabulates bench/probe/wgmma_splits_probe.sh's JSON: per family, shape and token count, the µs
of each build and split count side by side (cuBLAS BF16 from the first file as the reference)."""
import glob, json, os, re, sys

out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "*-splits-*.json"))):
    m = re.match(r"(.*)-splits-(\w+)\.json", os.path.basename(f))
    runs[(m.group(1), m.group(2))] = {(r["n"], r["k"], r["m"]): r for r in json.load(open(f))["qgemm"]}
keys = sorted(runs)
fams = ["w4a16_ms", "w8a8_ms", "w4a8_ms", "nibble_fp8_ms", "w8a16_ms"]
lines = []
for fam in fams:
    present = [k for k in keys if any(r.get(fam) for r in runs[k].values())]
    if not present:
        continue
    lines.append(f"\n### {fam[:-3]} (µs)\n")
    lines.append("| N x K | M | cuBLAS BF16 | " + " | ".join(f"{b} {s}" for b, s in present) + " |")
    lines.append("|---" * (3 + len(present)) + "|")
    shapes = sorted(runs[present[0]])
    for sh in shapes:
        ref = runs[present[0]][sh].get("cublas_bf16_ms") or 0
        cells = []
        for k in present:
            v = runs[k].get(sh, {}).get(fam)
            cells.append(f"{v * 1e3:.1f}" if v else "-")
        lines.append(f"| {sh[0]} x {sh[1]} | {sh[2]} | {ref * 1e3:.1f} | " + " | ".join(cells) + " |")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "splits.md"), "w").write(text)
print(text)

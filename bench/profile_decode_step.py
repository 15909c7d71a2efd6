#!/usr/bin/env python3
"""Where a decode step's device time goes, kernel by kernel, per precision: Nsight Compute's
duration of every kernel of Llama-3-8B-shaped decode steps (gpu-bench --decode-steps, random
weights, batch B, contexts 512 and 1024), summed per kernel name and divided by the steps seen.

    python3 bench/profile_decode_step.py OUTDIR BATCH SPEC...   # SPEC: bf16, w4a8-g128, fp8, ..

Runs on the GPU machine (scripts/gpu-stage.sh's stage/gpu/gpu-bench); writes OUTDIR/profile-B.md.
ncu serializes kernels, so these are isolated kernel times: their sum is a lower bound of a
step's time, and the gap to the measured step is launch and scheduling overhead.
"""
import collections
import csv
import io
import subprocess
import sys
from pathlib import Path


def profile(spec, batch, launches):
    cmd = ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
           "--launch-count", str(launches), "stage/gpu/gpu-bench", "/tmp/steps.json",
           "--decode-steps", str(batch)]
    if spec != "bf16":
        cmd += ["--spec", spec]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(out[out.index('"ID"'):])) if r.get("Metric Name") == "gpu__time_duration.sum"]
    per = collections.defaultdict(list)
    for r in rows:
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        us = v / 1e3 if unit == "nsecond" else v if unit == "usecond" else v * 1e3
        per[r["Kernel Name"].split("(")[0]].append(us)
    steps = max(1, len([n for n in per if n.startswith("embed")]) and len(next(v for n, v in per.items() if n.startswith("embed"))))
    return per, steps


def main():
    out, batch, specs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Decode steps, Llama-3-8B shape, batch {batch}, isolated kernel times (ncu, clocks untouched); "
             "µs per step = total over the profiled launches / steps (embedding launches).", ""]
    for spec in specs:
        per, steps = profile(spec, batch, 2500)
        total = sum(sum(v) for v in per.values()) / steps
        lines += [f"### {spec}: {steps} steps, {total:.0f} µs of kernels per step", "",
                  "| kernel | launches per step | mean µs | µs per step | share |", "|---|---|---|---|---|"]
        for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            t = sum(v) / steps
            lines.append(f"| {name} | {len(v) / steps:.1f} | {sum(v) / len(v):.1f} | {t:.0f} | {100 * t / total:.1f}% |")
        lines.append("")
    (out / f"profile-{batch}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

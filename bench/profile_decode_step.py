#!/usr/bin/env python3
"""Where a decode step's device time goes, kernel by kernel, per precision: Nsight Compute's
duration of every kernel of Llama-3-8B-shaped decode steps (gpu-bench --decode-steps, random
weights, batch B, contexts 512 and 1024), summed per kernel name and divided by the steps seen.

    python3 bench/profile_decode_step.py OUTDIR BATCH SPEC...   # SPEC: bf16, w4a8-g128, fp8, ..

Runs on the GPU machine (scripts/gpu-stage.sh's stage/gpu/gpu-bench); writes OUTDIR/profile-B.md.
ncu serializes kernels and flushes caches between them, so these are isolated, cold-cache kernel
times: compare kernels with each other, not their sum with a measured step.
"""
import collections
import csv
import io
import subprocess
import sys
from pathlib import Path


def profile(spec, batch, launches):
    # Past the setup's launches (the ceilings' copy and GEMM, the KV pool's random fill: 64).
    cmd = ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
           "--launch-skip", "80", "--launch-count", str(launches), "stage/gpu/gpu-bench", "/tmp/steps.json",
           "--decode-steps", str(batch)]
    if spec != "bf16":
        cmd += ["--spec", spec]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(out[out.index('"ID"'):])) if r.get("Metric Name") == "gpu__time_duration.sum"]
    per = collections.defaultdict(list)
    for r in rows:
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit] * v
        per[r["Kernel Name"].split("(")[0]].append(us)
    return per


def main():
    out, batch, specs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Decode steps, Llama-3-8B shape, batch {batch}: isolated kernel times (ncu, clocks untouched, "
             "caches flushed between kernels) over a window of 420 launches (about one step) after the setup.", ""]
    for spec in specs:
        per = profile(spec, batch, 420)
        total = sum(sum(v) for v in per.values())
        lines += [f"### {spec}", "",
                  "| kernel | launches | mean µs | share of the window |", "|---|---|---|---|"]
        for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"| {name} | {len(v)} | {sum(v) / len(v):.1f} | {100 * sum(v) / total:.1f}% |")
        lines.append("")
        (out / f"profile-{batch}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

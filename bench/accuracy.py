#!/usr/bin/env python3
"""Builds docs/accuracy.md: perplexity of every precision format x quantization method on the
default model (or --model), against the unquantized baseline, with the issue's acceptance lines
checked, plus the time and peak memory of each `nibble quantize`.

    python3 bench/accuracy.py            # the documented command: 32 x 256 calibration tokens,
                                         # 8 x 512 held-out tokens (about an hour on 2 cores)
    python3 bench/accuracy.py --quick    # fewer evaluation tokens, for a smoke run
    python3 bench/accuracy.py --render bench/results/accuracy-<time>.json
                                         # the page again from a run's raw results, keeping
                                         # only the rows ROWS still lists (a method withdrawn
                                         # after the run drops out; nothing is re-measured)

Every number comes from the release binary: `nibble quantize` writes each checkpoint under
--work, `nibble eval ppl --json` scores it on ../shared/reference/sample.txt and on a held-out
ShareGPT slice (the evaluation half of the file, disjoint from the calibration half).
Raw results go to bench/results/accuracy-<time>.json.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where `cargo build --release` puts the binary: cargo's own rule, so a CARGO_TARGET_DIR set for the
# build (a shared or out-of-tree target directory) is honoured without another option.
NIBBLE = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target").resolve() / "release" / "nibble"
SAMPLE = ROOT.parent / "shared" / "reference" / "sample.txt"

# (format, method). KV-only formats need no checkpoint: the baseline model runs with --kv.
ROWS = [
    ("w16a16", "baseline"),
    ("kv8", "rtn"),
    ("kvfp8", "rtn"),
    ("kv4", "rtn"),
    ("kv4c", "rtn"),
    ("kv2c", "rtn"),
    # Keys and values in different formats (`k<K>v<V>`, see README's KV section).
    ("k8v4", "rtn"),
    ("k4v8", "rtn"),
    ("kfp8v4", "rtn"),
    ("k8v2c", "rtn"),
    ("k4v2c", "rtn"),
    ("k4cv2c", "rtn"),
    ("w8a8", "rtn"),
    ("w8a8", "smoothquant"),
    ("w8a8", "qoq"),
    ("fp8", "rtn"),
    ("fp8", "smoothquant"),
    ("w4a16-g64", "rtn"),
    ("w4a16-g64", "awq"),
    ("w4a16-g64", "gptq"),
    ("w4a8", "rtn"),
    ("w4a8", "smoothquant"),
    ("w4a8", "qoq"),
    ("w4a8-g64", "rtn"),
    ("w4a8-g64", "qoq"),
    ("w4a8-lqq-g64", "rtn"),
    ("w4a8-lqq-g64", "lqq"),
    ("w4a4a8-g64", "rtn"),
    ("w4a4a8-g64", "fmpq"),
    ("w4a8-g64-kv4", "rtn"),
    ("w4a8-g64-kv4", "qoq"),
]

KV_ONLY = {"kv8", "kvfp8", "kv4", "kv4c", "kv2c", "k8v4", "k4v8", "kfp8v4", "k8v2c", "k4v2c", "k4cv2c"}


def run(cmd, log):
    """Runs cmd, appending its output to log; returns (stdout, seconds, peak RSS in MB or None)."""
    timer = ["/usr/bin/time", "-f", "NIBBLE_TIME %e %M"] if Path("/usr/bin/time").exists() else []
    t0 = time.time()
    p = subprocess.run(timer + cmd, capture_output=True, text=True)
    secs = time.time() - t0
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n" + p.stdout + p.stderr + "\n")
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{tail}")
    rss = None
    for line in p.stderr.splitlines():
        if line.startswith("NIBBLE_TIME"):
            _, secs_s, kb = line.split()
            secs, rss = float(secs_s), int(kb) / 1024
    return p.stdout, secs, rss


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in the output of nibble eval ppl --json")


def evaluate(model_args, kv, args, log):
    cmd = [NIBBLE, *model_args, "eval", "ppl", "--file", SAMPLE,
           "--sharegpt", str(args.eval_seqs), "--ctx", str(args.eval_len), "--json"]
    if kv:
        cmd += ["--kv", kv]
    out, secs, _ = run(cmd, log)
    res = last_json(out)
    return res, secs


def pct(x, base):
    return 100.0 * (x - base) / base


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model to quantize (default: nibble's default model)")
    ap.add_argument("--work", default=str(ROOT / "target" / "accuracy"), help="checkpoints go here")
    ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy.md"))
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--eval-seqs", type=int, default=8)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--only", help="comma-separated formats to run (default: all rows)")
    ap.add_argument("--quick", action="store_true", help="4 x 256 evaluation tokens")
    ap.add_argument("--render", metavar="RAW_JSON", help="rewrite --out from a run's raw results")
    args = ap.parse_args()
    if args.render:
        raw = Path(args.render).resolve()
        data = json.loads(raw.read_text())
        listed = set(ROWS)
        kept = [r for r in data["results"] if (r["format"], r["method"]) in listed]
        dropped = [f"{r['format']} {r['method']}" for r in data["results"] if (r["format"], r["method"]) not in listed]
        Path(args.out).write_text(render(kept, data["meta"], raw, dropped))
        print(f"wrote {args.out} from {raw}" + (f", without {', '.join(dropped)}" if dropped else ""), file=sys.stderr)
        return
    if args.quick:
        args.eval_seqs, args.eval_len = 4, 256

    subprocess.run(["cargo", "build", "--release", "--locked", "-q", "-p", "nibble-cli"], cwd=ROOT, check=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    log.write_text("")
    model_args = ["--model", args.model] if args.model else []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = ROWS
    if args.only:
        keep = set(args.only.split(",")) | {"w16a16"}
        rows = [r for r in ROWS if r[0] in keep]

    results = []
    for i, (fmt, method) in enumerate(rows):
        print(f"[{i + 1}/{len(rows)}] {fmt} {method}", file=sys.stderr, flush=True)
        entry = {"format": fmt, "method": method}
        try:
            if method == "baseline":
                res, esecs = evaluate(model_args, None, args, log)
            elif fmt in KV_ONLY:
                res, esecs = evaluate(model_args, fmt, args, log)
            else:
                out_dir = work / f"{fmt}-{method}"
                if out_dir.exists():
                    shutil.rmtree(out_dir)
                cmd = [NIBBLE, *model_args, "quantize", "--format", fmt, "--method", method,
                       "--out", out_dir, "--calib-samples", str(args.calib_samples),
                       "--calib-len", str(args.calib_len), "--dense", "f32"]
                _, qsecs, rss = run(cmd, log)
                entry["quantize_s"], entry["quantize_peak_mb"] = qsecs, rss
                entry["checkpoint_mb"] = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file()) / 1e6
                res, esecs = evaluate(["--model", str(out_dir)], None, args, log)
            entry.update(res)
            entry["eval_s"] = esecs
        except Exception as e:  # a failed row is reported, the table still gets written
            entry["error"] = str(e)
            print(f"  error: {e}", file=sys.stderr)
        results.append(entry)
        print(f"  {json.dumps(entry)}", file=sys.stderr, flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    raw = ROOT / "bench" / "results" / f"accuracy-{stamp}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit, "date": stamp, "args": vars(args), "host_cpus": os.cpu_count(),
            "command": " ".join(["python3", "bench/accuracy.py", *sys.argv[1:]])}
    raw.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    Path(args.out).write_text(render(results, meta, raw))
    print(f"wrote {args.out} and {raw}", file=sys.stderr)


def ppl_of(entry, key):
    v = entry.get(key)
    if isinstance(v, dict):
        return v.get("ppl")
    return None


def render(results, meta, raw, dropped=()):
    base = next((r for r in results if r["method"] == "baseline" and "error" not in r), None)
    bs, bf = (ppl_of(base, "sharegpt"), ppl_of(base, "file")) if base else (None, None)
    a = meta["args"]
    lines = [
        "# Accuracy of nibble's precision formats",
        "",
        f"Produced by `{meta.get('command', 'python3 bench/accuracy.py')}` (raw results: "
        f"`{raw.relative_to(ROOT)}`), commit `{meta['commit']}`, {meta['date']} UTC, on a "
        f"{meta['host_cpus']}-core CPU. Model: {a['model'] or 'the default model (SmolLM2-135M-Instruct Q4_1 GGUF, weights dequantized to f32)'}.",
        "",
        f"- **sample.txt**: `../shared/reference/sample.txt` (167 predicted tokens).",
        f"- **ShareGPT**: {a['eval_seqs']} held-out sequences of {a['eval_len']} tokens from the "
        "evaluation half of ShareGPT (odd positions of the file); calibration uses "
        f"{a['calib_samples']} x {a['calib_len']} tokens from the other half.",
        "- Δ is the change in ShareGPT perplexity against the unquantized baseline. Group size 64: "
        "the hidden size 576 is not a multiple of 128.",
        "- Quantize time and peak memory are for `nibble quantize` on this machine (see also BENCHMARKS.md).",
        *([f"- Rendered again with `--render` without the rows no longer in the script's list "
           f"(measured in this run, since withdrawn): {', '.join(dropped)}."] if dropped else []),
        "",
        "| format | method | PPL sample.txt | PPL ShareGPT | Δ ShareGPT | quantize s | peak MB | checkpoint MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['method']} | error | error | | | | |")
            continue
        s, f = ppl_of(r, "sharegpt"), ppl_of(r, "file")
        d = f"{pct(s, bs):+.2f}%" if bs and s else ""
        q = f"{r['quantize_s']:.0f}" if r.get("quantize_s") else ""
        m = f"{r['quantize_peak_mb']:.0f}" if r.get("quantize_peak_mb") else ""
        c = f"{r['checkpoint_mb']:.0f}" if r.get("checkpoint_mb") else ""
        lines.append(f"| {r['format']} | {r['method']} | {f:.4f} | {s:.4f} | {d} | {q} | {m} | {c} |")
    lines += ["", "## Acceptance lines", ""]
    lines += acceptance(results, bs)
    errors = [r for r in results if "error" in r]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {r['format']} {r['method']}: {r['error'].splitlines()[0]}" for r in errors]
    return "\n".join(lines) + "\n"


def acceptance(results, base):
    out = []
    by = {(r["format"], r["method"]): ppl_of(r, "sharegpt") for r in results if "error" not in r}

    def verdict(ok):
        return "**met**" if ok else "**NOT met**"

    for (fmt, method), p in by.items():
        if method in ("rtn", "baseline") or fmt in KV_ONLY:
            continue
        rtn = by.get((fmt, "rtn"))
        if rtn and p:
            out.append(f"- {method} beats RTN at {fmt}: {p:.4f} vs {rtn:.4f}: {verdict(p < rtn)}")
    if base:
        w8 = [p for (f, m), p in by.items() if f == "w8a8" and p]
        if w8:
            best = min(w8)
            out.append(f"- best W8A8 within 1% of baseline: {pct(best, base):+.2f}%: {verdict(pct(best, base) <= 1.0)}")
        kv8 = by.get(("kv8", "rtn"))
        if kv8:
            out.append(f"- KV8 within 0.5% of baseline: {pct(kv8, base):+.2f}%: {verdict(pct(kv8, base) <= 0.5)}")
        rtn, qoq = by.get(("w4a8-g64-kv4", "rtn")), by.get(("w4a8-g64-kv4", "qoq"))
        if rtn and qoq:
            rec = (rtn - qoq) / (rtn - base) if rtn > base else float("nan")
            out.append(f"- QoQ W4A8KV4 recovers >= half the RTN gap: recovered {100 * rec:.0f}% "
                       f"(RTN {rtn:.4f}, QoQ {qoq:.4f}, baseline {base:.4f}): {verdict(rec >= 0.5)}")
    return out


if __name__ == "__main__":
    main()

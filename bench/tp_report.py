#!/usr/bin/env python3
"""Report of the tensor-parallel runs (scripts/gpu-tp-run.sh OUT b1 offline): TP=2 against TP=1
on the Llama-3-8B shape, from the `bench throughput --profile` JSON of each. Prints the markdown
tables (output tokens/s; device time of a decode step by batch size, and the ratio) and draws the
decode step times and ratios (tp.png).

    python3 bench/tp_report.py DIR [OUT.png]
"""
import json
import sys
from pathlib import Path

GOAL_STEP, GOAL_OFFLINE = 1.6, 1.7  # issue 24: decode step at batch 1, offline throughput


def load(d, name):
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def gpu_name(d):
    """The GPU model from the run's device.txt (`0, NVIDIA H200, ...`), e.g. `H200`."""
    p = d / "device.txt"
    for line in (p.read_text().splitlines() if p.exists() else []):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 2 and parts[0] == "0":
            return parts[1].replace("NVIDIA ", "").split()[0]
    return "GPU"


def period(step):
    """A decode step's period: the host's launch and sampling, then its wait for the tokens
    (the engine's `device_ms`). The wait alone understates a step whose host part is long (NCCL's
    launches in a graph): the GPU runs the step during both."""
    return step["device_ms"] + step["host_ms"]


def main():
    d = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else d / "tp.png"
    rows = []
    print("| run | TP=1 output tok/s | TP=2 output tok/s | ratio | goal |")
    print("|---|---|---|---|---|")
    for name, goal in [("b1", GOAL_STEP), ("offline", GOAL_OFFLINE)]:
        one, two = load(d, f"{name}-tp1"), load(d, f"{name}-tp2")
        if not (one and two):
            continue
        r = two["output_tok_s"] / one["output_tok_s"]
        print(f"| {name} ({one['requests']} requests, {one['max_num_seqs']} seqs) | "
              f"{one['output_tok_s']:,.0f} | {two['output_tok_s']:,.0f} | {r:.2f}x | {goal}x |")
    # TP=2's levers one by one: the decode step at batch 1 and offline tokens/s of each variant.
    variants = [("", "peer sum + split head + symmetric window (default)"),
                ("-r2", "the same, second run"),
                ("-nopeer", "without the peer sum (split head + window)"),
                ("-nopeer-r2", "without the peer sum, second run"),
                ("-nowindow", "split head only"),
                ("-base", "neither (the 2026-11-25 configuration)"), ("-ll", "default + NCCL_PROTO=LL")]
    one = load(d, "b1-tp1")
    if one and any(load(d, f"b1-tp2{v}") for v, _ in variants):
        step1 = period(one["steps"]["decode"][0])
        print(f"\nTP=2 variants, decode step at batch 1 (host launch + wait for its tokens; TP=1: "
              f"{step1:.2f} ms) and offline tok/s:\n")
        print("| TP=2 variant | batch-1 step ms | vs TP=1 | offline output tok/s | vs TP=1 |")
        print("|---|---|---|---|---|")
        off1 = load(d, "offline-tp1")
        for v, what in variants:
            b, o = load(d, f"b1-tp2{v}"), load(d, f"offline-tp2{v}")
            if not (b or o):
                continue
            cells = ["-", "-", "-", "-"]
            if b:
                ms = period(b["steps"]["decode"][0])
                cells[0:2] = [f"{ms:.2f}", f"{step1 / ms:.2f}x"]
            if o:
                cells[2] = f"{o['output_tok_s']:,.0f}"
                if off1:
                    cells[3] = f"{o['output_tok_s'] / off1['output_tok_s']:.2f}x"
            print(f"| {what} | " + " | ".join(cells) + " |")
    one, two = load(d, "offline-tp1"), load(d, "offline-tp2")
    if one and two:
        print("\nDecode-only steps of the offline run, device time per step (ms):\n")
        print("| sequences | steps | TP=1 | TP=2 | TP=1 / TP=2 | TP=2 host ms |")
        print("|---|---|---|---|---|---|")
        by = {(s["seqs_from"], s["seqs_to"]): s for s in two["steps"]["decode"]}
        for s in one["steps"]["decode"]:
            t = by.get((s["seqs_from"], s["seqs_to"]))
            if not t:
                continue
            r = s["device_ms"] / t["device_ms"]
            rows.append((f"{s['seqs_from']}-{s['seqs_to']}", s["device_ms"], t["device_ms"], r))
            print(f"| {s['seqs_from']}-{s['seqs_to']} | {s['steps']} | {s['device_ms']:.2f} | "
                  f"{t['device_ms']:.2f} | {r:.2f}x | {t['host_ms']:.2f} |")
        m1, m2 = one["steps"]["mixed"], two["steps"]["mixed"]
        print(f"| with prefill | {m1['steps']} | {m1['device_ms']:.2f} | {m2['device_ms']:.2f} | "
              f"{m1['device_ms'] / m2['device_ms']:.2f}x | {m2['host_ms']:.2f} |")
    if not rows:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    gpu = gpu_name(d)
    a.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label=f"TP=1 (one {gpu})")
    a.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label=f"TP=2 (two {gpu}, NVLink)")
    a.set_xticks(list(x), [r[0] for r in rows], rotation=45)
    a.set_xlabel("sequences in the decode step")
    a.set_ylabel("device ms per step")
    a.set_title("Llama-3-8B shape, BF16: decode step")
    a.legend()
    b.plot(list(x), [r[3] for r in rows], "o-", label="TP=1 / TP=2")
    b.axhline(GOAL_STEP, color="gray", ls="--", label=f"goal at batch 1 ({GOAL_STEP}x)")
    b.axhline(2.0, color="lightgray", ls=":", label="two GPUs' bandwidth (2x)")
    b.set_xticks(list(x), [r[0] for r in rows], rotation=45)
    b.set_ylim(1, 2.2)
    b.set_title("speed-up of a decode step")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\n![TP=2 against TP=1]({out.name})")


if __name__ == "__main__":
    main()

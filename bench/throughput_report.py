#!/usr/bin/env python3
"""Tabulates a scripts/gpu-engine-run.sh folder: offline throughput per precision and batch size
(with the host share of step time when profiled), the engine's own decode-step rate, and
`bench serve` latencies per request rate, prefill attention against PyTorch's flash SDPA; draws
OUTDIR/throughput.png (output tokens/s against sequences per precision, and TTFT/TPOT against
request rate) and OUTDIR/prefill.png (prefill attention TFLOP/s against tokens).
    python3 bench/throughput_report.py OUTDIR > report.md"""
import json
import sys
from pathlib import Path


def load(path):
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def precision(model):
    return model.split(":")[1].split(" ")[0] if ":" in model else "bf16"


def is_long(run):
    """A run of gpu-engine-run.sh's kv-long part (4k-token prompts), not of ShareGPT."""
    return run["run"].startswith("long-")


def kv_long_table(runs):
    """The kv-long part's goal (issue 19): each long-* run against long-bf16-kv16 at the same
    sequence count, output tokens/s and KV pool tokens."""
    base = {r["max_num_seqs"]: r for r in runs if r["run"] == "long-bf16-kv16"}
    others = [r for r in runs if is_long(r) and r["run"] != "long-bf16-kv16"]
    if not base or not others:
        return
    print("| run | seqs | output tok/s | vs bf16-kv16 | KV pool tokens | vs bf16-kv16 |")
    print("|---|---|---|---|---|---|")
    for r in others:
        b = base.get(r["max_num_seqs"])
        if b is None:
            continue
        print(f"| {r['run']} | {r['max_num_seqs']} | {r['output_tok_s']:.1f} | "
              f"{r['output_tok_s'] / b['output_tok_s']:.2f}x | {r['kv_cache_tokens']} | "
              f"{r['kv_cache_tokens'] / b['kv_cache_tokens']:.2f}x |")
    print()


def main():
    out = Path(sys.argv[1])
    print((out / "device.txt").read_text() if (out / "device.txt").exists() else "")
    runs = []
    for p in sorted(out.glob("*.json")):
        if p.name.startswith(("throughput", "profile", "long-")):
            for r in load(p):
                r["run"] = p.stem
                runs.append(r)
    if runs:
        print("| run | precision | seqs | prompts | prompt tok | output tok | s | output tok/s | "
              "total tok/s | host share | GPU idle (device clock) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            share = r.get("steps", {}).get("host_share")
            idle = r.get("steps", {}).get("device_idle_share")
            print(f"| {r['run']} | {precision(r['model'])} | {r['max_num_seqs']} | {r['requests']} | "
                  f"{r['prompt_tokens']} | {r['output_tokens']} | {r['elapsed_s']:.1f} | "
                  f"{r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | "
                  f"{'' if share is None else f'{share * 100:.1f}%'} | "
                  f"{'' if idle is None else f'{idle * 100:.1f}%'} |")
        print()
        print("Decode-only steps (profiled runs): mean host and device ms per step by batch size")
        print()
        print("| run | seqs | batch sizes | steps | host ms | device ms | tok/s of device time |")
        print("|---|---|---|---|---|---|---|")
        for r in runs:
            for d in r.get("steps", {}).get("decode", []):
                print(f"| {r['run']} | {r['max_num_seqs']} | {d['seqs_from']}-{d['seqs_to']} | "
                      f"{d['steps']} | {d['host_ms']:.3f} | {d['device_ms']:.3f} | "
                      f"{d['device_tok_s']:.0f} |")
        print()
        kv_long_table(runs)
    steps = out / "decode-steps.json"
    if steps.exists():
        print("| decode step (bf16) | batch | ctx | ms | tok/s |")
        print("|---|---|---|---|---|")
        for s in json.loads(steps.read_text())["decode_steps"]:
            if "ms" in s:
                print(f"| | {s['batch']} | {s['ctx']} | {s['ms']:.2f} | {s['tokens_per_s']:.0f} |")
        print()
    serves = []
    for p in sorted(out.glob("serve-*.json")):
        s = json.loads(p.read_text())
        s["rate"] = p.stem.split("-", 1)[1]
        serves.append(s)
    if serves:
        keys = ["ttft", "tpot", "itl"]
        print("| request rate | req/s | output tok/s | " +
              " | ".join(f"{k.upper()} p50 / p99 ms" for k in keys) + " |")
        print("|---|---|---|" + "---|" * len(keys))
        for s in serves:
            cells = []
            for k in keys:
                m = s.get(f"{k}_ms", {})
                cells.append(f"{m.get('p50', float('nan')):.1f} / {m.get('p99', float('nan')):.1f}")
            print(f"| {s['rate']} | {s.get('request_throughput', 0):.2f} | "
                  f"{s.get('output_throughput', 0):.0f} | " + " | ".join(cells) + " |")
    prefill = prefill_table(out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)", file=sys.stderr)
        return
    if prefill:
        prefill_plot(plt, out, prefill)
    if not runs and not serves:
        return
    fig, axes = plt.subplots(1, 2 if serves else 1, figsize=(11 if serves else 6, 4))
    axes = axes if serves else [axes]
    by = {}
    long_runs = [r for r in runs if is_long(r)]
    for r in runs:
        if r["requests"] >= 500 and not is_long(r):
            label = precision(r["model"]) + (" lockstep" if "lockstep" in r["run"] else "")
            by.setdefault(label, []).append((r["max_num_seqs"], r["output_tok_s"]))
    title = "offline ShareGPT throughput"
    if not by and long_runs:  # the kv-long part: one line per precision and KV format
        for r in long_runs:
            by.setdefault(r["run"].removeprefix("long-"), []).append((r["max_num_seqs"], r["output_tok_s"]))
        title = "offline, 4k-token prompts, 512-token outputs"
    for name, pts in sorted(by.items()):
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    axes[0].set_xlabel("max sequences")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title(title)
    axes[0].legend()
    if serves:
        finite = [s for s in serves if s["rate"] != "inf"]
        xs = [float(s["rate"]) for s in finite]
        for k in ["ttft", "tpot"]:
            axes[1].plot(xs, [s.get(f"{k}_ms", {}).get("p50", 0) for s in finite], "o-",
                         label=f"{k.upper()} p50")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("request rate (req/s)")
        axes[1].set_ylabel("ms")
        axes[1].set_title("nibble serve, bf16")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


def prefill_table(out):
    """Prefill attention rows per kernel (nibble's tiers, PyTorch), printed as a table."""
    ours, peer = out / "prefill-attention.json", out / "prefill-peer.json"
    if not ours.exists():
        return None
    rows = json.loads(ours.read_text())["prefill_attention"]
    torch = {r["ctx"]: r for r in json.loads(peer.read_text())["prefill_attention"]} if peer.exists() else {}
    series = {}
    print("\nPrefill attention, one Llama-3-8B layer (32 heads, 8 KV heads, head_dim 128), causal, "
          "batch 1:\n")
    print("| tokens | nibble wgmma ms | TFLOP/s | nibble mma.sync ms | TFLOP/s | PyTorch flash ms | "
          "TFLOP/s | wgmma speedup over PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in sorted({r["ctx"] for r in rows}):
        by = {r["tier"]: r for r in rows if r["ctx"] == ctx}
        w, m, t = by.get("Auto"), by.get("MmaSync"), torch.get(ctx)
        for name, r in [("nibble wgmma", w), ("nibble mma.sync", m), ("PyTorch flash SDPA", t)]:
            if r:
                series.setdefault(name, []).append((ctx, r["tflops"]))
        cell = lambda r: f"{r['ms']:.3f} | {r['tflops']:.0f}" if r else " | "
        speed = f"{t['ms'] / w['ms']:.2f}x" if (w and t) else ""
        print(f"| {ctx} | {cell(w)} | {cell(m)} | {cell(t)} | {speed} |")
    print()
    return series


def prefill_plot(plt, out, series):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TFLOP/s (causal)")
    ax.set_title("prefill attention, Llama-3-8B layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prefill.png", dpi=120)


if __name__ == "__main__":
    main()

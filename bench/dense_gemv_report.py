"""The dense decode gemv against cuBLAS on one GPU (`gpu-bench OUT.json --dense-gemv`): a
markdown table and a bar plot of the one-token times with the copy-time floor.

    python3 bench/dense_gemv_report.py RESULTS.json [OUT.png]
"""
import json
import sys


def main():
    path = sys.argv[1]
    report = json.load(open(path))
    bw = report["hbm_bytes_per_s"]
    rows = report["dense_gemv"]
    print(f"device: {report['device']}, copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print("| layer | N x K | M | cuBLAS us | dense gemv us | b16_gdec us | dense / HBM | vs cuBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r.get("dense_us")
        if d is None:
            continue
        print(f"| {r['layer']} | {r['n']} x {r['k']} | {r['tokens']} | {r['cublas_us']:.1f} | {d:.1f} | "
              f"{r.get('gemv_us') or 0:.1f} | {r['dense_hbm_share'] * 100:.0f}% | {r['cublas_us'] / d:.2f}x |")
    if len(sys.argv) < 3:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    one = [r for r in rows if r["tokens"] == 1 and r.get("dense_us")]
    names = [r["layer"] for r in one]
    x = range(len(one))
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.27
    ax.bar([i - w for i in x], [r["cublas_us"] for r in one], w, label="cuBLAS BF16")
    ax.bar(list(x), [r["dense_us"] for r in one], w, label="nibble dense gemv")
    ax.bar([i + w for i in x], [r["weight_bytes"] / bw * 1e6 for r in one], w, label="copy-time floor",
           color="lightgray")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("µs (one token)")
    ax.set_title(f"Llama-3-8B layers, whole and as one of two TP ranks holds them\n{report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()

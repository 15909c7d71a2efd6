#!/usr/bin/env python3
"""The peer side of the GPU benchmarks (scripts/gpu-run.sh runs it beside nibble's gpu-bench):
HBM bandwidth and cuBLAS BF16 rate through PyTorch, and PyTorch's scaled_dot_product_attention
(flash backend) on the same Llama-3-8B attention shapes nibble's kernels are timed on: decode
(one query per sequence over a contiguous KV cache) and causal prefill.

    python3 bench/gpu_peer.py OUT.json
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

HEADS, KV_HEADS, HD = 32, 8, 128


def ms(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def ms_graph(fn):
    # Replayed from a CUDA graph, as nibble times its attention (and as a decode step runs).
    try:
        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    except TypeError:  # an older triton without return_mode
        return do_bench_cudagraph(fn, rep=200)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-peer.json"
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    b = torch.empty_like(a)
    t = ms(lambda: b.copy_(a))
    res["hbm_bytes_per_s"] = 2 * n / (t / 1e3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    t = ms(lambda: x @ y)
    res["cublas_bf16_flops"] = 2 * m**3 / (t / 1e3)
    del x, y
    rows = []
    for batch, ctx in [(1, 1024), (1, 4096), (8, 4096), (32, 4096), (64, 1024), (64, 4096)]:
        q = torch.randn(batch, HEADS, 1, HD, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, KV_HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = ms_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        kv_bytes = 2 * k.numel() * 2
        rows.append({"kind": "decode", "batch": batch, "ctx": ctx, "ms": t,
                     "bandwidth_fraction": kv_bytes / (t / 1e3) / res["hbm_bytes_per_s"]})
        print(rows[-1], flush=True)
    for ctx in [1024, 4096]:
        q = torch.randn(1, HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        flops = 4 * ctx * ctx / 2 * HEADS * HD
        rows.append({"kind": "prefill", "batch": 1, "ctx": ctx, "ms": t, "tflops": flops / (t / 1e3) / 1e12})
        print(rows[-1], flush=True)
    res["attention"] = rows
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

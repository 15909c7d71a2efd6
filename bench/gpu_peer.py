#!/usr/bin/env python3
"""The peer side of the GPU benchmarks (scripts/gpu-run.sh runs it beside nibble's gpu-bench):
HBM bandwidth and cuBLAS BF16 rate through PyTorch, and PyTorch's scaled_dot_product_attention
(flash backend) on the same Llama-3-8B attention shapes nibble's kernels are timed on: decode
(one query per sequence over a contiguous KV cache) and causal prefill; and PyTorch's quantized
matmuls on Llama-3-8B's layer shapes (`--qgemm`: the ceilings and those alone): BF16 (cuBLAS),
INT4 weight-only (`_weight_int4pack_mm`, group 128), INT8 (`_int_mm`) and FP8 (`_scaled_mm`,
row-wise scales), each timed from a CUDA graph like nibble's, cycling through enough copies of
its weight that every call reads it from HBM.

    python3 bench/gpu_peer.py OUT.json [--qgemm [--ms=256,1024]] [--kv-attention] [--prefill-attention]

`--ms=` limits the quantized matmuls to those token counts (the whole set once ran past a device
call's limit beside an A/B).
"""
import itertools
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


def prefill_rows(dev, ctxs):
    """Causal prefill attention of one Llama-3-8B layer, batch 1, by flash SDPA."""
    rows = []
    for ctx in ctxs:
        q = torch.randn(1, HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        flops = 4 * ctx * ctx / 2 * HEADS * HD
        rows.append({"kind": "prefill", "batch": 1, "ctx": ctx, "ms": t, "tflops": flops / (t / 1e3) / 1e12})
        print(rows[-1], flush=True)
    return rows


QGEMM_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
QGEMM_MS = [1, 4, 16, 64, 256, 1024, 8192]


def cold_copies(dev, make, nbytes):
    """Copies of a weight, enough to fill twice the L2 cache, and a function that returns the
    next one on each call: every call of a benchmark reads its weight from HBM, as a decode step
    does, and as gpu_bench times nibble's kernels."""
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = [make() for _ in range(max(1, -(-2 * l2 // nbytes)))]
    it = itertools.cycle(copies)
    return lambda: next(it), len(copies)


def qgemm_peers(dev, ms_list):
    rows = []
    for n, k in QGEMM_SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        wn, w_copies = cold_copies(dev, lambda: w.clone(), n * k * 2)
        # INT4 weight-only: uint8 [n, k/2] codes, packed by PyTorch for its kernel.
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        try:
            w4 = torch._convert_weight_to_int4pack(codes, 8)
            w4n, w4_copies = cold_copies(dev, lambda: w4.clone(), n * k // 2)
            sz = torch.stack([torch.full((k // 128, n), 0.01), torch.zeros(k // 128, n)], dim=2)
            sz = sz.to(dev, torch.bfloat16).contiguous()
            int4_err = None
        except Exception as e:  # noqa: BLE001 (recorded in the results)
            w4n, w4_copies, sz, int4_err = None, 0, None, repr(e)
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
        w8n, w8_copies = cold_copies(dev, lambda: w8.clone(), n * k)
        wf8 = w.to(torch.float8_e4m3fn)
        wf8n, _ = cold_copies(dev, lambda: wf8.clone(), n * k)
        sw = torch.full((1, n), 0.01, device=dev, dtype=torch.float32)
        for m in ms_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            r = {"n": n, "k": k, "m": m, "weight_copies": [w_copies, w4_copies, w8_copies]}
            r["bf16_ms"] = ms_graph(lambda: x @ wn().t())
            if m > 256:
                # PyTorch's int4 kernel is a decode kernel (64 ms at m 8192 on 28672x4096): it
                # is no peer there, and timing it took most of a device call.
                r["int4_error"] = "skipped above m 256"
            elif w4n is not None:
                try:
                    r["int4_ms"] = ms_graph(lambda: torch._weight_int4pack_mm(x, w4n(), 128, sz))
                except Exception as e:  # noqa: BLE001
                    r["int4_error"] = repr(e)
            else:
                r["int4_error"] = int4_err
            x8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
            try:
                r["int8_ms"] = ms_graph(lambda: torch._int_mm(x8, w8n().t()))
            except Exception as e:  # noqa: BLE001 (_int_mm needs m > 16)
                r["int8_error"] = repr(e).splitlines()[0][:200]
            xf8 = x.to(torch.float8_e4m3fn)
            sx = torch.full((m, 1), 0.01, device=dev, dtype=torch.float32)
            try:
                r["fp8_ms"] = ms_graph(
                    lambda: torch._scaled_mm(xf8, wf8n().t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
            except Exception as e:  # noqa: BLE001
                r["fp8_error"] = repr(e).splitlines()[0][:200]
            rows.append(r)
            print(r, flush=True)
    return rows


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
    if "--prefill-attention" in sys.argv:
        # Causal prefill attention of one Llama-3-8B layer, as gpu-bench --prefill-attention.
        res["prefill_attention"] = prefill_rows(dev, [1024, 2048, 4096, 8192, 16384])
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        return
    if "--kv-attention" in sys.argv:
        # Decode attention of one Llama-3-8B layer, as gpu-bench --kv-attention: flash SDPA over
        # a contiguous bf16 cache, and over an FP8 (e4m3, per-tensor scale) cache that PyTorch
        # must dequantize to bf16 first (SDPA has no FP8 KV input). FlashInfer's paged FP8
        # decode would be the sharper peer; its wheel (62 MB) does not fit a device call.
        rows = []
        for batch, ctx in [(64, 4096), (8, 32768)]:
            q = torch.randn(batch, HEADS, 1, HD, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, KV_HEADS, ctx, HD, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                t16 = ms_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                t8 = ms_graph(lambda: F.scaled_dot_product_attention(
                    q, k8.to(torch.bfloat16) * 0.5, v8.to(torch.bfloat16) * 0.5, enable_gqa=True))
            for kv, t, elem in [("bf16", t16, 2), ("fp8-dequantized", t8, 1)]:
                kv_bytes = 2 * k.numel() * elem
                rows.append({"kind": "decode", "peer": "torch-sdpa-flash", "kv": kv, "batch": batch,
                             "ctx": ctx, "ms": t,
                             "bandwidth_fraction": kv_bytes / (t / 1e3) / res["hbm_bytes_per_s"]})
                print(rows[-1], flush=True)
            del q, k, v, k8, v8
        res["kv_attention"] = rows
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        return
    if "--qgemm" in sys.argv:
        given = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--ms=")]
        ms_list = [int(v) for v in given[-1].split(",")] if given else QGEMM_MS
        res["qgemm"] = qgemm_peers(dev, ms_list)
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        return
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
    rows += prefill_rows(dev, [1024, 4096])
    res["attention"] = rows
    res["qgemm"] = qgemm_peers(dev)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

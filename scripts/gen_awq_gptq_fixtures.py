#!/usr/bin/env python3
"""Tiny AutoAWQ (GEMM) and GPTQ layers for nibble's loader tests.

Each fixture directory under crates/nibble-model/tests/fixtures/awq-gptq/ holds:

* config.json (or, for the old GPTQ layout, quantize_config.json) with the quantization config,
* model.safetensors: the packed layers, written with the packing loops of AutoAWQ
  (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear) and AutoGPTQ
  (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, QuantLinear.pack), numpy only,
* expected.safetensors: each layer's `<prefix>.weight` as float32 [out, in], computed by the
  *unpacking* paths of those projects (AutoAWQ's unpack_awq + reverse_awq_order +
  dequantize_gemm; AutoGPTQ's torch fallback in forward, with g_idx as in qlinear_cuda), with
  the final product taken exactly (float64, then float32) instead of in float16,
* expect.json: the nibble format each layer should load as ("int4-gN/a16" or "F32").

The packing and unpacking are reimplemented here independently of nibble's Rust code, so the
Rust test checks nibble's unpacking against a second implementation of the published layouts.
Deterministic; run from the repository root: python3 scripts/gen_awq_gptq_fixtures.py
"""

import json
import os

import numpy as np
from safetensors.numpy import save_file

OUT = "crates/nibble-model/tests/fixtures/awq-gptq"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def f16_scales(rng, groups, out):
    # Positive and negative, several binades, all exactly f16.
    s = rng.uniform(0.001, 0.05, size=(groups, out)) * rng.choice([-1.0, 1.0], size=(groups, out))
    return s.astype(np.float16)


# ---------------------------------------------------------------- AutoAWQ GEMM


def awq_pack(intweight_out_in, zeros_g_out):
    """WQLinear_GEMM.from_linear's packing: intweight is [out, in], zeros [G, out]."""
    intweight = intweight_out_in.T.astype(np.uint32)  # [in, out]
    pack_num = 8
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight[:, col] |= intweight[:, col * pack_num + AWQ_ORDER[i]] << (i * 4)
    zeros = zeros_g_out.astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzeros[:, col] |= zeros[:, col * pack_num + AWQ_ORDER[i]] << (i * 4)
    return qweight.view(np.int32), qzeros.view(np.int32)


def awq_dequant(qweight, qzeros, scales, group):
    """unpack_awq + reverse_awq_order + dequantize_gemm, returned as [out, in]."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    iw = (qweight.view(np.uint32)[:, :, None] >> shifts[None, None, :]).reshape(qweight.shape[0], -1)
    iz = (qzeros.view(np.uint32)[:, :, None] >> shifts[None, None, :]).reshape(qzeros.shape[0], -1)
    rev = np.arange(iz.shape[-1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    iw = (iw[:, rev] & 15).astype(np.int64)
    iz = (iz[:, rev] & 15).astype(np.int64)
    s = np.repeat(scales.astype(np.float64), group, axis=0)
    iz = np.repeat(iz, group, axis=0)
    return ((iw - iz) * s).astype(np.float32).T


# ---------------------------------------------------------------- GPTQ


def gptq_pack(intweight_out_in, zeros_g_out, v1):
    """QuantLinear.pack (qlinear_cuda_old), 4 bits. v1 stores zeros - 1 through uint32, so a zero
    of 0 becomes 0xFFFFFFFF and its OR spills into the higher nibbles of its word, as the
    original does."""
    intweight = intweight_out_in.T.astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i = 0
    row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = zeros_g_out.astype(np.int64)
    if v1:
        zeros = zeros - 1
    zeros = zeros.astype(np.uint32)  # -1 wraps, as numpy's astype does in AutoGPTQ
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << np.uint32(4 * (j - i))
        i += 8
        col += 1
    return qweight.view(np.int32), qzeros.view(np.int32)


def gptq_dequant(qweight, qzeros, scales, g_idx, v1):
    """The torch fallback of AutoGPTQ's forward: unpack, zeros (+1 for v1), then
    scales[g_idx] * (weight - zeros[g_idx]); returned as [out, in]."""
    wf = np.arange(0, 32, 4, dtype=np.uint32)
    z = (qzeros.view(np.uint32)[:, :, None] >> wf[None, None, :]) & 15
    z = z.reshape(z.shape[0], -1).astype(np.int64) + (1 if v1 else 0)  # [G, out]
    w = (qweight.view(np.uint32)[:, None, :] >> wf[None, :, None]) & 15
    w = w.reshape(-1, w.shape[2]).astype(np.int64)  # [in, out]
    g = g_idx.astype(np.int64)
    out = (w - z[g]) * scales.astype(np.float64)[g]
    return out.astype(np.float32).T


# ---------------------------------------------------------------- fixtures


def write(name, qc, tensors, expected, expect, qc_file="config.json"):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    for stale in ["config.json", "quantize_config.json"]:
        p = os.path.join(d, stale)
        if os.path.exists(p):
            os.remove(p)
    body = {"quantization_config": qc} if qc_file == "config.json" else qc
    with open(os.path.join(d, qc_file), "w") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
    # safetensors.numpy writes an array's memory as is: transposed views must be made C-ordered.
    c_order = lambda ts: {k: np.ascontiguousarray(v) for k, v in ts.items()}
    save_file(c_order(tensors), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    save_file(c_order(expected), os.path.join(d, "expected.safetensors"))
    with open(os.path.join(d, "expect.json"), "w") as f:
        json.dump(expect, f, indent=2, sort_keys=True)
        f.write("\n")


def awq_fixture(rng):
    tensors, expected, expect = {}, {}, {}
    group = 32
    for prefix, (out, inp) in {
        "model.layers.0.self_attn.q_proj": (64, 128),
        "model.layers.0.mlp.down_proj": (32, 96),
    }.items():
        groups = inp // group
        codes = rng.integers(0, 16, size=(out, inp))
        zeros = rng.integers(0, 16, size=(groups, out))
        scales = f16_scales(rng, groups, out)
        qw, qz = awq_pack(codes, zeros)
        tensors[f"{prefix}.qweight"] = qw
        tensors[f"{prefix}.qzeros"] = qz
        tensors[f"{prefix}.scales"] = scales
        expected[f"{prefix}.weight"] = awq_dequant(qw, qz, scales, group)
        # Independently of any packing: (q - z) * s from the drawn integers.
        direct = (codes - np.repeat(zeros, group, axis=0).T) * np.repeat(
            scales.astype(np.float64), group, axis=0).T
        assert np.array_equal(expected[f"{prefix}.weight"], direct.astype(np.float32))
        expect[prefix] = f"int4-g{group}/a16"
    tensors["model.layers.0.self_attn.q_proj.bias"] = rng.standard_normal(64).astype(np.float16)
    tensors["model.norm.weight"] = rng.standard_normal(64).astype(np.float16)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
          "version": "gemm"}
    write("awq-gemm-g32", qc, tensors, expected, expect)


def gptq_layer(rng, out, inp, group, zero_lo, act_order):
    groups = -(-inp // group)
    codes = rng.integers(0, 16, size=(out, inp))
    zeros = rng.integers(zero_lo, 16, size=(groups, out))
    scales = f16_scales(rng, groups, out)
    if act_order:
        # desc_act: groups follow the column order GPTQ quantized in, a permutation.
        perm = rng.permutation(inp)
        g_idx = np.empty(inp, dtype=np.int32)
        g_idx[perm] = np.arange(inp) // group
    else:
        g_idx = (np.arange(inp) // group).astype(np.int32)
    return codes, zeros, scales, g_idx


def gptq_fixture(rng, name, v1, act_order, group, layers, qc_file="config.json",
                 zero_lo=1, expect_format=None):
    tensors, expected, expect = {}, {}, {}
    for prefix, (out, inp) in layers.items():
        codes, zeros, scales, g_idx = gptq_layer(rng, out, inp, group, zero_lo, act_order)
        qw, qz = gptq_pack(codes, zeros, v1)
        tensors[f"{prefix}.qweight"] = qw
        tensors[f"{prefix}.qzeros"] = qz
        tensors[f"{prefix}.scales"] = scales
        tensors[f"{prefix}.g_idx"] = g_idx
        expected[f"{prefix}.weight"] = gptq_dequant(qw, qz, scales, g_idx, v1)
        if zero_lo >= 1 or not v1:
            direct = (codes - zeros[g_idx].T) * scales.astype(np.float64)[g_idx].T
            assert np.array_equal(expected[f"{prefix}.weight"], direct.astype(np.float32))
        expect[prefix] = expect_format or f"int4-g{group}/a16"
    tensors["model.embed_tokens.weight"] = rng.standard_normal((16, 8)).astype(np.float16)
    qc = {"bits": 4, "group_size": group, "desc_act": act_order, "sym": False}
    if qc_file == "config.json":
        qc["quant_method"] = "gptq"
        qc["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
    write(name, qc, tensors, expected, expect, qc_file)


def main():
    rng = np.random.default_rng(20250607)
    awq_fixture(rng)
    layers = {"model.layers.0.self_attn.k_proj": (32, 128), "model.layers.1.mlp.up_proj": (48, 64)}
    # Old layout: quantize_config.json, v1 zeros (1..=15 so none overflows).
    gptq_fixture(rng, "gptq-v1-g64", v1=True, act_order=False, group=64, layers=layers,
                 qc_file="quantize_config.json")
    # v1 with true zeros of 0: packed as 0xFFFFFFFF, so readers see 16 (and spilled nibbles);
    # nibble follows the readers, exactly, in f32.
    gptq_fixture(rng, "gptq-v1-overflow", v1=True, act_order=False, group=32, layers=layers,
                 zero_lo=0, expect_format="F32")
    gptq_fixture(rng, "gptq-v2-g32", v1=False, act_order=False, group=32, layers=layers,
                 zero_lo=0)
    gptq_fixture(rng, "gptq-v2-act-order", v1=False, act_order=True, group=32, layers=layers,
                 zero_lo=0, expect_format="F32")


if __name__ == "__main__":
    main()

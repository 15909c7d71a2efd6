#!/usr/bin/env python3
"""Writes the ggml dequantization fixtures used by crates/nibble-formats/src/gguf/dequant.rs tests.

For every ggml type nibble reads, writes into crates/nibble-formats/tests/fixtures/ggml/:
  <type>.bin  raw ggml block bytes (little-endian, exactly as stored in a GGUF tensor)
  <type>.f32  the reference dequantization of those bytes as little-endian f32

The reference is the python `gguf` package (gguf-py, maintained alongside llama.cpp), an
implementation independent of nibble's. Types it can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0) are quantized from seeded random rows that include outliers, zero blocks, all-negative
blocks, tiny and huge values. K-quants (Q4_K, Q5_K, Q6_K) cannot be quantized by gguf-py, so their
blocks are seeded random bytes with chosen finite f16 super-block scales, dequantized by gguf-py.

Usage: python3 scripts/gen_ggml_fixtures.py   (deterministic; rerunning rewrites identical files)
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parent.parent / "crates/nibble-formats/tests/fixtures/ggml"
SEED = 0x6E6962  # "nib"

FLOAT_TYPES = [T.F32, T.F16, T.BF16]
SMALL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # 32-element blocks
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]  # 256-element super-blocks


def small_block_rows(rng: np.random.Generator) -> np.ndarray:
    """Eight 32-element blocks, each exercising a different situation."""
    b = np.empty((8, 32), dtype=np.float32)
    b[0] = rng.standard_normal(32)  # plain gaussian
    b[1] = rng.standard_normal(32)
    b[1, 5] = 40.0  # one positive outlier: everything else lands in few levels
    b[2] = 0.0  # all zeros: d == 0
    b[3] = -np.abs(rng.standard_normal(32)) * 3.0  # all negative
    b[4] = rng.standard_normal(32) * 1e-3  # tiny values, scale near f16 subnormal range
    b[5] = rng.uniform(-1.0, 1.0, 32)
    b[5, 17] = -1000.0  # huge negative outlier
    b[6] = 0.5  # constant: Q4_1/Q5_1 have d == 0, m == 0.5
    b[7] = rng.standard_normal(32) * 100.0
    b[7, 31] = 2000.0
    return b.reshape(1, 256)


def float_rows(rng: np.random.Generator) -> np.ndarray:
    """256 floats: the block rows above plus special values (NaN is left out: its payload
    handling is not something the fixtures should pin down)."""
    x = small_block_rows(rng).reshape(-1).copy()
    specials = [np.inf, -np.inf, -0.0, 1e-6, -6e-8, 1e-40, 65504.0, -65520.0, 1e30, 3.0e38, -1.0e-45]
    x[: len(specials)] = np.array(specials, dtype=np.float32)
    return x.reshape(1, 256)


def k_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    """Four random but valid super-blocks with chosen finite f16 scales."""
    n_blocks = 4
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    raw[2] = 0  # an all-zero block
    # (d, dmin) per block; block 2 stays all zero.
    scales = [(0.0123, 0.0071), (-0.5, 2.25), (0.0, 0.0), (65504.0, -3.0e-5)]
    for i, (d, dmin) in enumerate(scales):
        if i == 2:
            continue
        d16 = np.array([d], dtype=np.float16).view(np.uint8)
        if qtype == T.Q6_K:
            raw[i, 208:210] = d16  # Q6_K: ql[128] qh[64] scales[16] d
        else:
            raw[i, 0:2] = d16  # Q4_K/Q5_K: d dmin scales[12] ...
            raw[i, 2:4] = np.array([dmin], dtype=np.float16).view(np.uint8)
    return raw.reshape(1, -1)


def main() -> None:
    rng = np.random.default_rng(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    for qtype in FLOAT_TYPES + SMALL_TYPES + K_TYPES:
        if qtype in K_TYPES:
            raw = k_blocks(rng, qtype)
        else:
            rows = float_rows(rng) if qtype in FLOAT_TYPES else small_block_rows(rng)
            with np.errstate(over="ignore"):  # 1e30 and 3e38 become +inf in F16, on purpose
                raw = quants.quantize(rows, qtype)
            raw = np.ascontiguousarray(raw).view(np.uint8)
        expected = quants.dequantize(raw if qtype != T.F32 else raw.view(np.float32), qtype)
        expected = np.asarray(expected, dtype=np.float32).reshape(-1)
        assert not np.isnan(expected).any(), qtype.name
        name = qtype.name.lower()
        (OUT / f"{name}.bin").write_bytes(raw.astype(np.uint8).tobytes())
        (OUT / f"{name}.f32").write_bytes(expected.astype("<f4").tobytes())
        print(f"{name}: {raw.size} bytes -> {expected.size} f32")


if __name__ == "__main__":
    main()

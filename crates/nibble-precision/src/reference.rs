//! The reference arithmetic of every quantized linear format: `y = x · Wᵀ` computed exactly the
//! way the kernels compute it, written as plain scalar loops. The CPU backend matches it bit for
//! bit; GPU kernels match it bit for bit where noted and within the stated tolerance elsewhere.
//!
//! Activations are quantized per row by the rules of [`crate::act`]. Weights come from
//! [`WeightCodec::integer_row`] (integer codecs) or [`WeightCodec::dequantize`]. "fma" below is a
//! fused multiply-add with one rounding (`f32::mul_add`, CUDA `fmaf` or a contracted `a * b + c`).
//!
//! **Integer activations** (`a8`, COMET `a4a8`). The weight integers are INT8 for `int8-pc`,
//! the INT8 that QoQ and LiquidQuant reconstruct, and `q - z` for INT4. Every integer dot is
//! accumulated in i32, which is exact (at most `128 * 127 * K`: any `K <=` [`MAX_INT_K`]), so the
//! summation order of the integer part never matters.
//! - Per-channel weight scale (`int8-pc`, `int4-pc`, `qoq-gN`, `lqq-gN`), INT8 per token:
//!   `y = f32(acc) * (sx * sw)`, where `sx * sw` is one f32 product.
//! - INT4 with groups (`int4-gN`), INT8 per token: per group an i32 partial sum `p_g`, then
//!   `t = fma(f32(p_g), s_g, t)` over the groups in order from `t = 0` (`s_g` the f16 group
//!   scale), then `y = t * sx`.
//! - COMET (`int4-gN` with `a4a8-bN`, block = group): per block `p_b` in i32, `c_b = s_w,b *
//!   sx_b` (one f32 product), `y = fma(f32(p_b), c_b, y)` over the blocks in order from 0.
//!
//! **Float activations.**
//! - 16-bit activations (`int8-pc`, `int4-*` and `fp8-pc` with `a16`): each weight is its
//!   [`WeightCodec::dequantize`] value rounded to f16, each activation is rounded to f16; the
//!   products (exact in f32: two 11-bit significands) are summed in f32 in channel order from 0,
//!   `y = y + w_j * x_j`.
//! - FP8 x FP8 (`fp8-pc` with `afp8`): `acc = acc + w_j * x_j` over the decoded e4m3 codes in
//!   channel order (products exact in f32), then `y = acc * (sx * sw)`.
//!
//! **What a GPU can match exactly.** Activation codes and scales (integer and FP8) are exact by
//! the rules of [`crate::act`]. For the integer formats, every i32 partial sum is exact whatever
//! the tiling; the f32 epilogue is a handful of operations per output (one or two products for
//! per-channel scales, `K / group` fmas in group order otherwise), so a kernel that keeps that
//! order (no split-K over groups) is bit-exact. The float formats sum `K` f32 terms; tensor
//! cores add in another order (and with their own internal rounding), so a GPU result differs by
//! f32 rounding-order error: compare within `K * 2^-23 * sum_j |w_j x_j|` (times the two scales
//! for FP8), with the products themselves exact on both sides.

use half::f16;
use nibble_core::{Error, Result};

use crate::act::{QuantizedRow, fp8_value};
use crate::spec::GROUP_SIZES;
use crate::weight::{ActQuant, LinearFormat, WeightCodec};

/// The largest input size whose integer dots cannot overflow i32 (weights within ±128,
/// activation codes within ±127).
pub const MAX_INT_K: usize = (i32::MAX / (128 * 127)) as usize;

/// `y = x · Wᵀ` (`m x n`, row-major) for `x` (`m x k` f32) and `w`, `n` rows of `format`'s
/// codec, by the arithmetic documented in this module.
pub fn reference_matmul(
    format: LinearFormat,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    n: usize,
) -> Result<Vec<f32>> {
    let format = LinearFormat::new(format.codec, format.act)?;
    let rb = format.row_bytes(k)?;
    if x.len() != m * k || w.len() != n * rb {
        return Err(Error::InvalidArgument(format!(
            "{format}: {} activations and {} weight bytes for m={m} k={k} n={n} \
             (rows of {rb} bytes)",
            x.len(),
            w.len()
        )));
    }
    if k > MAX_INT_K
        && matches!(
            format.act,
            ActQuant::Int8PerToken | ActQuant::Mixed4x8 { .. }
        )
    {
        return Err(Error::InvalidArgument(format!(
            "{format}: {k} input channels overflow the i32 accumulator (at most {MAX_INT_K})"
        )));
    }
    let acts: Vec<QuantizedRow> = x
        .chunks_exact(k)
        .map(|row| format.act.quantize_row(row))
        .collect::<Result<_>>()?;
    let mut y = vec![0f32; m * n];
    let mut ints = vec![0i8; k];
    let mut wscales = Vec::new();
    let mut wvals = vec![0f32; k];
    for (r, wrow) in w.chunks_exact(rb).enumerate() {
        let codec = format.codec;
        let wscale = match (codec, format.act) {
            (WeightCodec::Fp8PerChannel, ActQuant::Fp8PerToken) => fp8_row(wrow, k, &mut wvals),
            (_, ActQuant::F16) => {
                f16_weight_row(codec, wrow, k, &mut wvals)?;
                1.0
            }
            _ => {
                codec.integer_row(wrow, k, &mut ints, &mut wscales);
                1.0
            }
        };
        for (i, a) in acts.iter().enumerate() {
            y[i * n + r] = match a {
                QuantizedRow::F16(xh) => {
                    let mut acc = 0f32;
                    for (w, x) in wvals.iter().zip(xh) {
                        acc += w * x;
                    }
                    acc
                }
                QuantizedRow::Fp8 { codes, scale } => {
                    let mut acc = 0f32;
                    for (w, &c) in wvals.iter().zip(codes) {
                        acc += w * fp8_value(c);
                    }
                    acc * (scale * wscale)
                }
                QuantizedRow::Int {
                    codes,
                    scales,
                    block,
                } => match (codec, format.act) {
                    (WeightCodec::Int4Group { group }, ActQuant::Int8PerToken) if group > 0 => {
                        let g = group as usize;
                        let mut t = 0f32;
                        for (gi, &sw) in wscales.iter().enumerate() {
                            let p = int_dot(&ints[gi * g..(gi + 1) * g], &codes[gi * g..][..g]);
                            t = (p as f32).mul_add(sw, t);
                        }
                        t * scales[0]
                    }
                    (_, ActQuant::Mixed4x8 { .. }) => {
                        let mut t = 0f32;
                        for (bi, (&sw, &sx)) in wscales.iter().zip(scales).enumerate() {
                            let range = bi * block..(bi + 1) * block;
                            let p = int_dot(&ints[range.clone()], &codes[range]);
                            t = (p as f32).mul_add(sw * sx, t);
                        }
                        t
                    }
                    _ => int_dot(&ints, codes) as f32 * (scales[0] * wscales[0]),
                },
            };
        }
    }
    Ok(y)
}

/// Every linear format nibble has kernels for, with each group size of [`GROUP_SIZES`] that
/// divides `k`, and COMET with none, one, half and all of its blocks INT8: the list kernel tests
/// sweep.
pub fn kernel_formats(k: usize) -> Vec<LinearFormat> {
    use ActQuant as A;
    use WeightCodec as C;
    let mut out = vec![
        (C::Int8PerChannel, A::Int8PerToken),
        (C::Int8PerChannel, A::F16),
        (C::Fp8PerChannel, A::Fp8PerToken),
        (C::Fp8PerChannel, A::F16),
        (C::Int4Group { group: 0 }, A::Int8PerToken),
        (C::Int4Group { group: 0 }, A::F16),
    ];
    for g in GROUP_SIZES {
        if !k.is_multiple_of(g as usize) {
            continue;
        }
        let blocks = (k / g as usize) as u16;
        out.extend([
            (C::Int4Group { group: g }, A::Int8PerToken),
            (C::Int4Group { group: g }, A::F16),
            (C::Qoq { group: g }, A::Int8PerToken),
            (C::Lqq { group: g }, A::Int8PerToken),
        ]);
        for int8_blocks in [0, 1, blocks / 2, blocks] {
            let act = A::Mixed4x8 {
                block: g as u16,
                int8_blocks,
            };
            out.push((C::Int4Group { group: g }, act));
        }
    }
    out.into_iter()
        .map(|(c, a)| LinearFormat::new(c, a).unwrap())
        .collect()
}

/// The exact i32 dot of integer weights and integer activation codes.
pub fn int_dot(w: &[i8], x: &[i8]) -> i32 {
    w.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// One `fp8-pc` row: the decoded e4m3 codes into `vals` (`cols` long), and the f32 scale.
pub fn fp8_row(src: &[u8], cols: usize, vals: &mut [f32]) -> f32 {
    for (v, &b) in vals.iter_mut().zip(&src[..cols]) {
        *v = fp8_value(b);
    }
    f32::from_le_bytes(src[cols..cols + 4].try_into().unwrap())
}

/// One row's weights as 16-bit-activation kernels use them: the dequantized value rounded to f16.
pub fn f16_weight_row(codec: WeightCodec, src: &[u8], cols: usize, out: &mut [f32]) -> Result<()> {
    codec.dequantize(src, cols, &mut out[..cols])?;
    for v in &mut out[..cols] {
        *v = f16::from_f32(*v).to_f32();
    }
    Ok(())
}

#[cfg(test)]
#[path = "reference_tests.rs"]
mod tests;

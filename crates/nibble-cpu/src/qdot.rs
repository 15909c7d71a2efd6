//! Fused weight-row · activation-row dot products for small-M matmuls (decode).
//!
//! A decode step multiplies one activation row by every weight row, so the cost is decoding the
//! weights, not the multiply-adds. Two kinds of kernels read the blocks directly, with no
//! intermediate f32 tile:
//!
//! - **Integer kernels** (Q4_0, Q4_1, Q8_0, the formats of the default models). Much as in
//!   llama.cpp, the activation row is quantized once per matmul to blocks of 32 integers with an
//!   f32 scale `dx = amax / 32767` (`a = round_ties_even(x / dx)`, so `|x - dx * a| <= dx / 2`)
//!   and `sx = dx * sum(a)`. A weight block times an activation block is then one integer dot:
//!   - Q8_0 (`w = dw * q`):         `dw * dx * sum(q * a)`
//!   - Q4_0 (`w = dw * (q - 8)`):   `dw * dx * sum((q - 8) * a)`
//!   - Q4_1 (`w = dw * q + mw`):    `dw * dx * sum(q * a) + mw * sx`
//!
//!   The integer sums are exact (|q| <= 128, |a| <= 32767: at most 2^27 over a block); the
//!   per-block products are accumulated in f32. The activations are rounded to 16 bits per block
//!   of 32 (error at most 1/65534 of the block's largest magnitude), which leaves perplexity
//!   unchanged to 4 digits. llama.cpp uses 8 bits (one `maddubs` per block, about 1.2x faster
//!   here), but that raised the default model's perplexity by 1% (9.554 to 9.649), so this uses
//!   i16 lanes and `madd`: still no float conversion of the weights and 32 multiply-adds in two
//!   instructions, about 3x faster than dequantizing to f32 and using FMAs.
//! - **Float kernels** (every other format): each chunk of up to 256 weights is dequantized on
//!   the stack with the exact `WeightFormat::dequantize` and dotted with f32 activations, so the
//!   only difference from the reference is the f32 summation order.
//!
//! With AVX2 (the release build targets x86-64-v3) the integer kernels use `std::arch`; otherwise
//! a portable version with the same arithmetic runs. Both are tested against the f64 reference.

use half::f16;
use nibble_core::Result;
use nibble_formats::WeightFormat;
use nibble_formats::gguf::GgmlType;

use crate::ops::dot;

/// Elements per activation block.
pub const QK: usize = 32;

/// The largest activation magnitude on the integer grid.
pub const QMAX: f32 = 32767.0;

/// 32 activations as `d * qs[i]`, with `s = d * sum(qs)` for the min term of affine formats.
#[derive(Debug, Clone, Copy)]
pub struct QBlock {
    pub d: f32,
    pub s: f32,
    pub qs: [i16; QK],
}

/// How a weight format is dotted with activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Q4_0,
    Q4_1,
    Q8_0,
    /// Dequantize chunks to f32 on the stack.
    Float,
}

impl Kernel {
    pub fn for_format(format: WeightFormat) -> Kernel {
        match format {
            WeightFormat::Ggml(GgmlType::Q4_0) => Kernel::Q4_0,
            WeightFormat::Ggml(GgmlType::Q4_1) => Kernel::Q4_1,
            WeightFormat::Ggml(GgmlType::Q8_0) => Kernel::Q8_0,
            _ => Kernel::Float,
        }
    }

    pub fn quantizes_activations(self) -> bool {
        self != Kernel::Float
    }
}

/// Quantizes `x` (a multiple of 32 long) into `out`, one block per 32 values.
pub fn quantize_row(x: &[f32], out: &mut Vec<QBlock>) {
    debug_assert!(x.len().is_multiple_of(QK));
    out.extend(x.chunks_exact(QK).map(|c| {
        let c: &[f32; QK] = c.try_into().unwrap();
        let amax = c.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / QMAX;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i16; QK];
        for (q, &v) in qs.iter_mut().zip(c) {
            // |v * id| <= QMAX (up to rounding), and `as` saturates anyway.
            *q = (v * id).round_ties_even() as i16;
        }
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        QBlock {
            d,
            s: d * sum as f32,
            qs,
        }
    }));
}

/// The activations of one row in the form its kernel reads.
#[derive(Clone, Copy)]
pub enum ActRow<'a> {
    F32(&'a [f32]),
    Q8(&'a [QBlock]),
}

/// Dot of one weight row (its storage bytes) with one activation row.
#[inline]
pub fn row_dot(kernel: Kernel, format: WeightFormat, w: &[u8], x: ActRow) -> Result<f32> {
    Ok(match (kernel, x) {
        (Kernel::Q4_0, ActRow::Q8(x)) => imp::dot_q4_0(w, x),
        (Kernel::Q4_1, ActRow::Q8(x)) => imp::dot_q4_1(w, x),
        (Kernel::Q8_0, ActRow::Q8(x)) => imp::dot_q8_0(w, x),
        (_, ActRow::F32(x)) => dot_float(format, w, x)?,
        (_, ActRow::Q8(_)) => unreachable!("kernel {kernel:?} takes f32 activations"),
    })
}

/// Dequantizes the row 256 elements (or what is left) at a time and dots each chunk.
fn dot_float(format: WeightFormat, w: &[u8], x: &[f32]) -> Result<f32> {
    const CHUNK: usize = 256; // a multiple of every block size
    let mut buf = [0f32; CHUNK];
    let chunk_bytes = format.row_bytes(CHUNK)?;
    let mut acc = 0f32;
    for (wc, xc) in w.chunks(chunk_bytes).zip(x.chunks(CHUNK)) {
        let b = &mut buf[..xc.len()];
        format.dequantize(wc, b)?;
        acc += dot(b, xc);
    }
    Ok(acc)
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Portable integer kernels: the reference for the SIMD ones, and the fallback without AVX2.
#[allow(dead_code)] // with AVX2 only the tests call these
pub mod portable {
    use super::{QBlock, f16_at};

    pub fn dot_q4_0(w: &[u8], x: &[QBlock]) -> f32 {
        let mut acc = 0f32;
        for (b, x) in w.chunks_exact(18).zip(x) {
            let (qs, (lo, hi)) = (&b[2..18], x.qs.split_at(16));
            let mut sum = 0i32;
            for ((&q, &a0), &a1) in qs.iter().zip(lo).zip(hi) {
                sum += ((q & 0x0F) as i32 - 8) * a0 as i32 + ((q >> 4) as i32 - 8) * a1 as i32;
            }
            acc += f16_at(b, 0) * x.d * sum as f32;
        }
        acc
    }

    pub fn dot_q4_1(w: &[u8], x: &[QBlock]) -> f32 {
        let (mut acc, mut mins) = (0f32, 0f32);
        for (b, x) in w.chunks_exact(20).zip(x) {
            let (qs, (lo, hi)) = (&b[4..20], x.qs.split_at(16));
            let mut sum = 0i32;
            for ((&q, &a0), &a1) in qs.iter().zip(lo).zip(hi) {
                sum += (q & 0x0F) as i32 * a0 as i32 + (q >> 4) as i32 * a1 as i32;
            }
            acc += f16_at(b, 0) * x.d * sum as f32;
            mins += f16_at(b, 2) * x.s;
        }
        acc + mins
    }

    pub fn dot_q8_0(w: &[u8], x: &[QBlock]) -> f32 {
        let mut acc = 0f32;
        for (b, x) in w.chunks_exact(34).zip(x) {
            let sum: i32 = b[2..34]
                .iter()
                .zip(&x.qs)
                .map(|(&q, &a)| q as i8 as i32 * a as i32)
                .sum();
            acc += f16_at(b, 0) * x.d * sum as f32;
        }
        acc
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
use portable as imp;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
use avx2 as imp;

/// AVX2 kernels (compiled in when the build targets AVX2 + FMA, as the release config does).
/// A block's 32 weights are widened to two registers of 16 i16 each (elements 0..16, 16..32),
/// multiplied with the activations by `madd` (i16 x i16 summed in pairs to i32: exact, as
/// |w| <= 128 and |a| <= 32767) and the eight i32 lanes converted to f32 once per block.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
pub mod avx2 {
    use std::arch::x86_64::*;

    use super::{QBlock, f16_at};

    /// Elements 0..16 (low nibbles) and 16..32 (high nibbles) of 16 packed bytes, as i16.
    #[inline(always)]
    fn nibbles(p: &[u8; 16]) -> (__m256i, __m256i) {
        // SAFETY: an unaligned 16-byte load from a 16-byte array; the rest needs only AVX2.
        unsafe {
            let raw = _mm_loadu_si128(p.as_ptr() as *const __m128i);
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi))
        }
    }

    /// 32 signed bytes as two registers of 16 i16.
    #[inline(always)]
    fn bytes(p: &[u8; 32]) -> (__m256i, __m256i) {
        // SAFETY: two unaligned 16-byte loads from a 32-byte array.
        unsafe {
            let lo = _mm_loadu_si128(p.as_ptr() as *const __m128i);
            let hi = _mm_loadu_si128(p.as_ptr().add(16) as *const __m128i);
            (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
        }
    }

    /// `sum(w * a)` over the block as eight f32 lanes (exact integer sums, then converted).
    #[inline(always)]
    fn dot(w: (__m256i, __m256i), x: &QBlock) -> __m256 {
        // SAFETY: two unaligned 32-byte loads from the 32 i16s of the block.
        unsafe {
            let a0 = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            let a1 = _mm256_loadu_si256(x.qs.as_ptr().add(16) as *const __m256i);
            let s = _mm256_add_epi32(_mm256_madd_epi16(w.0, a0), _mm256_madd_epi16(w.1, a1));
            _mm256_cvtepi32_ps(s)
        }
    }

    #[inline(always)]
    fn hsum(v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    #[inline(always)]
    fn fmadd(d: f32, p: __m256, acc: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc) }
    }

    fn zero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }

    pub fn dot_q4_0(w: &[u8], x: &[QBlock]) -> f32 {
        let mut acc = zero();
        for (b, x) in w.chunks_exact(18).zip(x) {
            let (lo, hi) = nibbles(b[2..18].try_into().unwrap());
            let q = unsafe {
                let eight = _mm256_set1_epi16(8);
                (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight))
            };
            acc = fmadd(f16_at(b, 0) * x.d, dot(q, x), acc);
        }
        hsum(acc)
    }

    pub fn dot_q4_1(w: &[u8], x: &[QBlock]) -> f32 {
        let (mut acc, mut mins) = (zero(), 0f32);
        for (b, x) in w.chunks_exact(20).zip(x) {
            let q = nibbles(b[4..20].try_into().unwrap());
            acc = fmadd(f16_at(b, 0) * x.d, dot(q, x), acc);
            mins += f16_at(b, 2) * x.s;
        }
        hsum(acc) + mins
    }

    pub fn dot_q8_0(w: &[u8], x: &[QBlock]) -> f32 {
        let mut acc = zero();
        for (b, x) in w.chunks_exact(34).zip(x) {
            let q = bytes(b[2..34].try_into().unwrap());
            acc = fmadd(f16_at(b, 0) * x.d, dot(q, x), acc);
        }
        hsum(acc)
    }
}

//! Fused weight-row · activation-row dot products, for every matmul (see [`crate::linear`]).
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
//! Each kernel takes 1 to [`MAX_ROWS`] activation rows: a weight block is decoded once and applied
//! to every row, and each row's accumulation is exactly that of a lone row (batch invariance).
//!
//! With AVX2 (the release build targets x86-64-v3) the kernels use `std::arch`; otherwise a
//! portable version with the same arithmetic (same lanes, order and FMAs, so the same bits) runs.
//! Both are tested against each other bitwise and against the f64 reference.

use half::f16;
use nibble_core::Result;
use nibble_formats::WeightFormat;
use nibble_formats::gguf::GgmlType;

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

impl<'a> ActRow<'a> {
    #[inline(always)]
    fn q8(self) -> &'a [QBlock] {
        match self {
            ActRow::Q8(x) => x,
            ActRow::F32(_) => panic!("an integer kernel takes quantized activations"),
        }
    }

    #[inline(always)]
    fn f32(self) -> &'a [f32] {
        match self {
            ActRow::F32(x) => x,
            ActRow::Q8(_) => panic!("the float kernel takes f32 activations"),
        }
    }
}

/// The most activation rows one kernel call takes.
pub const MAX_ROWS: usize = 4;

/// Dots of one weight row (its storage bytes) with `x.len()` activation rows (1 to
/// [`MAX_ROWS`]) into `out`. The weight blocks are decoded once for all rows, and every output is
/// accumulated exactly as if its row were alone, so the results are bitwise independent of how
/// many rows (and which) are passed.
#[inline]
pub fn rows_dot(
    kernel: Kernel,
    format: WeightFormat,
    w: &[u8],
    x: &[ActRow],
    out: &mut [f32],
) -> Result<()> {
    match x.len() {
        1 => rows_dot_n::<1>(kernel, format, w, x, out),
        2 => rows_dot_n::<2>(kernel, format, w, x, out),
        3 => rows_dot_n::<3>(kernel, format, w, x, out),
        4 => rows_dot_n::<4>(kernel, format, w, x, out),
        n => unreachable!("{n} activation rows (1..={MAX_ROWS})"),
    }
}

#[inline(always)]
fn rows_dot_n<const R: usize>(
    kernel: Kernel,
    format: WeightFormat,
    w: &[u8],
    x: &[ActRow],
    out: &mut [f32],
) -> Result<()> {
    let q8 = || std::array::from_fn::<_, R, _>(|r| x[r].q8());
    let y = match kernel {
        Kernel::Q4_0 => imp::dot_q4_0::<R>(w, q8()),
        Kernel::Q4_1 => imp::dot_q4_1::<R>(w, q8()),
        Kernel::Q8_0 => imp::dot_q8_0::<R>(w, q8()),
        Kernel::Float => dot_float::<R>(format, w, std::array::from_fn(|r| x[r].f32()))?,
    };
    out.copy_from_slice(&y);
    Ok(())
}

/// How many weight rows [`weight_rows_dot`] takes at once.
pub const WEIGHT_ROWS: usize = 4;

/// Dots of `W` weight rows (storage bytes) with one quantized activation row, for the
/// single-row (decode) case: each activation block is loaded once for all `W` weight rows, and
/// the `W` independent accumulators hide the latency of each row's FMA chain. Every output is
/// accumulated exactly as by [`rows_dot`] for that weight row alone (same blocks, same order,
/// same operations), so the results are bitwise the same.
#[inline]
pub fn weight_rows_dot<const W: usize>(kernel: Kernel, w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
    match kernel {
        Kernel::Q4_0 => imp::dot_q4_0_w::<W>(w, x),
        Kernel::Q4_1 => imp::dot_q4_1_w::<W>(w, x),
        Kernel::Q8_0 => imp::dot_q8_0_w::<W>(w, x),
        Kernel::Float => panic!("the float kernel takes one weight row at a time"),
    }
}

/// Dequantizes the row 256 elements (or what is left) at a time and dots each chunk with every
/// activation row (`acc += dot(chunk)`, the dot as [`crate::ops::dot`]).
fn dot_float<const R: usize>(format: WeightFormat, w: &[u8], x: [&[f32]; R]) -> Result<[f32; R]> {
    const CHUNK: usize = 256; // a multiple of every block size
    let mut buf = [0f32; CHUNK];
    let chunk_bytes = format.row_bytes(CHUNK)?;
    let k = x[0].len();
    let mut acc = [0f32; R];
    for (c, wc) in w.chunks(chunk_bytes).enumerate() {
        let (lo, hi) = (c * CHUNK, (c * CHUNK + CHUNK).min(k));
        let b = &mut buf[..hi - lo];
        format.dequantize(wc, hi - lo, b)?;
        let d = imp::dot_f32::<R>(b, std::array::from_fn(|r| &x[r][lo..hi]));
        for (a, d) in acc.iter_mut().zip(d) {
            *a += d;
        }
    }
    Ok(acc)
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Portable kernels: the fallback without AVX2, with the SIMD kernels' exact arithmetic (same
/// lanes, same order, same fused multiply-adds), so both give the same bits.
///
/// The integer kernels keep eight f32 lanes like the AVX2 registers: lane `j` of a block is the
/// exact integer `w[2j]a[2j] + w[2j+1]a[2j+1] + w[16+2j]a[16+2j] + w[17+2j]a[17+2j]` converted to
/// f32, and `acc[j] = fma(dw * dx, lane[j], acc[j])`; the lanes are summed at the end as
/// [`hsum`].
#[allow(dead_code)] // with AVX2 only the tests call these
pub mod portable {
    use super::{QBlock, QK, f16_at};

    /// The eight lanes of one block's integer dot (`w` the 32 weight integers).
    #[inline(always)]
    fn lanes(w: &[i32; QK], a: &[i16; QK]) -> [f32; 8] {
        let p = |e: usize| w[e] * a[e] as i32;
        std::array::from_fn(|j| {
            ((p(2 * j) + p(2 * j + 1)) + (p(16 + 2 * j) + p(17 + 2 * j))) as f32
        })
    }

    #[inline(always)]
    fn fma_lanes(d: f32, l: [f32; 8], acc: &mut [f32; 8]) {
        for (a, l) in acc.iter_mut().zip(l) {
            *a = d.mul_add(l, *a);
        }
    }

    /// The AVX2 horizontal sum: halves, then pairs, then the last two.
    #[inline(always)]
    pub fn hsum(v: [f32; 8]) -> f32 {
        let s: [f32; 4] = std::array::from_fn(|j| v[j] + v[j + 4]);
        (s[0] + s[2]) + (s[1] + s[3])
    }

    /// 16 bytes of nibbles as elements 0..16 (low) and 16..32 (high).
    #[inline(always)]
    fn nibbles(qs: &[u8], offset: i32) -> [i32; QK] {
        std::array::from_fn(|e| {
            let q = if e < 16 {
                qs[e] & 0x0F
            } else {
                qs[e - 16] >> 4
            };
            q as i32 - offset
        })
    }

    pub fn dot_q4_0<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let mut acc = [[0f32; 8]; R];
        for (i, b) in w.chunks_exact(18).enumerate() {
            let q = nibbles(&b[2..18], 8);
            let dw = f16_at(b, 0);
            for (acc, x) in acc.iter_mut().zip(&x) {
                let x = &x[i];
                fma_lanes(dw * x.d, lanes(&q, &x.qs), acc);
            }
        }
        acc.map(hsum)
    }

    pub fn dot_q4_1<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let (mut acc, mut mins) = ([[0f32; 8]; R], [0f32; R]);
        for (i, b) in w.chunks_exact(20).enumerate() {
            let q = nibbles(&b[4..20], 0);
            let (dw, mw) = (f16_at(b, 0), f16_at(b, 2));
            for ((acc, mins), x) in acc.iter_mut().zip(&mut mins).zip(&x) {
                let x = &x[i];
                fma_lanes(dw * x.d, lanes(&q, &x.qs), acc);
                *mins += mw * x.s;
            }
        }
        std::array::from_fn(|r| hsum(acc[r]) + mins[r])
    }

    pub fn dot_q8_0<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let mut acc = [[0f32; 8]; R];
        for (i, b) in w.chunks_exact(34).enumerate() {
            let q: [i32; QK] = std::array::from_fn(|e| b[2 + e] as i8 as i32);
            let dw = f16_at(b, 0);
            for (acc, x) in acc.iter_mut().zip(&x) {
                let x = &x[i];
                fma_lanes(dw * x.d, lanes(&q, &x.qs), acc);
            }
        }
        acc.map(hsum)
    }

    /// One activation row with several weight rows: each as [`dot_q4_0`] alone.
    pub fn dot_q4_0_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        w.map(|w| dot_q4_0::<1>(w, [x])[0])
    }

    /// One activation row with several weight rows: each as [`dot_q4_1`] alone.
    pub fn dot_q4_1_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        w.map(|w| dot_q4_1::<1>(w, [x])[0])
    }

    /// One activation row with several weight rows: each as [`dot_q8_0`] alone.
    pub fn dot_q8_0_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        w.map(|w| dot_q8_0::<1>(w, [x])[0])
    }

    /// [`crate::ops::dot`] of `w` with each row of `x`.
    pub fn dot_f32<const R: usize>(w: &[f32], x: [&[f32]; R]) -> [f32; R] {
        let n8 = w.len() / 8 * 8;
        let mut acc = [[0f32; 8]; R];
        for (i, wc) in w[..n8].chunks_exact(8).enumerate() {
            for (acc, x) in acc.iter_mut().zip(&x) {
                let xc = &x[i * 8..i * 8 + 8];
                for j in 0..8 {
                    acc[j] = wc[j].mul_add(xc[j], acc[j]);
                }
            }
        }
        std::array::from_fn(|r| super::finish_dot(acc[r], &w[n8..], &x[r][n8..]))
    }
}

/// The end of [`crate::ops::dot`]: the eight lanes summed in order, plus the tail's dot.
#[inline(always)]
fn finish_dot(acc: [f32; 8], w: &[f32], x: &[f32]) -> f32 {
    let mut tail = 0f32;
    for (a, b) in w.iter().zip(x) {
        tail = a.mul_add(*b, tail);
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
use portable as imp;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
use avx2 as imp;

/// [`crate::ops::dot`] of one f32 row with each of `R` rows (the kernel compiled in).
#[cfg(test)]
pub use imp::dot_f32;
/// Several weight rows against one activation row (the kernels compiled in), for tests.
#[cfg(test)]
pub use imp::{dot_q4_0_w, dot_q4_1_w, dot_q8_0_w};

/// AVX2 kernels (compiled in when the build targets AVX2 + FMA, as the release config does).
/// A block's 32 weights are widened to two registers of 16 i16 each (elements 0..16, 16..32),
/// multiplied with the activations by `madd` (i16 x i16 summed in pairs to i32: exact, as
/// |w| <= 128 and |a| <= 32767) and the eight i32 lanes converted to f32 once per block. Each
/// block is widened once and applied to every activation row.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
pub mod avx2 {
    use std::arch::x86_64::*;

    use super::QBlock;

    /// The f16 at `b[at..at + 2]` as f32 (exact, as `half`'s conversion). Loaded with a zeroing
    /// `movd`: `half`'s `pinsrw` merges into a register LLVM may pick from a loop-carried
    /// accumulator, which serialized the loop.
    #[inline(always)]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        let v = u16::from_le_bytes([b[at], b[at + 1]]) as i32;
        // SAFETY: register-only F16C (part of x86-64-v3, like AVX2).
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v))) }
    }

    /// Elements 0..16 (low nibbles) and 16..32 (high nibbles) of 16 packed bytes, as i16.
    /// The bytes are widened once and each 16-bit lane (0..=255) split by a mask and a shift:
    /// three instructions where masking bytes before widening each half took five.
    #[inline(always)]
    fn nibbles(p: &[u8; 16]) -> (__m256i, __m256i) {
        // SAFETY: an unaligned 16-byte load from a 16-byte array; the rest needs only AVX2.
        unsafe {
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.as_ptr() as *const __m128i));
            (
                _mm256_and_si256(v, _mm256_set1_epi16(0x0F)),
                _mm256_srli_epi16(v, 4),
            )
        }
    }

    /// The two f16 at `b[0..4]` (a Q4_1 block's scale and min) as f32 lanes 0 and 1 (exact, as
    /// [`f16_at`]), converted by one instruction.
    #[inline(always)]
    fn f16_pair(b: &[u8]) -> __m128 {
        let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        // SAFETY: register-only F16C.
        unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(v)) }
    }

    /// How far ahead of the rows being read the next rows' bytes are requested: two passes of
    /// `W` rows. The weights stream from memory once per token (they do not fit in the cache),
    /// and the hardware prefetcher, which sees `W` interleaved row streams, was leaving the
    /// loads waiting (the profile's hottest instructions were those consuming them).
    #[inline(always)]
    fn prefetch_ahead(b: &[u8], row_bytes: usize, w: usize) {
        // SAFETY: a prefetch never faults; the address is computed without dereferencing.
        unsafe {
            _mm_prefetch(
                b.as_ptr().wrapping_add(2 * w * row_bytes) as *const i8,
                _MM_HINT_T0,
            )
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
        // SAFETY: register-only SSE/AVX arithmetic.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    #[inline(always)]
    fn fmadd(d: f32, p: __m256, acc: __m256) -> __m256 {
        // SAFETY: register-only FMA.
        unsafe { _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc) }
    }

    #[inline(always)]
    fn zero() -> __m256 {
        // SAFETY: register-only.
        unsafe { _mm256_setzero_ps() }
    }

    pub fn dot_q4_0<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let nb = w.len() / 18;
        let x = x.map(|x| &x[..nb]);
        let mut acc = [zero(); R];
        for (i, b) in w.chunks_exact(18).enumerate() {
            let (lo, hi) = nibbles(b[2..18].try_into().unwrap());
            // SAFETY: register-only AVX2.
            let q = unsafe {
                let eight = _mm256_set1_epi16(8);
                (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight))
            };
            let dw = f16_at(b, 0);
            for r in 0..R {
                let x = &x[r][i];
                acc[r] = fmadd(dw * x.d, dot(q, x), acc[r]);
            }
        }
        acc.map(hsum)
    }

    pub fn dot_q4_1<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let nb = w.len() / 20;
        let x = x.map(|x| &x[..nb]);
        let (mut acc, mut mins) = ([zero(); R], [0f32; R]);
        for (i, b) in w.chunks_exact(20).enumerate() {
            let q = nibbles(b[4..20].try_into().unwrap());
            let (dw, mw) = (f16_at(b, 0), f16_at(b, 2));
            for r in 0..R {
                let x = &x[r][i];
                acc[r] = fmadd(dw * x.d, dot(q, x), acc[r]);
                mins[r] += mw * x.s;
            }
        }
        std::array::from_fn(|r| hsum(acc[r]) + mins[r])
    }

    pub fn dot_q8_0<const R: usize>(w: &[u8], x: [&[QBlock]; R]) -> [f32; R] {
        let nb = w.len() / 34;
        let x = x.map(|x| &x[..nb]);
        let mut acc = [zero(); R];
        for (i, b) in w.chunks_exact(34).enumerate() {
            let q = bytes(b[2..34].try_into().unwrap());
            let dw = f16_at(b, 0);
            for r in 0..R {
                let x = &x[r][i];
                acc[r] = fmadd(dw * x.d, dot(q, x), acc[r]);
            }
        }
        acc.map(hsum)
    }

    /// The 32 activations of a block as two registers of 16 i16 (elements 0..16, 16..32).
    #[inline(always)]
    fn act(x: &QBlock) -> (__m256i, __m256i) {
        // SAFETY: two unaligned 32-byte loads from the 32 i16s of the block.
        unsafe {
            (
                _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i),
                _mm256_loadu_si256(x.qs.as_ptr().add(16) as *const __m256i),
            )
        }
    }

    /// [`dot`] with the activations already loaded by [`act`].
    #[inline(always)]
    fn dot_loaded(w: (__m256i, __m256i), a: (__m256i, __m256i)) -> __m256 {
        // SAFETY: register-only AVX2.
        unsafe {
            let s = _mm256_add_epi32(_mm256_madd_epi16(w.0, a.0), _mm256_madd_epi16(w.1, a.1));
            _mm256_cvtepi32_ps(s)
        }
    }

    // One activation row with `W` weight rows (the decode case): per block, the activations are
    // loaded once and each weight row updates its own accumulator exactly as in the single-row
    // kernels above (`fmadd(dw * x.d, dot, acc)`, then `mins += mw * x.s`), so every output has
    // the same bits; the `W` independent chains keep the FMA and add units busy.

    pub fn dot_q4_0_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        let nb = w[0].len() / 18;
        let x = &x[..nb];
        let w = w.map(|w| &w[..nb * 18]);
        let mut acc = [zero(); W];
        for (i, x) in x.iter().enumerate() {
            let a = act(x);
            for r in 0..W {
                let b = &w[r][i * 18..i * 18 + 18];
                prefetch_ahead(b, nb * 18, W);
                let (lo, hi) = nibbles(b[2..18].try_into().unwrap());
                // SAFETY: register-only AVX2.
                let q = unsafe {
                    let eight = _mm256_set1_epi16(8);
                    (_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight))
                };
                acc[r] = fmadd(f16_at(b, 0) * x.d, dot_loaded(q, a), acc[r]);
            }
        }
        acc.map(hsum)
    }

    pub fn dot_q4_1_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        let nb = w[0].len() / 20;
        let x = &x[..nb];
        let w = w.map(|w| &w[..nb * 20]);
        // Lane 1 of `mins` is the single-row kernel's `mins` (lane 0 sums the unused `dw * x.d`):
        // `[dw, mw] * [x.d, x.s]` is both of its products in one multiply, each rounded as alone.
        // SAFETY: register-only SSE.
        let mut mins = [unsafe { _mm_setzero_ps() }; W];
        let mut acc = [zero(); W];
        for (i, x) in x.iter().enumerate() {
            let a = act(x);
            // SAFETY: register-only SSE.
            let xds = unsafe { _mm_setr_ps(x.d, x.s, 0.0, 0.0) };
            for r in 0..W {
                let b = &w[r][i * 20..i * 20 + 20];
                prefetch_ahead(b, nb * 20, W);
                let q = nibbles(b[4..20].try_into().unwrap());
                // SAFETY: register-only AVX2/FMA.
                unsafe {
                    let p = _mm_mul_ps(f16_pair(b), xds);
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), dot_loaded(q, a), acc[r]);
                    mins[r] = _mm_add_ps(mins[r], p);
                }
            }
        }
        // SAFETY: register-only SSE.
        std::array::from_fn(|r| hsum(acc[r]) + unsafe { _mm_cvtss_f32(_mm_movehdup_ps(mins[r])) })
    }

    pub fn dot_q8_0_w<const W: usize>(w: [&[u8]; W], x: &[QBlock]) -> [f32; W] {
        let nb = w[0].len() / 34;
        let x = &x[..nb];
        let w = w.map(|w| &w[..nb * 34]);
        let mut acc = [zero(); W];
        for (i, x) in x.iter().enumerate() {
            let a = act(x);
            for r in 0..W {
                let b = &w[r][i * 34..i * 34 + 34];
                prefetch_ahead(b, nb * 34, W);
                let q = bytes(b[2..34].try_into().unwrap());
                acc[r] = fmadd(f16_at(b, 0) * x.d, dot_loaded(q, a), acc[r]);
            }
        }
        acc.map(hsum)
    }

    /// [`crate::ops::dot`] of `w` with each row of `x`: eight FMA lanes, then
    /// [`super::finish_dot`].
    pub fn dot_f32<const R: usize>(w: &[f32], x: [&[f32]; R]) -> [f32; R] {
        let n = w.len();
        let n8 = n / 8 * 8;
        let x = x.map(|x| &x[..n]);
        let mut acc = [zero(); R];
        for i in (0..n8).step_by(8) {
            // SAFETY: i + 8 <= n8 <= n, the length of w and of every x row.
            unsafe {
                let wv = _mm256_loadu_ps(w.as_ptr().add(i));
                for r in 0..R {
                    acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[r].as_ptr().add(i)), acc[r]);
                }
            }
        }
        std::array::from_fn(|r| {
            let mut lanes = [0f32; 8];
            // SAFETY: an unaligned 32-byte store to an 8-float array.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
            super::finish_dot(lanes, &w[n8..], &x[r][n8..])
        })
    }
}

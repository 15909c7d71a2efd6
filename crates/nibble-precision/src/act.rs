//! Run-time activation quantizers: one row (one token) at a time, so a token's codes never depend
//! on the rest of the batch.
//!
//! These are the exact rules every kernel (CPU and GPU) follows; a GPU kernel that rounds
//! differently produces different integer codes, and then nothing downstream can be bit-exact.
//!
//! * **Absolute maximum**: `amax = max |x|` over the row (per-token formats) or over one block of
//!   channels ([`ActQuant::Mixed4x8`]). A max is exact and order-free, so any reduction tree
//!   gives the same value.
//! * **Non-finite input**: a row or block holding a NaN or an infinity gets scale NaN and all
//!   codes 0, so every output it touches is NaN (a broken activation shows up instead of being
//!   quietly clipped). On a GPU `__float2int_rn(NaN)` is `INT_MIN`, so this must be an explicit
//!   test, not a consequence of the conversion.
//! * **Scale**: `scale = amax / QMAX`, one IEEE f32 division (correctly rounded: CUDA's default
//!   `-prec-div=true`, not `__fdividef` or a multiply by a reciprocal), with `QMAX` 127 for INT8,
//!   7 for INT4 and 448 for FP8 e4m3. Subnormals are kept (no flush to zero).
//! * **Zero scale**: when `scale == 0` (an all-zero row, or an `amax` so small that the division
//!   underflows) every code is 0.
//! * **Integer codes**: `q = clamp(round_ties_even(x / scale), -QMAX, QMAX)`, the division again
//!   an IEEE f32 division. Ties go to even, as the hardware conversions do (`cvt.rni`,
//!   `__float2int_rn`, `vcvtps2dq`). Codes are symmetric: INT8 never uses -128, INT4 never -8.
//! * **FP8 codes**: `code = e4m3(x / scale)`, rounded to nearest even and saturated to ±448
//!   (CUDA `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`; `float8::F8E4M3::from_f32`
//!   is a port of it).
//! * **16-bit activations**: each value rounded to f16 to nearest even, overflowing to ±inf
//!   (`__float2half_rn`, `half::f16::from_f32`).
//! * **COMET mixed blocks** ([`ActQuant::Mixed4x8`]): channels in consecutive blocks of `block`;
//!   blocks `0..int8_blocks` use the INT8 rules, the others the INT4 rules, each block with its own
//!   `amax` and scale.

use float8::F8E4M3;
use half::f16;
use nibble_core::{Error, Result};

use crate::weight::{ActQuant, FP8_MAX};

/// Largest INT8 activation code.
pub const INT8_QMAX: i32 = 127;
/// Largest INT4 activation code (COMET's non-outlier blocks).
pub const INT4_QMAX: i32 = 7;

/// One activation row in the form a kernel multiplies.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizedRow {
    /// Integer codes, with one scale per consecutive block of `block` channels (for per-token
    /// INT8, one block spanning the row). Code `j` stands for `codes[j] * scales[j / block]`.
    Int {
        codes: Vec<i8>,
        scales: Vec<f32>,
        block: usize,
    },
    /// FP8 e4m3 codes and the row's scale.
    Fp8 { codes: Vec<u8>, scale: f32 },
    /// Values rounded to f16 (held as f32, exactly).
    F16(Vec<f32>),
}

impl QuantizedRow {
    /// The values the codes stand for, in f64 (each `code * scale` exactly), for checks.
    pub fn dequantize_f64(&self) -> Vec<f64> {
        match self {
            QuantizedRow::Int {
                codes,
                scales,
                block,
            } => codes
                .iter()
                .enumerate()
                .map(|(j, &q)| q as f64 * scales[j / block] as f64)
                .collect(),
            QuantizedRow::Fp8 { codes, scale } => codes
                .iter()
                .map(|&c| fp8_value(c) as f64 * *scale as f64)
                .collect(),
            QuantizedRow::F16(v) => v.iter().map(|&v| v as f64).collect(),
        }
    }
}

impl ActQuant {
    /// Quantizes one row of `x.len()` channels.
    pub fn quantize_row(self, x: &[f32]) -> Result<QuantizedRow> {
        Ok(match self {
            ActQuant::F16 => {
                let mut v = vec![0f32; x.len()];
                round_f16(x, &mut v);
                QuantizedRow::F16(v)
            }
            ActQuant::Int8PerToken => {
                let mut codes = vec![0i8; x.len()];
                let s = quantize_int(x, INT8_QMAX, &mut codes);
                QuantizedRow::Int {
                    codes,
                    scales: vec![s],
                    block: x.len().max(1),
                }
            }
            ActQuant::Fp8PerToken => {
                let mut codes = vec![0u8; x.len()];
                let scale = quantize_fp8(x, &mut codes);
                QuantizedRow::Fp8 { codes, scale }
            }
            ActQuant::Mixed4x8 { block, int8_blocks } => {
                let (block, int8_blocks) = (block as usize, int8_blocks as usize);
                check_mixed(x.len(), block, int8_blocks)?;
                let mut codes = vec![0i8; x.len()];
                let mut scales = vec![0f32; x.len() / block];
                quantize_mixed(x, block, int8_blocks, &mut codes, &mut scales);
                QuantizedRow::Int {
                    codes,
                    scales,
                    block,
                }
            }
        })
    }
}

/// Checks that `k` channels split into blocks of `block` with `int8_blocks` of them INT8.
pub fn check_mixed(k: usize, block: usize, int8_blocks: usize) -> Result<()> {
    if block == 0 || !k.is_multiple_of(block) || int8_blocks * block > k {
        return Err(Error::InvalidArgument(format!(
            "mixed INT4/INT8 activations: {k} channels do not split into blocks of {block} \
             with {int8_blocks} INT8 blocks"
        )));
    }
    Ok(())
}

/// `(amax, all finite)` of a slice.
fn amax_finite(x: &[f32]) -> (f32, bool) {
    let mut m = 0f32;
    let mut finite = true;
    for &v in x {
        m = m.max(v.abs());
        finite &= v.is_finite();
    }
    (m, finite)
}

/// Symmetric integer quantization of `x` to `[-qmax, qmax]` with one scale (returned).
pub fn quantize_int(x: &[f32], qmax: i32, codes: &mut [i8]) -> f32 {
    debug_assert!((1..=127).contains(&qmax));
    let (amax, finite) = amax_finite(x);
    if !finite {
        codes.fill(0);
        return f32::NAN;
    }
    let scale = amax / qmax as f32;
    if scale == 0.0 {
        codes.fill(0);
        return scale;
    }
    let lim = qmax as f32;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v / scale).round_ties_even().clamp(-lim, lim) as i8;
    }
    scale
}

/// Per-token INT8: codes in `[-127, 127]`, scale `amax / 127`.
pub fn quantize_int8(x: &[f32], codes: &mut [i8]) -> f32 {
    quantize_int(x, INT8_QMAX, codes)
}

/// Per-token FP8 e4m3: codes (bit patterns) and the scale `amax / 448`.
pub fn quantize_fp8(x: &[f32], codes: &mut [u8]) -> f32 {
    let (amax, finite) = amax_finite(x);
    if !finite {
        codes.fill(0);
        return f32::NAN;
    }
    let scale = amax / FP8_MAX;
    if scale == 0.0 {
        codes.fill(0);
        return scale;
    }
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = F8E4M3::from_f32(v / scale).to_bits();
    }
    scale
}

/// COMET mixed precision: blocks `0..int8_blocks` INT8, the rest INT4, one scale per block into
/// `scales` (`x.len() / block` long). The caller has checked the geometry ([`check_mixed`]).
pub fn quantize_mixed(
    x: &[f32],
    block: usize,
    int8_blocks: usize,
    codes: &mut [i8],
    scales: &mut [f32],
) {
    for (b, ((xb, cb), s)) in x
        .chunks_exact(block)
        .zip(codes.chunks_exact_mut(block))
        .zip(scales.iter_mut())
        .enumerate()
    {
        let qmax = if b < int8_blocks {
            INT8_QMAX
        } else {
            INT4_QMAX
        };
        *s = quantize_int(xb, qmax, cb);
    }
}

/// Rounds every value to f16 (kept as f32).
pub fn round_f16(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f16::from_f32(v).to_f32();
    }
}

/// The value of an e4m3 code. Every e4m3 value is exactly an f16 (and so an f32).
pub fn fp8_value(code: u8) -> f32 {
    F8E4M3::from_bits(code).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn int8_follows_the_rounding_rules() {
        // amax 127 gives scale exactly 1, so x / scale is x: ties go to even, the max maps to 127.
        let x = [0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.49, 0.0];
        let mut q = [0i8; 8];
        assert_eq!(quantize_int8(&x, &mut q), 1.0);
        assert_eq!(q, [0, 2, 2, 0, -2, -127, 3, 0]);

        // A general scale: codes are round_ties_even(x / (amax / 127)), the max at ±127.
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x: Vec<f32> = (0..300).map(|_| rng.random_range(-3f32..3.0)).collect();
        let mut q = vec![0i8; 300];
        let s = quantize_int8(&x, &mut q);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(s, amax / 127.0);
        for (&v, &c) in x.iter().zip(&q) {
            assert_eq!(c as f32, (v / s).round_ties_even().clamp(-127.0, 127.0));
            assert!(
                (v - c as f32 * s).abs() <= s * 0.5 * (1.0 + 1e-6),
                "{v} -> {c}"
            );
        }
        assert!(q.iter().any(|&c| c.abs() == 127));
        assert!(q.iter().all(|&c| c != -128));
    }

    #[test]
    fn zero_tiny_and_non_finite_rows() {
        let mut q = [5i8; 4];
        assert_eq!(quantize_int8(&[0.0; 4], &mut q), 0.0);
        assert_eq!(q, [0; 4]);
        // amax / 127 underflows to zero: codes 0 rather than a division by zero.
        let tiny = f32::from_bits(1);
        let mut q = [5i8; 2];
        assert_eq!(quantize_int8(&[tiny, -tiny], &mut q), 0.0);
        assert_eq!(q, [0; 2]);
        // A subnormal scale is kept and used.
        let small = f32::MIN_POSITIVE * 0.5;
        let mut q = [0i8; 2];
        let s = quantize_int8(&[small, -small / 2.0], &mut q);
        assert!(s > 0.0 && s < f32::MIN_POSITIVE);
        assert_eq!(q[0], 127);
        assert!((q[1] + 64).abs() <= 1, "{q:?}");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut q = [5i8; 3];
            assert!(quantize_int8(&[1.0, bad, 2.0], &mut q).is_nan());
            assert_eq!(q, [0; 3]);
            let mut c = [5u8; 3];
            assert!(quantize_fp8(&[1.0, bad, 2.0], &mut c).is_nan());
            assert_eq!(c, [0; 3]);
        }
    }

    #[test]
    fn fp8_codes_saturate_and_round_to_nearest_even() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let x: Vec<f32> = (0..500).map(|_| rng.random_range(-10f32..10.0)).collect();
        let mut c = vec![0u8; 500];
        let s = quantize_fp8(&x, &mut c);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(s, amax / 448.0);
        for (&v, &code) in x.iter().zip(&c) {
            let got = fp8_value(code);
            let want = v / s;
            assert!(got.abs() <= 448.0);
            // No e4m3 value is strictly closer to x / scale than the one chosen.
            for other in 0..=255u8 {
                let o = fp8_value(other);
                if o.is_finite() {
                    assert!(
                        (o - want).abs() >= (got - want).abs(),
                        "{want}: {got} vs {o}"
                    );
                }
            }
        }
        assert!(c.iter().any(|&b| fp8_value(b).abs() == 448.0));
        // The tie between 1.0 and 1.125 (e4m3 mantissa 000 and 001) goes to the even 1.0.
        let mut c = [0u8; 2];
        let s = quantize_fp8(&[448.0, 1.0625], &mut c);
        assert_eq!(s, 1.0);
        assert_eq!((fp8_value(c[0]), fp8_value(c[1])), (448.0, 1.0));
        assert_eq!(quantize_fp8(&[0.0, 0.0], &mut c), 0.0);
        assert_eq!(c, [0, 0]);
    }

    #[test]
    fn mixed_blocks_use_int8_then_int4() {
        // Block 0 (INT8): amax 127 -> scale 1. Block 1 (INT4): amax 7 -> scale 1, 2.5 ties to 2,
        // 3.5 ties to 4. Block 2 (INT4): amax 14 -> scale 2, 3.0 / 2 = 1.5 ties to 2.
        let x = [
            127.0, -3.0, 0.5, 1.5, //
            7.0, 2.5, -3.5, 0.0, //
            -14.0, 3.0, 1.0, 6.9,
        ];
        let row = ActQuant::Mixed4x8 {
            block: 4,
            int8_blocks: 1,
        }
        .quantize_row(&x)
        .unwrap();
        assert_eq!(
            row,
            QuantizedRow::Int {
                codes: vec![127, -3, 0, 2, 7, 2, -4, 0, -7, 2, 0, 3],
                scales: vec![1.0, 1.0, 2.0],
                block: 4,
            }
        );
        // Random data: each block's codes are within its range, with its own scale.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let x: Vec<f32> = (0..256).map(|_| rng.random_range(-5f32..5.0)).collect();
        for n8 in [0, 1, 4] {
            let f = ActQuant::Mixed4x8 {
                block: 64,
                int8_blocks: n8,
            };
            let QuantizedRow::Int { codes, scales, .. } = f.quantize_row(&x).unwrap() else {
                panic!("integer codes expected");
            };
            for b in 0..4 {
                let qmax = if b < n8 as usize { 127 } else { 7 };
                let cb = &codes[b * 64..(b + 1) * 64];
                let mut want = vec![0i8; 64];
                assert_eq!(scales[b], quantize_int(&x[b * 64..][..64], qmax, &mut want));
                assert_eq!(cb, &want[..]);
                assert_eq!(cb.iter().map(|c| c.abs() as i32).max(), Some(qmax));
            }
        }
        let bad = ActQuant::Mixed4x8 {
            block: 64,
            int8_blocks: 5,
        };
        assert!(bad.quantize_row(&x).is_err());
        assert!(
            ActQuant::Mixed4x8 {
                block: 48,
                int8_blocks: 0
            }
            .quantize_row(&x)
            .is_err()
        );
    }

    #[test]
    fn f16_rounding_is_nearest_even_and_overflows_to_infinity() {
        // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): ties to even, 1.0.
        // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties to 1 + 2^-9.
        let x = [
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            70000.0,
            -1e-9,
            0.1,
        ];
        let mut out = [0f32; 5];
        round_f16(&x, &mut out);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[1], 1.0 + 2f32.powi(-9));
        assert_eq!(out[2], f32::INFINITY);
        assert_eq!(out[3], -0.0);
        assert_eq!(out[4], f16::from_f32(0.1).to_f32());
        assert_eq!(
            ActQuant::F16.quantize_row(&x).unwrap(),
            QuantizedRow::F16(out.to_vec())
        );
    }
}

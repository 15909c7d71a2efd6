//! Quantized weight codecs: how one row (one output channel) of a linear weight is encoded, and
//! the exact integer or float values a kernel reconstructs from it.
//!
//! Every codec stores a row as one self-contained byte string (codes first, then that row's
//! scales and zeros), so rows can be permuted, sliced and checked like ggml blocks, and a
//! checkpoint tensor is a plain `[rows, row_bytes]` byte matrix. GPU backends repack at load.
//! Row layouts (little-endian; `K` input channels, `G = K / group` groups, nibbles packed two
//! per byte, element `2j` in the low nibble of byte `j`):
//!
//! | codec | row bytes |
//! |---|---|
//! | `int8-pc` | `K` x i8, f16 scale |
//! | `fp8-pc` | `K` x e4m3, f32 scale |
//! | `int4-gN` / `int4-pc` | `K/2` codes, `G` x f16 scale, `G` x u8 zero (0..=15) |
//! | `qoq-gN` | `K/2` codes, `G` x u8 scale, `G` x u8 zero (0..=15), f16 channel scale |
//! | `lqq-gN` | `K/2` codes, `G` x u8 scale (1..=17), `G` x u8 offset, f16 channel scale |

use std::fmt;
use std::str::FromStr;

use float8::F8E4M3;
use half::f16;
use nibble_core::{Error, Result};

/// QoQ's protective INT8 range: level-1 dequantization of any group of values in
/// `[-119, 119]` stays inside INT8 (proved exhaustively in the tests).
pub const PROTECTIVE_RANGE: i32 = 119;

/// Largest FP8 e4m3 magnitude.
pub const FP8_MAX: f32 = 448.0;

/// The largest scale ratio [`WeightCodec::quantize_row`] takes for `Fp8PerChannel`: a ratio of
/// 2 is the grid of ratio 1 one binade up, so `(0, 2]` holds every alignment.
pub const FP8_MAX_SCALE_RATIO: f32 = 2.0;

/// The storage codec of one quantized weight tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightCodec {
    /// Symmetric INT8 per output channel, f16 scale.
    Int8PerChannel,
    /// FP8 e4m3 per output channel, f32 scale.
    Fp8PerChannel,
    /// Asymmetric UINT4 per group of `group` input channels (0: the whole row), f16 scale,
    /// integer zero: `w = (q - z) * s` (AWQ, GPTQ, QServe per-channel, COMET).
    Int4Group { group: u32 },
    /// QoQ progressive: `w = ((q - z) * s1) * s0` with `(q - z) * s1` an exact INT8.
    Qoq { group: u32 },
    /// LiquidQuant: `w = i8((q * s + z') ^ 0x80) * s0`.
    Lqq { group: u32 },
}

/// How a linear layer's input activations are quantized at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// 16-bit floats (weights are dequantized to 16-bit floats in the kernel).
    F16,
    /// Symmetric INT8 per token, scale `max|x| / 127`.
    Int8PerToken,
    /// FP8 e4m3 per token, scale `max|x| / 448`.
    Fp8PerToken,
    /// COMET: channel blocks of `block`; the first `int8_blocks` blocks (outliers, gathered
    /// there by the offline permutation) INT8, the rest INT4, each symmetric per token per block.
    Mixed4x8 { block: u16, int8_blocks: u16 },
}

/// Everything a kernel needs to know about one linear layer's arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinearFormat {
    pub codec: WeightCodec,
    pub act: ActQuant,
}

impl WeightCodec {
    fn group_len(self, cols: usize) -> usize {
        match self {
            WeightCodec::Int4Group { group: 0 } => cols,
            WeightCodec::Int4Group { group }
            | WeightCodec::Qoq { group }
            | WeightCodec::Lqq { group } => group as usize,
            WeightCodec::Int8PerChannel | WeightCodec::Fp8PerChannel => cols,
        }
    }

    /// Number of scale groups in a row of `cols`.
    pub fn groups(self, cols: usize) -> usize {
        cols / self.group_len(cols).max(1)
    }

    /// Checks that `cols` suits this codec (even, and a multiple of the group size).
    pub fn check_cols(self, cols: usize) -> Result<()> {
        let g = self.group_len(cols);
        let nibbles = !matches!(
            self,
            WeightCodec::Int8PerChannel | WeightCodec::Fp8PerChannel
        );
        if cols == 0 || g == 0 || !cols.is_multiple_of(g) || (nibbles && !cols.is_multiple_of(2)) {
            return Err(Error::InvalidArgument(format!(
                "{self} cannot encode rows of {cols} elements (group size {g} must divide it{})",
                if nibbles { ", and it must be even" } else { "" }
            )));
        }
        Ok(())
    }

    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        self.check_cols(cols)?;
        let g = self.groups(cols);
        Ok(match self {
            WeightCodec::Int8PerChannel => cols + 2,
            WeightCodec::Fp8PerChannel => cols + 4,
            WeightCodec::Int4Group { .. } => cols / 2 + 3 * g,
            WeightCodec::Qoq { .. } | WeightCodec::Lqq { .. } => cols / 2 + 2 * g + 2,
        })
    }

    /// Quantizes one row. `clip` (0 < clip <= 1) shrinks the range the codec covers: the
    /// channel's absolute maximum for per-channel codecs and level 0 of QoQ/LiquidQuant, each
    /// group's min and max for `Int4Group`. `out` is `row_bytes(row.len())` long.
    ///
    /// `Fp8PerChannel` also takes ratios in (1, [`FP8_MAX_SCALE_RATIO`]]: the scale then
    /// exceeds `max|w| / 448` and nothing is clipped. e4m3 rounding is relative, so the ratios
    /// of `[1, 2)` between them place every alignment of the float grid on the row's values
    /// (the FP8 scale search of SmoothQuant picks one per row by output error).
    pub fn quantize_row(self, row: &[f32], clip: f32, out: &mut [u8]) -> Result<()> {
        let cols = row.len();
        if out.len() != self.row_bytes(cols)? {
            return Err(Error::InvalidArgument(format!(
                "{self}: output row of {} bytes for {cols} elements",
                out.len()
            )));
        }
        let max_ratio = if self == WeightCodec::Fp8PerChannel {
            FP8_MAX_SCALE_RATIO
        } else {
            1.0
        };
        if !(clip > 0.0 && clip <= max_ratio) {
            return Err(Error::InvalidArgument(format!(
                "{self}: clip ratio {clip} is outside (0, {max_ratio}]"
            )));
        }
        check_finite(row)?;
        match self {
            WeightCodec::Int8PerChannel => {
                let s = f16_scale(absmax(row) * clip / 127.0)?;
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = round_clamp(x, s, -127, 127) as i8 as u8;
                }
                out[cols..].copy_from_slice(&f16::from_f32(s).to_le_bytes());
            }
            WeightCodec::Fp8PerChannel => {
                let s = absmax(row) * clip / FP8_MAX;
                let s = if s > 0.0 { s } else { 1.0 };
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = F8E4M3::from_f32((x / s).clamp(-FP8_MAX, FP8_MAX)).to_bits();
                }
                out[cols..].copy_from_slice(&s.to_le_bytes());
            }
            WeightCodec::Int4Group { .. } => {
                let gl = self.group_len(cols);
                let g = cols / gl;
                let mut codes = vec![0u8; cols];
                for (gi, group) in row.chunks_exact(gl).enumerate() {
                    let (s, z) = int4_group_params(group, clip)?;
                    for (c, &x) in codes[gi * gl..].iter_mut().zip(group) {
                        *c = round_clamp(x, s, -(z as i32), 15 - z as i32).wrapping_add(z as i32)
                            as u8;
                    }
                    let sb = f16::from_f32(s).to_le_bytes();
                    out[cols / 2 + 2 * gi..cols / 2 + 2 * gi + 2].copy_from_slice(&sb);
                    out[cols / 2 + 2 * g + gi] = z;
                }
                pack_nibbles(&codes, &mut out[..cols / 2]);
            }
            WeightCodec::Qoq { .. } => self.quantize_row_qoq(row, clip, &[], out)?,
            WeightCodec::Lqq { .. } => {
                two_level_row(self.group_len(cols), row, clip, out, |_, group, codes| {
                    lqq_level2(group, codes)
                })?
            }
        }
        Ok(())
    }

    /// QoQ's [`Self::quantize_row`] with the level-1 scale of group `g` lowered by `shrink[g]`
    /// (to at least 1; an empty `shrink` lowers none): the group's range is then clipped at the
    /// level-1 step (an integer), the grid a per-group clip search picks from. Level 1 stays
    /// inside INT8 for every shrink (a smaller step only clamps codes sooner; tested
    /// exhaustively). The layout is the plain QoQ row's.
    pub fn quantize_row_qoq(
        self,
        row: &[f32],
        clip: f32,
        shrink: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let WeightCodec::Qoq { .. } = self else {
            return Err(Error::InvalidArgument(format!(
                "{self}: per-group level-1 shrinks are for QoQ rows"
            )));
        };
        let cols = row.len();
        let gl = self.group_len(cols);
        let g = cols / gl.max(1);
        if out.len() != self.row_bytes(cols)? || !(shrink.is_empty() || shrink.len() == g) {
            return Err(Error::InvalidArgument(format!(
                "{self}: {} shrinks and {} output bytes for a row of {cols}",
                shrink.len(),
                out.len()
            )));
        }
        if !(clip > 0.0 && clip <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "{self}: clip ratio {clip} is outside (0, 1]"
            )));
        }
        check_finite(row)?;
        two_level_row(gl, row, clip, out, |gi, group, codes| {
            qoq_level1_shrunk(group, shrink.get(gi).copied().unwrap_or(0), codes)
        })?;
        Ok(())
    }

    /// The exact integer weights of a row for the integer codecs (INT8 per channel, the INT8
    /// that QoQ/LiquidQuant reconstruct in the GEMM main loop, `q - z` for INT4), with the scale
    /// each element is multiplied by: per channel (one entry) or per group.
    pub fn integer_row(self, src: &[u8], cols: usize, ints: &mut [i8], scales: &mut Vec<f32>) {
        scales.clear();
        match self {
            WeightCodec::Int8PerChannel => {
                for (o, &b) in ints.iter_mut().zip(&src[..cols]) {
                    *o = b as i8;
                }
                scales.push(read_f16(&src[cols..]));
            }
            WeightCodec::Fp8PerChannel => panic!("fp8 has no integer form"),
            WeightCodec::Int4Group { .. } => {
                let gl = self.group_len(cols);
                let g = cols / gl;
                for gi in 0..g {
                    let z = src[cols / 2 + 2 * g + gi] as i32;
                    for (j, o) in (gi * gl..).zip(&mut ints[gi * gl..(gi + 1) * gl]) {
                        *o = (nibble(src, j) as i32 - z) as i8;
                    }
                    scales.push(read_f16(&src[cols / 2 + 2 * gi..]));
                }
            }
            WeightCodec::Qoq { .. } => {
                let gl = self.group_len(cols);
                let g = cols / gl;
                for gi in 0..g {
                    let (s, z) = (src[cols / 2 + gi] as i32, src[cols / 2 + g + gi] as i32);
                    for (j, o) in (gi * gl..).zip(&mut ints[gi * gl..(gi + 1) * gl]) {
                        *o = ((nibble(src, j) as i32 - z) * s) as i8;
                    }
                }
                scales.push(read_f16(&src[src.len() - 2..]));
            }
            WeightCodec::Lqq { .. } => {
                let gl = self.group_len(cols);
                let g = cols / gl;
                for gi in 0..g {
                    let (s, z) = (src[cols / 2 + gi] as u32, src[cols / 2 + g + gi] as u32);
                    for j in (gi * gl..(gi + 1) * gl).step_by(4) {
                        let word = u32::from_le_bytes([
                            nibble(src, j),
                            nibble(src, j + 1),
                            nibble(src, j + 2),
                            nibble(src, j + 3),
                        ]);
                        let out = lqq_dequant_word(word, s, z).to_le_bytes();
                        for (o, b) in ints[j..j + 4].iter_mut().zip(out) {
                            *o = b as i8;
                        }
                    }
                }
                scales.push(read_f16(&src[src.len() - 2..]));
            }
        }
    }

    /// Decodes whole rows to f32: `src` holds `dst.len() / cols` rows.
    pub fn dequantize(self, src: &[u8], cols: usize, dst: &mut [f32]) -> Result<()> {
        let rb = self.row_bytes(cols)?;
        if src.len() * cols != dst.len() * rb {
            return Err(Error::InvalidArgument(format!(
                "{self}: {} bytes do not hold {} elements in rows of {cols}",
                src.len(),
                dst.len()
            )));
        }
        let mut ints = vec![0i8; cols];
        let mut scales = Vec::new();
        for (row, out) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(cols)) {
            if self == WeightCodec::Fp8PerChannel {
                let s = f32::from_le_bytes(row[cols..cols + 4].try_into().unwrap());
                for (o, &b) in out.iter_mut().zip(&row[..cols]) {
                    *o = F8E4M3::from_bits(b).to_f32() * s;
                }
                continue;
            }
            self.integer_row(row, cols, &mut ints, &mut scales);
            let gl = cols / scales.len();
            for (j, (o, &q)) in out.iter_mut().zip(&ints).enumerate() {
                *o = q as f32 * scales[j / gl];
            }
        }
        Ok(())
    }
}

/// The LiquidQuant dequantization of four zero-extended UINT4 codes in one 32-bit word: one
/// multiply-add and one XOR, with no carry between byte lanes. Each byte of the result is the
/// two's-complement INT8 weight.
pub fn lqq_dequant_word(codes: u32, scale: u32, offset: u32) -> u32 {
    codes
        .wrapping_mul(scale)
        .wrapping_add(offset.wrapping_mul(0x0101_0101))
        ^ 0x8080_8080
}

/// The byte-affine form of a 4-bit group with INT8 activations (`qoq-gN`, `lqq-gN`, `int4-pc`):
/// every INT8 weight of the group is byte `b` of [`byte_affine_word`]`(codes, scale, offset)`
/// over four consecutive channels (4-aligned, channel `j + b` zero-extended in byte `b`). The
/// GPU's W4A8 kernels widen codes to INT8 with exactly this word arithmetic (LiquidGEMM §4's
/// one IMAD and one XOR per four values, for QoQ too), so one parameter pair per group and row
/// replaces the codec's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteAffine {
    /// The multiplier, at most 255.
    pub scale: u32,
    /// The per-byte addend, `-3697..=255`: LiquidQuant's `z'`, QoQ's `128 - z * s`, INT4's
    /// `128 - z`.
    pub offset: i32,
}

/// `(codes * scale + offset * 0x01010101) ^ 0x80808080` in wrapping 32-bit arithmetic: for
/// LiquidQuant this is [`lqq_dequant_word`] itself; for QoQ and INT4 each byte holds
/// `(q - z) * s + 128`, which is exact (no carry or borrow crosses a byte) while that lies in
/// `0..=255`, and the XOR turns it into the two's-complement `(q - z) * s`.
pub fn byte_affine_word(codes: u32, a: ByteAffine) -> u32 {
    codes
        .wrapping_mul(a.scale)
        .wrapping_add((a.offset as u32).wrapping_mul(0x0101_0101))
        ^ 0x8080_8080
}

impl WeightCodec {
    /// One [`ByteAffine`] per group of a row (`src`, this codec's row bytes) whose INT8 weights
    /// [`byte_affine_word`] reproduces exactly, or `None` if the codec has no such form (INT8,
    /// FP8, INT4 with group scales) or a QoQ group holds a code whose `(q - z) * s` leaves
    /// `-128..=127` (the reference then wraps per element, which the word cannot).
    pub fn byte_affine(self, src: &[u8], cols: usize) -> Option<Vec<ByteAffine>> {
        let g = self.groups(cols);
        let gl = cols / g;
        let params = |gi: usize| (src[cols / 2 + gi] as i32, src[cols / 2 + g + gi] as i32);
        match self {
            WeightCodec::Lqq { .. } => Some(
                (0..g)
                    .map(|gi| {
                        let (s, z) = params(gi);
                        ByteAffine {
                            scale: s as u32,
                            offset: z,
                        }
                    })
                    .collect(),
            ),
            // `w = (q - z) * s`; INT4 per channel is the case `s = 1` with an f16 zero byte.
            WeightCodec::Qoq { .. } | WeightCodec::Int4Group { group: 0 } => (0..g)
                .map(|gi| {
                    let (s, z) = match self {
                        WeightCodec::Qoq { .. } => params(gi),
                        _ => (1, src[cols / 2 + 2] as i32),
                    };
                    let (lo, hi) = (gi * gl..(gi + 1) * gl)
                        .map(|j| nibble(src, j) as i32)
                        .fold((15, 0), |(lo, hi), q| (lo.min(q), hi.max(q)));
                    let exact = |q: i32| (0..=255).contains(&((q - z) * s + 128));
                    (exact(lo) && exact(hi)).then_some(ByteAffine {
                        scale: s as u32,
                        offset: 128 - z * s,
                    })
                })
                .collect(),
            _ => None,
        }
    }
}

/// A two-level row (QoQ, LiquidQuant): level 0 INT8 in the protective range with an f16 scale
/// (`clip` times the row's range), then `level` turns group `gi`'s INT8 values into 4-bit codes
/// and a byte scale and zero. Layout `[nibbles][scales][zeros][level-0 scale f16]`.
fn two_level_row(
    gl: usize,
    row: &[f32],
    clip: f32,
    out: &mut [u8],
    mut level: impl FnMut(usize, &[i32], &mut [u8]) -> (u8, u8),
) -> Result<()> {
    let cols = row.len();
    let g = cols / gl;
    let s0 = f16_scale(absmax(row) * clip / PROTECTIVE_RANGE as f32)?;
    let q8: Vec<i32> = row
        .iter()
        .map(|&x| round_clamp(x, s0, -PROTECTIVE_RANGE, PROTECTIVE_RANGE))
        .collect();
    let mut codes = vec![0u8; cols];
    for (gi, group) in q8.chunks_exact(gl).enumerate() {
        let (s, z) = level(gi, group, &mut codes[gi * gl..(gi + 1) * gl]);
        out[cols / 2 + gi] = s;
        out[cols / 2 + g + gi] = z;
    }
    pack_nibbles(&codes, &mut out[..cols / 2]);
    let end = out.len();
    out[end - 2..].copy_from_slice(&f16::from_f32(s0).to_le_bytes());
    Ok(())
}

/// QoQ level 1 on one group of INT8 values in the protective range (plain QoQ: no shrink).
#[cfg(test)]
fn qoq_level1(group: &[i32], codes: &mut [u8]) -> (u8, u8) {
    qoq_level1_shrunk(group, 0, codes)
}

/// QoQ level 1 on one group of INT8 values in the protective range: UINT8 scale
/// `ceil((hi - lo) / 15) - shrink` (at least 1; `shrink` is 0 but for the per-group step
/// search), UINT4 zero `round(-lo / s)`, codes `clamp(round(x / s) + z, 0, 15)`, all in
/// integers.
fn qoq_level1_shrunk(group: &[i32], shrink: u8, codes: &mut [u8]) -> (u8, u8) {
    let lo = group.iter().copied().min().unwrap_or(0).min(0);
    let hi = group.iter().copied().max().unwrap_or(0).max(0);
    let s = ((hi - lo + 14) / 15 - shrink as i32).max(1);
    let z = div_round(-lo, s).clamp(0, 15);
    for (c, &x) in codes.iter_mut().zip(group) {
        *c = (div_round(x, s) + z).clamp(0, 15) as u8;
    }
    (s as u8, z as u8)
}

/// LiquidQuant level 2 on one group of INT8 values in the protective range, shifted to UINT8:
/// offset `z' = min`, integer scale `ceil((max - min) / 15)` (at least 1, at most 16), codes
/// `round((u - z') / s)`.
fn lqq_level2(group: &[i32], codes: &mut [u8]) -> (u8, u8) {
    let lo = group.iter().copied().min().unwrap_or(0) + 128;
    let hi = group.iter().copied().max().unwrap_or(0) + 128;
    let s = ((hi - lo + 14) / 15).max(1);
    for (c, &x) in codes.iter_mut().zip(group) {
        *c = div_round(x + 128 - lo, s).clamp(0, 15) as u8;
    }
    (s as u8, lo as u8)
}

/// `round(a / b)` for `b > 0`, halves away from zero, in integers.
fn div_round(a: i32, b: i32) -> i32 {
    if a >= 0 {
        (2 * a + b) / (2 * b)
    } else {
        -((-2 * a + b) / (2 * b))
    }
}

/// Scale and integer zero of an asymmetric UINT4 group. The range is `[min, max]` shrunk by
/// `clip`; a (nearly) constant group widens it to include zero so the constant stays exact.
fn int4_group_params(group: &[f32], clip: f32) -> Result<(f32, u8)> {
    let mut lo = group.iter().copied().fold(f32::INFINITY, f32::min) * clip;
    let mut hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max) * clip;
    let amax = lo.abs().max(hi.abs());
    if amax == 0.0 {
        return Ok((0.0, 0));
    }
    if hi - lo <= amax * 1e-3 {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    let s = f16_scale((hi - lo) / 15.0)?;
    let z = (-lo / s).round().clamp(0.0, 15.0) as u8;
    Ok((s, z))
}

/// Rounds a scale to f16, refusing magnitudes f16 cannot hold; 0 stays 0 (an all-zero row).
fn f16_scale(s: f32) -> Result<f32> {
    let h = f16::from_f32(s);
    if !h.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "a weight scale of {s} does not fit in f16 (weights above about 1e6 in magnitude)"
        )));
    }
    // A tiny positive scale that f16 flushes to zero becomes the smallest f16 instead.
    if s > 0.0 && h.to_f32() == 0.0 {
        return Ok(f16::from_bits(1).to_f32());
    }
    Ok(h.to_f32())
}

/// `clamp(round(x / s), lo, hi)`, with a zero scale giving 0.
fn round_clamp(x: f32, s: f32, lo: i32, hi: i32) -> i32 {
    if s == 0.0 {
        return 0;
    }
    ((x / s).round() as i32).clamp(lo, hi)
}

fn absmax(xs: &[f32]) -> f32 {
    xs.iter().fold(0f32, |m, x| m.max(x.abs()))
}

fn read_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn nibble(src: &[u8], j: usize) -> u8 {
    (src[j / 2] >> ((j % 2) * 4)) & 0x0f
}

fn pack_nibbles(codes: &[u8], out: &mut [u8]) {
    for (o, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *o = pair[0] | (pair[1] << 4);
    }
}

/// The rounding grid of one group (the whole row for per-channel codecs), fixed once its scale
/// and zero are chosen. GPTQ needs it apart from [`WeightCodec::quantize_row`]: it picks a group's
/// grid from the weights as they stand when the group starts, then rounds each later column after
/// error feedback has moved it, on that same grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupGrid {
    /// The step; 0 for an all-zero group (every value then rounds to 0).
    pub scale: f32,
    /// The stored integer zero (`Int4Group`; 0 for symmetric INT8).
    pub zero: u8,
    lo: i32,
    hi: i32,
}

impl GroupGrid {
    /// The signed integer `x` rounds to (`code - zero` for INT4).
    pub fn level(&self, x: f32) -> i32 {
        round_clamp(x, self.scale, self.lo, self.hi)
    }

    /// The value `x` dequantizes to, bit-identical to [`WeightCodec::dequantize`] of the encoded
    /// row.
    pub fn value(&self, x: f32) -> f32 {
        self.level(x) as f32 * self.scale
    }
}

impl WeightCodec {
    /// The grid [`Self::quantize_row`] gives a group of `vals` with `clip`: one group of an
    /// `Int4Group` row, or a whole `Int8PerChannel` row. Other codecs (two-level or float) have
    /// no single integer grid per group and are refused.
    pub fn group_grid(self, vals: &[f32], clip: f32) -> Result<GroupGrid> {
        if !(clip > 0.0 && clip <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "clip ratio {clip} is outside (0, 1]"
            )));
        }
        check_finite(vals)?;
        match self {
            WeightCodec::Int8PerChannel => Ok(GroupGrid {
                scale: f16_scale(absmax(vals) * clip / 127.0)?,
                zero: 0,
                lo: -127,
                hi: 127,
            }),
            WeightCodec::Int4Group { .. } => {
                let (scale, zero) = int4_group_params(vals, clip)?;
                Ok(GroupGrid {
                    scale,
                    zero,
                    lo: -(zero as i32),
                    hi: 15 - zero as i32,
                })
            }
            other => Err(Error::unsupported(
                format!("per-group rounding grids for {other}"),
                "only int8-pc and int4 codecs have one integer grid per group",
            )),
        }
    }

    /// Encodes `row` with the given grid per group (`groups(row.len())` of them, from
    /// [`Self::group_grid`]): element `j` is rounded on its group's grid. With the grids
    /// `group_grid` picks from `row` itself this is exactly [`Self::quantize_row`].
    pub fn quantize_row_with(self, row: &[f32], grids: &[GroupGrid], out: &mut [u8]) -> Result<()> {
        let cols = row.len();
        let g = self.groups(cols);
        if out.len() != self.row_bytes(cols)? || grids.len() != g {
            return Err(Error::InvalidArgument(format!(
                "{self}: {} grids and {} output bytes for a row of {cols} (need {g} and {})",
                grids.len(),
                out.len(),
                self.row_bytes(cols)?
            )));
        }
        check_finite(row)?;
        let gl = self.group_len(cols);
        match self {
            WeightCodec::Int8PerChannel => {
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = grids[0].level(x) as i8 as u8;
                }
                out[cols..].copy_from_slice(&f16::from_f32(grids[0].scale).to_le_bytes());
            }
            WeightCodec::Int4Group { .. } => {
                let codes: Vec<u8> = row
                    .iter()
                    .enumerate()
                    .map(|(j, &x)| {
                        let grid = &grids[j / gl];
                        (grid.level(x) + grid.zero as i32) as u8
                    })
                    .collect();
                for (gi, grid) in grids.iter().enumerate() {
                    let sb = f16::from_f32(grid.scale).to_le_bytes();
                    out[cols / 2 + 2 * gi..cols / 2 + 2 * gi + 2].copy_from_slice(&sb);
                    out[cols / 2 + 2 * g + gi] = grid.zero;
                }
                pack_nibbles(&codes, &mut out[..cols / 2]);
            }
            other => {
                return Err(Error::unsupported(
                    format!("encoding {other} from per-group grids"),
                    "only int8-pc and int4 codecs have one integer grid per group",
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for WeightCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WeightCodec::Int8PerChannel => write!(f, "int8-pc"),
            WeightCodec::Fp8PerChannel => write!(f, "fp8-pc"),
            WeightCodec::Int4Group { group: 0 } => write!(f, "int4-pc"),
            WeightCodec::Int4Group { group } => write!(f, "int4-g{group}"),
            WeightCodec::Qoq { group } => write!(f, "qoq-g{group}"),
            WeightCodec::Lqq { group } => write!(f, "lqq-g{group}"),
        }
    }
}

impl FromStr for WeightCodec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::unsupported(format!("weight codec '{s}'"), "not a nibble codec name");
        let group = |g: &str| -> Result<u32> {
            let g: u32 = g.parse().map_err(|_| bad())?;
            if crate::spec::GROUP_SIZES.contains(&g) {
                Ok(g)
            } else {
                Err(bad())
            }
        };
        Ok(match s {
            "int8-pc" => WeightCodec::Int8PerChannel,
            "fp8-pc" => WeightCodec::Fp8PerChannel,
            "int4-pc" => WeightCodec::Int4Group { group: 0 },
            _ => match s.split_once("-g").ok_or_else(bad)? {
                ("int4", g) => WeightCodec::Int4Group { group: group(g)? },
                ("qoq", g) => WeightCodec::Qoq { group: group(g)? },
                ("lqq", g) => WeightCodec::Lqq { group: group(g)? },
                _ => return Err(bad()),
            },
        })
    }
}

impl fmt::Display for ActQuant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ActQuant::F16 => write!(f, "a16"),
            ActQuant::Int8PerToken => write!(f, "a8"),
            ActQuant::Fp8PerToken => write!(f, "afp8"),
            ActQuant::Mixed4x8 { block, int8_blocks } => write!(f, "a4a8-b{block}-n{int8_blocks}"),
        }
    }
}

impl FromStr for ActQuant {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::unsupported(format!("activation format '{s}'"), "not a nibble name");
        Ok(match s {
            "a16" => ActQuant::F16,
            "a8" => ActQuant::Int8PerToken,
            "afp8" => ActQuant::Fp8PerToken,
            _ => {
                let rest = s.strip_prefix("a4a8-b").ok_or_else(bad)?;
                let (b, n) = rest.split_once("-n").ok_or_else(bad)?;
                ActQuant::Mixed4x8 {
                    block: b.parse().map_err(|_| bad())?,
                    int8_blocks: n.parse().map_err(|_| bad())?,
                }
            }
        })
    }
}

impl fmt::Display for LinearFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.codec, self.act)
    }
}

impl FromStr for LinearFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let (c, a) = s.split_once('/').ok_or_else(|| {
            Error::unsupported(format!("linear format '{s}'"), "expected CODEC/ACT")
        })?;
        LinearFormat::new(c.parse()?, a.parse()?)
    }
}

impl LinearFormat {
    /// Whether columns `c0..c1` of rows of `cols` can stand as rows of this format on their own,
    /// computing exactly the columns' share of the dot product (tensor parallelism's row-parallel
    /// shards): per-channel scales stay with every part, and a group-wise row is cut on whole
    /// groups. A refusal says why.
    pub fn check_col_cut(self, cols: usize, c0: usize, c1: usize) -> Result<()> {
        self.row_bytes(cols)?;
        let refuse = |why: String| {
            Err(Error::unsupported(
                format!("cutting {self} rows by columns"),
                why,
            ))
        };
        if c0 >= c1 || c1 > cols {
            return refuse(format!("columns {c0}..{c1} of {cols}"));
        }
        if let ActQuant::Mixed4x8 { .. } = self.act {
            return refuse(
                "COMET's INT8 blocks lead each row (its outlier channels); a cut would move them"
                    .into(),
            );
        }
        match self.codec {
            WeightCodec::Int8PerChannel
            | WeightCodec::Fp8PerChannel
            | WeightCodec::Int4Group { group: 0 } => {
                if matches!(self.codec, WeightCodec::Int4Group { .. })
                    && (!c0.is_multiple_of(2) || !c1.is_multiple_of(2))
                {
                    return refuse(format!(
                        "columns {c0}..{c1} would split a byte of two codes"
                    ));
                }
                Ok(())
            }
            WeightCodec::Int4Group { group } => {
                let g = group as usize;
                if !c0.is_multiple_of(g) || !c1.is_multiple_of(g) || !c0.is_multiple_of(2) {
                    return refuse(format!(
                        "columns {c0}..{c1} would cut a group of {g}; pick a tensor-parallel size \
                         that divides the layer into whole groups"
                    ));
                }
                Ok(())
            }
            WeightCodec::Qoq { .. } | WeightCodec::Lqq { .. } => refuse(
                "QoQ and LiquidQuant rows fold a per-channel level into every group; not cut yet"
                    .into(),
            ),
        }
    }

    /// Appends columns `c0..c1` of `row` (a row of `cols` columns) to `out` as a row of
    /// `c1 - c0` columns, where [`LinearFormat::check_col_cut`] allows it.
    pub fn cut_cols(
        self,
        row: &[u8],
        cols: usize,
        c0: usize,
        c1: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.check_col_cut(cols, c0, c1)?;
        if row.len() != self.row_bytes(cols)? {
            return Err(Error::InvalidArgument(format!(
                "{self}: a row of {} bytes for {cols} columns",
                row.len()
            )));
        }
        match self.codec {
            WeightCodec::Int8PerChannel | WeightCodec::Fp8PerChannel => {
                out.extend_from_slice(&row[c0..c1]);
                out.extend_from_slice(&row[cols..]);
            }
            WeightCodec::Int4Group { group: 0 } => {
                out.extend_from_slice(&row[c0 / 2..c1 / 2]);
                out.extend_from_slice(&row[cols / 2..]);
            }
            WeightCodec::Int4Group { group } => {
                let (g, gl) = (self.codec.groups(cols), group as usize);
                let (g0, g1) = (c0 / gl, c1 / gl);
                let (scales, zeros) = (cols / 2, cols / 2 + 2 * g);
                out.extend_from_slice(&row[c0 / 2..c1 / 2]);
                out.extend_from_slice(&row[scales + 2 * g0..scales + 2 * g1]);
                out.extend_from_slice(&row[zeros + g0..zeros + g1]);
            }
            WeightCodec::Qoq { .. } | WeightCodec::Lqq { .. } => {
                unreachable!("check_col_cut refuses them")
            }
        }
        Ok(())
    }
}

impl LinearFormat {
    /// Checks that the pair is one nibble has kernels for.
    pub fn new(codec: WeightCodec, act: ActQuant) -> Result<Self> {
        use ActQuant as A;
        use WeightCodec as C;
        let ok = matches!(
            (codec, act),
            (C::Int8PerChannel, A::F16 | A::Int8PerToken)
                | (C::Fp8PerChannel, A::Fp8PerToken | A::F16)
                | (C::Int4Group { .. }, A::F16 | A::Int8PerToken)
                | (C::Qoq { .. } | C::Lqq { .. }, A::Int8PerToken)
        ) || matches!((codec, act), (C::Int4Group { group }, A::Mixed4x8 { block, .. })
                if group == block as u32 && group > 0);
        if !ok {
            return Err(Error::unsupported(
                format!("linear format {codec}/{act}"),
                "no kernel multiplies these weights by these activations",
            ));
        }
        Ok(LinearFormat { codec, act })
    }

    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        if let ActQuant::Mixed4x8 { block, int8_blocks } = self.act
            && int8_blocks as usize * block as usize > cols
        {
            return Err(Error::InvalidArgument(format!(
                "{self}: {int8_blocks} INT8 blocks of {block} exceed {cols} channels"
            )));
        }
        self.codec.row_bytes(cols)
    }
}

/// A clear error for the first non-finite weight of `vals`: no codec can represent it.
fn check_finite(vals: &[f32]) -> Result<()> {
    match vals.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::InvalidArgument(format!(
            "weight element {i} is {}: cannot quantize a non-finite weight",
            vals[i]
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn column_cuts_compute_their_share_exactly() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let cols = 256;
        let row: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for (codec, act) in [
            (WeightCodec::Int4Group { group: 64 }, ActQuant::F16),
            (
                WeightCodec::Int4Group { group: 128 },
                ActQuant::Int8PerToken,
            ),
            (WeightCodec::Int4Group { group: 0 }, ActQuant::F16),
            (WeightCodec::Int8PerChannel, ActQuant::Int8PerToken),
            (WeightCodec::Fp8PerChannel, ActQuant::Fp8PerToken),
        ] {
            let f = LinearFormat::new(codec, act).unwrap();
            let mut q = vec![0u8; f.row_bytes(cols).unwrap()];
            codec.quantize_row(&row, 1.0, &mut q).unwrap();
            let mut whole = vec![0f32; cols];
            codec.dequantize(&q, cols, &mut whole).unwrap();
            for (c0, c1) in [(0, 128), (128, 256), (64, 192)] {
                if f.check_col_cut(cols, c0, c1).is_err() {
                    assert_eq!(
                        codec,
                        WeightCodec::Int4Group { group: 128 },
                        "{f} {c0}..{c1}"
                    );
                    continue;
                }
                let mut part = Vec::new();
                f.cut_cols(&q, cols, c0, c1, &mut part).unwrap();
                assert_eq!(part.len(), f.row_bytes(c1 - c0).unwrap());
                let mut got = vec![0f32; c1 - c0];
                codec.dequantize(&part, c1 - c0, &mut got).unwrap();
                assert_eq!(got, whole[c0..c1], "{f} columns {c0}..{c1}");
            }
        }
        let group = LinearFormat::new(WeightCodec::Int4Group { group: 64 }, ActQuant::F16).unwrap();
        let err = group.check_col_cut(256, 0, 96).unwrap_err().to_string();
        assert!(err.contains("cut a group of 64"), "{err}");
        let qoq =
            LinearFormat::new(WeightCodec::Qoq { group: 64 }, ActQuant::Int8PerToken).unwrap();
        assert!(qoq.check_col_cut(256, 0, 128).is_err());
    }

    const CODECS: [WeightCodec; 9] = [
        WeightCodec::Int8PerChannel,
        WeightCodec::Fp8PerChannel,
        WeightCodec::Int4Group { group: 0 },
        WeightCodec::Int4Group { group: 32 },
        WeightCodec::Int4Group { group: 64 },
        WeightCodec::Int4Group { group: 128 },
        WeightCodec::Qoq { group: 32 },
        WeightCodec::Qoq { group: 128 },
        WeightCodec::Lqq { group: 64 },
    ];

    fn random_row(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let x: f32 = rng.random_range(-1.0..1.0);
                if rng.random_bool(0.01) { x * 20.0 } else { x }
            })
            .collect()
    }

    #[test]
    fn byte_affine_words_are_the_integer_weights() {
        // Quantized rows (every clip, so QoQ's groups take varied scales and zeros) and rows of
        // raw random bytes (LiquidQuant's word arithmetic holds whatever the parameters; QoQ
        // must then refuse the groups that would wrap).
        let mut rng = ChaCha8Rng::seed_from_u64(41);
        let codecs = [
            WeightCodec::Qoq { group: 32 },
            WeightCodec::Qoq { group: 128 },
            WeightCodec::Lqq { group: 64 },
            WeightCodec::Lqq { group: 128 },
            WeightCodec::Int4Group { group: 0 },
        ];
        let (mut refused, mut checked) = (0, 0);
        for codec in codecs {
            for trial in 0..40 {
                let cols = 256;
                let mut src = vec![0u8; codec.row_bytes(cols).unwrap()];
                if trial < 20 {
                    let clip = [1.0, 0.9, 0.75, 0.5][trial % 4];
                    codec
                        .quantize_row(&random_row(&mut rng, cols), clip, &mut src)
                        .unwrap();
                } else {
                    rng.fill(&mut src[..]);
                }
                let mut ints = vec![0i8; cols];
                let mut scales = Vec::new();
                codec.integer_row(&src, cols, &mut ints, &mut scales);
                let Some(affine) = codec.byte_affine(&src, cols) else {
                    assert!(trial >= 20 && !matches!(codec, WeightCodec::Lqq { .. }));
                    refused += 1;
                    continue;
                };
                let gl = cols / affine.len();
                for j in (0..cols).step_by(4) {
                    let codes = u32::from_le_bytes(std::array::from_fn(|b| nibble(&src, j + b)));
                    let word = byte_affine_word(codes, affine[j / gl]).to_le_bytes();
                    for b in 0..4 {
                        assert_eq!(
                            word[b] as i8,
                            ints[j + b],
                            "{codec} trial {trial} channel {}",
                            j + b
                        );
                    }
                }
                checked += 1;
            }
        }
        assert!(
            refused > 0 && checked >= 140,
            "{refused} refused, {checked} checked"
        );
        // No form for codecs whose scales are not per channel.
        let src = vec![0u8; WeightCodec::Int4Group { group: 32 }.row_bytes(64).unwrap()];
        assert!(
            WeightCodec::Int4Group { group: 32 }
                .byte_affine(&src, 64)
                .is_none()
        );
    }

    fn roundtrip(codec: WeightCodec, row: &[f32], clip: f32) -> Vec<f32> {
        let mut packed = vec![0u8; codec.row_bytes(row.len()).unwrap()];
        codec.quantize_row(row, clip, &mut packed).unwrap();
        let mut out = vec![f32::NAN; row.len()];
        codec.dequantize(&packed, row.len(), &mut out).unwrap();
        out
    }

    /// Every codec's error stays within half a quantization step of its own grid.
    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for codec in CODECS {
            for cols in [128, 256, 576] {
                if codec.check_cols(cols).is_err() {
                    continue;
                }
                let row = random_row(&mut rng, cols);
                let back = roundtrip(codec, &row, 1.0);
                let gl = codec.group_len(cols);
                for (g, (orig, deq)) in row.chunks(gl).zip(back.chunks(gl)).enumerate() {
                    let lo = orig.iter().copied().fold(f32::INFINITY, f32::min);
                    let hi = orig.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let amax = absmax(&row);
                    let tol = match codec {
                        WeightCodec::Int8PerChannel => amax / 127.0 * 0.51,
                        WeightCodec::Fp8PerChannel => amax / 8.0,
                        WeightCodec::Int4Group { .. } => (hi - lo) / 15.0 * 0.51 + 1e-3,
                        // Level 0 (half an INT8 step) plus level 1 (half a level-1 step).
                        _ => amax / 119.0 * (0.5 + 17.0 / 2.0 + 0.01),
                    };
                    for (a, b) in orig.iter().zip(deq) {
                        assert!((a - b).abs() <= tol, "{codec} g{g}: {a} -> {b} (tol {tol})");
                    }
                }
            }
        }
    }

    /// QoQ level 1 never leaves INT8 for any group range inside the protective range: every
    /// `[lo, hi]`, with every value in it.
    #[test]
    fn qoq_level1_is_overflow_free_for_every_group_range() {
        for lo in -PROTECTIVE_RANGE..=PROTECTIVE_RANGE {
            for hi in lo..=PROTECTIVE_RANGE {
                let group: Vec<i32> = (lo..=hi).collect();
                let mut codes = vec![0u8; group.len()];
                let (s, z) = qoq_level1(&group, &mut codes);
                assert!(z <= 15 && s >= 1);
                for (&x, &q) in group.iter().zip(&codes) {
                    let back = (q as i32 - z as i32) * s as i32;
                    assert!((-128..=127).contains(&back), "[{lo},{hi}] {x} -> {back}");
                    assert!(
                        (back - x).abs() <= (s as i32 + 1) / 2,
                        "[{lo},{hi}] {x} -> {back}"
                    );
                    // The GPU computes q*s and z*s in byte lanes: both must fit a byte.
                    assert!(q as i32 * s as i32 <= 255 && z as i32 * s as i32 <= 255);
                }
            }
        }
    }

    /// A shrunk level-1 step keeps every code inside INT8 and the byte-lane products inside a
    /// byte, for every group range and every shrink; a shrink of 0 is plain QoQ.
    #[test]
    fn qoq_shrunk_level1_is_overflow_free_for_every_group_range() {
        for lo in -PROTECTIVE_RANGE..=PROTECTIVE_RANGE {
            for hi in lo..=PROTECTIVE_RANGE {
                let group: Vec<i32> = (lo..=hi).collect();
                let mut plain = vec![0u8; group.len()];
                let (s_plain, _) = qoq_level1(&group, &mut plain);
                for shrink in 0..=16u8 {
                    let mut codes = vec![0u8; group.len()];
                    let (s, z) = qoq_level1_shrunk(&group, shrink, &mut codes);
                    assert_eq!(s as i32, (s_plain as i32 - shrink as i32).max(1));
                    if shrink == 0 {
                        assert_eq!(codes, plain);
                    }
                    assert!(z <= 15 && s >= 1);
                    for (&x, &q) in group.iter().zip(&codes) {
                        let back = (q as i32 - z as i32) * s as i32;
                        assert!(
                            (-128..=127).contains(&back),
                            "[{lo},{hi}]-{shrink} {x} -> {back}"
                        );
                        assert!(q as i32 * s as i32 <= 255 && z as i32 * s as i32 <= 255);
                    }
                }
            }
        }
    }

    #[test]
    fn qoq_row_shrinks_clip_only_the_groups_named() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let codec = WeightCodec::Qoq { group: 32 };
        let row = random_row(&mut rng, 128);
        let rb = codec.row_bytes(128).unwrap();
        let (mut plain, mut none, mut shrunk) = (vec![0u8; rb], vec![0u8; rb], vec![0u8; rb]);
        codec.quantize_row(&row, 0.9, &mut plain).unwrap();
        codec.quantize_row_qoq(&row, 0.9, &[], &mut none).unwrap();
        assert_eq!(plain, none);
        codec
            .quantize_row_qoq(&row, 0.9, &[0, 2, 0, 0], &mut shrunk)
            .unwrap();
        let (mut a, mut b) = (vec![0f32; 128], vec![0f32; 128]);
        codec.dequantize(&plain, 128, &mut a).unwrap();
        codec.dequantize(&shrunk, 128, &mut b).unwrap();
        assert_eq!(a[..32], b[..32]);
        assert_eq!(a[64..], b[64..]);
        assert_ne!(a[32..64], b[32..64]);
        // Only QoQ rows take shrinks, and one per group.
        assert!(
            codec
                .quantize_row_qoq(&row, 0.9, &[1, 2], &mut shrunk)
                .is_err()
        );
        let lqq = WeightCodec::Lqq { group: 32 };
        assert!(lqq.quantize_row_qoq(&row, 0.9, &[], &mut shrunk).is_err());
    }

    /// The word-wide LiquidQuant dequantization equals the scalar reference for every group
    /// range, every code and every lane position.
    #[test]
    fn lqq_word_dequant_matches_scalar_for_every_group() {
        for lo in -PROTECTIVE_RANGE..=PROTECTIVE_RANGE {
            for hi in lo..=PROTECTIVE_RANGE {
                let group: Vec<i32> = (lo..=hi).collect();
                let mut codes = vec![0u8; group.len()];
                let (s, z) = lqq_level2(&group, &mut codes);
                assert!((1..=17).contains(&s), "[{lo},{hi}] scale {s}");
                for q in 0..16u32 {
                    let scalar = q * s as u32 + z as u32;
                    if q > *codes.iter().max().unwrap() as u32 {
                        continue;
                    }
                    assert!(scalar <= 255, "[{lo},{hi}] q={q}: {scalar} leaves the byte");
                    let want = (scalar as i32 - 128) as i8;
                    for lane in 0..4 {
                        let word = q << (8 * lane);
                        let got = lqq_dequant_word(word, s as u32, z as u32).to_le_bytes()[lane];
                        assert_eq!(got as i8, want, "[{lo},{hi}] q={q} lane {lane}");
                    }
                }
                for (&x, &q) in group.iter().zip(&codes) {
                    let back = (q as i32 * s as i32 + z as i32) - 128;
                    assert!(
                        (back - x).abs() <= (s as i32 + 1) / 2,
                        "[{lo},{hi}] {x} -> {back}"
                    );
                }
            }
        }
    }

    #[test]
    fn lqq_four_lanes_at_once() {
        // Four different codes in one word give four independent bytes.
        let w = u32::from_le_bytes([0, 5, 15, 9]);
        let got = lqq_dequant_word(w, 16, 9).to_le_bytes();
        for (i, q) in [0u32, 5, 15, 9].into_iter().enumerate() {
            assert_eq!(got[i] as i8 as i32, (q * 16 + 9) as i32 - 128);
        }
    }

    #[test]
    fn constant_and_zero_groups_are_exact() {
        for codec in [
            WeightCodec::Int4Group { group: 32 },
            WeightCodec::Int8PerChannel,
        ] {
            let zeros = vec![0.0f32; 64];
            assert_eq!(roundtrip(codec, &zeros, 1.0), zeros);
            let c = vec![0.375f32; 64];
            let back = roundtrip(codec, &c, 1.0);
            assert!(
                back.iter().all(|&b| (b - 0.375).abs() < 1e-3),
                "{codec}: {back:?}"
            );
            let n = vec![-2.5f32; 64];
            let back = roundtrip(codec, &n, 1.0);
            assert!(
                back.iter().all(|&b| (b + 2.5).abs() < 1e-2),
                "{codec}: {back:?}"
            );
        }
        for codec in [
            WeightCodec::Qoq { group: 32 },
            WeightCodec::Lqq { group: 32 },
        ] {
            assert_eq!(roundtrip(codec, &[0.0; 64], 1.0), vec![0.0; 64]);
        }
    }

    #[test]
    fn non_finite_weights_and_bad_shapes_are_refused() {
        for codec in CODECS {
            let mut row = vec![0.5f32; 128];
            row[3] = f32::NAN;
            let mut out = vec![0u8; codec.row_bytes(128).unwrap()];
            let err = codec.quantize_row(&row, 1.0, &mut out).unwrap_err();
            assert!(err.to_string().contains("non-finite"), "{err}");
            row[3] = f32::INFINITY;
            assert!(codec.quantize_row(&row, 1.0, &mut out).is_err());
            assert!(codec.quantize_row(&[0.5; 128], 0.0, &mut out).is_err());
        }
        let err = WeightCodec::Int4Group { group: 128 }
            .row_bytes(576)
            .unwrap_err();
        assert!(err.to_string().contains("576"), "{err}");
        assert!(WeightCodec::Int4Group { group: 0 }.row_bytes(7).is_err());
        let huge = vec![1e9f32; 64];
        let mut out = vec![0u8; WeightCodec::Int8PerChannel.row_bytes(64).unwrap()];
        assert!(
            WeightCodec::Int8PerChannel
                .quantize_row(&huge, 1.0, &mut out)
                .is_err()
        );
    }

    /// Rounding on grids taken from the row itself is `quantize_row`, byte for byte; rounding
    /// other values on those grids decodes to exactly `GroupGrid::value`.
    #[test]
    fn explicit_grids_reproduce_the_codec() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for codec in [
            WeightCodec::Int8PerChannel,
            WeightCodec::Int4Group { group: 0 },
            WeightCodec::Int4Group { group: 32 },
            WeightCodec::Int4Group { group: 64 },
            WeightCodec::Int4Group { group: 128 },
        ] {
            for clip in [1.0, 0.85] {
                let mut row = random_row(&mut rng, 256);
                // A zero group and a constant group exercise the degenerate grids.
                row[..32].fill(0.0);
                row[32..64].fill(0.3);
                let gl = 256 / codec.groups(256);
                let grids: Vec<GroupGrid> = row
                    .chunks(gl)
                    .map(|g| codec.group_grid(g, clip).unwrap())
                    .collect();
                let rb = codec.row_bytes(256).unwrap();
                let (mut want, mut got) = (vec![0u8; rb], vec![0u8; rb]);
                codec.quantize_row(&row, clip, &mut want).unwrap();
                codec.quantize_row_with(&row, &grids, &mut got).unwrap();
                assert_eq!(got, want, "{codec} clip {clip}");

                let moved: Vec<f32> = row
                    .iter()
                    .map(|x| x + rng.random_range(-0.5..0.5))
                    .collect();
                codec.quantize_row_with(&moved, &grids, &mut got).unwrap();
                let mut back = vec![0f32; 256];
                codec.dequantize(&got, 256, &mut back).unwrap();
                for (j, (&x, &b)) in moved.iter().zip(&back).enumerate() {
                    assert_eq!(
                        grids[j / gl].value(x).to_bits(),
                        b.to_bits(),
                        "{codec} element {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn explicit_grids_refuse_what_they_cannot_encode() {
        for codec in [
            WeightCodec::Fp8PerChannel,
            WeightCodec::Qoq { group: 32 },
            WeightCodec::Lqq { group: 32 },
        ] {
            assert!(codec.group_grid(&[0.5; 32], 1.0).is_err(), "{codec}");
        }
        let codec = WeightCodec::Int4Group { group: 32 };
        assert!(codec.group_grid(&[0.5, f32::NAN], 1.0).is_err());
        assert!(codec.group_grid(&[0.5; 32], 0.0).is_err());
        let grid = codec.group_grid(&[0.5; 32], 1.0).unwrap();
        let mut out = vec![0u8; codec.row_bytes(64).unwrap()];
        let err = codec
            .quantize_row_with(&[0.5; 64], &[grid], &mut out)
            .unwrap_err();
        assert!(err.to_string().contains("1 grids"), "{err}");
        let mut row = vec![0.5f32; 64];
        row[9] = f32::INFINITY;
        assert!(codec.quantize_row_with(&row, &[grid; 2], &mut out).is_err());
    }

    #[test]
    fn clipping_shrinks_the_range() {
        let row: Vec<f32> = (0..64).map(|i| i as f32 / 63.0 - 0.5).collect();
        let back = roundtrip(WeightCodec::Int8PerChannel, &row, 0.5);
        assert!(back.iter().all(|x| x.abs() <= 0.2501), "{back:?}");
    }

    #[test]
    fn fp8_scale_ratios_above_one_widen_the_scale_without_clipping() {
        let row: Vec<f32> = (0..64).map(|i| (i as f32 / 63.0 - 0.5) * 3.0).collect();
        let codec = WeightCodec::Fp8PerChannel;
        let mut max_err = [0f32; 2];
        for (e, ratio) in max_err.iter_mut().zip([1.0, 1.5]) {
            let back = roundtrip(codec, &row, ratio);
            // No value saturates: the error stays within e4m3's relative half step.
            for (a, b) in row.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + 1e-6,
                    "{ratio}: {a} -> {b}"
                );
                *e = e.max((a - b).abs());
            }
        }
        // A different ratio is a different grid: the errors differ.
        assert_ne!(max_err[0], max_err[1]);
        let mut out = vec![0u8; codec.row_bytes(64).unwrap()];
        assert!(codec.quantize_row(&row, 2.5, &mut out).is_err());
        // Integer codecs keep (0, 1].
        let int8 = WeightCodec::Int8PerChannel;
        let mut out = vec![0u8; int8.row_bytes(64).unwrap()];
        assert!(int8.quantize_row(&row, 1.5, &mut out).is_err());
    }

    #[test]
    fn fp8_codes_round_trip_every_value() {
        for b in 0..=255u8 {
            let x = F8E4M3::from_bits(b).to_f32();
            if x.is_finite() {
                assert_eq!(
                    F8E4M3::from_f32(x).to_f32().to_bits(),
                    x.to_bits(),
                    "{b:#x}"
                );
            }
        }
        assert_eq!(F8E4M3::from_f32(448.0).to_f32(), 448.0);
    }

    #[test]
    fn names_round_trip() {
        for codec in CODECS {
            assert_eq!(codec.to_string().parse::<WeightCodec>().unwrap(), codec);
        }
        for f in [
            "int4-g64/a16",
            "qoq-g128/a8",
            "lqq-g64/a8",
            "int8-pc/a8",
            "fp8-pc/afp8",
            "int4-g64/a4a8-b64-n2",
            "int4-pc/a8",
        ] {
            assert_eq!(f.parse::<LinearFormat>().unwrap().to_string(), f);
        }
        for bad in [
            "qoq-g64/a16",
            "int4-g64/a4a8-b128-n1",
            "int9-pc/a8",
            "int8-pc",
            "lqq-g100/a8",
        ] {
            assert!(bad.parse::<LinearFormat>().is_err(), "{bad}");
        }
    }
}

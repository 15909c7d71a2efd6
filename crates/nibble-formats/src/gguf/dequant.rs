//! Dequantization of ggml blocks to f32.
//!
//! Layout conventions (those of ggml's `ggml-common.h` / `ggml-quants.c`):
//! - Everything is little-endian; `f16` fields are IEEE half floats, `bf16` the top half of an f32.
//! - A quantized row is a sequence of blocks; each block holds its scale(s) and packed values and
//!   decodes to `block_elems` consecutive floats. Blocks have no padding or alignment.
//! - 4-bit values pack two per byte: within a 32-element block (or a 64-element pair of K-quant
//!   sub-blocks) byte `j` holds element `j` in its low nibble and element `j + 16` (resp. `j + 32`)
//!   in its high nibble, not elements `2j` and `2j + 1`.
//! - Q*_0 types are symmetric (`x = d * (q - offset)`), Q*_1 and Q4_K/Q5_K affine
//!   (`x = d * q + m`, resp. `x = d * sc * q - dmin * m`).
//! - K-quants use 256-element super-blocks with one f16 scale (and min) refined by small integer
//!   scales per 16- or 32-element sub-block.
//!
//! The per-type functions below list their block's byte layout. The arithmetic is done in the
//! same order and precision as ggml's reference `dequantize_row_*` (and gguf-py), each step
//! rounded to f32 and no fused multiply-add, so the results are bit-identical to theirs.
//!
//! This is in the CPU matmul hot path: kernels work a block at a time on fixed-size arrays and
//! zipped iterators, so the inner loops have no bounds checks and vectorize.

use half::{f16, slice::HalfFloatSliceExt};
use nibble_core::{Error, Result};

use super::GgmlType;

/// Dequantizes `dst.len()` elements stored as `ty` in `src` (whole blocks only).
/// Errors (never panics) when dst.len() is not a multiple of the block size or src.len() != the bytes that many elements need.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let (block_elems, block_bytes) = (ty.block_elems(), ty.block_bytes());
    let elems = dst.len();
    if !elems.is_multiple_of(block_elems) {
        return Err(Error::InvalidArgument(format!(
            "dequantizing {ty}: {elems} output elements is not a multiple of the \
             {block_elems}-element block"
        )));
    }
    // Cannot overflow: every type stores at most 4 bytes per element, and `dst` is a live f32 slice.
    let need = elems / block_elems * block_bytes;
    if src.len() != need {
        return Err(Error::InvalidArgument(format!(
            "dequantizing {ty}: {elems} elements need {need} bytes ({} blocks of {block_bytes}), \
             but the source has {} bytes",
            elems / block_elems,
            src.len()
        )));
    }
    match ty {
        GgmlType::F32 => dequant_f32(src, dst),
        GgmlType::F16 => dequant_f16(src, dst),
        GgmlType::BF16 => dequant_bf16(src, dst),
        GgmlType::Q4_0 => blocks(src, dst).for_each(|(b, y)| block_q4_0(b, y)),
        GgmlType::Q4_1 => blocks(src, dst).for_each(|(b, y)| block_q4_1(b, y)),
        GgmlType::Q5_0 => blocks(src, dst).for_each(|(b, y)| block_q5_0(b, y)),
        GgmlType::Q5_1 => blocks(src, dst).for_each(|(b, y)| block_q5_1(b, y)),
        GgmlType::Q8_0 => blocks(src, dst).for_each(|(b, y)| block_q8_0(b, y)),
        GgmlType::Q4K => blocks(src, dst).for_each(|(b, y)| block_q4_k(b, y)),
        GgmlType::Q5K => blocks(src, dst).for_each(|(b, y)| block_q5_k(b, y)),
        GgmlType::Q6K => blocks(src, dst).for_each(|(b, y)| block_q6_k(b, y)),
    }
    Ok(())
}

/// Pairs each `B`-byte block of `src` with its `N` outputs in `dst`, both as fixed-size arrays so
/// the kernels index with compile-time bounds. Lengths were checked by `dequantize`.
fn blocks<'a, const B: usize, const N: usize>(
    src: &'a [u8],
    dst: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8; B], &'a mut [f32; N])> {
    src.chunks_exact(B)
        .zip(dst.chunks_exact_mut(N))
        // chunks_exact yields exactly B (resp. N) items, so these conversions cannot fail.
        .map(|(b, y)| (b.try_into().unwrap(), y.try_into().unwrap()))
}

/// The `N` bytes of a block starting at `at` (offsets are constants, so the check folds away).
#[inline(always)]
fn field<const N: usize>(block: &[u8], at: usize) -> &[u8; N] {
    block[at..at + N].try_into().unwrap()
}

/// The little-endian f16 at byte `at` of a block, as f32.
#[inline(always)]
fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes(*field(block, at)).to_f32()
}

fn dequant_f32(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn dequant_f16(src: &[u8], dst: &mut [f32]) {
    // half's slice conversion uses F16C/NEON where available (detected once per call, unlike
    // `f16::to_f32`), so go through a small stack buffer of f16s.
    const CHUNK: usize = 64;
    let mut buf = [f16::ZERO; CHUNK];
    for (src, dst) in src.chunks(2 * CHUNK).zip(dst.chunks_mut(CHUNK)) {
        for (h, b) in buf.iter_mut().zip(src.chunks_exact(2)) {
            *h = f16::from_le_bytes([b[0], b[1]]);
        }
        buf[..dst.len()].convert_to_f32_slice(dst);
    }
}

fn dequant_bf16(src: &[u8], dst: &mut [f32]) {
    // A bf16 is the top half of an f32 (the conversion is exact).
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// Q4_0, 18 bytes: `d: f16`, `qs: [u8; 16]`; `x = d * (q - 8)`, q in 0..16.
#[inline(always)]
fn block_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs: &[u8; 16] = field(b, 2);
    let (lo, hi) = y.split_at_mut(16);
    for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = ((q & 0x0F) as i32 - 8) as f32 * d;
        *hi = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1, 20 bytes: `d: f16`, `m: f16`, `qs: [u8; 16]`; `x = d * q + m`, q in 0..16.
#[inline(always)]
fn block_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs: &[u8; 16] = field(b, 4);
    let (lo, hi) = y.split_at_mut(16);
    for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = (q & 0x0F) as f32 * d + m;
        *hi = (q >> 4) as f32 * d + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block: bit `i` of the little-endian u32 `qh` is bit 4 of
/// element `i`; the nibbles in `qs` are as in Q4_0.
#[inline(always)]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    // Testing against per-lane masks (rather than shifting by the lane index) vectorizes.
    const BIT: [u32; 32] = {
        let mut bit = [0; 32];
        let mut i = 0;
        while i < 32 {
            bit[i] = 1 << i;
            i += 1;
        }
        bit
    };
    let qh = u32::from_le_bytes(*qh);
    let mut q = [0u8; 32];
    let (lo, hi) = q.split_at_mut(16);
    let (bit_lo, bit_hi) = BIT.split_at(16);
    for (((&b, lo), hi), (&m_lo, &m_hi)) in qs.iter().zip(lo).zip(hi).zip(bit_lo.iter().zip(bit_hi))
    {
        *lo = (b & 0x0F) | if qh & m_lo != 0 { 0x10 } else { 0 };
        *hi = (b >> 4) | if qh & m_hi != 0 { 0x10 } else { 0 };
    }
    q
}

/// Q5_0, 22 bytes: `d: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; `x = d * (q - 16)`, q in 0..32.
#[inline(always)]
fn block_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let q = q5_values(field(b, 2), field(b, 6));
    for (y, &q) in y.iter_mut().zip(&q) {
        *y = (q as i32 - 16) as f32 * d;
    }
}

/// Q5_1, 24 bytes: `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; `x = d * q + m`, q in 0..32.
#[inline(always)]
fn block_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let q = q5_values(field(b, 4), field(b, 8));
    for (y, &q) in y.iter_mut().zip(&q) {
        *y = q as f32 * d + m;
    }
}

/// Q8_0, 34 bytes: `d: f16`, `qs: [i8; 32]`; `x = d * q`.
#[inline(always)]
fn block_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs: &[u8; 32] = field(b, 2);
    for (y, &q) in y.iter_mut().zip(qs) {
        *y = q as i8 as f32 * d;
    }
}

/// Unpacks the 12 `scales` bytes of Q4_K/Q5_K into eight 6-bit (scale, min) pairs, one per
/// 32-element sub-block (ggml's `get_scale_min_k4`). Bytes 0-3 hold scales 0-3 in their low 6
/// bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits from bytes 8-11 (scale in
/// the low nibble, min in the high one) and their top 2 bits from bits 6-7 of bytes 0-3 / 4-7.
#[inline(always)]
fn k_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q4_K, 144 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`.
/// Sub-block `s` (32 elements) is `x = (d * sc[s]) * q - dmin * m[s]`, q in 0..16; sub-blocks
/// `2i` and `2i + 1` are the low and high nibbles of `qs[32i..32i + 32]`.
#[inline(always)]
fn block_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k_scales_mins(field(b, 4));
    let qs: &[u8; 128] = field(b, 16);
    let pairs = qs.chunks_exact(32).zip(y.chunks_exact_mut(64));
    for ((qs, y), (sc, mn)) in pairs.zip(sc.chunks_exact(2).zip(mn.chunks_exact(2))) {
        let (d1, m1) = (d * sc[0] as f32, dmin * mn[0] as f32);
        let (d2, m2) = (d * sc[1] as f32, dmin * mn[1] as f32);
        let (lo, hi) = y.split_at_mut(32);
        for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
            *lo = d1 * (q & 0x0F) as f32 - m1;
            *hi = d2 * (q >> 4) as f32 - m2;
        }
    }
}

/// Q5_K, 176 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]`.
/// As Q4_K with q in 0..32, whose bit 4 for element `l` of sub-block `s` is bit `s` of `qh[l]`.
#[inline(always)]
fn block_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k_scales_mins(field(b, 4));
    let qh: &[u8; 32] = field(b, 16);
    let qs: &[u8; 128] = field(b, 48);
    let pairs = qs.chunks_exact(32).zip(y.chunks_exact_mut(64));
    let scales = sc.chunks_exact(2).zip(mn.chunks_exact(2));
    for (i, ((qs, y), (sc, mn))) in pairs.zip(scales).enumerate() {
        let (d1, m1) = (d * sc[0] as f32, dmin * mn[0] as f32);
        let (d2, m2) = (d * sc[1] as f32, dmin * mn[1] as f32);
        // Bits of qh[l] holding bit 4 of sub-blocks 2i and 2i + 1 (ggml's u1, u2).
        let (u1, u2) = (1u8 << (2 * i), 2u8 << (2 * i));
        let (lo, hi) = y.split_at_mut(32);
        for (((&q, &h), lo), hi) in qs.iter().zip(qh).zip(lo).zip(hi) {
            let q1 = (q & 0x0F) | if h & u1 != 0 { 0x10 } else { 0 };
            let q2 = (q >> 4) | if h & u2 != 0 { 0x10 } else { 0 };
            *lo = d1 * q1 as f32 - m1;
            *hi = d2 * q2 as f32 - m2;
        }
    }
}

/// Q6_K, 210 bytes: `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`;
/// `x = (d * scales[k]) * (q - 32)` for the k-th run of 16 elements, q in 0..64.
/// Each 128-element half uses 64 bytes of `ql` and 32 of `qh`; its quarter `k` (32 elements,
/// index `l`) takes its low 4 bits from nibble `k / 2` of `ql[32 * (k % 2) + l]` and its top 2
/// bits from bits `2k..2k + 2` of `qh[l]`.
#[inline(always)]
fn block_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let sc: &[u8; 16] = field(b, 192);
    let d = f16_at(b, 208);
    // First gather the 6-bit values (byte-wide work), then scale them per run of 16.
    let mut q = [0u8; 256];
    for (half, q) in q.chunks_exact_mut(128).enumerate() {
        let ql: &[u8; 64] = field(b, 64 * half);
        let qh: &[u8; 32] = field(b, 128 + 32 * half);
        let q: &mut [u8; 128] = q.try_into().unwrap();
        #[allow(clippy::needless_range_loop)] // mirrors ggml's loop; all indices are in bounds
        for l in 0..32 {
            q[l] = (ql[l] & 0x0F) | (qh[l] & 0x03) << 4;
            q[l + 32] = (ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 0x03) << 4;
            q[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 0x03) << 4;
            q[l + 96] = (ql[l + 32] >> 4) | (qh[l] >> 6) << 4;
        }
    }
    for ((y, q), &sc) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(sc) {
        let s = d * sc as i8 as f32;
        for (y, &q) in y.iter_mut().zip(q) {
            *y = s * (q as i32 - 32) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn dequant(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; n];
        dequantize(ty, src, &mut y).unwrap();
        y
    }

    #[test]
    fn q4_0_hand_worked_block() {
        // d = 0.5; byte j = (15 - j) << 4 | j, so element j (low nibble) is q = j and element
        // j + 16 (high nibble) is q = 15 - j; x = 0.5 * (q - 8).
        let mut b = f16_bytes(0.5).to_vec();
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let y = dequant(GgmlType::Q4_0, &b, 32);
        #[rustfmt::skip]
        let want = [
            -4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
            3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, -4.0,
        ];
        assert_eq!(y, want);
    }

    #[test]
    fn q4_1_hand_worked_block() {
        // d = 0.25, m = -1; same nibbles as the Q4_0 test; x = 0.25 * q - 1.
        let mut b = f16_bytes(0.25).to_vec();
        b.extend(f16_bytes(-1.0));
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let y = dequant(GgmlType::Q4_1, &b, 32);
        #[rustfmt::skip]
        let want = [
            -1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75,
            1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75,
            2.75, 2.5, 2.25, 2.0, 1.75, 1.5, 1.25, 1.0,
            0.75, 0.5, 0.25, 0.0, -0.25, -0.5, -0.75, -1.0,
        ];
        assert_eq!(y, want);
    }

    #[test]
    fn q8_0_hand_worked_block() {
        // d = 2; q[j] = 4j - 64 for j in 1..31, q[0] = -128 and q[31] = 127 (the i8 extremes);
        // x = 2q: -256, then 8j - 128, then 254.
        let mut b = f16_bytes(2.0).to_vec();
        b.extend((0..32i32).map(|j| match j {
            0 => -128i8 as u8,
            31 => 127,
            _ => (4 * j - 64) as i8 as u8,
        }));
        let y = dequant(GgmlType::Q8_0, &b, 32);
        #[rustfmt::skip]
        let want = [
            -256.0, -120.0, -112.0, -104.0, -96.0, -88.0, -80.0, -72.0,
            -64.0, -56.0, -48.0, -40.0, -32.0, -24.0, -16.0, -8.0,
            0.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0,
            64.0, 72.0, 80.0, 88.0, 96.0, 104.0, 112.0, 254.0,
        ];
        assert_eq!(y, want);
    }

    #[test]
    fn q4_k_hand_worked_block() {
        // d = 1, dmin = 0.5. Each 32-element sub-block s gets one q for all its elements, so it
        // decodes to the constant d * sc * q - dmin * m:
        //   s  sc  m   q   value
        //   0   1   0   3   3 - 0     =   3.0
        //   1   2   1   5  10 - 0.5   =   9.5
        //   2   3   2  15  45 - 1     =  44.0
        //   3   4   3   0   0 - 1.5   =  -1.5
        //   4  17   5   1  17 - 2.5   =  14.5
        //   5  18  16   2  36 - 8     =  28.0
        //   6  40  33   7 280 - 16.5  = 263.5
        //   7  63  63  15 945 - 31.5  = 913.5
        // Scale bytes: j in 0..4: byte j = sc[j] | (sc[j+4] >> 4) << 6,
        // byte j+4 = m[j] | (m[j+4] >> 4) << 6, byte j+8 = (sc[j+4] & 15) | (m[j+4] & 15) << 4.
        let scales = [
            1 | 1 << 6, // sc0 = 1, top bits of sc4 = 17 >> 4 = 1
            2 | 1 << 6, // sc1 = 2, sc5 = 18 >> 4 = 1
            3 | 2 << 6, // sc2 = 3, sc6 = 40 >> 4 = 2
            4 | 3 << 6, // sc3 = 4, sc7 = 63 >> 4 = 3
            0,          // m0 = 0, m4 = 5 >> 4 = 0
            1 | 1 << 6, // m1 = 1, m5 = 16 >> 4 = 1
            2 | 2 << 6, // m2 = 2, m6 = 33 >> 4 = 2
            3 | 3 << 6, // m3 = 3, m7 = 63 >> 4 = 3
            1 | 5 << 4, // sc4 & 15 = 1, m4 & 15 = 5
            2,          // sc5 & 15 = 2, m5 & 15 = 0
            8 | 1 << 4, // sc6 & 15 = 8, m6 & 15 = 1
            0xFF,       // sc7 & 15 = 15, m7 & 15 = 15
        ];
        let mut b = f16_bytes(1.0).to_vec();
        b.extend(f16_bytes(0.5));
        b.extend(scales);
        // qs[32i..32i + 32]: low nibble = q of sub-block 2i, high nibble = q of sub-block 2i + 1.
        for byte in [5 << 4 | 3, 15, 2 << 4 | 1, 15 << 4 | 7] {
            b.extend([byte; 32]);
        }
        assert_eq!(b.len(), 144);
        let y = dequant(GgmlType::Q4K, &b, 256);
        let want = [3.0, 9.5, 44.0, -1.5, 14.5, 28.0, 263.5, 913.5];
        for (s, (sub, &w)) in y.chunks_exact(32).zip(&want).enumerate() {
            assert!(sub.iter().all(|&x| x == w), "sub-block {s}: {sub:?} != {w}");
        }
    }

    /// Compares with gguf-py's reference output (`scripts/gen_ggml_fixtures.py`) bit for bit:
    /// the kernels follow the reference's operation order with single f32 roundings, so every
    /// result (including -0.0 and infinities) must match exactly.
    fn check_fixture(ty: GgmlType, raw: &[u8], expected: &[u8]) {
        let want: Vec<f32> = expected
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(
            raw.len(),
            ty.bytes_for(want.len()).unwrap(),
            "{ty} fixture size"
        );
        let got = dequant(ty, raw, want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{ty} element {i}: got {g:e}, want {w:e}"
            );
        }
        // Block by block (as a row-at-a-time caller would) gives the same results.
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        for (i, (src, w)) in raw.chunks(bb * 2).zip(want.chunks(be * 2)).enumerate() {
            let got = dequant(ty, src, w.len());
            assert!(
                got.iter().zip(w).all(|(g, w)| g.to_bits() == w.to_bits()),
                "{ty} block pair {i}"
            );
        }
    }

    macro_rules! fixture_tests {
        ($($name:ident: $ty:expr, $file:literal;)*) => {$(
            #[test]
            fn $name() {
                check_fixture(
                    $ty,
                    include_bytes!(concat!("../../tests/fixtures/ggml/", $file, ".bin")),
                    include_bytes!(concat!("../../tests/fixtures/ggml/", $file, ".f32")),
                );
            }
        )*};
    }

    fixture_tests! {
        fixture_f32: GgmlType::F32, "f32";
        fixture_f16: GgmlType::F16, "f16";
        fixture_bf16: GgmlType::BF16, "bf16";
        fixture_q4_0: GgmlType::Q4_0, "q4_0";
        fixture_q4_1: GgmlType::Q4_1, "q4_1";
        fixture_q5_0: GgmlType::Q5_0, "q5_0";
        fixture_q5_1: GgmlType::Q5_1, "q5_1";
        fixture_q8_0: GgmlType::Q8_0, "q8_0";
        fixture_q4_k: GgmlType::Q4K, "q4_k";
        fixture_q5_k: GgmlType::Q5K, "q5_k";
        fixture_q6_k: GgmlType::Q6K, "q6_k";
    }

    #[test]
    fn wrong_src_length_is_an_error() {
        let mut y = [0.0f32; 32];
        for len in [0, 17, 19, 36] {
            let err = dequantize(GgmlType::Q4_0, &vec![0u8; len], &mut y).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::InvalidArgument(_)), "{msg}");
            assert!(
                msg.contains("Q4_0") && msg.contains("18") && msg.contains(&format!("{len} bytes")),
                "{msg}"
            );
        }
    }

    #[test]
    fn dst_not_whole_blocks_is_an_error() {
        let src = [0u8; 144];
        for n in [1, 255, 257] {
            let mut y = vec![0.0f32; n];
            let err = dequantize(GgmlType::Q4K, &src, &mut y).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::InvalidArgument(_)), "{msg}");
            assert!(
                msg.contains("Q4_K") && msg.contains(&n.to_string()) && msg.contains("256"),
                "{msg}"
            );
        }
    }

    #[test]
    fn truncated_or_odd_inputs_error_for_every_type() {
        for ty in GgmlType::ALL {
            let (be, bb) = (ty.block_elems(), ty.block_bytes());
            // Empty in, empty out is fine.
            assert!(dequantize(ty, &[], &mut []).is_ok(), "{ty}");
            for n_blocks in [1, 3] {
                let n = n_blocks * be;
                let need = n_blocks * bb;
                // Arbitrary bytes of the right length decode without panicking (maybe to NaN).
                let bytes: Vec<u8> = (0..need + bb).map(|i| (i * 37 + 11) as u8).collect();
                assert!(
                    dequantize(ty, &bytes[..need], &mut vec![0.0; n]).is_ok(),
                    "{ty}"
                );
                // Truncated (by a byte, a block, everything), overlong (by a byte, nearly or
                // exactly a block).
                for len in [need - 1, need - bb, 0, need + 1, need + bb - 1, need + bb] {
                    let r = dequantize(ty, &bytes[..len], &mut vec![0.0; n]);
                    assert!(r.is_err(), "{ty}: {n} elements from {len} bytes");
                }
                // Outputs that are not whole blocks (only possible for block types).
                if be > 1 {
                    for m in [n - 1, n + 1] {
                        let r = dequantize(ty, &bytes[..need], &mut vec![0.0; m]);
                        assert!(r.is_err(), "{ty}: {m} elements");
                    }
                }
            }
        }
    }
}

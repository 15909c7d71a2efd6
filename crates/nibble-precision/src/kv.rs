//! KV cache formats: how keys and values are packed, and the CPU reference of the values
//! attention reads back. A backend stores these bytes; its attention kernel must read exactly
//! the values [`TokenCodec::dequantize`] and [`ChannelKeys::dequantize`] produce.
//!
//! A cache stores its keys as [`KvSpec::k`]'s key layout says and its values as [`KvSpec::v`]'s
//! value codec says; the records below are per side, so a mix (`k8v4`) is the `kv8` key records
//! next to the `kv4` value records. A side whose format is channel-wise (`k4c`, `v2c`) waits for
//! its block to fill ([`KvSpec::buffered`]); the other side is quantized as it is written.
//!
//! # Quantizers
//!
//! * Unsigned `b`-bit codes (`kv8`, `kv4`, and the values of `kv4c`/`kv2c`), per token per KV
//!   head, asymmetric min-max: `s = f16((max - min) / (2^b - 1))`, `z = f16(min)`,
//!   `q = clamp(round((x - z) / s), 0, 2^b - 1)` (IEEE division, halves away from zero), read
//!   back as `x̂ = fma(q, s, z)` in f32. Quantizing with the f16-rounded `s` and `z` makes `x̂`
//!   the value closest to `x` on the grid the reader actually sees. A scale that is 0 in f16 (a
//!   constant head) gives all codes 0 and `x̂ = z` exactly.
//! * FP8 (`kvfp8`), per token per KV head: `s = f16(max|x| / 448)`, codes
//!   `e4m3(clamp(x / s, -448, 448))` rounded to nearest even, `x̂ = e4m3_value * s`. `s == 0`
//!   (an all-zero head) stores zeros.
//! * Channel-wise keys (`kv4c`/`kv2c`, BitDecoding/KIVI): one asymmetric min-max `(s, z)` per
//!   channel over the tokens of one full KV block, same arithmetic as above. The block being
//!   filled is not quantized at all: the backend keeps it in full precision (the residual
//!   buffer) and quantizes keys and values together when its last slot is written, so the
//!   quantization group is the paged pool's block. Blocks must hold at least
//!   [`MIN_CHANNEL_BLOCK`] tokens: the 4 bytes of parameters per channel per block then cost at
//!   most 2 bits per key element, and the channel statistics cover enough tokens to mean
//!   something.
//!
//! # Byte layouts (little-endian)
//!
//! `D` = head dim, `B` = block size in tokens, `b` = code bits. A run of `n` codes takes
//! `ceil(n * b / 8)` bytes; code `e` sits at bit `(e * b) % 8` of byte `e * b / 8` (4-bit:
//! element `2j` in the low nibble of byte `j`; 2-bit: element `4j + i` in bits `2i..2i+2` of
//! byte `j`); unused high bits of the last byte are zero.
//!
//! | record | bytes |
//! |---|---|
//! | one token, one head, `kv8` / `kv4` (K and V), `kv4c` / `kv2c` (V) | `ceil(D*b/8)` codes, f16 scale, f16 zero |
//! | one token, one head, `kvfp8` (K and V) | `D` e4m3 codes, f16 scale |
//! | one full block, one head, `kv4c` / `kv2c` (K) | `B` runs of `ceil(D*b/8)` codes (token-major), then `D` pairs (f16 scale, f16 zero), one per channel (BitDecoding's `half2`) |
//! | `kv16` | the backend's unquantized float, `D` per token per head |
//!
//! # Pages (the GPU pool)
//!
//! A GPU pool keeps each block of each KV head as one self-describing page of a side's per-token
//! records, split into their parts so that every part stays 16-byte aligned for vector loads:
//! the `B` code runs (token-major, `ceil(D*b/8)` bytes each, as in the record), then the `B`
//! parameter records (f16 scale and f16 zero; f16 scale for `fp8`), slot order
//! ([`TokenCodec::page_bytes`], [`TokenCodec::put_page_record`]). The bytes of a record are the
//! same; only where they sit differs.
//!
//! # Values a quantized cache refuses
//!
//! Quantization would silently turn a NaN into a finite number (min/max skip it) and an
//! infinity into NaN scales, hiding a broken forward pass; and a zero outside ±65504 does not fit
//! its f16. So every quantizer here refuses non-finite values and magnitudes above [`KV_MAX`]
//! with an error, and a backend checks a whole batch before writing any of it. `kv16` stores
//! whatever it is given, so NaN propagates into the attention output as in any float cache.

use std::sync::OnceLock;

use float8::F8E4M3;
use half::f16;
use nibble_core::{Error, Result};

use crate::spec::{KvFormat, KvSpec};
use crate::weight::FP8_MAX;

/// Largest magnitude a quantized cache stores: the f16 range of its zero point.
pub const KV_MAX: f32 = 65504.0;

/// Smallest KV block (= quantization group) of the channel-wise formats.
pub const MIN_CHANNEL_BLOCK: usize = 16;

/// Width of unsigned codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UintBits {
    B8,
    B4,
    B2,
}

impl UintBits {
    pub fn bits(self) -> u32 {
        match self {
            UintBits::B8 => 8,
            UintBits::B4 => 4,
            UintBits::B2 => 2,
        }
    }

    fn max_code(self) -> f32 {
        ((1u32 << self.bits()) - 1) as f32
    }

    /// Bytes of a run of `n` codes.
    pub fn code_bytes(self, n: usize) -> usize {
        (n * self.bits() as usize).div_ceil(8)
    }
}

/// How one token's vector of one KV head is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenCodec {
    /// Unsigned codes, asymmetric min-max, f16 scale and zero.
    Uint(UintBits),
    /// e4m3 codes, f16 scale `max|x| / 448`.
    Fp8,
}

/// Keys quantized per channel over the tokens of a full KV block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChannelKeys(pub UintBits);

/// How a format stores keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyLayout {
    /// The backend's unquantized float.
    Float,
    PerToken(TokenCodec),
    PerChannel(ChannelKeys),
}

/// Index of the first value a quantized cache cannot store (non-finite, or beyond ±[`KV_MAX`]).
pub fn first_unstorable(xs: &[f32]) -> Option<usize> {
    xs.iter().position(|x| !x.is_finite() || x.abs() > KV_MAX)
}

fn check_storable(xs: &[f32], what: &str) -> Result<()> {
    match first_unstorable(xs) {
        None => Ok(()),
        Some(i) => Err(Error::InvalidArgument(format!(
            "{what} element {i} is {}: a quantized KV cache stores only finite values within \
             ±{KV_MAX}",
            xs[i]
        ))),
    }
}

/// `(s, z)` of the range `[lo, hi]`, both rounded to f16. `lo` and `hi` are storable, so
/// neither overflows f16.
fn min_max_params(lo: f32, hi: f32, bits: UintBits) -> (f32, f32) {
    let s = f16::from_f32((hi - lo) / bits.max_code()).to_f32();
    (s, f16::from_f32(lo).to_f32())
}

fn encode(x: f32, s: f32, z: f32, max: f32) -> u8 {
    if s == 0.0 {
        0
    } else {
        ((x - z) / s).round().clamp(0.0, max) as u8
    }
}

#[inline(always)]
fn decode(q: u8, s: f32, z: f32) -> f32 {
    (q as f32).mul_add(s, z)
}

/// Packs codes into `out` (its length is the run's byte count).
fn pack(codes: impl Iterator<Item = u8>, bits: UintBits, out: &mut [u8]) {
    out.fill(0);
    let b = bits.bits() as usize;
    let per = 8 / b;
    for (e, q) in codes.enumerate() {
        out[e / per] |= q << ((e % per) * b);
    }
}

/// Unpacks the first `q.len()` codes of a run, one per byte.
#[inline(always)]
fn unpack(bits: UintBits, codes: &[u8], q: &mut [u8]) {
    match bits {
        UintBits::B8 => q.copy_from_slice(&codes[..q.len()]),
        UintBits::B4 => {
            let mut pairs = q.chunks_exact_mut(2);
            for (x, &b) in (&mut pairs).zip(codes) {
                x[0] = b & 0x0f;
                x[1] = b >> 4;
            }
            if let [last] = pairs.into_remainder() {
                *last = codes[codes.len() - 1] & 0x0f;
            }
        }
        UintBits::B2 => {
            let mut quads = q.chunks_exact_mut(4);
            for (x, &b) in (&mut quads).zip(codes) {
                x[0] = b & 3;
                x[1] = (b >> 2) & 3;
                x[2] = (b >> 4) & 3;
                x[3] = b >> 6;
            }
            let last = codes.last().copied().unwrap_or(0);
            for (i, x) in quads.into_remainder().iter_mut().enumerate() {
                *x = (last >> (2 * i)) & 3;
            }
        }
    }
}

/// Decodes a run of codes sharing one `(s, z)`. Narrow codes go through a table of their 16 or 4
/// values (the same `fma(q, s, z)` each), which is cheaper than converting every element.
#[inline(always)]
fn decode_token_run(bits: UintBits, codes: &[u8], out: &mut [f32], s: f32, z: f32) {
    let table = || -> [f32; 16] { std::array::from_fn(|q| decode(q as u8, s, z)) };
    match bits {
        UintBits::B8 => {
            for (o, &q) in out.iter_mut().zip(codes) {
                *o = decode(q, s, z);
            }
        }
        UintBits::B4 => {
            let table = table();
            let mut pairs = out.chunks_exact_mut(2);
            for (o, &b) in (&mut pairs).zip(codes) {
                o[0] = table[(b & 0x0f) as usize];
                o[1] = table[(b >> 4) as usize];
            }
            if let [last] = pairs.into_remainder() {
                *last = table[(codes[codes.len() - 1] & 0x0f) as usize];
            }
        }
        UintBits::B2 => {
            let table = table();
            let mut quads = out.chunks_exact_mut(4);
            for (o, &b) in (&mut quads).zip(codes) {
                o[0] = table[(b & 3) as usize];
                o[1] = table[((b >> 2) & 3) as usize];
                o[2] = table[((b >> 4) & 3) as usize];
                o[3] = table[(b >> 6) as usize];
            }
            let last = codes.last().copied().unwrap_or(0);
            for (i, o) in quads.into_remainder().iter_mut().enumerate() {
                *o = table[((last >> (2 * i)) & 3) as usize];
            }
        }
    }
}

fn min_max(xs: impl Iterator<Item = f32>) -> (f32, f32) {
    xs.fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    })
}

fn put_f16(out: &mut [u8], x: f32) {
    out[..2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn get_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// e4m3 code -> f32, all 256 of them.
fn fp8_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| F8E4M3::from_bits(b as u8).to_f32()))
}

impl TokenCodec {
    /// Bytes of one record of `head_dim` elements.
    pub fn record_bytes(self, head_dim: usize) -> usize {
        match self {
            TokenCodec::Uint(bits) => bits.code_bytes(head_dim) + 4,
            TokenCodec::Fp8 => head_dim + 2,
        }
    }

    /// Bytes of the codes of one record (the record without its parameters).
    pub fn code_bytes(self, head_dim: usize) -> usize {
        self.record_bytes(head_dim) - self.param_bytes()
    }

    /// Bytes of the parameters of one record: f16 scale and zero, or the f16 scale of `fp8`.
    pub fn param_bytes(self) -> usize {
        match self {
            TokenCodec::Uint(_) => 4,
            TokenCodec::Fp8 => 2,
        }
    }

    /// Bytes of one page: the records of `block` slots of one head, codes first, then the
    /// parameters (module docs, "Pages").
    pub fn page_bytes(self, head_dim: usize, block: usize) -> usize {
        block * self.record_bytes(head_dim)
    }

    /// Where slot `slot`'s codes and parameters sit in a page of `block` slots.
    fn page_parts(self, head_dim: usize, block: usize, slot: usize) -> (usize, usize) {
        let cb = self.code_bytes(head_dim);
        (slot * cb, block * cb + slot * self.param_bytes())
    }

    /// Writes record `rec` into slot `slot` of `page`.
    pub fn put_page_record(
        self,
        rec: &[u8],
        head_dim: usize,
        block: usize,
        slot: usize,
        page: &mut [u8],
    ) {
        let (cb, pb) = (self.code_bytes(head_dim), self.param_bytes());
        let (codes, params) = self.page_parts(head_dim, block, slot);
        page[codes..codes + cb].copy_from_slice(&rec[..cb]);
        page[params..params + pb].copy_from_slice(&rec[cb..]);
    }

    /// The record in slot `slot` of `page`.
    pub fn page_record(self, page: &[u8], head_dim: usize, block: usize, slot: usize) -> Vec<u8> {
        let (cb, pb) = (self.code_bytes(head_dim), self.param_bytes());
        let (codes, params) = self.page_parts(head_dim, block, slot);
        [&page[codes..codes + cb], &page[params..params + pb]].concat()
    }

    /// Quantizes one head vector into `out` (`record_bytes(x.len())` long).
    pub fn quantize(self, x: &[f32], out: &mut [u8]) -> Result<()> {
        check_storable(x, "KV")?;
        if out.len() != self.record_bytes(x.len()) {
            return Err(Error::InvalidArgument(format!(
                "{self:?}: a record of {} bytes for {} elements needs {}",
                out.len(),
                x.len(),
                self.record_bytes(x.len())
            )));
        }
        match self {
            TokenCodec::Uint(bits) => {
                let (lo, hi) = min_max(x.iter().copied());
                let (s, z) = if x.is_empty() {
                    (0.0, 0.0)
                } else {
                    min_max_params(lo, hi, bits)
                };
                let nc = bits.code_bytes(x.len());
                let max = bits.max_code();
                pack(
                    x.iter().map(|&v| encode(v, s, z, max)),
                    bits,
                    &mut out[..nc],
                );
                put_f16(&mut out[nc..], s);
                put_f16(&mut out[nc + 2..], z);
            }
            TokenCodec::Fp8 => {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = f16::from_f32(amax / FP8_MAX).to_f32();
                let n = x.len();
                for (o, &v) in out[..n].iter_mut().zip(x) {
                    *o = if s == 0.0 {
                        0
                    } else {
                        F8E4M3::from_f32((v / s).clamp(-FP8_MAX, FP8_MAX)).to_bits()
                    };
                }
                put_f16(&mut out[n..], s);
            }
        }
        Ok(())
    }

    /// The values attention reads from one record of `out.len()` elements.
    pub fn dequantize(self, rec: &[u8], out: &mut [f32]) {
        let n = out.len();
        match self {
            TokenCodec::Uint(bits) => {
                let nc = bits.code_bytes(n);
                let (s, z) = (get_f16(&rec[nc..]), get_f16(&rec[nc + 2..]));
                decode_token_run(bits, &rec[..nc], out, s, z);
            }
            TokenCodec::Fp8 => {
                let s = get_f16(&rec[n..]);
                let table = fp8_table();
                for (o, &b) in out.iter_mut().zip(&rec[..n]) {
                    *o = table[b as usize] * s;
                }
            }
        }
    }
}

impl ChannelKeys {
    /// Bytes of the keys of one head over a block of `tokens`.
    pub fn block_bytes(self, head_dim: usize, tokens: usize) -> usize {
        tokens * self.0.code_bytes(head_dim) + 4 * head_dim
    }

    /// Quantizes the keys of one head over `tokens` tokens: channel `c` of token `t` is
    /// `x[t * stride + c]`, `c < head_dim`. `out` is `block_bytes(head_dim, tokens)` long.
    pub fn quantize(
        self,
        x: &[f32],
        stride: usize,
        tokens: usize,
        head_dim: usize,
        out: &mut [u8],
    ) -> Result<()> {
        if tokens == 0
            || head_dim > stride
            || x.len() < (tokens - 1) * stride + head_dim
            || out.len() != self.block_bytes(head_dim, tokens)
        {
            return Err(Error::InvalidArgument(format!(
                "channel-wise keys: {} floats (stride {stride}) and {} bytes do not hold \
                 {tokens} tokens of {head_dim} channels",
                x.len(),
                out.len()
            )));
        }
        for t in 0..tokens {
            check_storable(&x[t * stride..t * stride + head_dim], "key")?;
        }
        let bits = self.0;
        let run = bits.code_bytes(head_dim);
        let params_at = tokens * run;
        let max = bits.max_code();
        let mut params = Vec::with_capacity(head_dim);
        for c in 0..head_dim {
            let (lo, hi) = min_max((0..tokens).map(|t| x[t * stride + c]));
            let (s, z) = min_max_params(lo, hi, bits);
            put_f16(&mut out[params_at + 4 * c..], s);
            put_f16(&mut out[params_at + 4 * c + 2..], z);
            params.push((s, z));
        }
        for t in 0..tokens {
            let row = &x[t * stride..t * stride + head_dim];
            pack(
                row.iter()
                    .zip(&params)
                    .map(|(&v, &(s, z))| encode(v, s, z, max)),
                bits,
                &mut out[t * run..(t + 1) * run],
            );
        }
        Ok(())
    }

    /// The keys attention reads from one block record: token `t`, channel `c` go to
    /// `out[t * stride + c]`.
    pub fn dequantize(
        self,
        rec: &[u8],
        tokens: usize,
        head_dim: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let bits = self.0;
        let run = bits.code_bytes(head_dim);
        let p = &rec[tokens * run..];
        let scales: Vec<f32> = (0..head_dim).map(|c| get_f16(&p[4 * c..])).collect();
        let zeros: Vec<f32> = (0..head_dim).map(|c| get_f16(&p[4 * c + 2..])).collect();
        let mut q = vec![0u8; head_dim];
        for t in 0..tokens {
            unpack(bits, &rec[t * run..(t + 1) * run], &mut q);
            let o = &mut out[t * stride..t * stride + head_dim];
            for ((o, &q), (&s, &z)) in o.iter_mut().zip(&q).zip(scales.iter().zip(&zeros)) {
                *o = decode(q, s, z);
            }
        }
    }
}

impl KvFormat {
    pub fn keys(self) -> KeyLayout {
        match self {
            KvFormat::F16 => KeyLayout::Float,
            KvFormat::Int8 => KeyLayout::PerToken(TokenCodec::Uint(UintBits::B8)),
            KvFormat::Int4 => KeyLayout::PerToken(TokenCodec::Uint(UintBits::B4)),
            KvFormat::Fp8 => KeyLayout::PerToken(TokenCodec::Fp8),
            KvFormat::Int4Channel => KeyLayout::PerChannel(ChannelKeys(UintBits::B4)),
            KvFormat::Int2Channel => KeyLayout::PerChannel(ChannelKeys(UintBits::B2)),
        }
    }

    /// How values are stored; `None` for the unquantized cache.
    pub fn values(self) -> Option<TokenCodec> {
        match self {
            KvFormat::F16 => None,
            KvFormat::Int8 => Some(TokenCodec::Uint(UintBits::B8)),
            KvFormat::Int4 | KvFormat::Int4Channel => Some(TokenCodec::Uint(UintBits::B4)),
            KvFormat::Fp8 => Some(TokenCodec::Fp8),
            KvFormat::Int2Channel => Some(TokenCodec::Uint(UintBits::B2)),
        }
    }

    /// Keys per channel over each full block, with a full-precision residual for the block
    /// being filled.
    pub fn is_channelwise(self) -> bool {
        matches!(self.keys(), KeyLayout::PerChannel(_))
    }

    pub fn is_quantized(self) -> bool {
        self != KvFormat::F16
    }

    /// Bytes one token's keys take in one KV head, averaged over a full block (the channel-wise
    /// formats share their parameters over the block). `float_bytes` is the size of the
    /// backend's unquantized element, which `kv16` stores.
    pub fn key_bytes_per_token(
        self,
        head_dim: usize,
        block_size: usize,
        float_bytes: usize,
    ) -> f64 {
        match self.keys() {
            KeyLayout::Float => (head_dim * float_bytes) as f64,
            KeyLayout::PerToken(c) => c.record_bytes(head_dim) as f64,
            KeyLayout::PerChannel(c) => {
                c.block_bytes(head_dim, block_size) as f64 / block_size.max(1) as f64
            }
        }
    }

    /// Bytes one token's values take in one KV head.
    pub fn value_bytes_per_token(self, head_dim: usize, float_bytes: usize) -> usize {
        match self.values() {
            None => head_dim * float_bytes,
            Some(c) => c.record_bytes(head_dim),
        }
    }
}

impl KvSpec {
    pub fn keys(self) -> KeyLayout {
        self.k.keys()
    }

    /// How values are stored; `None` when they are unquantized.
    pub fn values(self) -> Option<TokenCodec> {
        self.v.values()
    }

    /// Keys wait in the block's full-precision residual until the block fills (channel-wise
    /// keys need the whole block for their statistics).
    pub fn keys_deferred(self) -> bool {
        self.k.is_channelwise()
    }

    /// Values wait in the block's residual until it fills: a `v4c`/`v2c` side, as `kv4c` and
    /// `kv2c` treat their values.
    pub fn values_deferred(self) -> bool {
        self.v.is_channelwise()
    }

    /// Either side waits for its block to fill: a pool of this format keeps a full-precision
    /// residual for each block being filled and writes blocks in slot order.
    pub fn buffered(self) -> bool {
        self.keys_deferred() || self.values_deferred()
    }

    /// Refuses blocks too small to be a channel-wise quantization group.
    pub fn check_block_size(self, block_size: usize) -> Result<()> {
        if block_size == 0 || (self.keys_deferred() && block_size < MIN_CHANNEL_BLOCK) {
            return Err(Error::InvalidArgument(format!(
                "a {self} KV cache cannot use blocks of {block_size} tokens: {}",
                if block_size == 0 {
                    "blocks must hold at least one token".to_string()
                } else {
                    format!(
                        "it quantizes keys per channel over each block, which must hold at \
                         least {MIN_CHANNEL_BLOCK} tokens"
                    )
                }
            )));
        }
        Ok(())
    }

    /// Bytes one token's keys and values take in one layer, averaged over a full block (the
    /// residual buffer of a block being filled is extra). `float_bytes` is the size of the
    /// backend's unquantized element, which a `16` side stores.
    pub fn bytes_per_token(
        self,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        float_bytes: usize,
    ) -> f64 {
        let keys = self
            .k
            .key_bytes_per_token(head_dim, block_size, float_bytes);
        let values = self.v.value_bytes_per_token(head_dim, float_bytes);
        num_kv_heads as f64 * (keys + values as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const UINTS: [UintBits; 3] = [UintBits::B8, UintBits::B4, UintBits::B2];

    /// Mostly N(0,1)-ish values with a few outliers, like rotated keys.
    fn random_head(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let x: f32 = rng.random_range(-2.0..2.0);
                if rng.random_bool(0.03) { x * 15.0 } else { x }
            })
            .collect()
    }

    fn roundtrip(codec: TokenCodec, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut rec = vec![0xaa; codec.record_bytes(x.len())];
        codec.quantize(x, &mut rec).unwrap();
        let mut back = vec![f32::NAN; x.len()];
        codec.dequantize(&rec, &mut back);
        (rec, back)
    }

    /// Error bound of the asymmetric quantizer: half a step, plus what the f16 rounding of the
    /// scale and zero can push the top and bottom codes off by (2^-11 relative each).
    fn uint_tol(lo: f32, hi: f32, bits: UintBits) -> f32 {
        let s = (hi - lo) / bits.max_code();
        0.5 * s * (1.0 + 1e-3) + (hi - lo + lo.abs()) * 2f32.powi(-10) + 1e-6
    }

    #[test]
    fn page_records_round_trip_and_pages_stay_aligned() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for codec in [
            TokenCodec::Uint(UintBits::B8),
            TokenCodec::Uint(UintBits::B4),
            TokenCodec::Fp8,
        ] {
            for (d, block) in [(64, 16), (128, 16), (128, 32)] {
                let page_bytes = codec.page_bytes(d, block);
                assert_eq!(page_bytes % 16, 0, "{codec:?} d={d}");
                let recs: Vec<Vec<u8>> = (0..block)
                    .map(|_| roundtrip(codec, &random_head(&mut rng, d)).0)
                    .collect();
                let mut page = vec![0u8; page_bytes];
                for (slot, rec) in recs.iter().enumerate().rev() {
                    codec.put_page_record(rec, d, block, slot, &mut page);
                }
                for (slot, rec) in recs.iter().enumerate() {
                    assert_eq!(&codec.page_record(&page, d, block, slot), rec);
                }
                // Codes first, token-major; then the parameters in slot order.
                let cb = codec.code_bytes(d);
                assert_eq!(&page[cb..2 * cb], &recs[1][..cb]);
                let pb = codec.param_bytes();
                assert_eq!(&page[block * cb..block * cb + pb], &recs[0][cb..]);
            }
        }
    }

    #[test]
    fn uint_token_round_trip_is_within_half_a_step() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for bits in UINTS {
            for d in [1, 2, 5, 7, 64, 128, 129] {
                for _ in 0..50 {
                    let x = random_head(&mut rng, d);
                    let (_, back) = roundtrip(TokenCodec::Uint(bits), &x);
                    let (lo, hi) = min_max(x.iter().copied());
                    let tol = uint_tol(lo, hi, bits);
                    for (a, b) in x.iter().zip(&back) {
                        assert!(
                            (a - b).abs() <= tol,
                            "{bits:?} d={d}: {a} -> {b} (tol {tol})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fp8_token_round_trip_is_within_e4m3_precision() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for d in [1, 3, 64, 128] {
            for _ in 0..50 {
                let x = random_head(&mut rng, d);
                let (_, back) = roundtrip(TokenCodec::Fp8, &x);
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in x.iter().zip(&back) {
                    // Half an ulp of a 3-bit mantissa, the subnormal step near zero, and the
                    // clamp at 448 after the f16 rounding of the scale.
                    let tol = a.abs() / 16.0 + amax / FP8_MAX * 2f32.powi(-9) + amax * 2e-3;
                    assert!((a - b).abs() <= tol, "d={d}: {a} -> {b} (tol {tol})");
                }
            }
        }
    }

    #[test]
    fn channel_keys_round_trip_is_within_half_a_step_per_channel() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for bits in [UintBits::B4, UintBits::B2] {
            let codec = ChannelKeys(bits);
            for (tokens, d, stride) in [(16, 64, 64), (16, 7, 21), (33, 10, 10), (128, 64, 192)] {
                let x = random_head(&mut rng, tokens * stride);
                let mut rec = vec![0xaa; codec.block_bytes(d, tokens)];
                codec.quantize(&x, stride, tokens, d, &mut rec).unwrap();
                let mut back = vec![f32::NAN; tokens * stride];
                codec.dequantize(&rec, tokens, d, &mut back, stride);
                for c in 0..d {
                    let col: Vec<f32> = (0..tokens).map(|t| x[t * stride + c]).collect();
                    let (lo, hi) = min_max(col.iter().copied());
                    let tol = uint_tol(lo, hi, bits);
                    for (t, a) in col.iter().enumerate() {
                        let b = back[t * stride + c];
                        assert!((a - b).abs() <= tol, "{bits:?} t{t} c{c}: {a} -> {b}");
                    }
                }
                // Only the channels of this head are written.
                for t in 0..tokens {
                    assert!(
                        back[t * stride + d..(t + 1) * stride]
                            .iter()
                            .all(|v| v.is_nan())
                    );
                }
            }
        }
    }

    /// Per-channel grouping is what makes 2-bit keys usable: a channel with a large offset
    /// (the outlier channels of rotated keys) costs nothing to the others.
    #[test]
    fn channel_grouping_isolates_an_outlier_channel() {
        let (tokens, d) = (16, 8);
        let x: Vec<f32> = (0..tokens * d)
            .map(|i| {
                let (t, c) = (i / d, i % d);
                let v = (t as f32 * 0.37 + c as f32).sin() * 0.1;
                if c == 3 { v + 40.0 } else { v }
            })
            .collect();
        let codec = ChannelKeys(UintBits::B2);
        let mut rec = vec![0; codec.block_bytes(d, tokens)];
        codec.quantize(&x, d, tokens, d, &mut rec).unwrap();
        let mut back = vec![0.0; tokens * d];
        codec.dequantize(&rec, tokens, d, &mut back, d);
        for (i, (a, b)) in x.iter().zip(&back).enumerate() {
            assert!((a - b).abs() < 0.05, "element {i}: {a} -> {b}");
        }
    }

    #[test]
    fn constant_and_zero_heads_are_exact() {
        for codec in [
            TokenCodec::Uint(UintBits::B8),
            TokenCodec::Uint(UintBits::B4),
            TokenCodec::Uint(UintBits::B2),
            TokenCodec::Fp8,
        ] {
            let (rec, back) = roundtrip(codec, &[0.0; 9]);
            assert!(
                rec.iter().all(|&b| b == 0),
                "{codec:?}: zero head -> {rec:?}"
            );
            assert!(back.iter().all(|&v| v == 0.0));
        }
        for bits in UINTS {
            // 0.1 is not an f16: the head comes back as its f16 zero, the same for every element.
            let (rec, back) = roundtrip(TokenCodec::Uint(bits), &[0.1; 9]);
            let z = f16::from_f32(0.1).to_f32();
            let nc = bits.code_bytes(9);
            assert!(rec[..nc].iter().all(|&b| b == 0), "{bits:?}: codes {rec:?}");
            assert_eq!(get_f16(&rec[nc..]), 0.0, "scale");
            assert!(back.iter().all(|&v| v == z), "{bits:?}: {back:?}");
            let (_, back) = roundtrip(TokenCodec::Uint(bits), &[-3.5; 4]);
            assert_eq!(back, vec![-3.5; 4], "an f16 constant is exact");
        }
        // A constant channel inside a varying block: its codes are all 0 and it is exact.
        let (tokens, d) = (16, 3);
        let x: Vec<f32> = (0..tokens * d)
            .map(|i| if i % d == 1 { 2.25 } else { i as f32 * 0.01 })
            .collect();
        let codec = ChannelKeys(UintBits::B4);
        let mut rec = vec![0; codec.block_bytes(d, tokens)];
        codec.quantize(&x, d, tokens, d, &mut rec).unwrap();
        let mut back = vec![0.0; tokens * d];
        codec.dequantize(&rec, tokens, d, &mut back, d);
        for t in 0..tokens {
            assert_eq!(back[t * d + 1], 2.25);
            // Channel 1 is the high nibble of byte 0 of each 2-byte token run.
            assert_eq!(rec[t * 2] >> 4, 0);
        }
    }

    #[test]
    fn non_finite_and_out_of_range_values_are_refused() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 65600.0, -1e9] {
            let mut x = vec![0.5f32; 8];
            x[5] = bad;
            assert_eq!(first_unstorable(&x), Some(5));
            for codec in [
                TokenCodec::Uint(UintBits::B8),
                TokenCodec::Uint(UintBits::B4),
                TokenCodec::Fp8,
            ] {
                let mut rec = vec![0; codec.record_bytes(8)];
                let err = codec.quantize(&x, &mut rec).unwrap_err().to_string();
                assert!(err.contains("element 5"), "{codec:?} {bad}: {err}");
            }
            let keys: Vec<f32> = (0..16 * 8)
                .map(|i| if i == 77 { bad } else { 1.0 })
                .collect();
            let codec = ChannelKeys(UintBits::B2);
            let mut rec = vec![0; codec.block_bytes(8, 16)];
            assert!(codec.quantize(&keys, 8, 16, 8, &mut rec).is_err(), "{bad}");
        }
        // The extremes themselves are storable: the widest range still has a finite f16 scale.
        let x = [KV_MAX, -KV_MAX, 0.0];
        assert_eq!(first_unstorable(&x), None);
        for bits in UINTS {
            let (_, back) = roundtrip(TokenCodec::Uint(bits), &x);
            let tol = uint_tol(-KV_MAX, KV_MAX, bits);
            for (a, b) in x.iter().zip(&back) {
                assert!(
                    b.is_finite() && (a - b).abs() <= tol,
                    "{bits:?}: {a} -> {b}"
                );
            }
        }
    }

    #[test]
    fn two_and_four_bit_codes_pack_exactly() {
        // 2-bit: values 0..=3 with min 0 and max 3 are their own codes (s = 1, z = 0).
        let x = [0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0, 1.0];
        let mut rec = vec![0; TokenCodec::Uint(UintBits::B2).record_bytes(9)];
        TokenCodec::Uint(UintBits::B2)
            .quantize(&x, &mut rec)
            .unwrap();
        assert_eq!(rec.len(), 3 + 4);
        assert_eq!(
            &rec[..3],
            &[0b11_10_01_00, 0b00_01_10_11, 0b00_00_00_01],
            "element 4j+i in bits 2i..2i+2 of byte j, unused bits zero"
        );
        assert_eq!(&rec[3..], &[0x00, 0x3c, 0x00, 0x00], "f16 1.0 and 0.0");

        // 4-bit: 0..=15 (s = 1, z = 0), element 2j in the low nibble of byte j.
        let x: Vec<f32> = [3, 12, 15, 0, 7].iter().map(|&v| v as f32).collect();
        let mut rec = vec![0; TokenCodec::Uint(UintBits::B4).record_bytes(5)];
        TokenCodec::Uint(UintBits::B4)
            .quantize(&x, &mut rec)
            .unwrap();
        assert_eq!(&rec[..3], &[0xc3, 0x0f, 0x07]);

        // Channel-wise 2-bit keys, 16 tokens x 2 channels: channel 0 counts 0..=3 over tokens,
        // channel 1 runs 6..=0 by steps of 2 (s = 2, z = 0); a token's two codes share a byte.
        let x: Vec<f32> = (0..16)
            .flat_map(|t| [(t % 4) as f32, (6 - 2 * (t % 4)) as f32])
            .collect();
        let codec = ChannelKeys(UintBits::B2);
        let mut rec = vec![0; codec.block_bytes(2, 16)];
        codec.quantize(&x, 2, 16, 2, &mut rec).unwrap();
        assert_eq!(rec.len(), 16 + 8);
        for (t, &byte) in rec[..16].iter().enumerate() {
            let (c0, c1) = (t % 4, 3 - t % 4);
            assert_eq!(byte as usize, c0 | (c1 << 2), "token {t}");
        }
        assert_eq!(
            &rec[16..],
            &[0x00, 0x3c, 0, 0, 0x00, 0x40, 0, 0],
            "(1, 0), (2, 0)"
        );
    }

    #[test]
    fn codes_fill_the_range_and_round_half_away_from_zero() {
        // 4-bit over [0, 15]: x = 2.5 sits exactly between codes 2 and 3.
        let mut x = vec![0.0, 15.0, 2.5, 7.4999, 7.5];
        x.push(14.6);
        let (rec, back) = roundtrip(TokenCodec::Uint(UintBits::B4), &x);
        assert_eq!(&rec[..3], &[0xf0, 0x73, 0xf8]);
        assert_eq!(back, vec![0.0, 15.0, 3.0, 7.0, 8.0, 15.0]);
    }

    #[test]
    fn bytes_per_token_follow_the_layouts() {
        let (h, d) = (3, 64);
        let u = KvSpec::uniform;
        let f32_bytes = u(KvFormat::F16).bytes_per_token(h, d, 16, 4);
        assert_eq!(f32_bytes, (3 * 64 * 4 * 2) as f64);
        assert_eq!(
            u(KvFormat::F16).bytes_per_token(h, d, 16, 2),
            (3 * 64 * 2 * 2) as f64
        );
        assert_eq!(
            u(KvFormat::Int8).bytes_per_token(h, d, 16, 4),
            (3 * 68 * 2) as f64
        );
        assert_eq!(
            u(KvFormat::Int4).bytes_per_token(h, d, 16, 4),
            (3 * 36 * 2) as f64
        );
        assert_eq!(
            u(KvFormat::Fp8).bytes_per_token(h, d, 16, 4),
            (3 * 66 * 2) as f64
        );
        // Keys: 32 bytes of codes + 64 (scale, zero) pairs shared by 16 tokens; values like kv4.
        assert_eq!(
            u(KvFormat::Int4Channel).bytes_per_token(h, d, 16, 4),
            3.0 * (32.0 + 256.0 / 16.0 + 36.0)
        );
        assert_eq!(
            u(KvFormat::Int2Channel).bytes_per_token(h, d, 128, 4),
            3.0 * (16.0 + 256.0 / 128.0 + 20.0)
        );
        // A mix pays each side's own record: INT8 keys (64 + 4) and INT4 values (32 + 4);
        // channel-wise INT4 keys and INT2 values; f32 keys and FP8 values.
        let mix = |s: &str| s.parse::<KvSpec>().unwrap();
        assert_eq!(
            mix("k8v4").bytes_per_token(h, d, 16, 4),
            (3 * (68 + 36)) as f64
        );
        assert_eq!(
            mix("k4cv2c").bytes_per_token(h, d, 16, 4),
            3.0 * (32.0 + 256.0 / 16.0 + 20.0)
        );
        assert_eq!(
            mix("k16vfp8").bytes_per_token(h, d, 16, 4),
            (3 * (256 + 66)) as f64
        );
        for kv in KvFormat::ALL {
            if kv.is_quantized() {
                // Smaller than even a 16-bit cache, at the smallest block allowed.
                assert!(
                    u(kv).bytes_per_token(h, d, 16, 4)
                        < u(KvFormat::F16).bytes_per_token(h, d, 16, 2) / 1.5
                );
            }
            for v in KvFormat::ALL {
                // Each side costs the same whatever the other side is.
                let at = |k, v| KvSpec { k, v }.bytes_per_token(h, d, 16, 4);
                assert_eq!(
                    at(kv, v) + f32_bytes,
                    at(kv, KvFormat::F16) + at(KvFormat::F16, v),
                    "k {kv}, v {v}"
                );
            }
        }
    }

    #[test]
    fn channel_keys_need_blocks_of_sixteen() {
        for k in KvFormat::ALL {
            for v in KvFormat::ALL {
                let kv = KvSpec { k, v };
                assert!(kv.check_block_size(0).is_err());
                assert!(kv.check_block_size(16).is_ok());
                // Deferred values need no block statistics: only channel-wise keys refuse.
                assert_eq!(kv.check_block_size(8).is_ok(), !k.is_channelwise(), "{kv}");
                assert_eq!(kv.buffered(), k.is_channelwise() || v.is_channelwise());
            }
        }
        let err = KvSpec::uniform(KvFormat::Int2Channel)
            .check_block_size(4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv2c") && err.contains("16"), "{err}");
        let err = "k4cv8"
            .parse::<KvSpec>()
            .unwrap()
            .check_block_size(4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("k4cv8") && err.contains("16"), "{err}");
    }
}

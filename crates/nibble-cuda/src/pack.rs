//! Offline weight packing for the quantized GEMMs (TurboMind §4.1): a weight matrix is rewritten
//! once, at load, into the exact register fragments the kernels' `mma.sync` consumes, so a warp
//! fetches its operand for a 64-wide K chunk with one coalesced 16- or 32-byte load per lane and
//! uses it with no shuffle, no run-time swizzle and no conversion table.
//!
//! Nothing here is a hand-written table: the layout is derived from the PTX ISA's fragment
//! description of the MMA ([`a_element`], [`b_element`]) and from the order in which the INT4
//! converter produces register halves ([`nibble_slot`]). Adding an MMA shape means describing
//! its fragments; the packer and its inverse follow.
//!
//! **Roles.** The kernels swap A and B: weight rows are the MMA's M side (16 per tile) and tokens
//! its N side (8 per tile), so a decode step of 1 to 16 tokens still fills the wide side of the
//! tensor core with weights.
//!
//! **K order.** A dot product does not care in which order K is visited, as long as A and B
//! agree ([`KOrder`]). The 16-bit fragments (W4A16, W8A16) permute K within each 64-wide chunk:
//! the MMA position `kk` of step `j` is the logical input channel `16 * t + e * j + i`, where
//! lane `t = lane % 4` is the lane whose B fragment holds `kk` as its element `i` and `e` is the
//! B elements per lane, so every lane's B operand (activations) for a whole chunk is 16
//! consecutive channels (two 16-byte vectors of f16) and its A operand (weights) is those same
//! 16 channels of rows `g` and `g+8`. The INT8 fragments (W8A8, W4A8) keep K in natural order,
//! the order wgmma reads its shared-memory B operand in (tokens as TMA loads them), so the wgmma
//! tier uses them as they are; the INT8 decode and mma.sync kernels stage each chunk's
//! activations transposed by 4-byte words instead ([`s8_staged_channel`]), which again makes a
//! lane's B operand for a chunk one 16-byte vector.
//!
//! Packed layouts (`tiles = ceil(N / 16)`, `chunks = ceil(K / 64)`; padding rows and channels
//! dequantize to exactly 0):
//! - INT4 codes: `[tiles][chunks][32 lanes][4 steps]` u32 words, nibble [`nibble_slot`]`(r, e)`
//!   of step `j`'s word is element `e` of A register `r`.
//! - INT4 group parameters: `[tiles][groups][8][2]` pairs `(scale, magic + zero)` in the model
//!   dtype, `[.., g, 0]` for row `g` and `[.., g, 1]` for row `g + 8` of the tile; `groups =
//!   ceil(64 * chunks / group_len)`, so a lane reads both of its rows' pairs as one 8-byte load.
//! - INT8 codes: `[tiles][chunks][32 lanes][2 steps][4 registers][4]` bytes, K in natural order.
//! - W8A16 INT8 codes: `[tiles][chunks][32 lanes][4 steps][2 rows][4]` bytes, the m16n8k16
//!   fragments' codes placed for the 16-bit converter ([`w8a16_slot`]).

use half::{bf16, f16};
use nibble_core::{Error, Result};
use nibble_precision::{ByteAffine, byte_affine_word};
use rayon::prelude::*;

use crate::tensor::Dtype;

/// K channels per packed chunk (one main-loop step of every quantized kernel).
pub const CHUNK_K: usize = 64;
/// Weight rows per tile: the MMA's M.
pub const TILE_ROWS: usize = 16;
/// The channels one lane's B operand covers in a chunk.
const LANE_K: usize = CHUNK_K / 4;

/// One `mma.sync.m16n8kK` shape with `bits`-wide operands (16: m16n8k16, 8: m16n8k32), and the
/// order its packed fragments visit a chunk's K in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mma {
    pub bits: usize,
    pub order: KOrder,
}

/// Which input channel a packed chunk's MMA position stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KOrder {
    /// Lane `t`'s B operand is channels `16t .. 16t + 15`: activations read as 16-byte vectors
    /// as they lie in memory (the 16-bit families; the wgmma tier transposes their A fragments
    /// per quad, `k16_regs_to_k_order` in kernels/qgemm_wgmma.cu).
    LaneRuns,
    /// Position `kk` of step `j` is channel `j * K + kk`: wgmma's A fragment is mma.sync's, so
    /// the wgmma tier feeds the packed registers to it with no shuffle. Removing the INT8
    /// families' quad transposes measured 1.17x to 1.23x on W4A8 / W8A8 at 256 tokens
    /// (`WGQ_NO_KORDER` probe, BENCHMARKS.md issue 18).
    Natural,
}

pub const MMA_F16: Mma = Mma {
    bits: 16,
    order: KOrder::LaneRuns,
};
pub const MMA_S8: Mma = Mma {
    bits: 8,
    order: KOrder::Natural,
};

impl Mma {
    /// The MMA's K.
    pub fn k(self) -> usize {
        256 / self.bits
    }
    /// Operand elements in one 32-bit register.
    pub fn per_reg(self) -> usize {
        32 / self.bits
    }
    /// A elements per lane (4 registers).
    pub fn a_elems(self) -> usize {
        4 * self.per_reg()
    }
    /// B elements per lane (2 registers).
    pub fn b_elems(self) -> usize {
        2 * self.per_reg()
    }
    /// MMA steps per chunk.
    pub fn steps(self) -> usize {
        CHUNK_K / self.k()
    }
}

/// `(row, k)` of element `i` of lane `lane`'s A fragment (16 x K, row-major). PTX ISA, "Matrix
/// fragments for mma.m16n8k16 / mma.m16n8k32": with `g = lane / 4`, `t = lane % 4` and `p` the
/// elements per register, register `r` holds row `g + 8 * (r % 2)` at columns
/// `t * p .. t * p + p` plus `K / 2` for registers 2 and 3.
pub fn a_element(mma: Mma, lane: usize, i: usize) -> (usize, usize) {
    let (g, t, p) = (lane / 4, lane % 4, mma.per_reg());
    let (r, e) = (i / p, i % p);
    (g + 8 * (r % 2), t * p + e + (mma.k() / 2) * (r / 2))
}

/// `(k, n)` of element `i` of lane `lane`'s B fragment (K x 8, column-major): register `r`
/// holds rows `t * p .. t * p + p` (plus `K / 2` for register 1) of column `g`.
pub fn b_element(mma: Mma, lane: usize, i: usize) -> (usize, usize) {
    let (g, t, p) = (lane / 4, lane % 4, mma.per_reg());
    let (r, e) = (i / p, i % p);
    (t * p + e + (mma.k() / 2) * r, g)
}

/// The logical channel (0..64 within a chunk) that MMA position `kk` of step `step` stands for.
pub fn logical_k(mma: Mma, step: usize, kk: usize) -> usize {
    if mma.order == KOrder::Natural {
        return step * mma.k() + kk;
    }
    for lane in 0..4 {
        for i in 0..mma.b_elems() {
            if b_element(mma, lane, i).0 == kk {
                return lane * LANE_K + step * mma.b_elems() + i;
            }
        }
    }
    unreachable!("k position {kk} is outside the MMA's K")
}

/// The channel (within a 64-channel chunk) of byte `i` of word `w` of lane `t`'s 16-byte vector
/// of INT8 activations as the decode and mma.sync kernels stage them (`stage_x16` in
/// kernels/qgemm.cu): staged word `4t + w` is the chunk's word `4w + t`, so word `2j + r` is
/// register `b_r` of k32 step `j` under [`KOrder::Natural`].
pub fn s8_staged_channel(t: usize, w: usize, i: usize) -> usize {
    4 * (4 * w + t) + i
}

/// Where element `e` (0 or 1) of A register `r` sits in a step's INT4 word: the converter
/// expands nibbles `r` and `r + 4` into one register with a single mask (`0x000f000f << 4r`).
pub fn nibble_slot(r: usize, e: usize) -> usize {
    r + 4 * e
}

/// For each lane and each packed value in the lane's order (step, register, element), the
/// `(row in tile, channel in chunk)` it holds.
fn lane_order(mma: Mma) -> Vec<Vec<(usize, usize)>> {
    (0..32)
        .map(|lane| {
            let mut v = Vec::with_capacity(mma.steps() * mma.a_elems());
            for step in 0..mma.steps() {
                for i in 0..mma.a_elems() {
                    let (row, kk) = a_element(mma, lane, i);
                    v.push((row, logical_k(mma, step, kk)));
                }
            }
            v
        })
        .collect()
}

/// Where row `row` of tile `tile`'s group `grp` parameters sit among `groups` per tile, in the
/// units of one row's parameters: `[tiles][groups][8][2]`, row `g` then row `g + 8`, so a lane
/// (`g = lane / 4`) reads both of its rows' with one load.
fn param_slot(tile: usize, groups: usize, grp: usize, row: usize) -> usize {
    ((tile * groups + grp) * 8 + row % 8) * 2 + row / 8
}

/// Fills packed fragments `[tiles][chunks][32 lanes][per_lane]`, a tile per task (a large
/// checkpoint's packing is a large share of its load time): `fill(words, tile, chunk, vals)`
/// writes one lane's `per_lane` words of a chunk, `vals` being the lane's `(row, channel)` pairs
/// in `mma`'s fragment order.
fn fill_fragments<T: Send>(
    out: &mut [T],
    chunks: usize,
    per_lane: usize,
    mma: Mma,
    fill: impl Fn(&mut [T], usize, usize, &[(usize, usize)]) + Sync,
) {
    let order = lane_order(mma);
    out.par_chunks_mut(chunks * 32 * per_lane)
        .enumerate()
        .for_each(|(tile, out)| {
            for chunk in 0..chunks {
                for (lane, vals) in order.iter().enumerate() {
                    let at = (chunk * 32 + lane) * per_lane;
                    fill(&mut out[at..at + per_lane], tile, chunk, vals);
                }
            }
        });
}

/// A dense `[n, k]` INT4 weight with per-group asymmetric parameters, the input of [`pack_w4`].
pub struct W4Matrix<'a> {
    pub n: usize,
    pub k: usize,
    /// Channels per group (`k` for per-channel).
    pub group_len: usize,
    /// Codes 0..=15, row-major `[n, k]`.
    pub codes: &'a [u8],
    /// `[n, k / group_len]`.
    pub scales: &'a [f32],
    /// `[n, k / group_len]`, 0..=15.
    pub zeros: &'a [u8],
}

/// Packed INT4 weight: codes as u32 words, group parameters as 16-bit pairs.
pub struct PackedW4 {
    pub n: usize,
    pub k: usize,
    pub group_len: usize,
    pub tiles: usize,
    pub chunks: usize,
    pub groups: usize,
    pub dtype: Dtype,
    pub codes: Vec<u32>,
    pub params: Vec<u16>,
}

/// The exact value the f16/bf16 converter produces for code 0 (`0x6400`: 1024.0, `0x4300`:
/// 128.0): `magic | q` is `magic + q`, and subtracting `magic + z` leaves `q - z` exactly.
pub fn w4_magic(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => 1024.0,
        Dtype::Bf16 => 128.0,
    }
}

fn chunks_for(k: usize) -> usize {
    k.div_ceil(CHUNK_K)
}

/// Checks the geometry every quantized kernel needs: whole 16-channel lane vectors, and for
/// grouped weights groups that keep a lane's 16 channels together and span at most two per
/// 64-channel chunk.
pub fn check_k(k: usize, group_len: Option<usize>) -> Result<()> {
    let groups_ok =
        group_len.is_none_or(|g| g.is_multiple_of(16) && (g.is_multiple_of(32) || g >= CHUNK_K));
    if k == 0 || !k.is_multiple_of(16) || !groups_ok {
        return Err(Error::unsupported(
            format!(
                "a quantized GPU weight with {k} input channels{}",
                group_len.map_or(String::new(), |g| format!(" and groups of {g}"))
            ),
            "the GPU kernels read 16-channel vectors and at most two groups per 64 channels: \
             K must be a multiple of 16 and the group size a multiple of 32 (or of 16 from 64)",
        ));
    }
    Ok(())
}

pub fn pack_w4(w: &W4Matrix, dtype: Dtype) -> Result<PackedW4> {
    check_k(w.k, Some(w.group_len))?;
    let groups_in = w.k / w.group_len;
    if w.codes.len() != w.n * w.k
        || w.scales.len() != w.n * groups_in
        || w.zeros.len() != w.scales.len()
    {
        return Err(Error::InvalidArgument(format!(
            "pack_w4: {} codes, {} scales for a {}x{} weight in groups of {}",
            w.codes.len(),
            w.scales.len(),
            w.n,
            w.k,
            w.group_len
        )));
    }
    let (tiles, chunks) = (w.n.div_ceil(TILE_ROWS), chunks_for(w.k));
    let groups = (chunks * CHUNK_K).div_ceil(w.group_len);
    let mut codes = vec![0u32; tiles * chunks * 32 * 4];
    fill_fragments(
        &mut codes,
        chunks,
        4,
        MMA_F16,
        |words, tile, chunk, vals| {
            for (idx, &(row, ch)) in vals.iter().enumerate() {
                let (n, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                // Padding takes the group's zero point, so it dequantizes to exactly 0.
                let q = if n < w.n && kk < w.k {
                    w.codes[n * w.k + kk]
                } else if n < w.n && kk / w.group_len < groups_in {
                    w.zeros[n * groups_in + kk / w.group_len]
                } else {
                    0
                };
                let (step, i) = (idx / 8, idx % 8);
                let slot = nibble_slot(i / 2, i % 2);
                words[step] |= ((q & 15) as u32) << (4 * slot);
            }
        },
    );
    let magic = w4_magic(dtype);
    let mut params = vec![0u16; tiles * groups * 16 * 2];
    let per_tile = groups * 16 * 2;
    params
        .par_chunks_mut(per_tile)
        .enumerate()
        .for_each(|(tile, params)| {
            for grp in 0..groups {
                for row in 0..TILE_ROWS {
                    let n = tile * TILE_ROWS + row;
                    let (s, z) = if n < w.n && grp < groups_in {
                        (
                            w.scales[n * groups_in + grp],
                            w.zeros[n * groups_in + grp] as f32,
                        )
                    } else {
                        (0.0, 0.0)
                    };
                    let at = param_slot(tile, groups, grp, row) * 2 - tile * per_tile;
                    params[at] = dtype.encode(&[s])[0];
                    params[at + 1] = dtype.encode(&[magic + z])[0];
                }
            }
        });
    Ok(PackedW4 {
        n: w.n,
        k: w.k,
        group_len: w.group_len,
        tiles,
        chunks,
        groups,
        dtype,
        codes,
        params,
    })
}

impl PackedW4 {
    /// The dequantized `[n, k]` matrix as the kernel computes it (`(magic + q - (magic + z)) *
    /// s`, rounded once to the dtype): the inverse of [`pack_w4`], for tests.
    pub fn unpack(&self) -> Vec<f32> {
        let order = lane_order(MMA_F16);
        let mut out = vec![f32::NAN; self.n * self.k];
        let half = |b: u16| match self.dtype {
            Dtype::F16 => f16::from_bits(b).to_f32(),
            Dtype::Bf16 => bf16::from_bits(b).to_f32(),
        };
        let magic = w4_magic(self.dtype);
        for tile in 0..self.tiles {
            for chunk in 0..self.chunks {
                for (lane, vals) in order.iter().enumerate() {
                    let base = ((tile * self.chunks + chunk) * 32 + lane) * 4;
                    for (idx, &(row, ch)) in vals.iter().enumerate() {
                        let (n, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                        if n >= self.n || kk >= self.k {
                            continue;
                        }
                        let (step, i) = (idx / 8, idx % 8);
                        let q = (self.codes[base + step] >> (4 * nibble_slot(i / 2, i % 2))) & 15;
                        let grp = kk / self.group_len;
                        let at = param_slot(tile, self.groups, grp, row) * 2;
                        let (s, zt) = (half(self.params[at]), half(self.params[at + 1]));
                        let v = (magic + q as f32 - zt) * s;
                        out[n * self.k + kk] = self.dtype.decode(&self.dtype.encode(&[v]))[0];
                    }
                }
            }
        }
        out
    }
}

/// Packed INT8 weight: codes in fragment order, one f32 scale per row (padded to whole tiles).
/// 32 bytes a lane a chunk in either layout ([`Int8Layout`]).
pub struct PackedW8 {
    pub n: usize,
    pub k: usize,
    pub tiles: usize,
    pub chunks: usize,
    pub layout: Int8Layout,
    pub codes: Vec<i8>,
    pub scales: Vec<f32>,
}

/// Which MMA an INT8 weight's fragments feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Layout {
    /// W8A8: the m16n8k32 s8 A fragments of two k32 steps, bytes in register order.
    S8,
    /// W8A16: the m16n8k16 A fragments of four k16 steps as INT8 codes, which the kernels make
    /// 16-bit in registers (`w8_pair` in kernels/qgemm.cu), bytes at [`w8a16_slot`].
    F16,
}

impl Int8Layout {
    fn mma(self) -> Mma {
        match self {
            Int8Layout::S8 => MMA_S8,
            Int8Layout::F16 => MMA_F16,
        }
    }

    /// The byte, among a lane's 32 of a chunk, of the value at `idx` in the MMA's fragment
    /// order (step, register, element).
    fn byte(self, idx: usize) -> usize {
        match self {
            Int8Layout::S8 => idx,
            Int8Layout::F16 => {
                let (step, i) = (idx / 8, idx % 8);
                step * 8 + w8a16_slot(i / 2, i % 2)
            }
        }
    }
}

/// Where element `e` (0 or 1) of A register `r` sits among a k16 step's 8 W8A16 bytes: the
/// converter takes a register's pair from bytes 0 and 2 of a word (one mask, `0x00ff00ff`, then
/// the word shifted by 8 for the second register of that row), and word `h` holds row `g + 8h`
/// (registers `h` and `2 + h`).
pub fn w8a16_slot(r: usize, e: usize) -> usize {
    4 * (r % 2) + 2 * e + r / 2
}

/// Packs `[n, k]` INT8 codes with per-row scales, for the W8A8 kernels or ([`Int8Layout::F16`])
/// the W8A16 ones.
pub fn pack_w8(
    n: usize,
    k: usize,
    codes: &[i8],
    scales: &[f32],
    layout: Int8Layout,
) -> Result<PackedW8> {
    check_k(k, None)?;
    if codes.len() != n * k || scales.len() != n {
        return Err(Error::InvalidArgument(format!(
            "pack_w8: {} codes and {} scales for a {n}x{k} weight",
            codes.len(),
            scales.len()
        )));
    }
    let (tiles, chunks) = (n.div_ceil(TILE_ROWS), chunks_for(k));
    let mma = layout.mma();
    let per_lane = mma.steps() * mma.a_elems();
    let mut packed = vec![0i8; tiles * chunks * 32 * per_lane];
    fill_fragments(
        &mut packed,
        chunks,
        per_lane,
        mma,
        |out, tile, chunk, vals| {
            for (idx, &(row, ch)) in vals.iter().enumerate() {
                let (r, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                if r < n && kk < k {
                    out[layout.byte(idx)] = codes[r * k + kk];
                }
            }
        },
    );
    let mut s = scales.to_vec();
    s.resize(tiles * TILE_ROWS, 0.0);
    Ok(PackedW8 {
        n,
        k,
        tiles,
        chunks,
        layout,
        codes: packed,
        scales: s,
    })
}

/// FP8 weights as the kernels read them (kernels/qgemm_fp8.cu): plain row-major e4m3 codes,
/// `tiles * 16` rows of `chunks * 64` bytes (zero past `n` and `k`), because the wgmma tier takes
/// its weights from shared memory through TMA (a 128-byte-swizzled K-major operand needs rows of K
/// in memory) and the decode gemv's mma.sync fragments are 16-byte runs of two rows: lane
/// (g, t) holds rows g and g + 8, channels 16t .. 16t + 15 of each 64-channel chunk, the
/// channels it also reads of the activations ([`fp8_fragment_channel`]).
pub struct PackedFp8 {
    pub n: usize,
    pub k: usize,
    pub tiles: usize,
    pub chunks: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// Packs `[n, k]` e4m3 codes with per-row f32 scales.
pub fn pack_fp8(n: usize, k: usize, codes: &[u8], scales: &[f32]) -> Result<PackedFp8> {
    check_k(k, None)?;
    if codes.len() != n * k || scales.len() != n {
        return Err(Error::InvalidArgument(format!(
            "pack_fp8: {} codes and {} scales for a {n}x{k} weight",
            codes.len(),
            scales.len()
        )));
    }
    let (tiles, chunks) = (n.div_ceil(TILE_ROWS), chunks_for(k));
    let row = chunks * CHUNK_K;
    let mut packed = vec![0u8; tiles * TILE_ROWS * row];
    for (dst, src) in packed.chunks_exact_mut(row).zip(codes.chunks_exact(k)) {
        dst[..k].copy_from_slice(src);
    }
    let mut s = scales.to_vec();
    s.resize(tiles * TILE_ROWS, 0.0);
    Ok(PackedFp8 {
        n,
        k,
        tiles,
        chunks,
        codes: packed,
        scales: s,
    })
}

/// The decode gemv's m16n8k32 operand mapping over row-major FP8 weights: the input channel (within
/// a 64-channel chunk) of byte `i` of register `reg` (a0..a3 of the A fragment, or b0, b1 of the B
/// fragment as `reg` 0 and 2) of lane `t` (its index in the quad) in k32 step `j`. Register pairs
/// (a0, a1) and (a2, a3) are rows g and g + 8 of the same channels.
pub fn fp8_fragment_channel(t: usize, j: usize, reg: usize, i: usize) -> usize {
    16 * t + 8 * j + 4 * (reg / 2) + i
}

impl PackedW8 {
    /// The `[n, k]` codes back: the inverse of [`pack_w8`], for tests.
    pub fn unpack(&self) -> Vec<i8> {
        let mma = self.layout.mma();
        let order = lane_order(mma);
        let per_lane = mma.steps() * mma.a_elems();
        let mut out = vec![0i8; self.n * self.k];
        for tile in 0..self.tiles {
            for chunk in 0..self.chunks {
                for (lane, vals) in order.iter().enumerate() {
                    let base = ((tile * self.chunks + chunk) * 32 + lane) * per_lane;
                    for (idx, &(row, ch)) in vals.iter().enumerate() {
                        let (r, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                        if r < self.n && kk < self.k {
                            out[r * self.k + kk] = self.codes[base + self.layout.byte(idx)];
                        }
                    }
                }
            }
        }
        out
    }
}

/// A dense `[n, k]` W4A8 weight (QoQ, LiquidQuant, INT4 per channel with INT8 activations):
/// 4-bit codes and each group's [`ByteAffine`] widening, the input of [`pack_w4a8`].
pub struct W4A8Matrix<'a> {
    pub n: usize,
    pub k: usize,
    /// Channels per group: a power of two from 32, or `k` for one group per row.
    pub group_len: usize,
    /// Codes 0..=15, row-major `[n, k]`.
    pub codes: &'a [u8],
    /// `[n, k / group_len]`.
    pub affine: &'a [ByteAffine],
    /// The per-row scale of the INT8 weights (`[n]`).
    pub scales: &'a [f32],
}

/// Packed W4A8 weight. Codes: `[tiles][chunks][32 lanes][4]` u32 words, 16 bytes a lane, which
/// widen to the lane's eight INT8 registers of [`pack_w8`]'s layout: word `2 * step + h` holds
/// register `h` of that step (rows `g + 8h`, the step's first 4 channels) in its low nibbles and
/// register `2 + h` in its high nibbles, byte `b` in byte `b`. Parameters: `[tiles][groups][8][2]`
/// u32 words `scale | offset << 16` (offset as i16), row `g` then row `g + 8`, as W4A16's pairs.
/// K is in natural order ([`KOrder::Natural`]), so each k32 step of a chunk (channels `32 j ..
/// 32 j + 31`) lies in one group, groups being 32 channels or more: the kernels read the
/// parameters of a chunk's two steps, which differ for groups of 32.
pub struct PackedW4A8 {
    pub n: usize,
    pub k: usize,
    pub tiles: usize,
    pub chunks: usize,
    pub groups: usize,
    pub group_len: usize,
    /// `log2(group_len)`, or 30 for one group per row (any lane's channel shifts to group 0).
    pub group_shift: u32,
    pub codes: Vec<u32>,
    pub params: Vec<u32>,
    pub scales: Vec<f32>,
}

/// The parameter word of one group and row.
pub fn w4a8_param(a: ByteAffine) -> u32 {
    a.scale & 0xffff | (a.offset as i16 as u16 as u32) << 16
}

/// A packed word's two INT8 registers, as the kernels widen them (`w4a8_widen` in
/// kernels/common.cuh): the low nibbles, then the high ones.
pub fn w4a8_widen(word: u32, param: u32) -> (u32, u32) {
    let a = ByteAffine {
        scale: param & 0xffff,
        offset: (param >> 16) as u16 as i16 as i32,
    };
    (
        byte_affine_word(word & 0x0f0f_0f0f, a),
        byte_affine_word((word >> 4) & 0x0f0f_0f0f, a),
    )
}

pub fn pack_w4a8(w: &W4A8Matrix) -> Result<PackedW4A8> {
    check_k(w.k, None)?;
    let groups_in = w.k / w.group_len.max(1);
    let one_group = groups_in == 1 && w.group_len == w.k;
    if !(one_group || w.group_len >= 32 && w.group_len.is_power_of_two()) {
        return Err(Error::unsupported(
            format!("a W4A8 GPU weight in groups of {}", w.group_len),
            "the W4A8 kernels take groups of a power of two from 32 channels, or one per row",
        ));
    }
    if w.codes.len() != w.n * w.k
        || w.affine.len() != w.n * groups_in
        || w.scales.len() != w.n
        || !w.k.is_multiple_of(w.group_len)
    {
        return Err(Error::InvalidArgument(format!(
            "pack_w4a8: {} codes, {} group parameters, {} scales for a {}x{} weight in groups of {}",
            w.codes.len(),
            w.affine.len(),
            w.scales.len(),
            w.n,
            w.k,
            w.group_len
        )));
    }
    let (tiles, chunks) = (w.n.div_ceil(TILE_ROWS), chunks_for(w.k));
    let groups = if one_group {
        1
    } else {
        (chunks * CHUNK_K).div_ceil(w.group_len)
    };
    let per_reg = MMA_S8.per_reg();
    let mut codes = vec![0u32; tiles * chunks * 32 * 4];
    fill_fragments(&mut codes, chunks, 4, MMA_S8, |words, tile, chunk, vals| {
        for (idx, &(row, ch)) in vals.iter().enumerate() {
            let (n, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
            if n >= w.n || kk >= w.k {
                continue; // padding: its activations are zero
            }
            let (step, reg, byte) = (idx / 16, idx % 16 / per_reg, idx % per_reg);
            let word = 2 * step + reg % 2;
            let shift = 8 * byte + 4 * (reg / 2);
            words[word] |= ((w.codes[n * w.k + kk] & 15) as u32) << shift;
        }
    });
    let mut params = vec![0u32; tiles * groups * 16];
    let per_tile = groups * 16;
    params
        .par_chunks_mut(per_tile)
        .enumerate()
        .for_each(|(tile, params)| {
            for grp in 0..groups.min(groups_in) {
                for row in 0..TILE_ROWS {
                    let n = tile * TILE_ROWS + row;
                    if n < w.n {
                        let at = param_slot(tile, groups, grp, row) - tile * per_tile;
                        params[at] = w4a8_param(w.affine[n * groups_in + grp]);
                    }
                }
            }
        });
    let mut scales = w.scales.to_vec();
    scales.resize(tiles * TILE_ROWS, 0.0);
    Ok(PackedW4A8 {
        n: w.n,
        k: w.k,
        tiles,
        chunks,
        groups,
        group_len: w.group_len,
        group_shift: if one_group {
            30
        } else {
            w.group_len.trailing_zeros()
        },
        codes,
        params,
        scales,
    })
}

impl PackedW4A8 {
    /// The `[n, k]` INT8 weights as the kernels widen them from the packed words: what
    /// [`WeightCodec::integer_row`](nibble_precision::WeightCodec::integer_row) gives, for tests.
    pub fn widened(&self) -> Vec<i8> {
        let order = lane_order(MMA_S8);
        let per_reg = MMA_S8.per_reg();
        let mut out = vec![0i8; self.n * self.k];
        for tile in 0..self.tiles {
            for chunk in 0..self.chunks {
                for (lane, vals) in order.iter().enumerate() {
                    let base = ((tile * self.chunks + chunk) * 32 + lane) * 4;
                    for (idx, &(row, ch)) in vals.iter().enumerate() {
                        let (n, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                        if n >= self.n || kk >= self.k {
                            continue;
                        }
                        let (step, reg, byte) = (idx / 16, idx % 16 / per_reg, idx % per_reg);
                        let grp = (chunk * CHUNK_K + MMA_S8.k() * step) >> self.group_shift;
                        let p = self.params[param_slot(tile, self.groups, grp, row)];
                        let (lo, hi) = w4a8_widen(self.codes[base + 2 * step + reg % 2], p);
                        let word = if reg < 2 { lo } else { hi };
                        out[n * self.k + kk] = word.to_le_bytes()[byte] as i8;
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode gemv's fragment mapping (kernels/qgemm_fp8.cu, DecFp8) computes the dot
    /// products: an m16n8k32 MMA multiplies A's logical k (4t + i for a0/a1, 16 + 4t + i for
    /// a2/a3) with B's same logical k (b0, b1), so the mapping is right when each lane's A and
    /// B registers name the same channels and the lanes cover each chunk once.
    #[test]
    fn fp8_fragments_cover_each_chunk_once_with_matching_channels() {
        let (n, k) = (20, 192);
        let w: Vec<u8> = (0..n * k).map(|v| (v * 7 % 13) as u8).collect();
        let p = pack_fp8(n, k, &w, &vec![1.0; n]).unwrap();
        assert_eq!((p.tiles, p.chunks, p.codes.len()), (2, 3, 32 * 192));
        let x: Vec<i64> = (0..k).map(|v| (v as i64 * 5) % 11 - 5).collect();
        let row_bytes = p.chunks * CHUNK_K;
        for r in 0..p.tiles * TILE_ROWS {
            let (g, h) = (r % 8, (r % 16) / 8);
            let mut dot = 0i64;
            for c in 0..p.chunks {
                let mut seen = [false; CHUNK_K];
                for t in 0..4 {
                    // Lane (g, t) loads 16 bytes of rows g and g + 8 at channel 16t.
                    let lane_row = &p.codes[(r - r % 16 + g + 8 * h) * row_bytes + c * CHUNK_K..];
                    for j in 0..2 {
                        for reg in [0, 2] {
                            for i in 0..4 {
                                let ch = fp8_fragment_channel(t, j, reg, i);
                                assert!(!seen[ch], "channel {ch} twice");
                                seen[ch] = true;
                                // a{reg + h} is byte (j * 8 + reg * 2 + i) of the lane's 16.
                                let a = lane_row[16 * t + 8 * j + 2 * reg + i] as i64;
                                let b = x.get(c * CHUNK_K + ch).copied().unwrap_or(0);
                                dot += a * b;
                            }
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s));
            }
            let want: i64 = if r < n {
                (0..k).map(|kk| w[r * k + kk] as i64 * x[kk]).sum()
            } else {
                0
            };
            assert_eq!(dot, want, "row {r}");
        }
    }
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn fragments_match_the_ptx_tables() {
        // Spot values from the PTX ISA figures. m16n8k16 A: a0 of lane 0 is (0, 0), a2 (row
        // 8), a4 (column 8); lane 5 (g 1, t 1) a1 is (1, 3). B: b2 of lane 0 is k 8.
        assert_eq!(a_element(MMA_F16, 0, 0), (0, 0));
        assert_eq!(a_element(MMA_F16, 0, 2), (8, 0));
        assert_eq!(a_element(MMA_F16, 0, 4), (0, 8));
        assert_eq!(a_element(MMA_F16, 5, 1), (1, 3));
        assert_eq!(b_element(MMA_F16, 0, 2), (8, 0));
        assert_eq!(b_element(MMA_F16, 6, 1), (5, 1));
        // m16n8k32 A: a4 of lane 0 is row 8, a8 column 16; lane 7 (g 1, t 3) a3 is (1, 15).
        assert_eq!(a_element(MMA_S8, 0, 4), (8, 0));
        assert_eq!(a_element(MMA_S8, 0, 8), (0, 16));
        assert_eq!(a_element(MMA_S8, 7, 3), (1, 15));
        assert_eq!(b_element(MMA_S8, 0, 4), (16, 0));
    }

    #[test]
    fn fragments_cover_each_tile_once() {
        for mma in [MMA_F16, MMA_S8] {
            let mut a = vec![0; 16 * mma.k()];
            let mut b = vec![0; 8 * mma.k()];
            for lane in 0..32 {
                for i in 0..mma.a_elems() {
                    let (r, c) = a_element(mma, lane, i);
                    a[r * mma.k() + c] += 1;
                }
                for i in 0..mma.b_elems() {
                    let (k, n) = b_element(mma, lane, i);
                    b[k * 8 + n] += 1;
                }
            }
            assert!(a.iter().chain(&b).all(|&c| c == 1), "{mma:?}");
        }
    }

    #[test]
    fn lane_runs_give_each_lane_16_consecutive_channels() {
        let mma = MMA_F16;
        let mut seen = [false; CHUNK_K];
        for lane in 0..32 {
            for step in 0..mma.steps() {
                for i in 0..mma.b_elems() {
                    let (kk, _) = b_element(mma, lane, i);
                    let l = logical_k(mma, step, kk);
                    assert_eq!(l / LANE_K, lane % 4);
                    assert_eq!(l % LANE_K, step * mma.b_elems() + i);
                    seen[l] = true;
                }
            }
            // The A side of a lane touches the same channels as its B side.
            for &(_, ch) in &lane_order(mma)[lane] {
                assert_eq!(ch / LANE_K, lane % 4);
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// The INT8 fragments are in wgmma's order: register `r` of k32 step `j` of lane `(g, t)`
    /// holds row `g + 8 (r % 2)`, channels `32 j + 16 (r / 2) + 4 t ..`, the A fragment of the
    /// wgmma reading the chunk's tokens at `32 j` as TMA stored them. And the word-transposed
    /// staging of the decode and mma.sync kernels gives each lane, in word `2 j + r` of its
    /// 16-byte vector, the channels its B register `r` of step `j` multiplies.
    #[test]
    fn int8_fragments_are_in_natural_order_and_staging_matches_them() {
        let mma = MMA_S8;
        let order = lane_order(mma);
        for (lane, vals) in order.iter().enumerate() {
            let (g, t) = (lane / 4, lane % 4);
            for (idx, &(row, ch)) in vals.iter().enumerate() {
                let (j, r, i) = (idx / 16, idx % 16 / 4, idx % 4);
                assert_eq!(
                    (row, ch),
                    (g + 8 * (r % 2), 32 * j + 16 * (r / 2) + 4 * t + i)
                );
            }
            for j in 0..mma.steps() {
                for i in 0..mma.b_elems() {
                    let (kk, _) = b_element(mma, lane, i);
                    let (r, e) = (i / 4, i % 4);
                    assert_eq!(logical_k(mma, j, kk), s8_staged_channel(t, 2 * j + r, e));
                }
            }
        }
        // The staging is a permutation of the chunk's 64 bytes.
        let mut seen = [false; CHUNK_K];
        for t in 0..4 {
            for w in 0..4 {
                for i in 0..4 {
                    seen[s8_staged_channel(t, w, i)] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    fn random_w4(n: usize, k: usize, group_len: usize, seed: u64) -> (Vec<u8>, Vec<f32>, Vec<u8>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let g = k / group_len;
        let codes = (0..n * k).map(|_| rng.random_range(0..16u8)).collect();
        let scales = (0..n * g)
            .map(|_| f16::from_f32(rng.random_range(1e-3..0.1f32)).to_f32())
            .collect();
        let zeros = (0..n * g).map(|_| rng.random_range(0..16u8)).collect();
        (codes, scales, zeros)
    }

    #[test]
    fn w4_round_trips_on_odd_shapes_and_every_group() {
        for (n, k, group_len) in [
            (16, 64, 32),
            (37, 96, 32),
            (5, 224, 32),
            (48, 320, 64),
            (33, 576, 64),
            (17, 256, 128),
            (3, 80, 80),
        ] {
            let (codes, scales, zeros) = random_w4(n, k, group_len, (n * k) as u64);
            let w = W4Matrix {
                n,
                k,
                group_len,
                codes: &codes,
                scales: &scales,
                zeros: &zeros,
            };
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let p = pack_w4(&w, dtype).unwrap();
                let got = p.unpack();
                for r in 0..n {
                    for c in 0..k {
                        let grp = r * (k / group_len) + c / group_len;
                        let s = dtype.decode(&dtype.encode(&[scales[grp]]))[0];
                        let v = (codes[r * k + c] as f32 - zeros[grp] as f32) * s;
                        let want = dtype.decode(&dtype.encode(&[v]))[0];
                        assert_eq!(
                            got[r * k + c],
                            want,
                            "{n}x{k} g{group_len} {dtype:?} ({r}, {c})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn w4_padding_dequantizes_to_zero() {
        // Re-derive padded positions from the packed words: every padded channel of a real row
        // holds the group's zero point, so the kernel's (q - z) * s is exactly 0 there.
        let (n, k, group_len) = (20, 96, 32);
        let (codes, scales, zeros) = random_w4(n, k, group_len, 7);
        let w = W4Matrix {
            n,
            k,
            group_len,
            codes: &codes,
            scales: &scales,
            zeros: &zeros,
        };
        let p = pack_w4(&w, Dtype::F16).unwrap();
        assert_eq!((p.tiles, p.chunks, p.groups), (2, 2, 4));
        let order = lane_order(MMA_F16);
        for tile in 0..p.tiles {
            for (lane, vals) in order.iter().enumerate() {
                let base = ((tile * p.chunks + 1) * 32 + lane) * 4;
                for (idx, &(row, ch)) in vals.iter().enumerate() {
                    let (r, kk) = (tile * 16 + row, 64 + ch);
                    if kk < k {
                        continue;
                    }
                    let q =
                        (p.codes[base + idx / 8] >> (4 * nibble_slot((idx % 8) / 2, idx % 2))) & 15;
                    let at = (((tile * p.groups + kk / group_len) * 8 + row % 8) * 2 + row / 8) * 2;
                    let s = f16::from_bits(p.params[at]).to_f32();
                    let zt = f16::from_bits(p.params[at + 1]).to_f32();
                    assert_eq!((1024.0 + q as f32 - zt) * s, 0.0, "row {r} channel {kk}");
                }
            }
        }
    }

    #[test]
    fn w8_round_trips() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for (n, k) in [(16, 64), (35, 112), (64, 4096), (1, 16)] {
            let codes: Vec<i8> = (0..n * k).map(|_| rng.random_range(-127..=127i8)).collect();
            let scales: Vec<f32> = (0..n).map(|i| i as f32).collect();
            for layout in [Int8Layout::S8, Int8Layout::F16] {
                let p = pack_w8(n, k, &codes, &scales, layout).unwrap();
                assert_eq!(p.unpack(), codes, "{layout:?}");
                assert_eq!(p.scales.len(), p.tiles * 16);
            }
        }
    }

    /// The W8A16 converter (`w8_pair` / `w8_step` in kernels/qgemm.cu) run on packed words: every
    /// A register of every k16 step holds exactly the codes the PTX fragment map puts there,
    /// -128 and 127 included, in both dtypes' magic.
    #[test]
    fn w8a16_words_convert_to_the_k16_fragments() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (n, k) = (35, 192);
        let mut codes: Vec<i8> = (0..n * k).map(|_| rng.random::<i8>()).collect();
        codes[0] = -128;
        codes[1] = 127;
        let p = pack_w8(n, k, &codes, &vec![1.0; n], Int8Layout::F16).unwrap();
        let order = lane_order(MMA_F16);
        for (magic, half) in [
            (
                0x6400_6400u32,
                (|b: u16| f16::from_bits(b).to_f32()) as fn(u16) -> f32,
            ),
            (0x4300_4300, |b: u16| bf16::from_bits(b).to_f32()),
        ] {
            let pair = |w: u32| -> [f32; 2] {
                let (low, sign) = ((w & 0x007f_007f) | magic, (w & 0x0080_0080) | magic);
                [0, 16].map(|sh| half((low >> sh) as u16) - half((sign >> sh) as u16))
            };
            for tile in 0..p.tiles {
                for chunk in 0..p.chunks {
                    for (lane, vals) in order.iter().enumerate() {
                        let base = ((tile * p.chunks + chunk) * 32 + lane) * 32;
                        let bytes = &p.codes[base..base + 32];
                        let word = |i: usize| {
                            u32::from_le_bytes(std::array::from_fn(|b| bytes[4 * i + b] as u8))
                        };
                        for (idx, &(row, ch)) in vals.iter().enumerate() {
                            let (step, r, e) = (idx / 8, idx % 8 / 2, idx % 2);
                            let w = word(2 * step + r % 2) >> (8 * (r / 2));
                            let (nr, kk) = (tile * TILE_ROWS + row, chunk * CHUNK_K + ch);
                            let want = if nr < n && kk < k {
                                codes[nr * k + kk] as f32
                            } else {
                                0.0
                            };
                            assert_eq!(pair(w)[e], want, "tile {tile} chunk {chunk} lane {lane}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_what_the_kernels_cannot_read() {
        assert!(check_k(72, Some(72)).is_err());
        assert!(check_k(64, Some(24)).is_err());
        assert!(check_k(64, Some(16)).is_err());
        assert!(check_k(48, Some(48)).is_err());
        assert!(check_k(80, Some(80)).is_ok());
        assert!(check_k(40, None).is_err());
        assert!(check_k(48, None).is_ok());
        assert!(pack_w8(2, 40, &[0; 80], &[1.0; 2], Int8Layout::S8).is_err());
        let e = pack_w4(
            &W4Matrix {
                n: 1,
                k: 64,
                group_len: 32,
                codes: &[0; 63],
                scales: &[1.0; 2],
                zeros: &[0; 2],
            },
            Dtype::F16,
        );
        assert!(e.is_err());
    }
}

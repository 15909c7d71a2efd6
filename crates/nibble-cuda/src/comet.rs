//! COMET W4A4A8 (FMPQ) on the GPU (kernels/comet.cu): INT4 weights in groups, activations in
//! channel blocks of the group size, the leading blocks INT8 and the rest INT4, one scale per
//! token and block; nibble_precision::reference's COMET arithmetic bit for bit (an exact i32 dot
//! per block, then one fma per block in block order).
//!
//! The weight stays in the checkpoint's row layout: each row's nibbles (low first), its f16 group
//! scales as f32 and its group zeros as bytes, three arrays. The GEMM quantizes its own input
//! (`comet_quantize_*`: INT8 codes for every block, an INT4 block's within [-7, 7], since Hopper
//! has no 4-bit tensor-core math), so no producer writes codes for it.

use nibble_core::{Error, Result};
use nibble_precision::{ActQuant, LinearFormat, WeightCodec};

use crate::context::CudaContext;
use crate::pack::{self, PackedW4A8, W4A8Matrix};
use crate::runtime::{Arg, DeviceBuffer, TmaLayout, WGMMA_THREADS, tensor_map, weight_map};
use crate::tensor::{CometWeight, CometWgmma, CudaTensor, Elem};

/// The layer geometry the kernels take: blocks (= groups) of 32 to 128 channels, a multiple of
/// the k32 step, and `k` a whole number of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CometGeometry {
    pub group: usize,
    pub int8_blocks: usize,
}

/// Whether `format` is COMET's (`int4-gN/a4a8-bN-nI`) and the kernels take its rows of `k`.
pub fn geometry(format: LinearFormat, k: usize) -> Option<CometGeometry> {
    let (WeightCodec::Int4Group { group }, ActQuant::Mixed4x8 { block, int8_blocks }) =
        (format.codec, format.act)
    else {
        return None;
    };
    let (group, block) = (group as usize, block as usize);
    let fits = group == block
        && (32..=128).contains(&group)
        && group.is_multiple_of(32)
        && k > 0
        && k.is_multiple_of(group)
        && (int8_blocks as usize) * group <= k;
    fits.then_some(CometGeometry {
        group,
        int8_blocks: int8_blocks as usize,
    })
}

/// A COMET weight's three arrays on the host, in the kernels' layout.
#[derive(Debug, PartialEq)]
pub struct PackedComet {
    /// `[n][k / 2]`: each row's nibbles as the checkpoint stores them.
    pub codes: Vec<u8>,
    /// `[n][groups]`: the zeros.
    pub zeros: Vec<u8>,
    /// `[n][groups]`: the f16 group scales as f32.
    pub scales: Vec<f32>,
}

/// Splits `n` checkpoint rows of `format` (`Int4Group` rows: `k / 2` nibble bytes, `groups` f16
/// scales, `groups` zero bytes) into the kernels' arrays.
pub fn pack(format: LinearFormat, n: usize, k: usize, bytes: &[u8]) -> Result<PackedComet> {
    let geo = geometry(format, k).ok_or_else(|| {
        Error::InvalidArgument(format!("{format}: no COMET kernel for rows of {k}"))
    })?;
    let rb = format.row_bytes(k)?;
    let groups = k / geo.group;
    if bytes.len() != n * rb || rb != k / 2 + 3 * groups {
        return Err(Error::InvalidArgument(format!(
            "{format}: {} bytes for {n} rows of {k}",
            bytes.len()
        )));
    }
    let mut out = PackedComet {
        codes: Vec::with_capacity(n * k / 2),
        zeros: Vec::with_capacity(n * groups),
        scales: Vec::with_capacity(n * groups),
    };
    for row in bytes.chunks_exact(rb) {
        out.codes.extend_from_slice(&row[..k / 2]);
        let params = &row[k / 2..];
        out.scales.extend(
            params[..2 * groups]
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        );
        out.zeros.extend_from_slice(&params[2 * groups..]);
    }
    Ok(out)
}

/// Uploads a packed COMET weight of `n` rows of `k`, with the wgmma tier's copy too where
/// [`wgmma_applies`] says so.
pub fn upload(
    ctx: &CudaContext,
    p: &PackedComet,
    geometry: CometGeometry,
    (n, k): (usize, usize),
    what: &str,
) -> Result<CometWeight> {
    let wgmma = if wgmma_applies(ctx, geometry) {
        let (packed, row_scales) = pack_wgmma(p, n, k, geometry.group)?;
        Some(CometWgmma {
            codes: DeviceBuffer::from_host(&ctx.gpu, &packed.codes, what)?,
            params: DeviceBuffer::from_host(&ctx.gpu, &packed.params, what)?,
            row_scales: DeviceBuffer::from_host(&ctx.gpu, &row_scales, what)?,
            tiles: packed.tiles,
            chunks: packed.chunks,
            groups: packed.groups,
        })
    } else {
        None
    };
    Ok(CometWeight {
        codes: DeviceBuffer::from_host(&ctx.gpu, &p.codes, what)?,
        zeros: DeviceBuffer::from_host(&ctx.gpu, &p.zeros, what)?,
        scales: DeviceBuffer::from_host(&ctx.gpu, &p.scales, what)?,
        group: geometry.group,
        int8_blocks: geometry.int8_blocks,
        wgmma,
    })
}

/// The group size the wgmma tier takes: one block a 128-channel stage.
pub const WGMMA_GROUP: usize = 128;

/// Whether COMET weights get the wgmma tier's copy unless a context says otherwise: yes, unless
/// NIBBLE_COMET_WGMMA=0 (read once). On an H200 (72615aa, BENCHMARKS.md, issue 18) it took 1.5x
/// to 5.3x less time than the tiled GEMM at every token count past the gemv's (4096x4096 at 256
/// tokens: 39.0 against 88.7 us). The copy is a second set of codes beside the gemv's.
pub fn wgmma_by_default() -> bool {
    static KNOB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&KNOB, "NIBBLE_COMET_WGMMA") != Some(0)
}

/// Whether a weight of this geometry uploaded now gets the wgmma copy: asked for
/// ([`CudaContext::set_comet_wgmma`], else [`wgmma_by_default`]), groups of [`WGMMA_GROUP`], and
/// a GPU with the sm_90a kernels.
pub fn wgmma_applies(ctx: &CudaContext, geometry: CometGeometry) -> bool {
    geometry.group == WGMMA_GROUP
        && ctx.comet_wgmma().unwrap_or_else(wgmma_by_default)
        && ctx.has_kernel("comet_wgmma64_f32")
}

/// The wgmma tier's layout of a COMET weight: its nibbles in W4A8's packed fragments, each row and
/// group's widening `q - z` as a byte-affine parameter (scale 1, offset `128 - z`: the byte
/// `q - z + 128` with its top bit flipped is `q - z` in two's complement), and the group scales
/// transposed to `[groups][tiles * 16]` (rows past `n` zero), one block's rows contiguous for
/// the producer's copy.
pub fn pack_wgmma(
    p: &PackedComet,
    n: usize,
    k: usize,
    group: usize,
) -> Result<(PackedW4A8, Vec<f32>)> {
    let groups = k / group;
    if p.codes.len() != n * k / 2 || p.zeros.len() != n * groups || p.scales.len() != n * groups {
        return Err(Error::InvalidArgument(format!(
            "COMET wgmma packing: {} code bytes, {} zeros, {} scales for {n} rows of {k} in groups of {group}",
            p.codes.len(),
            p.zeros.len(),
            p.scales.len()
        )));
    }
    let codes: Vec<u8> = p.codes.iter().flat_map(|&b| [b & 15, b >> 4]).collect();
    let affine: Vec<nibble_precision::ByteAffine> = p
        .zeros
        .iter()
        .map(|&z| nibble_precision::ByteAffine {
            scale: 1,
            offset: 128 - i32::from(z),
        })
        .collect();
    let packed = pack::pack_w4a8(&W4A8Matrix {
        n,
        k,
        group_len: group,
        codes: &codes,
        affine: &affine,
        scales: &vec![1.0; n],
    })?;
    let cols = packed.tiles * 16;
    let mut row_scales = vec![0f32; groups * cols];
    for (row, scales) in p.scales.chunks_exact(groups).enumerate() {
        for (b, &s) in scales.iter().enumerate() {
            row_scales[b * cols + row] = s;
        }
    }
    Ok((packed, row_scales))
}

/// Tokens and weight rows of a `comet_gemm_*` CTA (kernels/comet.cu).
const TOKENS_PER_CTA: usize = 32;
const ROWS_PER_CTA: usize = 64;

/// The most tokens `comet_gemv*` takes (four 8-token tiles a CTA).
pub const GEMV_MAX_TOKENS: usize = 32;
/// Weight rows of a `comet_gemv*` CTA.
const GEMV_ROWS_PER_CTA: usize = 16;

/// Whether decode batches take the gemv unless a context says otherwise: yes, unless
/// NIBBLE_COMET_GEMV=0 (read once). On an H100 it took 10.9 us against the tiled GEMM's 47.1 for
/// 4096x4096 at one token and 59.7 against 255.8 for 4096x14336 at 32, and tied it (101 us) only
/// on 28672x4096 at 32 (BENCHMARKS.md, issue 18, 2026-11-27).
pub fn gemv_by_default() -> bool {
    static KNOB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&KNOB, "NIBBLE_COMET_GEMV") != Some(0)
}

/// The 8-token tiles of a `comet_gemv*` CTA for `m` tokens (1, 2 or 4), or `None` for the tiled
/// GEMM: past [`GEMV_MAX_TOKENS`], or where `use_gemv` says no.
pub fn gemv_tiles(m: usize, use_gemv: bool) -> Option<usize> {
    (use_gemv && m <= GEMV_MAX_TOKENS).then(|| m.div_ceil(8).next_power_of_two())
}

/// Rows past which a layer with the wgmma copy leaves batches of more than 8 tokens to it.
const GEMV_WIDE_ROWS: usize = 8192;

/// Whether the gemv takes `m` tokens of an `n`-row layer, given the wgmma copy or not. The gemv's
/// time grows with the rows times the 8-token tiles, the wgmma tier's hardly moves up to 64
/// tokens; on an H200 (72615aa) the gemv led at 16 and 32 tokens on layers of 4096 and 6144 rows
/// (20.8 against 25.7 us on 4096x4096 at 32; 33.2 against 25.8 on 6144x4096 the one miss), the
/// wgmma tier on 28672 rows (47.3 against 73.8 at 16).
pub fn gemv_takes(m: usize, n: usize, has_wgmma: bool) -> bool {
    m <= GEMV_MAX_TOKENS && (!has_wgmma || m <= 8 || n <= GEMV_WIDE_ROWS)
}

/// `out = x · Wᵀ` (`[x.rows, n]`, f32 or the model dtype) for a COMET weight of `n` rows of `k`:
/// `x`'s mixed codes and block scales first (`comet_quantize_*`), then the GEMM.
pub fn gemm(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &CometWeight,
    n: usize,
    k: usize,
    out: &CudaTensor,
) -> Result<()> {
    let m = x.rows;
    if x.cols != k || (out.rows, out.cols) != (m, n) {
        return Err(Error::InvalidArgument(format!(
            "COMET GEMM: {}x{} input and {}x{} output for {n} rows of {k}",
            x.rows, x.cols, out.rows, out.cols
        )));
    }
    if m == 0 {
        return Ok(());
    }
    let (group, int8_blocks) = (w.group, w.int8_blocks);
    let blocks = k / group;
    // A context's override forces its choice (tests run both); the default hands wide layers to
    // the wgmma tier past 8 tokens.
    let use_gemv = ctx
        .comet_gemv()
        .unwrap_or_else(|| gemv_by_default() && gemv_takes(m, n, w.wgmma.is_some()));
    let gemv = gemv_tiles(m, use_gemv);
    // Batches the gemv does not take go to the wgmma tier where the weight has its copy. It
    // reads the tokens' block scales as [blocks][tokens] (rows of a multiple of 4 floats, as TMA
    // wants 16-byte strides), the other kernels as [tokens][blocks].
    let wgmma = if gemv.is_none() {
        w.wgmma.as_ref()
    } else {
        None
    };
    let m_pad = m.next_multiple_of(4);
    let (sx_row, sx_block) = if wgmma.is_some() {
        (1, m_pad)
    } else {
        (blocks, 1)
    };
    let codes = ctx.alloc_bytes(m * k)?;
    let scales = ctx.alloc(m_pad, blocks, Elem::F32)?.ptr;
    let in_sfx = x.elem.suffix();
    ctx.kernel(&format!("comet_quantize_{in_sfx}"))?.launch(
        &ctx.gpu,
        (m as u32, 1, 1),
        (32 * blocks).clamp(32, 1024) as u32,
        0,
        vec![
            Arg::Ptr(x.ptr),
            Arg::I64(x.ld as i64),
            Arg::Ptr(codes),
            Arg::Ptr(scales),
            Arg::I64(sx_row as i64),
            Arg::I64(sx_block as i64),
            Arg::I32(k as i32),
            Arg::I32(group as i32),
            Arg::I32(int8_blocks as i32),
        ],
    )?;
    let out_sfx = out.elem.suffix();
    if let Some(wg) = wgmma {
        return launch_wgmma(ctx, wg, (codes, scales), (m, m_pad, n, k), out);
    }
    let (name, grid, threads) = match gemv {
        Some(tt) => (
            format!("comet_gemv{tt}_{out_sfx}"),
            (
                n.div_ceil(GEMV_ROWS_PER_CTA) as u32,
                m.div_ceil(8 * tt) as u32,
                1,
            ),
            256,
        ),
        None => (
            format!("comet_gemm_{out_sfx}"),
            (
                n.div_ceil(ROWS_PER_CTA) as u32,
                m.div_ceil(TOKENS_PER_CTA) as u32,
                1,
            ),
            128,
        ),
    };
    ctx.kernel(&name)?.launch(
        &ctx.gpu,
        grid,
        threads,
        0,
        vec![
            Arg::Ptr(w.codes.ptr),
            Arg::Ptr(w.zeros.ptr),
            Arg::Ptr(w.scales.ptr),
            Arg::Ptr(codes),
            Arg::Ptr(scales),
            Arg::Ptr(out.ptr),
            Arg::I64(out.ld as i64),
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(group as i32),
        ],
    )
}

/// Tokens a `comet_wgmma*` tile takes: 64 for batches of up to 64, else 128.
pub fn wgmma_tokens(m: usize) -> usize {
    if m <= 64 { 64 } else { 128 }
}

/// Dynamic shared memory of `comet_wgmma*` with `tokens` a tile (kernels/qgemm_wgmma.cu,
/// `WgqComet`): its stages (the tokens' 128-byte rows, 8 KB of codes, 512 B of parameters, the
/// rows' and the tokens' block scales, padded to 1 KB), 1 KB to align the swizzle atoms, two
/// mbarriers a stage.
pub fn wgmma_smem(tokens: usize) -> u32 {
    let stages = if tokens == 128 { 8 } else { 12 }; // WgqComet::STAGES
    let stage = (tokens * 128 + 8 * 1024 + 8 * 64 + 128 * 4 + tokens * 4).next_multiple_of(1024);
    (stages * stage + 1024 + stages * 16) as u32
}

/// `comet_wgmma{64,128}_*` over the quantizer's INT8 codes `[m][k]` and block scales
/// `[blocks][m_pad]`: persistent CTAs, at most one an SM, over tiles of 128 rows x the tokens.
fn launch_wgmma(
    ctx: &CudaContext,
    w: &CometWgmma,
    (codes, scales): (u64, u64),
    (m, m_pad, n, k): (usize, usize, usize, usize),
    out: &CudaTensor,
) -> Result<()> {
    let tokens = wgmma_tokens(m);
    let blocks = k / WGMMA_GROUP;
    // Plain 2-D maps of f32 scales: a block's `box_len` consecutive values of a `[blocks][len]`
    // array.
    let scales_map = |ptr, len: usize, box_len| {
        let map = tensor_map(
            ptr,
            4,
            &[len, blocks],
            &[len * 4],
            &[box_len, 1],
            TmaLayout::Plain,
        )?;
        Ok::<_, Error>(Arg::TensorMap(Box::new(map)))
    };
    let x_map = tensor_map(
        codes,
        1,
        &[k, m],
        &[k],
        &[128, tokens],
        TmaLayout::Swizzle128,
    )?;
    let args = vec![
        // The tokens' codes, 128-byte swizzled boxes of 128 channels.
        Arg::TensorMap(Box::new(x_map)),
        // Two 512-byte chunks of 8 tiles' codes a stage (W4A8's), and the stage's group
        // parameter rows.
        weight_map(w.codes.ptr, w.tiles, w.chunks, 512, 2)?,
        weight_map(w.params.ptr, w.tiles, w.groups, 64, 1)?,
        // A block's scales of 128 rows, and of the tile's tokens.
        scales_map(w.row_scales.ptr, w.tiles * 16, 128)?,
        scales_map(scales, m_pad, tokens)?,
        Arg::Ptr(out.ptr),
        Arg::I64(out.ld as i64),
        Arg::I32(m as i32),
        Arg::I32(n as i32),
        Arg::I32(w.tiles as i32),
        Arg::I32(w.chunks as i32),
        Arg::I32(w.groups as i32),
    ];
    let out_tiles = w.tiles.div_ceil(8) * m.div_ceil(tokens);
    let ctas = out_tiles.min(ctx.gpu.sm_count);
    ctx.launch_block(
        &format!("comet_wgmma{tokens}_{}", out.elem.suffix()),
        (ctas as u32, 1, 1),
        WGMMA_THREADS,
        wgmma_smem(tokens),
        args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemv_hands_wide_layers_to_the_wgmma_tier_past_8_tokens() {
        // Without the wgmma copy the gemv takes every batch it can.
        assert!(gemv_takes(32, 28672, false));
        assert!(!gemv_takes(33, 4096, false));
        // With it: up to 8 tokens on any layer, up to 32 on layers of at most 8192 rows.
        assert!(gemv_takes(8, 28672, true));
        assert!(!gemv_takes(9, 28672, true));
        assert!(gemv_takes(32, GEMV_WIDE_ROWS, true));
        assert!(!gemv_takes(32, GEMV_WIDE_ROWS + 1, true));
        assert!(!gemv_takes(33, 4096, true));
    }

    #[test]
    fn wgmma_packing_widens_to_q_minus_z_and_transposes_the_scales() {
        // Rows off the 16-row tiles, every zero and code, and what the kernels' byte-affine
        // widening makes of the packed words (PackedW4A8::widened) against q - z per group.
        let (n, k, group) = (40, 384, WGMMA_GROUP);
        let groups = k / group;
        let mut r = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(7);
        let p = PackedComet {
            codes: (0..n * k / 2).map(|_| rand::Rng::random(&mut r)).collect(),
            zeros: (0..n * groups)
                .map(|_| rand::Rng::random_range(&mut r, 0..16u8))
                .collect(),
            scales: (0..n * groups).map(|i| 0.5 + i as f32).collect(),
        };
        let (packed, row_scales) = pack_wgmma(&p, n, k, group).unwrap();
        let widened = packed.widened();
        for row in 0..n {
            for ch in 0..k {
                let byte = p.codes[row * k / 2 + ch / 2];
                let q = if ch % 2 == 0 { byte & 15 } else { byte >> 4 };
                let z = p.zeros[row * groups + ch / group];
                assert_eq!(
                    widened[row * k + ch],
                    q as i8 - z as i8,
                    "row {row} channel {ch}"
                );
            }
        }
        let cols = packed.tiles * 16;
        assert_eq!(row_scales.len(), groups * cols);
        for b in 0..groups {
            for row in 0..cols {
                let want = if row < n {
                    p.scales[row * groups + b]
                } else {
                    0.0
                };
                assert_eq!(row_scales[b * cols + row], want, "block {b} row {row}");
            }
        }
        assert!(
            pack_wgmma(&p, n, k + group, group).is_err(),
            "sizes that disagree"
        );
    }

    #[test]
    fn wgmma_shared_memory_fits_a_hopper_sm() {
        for tokens in [64, 128] {
            assert!(
                wgmma_smem(tokens) + crate::qlinear::WGMMA_STATIC_SMEM <= 227 * 1024,
                "{tokens} tokens"
            );
        }
        assert_eq!(wgmma_tokens(33), 64);
        assert_eq!(wgmma_tokens(65), 128);
    }

    fn comet(group: u32, int8_blocks: u16) -> LinearFormat {
        LinearFormat::new(
            WeightCodec::Int4Group { group },
            ActQuant::Mixed4x8 {
                block: group as u16,
                int8_blocks,
            },
        )
        .unwrap()
    }

    #[test]
    fn geometry_takes_comet_formats_the_kernels_can_read() {
        assert_eq!(
            geometry(comet(128, 2), 4096),
            Some(CometGeometry {
                group: 128,
                int8_blocks: 2
            })
        );
        assert!(geometry(comet(32, 0), 96).is_some());
        assert!(
            geometry(comet(64, 1), 96).is_none(),
            "k not a whole number of blocks"
        );
        assert!(geometry("int4-g128/a8".parse().unwrap(), 4096).is_none());
        assert!(geometry("qoq-g128/a8".parse().unwrap(), 4096).is_none());
    }

    #[test]
    fn packing_keeps_the_reference_integers_and_scales() {
        // The kernels' arrays hold exactly what WeightCodec::integer_row gives: q - z per channel
        // from the nibbles and zeros, and the group scales.
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for (group, k) in [(32, 96), (64, 256), (128, 384)] {
            let format = comet(group, 1);
            let n = 5;
            let rb = format.row_bytes(k).unwrap();
            let mut bytes = vec![0u8; n * rb];
            for row in bytes.chunks_exact_mut(rb) {
                let vals: Vec<f32> = (0..k).map(|_| r.random_range(-2f32..2.0)).collect();
                format.codec.quantize_row(&vals, 1.0, row).unwrap();
            }
            let p = pack(format, n, k, &bytes).unwrap();
            let groups = k / group as usize;
            let (mut ints, mut scales) = (vec![0i8; k], vec![]);
            for (i, row) in bytes.chunks_exact(rb).enumerate() {
                format.codec.integer_row(row, k, &mut ints, &mut scales);
                for (j, &want) in ints.iter().enumerate() {
                    let byte = p.codes[i * k / 2 + j / 2];
                    let q = (byte >> ((j % 2) * 4)) & 15;
                    let z = p.zeros[i * groups + j / group as usize];
                    assert_eq!(q as i32 - z as i32, want as i32, "row {i} channel {j}");
                }
                assert_eq!(&p.scales[i * groups..(i + 1) * groups], &scales[..]);
            }
        }
    }

    /// CUDA's `__byte_perm(x, y, s)`: byte i of the result is byte `s >> 4i & 7` of `y:x`.
    fn byte_perm(x: u32, y: u32, s: u32) -> u32 {
        let bytes = ((y as u64) << 32 | x as u64).to_le_bytes();
        u32::from_le_bytes(std::array::from_fn(|i| bytes[(s >> (4 * i) & 7) as usize]))
    }

    /// CUDA's `__vsub4`: byte-wise subtraction, wrapping.
    fn vsub4(a: u32, b: u32) -> u32 {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        u32::from_le_bytes(std::array::from_fn(|i| a[i].wrapping_sub(b[i])))
    }

    /// kernels/comet.cu's `comet_widen`.
    fn widen(w: u32, z: u32) -> (u32, u32) {
        let (even, odd) = (w & 0x0f0f_0f0f, (w >> 4) & 0x0f0f_0f0f);
        let zz = z.wrapping_mul(0x0101_0101);
        (
            vsub4(byte_perm(even, odd, 0x5140), zz),
            vsub4(byte_perm(even, odd, 0x7362), zz),
        )
    }

    /// One warp's exact i32 fragments of block `b` (`[lane][tile][register]`, `tiles` 8-token
    /// tiles from token `m0`, rows `row0 ..`), as `comet_gemm_impl` and `comet_gemv_impl` form
    /// them, step by step with mma.sync m16n8k32's fragment layout (PTX ISA: A's registers 0 / 1
    /// / 2 / 3 hold row g / g + 8 / g / g + 8 at k 4t.. / 4t.. / 16 + 4t.. / 16 + 4t..; B's 0 / 1
    /// column g at k 4t.. / 16 + 4t..; C's 0, 1 / 2, 3 row g / g + 8 at columns 2t, 2t + 1), on
    /// the packed arrays and the activations' codes.
    #[allow(clippy::needless_range_loop)] // lanes, tiles and registers by index, as the kernel
    fn warp_block_fragments(
        p: &PackedComet,
        x: &[i8],
        (m, n, k, block): (usize, usize, usize, usize),
        row0: usize,
        m0: usize,
        b: usize,
        tiles: usize,
    ) -> Vec<Vec<[i32; 4]>> {
        let blocks = k / block;
        let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let byte = |r: u32, i: usize| r.to_le_bytes()[i] as i8 as i32;
        let mut frag = vec![vec![[0i32; 4]; tiles]; 32];
        for s in 0..block / 32 {
            let k0 = b * block + s * 32;
            let mut am = [[0i32; 32]; 16];
            let mut bv = vec![vec![[0u32; 2]; tiles]; 32];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                let ra = if row0 + g < n { row0 + g } else { 0 };
                let rb = if row0 + g + 8 < n { row0 + g + 8 } else { 0 };
                let za = p.zeros[ra * blocks + b] as u32;
                let zb = p.zeros[rb * blocks + b] as u32;
                let (a0, a2) = widen(u32_at(&p.codes, ra * k / 2 + 4 * t + k0 / 2), za);
                let (a1, a3) = widen(u32_at(&p.codes, rb * k / 2 + 4 * t + k0 / 2), zb);
                for i in 0..4 {
                    am[g][4 * t + i] = byte(a0, i);
                    am[g + 8][4 * t + i] = byte(a1, i);
                    am[g][16 + 4 * t + i] = byte(a2, i);
                    am[g + 8][16 + 4 * t + i] = byte(a3, i);
                }
                for (tt, v) in bv[lane].iter_mut().enumerate() {
                    let tok = m0 + tt * 8 + g;
                    let tok = if tok < m { tok } else { 0 };
                    let xb: Vec<u8> = x[tok * k + 8 * t + k0..][..8]
                        .iter()
                        .map(|&c| c as u8)
                        .collect();
                    *v = [u32_at(&xb, 0), u32_at(&xb, 4)];
                }
            }
            // The warp's mma per tile: A 16 x 32 and B 32 x 8 from the lanes' registers.
            for tt in 0..tiles {
                let mut bm = [[0i32; 8]; 32];
                for (lane, v) in bv.iter().enumerate() {
                    let (g, t) = (lane / 4, lane % 4);
                    for i in 0..4 {
                        bm[4 * t + i][g] = byte(v[tt][0], i);
                        bm[16 + 4 * t + i][g] = byte(v[tt][1], i);
                    }
                }
                for (lane, f) in frag.iter_mut().enumerate() {
                    let (g, t) = (lane / 4, lane % 4);
                    for e in 0..4 {
                        let (row, col) = (g + 8 * (e >> 1), 2 * t + (e & 1));
                        f[tt][e] += (0..32).map(|kk| am[row][kk] * bm[kk][col]).sum::<i32>();
                    }
                }
            }
        }
        frag
    }

    /// `comet_gemm_impl`: CTAs of 4 warps over 64 rows x 32 tokens, each lane folding its
    /// fragments block by block.
    #[allow(clippy::needless_range_loop)]
    fn emulated_gemm(
        p: &PackedComet,
        x: &[i8],
        sx: &[f32],
        (m, n, k, block): (usize, usize, usize, usize),
    ) -> Vec<f32> {
        let blocks = k / block;
        let mut y = vec![f32::NAN; m * n];
        for bx in 0..n.div_ceil(ROWS_PER_CTA) {
            for by in 0..m.div_ceil(TOKENS_PER_CTA) {
                for warp in 0..4 {
                    let (row0, m0) = (bx * ROWS_PER_CTA + warp * 16, by * TOKENS_PER_CTA);
                    let mut acc = [[[0f32; 4]; 4]; 32];
                    for b in 0..blocks {
                        let frag = warp_block_fragments(p, x, (m, n, k, block), row0, m0, b, 4);
                        for (lane, f) in frag.iter().enumerate() {
                            let (g, t) = (lane / 4, lane % 4);
                            let ra = if row0 + g < n { row0 + g } else { 0 };
                            let rb = if row0 + g + 8 < n { row0 + g + 8 } else { 0 };
                            for tt in 0..4 {
                                for e in 0..4 {
                                    let tok = (m0 + tt * 8 + 2 * t + (e & 1)).min(m - 1);
                                    let swr = p.scales[if e < 2 { ra } else { rb } * blocks + b];
                                    let c = swr * sx[tok * blocks + b];
                                    acc[lane][tt][e] =
                                        (f[tt][e] as f32).mul_add(c, acc[lane][tt][e]);
                                }
                            }
                        }
                    }
                    for (lane, a) in acc.iter().enumerate() {
                        let (g, t) = (lane / 4, lane % 4);
                        for tt in 0..4 {
                            for e in 0..4 {
                                let (row, tok) =
                                    (row0 + g + 8 * (e >> 1), m0 + tt * 8 + 2 * t + (e & 1));
                                if row < n && tok < m {
                                    y[tok * n + row] = a[tt][e];
                                }
                            }
                        }
                    }
                }
            }
        }
        y
    }

    /// The blocks a `comet_gemv*` round covers, two for each of its 8 warps.
    const GEMV_SLOTS: usize = 16;

    /// `comet_gemv_impl` with `tiles` 8-token tiles a CTA: 16 rows, rounds of 16 blocks parked
    /// by 8 warps (blocks b0 + w and b0 + 8 + w) in `part[slot][tile * 4 + register][lane]`,
    /// then folded by 256 threads, thread `o` (and `o + 256`) owning output
    /// `(tile * 4 + register) * 32 + lane` of the CTA.
    #[allow(clippy::needless_range_loop)]
    fn emulated_gemv(
        p: &PackedComet,
        x: &[i8],
        sx: &[f32],
        (m, n, k, block): (usize, usize, usize, usize),
        tiles: usize,
    ) -> Vec<f32> {
        let blocks = k / block;
        let outs = tiles * 128;
        let mut y = vec![f32::NAN; m * n];
        for bx in 0..n.div_ceil(GEMV_ROWS_PER_CTA) {
            for by in 0..m.div_ceil(8 * tiles) {
                let (row0, m0) = (bx * GEMV_ROWS_PER_CTA, by * 8 * tiles);
                let mut acc = vec![0f32; outs];
                for b0 in (0..blocks).step_by(GEMV_SLOTS) {
                    let mut part = vec![vec![[0i32; 32]; tiles * 4]; GEMV_SLOTS];
                    for warp in 0..8 {
                        for j in 0..2 {
                            let b = b0 + warp + 8 * j;
                            if b >= blocks {
                                continue;
                            }
                            let frag =
                                warp_block_fragments(p, x, (m, n, k, block), row0, m0, b, tiles);
                            for (lane, f) in frag.iter().enumerate() {
                                for tt in 0..tiles {
                                    for e in 0..4 {
                                        part[warp + 8 * j][tt * 4 + e][lane] = f[tt][e];
                                    }
                                }
                            }
                        }
                    }
                    let used = GEMV_SLOTS.min(blocks - b0);
                    for (o, a) in acc.iter_mut().enumerate() {
                        let (ol, e, tt) = (o & 31, (o >> 5) & 3, o >> 7);
                        let row = row0 + (ol >> 2) + 8 * (e >> 1);
                        let rw = if row < n { row } else { 0 } * blocks;
                        let rx = (m0 + tt * 8 + 2 * (ol & 3) + (e & 1)).min(m - 1) * blocks;
                        for (sl, slot) in part.iter().enumerate().take(used) {
                            let c = p.scales[rw + b0 + sl] * sx[rx + b0 + sl];
                            *a = (slot[tt * 4 + e][ol] as f32).mul_add(c, *a);
                        }
                    }
                }
                for (o, a) in acc.iter().enumerate() {
                    let (ol, e, tt) = (o & 31, (o >> 5) & 3, o >> 7);
                    let (row, tok) = (
                        row0 + (ol >> 2) + 8 * (e >> 1),
                        m0 + tt * 8 + 2 * (ol & 3) + (e & 1),
                    );
                    if row < n && tok < m {
                        y[tok * n + row] = *a;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn the_kernels_lane_arithmetic_is_the_references() {
        // The GEMM's register recipe (nibble widening, the permuted K order, the fragments, the
        // block-ordered fma) emulated lane by lane gives reference_matmul's bits; the quantizer's
        // codes and block scales are act::quantize_mixed's, as kernels/comet.cu computes them.
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        // The gemv's cases: rounds of 16 blocks with a partial last one (40 blocks), fewer blocks
        // than warps, three steps a block (96), 1, 2 and 4 token tiles, rows off its 16.
        for (group, k, n, m, int8_blocks) in [
            (32, 96, 20, 5, 1),
            (64, 256, 72, 33, 2),
            (128, 384, 64, 3, 0),
            (32, 1280, 20, 1, 3),
            (64, 1152, 40, 12, 4),
            (96, 960, 24, 27, 1),
        ] {
            let format = comet(group, int8_blocks);
            let rb = format.row_bytes(k).unwrap();
            let mut bytes = vec![0u8; n * rb];
            for row in bytes.chunks_exact_mut(rb) {
                let vals: Vec<f32> = (0..k).map(|_| r.random_range(-2f32..2.0)).collect();
                format.codec.quantize_row(&vals, 1.0, row).unwrap();
            }
            let mut x: Vec<f32> = (0..m * k).map(|_| r.random_range(-3f32..3.0)).collect();
            x[k / 2] = 50.0;
            if m > 2 {
                x[2 * k..3 * k].fill(0.0);
            }
            let blocks = k / group as usize;
            let (mut codes, mut sx) = (vec![0i8; m * k], vec![0f32; m * blocks]);
            for i in 0..m {
                nibble_precision::act::quantize_mixed(
                    &x[i * k..(i + 1) * k],
                    group as usize,
                    int8_blocks as usize,
                    &mut codes[i * k..(i + 1) * k],
                    &mut sx[i * blocks..(i + 1) * blocks],
                );
            }
            let p = pack(format, n, k, &bytes).unwrap();
            let dims = (m, n, k, group as usize);
            let want = nibble_precision::reference_matmul(format, &x, m, k, &bytes, n).unwrap();
            let mut runs = vec![(
                "comet_gemm".to_string(),
                emulated_gemm(&p, &codes, &sx, dims),
            )];
            if let Some(tiles) = gemv_tiles(m, true) {
                runs.push((
                    format!("comet_gemv{tiles}"),
                    emulated_gemv(&p, &codes, &sx, dims, tiles),
                ));
            }
            for (kernel, got) in runs {
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{kernel} {format} element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn packing_refuses_rows_it_cannot_read() {
        let format = comet(64, 0);
        assert!(pack(format, 2, 256, &[0u8; 10]).is_err());
        assert!(pack(comet(64, 0), 1, 96, &[0u8; 60]).is_err());
    }
}

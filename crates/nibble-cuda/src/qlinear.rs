//! Quantized linear layers on the GPU: the weight formats with kernels of their own
//! (`kernels/qgemm.cu`), how a checkpoint's rows become packed device weights (`pack`), and
//! which kernel a GEMM runs.
//!
//! | format | kernels | activations |
//! |---|---|---|
//! | `int4-gN/a16` (w4a16, AWQ, GPTQ) | `w4a16_stream{1,2,4}` (sm_90) or `w4a16_gemv{1,2,4,8}`, `w4a16_tiled` | model dtype |
//! | `int8-pc/a8` (w8a8) | `w8a8_stream{1,2,4}` (sm_90) or `w8a8_gemv{1,2,4,8}`, `w8a8_tiled` | INT8 per token, quantized by the producing RMSNorm / SiLU-gate kernel or `quantize_i8` |
//! | `qoq-gN/a8`, `lqq-gN/a8`, `int4-pc/a8` (w4a8) | `w4a8_dec{1,2,4}` up to 32 tokens, `w4a8_wgmma{64,128,}` beyond (sm_90a only) | as W8A8 |
//! | `int8-pc/a16` (w8a16; INT8 codes in k16 fragments, `pack::Int8Layout::F16`) | `w8a16_dec{1,2}` up to 16 tokens, `w8a16_wgmma{64,128,}` beyond (sm_90a only) | model dtype |
//! | `fp8-pc/afp8` (fp8; row-major codes, `pack::PackedFp8`) | `fp8_dec{1,2,4}` up to 32 tokens, `fp8_wgmma{64,128}` beyond (sm_90a only; kernels/qgemm_fp8.cu) | FP8 e4m3 per token, by the producing kernel or `quantize_f8` |
//!
//! Other quantized formats load dequantized to the model dtype and run on cuBLAS; so do W4A8,
//! FP8 and W8A16 weights on GPUs without the Hopper kernels, and QoQ groups whose codes the word
//! arithmetic cannot widen exactly ([`WeightCodec::byte_affine`]).

use nibble_core::{Error, Result};
use nibble_formats::{HostTensor, WeightFormat};
use nibble_precision::{ActQuant, LinearFormat, WeightCodec};
use rayon::prelude::*;

use crate::context::{CudaContext, row_regs_block};
pub use crate::context::{KernelTier, SPLIT_COUNTERS};
use crate::pack::{
    self, Int8Layout, PackedFp8, PackedW4, PackedW4A8, PackedW8, W4A8Matrix, W4Matrix,
};
use crate::runtime::{
    Arg, DeviceBuffer, TmaLayout, WGMMA_THREADS, probe_knob, tensor_map, weight_map,
};
pub use crate::tensor::{Act8, Act8Input, QuantWeight};
use crate::tensor::{CudaTensor, Dtype, Elem};

/// Largest M the gemv (decode) kernels take; larger batches run the tiled kernels (whose 128-token
/// tiles and one CTA per 128 weight rows leave most of the GPU idle at 64 tokens: 80 µs against
/// cuBLAS's 8 on a 4096x4096 layer, BENCHMARKS.md).
pub const GEMV_MAX_M: usize = 64;
/// Dynamic shared memory of the tiled kernels (4 stages).
pub const W4_TILED_SMEM: u32 = 4 * (5120 + 128 * 144);
pub const W8_TILED_SMEM: u32 = 4 * (8192 + 128 * 64);
/// Most tokens the persistent decode gemv (kernels/qgemv.cu) takes for W4A16: two 8-token MMA
/// tiles.
pub const DECODE_MAX_M: usize = 16;
/// Most tokens it takes for W4A16, in three 8-token tiles past [`DECODE_MAX_M`] (`w4a16_dec4`:
/// each tile's activations read just before its MMAs, `DecW4::mma_rows`), on layers of at least
/// [`DECODE_LARGE_LAYER`] weights where the activation window fits ([`plan_decode`]). Against the
/// 64-token wgmma tiles with their K splits on an H100 (bench/results/decode-cap-20261126-h100):
/// 28672x4096 at 24 tokens 49.9 against 55.9 µs, 4096x14336 28.2 against 29.8; at 28 tokens the
/// tiles win, and on 6144x4096 and 4096x4096 from 17 tokens (19.7 against 23.9 µs at 20).
pub const DECODE_MAX_M_W4A16: usize = 24;
/// Weights (rows x columns) from which a layer keeps W4A16's decode gemv up to
/// [`DECODE_MAX_M_W4A16`] tokens; smaller ones hand over at [`DECODE_MAX_M`].
pub const DECODE_LARGE_LAYER: usize = 32 << 20;
/// Most tokens the decode gemv takes for FP8: past 8 the 64-token wgmma tiles won on an H100 on
/// three of Llama-3-8B's four layers at 12 and 16 tokens (28672x4096 at 16: 45.8 against 57.0 µs),
/// and the sum of the four (107.8 against 117.2 µs at 12).
pub const DECODE_MAX_M_FP8: usize = 8;
/// Most tokens the grouped (MoE) decode gemv takes for the INT8-activation families: four tiles.
/// The dense layers of W8A8 and W4A8 hand over at [`DECODE_MAX_M`]: since the wgmma tiles split
/// K, they win from 17 tokens on an H100 (W4A8 6144x4096 at 32: 14.6 against 27.5 µs, W8A8
/// 28672x4096 48.2 against 67.0; bench/results/decode-cap-20261126-h100). Before the splits were
/// mended the gemv won up to 32 (4096x4096 W4A8 16.7 against 27.1 µs on an H200).
pub const DECODE_MAX_M_INT8: usize = 32;
/// Chunks of 64 channels per register batch of the decode gemv (`U` of its entry points): the
/// input width must be a multiple of `64 * DECODE_BATCH`.
pub(crate) const DECODE_BATCH: usize = 4;
/// Weight rows per decode-gemv row block: one 16-row tile per warp of its 16-warp CTAs.
pub(crate) const DECODE_BLOCK_TILES: usize = 16;
/// Shared memory the decode gemv may take for its staged activations and their sums.
pub(crate) const DECODE_SMEM: usize = 200 * 1024;
/// Tokens per CTA of the wgmma kernels (kernels/qgemm_wgmma.cu): [`KernelTier::Auto`] takes them
/// from one full CTA of tokens on.
pub const WGMMA_TOKENS: usize = 256;

/// Tokens per tile of the wgmma kernel for batches past the decode gemv (17 to 64 tokens).
pub const WGMMA_SMALL_TOKENS: usize = 64;

/// Static shared memory of every wgmma kernel (kernels/qgemm_wgmma.cu, `wgmma_gemm`) beside its
/// dynamic stages: the epilogue's 512 bytes a consumer warp (`store_tile_staged`) and the split
/// flag.
pub const WGMMA_STATIC_SMEM: u32 = 8 * 512 + 16;

/// Dynamic shared memory of a wgmma kernel with `tokens` per tile (kernels/qgemm_wgmma.cu,
/// `WgqW8` / `WgqW4` / `WgqW4A8`): stages x (the token rows of 128 B a chunk box + the 8 weight
/// tiles' bytes), 1 KB to align the swizzle atoms, two mbarriers per stage.
pub fn wgmma_smem(family: QFamily, tokens: usize) -> u32 {
    let stages = match (family, tokens) {
        (QFamily::W8A8, WGMMA_TOKENS) => 4,
        (QFamily::W8A8, 128) => 6,
        (QFamily::W8A8, _) => 8,
        (QFamily::Fp8, 128) => 6,
        (QFamily::Fp8, _) => 8,
        (QFamily::W4A16, WGMMA_TOKENS) => 5,
        (QFamily::W4A16, 128) => 5,
        (QFamily::W4A16, _) => 8,
        (QFamily::W8A16, WGMMA_TOKENS) => 5,
        (QFamily::W8A16, 128) => 4,
        (QFamily::W8A16, _) => 6,
        (_, WGMMA_TOKENS) => 5,
        (_, 128) => 8,
        (_, _) => 12,
    };
    let chunks = stage_chunks_16(tokens);
    let x_boxes = if family.x_elem() == 2 { chunks } else { 1 };
    let weights = match family {
        // Codes, and room for the parameter rows of groups of 32.
        QFamily::W4A16 => chunks * (8 * 512 + 8 * 128),
        QFamily::W8A8 => 8 * 2048,
        QFamily::W8A16 => chunks * 8 * 1024,
        QFamily::Fp8 => 128 * 128,
        QFamily::W4A8 => 8 * 1024 + 8 * 4 * 64,
    };
    (stages * (x_boxes * tokens * 128 + weights) + 1024 + stages * 16) as u32
}

/// 64-channel chunks a wgmma stage of the 16-bit-activation families (W4A16, W8A16) takes with
/// `tokens` per tile (kernels/qgemm_wgmma.cu, `WgqW4::CPS`, `WgqW8A16::CPS`): two, but one at 256
/// tokens, whose accumulators leave no registers for more.
fn stage_chunks_16(tokens: usize) -> usize {
    if tokens == WGMMA_TOKENS { 1 } else { 2 }
}

/// Groups of W4A16 parameters one wgmma stage of `channels` reads (`WgqW4::span`): one when
/// groups are whole stages, all of them when they divide a stage, else as many as a stage can
/// touch (groups are multiples of 32, or of 16 from 64: pack::check_k).
fn w4a16_span(group_len: usize, channels: usize) -> usize {
    if group_len.is_multiple_of(channels) {
        1
    } else if channels.is_multiple_of(group_len) {
        channels / group_len
    } else {
        channels / group_len + 2
    }
}

/// Tokens per wgmma tile for `m` tokens on a layer of `tiles` 16-row weight tiles: 256, or 128
/// where that needs clearly fewer rounds of the `sms` persistent CTAs for the work. A 128-token
/// tile does about a third less per token (its conversions and barriers shared by half the
/// tokens: on an H200, 1024x28672x4096 W8A8 took 260 µs in 128-token tiles against 196 in 256),
/// so it wins where the second token block would be mostly padding, not on 6144x4096 at M = 1024
/// (two rounds of 256-token tiles against three of 128: 60.0 against 62 µs W8A8, 120 against 114
/// W4A16).
pub fn wgmma_tokens(m: usize, tiles: usize, sms: usize) -> usize {
    if m <= WGMMA_SMALL_TOKENS {
        return WGMMA_SMALL_TOKENS;
    }
    let cost = |t: usize, per_mille: usize| {
        (tiles.div_ceil(8) * m.div_ceil(t)).div_ceil(sms.max(1)) * t * per_mille
    };
    if cost(128, 1350) < cost(WGMMA_TOKENS, 1000) {
        128
    } else {
        WGMMA_TOKENS
    }
}

/// Most tokens per tile of a wgmma entry that splits K (kernels/qgemm_wgmma.cu, `SPLITS`).
const SPLIT_MAX_TOKENS: usize = 128;

/// K splits per output tile of a 64- or 128-token wgmma kernel with `out_tiles` tiles of
/// `stages` stages each on `sms` SMs: with fewer tiles than SMs, as many as fill the SMs, at most
/// 8 and keeping at least `min_stages` stages a split ([`QFamily::min_split_stages`]); else 1.
pub fn wgmma_splits(out_tiles: usize, stages: usize, sms: usize, min_stages: usize) -> usize {
    if out_tiles == 0 || out_tiles >= sms {
        return 1;
    }
    (sms / out_tiles)
        .min(8)
        .min(stages / min_stages.max(1))
        .max(1)
}

/// The quantized format a GPU kernel runs directly, if `f` is one.
pub fn kernel_format(f: WeightFormat) -> Option<LinearFormat> {
    let WeightFormat::Quant(lf) = f else {
        return None;
    };
    QFamily::of(lf).map(|_| lf)
}

/// The kernel families of the quantized GEMMs, by weight and activation format.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QFamily {
    /// INT4 in groups, 16-bit activations (`int4-gN/a16`).
    W4A16,
    /// INT8 per channel, INT8 per token (`int8-pc/a8`).
    W8A8,
    /// INT8 per channel made 16-bit in registers, 16-bit activations (`int8-pc/a16`).
    W8A16,
    /// 4-bit codes widened to INT8 in registers, INT8 per token (`qoq-gN/a8`, `lqq-gN/a8`,
    /// `int4-pc/a8`).
    W4A8,
    /// FP8 e4m3 per channel, FP8 e4m3 per token (`fp8-pc/afp8`), row-major codes.
    Fp8,
}

impl QFamily {
    pub const ALL: [QFamily; 5] = [
        QFamily::W4A16,
        QFamily::W8A8,
        QFamily::W8A16,
        QFamily::W4A8,
        QFamily::Fp8,
    ];

    pub fn of(f: LinearFormat) -> Option<QFamily> {
        match (f.codec, f.act) {
            (WeightCodec::Int4Group { .. }, ActQuant::F16) => Some(QFamily::W4A16),
            (WeightCodec::Int8PerChannel, ActQuant::Int8PerToken) => Some(QFamily::W8A8),
            (WeightCodec::Int8PerChannel, ActQuant::F16) => Some(QFamily::W8A16),
            (
                WeightCodec::Qoq { .. }
                | WeightCodec::Lqq { .. }
                | WeightCodec::Int4Group { group: 0 },
                ActQuant::Int8PerToken,
            ) => Some(QFamily::W4A8),
            (WeightCodec::Fp8PerChannel, ActQuant::Fp8PerToken) => Some(QFamily::Fp8),
            _ => None,
        }
    }

    /// Families with the Hopper kernels only (the decode gemv and wgmma, sm_90a): no mma.sync
    /// gemv or tiled kernel to fall back on.
    pub fn hopper_only(self) -> bool {
        matches!(self, QFamily::W4A8 | QFamily::Fp8 | QFamily::W8A16)
    }

    /// A kernel that exists only where the family's Hopper kernels were compiled.
    pub fn hopper_probe(self) -> &'static str {
        match self {
            QFamily::W4A16 => "w4a16_wgmma64_bf16",
            QFamily::W8A8 => "w8a8_wgmma64_f32",
            QFamily::W8A16 => "w8a16_wgmma64_bf16",
            QFamily::W4A8 => "w4a8_wgmma64_f32",
            QFamily::Fp8 => "fp8_wgmma64_f32",
        }
    }

    /// Tokens per tile of its largest wgmma kernel: FP8's promotion fragment leaves no registers
    /// for 256-token tiles (kernels/qgemm_fp8.cu).
    fn max_wgmma_tokens(self) -> usize {
        if self == QFamily::Fp8 {
            128
        } else {
            WGMMA_TOKENS
        }
    }

    /// The fewest wgmma stages a K split keeps. On an H100 at M = 64
    /// (bench/probe/wgmma_splits_probe.sh, bench/results/wgmma-splits-20261126-h100), in µs for
    /// 1 / 2 / 4 splits: W4A8 4096x4096 20.4 / 16.2 / 14.7, 6144x4096 20.8 / 16.5 / 25.5,
    /// 4096x14336 53.7 / 33.3 / 23.7; W8A8 4096x4096 19.1 / 16.3 / 17.1; W8A16 (64 channels a
    /// stage) 4096x4096 28.2 / 19.0 / 16.3. So 16 stages for W8A8 and FP8 and 8 for the
    /// others, whose stages take the longest to convert (W4A16's and W8A16's stages are 128
    /// channels below 256 tokens: 32 stages at K = 4096, as W4A8's). Before the split reduction
    /// loaded each split's values together, the 8-bit families lost with splits and kept 28.
    pub fn min_split_stages(self) -> usize {
        match self {
            QFamily::W4A16 | QFamily::W4A8 | QFamily::W8A16 => 8,
            QFamily::W8A8 | QFamily::Fp8 => 16,
        }
    }

    /// Most tokens the decode gemv takes for this family on a layer of `weights` (rows x
    /// columns; [`plan_decode`]).
    pub fn decode_max_m(self, weights: usize) -> usize {
        let most = match self {
            QFamily::W4A16 if weights >= DECODE_LARGE_LAYER => DECODE_MAX_M_W4A16,
            QFamily::W4A16 | QFamily::W8A16 | QFamily::W8A8 | QFamily::W4A8 => DECODE_MAX_M,
            QFamily::Fp8 => DECODE_MAX_M_FP8,
        };
        forced_decode_max_m().map_or(most, |cap| most.min(cap))
    }

    /// Bytes of one activation element.
    fn x_elem(self) -> usize {
        match self {
            QFamily::W4A16 | QFamily::W8A16 => 2,
            QFamily::W8A8 | QFamily::W4A8 | QFamily::Fp8 => 1,
        }
    }

    /// Whether this family's kernels have SwiGLU entries (kernels/qgemm.cu, `SwiGluEpilogue`:
    /// the decode gemv and the wgmma tiles, [`QKernel::has_swiglu_entry`];
    /// [`swiglu_kernel_name`]): the 8-bit-activation families, whose SiLU-gate would otherwise
    /// read both halves back in f32 to write its codes (docs/design/decode-step-256.md).
    pub fn has_swiglu(self) -> bool {
        matches!(self, QFamily::W4A8 | QFamily::W8A8 | QFamily::Fp8)
    }

    /// The kernels this family has for `m` tokens, on a GPU with (`hopper`) or without the sm_90
    /// ones: what the dispatch may ask for.
    pub fn kernels(self, hopper: bool, m: usize) -> Vec<QKernel> {
        let mut kinds = vec![];
        if !self.hopper_only() {
            kinds.extend([QKernel::Gemv, QKernel::Tiled]);
        }
        if hopper && m <= self.decode_max_m(usize::MAX) {
            kinds.push(QKernel::Decode);
            match self {
                QFamily::W4A16 => kinds.push(QKernel::DecodeG64),
                QFamily::W4A8 => kinds.push(QKernel::DecodeG32),
                _ => {}
            }
        }
        if hopper {
            if self.max_wgmma_tokens() == WGMMA_TOKENS {
                kinds.push(QKernel::Wgmma);
            }
            kinds.extend([QKernel::Wgmma128, QKernel::Wgmma64]);
            if self == QFamily::Fp8 {
                kinds.push(QKernel::Wgmma128Whole);
            }
        }
        kinds
    }
}

/// `(format, rows, cols, row bytes)` of a weight in a kernel format.
pub type StackedRows = (LinearFormat, usize, usize, Vec<u8>);

/// Host rows of `parts` (one weight, or the parts of a fused projection stacked in order) when
/// they share one kernel format and width: `(format, rows, cols, bytes)`.
pub fn stacked_rows(parts: &[HostTensor]) -> Result<Option<StackedRows>> {
    stacked_rows_of(parts, kernel_format)
}

/// [`stacked_rows`] for the formats `format_of` takes (COMET's own kernel takes others).
pub fn stacked_rows_of(
    parts: &[HostTensor],
    format_of: impl Fn(WeightFormat) -> Option<LinearFormat>,
) -> Result<Option<StackedRows>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let Some(format) = format_of(first.format) else {
        return Ok(None);
    };
    let (_, cols, _) = first.matrix_geometry()?;
    let mut rows = 0;
    let mut bytes = Vec::new();
    for t in parts {
        let (r, c, _) = t.matrix_geometry()?;
        if t.format != first.format || c != cols {
            return Ok(None);
        }
        rows += r;
        bytes.extend_from_slice(&t.bytes);
    }
    Ok(Some((format, rows, cols, bytes)))
}

/// Rows of a gate and an up projection a run of the SwiGLU epilogue holds: the thread with a gate
/// row's sums holds its up partner's too (kernels/qgemm.cu, `SwiGluEpilogue`).
pub const SWIGLU_RUN: usize = 8;

/// A SwiGLU layer's gate and up rows (`[ffn, k]` each) interleaved for the SwiGLU epilogue:
/// packed rows `16j .. 16j + 7` are gate rows `8j ..`, rows `16j + 8 ..` up rows `8j ..`. `None`
/// where the pair does not share one kernel format and shape, or `ffn` is not a multiple of 8.
pub fn swiglu_rows(gate: &HostTensor, up: &HostTensor) -> Result<Option<StackedRows>> {
    let Some(format) = kernel_format(gate.format) else {
        return Ok(None);
    };
    let (rows, cols, row_bytes) = gate.matrix_geometry()?;
    let (up_rows, up_cols, _) = up.matrix_geometry()?;
    if up.format != gate.format
        || (up_rows, up_cols) != (rows, cols)
        || rows == 0
        || !rows.is_multiple_of(SWIGLU_RUN)
    {
        return Ok(None);
    }
    let run = SWIGLU_RUN * row_bytes;
    Ok(Some((
        format,
        2 * rows,
        cols,
        interleave_runs(&gate.bytes, &up.bytes, run),
    )))
}

/// `a` and `b` (of equal length) in alternating runs of `run` bytes: a run of `a`, then one of `b`.
fn interleave_runs(a: &[u8], b: &[u8], run: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    for (ra, rb) in a.chunks(run).zip(b.chunks(run)) {
        out.extend_from_slice(ra);
        out.extend_from_slice(rb);
    }
    out
}

/// Two 4-bit codes a byte, low nibble first, into one code a byte.
fn unpack_nibbles(packed: &[u8], codes: &mut [u8]) {
    for (pair, &b) in codes.chunks_exact_mut(2).zip(packed) {
        pair[0] = b & 15;
        pair[1] = b >> 4;
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Packs checkpoint rows (the layouts of `nibble_precision::weight`) for the kernels. Errors on
/// geometry the kernels cannot read (the caller then runs the layer dequantized).
pub fn pack_rows(
    format: LinearFormat,
    n: usize,
    k: usize,
    bytes: &[u8],
    dtype: Dtype,
) -> Result<Packed> {
    let rb = format.row_bytes(k)?;
    if bytes.len() != n * rb {
        return Err(Error::InvalidArgument(format!(
            "{format}: {} bytes for {n} rows of {rb}",
            bytes.len()
        )));
    }
    if QFamily::of(format) == Some(QFamily::W4A8) {
        return pack_w4a8_rows(format, n, k, rb, bytes).map(Packed::W4A8);
    }
    match format.codec {
        WeightCodec::Int4Group { .. } => {
            let groups = format.codec.groups(k);
            let group_len = k / groups;
            pack::check_k(k, Some(group_len))?;
            let (mut codes, mut scales, mut zeros) = (
                vec![0u8; n * k],
                vec![0f32; n * groups],
                vec![0u8; n * groups],
            );
            codes
                .par_chunks_mut(k)
                .zip(scales.par_chunks_mut(groups))
                .zip(zeros.par_chunks_mut(groups))
                .zip(bytes.par_chunks(rb))
                .for_each(|(((codes, scales), zeros), row)| {
                    unpack_nibbles(&row[..k / 2], codes);
                    let s = &row[k / 2..k / 2 + 2 * groups];
                    for (g, scale) in scales.iter_mut().enumerate() {
                        *scale = f16_at(s, 2 * g);
                    }
                    zeros.copy_from_slice(&row[k / 2 + 2 * groups..]);
                });
            let w = W4Matrix {
                n,
                k,
                group_len,
                codes: &codes,
                scales: &scales,
                zeros: &zeros,
            };
            Ok(Packed::W4(pack::pack_w4(&w, dtype)?))
        }
        WeightCodec::Int8PerChannel => {
            let mut codes = Vec::with_capacity(n * k);
            let mut scales = Vec::with_capacity(n);
            for row in bytes.chunks_exact(rb) {
                codes.extend(row[..k].iter().map(|&b| b as i8));
                scales.push(f16_at(row, k));
            }
            let layout = if format.act == ActQuant::F16 {
                Int8Layout::F16
            } else {
                Int8Layout::S8
            };
            Ok(Packed::W8(pack::pack_w8(n, k, &codes, &scales, layout)?))
        }
        WeightCodec::Fp8PerChannel => {
            let mut codes = Vec::with_capacity(n * k);
            let mut scales = Vec::with_capacity(n);
            for row in bytes.chunks_exact(rb) {
                codes.extend_from_slice(&row[..k]);
                scales.push(f32::from_le_bytes([
                    row[k],
                    row[k + 1],
                    row[k + 2],
                    row[k + 3],
                ]));
            }
            Ok(Packed::Fp8(pack::pack_fp8(n, k, &codes, &scales)?))
        }
        _ => Err(Error::unsupported(
            format!("linear format {format} on the GPU"),
            "it has no kernel",
        )),
    }
}

/// W4A8 rows (`qoq-gN`, `lqq-gN`, `int4-pc` with INT8 activations): codes, each group's
/// byte-affine widening and the per-row scale, packed for the W4A8 kernels.
fn pack_w4a8_rows(
    format: LinearFormat,
    n: usize,
    k: usize,
    rb: usize,
    bytes: &[u8],
) -> Result<PackedW4A8> {
    let groups = format.codec.groups(k);
    let mut codes = vec![0u8; n * k];
    codes
        .par_chunks_mut(k)
        .zip(bytes.par_chunks(rb))
        .for_each(|(codes, row)| unpack_nibbles(&row[..k / 2], codes));
    let mut affine = Vec::with_capacity(n * groups);
    let mut scales = Vec::with_capacity(n);
    for (r, row) in bytes.chunks_exact(rb).enumerate() {
        affine.extend(format.codec.byte_affine(row, k).ok_or_else(|| {
            Error::unsupported(
                format!("{format} row {r} on the W4A8 kernels"),
                "a group's (q - z) * s leaves INT8, which the reference wraps per element",
            )
        })?);
        // The INT8 weights' scale: the level-0 f16 after the groups (QoQ, LiquidQuant), or
        // INT4's single group scale.
        scales.push(match format.codec {
            WeightCodec::Int4Group { .. } => f16_at(row, k / 2),
            _ => f16_at(row, rb - 2),
        });
    }
    pack::pack_w4a8(&W4A8Matrix {
        n,
        k,
        group_len: k / groups,
        codes: &codes,
        affine: &affine,
        scales: &scales,
    })
}

/// Host-side packed weight, before upload.
pub enum Packed {
    W4(PackedW4),
    W8(PackedW8),
    Fp8(PackedFp8),
    W4A8(PackedW4A8),
}

impl Packed {
    pub fn upload(&self, ctx: &CudaContext, what: &str) -> Result<QuantWeight> {
        Ok(match self {
            Packed::W4(p) => QuantWeight::W4 {
                codes: DeviceBuffer::from_host(&ctx.gpu, &p.codes, what)?,
                params: DeviceBuffer::from_host(&ctx.gpu, &p.params, what)?,
                group_len: p.group_len,
                tiles: p.tiles,
                chunks: p.chunks,
                groups: p.groups,
            },
            Packed::W8(p) => {
                let (codes, scales) = (
                    DeviceBuffer::from_host(&ctx.gpu, &p.codes, what)?,
                    DeviceBuffer::from_host(&ctx.gpu, &p.scales, what)?,
                );
                let (tiles, chunks) = (p.tiles, p.chunks);
                match p.layout {
                    Int8Layout::S8 => QuantWeight::W8 {
                        codes,
                        scales,
                        tiles,
                        chunks,
                    },
                    Int8Layout::F16 => QuantWeight::W8A16 {
                        codes,
                        scales,
                        tiles,
                        chunks,
                    },
                }
            }
            Packed::Fp8(p) => QuantWeight::Fp8 {
                codes: DeviceBuffer::from_host(&ctx.gpu, &p.codes, what)?,
                scales: DeviceBuffer::from_host(&ctx.gpu, &p.scales, what)?,
                tiles: p.tiles,
                chunks: p.chunks,
            },
            Packed::W4A8(p) => QuantWeight::W4A8 {
                codes: DeviceBuffer::from_host(&ctx.gpu, &p.codes, what)?,
                params: DeviceBuffer::from_host(&ctx.gpu, &p.params, what)?,
                scales: DeviceBuffer::from_host(&ctx.gpu, &p.scales, what)?,
                tiles: p.tiles,
                chunks: p.chunks,
                groups: p.groups,
                group_shift: p.group_shift,
            },
        })
    }
}

/// Split-K plan of a gemv launch: `(row blocks, splits, chunks per split)`. Enough CTAs for two
/// per SM, at least two chunks per split, at most 16 splits, and a CTA's activation slice (`m`
/// tokens of `x_bytes` bytes per 64-channel chunk) within 48 KB of shared memory. (A plan that
/// filled whole waves of resident CTAs with more, shorter splits measured slower on an H200:
/// BENCHMARKS.md.)
pub fn plan_gemv(
    tiles: usize,
    chunks: usize,
    sms: usize,
    m: usize,
    x_bytes: usize,
) -> (usize, usize, usize) {
    let blocks = tiles.div_ceil(8);
    let want = (2 * sms).div_ceil(blocks).clamp(1, 16);
    let fit = ((GEMV_SMEM / m.max(1)).saturating_sub(128) / x_bytes).max(1);
    let cps = chunks.div_ceil(want).max(2.min(chunks)).clamp(1, fit);
    (blocks, chunks.div_ceil(cps), cps)
}

/// Launch plan of the persistent decode gemv (kernels/qgemv.cu).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DecodePlan {
    /// CTAs, at most one per SM.
    pub ctas: usize,
    /// `row block x chunk` units per CTA, a multiple of [`DECODE_BATCH`].
    pub per_cta: usize,
    /// The most CTAs a row block's units are cut between: partial-sum slots per tile.
    pub max_pieces: usize,
    /// Dynamic shared memory: the CTA's window of activation chunks and their sums.
    pub smem: usize,
}

/// The decode gemv's plan for `m` tokens of `elem`-byte activations over `tiles` 16-row tiles of
/// `chunks` 64-channel chunks: the `row block x chunk` units cut into equal ranges, one per SM
/// (stream-K), or `None` where the kernel does not apply (too many tokens, an input width that is
/// not a multiple of 256, or an activation window past [`DECODE_SMEM`]).
pub fn plan_decode(
    tiles: usize,
    chunks: usize,
    sms: usize,
    m: usize,
    family: QFamily,
) -> Option<DecodePlan> {
    let most = family.decode_max_m(tiles * 16 * chunks * 64);
    if m == 0 || m > most || !chunks.is_multiple_of(DECODE_BATCH) {
        return None;
    }
    let units = tiles.div_ceil(DECODE_BLOCK_TILES) * chunks;
    let per_cta = units
        .div_ceil(sms.max(1))
        .next_multiple_of(DECODE_BATCH)
        .max(DECODE_BATCH);
    let window = per_cta.min(chunks);
    // The window's rows padded as the gemv pads its slice; W4A16 adds f32 sums per chunk and row
    // of the kernel's token tiles (dec_stage_x writes all 8 * TT rows: 32 at 17 to 24 tokens).
    // W8A16 reserves them too, though it stages none: sizing it without them would move its
    // picks on Llama-2-70B's layers at 12 to 16 tokens to the decode gemv, which no run has
    // measured there.
    let sums = if family.x_elem() == 2 {
        window * decode_sum_rows(m) * 4
    } else {
        0
    };
    let smem = gemv_smem(m, window, 64 * family.x_elem()) + sums;
    (smem <= DECODE_SMEM).then_some(DecodePlan {
        ctas: units.div_ceil(per_cta),
        per_cta,
        max_pieces: chunks.div_ceil(per_cta) + 1,
        smem,
    })
}

/// Whether `m` tokens run the gemv kernels rather than the tiled ones: always up to 32; up to
/// [`GEMV_MAX_M`] when the tiled grid (one CTA per 128 weight rows and 128 tokens) would leave
/// SMs idle. On an H200 at 64 tokens the gemv took 57 µs against 80 on a 4096x4096 layer and
/// 171 against 132 on a 28672x4096 one (BENCHMARKS.md).
pub fn use_gemv(m: usize, tiles: usize, sms: usize) -> bool {
    m <= 32 || (m <= GEMV_MAX_M && tiles.div_ceil(8) < sms)
}

/// The kernel families of a quantized GEMM.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QKernel {
    /// The persistent decode gemv (up to [`QFamily::decode_max_m`] tokens); for W4A16, groups of 128
    /// channels or a larger power of two.
    Decode,
    /// The same for W4A16 groups of 64 channels (scales apply every chunk); W8A8 has no groups
    /// and names [`QKernel::Decode`]'s entry.
    DecodeG64,
    /// The W4A8 decode gemv for groups of 32 channels: a chunk's two k32 steps lie in two groups
    /// (`DecW4A8<true>` in kernels/qgemv.cu), so a chunk reads two parameter pairs.
    DecodeG32,
    /// The mma.sync gemv (up to [`GEMV_MAX_M`] tokens).
    Gemv,
    /// The mma.sync tiled kernel.
    Tiled,
    /// The Hopper wgmma kernel (sm_90a; larger M), 256 tokens per tile.
    Wgmma,
    /// The same with 128 tokens per tile ([`wgmma_tokens`]).
    Wgmma128,
    /// FP8's 128-token tiles compiled without the split path (kernels/qgemm_fp8.cu), which
    /// `launch_wgmma` takes where a layer's tiles do not split K.
    Wgmma128Whole,
    /// The same with [`WGMMA_SMALL_TOKENS`] tokens per tile.
    Wgmma64,
}

impl QKernel {
    /// Whether a family with SwiGLU kernels ([`QFamily::has_swiglu`]) has this kind's SwiGLU
    /// entry: the decode gemv and the wgmma tiles, not the mma.sync gemv or tiles.
    pub fn has_swiglu_entry(self) -> bool {
        matches!(
            self,
            QKernel::Decode
                | QKernel::DecodeG32
                | QKernel::Wgmma
                | QKernel::Wgmma128
                | QKernel::Wgmma128Whole
                | QKernel::Wgmma64
        )
    }
}

/// What picks a quantized GEMM's kernel besides its shape: the format (W4A16 or W8A8), the output
/// type, and which decode gemv the weight may take, if any.
#[derive(Clone, Copy)]
struct Route {
    family: QFamily,
    out_half: bool,
    decode: Option<QKernel>,
    /// A SwiGLU weight ([`swiglu_rows`]): the kernels write `silu(gate) * up`.
    swiglu: bool,
}

/// Entry point of `kind` for `family`, `m` tokens, an output in the model dtype (`out_half`,
/// dtype suffix `sfx`) or f32: the names the entry macros of kernels/qgemm.cu, qgemv.cu and
/// qgemm_wgmma.cu give (`kernels_compile` checks every one [`QFamily::kernels`] lists exists).
pub fn qgemm_kernel_name(
    kind: QKernel,
    family: QFamily,
    m: usize,
    out_half: bool,
    sfx: &str,
) -> String {
    let tt = token_tiles(m);
    if family.x_elem() == 2 {
        let p = if family == QFamily::W4A16 {
            "w4a16"
        } else {
            "w8a16"
        };
        let h = if out_half { "_h" } else { "" };
        return match kind {
            QKernel::Decode => format!("{p}_dec{tt}{h}_{sfx}"),
            QKernel::DecodeG64 => format!("{p}_dec{tt}{h}_g64_{sfx}"),
            QKernel::DecodeG32 => format!("{p}_dec{tt}{h}_g32_{sfx}"),
            QKernel::Gemv => format!("{p}_gemv{tt}{h}_{sfx}"),
            QKernel::Tiled => format!("{p}_tiled{h}_{sfx}"),
            QKernel::Wgmma => format!("{p}_wgmma{h}_{sfx}"),
            QKernel::Wgmma128 => format!("{p}_wgmma128{h}_{sfx}"),
            QKernel::Wgmma128Whole => format!("{p}_wgmma128w{h}_{sfx}"),
            QKernel::Wgmma64 => format!("{p}_wgmma64{h}_{sfx}"),
        };
    }
    let o = if out_half { sfx } else { "f32" };
    let p = match family {
        QFamily::W8A8 => "w8a8",
        QFamily::Fp8 => "fp8",
        _ => "w4a8",
    };
    match kind {
        QKernel::Decode | QKernel::DecodeG64 => format!("{p}_dec{tt}_{o}"),
        QKernel::DecodeG32 => format!("{p}_dec{tt}_g32_{o}"),
        QKernel::Gemv => format!("{p}_gemv{tt}_{o}"),
        QKernel::Tiled => format!("{p}_tiled_{o}"),
        QKernel::Wgmma => format!("{p}_wgmma_{o}"),
        QKernel::Wgmma128 => format!("{p}_wgmma128_{o}"),
        QKernel::Wgmma128Whole => format!("{p}_wgmma128w_{o}"),
        QKernel::Wgmma64 => format!("{p}_wgmma64_{o}"),
    }
}

/// The SwiGLU entry of `kind` ([`QFamily::has_swiglu`]): the model-dtype output entry's name
/// with `_swiglu` before the dtype suffix (`w4a8_wgmma128_swiglu_bf16`).
pub fn swiglu_kernel_name(kind: QKernel, family: QFamily, m: usize, sfx: &str) -> String {
    let name = qgemm_kernel_name(kind, family, m, true, sfx);
    let stem = name.strip_suffix(sfx).unwrap_or(&name);
    format!("{stem}swiglu_{sfx}")
}

/// The decode gemv of a W4A8 weight whose groups are `2^group_shift` channels (30: one a row):
/// groups of 32 put a chunk's two k32 steps in two groups ([`QKernel::DecodeG32`]).
pub fn w4a8_decode_kernel(group_shift: u32) -> QKernel {
    if group_shift == 5 {
        QKernel::DecodeG32
    } else {
        QKernel::Decode
    }
}

/// The decode gemv a W4A16 weight with `groups` groups of `group_len` channels per row takes, if
/// any: scales apply after the MMA once per span of chunks whose group is a shift away, so groups
/// must be 64 channels ([`QKernel::DecodeG64`]), a power of two past it, or one per row.
pub fn w4_decode_kernel(group_len: usize, groups: usize) -> Option<QKernel> {
    match group_len {
        64 => Some(QKernel::DecodeG64),
        g if groups == 1 || (g > 64 && g.is_power_of_two()) => Some(QKernel::Decode),
        _ => None,
    }
}

/// The gemv variant for `m` tokens: 1, 2, 4 or 8 tiles of 8 tokens.
pub(crate) fn token_tiles(m: usize) -> usize {
    m.div_ceil(8).next_power_of_two()
}

/// Rows of span sums a decode gemv CTA stages per chunk for `m` tokens: every row of its token
/// tiles, `8 * token_tiles(m)` (kernels/qgemv.cu, `dec_stage_x`'s `MP`), not just `m` rounded to 8.
fn decode_sum_rows(m: usize) -> usize {
    8 * token_tiles(m)
}

/// Shared memory a gemv CTA may use for its activation slice.
const GEMV_SMEM: usize = 48 * 1024;

/// Bytes of a gemv CTA's activation slice, matching `gemv_x_stride` in kernels/qgemm.cu.
pub(crate) fn gemv_smem(m: usize, cps: usize, x_bytes: usize) -> usize {
    let stride = if x_bytes == 128 {
        cps * 128 + 16
    } else {
        (cps * 64).div_ceil(128) * 128 + 64
    };
    m * stride
}

/// What a wgmma-tier launch takes besides the shape: the activations (read through a TMA
/// descriptor, not a pointer), the weight, and the output. The descriptors are made only when
/// the wgmma kernel runs, so the other tiers (and GPUs without TMA) never encode one.
struct WgmmaOperands {
    x: u64,
    x_ld: usize,
    x_elem: usize,
    weights: WgmmaWeights,
    out: u64,
    ldy: usize,
}

enum WgmmaWeights {
    W4 {
        codes: u64,
        params: u64,
        groups: usize,
        group_len: usize,
    },
    /// W8A16's INT8 fragments in the k16 order (`pack::Int8Layout::F16`).
    W8A16 { codes: u64, scales: u64 },
    /// INT8 fragments (`pack::PackedW8`) or row-major FP8 rows (`row_major`).
    W8 {
        codes: u64,
        scales: u64,
        x_scales: u64,
        row_major: bool,
    },
    W4A8 {
        codes: u64,
        params: u64,
        scales: u64,
        x_scales: u64,
        groups: usize,
        group_shift: u32,
    },
}

/// Output element type of a quantized GEMM: f32 (the engine's GEMM outputs) or the model dtype
/// (benchmarks compare against 16-bit cuBLAS outputs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OutElem {
    F32,
    Half,
}

/// `y = x · Wᵀ` for a packed weight of `n` rows and `k` columns, into `out` (`x.rows x n`,
/// f32 or model dtype).
pub fn quant_gemm(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &QuantWeight,
    n: usize,
    k: usize,
    out: &CudaTensor,
) -> Result<()> {
    routed_gemm(ctx, x, w, n, k, out, false)
}

/// `silu(gate x) * up x` of a SwiGLU weight ([`swiglu_rows`]: `2 * ffn` packed rows of `k`) in
/// the model dtype, `[x.rows, ffn]`: the bits of [`quant_gemm`] into f32 followed by the SiLU-gate
/// kernel, in one pass (no codes attached: the next INT8 GEMM quantizes it itself, with the same
/// scale rule).
pub fn swiglu_gemm(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &QuantWeight,
    ffn: usize,
    k: usize,
) -> Result<CudaTensor> {
    let out = ctx.alloc(x.rows, ffn, Elem::Half(ctx.dtype))?;
    routed_gemm(ctx, x, w, 2 * ffn, k, &out, true)?;
    Ok(out)
}

/// [`quant_gemm`], or with `swiglu` [`swiglu_gemm`]'s kernels into its `[m, n / 2]` output.
fn routed_gemm(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &QuantWeight,
    n: usize,
    k: usize,
    out: &CudaTensor,
    swiglu: bool,
) -> Result<()> {
    let m = x.rows;
    let out_half = match out.elem {
        Elem::F32 => false,
        Elem::Half(d) if d == ctx.dtype => true,
        e => {
            return Err(Error::InvalidArgument(format!(
                "quantized GEMM output of {e:?}"
            )));
        }
    };
    match w {
        QuantWeight::W4 {
            codes,
            params,
            group_len,
            tiles,
            chunks,
            groups,
        } => {
            let (xh, head) = half_operands(ctx, x, "w4a16", [codes.ptr, params.ptr], out)?;
            let geo = [m, n, k, *tiles, *chunks, *groups, *group_len];
            let shift = w4_group_shift(*group_len);
            let route = Route {
                family: QFamily::W4A16,
                out_half,
                decode: w4_decode_kernel(*group_len, *groups),
                swiglu,
            };
            let wg = WgmmaOperands {
                x: xh.ptr,
                x_ld: xh.ld,
                x_elem: 2,
                weights: WgmmaWeights::W4 {
                    codes: codes.ptr,
                    params: params.ptr,
                    groups: *groups,
                    group_len: *group_len,
                },
                out: out.ptr,
                ldy: out.ld,
            };
            run_quant(ctx, route, head, wg, &geo, &[shift], *tiles, *chunks)
        }
        QuantWeight::W8A16 {
            codes,
            scales,
            tiles,
            chunks,
        } => {
            let (xh, head) = half_operands(ctx, x, "w8a16", [codes.ptr, scales.ptr], out)?;
            let route = Route {
                family: QFamily::W8A16,
                out_half,
                decode: Some(QKernel::Decode),
                swiglu,
            };
            let wg = WgmmaOperands {
                x: xh.ptr,
                x_ld: xh.ld,
                x_elem: 2,
                weights: WgmmaWeights::W8A16 {
                    codes: codes.ptr,
                    scales: scales.ptr,
                },
                out: out.ptr,
                ldy: out.ld,
            };
            let geo = [m, n, k, *tiles, *chunks];
            run_quant(ctx, route, head, wg, &geo, &[], *tiles, *chunks)
        }
        QuantWeight::W8 {
            codes,
            scales,
            tiles,
            chunks,
        }
        | QuantWeight::Fp8 {
            codes,
            scales,
            tiles,
            chunks,
        } => {
            let (family, act) = match w {
                QuantWeight::Fp8 { .. } => (QFamily::Fp8, Act8::Fp8),
                _ => (QFamily::W8A8, Act8::Int8),
            };
            let q = act8_input(ctx, x, k, act)?;
            let head = vec![
                Arg::Ptr(codes.ptr),
                Arg::Ptr(scales.ptr),
                Arg::Ptr(q.codes),
                Arg::I64(k as i64),
                Arg::Ptr(q.scales),
                Arg::Ptr(out.ptr),
                Arg::I64(out.ld as i64),
            ];
            let geo = [m, n, k, *tiles, *chunks];
            let route = Route {
                family,
                out_half,
                decode: Some(QKernel::Decode),
                swiglu,
            };
            let wg = WgmmaOperands {
                x: q.codes,
                x_ld: k,
                x_elem: 1,
                weights: WgmmaWeights::W8 {
                    codes: codes.ptr,
                    scales: scales.ptr,
                    x_scales: q.scales,
                    row_major: family == QFamily::Fp8,
                },
                out: out.ptr,
                ldy: out.ld,
            };
            run_quant(ctx, route, head, wg, &geo, &[], *tiles, *chunks)
        }
        QuantWeight::W4A8 {
            codes,
            params,
            scales,
            tiles,
            chunks,
            groups,
            group_shift,
        } => {
            let q = act8_input(ctx, x, k, Act8::Int8)?;
            let head = vec![
                Arg::Ptr(codes.ptr),
                Arg::Ptr(params.ptr),
                Arg::Ptr(scales.ptr),
                Arg::Ptr(q.codes),
                Arg::I64(k as i64),
                Arg::Ptr(q.scales),
                Arg::Ptr(out.ptr),
                Arg::I64(out.ld as i64),
            ];
            let geo = [m, n, k, *tiles, *chunks];
            let route = Route {
                family: QFamily::W4A8,
                out_half,
                decode: Some(w4a8_decode_kernel(*group_shift)),
                swiglu,
            };
            let wg = WgmmaOperands {
                x: q.codes,
                x_ld: k,
                x_elem: 1,
                weights: WgmmaWeights::W4A8 {
                    codes: codes.ptr,
                    params: params.ptr,
                    scales: scales.ptr,
                    x_scales: q.scales,
                    groups: *groups,
                    group_shift: *group_shift,
                },
                out: out.ptr,
                ldy: out.ld,
            };
            let decode_geo = [*groups as i32, *group_shift as i32];
            run_quant(ctx, route, head, wg, &geo, &decode_geo, *tiles, *chunks)
        }
    }
}

/// The RMSNorm a one-token decode gemv takes over (kernels/qgemv.cu, `RowNorm`): it norms
/// `res + delta` (`delta` 0: `res` alone) by `weight` on the way in, and writes `res + delta` to
/// `res_out` (with a delta; another row than `res`, which every CTA reads).
#[derive(Clone, Copy, Debug)]
pub struct RowNormArgs {
    pub res: u64,
    pub delta: u64,
    pub weight: u64,
    pub res_out: u64,
    pub eps: f32,
}

/// A one-token W4A16 GEMM whose decode gemv norms its own input (`w4a16_dec1_norm_*`):
/// [`Backend::norm_linear`](crate::Backend) takes it where [`NormedDecode::of`] finds one,
/// instead of the norm kernel and the gemv. In a CUDA graph a batch-1 step runs level with the
/// two (1.002x to 1.006x on an H200), without one 1.02x faster (BENCHMARKS.md, issue 18).
#[derive(Clone, Debug)]
pub struct NormedDecode {
    name: String,
    weight: [u64; 2],
    /// The integers after the pointers: `[m, n, k, tiles, chunks, groups, group_len]`, then
    /// `shift` ([`w4_group_shift`]).
    geo: [usize; 7],
    shift: i32,
    tiles: usize,
    plan: DecodePlan,
}

impl NormedDecode {
    /// The normed decode gemv of a weight of `n` rows and `k` columns, where the plain one would
    /// run at one token here (the tier, the group size and the activation window allow it).
    pub fn of(ctx: &CudaContext, w: &QuantWeight, n: usize, k: usize) -> Option<NormedDecode> {
        // W8A16's came out level to 1% slower in a graph (BENCHMARKS.md, issue 18, "the RMSNorm
        // in the W4A16 and W8A16 decode gemv"): it keeps the norm kernel.
        let QuantWeight::W4 {
            codes,
            params,
            group_len,
            tiles,
            chunks,
            groups,
        } = w
        else {
            return None;
        };
        let (group_len, tiles, chunks, groups) = (*group_len, *tiles, *chunks, *groups);
        let kind = w4_decode_kernel(group_len, groups)?;
        let name = normed_kernel_name(kind, QFamily::W4A16, ctx.dtype.suffix())?;
        let gemm = QGemm {
            route: Route {
                family: QFamily::W4A16,
                out_half: false,
                decode: Some(kind),
                swiglu: false,
            },
            m: 1,
            tiles,
            chunks,
            sms: ctx.gpu.sm_count,
            tier: ctx.tier(),
            tma_ok: true,
        };
        let Pick::Decode(_, plan) = gemm.pick(&|c| c == kind && ctx.has_kernel(&name)) else {
            return None;
        };
        let shift = w4_group_shift(group_len);
        let geo = [1, n, k, tiles, chunks, groups, group_len];
        let weight = [codes.ptr, params.ptr];
        Some(NormedDecode {
            name,
            weight,
            geo,
            shift,
            tiles,
            plan,
        })
    }

    /// `out` (one f32 row of the weight's `n` outputs) = the weight times the normed row.
    pub fn launch(&self, ctx: &CudaContext, norm: &RowNormArgs, out: &CudaTensor) -> Result<()> {
        if out.rows != 1 || out.elem != Elem::F32 {
            return Err(Error::InvalidArgument(format!(
                "a normed decode gemv into {}x{} {:?}",
                out.rows, out.cols, out.elem
            )));
        }
        let args = vec![
            Arg::Ptr(self.weight[0]),
            Arg::Ptr(self.weight[1]),
            Arg::Ptr(norm.res),
            Arg::Ptr(norm.delta),
            Arg::Ptr(norm.weight),
            Arg::Ptr(norm.res_out),
            Arg::F32(norm.eps),
            Arg::Ptr(out.ptr),
            Arg::I64(out.ld as i64),
        ];
        let geo = self.geo.iter().map(|&v| Arg::I32(v as i32));
        let geo = geo.chain([Arg::I32(self.shift)]).collect();
        launch_decode(ctx, &self.name, args, geo, self.tiles, 1, self.plan)
    }
}

/// The normed one-token entry of a decode gemv `kind` (kernels/qgemv.cu,
/// `W4A16_DEC_NORM_ENTRY`), W4A16's only: `w4a16_dec1_norm_g64_bf16`.
pub fn normed_kernel_name(kind: QKernel, family: QFamily, sfx: &str) -> Option<String> {
    match (family, kind) {
        (QFamily::W4A16, QKernel::Decode) => Some(format!("w4a16_dec1_norm_{sfx}")),
        (QFamily::W4A16, QKernel::DecodeG64) => Some(format!("w4a16_dec1_norm_g64_{sfx}")),
        _ => None,
    }
}

/// W4A16's `group_shift` kernel argument: log2 of the group length, or -1 for a whole row's
/// group that is not a power of two (the kernels read none then).
fn w4_group_shift(group_len: usize) -> i32 {
    match group_len.is_power_of_two() {
        true => group_len.trailing_zeros() as i32,
        false => -1,
    }
}

/// The 16-bit input of a `what` GEMM, whose kernels read 16-byte vectors of its rows.
pub(crate) fn half_input(ctx: &CudaContext, x: &CudaTensor, what: &str) -> Result<CudaTensor> {
    let xh = ctx.as_half(x)?;
    if xh.ld % 8 != 0 || xh.ptr % 16 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} GEMM input rows must be 16-byte aligned"
        )));
    }
    Ok(xh)
}

/// The 16-bit input of a `what` GEMM and its gemv and tiled kernels' leading arguments: the
/// weight's two arrays (codes, then group parameters or row scales), the input, the output.
fn half_operands(
    ctx: &CudaContext,
    x: &CudaTensor,
    what: &str,
    weight: [u64; 2],
    out: &CudaTensor,
) -> Result<(CudaTensor, Vec<Arg>)> {
    let xh = half_input(ctx, x, what)?;
    let head = vec![
        Arg::Ptr(weight[0]),
        Arg::Ptr(weight[1]),
        Arg::Ptr(xh.ptr),
        Arg::I64(xh.ld as i64),
        Arg::Ptr(out.ptr),
        Arg::I64(out.ld as i64),
    ];
    Ok((xh, head))
}

/// Runs the kernel family a quantized GEMM takes: the decode gemv where it applies and the
/// [`KernelTier`] picks it, else the mma.sync gemv ([`use_gemv`]), else the wgmma kernel where
/// the tier picks it and the activations suit TMA, else the tiled kernel; W4A8, which has the
/// Hopper kernels only, takes the decode gemv or the wgmma kernel whatever the tier. `head` are
/// the gemv and tiled kernels' pointer arguments, `wg` the wgmma kernel's operands, `geo` the
/// integers `[m, n, k, tiles, chunks, ..]` they take after them (the gemv kernels also
/// `gemv_geo`).
#[allow(clippy::too_many_arguments)]
fn run_quant(
    ctx: &CudaContext,
    route: Route,
    head: Vec<Arg>,
    wg: WgmmaOperands,
    geo: &[usize],
    gemv_geo: &[i32],
    tiles: usize,
    chunks: usize,
) -> Result<()> {
    let (m, n, k) = (geo[0], geo[1], geo[2]);
    let sfx = ctx.dtype.suffix();
    let name = |kind| match route.swiglu {
        true => swiglu_kernel_name(kind, route.family, m, sfx),
        false => qgemm_kernel_name(kind, route.family, m, route.out_half, sfx),
    };
    // The integers after the pointers: `geo`, and for the gemv kernels `gemv_geo` too.
    let ints = |gemv: bool| -> Vec<Arg> {
        let extra = if gemv { gemv_geo } else { &[] };
        let geo = geo.iter().map(|&v| Arg::I32(v as i32));
        geo.chain(extra.iter().map(|&v| Arg::I32(v))).collect()
    };
    let tma_ok = wg.x.is_multiple_of(16) && (wg.x_ld * wg.x_elem).is_multiple_of(16);
    let gemm = QGemm {
        route,
        m,
        tiles,
        chunks,
        sms: ctx.gpu.sm_count,
        tier: ctx.tier(),
        tma_ok,
    };
    if route.swiglu && !route.family.has_swiglu() {
        return Err(Error::InvalidArgument(format!(
            "a SwiGLU {:?} GEMM: the family has no SwiGLU kernels",
            route.family
        )));
    }
    let pick = gemm.pick(&|kind| ctx.has_kernel(&name(kind)));
    if route.swiglu && !matches!(pick, Pick::Decode(..) | Pick::Wgmma(..)) {
        return Err(Error::unsupported(
            format!("a SwiGLU {:?} GEMM of {m} tokens here", route.family),
            "its SwiGLU epilogue is in the decode gemv and the wgmma kernels (sm_90a) only",
        ));
    }
    match pick {
        Pick::Decode(kind, plan) => {
            launch_decode(ctx, &name(kind), head, ints(true), tiles, m, plan)
        }
        Pick::Gemv => launch_gemv(
            ctx,
            &name(QKernel::Gemv),
            head,
            ints(true),
            tiles,
            chunks,
            m,
            64 * route.family.x_elem(),
        ),
        Pick::Wgmma(kind, tokens) => launch_wgmma(
            ctx,
            &name,
            kind,
            route.family,
            tokens,
            wg,
            (m, n, k, tiles, chunks),
        ),
        Pick::Tiled => {
            let mut args = head;
            args.extend(ints(false));
            let grid = (tiles.div_ceil(8) as u32, m.div_ceil(128) as u32, 1);
            let smem = if route.family == QFamily::W4A16 {
                W4_TILED_SMEM
            } else {
                W8_TILED_SMEM
            };
            ctx.launch_smem(&name(QKernel::Tiled), grid, smem, args)
        }
        Pick::None => Err(Error::unsupported(
            format!("a {:?} GEMM of {m} tokens here", route.family),
            "its kernels are Hopper's (sm_90a) and read 16-byte aligned 8-bit input rows",
        )),
    }
}

/// The kernel a quantized GEMM runs ([`QGemm::pick`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pick {
    Decode(QKernel, DecodePlan),
    Gemv,
    Wgmma(QKernel, usize),
    Tiled,
    /// A Hopper-only family (W4A8, FP8) where its kernels cannot run.
    None,
}

/// What picks a quantized GEMM's kernel: the route, the shape, the GPU and the [`KernelTier`].
#[derive(Clone, Copy)]
struct QGemm {
    route: Route,
    m: usize,
    tiles: usize,
    chunks: usize,
    sms: usize,
    tier: KernelTier,
    /// The activations suit a TMA descriptor (16-byte aligned rows).
    tma_ok: bool,
}

impl QGemm {
    /// The decode gemv where it applies and the tier picks it, else the 64-token wgmma tiles
    /// (17 to 64 tokens), the mma.sync gemv ([`use_gemv`]), the wgmma tiles or the tiled kernel.
    /// W4A8, which has the Hopper kernels only, takes the decode gemv or a wgmma kernel whatever
    /// the tier. `has` says whether a Hopper kernel was compiled for this GPU.
    fn pick(self, has: &dyn Fn(QKernel) -> bool) -> Pick {
        let QGemm { route, m, .. } = self;
        // A SwiGLU weight has only the decode gemv and wgmma entries, whatever its family.
        let hopper_only = route.family.hopper_only() || route.swiglu;
        let wanted = |kind: QKernel, auto_picks: bool| {
            let tier = match self.tier {
                _ if hopper_only => true,
                KernelTier::MmaSync => false,
                KernelTier::Hopper => true,
                KernelTier::Auto => auto_picks,
            };
            tier && has(kind)
        };
        // The decode gemv: up to `QFamily::decode_max_m` tokens (16; 8 for FP8, 24 in three
        // 8-token tiles for W4A16 on large layers) where its activation window fits. On an H200 1.05x to
        // 1.85x the mma.sync gemv, 4096x4096 at M = 1 included: 6.6 against 7.9 µs.
        let plan = plan_decode(self.tiles, self.chunks, self.sms, m, route.family);
        if let (Some(plan), Some(kind)) = (plan, route.decode)
            && wanted(kind, true)
        {
            return Pick::Decode(kind, plan);
        }
        // Past the decode gemv, up to 64 tokens: 64-token wgmma tiles on Hopper, with their K
        // splits ahead of the mma.sync gemv on every layer (4096x4096 W4A16 at 32 tokens: 14.2
        // against 19.2 µs on an H100; before the splits were mended the gemv won there).
        if m > DECODE_MAX_M
            && m <= WGMMA_SMALL_TOKENS
            && self.tma_ok
            && wanted(QKernel::Wgmma64, true)
        {
            return Pick::Wgmma(QKernel::Wgmma64, WGMMA_SMALL_TOKENS);
        }
        if !hopper_only && use_gemv(m, self.tiles, self.sms) {
            return Pick::Gemv;
        }
        let tokens = wgmma_tokens(m, self.tiles, self.sms).min(route.family.max_wgmma_tokens());
        let kind = match tokens {
            WGMMA_TOKENS => QKernel::Wgmma,
            128 => QKernel::Wgmma128,
            _ => QKernel::Wgmma64,
        };
        // Auto: wgmma past 64 tokens. Kernel by kernel the mma.sync tiles looked cheaper under
        // a full 256-token tile, but in the engine (Llama-3-8B on an H100, 1000 ShareGPT
        // prompts) steps of 128 to 255 sequences took 27.0 ms W4A16 and 20.2 W8A8 on them
        // against 16.9 and 12.4 for steps of 256 to 511 on wgmma
        // (bench/results/engine-20261124-77517f0).
        if self.tma_ok && wanted(kind, true) {
            Pick::Wgmma(kind, tokens)
        } else if hopper_only {
            Pick::None
        } else {
            Pick::Tiled
        }
    }
}

/// Launches a split-K gemv: `head` are the pointer arguments before the partials, `geo`
/// the integer geometry after the counters; the chunks-per-split argument goes last. The
/// partial sums (f32 or i32) take 4 bytes each; `x_bytes` is one token's activation bytes
/// per 64-channel chunk.
#[allow(clippy::too_many_arguments)]
fn launch_gemv(
    ctx: &CudaContext,
    name: &str,
    mut args: Vec<Arg>,
    geo: Vec<Arg>,
    tiles: usize,
    chunks: usize,
    m: usize,
    x_bytes: usize,
) -> Result<()> {
    let kernel = ctx.kernel(name)?;
    let (blocks, splits, cps) = plan_gemv(tiles, chunks, ctx.gpu.sm_count, m, x_bytes);
    let partial = if splits > 1 {
        ctx.alloc(splits * m, tiles * 16, Elem::F32)?.ptr
    } else {
        0
    };
    args.push(Arg::Ptr(partial));
    args.push(Arg::Ptr(ctx.split_counters()));
    args.extend(geo);
    args.push(Arg::I32(cps as i32));
    kernel.launch(
        &ctx.gpu,
        (blocks as u32, splits as u32, 1),
        256,
        gemv_smem(m, cps, x_bytes) as u32,
        args,
    )
}

/// Launches a wgmma-tier GEMM of shape `(m, n, k, tiles, chunks)`: output tiles of 128 weight
/// rows and `tokens` tokens, the activations read through a TMA descriptor in 128-byte rows of K.
fn launch_wgmma(
    ctx: &CudaContext,
    name: &dyn Fn(QKernel) -> String,
    kind: QKernel,
    family: QFamily,
    tokens: usize,
    op: WgmmaOperands,
    (m, n, k, tiles, chunks): (usize, usize, usize, usize, usize),
) -> Result<()> {
    let map = tensor_map(
        op.x,
        op.x_elem,
        &[k, m],
        &[op.x_ld * op.x_elem],
        &[128 / op.x_elem, tokens],
        TmaLayout::Swizzle128,
    )?;
    let mut args = vec![Arg::TensorMap(Box::new(map))];
    let mut tail = vec![];
    match op.weights {
        WgmmaWeights::W8 {
            codes,
            scales,
            x_scales,
            row_major,
        } => {
            // Two 64-channel chunks of codes a stage: of 8 packed tiles, or (FP8) a 128-row box
            // of the rows, 128-byte swizzled as the tokens (kernels/qgemm_fp8.cu).
            args.push(if row_major {
                let row = chunks * 64;
                let map = tensor_map(
                    codes,
                    1,
                    &[row, tiles * 16],
                    &[row],
                    &[128, 128],
                    TmaLayout::Swizzle128,
                )?;
                Arg::TensorMap(Box::new(map))
            } else {
                weight_map(codes, tiles, chunks, 1024, 2)?
            });
            args.push(Arg::Ptr(scales));
            args.push(Arg::Ptr(x_scales));
        }
        WgmmaWeights::W4 {
            codes,
            params,
            groups,
            group_len,
        } => {
            // One or two chunks of codes a stage, and the parameter rows of the groups the
            // stage can touch (kernels/qgemm_wgmma.cu, WgqW4::span).
            let stage_chunks = stage_chunks_16(tokens);
            let span = w4a16_span(group_len, 64 * stage_chunks);
            args.push(weight_map(codes, tiles, chunks, 512, stage_chunks)?);
            args.push(weight_map(params, tiles, groups, 64, span)?);
            tail = vec![Arg::I32(groups as i32), Arg::I32(group_len as i32)];
        }
        WgmmaWeights::W8A16 { codes, scales } => {
            // One or two 1 KB chunks of codes a stage (kernels/qgemm_wgmma.cu, WgqW8A16).
            args.push(weight_map(
                codes,
                tiles,
                chunks,
                1024,
                stage_chunks_16(tokens),
            )?);
            args.push(Arg::Ptr(scales));
        }
        WgmmaWeights::W4A8 {
            codes,
            params,
            scales,
            x_scales,
            groups,
            group_shift,
        } => {
            // Two chunks of codes a stage, and the parameter rows of the groups 128 channels
            // can touch (kernels/qgemm_wgmma.cu, WgqW4A8).
            let span = w4a8_span(group_shift);
            args.push(weight_map(codes, tiles, chunks, 512, 2)?);
            args.push(weight_map(params, tiles, groups, 64, span)?);
            args.push(Arg::Ptr(scales));
            args.push(Arg::Ptr(x_scales));
            tail = vec![
                Arg::I32(groups as i32),
                Arg::I32(group_shift as i32),
                Arg::I32(span as i32),
            ];
        }
    }
    args.push(Arg::Ptr(op.out));
    args.push(Arg::I64(op.ldy as i64));
    args.extend([m, n, tiles, chunks].map(|v| Arg::I32(v as i32)));
    args.extend(tail);
    let out_tiles = tiles.div_ceil(8) * m.div_ceil(tokens);
    let stages = if family.x_elem() == 2 {
        chunks.div_ceil(stage_chunks_16(tokens))
    } else {
        chunks.div_ceil(2)
    };
    // Only the 64- and 128-token entries compile the split path (kernels/qgemm_wgmma.cu).
    let splits = if tokens <= SPLIT_MAX_TOKENS {
        forced_wgmma_splits().map_or_else(
            || {
                wgmma_splits(
                    out_tiles,
                    stages,
                    ctx.gpu.sm_count,
                    family.min_split_stages(),
                )
            },
            |s| s.clamp(1, stages.max(1)),
        )
    } else {
        1
    };
    // FP8's 128-token tiles, whole: the entry without the split path (kernels/qgemm_fp8.cu).
    let kind = if kind == QKernel::Wgmma128
        && family == QFamily::Fp8
        && splits == 1
        && forced_fp8_whole() != Some(0)
    {
        QKernel::Wgmma128Whole
    } else {
        kind
    };
    let partial = if splits > 1 {
        ctx.alloc(out_tiles * splits * tokens * 128, 1, Elem::F32)?
            .ptr
    } else {
        0
    };
    args.push(Arg::I32(splits as i32));
    args.push(Arg::Ptr(partial));
    args.push(Arg::Ptr(ctx.split_counters()));
    // Persistent CTAs, at most one per SM: each walks units of work, its producer loading the
    // next unit while the consumers store the last.
    let ctas = (out_tiles * splits).min(ctx.gpu.sm_count);
    let smem = wgmma_smem(family, tokens);
    ctx.launch_block(&name(kind), (ctas as u32, 1, 1), WGMMA_THREADS, smem, args)
}

/// NIBBLE_WGMMA_SPLITS, read once: a K-split count that overrides the plan of the 64-token
/// tiles (a probe knob for bench/probe/wgmma64_probe.sh; clamped to the stages there are).
fn forced_wgmma_splits() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    probe_knob(&FORCED, "NIBBLE_WGMMA_SPLITS")
}

/// NIBBLE_FP8_WHOLE, read once: 0 runs FP8's 128-token tiles on the entry with the split path
/// even where nothing splits (a probe knob: the A/B of `fp8_wgmma128w_*`).
fn forced_fp8_whole() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    probe_knob(&FORCED, "NIBBLE_FP8_WHOLE")
}

/// NIBBLE_DECODE_MAX_M, read once: a probe knob (bench/probe/decode_cap_probe.sh) that caps the
/// tokens the decode gemv takes, so the batches past it run the 64-token wgmma tiles.
fn forced_decode_max_m() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    probe_knob(&FORCED, "NIBBLE_DECODE_MAX_M")
}

/// Groups of W4A8 parameters one 128-channel wgmma stage reads (`group_shift` 30: one per row).
fn w4a8_span(group_shift: u32) -> usize {
    if group_shift >= 7 {
        1
    } else {
        128 >> group_shift
    }
}

/// Launches the persistent decode gemv on its [`DecodePlan`]: arguments as for
/// [`launch_gemv`], then the units per CTA and the partial slots per tile. Partial sums
/// take 4 bytes each.
fn launch_decode(
    ctx: &CudaContext,
    name: &str,
    mut args: Vec<Arg>,
    geo: Vec<Arg>,
    tiles: usize,
    m: usize,
    plan: DecodePlan,
) -> Result<()> {
    let partial = if plan.max_pieces > 1 {
        ctx.alloc(tiles * plan.max_pieces * m, 16, Elem::F32)?.ptr
    } else {
        0
    };
    args.push(Arg::Ptr(partial));
    args.push(Arg::Ptr(ctx.split_counters()));
    args.extend(geo);
    args.push(Arg::I32(plan.per_cta as i32));
    args.push(Arg::I32(plan.max_pieces as i32));
    // Its weight loads start before the previous kernel ends (the kernel waits on the grid
    // dependency before it reads activations or touches the split-K slots; it is one of
    // compile::GRID_WAITING_KERNELS).
    ctx.launch_block(
        name,
        (plan.ctas as u32, 1, 1),
        32 * DECODE_BLOCK_TILES as u32,
        plan.smem as u32,
        args,
    )
}

/// The 8-bit codes of `kind` a GEMM over `k` input channels reads: those the producer of `x`
/// wrote alongside it (fused into RMSNorm / SiLU-gate), else quantized now.
pub(crate) fn act8_input(
    ctx: &CudaContext,
    x: &CudaTensor,
    k: usize,
    kind: Act8,
) -> Result<Act8Input> {
    match x.act8 {
        Some(q) if x.cols == k && q.kind == kind => Ok(q),
        _ => quantize_act8(ctx, x, kind),
    }
}

/// Per-token 8-bit codes of `kind` (`rows x cols`, row stride `cols`) and scales of `x`.
pub fn quantize_act8(ctx: &CudaContext, x: &CudaTensor, kind: Act8) -> Result<Act8Input> {
    let codes = ctx.alloc_bytes(x.rows * x.cols)?;
    let scales = ctx.alloc(x.rows, 1, Elem::F32)?.ptr;
    let sfx = x.elem.suffix();
    ctx.kernel(&format!("{}_{sfx}", kind.quantize_kernel()))?
        .launch(
            &ctx.gpu,
            (x.rows as u32, 1, 1),
            row_regs_block(x.cols),
            0,
            vec![
                Arg::Ptr(x.ptr),
                Arg::I64(x.ld as i64),
                Arg::Ptr(codes),
                Arg::I64(x.cols as i64),
                Arg::Ptr(scales),
                Arg::I32(x.cols as i32),
            ],
        )?;
    Ok(Act8Input {
        codes,
        scales,
        kind,
    })
}

/// Benchmark support: `x` with its per-token 8-bit codes of `kind` attached, in owned memory, so
/// a W8A8 / W4A8 / FP8 GEMM can be timed without its quantization.
pub fn with_owned_act8(ctx: &CudaContext, x: &CudaTensor, kind: Act8) -> Result<CudaTensor> {
    let codes_bytes = (x.rows * x.cols).div_ceil(16) * 16;
    let store = ctx.owned_tensor(codes_bytes / 4 + x.rows, 1, Elem::F32)?;
    let q = quantize_act8(ctx, x, kind)?;
    ctx.gpu.copy(store.ptr, q.codes, x.rows * x.cols)?;
    ctx.gpu
        .copy(store.ptr + codes_bytes as u64, q.scales, x.rows * 4)?;
    Ok(CudaTensor {
        ld: x.ld,
        owner: store.owner.clone(),
        act8: Some(Act8Input {
            codes: store.ptr,
            scales: store.ptr + codes_bytes as u64,
            kind,
        }),
        ..CudaTensor::view(x.ptr, x.rows, x.cols, x.elem, 0)
    })
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_plans_fill_the_gpu_and_cover_k() {
        for (tiles, chunks) in [
            (256, 64),
            (256, 224),
            (1792, 64),
            (384, 64),
            (12, 9),
            (1, 1),
            (36, 9),
        ] {
            for m in [1, 9, 16, 32, 33, 64] {
                let (blocks, splits, cps) = plan_gemv(tiles, chunks, 132, m, 128);
                assert_eq!(blocks, tiles.div_ceil(8));
                assert!(
                    splits * cps >= chunks && (splits - 1) * cps < chunks,
                    "{tiles} {chunks}"
                );
                assert!(splits <= 16 || cps == plan_gemv(tiles, chunks, 132, m, 128).2);
                assert!(gemv_smem(m, cps, 128) <= GEMV_SMEM && gemv_smem(m, cps, 64) <= GEMV_SMEM);
            }
        }
        assert_eq!(plan_gemv(256, 64, 132, 1, 128), (32, 8, 8));
        assert_eq!(plan_gemv(1792, 64, 132, 1, 128), (224, 2, 32));
        // Sixteen tokens of a 14336-wide input: the slice caps the chunks per split.
        assert_eq!(plan_gemv(256, 224, 132, 16, 128), (32, 10, 23));
    }

    #[test]
    fn w4_decode_kernels_follow_the_group_size() {
        assert_eq!(w4_decode_kernel(64, 64), Some(QKernel::DecodeG64));
        assert_eq!(w4_decode_kernel(128, 32), Some(QKernel::Decode));
        assert_eq!(w4_decode_kernel(1024, 4), Some(QKernel::Decode));
        // Per-channel: one group of any width.
        assert_eq!(w4_decode_kernel(14336, 1), Some(QKernel::Decode));
        // Groups of 32, or a multiple of 64 that is not a power of two, take the mma.sync gemv.
        assert_eq!(w4_decode_kernel(32, 128), None);
        assert_eq!(w4_decode_kernel(192, 24), None);
        let name = |g| {
            qgemm_kernel_name(
                w4_decode_kernel(g, 2).unwrap(),
                QFamily::W4A16,
                1,
                true,
                "bf16",
            )
        };
        assert_eq!(name(64), "w4a16_dec1_h_g64_bf16");
        assert_eq!(name(128), "w4a16_dec1_h_bf16");
    }

    #[test]
    fn w4a8_groups_of_32_take_their_own_decode_entries() {
        // group_shift: 5 for groups of 32, 6 and up for 64 and up, 30 for one group a row.
        assert_eq!(w4a8_decode_kernel(5), QKernel::DecodeG32);
        for shift in [6, 7, 10, 30] {
            assert_eq!(w4a8_decode_kernel(shift), QKernel::Decode);
        }
        let name =
            |shift, m| qgemm_kernel_name(w4a8_decode_kernel(shift), QFamily::W4A8, m, true, "bf16");
        assert_eq!(name(5, 1), "w4a8_dec1_g32_bf16");
        assert_eq!(name(7, 9), "w4a8_dec2_bf16");
        assert_eq!(
            swiglu_kernel_name(QKernel::DecodeG32, QFamily::W4A8, 17, "f16"),
            "w4a8_dec4_g32_swiglu_f16"
        );
        assert!(QFamily::W4A8.kernels(true, 1).contains(&QKernel::DecodeG32));
    }

    #[test]
    fn w4a16_stage_spans_cover_every_group_a_stage_touches() {
        for channels in [64, 128] {
            for group_len in (16..=512).step_by(16) {
                // Every alignment of groups to stages repeats within channels x group_len.
                let k = channels * group_len;
                if crate::pack::check_k(k, Some(group_len)).is_err() {
                    continue;
                }
                let most = (0..k / channels)
                    .map(|c| ((c + 1) * channels - 1) / group_len - c * channels / group_len + 1)
                    .max()
                    .unwrap();
                let span = w4a16_span(group_len, channels);
                assert!(span >= most, "groups of {group_len}, {channels} channels");
                // The kernel's shared memory holds 2 rows a chunk.
                assert!(
                    span <= 2 * channels / 64,
                    "groups of {group_len}, {channels} channels"
                );
            }
        }
    }

    #[test]
    fn wgmma_splits_fill_the_sms_only_for_few_tiles() {
        let (w4, w8) = (
            QFamily::W4A8.min_split_stages(),
            QFamily::W8A8.min_split_stages(),
        );
        assert_eq!(QFamily::W4A16.min_split_stages(), w4);
        // 4096 rows at 64 tokens: 32 tiles, 32 stages of 128 channels for K = 4096.
        assert_eq!(wgmma_splits(32, 32, 132, w4), 4);
        assert_eq!(wgmma_splits(32, 32, 132, w8), 2);
        assert_eq!(wgmma_splits(48, 32, 132, w4), 2);
        assert_eq!(wgmma_splits(48, 32, 132, w8), 2);
        // K = 14336: 112 stages, 4 splits.
        assert_eq!(wgmma_splits(32, 112, 132, w8), 4);
        // 128-token tiles of 4096 rows at 256 tokens: 64 tiles, 2 splits.
        assert_eq!(wgmma_splits(64, 32, 132, w8), 2);
        assert_eq!(wgmma_splits(224, 64, 132, w4), 1);
        assert_eq!(wgmma_splits(132, 64, 132, w4), 1);
        // Short K keeps the minimum a split; a lone tile takes at most 8.
        assert_eq!(wgmma_splits(8, 32, 132, w8), 2);
        assert_eq!(wgmma_splits(1, 224, 132, w8), 8);
        assert_eq!(wgmma_splits(1, 8, 132, w8), 1);
    }

    #[test]
    fn decode_plans_balance_units_in_whole_batches_and_bound_pieces() {
        for (tiles, chunks, m) in [
            (256, 64, 1),
            (256, 224, 16),
            (1792, 64, 4),
            (3584, 128, 8),
            (384, 64, 1),
            (1, 4, 1),
        ] {
            let p = plan_decode(tiles, chunks, 132, m, QFamily::W4A16).unwrap();
            let units = tiles.div_ceil(DECODE_BLOCK_TILES) * chunks;
            assert!(
                p.ctas <= 132 && p.ctas * p.per_cta >= units && (p.ctas - 1) * p.per_cta < units
            );
            assert!(p.per_cta.is_multiple_of(DECODE_BATCH) && p.smem <= DECODE_SMEM);
            // Count the CTAs each row block's units fall in: never more than max_pieces.
            for b in 0..tiles.div_ceil(DECODE_BLOCK_TILES) {
                let (first, last) = (b * chunks / p.per_cta, ((b + 1) * chunks - 1) / p.per_cta);
                assert!(last - first < p.max_pieces, "{tiles} {chunks} block {b}");
            }
        }
        // The span sums cover every row of the token tiles the kernel runs: at 17 to 24 tokens
        // w4a16_dec4 writes 32 rows a chunk (a plan sized for 24 overran shared memory).
        for m in 1..=DECODE_MAX_M_W4A16 {
            let p = plan_decode(256, 224, 132, m, QFamily::W4A16).unwrap();
            let window = p.per_cta.min(224);
            let written = gemv_smem(m, window, 128) + window * 8 * token_tiles(m) * 4;
            assert!(p.smem >= written, "{m} tokens: {} < {written}", p.smem);
        }
        // Llama-3-8B's 28672x4096 on an H200: 56 units per CTA, 128 CTAs, one wave.
        let p = plan_decode(1792, 64, 132, 1, QFamily::W4A16).unwrap();
        assert_eq!((p.ctas, p.per_cta, p.max_pieces), (128, 56, 3));
        // Up to 16 tokens of W8A16 and the INT8 codes, 8 of FP8, and 24 of W4A16 on large
        // layers (16 on small ones), where the window fits; not inputs that are not a multiple
        // of 256 wide, or windows too large: 32 bf16 tokens of 28672x4096 (56 chunks a CTA) and
        // 16 of an 8192-wide input (Llama-2-70B's 57344x8192) take the other kernels; as INT8
        // codes they fit.
        use QFamily::{Fp8, W4A16, W8A8, W8A16};
        for (tiles, chunks, m, family, fits) in [
            (1792, 64, 17, W8A16, false),
            (256, 224, 24, W4A16, true),
            (256, 224, 25, W4A16, false),
            (256, 64, 16, W4A16, true),
            (256, 64, 17, W4A16, false),
            (256, 64, 16, W8A8, true),
            (256, 64, 17, W8A8, false),
            (256, 64, 8, Fp8, true),
            (256, 64, 9, Fp8, false),
            (1792, 66, 1, W4A16, false),
            (1792, 64, 32, W4A16, false),
            (3584, 128, 16, W4A16, false),
            (3584, 128, 16, W8A8, true),
        ] {
            let plan = plan_decode(tiles, chunks, 132, m, family);
            assert_eq!(
                plan.is_some(),
                fits,
                "{family:?} {tiles} tiles x {chunks} chunks, {m} tokens"
            );
        }
    }

    #[test]
    fn batches_past_32_tokens_take_the_gemv_only_where_tiles_would_idle_sms() {
        assert!(use_gemv(1, 1792, 132) && use_gemv(32, 1792, 132));
        assert!(use_gemv(64, 256, 132) && !use_gemv(64, 1792, 132));
        assert!(!use_gemv(65, 256, 132));
    }

    #[test]
    fn wgmma_takes_128_token_tiles_only_where_256_would_mostly_pad() {
        // Full rounds either way, or two rounds of 256 against three of 128 (6144x4096 at
        // M = 1024): the larger tile.
        for (m, n) in [
            (1024, 28672),
            (8192, 6144),
            (1024, 4096),
            (8192, 4096),
            (1024, 6144),
        ] {
            assert_eq!(wgmma_tokens(m, n / 16, 132), WGMMA_TOKENS, "{m}x{n}");
        }
        // A second token block that would be mostly padding.
        assert_eq!(wgmma_tokens(300, 4096 / 16, 132), 128);
        for tokens in [WGMMA_SMALL_TOKENS, 128, WGMMA_TOKENS] {
            for family in QFamily::ALL {
                if family == QFamily::Fp8 && tokens > family.max_wgmma_tokens() {
                    continue;
                }
                assert!(
                    wgmma_smem(family, tokens) + WGMMA_STATIC_SMEM <= 227 * 1024,
                    "{family:?} {tokens}"
                );
            }
        }
    }

    /// Rows of `format` quantized from random values (outliers included), as a checkpoint has.
    fn quantized_rows(format: LinearFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let rb = format.row_bytes(k).unwrap();
        let mut out = vec![0u8; n * rb];
        for row in out.chunks_exact_mut(rb) {
            let vals: Vec<f32> = (0..k)
                .map(|_| {
                    rng.random_range(-1.0..1.0f32) * if rng.random_bool(0.01) { 30.0 } else { 1.0 }
                })
                .collect();
            let clip = [1.0, 0.8][rng.random_range(0..2)];
            format.codec.quantize_row(&vals, clip, row).unwrap();
        }
        out
    }

    #[test]
    fn w4a8_packing_widens_to_the_integer_weights() {
        for (i, (f, n, k)) in [
            ("qoq-g128/a8", 35, 256),
            ("qoq-g32/a8", 17, 192),
            ("qoq-g64/a8", 16, 4096),
            ("lqq-g64/a8", 16, 320),
            ("lqq-g128/a8", 3, 1024),
            ("int4-pc/a8", 20, 208),
            ("int4-pc/a8", 33, 4096),
        ]
        .into_iter()
        .enumerate()
        {
            let format: LinearFormat = f.parse().unwrap();
            let bytes = quantized_rows(format, n, k, i as u64);
            let Packed::W4A8(p) = pack_rows(format, n, k, &bytes, Dtype::Bf16).unwrap() else {
                panic!("{f} did not pack as W4A8");
            };
            let widened = p.widened();
            let (mut ints, mut scales) = (vec![0i8; k], Vec::new());
            for (r, row) in bytes.chunks_exact(format.row_bytes(k).unwrap()).enumerate() {
                format.codec.integer_row(row, k, &mut ints, &mut scales);
                assert_eq!(
                    &widened[r * k..(r + 1) * k],
                    &ints[..],
                    "{f} {n}x{k} row {r}"
                );
                assert_eq!(p.scales[r], scales[0], "{f} row {r} scale");
            }
            assert!(p.scales[n..].iter().all(|&s| s == 0.0));
        }
        // A QoQ group whose (q - z) * s wraps in the reference cannot take the word arithmetic.
        let format: LinearFormat = "qoq-g32/a8".parse().unwrap();
        let mut bytes = quantized_rows(format, 1, 64, 9);
        bytes[0] = 0xff; // codes 15 in group 0
        bytes[32] = 200; // its scale
        bytes[34] = 0; // its zero
        assert!(pack_rows(format, 1, 64, &bytes, Dtype::Bf16).is_err());
    }

    #[test]
    fn kernel_picks_follow_the_family_the_tier_and_the_shape() {
        let gemm = |family, m: usize, n: usize, k: usize, tier| QGemm {
            route: Route {
                family,
                out_half: false,
                decode: match family {
                    QFamily::W4A16 => w4_decode_kernel(128, k / 128),
                    _ => Some(QKernel::Decode),
                },
                swiglu: false,
            },
            m,
            tiles: n / 16,
            chunks: k / 64,
            sms: 132,
            tier,
            tma_ok: true,
        };
        let hopper = |_: QKernel| true;
        let ampere = |_: QKernel| false;
        let kind = |p: Pick| match p {
            Pick::Decode(k, _) => format!("decode {k:?}"),
            other => format!("{other:?}"),
        };
        use KernelTier::{Auto, MmaSync};
        use QFamily::{Fp8, W4A8, W4A16, W8A8, W8A16};
        for (family, m, n, k, tier, has_hopper, want) in [
            // Decode sizes: the decode gemv, up to 16 tokens (8 for FP8, 24 for W4A16 on large
            // layers), then the 64-token wgmma tiles.
            (W4A16, 1, 4096, 4096, Auto, true, "decode Decode"),
            (W8A8, 16, 4096, 4096, Auto, true, "decode Decode"),
            (W8A8, 17, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W4A8, 16, 28672, 4096, Auto, true, "decode Decode"),
            (W4A8, 32, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W4A16, 24, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W4A16, 24, 4096, 14336, Auto, true, "decode Decode"),
            (W4A16, 25, 4096, 14336, Auto, true, "Wgmma(Wgmma64, 64)"),
            (Fp8, 8, 4096, 4096, Auto, true, "decode Decode"),
            (Fp8, 9, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W8A16, 24, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W4A16, 32, 28672, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            // The mma.sync tier and GPUs without the Hopper kernels: the gemv and tiled
            // kernels, except for W4A8, which has none and is refused.
            (W8A8, 8, 4096, 4096, MmaSync, true, "Gemv"),
            (W4A16, 1000, 4096, 4096, Auto, false, "Tiled"),
            (W4A8, 8, 4096, 4096, MmaSync, true, "decode Decode"),
            (W4A8, 8, 4096, 4096, Auto, false, "None"),
            (W4A8, 1000, 4096, 4096, Auto, false, "None"),
            // 33 to 64 tokens: the 64-token wgmma tiles; past them 256-token tiles.
            (W8A8, 48, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W4A8, 64, 28672, 4096, MmaSync, true, "Wgmma(Wgmma64, 64)"),
            (W4A16, 1024, 28672, 4096, Auto, true, "Wgmma(Wgmma, 256)"),
            (W4A8, 1024, 28672, 4096, Auto, true, "Wgmma(Wgmma, 256)"),
            // FP8: Hopper only, as W4A8, and 128-token tiles at most (its promotion fragment).
            (Fp8, 32, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (Fp8, 48, 4096, 4096, MmaSync, true, "Wgmma(Wgmma64, 64)"),
            (Fp8, 8192, 28672, 4096, Auto, true, "Wgmma(Wgmma128, 128)"),
            (Fp8, 8, 4096, 4096, Auto, false, "None"),
            // W8A16: Hopper only, the decode gemv up to 16 tokens (16-bit activations), then
            // the 64-token tiles and 256-token ones.
            (W8A16, 16, 4096, 4096, MmaSync, true, "decode Decode"),
            (W8A16, 17, 4096, 4096, Auto, true, "Wgmma(Wgmma64, 64)"),
            (W8A16, 8192, 4096, 4096, Auto, true, "Wgmma(Wgmma, 256)"),
            (W8A16, 1, 4096, 4096, Auto, false, "None"),
        ] {
            let has: &dyn Fn(QKernel) -> bool = if has_hopper { &hopper } else { &ampere };
            let got = kind(gemm(family, m, n, k, tier).pick(has));
            assert_eq!(
                got, want,
                "{family:?} {m}x{n}x{k} {tier:?} hopper {has_hopper}"
            );
        }
        // W4A8 with inputs the decode gemv cannot stage (K not a multiple of 256): wgmma tiles.
        let odd = QGemm {
            chunks: 9,
            ..gemm(W4A8, 4, 576, 576, Auto)
        };
        assert_eq!(kind(odd.pick(&hopper)), "Wgmma(Wgmma64, 64)");
        // A SwiGLU weight has only the decode gemv and wgmma entries: W8A8's never takes the
        // mma.sync gemv or tiles, whatever the tier, and without the Hopper kernels nothing.
        let swiglu = |family, m, tier| QGemm {
            route: Route {
                swiglu: true,
                ..gemm(family, m, 28672, 4096, tier).route
            },
            ..gemm(family, m, 28672, 4096, tier)
        };
        for (family, m, tier, has_hopper, want) in [
            (W8A8, 8, MmaSync, true, "decode Decode"),
            (W8A8, 40, MmaSync, true, "Wgmma(Wgmma64, 64)"),
            (W8A8, 1000, MmaSync, true, "Wgmma(Wgmma, 256)"),
            (W8A8, 8, Auto, false, "None"),
            (W8A8, 1000, Auto, false, "None"),
            (Fp8, 1000, Auto, true, "Wgmma(Wgmma128, 128)"),
        ] {
            let has: &dyn Fn(QKernel) -> bool = if has_hopper { &hopper } else { &ampere };
            let got = kind(swiglu(family, m, tier).pick(has));
            assert_eq!(
                got, want,
                "SwiGLU {family:?} {m} {tier:?} hopper {has_hopper}"
            );
        }
    }

    #[test]
    fn only_kernel_formats_stack() {
        let fmt: LinearFormat = "int4-g32/a16".parse().unwrap();
        assert!(kernel_format(WeightFormat::Quant(fmt)).is_some());
        let w8: LinearFormat = "int8-pc/a8".parse().unwrap();
        assert!(kernel_format(WeightFormat::Quant(w8)).is_some());
        for f in ["qoq-g128/a8", "lqq-g64/a8", "int4-pc/a8"] {
            let f: LinearFormat = f.parse().unwrap();
            assert_eq!(QFamily::of(f), Some(QFamily::W4A8), "{f}");
        }
        let fp8: LinearFormat = "fp8-pc/afp8".parse().unwrap();
        assert_eq!(QFamily::of(fp8), Some(QFamily::Fp8));
        let w8a16: LinearFormat = "int8-pc/a16".parse().unwrap();
        assert_eq!(QFamily::of(w8a16), Some(QFamily::W8A16));
        for f in ["int4-g128/a8", "fp8-pc/a16", "int4-g128/a4a8-b128-n1"] {
            let f: LinearFormat = f.parse().unwrap();
            assert!(kernel_format(WeightFormat::Quant(f)).is_none(), "{f}");
        }
    }

    fn host_rows(format: LinearFormat, rows: usize, cols: usize, first: u8) -> HostTensor {
        let rb = format.row_bytes(cols).unwrap();
        // Every byte of row r is first + r: the interleaving is visible row by row.
        let bytes = (0..rows)
            .flat_map(|r| std::iter::repeat_n(first.wrapping_add(r as u8), rb))
            .collect::<Vec<u8>>();
        HostTensor {
            name: format!("rows from {first}"),
            shape: vec![rows, cols],
            format: WeightFormat::Quant(format),
            bytes: nibble_formats::TensorBytes::Owned(std::sync::Arc::new(bytes)),
        }
    }

    #[test]
    fn swiglu_rows_interleave_gate_and_up_in_runs_of_eight() {
        let f: LinearFormat = "qoq-g128/a8".parse().unwrap();
        let (ffn, k) = (24, 256);
        let rb = f.row_bytes(k).unwrap();
        let (format, rows, cols, bytes) =
            swiglu_rows(&host_rows(f, ffn, k, 0), &host_rows(f, ffn, k, 100))
                .unwrap()
                .unwrap();
        assert_eq!((format, rows, cols), (f, 2 * ffn, k));
        let order: Vec<u8> = bytes.chunks_exact(rb).map(|row| row[0]).collect();
        let mut want = vec![];
        for j in 0..ffn / SWIGLU_RUN {
            want.extend((0..8).map(|i| (8 * j + i) as u8));
            want.extend((0..8).map(|i| (100 + 8 * j + i) as u8));
        }
        assert_eq!(order, want);
        // Rows in whole runs, one format and one shape, or no SwiGLU weight.
        let none = |g: HostTensor, u: HostTensor| swiglu_rows(&g, &u).unwrap().is_none();
        assert!(none(host_rows(f, 20, k, 0), host_rows(f, 20, k, 0)));
        assert!(none(host_rows(f, 24, k, 0), host_rows(f, 16, k, 0)));
        let lqq: LinearFormat = "lqq-g128/a8".parse().unwrap();
        assert!(none(host_rows(f, 24, k, 0), host_rows(lqq, 24, k, 0)));
    }

    #[test]
    fn swiglu_entries_are_named_after_the_plain_ones() {
        for (kind, family, m, sfx, want) in [
            (
                QKernel::Wgmma128,
                QFamily::W4A8,
                200,
                "bf16",
                "w4a8_wgmma128_swiglu_bf16",
            ),
            (
                QKernel::Decode,
                QFamily::W4A8,
                9,
                "f16",
                "w4a8_dec2_swiglu_f16",
            ),
            (
                QKernel::Wgmma,
                QFamily::W8A8,
                300,
                "bf16",
                "w8a8_wgmma_swiglu_bf16",
            ),
            (
                QKernel::Decode,
                QFamily::Fp8,
                1,
                "bf16",
                "fp8_dec1_swiglu_bf16",
            ),
        ] {
            assert_eq!(swiglu_kernel_name(kind, family, m, sfx), want);
        }
        for family in QFamily::ALL {
            let eight_bit_acts = matches!(family, QFamily::W4A8 | QFamily::W8A8 | QFamily::Fp8);
            assert_eq!(family.has_swiglu(), eight_bit_acts, "{family:?}");
        }
    }
}

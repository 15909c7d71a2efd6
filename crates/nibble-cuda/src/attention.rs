//! Launches the paged attention kernels (kernels/attention.cu): append this batch's keys and
//! values, attend with the context split across CTAs, reduce the splits.

use nibble_core::{Error, Result};
use nibble_model::{AttentionShape, BatchLayout, RopeLayout};

use crate::context::{CudaContext, KernelTier};
use crate::elementwise as ew;
use crate::kv::CudaKv;
use crate::runtime::{Arg, DevicePtr};
use crate::tensor::{CudaTensor, Elem};

/// Heads per KV head the kernels are instantiated for (the smallest that fits is used).
const GROUPS: [usize; 4] = [1, 2, 4, 8];
/// Head sizes with a kernel: a token row is read as HD/8 16-byte loads by a power-of-two group of
/// lanes.
pub const HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];
/// Head sizes of the tensor-core prefill kernel (kernels/prefill.cu); batches with a prompt
/// chunk and another head size use the paged kernel for every token.
pub const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];
/// Query rows per prefill CTA (4 warps of 16).
const PREFILL_ROWS: usize = 64;
/// Query rows per CTA of the wgmma prefill kernel (kernels/prefill_wgmma.cu, Hopper): two
/// consumer warpgroups of 64, and a producer warpgroup.
const WGMMA_PREFILL_ROWS: usize = 128;
const WGMMA_PREFILL_THREADS: u32 = 384;
/// Tokens per KV block: the decode kernel reads a block's rows of a head as one contiguous run.
pub const KV_BLOCK: usize = 16;
/// Tokens one CTA takes at the least: below that a CTA's fixed costs dominate.
const MIN_CHUNK: usize = 64;

/// How the context is split: `splits` CTAs per (token, kv head), each over `chunk` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub splits: usize,
    pub chunk: usize,
}

/// Splits the reduction kernel can merge (kernels/attention.cu MAX_SPLITS).
const MAX_SPLITS: usize = 512;

/// CTAs per SM a decode split aims at: about 24 (8 waves of 3 resident CTAs: a short last wave
/// costs little).
const CTAS_PER_SM: usize = 24;

/// NIBBLE_ATTN_CTAS_PER_SM, read once: a probe knob that replaces [`CTAS_PER_SM`]. A quantized
/// pool's CTA reads a quarter (KV4) of a 16-bit one's bytes over the same chunk, so its fixed
/// costs and the partials it writes weigh more. On an H200 (72615aa, BENCHMARKS.md, issue 19) 12
/// and 8 moved kv4 by at most 3% and cost the channel-wise formats up to 28%: its bound is the
/// kernel's instructions, not the split.
fn ctas_per_sm() -> usize {
    static KNOB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&KNOB, "NIBBLE_ATTN_CTAS_PER_SM")
        .filter(|&n| n > 0)
        .unwrap_or(CTAS_PER_SM)
}

/// Enough CTAs for about [`CTAS_PER_SM`] per SM (NIBBLE_ATTN_CTAS_PER_SM overrides it), never a
/// chunk under MIN_CHUNK, never more than MAX_SPLITS splits.
pub fn plan_split(tokens: usize, kv_heads: usize, max_ctx: usize, sm_count: usize) -> Split {
    plan_split_for(tokens, kv_heads, max_ctx, sm_count * ctas_per_sm())
}

fn plan_split_for(tokens: usize, kv_heads: usize, max_ctx: usize, ctas: usize) -> Split {
    let max_ctx = max_ctx.max(1);
    let base = tokens * kv_heads;
    let want = ctas.div_ceil(base.max(1));
    let most = max_ctx.div_ceil(MIN_CHUNK).min(MAX_SPLITS);
    let splits = want.clamp(1, most.max(1));
    let chunk = max_ctx.div_ceil(splits).div_ceil(MIN_CHUNK) * MIN_CHUNK;
    Split {
        splits: max_ctx.div_ceil(chunk),
        chunk,
    }
}

/// RoPE that [`attention`] applies to q and k first: `Backend::rope_qk`'s frequency table and
/// pairing.
#[derive(Clone, Copy)]
pub struct Rotary<'a> {
    pub inv_freq: &'a CudaTensor,
    pub layout: RopeLayout,
}

/// `Backend::attention`, after `Backend::rope_qk` when `rotary` is given. A decode batch whose
/// kernel appends the step's keys itself (tensor cores, no deferred side) rotates q and the key
/// inside that kernel from the pass's angle table: one launch fewer a layer, the rope kernel's
/// bits. Other batches get the rope kernel first.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    ctx: &CudaContext,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    kv: &mut CudaKv,
    layer: usize,
    batch: &BatchLayout,
    shape: AttentionShape,
    rotary: Option<Rotary<'_>>,
) -> Result<CudaTensor> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        window,
    } = shape;
    if window == Some(0) {
        return Err(Error::InvalidArgument(
            "a sliding window of 0 tokens".into(),
        ));
    }
    let n = batch.num_tokens();
    let kv_row = num_kv_heads * head_dim;
    if num_kv_heads == 0
        || num_heads % num_kv_heads != 0
        || (num_kv_heads, head_dim) != (kv.shape.num_kv_heads, kv.shape.head_dim)
        || layer >= kv.shape.num_layers
        || (q.rows, q.cols) != (n, num_heads * head_dim)
        || (k.rows, k.cols) != (n, kv_row)
        || (v.rows, v.cols) != (n, kv_row)
        || [q.elem, k.elem, v.elem] != [Elem::F32; 3]
        || q.ld < q.cols
        || k.ld < k.cols
        || v.ld < v.cols
    {
        return Err(Error::InvalidArgument(format!(
            "attention {shape:?} over a {:?} pool: q {}x{}, k {}x{}, v {}x{} for {n} tokens",
            kv.shape, q.rows, q.cols, k.rows, k.cols, v.rows, v.cols
        )));
    }
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(Error::unsupported(
            format!("head_dim {head_dim} on the CUDA backend"),
            format!("attention kernels exist for head_dim {HEAD_DIMS:?}"),
        ));
    }
    let group = num_heads / num_kv_heads;
    let g = *GROUPS.iter().find(|&&g| g >= group).ok_or_else(|| {
        Error::unsupported(
            format!("{group} query heads per KV head on the CUDA backend"),
            "attention kernels serve at most 8",
        )
    })?;
    for s in &batch.seqs {
        let need = (s.start_pos + s.len).div_ceil(kv.block_size);
        if s.blocks.len() < need {
            return Err(Error::InvalidArgument(format!(
                "a sequence at positions up to {} has {} blocks of {}, needs {need}",
                s.start_pos + s.len,
                s.blocks.len(),
                kv.block_size
            )));
        }
        if let Some(&b) = s.blocks.iter().find(|&&b| b as usize >= kv.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "block {b} is outside the KV pool of {} blocks",
                kv.num_blocks
            )));
        }
    }
    ctx.ensure_meta(None, batch)?;
    let (positions, tok_seq, tables, max_blocks) =
        ctx.with_meta(|m| (m.positions, m.tok_seq, m.block_tables, m.max_blocks));
    let (kc, vc) = kv.layer(layer);
    let dt = ctx.dtype.suffix();

    let prefill = batch.seqs.iter().any(|s| s.len > 1);
    // A quantized pool is read by the tensor-core kernels only, instantiated for its format.
    let quantized = !kv.is_float();
    if quantized && !PREFILL_HEAD_DIMS.contains(&head_dim) {
        return Err(Error::unsupported(
            format!(
                "head_dim {head_dim} with a {} KV cache on the CUDA backend",
                kv.shape.format
            ),
            format!("quantized KV caches have kernels for head_dim {PREFILL_HEAD_DIMS:?}"),
        ));
    }
    // A decode batch on tensor cores appends inside the attention kernel; the other paths write
    // the batch's keys and values first.
    let tensor_core_decode = quantized || (group >= 2 && PREFILL_HEAD_DIMS.contains(&head_dim));
    let deferred = kv.defers();
    let fused_append = !prefill && tensor_core_decode && !deferred;
    let mut decode_rope = None;
    if let Some(r) = rotary {
        if fused_append && !unfolded_rope() {
            decode_rope = Some(DecodeRope {
                table: ew::rope_table(ctx, r.inv_freq, head_dim, batch)?,
                interleaved: r.layout == RopeLayout::Interleaved,
            });
        } else {
            ew::rope(ctx, q, Some(k), head_dim, batch, r.inv_freq, r.layout)?;
        }
    }
    if deferred {
        // Raw rows of the deferred sides into the residual (the other side appended as usual),
        // then the blocks whose last slot this call wrote packed from it.
        // kvq_pack takes (pages, residual, tables, tokens, sizes); kvq_append_residual the
        // same between the rows it writes and their strides.
        let grid = (n as u32, num_kv_heads as u32, 1);
        let (rk, rv) = kv.residual_layer(layer);
        let rt = kv.residual_tables(layer);
        let pack_args = || {
            vec![
                Arg::Ptr(kc),
                Arg::Ptr(vc),
                Arg::Ptr(rk),
                Arg::Ptr(rv),
                Arg::Ptr(tables),
                Arg::Ptr(rt),
                Arg::Ptr(tok_seq),
                Arg::Ptr(positions),
                Arg::I32(max_blocks as i32),
                Arg::I32(num_kv_heads as i32),
            ]
        };
        let mut args = vec![Arg::Ptr(k.ptr), Arg::Ptr(v.ptr)];
        args.extend(pack_args());
        args.extend([Arg::I64(k.ld as i64), Arg::I64(v.ld as i64)]);
        let append = format!("kvq_append_residual_hd{head_dim}");
        ctx.kv_kernel(kv.formats, kv.deferred[1], &append)?
            .launch(&ctx.gpu, grid, 64, 0, args)?;
        let pack = format!("kvq_pack_hd{head_dim}");
        ctx.kv_kernel(kv.formats, kv.deferred[1], &pack)?.launch(
            &ctx.gpu,
            grid,
            64,
            0,
            pack_args(),
        )?;
    } else if !fused_append {
        // Both append kernels: a token's rows, where they go, then how the pool is cut.
        let mut args = vec![
            Arg::Ptr(k.ptr),
            Arg::Ptr(v.ptr),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
            Arg::Ptr(tables),
            Arg::Ptr(tok_seq),
            Arg::Ptr(positions),
            Arg::I32(max_blocks as i32),
        ];
        let (kernel, grid, block) = if quantized {
            args.push(Arg::I32(num_kv_heads as i32));
            let kernel = ctx.kv_kernel(
                kv.formats,
                kv.deferred[1],
                &format!("kvq_append_hd{head_dim}"),
            )?;
            (kernel, (n as u32, num_kv_heads as u32, 1), 64)
        } else {
            args.extend([
                Arg::I32(kv.block_size as i32),
                Arg::I32(kv_row as i32),
                Arg::I32(head_dim as i32),
            ]);
            (
                ctx.kernel(&format!("kv_append_{dt}"))?,
                (n as u32, 1, 1),
                128,
            )
        };
        args.extend([Arg::I64(k.ld as i64), Arg::I64(v.ld as i64)]);
        kernel.launch(&ctx.gpu, grid, block, 0, args)?;
    }

    let out = ctx.alloc(n, num_heads * head_dim, Elem::Half(ctx.dtype))?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    if prefill && PREFILL_HEAD_DIMS.contains(&head_dim) {
        // A mixed step's leading one-token sequences (the engine schedules running decodes
        // first) take the decode kernel, which reads each KV head once for its whole GQA group;
        // the prefill kernel would read it once per query head.
        let decodes = if tensor_core_decode {
            batch.seqs.iter().take_while(|s| s.len == 1).count()
        } else {
            0
        };
        if decodes > 0 {
            decode_rows(ctx, q, k, v, kv, layer, decodes, shape, g, &out, None)?;
        }
        let wgmma = ctx.gpu.cc == (9, 0)
            && !quantized
            && ctx.tier() != KernelTier::MmaSync
            && kv.block_size == KV_BLOCK
            && q.ld.is_multiple_of(4);
        let rows_per_tile = if wgmma {
            WGMMA_PREFILL_ROWS
        } else {
            PREFILL_ROWS
        };
        // Every layer of the forward launches over the same tiles: the first one uploads them.
        let (list, num_tiles) = ctx.prefill_tile_list(decodes, rows_per_tile, || {
            let mut tiles = prefill_tiles(batch, decodes, rows_per_tile);
            if wgmma {
                // Longest first: a causal tile's work grows with its last position.
                tiles.sort_by_key(|t| std::cmp::Reverse(t[1] + t[2]));
            }
            tiles
        })?;
        // The two kernels take the same arguments but for how they reach the cache: the wgmma
        // kernel through TMA descriptors (and the pool size, its out-of-range block), the
        // mma.sync kernel through pointers (and the block size).
        let mut args = if wgmma {
            let [kmap, vmap] = kv.tensor_maps(layer)?;
            vec![
                Arg::TensorMap(Box::new(kmap)),
                Arg::TensorMap(Box::new(vmap)),
                Arg::Ptr(q.ptr),
            ]
        } else {
            vec![Arg::Ptr(q.ptr), Arg::Ptr(kc), Arg::Ptr(vc)]
        };
        args.extend([
            Arg::Ptr(tables),
            Arg::Ptr(list),
            Arg::Ptr(out.ptr),
            Arg::I32(num_kv_heads as i32),
            Arg::I32(group as i32),
            Arg::I32(max_blocks as i32),
            Arg::I32(if wgmma { kv.num_blocks } else { kv.block_size } as i32),
            Arg::F32(scale * std::f32::consts::LOG2_E),
            Arg::I64(q.ld as i64),
            Arg::I32(window_arg(window)),
        ]);
        if wgmma {
            ctx.launch_block(
                &format!("prefill_wgmma_{dt}_hd{head_dim}"),
                (num_heads as u32, num_tiles as u32, 1),
                WGMMA_PREFILL_THREADS,
                wgmma_prefill_smem(head_dim),
                args,
            )?;
        } else {
            let kernel = if quantized {
                ctx.kv_kernel(
                    kv.formats,
                    kv.deferred[1],
                    &format!("kvq_prefill_hd{head_dim}"),
                )?
            } else {
                ctx.kernel(&format!("prefill_attn_{dt}_hd{head_dim}"))?
            };
            let mut args = args;
            if deferred {
                args.extend(residual_args(kv, layer));
            }
            kernel.launch(
                &ctx.gpu,
                (num_tiles as u32, num_heads as u32, 1),
                128,
                0,
                args,
            )?;
        }
        return Ok(out);
    }

    decode_rows(ctx, q, k, v, kv, layer, n, shape, g, &out, decode_rope)?;
    Ok(out)
}

/// `NIBBLE_DECODE_ROPE=0`: the decode attention takes q and k rotated by the rope kernel (the
/// A/B baseline of the fold).
fn unfolded_rope() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("NIBBLE_DECODE_ROPE").is_ok_and(|v| v == "0"))
}

/// A decode kernel's RoPE: the pass's angle table and the pairing.
#[derive(Clone, Copy)]
struct DecodeRope {
    table: DevicePtr,
    interleaved: bool,
}

/// The residual arguments of a deferred pool's kernels (docs/design/kv-channel-gpu.md): layer
/// `layer`'s residual rows of keys and values, and the call's residual tables.
fn residual_args(kv: &CudaKv, layer: usize) -> [Arg; 3] {
    let (rk, rv) = kv.residual_layer(layer);
    [
        Arg::Ptr(rk),
        Arg::Ptr(rv),
        Arg::Ptr(kv.residual_tables(layer)),
    ]
}

/// Decode attention of the batch's first `rows` tokens (one per sequence) into `out`'s rows:
/// the context split across CTAs, then the splits reduced. Grouped heads and quantized pools run
/// on tensor cores where a kernel exists (appending the rows' keys and values themselves: after an append of a
/// whole mixed batch, that rewrites the same bytes); MHA and other head sizes on CUDA cores.
/// Both write the same partials (the MMA kernel converts its base-2 maxima to base e).
#[allow(clippy::too_many_arguments)]
fn decode_rows(
    ctx: &CudaContext,
    q: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    kv: &CudaKv,
    layer: usize,
    rows: usize,
    shape: AttentionShape,
    g: usize,
    out: &CudaTensor,
    rope: Option<DecodeRope>,
) -> Result<()> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        ..
    } = shape;
    let group = num_heads / num_kv_heads;
    let (positions, tok_seq, tables, max_blocks) =
        ctx.with_meta(|m| (m.positions, m.tok_seq, m.block_tables, m.max_blocks));
    let max_ctx = max_blocks * kv.block_size;
    let (kc, vc) = kv.layer(layer);
    let dt = ctx.dtype.suffix();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let quantized = !kv.is_float();
    let mma = quantized || (group >= 2 && PREFILL_HEAD_DIMS.contains(&head_dim));
    // The split is planned for the padded table width, not the exact context, so a decode step
    // launches the same grid at every length within a power of two (what a graph replays).
    let split = plan_split(rows, num_kv_heads, max_ctx, ctx.gpu.sm_count);
    let part = ctx.alloc(
        rows * num_kv_heads * split.splits * g,
        head_dim + 2,
        Elem::F32,
    )?;
    let grid = (rows as u32, num_kv_heads as u32, split.splits as u32);
    let common = |scale: f32, with_block: bool| {
        let mut args = vec![
            Arg::Ptr(q.ptr),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
            Arg::Ptr(tables),
            Arg::Ptr(tok_seq),
            Arg::Ptr(positions),
            Arg::Ptr(part.ptr),
            Arg::I32(num_kv_heads as i32),
            Arg::I32(group as i32),
            Arg::I32(max_blocks as i32),
        ];
        if with_block {
            args.push(Arg::I32(kv.block_size as i32));
        }
        args.push(Arg::I32(split.chunk as i32));
        args.push(Arg::F32(scale));
        args.push(Arg::I64(q.ld as i64));
        args
    };
    if mma {
        let mut args = common(scale * std::f32::consts::LOG2_E, false);
        // A deferred pool appended the rows already (append_residual_and_pack): no fused append.
        let deferred = kv.defers();
        let (knew, vnew) = if deferred { (0, 0) } else { (k.ptr, v.ptr) };
        args.extend([
            Arg::Ptr(knew),
            Arg::Ptr(vnew),
            Arg::I64(k.ld as i64),
            Arg::I64(v.ld as i64),
            Arg::I32(window_arg(shape.window)),
        ]);
        if deferred {
            args.extend(residual_args(kv, layer));
        } else {
            args.extend([
                Arg::Ptr(rope.map_or(0, |r| r.table)),
                Arg::I32(i32::from(rope.is_some_and(|r| r.interleaved))),
            ]);
        }
        let kernel = if quantized {
            ctx.kv_kernel(
                kv.formats,
                kv.deferred[1],
                &format!("kvq_decode_hd{head_dim}_g{g}"),
            )?
        } else {
            ctx.kernel(&format!("decode_mma_{dt}_hd{head_dim}_g{g}"))?
        };
        kernel.launch(&ctx.gpu, grid, 64, 0, args)?;
    } else {
        let mut args = common(scale, true);
        args.push(Arg::I32(window_arg(shape.window)));
        ctx.kernel(&format!("paged_attn_{dt}_hd{head_dim}_g{g}"))?
            .launch(&ctx.gpu, grid, 128, 0, args)?;
    }
    ctx.kernel(&format!("attn_reduce_{dt}_hd{head_dim}_g{g}"))?
        .launch(
            &ctx.gpu,
            (rows as u32, num_heads as u32, 1),
            128,
            0,
            vec![
                Arg::Ptr(part.ptr),
                Arg::Ptr(positions),
                Arg::Ptr(out.ptr),
                Arg::I32(num_kv_heads as i32),
                Arg::I32(group as i32),
                Arg::I32(split.splits as i32),
                Arg::I32(split.chunk as i32),
            ],
        )?;
    Ok(())
}

/// The kernels' `window` argument: 0 for none (a window past `i32::MAX` masks nothing either).
fn window_arg(window: Option<usize>) -> i32 {
    window.map_or(0, |w| w.min(i32::MAX as usize) as i32)
}

/// The prefill kernels' tile list (kernels/prefill.cu `PrefillTile`): query tiles of up to
/// `rows_per_tile` rows, each within one sequence, for the sequences after the first `skip`,
/// as (first batch row, first position, rows, sequence).
fn prefill_tiles(batch: &BatchLayout, skip: usize, rows_per_tile: usize) -> Vec<[i32; 4]> {
    let mut tiles = Vec::new();
    let mut row: usize = batch.seqs[..skip].iter().map(|s| s.len).sum();
    for (i, s) in batch.seqs.iter().enumerate().skip(skip) {
        for r0 in (0..s.len).step_by(rows_per_tile) {
            tiles.push([
                (row + r0) as i32,
                (s.start_pos + r0) as i32,
                (s.len - r0).min(rows_per_tile) as i32,
                i as i32,
            ]);
        }
        row += s.len;
    }
    tiles
}

/// Dynamic shared memory of the wgmma prefill kernel (kernels/prefill_wgmma.cu `FaSmem`): Q
/// (128 rows), 3 (head_dim 128) or 4 (64) stages of K and V (128 keys each), the stages'
/// barriers, alignment slack.
fn wgmma_prefill_smem(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 3 } else { 4 };
    let tile = 128 * head_dim * 2;
    (tile + 2 * stages * tile + 3 * stages * 8 + 1024) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_context_and_fill_the_gpu() {
        for &(tokens, heads, ctx) in &[
            (1, 8, 4096),
            (64, 8, 4096),
            (1, 3, 1),
            (7, 2, 100),
            (128, 8, 1024),
        ] {
            let s = plan_split(tokens, heads, ctx, 132);
            assert!(s.splits * s.chunk >= ctx, "{s:?} misses context {ctx}");
            assert!(
                (s.splits - 1) * s.chunk < ctx,
                "{s:?} has an empty split for {ctx}"
            );
            assert_eq!(s.chunk % MIN_CHUNK, 0);
        }
        // Batch 1 at 4k context: many splits so that every SM has work.
        let s = plan_split(1, 8, 4096, 132);
        assert!(s.splits * 8 >= 132, "{s:?}");
        // A large batch needs few splits; a huge context is capped at MAX_SPLITS.
        assert!(plan_split(128, 8, 1024, 132).splits <= 4);
        assert!(plan_split(1, 8, 1 << 20, 132).splits <= MAX_SPLITS);
        // Fewer CTAs an SM (the probe knob's lever) means fewer, longer splits.
        let (few, many) = (
            plan_split_for(64, 8, 4096, 132 * 8),
            plan_split_for(64, 8, 4096, 132 * CTAS_PER_SM),
        );
        assert!(
            few.splits < many.splits && few.chunk > many.chunk,
            "{few:?} {many:?}"
        );
    }
}

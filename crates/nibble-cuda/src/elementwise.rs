//! The row-wise and element-wise ops of a layer (kernels/elementwise.cu): embedding and row
//! gathers, RMSNorm, RoPE, the SiLU gate, residual adds and biases, and the fills benchmarks
//! start from. They sit apart from the GEMMs and attention because each is one launch with
//! nothing to plan; they return errors, and the backend turns those of the `Backend` trait's
//! infallible ops into its sticky error.

use nibble_core::{Error, Result};
use nibble_model::{BatchLayout, RopeLayout, ScaledRows};

use crate::context::{BLOCK, CudaContext, StepUpload, grid_for, norm_block, row_regs_block};
use crate::kv::CudaKv;
use crate::runtime::{Arg, DeviceBuffer, DevicePtr};
use crate::tensor::{Act8, Act8Input, CudaTensor, CudaWeight, Elem};

/// Rows `ids` of `table`, as f32.
pub fn embed(ctx: &CudaContext, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
    ctx.check_err()?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
        return Err(Error::InvalidArgument(format!(
            "token id {bad} outside the {}-row embedding table",
            table.rows
        )));
    }
    // The forward's metadata already holds these ids; other callers get them uploaded.
    let ids_ptr = ctx.staged_indices(
        |m| (m.host_tokens == ids).then_some(m.tokens),
        &ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
    )?;
    let out = ctx.alloc(ids.len(), table.cols, Elem::F32)?;
    ctx.half_kernel("embed")?.launch(
        &ctx.gpu,
        (ids.len() as u32, 1, 1),
        norm_block(table.cols),
        0,
        vec![
            Arg::Ptr(table.dense()?.ptr),
            Arg::Ptr(ids_ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(table.cols as i32),
        ],
    )?;
    Ok(out)
}

/// RMSNorm of `x` into a new model-dtype tensor (with INT8 codes when a W8A8 GEMM will read it).
pub fn rms_norm(
    ctx: &CudaContext,
    x: &CudaTensor,
    weight: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    norm_into(ctx, x, None, weight, eps)
}

/// `x += delta`, then [`rms_norm`] of the sum, in one launch.
pub fn add_rms_norm(
    ctx: &CudaContext,
    x: &mut CudaTensor,
    delta: &CudaTensor,
    weight: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    expect_whole_f32(delta, "residual delta")?;
    norm_into(ctx, x, Some(delta), weight, eps)
}

fn norm_into(
    ctx: &CudaContext,
    x: &CudaTensor,
    delta: Option<&CudaTensor>,
    weight: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    expect_whole_f32(x, "rms_norm input")?;
    if weight.cols != x.cols {
        return Err(Error::InvalidArgument(format!(
            "rms_norm: {} features, weight of {}",
            x.cols, weight.cols
        )));
    }
    let mut out = ctx.alloc(x.rows, x.cols, Elem::Half(ctx.dtype))?;
    let mut args = vec![
        Arg::Ptr(x.ptr),
        Arg::Ptr(delta.map_or(0, |d| d.ptr)),
        Arg::Ptr(weight.ptr),
        Arg::Ptr(out.ptr),
        Arg::I32(x.cols as i32),
        Arg::F32(eps),
    ];
    let name = match ctx.wants_act8() {
        Some(kind) => {
            out.act8 = Some(act8_for(ctx, &out, kind, &mut args)?);
            format!("rms_norm_{}", kind.fused_tag())
        }
        None => "rms_norm".into(),
    };
    ctx.half_kernel(&name)?.launch(
        &ctx.gpu,
        (x.rows as u32, 1, 1),
        row_regs_block(x.cols),
        0,
        args,
    )?;
    Ok(out)
}

/// RMSNorm of every `head_dim` slice of `x`'s rows, in place.
pub fn head_rms_norm(
    ctx: &CudaContext,
    x: &mut CudaTensor,
    weight: &CudaTensor,
    head_dim: usize,
    eps: f32,
) -> Result<()> {
    expect_f32(x, "head_rms_norm input")?;
    // Whole heads of each row, like the CPU.
    let row_heads = x.cols / head_dim;
    let heads = x.rows * row_heads;
    ctx.launch(
        "head_rms_norm",
        (heads.div_ceil(8) as u32, 1, 1),
        256,
        vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(weight.ptr),
            Arg::I32(head_dim as i32),
            Arg::I32(row_heads as i32),
            Arg::I64(x.ld as i64),
            Arg::I64(heads as i64),
            Arg::F32(eps),
        ],
    )
}

/// Adds bias `b` to every row of a GEMM's output.
pub fn add_bias(ctx: &CudaContext, out: &CudaTensor, b: &CudaTensor) -> Result<()> {
    let n = out.rows * out.cols;
    ctx.launch(
        "add_bias",
        grid_for(n),
        BLOCK,
        vec![
            Arg::Ptr(out.ptr),
            Arg::Ptr(b.ptr),
            Arg::I32(out.cols as i32),
            Arg::I64(n as i64),
        ],
    )
}

/// The current forward pass's RoPE angles for `inv_freq` (`[tokens][head_dim / 2]` of (cos,
/// sin), f64 angles as on the CPU): computed by the pass's first rotation and read by every
/// layer's, so the double-precision sines run once a step, not once a layer.
pub fn rope_table(
    ctx: &CudaContext,
    inv_freq: &CudaTensor,
    head_dim: usize,
    batch: &BatchLayout,
) -> Result<DevicePtr> {
    let half = head_dim / 2;
    if half == 0 || inv_freq.rows * inv_freq.cols < half {
        return Err(Error::InvalidArgument(format!(
            "rope of head_dim {head_dim} with {} frequencies",
            inv_freq.rows * inv_freq.cols
        )));
    }
    ctx.ensure_meta(None, batch)?;
    let positions = ctx.with_meta(|m| m.positions);
    let n = batch.num_tokens() * half;
    ctx.rope_table(inv_freq.ptr, half, n * 8, |table| {
        ctx.launch(
            "rope_angles",
            grid_for(n),
            BLOCK,
            vec![
                Arg::Ptr(positions),
                Arg::Ptr(inv_freq.ptr),
                Arg::Ptr(table),
                Arg::I32(half as i32),
                Arg::I64(n as i64),
            ],
        )
    })
}

/// RoPE over `x` and, in the same launch, `second` (q and k of one layer).
pub fn rope(
    ctx: &CudaContext,
    x: &CudaTensor,
    second: Option<&CudaTensor>,
    head_dim: usize,
    batch: &BatchLayout,
    inv_freq: &CudaTensor,
    layout: RopeLayout,
) -> Result<()> {
    expect_f32(x, "rope input")?;
    if let Some(k) = second {
        expect_f32(k, "rope input")?;
        if k.rows != x.rows {
            return Err(Error::InvalidArgument(format!(
                "rope of q with {} rows and k with {}",
                x.rows, k.rows
            )));
        }
    }
    if x.rows != batch.num_tokens() {
        return Err(Error::InvalidArgument(format!(
            "rope of {} rows for a batch of {} tokens",
            x.rows,
            batch.num_tokens()
        )));
    }
    let table = rope_table(ctx, inv_freq, head_dim, batch)?;
    let other = second.unwrap_or(x);
    ctx.launch(
        "rope",
        (x.rows as u32, if second.is_some() { 2 } else { 1 }, 1),
        norm_block(x.cols.max(other.cols) / 2),
        vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(table),
            Arg::I32(x.cols as i32),
            Arg::I64(x.ld as i64),
            Arg::I32(head_dim as i32),
            Arg::I32(i32::from(layout == RopeLayout::Interleaved)),
            Arg::Ptr(other.ptr),
            Arg::I32(other.cols as i32),
            Arg::I64(other.ld as i64),
        ],
    )
}

/// `silu(gate) * up` in the model dtype (with INT8 codes when an INT8-activation GEMM will read
/// it).
pub fn silu_mul(ctx: &CudaContext, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
    let Some(kind) = ctx.wants_act8() else {
        return gated(ctx, "silu_mul", gate, up);
    };
    check_gated("silu_mul", gate, up)?;
    let mut out = ctx.alloc(gate.rows, gate.cols, Elem::Half(ctx.dtype))?;
    // One block per row: the row's INT8 codes need its max.
    let mut args = vec![
        Arg::Ptr(gate.ptr),
        Arg::Ptr(up.ptr),
        Arg::Ptr(out.ptr),
        Arg::I32(gate.cols as i32),
        Arg::I64(gate.ld as i64),
        Arg::I64(up.ld as i64),
    ];
    out.act8 = Some(act8_for(ctx, &out, kind, &mut args)?);
    ctx.half_kernel(&format!("silu_mul_{}", kind.fused_tag()))?
        .launch(
            &ctx.gpu,
            (gate.rows as u32, 1, 1),
            row_regs_block(gate.cols),
            0,
            args,
        )?;
    Ok(out)
}

fn check_gated(what: &str, gate: &CudaTensor, up: &CudaTensor) -> Result<()> {
    expect_f32(gate, "gate")?;
    expect_f32(up, "up")?;
    if (gate.rows, gate.cols) != (up.rows, up.cols) {
        return Err(Error::InvalidArgument(format!(
            "{what} of {}x{} and {}x{}",
            gate.rows, gate.cols, up.rows, up.cols
        )));
    }
    Ok(())
}

/// `act(gate) * up` in the model dtype by the element-wise kernel `kernel` (`silu_mul`,
/// `gelu_tanh_mul`): f32 gate and up, possibly strided views of one fused projection.
fn gated(
    ctx: &CudaContext,
    kernel: &str,
    gate: &CudaTensor,
    up: &CudaTensor,
) -> Result<CudaTensor> {
    check_gated(kernel, gate, up)?;
    let out = ctx.alloc(gate.rows, gate.cols, Elem::Half(ctx.dtype))?;
    let n = gate.rows * gate.cols;
    if n == 0 {
        return Ok(out);
    }
    // A block per row (the kernel walks rows blockIdx.x, + gridDim.x, ...).
    ctx.half_kernel(kernel)?.launch(
        &ctx.gpu,
        (gate.rows.min(1 << 20) as u32, 1, 1),
        row_regs_block(gate.cols),
        0,
        vec![
            Arg::Ptr(gate.ptr),
            Arg::Ptr(up.ptr),
            Arg::Ptr(out.ptr),
            Arg::I64(n as i64),
            Arg::I32(gate.cols as i32),
            Arg::I64(gate.ld as i64),
            Arg::I64(up.ld as i64),
        ],
    )?;
    Ok(out)
}

/// `x += delta` (the residual stream).
pub fn add(ctx: &CudaContext, x: &mut CudaTensor, delta: &CudaTensor) -> Result<()> {
    expect_whole_f32(x, "add target")?;
    expect_whole_f32(delta, "add delta")?;
    let n = x.rows * x.cols;
    ctx.launch(
        "add_f32",
        grid_for(n),
        BLOCK,
        vec![Arg::Ptr(x.ptr), Arg::Ptr(delta.ptr), Arg::I64(n as i64)],
    )
}

/// RMSNorm of `x` into a new f32 tensor (a block output before its residual add).
pub fn residual_rms_norm(
    ctx: &CudaContext,
    x: &CudaTensor,
    weight: &CudaTensor,
    eps: f32,
) -> Result<CudaTensor> {
    expect_whole_f32(x, "residual_rms_norm input")?;
    if weight.cols != x.cols {
        return Err(Error::InvalidArgument(format!(
            "residual_rms_norm: {} features, weight of {}",
            x.cols, weight.cols
        )));
    }
    let out = ctx.alloc(x.rows, x.cols, Elem::F32)?;
    ctx.kernel("rms_norm_f32")?.launch(
        &ctx.gpu,
        (x.rows as u32, 1, 1),
        row_regs_block(x.cols),
        0,
        vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(weight.ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(x.cols as i32),
            Arg::F32(eps),
        ],
    )?;
    Ok(out)
}

/// `x *= factor` (Gemma's embedding scale, and q's when `query_pre_attn_scalar` is not the head
/// size): `x` may be a column slice of a fused projection.
pub fn scale(ctx: &CudaContext, x: &mut CudaTensor, factor: f32) -> Result<()> {
    expect_f32(x, "scale target")?;
    let n = x.rows * x.cols;
    ctx.launch(
        "scale_f32",
        grid_for(n),
        BLOCK,
        vec![
            Arg::Ptr(x.ptr),
            Arg::I64(n as i64),
            Arg::I32(x.cols as i32),
            Arg::I64(x.ld as i64),
            Arg::F32(factor),
        ],
    )
}

/// `gelu_tanh(gate) * up` in the model dtype (Gemma's GeGLU). No fused INT8 variant: an
/// INT8-activation GEMM after it quantizes its input itself (`qlinear::quantize_int8`).
pub fn gelu_tanh_mul(ctx: &CudaContext, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
    gated(ctx, "gelu_tanh_mul", gate, up)
}

/// Rows `rows` of `x`, f32 or 16-bit (the last token of each sequence, for the head; the tokens
/// routed to an expert).
pub fn gather_rows(ctx: &CudaContext, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
    let rows_ptr = ctx.staged_indices(
        |m| (m.host_last_rows == rows).then_some(m.last_rows),
        &rows.iter().map(|&r| r as i32).collect::<Vec<_>>(),
    )?;
    gather_rows_at(ctx, x, rows_ptr, rows.len())
}

/// [`gather_rows`] with the `n` row indices (i32) already on the device at `rows_ptr`.
pub fn gather_rows_at(
    ctx: &CudaContext,
    x: &CudaTensor,
    rows_ptr: u64,
    n: usize,
) -> Result<CudaTensor> {
    let kernel = match x.elem {
        Elem::F32 => "gather_rows",
        Elem::Half(_) => "gather_rows_b16",
    };
    if !x.is_contiguous() {
        return Err(Error::InvalidArgument(
            "gather input must be a whole tensor, not a column slice".into(),
        ));
    }
    let out = ctx.alloc(n, x.cols, x.elem)?;
    if n == 0 {
        return Ok(out);
    }
    ctx.launch(
        kernel,
        (n as u32, 1, 1),
        norm_block(x.cols),
        vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(rows_ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(x.cols as i32),
        ],
    )?;
    Ok(out)
}

/// A mixture-of-experts layer's weighted sum of its experts' outputs (`Backend::scatter_add_scaled`):
/// a `[rows, cols]` f32 result whose row `r` adds `scale * x[i]` for every part row `i` aimed at
/// `r`, in the order of the parts, one fma each from zero, as the CPU backend does. One launch: a
/// row's entries (source row address and scale) are listed on the host in part order.
pub fn moe_combine(
    ctx: &CudaContext,
    rows: usize,
    cols: usize,
    parts: &[ScaledRows<'_, CudaTensor>],
) -> Result<CudaTensor> {
    ctx.check_err()?;
    let mut per_row = vec![0i32; rows + 1];
    for (n, p) in parts.iter().enumerate() {
        expect_whole_f32(p.x, "expert output")?;
        ctx.check_live(p.x)?;
        p.check(n, (p.x.rows, p.x.cols), rows, cols)?;
        for &r in p.rows {
            per_row[r + 1] += 1;
        }
    }
    for r in 0..rows {
        per_row[r + 1] += per_row[r];
    }
    let entries = per_row[rows] as usize;
    let mut next: Vec<usize> = per_row[..rows].iter().map(|&o| o as usize).collect();
    let mut srcs = vec![0u64; entries];
    let mut scales = vec![0f32; entries];
    let row_bytes = (cols * 4) as u64;
    for p in parts {
        for (i, (&r, &s)) in p.rows.iter().zip(p.scales).enumerate() {
            srcs[next[r]] = p.x.ptr + i as u64 * row_bytes;
            scales[next[r]] = s;
            next[r] += 1;
        }
    }
    let mut up = StepUpload::default();
    let (srcs_at, scales_at, offsets_at) = (up.push(&srcs), up.push(&scales), up.push(&per_row));
    let base = ctx.stage_upload_all(&up)?;
    let (srcs_ptr, scales_ptr, offsets_ptr) = (
        base + srcs_at as u64,
        base + scales_at as u64,
        base + offsets_at as u64,
    );
    let out = ctx.alloc(rows, cols, Elem::F32)?;
    if rows > 0 {
        ctx.launch(
            "moe_combine",
            (rows as u32, 1, 1),
            norm_block(cols),
            vec![
                Arg::Ptr(srcs_ptr),
                Arg::Ptr(scales_ptr),
                Arg::Ptr(offsets_ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(cols as i32),
            ],
        )?;
    }
    Ok(out)
}

/// An f32 matrix of uniform values in [-1, 1) that owns its memory (benchmark inputs that
/// outlive forward passes).
pub fn random_tensor(ctx: &CudaContext, rows: usize, cols: usize, seed: i32) -> Result<CudaTensor> {
    let n = rows * cols;
    let buf = std::sync::Arc::new(DeviceBuffer::alloc(&ctx.gpu, n * 4, "benchmark input")?);
    ctx.launch(
        "fill_random_f32",
        grid_for(n),
        BLOCK,
        vec![Arg::Ptr(buf.ptr), Arg::I64(n as i64), Arg::I32(seed)],
    )?;
    Ok(CudaTensor::owned(buf, rows, cols, Elem::F32))
}

/// Benchmark support: uniform values in [-1, 1) in the model dtype, in owned memory.
pub fn random_half_tensor(
    ctx: &CudaContext,
    rows: usize,
    cols: usize,
    seed: i32,
) -> Result<CudaTensor> {
    let t = ctx.owned_tensor(rows, cols, Elem::Half(ctx.dtype))?;
    let n = rows * cols;
    ctx.half_kernel("fill_random")?.launch(
        &ctx.gpu,
        grid_for(n),
        BLOCK,
        0,
        vec![Arg::Ptr(t.ptr), Arg::I64(n as i64), Arg::I32(seed)],
    )?;
    Ok(t)
}

/// Fills a whole KV pool with uniform values in [-1, 1), quantized as appends would for a
/// quantized pool.
pub fn fill_kv_random(ctx: &CudaContext, kv: &CudaKv, seed: i32) -> Result<()> {
    if !kv.is_float() {
        let name = format!("kvq_fill_random_hd{}", kv.shape.head_dim);
        let slots = kv.num_blocks * kv.shape.num_kv_heads * kv.block_size;
        for layer in 0..kv.shape.num_layers {
            let (k, v) = kv.layer(layer);
            ctx.kv_kernel(kv.formats, kv.deferred[1], &name)?.launch(
                &ctx.gpu,
                (slots as u32, 1, 1),
                64,
                0,
                vec![Arg::Ptr(k), Arg::Ptr(v), Arg::I32(seed + 2 * layer as i32)],
            )?;
        }
        return Ok(());
    }
    let n = kv.num_blocks * kv.block_size * kv.shape.num_kv_heads * kv.shape.head_dim;
    for layer in 0..kv.shape.num_layers {
        let (k, v) = kv.layer(layer);
        for (i, p) in [k, v].into_iter().enumerate() {
            ctx.half_kernel("fill_random")?.launch(
                &ctx.gpu,
                grid_for(n),
                BLOCK,
                0,
                vec![
                    Arg::Ptr(p),
                    Arg::I64(n as i64),
                    Arg::I32(seed + 2 * layer as i32 + i as i32),
                ],
            )?;
        }
    }
    Ok(())
}

/// Allocates 8-bit codes and scales for `out` and appends them to a fused kernel's `args`.
fn act8_for(
    ctx: &CudaContext,
    out: &CudaTensor,
    kind: Act8,
    args: &mut Vec<Arg>,
) -> Result<Act8Input> {
    let codes = ctx.alloc_bytes(out.rows * out.cols)?;
    let scales = ctx.alloc(out.rows, 1, Elem::F32)?.ptr;
    args.push(Arg::Ptr(codes));
    args.push(Arg::Ptr(scales));
    Ok(Act8Input {
        codes,
        scales,
        kind,
    })
}

/// For ops that read rows back to back (norms, adds, gathers).
fn expect_whole_f32(t: &CudaTensor, what: &str) -> Result<()> {
    expect_f32(t, what)?;
    if !t.is_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "{what} must be a whole tensor, not a column slice"
        )));
    }
    Ok(())
}

fn expect_f32(t: &CudaTensor, what: &str) -> Result<()> {
    if t.elem != Elem::F32 {
        return Err(Error::InvalidArgument(format!(
            "{what} must be f32, got {:?}",
            t.elem
        )));
    }
    Ok(())
}

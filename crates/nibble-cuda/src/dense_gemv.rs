//! The dense 16-bit decode gemv (kernels/gemv_dense.cu): `y = x @ w^T` for 1 to
//! [`MAX_TOKENS`] tokens on Hopper, in place of cuBLAS, whose kernels spend several µs a call
//! over the copy time of a decode-sized layer. One CTA per SM streams a contiguous run of rows
//! through a ring of shared memory with TMA bulk copies, and starts them before the previous
//! kernel has finished.

use nibble_core::{Error, Result};

use crate::context::CudaContext;
use crate::peer_sum::{PushArgs, WaitArgs};
use crate::runtime::Arg;
use crate::tensor::{CudaTensor, CudaWeight, Elem};

/// Most tokens the kernel takes (one instance per count).
pub const MAX_TOKENS: usize = 4;

/// Channels of a segment, what a warp reads of a row at once: K must be a multiple.
pub const SEGMENT: usize = 256;

/// The kernel's consumer warps (`DG_WARPS`); one producer warp more.
const WARPS: usize = 16;

/// Most shared memory a CTA may hold on Hopper (227 KB), less the kernel's static barriers.
const SMEM_LIMIT: usize = 227 * 1024 - 256;

/// The stage sizes the kernel is built for (one bulk copy each), and the one [`run`] takes.
pub const STAGES_KB: [usize; 2] = [16, 32];
pub const DEFAULT_STAGE_KB: usize = 32;

/// The ring: up to this much in flight an SM (HBM's latency under a full stream), at least two
/// stages, at most `DG_MAX_SLOTS` (10).
const MAX_RING: usize = 160 * 1024;
const MAX_SLOTS: usize = 10;

/// The CTAs for `n` rows: one per SM, at most one per row.
fn ctas(ctx: &CudaContext, n: usize) -> usize {
    ctx.gpu.sm_count.min(n)
}

/// The ring's bytes and the CTA's shared memory for `m` tokens of a `[n, k]` weight in stages of
/// `stage` bytes: the ring, the activations, then a partial sum per (row, warp, token); a
/// SwiGLU weight's CTA (`pair`) sums each of its rows' up partner too.
fn layout(m: usize, n: usize, k: usize, ctas: usize, stage: usize) -> (usize, usize) {
    layout_rows(m, n.div_ceil(ctas), k, stage)
}

/// [`layout`] for a CTA of at most `rows` rows.
fn layout_rows(m: usize, rows: usize, k: usize, stage: usize) -> (usize, usize) {
    let rest = m * k * 2 + rows * WARPS * m * 4;
    let ring = SMEM_LIMIT
        .saturating_sub(rest)
        .min(MAX_RING)
        .min(MAX_SLOTS * stage)
        / stage
        * stage;
    (ring, ring + rest)
}

/// Whether the kernel computes an `m`-token product with a `[n, k]` weight on this GPU: Hopper
/// only (its entries are built for `sm_90a`; later GPUs keep cuBLAS, as the wgmma kernels do).
pub fn applies(ctx: &CudaContext, m: usize, n: usize, k: usize) -> bool {
    ctx.gpu.cc == (9, 0)
        && (1..=MAX_TOKENS).contains(&m)
        && n > 0
        && k > 0
        && k.is_multiple_of(SEGMENT)
        && STAGES_KB.iter().all(|&kb| {
            let stage = kb << 10;
            layout(m, n, k, ctas(ctx, n), stage).0 >= 2 * stage
        })
}

/// Smallest weight the engine streams with this kernel rather than cuBLAS (bytes).
const ENGINE_MIN_BYTES: usize = 20 << 20;

/// Whether the engine runs an `m`-token product with a `[n, k]` 16-bit weight here rather than
/// on cuBLAS: one token, weights of 20 MB or more. Measured on an H200 (BENCHMARKS.md, "the
/// dense decode gemv"): at one token it runs 0.98x to 1.05x cuBLAS from 25 MB up (Llama-3-8B's
/// layers, whole and halved), and starts under programmatic dependent launch, which cuBLAS does
/// not; on a 16 MB layer (o_proj halved) its ramp costs 0.84x, and from two tokens the f32
/// products of every token make it 0.64x to 0.93x.
pub fn engine_picks(ctx: &CudaContext, m: usize, n: usize, k: usize) -> bool {
    m == 1 && n * k * 2 >= ENGINE_MIN_BYTES && applies(ctx, m, n, k)
}

/// The entry point for `m` tokens of the model dtype in stages of `stage_kb` KB.
pub fn kernel_name(m: usize, stage_kb: usize, dtype_suffix: &str) -> String {
    format!("dense_gemv{m}_s{stage_kb}_{dtype_suffix}")
}

/// `out = x @ w^T`: `x` `[m, k]` in the model dtype, `w` a dense `[n, k]` weight of that dtype,
/// `out` `[m, n]` f32. The caller checks [`applies`].
pub fn run(ctx: &CudaContext, x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) -> Result<()> {
    run_staged(ctx, x, w, out, DEFAULT_STAGE_KB)
}

/// [`run`] in stages of `stage_kb` KB, one of [`STAGES_KB`] (benchmarks compare them).
pub fn run_staged(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &CudaWeight,
    out: &CudaTensor,
    stage_kb: usize,
) -> Result<()> {
    let (m, n, k) = (x.rows, w.rows, w.cols);
    if !applies(ctx, m, n, k)
        || x.cols != k
        || out.rows != m
        || out.cols != n
        || !out.is_contiguous()
        || !STAGES_KB.contains(&stage_kb)
    {
        return Err(Error::InvalidArgument(format!(
            "dense gemv of {m}x{} by {n}x{k} into {}x{} in {stage_kb} KB stages",
            x.cols, out.rows, out.cols
        )));
    }
    if x.elem != Elem::Half(ctx.dtype) || w.dtype != ctx.dtype || out.elem != Elem::F32 {
        return Err(Error::InvalidArgument(format!(
            "dense gemv of a {:?} input and a {:?} weight into {:?}",
            x.elem, w.dtype, out.elem
        )));
    }
    let name = kernel_name(m, stage_kb, ctx.dtype.suffix());
    let wp = w.dense()?.ptr;
    launch(ctx, &name, (m, n, k), stage_kb, false, |ring| {
        gemv_args(wp, x, out, n, k, ring)
    })
}

/// The arguments every plain gemv entry starts with: weight, input, output, shape, ring bytes.
fn gemv_args(
    wp: crate::runtime::DevicePtr,
    x: &CudaTensor,
    out: &CudaTensor,
    n: usize,
    k: usize,
    ring: usize,
) -> Vec<Arg> {
    vec![
        Arg::Ptr(wp),
        Arg::Ptr(x.ptr),
        Arg::Ptr(out.ptr),
        Arg::I32(n as i32),
        Arg::I32(k as i32),
        Arg::I32(ring as i32),
    ]
}

/// Launches entry `name` for `m` tokens of a `[n, k]` weight in stages of `stage_kb` KB: one
/// CTA per SM (at most one per row), the layout's shared memory, `args(ring bytes)` its
/// arguments; with `pair`, each of the `n` rows has an up partner (a SwiGLU weight).
fn launch(
    ctx: &CudaContext,
    name: &str,
    (m, n, k): (usize, usize, usize),
    stage_kb: usize,
    pair: bool,
    args: impl FnOnce(usize) -> Vec<Arg>,
) -> Result<()> {
    let ctas = ctas(ctx, n);
    let rows = n.div_ceil(ctas) * if pair { 2 } else { 1 };
    let (ring, smem) = layout_rows(m, rows, k, stage_kb << 10);
    ctx.launch_block(
        name,
        (ctas as u32, 1, 1),
        ((WARPS + 1) * 32) as u32,
        smem as u32,
        args(ring),
    )
}

/// The entry point that norms its one row first ([`run_norm`]); with `peer`, the one that waits
/// for a peer sum's other half first; with `swiglu`, the one that writes a SwiGLU layer's
/// `silu(gate) * up`.
pub fn norm_kernel_name(dtype_suffix: &str, peer: bool, swiglu: bool) -> String {
    let p = if peer { "_peer" } else { "" };
    let g = if swiglu { "_swiglu" } else { "" };
    format!("dense_gemv_norm1{p}{g}_s{DEFAULT_STAGE_KB}_{dtype_suffix}")
}

/// Whether a SwiGLU layer of `n` outputs over `k` channels fits the normed gemv: a CTA sums its
/// rows' up partners too, and its ring must still hold two stages.
pub fn swiglu_fits(ctx: &CudaContext, n: usize, k: usize) -> bool {
    let stage = DEFAULT_STAGE_KB << 10;
    n > 0 && layout_rows(1, 2 * n.div_ceil(ctas(ctx, n)), k, stage).0 >= 2 * stage
}

/// The entry point of a peer sum's producer ([`run_push`]).
pub fn push_kernel_name(dtype_suffix: &str) -> String {
    format!("dense_gemv1_push_s{DEFAULT_STAGE_KB}_{dtype_suffix}")
}

/// [`run`] for one token, its rows also pushed into a tensor-parallel peer's receive slot and
/// counted there (a peer sum's producer, `crate::peer_sum`). The caller checks [`applies`].
pub fn run_push(
    ctx: &CudaContext,
    x: &CudaTensor,
    w: &CudaWeight,
    out: &CudaTensor,
    push: &PushArgs,
) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    if x.rows != 1
        || !applies(ctx, 1, n, k)
        || x.cols != k
        || out.rows != 1
        || out.cols != n
        || x.elem != Elem::Half(ctx.dtype)
        || w.dtype != ctx.dtype
        || out.elem != Elem::F32
    {
        return Err(Error::InvalidArgument(format!(
            "pushing dense gemv of {}x{} by {n}x{k}",
            x.rows, x.cols
        )));
    }
    let name = push_kernel_name(ctx.dtype.suffix());
    let wp = w.dense()?.ptr;
    launch(ctx, &name, (1, n, k), DEFAULT_STAGE_KB, false, |ring| {
        let mut args = gemv_args(wp, x, out, n, k, ring);
        args.extend([
            Arg::Ptr(push.peer_y),
            Arg::Ptr(push.peer_arrivals),
            Arg::Ptr(push.own),
        ]);
        args
    })
}

/// `out = rms_norm(res + delta) @ w^T` for one row, the norm (elementwise.cu's arithmetic) done
/// by every CTA for itself instead of in a kernel of its own: `res` `[1, k]` f32, `delta` the
/// same or none, `norm` `[k]` f32. With `delta`, the updated residual `res + delta` goes to
/// `res_out` (`k` f32, not `res`: every CTA reads `res`). The caller checks
/// [`engine_picks`] for one token. With `peer`, `delta` is this rank's half of a peer sum and
/// the kernel waits for the other half, then norms `res + (delta + peer's)`. With `swiglu`, `w`
/// is a SwiGLU layer's gate rows stacked on its up rows and `out` `[1, rows / 2]` in the model
/// dtype gets `silu(gate) * up`.
#[allow(clippy::too_many_arguments)]
pub fn run_norm(
    ctx: &CudaContext,
    res: &CudaTensor,
    delta: Option<&CudaTensor>,
    norm: &CudaTensor,
    eps: f32,
    w: &CudaWeight,
    out: &CudaTensor,
    res_out: crate::runtime::DevicePtr,
    peer: Option<&WaitArgs>,
    swiglu: bool,
) -> Result<()> {
    let k = w.cols;
    let n = if swiglu { w.rows / 2 } else { w.rows };
    let out_elem = if swiglu {
        Elem::Half(ctx.dtype)
    } else {
        Elem::F32
    };
    let shapes_agree = res.rows == 1
        && res.cols == k
        && norm.rows * norm.cols == k
        && delta.is_none_or(|d| d.rows == 1 && d.cols == k && d.elem == Elem::F32)
        && out.rows == 1
        && out.cols == n
        && (!swiglu || w.rows.is_multiple_of(2));
    let fits = !swiglu || swiglu_fits(ctx, n, k);
    if !engine_picks(ctx, 1, w.rows, k) || !shapes_agree || !fits {
        return Err(Error::InvalidArgument(format!(
            "normed dense gemv of {}x{} by {n}x{k}",
            res.rows, res.cols
        )));
    }
    if res.elem != Elem::F32 || w.dtype != ctx.dtype || out.elem != out_elem {
        return Err(Error::InvalidArgument(format!(
            "normed dense gemv of a {:?} residual and a {:?} weight into {:?}",
            res.elem, w.dtype, out.elem
        )));
    }
    if peer.is_some() && delta.is_none() {
        return Err(Error::InvalidArgument(
            "a peer sum's normed gemv without its own half".into(),
        ));
    }
    let name = norm_kernel_name(ctx.dtype.suffix(), peer.is_some(), swiglu);
    let wp = w.dense()?.ptr;
    launch(ctx, &name, (1, n, k), DEFAULT_STAGE_KB, swiglu, |ring| {
        let mut args = vec![
            Arg::Ptr(wp),
            Arg::Ptr(res.ptr),
            Arg::Ptr(delta.map_or(0, |d| d.ptr)),
        ];
        if let Some(p) = peer {
            args.push(Arg::Ptr(p.peer_part));
        }
        args.extend([
            Arg::Ptr(norm.ptr),
            Arg::Ptr(res_out),
            Arg::Ptr(out.ptr),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(ring as i32),
            Arg::F32(eps),
        ]);
        if let Some(p) = peer {
            args.extend([Arg::Ptr(p.arrivals), Arg::Ptr(p.own), Arg::Ptr(p.abort)]);
        }
        args
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_holds_a_ring_of_two_stages_or_more() {
        // On 132 SMs, Llama-3-8B's layers whole and halved and Llama-2-70B's halved fit at every token
        // count, and the output heads (a partial sum per row and warp) up to two tokens; what
        // does not fit is refused (cuBLAS runs it), never launched over the SM's 227 KB.
        let fits = |m: usize, n: usize, k: usize| {
            STAGES_KB.iter().all(|&kb| {
                let (ring, smem) = layout(m, n, k, 132.min(n), kb << 10);
                let ok = ring >= 2 * (kb << 10);
                assert!(!ok || smem <= SMEM_LIMIT, "{m}x{n}x{k} {kb} KB: {smem}");
                ok
            })
        };
        for &(n, k) in &[
            (6144, 4096),
            (3072, 4096),
            (4096, 2048),
            (28672, 4096),
            (4096, 14336),
            (4096, 7168),
            (10240, 8192),
            (28672, 8192),
            (8192, 14336),
        ] {
            for m in 1..=MAX_TOKENS {
                assert!(fits(m, n, k), "{m}x{n}x{k}");
            }
        }
        for n in [128256, 64128, 32000] {
            assert!(fits(1, n, 4096) && fits(2, n, 4096), "head {n}");
        }
        // Llama-2-70B's down_proj halved: its activations fill the SM from three tokens.
        assert!(fits(2, 8192, 28672) && !fits(3, 8192, 28672));
        assert!(!fits(4, 128256, 4096));
    }
}

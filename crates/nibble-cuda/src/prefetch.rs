//! Streaming a weight into L2 ahead of its GEMM (`Backend::prefetch`, kernels/gemv_dense.cu's
//! `l2_prefetch`). A decode step at small batches is a sequence of weight streams with gaps where
//! memory sits idle (attention, a rank's all-reduce, norms, RoPE); a prefetch issued before a gap
//! fills it with the next weight's bytes, which its GEMM then reads from L2.

use nibble_core::Result;

use crate::context::CudaContext;
use crate::runtime::Arg;
use crate::tensor::{CudaWeight, WeightData};

/// Parts of the buffer whose starts are prefetched: two a SM, the stream-K decode gemvs' CTAs
/// and twice the dense gemv's (each streams its own contiguous range from its start).
fn parts(ctx: &CudaContext) -> usize {
    2 * ctx.gpu.sm_count
}

/// At most this share of L2 is filled ahead: the rest holds what the gap's own ops read.
const L2_SHARE: f64 = 0.5;

/// Bytes of each part that are prefetched, `(parts, per_part)`, for a buffer of `bytes`:
/// everything when it fits the L2 share, else the same start of every part.
pub fn plan(bytes: usize, l2_bytes: usize, parts: usize) -> (usize, usize) {
    let budget = (l2_bytes as f64 * L2_SHARE) as usize;
    if bytes <= budget {
        (1, bytes)
    } else {
        (parts, budget / parts)
    }
}

/// Starts moving `w`'s bytes (its codes, for a quantized weight) into L2; Hopper only (the bulk
/// prefetch), a no-op elsewhere.
pub fn prefetch(ctx: &CudaContext, w: &CudaWeight) -> Result<()> {
    if ctx.gpu.cc.0 < 9 {
        return Ok(());
    }
    let buf = match &w.data {
        WeightData::Dense(b) => b,
        WeightData::Quant(q) => q.codes(),
    };
    let (parts, per_part) = plan(buf.bytes, ctx.gpu.l2_bytes, parts(ctx));
    let threads = parts * per_part.div_ceil(64 << 10);
    ctx.launch_block(
        "l2_prefetch",
        (threads.div_ceil(128).max(1) as u32, 1, 1),
        128,
        0,
        vec![
            Arg::Ptr(buf.ptr),
            Arg::I64(buf.bytes as i64),
            Arg::I32(parts as i32),
            Arg::I64(per_part as i64),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::plan;

    #[test]
    fn small_weights_come_whole_and_large_ones_by_the_start_of_each_part() {
        // 60 MB of L2 (an H200): 16 MB comes whole, 117 MB as 264 starts of 30 MB in all.
        let l2 = 60 << 20;
        assert_eq!(plan(16 << 20, l2, 264), (1, 16 << 20));
        let (parts, per) = plan(117 << 20, l2, 264);
        assert_eq!(parts, 264);
        assert!(parts * per <= 30 << 20 && parts * per > 29 << 20);
    }
}

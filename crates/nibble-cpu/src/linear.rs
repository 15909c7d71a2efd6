//! `y = x @ W^T` with W kept in its storage format.
//!
//! **Batch invariance.** Every output row is bit-for-bit the same whatever the number of input
//! rows and whatever the other rows hold, so a request gets the same logits alone, batched, or
//! recomputed by a prefill after preemption. There is one arithmetic per weight format, whatever
//! `m`:
//!
//! - Q4_0, Q4_1, Q8_0: each activation row is quantized to 16-bit integer blocks (a per-row
//!   operation) and dotted with the weight blocks by the integer kernels of [`crate::qdot`].
//! - Every other ggml format: each weight row is dequantized 256 elements at a time and dotted
//!   with the f32 activations with a fixed lane order ([`crate::ops::dot`]).
//! - nibble's quantized formats (`WeightFormat::Quant`): [`crate::quant`], bit for bit
//!   `nibble_precision::reference_matmul`, with the tiling of [`run_tiles`].
//!
//! The kernels take up to [`qdot::MAX_ROWS`] activation rows at once and decode each weight block
//! once for all of them, but accumulate every output exactly as for a lone row.
//!
//! Output columns (weight rows) are split into tiles, which the calling thread and the spinning
//! workers of [`crate::spin`] take in turn (small matmuls run on the calling thread alone; neither
//! changes the arithmetic), and every tile writes its own block of output columns in place.
//! Within a tile, weight rows are taken a cache-sized panel at a time, and each panel is applied
//! to all activation rows, [`qdot::MAX_ROWS`] at a time (a lone row takes [`qdot::WEIGHT_ROWS`]
//! weight rows per pass instead).
//!
//! A fused weight (Q/K/V or gate/up rows stacked, see `load_fused_weight`) is one matmul like any
//! other: its rows are independent, so each output has the bits of its own weight's matmul.

use std::sync::atomic::{AtomicUsize, Ordering};

use nibble_core::Result;
use nibble_formats::WeightFormat;

use crate::qdot::{self, ActRow, Kernel, QBlock};
use crate::{CpuTensor, CpuWeight, Threads};

/// Below this much work (weight bytes times groups of [`qdot::MAX_ROWS`] input rows) a matmul
/// runs on the calling thread: handing it out costs more than it saves. With spinning workers
/// (a handoff of a microsecond or so, not a wake-up) that is far less than the 256 KiB it took
/// with rayon's sleeping ones, so even a decode step's K/V-sized matmuls are split.
const SERIAL_BYTES: usize = 32 * 1024;

/// Weight bytes of the panel that a task applies to every group of input rows (stays in L1/L2).
const PANEL_BYTES: usize = 32 * 1024;

/// `x @ w^T`, called from outside `pool` (or from inside it); see [`fused`] for how the work is
/// shared with the pool.
pub(crate) fn matmul_transposed(pool: &Threads, x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor> {
    let mut y = CpuTensor::zeros(x.rows, w.rows);
    if let WeightFormat::Quant(_) = w.format {
        crate::quant::matmul(pool, x, w.quant()?, &mut y.data, false)?;
    } else {
        fused(pool, x, w, &mut y)?;
    }
    Ok(y)
}

/// `y`'s data, shared by tasks that write disjoint column blocks.
pub(crate) struct OutPtr(*mut f32);
// SAFETY: each task writes only its own columns of y (see `run_tiles`).
unsafe impl Sync for OutPtr {}
impl OutPtr {
    pub(crate) fn new(p: *mut f32) -> Self {
        OutPtr(p)
    }

    pub(crate) fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Fused dots into `y` (`m x n`), each task writing its own block of columns.
fn fused(pool: &Threads, x: &CpuTensor, w: &CpuWeight, y: &mut CpuTensor) -> Result<()> {
    let (m, k, n) = (x.rows, x.cols, w.rows);
    let kernel = Kernel::for_format(w.format);
    let q8: Vec<QBlock> = if kernel.quantizes_activations() {
        let mut q = Vec::with_capacity(m * k / qdot::QK);
        for i in 0..m {
            qdot::quantize_row(x.row(i), &mut q);
        }
        q
    } else {
        Vec::new()
    };
    let act = |i: usize| match kernel {
        Kernel::Float => ActRow::F32(x.row(i)),
        _ => ActRow::Q8(&q8[i * k / qdot::QK..(i + 1) * k / qdot::QK]),
    };
    let wr = w.rows_view();
    // A whole number of decode passes, so that no row of a panel falls to the one-row kernel
    // (same bits either way, but that one has no prefetch and no shared activation loads).
    let panel = (PANEL_BYTES / w.row_bytes.max(1))
        .max(1)
        .next_multiple_of(qdot::WEIGHT_ROWS);
    let out = OutPtr(y.data.as_mut_ptr());
    // Weight rows r0..r0 + nr: columns r0..r0 + nr of y.
    let rows = |r0: usize, nr: usize| -> Result<()> {
        let mut acts = [act(0); qdot::MAX_ROWS];
        let mut res = [0f32; qdot::MAX_ROWS];
        for p0 in (r0..r0 + nr).step_by(panel) {
            let p1 = (p0 + panel).min(r0 + nr);
            for i0 in (0..m).step_by(qdot::MAX_ROWS) {
                let g = qdot::MAX_ROWS.min(m - i0);
                for (j, a) in acts[..g].iter_mut().enumerate() {
                    *a = act(i0 + j);
                }
                let mut r0 = p0;
                if let (1, ActRow::Q8(xq)) = (g, acts[0]) {
                    // A lone activation row (decode): several weight rows per pass share its
                    // loads and overlap their accumulation chains; same bits as `rows_dot`.
                    const W: usize = qdot::WEIGHT_ROWS;
                    while r0 + W <= p1 {
                        let v = qdot::weight_rows_dot::<W>(
                            kernel,
                            std::array::from_fn(|j| wr.row(r0 + j)),
                            xq,
                        );
                        for (j, &v) in v.iter().enumerate() {
                            // SAFETY: (i0, r0 + j) is inside y (i0 < m, r0 + j < p1 <= n), and
                            // column r0 + j belongs to this task only.
                            unsafe { *out.at(i0 * n + r0 + j) = v };
                        }
                        r0 += W;
                    }
                }
                for r in r0..p1 {
                    qdot::rows_dot(kernel, w.format, wr.row(r), &acts[..g], &mut res[..g])?;
                    for (j, &v) in res[..g].iter().enumerate() {
                        // SAFETY: (i0 + j, r) is inside y (i0 + j < m, r < n), and column r
                        // belongs to this task only.
                        unsafe { *out.at((i0 + j) * n + r) = v };
                    }
                }
            }
        }
        Ok(())
    };
    let serial = n * w.row_bytes * m.div_ceil(qdot::MAX_ROWS) < SERIAL_BYTES;
    run_tiles(pool, n, 1, serial, &rows)
}

/// Runs `rows(c0, nc)` over output columns `0..n` in tiles of a multiple of `align` columns
/// (`align` divides `n`), on the calling thread alone when `serial` or the pool has one thread.
/// Each call owns its columns, so tasks may write them in place.
pub(crate) fn run_tiles(
    pool: &Threads,
    n: usize,
    align: usize,
    serial: bool,
    rows: &(dyn Fn(usize, usize) -> Result<()> + Sync),
) -> Result<()> {
    let threads = pool.current_num_threads();
    if threads == 1 || serial {
        return rows(0, n);
    }
    // The calling thread works too, next to `threads - 1` helpers, and every participant takes
    // the next tile from a shared counter until none is left, so a late helper just finds fewer
    // tiles (which tile runs where does not change any output's bits). The helpers are the
    // spinning workers of `crate::spin` (a decode step runs ~200 matmuls, and sleeping between
    // them cost a wake-up and a condvar wait each), else rayon jobs. A few tiles per thread
    // balances load without much scheduling overhead.
    let tile = n.div_ceil(4 * threads).max(16).next_multiple_of(align);
    let tiles = n.div_ceil(tile);
    let next = AtomicUsize::new(0);
    let work = || -> Result<()> {
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= tiles {
                return Ok(());
            }
            rows(t * tile, tile.min(n - t * tile))?;
        }
    };
    let work = &work;
    let failed = std::sync::Mutex::new(None);
    let spun = pool.spin.try_run(&|| {
        if let Err(e) = work() {
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        }
    });
    if spun.is_some() {
        return match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        };
    }
    // The spinning workers are busy with another caller's matmul (or this one is nested in
    // one): the rayon pool's workers share the tiles instead.
    let mut helpers: Vec<Result<()>> = (1..threads.min(tiles)).map(|_| Ok(())).collect();
    let mine = pool.in_place_scope(|s| {
        for h in helpers.iter_mut() {
            s.spawn(move |_| *h = work());
        }
        work()
    });
    mine?;
    helpers.into_iter().collect()
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;

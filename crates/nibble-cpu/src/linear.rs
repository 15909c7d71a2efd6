//! `y = x @ W^T` with W kept in its storage format.
//!
//! **Batch invariance.** Every output row is bit-for-bit the same whatever the number of input
//! rows and whatever the other rows hold, so a request gets the same logits alone, batched, or
//! recomputed by a prefill after preemption. There is one arithmetic per weight format, whatever
//! `m`:
//!
//! - Q4_0, Q4_1, Q8_0: each activation row is quantized to 16-bit integer blocks (a per-row
//!   operation) and dotted with the weight blocks by the integer kernels of [`crate::qdot`].
//! - Every other format: each weight row is dequantized 256 elements at a time and dotted with the
//!   f32 activations with a fixed lane order ([`crate::ops::dot`]).
//!
//! The kernels take up to [`qdot::MAX_ROWS`] activation rows at once and decode each weight block
//! once for all of them, but accumulate every output exactly as for a lone row.
//!
//! Output columns (weight rows) are split into tiles, one rayon task each (small matmuls run on
//! the calling thread, which does not change the arithmetic), and every task writes its own
//! block of output columns in place. Within a task, weight rows are taken a cache-sized panel at
//! a time, and each panel is applied to all activation rows, [`qdot::MAX_ROWS`] at a time.

use nibble_core::Result;
use rayon::prelude::*;

use crate::qdot::{self, ActRow, Kernel, QBlock};
use crate::{CpuTensor, CpuWeight};

/// Below this much work (weight bytes times groups of [`qdot::MAX_ROWS`] input rows) a matmul
/// runs on the calling thread: waking workers costs more than it saves.
const SERIAL_BYTES: usize = 256 * 1024;

/// Weight bytes of the panel that a task applies to every group of input rows (stays in L1/L2).
const PANEL_BYTES: usize = 32 * 1024;

pub fn matmul_transposed(x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor> {
    let mut y = CpuTensor::zeros(x.rows, w.rows);
    fused(x, w, &mut y)?;
    Ok(y)
}

/// `y`'s data, shared by tasks that write disjoint column blocks.
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own columns of y (see `fused`).
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Fused dots into `y` (`m x n`), each task writing its own block of columns.
fn fused(x: &CpuTensor, w: &CpuWeight, y: &mut CpuTensor) -> Result<()> {
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
    let panel = (PANEL_BYTES / w.row_bytes.max(1)).max(1);
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
                for r in p0..p1 {
                    qdot::rows_dot(kernel, w.format, w.row(r), &acts[..g], &mut res[..g])?;
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
    let threads = rayon::current_num_threads();
    if threads == 1 || n * w.row_bytes * m.div_ceil(qdot::MAX_ROWS) < SERIAL_BYTES {
        return rows(0, n);
    }
    // A few tasks per thread balances load without much scheduling overhead.
    let tile = n.div_ceil(4 * threads).max(16);
    (0..n.div_ceil(tile))
        .into_par_iter()
        .try_for_each(|t| rows(t * tile, tile.min(n - t * tile)))
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;

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
//! the calling thread, which does not change the arithmetic). A task fills its block of a
//! transposed `[n][m]` result, transposed into `y` at the end (nothing to do for m = 1). Within
//! a task, weight rows are taken a cache-sized panel at a time, and each panel is applied to all
//! activation rows, [`qdot::MAX_ROWS`] at a time.

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
    let (m, n) = (x.rows, w.rows);
    let mut out_t = vec![0f32; n * m];
    fused(x, w, &mut out_t)?;
    if m == 1 {
        return Ok(CpuTensor::new(out_t, 1, n));
    }
    let mut y = CpuTensor::zeros(m, n);
    for (r, col) in out_t.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y.data[i * n + r] = v;
        }
    }
    Ok(y)
}

/// Fused dots into `out_t` (`[n][m]`).
fn fused(x: &CpuTensor, w: &CpuWeight, out_t: &mut [f32]) -> Result<()> {
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
    // Weight rows r0.., whose `[rows][m]` results are `out`.
    let rows = |r0: usize, out: &mut [f32]| -> Result<()> {
        let mut acts = [act(0); qdot::MAX_ROWS];
        for (p, out) in out.chunks_mut(panel * m).enumerate() {
            let p0 = r0 + p * panel;
            for i0 in (0..m).step_by(qdot::MAX_ROWS) {
                let g = qdot::MAX_ROWS.min(m - i0);
                for (j, a) in acts[..g].iter_mut().enumerate() {
                    *a = act(i0 + j);
                }
                for (r, o) in out.chunks_exact_mut(m).enumerate() {
                    qdot::rows_dot(
                        kernel,
                        w.format,
                        w.row(p0 + r),
                        &acts[..g],
                        &mut o[i0..i0 + g],
                    )?;
                }
            }
        }
        Ok(())
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || n * w.row_bytes * m.div_ceil(qdot::MAX_ROWS) < SERIAL_BYTES {
        return rows(0, out_t);
    }
    // A few tasks per thread balances load without much scheduling overhead.
    let tile = n.div_ceil(4 * threads).max(16);
    out_t
        .par_chunks_mut(tile * m)
        .enumerate()
        .try_for_each(|(t, out)| rows(t * tile, out))
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;

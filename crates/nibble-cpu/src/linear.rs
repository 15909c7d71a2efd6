//! `y = x @ W^T` with W kept in its storage format.
//!
//! Output columns (weight rows) are split into tiles, one rayon task each, and every task writes
//! its own block of output columns in place (no per-task allocation).
//!
//! - Few input rows (decode, `m <= SMALL_M`): the fused kernels of [`crate::qdot`] dot each
//!   weight row straight from its blocks; quantized formats first quantize x to 16-bit integer
//!   blocks. Tasks fill a transposed `[n][m]` result (contiguous per tile), transposed into `y`
//!   at the end (nothing to do for m = 1). Small matmuls run on the calling thread.
//! - Otherwise (prefill): a task decodes its tile (8..64 rows) to f32 in a thread-local buffer
//!   (at most 64 x K floats, so it stays in L2) and multiplies it with the `gemm` crate's packed
//!   micro-kernels.

use std::cell::RefCell;

use nibble_core::Result;
use rayon::prelude::*;

use crate::qdot::{self, ActRow, Kernel, QBlock};
use crate::{CpuTensor, CpuWeight};

/// Up to this many input rows, fused per-row dots beat decoding tiles for gemm.
pub const SMALL_M: usize = 4;

/// Below this many weight bytes (per input row) a fused matmul runs on the calling thread: waking
/// workers costs more than it saves.
const SERIAL_BYTES: usize = 256 * 1024;

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub fn matmul_transposed(x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor> {
    let (m, n) = (x.rows, w.rows);
    if m > SMALL_M {
        let mut y = CpuTensor::zeros(m, n);
        tiled_gemm(x, w, &mut y)?;
        return Ok(y);
    }
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

/// Fused per-row dots into `out_t` (`[n][m]`).
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
    let rows = |r0: usize, out: &mut [f32]| -> Result<()> {
        for (r, o) in out.chunks_exact_mut(m).enumerate() {
            let wr = w.row(r0 + r);
            for (i, o) in o.iter_mut().enumerate() {
                *o = qdot::row_dot(kernel, w.format, wr, act(i))?;
            }
        }
        Ok(())
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || n * w.row_bytes < SERIAL_BYTES {
        return rows(0, out_t);
    }
    // A few tasks per thread balances load without much scheduling overhead.
    let tile = n.div_ceil(4 * threads).max(16);
    out_t
        .par_chunks_mut(tile * m)
        .enumerate()
        .try_for_each(|(t, out)| rows(t * tile, out))
}

fn tile_rows(n: usize, threads: usize) -> usize {
    let target = n / (4 * threads.max(1));
    (target.clamp(8, 64) / 8 * 8).max(8)
}

/// `y`'s data, shared by tasks that write disjoint column blocks.
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own columns r0..r0 + nr of y.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Decode-a-tile-then-gemm, each task writing its column block of `y` in place.
fn tiled_gemm(x: &CpuTensor, w: &CpuWeight, y: &mut CpuTensor) -> Result<()> {
    let (m, k, n) = (x.rows, x.cols, w.rows);
    let tile = tile_rows(n, rayon::current_num_threads());
    let out = OutPtr(y.data.as_mut_ptr());
    (0..n.div_ceil(tile)).into_par_iter().try_for_each(|t| {
        let (r0, nr) = (t * tile, tile.min(n - t * tile));
        TILE.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.resize(tile * k, 0.0);
            w.dequantize_rows(r0, nr, &mut buf)?;
            // SAFETY: dst is columns r0..r0 + nr of y (m x n, row stride n), written by this
            // task only; lhs is x (m x k, row stride k), rhs is the tile viewed as k x nr with
            // column stride k; all within their buffers.
            unsafe {
                gemm::gemm(
                    m,
                    nr,
                    k,
                    out.at(r0),
                    1,
                    n as isize,
                    false,
                    x.data.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            Ok(())
        })
    })
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;

//! `y = x @ W^T` with W kept in its storage format.
//!
//! Tiling: output columns (weight rows) are split into tiles of 8..64 rows, one rayon task each.
//! A task decodes its tile to f32 in a thread-local buffer (at most 64 x K floats, so it stays in
//! L2) and multiplies: a plain FMA dot per row when x has few rows (decode), the `gemm` crate's
//! packed micro-kernels otherwise (prefill). Each task writes its own column block of y.

use std::cell::RefCell;

use nibble_core::Result;
use rayon::prelude::*;

use crate::ops::dot;
use crate::{CpuTensor, CpuWeight};

/// Below this many input rows, per-row dot products beat packing for gemm.
const SMALL_M: usize = 4;

thread_local! {
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn tile_rows(n: usize, threads: usize) -> usize {
    let target = n / (4 * threads.max(1));
    (target.clamp(8, 64) / 8 * 8).max(8)
}

pub fn matmul_transposed(x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor> {
    let (m, k, n) = (x.rows, x.cols, w.rows);
    let tile = tile_rows(n, rayon::current_num_threads());
    let blocks: Vec<Result<Vec<f32>>> = (0..n.div_ceil(tile))
        .into_par_iter()
        .map(|t| {
            let r0 = t * tile;
            let nr = tile.min(n - r0);
            TILE.with(|buf| {
                let mut buf = buf.borrow_mut();
                buf.resize(tile * k, 0.0);
                w.dequantize_rows(r0, nr, &mut buf)?;
                let mut out = vec![0f32; m * nr];
                if m <= SMALL_M {
                    for i in 0..m {
                        let xi = x.row(i);
                        for r in 0..nr {
                            out[i * nr + r] = dot(xi, &buf[r * k..(r + 1) * k]);
                        }
                    }
                } else {
                    // SAFETY: dst is m x nr (row stride nr), lhs is x (m x k, row stride k), rhs
                    // is the tile viewed as k x nr with column stride k; all within their buffers.
                    unsafe {
                        gemm::gemm(
                            m,
                            nr,
                            k,
                            out.as_mut_ptr(),
                            1,
                            nr as isize,
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
                }
                Ok(out)
            })
        })
        .collect();
    let mut y = CpuTensor::zeros(m, n);
    for (t, block) in blocks.into_iter().enumerate() {
        let block = block?;
        let r0 = t * tile;
        let nr = tile.min(n - r0);
        for i in 0..m {
            y.data[i * n + r0..i * n + r0 + nr].copy_from_slice(&block[i * nr..(i + 1) * nr]);
        }
    }
    Ok(y)
}

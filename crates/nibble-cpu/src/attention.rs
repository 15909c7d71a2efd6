//! Causal attention over the KV cache, one rayon task per (token, head) pair (or all on the
//! calling thread when the work is small).
//!
//! Scores are computed in f32 with a running max for a numerically safe softmax; the output is
//! the probability-weighted sum of values, normalized once at the end.

use nibble_core::Result;
use nibble_model::{AttentionShape, BatchLayout};
use rayon::prelude::*;

use crate::CpuTensor;
use crate::kv::CpuKvCache;
use crate::ops::dot;

/// Below this many query-key multiply-adds, attention for a sequence runs on the calling thread.
const SERIAL_WORK: usize = 64 * 1024;

thread_local! {
    /// Scores of one (token, head), reused across calls.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &rayon::ThreadPool,
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    kv: &mut CpuKvCache,
    layer: usize,
    batch: &BatchLayout,
    shape: AttentionShape,
) -> Result<CpuTensor> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
    } = shape;
    let kv_row = num_kv_heads * head_dim;
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = CpuTensor::zeros(q.rows, num_heads * head_dim);

    // Write the new keys/values first: token t of a sequence attends to positions <= its own.
    let mut row0 = 0;
    for s in &batch.seqs {
        kv.check_table(&s.blocks, s.start_pos + s.len)?;
        for t in 0..s.len {
            let at = kv.offset(&s.blocks, s.start_pos + t);
            let src = (row0 + t) * kv_row..(row0 + t + 1) * kv_row;
            kv.k[layer][at..at + kv_row].copy_from_slice(&k.data[src.clone()]);
            kv.v[layer][at..at + kv_row].copy_from_slice(&v.data[src]);
        }
        row0 += s.len;
    }

    let kv = &*kv;
    let mut row0 = 0;
    for s in &batch.seqs {
        let (keys, values) = (&kv.k[layer], &kv.v[layer]);
        let out_rows =
            &mut out.data[row0 * num_heads * head_dim..(row0 + s.len) * num_heads * head_dim];
        let head = |(idx, o): (usize, &mut [f32])| {
            let (t, h) = (idx / num_heads, idx % num_heads);
            let kvh = h / group;
            let qv = &q.data[(row0 + t) * q.cols + h * head_dim..][..head_dim];
            let ctx = s.start_pos + t + 1;
            SCORES.with(|scores| {
                let mut scores = scores.borrow_mut();
                scores.clear();
                scores.extend((0..ctx).map(|p| {
                    dot(
                        qv,
                        &keys[kv.offset(&s.blocks, p) + kvh * head_dim..][..head_dim],
                    ) * scale
                }));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                for (p, &w) in scores.iter().enumerate() {
                    let vv = &values[kv.offset(&s.blocks, p) + kvh * head_dim..][..head_dim];
                    for (a, b) in o.iter_mut().zip(vv) {
                        *a = w.mul_add(*b, *a);
                    }
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|a| *a *= inv);
            });
        };
        // Waking the pool costs more than a few small heads (a decode step at short context), so
        // those run on the calling thread, without handing anything to the pool.
        let work = s.len * num_heads * (s.start_pos + s.len) * head_dim;
        if work < SERIAL_WORK {
            out_rows.chunks_mut(head_dim).enumerate().for_each(head);
        } else {
            pool.install(|| out_rows.par_chunks_mut(head_dim).enumerate().for_each(head));
        }
        row0 += s.len;
    }
    Ok(out)
}

//! Causal attention over the KV cache, one task per (token, head) pair (or all on the
//! calling thread when the work is small).
//!
//! Keys and values are written (quantized, for a quantized pool) before anything is read, and
//! every query reads what the pool holds, dequantized once per sequence per call
//! ([`crate::kv::SeqView`]). A query's scores and output depend only on its own sequence's
//! cache, computed in the same order whatever else is in the batch, so attention is
//! batch-invariant for every KV format.
//!
//! Scores are computed in f32 with a running max for a numerically safe softmax; the output is
//! the probability-weighted sum of values, normalized once at the end.

use nibble_core::{Error, Result};
use nibble_model::{AttentionShape, BatchLayout};

use crate::kv::{CpuKvCache, SeqView};
use crate::ops::dot;
use crate::{CpuTensor, Threads};

/// Below this many query-key multiply-adds, attention for a sequence runs on the calling thread.
const SERIAL_WORK: usize = 64 * 1024;

thread_local! {
    /// Scores of one (token, head), reused across calls.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &Threads,
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
        window,
    } = shape;
    if window == Some(0) {
        return Err(Error::InvalidArgument(
            "a sliding window of 0 tokens".into(),
        ));
    }
    let kv_row = num_kv_heads * head_dim;
    let tokens = batch.num_tokens();
    if num_kv_heads == 0
        || num_heads % num_kv_heads != 0
        || (num_kv_heads, head_dim) != (kv.shape.num_kv_heads, kv.shape.head_dim)
        || (q.rows, q.cols) != (tokens, num_heads * head_dim)
        || (k.rows, k.cols) != (tokens, kv_row)
        || (v.rows, v.cols) != (tokens, kv_row)
    {
        return Err(Error::InvalidArgument(format!(
            "attention {shape:?} over a {:?} pool: q {}x{}, k {}x{}, v {}x{} for {tokens} tokens",
            kv.shape, q.rows, q.cols, k.rows, k.cols, v.rows, v.cols
        )));
    }
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = CpuTensor::zeros(q.rows, num_heads * head_dim);

    // Write the new keys/values first: token t of a sequence attends to positions <= its own.
    let packed_now = kv.write(layer, batch, &k.data, &v.data)?;

    let mut scratch = kv.take_scratch();
    let kv_ref = &*kv;
    let mut row0 = 0;
    for s in &batch.seqs {
        let view = kv_ref.view(layer, s, shape.first_key(s.start_pos), &mut scratch, pool)?;
        let out_rows =
            &mut out.data[row0 * num_heads * head_dim..(row0 + s.len) * num_heads * head_dim];
        let head = |(idx, o): (usize, &mut [f32])| {
            let (t, h) = (idx / num_heads, idx % num_heads);
            let qv = &q.data[(row0 + t) * q.cols + h * head_dim..][..head_dim];
            let off = (h / group) * head_dim;
            let pos = s.start_pos + t;
            attend(&view, qv, shape.first_key(pos), pos, off, kv_row, scale, o);
        };
        // Waking the pool costs more than a few small heads (a decode step at short context), so
        // those run on the calling thread, without handing anything to the pool.
        let keys = window.map_or(s.start_pos + s.len, |w| w.min(s.start_pos + s.len));
        let work = s.len * num_heads * keys * head_dim;
        if work < SERIAL_WORK {
            out_rows.chunks_mut(head_dim).enumerate().for_each(head);
        } else {
            pool.par_chunks_mut(out_rows, head_dim, head);
        }
        row0 += s.len;
    }
    kv.put_scratch(scratch);
    kv.finish_write(layer, &packed_now);
    Ok(out)
}

/// One query head at position `pos` over positions `first..=pos` of its sequence, reading KV
/// head columns `off..off + head_dim` of each row; the result goes to `o`.
#[allow(clippy::too_many_arguments)]
fn attend(
    view: &SeqView,
    qv: &[f32],
    first: usize,
    pos: usize,
    off: usize,
    kv_row: usize,
    scale: f32,
    o: &mut [f32],
) {
    let hd = qv.len();
    let split = view.split(pos);
    let (own_k, own_v) = view.own(pos);
    SCORES.with(|scores| {
        let mut scores = scores.borrow_mut();
        scores.clear();
        scores.extend((first..split).map(|p| dot(qv, view.key(p, off, hd)) * scale));
        scores.extend(
            (split.max(first)..=pos)
                .map(|p| dot(qv, &own_k[(p - split) * kv_row + off..][..hd]) * scale),
        );
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        for (p, &w) in (first..).zip(scores.iter()) {
            let vv = if p < split {
                view.value(p, off, hd)
            } else {
                &own_v[(p - split) * kv_row + off..][..hd]
            };
            for (a, b) in o.iter_mut().zip(vv) {
                *a = w.mul_add(*b, *a);
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|a| *a *= inv);
    });
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;

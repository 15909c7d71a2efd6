//! Row-wise elementwise kernels.

use nibble_model::RopeLayout;

/// 8 independent accumulators let LLVM keep the sum in one AVX register and use FMA.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail = x.mul_add(*y, tail);
    }
    acc.iter().sum::<f32>() + tail
}

pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Rotates every head of one token's row by `pos`.
pub fn rope_row(
    row: &mut [f32],
    head_dim: usize,
    pos: usize,
    inv_freq: &[f32],
    layout: RopeLayout,
) {
    let half = head_dim / 2;
    // Angles in f64: positions reach 10^5 and more, where f32 products lose the phase.
    let cos_sin: Vec<(f32, f32)> = inv_freq
        .iter()
        .map(|&f| {
            let a = pos as f64 * f as f64;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect();
    for head in row.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in cos_sin.iter().enumerate().take(half) {
            let (a, b) = match layout {
                RopeLayout::HalfSplit => (i, i + half),
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

/// PyTorch's `gelu(x, approximate="tanh")` in f32, its constants as PyTorch spells them.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

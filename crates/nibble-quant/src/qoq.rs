//! QServe's QoQ (W4A8, per-channel or progressive per-group weights, INT8 per-token
//! activations).
//!
//! The same pipeline serves W8A8 (per-channel INT8 weights); only the encoding differs. The
//! residual rotation is
//! what matters: the loss of per-token INT8 activations sits at the residual readers' inputs,
//! whose few massive channels set every token's scale, and at down_proj's input, which a
//! rotation of the residual stream does not reach (measured on calibration-half text the
//! calibration does not use, float 7.747: W8A8 RTN 8.055, SmoothQuant 7.834, QoQ 7.798, with
//! down_proj's layers alone left in float 7.750). Tried for W8A8 and not kept: SmoothQuant's
//! strengths 0 to 0.95 for down_proj's input (7.856; they halve the layer's output error on
//! the calibration rows, which the first tokens' massive outputs dominate), and for o_proj's
//! too (7.837); GPTQ instead of the clip search (7.790, within the slice's noise, for two more
//! minutes of Hessians). Not for FP8: e4m3 rounds relative to each value, so an outlier costs
//! its token's other channels little, and on held-out ShareGPT text the same pipeline with FP8
//! weights was worse than FP8 round-to-nearest (perplexity 10.2327 against 10.2039; SmoothQuant
//! 10.1159).
//!
//! The steps, in the order they depend on each other:
//!
//! 1. **Block input rotation.** Norm gains are folded into the readers, then the residual
//!    stream is rotated by a seeded scaled Hadamard matrix ([`crate::rotation`]), so q/k/v and
//!    gate/up read activations whose outlier channels are spread over all channels. The
//!    rotation needs no statistics, so it comes first and calibration runs once, on the
//!    rotated model.
//!    **Value rotation** (beyond QServe, from QuaRot; optional, off by default): each value
//!    head is rotated by a seeded Hadamard matrix of the head size
//!    ([`crate::rotation::rotate_values`]), folded into v_proj's rows and o_proj's input
//!    columns. Attention is linear in the values per head, so the function is kept. With KV4 it
//!    made calibration-half text that the calibration does not use worse on SmolLM2 (W4A8-g64
//!    KV4 perplexity 15.71 without, 15.90 with), so [`QoqSteps::rotate_values`] is off.
//! 2. **SmoothAttention.** `λ_i = max(max|K_i|, max|K_pair(i)|)^s` per KV channel from the
//!    rotary-embedded keys (what the KV cache stores), with `pair` the rotary partner of the
//!    model's layout so `λ` commutes with RoPE; q_proj rows are multiplied by `λ` (for every
//!    query head of the KV group) and k_proj rows divided, biases too. QServe's strength is
//!    `s = 0.5`; with a per-token quantized KV cache `s` is chosen per layer from
//!    [`KEY_ERROR_STRENGTHS`] by the error the stored keys cause in the layer's attention output
//!    on calibration sequences ([`key_error_strengths`]: exact queries and values, the keys
//!    through the cache's own codec after the fold, against exact keys). Skipped for models with
//!    per-head QK norms (Qwen3): the norm of `q λ` is not the norm of `q` times `λ`, so the
//!    scale cannot be folded through it.
//!    **Key pair rotation** (beyond QServe; per-token quantized KV caches only), before `λ`:
//!    SmolLM2's keys carry large near-constant offsets in a few low-frequency rotary pairs
//!    (mean -14 against a spread of 2 in some), of both signs, and a per-token INT4 key spends
//!    its 16 levels on the distance between them. RoPE commutes with any rotation in a pair's
//!    plane, and rotating q and k alike keeps every score, so each pair (of every KV head, and
//!    its query heads) is turned until its mean key points at 225 degrees
//!    ([`rotate_key_pairs`]): every offset then lies on the negative side of both of its dims,
//!    where the asymmetric per-token quantizer's range already reaches. `λ` is then taken from
//!    the rotated keys. This halves the attention-output error of KV4 keys on calibration
//!    sequences the angles were not fitted on. `λ` and the angle together are a complex scale
//!    per rotary pair, the general transform of keys that commutes with RoPE.
//! 3. **Output-module smoothing.** o_proj's and down_proj's inputs are smoothed with migration
//!    strength from {0, 0.05, 0.1, 0.15} (or not at all), chosen per site on the output error
//!    of the quantized layer ([`crate::sim::search_smoothing`]).
//! 4. **Channel reordering** (group quantization only). down_proj's input channels are sorted
//!    by salience `max|x|`, so each group holds channels of similar salience (gate/up rows and
//!    down columns move; free). o_proj's input can only be reordered inside each head, with one
//!    order per KV group folded into v_proj's rows; that changes groups only when the group is
//!    narrower than a head, so it is done only then. The residual-stream readers (q/k/v,
//!    gate/up) are not reordered: after the rotation their channels have near-equal salience,
//!    and a permutation of the rotated stream would have to be shared by every layer.
//! 5. **Weight clipping.** Per output row, the level-0 clip ratio from 1.0 down to 0.70 that
//!    minimizes the layer's output error with INT8 per-token activations. The paper measures
//!    q_proj/k_proj on the block output instead; here every layer uses its own output error
//!    (the attention scores depend on q and k jointly, which a per-layer search cannot see).
//!    **Level-1 step search** (progressive groups only; beyond QServe, which clips level 0
//!    alone): per group, the integer level-1 step is lowered by 0 to [`LEVEL1_SHRINKS`] (its
//!    range clipped at the step) where that lowers the row's output error `dᵀ XᵀX d` on the
//!    INT8 per-token quantized calibration rows ([`level1_shrinks`]): a per-group clip, on
//!    QoQ's integer grid.
//! 6. **Encoding** with `Qoq { group }` (or `Int4Group { group: 0 }` for per-channel W4A8,
//!    `Int8PerChannel` for W8A8).
//!
//! In a mixture-of-experts model the rotation and the norm fold take the router (and Qwen2-MoE's
//! shared-expert gate) with the other readers of the residual stream; output smoothing and the
//! reordering treat each expert's down_proj input as its own site, on the rows the router sent
//! that expert, and the clip and level-1 searches fit each expert's layers to its own rows. An
//! expert routed fewer than [`crate::search::MIN_EXPERT_TOKENS`] calibration tokens is not
//! smoothed and is encoded at clip 1 (RTN).

use nibble_core::{Error, Result};
use nibble_model::RopeLayout;
use nibble_model::config::ModelConfig;
use nibble_precision::kv::{KeyLayout, TokenCodec};
use nibble_precision::{KvFormat, KvSpec, LinearFormat, LinearScheme, PrecisionSpec, WeightCodec};
use rayon::prelude::*;

use crate::capture::AttentionInputs;

use crate::dense::{DenseModel, Mat, Site, SiteKind};
use crate::permute::{HeadPermutation, permute_down_input, sort_desc};
use crate::pipeline::{Method, QuantOptions, QuantizedModel};
use crate::rotation::{Rotation, rotate_residual, rotate_values};
use crate::sim::{
    ActSim, SiteData, Sites, apply_smoothing, calibrate_with, clip_and_encode,
    clip_and_encode_with, clip_grid, matmul_nt, reduce_kv_max, search_smoothing, sq_err,
};
use crate::simulate::Simulated;

/// Mixed into the seed of the value rotation's signs.
const VALUE_ROTATION_SEED: u64 = 0x7654_3210;

/// Output-module migration strengths: near 0, so the scale comes mostly from the weights.
pub const OUTPUT_ALPHAS: [f32; 4] = [0.0, 0.05, 0.1, 0.15];

/// SmoothAttention strengths tried with a quantized KV cache by the whole-model perplexity
/// search ([`AttentionStrength::Perplexity`]): QServe's 0.5 and its neighbours.
pub const SMOOTH_ATTENTION_STRENGTHS: [f32; 5] = [0.4, 0.45, 0.5, 0.55, 0.6];

/// SmoothAttention strengths tried per layer by the key-error search
/// ([`AttentionStrength::KeyError`]); 0 is no smoothing.
pub const KEY_ERROR_STRENGTHS: [f32; 9] = [0.0, 0.25, 0.375, 0.5, 0.5625, 0.625, 0.75, 0.875, 1.0];

/// Calibration sequences whose attention inputs the key pair rotation and the key-error search
/// read (about 1 MB per layer for 256 tokens of the default model). 16 (bench/accuracy.py's
/// whole calibration set) did better than 8 on calibration-half text the calibration does not
/// use (W4A8-g64 KV4 perplexity 14.51 against 14.70).
pub const KEY_ERROR_SEQUENCES: usize = 16;

/// How SmoothAttention's strength is chosen (with a 16-bit KV cache it is always QServe's 0.5:
/// the fold then changes nothing that is rounded).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionStrength {
    /// The same strength in every layer.
    Fixed(f32),
    /// One strength for the model, of [`SMOOTH_ATTENTION_STRENGTHS`], by calibration perplexity
    /// with the quantized cache ([`smooth_attention_strength`]).
    Perplexity,
    /// Per layer, the strength of [`KEY_ERROR_STRENGTHS`] whose stored keys change the layer's
    /// attention output least on calibration sequences ([`key_error_strengths`]).
    KeyError,
}

/// SmoothAttention's `λ` for one layer from its channel-wise max |K| (`kv_dim` values), at
/// QServe's strength 0.5.
pub fn smooth_attention_scale(c: &ModelConfig, key_absmax: &[f32]) -> Vec<f32> {
    smooth_attention_scale_with(c, key_absmax, 0.5)
}

/// `λ = max|K|^strength` per rotary pair.
pub fn smooth_attention_scale_with(c: &ModelConfig, key_absmax: &[f32], strength: f32) -> Vec<f32> {
    let hd = c.head_dim;
    (0..c.kv_dim())
        .map(|j| {
            let (h, d) = (j / hd, j % hd);
            let pair = match c.rope_layout {
                RopeLayout::HalfSplit => (d + hd / 2) % hd,
                RopeLayout::Interleaved => d ^ 1,
            };
            let m = key_absmax[j].max(key_absmax[h * hd + pair]);
            let l = m.powf(strength);
            // A key channel that never fired has nothing to smooth; the clamp keeps q and k
            // rows away from f16's ends whatever the statistics.
            if l.is_finite() && l > 0.0 {
                l.clamp(1e-3, 1e3)
            } else {
                1.0
            }
        })
        .collect()
}

/// Whether SmoothAttention can be folded into this model (no per-head QK norms).
pub fn smooth_attention_applies(model: &DenseModel) -> bool {
    model
        .layers
        .iter()
        .all(|l| l.q_norm.is_none() && l.k_norm.is_none())
}

/// Folds SmoothAttention into every layer: q_proj rows (and bias) times `λ`, k_proj rows (and
/// bias) divided by `λ`. `key_absmax[layer]` is that layer's channel-wise max |K| after RoPE.
pub fn smooth_attention(model: &mut DenseModel, key_absmax: &[Vec<f32>]) -> Result<()> {
    smooth_attention_with(model, key_absmax, 0.5)
}

/// [`smooth_attention`] at another strength.
pub fn smooth_attention_with(
    model: &mut DenseModel,
    key_absmax: &[Vec<f32>],
    strength: f32,
) -> Result<()> {
    let strengths = vec![vec![strength; model.config.num_kv_heads]; model.layers.len()];
    smooth_attention_layers(model, key_absmax, &strengths)
}

/// [`smooth_attention`] with strength `strengths[layer][kv_head]` for each layer and KV head.
pub fn smooth_attention_layers(
    model: &mut DenseModel,
    key_absmax: &[Vec<f32>],
    strengths: &[Vec<f32>],
) -> Result<()> {
    if !smooth_attention_applies(model) {
        return Err(Error::InvalidArgument(
            "SmoothAttention cannot be folded through per-head QK norms".into(),
        ));
    }
    if key_absmax.len() != model.layers.len() || strengths.len() != model.layers.len() {
        return Err(Error::InvalidArgument(format!(
            "key statistics for {} layers and {} strengths, the model has {} layers",
            key_absmax.len(),
            strengths.len(),
            model.layers.len()
        )));
    }
    let c = model.config.clone();
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    for ((l, kmax), strength) in model.layers.iter_mut().zip(key_absmax).zip(strengths) {
        if kmax.len() != c.kv_dim() || strength.len() != c.num_kv_heads {
            return Err(Error::InvalidArgument(format!(
                "key statistics of {} channels and {} strengths, the model's keys have {} \
                 channels in {} heads",
                kmax.len(),
                strength.len(),
                c.kv_dim(),
                c.num_kv_heads
            )));
        }
        let lambda: Vec<f32> = (0..c.num_kv_heads)
            .flat_map(|h| {
                let one = smooth_attention_scale_with(&c, kmax, strength[h]);
                one[h * hd..(h + 1) * hd].to_vec()
            })
            .collect();
        let q_scale: Vec<f32> = (0..c.q_dim())
            .map(|j| lambda[(j / hd / group) * hd + j % hd])
            .collect();
        let k_scale: Vec<f32> = lambda.iter().map(|v| 1.0 / v).collect();
        l.q.scale_rows(&q_scale);
        l.k.scale_rows(&k_scale);
        if let Some(b) = &mut l.q_bias {
            b.iter_mut().zip(&q_scale).for_each(|(b, s)| *b *= s);
        }
        if let Some(b) = &mut l.k_bias {
            b.iter_mut().zip(&k_scale).for_each(|(b, s)| *b *= s);
        }
    }
    Ok(())
}

/// The SmoothAttention strength for a model whose KV cache is stored as `kv`: QServe's 0.5 for
/// unquantized keys (the fold scales queries and keys only, so it then changes nothing that is
/// rounded), otherwise the strength of
/// [`SMOOTH_ATTENTION_STRENGTHS`] whose float model, run with the quantized cache, has the lowest
/// calibration perplexity. The float weights are a faithful stand-in: the fold scales q_proj and
/// k_proj rows, and every weight codec QoQ uses scales per output row, so the weights' rounding
/// does not depend on the strength; only the keys the cache stores do.
pub fn smooth_attention_strength(
    model: &DenseModel,
    key_absmax: &[Vec<f32>],
    kv: KvSpec,
    calibration: &[Vec<u32>],
    threads: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<f32> {
    if !kv.k.is_quantized() {
        return Ok(0.5);
    }
    let mut best = (f64::INFINITY, 0.5);
    for (i, &strength) in SMOOTH_ATTENTION_STRENGTHS.iter().enumerate() {
        let mut sim = Simulated {
            kv,
            ..Simulated::float(model)
        };
        smooth_attention_with(&mut sim.dense, key_absmax, strength)?;
        let (nll, _) = sim.mean_nll(calibration, threads, &mut |_, _| {})?;
        if nll < best.0 {
            best = (nll, strength);
        }
        progress(
            "qoq: smooth attention strength",
            i + 1,
            SMOOTH_ATTENTION_STRENGTHS.len(),
        );
    }
    Ok(best.1)
}

/// The two dims of rotary pair `p` of a head (`p < head_dim / 2`) in the model's layout.
pub fn rotary_pair(layout: RopeLayout, head_dim: usize, p: usize) -> (usize, usize) {
    match layout {
        RopeLayout::HalfSplit => (p, p + head_dim / 2),
        RopeLayout::Interleaved => (2 * p, 2 * p + 1),
    }
}

/// Per KV head and rotary pair (`kv_dim / 2` values, head-major), the angle that turns the
/// pair's mean rotary-embedded key over `inputs` to 225 degrees: both dims of every pair's key
/// offset negative and equal, so the offsets stop stretching a token's range between dims of
/// opposite sign (see [`rotate_key_pairs`]).
pub fn key_pair_angles(c: &ModelConfig, inputs: &[AttentionInputs]) -> Vec<f32> {
    let (hd, half) = (c.head_dim, c.head_dim / 2);
    let mut sum = vec![(0f64, 0f64); c.kv_dim() / 2];
    for a in inputs {
        for r in 0..a.k.rows {
            let row = a.k.row(r);
            for (i, s) in sum.iter_mut().enumerate() {
                let (x, y) = rotary_pair(c.rope_layout, hd, i % half);
                let h = i / half * hd;
                s.0 += row[h + x] as f64;
                s.1 += row[h + y] as f64;
            }
        }
    }
    sum.iter()
        .map(|&(x, y)| {
            if x == 0.0 && y == 0.0 {
                0.0
            } else {
                (-3.0 * std::f64::consts::FRAC_PI_4 - y.atan2(x)) as f32
            }
        })
        .collect()
}

/// Rotates `x` (rows of heads of `head_dim`; head `h` uses the angles of KV head
/// `h / heads_per_angle_set`) by `angles` in every rotary pair.
fn rotate_pairs_in(
    layout: RopeLayout,
    head_dim: usize,
    rows: &mut [f32],
    angles: &[f32],
    heads_per_set: usize,
) {
    let half = head_dim / 2;
    for (h, head) in rows.chunks_exact_mut(head_dim).enumerate() {
        let set = &angles[(h / heads_per_set) * half..][..half];
        for (p, &a) in set.iter().enumerate() {
            let (i, j) = rotary_pair(layout, head_dim, p);
            let (sin, cos) = a.sin_cos();
            let (x, y) = (head[i], head[j]);
            head[i] = x * cos - y * sin;
            head[j] = x * sin + y * cos;
        }
    }
}

/// Rotates every rotary pair of the keys, and of the queries of the KV group, by the same angle
/// (`angles` from [`key_pair_angles`]), folded into k_proj's and q_proj's rows (and biases).
/// Rotations in a rotary pair's plane commute with RoPE, and rotating q and k alike keeps every
/// score: the layer's function is unchanged. It is SmoothAttention's `λ` made complex: `λ` scales
/// each pair, the angle turns it (beyond QServe, which only scales). Like `λ`, the fold cannot pass
/// through per-head QK norms.
pub fn rotate_key_pairs(model: &mut DenseModel, layer: usize, angles: &[f32]) -> Result<()> {
    let c = model.config.clone();
    if angles.len() != c.kv_dim() / 2 {
        return Err(Error::InvalidArgument(format!(
            "{} key pair angles, the model's keys have {} pairs",
            angles.len(),
            c.kv_dim() / 2
        )));
    }
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    let l = model
        .layers
        .get_mut(layer)
        .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
    if l.q_norm.is_some() || l.k_norm.is_some() {
        return Err(Error::InvalidArgument(
            "key pair rotation cannot be folded through per-head QK norms".into(),
        ));
    }
    // Rotating a projection's output rows: row i of the rotated weight is the combination of
    // rows i and j that the rotation gives output i. Done column by column on the transpose.
    let rotate_rows = |w: &mut Mat, heads_per_set: usize| {
        let mut t = w.transpose();
        for row in t.data.chunks_exact_mut(t.cols) {
            rotate_pairs_in(c.rope_layout, hd, row, angles, heads_per_set);
        }
        *w = t.transpose();
    };
    rotate_rows(&mut l.k, 1);
    rotate_rows(&mut l.q, group);
    if let Some(b) = &mut l.k_bias {
        rotate_pairs_in(c.rope_layout, hd, b, angles, 1);
    }
    if let Some(b) = &mut l.q_bias {
        rotate_pairs_in(c.rope_layout, hd, b, angles, group);
    }
    Ok(())
}

/// `inputs` as the model sees them after [`rotate_key_pairs`] with `angles`.
pub fn rotate_attention_inputs(
    c: &ModelConfig,
    inputs: &[AttentionInputs],
    angles: &[f32],
) -> Vec<AttentionInputs> {
    let group = c.num_heads / c.num_kv_heads;
    inputs
        .iter()
        .map(|a| {
            let (mut q, mut k) = (a.q.clone(), a.k.clone());
            for row in q.data.chunks_exact_mut(q.cols) {
                rotate_pairs_in(c.rope_layout, c.head_dim, row, angles, group);
            }
            for row in k.data.chunks_exact_mut(k.cols) {
                rotate_pairs_in(c.rope_layout, c.head_dim, row, angles, 1);
            }
            AttentionInputs {
                q,
                k,
                v: a.v.clone(),
            }
        })
        .collect()
}

/// Channel-wise max |K| over `inputs`' keys.
pub fn key_absmax_of(inputs: &[AttentionInputs]) -> Vec<f32> {
    let mut m = vec![0f32; inputs.first().map_or(0, |a| a.k.cols)];
    for a in inputs {
        for row in a.k.data.chunks_exact(a.k.cols) {
            m.iter_mut().zip(row).for_each(|(m, v)| *m = m.max(v.abs()));
        }
    }
    m
}

/// Per layer, the strength of [`KEY_ERROR_STRENGTHS`] with the least [`key_error`] on the
/// layer's recorded attention inputs (`attention[layer]`, from the model before the fold), for
/// keys stored as the key format `kv` (a [`KvSpec`]'s `k`) says, repeated for each KV head (the shape
/// [`smooth_attention_layers`] takes). An unquantized or channel-wise key cache gets QServe's 0.5
/// everywhere (a channel-wise scale is undone by channel-wise quantization).
///
/// The fold multiplies q by `λ` and divides k by `λ` after RoPE, so the layer's scores become
/// `q · (λ ∘ Q(k / λ))`: the search replays exactly that against the exact `q · k`, through the
/// softmax and the values, which a perplexity over a few thousand tokens measures only through
/// noise (its whole-model choice did not carry over to held-out text). One strength per KV head
/// (each head's error is separate) did worse on calibration-half text the calibration does not
/// use (perplexity 14.79 against 14.70 per layer), so the layer shares one.
pub fn key_error_strengths(
    c: &ModelConfig,
    key_absmax: &[Vec<f32>],
    attention: &[Vec<AttentionInputs>],
    kv: KvFormat,
) -> Result<Vec<Vec<f32>>> {
    let KeyLayout::PerToken(codec) = kv.keys() else {
        return Ok(vec![vec![0.5; c.num_kv_heads]; c.num_layers]);
    };
    if attention.len() != c.num_layers || key_absmax.len() != c.num_layers {
        return Err(Error::InvalidArgument(format!(
            "attention inputs of {} layers and key statistics of {}, the model has {}",
            attention.len(),
            key_absmax.len(),
            c.num_layers
        )));
    }
    attention
        .iter()
        .zip(key_absmax)
        .map(|(inputs, kmax)| {
            let mut best = (f64::INFINITY, 0.5f32);
            for &strength in &KEY_ERROR_STRENGTHS {
                let lambda = smooth_attention_scale_with(c, kmax, strength);
                let e = key_error(c, inputs, &lambda, codec)?;
                // Strictly better only: ties keep the weaker strength.
                if e < best.0 {
                    best = (e, strength);
                }
            }
            Ok(vec![best.1; c.num_kv_heads])
        })
        .collect()
}

/// Summed squared difference, over `inputs`' sequences, query heads and tokens, between one
/// layer's causal attention output with its keys as a per-token `codec` cache stores them after
/// SmoothAttention's `λ` (`kv_dim` factors) and with exact keys. Values are exact in both.
pub fn key_error(
    c: &ModelConfig,
    inputs: &[AttentionInputs],
    lambda: &[f32],
    codec: TokenCodec,
) -> Result<f64> {
    Ok(key_error_per_head(c, inputs, lambda, codec)?.iter().sum())
}

/// [`key_error`] per KV head (the query heads of its group): a KV head's keys reach only those.
pub fn key_error_per_head(
    c: &ModelConfig,
    inputs: &[AttentionInputs],
    lambda: &[f32],
    codec: TokenCodec,
) -> Result<Vec<f64>> {
    let (hd, kvh) = (c.head_dim, c.num_kv_heads);
    let group = c.num_heads / kvh;
    let mut total = vec![0f64; kvh];
    for a in inputs {
        let t = a.k.rows;
        if a.k.cols != c.kv_dim() || a.q.cols != c.q_dim() || a.v.cols != c.kv_dim() {
            return Err(Error::InvalidArgument(format!(
                "attention inputs of {}/{}/{} channels for a model of q {} and kv {}",
                a.q.cols,
                a.k.cols,
                a.v.cols,
                c.q_dim(),
                c.kv_dim()
            )));
        }
        // The keys as attention reads them back, in the unsmoothed basis: λ ∘ Q(k / λ).
        let mut kq = a.k.clone();
        let mut rec = vec![0u8; codec.record_bytes(hd)];
        let mut buf = vec![0f32; hd];
        for row in kq.data.chunks_exact_mut(c.kv_dim()) {
            for (h, head) in row.chunks_exact_mut(hd).enumerate() {
                let l = &lambda[h * hd..(h + 1) * hd];
                buf.iter_mut()
                    .zip(head.iter())
                    .zip(l)
                    .for_each(|((b, &k), &l)| *b = k / l);
                codec.quantize(&buf, &mut rec)?;
                codec.dequantize(&rec, &mut buf);
                head.iter_mut()
                    .zip(&buf)
                    .zip(l)
                    .for_each(|((k, &b), &l)| *k = b * l);
            }
        }
        let cols = |m: &Mat, from: usize| {
            let mut out = Mat::new(t, hd, vec![0f32; t * hd]);
            for r in 0..t {
                out.data[r * hd..(r + 1) * hd].copy_from_slice(&m.row(r)[from..from + hd]);
            }
            out
        };
        let scale = 1.0 / (hd as f32).sqrt();
        for (g, total) in total.iter_mut().enumerate() {
            let (k, kq, v) = (cols(&a.k, g * hd), cols(&kq, g * hd), cols(&a.v, g * hd));
            let vt = v.transpose();
            for h in g * group..(g + 1) * group {
                let q = cols(&a.q, h * hd);
                let exact = matmul_nt(&causal_softmax(matmul_nt(&q, &k), scale), &vt);
                let approx = matmul_nt(&causal_softmax(matmul_nt(&q, &kq), scale), &vt);
                *total += sq_err(&exact, &approx);
            }
        }
    }
    Ok(total)
}

/// Row `i` of the `[t, t]` scores: softmax of `scale * s[i, 0..=i]`, zero after `i`.
fn causal_softmax(mut s: Mat, scale: f32) -> Mat {
    for (i, row) in s.data.chunks_exact_mut(s.cols).enumerate() {
        let (live, masked) = row.split_at_mut(i + 1);
        masked.fill(0.0);
        let max = live
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        let mut sum = 0f32;
        for v in live.iter_mut() {
            *v = (*v * scale - max).exp();
            sum += *v;
        }
        live.iter_mut().for_each(|v| *v /= sum);
    }
    s
}

/// Sorts down_proj's input channels of `layer` by salience (descending), in the model and in
/// the site's calibration view.
pub fn reorder_down_input(model: &mut DenseModel, site: Site, data: &mut SiteData) -> Result<()> {
    let perm = sort_desc(&data.absmax);
    permute_down_input(model, site.layer, site.expert, &perm)?;
    data.permute(&perm);
    Ok(())
}

/// Sorts the dims of each value head by salience (the max over the query heads of its KV
/// group), folded into v_proj rows and o_proj columns.
pub fn reorder_o_input(model: &mut DenseModel, layer: usize, data: &mut SiteData) -> Result<()> {
    let hd = model.config.head_dim;
    let kv = reduce_kv_max(model, &data.absmax);
    let mut hp = HeadPermutation::identity(model);
    hp.within = kv.chunks_exact(hd).map(sort_desc).collect();
    hp.apply(model, layer)?;
    data.permute(&hp.o_input(model));
    Ok(())
}

/// The most a group's level-1 step is lowered by the per-group search ([`level1_shrinks`]).
/// On calibration-half text the calibration does not use (W4A8-g64 KV4, 32 x 256 calibration
/// tokens, 8 x 256 evaluation tokens: float 7.747, RTN 13.382, QoQ without the search 10.483),
/// at most 1 gave 10.164 and at most 3 gave 10.390 (the wider search fits the 256 sampled
/// rows more than the text); a per-group criterion without the cross-group terms, 11.250.
pub const LEVEL1_SHRINKS: u8 = 1;

/// Per output row of `w` (encoded with `codec`, a `Qoq` codec, at level-0 clip `clips[r]`), per
/// group, the amount in `0..=max_shrink` to lower the level-1 step by
/// ([`WeightCodec::quantize_row_qoq`]), chosen to lower `dᵀ XᵀX d`, the error the row's weight
/// error `d` puts into its output on the rows of `x`. The whole row's error, cross-group terms
/// included: after the residual rotation every channel carries a share of the attention sink's
/// massive activation, so the groups' errors add up coherently, and a per-group criterion (AWQ's)
/// clipped every group a little and made the model far worse. Coordinate descent from no shrink,
/// group by group, [`SHRINK_PASSES`] passes, a change only where it lowers the error.
pub fn level1_shrinks(
    w: &Mat,
    x: &Mat,
    codec: WeightCodec,
    clips: &[f32],
    max_shrink: u8,
) -> Result<Vec<Vec<u8>>> {
    let WeightCodec::Qoq { .. } = codec else {
        return Err(Error::InvalidArgument(format!(
            "level-1 shrinks are for QoQ's progressive groups, not {codec}"
        )));
    };
    let cols = w.cols;
    codec.check_cols(cols)?;
    if x.cols != cols || clips.len() != w.rows {
        return Err(Error::InvalidArgument(format!(
            "level-1 shrinks: {} input columns and {} clips for a {}x{cols} weight",
            x.cols,
            clips.len(),
            w.rows
        )));
    }
    let g = codec.groups(cols);
    let gl = cols / g;
    if max_shrink == 0 {
        return Ok(vec![vec![0; g]; w.rows]);
    }
    // The Gram matrix XᵀX, row by row.
    let gram: Vec<f64> = {
        let mut m = vec![0f64; cols * cols];
        m.par_chunks_mut(cols).enumerate().for_each(|(a, out)| {
            for r in 0..x.rows {
                let row = x.row(r);
                let xa = row[a] as f64;
                if xa != 0.0 {
                    for (o, &xb) in out.iter_mut().zip(row) {
                        *o += xa * xb as f64;
                    }
                }
            }
        });
        m
    };
    let rb = codec.row_bytes(cols)?;
    (0..w.rows)
        .into_par_iter()
        .map(|r| {
            let row = w.row(r);
            // The row's weight error under each uniform shrink: groups are encoded
            // independently, so group `g` of candidate `c` is that group at shrink `c`.
            let mut cand = Vec::with_capacity(max_shrink as usize + 1);
            let (mut bytes, mut deq) = (vec![0u8; rb], vec![0f32; cols]);
            for shrink in 0..=max_shrink {
                codec.quantize_row_qoq(row, clips[r], &vec![shrink; g], &mut bytes)?;
                codec.dequantize(&bytes, cols, &mut deq)?;
                let d: Vec<f64> = row.iter().zip(&deq).map(|(w, q)| (w - q) as f64).collect();
                cand.push(d);
            }
            let mut d = cand[0].clone();
            // gd = XᵀX d, kept up to date as groups change.
            let mut gd: Vec<f64> = gram
                .chunks_exact(cols)
                .map(|m| m.iter().zip(&d).map(|(m, d)| m * d).sum())
                .collect();
            let mut choice = vec![0u8; g];
            let mut delta = vec![0f64; gl];
            for _ in 0..SHRINK_PASSES {
                let mut changed = false;
                for gi in 0..g {
                    let span = gi * gl..(gi + 1) * gl;
                    let mut best = (0f64, choice[gi]);
                    for (c, dc) in cand.iter().enumerate() {
                        if c as u8 == choice[gi] {
                            continue;
                        }
                        for (o, (a, b)) in delta
                            .iter_mut()
                            .zip(dc[span.clone()].iter().zip(&d[span.clone()]))
                        {
                            *o = a - b;
                        }
                        // e(d + δ) - e(d) = 2 δᵀ(XᵀX d) + δᵀ XᵀX δ on the group's block.
                        let mut change: f64 = 2.0
                            * delta
                                .iter()
                                .zip(&gd[span.clone()])
                                .map(|(a, b)| a * b)
                                .sum::<f64>();
                        for (i, &di) in delta.iter().enumerate() {
                            if di != 0.0 {
                                let m = &gram[(gi * gl + i) * cols + gi * gl..][..gl];
                                change +=
                                    di * m.iter().zip(&delta).map(|(m, d)| m * d).sum::<f64>();
                            }
                        }
                        if change < best.0 {
                            best = (change, c as u8);
                        }
                    }
                    if best.1 != choice[gi] {
                        let dc = &cand[best.1 as usize];
                        for (i, j) in span.clone().enumerate() {
                            delta[i] = dc[j] - d[j];
                            d[j] = dc[j];
                        }
                        // XᵀX is symmetric: column j of it is row j.
                        for (i, &di) in delta.iter().enumerate() {
                            if di != 0.0 {
                                let m = &gram[(gi * gl + i) * cols..][..cols];
                                gd.iter_mut().zip(m).for_each(|(o, m)| *o += di * m);
                            }
                        }
                        choice[gi] = best.1;
                        changed = true;
                    }
                }
                if !changed {
                    break;
                }
            }
            Ok(choice)
        })
        .collect()
}

/// Coordinate-descent passes over a row's groups in [`level1_shrinks`].
pub const SHRINK_PASSES: usize = 2;

/// Encodes weight `w` in `format` (a `Qoq` codec) at its rows' level-0 `clips`, with each
/// group's level-1 step from [`level1_shrinks`] when `max_shrink > 0`; `xq` is the layer's
/// quantized calibration input.
fn encode_shrunk(
    w: &Mat,
    xq: &Mat,
    format: LinearFormat,
    clips: &[f32],
    max_shrink: u8,
) -> Result<Vec<u8>> {
    let shrinks = if max_shrink > 0 {
        level1_shrinks(w, xq, format.codec, clips, max_shrink)?
    } else {
        vec![Vec::new(); w.rows]
    };
    let rb = format.row_bytes(w.cols)?;
    let mut bytes = vec![0u8; rb * w.rows];
    bytes
        .par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, o)| {
            format
                .codec
                .quantize_row_qoq(w.row(r), clips[r], &shrinks[r], o)
        })?;
    Ok(bytes)
}

/// Which of QoQ's steps run (all of them for the method; fewer to measure what each brings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QoqSteps {
    pub rotate: bool,
    /// The per-head value rotation (an addition to QServe, off by default, see the module
    /// documentation); applied only with a quantized KV cache.
    pub rotate_values: bool,
    pub smooth_attention: bool,
    /// How SmoothAttention's strength is chosen with a quantized KV cache.
    pub attention_strength: AttentionStrength,
    /// Key pair rotation ([`rotate_key_pairs`]) before SmoothAttention, with a per-token
    /// quantized KV cache only.
    pub rotate_key_pairs: bool,
    /// Calibration sequences whose attention inputs the key pair rotation and the key-error
    /// search read.
    pub attention_sequences: usize,
    pub smooth_outputs: bool,
    pub reorder: bool,
    pub clip: bool,
    /// The most the per-group level-1 step search lowers a step (0: no search).
    pub level1_shrinks: u8,
}

impl Default for QoqSteps {
    fn default() -> Self {
        QoqSteps {
            rotate: true,
            rotate_values: false,
            smooth_attention: true,
            attention_strength: AttentionStrength::KeyError,
            rotate_key_pairs: true,
            attention_sequences: KEY_ERROR_SEQUENCES,
            smooth_outputs: true,
            reorder: true,
            clip: true,
            level1_shrinks: LEVEL1_SHRINKS,
        }
    }
}

pub fn quantize(
    model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    quantize_with(
        model,
        spec,
        calibration,
        opts,
        QoqSteps::default(),
        progress,
    )
}

/// QoQ with only `steps` enabled.
pub fn quantize_with(
    mut model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    steps: QoqSteps,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    let group = match spec.linear {
        LinearScheme::W4A8 { group } => group,
        LinearScheme::W8A8 => 0,
        other => {
            return Err(Error::InvalidArgument(format!(
                "QoQ quantizes to w4a8, w4a8-gN or w8a8, not {other}"
            )));
        }
    };
    let format = spec
        .linear
        .linear_format(0)
        .expect("w4a8 is a quantized scheme");
    let act = ActSim::of(format.act);

    if steps.rotate {
        model.fold_norms()?;
        let rot = Rotation::new(model.config.hidden_size, opts.seed)?;
        rotate_residual(&mut model, &rot, &mut |d, t| progress("qoq: rotate", d, t))?;
    }

    // For quantized values only (when asked for): with 16-bit values it would only reshape
    // o_proj's input.
    if steps.rotate_values && spec.kv.v.is_quantized() {
        // Its own seed: the value rotation has nothing to do with the residual one.
        let rot = Rotation::new(model.config.head_dim, opts.seed ^ VALUE_ROTATION_SEED)?;
        rotate_values(&mut model, &rot)?;
    }
    // The attention sink's rows are kept in the samples: without them the searches tune the
    // weights for ordinary tokens at the sink's expense (held-out perplexity of w4a8-g64 QoQ
    // 9.52 with the position-walking samples alone, 8.92 with every first token added; w4a8
    // 10.32 vs 9.76). LiquidQuant and FMPQ do better without (8.66 vs 9.32, 11.51 vs 14.61
    // against samples that held the first tokens).
    let smooth_attn = steps.smooth_attention && smooth_attention_applies(&model);
    let per_token_keys = matches!(spec.kv.keys(), KeyLayout::PerToken(_));
    let rotate_pairs = smooth_attn && steps.rotate_key_pairs && per_token_keys;
    let key_search =
        smooth_attn && steps.attention_strength == AttentionStrength::KeyError && per_token_keys;
    let (mut cal, mut sites) = calibrate_with(
        &model,
        calibration,
        opts.threads,
        true,
        if key_search || rotate_pairs {
            steps.attention_sequences
        } else {
            0
        },
        &mut |d, t| progress("qoq: calibrate", d, t),
    )?;

    if rotate_pairs {
        let c = model.config.clone();
        for layer in 0..model.layers.len() {
            let angles = key_pair_angles(&c, &cal.attention[layer]);
            rotate_key_pairs(&mut model, layer, &angles)?;
            cal.attention[layer] = rotate_attention_inputs(&c, &cal.attention[layer], &angles);
            // The rotation moves magnitude between the dims of a pair: the key maxima that `λ`
            // is made of are those of the rotated keys, over the sequences kept whole.
            cal.key_absmax[layer] = key_absmax_of(&cal.attention[layer]);
        }
    }
    progress("qoq: rotate key pairs", 1, 1);

    if smooth_attn {
        let (layers, kvh) = (model.layers.len(), model.config.num_kv_heads);
        let strengths = match steps.attention_strength {
            _ if !spec.kv.k.is_quantized() => vec![vec![0.5; kvh]; layers],
            AttentionStrength::Fixed(s) => vec![vec![s; kvh]; layers],
            AttentionStrength::Perplexity => {
                let s = smooth_attention_strength(
                    &model,
                    &cal.key_absmax,
                    spec.kv,
                    calibration,
                    opts.threads,
                    progress,
                )?;
                vec![vec![s; kvh]; layers]
            }
            AttentionStrength::KeyError => {
                key_error_strengths(&model.config, &cal.key_absmax, &cal.attention, spec.kv.k)?
            }
        };
        smooth_attention_layers(&mut model, &cal.key_absmax, &strengths)?;
    }
    progress("qoq: smooth attention", 1, 1);

    let layers = model.layers.len();
    // In a sparse block each expert's down_proj input is its own site; an expert calibration
    // (nearly) never routed to keeps its input as it is (and is RTN at encoding).
    let calibrated = |site: &Site, sites: &Sites| {
        site.expert.is_none()
            || sites
                .get(site)
                .is_some_and(|d| d.tokens >= crate::search::MIN_EXPERT_TOKENS)
    };
    let output_sites: Vec<Site> = model
        .sites()
        .into_iter()
        .filter(|s| matches!(s.kind, SiteKind::OIn | SiteKind::DownIn))
        .collect();
    for site in output_sites.iter().filter(|_| steps.smooth_outputs) {
        if !calibrated(site, &sites) {
            continue;
        }
        let data = sites.get_mut(site).ok_or_else(|| {
            Error::InvalidArgument(format!("calibration recorded no {site:?} input"))
        })?;
        let choice = search_smoothing(&model, *site, data, &OUTPUT_ALPHAS, format, act)?;
        if choice.alpha.is_some() {
            apply_smoothing(&mut model, *site, data, &choice.scale)?;
        }
        progress("qoq: smooth outputs", site.layer + 1, layers);
    }

    if group > 0 && steps.reorder {
        for layer in 0..layers {
            for site in output_sites
                .iter()
                .filter(|s| s.layer == layer && s.kind == SiteKind::DownIn)
            {
                // Even a starved expert's channels are reordered by its few rows' maxima: the
                // permutation is exact whatever it is. One the router never chose has no rows.
                match sites.get_mut(site) {
                    Some(data) => reorder_down_input(&mut model, *site, data)?,
                    None if site.expert.is_some() => {}
                    None => {
                        return Err(Error::InvalidArgument(format!(
                            "calibration recorded no {site:?} input"
                        )));
                    }
                }
            }
            if (group as usize) < model.config.head_dim {
                reorder_o_input(
                    &mut model,
                    layer,
                    site_mut(&mut sites, layer, SiteKind::OIn)?,
                )?;
            }
            progress("qoq: reorder", layer + 1, layers);
        }
    }

    let grid = if steps.clip { clip_grid() } else { vec![1.0] };
    let shrink = steps.level1_shrinks;
    let linears = if matches!(format.codec, WeightCodec::Qoq { .. }) {
        clip_and_encode_with(
            &model,
            &sites,
            &|_| format,
            &grid,
            &move |w, xq, format, clips| encode_shrunk(w, xq, format, clips, shrink),
            &mut |d, t| progress("qoq: clip and encode", d, t),
        )?
    } else {
        clip_and_encode(&model, &sites, &|_| format, &grid, &mut |d, t| {
            progress("qoq: clip and encode", d, t)
        })?
    };
    Ok(QuantizedModel {
        spec,
        method: Method::Qoq,
        dense: model,
        linears,
    })
}

/// The calibration view of one site, or an error naming it.
pub(crate) fn site_mut(sites: &mut Sites, layer: usize, site: SiteKind) -> Result<&mut SiteData> {
    sites.get_mut(&Site::dense(layer, site)).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "calibration recorded no {site:?} input for layer {layer}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn heavy(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Mat {
        let data = (0..rows * cols)
            .map(|_| {
                let v: f32 = rng.random_range(-1.0..1.0);
                if rng.random_bool(0.02) { v * 6.0 } else { v }
            })
            .collect();
        Mat::new(rows, cols, data)
    }

    fn encoded_error(w: &Mat, x: &Mat, codec: WeightCodec, shrinks: &[Vec<u8>]) -> f64 {
        let rb = codec.row_bytes(w.cols).unwrap();
        let mut deq = vec![0f32; w.rows * w.cols];
        for r in 0..w.rows {
            let mut bytes = vec![0u8; rb];
            codec
                .quantize_row_qoq(w.row(r), 1.0, &shrinks[r], &mut bytes)
                .unwrap();
            codec
                .dequantize(&bytes, w.cols, &mut deq[r * w.cols..(r + 1) * w.cols])
                .unwrap();
        }
        let wq = Mat::new(w.rows, w.cols, deq);
        sq_err(&matmul_nt(x, &wq), &matmul_nt(x, w))
    }

    /// The per-group level-1 step search lowers the layer's output error against plain QoQ (a
    /// shrink of 0 is a candidate for every group) and does lower some steps; it is refused for
    /// codecs without progressive groups.
    #[test]
    fn level1_shrinks_lower_the_output_error() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (w, x) = (heavy(&mut rng, 32, 128), heavy(&mut rng, 256, 128));
        let codec = WeightCodec::Qoq { group: 32 };
        let clips = vec![1.0; w.rows];
        let shrinks = level1_shrinks(&w, &x, codec, &clips, LEVEL1_SHRINKS).unwrap();
        assert!(shrinks.iter().all(|r| r.len() == 4));
        assert!(shrinks.iter().flatten().all(|&s| s <= LEVEL1_SHRINKS));
        assert!(shrinks.iter().flatten().any(|&s| s > 0), "{shrinks:?}");
        let plain = encoded_error(&w, &x, codec, &vec![vec![0; 4]; w.rows]);
        let searched = encoded_error(&w, &x, codec, &shrinks);
        assert!(searched < 0.97 * plain, "{searched} vs {plain}");
        // Rows that share one massive component in every channel (the attention sink after the
        // residual rotation): the groups' errors add up coherently, and the whole-row search
        // still never raises the error.
        let mut xs = x.clone();
        for r in (0..xs.rows).step_by(16) {
            xs.data[r * 128..(r + 1) * 128]
                .iter_mut()
                .for_each(|v| *v += 40.0);
        }
        let sink = level1_shrinks(&w, &xs, codec, &clips, LEVEL1_SHRINKS).unwrap();
        let plain = encoded_error(&w, &xs, codec, &vec![vec![0; 4]; w.rows]);
        assert!(encoded_error(&w, &xs, codec, &sink) <= plain);
        let none = level1_shrinks(&w, &x, codec, &clips, 0).unwrap();
        assert!(none.iter().flatten().all(|&s| s == 0));
        let int4 = WeightCodec::Int4Group { group: 32 };
        assert!(level1_shrinks(&w, &x, int4, &clips, 3).is_err());
        assert!(level1_shrinks(&w, &x, codec, &clips[1..], 3).is_err());
    }
}

//! QServe's QoQ (W4A8, per-channel or progressive per-group weights, INT8 per-token
//! activations), in the order its steps depend on each other:
//!
//! 1. **Block input rotation.** Norm gains are folded into the readers, then the residual
//!    stream is rotated by a seeded scaled Hadamard matrix ([`crate::rotation`]), so q/k/v and
//!    gate/up read activations whose outlier channels are spread over all channels. The
//!    rotation needs no statistics, so it comes first and calibration runs once, on the
//!    rotated model.
//!    **Value rotation** (beyond QServe, from QuaRot; with a quantized KV cache only): each
//!    value head is rotated by a seeded
//!    Hadamard matrix of the head size ([`crate::rotation::rotate_values`]), folded into
//!    v_proj's rows and o_proj's input columns. Attention is linear in the values per head, so
//!    the function is kept; a value cache quantized per token and head (KV4, KV8) and o_proj's
//!    INT8 input then see each value dim's outliers spread over the head. Keys cannot be
//!    rotated this way: RoPE sits between k_proj and the cache and commutes only with
//!    transforms inside each rotary pair, which is what SmoothAttention's scale is.
//! 2. **SmoothAttention.** `λ_i = max(max|K_i|, max|K_pair(i)|)^s` per KV channel from the
//!    rotary-embedded keys (what the KV cache stores), with `pair` the rotary partner of the
//!    model's layout so `λ` commutes with RoPE; q_proj rows are multiplied by `λ` (for every
//!    query head of the KV group) and k_proj rows divided, biases too. QServe's strength is
//!    `s = 0.5`; with a quantized KV cache `s` is chosen from [`SMOOTH_ATTENTION_STRENGTHS`] by
//!    calibration perplexity ([`smooth_attention_strength`]). Skipped for models with
//!    per-head QK norms (Qwen3): the norm of `q λ` is not the norm of `q` times `λ`, so the
//!    scale cannot be folded through it.
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
//! 6. **Encoding** with `Qoq { group }` (or `Int4Group { group: 0 }` for per-channel W4A8).

use nibble_core::{Error, Result};
use nibble_model::RopeLayout;
use nibble_model::config::ModelConfig;
use nibble_precision::{KvFormat, LinearScheme, PrecisionSpec};

use crate::dense::{DenseModel, SiteKind};
use crate::permute::{HeadPermutation, permute_down_input, sort_desc};
use crate::pipeline::{Method, QuantOptions, QuantizedModel};
use crate::rotation::{Rotation, rotate_residual, rotate_values};
use crate::sim::{
    ActSim, SiteData, Sites, apply_smoothing, calibrate_with, clip_and_encode, clip_grid,
    reduce_kv_max, search_smoothing,
};
use crate::simulate::Simulated;

/// Mixed into the seed of the value rotation's signs.
const VALUE_ROTATION_SEED: u64 = 0x7654_3210;

/// Output-module migration strengths: near 0, so the scale comes mostly from the weights.
pub const OUTPUT_ALPHAS: [f32; 4] = [0.0, 0.05, 0.1, 0.15];

/// SmoothAttention strengths tried with a quantized KV cache: QServe's 0.5 and its neighbours.
/// The KV4 loss is sharply non-monotonic in the strength on SmolLM2 (simulated perplexity on
/// calibration-half text: 17.07 at 0.35, 15.79 at 0.5, 16.37 at 0.75), so it is measured, not
/// assumed.
pub const SMOOTH_ATTENTION_STRENGTHS: [f32; 5] = [0.4, 0.45, 0.5, 0.55, 0.6];

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
    if !smooth_attention_applies(model) {
        return Err(Error::InvalidArgument(
            "SmoothAttention cannot be folded through per-head QK norms".into(),
        ));
    }
    if key_absmax.len() != model.layers.len() {
        return Err(Error::InvalidArgument(format!(
            "key statistics for {} layers, the model has {}",
            key_absmax.len(),
            model.layers.len()
        )));
    }
    let c = model.config.clone();
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    for (l, kmax) in model.layers.iter_mut().zip(key_absmax) {
        if kmax.len() != c.kv_dim() {
            return Err(Error::InvalidArgument(format!(
                "key statistics of {} channels, the model's keys have {}",
                kmax.len(),
                c.kv_dim()
            )));
        }
        let lambda = smooth_attention_scale_with(&c, kmax, strength);
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

/// The SmoothAttention strength for a model whose KV cache is stored as `kv`: QServe's 0.5 for an
/// unquantized cache (the fold then changes nothing that is rounded), otherwise the strength of
/// [`SMOOTH_ATTENTION_STRENGTHS`] whose float model, run with the quantized cache, has the lowest
/// calibration perplexity. The float weights are a faithful stand-in: the fold scales q_proj and
/// k_proj rows, and every weight codec QoQ uses scales per output row, so the weights' rounding
/// does not depend on the strength; only the keys the cache stores do.
pub fn smooth_attention_strength(
    model: &DenseModel,
    key_absmax: &[Vec<f32>],
    kv: KvFormat,
    calibration: &[Vec<u32>],
    threads: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<f32> {
    if kv == KvFormat::F16 {
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

/// Sorts down_proj's input channels of `layer` by salience (descending), in the model and in
/// the site's calibration view.
pub fn reorder_down_input(model: &mut DenseModel, layer: usize, data: &mut SiteData) -> Result<()> {
    let perm = sort_desc(&data.absmax);
    permute_down_input(model, layer, &perm)?;
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

/// Which of QoQ's steps run (all of them for the method; fewer to measure what each brings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QoqSteps {
    pub rotate: bool,
    /// The per-head value rotation (an addition to QServe, see the module documentation);
    /// applied only with a quantized KV cache.
    pub rotate_values: bool,
    pub smooth_attention: bool,
    pub smooth_outputs: bool,
    pub reorder: bool,
    pub clip: bool,
}

impl Default for QoqSteps {
    fn default() -> Self {
        QoqSteps {
            rotate: true,
            rotate_values: true,
            smooth_attention: true,
            smooth_outputs: true,
            reorder: true,
            clip: true,
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
    let LinearScheme::W4A8 { group } = spec.linear else {
        return Err(Error::InvalidArgument(format!(
            "QoQ quantizes to w4a8 or w4a8-gN, not {}",
            spec.linear
        )));
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

    // For a quantized KV cache only: that is what it is for (dev-set perplexity with KV4 15.79
    // -> 15.71); with a 16-bit cache it would only reshape o_proj's input.
    if steps.rotate_values && spec.kv != KvFormat::F16 {
        // Its own seed: the value rotation has nothing to do with the residual one.
        let rot = Rotation::new(model.config.head_dim, opts.seed ^ VALUE_ROTATION_SEED)?;
        rotate_values(&mut model, &rot)?;
    }
    // The attention sink's rows are kept in the samples: without them the searches tune the
    // weights for ordinary tokens at the sink's expense (held-out perplexity of w4a8-g64 QoQ
    // 9.52 with the position-walking samples alone, 8.92 with every first token added; w4a8
    // 10.32 vs 9.76). LiquidQuant and FMPQ do better without (8.66 vs 9.32, 11.51 vs 14.61
    // against samples that held the first tokens).
    let (cal, mut sites) = calibrate_with(&model, calibration, opts.threads, true, &mut |d, t| {
        progress("qoq: calibrate", d, t)
    })?;

    if steps.smooth_attention && smooth_attention_applies(&model) {
        let strength = smooth_attention_strength(
            &model,
            &cal.key_absmax,
            spec.kv,
            calibration,
            opts.threads,
            progress,
        )?;
        smooth_attention_with(&mut model, &cal.key_absmax, strength)?;
    }
    progress("qoq: smooth attention", 1, 1);

    let layers = model.layers.len();
    for layer in (0..layers).filter(|_| steps.smooth_outputs) {
        for site in [SiteKind::OIn, SiteKind::DownIn] {
            let data = site_mut(&mut sites, layer, site)?;
            let choice = search_smoothing(&model, layer, site, data, &OUTPUT_ALPHAS, format, act)?;
            if choice.alpha.is_some() {
                apply_smoothing(&mut model, layer, site, data, &choice.scale)?;
            }
        }
        progress("qoq: smooth outputs", layer + 1, layers);
    }

    if group > 0 && steps.reorder {
        for layer in 0..layers {
            reorder_down_input(
                &mut model,
                layer,
                site_mut(&mut sites, layer, SiteKind::DownIn)?,
            )?;
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
    let linears = clip_and_encode(&model, &sites, &|_| format, &grid, &mut |d, t| {
        progress("qoq: clip and encode", d, t)
    })?;
    Ok(QuantizedModel {
        spec,
        method: Method::Qoq,
        dense: model,
        linears,
    })
}

/// The calibration view of one site, or an error naming it.
pub(crate) fn site_mut(sites: &mut Sites, layer: usize, site: SiteKind) -> Result<&mut SiteData> {
    sites.get_mut(&(layer, site)).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "calibration recorded no {site:?} input for layer {layer}"
        ))
    })
}

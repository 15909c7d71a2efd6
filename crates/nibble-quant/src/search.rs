//! What the calibrated searches (AWQ, GPTQ, SmoothQuant) share: running the calibration capture,
//! the scaled output error of a site (its layers replayed on sampled input rows with the
//! run-time rounding of [`crate::sim`]: codec rounding of the weights, per-token quantization of
//! the activations), and the bookkeeping of an input site (the layers reading it, its
//! per-KV-channel statistics for o_proj).

use nibble_core::{Error, Result};
use nibble_precision::LinearFormat;

use crate::capture::{Calibration, CaptureOptions, SiteStats, capture};
use crate::dense::{DenseModel, LinearId, Mat, Site, SiteKind};
use crate::sim::{ActSim, fake_quant_weight, matmul_nt, sq_err};

/// Input rows per site the searches replay. Their cost is linear in it; 256 rows keep a search
/// over the 135M default model to tens of seconds on two cores, and the searched quantities
/// (one scale per channel, one clip per group) are far fewer than the 256 x K values they are fit
/// on.
pub const SEARCH_ROWS: usize = 256;

/// Runs the calibration capture over `sequences`, keeping `rows` input rows per site spread
/// evenly over all the tokens (not just the first sequences), and the Gram matrices if asked.
pub fn calibrate(
    model: &DenseModel,
    sequences: &[Vec<u32>],
    rows: usize,
    hessian: bool,
    threads: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Calibration> {
    calibrate_with_first(model, sequences, rows, hessian, false, threads, progress)
}

/// [`calibrate`], with `sample_first`: every sequence's first token (the attention sink) kept
/// on top of the strided rows.
pub fn calibrate_with_first(
    model: &DenseModel,
    sequences: &[Vec<u32>],
    rows: usize,
    hessian: bool,
    sample_first: bool,
    threads: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Calibration> {
    // Before the forward passes, not after: a bad weight should cost no calibration time.
    check_finite(model)?;
    let opts = CaptureOptions {
        hessian,
        max_samples: rows,
        sample_stride: sample_stride(sequences, rows),
        sample_first,
        attention_sequences: 0,
        hessian_layers: None,
    };
    capture(model, sequences, opts, threads, &mut |d, t| {
        progress("calibration", d, t)
    })
}

/// A stride that spreads `rows` samples over all the tokens and walks through every position of
/// the sequences. The capture counts tokens across sequences, so a stride sharing a factor with
/// the sequence length would keep revisiting the same positions: with 256-token sequences and a
/// stride of 32, one sample in eight would be a sequence's first token, whose huge activations
/// (the attention sink) would then dominate every error the searches measure.
pub fn sample_stride(sequences: &[Vec<u32>], rows: usize) -> usize {
    let tokens: usize = sequences.iter().map(Vec::len).sum();
    let mut stride = (tokens / rows.max(1)).max(1);
    while stride > 1 && sequences.iter().any(|s| gcd(stride, s.len()) > 1) {
        stride += 1;
    }
    stride
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Refuses a model holding a NaN or an infinity in a linear layer, naming the tensor: the
/// searches would otherwise turn one bad weight into garbage scales for a whole site.
pub fn check_finite(model: &DenseModel) -> Result<()> {
    for id in model.linear_ids() {
        if let Some(i) = model.linear(id).data.iter().position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "{} holds a non-finite value at index {i}; cannot quantize it",
                model.linear_name(id)
            )));
        }
    }
    Ok(())
}

/// Fewer calibration tokens than this routed to an expert, and its layers are quantized with
/// plain RTN (no scale of its own, no clipping search, no Hessian), and the scale folded at its
/// block's shared MLP input is searched without it. The calibrated methods fit one number per
/// input channel (AWQ, SmoothQuant) or a `k x k` Hessian (GPTQ) to the rows an expert saw: on
/// too few rows that fit is noise and does worse than RTN, which needs no data. On the tiny MoE
/// fixtures (64 input channels) GPTQ fitted to an expert's 70-110 routed tokens came out worse
/// than RTN on held-out inputs, and from a few hundred tokens on better. The statistics of all
/// the block's tokens are no substitute: they describe tokens the router decided this expert
/// does not serve, and its down_proj input (its own gate and up) was never computed for them.
pub const MIN_EXPERT_TOKENS: usize = 128;

/// The statistics of a site, refusing a site the capture did not see or saw no rows of.
pub fn site_stats(calib: &Calibration, site: Site) -> Result<&SiteStats> {
    let s = calib.stats(site).ok_or_else(|| {
        Error::InvalidArgument(format!("the calibration has no statistics for {site:?}"))
    })?;
    if s.samples.rows == 0 || s.tokens == 0 {
        return Err(Error::InvalidArgument(format!(
            "the calibration kept no input rows for {site:?}"
        )));
    }
    Ok(s)
}

/// The statistics of the input linear layer `id` reads, `None` for an expert calibration routed
/// fewer than [`MIN_EXPERT_TOKENS`] tokens to (or kept no rows of), which is then quantized as
/// RTN would. Refuses a missing dense site, which is a capture that did not run this model.
pub fn calibrated_input(calib: &Calibration, id: LinearId) -> Result<Option<&SiteStats>> {
    if id.expert.is_none() {
        return site_stats(calib, id.input()).map(Some);
    }
    Ok(calib
        .input_of(id)
        .filter(|s| s.tokens >= MIN_EXPERT_TOKENS && s.samples.rows > 0))
}

/// The weights of every layer reading `site`, stacked by rows (q, k, v or gate, up, of every
/// expert of a sparse block): the output error of the site is the sum of theirs, and rows are
/// quantized independently, so one stacked matrix replays them all at once.
pub fn site_weights(model: &DenseModel, site: Site) -> Mat {
    stack(model, &model.readers(site))
}

fn stack(model: &DenseModel, ids: &[LinearId]) -> Mat {
    let cols = model.linear(ids[0]).cols;
    let mut data = Vec::new();
    let mut rows = 0;
    for &id in ids {
        let w = model.linear(id);
        data.extend_from_slice(&w.data);
        rows += w.rows;
    }
    Mat::new(rows, cols, data)
}

/// The calibrated readers of `site` grouped by the input they see, each group as (sampled input
/// rows, stacked weights): one group for a dense site, one per expert at a sparse block's MLP
/// input, each with only the rows routed to it. An expert [`calibrated_input`] leaves out is in
/// no group, so the site's error is the error on the inputs each layer will actually read.
pub fn site_groups(model: &DenseModel, calib: &Calibration, site: Site) -> Result<Vec<(Mat, Mat)>> {
    let readers = model.readers(site);
    let mut groups: Vec<(Site, Vec<LinearId>)> = Vec::new();
    for id in readers {
        match groups.last_mut() {
            Some((input, ids)) if *input == id.input() => ids.push(id),
            _ => groups.push((id.input(), vec![id])),
        }
    }
    let mut out = Vec::new();
    for (_, ids) in groups {
        if let Some(stats) = calibrated_input(calib, ids[0])? {
            out.push((stats.samples.clone(), stack(model, &ids)));
        }
    }
    Ok(out)
}

/// The number of smoothing factors `fold_input_scale` takes for a site.
pub fn factor_count(model: &DenseModel, site: SiteKind) -> usize {
    let c = &model.config;
    match site {
        SiteKind::AttnIn | SiteKind::MlpIn => c.hidden_size,
        SiteKind::OIn => c.kv_dim(),
        SiteKind::DownIn => c.intermediate_size,
    }
}

/// How per-channel statistics of o_proj's input (`q_dim` channels) become one value per KV
/// channel: the query heads of a group share their KV head's value rows, so they share a factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Mean,
    Max,
}

/// Per-channel statistics of `site`'s input brought to the site's factor count: unchanged except
/// for o_proj's input, reduced over the query heads sharing each KV channel.
pub fn per_factor(model: &DenseModel, site: SiteKind, v: &[f32], how: Reduce) -> Vec<f32> {
    if site != SiteKind::OIn {
        return v.to_vec();
    }
    let c = &model.config;
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    let mut out = vec![0f32; c.kv_dim()];
    for (j, &x) in v.iter().enumerate() {
        let o = &mut out[(j / hd / group) * hd + j % hd];
        *o = match how {
            Reduce::Mean => *o + x / group as f32,
            Reduce::Max => o.max(x),
        };
    }
    out
}

/// A site's factors spread over its input channels (the inverse of [`per_factor`]'s grouping).
pub fn per_channel(model: &DenseModel, site: SiteKind, s: &[f32]) -> Vec<f32> {
    if site != SiteKind::OIn {
        return s.to_vec();
    }
    let c = &model.config;
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    (0..c.q_dim())
        .map(|j| s[(j / hd / group) * hd + j % hd])
        .collect()
}

/// Folds `s` (one factor per KV channel for o_proj) into `site` and divides the site's recorded
/// inputs by it (at a sparse block's MLP input, every expert's share as well). The fold keeps
/// the output of every layer reading the site, so no other site's input changes and the
/// recorded statistics stay exact without a second capture.
pub fn fold_site(
    model: &mut DenseModel,
    calib: &mut Calibration,
    site: Site,
    s: &[f32],
) -> Result<()> {
    model.fold_scale(site, s)?;
    let full = per_channel(model, site.kind, s);
    for stats in calib.shares_mut(site) {
        stats.divide_channels(&full);
    }
    Ok(())
}

/// Squared output error of a site after folding `s` (one factor per input channel): the
/// reference `y_ref = x · wᵀ` against `Qa(x / s) · Qw(w · diag(s))ᵀ`, with the quantizers of
/// `format` applied as the kernels apply them.
pub fn scaled_error(x: &Mat, w: &Mat, y_ref: &Mat, s: &[f32], format: LinearFormat) -> Result<f64> {
    let mut ws = w.clone();
    ws.scale_cols(s);
    let wq = fake_quant_weight(&ws, format, &vec![1.0; w.rows])?;
    let mut xs = x.clone();
    let inv: Vec<f32> = s.iter().map(|v| 1.0 / v).collect();
    xs.scale_cols(&inv);
    let xq = ActSim::of(format.act).apply(&xs);
    Ok(sq_err(&matmul_nt(&xq, &wq), y_ref))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(rows: usize, cols: usize, seed: u64) -> Mat {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Mat::new(
            rows,
            cols,
            (0..rows * cols)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect(),
        )
    }

    #[test]
    fn sample_stride_visits_every_position() {
        let seqs = vec![vec![0u32; 256]; 32];
        let stride = sample_stride(&seqs, 256);
        assert_eq!(stride, 33);
        let positions: std::collections::HashSet<usize> =
            (0..32 * 256).step_by(stride).map(|t| t % 256).collect();
        assert!(positions.len() > 240, "{}", positions.len());
        assert_eq!(sample_stride(&seqs, 100_000), 1);
        assert_eq!(sample_stride(&[vec![0; 7]], 2), 3);
    }

    #[test]
    fn identity_scale_error_is_the_rtn_error() {
        let (x, w) = (random(64, 64, 3), random(16, 64, 4));
        let format: LinearFormat = "int4-g32/a8".parse().unwrap();
        let y_ref = matmul_nt(&x, &w);
        let direct = {
            let wq = fake_quant_weight(&w, format, &[1.0; 16]).unwrap();
            let xq = ActSim::of(format.act).apply(&x);
            sq_err(&matmul_nt(&xq, &wq), &y_ref)
        };
        let via = scaled_error(&x, &w, &y_ref, &[1.0; 64], format).unwrap();
        assert_eq!(direct, via);
        assert!(direct > 0.0);
    }
}

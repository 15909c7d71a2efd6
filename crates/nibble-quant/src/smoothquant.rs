//! SmoothQuant: activations with outlier channels quantize badly per token (one outlier sets the
//! whole token's scale), weights quantize well per output channel; dividing input channel `j` by
//! `s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)` and multiplying the weights' column `j` by it
//! moves the difficulty from the activations into the weights. `max|W_j|` is over every layer
//! reading the site; the division is folded into the op producing the input.
//!
//! `alpha` is searched per site on a grid (`0.0, 0.05, ..., 0.95`, plus no smoothing at all,
//! which `alpha = 0` is not) by the squared output error of the site's layers on the sampled
//! calibration rows, replayed exactly as the run-time kernels compute: activations quantized
//! per token by [`nibble_precision::ActQuant::quantize_row`] (INT8: scale `max|x| / 127`,
//! round-half-even, clamp to ±127; FP8: scale `max|x| / 448`, e4m3 rounding), weights rounded by
//! the codec. The smoothed weights are then rounded to nearest.
//!
//! All four sites are smoothed, o_proj's and down_proj's inputs too (the original smooths only
//! the norm-fed ones): the fold is exact at every site here, and down_proj's input is where
//! Llama-family models carry their largest activation outliers. The "no smoothing" candidate
//! keeps a site unchanged where smoothing does not help.
//!
//! o_proj's input: one factor per KV channel (the query heads of a group share v_proj's rows);
//! both maxima are taken over the group's heads, so the factor tames the largest of them.

use std::collections::BTreeMap;

use nibble_core::{Error, Result};
use nibble_precision::{LinearFormat, PrecisionSpec};

use crate::capture::Calibration;
use crate::dense::{DenseModel, SiteKind};
use crate::pipeline::{Method, QuantizedModel, encode};
use crate::search::{
    Reduce, fold_site, matmul_nt, per_channel, per_factor, scaled_error, site_stats, site_weights,
};

/// The largest smoothed weight magnitude a candidate may produce: INT4 group scales are f16
/// (a range up to about 9.8e5), with margin.
const MAX_SMOOTHED_WEIGHT: f32 = 1e5;

#[derive(Debug, Clone)]
pub struct SmoothQuantOptions {
    /// Migration strengths tried at every site (each in `[0, 1]`); no smoothing is always tried.
    pub alphas: Vec<f32>,
}

impl Default for SmoothQuantOptions {
    fn default() -> Self {
        SmoothQuantOptions {
            alphas: (0..20).map(|i| i as f32 * 0.05).collect(),
        }
    }
}

/// Quantizes `model` with SmoothQuant from the statistics in `calib`.
pub fn smoothquant(
    mut model: DenseModel,
    spec: PrecisionSpec,
    mut calib: Calibration,
    opts: &SmoothQuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    Method::SmoothQuant.check(&spec)?;
    let format = spec
        .linear
        .linear_format(0)
        .expect("SmoothQuant's schemes are quantized");
    if opts.alphas.iter().any(|a| !(0.0..=1.0).contains(a)) {
        return Err(Error::InvalidArgument(format!(
            "SmoothQuant alphas must lie in [0, 1]: {:?}",
            opts.alphas
        )));
    }
    crate::search::check_finite(&model)?;
    smooth(&mut model, &mut calib, format, opts, progress)?;
    let ids = model.linear_ids();
    let mut linears = BTreeMap::new();
    for (i, &id) in ids.iter().enumerate() {
        let clips = vec![1.0; model.linear(id).rows];
        linears.insert(id, (format, encode(&model, id, format, &clips)?));
        progress("encode", i + 1, ids.len());
    }
    Ok(QuantizedModel {
        spec,
        method: Method::SmoothQuant,
        dense: model,
        linears,
    })
}

/// The smoothing alone: folds each site's best factors into `model` (its function is unchanged up
/// to float rounding) and divides the recorded inputs by them. Returns the chosen `alpha` per
/// site, `None` where no smoothing won.
pub fn smooth(
    model: &mut DenseModel,
    calib: &mut Calibration,
    format: LinearFormat,
    opts: &SmoothQuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BTreeMap<(usize, SiteKind), Option<f32>>> {
    let layers = model.layers.len();
    let total = layers * SiteKind::ALL.len();
    let mut chosen = BTreeMap::new();
    for layer in 0..layers {
        for (si, site) in SiteKind::ALL.into_iter().enumerate() {
            let stats = site_stats(calib, layer, site)?;
            let x = &stats.samples;
            let w = site_weights(model, layer, site);
            let xmax = per_factor(model, site, &stats.absmax, Reduce::Max);
            let mut wcol = vec![0f32; w.cols];
            for r in 0..w.rows {
                for (m, v) in wcol.iter_mut().zip(w.row(r)) {
                    *m = m.max(v.abs());
                }
            }
            let wmax = per_factor(model, site, &wcol, Reduce::Max);
            let y_ref = matmul_nt(x, &w);
            let mut candidates: Vec<(Option<f32>, Vec<f32>)> = vec![(None, vec![1.0; xmax.len()])];
            for &a in &opts.alphas {
                candidates.push((Some(a), smooth_scale(&xmax, &wmax, a)));
            }
            let mut best: Option<(f64, Option<f32>, Vec<f32>)> = None;
            for (alpha, s) in candidates {
                // An extreme factor can push a smoothed weight past what an f16 weight scale
                // holds; that candidate is not available. No smoothing always is.
                let fits = wmax
                    .iter()
                    .zip(&s)
                    .all(|(w, s)| w * s <= MAX_SMOOTHED_WEIGHT);
                if alpha.is_some() && !fits {
                    continue;
                }
                let full = per_channel(model, site, &s);
                let err = scaled_error(x, &w, &y_ref, &full, format).map_err(|e| {
                    Error::InvalidArgument(format!("SmoothQuant layer {layer} {site:?}: {e}"))
                })?;
                if best.as_ref().is_none_or(|b| err < b.0) {
                    best = Some((err, alpha, s));
                }
            }
            let (_, alpha, s) = best.expect("the no-smoothing candidate always scores");
            if alpha.is_some() {
                fold_site(model, calib, layer, site, &s)?;
            }
            chosen.insert((layer, site), alpha);
            progress("smoothing", layer * SiteKind::ALL.len() + si + 1, total);
        }
    }
    Ok(chosen)
}

/// `s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`, both maxima floored at 1e-5 so silent channels
/// and all-zero columns keep a finite positive factor.
pub fn smooth_scale(xmax: &[f32], wmax: &[f32], alpha: f32) -> Vec<f32> {
    xmax.iter()
        .zip(wmax)
        .map(|(&x, &w)| x.max(1e-5).powf(alpha) / w.max(1e-5).powf(1.0 - alpha))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_balances_the_two_maxima() {
        let s = smooth_scale(&[100.0, 1.0, 0.0], &[0.5, 2.0, 0.0], 0.5);
        // After smoothing, max|X_j| / s_j == max|W_j| * s_j at alpha 0.5.
        for (j, (x, w)) in [(100.0f32, 0.5f32), (1.0, 2.0)].into_iter().enumerate() {
            assert!(((x / s[j]) - (w * s[j])).abs() < 1e-4, "{s:?}");
        }
        assert!(s[2].is_finite() && s[2] > 0.0);
        assert_eq!(smooth_scale(&[4.0], &[0.25], 1.0), vec![4.0]);
    }
}

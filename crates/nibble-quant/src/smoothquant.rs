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
//! A site is smoothed only where the chosen strength lowers the output error on each of two
//! disjoint halves of the sampled rows (even and odd rows, by [`SmoothQuantOptions::min_gain`]
//! at least): a gain fitted to a few rows that the other half does not see is noise, and FP8's
//! relative rounding makes most per-site gains exactly that (before this rule the per-site
//! winners gave held-out ShareGPT perplexity 7.51 against RTN's 7.48).
//!
//! For the integer schemes the per-site search is one whole-model candidate among others: every
//! strength of [`SmoothQuantOptions::global_alphas`] applied at every site (0.5, the paper's
//! default), each encoded and run through the simulated quantized model ([`crate::simulate`],
//! activations by the run-time rule) on the calibration text; the lowest calibration perplexity
//! wins. FP8 keeps the per-site search alone ([`SmoothQuantOptions::for_scheme`]).
//!
//! o_proj's input: one factor per KV channel (the query heads of a group share v_proj's rows);
//! both maxima are taken over the group's heads, so the factor tames the largest of them.
//!
//! A mixture-of-experts block's MLP input is smoothed once for the router and every expert (its
//! producer, the norm, is shared; the f32 router takes the factor on its columns exactly):
//! `max|X|` over all the block's tokens (every token reaches some expert), `max|W|` over every
//! expert, and each expert's error replayed on the rows the router sent it. Each expert's
//! down_proj input is its own site, on its own tokens. An expert routed fewer than
//! [`crate::search::MIN_EXPERT_TOKENS`] tokens gets no smoothing of its own and no clip search.

use std::collections::BTreeMap;

use nibble_core::{Error, Result};
use nibble_precision::{LinearFormat, LinearScheme, PrecisionSpec};

use crate::capture::Calibration;
use crate::dense::{DenseModel, Mat, Site};
use crate::pipeline::{Method, QuantizedModel, encode};
use crate::search::{
    Reduce, calibrated_input, fold_site, per_channel, per_factor, scaled_error, site_groups,
    site_stats, site_weights,
};
use crate::sim::{ActSim, matmul_nt, search_clips};
use crate::simulate::Simulated;

/// The largest smoothed weight magnitude a candidate may produce: INT4 group scales are f16
/// (a range up to about 9.8e5), with margin.
const MAX_SMOOTHED_WEIGHT: f32 = 1e5;

#[derive(Debug, Clone)]
pub struct SmoothQuantOptions {
    /// Migration strengths tried at every site (each in `[0, 1]`); no smoothing is always tried.
    pub alphas: Vec<f32>,
    /// Strengths applied at every site alike, each a whole-model candidate against the per-site
    /// search, judged by calibration perplexity.
    pub global_alphas: Vec<f32>,
    /// The per-site search smooths a site only where the chosen strength lowers the output error
    /// by at least this fraction on each of two disjoint halves of the sampled rows (even and
    /// odd rows): a gain that one half of the rows does not confirm is taken for noise.
    pub min_gain: f64,
    /// Per output row, the weight clip (or, for FP8, scale) ratio is chosen from these by the
    /// row's output error on the sampled rows ([`crate::sim::search_clips`]); `[1.0]` is plain
    /// round-to-nearest.
    pub weight_ratios: Vec<f32>,
}

impl Default for SmoothQuantOptions {
    fn default() -> Self {
        SmoothQuantOptions {
            alphas: (0..20).map(|i| i as f32 * 0.05).collect(),
            global_alphas: vec![0.5],
            min_gain: 0.0,
            weight_ratios: vec![1.0],
        }
    }
}

impl SmoothQuantOptions {
    /// The options `nibble quantize` uses for `scheme`: the defaults, except that FP8 keeps the
    /// per-site search alone (no global strength): FP8 rounds relative to each value, so a
    /// strength applied everywhere has nothing to gain at most sites, and the per-site search
    /// smooths only where both halves of the rows confirm a gain (on calibration-half text the
    /// calibration does not use: perplexity 11.51 per site, 11.56 with the global strength
    /// competing, 11.66 RTN).
    pub fn for_scheme(scheme: LinearScheme) -> Self {
        let mut o = SmoothQuantOptions::default();
        if scheme == LinearScheme::Fp8 {
            o.global_alphas.clear();
        }
        o
    }
}

/// FP8 weight scale ratios `2^(i/16)`, `i = 0..16`, for [`SmoothQuantOptions::weight_ratios`]:
/// e4m3 rounding is relative, so where the float grid falls on a row's values changes its
/// rounding error (each ratio of `[1, 2)` is another alignment, and none clips). The search
/// keeps, per output row, the ratio with the least output error; ties keep 1.
///
/// Not used by default: on calibration-half text the calibration does not use (32 x 256
/// calibration tokens, 8 x 256 evaluation tokens; float 7.747, FP8 RTN 7.936) the search alone
/// gave 7.909 and with SmoothQuant's smoothing 7.902, against 7.884 for the smoothing alone.
pub fn fp8_scale_ratios() -> Vec<f32> {
    (0..16).map(|i| (i as f32 / 16.0).exp2()).collect()
}

/// Quantizes `model` with SmoothQuant from the statistics in `calib`. With `sequences` (the
/// calibration text) and `opts.global_alphas`, each candidate smoothing (the per-site search and
/// every global strength) is encoded and run through the simulated quantized model, and the one
/// with the lowest calibration perplexity is kept (see the module documentation for why).
pub fn smoothquant(
    model: DenseModel,
    spec: PrecisionSpec,
    calib: Calibration,
    sequences: &[Vec<u32>],
    threads: usize,
    opts: &SmoothQuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    Method::SmoothQuant.check(&spec)?;
    let format = spec
        .linear
        .linear_format(0)
        .expect("SmoothQuant's schemes are quantized");
    if opts
        .alphas
        .iter()
        .chain(&opts.global_alphas)
        .any(|a| !(0.0..=1.0).contains(a))
    {
        return Err(Error::InvalidArgument(format!(
            "SmoothQuant alphas must lie in [0, 1]: {:?} {:?}",
            opts.alphas, opts.global_alphas
        )));
    }
    crate::search::check_finite(&model)?;
    let mut strengths = vec![Strength::PerSite];
    if !sequences.is_empty() {
        strengths.extend(opts.global_alphas.iter().map(|&a| Strength::Global(a)));
    }
    let mut best: Option<(f64, QuantizedModel)> = None;
    for &strength in &strengths {
        let (mut m, mut c) = (model.clone(), calib.clone());
        smooth(&mut m, &mut c, format, opts, strength, progress)?;
        let ids = m.linear_ids();
        let mut linears = BTreeMap::new();
        // Readers of one input (q/k/v, gate/up) share their quantized input rows.
        let mut cached: Option<(Site, Mat)> = None;
        for (i, &id) in ids.iter().enumerate() {
            let w = m.linear(id);
            let stats = calibrated_input(&c, id)?;
            let clips = match stats {
                Some(stats) if opts.weight_ratios != [1.0] => {
                    let key = id.input();
                    let x = &stats.samples;
                    if cached.as_ref().is_none_or(|(k, _)| *k != key) {
                        cached = Some((key, ActSim::of(format.act).apply(x)));
                    }
                    let xq = &cached.as_ref().expect("set above").1;
                    search_clips(w, x, xq, format, &opts.weight_ratios)
                        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", m.linear_name(id))))?
                        .0
                }
                _ => vec![1.0; w.rows],
            };
            linears.insert(id, (format, encode(&m, id, format, &clips)?));
            progress("encode", i + 1, ids.len());
        }
        let q = QuantizedModel {
            spec,
            method: Method::SmoothQuant,
            dense: m,
            linears,
        };
        if strengths.len() == 1 {
            return Ok(q);
        }
        let (nll, _) = Simulated::new(&q)?.mean_nll(sequences, threads, &mut |d, t| {
            progress("smoothquant: calibration perplexity", d, t)
        })?;
        if best.as_ref().is_none_or(|b| nll < b.0) {
            best = Some((nll, q));
        }
    }
    Ok(best.expect("at least the per-site candidate").1)
}

/// How [`smooth`] picks each site's migration strength.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strength {
    /// Per site, the strength of `SmoothQuantOptions::alphas` (or none) with the least output
    /// error on the sampled rows.
    PerSite,
    /// The same strength at every site (none where its factors would not fit f16 scales).
    Global(f32),
}

/// The smoothing alone: folds each site's chosen factors into `model` (its function is unchanged
/// up to float rounding) and divides the recorded inputs by them. Returns the chosen `alpha` per
/// site, `None` where no smoothing won (or an expert too few tokens were routed to).
pub fn smooth(
    model: &mut DenseModel,
    calib: &mut Calibration,
    format: LinearFormat,
    opts: &SmoothQuantOptions,
    strength: Strength,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BTreeMap<Site, Option<f32>>> {
    let sites = model.sites();
    let mut chosen = BTreeMap::new();
    for (si, &site) in sites.iter().enumerate() {
        let groups = site_groups(model, calib, site)?;
        if groups.is_empty() {
            chosen.insert(site, None);
            progress("smoothing", si + 1, sites.len());
            continue;
        }
        let stats = site_stats(calib, site)?;
        // Every reader's columns take the factor, calibrated or not.
        let w = site_weights(model, site);
        let xmax = per_factor(model, site.kind, &stats.absmax, Reduce::Max);
        let mut wcol = vec![0f32; w.cols];
        for r in 0..w.rows {
            for (m, v) in wcol.iter_mut().zip(w.row(r)) {
                *m = m.max(v.abs());
            }
        }
        let wmax = per_factor(model, site.kind, &wcol, Reduce::Max);
        // An extreme factor can push a smoothed weight past what an f16 weight scale holds;
        // that candidate is not available. No smoothing always is.
        let fits = |s: &[f32]| {
            wmax.iter()
                .zip(s)
                .all(|(w, s)| w * s <= MAX_SMOOTHED_WEIGHT)
        };
        let (alpha, s) = match strength {
            // A global strength is applied wherever it fits, whatever the site's error says:
            // it is judged on the whole model instead.
            Strength::Global(a) => {
                let s = smooth_scale(&xmax, &wmax, a);
                if fits(&s) {
                    (Some(a), s)
                } else {
                    (None, vec![1.0; xmax.len()])
                }
            }
            Strength::PerSite => {
                // Two disjoint halves of each group's rows, each with its reference output.
                let halves: Vec<[(Mat, Mat, &Mat); 2]> = groups
                    .iter()
                    .map(|(x, w)| {
                        [0, 1].map(|h| {
                            let rows: Vec<usize> = (h..x.rows).step_by(2).collect();
                            let xh = x.select_rows(&rows);
                            let y = matmul_nt(&xh, w);
                            (xh, y, w)
                        })
                    })
                    .collect();
                let errors = |s: &[f32]| -> Result<[f64; 2]> {
                    let full = per_channel(model, site.kind, s);
                    let mut e = [0f64; 2];
                    for group in &halves {
                        for (e, (xh, y, w)) in e.iter_mut().zip(group) {
                            *e += scaled_error(xh, w, y, &full, format).map_err(|e| {
                                Error::InvalidArgument(format!("SmoothQuant {site:?}: {e}"))
                            })?;
                        }
                    }
                    Ok(e)
                };
                let none = errors(&vec![1.0; xmax.len()])?;
                let keep = 1.0 - opts.min_gain;
                let mut best: (f64, Option<f32>, Vec<f32>) =
                    (none[0] + none[1], None, vec![1.0; xmax.len()]);
                for &a in &opts.alphas {
                    let s = smooth_scale(&xmax, &wmax, a);
                    if !fits(&s) {
                        continue;
                    }
                    let e = errors(&s)?;
                    let confirmed = e[0] < keep * none[0] && e[1] < keep * none[1];
                    if confirmed && e[0] + e[1] < best.0 {
                        best = (e[0] + e[1], Some(a), s);
                    }
                }
                (best.1, best.2)
            }
        };
        if alpha.is_some() {
            fold_site(model, calib, site, &s)?;
        }
        chosen.insert(site, alpha);
        progress("smoothing", si + 1, sites.len());
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

    #[test]
    fn fp8_keeps_the_per_site_search_alone() {
        assert!(
            SmoothQuantOptions::for_scheme(LinearScheme::Fp8)
                .global_alphas
                .is_empty()
        );
        let int8 = SmoothQuantOptions::for_scheme(LinearScheme::W8A8);
        assert_eq!(int8.global_alphas, vec![0.5]);
        assert_eq!(int8.alphas, SmoothQuantOptions::default().alphas);
    }

    #[test]
    fn fp8_scale_ratios_span_one_binade_from_one() {
        let r = fp8_scale_ratios();
        assert_eq!(r[0], 1.0);
        assert!(r.windows(2).all(|r| r[0] < r[1]));
        assert!(*r.last().unwrap() < nibble_precision::weight::FP8_MAX_SCALE_RATIO);
        // Round-to-nearest by default, FP8 included.
        for scheme in [LinearScheme::Fp8, LinearScheme::W8A8] {
            assert_eq!(
                SmoothQuantOptions::for_scheme(scheme).weight_ratios,
                vec![1.0]
            );
        }
    }

    /// The FP8 scale search: per row never worse than round-to-nearest (ratio 1 is a candidate),
    /// and on a random layer strictly better in total, with rows taking other ratios.
    #[test]
    fn fp8_scale_search_lowers_the_output_error() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut random = |rows: usize, cols: usize| {
            let data = (0..rows * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            Mat::new(rows, cols, data)
        };
        let (x, w) = (random(128, 96), random(24, 96));
        let format: LinearFormat = "fp8-pc/afp8".parse().unwrap();
        let xq = ActSim::of(format.act).apply(&x);
        let (rtn_ratios, rtn) = search_clips(&w, &x, &xq, format, &[1.0]).unwrap();
        assert!(rtn_ratios.iter().all(|&r| r == 1.0));
        let (ratios, searched) = search_clips(&w, &x, &xq, format, &fp8_scale_ratios()).unwrap();
        assert!(searched < 0.95 * rtn, "{searched} vs {rtn}");
        assert!(ratios.iter().any(|&r| r > 1.0), "{ratios:?}");
        // The chosen codes are what `encode` writes: the search's error is the encoded layer's.
        let wq = crate::sim::fake_quant_weight(&w, format, &ratios).unwrap();
        let y = matmul_nt(&x, &w);
        let direct = crate::sim::sq_err(&matmul_nt(&xq, &wq), &y);
        assert!(
            (direct - searched).abs() <= 1e-9 * direct.max(1.0),
            "{direct} vs {searched}"
        );
    }

    #[test]
    fn rows_split_into_halves() {
        let m = Mat::new(5, 2, (0..10).map(|v| v as f32).collect());
        let even = m.select_rows(&[0, 2, 4]);
        assert_eq!(even.data, vec![0.0, 1.0, 4.0, 5.0, 8.0, 9.0]);
        assert_eq!(m.select_rows(&[]).rows, 0);
    }
}

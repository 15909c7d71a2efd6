//! LiquidQuant (LiquidGEMM's W4A8: INT8 per channel in the protective range, shifted to UINT8,
//! UINT4 per group with an integer scale and offset; INT8 per-token activations).
//!
//! The paper's weights are "first multiplied by a SmoothQuant smoothing factor ... found by grid
//! search, following OutlierSuppression+". So, at every linear input site (q/k/v's, o_proj's,
//! gate/up's, down_proj's) the migration strength `alpha` is searched over 0, 0.1, ..., 1 (and
//! no smoothing) on the summed output error of the site's readers with both sides quantized
//! as they run: weights through the LQQ codec, activations INT8 per token. The chosen scale is
//! folded into the op producing the input (norm gains, v_proj rows, up_proj rows). Then each
//! output row gets the level-0 clip ratio minimizing its output error (the same search as QoQ)
//! and is encoded with `Lqq { group }`.
//!
//! A mixture-of-experts model takes the same two steps over its sites ([`quantize_sparse`]):
//! one strength at a sparse block's MLP input for the router and every expert (their norm is
//! shared), scored by each expert's error on the rows the router sent it, one per expert's
//! down_proj input, and each expert's clip ratios fitted to its own rows. An expert routed
//! fewer than [`crate::search::MIN_EXPERT_TOKENS`] calibration tokens is not smoothed at its
//! own input and keeps clip 1 (RTN).

use nibble_core::{Error, Result};
use nibble_precision::{LinearScheme, PrecisionSpec};

use std::collections::BTreeMap;

use crate::capture::Calibration;
use crate::dense::{DenseModel, Site, SiteKind};
use crate::pipeline::{Method, QuantOptions, QuantizedModel, encode_matrix};
use crate::qoq::site_mut;
use crate::search::{
    Reduce, calibrated_input, fold_site, per_channel, per_factor, scaled_error, site_groups,
    site_stats, site_weights,
};
use crate::sim::{
    ActSim, SEARCH_SAMPLES, Sites, SmoothChoice, apply_smoothing, calibrate, clip_and_encode,
    clip_grid, col_absmax, matmul_nt, search_clips, search_smoothing, smooth_scale,
};

/// Migration strengths searched at every site.
pub fn alpha_grid() -> Vec<f32> {
    (0..=10).map(|i| i as f32 / 10.0).collect()
}

/// Searches and folds the smoothing of every input site; returns the choices by layer and site
/// (in [`SiteKind::ALL`] order).
pub fn smooth(
    model: &mut DenseModel,
    sites: &mut Sites,
    spec: PrecisionSpec,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Vec<SmoothChoice>>> {
    let format = spec
        .linear
        .linear_format(0)
        .ok_or_else(|| Error::InvalidArgument("smoothing needs a quantized scheme".into()))?;
    let act = ActSim::of(format.act);
    let alphas = alpha_grid();
    let layers = model.layers.len();
    let mut out = Vec::with_capacity(layers);
    for layer in 0..layers {
        let mut choices = Vec::with_capacity(4);
        for site in SiteKind::ALL {
            let data = site_mut(sites, layer, site)?;
            let site = Site::dense(layer, site);
            let choice = search_smoothing(model, site, data, &alphas, format, act)?;
            if choice.alpha.is_some() {
                apply_smoothing(model, site, data, &choice.scale)?;
            }
            choices.push(choice);
        }
        out.push(choices);
        progress(layer + 1, layers);
    }
    Ok(out)
}

pub fn quantize(
    mut model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    if !matches!(spec.linear, LinearScheme::W4A8Lqq { .. }) {
        return Err(Error::InvalidArgument(format!(
            "LiquidQuant quantizes to w4a8-lqq-gN, not {}",
            spec.linear
        )));
    }
    if model.config.moe.is_some() {
        return quantize_sparse(model, spec, calibration, opts, progress);
    }
    let format = spec.linear.linear_format(0).expect("lqq is quantized");
    let (_, mut sites) = calibrate(&model, calibration, opts.threads, &mut |d, t| {
        progress("lqq: calibrate", d, t)
    })?;
    smooth(&mut model, &mut sites, spec, &mut |d, t| {
        progress("lqq: smooth", d, t)
    })?;
    let linears = clip_and_encode(&model, &sites, &|_| format, &clip_grid(), &mut |d, t| {
        progress("lqq: clip and encode", d, t)
    })?;
    Ok(QuantizedModel {
        spec,
        method: Method::Lqq,
        dense: model,
        linears,
    })
}

/// LiquidQuant on a mixture-of-experts model (see the module documentation): the dense path's
/// searches over [`DenseModel::sites`], with the statistics kept per expert.
fn quantize_sparse(
    mut model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    let format = spec.linear.linear_format(0).expect("lqq is quantized");
    let mut calib = crate::search::calibrate(
        &model,
        calibration,
        SEARCH_SAMPLES,
        false,
        opts.threads,
        progress,
    )?;
    smooth_sparse(&mut model, &mut calib, spec, &mut |d, t| {
        progress("lqq: smooth", d, t)
    })?;
    let act = ActSim::of(format.act);
    let ids = model.linear_ids();
    let mut linears = BTreeMap::new();
    for (i, &id) in ids.iter().enumerate() {
        let w = model.linear(id);
        let clips = match calibrated_input(&calib, id)? {
            Some(stats) => {
                let xq = act.apply(&stats.samples);
                search_clips(w, &stats.samples, &xq, format, &clip_grid())?.0
            }
            None => vec![1.0; w.rows],
        };
        let bytes = encode_matrix(w, format, &clips)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", model.linear_name(id))))?;
        linears.insert(id, (format, bytes));
        progress("lqq: clip and encode", i + 1, ids.len());
    }
    Ok(QuantizedModel {
        spec,
        method: Method::Lqq,
        dense: model,
        linears,
    })
}

/// [`smooth`] over every site of a model with sparse blocks, each candidate scored by the
/// readers' summed output error on the rows each reads; returns the strength chosen per site
/// searched (`None`: no smoothing won).
pub fn smooth_sparse(
    model: &mut DenseModel,
    calib: &mut Calibration,
    spec: PrecisionSpec,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<crate::dense::Site, Option<f32>>> {
    let format = spec
        .linear
        .linear_format(0)
        .ok_or_else(|| Error::InvalidArgument("smoothing needs a quantized scheme".into()))?;
    let sites = model.sites();
    let mut chosen = BTreeMap::new();
    for (i, &site) in sites.iter().enumerate() {
        let groups = site_groups(model, calib, site)?;
        if groups.is_empty() {
            progress(i + 1, sites.len());
            continue;
        }
        let xmax = per_factor(
            model,
            site.kind,
            &site_stats(calib, site)?.absmax,
            Reduce::Max,
        );
        let w = site_weights(model, site);
        let wmax = per_factor(model, site.kind, &col_absmax(&[&w]), Reduce::Max);
        let refs: Vec<_> = groups.iter().map(|(x, w)| matmul_nt(x, w)).collect();
        let error = |s: &[f32]| -> Result<f64> {
            let full = per_channel(model, site.kind, s);
            let mut e = 0.0;
            for ((x, w), y) in groups.iter().zip(&refs) {
                e += scaled_error(x, w, y, &full, format)?;
            }
            Ok(e)
        };
        let mut best = (error(&vec![1.0; xmax.len()])?, None, Vec::new());
        for alpha in alpha_grid() {
            let s = smooth_scale(&xmax, &wmax, alpha);
            let e = error(&s)?;
            if e < best.0 {
                best = (e, Some(alpha), s);
            }
        }
        if best.1.is_some() {
            fold_site(model, calib, site, &best.2)?;
        }
        chosen.insert(site, best.1);
        progress(i + 1, sites.len());
    }
    Ok(chosen)
}

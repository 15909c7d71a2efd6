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

use nibble_core::{Error, Result};
use nibble_precision::{LinearScheme, PrecisionSpec};

use crate::dense::{DenseModel, SiteKind};
use crate::pipeline::{Method, QuantOptions, QuantizedModel};
use crate::qoq::site_mut;
use crate::sim::{
    ActSim, Sites, SmoothChoice, apply_smoothing, calibrate, clip_and_encode, clip_grid,
    search_smoothing,
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
            let choice = search_smoothing(model, layer, site, data, &alphas, format, act)?;
            if choice.alpha.is_some() {
                apply_smoothing(model, layer, site, data, &choice.scale)?;
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

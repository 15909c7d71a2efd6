//! AWQ (activation-aware weight quantization): protect the input channels that carry large
//! activations by scaling them up in the weights before rounding (and down in the activation,
//! folded into the op that produces it), then clip each weight group's range.
//!
//! Per input site of each block (the normalized block input read by q/k/v, the attention output
//! read by o_proj, the normalized MLP input read by gate/up, down_proj's input) the scale is
//! `s = mean|x|^alpha`, normalized by `sqrt(max(s) * min(s))`, with `alpha` from a grid over
//! `[0, 1)`. Each candidate is scored by the squared output error of every layer reading the site
//! on the sampled calibration rows, replayed as the kernels compute: `x · Wᵀ` against
//! `Qa(x / s) · Q(W · diag(s))ᵀ` (the activation quantizer is the identity up to f16 rounding for
//! 16-bit activations, per-token INT8 for per-channel W4A8). `alpha = 0` is `s = 1`, plain RTN,
//! so the chosen scale never replays worse than RTN on the calibration rows.
//!
//! o_proj's input channels are (query head, dim), but the fold divides v_proj's rows, which the
//! query heads of a GQA group share: the scale is computed per KV channel from the mean of |x|
//! over the group's query heads (AWQ's statistic is a mean, so the group's mean is its natural
//! pooled value), and the search replays o_proj with that shared factor expanded per head.
//! AutoAWQ skips this site under GQA; the fold here makes it exact, so it is searched like the
//! rest.
//!
//! In a mixture-of-experts block the MLP input is one activation read by the router and every
//! expert, and its producer (the norm) is shared, so one scale is searched there for all of
//! them (as AutoAWQ does for Mixtral; the f32 router takes the scale on its columns exactly).
//! The scale's statistic is the mean over all the block's tokens, but each expert's error is
//! replayed on the rows the router sent it only, and the candidates are scored by the sum. Each
//! expert's down_proj input is its own site, searched on its own tokens. An expert with fewer
//! than [`crate::search::MIN_EXPERT_TOKENS`] routed tokens gets no scale and no clip: RTN.
//!
//! After a fold the site's recorded inputs are divided by `s` analytically
//! ([`crate::search::fold_site`]): the fold leaves the output of every layer reading the site
//! unchanged, so no other site's input moves and no second capture is needed. Stats come from one
//! capture of the float model (AutoAWQ likewise searches each block on float inputs).
//!
//! Clipping follows AutoAWQ's `auto_clip`: for every layer except q_proj and k_proj (their
//! outputs meet in the attention scores, where a per-layer output error says little), each
//! weight group's range is clamped to `±max|w| * (1 - i / grid)` for `i` in
//! `0..max_shrink * grid`, choosing per row and group the clamp that minimizes the squared error
//! of that group's partial output `x_g · w_gᵀ` on the (scaled) sample rows. `i = 0` is no clamp.
//! The clamp applies to the weights being encoded (then rounded by the codec's own min/max
//! rule); the dense model keeps the unclamped float weights.

use std::collections::BTreeMap;

use nibble_core::{Error, Result};
use nibble_precision::{LinearFormat, PrecisionSpec, WeightCodec};
use rayon::prelude::*;

use crate::capture::Calibration;
use crate::dense::{DenseModel, LinearId, LinearKind, Mat, Site};
use crate::pipeline::{Method, QuantizedModel, encode_matrix};
use crate::search::{
    Reduce, calibrated_input, fold_site, per_channel, per_factor, scaled_error, site_groups,
    site_stats,
};
use crate::sim::matmul_nt;

#[derive(Debug, Clone, Copy)]
pub struct AwqOptions {
    /// Points of the `alpha` grid over `[0, 1)`.
    pub scale_grid: usize,
    /// Steps of the clip grid: clamps `1 - i / clip_grid`.
    pub clip_grid: usize,
    /// The largest fraction of a group's range clipping may remove.
    pub max_shrink: f32,
}

impl Default for AwqOptions {
    /// AutoAWQ's settings.
    fn default() -> Self {
        AwqOptions {
            scale_grid: 20,
            clip_grid: 20,
            max_shrink: 0.5,
        }
    }
}

/// Quantizes `model` with AWQ from the statistics in `calib` (one capture of the float model with
/// sampled rows; Gram matrices unused).
pub fn awq(
    mut model: DenseModel,
    spec: PrecisionSpec,
    mut calib: Calibration,
    opts: &AwqOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    Method::Awq.check(&spec)?;
    let format = spec
        .linear
        .linear_format(0)
        .expect("AWQ's schemes are quantized");
    if opts.scale_grid == 0 || opts.clip_grid == 0 || !(0.0..1.0).contains(&opts.max_shrink) {
        return Err(Error::InvalidArgument(format!(
            "AWQ grids must be non-empty and max_shrink in [0, 1): {opts:?}"
        )));
    }
    crate::search::check_finite(&model)?;
    search_scales(&mut model, &mut calib, format, opts, progress)?;
    let clamps = search_clips(&model, &calib, format, opts, progress)?;
    let ids = model.linear_ids();
    let mut linears = BTreeMap::new();
    for (i, &id) in ids.iter().enumerate() {
        let mut w = model.linear(id).clone();
        if let Some(maxes) = clamps.get(&id) {
            apply_clip(&mut w, format.codec, maxes);
        }
        let bytes = encode_matrix(&w, format, &vec![1.0; w.rows])
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", model.linear_name(id))))?;
        linears.insert(id, (format, bytes));
        progress("encode", i + 1, ids.len());
    }
    Ok(QuantizedModel {
        spec,
        method: Method::Awq,
        dense: model,
        linears,
    })
}

/// The scale search alone: folds the best scale of every site into `model` (its function is
/// unchanged up to float rounding) and divides the recorded inputs accordingly. Returns the chosen
/// `alpha` per site searched (not an expert's down_proj input too few tokens were routed to).
pub fn search_scales(
    model: &mut DenseModel,
    calib: &mut Calibration,
    format: LinearFormat,
    opts: &AwqOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BTreeMap<Site, f32>> {
    let sites = model.sites();
    let mut chosen = BTreeMap::new();
    for (i, &site) in sites.iter().enumerate() {
        let groups = site_groups(model, calib, site)?;
        if groups.is_empty() {
            progress("awq scales", i + 1, sites.len());
            continue;
        }
        let stats = site_stats(calib, site)?;
        let mean = per_factor(model, site.kind, &stats.absmean(), Reduce::Mean);
        let refs: Vec<Mat> = groups.iter().map(|(x, w)| matmul_nt(x, w)).collect();
        let mut best: Option<(f64, f32, Vec<f32>)> = None;
        for g in 0..opts.scale_grid {
            let alpha = g as f32 / opts.scale_grid as f32;
            let s = awq_scale(&mean, alpha);
            let full = per_channel(model, site.kind, &s);
            let mut err = 0f64;
            for ((x, w), y_ref) in groups.iter().zip(&refs) {
                err += scaled_error(x, w, y_ref, &full, format)
                    .map_err(|e| Error::InvalidArgument(format!("AWQ {site:?}: {e}")))?;
            }
            if best.as_ref().is_none_or(|b| err < b.0) {
                best = Some((err, alpha, s));
            }
        }
        let (_, alpha, s) = best.expect("the grid is not empty");
        fold_site(model, calib, site, &s)?;
        chosen.insert(site, alpha);
        progress("awq scales", i + 1, sites.len());
    }
    Ok(chosen)
}

/// `mean^alpha`, floored at 1e-4 so dead channels keep a usable factor, normalized by
/// `sqrt(max * min)` so the scales straddle 1 and neither side of the fold drifts in magnitude.
pub fn awq_scale(mean: &[f32], alpha: f32) -> Vec<f32> {
    let s: Vec<f32> = mean.iter().map(|m| m.powf(alpha).max(1e-4)).collect();
    let (lo, hi) = s
        .iter()
        .fold((f32::INFINITY, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let norm = (hi * lo).sqrt();
    s.into_iter().map(|v| v / norm).collect()
}

/// AutoAWQ's clipping search: the clamp of each (row, group) of every layer except q/k
/// (`[rows x groups]` per layer). The clamps are applied to a copy of the weights when encoding,
/// so the dense model keeps computing the float function (what everything left unquantized and
/// any later check relies on).
pub fn search_clips(
    model: &DenseModel,
    calib: &Calibration,
    format: LinearFormat,
    opts: &AwqOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BTreeMap<LinearId, Vec<f32>>> {
    let ids: Vec<LinearId> = model
        .linear_ids()
        .into_iter()
        .filter(|id| !matches!(id.kind, LinearKind::Q | LinearKind::K))
        .collect();
    let mut clamps = BTreeMap::new();
    for (i, &id) in ids.iter().enumerate() {
        // An expert calibration (nearly) never routed to is left unclipped: RTN.
        let Some(stats) = calibrated_input(calib, id)? else {
            progress("awq clip", i + 1, ids.len());
            continue;
        };
        let maxes =
            search_clip(model.linear(id), &stats.samples, format.codec, opts).map_err(|e| {
                Error::InvalidArgument(format!("AWQ clip of {}: {e}", model.linear_name(id)))
            })?;
        clamps.insert(id, maxes);
        progress("awq clip", i + 1, ids.len());
    }
    Ok(clamps)
}

/// The codec that encodes one group of `codec` on its own with identical rounding (an INT4 group
/// is a one-group INT4 row), and the group length.
fn group_codec(codec: WeightCodec, cols: usize) -> Result<(WeightCodec, usize)> {
    codec.check_cols(cols)?;
    Ok(match codec {
        WeightCodec::Int4Group { .. } => (
            WeightCodec::Int4Group { group: 0 },
            cols / codec.groups(cols),
        ),
        WeightCodec::Int8PerChannel | WeightCodec::Fp8PerChannel => (codec, cols),
        other => {
            return Err(Error::unsupported(
                format!("AWQ clipping for {other}"),
                "AWQ's schemes are int4, int8 and fp8 per-channel codecs",
            ));
        }
    })
}

/// Per row and group of `w`, the clamp `max|w_g| * (1 - i / grid)` minimizing the squared error
/// of the group's partial outputs on the rows of `x`; `[rows x groups]`.
pub fn search_clip(w: &Mat, x: &Mat, codec: WeightCodec, opts: &AwqOptions) -> Result<Vec<f32>> {
    let (sub, gl) = group_codec(codec, w.cols)?;
    let groups = w.cols / gl;
    let steps = ((opts.max_shrink * opts.clip_grid as f32).round() as usize).max(1);
    let rb = sub.row_bytes(gl)?;
    let per_group: Vec<Vec<f32>> = (0..groups)
        .into_par_iter()
        .map(|g| -> Result<Vec<f32>> {
            let xg = columns(x, g * gl, gl);
            let wg = columns(w, g * gl, gl);
            let amax: Vec<f32> = (0..w.rows)
                .map(|r| wg.row(r).iter().fold(0f32, |m, v| m.max(v.abs())))
                .collect();
            let mut best_err = vec![f64::INFINITY; w.rows];
            let mut best_max = amax.clone();
            let mut diff = Mat::new(w.rows, gl, vec![0f32; w.rows * gl]);
            let (mut packed, mut deq, mut clamped) =
                (vec![0u8; rb], vec![0f32; gl], vec![0f32; gl]);
            for i in 0..steps {
                let keep = 1.0 - i as f32 / opts.clip_grid as f32;
                for (r, &a) in amax.iter().enumerate() {
                    let m = a * keep;
                    for (c, &v) in clamped.iter_mut().zip(wg.row(r)) {
                        *c = v.clamp(-m, m);
                    }
                    sub.quantize_row(&clamped, 1.0, &mut packed)?;
                    sub.dequantize(&packed, gl, &mut deq)?;
                    for ((d, &v), &q) in diff.row_mut(r).iter_mut().zip(wg.row(r)).zip(&deq) {
                        *d = v - q;
                    }
                }
                let e = matmul_nt(&xg, &diff);
                for r in 0..w.rows {
                    let err: f64 = (0..e.rows)
                        .map(|t| {
                            let v = e.data[t * e.cols + r] as f64;
                            v * v
                        })
                        .sum();
                    if err < best_err[r] {
                        best_err[r] = err;
                        best_max[r] = amax[r] * keep;
                    }
                }
            }
            Ok(best_max)
        })
        .collect::<Result<_>>()?;
    let mut out = vec![0f32; w.rows * groups];
    for (g, maxes) in per_group.iter().enumerate() {
        for (r, &m) in maxes.iter().enumerate() {
            out[r * groups + g] = m;
        }
    }
    Ok(out)
}

/// Clamps each (row, group) of `w` to `±maxes[row * groups + group]`.
pub fn apply_clip(w: &mut Mat, codec: WeightCodec, maxes: &[f32]) {
    let groups = codec.groups(w.cols);
    let gl = w.cols / groups;
    for r in 0..w.rows {
        for (g, chunk) in w.row_mut(r).chunks_exact_mut(gl).enumerate() {
            let m = maxes[r * groups + g];
            chunk.iter_mut().for_each(|v| *v = v.clamp(-m, m));
        }
    }
}

/// Columns `start..start + len` of `m` as their own matrix.
fn columns(m: &Mat, start: usize, len: usize) -> Mat {
    let mut data = Vec::with_capacity(m.rows * len);
    for r in 0..m.rows {
        data.extend_from_slice(&m.row(r)[start..start + len]);
    }
    Mat::new(m.rows, len, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn scales_are_normalized_and_alpha_zero_is_identity() {
        let mean = [0.0, 0.5, 2.0, 8.0];
        assert_eq!(awq_scale(&mean, 0.0), vec![1.0; 4]);
        let s = awq_scale(&mean, 0.5);
        let (lo, hi) = (s[0], s[3]);
        assert!((lo * hi - 1.0).abs() < 1e-5, "{s:?}");
        assert!(s.windows(2).all(|p| p[0] <= p[1]), "{s:?}");
    }

    /// A layer whose inputs carry a few huge channels: clipping never replays worse than no
    /// clipping (the i = 0 candidate), and on heavy-tailed weights it clips something.
    #[test]
    fn clipping_never_hurts_the_group_outputs() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (rows, k, n) = (8, 64, 128);
        let w = Mat::new(
            rows,
            k,
            (0..rows * k)
                .map(|_| {
                    let v: f32 = rng.random_range(-1.0..1.0);
                    v * v * v * if rng.random_bool(0.02) { 8.0 } else { 1.0 }
                })
                .collect(),
        );
        let x = Mat::new(
            n,
            k,
            (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect(),
        );
        let codec = WeightCodec::Int4Group { group: 32 };
        let format = LinearFormat::new(codec, nibble_precision::ActQuant::F16).unwrap();
        let maxes = search_clip(&w, &x, codec, &AwqOptions::default()).unwrap();
        let mut clipped = w.clone();
        apply_clip(&mut clipped, codec, &maxes);
        assert_ne!(clipped, w, "heavy tails should be clipped somewhere");
        let y_ref = matmul_nt(&x, &w);
        let err = |m: &Mat| {
            let q = crate::sim::fake_quant_weight(m, format, &vec![1.0; m.rows]).unwrap();
            crate::sim::sq_err(&matmul_nt(&x, &q), &y_ref)
        };
        assert!(err(&clipped) < err(&w), "{} vs {}", err(&clipped), err(&w));
    }
}

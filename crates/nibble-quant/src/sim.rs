//! Simulated quantized linear layers, and the searches QoQ, LiquidQuant and FMPQ build on them.
//! The one replay of run-time rounding: AWQ, GPTQ and SmoothQuant ([`crate::search`]) and the
//! whole-model simulation ([`crate::simulate`]) use these functions too.
//!
//! A search compares a float layer `Y = X W^T` on captured calibration rows with the layer as
//! it will run: weights through the real codec (encode, then decode) and activations through the
//! run-time rules, which are repeated here exactly:
//!
//! * INT8 per token: `scale = max|x| / 127` (one f32 division), `q = clamp(round(x / scale),
//!   -127, 127)` with ties to even (what `cvt.rni` and `vcvtps2dq` do); a zero scale gives zeros.
//! * COMET mixed blocks: per token per block of `block` channels, the first `int8_blocks`
//!   blocks with the INT8 rule, the others with `scale = max|x_b| / 7`, codes clamped to ±7.
//! * FP8 per token and 16-bit activations: the run-time quantizer itself
//!   ([`nibble_precision::ActQuant::quantize_row`]; f16 rounding for the latter).
//!
//! Errors are summed squares over the sampled tokens, accumulated in f64.

use std::collections::{BTreeMap, HashMap};

use nibble_core::{Error, Result};
use nibble_precision::{ActQuant, LinearFormat};
use rayon::prelude::*;

use crate::capture::{Calibration, CaptureOptions, capture};
use crate::dense::{DenseModel, LinearId, Mat, Site, SiteKind};
use crate::pipeline::encode_matrix;

/// Calibration rows kept per input site for the searches: enough tokens that a clip ratio or
/// smoothing strength is not fitted to a handful of them, few enough that every candidate of
/// every search is one modest matmul.
pub const SEARCH_SAMPLES: usize = 512;

/// Every input's calibration view, by site (each expert's inputs of a sparse block as well: see
/// [`crate::capture::Calibration::experts`]).
pub type Sites = HashMap<Site, SiteData>;

/// Runs `model` over `calibration` keeping about [`SEARCH_SAMPLES`] rows per site, strided over
/// all tokens so every sequence contributes and every position is visited;
/// `progress(done, total)` per sequence.
pub fn calibrate(
    model: &DenseModel,
    calibration: &[Vec<u32>],
    threads: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Calibration, Sites)> {
    calibrate_with(model, calibration, threads, false, 0, progress)
}

/// [`calibrate`], with `sample_first`: every sequence's first token (the attention sink) kept
/// on top of the strided rows (QoQ; see [`crate::qoq`]), and the whole attention inputs of the
/// first `attention_sequences` sequences kept ([`Calibration::attention`]).
pub fn calibrate_with(
    model: &DenseModel,
    calibration: &[Vec<u32>],
    threads: usize,
    sample_first: bool,
    attention_sequences: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Calibration, Sites)> {
    let opts = CaptureOptions {
        hessian: false,
        max_samples: SEARCH_SAMPLES,
        // Strided so it walks every position: a stride dividing the sequence length would
        // land on every sequence's first token, and only on a few positions.
        sample_stride: crate::search::sample_stride(calibration, SEARCH_SAMPLES),
        sample_first,
        attention_sequences,
        hessian_layers: None,
    };
    let cal = capture(model, calibration, opts, threads, progress)?;
    let data = |s: &crate::capture::SiteStats| SiteData {
        absmax: s.absmax.clone(),
        samples: s.samples.clone(),
        tokens: s.tokens,
    };
    let sites = cal
        .sites
        .iter()
        .map(|(&(layer, kind), s)| (Site::dense(layer, kind), data(s)))
        .chain(cal.experts.iter().map(|(&(layer, kind, e), s)| {
            let site = Site {
                layer,
                kind,
                expert: Some(e),
            };
            (site, data(s))
        }))
        .collect();
    Ok((cal, sites))
}

/// Encodes every linear layer of `model` in `format_of(id)`, each output row at the clip ratio
/// from `grid` (e.g. [`clip_grid`]) that minimizes the layer's output error on its site's
/// samples with the run-time activation quantization applied. `progress(done, total)` per layer.
pub fn clip_and_encode(
    model: &DenseModel,
    sites: &Sites,
    format_of: &dyn Fn(LinearId) -> LinearFormat,
    grid: &[f32],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<LinearId, (LinearFormat, Vec<u8>)>> {
    clip_and_encode_with(
        model,
        sites,
        format_of,
        grid,
        &|w, _, format, clips| encode_matrix(w, format, clips),
        progress,
    )
}

/// Encodes a weight: `(w, quantized site input, format, row clips) -> bytes`.
pub type EncodeFn = dyn Fn(&Mat, &Mat, LinearFormat, &[f32]) -> Result<Vec<u8>> + Sync;

/// [`clip_and_encode`] with the last step, the encoding of weight `w` at its rows' clips, done
/// by `encode(w, quantized site input, format, clips)` (QoQ adds its level-1 step search there).
pub fn clip_and_encode_with(
    model: &DenseModel,
    sites: &Sites,
    format_of: &dyn Fn(LinearId) -> LinearFormat,
    grid: &[f32],
    encode: &EncodeFn,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BTreeMap<LinearId, (LinearFormat, Vec<u8>)>> {
    let ids = model.linear_ids();
    let mut out = BTreeMap::new();
    let mut cached: Option<((Site, ActQuant), Mat)> = None;
    for (i, &id) in ids.iter().enumerate() {
        let format = format_of(id);
        let w = model.linear(id);
        let data = match sites.get(&id.input()) {
            // An expert calibration (nearly) never routed to: RTN (see
            // `crate::search::MIN_EXPERT_TOKENS`).
            d if id.expert.is_some()
                && d.is_none_or(|d| d.tokens < crate::search::MIN_EXPERT_TOKENS) =>
            {
                let bytes = encode_matrix(w, format, &vec![1.0; w.rows]).map_err(|e| {
                    Error::InvalidArgument(format!("{}: {e}", model.linear_name(id)))
                })?;
                out.insert(id, (format, bytes));
                progress(i + 1, ids.len());
                continue;
            }
            d => d.ok_or_else(|| {
                Error::InvalidArgument(format!("no calibration rows for {}", model.linear_name(id)))
            })?,
        };
        // Readers of one input (q/k/v, gate/up) share their quantized input.
        let key = (id.input(), format.act);
        if cached.as_ref().is_none_or(|(k, _)| *k != key) {
            cached = Some((key, ActSim::of(format.act).apply(&data.samples)));
        }
        let xq = &cached.as_ref().expect("set above").1;
        let clips = if grid == [1.0] {
            vec![1.0; w.rows]
        } else {
            search_clips(w, &data.samples, xq, format, grid)?.0
        };
        let bytes = encode(w, xq, format, &clips)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", model.linear_name(id))))?;
        out.insert(id, (format, bytes));
        progress(i + 1, ids.len());
    }
    Ok(out)
}

/// How a layer's input is quantized at run time, for simulation: every searcher and the
/// whole-model simulation replay activations through this one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActSim {
    /// Left exactly as computed (layers that stay in float).
    Float,
    /// 16-bit activations: rounded to f16, as the kernels of 16-bit-activation formats read them.
    F16,
    Int8PerToken,
    /// FP8 e4m3 per token (scale `max|x| / 448`), by the run-time quantizer itself.
    Fp8PerToken,
    /// COMET blocks: the first `int8_blocks` blocks INT8, the rest INT4.
    Mixed {
        block: usize,
        int8_blocks: usize,
    },
}

impl ActSim {
    /// The simulation of a run-time activation format.
    pub fn of(act: ActQuant) -> ActSim {
        match act {
            ActQuant::F16 => ActSim::F16,
            ActQuant::Int8PerToken => ActSim::Int8PerToken,
            ActQuant::Fp8PerToken => ActSim::Fp8PerToken,
            ActQuant::Mixed4x8 { block, int8_blocks } => ActSim::Mixed {
                block: block as usize,
                int8_blocks: int8_blocks as usize,
            },
        }
    }

    /// Quantizes and dequantizes every row of `x` (one token per row).
    pub fn apply(self, x: &Mat) -> Mat {
        let mut out = x.clone();
        if x.cols == 0 {
            return out;
        }
        let rows = out.data.par_chunks_mut(x.cols);
        match self {
            ActSim::Float => {}
            ActSim::F16 => rows.for_each(|row| {
                row.iter_mut()
                    .for_each(|v| *v = half::f16::from_f32(*v).to_f32())
            }),
            ActSim::Int8PerToken => rows.for_each(|row| fake_quant_int(row, 127)),
            ActSim::Fp8PerToken => rows.for_each(|row| {
                // The e4m3 rounding is not worth repeating here: the run-time rule itself.
                let q = ActQuant::Fp8PerToken
                    .quantize_row(row)
                    .expect("per-token FP8 takes any row length");
                for (v, d) in row.iter_mut().zip(q.dequantize_f64()) {
                    *v = d as f32;
                }
            }),
            ActSim::Mixed { block, int8_blocks } => {
                assert!(
                    block > 0 && x.cols.is_multiple_of(block) && int8_blocks * block <= x.cols,
                    "mixed blocks of {block} ({int8_blocks} INT8) over {} channels",
                    x.cols
                );
                rows.for_each(|row| {
                    for (b, chunk) in row.chunks_mut(block).enumerate() {
                        fake_quant_int(chunk, if b < int8_blocks { 127 } else { 7 });
                    }
                });
            }
        }
        out
    }
}

/// Symmetric quantize-dequantize of one token (or one block of it) to `[-qmax, qmax]`.
pub fn fake_quant_int(x: &mut [f32], qmax: i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / qmax as f32;
    if scale == 0.0 || !scale.is_finite() {
        x.fill(if scale.is_finite() { 0.0 } else { f32::NAN });
        return;
    }
    let q = qmax as f32;
    for v in x.iter_mut() {
        *v = (*v / scale).round_ties_even().clamp(-q, q) * scale;
    }
}

/// `x w^T`: `x` is `[n, k]` (tokens), `w` is `[m, k]` (a linear weight); the result `[n, m]`.
pub fn matmul_nt(x: &Mat, w: &Mat) -> Mat {
    assert_eq!(x.cols, w.cols, "inner dimensions");
    let (n, m, k) = (x.rows, w.rows, x.cols);
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 || k == 0 {
        return Mat::new(n, m, out);
    }
    const ROWS: usize = 32;
    out.par_chunks_mut(ROWS * m)
        .zip(x.data.par_chunks(ROWS * k))
        .for_each(|(o, xs)| {
            let rows = xs.len() / k;
            // SAFETY: `xs` is `rows x k` row-major (column stride 1, row stride k); `w` read with
            // column stride k and row stride 1 is `w^T`, `k x m`; `o` is `rows x m` row-major.
            // All three lie within their buffers.
            unsafe {
                gemm::gemm(
                    rows,
                    m,
                    k,
                    o.as_mut_ptr(),
                    1,
                    m as isize,
                    false,
                    xs.as_ptr(),
                    1,
                    k as isize,
                    w.data.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    Mat::new(n, m, out)
}

/// The weight a kernel multiplies by: `w` encoded in `format` (row `r` with clip `clips[r]`) and
/// decoded back to f32.
pub fn fake_quant_weight(w: &Mat, format: LinearFormat, clips: &[f32]) -> Result<Mat> {
    let bytes = encode_matrix(w, format, clips)?;
    decoded_weights(&bytes, format, w.rows, w.cols)
}

/// The weights a kernel multiplies for `rows` encoded rows of `format`: the codec's decoded
/// values, rounded to f16 for 16-bit-activation kernels (their float tiles hold f16 panels).
pub fn decoded_weights(
    bytes: &[u8],
    format: LinearFormat,
    rows: usize,
    cols: usize,
) -> Result<Mat> {
    let mut data = vec![0f32; rows * cols];
    let rb = format.row_bytes(cols)?;
    if bytes.len() != rb * rows {
        return Err(Error::InvalidArgument(format!(
            "{format}: {} bytes for {rows} rows of {cols}",
            bytes.len()
        )));
    }
    data.par_chunks_mut(cols)
        .zip(bytes.par_chunks(rb))
        .try_for_each(|(d, b)| format.codec.dequantize(b, cols, d))?;
    if format.act == ActQuant::F16 {
        data.iter_mut()
            .for_each(|x| *x = half::f16::from_f32(*x).to_f32());
    }
    Ok(Mat::new(rows, cols, data))
}

/// `sum (a - b)^2` in f64.
pub fn sq_err(a: &Mat, b: &Mat) -> f64 {
    assert_eq!(a.data.len(), b.data.len());
    a.data
        .par_chunks(4096)
        .zip(b.data.par_chunks(4096))
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .map(|(x, y)| {
                    let d = (x - y) as f64;
                    d * d
                })
                .sum::<f64>()
        })
        .sum()
}

/// Per output channel `r`: `sum_t (y[t, r] - yhat[t, r])^2`.
pub fn column_sq_err(y: &Mat, yhat: &Mat) -> Vec<f64> {
    assert_eq!((y.rows, y.cols), (yhat.rows, yhat.cols));
    let mut err = vec![0f64; y.cols];
    for (a, b) in y
        .data
        .chunks_exact(y.cols)
        .zip(yhat.data.chunks_exact(y.cols))
    {
        for ((e, &a), &b) in err.iter_mut().zip(a).zip(b) {
            let d = (a - b) as f64;
            *e += d * d;
        }
    }
    err
}

/// Sum of squares of a matrix, in f64.
pub fn sq_norm(y: &Mat) -> f64 {
    y.data.iter().map(|&v| (v as f64) * (v as f64)).sum()
}

/// The clip ratios searched for each output row: 1.0 down to 0.70 in steps of 0.02.
pub fn clip_grid() -> Vec<f32> {
    (0..=15).map(|i| 1.0 - 0.02 * i as f32).collect()
}

/// Per output row of `w`, the clip ratio from `grid` that minimizes the layer's output error
/// `|x w^T - xq Q(w)^T|^2` on the sampled tokens, where `xq` is the input as the kernel sees it
/// (run-time activation quantization applied). Rows are independent (a row's codes depend on
/// its clip only), so each row takes its own best ratio. Returns the ratios and the total error.
pub fn search_clips(
    w: &Mat,
    x: &Mat,
    xq: &Mat,
    format: LinearFormat,
    grid: &[f32],
) -> Result<(Vec<f32>, f64)> {
    let y = matmul_nt(x, w);
    let mut best = vec![(f64::INFINITY, 1.0f32); w.rows];
    for &c in grid {
        let wq = fake_quant_weight(w, format, &vec![c; w.rows])?;
        let err = column_sq_err(&y, &matmul_nt(xq, &wq));
        for (b, e) in best.iter_mut().zip(err) {
            // Strictly better only, so ties keep the larger (earlier) ratio.
            if e < b.0 {
                *b = (e, c);
            }
        }
    }
    let total = best.iter().map(|b| b.0).sum();
    Ok((best.into_iter().map(|b| b.1).collect(), total))
}

/// The calibration view of one linear-layer input that the searches read and the transforms
/// keep up to date: channel-wise max |x| and sampled rows.
#[derive(Debug, Clone)]
pub struct SiteData {
    pub absmax: Vec<f32>,
    pub samples: Mat,
    /// Tokens the capture saw at the site (an expert's: those routed to it).
    pub tokens: usize,
}

impl SiteData {
    /// Divides channel `j` by `s[j]` (what folding an input scale does to the activation).
    pub fn divide(&mut self, s: &[f32]) {
        let inv: Vec<f32> = s.iter().map(|v| 1.0 / v).collect();
        self.samples.scale_cols(&inv);
        self.absmax.iter_mut().zip(&inv).for_each(|(a, i)| *a *= i);
    }

    /// Channel `j` becomes channel `perm[j]` of before.
    pub fn permute(&mut self, perm: &[usize]) {
        self.samples.permute_cols(perm);
        self.absmax = perm.iter().map(|&p| self.absmax[p]).collect();
    }
}

/// Per input channel, the max |w| over the columns of the given weights.
pub fn col_absmax(ws: &[&Mat]) -> Vec<f32> {
    let k = ws[0].cols;
    let mut m = vec![0f32; k];
    for w in ws {
        assert_eq!(w.cols, k);
        for row in w.data.chunks_exact(k) {
            for (m, v) in m.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
    }
    m
}

/// o_proj's input channel `(query head h, d)` reads KV channel `(h / group, d)`: spreads one
/// value per KV channel over o_proj's input.
pub fn expand_kv(model: &DenseModel, kv: &[f32]) -> Vec<f32> {
    let c = &model.config;
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    (0..c.q_dim())
        .map(|j| kv[(j / hd / group) * hd + j % hd])
        .collect()
}

/// The max over the query heads of each KV group: one value per KV channel from o_proj's input.
pub fn reduce_kv_max(model: &DenseModel, q: &[f32]) -> Vec<f32> {
    let c = &model.config;
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    let mut out = vec![0f32; c.kv_dim()];
    for (j, &v) in q.iter().enumerate() {
        let o = &mut out[(j / hd / group) * hd + j % hd];
        *o = o.max(v);
    }
    out
}

/// SmoothQuant's migration scale `s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)`, normalized to
/// geometric mean 1 (a common factor changes no quantization error but can push weights or norm
/// gains towards the ends of the f16 range). Channels that never fire or have no weight get 1.
pub fn smooth_scale(x_absmax: &[f32], w_absmax: &[f32], alpha: f32) -> Vec<f32> {
    let mut s: Vec<f32> = x_absmax
        .iter()
        .zip(w_absmax)
        .map(|(&x, &w)| {
            if x > 0.0 && w > 0.0 {
                let v = (x as f64).powf(alpha as f64) / (w as f64).powf(1.0 - alpha as f64);
                if v.is_finite() && v > 0.0 {
                    v as f32
                } else {
                    1.0
                }
            } else {
                1.0
            }
        })
        .collect();
    let log_mean = s.iter().map(|v| (*v as f64).ln()).sum::<f64>() / s.len().max(1) as f64;
    let g = log_mean.exp() as f32;
    // Keep every factor well inside f32 after the division, whatever the statistics.
    s.iter_mut().for_each(|v| *v = (*v / g).clamp(1e-6, 1e6));
    s
}

/// The outcome of a smoothing-strength search at one input site.
#[derive(Debug, Clone)]
pub struct SmoothChoice {
    /// The chosen migration strength; `None` when no smoothing beat leaving the site alone.
    pub alpha: Option<f32>,
    /// The scale to fold (`kv_dim` entries for o_proj's input), all ones for `None`.
    pub scale: Vec<f32>,
    /// Summed output error of the readers with the chosen scale, and without any.
    pub error: f64,
    pub error_unsmoothed: f64,
}

/// Searches the SmoothQuant strength for input `site` of `layer`: for each `alpha`, the site's
/// activations are divided by [`smooth_scale`] and the readers' columns multiplied by it, both
/// are quantized (`formats[i]` for reader `i`, weights at clip 1, activations by `act`), and the
/// readers' summed output error on the samples is measured; the smallest wins. Leaving the site
/// unsmoothed is always a candidate, so the search never does worse than not smoothing on the
/// calibration data.
pub fn search_smoothing(
    model: &DenseModel,
    site: Site,
    data: &SiteData,
    alphas: &[f32],
    format: LinearFormat,
    act: ActSim,
) -> Result<SmoothChoice> {
    let ids = model.readers(site);
    // A sparse block's MLP input: each expert reads its own rows, not `data`'s.
    if ids.is_empty() || ids.iter().any(|id| id.input() != ids[0].input()) {
        return Err(Error::InvalidArgument(format!(
            "{site:?} is not one input read by its layers alike"
        )));
    }
    let site_kind = site.kind;
    let readers: Vec<&Mat> = ids.iter().map(|&id| model.linear(id)).collect();
    let x = &data.samples;
    let ys: Vec<Mat> = readers.iter().map(|w| matmul_nt(x, w)).collect();
    let wmax = col_absmax(&readers);
    let (xmax_site, wmax_site) = if site_kind == SiteKind::OIn {
        (
            reduce_kv_max(model, &data.absmax),
            reduce_kv_max(model, &wmax),
        )
    } else {
        (data.absmax.clone(), wmax)
    };
    let error_of = |scale: Option<&[f32]>| -> Result<f64> {
        let expanded = match scale {
            Some(s) if site_kind == SiteKind::OIn => Some(expand_kv(model, s)),
            Some(s) => Some(s.to_vec()),
            None => None,
        };
        let mut xs = x.clone();
        if let Some(s) = &expanded {
            xs.scale_cols(&s.iter().map(|v| 1.0 / v).collect::<Vec<_>>());
        }
        let xq = act.apply(&xs);
        let mut total = 0.0;
        for (w, y) in readers.iter().zip(&ys) {
            let mut w = (*w).clone();
            if let Some(s) = &expanded {
                w.scale_cols(s);
            }
            let wq = fake_quant_weight(&w, format, &vec![1.0; w.rows])?;
            total += column_sq_err(y, &matmul_nt(&xq, &wq)).iter().sum::<f64>();
        }
        Ok(total)
    };
    let error_unsmoothed = error_of(None)?;
    let mut choice = SmoothChoice {
        alpha: None,
        scale: vec![1.0; xmax_site.len()],
        error: error_unsmoothed,
        error_unsmoothed,
    };
    for &alpha in alphas {
        let s = smooth_scale(&xmax_site, &wmax_site, alpha);
        let e = error_of(Some(&s))?;
        if e < choice.error {
            choice = SmoothChoice {
                alpha: Some(alpha),
                scale: s,
                error: e,
                error_unsmoothed,
            };
        }
    }
    Ok(choice)
}

/// Folds a chosen smoothing scale into the model and into the site's calibration view.
pub fn apply_smoothing(
    model: &mut DenseModel,
    site: Site,
    data: &mut SiteData,
    scale: &[f32],
) -> Result<()> {
    model.fold_scale(site, scale)?;
    if site.kind == SiteKind::OIn {
        data.divide(&expand_kv(model, scale));
    } else {
        data.divide(scale);
    }
    Ok(())
}

/// Relative output error of one quantized layer: the float layer `x · wᵀ` against the kernels'
/// `Qa(x) · Wqᵀ` for `Wq` the encoded rows `bytes`, as `||Δy||² / ||y||²`. `x` and `w` are the
/// float model's (after any folds) input rows and weight for that layer. Tests and reports use it
/// to compare methods on equal terms, and on held-out rows it shows how a search's objective
/// transfers.
pub fn relative_layer_error(x: &Mat, w: &Mat, format: LinearFormat, bytes: &[u8]) -> Result<f64> {
    let wq = decoded_weights(bytes, format, w.rows, w.cols)?;
    let xq = ActSim::of(format.act).apply(x);
    let y = matmul_nt(x, w);
    Ok(sq_err(&matmul_nt(&xq, &wq), &y) / sq_norm(&y).max(f64::MIN_POSITIVE))
}

/// Every encoded layer's [`relative_layer_error`] on held-out `sequences`, each layer fed the
/// float activations of the model it belongs to (`q.dense`, transforms included).
pub fn layer_errors(
    q: &crate::pipeline::QuantizedModel,
    sequences: &[Vec<u32>],
    threads: usize,
) -> Result<BTreeMap<LinearId, f64>> {
    let (_, sites) = calibrate(&q.dense, sequences, threads, &mut |_, _| {})?;
    q.linears
        .iter()
        // An expert the held-out text never routes to has no error to report.
        .filter_map(|(&id, (format, bytes))| {
            let x = &sites.get(&id.input())?.samples;
            Some(relative_layer_error(x, q.dense.linear(id), *format, bytes).map(|e| (id, e)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_rule_matches_the_runtime_definition() {
        let mut x = vec![1.27f32, -0.635, 0.005, 0.0, 0.3];
        fake_quant_int(&mut x, 127);
        let s = 1.27f32 / 127.0;
        assert_eq!(x[0], 127.0 * s);
        // -0.635 / 0.01 = -63.5 ties to even: -64.
        assert_eq!(x[1], (-0.635f32 / s).round_ties_even() * s);
        assert_eq!(x[3], 0.0);
        let mut z = vec![0f32; 4];
        fake_quant_int(&mut z, 7);
        assert_eq!(z, vec![0.0; 4]);
    }

    #[test]
    fn mixed_blocks_use_int8_first_then_int4() {
        let row: Vec<f32> = (0..8).map(|i| (i as f32 + 1.0) * 0.1).collect();
        let x = Mat::new(1, 8, row.clone());
        let q = ActSim::Mixed {
            block: 4,
            int8_blocks: 1,
        }
        .apply(&x);
        // Block 0 (INT8) is nearly exact; block 1 (INT4) has steps of 0.8 / 7.
        for (q, x) in q.data[..4].iter().zip(&row[..4]) {
            assert!((q - x).abs() <= 0.4 / 127.0 * 0.5 + 1e-7);
        }
        let s4 = 0.8f32 / 7.0;
        for (q, x) in q.data[4..].iter().zip(&row[4..]) {
            assert_eq!(*q, (x / s4).round_ties_even() * s4);
        }
    }

    /// The simulation is bit for bit the run-time quantizers of `nibble_precision::act`.
    #[test]
    fn simulation_equals_the_runtime_quantizers() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let x = Mat::new(
            7,
            128,
            (0..7 * 128)
                .map(|i| rng.random_range(-1.0f32..1.0) * if i % 37 == 0 { 30.0 } else { 1.0 })
                .collect(),
        );
        for act in [
            ActQuant::F16,
            ActQuant::Int8PerToken,
            ActQuant::Fp8PerToken,
            ActQuant::Mixed4x8 {
                block: 32,
                int8_blocks: 1,
            },
            ActQuant::Mixed4x8 {
                block: 64,
                int8_blocks: 0,
            },
        ] {
            let sim = ActSim::of(act).apply(&x);
            for r in 0..x.rows {
                let want: Vec<f32> = act
                    .quantize_row(x.row(r))
                    .unwrap()
                    .dequantize_f64()
                    .into_iter()
                    .map(|v| v as f32)
                    .collect();
                assert_eq!(sim.row(r), &want[..], "{act} row {r}");
            }
        }
    }

    fn random(rows: usize, cols: usize, seed: u64) -> Mat {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        Mat::new(
            rows,
            cols,
            (0..rows * cols)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect(),
        )
    }

    #[test]
    fn matmul_matches_a_plain_loop() {
        for (n, m, k) in [(1, 1, 1), (37, 5, 19), (300, 33, 64)] {
            let (x, w) = (random(n, k, 1), random(m, k, 2));
            let y = matmul_nt(&x, &w);
            for i in 0..n {
                for j in 0..m {
                    let want: f64 = (0..k)
                        .map(|l| x.row(i)[l] as f64 * w.row(j)[l] as f64)
                        .sum();
                    let got = y.row(i)[j] as f64;
                    assert!((got - want).abs() < 1e-4, "({i},{j}): {got} vs {want}");
                }
            }
        }
    }

    /// The searched clip ratios never do worse than no clipping on the data searched, and on
    /// heavy-tailed rows some clip.
    #[test]
    fn clip_search_beats_no_clipping_row_by_row() {
        use nibble_precision::WeightCodec;
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let (rows, k, n) = (16, 64, 96);
        // Laplace weights: heavy enough tails that the largest weight of a row is worth clipping.
        let w = Mat::new(
            rows,
            k,
            (0..rows * k)
                .map(|_| {
                    let u: f32 = rng.random_range(1e-6..1.0);
                    if rng.random_bool(0.5) {
                        -u.ln()
                    } else {
                        u.ln()
                    }
                })
                .collect(),
        );
        let x = Mat::new(
            n,
            k,
            (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect(),
        );
        for codec in [
            WeightCodec::Qoq { group: 32 },
            WeightCodec::Int4Group { group: 0 },
        ] {
            let f = LinearFormat::new(codec, ActQuant::Int8PerToken).unwrap();
            let xq = ActSim::Int8PerToken.apply(&x);
            let (clips, total) = search_clips(&w, &x, &xq, f, &clip_grid()).unwrap();
            let y = matmul_nt(&x, &w);
            let chosen = column_sq_err(
                &y,
                &matmul_nt(&xq, &fake_quant_weight(&w, f, &clips).unwrap()),
            );
            let unclipped = column_sq_err(
                &y,
                &matmul_nt(&xq, &fake_quant_weight(&w, f, &[1.0; 16]).unwrap()),
            );
            assert!((chosen.iter().sum::<f64>() - total).abs() <= 1e-9 * total);
            for r in 0..rows {
                assert!(chosen[r] <= unclipped[r], "{codec} row {r}");
            }
            let (c, u) = (chosen.iter().sum::<f64>(), unclipped.iter().sum::<f64>());
            println!("{codec}: clips {clips:?}, error {c} vs {u} unclipped");
            assert!(clips.iter().any(|&c| c < 1.0) && c < u, "{codec}");
        }
    }

    #[test]
    fn smooth_scale_follows_the_formula_up_to_a_common_factor() {
        let x = [4.0f32, 1.0, 0.0, 9.0];
        let w = [1.0f32, 4.0, 2.0, 1.0];
        let s = smooth_scale(&x, &w, 0.5);
        // sqrt(4)/1 = 2, 1/2, 1 (dead channel), 3: ratios survive the normalization.
        assert!((s[0] / s[1] - 4.0).abs() < 1e-5);
        assert!((s[3] / s[0] - 1.5).abs() < 1e-5);
        let prod: f64 = s.iter().map(|v| *v as f64).product();
        assert!((prod - 1.0).abs() < 1e-5);
    }
}

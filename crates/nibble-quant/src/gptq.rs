//! GPTQ: quantize a layer's weight one input column at a time, and after each column push its
//! rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the
//! layer's squared output error, `H = 2 XᵀX / n` over the calibration tokens.
//!
//! The factorization follows the reference `fasterquant`: input channels that never fired
//! (`H_ii = 0`) get `H_ii = 1` and zero weight; `H += damp * mean(diag H) * I`; `U` is the upper
//! Cholesky factor of `H⁻¹`, and column `i` is quantized as `q = Q(w_i)`, then
//! `w_j -= (w_i - q) / U_ii * U_ij` for every later `j`. It is computed without forming `H⁻¹`:
//! with `J` the order reversal, `J H J = L Lᵀ` gives `H = R Rᵀ` for the upper triangular
//! `R = J L J`, so `H⁻¹ = (R⁻¹)ᵀ R⁻¹` and `U = R⁻¹`: one Cholesky and one triangular inverse.
//! When `H` is too ill-conditioned to factor, the damping is raised tenfold (up to three times)
//! before giving up.
//!
//! Each output row's updates touch only that row, so rows run in parallel; the lazy block updates
//! of the reference are a GPU memory-traffic optimization with the same arithmetic.
//!
//! Groups: a group's grid (scale and zero) is chosen from the row's weights as they stand when
//! the group's first column comes up, after the error feedback of earlier groups (the reference
//! with `static_groups=False`); per-channel codecs take one grid from the whole row before any
//! update. Every column is then rounded on its group's grid and the row is encoded by the codec
//! itself ([`WeightCodec::quantize_row_with`]), so the stored codes are exactly the values GPTQ
//! compensated for.
//!
//! With `act_order` (the default), columns are processed in decreasing `H_ii` order. The codec's
//! groups are contiguous in the original channel order, so a group no longer starts at one point
//! of the sweep: grids are then fixed up front from the unmodified weights (the reference's
//! `static_groups=True`, which it recommends with act-order).
//!
//! Why act-order is the default: in natural order GPTQ made the default model *worse* than RTN
//! (held-out ShareGPT perplexity 9.43 vs 9.34 at w4a16-g64) although every layer's output error
//! on ordinary tokens was two to four times lower. The loss was the attention sink. A sequence's
//! first token puts nearly all its energy into a few massive channels that ordinary tokens
//! barely use; the calibration holds one such token per sequence, so in `XᵀX` those channels
//! look cheap, and the sweep pushed the earlier columns' rounding error onto them. The sink's
//! q/k/v outputs then carried relative errors of 100-190% in layers 12-21 (RTN: 1-13%), and
//! every query attends to the sink. Act-order rounds the high-energy channels first, so no error
//! is ever pushed onto them (dev-set perplexity on calibration-half text: RTN 13.78, natural order
//! 14.53, act-order 13.06).
//!
//! The Hessians come from one capture of the float model (non-sequential GPTQ): later layers see
//! float inputs, not the outputs of already-quantized layers. This keeps calibration to one
//! forward pass; the reference's sequential variant re-runs each block on quantized inputs.
//!
//! A mixture-of-experts expert's Hessian is `X_eᵀ X_e` over the rows the router sent it only
//! (its gate/up and down inputs as it ran them), so its error compensation weighs the inputs it
//! serves. An expert routed fewer than [`crate::search::MIN_EXPERT_TOKENS`] tokens is RTN.

use std::collections::BTreeMap;

use nibble_core::{Error, Result};
use nibble_precision::weight::GroupGrid;
use nibble_precision::{LinearFormat, PrecisionSpec, WeightCodec};
use rayon::prelude::*;

use crate::capture::Calibration;
use crate::dense::{DenseModel, LinearId, Mat, Site};
use crate::pipeline::{Method, QuantizedModel, encode_matrix};
use crate::search::calibrated_input;

#[derive(Debug, Clone, Copy)]
pub struct GptqOptions {
    /// Dampening, as a fraction of the mean Hessian diagonal.
    pub damp: f64,
    /// Quantize columns in decreasing Hessian-diagonal order (with static group grids); the
    /// default, see the module documentation.
    pub act_order: bool,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions {
            damp: 0.01,
            act_order: true,
        }
    }
}

/// Quantizes every linear layer of `model` with GPTQ from the Gram matrices in `calib`.
pub fn gptq(
    model: DenseModel,
    spec: PrecisionSpec,
    calib: &Calibration,
    opts: &GptqOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    let format = check(&model, &spec, opts)?;
    let ids = model.linear_ids();
    let mut linears = BTreeMap::new();
    quantize_linears(&model, format, calib, opts, &ids, &mut linears, &mut |d| {
        progress("gptq", d, ids.len())
    })?;
    Ok(QuantizedModel {
        spec,
        method: Method::Gptq,
        dense: model,
        linears,
    })
}

/// Bytes of the Hessians (`k x k` f64 per input site) of each layer of `model`.
pub fn hessian_bytes_per_layer(model: &DenseModel) -> Vec<usize> {
    let mut out = vec![0usize; model.config.num_layers];
    let mut seen = std::collections::BTreeSet::new();
    for id in model.linear_ids() {
        if seen.insert(id.input()) {
            let k = model.linear(id).cols;
            out[id.layer] += k * k * 8;
        }
    }
    out
}

/// Consecutive windows of layers whose Hessians fit `budget` bytes together (a layer alone
/// larger than the budget gets a window of its own).
pub fn hessian_windows(per_layer: &[usize], budget: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &b) in per_layer.iter().enumerate() {
        if i > start && bytes + b > budget {
            out.push((start, i));
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < per_layer.len() {
        out.push((start, per_layer.len()));
    }
    out
}

/// [`gptq`] holding at most about `budget` bytes of Hessians at once: the calibration runs once
/// per window of layers ([`hessian_windows`]), each time keeping only that window's Hessians,
/// and the window's layers are quantized before the next. The result is [`gptq`]'s bit for bit
/// (the Hessians come from the float model either way); a Mixtral-sized model, whose Hessians
/// all together would take hundreds of GB, costs a calibration pass per window instead.
#[allow(clippy::too_many_arguments)]
pub fn gptq_windowed(
    model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    threads: usize,
    budget: usize,
    opts: &GptqOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    let format = check(&model, &spec, opts)?;
    let windows = hessian_windows(&hessian_bytes_per_layer(&model), budget);
    let ids = model.linear_ids();
    let mut linears = BTreeMap::new();
    for &(a, b) in &windows {
        let capture = crate::capture::CaptureOptions {
            hessian: true,
            max_samples: 1,
            sample_stride: crate::search::sample_stride(calibration, 1),
            sample_first: false,
            attention_sequences: 0,
            hessian_layers: Some((a, b)),
        };
        let calib = crate::capture::capture(&model, calibration, capture, threads, &mut |d, t| {
            progress(&format!("calibration (layers {a}..{b})"), d, t)
        })?;
        let window: Vec<LinearId> = ids
            .iter()
            .copied()
            .filter(|id| (a..b).contains(&id.layer))
            .collect();
        let done = linears.len();
        quantize_linears(
            &model,
            format,
            &calib,
            opts,
            &window,
            &mut linears,
            &mut |d| progress("gptq", done + d, ids.len()),
        )?;
    }
    Ok(QuantizedModel {
        spec,
        method: Method::Gptq,
        dense: model,
        linears,
    })
}

/// What every GPTQ run checks first; gives the linear format.
fn check(model: &DenseModel, spec: &PrecisionSpec, opts: &GptqOptions) -> Result<LinearFormat> {
    Method::Gptq.check(spec)?;
    let format = spec
        .linear
        .linear_format(0)
        .expect("GPTQ's schemes are quantized");
    if !(opts.damp > 0.0 && opts.damp.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "GPTQ dampening must be positive, got {}",
            opts.damp
        )));
    }
    crate::search::check_finite(model)?;
    Ok(format)
}

/// GPTQ of the linear layers `ids` from the Hessians in `calib`, into `linears`; `progress(n)`
/// after each of them.
fn quantize_linears(
    model: &DenseModel,
    format: LinearFormat,
    calib: &Calibration,
    opts: &GptqOptions,
    ids: &[LinearId],
    linears: &mut BTreeMap<LinearId, (LinearFormat, Vec<u8>)>,
    progress: &mut dyn FnMut(usize),
) -> Result<()> {
    // Layers reading one input (q/k/v, gate/up) are consecutive and share its factor.
    let mut factor: Option<(Site, HessianFactor)> = None;
    for (done, &id) in ids.iter().enumerate() {
        let name = || model.linear_name(id);
        let input = id.input();
        // An expert calibration (nearly) never routed to has no Hessian worth the name: RTN.
        let Some(stats) = calibrated_input(calib, id)? else {
            let w = model.linear(id);
            let bytes = encode_matrix(w, format, &vec![1.0; w.rows])
                .map_err(|e| Error::InvalidArgument(format!("{}: {e}", name())))?;
            linears.insert(id, (format, bytes));
            progress(done + 1);
            continue;
        };
        if factor.as_ref().is_none_or(|(s, _)| *s != input) {
            let gram = stats.hessian.as_ref().ok_or_else(|| {
                Error::InvalidArgument(
                    "GPTQ needs a calibration captured with Hessians (CaptureOptions::hessian)"
                        .into(),
                )
            })?;
            let f = HessianFactor::new(gram, stats.absmax.len(), stats.tokens, opts)
                .map_err(|e| Error::InvalidArgument(format!("GPTQ {input:?}: {e}")))?;
            factor = Some((input, f));
        }
        let f = &factor.as_ref().expect("set above").1;
        let bytes = quantize_matrix(model.linear(id), format.codec, f)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", name())))?;
        linears.insert(id, (format, bytes));
        progress(done + 1);
    }
    Ok(())
}

/// What GPTQ needs from one input site's Hessian, shared by every layer reading it.
#[derive(Debug, Clone)]
pub struct HessianFactor {
    k: usize,
    /// Processing order: `order[p]` is the input channel quantized at step `p`.
    order: Vec<usize>,
    /// Upper Cholesky factor of the (damped, permuted) inverse Hessian, `k x k` row-major.
    u: Vec<f32>,
    /// Channels with no signal, whose weights are zeroed.
    dead: Vec<bool>,
    act_order: bool,
}

impl HessianFactor {
    /// From the accumulated Gram matrix `XᵀX` (`k x k`, f64) over `tokens` rows.
    pub fn new(gram: &[f64], k: usize, tokens: usize, opts: &GptqOptions) -> Result<Self> {
        if gram.len() != k * k || tokens == 0 {
            return Err(Error::InvalidArgument(format!(
                "a {k}-channel Hessian needs {} entries and some tokens, got {} over {tokens}",
                k * k,
                gram.len()
            )));
        }
        let scale = 2.0 / tokens as f64;
        let mut h: Vec<f64> = gram.iter().map(|v| v * scale).collect();
        if let Some(i) = h.iter().position(|v| !v.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "the Hessian holds a non-finite value at ({}, {})",
                i / k,
                i % k
            )));
        }
        let mut dead = vec![false; k];
        for (i, d) in dead.iter_mut().enumerate() {
            if h[i * k + i] == 0.0 {
                *d = true;
                h[i * k + i] = 1.0;
            }
        }
        let order: Vec<usize> = if opts.act_order {
            let mut o: Vec<usize> = (0..k).collect();
            // Stable, so ties keep channel order and the factor is deterministic.
            o.sort_by(|&a, &b| h[b * k + b].total_cmp(&h[a * k + a]));
            o
        } else {
            (0..k).collect()
        };
        // Reversed (and permuted) order: rev[i][j] = H[order[k-1-i]][order[k-1-j]].
        let mut rev = vec![0f64; k * k];
        for i in 0..k {
            let oi = order[k - 1 - i];
            for j in 0..k {
                rev[i * k + j] = h[oi * k + order[k - 1 - j]];
            }
        }
        let mean_diag = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
        let mut damp = opts.damp;
        let mut attempt = 0;
        let l = loop {
            let mut a = rev.clone();
            for i in 0..k {
                a[i * k + i] += damp * mean_diag;
            }
            match cholesky_lower(&mut a, k) {
                Ok(()) => break a,
                Err(_) if attempt < 3 => {
                    attempt += 1;
                    damp *= 10.0;
                }
                Err(e) => {
                    return Err(Error::InvalidArgument(format!(
                        "the Hessian is not positive definite even with dampening {damp}: {e}"
                    )));
                }
            }
        };
        let m = invert_lower(&l, k);
        // U = J M J: U[i][j] = M[k-1-i][k-1-j], upper triangular.
        let mut u = vec![0f32; k * k];
        for i in 0..k {
            for j in i..k {
                u[i * k + j] = m[(k - 1 - i) * k + (k - 1 - j)] as f32;
            }
        }
        Ok(HessianFactor {
            k,
            order,
            u,
            dead,
            act_order: opts.act_order,
        })
    }
}

/// Quantizes every row of `w` with GPTQ; the rows in `codec`'s layout.
pub fn quantize_matrix(w: &Mat, codec: WeightCodec, f: &HessianFactor) -> Result<Vec<u8>> {
    if w.cols != f.k {
        return Err(Error::InvalidArgument(format!(
            "a weight of {} columns with a {}-channel Hessian",
            w.cols, f.k
        )));
    }
    let rb = codec.row_bytes(w.cols)?;
    let mut out = vec![0u8; rb * w.rows];
    out.par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, o)| quantize_row(w.row(r), codec, f, o))?;
    Ok(out)
}

/// GPTQ on one row: rounds column by column with error feedback, then encodes the row with the
/// grids and the values as they were when each column was rounded.
fn quantize_row(row: &[f32], codec: WeightCodec, f: &HessianFactor, out: &mut [u8]) -> Result<()> {
    let k = f.k;
    let groups = codec.groups(k);
    let gl = k / groups;
    let mut w = vec![0f32; k];
    for (p, &c) in f.order.iter().enumerate() {
        w[p] = if f.dead[c] { 0.0 } else { row[c] };
    }
    let mut grids: Vec<Option<GroupGrid>> = vec![None; groups];
    if f.act_order {
        let mut orig = row.to_vec();
        for (c, v) in orig.iter_mut().enumerate() {
            if f.dead[c] {
                *v = 0.0;
            }
        }
        for (g, grid) in grids.iter_mut().enumerate() {
            *grid = Some(codec.group_grid(&orig[g * gl..(g + 1) * gl], 1.0)?);
        }
    }
    // The value of each original channel when it was rounded.
    let mut rounded_from = vec![0f32; k];
    for p in 0..k {
        let c = f.order[p];
        let g = c / gl;
        if grids[g].is_none() {
            // Without act-order the order is the identity, so the group is w[p..p + gl].
            grids[g] = Some(codec.group_grid(&w[p..p + gl], 1.0)?);
        }
        let grid = grids[g].as_ref().expect("set above");
        let x = w[p];
        let q = grid.value(x);
        rounded_from[c] = x;
        let urow = &f.u[p * k..(p + 1) * k];
        let err = (x - q) / urow[p];
        for (wj, &uj) in w[p + 1..].iter_mut().zip(&urow[p + 1..]) {
            *wj -= err * uj;
        }
    }
    let grids: Vec<GroupGrid> = grids
        .into_iter()
        .map(|g| g.expect("every group has a column"))
        .collect();
    codec.quantize_row_with(&rounded_from, &grids, out)
}

/// In-place lower Cholesky factor of the symmetric `a` (`k x k`); the upper triangle is zeroed.
fn cholesky_lower(a: &mut [f64], k: usize) -> std::result::Result<(), String> {
    for i in 0..k {
        for j in 0..=i {
            let (ri, rj) = (i * k, j * k);
            let s = a[ri + j] - dot(&a[ri..ri + j], &a[rj..rj + j]);
            if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return Err(format!("pivot {i} is {s}"));
                }
                a[ri + i] = s.sqrt();
            } else {
                a[ri + j] = s / a[rj + j];
            }
        }
        a[i * k + i + 1..(i + 1) * k].fill(0.0);
    }
    Ok(())
}

/// The inverse of a lower triangular `l` (`k x k`), row by row: row `i` of `M = L⁻¹` is
/// `(e_i - sum_{p<i} L_ip M_p) / L_ii`, an axpy per earlier row.
fn invert_lower(l: &[f64], k: usize) -> Vec<f64> {
    let mut m = vec![0f64; k * k];
    for i in 0..k {
        let (done, rest) = m.split_at_mut(i * k);
        let mi = &mut rest[..k];
        mi[i] = 1.0;
        for p in 0..i {
            let c = l[i * k + p];
            if c != 0.0 {
                for (a, &b) in mi[..=p].iter_mut().zip(&done[p * k..p * k + p + 1]) {
                    *a -= c * b;
                }
            }
        }
        let d = l[i * k + i];
        mi[..=i].iter_mut().for_each(|v| *v /= d);
    }
    m
}

/// A dot product with four independent accumulators, which the compiler vectorizes.
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    acc[0] + acc[1] + acc[2] + acc[3] + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn spd(k: usize, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let x: Vec<f64> = (0..3 * k * k)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut h = vec![0f64; k * k];
        for row in x.chunks_exact(k) {
            for i in 0..k {
                for j in 0..k {
                    h[i * k + j] += row[i] * row[j];
                }
            }
        }
        h
    }

    #[test]
    fn factor_is_the_upper_cholesky_of_the_inverse() {
        let k = 13;
        let gram = spd(k, 1);
        let opts = GptqOptions {
            damp: 1e-9,
            act_order: false,
        };
        let f = HessianFactor::new(&gram, k, 2, &opts).unwrap();
        // UᵀU H = I for H = gram (2 / 2 = 1) plus the tiny damping.
        for i in 0..k {
            for j in 0..k {
                let mut v = 0f64;
                for a in 0..k {
                    let uu: f64 = (0..k)
                        .map(|p| f.u[p * k + i] as f64 * f.u[p * k + a] as f64)
                        .sum();
                    v += uu * gram[a * k + j];
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-3, "({i},{j}) = {v}");
            }
            for j in 0..i {
                assert_eq!(f.u[i * k + j], 0.0);
            }
        }
    }

    /// A synthetic layer whose inputs have correlated channels and a few large ones: GPTQ's
    /// output error on held-out rows is well below RTN's, for every codec it serves, and its
    /// rows are ordinary codec rows.
    #[test]
    fn beats_rtn_on_a_synthetic_layer() {
        use crate::sim::{decoded_weights, matmul_nt, sq_err};
        use nibble_precision::{ActQuant, LinearFormat};
        let (k, rows) = (128, 24);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut inputs = |n: usize| {
            let mut x = Mat::new(n, k, vec![0f32; n * k]);
            for t in 0..n {
                let common: f32 = rng.random_range(-1.0..1.0);
                for j in 0..k {
                    let big = if j % 37 == 5 { 12.0 } else { 1.0 };
                    x.row_mut(t)[j] = big * (0.7 * common + 0.3 * rng.random_range(-1.0..1.0));
                }
            }
            x
        };
        let (calib, held) = (inputs(512), inputs(256));
        let w = Mat::new(
            rows,
            k,
            (0..rows * k)
                .map(|_| rng.random_range(-1.0f32..1.0) * 0.05)
                .collect(),
        );
        let gram: Vec<f64> = crate::capture::gram(&calib.data, calib.rows, k)
            .into_iter()
            .map(f64::from)
            .collect();
        let y_ref = matmul_nt(&held, &w);
        for (codec, act_order) in [
            (WeightCodec::Int4Group { group: 32 }, false),
            (WeightCodec::Int4Group { group: 32 }, true),
            (WeightCodec::Int4Group { group: 0 }, false),
            (WeightCodec::Int8PerChannel, false),
        ] {
            let opts = GptqOptions {
                act_order,
                ..Default::default()
            };
            let f = HessianFactor::new(&gram, k, calib.rows, &opts).unwrap();
            let format = LinearFormat::new(codec, ActQuant::F16).unwrap();
            let err = |bytes: &[u8]| {
                let wq = decoded_weights(bytes, format, rows, k).unwrap();
                sq_err(&matmul_nt(&held, &wq), &y_ref)
            };
            let gptq = err(&quantize_matrix(&w, codec, &f).unwrap());
            let rtn = err(&crate::pipeline::encode_matrix(&w, format, &[1.0; 24]).unwrap());
            assert!(
                gptq < 0.7 * rtn,
                "{codec} act_order={act_order}: GPTQ {gptq:.3e} vs RTN {rtn:.3e}"
            );
        }
    }

    /// GPTQ as the paper's Algorithm 1 / the reference `fasterquant` state it, transcribed
    /// directly in f64: `H = 2 XᵀX / n + damp * mean(diag) * I`, `H⁻¹` by Gauss-Jordan, its upper
    /// Cholesky factor `U` (`H⁻¹ = UᵀU`), then per column: a group's grid from the current
    /// (already updated) weights when the group starts, round, and push `(w - q) / U_ii * U_i,j`
    /// onto the later columns. Returns the dequantized weights.
    fn reference_gptq(w: &Mat, x: &Mat, group: usize, damp: f64) -> Mat {
        let (k, n) = (w.cols, x.rows);
        let mut h = vec![0f64; k * k];
        for t in 0..n {
            let r = x.row(t);
            for i in 0..k {
                for j in 0..k {
                    h[i * k + j] += 2.0 * r[i] as f64 * r[j] as f64 / n as f64;
                }
            }
        }
        let mean = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
        (0..k).for_each(|i| h[i * k + i] += damp * mean);
        // Gauss-Jordan inverse.
        let mut a = h.clone();
        let mut inv: Vec<f64> = (0..k * k)
            .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
            .collect();
        for c in 0..k {
            let p = a[c * k + c];
            for j in 0..k {
                a[c * k + j] /= p;
                inv[c * k + j] /= p;
            }
            for r in (0..k).filter(|&r| r != c) {
                let f = a[r * k + c];
                for j in 0..k {
                    a[r * k + j] -= f * a[c * k + j];
                    inv[r * k + j] -= f * inv[c * k + j];
                }
            }
        }
        // Upper Cholesky: inv = Uᵀ U.
        let mut u = vec![0f64; k * k];
        for i in 0..k {
            for j in i..k {
                let s: f64 =
                    inv[i * k + j] - (0..i).map(|p| u[p * k + i] * u[p * k + j]).sum::<f64>();
                u[i * k + j] = if i == j { s.sqrt() } else { s / u[i * k + i] };
            }
        }
        let codec = WeightCodec::Int4Group {
            group: group as u32,
        };
        let mut out = w.clone();
        for r in 0..w.rows {
            let mut row: Vec<f64> = w.row(r).iter().map(|&v| v as f64).collect();
            let mut grid = None;
            for i in 0..k {
                if i % group == 0 {
                    let g: Vec<f32> = row[i..i + group].iter().map(|&v| v as f32).collect();
                    grid = Some(codec.group_grid(&g, 1.0).unwrap());
                }
                let q = grid.as_ref().unwrap().value(row[i] as f32) as f64;
                out.row_mut(r)[i] = q as f32;
                let e = (row[i] - q) / u[i * k + i];
                for j in i + 1..k {
                    row[j] -= e * u[i * k + j];
                }
            }
        }
        out
    }

    /// Our GPTQ against the direct transcription on a layer with correlated, outlier-heavy
    /// inputs: the same quantized weights (up to the odd rounding tie the f32 factor breaks the
    /// other way), and both well below RTN's output error on the calibration rows.
    #[test]
    fn matches_a_direct_transcription_of_the_paper() {
        use crate::sim::{decoded_weights, matmul_nt, sq_err};
        use nibble_precision::{ActQuant, LinearFormat};
        let (k, rows, n, group) = (64, 12, 300, 16);
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut x = Mat::new(n, k, vec![0f32; n * k]);
        for t in 0..n {
            let common: f32 = rng.random_range(-1.0..1.0);
            for j in 0..k {
                let big = if j % 13 == 2 { 8.0 } else { 1.0 };
                x.row_mut(t)[j] = big * (0.6 * common + 0.4 * rng.random_range(-1.0..1.0));
            }
        }
        let w = Mat::new(
            rows,
            k,
            (0..rows * k)
                .map(|_| rng.random_range(-0.1f32..0.1))
                .collect(),
        );
        let want = reference_gptq(&w, &x, group, 0.01);
        let gram: Vec<f64> = crate::capture::gram(&x.data, n, k)
            .into_iter()
            .map(f64::from)
            .collect();
        let natural = GptqOptions {
            act_order: false,
            ..Default::default()
        };
        let f = HessianFactor::new(&gram, k, n, &natural).unwrap();
        let codec = WeightCodec::Int4Group {
            group: group as u32,
        };
        let format = LinearFormat::new(codec, ActQuant::F16).unwrap();
        let got =
            decoded_weights(&quantize_matrix(&w, codec, &f).unwrap(), format, rows, k).unwrap();
        let same = got
            .data
            .iter()
            .zip(&want.data)
            .filter(|(a, b)| (*a - half::f16::from_f32(**b).to_f32()).abs() <= 1e-6)
            .count();
        assert!(
            same * 100 >= 99 * got.data.len(),
            "{same} of {} equal",
            got.data.len()
        );
        let y = matmul_nt(&x, &w);
        let rtn = decoded_weights(
            &crate::pipeline::encode_matrix(&w, format, &vec![1.0; rows]).unwrap(),
            format,
            rows,
            k,
        )
        .unwrap();
        let (e_got, e_want, e_rtn) = (
            sq_err(&matmul_nt(&x, &got), &y),
            sq_err(&matmul_nt(&x, &want), &y),
            sq_err(&matmul_nt(&x, &rtn), &y),
        );
        assert!(
            (e_got - e_want).abs() <= 0.02 * e_want,
            "{e_got} vs reference {e_want}"
        );
        assert!(e_got < 0.7 * e_rtn, "GPTQ {e_got} vs RTN {e_rtn}");
    }

    /// Rare tokens whose energy sits in channels the others barely use (the attention sink's
    /// shape after RMSNorm): the default GPTQ (act-order) keeps their output error below RTN's
    /// while beating RTN on all tokens. (On the default model natural order broke exactly such
    /// tokens; see the module documentation. This small layer does not reproduce that failure,
    /// so the test pins the default and its behaviour, not the contrast.)
    #[test]
    fn act_order_default_keeps_rare_tokens() {
        use crate::sim::{decoded_weights, matmul_nt, sq_err};
        use nibble_precision::{ActQuant, LinearFormat};
        let (k, rows, n) = (128, 16, 1024);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let massive = [40usize, 100];
        let mut x = Mat::new(n, k, vec![0f32; n * k]);
        for t in 0..n {
            let sink = t % 64 == 0;
            let common: f32 = rng.random_range(-1.0..1.0);
            for j in 0..k {
                let v = 0.5 * common + 0.5 * rng.random_range(-1.0f32..1.0);
                x.row_mut(t)[j] = match (sink, massive.contains(&j)) {
                    (true, true) => 1.0,
                    (true, false) => 0.01 * v,
                    (false, true) => 0.02 * v,
                    (false, false) => v,
                };
            }
        }
        let w = Mat::new(
            rows,
            k,
            (0..rows * k)
                .map(|_| rng.random_range(-0.1f32..0.1))
                .collect(),
        );
        let gram: Vec<f64> = crate::capture::gram(&x.data, n, k)
            .into_iter()
            .map(f64::from)
            .collect();
        let codec = WeightCodec::Int4Group { group: 32 };
        let format = LinearFormat::new(codec, ActQuant::F16).unwrap();
        let sinks = Mat::new(
            n / 64,
            k,
            (0..n).step_by(64).flat_map(|t| x.row(t).to_vec()).collect(),
        );
        // Relative output error on the rare tokens and on all tokens.
        let errors = |bytes: &[u8]| {
            let wq = decoded_weights(bytes, format, rows, k).unwrap();
            let rel = |x: &Mat| {
                let y = matmul_nt(x, &w);
                sq_err(&matmul_nt(x, &wq), &y)
                    / sq_err(&y, &Mat::new(y.rows, y.cols, vec![0.0; y.data.len()]))
            };
            (rel(&sinks), rel(&x))
        };
        let rtn = errors(&crate::pipeline::encode_matrix(&w, format, &[1.0; 16]).unwrap());
        let run = |act_order| {
            let opts = GptqOptions {
                act_order,
                ..Default::default()
            };
            let f = HessianFactor::new(&gram, k, n, &opts).unwrap();
            errors(&quantize_matrix(&w, codec, &f).unwrap())
        };
        let (natural, ordered) = (run(false), run(true));
        println!(
            "rare/all relative error: RTN {rtn:?}, natural {natural:?}, act-order {ordered:?}"
        );
        assert!(
            ordered.0 < rtn.0,
            "act-order keeps the rare tokens: {ordered:?} vs {rtn:?}"
        );
        assert!(
            ordered.1 < 0.6 * rtn.1,
            "and beats RTN overall: {ordered:?} vs {rtn:?}"
        );
        assert!(GptqOptions::default().act_order);
    }

    #[test]
    fn singular_hessians_are_damped_and_dead_channels_zeroed() {
        let k = 8;
        // Rank one, channel 3 silent.
        let v = [1.0, 2.0, -1.0, 0.0, 0.5, 1.5, -2.0, 1.0];
        let gram: Vec<f64> = (0..k * k).map(|i| v[i / k] * v[i % k]).collect();
        let f = HessianFactor::new(&gram, k, 1, &GptqOptions::default()).unwrap();
        assert!(f.dead[3] && f.dead.iter().filter(|&&d| d).count() == 1);
        assert!(f.u.iter().all(|x| x.is_finite()));
        let w = Mat::new(1, k, vec![0.3; k]);
        let bytes = quantize_matrix(&w, WeightCodec::Int8PerChannel, &f).unwrap();
        assert_eq!(bytes[3], 0, "the dead channel's weight is zeroed");
        let bad = vec![f64::NAN; k * k];
        assert!(HessianFactor::new(&bad, k, 1, &GptqOptions::default()).is_err());
        assert!(HessianFactor::new(&gram, k + 1, 1, &GptqOptions::default()).is_err());
    }
}

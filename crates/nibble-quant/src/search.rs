//! What the calibrated searches (AWQ, GPTQ, SmoothQuant) share: running the calibration capture,
//! replaying a linear layer on sampled input rows exactly as the run-time kernels will compute it
//! (codec rounding of the weights, per-token quantization of the activations), and the bookkeeping
//! of an input site (the layers reading it, its per-KV-channel statistics for o_proj).

use nibble_core::{Error, Result};
use nibble_precision::{ActQuant, LinearFormat};
use rayon::prelude::*;

use crate::capture::{Calibration, CaptureOptions, SiteStats, capture};
use crate::dense::{DenseModel, LinearId, Mat, SiteKind};
use crate::pipeline::encode_matrix;

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
    // Before the forward passes, not after: a bad weight should cost no calibration time.
    check_finite(model)?;
    let opts = CaptureOptions {
        hessian,
        max_samples: rows,
        sample_stride: sample_stride(sequences, rows),
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
                id.name()
            )));
        }
    }
    Ok(())
}

/// The statistics of a site, refusing a site the capture did not see or saw no rows of.
pub fn site_stats(calib: &Calibration, layer: usize, site: SiteKind) -> Result<&SiteStats> {
    let s = calib.sites.get(&(layer, site)).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the calibration has no statistics for layer {layer} {site:?}"
        ))
    })?;
    if s.samples.rows == 0 || s.tokens == 0 {
        return Err(Error::InvalidArgument(format!(
            "the calibration kept no input rows for layer {layer} {site:?}"
        )));
    }
    Ok(s)
}

/// The weights of every layer reading `site`, stacked by rows (q, k, v or gate, up): the output
/// error of the site is the sum of theirs, and rows are quantized independently, so one stacked
/// matrix replays them all at once.
pub fn site_weights(model: &DenseModel, layer: usize, site: SiteKind) -> Mat {
    let readers = site.readers();
    let cols = model
        .linear(LinearId {
            layer,
            kind: readers[0],
        })
        .cols;
    let mut data = Vec::new();
    let mut rows = 0;
    for &kind in readers {
        let w = model.linear(LinearId { layer, kind });
        data.extend_from_slice(&w.data);
        rows += w.rows;
    }
    Mat::new(rows, cols, data)
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

/// Folds `s` (one factor per KV channel for o_proj) into `site` of `layer` and divides the site's
/// recorded inputs by it. The fold keeps the output of every layer reading the site, so no other
/// site's input changes and the recorded statistics stay exact without a second capture.
pub fn fold_site(
    model: &mut DenseModel,
    calib: &mut Calibration,
    layer: usize,
    site: SiteKind,
    s: &[f32],
) -> Result<()> {
    model.fold_input_scale(layer, site, s)?;
    let full = per_channel(model, site, s);
    if let Some(stats) = calib.sites.get_mut(&(layer, site)) {
        stats.divide_channels(&full);
    }
    Ok(())
}

/// `x · wᵀ` (`x` is `n x k`, `w` is `m x k`), f32, split over the rayon pool by rows of `x`.
pub fn matmul_nt(x: &Mat, w: &Mat) -> Mat {
    assert_eq!(x.cols, w.cols, "inner dimensions");
    let (n, m, k) = (x.rows, w.rows, x.cols);
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return Mat::new(n, m, out);
    }
    let chunk = n.div_ceil(rayon::current_num_threads().max(1)).max(16);
    out.par_chunks_mut(chunk * m)
        .zip(x.data.par_chunks(chunk * k))
        .for_each(|(o, xs)| {
            let rows = xs.len() / k;
            // SAFETY: `o` is `rows x m` row-major (column stride 1, row stride m); `xs` is
            // `rows x k` row-major; `w` read as `k x m` has element (l, j) at `j * k + l`.
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

/// The weights a kernel multiplies after `w` is encoded in `format` (row `r` with clip ratio
/// `clips[r]`, or 1): the codec's decoded values, rounded to f16 for 16-bit-activation kernels.
pub fn kernel_weights(w: &Mat, format: LinearFormat, clips: Option<&[f32]>) -> Result<Mat> {
    let ones;
    let clips = match clips {
        Some(c) => c,
        None => {
            ones = vec![1.0; w.rows];
            &ones
        }
    };
    let bytes = encode_matrix(w, format, clips)?;
    decoded_weights(&bytes, format, w.rows, w.cols)
}

/// The weights a kernel multiplies for `rows` encoded rows of `format`.
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
        round_f16(&mut data);
    }
    Ok(Mat::new(rows, cols, data))
}

fn round_f16(v: &mut [f32]) {
    for x in v {
        *x = half::f16::from_f32(*x).to_f32();
    }
}

/// Activation rows as the kernels see them: each row quantized by the run-time rules of `act`
/// (per-token INT8 or FP8 scale from the row's max, f16 rounding for 16-bit activations) and
/// expanded back to the values the codes stand for.
pub fn kernel_acts(x: &Mat, act: ActQuant) -> Result<Mat> {
    let mut data = vec![0f32; x.data.len()];
    data.par_chunks_mut(x.cols)
        .zip(x.data.par_chunks(x.cols))
        .try_for_each(|(o, row)| -> Result<()> {
            let q = act.quantize_row(row)?;
            for (o, v) in o.iter_mut().zip(q.dequantize_f64()) {
                *o = v as f32;
            }
            Ok(())
        })?;
    Ok(Mat::new(x.rows, x.cols, data))
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

/// Squared output error of a site after folding `s` (one factor per input channel): the
/// reference `y_ref = x · wᵀ` against `Qa(x / s) · Qw(w · diag(s))ᵀ`, with the quantizers of
/// `format` applied as the kernels apply them.
pub fn scaled_error(x: &Mat, w: &Mat, y_ref: &Mat, s: &[f32], format: LinearFormat) -> Result<f64> {
    let mut ws = w.clone();
    ws.scale_cols(s);
    let wq = kernel_weights(&ws, format, None)?;
    let mut xs = x.clone();
    let inv: Vec<f32> = s.iter().map(|v| 1.0 / v).collect();
    xs.scale_cols(&inv);
    let xq = kernel_acts(&xs, format.act)?;
    Ok(sq_err(&matmul_nt(&xq, &wq), y_ref))
}

/// Relative output error of one quantized layer: the float layer `x · wᵀ` against the kernels'
/// `Qa(x) · Wqᵀ` for `Wq` the encoded rows `bytes`, as `||Δy||² / ||y||²`. `x` and `w` are the
/// float model's (after any folds) input rows and weight for that layer. Tests and reports use it
/// to compare methods on equal terms.
pub fn relative_layer_error(x: &Mat, w: &Mat, format: LinearFormat, bytes: &[u8]) -> Result<f64> {
    let y_ref = matmul_nt(x, w);
    let wq = decoded_weights(bytes, format, w.rows, w.cols)?;
    let y = matmul_nt(&kernel_acts(x, format.act)?, &wq);
    let norm: f64 = y_ref.data.iter().map(|&v| (v as f64) * (v as f64)).sum();
    Ok(sq_err(&y, &y_ref) / norm.max(f64::MIN_POSITIVE))
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
            let wq = kernel_weights(&w, format, None).unwrap();
            let xq = kernel_acts(&x, format.act).unwrap();
            sq_err(&matmul_nt(&xq, &wq), &y_ref)
        };
        let via = scaled_error(&x, &w, &y_ref, &[1.0; 64], format).unwrap();
        assert_eq!(direct, via);
        assert!(direct > 0.0);
    }

    #[test]
    fn int8_activations_follow_the_per_token_rule() {
        let x = Mat::new(1, 4, vec![127.0, -63.4, 0.5, 2.5]);
        let q = kernel_acts(&x, ActQuant::Int8PerToken).unwrap();
        // Scale 1: values round to nearest, ties to even.
        assert_eq!(q.data, vec![127.0, -63.0, 0.0, 2.0]);
    }
}

//! QoQ, LiquidQuant and FMPQ on the tiny fixture models: every transform keeps the float
//! function (logits agree) and keeps the calibration view in step with the model (a fresh
//! capture of the transformed model sees the same rows), and on a model with planted activation
//! outliers each method's quantized layers beat round-to-nearest in the same format.

mod common;

use common::{TOKENS, assert_close, dense, logits};
use std::collections::BTreeMap;

use nibble_cpu::CpuBackend;
use nibble_model::{BatchLayout, LogitRows, RopeLayout, Transformer};
use nibble_precision::{ActQuant, KvFormat, LinearFormat, PrecisionSpec, WeightCodec};
use nibble_quant::dense::{DenseModel, LinearId, LinearKind, Site, SiteKind};
use nibble_quant::fmpq::{OUTLIER_RATIO, int8_blocks_needed, outlier_score, plan_and_permute};
use nibble_quant::permute::HeadPermutation;
use nibble_quant::qoq::{
    reorder_down_input, reorder_o_input, smooth_attention, smooth_attention_scale,
};
use nibble_quant::rotation::{Rotation, rotate_residual};
use nibble_quant::sim::{Sites, apply_smoothing, calibrate, layer_errors, smooth_scale};
use nibble_quant::simulate::{QuantSource, Simulated};
use nibble_quant::{Method, QuantOptions, QuantizedModel, quantize};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Random token sequences (the fixtures' vocabulary is 272 byte-level tokens).
fn token_sequences(seed: u64, n: usize, len: usize) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| (0..len).map(|_| rng.random_range(0..256)).collect())
        .collect()
}

fn calib() -> Vec<Vec<u32>> {
    token_sequences(1, 8, 80)
}

fn held_out() -> Vec<Vec<u32>> {
    token_sequences(2, 6, 64)
}

/// Planted outlier channels of each input site: the residual stream's spread over both
/// 32-channel blocks (one moving with the layer), down_proj's over all three, o_proj's all in
/// the second KV head.
fn planted(site: SiteKind, layer: usize) -> Vec<usize> {
    match site {
        SiteKind::AttnIn | SiteKind::MlpIn => vec![5, 40 + layer, 60],
        SiteKind::DownIn => vec![2, 50, 90],
        SiteKind::OIn => vec![16 + 3, 16 + 9],
    }
}

/// Residual channels made massive from the embedding on: real LLMs carry a few such channels
/// through the whole residual stream, and no equivalence transform can create them (RMSNorm
/// sees the whole vector). Planting changes the model; every check compares a quantized model
/// with the float model it came from.
const MASSIVE: [usize; 3] = [5, 40, 60];

/// Makes the planted channels of every input site 25x larger and the weights reading them 5x
/// smaller (a 5x scale folded both ways, then the producing op - norm gain, v_proj row, up_proj
/// row - boosted 5x more), and the [`MASSIVE`] residual channels 20x larger.
fn plant_outliers(m: &mut DenseModel) {
    let c = m.config.clone();
    let mut e = vec![1.0f32; c.hidden_size];
    for ch in MASSIVE {
        e[ch] = 20.0;
    }
    m.untie_head();
    m.embed.scale_cols(&e);
    for layer in 0..c.num_layers {
        for site in SiteKind::ALL {
            let n = match site {
                SiteKind::AttnIn | SiteKind::MlpIn => c.hidden_size,
                SiteKind::OIn => c.kv_dim(),
                SiteKind::DownIn => c.intermediate_size,
            };
            let mut s = vec![1.0f32; n];
            for ch in planted(site, layer) {
                s[ch] = 1.0 / 5.0;
            }
            m.fold_input_scale(layer, site, &s).unwrap();
            let l = &mut m.layers[layer];
            for ch in planted(site, layer) {
                match site {
                    SiteKind::AttnIn => l.attn_norm[ch] *= 5.0,
                    SiteKind::MlpIn => l.mlp_norm[ch] *= 5.0,
                    SiteKind::DownIn => l
                        .linear_mut(LinearKind::Up, None)
                        .unwrap()
                        .row_mut(ch)
                        .iter_mut()
                        .for_each(|w| *w *= 5.0),
                    SiteKind::OIn => {
                        l.v.row_mut(ch).iter_mut().for_each(|w| *w *= 5.0);
                        if let Some(b) = &mut l.v_bias {
                            b[ch] *= 5.0;
                        }
                    }
                }
            }
        }
    }
}

fn planted_model(name: &str) -> DenseModel {
    let mut m = dense(name);
    plant_outliers(&mut m);
    m
}

/// The analytic updates of the calibration view agree with a fresh capture of the model.
fn assert_sites_match_model(model: &DenseModel, sites: &Sites, what: &str) {
    let (_, fresh) = calibrate(model, &calib(), 1, &mut |_, _| {}).unwrap();
    for (key, data) in sites {
        let f = &fresh[key];
        assert_close(
            &f.samples.data,
            &data.samples.data,
            1e-4,
            &format!("{what} {key:?} rows"),
        );
        assert_close(
            &f.absmax,
            &data.absmax,
            1e-4,
            &format!("{what} {key:?} max"),
        );
    }
}

#[test]
fn fast_rotation_keeps_the_function_and_equals_the_dense_rotation() {
    for name in [
        "tiny-llama3",
        "tiny-qwen2",
        "tiny-llama-tied-bf16",
        "tiny-qwen3",
    ] {
        let mut m = planted_model(name);
        let want = logits(&m);
        let rot = Rotation::new(m.config.hidden_size, 7).unwrap();
        assert!(
            rotate_residual(&mut m, &rot, &mut |_, _| {}).is_err(),
            "norms first"
        );
        m.fold_norms().unwrap();
        let mut slow = m.clone();
        slow.rotate_residual(&rot.matrix()).unwrap();
        let mut ticks = 0;
        rotate_residual(&mut m, &rot, &mut |d, t| {
            ticks += 1;
            assert!(d <= t);
        })
        .unwrap();
        assert_eq!(ticks, m.layers.len() + 1);
        assert_close(&logits(&m), &want, 1e-4, name);
        for n in m.tensor_names() {
            let (a, b) = (m.tensor(&n).unwrap().1, slow.tensor(&n).unwrap().1);
            assert_close(a, b, 1e-5, &n);
        }
        // The planted outliers are gone from the rotated stream: no channel dominates.
        let (_, sites) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
        let x = &sites[&Site::dense(0, SiteKind::AttnIn)].absmax;
        let ratio = x.iter().fold(0f32, |a, &b| a.max(b)) / median(x);
        assert!(ratio < 4.0, "{name}: rotated max/median {ratio}");
    }
}

fn median(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(f32::total_cmp);
    s[s.len() / 2]
}

#[test]
fn smooth_attention_pairs_rotary_channels_and_keeps_the_function() {
    for (name, layout) in [
        ("tiny-llama3", RopeLayout::HalfSplit),
        ("tiny-qwen2", RopeLayout::HalfSplit),
        ("tiny-llama3", RopeLayout::Interleaved),
        ("tiny-mistral", RopeLayout::Interleaved),
    ] {
        let mut m = dense(name);
        m.config.rope_layout = layout;
        let c = m.config.clone();
        let hd = c.head_dim;
        // Key outlier channels: k rows x8 and q rows /8 keep the scores.
        for l in &mut m.layers {
            let mut ks = vec![1.0f32; c.kv_dim()];
            ks[2] = 8.0;
            ks[hd + 5] = 8.0;
            let qs: Vec<f32> = (0..c.q_dim())
                .map(|j| 1.0 / ks[(j / hd / (c.num_heads / c.num_kv_heads)) * hd + j % hd])
                .collect();
            l.k.scale_rows(&ks);
            l.q.scale_rows(&qs);
            if let Some(b) = &mut l.k_bias {
                b.iter_mut().zip(&ks).for_each(|(b, s)| *b *= s);
            }
            if let Some(b) = &mut l.q_bias {
                b.iter_mut().zip(&qs).for_each(|(b, s)| *b *= s);
            }
        }
        let want = logits(&m);
        let (cal, _) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
        for kmax in &cal.key_absmax {
            let lambda = smooth_attention_scale(&c, kmax);
            for j in 0..c.kv_dim() {
                let (h, d) = (j / hd, j % hd);
                let pair = match layout {
                    RopeLayout::HalfSplit => (d + hd / 2) % hd,
                    RopeLayout::Interleaved => d ^ 1,
                };
                assert_eq!(
                    lambda[j],
                    lambda[h * hd + pair],
                    "{name} {layout:?} channel {j}"
                );
                let m = kmax[j].max(kmax[h * hd + pair]);
                assert!((lambda[j] - m.sqrt()).abs() <= 1e-6 * m.sqrt().max(1.0));
            }
        }
        let kv4_error = |m: &DenseModel| {
            let sim = Simulated {
                kv: KvFormat::Int4.into(),
                ..Simulated::float(m)
            };
            let got = sim.logits(&TOKENS, 1).unwrap();
            got.iter()
                .zip(&want)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        };
        let before = kv4_error(&m);
        smooth_attention(&mut m, &cal.key_absmax).unwrap();
        assert_close(&logits(&m), &want, 1e-4, &format!("{name} {layout:?}"));
        // What it is for: a 4-bit KV cache hurts less.
        let after = kv4_error(&m);
        println!("{name} {layout:?}: kv4 logit error {before:.4} -> {after:.4}");
        assert!(
            after < before,
            "{name} {layout:?}: kv4 error {before} -> {after}"
        );
        // The keys the cache stores lost their outliers: max/median per layer shrank by > 2x.
        let (after, _) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
        for (b, a) in cal.key_absmax.iter().zip(&after.key_absmax) {
            let spread = |v: &[f32]| v.iter().fold(0f32, |x, &y| x.max(y)) / median(v);
            assert!(
                spread(a) * 2.0 < spread(b),
                "{name}: key spread {} -> {}",
                spread(b),
                spread(a)
            );
        }
    }
    // Qwen3's per-head QK norms do not commute with the scale: refused, and QoQ skips it.
    let mut q3 = dense("tiny-qwen3");
    let (cal, _) = calibrate(&q3, &calib(), 1, &mut |_, _| {}).unwrap();
    assert!(smooth_attention(&mut q3, &cal.key_absmax).is_err());
}

/// With a quantized KV cache the SmoothAttention strength is the candidate whose float model,
/// run with that cache, has the lowest calibration perplexity; with a 16-bit cache it is
/// QServe's 0.5. Every candidate keeps the function.
#[test]
fn smooth_attention_strength_is_measured_with_the_quantized_cache() {
    use nibble_quant::qoq::{
        SMOOTH_ATTENTION_STRENGTHS, smooth_attention_strength, smooth_attention_with,
    };
    let m = dense("tiny-llama3");
    let want = logits(&m);
    let (cal, _) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
    let none = &mut |_: &str, _: usize, _: usize| {};
    let got =
        smooth_attention_strength(&m, &cal.key_absmax, KvFormat::F16.into(), &calib(), 1, none);
    assert_eq!(got.unwrap(), 0.5);
    // The fold scales queries and keys only: with 16-bit keys and INT4 values every strength
    // rounds the same values, so there is nothing to search.
    let k16v4: nibble_precision::KvSpec = "k16v4".parse().unwrap();
    let nll16: Vec<f64> = SMOOTH_ATTENTION_STRENGTHS
        .iter()
        .map(|&s| {
            let mut sm = m.clone();
            smooth_attention_with(&mut sm, &cal.key_absmax, s).unwrap();
            let sim = Simulated {
                kv: k16v4,
                ..Simulated::float(&sm)
            };
            sim.mean_nll(&calib(), 1, &mut |_, _| {}).unwrap().0
        })
        .collect();
    for n in &nll16 {
        assert!((n - nll16[0]).abs() < 1e-4, "{nll16:?}");
    }
    let got = smooth_attention_strength(&m, &cal.key_absmax, k16v4, &calib(), 1, none);
    assert_eq!(got.unwrap(), 0.5);
    let nll: Vec<f64> = SMOOTH_ATTENTION_STRENGTHS
        .iter()
        .map(|&s| {
            let mut sm = m.clone();
            smooth_attention_with(&mut sm, &cal.key_absmax, s).unwrap();
            assert_close(&logits(&sm), &want, 1e-4, &format!("strength {s}"));
            let sim = Simulated {
                kv: KvFormat::Int4.into(),
                ..Simulated::float(&sm)
            };
            sim.mean_nll(&calib(), 1, &mut |_, _| {}).unwrap().0
        })
        .collect();
    let got = smooth_attention_strength(
        &m,
        &cal.key_absmax,
        KvFormat::Int4.into(),
        &calib(),
        1,
        none,
    )
    .unwrap();
    let best = nll.iter().copied().fold(f64::INFINITY, f64::min);
    let i = SMOOTH_ATTENTION_STRENGTHS
        .iter()
        .position(|&s| s == got)
        .unwrap();
    println!("kv4 calibration nll per strength {nll:?}: chose {got}");
    assert_eq!(nll[i], best);
}

/// The key-error search replays what the fold does: the attention inputs recorded from the
/// smoothed model, with exact keys through the cache codec, give the error the search computed
/// from the unsmoothed model's inputs and `λ`. It picks real smoothing for planted key
/// outliers, and QServe's 0.5 where the keys are not quantized per token.
#[test]
fn smooth_attention_key_error_replays_the_folded_cache() {
    use nibble_precision::{KeyLayout, TokenCodec, UintBits};
    use nibble_quant::capture::{CaptureOptions, capture};
    use nibble_quant::qoq::{
        KEY_ERROR_STRENGTHS, key_error, key_error_strengths, smooth_attention_layers,
        smooth_attention_scale_with,
    };
    let mut m = dense("tiny-llama3");
    let c = m.config.clone();
    let hd = c.head_dim;
    for l in &mut m.layers {
        let mut ks = vec![1.0f32; c.kv_dim()];
        ks[3] = 10.0;
        ks[3 + hd / 2] = 10.0;
        let qs: Vec<f32> = (0..c.q_dim())
            .map(|j| 1.0 / ks[(j / hd / (c.num_heads / c.num_kv_heads)) * hd + j % hd])
            .collect();
        l.k.scale_rows(&ks);
        l.q.scale_rows(&qs);
    }
    let seqs = calib();
    let opts = CaptureOptions {
        max_samples: 16,
        attention_sequences: 2,
        hessian_layers: None,
        ..CaptureOptions::default()
    };
    let cal = capture(&m, &seqs, opts, 1, &mut |_, _| {}).unwrap();
    assert_eq!(cal.attention.len(), c.num_layers);
    for a in &cal.attention {
        assert_eq!(a.len(), 2);
        assert_eq!((a[0].q.rows, a[0].q.cols), (seqs[0].len(), c.q_dim()));
        assert_eq!((a[1].k.rows, a[1].k.cols), (seqs[1].len(), c.kv_dim()));
        assert_eq!(a[1].v.cols, c.kv_dim());
    }
    let KeyLayout::PerToken(int4) = KvFormat::Int4.keys() else {
        unreachable!("kv4 stores keys per token")
    };
    let ones = vec![1.0f32; c.kv_dim()];
    let e4 = key_error(&c, &cal.attention[0], &ones, int4).unwrap();
    let e8 = key_error(&c, &cal.attention[0], &ones, TokenCodec::Uint(UintBits::B8)).unwrap();
    assert!(e8 * 20.0 < e4 && e4 > 0.0, "int8 {e8} vs int4 {e4}");

    let strengths =
        key_error_strengths(&c, &cal.key_absmax, &cal.attention, KvFormat::Int4).unwrap();
    println!("key-error strengths per layer and KV head: {strengths:?}");
    let all = || strengths.iter().flatten();
    assert!(all().all(|s| KEY_ERROR_STRENGTHS.contains(s)));
    assert!(strengths.iter().all(|s| s.len() == c.num_kv_heads));
    // The planted outliers are in KV head 0: there smoothing always wins.
    assert!(strengths.iter().all(|s| s[0] > 0.0), "{strengths:?}");
    for kv in [KvFormat::F16, KvFormat::Int4Channel] {
        let got = key_error_strengths(&c, &cal.key_absmax, &cal.attention, kv).unwrap();
        assert_eq!(got, vec![vec![0.5; c.num_kv_heads]; c.num_layers]);
    }

    let want = logits(&m);
    let mut sm = m.clone();
    smooth_attention_layers(&mut sm, &cal.key_absmax, &strengths).unwrap();
    assert_close(&logits(&sm), &want, 1e-4, "per-layer SmoothAttention");
    let after = capture(&sm, &seqs, opts, 1, &mut |_, _| {}).unwrap();
    for (layer, s) in strengths.iter().enumerate() {
        let lambda: Vec<f32> = (0..c.kv_dim())
            .map(|j| smooth_attention_scale_with(&c, &cal.key_absmax[layer], s[j / hd])[j])
            .collect();
        let predicted = key_error(&c, &cal.attention[layer], &lambda, int4).unwrap();
        let replayed = key_error(&c, &after.attention[layer], &ones, int4).unwrap();
        assert!(
            (predicted - replayed).abs() <= 0.05 * replayed,
            "layer {layer}: predicted {predicted}, replayed {replayed}"
        );
        assert!(
            predicted < e4 || layer > 0,
            "layer 0: {predicted} vs {e4} unsmoothed"
        );
    }
}

/// Key pair rotation keeps the function in both rotary layouts (and with QKV biases), the
/// rotated attention inputs it predicts are what a fresh capture of the rotated model records,
/// and every pair's mean key ends at 225 degrees (both dims negative and equal).
#[test]
fn key_pair_rotation_keeps_the_function_and_aligns_the_key_offsets() {
    use nibble_quant::capture::{CaptureOptions, capture};
    use nibble_quant::qoq::{
        key_pair_angles, rotary_pair, rotate_attention_inputs, rotate_key_pairs,
    };
    for (name, layout) in [
        ("tiny-llama3", RopeLayout::HalfSplit),
        ("tiny-qwen2", RopeLayout::HalfSplit),
        ("tiny-mistral", RopeLayout::Interleaved),
    ] {
        let mut m = dense(name);
        m.config.rope_layout = layout;
        let c = m.config.clone();
        let want = logits(&m);
        let seqs = calib();
        let opts = CaptureOptions {
            max_samples: 4,
            attention_sequences: 3,
            hessian_layers: None,
            ..CaptureOptions::default()
        };
        let cal = capture(&m, &seqs, opts, 1, &mut |_, _| {}).unwrap();
        let mut predicted = Vec::new();
        for layer in 0..c.num_layers {
            let angles = key_pair_angles(&c, &cal.attention[layer]);
            rotate_key_pairs(&mut m, layer, &angles).unwrap();
            predicted.push(rotate_attention_inputs(&c, &cal.attention[layer], &angles));
        }
        assert_close(&logits(&m), &want, 1e-4, &format!("{name} {layout:?}"));
        let after = capture(&m, &seqs, opts, 1, &mut |_, _| {}).unwrap();
        for (layer, predicted) in predicted.iter().enumerate() {
            for (p, a) in predicted.iter().zip(&after.attention[layer]) {
                assert_close(
                    &a.q.data,
                    &p.q.data,
                    1e-4,
                    &format!("{name} layer {layer} q"),
                );
                assert_close(
                    &a.k.data,
                    &p.k.data,
                    1e-4,
                    &format!("{name} layer {layer} k"),
                );
            }
            let (hd, n) = (c.head_dim, c.kv_dim());
            let (mut mean, mut abs) = (vec![0f64; n], vec![0f64; n]);
            for a in &after.attention[layer] {
                for r in 0..a.k.rows {
                    for (j, &v) in a.k.row(r).iter().enumerate() {
                        mean[j] += v as f64;
                        abs[j] += v.abs() as f64;
                    }
                }
            }
            for h in 0..c.num_kv_heads {
                for p in 0..hd / 2 {
                    let (i, j) = rotary_pair(layout, hd, p);
                    let (x, y) = (mean[h * hd + i], mean[h * hd + j]);
                    let tol = 1e-4 * (abs[h * hd + i] + abs[h * hd + j]);
                    assert!(
                        (x - y).abs() <= tol && (x < 0.0 || x.hypot(y) <= tol),
                        "{name} layer {layer} head {h} pair {p}: mean ({x}, {y})"
                    );
                }
            }
        }
    }
}

#[test]
fn output_smoothing_and_reordering_keep_the_function_and_the_calibration_view() {
    for name in ["tiny-llama3", "tiny-qwen2"] {
        let mut m = planted_model(name);
        let want = logits(&m);
        let (_, mut sites) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
        for layer in 0..m.layers.len() {
            for site in [SiteKind::OIn, SiteKind::DownIn] {
                let data = sites.get_mut(&Site::dense(layer, site)).unwrap();
                // A forced strength, so the fold is never the identity.
                let w = if site == SiteKind::OIn {
                    &m.layers[layer].o
                } else {
                    m.linear(LinearId::dense(layer, LinearKind::Down))
                };
                let wmax = nibble_quant::sim::col_absmax(&[w]);
                let (x, w) = if site == SiteKind::OIn {
                    (
                        nibble_quant::sim::reduce_kv_max(&m, &data.absmax),
                        nibble_quant::sim::reduce_kv_max(&m, &wmax),
                    )
                } else {
                    (data.absmax.clone(), wmax)
                };
                let s = smooth_scale(&x, &w, 0.15);
                assert!(s.iter().any(|v| (v - 1.0).abs() > 0.1));
                apply_smoothing(&mut m, Site::dense(layer, site), data, &s).unwrap();
            }
            reorder_down_input(
                &mut m,
                Site::dense(layer, SiteKind::DownIn),
                sites
                    .get_mut(&Site::dense(layer, SiteKind::DownIn))
                    .unwrap(),
            )
            .unwrap();
            let before = m.layers[layer].v.clone();
            reorder_o_input(
                &mut m,
                layer,
                sites.get_mut(&Site::dense(layer, SiteKind::OIn)).unwrap(),
            )
            .unwrap();
            assert_ne!(before, m.layers[layer].v, "value dims reordered");
            let down = &sites[&Site::dense(layer, SiteKind::DownIn)].absmax;
            assert!(down.windows(2).all(|p| p[0] >= p[1]), "down input sorted");
        }
        assert_close(&logits(&m), &want, 1e-4, name);
        assert_sites_match_model(&m, &sites, name);
    }
}

#[test]
fn head_permutations_keep_the_function_and_refuse_moving_a_head_off_its_kv() {
    for name in ["tiny-qwen2", "tiny-llama3", "tiny-qwen3"] {
        let mut m = dense(name);
        let want = logits(&m);
        let hd = m.config.head_dim;
        let hp = HeadPermutation {
            kv_heads: vec![1, 0],
            q_heads: vec![3, 2, 1, 0],
            within: vec![
                (0..hd).rev().collect(),
                (0..hd).map(|d| (d * 5) % hd).collect(),
            ],
        };
        hp.apply(&mut m, 0).unwrap();
        hp.apply(&mut m, 1).unwrap();
        assert_close(&logits(&m), &want, 1e-5, name);
        let bad = HeadPermutation {
            q_heads: vec![0, 2, 1, 3],
            ..HeadPermutation::identity(&m)
        };
        assert!(bad.apply(&mut m, 0).is_err());
    }
}

fn spec(s: &str) -> PrecisionSpec {
    s.parse().unwrap()
}

fn run(model: DenseModel, s: &str, method: Method) -> QuantizedModel {
    let mut stages = BTreeMap::<String, (usize, usize)>::new();
    let q = quantize(
        model,
        spec(s),
        method,
        &calib(),
        &QuantOptions {
            threads: 1,
            seed: 3,
        },
        &mut |stage, d, t| {
            assert!(d <= t && t > 0, "{stage}: {d}/{t}");
            stages.insert(stage.to_string(), (d, t));
        },
    )
    .unwrap();
    assert!(!stages.is_empty());
    for (stage, (d, t)) in stages {
        assert_eq!(d, t, "{stage} finished");
    }
    q
}

/// Sum of relative layer errors on held-out text, over the readers of `sites`.
fn error_sum(q: &QuantizedModel, sites: &[SiteKind]) -> f64 {
    layer_errors(q, &held_out(), 1)
        .unwrap()
        .into_iter()
        .filter(|(id, _)| sites.contains(&id.kind.site()))
        .map(|(_, e)| e)
        .sum()
}

/// Relative mean squared logit error of a simulated quantized model against the float model,
/// on held-out text.
fn logit_error(q: &QuantizedModel, float: &DenseModel) -> f64 {
    let sim = Simulated::new(q).unwrap();
    let refm = Simulated::float(float);
    let (mut num, mut den) = (0f64, 0f64);
    for seq in held_out() {
        let a = refm.logits(&seq, 1).unwrap();
        let b = sim.logits(&seq, 1).unwrap();
        for (x, y) in a.iter().zip(&b) {
            num += ((x - y) as f64).powi(2);
            den += (*x as f64).powi(2);
        }
    }
    num / den
}

#[test]
fn qoq_beats_rtn_on_planted_outliers_and_runs_on_each_architecture() {
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"] {
        for s in ["w4a8-g32", "w4a8", "w8a8"] {
            let m = planted_model(name);
            let q = run(m.clone(), s, Method::Qoq);
            let want = match s {
                "w4a8" => WeightCodec::Int4Group { group: 0 },
                "w8a8" => WeightCodec::Int8PerChannel,
                _ => WeightCodec::Qoq { group: 32 },
            };
            assert_eq!(q.linears.len(), 7 * m.layers.len());
            for (id, (f, bytes)) in &q.linears {
                assert_eq!(*f, LinearFormat::new(want, ActQuant::Int8PerToken).unwrap());
                let w = q.dense.linear(*id);
                assert_eq!(bytes.len(), f.row_bytes(w.cols).unwrap() * w.rows);
            }
            let r = nibble_quant::pipeline::rtn(m.clone(), spec(s), &mut |_, _, _| {}).unwrap();
            let all = SiteKind::ALL;
            let (eq, er) = (error_sum(&q, &all), error_sum(&r, &all));
            let residual = [SiteKind::AttnIn, SiteKind::MlpIn];
            let (rq, rr) = (error_sum(&q, &residual), error_sum(&r, &residual));
            let (lq, lr) = (logit_error(&q, &m), logit_error(&r, &m));
            println!(
                "{name} {s}: layer errors qoq {eq:.4} rtn {er:.4}; residual readers {rq:.4} vs {rr:.4}; logits {lq:.2e} vs {lr:.2e}"
            );
            assert!(eq < er, "{name} {s}: layer errors qoq {eq} rtn {er}");
            assert!(rq * 2.0 < rr, "{name} {s}: rotated readers {rq} vs {rr}");
            assert!(lq < lr, "{name} {s}: logits qoq {lq} rtn {lr}");
        }
    }
}

#[test]
fn lqq_smoothing_keeps_the_function_and_beats_rtn_on_planted_outliers() {
    for name in ["tiny-llama3", "tiny-qwen2"] {
        let m = planted_model(name);
        let want = logits(&m);
        let mut sm = m.clone();
        let (_, mut sites) = calibrate(&sm, &calib(), 1, &mut |_, _| {}).unwrap();
        let choices =
            nibble_quant::lqq::smooth(&mut sm, &mut sites, spec("w4a8-lqq-g32"), &mut |_, _| {})
                .unwrap();
        assert_close(&logits(&sm), &want, 1e-4, name);
        assert_sites_match_model(&sm, &sites, name);
        for c in choices.iter().flatten() {
            assert!(c.error <= c.error_unsmoothed);
        }
        // The planted residual outliers are worth smoothing.
        assert!(choices.iter().all(|l| l[0].alpha.is_some()), "{choices:?}");

        let q = run(m.clone(), "w4a8-lqq-g32", Method::Lqq);
        for (f, _) in q.linears.values() {
            assert_eq!(f.codec, WeightCodec::Lqq { group: 32 });
        }
        let r = nibble_quant::pipeline::rtn(m.clone(), spec("w4a8-lqq-g32"), &mut |_, _, _| {})
            .unwrap();
        let (eq, er) = (error_sum(&q, &SiteKind::ALL), error_sum(&r, &SiteKind::ALL));
        let (lq, lr) = (logit_error(&q, &m), logit_error(&r, &m));
        println!("{name} lqq: layer errors {eq:.4} rtn {er:.4}; logits {lq:.2e} vs {lr:.2e}");
        assert!(eq < er, "{name}: lqq {eq} rtn {er}");
        assert!(lq < lr, "{name}: logits lqq {lq} rtn {lr}");
    }
}

#[test]
fn fmpq_gathers_outliers_into_leading_int8_blocks() {
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"] {
        let m = planted_model(name);
        let want = logits(&m);
        let (_, mut sites) = calibrate(&m, &calib(), 1, &mut |_, _| {}).unwrap();
        // Unpermuted, the planted outliers reach past the first block of every site.
        for (key, data) in &sites {
            let n = int8_blocks_needed(&outlier_score(&data.absmax), 32, OUTLIER_RATIO);
            assert!(n > 1, "{name} {key:?} unpermuted: {n}");
        }
        let mut pm = m.clone();
        let blocks = plan_and_permute(&mut pm, &mut sites, 32, OUTLIER_RATIO).unwrap();
        assert_close(&logits(&pm), &want, 1e-4, name);
        assert_sites_match_model(&pm, &sites, name);
        let c = &pm.config;
        // o_proj's planted channels come from one value head, so every query head of its KV
        // group carries them: they end in the group's last head.
        let o_reach = c.head_dim * (c.num_heads / c.num_kv_heads - 1) + 2;
        for (key, &n) in &blocks {
            let want = if key.kind == SiteKind::OIn {
                o_reach.div_ceil(32)
            } else {
                1
            };
            assert_eq!(n, want, "{name} {key:?}: outliers fit the leading blocks");
            let score = outlier_score(&sites[key].absmax);
            assert!(
                score[32 * n..].iter().all(|&s| s <= OUTLIER_RATIO),
                "{key:?}"
            );
        }

        let q = run(m.clone(), "w4a4a8-g32", Method::Fmpq);
        for (id, (f, _)) in &q.linears {
            assert_eq!(
                f.act,
                ActQuant::Mixed4x8 {
                    block: 32,
                    int8_blocks: blocks[&Site::dense(id.layer, id.kind.site())] as u16
                }
            );
        }
        let r =
            nibble_quant::pipeline::rtn(m.clone(), spec("w4a4a8-g32"), &mut |_, _, _| {}).unwrap();
        for site in SiteKind::ALL {
            let (ef, er) = (error_sum(&q, &[site]), error_sum(&r, &[site]));
            println!("{name} fmpq {site:?}: {ef:.4} vs all-INT4 rtn {er:.4}");
            assert!(ef < er, "{name} {site:?}: fmpq {ef} rtn {er}");
        }
        let (lq, lr) = (logit_error(&q, &m), logit_error(&r, &m));
        println!("{name} fmpq logits {lq:.2e} vs {lr:.2e}");
        assert!(lq < lr, "{name}: logits fmpq {lq} rtn {lr}");
    }
}

/// The reference check of the simulation itself: a format's simulated layer is exactly the
/// decoded weight times the quantized input.
#[test]
fn simulated_model_multiplies_decoded_weights_by_quantized_inputs() {
    let m = dense("tiny-llama3");
    let q = nibble_quant::pipeline::rtn(m.clone(), spec("w4a8-g32"), &mut |_, _, _| {}).unwrap();
    let sim = Simulated::new(&q).unwrap();
    let id = LinearId::dense(1, LinearKind::Down);
    let (f, bytes) = &q.linears[&id];
    let w = m.linear(id);
    let mut decoded = vec![0f32; w.rows * w.cols];
    f.codec.dequantize(bytes, w.cols, &mut decoded).unwrap();
    assert_eq!(sim.dense.linear(id).data, decoded);
    assert!(sim.dense.linear(id).data != w.data);
    // Without quantized layers the simulation is the CPU forward pass, bit for bit.
    assert_eq!(logits(&m), Simulated::float(&m).logits(&TOKENS, 1).unwrap());
    let e = logit_error(&q, &m);
    assert!(e > 0.0 && e < 0.2, "w4a8-g32 RTN logits off by {e}");
}

/// What the searches optimize is what the kernels compute: the simulation of each method's
/// output and the CPU backend's quantized kernels (integer dots, per-token scales) give the
/// same logits up to float rounding.
#[test]
fn simulation_matches_the_quantized_cpu_kernels() {
    let m = planted_model("tiny-qwen2");
    for (s, method) in [
        ("w4a8-g32", Method::Qoq),
        ("w4a8", Method::Qoq),
        ("w8a8", Method::Qoq),
        ("w4a8-lqq-g32", Method::Lqq),
        ("w4a4a8-g32", Method::Fmpq),
    ] {
        let q = run(m.clone(), s, method);
        let sim = Simulated::new(&q).unwrap().logits(&TOKENS, 1).unwrap();
        let backend = CpuBackend::new(1).unwrap();
        let src = QuantSource(&q);
        let t = Transformer::load(&backend, q.dense.config.clone(), &src, &mut |_, _| {}).unwrap();
        let (mut kv, table) = t.single_sequence_kv(&backend, TOKENS.len()).unwrap();
        let real = t
            .forward(
                &backend,
                &TOKENS,
                &BatchLayout::single(table, 0, TOKENS.len()),
                &mut kv,
                LogitRows::All,
            )
            .unwrap()
            .data;
        assert_close(&real, &sim, 1e-3, &format!("{method} {s}"));
        // The tolerance is far below what quantization itself moves.
        let float = logits(&m);
        let moved = float
            .iter()
            .zip(&real)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        let scale = float.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(
            moved > 1e-2 * scale,
            "{method} {s}: quantization moved logits by {moved}"
        );
    }
}

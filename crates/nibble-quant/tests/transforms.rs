//! The offline rewrites keep the network's function: logits of the tiny fixture models before and
//! after each rewrite agree to float rounding, and calibration sees every input site.

mod common;

use common::{TOKENS, assert_close, dense, fixture, logits};

use nibble_cpu::CpuBackend;
use nibble_model::{BatchLayout, LogitRows, Transformer, open_model};
use nibble_quant::capture::{CaptureOptions, capture};
use nibble_quant::dense::{Mat, SiteKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_orthogonal(n: usize, seed: u64) -> Mat {
    // Gram-Schmidt on a Gaussian-ish matrix, in f64.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut q: Vec<Vec<f64>> = Vec::new();
    while q.len() < n {
        let mut v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        for u in &q {
            let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(u).for_each(|(a, b)| *a -= d * b);
        }
        let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if norm > 1e-6 {
            q.push(v.into_iter().map(|a| a / norm).collect());
        }
    }
    Mat::new(n, n, q.into_iter().flatten().map(|x| x as f32).collect())
}

#[test]
fn dense_model_runs_like_the_original() {
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-llama-tied-bf16"] {
        let files = open_model(&fixture(name), None).unwrap();
        let backend = CpuBackend::new(1).unwrap();
        let t = Transformer::load(
            &backend,
            files.config.clone(),
            &*files.source,
            &mut |_, _| {},
        )
        .unwrap();
        let (mut kv, table) = t.single_sequence_kv(&backend, TOKENS.len()).unwrap();
        let want = t
            .forward(
                &backend,
                &TOKENS,
                &BatchLayout::single(table, 0, TOKENS.len()),
                &mut kv,
                LogitRows::All,
            )
            .unwrap()
            .data;
        assert_close(&logits(&dense(name)), &want, 1e-6, name);
    }
}

#[test]
fn input_scales_fold_without_changing_the_function() {
    for name in ["tiny-llama3", "tiny-qwen2"] {
        let mut m = dense(name);
        let want = logits(&m);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let c = m.config.clone();
        for layer in 0..c.num_layers {
            for site in SiteKind::ALL {
                let n = match site {
                    SiteKind::AttnIn | SiteKind::MlpIn => c.hidden_size,
                    SiteKind::OIn => c.kv_dim(),
                    SiteKind::DownIn => c.intermediate_size,
                };
                let s: Vec<f32> = (0..n).map(|_| rng.random_range(0.25..4.0)).collect();
                m.fold_input_scale(layer, site, &s).unwrap();
            }
        }
        assert_close(&logits(&m), &want, 1e-4, name);
        assert!(m.fold_input_scale(0, SiteKind::AttnIn, &[1.0]).is_err());
        assert!(
            m.fold_input_scale(0, SiteKind::DownIn, &vec![0.0; c.intermediate_size])
                .is_err()
        );
    }
}

#[test]
fn residual_rotation_keeps_the_function() {
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-llama-tied-bf16"] {
        let mut m = dense(name);
        let want = logits(&m);
        let r = random_orthogonal(m.config.hidden_size, 11);
        assert!(m.rotate_residual(&r).is_err(), "needs folded norms first");
        m.fold_norms().unwrap();
        assert_close(&logits(&m), &want, 1e-5, name);
        m.rotate_residual(&r).unwrap();
        assert_close(&logits(&m), &want, 1e-4, name);
    }
}

#[test]
fn value_rotation_keeps_the_function() {
    use nibble_quant::rotation::{Rotation, rotate_values};
    // Grouped-query (llama3), biased v_proj (qwen2), QK-normed (qwen3) and interleaved rotary
    // (mistral): the value rotation touches none of what differs between them.
    for name in ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let mut m = dense(name);
        let want = logits(&m);
        let hd = m.config.head_dim;
        assert!(rotate_values(&mut m, &Rotation::new(hd + 1, 1).unwrap()).is_err());
        let v0 = m.layers[0].v.clone();
        rotate_values(&mut m, &Rotation::new(hd, 5).unwrap()).unwrap();
        assert!(
            m.layers[0]
                .v
                .data
                .iter()
                .zip(&v0.data)
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "{name}: the values moved"
        );
        assert_close(&logits(&m), &want, 1e-4, name);
    }
}

/// `sample_first` keeps each sequence's first token on top of the stride.
#[test]
fn calibration_can_keep_every_first_token() {
    let m = dense("tiny-llama3");
    // 12 + 7 tokens; a stride of 5 lands on global tokens 0, 5, 10 and 15 (the second
    // sequence's fourth), never on the second sequence's first token (global 12).
    let seqs = vec![TOKENS.to_vec(), TOKENS[..7].to_vec()];
    let rows = |sample_first| {
        let opts = CaptureOptions {
            hessian: false,
            max_samples: 100,
            sample_stride: 5,
            sample_first,
            attention_sequences: 0,
            hessian_layers: None,
        };
        let cal = capture(&m, &seqs, opts, 1, &mut |_, _| {}).unwrap();
        cal.site(0, SiteKind::AttnIn).samples.clone()
    };
    let (plain, with_first) = (rows(false), rows(true));
    assert_eq!((plain.rows, with_first.rows), (4, 5));
    // The extra row is the second sequence's first token, which is the first sequence's too
    // (same token, position 0), so it repeats the first sample.
    assert_eq!(with_first.row(3), with_first.row(0));
}

#[test]
fn calibration_records_every_site() {
    let m = dense("tiny-llama3");
    let seqs = vec![TOKENS.to_vec(), TOKENS[..7].to_vec()];
    let opts = CaptureOptions {
        hessian: true,
        max_samples: 5,
        sample_stride: 2,
        sample_first: false,
        attention_sequences: 0,
        hessian_layers: None,
    };
    let cal = capture(&m, &seqs, opts, 1, &mut |_, _| {}).unwrap();
    assert_eq!(cal.tokens, 19);
    assert_eq!(cal.key_absmax.len(), m.config.num_layers);
    for layer in 0..m.config.num_layers {
        for site in SiteKind::ALL {
            let s = cal.site(layer, site);
            assert_eq!(s.tokens, 19);
            assert_eq!(s.samples.rows, 5);
            assert!(s.absmax.iter().any(|&x| x > 0.0));
            let h = s.hessian.as_ref().unwrap();
            let k = s.absmax.len();
            // The Gram matrix is symmetric with diagonal = sum of squares >= max^2.
            for i in 0..k {
                assert!(h[i * k + i] + 1e-6 >= (s.absmax[i] as f64).powi(2));
                assert!((h[i * k + (i + 1) % k] - h[((i + 1) % k) * k + i]).abs() < 1e-3);
            }
        }
    }
}

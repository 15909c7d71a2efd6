//! Device sampling against the reference (`nibble_model::sampling::sample_rows`, which is what
//! the CPU samples with): the same token for greedy and for every seeded filter mix, and the same
//! top log-probabilities, on fresh random logits with ties, -inf and NaN in them.

use nibble_cuda::{CudaBackend, Dtype};
use nibble_model::Backend;
use nibble_model::sampling::{SampleSpec, SamplingParams, sample_rows};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn logits(r: &mut ChaCha8Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(rows * vocab);
    for row in 0..rows {
        // Peaked, flat and tie-heavy rows.
        let scale = [3.0f32, 12.0, 0.5, 30.0][row % 4];
        for _ in 0..vocab {
            let x = (r.random::<f32>() - 0.5) * scale;
            v.push(if row % 5 == 2 { x.round() } else { x });
        }
        let base = row * vocab;
        if row % 3 == 1 {
            v[base + r.random_range(0..vocab)] = f32::NEG_INFINITY;
            v[base + r.random_range(0..vocab)] = f32::NAN;
        }
    }
    v
}

fn param_mixes() -> Vec<SamplingParams> {
    let p = |temperature, top_k, top_p, min_p, repetition_penalty| SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        ..SamplingParams::default()
    };
    vec![
        p(0.0, 0, 1.0, 0.0, 1.0),
        p(0.0, 0, 1.0, 0.0, 1.3),
        p(1.0, 0, 1.0, 0.0, 1.0),
        p(0.7, 40, 1.0, 0.0, 1.0),
        p(0.8, 0, 0.9, 0.0, 1.0),
        p(1.3, 0, 0.5, 0.05, 1.0),
        p(0.6, 100, 0.95, 0.02, 1.1),
        p(1.0, 1, 1.0, 0.0, 1.0),
        p(0.9, 0, 1.0, 0.1, 1.0),
        p(2.0, 5000, 0.99, 0.0, 0.8),
        p(1e-30, 0, 1.0, 0.0, 1.0),
    ]
}

#[test]
fn device_sampling_matches_the_reference() {
    let g = CudaBackend::new(0, Dtype::Bf16).expect("a CUDA GPU");
    let mut r = super::rng("device_sampling_matches_the_reference");
    let mixes = param_mixes();
    for &vocab in &[1usize, 7, 32_003, 128_256] {
        let rows = 23;
        let host = logits(&mut r, rows, vocab);
        let t = g.tensor_from_f32(&host, rows, vocab).unwrap();
        let histories: Vec<Vec<u32>> = (0..rows)
            .map(|i| {
                (0..(i * 37) % 300)
                    .map(|_| r.random_range(0..vocab as u32 + 3))
                    .collect()
            })
            .collect();
        for round in 0..3 {
            // Every row under every mix, rows out of order and repeated, fresh seeds and draws.
            let seeds: Vec<(u64, u64)> = (0..rows * mixes.len())
                .map(|_| (r.random(), r.random_range(0..1000)))
                .collect();
            let specs: Vec<SampleSpec> = (0..rows * mixes.len())
                .map(|i| SampleSpec {
                    row: (i * 7 + round) % rows,
                    params: &mixes[i % mixes.len()],
                    seed: seeds[i].0,
                    draw: seeds[i].1,
                    history: &histories[(i * 7 + round) % rows],
                    output: &[],
                    allowed: None,
                    logprobs: [None, Some(0), Some(5), Some(20)][(i + round) % 4],
                })
                .collect();
            let want = sample_rows(&host, vocab, &specs).unwrap();
            let got = g.sample(&t, vocab, &specs).unwrap();
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                let s = &specs[i];
                assert_eq!(
                    a.token, b.token,
                    "vocab {vocab} spec {i} (row {}, {:?}, seed {} draw {})",
                    s.row, s.params, s.seed, s.draw
                );
                match (&a.logprobs, &b.logprobs) {
                    (None, None) => {}
                    (Some(x), Some(y)) => {
                        let ids = |v: &[(u32, f32)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
                        assert_eq!(ids(&x.top), ids(&y.top), "top ids, vocab {vocab} spec {i}");
                        // A row of NaN alone has NaN log-probabilities on both sides.
                        let close = |p: f32, q: f32| {
                            (p == q)
                                || (p.is_nan() && q.is_nan())
                                || (p - q).abs() <= 1e-4 * q.abs().max(1.0)
                        };
                        assert!(
                            close(x.logprob, y.logprob),
                            "{} vs {}",
                            x.logprob,
                            y.logprob
                        );
                        for (p, q) in x.top.iter().zip(&y.top) {
                            assert!(close(p.1, q.1), "{p:?} vs {q:?}");
                        }
                    }
                    _ => panic!("logprobs asked for but not returned, spec {i}"),
                }
            }
        }
    }
}

/// A seeded stream gives a spread of tokens (not one repeated), and one draw index always the
/// same token: the device really draws.
#[test]
fn device_draws_follow_the_seeded_stream() {
    let g = CudaBackend::new(0, Dtype::Bf16).expect("a CUDA GPU");
    let vocab = 1000;
    let host: Vec<f32> = (0..vocab).map(|i| -((i % 10) as f32) * 0.3).collect();
    let t = g.tensor_from_f32(&host, 1, vocab).unwrap();
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let specs: Vec<SampleSpec> = (0..200)
        .map(|d| SampleSpec {
            row: 0,
            params: &p,
            seed: 99,
            draw: d,
            history: &[],
            output: &[],
            allowed: None,
            logprobs: None,
        })
        .collect();
    let a = g.sample(&t, vocab, &specs).unwrap();
    let b = g.sample(&t, vocab, &specs).unwrap();
    assert_eq!(a, b);
    let distinct: std::collections::HashSet<u32> = a.iter().map(|s| s.token).collect();
    assert!(distinct.len() > 50, "{} distinct tokens", distinct.len());
    // Out-of-range rows are an error, not a fault.
    let bad = [SampleSpec {
        row: 1,
        ..specs[0].clone()
    }];
    assert!(g.sample(&t, vocab, &bad).is_err());
}

/// Structured outputs and OpenAI's adjustments on the device: an allowed-token mask (dense,
/// sparse, a single token, and words past the last token), `logit_bias`, presence and frequency
/// penalties, alone and with the repetition penalty and every filter, give the reference's token
/// on every row; a masked token never comes out.
#[test]
fn device_sampling_with_masks_and_biases_matches_the_reference() {
    let g = CudaBackend::new(0, Dtype::Bf16).expect("a CUDA GPU");
    let mut r = super::rng("device_sampling_with_masks_and_biases_matches_the_reference");
    let mut mixes = param_mixes();
    for (i, m) in mixes.iter_mut().enumerate() {
        m.presence_penalty = [0.0, 0.5, -1.0, 2.0][i % 4];
        m.frequency_penalty = [0.0, 0.3, 1.5, -0.7][(i / 2) % 4];
        m.logit_bias = (0..(i * 3) % 11)
            .map(|_| {
                (
                    r.random_range(0..40_000u32),
                    r.random_range(-100.0f32..100.0),
                )
            })
            .collect();
    }
    for &vocab in &[7usize, 33, 32_003, 151_936] {
        let rows = 17;
        let words = vocab.div_ceil(32);
        let host = logits(&mut r, rows, vocab);
        let t = g.tensor_from_f32(&host, rows, vocab).unwrap();
        let masks: Vec<Vec<u32>> = (0..rows)
            .map(|i| {
                let density = [0.5f64, 0.01, 0.0, 0.9][i % 4];
                let mut m: Vec<u32> = (0..words)
                    .map(|_| {
                        (0..32).fold(0u32, |w, b| w | (u32::from(r.random_bool(density)) << b))
                    })
                    .collect();
                // At least one allowed token, and bits past the vocabulary set (never tokens).
                let one = r.random_range(0..vocab);
                m[one / 32] |= 1 << (one % 32);
                if vocab % 32 != 0 {
                    m[words - 1] |= !0u32 << (vocab % 32);
                }
                m
            })
            .collect();
        let outputs: Vec<Vec<u32>> = (0..rows)
            .map(|i| {
                (0..(i * 53) % 400)
                    .map(|_| r.random_range(0..vocab as u32))
                    .collect()
            })
            .collect();
        let specs: Vec<SampleSpec> = (0..rows * mixes.len())
            .map(|i| {
                let row = (i * 5) % rows;
                SampleSpec {
                    row,
                    params: &mixes[i % mixes.len()],
                    seed: r.random(),
                    draw: r.random_range(0..1000),
                    history: &outputs[row],
                    output: &outputs[row],
                    allowed: (i % 3 != 2).then_some(&masks[row][..]),
                    logprobs: [None, Some(3)][i % 2],
                }
            })
            .collect();
        let want = sample_rows(&host, vocab, &specs).unwrap();
        let got = g.sample(&t, vocab, &specs).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let s = &specs[i];
            assert_eq!(
                a.token, b.token,
                "vocab {vocab} spec {i} (row {}, {:?})",
                s.row, s.params
            );
            if let Some(m) = s.allowed {
                let t = a.token as usize;
                let row = &host[s.row * vocab..(s.row + 1) * vocab];
                // Unless every allowed logit is -inf or NaN, the token is an allowed one.
                let live = (0..vocab)
                    .any(|j| (m[j / 32] >> (j % 32)) & 1 == 1 && row[j] > f32::NEG_INFINITY);
                assert!(
                    !live || (m[t / 32] >> (t % 32)) & 1 == 1,
                    "masked token {t}, spec {i}"
                );
            }
        }
    }
}

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
        seed: None,
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

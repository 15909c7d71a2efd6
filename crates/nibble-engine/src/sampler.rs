//! Next-token sampling with the llama.cpp / Hugging Face semantics users already tune against:
//! repetition penalty, temperature, top-k, min-p and top-p, then a draw. The arithmetic is
//! [`nibble_model::sampling`], the reference every backend's sampler reproduces; a [`Sampler`]
//! adds what one sequence carries from token to token: its seed and how many draws it made.

use nibble_core::Result;
use nibble_model::Backend;
pub use nibble_model::sampling::SamplingParams;
use nibble_model::sampling::{self, SampleScratch, SampleSpec, Sampled};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Stateful token picker for one sequence: a seeded generation is reproducible across calls
/// and across backends (draw `n` of seed `s` is the same number everywhere), and the scratch
/// buffers spare a 150k-entry vocabulary an allocation per token.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    draws: u64,
    scratch: SampleScratch,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = match params.seed {
            Some(seed) => seed,
            None => ChaCha8Rng::from_os_rng().random(),
        };
        Ok(Self {
            params,
            seed,
            draws: 0,
            scratch: SampleScratch::default(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed of this sequence's random stream (the request's, or one drawn from the OS).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Draws made so far: the position of the next one in the random stream.
    pub fn draws(&self) -> u64 {
        self.draws
    }

    /// Records a token sampled elsewhere (on a device) from this sampler's stream.
    pub fn advance(&mut self) {
        self.draws += 1;
    }

    /// Samples the next token from row 0 of `logits` where they are (on a GPU, on the GPU) and
    /// advances the stream. `tokens` is the sequence so far, its first `prompt_len` the prompt;
    /// `allowed` the structured-output mask, if any.
    pub fn sample_on<B: Backend>(
        &mut self,
        backend: &B,
        logits: &B::Tensor,
        vocab: usize,
        tokens: &[u32],
        prompt_len: usize,
        allowed: Option<&[u32]>,
    ) -> Result<Sampled> {
        let spec = self.spec(0, tokens, prompt_len, allowed, None);
        let mut out = backend.sample(logits, vocab, std::slice::from_ref(&spec))?;
        self.advance();
        out.pop().ok_or_else(|| {
            nibble_core::Error::InvalidArgument("the sampler returned no token".into())
        })
    }

    /// This sampler's next draw, for a backend's batched [`Backend::sample`]: `tokens` is the
    /// sequence so far (prompt, then output from `prompt_len` on).
    pub fn spec<'a>(
        &'a self,
        row: usize,
        tokens: &'a [u32],
        prompt_len: usize,
        allowed: Option<&'a [u32]>,
        logprobs: Option<usize>,
    ) -> SampleSpec<'a> {
        SampleSpec {
            row,
            params: &self.params,
            seed: self.seed,
            draw: self.draws,
            history: if self.params.repetition_penalty == 1.0 {
                &[]
            } else {
                tokens
            },
            output: if self.params.uses_output() {
                tokens.get(prompt_len..).unwrap_or(&[])
            } else {
                &[]
            },
            allowed,
            logprobs,
        }
    }

    /// Picks the next token. `logits` is modified in place (the repetition penalty is applied to
    /// it) so the caller need not copy the model's output buffer. NaN logits are never chosen; if
    /// nothing is selectable the result is 0.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        sampling::apply_repetition_penalty(
            logits,
            history,
            self.params.repetition_penalty,
            &mut self.scratch.seen,
        );
        let token = sampling::sample_row(
            logits,
            &self.params,
            self.seed,
            self.draws,
            &mut self.scratch,
        );
        self.draws += 1;
        token
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nibble_core::Error;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(1234),
            ..SamplingParams::default()
        }
    }

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p).unwrap()
    }

    /// Logits whose softmax (at temperature 1) is exactly `probs`.
    fn logits_for(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// Counts how often each id is drawn in `n` samples.
    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..n {
            let mut l = logits.to_vec();
            counts[s.sample(&mut l, &[]) as usize] += 1;
        }
        counts
    }

    /// Deterministic pseudo-random logits so reference comparisons cover many shapes.
    fn random_logits(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| (rng.random::<f32>() - 0.5) * scale)
            .collect()
    }

    #[test]
    fn default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert_eq!(p.temperature, 0.0);
        p.validate().unwrap();
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = sampler(params(0.0));
        let mut l = vec![0.1, -3.0, 2.5, 2.4, 0.0];
        assert_eq!(s.sample(&mut l, &[]), 2);
        let mut l = vec![-5.0, -1.0, -2.0];
        assert_eq!(s.sample(&mut l, &[]), 1);
    }

    #[test]
    fn greedy_ties_go_to_lowest_id() {
        let mut s = sampler(params(0.0));
        let mut l = vec![0.0, 3.0, 1.0, 3.0, 3.0];
        assert_eq!(s.sample(&mut l, &[]), 1);
    }

    #[test]
    fn temperature_matches_softmax() {
        let logits = [1.0f32, 2.0, 0.5, 3.0, -1.0];
        let t = 0.7f32;
        let mut s = sampler(params(t));
        let n = 20_000;
        let counts = histogram(&mut s, &logits, n);
        let z: f64 = logits.iter().map(|&l| f64::from(l / t).exp()).sum();
        let chi2: f64 = logits
            .iter()
            .zip(&counts)
            .map(|(&l, &c)| {
                let expected = f64::from(l / t).exp() / z * n as f64;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        // 4 degrees of freedom: P(chi2 > 18.47) = 0.001. Ignoring the temperature, or applying
        // it twice, yields a chi2 in the thousands.
        assert!(chi2 < 18.47, "chi2 = {chi2}, counts = {counts:?}");
    }

    #[test]
    fn high_temperature_flattens() {
        let logits = [0.0f32, 2.0];
        let mut s = sampler(params(100.0));
        let counts = histogram(&mut s, &logits, 4000);
        // At T=100 the split is ~49.5/50.5; at T=1 it would be 12/88.
        assert!(counts[0] > 1800, "{counts:?}");
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut greedy = sampler(params(0.0));
        let mut topk = sampler(SamplingParams {
            top_k: 1,
            ..params(1.5)
        });
        for seed in 0..50 {
            let logits = random_logits(seed, 1000, 4.0);
            let g = greedy.sample(&mut logits.clone(), &[]);
            let k = topk.sample(&mut logits.clone(), &[]);
            assert_eq!(g, k, "seed {seed}");
        }
        // Ties must resolve the same way in both paths.
        let logits = vec![1.0, 5.0, 5.0, 0.0];
        assert_eq!(topk.sample(&mut logits.clone(), &[]), 1);
    }

    #[test]
    fn top_k_restricts_support() {
        let logits = logits_for(&[0.1, 0.4, 0.05, 0.3, 0.15]);
        let mut s = sampler(SamplingParams {
            top_k: 2,
            ..params(1.0)
        });
        let counts = histogram(&mut s, &logits, 2000);
        assert_eq!(counts[0] + counts[2] + counts[4], 0, "{counts:?}");
        assert!(counts[1] > 0 && counts[3] > 0, "{counts:?}");
    }

    #[test]
    fn top_p_keeps_smallest_sufficient_set() {
        // Sorted: 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1).
        let logits = logits_for(&[0.3, 0.05, 0.5, 0.15]);
        let run = |top_p: f32| {
            let mut s = sampler(SamplingParams {
                top_p,
                ..params(1.0)
            });
            histogram(&mut s, &logits, 3000)
        };
        let c = run(0.75);
        assert_eq!(c[1] + c[3], 0, "top_p 0.75: {c:?}");
        assert!(c[2] > 0 && c[0] > 0, "top_p 0.75: {c:?}");
        // Renormalized over {0.5, 0.3}: id 2 should get 62.5%.
        let share = c[2] as f64 / 3000.0;
        assert!((share - 0.625).abs() < 0.04, "share {share}");

        let c = run(0.85);
        assert_eq!(c[1], 0, "top_p 0.85: {c:?}");
        assert!(c[3] > 0, "top_p 0.85: {c:?}");

        // Even a tiny top_p keeps the single most likely token.
        let c = run(0.01);
        assert_eq!(c[2], 3000, "top_p 0.01: {c:?}");
    }

    #[test]
    fn min_p_drops_relatively_unlikely_tokens() {
        let logits = logits_for(&[0.3, 0.05, 0.5, 0.15]);
        let run = |min_p: f32| {
            let mut s = sampler(SamplingParams {
                min_p,
                ..params(1.0)
            });
            histogram(&mut s, &logits, 3000)
        };
        // Threshold 0.2 * 0.5 = 0.1 drops only the 0.05 token.
        let c = run(0.2);
        assert_eq!(c[1], 0, "min_p 0.2: {c:?}");
        assert!(c[0] > 0 && c[3] > 0, "min_p 0.2: {c:?}");
        // Threshold 0.5 * 0.5 = 0.25 keeps 0.5 and 0.3.
        let c = run(0.5);
        assert_eq!(c[1] + c[3], 0, "min_p 0.5: {c:?}");
        assert!(c[0] > 0, "min_p 0.5: {c:?}");
        // min_p 1 keeps only the top token.
        let c = run(1.0);
        assert_eq!(c[2], 3000, "min_p 1: {c:?}");
    }

    /// Straightforward full-sort pipeline in f64, in the documented order, as the oracle for the
    /// partition-based implementation.
    fn reference_set(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let mut c: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, f64::from(l) / f64::from(p.temperature)))
            .collect();
        c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            c.truncate(p.top_k);
        }
        let max = c[0].1;
        let z: f64 = c.iter().map(|x| (x.1 - max).exp()).sum();
        let probs: Vec<(u32, f64)> = c.iter().map(|x| (x.0, (x.1 - max).exp() / z)).collect();
        let mut keep = probs.len();
        let mut cum = 0.0;
        for (i, x) in probs.iter().enumerate() {
            cum += x.1;
            if cum >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
        let pmax = probs[0].1;
        let mut ids: Vec<u32> = probs[..keep]
            .iter()
            .filter(|x| x.1 >= f64::from(p.min_p) * pmax)
            .map(|x| x.0)
            .collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn filters_match_full_sort_reference() {
        let configs = [
            (0, 0.9, 0.0),
            (0, 0.5, 0.0),
            (0, 0.999, 0.0),
            (40, 0.95, 0.0),
            (0, 1.0, 0.05),
            (0, 0.9, 0.01),
            (100, 0.8, 0.02),
            (5000, 0.99, 0.0),
        ];
        for seed in 0..6 {
            // Flat distributions over a large vocabulary put thousands of tokens in the nucleus
            // and in top-p's boundary bucket; rounded logits add ties at the cut.
            let scale = if seed % 2 == 0 { 6.0 } else { 30.0 };
            let mut logits = random_logits(seed, 20_000, scale);
            if seed >= 4 {
                logits.iter_mut().for_each(|l| *l = l.round());
            }
            for &(top_k, top_p, min_p) in &configs {
                let p = SamplingParams {
                    top_k,
                    top_p,
                    min_p,
                    ..params(0.8)
                };
                let mut scratch = SampleScratch::default();
                assert!(matches!(
                    sampling::filter(&logits, &p, &mut scratch),
                    sampling::Filtered::Kept
                ));
                let mut got: Vec<u32> = scratch.kept_ids().collect();
                got.sort_unstable();
                let want = reference_set(&logits, &p);
                assert_eq!(
                    got.len(),
                    want.len(),
                    "seed {seed} k {top_k} p {top_p} min_p {min_p}"
                );
                assert_eq!(got, want, "seed {seed} k {top_k} p {top_p} min_p {min_p}");
            }
        }
    }

    #[test]
    fn repetition_penalty_flips_positive_choice() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 1.5,
            ..params(0.0)
        });
        // 2.0 / 1.5 = 1.33 < 1.8
        assert_eq!(s.sample(&mut [2.0, 1.8], &[]), 0);
        assert_eq!(s.sample(&mut [2.0, 1.8], &[0]), 1);
    }

    #[test]
    fn repetition_penalty_pushes_negative_logits_down() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 1.5,
            ..params(0.0)
        });
        // -1.0 * 1.5 = -1.5 < -1.2; dividing instead would have favoured token 0 further.
        assert_eq!(s.sample(&mut [-1.0, -1.2], &[0]), 1);
    }

    #[test]
    fn repetition_penalty_applies_once_per_token() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 1.2,
            ..params(0.0)
        });
        // Once: 2.0 / 1.2 = 1.67 > 1.5. Three times would be 1.16 < 1.5.
        let mut l = [2.0, 1.5];
        assert_eq!(s.sample(&mut l, &[0, 0, 0]), 0);
        assert!((l[0] - 2.0 / 1.2).abs() < 1e-6, "{l:?}");
    }

    #[test]
    fn repetition_penalty_ignores_out_of_range_history() {
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        });
        let mut l = [1.0, 0.9];
        assert_eq!(s.sample(&mut l, &[7, 64, 1_000_000, u32::MAX]), 0);
        assert_eq!(l, [1.0, 0.9]);
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits = random_logits(7, 500, 3.0);
        let p = SamplingParams {
            top_k: 100,
            top_p: 0.95,
            seed: Some(42),
            ..params(1.0)
        };
        let run = |p: SamplingParams| {
            let mut s = sampler(p);
            (0..200)
                .map(|i| s.sample(&mut logits.clone(), &[i % 500]))
                .collect::<Vec<_>>()
        };
        let a = run(p.clone());
        let b = run(p.clone());
        assert_eq!(a, b);
        let c = run(SamplingParams {
            seed: Some(43),
            ..p.clone()
        });
        assert_ne!(a, c);
        // Sanity: the run is actually random, not stuck on one token.
        assert!(a.iter().any(|&x| x != a[0]));
    }

    #[test]
    fn unseeded_sampler_works() {
        let mut s = sampler(SamplingParams {
            seed: None,
            ..params(1.0)
        });
        let id = s.sample(&mut [0.0, 1.0, 2.0], &[]);
        assert!(id < 3);
    }

    #[test]
    fn nan_logits_never_chosen() {
        let nan = f32::NAN;
        let logits = [nan, 1.0, nan, 0.5, nan];
        let mut g = sampler(params(0.0));
        assert_eq!(g.sample(&mut logits.clone(), &[]), 1);
        for p in [
            params(1.0),
            SamplingParams {
                top_k: 3,
                ..params(1.0)
            },
            SamplingParams {
                top_p: 0.99,
                min_p: 0.01,
                ..params(5.0)
            },
        ] {
            let mut s = sampler(p);
            let c = histogram(&mut s, &logits, 2000);
            assert_eq!(c[0] + c[2] + c[4], 0, "{c:?}");
        }
    }

    #[test]
    fn degenerate_logits_fall_back_without_panicking() {
        let nan = f32::NAN;
        let ninf = f32::NEG_INFINITY;
        for t in [0.0, 1.0] {
            let mut s = sampler(SamplingParams {
                top_p: 0.9,
                ..params(t)
            });
            assert_eq!(s.sample(&mut [nan, nan, nan], &[]), 0);
            assert_eq!(s.sample(&mut [ninf, nan, ninf], &[]), 0);
            assert_eq!(s.sample(&mut [], &[]), 0);
            // A lone finite value among NaN/-inf is the only choice.
            assert_eq!(s.sample(&mut [nan, ninf, -1e30], &[]), 2);
            // +inf is a certainty; ties go to the lowest id.
            assert_eq!(
                s.sample(&mut [1.0, f32::INFINITY, 2.0, f32::INFINITY], &[]),
                1
            );
        }
        // Division by a tiny temperature overflows every logit to -inf; fall back to argmax.
        let mut s = sampler(params(1e-30));
        assert_eq!(s.sample(&mut [-1e30, -2e30, -5e29, -3e30], &[]), 2);
    }

    fn assert_invalid(p: SamplingParams, field: &str) {
        match p.validate() {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains(field), "message {msg:?} should name {field}")
            }
            other => panic!("expected InvalidArgument for {field}, got {other:?}"),
        }
        assert!(Sampler::new(p).is_err());
    }

    #[test]
    fn validate_rejects_bad_values() {
        let d = SamplingParams::default;
        for t in [f32::NAN, f32::INFINITY, -0.5] {
            assert_invalid(
                SamplingParams {
                    temperature: t,
                    ..d()
                },
                "temperature",
            );
        }
        for v in [0.0, -0.1, 1.01, f32::NAN] {
            assert_invalid(SamplingParams { top_p: v, ..d() }, "top_p");
        }
        for v in [-0.01, 1.5, f32::NAN] {
            assert_invalid(SamplingParams { min_p: v, ..d() }, "min_p");
        }
        for v in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert_invalid(
                SamplingParams {
                    repetition_penalty: v,
                    ..d()
                },
                "repetition_penalty",
            );
        }
        // The message carries the offending value too.
        let err = SamplingParams { top_p: 1.5, ..d() }.validate().unwrap_err();
        assert!(err.to_string().contains("1.5"), "{err}");
    }

    #[test]
    fn validate_accepts_boundaries() {
        let ok = SamplingParams {
            temperature: 2.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 0.5,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logit_bias: vec![(0, -100.0), (1, 100.0)],
            seed: Some(0),
        };
        ok.validate().unwrap();
        SamplingParams {
            top_p: 1e-6,
            min_p: 0.0,
            ..ok
        }
        .validate()
        .unwrap();
    }

    /// Timing on a 150k vocabulary; run with `--ignored --nocapture`.
    #[test]
    #[ignore]
    fn perf_150k_vocab() {
        let logits = random_logits(3, 150_000, 20.0);
        let history: Vec<u32> = (0..4096).map(|i| i * 31 % 150_000).collect();
        let configs = [
            ("greedy", params(0.0)),
            ("temp only", params(0.8)),
            (
                "top_k 40 + top_p 0.95",
                SamplingParams {
                    top_k: 40,
                    top_p: 0.95,
                    ..params(0.8)
                },
            ),
            (
                "top_p 0.95 (flat: nucleus of ~20k tokens)",
                SamplingParams {
                    top_p: 0.95,
                    ..params(0.8)
                },
            ),
            (
                "min_p 0.05 + top_p 0.9 + rep 1.1",
                SamplingParams {
                    top_p: 0.9,
                    min_p: 0.05,
                    repetition_penalty: 1.1,
                    ..params(0.8)
                },
            ),
        ];
        for (name, p) in configs {
            let mut s = sampler(p);
            let iters = 50;
            let mut buf = logits.clone();
            let start = std::time::Instant::now();
            for _ in 0..iters {
                buf.copy_from_slice(&logits);
                std::hint::black_box(s.sample(&mut buf, &history));
            }
            println!("{name}: {:?}/token", start.elapsed() / iters);
        }
    }
}

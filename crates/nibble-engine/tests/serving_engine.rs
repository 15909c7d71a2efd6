//! The continuous-batching engine on a tiny real model: outputs do not depend on batching,
//! chunking, preemption or prefix caching, and every block comes back.

use std::collections::HashMap;
use std::path::PathBuf;

use nibble_cpu::CpuBackend;
use nibble_engine::serving::{EngineConfig, Event, LlmEngine, Request, RequestId};
use nibble_engine::{FinishReason, SamplingParams};
use nibble_model::{KvFormat, KvSpec, Transformer, open_model};

fn engine(config: EngineConfig) -> LlmEngine<CpuBackend> {
    engine_kv(config, KvSpec::default())
}

fn engine_kv(config: EngineConfig, kv: KvSpec) -> LlmEngine<CpuBackend> {
    engine_of("tiny-qwen2", config, kv)
}

/// An engine over the fixture model `name`.
fn engine_of(name: &str, config: EngineConfig, kv: KvSpec) -> LlmEngine<CpuBackend> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name);
    let files = open_model(&dir, None).unwrap();
    let backend = CpuBackend::new(2).unwrap();
    let mut model =
        Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    model.kv_format = kv;
    LlmEngine::new(backend, model, files.tokenizer, config).unwrap()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        params: SamplingParams::default(),
        max_tokens,
        stop: vec![],
        ignore_eos: true,
        stop_token_ids: vec![],
        // Runs are compared on each token's exact log-probability too, not just the argmax.
        logprobs: Some(0),
        constraint: None,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![72, 105, 44, 32, 110, 105, 98, 98, 108],
        vec![10, 20, 30],
        (0..23).map(|i| (i * 7 % 250) as u32).collect(),
        vec![200],
        (100..117).collect(),
    ]
}

/// Runs every request to completion; returns generated tokens per id, each with the bits of its
/// log-probability.
fn run(
    e: &mut LlmEngine<CpuBackend>,
    reqs: Vec<(RequestId, Request)>,
) -> HashMap<RequestId, Vec<(u32, u32)>> {
    let mut out: HashMap<RequestId, Vec<(u32, u32)>> = HashMap::new();
    let mut done = 0;
    // Requests queued before the call run too.
    let n = reqs.len() + e.stats().waiting;
    for (id, r) in reqs {
        e.add_request(id, r).unwrap();
    }
    let mut steps = 0;
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    id, token, logprob, ..
                } => {
                    let lp = logprob.expect("requests ask for logprobs").logprob;
                    out.entry(id).or_default().push((token, lp.to_bits()));
                }
                Event::Finished { .. } => done += 1,
            }
        }
        steps += 1;
        assert!(steps < 10_000, "engine does not make progress");
    }
    assert_eq!(done, n);
    assert_eq!(
        e.stats().blocks_in_use,
        0,
        "every block must be free at the end"
    );
    out
}

/// Every prompt of `prompts()` as a request, numbered by position.
fn all_prompts(max_tokens: usize) -> Vec<(RequestId, Request)> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (i as u64, request(p, max_tokens)))
        .collect()
}

fn alone() -> HashMap<RequestId, Vec<(u32, u32)>> {
    alone_kv(KvSpec::default())
}

fn alone_kv(kv: KvSpec) -> HashMap<RequestId, Vec<(u32, u32)>> {
    let mut want = HashMap::new();
    for (i, p) in prompts().into_iter().enumerate() {
        let mut e = engine_kv(EngineConfig::default(), kv);
        want.extend(run(&mut e, vec![(i as u64, request(p, 12))]));
    }
    want
}

#[test]
fn batched_equals_alone() {
    let want = alone();
    let mut e = engine(EngineConfig::default());
    let reqs = all_prompts(12);
    assert_eq!(run(&mut e, reqs), want);
}

/// Mixture-of-experts models: a token's experts run on whichever rows chose them, so batching
/// and chunking change which rows share an expert's matmul; the outputs (tokens and the bits of
/// their log-probabilities) must not change.
#[test]
fn moe_batched_and_chunked_equal_alone() {
    for name in ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"] {
        let mut want = HashMap::new();
        for (i, p) in prompts().into_iter().enumerate() {
            let mut e = engine_of(name, EngineConfig::default(), KvSpec::default());
            want.extend(run(&mut e, vec![(i as u64, request(p, 12))]));
        }
        let mut e = engine_of(name, EngineConfig::default(), KvSpec::default());
        assert_eq!(run(&mut e, all_prompts(12)), want, "{name}: batched");
        let chunked = EngineConfig {
            max_batched_tokens: 4,
            ..EngineConfig::default()
        };
        let mut e = engine_of(name, chunked, KvSpec::default());
        assert_eq!(
            run(&mut e, all_prompts(12)),
            want,
            "{name}: chunked prefill"
        );
    }
}

/// Gemma 3 (sliding-window layers of 6 tokens, prompts up to 23 tokens and 12 generated): its
/// output alone, batched, chunked and preempted is the same, bit for bit.
#[test]
fn gemma3_batched_chunked_and_preempted_equal_alone() {
    let name = "tiny-gemma3";
    let mut want = HashMap::new();
    for (i, p) in prompts().into_iter().enumerate() {
        let mut e = engine_of(name, EngineConfig::default(), KvSpec::default());
        want.extend(run(&mut e, vec![(i as u64, request(p, 12))]));
    }
    for (what, config) in [
        ("batched", EngineConfig::default()),
        (
            "chunked prefill",
            EngineConfig {
                max_batched_tokens: 4,
                ..EngineConfig::default()
            },
        ),
        (
            "preempted",
            EngineConfig {
                num_blocks: 12,
                block_size: 4,
                ..EngineConfig::default()
            },
        ),
    ] {
        let mut e = engine_of(name, config, KvSpec::default());
        assert_eq!(run(&mut e, all_prompts(12)), want, "{name}: {what}");
        if what == "preempted" {
            assert!(
                e.stats().preemptions > 0,
                "the pool was meant to force preemption"
            );
        }
    }
}

#[test]
fn chunked_prefill_equals_alone() {
    let want = alone();
    let mut e = engine(EngineConfig {
        max_batched_tokens: 4,
        ..EngineConfig::default()
    });
    let reqs = all_prompts(12);
    assert_eq!(run(&mut e, reqs), want);
}

#[test]
fn preempted_requests_resume_with_the_same_output() {
    let want = alone();
    // 12 blocks of 4 tokens: the five sequences (up to 35 tokens each) cannot all fit.
    let mut e = engine(EngineConfig {
        num_blocks: 12,
        block_size: 4,
        ..EngineConfig::default()
    });
    let reqs = all_prompts(12);
    assert_eq!(run(&mut e, reqs), want);
    assert!(
        e.stats().preemptions > 0,
        "the pool was meant to force preemption"
    );
}

#[test]
fn shared_prefix_hits_the_cache_and_changes_nothing() {
    let prefix: Vec<u32> = (30..62).collect();
    let mut a = prefix.clone();
    a.extend([1, 2, 3]);
    let mut b = prefix.clone();
    b.extend([4, 5]);
    let mut e1 = engine(EngineConfig {
        block_size: 8,
        ..EngineConfig::default()
    });
    let want_b = run(&mut e1, vec![(2, request(b.clone(), 8))]);
    let mut e = engine(EngineConfig {
        block_size: 8,
        ..EngineConfig::default()
    });
    run(&mut e, vec![(1, request(a, 8))]);
    let before = e.stats().prefix_cache_hits;
    let got_b = run(&mut e, vec![(2, request(b, 8))]);
    assert_eq!(
        e.stats().prefix_cache_hits - before,
        4,
        "32 shared tokens = 4 cached blocks"
    );
    assert_eq!(got_b, want_b);
}

#[test]
fn abort_frees_blocks_and_stops_events() {
    let mut e = engine(EngineConfig::default());
    e.add_request(1, request(prompts()[2].clone(), 50)).unwrap();
    e.add_request(2, request(prompts()[0].clone(), 50)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.stats().blocks_in_use > 0);
    assert!(e.abort(1));
    assert!(!e.abort(1), "already gone");
    for _ in 0..3 {
        for ev in e.step().unwrap() {
            let id = match ev {
                Event::Token { id, .. } | Event::Finished { id, .. } => id,
            };
            assert_eq!(id, 2);
        }
    }
    assert!(e.abort(2));
    assert_eq!(e.stats().blocks_in_use, 0);
    assert!(!e.has_work());
}

#[test]
fn limits_and_bad_requests_are_refused() {
    let mut e = engine(EngineConfig {
        max_waiting: 2,
        num_blocks: 8,
        block_size: 4,
        ..EngineConfig::default()
    });
    // Longer than the pool (32 tokens) can ever hold.
    assert!(e.add_request(1, request((0..40).collect(), 4)).is_err());
    assert!(e.add_request(1, request(vec![], 4)).is_err());
    assert!(e.add_request(1, request(vec![999_999], 4)).is_err());
    let mut bad = request(vec![1], 4);
    bad.params.temperature = f32::NAN;
    assert!(e.add_request(1, bad).is_err());
    e.add_request(1, request(vec![1], 4)).unwrap();
    e.add_request(2, request(vec![2], 4)).unwrap();
    let full = e.add_request(3, request(vec![3], 4)).unwrap_err();
    assert!(full.to_string().contains("waiting requests"), "{full}");
}

#[test]
fn stops_eos_length_and_logprobs() {
    let mut e = engine(EngineConfig::default());
    let mut r = request(prompts()[0].clone(), 5);
    r.logprobs = Some(3);
    e.add_request(7, r).unwrap();
    let mut finish = None;
    let mut lps = vec![];
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { logprob, .. } => lps.push(logprob.unwrap()),
                Event::Finished {
                    reason,
                    completion_tokens,
                    prompt_tokens,
                    ..
                } => finish = Some((reason, completion_tokens, prompt_tokens)),
            }
        }
    }
    assert_eq!(finish, Some((FinishReason::Length, 5, 9)));
    for lp in &lps {
        assert!(lp.logprob <= 0.0 && lp.top.len() == 3);
        // Greedy: the sampled token is the most likely one.
        assert_eq!(lp.top[0].0, lp.token);
        assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
    }
}

/// The quantized caches keep every guarantee of the f32 one: greedy outputs do not depend on
/// batching, chunking (which splits KV blocks across steps), preemption or prefix caching (which
/// hands one sequence's packed blocks to another). Blocks are 16 tokens, the smallest the
/// channel-wise formats take.
fn quantized_cache_changes_nothing_but_precision(kv: KvSpec) {
    let want = alone_kv(kv);
    let f32_bytes = engine(EngineConfig::default()).kv().bytes_per_token();

    let mut e = engine_kv(EngineConfig::default(), kv);
    assert!(
        e.kv().bytes_per_token() < f32_bytes / 3.0,
        "{kv} must be in effect"
    );
    assert_eq!(run(&mut e, all_prompts(12)), want, "{kv} batched");

    let mut e = engine_kv(
        EngineConfig {
            max_batched_tokens: 4,
            ..EngineConfig::default()
        },
        kv,
    );
    assert_eq!(run(&mut e, all_prompts(12)), want, "{kv} chunked");

    // 4 blocks of 16: the longest sequence (35 tokens, 3 blocks) fits alone, the five together
    // (9 blocks) do not.
    let mut e = engine_kv(
        EngineConfig {
            num_blocks: 4,
            ..EngineConfig::default()
        },
        kv,
    );
    assert_eq!(run(&mut e, all_prompts(12)), want, "{kv} preempted");
    assert!(
        e.stats().preemptions > 0,
        "the pool was meant to force preemption"
    );
    assert_eq!(
        e.kv().residual_bytes(),
        0,
        "released blocks keep no full-precision residual"
    );

    let prefix: Vec<u32> = (30..62).collect();
    let a: Vec<u32> = prefix.iter().copied().chain([1, 2, 3]).collect();
    let b: Vec<u32> = prefix.iter().copied().chain([4, 5]).collect();
    let want_b = run(
        &mut engine_kv(EngineConfig::default(), kv),
        vec![(2, request(b.clone(), 8))],
    );
    let mut e = engine_kv(EngineConfig::default(), kv);
    run(&mut e, vec![(1, request(a, 8))]);
    let before = e.stats().prefix_cache_hits;
    let got_b = run(&mut e, vec![(2, request(b, 8))]);
    assert_eq!(
        e.stats().prefix_cache_hits - before,
        2,
        "32 shared tokens = 2 cached blocks"
    );
    assert_eq!(got_b, want_b, "{kv} prefix-cached");
}

#[test]
fn kv8_changes_nothing_but_precision() {
    quantized_cache_changes_nothing_but_precision(KvFormat::Int8.into());
}

#[test]
fn kv4c_changes_nothing_but_precision() {
    quantized_cache_changes_nothing_but_precision(KvFormat::Int4Channel.into());
}

/// Keys and values in different formats, both quantized as written.
#[test]
fn k8v4_changes_nothing_but_precision() {
    quantized_cache_changes_nothing_but_precision("k8v4".parse().unwrap());
}

/// Values wait for their block (2-bit, channel-wise family) while INT4 keys are quantized as
/// written: the residual then holds the keys' written records next to the raw values.
#[test]
fn k4v2c_changes_nothing_but_precision() {
    quantized_cache_changes_nothing_but_precision("k4v2c".parse().unwrap());
}

/// The other way round: channel-wise keys wait for their block, INT8 values do not.
#[test]
fn k4cv8_changes_nothing_but_precision() {
    quantized_cache_changes_nothing_but_precision("k4cv8".parse().unwrap());
}

#[test]
fn channel_wise_caches_refuse_small_blocks() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2");
    let files = open_model(&dir, None).unwrap();
    let backend = CpuBackend::new(1).unwrap();
    let mut model =
        Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    model.kv_format = KvFormat::Int2Channel.into();
    let config = EngineConfig {
        block_size: 8,
        ..EngineConfig::default()
    };
    let err = LlmEngine::new(backend, model, files.tokenizer, config)
        .err()
        .expect("blocks of 8 are too small for kv2c")
        .to_string();
    assert!(err.contains("at least 16"), "{err}");
}

/// Runs one request to the end: its tokens and how it finished.
fn run_one(e: &mut LlmEngine<CpuBackend>, r: Request) -> (Vec<u32>, Option<(FinishReason, usize)>) {
    e.add_request(1, r).unwrap();
    let (mut tokens, mut finish) = (vec![], None);
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { token, .. } => tokens.push(token),
                Event::Finished {
                    reason,
                    completion_tokens,
                    ..
                } => finish = Some((reason, completion_tokens)),
            }
        }
    }
    (tokens, finish)
}

#[test]
fn a_stop_token_id_ends_the_sequence_and_is_not_output() {
    let mut e = engine(EngineConfig::default());
    let (greedy, _) = run_one(&mut e, request(prompts()[0].clone(), 12));
    // The first token of the greedy output that did not come before: the run stops right there.
    let at = (1..greedy.len())
        .find(|&i| !greedy[..i].contains(&greedy[i]))
        .expect("some token is new");
    let mut r = request(prompts()[0].clone(), 12);
    r.stop_token_ids = vec![greedy[at], 999_999];
    let (tokens, finish) = run_one(&mut e, r);
    assert_eq!(tokens, greedy[..at]);
    assert_eq!(finish, Some((FinishReason::Stop, at)));
    assert_eq!(e.stats().blocks_in_use, 0);
}

#[test]
fn requests_added_together_are_all_queued_or_none() {
    let mut e = engine(EngineConfig {
        max_waiting: 4,
        ..EngineConfig::default()
    });
    let group = |n: u64, from: u64| -> Vec<(RequestId, Request)> {
        (from..from + n)
            .map(|id| (id, request(vec![1, 2, 3], 2)))
            .collect()
    };
    let never = e.add_requests(group(5, 0)).unwrap_err();
    assert!(!never.to_string().contains("waiting"), "{never}");
    e.add_requests(group(3, 0)).unwrap();
    let full = e.add_requests(group(2, 10)).unwrap_err();
    assert!(full.to_string().contains("waiting requests"), "{full}");
    // One bad request refuses its whole group.
    let mut bad = group(1, 20);
    bad.push((21, request(vec![], 2)));
    assert!(e.add_requests(bad).is_err());
    assert_eq!(e.stats().waiting, 3, "nothing of a refused group is queued");
    e.add_requests(group(1, 30)).unwrap();
}

#[test]
fn choices_of_one_prompt_share_its_blocks_and_keep_their_outputs() {
    // 35 tokens in blocks of 8: 4 full blocks before the last token.
    let prompt = prompts()[2]
        .iter()
        .chain(&prompts()[4])
        .copied()
        .collect::<Vec<u32>>();
    assert_eq!(prompt.len(), 40);
    let prompt = prompt[..35].to_vec();
    let config = EngineConfig {
        block_size: 8,
        ..EngineConfig::default()
    };
    let seeded = |seed: u64| {
        let mut r = request(prompt.clone(), 10);
        r.params.temperature = 1.0;
        r.params.seed = Some(seed);
        r
    };
    let mut want = HashMap::new();
    for i in 0..4 {
        want.extend(run(&mut engine(config.clone()), vec![(i, seeded(i))]));
    }
    for budget in [512, 16] {
        let mut e = engine(EngineConfig {
            max_batched_tokens: budget,
            ..config.clone()
        });
        e.add_requests((0..4).map(|i| (i, seeded(i))).collect())
            .unwrap();
        let got = run(&mut e, vec![]);
        assert_eq!(got, want, "budget {budget}");
        assert_eq!(
            e.stats().prefix_cache_hits,
            3 * 4,
            "3 choices x 4 blocks from the first choice (budget {budget})"
        );
        assert_eq!(e.stats().prompt_tokens, 4 * 35);
    }
    let distinct: std::collections::HashSet<_> = want.values().collect();
    assert_eq!(distinct.len(), 4, "different seeds, different outputs");
}

//! The engine running ahead of the host (step n+1 queued before step n's tokens are read) gives
//! exactly what it gives in lockstep: the same tokens, log-probabilities, texts and finish
//! reasons, through EOS, stop strings, length limits, preemption, aborts, the repetition
//! penalty (which makes it wait) and requests admitted mid-run.
//!
//! The CPU computes on the calling thread and never runs ahead, so a test double does what a
//! GPU does: [`Deferred`] wraps the CPU backend, keeps each sampling's results until they are
//! collected, and substitutes fed tokens the way the device does, at the embedding, so that a
//! placeholder the engine forgot to feed shows up as a different output.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use nibble_core::{Error, Result};
use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
use nibble_engine::serving::{EngineConfig, Event, LlmEngine, Request, RequestId};
use nibble_engine::structured::{GrammarSpec, Grammars};
use nibble_engine::{FinishReason, SamplingParams};
use nibble_formats::HostTensor;
use nibble_model::sampling::{PendingSample, SampleSpec, Sampled};
use nibble_model::{Backend, BatchLayout, Transformer, open_model};

#[derive(Default)]
struct DeferredState {
    launches: usize,
    /// Uncollected results by launch.
    queued: HashMap<usize, Vec<Sampled>>,
    /// The latest launch's tokens, where a fed row reads them.
    latest: Option<Vec<u32>>,
    feed: Vec<(usize, usize)>,
    /// The current forward pass's tokens with the fed ones in place.
    fed_tokens: Option<Vec<u32>>,
    /// Rows fed so far (the test checks running ahead happened).
    fed_rows: usize,
}

struct Deferred {
    cpu: CpuBackend,
    state: Mutex<DeferredState>,
}

impl Deferred {
    fn st(&self) -> std::sync::MutexGuard<'_, DeferredState> {
        self.state.lock().unwrap()
    }
}

impl Backend for Deferred {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKvCache;

    nibble_cpu::delegate_to_cpu!(cpu);
    nibble_cpu::delegate_attention_and_linear_to_cpu!(cpu);

    fn name(&self) -> String {
        "deferred cpu".into()
    }
    fn load_weight(&self, t: &HostTensor) -> Result<CpuWeight> {
        self.cpu.load_weight(t)
    }
    fn begin_forward(&self, tokens: &[u32], batch: &BatchLayout) -> Result<()> {
        let mut st = self.st();
        let feed = std::mem::take(&mut st.feed);
        let mut fed = tokens.to_vec();
        for &(row, spec) in &feed {
            let latest = st.latest.as_ref().ok_or_else(|| {
                Error::InvalidArgument("fed from a sampling not on the device".into())
            })?;
            fed[row] = latest[spec];
        }
        st.fed_rows += feed.len();
        st.fed_tokens = Some(fed);
        drop(st);
        self.cpu.begin_forward(tokens, batch)
    }
    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
        let fed = self.st().fed_tokens.take();
        match fed {
            Some(f) if f.len() == ids.len() => self.cpu.embed(table, &f),
            _ => self.cpu.embed(table, ids),
        }
    }
    fn runs_ahead(&self) -> bool {
        true
    }
    fn launch_sample(
        &self,
        logits: &CpuTensor,
        vocab: usize,
        specs: &[SampleSpec],
    ) -> Result<PendingSample> {
        let out = self.cpu.sample(logits, vocab, specs)?;
        let mut st = self.st();
        let launch = st.launches;
        st.launches += 1;
        st.latest = Some(out.iter().map(|s| s.token).collect());
        st.queued.insert(launch, out);
        Ok(PendingSample::Queued {
            slot: launch,
            logprobs: specs.iter().map(|s| s.logprobs).collect(),
        })
    }
    fn collect_sample(&self, pending: PendingSample) -> Result<Vec<Sampled>> {
        match pending {
            PendingSample::Ready(s) => Ok(s),
            PendingSample::Queued { slot, .. } => self
                .st()
                .queued
                .remove(&slot)
                .ok_or_else(|| Error::InvalidArgument(format!("launch {slot} collected twice"))),
        }
    }
    fn feed_sampled(&self, rows: &[(usize, usize)]) -> Result<()> {
        let mut st = self.st();
        let n = st.latest.as_ref().map_or(0, Vec::len);
        if let Some(&(_, spec)) = rows.iter().find(|&&(_, s)| s >= n) {
            return Err(Error::InvalidArgument(format!(
                "fed spec {spec} of a sampling of {n}"
            )));
        }
        st.feed = rows.to_vec();
        Ok(())
    }
}

fn engine(config: EngineConfig) -> LlmEngine<Deferred> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2");
    let files = open_model(&dir, None).unwrap();
    let backend = Deferred {
        cpu: CpuBackend::new(2).unwrap(),
        state: Mutex::default(),
    };
    let model = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    LlmEngine::new(backend, model, files.tokenizer, config).unwrap()
}

/// Requests that end every way: length, EOS (not ignored, so whichever token is EOS ends it),
/// stop strings, seeded sampling, logprobs, one with a repetition penalty, one with presence
/// and frequency penalties and a logit bias, and one held to a regular expression.
/// What request 5's output must match.
const REQUEST_5: &str = "[a-z]{2,8}( [a-z]{1,8}){0,3}[.!]";

fn requests() -> Vec<(RequestId, Request)> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2");
    let files = open_model(&dir, None).unwrap();
    let grammars = Grammars::new(&files.tokenizer, files.config.vocab_size).unwrap();
    (0..9u64)
        .map(|i| {
            let prompt: Vec<u32> = (0..2 + i as u32 * 4)
                .map(|t| 1 + (t * 13 + i as u32 * 7) % 250)
                .collect();
            let params = SamplingParams {
                temperature: if i % 3 == 0 { 0.0 } else { 0.9 },
                top_k: if i % 2 == 0 { 40 } else { 0 },
                seed: Some(100 + i),
                repetition_penalty: if i == 4 { 1.3 } else { 1.0 },
                presence_penalty: if i == 3 { 0.7 } else { 0.0 },
                frequency_penalty: if i == 3 { 0.4 } else { 0.0 },
                logit_bias: if i == 3 { vec![(100, 3.0)] } else { vec![] },
                ..SamplingParams::default()
            };
            let req = Request {
                prompt,
                params,
                // Room for request 5's grammar to finish.
                max_tokens: if i == 5 { 60 } else { 6 + i as usize * 3 },
                stop: if i == 1 || i == 6 || i == 9 {
                    vec!["w".into(), "C*".into()]
                } else {
                    vec![]
                },
                ignore_eos: i % 2 == 0,
                // Tokens these sample (at the 11th and 24th place): they end in a step whose
                // successor was already run ahead for them.
                stop_token_ids: match i {
                    2 => vec![161, 300],
                    8 => vec![113],
                    _ => vec![],
                },
                logprobs: (i % 3 == 2).then_some(2),
                constraint: (i == 5).then(|| {
                    grammars
                        .compile(&GrammarSpec::Regex(REQUEST_5.into()))
                        .unwrap()
                }),
            };
            (i, req)
        })
        .collect()
}

/// Everything the engine said, per request, in order; requests join as the run goes (one
/// before each of the first steps) and request 7 is aborted two steps after it joins.
fn run(run_ahead: bool, num_blocks: usize) -> (HashMap<RequestId, Vec<Event>>, usize, u64) {
    let mut e = engine(EngineConfig {
        num_blocks,
        max_num_seqs: 5,
        max_batched_tokens: 24,
        run_ahead,
        ..EngineConfig::default()
    });
    assert_eq!(e.runs_ahead(), run_ahead);
    let mut reqs = requests().into_iter();
    let mut out: HashMap<RequestId, Vec<Event>> = HashMap::new();
    let mut steps = 0;
    loop {
        if let Some((id, r)) = reqs.next() {
            e.add_request(id, r).unwrap();
        } else if !e.has_work() {
            break;
        }
        if steps == 9 {
            assert!(e.abort(7), "request 7 is known");
        }
        for ev in e.step().unwrap() {
            let id = match &ev {
                Event::Token { id, .. } | Event::Finished { id, .. } => *id,
            };
            out.entry(id).or_default().push(ev);
        }
        steps += 1;
    }
    let stats = e.stats();
    assert_eq!(stats.blocks_in_use, 0, "every block comes back");
    let fed = e.backend.state.lock().unwrap().fed_rows;
    (out, fed, stats.preemptions)
}

fn finish_reasons(out: &HashMap<RequestId, Vec<Event>>) -> Vec<(RequestId, FinishReason)> {
    let mut r: Vec<_> = out
        .iter()
        .filter_map(|(&id, evs)| match evs.last() {
            Some(Event::Finished { reason, .. }) => Some((id, *reason)),
            _ => None,
        })
        .collect();
    r.sort_by_key(|&(id, _)| id);
    r
}

#[test]
fn running_ahead_changes_no_output() {
    let (lockstep, fed, _) = run(false, 64);
    assert_eq!(fed, 0, "lockstep feeds nothing");
    let (ahead, fed, _) = run(true, 64);
    assert!(fed > 20, "only {fed} rows were fed from the device");
    assert_eq!(ahead, lockstep);
    let reasons = finish_reasons(&lockstep);
    // Requests 2 and 8 stop at a stop token id, which never reaches the output.
    for (id, len) in [(2, 10), (8, 23)] {
        let events = &lockstep[&id];
        assert!(
            matches!(
                events.last(),
                Some(Event::Finished {
                    reason: FinishReason::Stop,
                    ..
                })
            ),
            "request {id}: {events:?}"
        );
        let tokens = events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
        assert_eq!(tokens, len, "request {id}");
    }
    // Request 5 wrote what its grammar allows, and stopped where the grammar ended.
    let text: String = lockstep[&5]
        .iter()
        .map(|e| match e {
            Event::Token { text, .. } => text.clone(),
            Event::Finished { tail, reason, .. } => {
                assert_eq!(*reason, FinishReason::Eos, "request 5");
                tail.clone()
            }
        })
        .collect();
    let words: Vec<&str> = text[..text.len() - 1].split(' ').collect();
    assert!(
        text.ends_with(['.', '!'])
            && (1..=4).contains(&words.len())
            && words
                .iter()
                .enumerate()
                .all(|(i, w)| w.len() >= if i == 0 { 2 } else { 1 }
                    && w.len() <= 8
                    && w.bytes().all(|b| b.is_ascii_lowercase())),
        "request 5: {text:?}"
    );
    // Request 7 was aborted: no Finished event.
    assert_eq!(reasons.len(), 8, "{reasons:?}");
    assert!(reasons.iter().any(|(_, r)| *r == FinishReason::Length));
    assert!(
        reasons
            .iter()
            .filter(|(_, r)| *r == FinishReason::Stop)
            .count()
            >= 2,
        "{reasons:?}"
    );
}

#[test]
fn running_ahead_with_preemption_changes_no_output() {
    // 5 blocks of 16 tokens for 5 sequences of up to 64 tokens: sequences are preempted.
    let (lockstep, _, preempted) = run(false, 5);
    assert!(
        preempted > 0,
        "the pool was large enough to preempt nothing"
    );
    let (ahead, fed, _) = run(true, 5);
    assert!(fed > 0);
    assert_eq!(ahead, lockstep);
}

/// Choices of one prompt admitted together: the later ones join once the first has computed the
/// prompt, which with running ahead is while that step is still in flight.
#[test]
fn running_ahead_with_shared_prompts_changes_no_output() {
    let run = |run_ahead: bool| {
        let mut e = engine(EngineConfig {
            run_ahead,
            ..EngineConfig::default()
        });
        let prompt: Vec<u32> = (0..40).map(|t| 1 + (t * 11) % 250).collect();
        let group = (0..3u64)
            .map(|i| {
                let params = SamplingParams {
                    temperature: 0.8,
                    seed: Some(7 + i),
                    ..SamplingParams::default()
                };
                let req = Request {
                    prompt: prompt.clone(),
                    params,
                    max_tokens: 8,
                    stop: vec![],
                    ignore_eos: true,
                    stop_token_ids: vec![],
                    logprobs: None,
                    constraint: None,
                };
                (i, req)
            })
            .collect();
        e.add_requests(group).unwrap();
        let mut out: HashMap<RequestId, Vec<Event>> = HashMap::new();
        while e.has_work() {
            for ev in e.step().unwrap() {
                let id = match &ev {
                    Event::Token { id, .. } | Event::Finished { id, .. } => *id,
                };
                out.entry(id).or_default().push(ev);
            }
        }
        let stats = e.stats();
        assert_eq!(stats.blocks_in_use, 0);
        // 40 tokens in blocks of 16: 2 full blocks, shared by the 2 later choices.
        assert_eq!(stats.prefix_cache_hits, 4, "run ahead: {run_ahead}");
        out
    };
    assert_eq!(run(true), run(false));
}

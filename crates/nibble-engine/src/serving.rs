//! The serving engine: many requests share the model through continuous batching over a paged
//! KV cache.
//!
//! Each `step` builds one batch under a token budget: first the running sequences (one decode
//! token each, or the next chunk of a prompt being prefilled in pieces), then new requests from
//! the waiting queue, whose prompts are chunked to fit the budget (chunked prefill). When the KV
//! pool runs out, the most recently admitted sequence is preempted: its blocks are released and
//! it goes back to the head of the queue to be recomputed later (its sampler state is kept, so
//! its output is the same as if it had never been interrupted). Nothing here depends on which
//! backend runs the model.

use std::collections::VecDeque;

use nibble_core::{Error, Result};
use nibble_formats::tokenizer::{StreamDecoder, Tokenizer};
use nibble_model::sampling::PendingSample;
use nibble_model::{Backend, BatchLayout, LogitRows, SeqSpan, Transformer};

use crate::block_manager::{BlockId, BlockManager, HashChain};
use crate::structured::Constraint;
use crate::{FinishReason, Sampler, SamplingParams, StopMatcher};

pub type RequestId = u64;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool (pool tokens = `num_blocks * block_size`).
    pub num_blocks: usize,
    /// Sequences decoded together at most.
    pub max_num_seqs: usize,
    /// Tokens one forward pass processes at most (decode tokens + prefill chunks).
    pub max_batched_tokens: usize,
    /// Requests that may wait for admission; beyond this `add_request` refuses.
    pub max_waiting: usize,
    /// Queue step n+1 while step n runs, on backends that [run ahead](Backend::runs_ahead)
    /// (`false`: every step waits for its tokens before the next is scheduled).
    pub run_ahead: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_waiting: 256,
            run_ahead: true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Token ids that end the generation when sampled, as EOS does (finish reason `Stop`):
    /// the token is not part of the output. Unlike EOS they apply with `ignore_eos` too.
    pub stop_token_ids: Vec<u32>,
    /// Also report the sampled token's log-probability and this many top alternatives.
    pub logprobs: Option<usize>,
    /// Structured output: only tokens the grammar allows are sampled; the sequence ends
    /// (`FinishReason::Eos`) once the grammar is complete, or at an EOS where it accepts (even
    /// with `ignore_eos`).
    pub constraint: Option<Constraint>,
}

/// A call that changes an engine's state, in the order rank 0's engine took it: what the other
/// ranks of a tensor-parallel server repeat on their own engines ([`LlmEngine::mirror_to`],
/// [`LlmEngine::follow`]) so that every rank issues the same steps and collectives.
#[derive(Debug, Clone)]
pub enum EngineOp {
    Add(Vec<(RequestId, Request)>),
    Abort(RequestId),
    Step,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token; `text` is the newly final text (may be empty while a multi-byte
    /// character or a possible stop string is pending).
    Token {
        id: RequestId,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        id: RequestId,
        reason: FinishReason,
        /// Text held back until the end (a partial stop-string match that did not complete).
        tail: String,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
}

struct Sequence {
    id: RequestId,
    /// Unique within the engine (request ids come from outside and might repeat).
    serial: u64,
    req: Request,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    /// Leading tokens whose KV is in the cache.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Progress of registering this sequence's full blocks in the prefix cache.
    hashed: HashChain,
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    generated: usize,
    /// Tokens sampled in steps still in flight, not yet in `tokens` (0 or 1; 2 for a moment
    /// while the step run ahead is launched).
    unseen: usize,
    /// This sequence's spec index in the latest launched sampling, where the device keeps its
    /// unseen token.
    latest_spec: Option<usize>,
    /// The serial of an earlier sequence of the same [`LlmEngine::add_requests`] call with the
    /// same prompt. This one is admitted once that one's prompt is computed, so that it finds
    /// the prompt's full blocks in the prefix cache instead of computing them again.
    follows: Option<u64>,
}

impl Sequence {
    /// Tokens whose KV is still to be computed (an unseen token counts: its KV is computed in
    /// the step after it is sampled).
    fn pending(&self) -> usize {
        self.tokens.len() + self.unseen - self.computed
    }
}

/// A step whose sampled tokens have not been read yet.
struct InFlight {
    pending: PendingSample,
    /// The sampled sequences' serials, in spec order.
    serials: Vec<u64>,
    seqs: usize,
    tokens: usize,
    decode_only: bool,
    launch_s: f64,
    forward_call_s: f64,
    sample_call_s: f64,
    forward_wait_s: f64,
}

/// Counters for /metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub waiting: usize,
    pub running: usize,
    pub blocks_in_use: usize,
    pub blocks_total: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
}

pub struct LlmEngine<B: Backend> {
    pub backend: B,
    pub model: Transformer<B>,
    pub tokenizer: Tokenizer,
    pub config: EngineConfig,
    kv: B::Kv,
    blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    /// In admission order; the last one is preempted first.
    running: Vec<Sequence>,
    preemptions: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    /// Per-step timings, when [`LlmEngine::set_profiling`] turned them on.
    profile: Option<Vec<StepProfile>>,
    /// Whether steps run ahead (the config asks and the backend can).
    run_ahead: bool,
    in_flight: Option<InFlight>,
    next_serial: u64,
    /// Where every state-changing call goes first (tensor parallelism's other ranks).
    mirror: Option<Box<dyn FnMut(EngineOp) + Send>>,
}

/// Where one step's time went: `host_s` scheduling and preparing the batch, queueing the forward
/// pass and handling its tokens; `device_s` waiting for the device (the forward pass and the
/// sampling). On the CPU backend the forward pass is host time. When steps run ahead, the host
/// time of a step (launching the next one, handling this one's tokens) overlaps the device's
/// work on it, and `device_s` is only the wait for its tokens; `launch_s` is the part spent
/// scheduling and queueing a step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepProfile {
    pub seqs: usize,
    pub tokens: usize,
    pub decode_only: bool,
    pub host_s: f64,
    pub device_s: f64,
    pub launch_s: f64,
    /// Parts of `launch_s`: queueing the forward pass, and queueing the sampling.
    pub forward_call_s: f64,
    pub sample_call_s: f64,
}

/// Runs the largest step the engine will build (`max_tokens` tokens over up to `max_seqs`
/// sequences, then sampled) twice in a scratch pool, so that a device backend takes its
/// activation and sampling memory now: before the KV pool is sized from what is left, and
/// before decode steps are recorded as graphs, which a later growth of that memory would make
/// it record again.
pub fn warm_up<B: Backend>(
    backend: &B,
    model: &Transformer<B>,
    max_tokens: usize,
    max_seqs: usize,
    block_size: usize,
) -> Result<()> {
    let seqs = max_seqs.min(max_tokens).max(1);
    let ctx = model.config.max_context.saturating_sub(1).max(1);
    let mut batch = BatchLayout::default();
    let mut next_block = 0u32;
    for i in 0..seqs {
        let len = (max_tokens / seqs + usize::from(i < max_tokens % seqs)).clamp(1, ctx);
        let blocks = len.div_ceil(block_size) as u32;
        batch.seqs.push(SeqSpan {
            blocks: (next_block..next_block + blocks).collect(),
            start_pos: 0,
            len,
        });
        next_block += blocks;
    }
    let tokens = vec![0u32; batch.num_tokens()];
    let mut kv = backend.new_kv_pool(model.kv_shape(), next_block as usize, block_size)?;
    let params = crate::SamplingParams::default();
    let specs: Vec<_> = (0..seqs)
        .map(|row| nibble_model::sampling::SampleSpec {
            row,
            params: &params,
            seed: 0,
            draw: 0,
            history: &[],
            output: &[],
            allowed: None,
            logprobs: Some(nibble_model::sampling::MAX_TOP_LOGPROBS),
        })
        .collect();
    for _ in 0..2 {
        let logits = model.forward(backend, &tokens, &batch, &mut kv, LogitRows::LastPerSeq)?;
        backend.sample(&logits, model.config.vocab_size, &specs)?;
    }
    backend.synchronize()
}

impl<B: Backend> LlmEngine<B> {
    pub fn new(
        backend: B,
        model: Transformer<B>,
        tokenizer: Tokenizer,
        config: EngineConfig,
    ) -> Result<Self> {
        if config.block_size == 0
            || config.num_blocks == 0
            || config.max_batched_tokens == 0
            || config.max_num_seqs == 0
        {
            return Err(Error::InvalidArgument(format!(
                "engine sizes must be positive: {config:?}"
            )));
        }
        // One block past the block manager's: the padding sequences of a bucketed decode step
        // write there, and nothing reads it.
        let kv = backend.new_kv_pool(model.kv_shape(), config.num_blocks + 1, config.block_size)?;
        let run_ahead = config.run_ahead && backend.runs_ahead();
        Ok(LlmEngine {
            run_ahead,
            in_flight: None,
            next_serial: 0,
            blocks: BlockManager::new(config.num_blocks, config.block_size),
            backend,
            model,
            tokenizer,
            config,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            prompt_tokens: 0,
            generated_tokens: 0,
            profile: None,
            mirror: None,
        })
    }

    /// Sends every call that changes this engine's state ([`EngineOp`]) to `mirror` before it
    /// runs here: rank 0 of a tensor-parallel server, whose other ranks [`LlmEngine::follow`].
    pub fn mirror_to(&mut self, mirror: Box<dyn FnMut(EngineOp) + Send>) {
        self.mirror = Some(mirror);
    }

    /// Repeats rank 0's calls on this engine until `ops` closes (rank 0's engine is gone). A
    /// request rank 0 refused is refused here alike and skipped; a failed step ends the rank
    /// (its collectives could no longer match rank 0's).
    pub fn follow(&mut self, ops: std::sync::mpsc::Receiver<EngineOp>) -> Result<()> {
        for op in ops {
            match op {
                EngineOp::Add(reqs) => {
                    let _ = self.add_requests(reqs);
                }
                EngineOp::Abort(id) => {
                    self.abort(id);
                }
                EngineOp::Step => {
                    self.step()?;
                }
            }
        }
        Ok(())
    }

    /// Whether this engine leads a tensor-parallel group ([`LlmEngine::mirror_to`]). A step that
    /// fails here cannot be recovered from as a lone engine does: the other ranks may have run
    /// it, so their sequences and KV no longer match this rank's, and the group must end.
    pub fn leads_group(&self) -> bool {
        self.mirror.is_some()
    }

    fn mirror(&mut self, op: impl FnOnce() -> EngineOp) {
        if let Some(m) = self.mirror.as_mut() {
            m(op());
        }
    }

    /// Gives the model back (its KV pool freed), e.g. to build another engine of other sizes.
    pub fn into_parts(self) -> (B, Transformer<B>, Tokenizer) {
        // A step still in flight reads the pool about to be freed.
        if self.in_flight.is_some() {
            let _ = self.backend.synchronize();
        }
        (self.backend, self.model, self.tokenizer)
    }

    /// Records a [`StepProfile`] for every step from now on (each step then waits for the
    /// device once more, to split host from device time).
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(Vec::new);
        self.backend.record_device_timeline(on);
    }

    /// Where the device's time went since profiling was turned on, by its own clock (devices
    /// that record it): busy with steps, or idle between them waiting for the host.
    pub fn take_device_timeline(&mut self) -> Option<nibble_model::DeviceTimeline> {
        self.backend.take_device_timeline()
    }

    /// The steps profiled so far.
    pub fn take_profile(&mut self) -> Vec<StepProfile> {
        self.profile
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Largest prompt + completion one request may reach: the model's context, and the whole pool.
    pub fn max_sequence_len(&self) -> usize {
        self.model
            .config
            .max_context
            .min(self.config.num_blocks * self.config.block_size)
    }

    /// Queues a request. Refuses (nothing queued) a request that can never fit, or when the
    /// waiting queue is full.
    pub fn add_request(&mut self, id: RequestId, req: Request) -> Result<()> {
        self.add_requests(vec![(id, req)])
    }

    /// Queues several requests (the choices of one API request) together: all of them, or none
    /// when one can never fit or the waiting queue cannot take them all. Requests with the same
    /// prompt share its KV blocks: the first computes it, the others are admitted after it and
    /// find the prompt's full blocks in the prefix cache.
    pub fn add_requests(&mut self, mut reqs: Vec<(RequestId, Request)>) -> Result<()> {
        if self.mirror.is_some() {
            // Every rank must draw the same tokens: a request without a seed gets one here,
            // before the other ranks see it, instead of one from each rank's own entropy.
            for (_, r) in &mut reqs {
                r.params.seed.get_or_insert_with(rand::random);
            }
        }
        self.mirror(|| EngineOp::Add(reqs.clone()));
        for (_, req) in &reqs {
            self.check(req)?;
        }
        if reqs.len() > self.config.max_waiting {
            // Waiting could never make room for them: say so rather than "try again".
            return Err(Error::LimitExceeded {
                what: "sequences in one request (the queue's size)".into(),
                value: reqs.len(),
                limit: self.config.max_waiting,
            });
        }
        if self.waiting.len() + reqs.len() > self.config.max_waiting {
            return Err(Error::LimitExceeded {
                what: "waiting requests".into(),
                value: self.waiting.len() + reqs.len(),
                limit: self.config.max_waiting,
            });
        }
        let samplers = reqs
            .iter()
            .map(|(_, r)| Sampler::new(r.params.clone()))
            .collect::<Result<Vec<_>>>()?;
        // Only a prompt with a full block before its last token has anything to share
        // (`BlockManager::match_prefix` leaves the last token uncached).
        let shareable = |p: &[u32]| (p.len() - 1) / self.config.block_size > 0;
        let mut leaders: std::collections::HashMap<Vec<u32>, u64> = Default::default();
        for ((id, req), sampler) in reqs.into_iter().zip(samplers) {
            self.next_serial += 1;
            let serial = self.next_serial;
            let follows = if shareable(&req.prompt) {
                match leaders.get(&req.prompt) {
                    Some(&leader) => Some(leader),
                    None => {
                        leaders.insert(req.prompt.clone(), serial);
                        None
                    }
                }
            } else {
                None
            };
            self.waiting.push_back(Sequence {
                id,
                serial,
                unseen: 0,
                latest_spec: None,
                follows,
                tokens: req.prompt.clone(),
                stops: StopMatcher::new(req.stop.clone()),
                req,
                computed: 0,
                blocks: Vec::new(),
                hashed: HashChain::default(),
                sampler,
                decoder: StreamDecoder::new(),
                generated: 0,
            });
        }
        Ok(())
    }

    /// Refuses a request that can never be served.
    fn check(&self, req: &Request) -> Result<()> {
        req.params.validate()?;
        let limit = self.max_sequence_len();
        if req.prompt.is_empty() {
            return Err(Error::InvalidArgument("the prompt is empty".into()));
        }
        if req.prompt.len() >= limit {
            return Err(Error::LimitExceeded {
                what: "prompt length in tokens".into(),
                value: req.prompt.len(),
                limit: limit - 1,
            });
        }
        if let Some(&bad) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.model.config.vocab_size)
        {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        Ok(())
    }

    /// Drops a request wherever it is and frees its blocks. Returns whether it was known.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.mirror(|| EngineOp::Abort(id));
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("index from position");
            self.release(&s.blocks);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.release(&s.blocks);
            return true;
        }
        false
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || self.in_flight.is_some()
    }

    /// Whether steps run ahead of the host (see [`LlmEngine::step`]).
    pub fn runs_ahead(&self) -> bool {
        self.run_ahead
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            blocks_in_use: self.blocks.in_use(),
            blocks_total: self.blocks.num_blocks(),
            prefix_cache_queries: self.blocks.prefix_queries,
            prefix_cache_hits: self.blocks.prefix_hits,
            preemptions: self.preemptions,
            prompt_tokens: self.prompt_tokens,
            generated_tokens: self.generated_tokens,
        }
    }

    /// The KV pool (for its size and format).
    pub fn kv(&self) -> &B::Kv {
        &self.kv
    }

    /// Gives a sequence's blocks back to the block manager, and tells the pool so it can drop
    /// what it kept only for blocks being filled.
    fn release(&mut self, table: &[BlockId]) {
        self.blocks.release(table);
        self.backend.release_kv_blocks(&mut self.kv, table);
    }

    fn preempt_last(&mut self) -> bool {
        match self.running.pop() {
            Some(mut s) => {
                debug_assert_eq!(s.unseen, 0, "preempted with a step in flight");
                self.release(&s.blocks);
                s.blocks.clear();
                s.hashed = HashChain::default();
                s.computed = 0;
                self.preemptions += 1;
                self.waiting.push_front(s);
                true
            }
            None => false,
        }
    }

    /// Runs one step and returns what it produced: the tokens of one forward pass.
    ///
    /// On a backend that [runs ahead](Backend::runs_ahead) of the host, the step after it is
    /// queued before this one's tokens are read back, its decode rows taking their tokens from
    /// the device: the host schedules, stages and launches step n+1, then handles step n's
    /// tokens (detokenizing, stop strings, events) while the GPU runs n+1. The only wait is for
    /// step n's sampled ids. Whatever step n decides (a sequence reached EOS or a stop string)
    /// is seen one step late: the row step n+1 computed for it is discarded, which costs one row
    /// and changes no output.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.mirror(|| EngineOp::Step);
        let r = self.step_inner();
        if r.is_err() {
            self.recover();
        }
        r
    }

    fn step_inner(&mut self) -> Result<Vec<Event>> {
        let current = match self.in_flight.take() {
            Some(f) => f,
            None => {
                let t0 = std::time::Instant::now();
                // Without a step in flight nothing makes the schedule wait: it is `Some`.
                let rows = self.schedule(false)?.unwrap_or_default();
                if rows.is_empty() {
                    return Ok(Vec::new());
                }
                self.launch(rows, t0)?
            }
        };
        let ahead = if self.run_ahead && current.pending.on_device() {
            let t0 = std::time::Instant::now();
            match self.schedule(true)? {
                Some(rows) if !rows.is_empty() => Some(self.launch(rows, t0)?),
                _ => None,
            }
        } else {
            None
        };
        let events = self.finish(current)?;
        self.in_flight = ahead;
        Ok(events)
    }

    /// After a failed step: nothing is in flight any more, and every running sequence goes back
    /// to the queue to be recomputed (a failed forward pass may have left its KV half written).
    /// Tokens sampled but not yet read are dropped with their draws, so recomputing samples
    /// them again, the same.
    fn recover(&mut self) {
        self.in_flight = None;
        let _ = self.backend.synchronize();
        while let Some(mut s) = self.running.pop() {
            self.release(&s.blocks);
            s.blocks.clear();
            s.hashed = HashChain::default();
            s.computed = 0;
            s.unseen = 0;
            self.waiting.push_front(s);
        }
    }

    /// Picks the next batch: `(index in running, tokens)` per scheduled sequence. Running
    /// sequences come first, in admission order, preempted from the back when blocks run out;
    /// then waiting requests while budget and sequences allow, chunked to the budget.
    ///
    /// `ahead`: step n is still in flight. Its sampled tokens are not on the host, so a sequence
    /// with one takes it from the device ([`Backend::feed_sampled`]); one whose unseen token
    /// ends it for certain (its length limit) is left out. Nothing can be preempted while its
    /// blocks may be in use, and the repetition penalty needs the token on the host: either
    /// makes this return `None`, and the step is scheduled once step n is collected. So do the
    /// presence and frequency penalties, and a structured output's grammar, whose mask for the
    /// next token depends on the unseen one.
    fn schedule(&mut self, ahead: bool) -> Result<Option<Vec<(usize, usize)>>> {
        let max_len = self.max_sequence_len();
        let mut budget = self.config.max_batched_tokens;
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            if s.unseen > 0 {
                if s.generated + s.unseen >= s.req.max_tokens
                    || s.tokens.len() + s.unseen >= max_len
                {
                    i += 1;
                    continue;
                }
                // Penalties read the tokens, and a grammar's mask depends on the last one.
                if s.req.params.uses_history() || s.req.constraint.is_some() {
                    return Ok(None);
                }
            }
            let chunk = s.pending().min(budget);
            if chunk == 0 {
                i += 1;
                continue;
            }
            let new_len = s.computed + chunk;
            let grown = {
                let s = &mut self.running[i];
                self.blocks.grow(&mut s.blocks, new_len)
            };
            if grown.is_err() {
                if ahead {
                    return Ok(None);
                }
                let last = self.running.len() - 1;
                self.preempt_last();
                if last == i {
                    break;
                }
                continue;
            }
            rows.push((i, chunk));
            budget -= chunk;
            i += 1;
        }
        // Then admit waiting requests while there is room.
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else {
                break;
            };
            // A sequence that shares its prompt with one still computing it waits for it (and
            // keeps the queue's order): admitted now, it would compute the same blocks again.
            if let Some(leader) = front.follows
                && self
                    .running
                    .iter()
                    .any(|s| s.serial == leader && s.computed < s.req.prompt.len())
            {
                break;
            }
            let Ok((table, cached)) = self.blocks.allocate(&front.tokens) else {
                break;
            };
            let mut s = self.waiting.pop_front().expect("front exists");
            s.blocks = table;
            s.computed = cached;
            let chunk = s.pending().min(budget);
            budget -= chunk;
            if s.generated == 0 {
                self.prompt_tokens += s.tokens.len() as u64;
            }
            self.running.push(s);
            rows.push((self.running.len() - 1, chunk));
        }
        Ok(Some(rows))
    }

    /// Queues the forward pass and the sampling of `rows` (from [`Self::schedule`]) and marks
    /// their tokens computed; the sampled tokens are read by [`Self::finish`].
    /// `t_start` is when its scheduling began (for the profile).
    fn launch(
        &mut self,
        rows: Vec<(usize, usize)>,
        t_start: std::time::Instant,
    ) -> Result<InFlight> {
        let mut tokens = Vec::with_capacity(self.config.max_batched_tokens);
        let mut batch = BatchLayout::default();
        let mut feed = Vec::new();
        for &(idx, chunk) in &rows {
            let s = &self.running[idx];
            if s.unseen > 0 {
                // Its next token is the one step n sampled, still on the device.
                debug_assert_eq!((s.unseen, chunk), (1, 1));
                let spec = s.latest_spec.expect("an unseen token has a spec");
                feed.push((tokens.len(), spec));
                tokens.push(0);
            } else {
                tokens.extend_from_slice(&s.tokens[s.computed..s.computed + chunk]);
            }
            batch.seqs.push(SeqSpan {
                blocks: s.blocks.clone(),
                start_pos: s.computed,
                len: chunk,
            });
        }
        let decode_only = rows.iter().all(|&(_, c)| c == 1);
        if decode_only {
            // Padding sequences (token 0 at position 0 of the block kept aside) fill the step to
            // the size the backend asks for; their logits are never sampled.
            let pad = self.backend.decode_bucket(rows.len()).max(rows.len()) - rows.len();
            for _ in 0..pad {
                tokens.push(0);
                batch.seqs.push(SeqSpan {
                    blocks: vec![self.config.num_blocks as u32],
                    start_pos: 0,
                    len: 1,
                });
            }
        }
        self.backend.feed_sampled(&feed)?;
        let t_forward = std::time::Instant::now();
        let logits = self.model.forward(
            &self.backend,
            &tokens,
            &batch,
            &mut self.kv,
            LogitRows::LastPerSeq,
        )?;
        // Profiling a step that does not run ahead: how long the forward pass keeps the host
        // waiting once it is queued (a step that runs ahead must not wait here).
        let forward_call = t_forward.elapsed();
        let forward_wait = if self.profile.is_some() && !self.run_ahead {
            let waited = std::time::Instant::now();
            self.backend.synchronize()?;
            waited.elapsed()
        } else {
            std::time::Duration::ZERO
        };
        // Sequences whose prompt is now complete sample from their row; the logits of one still
        // mid-prefill are not for sampling.
        let mut sampling = Vec::new();
        for (row, &(idx, chunk)) in rows.iter().enumerate() {
            let s = &mut self.running[idx];
            s.computed += chunk;
            let known = s.computed.min(s.tokens.len());
            self.blocks
                .register_full_blocks(&mut s.hashed, &s.blocks, &s.tokens[..known]);
            if s.computed == s.tokens.len() + s.unseen {
                sampling.push((row, idx));
            }
        }
        // The grammar's masks, computed while the forward pass runs on a device (a constrained
        // sequence has no unseen token: its step waited for it).
        let mut masks: Vec<Option<Vec<u32>>> = Vec::with_capacity(sampling.len());
        for &(_, idx) in &sampling {
            let s = &mut self.running[idx];
            masks.push(match s.req.constraint.as_mut() {
                Some(c) => {
                    let mut m = Vec::new();
                    // A grammar in error (past one of llguidance's limits) allows nothing: its
                    // mask stays empty, the sampler's token is refused by `commit` in `finish`,
                    // and the sequence ends there. Failing the step would fail every sequence
                    // in it, again and again.
                    if c.mask(&mut m).is_err() {
                        m.clear();
                        m.resize(self.model.config.vocab_size.div_ceil(32), 0);
                    }
                    Some(m)
                }
                None => None,
            });
        }
        let specs: Vec<_> = sampling
            .iter()
            .zip(&masks)
            .map(|(&(row, idx), mask)| {
                let s = &self.running[idx];
                let mut spec = s.sampler.spec(
                    row,
                    &s.tokens,
                    s.req.prompt.len(),
                    mask.as_deref(),
                    s.req.logprobs,
                );
                spec.draw += s.unseen as u64;
                spec
            })
            .collect();
        let vocab = self.model.config.vocab_size;
        let t_sample = std::time::Instant::now();
        let pending = self.backend.launch_sample(&logits, vocab, &specs)?;
        let sample_call = t_sample.elapsed();
        drop(specs);
        let mut serials = Vec::with_capacity(sampling.len());
        for (spec, &(_, idx)) in sampling.iter().enumerate() {
            let s = &mut self.running[idx];
            s.unseen += 1;
            s.latest_spec = Some(spec);
            serials.push(s.serial);
        }
        Ok(InFlight {
            pending,
            serials,
            seqs: batch.seqs.len(),
            tokens: tokens.len(),
            decode_only,
            launch_s: t_start.elapsed().saturating_sub(forward_wait).as_secs_f64(),
            forward_call_s: forward_call.as_secs_f64(),
            sample_call_s: sample_call.as_secs_f64(),
            forward_wait_s: forward_wait.as_secs_f64(),
        })
    }

    /// Reads a launched step's tokens and turns them into events; sequences that end are
    /// released.
    fn finish(&mut self, step: InFlight) -> Result<Vec<Event>> {
        let t_wait = std::time::Instant::now();
        let sampled = self.backend.collect_sample(step.pending)?;
        let wait = t_wait.elapsed();
        let mut events = Vec::new();
        let max_len = self.max_sequence_len();
        // Where each sequence is now: a step run ahead may have admitted sequences since, and
        // abort or an earlier finish may have removed some (whose tokens are then dropped).
        let at: std::collections::HashMap<u64, usize> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, s)| (s.serial, i))
            .collect();
        let mut finished = Vec::new();
        for (&serial, sampled) in step.serials.iter().zip(sampled) {
            let Some(&idx) = at.get(&serial) else {
                continue;
            };
            let s = &mut self.running[idx];
            s.unseen -= 1;
            s.sampler.advance();
            let next = sampled.token;
            let logprob = sampled.logprobs.map(|l| TokenLogprob {
                token: next,
                logprob: l.logprob,
                top: l.top,
            });
            let is_eos = self.tokenizer.is_eos(next);
            let eos = match s.req.constraint.as_mut() {
                Some(c) => is_eos && c.accepting(),
                None => !s.req.ignore_eos && is_eos,
            };
            let mut reason = None;
            if eos {
                reason = Some(FinishReason::Eos);
            } else if let Some(Err(_)) = s.req.constraint.as_mut().map(|c| c.commit(next)) {
                // Only a grammar that allowed nothing (its mask was empty, so the sampler's
                // fallback token came out) gets here: the token is not output.
                reason = Some(FinishReason::Stop);
            } else if s.req.stop_token_ids.contains(&next) {
                // Like EOS: the token ends the sequence and is not part of its output.
                reason = Some(FinishReason::Stop);
            } else {
                s.tokens.push(next);
                s.generated += 1;
                self.generated_tokens += 1;
                let piece = s.decoder.push(&self.tokenizer, next)?;
                let (text, hit) = s.stops.push(&piece);
                events.push(Event::Token {
                    id: s.id,
                    token: next,
                    text,
                    logprob,
                });
                if hit {
                    reason = Some(FinishReason::Stop);
                } else if s.req.constraint.as_ref().is_some_and(|c| c.finished()) {
                    reason = Some(FinishReason::Eos);
                } else if s.generated >= s.req.max_tokens {
                    reason = Some(FinishReason::Length);
                } else if s.tokens.len() >= max_len {
                    reason = Some(FinishReason::ContextFull);
                }
            }
            if let Some(reason) = reason {
                finished.push(idx);
                events.push(Event::Finished {
                    id: s.id,
                    reason,
                    tail: s.stops.finish(),
                    prompt_tokens: s.req.prompt.len(),
                    completion_tokens: s.generated,
                });
            }
        }
        finished.sort_unstable();
        for idx in finished.into_iter().rev() {
            // Blocks a step run ahead still writes are safe to hand out: whoever gets them is in
            // a later step, queued behind it.
            let s = self.running.remove(idx);
            self.release(&s.blocks);
        }
        if let Some(profile) = self.profile.as_mut() {
            // A step's own host time: scheduling and queueing it, and handling its tokens (not
            // the queueing of the step run ahead meanwhile, which is that step's). Sampling is
            // device work behind one small copy: the wait for it is device time.
            let handling = t_wait.elapsed().saturating_sub(wait).as_secs_f64();
            profile.push(StepProfile {
                seqs: step.seqs,
                tokens: step.tokens,
                decode_only: step.decode_only,
                host_s: step.launch_s + handling,
                device_s: step.forward_wait_s + wait.as_secs_f64(),
                launch_s: step.launch_s,
                forward_call_s: step.forward_call_s,
                sample_call_s: step.sample_call_s,
            });
        }
        Ok(events)
    }
}

//! The single-request generation loop: prefill the prompt, then sample, stream and decode one
//! token at a time until EOS, a stop string, `max_tokens` or the end of the context window.

use std::time::Instant;

use nibble_core::{Error, Result};
use nibble_formats::tokenizer::{StreamDecoder, Tokenizer};
use nibble_model::{Backend, BatchLayout, LogitRows, Transformer};

use crate::structured::Constraint;
use crate::{Sampler, SamplingParams, StopMatcher};

/// A loaded model ready to generate.
pub struct Engine<B: Backend> {
    pub backend: B,
    pub model: Transformer<B>,
    pub tokenizer: Tokenizer,
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep going past EOS (benchmarks want a fixed token count).
    pub ignore_eos: bool,
    /// Structured output: only tokens this grammar allows are sampled, and the output ends
    /// once it is complete (EOS where the grammar accepts ends it even with `ignore_eos`).
    pub constraint: Option<Constraint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    Stop,
    Length,
    /// The context window filled before `max_tokens`.
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

impl<B: Backend> Engine<B> {
    /// Generates, calling `on_text` with each piece of text as soon as it is final.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        let ctx = self.model.config.max_context;
        let n = req.prompt_ids.len();
        if n == 0 {
            return Err(Error::InvalidArgument("the prompt is empty".into()));
        }
        if n >= ctx {
            return Err(Error::LimitExceeded {
                what: "prompt length in tokens".into(),
                value: n,
                limit: ctx - 1,
            });
        }
        let mut sampler = Sampler::new(req.params.clone())?;
        let b = &self.backend;
        let (mut kv, table) = self.model.single_sequence_kv(b, n + req.max_tokens)?;

        // Prefill ends with its first token sampled (the time to first token): on a GPU the
        // forward pass only queues work, and sampling is what waits for it.
        let t0 = Instant::now();
        let vocab = self.model.config.vocab_size;
        let logits = self.model.forward(
            b,
            &req.prompt_ids,
            &BatchLayout::single(table.clone(), 0, n),
            &mut kv,
            LogitRows::LastPerSeq,
        )?;
        let mut history = req.prompt_ids.clone();
        let mut constraint = req.constraint.clone();
        let mut mask = Vec::new();
        if let Some(c) = constraint.as_mut() {
            c.mask(&mut mask)?;
        }
        let masked = constraint.is_some();
        let mut next = sampler
            .sample_on(b, &logits, vocab, &history, n, masked.then_some(&mask[..]))?
            .token;
        let prefill_secs = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let mut out_ids = Vec::new();
        let mut text = String::new();
        let mut decoder = StreamDecoder::new();
        let mut stops = StopMatcher::new(req.stop.clone());
        let mut emit = |piece: &str, text: &mut String| {
            if !piece.is_empty() {
                text.push_str(piece);
                on_text(piece);
            }
        };
        let finish = loop {
            if out_ids.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            let eos = self.tokenizer.is_eos(next);
            if let Some(c) = constraint.as_mut() {
                if eos && c.accepting() {
                    break FinishReason::Eos;
                }
                // The mask allowed it, unless the mask allowed nothing at all.
                c.commit(next)?;
            } else if !req.ignore_eos && eos {
                break FinishReason::Eos;
            }
            out_ids.push(next);
            history.push(next);
            let piece = decoder.push(&self.tokenizer, next)?;
            let (safe, hit) = stops.push(&piece);
            emit(&safe, &mut text);
            if hit {
                break FinishReason::Stop;
            }
            if constraint.as_ref().is_some_and(|c| c.finished()) {
                break FinishReason::Eos;
            }
            if out_ids.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            let pos = history.len() - 1;
            if pos + 1 >= ctx {
                break FinishReason::ContextFull;
            }
            let logits = self.model.forward(
                b,
                &[next],
                &BatchLayout::single(table.clone(), pos, 1),
                &mut kv,
                LogitRows::LastPerSeq,
            )?;
            if let Some(c) = constraint.as_mut() {
                c.mask(&mut mask)?;
            }
            next = sampler
                .sample_on(b, &logits, vocab, &history, n, masked.then_some(&mask[..]))?
                .token;
        };
        emit(&stops.finish(), &mut text);
        Ok(GenerateOutput {
            token_ids: out_ids,
            text,
            finish,
            prompt_tokens: n,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
        })
    }
}

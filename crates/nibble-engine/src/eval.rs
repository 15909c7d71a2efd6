//! Perplexity: the exponential of the mean negative log-likelihood of each token given the ones
//! before it, over non-overlapping windows of `window` tokens (llama.cpp's convention; the first
//! token of each window is context only).

use nibble_core::{Error, Result};
use nibble_model::{Backend, BatchLayout, LogitRows};

use crate::generate::Engine;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    pub mean_nll: f64,
    pub predicted_tokens: usize,
}

pub fn perplexity<B: Backend>(
    engine: &Engine<B>,
    ids: &[u32],
    window: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Perplexity> {
    let window = window.min(engine.model.config.max_context);
    if ids.len() < 2 || window < 2 {
        return Err(Error::InvalidArgument(format!(
            "perplexity needs at least 2 tokens and a window of 2 (got {} tokens, window {window})",
            ids.len()
        )));
    }
    let chunks: Vec<&[u32]> = ids.chunks(window).filter(|c| c.len() >= 2).collect();
    over_windows(engine, &chunks, progress)
}

/// Perplexity over separate sequences (each its own window, e.g. held-out conversations): every
/// token but each sequence's first is predicted, and the mean is over all of them.
pub fn perplexity_sequences<B: Backend>(
    engine: &Engine<B>,
    sequences: &[Vec<u32>],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Perplexity> {
    let max = engine.model.config.max_context;
    if let Some(s) = sequences.iter().find(|s| s.len() < 2 || s.len() > max) {
        return Err(Error::InvalidArgument(format!(
            "perplexity sequences need 2 to {max} tokens, got one of {}",
            s.len()
        )));
    }
    if sequences.is_empty() {
        return Err(Error::InvalidArgument("no sequences to evaluate".into()));
    }
    let windows: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
    over_windows(engine, &windows, progress)
}

fn over_windows<B: Backend>(
    engine: &Engine<B>,
    chunks: &[&[u32]],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Perplexity> {
    let b = &engine.backend;
    let vocab = engine.model.config.vocab_size;
    let mut nll = 0f64;
    let mut count = 0usize;
    for (ci, chunk) in chunks.iter().enumerate() {
        let (mut kv, table) = engine.model.single_sequence_kv(b, chunk.len())?;
        let logits = engine.model.forward(
            b,
            chunk,
            &BatchLayout::single(table, 0, chunk.len()),
            &mut kv,
            LogitRows::All,
        )?;
        let logits = b.to_host(&logits)?;
        for t in 0..chunk.len() - 1 {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[chunk[t + 1] as usize] as f64;
            count += 1;
        }
        progress(ci + 1, chunks.len());
    }
    let mean_nll = nll / count as f64;
    if !mean_nll.is_finite() {
        return Err(Error::InvalidArgument(
            "the model produced non-finite logits; the weights may be corrupt".into(),
        ));
    }
    Ok(Perplexity {
        ppl: mean_nll.exp(),
        mean_nll,
        predicted_tokens: count,
    })
}

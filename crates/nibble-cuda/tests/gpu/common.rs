//! What both GPU test binaries (`gpu.rs`, `gpu_tp.rs`) use: the fixtures, greedy generation
//! and a row's top two logits.

use std::path::PathBuf;

use nibble_engine::{Engine, GenerateRequest, SamplingParams};
use nibble_model::Backend;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name)
}

/// `n` greedy tokens after `prompt`.
pub fn greedy<B: Backend>(e: &Engine<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        params: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: n,
        stop: vec![],
        ignore_eos: true,
        constraint: None,
    };
    e.generate(&req, &mut |_| {}).unwrap().token_ids
}

/// The largest logit's index and its lead over the second.
pub fn top2(l: &[f32]) -> (usize, f32) {
    let (mut best, mut second) = (0, f32::NEG_INFINITY);
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            second = l[best];
            best = i;
        } else if i != best && v > second {
            second = v;
        }
    }
    (best, l[best] - second)
}

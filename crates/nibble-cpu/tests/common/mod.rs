//! Shared by the CPU backend's integration tests: the tiny HF fixtures and loading a model.
// Each test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use nibble_cpu::{CpuBackend, CpuKvCache};
use nibble_model::{Backend, BatchLayout, LogitRows, ModelFiles, Transformer, open_model};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name)
}

pub struct Loaded {
    pub files: ModelFiles,
    pub backend: CpuBackend,
    pub model: Transformer<CpuBackend>,
}

/// Opens a GGUF file or HF directory and loads it on a CPU backend with `threads` threads.
pub fn load(path: &Path, threads: usize) -> Loaded {
    let files = open_model(path, None).unwrap();
    let backend = CpuBackend::new(threads).unwrap();
    let model = Transformer::load(
        &backend,
        files.config.clone(),
        &*files.source,
        &mut |_, _| {},
    )
    .unwrap();
    Loaded {
        files,
        backend,
        model,
    }
}

/// A fixture's `expected.json`: input ids, per-position reference logits (flattened), and the
/// greedy continuation.
pub struct Expected {
    pub input_ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

pub fn expected(name: &str) -> Expected {
    expected_at(&fixture(name).join("expected.json"))
}

/// An `expected.json`-shaped file anywhere.
pub fn expected_at(path: &Path) -> Expected {
    let text = std::fs::read_to_string(path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        input_ids: ids("input_ids"),
        greedy: ids("greedy"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
            })
            .collect(),
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// Greedy decoding through the KV cache, one token at a time: `first` is fed at position
/// `start` of the sequence in `slot`, then each argmax; returns the `n` tokens fed.
pub fn greedy_continue(
    backend: &CpuBackend,
    model: &Transformer<CpuBackend>,
    kv: &mut CpuKvCache,
    slot: &[u32],
    first: u32,
    start: usize,
    n: usize,
) -> Vec<u32> {
    let mut next = first;
    let mut fed = Vec::with_capacity(n);
    for step in 0..n {
        fed.push(next);
        let l = model
            .forward(
                backend,
                &[next],
                &BatchLayout::single(slot.to_vec(), start + step, 1),
                kv,
                LogitRows::LastPerSeq,
            )
            .unwrap();
        next = argmax(&backend.to_host(&l).unwrap());
    }
    fed
}

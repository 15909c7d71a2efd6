//! Shared by the CPU backend's integration tests: the tiny HF fixtures and loading a model.
// Each test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use nibble_cpu::CpuBackend;
use nibble_model::{ModelFiles, Transformer, open_model};

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
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
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

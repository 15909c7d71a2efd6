//! Synthetic models (`nibble_model::dummy`) load through `Transformer::load` on the CPU backend
//! and run: finite, non-degenerate logits, and a greedy continuation through the KV cache.

mod common;

use common::argmax;
use nibble_cpu::CpuBackend;
use nibble_model::dummy::{open_dummy, shipped_config};
use nibble_model::{Backend, BatchLayout, LogitRows, ModelFiles, Transformer};

fn check_logits(what: &str, logits: &[f32], vocab: usize) {
    assert_eq!(logits.len(), vocab, "{what}");
    assert!(
        logits.iter().all(|x| x.is_finite()),
        "{what}: non-finite logit"
    );
    let mean = logits.iter().sum::<f32>() / vocab as f32;
    let std = (logits.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / vocab as f32).sqrt();
    // Realistic scales give logits of order one: neither flat nor blown up.
    assert!((0.05..20.0).contains(&std), "{what}: logit std {std}");
}

/// Prefill of a prompt, then `steps` greedy tokens one at a time; returns the generated ids.
fn generate(files: &ModelFiles, prompt: &str, steps: usize) -> Vec<u32> {
    let backend = CpuBackend::new(2).unwrap();
    let mut calls = 0;
    let model = Transformer::load(
        &backend,
        files.config.clone(),
        &*files.source,
        &mut |_, _| calls += 1,
    )
    .unwrap();
    let has = |n: &str| usize::from(files.source.contains(n));
    let per_layer = 9 + 2 * has("model.layers.0.self_attn.q_norm.weight");
    assert_eq!(
        calls,
        2 + has("lm_head.weight") + per_layer * files.config.num_layers
    );
    let vocab = files.config.vocab_size;
    let ids = files.tokenizer.encode(prompt, true).unwrap();
    assert!(!ids.is_empty() && ids.iter().all(|&i| (i as usize) < vocab));
    let (mut kv, blocks) = model.single_sequence_kv(&backend, 64).unwrap();
    let n = ids.len();
    let logits = model
        .forward(
            &backend,
            &ids,
            &BatchLayout::single(blocks.clone(), 0, n),
            &mut kv,
            LogitRows::LastPerSeq,
        )
        .unwrap();
    let host = backend.to_host(&logits).unwrap();
    check_logits("prefill", &host, vocab);
    let mut next = argmax(&host);
    let mut out = vec![];
    for step in 0..steps {
        out.push(next);
        let l = model
            .forward(
                &backend,
                &[next],
                &BatchLayout::single(blocks.clone(), n + step, 1),
                &mut kv,
                LogitRows::LastPerSeq,
            )
            .unwrap();
        let host = backend.to_host(&l).unwrap();
        check_logits(&format!("step {step}"), &host, vocab);
        next = argmax(&host);
    }
    out
}

#[test]
fn tiny_dummy_generates() {
    let files = open_dummy("tiny-dummy", 1).unwrap();
    let got = generate(&files, "The quick brown fox", 8);
    let text = files.tokenizer.decode(&got, true).unwrap();
    println!("tiny-dummy, seed 1: {got:?} = {text:?}");
    assert!(!text.is_empty());
    // Same seed, same model, same tokens.
    let again = generate(
        &open_dummy("tiny-dummy", 1).unwrap(),
        "The quick brown fox",
        8,
    );
    assert_eq!(got, again);
}

#[test]
fn qwen3_shaped_dummy_generates() {
    // The tiny shape as Qwen3 (per-head Q/K norms), from a config path.
    let dir = tempfile::tempdir().unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(shipped_config("tiny-dummy").unwrap()).unwrap();
    v["model_type"] = "qwen3".into();
    v["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    let path = dir.path().join("config.json");
    std::fs::write(&path, v.to_string()).unwrap();
    let files = open_dummy(path.to_str().unwrap(), 5).unwrap();
    assert!(
        files
            .source
            .contains("model.layers.0.self_attn.q_norm.weight")
    );
    let got = generate(&files, "naïve café 🦀", 4);
    assert_eq!(got.len(), 4);
}

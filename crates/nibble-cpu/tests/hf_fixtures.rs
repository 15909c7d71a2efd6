//! Every architecture against logits from an independent float64 numpy forward (and Hugging Face
//! transformers; see crates/nibble-model/tests/fixtures/README.md).

use std::path::PathBuf;

use nibble_cpu::CpuBackend;
use nibble_model::{Backend, BatchLayout, KvCache, LogitRows, Transformer, open_model};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures")
        .join(name)
}

struct Expected {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn expected(name: &str) -> Expected {
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
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

fn check(name: &str) {
    let files = open_model(&fixture(name), None).unwrap();
    let backend = CpuBackend::new(2).unwrap();
    let model = Transformer::load(
        &backend,
        files.config.clone(),
        &*files.source,
        &mut |_, _| {},
    )
    .unwrap();
    let exp = expected(name);
    let mut kv = backend.new_kv_cache(model.kv_shape(), 1).unwrap();
    let slot = kv.alloc_seq().unwrap();
    let n = exp.input_ids.len();
    let logits = model
        .forward(
            &backend,
            &exp.input_ids,
            &BatchLayout::single(slot, 0, n),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let host = backend.to_host(&logits).unwrap();
    let vocab = files.config.vocab_size;
    let mut worst = 0f32;
    for (t, want) in exp.logits.iter().enumerate() {
        for (a, b) in host[t * vocab..(t + 1) * vocab].iter().zip(want) {
            assert!(a.is_finite(), "{name}: non-finite logit");
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst < 2e-4, "{name}: max |logit error| {worst}");

    // Greedy continuation through the KV cache, one token at a time.
    let mut next = argmax(&host[(n - 1) * vocab..n * vocab]);
    let mut got = vec![];
    for step in 0..exp.greedy.len() {
        got.push(next);
        let l = model
            .forward(
                &backend,
                &[next],
                &BatchLayout::single(slot, n + step, 1),
                &mut kv,
                LogitRows::LastPerSeq,
            )
            .unwrap();
        next = argmax(&backend.to_host(&l).unwrap());
    }
    assert_eq!(got, exp.greedy, "{name}: greedy continuation");
}

#[test]
fn llama3_rope_scaling() {
    check("tiny-llama3");
}

#[test]
fn mistral() {
    check("tiny-mistral");
}

#[test]
fn qwen2_qkv_bias_untied_head() {
    check("tiny-qwen2");
}

#[test]
fn qwen3_qk_norm_explicit_head_dim() {
    check("tiny-qwen3");
}

#[test]
fn llama_tied_bf16_sharded() {
    check("tiny-llama-tied-bf16");
}

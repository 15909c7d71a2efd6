//! Gemma 3 on the CPU against an independent float64 numpy forward
//! (scripts/gemma3_numpy_reference.py, fixtures made by scripts/make_tiny_gemma3_fixture.py): a
//! tiny random model as a llama.cpp-style GGUF file (norms stored as 1 + w, Q8_0 and F32) and as
//! a Hugging Face directory (norms as w, query_pre_attn_scalar other than head_dim), each with
//! seven layers of which the sixth is global and the others attend within 6 tokens.

mod common;

use std::path::Path;

use common::{Loaded, argmax, expected_at, fixture, greedy_continue, load};
use nibble_model::{Arch, Backend, BatchLayout, LogitRows};

/// Logits of the whole prompt and the greedy continuation against `expected`; returns the
/// largest logit error.
fn check(path: &Path, expected: &Path) -> f32 {
    let Loaded {
        files,
        backend,
        model,
    } = load(path, 2);
    assert_eq!(files.config.arch, Arch::Gemma3);
    let exp = expected_at(expected);
    let n = exp.input_ids.len();
    let (mut kv, slot) = model.single_sequence_kv(&backend, 64).unwrap();
    let l = model
        .forward(
            &backend,
            &exp.input_ids,
            &BatchLayout::single(slot.clone(), 0, n),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let host = backend.to_host(&l).unwrap();
    assert_eq!(host.len(), exp.logits.len());
    let worst = host
        .iter()
        .zip(&exp.logits)
        .map(|(a, b)| {
            assert!(a.is_finite());
            (a - b).abs()
        })
        .fold(0f32, f32::max);
    let vocab = files.config.vocab_size;
    let first = argmax(&host[(n - 1) * vocab..]);
    let got = greedy_continue(&backend, &model, &mut kv, &slot, first, n, exp.greedy.len());
    assert_eq!(got, exp.greedy, "{}: greedy continuation", path.display());
    eprintln!("{}: max |logit error| {worst:e}", path.display());
    worst
}

#[test]
fn gguf_file_matches_the_float64_reference() {
    let path = fixture("tiny-gemma3.gguf");
    let c = nibble_model::open_model(&path, None).unwrap().config;
    let w = c.sliding_window.as_ref().unwrap();
    assert_eq!(w.size, 6);
    assert_eq!(w.layers, [true, true, true, true, true, false, true]);
    assert_eq!(c.head_dim, 32);
    let g = c.gemma.as_ref().unwrap();
    assert_eq!(
        (g.query_pre_attn_scalar, g.rope_local_theta),
        (32.0, 10_000.0)
    );
    let worst = check(&path, &fixture("tiny-gemma3.gguf-expected.json"));
    assert!(worst < 2e-4, "max |logit error| {worst}");
}

#[test]
fn hf_directory_matches_the_float64_reference() {
    let dir = fixture("tiny-gemma3");
    let worst = check(&dir, &dir.join("expected.json"));
    assert!(worst < 2e-4, "max |logit error| {worst}");
}

/// The window is what makes the reference's logits: the same model with its window widened
/// past the prompt (full attention everywhere) must miss them.
#[test]
fn the_window_matters() {
    let path = fixture("tiny-gemma3.gguf");
    let files = nibble_model::open_model(&path, None).unwrap();
    let backend = nibble_cpu::CpuBackend::new(2).unwrap();
    let mut config = files.config.clone();
    config.sliding_window.as_mut().unwrap().size = 1000;
    let model =
        nibble_model::Transformer::load(&backend, config, &*files.source, &mut |_, _| {}).unwrap();
    let exp = expected_at(&fixture("tiny-gemma3.gguf-expected.json"));
    let n = exp.input_ids.len();
    let (mut kv, slot) = model.single_sequence_kv(&backend, 64).unwrap();
    let l = model
        .forward(
            &backend,
            &exp.input_ids,
            &BatchLayout::single(slot, 0, n),
            &mut kv,
            LogitRows::All,
        )
        .unwrap();
    let host = backend.to_host(&l).unwrap();
    let vocab = files.config.vocab_size;
    let diff = |r: usize| {
        host[r * vocab..(r + 1) * vocab]
            .iter()
            .zip(&exp.logits[r * vocab..(r + 1) * vocab])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    // Within the first window the two agree; past it they must not.
    assert!(diff(5) < 2e-4, "position 5: {}", diff(5));
    assert!(diff(n - 1) > 1e-2, "position {}: {}", n - 1, diff(n - 1));
}

/// Gemma's chat template comes with a GGUF file that has none (the system prompt joins the first
/// user turn, the assistant is `model`, contents are trimmed).
#[test]
fn gemma_chat_template_for_a_file_without_one() {
    use nibble_formats::chat_template::{ChatMessage, ChatTemplate};
    let files = nibble_model::open_model(&fixture("tiny-gemma3.gguf"), None).unwrap();
    let t = &files.tokenizer;
    let tmpl = ChatTemplate::new(t.chat_template.as_deref().unwrap(), Some("<s>"), None).unwrap();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", " Hi "),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "Bye"),
    ];
    let text = tmpl.render(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.\
         <end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
}

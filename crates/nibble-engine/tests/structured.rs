//! Structured outputs in the engine: the grammar engine sees each tokenizer's tokens as the bytes
//! they decode to (byte-level BPE from `tokenizer.json`, SentencePiece from a GGUF file), masks
//! allow exactly the tokens that can continue the grammar, and the single-request loop holds its
//! output to it.

use std::path::PathBuf;

use nibble_cpu::CpuBackend;
use nibble_engine::structured::{GrammarSpec, Grammars};
use nibble_engine::{Engine, FinishReason, GenerateRequest, SamplingParams};
use nibble_formats::gguf::GgufFile;
use nibble_formats::tokenizer::Tokenizer;
use nibble_model::{Transformer, open_model};

fn tiny_qwen2() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2")
}

const TEXTS: &[&str] = &[
    "Hello, world!",
    "  two spaces, tabs\tand\nnewlines",
    "{\"key\": [1, 2.5, null]}",
    "Ünïcödé — 日本語 🎉",
];

/// The grammar engine's bytes of each token of an encoding, concatenated, are the text.
fn assert_bytes_spell(tok: &Tokenizer, vocab: usize, strip_space_prefix: bool) {
    let g = Grammars::new(tok, vocab).unwrap();
    for text in TEXTS {
        let ids = tok.encode(text, false).unwrap();
        let mut bytes: Vec<u8> = ids.iter().flat_map(|&id| g.token_bytes(id)).collect();
        if strip_space_prefix && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
        assert_eq!(String::from_utf8_lossy(&bytes), *text, "ids {ids:?}");
    }
}

#[test]
fn token_bytes_spell_the_text_for_byte_level_bpe() {
    let files = open_model(&tiny_qwen2(), None).unwrap();
    assert_bytes_spell(&files.tokenizer, files.config.vocab_size, false);
}

#[test]
fn token_bytes_spell_the_text_for_gguf_sentencepiece() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-formats/tests/fixtures/spm/spm.gguf");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let vocab = tok.vocab_size();
    // SentencePiece puts a space before the first word.
    assert_bytes_spell(&tok, vocab, true);
}

#[test]
fn a_mask_allows_exactly_the_tokens_that_continue_the_grammar() {
    let files = open_model(&tiny_qwen2(), None).unwrap();
    let vocab = files.config.vocab_size;
    let g = Grammars::new(&files.tokenizer, vocab).unwrap();
    let mut c = g
        .compile(&GrammarSpec::Regex("[0-9]{1,3}x".into()))
        .unwrap();
    let allowed = |c: &mut nibble_engine::structured::Constraint| {
        let mut m = Vec::new();
        c.mask(&mut m).unwrap();
        assert_eq!(m.len(), vocab.div_ceil(32));
        (0..vocab as u32)
            .filter(|&t| (m[t as usize / 32] >> (t % 32)) & 1 == 1)
            .collect::<Vec<u32>>()
    };
    let first = allowed(&mut c);
    assert!(!first.is_empty());
    for &t in &first {
        let b = g.token_bytes(t);
        assert!(
            !b.is_empty() && b.iter().all(u8::is_ascii_digit) && b.len() <= 3,
            "token {t} {b:?}"
        );
    }
    // Every one-digit token is there, and no end of sequence yet.
    let digits: Vec<u32> = (b'0'..=b'9').map(u32::from).collect();
    assert!(digits.iter().all(|d| first.contains(d)), "{first:?}");
    assert!(!c.accepting());
    for t in [u32::from(b'4'), u32::from(b'2'), u32::from(b'0')] {
        c.commit(t).unwrap();
    }
    // Three digits: only "x" may follow (alone, or starting a longer token, of which this
    // vocabulary has none).
    assert_eq!(allowed(&mut c), [u32::from(b'x')]);
    // A refused token is an error (which leaves that matcher in error: tried on a copy).
    assert!(c.clone().commit(u32::from(b'7')).is_err());
    c.commit(u32::from(b'x')).unwrap();
    assert!(c.accepting());
    // Complete: only the end-of-sequence tokens remain.
    assert_eq!(allowed(&mut c), files.tokenizer.eos_ids);
}

#[test]
fn generate_holds_its_output_to_a_json_schema() {
    let files = open_model(&tiny_qwen2(), None).unwrap();
    let backend = CpuBackend::new(1).unwrap();
    let model = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    let g = Grammars::new(&files.tokenizer, model.config.vocab_size).unwrap();
    let engine = Engine {
        backend,
        model,
        tokenizer: files.tokenizer,
    };
    let schema = serde_json::json!({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "word": {"type": "string", "pattern": "^[a-z]{3}$"}},
        "required": ["n", "word"], "additionalProperties": false});
    for seed in 0..4 {
        let req = GenerateRequest {
            prompt_ids: engine.tokenizer.encode("Hi", false).unwrap(),
            params: SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            max_tokens: 100,
            stop: vec![],
            ignore_eos: true,
            constraint: Some(g.compile(&GrammarSpec::JsonSchema(schema.clone())).unwrap()),
        };
        let out = engine.generate(&req, &mut |_| {}).unwrap();
        assert_eq!(out.finish, FinishReason::Eos, "{:?}", out.text);
        let v: serde_json::Value = serde_json::from_str(&out.text).unwrap();
        let n = v["n"].as_i64().unwrap();
        let w = v["word"].as_str().unwrap();
        assert!((1..=9).contains(&n), "{v}");
        assert!(
            w.len() == 3 && w.bytes().all(|b| b.is_ascii_lowercase()),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }
}

//! A tokenizer rebuilt from GGUF metadata, written out as Hugging Face files (what a checkpoint
//! made from a GGUF model ships) and read back, encodes, decodes and stops the same.

use nibble_formats::gguf::{GgufFile, GgufWriter, MetaValue};
use nibble_formats::tokenizer::Tokenizer;
use serde_json::Value;

const TEMPLATE: &str =
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}";

/// The tiny fixture tokenizer as `tokenizer.ggml.*` metadata, with BOS added on encode.
fn gguf_tokenizer(dir: &std::path::Path) -> Tokenizer {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../nibble-model/tests/fixtures/tiny-llama3/tokenizer.json");
    let tok: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let mut tokens = vec![String::new(); 270];
    for (t, id) in tok["model"]["vocab"].as_object().unwrap() {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    for a in tok["added_tokens"].as_array().unwrap() {
        tokens[a["id"].as_u64().unwrap() as usize] = a["content"].as_str().unwrap().into();
    }
    assert!(tokens.iter().all(|t| !t.is_empty()));
    let merges: Vec<MetaValue> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => MetaValue::String(s.clone()),
            Value::Array(p) => MetaValue::String(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            _ => unreachable!("merges are strings or pairs"),
        })
        .collect();
    let types = (0..270)
        .map(|i| MetaValue::I32(if (256..260).contains(&i) { 3 } else { 1 }))
        .collect();
    let mut w = GgufWriter::new();
    let s = |x: &str| MetaValue::String(x.into());
    w.meta("tokenizer.ggml.model", s("gpt2"))
        .meta("tokenizer.ggml.pre", s("gpt2"))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .meta("tokenizer.ggml.token_type", MetaValue::Array(types))
        .meta("tokenizer.ggml.merges", MetaValue::Array(merges))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(256))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(257))
        .meta("tokenizer.chat_template", s(TEMPLATE));
    let path = dir.join("t.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
}

#[test]
fn gguf_tokenizer_round_trips_through_hf_files() {
    let tmp = tempfile::tempdir().unwrap();
    let original = gguf_tokenizer(tmp.path());
    let out = tmp.path().join("hf");
    std::fs::create_dir(&out).unwrap();
    original.write_hf_files(&out).unwrap();
    let back = Tokenizer::from_hf_dir(&out).unwrap();

    assert_eq!(back.eos_ids, vec![257]);
    assert_eq!(back.eos_ids, original.eos_ids);
    assert_eq!(back.bos_token.as_deref(), Some("<s>"));
    assert_eq!(back.eos_token, original.eos_token);
    assert_eq!(back.chat_template.as_deref(), Some(TEMPLATE));
    assert_eq!(back.vocab_size(), original.vocab_size());
    for text in [
        "Hello world",
        " leading space, émoji 🦀",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = original.encode(text, true).unwrap();
        assert_eq!(ids[0], 256, "BOS is added: {ids:?}");
        assert_eq!(back.encode(text, true).unwrap(), ids, "{text}");
        assert_eq!(
            back.decode(&ids, true).unwrap(),
            original.decode(&ids, true).unwrap()
        );
    }
}

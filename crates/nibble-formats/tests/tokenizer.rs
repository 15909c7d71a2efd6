//! Tokenizers against ids produced by the Python `tokenizers` library for the fixture vocabulary
//! (crates/nibble-model/tests/fixtures/tokenizer_expected.json), and the streaming decoder.

use std::path::PathBuf;

use nibble_formats::chat_template::{ChatMessage, ChatTemplate};
use nibble_formats::tokenizer::{StreamDecoder, Tokenizer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizer_expected.json")).unwrap(),
    )
    .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn encode_and_decode_match_python_tokenizers() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny-llama3")).unwrap();
    let exp = expected();
    for case in exp["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
}

#[test]
fn hf_dir_reads_eos_list_template_and_special_tokens() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny-llama3")).unwrap();
    // generation_config.json lists [257, 259]; tokenizer_config's eos_token "</s>" is 257.
    assert_eq!(tok.eos_ids, vec![257, 259]);
    assert_eq!(tok.bos_token.as_deref(), Some("<s>"));
    let tmpl = ChatTemplate::new(tok.chat_template.as_deref().unwrap(), None, None).unwrap();
    let exp = expected();
    {
        let chat = &exp["chat"];
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
        let text = tmpl.render(&messages, true).unwrap();
        assert_eq!(text, chat["rendered"].as_str().unwrap());
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&chat["ids"]));
    }
}

#[test]
fn stream_decoder_waits_for_whole_characters() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("tiny-llama3")).unwrap();
    // "é" is bytes c3 a9 and "😀" f0 9f 98 80: single-byte tokens each in this vocabulary.
    let text = "café 😀!";
    let ids = tok.encode(text, false).unwrap();
    let mut dec = StreamDecoder::new();
    let pieces: Vec<String> = ids.iter().map(|&i| dec.push(&tok, i).unwrap()).collect();
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    // The first byte of a multi-byte character yields nothing yet.
    let c3 = ids.iter().position(|&i| i == 0xc3).unwrap();
    assert_eq!(pieces[c3], "");
}

#[test]
fn missing_and_corrupt_tokenizer_files() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_hf_dir(tmp.path()).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    std::fs::write(tmp.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let e = Tokenizer::from_hf_dir(tmp.path()).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
}

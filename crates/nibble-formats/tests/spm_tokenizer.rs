//! SentencePiece GGUF tokenizers (`tokenizer.ggml.model = "llama"`) against the `sentencepiece`
//! package: tests/fixtures/spm holds a BPE model trained by it, stored as GGUF metadata, and its
//! encodings of held-out text (made by scripts/gen_spm_fixture.py).

use std::path::{Path, PathBuf};

use nibble_core::Error;
use nibble_formats::gguf::{GgufFile, GgufWriter, MetaValue};
use nibble_formats::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/spm")
        .join(name)
}

fn fixture_tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(fixture("spm.gguf")).unwrap()).unwrap()
}

struct Case {
    text: String,
    ids: Vec<u32>,
    /// What `sentencepiece` decodes `ids` to.
    decoded: String,
}

fn cases(section: &str) -> Vec<Case> {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("spm_expected.json")).unwrap())
            .unwrap();
    doc[section]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let text = c["text"].as_str().unwrap().to_string();
            Case {
                decoded: c
                    .get("decoded")
                    .map_or(text.clone(), |d| d.as_str().unwrap().to_string()),
                text,
                ids: c["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect(),
            }
        })
        .collect()
}

/// Asserts that `tok` encodes every case as `sentencepiece` did, listing the first few that
/// do not.
fn assert_encodes_all(tok: &Tokenizer, cases: &[Case]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let got = tok.encode(&c.text, false).unwrap();
            (got != c.ids).then(|| format!("{:?}: got {got:?}, want {:?}", c.text, c.ids))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} lines differ from sentencepiece:\n{}",
        wrong.len(),
        cases.len(),
        wrong[..wrong.len().min(5)].join("\n")
    );
}

#[test]
fn encode_matches_sentencepiece_on_every_line() {
    let tok = fixture_tokenizer();
    let cases = cases("cases");
    assert!(cases.len() >= 1000, "{} lines", cases.len());
    assert_encodes_all(&tok, &cases);
    // add_bos_token is set: BOS (1) goes first when special tokens are wanted.
    for c in &cases {
        let with_bos = tok.encode(&c.text, true).unwrap();
        assert_eq!(with_bos[0], 1);
        assert_eq!(with_bos[1..], c.ids[..], "{:?}", c.text);
    }
    eprintln!("{} lines encode as sentencepiece does", cases.len());
}

#[test]
fn control_tokens_split_the_text_and_each_piece_gets_the_prefix() {
    let tok = fixture_tokenizer();
    let cases = cases("control_cases");
    assert!(cases.len() >= 50);
    assert_encodes_all(&tok, &cases);
}

/// The fixture's metadata rewritten by `edit`, which sees every key and returns its new value
/// (`None` drops it); `extra` keys are appended.
fn variant(
    dir: &Path,
    edit: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    extra: &[(&str, MetaValue)],
) -> PathBuf {
    let file = GgufFile::open(fixture("spm.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for key in file.metadata_keys() {
        if let Some(v) = edit(key, file.metadata(key).unwrap()) {
            w.meta(key, v);
        }
    }
    for (k, v) in extra {
        w.meta(k, v.clone());
    }
    let path = dir.join("variant.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

fn keep(_: &str, v: &MetaValue) -> Option<MetaValue> {
    Some(v.clone())
}

#[test]
fn without_the_space_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let path = variant(
        tmp.path(),
        keep,
        &[("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false))],
    );
    let tok = Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
    let cases = cases("no_prefix_cases");
    assert!(cases.len() >= 200);
    assert_encodes_all(&tok, &cases);
    for c in &cases {
        assert_eq!(tok.decode(&c.ids, true).unwrap(), c.text.replace('▁', " "));
    }
}

#[test]
fn decode_inverts_encode_and_streams_the_same_text() {
    let tok = fixture_tokenizer();
    let mut round_trips = 0;
    for c in cases("cases") {
        let text = tok.decode(&c.ids, true).unwrap();
        assert_eq!(text, c.decoded, "{:?}", c.text);
        // A literal `▁` in the input reads back as a space, in sentencepiece too.
        if !c.text.contains('▁') {
            assert_eq!(text, c.text);
            round_trips += 1;
        }
        let with_bos = tok.encode(&c.text, true).unwrap();
        assert_eq!(tok.decode(&with_bos, true).unwrap(), text);

        let mut dec = StreamDecoder::new();
        let pieces: Vec<String> = with_bos
            .iter()
            .map(|&id| dec.push(&tok, id).unwrap())
            .collect();
        assert_eq!(pieces.concat(), text, "{:?}: {pieces:?}", c.text);
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "{:?}: {pieces:?}",
            c.text
        );
    }
    assert!(round_trips >= 1000, "{round_trips}");
}

#[test]
fn byte_fallback_characters_stream_whole() {
    let tok = fixture_tokenizer();
    // Gothic letters are not in the vocabulary: four byte tokens each.
    let text = "a 𐌰𐌱 b";
    let ids = tok.encode(text, false).unwrap();
    let bytes: Vec<u32> = (0..8)
        .map(|i| {
            tok.token_to_id(&format!("<0x{:02X}>", "𐌰𐌱".as_bytes()[i]))
                .unwrap()
        })
        .collect();
    assert!(ids.windows(8).any(|w| w == bytes), "{ids:?}");
    let mut dec = StreamDecoder::new();
    let pieces: Vec<String> = ids.iter().map(|&i| dec.push(&tok, i).unwrap()).collect();
    assert_eq!(pieces.concat(), text);
    // Nothing is emitted until a character's last byte arrives.
    let first = ids.iter().position(|&i| i == bytes[0]).unwrap();
    assert_eq!(pieces[first..first + 3], ["", "", ""]);
    assert_eq!(pieces[first + 3], "𐌰");
}

#[test]
fn special_tokens_ids_and_skipping() {
    let tok = fixture_tokenizer();
    assert_eq!(tok.bos_token.as_deref(), Some("<s>"));
    assert_eq!(tok.eos_token.as_deref(), Some("</s>"));
    assert_eq!(tok.eos_ids, vec![2]);
    assert_eq!(tok.vocab_size(), 3000);
    let ids = tok.encode("<|im_start|>hi<|im_end|>", true).unwrap();
    assert_eq!(ids[..2], [1, 3]);
    assert_eq!(*ids.last().unwrap(), 4);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi");
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<s><|im_start|> hi<|im_end|>"
    );
    // Ids past the vocabulary (a wider output layer) decode to nothing.
    let mut wide = vec![5000];
    wide.extend_from_slice(&ids[2..ids.len() - 1]);
    assert_eq!(tok.decode(&wide, true).unwrap(), "hi");
}

/// A SentencePiece vocabulary written here, for rules the trained fixture cannot show.
fn tiny(dir: &Path, tokens: &[(&str, f32, i32)]) -> Tokenizer {
    let mut w = GgufWriter::new();
    let s = |x: &str| MetaValue::String(x.into());
    let arr = |f: &dyn Fn(&(&str, f32, i32)) -> MetaValue| {
        MetaValue::Array(tokens.iter().map(f).collect())
    };
    w.meta("tokenizer.ggml.model", s("llama"))
        .meta("tokenizer.ggml.tokens", arr(&|t| s(t.0)))
        .meta("tokenizer.ggml.scores", arr(&|t| MetaValue::F32(t.1)))
        .meta("tokenizer.ggml.token_type", arr(&|t| MetaValue::I32(t.2)))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
}

#[test]
fn equal_scores_merge_leftmost_first() {
    // Files converted without scores give every token the same one; SentencePiece (and
    // llama.cpp) then merge the leftmost pair, whatever the ids. "ba" has the lower id, so a
    // merge list ranked by id would give [▁, a, ba].
    let tmp = tempfile::tempdir().unwrap();
    let tok = tiny(
        tmp.path(),
        &[
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("</s>", 0.0, 3),
            ("▁", -1000.0, 1),
            ("a", -1000.0, 1),
            ("b", -1000.0, 1),
            ("ba", -1000.0, 1),
            ("ab", -1000.0, 1),
        ],
    );
    assert_eq!(tok.encode("aba", false).unwrap(), [3, 7, 4]);
    // Hugging Face's conversion ranks the merges, equal scores by id, and so differs here.
    let hf_dir = tmp.path().join("hf");
    std::fs::create_dir(&hf_dir).unwrap();
    tok.write_hf_files(&hf_dir).unwrap();
    let hf = Tokenizer::from_hf_dir(&hf_dir).unwrap();
    assert_eq!(hf.encode("aba", false).unwrap(), [3, 4, 6]);
    // Without byte tokens, a run of characters outside the vocabulary is one unknown token.
    assert_eq!(tok.encode("a xyz", false).unwrap(), [3, 4, 3, 0]);
    assert_eq!(tok.decode(&[3, 7, 4], true).unwrap(), "aba");
}

fn open_err(path: &Path) -> Error {
    Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).expect_err("bad metadata must be refused")
}

/// A change to one metadata value: the new value, or `None` to drop the key.
type Edit = Box<dyn Fn(&MetaValue) -> Option<MetaValue>>;

#[test]
fn bad_metadata_is_refused_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let shorter: fn(&MetaValue) -> Option<MetaValue> = |v| {
        let a = v.as_array().unwrap();
        Some(MetaValue::Array(a[..a.len() - 1].to_vec()))
    };
    let set_type = |t: i32| -> Edit {
        Box::new(move |v| {
            let mut a = v.as_array().unwrap().to_vec();
            a[500] = MetaValue::I32(t);
            Some(MetaValue::Array(a))
        })
    };
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "tokenizer.ggml.scores",
            Box::new(|_| None),
            &["tokenizer.ggml.scores", "missing"],
        ),
        (
            "tokenizer.ggml.scores",
            Box::new(shorter),
            &["tokenizer.ggml.scores", "2999 entries for 3000 tokens"],
        ),
        (
            "tokenizer.ggml.scores",
            Box::new(|_| Some(MetaValue::String("high".into()))),
            &["tokenizer.ggml.scores", "not an array"],
        ),
        (
            "tokenizer.ggml.token_type",
            Box::new(shorter),
            &["tokenizer.ggml.token_type", "2999 entries for 3000 tokens"],
        ),
        (
            "tokenizer.ggml.token_type",
            Box::new(|_| None),
            &["tokenizer.ggml.token_type", "missing"],
        ),
        (
            "tokenizer.ggml.token_type",
            set_type(9),
            &["token_type[500]", "not a token type"],
        ),
        // An ordinary token marked as a byte token.
        (
            "tokenizer.ggml.token_type",
            set_type(6),
            &["token 500", "not <0xNN>"],
        ),
        (
            "tokenizer.ggml.bos_token_id",
            Box::new(|_| Some(MetaValue::U32(3000))),
            &["tokenizer.ggml.bos_token_id", "below 3000"],
        ),
        (
            "tokenizer.ggml.tokens",
            Box::new(|_| None),
            &["tokenizer.ggml.tokens", "missing"],
        ),
    ];
    for (key, edit, needles) in &cases {
        let path = variant(
            tmp.path(),
            |k, v| if k == *key { edit(v) } else { Some(v.clone()) },
            &[],
        );
        let e = open_err(&path);
        let msg = e.to_string();
        assert!(matches!(e, Error::CorruptFile { .. }), "{key}: {msg}");
        assert!(msg.contains("variant.gguf"), "{key}: {msg}");
        for n in *needles {
            assert!(msg.contains(n), "{key}: {msg:?} lacks {n:?}");
        }
    }

    let path = variant(
        tmp.path(),
        keep,
        &[("tokenizer.ggml.model", MetaValue::String("rwkv".into()))],
    );
    let e = open_err(&path);
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("'rwkv'"), "{e}");
}

#[test]
fn hugging_face_export_encodes_the_same_but_for_user_defined_and_unused_tokens() {
    let tok = fixture_tokenizer();
    let tmp = tempfile::tempdir().unwrap();
    tok.write_hf_files(tmp.path()).unwrap();
    let back = Tokenizer::from_hf_dir(tmp.path()).unwrap();
    assert_eq!(back.vocab_size(), tok.vocab_size());
    assert_eq!(back.bos_token, tok.bos_token);
    assert_eq!(back.eos_token, tok.eos_token);
    let file = GgufFile::open(fixture("spm.gguf")).unwrap();
    let unused: Vec<u32> = file
        .metadata("tokenizer.ggml.token_type")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.as_u64() == Some(5))
        .map(|(i, _)| i as u32)
        .collect();
    let (mut same, mut total) = (0, 0);
    for c in cases("cases").iter().chain(&cases("control_cases")) {
        total += 1;
        let hf = back.encode(&c.text, true).unwrap();
        if hf == tok.encode(&c.text, true).unwrap() {
            same += 1;
            assert_eq!(
                back.decode(&hf, true).unwrap(),
                tok.decode(&hf, true).unwrap()
            );
        } else {
            // Hugging Face's added tokens cut the text before the space prefix goes in, so the
            // text after a user-defined token gets a prefix SentencePiece does not add; and a
            // BPE model has no notion of unused tokens, which SentencePiece splits up again.
            assert!(
                ["<|tool|>", "@@", "[[ref]]"]
                    .iter()
                    .any(|u| c.text.contains(u))
                    || hf.iter().any(|i| unused.contains(i)),
                "{:?}: {hf:?}",
                c.text
            );
        }
    }
    eprintln!("{same} of {total} lines encode the same after the Hugging Face export");
    assert!(same >= total * 9 / 10, "{same} of {total}");
}

/// Control-token strings in a user's text stay text; in a template's text outside the user's
/// ranges they are control tokens, cut as `encode` cuts them.
#[test]
fn control_token_strings_in_user_text_are_text() {
    let tok = fixture_tokenizer();
    assert_eq!(
        tok.special_tokens(),
        ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    );
    let text = "<s>hi </s> there";
    let plain = tok.encode_plain(text, true).unwrap();
    assert_eq!(plain[0], 1, "the BOS asked for");
    assert!(!plain[1..].iter().any(|&i| i < 3), "{plain:?}");
    assert_eq!(tok.decode(&plain[1..], false).unwrap(), text);
    // The user's `</s>` (bytes 6..10) is text; the template's `<s>` is the token.
    let mixed = tok
        .encode_with_literals(text, std::slice::from_ref(&(6..10)))
        .unwrap();
    assert_eq!(mixed[0], 1);
    assert!(!mixed[1..].contains(&2), "{mixed:?}");
    // Ranges without a control token in them change nothing.
    assert_eq!(
        tok.encode_with_literals(text, std::slice::from_ref(&(3..5)))
            .unwrap(),
        tok.encode(text, false).unwrap()
    );
}

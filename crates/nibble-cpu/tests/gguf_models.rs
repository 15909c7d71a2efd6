//! GGUF loading end to end on small models built here: a tiny HF fixture re-exported as a
//! llama-arch GGUF (Q/K rows permuted the way llama.cpp's converter does it, tokenizer in
//! metadata) must give the fixture's logits; broken files give clear errors.

mod common;

use std::path::{Path, PathBuf};

use common::{Loaded, expected, fixture, load};
use nibble_core::Error;
use nibble_cpu::CpuBackend;
use nibble_formats::gguf::{GgmlType, GgufWriter, MetaValue};
use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::tokenizer::StreamDecoder;
use nibble_model::source::{gguf_name, unpermute_qk_order};
use nibble_model::{Backend, BatchLayout, LogitRows, Transformer, open_model};

/// The tiny mistral fixture as a llama-arch GGUF writer, F32 tensors.
fn tiny_gguf() -> GgufWriter {
    export("tiny-mistral", "llama", None)
}

/// As `tiny_gguf`, with the named HF tensor written transposed (a wrong shape).
fn tiny_gguf_with(transposed: Option<&str>) -> GgufWriter {
    export("tiny-mistral", "llama", transposed)
}

/// A fixture as a GGUF of architecture `arch`, written the way llama.cpp's converter does: Q/K
/// rows permuted for llama, HF rope scaling as `rope_freqs.weight` divisors.
fn export(name: &str, arch: &str, transposed: Option<&str>) -> GgufWriter {
    let dir = fixture(name);
    let st = SafetensorsDir::open(&dir).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as u32;
    let (heads, kv_heads) = (
        u("num_attention_heads") as usize,
        u("num_key_value_heads") as usize,
    );

    let mut w = GgufWriter::new();
    let s = |x: &str| MetaValue::String(x.into());
    w.meta("general.architecture", s(arch))
        .meta(
            &format!("{arch}.block_count"),
            MetaValue::U32(u("num_hidden_layers")),
        )
        .meta(&format!("{arch}.context_length"), MetaValue::U32(64))
        .meta(
            &format!("{arch}.embedding_length"),
            MetaValue::U32(u("hidden_size")),
        )
        .meta(
            &format!("{arch}.feed_forward_length"),
            MetaValue::U32(u("intermediate_size")),
        )
        .meta(
            &format!("{arch}.attention.head_count"),
            MetaValue::U32(heads as u32),
        )
        .meta(
            &format!("{arch}.attention.head_count_kv"),
            MetaValue::U32(kv_heads as u32),
        )
        .meta(
            &format!("{arch}.rope.freq_base"),
            MetaValue::F32(cfg["rope_theta"].as_f64().unwrap() as f32),
        )
        .meta(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        );
    // Tokenizer: the fixture's byte-level BPE vocabulary, padded to the model's 272 rows.
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); 272];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    for a in tok["added_tokens"].as_array().unwrap() {
        tokens[a["id"].as_u64().unwrap() as usize] = a["content"].as_str().unwrap().into();
    }
    for (i, t) in tokens.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("<unused{i}>");
        }
    }
    let types: Vec<MetaValue> = (0..272)
        .map(|i| MetaValue::I32(if (256..260).contains(&i) { 3 } else { 1 }))
        .collect();
    let merges: Vec<MetaValue> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => MetaValue::String(s.clone()),
            serde_json::Value::Array(p) => MetaValue::String(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            _ => unreachable!(),
        })
        .collect();
    w.meta("tokenizer.ggml.model", s("gpt2"))
        .meta("tokenizer.ggml.pre", s("gpt2"))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .meta("tokenizer.ggml.token_type", MetaValue::Array(types))
        .meta("tokenizer.ggml.merges", MetaValue::Array(merges))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(257));

    let hf = nibble_model::ModelConfig::from_hf_json(
        &std::fs::read_to_string(dir.join("config.json")).unwrap(),
        "config.json",
    )
    .unwrap();
    if hf.rope_scaling != nibble_model::RopeScaling::None {
        // llama.cpp stores the scaled frequencies as per-frequency divisors of the plain ones.
        let plain = nibble_model::ModelConfig {
            rope_scaling: nibble_model::RopeScaling::None,
            ..hf.clone()
        };
        let factors: Vec<u8> = plain
            .rope_inv_freq()
            .iter()
            .zip(hf.rope_inv_freq())
            .flat_map(|(p, q)| (p / q).to_le_bytes())
            .collect();
        w.tensor(
            "rope_freqs.weight",
            &[hf.head_dim / 2],
            GgmlType::F32,
            factors,
        );
    }
    let mut names: Vec<&str> = st.names().collect();
    names.sort();
    for name in names {
        let t = st.get(name).unwrap();
        let mut t = t.clone();
        // Apply llama.cpp's permutation (the inverse of the loader's un-permutation).
        let heads_for = if name.contains("q_proj") {
            Some(heads)
        } else if name.contains("k_proj") {
            Some(kv_heads)
        } else {
            None
        };
        if let (Some(h), "llama") = (heads_for, arch) {
            let order = unpermute_qk_order(t.shape[0], h);
            let mut inverse = vec![0; order.len()];
            for (hf_row, &g) in order.iter().enumerate() {
                inverse[g] = hf_row;
            }
            t = t.permute_rows(&inverse).unwrap();
        }
        let shape = if transposed == Some(name) {
            t.shape.iter().rev().copied().collect()
        } else {
            t.shape.clone()
        };
        w.tensor(
            &gguf_name(name).unwrap(),
            &shape,
            GgmlType::F32,
            t.bytes.to_vec(),
        );
    }
    w
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn gguf_export_of_a_fixture_reproduces_its_logits() {
    let e = export_error("tiny-mistral", "llama");
    assert!(e < 2e-4, "max logit error {e}");

    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "tiny.gguf", &tiny_gguf().to_bytes());
    let Loaded {
        files,
        backend,
        model,
    } = load(&path, 1);
    assert_eq!(files.tokenizer.eos_ids, vec![257]);
    // The GGUF tokenizer built from metadata must agree with the fixture's tokenizer.json.
    let hf_tok =
        nibble_formats::tokenizer::Tokenizer::from_hf_dir(&fixture("tiny-mistral")).unwrap();
    for text in [
        "Hi, nibble! the then",
        "in on an <|im_start|>user\nhello<|im_end|>",
        "über 123",
    ] {
        assert_eq!(
            files.tokenizer.encode(text, false).unwrap(),
            hf_tok.encode(text, false).unwrap(),
            "{text:?}"
        );
    }

    // The context limit from the GGUF (64) is enforced with a clear error.
    let long = vec![1u32; 65];
    let mut kv = backend.new_kv_pool(model.kv_shape(), 5, 16).unwrap();
    let table: Vec<u32> = (0..5).collect();
    let e = model
        .forward(
            &backend,
            &long,
            &BatchLayout::single(table, 0, 65),
            &mut kv,
            LogitRows::LastPerSeq,
        )
        .err()
        .unwrap();
    assert!(matches!(e, Error::LimitExceeded { limit: 64, .. }), "{e}");
}

/// The tiny model with a SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`, what Llama 2
/// and Mistral GGUF files carry) in place of its byte-level BPE: three special tokens, the 256
/// byte tokens and 13 pieces fill its 272 rows. The reader keeps the last value of a repeated
/// key, so the BPE keys written before are overridden (its merges are left and ignored).
fn tiny_gguf_with_sentencepiece() -> GgufWriter {
    let mut w = tiny_gguf();
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    let pieces = [
        "▁t", "he", "▁the", "▁a", "at", "▁h", "▁hat", "▁", "t", "h", "e", "a", "n",
    ];
    tokens.extend(pieces.map(String::from));
    types.extend([1; 13]);
    let scores = (0..272).map(|i| MetaValue::F32(if i < 259 { 0.0 } else { 258.0 - i as f32 }));
    w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .meta("tokenizer.ggml.scores", MetaValue::Array(scores.collect()))
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        )
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .meta("tokenizer.ggml.unknown_token_id", MetaValue::U32(0))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true));
    w
}

#[test]
fn sentencepiece_gguf_loads_encodes_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(
        tmp.path(),
        "spm.gguf",
        &tiny_gguf_with_sentencepiece().to_bytes(),
    );
    let Loaded {
        files,
        backend,
        model,
    } = load(&path, 1);
    let tok = &files.tokenizer;
    assert_eq!(tok.eos_ids, vec![2]);
    assert_eq!(tok.bos_token.as_deref(), Some("<s>"));
    // BOS, then "▁the" and "▁hat" by the pieces' scores; "é" is not a piece: two byte tokens.
    let prompt = tok.encode("the hat é", true).unwrap();
    assert_eq!(prompt, [1, 261, 265, 266, 3 + 0xc3, 3 + 0xa9]);
    assert_eq!(tok.decode(&prompt, true).unwrap(), "the hat é");

    // Greedy generation from the prompt, streamed back to text.
    let (mut kv, slot) = model.single_sequence_kv(&backend, 32).unwrap();
    let n = prompt.len();
    let logits = model
        .forward(
            &backend,
            &prompt,
            &BatchLayout::single(slot.clone(), 0, n),
            &mut kv,
            LogitRows::LastPerSeq,
        )
        .unwrap();
    let first = common::argmax(&backend.to_host(&logits).unwrap());
    let generated = common::greedy_continue(&backend, &model, &mut kv, &slot, first, n, 8);
    let mut stream = StreamDecoder::new();
    let streamed: String = generated
        .iter()
        .map(|&t| stream.push(tok, t).unwrap())
        .collect();
    assert!(generated.iter().all(|&id| id < 272), "{generated:?}");
    let text = tok.decode(&generated, true).unwrap();
    assert!(text.starts_with(&streamed), "{streamed:?} vs {text:?}");
}

#[test]
fn truncated_gguf_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = tiny_gguf().to_bytes();
    for cut in [0, 3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
        let path = write(tmp.path(), "cut.gguf", &bytes[..cut]);
        let e = open_model(&path, None)
            .err()
            .expect("truncated file must fail");
        let msg = e.to_string();
        assert!(msg.contains("cut.gguf"), "cut at {cut}: {msg}");
        assert!(
            matches!(e, Error::CorruptFile { .. }),
            "cut at {cut}: {msg}"
        );
    }
}

#[test]
fn bad_magic_and_missing_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(
        tmp.path(),
        "x.gguf",
        b"NOPE this is not a model file at all",
    );
    let e = open_model(&path, None).err().unwrap();
    assert!(e.to_string().contains("not a GGUF file"), "{e}");
    let e = open_model(&tmp.path().join("absent.gguf"), None)
        .err()
        .unwrap();
    assert!(e.to_string().contains("absent.gguf"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let mut w = tiny_gguf();
    w.meta("general.architecture", MetaValue::String("mamba".into()));
    // The writer keeps both keys; the reader keeps the last one written.
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "arch.gguf", &w.to_bytes());
    let e = open_model(&path, None).err().unwrap();
    assert!(e.to_string().contains("mamba"), "{e}");
}

#[test]
fn unknown_tensor_type_is_named() {
    let mut bytes = tiny_gguf().to_bytes();
    // Patch the first tensor's type id (after its name, rank and dims) to Q2_K (10).
    let name = b"blk.0.attn_k.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap();
    let type_at = at + name.len() + 4 + 2 * 8;
    bytes[type_at..type_at + 4].copy_from_slice(&10u32.to_le_bytes());
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "type.gguf", &bytes);
    let e = open_model(&path, None).err().unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("Q2_K") && msg.contains("blk.0.attn_k.weight"),
        "{msg}"
    );
}

#[test]
fn wrong_tensor_shape_is_named() {
    let w = tiny_gguf_with(Some("model.layers.1.self_attn.v_proj.weight"));
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "shape.gguf", &w.to_bytes());
    let files = open_model(&path, None).unwrap();
    let backend = CpuBackend::new(1).unwrap();
    let e = Transformer::load(
        &backend,
        files.config.clone(),
        &*files.source,
        &mut |_, _| {},
    )
    .err()
    .expect("a transposed tensor must fail");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("model.layers.1.self_attn.v_proj.weight"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_is_corrupt() {
    let st = SafetensorsDir::open(&fixture("tiny-mistral")).unwrap();
    let v = st.get("model.layers.1.self_attn.v_proj.weight").unwrap();
    let mut w = tiny_gguf();
    w.tensor(
        "blk.1.attn_v.weight",
        &v.shape,
        GgmlType::F32,
        v.bytes.to_vec(),
    );
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "dup.gguf", &w.to_bytes());
    let e = open_model(&path, None)
        .err()
        .expect("duplicate tensor must fail");
    assert!(e.to_string().contains("appears twice"), "{e}");
}

/// Largest |logit - reference| of a GGUF export of `name` over the fixture's input.
fn export_error(name: &str, arch: &str) -> f32 {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "m.gguf", &export(name, arch, None).to_bytes());
    let Loaded { backend, model, .. } = load(&path, 1);
    let exp = expected(name);
    let ids = &exp.input_ids;
    let (mut kv, table) = model.single_sequence_kv(&backend, ids.len()).unwrap();
    let batch = BatchLayout::single(table, 0, ids.len());
    let logits = model
        .forward(&backend, ids, &batch, &mut kv, LogitRows::All)
        .unwrap();
    let got = backend.to_host(&logits).unwrap();
    assert_eq!(got.len(), exp.logits.len());
    got.iter()
        .zip(&exp.logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

#[test]
fn gguf_llama3_rope_freqs_reproduce_hf_rope_scaling() {
    let e = export_error("tiny-llama3", "llama");
    assert!(e < 2e-4, "max logit error {e}");
}

#[test]
fn gguf_qwen2_keeps_rows_and_biases() {
    let e = export_error("tiny-qwen2", "qwen2");
    assert!(e < 2e-4, "max logit error {e}");
}

//! Tokenizers, from a Hugging Face `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*`
//! metadata. A GGUF byte-level BPE (`gpt2`) becomes a `tokenizers::Tokenizer`: the GGUF path
//! writes the equivalent tokenizer.json in memory, so there is one encoder and one decoder to
//! trust. A GGUF SentencePiece BPE (`llama`) has its own encoder in `spm`, because the
//! `tokenizers` crate cannot reproduce SentencePiece's output exactly (the module says where).

mod spm;

use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};
use nibble_core::{Error, Result};
use serde_json::{Value, json};

use crate::gguf::GgufFile;
use spm::SpmTokenizer;

#[derive(Clone)]
pub struct Tokenizer {
    inner: Inner,
    /// Token ids that end generation (EOS, end-of-turn).
    pub eos_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The model's own Jinja chat template, if it ships one.
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

#[derive(Clone)]
enum Inner {
    // Shared: clones (the server's, the engine's) need not copy two vocabularies.
    Hf(std::sync::Arc<HfTokenizer>),
    Spm(Box<SpmTokenizer>),
}

/// A `tokenizers::Tokenizer` twice: as loaded, and with special tokens encoded as the text they
/// are spelt with, for text that comes from a user.
#[derive(Clone)]
struct HfTokenizer {
    parse: tokenizers::Tokenizer,
    plain: tokenizers::Tokenizer,
    /// The special tokens, found as the `tokenizers` crate finds them (leftmost, longest).
    specials: Option<(AhoCorasick, Vec<SpecialToken>)>,
}

/// A special token's id and whether it swallows the whitespace before and after it.
#[derive(Clone, Copy)]
struct SpecialToken {
    id: u32,
    lstrip: bool,
    rstrip: bool,
}

impl HfTokenizer {
    fn new(parse: tokenizers::Tokenizer) -> Result<Self> {
        let mut plain = parse.clone();
        plain.set_encode_special_tokens(true);
        let mut added: Vec<(u32, tokenizers::AddedToken)> = parse
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .collect();
        added.sort_by_key(|&(id, _)| id);
        let specials = if added.is_empty() {
            None
        } else {
            let automaton = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(added.iter().map(|(_, t)| t.content.as_str()))
                .map_err(|e| Error::Tokenizer(format!("cannot index the special tokens: {e}")))?;
            let flags = added
                .iter()
                .map(|(id, t)| SpecialToken {
                    id: *id,
                    lstrip: t.lstrip,
                    rstrip: t.rstrip,
                })
                .collect();
            Some((automaton, flags))
        };
        Ok(HfTokenizer {
            parse,
            plain,
            specials,
        })
    }

    /// Cuts the text at the special tokens `cut` accepts, as `tokenizers` would at every one,
    /// and encodes the pieces between them with the others as text.
    fn encode_cutting(
        &self,
        text: &str,
        cut: &dyn Fn(std::ops::Range<usize>) -> bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let piece = |text: &str, out: &mut Vec<u32>| -> Result<()> {
            if !text.is_empty() {
                let e = self
                    .plain
                    .encode(text, false)
                    .map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
                out.extend_from_slice(e.get_ids());
            }
            Ok(())
        };
        let mut start = 0;
        if let Some((automaton, flags)) = &self.specials {
            for hit in automaton.find_iter(text) {
                if hit.start() < start || !cut(hit.range()) {
                    continue;
                }
                let t = flags[hit.pattern().as_usize()];
                let before = &text[start..hit.start()];
                piece(if t.lstrip { before.trim_end() } else { before }, &mut out)?;
                out.push(t.id);
                start = hit.end();
                if t.rstrip {
                    start = text.len() - text[start..].trim_start().len();
                }
            }
        }
        piece(&text[start..], &mut out)?;
        Ok(out)
    }
}

// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

impl Tokenizer {
    /// `tokenizer.json` plus, when present beside it, `tokenizer_config.json` (chat template,
    /// special token strings) and `config.json` / `generation_config.json` (EOS ids).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            if path.exists() {
                Error::corrupt(&path, format!("cannot parse tokenizer: {e}"))
            } else {
                Error::io(
                    &path,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
                )
            }
        })?;
        let read_json = |name: &str| -> Result<Option<Value>> {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(t) => serde_json::from_str(&t)
                    .map(Some)
                    .map_err(|e| Error::corrupt(&p, format!("invalid JSON: {e}"))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(&p, e)),
            }
        };
        let tok_cfg = read_json("tokenizer_config.json")?.unwrap_or(Value::Null);
        let token_str = |v: Option<&Value>| -> Option<String> {
            match v? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_token = token_str(tok_cfg.get("bos_token"));
        let eos_token = token_str(tok_cfg.get("eos_token"));
        let chat_template = match tok_cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let mut eos_ids = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            if let Some(cfg) = read_json(name)? {
                match cfg.get("eos_token_id") {
                    Some(Value::Number(n)) => eos_ids.extend(n.as_u64().map(|x| x as u32)),
                    Some(Value::Array(a)) => {
                        eos_ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
                    }
                    _ => {}
                }
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Ok(Tokenizer {
            inner: Inner::Hf(std::sync::Arc::new(HfTokenizer::new(inner)?)),
            eos_ids,
            bos_token,
            eos_token,
            chat_template,
        })
    }

    /// A tokenizer from the text of a `tokenizer.json` document alone (`origin` names it in
    /// errors): no EOS ids, special token strings or chat template; set the public fields to
    /// add them.
    pub fn from_hf_json(text: &str, origin: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| Error::Tokenizer(format!("cannot parse tokenizer {origin}: {e}")))?;
        Ok(Tokenizer {
            inner: Inner::Hf(std::sync::Arc::new(HfTokenizer::new(inner)?)),
            eos_ids: Vec::new(),
            bos_token: None,
            eos_token: None,
            chat_template: None,
        })
    }

    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if !matches!(model, "gpt2" | "llama") {
            return Err(Error::unsupported(
                format!(
                    "GGUF tokenizer model '{model}' in {}",
                    file.path().display()
                ),
                "nibble builds byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers \
                 from GGUF metadata; pass --tokenizer path/to/tokenizer.json for other kinds",
            ));
        }
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let id_of = |key: &str| {
            file.metadata(key)
                .and_then(|v| v.as_u64())
                .map(|x| x as u32)
        };
        let (inner, bos_id, eos_id) = if model == "gpt2" {
            (
                Inner::Hf(std::sync::Arc::new(HfTokenizer::new(byte_level_bpe(
                    file, &tokens,
                )?)?)),
                id_of("tokenizer.ggml.bos_token_id"),
                id_of("tokenizer.ggml.eos_token_id"),
            )
        } else {
            let spm = SpmTokenizer::from_gguf(file, &tokens)?;
            let (bos, eos) = (spm.bos, spm.eos);
            (Inner::Spm(Box::new(spm)), bos, eos)
        };
        let mut eos_ids: Vec<u32> = ["eot_token_id", "eom_token_id"]
            .iter()
            .filter_map(|k| id_of(&format!("tokenizer.ggml.{k}")))
            .chain(eos_id)
            .collect();
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let name = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
        };
        Ok(Tokenizer {
            inner,
            bos_token: name(bos_id),
            eos_token: name(eos_id),
            eos_ids,
            chat_template: file
                .metadata("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
        })
    }

    /// The underlying tokenizer as a Hugging Face `tokenizer.json` document (for a GGUF
    /// tokenizer, the equivalent one built from its metadata; for a SentencePiece one, Hugging
    /// Face's conversion, which differs from SentencePiece in the cases `spm` names).
    pub fn to_hf_json(&self) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => t
                .parse
                .to_string(false)
                .map_err(|e| Error::Tokenizer(format!("cannot serialize the tokenizer: {e}"))),
            Inner::Spm(t) => Ok(t.to_hf_json().to_string()),
        }
    }

    /// A `tokenizer_config.json` carrying what [`Tokenizer::from_hf_dir`] reads from it: the
    /// special token strings and the chat template.
    pub fn hf_tokenizer_config(&self) -> Value {
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": false,
        })
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`; EOS ids beyond
    /// `eos_token` belong in the model's `config.json` (`eos_token_id`), where
    /// [`Tokenizer::from_hf_dir`] finds them.
    pub fn write_hf_files(&self, dir: &Path) -> Result<()> {
        let tok = dir.join("tokenizer.json");
        std::fs::write(&tok, self.to_hf_json()?).map_err(|e| Error::io(&tok, e))?;
        let cfg = dir.join("tokenizer_config.json");
        let text = serde_json::to_string_pretty(&self.hf_tokenizer_config())
            .map_err(|e| Error::Tokenizer(format!("cannot serialize tokenizer_config: {e}")))?;
        std::fs::write(&cfg, text).map_err(|e| Error::io(&cfg, e))
    }

    /// Encodes text, special tokens included (`<|im_end|>` in the text is that token): for text
    /// the server trusts, like a rendered chat template. `add_special` lets the tokenizer add BOS
    /// where the model expects it; chat prompts rendered by a template already carry their
    /// special tokens and pass `false`.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Hf(t) => t
                .parse
                .encode(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer(format!("encode failed: {e}"))),
            Inner::Spm(t) => t.encode(text, add_special),
        }
    }

    /// Encodes a user's text: a special token's string in it is text like any other, so a
    /// client cannot end a turn or forge one by typing `<|im_end|>`. Only the BOS or EOS that
    /// `add_special` asks for are special.
    pub fn encode_plain(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Hf(t) => t
                .plain
                .encode(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer(format!("encode failed: {e}"))),
            Inner::Spm(t) => t.encode_cutting(text, add_special, &|_| false),
        }
    }

    /// Encodes a rendered chat template whose `literal` byte ranges (sorted, disjoint) are a
    /// user's text: special tokens count only outside them. Without literal ranges this is
    /// [`Tokenizer::encode`] exactly; with some, the text is cut at the template's special
    /// tokens and the pieces between are encoded with special tokens as text. That equals
    /// `encode` wherever the `tokenizers` crate encodes the pieces between special tokens
    /// independently (byte-level BPE, SentencePiece); a Hugging Face Metaspace tokenizer that
    /// prefixes only the first piece of a text gives the later pieces a prefix too.
    pub fn encode_with_literals(
        &self,
        text: &str,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        if literal.is_empty() {
            return self.encode(text, false);
        }
        let outside = |r: std::ops::Range<usize>| {
            // The first range that ends after the hit starts is the only one it can overlap.
            let i = literal.partition_point(|l| l.end <= r.start);
            literal.get(i).is_none_or(|l| l.start >= r.end)
        };
        match &self.inner {
            Inner::Hf(t) => t.encode_cutting(text, &outside),
            Inner::Spm(t) => t.encode_cutting(text, false, &outside),
        }
    }

    /// The strings that [`Tokenizer::encode`] reads as special tokens.
    pub fn special_tokens(&self) -> Vec<String> {
        match &self.inner {
            Inner::Hf(t) => t.specials.as_ref().map_or_else(Vec::new, |(_, flags)| {
                flags
                    .iter()
                    .filter_map(|f| t.parse.id_to_token(f.id))
                    .collect()
            }),
            Inner::Spm(t) => t.special_strings(),
        }
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => t
                .parse
                .decode(ids, skip_special)
                .map_err(|e| Error::Tokenizer(format!("decode failed: {e}"))),
            Inner::Spm(t) => Ok(t.decode(ids, skip_special)),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Hf(t) => t.parse.get_vocab_size(true),
            Inner::Spm(t) => t.vocab_size(),
        }
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf(t) => t.parse.token_to_id(token),
            Inner::Spm(t) => t.token_to_id(token),
        }
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }
}

/// A GGUF byte-level BPE (`tokenizer.ggml.model = "gpt2"`) as the `tokenizer.json` it stands for.
fn byte_level_bpe(file: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let merges = file.get_str_array("tokenizer.ggml.merges")?;
    let types: Vec<u64> = match file.metadata("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .unwrap_or(&[])
            .iter()
            .map(|t| t.as_u64().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };
    let pre = file
        .metadata("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let bos_id = file
        .metadata("tokenizer.ggml.bos_token_id")
        .and_then(|v| v.as_u64())
        .map(|x| x as u32);
    let add_bos = file
        .metadata("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);

    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            matches!(
                types.get(*i),
                Some(&TOKEN_TYPE_CONTROL) | Some(&TOKEN_TYPE_USER_DEFINED)
            )
        })
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false,
                       "special": types[i] == TOKEN_TYPE_CONTROL})
        })
        .collect();
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": use_regex})
    };
    let split = |pattern: &str| {
        json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                   "invert": false})
    };
    let pre_tokenizer = match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "qwen2" | "deepseek-r1-qwen" => json!({"type": "Sequence", "pretokenizers": [
                split(QWEN2_PATTERN), byte_level(false)]}),
        "llama3" | "llama-bpe" | "llama-v3" => json!({"type": "Sequence", "pretokenizers": [
                split(LLAMA3_PATTERN), byte_level(false)]}),
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        other => {
            return Err(Error::unsupported(
                format!("GGUF pre-tokenizer '{other}' in {}", file.path().display()),
                "known: smollm, qwen2, llama-bpe, gpt2/default; pass --tokenizer \
                     path/to/tokenizer.json to use the model's own",
            ));
        }
    };
    let post_processor = template_processing(
        bos_id
            .filter(|_| add_bos)
            .map(|id| (id, tokens.get(id as usize).copied().unwrap_or_default())),
        None,
    );
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    spec.to_string().parse().map_err(|e| {
        Error::corrupt(
            file.path(),
            format!("tokenizer metadata is inconsistent: {e}"),
        )
    })
}

/// A `TemplateProcessing` post-processor that puts `bos` before and `eos` after the text (null
/// when neither is added).
fn template_processing(bos: Option<(u32, &str)>, eos: Option<(u32, &str)>) -> Value {
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special = |(_, t): (u32, &str)| json!({"SpecialToken": {"id": t, "type_id": 0}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single: Vec<Value> = bos.map(special).into_iter().collect();
    single.push(seq("A", 0));
    single.extend(eos.map(special));
    let mut pair = single.clone();
    pair.push(seq("B", 1));
    pair.extend(eos.map(special));
    let special_tokens: serde_json::Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|(id, t)| (t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]})))
        .collect();
    json!({"type": "TemplateProcessing", "single": single, "pair": pair,
           "special_tokens": special_tokens})
}

/// Turns a growing list of token ids into text pieces as soon as they are complete UTF-8: a
/// multi-byte character split over two tokens is emitted once, when its last byte arrives.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Ids before this index have been emitted and are kept only as left context.
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prev = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if now.len() > prev.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&prev) {
            let piece = now[prev.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }
}

// Pre-tokenizer regexes as the models' tokenizer.json files publish them.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

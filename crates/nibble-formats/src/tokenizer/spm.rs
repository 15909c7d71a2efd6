//! SentencePiece BPE tokenizers from GGUF metadata (`tokenizer.ggml.model = "llama"`: Llama 2,
//! Mistral, Mixtral and many community files).
//!
//! The `tokenizers` crate can hold such a vocabulary (a BPE with byte fallback whose merges are
//! derived from the scores, which is how Hugging Face converts these models and what
//! [`SpmTokenizer::to_hf_json`] writes), but it does not encode exactly as SentencePiece does:
//! * its merges are ranked by position in a list, where SentencePiece takes the highest-scoring
//!   pair and, between equal scores, the leftmost (files converted without scores have every
//!   score equal);
//! * its added tokens either cut the text before the space prefix goes in (so the text after a
//!   user-defined token gets a prefix SentencePiece never adds) or are matched after
//!   normalization with the prefix inside the pattern;
//! * it has no unused tokens, which SentencePiece splits back into the pair that formed them.
//!
//! So encoding is the merge loop below, SentencePiece's `bpe_model.cc` (which llama.cpp's
//! `llm_tokenizer_spm` also follows), checked against the `sentencepiece` package by
//! `tests/spm_tokenizer.rs`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::{AhoCorasick, MatchKind};
use nibble_core::{Error, Result};
use serde_json::{Value, json};

use crate::gguf::GgufFile;

/// SentencePiece's visible space (U+2581): the vocabulary spells every space this way.
const SPACE: char = '\u{2581}';

/// A token's role, from `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`, which are
/// SentencePiece's piece types value for value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte(u8),
}

/// Literal strings found in a text, leftmost first and longest among those starting there.
#[derive(Clone)]
struct Matcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl Matcher {
    fn new(path: &std::path::Path, tokens: &[&str], ids: Vec<u32>) -> Result<Option<Self>> {
        if ids.is_empty() {
            return Ok(None);
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(ids.iter().map(|&i| tokens[i as usize]))
            .map_err(|e| Error::corrupt(path, format!("cannot index the special tokens: {e}")))?;
        Ok(Some(Matcher { automaton, ids }))
    }
}

#[derive(Clone)]
pub(crate) struct SpmTokenizer {
    tokens: Vec<String>,
    kinds: Vec<Kind>,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    byte_fallback: bool,
    unk: Option<u32>,
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    /// Control and unknown-type tokens (`<s>`, `[INST]`), cut out of the raw text first so that
    /// chat templates can write them; SentencePiece itself never parses them.
    specials: Option<Matcher>,
    /// User-defined tokens, which SentencePiece matches in the escaped text as symbols no merge
    /// may touch.
    user_defined: Option<Matcher>,
}

impl SpmTokenizer {
    pub(crate) fn from_gguf(file: &GgufFile, tokens: &[&str]) -> Result<Self> {
        let path = file.path();
        let bad = |why: String| Error::corrupt(path, why);
        let n = tokens.len();
        if n == 0 {
            return Err(bad("tokenizer.ggml.tokens is empty".into()));
        }
        let array = |key: &str, why: &str| -> Result<&[crate::gguf::MetaValue]> {
            let v = file.metadata(key).ok_or_else(|| {
                bad(format!(
                    "a SentencePiece ('llama') tokenizer needs {key} ({why}), and it is missing"
                ))
            })?;
            let a = v
                .as_array()
                .ok_or_else(|| bad(format!("{key} is not an array")))?;
            if a.len() != n {
                return Err(bad(format!("{key} has {} entries for {n} tokens", a.len())));
            }
            Ok(a)
        };

        let scores = array("tokenizer.ggml.scores", "merges are chosen by score")?
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_f64() {
                // Adding 0.0 turns -0.0 into 0.0: SentencePiece compares scores with `<`, under
                // which the two are equal, and the heap below orders with `total_cmp`.
                Some(s) if !s.is_nan() => Ok(s as f32 + 0.0),
                _ => Err(bad(format!(
                    "tokenizer.ggml.scores[{i}] is {v:?}, not a number"
                ))),
            })
            .collect::<Result<Vec<f32>>>()?;
        let kinds = array(
            "tokenizer.ggml.token_type",
            "it marks the byte, control and user-defined tokens",
        )?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            Ok(match v.as_u64() {
                // 0 is llama.cpp's "undefined", which it treats as an ordinary token.
                Some(0 | 1) => Kind::Normal,
                Some(2) => Kind::Unknown,
                Some(3) => Kind::Control,
                Some(4) => Kind::UserDefined,
                Some(5) => Kind::Unused,
                Some(6) => Kind::Byte(parse_byte(tokens[i]).ok_or_else(|| {
                    bad(format!(
                        "token {i} is a byte token but reads {:?}, not <0xNN>",
                        tokens[i]
                    ))
                })?),
                _ => {
                    return Err(bad(format!(
                        "tokenizer.ggml.token_type[{i}] is {v:?}, not a token type (0 to 6)"
                    )));
                }
            })
        })
        .collect::<Result<Vec<Kind>>>()?;

        let id = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            match file.metadata(key) {
                None => Ok(default.filter(|&d| (d as usize) < n)),
                Some(v) => match v.as_u64() {
                    Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                    _ => Err(bad(format!("{key} is {v:?}, not a token id below {n}"))),
                },
            }
        };
        let flag = |key: &str, default: bool| {
            file.metadata(key)
                .and_then(|v| v.as_bool())
                .unwrap_or(default)
        };
        // llama.cpp assumes Llama's ids (BOS 1, EOS 2) when a SentencePiece file omits them, and
        // adds BOS unless told not to; files written for it rely on that.
        let bos = id("tokenizer.ggml.bos_token_id", Some(1))?;
        let eos = id("tokenizer.ggml.eos_token_id", Some(2))?;
        let unk = id(
            "tokenizer.ggml.unknown_token_id",
            kinds
                .iter()
                .position(|&k| k == Kind::Unknown)
                .map(|i| i as u32),
        )?;

        let mut byte_ids = [None; 256];
        for (i, k) in kinds.iter().enumerate() {
            if let Kind::Byte(b) = *k {
                byte_ids[b as usize] = Some(i as u32);
            }
        }
        let of_kind = |want: &dyn Fn(Kind) -> bool| -> Vec<u32> {
            (0..n as u32)
                .filter(|&i| want(kinds[i as usize]) && !tokens[i as usize].is_empty())
                .collect()
        };
        let specials = Matcher::new(
            path,
            tokens,
            of_kind(&|k| matches!(k, Kind::Control | Kind::Unknown)),
        )?;
        let user_defined =
            Matcher::new(path, tokens, of_kind(&|k| matches!(k, Kind::UserDefined)))?;
        Ok(SpmTokenizer {
            ids: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), i as u32))
                .collect(),
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            byte_fallback: byte_ids.iter().any(Option::is_some),
            byte_ids,
            kinds,
            scores,
            unk,
            bos,
            eos,
            add_bos: flag("tokenizer.ggml.add_bos_token", true),
            add_eos: flag("tokenizer.ggml.add_eos_token", false),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true),
            specials,
            user_defined,
        })
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn token_to_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The text is cut at control tokens, and each piece between them is encoded as
    /// SentencePiece encodes a whole text, dummy prefix included: llama.cpp's rule, which gives
    /// a chat template's `<s>[INST] hi` the `▁[INST]` that Meta's reference code produces.
    pub(crate) fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_cutting(text, add_special, &|_| true)
    }

    /// [`Self::encode`], cutting only at the control tokens `cut` accepts (by their byte range):
    /// the others stay in their piece as text.
    pub(crate) fn encode_cutting(
        &self,
        text: &str,
        add_special: bool,
        cut: &dyn Fn(std::ops::Range<usize>) -> bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut start = 0;
        if let Some(m) = &self.specials {
            for hit in m.automaton.find_iter(text) {
                if !cut(hit.range()) {
                    continue;
                }
                self.encode_piece(&text[start..hit.start()], &mut out)?;
                out.push(m.ids[hit.pattern().as_usize()]);
                start = hit.end();
            }
        }
        self.encode_piece(&text[start..], &mut out)?;
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// The strings of the control tokens that [`Self::encode`] cuts out of a text.
    pub(crate) fn special_strings(&self) -> Vec<String> {
        self.specials.as_ref().map_or_else(Vec::new, |m| {
            m.ids
                .iter()
                .map(|&i| self.tokens[i as usize].clone())
                .collect()
        })
    }

    fn encode_piece(&self, raw: &str, out: &mut Vec<u32>) -> Result<()> {
        if raw.is_empty() {
            return Ok(());
        }
        let mut text = String::with_capacity(raw.len() + 3);
        if self.add_space_prefix {
            text.push(SPACE);
        }
        text.extend(raw.chars().map(|c| if c == ' ' { SPACE } else { c }));

        // Symbols: user-defined tokens whole, everything else one character each.
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        let push_chars = |symbols: &mut Vec<Symbol>, from: usize, to: usize| {
            for (i, c) in text[from..to].char_indices() {
                symbols.push(Symbol::new(from + i, from + i + c.len_utf8(), None));
            }
        };
        let mut at = 0;
        if let Some(m) = &self.user_defined {
            for hit in m.automaton.find_iter(&text) {
                push_chars(&mut symbols, at, hit.start());
                let id = m.ids[hit.pattern().as_usize()];
                symbols.push(Symbol::new(hit.start(), hit.end(), Some(id)));
                at = hit.end();
            }
        }
        push_chars(&mut symbols, at, text.len());
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = i.checked_sub(1);
            s.next = Some(i + 1);
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }

        let mut merges = Merges {
            text: &text,
            heap: BinaryHeap::new(),
            unused_parts: HashMap::new(),
        };
        for i in 1..symbols.len() {
            self.propose(&mut merges, &symbols, i - 1, i);
        }
        while let Some(c) = merges.heap.pop() {
            let (l, r) = (c.left, c.right);
            // Stale: one side was merged into something else since this pair was proposed.
            if symbols[l].is_empty()
                || symbols[r].is_empty()
                || symbols[l].len() + symbols[r].len() != c.len
            {
                continue;
            }
            symbols[l].end = symbols[r].end;
            symbols[l].next = symbols[r].next;
            if let Some(next) = symbols[r].next {
                symbols[next].prev = Some(l);
            }
            symbols[r].end = symbols[r].start;
            if let Some(prev) = symbols[l].prev {
                self.propose(&mut merges, &symbols, prev, l);
            }
            if let Some(next) = symbols[l].next {
                self.propose(&mut merges, &symbols, l, next);
            }
        }

        let mut last_unknown = false;
        let mut cur = (!symbols.is_empty()).then_some(0);
        while let Some(i) = cur {
            let s = &symbols[i];
            match s.frozen {
                Some(id) => {
                    out.push(id);
                    last_unknown = false;
                }
                None => self.emit(
                    &text[s.start..s.end],
                    &merges.unused_parts,
                    &mut last_unknown,
                    out,
                )?,
            }
            cur = s.next;
        }
        Ok(())
    }

    /// Queues the merge of two neighbouring symbols if the vocabulary has their concatenation.
    fn propose<'t>(&self, m: &mut Merges<'t>, symbols: &[Symbol], left: usize, right: usize) {
        let (l, r) = (&symbols[left], &symbols[right]);
        if l.frozen.is_some() || r.frozen.is_some() {
            return;
        }
        let piece = &m.text[l.start..r.end];
        let Some(&id) = self.ids.get(piece) else {
            return;
        };
        let kind = self.kinds[id as usize];
        // SentencePiece's mergeable pieces; control, unknown and byte tokens are reserved.
        if !matches!(kind, Kind::Normal | Kind::UserDefined | Kind::Unused) {
            return;
        }
        m.heap.push(Candidate {
            score: self.scores[id as usize],
            left,
            right,
            len: piece.len(),
        });
        if kind == Kind::Unused {
            // SentencePiece remembers the latest pair proposed for an unused piece, and splits
            // the piece back into it on output.
            m.unused_parts
                .insert(piece, (&m.text[l.start..l.end], &m.text[r.start..r.end]));
        }
    }

    /// Appends a final symbol's ids: its token, an unused token's parts, or (not in the
    /// vocabulary) its bytes as byte tokens, else the unknown token.
    fn emit(
        &self,
        piece: &str,
        unused_parts: &HashMap<&str, (&str, &str)>,
        last_unknown: &mut bool,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut stack = vec![piece];
        while let Some(p) = stack.pop() {
            let id = self.ids.get(p).copied();
            match id.map(|i| self.kinds[i as usize]) {
                Some(Kind::Unused) => {
                    // An unused token goes back into the pair that formed it; one no merge
                    // formed (a single character) is unknown, as sentencepiece 0.2 has it.
                    if let Some(&(a, b)) = unused_parts.get(p) {
                        stack.push(b);
                        stack.push(a);
                        continue;
                    }
                }
                Some(Kind::Unknown) | None => {}
                Some(_) => {
                    out.extend(id);
                    *last_unknown = false;
                    continue;
                }
            }
            if self.byte_fallback {
                for b in p.bytes() {
                    out.push(self.byte_ids[b as usize].or(self.unk).ok_or_else(|| {
                        unencodable(p, "neither its byte token nor an unknown token")
                    })?);
                }
                *last_unknown = false;
            } else {
                // Without byte fallback, SentencePiece folds a run of unknown symbols into one
                // unknown token.
                if !*last_unknown {
                    out.push(
                        self.unk
                            .ok_or_else(|| unencodable(p, "no unknown token either"))?,
                    );
                }
                *last_unknown = true;
            }
        }
        Ok(())
    }

    /// Byte tokens become bytes (so a character split over several comes out whole), `▁`
    /// becomes a space, and the space the encoder's prefix added before the first piece is
    /// dropped, as SentencePiece decodes. Ids past the vocabulary (a model's output layer can be
    /// wider) are skipped.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_prefix = self.add_space_prefix;
        let mut buf = [0u8; 4];
        for &id in ids {
            let Some(&kind) = self.kinds.get(id as usize) else {
                continue;
            };
            let token = self.tokens[id as usize].as_str();
            match kind {
                Kind::Control | Kind::Unknown => {
                    if !skip_special {
                        bytes.extend_from_slice(token.as_bytes());
                    }
                }
                Kind::Byte(b) => bytes.push(b),
                Kind::Normal | Kind::UserDefined | Kind::Unused => {
                    let mut text = token;
                    if strip_prefix
                        && bytes.is_empty()
                        && let Some(rest) = text.strip_prefix(SPACE)
                    {
                        text = rest;
                        strip_prefix = false;
                    }
                    for c in text.chars() {
                        let c = if c == SPACE { ' ' } else { c };
                        bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The Hugging Face `tokenizer.json` that Hugging Face's own converter makes of a
    /// SentencePiece BPE model: a BPE with byte fallback whose merges are every split of a
    /// token into two tokens, ranked by the token's score. It encodes as this tokenizer does
    /// except in the cases the module comment names.
    pub(crate) fn to_hf_json(&self) -> Value {
        let vocab: serde_json::Map<String, Value> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        let symbol = |s: &str| {
            self.ids
                .get(s)
                .copied()
                .filter(|&i| matches!(self.kinds[i as usize], Kind::Normal | Kind::Unused))
        };
        let mut merges: Vec<(f32, u32, u32, u32)> = Vec::new();
        for (id, token) in self.tokens.iter().enumerate() {
            if self.kinds[id] != Kind::Normal {
                continue;
            }
            for (at, _) in token.char_indices().skip(1) {
                if let (Some(l), Some(r)) = (symbol(&token[..at]), symbol(&token[at..])) {
                    merges.push((self.scores[id], id as u32, l, r));
                }
            }
        }
        merges.sort_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then(a.1.cmp(&b.1))
                .then((a.2, a.3).cmp(&(b.2, b.3)))
        });
        let merges: Vec<Value> = merges
            .iter()
            .map(|&(_, _, l, r)| json!([self.tokens[l as usize], self.tokens[r as usize]]))
            .collect();
        let added: Vec<Value> = (0..self.tokens.len())
            .filter_map(|i| {
                let special = match self.kinds[i] {
                    Kind::Control | Kind::Unknown => true,
                    Kind::UserDefined => false,
                    _ => return None,
                };
                Some(
                    json!({"id": i, "content": self.tokens[i], "single_word": false,
                            "lstrip": false, "rstrip": false, "normalized": false,
                            "special": special}),
                )
            })
            .collect();
        let replace_space = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
        let (normalizer, decoder) = if self.add_space_prefix {
            (
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "▁"}, replace_space]}),
                json!({"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
            )
        } else {
            (
                replace_space,
                json!({"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"}]}),
            )
        };
        let name = |id: Option<u32>| id.map(|i| (i, self.tokens[i as usize].as_str()));
        json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": null,
            "post_processor": super::template_processing(
                name(self.bos.filter(|_| self.add_bos)),
                name(self.eos.filter(|_| self.add_eos)),
            ),
            "decoder": decoder,
            "model": {"type": "BPE", "dropout": null,
                      "unk_token": self.unk.map(|i| self.tokens[i as usize].clone()),
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": true, "byte_fallback": self.byte_fallback,
                      "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
    }
}

fn parse_byte(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn unencodable(piece: &str, why: &str) -> Error {
    Error::Tokenizer(format!(
        "cannot encode {piece:?}: it is not in the vocabulary and there is {why}"
    ))
}

/// A run of the escaped text; merged-away symbols are left empty.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: Option<usize>,
    next: Option<usize>,
    /// A user-defined token's id: this symbol never merges.
    frozen: Option<u32>,
}

impl Symbol {
    fn new(start: usize, end: usize, frozen: Option<u32>) -> Self {
        Symbol {
            start,
            end,
            prev: None,
            next: None,
            frozen,
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

struct Merges<'t> {
    text: &'t str,
    heap: BinaryHeap<Candidate>,
    unused_parts: HashMap<&'t str, (&'t str, &'t str)>,
}

/// A proposed merge of symbols `left` and `right`, `len` bytes together.
#[derive(PartialEq)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    /// The heap pops the highest score first and, between equal scores, the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

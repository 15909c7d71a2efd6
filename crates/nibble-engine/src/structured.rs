//! Structured outputs: a JSON schema, any JSON object, a regular expression or a Lark grammar,
//! enforced by masking the tokens that cannot continue it at every step ([`Constraint`]).
//!
//! The grammar engine is `llguidance` (the one llama.cpp and vLLM use): it compiles JSON schemas
//! to a lexer + Earley parser and computes a step's mask by walking a trie of the vocabulary's
//! bytes ([`Grammars`], built once per tokenizer), in tens of microseconds for a large vocabulary.
//! The mask goes to the backend's sampler ([`nibble_model::sampling::SampleSpec::allowed`]),
//! which removes every other token before any penalty or filter, on the CPU and the GPU alike.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use nibble_core::{Error, Result};
use nibble_formats::tokenizer::Tokenizer;
use serde_json::Value;

/// What a request asks its output to be.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON Schema (draft 2020-12 as llguidance supports it).
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression the whole output matches (Rust `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// The vocabulary as llguidance sees it: each token's bytes, in a trie.
struct NibbleTokEnv {
    trie: TokTrie,
}

impl TokenizerEnv for NibbleTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    // llguidance tokenizes only the grammar's forced text; greedy over the trie is a valid (if
    // not always canonical) tokenization of any byte string, and never fails.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles grammars for one tokenizer and model vocabulary. Building it walks the whole
/// vocabulary once; compiling a grammar is per request.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    words: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("words", &self.words)
            .finish()
    }
}

impl Grammars {
    /// For `tokenizer` over a model whose logits have `vocab` columns (ids the tokenizer does
    /// not have are never allowed; ids past `vocab` cannot be sampled and are left out).
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Self> {
        let bad = |why: String| Error::Tokenizer(format!("structured outputs: {why}"));
        let json: Value = serde_json::from_str(&tokenizer.to_hf_json()?)
            .map_err(|e| bad(format!("the tokenizer's JSON does not parse: {e}")))?;
        // llguidance asserts on some malformed vocabularies rather than returning an error; a
        // model file must never be able to take the process down.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| bad("the vocabulary cannot be read as bytes".into()))?
            .map_err(|e| bad(format!("the vocabulary cannot be read as bytes: {e}")))?;
        let mut words = words;
        words.resize(vocab, Vec::new());
        let eos: Vec<u32> = tokenizer
            .eos_ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            return Err(bad("the tokenizer has no end-of-sequence token".into()));
        };
        let vocab_u32 = u32::try_from(vocab).map_err(|_| bad(format!("vocabulary of {vocab}")))?;
        let info = TokRxInfo::new(vocab_u32, first_eos);
        let trie = std::panic::catch_unwind(|| TokTrie::from(&info, &words).with_eos_tokens(&eos))
            .map_err(|_| bad("the vocabulary cannot be put in a trie".into()))?;
        let env: TokEnv = Arc::new(NibbleTokEnv { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| bad(format!("cannot set up the grammar engine: {e}")))?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
            words: vocab.div_ceil(32),
            eos: eos.into(),
        })
    }

    /// Compiles `spec` into a fresh constraint, or says why it cannot (an invalid or
    /// unsupported schema, a bad regular expression or grammar): `Error::InvalidArgument`.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_layout(schema.clone()))
            }
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(json_layout(
                serde_json::json!({"type": "object"}),
            )),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            Error::InvalidArgument(format!("the {} cannot be compiled: {e}", spec.what()))
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidArgument(format!(
                "the {} cannot be compiled: {e}",
                spec.what()
            )));
        }
        Ok(Constraint {
            matcher,
            words: self.words,
            eos: self.eos.clone(),
        })
    }

    /// Words of a mask (`vocab.div_ceil(32)`).
    pub fn mask_words(&self) -> usize {
        self.words
    }

    /// The bytes token `id` stands for, as the grammar engine matches them (a special token's
    /// start with 0xFF, so that no text matches them; empty for ids the tokenizer lacks).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if (id as usize) < trie.vocab_size() {
            trie.token(id).to_vec()
        } else {
            Vec::new()
        }
    }
}

impl GrammarSpec {
    fn what(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::JsonObject => "JSON object grammar",
            GrammarSpec::Regex(_) => "regular expression",
            GrammarSpec::Lark(_) => "grammar",
        }
    }
}

/// JSON as models write it (`{"a": 1, "b": [2, 3]}`) and nothing else: with llguidance's
/// default, any run of whitespace may go between tokens, and a small model stuck on a newline
/// would spend its whole budget there. A schema that says how it wants its layout
/// (`x-guidance`) keeps it.
pub fn json_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    schema
}

/// One sequence's grammar state: which tokens may come next, advanced by each sampled token.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    words: usize,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// The tokens allowed next, as a bitmask of [`Grammars::mask_words`] words (the
    /// end-of-sequence tokens are in it once the grammar accepts). Empty when the grammar is in
    /// error: nothing may be sampled.
    pub fn mask(&mut self, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        out.resize(self.words, 0);
        let vob = self
            .matcher
            // A complete grammar's mask is its end-of-sequence tokens.
            .compute_mask_or_eos()
            .map_err(|e| Error::InvalidArgument(format!("structured output: {e}")))?;
        let bits = vob.as_slice();
        let n = bits.len().min(out.len());
        out[..n].copy_from_slice(&bits[..n]);
        // Every end-of-sequence token of the model ends an accepted output, not only the one
        // llguidance knows as its own.
        if self.accepting() {
            for &t in self.eos.iter() {
                out[t as usize / 32] |= 1 << (t % 32);
            }
        }
        Ok(())
    }

    /// Advances past a sampled (non-EOS) token; an error if the grammar forbids it.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::InvalidArgument(format!("structured output: {e}")))
    }

    /// Whether the grammar accepts the output as it is (an end-of-sequence token may end it).
    pub fn accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether nothing but the end may follow: the output is complete.
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

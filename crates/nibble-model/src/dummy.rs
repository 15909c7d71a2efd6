//! Synthetic models, so speed can be measured without checkpoints: a shipped (or given)
//! Hugging Face `config.json`, random BF16 weights of realistic scale made on demand, and a
//! byte-level tokenizer.
//!
//! Every tensor [`crate::Transformer::load`] reads is built when asked for (`get`), from
//! `(seed, tensor name)` alone: a counter-based hash per four elements, rows in parallel. Nothing
//! is kept, so host memory peaks at one tensor, and the same seed always gives the same bits.
//!
//! Scales: projections and an untied output head are uniform with standard deviation
//! `1/sqrt(in_features)` (so a layer keeps its input's RMS), the embedding table has standard
//! deviation [`EMBED_STD`], norm weights lie in `1 ± 0.05`, biases have standard deviation
//! [`BIAS_STD`]. No element is ever zero.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::bf16;
use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::tokenizer::Tokenizer;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_precision::LinearFormat;
use rayon::prelude::*;
use serde_json::{Value, json};

use crate::config::{Arch, ModelConfig, TensorLayout};
use crate::loader::ModelFiles;
use crate::source::TensorSource;
use crate::transformer::{TensorRole, model_tensors};

/// The configs the binary carries, by name: published Hugging Face shapes (`torch_dtype`
/// bfloat16; two mixture-of-experts ones), and `tiny-dummy` for tests.
pub const SHIPPED_CONFIGS: [(&str, &str); 7] = [
    ("llama-3-8b", include_str!("../configs/llama-3-8b.json")),
    ("qwen3-8b", include_str!("../configs/qwen3-8b.json")),
    ("llama-2-7b", include_str!("../configs/llama-2-7b.json")),
    ("llama-2-70b", include_str!("../configs/llama-2-70b.json")),
    ("mixtral-8x7b", include_str!("../configs/mixtral-8x7b.json")),
    (
        "qwen3-30b-a3b",
        include_str!("../configs/qwen3-30b-a3b.json"),
    ),
    ("tiny-dummy", include_str!("../configs/tiny-dummy.json")),
];

/// Standard deviation of the embedding table.
pub const EMBED_STD: f32 = 0.02;
/// Standard deviation of Q/K/V biases (architectures that have them).
pub const BIAS_STD: f32 = 0.02;
/// Norm weights are uniform in `1 ± NORM_SPREAD`.
pub const NORM_SPREAD: f32 = 0.05;

/// The text of a shipped `config.json`, by name.
pub fn shipped_config(name: &str) -> Option<&'static str> {
    SHIPPED_CONFIGS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}

/// A model with random weights: `name_or_path` is a shipped config's name (see
/// [`SHIPPED_CONFIGS`]) or a path to a `config.json` (or a directory holding one). The same
/// `seed` gives the same weights.
///
/// `NAME:PRECISION` (e.g. `llama-3-8b:w4a16-g128`, `llama-3-8b:w8a8`) gives the linear layers
/// of the blocks in that precision instead, each random row quantized round-to-nearest, so
/// quantized kernels can be run and timed at a model's real shapes without its checkpoint.
pub fn open_dummy(name_or_path: &str, seed: u64) -> Result<ModelFiles> {
    let (name_or_path, quant) = match name_or_path.rsplit_once(':') {
        Some((name, spec)) if !spec.contains('/') && !spec.contains('\\') => {
            let spec: nibble_precision::PrecisionSpec = spec.parse()?;
            (name, spec.linear.linear_format(0))
        }
        _ => (name_or_path, None),
    };
    let (text, origin, path) = match shipped_config(name_or_path) {
        Some(text) => (
            text.to_string(),
            format!("shipped config '{name_or_path}'"),
            PathBuf::from(format!("dummy:{name_or_path}")),
        ),
        None => {
            let p = Path::new(name_or_path);
            let file = if p.is_dir() {
                p.join("config.json")
            } else {
                p.to_path_buf()
            };
            if !file.is_file() {
                let names: Vec<&str> = SHIPPED_CONFIGS.iter().map(|(n, _)| *n).collect();
                return Err(Error::InvalidArgument(format!(
                    "no dummy model '{name_or_path}': name a shipped config ({}) or a path to \
                     a config.json",
                    names.join(", ")
                )));
            }
            let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
            (text, file.display().to_string(), file)
        }
    };
    let config = ModelConfig::from_hf_json(&text, &origin)?;
    let layout = hf_layout(&text, config.arch, &origin)?;
    let tokenizer = byte_level_tokenizer(config.vocab_size)?;
    let mut source = DummySource::new(
        &config,
        &layout,
        seed,
        format!("dummy weights for {origin} (seed {seed})"),
    );
    source.quantize = quant;
    Ok(ModelFiles {
        path,
        config,
        tokenizer,
        source: Box::new(source),
        precision: None,
    })
}

/// The tensors a Hugging Face config implies beyond `ModelConfig`, with the defaults of its
/// architecture's config class.
fn hf_layout(text: &str, arch: Arch, origin: &str) -> Result<TensorLayout> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::Config(format!("{origin} is not valid JSON: {e}")))?;
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("mlp_bias") {
        return Err(Error::unsupported(
            format!("MLP biases (mlp_bias in {origin})"),
            "nibble's MLP has no biases",
        ));
    }
    Ok(TensorLayout {
        // Gemma's config class ties the head unless told otherwise.
        tie_word_embeddings: v
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(arch == Arch::Gemma3),
        attention_bias: match arch {
            Arch::Qwen2 | Arch::Qwen2Moe => true,
            Arch::Mistral | Arch::Mixtral | Arch::Gemma3 => false,
            Arch::Llama | Arch::Qwen3 | Arch::Qwen3Moe => flag("attention_bias"),
        },
        qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
    })
}

/// GPT-2's printable stand-in for each byte (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).expect("a valid code point")
    }
}

/// A byte-level tokenizer of `vocab_size` ids: id `b < 256` is byte `b`, so any text encodes
/// (one id per byte), and every other id decodes to a placeholder `<tID>`. Control characters
/// decode as `?` so output stays printable. No special tokens, no EOS (generation runs to its
/// token limit), no chat template.
pub fn byte_level_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    if vocab_size < 256 {
        return Err(Error::Config(format!(
            "a dummy model needs a vocabulary of at least 256 ids (one per byte), not {vocab_size}"
        )));
    }
    let vocab: serde_json::Map<String, Value> = (0..vocab_size)
        .map(|id| {
            let token = match u8::try_from(id) {
                Ok(b) => byte_char(b).to_string(),
                Err(_) => format!("<t{id}>"),
            };
            (token, json!(id))
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": false});
    let spec = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            byte_level,
            {"type": "Replace", "pattern": {"Regex": r"[\x00-\x08\x0B-\x1F\x7F-\x9F]"},
             "content": "?"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    Tokenizer::from_hf_json(&spec.to_string(), "(dummy byte-level tokenizer)")
}

/// How a tensor's elements are drawn: uniform in `center ± half`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Init {
    center: f32,
    half: f32,
}

impl Init {
    fn with_std(std: f32) -> Self {
        Init {
            center: 0.0,
            half: std * 3f32.sqrt(),
        }
    }
}

/// Random BF16 weights for every tensor [`crate::Transformer::load`] reads, each built when
/// asked for.
pub struct DummySource {
    seed: u64,
    origin: String,
    tensors: HashMap<String, (Vec<usize>, Init)>,
    /// Linear layers of the blocks in this format (RTN of the random rows) instead of BF16.
    pub quantize: Option<LinearFormat>,
}

impl DummySource {
    /// The tensors of `config` with `layout` (as [`model_tensors`] lists them); `origin` names
    /// the source in errors.
    pub fn new(
        config: &ModelConfig,
        layout: &TensorLayout,
        seed: u64,
        origin: impl Into<String>,
    ) -> Self {
        let tensors = model_tensors(config, layout)
            .into_iter()
            .map(|(name, shape, role)| {
                let init = match role {
                    TensorRole::Weight if name == "model.embed_tokens.weight" => {
                        Init::with_std(EMBED_STD)
                    }
                    TensorRole::Weight => {
                        let fan_in = *shape.last().expect("a 2-D weight");
                        Init::with_std(1.0 / (fan_in as f32).sqrt())
                    }
                    TensorRole::Vector if name.ends_with(".bias") => Init::with_std(BIAS_STD),
                    TensorRole::Vector => Init {
                        center: 1.0,
                        half: NORM_SPREAD,
                    },
                };
                (name, (shape, init))
            })
            .collect();
        DummySource {
            seed,
            origin: origin.into(),
            tensors,
            quantize: None,
        }
    }

    /// Every tensor's name and shape, in no particular order.
    pub fn shapes(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.tensors
            .iter()
            .map(|(n, (shape, _))| (n.as_str(), shape.as_slice()))
    }
}

impl DummySource {
    /// Rows `r0..r1`, columns `c0..c1` of tensor `name`, quantized as `get` would where the
    /// quantization is row-wise: the same bytes as cutting `get`'s tensor (each element is a
    /// function of its row and column, and every quantization here works row by row).
    fn build(&self, name: &str, rows: (usize, usize), cols: (usize, usize)) -> Option<HostTensor> {
        let (shape, init) = self.tensors.get(name)?;
        let (n_rows, n_cols) = (rows.1 - rows.0, cols.1 - cols.0);
        let mut bytes = vec![0u8; n_rows * n_cols * 2];
        let key = tensor_key(self.seed, name);
        bytes
            .par_chunks_mut(n_cols * 2)
            .enumerate()
            .for_each(|(row, out)| fill_row(key, rows.0 + row, cols.0, out, *init));
        let mut out_shape = shape.clone();
        if shape.len() == 2 {
            out_shape = vec![n_rows, n_cols];
        }
        if let Some(format) = self.quantized_as(name, shape)
            && let Ok(rb) = format.row_bytes(n_cols)
        {
            let mut q = vec![0u8; n_rows * rb];
            let ok = q
                .par_chunks_mut(rb)
                .zip(bytes.par_chunks(n_cols * 2))
                .all(|(out, row)| {
                    let vals: Vec<f32> = row
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect();
                    format.codec.quantize_row(&vals, 1.0, out).is_ok()
                });
            if ok {
                return Some(HostTensor {
                    name: name.to_string(),
                    shape: out_shape,
                    format: WeightFormat::Quant(format),
                    bytes: TensorBytes::Owned(std::sync::Arc::new(q)),
                });
            }
        }
        Some(HostTensor {
            name: name.to_string(),
            shape: out_shape,
            format: WeightFormat::Ggml(GgmlType::BF16),
            bytes: TensorBytes::Owned(std::sync::Arc::new(bytes)),
        })
    }

    /// Whether quantizing columns `c0..c1` of `name`'s rows on their own gives the bytes of
    /// cutting the quantized whole rows: BF16, or groups that the cut keeps whole (per-channel
    /// scales depend on the whole row).
    fn part_quantizes_alike(&self, name: &str, shape: &[usize], c0: usize, c1: usize) -> bool {
        self.quantized_as(name, shape).is_none_or(|f| {
            matches!(f.codec, nibble_precision::WeightCodec::Int4Group { group } if group > 0)
                && f.check_col_cut(shape[1], c0, c1).is_ok()
        })
    }

    /// The format `get` stores tensor `name` of `shape` in, when it quantizes it: the blocks'
    /// linear layers whose rows the format can encode.
    fn quantized_as(&self, name: &str, shape: &[usize]) -> Option<LinearFormat> {
        let f = self.quantize?;
        let cols = *shape.last()?;
        (shape.len() == 2 && name.starts_with("model.layers.") && f.row_bytes(cols).is_ok())
            .then_some(f)
    }
}

impl TensorSource for DummySource {
    fn get(&self, name: &str) -> Option<HostTensor> {
        let (shape, _) = self.tensors.get(name)?;
        let rows = if shape.len() == 2 { shape[0] } else { 1 };
        let cols = shape.last().copied().unwrap_or(1).max(1);
        self.build(name, (0, rows), (0, cols))
    }

    fn get_part(
        &self,
        name: &str,
        by_rows: bool,
        a: usize,
        b: usize,
    ) -> Option<Result<HostTensor>> {
        let (shape, _) = self.tensors.get(name)?;
        let cut = |t: HostTensor| t.slice_part(by_rows, a, b);
        let [rows, cols] = shape[..] else {
            return self.get(name).map(cut);
        };
        if a >= b || b > if by_rows { rows } else { cols } {
            return self.get(name).map(cut);
        }
        if by_rows {
            return self.build(name, (a, b), (0, cols)).map(Ok);
        }
        // Elements come four to a hash: a column cut on a multiple of four builds only its part.
        if a.is_multiple_of(4) && self.part_quantizes_alike(name, shape, a, b) {
            return self.build(name, (0, rows), (a, b)).map(Ok);
        }
        self.get(name).map(cut)
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn layout_of(&self, name: &str) -> Option<(Vec<usize>, WeightFormat)> {
        let (shape, _) = self.tensors.get(name)?;
        let format = self
            .quantized_as(name, shape)
            .map_or(WeightFormat::Ggml(GgmlType::BF16), WeightFormat::Quant);
        Some((shape.clone(), format))
    }

    fn origin(&self) -> String {
        self.origin.clone()
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijection that scrambles every input bit into every output bit.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream key of one tensor: FNV-1a of its name, mixed with the seed.
fn tensor_key(seed: u64, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    });
    mix64(mix64(seed.wrapping_add(GOLDEN)) ^ fnv)
}

/// Row `row` of a tensor as BF16 bytes, from column `col0` (a multiple of 4) on: one splitmix64
/// draw of (key, row, column / 4) per four elements, each taking 16 bits, mapped to the odd
/// multiples of `half / 65535` about `center` (never zero about 0); so any part of a row is the
/// same bytes as that part of the whole row.
fn fill_row(key: u64, row: usize, col0: usize, out: &mut [u8], init: Init) {
    debug_assert!(col0.is_multiple_of(4));
    let scale = init.half / 32767.5;
    let row_base = (row as u64) << 32;
    for (g, chunk) in out.chunks_mut(8).enumerate() {
        let counter = row_base | (col0 / 4 + g) as u64;
        let mut h = mix64(key.wrapping_add(counter.wrapping_mul(GOLDEN)));
        for pair in chunk.chunks_exact_mut(2) {
            let u = (h & 0xFFFF) as f32;
            h >>= 16;
            let v = init.center + (u - 32767.5) * scale;
            pair.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn parts_are_the_whole_tensors_cut() {
        for spec in ["tiny-dummy", "tiny-dummy:w4a16-g32", "tiny-dummy:w8a8"] {
            let files = open_dummy(spec, 5).unwrap();
            let src = &*files.source;
            for (name, by_rows, a, b) in [
                ("model.layers.1.self_attn.q_proj.weight", true, 128, 256),
                ("model.layers.1.self_attn.o_proj.weight", false, 128, 256),
                ("model.layers.2.mlp.down_proj.weight", false, 352, 704),
                ("model.layers.2.mlp.down_proj.weight", false, 0, 352),
                ("model.norm.weight", true, 0, 1),
            ] {
                let want = src.get(name).unwrap().slice_part(by_rows, a, b);
                let got = src.get_part(name, by_rows, a, b).unwrap();
                match (got, want) {
                    (Ok(g), Ok(w)) => {
                        assert_eq!(g.shape, w.shape, "{spec} {name}");
                        assert_eq!(g.format, w.format, "{spec} {name}");
                        assert_eq!(&g.bytes[..], &w.bytes[..], "{spec} {name} {a}..{b}");
                    }
                    (Err(_), Err(_)) => {}
                    (g, w) => panic!("{spec} {name}: part {:?} vs cut {:?}", g.err(), w.err()),
                }
            }
        }
    }

    fn tiny() -> ModelFiles {
        open_dummy("tiny-dummy", 7).unwrap()
    }

    #[test]
    fn shipped_configs_parse_with_published_shapes() {
        for (name, text) in SHIPPED_CONFIGS {
            let c = ModelConfig::from_hf_json(text, name).unwrap();
            let v: Value = serde_json::from_str(text).unwrap();
            assert_eq!(v["torch_dtype"], "bfloat16", "{name}");
            let layout = hf_layout(text, c.arch, name).unwrap();
            assert!(!layout.tie_word_embeddings, "{name}");
            let shape = (
                c.arch,
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.intermediate_size,
                c.vocab_size,
                c.rope_theta,
                c.max_context,
                layout.qk_norm,
            );
            let want = match name {
                "llama-3-8b" => (
                    Arch::Llama,
                    4096,
                    32,
                    32,
                    8,
                    128,
                    14336,
                    128256,
                    500000.0,
                    8192,
                    false,
                ),
                "qwen3-8b" => (
                    Arch::Qwen3,
                    4096,
                    36,
                    32,
                    8,
                    128,
                    12288,
                    151936,
                    1e6,
                    40960,
                    true,
                ),
                "llama-2-7b" => (
                    Arch::Llama,
                    4096,
                    32,
                    32,
                    32,
                    128,
                    11008,
                    32000,
                    10000.0,
                    4096,
                    false,
                ),
                "llama-2-70b" => (
                    Arch::Llama,
                    8192,
                    80,
                    64,
                    8,
                    128,
                    28672,
                    32000,
                    10000.0,
                    4096,
                    false,
                ),
                "mixtral-8x7b" => (
                    Arch::Mixtral,
                    4096,
                    32,
                    32,
                    8,
                    128,
                    14336,
                    32000,
                    1e6,
                    32768,
                    false,
                ),
                "qwen3-30b-a3b" => (
                    Arch::Qwen3Moe,
                    2048,
                    48,
                    32,
                    4,
                    128,
                    6144,
                    151936,
                    1e6,
                    40960,
                    true,
                ),
                "tiny-dummy" => (
                    Arch::Llama,
                    256,
                    4,
                    4,
                    2,
                    64,
                    704,
                    512,
                    500000.0,
                    2048,
                    false,
                ),
                other => panic!("untested shipped config {other}"),
            };
            assert_eq!(shape, want, "{name}");
            // The routers: Mixtral's 8 experts of 14336, two per token, renormalized; Qwen3's
            // 128 of 768, eight per token, renormalized (`norm_topk_prob`), every layer sparse.
            let moe = c.moe.as_ref().map(|m| {
                (
                    m.num_experts,
                    m.top_k,
                    m.renormalize,
                    m.expert_intermediate_size,
                    m.shared_expert_intermediate_size,
                    m.sparse_layers.iter().all(|&s| s),
                )
            });
            let want_moe = match name {
                "mixtral-8x7b" => Some((8, 2, true, 14336, None, true)),
                "qwen3-30b-a3b" => Some((128, 8, true, 768, None, true)),
                _ => None,
            };
            assert_eq!(moe, want_moe, "{name}");
        }
    }

    #[test]
    fn parameter_counts_match_published() {
        for (name, published) in [
            ("llama-3-8b", 8.03e9),
            ("qwen3-8b", 8.19e9),
            ("llama-2-7b", 6.74e9),
            ("llama-2-70b", 68.98e9),
            ("mixtral-8x7b", 46.7e9),
            ("qwen3-30b-a3b", 30.5e9),
        ] {
            let text = shipped_config(name).unwrap();
            let c = ModelConfig::from_hf_json(text, name).unwrap();
            let layout = hf_layout(text, c.arch, name).unwrap();
            let total: usize = model_tensors(&c, &layout)
                .iter()
                .map(|(_, s, _)| s.iter().product::<usize>())
                .sum();
            let rel = (total as f64 - published).abs() / published;
            println!(
                "{name}: {total} parameters ({:.2}% off {published:e})",
                rel * 100.0
            );
            assert!(rel < 0.02, "{name}: {total} parameters vs {published:e}");
        }
    }

    #[test]
    fn every_tensor_is_present_nonzero_and_bf16() {
        let m = tiny();
        let layout = hf_layout(shipped_config("tiny-dummy").unwrap(), m.config.arch, "t").unwrap();
        let list = model_tensors(&m.config, &layout);
        assert_eq!(list.len(), 3 + 9 * 4);
        for (name, shape, _) in list {
            assert!(m.source.contains(&name), "{name}");
            let t = m.source.get(&name).unwrap();
            assert_eq!(t.shape, shape, "{name}");
            assert_eq!(t.format, WeightFormat::Ggml(GgmlType::BF16));
            assert_eq!(t.bytes.len(), 2 * t.elems());
            let v = t.to_f32().unwrap();
            assert!(v.iter().all(|x| x.is_finite() && *x != 0.0), "{name}");
        }
        assert!(
            m.source
                .get("model.layers.0.self_attn.q_proj.bias")
                .is_none()
        );
        assert!(!m.source.contains("model.layers.4.input_layernorm.weight"));
    }

    #[test]
    fn deterministic_per_seed_and_name() {
        let name = "model.layers.1.mlp.up_proj.weight";
        let bytes = |seed| {
            open_dummy("tiny-dummy", seed)
                .unwrap()
                .source
                .get(name)
                .unwrap()
        };
        let (a, b, c) = (bytes(3), bytes(3), bytes(4));
        assert_eq!(&a.bytes[..], &b.bytes[..]);
        assert_ne!(&a.bytes[..], &c.bytes[..]);
        let m = open_dummy("tiny-dummy", 3).unwrap();
        let gate = m.source.get("model.layers.1.mlp.gate_proj.weight").unwrap();
        assert_ne!(
            &a.bytes[..],
            &gate.bytes[..],
            "two tensors of one seed differ"
        );
        // Different bits almost everywhere, not a shifted copy.
        let same = a
            .bytes
            .chunks(2)
            .zip(c.bytes.chunks(2))
            .filter(|(x, y)| x == y)
            .count();
        assert!(
            same * 50 < a.elems(),
            "{same} of {} elements equal",
            a.elems()
        );
    }

    #[test]
    fn scales_are_realistic() {
        let m = tiny();
        let get = |n: &str| m.source.get(n).unwrap().to_f32().unwrap();
        // [256, 704]: std 1/sqrt(704).
        let down = get("model.layers.2.mlp.down_proj.weight");
        let (mean, std) = stats(&down);
        let want = 1.0 / 704f64.sqrt();
        assert!(mean.abs() < 0.02 * want, "mean {mean}");
        assert!((std / want - 1.0).abs() < 0.02, "std {std} vs {want}");
        let (_, std) = stats(&get("model.layers.0.self_attn.q_proj.weight"));
        assert!((std * 16.0 - 1.0).abs() < 0.02, "q_proj std {std}");
        let (mean, std) = stats(&get("model.embed_tokens.weight"));
        assert!(mean.abs() < 1e-3 && (std / EMBED_STD as f64 - 1.0).abs() < 0.02);
        let norm = get("model.layers.3.post_attention_layernorm.weight");
        let (mean, _) = stats(&norm);
        assert!((mean - 1.0).abs() < 0.01, "norm mean {mean}");
        assert!(norm.iter().all(|x| (x - 1.0).abs() <= NORM_SPREAD + 4e-3));
    }

    #[test]
    fn config_path_with_biases_and_qk_norm() {
        let dir = tempfile::tempdir().unwrap();
        let mut v: Value = serde_json::from_str(shipped_config("tiny-dummy").unwrap()).unwrap();
        v["model_type"] = "qwen2".into();
        v["tie_word_embeddings"] = true.into();
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        // A directory or the file itself.
        for p in [dir.path().to_path_buf(), dir.path().join("config.json")] {
            let m = open_dummy(p.to_str().unwrap(), 0).unwrap();
            assert_eq!(m.config.arch, Arch::Qwen2);
            assert!(!m.source.contains("lm_head.weight"));
            let b = m
                .source
                .get("model.layers.0.self_attn.k_proj.bias")
                .unwrap();
            let (_, std) = stats(&b.to_f32().unwrap());
            assert!((std / BIAS_STD as f64 - 1.0).abs() < 0.2, "bias std {std}");
        }
        v["model_type"] = "qwen3".into();
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let m = open_dummy(dir.path().to_str().unwrap(), 0).unwrap();
        assert!(m.source.contains("model.layers.3.self_attn.k_norm.weight"));
        assert!(!m.source.contains("model.layers.0.self_attn.q_proj.bias"));
    }

    #[test]
    fn unknown_name_lists_shipped_configs() {
        let Err(e) = open_dummy("llama-9-70b", 0) else {
            panic!("an unknown name opened")
        };
        let msg = e.to_string();
        for (name, _) in SHIPPED_CONFIGS {
            assert!(msg.contains(name), "{msg}");
        }
        assert!(msg.contains("llama-9-70b"), "{msg}");
    }

    #[test]
    fn tokenizer_encodes_anything_and_decodes_printably() {
        let m = tiny();
        let tok = &m.tokenizer;
        assert_eq!(tok.vocab_size(), 512);
        assert!(tok.eos_ids.is_empty() && tok.chat_template.is_none());
        let text = "Hello, world!\n  naïve café — 日本語 🦀\ttabs";
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids.len(), text.len(), "one id per byte");
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        for id in 0..512u32 {
            let s = tok.decode(&[id], true).unwrap();
            assert!(!s.is_empty(), "id {id}");
            assert!(
                s.chars().all(|c| !c.is_control() || c == '\n' || c == '\t'),
                "id {id} decodes to {s:?}"
            );
        }
        assert_eq!(tok.decode(&[300, 32], true).unwrap(), "<t300> ");
        assert!(byte_level_tokenizer(255).is_err());
    }

    #[test]
    fn big_tensor_generation_time() {
        let m = open_dummy("llama-3-8b", 0).unwrap();
        let start = std::time::Instant::now();
        let t = m.source.get("model.layers.0.mlp.down_proj.weight").unwrap();
        let took = start.elapsed();
        assert_eq!(t.shape, [4096, 14336]);
        println!(
            "4096x14336 BF16 tensor generated in {:.3} s on {} threads",
            took.as_secs_f64(),
            rayon::current_num_threads(),
        );
        let v = t.to_f32().unwrap();
        let (mean, std) = stats(&v[..1 << 20]);
        let want = 1.0 / 14336f64.sqrt();
        assert!(mean.abs() < 0.02 * want && (std / want - 1.0).abs() < 0.02);
    }

    #[test]
    fn a_precision_suffix_quantizes_the_block_linears() {
        let files = open_dummy("tiny-dummy:w8a8", 1).unwrap();
        let q = files
            .source
            .get("model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.format.to_string(), "int8-pc/a8");
        let e = files.source.get("model.embed_tokens.weight").unwrap();
        assert_eq!(e.format, WeightFormat::Ggml(GgmlType::BF16));
        assert!(open_dummy("tiny-dummy:w9a9", 1).is_err());
    }
}

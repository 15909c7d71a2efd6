//! Model hyper-parameters, read from a GGUF file's metadata or a Hugging Face `config.json`, and
//! the rotary-embedding frequencies they imply.

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgufFile;
use serde_json::Value;

/// The decoder-only architectures nibble runs; they differ only in the switches on `ModelConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Mistral with a sparse feed-forward in every layer.
    Mixtral,
    /// Qwen2 with sparse feed-forwards and a gated shared expert.
    Qwen2Moe,
    /// Qwen3 with sparse feed-forwards.
    Qwen3Moe,
    /// Gemma 3 (text): QK norms, GeGLU, four norms per layer with Gemma's `(1 + w)` scale,
    /// a scaled embedding, and sliding-window layers with their own rotary base.
    Gemma3,
}

impl Arch {
    fn from_name(name: &str, origin: &str) -> Result<Self> {
        Ok(match name {
            "llama" | "LlamaForCausalLM" => Arch::Llama,
            "mistral" | "MistralForCausalLM" => Arch::Mistral,
            "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
            "qwen3" | "Qwen3ForCausalLM" => Arch::Qwen3,
            "mixtral" | "MixtralForCausalLM" => Arch::Mixtral,
            "qwen2_moe" | "qwen2moe" | "Qwen2MoeForCausalLM" => Arch::Qwen2Moe,
            "qwen3_moe" | "qwen3moe" | "Qwen3MoeForCausalLM" => Arch::Qwen3Moe,
            "gemma3" | "gemma3_text" | "Gemma3ForCausalLM" => Arch::Gemma3,
            other => {
                return Err(Error::unsupported(
                    format!("architecture '{other}' (from {origin})"),
                    "nibble runs llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe \
                     and gemma3",
                ));
            }
        })
    }
}

/// How the two halves of each rotated pair sit in a head vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (i, i + d/2): Hugging Face's `rotate_half`, GGUF NeoX-style architectures.
    HalfSplit,
    /// Pairs (2i, 2i + 1): the original Meta layout that llama-arch GGUF files keep.
    Interleaved,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (all frequencies scaled alike).
    Linear {
        factor: f64,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    /// Per-frequency divisors given explicitly (GGUF `rope_freqs.weight`).
    FreqFactors(Vec<f32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub rope_layout: RopeLayout,
    pub max_context: usize,
    /// The sparse feed-forward of mixture-of-experts models; `None` for dense ones.
    pub moe: Option<MoeConfig>,
    /// Sliding-window attention in some or all layers; `None`: every layer sees the whole context.
    pub sliding_window: Option<SlidingWindow>,
    /// Gemma 3's switches; `None` for the other architectures.
    pub gemma: Option<GemmaConfig>,
}

/// Sliding-window attention: in the layers marked, a query at position `p` attends to the keys
/// at positions `p + 1 - size ..= p` only (Hugging Face's and llama.cpp's `p - j < size`).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub size: usize,
    /// Per layer, whether it attends within the window.
    pub layers: Vec<bool>,
}

/// What Gemma 3 does beyond the Llama stack that is a number rather than a tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// Attention logits are scaled by `query_pre_attn_scalar^-1/2`, not `head_dim^-1/2`.
    pub query_pre_attn_scalar: f64,
    /// Rotary base of the sliding-window layers, never scaled; the global layers use
    /// `rope_theta` with `rope_scaling`.
    pub rope_local_theta: f64,
}

/// A sparse feed-forward: a router picks `top_k` of `num_experts` expert MLPs per token (softmax
/// in f32 over all experts, the `top_k` largest probabilities), whose outputs are summed weighted
/// by those probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    /// The chosen probabilities are divided by their sum (Mixtral always; Qwen when
    /// `norm_topk_prob`). Otherwise they are used as they are, summing to less than one.
    pub renormalize: bool,
    /// Hidden width of each routed expert.
    pub expert_intermediate_size: usize,
    /// Qwen2-MoE's shared expert, run for every token and scaled by
    /// `sigmoid(shared_expert_gate · x)`: its hidden width.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per layer, whether its feed-forward is sparse; the others are dense MLPs of
    /// `intermediate_size` (Qwen's `decoder_sparse_step` and `mlp_only_layers`).
    pub sparse_layers: Vec<bool>,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch_name = file.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name, &file.path().display().to_string())?;
        let key = |k: &str| format!("{arch_name}.{k}");
        // llama.cpp writes Mixtral as a llama-arch file with experts.
        let arch = match file.metadata(&key("expert_count")).and_then(|v| v.as_u64()) {
            Some(n) if n > 0 && matches!(arch, Arch::Llama | Arch::Mistral) => Arch::Mixtral,
            _ => arch,
        };
        let hidden_size = file.get_u64(&key("embedding_length"))? as usize;
        let num_heads = file.get_u64(&key("attention.head_count"))? as usize;
        let num_kv_heads = match file.metadata(&key("attention.head_count_kv")) {
            Some(_) => file.get_u64(&key("attention.head_count_kv"))? as usize,
            None => num_heads,
        };
        let head_dim = match file.metadata(&key("attention.key_length")) {
            Some(_) => file.get_u64(&key("attention.key_length"))? as usize,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let vocab_size = match file.metadata(&key("vocab_size")) {
            Some(_) => file.get_u64(&key("vocab_size"))? as usize,
            None => file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_scaling = if let Some(t) = file.tensor("rope_freqs.weight") {
            let mut factors = vec![0f32; t.elems()];
            nibble_formats::gguf::dequant::dequantize(t.ty, file.tensor_bytes(t), &mut factors)?;
            RopeScaling::FreqFactors(factors)
        } else {
            match file
                .metadata(&key("rope.scaling.type"))
                .and_then(|v| v.as_str())
            {
                None | Some("none") => RopeScaling::None,
                Some("linear") => RopeScaling::Linear {
                    factor: file.get_f64(&key("rope.scaling.factor"))?,
                },
                Some(other) => {
                    return Err(Error::unsupported(
                        format!("rope scaling '{other}' in {}", file.path().display()),
                        "supported: none, linear, llama3 (rope_freqs.weight)",
                    ));
                }
            }
        };
        if let Some(v) = file.metadata(&key("rope.dimension_count"))
            && v.as_u64() != Some(head_dim as u64)
        {
            return Err(Error::unsupported(
                format!("partial rotary embedding ({v:?} of {head_dim} dims)"),
                "nibble rotates the whole head",
            ));
        }
        let mut cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: file.get_u64(&key("feed_forward_length"))? as usize,
            num_layers: file.get_u64(&key("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: file.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: match file.metadata(&key("rope.freq_base")) {
                Some(_) => file.get_f64(&key("rope.freq_base"))?,
                None => 10_000.0,
            },
            rope_scaling,
            // Llama-arch GGUF files store Q/K rows permuted for the interleaved layout; the loader
            // un-permutes them so one layout serves every source (see `weights::unpermute_qk`).
            rope_layout: RopeLayout::HalfSplit,
            max_context: match file.metadata(&key("context_length")) {
                Some(_) => file.get_u64(&key("context_length"))? as usize,
                None => 2048,
            },
            moe: None,
            sliding_window: None,
            gemma: None,
        };
        cfg.moe = moe_from_gguf(file, arch, cfg.num_layers, cfg.intermediate_size)?;
        if arch == Arch::Gemma3 {
            gemma_from_gguf(file, &mut cfg)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a Hugging Face `config.json`; `origin` names the file in errors.
    pub fn from_hf_json(text: &str, origin: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("{origin} is not valid JSON: {e}")))?;
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| v.get("architectures")?.get(0)?.as_str())
            .ok_or_else(|| Error::Config(format!("{origin} has no model_type")))?;
        let arch = Arch::from_name(model_type, origin)?;
        let get = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| Error::Config(format!("{origin}: '{k}' missing or not an integer")))
        };
        let opt = |k: &str| v.get(k).filter(|x| !x.is_null());
        let hidden_size = get("hidden_size")?;
        let num_heads = get("num_attention_heads")?;
        let num_kv_heads = if opt("num_key_value_heads").is_some() {
            get("num_key_value_heads")?
        } else {
            num_heads
        };
        let head_dim = if opt("head_dim").is_some() {
            get("head_dim")?
        } else {
            hidden_size / num_heads.max(1)
        };
        let f = |k: &str, default: f64| opt(k).and_then(Value::as_f64).unwrap_or(default);
        let rope_scaling = match opt("rope_scaling") {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let sf = |k: &str| -> Result<f64> {
                    s.get(k)
                        .and_then(Value::as_f64)
                        .ok_or_else(|| Error::Config(format!("{origin}: rope_scaling.{k} missing")))
                };
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear {
                        factor: sf("factor")?,
                    },
                    "llama3" => RopeScaling::Llama3 {
                        factor: sf("factor")?,
                        low_freq_factor: sf("low_freq_factor")?,
                        high_freq_factor: sf("high_freq_factor")?,
                        original_max_position: sf("original_max_position_embeddings")?,
                    },
                    other => {
                        return Err(Error::unsupported(
                            format!("rope scaling '{other}' in {origin}"),
                            "supported: default, linear, llama3",
                        ));
                    }
                }
            }
        };
        let mut cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: get("intermediate_size")?,
            num_layers: get("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: get("vocab_size")?,
            rms_norm_eps: f("rms_norm_eps", 1e-6) as f32,
            rope_theta: f("rope_theta", 10_000.0),
            rope_scaling,
            rope_layout: RopeLayout::HalfSplit,
            max_context: opt("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(2048) as usize,
            moe: None,
            sliding_window: None,
            gemma: None,
        };
        cfg.moe = moe_from_hf(&v, arch, cfg.num_layers, origin)?;
        let n = cfg.num_layers;
        cfg.sliding_window = match arch {
            Arch::Gemma3 => {
                gemma_from_hf(&v, &mut cfg, origin)?;
                cfg.sliding_window
            }
            // Mistral's window applies to every layer when the config names one.
            Arch::Mistral | Arch::Mixtral => opt("sliding_window")
                .map(|_| get("sliding_window"))
                .transpose()?
                .map(|size| SlidingWindow {
                    size,
                    layers: vec![true; n],
                }),
            // Qwen's window is off unless `use_sliding_window`, and then only in the layers from
            // `max_window_layers` on (Hugging Face's `layer_types`).
            _ if opt("use_sliding_window").and_then(Value::as_bool) == Some(true) => {
                let size = get("sliding_window")?;
                let from = get("max_window_layers")?;
                Some(SlidingWindow {
                    size,
                    layers: (0..n).map(|i| i >= from).collect(),
                })
            }
            _ => None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A Hugging Face `config.json` for this model that [`ModelConfig::from_hf_json`] reads back
    /// to an equal config. `layout` says what nibble learns from the tensors and HF must be told
    /// (tied head, QKV biases, QK norms); combinations the architecture's HF class cannot express
    /// are refused rather than written as a config HF would load wrongly.
    pub fn to_hf_json(&self, layout: &TensorLayout) -> Result<Value> {
        let (class, model_type) = match self.arch {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Mistral => ("MistralForCausalLM", "mistral"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Arch::Mixtral => ("MixtralForCausalLM", "mixtral"),
            Arch::Qwen2Moe => ("Qwen2MoeForCausalLM", "qwen2_moe"),
            Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        };
        let refuse = |why: &str| {
            Err(Error::unsupported(
                format!("a {model_type} model {why}"),
                "its Hugging Face config class has no switch for that",
            ))
        };
        match self.arch {
            Arch::Qwen2 | Arch::Qwen2Moe if !layout.attention_bias => {
                return refuse("without Q/K/V biases");
            }
            Arch::Mistral | Arch::Mixtral if layout.attention_bias => {
                return refuse("with Q/K/V biases");
            }
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 if !layout.qk_norm => {
                return refuse("without per-head Q/K norms");
            }
            Arch::Gemma3 if layout.attention_bias => {
                return refuse("with Q/K/V biases");
            }
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Mixtral | Arch::Qwen2Moe
                if layout.qk_norm =>
            {
                return refuse("with per-head Q/K norms");
            }
            _ => {}
        }
        if self.rope_layout != RopeLayout::HalfSplit {
            return Err(Error::unsupported(
                "an interleaved rotary layout in a Hugging Face config",
                "HF models rotate half-split pairs; un-permute Q/K rows first",
            ));
        }
        let rope_scaling = match &self.rope_scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "type": "linear", "factor": factor})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => llama3_json(
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_position,
            ),
            RopeScaling::FreqFactors(f) => match self.llama3_params_of(f) {
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position,
                }) => llama3_json(
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position,
                ),
                _ => {
                    return Err(Error::unsupported(
                        "per-frequency rotary factors (GGUF rope_freqs.weight) that are not \
                         Llama 3 scaling",
                        "a Hugging Face config can only name linear or llama3 rotary scaling",
                    ));
                }
            },
        };
        // The shortest decimal that reads back as the same f32, so the JSON shows 1e-06, not
        // 9.999999974752427e-07.
        let eps: f64 = self.rms_norm_eps.to_string().parse().unwrap_or(1e-6);
        let mut v = serde_json::json!({
            "architectures": [class],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_context,
            "tie_word_embeddings": layout.tie_word_embeddings,
            "hidden_act": "silu",
        });
        let o = v.as_object_mut().expect("a JSON object literal");
        let window = |o: &mut serde_json::Map<String, Value>| {
            o.insert(
                "sliding_window".into(),
                self.sliding_window.as_ref().map(|w| w.size).into(),
            );
        };
        // A window HF cannot express (Mistral's in some layers only) is refused, never dropped.
        let every_layer = self
            .sliding_window
            .as_ref()
            .is_none_or(|w| w.layers.iter().all(|&l| l));
        match self.arch {
            Arch::Llama => {
                o.insert("attention_bias".into(), layout.attention_bias.into());
                o.insert("mlp_bias".into(), false.into());
            }
            Arch::Mistral | Arch::Mixtral if !every_layer => {
                return refuse("with a sliding window in some layers only");
            }
            Arch::Mistral | Arch::Mixtral => window(o),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe => {
                if self.arch == Arch::Qwen3 || self.arch == Arch::Qwen3Moe {
                    o.insert("attention_bias".into(), layout.attention_bias.into());
                }
                match &self.sliding_window {
                    None => {
                        o.insert("sliding_window".into(), Value::Null);
                        o.insert("use_sliding_window".into(), false.into());
                    }
                    Some(w) => {
                        // HF windows the layers from max_window_layers on; nothing else.
                        let from = w.layers.iter().position(|&l| l).unwrap_or(self.num_layers);
                        if w.layers[from..].iter().any(|&l| !l) {
                            return refuse("with sliding-window layers that are not the last ones");
                        }
                        window(o);
                        o.insert("use_sliding_window".into(), true.into());
                        o.insert("max_window_layers".into(), from.into());
                    }
                }
            }
            Arch::Gemma3 => {
                let (Some(g), Some(w)) = (&self.gemma, &self.sliding_window) else {
                    return refuse("without its sliding-window and scaling parameters");
                };
                window(o);
                let types: Vec<&str> = w
                    .layers
                    .iter()
                    .map(|&l| {
                        if l {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                o.insert("layer_types".into(), types.into());
                o.insert(
                    "query_pre_attn_scalar".into(),
                    g.query_pre_attn_scalar.into(),
                );
                o.insert("rope_local_base_freq".into(), g.rope_local_theta.into());
                o.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
                o.remove("hidden_act");
                o.insert("final_logit_softcapping".into(), Value::Null);
                o.insert("attn_logit_softcapping".into(), Value::Null);
                o.insert("attention_bias".into(), false.into());
            }
        }
        if let Some(m) = &self.moe {
            let dense: Vec<usize> = (0..self.num_layers)
                .filter(|&i| !m.sparse_layers.get(i).copied().unwrap_or(false))
                .collect();
            o.insert("num_experts_per_tok".into(), m.top_k.into());
            if self.arch == Arch::Mixtral {
                if !m.renormalize
                    || !dense.is_empty()
                    || m.shared_expert_intermediate_size.is_some()
                    || m.expert_intermediate_size != self.intermediate_size
                {
                    return refuse(
                        "with a router, dense layers or expert widths other than Mixtral's",
                    );
                }
                o.insert("num_local_experts".into(), m.num_experts.into());
            } else {
                o.insert("num_experts".into(), m.num_experts.into());
                o.insert("norm_topk_prob".into(), m.renormalize.into());
                o.insert(
                    "moe_intermediate_size".into(),
                    m.expert_intermediate_size.into(),
                );
                o.insert("decoder_sparse_step".into(), 1.into());
                o.insert("mlp_only_layers".into(), dense.into());
                match (self.arch, m.shared_expert_intermediate_size) {
                    (Arch::Qwen2Moe, Some(s)) => {
                        o.insert("shared_expert_intermediate_size".into(), s.into());
                    }
                    (Arch::Qwen3Moe, None) => {}
                    _ => return refuse("with a shared expert layout its class lacks"),
                }
            }
        }
        Ok(v)
    }

    /// The Llama 3 parameters that llama.cpp's converter turned into `factors`, if they are the
    /// published ones (low 1, high 4, original context 8192; the factor is the largest divisor).
    fn llama3_params_of(&self, factors: &[f32]) -> Option<RopeScaling> {
        let factor = factors.iter().copied().fold(f32::NAN, f32::max) as f64;
        if !factor.is_finite() || factors.len() != self.head_dim / 2 {
            return None;
        }
        let candidate = RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        };
        let as_llama3 = ModelConfig {
            rope_scaling: candidate.clone(),
            ..self.clone()
        };
        let as_factors = ModelConfig {
            rope_scaling: RopeScaling::FreqFactors(factors.to_vec()),
            ..self.clone()
        };
        let same = as_llama3
            .rope_inv_freq()
            .iter()
            .zip(as_factors.rope_inv_freq())
            .all(|(a, b)| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()));
        same.then_some(candidate)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return bad(format!(
                "heads ({}), kv heads ({}) and layers ({}) must be positive",
                self.num_heads, self.num_kv_heads, self.num_layers
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads are not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head dim {} must be even and positive",
                self.head_dim
            ));
        }
        if self.hidden_size == 0 || self.intermediate_size == 0 || self.vocab_size == 0 {
            return bad("hidden, intermediate and vocab sizes must be positive".into());
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps {} must be positive",
                self.rms_norm_eps
            ));
        }
        if let Some(w) = &self.sliding_window {
            if w.size == 0 {
                return bad("a sliding window of 0 tokens".into());
            }
            if w.layers.len() != self.num_layers {
                return bad(format!(
                    "{} layers but {} sliding-window flags",
                    self.num_layers,
                    w.layers.len()
                ));
            }
        }
        if (self.arch == Arch::Gemma3) != self.gemma.is_some() {
            return bad(format!(
                "a {:?} model {} Gemma 3's parameters",
                self.arch,
                if self.gemma.is_some() {
                    "with"
                } else {
                    "without"
                }
            ));
        }
        let sparse_arch = matches!(self.arch, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe);
        match &self.moe {
            None if sparse_arch => {
                return bad(format!(
                    "a {:?} model needs its experts described",
                    self.arch
                ));
            }
            Some(_) if !sparse_arch => {
                return bad(format!("a {:?} model has no experts", self.arch));
            }
            Some(m) if m.sparse_layers.len() != self.num_layers => {
                return bad(format!(
                    "{} layers but {} sparse-layer flags",
                    self.num_layers,
                    m.sparse_layers.len()
                ));
            }
            _ => {}
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The window of layer `i`'s attention, if it has one.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .filter(|w| w.layers.get(i).copied().unwrap_or(false))
            .map(|w| w.size)
    }

    /// Rotary inverse frequencies of layer `i`: Gemma 3's sliding-window layers rotate with
    /// their own base and no scaling; every other layer with [`ModelConfig::rope_inv_freq`].
    pub fn layer_rope_inv_freq(&self, i: usize) -> Vec<f32> {
        match &self.gemma {
            Some(g) if self.layer_window(i).is_some() => {
                inv_freq(self.head_dim, g.rope_local_theta, &RopeScaling::None)
            }
            _ => self.rope_inv_freq(),
        }
    }

    /// Rotary inverse frequencies, one per rotated pair, with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        inv_freq(self.head_dim, self.rope_theta, &self.rope_scaling)
    }
}

fn inv_freq(d: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    (0..d / 2)
        .map(|i| {
            let base = theta.powf(-((2 * i) as f64) / d as f64);
            let scaled = match scaling {
                RopeScaling::None => base,
                RopeScaling::Linear { factor } => base / factor,
                RopeScaling::FreqFactors(f) => base / f.get(i).copied().unwrap_or(1.0) as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    let low_wavelen = original_max_position / low_freq_factor;
                    let high_wavelen = original_max_position / high_freq_factor;
                    if wavelen < high_wavelen {
                        base
                    } else if wavelen > low_wavelen {
                        base / factor
                    } else {
                        let smooth = (original_max_position / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            scaled as f32
        })
        .collect()
}

/// Gemma 3's numbers from a GGUF file as llama.cpp reads them: the window
/// (`gemma3.attention.sliding_window`, required), every sixth layer global unless
/// `gemma3.attention.sliding_window_pattern` says otherwise, a local rotary base of 10000 unless
/// `gemma3.rope.freq_base_swa` is there, and the attention scale llama.cpp derives (GGUF has no
/// `query_pre_attn_scalar`): `head_dim`, except for the 27B model, whose published scalar is
/// `hidden / heads` (168).
fn gemma_from_gguf(file: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    let origin = file.path().display().to_string();
    let key = |k: &str| format!("gemma3.{k}");
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = file.metadata(&key(k)) {
            return Err(Error::unsupported(
                format!("{} = {v:?} in {origin}", key(k)),
                "Gemma 3 has no logit soft-capping; nibble does not implement it",
            ));
        }
    }
    let size = file.get_u64(&key("attention.sliding_window"))? as usize;
    let n = cfg.num_layers;
    let pattern_key = key("attention.sliding_window_pattern");
    let layers = match file.metadata(&pattern_key) {
        None => gemma_pattern(n, 6),
        Some(v) => match v.as_u64() {
            Some(period) if period > 0 => gemma_pattern(n, period as usize),
            _ => {
                return Err(Error::Config(format!(
                    "{origin}: {pattern_key} is {v:?}, not a positive layer period"
                )));
            }
        },
    };
    let rope_local_theta = match file.metadata(&key("rope.freq_base_swa")) {
        Some(_) => file.get_f64(&key("rope.freq_base_swa"))?,
        None => 10_000.0,
    };
    let query_pre_attn_scalar = if cfg.num_layers == 62 && cfg.hidden_size == 5376 {
        (cfg.hidden_size / cfg.num_heads) as f64
    } else {
        cfg.head_dim as f64
    };
    cfg.sliding_window = Some(SlidingWindow { size, layers });
    cfg.gemma = Some(GemmaConfig {
        query_pre_attn_scalar,
        rope_local_theta,
    });
    Ok(())
}

/// Layers `0..n` with every `period`-th one global (Gemma 3: five local layers, then one global).
fn gemma_pattern(n: usize, period: usize) -> Vec<bool> {
    (0..n).map(|i| !(i + 1).is_multiple_of(period)).collect()
}

/// Gemma 3's fields of a Hugging Face `config.json` (`gemma3_text`), each required and named
/// when missing: `query_pre_attn_scalar`, `sliding_window`, `rope_local_base_freq`, and the layer
/// pattern as `layer_types` or (older configs) `sliding_window_pattern`.
fn gemma_from_hf(v: &Value, cfg: &mut ModelConfig, origin: &str) -> Result<()> {
    let opt = |k: &str| v.get(k).filter(|x| !x.is_null());
    let missing = |k: &str, what: &str| {
        Error::Config(format!(
            "{origin}: '{k}' missing or not {what} (a Gemma 3 config needs it)"
        ))
    };
    let num = |k: &str| {
        opt(k)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| missing(k, "a positive number"))
    };
    if v.get("text_config").is_some() {
        return Err(Error::unsupported(
            format!("a multimodal Gemma 3 checkpoint ({origin})"),
            "nibble runs the text-only Gemma 3 models (model_type gemma3_text)",
        ));
    }
    for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(x) = opt(k) {
            return Err(Error::unsupported(
                format!("{k} = {x} in {origin}"),
                "Gemma 3 has no logit soft-capping; nibble does not implement it",
            ));
        }
    }
    let act = opt("hidden_activation")
        .or_else(|| opt("hidden_act"))
        .and_then(Value::as_str);
    if act != Some("gelu_pytorch_tanh") {
        return Err(Error::unsupported(
            format!("Gemma 3 hidden_activation {act:?} in {origin}"),
            "nibble's GeGLU uses gelu_pytorch_tanh, as every Gemma 3 does",
        ));
    }
    if opt("head_dim").is_none() {
        return Err(missing("head_dim", "an integer"));
    }
    let query_pre_attn_scalar = num("query_pre_attn_scalar")?;
    let rope_local_theta = num("rope_local_base_freq")?;
    let size = opt("sliding_window")
        .and_then(Value::as_u64)
        .filter(|&w| w > 0)
        .ok_or_else(|| missing("sliding_window", "a positive integer"))? as usize;
    let n = cfg.num_layers;
    let layers = if let Some(types) = opt("layer_types") {
        let bad = || {
            Error::Config(format!(
                "{origin}: 'layer_types' must list {n} of \"sliding_attention\" or \
                 \"full_attention\""
            ))
        };
        let list = types.as_array().filter(|l| l.len() == n).ok_or_else(bad)?;
        list.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(bad()),
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        let period = opt("sliding_window_pattern")
            .and_then(Value::as_u64)
            .filter(|&p| p > 0)
            .ok_or_else(|| missing("layer_types' or 'sliding_window_pattern", "given"))?;
        gemma_pattern(n, period as usize)
    };
    cfg.sliding_window = Some(SlidingWindow { size, layers });
    cfg.gemma = Some(GemmaConfig {
        query_pre_attn_scalar,
        rope_local_theta,
    });
    Ok(())
}

/// The sparse feed-forward a Hugging Face config of a mixture-of-experts architecture describes
/// (`None` for dense architectures), with every count checked: a router or expert layout nibble
/// does not implement is refused, naming the field, rather than run as something else.
/// The sparse feed-forward of a GGUF file as llama.cpp writes it: `<arch>.expert_count`,
/// `expert_used_count`, `expert_feed_forward_length` (Mixtral: `feed_forward_length`) and, for
/// Qwen2-MoE, `expert_shared_feed_forward_length`. llama.cpp renormalizes the chosen
/// probabilities for Mixtral and Qwen3-MoE and not for Qwen2-MoE, unless
/// `expert_weights_norm` says otherwise. Every layer is sparse except one with no router
/// (`blk.N.ffn_gate_inp.weight`) but a dense `blk.N.ffn_up.weight`.
fn moe_from_gguf(
    file: &GgufFile,
    arch: Arch,
    num_layers: usize,
    intermediate_size: usize,
) -> Result<Option<MoeConfig>> {
    let arch_name = file.get_str("general.architecture")?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let origin = file.path().display().to_string();
    let bad = |m: String| Err(Error::Config(format!("{origin}: {m}")));
    let renormalize = match arch {
        Arch::Mixtral | Arch::Qwen3Moe => true,
        Arch::Qwen2Moe => false,
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => {
            return match file.metadata(&key("expert_count")).and_then(|v| v.as_u64()) {
                Some(n) if n > 0 => Err(Error::unsupported(
                    format!(
                        "a mixture-of-experts {arch_name} GGUF file ({} = {n} in {origin})",
                        key("expert_count")
                    ),
                    "nibble runs mixture-of-experts GGUF files of architecture llama \
                     (Mixtral), qwen2moe and qwen3moe",
                )),
                _ => Ok(None),
            };
        }
    };
    let renormalize = match file.metadata(&key("expert_weights_norm")) {
        Some(v) => match v.as_bool() {
            Some(b) => b,
            None => {
                return bad(format!(
                    "{} is {v:?}, not a boolean",
                    key("expert_weights_norm")
                ));
            }
        },
        None => renormalize,
    };
    if let Some(v) = file.metadata(&key("expert_gating_func"))
        && v.as_u64() != Some(1)
    {
        return Err(Error::unsupported(
            format!(
                "router gating function {v:?} ({}) in {origin}",
                key("expert_gating_func")
            ),
            "nibble's router is a softmax over all experts (gating function 1)",
        ));
    }
    let num_experts = file.get_u64(&key("expert_count"))? as usize;
    let top_k = file.get_u64(&key("expert_used_count"))? as usize;
    let expert_intermediate_size = match arch {
        Arch::Mixtral => intermediate_size,
        _ => file.get_u64(&key("expert_feed_forward_length"))? as usize,
    };
    let shared_expert_intermediate_size = match arch {
        Arch::Qwen2Moe => Some(file.get_u64(&key("expert_shared_feed_forward_length"))? as usize),
        _ => None,
    };
    if num_experts == 0 {
        return bad(format!(
            "{} is 0: a {arch:?} model needs experts",
            key("expert_count")
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return bad(format!(
            "{} is {top_k}: it must be between 1 and {} ({num_experts})",
            key("expert_used_count"),
            key("expert_count")
        ));
    }
    if expert_intermediate_size == 0 || shared_expert_intermediate_size == Some(0) {
        return bad("an expert feed-forward length is 0".into());
    }
    let sparse_layers = (0..num_layers)
        .map(|i| {
            file.tensor(&format!("blk.{i}.ffn_gate_inp.weight"))
                .is_some()
                || file.tensor(&format!("blk.{i}.ffn_up.weight")).is_none()
        })
        .collect();
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        renormalize,
        expert_intermediate_size,
        shared_expert_intermediate_size,
        sparse_layers,
    }))
}

fn moe_from_hf(
    v: &Value,
    arch: Arch,
    num_layers: usize,
    origin: &str,
) -> Result<Option<MoeConfig>> {
    let bad = |m: String| Err(Error::Config(format!("{origin}: {m}")));
    let opt = |k: &str| v.get(k).filter(|x| !x.is_null());
    let count = |k: &str| -> Result<usize> {
        opt(k)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{origin}: '{k}' missing or not an integer (a {arch:?} model needs it)"
                ))
            })
    };
    let flag = |k: &str| -> Result<bool> {
        match opt(k) {
            None => Ok(false),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| Error::Config(format!("{origin}: '{k}' is not a boolean"))),
        }
    };
    let (experts_key, renormalize, ff_key, shared) = match arch {
        // Mixtral's router always renormalizes the chosen probabilities.
        Arch::Mixtral => ("num_local_experts", true, "intermediate_size", None),
        Arch::Qwen2Moe => (
            "num_experts",
            flag("norm_topk_prob")?,
            "moe_intermediate_size",
            Some(count("shared_expert_intermediate_size")?),
        ),
        Arch::Qwen3Moe => (
            "num_experts",
            flag("norm_topk_prob")?,
            "moe_intermediate_size",
            None,
        ),
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => {
            return Ok(None);
        }
    };
    // Other routers (DeepSeek's sigmoid scoring, grouped top-k) pick different experts.
    if let Some(f) = opt("scoring_func")
        && f.as_str() != Some("softmax")
    {
        return Err(Error::unsupported(
            format!("router scoring_func {f} in {origin}"),
            "nibble's router is a softmax over all experts",
        ));
    }
    if let Some(m) = opt("topk_method")
        && m.as_str() != Some("greedy")
    {
        return Err(Error::unsupported(
            format!("router topk_method {m} in {origin}"),
            "nibble's router takes the top-k experts over all of them (greedy)",
        ));
    }
    let num_experts = count(experts_key)?;
    let top_k = count("num_experts_per_tok")?;
    let expert_intermediate_size = count(ff_key)?;
    if num_experts == 0 {
        return bad(format!(
            "'{experts_key}' is 0: a {arch:?} model needs experts"
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return bad(format!(
            "'num_experts_per_tok' is {top_k}: it must be between 1 and {experts_key} ({num_experts})"
        ));
    }
    if expert_intermediate_size == 0 {
        return bad(format!("'{ff_key}' is 0"));
    }
    if shared == Some(0) {
        return bad("'shared_expert_intermediate_size' is 0".into());
    }
    let sparse_layers = if arch == Arch::Mixtral {
        vec![true; num_layers]
    } else {
        // Hugging Face: layer i is sparse unless listed in mlp_only_layers, and only when
        // (i + 1) is a multiple of decoder_sparse_step.
        let step = if opt("decoder_sparse_step").is_some() {
            count("decoder_sparse_step")?
        } else {
            1
        };
        if step == 0 {
            return bad("'decoder_sparse_step' is 0".into());
        }
        let mut dense = Vec::new();
        if let Some(list) = opt("mlp_only_layers") {
            let items = list.as_array().ok_or_else(|| {
                Error::Config(format!("{origin}: 'mlp_only_layers' is not a list"))
            })?;
            for x in items {
                match x.as_u64() {
                    Some(i) if (i as usize) < num_layers => dense.push(i as usize),
                    _ => {
                        return bad(format!(
                            "'mlp_only_layers' holds {x}, not a layer index below {num_layers}"
                        ));
                    }
                }
            }
        }
        (0..num_layers)
            .map(|i| !dense.contains(&i) && (i + 1).is_multiple_of(step))
            .collect()
    };
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        renormalize,
        expert_intermediate_size,
        shared_expert_intermediate_size: shared,
        sparse_layers,
    }))
}

/// What a Hugging Face config states and nibble instead reads off the tensors that exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TensorLayout {
    /// No `lm_head.weight`: the output head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// `self_attn.{q,k,v}_proj.bias` exist.
    pub attention_bias: bool,
    /// `self_attn.{q,k}_norm.weight` exist.
    pub qk_norm: bool,
}

impl TensorLayout {
    /// Reads the layout off a model's (Hugging Face) tensor names.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut layout = TensorLayout {
            tie_word_embeddings: true,
            ..Default::default()
        };
        for n in names {
            if n == "lm_head.weight" {
                layout.tie_word_embeddings = false;
            } else if n.ends_with("self_attn.q_proj.bias") {
                layout.attention_bias = true;
            } else if n.ends_with("self_attn.q_norm.weight") {
                layout.qk_norm = true;
            }
        }
        layout
    }
}

fn llama3_json(factor: f64, low: f64, high: f64, original_max_position: f64) -> Value {
    serde_json::json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        // HF reads this as a context length: an integer when it is one.
        "original_max_position_embeddings": if original_max_position.fract() == 0.0
            && original_max_position.abs() < 9e15
        {
            Value::from(original_max_position as i64)
        } else {
            Value::from(original_max_position)
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(extra: &str) -> String {
        format!(
            r#"{{"model_type":"llama","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300{extra}}}"#
        )
    }

    #[test]
    fn hf_defaults() {
        let c = ModelConfig::from_hf_json(&hf(""), "config.json").unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
        assert_eq!(c.kv_dim(), 32);
    }

    #[test]
    fn unknown_arch_is_named() {
        let text = hf("").replace("\"llama\"", "\"gpt_neox\"");
        let e = ModelConfig::from_hf_json(&text, "x/config.json").unwrap_err();
        assert!(e.to_string().contains("gpt_neox"), "{e}");
    }

    #[test]
    fn bad_heads_rejected() {
        let text = hf("").replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
        assert!(ModelConfig::from_hf_json(&text, "c").is_err());
        assert!(ModelConfig::from_hf_json("{not json", "c").is_err());
    }

    #[test]
    fn sliding_windows_are_read_per_layer() {
        let mistral = hf(r#","max_position_embeddings":32768,"sliding_window":4096"#)
            .replace("\"llama\"", "\"mistral\"");
        let c = ModelConfig::from_hf_json(&mistral, "c").unwrap();
        // The window no longer caps the context: attention masks what lies outside it.
        assert_eq!(c.max_context, 32768);
        assert_eq!(
            (c.layer_window(0), c.layer_window(1)),
            (Some(4096), Some(4096))
        );
        let back = c.to_hf_json(&TensorLayout::default()).unwrap();
        assert_eq!(back["sliding_window"], 4096);
        assert_eq!(
            ModelConfig::from_hf_json(&back.to_string(), "c").unwrap(),
            c
        );
        // Qwen2 configs carry a window that is off unless use_sliding_window says otherwise,
        // and then it covers the layers from max_window_layers on.
        let qwen = |on: bool| {
            hf(&format!(
                r#","max_position_embeddings":32768,"sliding_window":4096,"use_sliding_window":{on},"max_window_layers":1,"attention_bias":true"#
            ))
            .replace("\"llama\"", "\"qwen2\"")
        };
        let off = ModelConfig::from_hf_json(&qwen(false), "c").unwrap();
        assert_eq!((off.max_context, off.sliding_window.clone()), (32768, None));
        let on = ModelConfig::from_hf_json(&qwen(true), "c").unwrap();
        assert_eq!((on.layer_window(0), on.layer_window(1)), (None, Some(4096)));
        let layout = TensorLayout {
            attention_bias: true,
            ..Default::default()
        };
        let back = on.to_hf_json(&layout).unwrap();
        assert_eq!(
            ModelConfig::from_hf_json(&back.to_string(), "c").unwrap(),
            on
        );
    }

    #[test]
    fn llama3_scaling_matches_the_three_regimes() {
        let c = ModelConfig::from_hf_json(
            &hf(
                r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
            ),
            "c",
        )
        .unwrap();
        let inv = c.rope_inv_freq();
        let base = |i: usize| 500000f64.powf(-((2 * i) as f64) / 16.0);
        // Highest frequency (short wavelength): untouched.
        assert!((inv[0] as f64 - base(0)).abs() < 1e-7);
        // Lowest frequency (wavelength 2*pi*500000^(14/16) ~ 62k > 8192): divided by 8.
        assert!((inv[7] as f64 - base(7) / 8.0).abs() / (base(7) / 8.0) < 1e-5);
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    const FIXTURES: [&str; 9] = [
        "tiny-gemma3",
        "tiny-llama-tied-bf16",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe",
    ];

    /// Every fixture's config survives `to_hf_json` -> `from_hf_json`, the tensor layout read
    /// off its files matches what its own config.json says, and `model_tensors` names exactly
    /// the tensors it ships.
    #[test]
    fn hf_json_round_trips_every_fixture() {
        for name in FIXTURES {
            let dir = fixture(name);
            let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
            let original: Value = serde_json::from_str(&text).unwrap();
            let c = ModelConfig::from_hf_json(&text, name).unwrap();
            let st = nibble_formats::safetensors_dir::SafetensorsDir::open(&dir).unwrap();
            let layout = TensorLayout::from_names(st.names());
            let v = c.to_hf_json(&layout).unwrap();
            assert_eq!(
                ModelConfig::from_hf_json(&v.to_string(), name).unwrap(),
                c,
                "{name}"
            );
            assert_eq!(
                v["tie_word_embeddings"], original["tie_word_embeddings"],
                "{name}"
            );
            assert_eq!(v["model_type"], original["model_type"], "{name}");
            assert_eq!(v["architectures"], original["architectures"], "{name}");
            assert_eq!(v["rms_norm_eps"], original["rms_norm_eps"], "{name}");
            if let Some(b) = original.get("attention_bias") {
                assert_eq!(&v["attention_bias"], b, "{name}");
            }
            let mut want: Vec<(String, Vec<usize>)> = st
                .names()
                .map(|n| (n.to_string(), st.get(n).unwrap().shape))
                .collect();
            let mut got: Vec<(String, Vec<usize>)> = crate::transformer::model_tensors(&c, &layout)
                .into_iter()
                .map(|(n, s, _)| (n, s))
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{name}");
        }
    }

    fn moe_fixture_config(name: &str) -> (String, Value) {
        let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
        let v = serde_json::from_str(&text).unwrap();
        (text, v)
    }

    /// A GGUF file holding only `meta` plus the dense keys `from_gguf` needs, for `arch`.
    fn gguf_config(
        arch: &str,
        meta: &[(&str, nibble_formats::gguf::MetaValue)],
    ) -> Result<ModelConfig> {
        use nibble_formats::gguf::{GgufWriter, MetaValue};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String(arch.into()));
        for (k, v) in [
            ("embedding_length", 64),
            ("attention.head_count", 4),
            ("vocab_size", 272),
            ("feed_forward_length", 32),
            ("block_count", 2),
        ] {
            w.meta(&format!("{arch}.{k}"), MetaValue::U32(v));
        }
        w.meta(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-5),
        );
        for (k, v) in meta {
            w.meta(k, v.clone());
        }
        w.write_to(&path).unwrap();
        ModelConfig::from_gguf(&GgufFile::open(&path).unwrap())
    }

    #[test]
    fn moe_gguf_metadata_parses_as_llama_cpp_writes_it() {
        use nibble_formats::gguf::MetaValue::U32;
        // Mixtral is a llama-arch file with experts; its experts are feed_forward_length wide.
        let c = gguf_config(
            "llama",
            &[
                ("llama.expert_count", U32(8)),
                ("llama.expert_used_count", U32(2)),
            ],
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Mixtral);
        let m = c.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.renormalize), (8, 2, true));
        assert_eq!(m.expert_intermediate_size, 32);
        assert_eq!(m.shared_expert_intermediate_size, None);
        // With no tensors, every layer counts as sparse (the loader then names the missing router).
        assert_eq!(m.sparse_layers, vec![true, true]);

        let c = gguf_config(
            "qwen2moe",
            &[
                ("qwen2moe.expert_count", U32(8)),
                ("qwen2moe.expert_used_count", U32(4)),
                ("qwen2moe.expert_feed_forward_length", U32(16)),
                ("qwen2moe.expert_shared_feed_forward_length", U32(48)),
            ],
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2Moe);
        let m = c.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.renormalize), (8, 4, false));
        assert_eq!(m.expert_intermediate_size, 16);
        assert_eq!(m.shared_expert_intermediate_size, Some(48));

        let c = gguf_config(
            "qwen3moe",
            &[
                ("qwen3moe.expert_count", U32(8)),
                ("qwen3moe.expert_used_count", U32(2)),
                ("qwen3moe.expert_feed_forward_length", U32(16)),
            ],
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe);
        assert!(c.moe.unwrap().renormalize);

        // A missing expert key is named.
        let e = gguf_config("qwen3moe", &[("qwen3moe.expert_count", U32(8))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("qwen3moe.expert_used_count"), "{e}");
    }

    #[test]
    fn gemma3_gguf_metadata_and_its_missing_window() {
        use nibble_formats::gguf::MetaValue::{F32, U32};
        let e = gguf_config("gemma3", &[]).unwrap_err().to_string();
        assert!(e.contains("gemma3.attention.sliding_window"), "{e}");
        let c = gguf_config(
            "gemma3",
            &[
                ("gemma3.attention.sliding_window", U32(512)),
                ("gemma3.block_count", U32(12)),
                ("gemma3.rope.freq_base", F32(1e6)),
            ],
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        let w = c.sliding_window.as_ref().unwrap();
        // Five local layers, then a global one.
        let globals: Vec<usize> = (0..12).filter(|&i| !w.layers[i]).collect();
        assert_eq!((w.size, globals), (512, vec![5, 11]));
        let g = c.gemma.as_ref().unwrap();
        assert_eq!(g.query_pre_attn_scalar, c.head_dim as f64);
        assert_eq!(g.rope_local_theta, 10_000.0);
        // Local layers rotate with base 10000, global ones with rope_theta.
        assert_eq!(
            c.layer_rope_inv_freq(0)[1],
            (10_000f64.powf(-2.0 / 16.0)) as f32
        );
        assert_eq!(c.layer_rope_inv_freq(5), c.rope_inv_freq());
        assert_ne!(c.layer_rope_inv_freq(0), c.rope_inv_freq());
        let e = gguf_config(
            "gemma3",
            &[
                ("gemma3.attention.sliding_window", U32(512)),
                ("gemma3.final_logit_softcapping", F32(30.0)),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("gemma3.final_logit_softcapping"), "{e}");
    }

    /// A Gemma 3 config.json without one of the fields its model needs is refused naming it.
    #[test]
    fn gemma3_hf_config_names_a_missing_field() {
        let (text, v) = moe_fixture_config("tiny-gemma3");
        let c = ModelConfig::from_hf_json(&text, "c").unwrap();
        assert_eq!(c.gemma.as_ref().unwrap().query_pre_attn_scalar, 48.0);
        assert_eq!(c.layer_window(5), None);
        assert_eq!(c.layer_window(6), Some(6));
        for key in [
            "query_pre_attn_scalar",
            "sliding_window",
            "rope_local_base_freq",
            "head_dim",
            "hidden_activation",
        ] {
            let mut bad = v.clone();
            bad.as_object_mut().unwrap().remove(key);
            let e = ModelConfig::from_hf_json(&bad.to_string(), "x/config.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(key) || e.contains("hidden_activation"),
                "{key}: {e}"
            );
        }
        // The layer pattern: layer_types, or the older sliding_window_pattern.
        let mut old = v.clone();
        old.as_object_mut().unwrap().remove("layer_types");
        let e = ModelConfig::from_hf_json(&old.to_string(), "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer_types") && e.contains("sliding_window_pattern"),
            "{e}"
        );
        old["sliding_window_pattern"] = 6.into();
        assert_eq!(ModelConfig::from_hf_json(&old.to_string(), "c").unwrap(), c);
        let mut short = v.clone();
        short["layer_types"] = serde_json::json!(["full_attention"]);
        let e = ModelConfig::from_hf_json(&short.to_string(), "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layer_types"), "{e}");
        for (key, value) in [
            ("final_logit_softcapping", Value::from(30.0)),
            ("attn_logit_softcapping", Value::from(50.0)),
            ("text_config", serde_json::json!({})),
        ] {
            let mut bad = v.clone();
            bad[key] = value;
            let e = ModelConfig::from_hf_json(&bad.to_string(), "c")
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) || e.contains("multimodal"), "{key}: {e}");
        }
    }

    #[test]
    fn moe_gguf_of_a_dense_architecture_is_refused_naming_the_key() {
        let e = gguf_config(
            "qwen2",
            &[(
                "qwen2.expert_count",
                nibble_formats::gguf::MetaValue::U32(8),
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("qwen2.expert_count"), "{e}");
    }

    #[test]
    fn moe_configs_parse() {
        let cfg = |name: &str| {
            let (text, _) = moe_fixture_config(name);
            ModelConfig::from_hf_json(&text, name).unwrap()
        };
        let m = cfg("tiny-mixtral").moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.renormalize), (4, 2, true));
        assert_eq!(m.expert_intermediate_size, 32);
        assert_eq!(m.sparse_layers, vec![true, true]);
        let q2 = cfg("tiny-qwen2-moe");
        assert_eq!(q2.arch, Arch::Qwen2Moe);
        let m = q2.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.renormalize), (8, 2, false));
        assert_eq!(m.shared_expert_intermediate_size, Some(48));
        let q3 = cfg("tiny-qwen3-moe");
        assert_eq!(q3.intermediate_size, 96);
        let m = q3.moe.unwrap();
        assert!(m.renormalize && m.shared_expert_intermediate_size.is_none());
        assert_eq!(m.sparse_layers, vec![false, true]);
        // decoder_sparse_step 2 makes every second layer (1, 3, ...) sparse.
        let (_, mut v) = moe_fixture_config("tiny-qwen3-moe");
        v["decoder_sparse_step"] = 2.into();
        v["mlp_only_layers"] = serde_json::json!([]);
        v["num_hidden_layers"] = 4.into();
        let c = ModelConfig::from_hf_json(&v.to_string(), "c").unwrap();
        assert_eq!(c.moe.unwrap().sparse_layers, vec![false, true, false, true]);
        // A dense architecture never has experts, whatever stray keys its config holds.
        let dense = ModelConfig::from_hf_json(&hf(r#","num_experts":8"#), "c").unwrap();
        assert!(dense.moe.is_none());
    }

    /// Router and expert layouts nibble does not implement are refused, naming the field.
    #[test]
    fn bad_moe_configs_name_the_field() {
        let cases: [(&str, &str, Value, &str); 9] = [
            (
                "tiny-mixtral",
                "num_local_experts",
                Value::Null,
                "num_local_experts",
            ),
            ("tiny-qwen3-moe", "num_experts", 0.into(), "num_experts"),
            (
                "tiny-qwen3-moe",
                "num_experts_per_tok",
                9.into(),
                "num_experts_per_tok",
            ),
            (
                "tiny-mixtral",
                "num_experts_per_tok",
                Value::Null,
                "num_experts_per_tok",
            ),
            (
                "tiny-qwen3-moe",
                "scoring_func",
                "sigmoid".into(),
                "scoring_func",
            ),
            (
                "tiny-qwen3-moe",
                "topk_method",
                "group_limited_greedy".into(),
                "topk_method",
            ),
            (
                "tiny-qwen2-moe",
                "shared_expert_intermediate_size",
                Value::Null,
                "shared_expert",
            ),
            (
                "tiny-qwen3-moe",
                "moe_intermediate_size",
                Value::Null,
                "moe_intermediate_size",
            ),
            (
                "tiny-qwen3-moe",
                "mlp_only_layers",
                serde_json::json!([5]),
                "mlp_only_layers",
            ),
        ];
        for (name, key, value, want) in cases {
            let (_, mut v) = moe_fixture_config(name);
            v[key] = value;
            let e = ModelConfig::from_hf_json(&v.to_string(), name)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{name} {key}: {e}");
        }
        let (_, mut v) = moe_fixture_config("tiny-qwen3-moe");
        v["decoder_sparse_step"] = 0.into();
        let e = ModelConfig::from_hf_json(&v.to_string(), "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("decoder_sparse_step"), "{e}");
        let (_, mut v) = moe_fixture_config("tiny-qwen3-moe");
        v["norm_topk_prob"] = "yes".into();
        let e = ModelConfig::from_hf_json(&v.to_string(), "c")
            .unwrap_err()
            .to_string();
        assert!(e.contains("norm_topk_prob"), "{e}");
    }

    fn with_scaling(rope_scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            rope_scaling,
            ..ModelConfig::from_hf_json(&hf(r#","rope_theta":500000.0"#), "c").unwrap()
        }
    }

    #[test]
    fn rope_scaling_round_trips() {
        let layout = TensorLayout::default();
        for scaling in [
            RopeScaling::None,
            RopeScaling::Linear { factor: 2.5 },
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192.0,
            },
        ] {
            let c = with_scaling(scaling);
            let v = c.to_hf_json(&layout).unwrap();
            assert_eq!(ModelConfig::from_hf_json(&v.to_string(), "c").unwrap(), c);
        }
    }

    /// GGUF Llama 3 files carry the scaling as per-frequency factors; written out they become
    /// the llama3 parameters that produce the same frequencies.
    #[test]
    fn gguf_freq_factors_are_written_as_llama3() {
        let base = with_scaling(RopeScaling::None);
        // llama.cpp's convert_hf_to_gguf.py: f32 frequencies, factors per pair.
        let (factor, low, high, old) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
        let d = base.head_dim;
        let factors: Vec<f32> = (0..d / 2)
            .map(|i| {
                let freq = (1.0 / 500000f32.powf((2 * i) as f32 / d as f32)) as f64;
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor as f32
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                }
            })
            .collect();
        let c = with_scaling(RopeScaling::FreqFactors(factors));
        let v = c.to_hf_json(&TensorLayout::default()).unwrap();
        assert_eq!(v["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(v["rope_scaling"]["original_max_position_embeddings"], 8192);
        let back = ModelConfig::from_hf_json(&v.to_string(), "c").unwrap();
        for (a, b) in back.rope_inv_freq().iter().zip(c.rope_inv_freq()) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{a} vs {b}");
        }
        // Factors that are not Llama 3's are refused rather than approximated.
        let odd = with_scaling(RopeScaling::FreqFactors(vec![1.5; d / 2]));
        let e = odd.to_hf_json(&TensorLayout::default()).unwrap_err();
        assert!(e.to_string().contains("rope_freqs"), "{e}");
    }

    #[test]
    fn layouts_an_hf_class_cannot_express_are_refused() {
        let cfg = |arch: &str| {
            ModelConfig::from_hf_json(&hf("").replace("\"llama\"", &format!("\"{arch}\"")), "c")
                .unwrap()
        };
        let l = |attention_bias, qk_norm| TensorLayout {
            tie_word_embeddings: false,
            attention_bias,
            qk_norm,
        };
        for (arch, layout, why) in [
            ("qwen2", l(false, false), "without Q/K/V biases"),
            ("qwen3", l(false, false), "without per-head Q/K norms"),
            ("mistral", l(true, false), "with Q/K/V biases"),
            ("llama", l(false, true), "with per-head Q/K norms"),
        ] {
            let e = cfg(arch).to_hf_json(&layout).unwrap_err().to_string();
            assert!(e.contains(why), "{arch}: {e}");
        }
        let v = cfg("llama").to_hf_json(&l(true, false)).unwrap();
        assert_eq!(v["attention_bias"], true);
        assert_eq!(v["tie_word_embeddings"], false);
    }
}

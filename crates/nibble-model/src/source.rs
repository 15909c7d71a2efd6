//! Where a model's tensors come from, under Hugging Face names whatever the file format.
//!
//! A GGUF file's names are mapped to Hugging Face ones here, and llama-arch GGUF files get their
//! Q/K rows un-permuted (llama.cpp's converter permutes them for the interleaved rotary layout),
//! so model code sees one naming and one rotary layout.

use nibble_formats::gguf::{GgufFile, TensorInfo};
use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};

use nibble_core::{Error, Result};

use crate::config::{Arch, ModelConfig};

pub trait TensorSource: Send + Sync {
    fn get(&self, name: &str) -> Option<HostTensor>;
    /// Whether `get(name)` would return a tensor; sources that build tensors on demand answer
    /// without building one.
    fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
    /// The file or directory, for error messages.
    fn origin(&self) -> String;
    /// A tensor's shape and storage format, without its data where the source can tell them
    /// apart (a source that builds tensors on demand).
    fn layout_of(&self, name: &str) -> Option<(Vec<usize>, WeightFormat)> {
        self.get(name).map(|t| (t.shape, t.format))
    }
    /// Rows `a..b` (`by_rows`) or columns `a..b` of a matrix: one tensor-parallel rank's shard.
    /// The default reads the whole tensor and cuts it; a source that builds tensors on demand
    /// may build only the part (the same bytes).
    fn get_part(
        &self,
        name: &str,
        by_rows: bool,
        a: usize,
        b: usize,
    ) -> Option<Result<HostTensor>> {
        Some(self.get(name)?.slice_part(by_rows, a, b))
    }
}

impl TensorSource for SafetensorsDir {
    fn get(&self, name: &str) -> Option<HostTensor> {
        SafetensorsDir::get(self, name)
    }
    fn origin(&self) -> String {
        self.dir().display().to_string()
    }
}

pub struct GgufSource {
    file: GgufFile,
    arch: Arch,
    num_heads: usize,
    num_kv_heads: usize,
    unpermute: bool,
}

impl GgufSource {
    /// `unpermute`: undo llama.cpp's Q/K row permutation (llama arch only), giving HF layout.
    pub fn new(
        file: GgufFile,
        arch: Arch,
        num_heads: usize,
        num_kv_heads: usize,
        unpermute: bool,
    ) -> Self {
        GgufSource {
            file,
            arch,
            num_heads,
            num_kv_heads,
            unpermute,
        }
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// Expert `e`'s projection: a slice of the stacked `blk.L.ffn_<proj>_exps.weight` (ggml
    /// dims `[in, out, experts]`, so expert `e` is the contiguous `e`-th of `experts` equal byte
    /// ranges, for any ggml type), or older llama.cpp's split `blk.L.ffn_<proj>.E.weight`.
    fn expert(&self, name: &str, layer: usize, e: usize, proj: &str) -> Option<HostTensor> {
        if let Some(info) = self
            .file
            .tensor(&format!("blk.{layer}.ffn_{proj}_exps.weight"))
        {
            let [cols, rows, n] = info.dims[..] else {
                return None;
            };
            if e >= n || !info.len.is_multiple_of(n) {
                return None;
            }
            let len = info.len / n;
            return Some(HostTensor {
                name: name.to_string(),
                shape: vec![rows, cols],
                format: WeightFormat::Ggml(info.ty),
                bytes: TensorBytes::Mapped {
                    map: self.file.mmap().clone(),
                    start: info.start + e * len,
                    len,
                },
            });
        }
        let info = self
            .file
            .tensor(&format!("blk.{layer}.ffn_{proj}.{e}.weight"))?;
        Some(self.host(info, name))
    }

    /// Checks the mixture-of-experts tensors of every sparse layer against `cfg`, naming the
    /// GGUF tensor that is missing or misshapen (the model loader would name the Hugging Face
    /// tensor, or a slice of a stacked one).
    pub fn check_experts(&self, cfg: &ModelConfig) -> Result<()> {
        let Some(m) = &cfg.moe else {
            return Ok(());
        };
        let origin = self.origin();
        let (h, f, n) = (cfg.hidden_size, m.expert_intermediate_size, m.num_experts);
        let missing = |name: String| Error::MissingTensor {
            name,
            source_name: origin.clone(),
        };
        // Expected ggml dims (innermost first).
        let check = |name: String, dims: &[usize]| -> Result<()> {
            let info = self
                .file
                .tensor(&name)
                .ok_or_else(|| missing(name.clone()))?;
            if info.dims != dims {
                return Err(Error::corrupt(
                    &origin,
                    format!(
                        "tensor '{name}' has ggml dims {:?}, expected {dims:?} \
                         ({n} experts, hidden {h}, expert width {f})",
                        info.dims
                    ),
                ));
            }
            Ok(())
        };
        for (layer, _) in m.sparse_layers.iter().enumerate().filter(|(_, s)| **s) {
            let b = format!("blk.{layer}");
            check(format!("{b}.ffn_gate_inp.weight"), &[h, n])?;
            for (proj, dims) in [("gate", [h, f]), ("up", [h, f]), ("down", [f, h])] {
                let stacked = format!("{b}.ffn_{proj}_exps.weight");
                if self.file.tensor(&stacked).is_some() {
                    check(stacked, &[dims[0], dims[1], n])?;
                } else if self
                    .file
                    .tensor(&format!("{b}.ffn_{proj}.0.weight"))
                    .is_some()
                {
                    for e in 0..n {
                        check(format!("{b}.ffn_{proj}.{e}.weight"), &dims)?;
                    }
                } else {
                    return Err(missing(stacked));
                }
            }
            if let Some(sf) = m.shared_expert_intermediate_size {
                check(format!("{b}.ffn_gate_shexp.weight"), &[h, sf])?;
                check(format!("{b}.ffn_up_shexp.weight"), &[h, sf])?;
                check(format!("{b}.ffn_down_shexp.weight"), &[sf, h])?;
                let gate = format!("{b}.ffn_gate_inp_shexp.weight");
                let info = self
                    .file
                    .tensor(&gate)
                    .ok_or_else(|| missing(gate.clone()))?;
                if info.dims != [h] && info.dims != [h, 1] {
                    return Err(Error::corrupt(
                        &origin,
                        format!(
                            "tensor '{gate}' has ggml dims {:?}, expected [{h}]",
                            info.dims
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn host(&self, info: &TensorInfo, name: &str) -> HostTensor {
        HostTensor {
            name: name.to_string(),
            shape: info.shape(),
            format: WeightFormat::Ggml(info.ty),
            bytes: TensorBytes::Mapped {
                map: self.file.mmap().clone(),
                start: info.start,
                len: info.len,
            },
        }
    }
}

/// GGUF name for a Hugging Face tensor name.
pub fn gguf_name(hf: &str) -> Option<String> {
    Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.")?;
            let (layer, part) = rest.split_once('.')?;
            let (module, suffix) = part.rsplit_once('.')?;
            let g = match module {
                "input_layernorm" => "attn_norm",
                "post_attention_layernorm" => "ffn_norm",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "mlp.gate_proj" => "ffn_gate",
                "mlp.up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                // Mixture-of-experts routers, and Qwen2-MoE's shared expert and its gate.
                "block_sparse_moe.gate" | "mlp.gate" => "ffn_gate_inp",
                "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
                "mlp.shared_expert.up_proj" => "ffn_up_shexp",
                "mlp.shared_expert.down_proj" => "ffn_down_shexp",
                "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
                _ => return None,
            };
            format!("blk.{layer}.{g}.{suffix}")
        }
    })
}

/// GGUF name of a Gemma 3 tensor: its four norms per layer are named apart (Hugging Face's
/// `post_attention_layernorm` follows attention, not the feed-forward's input as in Llama).
pub fn gemma_gguf_name(hf: &str) -> Option<String> {
    let rest = hf.strip_prefix("model.layers.");
    if let Some((layer, part)) = rest.and_then(|r| r.split_once('.')) {
        let g = match part {
            "post_attention_layernorm.weight" => Some("post_attention_norm"),
            "pre_feedforward_layernorm.weight" => Some("ffn_norm"),
            "post_feedforward_layernorm.weight" => Some("post_ffw_norm"),
            _ => None,
        };
        if let Some(g) = g {
            return Some(format!("blk.{layer}.{g}.weight"));
        }
    }
    gguf_name(hf)
}

/// A Gemma norm scale in Hugging Face's terms, `w` of `x * (1 + w)`: llama.cpp's converter
/// stores `1 + w` (its RMSNorm multiplies by the weight alone), so 1 is taken off here and the
/// model adds it back, as for a Hugging Face checkpoint. Both steps are exact for stored values
/// of at least 0.5 (Sterbenz) and for smaller ones on the 2^-24 grid (bf16 weights plus one).
fn gemma_norm_from_gguf(t: HostTensor) -> Option<HostTensor> {
    let values = t.to_f32().ok()?;
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|&x| (x - 1.0).to_le_bytes())
        .collect();
    Some(HostTensor {
        format: WeightFormat::Ggml(nibble_formats::gguf::GgmlType::F32),
        bytes: TensorBytes::Owned(std::sync::Arc::new(bytes)),
        ..t
    })
}

/// A routed expert's projection under its Hugging Face name (Mixtral's
/// `block_sparse_moe.experts.E.w1`, Qwen's `mlp.experts.E.gate_proj`): the layer, the expert and
/// the GGUF projection (`gate`, `up` or `down`).
pub fn expert_part(hf: &str) -> Option<(usize, usize, &'static str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = part.strip_suffix(".weight")?;
    let part = part
        .strip_prefix("block_sparse_moe.experts.")
        .or_else(|| part.strip_prefix("mlp.experts."))?;
    let (expert, proj) = part.split_once('.')?;
    let proj = match proj {
        "w1" | "gate_proj" => "gate",
        "w3" | "up_proj" => "up",
        "w2" | "down_proj" => "down",
        _ => return None,
    };
    Some((layer.parse().ok()?, expert.parse().ok()?, proj))
}

/// Row order that undoes llama.cpp's permutation of a Q or K projection with `heads` heads:
/// within each head, GGUF row `2i + j` holds HF row `j * half + i`.
pub fn unpermute_qk_order(rows: usize, heads: usize) -> Vec<usize> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    (0..rows)
        .map(|hf_row| {
            let (h, r) = (hf_row / head_dim, hf_row % head_dim);
            let (j, i) = (r / half, r % half);
            h * head_dim + 2 * i + j
        })
        .collect()
}

impl TensorSource for GgufSource {
    fn get(&self, name: &str) -> Option<HostTensor> {
        if let Some((layer, e, proj)) = expert_part(name) {
            return self.expert(name, layer, e, proj);
        }
        let gname = match self.arch {
            Arch::Gemma3 => gemma_gguf_name(name),
            _ => gguf_name(name),
        }?;
        let info = self.file.tensor(&gname)?;
        let mut t = self.host(info, name);
        if self.arch == Arch::Gemma3 && gname.ends_with("norm.weight") {
            return gemma_norm_from_gguf(t);
        }
        if gname.ends_with("ffn_gate_inp_shexp.weight") && t.shape.len() == 1 {
            // llama.cpp stores Qwen2-MoE's shared-expert gate `[1, hidden]` as a vector.
            t.shape.insert(0, 1);
        }
        let heads = if name.ends_with("self_attn.q_proj.weight")
            || name.ends_with("self_attn.q_proj.bias")
        {
            self.num_heads
        } else if name.ends_with("self_attn.k_proj.weight")
            || name.ends_with("self_attn.k_proj.bias")
        {
            self.num_kv_heads
        } else {
            return Some(t);
        };
        if !(self.unpermute && matches!(self.arch, Arch::Llama | Arch::Mistral | Arch::Mixtral)) {
            return Some(t);
        }
        let rows = t.shape[0];
        if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
            // Leave it as is; the shape check in the loader reports the inconsistency.
            return Some(t);
        }
        // A 1-D bias is a single column of rows.
        let as_rows = HostTensor {
            shape: if t.shape.len() == 1 {
                vec![rows, 1]
            } else {
                t.shape.clone()
            },
            ..t.clone()
        };
        let mut p = as_rows
            .permute_rows(&unpermute_qk_order(rows, heads))
            .ok()?;
        p.shape = t.shape;
        Some(p)
    }

    fn origin(&self) -> String {
        self.file.path().display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.k_proj.bias").as_deref(),
            Some("blk.3.attn_k.bias")
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.up_proj.weight").as_deref(),
            Some("blk.0.ffn_up.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.0.unknown.weight"), None);
        assert_eq!(
            gguf_name("model.layers.2.block_sparse_moe.gate.weight").as_deref(),
            Some("blk.2.ffn_gate_inp.weight")
        );
        assert_eq!(
            gguf_name("model.layers.1.mlp.shared_expert_gate.weight").as_deref(),
            Some("blk.1.ffn_gate_inp_shexp.weight")
        );
        assert_eq!(
            expert_part("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
            Some((1, 3, "down"))
        );
        assert_eq!(
            expert_part("model.layers.0.mlp.experts.7.gate_proj.weight"),
            Some((0, 7, "gate"))
        );
        assert_eq!(expert_part("model.layers.0.mlp.gate_proj.weight"), None);
    }

    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        // llama.cpp's converter: w.reshape(heads, 2, half, in).swapaxes(1, 2): GGUF row
        // (h, i, j) = h*hd + 2i + j comes from HF row (h, j, i) = h*hd + j*half + i.
        let (heads, hd) = (3, 8);
        let half = hd / 2;
        let mut gguf_from_hf = vec![0; heads * hd];
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    gguf_from_hf[h * hd + 2 * i + j] = h * hd + j * half + i;
                }
            }
        }
        let order = unpermute_qk_order(heads * hd, heads);
        for (hf_row, &g) in order.iter().enumerate() {
            assert_eq!(gguf_from_hf[g], hf_row);
        }
    }
}

//! Where a model's tensors come from, under Hugging Face names whatever the file format.
//!
//! A GGUF file's names are mapped to Hugging Face ones here, and llama-arch GGUF files get their
//! Q/K rows un-permuted (llama.cpp's converter permutes them for the interleaved rotary layout),
//! so model code sees one naming and one rotary layout.

use nibble_formats::gguf::{GgufFile, TensorInfo};
use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};

use crate::config::Arch;

pub trait TensorSource: Send + Sync {
    fn get(&self, name: &str) -> Option<HostTensor>;
    /// Whether `get(name)` would return a tensor; sources that build tensors on demand answer
    /// without building one.
    fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
    /// The file or directory, for error messages.
    fn origin(&self) -> String;
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
                _ => return None,
            };
            format!("blk.{layer}.{g}.{suffix}")
        }
    })
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
        let gname = gguf_name(name)?;
        let info = self.file.tensor(&gname)?;
        let t = self.host(info, name);
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
        if !(self.unpermute && matches!(self.arch, Arch::Llama | Arch::Mistral)) {
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

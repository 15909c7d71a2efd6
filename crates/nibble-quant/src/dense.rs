//! A model held as plain f32 matrices under Hugging Face names: what calibration runs, what the
//! offline transforms rewrite, and what the quantizers encode. It is also a [`TensorSource`], so
//! the ordinary `Transformer` (and so the ordinary CPU kernels) run it unchanged.
//!
//! The rewrites here keep the network's function: a per-channel scale or permutation of a linear
//! layer's input is folded into the op that produces that input, and a rotation of the residual
//! stream into everything that reads or writes it.

use std::sync::Arc;

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::config::ModelConfig;
use nibble_model::source::TensorSource;

/// A row-major f32 matrix; a linear weight is `[out, in]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data length");
        Mat { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// The rows `rows` (in that order) as a new matrix.
    pub fn select_rows(&self, rows: &[usize]) -> Mat {
        let mut data = Vec::with_capacity(rows.len() * self.cols);
        for &r in rows {
            data.extend_from_slice(self.row(r));
        }
        Mat::new(rows.len(), self.cols, data)
    }

    /// Multiplies column `j` by `s[j]`.
    pub fn scale_cols(&mut self, s: &[f32]) {
        assert_eq!(s.len(), self.cols);
        for row in self.data.chunks_exact_mut(self.cols) {
            for (w, s) in row.iter_mut().zip(s) {
                *w *= s;
            }
        }
    }

    /// Multiplies row `i` by `s[i]`.
    pub fn scale_rows(&mut self, s: &[f32]) {
        assert_eq!(s.len(), self.rows);
        for (row, s) in self.data.chunks_exact_mut(self.cols).zip(s) {
            row.iter_mut().for_each(|w| *w *= s);
        }
    }

    /// Row `i` of the result is row `perm[i]` of `self`.
    pub fn permute_rows(&mut self, perm: &[usize]) {
        assert_eq!(perm.len(), self.rows);
        let mut out = Vec::with_capacity(self.data.len());
        for &p in perm {
            out.extend_from_slice(self.row(p));
        }
        self.data = out;
    }

    /// Column `j` of the result is column `perm[j]` of `self`.
    pub fn permute_cols(&mut self, perm: &[usize]) {
        assert_eq!(perm.len(), self.cols);
        let mut tmp = vec![0f32; self.cols];
        for row in self.data.chunks_exact_mut(self.cols) {
            for (t, &p) in tmp.iter_mut().zip(perm) {
                *t = row[p];
            }
            row.copy_from_slice(&tmp);
        }
    }

    /// `self @ r` for a square `r` (`cols x cols`), in f64 accumulation.
    pub fn matmul_right(&self, r: &Mat) -> Mat {
        assert_eq!(r.rows, self.cols);
        let mut out = vec![0f32; self.rows * r.cols];
        for (orow, srow) in out
            .chunks_exact_mut(r.cols)
            .zip(self.data.chunks_exact(self.cols))
        {
            let mut acc = vec![0f64; r.cols];
            for (k, &a) in srow.iter().enumerate() {
                if a != 0.0 {
                    for (o, &b) in acc.iter_mut().zip(r.row(k)) {
                        *o += a as f64 * b as f64;
                    }
                }
            }
            for (o, a) in orow.iter_mut().zip(acc) {
                *o = a as f32;
            }
        }
        Mat::new(self.rows, r.cols, out)
    }

    pub fn transpose(&self) -> Mat {
        let mut out = vec![0f32; self.data.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                out[c * self.rows + r] = self.data[r * self.cols + c];
            }
        }
        Mat::new(self.cols, self.rows, out)
    }
}

/// The linear layers of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearKind {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LinearKind {
    pub const ALL: [LinearKind; 7] = [
        LinearKind::Q,
        LinearKind::K,
        LinearKind::V,
        LinearKind::O,
        LinearKind::Gate,
        LinearKind::Up,
        LinearKind::Down,
    ];

    pub fn hf_suffix(self) -> &'static str {
        match self {
            LinearKind::Q => "self_attn.q_proj",
            LinearKind::K => "self_attn.k_proj",
            LinearKind::V => "self_attn.v_proj",
            LinearKind::O => "self_attn.o_proj",
            LinearKind::Gate => "mlp.gate_proj",
            LinearKind::Up => "mlp.up_proj",
            LinearKind::Down => "mlp.down_proj",
        }
    }

    /// The activation this layer reads.
    pub fn site(self) -> SiteKind {
        match self {
            LinearKind::Q | LinearKind::K | LinearKind::V => SiteKind::AttnIn,
            LinearKind::O => SiteKind::OIn,
            LinearKind::Gate | LinearKind::Up => SiteKind::MlpIn,
            LinearKind::Down => SiteKind::DownIn,
        }
    }
}

/// The four distinct linear-layer inputs of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SiteKind {
    /// The normalized block input, read by q/k/v.
    AttnIn,
    /// The attention output, read by o_proj.
    OIn,
    /// The normalized residual after attention, read by gate/up.
    MlpIn,
    /// `silu(gate) * up`, read by down_proj.
    DownIn,
}

impl SiteKind {
    pub const ALL: [SiteKind; 4] = [
        SiteKind::AttnIn,
        SiteKind::OIn,
        SiteKind::MlpIn,
        SiteKind::DownIn,
    ];

    /// The linear layers that read this input.
    pub fn readers(self) -> &'static [LinearKind] {
        match self {
            SiteKind::AttnIn => &[LinearKind::Q, LinearKind::K, LinearKind::V],
            SiteKind::OIn => &[LinearKind::O],
            SiteKind::MlpIn => &[LinearKind::Gate, LinearKind::Up],
            SiteKind::DownIn => &[LinearKind::Down],
        }
    }
}

/// One linear layer of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinearId {
    pub layer: usize,
    pub kind: LinearKind,
}

impl LinearId {
    /// The Hugging Face tensor name of its weight.
    pub fn name(self) -> String {
        format!(
            "model.layers.{}.{}.weight",
            self.layer,
            self.kind.hf_suffix()
        )
    }

    /// Parses a Hugging Face weight name back.
    pub fn parse(name: &str) -> Option<LinearId> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let suffix = rest.strip_suffix(".weight")?;
        let kind = LinearKind::ALL
            .into_iter()
            .find(|k| k.hf_suffix() == suffix)?;
        Some(LinearId {
            layer: layer.parse().ok()?,
            kind,
        })
    }
}

#[derive(Debug, Clone)]
pub struct DenseLayer {
    pub attn_norm: Vec<f32>,
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    pub o: Mat,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

impl DenseLayer {
    pub fn linear(&self, kind: LinearKind) -> &Mat {
        match kind {
            LinearKind::Q => &self.q,
            LinearKind::K => &self.k,
            LinearKind::V => &self.v,
            LinearKind::O => &self.o,
            LinearKind::Gate => &self.gate,
            LinearKind::Up => &self.up,
            LinearKind::Down => &self.down,
        }
    }

    pub fn linear_mut(&mut self, kind: LinearKind) -> &mut Mat {
        match kind {
            LinearKind::Q => &mut self.q,
            LinearKind::K => &mut self.k,
            LinearKind::V => &mut self.v,
            LinearKind::O => &mut self.o,
            LinearKind::Gate => &mut self.gate,
            LinearKind::Up => &mut self.up,
            LinearKind::Down => &mut self.down,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DenseModel {
    pub config: ModelConfig,
    pub embed: Mat,
    /// `None` while the head is tied to the embedding table.
    pub lm_head: Option<Mat>,
    pub final_norm: Vec<f32>,
    pub layers: Vec<DenseLayer>,
}

impl DenseModel {
    /// Decodes every tensor of `source` to f32; `progress(done, total)` per tensor.
    pub fn load(
        config: ModelConfig,
        source: &dyn TensorSource,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &config;
        // Said plainly here rather than as a missing `mlp.gate_proj` tensor later.
        if c.moe.is_some() {
            return Err(Error::unsupported(
                format!("quantizing a mixture-of-experts model ({:?})", c.arch),
                "nibble quantizes dense models; run this one in its stored format",
            ));
        }
        // Its extra norms, GeGLU and scales are not in this model's folds and simulation, which
        // would quantize a different function.
        if c.gemma.is_some() {
            return Err(Error::unsupported(
                "quantizing a Gemma 3 model",
                "nibble's quantization pipeline models the Llama block (SwiGLU, two norms); run \
                 Gemma in its stored format",
            ));
        }
        let (h, qd, kvd, ff, hd) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.head_dim,
        );
        let total = 3 + c.num_layers * 9;
        let done = std::cell::Cell::new(0);
        let progress = std::cell::RefCell::new(progress);
        let tick = || {
            done.set(done.get() + 1);
            (progress.borrow_mut())(done.get().min(total), total);
        };
        let need = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = source.get(name).ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                source_name: source.origin(),
            })?;
            t.expect_shape(shape)?;
            let v = t.to_f32()?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::corrupt(
                    source.origin(),
                    format!("tensor '{name}' holds a non-finite value at index {i}"),
                ));
            }
            Ok(v)
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Mat> {
            let m = Mat::new(rows, cols, need(name, &[rows, cols])?);
            tick();
            Ok(m)
        };
        let embed = mat("model.embed_tokens.weight", c.vocab_size, h)?;
        let final_norm = need("model.norm.weight", &[h])?;
        let lm_head = match source.get("lm_head.weight") {
            Some(_) => Some(mat("lm_head.weight", c.vocab_size, h)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let opt = |name: String, len: usize| -> Result<Option<Vec<f32>>> {
                source.get(&name).map(|_| need(&name, &[len])).transpose()
            };
            layers.push(DenseLayer {
                attn_norm: need(&format!("{p}.input_layernorm.weight"), &[h])?,
                q: mat(&format!("{p}.self_attn.q_proj.weight"), qd, h)?,
                k: mat(&format!("{p}.self_attn.k_proj.weight"), kvd, h)?,
                v: mat(&format!("{p}.self_attn.v_proj.weight"), kvd, h)?,
                o: mat(&format!("{p}.self_attn.o_proj.weight"), h, qd)?,
                q_bias: opt(format!("{p}.self_attn.q_proj.bias"), qd)?,
                k_bias: opt(format!("{p}.self_attn.k_proj.bias"), kvd)?,
                v_bias: opt(format!("{p}.self_attn.v_proj.bias"), kvd)?,
                q_norm: opt(format!("{p}.self_attn.q_norm.weight"), hd)?,
                k_norm: opt(format!("{p}.self_attn.k_norm.weight"), hd)?,
                mlp_norm: need(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                gate: mat(&format!("{p}.mlp.gate_proj.weight"), ff, h)?,
                up: mat(&format!("{p}.mlp.up_proj.weight"), ff, h)?,
                down: mat(&format!("{p}.mlp.down_proj.weight"), h, ff)?,
            });
        }
        Ok(DenseModel {
            config,
            embed,
            lm_head,
            final_norm,
            layers,
        })
    }

    pub fn linear(&self, id: LinearId) -> &Mat {
        self.layers[id.layer].linear(id.kind)
    }

    pub fn linear_mut(&mut self, id: LinearId) -> &mut Mat {
        self.layers[id.layer].linear_mut(id.kind)
    }

    /// Every linear layer of every block, in execution order.
    pub fn linear_ids(&self) -> Vec<LinearId> {
        (0..self.layers.len())
            .flat_map(|layer| LinearKind::ALL.map(|kind| LinearId { layer, kind }))
            .collect()
    }

    /// Gives the model its own output head (a copy of the embedding table when tied), so
    /// transforms of the head's input need not touch the embedding's.
    pub fn untie_head(&mut self) {
        if self.lm_head.is_none() {
            self.lm_head = Some(self.embed.clone());
        }
    }

    /// Divides input `site` of layer `layer` by `s` channel-wise and multiplies the columns of
    /// every layer reading it by `s`: the function is unchanged, the activation's range moves
    /// into the weights (SmoothQuant, AWQ). The division is folded into the op producing the
    /// input: the RMSNorm weight (block and MLP inputs), the rows of v_proj (o_proj's input; one
    /// factor per KV channel, shared by the query heads of its group), the rows of up_proj
    /// (down_proj's input).
    pub fn fold_input_scale(&mut self, layer: usize, site: SiteKind, s: &[f32]) -> Result<()> {
        let c = &self.config;
        let group = c.num_heads / c.num_kv_heads;
        let (hd, kvd) = (c.head_dim, c.kv_dim());
        let expect = match site {
            SiteKind::OIn => kvd,
            SiteKind::AttnIn | SiteKind::MlpIn => c.hidden_size,
            SiteKind::DownIn => c.intermediate_size,
        };
        if s.len() != expect || s.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
            return Err(Error::InvalidArgument(format!(
                "a smoothing scale for {site:?} needs {expect} finite positive factors"
            )));
        }
        let inv: Vec<f32> = s.iter().map(|x| 1.0 / x).collect();
        let l = &mut self.layers[layer];
        match site {
            SiteKind::AttnIn => {
                l.attn_norm.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                for m in [&mut l.q, &mut l.k, &mut l.v] {
                    m.scale_cols(s);
                }
            }
            SiteKind::MlpIn => {
                l.mlp_norm.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                l.gate.scale_cols(s);
                l.up.scale_cols(s);
            }
            SiteKind::DownIn => {
                l.up.scale_rows(&inv);
                l.down.scale_cols(s);
            }
            SiteKind::OIn => {
                l.v.scale_rows(&inv);
                if let Some(b) = &mut l.v_bias {
                    b.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                }
                // o_proj's input channel (head h, dim d) is KV channel (h / group, d).
                let expanded: Vec<f32> = (0..c.q_dim())
                    .map(|j| s[(j / hd / group) * hd + j % hd])
                    .collect();
                l.o.scale_cols(&expanded);
            }
        }
        Ok(())
    }

    /// Moves every RMSNorm weight into the columns of the layers that read the normalized
    /// activation, leaving unit norm weights (what a rotation of the residual stream needs:
    /// `rmsnorm(x R) = rmsnorm(x) R` only without a per-channel weight). Unties the head.
    /// Refused for Qwen3's per-head QK norms, which are not linear.
    pub fn fold_norms(&mut self) -> Result<()> {
        self.untie_head();
        for l in &mut self.layers {
            for m in [&mut l.q, &mut l.k, &mut l.v] {
                m.scale_cols(&l.attn_norm);
            }
            l.attn_norm.iter_mut().for_each(|w| *w = 1.0);
            l.gate.scale_cols(&l.mlp_norm);
            l.up.scale_cols(&l.mlp_norm);
            l.mlp_norm.iter_mut().for_each(|w| *w = 1.0);
        }
        let head = self.lm_head.as_mut().expect("untied above");
        head.scale_cols(&self.final_norm);
        self.final_norm.iter_mut().for_each(|w| *w = 1.0);
        Ok(())
    }

    /// Rotates the residual stream by the orthogonal `r` (`hidden x hidden`): every token's
    /// hidden state `x` becomes `x r`. The embedding table and the writers into the stream
    /// (o_proj, down_proj) are rotated on their output side, every reader (q/k/v, gate/up, the
    /// head) on its input side. Needs unit norm weights: call [`Self::fold_norms`] first.
    pub fn rotate_residual(&mut self, r: &Mat) -> Result<()> {
        let h = self.config.hidden_size;
        if r.rows != h || r.cols != h {
            return Err(Error::InvalidArgument(format!(
                "a residual rotation must be {h}x{h}, got {}x{}",
                r.rows, r.cols
            )));
        }
        let unit = |w: &[f32]| w.iter().all(|&x| x == 1.0);
        if !(unit(&self.final_norm)
            && self
                .layers
                .iter()
                .all(|l| unit(&l.attn_norm) && unit(&l.mlp_norm)))
        {
            return Err(Error::InvalidArgument(
                "rotate_residual needs the norm weights folded first (fold_norms)".into(),
            ));
        }
        self.untie_head();
        self.embed = self.embed.matmul_right(r);
        let head = self.lm_head.as_mut().expect("untied above");
        *head = head.matmul_right(r);
        for l in &mut self.layers {
            for m in [&mut l.q, &mut l.k, &mut l.v, &mut l.gate, &mut l.up] {
                *m = m.matmul_right(r);
            }
            // Writers: W' = r^T W, computed as (W^T r)^T.
            for m in [&mut l.o, &mut l.down] {
                *m = m.transpose().matmul_right(r).transpose();
            }
        }
        Ok(())
    }

    /// The model's tensors under their Hugging Face names (biases and QK norms when present).
    pub fn tensor_names(&self) -> Vec<String> {
        let mut names = vec![
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".to_string(),
        ];
        if self.lm_head.is_some() {
            names.push("lm_head.weight".into());
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            names.push(format!("{p}.input_layernorm.weight"));
            names.push(format!("{p}.post_attention_layernorm.weight"));
            for kind in LinearKind::ALL {
                names.push(LinearId { layer: i, kind }.name());
            }
            for (b, n) in [
                (&l.q_bias, "self_attn.q_proj.bias"),
                (&l.k_bias, "self_attn.k_proj.bias"),
                (&l.v_bias, "self_attn.v_proj.bias"),
                (&l.q_norm, "self_attn.q_norm.weight"),
                (&l.k_norm, "self_attn.k_norm.weight"),
            ] {
                if b.is_some() {
                    names.push(format!("{p}.{n}"));
                }
            }
        }
        names
    }

    /// A tensor by Hugging Face name, as f32 values with its shape.
    pub fn tensor(&self, name: &str) -> Option<(Vec<usize>, &[f32])> {
        fn mat(m: &Mat) -> Option<(Vec<usize>, &[f32])> {
            Some((vec![m.rows, m.cols], m.data.as_slice()))
        }
        fn vec(v: &Vec<f32>) -> Option<(Vec<usize>, &[f32])> {
            Some((vec![v.len()], v.as_slice()))
        }
        match name {
            "model.embed_tokens.weight" => return mat(&self.embed),
            "lm_head.weight" => return self.lm_head.as_ref().and_then(mat),
            "model.norm.weight" => return vec(&self.final_norm),
            _ => {}
        }
        if let Some(id) = LinearId::parse(name) {
            return self
                .layers
                .get(id.layer)
                .and_then(|l| mat(l.linear(id.kind)));
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (i, suffix) = rest.split_once('.')?;
        let l = self.layers.get(i.parse::<usize>().ok()?)?;
        match suffix {
            "input_layernorm.weight" => vec(&l.attn_norm),
            "post_attention_layernorm.weight" => vec(&l.mlp_norm),
            "self_attn.q_proj.bias" => l.q_bias.as_ref().and_then(vec),
            "self_attn.k_proj.bias" => l.k_bias.as_ref().and_then(vec),
            "self_attn.v_proj.bias" => l.v_bias.as_ref().and_then(vec),
            "self_attn.q_norm.weight" => l.q_norm.as_ref().and_then(vec),
            "self_attn.k_norm.weight" => l.k_norm.as_ref().and_then(vec),
            _ => None,
        }
    }
}

impl TensorSource for DenseModel {
    fn get(&self, name: &str) -> Option<HostTensor> {
        let (shape, values) = self.tensor(name)?;
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        Some(HostTensor {
            name: name.to_string(),
            shape,
            format: WeightFormat::Ggml(GgmlType::F32),
            bytes: TensorBytes::Owned(Arc::new(bytes)),
        })
    }

    fn origin(&self) -> String {
        "the dense f32 model in memory".into()
    }
}

//! A model held as plain f32 matrices under Hugging Face names: what calibration runs, what the
//! offline transforms rewrite, and what the quantizers encode. It is also a [`TensorSource`], so
//! the ordinary `Transformer` (and so the ordinary CPU kernels) run it unchanged.
//!
//! The rewrites here keep the network's function: a per-channel scale or permutation of a linear
//! layer's input is folded into the op that produces that input, and a rotation of the residual
//! stream into everything that reads or writes it.
//!
//! Mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) hold their router, experts and
//! shared expert ([`SparseMlp`]). The router reads the same normalized input as the experts, so
//! every rewrite of that input treats it as one more reader (it stays f32, so the rewrite is
//! exact for it), and a rewrite of a down_proj input is per expert.

use std::sync::Arc;

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::config::{Arch, ModelConfig};
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

/// Which feed-forward of a sparse (mixture-of-experts) block a linear layer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Expert {
    /// Routed expert `e`: it reads only the tokens the router sends it.
    Routed(usize),
    /// Qwen2-MoE's shared expert: it reads every token, like a dense MLP.
    Shared,
}

/// One linear layer of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinearId {
    pub layer: usize,
    pub kind: LinearKind,
    /// The expert of a sparse block's gate/up/down; `None` for attention and dense MLPs.
    pub expert: Option<Expert>,
}

impl LinearId {
    /// An attention projection or a dense MLP's.
    pub fn dense(layer: usize, kind: LinearKind) -> LinearId {
        LinearId {
            layer,
            kind,
            expert: None,
        }
    }

    /// The Hugging Face tensor name of its weight in a checkpoint of `arch` (whose expert names
    /// differ: Mixtral's `block_sparse_moe.experts.E.w1`, Qwen's `mlp.experts.E.gate_proj`).
    pub fn name_in(self, arch: Arch) -> String {
        let p = format!("model.layers.{}", self.layer);
        let proj = match self.kind {
            LinearKind::Gate => 0,
            LinearKind::Up => 1,
            LinearKind::Down => 2,
            _ => return format!("{p}.{}.weight", self.kind.hf_suffix()),
        };
        match self.expert {
            None => format!("{p}.{}.weight", self.kind.hf_suffix()),
            Some(Expert::Routed(e)) => {
                let names = nibble_model::transformer::expert_names(arch, &p, e);
                format!("{}.weight", names[proj])
            }
            Some(Expert::Shared) => {
                let n = ["gate_proj", "up_proj", "down_proj"][proj];
                format!("{p}.mlp.shared_expert.{n}.weight")
            }
        }
    }

    /// Parses a Hugging Face weight name back (Mixtral's and Qwen's expert names alike).
    pub fn parse(name: &str) -> Option<LinearId> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer = layer.parse().ok()?;
        let suffix = rest.strip_suffix(".weight")?;
        if let Some(kind) = LinearKind::ALL
            .into_iter()
            .find(|k| k.hf_suffix() == suffix)
        {
            return Some(LinearId::dense(layer, kind));
        }
        let ffn_kind = |proj: &str| match proj {
            "gate_proj" | "w1" => Some(LinearKind::Gate),
            "up_proj" | "w3" => Some(LinearKind::Up),
            "down_proj" | "w2" => Some(LinearKind::Down),
            _ => None,
        };
        if let Some(proj) = suffix.strip_prefix("mlp.shared_expert.") {
            return Some(LinearId {
                layer,
                kind: ffn_kind(proj).filter(|_| !proj.starts_with('w'))?,
                expert: Some(Expert::Shared),
            });
        }
        let (experts, mixtral) = match suffix.strip_prefix("mlp.experts.") {
            Some(r) => (r, false),
            None => (suffix.strip_prefix("block_sparse_moe.experts.")?, true),
        };
        let (e, proj) = experts.split_once('.')?;
        if proj.starts_with('w') != mixtral {
            return None;
        }
        Some(LinearId {
            layer,
            kind: ffn_kind(proj)?,
            expert: Some(Expert::Routed(e.parse().ok()?)),
        })
    }

    /// The input this layer reads, as the calibration records it: a routed expert's own tokens.
    pub fn input(self) -> Site {
        Site {
            layer: self.layer,
            kind: self.kind.site(),
            expert: self.expert,
        }
    }
}

/// One linear-layer input of a block: where calibration statistics are kept, and (with `expert`
/// `None` for the MLP input) where a per-channel scale can be folded.
///
/// A sparse block's MLP input is one activation read by the router and every expert, so a scale
/// folds there once, into the norm, for all of them; each routed expert's share of it
/// (`expert: Some(Routed(e))`) has its own statistics but no fold of its own. Each expert's
/// down_proj input is its own, with both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Site {
    pub layer: usize,
    pub kind: SiteKind,
    pub expert: Option<Expert>,
}

impl Site {
    pub fn dense(layer: usize, kind: SiteKind) -> Site {
        Site {
            layer,
            kind,
            expert: None,
        }
    }
}

/// A gated MLP: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

impl Mlp {
    fn linear(&self, kind: LinearKind) -> Option<&Mat> {
        match kind {
            LinearKind::Gate => Some(&self.gate),
            LinearKind::Up => Some(&self.up),
            LinearKind::Down => Some(&self.down),
            _ => None,
        }
    }

    fn linear_mut(&mut self, kind: LinearKind) -> Option<&mut Mat> {
        match kind {
            LinearKind::Gate => Some(&mut self.gate),
            LinearKind::Up => Some(&mut self.up),
            LinearKind::Down => Some(&mut self.down),
            _ => None,
        }
    }
}

/// A mixture-of-experts feed-forward (see `nibble_model::config::MoeConfig`). The router and the
/// shared expert's gate stay f32: each is one output row per expert (or one), a rounding error
/// in them changes which experts a token runs, and they cost nothing next to the experts.
#[derive(Debug, Clone)]
pub struct SparseMlp {
    /// `[experts, hidden]`.
    pub router: Mat,
    pub experts: Vec<Mlp>,
    /// Qwen2-MoE's shared expert and its gate `[1, hidden]`.
    pub shared: Option<(Mlp, Mat)>,
}

impl SparseMlp {
    pub fn expert(&self, e: Expert) -> Option<&Mlp> {
        match e {
            Expert::Routed(i) => self.experts.get(i),
            Expert::Shared => self.shared.as_ref().map(|(m, _)| m),
        }
    }

    pub fn expert_mut(&mut self, e: Expert) -> Option<&mut Mlp> {
        match e {
            Expert::Routed(i) => self.experts.get_mut(i),
            Expert::Shared => self.shared.as_mut().map(|(m, _)| m),
        }
    }

    /// Every expert, routed ones in order, then the shared one.
    pub fn all(&self) -> Vec<(Expert, &Mlp)> {
        let mut out: Vec<(Expert, &Mlp)> = self
            .experts
            .iter()
            .enumerate()
            .map(|(e, m)| (Expert::Routed(e), m))
            .collect();
        if let Some((m, _)) = &self.shared {
            out.push((Expert::Shared, m));
        }
        out
    }
}

/// A block's feed-forward.
#[derive(Debug, Clone)]
pub enum Ffn {
    Dense(Mlp),
    Sparse(Box<SparseMlp>),
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
    pub ffn: Ffn,
}

impl DenseLayer {
    /// A linear layer of this block; `None` for an expert (or a dense MLP) it does not have.
    pub fn linear(&self, kind: LinearKind, expert: Option<Expert>) -> Option<&Mat> {
        match (kind, &self.ffn, expert) {
            (LinearKind::Q, _, None) => Some(&self.q),
            (LinearKind::K, _, None) => Some(&self.k),
            (LinearKind::V, _, None) => Some(&self.v),
            (LinearKind::O, _, None) => Some(&self.o),
            (_, Ffn::Dense(m), None) => m.linear(kind),
            (_, Ffn::Sparse(s), Some(e)) => s.expert(e)?.linear(kind),
            _ => None,
        }
    }

    pub fn linear_mut(&mut self, kind: LinearKind, expert: Option<Expert>) -> Option<&mut Mat> {
        match (kind, &mut self.ffn, expert) {
            (LinearKind::Q, _, None) => Some(&mut self.q),
            (LinearKind::K, _, None) => Some(&mut self.k),
            (LinearKind::V, _, None) => Some(&mut self.v),
            (LinearKind::O, _, None) => Some(&mut self.o),
            (_, Ffn::Dense(m), None) => m.linear_mut(kind),
            (_, Ffn::Sparse(s), Some(e)) => s.expert_mut(e)?.linear_mut(kind),
            _ => None,
        }
    }

    /// The dense MLP, refusing a sparse block (for transforms defined on one MLP only).
    pub fn dense_mlp_mut(&mut self) -> Result<&mut Mlp> {
        match &mut self.ffn {
            Ffn::Dense(m) => Ok(m),
            Ffn::Sparse(_) => Err(Error::unsupported(
                "this transform on a mixture-of-experts block",
                "it is defined on one dense MLP per block",
            )),
        }
    }

    pub fn sparse(&self) -> Option<&SparseMlp> {
        match &self.ffn {
            Ffn::Dense(_) => None,
            Ffn::Sparse(s) => Some(s),
        }
    }

    /// Every matrix reading the normalized MLP input: gate/up of every expert, and in a sparse
    /// block the router and the shared expert's gate as well.
    pub fn mlp_readers_mut(&mut self) -> Vec<&mut Mat> {
        ffn_readers(&mut self.ffn)
    }

    /// Every down_proj (each writes into the residual stream).
    pub fn mlp_writers_mut(&mut self) -> Vec<&mut Mat> {
        ffn_writers(&mut self.ffn)
    }

    /// Every matrix reading the residual stream (through a norm): q/k/v and the MLP readers.
    pub fn residual_readers_mut(&mut self) -> Vec<&mut Mat> {
        let mut out = vec![&mut self.q, &mut self.k, &mut self.v];
        out.extend(ffn_readers(&mut self.ffn));
        out
    }

    /// Every matrix writing into the residual stream: o_proj and every down_proj.
    pub fn residual_writers_mut(&mut self) -> Vec<&mut Mat> {
        let mut out = vec![&mut self.o];
        out.extend(ffn_writers(&mut self.ffn));
        out
    }
}

fn ffn_readers(ffn: &mut Ffn) -> Vec<&mut Mat> {
    match ffn {
        Ffn::Dense(m) => vec![&mut m.gate, &mut m.up],
        Ffn::Sparse(s) => {
            let s = &mut **s;
            let mut out = vec![&mut s.router];
            for m in &mut s.experts {
                out.push(&mut m.gate);
                out.push(&mut m.up);
            }
            if let Some((m, g)) = &mut s.shared {
                out.extend([&mut m.gate, &mut m.up, g]);
            }
            out
        }
    }
}

fn ffn_writers(ffn: &mut Ffn) -> Vec<&mut Mat> {
    match ffn {
        Ffn::Dense(m) => vec![&mut m.down],
        Ffn::Sparse(s) => {
            let s = &mut **s;
            let mut out: Vec<&mut Mat> = s.experts.iter_mut().map(|m| &mut m.down).collect();
            if let Some((m, _)) = &mut s.shared {
                out.push(&mut m.down);
            }
            out
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
        let sparse_extra = c.moe.as_ref().map_or(0, |m| {
            let per_layer = 1
                + 3 * m.num_experts
                + 4 * usize::from(m.shared_expert_intermediate_size.is_some());
            m.sparse_layers.iter().filter(|&&s| s).count() * (per_layer - 3)
        });
        let total = 3 + c.num_layers * 9 + sparse_extra;
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
        let mlp = |[gate, up, down]: [String; 3], ff: usize| -> Result<Mlp> {
            Ok(Mlp {
                gate: mat(&format!("{gate}.weight"), ff, h)?,
                up: mat(&format!("{up}.weight"), ff, h)?,
                down: mat(&format!("{down}.weight"), h, ff)?,
            })
        };
        // The same tensors `Transformer::load` reads, under the same names, so a model this
        // loads is one the engine runs.
        let ffn = |i: usize| -> Result<Ffn> {
            let p = format!("model.layers.{i}");
            let Some(m) = c.moe.as_ref().filter(|m| m.sparse_layers[i]) else {
                let names = ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{p}.mlp.{n}"));
                return Ok(Ffn::Dense(mlp(names, ff)?));
            };
            let router_name = nibble_model::transformer::router_name(c.arch, &p);
            let router = mat(&format!("{router_name}.weight"), m.num_experts, h)?;
            let experts = (0..m.num_experts)
                .map(|e| {
                    mlp(
                        nibble_model::transformer::expert_names(c.arch, &p, e),
                        m.expert_intermediate_size,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let shared = match m.shared_expert_intermediate_size {
                None => None,
                Some(sf) => {
                    let names = ["gate_proj", "up_proj", "down_proj"]
                        .map(|n| format!("{p}.mlp.shared_expert.{n}"));
                    let gate = mat(&format!("{p}.mlp.shared_expert_gate.weight"), 1, h)?;
                    Some((mlp(names, sf)?, gate))
                }
            };
            Ok(Ffn::Sparse(Box::new(SparseMlp {
                router,
                experts,
                shared,
            })))
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
                ffn: ffn(i)?,
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

    /// A linear layer of the model; `id` must be one of [`Self::linear_ids`].
    pub fn linear(&self, id: LinearId) -> &Mat {
        self.layers
            .get(id.layer)
            .and_then(|l| l.linear(id.kind, id.expert))
            .unwrap_or_else(|| panic!("the model has no linear layer {id:?}"))
    }

    pub fn linear_mut(&mut self, id: LinearId) -> &mut Mat {
        self.layers
            .get_mut(id.layer)
            .and_then(|l| l.linear_mut(id.kind, id.expert))
            .unwrap_or_else(|| panic!("the model has no linear layer {id:?}"))
    }

    /// Whether `id` names a linear layer of this model.
    pub fn has_linear(&self, id: LinearId) -> bool {
        self.layers
            .get(id.layer)
            .is_some_and(|l| l.linear(id.kind, id.expert).is_some())
    }

    /// The Hugging Face name of a linear layer's weight in this model's checkpoints.
    pub fn linear_name(&self, id: LinearId) -> String {
        id.name_in(self.config.arch)
    }

    /// Every linear layer of every block, in execution order (a sparse block's experts in
    /// order, then its shared expert). Routers are not linear layers here: they stay f32.
    pub fn linear_ids(&self) -> Vec<LinearId> {
        let mut out = Vec::new();
        for (layer, l) in self.layers.iter().enumerate() {
            for kind in [LinearKind::Q, LinearKind::K, LinearKind::V, LinearKind::O] {
                out.push(LinearId::dense(layer, kind));
            }
            let experts: Vec<Option<Expert>> = match &l.ffn {
                Ffn::Dense(_) => vec![None],
                Ffn::Sparse(s) => s.all().into_iter().map(|(e, _)| Some(e)).collect(),
            };
            for expert in experts {
                for kind in [LinearKind::Gate, LinearKind::Up, LinearKind::Down] {
                    out.push(LinearId {
                        layer,
                        kind,
                        expert,
                    });
                }
            }
        }
        out
    }

    /// Every site a per-channel scale folds into, in execution order: per block the attention
    /// input, o_proj's input, the MLP input (one for all experts of a sparse block), then each
    /// MLP's down_proj input.
    pub fn sites(&self) -> Vec<Site> {
        let mut out = Vec::new();
        for (layer, l) in self.layers.iter().enumerate() {
            for kind in [SiteKind::AttnIn, SiteKind::OIn, SiteKind::MlpIn] {
                out.push(Site::dense(layer, kind));
            }
            match &l.ffn {
                Ffn::Dense(_) => out.push(Site::dense(layer, SiteKind::DownIn)),
                Ffn::Sparse(s) => out.extend(s.all().into_iter().map(|(e, _)| Site {
                    layer,
                    kind: SiteKind::DownIn,
                    expert: Some(e),
                })),
            }
        }
        out
    }

    /// The quantized linear layers reading fold site `site` (the router and the shared expert's
    /// gate read a sparse block's MLP input too, but stay f32).
    pub fn readers(&self, site: Site) -> Vec<LinearId> {
        let Some(l) = self.layers.get(site.layer) else {
            return Vec::new();
        };
        let at = |kind, expert| LinearId {
            layer: site.layer,
            kind,
            expert,
        };
        match (site.kind, &l.ffn, site.expert) {
            (SiteKind::MlpIn, Ffn::Sparse(s), None) => s
                .all()
                .into_iter()
                .flat_map(|(e, _)| [at(LinearKind::Gate, Some(e)), at(LinearKind::Up, Some(e))])
                .collect(),
            (kind, _, expert) => kind
                .readers()
                .iter()
                .map(|&k| at(k, expert))
                .filter(|&id| self.has_linear(id))
                .collect(),
        }
    }

    /// Gives the model its own output head (a copy of the embedding table when tied), so
    /// transforms of the head's input need not touch the embedding's.
    pub fn untie_head(&mut self) {
        if self.lm_head.is_none() {
            self.lm_head = Some(self.embed.clone());
        }
    }

    /// [`Self::fold_scale`] at a site of a dense block (or a sparse block's attention or MLP
    /// input).
    pub fn fold_input_scale(&mut self, layer: usize, site: SiteKind, s: &[f32]) -> Result<()> {
        self.fold_scale(Site::dense(layer, site), s)
    }

    /// The number of factors [`Self::fold_scale`] takes at `site`.
    pub fn factor_count(&self, site: Site) -> usize {
        let c = &self.config;
        match site.kind {
            SiteKind::AttnIn | SiteKind::MlpIn => c.hidden_size,
            SiteKind::OIn => c.kv_dim(),
            SiteKind::DownIn => self
                .readers(site)
                .first()
                .map_or(0, |&id| self.linear(id).cols),
        }
    }

    /// Divides input `site` by `s` channel-wise and multiplies the columns of every layer
    /// reading it by `s`: the function is unchanged, the activation's range moves into the
    /// weights (SmoothQuant, AWQ). The division is folded into the op producing the input: the
    /// RMSNorm weight (block and MLP inputs; in a sparse block the router and the shared
    /// expert's gate read it too and take `s` on their columns), the rows of v_proj (o_proj's
    /// input; one factor per KV channel, shared by the query heads of its group), the rows of
    /// up_proj (down_proj's input, per expert in a sparse block).
    pub fn fold_scale(&mut self, site: Site, s: &[f32]) -> Result<()> {
        let c = &self.config;
        let group = c.num_heads / c.num_kv_heads;
        let (hd, kvd, q_dim) = (c.head_dim, c.kv_dim(), c.q_dim());
        let valid = match (site.kind, site.expert) {
            (SiteKind::MlpIn | SiteKind::AttnIn | SiteKind::OIn, None) => {
                site.layer < self.layers.len()
            }
            (SiteKind::DownIn, _) => !self.readers(site).is_empty(),
            _ => false,
        };
        if !valid {
            return Err(Error::InvalidArgument(format!(
                "{site:?} is not a site of this model a scale folds into"
            )));
        }
        let expect = self.factor_count(site);
        if s.len() != expect || s.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
            return Err(Error::InvalidArgument(format!(
                "a smoothing scale for {site:?} needs {expect} finite positive factors"
            )));
        }
        let inv: Vec<f32> = s.iter().map(|x| 1.0 / x).collect();
        let l = &mut self.layers[site.layer];
        match site.kind {
            SiteKind::AttnIn => {
                l.attn_norm.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                for m in [&mut l.q, &mut l.k, &mut l.v] {
                    m.scale_cols(s);
                }
            }
            SiteKind::MlpIn => {
                l.mlp_norm.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                for m in l.mlp_readers_mut() {
                    m.scale_cols(s);
                }
            }
            SiteKind::DownIn => {
                let up = l
                    .linear_mut(LinearKind::Up, site.expert)
                    .expect("checked above");
                up.scale_rows(&inv);
                let down = l
                    .linear_mut(LinearKind::Down, site.expert)
                    .expect("checked above");
                down.scale_cols(s);
            }
            SiteKind::OIn => {
                debug_assert_eq!(s.len(), kvd);
                l.v.scale_rows(&inv);
                if let Some(b) = &mut l.v_bias {
                    b.iter_mut().zip(&inv).for_each(|(w, i)| *w *= i);
                }
                // o_proj's input channel (head h, dim d) is KV channel (h / group, d).
                let expanded: Vec<f32> = (0..q_dim)
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
            let norm = std::mem::take(&mut l.mlp_norm);
            for m in l.mlp_readers_mut() {
                m.scale_cols(&norm);
            }
            l.mlp_norm = vec![1.0; norm.len()];
        }
        let head = self.lm_head.as_mut().expect("untied above");
        head.scale_cols(&self.final_norm);
        self.final_norm.iter_mut().for_each(|w| *w = 1.0);
        Ok(())
    }

    /// Rotates the residual stream by the orthogonal `r` (`hidden x hidden`): every token's
    /// hidden state `x` becomes `x r`. The embedding table and the writers into the stream
    /// (o_proj, down_proj) are rotated on their output side, every reader (q/k/v, gate/up, a
    /// router, the head) on its input side. Needs unit norm weights: call [`Self::fold_norms`]
    /// first.
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
            for m in l.residual_readers_mut() {
                *m = m.matmul_right(r);
            }
            // Writers: W' = r^T W, computed as (W^T r)^T.
            for m in l.residual_writers_mut() {
                *m = m.transpose().matmul_right(r).transpose();
            }
        }
        Ok(())
    }

    /// The model's tensors under their Hugging Face names (biases and QK norms when present).
    pub fn tensor_names(&self) -> Vec<String> {
        let arch = self.config.arch;
        let mut names = vec![
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".to_string(),
        ];
        if self.lm_head.is_some() {
            names.push("lm_head.weight".into());
        }
        let ids = self.linear_ids();
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            names.push(format!("{p}.input_layernorm.weight"));
            names.push(format!("{p}.post_attention_layernorm.weight"));
            names.extend(
                ids.iter()
                    .filter(|id| id.layer == i)
                    .map(|id| id.name_in(arch)),
            );
            if let Some(s) = l.sparse() {
                let router = nibble_model::transformer::router_name(arch, &p);
                names.push(format!("{router}.weight"));
                if s.shared.is_some() {
                    names.push(format!("{p}.mlp.shared_expert_gate.weight"));
                }
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
            // Mixtral's names only in a Mixtral model, Qwen's only in others: one name per
            // tensor, as the engine's loader reads it.
            if id.name_in(self.config.arch) != name {
                return None;
            }
            return self
                .layers
                .get(id.layer)
                .and_then(|l| l.linear(id.kind, id.expert))
                .and_then(mat);
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (i, suffix) = rest.split_once('.')?;
        let l = self.layers.get(i.parse::<usize>().ok()?)?;
        if let Some(s) = l.sparse() {
            let p = format!("model.layers.{i}");
            let router = nibble_model::transformer::router_name(self.config.arch, &p);
            if name.strip_suffix(".weight") == Some(router.as_str()) {
                return mat(&s.router);
            }
            if suffix == "mlp.shared_expert_gate.weight" {
                return s.shared.as_ref().and_then(|(_, g)| mat(g));
            }
        }
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

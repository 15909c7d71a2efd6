//! The decoder-only transformer shared by Llama, Mistral, Qwen2, Qwen3 and Gemma 3 and the
//! mixture-of-experts relatives (Mixtral, Qwen2-MoE, Qwen3-MoE), written once against `Backend`.
//! Architectural differences are data: optional QKV biases (Qwen2), optional per-head QK norms
//! (Qwen3, Gemma 3), tied or separate output head, rotary scaling, per layer a dense or sparse
//! feed-forward, a sliding window and its rotary base; Gemma 3 adds norms after attention and the
//! feed-forward, GeGLU, `(1 + w)` norm scales and a scaled embedding.

use nibble_core::{Error, Result};
use nibble_precision::KvSpec;

use crate::backend::{AttentionShape, Backend, BatchLayout, KvShape};
use crate::backend::{RoutedExpert, ScaledRows};
use crate::config::{Arch, ModelConfig, TensorLayout};
use crate::source::TensorSource;

/// Projections that read the same input: one weight each with their biases, or one fused
/// weight (rows stacked) with its stacked bias, when the backend asked for it.
enum Projections<B: Backend> {
    Separate(Vec<(B::Weight, Option<B::Tensor>)>),
    Fused(B::Weight, Option<B::Tensor>, Vec<usize>),
}

impl<B: Backend> Projections<B> {
    /// Each projection of the RMSNorm of `x` (plus `delta`, which is added into `x`), in
    /// order: fused projections through [`Backend::norm_linear`], which may do it in one pass.
    fn apply_normed(
        &self,
        backend: &B,
        x: &mut B::Tensor,
        delta: Option<&B::Tensor>,
        norm: &B::Tensor,
        eps: f32,
    ) -> Result<Vec<B::Tensor>> {
        match self {
            Projections::Fused(w, b, widths) => backend.split_cols(
                &backend.norm_linear(x, delta, norm, eps, w, b.as_ref())?,
                widths,
            ),
            Projections::Separate(_) => self.apply(backend, &backend.pre_norm(x, delta, norm, eps)),
        }
    }

    /// Each projection of `x`, in order.
    fn apply(&self, backend: &B, x: &B::Tensor) -> Result<Vec<B::Tensor>> {
        match self {
            Projections::Separate(parts) => parts
                .iter()
                .map(|(w, b)| backend.linear(x, w, b.as_ref()))
                .collect(),
            Projections::Fused(w, b, widths) => {
                backend.split_cols(&backend.linear(x, w, b.as_ref())?, widths)
            }
        }
    }
}

/// The gate's activation of a gated feed-forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activation {
    /// SwiGLU (Llama and the others).
    Silu,
    /// GeGLU with tanh-approximated GELU (Gemma).
    GeluTanh,
}

/// A gated feed-forward's gate and up projections.
enum GateUp<B: Backend> {
    /// gate, up; the activation runs after them.
    Projections(Projections<B>),
    /// One weight whose product is `silu(gate x) * up x` already
    /// ([`Backend::load_swiglu_weight`]).
    SwiGlu(B::Weight),
}

/// A gated feed-forward: `down(act(gate x) * up x)`.
struct Mlp<B: Backend> {
    gate_up: GateUp<B>,
    down: B::Weight,
    act: Activation,
}

impl<B: Backend> Mlp<B> {
    /// This MLP over `rows`, for [`Backend::grouped_swiglu`]: SwiGLU with a fused gate/up only.
    fn routed<'a>(&'a self, rows: &'a [usize]) -> Option<RoutedExpert<'a, B::Weight>> {
        match (&self.gate_up, self.act) {
            (GateUp::Projections(Projections::Fused(gate_up, None, widths)), Activation::Silu)
                if widths.len() == 2 && widths[0] == widths[1] =>
            {
                Some(RoutedExpert {
                    gate_up,
                    down: &self.down,
                    rows,
                })
            }
            _ => None,
        }
    }

    fn apply(&self, backend: &B, x: &B::Tensor) -> Result<B::Tensor> {
        backend.linear(&self.activated(backend, x)?, &self.down, None)
    }

    /// A dense layer's MLP of the RMSNorm of `x + delta` (added into `x`; the norm left to
    /// [`Backend::norm_linear`] with the gate/up projection), its down projection summed over
    /// the ranks; with `next_norms`, the sum is read only by the next block's pre-norm
    /// ([`Backend::linear_summed_delta`]).
    fn apply_summed_normed(
        &self,
        backend: &B,
        x: &mut B::Tensor,
        delta: &B::Tensor,
        norm: &B::Tensor,
        eps: f32,
        next_norms: bool,
    ) -> Result<B::Tensor> {
        let activated = match &self.gate_up {
            GateUp::SwiGlu(w) => backend.norm_linear(x, Some(delta), norm, eps, w, None)?,
            GateUp::Projections(p) => self.act(
                backend,
                &p.apply_normed(backend, x, Some(delta), norm, eps)?,
            ),
        };
        if next_norms {
            backend.linear_summed_delta(&activated, &self.down)
        } else {
            backend.linear_summed(&activated, &self.down)
        }
    }

    /// `act(gate x) * up x`.
    fn activated(&self, backend: &B, x: &B::Tensor) -> Result<B::Tensor> {
        match &self.gate_up {
            GateUp::SwiGlu(w) => backend.linear(x, w, None),
            GateUp::Projections(p) => Ok(self.act(backend, &p.apply(backend, x)?)),
        }
    }

    /// `act(gate) * up` of the gate/up projections.
    fn act(&self, backend: &B, gate_up: &[B::Tensor]) -> B::Tensor {
        match self.act {
            Activation::Silu => backend.silu_mul(&gate_up[0], &gate_up[1]),
            Activation::GeluTanh => backend.gelu_tanh_mul(&gate_up[0], &gate_up[1]),
        }
    }
}

/// A mixture-of-experts feed-forward (see [`crate::config::MoeConfig`]).
struct Sparse<B: Backend> {
    /// `[experts, hidden]`: one logit per expert.
    router: B::Weight,
    experts: Vec<Mlp<B>>,
    /// Qwen2-MoE's shared expert and its gate `[1, hidden]`.
    shared: Option<(Mlp<B>, B::Weight)>,
    top_k: usize,
    renormalize: bool,
}

impl<B: Backend> Sparse<B> {
    /// Each token's experts run on the rows routed to them (a row's result does not depend on
    /// the other rows of a linear layer), and the sum over a token's experts is taken in expert
    /// order, then the shared expert: so a token's output is the same in any batch.
    fn apply(&self, backend: &B, x: &B::Tensor, tokens: usize, hidden: usize) -> Result<B::Tensor> {
        let logits = backend.to_host(&backend.linear(x, &self.router, None)?)?;
        let routes = crate::moe::route(&logits, self.experts.len(), self.top_k, self.renormalize)?;
        let routed: Vec<(&Mlp<B>, &crate::moe::ExpertRows)> = self
            .experts
            .iter()
            .zip(&routes)
            .filter(|(_, r)| !r.rows.is_empty())
            .collect();
        let grouped = match routed
            .iter()
            .map(|(e, r)| e.routed(&r.rows))
            .collect::<Option<Vec<_>>>()
        {
            Some(runs) => backend.grouped_swiglu(x, &runs)?,
            None => None,
        };
        let outputs: Vec<(B::Tensor, &crate::moe::ExpertRows)> = match grouped {
            Some(ys) => ys.into_iter().zip(routed.iter().map(|(_, r)| *r)).collect(),
            None => routed
                .iter()
                .map(|(e, r)| Ok((e.apply(backend, &backend.gather_rows(x, &r.rows))?, *r)))
                .collect::<Result<_>>()?,
        };
        let all_rows: Vec<usize> = (0..tokens).collect();
        let shared = match &self.shared {
            None => None,
            Some((mlp, gate)) => {
                let y = mlp.apply(backend, x)?;
                let g = backend.to_host(&backend.linear(x, gate, None)?)?;
                let scales: Vec<f32> = g.iter().map(|&g| 1.0 / (1.0 + (-g).exp())).collect();
                Some((y, scales))
            }
        };
        let mut parts: Vec<ScaledRows<'_, B::Tensor>> = outputs
            .iter()
            .map(|(y, r)| ScaledRows {
                x: y,
                rows: &r.rows,
                scales: &r.weights,
            })
            .collect();
        if let Some((y, scales)) = &shared {
            parts.push(ScaledRows {
                x: y,
                rows: &all_rows,
                scales,
            });
        }
        backend.scatter_add_scaled(tokens, hidden, &parts)
    }
}

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Sparse(Box<Sparse<B>>),
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    /// q, k, v.
    qkv: Projections<B>,
    o: B::Weight,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    /// Gemma's norm of the attention output, before the residual add.
    post_attn_norm: Option<B::Tensor>,
    /// The feed-forward's input norm (`post_attention_layernorm` in Llama's names,
    /// `pre_feedforward_layernorm` in Gemma's).
    mlp_norm: B::Tensor,
    ffn: Ffn<B>,
    /// Gemma's norm of the feed-forward output, before the residual add.
    post_ffn_norm: Option<B::Tensor>,
    /// Sliding window of this layer's attention.
    window: Option<usize>,
    /// Whether the layer rotates with `Transformer::local_inv_freq` (Gemma's sliding layers).
    local_rope: bool,
}

/// The Hugging Face names (without `.weight`) of a sparse layer's tensors, under the layer prefix
/// `p`: the router, and expert `e`'s gate, up and down projections. Mixtral's checkpoints name
/// them `block_sparse_moe.*` and `w1`/`w3`/`w2`; Qwen's `mlp.*`.
pub fn router_name(arch: Arch, p: &str) -> String {
    match arch {
        Arch::Mixtral => format!("{p}.block_sparse_moe.gate"),
        _ => format!("{p}.mlp.gate"),
    }
}

pub fn expert_names(arch: Arch, p: &str, e: usize) -> [String; 3] {
    match arch {
        Arch::Mixtral => {
            ["w1", "w3", "w2"].map(|w| format!("{p}.block_sparse_moe.experts.{e}.{w}"))
        }
        _ => ["gate_proj", "up_proj", "down_proj"].map(|w| format!("{p}.mlp.experts.{e}.{w}")),
    }
}

pub struct Transformer<B: Backend> {
    pub config: ModelConfig,
    /// How the KV pools this model makes store keys and values (`kv16` after loading).
    pub kv_format: KvSpec,
    embed: B::Weight,
    /// `None` when the output head is tied to the embedding table.
    lm_head: Option<B::Weight>,
    /// Parts the output head is split into by vocabulary (a tensor-parallel rank holds one):
    /// 1 for the whole head; otherwise the logits are gathered across the ranks.
    head_parts: usize,
    final_norm: B::Tensor,
    inv_freq: B::Tensor,
    /// Gemma 3's rotary frequencies of its sliding-window layers.
    local_inv_freq: Option<B::Tensor>,
    layers: Vec<Layer<B>>,
}

/// Block size of [`Transformer::single_sequence_kv`] pools: the smallest block the channel-wise
/// KV formats accept (their quantization group).
pub const SINGLE_SEQUENCE_BLOCK: usize = nibble_precision::kv::MIN_CHANNEL_BLOCK;

/// Which rows of the batch get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every token (perplexity, prompt scoring).
    All,
    /// The last token of each sequence (generation).
    LastPerSeq,
}

struct Loader<'a, B: Backend> {
    backend: &'a B,
    source: &'a dyn TensorSource,
    progress: &'a mut dyn FnMut(usize, usize),
    done: usize,
    total: usize,
    /// Added to every norm scale: 1 for Gemma, whose RMSNorm multiplies by `1 + w`.
    norm_shift: f32,
    /// The gated feed-forward's activation.
    act: Activation,
}

impl<B: Backend> Loader<'_, B> {
    fn tick(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total);
    }

    fn host(&self, name: &str, shape: &[usize]) -> Result<nibble_formats::HostTensor> {
        let t = self.source.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            source_name: self.source.origin(),
        })?;
        t.expect_shape(shape)?;
        Ok(t)
    }

    fn weight(&mut self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        let t = self.host(name, shape)?;
        let w = self.backend.load_weight(&t)?;
        self.tick();
        Ok(w)
    }

    /// The untied output head, `[vocab, hidden]`, or the `[vocab / N, hidden]` slice of it a
    /// tensor-parallel rank's source gives: the weight and the parts the vocabulary is in.
    fn head(&mut self, vocab: usize, hidden: usize) -> Result<(B::Weight, usize)> {
        let name = "lm_head.weight";
        let t = self.source.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            source_name: self.source.origin(),
        })?;
        let rows = t.shape.first().copied().unwrap_or(0);
        if rows == 0 || !vocab.is_multiple_of(rows) {
            return Err(Error::InvalidArgument(format!(
                "{name} has {rows} rows, not the vocabulary's {vocab} or a part of it"
            )));
        }
        t.expect_shape(&[rows, hidden])?;
        let w = self.backend.load_weight(&t)?;
        self.tick();
        Ok((w, vocab / rows))
    }

    /// A norm's scale, with the architecture's offset folded in (in f32, as Gemma's
    /// `x * (1.0 + w.float())` computes it).
    fn norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.vector_shifted(name, len, self.norm_shift)
    }

    fn optional_norm(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        if self.source.contains(name) {
            self.norm(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.vector_shifted(name, len, 0.0)
    }

    fn vector_shifted(&mut self, name: &str, len: usize, shift: f32) -> Result<B::Tensor> {
        let t = self.host(name, &[len])?;
        let mut values = t.to_f32()?;
        if shift != 0.0 {
            values.iter_mut().for_each(|x| *x += shift);
        }
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(Error::corrupt(
                self.source.origin(),
                format!("tensor '{name}' holds a non-finite value at index {i}"),
            ));
        }
        let v = self.backend.load_vector(&values)?;
        self.tick();
        Ok(v)
    }

    /// Projections `(prefix, rows)` of `cols` inputs (`prefix.weight`, optional `prefix.bias`),
    /// fused into one weight when the backend wants that.
    fn projections(&mut self, parts: &[(String, usize)], cols: usize) -> Result<Projections<B>> {
        let hosts = self.hosts(parts, cols)?;
        self.projections_of(parts, hosts, cols)
    }

    /// The `[rows, cols]` weights of `parts`, read but not uploaded.
    fn hosts(
        &self,
        parts: &[(String, usize)],
        cols: usize,
    ) -> Result<Vec<nibble_formats::HostTensor>> {
        parts
            .iter()
            .map(|(p, rows)| self.host(&format!("{p}.weight"), &[*rows, cols]))
            .collect()
    }

    /// [`Self::projections`] of the weights `hosts` of `parts`, already read.
    fn projections_of(
        &mut self,
        parts: &[(String, usize)],
        hosts: Vec<nibble_formats::HostTensor>,
        cols: usize,
    ) -> Result<Projections<B>> {
        if let Some(w) = self.backend.load_fused_weight(&hosts)? {
            let mut bias = Vec::new();
            let mut any = false;
            for (p, rows) in parts {
                self.tick();
                match self.optional_vector_values(&format!("{p}.bias"), *rows)? {
                    Some(b) => {
                        bias.extend(b);
                        any = true;
                    }
                    None => bias.extend(std::iter::repeat_n(0.0, *rows)),
                }
            }
            let bias = if any {
                Some(self.backend.load_vector(&bias)?)
            } else {
                None
            };
            let widths = parts.iter().map(|(_, r)| *r).collect();
            return Ok(Projections::Fused(w, bias, widths));
        }
        drop(hosts);
        let mut out = Vec::new();
        for (p, rows) in parts {
            let w = self.weight(&format!("{p}.weight"), &[*rows, cols])?;
            let b = self.optional_vector(&format!("{p}.bias"), *rows)?;
            out.push((w, b));
        }
        Ok(Projections::Separate(out))
    }

    /// The values of an optional vector, checked, without uploading them.
    fn optional_vector_values(&mut self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if !self.source.contains(name) {
            return Ok(None);
        }
        let values = self.host(name, &[len])?.to_f32()?;
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(Error::corrupt(
                self.source.origin(),
                format!("tensor '{name}' holds a non-finite value at index {i}"),
            ));
        }
        Ok(Some(values))
    }

    /// A SwiGLU MLP of width `ff` whose projections are `{gate, up, down}.weight`.
    fn mlp(&mut self, [gate, up, down]: [String; 3], h: usize, ff: usize) -> Result<Mlp<B>> {
        Ok(Mlp {
            gate_up: GateUp::Projections(self.projections(&[(gate, ff), (up, ff)], h)?),
            down: self.weight(&format!("{down}.weight"), &[h, ff])?,
            act: self.act,
        })
    }

    /// A dense layer's MLP: [`Self::mlp`], with SiLU's gate and up as one activated weight where
    /// the backend offers it ([`Backend::load_swiglu_weight`]) and they have no biases. (Routed
    /// experts keep [`Self::mlp`]: the grouped kernels read a plain gate/up weight.)
    fn dense_mlp(&mut self, names: [String; 3], h: usize, ff: usize) -> Result<Mlp<B>> {
        let [gate, up, down] = names;
        let parts = [(gate, ff), (up, ff)];
        let hosts = self.hosts(&parts, h)?;
        let biased = parts
            .iter()
            .any(|(p, _)| self.source.contains(&format!("{p}.bias")));
        let swiglu = match self.act == Activation::Silu && !biased {
            true => self.backend.load_swiglu_weight(&hosts[0], &hosts[1])?,
            false => None,
        };
        let gate_up = match swiglu {
            Some(w) => {
                drop(hosts);
                self.tick();
                self.tick();
                GateUp::SwiGlu(w)
            }
            None => GateUp::Projections(self.projections_of(&parts, hosts, h)?),
        };
        Ok(Mlp {
            gate_up,
            down: self.weight(&format!("{down}.weight"), &[h, ff])?,
            act: self.act,
        })
    }

    /// Layer `i`'s feed-forward, dense or sparse as the config says.
    fn ffn(&mut self, c: &ModelConfig, i: usize) -> Result<Ffn<B>> {
        let p = format!("model.layers.{i}");
        let h = c.hidden_size;
        let Some(m) = c.moe.as_ref().filter(|m| m.sparse_layers[i]) else {
            let names = ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{p}.mlp.{n}"));
            return Ok(Ffn::Dense(self.dense_mlp(names, h, c.intermediate_size)?));
        };
        let router = self.weight(
            &format!("{}.weight", router_name(c.arch, &p)),
            &[m.num_experts, h],
        )?;
        let experts = (0..m.num_experts)
            .map(|e| self.mlp(expert_names(c.arch, &p, e), h, m.expert_intermediate_size))
            .collect::<Result<Vec<_>>>()?;
        let shared = match m.shared_expert_intermediate_size {
            None => None,
            Some(sf) => {
                let names = ["gate_proj", "up_proj", "down_proj"]
                    .map(|n| format!("{p}.mlp.shared_expert.{n}"));
                let mlp = self.mlp(names, h, sf)?;
                let gate = self.weight(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?;
                Some((mlp, gate))
            }
        };
        Ok(Ffn::Sparse(Box::new(Sparse {
            router,
            experts,
            shared,
            top_k: m.top_k,
            renormalize: m.renormalize,
        })))
    }

    fn optional_vector(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        if self.source.contains(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Whether a tensor is multiplied (a weight a backend may store quantized) or read as floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// Embedding table, output head, or a projection `[out, in]`.
    Weight,
    /// A norm scale or a bias, always loaded as f32.
    Vector,
}

/// Every tensor [`Transformer::load`] reads for `config` with `layout`, under its Hugging Face
/// name, with its shape and role. Kept beside `load` so the two name the same set; the
/// checkpoint writer checks its input against it.
pub fn model_tensors(
    config: &ModelConfig,
    layout: &TensorLayout,
) -> Vec<(String, Vec<usize>, TensorRole)> {
    use TensorRole::{Vector, Weight};
    let c = config;
    let (h, qd, kvd, ff, hd) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.head_dim,
    );
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, h],
            Weight,
        ),
        ("model.norm.weight".to_string(), vec![h], Vector),
    ];
    if !layout.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![c.vocab_size, h], Weight));
    }
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let mut add =
            |n: &str, shape: Vec<usize>, role| out.push((format!("{p}.{n}"), shape, role));
        add("input_layernorm.weight", vec![h], Vector);
        add("post_attention_layernorm.weight", vec![h], Vector);
        if c.arch == Arch::Gemma3 {
            add("pre_feedforward_layernorm.weight", vec![h], Vector);
            add("post_feedforward_layernorm.weight", vec![h], Vector);
        }
        add("self_attn.q_proj.weight", vec![qd, h], Weight);
        add("self_attn.k_proj.weight", vec![kvd, h], Weight);
        add("self_attn.v_proj.weight", vec![kvd, h], Weight);
        add("self_attn.o_proj.weight", vec![h, qd], Weight);
        if layout.attention_bias {
            add("self_attn.q_proj.bias", vec![qd], Vector);
            add("self_attn.k_proj.bias", vec![kvd], Vector);
            add("self_attn.v_proj.bias", vec![kvd], Vector);
        }
        if layout.qk_norm {
            add("self_attn.q_norm.weight", vec![hd], Vector);
            add("self_attn.k_norm.weight", vec![hd], Vector);
        }
        let moe = c.moe.as_ref().filter(|m| m.sparse_layers[i]);
        let Some(m) = moe else {
            add("mlp.gate_proj.weight", vec![ff, h], Weight);
            add("mlp.up_proj.weight", vec![ff, h], Weight);
            add("mlp.down_proj.weight", vec![h, ff], Weight);
            continue;
        };
        let ef = m.expert_intermediate_size;
        let mut add =
            |n: String, shape: Vec<usize>| out.push((format!("{n}.weight"), shape, Weight));
        add(router_name(c.arch, &p), vec![m.num_experts, h]);
        for e in 0..m.num_experts {
            let [g, u, d] = expert_names(c.arch, &p, e);
            add(g, vec![ef, h]);
            add(u, vec![ef, h]);
            add(d, vec![h, ef]);
        }
        if let Some(sf) = m.shared_expert_intermediate_size {
            add(format!("{p}.mlp.shared_expert.gate_proj"), vec![sf, h]);
            add(format!("{p}.mlp.shared_expert.up_proj"), vec![sf, h]);
            add(format!("{p}.mlp.shared_expert.down_proj"), vec![h, sf]);
            add(format!("{p}.mlp.shared_expert_gate"), vec![1, h]);
        }
    }
    out
}

impl<B: Backend> Transformer<B> {
    /// Loads every weight through `backend`; `progress(done, total)` is called per tensor.
    pub fn load(
        backend: &B,
        config: ModelConfig,
        source: &dyn TensorSource,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &config;
        // Before any weight moves: a Mixtral-sized model is minutes of loading.
        if c.moe.is_some() {
            backend.check_moe()?;
        }
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let tied = !source.contains("lm_head.weight");
        // Tensors loaded per feed-forward beyond a dense one's three.
        let sparse_extra = c.moe.as_ref().map_or(0, |m| {
            let per_layer = 1
                + 3 * m.num_experts
                + if m.shared_expert_intermediate_size.is_some() {
                    4
                } else {
                    0
                };
            m.sparse_layers.iter().filter(|&&s| s).count() * (per_layer - 3)
        });
        let gemma = c.arch == Arch::Gemma3;
        let mut ld = Loader {
            backend,
            source,
            progress,
            done: 0,
            total: 2
                + usize::from(!tied)
                + c.num_layers * (9 + 2 * usize::from(gemma))
                + sparse_extra,
            norm_shift: if gemma { 1.0 } else { 0.0 },
            act: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
        };
        let embed = ld.weight("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let (lm_head, head_parts) = if tied {
            (None, 1)
        } else {
            let (w, parts) = ld.head(c.vocab_size, h)?;
            (Some(w), parts)
        };
        let final_norm = ld.norm("model.norm.weight", h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let attn = |n: &str| format!("{p}.self_attn.{n}_proj");
            let norm = |n: &str| format!("{p}.{n}.weight");
            let attn_norm = ld.norm(&norm("input_layernorm"), h)?;
            let qkv = ld.projections(&[(attn("q"), qd), (attn("k"), kvd), (attn("v"), kvd)], h)?;
            let o = ld.weight(&format!("{p}.self_attn.o_proj.weight"), &[h, qd])?;
            let q_norm = ld.optional_norm(&format!("{p}.self_attn.q_norm.weight"), hd)?;
            let k_norm = ld.optional_norm(&format!("{p}.self_attn.k_norm.weight"), hd)?;
            if gemma && (q_norm.is_none() || k_norm.is_none()) {
                return Err(Error::MissingTensor {
                    name: format!("{p}.self_attn.{{q,k}}_norm.weight"),
                    source_name: source.origin(),
                });
            }
            let (post_attn_norm, mlp_norm) = if gemma {
                (
                    Some(ld.norm(&norm("post_attention_layernorm"), h)?),
                    ld.norm(&norm("pre_feedforward_layernorm"), h)?,
                )
            } else {
                (None, ld.norm(&norm("post_attention_layernorm"), h)?)
            };
            let ffn = ld.ffn(c, i)?;
            let post_ffn_norm = if gemma {
                Some(ld.norm(&norm("post_feedforward_layernorm"), h)?)
            } else {
                None
            };
            layers.push(Layer {
                attn_norm,
                qkv,
                o,
                q_norm,
                k_norm,
                post_attn_norm,
                mlp_norm,
                ffn,
                post_ffn_norm,
                window: c.layer_window(i),
                local_rope: gemma && c.layer_window(i).is_some(),
            });
        }
        let inv_freq = backend.load_vector(&config.rope_inv_freq())?;
        let local = layers.iter().position(|l| l.local_rope);
        let local_inv_freq = local
            .map(|i| backend.load_vector(&config.layer_rope_inv_freq(i)))
            .transpose()?;
        Ok(Transformer {
            embed,
            lm_head,
            head_parts,
            final_norm,
            inv_freq,
            local_inv_freq,
            layers,
            config,
            kv_format: KvSpec::default(),
        })
    }

    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            format: self.kv_format,
        }
    }

    /// A KV pool holding one sequence of up to `max_tokens`, with its block table: for one-shot
    /// generation, perplexity and tests. Serving shares one pool through a block manager instead.
    pub fn single_sequence_kv(&self, backend: &B, max_tokens: usize) -> Result<(B::Kv, Vec<u32>)> {
        const BLOCK: usize = SINGLE_SEQUENCE_BLOCK;
        let blocks = max_tokens
            .min(self.config.max_context)
            .div_ceil(BLOCK)
            .max(1);
        let kv = backend.new_kv_pool(self.kv_shape(), blocks, BLOCK)?;
        Ok((kv, (0..blocks as u32).collect()))
    }

    /// Logits of each step of a teacher-forced decode along `tokens` in a fresh pool: the first
    /// `prompt` tokens as one step, then one token a step (what tests compare backends on).
    pub fn step_logits(&self, backend: &B, tokens: &[u32], prompt: usize) -> Result<Vec<Vec<f32>>> {
        let (mut kv, table) = self.single_sequence_kv(backend, tokens.len())?;
        let mut out = Vec::new();
        let mut pos = 0;
        let steps = std::iter::once(prompt).chain(std::iter::repeat_n(1, tokens.len() - prompt));
        for len in steps {
            let batch = BatchLayout::single(table.clone(), pos, len);
            let tokens = &tokens[pos..pos + len];
            let logits = self.forward(backend, tokens, &batch, &mut kv, LogitRows::LastPerSeq)?;
            out.push(backend.to_host(&logits)?);
            pos += len;
        }
        Ok(out)
    }

    /// Runs `tokens` (laid out as `batch` says) through the model, appending their keys and
    /// values to `kv`, and returns logits `[rows, vocab]` for the rows `which` selects.
    pub fn forward(
        &self,
        backend: &B,
        tokens: &[u32],
        batch: &BatchLayout,
        kv: &mut B::Kv,
        which: LogitRows,
    ) -> Result<B::Tensor> {
        let c = &self.config;
        if tokens.len() != batch.num_tokens() {
            return Err(Error::InvalidArgument(format!(
                "{} tokens for a batch layout of {}",
                tokens.len(),
                batch.num_tokens()
            )));
        }
        for s in &batch.seqs {
            if s.start_pos + s.len > c.max_context {
                return Err(Error::LimitExceeded {
                    what: "sequence length".into(),
                    value: s.start_pos + s.len,
                    limit: c.max_context,
                });
            }
            if s.len == 0 {
                return Err(Error::InvalidArgument(
                    "a batch sequence has no tokens".into(),
                ));
            }
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        backend.begin_forward(tokens, batch)?;
        let model = self as *const Self as usize;
        backend.run_forward(model, kv, batch, &mut |kv| {
            self.forward_layers(backend, tokens, batch, kv, which)
        })
    }

    /// The layers of [`Transformer::forward`], on validated input.
    fn forward_layers(
        &self,
        backend: &B,
        tokens: &[u32],
        batch: &BatchLayout,
        kv: &mut B::Kv,
        which: LogitRows,
    ) -> Result<B::Tensor> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let mut x = backend.embed(&self.embed, tokens)?;
        // Gemma's attention scale, as a factor on q next to the backend's 1/sqrt(head_dim)
        // (none when they agree, as in every Gemma 3 but the 27B).
        let mut q_scale = None;
        if let Some(g) = &c.gemma {
            // llama.cpp's f32 sqrt(hidden); Hugging Face rounds it to the weights' dtype.
            backend.scale(&mut x, (c.hidden_size as f32).sqrt());
            if g.query_pre_attn_scalar != c.head_dim as f64 {
                q_scale = Some((c.head_dim as f64 / g.query_pre_attn_scalar).sqrt() as f32);
            }
        }
        // The residual add of each block is fused into the next block's norm.
        let mut pending: Option<B::Tensor> = None;
        for (i, l) in self.layers.iter().enumerate() {
            backend.begin_layer(i);
            let delta = pending.take();
            let mut qkv = l
                .qkv
                .apply_normed(backend, &mut x, delta.as_ref(), &l.attn_norm, eps)?;
            let (v, mut k, mut q) = match (qkv.pop(), qkv.pop(), qkv.pop()) {
                (Some(v), Some(k), Some(q)) => (v, k, q),
                _ => unreachable!("three projections"),
            };
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                backend.head_rms_norm(&mut q, qn, c.head_dim, eps);
                backend.head_rms_norm(&mut k, kn, c.head_dim, eps);
            }
            let inv_freq = match (&self.local_inv_freq, l.local_rope) {
                (Some(local), true) => local,
                _ => &self.inv_freq,
            };
            let shape = AttentionShape {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                window: l.window,
            };
            let attn = match q_scale {
                // Scaled after its rotation: the rotation stays a kernel of its own.
                Some(f) => {
                    backend.rope_qk(&mut q, &mut k, c.head_dim, batch, inv_freq, c.rope_layout);
                    backend.scale(&mut q, f);
                    backend.attention(&q, &k, &v, kv, i, batch, shape)?
                }
                None => backend.rope_attention(
                    &mut q,
                    &mut k,
                    &v,
                    kv,
                    i,
                    batch,
                    shape,
                    inv_freq,
                    c.rope_layout,
                )?,
            };
            // A sum read only by the next pre-norm may be left to it (Backend::linear_summed_delta).
            let dense = matches!(l.ffn, Ffn::Dense(_));
            let mut o = if l.post_attn_norm.is_none() && dense {
                backend.linear_summed_delta(&attn, &l.o)?
            } else {
                backend.linear_summed(&attn, &l.o)?
            };
            if let Some(n) = &l.post_attn_norm {
                o = backend.residual_rms_norm(&o, n, eps);
            }
            let next_norms = l.post_ffn_norm.is_none() && i + 1 < self.layers.len();
            let mut d = match &l.ffn {
                Ffn::Dense(mlp) => {
                    mlp.apply_summed_normed(backend, &mut x, &o, &l.mlp_norm, eps, next_norms)?
                }
                Ffn::Sparse(s) => {
                    let h = backend.add_rms_norm(&mut x, &o, &l.mlp_norm, eps);
                    let mut d = s.apply(backend, &h, tokens.len(), c.hidden_size)?;
                    backend.all_reduce(&mut d)?;
                    d
                }
            };
            if let Some(n) = &l.post_ffn_norm {
                d = backend.residual_rms_norm(&d, n, eps);
            }
            pending = Some(d);
        }
        backend.begin_layer(self.layers.len());
        if let Some(d) = pending {
            backend.add(&mut x, &d);
        }
        let x = match which {
            LogitRows::All => x,
            LogitRows::LastPerSeq => backend.gather_rows(&x, &batch.last_rows()),
        };
        let x = backend.rms_norm(&x, &self.final_norm, eps);
        let logits = backend.linear(&x, self.lm_head.as_ref().unwrap_or(&self.embed), None)?;
        if self.head_parts > 1 {
            return backend.all_gather_cols(&logits);
        }
        Ok(logits)
    }
}

//! The narrow interface between model code and compute. Ops are coarse (a whole linear layer
//! with its stored weight, a whole attention call over the KV cache) so that each backend can
//! fuse and pick kernels freely, and each op has a CPU reference to be checked against.

use nibble_core::Result;
use nibble_formats::HostTensor;
use nibble_precision::KvSpec;

use crate::config::RopeLayout;
use crate::sampling::{PendingSample, SampleSpec, Sampled};

/// One sequence's slice of a batch: its tokens are `len` consecutive rows of the batch tensors,
/// at positions `start_pos..start_pos + len` of the sequence. Its KV lives in the paged pool:
/// position `p` is slot `p % block_size` of physical block `blocks[p / block_size]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSpan {
    pub blocks: Vec<u32>,
    pub start_pos: usize,
    pub len: usize,
}

/// The sequences of one forward call, laid out one after another.
#[derive(Debug, Clone, Default)]
pub struct BatchLayout {
    pub seqs: Vec<SeqSpan>,
}

impl BatchLayout {
    pub fn single(blocks: Vec<u32>, start_pos: usize, len: usize) -> Self {
        BatchLayout {
            seqs: vec![SeqSpan {
                blocks,
                start_pos,
                len,
            }],
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    /// Position of every token of the batch, in batch order.
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.len)
            .collect()
    }

    /// Batch row of each sequence's last token.
    pub fn last_rows(&self) -> Vec<usize> {
        let mut end = 0;
        self.seqs
            .iter()
            .map(|s| {
                end += s.len;
                end - 1
            })
            .collect()
    }
}

/// Where a device's time went over a run of steps, by its own clock: `busy_s` from the start of
/// each step's work to the end of its sampling, `idle_s` between the end of one step and the start
/// of the next (the device waiting for the host).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct DeviceTimeline {
    pub steps: usize,
    pub busy_s: f64,
    pub idle_s: f64,
}

/// Geometry of a KV cache entry: per layer, per token, `num_kv_heads * head_dim` keys and values,
/// stored as `format` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub format: KvSpec,
}

/// Attention geometry of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a query at position `p` reads only the keys at positions
    /// `p + 1 - window ..= p` (all of `0..=p` when `None`). The cache still holds every position.
    pub window: Option<usize>,
}

impl AttentionShape {
    /// The first position a query at `pos` reads.
    #[inline]
    pub fn first_key(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Rows of `x` to be added, each scaled, into rows of a result: row `i` of `x` times
/// `scales[i]` goes to row `rows[i]`. One expert's outputs in a mixture-of-experts layer.
#[derive(Debug, Clone, Copy)]
pub struct ScaledRows<'a, T> {
    pub x: &'a T,
    pub rows: &'a [usize],
    pub scales: &'a [f32],
}

impl<T> ScaledRows<'_, T> {
    /// Checks part `n` of a `[rows, cols]` result, its tensor being `[x_rows, x_cols]`: one
    /// target row and one scale per row of the tensor, every target row in range.
    pub fn check(
        &self,
        n: usize,
        (x_rows, x_cols): (usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        if x_cols != cols || x_rows != self.rows.len() || self.rows.len() != self.scales.len() {
            return Err(nibble_core::Error::InvalidArgument(format!(
                "scatter_add_scaled part {n}: a [{x_rows}, {x_cols}] tensor with {} target rows \
                 and {} scales for a [{rows}, {cols}] result",
                self.rows.len(),
                self.scales.len()
            )));
        }
        if let Some(&r) = self.rows.iter().find(|&&r| r >= rows) {
            return Err(nibble_core::Error::InvalidArgument(format!(
                "scatter_add_scaled part {n}: target row {r} of {rows}"
            )));
        }
        Ok(())
    }
}

/// One routed expert of a mixture-of-experts layer for [`Backend::grouped_swiglu`]: its fused
/// gate/up weight (`[2 * ffn, hidden]`, gate rows first), its down weight, and the rows of the
/// layer's input routed to it (in batch order, never empty).
#[derive(Debug)]
pub struct RoutedExpert<'a, W> {
    pub gate_up: &'a W,
    pub down: &'a W,
    pub rows: &'a [usize],
}

// By hand: the derives would ask `W: Copy`, and a reference is `Copy` whatever it points to.
impl<W> Clone for RoutedExpert<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<W> Copy for RoutedExpert<'_, W> {}

pub trait Backend: Send + Sync {
    /// Activations: a row-major matrix `[tokens, features]`.
    type Tensor: Send + Sync;
    /// A weight matrix `[out, in]` in its storage format, prepared for this backend's kernels.
    type Weight: Send + Sync;
    /// The paged KV pool. Which blocks a sequence uses is decided outside the backend (the
    /// engine's block manager); the backend only stores and reads the slots a batch names.
    type Kv: Send;

    fn name(&self) -> String;

    /// What a user should know about how the loaded weights run here, e.g. quantized formats
    /// this backend has no kernel for and runs dequantized (one line each, no duplicates).
    fn load_notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether this backend runs mixture-of-experts layers ([`Backend::scatter_add_scaled`]);
    /// checked before a MoE model's weights load.
    fn check_moe(&self) -> Result<()> {
        Ok(())
    }

    /// Prepares a 2-D weight (linear layers, embedding tables), keeping its storage format.
    fn load_weight(&self, tensor: &HostTensor) -> Result<Self::Weight>;
    /// Uploads a small f32 vector (norm weights, biases, rotary frequencies).
    fn load_vector(&self, values: &[f32]) -> Result<Self::Tensor>;
    /// A KV pool of `num_blocks` blocks of `block_size` tokens in `shape.format`; fails cleanly
    /// when memory is short or the format cannot use blocks of that size.
    fn new_kv_pool(&self, shape: KvShape, num_blocks: usize, block_size: usize)
    -> Result<Self::Kv>;
    /// Tells the pool that a sequence let go of these blocks. Their full-block contents must stay
    /// readable (the prefix cache may hand them to another sequence), but per-block state kept
    /// only while a block is being filled (the full-precision residual of the channel-wise
    /// formats) can be dropped: a partially filled block is never shared, and whoever gets it
    /// next starts writing it at slot 0.
    fn release_kv_blocks(&self, kv: &mut Self::Kv, blocks: &[u32]);

    /// Called by the model at the start of every forward pass. A backend may stage the batch's
    /// tokens and layout on its device once here, and recycle the previous pass's activations
    /// (tensors of an earlier forward must not be used after this).
    fn begin_forward(&self, _tokens: &[u32], _batch: &BatchLayout) -> Result<()> {
        Ok(())
    }
    /// Called by the model as layer `layer` of a forward pass begins, and with the number of
    /// layers once they are done: a layer reads only what the previous layer made (and what was
    /// made before the first), so a backend may recycle the memory of layer `layer - 2`.
    fn begin_layer(&self, _layer: usize) {}

    /// Runs one whole forward pass, `body`. A backend may record the work of a step once and
    /// replay it for later steps of the same shape (CUDA graphs for decode steps); `model`
    /// identifies the weights the body reads.
    fn run_forward(
        &self,
        _model: usize,
        kv: &mut Self::Kv,
        _batch: &BatchLayout,
        body: &mut dyn FnMut(&mut Self::Kv) -> Result<Self::Tensor>,
    ) -> Result<Self::Tensor> {
        body(kv)
    }

    /// Prepares weights that read the same input (q/k/v, gate/up) as one matrix, their rows
    /// stacked in order, when one GEMM serves this backend better than several. `None` (the
    /// default) keeps them separate; model code then never calls [`Backend::split_cols`].
    fn load_fused_weight(&self, _parts: &[HostTensor]) -> Result<Option<Self::Weight>> {
        Ok(None)
    }
    /// A SwiGLU layer's gate and up projections (`[ffn, hidden]` each, no biases) as one weight
    /// whose [`Backend::linear`] is `silu(gate x) * up x`, `[tokens, ffn]`: the values
    /// [`Backend::silu_mul`] gives of the two projections, in one pass where this backend's
    /// kernels can (a GEMM epilogue that holds a gate output and its up partner together). `None`
    /// (the default) keeps them projections, activated after.
    fn load_swiglu_weight(
        &self,
        _gate: &HostTensor,
        _up: &HostTensor,
    ) -> Result<Option<Self::Weight>> {
        Ok(None)
    }
    /// The column blocks of `x` of the given widths, in order: a fused projection's outputs.
    fn split_cols(&self, _x: &Self::Tensor, _widths: &[usize]) -> Result<Vec<Self::Tensor>> {
        Err(nibble_core::Error::InvalidArgument(format!(
            "{} fuses no weights, so it has nothing to split",
            self.name()
        )))
    }

    /// Tensor parallelism: sums `x` over the ranks that each hold a shard of the model
    /// (`tensor_parallel`), after a row-parallel layer (o_proj, down_proj) left each rank a
    /// partial sum; every rank gets the same sum. A backend running the whole model does nothing.
    fn all_reduce(&self, _x: &mut Self::Tensor) -> Result<()> {
        Ok(())
    }

    /// A block's pre-norm: [`Backend::add_rms_norm`] of `x + delta` (added into `x`), or
    /// [`Backend::rms_norm`] of `x` without a delta.
    fn pre_norm(
        &self,
        x: &mut Self::Tensor,
        delta: Option<&Self::Tensor>,
        norm: &Self::Tensor,
        eps: f32,
    ) -> Self::Tensor {
        match delta {
            Some(d) => self.add_rms_norm(x, d, norm, eps),
            None => self.rms_norm(x, norm, eps),
        }
    }

    /// [`Backend::pre_norm`], then [`Backend::linear`] of the normed rows: a block's first
    /// projection. A backend may do both in one pass (a GPU's one-token gemv norms its row
    /// itself); `x` ends updated either way.
    #[allow(clippy::too_many_arguments)]
    fn norm_linear(
        &self,
        x: &mut Self::Tensor,
        delta: Option<&Self::Tensor>,
        norm: &Self::Tensor,
        eps: f32,
        weight: &Self::Weight,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor> {
        let h = self.pre_norm(x, delta, norm, eps);
        self.linear(&h, weight, bias)
    }

    /// A row-parallel layer (o_proj, down_proj) summed over the ranks: `x @ weight^T`, then
    /// [`Backend::all_reduce`]. A backend may compute it in memory of its own that it reuses
    /// at its next call but one (a GPU rank's NCCL symmetric memory), so the caller reads the
    /// result before calling this twice more.
    fn linear_summed(&self, x: &Self::Tensor, weight: &Self::Weight) -> Result<Self::Tensor> {
        let mut out = self.linear(x, weight, None)?;
        self.all_reduce(&mut out)?;
        Ok(out)
    }

    /// [`Backend::linear_summed`] whose result is read only as the `delta` of the next
    /// [`Backend::norm_linear`] or [`Backend::pre_norm`], before any other row-parallel layer: a
    /// backend may leave the sum to that call (two GPU ranks whose gemvs sum peer to peer).
    fn linear_summed_delta(&self, x: &Self::Tensor, weight: &Self::Weight) -> Result<Self::Tensor> {
        self.linear_summed(x, weight)
    }

    /// Whether this backend, as a tensor-parallel rank, gathers column parts
    /// ([`Backend::all_gather_cols`]), so that the output head can be split by vocabulary.
    fn gathers_columns(&self) -> bool {
        false
    }

    /// Tensor parallelism: every rank's `x` (the same rows on each, `c` columns a rank) side by
    /// side in rank order, `[rows, c * ranks]`, on every rank: the logits of an output head split
    /// by vocabulary. Only backends that [`Backend::gathers_columns`] are asked.
    fn all_gather_cols(&self, _x: &Self::Tensor) -> Result<Self::Tensor> {
        Err(nibble_core::Error::unsupported(
            format!("gathering columns on {}", self.name()),
            "it is not a tensor-parallel rank",
        ))
    }

    /// Rows `ids` of an embedding table.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor>;
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Self::Tensor;
    /// `x += delta`, then returns `rms_norm(x)`: the residual add fused with the next norm.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Self::Tensor;
    /// RMS norm of a block's output that is then added to the residual stream (Gemma's norms
    /// after attention and after the feed-forward): the result keeps the residual's precision,
    /// where [`Backend::rms_norm`] may round for the GEMM that reads it.
    fn residual_rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Self::Tensor;
    /// RMS-normalizes every `head_dim` slice of each row in place (Qwen3's QK norm).
    fn head_rms_norm(&self, x: &mut Self::Tensor, weight: &Self::Tensor, head_dim: usize, eps: f32);
    /// `x @ weight^T (+ bias)`.
    fn linear(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// Rotates each head of `x` in place by its token's position.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &Self::Tensor,
        layout: RopeLayout,
    );
    /// Rotates `q` and `k` (the same positions): one pass on backends that fuse it.
    fn rope_qk(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &Self::Tensor,
        layout: RopeLayout,
    ) {
        self.rope(q, head_dim, batch, inv_freq, layout);
        self.rope(k, head_dim, batch, inv_freq, layout);
    }
    /// Writes `k`, `v` into each sequence's blocks at its positions and returns causal attention
    /// of `q` over positions `0..=` each token's own, or its window's (`shape.window`), with
    /// logits scaled by `1/sqrt(head_dim)` (GQA: head h reads kv head
    /// `h / (num_heads / num_kv_heads)`). A quantized pool quantizes on write and attention reads
    /// the dequantized values; a `4c`/`2c` side (`KvSpec::buffered`) is read in full precision
    /// in the block holding the query and quantized in earlier blocks, which needs each block
    /// written in slot order (slot 0 starts a block afresh).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<Self::Tensor>;
    /// [`Backend::rope_qk`] then [`Backend::attention`]: the result of both, `q` and `k` left
    /// rotated or not. A backend may rotate them inside its attention instead (the CUDA decode
    /// attention rotates q as it stages it and the step's key before it appends it: one kernel
    /// fewer a layer), so the caller must not read them afterwards.
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
        inv_freq: &Self::Tensor,
        layout: RopeLayout,
    ) -> Result<Self::Tensor> {
        self.rope_qk(q, k, shape.head_dim, batch, inv_freq, layout);
        self.attention(q, k, v, kv, layer, batch, shape)
    }
    /// `silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
    /// `gelu_tanh(gate) * up`, elementwise (Gemma's GeGLU; PyTorch's `gelu(approximate="tanh")`:
    /// `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`).
    fn gelu_tanh_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
    /// `x *= factor`, elementwise (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Tensor, factor: f32);
    fn add(&self, x: &mut Self::Tensor, delta: &Self::Tensor);
    /// A tensor made of the given rows.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Self::Tensor;
    /// A `[rows, cols]` tensor that starts at zero and gets each part's scaled rows added, part
    /// after part in the order given (a mixture-of-experts layer's weighted sum of its experts'
    /// outputs): each output row's sum is in that order whatever the other rows hold, which
    /// keeps the forward pass batch-invariant. Rows and shapes out of range are errors.
    fn scatter_add_scaled(
        &self,
        rows: usize,
        cols: usize,
        parts: &[ScaledRows<'_, Self::Tensor>],
    ) -> Result<Self::Tensor>;
    /// The SwiGLU feed-forwards `down(silu(gate x) * up x)` of several experts, each over its own
    /// rows of `x`, as grouped launches (one for all gate/up products, one for all down
    /// products): each expert's `[rows, hidden]` output, in the order given. `None` where the
    /// backend has no grouped kernels for these weights; the model then runs the experts one
    /// by one with the ops above, which is what this must compute.
    fn grouped_swiglu(
        &self,
        _x: &Self::Tensor,
        _experts: &[RoutedExpert<'_, Self::Weight>],
    ) -> Result<Option<Vec<Self::Tensor>>> {
        Ok(None)
    }
    /// Copies to host memory, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;

    /// Sequences a decode step of `n` sequences is best padded to: a backend that replays decode
    /// steps as recorded graphs keeps one per size it sees, so it asks for a few sizes. The
    /// engine pads with one-token sequences that write only a block it keeps aside. `n` (the
    /// default) pads nothing.
    fn decode_bucket(&self, n: usize) -> usize {
        n
    }

    /// `(free, total)` bytes of the backend's own memory (a GPU's), or `None` for host memory.
    /// The serving engine sizes its KV pool from it, after a warm-up step has taken the
    /// activation memory of the largest batch.
    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    /// Waits until the work queued so far has finished (a device's stream; nothing on the host).
    /// Profiles use it to split a step's host time from its device time.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Samples a token for each spec from its row of `logits` (`[rows, vocab]`, f32), with the
    /// arithmetic of [`crate::sampling::sample_rows`], which is also this default (the logits
    /// copied to the host). A device backend samples where the logits are, so that only token
    /// ids, and the log-probabilities asked for, cross to the host.
    fn sample(
        &self,
        logits: &Self::Tensor,
        vocab: usize,
        specs: &[SampleSpec],
    ) -> Result<Vec<Sampled>> {
        let host = self.to_host(logits)?;
        crate::sampling::sample_rows(&host, vocab, specs)
    }

    /// Starts (or stops) recording, on the device's own clock, when each forward pass's work
    /// begins and when its sampling ends, so that [`Backend::take_device_timeline`] can say how
    /// long the device was busy with steps and how long it sat idle between them. Nothing for a
    /// backend that computes on the calling thread.
    fn record_device_timeline(&self, _on: bool) {}

    /// The device time recorded since [`Backend::record_device_timeline`] was turned on (and
    /// clears it): `None` where nothing is recorded.
    fn take_device_timeline(&self) -> Option<DeviceTimeline> {
        None
    }

    /// Whether this backend queues work and returns before it runs (a GPU's stream), so that the
    /// engine gains by preparing step n+1 while step n runs: it then uses
    /// [`Backend::launch_sample`], [`Backend::collect_sample`] and [`Backend::feed_sampled`].
    /// A backend that computes on the calling thread (the CPU) has nothing to overlap.
    fn runs_ahead(&self) -> bool {
        false
    }

    /// [`Backend::sample`], but returning once the work is queued: the tokens come from
    /// [`Backend::collect_sample`]. The default samples now.
    fn launch_sample(
        &self,
        logits: &Self::Tensor,
        vocab: usize,
        specs: &[SampleSpec],
    ) -> Result<PendingSample> {
        self.sample(logits, vocab, specs).map(PendingSample::Ready)
    }

    /// Waits for a [`Backend::launch_sample`]'s tokens (only for them, not for work queued
    /// after it) and returns them in spec order.
    fn collect_sample(&self, pending: PendingSample) -> Result<Vec<Sampled>> {
        match pending {
            PendingSample::Ready(s) => Ok(s),
            PendingSample::Queued { .. } => Err(nibble_core::Error::InvalidArgument(format!(
                "{} queued no sampling to collect",
                self.name()
            ))),
        }
    }

    /// Says that in the next forward pass, batch row `row` takes as its token the one sampled
    /// for spec `spec` of the latest [`Backend::launch_sample`], read on the device: the token
    /// ids the host passes for those rows are placeholders. This is how step n+1 is queued
    /// before step n's tokens reach the host. Only for backends that [`Backend::runs_ahead`],
    /// and only while that sampling is [`PendingSample::on_device`].
    fn feed_sampled(&self, rows: &[(usize, usize)]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        Err(nibble_core::Error::unsupported(
            format!("feeding sampled tokens on {}", self.name()),
            "it does not run ahead of the host",
        ))
    }
}

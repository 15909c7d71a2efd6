//! `CudaBackend`: the model's ops on one GPU, as the `Backend` trait asks for them. Only the
//! choices between ops live here (cuBLAS or a quantized kernel, device or host sampling, a graph
//! or an eager step); the ops themselves are in their modules and take the context, so this is
//! the one module that sees all of them.
//!
//! Precision plan: the residual stream, GEMM outputs, q/k/v and the MLP's gate/up products are
//! f32; whatever a GEMM or the KV cache reads is the model dtype (bf16 or f16). GEMMs run on
//! cuBLAS with 16-bit operands and f32 accumulation and output (one-token products of large
//! layers on Hopper on `dense_gemv`, with the same operands and accumulation). This keeps the GPU within a few
//! bf16 roundings of the f32 CPU reference, which is what the greedy-equality test needs.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, WeightFormat};
use nibble_model::sampling::{PendingSample, SampleSpec, Sampled};
use nibble_model::{
    AttentionShape, Backend, BatchLayout, KvShape, RopeLayout, RoutedExpert, ScaledRows,
};

use crate::blas::Blas;
use crate::context::{CudaContext, StepUpload};
use crate::host_trace::HostTrace;
use crate::kv::CudaKv;
use crate::nccl::{Communicator, ReduceType};
use crate::peer_sum::{self, PeerSum};
use crate::qlinear::QKernel;
use crate::runtime::{DeviceBuffer, DevicePtr};
use crate::sampling::SampleScratch;
use crate::tensor::{CudaTensor, CudaWeight, Dtype, Elem, QuantWeight, WeightData};
use crate::{attention, comet, dense_gemv, elementwise as ew, graph, grouped, qlinear, sampling};

/// Most rows an expert may be routed for the engine to group the layer's experts
/// ([`Backend::grouped_swiglu`]): past it the grouped gemv's activation window shrinks its K
/// splits until the partial sums outweigh the saving (at 64 rows, 13 splits of Mixtral's gate/up
/// write more than its 62 MB of weights).
pub const GROUPED_ENGINE_ROWS: usize = 32;

/// Widest residual row the one-token normed gemv takes (f32s; wider models norm separately).
const RESIDUAL_ROW_MAX: usize = 1 << 16;

/// The context, plus what only the ops behind one trait method use (cuBLAS, sampling scratch).
/// It dereferences to the context, whose methods and fields tests and benchmarks reach through it.
pub struct CudaBackend {
    blas: Mutex<Blas>,
    sampling: SampleScratch,
    /// Sample on the host from copied logits (NIBBLE_HOST_SAMPLING=1): the reference path, kept
    /// to measure what device sampling saves.
    pub host_sampling: bool,
    /// Quantized formats loaded dequantized, and why (`Backend::load_notes`).
    dequantized: Mutex<std::collections::BTreeSet<String>>,
    /// This GPU's rank in a tensor-parallel group (`Backend::all_reduce` over NCCL); `None`
    /// runs the whole model.
    collective: Option<Arc<Communicator>>,
    /// As a rank, take a share of the output head's vocabulary and gather the logits
    /// (`Backend::all_gather_cols`); the group sets it (`GpuGroup::split_head`).
    split_head: bool,
    /// The rank's NCCL symmetric memory (address, bytes), two slots that row-parallel outputs
    /// are computed and summed in ([`Backend::linear_summed`]); `None` sums them in place.
    window: Option<(DevicePtr, usize)>,
    /// The slot the next [`Backend::linear_summed`] writes (rewound at every forward, so a
    /// captured graph's slots are the ones a replay's consumers read).
    window_turn: AtomicUsize,
    /// 16-bit one-token GEMMs of large layers on nibble's streamed gemv instead of cuBLAS
    /// (Hopper, [`dense_gemv::engine_picks`]; `NIBBLE_DENSE_GEMV=0` keeps cuBLAS, to measure
    /// one against the other).
    pub dense_gemv: bool,
    /// One-token W4A16 GEMMs after an RMSNorm on the decode gemv that norms its own input
    /// ([`qlinear::NormedDecode`]) instead of the norm kernel and then the gemv
    /// (`NIBBLE_NORMED_DECODE=0` keeps the two, to measure one against the other).
    pub normed_decode: bool,
    /// Two residual rows the one-token normed gemv writes the updated residual to in turn
    /// ([`Backend::norm_linear`]; it cannot update it in place, every CTA reads it), and the one
    /// next (rewound at every forward, so a captured graph's turns are a replay's).
    residual_rows: [DeviceBuffer; 2],
    residual_turn: AtomicUsize,
    /// As one of two ranks whose GPUs are peers: one-token row-parallel outputs summed by the
    /// gemvs themselves (`crate::peer_sum`) instead of NCCL's all-reduce.
    peer: Option<PeerSum>,
    /// With `peer`: every other row-parallel output (several tokens, quantized layers) summed by
    /// [`PeerSum::sum_rows`] instead of NCCL's all-reduce (`NIBBLE_TP_PEER_ROWS=0` keeps NCCL's,
    /// to measure one against the other).
    pub peer_rows: bool,
    /// Those sums over NVLink in bf16 (`NIBBLE_TP_SUM_BF16=1`), as vLLM's and TensorRT-LLM's
    /// 16-bit all-reduces: each rank's addend rounded to bf16, half the bytes, of any size. Off
    /// by default: on two H100s the engine ran within the runs' spread of the f32 sums, which
    /// keep NCCL's bits, and a mixture-of-experts router can pick other experts on the rounded
    /// residual (the tiny Mixtral fixture did at its eighth step).
    pub peer_rows_bf16: bool,
    /// Host time of eager forward passes by kind of op (`NIBBLE_HOST_TRACE=1`).
    trace: Option<HostTrace>,
    ctx: CudaContext,
}

impl Deref for CudaBackend {
    type Target = CudaContext;

    fn deref(&self) -> &CudaContext {
        &self.ctx
    }
}

impl DerefMut for CudaBackend {
    fn deref_mut(&mut self) -> &mut CudaContext {
        &mut self.ctx
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize, dtype: Dtype) -> Result<CudaBackend> {
        let ctx = CudaContext::new(ordinal, dtype)?;
        Ok(CudaBackend {
            blas: Mutex::new(Blas::new(&ctx.gpu)?),
            sampling: SampleScratch::default(),
            host_sampling: std::env::var("NIBBLE_HOST_SAMPLING").is_ok_and(|v| v != "0"),
            dequantized: Mutex::default(),
            collective: None,
            split_head: false,
            window: None,
            window_turn: AtomicUsize::new(0),
            residual_rows: [
                DeviceBuffer::alloc(&ctx.gpu, RESIDUAL_ROW_MAX * 4, "residual row")?,
                DeviceBuffer::alloc(&ctx.gpu, RESIDUAL_ROW_MAX * 4, "residual row")?,
            ],
            residual_turn: AtomicUsize::new(0),
            peer: None,
            peer_rows: std::env::var("NIBBLE_TP_PEER_ROWS").map_or(true, |v| v != "0"),
            peer_rows_bf16: std::env::var("NIBBLE_TP_SUM_BF16").is_ok_and(|v| v == "1"),
            dense_gemv: std::env::var("NIBBLE_DENSE_GEMV").map_or(true, |v| v != "0"),
            normed_decode: std::env::var("NIBBLE_NORMED_DECODE").map_or(true, |v| v != "0"),
            trace: std::env::var("NIBBLE_HOST_TRACE")
                .is_ok_and(|v| v == "1")
                .then(HostTrace::default),
            ctx,
        })
    }

    /// Makes this backend one rank of a tensor-parallel group: it holds that rank's shard, and
    /// [`Backend::all_reduce`] sums row-parallel outputs over the group on this GPU's stream;
    /// with `split_head`, it holds a share of the output head's vocabulary and gathers logits;
    /// `window` is the NCCL symmetric memory (address, bytes) the group registered for it.
    pub fn with_collective(
        mut self,
        comm: Arc<Communicator>,
        split_head: bool,
        window: Option<(DevicePtr, usize)>,
    ) -> CudaBackend {
        self.collective = Some(comm);
        self.split_head = split_head;
        self.window = window;
        self
    }

    /// As a rank of two whose GPUs are peers, sums one-token row-parallel outputs with `peer`
    /// ([`crate::peer_sum`]).
    pub fn with_peer_sum(mut self, peer: Option<PeerSum>) -> CudaBackend {
        self.peer = peer;
        self
    }

    /// Whether one-token row-parallel outputs are summed peer to peer.
    pub fn sums_with_peer(&self) -> bool {
        self.peer.is_some()
    }

    /// (fused, settled): peer sums the next normed gemv finished, and those settled on their
    /// own (tests tell the two paths apart by these; they give the same bits).
    pub fn peer_sum_counts(&self) -> (usize, usize) {
        self.peer.as_ref().map_or((0, 0), |p| p.counts())
    }

    /// How many outputs of several rows were summed peer to peer ([`PeerSum::sum_rows`]).
    pub fn peer_rows_summed(&self) -> usize {
        self.peer.as_ref().map_or(0, |p| p.rows_summed())
    }

    /// Whether [`CudaBackend::peer_sum_rows`] takes an output of `n` f32 values: in f32 up to a
    /// receive slot (past it NCCL's pipelined all-reduce was faster: 8,192-token prefill steps
    /// 1.07x and 1.08x on two H100s), in bf16 any size (level with NCCL's f32 there).
    fn peer_rows_take(&self, n: usize) -> bool {
        self.peer.is_some()
            && self.peer_rows
            && PeerSum::rows_fit(n)
            && (self.peer_rows_bf16 || n <= peer_sum::SLOT_FLOATS)
    }

    /// Sums a whole f32 output `x` (`n` values, 16-byte aligned) with the peer's, where that
    /// applies ([`CudaBackend::peer_rows_take`]); false leaves it to NCCL.
    fn peer_sum_rows(&self, x: &CudaTensor) -> Result<bool> {
        let n = x.rows * x.cols;
        match &self.peer {
            Some(p)
                if x.elem == Elem::F32
                    && x.is_contiguous()
                    && x.ptr.is_multiple_of(16)
                    && self.peer_rows_take(n) =>
            {
                p.sum_rows(&self.ctx, x.ptr, n, self.peer_rows_bf16)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Finishes a peer sum left to a consumer that turned out not to be a normed gemv.
    fn settle_peer(&self) -> Result<()> {
        match &self.peer {
            Some(p) => p.settle_pending(&self.ctx),
            None => Ok(()),
        }
    }

    /// Ends a forward pass's peer sums: none left pending, and where the pass's last push went to
    /// the next pass's first slot, a barrier with the peer (NCCL's all-reduce of one float,
    /// in the pass and so in its graph) so that slot is read before it is pushed to again.
    fn close_peer_forward(&self) -> Result<()> {
        let (Some(p), Some(comm)) = (&self.peer, &self.collective) else {
            return Ok(());
        };
        p.settle_pending(&self.ctx)?;
        if p.ends_on_the_first_slot() {
            let one = self.ctx.alloc(1, 1, Elem::F32)?;
            comm.all_reduce_sum(one.ptr, 1, ReduceType::F32)?;
        }
        Ok(())
    }

    /// The row-parallel layer as one rank of a peer sum, where it applies (one token, a dense
    /// weight the gemv streams): the gemv pushes its rows to the peer; with `defer` the sum is
    /// left to the next normed gemv, else finished here.
    fn peer_linear_summed(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        defer: bool,
    ) -> Result<Option<CudaTensor>> {
        let Some(p) = &self.peer else {
            return Ok(None);
        };
        let (n, k) = (weight.rows, weight.cols);
        let applies = self.streams_dense(weight)
            && x.rows == 1
            && x.cols == k
            && x.is_contiguous()
            && PeerSum::fits(n)
            && dense_gemv::applies(&self.ctx, 1, n, k);
        if !applies {
            return Ok(None);
        }
        self.ctx.check_live(x)?;
        p.settle_pending(&self.ctx)?;
        // Attention's output is f32: the gemv reads the model dtype.
        let xh = self.ctx.as_half(x)?;
        let out = self.ctx.alloc(1, n, Elem::F32)?;
        let (slot, push) = p.next_push();
        dense_gemv::run_push(&self.ctx, &xh, weight, &out, &push)?;
        p.pushed(&self.ctx, out.ptr, slot, n, defer)?;
        Ok(Some(out))
    }

    /// This rank's communicator, if the backend is a tensor-parallel rank.
    pub fn communicator(&self) -> Option<&Arc<Communicator>> {
        self.collective.as_ref()
    }

    /// Test and benchmark support: a `rows` x `cols` f32 tensor in the first slot of the
    /// rank's symmetric window, if it has one and the tensor fits a slot.
    pub fn window_tensor(&self, rows: usize, cols: usize) -> Option<CudaTensor> {
        let (ptr, bytes) = self.window?;
        (rows * cols * 4 <= bytes / 2).then(|| CudaTensor::view(ptr, rows, cols, Elem::F32, 0))
    }

    /// `out = x @ weight^T (+ bias)`, into `out` (`[x.rows, weight.rows]` f32).
    fn linear_into(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        bias: Option<&CudaTensor>,
        out: &CudaTensor,
    ) -> Result<()> {
        let ctx = &self.ctx;
        ctx.check_live(x)?;
        if x.cols != weight.cols {
            return Err(Error::InvalidArgument(format!(
                "linear: input has {} features, weight expects {}",
                x.cols, weight.cols
            )));
        }
        let gemm = || -> Result<()> {
            match &weight.data {
                WeightData::Dense(_) => {
                    let xh = ctx.as_half(x)?;
                    if self.takes_dense_gemv(x.rows, weight) {
                        return dense_gemv::run(ctx, &xh, weight, out);
                    }
                    self.blas_gemm(&xh, weight, out)
                }
                WeightData::Quant(q) => {
                    qlinear::quant_gemm(ctx, x, q, weight.rows, weight.cols, out)
                }
                WeightData::SwiGlu(_) | WeightData::DenseSwiGlu(_) => Err(Error::InvalidArgument(
                    "a SwiGLU weight writes its own 16-bit output (linear), not into f32".into(),
                )),
                WeightData::Comet(c) => comet::gemm(ctx, x, c, weight.rows, weight.cols, out),
            }
        };
        match &self.trace {
            Some(t) => t.gemm(gemm)?,
            None => gemm()?,
        }
        if let Some(b) = bias {
            ew::add_bias(ctx, out, b)?;
        }
        Ok(())
    }

    /// `silu(gate x) * up x` of a SwiGLU weight (packed, or [`WeightData::DenseSwiGlu`]),
    /// `[x.rows, ffn]` in the model dtype.
    fn swiglu_linear(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let ctx = &self.ctx;
        ctx.check_live(x)?;
        if bias.is_some() {
            return Err(Error::InvalidArgument(
                "SwiGLU linear with a bias: its weights are loaded only for bias-free layers"
                    .into(),
            ));
        }
        if x.cols != weight.cols {
            return Err(Error::InvalidArgument(format!(
                "SwiGLU linear: input has {} features, weight expects {}",
                x.cols, weight.cols
            )));
        }
        match &weight.data {
            WeightData::SwiGlu(q) => {
                let gemm = || qlinear::swiglu_gemm(ctx, x, q, weight.rows, weight.cols);
                match &self.trace {
                    Some(t) => t.gemm(gemm),
                    None => gemm(),
                }
            }
            // The stacked product, then the SiLU-gate: what the one-token epilogue computes.
            WeightData::DenseSwiGlu(stacked) => {
                let gu = self.linear(x, stacked, None)?;
                let parts = gu.split_cols(&[weight.rows, weight.rows])?;
                ew::silu_mul(ctx, &parts[0], &parts[1])
            }
            _ => Err(Error::InvalidArgument("not a SwiGLU weight".into())),
        }
    }

    /// A SwiGLU layer's gate and up projections packed for the SwiGLU epilogue
    /// ([`WeightData::SwiGlu`]: rows interleaved in runs of 8, `qlinear::swiglu_rows`), whatever
    /// NIBBLE_SWIGLU says; `None` where the pair's format has no SwiGLU kernels here or does not
    /// pack. [`Backend::load_swiglu_weight`] offers it to the model unless NIBBLE_SWIGLU=0.
    pub fn swiglu_weight(&self, gate: &HostTensor, up: &HostTensor) -> Result<Option<CudaWeight>> {
        // The family first: a pair without SwiGLU kernels is not packed only to be dropped.
        let family = qlinear::kernel_format(gate.format).and_then(qlinear::QFamily::of);
        let Some(family) = family.filter(|f| f.has_swiglu()) else {
            return Ok(None);
        };
        let dtype = self.ctx.dtype;
        let probe = qlinear::swiglu_kernel_name(QKernel::Wgmma64, family, 64, dtype.suffix());
        if !self.ctx.has_kernel(&probe) {
            return Ok(None);
        }
        let Some((format, rows, cols, bytes)) = qlinear::swiglu_rows(gate, up)? else {
            return Ok(None);
        };
        let what = format!("weight {} + {}", gate.name, up.name);
        Ok(self
            .upload_packed(format, rows, cols, &bytes, &what)?
            .map(|q| CudaWeight {
                rows: rows / 2,
                cols,
                dtype,
                data: WeightData::SwiGlu(q),
            }))
    }

    /// A SwiGLU layer's 16-bit gate and up stacked as one [`WeightData::DenseSwiGlu`] weight,
    /// where the one-token gemv takes the stacked layer (Hopper, 20 MB or more): its epilogue
    /// then writes `silu(gate) * up`, one kernel fewer a block. `None` otherwise, and for
    /// quantized pairs (their own kernels, or loaded as projections).
    fn dense_swiglu_weight(
        &self,
        gate: &HostTensor,
        up: &HostTensor,
    ) -> Result<Option<CudaWeight>> {
        let (rows, cols, _) = gate.matrix_geometry()?;
        let dense = |t: &HostTensor| {
            matches!(
                t.format,
                WeightFormat::Ggml(GgmlType::BF16 | GgmlType::F16 | GgmlType::F32)
            )
        };
        if !self.dense_gemv
            || !dense(gate)
            || !dense(up)
            || up.matrix_geometry()?.0 != rows
            || !dense_gemv::engine_picks(&self.ctx, 1, 2 * rows, cols)
        {
            return Ok(None);
        }
        // 16- and 32-bit parts always upload dense (in the model dtype).
        let stacked = self.upload_stacked(&[gate.clone(), up.clone()])?;
        Ok(Some(CudaWeight {
            rows,
            cols,
            dtype: self.ctx.dtype,
            data: WeightData::DenseSwiGlu(Box::new(stacked)),
        }))
    }

    /// Whether `weight` is a plain matrix of the model dtype and the dense gemv is on: what
    /// the gemv can stream, whatever the shape.
    fn streams_dense(&self, weight: &CudaWeight) -> bool {
        self.dense_gemv
            && matches!(weight.data, WeightData::Dense(_))
            && weight.dtype == self.ctx.dtype
    }

    /// Whether an `m`-row product with the 16-bit `weight` runs on the dense decode gemv.
    fn takes_dense_gemv(&self, m: usize, weight: &CudaWeight) -> bool {
        if let WeightData::DenseSwiGlu(stacked) = &weight.data {
            return self.takes_dense_gemv(m, stacked)
                && dense_gemv::swiglu_fits(&self.ctx, weight.rows, weight.cols);
        }
        self.streams_dense(weight)
            && dense_gemv::engine_picks(&self.ctx, m, weight.rows, weight.cols)
    }

    /// cuBLAS's `out = x @ w^T` whatever the shape (benchmarks time it against `dense_gemv`).
    pub fn blas_gemm(&self, x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) -> Result<()> {
        self.blas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .gemm(&self.ctx.gpu, x, w, out)
    }

    /// [`qlinear::quant_gemm`] (benchmarks and tests time and check the kernels alone).
    pub fn quant_gemm(
        &self,
        x: &CudaTensor,
        w: &QuantWeight,
        n: usize,
        k: usize,
        out: &CudaTensor,
    ) -> Result<()> {
        qlinear::quant_gemm(&self.ctx, x, w, n, k, out)
    }

    /// Test support: the per-token 8-bit codes of `kind` and scales a quantized GEMM would read
    /// for `x` (those its producer wrote alongside it, else quantized now), on the host.
    pub fn act8_codes(&self, x: &CudaTensor, kind: qlinear::Act8) -> Result<(Vec<u8>, Vec<f32>)> {
        let q = qlinear::act8_input(&self.ctx, x, x.cols, kind)?;
        let mut codes = vec![0u8; x.rows * x.cols];
        let mut scales = vec![0f32; x.rows];
        self.ctx.gpu.download(&mut codes, q.codes)?;
        self.ctx.gpu.download(&mut scales, q.scales)?;
        Ok((codes, scales))
    }

    /// Benchmark support: [`qlinear::with_owned_act8`].
    pub fn with_owned_act8(&self, x: &CudaTensor, kind: qlinear::Act8) -> Result<CudaTensor> {
        qlinear::with_owned_act8(&self.ctx, x, kind)
    }

    /// Benchmark support: an f32 matrix of uniform values in [-1, 1) in owned memory.
    pub fn random_tensor(&self, rows: usize, cols: usize, seed: i32) -> Result<CudaTensor> {
        ew::random_tensor(&self.ctx, rows, cols, seed)
    }

    /// Benchmark support: uniform values in [-1, 1) in the model dtype, in owned memory.
    pub fn random_half_tensor(&self, rows: usize, cols: usize, seed: i32) -> Result<CudaTensor> {
        ew::random_half_tensor(&self.ctx, rows, cols, seed)
    }

    /// Test support: layer `layer`'s key and value pages as stored (`CudaKv::download_layer`).
    pub fn kv_pages(&self, kv: &CudaKv, layer: usize) -> Result<[Vec<u8>; 2]> {
        self.ctx.gpu.synchronize()?;
        kv.download_layer(&self.ctx.gpu, layer)
    }

    /// Benchmark support: fills a whole KV pool with uniform values in [-1, 1) (quantized as
    /// an append would, for a quantized pool).
    pub fn fill_kv_random(&self, kv: &CudaKv, seed: i32) -> Result<()> {
        ew::fill_kv_random(&self.ctx, kv, seed)
    }

    /// A pool with a deferred side (kv4c, kv2c): plans which residual slot each block `batch`
    /// touches writes and uploads the tables, before a forward pass runs or replays. Every
    /// attention call until [`CudaKv::finish_residual`] then uses that plan, as the calls of a
    /// captured graph must (an upload cannot be captured); it applies the plan once those calls
    /// are queued. The tables are as wide as the block tables `begin_forward` staged.
    pub fn plan_kv_residual(&self, kv: &mut CudaKv, batch: &BatchLayout) -> Result<()> {
        if kv.defers() {
            let width = self.residual_width(batch)?;
            kv.plan_residual(&self.ctx.gpu, batch, width, &mut |dst, src| {
                self.ctx.upload_step(dst, src)
            })?;
        }
        Ok(())
    }

    /// `Backend::attention`, after `Backend::rope_qk` when `rotary` is given (folded into the
    /// decode kernel where it can be: `attention::attention`).
    #[allow(clippy::too_many_arguments)]
    fn attention_rotated(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
        rotary: Option<attention::Rotary<'_>>,
    ) -> Result<CudaTensor> {
        self.ctx.check_live(q)?;
        // A deferred pool outside a forward pass (a direct call): this layer's residual plan.
        let plan = if kv.residual_planned() {
            None
        } else {
            let width = self.residual_width(batch)?;
            kv.plan_residual_layer(&self.ctx.gpu, layer, batch, width, &mut |dst, src| {
                self.ctx.upload_step(dst, src)
            })?
        };
        let mut run = || attention::attention(&self.ctx, q, k, v, kv, layer, batch, shape, rotary);
        let out = match &self.trace {
            Some(t) => t.attention(run),
            None => run(),
        };
        if let (Some(plan), Ok(_)) = (plan, &out) {
            kv.finish_residual_layer(layer, plan);
        }
        out
    }

    /// The width of `batch`'s block tables as the kernels read them (staged if they were not):
    /// a residual table's too.
    fn residual_width(&self, batch: &BatchLayout) -> Result<usize> {
        self.ctx.ensure_meta(None, batch)?;
        Ok(self.ctx.with_meta(|m| m.max_blocks))
    }

    /// The SwiGLU MLPs of several experts, each over its own rows of `x`, as grouped launches
    /// (`grouped`): the rows gathered once in expert order, one launch for every fused gate/up,
    /// one SiLU-gate, one launch for every down; each expert's `[rows, hidden]` output (views
    /// into one arena tensor). `None` unless the experts share one shape and a format with a
    /// grouped kernel here (`grouped::pick`). [`Backend::grouped_swiglu`] adds the sizes the
    /// engine groups; tests and benchmarks call this directly at any size.
    pub fn run_grouped_swiglu(
        &self,
        x: &CudaTensor,
        experts: &[RoutedExpert<'_, CudaWeight>],
    ) -> Result<Option<Vec<CudaTensor>>> {
        if !self.groupable(x, experts) {
            return Ok(None);
        }
        let ctx = &self.ctx;
        ctx.check_live(x)?;
        let (ffn2, hidden) = (experts[0].gate_up.rows, experts[0].gate_up.cols);
        let ffn = ffn2 / 2;
        let order: Vec<usize> = experts
            .iter()
            .flat_map(|e| e.rows.iter().copied())
            .collect();
        let counts = || experts.iter().map(|e| e.rows.len());
        // The item tables and the gather indices in one copy, ahead of the layer's kernels.
        let mut up = StepUpload::default();
        let runs = grouped::runs_in_order(experts.iter().map(|e| e.gate_up).zip(counts()));
        let gate_up_gemm = grouped::GroupedGemm::new(ctx, order.len(), &runs, &mut up)?;
        let runs = grouped::runs_in_order(experts.iter().map(|e| e.down).zip(counts()));
        let down_gemm = grouped::GroupedGemm::new(ctx, order.len(), &runs, &mut up)?;
        let order_at = up.push(&order.iter().map(|&r| r as i32).collect::<Vec<_>>());
        let base = ctx.stage_upload_all(&up)?;
        let gathered = ew::gather_rows_at(ctx, x, base + order_at as u64, order.len())?;
        let gate_up = ctx.alloc(order.len(), ffn2, Elem::F32)?;
        gate_up_gemm.launch(ctx, base, &gathered, &gate_up)?;
        let halves = gate_up.split_cols(&[ffn, ffn])?;
        let act = ew::silu_mul(ctx, &halves[0], &halves[1])?;
        let y = ctx.alloc(order.len(), hidden, Elem::F32)?;
        down_gemm.launch(ctx, base, &act, &y)?;
        let mut at = 0;
        Ok(Some(
            experts
                .iter()
                .map(|e| {
                    let ptr = y.ptr + (at * hidden * 4) as u64;
                    at += e.rows.len();
                    CudaTensor::view(ptr, e.rows.len(), hidden, Elem::F32, y.epoch)
                })
                .collect(),
        ))
    }

    /// Whether the experts' gate/up and down GEMMs both have a grouped kernel: every expert of
    /// one shape (`gate_up` `[2 ffn, hidden]`, `down` `[hidden, ffn]`) over `x`.
    fn groupable(&self, x: &CudaTensor, experts: &[RoutedExpert<'_, CudaWeight>]) -> bool {
        let Some(first) = experts.first() else {
            return false;
        };
        let (ffn2, hidden) = (first.gate_up.rows, first.gate_up.cols);
        let shaped = ffn2.is_multiple_of(2)
            && x.cols == hidden
            && experts.iter().all(|e| {
                (e.gate_up.rows, e.gate_up.cols, e.down.rows, e.down.cols)
                    == (ffn2, hidden, hidden, ffn2 / 2)
            });
        if !shaped {
            return false;
        }
        let rows = experts.iter().map(|e| e.rows.len()).max().unwrap_or(0);
        let gate_ups: Vec<&CudaWeight> = experts.iter().map(|e| e.gate_up).collect();
        let downs: Vec<&CudaWeight> = experts.iter().map(|e| e.down).collect();
        grouped::pick(&self.ctx, &gate_ups, rows).is_some()
            && grouped::pick(&self.ctx, &downs, rows).is_some()
    }

    /// Kernel-format rows packed for the quantized kernels and uploaded, or `None` where they do
    /// not pack (geometry the kernels cannot read: the caller runs them dequantized).
    fn upload_packed(
        &self,
        format: nibble_precision::LinearFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        what: &str,
    ) -> Result<Option<QuantWeight>> {
        let Ok(packed) = qlinear::pack_rows(format, rows, cols, bytes, self.ctx.dtype) else {
            return Ok(None);
        };
        let q = packed.upload(&self.ctx, what)?;
        self.ctx.note_weight(q.bytes(), q.reads_act8());
        Ok(Some(q))
    }

    /// COMET W4A4A8 parts of one format and width, stacked and uploaded for `comet::gemm`
    /// (kernels/comet.cu, sm_80 on), whatever NIBBLE_COMET says; `None` for any other format, or
    /// geometry the kernel cannot read. The loader takes it unless NIBBLE_COMET=0 ([`comet_wanted`]).
    pub fn comet_weight(&self, parts: &[HostTensor]) -> Result<Option<CudaWeight>> {
        self.upload_comet(parts, &weight_label(parts))
    }

    fn upload_comet(&self, parts: &[HostTensor], what: &str) -> Result<Option<CudaWeight>> {
        // Only COMET's parts are stacked (a copy of their bytes); any other weight leaves at once.
        let comet_format = |f| match f {
            WeightFormat::Quant(lf)
                if matches!(lf.act, nibble_precision::ActQuant::Mixed4x8 { .. }) =>
            {
                Some(lf)
            }
            _ => None,
        };
        let Some((format, rows, cols, bytes)) = qlinear::stacked_rows_of(parts, comet_format)?
        else {
            return Ok(None);
        };
        let Some(geo) = comet::geometry(format, cols) else {
            return Ok(None);
        };
        if !self.ctx.has_kernel("comet_gemm_f32") {
            return Ok(None);
        }
        let packed = comet::pack(format, rows, cols, &bytes)?;
        let w = comet::upload(&self.ctx, &packed, geo, (rows, cols), what)?;
        self.ctx.note_weight(w.bytes(), None);
        Ok(Some(CudaWeight {
            rows,
            cols,
            dtype: self.ctx.dtype,
            data: WeightData::Comet(w),
        }))
    }

    /// Checked 2-D weights with equal widths, converted to the model dtype and uploaded as one
    /// matrix, rows stacked in order (one weight, or a fused projection).
    fn upload_stacked(&self, parts: &[HostTensor]) -> Result<CudaWeight> {
        let dtype = self.ctx.dtype;
        let what = weight_label(parts);
        if comet_wanted()
            && let Some(w) = self.upload_comet(parts, &what)?
        {
            return Ok(w);
        }
        if let Some((format, rows, cols, bytes)) = qlinear::stacked_rows(parts)? {
            // Geometry the kernels cannot read (K not a multiple of 16) runs dequantized below.
            // W4A8 has Hopper kernels only; elsewhere it runs dequantized too.
            let runs = qlinear::QFamily::of(format)
                .is_some_and(|f| !f.hopper_only() || self.ctx.has_kernel(f.hopper_probe()));
            if runs && let Some(q) = self.upload_packed(format, rows, cols, &bytes, &what)? {
                return Ok(CudaWeight {
                    rows,
                    cols,
                    dtype,
                    data: WeightData::Quant(q),
                });
            }
        }
        if let Some(why) = dequantized_reason(&self.ctx, parts) {
            self.dequantized
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(why);
        }
        let (mut rows, mut cols) = (0, 0);
        for t in parts {
            let (r, c, _) = t.matrix_geometry()?;
            rows += r;
            cols = c;
        }
        let bytes = weight_bytes(parts, dtype)?;
        let buf = DeviceBuffer::from_host(&self.ctx.gpu, &bytes, &what)?;
        self.ctx.note_weight(bytes.len(), None);
        Ok(CudaWeight {
            rows,
            cols,
            dtype,
            data: WeightData::Dense(buf),
        })
    }

    /// An infallible op's result: the tensor, or one nothing reads correctly once the context
    /// recorded the error for the next fallible op to report.
    fn or_dead(&self, r: Result<CudaTensor>, rows: usize, cols: usize, elem: Elem) -> CudaTensor {
        self.ctx
            .sticky(r)
            .unwrap_or_else(|| CudaTensor::dead(rows, cols, elem))
    }
}

/// How an upload names `parts` in its errors: "weight a + b".
fn weight_label(parts: &[HostTensor]) -> String {
    let names: Vec<&str> = parts.iter().map(|t| t.name.as_str()).collect();
    format!("weight {}", names.join(" + "))
}

/// Whether COMET W4A4A8 layers load for their own kernel (`comet.rs`): unless NIBBLE_COMET=0,
/// read once. The kernel computes the format (4-bit weights, INT4/INT8 activation blocks, the
/// reference's bits: its GPU tests passed on an H100) in a quarter of the dequantized weight
/// memory; dequantized runs cuBLAS BF16 without the activation quantization, which on Hopper is
/// mostly faster (the kernel measured from 1.2x faster to 8.4x slower than cuBLAS BF16, and 2.4x
/// to 11x slower than W4A8: BENCHMARKS.md, issue 18), so that path stays a knob away.
fn comet_wanted() -> bool {
    static KNOB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&KNOB, "NIBBLE_COMET") != Some(0)
}

/// Whether dense SwiGLU layers of a family with SwiGLU kernels ([`qlinear::QFamily::has_swiglu`]:
/// W4A8, W8A8, FP8) load their gate/up as one [`WeightData::SwiGlu`] weight, the SiLU-gate in the
/// GEMM's epilogue: unless NIBBLE_SWIGLU=0. Each family measured 1.035x to 1.047x end to end at 64
/// and 256 sequences with it (H100, BENCHMARKS.md, issue 18). Read once; a probe knob, so the
/// separate GEMM and SiLU-gate can be A/B'd against the epilogue in one build.
fn swiglu_on() -> bool {
    static KNOB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&KNOB, "NIBBLE_SWIGLU") != Some(0)
}

/// The fewest routed experts a step runs grouped: 3 quantized ones (at two, grouping measured
/// slower in eager steps: BENCHMARKS.md, issue 23), 8 of 16 bits (the grouped gemv only breaks
/// even with cuBLAS there). `NIBBLE_MOE_GROUP_MIN` overrides both, read once (a probe knob for
/// `scripts/gpu-engine-run.sh moe-group`).
fn grouped_experts_least(quantized: bool) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::runtime::probe_knob(&FORCED, "NIBBLE_MOE_GROUP_MIN").unwrap_or(if quantized {
        3
    } else {
        8
    })
}

/// Why quantized `parts` are about to load dequantized, for the user (`None` for 16/32-bit
/// weights, which are not quantized to begin with).
fn dequantized_reason(ctx: &CudaContext, parts: &[HostTensor]) -> Option<String> {
    let first = parts.first()?;
    let (fmt, why) = match first.format {
        WeightFormat::Quant(f) => (
            f.to_string(),
            match qlinear::QFamily::of(f) {
                None if matches!(f.act, nibble_precision::ActQuant::Mixed4x8 { .. }) => {
                    if comet_wanted() {
                        "COMET's kernel takes groups of 32 to 128 channels that divide the \
                         layer, on sm_80 and later"
                    } else {
                        "NIBBLE_COMET=0 asked for it (cuBLAS BF16, faster than COMET's own \
                         kernel on Hopper, in 4x the weight memory and without the INT4 \
                         activations)"
                    }
                }
                None => "it has no GPU kernel yet",
                Some(f) if f.hopper_only() && !ctx.has_kernel(f.hopper_probe()) => {
                    "its kernels need Hopper (sm_90a)"
                }
                Some(_) => "this layer's shape or groups do not suit the kernel",
            },
        ),
        WeightFormat::Ggml(t) if !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) => {
            (format!("GGUF {t:?}"), "GGUF blocks have no GPU kernels yet")
        }
        _ => return None,
    };
    Some(format!(
        "{fmt} weights run dequantized to {:?} on the GPU: {why}",
        ctx.dtype
    ))
}

/// Host bytes (little-endian) of weights stacked by rows in `dtype`: 16-bit files of the same
/// dtype as they are, anything else (f32, the other 16-bit type, ggml blocks, quantized formats
/// with no kernel here) decoded to f32 first.
fn weight_bytes(parts: &[HostTensor], dtype: Dtype) -> Result<std::borrow::Cow<'_, [u8]>> {
    let native = |t: &HostTensor| {
        matches!(
            (t.format, dtype),
            (WeightFormat::Ggml(GgmlType::BF16), Dtype::Bf16)
                | (WeightFormat::Ggml(GgmlType::F16), Dtype::F16)
        )
    };
    // A weight already in the dtype uploads from its own bytes: copying a 70B model's shard
    // once more on the host was a large part of its load.
    if let [t] = parts
        && native(t)
    {
        return Ok(std::borrow::Cow::Borrowed(&t.bytes[..]));
    }
    let mut out = Vec::new();
    for t in parts {
        if native(t) {
            out.extend_from_slice(&t.bytes);
        } else {
            out.extend(
                dtype
                    .encode(&t.to_f32()?)
                    .iter()
                    .flat_map(|b| b.to_le_bytes()),
            );
        }
    }
    Ok(std::borrow::Cow::Owned(out))
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn load_notes(&self) -> Vec<String> {
        let set = self.dequantized.lock().unwrap_or_else(|e| e.into_inner());
        set.iter().cloned().collect()
    }

    fn name(&self) -> String {
        let gpu = &self.ctx.gpu;
        let rank = self.collective.as_ref().map_or(String::new(), |c| {
            format!(", tensor-parallel rank {} of {}", c.rank(), c.size())
        });
        format!(
            "cuda:{} ({}, sm_{}{}, {}{rank})",
            gpu.ordinal,
            gpu.name,
            gpu.cc.0,
            gpu.cc.1,
            self.ctx.dtype.suffix()
        )
    }

    fn gathers_columns(&self) -> bool {
        self.collective.is_some() && self.split_head
    }

    fn all_gather_cols(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let Some(comm) = &self.collective else {
            return Err(Error::InvalidArgument(
                "gathering columns outside a tensor-parallel group".into(),
            ));
        };
        if x.ld != x.cols || x.elem != Elem::F32 {
            return Err(Error::InvalidArgument(
                "all-gather of columns takes whole f32 tensors (logits)".into(),
            ));
        }
        let (rows, cols, n) = (x.rows, x.cols, comm.size());
        // NCCL gathers whole buffers rank after rank: [rank][rows][cols]; the rows of the result
        // take each rank's block side by side, one strided copy a rank.
        let staged = self.ctx.alloc(n * rows, cols, Elem::F32)?;
        let out = self.ctx.alloc(rows, n * cols, Elem::F32)?;
        self.ctx.gpu.bind()?;
        let stream = self.ctx.gpu.cu_stream();
        comm.all_gather(x.ptr, staged.ptr, rows * cols, ReduceType::F32)?;
        for r in 0..n {
            crate::runtime::copy_2d(
                out.ptr + (r * cols * 4) as u64,
                n * cols * 4,
                staged.ptr + (r * rows * cols * 4) as u64,
                cols * 4,
                cols * 4,
                rows,
                stream,
            )?;
        }
        Ok(out)
    }

    fn all_reduce(&self, x: &mut CudaTensor) -> Result<()> {
        let Some(comm) = &self.collective else {
            return Ok(());
        };
        if x.ld != x.cols {
            return Err(Error::InvalidArgument(format!(
                "all-reduce of a column slice ({} of {} columns): row-parallel outputs are whole",
                x.cols, x.ld
            )));
        }
        if self.peer_sum_rows(x)? {
            return Ok(());
        }
        let ty = match x.elem {
            Elem::F32 => ReduceType::F32,
            Elem::Half(Dtype::Bf16) => ReduceType::Bf16,
            Elem::Half(Dtype::F16) => ReduceType::F16,
        };
        comm.all_reduce_sum(x.ptr, x.rows * x.cols, ty)
    }

    fn load_weight(&self, t: &HostTensor) -> Result<CudaWeight> {
        self.upload_stacked(std::slice::from_ref(t))
    }

    fn load_vector(&self, values: &[f32]) -> Result<CudaTensor> {
        let buf = Arc::new(DeviceBuffer::from_host(&self.ctx.gpu, values, "vector")?);
        Ok(CudaTensor::owned(buf, 1, values.len(), Elem::F32))
    }

    fn new_kv_pool(&self, shape: KvShape, num_blocks: usize, block_size: usize) -> Result<CudaKv> {
        if block_size != attention::KV_BLOCK {
            return Err(Error::unsupported(
                format!("KV blocks of {block_size} tokens on the CUDA backend"),
                format!(
                    "its attention kernels read blocks of {} tokens (--block-size {0})",
                    attention::KV_BLOCK
                ),
            ));
        }
        let pool = CudaKv::new(&self.ctx.gpu, shape, num_blocks, block_size, self.ctx.dtype)?;
        if !pool.is_float() {
            if !attention::PREFILL_HEAD_DIMS.contains(&shape.head_dim) {
                return Err(Error::unsupported(
                    format!(
                        "a {} KV cache with head_dim {} on the CUDA backend",
                        shape.format, shape.head_dim
                    ),
                    format!(
                        "quantized KV caches have kernels for head_dim {:?}; use --kv kv16",
                        attention::PREFILL_HEAD_DIMS
                    ),
                ));
            }
            self.ctx.load_kv_kernels(pool.formats, pool.deferred[1])?;
        }
        Ok(pool)
    }

    fn release_kv_blocks(&self, kv: &mut CudaKv, blocks: &[u32]) {
        // Only the channel-wise formats keep per-block state: the residual slot of a block being
        // filled.
        kv.release_residual(blocks);
    }

    fn begin_forward(&self, tokens: &[u32], batch: &BatchLayout) -> Result<()> {
        // A replayed graph issues its all-reduces without asking the communicator: once the
        // group is aborted (a rank failed), no forward pass may start.
        if let Some(comm) = &self.collective
            && comm.is_aborted()
        {
            return Err(Error::InvalidArgument(
                "tensor-parallel group abandoned: another rank failed".into(),
            ));
        }
        self.window_turn.store(0, Ordering::Relaxed);
        self.residual_turn.store(0, Ordering::Relaxed);
        if let Some(p) = &self.peer {
            p.rewind();
        }
        if let Some(t) = &self.trace {
            t.begin(tokens.len(), batch.seqs.len());
        }
        self.ctx.begin_forward(tokens, batch)
    }

    fn begin_layer(&self, layer: usize) {
        if let (Some(t), 0) = (&self.trace, layer) {
            t.first_layer_begins();
        }
        let r = self.ctx.begin_layer(layer);
        self.ctx.sticky(r);
    }

    fn run_forward(
        &self,
        model: usize,
        kv: &mut CudaKv,
        batch: &BatchLayout,
        body: &mut dyn FnMut(&mut CudaKv) -> Result<CudaTensor>,
    ) -> Result<CudaTensor> {
        self.plan_kv_residual(kv, batch)?;
        let id = kv.id;
        // A rank's replay holds its communicator, so an abort cannot slip in after
        // begin_forward's check and leave the graph's collectives on a freed communicator.
        let gate = |launch: &mut dyn FnMut() -> Result<()>| match &self.collective {
            Some(comm) => comm.while_live(launch),
            None => launch(),
        };
        let out = self.ctx.run_forward(
            model,
            id,
            batch,
            &mut || {
                let out = body(kv)?;
                self.close_peer_forward()?;
                Ok(out)
            },
            &gate,
        );
        self.ctx.end_forward();
        if let Some(t) = &self.trace {
            t.end();
        }
        kv.finish_residual(out.is_ok());
        out
    }

    fn load_fused_weight(&self, parts: &[HostTensor]) -> Result<Option<CudaWeight>> {
        // One GEMM instead of several over the same input: fewer launches, and the small K/V
        // projections of a decode step no longer run as separate, poorly filled GEMVs.
        let cols = parts.first().and_then(|t| t.shape.get(1)).copied();
        if parts
            .iter()
            .any(|t| t.shape.len() != 2 || Some(t.shape[1]) != cols)
        {
            return Ok(None);
        }
        self.upload_stacked(parts).map(Some)
    }

    fn load_swiglu_weight(&self, gate: &HostTensor, up: &HostTensor) -> Result<Option<CudaWeight>> {
        if !swiglu_on() {
            return Ok(None);
        }
        if let Some(w) = self.swiglu_weight(gate, up)? {
            return Ok(Some(w));
        }
        self.dense_swiglu_weight(gate, up)
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        x.split_cols(widths)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        ew::embed(&self.ctx, table, ids)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> CudaTensor {
        let r = ew::rms_norm(&self.ctx, x, weight, eps);
        self.or_dead(r, x.rows, x.cols, Elem::Half(self.ctx.dtype))
    }

    fn residual_rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> CudaTensor {
        let r = self.settle_peer();
        self.ctx.sticky(r);
        let r = ew::residual_rms_norm(&self.ctx, x, weight, eps);
        self.or_dead(r, x.rows, x.cols, Elem::F32)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> CudaTensor {
        let r = ew::add_rms_norm(&self.ctx, x, delta, weight, eps);
        self.or_dead(r, x.rows, x.cols, Elem::Half(self.ctx.dtype))
    }

    fn norm_linear(
        &self,
        x: &mut CudaTensor,
        delta: Option<&CudaTensor>,
        norm: &CudaTensor,
        eps: f32,
        weight: &CudaWeight,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let ctx = &self.ctx;
        // One row of the residual stream, normed into 16-bit activations: the one-token gemvs
        // can take the norm over.
        let one_row = x.rows == 1
            && x.elem == Elem::F32
            && x.is_contiguous()
            && x.cols <= RESIDUAL_ROW_MAX
            && x.cols == weight.cols
            && norm.rows * norm.cols == x.cols
            && delta.is_none_or(|d| d.rows == 1 && d.cols == x.cols && d.elem == Elem::F32)
            && ctx.wants_act8().is_none();
        let dense = one_row && self.takes_dense_gemv(1, weight);
        let quant = match &weight.data {
            // Its norm reads the rows as float4s.
            WeightData::Quant(q)
                if one_row
                    && !dense
                    && self.normed_decode
                    && x.cols.is_multiple_of(4)
                    && [x.ptr, delta.map_or(0, |d| d.ptr), norm.ptr]
                        .iter()
                        .all(|p| p.is_multiple_of(16)) =>
            {
                qlinear::NormedDecode::of(ctx, q, weight.rows, weight.cols)
            }
            _ => None,
        };
        if !dense && quant.is_none() {
            let h = self.pre_norm(x, delta, norm, eps);
            return self.linear(&h, weight, bias);
        }
        // A peer sum left to the dense gemv: it waits for the peer's half and adds it itself
        // (the quantized one reads the delta settled).
        let peer = match dense {
            true => self
                .peer
                .as_ref()
                .zip(delta)
                .and_then(|(p, d)| p.take_wait(d.ptr)),
            false => None,
        };
        self.settle_peer()?;
        ctx.check_live(x)?;
        if let Some(d) = delta {
            ctx.check_live(d)?;
        }
        let next = delta.map(|_| {
            let turn = self.residual_turn.fetch_xor(1, Ordering::Relaxed);
            CudaTensor::view(self.residual_rows[turn].ptr, 1, x.cols, Elem::F32, 0)
        });
        let res_out = next.as_ref().map_or(0, |t| t.ptr);
        let out = match quant {
            Some(q) => {
                let out = ctx.alloc(1, weight.rows, Elem::F32)?;
                let args = qlinear::RowNormArgs {
                    res: x.ptr,
                    delta: delta.map_or(0, |d| d.ptr),
                    weight: norm.ptr,
                    res_out,
                    eps,
                };
                let gemm = || q.launch(ctx, &args, &out);
                match &self.trace {
                    Some(t) => t.gemm(gemm)?,
                    None => gemm()?,
                }
                out
            }
            None => {
                // A SwiGLU pair: the gemv runs over the stacked rows and writes silu(gate) * up.
                let (gemv_weight, swiglu) = match &weight.data {
                    WeightData::DenseSwiGlu(stacked) => (&**stacked, true),
                    _ => (weight, false),
                };
                let out_elem = if swiglu {
                    Elem::Half(ctx.dtype)
                } else {
                    Elem::F32
                };
                let out = ctx.alloc(1, weight.rows, out_elem)?;
                dense_gemv::run_norm(
                    ctx,
                    x,
                    delta,
                    norm,
                    eps,
                    gemv_weight,
                    &out,
                    res_out,
                    peer.as_ref(),
                    swiglu,
                )?;
                out
            }
        };
        if let Some(r) = next {
            *x = r;
        }
        if let Some(b) = bias {
            ew::add_bias(ctx, &out, b)?;
        }
        Ok(out)
    }

    fn head_rms_norm(&self, x: &mut CudaTensor, weight: &CudaTensor, head_dim: usize, eps: f32) {
        let r = ew::head_rms_norm(&self.ctx, x, weight, head_dim, eps);
        self.ctx.sticky(r);
    }

    fn linear(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        if let WeightData::SwiGlu(_) | WeightData::DenseSwiGlu(_) = &weight.data {
            return self.swiglu_linear(x, weight, bias);
        }
        let out = self.ctx.alloc(x.rows, weight.rows, Elem::F32)?;
        self.linear_into(x, weight, bias, &out)?;
        Ok(out)
    }

    fn linear_summed(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor> {
        let Some(comm) = &self.collective else {
            return self.linear(x, weight, None);
        };
        if let Some(out) = self.peer_linear_summed(x, weight, false)? {
            return Ok(out);
        }
        let n = x.rows * weight.rows;
        // Summed peer to peer (Backend::all_reduce): computed in activations, not the window.
        if self.peer_rows_take(n) {
            let mut out = self.linear(x, weight, None)?;
            self.all_reduce(&mut out)?;
            return Ok(out);
        }
        match self.window {
            // Computed straight into a slot of the symmetric window and summed there: NCCL's
            // symmetric kernels, no copy in or out. The two slots alternate, and each result is
            // read by the next residual add before the slot comes round again.
            Some((ptr, bytes)) if n * 4 <= bytes / 2 => {
                let slot = self.window_turn.fetch_xor(1, Ordering::Relaxed);
                let epoch = self.ctx.lock().arena.epoch;
                let out = CudaTensor::view(
                    ptr + (slot * bytes / 2) as u64,
                    x.rows,
                    weight.rows,
                    Elem::F32,
                    epoch,
                );
                self.linear_into(x, weight, None, &out)?;
                comm.all_reduce_sum(out.ptr, n, ReduceType::F32)?;
                Ok(out)
            }
            _ => {
                let mut out = self.linear(x, weight, None)?;
                self.all_reduce(&mut out)?;
                Ok(out)
            }
        }
    }

    fn linear_summed_delta(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor> {
        match self.peer_linear_summed(x, weight, true)? {
            Some(out) => Ok(out),
            None => self.linear_summed(x, weight),
        }
    }

    fn pre_norm(
        &self,
        x: &mut CudaTensor,
        delta: Option<&CudaTensor>,
        norm: &CudaTensor,
        eps: f32,
    ) -> CudaTensor {
        let r = self.settle_peer();
        self.ctx.sticky(r);
        match delta {
            Some(d) => self.add_rms_norm(x, d, norm, eps),
            None => self.rms_norm(x, norm, eps),
        }
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CudaTensor,
        layout: RopeLayout,
    ) {
        let r = ew::rope(&self.ctx, x, None, head_dim, batch, inv_freq, layout);
        self.ctx.sticky(r);
    }

    fn rope_qk(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CudaTensor,
        layout: RopeLayout,
    ) {
        let r = ew::rope(&self.ctx, q, Some(k), head_dim, batch, inv_freq, layout);
        self.ctx.sticky(r);
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<CudaTensor> {
        self.attention_rotated(q, k, v, kv, layer, batch, shape, None)
    }

    fn rope_attention(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
        inv_freq: &CudaTensor,
        layout: RopeLayout,
    ) -> Result<CudaTensor> {
        let rotary = attention::Rotary { inv_freq, layout };
        self.attention_rotated(q, k, v, kv, layer, batch, shape, Some(rotary))
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        let r = ew::silu_mul(&self.ctx, gate, up);
        self.or_dead(r, gate.rows, gate.cols, Elem::Half(self.ctx.dtype))
    }

    fn gelu_tanh_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        let r = ew::gelu_tanh_mul(&self.ctx, gate, up);
        self.or_dead(r, gate.rows, gate.cols, Elem::Half(self.ctx.dtype))
    }

    fn scale(&self, x: &mut CudaTensor, factor: f32) {
        let r = ew::scale(&self.ctx, x, factor);
        self.ctx.sticky(r);
    }

    fn add(&self, x: &mut CudaTensor, delta: &CudaTensor) {
        let r = self.settle_peer();
        self.ctx.sticky(r);
        let r = ew::add(&self.ctx, x, delta);
        self.ctx.sticky(r);
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let r = ew::gather_rows(&self.ctx, x, rows);
        self.or_dead(r, rows.len(), x.cols, x.elem)
    }

    fn scatter_add_scaled(
        &self,
        rows: usize,
        cols: usize,
        parts: &[ScaledRows<'_, CudaTensor>],
    ) -> Result<CudaTensor> {
        ew::moe_combine(&self.ctx, rows, cols, parts)
    }

    /// Experts run grouped ([`CudaBackend::run_grouped_swiglu`]) at decode sizes: at most
    /// [`GROUPED_ENGINE_ROWS`] rows each, three or more routed experts, eight or more for 16-bit
    /// experts. Two experts (one sequence's decode step) run one by one: the grouped launches
    /// need their item table and gather indices copied to the device, and those copies serialize
    /// the eager MoE step (Mixtral-8x7B W4A16 on an H200: 6.55 ms a batch-1 step grouped against
    /// 5.83 one by one, though the grouped GEMMs alone take 62 against 91 µs). 16-bit experts
    /// on the grouped decode gemv only break even with cuBLAS expert by expert from eight experts
    /// on (Mixtral-shaped BF16 experts: 0.89x at 2, 1.02x to 1.09x at 8; BENCHMARKS.md). With
    /// more rows the expert-by-expert path takes the wgmma and tiled kernels.
    fn grouped_swiglu(
        &self,
        x: &CudaTensor,
        experts: &[RoutedExpert<'_, CudaWeight>],
    ) -> Result<Option<Vec<CudaTensor>>> {
        let decode_sized = experts.iter().all(|e| e.rows.len() <= GROUPED_ENGINE_ROWS);
        let least = grouped_experts_least(experts[0].gate_up.quant().is_some());
        if experts.len() < least || !decode_sized {
            return Ok(None);
        }
        self.run_grouped_swiglu(x, experts)
    }

    /// Routing reads the router's logits on the host (`nibble_model::moe`), so a MoE model's steps
    /// run eagerly.
    fn check_moe(&self) -> Result<()> {
        self.ctx.forward_reads_host();
        Ok(())
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.ctx.to_host(x)
    }

    fn decode_bucket(&self, n: usize) -> usize {
        if self.ctx.graphs_on() {
            graph::decode_bucket(n)
        } else {
            n
        }
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.gpu.bind().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.gpu.synchronize()
    }

    fn sample(
        &self,
        logits: &CudaTensor,
        vocab: usize,
        specs: &[SampleSpec],
    ) -> Result<Vec<Sampled>> {
        if self.host_sampling {
            let host = self.ctx.to_host(logits)?;
            return nibble_model::sampling::sample_rows(&host, vocab, specs);
        }
        let pending = sampling::launch(&self.ctx, &self.sampling, logits, vocab, specs)?;
        sampling::collect(&self.sampling, pending)
    }

    fn runs_ahead(&self) -> bool {
        true
    }

    fn launch_sample(
        &self,
        logits: &CudaTensor,
        vocab: usize,
        specs: &[SampleSpec],
    ) -> Result<PendingSample> {
        let pending = if self.host_sampling {
            self.sample(logits, vocab, specs).map(PendingSample::Ready)
        } else {
            sampling::launch(&self.ctx, &self.sampling, logits, vocab, specs)
        }?;
        self.ctx.mark_step_end()?;
        Ok(pending)
    }

    fn record_device_timeline(&self, on: bool) {
        self.ctx.record_timeline(on);
    }

    fn take_device_timeline(&self) -> Option<nibble_model::DeviceTimeline> {
        let r = self.ctx.take_timeline();
        self.ctx.sticky(r).flatten()
    }

    fn collect_sample(&self, pending: PendingSample) -> Result<Vec<Sampled>> {
        sampling::collect(&self.sampling, pending)
    }

    fn feed_sampled(&self, rows: &[(usize, usize)]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let (sampled, records) = sampling::latest_on_device(&self.sampling).ok_or_else(|| {
            Error::InvalidArgument(
                "tokens fed from a sampling that is not on the device (none, or sampled on \
                 the host)"
                    .into(),
            )
        })?;
        if let Some(&(_, spec)) = rows.iter().find(|&&(_, spec)| spec >= records) {
            return Err(Error::InvalidArgument(format!(
                "fed token of spec {spec} from a sampling of {records}"
            )));
        }
        self.ctx
            .feed_next_forward(sampled, sampling::OUT_STRIDE, rows);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nibble_formats::TensorBytes;

    fn tensor(ty: GgmlType, bytes: Vec<u8>, rows: usize) -> HostTensor {
        let cols = bytes.len() / rows / ty.bytes_for(1).unwrap_or(2);
        HostTensor {
            name: "w".into(),
            shape: vec![rows, cols],
            format: WeightFormat::Ggml(ty),
            bytes: TensorBytes::Owned(Arc::new(bytes)),
        }
    }

    #[test]
    fn weight_bytes_keep_native_bits_and_encode_the_rest() {
        let vals = [1.5f32, -2.25, 3.0, 0.1];
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let native = tensor(GgmlType::BF16, bf.clone(), 2);
        let wide = tensor(GgmlType::F32, f32s, 2);
        let one = weight_bytes(std::slice::from_ref(&native), Dtype::Bf16).unwrap();
        assert!(matches!(one, std::borrow::Cow::Borrowed(_)));
        assert_eq!(&one[..], &bf[..]);
        let parts = [native, wide];
        let stacked = weight_bytes(&parts, Dtype::Bf16).unwrap();
        assert_eq!(&stacked[..], &[bf.clone(), bf].concat()[..]);
    }
}

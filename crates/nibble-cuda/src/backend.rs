//! `CudaBackend`: the model's ops on one GPU.
//!
//! Precision plan: the residual stream, GEMM outputs, q/k/v and the MLP's gate/up products are
//! f32; whatever a GEMM or the KV cache reads is the model dtype (bf16 or f16). GEMMs run on
//! cuBLAS with 16-bit operands and f32 accumulation and output. This keeps the GPU within a few
//! bf16 roundings of the f32 CPU reference, which is what the greedy-equality test needs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use half::{bf16, f16};
use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, WeightFormat};
use nibble_model::{AttentionShape, Backend, BatchLayout, KvShape, RopeLayout};
use nibble_precision::KvFormat;

use crate::blas::Blas;
use crate::compile;
use crate::graph::GraphCache;
use crate::kv::CudaKv;
use crate::qlinear::{Int8Input, QuantWeight};
use crate::runtime::{Arena, Arg, DeviceBuffer, DevicePtr, Gpu, Kernel, StickyError};

/// The 16-bit float type weights, GEMM inputs and the KV cache are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F16,
}

impl Dtype {
    pub fn suffix(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Converts f32 values to this dtype's bit patterns.
    pub fn encode(self, values: &[f32]) -> Vec<u16> {
        match self {
            Dtype::Bf16 => values
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect(),
            Dtype::F16 => values.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
        }
    }

    pub fn decode(self, bits: &[u16]) -> Vec<f32> {
        match self {
            Dtype::Bf16 => bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
            Dtype::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
        }
    }
}

/// What a tensor's elements are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    Half(Dtype),
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Half(_) => 2,
        }
    }
}

/// A row-major matrix on the GPU. Activations live in the per-forward arena and are valid until
/// the next forward begins (`epoch` says which one); vectors loaded with the model own their
/// memory (`epoch` 0).
pub struct CudaTensor {
    pub ptr: DevicePtr,
    pub rows: usize,
    pub cols: usize,
    /// Elements from one row to the next: `cols`, except for a column slice of a wider tensor
    /// (the q/k/v and gate/up parts of a fused projection's output).
    pub ld: usize,
    pub elem: Elem,
    epoch: u64,
    _owner: Option<Arc<DeviceBuffer>>,
    /// The tensor's per-token INT8 codes and scales, when the kernel that wrote it also made them
    /// (QServe S1: a W8A8 GEMM then reads them instead of quantizing again).
    pub(crate) int8: Option<Int8Input>,
}

impl CudaTensor {
    pub(crate) fn view(ptr: DevicePtr, rows: usize, cols: usize, elem: Elem, epoch: u64) -> Self {
        CudaTensor {
            ptr,
            rows,
            cols,
            ld: cols,
            elem,
            epoch,
            _owner: None,
            int8: None,
        }
    }

    pub fn is_contiguous(&self) -> bool {
        self.ld == self.cols
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.elem.size()
    }
}

/// A weight matrix `[rows, cols]`: in the model dtype, or packed for a quantized kernel.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub dtype: Dtype,
    pub data: WeightData,
}

pub enum WeightData {
    Dense(DeviceBuffer),
    Quant(QuantWeight),
}

impl CudaWeight {
    /// The model-dtype matrix, for ops that read weights as plain matrices (cuBLAS, embedding).
    pub fn dense(&self) -> Result<&DeviceBuffer> {
        match &self.data {
            WeightData::Dense(b) => Ok(b),
            WeightData::Quant(q) => Err(Error::unsupported(
                format!("a {} weight used as a plain matrix", q.format_name()),
                "only linear layers run quantized on the GPU",
            )),
        }
    }
}

/// The device copy of one forward pass's integer metadata, packed in one buffer.
pub(crate) struct Meta {
    /// Identifies the `BatchLayout` it was built from (its address and shape): ops compare
    /// against it instead of walking every block table again.
    key: (usize, usize, usize),
    pub tokens: DevicePtr,
    pub positions: DevicePtr,
    pub tok_seq: DevicePtr,
    pub block_tables: DevicePtr,
    pub last_rows: DevicePtr,
    pub max_blocks: usize,
    host_tokens: Vec<u32>,
    host_last_rows: Vec<usize>,
}

pub(crate) struct State {
    pub arena: Arena,
    pub meta: Option<Meta>,
    /// Persistent home of the metadata, so a captured graph reads the same addresses each step.
    meta_buf: Option<DeviceBuffer>,
    pub graphs: GraphCache,
    pub sampling: crate::sampling::SampleScratch,
}

pub struct CudaBackend {
    pub gpu: Arc<Gpu>,
    /// Bytes of every weight loaded so far (benchmarks state their floor with it).
    weight_bytes: std::sync::atomic::AtomicUsize,
    pub dtype: Dtype,
    kernels: HashMap<&'static str, Kernel>,
    blas: Mutex<Blas>,
    pub(crate) state: Mutex<State>,
    err: StickyError,
    /// Capture decode steps as CUDA graphs (on unless NIBBLE_CUDA_GRAPHS=0).
    pub graphs_enabled: bool,
    /// Sample on the host from copied logits (NIBBLE_HOST_SAMPLING=1): the reference path, kept
    /// to measure what device sampling saves.
    pub host_sampling: bool,
    /// Zeroed arrival counters of the split-K gemv kernels (each launch leaves them zeroed).
    split_counters: DeviceBuffer,
    /// Kernels whose dynamic shared-memory limit has been raised, and to what.
    smem_raised: Mutex<HashMap<String, u32>>,
    /// Set once a W8A8 weight is loaded: RMSNorm and SiLU-gate then also write INT8 codes.
    int8_inputs: std::sync::atomic::AtomicBool,
    /// Which kernel tier quantized GEMMs run ([`crate::qlinear::KernelTier`] as u8).
    pub(crate) kernel_tier: std::sync::atomic::AtomicU8,
}

const BLOCK: u32 = 256;

fn grid_for(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(BLOCK as usize).clamp(1, 65535 * 4) as u32, 1, 1)
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize, dtype: Dtype) -> Result<CudaBackend> {
        crate::probe::ensure_driver()?;
        crate::probe::ensure_libraries()?;
        let gpu = Gpu::open(ordinal)?;
        let arch = compile::arch_for(gpu.cc);
        let include = crate::probe::cuda_include_dir()?;
        let opts = compile::options(&arch, &include);
        let mut kernels = HashMap::new();
        for (name, text) in compile::SOURCES {
            let src = compile::full_source(text);
            let cubin = compile::cubin(name, &src, &opts)?;
            crate::module::load(&gpu, name, &cubin, &mut kernels)?;
        }
        let blas = Blas::new(&gpu)?;
        let split_counters = DeviceBuffer::from_host(
            &gpu,
            &vec![0i32; crate::qlinear::SPLIT_COUNTERS],
            "split-K counters",
        )?;
        Ok(CudaBackend {
            gpu,
            weight_bytes: Default::default(),
            dtype,
            kernels,
            blas: Mutex::new(blas),
            state: Mutex::new(State {
                arena: Arena::new(),
                meta: None,
                meta_buf: None,
                graphs: GraphCache::default(),
                sampling: Default::default(),
            }),
            err: StickyError::default(),
            graphs_enabled: std::env::var("NIBBLE_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            host_sampling: std::env::var("NIBBLE_HOST_SAMPLING").is_ok_and(|v| v != "0"),
            split_counters,
            smem_raised: Default::default(),
            int8_inputs: Default::default(),
            kernel_tier: Default::default(),
        })
    }

    /// Chooses the kernel tier of quantized GEMMs (tests and benchmarks compare them); the
    /// default, [`crate::qlinear::KernelTier::Auto`], picks the faster per shape.
    pub fn set_kernel_tier(&self, tier: crate::qlinear::KernelTier) {
        self.kernel_tier
            .store(tier as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether kernel `name` was compiled for this GPU.
    pub(crate) fn has_kernel(&self, name: &str) -> bool {
        self.kernels.contains_key(name)
    }

    /// Whether producers of GEMM inputs should also write INT8 codes (a W8A8 weight is loaded).
    pub fn wants_int8(&self) -> bool {
        self.int8_inputs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Allocates INT8 codes and scales for `out` and appends them to a fused kernel's `args`.
    fn int8_for(&self, out: &CudaTensor, args: &mut Vec<Arg>) -> Result<Int8Input> {
        let codes = self.alloc_bytes(out.rows * out.cols)?;
        let scales = self.alloc(out.rows, 1, Elem::F32)?.ptr;
        args.push(Arg::Ptr(codes));
        args.push(Arg::Ptr(scales));
        Ok(Int8Input { codes, scales })
    }

    pub(crate) fn split_counters(&self) -> DevicePtr {
        self.split_counters.ptr
    }

    /// `bytes` of arena memory (16-byte aligned like every arena allocation).
    pub(crate) fn alloc_bytes(&self, bytes: usize) -> Result<DevicePtr> {
        Ok(self.alloc(bytes.div_ceil(4), 1, Elem::F32)?.ptr)
    }

    /// Launches a 256-thread kernel with `smem` bytes of dynamic shared memory, raising its limit
    /// the first time.
    pub(crate) fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        smem: u32,
        args: Vec<Arg>,
    ) -> Result<()> {
        self.launch_block(name, grid, 256, smem, args)
    }

    /// [`Self::launch_smem`] with `block` threads per CTA, ordered as [`Kernel::launch`] orders
    /// it (kernels that wait on the grid dependency first start early on Hopper).
    pub(crate) fn launch_block(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: Vec<Arg>,
    ) -> Result<()> {
        let k = self.kernel(name)?;
        {
            let mut raised = self.smem_raised.lock().unwrap_or_else(|p| p.into_inner());
            if smem > 48 * 1024 && raised.get(name).is_none_or(|&r| r < smem) {
                unsafe {
                    cudarc::driver::result::function::set_function_attribute(
                        k.func,
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                }
                .map_err(|e| crate::runtime::driver_err(&format!("shared memory limit of {name}"), e))?;
                raised.insert(name.to_string(), smem);
            }
        }
        k.launch(&self.gpu, grid, block, smem, args)
    }

    pub(crate) fn kernel(&self, name: &str) -> Result<Kernel> {
        self.kernels
            .get(name)
            .copied()
            .ok_or_else(|| Error::unsupported("CUDA kernel", format!("'{name}' was not compiled")))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh activation tensor in the current forward's arena.
    pub(crate) fn alloc(&self, rows: usize, cols: usize, elem: Elem) -> Result<CudaTensor> {
        let mut st = self.lock();
        let ptr = st.arena.alloc(&self.gpu, rows * cols * elem.size())?;
        Ok(CudaTensor {
            ptr,
            rows,
            cols,
            ld: cols,
            elem,
            epoch: st.arena.epoch,
            _owner: None,
            int8: None,
        })
    }

    /// A tensor made of the f32 values given (tests and metadata use it).
    pub fn tensor_from_f32(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        assert_eq!(data.len(), rows * cols);
        let t = self.alloc(rows, cols, Elem::F32)?;
        self.gpu.upload(t.ptr, data)?;
        Ok(t)
    }

    /// Records an infallible op's failure and hands back a tensor nothing reads correctly; the
    /// next fallible op reports the error.
    fn sticky<T>(&self, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.err.record(e);
                None
            }
        }
    }

    fn dead_tensor(&self, rows: usize, cols: usize, elem: Elem) -> CudaTensor {
        CudaTensor {
            ptr: 0,
            rows,
            cols,
            ld: cols,
            elem,
            epoch: u64::MAX,
            _owner: None,
            int8: None,
        }
    }

    /// Fails if an earlier op failed, or if `t` belongs to an earlier forward pass.
    pub(crate) fn check_live(&self, t: &CudaTensor) -> Result<()> {
        self.err.check()?;
        let epoch = self.lock().arena.epoch;
        if t.epoch != 0 && t.epoch != epoch {
            return Err(Error::InvalidArgument(
                "a GPU activation was used after the forward pass that made it ended".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn half_kernel(&self, base: &str) -> Result<Kernel> {
        self.kernel(&format!("{base}_{}", self.dtype.suffix()))
    }

    /// Uploads `batch`'s metadata unless the current forward already did.
    pub(crate) fn ensure_meta(&self, tokens: Option<&[u32]>, batch: &BatchLayout) -> Result<()> {
        let key = batch_key(batch);
        {
            let st = self.lock();
            if let Some(m) = &st.meta
                && m.key == key
                && tokens.is_none_or(|t| t == m.host_tokens.as_slice())
            {
                return Ok(());
            }
        }
        let n = batch.num_tokens();
        let tokens: Vec<u32> = match tokens {
            Some(t) => t.to_vec(),
            None => vec![0; n],
        };
        if tokens.len() != n {
            return Err(Error::InvalidArgument(format!(
                "{} tokens for a batch of {n}",
                tokens.len()
            )));
        }
        // Padded to a power of two: it is a kernel argument, and graphs are keyed by it.
        let max_blocks = batch
            .seqs
            .iter()
            .map(|s| s.blocks.len())
            .max()
            .unwrap_or(0)
            .max(1)
            .next_power_of_two();
        let s = batch.seqs.len();
        let mut host: Vec<i32> = Vec::with_capacity(3 * n + s * max_blocks + s);
        host.extend(tokens.iter().map(|&t| t as i32));
        host.extend(batch.positions().iter().map(|&p| p as i32));
        for (i, seq) in batch.seqs.iter().enumerate() {
            host.extend(std::iter::repeat_n(i as i32, seq.len));
        }
        for seq in &batch.seqs {
            host.extend(seq.blocks.iter().map(|&b| b as i32));
            host.extend(std::iter::repeat_n(0, max_blocks - seq.blocks.len()));
        }
        let last_rows = batch.last_rows();
        host.extend(last_rows.iter().map(|&r| r as i32));
        let bytes = host.len() * 4;
        let mut st = self.lock();
        if st.meta_buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            // Graphs read the metadata where it was: they go with the old buffer.
            self.gpu.synchronize()?;
            st.graphs.clear();
            st.meta_buf = Some(DeviceBuffer::alloc(&self.gpu, bytes * 2, "batch metadata")?);
        }
        let base = st.meta_buf.as_ref().expect("allocated above").ptr;
        self.gpu.upload(base, &host)?;
        let at = |i: usize| base + (i * 4) as u64;
        st.meta = Some(Meta {
            key,
            tokens: at(0),
            positions: at(n),
            tok_seq: at(2 * n),
            block_tables: at(3 * n),
            last_rows: at(3 * n + s * max_blocks),
            max_blocks,
            host_tokens: tokens,
            host_last_rows: last_rows,
        });
        Ok(())
    }

    pub(crate) fn with_meta<R>(&self, f: impl FnOnce(&Meta) -> R) -> R {
        let st = self.lock();
        f(st.meta.as_ref().expect("ensure_meta ran"))
    }

    fn launch(&self, k: &str, grid: (u32, u32, u32), block: u32, args: Vec<Arg>) -> Result<()> {
        self.kernel(k)?.launch(&self.gpu, grid, block, 0, args)
    }

    fn rms_norm_into(
        &self,
        x: &CudaTensor,
        delta: Option<&CudaTensor>,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        expect_whole_f32(x, "rms_norm input")?;
        if weight.cols != x.cols {
            return Err(Error::InvalidArgument(format!(
                "rms_norm: {} features, weight of {}",
                x.cols, weight.cols
            )));
        }
        let mut out = self.alloc(x.rows, x.cols, Elem::Half(self.dtype))?;
        let mut args = vec![
            Arg::Ptr(x.ptr),
            Arg::Ptr(delta.map_or(0, |d| d.ptr)),
            Arg::Ptr(weight.ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(x.cols as i32),
            Arg::F32(eps),
        ];
        let name = if self.wants_int8() {
            let q = self.int8_for(&out, &mut args)?;
            out.int8 = Some(q);
            "rms_norm_q8"
        } else {
            "rms_norm"
        };
        self.half_kernel(name)?.launch(
            &self.gpu,
            (x.rows as u32, 1, 1),
            norm_block(x.cols),
            0,
            args,
        )?;
        Ok(out)
    }

    /// `x` as the model dtype (a cast when it is f32).
    pub(crate) fn as_half(&self, x: &CudaTensor) -> Result<CudaTensor> {
        match x.elem {
            _ if !x.is_contiguous() => Err(Error::InvalidArgument(
                "a GEMM input must be a whole tensor, not a column slice".into(),
            )),
            Elem::Half(d) if d == self.dtype => Ok(CudaTensor {
                ptr: x.ptr,
                rows: x.rows,
                cols: x.cols,
                ld: x.ld,
                elem: x.elem,
                epoch: x.epoch,
                _owner: x._owner.clone(),
                int8: x.int8,
            }),
            Elem::F32 => {
                let out = self.alloc(x.rows, x.cols, Elem::Half(self.dtype))?;
                let n = x.rows * x.cols;
                self.half_kernel("cast")?.launch(
                    &self.gpu,
                    grid_for(n),
                    BLOCK,
                    0,
                    vec![Arg::Ptr(x.ptr), Arg::Ptr(out.ptr), Arg::I64(n as i64)],
                )?;
                Ok(out)
            }
            Elem::Half(d) => Err(Error::InvalidArgument(format!(
                "a {d:?} activation on a {:?} backend",
                self.dtype
            ))),
        }
    }

    /// Test support: recycles the activation arena with room for `bytes` and fills it with 0xFF
    /// bytes, NaN as f32, bf16 and f16 alike, so an output element a kernel fails to write reads
    /// as NaN. Tensors made before this call are invalid afterwards.
    pub fn poison_activations(&self, bytes: usize) -> Result<()> {
        let mut st = self.lock();
        st.meta = None;
        st.graphs.clear();
        let (ptr, len) = st.arena.reserve(&self.gpu, bytes)?;
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, len, self.gpu.cu_stream()) }
            .map_err(|e| crate::runtime::driver_err("memset", e))?;
        Ok(())
    }

    /// Graph replays and captures so far (tests check that decode steps replay).
    pub fn graph_counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.graphs.replays, st.graphs.captures)
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A weight read as a 16-bit activation matrix (benchmarks feed a GEMM with it).
    pub fn weight_as_input(&self, w: &CudaWeight) -> Result<CudaTensor> {
        Ok(CudaTensor::view(
            w.dense()?.ptr,
            w.rows,
            w.cols,
            Elem::Half(w.dtype),
            0,
        ))
    }

    /// An f32 matrix of uniform values in [-1, 1) that owns its memory (benchmark inputs that
    /// outlive forward passes).
    pub fn random_tensor(&self, rows: usize, cols: usize, seed: i32) -> Result<CudaTensor> {
        let n = rows * cols;
        let buf = Arc::new(DeviceBuffer::alloc(&self.gpu, n * 4, "benchmark input")?);
        self.launch(
            "fill_random_f32",
            grid_for(n),
            BLOCK,
            vec![Arg::Ptr(buf.ptr), Arg::I64(n as i64), Arg::I32(seed)],
        )?;
        Ok(CudaTensor {
            ptr: buf.ptr,
            rows,
            cols,
            ld: cols,
            elem: Elem::F32,
            epoch: 0,
            _owner: Some(buf),
            int8: None,
        })
    }

    /// Benchmark support: a tensor with its own memory (not the per-forward arena), uninitialized.
    pub fn owned_tensor(&self, rows: usize, cols: usize, elem: Elem) -> Result<CudaTensor> {
        let buf = Arc::new(DeviceBuffer::alloc(
            &self.gpu,
            rows * cols * elem.size(),
            "benchmark tensor",
        )?);
        Ok(CudaTensor {
            ptr: buf.ptr,
            rows,
            cols,
            ld: cols,
            elem,
            epoch: 0,
            _owner: Some(buf),
            int8: None,
        })
    }

    /// Benchmark support: uniform values in [-1, 1) in the model dtype, in owned memory.
    pub fn random_half_tensor(&self, rows: usize, cols: usize, seed: i32) -> Result<CudaTensor> {
        let t = self.owned_tensor(rows, cols, Elem::Half(self.dtype))?;
        let n = rows * cols;
        self.half_kernel("fill_random")?.launch(
            &self.gpu,
            grid_for(n),
            BLOCK,
            0,
            vec![Arg::Ptr(t.ptr), Arg::I64(n as i64), Arg::I32(seed)],
        )?;
        Ok(t)
    }

    /// Benchmark support: `x` with its per-token INT8 codes attached, in owned memory, so a
    /// W8A8 GEMM can be timed without its quantization.
    pub fn with_owned_int8(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let codes_bytes = (x.rows * x.cols).div_ceil(16) * 16;
        let store = self.owned_tensor(codes_bytes / 4 + x.rows, 1, Elem::F32)?;
        let q = self.quantize_int8(x)?;
        self.gpu.copy(store.ptr, q.codes, x.rows * x.cols)?;
        self.gpu
            .copy(store.ptr + codes_bytes as u64, q.scales, x.rows * 4)?;
        Ok(CudaTensor {
            ptr: x.ptr,
            rows: x.rows,
            cols: x.cols,
            ld: x.ld,
            elem: x.elem,
            epoch: 0,
            _owner: store._owner.clone(),
            int8: Some(Int8Input {
                codes: store.ptr,
                scales: store.ptr + codes_bytes as u64,
            }),
        })
    }

    /// Fills a whole KV pool with uniform values in [-1, 1).
    pub fn fill_kv_random(&self, kv: &CudaKv, seed: i32) -> Result<()> {
        let n = kv.num_blocks * kv.block_size * kv.shape.num_kv_heads * kv.shape.head_dim;
        for layer in 0..kv.shape.num_layers {
            let (k, v) = kv.layer(layer);
            for (i, p) in [k, v].into_iter().enumerate() {
                self.half_kernel("fill_random")?.launch(
                    &self.gpu,
                    grid_for(n),
                    BLOCK,
                    0,
                    vec![
                        Arg::Ptr(p),
                        Arg::I64(n as i64),
                        Arg::I32(seed + 2 * layer as i32 + i as i32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Device indices: the forward's staged copy when `staged` finds them in its metadata (no
    /// upload, so a captured graph reads the buffer `begin_forward` refills), else `values`
    /// uploaded into the arena.
    fn staged_indices(
        &self,
        staged: impl FnOnce(&Meta) -> Option<DevicePtr>,
        values: &[i32],
    ) -> Result<DevicePtr> {
        if let Some(p) = self.lock().meta.as_ref().and_then(staged) {
            return Ok(p);
        }
        let t = self.alloc(1, values.len().max(1), Elem::F32)?;
        self.gpu.upload(t.ptr, values)?;
        Ok(t.ptr)
    }

    /// Checked 2-D weights with equal widths, converted to the model dtype and uploaded as one
    /// matrix, rows stacked in order (one weight, or a fused projection).
    fn upload_stacked(&self, parts: &[HostTensor]) -> Result<CudaWeight> {
        let names: Vec<&str> = parts.iter().map(|t| t.name.as_str()).collect();
        let what = format!("weight {}", names.join(" + "));
        if let Some((format, rows, cols, bytes)) = crate::qlinear::stacked_rows(parts)? {
            // Geometry the kernels cannot read (K not a multiple of 16) runs dequantized below.
            if let Ok(packed) = crate::qlinear::pack_rows(format, rows, cols, &bytes, self.dtype) {
                let q = packed.upload(self, &what)?;
                self.weight_bytes
                    .fetch_add(q.bytes(), std::sync::atomic::Ordering::Relaxed);
                if matches!(q, QuantWeight::W8 { .. }) {
                    self.int8_inputs
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(CudaWeight {
                    rows,
                    cols,
                    dtype: self.dtype,
                    data: WeightData::Quant(q),
                });
            }
        }
        let mut bits = Vec::new();
        let (mut rows, mut cols) = (0, 0);
        for t in parts {
            let (r, c, _) = t.matrix_geometry()?;
            bits.extend(weight_bits(t, self.dtype)?);
            rows += r;
            cols = c;
        }
        let buf = DeviceBuffer::from_host(&self.gpu, &bits, &what)?;
        self.weight_bytes
            .fetch_add(bits.len() * 2, std::sync::atomic::Ordering::Relaxed);
        Ok(CudaWeight {
            rows,
            cols,
            dtype: self.dtype,
            data: WeightData::Dense(buf),
        })
    }

    /// Benchmark support: records `f`'s GPU work once as a CUDA graph and returns the median
    /// seconds of `reps` replays (device time without host launch gaps, as a decode step runs).
    /// `f` must not grow the activation arena (run it once eagerly first).
    pub fn time_graph(&self, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        use cudarc::driver::result as cu;
        use cudarc::driver::sys;
        let stream = self.gpu.cu_stream();
        let err = |what: &str, e: cudarc::driver::DriverError| crate::runtime::driver_err(what, e);
        unsafe {
            cu::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(|e| err("capture", e))?;
        let body = f();
        let graph =
            unsafe { cu::stream::end_capture(stream) }.map_err(|e| err("capture end", e))?;
        body?;
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(|e| err("instantiate", e))?;
        let mut times = Vec::with_capacity(reps);
        let run = || unsafe { cu::graph::launch(exec, stream) }.map_err(|e| err("graph launch", e));
        run()?;
        self.gpu.synchronize()?;
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            run()?;
            self.gpu.synchronize()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        unsafe {
            let _ = cu::graph::exec_destroy(exec);
            let _ = cu::graph::destroy(graph);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// RoPE over `x` and, in the same launch, `second` (q and k of one layer).
    fn rope_launch(
        &self,
        x: &CudaTensor,
        second: Option<&CudaTensor>,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CudaTensor,
        layout: RopeLayout,
    ) -> Result<()> {
        expect_f32(x, "rope input")?;
        if let Some(k) = second {
            expect_f32(k, "rope input")?;
            if k.rows != x.rows {
                return Err(Error::InvalidArgument(format!(
                    "rope of q with {} rows and k with {}",
                    x.rows, k.rows
                )));
            }
        }
        self.ensure_meta(None, batch)?;
        let positions = self.with_meta(|m| m.positions);
        let other = second.unwrap_or(x);
        self.launch(
            "rope",
            (x.rows as u32, if second.is_some() { 2 } else { 1 }, 1),
            norm_block(x.cols.max(other.cols) / 2),
            vec![
                Arg::Ptr(x.ptr),
                Arg::Ptr(positions),
                Arg::Ptr(inv_freq.ptr),
                Arg::I32(x.cols as i32),
                Arg::I64(x.ld as i64),
                Arg::I32(head_dim as i32),
                Arg::I32(i32::from(layout == RopeLayout::Interleaved)),
                Arg::Ptr(other.ptr),
                Arg::I32(other.cols as i32),
                Arg::I64(other.ld as i64),
            ],
        )
    }
}

pub(crate) fn batch_key(batch: &BatchLayout) -> (usize, usize, usize) {
    (
        batch as *const BatchLayout as usize,
        batch.seqs.len(),
        batch
            .seqs
            .first()
            .map_or(0, |s| s.start_pos * 65536 + s.len),
    )
}

pub(crate) fn norm_block(cols: usize) -> u32 {
    (cols.div_ceil(4).next_power_of_two()).clamp(32, 1024) as u32
}

/// For ops that read rows back to back (norms, adds, gathers).
fn expect_whole_f32(t: &CudaTensor, what: &str) -> Result<()> {
    expect_f32(t, what)?;
    if !t.is_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "{what} must be a whole tensor, not a column slice"
        )));
    }
    Ok(())
}

fn expect_f32(t: &CudaTensor, what: &str) -> Result<()> {
    if t.elem != Elem::F32 {
        return Err(Error::InvalidArgument(format!(
            "{what} must be f32, got {:?}",
            t.elem
        )));
    }
    Ok(())
}

/// Host bits of a weight in `dtype`: 16-bit files of the same dtype as they are, anything else
/// (f32, the other 16-bit type, ggml blocks, nibble's quantized formats) decoded to f32 first.
/// Quantized formats run dequantized here until their GPU kernels exist.
fn weight_bits(t: &HostTensor, dtype: Dtype) -> Result<Vec<u16>> {
    match (t.format, dtype) {
        (WeightFormat::Ggml(GgmlType::BF16), Dtype::Bf16)
        | (WeightFormat::Ggml(GgmlType::F16), Dtype::F16) => Ok(t
            .bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()),
        _ => Ok(dtype.encode(&t.to_f32()?)),
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn name(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{}, {})",
            self.gpu.ordinal,
            self.gpu.name,
            self.gpu.cc.0,
            self.gpu.cc.1,
            self.dtype.suffix()
        )
    }

    fn load_weight(&self, t: &HostTensor) -> Result<CudaWeight> {
        self.upload_stacked(std::slice::from_ref(t))
    }

    fn load_vector(&self, values: &[f32]) -> Result<CudaTensor> {
        let buf = Arc::new(DeviceBuffer::from_host(&self.gpu, values, "vector")?);
        Ok(CudaTensor {
            ptr: buf.ptr,
            rows: 1,
            cols: values.len(),
            ld: values.len(),
            elem: Elem::F32,
            epoch: 0,
            _owner: Some(buf),
            int8: None,
        })
    }

    fn new_kv_pool(&self, shape: KvShape, num_blocks: usize, block_size: usize) -> Result<CudaKv> {
        if block_size != crate::attention::KV_BLOCK {
            return Err(Error::unsupported(
                format!("KV blocks of {block_size} tokens on the CUDA backend"),
                format!(
                    "its attention kernels read blocks of {} tokens (--block-size {0})",
                    crate::attention::KV_BLOCK
                ),
            ));
        }
        if shape.format != KvFormat::F16 {
            return Err(Error::unsupported(
                format!("KV cache format {} on the CUDA backend", shape.format),
                "only kv16 (the model dtype) runs on the GPU so far; use --kv kv16 or --device cpu",
            ));
        }
        CudaKv::new(&self.gpu, shape, num_blocks, block_size, self.dtype)
    }

    fn release_kv_blocks(&self, _kv: &mut CudaKv, _blocks: &[u32]) {
        // kv16 keeps no per-block state beyond the cache itself.
    }

    fn begin_forward(&self, tokens: &[u32], batch: &BatchLayout) -> Result<()> {
        self.err.check()?;
        self.gpu.bind()?;
        {
            let mut st = self.lock();
            if st.arena.reset(&self.gpu)? {
                st.graphs.clear();
            }
            st.meta = None;
        }
        self.ensure_meta(Some(tokens), batch)
    }

    fn begin_layer(&self, layer: usize) {
        let mut st = self.lock();
        let recording = st.graphs.recording;
        let r = st.arena.begin_layer(&self.gpu, layer, recording);
        drop(st);
        self.sticky(r);
    }

    fn run_forward(
        &self,
        model: usize,
        kv: &mut CudaKv,
        batch: &BatchLayout,
        body: &mut dyn FnMut(&mut CudaKv) -> Result<CudaTensor>,
    ) -> Result<CudaTensor> {
        let id = kv.id;
        crate::graph::run_forward(self, model, id, batch, &mut || body(kv))
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

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        if widths.iter().sum::<usize>() != x.cols {
            return Err(Error::InvalidArgument(format!(
                "split of {} columns into {widths:?}",
                x.cols
            )));
        }
        let mut at = 0;
        Ok(widths
            .iter()
            .map(|&w| {
                let t = CudaTensor {
                    ptr: x.ptr + (at * x.elem.size()) as u64,
                    rows: x.rows,
                    cols: w,
                    ld: x.ld,
                    elem: x.elem,
                    epoch: x.epoch,
                    _owner: x._owner.clone(),
                    int8: None,
                };
                at += w;
                t
            })
            .collect())
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        self.err.check()?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} outside the {}-row embedding table",
                table.rows
            )));
        }
        // The forward's metadata already holds these ids; other callers get them uploaded.
        let ids_ptr = self.staged_indices(
            |m| (m.host_tokens == ids).then_some(m.tokens),
            &ids.iter().map(|&i| i as i32).collect::<Vec<_>>(),
        )?;
        let out = self.alloc(ids.len(), table.cols, Elem::F32)?;
        self.half_kernel("embed")?.launch(
            &self.gpu,
            (ids.len() as u32, 1, 1),
            norm_block(table.cols),
            0,
            vec![
                Arg::Ptr(table.dense()?.ptr),
                Arg::Ptr(ids_ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(table.cols as i32),
            ],
        )?;
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> CudaTensor {
        let r = self.rms_norm_into(x, None, weight, eps);
        self.sticky(r)
            .unwrap_or_else(|| self.dead_tensor(x.rows, x.cols, Elem::Half(self.dtype)))
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> CudaTensor {
        let r = expect_whole_f32(delta, "residual delta")
            .and_then(|()| self.rms_norm_into(x, Some(delta), weight, eps));
        self.sticky(r)
            .unwrap_or_else(|| self.dead_tensor(x.rows, x.cols, Elem::Half(self.dtype)))
    }

    fn head_rms_norm(&self, x: &mut CudaTensor, weight: &CudaTensor, head_dim: usize, eps: f32) {
        let r = expect_f32(x, "head_rms_norm input").and_then(|()| {
            // Whole heads of each row, like the CPU.
            let row_heads = x.cols / head_dim;
            let heads = x.rows * row_heads;
            self.launch(
                "head_rms_norm",
                (heads.div_ceil(8) as u32, 1, 1),
                256,
                vec![
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(weight.ptr),
                    Arg::I32(head_dim as i32),
                    Arg::I32(row_heads as i32),
                    Arg::I64(x.ld as i64),
                    Arg::I64(heads as i64),
                    Arg::F32(eps),
                ],
            )
        });
        self.sticky(r);
    }

    fn linear(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        self.check_live(x)?;
        if x.cols != weight.cols {
            return Err(Error::InvalidArgument(format!(
                "linear: input has {} features, weight expects {}",
                x.cols, weight.cols
            )));
        }
        let out = self.alloc(x.rows, weight.rows, Elem::F32)?;
        match &weight.data {
            WeightData::Dense(_) => {
                let xh = self.as_half(x)?;
                self.blas
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .gemm(&self.gpu, &xh, weight, &out)?;
            }
            WeightData::Quant(q) => self.quant_gemm(x, q, weight.rows, weight.cols, &out)?,
        }
        if let Some(b) = bias {
            let n = out.rows * out.cols;
            self.launch(
                "add_bias",
                grid_for(n),
                BLOCK,
                vec![
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(b.ptr),
                    Arg::I32(out.cols as i32),
                    Arg::I64(n as i64),
                ],
            )?;
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CudaTensor,
        layout: RopeLayout,
    ) {
        let r = self.rope_launch(x, None, head_dim, batch, inv_freq, layout);
        self.sticky(r);
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
        let r = self.rope_launch(q, Some(k), head_dim, batch, inv_freq, layout);
        self.sticky(r);
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
        self.check_live(q)?;
        crate::attention::attention(self, q, k, v, kv, layer, batch, shape)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        let r = expect_f32(gate, "gate")
            .and_then(|()| expect_f32(up, "up"))
            .and_then(|()| {
                if (gate.rows, gate.cols) != (up.rows, up.cols) {
                    return Err(Error::InvalidArgument(format!(
                        "silu_mul of {}x{} and {}x{}",
                        gate.rows, gate.cols, up.rows, up.cols
                    )));
                }
                let mut out = self.alloc(gate.rows, gate.cols, Elem::Half(self.dtype))?;
                if self.wants_int8() {
                    // One block per row: the row's INT8 codes need its max.
                    let mut args = vec![
                        Arg::Ptr(gate.ptr),
                        Arg::Ptr(up.ptr),
                        Arg::Ptr(out.ptr),
                        Arg::I32(gate.cols as i32),
                        Arg::I64(gate.ld as i64),
                        Arg::I64(up.ld as i64),
                    ];
                    out.int8 = Some(self.int8_for(&out, &mut args)?);
                    self.half_kernel("silu_mul_q8")?.launch(
                        &self.gpu,
                        (gate.rows as u32, 1, 1),
                        norm_block(gate.cols),
                        0,
                        args,
                    )?;
                    return Ok(out);
                }
                let n = gate.rows * gate.cols;
                self.half_kernel("silu_mul")?.launch(
                    &self.gpu,
                    grid_for(n),
                    BLOCK,
                    0,
                    vec![
                        Arg::Ptr(gate.ptr),
                        Arg::Ptr(up.ptr),
                        Arg::Ptr(out.ptr),
                        Arg::I64(n as i64),
                        Arg::I32(gate.cols as i32),
                        Arg::I64(gate.ld as i64),
                        Arg::I64(up.ld as i64),
                    ],
                )?;
                Ok(out)
            });
        self.sticky(r)
            .unwrap_or_else(|| self.dead_tensor(gate.rows, gate.cols, Elem::Half(self.dtype)))
    }

    fn add(&self, x: &mut CudaTensor, delta: &CudaTensor) {
        let r = expect_whole_f32(x, "add target")
            .and_then(|()| expect_whole_f32(delta, "add delta"))
            .and_then(|()| {
                let n = x.rows * x.cols;
                self.launch(
                    "add_f32",
                    grid_for(n),
                    BLOCK,
                    vec![Arg::Ptr(x.ptr), Arg::Ptr(delta.ptr), Arg::I64(n as i64)],
                )
            });
        self.sticky(r);
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let r = expect_whole_f32(x, "gather input").and_then(|()| {
            let rows_ptr = self.staged_indices(
                |m| (m.host_last_rows == rows).then_some(m.last_rows),
                &rows.iter().map(|&r| r as i32).collect::<Vec<_>>(),
            )?;
            let out = self.alloc(rows.len(), x.cols, Elem::F32)?;
            self.launch(
                "gather_rows",
                (rows.len() as u32, 1, 1),
                norm_block(x.cols),
                vec![
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(rows_ptr),
                    Arg::Ptr(out.ptr),
                    Arg::I32(x.cols as i32),
                ],
            )?;
            Ok(out)
        });
        self.sticky(r)
            .unwrap_or_else(|| self.dead_tensor(rows.len(), x.cols, Elem::F32))
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        self.check_live(x)?;
        if !x.is_contiguous() {
            return Err(Error::InvalidArgument(
                "to_host of a column slice: copy it whole".into(),
            ));
        }
        let n = x.rows * x.cols;
        match x.elem {
            Elem::F32 => {
                let mut out = vec![0f32; n];
                self.gpu.download(&mut out, x.ptr)?;
                Ok(out)
            }
            Elem::Half(d) => {
                let mut bits = vec![0u16; n];
                self.gpu.download(&mut bits, x.ptr)?;
                Ok(d.decode(&bits))
            }
        }
    }

    fn decode_bucket(&self, n: usize) -> usize {
        if self.graphs_enabled {
            crate::graph::decode_bucket(n)
        } else {
            n
        }
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.gpu.bind().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn sample(
        &self,
        logits: &CudaTensor,
        vocab: usize,
        specs: &[nibble_model::sampling::SampleSpec],
    ) -> Result<Vec<nibble_model::sampling::Sampled>> {
        if self.host_sampling {
            let host = self.to_host(logits)?;
            return nibble_model::sampling::sample_rows(&host, vocab, specs);
        }
        crate::sampling::sample(self, logits, vocab, specs)
    }
}

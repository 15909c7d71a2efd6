//! The device context: what every op needs to run on the GPU, gathered in one place so that the
//! ops can depend on it and on nothing of each other. It owns the compiled kernels, the per-
//! forward state that captured graphs bake in (arena, batch metadata, the graph cache itself),
//! the sticky error of infallible ops and the switches that pick kernels; the ops in their own
//! modules take it by reference.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nibble_core::{Error, Result};
use nibble_model::BatchLayout;
use nibble_precision::KvSpec;

use crate::compile;
use crate::graph::{self, GraphCache, GraphKey};
use crate::host::{Event, StagingRing};
use crate::kv::PageFormat;
use crate::runtime::{Arena, Arg, DeviceBuffer, DevicePtr, Gpu, Kernel, StickyError, driver_err};
use crate::tensor::{Act8, CudaTensor, CudaWeight, Dtype, Elem};

/// Split-K arrival counters: one per row block of 128 weight rows (mma.sync gemv) or per 16-row
/// tile (decode gemv).
pub const SPLIT_COUNTERS: usize = 1 << 16;

/// Kernel tier of the quantized GEMMs: at decode sizes the mma.sync gemv (sm_80 and later) or the
/// persistent decode gemv (Hopper tier); past the gemv range the mma.sync tiled kernels or the
/// Hopper wgmma kernels (sm_90a). A context setting, not a GEMM argument, because attention reads
/// it too (its wgmma prefill kernel is a Hopper-tier kernel).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum KernelTier {
    /// Whichever measured faster (BENCHMARKS.md): on Hopper the decode gemv up to
    /// `QFamily::decode_max_m` tokens (16; 8 for FP8, 24 for W4A16 on large layers), the 64-token
    /// wgmma kernels up to `qlinear::WGMMA_SMALL_TOKENS` and the 128- or 256-token wgmma kernels
    /// past that, mma.sync everywhere else.
    Auto = 0,
    /// The mma.sync kernels for every shape (a SwiGLU weight, which has only the Hopper tier's
    /// entries, keeps the decode gemv and wgmma kernels).
    MmaSync = 1,
    /// The Hopper kernels (decode gemv, wgmma) wherever the GPU has them and the format allows.
    Hopper = 2,
}

/// Small per-step arrays bound for the device together ([`CudaContext::stage_upload_all`]): each
/// copy queued between two kernels of an eager step holds the stream up on its own, so an op that
/// needs several arrays sends them as one.
#[derive(Default)]
pub struct StepUpload {
    bytes: Vec<u8>,
}

impl StepUpload {
    /// Appends `v`, 16-byte aligned; its byte offset in the upload. `T` has no padding bytes
    /// (integers, floats, and `#[repr(C)]` records of them laid out without gaps).
    pub fn push<T: Copy>(&mut self, v: &[T]) -> usize {
        let at = self.bytes.len().next_multiple_of(16);
        self.bytes.resize(at, 0);
        // SAFETY: `v` is `size_of_val(v)` initialized bytes (T has no padding, as documented).
        let raw = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, size_of_val(v)) };
        self.bytes.extend_from_slice(raw);
        at
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
    pub host_tokens: Vec<u32>,
    pub host_last_rows: Vec<usize>,
    /// The prefill kernels' tile list of this batch, once a layer has uploaded it.
    prefill_tiles: Option<TileList>,
    /// This pass's RoPE angle tables (`elementwise::rope_table`), by frequency table and
    /// half head size.
    rope_tables: Vec<(DevicePtr, usize, DevicePtr)>,
    /// Between `begin_forward` and `end_forward`: the model's frequency tables live
    /// through the pass, so their addresses may key `rope_tables` (a direct call's table may be
    /// freed and its address reused by another).
    in_forward: bool,
}

/// A prefill tile list on the device (`attention::prefill_tiles`): the sequences it skips, its
/// rows per tile, where it is and how many tiles.
struct TileList {
    skip: usize,
    rows_per_tile: usize,
    ptr: DevicePtr,
    count: usize,
}

pub(crate) struct State {
    pub arena: Arena,
    pub meta: Option<Meta>,
    /// Persistent home of the metadata, so a captured graph reads the same addresses each step.
    meta_buf: Option<DeviceBuffer>,
    /// Home of the prefill tile lists.
    tiles_buf: Option<DeviceBuffer>,
    pub graphs: GraphCache,
    /// Rows of the next forward pass that take their token from a sampling on the device.
    feed: Option<Feed>,
}

/// Each step's start event and, once its sampling is queued, its end event.
type StepMarks = Vec<(Event, Option<Event>)>;

/// Tokens the next forward pass reads from the device ([`CudaContext::feed_next_forward`]).
struct Feed {
    sampled: DevicePtr,
    stride: usize,
    rows: Vec<(usize, usize)>,
}

pub struct CudaContext {
    pub gpu: Arc<Gpu>,
    /// Bytes of every weight loaded so far (benchmarks state their floor with it).
    weight_bytes: AtomicUsize,
    pub dtype: Dtype,
    kernels: HashMap<&'static str, Kernel>,
    /// NVRTC options of this GPU's kernels (the per-format KV modules are compiled later).
    compile_options: Vec<String>,
    /// The attention kernels of each quantized KV pool format in use, by its sides' page kinds.
    kv_modules: Mutex<HashMap<[u32; 3], Arc<Kernels>>>,
    pub(crate) state: Mutex<State>,
    /// Per-step uploads go through page-locked memory, so queueing a step never waits for the
    /// one before it.
    staging: Mutex<StagingRing>,
    /// Timed events at each step's start and end, while a profile records them.
    timeline: Mutex<Option<StepMarks>>,
    err: StickyError,
    /// Capture decode steps as CUDA graphs (on unless NIBBLE_CUDA_GRAPHS=0).
    pub graphs_enabled: bool,
    /// Set when a model whose forward reads device results on the host loads (mixture-of-experts
    /// routing): its steps cannot be captured, so they run eagerly ([`Self::graphs_on`]).
    host_reads_in_forward: AtomicBool,
    /// Grouped expert launches so far (tests check that a MoE model took them).
    grouped_launches: AtomicU64,
    /// Zeroed arrival counters of the split-K gemv kernels (each launch leaves them zeroed).
    split_counters: DeviceBuffer,
    /// Kernels whose dynamic shared-memory limit has been raised, and to what.
    smem_raised: Mutex<HashMap<String, u32>>,
    /// Set once a weight that reads 8-bit activation codes is loaded (0: none, 1: INT8, 2: FP8;
    /// the first such weight decides): RMSNorm and SiLU-gate then also write those codes.
    act8_inputs: AtomicU8,
    /// Which kernel tier quantized GEMMs run ([`KernelTier`] as u8).
    kernel_tier: AtomicU8,
    /// Whether COMET's decode batches take `comet_gemv*` (0: the default, [`crate::comet::gemv_by_default`]; 1: no,
    /// 2: yes; [`Self::set_comet_gemv`]).
    comet_gemv: AtomicU8,
    /// Whether COMET weights uploaded from now on get the wgmma tier's copy (0: the default,
    /// [`crate::comet::wgmma_by_default`]; 1: no, 2: yes; [`Self::set_comet_wgmma`]).
    comet_wgmma: AtomicU8,
}

/// An override kept in an atomic byte: 0 none (the default applies), 1 off, 2 on.
fn tri_state(on: Option<bool>) -> u8 {
    match on {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    }
}

fn from_tri_state(v: u8) -> Option<bool> {
    match v {
        1 => Some(false),
        2 => Some(true),
        _ => None,
    }
}

/// A module's kernels by name.
type Kernels = HashMap<&'static str, Kernel>;

/// Queues a graph launch, or refuses it ([`CudaContext::run_forward`]).
pub(crate) type LaunchGate<'a> = &'a dyn Fn(&mut dyn FnMut() -> Result<()>) -> Result<()>;

/// Threads per CTA of the element-wise kernels.
pub(crate) const BLOCK: u32 = 256;

/// A grid of [`BLOCK`]-thread CTAs over `n` elements (the kernels loop past 65535 * 4 CTAs).
pub(crate) fn grid_for(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(BLOCK as usize).clamp(1, 65535 * 4) as u32, 1, 1)
}

/// Threads of a one-CTA-per-row kernel over rows of `cols` elements: four elements a thread.
pub(crate) fn norm_block(cols: usize) -> u32 {
    (cols.div_ceil(4).next_power_of_two()).clamp(32, 1024) as u32
}

/// Values a thread holds on the row ops' register path (common.cuh: `ROW_VECS` float4s).
pub(crate) const ROW_REGS_VALUES: usize = 16;

/// Threads of a row kernel with the register path (`ROW_REGS_KERNEL`, common.cuh
/// `row_vec_fits`). A row the path holds gets [`ROW_REGS_VALUES`] values a thread rather than
/// [`norm_block`]'s four: a 1024-thread CTA of up to 64 registers a thread fills an SM's register
/// file, so a 256-row launch over 4096-wide rows ran in two waves; 256-thread CTAs run four to an
/// SM. Other rows (not a multiple of 4, or wider than the path holds) keep `norm_block` for the
/// paged loop. Depends on the width alone, so a row is reduced the same way alone or batched.
pub(crate) fn row_regs_block(cols: usize) -> u32 {
    if !cols.is_multiple_of(4) || cols > ROW_REGS_VALUES * 1024 {
        return norm_block(cols);
    }
    cols.div_ceil(ROW_REGS_VALUES)
        .next_power_of_two()
        .clamp(32, 1024) as u32
}

/// The KV formats of the GPU tests (tests/gpu/kv.rs, tests/gpu.rs) and of `gpu-bench
/// --kv-attention`: what [`precompile_kernels`] compiles ahead (a format missing here still
/// compiles when its pool is made).
const WARM_KV_FORMATS: &[&str] = &[
    "kv8", "kv4", "kvfp8", "k8v4", "k4v8", "kfp8v4", "k16v4", "k8v16", "k16v8", "kv4c", "kv2c",
    "k8v4c", "k4cv8",
];

/// The name and NVRTC options (after the context's `base`) of the quantized KV module for
/// `formats` and `dtype`.
fn kv_module(
    base: &[String],
    formats: [PageFormat; 2],
    v_deferred: bool,
    dtype: Dtype,
) -> (String, Vec<String>) {
    let [k, v] = formats.map(PageFormat::kernel_code);
    let opts = compile::kv_quant_options(base, dtype.suffix(), [k, v], v_deferred);
    let name = format!("kv_quant_k{k}v{v}{}", if v_deferred { "d" } else { "" });
    (name, opts)
}

/// Compiles into the disk cache, side by side, the quantized-pool modules that pools of `specs`
/// in each of `dtypes` would compile one at a time as they are made (a 16-bit pool needs none),
/// with a context's compile options `base` ([`context_compile_options`]). Needs NVRTC, not a GPU.
fn warm_kv_modules(base: &[String], specs: &[KvSpec], dtypes: &[Dtype]) -> Result<()> {
    let source = compile::full_source(compile::KV_QUANT);
    let modules = kv_modules(base, specs, dtypes);
    compile::cubin_jobs(&kv_jobs(&modules, &source).collect::<Vec<_>>()).map(drop)
}

/// [`compile::cubin_jobs`]'s jobs for `modules` ([`kv_modules`]) of the full KV source `source`.
fn kv_jobs<'a>(
    modules: &'a [(String, Vec<String>)],
    source: &'a str,
) -> impl Iterator<Item = (&'a str, &'a str, &'a [String])> {
    modules
        .iter()
        .map(move |(name, opts)| (name.as_str(), source, opts.as_slice()))
}

/// The distinct (name, options) of the quantized KV modules that pools of `specs` in each of
/// `dtypes` compile (of [`compile::KV_QUANT`]'s source).
fn kv_modules(base: &[String], specs: &[KvSpec], dtypes: &[Dtype]) -> Vec<(String, Vec<String>)> {
    let mut modules: Vec<(String, Vec<String>)> = Vec::new();
    for &spec in specs {
        let formats = PageFormat::of_spec(spec);
        if formats == [PageFormat::Float; 2] {
            continue;
        }
        for &dtype in dtypes {
            let module = kv_module(base, formats, spec.values_deferred(), dtype);
            if !modules.contains(&module) {
                modules.push(module);
            }
        }
    }
    modules
}

/// Compiles, side by side into the kernel cache, every module a context makes and the KV
/// formats' modules ([`WARM_KV_FORMATS`], both model dtypes) for `arch` (`sm_90a`, `sm_80`, ...;
/// [`gpu_arch`] gives a GPU's), with the options a context would use (NIBBLE_NVRTC_DEFINES
/// included): `nibble kernels` (the GPU scripts' `warm_kv` too; with `--list`, the names
/// scripts/gpu-precompile.sh packs into the GPU scripts' seed).
/// Needs NVRTC and the CUDA headers, not a GPU: the cache key leaves out where the headers are,
/// so a cache filled on a build machine serves a GPU machine with the same NVRTC. Returns the
/// cache's file names, one a module.
pub fn precompile_kernels(arch: &str) -> Result<Vec<String>> {
    let well_formed = arch.strip_prefix("sm_").is_some_and(|v| {
        !v.is_empty() && v.trim_end_matches('a').bytes().all(|b| b.is_ascii_digit())
    });
    if !well_formed {
        return Err(Error::InvalidArgument(format!(
            "GPU architecture '{arch}': expected sm_ and a number, such as sm_80 or sm_90a"
        )));
    }
    if compile::cache_dir().is_none() {
        return Err(Error::InvalidArgument(
            "no kernel cache directory: set NIBBLE_KERNEL_CACHE or HOME".into(),
        ));
    }
    if !crate::probe::nvrtc_available() {
        return Err(Error::unsupported(
            "compiling CUDA kernels",
            "NVRTC (libnvrtc.so.13) was not found: install the CUDA toolkit or the \
             nvidia-cuda-nvrtc wheel",
        ));
    }
    let include = crate::probe::cuda_include_dir()?;
    let opts = context_compile_options(arch, &include)?;
    let specs = WARM_KV_FORMATS
        .iter()
        .map(|f| f.parse())
        .collect::<Result<Vec<KvSpec>>>()?;
    let kv = kv_modules(&opts, &specs, &[Dtype::Bf16, Dtype::F16]);
    let sources: Vec<String> = compile::SOURCES
        .iter()
        .map(|(_, text)| compile::full_source(text))
        .collect();
    let kv_source = compile::full_source(compile::KV_QUANT);
    // One set of jobs: the context's modules and the KV formats' compile side by side.
    let jobs: Vec<(&str, &str, &[String])> = compile::SOURCES
        .iter()
        .zip(&sources)
        .map(|((name, _), source)| (*name, source.as_str(), opts.as_slice()))
        .chain(kv_jobs(&kv, &kv_source))
        .collect();
    compile::cubin_jobs(&jobs)?;
    Ok(jobs
        .iter()
        .map(|&(name, source, options)| compile::cache_file_name(name, source, options))
        .collect())
}

/// The architecture NVRTC compiles for on GPU `ordinal` (`sm_90a` on Hopper).
pub fn gpu_arch(ordinal: usize) -> Result<String> {
    Ok(compile::arch_for(Gpu::open(ordinal)?.cc))
}

/// A context's NVRTC options for `arch` with the CUDA headers in `include`: [`compile::options`]
/// and NIBBLE_NVRTC_DEFINES's names.
fn context_compile_options(arch: &str, include: &std::path::Path) -> Result<Vec<String>> {
    let mut opts = compile::options(arch, include);
    opts.extend(compile::knob_defines()?);
    Ok(opts)
}

impl CudaContext {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize, dtype: Dtype) -> Result<CudaContext> {
        crate::probe::ensure_driver()?;
        crate::probe::ensure_libraries()?;
        let gpu = Gpu::open(ordinal)?;
        let arch = compile::arch_for(gpu.cc);
        let include = crate::probe::cuda_include_dir()?;
        let opts = context_compile_options(&arch, &include)?;
        let mut kernels = HashMap::new();
        let cubins = compile::cubins(compile::SOURCES, &opts)?;
        for ((name, _), cubin) in compile::SOURCES.iter().zip(&cubins) {
            crate::module::load(&gpu, name, cubin, &mut kernels)?;
        }
        let split_counters =
            DeviceBuffer::from_host(&gpu, &vec![0i32; SPLIT_COUNTERS], "split-K counters")?;
        Ok(CudaContext {
            gpu,
            weight_bytes: Default::default(),
            dtype,
            kernels,
            compile_options: opts,
            kv_modules: Default::default(),
            state: Mutex::new(State {
                arena: Arena::new(),
                meta: None,
                meta_buf: None,
                tiles_buf: None,
                graphs: GraphCache::default(),
                feed: None,
            }),
            staging: Mutex::new(StagingRing::new()),
            timeline: Mutex::new(None),
            err: StickyError::default(),
            graphs_enabled: std::env::var("NIBBLE_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            host_reads_in_forward: AtomicBool::new(false),
            grouped_launches: AtomicU64::new(0),
            split_counters,
            smem_raised: Default::default(),
            act8_inputs: Default::default(),
            kernel_tier: Default::default(),
            comet_gemv: Default::default(),
            comet_wgmma: Default::default(),
        })
    }

    /// Chooses the kernel tier of quantized GEMMs (tests and benchmarks compare them); the
    /// default, [`KernelTier::Auto`], picks the faster per shape.
    pub fn set_kernel_tier(&self, tier: KernelTier) {
        self.kernel_tier.store(tier as u8, Ordering::Relaxed);
    }

    /// Whether COMET's decode batches (up to [`crate::comet::GEMV_MAX_TOKENS`]) run on its decode
    /// gemv (`Some(true)`), its tiled GEMM or wgmma tier (`Some(false)`) or, with `None`, the
    /// default ([`crate::comet::gemv_by_default`] and [`crate::comet::gemv_takes`]): tests and
    /// benchmarks run both.
    pub fn set_comet_gemv(&self, on: Option<bool>) {
        self.comet_gemv.store(tri_state(on), Ordering::Relaxed);
    }

    /// What [`Self::set_comet_gemv`] set.
    pub(crate) fn comet_gemv(&self) -> Option<bool> {
        from_tri_state(self.comet_gemv.load(Ordering::Relaxed))
    }

    /// Whether COMET weights uploaded after this call also get the Hopper wgmma tier's packed
    /// copy, which batches past the decode gemv then take (`Some(true)`), or not
    /// (`Some(false)`), or, with `None`, the default ([`crate::comet::wgmma_by_default`]).
    pub fn set_comet_wgmma(&self, on: Option<bool>) {
        self.comet_wgmma.store(tri_state(on), Ordering::Relaxed);
    }

    /// What [`Self::set_comet_wgmma`] set.
    pub(crate) fn comet_wgmma(&self) -> Option<bool> {
        from_tri_state(self.comet_wgmma.load(Ordering::Relaxed))
    }

    /// The [`KernelTier`] set by [`Self::set_kernel_tier`].
    pub(crate) fn tier(&self) -> KernelTier {
        match self.kernel_tier.load(Ordering::Relaxed) {
            t if t == KernelTier::MmaSync as u8 => KernelTier::MmaSync,
            t if t == KernelTier::Hopper as u8 => KernelTier::Hopper,
            _ => KernelTier::Auto,
        }
    }

    /// Whether kernel `name` was compiled for this GPU.
    pub(crate) fn has_kernel(&self, name: &str) -> bool {
        self.kernels.contains_key(name)
    }

    /// The 8-bit codes producers of GEMM inputs should also write, if any (a W8A8, W4A8 or FP8
    /// weight is loaded).
    pub fn wants_act8(&self) -> Option<Act8> {
        match self.act8_inputs.load(Ordering::Relaxed) {
            1 => Some(Act8::Int8),
            2 => Some(Act8::Fp8),
            _ => None,
        }
    }

    /// Counts a loaded weight's bytes; `act8` the activation codes its GEMMs read, which the
    /// producers of their inputs then write (the first kind loaded; a GEMM reading the other
    /// kind quantizes its input itself).
    pub(crate) fn note_weight(&self, bytes: usize, act8: Option<Act8>) {
        self.weight_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Some(kind) = act8 {
            let v = match kind {
                Act8::Int8 => 1,
                Act8::Fp8 => 2,
            };
            let _ = self
                .act8_inputs
                .compare_exchange(0, v, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn split_counters(&self) -> DevicePtr {
        self.split_counters.ptr
    }

    pub(crate) fn kernel(&self, name: &str) -> Result<Kernel> {
        self.kernels
            .get(name)
            .copied()
            .ok_or_else(|| Error::unsupported("CUDA kernel", format!("'{name}' was not compiled")))
    }

    /// Compiles (or loads cached) the attention kernels of a quantized KV pool whose keys and
    /// values are stored as `formats` say, once per format: at the pool's creation, so no compile
    /// happens inside a forward pass (or a graph capture).
    /// `v_deferred`: the values wait for their block to fill (kv4c, kv2c, k8v4c).
    pub(crate) fn load_kv_kernels(&self, formats: [PageFormat; 2], v_deferred: bool) -> Result<()> {
        let [k, v] = formats.map(PageFormat::kernel_code);
        let key = [k, v, v_deferred as u32];
        let mut modules = self.kv_modules.lock().unwrap_or_else(|p| p.into_inner());
        if modules.contains_key(&key) {
            return Ok(());
        }
        let (name, opts) = kv_module(&self.compile_options, formats, v_deferred, self.dtype);
        let cubin = compile::cubin(&name, &compile::full_source(compile::KV_QUANT), &opts)?;
        let mut kernels = HashMap::new();
        crate::module::load(&self.gpu, &name, &cubin, &mut kernels)?;
        modules.insert(key, Arc::new(kernels));
        Ok(())
    }

    /// [`warm_kv_modules`] with this context's compile options, so tests that make pool after pool
    /// find their modules cached.
    pub fn warm_kv_kernels(&self, specs: &[KvSpec], dtypes: &[Dtype]) -> Result<()> {
        warm_kv_modules(&self.compile_options, specs, dtypes)
    }

    /// Kernel `name` of the quantized KV pool format `formats` ([`Self::load_kv_kernels`]).
    pub(crate) fn kv_kernel(
        &self,
        formats: [PageFormat; 2],
        v_deferred: bool,
        name: &str,
    ) -> Result<Kernel> {
        let [k, v] = formats.map(PageFormat::kernel_code);
        let modules = self.kv_modules.lock().unwrap_or_else(|p| p.into_inner());
        modules
            .get(&[k, v, v_deferred as u32])
            .and_then(|m| m.get(name).copied())
            .ok_or_else(|| {
                Error::unsupported(
                    "CUDA kernel",
                    format!("'{name}' of the KV pool format {formats:?} was not compiled"),
                )
            })
    }

    pub(crate) fn half_kernel(&self, base: &str) -> Result<Kernel> {
        self.kernel(&format!("{base}_{}", self.dtype.suffix()))
    }

    pub(crate) fn launch(
        &self,
        k: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: Vec<Arg>,
    ) -> Result<()> {
        self.kernel(k)?.launch(&self.gpu, grid, block, 0, args)
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
                .map_err(|e| driver_err(&format!("shared memory limit of {name}"), e))?;
                raised.insert(name.to_string(), smem);
            }
        }
        k.launch(&self.gpu, grid, block, smem, args)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh activation tensor in the current forward's arena.
    pub(crate) fn alloc(&self, rows: usize, cols: usize, elem: Elem) -> Result<CudaTensor> {
        let mut st = self.lock();
        let ptr = st.arena.alloc(&self.gpu, rows * cols * elem.size())?;
        Ok(CudaTensor::view(ptr, rows, cols, elem, st.arena.epoch))
    }

    /// `bytes` of arena memory (16-byte aligned like every arena allocation).
    pub(crate) fn alloc_bytes(&self, bytes: usize) -> Result<DevicePtr> {
        Ok(self.alloc(bytes.div_ceil(4), 1, Elem::F32)?.ptr)
    }

    /// A tensor made of the f32 values given (tests and metadata use it).
    pub fn tensor_from_f32(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        assert_eq!(data.len(), rows * cols);
        let t = self.alloc(rows, cols, Elem::F32)?;
        self.gpu.upload(t.ptr, data)?;
        Ok(t)
    }

    /// Benchmark support: a tensor with its own memory (not the per-forward arena), uninitialized.
    pub fn owned_tensor(&self, rows: usize, cols: usize, elem: Elem) -> Result<CudaTensor> {
        let buf = Arc::new(DeviceBuffer::alloc(
            &self.gpu,
            rows * cols * elem.size(),
            "benchmark tensor",
        )?);
        Ok(CudaTensor::owned(buf, rows, cols, elem))
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

    /// Records an infallible op's failure and hands back nothing; the next fallible op reports
    /// the error. The `Backend` trait makes element-wise ops infallible so that model code stays
    /// free of `?` on every line.
    pub(crate) fn sticky<T>(&self, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.err.record(e);
                None
            }
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

    /// Fails if an earlier infallible op failed.
    pub(crate) fn check_err(&self) -> Result<()> {
        self.err.check()
    }

    /// `x` as the model dtype (a cast when it is f32): what every GEMM reads.
    pub fn as_half(&self, x: &CudaTensor) -> Result<CudaTensor> {
        match x.elem {
            _ if !x.is_contiguous() => Err(Error::InvalidArgument(
                "a GEMM input must be a whole tensor, not a column slice".into(),
            )),
            Elem::Half(d) if d == self.dtype => Ok(x.share()),
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

    /// `x`'s values on the host, as f32.
    pub(crate) fn to_host(&self, x: &CudaTensor) -> Result<Vec<f32>> {
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

    /// A forward pass begins: the arena is recycled (graphs go if it moved) and `batch`'s
    /// metadata uploaded.
    pub(crate) fn begin_forward(&self, tokens: &[u32], batch: &BatchLayout) -> Result<()> {
        self.err.check()?;
        self.gpu.bind()?;
        if let Some(t) = self
            .timeline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            let start = Event::timed(&self.gpu)?;
            start.record(&self.gpu)?;
            t.push((start, None));
        }
        let feed = {
            let mut st = self.lock();
            if st.arena.reset(&self.gpu)? {
                st.graphs.clear();
            }
            st.meta = None;
            st.feed.take()
        };
        self.ensure_meta(Some(tokens), batch)?;
        if let Some(m) = self.lock().meta.as_mut() {
            m.in_forward = true;
        }
        match feed {
            Some(f) => self.apply_feed(f, tokens.len()),
            None => Ok(()),
        }
    }

    /// Starts or stops recording each step's start and end on the device's clock.
    pub(crate) fn record_timeline(&self, on: bool) {
        *self.timeline.lock().unwrap_or_else(|p| p.into_inner()) = on.then(Vec::new);
    }

    /// Marks the end of the current step's work (after its sampling is queued).
    pub(crate) fn mark_step_end(&self) -> Result<()> {
        let mut t = self.timeline.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, end @ None)) = t.as_mut().and_then(|t| t.last_mut()) {
            let e = Event::timed(&self.gpu)?;
            e.record(&self.gpu)?;
            *end = Some(e);
        }
        Ok(())
    }

    /// The recorded steps' busy and idle time (waits for the device), and starts afresh. A
    /// forward pass that sampled nothing counts as busy until the next one starts.
    pub(crate) fn take_timeline(&self) -> Result<Option<nibble_model::DeviceTimeline>> {
        let steps = {
            let mut t = self.timeline.lock().unwrap_or_else(|p| p.into_inner());
            match t.as_mut() {
                Some(t) => std::mem::take(t),
                None => return Ok(None),
            }
        };
        self.gpu.synchronize()?;
        let mut out = nibble_model::DeviceTimeline {
            steps: steps.len(),
            ..Default::default()
        };
        for (i, (start, end)) in steps.iter().enumerate() {
            let next = steps.get(i + 1).map(|(s, _)| s);
            match (end, next) {
                (Some(end), next) => {
                    out.busy_s += end.seconds_since(start)?;
                    if let Some(next) = next {
                        out.idle_s += next.seconds_since(end)?.max(0.0);
                    }
                }
                (None, Some(next)) => out.busy_s += next.seconds_since(start)?,
                (None, None) => {}
            }
        }
        Ok(Some(out))
    }

    /// Says that the next forward pass's rows `rows[i].0` take the token of record `rows[i].1`
    /// of `sampled` (records of `stride` ints, the token first), on the device.
    pub(crate) fn feed_next_forward(
        &self,
        sampled: DevicePtr,
        stride: usize,
        rows: &[(usize, usize)],
    ) {
        self.lock().feed = (!rows.is_empty()).then(|| Feed {
            sampled,
            stride,
            rows: rows.to_vec(),
        });
    }

    /// Overwrites the staged tokens of the fed rows with their sampled ids. The pairs travel
    /// in the arena, which the forward pass has just recycled.
    fn apply_feed(&self, feed: Feed, num_tokens: usize) -> Result<()> {
        if let Some(&(row, _)) = feed.rows.iter().find(|&&(row, _)| row >= num_tokens) {
            return Err(Error::InvalidArgument(format!(
                "fed row {row} of a {num_tokens}-token batch"
            )));
        }
        let pairs: Vec<i32> = feed
            .rows
            .iter()
            .flat_map(|&(row, spec)| [row as i32, spec as i32])
            .collect();
        let buf = self.alloc(1, pairs.len(), Elem::F32)?;
        self.stage_upload(buf.ptr, &pairs)?;
        let tokens = self.with_meta(|m| m.tokens);
        let n = feed.rows.len();
        self.launch(
            "feed_tokens",
            grid_for(n),
            BLOCK,
            vec![
                Arg::Ptr(tokens),
                Arg::Ptr(feed.sampled),
                Arg::I32(feed.stride as i32),
                Arg::Ptr(buf.ptr),
                Arg::I32(n as i32),
            ],
        )
    }

    /// Queues a copy of per-step data to the device through page-locked staging: the host
    /// does not wait for the stream. While a graph is being recorded, a plain upload (recorded
    /// as its node) instead.
    pub(crate) fn stage_upload<T: Copy>(&self, dst: DevicePtr, src: &[T]) -> Result<()> {
        let recording = self.lock().graphs.recording;
        self.upload_step_data(recording, dst, src)
    }

    /// Sends the arrays of `up` in one arena allocation and one staged copy: the device address
    /// of its offset 0 (each array lies at the offset [`StepUpload::push`] returned).
    pub fn stage_upload_all(&self, up: &StepUpload) -> Result<DevicePtr> {
        let base = self.alloc_bytes(up.bytes.len().max(16))?;
        self.stage_upload(base, &up.bytes)?;
        Ok(base)
    }

    /// [`Self::stage_upload`] for callers that hold the state lock and read `recording` there.
    /// Queues a per-step upload outside graph capture (through the staging ring).
    pub(crate) fn upload_step<T: Copy>(&self, dst: DevicePtr, src: &[T]) -> Result<()> {
        self.upload_step_data(false, dst, src)
    }

    fn upload_step_data<T: Copy>(&self, recording: bool, dst: DevicePtr, src: &[T]) -> Result<()> {
        if recording {
            return self.gpu.upload(dst, src);
        }
        self.staging
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .upload(&self.gpu, dst, src)
    }

    /// Layer `layer` begins: its arena region is rewound.
    pub(crate) fn begin_layer(&self, layer: usize) -> Result<()> {
        let mut st = self.lock();
        let recording = st.graphs.recording;
        st.arena.begin_layer(&self.gpu, layer, recording)
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
        self.upload_step_data(st.graphs.recording, base, &host)?;
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
            prefill_tiles: None,
            rope_tables: Vec::new(),
            in_forward: false,
        });
        Ok(())
    }

    /// The current batch's prefill tile list for `skip` leading sequences and `rows_per_tile`
    /// rows, made by `build` and uploaded the first time a layer asks, as (device address,
    /// tiles).
    pub(crate) fn prefill_tile_list(
        &self,
        skip: usize,
        rows_per_tile: usize,
        build: impl FnOnce() -> Vec<[i32; 4]>,
    ) -> Result<(DevicePtr, usize)> {
        let mut st = self.lock();
        let meta = st.meta.as_ref().expect("ensure_meta ran");
        if let Some(t) = &meta.prefill_tiles
            && (t.skip, t.rows_per_tile) == (skip, rows_per_tile)
        {
            return Ok((t.ptr, t.count));
        }
        let tiles = build();
        let bytes = std::mem::size_of_val(tiles.as_slice());
        if st.tiles_buf.as_ref().is_none_or(|b| b.bytes < bytes) {
            // Kernels of earlier steps may still read the old buffer.
            self.gpu.synchronize()?;
            st.tiles_buf = Some(DeviceBuffer::alloc(&self.gpu, bytes * 2, "prefill tiles")?);
        }
        let ptr = st.tiles_buf.as_ref().expect("allocated above").ptr;
        self.upload_step_data(st.graphs.recording, ptr, tiles.as_flattened())?;
        let count = tiles.len();
        st.meta.as_mut().expect("ensure_meta ran").prefill_tiles = Some(TileList {
            skip,
            rows_per_tile,
            ptr,
            count,
        });
        Ok((ptr, count))
    }

    /// The current pass's RoPE angles for frequency table `inv_freq` and `half` angles a token,
    /// once `make` has queued them into the base region's `bytes` it is given: every layer of
    /// a forward pass reads the same table (a call outside one makes its own).
    pub(crate) fn rope_table(
        &self,
        inv_freq: DevicePtr,
        half: usize,
        bytes: usize,
        make: impl FnOnce(DevicePtr) -> Result<()>,
    ) -> Result<DevicePtr> {
        let (found, cached) = self.with_meta(|m| {
            let found = m
                .rope_tables
                .iter()
                .find(|t| (t.0, t.1) == (inv_freq, half));
            (found.map(|t| t.2), m.in_forward)
        });
        if let Some(ptr) = found {
            return Ok(ptr);
        }
        // A pass's table lives through all its layers (the base region); a direct call's only
        // through the call.
        let ptr = {
            let mut st = self.lock();
            if cached {
                st.arena.alloc_base(&self.gpu, bytes)?
            } else {
                st.arena.alloc(&self.gpu, bytes)?
            }
        };
        make(ptr)?;
        if cached {
            let mut st = self.lock();
            let meta = st.meta.as_mut().expect("ensure_meta ran");
            meta.rope_tables.push((inv_freq, half, ptr));
        }
        Ok(ptr)
    }

    /// The forward pass `begin_forward` began is over: its frequency tables' addresses no
    /// longer key its angle tables.
    pub(crate) fn end_forward(&self) {
        if let Some(m) = self.lock().meta.as_mut() {
            m.in_forward = false;
            m.rope_tables.clear();
        }
    }

    pub(crate) fn with_meta<R>(&self, f: impl FnOnce(&Meta) -> R) -> R {
        let st = self.lock();
        f(st.meta.as_ref().expect("ensure_meta ran"))
    }

    /// Device indices: the forward's staged copy when `staged` finds them in its metadata (no
    /// upload, so a captured graph reads the buffer `begin_forward` refills), else `values`
    /// uploaded into the arena.
    pub(crate) fn staged_indices(
        &self,
        staged: impl FnOnce(&Meta) -> Option<DevicePtr>,
        values: &[i32],
    ) -> Result<DevicePtr> {
        if let Some(p) = self.lock().meta.as_ref().and_then(staged) {
            return Ok(p);
        }
        let t = self.alloc(1, values.len().max(1), Elem::F32)?;
        self.stage_upload(t.ptr, values)?;
        Ok(t.ptr)
    }

    /// Whether decode steps are captured and replayed as CUDA graphs: asked for, and no loaded
    /// model reads device results on the host in its forward pass.
    pub fn graphs_on(&self) -> bool {
        self.graphs_enabled && !self.host_reads_in_forward.load(Ordering::Relaxed)
    }

    /// Grouped expert GEMM launches so far (`grouped::grouped_gemm`, `GroupedGemm::launch`).
    pub fn grouped_expert_launches(&self) -> u64 {
        self.grouped_launches.load(Ordering::Relaxed)
    }

    pub(crate) fn count_grouped_launch(&self) {
        self.grouped_launches.fetch_add(1, Ordering::Relaxed);
    }

    /// A model whose forward pass copies device results to the host (mixture-of-experts routing)
    /// is loading: from now on steps run eagerly, since a graph capture cannot wait on the host.
    pub(crate) fn forward_reads_host(&self) {
        self.host_reads_in_forward.store(true, Ordering::Relaxed);
    }

    /// Runs one forward pass, through a graph when it is a decode step ([`graph`] says why that
    /// is valid). Driven from here because the replay restores the arena and the cache must see
    /// the same lock as everything that moves what graphs bake in.
    /// `gate` queues a graph launch: a tensor-parallel rank's runs it only while its group is
    /// live (`Communicator::while_live`), since a graph's collectives bypass the communicator.
    pub(crate) fn run_forward(
        &self,
        model: usize,
        kv_id: u64,
        batch: &BatchLayout,
        body: &mut dyn FnMut() -> Result<CudaTensor>,
        gate: LaunchGate,
    ) -> Result<CudaTensor> {
        if !self.graphs_on() || !graph::is_graph_step(batch) {
            return body();
        }
        let key = GraphKey {
            model,
            kv: kv_id,
            seqs: batch.seqs.len(),
            max_blocks: self.with_meta(|m| m.max_blocks),
        };
        {
            let mut st = self.lock();
            st.graphs.serve_pool(&self.gpu, &key)?;
            let mut replayed = None;
            gate(&mut || {
                replayed = st.graphs.replay(&self.gpu, &key)?;
                Ok(())
            })?;
            if let Some((out, mark)) = replayed {
                st.arena.restore(mark);
                let epoch = st.arena.epoch;
                return Ok(CudaTensor::view(out.0, out.1, out.2, out.3, epoch));
            }
            // Recorded at first sight once the arena has its size (the engine's warm-up gives it
            // the largest step's); before that, steps run eagerly and size it.
            if st.graphs.refused(&key) || !st.arena.settled() {
                drop(st);
                return body();
            }
        }
        let stream = self.gpu.cu_stream();
        graph::begin_capture(stream, "graph capture")?;
        self.lock().graphs.recording = true;
        let out = body();
        self.lock().graphs.recording = false;
        let captured = graph::end_capture(stream);
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                // A step that failed while recording (a collective refused after an abort): its
                // partial graph is never run.
                if let Ok(g) = captured {
                    graph::destroy(None, g);
                }
                return Err(e);
            }
        };
        let captured = captured.map_err(|e| driver_err("graph capture end", e))?;
        let exec = match graph::instantiate(captured) {
            Ok(e) => e,
            Err(e) => {
                graph::destroy(None, captured);
                self.lock().graphs.refuse(key);
                return Err(driver_err("graph instantiate", e));
            }
        };
        // Capture records without running: run it now.
        if let Err(e) = gate(&mut || graph::launch(exec, stream)) {
            graph::destroy(Some(exec), captured);
            return Err(e);
        }
        let mut st = self.lock();
        if st.arena.settled() {
            let arena = st.arena.mark();
            st.graphs.keep(
                key,
                (exec, captured),
                (out.ptr, out.rows, out.cols, out.elem),
                arena,
            );
        } else {
            // The step outgrew the arena while capturing: its extra buffers go at the next reset,
            // so this graph must not be replayed. It has run; destroy it once it finished.
            drop(st);
            let finished = self.gpu.synchronize();
            graph::destroy(Some(exec), captured);
            finished?;
        }
        Ok(out)
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
            .map_err(|e| driver_err("memset", e))?;
        Ok(())
    }

    /// Graph replays and captures so far (tests check that decode steps replay).
    pub fn graph_counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.graphs.replays, st.graphs.captures)
    }

    /// Benchmark support: records `f`'s GPU work once as a CUDA graph and returns the median
    /// seconds of `reps` replays (device time without host launch gaps, as a decode step runs).
    /// `f` must not grow the activation arena (run it once eagerly first).
    pub fn time_graph(&self, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        graph::time_graph(&self.gpu, reps, f)
    }
}

fn batch_key(batch: &BatchLayout) -> (usize, usize, usize) {
    (
        batch as *const BatchLayout as usize,
        batch.seqs.len(),
        batch
            .seqs
            .first()
            .map_or(0, |s| s.start_pos * 65536 + s.len),
    )
}

#[cfg(test)]
mod tests {
    use super::{ROW_REGS_VALUES, norm_block, row_regs_block};

    #[test]
    fn row_kernels_hold_their_rows() {
        // The register path holds every row it is given (row_vec_fits on the device), in CTAs
        // of a warp to 1024 threads, and a 4096-wide row in 256 threads.
        for cols in (4..=ROW_REGS_VALUES * 1024).step_by(4) {
            let threads = row_regs_block(cols) as usize;
            assert!(
                threads * ROW_REGS_VALUES >= cols,
                "{cols} wide in {threads}"
            );
            assert!(threads.is_power_of_two() && (32..=1024).contains(&threads));
            assert!(
                threads == 32 || (threads / 2) * ROW_REGS_VALUES < cols,
                "{cols}: too many"
            );
        }
        assert_eq!(row_regs_block(4096), 256);
        assert_eq!(row_regs_block(14336), 1024);
        // Rows the path cannot hold keep four values a thread for the paged loop.
        for cols in [1, 1001, 4097, ROW_REGS_VALUES * 1024 + 4, 20000] {
            assert_eq!(row_regs_block(cols), norm_block(cols));
        }
    }

    #[test]
    fn register_path_width_agrees_with_the_kernels() {
        let common = include_str!("../kernels/common.cuh");
        let vecs: usize = common
            .lines()
            .find_map(|l| l.strip_prefix("#define ROW_VECS "))
            .expect("common.cuh defines ROW_VECS")
            .trim()
            .parse()
            .expect("ROW_VECS is a number");
        assert_eq!(vecs * 4, ROW_REGS_VALUES);
    }
}

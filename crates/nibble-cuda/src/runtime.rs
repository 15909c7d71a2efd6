//! The device, its one stream, device memory and kernel launches, on cudarc's thin `result`
//! layer. nibble runs every op on one stream in issue order, so buffers need none of cudarc's
//! per-slice event tracking; raw device pointers keep launches cheap and make a decode step
//! capturable as a CUDA graph.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use nibble_core::{Error, Result};

pub type DevicePtr = sys::CUdeviceptr;

pub(crate) fn driver_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::unsupported(format!("CUDA {what}"), format!("{e:?}"))
}

/// An out-of-memory error that says how much was asked for and how much was free.
pub(crate) fn oom(what: &str, bytes: usize) -> Error {
    let free = cu::mem_get_info().map(|(f, _)| f).unwrap_or(0);
    Error::LimitExceeded {
        what: format!("GPU memory for {what} (bytes; {} MiB free)", free >> 20),
        value: bytes,
        limit: free,
    }
}

/// The GPU nibble runs on: its context, its stream and what kernels are compiled for.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0) for Hopper.
    pub cc: (i32, i32),
    pub sm_count: usize,
    /// L2 cache bytes: benchmarks rotate weights through more than this so they read HBM.
    pub l2_bytes: usize,
    pub total_mem: usize,
    /// Since when the host has been blocked waiting for this GPU's work ([`WaitGauge`]).
    pub(crate) waits: Arc<WaitGauge>,
}

/// Whether, and since when, a host thread is blocked waiting for a GPU's stream (a synchronize,
/// a download, an event): what a tensor-parallel group's step deadline watches, since a rank
/// whose peer stopped taking part in the collectives waits here for ever.
#[derive(Default)]
pub struct WaitGauge {
    /// Milliseconds since the Unix epoch when the current wait began; 0 when none is under way.
    since_ms: std::sync::atomic::AtomicU64,
}

impl WaitGauge {
    /// Runs the blocking `wait`, marked as one.
    pub(crate) fn during<R>(&self, wait: impl FnOnce() -> R) -> R {
        use std::sync::atomic::Ordering;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis().max(1) as u64);
        self.since_ms.store(now, Ordering::Release);
        let r = wait();
        self.since_ms.store(0, Ordering::Release);
        r
    }

    /// How long the current wait has lasted, if one is under way.
    pub fn waiting_for(&self) -> Option<std::time::Duration> {
        let since = self.since_ms.load(std::sync::atomic::Ordering::Acquire);
        if since == 0 {
            return None;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_millis() as u64;
        Some(std::time::Duration::from_millis(now.saturating_sub(since)))
    }
}

impl Gpu {
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        crate::probe::ensure_driver()?;
        let count = CudaContext::device_count().map_err(|e| driver_err("device count", e))?;
        if ordinal >= count as usize {
            return Err(Error::InvalidArgument(format!(
                "cuda:{ordinal} asked for, but the driver sees {count} GPU(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("context", e))?;
        // One stream in issue order: cudarc's cross-stream event tracking would only add work.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| driver_err("stream", e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("attribute", e))? as usize;
        let l2_bytes = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| driver_err("attribute", e))? as usize;
        Ok(Arc::new(Gpu {
            name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            total_mem: ctx.total_mem().unwrap_or(0),
            ctx,
            stream,
            ordinal,
            cc,
            sm_count,
            l2_bytes,
            waits: Arc::default(),
        }))
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("context bind", e))
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    pub fn synchronize(&self) -> Result<()> {
        self.waits
            .during(|| self.stream.synchronize())
            .map_err(|e| driver_err("stream synchronize (an earlier kernel failed)", e))
    }

    /// How long the host has been blocked waiting for this GPU, if it is now.
    pub fn waiting_for(&self) -> Option<std::time::Duration> {
        self.waits.waiting_for()
    }

    pub fn upload<T: Copy>(&self, dst: DevicePtr, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        unsafe { cu::memcpy_htod_async(dst, src, self.cu_stream()) }
            .map_err(|e| driver_err("copy to device", e))
    }

    pub fn download<T: Copy>(&self, dst: &mut [T], src: DevicePtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        unsafe { cu::memcpy_dtoh_async(dst, src, self.cu_stream()) }
            .map_err(|e| driver_err("copy to host", e))?;
        self.synchronize()
    }

    pub fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .map_err(|e| driver_err("device copy", e))
    }
}

/// A strided device-to-device copy queued on `stream`: `height` rows of `width` bytes, rows
/// `src_pitch` bytes apart in the source and `dst_pitch` in the destination.
pub(crate) fn copy_2d(
    dst: DevicePtr,
    dst_pitch: usize,
    src: DevicePtr,
    src_pitch: usize,
    width: usize,
    height: usize,
    stream: sys::CUstream,
) -> Result<()> {
    if width == 0 || height == 0 {
        return Ok(());
    }
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    let r = unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_err("strided device copy", r));
    }
    Ok(())
}

/// Device memory owned by Rust: weights, vectors, KV pools, the activation arena.
pub struct DeviceBuffer {
    pub ptr: DevicePtr,
    pub bytes: usize,
    gpu: Arc<Gpu>,
}

impl DeviceBuffer {
    pub fn alloc(gpu: &Arc<Gpu>, bytes: usize, what: &str) -> Result<DeviceBuffer> {
        gpu.bind()?;
        let ptr = unsafe { cu::malloc_sync(bytes.max(256)) }.map_err(|_| oom(what, bytes))?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            gpu: gpu.clone(),
        })
    }

    pub fn from_host<T: Copy>(gpu: &Arc<Gpu>, data: &[T], what: &str) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::alloc(gpu, std::mem::size_of_val(data), what)?;
        gpu.upload(buf.ptr, data)?;
        Ok(buf)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // cuMemFree waits for work that may still read the buffer.
        let _ = self.gpu.bind();
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}

/// One bump-allocated stretch of device memory. An allocation past its main buffer gets an
/// extra buffer; the next reset folds the extras into a main buffer as large as the most the
/// region held at once, plus a quarter.
struct Region {
    main: Option<DeviceBuffer>,
    used: usize,
    extra: Vec<DeviceBuffer>,
    /// Bytes handed out since the last rewind (main and extras), and the most of that seen.
    span: usize,
    peak: usize,
}

impl Region {
    const fn new() -> Region {
        Region {
            main: None,
            used: 0,
            extra: Vec::new(),
            span: 0,
            peak: 0,
        }
    }

    fn alloc(&mut self, gpu: &Arc<Gpu>, bytes: usize) -> Result<DevicePtr> {
        self.span += bytes;
        self.peak = self.peak.max(self.span);
        if let Some(m) = &self.main
            && self.used + bytes <= m.bytes
        {
            let p = m.ptr + self.used as u64;
            self.used += bytes;
            return Ok(p);
        }
        let buf = DeviceBuffer::alloc(gpu, bytes, "activations")?;
        let p = buf.ptr;
        self.extra.push(buf);
        Ok(p)
    }

    /// Hands the region out again from its start. A region that outgrew its main buffer is
    /// folded into one now (after the GPU has finished with the old buffers), so a growing first
    /// forward does not take new memory for every layer; while a graph is being recorded the
    /// extras stay until the forward's reset instead (the recording is then dropped).
    fn rewind(&mut self, gpu: &Arc<Gpu>, recording: bool) -> Result<()> {
        self.used = 0;
        self.span = 0;
        if self.extra.is_empty() || recording {
            return Ok(());
        }
        gpu.synchronize()?;
        self.extra.clear();
        let want = self.peak + self.peak / 4;
        if self.main.as_ref().is_none_or(|m| m.bytes < want) {
            self.main = None;
            self.main = Some(DeviceBuffer::alloc(gpu, want, "activations")?);
        }
        Ok(())
    }

    /// Returns whether the main buffer moved (it grew).
    fn reset(&mut self, gpu: &Arc<Gpu>) -> Result<bool> {
        self.used = 0;
        self.span = 0;
        if self.extra.is_empty() {
            return Ok(false);
        }
        let want = self.peak + self.peak / 4;
        self.extra.clear();
        self.main = None;
        self.main = Some(DeviceBuffer::alloc(gpu, want, "activations")?);
        Ok(true)
    }
}

/// Where an arena stands: the bytes used in each region and the one allocating. A replayed graph
/// restores the state its recording ended in.
#[derive(Clone, Copy, Debug)]
pub struct ArenaMark {
    used: [usize; 3],
    current: usize,
}

/// Per-forward scratch memory: every activation of one forward pass is bump-allocated here and
/// recycled, so allocation is a pointer add and a decode step replays with the same addresses,
/// which is what lets it be captured as a graph. The model's layers alternate between two
/// regions, each rewound when the layer after next begins ([`Arena::begin_layer`]): a layer reads
/// only the previous layer's outputs and what was made before the first layer (the residual
/// stream, in the base region), so a forward pass needs two layers' activations, not all of
/// them. The whole arena is recycled when the next forward begins.
pub struct Arena {
    /// 0: before the first layer and outside forwards; 1 and 2: even and odd layers.
    regions: [Region; 3],
    current: usize,
    /// Bumped by every reset; tensors carry the epoch they were made in.
    pub epoch: u64,
}

const ALIGN: usize = 256;

impl Arena {
    pub fn new() -> Arena {
        Arena {
            regions: [Region::new(), Region::new(), Region::new()],
            current: 0,
            epoch: 1,
        }
    }

    pub fn alloc(&mut self, gpu: &Arc<Gpu>, bytes: usize) -> Result<DevicePtr> {
        let bytes = bytes.div_ceil(ALIGN) * ALIGN;
        self.regions[self.current].alloc(gpu, bytes)
    }

    /// [`Arena::alloc`] in the base region, whatever layer runs: for what every layer of the
    /// forward pass reads (its RoPE angles).
    pub fn alloc_base(&mut self, gpu: &Arc<Gpu>, bytes: usize) -> Result<DevicePtr> {
        let bytes = bytes.div_ceil(ALIGN) * ALIGN;
        self.regions[0].alloc(gpu, bytes)
    }

    /// Layer `layer` begins: its activations go to its parity's region, whose previous contents
    /// (layer `layer - 2`'s) are dead. `recording`: a graph is being captured (no synchronizing).
    pub fn begin_layer(&mut self, gpu: &Arc<Gpu>, layer: usize, recording: bool) -> Result<()> {
        self.current = 1 + layer % 2;
        self.regions[self.current].rewind(gpu, recording)
    }

    /// Starts a new forward pass; returns whether a main buffer moved (one grew).
    pub fn reset(&mut self, gpu: &Arc<Gpu>) -> Result<bool> {
        self.epoch += 1;
        self.current = 0;
        let mut moved = false;
        for r in &mut self.regions {
            moved |= r.reset(gpu)?;
        }
        Ok(moved)
    }

    /// Whether everything allocated since the reset came from main buffers (a graph may only be
    /// kept then: extra buffers are freed at the next reset), after a forward sized them.
    pub fn settled(&self) -> bool {
        self.regions[0].main.is_some() && self.regions.iter().all(|r| r.extra.is_empty())
    }

    /// Empties the arena and makes its base region at least `bytes`; returns that buffer.
    pub fn reserve(&mut self, gpu: &Arc<Gpu>, bytes: usize) -> Result<(DevicePtr, usize)> {
        self.reset(gpu)?;
        let base = &mut self.regions[0];
        if base.main.as_ref().is_none_or(|m| m.bytes < bytes) {
            base.main = None;
            base.main = Some(DeviceBuffer::alloc(gpu, bytes, "activations")?);
        }
        let m = base.main.as_ref().expect("allocated above");
        Ok((m.ptr, m.bytes))
    }

    pub fn mark(&self) -> ArenaMark {
        ArenaMark {
            used: [0, 1, 2].map(|i| self.regions[i].used),
            current: self.current,
        }
    }

    /// After a graph replay: the arena as the recorded step left it.
    pub fn restore(&mut self, mark: ArenaMark) {
        for (r, &used) in self.regions.iter_mut().zip(&mark.used) {
            r.used = used;
            r.span = used;
        }
        self.current = mark.current;
    }
}

/// A kernel argument: what `cuLaunchKernel` reads through its `void**`.
pub enum Arg {
    Ptr(DevicePtr),
    I32(i32),
    I64(i64),
    F32(f32),
    /// A TMA descriptor passed by value (`const __grid_constant__`), boxed for its alignment.
    TensorMap(Box<sys::CUtensorMap>),
}

impl Arg {
    fn as_void(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(p) => p as *mut DevicePtr as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::TensorMap(m) => &mut **m as *mut sys::CUtensorMap as *mut c_void,
        }
    }
}

/// How TMA lays a box out in shared memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum TmaLayout {
    /// As in global memory.
    Plain,
    /// The 128-byte swizzle a wgmma operand descriptor reads: box rows of exactly 128 bytes.
    Swizzle128,
}

/// Threads of a CTA of the Hopper wgmma GEMMs (kernels/qgemm_wgmma.cu's WGQ_THREADS: two consumer
/// warpgroups and a producer), quantized linear layers' and COMET's alike.
pub(crate) const WGMMA_THREADS: u32 = 384;

/// A TMA descriptor, as a kernel argument, over packed weight bytes laid out as
/// `[tiles][rows][row_bytes]`, read in boxes of 8 tiles x `box_rows` rows.
pub(crate) fn weight_map(
    ptr: u64,
    tiles: usize,
    rows: usize,
    row_bytes: usize,
    box_rows: usize,
) -> Result<Arg> {
    let words = row_bytes / 4;
    let map = tensor_map(
        ptr,
        4,
        &[words, rows, tiles],
        &[row_bytes, rows * row_bytes],
        &[words, box_rows, 8],
        TmaLayout::Plain,
    )?;
    Ok(Arg::TensorMap(Box::new(map)))
}

/// A TMA descriptor for a tensor of `dims` elements of `elem` (1, 2 or 4) bytes, innermost first,
/// dimension `i + 1` `strides[i]` bytes apart, read in boxes of `boxes` elements (reads past the
/// tensor are zeros), into shared memory as is or 128-byte swizzled.
pub fn tensor_map(
    ptr: DevicePtr,
    elem: usize,
    dims: &[usize],
    strides: &[usize],
    boxes: &[usize],
    layout: TmaLayout,
) -> Result<sys::CUtensorMap> {
    use sys::{
        CUtensorMapDataType as D, CUtensorMapFloatOOBfill as F, CUtensorMapInterleave as I,
        CUtensorMapL2promotion as L, CUtensorMapSwizzle as S,
    };
    let dtype = match elem {
        1 => D::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        2 => D::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        4 => D::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "TMA tensor of {elem}-byte elements"
            )));
        }
    };
    let inner = boxes.first().copied().unwrap_or(0) * elem;
    if dims.is_empty()
        || dims.len() > 5
        || strides.len() + 1 != dims.len()
        || boxes.len() != dims.len()
        || !ptr.is_multiple_of(16)
        || strides.iter().any(|s| !s.is_multiple_of(16))
        || !inner.is_multiple_of(16)
        || (layout == TmaLayout::Swizzle128 && inner != 128)
        || boxes.iter().any(|&b| b == 0 || b > 256)
    {
        return Err(Error::InvalidArgument(format!(
            "no TMA descriptor for pointer {ptr:#x}, dims {dims:?}, strides {strides:?} bytes, \
             box {boxes:?} of {elem}-byte elements: TMA needs 16-byte aligned strides and box rows, \
             boxes of 1 to 256, rows of 128 bytes to swizzle"
        )));
    }
    let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    let strides: Vec<u64> = strides.iter().map(|&s| s as u64).collect();
    let boxes: Vec<u32> = boxes.iter().map(|&b| b as u32).collect();
    let steps = vec![1u32; dims.len()];
    let swizzle = match layout {
        TmaLayout::Swizzle128 => S::CU_TENSOR_MAP_SWIZZLE_128B,
        TmaLayout::Plain => S::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            dims.len() as u32,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            I::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            F::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(|e| driver_err("cuTensorMapEncodeTiled", e))?;
        Ok(map.assume_init())
    }
}

/// A compiled kernel entry point.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub func: sys::CUfunction,
    pub name: &'static str,
}

unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// How a launch is ordered after the previous kernel on the stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Launch {
    /// After it has finished (the default).
    Stream,
    /// Programmatic dependent launch (sm_90 and later): the kernel may start while the previous
    /// one still runs, and must execute `griddepcontrol.wait` before it touches anything that
    /// kernel writes. Kept in CUDA graphs as a programmatic edge.
    Dependent,
}

impl Kernel {
    /// How this kernel follows the previous one: launch latency is a large share of a decode
    /// step's small kernels, so on Hopper each one that waits on the grid dependency first
    /// ([`crate::compile::waits_on_grid_first`]) is scheduled while its predecessor finishes.
    pub fn order(&self, gpu: &Gpu) -> Launch {
        if gpu.cc.0 >= 9 && crate::compile::waits_on_grid_first(self.name) {
            Launch::Dependent
        } else {
            Launch::Stream
        }
    }

    /// Launches on the GPU's stream, ordered as [`Self::order`] says.
    pub fn launch(
        &self,
        gpu: &Gpu,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        mut args: Vec<Arg>,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut params: Vec<*mut c_void> = args.iter_mut().map(Arg::as_void).collect();
        let launched = match self.order(gpu) {
            Launch::Stream => unsafe {
                cu::launch_kernel(
                    self.func,
                    grid,
                    (block, 1, 1),
                    smem,
                    gpu.cu_stream(),
                    &mut params,
                )
            },
            Launch::Dependent => {
                // SAFETY: a zeroed launch attribute is a valid "ignore" value; the union member
                // written is the one the attribute id names.
                let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
                attr.id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let config = sys::CUlaunchConfig {
                    gridDimX: grid.0,
                    gridDimY: grid.1,
                    gridDimZ: grid.2,
                    blockDimX: block,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: gpu.cu_stream(),
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                // SAFETY: `params` points at `args`, which outlive the call; the driver copies
                // both.
                unsafe {
                    sys::cuLaunchKernelEx(
                        &config,
                        self.func,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }
                .result()
            }
        };
        launched.map_err(|e| driver_err(&format!("launch of {}", self.name), e))
    }
}

/// The first error of an op that cannot return one (the `Backend` trait's infallible ops); the
/// next fallible op reports it. Kernel faults are sticky in CUDA anyway.
#[derive(Default)]
pub struct StickyError(Mutex<Option<String>>);

impl StickyError {
    pub fn record(&self, e: Error) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e.to_string());
        }
    }

    pub fn check(&self) -> Result<()> {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Some(msg) => Err(Error::unsupported("CUDA backend", msg.clone())),
            None => Ok(()),
        }
    }
}

/// A probe knob: environment variable `name` parsed once into `cell` (`None` when unset or not a
/// count). The bench/probe scripts set them to sweep one dispatch choice from a single build.
pub(crate) fn probe_knob(
    cell: &'static std::sync::OnceLock<Option<usize>>,
    name: &str,
) -> Option<usize> {
    *cell.get_or_init(|| std::env::var(name).ok().and_then(|v| v.parse().ok()))
}

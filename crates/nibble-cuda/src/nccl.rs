//! NCCL, the collective library tensor parallelism sums its partial outputs with, loaded at run
//! time as cuBLAS is: nibble builds and runs without it, and a missing library is an error that
//! says where it was looked for, never a panic.
//!
//! Only what tensor parallelism calls is bound: the unique id, one communicator per rank, the
//! in-place sum all-reduce and the all-gather on a rank's stream (so a CUDA graph captures them
//! with the rest of a decode step), abort and destroy. cudarc has NCCL bindings, but its loader
//! looks for `libnccl.so` and `libnccl.so.<CUDA major>` only, while NCCL's library is
//! `libnccl.so.2` (the `nvidia-nccl-cu13` wheel ships nothing else), so the few entry points are
//! loaded here.
//!
//! Where the library is looked for, in order: `$NIBBLE_NCCL_LIB` (a file), the dynamic loader's
//! own search (`libnccl.so.2`, `libnccl.so`: `LD_LIBRARY_PATH`, the system), then the
//! `nvidia/nccl/lib` folder of the Python environments pip installs `nvidia-nccl-cu13` into.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use nibble_core::{Error, Result};

use crate::runtime::{DevicePtr, Gpu};

type RawComm = *mut c_void;
type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_SUM: c_int = 0;

/// `ncclUniqueId`: 128 opaque bytes rank 0 makes and every rank joins with (passed by value).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

/// The element types nibble reduces, as NCCL numbers them (`ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceType {
    F16 = 6,
    F32 = 7,
    Bf16 = 9,
}

struct Api {
    _lib: libloading::Library,
    path: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        RawComm,
        sys::CUstream,
    ) -> NcclResult,
    /// NCCL 2.27's symmetric memory (absent before it): buffers every rank allocates alike and
    /// registers together, which NCCL's low-latency symmetric kernels reduce over NVLink loads
    /// and stores instead of its ring's staged copies.
    symmetric: Option<SymmetricApi>,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
}

struct SymmetricApi {
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult,
    mem_free: unsafe extern "C" fn(*mut c_void) -> NcclResult,
    window_register:
        unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult,
    window_deregister: unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult,
}

type RawWindow = *mut c_void;
/// `NCCL_WIN_COLL_SYMMETRIC`: the window takes part in symmetric collectives.
const NCCL_WIN_COLL_SYMMETRIC: c_int = 1;

/// Where a pip-installed NCCL may sit: `<prefix>/lib/python3.*/{site,dist}-packages/nvidia/nccl/lib`.
fn python_candidates() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    let mut out = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons.into_iter().rev() {
            for packages in ["site-packages", "dist-packages"] {
                let lib = py.join(packages).join("nvidia/nccl/lib/libnccl.so.2");
                if lib.is_file() {
                    out.push(lib);
                }
            }
        }
    }
    out
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<String> = Vec::new();
    if let Some(p) = std::env::var_os("NIBBLE_NCCL_LIB") {
        candidates.push(p.to_string_lossy().into_owned());
    }
    candidates.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    candidates.extend(
        python_candidates()
            .into_iter()
            .map(|p| p.display().to_string()),
    );
    for name in candidates {
        let lib = match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => lib,
            Err(_) => {
                tried.push(name);
                continue;
            }
        };
        // The symbols are NCCL's documented C API (nccl.h), with these signatures.
        let api = unsafe {
            macro_rules! sym {
                ($n:literal) => {
                    *lib.get($n)
                        .map_err(|e| format!("{name} has no {}: {e}", stringify!($n)))?
                };
            }
            Api {
                get_version: sym!(b"ncclGetVersion\0"),
                get_unique_id: sym!(b"ncclGetUniqueId\0"),
                comm_init_rank: sym!(b"ncclCommInitRank\0"),
                all_reduce: sym!(b"ncclAllReduce\0"),
                all_gather: sym!(b"ncclAllGather\0"),
                symmetric: (|| {
                    Some(SymmetricApi {
                        mem_alloc: *lib.get(b"ncclMemAlloc\0").ok()?,
                        mem_free: *lib.get(b"ncclMemFree\0").ok()?,
                        window_register: *lib.get(b"ncclCommWindowRegister\0").ok()?,
                        window_deregister: *lib.get(b"ncclCommWindowDeregister\0").ok()?,
                    })
                })(),
                comm_abort: sym!(b"ncclCommAbort\0"),
                comm_destroy: sym!(b"ncclCommDestroy\0"),
                get_error_string: sym!(b"ncclGetErrorString\0"),
                path: name.clone(),
                _lib: lib,
            }
        };
        return Ok(api);
    }
    Err(format!(
        "NCCL (libnccl.so.2) could not be loaded (tried {}): `pip install nvidia-nccl-cu13`, put \
         its folder on LD_LIBRARY_PATH, or name the file in NIBBLE_NCCL_LIB",
        tried.join(", ")
    ))
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|msg| Error::unsupported("tensor parallelism on GPUs", msg.clone()))
}

fn check(api: &Api, what: &str, r: NcclResult) -> Result<()> {
    if r == NCCL_SUCCESS {
        return Ok(());
    }
    let msg = unsafe { (api.get_error_string)(r) };
    let msg = if msg.is_null() {
        format!("error {r}")
    } else {
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    Err(Error::unsupported(format!("NCCL {what}"), msg))
}

/// The error of a collective (or a replay holding collectives) asked for after the group's abort.
fn abandoned(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "tensor-parallel {what} abandoned: the group was aborted (another rank failed)"
    ))
}

/// Whether NCCL loads here, and which version and file it is (`NCCL 2.28.3 (libnccl.so.2)`).
pub fn describe() -> Result<String> {
    let api = api()?;
    let mut v: c_int = 0;
    check(api, "version", unsafe { (api.get_version)(&mut v) })?;
    Ok(format!(
        "NCCL {}.{}.{} ({})",
        v / 10000,
        v / 100 % 100,
        v % 100,
        api.path
    ))
}

/// A new group's id: made once (rank 0's job across hosts), handed to every rank.
pub fn unique_id() -> Result<UniqueId> {
    let api = api()?;
    let mut id = UniqueId { internal: [0; 128] };
    check(api, "unique id", unsafe { (api.get_unique_id)(&mut id) })?;
    Ok(id)
}

/// One rank's communicator, bound to its GPU. After [`Communicator::abort`] every call is an
/// error: the handle is gone, and an aborted group stays aborted.
pub struct Communicator {
    raw: Mutex<Option<RawCommHandle>>,
    /// Symmetric windows this rank registered ([`Communicator::symmetric_window`]): deregistered
    /// and freed before the communicator is destroyed.
    windows: Mutex<Vec<Window>>,
    /// Set by [`Communicator::abort`]; read without the lock on every forward pass.
    aborted: AtomicBool,
    rank: usize,
    size: usize,
    /// The GPU's context lives as long as the communicator: NCCL's resources sit in it, and a
    /// context torn down under a live communicator (a failed rank's backend dropped before the
    /// group's abort) stalled the run for 100 s in its first two-GPU test.
    gpu: Arc<Gpu>,
}

struct RawCommHandle(RawComm);

/// One registered symmetric buffer: its memory (from `ncclMemAlloc`) and NCCL's window handle.
struct Window {
    ptr: DevicePtr,
    raw: RawWindow,
}
// NCCL's handle, used under the communicator's locks only.
unsafe impl Send for Window {}
// The handle is NCCL's; NCCL allows a communicator to be used from any thread, one at a time,
// which the mutex around it gives.
unsafe impl Send for RawCommHandle {}

impl Communicator {
    /// Joins rank `rank` of `size` to the group `id` on `gpu`. Blocks until every rank has
    /// joined, so the ranks call this concurrently (one thread or process each).
    pub fn join(gpu: &Arc<Gpu>, id: &UniqueId, rank: usize, size: usize) -> Result<Communicator> {
        let api = api()?;
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a group of {size}"
            )));
        }
        // NCCL takes its device from the calling thread's current context.
        gpu.bind()?;
        let mut raw: RawComm = std::ptr::null_mut();
        check(api, "communicator init", unsafe {
            (api.comm_init_rank)(&mut raw, size as c_int, *id, rank as c_int)
        })?;
        Ok(Communicator {
            raw: Mutex::new(Some(RawCommHandle(raw))),
            windows: Mutex::default(),
            aborted: AtomicBool::new(false),
            rank,
            size,
            gpu: gpu.clone(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Queues one collective, `call(communicator, stream)`, on the GPU's stream (a capturing
    /// stream records it into the graph); an error once the group is aborted.
    fn collective(
        &self,
        what: &str,
        call: impl FnOnce(&Api, RawComm, sys::CUstream) -> NcclResult,
    ) -> Result<()> {
        let api = api()?;
        self.gpu.bind()?;
        let guard = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        let Some(raw) = guard.as_ref() else {
            return Err(abandoned(what));
        };
        check(api, what, call(api, raw.0, self.gpu.cu_stream()))
    }

    /// Runs `launch` (a graph replay, whose collectives do not come through here) while the
    /// communicator is live, holding it so that an abort on another thread waits until the launch
    /// is queued, and aborts it with the rest; an error, without running `launch`, once the group
    /// is aborted. Without this a replay could start between a check of [`Self::is_aborted`] and an
    /// abort, and run collectives on a communicator NCCL has freed. Queueing a launch waits on the
    /// GPU only when the stream's launch queue is full, which a decode loop that reads each
    /// step's tokens never fills; the CLI's watchdog bounds that case too.
    pub fn while_live(&self, launch: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let guard = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() || self.is_aborted() {
            return Err(abandoned("graph replay"));
        }
        launch()
    }

    /// Replaces the `count` elements at `ptr` by their sum over the group.
    pub fn all_reduce_sum(&self, ptr: DevicePtr, count: usize, ty: ReduceType) -> Result<()> {
        self.collective("all-reduce", |api, comm, stream| unsafe {
            (api.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                ty as c_int,
                NCCL_SUM,
                comm,
                stream,
            )
        })
    }

    /// Writes every rank's `count` elements at `send`, in rank order, to `recv` (`count` times
    /// the group's size).
    pub fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        ty: ReduceType,
    ) -> Result<()> {
        self.collective("all-gather", |api, comm, stream| unsafe {
            (api.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                ty as c_int,
                comm,
                stream,
            )
        })
    }

    /// `bytes` of device memory every rank of the group holds at the same offset of a window
    /// registered with NCCL for symmetric collectives, so that an all-reduce in place there runs
    /// NCCL's low-latency symmetric kernels. Collective: every rank calls it with the same
    /// `bytes`, side by side; `all_ok` tells a rank whether every rank allocated its memory (the
    /// registration that follows waits for all of them). `Ok(None)` where this NCCL predates
    /// symmetric memory (2.27) or some rank could not allocate it; the memory lives as long as
    /// the communicator.
    pub fn symmetric_window(
        &self,
        bytes: usize,
        all_ok: impl FnOnce(bool) -> Result<bool>,
    ) -> Result<Option<DevicePtr>> {
        let api = api()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if let Some(sym) = &api.symmetric {
            self.gpu.bind()?;
            if unsafe { (sym.mem_alloc)(&mut ptr, bytes) } != NCCL_SUCCESS {
                ptr = std::ptr::null_mut();
            }
        }
        let free = |ptr: *mut c_void| {
            if let (Some(sym), false) = (&api.symmetric, ptr.is_null()) {
                unsafe { (sym.mem_free)(ptr) };
            }
        };
        match all_ok(!ptr.is_null()) {
            Ok(true) => {}
            other => {
                free(ptr);
                return other.map(|_| None);
            }
        }
        let sym = api.symmetric.as_ref().expect("allocated above");
        let guard = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        let Some(raw) = guard.as_ref() else {
            free(ptr);
            return Err(abandoned("window"));
        };
        let mut win: RawWindow = std::ptr::null_mut();
        let r =
            unsafe { (sym.window_register)(raw.0, ptr, bytes, &mut win, NCCL_WIN_COLL_SYMMETRIC) };
        if let Err(e) = check(api, "symmetric window registration", r) {
            free(ptr);
            return Err(e);
        }
        self.windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Window {
                ptr: ptr as DevicePtr,
                raw: win,
            });
        Ok(Some(ptr as DevicePtr))
    }

    /// Deregisters (with a live communicator) and frees this rank's symmetric windows.
    fn free_windows(&self, api: &Api, comm: Option<RawComm>) {
        let Some(sym) = &api.symmetric else {
            return;
        };
        for w in self
            .windows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            unsafe {
                if let Some(comm) = comm {
                    (sym.window_deregister)(comm, w.raw);
                }
                (sym.mem_free)(w.ptr as *mut c_void);
            }
        }
    }

    /// Ends the communicator now: collectives in flight on the device stop (so a rank blocked on
    /// its stream waiting for a peer that failed gets its stream back), and later calls are
    /// errors. Safe to call from any thread, and more than once.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let taken = self.raw.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let (Some(raw), Ok(api)) = (taken, api()) {
            let _ = self.gpu.bind();
            unsafe { (api.comm_abort)(raw.0) };
            self.free_windows(api, None);
        }
    }

    /// How long the host has been blocked waiting for this rank's GPU, if it is now.
    pub fn gpu_waiting_for(&self) -> Option<std::time::Duration> {
        self.gpu.waiting_for()
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let taken = self.raw.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let (Some(raw), Ok(api)) = (taken, api()) {
            // NCCL's calls take their device from the calling thread's context.
            let _ = self.gpu.bind();
            self.free_windows(api, Some(raw.0));
            unsafe { (api.comm_destroy)(raw.0) };
        }
    }
}

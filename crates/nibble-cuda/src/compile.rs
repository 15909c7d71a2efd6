//! Kernels are CUDA C++ embedded in the binary and compiled with NVRTC for the GPU found, to a
//! cubin for its exact architecture (`sm_90a` on Hopper, so wgmma, TMA and setmaxnreg are there).
//! Cubins are cached on disk, keyed by the source, the options and the NVRTC version, so a model
//! starts without compiling anything after the first run.

use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use nibble_core::{Error, Result};
use sha2::{Digest, Sha256};

/// Every kernel source: (module name, text). `common.cuh` is prepended to each.
pub const COMMON: &str = include_str!("../kernels/common.cuh");
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("../kernels/elementwise.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
    // The mma.sync prefill kernel and its wgmma tier (sm_90a) share the tile list.
    (
        "prefill",
        concat!(
            include_str!("../kernels/kv_pages.cuh"),
            "\n",
            include_str!("../kernels/prefill.cu"),
            "\n",
            include_str!("../kernels/hopper.cuh"),
            "\n",
            include_str!("../kernels/prefill_wgmma.cu")
        ),
    ),
    (
        "decode_mma",
        concat!(
            include_str!("../kernels/kv_pages.cuh"),
            "\n",
            include_str!("../kernels/decode_mma.cu")
        ),
    ),
    ("sampling", include_str!("../kernels/sampling.cu")),
    ("comet", include_str!("../kernels/comet.cu")),
    // One module: the decode gemv and the wgmma tier (sm_90a) reuse the mma.sync tier's
    // helpers and epilogues; hopper.cuh holds what the wgmma kernels and the dense decode gemv
    // (TMA bulk copies) share.
    (
        "qgemm",
        concat!(
            include_str!("../kernels/qgemm.cu"),
            "\n",
            include_str!("../kernels/qgemv.cu"),
            "\n",
            include_str!("../kernels/hopper.cuh"),
            "\n",
            include_str!("../kernels/qgemm_wgmma.cu"),
            "\n",
            include_str!("../kernels/qgemm_fp8.cu"),
            "\n",
            include_str!("../kernels/qgemv_grouped.cu"),
            "\n",
            include_str!("../kernels/gemv_dense.cu")
        ),
    ),
];

/// The attention kernels over a quantized KV pool, compiled per pool format with
/// [`kv_quant_options`]: the 16-bit pool's decode and prefill kernels instantiated with quantized
/// pages, and the quantizing append.
pub const KV_QUANT: &str = concat!(
    "#define NIBBLE_KVQ_MODULE\n",
    include_str!("../kernels/kv_pages.cuh"),
    "\n",
    include_str!("../kernels/decode_mma.cu"),
    "\n",
    include_str!("../kernels/prefill.cu"),
    "\n",
    include_str!("../kernels/kv_quant.cu")
);

/// [`options`] plus what picks the [`KV_QUANT`] module's instance: the model dtype (`bf16` or
/// `f16`), the keys' and values' page kinds (`PageFormat::kernel_code`), and `v_deferred`: the
/// values wait for their block to fill (`kv4c`, `kv2c`, `k8v4c`; channel-wise keys, kinds 5 and
/// 6, always do). A deferred module has `kvq_append_residual` and `kvq_pack` instead of
/// `kvq_append`, and its decode and prefill read a query's own block from the residual
/// (docs/design/kv-channel-gpu.md).
pub fn kv_quant_options(
    base: &[String],
    dtype: &str,
    kinds: [u32; 2],
    v_deferred: bool,
) -> Vec<String> {
    let t = if dtype == "f16" {
        "__half"
    } else {
        "__nv_bfloat16"
    };
    let mut o = base.to_vec();
    o.push(format!("-DNIBBLE_KVQ_T={t}"));
    o.push(format!("-DNIBBLE_KVQ_K={}", kinds[0]));
    o.push(format!("-DNIBBLE_KVQ_V={}", kinds[1]));
    o.push(format!("-DNIBBLE_KVQ_VDEFER={}", v_deferred as u32));
    o
}

/// Kernels, by name prefix, that call `grid_dependency_wait` (common.cuh) before they touch
/// memory, so that [`crate::runtime::Kernel::launch`] may start them while the previous kernel
/// still runs (programmatic dependent launch, sm_90 and later). These are the small kernels of a
/// decode step, whose launch latency is a large share of their time, and the decode gemv, whose
/// weight loads go out before its wait. Listing a kernel that does not wait first is a data race.
pub const GRID_WAITING_KERNELS: &[&str] = &[
    "embed_",
    "rms_norm_",
    "silu_mul_",
    "kv_append_",
    "rope",
    "add_f32",
    "gather_rows",
    "moe_combine",
    "quantize_i8_",
    "quantize_f8_",
    "paged_attn_",
    "attn_reduce_",
    "decode_mma_",
    "kvq_decode_",
    "kvq_append_",
    "w4a16_dec",
    "w8a8_dec",
    "w8a16_dec",
    "w4a8_dec",
    "fp8_dec",
    // The 64-token wgmma tiles of W8A8 and FP8 (kernels/qgemm_wgmma.cu, `LaunchesEarly`) issue
    // their first stages' weight copies before the wait.
    "w8a8_wgmma64",
    "fp8_wgmma64",
    "dense_gemv",
    "peer_sum_settle",
    "peer_sum_rows",
    // The grouped decode gemv also reads its item table before the wait: grouped.rs uploads
    // tables ahead of a layer's kernels, never between two of them.
    "w4a16_gdec",
    "w8a8_gdec",
    "w8a16_gdec",
    "w4a8_gdec",
    "fp8_gdec",
    "b16_gdec",
];

/// Whether kernel `name` is one of [`GRID_WAITING_KERNELS`].
pub fn waits_on_grid_first(name: &str) -> bool {
    GRID_WAITING_KERNELS.iter().any(|p| name.starts_with(p))
}

/// The NVRTC `--gpu-architecture` for a compute capability: the `a` variant on Hopper and later
/// data-center parts, whose arch-specific instructions (wgmma, setmaxnreg) need it.
pub fn arch_for(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".into(),
        (10, 0) => "sm_100a".into(),
        (maj, min) => format!("sm_{maj}{min}"),
    }
}

/// `-D` options for the names in NIBBLE_NVRTC_DEFINES (separated by commas or `+`, the form
/// `scripts/gpu-abn.sh` stages take, whose knobs are comma-separated), so a kernel variant under
/// `#ifdef` can be A/B'd against the default in one build (`scripts/gpu-abn.sh` with
/// `@NIBBLE_NVRTC_DEFINES=...`); the cache key holds the options, so each variant caches apart.
/// A name that is not an identifier is an error.
pub fn knob_defines() -> Result<Vec<String>> {
    std::env::var("NIBBLE_NVRTC_DEFINES").map_or(Ok(vec![]), |v| defines_of(&v))
}

/// [`knob_defines`] of the knob's value.
fn defines_of(v: &str) -> Result<Vec<String>> {
    v.split([',', '+'])
        .filter(|d| !d.is_empty())
        .map(|d| {
            let ident = d.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && d.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if ident {
                Ok(format!("-D{d}"))
            } else {
                Err(Error::InvalidArgument(format!(
                    "NIBBLE_NVRTC_DEFINES: '{d}' is not a macro name"
                )))
            }
        })
        .collect()
}

pub fn options(arch: &str, include: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include.display()),
        "--std=c++17".into(),
        "--fmad=true".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// Where compiled kernels are kept: `$NIBBLE_KERNEL_CACHE`, else `~/.cache/nibble/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NIBBLE_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("nibble").join("kernels"))
}

/// The cache key of `source` compiled with `options` by this NVRTC. Where the CUDA headers were
/// found (`--include-path`) is left out: the same NVRTC version ships the same headers, so a
/// cubin compiled on a machine without a GPU (`scripts/gpu-precompile.sh`, from pip's NVRTC and
/// headers) is the GPU machine's too, and a fresh GPU machine seeded with it compiles nothing.
pub fn cache_key(source: &str, options: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options {
        h.update([0u8]);
        let o = if o.starts_with("--include-path=") {
            "--include-path"
        } else {
            o
        };
        h.update(o.as_bytes());
    }
    let (maj, min) = nvrtc_version();
    h.update(format!("nvrtc {maj}.{min}").as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The file [`cubin`] keeps module `name`'s cubin in, within the cache directory.
pub fn cache_file_name(name: &str, source: &str, options: &[String]) -> String {
    format!("{name}-{}.cubin", cache_key(source, options))
}

/// The full text NVRTC compiles for module `name`.
pub fn full_source(text: &str) -> String {
    format!("{COMMON}\n{text}")
}

/// Compiles `source` to a cubin, or loads it from the cache. A compile error carries NVRTC's log.
pub fn cubin(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    cubin_cached_in(cache_dir().as_deref(), name, source, options)
}

/// [`cubin`] of every `(name, text)` module at once, a thread each, in their order: on a cold cache
/// a context's first start costs its slowest module's compile (`qgemm`) instead of the sum of all.
/// NVRTC compiles separate programs concurrently.
pub fn cubins(modules: &[(&str, &str)], options: &[String]) -> Result<Vec<Vec<u8>>> {
    cubins_cached_in(cache_dir().as_deref(), modules, options)
}

/// [`cubins`] with the cache in `dir` (`None`: no cache).
pub fn cubins_cached_in(
    dir: Option<&Path>,
    modules: &[(&str, &str)],
    options: &[String],
) -> Result<Vec<Vec<u8>>> {
    let sources: Vec<String> = modules.iter().map(|(_, text)| full_source(text)).collect();
    let jobs: Vec<(&str, &str, &[String])> = modules
        .iter()
        .zip(&sources)
        .map(|(&(name, _), source)| (name, source.as_str(), options))
        .collect();
    cubin_jobs_in(dir, &jobs)
}

/// [`cubin`] of every `(name, full source, options)` job at once, a thread each, in their order.
pub fn cubin_jobs(jobs: &[(&str, &str, &[String])]) -> Result<Vec<Vec<u8>>> {
    cubin_jobs_in(cache_dir().as_deref(), jobs)
}

fn cubin_jobs_in(dir: Option<&Path>, jobs: &[(&str, &str, &[String])]) -> Result<Vec<Vec<u8>>> {
    std::thread::scope(|scope| {
        let compiles: Vec<_> = jobs
            .iter()
            .map(|&(name, source, options)| {
                scope.spawn(move || cubin_cached_in(dir, name, source, options))
            })
            .collect();
        // Every thread joined before the first error is returned: a handle dropped unjoined
        // would turn a later thread's panic into the scope's.
        let results: Vec<Result<Vec<u8>>> = compiles
            .into_iter()
            .zip(jobs)
            .map(|(compile, (name, _, _))| {
                compile.join().unwrap_or_else(|_| {
                    Err(Error::unsupported(
                        format!("compiling CUDA kernels '{name}'"),
                        "the compiling thread panicked",
                    ))
                })
            })
            .collect();
        results.into_iter().collect()
    })
}

/// [`cubin`] with the cache in `dir` (`None`: no cache).
pub fn cubin_cached_in(
    dir: Option<&Path>,
    name: &str,
    source: &str,
    options: &[String],
) -> Result<Vec<u8>> {
    let cached = dir.map(|d| d.join(cache_file_name(name, source, options)));
    if let Some(path) = &cached
        && let Ok(bytes) = std::fs::read(path)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let bytes = compile(name, source, options)?;
    if let Some(path) = &cached {
        // Best effort: a read-only home must not stop the model from running.
        let _ = store_atomically(path, &bytes);
    }
    Ok(bytes)
}

fn store_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Unique within the process too: modules compiled side by side finish together.
    static STORES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STORES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".tmp-{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// NVRTC, uncached. Also used by the kernel-compile check that runs without a GPU.
pub fn compile(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    nvrtc_output(name, "cubin", source, options, |prog| unsafe {
        get_cubin(prog)
    })
}

/// NVRTC's log of a successful compile to a cubin (with `--ptxas-options=-v` among `options`,
/// ptxas's report per entry: registers, spills, and its performance notes such as C7514,
/// serialized wgmmas), uncached: for checks of how ptxas compiled a kernel.
pub fn compile_log(name: &str, source: &str, options: &[String]) -> Result<String> {
    nvrtc_output(name, "log", source, options, |prog| {
        let raw = unsafe { nvrtc::get_program_log(prog) }.map_err(|e| format!("{e:?}"))?;
        Ok(unsafe { CStr::from_ptr(raw.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    })
}

/// NVRTC to PTX for a virtual architecture (`compute_90a`), uncached: for checks of what a
/// kernel's code does (the kernel-compile test reads which entries wait on the grid).
pub fn ptx(name: &str, source: &str, options: &[String]) -> Result<String> {
    nvrtc_output(name, "PTX", source, options, |prog| {
        let raw = unsafe { nvrtc::get_ptx(prog) }.map_err(|e| format!("{e:?}"))?;
        let bytes: Vec<u8> = raw
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    })
}

/// Compiles `source` with NVRTC and takes its `what` (cubin or PTX) with `get`; a failed compile
/// is an error carrying NVRTC's log.
fn nvrtc_output<T>(
    name: &str,
    what: &str,
    source: &str,
    options: &[String],
    get: impl FnOnce(nvrtc_sys::nvrtcProgram) -> std::result::Result<T, String>,
) -> Result<T> {
    let fail = |step: &str, detail: String| {
        Error::unsupported(format!("compiling CUDA kernels '{name}' ({step})"), detail)
    };
    let src = CString::new(source).map_err(|_| fail("source", "contains a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).expect("kernel names hold no NUL");
    let prog =
        nvrtc::create_program(&src, Some(&cname)).map_err(|e| fail("create", format!("{e:?}")))?;
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    let result = match compiled {
        Err(e) => {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|raw| {
                    unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            Err(fail(
                "NVRTC",
                format!("{e:?} with options {options:?}\n{log}"),
            ))
        }
        Ok(()) => get(prog).map_err(|e| fail(what, e)),
    };
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// The names of a PTX module's kernels (`.entry`) whose code waits on the grid dependency
/// (`griddepcontrol.wait`) before it ends, and of those that do not.
pub fn ptx_grid_waits(ptx: &str) -> (Vec<String>, Vec<String>) {
    let (mut waiting, mut not) = (Vec::new(), Vec::new());
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        let after = &rest[at + ".entry ".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body runs to the next entry (PTX modules have no nested entries).
        let end = after.find(".entry ").unwrap_or(after.len());
        if after[..end].contains("griddepcontrol.wait") {
            waiting.push(name);
        } else {
            not.push(name);
        }
        rest = &after[end..];
    }
    (waiting, not)
}

unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    let mut size = 0usize;
    let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(format!(
            "no cubin ({r:?}); was a virtual architecture (compute_XX) given?"
        ));
    }
    let mut buf = vec![0u8; size];
    let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("{r:?}"));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knob_defines_are_macro_names_only() {
        assert_eq!(
            defines_of("SOME_VARIANT+_X1,").unwrap(),
            ["-DSOME_VARIANT", "-D_X1"]
        );
        assert!(defines_of("").unwrap().is_empty());
        for bad in ["1X", "A=1", "A B", "--gpu-architecture=sm_80", "A,-DB"] {
            let e = defines_of(bad).unwrap_err().to_string();
            assert!(e.contains("NIBBLE_NVRTC_DEFINES"), "{bad}: {e}");
        }
    }
}

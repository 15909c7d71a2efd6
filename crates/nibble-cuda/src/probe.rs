//! Finding the CUDA libraries before cudarc touches them: cudarc's dynamic loader panics when a
//! library is missing, and a panic must never reach a user who merely has no GPU.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nibble_core::{Error, Result};

/// The first candidate name of `lib` (as cudarc would search it) that the dynamic loader opens.
fn loadable(lib: &str) -> Option<String> {
    cudarc::get_lib_name_candidates(lib)
        .into_iter()
        .find(|name| unsafe { libloading::Library::new(name) }.is_ok())
}

/// Checks that the driver library loads and sees a GPU; the error says what is missing.
pub fn ensure_driver() -> Result<()> {
    static DRIVER: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            if loadable("cuda").is_none() {
                return Err(
                    "no NVIDIA driver found: libcuda.so could not be loaded (install the \
                            NVIDIA driver, or run with --device cpu)"
                        .into(),
                );
            }
            cudarc::driver::result::init()
                .map_err(|e| format!("the NVIDIA driver did not initialize: {e:?}"))?;
            match cudarc::driver::result::device::get_count() {
                Ok(0) => Err("the NVIDIA driver sees no GPU".into()),
                Ok(_) => Ok(()),
                Err(e) => Err(format!("cannot count GPUs: {e:?}")),
            }
        })
        .clone()
        .map_err(|msg| Error::unsupported("the CUDA device", msg))
}

/// Checks that NVRTC (run-time compilation) and cuBLAS load.
pub fn ensure_libraries() -> Result<()> {
    for (lib, what) in [("nvrtc", "NVRTC"), ("cublas", "cuBLAS")] {
        if loadable(lib).is_none() {
            return Err(Error::unsupported(
                "the CUDA backend",
                format!(
                    "{what} (lib{lib}.so) could not be loaded: install the CUDA toolkit or put \
                     its lib64 folder on LD_LIBRARY_PATH"
                ),
            ));
        }
    }
    Ok(())
}

/// Whether NVRTC loads (kernels can be compiled, with or without a GPU).
pub fn nvrtc_available() -> bool {
    loadable("nvrtc").is_some()
}

/// Whether a GPU can be used at all, without an error: `--device auto` asks this.
pub fn cuda_available() -> bool {
    ensure_driver().is_ok() && ensure_libraries().is_ok()
}

/// The CUDA include folder holding `cuda_fp16.h` and `cuda_bf16.h`, which the kernels include:
/// `$CUDA_HOME`, `$CUDA_PATH`, then the usual install places.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|p| PathBuf::from(p).join("include"))
        .collect();
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .map(|p| p.join("include"))
            .collect();
        versioned.sort();
        candidates.extend(versioned.into_iter().rev());
    }
    candidates.push(PathBuf::from("/opt/cuda/include"));
    candidates.push(PathBuf::from("/usr/include"));
    for dir in candidates {
        if has_headers(&dir) {
            return Ok(dir);
        }
        tried.push(dir.display().to_string());
    }
    Err(Error::unsupported(
        "the CUDA backend",
        format!(
            "cuda_fp16.h was not found in any CUDA include folder (tried {}); set CUDA_HOME to \
             the CUDA toolkit",
            tried.join(", ")
        ),
    ))
}

fn has_headers(dir: &Path) -> bool {
    dir.join("cuda_fp16.h").is_file() && dir.join("cuda_bf16.h").is_file()
}

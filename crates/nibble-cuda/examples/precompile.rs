//! Compiles, without a GPU, every kernel module a GPU run of the tests and benchmarks needs into
//! the kernel cache (`NIBBLE_KERNEL_CACHE`) for ARCH (default `sm_90a`: H100 and H200), and
//! prints the cache's file names that hold them, one a line, for `scripts/gpu-precompile.sh` to
//! pack (`nibble_cuda::precompile_kernels`; `nibble kernels` is the same for users).
//!
//!     precompile [ARCH]      (NVRTC and the CUDA headers from CUDA_HOME, as test.sh installs them)

use std::time::Instant;

use nibble_core::Result;

fn main() -> Result<()> {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90a".into());
    let t0 = Instant::now();
    let files = nibble_cuda::precompile_kernels(&arch)?;
    eprintln!(
        "precompile {arch}: {} modules in {:.1} s",
        files.len(),
        t0.elapsed().as_secs_f64()
    );
    for f in files {
        println!("{f}");
    }
    Ok(())
}

//! Compiles, without a GPU, every kernel module a GPU run of the tests and benchmarks needs into
//! the kernel cache (`NIBBLE_KERNEL_CACHE`): a context's modules and the KV formats' modules
//! ([`nibble_cuda::WARM_KV_FORMATS`], both model dtypes), for ARCH (default `sm_90a`: H100 and
//! H200), side by side. Prints the cache's file names it holds them in, one a line, for
//! `scripts/gpu-precompile.sh` to pack: a fresh GPU machine seeded with them compiles nothing
//! (the cache key leaves out where the CUDA headers were found, `compile::cache_key`).
//!
//!     precompile [ARCH]      (NVRTC and the CUDA headers from CUDA_HOME, as test.sh installs them)

use std::time::Instant;

use nibble_core::{Error, Result};
use nibble_cuda::{Dtype, compile, probe};
use nibble_precision::KvSpec;

fn main() -> Result<()> {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90a".into());
    if !probe::nvrtc_available() {
        return Err(Error::unsupported(
            "precompiling kernels",
            "NVRTC is not installed here (test.sh installs it in .cuda-tk)",
        ));
    }
    let include = probe::cuda_include_dir()?;
    let opts = nibble_cuda::context_compile_options(&arch, &include)?;
    let t0 = Instant::now();
    compile::cubins(compile::SOURCES, &opts)?;
    let specs = nibble_cuda::WARM_KV_FORMATS
        .iter()
        .map(|f| f.parse())
        .collect::<Result<Vec<KvSpec>>>()?;
    let dtypes = [Dtype::Bf16, Dtype::F16];
    nibble_cuda::warm_kv_modules(&opts, &specs, &dtypes)?;
    let kv = nibble_cuda::kv_modules(&opts, &specs, &dtypes);
    eprintln!(
        "precompile {arch}: {} modules and {} KV modules in {:.1} s",
        compile::SOURCES.len(),
        kv.len(),
        t0.elapsed().as_secs_f64()
    );
    for (name, text) in compile::SOURCES {
        println!(
            "{}",
            compile::cache_file_name(name, &compile::full_source(text), &opts)
        );
    }
    let kv_source = compile::full_source(compile::KV_QUANT);
    for (name, kv_opts) in &kv {
        println!("{}", compile::cache_file_name(name, &kv_source, kv_opts));
    }
    Ok(())
}

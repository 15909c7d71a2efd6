//! The CUDA backend. Kernels are CUDA C++ sources embedded in the binary and compiled at run time
//! with NVRTC for the GPU found (`compile`), GEMMs go through cuBLAS (`blas`), attention reads a
//! paged KV cache (`kv`, `attention`), and decode steps replay as CUDA graphs (`graph`).
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading), so nibble builds and runs
//! its CPU paths on machines with no CUDA at all; `probe` checks for the libraries first, since
//! a missing one would otherwise panic inside cudarc.
//!
//! The modules form three layers, each importing only from the layers below it, so that an op
//! can be read, changed or tested knowing the context and the data types alone, and a new op
//! touches its own module and the `Backend` impl, nothing else. Within a layer the arrows point
//! down the list; the ops do not import one another, but for `qlinear` and its packer `pack`, and
//! `grouped`, which runs `qlinear`'s formats over item tables.
//!
//! ```text
//! tensor_parallel  ranks on several GPUs, their NCCL group             -> backend nccl
//! backend       impl Backend for CudaBackend: picks and calls the ops  -> every module below
//! ---------------------------------------------------------------------------------------------
//! ops           attention    paged attention, prefill and decode       -> context kv runtime tensor
//!               grouped      MoE experts' GEMMs in one launch          -> context qlinear runtime tensor
//!               qlinear      quantized GEMMs, weight packing           -> context pack runtime tensor
//!               pack         the quantized kernels' weight layouts     -> tensor
//!               blas         cuBLAS GEMMs                              -> runtime tensor
//!               comet        COMET W4A4A8: quantizer, GEMM, gemv       -> context runtime tensor
//!               dense_gemv   16-bit decode gemv on TMA bulk copies     -> context runtime tensor
//!               sampling     sampling on the device                    -> context runtime tensor
//!               elementwise  embedding, norms, RoPE, SiLU gate, adds   -> context kv runtime tensor
//! ---------------------------------------------------------------------------------------------
//! runtime       context      CudaContext: kernels, arena, batch        -> compile graph kv module
//!                            metadata, launches, sticky error, tier       probe runtime tensor
//!               graph        the CUDA graph cache, capture primitives  -> runtime tensor
//!               kv           CudaKv, the paged KV pool                 -> kv_residual runtime tensor
//!               kv_residual  which residual slot holds a filling block -> (none)
//!               tensor       Dtype, Elem, CudaTensor, CudaWeight       -> runtime
//!               module       loading cubins                            -> runtime
//!               nccl         NCCL loaded at run time: all-reduce       -> runtime
//!               host         page-locked memory, events, staging ring  -> runtime
//!               host_trace   host time of eager forward passes by op   -> (none)
//!               runtime      Gpu, DeviceBuffer, Arena, Kernel, Arg     -> compile probe
//!               compile      NVRTC and the cubin cache                 -> (none)
//!               probe        finding the CUDA libraries                -> (none)
//! ```

mod attention;
mod backend;
mod blas;
pub mod comet;
pub mod compile;
mod context;
pub mod dense_gemv;
mod elementwise;
mod graph;
pub mod grouped;
mod host;
mod host_trace;
mod kv;
mod kv_residual;
pub mod module;
pub mod nccl;
pub mod pack;
pub mod peer_sum;
pub mod probe;
pub mod qlinear;
mod runtime;
mod sampling;
mod tensor;
pub mod tensor_parallel;

pub use attention::{HEAD_DIMS, Split, plan_split};
pub use backend::CudaBackend;
pub use context::{CudaContext, StepUpload, gpu_arch, precompile_kernels};
pub use kv::{CudaKv, PageFormat};
pub use probe::cuda_available;
pub use runtime::{DeviceBuffer, Gpu};
pub use sampling::TOP_LOGPROBS;
pub use tensor::{CudaTensor, CudaWeight, Dtype, Elem, WeightData};

use nibble_core::{Error, Result};

/// Where the model runs, as `--device` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA GPU 0 when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Device> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "unknown device '{s}': use auto, cpu, cuda or cuda:N"
                    ))
                }),
        }
    }
}

impl Device {
    /// `Auto` made concrete: CUDA 0 if a driver, a GPU, NVRTC and cuBLAS are all there.
    pub fn resolve(self) -> Device {
        match self {
            Device::Auto if cuda_available() => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!("auto".parse::<Device>().unwrap(), Device::Auto);
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["cuda:", "cuda:x", "tpu", "", "cuda:-1"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains("unknown device"), "{bad}: {e}");
        }
    }

    /// On a machine without a GPU, asking for one is an error that says why, never a panic.
    #[test]
    fn no_gpu_is_a_clear_error() {
        if cuda_available() {
            return;
        }
        let e = CudaBackend::new(0, Dtype::Bf16).err().expect("no GPU here");
        let msg = e.to_string();
        assert!(
            msg.contains("driver") || msg.contains("GPU") || msg.contains("NVRTC"),
            "{msg}"
        );
        assert_eq!(Device::Auto.resolve(), Device::Cpu);
    }
}

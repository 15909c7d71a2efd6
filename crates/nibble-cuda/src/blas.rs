//! GEMMs through cuBLAS: `y[M, N] = x[M, K] @ w[N, K]^T` with 16-bit operands, f32 accumulation
//! and f32 output. Row-major `y` is column-major `y^T = w x^T`, so w goes in transposed.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys};
use nibble_core::{Error, Result};

use crate::runtime::{DeviceBuffer, Gpu};
use crate::tensor::{CudaTensor, CudaWeight, Dtype, Elem};

/// cuBLAS needs a workspace it owns for graph capture (otherwise it allocates inside the step).
const WORKSPACE: usize = 32 << 20;

pub struct Blas {
    handle: sys::cublasHandle_t,
    _workspace: DeviceBuffer,
}

unsafe impl Send for Blas {}

fn err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::unsupported(format!("cuBLAS {what}"), format!("{e:?}"))
}

impl Blas {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Blas> {
        gpu.bind()?;
        let handle = blas::create_handle().map_err(|e| err("handle", e))?;
        unsafe { blas::set_stream(handle, gpu.cu_stream() as _) }.map_err(|e| err("stream", e))?;
        let workspace = DeviceBuffer::alloc(gpu, WORKSPACE, "cuBLAS workspace")?;
        unsafe {
            sys::cublasSetWorkspace_v2(handle, workspace.ptr as *mut c_void, WORKSPACE)
                .result()
                .map_err(|e| err("workspace", e))?;
        }
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }

    pub fn gemm(
        &mut self,
        gpu: &Gpu,
        x: &CudaTensor,
        w: &CudaWeight,
        y: &CudaTensor,
    ) -> Result<()> {
        gpu.bind()?;
        let ty = match (x.elem, w.dtype) {
            (Elem::Half(Dtype::Bf16), Dtype::Bf16) => sys::cudaDataType::CUDA_R_16BF,
            (Elem::Half(Dtype::F16), Dtype::F16) => sys::cudaDataType::CUDA_R_16F,
            (a, b) => {
                return Err(Error::InvalidArgument(format!(
                    "GEMM of a {a:?} input with a {b:?} weight"
                )));
            }
        };
        let (m, n, k) = (x.rows as i32, w.rows as i32, w.cols as i32);
        if m == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        unsafe {
            blas::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                w.dense()?.ptr as *const c_void,
                ty,
                k,
                x.ptr as *const c_void,
                ty,
                k,
                &beta as *const f32 as *const c_void,
                y.ptr as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                n,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| err("GEMM", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}

//! The data types every layer passes around, kept apart from the context and the ops so that both
//! can name them without naming each other. A quantized weight's packed buffers are here too: a
//! [`CudaWeight`] holds them, while how they are made and read is `qlinear`'s business.

use std::sync::Arc;

use half::{bf16, f16};
use nibble_core::{Error, Result};

use crate::runtime::{DeviceBuffer, DevicePtr};

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
    /// The suffix of kernel entries that read or write this element type.
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Half(d) => d.suffix(),
        }
    }

    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Half(_) => 2,
        }
    }
}

/// The 8-bit activation codes a quantized GEMM reads, per token (`nibble_precision::act`): INT8
/// (W8A8, W4A8) or FP8 e4m3 (FP8 W8A8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act8 {
    Int8,
    Fp8,
}

impl Act8 {
    /// The tag of the kernels that write these codes: `quantize_i8_*` / `rms_norm_q8_*` /
    /// `silu_mul_q8_*`, or their `f8` twins (kernels/elementwise.cu).
    pub fn quantize_kernel(self) -> &'static str {
        match self {
            Act8::Int8 => "quantize_i8",
            Act8::Fp8 => "quantize_f8",
        }
    }
    pub fn fused_tag(self) -> &'static str {
        match self {
            Act8::Int8 => "q8",
            Act8::Fp8 => "f8",
        }
    }
}

/// 8-bit codes and per-token scales of a GEMM input, made by the kernel that produced it.
#[derive(Clone, Copy, Debug)]
pub struct Act8Input {
    pub codes: u64,
    pub scales: u64,
    pub kind: Act8,
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
    pub(crate) epoch: u64,
    pub(crate) owner: Option<Arc<DeviceBuffer>>,
    /// The tensor's per-token 8-bit codes and scales, when the kernel that wrote it also made them
    /// (QServe S1: a W8A8 GEMM then reads them instead of quantizing again).
    pub(crate) act8: Option<Act8Input>,
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
            owner: None,
            act8: None,
        }
    }

    /// A tensor that keeps `buf` alive and outlives forward passes (epoch 0).
    pub(crate) fn owned(buf: Arc<DeviceBuffer>, rows: usize, cols: usize, elem: Elem) -> Self {
        CudaTensor {
            owner: Some(buf.clone()),
            ..CudaTensor::view(buf.ptr, rows, cols, elem, 0)
        }
    }

    /// What an infallible op that failed hands back: an epoch no forward has, so nothing reads
    /// it as valid.
    pub(crate) fn dead(rows: usize, cols: usize, elem: Elem) -> Self {
        CudaTensor::view(0, rows, cols, elem, u64::MAX)
    }

    /// Another handle to the same memory, INT8 codes included.
    pub(crate) fn share(&self) -> Self {
        CudaTensor {
            owner: self.owner.clone(),
            ..*self
        }
    }

    /// Column slices of `widths` (the outputs of a fused projection): views of the same rows.
    pub(crate) fn split_cols(&self, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        if widths.iter().sum::<usize>() != self.cols {
            return Err(Error::InvalidArgument(format!(
                "split of {} columns into {widths:?}",
                self.cols
            )));
        }
        let mut at = 0;
        Ok(widths
            .iter()
            .map(|&w| {
                let t = CudaTensor {
                    ptr: self.ptr + (at * self.elem.size()) as u64,
                    rows: self.rows,
                    cols: w,
                    ld: self.ld,
                    elem: self.elem,
                    epoch: self.epoch,
                    owner: self.owner.clone(),
                    act8: None,
                };
                at += w;
                t
            })
            .collect())
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
    /// A SwiGLU layer's gate and up projections packed as one weight of `2 * rows` interleaved
    /// rows (`qlinear::swiglu_rows`), whose product is `silu(gate x) * up x` in the model dtype
    /// (`qlinear::swiglu_gemm`); the [`CudaWeight`]'s `rows` are the `ffn` outputs.
    SwiGlu(QuantWeight),
    /// COMET W4A4A8 (`comet.rs`): the GEMM quantizes its own input in mixed blocks.
    Comet(CometWeight),
    /// A SwiGLU layer's 16-bit gate and up projections as they load, stacked (`2 * rows` rows,
    /// gate first), whose product is `silu(gate x) * up x` in the model dtype: at one token the
    /// dense decode gemv writes it in its epilogue (`dense_gemv::run_norm`), else the stacked
    /// product and then the SiLU-gate. The [`CudaWeight`]'s `rows` are the `ffn` outputs.
    DenseSwiGlu(Box<CudaWeight>),
}

impl CudaWeight {
    /// The packed weight of a quantized layer, `None` for a dense one.
    pub fn quant(&self) -> Option<&QuantWeight> {
        match &self.data {
            WeightData::Quant(q) => Some(q),
            WeightData::Dense(_)
            | WeightData::SwiGlu(_)
            | WeightData::Comet(_)
            | WeightData::DenseSwiGlu(_) => None,
        }
    }

    /// The model-dtype matrix, for ops that read weights as plain matrices (cuBLAS, embedding).
    pub fn dense(&self) -> Result<&DeviceBuffer> {
        match &self.data {
            WeightData::Dense(b) => Ok(b),
            WeightData::Quant(q) | WeightData::SwiGlu(q) => Err(Error::unsupported(
                format!("a {} weight used as a plain matrix", q.format_name()),
                "only linear layers run quantized on the GPU",
            )),
            WeightData::Comet(_) => Err(Error::unsupported(
                "a w4a4a8 weight used as a plain matrix",
                "only linear layers run quantized on the GPU",
            )),
            WeightData::DenseSwiGlu(_) => Err(Error::InvalidArgument(
                "a SwiGLU gate/up pair used as a plain matrix".into(),
            )),
        }
    }
}

/// A COMET W4A4A8 weight (`comet.rs`, kernels/comet.cu): the checkpoint rows' nibbles
/// `[n][k / 2]`, group zeros `[n][groups]` (bytes) and group scales `[n][groups]` (f32); blocks of
/// activations are the groups, the first `int8_blocks` INT8.
pub struct CometWeight {
    pub codes: DeviceBuffer,
    pub zeros: DeviceBuffer,
    pub scales: DeviceBuffer,
    pub group: usize,
    pub int8_blocks: usize,
    /// The Hopper wgmma tier's copy (`comet::pack_wgmma`), where it was asked for.
    pub wgmma: Option<CometWgmma>,
}

/// A COMET weight as `comet_wgmma*` reads it (kernels/qgemm_wgmma.cu, `WgqComet`): the codes in
/// W4A8's packed fragments with one byte-affine parameter a row and group (scale 1, offset
/// `128 - z`), and the group scales transposed, `[groups][tiles * 16]`.
pub struct CometWgmma {
    pub codes: DeviceBuffer,
    pub params: DeviceBuffer,
    pub row_scales: DeviceBuffer,
    pub tiles: usize,
    pub chunks: usize,
    /// Parameter groups of the packed layout (`PackedW4A8::groups`).
    pub groups: usize,
}

impl CometWeight {
    pub fn bytes(&self) -> usize {
        let wgmma = self
            .wgmma
            .as_ref()
            .map_or(0, |w| w.codes.bytes + w.params.bytes + w.row_scales.bytes);
        self.codes.bytes + self.zeros.bytes + self.scales.bytes + wgmma
    }
}

/// A weight packed for a quantized kernel.
pub enum QuantWeight {
    W4 {
        codes: DeviceBuffer,
        params: DeviceBuffer,
        group_len: usize,
        tiles: usize,
        chunks: usize,
        groups: usize,
    },
    W8 {
        codes: DeviceBuffer,
        scales: DeviceBuffer,
        tiles: usize,
        chunks: usize,
    },
    /// INT8 codes in the k16 fragment order the W8A16 kernels make 16-bit
    /// (`pack::Int8Layout::F16`), f32 scales.
    W8A16 {
        codes: DeviceBuffer,
        scales: DeviceBuffer,
        tiles: usize,
        chunks: usize,
    },
    /// Row-major e4m3 codes, f32 scales (`pack::PackedFp8`).
    Fp8 {
        codes: DeviceBuffer,
        scales: DeviceBuffer,
        tiles: usize,
        chunks: usize,
    },
    /// 4-bit codes widened to INT8 in the kernels (`pack::PackedW4A8`).
    W4A8 {
        codes: DeviceBuffer,
        params: DeviceBuffer,
        scales: DeviceBuffer,
        tiles: usize,
        chunks: usize,
        groups: usize,
        group_shift: u32,
    },
}

impl QuantWeight {
    pub fn bytes(&self) -> usize {
        match self {
            QuantWeight::W4 { codes, params, .. } => codes.bytes + params.bytes,
            QuantWeight::W8 { codes, scales, .. }
            | QuantWeight::W8A16 { codes, scales, .. }
            | QuantWeight::Fp8 { codes, scales, .. } => codes.bytes + scales.bytes,
            QuantWeight::W4A8 {
                codes,
                params,
                scales,
                ..
            } => codes.bytes + params.bytes + scales.bytes,
        }
    }

    /// The 8-bit activation codes its GEMMs read, if any (which the producers of their inputs
    /// then write alongside).
    pub fn reads_act8(&self) -> Option<Act8> {
        match self {
            QuantWeight::W4 { .. } | QuantWeight::W8A16 { .. } => None,
            QuantWeight::W8 { .. } | QuantWeight::W4A8 { .. } => Some(Act8::Int8),
            QuantWeight::Fp8 { .. } => Some(Act8::Fp8),
        }
    }

    pub fn format_name(&self) -> &'static str {
        match self {
            QuantWeight::W4 { .. } => "w4a16",
            QuantWeight::W8 { .. } => "w8a8",
            QuantWeight::W8A16 { .. } => "w8a16",
            QuantWeight::Fp8 { .. } => "fp8",
            QuantWeight::W4A8 { .. } => "w4a8",
        }
    }
}

//! Offline quantization. A model is loaded as dense f32 ([`dense::DenseModel`]), run over
//! calibration text to collect activation statistics ([`capture`]), transformed by
//! equivalence-preserving rewrites folded into its weights (rotation, smoothing, permutation),
//! and finally each linear layer is encoded in its [`nibble_precision::LinearFormat`] by a method
//! (RTN, AWQ, GPTQ, ...). [`pipeline::quantize`] is the one entry point.

pub mod awq;
pub mod capture;
pub mod data;
pub mod dense;
pub mod fmpq;
pub mod gptq;
pub mod hooked;
pub mod lqq;
pub mod permute;
pub mod pipeline;
pub mod qoq;
pub mod rotation;
pub mod search;
pub mod sim;
pub mod simulate;
pub mod smoothquant;

pub use pipeline::{Method, QuantOptions, QuantizedModel, quantize};

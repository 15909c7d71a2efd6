//! GGUF v2/v3 files: memory-mapped reader, metadata, tensor table and block dequantization.

pub mod dequant;
mod ggml_type;

pub use ggml_type::GgmlType;

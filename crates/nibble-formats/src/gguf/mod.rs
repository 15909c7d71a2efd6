//! GGUF v2/v3 files: memory-mapped reader, metadata, tensor table and block dequantization.

pub mod dequant;
mod ggml_type;
mod reader;
mod writer;

pub use ggml_type::GgmlType;
pub use reader::{GgufFile, MetaValue, TensorInfo};
pub use writer::GgufWriter;

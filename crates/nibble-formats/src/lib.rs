//! Model file formats: everything between bytes on disk and named, typed tensors plus the model's
//! tokenizer and chat template. Architecture knowledge (which tensor means what) lives in
//! `nibble-model`, not here.

pub mod chat_template;
pub mod gguf;
pub mod safetensors_dir;
pub mod tensor;
pub mod tokenizer;

pub use tensor::{HostTensor, TensorBytes, WeightFormat};

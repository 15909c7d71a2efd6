//! Model file formats: everything between bytes on disk and named, typed tensors plus the model's
//! configuration, tokenizer and chat template.

pub mod gguf;

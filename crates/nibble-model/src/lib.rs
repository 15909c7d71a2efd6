//! Transformer architectures, written once over the `Backend` trait, with their configuration
//! and the mapping from model files to named weights.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod dummy;
pub mod hf_quant;
pub mod loader;
pub mod moe;
pub mod sampling;
pub mod source;
pub mod tensor_parallel;
pub mod transformer;

pub use backend::{
    AttentionShape, Backend, BatchLayout, DeviceTimeline, KvShape, RoutedExpert, ScaledRows,
    SeqSpan,
};
pub use checkpoint::{CheckpointData, CheckpointSource, CheckpointTensor, write_checkpoint};
pub use config::{
    Arch, GemmaConfig, ModelConfig, MoeConfig, RopeLayout, RopeScaling, SlidingWindow, TensorLayout,
};
pub use loader::{ModelFiles, open_model, tokenizer_from_path};
pub use nibble_precision::{KvFormat, KvSpec};
pub use transformer::{LogitRows, SINGLE_SEQUENCE_BLOCK, TensorRole, Transformer, model_tensors};

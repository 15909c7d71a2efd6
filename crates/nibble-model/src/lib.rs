//! Transformer architectures, written once over the `Backend` trait, with their configuration
//! and the mapping from model files to named weights.

pub mod backend;
pub mod config;
pub mod loader;
pub mod source;
pub mod transformer;

pub use backend::{AttentionShape, Backend, BatchLayout, KvShape, SeqSpan};
pub use config::{Arch, ModelConfig, RopeLayout, RopeScaling};
pub use loader::{ModelFiles, open_model};
pub use nibble_precision::KvFormat;
pub use transformer::{LogitRows, Transformer};

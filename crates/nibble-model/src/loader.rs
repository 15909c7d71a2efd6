//! Opens whatever the user points at, a GGUF file or a Hugging Face directory (plain, a nibble
//! checkpoint, or AWQ/GPTQ), and returns its configuration, tokenizer and tensor source.

use std::path::{Path, PathBuf};

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgufFile;
use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::tokenizer::Tokenizer;

use nibble_precision::PrecisionSpec;

use crate::checkpoint::{CheckpointSource, QUANT_FILE};
use crate::config::ModelConfig;
use crate::hf_quant::{HfQuantConfig, HfQuantSource};
use crate::source::{GgufSource, TensorSource};

pub struct ModelFiles {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub source: Box<dyn TensorSource>,
    /// The precision the weights were quantized for: a nibble checkpoint's spec (including its
    /// KV cache format), `w4a16-gN` for AWQ/GPTQ with a group size nibble names; `None` for
    /// unquantized models, GGUF files and AWQ/GPTQ with other group sizes.
    pub precision: Option<PrecisionSpec>,
}

/// The tokenizer `--tokenizer` names: a `tokenizer.json` file (with the `tokenizer_config.json`
/// beside it, if any).
pub fn tokenizer_from_path(p: &Path) -> Result<Tokenizer> {
    let dir = p.parent().unwrap_or(Path::new("."));
    if p.file_name().is_some_and(|n| n == "tokenizer.json") {
        Tokenizer::from_hf_dir(dir)
    } else {
        Err(Error::InvalidArgument(format!(
            "--tokenizer must name a tokenizer.json file, got {}",
            p.display()
        )))
    }
}

/// Gemma 3's chat template (that of the instruction-tuned checkpoints' `tokenizer_config.json`),
/// for files that carry none: llama.cpp's GGUF conversions of the base models do not.
pub const GEMMA3_CHAT_TEMPLATE: &str = include_str!("../templates/gemma3.jinja");

/// What an architecture's tokenizer needs beyond its file: Gemma 3 ends a chat turn with
/// `<end_of_turn>`, which is not its EOS (`<eos>`) but ends generation as the model's
/// `generation_config.json` says, and gets its chat template when the file has none.
fn adapt_tokenizer(config: &ModelConfig, tokenizer: &mut Tokenizer) {
    if config.arch != crate::config::Arch::Gemma3 {
        return;
    }
    if let Some(id) = tokenizer.token_to_id("<end_of_turn>")
        && !tokenizer.eos_ids.contains(&id)
    {
        tokenizer.eos_ids.push(id);
        tokenizer.eos_ids.sort_unstable();
    }
    if tokenizer.chat_template.is_none() {
        tokenizer.chat_template = Some(GEMMA3_CHAT_TEMPLATE.to_string());
    }
}

/// `tokenizer_json` overrides the tokenizer the model carries.
pub fn open_model(path: &Path, tokenizer_json: Option<&Path>) -> Result<ModelFiles> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let override_tok =
        |t: Option<&Path>| -> Result<Option<Tokenizer>> { t.map(tokenizer_from_path).transpose() };
    if meta.is_dir() {
        let cfg_path = path.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let config = ModelConfig::from_hf_json(&text, &cfg_path.display().to_string())?;
        let mut tokenizer = match override_tok(tokenizer_json)? {
            Some(t) => t,
            None => Tokenizer::from_hf_dir(path)?,
        };
        adapt_tokenizer(&config, &mut tokenizer);
        let (source, precision): (Box<dyn TensorSource>, _) = if path.join(QUANT_FILE).exists() {
            let ckpt = CheckpointSource::open(path)?;
            let spec = ckpt.spec();
            (Box::new(ckpt), Some(spec))
        } else {
            let hf: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::corrupt(&cfg_path, format!("invalid JSON: {e}")))?;
            match HfQuantConfig::detect(path, &hf, &cfg_path)? {
                Some(q) => {
                    let spec = q.spec();
                    (Box::new(HfQuantSource::open(path, q)?), spec)
                }
                None => (Box::new(SafetensorsDir::open(path)?), None),
            }
        };
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            tokenizer,
            source,
            precision,
        })
    } else {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let mut tokenizer = match override_tok(tokenizer_json)? {
            Some(t) => t,
            None => Tokenizer::from_gguf(&file)?,
        };
        adapt_tokenizer(&config, &mut tokenizer);
        let source = GgufSource::new(
            file,
            config.arch,
            config.num_heads,
            config.num_kv_heads,
            true,
        );
        source.check_experts(&config)?;
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            tokenizer,
            source: Box::new(source),
            precision: None,
        })
    }
}

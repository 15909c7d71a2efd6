//! Opens whatever the user points at, a GGUF file or a Hugging Face directory, and returns its
//! configuration, tokenizer and tensor source.

use std::path::{Path, PathBuf};

use nibble_core::{Error, Result};
use nibble_formats::gguf::GgufFile;
use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::tokenizer::Tokenizer;

use crate::config::ModelConfig;
use crate::source::{GgufSource, TensorSource};

pub struct ModelFiles {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub source: Box<dyn TensorSource>,
}

/// `tokenizer_json` overrides the tokenizer the model carries.
pub fn open_model(path: &Path, tokenizer_json: Option<&Path>) -> Result<ModelFiles> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let override_tok = |t: Option<&Path>| -> Result<Option<Tokenizer>> {
        t.map(|p| {
            let dir = p.parent().unwrap_or(Path::new("."));
            if p.file_name().is_some_and(|n| n == "tokenizer.json") {
                Tokenizer::from_hf_dir(dir)
            } else {
                Err(Error::InvalidArgument(format!(
                    "--tokenizer must name a tokenizer.json file, got {}",
                    p.display()
                )))
            }
        })
        .transpose()
    };
    if meta.is_dir() {
        let cfg_path = path.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let config = ModelConfig::from_hf_json(&text, &cfg_path.display().to_string())?;
        let tokenizer = match override_tok(tokenizer_json)? {
            Some(t) => t,
            None => Tokenizer::from_hf_dir(path)?,
        };
        let source = SafetensorsDir::open(path)?;
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            tokenizer,
            source: Box::new(source),
        })
    } else {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = match override_tok(tokenizer_json)? {
            Some(t) => t,
            None => Tokenizer::from_gguf(&file)?,
        };
        let source = GgufSource::new(
            file,
            config.arch,
            config.num_heads,
            config.num_kv_heads,
            true,
        );
        Ok(ModelFiles {
            path: path.to_path_buf(),
            config,
            tokenizer,
            source: Box::new(source),
        })
    }
}

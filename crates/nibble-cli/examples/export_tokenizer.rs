//! Writes a model's tokenizer as `tokenizer.json` (+ `tokenizer_config.json`) into a folder, so
//! that `--dummy-weights` runs can count tokens as that model does (`--tokenizer
//! DIR/tokenizer.json`) on a machine that has no copy of the model.
//!
//! `cargo run --release -p nibble-cli --example export_tokenizer -- OUT_DIR [MODEL]`
//! (MODEL: a GGUF file or HF directory; default: the default model, fetched through pip).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let mut args = std::env::args_os().skip(1);
    let out = std::path::PathBuf::from(
        args.next()
            .context("usage: export_tokenizer OUT_DIR [MODEL]")?,
    );
    let model = args.next().map(std::path::PathBuf::from);
    let (label, files) = nibble_cli::open_files(model.as_deref(), None, None)?;
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    files.tokenizer.write_hf_files(&out)?;
    println!(
        "{}: tokenizer of {label} ({} tokens)",
        out.join("tokenizer.json").display(),
        files.tokenizer.vocab_size()
    );
    Ok(())
}

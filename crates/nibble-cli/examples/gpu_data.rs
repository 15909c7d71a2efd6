//! Gathers what a GPU run of the serving engine carries (the GPU machine has no network): the
//! default model's tokenizer as `OUT/tokenizer/tokenizer.json`, so that `--dummy-weights` runs
//! count tokens as a real model would, and the ShareGPT file in nibble's cache (its path is
//! printed; `bench/sharegpt_slice.py` cuts the slice that travels). `scripts/gpu-engine-data.sh`
//! runs it.
//!
//! `cargo run --release -p nibble-cli --example gpu_data -- OUT [MODEL]`
//! (MODEL: a GGUF file or HF directory whose tokenizer to take; default: the default model).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let mut args = std::env::args_os().skip(1);
    let out = std::path::PathBuf::from(args.next().context("usage: gpu_data OUT [MODEL]")?);
    let model = args.next().map(std::path::PathBuf::from);
    let (label, files) = nibble_cli::open_files(model.as_deref(), None, None)?;
    let dir = out.join("tokenizer");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    files.tokenizer.write_hf_files(&dir)?;
    eprintln!(
        "{}: the tokenizer of {label} ({} tokens)",
        dir.join("tokenizer.json").display(),
        files.tokenizer.vocab_size()
    );
    println!("{}", nibble_bench::sharegpt::ensure_dataset()?.display());
    Ok(())
}

//! The pieces of the `nibble` command that tests and other front ends share: finding and loading
//! a model with progress, and the default model fetch.

pub mod bench_serve;
pub mod default_model;
pub mod quantize;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use nibble_cpu::CpuBackend;
use nibble_engine::Engine;
use nibble_model::{Transformer, open_model};

/// The model path the user gave, or the default model (fetched if needed).
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.to_path_buf()),
        None => default_model::ensure(),
    }
}

/// Opens and loads a model on the CPU backend, showing a progress bar on a terminal.
pub fn load_cpu_engine(
    model: Option<&Path>,
    tokenizer: Option<&Path>,
    threads: usize,
) -> Result<Engine<CpuBackend>> {
    let path = resolve_model(model)?;
    let t0 = Instant::now();
    let files = open_model(&path, tokenizer)
        .with_context(|| format!("cannot load model {}", path.display()))?;
    let backend = CpuBackend::new(threads)?;
    // A quantized checkpoint names the KV format it was made for; --kv can still override it.
    let kv_format = files.precision.map(|p| p.kv).unwrap_or_default();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("   loading [{bar:40}] {pos}/{len} tensors")
            .expect("static template")
            .progress_chars("=> "),
    );
    let model = Transformer::load(
        &backend,
        files.config,
        &*files.source,
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )
    .with_context(|| format!("cannot load model {}", path.display()))?;
    let mut model = model;
    model.kv_format = kv_format;
    bar.finish_and_clear();
    let c = &model.config;
    eprintln!(
        "nibble: {} ({:?}, {} layers, hidden {}, {} heads / {} kv, context {}) on {} in {:.2}s",
        path.display(),
        c.arch,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.max_context,
        backend_name(&backend),
        t0.elapsed().as_secs_f64()
    );
    Ok(Engine {
        backend,
        model,
        tokenizer: files.tokenizer,
    })
}

fn backend_name(b: &CpuBackend) -> String {
    nibble_model::Backend::name(b)
}

//! The pieces of the `nibble` command that tests and other front ends share: finding and loading
//! a model with progress, and the default model fetch.

pub mod bench_serve;
pub mod default_model;
pub mod quantize;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use nibble_cpu::{CpuBackend, CpuKvCache};
use nibble_cuda::CudaKv;
use nibble_engine::Engine;
use nibble_model::{Backend, KvShape, ModelFiles, Transformer, open_model};

/// The model path the user gave, or the default model (fetched if needed).
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.to_path_buf()),
        None => default_model::ensure(),
    }
}

/// Opens the model the user named: `--dummy-weights` (random weights in a shipped shape), a
/// path, or the default model. Returns a label for messages and the files.
pub fn open_files(
    model: Option<&Path>,
    tokenizer: Option<&Path>,
    dummy: Option<&str>,
) -> Result<(String, ModelFiles)> {
    if let Some(name) = dummy {
        if model.is_some() {
            anyhow::bail!("--dummy-weights and --model name two different models: pick one");
        }
        let mut files = nibble_model::dummy::open_dummy(name, 0)
            .with_context(|| format!("cannot make dummy weights '{name}'"))?;
        if let Some(path) = tokenizer {
            let tok = nibble_model::tokenizer_from_path(path)?;
            if tok.vocab_size() > files.config.vocab_size {
                anyhow::bail!(
                    "tokenizer {} has {} tokens, more than the {} of dummy model '{name}'",
                    path.display(),
                    tok.vocab_size(),
                    files.config.vocab_size
                );
            }
            files.tokenizer = tok;
        }
        return Ok((format!("{name} (dummy weights)"), files));
    }
    let path = resolve_model(model)?;
    let files = open_model(&path, tokenizer)
        .with_context(|| format!("cannot load model {}", path.display()))?;
    Ok((path.display().to_string(), files))
}

/// Opens and loads a model on the CPU backend, showing a progress bar on a terminal.
pub fn load_cpu_engine(
    model: Option<&Path>,
    tokenizer: Option<&Path>,
    threads: usize,
) -> Result<Engine<CpuBackend>> {
    let (label, files) = open_files(model, tokenizer, None)?;
    load_engine(CpuBackend::new(threads)?, &label, files)
}

/// Loads opened model files onto `backend`, showing a progress bar on a terminal.
pub fn load_engine<B: Backend>(backend: B, label: &str, files: ModelFiles) -> Result<Engine<B>> {
    let t0 = Instant::now();
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
    .with_context(|| format!("cannot load model {label}"))?;
    let mut model = model;
    model.kv_format = kv_format;
    bar.finish_and_clear();
    let c = &model.config;
    eprintln!(
        "nibble: {label} ({:?}, {} layers, hidden {}, {} heads / {} kv, context {}) on {} in {:.2}s",
        c.arch,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.max_context,
        backend.name(),
        t0.elapsed().as_secs_f64()
    );
    for note in backend.load_notes() {
        eprintln!("nibble: note: {note}");
    }
    Ok(Engine {
        backend,
        model,
        tokenizer: files.tokenizer,
    })
}

/// What the CLI reports about a KV pool, for each backend's pool type.
pub trait KvReport {
    fn kv_shape(&self) -> KvShape;
    fn bytes_per_token(&self) -> f64;
    fn pool_bytes(&self) -> usize;
    fn bytes_per_token_of(shape: KvShape, block_size: usize) -> f64;
    /// Memory a pool of `shape` takes beyond its blocks for an engine of these limits (the CUDA
    /// pool's residual for the channel-wise formats): reserved before the blocks are sized.
    fn fixed_bytes_of(_shape: KvShape, _max_num_seqs: usize, _max_batched_tokens: usize) -> usize {
        0
    }
}

impl KvReport for CpuKvCache {
    fn kv_shape(&self) -> KvShape {
        self.shape
    }
    fn bytes_per_token(&self) -> f64 {
        CpuKvCache::bytes_per_token(self)
    }
    fn pool_bytes(&self) -> usize {
        CpuKvCache::pool_bytes(self)
    }
    fn bytes_per_token_of(shape: KvShape, block_size: usize) -> f64 {
        CpuKvCache::bytes_per_token_of(shape, block_size)
    }
}

impl KvReport for CudaKv {
    fn kv_shape(&self) -> KvShape {
        self.shape
    }
    fn bytes_per_token(&self) -> f64 {
        CudaKv::bytes_per_token(self) as f64
    }
    fn pool_bytes(&self) -> usize {
        CudaKv::bytes_per_token(self) * self.num_blocks * self.block_size
    }
    fn bytes_per_token_of(shape: KvShape, _block_size: usize) -> f64 {
        CudaKv::bytes_per_token_of(shape) as f64
    }
    fn fixed_bytes_of(shape: KvShape, max_num_seqs: usize, max_batched_tokens: usize) -> usize {
        CudaKv::residual_bytes_for(shape, max_num_seqs, max_batched_tokens)
    }
}

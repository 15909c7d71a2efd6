//! Request parsing, validation and OpenAI response shapes.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use nibble_core::Error;
use nibble_engine::serving::{Event, Request, TokenLogprob};
use nibble_engine::{FinishReason, SamplingParams};
use nibble_formats::chat_template::ChatMessage;
use serde_json::{Map, Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "no such route",
                "invalid_request_error",
            )
        })
        .with_state(state)
}

pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    fn bad(message: impl Into<String>, param: &str) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::BAD_REQUEST, message, "invalid_request_error")
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind,
                                    "param": self.param, "code": self.code}});
        (self.status, Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn authorize(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        state.engine.metrics.rejected.inc();
        Err(ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or incorrect API key",
                "authentication_error",
            )
        })
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> ApiResult<Json<Value>> {
    authorize(&state, &headers)?;
    Ok(Json(
        json!({"object": "list", "data": [{"id": state.model_name, "object": "model",
        "created": state.created, "owned_by": "nibble", "max_model_len": state.max_sequence_len}]}),
    ))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let stats = state
        .engine
        .stats
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.engine.metrics.render(&stats),
    )
        .into_response()
}

/// Typed access to a JSON object's fields with errors that name the field.
struct Fields(Map<String, Value>);

impl Fields {
    fn parse(body: &[u8]) -> ApiResult<Fields> {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => Ok(Fields(m)),
            Ok(_) => Err(ApiError::bad(
                "the request body must be a JSON object",
                "body",
            )),
            Err(e) => Err(ApiError::bad(
                format!("the request body is not valid JSON: {e}"),
                "body",
            )),
        }
    }

    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn f32(&self, k: &str, default: f32) -> ApiResult<f32> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| ApiError::bad(format!("'{k}' must be a number, got {v}"), k)),
        }
    }

    fn int(&self, k: &str) -> ApiResult<Option<i64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| ApiError::bad(format!("'{k}' must be an integer, got {v}"), k)),
        }
    }

    fn bool(&self, k: &str) -> ApiResult<bool> {
        match self.get(k) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad(format!("'{k}' must be true or false, got {v}"), k)),
        }
    }

    fn stop(&self) -> ApiResult<Vec<String>> {
        match self.get("stop") {
            None => Ok(vec![]),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) if a.iter().all(Value::is_string) && a.len() <= 16 => Ok(a
                .iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()),
            Some(v) => Err(ApiError::bad(
                format!("'stop' must be a string or up to 16 strings, got {v}"),
                "stop",
            )),
        }
    }
}

/// What both endpoints share after parsing.
struct Common {
    params: SamplingParams,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
    logprobs: Option<usize>,
}

fn common(state: &AppState, f: &Fields, max_tokens_keys: &[&str]) -> ApiResult<Common> {
    match f.get("model").map(|m| m.as_str()) {
        None => {}
        Some(Some(m)) if m == state.model_name => {}
        Some(m) => {
            return Err(ApiError {
                code: Some("model_not_found"),
                param: Some("model".into()),
                ..ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!(
                        "the model '{}' does not exist; this server serves '{}'",
                        m.unwrap_or("?"),
                        state.model_name
                    ),
                    "invalid_request_error",
                )
            });
        }
    }
    if let Some(n) = f.int("n")?
        && n != 1
    {
        return Err(ApiError::bad("only n = 1 is supported", "n"));
    }
    let top_k = f.int("top_k")?.unwrap_or(0);
    let seed = f.int("seed")?;
    let params = SamplingParams {
        temperature: f.f32("temperature", 1.0)?,
        top_p: f.f32("top_p", 1.0)?,
        top_k: if top_k < 0 { 0 } else { top_k as usize },
        min_p: f.f32("min_p", 0.0)?,
        repetition_penalty: f.f32("repetition_penalty", 1.0)?,
        seed: seed.map(|s| s as u64),
    };
    params
        .validate()
        .map_err(|e| ApiError::bad(e.to_string(), "sampling"))?;
    let mut max_tokens = None;
    for k in max_tokens_keys {
        if let Some(m) = f.int(k)? {
            if m < 1 {
                return Err(ApiError::bad(
                    format!("'{k}' must be at least 1, got {m}"),
                    k,
                ));
            }
            max_tokens = Some(m as usize);
        }
    }
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => o
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        Some(v) => {
            return Err(ApiError::bad(
                format!("'stream_options' must be an object, got {v}"),
                "stream_options",
            ));
        }
    };
    Ok(Common {
        params,
        max_tokens,
        stop: f.stop()?,
        stream: f.bool("stream")?,
        include_usage,
        ignore_eos: f.bool("ignore_eos")?,
        logprobs: None,
    })
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(state, headers, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn prompt_ids(state: &AppState, f: &Fields, kind: Kind) -> ApiResult<Vec<u32>> {
    let encode = |text: &str, special: bool| {
        state
            .tokenizer
            .encode(text, special)
            .map_err(|e| ApiError::bad(e.to_string(), "prompt"))
    };
    match kind {
        Kind::Completion => match f.get("prompt") {
            Some(Value::String(s)) => encode(s, true),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                encode(a[0].as_str().unwrap_or_default(), true)
            }
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()) => {
                let ids: Vec<u32> = a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect();
                match ids.iter().find(|&&t| t as usize >= state.vocab_size) {
                    Some(t) => Err(ApiError::bad(
                        format!("token id {t} is outside the vocabulary"),
                        "prompt",
                    )),
                    None => Ok(ids),
                }
            }
            Some(Value::Array(_)) => Err(ApiError::bad(
                "'prompt' must be a string, a list with one string, or a list of token ids (batched prompts are not supported)",
                "prompt",
            )),
            Some(v) => Err(ApiError::bad(
                format!("'prompt' must be a string, got {v}"),
                "prompt",
            )),
            None => Err(ApiError::bad("'prompt' is required", "prompt")),
        },
        Kind::Chat => {
            let Some(Value::Array(msgs)) = f.get("messages") else {
                return Err(ApiError::bad(
                    "'messages' must be a non-empty list",
                    "messages",
                ));
            };
            if msgs.is_empty() {
                return Err(ApiError::bad(
                    "'messages' must be a non-empty list",
                    "messages",
                ));
            }
            let mut messages = Vec::with_capacity(msgs.len());
            for (i, m) in msgs.iter().enumerate() {
                let role = m.get("role").and_then(Value::as_str);
                let content = match m.get("content") {
                    Some(Value::String(s)) => Some(s.clone()),
                    // Content parts: keep the text ones.
                    Some(Value::Array(parts)) => Some(
                        parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join(""),
                    ),
                    Some(Value::Null) | None => Some(String::new()),
                    _ => None,
                };
                match (role, content) {
                    (Some(r), Some(c)) => messages.push(ChatMessage::new(r, &c)),
                    _ => {
                        return Err(ApiError::bad(
                            format!("messages[{i}] needs a string 'role' and a string 'content'"),
                            "messages",
                        ));
                    }
                }
            }
            let template = state.template.as_ref().ok_or_else(|| {
                ApiError::bad(
                    "this model has no chat template; use /v1/completions",
                    "messages",
                )
            })?;
            let text = template
                .render(&messages, true)
                .map_err(|e| ApiError::bad(e.to_string(), "messages"))?;
            encode(&text, false)
        }
    }
}

async fn handle(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Bytes,
    kind: Kind,
) -> ApiResult<Response> {
    let result = prepare(&state, &headers, &body, kind);
    let (prompt, mut c) = match result {
        Ok(x) => x,
        Err(e) => {
            state.engine.metrics.rejected.inc();
            return Err(e);
        }
    };
    let prompt_len = prompt.len();
    let limit = state.max_sequence_len;
    if prompt_len >= limit {
        state.engine.metrics.rejected.inc();
        return Err(ApiError::bad(
            format!(
                "the prompt is {prompt_len} tokens; this model's maximum context length is {limit} tokens"
            ),
            "prompt",
        ));
    }
    let default_max = if kind == Kind::Completion {
        16
    } else {
        limit - prompt_len
    };
    let max_tokens = c.max_tokens.unwrap_or(default_max.min(limit - prompt_len));
    if prompt_len + max_tokens > limit {
        state.engine.metrics.rejected.inc();
        return Err(ApiError::bad(
            format!(
                "this model's maximum context length is {limit} tokens; you requested {} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)",
                prompt_len + max_tokens
            ),
            "max_tokens",
        ));
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let request = Request {
        prompt,
        params: std::mem::take(&mut c.params),
        max_tokens,
        stop: std::mem::take(&mut c.stop),
        ignore_eos: c.ignore_eos,
        logprobs: c.logprobs,
    };
    let rx = match state.engine.submit(id, request).await {
        Ok(rx) => rx,
        Err(e) => {
            state.engine.metrics.rejected.inc();
            return Err(match e {
                Error::LimitExceeded { ref what, .. } if what.contains("waiting") => ApiError {
                    code: Some("server_overloaded"),
                    ..ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!("the server is at capacity ({e}); retry later"),
                        "server_error",
                    )
                },
                other => ApiError::bad(other.to_string(), "prompt"),
            });
        }
    };
    let meta = ResponseMeta {
        id: format!(
            "{}-{id}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        model: state.model_name.clone(),
        created: now(),
        kind,
        state: state.clone(),
    };
    if c.stream {
        Ok(stream_response(meta, rx, c.include_usage).into_response())
    } else {
        Ok(Json(collect(meta, rx).await?).into_response())
    }
}

fn prepare(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    kind: Kind,
) -> ApiResult<(Vec<u32>, Common)> {
    authorize(state, headers)?;
    let f = Fields::parse(body)?;
    let keys: &[&str] = match kind {
        Kind::Completion => &["max_tokens"],
        Kind::Chat => &["max_tokens", "max_completion_tokens"],
    };
    let mut c = common(state, &f, keys)?;
    c.logprobs = match kind {
        Kind::Completion => match f.int("logprobs")? {
            None => None,
            Some(n) if (0..=20).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::bad(
                    format!("'logprobs' must be 0 to 20, got {n}"),
                    "logprobs",
                ));
            }
        },
        Kind::Chat => {
            if f.bool("logprobs")? {
                match f.int("top_logprobs")?.unwrap_or(0) {
                    n @ 0..=20 => Some(n as usize),
                    n => {
                        return Err(ApiError::bad(
                            format!("'top_logprobs' must be 0 to 20, got {n}"),
                            "top_logprobs",
                        ));
                    }
                }
            } else {
                None
            }
        }
    };
    Ok((prompt_ids(state, &f, kind)?, c))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct ResponseMeta {
    id: String,
    model: String,
    created: u64,
    kind: Kind,
    state: Arc<AppState>,
}

impl ResponseMeta {
    fn token_text(&self, t: u32) -> String {
        self.state.tokenizer.decode(&[t], false).unwrap_or_default()
    }

    fn logprobs_json(&self, lps: &[TokenLogprob]) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "tokens": lps.iter().map(|l| self.token_text(l.token)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (self.token_text(*t), json!(p)))
                    .collect::<Map<String, Value>>()).collect::<Vec<_>>(),
            }),
            Kind::Chat => json!({"content": lps.iter().map(|l| {
                let tok = self.token_text(l.token);
                json!({"token": tok, "logprob": l.logprob, "bytes": tok.as_bytes(),
                    "top_logprobs": l.top.iter().map(|(t, p)| { let s = self.token_text(*t);
                        json!({"token": s, "logprob": p, "bytes": s.as_bytes()}) }).collect::<Vec<_>>()})
            }).collect::<Vec<_>>()}),
        }
    }

    fn usage(prompt: usize, completion: usize) -> Value {
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn chunk(&self, text: &str, lps: &[TokenLogprob], finish: Option<&str>, first: bool) -> Value {
        let logprobs = if lps.is_empty() {
            Value::Null
        } else {
            self.logprobs_json(lps)
        };
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = match (first, finish.is_some() && text.is_empty()) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, true) => json!({}),
                    (false, false) => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let object = if self.kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
    }
}

async fn collect(
    meta: ResponseMeta,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> ApiResult<Value> {
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token {
                text: t, logprob, ..
            } => {
                text.push_str(&t);
                lps.extend(logprob);
            }
            Event::Finished {
                reason,
                tail,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                text.push_str(&tail);
                let logprobs = if lps.is_empty() {
                    Value::Null
                } else {
                    meta.logprobs_json(&lps)
                };
                let choice = match meta.kind {
                    Kind::Completion => json!({"index": 0, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_name(reason)}),
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs, "finish_reason": finish_name(reason)})
                    }
                };
                let object = if meta.kind == Kind::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                return Ok(
                    json!({"id": meta.id, "object": object, "created": meta.created, "model": meta.model,
                    "choices": [choice], "usage": ResponseMeta::usage(prompt_tokens, completion_tokens)}),
                );
            }
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine dropped the request",
        "server_error",
    ))
}

fn stream_response(
    meta: ResponseMeta,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let mut first = true;
    let events = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let mut out: Vec<Value> = Vec::new();
        let mut done = false;
        match ev {
            Event::Token { text, logprob, .. } => {
                let lps: Vec<TokenLogprob> = logprob.into_iter().collect();
                if !text.is_empty() || !lps.is_empty() || first {
                    out.push(meta.chunk(&text, &lps, None, first));
                    first = false;
                }
            }
            Event::Finished { reason, tail, prompt_tokens, completion_tokens, .. } => {
                out.push(meta.chunk(&tail, &[], Some(finish_name(reason)), first));
                first = false;
                if include_usage {
                    let object = if meta.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                    out.push(json!({"id": meta.id, "object": object, "created": meta.created, "model": meta.model,
                        "choices": [], "usage": ResponseMeta::usage(prompt_tokens, completion_tokens)}));
                }
                done = true;
            }
        }
        let mut sse: Vec<Result<SseEvent, Infallible>> =
            out.into_iter().map(|v| Ok(SseEvent::default().data(v.to_string()))).collect();
        if done {
            sse.push(Ok(SseEvent::default().data("[DONE]")));
        }
        stream::iter(sse)
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

//! The routes and OpenAI's response shapes. Requests arrive here read whole and authorized
//! (`front_door`); they are validated (`validate`), tokenized, and handed to the engine.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures_util::stream::{self, Stream, StreamExt};
use nibble_core::Error;
use nibble_engine::FinishReason;
use nibble_engine::serving::{Event, Request, TokenLogprob};
use nibble_formats::chat_template::ChatMessage;
use serde_json::{Map, Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::front_door;
use crate::validate::{self, Generation, Prompt, Rules};

pub fn router(state: Arc<AppState>) -> Router {
    let routes = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        // Only the routes above, and only their methods (a 405 is answered before it).
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            front_door::admit,
        ))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(front_door::not_found)
        // `admit` has read the body within --max-body-bytes; axum's own 2 MiB cap would answer
        // in plain text.
        .layer(DefaultBodyLimit::disable())
        .with_state(state);
    front_door::with_json_errors(routes)
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": state.model_name, "object": "model",
        "created": state.created, "owned_by": "nibble", "max_model_len": state.max_sequence_len}]}),
    )
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

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(state, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    handle(state, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn rules(state: &AppState) -> Rules<'_> {
    Rules {
        model_name: &state.model_name,
        vocab_size: state.vocab_size,
        max_messages: state.limits.max_messages,
        max_stop: state.limits.max_stop,
    }
}

/// Validates and tokenizes: the prompt's token ids and what to generate.
fn prepare(state: &AppState, body: &[u8], kind: Kind) -> ApiResult<(Vec<u32>, Generation)> {
    let encode = |text: &str, add_special: bool, param: &str| {
        state
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| ApiError::invalid_value(param, e.to_string()))
    };
    let (prompt, generation) = match kind {
        Kind::Completion => {
            let r = validate::completion(body, &rules(state))?;
            let ids = match r.prompt {
                Prompt::Text(text) => encode(&text, true, "prompt")?,
                Prompt::Tokens(ids) => ids,
            };
            (ids, r.generation)
        }
        Kind::Chat => {
            let r = validate::chat(body, &rules(state))?;
            let template = state.template.as_ref().ok_or_else(|| {
                ApiError::unsupported(
                    "messages",
                    "needs a chat template, and this model has none: use /v1/completions",
                )
            })?;
            let messages: Vec<ChatMessage> = r
                .messages
                .iter()
                .map(|m| ChatMessage::new(m.role.template_name(), &m.content))
                .collect();
            let text = template
                .render(&messages, true)
                .map_err(|e| ApiError::invalid_value("messages", e.to_string()))?;
            (encode(&text, false, "messages")?, r.generation)
        }
    };
    if prompt.is_empty() {
        let param = if kind == Kind::Chat {
            "messages"
        } else {
            "prompt"
        };
        return Err(ApiError::invalid_value(
            param,
            "the prompt is empty: it has no tokens.",
        ));
    }
    Ok((prompt, generation))
}

async fn handle(state: Arc<AppState>, body: Bytes, kind: Kind) -> ApiResult<Response> {
    let (prompt, mut c) = match prepare(&state, &body, kind) {
        Ok(x) => x,
        Err(e) => {
            state.engine.metrics.rejected.inc();
            return Err(e);
        }
    };
    let prompt_param = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    let prompt_len = prompt.len();
    let limit = state.max_sequence_len;
    if prompt_len >= limit {
        state.engine.metrics.rejected.inc();
        return Err(ApiError::bad(
            prompt_param,
            "context_length_exceeded",
            format!(
                "The prompt is {prompt_len} tokens; this model's maximum context length is {limit} tokens."
            ),
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
            "max_tokens",
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {limit} tokens; you requested {} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                prompt_len.saturating_add(max_tokens)
            ),
        ));
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let request = Request {
        prompt,
        params: std::mem::take(&mut c.params),
        max_tokens,
        stop: std::mem::take(&mut c.stop),
        ignore_eos: c.ignore_eos,
        stop_token_ids: vec![],
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
                        format!("The server is at capacity ({e}); retry later."),
                        "server_error",
                    )
                },
                other => ApiError::invalid_value(prompt_param, other.to_string()),
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

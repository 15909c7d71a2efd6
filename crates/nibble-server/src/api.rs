//! The routes and OpenAI's response shapes. Requests arrive here read whole and authorized
//! (`front_door`); they are validated (`validate`), tokenized, and handed to the engine as one
//! sequence per choice: `n` per prompt, prompt-major (choice `index = prompt_i * n + j`, as
//! OpenAI and vLLM number them).

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
use nibble_engine::serving::{Event, Request, RequestId, TokenLogprob};
use nibble_formats::chat_template::ChatMessage;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::error::{ApiError, ApiResult};
use crate::front_door;
use crate::tools::{self, TemplateTools, Tool, ToolCall, ToolChoice, ToolFormat};
use crate::validate::{self, Generation, Message, Prompt, Role, Rules};

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
        max_n: state.limits.max_n,
        max_sequences: state.max_waiting,
    }
}

/// One prompt of a request, tokenized.
struct PromptIn {
    ids: Vec<u32>,
    /// What `echo` puts before each of its choices' text.
    echo: Option<String>,
    /// The field to name in errors about it: `prompt[i]` in a batch.
    param: String,
}

/// Validates and tokenizes: the prompts' token ids, what to generate, and the format of tool
/// calls to parse from the replies (when tools may be called).
fn prepare(
    state: &AppState,
    body: &[u8],
    kind: Kind,
) -> ApiResult<(Vec<PromptIn>, Generation, Option<ToolFormat>)> {
    let tokenizer_error =
        |param: &str, e: nibble_core::Error| ApiError::invalid_value(param, e.to_string());
    let (prompts, generation, parse) = match kind {
        Kind::Completion => {
            let r = validate::completion(body, &rules(state))?;
            let batch = r.prompts.len() > 1;
            let prompts = r
                .prompts
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let param = if batch {
                        format!("prompt[{i}]")
                    } else {
                        "prompt".to_string()
                    };
                    // A prompt's text is the client's: a special token's string in it is text
                    // (send token ids for special tokens).
                    let (ids, text) = match p {
                        Prompt::Text(text) => (
                            state
                                .tokenizer
                                .encode_plain(&text, true)
                                .map_err(|e| tokenizer_error(&param, e))?,
                            text,
                        ),
                        Prompt::Tokens(ids) => {
                            let text = if r.echo {
                                state
                                    .tokenizer
                                    .decode(&ids, false)
                                    .map_err(|e| tokenizer_error(&param, e))?
                            } else {
                                String::new()
                            };
                            (ids, text)
                        }
                    };
                    Ok(PromptIn {
                        ids,
                        echo: r.echo.then_some(text),
                        param,
                    })
                })
                .collect::<ApiResult<Vec<_>>>()?;
            (prompts, r.generation, None)
        }
        Kind::Chat => {
            let r = validate::chat(body, &rules(state))?;
            let template = state.template.as_ref().ok_or_else(|| {
                ApiError::unsupported(
                    "messages",
                    "needs a chat template, and this model has none: use /v1/completions",
                )
            })?;
            let tt = TemplateTools::detect(state.tokenizer.chat_template.as_deref().unwrap_or(""));
            let messages = chat_messages(&r.messages, &r.tools, tt);
            let tools = (tt.renders_tools && !r.tools.is_empty())
                .then(|| Value::Array(r.tools.iter().map(|t| t.spec.clone()).collect()));
            // The template's special tokens are special; the ones users typed are text.
            let rendered = template
                .render_guarded_with_tools(&messages, tools.as_ref(), true, &state.guard)
                .map_err(|e| ApiError::invalid_value("messages", e.to_string()))?;
            let ids = state
                .tokenizer
                .encode_with_literals(&rendered.text, &rendered.literal)
                .map_err(|e| tokenizer_error("messages", e))?;
            let prompt = PromptIn {
                ids,
                echo: None,
                param: "messages".into(),
            };
            let mut generation = r.generation;
            if let Some(g) = tools::grammar(tt.format, &r.tools, &r.tool_choice) {
                generation.grammar = Some(("tool_choice", g));
            }
            let parse = (r.tool_choice != ToolChoice::None).then_some(tt.format);
            (vec![prompt], generation, parse)
        }
    };
    if let Some(p) = prompts.iter().find(|p| p.ids.is_empty()) {
        return Err(ApiError::invalid_value(
            &p.param,
            "the prompt is empty: it has no tokens.",
        ));
    }
    Ok((prompts, generation, parse))
}

/// The request's messages as the template takes them. A template that renders tools gets the
/// calls and results in Hugging Face's fields (arguments as objects, as vLLM passes them); for
/// one that does not, the tools are described in the system message and calls and results are
/// written out as a Hermes-style model reads them.
fn chat_messages(messages: &[Message], tools: &[Tool], tt: TemplateTools) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if !tt.renders_tools && !tools.is_empty() {
        let prompt = tools::system_prompt(tools);
        match messages.first() {
            Some(m) if m.role.template_name() == "system" => {
                out.push(ChatMessage::new(
                    "system",
                    &format!("{}\n\n{prompt}", m.content),
                ));
            }
            _ => out.push(ChatMessage::new("system", &prompt)),
        }
    }
    for (i, m) in messages.iter().enumerate() {
        if i == 0 && !out.is_empty() && m.role.template_name() == "system" {
            continue;
        }
        let mut cm = ChatMessage::new(m.role.template_name(), &m.content);
        if tt.renders_tools {
            cm.tool_call_id = m.tool_call_id.clone();
            if !m.tool_calls.is_empty() {
                cm.tool_calls = Some(Value::Array(
                    m.tool_calls
                        .iter()
                        .map(|(id, c)| {
                            let args: Value = serde_json::from_str(&c.arguments)
                                .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                            json!({"id": id, "type": "function",
                                "function": {"name": c.name, "arguments": args}})
                        })
                        .collect(),
                ));
            }
        } else if m.role == Role::Tool {
            cm = ChatMessage::new(
                "user",
                &format!("<tool_response>\n{}\n</tool_response>", m.content),
            );
        } else if !m.tool_calls.is_empty() {
            let calls: Vec<ToolCall> = m.tool_calls.iter().map(|(_, c)| c.clone()).collect();
            let text = tools::calls_as_text(&calls);
            cm.content = if m.content.is_empty() {
                text
            } else {
                format!("{}\n{text}", m.content)
            };
        }
        out.push(cm);
    }
    out
}

/// The engine's requests for every choice of every prompt, prompt-major, with the length
/// checks of each prompt.
fn requests(
    state: &AppState,
    kind: Kind,
    prompts: &[PromptIn],
    c: &Generation,
) -> ApiResult<Vec<Request>> {
    let limit = state.max_sequence_len;
    // Compiled once; every choice starts from a copy.
    let constraint = match &c.grammar {
        None => None,
        Some((param, spec)) => {
            let grammars = state.grammars.as_ref().map_err(|why| {
                ApiError::unsupported(param, &format!("is not available for this model ({why})"))
            })?;
            Some(
                grammars
                    .compile(spec)
                    .map_err(|e| ApiError::invalid_value(param, e.to_string()))?,
            )
        }
    };
    let mut out = Vec::with_capacity(prompts.len() * c.n);
    for p in prompts {
        let prompt_len = p.ids.len();
        if prompt_len >= limit {
            return Err(ApiError::bad(
                &p.param,
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
            return Err(ApiError::bad(
                "max_tokens",
                "context_length_exceeded",
                format!(
                    "This model's maximum context length is {limit} tokens; you requested {} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                    prompt_len.saturating_add(max_tokens)
                ),
            ));
        }
        for j in 0..c.n {
            let mut params = c.params.clone();
            // Choice j of a seeded request draws from seed + j: the choices differ, a rerun
            // repeats them, and each prompt of a batch gets what it would get alone (vLLM's
            // rule).
            params.seed = c.params.seed.map(|s| s.wrapping_add(j as u64));
            out.push(Request {
                prompt: p.ids.clone(),
                params,
                max_tokens,
                stop: c.stop.clone(),
                ignore_eos: c.ignore_eos,
                stop_token_ids: c.stop_token_ids.clone(),
                logprobs: c.logprobs,
                constraint: constraint.clone(),
            });
        }
    }
    Ok(out)
}

async fn handle(state: Arc<AppState>, body: Bytes, kind: Kind) -> ApiResult<Response> {
    let refused = |e: ApiError| {
        state.engine.metrics.rejected.inc();
        e
    };
    let (prompts, c, parse_tools) = prepare(&state, &body, kind).map_err(refused)?;
    let reqs = requests(&state, kind, &prompts, &c).map_err(refused)?;
    let count = reqs.len() as u64;
    let first = state.next_id.fetch_add(count, Ordering::Relaxed);
    let batch: Vec<(RequestId, Request)> = (first..first + count).zip(reqs).collect();
    let rx = match state.engine.submit(batch).await {
        Ok(rx) => rx,
        Err(e) => {
            return Err(refused(match e {
                Error::LimitExceeded { ref what, .. } if what.contains("waiting") => ApiError {
                    code: Some("server_overloaded"),
                    ..ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!("The server is at capacity ({e}); retry later."),
                        "server_error",
                    )
                },
                other => ApiError::invalid_value(&prompts[0].param, other.to_string()),
            }));
        }
    };
    let meta = ResponseMeta {
        id: format!(
            "{}-{first}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        model: state.model_name.clone(),
        created: now(),
        kind,
        first,
        n: c.n,
        prompt_tokens: prompts.iter().map(|p| p.ids.len()).sum(),
        echo: prompts.into_iter().map(|p| p.echo).collect(),
        include_usage: c.include_usage,
        tools: parse_tools,
        state: state.clone(),
    };
    if c.stream {
        Ok(stream_response(meta, rx).into_response())
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
    /// The engine id of choice 0; choice `i` is `first + i`.
    first: RequestId,
    /// Choices per prompt.
    n: usize,
    /// All prompts' tokens, each prompt counted once however many choices it has.
    prompt_tokens: usize,
    /// Per prompt, the text `echo` puts before its choices' text.
    echo: Vec<Option<String>>,
    include_usage: bool,
    /// Tool calls are parsed from the replies, in this format.
    tools: Option<ToolFormat>,
    state: Arc<AppState>,
}

impl ResponseMeta {
    fn choices(&self) -> usize {
        self.echo.len() * self.n
    }

    /// The choice an engine event is for.
    fn index(&self, id: RequestId) -> Option<usize> {
        let i = id.checked_sub(self.first)? as usize;
        (i < self.choices()).then_some(i)
    }

    fn echo_of(&self, index: usize) -> &str {
        self.echo[index / self.n].as_deref().unwrap_or("")
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn token_text(&self, t: u32) -> String {
        self.state.tokenizer.decode(&[t], false).unwrap_or_default()
    }

    fn logprobs_json(&self, lps: &[TokenLogprob]) -> Value {
        if lps.is_empty() {
            return Value::Null;
        }
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

    /// OpenAI's `tool_calls` of choice `index` (with each call's `index` in a stream's delta).
    fn tool_calls_json(&self, index: usize, calls: &[ToolCall], delta: bool) -> Value {
        Value::Array(
            calls
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    let mut v = json!({"id": format!("call_{}_{index}_{k}", self.first),
                        "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
                    if delta {
                        v["index"] = json!(k);
                    }
                    v
                })
                .collect(),
        )
    }

    /// A reply that calls tools finished to call them, unless it was cut off.
    fn calls_finish(&self, finish: Option<FinishReason>) -> Option<&'static str> {
        finish.map(|r| match r {
            FinishReason::Eos | FinishReason::Stop => "tool_calls",
            other => finish_name(other),
        })
    }

    /// A chat chunk whose delta is `delta`.
    fn delta_chunk(&self, index: usize, delta: Value, finish: Option<&str>) -> Value {
        let mut chunk = json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [{"index": index, "delta": delta, "logprobs": null,
            "finish_reason": finish}]});
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn usage(&self, completion: usize) -> Value {
        let prompt = self.prompt_tokens;
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    /// A streamed chunk of one choice; `first` is its first chunk (which carries the chat role,
    /// and the echoed prompt).
    fn chunk(
        &self,
        index: usize,
        text: &str,
        lps: &[TokenLogprob],
        finish: Option<&str>,
        first: bool,
    ) -> Value {
        let logprobs = self.logprobs_json(lps);
        let choice = match self.kind {
            Kind::Completion => {
                let text = if first {
                    format!("{}{text}", self.echo_of(index))
                } else {
                    text.to_string()
                };
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = match (first, finish.is_some() && text.is_empty()) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, true) => json!({}),
                    (false, false) => json!({"content": text}),
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let mut chunk = json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [choice]});
        if self.include_usage {
            // OpenAI: with include_usage, every chunk has `usage`, null until the last one.
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

#[derive(Default)]
struct Choice {
    text: String,
    lps: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    completion_tokens: usize,
}

async fn collect(meta: ResponseMeta, mut rx: UnboundedReceiver<Event>) -> ApiResult<Value> {
    let mut choices: Vec<Choice> = (0..meta.choices()).map(|_| Choice::default()).collect();
    let mut left = choices.len();
    while left > 0 {
        let Some(ev) = rx.recv().await else {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine dropped the request",
                "server_error",
            ));
        };
        let (Event::Token { id, .. } | Event::Finished { id, .. }) = ev;
        let Some(c) = meta.index(id).map(|i| &mut choices[i]) else {
            continue;
        };
        match ev {
            Event::Token { text, logprob, .. } => {
                c.text.push_str(&text);
                c.lps.extend(logprob);
            }
            Event::Finished {
                reason,
                tail,
                completion_tokens,
                ..
            } => {
                c.text.push_str(&tail);
                c.finish = Some(reason);
                c.completion_tokens = completion_tokens;
                left -= 1;
            }
        }
    }
    let completion_tokens = choices.iter().map(|c| c.completion_tokens).sum();
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = meta.logprobs_json(&c.lps);
            let finish = c.finish.map(finish_name);
            match meta.kind {
                Kind::Completion => {
                    json!({"index": i, "text": format!("{}{}", meta.echo_of(i), c.text),
                    "logprobs": logprobs, "finish_reason": finish})
                }
                Kind::Chat => match meta.tools.and_then(|f| tools::parse(f, &c.text)) {
                    Some((content, calls)) => {
                        json!({"index": i, "message": {"role": "assistant", "content": content,
                            "tool_calls": meta.tool_calls_json(i, &calls, false)},
                        "logprobs": logprobs, "finish_reason": meta.calls_finish(c.finish)})
                    }
                    None => json!({"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": finish}),
                },
            }
        })
        .collect();
    Ok(
        json!({"id": meta.id, "object": meta.object(false), "created": meta.created, "model": meta.model,
        "choices": choices, "usage": meta.usage(completion_tokens)}),
    )
}

fn stream_response(
    meta: ResponseMeta,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    // Per choice: whether its first chunk is still to come.
    let mut first = vec![true; meta.choices()];
    let mut left = meta.choices();
    let mut completion_tokens = 0;
    // Per choice, with tools: text held back because a tool call may start in it.
    let mut held = vec![String::new(); meta.choices()];
    let events = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let mut out: Vec<Value> = Vec::new();
        let (Event::Token { id, .. } | Event::Finished { id, .. }) = ev;
        if let Some(i) = meta.index(id) {
            match ev {
                Event::Token { text, logprob, .. } => {
                    let lps: Vec<TokenLogprob> = logprob.into_iter().collect();
                    let text = match meta.tools {
                        None => text,
                        Some(format) => {
                            held[i].push_str(&text);
                            let cut = tools::call_start(format, &held[i]).unwrap_or(held[i].len());
                            let rest = held[i].split_off(cut);
                            std::mem::replace(&mut held[i], rest)
                        }
                    };
                    if !text.is_empty() || !lps.is_empty() || first[i] {
                        out.push(meta.chunk(i, &text, &lps, None, first[i]));
                        first[i] = false;
                    }
                }
                Event::Finished { reason, tail, completion_tokens: n, .. } => {
                    let mut tail = tail;
                    if let Some(format) = meta.tools {
                        let text = std::mem::take(&mut held[i]) + &tail;
                        tail = match tools::parse(format, &text) {
                            Some((_, calls)) => {
                                // The content before the call went out already.
                                let delta = json!({"tool_calls": meta.tool_calls_json(i, &calls, true)});
                                let delta = if first[i] {
                                    json!({"role": "assistant", "content": null,
                                        "tool_calls": delta["tool_calls"]})
                                } else {
                                    delta
                                };
                                out.push(meta.delta_chunk(i, delta, None));
                                out.push(meta.delta_chunk(i, json!({}), meta.calls_finish(Some(reason))));
                                first[i] = false;
                                String::new()
                            }
                            None => text,
                        };
                    }
                    if first[i] || out.is_empty() {
                        out.push(meta.chunk(i, &tail, &[], Some(finish_name(reason)), first[i]));
                    }
                    first[i] = false;
                    completion_tokens += n;
                    left -= 1;
                    if left == 0 && meta.include_usage {
                        out.push(json!({"id": meta.id, "object": meta.object(true), "created": meta.created,
                            "model": meta.model, "choices": [], "usage": meta.usage(completion_tokens)}));
                    }
                }
            }
        }
        let done = left == 0 && !out.is_empty();
        let mut sse: Vec<Result<SseEvent, Infallible>> =
            out.into_iter().map(|v| Ok(SseEvent::default().data(v.to_string()))).collect();
        if done {
            sse.push(Ok(SseEvent::default().data("[DONE]")));
        }
        stream::iter(sse)
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

#[cfg(test)]
#[path = "api_tests.rs"]
mod tests;

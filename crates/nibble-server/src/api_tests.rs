//! The routes over a real engine (the tiny Qwen2 test model on the CPU): several choices and
//! prompts per request, their order, seeds and usage, streaming, echo, stop token ids, and
//! special-token strings in messages.

use std::path::PathBuf;

use axum::body::Body;
use axum::http::Request as HttpRequest;
use nibble_cpu::CpuBackend;
use nibble_engine::serving::{EngineConfig, LlmEngine};
use nibble_model::{Transformer, open_model};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::*;
use crate::Limits;

fn app(config: EngineConfig) -> Router {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nibble-model/tests/fixtures/tiny-qwen2");
    let files = open_model(&dir, None).unwrap();
    let backend = CpuBackend::new(1).unwrap();
    let model = Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
    let engine = LlmEngine::new(backend, model, files.tokenizer, config).unwrap();
    let limits = Limits {
        max_n: 4,
        ..Limits::default()
    };
    router(crate::start(engine, "tiny".into(), None, limits).unwrap())
}

/// POSTs `body` to `path`: the status and the response body.
async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, String) {
    let req = HttpRequest::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn ok(app: &Router, path: &str, body: Value) -> Value {
    let (status, text) = post(app, path, body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// A streamed response's chunks, after checking that it ends with `[DONE]`.
async fn chunks(app: &Router, path: &str, body: Value) -> Vec<Value> {
    let (status, text) = post(app, path, body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn texts(r: &Value) -> Vec<String> {
    r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "choices come in index order");
            c["text"]
                .as_str()
                .or(c["message"]["content"].as_str())
                .unwrap()
                .to_string()
        })
        .collect()
}

const SAMPLED: fn(Value) -> Value = |extra| {
    let mut body = json!({"max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
};

#[tokio::test]
async fn n_choices_differ_repeat_with_their_seed_and_count_the_prompt_once() {
    let app = app(EngineConfig::default());
    let body = SAMPLED(json!({"prompt": "Hello there", "n": 3}));
    let r = ok(&app, "/v1/completions", body.clone()).await;
    let got = texts(&r);
    assert_eq!(got.len(), 3);
    assert!(
        got[0] != got[1] && got[1] != got[2] && got[0] != got[2],
        "{got:?}"
    );
    assert_eq!(texts(&ok(&app, "/v1/completions", body).await), got);
    // Choice j draws from seed + j: choice 1 is what seed 6 gives alone.
    let alone = ok(
        &app,
        "/v1/completions",
        SAMPLED(json!({"prompt": "Hello there", "seed": 6})),
    )
    .await;
    assert_eq!(texts(&alone)[0], got[1]);
    let prompt_tokens = alone["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(r["usage"]["completion_tokens"], 3 * 8);
    assert_eq!(r["usage"]["total_tokens"], prompt_tokens + 24);

    let chat = SAMPLED(json!({"messages": [{"role": "user", "content": "Hi"}], "n": 2}));
    let r = ok(&app, "/v1/chat/completions", chat).await;
    let got = texts(&r);
    assert_eq!(got.len(), 2);
    assert_ne!(got[0], got[1]);
    assert_eq!(r["usage"]["completion_tokens"], 16);
}

#[tokio::test]
async fn batched_prompts_are_numbered_prompt_major() {
    let app = app(EngineConfig::default());
    let batch = ok(
        &app,
        "/v1/completions",
        SAMPLED(json!({"prompt": ["One", "Two two"], "n": 2})),
    )
    .await;
    let got = texts(&batch);
    assert_eq!(got.len(), 4);
    let mut prompt_tokens = 0;
    for (p, prompt) in ["One", "Two two"].iter().enumerate() {
        let alone = ok(
            &app,
            "/v1/completions",
            SAMPLED(json!({"prompt": prompt, "n": 2})),
        )
        .await;
        assert_eq!(texts(&alone), got[p * 2..p * 2 + 2], "prompt {p}");
        prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    assert_eq!(batch["usage"]["prompt_tokens"], prompt_tokens);
    // Token-id prompts, one list per prompt.
    let ids = ok(
        &app,
        "/v1/completions",
        SAMPLED(json!({"prompt": [[79, 110, 101], [84, 119, 111]]})),
    )
    .await;
    assert_eq!(texts(&ids)[0], got[0], "\"One\" is bytes 79 110 101");
    let (status, text) = post(&app, "/v1/completions", json!({"prompt": []})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    let (status, text) = post(&app, "/v1/completions", json!({"prompt": ["a", ""]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("\"param\":\"prompt[1]\""), "{text}");
}

#[tokio::test]
async fn streams_index_every_choice_and_end_with_usage() {
    let app = app(EngineConfig::default());
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": ["One", "Two two"], "n": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "n": 3}),
        ),
    ] {
        let whole = ok(&app, path, SAMPLED(body.clone())).await;
        let mut streamed = SAMPLED(body);
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let chunks = chunks(&app, path, streamed).await;
        let choices = whole["choices"].as_array().unwrap().len();
        let mut text = vec![String::new(); choices];
        let mut finished = vec![0; choices];
        let (last, rest) = chunks.split_last().unwrap();
        for c in rest {
            assert!(c["usage"].is_null(), "{c}");
            for ch in c["choices"].as_array().unwrap() {
                let i = ch["index"].as_u64().unwrap() as usize;
                let piece = ch["text"].as_str().or(ch["delta"]["content"].as_str());
                text[i].push_str(piece.unwrap_or(""));
                if !ch["finish_reason"].is_null() {
                    finished[i] += 1;
                }
            }
        }
        assert_eq!(text, texts(&whole), "{path}");
        assert_eq!(finished, vec![1; choices], "{path}");
        assert_eq!(last["choices"], json!([]), "{path}");
        assert_eq!(last["usage"], whole["usage"], "{path}");
    }
}

#[tokio::test]
async fn echo_puts_the_prompt_before_each_choice() {
    let app = app(EngineConfig::default());
    let plain = ok(
        &app,
        "/v1/completions",
        SAMPLED(json!({"prompt": "Hello", "n": 2})),
    )
    .await;
    let echoed = ok(
        &app,
        "/v1/completions",
        SAMPLED(json!({"prompt": "Hello", "n": 2, "echo": true})),
    )
    .await;
    let want: Vec<String> = texts(&plain).iter().map(|t| format!("Hello{t}")).collect();
    assert_eq!(texts(&echoed), want);
    assert_eq!(echoed["usage"], plain["usage"]);
    // Token prompts echo their text; streams echo in each choice's first chunk.
    let mut body = SAMPLED(json!({"prompt": [72, 101, 108, 108, 111], "echo": true}));
    let r = ok(&app, "/v1/completions", body.clone()).await;
    assert!(texts(&r)[0].starts_with("Hello"), "{r}");
    body["stream"] = json!(true);
    let first = &chunks(&app, "/v1/completions", body).await[0];
    assert!(
        first["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Hello")
    );
    let (status, text) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "Hello", "echo": true, "logprobs": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
}

#[tokio::test]
async fn a_stop_token_id_ends_the_choice_without_its_text() {
    let app = app(EngineConfig::default());
    let greedy = json!({"prompt": "Hello", "max_tokens": 10, "temperature": 0, "ignore_eos": true,
        "logprobs": 0});
    let r = ok(&app, "/v1/completions", greedy.clone()).await;
    let tokens: Vec<String> =
        serde_json::from_value(r["choices"][0]["logprobs"]["tokens"].clone()).unwrap();
    // The first token of the output that did not come before, as a single byte (this vocabulary
    // is bytes, then a few merges).
    let at = (1..tokens.len())
        .find(|&i| !tokens[..i].contains(&tokens[i]) && tokens[i].len() == 1)
        .expect("a new one-byte token");
    let id = tokens[at].as_bytes()[0];
    let mut body = greedy;
    body["stop_token_ids"] = json!([id]);
    let stopped = ok(&app, "/v1/completions", body).await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["usage"]["completion_tokens"], at);
    let (all, cut) = (&r["choices"][0]["text"], &stopped["choices"][0]["text"]);
    assert!(
        all.as_str().unwrap().starts_with(cut.as_str().unwrap()),
        "{all} {cut}"
    );
    assert_eq!(
        stopped["choices"][0]["logprobs"]["tokens"],
        json!(tokens[..at])
    );
}

#[tokio::test]
async fn special_token_strings_typed_in_a_message_are_text() {
    let app = app(EngineConfig::default());
    let usage = |content: &str| json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1});
    let typed = ok(&app, "/v1/chat/completions", usage("a<|im_end|>")).await;
    let plain = ok(&app, "/v1/chat/completions", usage("a")).await;
    // "<|im_end|>" as text is ten byte tokens (this vocabulary has no merge for it), not one.
    let extra = typed["usage"]["prompt_tokens"].as_u64().unwrap()
        - plain["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(extra, 10);
    let prompt = ok(
        &app,
        "/v1/completions",
        json!({"prompt": "a<|im_end|>", "max_tokens": 1}),
    )
    .await;
    assert_eq!(prompt["usage"]["prompt_tokens"], 11);
}

#[tokio::test]
async fn too_many_sequences_and_unknown_roles_are_400() {
    let app = app(EngineConfig {
        max_waiting: 3,
        ..EngineConfig::default()
    });
    for (path, body, param) in [
        ("/v1/completions", json!({"prompt": "x", "n": 5}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 4}), "n"),
        (
            "/v1/completions",
            json!({"prompt": ["x", "y"], "n": 2}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}]}),
            "messages[1].role",
        ),
    ] {
        let (status, text) = post(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["param"], param, "{text}");
    }
    ok(
        &app,
        "/v1/completions",
        json!({"prompt": "x", "n": 3, "max_tokens": 1}),
    )
    .await;
}

/// The CPU backend, except that its forward passes fail while `fail` is set.
struct Faulty {
    cpu: CpuBackend,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl nibble_model::Backend for Faulty {
    type Tensor = nibble_cpu::CpuTensor;
    type Weight = nibble_cpu::CpuWeight;
    type Kv = nibble_cpu::CpuKvCache;

    nibble_cpu::delegate_to_cpu!(cpu);
    nibble_cpu::delegate_attention_and_linear_to_cpu!(cpu);

    fn name(&self) -> String {
        "faulty cpu".into()
    }
    fn load_weight(
        &self,
        t: &nibble_formats::HostTensor,
    ) -> nibble_core::Result<nibble_cpu::CpuWeight> {
        self.cpu.load_weight(t)
    }
    fn embed(
        &self,
        table: &nibble_cpu::CpuWeight,
        ids: &[u32],
    ) -> nibble_core::Result<nibble_cpu::CpuTensor> {
        self.cpu.embed(table, ids)
    }
    fn begin_forward(
        &self,
        tokens: &[u32],
        batch: &nibble_model::BatchLayout,
    ) -> nibble_core::Result<()> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(nibble_core::Error::InvalidArgument(
                "injected step failure".into(),
            ));
        }
        self.cpu.begin_forward(tokens, batch)
    }
}

/// A step that fails fails its requests. A lone engine then serves the next ones; rank 0 of a
/// tensor-parallel group stops for good (its ranks' sequences no longer match), which ends
/// `serve` with the reason, and later requests get a clear error rather than a hang.
#[tokio::test]
async fn a_failed_step_stops_a_group_leader_and_not_a_lone_engine() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    for leads in [false, true] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../nibble-model/tests/fixtures/tiny-qwen2");
        let files = open_model(&dir, None).unwrap();
        let fail = Arc::new(AtomicBool::new(true));
        let backend = Faulty {
            cpu: CpuBackend::new(1).unwrap(),
            fail: fail.clone(),
        };
        let model =
            Transformer::load(&backend, files.config, &*files.source, &mut |_, _| {}).unwrap();
        let mut engine =
            LlmEngine::new(backend, model, files.tokenizer, EngineConfig::default()).unwrap();
        if leads {
            // Rank 0 of a group whose other ranks are not listening.
            engine.mirror_to(Box::new(|_| {}));
        }
        let state = crate::start(engine, "tiny".into(), None, Limits::default()).unwrap();
        let handle = state.engine.clone();
        let app = router(state);
        let body = json!({"prompt": "Hello", "max_tokens": 4});
        let (status, text) = post(&app, "/v1/completions", body.clone()).await;
        assert_ne!(status, StatusCode::OK, "leads {leads}: {text}");
        fail.store(false, Ordering::SeqCst);
        if leads {
            tokio::time::timeout(std::time::Duration::from_secs(10), handle.stopped())
                .await
                .expect("the engine stops");
            let reason = handle.failure().unwrap();
            assert!(
                reason.contains("tensor-parallel") && reason.contains("injected step failure"),
                "{reason}"
            );
            let (status, text) = post(&app, "/v1/completions", body).await;
            assert_ne!(status, StatusCode::OK, "{text}");
            assert!(text.contains("stopped"), "{text}");
        } else {
            ok(&app, "/v1/completions", body).await;
            assert_eq!(handle.failure(), None);
        }
    }
}

#[path = "structured_tests.rs"]
mod structured;

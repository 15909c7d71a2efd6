//! `run_serve_bench` against a mock OpenAI-style server on 127.0.0.1 that streams chunks with
//! known delays. Prompt words steer the mock: REFUSE (429), UNAVAILABLE (503), FAIL (500),
//! STREAMERR (an error event mid-stream), DOUBLE (two tokens a chunk, counted by `usage`),
//! HANG (never answers).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use nibble_bench::{Endpoint, Outcome, Sample, ServeBenchConfig, run_serve_bench};
use serde_json::{Value, json};

const TTFT_MS: u64 = 60;
const ITL_MS: u64 = 15;
const MODEL: &str = "mock-model";

#[derive(Default)]
struct Mock {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// (Authorization header, body) of every request.
    seen: Mutex<Vec<(Option<String>, Value)>>,
}

/// Counts a streaming response as in flight until its body is dropped.
struct InFlight(Arc<Mock>);

impl InFlight {
    fn new(m: Arc<Mock>) -> Self {
        let now = m.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        m.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(m)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
}

async fn completions(State(m): State<Arc<Mock>>, h: HeaderMap, Json(b): Json<Value>) -> Response {
    respond(m, h, b, false)
}

async fn chat(State(m): State<Arc<Mock>>, h: HeaderMap, Json(b): Json<Value>) -> Response {
    respond(m, h, b, true)
}

fn respond(m: Arc<Mock>, headers: HeaderMap, body: Value, chat: bool) -> Response {
    let auth = headers
        .get("authorization")
        .map(|v| v.to_str().unwrap().to_string());
    m.seen.lock().unwrap().push((auth, body.clone()));
    if body["model"] != MODEL {
        return (StatusCode::NOT_FOUND, "no such model").into_response();
    }
    let prompt = if chat {
        body["messages"][0]["content"].as_str()
    } else {
        body["prompt"].as_str()
    }
    .unwrap_or_default()
    .to_string();
    for (word, status) in [
        ("REFUSE", StatusCode::TOO_MANY_REQUESTS),
        ("UNAVAILABLE", StatusCode::SERVICE_UNAVAILABLE),
        ("FAIL", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        if prompt.contains(word) {
            return (status, format!("mock says {word}")).into_response();
        }
    }
    let k = body["max_tokens"].as_u64().unwrap() as usize;
    let chunk = |text: &str| {
        if chat {
            json!({"choices": [{"index": 0, "delta": {"content": text}}]})
        } else {
            json!({"choices": [{"index": 0, "text": text}]})
        }
    };
    // (delay before, event)
    let mut events: Vec<(u64, Value)> = Vec::new();
    if chat {
        events.push((
            0,
            json!({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        ));
    } else {
        events.push((0, chunk(""))); // an empty chunk (a special token) is not a token
    }
    let hang = prompt.contains("HANG");
    let per_chunk = if prompt.contains("DOUBLE") { 2 } else { 1 };
    for i in 0..k.div_ceil(per_chunk) {
        let delay = if i == 0 { TTFT_MS } else { ITL_MS };
        events.push((if hang { 60_000 } else { delay }, chunk(&format!(" t{i}"))));
        if i == 1 && prompt.contains("STREAMERR") {
            events.push((0, json!({"error": {"message": "engine died", "code": 500}})));
        }
    }
    // The usage chunk, only when asked for and only on /v1/completions (the chat mock counts on
    // the client counting chunks).
    if body["stream_options"]["include_usage"] == true && !chat {
        events.push((0, json!({"choices": [], "usage": {"completion_tokens": k}})));
    }
    let mut lines: Vec<(u64, String)> = events
        .into_iter()
        .map(|(d, v)| (d, format!("data: {v}\n\n")))
        .collect();
    lines.push((0, "data: [DONE]\n\n".into()));
    let guard = InFlight::new(m);
    let stream =
        futures_util::stream::unfold((lines.into_iter(), guard), |(mut it, guard)| async move {
            let (delay, line) = it.next()?;
            tokio::time::sleep(Duration::from_millis(delay)).await;
            Some((Ok::<_, std::convert::Infallible>(line), (it, guard)))
        });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn start_mock() -> (String, Arc<Mock>) {
    let mock = Arc::new(Mock::default());
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), mock)
}

fn sample(prompt: &str, prompt_len: usize, output_len: usize) -> Sample {
    Sample {
        prompt: prompt.into(),
        prompt_len,
        output_len,
    }
}

fn config(base_url: &str) -> ServeBenchConfig {
    ServeBenchConfig {
        base_url: base_url.into(),
        model: Some(MODEL.into()),
        progress: false,
        timeout: Duration::from_secs(8),
        ..Default::default()
    }
}

/// Mean of `stats` lies in [lo, hi] ms.
fn assert_between(what: &str, got: f64, lo: f64, hi: f64) {
    assert!(
        (lo..=hi).contains(&got),
        "{what} = {got:.2} ms, expected {lo}..{hi}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_counts_tokens_and_timing() {
    let (url, mock) = start_mock().await;
    let mut samples: Vec<Sample> = (0..6)
        .map(|i| sample(&format!("prompt {i}"), 10 + i, 5))
        .collect();
    samples.push(sample("please REFUSE", 7, 5));
    samples.push(sample("REFUSE again", 8, 5));
    samples.push(sample("UNAVAILABLE", 9, 5));
    samples.push(sample("FAIL now", 11, 5));
    samples.push(sample("STREAMERR", 12, 5));
    samples.push(sample("DOUBLE", 13, 6));
    let cfg = ServeBenchConfig {
        max_concurrency: Some(3),
        api_key: Some("sekrit-key".into()),
        ..config(&format!("{url}/v1"))
    };
    let r = run_serve_bench(cfg, samples).await.unwrap();

    assert_eq!(r.num_prompts, 12);
    assert_eq!(r.sent, 12);
    assert_eq!(r.not_sent, 0);
    assert_eq!((r.completed, r.refused, r.failed), (7, 3, 2), "{r:#?}");
    assert_eq!(r.completed + r.refused + r.failed, r.sent);
    assert_eq!(r.total_output_tokens, 6 * 5 + 6);
    assert_eq!(r.total_input_tokens, (10..16).sum::<usize>() + 13);
    let by_index = |i: usize| &r.requests[i];
    assert_eq!(by_index(11).output_tokens, 6, "usage wins over 3 chunks");
    assert_eq!(by_index(6).http_status, Some(429));
    assert_eq!(by_index(8).outcome, Outcome::Refused);
    assert_eq!(by_index(9).http_status, Some(500));
    assert!(
        by_index(9)
            .error
            .as_deref()
            .unwrap()
            .contains("mock says FAIL")
    );
    assert!(
        by_index(10)
            .error
            .as_deref()
            .unwrap()
            .contains("engine died")
    );
    assert!(
        r.errors
            .iter()
            .any(|e| e.count == 2 && e.http_status == Some(429))
    );

    let ttft = r.ttft_ms.as_ref().unwrap();
    assert_eq!(ttft.count, 7);
    assert_between(
        "TTFT mean",
        ttft.mean,
        TTFT_MS as f64 * 0.95,
        TTFT_MS as f64 + 80.0,
    );
    let itl = r.itl_ms.as_ref().unwrap();
    assert_eq!(itl.count, 6 * 4 + 2);
    assert_between(
        "ITL mean",
        itl.mean,
        ITL_MS as f64 * 0.8,
        ITL_MS as f64 + 40.0,
    );
    let tpot = r.tpot_ms.as_ref().unwrap();
    assert_eq!(tpot.count, 7);
    assert_between(
        "TPOT p50",
        tpot.p50,
        ITL_MS as f64 * 0.9,
        ITL_MS as f64 + 40.0,
    );
    let e2e = r.e2el_ms.as_ref().unwrap();
    let expect = (TTFT_MS + 4 * ITL_MS) as f64;
    assert_between("E2E p50", e2e.p50, expect * 0.95, expect + 100.0);
    assert!(r.output_throughput > 0.0 && r.request_throughput > 0.0);
    assert!((r.request_throughput * r.duration_s - 7.0).abs() < 1e-9);

    // Requests went in sample order.
    let sent: Vec<f64> = r.requests.iter().map(|q| q.sent_at_s.unwrap()).collect();
    assert!(sent.windows(2).all(|w| w[0] <= w[1]), "{sent:?}");
    // The concurrency limit held, and each request carried the fields a vLLM server wants.
    let max = mock.max_in_flight.load(Ordering::SeqCst);
    assert!((1..=3).contains(&max), "max in flight {max}");
    let seen = mock.seen.lock().unwrap();
    assert_eq!(seen.len(), 12);
    for (auth, b) in seen.iter() {
        assert_eq!(auth.as_deref(), Some("Bearer sekrit-key"));
        assert_eq!(b["stream"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["model"], MODEL);
        assert!(b["max_tokens"] == 5 || b["max_tokens"] == 6);
    }

    // The JSON has the numbers and the config, and not the key.
    let j = serde_json::to_string(&r).unwrap();
    assert!(!j.contains("sekrit"));
    assert!(!format!("{r:?}").contains("sekrit"));
    let v: Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v["config"]["request_rate"], "inf");
    assert_eq!(v["config"]["max_concurrency"], 3);
    assert_eq!(v["completed"], 7);
    assert!(v["ttft_ms"]["p99"].as_f64().unwrap() >= v["ttft_ms"]["p50"].as_f64().unwrap());
    let table = r.table();
    for needle in [
        "TTFT",
        "TPOT",
        "ITL",
        "E2E",
        "Refused (429/503)",
        "mock says FAIL",
    ] {
        assert!(table.contains(needle), "{needle} missing from\n{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_counts_content_chunks_and_finds_the_model() {
    let (url, mock) = start_mock().await;
    let samples: Vec<Sample> = (0..4)
        .map(|i| sample(&format!("hi {i}"), 5, 4 + i))
        .collect();
    let cfg = ServeBenchConfig {
        endpoint: Endpoint::Chat,
        model: None,
        ..config(&url)
    };
    let r = run_serve_bench(cfg, samples).await.unwrap();
    assert_eq!(r.model, MODEL);
    assert_eq!(
        (r.completed, r.refused, r.failed),
        (4, 0, 0),
        "{:?}",
        r.errors
    );
    // No usage from the chat mock: content chunks are counted, the role-only chunk is not.
    assert_eq!(r.total_output_tokens, 4 + 5 + 6 + 7);
    let ttft = r.ttft_ms.as_ref().unwrap();
    assert!(ttft.p50 >= TTFT_MS as f64 * 0.95, "{ttft:?}");
    assert_eq!(r.itl_ms.as_ref().unwrap().count, 3 + 4 + 5 + 6);
    // All at once: every stream was open together.
    assert_eq!(mock.max_in_flight.load(Ordering::SeqCst), 4);
    let seen = mock.seen.lock().unwrap();
    assert!(seen.iter().all(|(auth, b)| auth.is_none()
        && b["messages"][0]["role"] == "user"
        && b["max_completion_tokens"] == b["max_tokens"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_schedule_and_the_timeout() {
    let (url, _mock) = start_mock().await;
    let (n, rate, seed, timeout) = (30, 20.0, 3, Duration::from_millis(1000));
    let offsets = nibble_bench::serve::arrival_offsets(n, rate, seed);
    let mut samples: Vec<Sample> = (0..n).map(|i| sample(&format!("p{i}"), 6, 4)).collect();
    samples[1] = sample("HANG", 6, 4);
    let cfg = ServeBenchConfig {
        request_rate: rate,
        seed,
        timeout,
        ..config(&url)
    };
    let t0 = std::time::Instant::now();
    let r = run_serve_bench(cfg, samples).await.unwrap();
    let wall = t0.elapsed();
    assert!(wall < timeout + Duration::from_millis(500), "{wall:?}");

    let late = offsets.iter().filter(|o| **o >= timeout).count();
    let nearly = offsets
        .iter()
        .filter(|o| **o >= timeout - Duration::from_millis(50))
        .count();
    assert!(
        late > 0 && late < n - 5,
        "pick a schedule that crosses the timeout"
    );
    assert!(
        (late..=nearly).contains(&r.not_sent),
        "{} not sent",
        r.not_sent
    );
    assert_eq!(r.sent + r.not_sent, n);
    assert_eq!(r.completed + r.refused + r.failed, r.sent);
    let hang = &r.requests[1];
    assert_eq!(hang.outcome, Outcome::Failed);
    assert!(hang.error.as_deref().unwrap().contains("timed out"));
    // Everything sent well before the end completed.
    let early = offsets
        .iter()
        .filter(|o| **o + Duration::from_millis(400) < timeout)
        .count();
    assert!(
        r.completed >= early - 1,
        "{} completed, {early} early",
        r.completed
    );
    // Requests left on the Poisson schedule (never before their time, not much after).
    for (rec, off) in r.requests.iter().zip(&offsets) {
        if let Some(at) = rec.sent_at_s {
            let off = off.as_secs_f64();
            assert!(
                at >= off - 0.002 && at < off + 0.1,
                "sent at {at}, due {off}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_queue_and_the_timeout() {
    let (url, _mock) = start_mock().await;
    let mut samples: Vec<Sample> = (0..4).map(|i| sample(&format!("p{i}"), 6, 4)).collect();
    samples[0] = sample("HANG", 6, 4);
    let cfg = ServeBenchConfig {
        max_concurrency: Some(1),
        timeout: Duration::from_millis(400),
        ..config(&url)
    };
    let r = run_serve_bench(cfg, samples).await.unwrap();
    assert_eq!((r.sent, r.failed, r.not_sent), (1, 1, 3), "{r:#?}");
    assert_eq!(r.completed, 0);
    assert!(r.ttft_ms.is_none() && r.itl_ms.is_none());
    assert_eq!(r.request_throughput, 0.0);
    assert!(r.table().contains("Not sent"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_and_wrong_model_fail_every_request() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let samples: Vec<Sample> = (0..3).map(|i| sample(&format!("p{i}"), 6, 4)).collect();
    let r = run_serve_bench(config(&format!("http://127.0.0.1:{port}")), samples.clone())
        .await
        .unwrap();
    assert_eq!((r.sent, r.failed, r.completed), (3, 3, 0));
    assert!(r.requests.iter().all(|q| q.http_status.is_none()));
    // Without --served-model-name, an unreachable server is an error that says what to pass.
    let cfg = ServeBenchConfig {
        model: None,
        ..config(&format!("http://127.0.0.1:{port}"))
    };
    let err = run_serve_bench(cfg, samples.clone()).await.unwrap_err();
    assert!(
        format!("{err:#}").contains("--served-model-name"),
        "{err:#}"
    );

    let (url, _mock) = start_mock().await;
    let cfg = ServeBenchConfig {
        model: Some("other".into()),
        ..config(&url)
    };
    let r = run_serve_bench(cfg, samples).await.unwrap();
    assert_eq!((r.failed, r.refused), (3, 0));
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.errors[0].http_status, Some(404));
}

//! The connection layer over a real socket: what hyper would answer with an empty body comes
//! back in OpenAI's shape, and slow or idle connections are cut off on time.

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

const TIMEOUT: Duration = Duration::from_millis(600);

async fn start() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = crate::front_door::with_json_errors(Router::new().route("/", get(|| async { "ok" })));
    let limits = Limits {
        header_timeout: TIMEOUT,
        max_header_bytes: 4096,
        ..Limits::default()
    };
    tokio::spawn(async move { serve(listener, app, &limits, std::future::pending()).await });
    addr
}

/// Sends `bytes` and reads until the server closes (or 5 s pass).
async fn exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> (String, Duration) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let t0 = Instant::now();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    (String::from_utf8_lossy(&out).into_owned(), t0.elapsed())
}

/// The status and the `error` object of a response that must be OpenAI-shaped JSON.
fn openai_error(response: &str) -> (u16, Value) {
    let (head, body) = response.split_once("\r\n\r\n").expect(response);
    let status: u16 = head[9..12].parse().unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let v: Value = serde_json::from_str(body).expect(body);
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    (status, e.clone())
}

/// Cut off at the timeout: not before (the client's clock starts a moment after the server's),
/// and not much after.
fn on_time(took: Duration) -> bool {
    took >= TIMEOUT - Duration::from_millis(50) && took < TIMEOUT * 3
}

#[tokio::test]
async fn hyper_parse_errors_come_back_as_json() {
    let addr = start().await;
    for (request, status, code) in [
        (&b"NOT A REQUEST\r\n\r\n"[..], 400, "invalid_http_request"),
        (
            b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
            400,
            "invalid_http_request",
        ),
        (b"G\x01T / HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),
    ] {
        let (response, _) = exchange(addr, request).await;
        let (s, e) = openai_error(&response);
        assert_eq!(
            (s, e["code"].as_str().unwrap()),
            (status, code),
            "{response}"
        );
    }
    let big = format!("GET / HTTP/1.1\r\nx-big: {}\r\n\r\n", "a".repeat(5000));
    let (s, e) = openai_error(&exchange(addr, big.as_bytes()).await.0);
    assert_eq!((s, e["code"].as_str().unwrap()), (431, "headers_too_large"));
    let many: String = (0..120).map(|i| format!("x-{i}: 1\r\n")).collect();
    let req = format!("GET / HTTP/1.1\r\n{many}\r\n");
    let (s, _) = openai_error(&exchange(addr, req.as_bytes()).await.0);
    assert_eq!(s, 431);
    // Routing errors are the router's, in the same shape.
    let req = format!(
        "GET /{} HTTP/1.1\r\nConnection: close\r\n\r\n",
        "a".repeat(300)
    );
    let (s, e) = openai_error(&exchange(addr, req.as_bytes()).await.0);
    assert_eq!((s, e["code"].as_str().unwrap()), (404, "invalid_request"));
    let req = b"DELETE / HTTP/1.1\r\nConnection: close\r\n\r\n";
    let response = exchange(addr, req).await.0;
    let (s, e) = openai_error(&response);
    assert_eq!(
        (s, e["code"].as_str().unwrap()),
        (405, "method_not_allowed")
    );
    assert!(
        response.to_ascii_lowercase().contains("allow: get,head"),
        "{response}"
    );
}

#[tokio::test]
async fn a_partial_head_gets_408_and_an_idle_connection_is_closed() {
    let addr = start().await;
    let (response, took) = exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n").await;
    let (s, e) = openai_error(&response);
    assert_eq!((s, e["code"].as_str().unwrap()), (408, "request_timeout"));
    assert!(on_time(took), "{took:?}");
    let (response, took) = exchange(addr, b"").await;
    assert_eq!(response, "");
    assert!(on_time(took), "{took:?}");
    // After a served request the keep-alive connection idles out the same way.
    let (response, took) = exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        response.starts_with("HTTP/1.1 200") && response.ends_with("ok"),
        "{response}"
    );
    assert!(on_time(took), "{took:?}");
}

#[tokio::test]
async fn a_slow_client_does_not_hold_up_others() {
    let addr = start().await;
    let slow = tokio::spawn(async move {
        let (mut r, mut w) = TcpStream::connect(addr).await.unwrap().into_split();
        let t0 = Instant::now();
        // Keeps sending a byte every 50 ms; the answer and the close come meanwhile.
        let writer = tokio::spawn(async move {
            for b in b"GET / HTTP/1.1\r\nHost: slowloris\r\nX-A: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
                if w.write_all(&[*b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let mut out = Vec::new();
        let _ = r.read_to_end(&mut out).await;
        writer.abort();
        (t0.elapsed(), String::from_utf8_lossy(&out).into_owned())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let (ok, _) = exchange(addr, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(t0.elapsed() < TIMEOUT / 2);
    let (took, response) = slow.await.unwrap();
    // Cut off at the header timeout although it kept sending a byte every 50 ms.
    assert!(took < TIMEOUT * 3, "{took:?}");
    assert_eq!(openai_error(&response).0, 408);
}

#[test]
fn only_hyper_automatic_responses_are_replaced() {
    let hyper_431 =
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
    let r = String::from_utf8(replacement(hyper_431).unwrap()).unwrap();
    assert_eq!(openai_error(&r).0, 431);
    assert!(r.contains("connection: close"));
    for not_hyper in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..],
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 10\r\n\r\n",
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}",
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n",
        b"data: HTTP/1.1 400 \r\ncontent-length: 0\r\n\r\n",
    ] {
        assert!(replacement(not_hyper).is_none());
    }
}

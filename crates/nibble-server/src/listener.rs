//! The connection layer: hyper's HTTP/1 server driven directly (rather than through
//! `axum::serve`) so that nibble sets its limits and answers what hyper answers by itself.
//!
//! * **Header timeout.** A connection must deliver each request head within `--header-timeout`,
//!   counted from when the server starts waiting for it, so an idle keep-alive connection is
//!   closed after the same time. One that sent part of a head gets a 408 in OpenAI's shape; an
//!   idle one is closed silently (a 408 there could be read as the answer to a request the
//!   client is about to send).
//! * **Head size.** A head over `--max-header-bytes` (or with over 100 headers) gets 431.
//! * **Error bodies.** hyper answers a head it cannot parse (400), one too large (431) or a URI
//!   over 64 KiB (414) itself, with an empty body, and has no hook to change that. [`JsonErrors`]
//!   sits between hyper and the socket and replaces exactly those responses with OpenAI-shaped
//!   ones. It can tell them apart because nibble's own 400s, 414s and 431s always have a body,
//!   and hyper's automatic ones always say `content-length: 0`.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt;

use crate::Limits;
use crate::error::raw_response;

/// Accepts connections until `shutdown` resolves, then lets the open ones finish their
/// requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &Limits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_header_bytes)
        // One contiguous buffer per write: JsonErrors then sees each response head whole.
        .writev(false);
    let (stop, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    eprintln!("nibble serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(
            builder.clone(),
            stream,
            app.clone(),
            limits.header_timeout,
            stopping.clone(),
        ));
    }
    drop(stopping);
    let _ = stop.send(true);
    // Every connection task holds a receiver; they are all gone when the last one ends.
    stop.closed().await;
    Ok(())
}

/// Serves one connection; `stopping` turns to `true` for a graceful shutdown.
async fn connection(
    builder: http1::Builder,
    stream: TcpStream,
    app: Router,
    header_timeout: Duration,
    mut stopping: watch::Receiver<bool>,
) -> io::Result<()> {
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        // Boxed so the connection is `Unpin` and can be taken apart after an error.
        Box::pin(app.clone().oneshot(req))
    });
    let mut conn = builder.serve_connection(TokioIo::new(JsonErrors::new(stream)), service);
    let mut draining = false;
    let result = loop {
        tokio::select! {
            r = poll_fn(|cx| Pin::new(&mut conn).poll_without_shutdown(cx)) => break r,
            _ = stopping.changed(), if !draining => {
                draining = true;
                Pin::new(&mut conn).graceful_shutdown();
            }
        }
    };
    let parts = conn.into_parts();
    let mut io = parts.io.into_inner();
    if let Err(e) = result
        && e.is_timeout()
        && !parts.read_buf.is_empty()
    {
        let reply = raw_response(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            &format!(
                "The request head did not arrive within {} s (--header-timeout).",
                header_timeout.as_secs_f64()
            ),
        );
        let _ = io.write_all(&reply).await;
    }
    // Sends whatever JsonErrors still owes, then FIN.
    tokio::time::timeout(LINGER, io.shutdown())
        .await
        .unwrap_or(Ok(()))?;
    // A refused request may still be arriving (a body over the limit). Closing a socket with
    // unread data makes the kernel send a reset, which can destroy the answer before the client
    // reads it; so read and drop what comes, for a little while, as nginx's lingering close does.
    let mut sink = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + LINGER;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, io.read(&mut sink)).await
        && n > 0
    {}
    Ok(())
}

/// How long a closing connection waits for the client to take its last answer.
const LINGER: Duration = Duration::from_secs(2);

/// The socket as hyper sees it, with hyper's empty-bodied automatic error responses replaced
/// by OpenAI-shaped ones (see the module's comment).
pub struct JsonErrors<T> {
    inner: T,
    /// A replacement response not yet written out, and how much of it is.
    owed: Vec<u8>,
    sent: usize,
}

impl<T: AsyncWrite + Unpin> JsonErrors<T> {
    pub fn new(inner: T) -> Self {
        JsonErrors {
            inner,
            owed: Vec::new(),
            sent: 0,
        }
    }

    fn poll_pay(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.owed.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.owed[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.owed.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

/// The OpenAI-shaped response to send instead of `buf`, if `buf` is one of hyper's automatic
/// error responses: a whole head, status 400, 414 or 431, `content-length: 0`, nothing after.
pub fn replacement(buf: &[u8]) -> Option<Vec<u8>> {
    let status = buf.strip_prefix(b"HTTP/1.1 ")?.get(..4)?;
    let (status, code, message) = match status {
        b"400 " => (
            StatusCode::BAD_REQUEST,
            "invalid_http_request",
            "The request is not valid HTTP/1.1: the request line or a header is malformed.",
        ),
        b"414 " => (
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            "The request URI is longer than the server takes.",
        ),
        b"431 " => (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            "The request head is larger than the server takes (--max-header-bytes), or has more than 100 headers.",
        ),
        _ => return None,
    };
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let empty = buf[..head_end]
        .to_ascii_lowercase()
        .windows(21)
        .any(|w| w == b"\r\ncontent-length: 0\r\n");
    (head_end == buf.len() && empty).then(|| raw_response(status, code, message))
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pay(cx))?;
        if let Some(reply) = replacement(buf) {
            // Take hyper's bytes as written and owe ours; flush and shutdown pay the debt.
            self.owed = reply;
            if let Poll::Ready(Err(e)) = self.poll_pay(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pay(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pay(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[path = "listener_tests.rs"]
mod tests;

//! The router's front door, the checks every request passes before a handler sees it:
//!
//! 1. the URI is at most [`MAX_URI_BYTES`] (414);
//! 2. a POST to `/v1` is `application/json` (415): a web page can make a browser POST
//!    `text/plain`, a form or multipart to a loopback server without a CORS preflight, and must
//!    not be able to run requests on it;
//! 3. the API key, when the server has one (401);
//! 4. the body is read whole, within the size limit (413) and the body timeout (408), before
//!    anything is validated or reaches the engine: a slow client holds a connection and a
//!    task, never an engine slot.
//!
//! Whatever error a layer below answers without OpenAI's JSON shape (axum's 405, for one) is
//! rewritten into it on the way out.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::AppState;
use crate::error::{ApiError, ApiResult};

/// The longest request target (path and query) served; longer ones get 414. The whole request
/// head is bounded separately by `--max-header-bytes` (431, in `listener`).
pub const MAX_URI_BYTES: usize = 8192;

/// `routes` behind [`http_errors`]. Around the whole router rather than as its layer: a layer
/// runs inside each route, before axum adds the `Allow` header to a 405.
pub fn with_json_errors(routes: Router) -> Router {
    Router::new()
        .fallback_service(routes)
        .layer(axum::middleware::from_fn(http_errors))
}

/// Outermost layer: the URI length, then OpenAI's shape for every error response.
async fn http_errors(req: Request, next: Next) -> Response {
    let uri_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if uri_len > MAX_URI_BYTES {
        return ApiError::client(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            format!(
                "The request URI is {uri_len} bytes; this server takes at most {MAX_URI_BYTES}."
            ),
        )
        .into_response();
    }
    let method = req.method().clone();
    let path = short(req.uri().path());
    let response = next.run(req).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let error = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = response
                .headers()
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            ApiError::client(
                status,
                "method_not_allowed",
                format!("{method} is not allowed on {path}; it takes {allowed}."),
            )
        }
        s if s.is_server_error() => ApiError::new(s, reason(s), "server_error"),
        s => ApiError::client(s, "invalid_request", reason(s)),
    };
    let (parts, _) = response.into_parts();
    let mut rewritten = error.into_response();
    // Keep what the original said besides its body (`Allow` on a 405, `Connection: close`).
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            rewritten.headers_mut().insert(name, value.clone());
        }
    }
    rewritten
}

/// The fallback route.
pub async fn not_found(req: Request) -> ApiError {
    ApiError::client(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "There is no route {} {}; this server serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
            req.method(),
            short(req.uri().path())
        ),
    )
}

/// Route layer of the `/v1` routes: content type, API key, whole body.
pub async fn admit(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match read_request(&state, req).await {
        Ok(req) => next.run(req).await,
        Err(e) => {
            state.engine.metrics.rejected.inc();
            e.into_response()
        }
    }
}

async fn read_request(state: &AppState, req: Request) -> ApiResult<Request> {
    if req.method() == Method::POST {
        json_content_type(req.headers())?;
    }
    authorize(state, req.headers())?;
    let (parts, body) = req.into_parts();
    let bytes = read_body(&parts.headers, body, state).await?;
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

fn json_content_type(headers: &HeaderMap) -> ApiResult<()> {
    let refuse = |what: String| {
        Err(ApiError::client(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("{what}; this server takes 'Content-Type: application/json' only."),
        )
        .param("content-type"))
    };
    let mut all = headers.get_all(header::CONTENT_TYPE).iter();
    let (Some(value), None) = (all.next(), all.next()) else {
        return refuse("The request has no single Content-Type".into());
    };
    let Ok(value) = value.to_str() else {
        return refuse("The Content-Type is not ASCII".into());
    };
    let mut fields = value.split(';');
    let essence = fields.next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return refuse(format!("The Content-Type is {:?}", short(value)));
    }
    // JSON is UTF-8 (RFC 8259); a charset parameter may say so and nothing else.
    for field in fields {
        if let Some((name, v)) = field.split_once('=')
            && name.trim().eq_ignore_ascii_case("charset")
            && !v.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
        {
            return refuse(format!("The Content-Type is {:?}", short(value)));
        }
    }
    Ok(())
}

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
        Err(ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Missing or incorrect API key.",
                "authentication_error",
            )
        })
    }
}

/// Reads the whole body within `--max-body-bytes` and `--body-timeout`. A refused body is not
/// read further, so the answer closes the connection.
async fn read_body(headers: &HeaderMap, body: Body, state: &AppState) -> ApiResult<Bytes> {
    let limit = state.limits.max_body_bytes;
    let too_large = || {
        ApiError::client(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("The request body is larger than {limit} bytes (--max-body-bytes)."),
        )
        .param("body")
        .closing()
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let timeout = state.limits.body_timeout;
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(e)) => Err(ApiError::client(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("The request body could not be read: {e}."),
        )
        .param("body")
        .closing()),
        Err(_) => Err(ApiError::client(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "The request body did not arrive within {} s (--body-timeout).",
                timeout.as_secs_f64()
            ),
        )
        .param("body")
        .closing()),
    }
}

fn reason(s: StatusCode) -> String {
    format!("{}.", s.canonical_reason().unwrap_or("Error"))
}

/// A client's string inside an error message, cut short.
fn short(s: &str) -> String {
    if s.len() <= 100 {
        return s.to_string();
    }
    let mut end = 100;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

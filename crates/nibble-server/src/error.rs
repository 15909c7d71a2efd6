//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error the
//! server answers: validation, routing, the HTTP layer and the engine.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    /// The offending field, as OpenAI names it: `temperature`, `messages[2].content[0].text`.
    /// `None` when the fault is not in a field (an unknown route, a wrong method).
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Answer with `Connection: close`: the rest of the request cannot be trusted or read.
    pub close: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            close: false,
        }
    }

    /// A 4xx of type `invalid_request_error`.
    pub fn client(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code: Some(code),
            ..ApiError::new(status, message, "invalid_request_error")
        }
    }

    /// A 400 about one field.
    pub fn bad(param: &str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::client(StatusCode::BAD_REQUEST, code, message).param(param)
    }

    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    pub fn invalid_type(param: &str, expected: &str, got: &Value) -> Self {
        ApiError::bad(
            param,
            "invalid_type",
            format!(
                "Invalid type for '{param}': expected {expected}, but got {} instead.",
                json_kind(got)
            ),
        )
    }

    pub fn invalid_value(param: &str, message: impl Into<String>) -> Self {
        ApiError::bad(
            param,
            "invalid_value",
            format!("Invalid value for '{param}': {}", message.into()),
        )
    }

    pub fn missing(param: &str) -> Self {
        ApiError::bad(
            param,
            "missing_required_parameter",
            format!("Missing required parameter: '{param}'."),
        )
    }

    pub fn unknown(param: &str) -> Self {
        ApiError::bad(
            param,
            "unknown_parameter",
            format!("Unknown parameter: '{param}'."),
        )
    }

    /// A field OpenAI defines but this server does not implement: refused rather than ignored,
    /// so a client never gets output that silently disregards what it asked for.
    pub fn unsupported(param: &str, why: &str) -> Self {
        ApiError::bad(
            param,
            "unsupported_parameter",
            format!("Unsupported parameter: '{param}' {why}."),
        )
    }

    /// The body of the error as OpenAI sends it.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind,
                         "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.close {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// JSON's name for the kind of a value, as error messages say it.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A complete HTTP/1.1 response carrying an OpenAI error, for the places below the router that
/// write bytes themselves (the connection layer in `listener`).
pub fn raw_response(status: StatusCode, code: &'static str, message: &str) -> Vec<u8> {
    let body = ApiError::client(status, code, message).body().to_string();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_str(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

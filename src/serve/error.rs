//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that goes
//! with them (docs/serve.md lists them).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// One failed request: its status, OpenAI error `type`, the parameter at fault and a machine-readable code.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// 400: the request is malformed or asks for something out of range.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.into());
        e
    }

    /// 400 without a single parameter at fault (malformed JSON, a prompt that does not fit, ...).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: a known parameter the server cannot honour with this value.
    pub fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::invalid(param, message);
        e.code = Some("unsupported_parameter");
        e
    }

    pub fn unauthorized() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "missing or incorrect API key: send it as `Authorization: Bearer KEY`",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn model_not_found(name: &str, served: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{name}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn not_found(path: &str) -> ApiError {
        let mut e = ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {path}"));
        e.code = Some("not_found");
        e
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed on this path")
    }

    pub fn too_large(limit: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"),
        );
        e.code = Some("request_too_large");
        e
    }

    pub fn queue_full(limit: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the server is busy: {limit} requests are running or queued (--max-concurrency + --max-queue); retry later"),
        );
        e.code = Some("queue_full");
        e.retry_after = Some(1);
        e
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message);
        e.retry_after = Some(5);
        e
    }

    /// 500: the engine failed on this request (the server and other requests carry on).
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The error object, as sent in a body or in one SSE event.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

//! Errors: [`ApiError`] is what a client sees (an HTTP status and OpenAI's error JSON);
//! [`IngressError`] is what the server itself can fail with (binding, serving, its TLS and API
//! key files).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvx_proto::ErrorClass;
use serde::Serialize;

use crate::dispatch::DispatchError;

/// A request's failure, rendered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
    /// Machine-readable code.
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (`Retry-After`).
    pub retry_after: Option<u32>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError { param, ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError { code: Some("invalid_api_key"), ..Self::new(StatusCode::UNAUTHORIZED, message) }
    }

    /// 403: an accepted key that may not use the endpoint.
    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError { code: Some("permission_denied"), ..Self::new(StatusCode::FORBIDDEN, message) }
    }

    /// 404 for a model name.
    pub fn model_not_found(name: &str) -> Self {
        ApiError {
            param: Some("model"),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("The model `{name}` does not exist or you do not have access to it."),
            )
        }
    }

    /// 404 for a path.
    pub fn no_route(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("No route for {path}"))
    }

    /// 405.
    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than the limit of {limit} bytes"),
            )
        }
    }

    /// 408: the request body did not arrive in time.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("request_timeout"),
            ..Self::new(StatusCode::REQUEST_TIMEOUT, message)
        }
    }

    /// 408: a stream's client left more than the bound unread; the request was cancelled.
    pub fn client_too_slow(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("client_too_slow"),
            ..Self::new(StatusCode::REQUEST_TIMEOUT, message)
        }
    }

    /// 408: the request's deadline (`timeout`) passed before it was served.
    pub fn deadline(message: impl Into<String>) -> Self {
        ApiError { code: Some("timeout"), ..Self::new(StatusCode::REQUEST_TIMEOUT, message) }
    }

    /// 429 from the admission queue, with `Retry-After: retry_after` (seconds, at least 1).
    pub fn queue_refused(message: impl Into<String>, retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after.max(1)),
            code: Some("overloaded"),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// 429 with `Retry-After`.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            retry_after: Some(1),
            code: Some("overloaded"),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// 429 for a key's limit, with `Retry-After: retry_after` (seconds).
    pub fn rate_limited(message: impl Into<String>, retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after.max(1)),
            code: Some("rate_limit_exceeded"),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { retry_after: Some(5), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message) }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// The error for a request-plane error class.
    pub fn from_class(class: ErrorClass, message: impl Into<String>) -> Self {
        let m = message.into();
        match class {
            ErrorClass::BadRequest => Self::bad_request(m, None),
            ErrorClass::NotFound => Self::new(StatusCode::NOT_FOUND, m),
            ErrorClass::Overloaded => Self::overloaded(m),
            ErrorClass::Unavailable => Self::unavailable(m),
            ErrorClass::Internal => Self::internal(m),
            ErrorClass::Timeout => Self::new(StatusCode::GATEWAY_TIMEOUT, m),
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 413 | 404 | 405 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            408 | 504 => "timeout",
            _ => "internal_error",
        }
    }

    /// The JSON body.
    pub fn json(&self) -> String {
        let b = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind(),
                param: self.param,
                code: self.code,
            },
        };
        serde_json::to_string(&b).unwrap_or_else(|_| "{\"error\":{}}".into())
    }
}

impl From<DispatchError> for ApiError {
    fn from(e: DispatchError) -> Self {
        match e {
            DispatchError::Overloaded(m) => ApiError::overloaded(m),
            DispatchError::Unavailable(m) => ApiError::unavailable(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, self.json()).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// Binding the listening socket failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
    /// The TLS certificate or key cannot be used.
    #[error("TLS certificate {cert} with key {key}: {why}")]
    Tls {
        /// The certificate chain file.
        cert: std::path::PathBuf,
        /// The private key file.
        key: std::path::PathBuf,
        /// What is wrong (it names the file at fault).
        why: kvx_trust::TrustError,
    },
    /// The API keys file cannot be read or has a bad line.
    #[error("API keys file {path}: {why}")]
    KeysFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_openai_shape() {
        let e = ApiError::model_not_found("x\"y");
        let v: serde_json::Value = serde_json::from_str(&e.json()).unwrap();
        assert_eq!(
            v["error"]["message"],
            "The model `x\"y` does not exist or you do not have access to it."
        );
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn classes_map_to_statuses() {
        for (c, s) in [
            (ErrorClass::BadRequest, 400),
            (ErrorClass::NotFound, 404),
            (ErrorClass::Overloaded, 429),
            (ErrorClass::Unavailable, 503),
            (ErrorClass::Internal, 500),
            (ErrorClass::Timeout, 504),
        ] {
            assert_eq!(ApiError::from_class(c, "m").status.as_u16(), s);
        }
        let r = ApiError::overloaded("full").into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let e = ApiError::rate_limited("slow down", 30);
        assert_eq!(
            (e.status.as_u16(), e.kind(), e.code),
            (429, "rate_limit_error", Some("rate_limit_exceeded"))
        );
        assert_eq!(e.into_response().headers()[header::RETRY_AFTER], "30");
        assert_eq!(ApiError::rate_limited("m", 0).retry_after, Some(1));
        let e = ApiError::forbidden("no");
        assert_eq!((e.status.as_u16(), e.kind()), (403, "permission_error"));
    }
}

//! The HTTP client: HTTP/1.1 connections (TCP_NODELAY) kept alive in the callers' [`Scratch`]
//! from one request to the next, timing every content chunk of the stream as it arrives.
//!
//! A closed-loop stream sends its requests on one connection for as long as the server keeps
//! it open; a new one is opened when it is closed, including by the client itself after a
//! response it did not read to the end (a timeout, a broken stream, an error status whose body
//! was still arriving). A request waits only on its own connection: connecting is bounded by
//! the connect timeout, and any other wait fails when that connection closes.

use std::fmt;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, HeaderName, HeaderValue};
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use crate::BenchError;
use crate::request::EndpointConfig;
use crate::sse::{SseParser, Usage, parse_chunk, unescape_json_str};

/// Largest non-streamed response body read.
const MAX_BODY_BYTES: usize = 64 << 20;

/// Why a request failed. Rendered as `connect`, `timeout`, `http_<status>`, `shed_<status>`,
/// `body`, `stream`, `incomplete` or `empty` in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorClass {
    /// The connection could not be made.
    Connect,
    /// The request did not finish within the timeout.
    Timeout,
    /// The server answered with a non-2xx status.
    Http(u16),
    /// The server shed the request: 429 or 503 with `Retry-After` (overload control working
    /// as designed, counted apart from failures that are not).
    Shed(u16),
    /// Sending the request or reading the response body failed (connection reset, ...).
    Body,
    /// The stream was malformed or carried an error object.
    Stream,
    /// The stream ended before `[DONE]` or a finish reason.
    Incomplete,
    /// The response finished without any generated text.
    Empty,
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connect => f.write_str("connect"),
            Self::Timeout => f.write_str("timeout"),
            Self::Http(s) => write!(f, "http_{s}"),
            Self::Shed(s) => write!(f, "shed_{s}"),
            Self::Body => f.write_str("body"),
            Self::Stream => f.write_str("stream"),
            Self::Incomplete => f.write_str("incomplete"),
            Self::Empty => f.write_str("empty"),
        }
    }
}

impl Serialize for ErrorClass {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ErrorClass {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Ok(match s.as_ref() {
            "connect" => Self::Connect,
            "timeout" => Self::Timeout,
            "body" => Self::Body,
            "stream" => Self::Stream,
            "incomplete" => Self::Incomplete,
            "empty" => Self::Empty,
            other => match (
                other.strip_prefix("http_").and_then(|c| c.parse().ok()),
                other.strip_prefix("shed_").and_then(|c| c.parse().ok()),
            ) {
                (Some(code), _) => Self::Http(code),
                (_, Some(code)) => Self::Shed(code),
                (None, None) => {
                    return Err(serde::de::Error::custom(format!("unknown error class {other}")));
                }
            },
        })
    }
}

/// Buffers reused from one request to the next by the same caller, so steady-state requests
/// allocate nothing per token.
#[derive(Debug, Default)]
pub struct Scratch {
    parser: SseParser,
    /// The caller's kept-alive connection, if it has one open.
    conn: Option<SendRequest<Full<Bytes>>>,
    /// Gaps between consecutive content chunks of the last request, in nanoseconds.
    pub gaps: Vec<u64>,
    /// Generated text of the last request (filled only when asked for).
    pub text: String,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// When the request was handed to the connection.
    pub start: Instant,
    /// When the first content chunk arrived.
    pub first_token: Option<Instant>,
    /// When the response ended (or failed).
    pub end: Instant,
    /// Chunks that carried generated text.
    pub content_chunks: u32,
    /// Usage reported by the server.
    pub usage: Option<Usage>,
    /// Set when the request failed.
    pub error: Option<ErrorClass>,
    /// Whether the request was sent a second time (its connection closed or was reset unanswered).
    pub resent: bool,
    /// The wait a shedding server asked for (`Retry-After` in seconds on a 429 or 503),
    /// at most [`MAX_RETRY_AFTER`].
    pub retry_after: Option<Duration>,
}

/// The longest `Retry-After` honoured; a larger one is read as this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A `Retry-After` header's delay in seconds (the HTTP-date form is not used by servers that
/// shed load, and is read as absent), at most [`MAX_RETRY_AFTER`].
fn retry_after(v: &HeaderValue) -> Option<Duration> {
    let secs: u64 = v.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER))
}

/// A client for one endpoint. Cheap to share behind an `Arc`; each caller brings its own
/// connection in its [`Scratch`].
#[derive(Debug)]
pub struct Client {
    uri: Uri,
    models_uri: Uri,
    /// `host:port` to connect to.
    addr: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    timeout: Duration,
    connect_timeout: Duration,
    stream: bool,
}

impl Client {
    /// A client for `endpoint`; every request is cut off after `timeout`.
    pub fn new(endpoint: &EndpointConfig, timeout: Duration) -> Result<Self, BenchError> {
        let (uri, models_uri) = resolve_uris(&endpoint.url, endpoint.api.default_path())?;
        let authority = uri.authority().ok_or_else(|| BenchError::config("no host"))?;
        let (name, port) = (authority.host(), authority.port_u16());
        let addr = format!("{name}:{}", port.unwrap_or(80));
        // `Host` is the host and port alone: never the URL's user information.
        let host = port.map_or_else(|| name.to_string(), |_| addr.clone());
        let host = HeaderValue::from_str(&host)
            .map_err(|_| BenchError::config("the host is not a valid header value"))?;
        let mut headers = vec![
            (HOST, host),
            (CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (
                ACCEPT,
                HeaderValue::from_static(if endpoint.stream {
                    "text/event-stream"
                } else {
                    "application/json"
                }),
            ),
        ];
        if let Some(key) = &endpoint.api_key {
            let v = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| BenchError::config("the API key is not a valid header value"))?;
            headers.push((AUTHORIZATION, v));
        }
        for (k, v) in &endpoint.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| BenchError::config(format!("bad header name {k:?}")))?;
            let value = HeaderValue::from_str(v)
                .map_err(|_| BenchError::config(format!("bad value for header {k}")))?;
            headers.push((name, value));
        }
        let connect_timeout = timeout.min(Duration::from_secs(30));
        Ok(Self {
            uri,
            models_uri,
            addr,
            headers,
            timeout,
            connect_timeout,
            stream: endpoint.stream,
        })
    }

    /// Opens a connection (TCP_NODELAY), starts its HTTP/1.1 driver and waits until it takes a
    /// request.
    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, ErrorClass> {
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&*self.addr))
            .await
            .map_err(|_| ErrorClass::Connect)?
            .map_err(|e| {
                tracing::debug!(error = ?e, addr = %self.addr, "connect failed");
                ErrorClass::Connect
            })?;
        // Small writes (requests) go out at once; a failure leaves Nagle's delay, not an error.
        let _ = tcp.set_nodelay(true);
        let (mut tx, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.map_err(|e| {
                tracing::debug!(error = ?e, "handshake failed");
                ErrorClass::Connect
            })?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = ?e, "connection ended");
            }
        });
        tx.ready().await.map_err(|e| {
            tracing::debug!(error = ?e, "connection closed before a request");
            ErrorClass::Connect
        })?;
        Ok(tx)
    }

    /// The URI requests go to.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// A request in origin form (the path; `Host` among the headers), as HTTP/1.1 sends it.
    fn request(&self, method: Method, uri: &Uri, body: Bytes) -> Result<Request<Full<Bytes>>, ()> {
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut b = Request::builder().method(method).uri(path);
        if let Some(h) = b.headers_mut() {
            h.reserve(self.headers.len());
            for (k, v) in &self.headers {
                h.insert(k.clone(), v.clone());
            }
        }
        b.body(Full::new(body)).map_err(|_| ())
    }

    /// Asks the server which models it serves (`GET /v1/models`) and returns the first.
    pub async fn first_model(&self) -> Result<String, BenchError> {
        let fail = |m: String| BenchError::config(format!("GET {}: {m}", self.models_uri));
        let req = self
            .request(Method::GET, &self.models_uri, Bytes::new())
            .map_err(|()| fail("bad request".into()))?;
        let body = tokio::time::timeout(self.timeout, async {
            let mut tx =
                self.connect().await.map_err(|_| format!("cannot connect to {}", self.addr))?;
            let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("status {}", resp.status()));
            }
            Limited::new(resp.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|_| fail("timed out".into()))?
        .map_err(fail)?;
        #[derive(Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(Deserialize)]
        struct Model {
            id: String,
        }
        let models: Models = serde_json::from_slice(&body).map_err(|e| fail(e.to_string()))?;
        models.data.into_iter().next().map(|m| m.id).ok_or_else(|| fail("no models".into()))
    }

    /// Sends one request and reads its response to the end. Gaps between content chunks go
    /// to `scratch.gaps`; the generated text goes to `scratch.text` when `want_text` is set
    /// (always for non-streamed responses).
    pub async fn send(&self, body: Bytes, scratch: &mut Scratch, want_text: bool) -> Outcome {
        scratch.gaps.clear();
        scratch.text.clear();
        scratch.parser.reset();
        let start = Instant::now();
        let mut st = StreamState::new(start);
        let result =
            tokio::time::timeout(self.timeout, self.exchange(body, scratch, want_text, &mut st))
                .await;
        let end = Instant::now();
        let error = match result {
            Err(_) => Some(ErrorClass::Timeout),
            Ok(Err(class)) => Some(class),
            Ok(Ok(())) => {
                if st.content_chunks == 0 && self.stream {
                    Some(ErrorClass::Empty)
                } else if self.stream && !st.done && !st.finished {
                    Some(ErrorClass::Incomplete)
                } else {
                    None
                }
            }
        };
        Outcome {
            start,
            first_token: st.first,
            end,
            content_chunks: st.content_chunks,
            usage: st.usage,
            error,
            resent: st.resent,
            retry_after: st.retry_after,
        }
    }

    async fn exchange(
        &self,
        body: Bytes,
        scratch: &mut Scratch,
        want_text: bool,
        st: &mut StreamState,
    ) -> Result<(), ErrorClass> {
        // A kept-alive connection the server closes (or resets) just as the request goes out
        // (servers cap requests per connection or idle time) fails without an answer: send
        // the request once more, on a fresh connection.
        let mut retried = false;
        let resp = loop {
            let req = self
                .request(Method::POST, &self.uri, body.clone())
                .map_err(|()| ErrorClass::Body)?;
            // The caller's connection, once it has read its last response to the end (a
            // closed one, or one that fails to get there, is replaced without a resend: the
            // request has not gone out).
            let kept = match scratch.conn.take() {
                Some(mut tx) if !tx.is_closed() => tx.ready().await.is_ok().then_some(tx),
                _ => None,
            };
            let mut tx = match kept {
                Some(tx) => tx,
                None => self.connect().await?,
            };
            match tx.send_request(req).await {
                Ok(resp) => {
                    scratch.conn = Some(tx);
                    break resp;
                }
                Err(e) if !retried && closed_before_response(&e) => {
                    tracing::debug!(error = ?e, "connection closed before a response; resending");
                    retried = true;
                    st.resent = true;
                }
                Err(e) => {
                    tracing::debug!(error = ?e, "request failed before a response");
                    return Err(ErrorClass::Body);
                }
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let code = status.as_u16();
            let after = resp.headers().get(http::header::RETRY_AFTER);
            let shed = matches!(code, 429 | 503) && after.is_some();
            if shed {
                st.retry_after = after.and_then(retry_after);
            }
            return Err(if shed { ErrorClass::Shed(code) } else { ErrorClass::Http(code) });
        }
        let mut body = resp.into_body();
        if !self.stream {
            let bytes = Limited::new(body, MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|_| ErrorClass::Body)?
                .to_bytes();
            return st.full_response(&bytes, &mut scratch.text);
        }
        let Scratch { parser, gaps, text, .. } = scratch;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                tracing::debug!(error = ?e, "response body failed");
                ErrorClass::Body
            })?;
            let Ok(data) = frame.into_data() else { continue };
            let now = Instant::now();
            parser
                .feed(&data, |ev| st.on_event(ev, now, gaps, text, want_text))
                .map_err(|_| ErrorClass::Stream)?;
            if st.bad {
                return Err(ErrorClass::Stream);
            }
        }
        let now = Instant::now();
        parser.finish(|ev| st.on_event(ev, now, gaps, text, want_text));
        if st.bad { Err(ErrorClass::Stream) } else { Ok(()) }
    }
}

/// Whether a request failed because the connection closed without an answer: before the
/// request was written (`canceled`), or after, with no response (`incomplete message`, or a
/// reset: a server that closes a socket holding a request it has not read resets it).
fn closed_before_response(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    if e.is_incomplete_message() || e.is_canceled() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe);
        }
        source = s.source();
    }
    false
}

/// Progress through one streamed response.
#[derive(Debug)]
struct StreamState {
    first: Option<Instant>,
    last: Instant,
    content_chunks: u32,
    usage: Option<Usage>,
    done: bool,
    finished: bool,
    bad: bool,
    resent: bool,
    retry_after: Option<Duration>,
}

impl StreamState {
    fn new(start: Instant) -> Self {
        Self {
            first: None,
            last: start,
            content_chunks: 0,
            usage: None,
            done: false,
            finished: false,
            bad: false,
            retry_after: None,
            resent: false,
        }
    }

    fn on_event(
        &mut self,
        data: &[u8],
        now: Instant,
        gaps: &mut Vec<u64>,
        text: &mut String,
        want_text: bool,
    ) {
        if self.done || self.bad {
            return;
        }
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        if data.is_empty() {
            return;
        }
        let Ok(chunk) = parse_chunk(data) else {
            self.bad = true;
            return;
        };
        if chunk.error {
            self.bad = true;
            return;
        }
        if chunk.has_content() {
            if self.first.is_none() {
                self.first = Some(now);
            } else {
                gaps.push(now.duration_since(self.last).as_nanos() as u64);
            }
            self.last = now;
            self.content_chunks = self.content_chunks.saturating_add(1);
            if want_text
                && let Some(raw) = chunk.content
                && !unescape_json_str(raw.get(), text)
            {
                self.bad = true;
            }
        }
        self.finished |= chunk.finished;
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
    }

    fn full_response(&mut self, body: &[u8], text: &mut String) -> Result<(), ErrorClass> {
        #[derive(Deserialize)]
        struct Full {
            #[serde(default)]
            choices: Vec<Choice>,
            #[serde(default)]
            usage: Option<Usage>,
        }
        #[derive(Deserialize)]
        struct Choice {
            #[serde(default)]
            message: Option<Message>,
            #[serde(default)]
            text: Option<String>,
        }
        #[derive(Deserialize)]
        struct Message {
            #[serde(default)]
            content: Option<String>,
        }
        let full: Full = serde_json::from_slice(body).map_err(|_| ErrorClass::Stream)?;
        let content = full
            .choices
            .into_iter()
            .next()
            .and_then(|c| c.message.and_then(|m| m.content).or(c.text));
        match content {
            Some(c) if !c.is_empty() => text.push_str(&c),
            _ => return Err(ErrorClass::Empty),
        }
        self.usage = full.usage;
        self.finished = true;
        Ok(())
    }
}

/// Resolves the request URI and the models URI from a base URL.
///
/// `http://h:p` and `http://h:p/` get the API's default path; `http://h:p/v1` gets the rest of
/// it; any other path is used as given.
pub fn resolve_uris(url: &str, default_path: &str) -> Result<(Uri, Uri), BenchError> {
    let bad = |m: &str| BenchError::config(format!("bad endpoint URL {url:?}: {m}"));
    let with_scheme = if url.contains("://") { url.to_string() } else { format!("http://{url}") };
    let uri: Uri = with_scheme.parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(_) => return Err(bad("only http:// is supported")),
        None => return Err(bad("no scheme")),
    }
    let authority = uri.authority().ok_or_else(|| bad("no host"))?.as_str();
    let path = uri.path().trim_end_matches('/');
    let full_path = if path.is_empty() {
        default_path.to_string()
    } else if path.ends_with("/v1") {
        format!("{path}{}", default_path.trim_start_matches("/v1"))
    } else {
        path.to_string()
    };
    let make = |p: &str| -> Result<Uri, BenchError> {
        format!("http://{authority}{p}").parse().map_err(|_| bad("bad path"))
    };
    let models = if path.ends_with("/v1") { format!("{path}/models") } else { "/v1/models".into() };
    Ok((make(&full_path)?, make(&models)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_read_in_seconds_and_capped() {
        let v = |s: &'static str| retry_after(&HeaderValue::from_static(s));
        assert_eq!(v("7"), Some(Duration::from_secs(7)));
        assert_eq!(v(" 0 "), Some(Duration::ZERO));
        assert_eq!(v("86400"), Some(MAX_RETRY_AFTER));
        assert_eq!(v("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(v("-1"), None);
    }

    #[test]
    fn urls_resolve_to_api_paths() {
        let p = "/v1/chat/completions";
        let r = |u| resolve_uris(u, p).map(|(a, b)| (a.to_string(), b.to_string()));
        assert_eq!(
            r("http://127.0.0.1:8000").unwrap(),
            (
                "http://127.0.0.1:8000/v1/chat/completions".into(),
                "http://127.0.0.1:8000/v1/models".into()
            )
        );
        assert_eq!(r("localhost:9/").unwrap().0, "http://localhost:9/v1/chat/completions");
        assert_eq!(
            r("http://h/api/v1").unwrap(),
            ("http://h/api/v1/chat/completions".into(), "http://h/api/v1/models".into())
        );
        assert_eq!(r("http://h/custom/gen").unwrap().0, "http://h/custom/gen");
        assert!(r("https://h").is_err());
        assert!(r("http://").is_err());
    }

    #[test]
    fn error_classes_round_trip_through_json() {
        for c in
            [ErrorClass::Connect, ErrorClass::Http(503), ErrorClass::Shed(429), ErrorClass::Empty]
        {
            let s = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<ErrorClass>(&s).unwrap(), c);
        }
        assert_eq!(ErrorClass::Http(429).to_string(), "http_429");
        assert_eq!(ErrorClass::Shed(503).to_string(), "shed_503");
        assert!(serde_json::from_str::<ErrorClass>("\"nope\"").is_err());
    }

    #[test]
    fn stream_state_times_content_chunks_and_reads_usage() {
        let t0 = Instant::now();
        let mut st = StreamState::new(t0);
        let (mut gaps, mut text) = (Vec::new(), String::new());
        let at = |ms| t0 + Duration::from_millis(ms);
        st.on_event(
            br#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
            at(1),
            &mut gaps,
            &mut text,
            true,
        );
        st.on_event(
            br#"{"choices":[{"delta":{"content":"a"}}]}"#,
            at(10),
            &mut gaps,
            &mut text,
            true,
        );
        st.on_event(
            br#"{"choices":[{"delta":{"content":"b\n"}}]}"#,
            at(13),
            &mut gaps,
            &mut text,
            true,
        );
        st.on_event(
            br#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            at(14),
            &mut gaps,
            &mut text,
            true,
        );
        st.on_event(
            br#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}"#,
            at(15),
            &mut gaps,
            &mut text,
            true,
        );
        st.on_event(b"[DONE]", at(16), &mut gaps, &mut text, true);
        st.on_event(
            br#"{"choices":[{"delta":{"content":"late"}}]}"#,
            at(17),
            &mut gaps,
            &mut text,
            true,
        );
        assert_eq!(st.first, Some(at(10)));
        assert_eq!(gaps, vec![3_000_000]);
        assert_eq!(text, "ab\n");
        assert_eq!(st.content_chunks, 2);
        assert!(st.done && st.finished && !st.bad);
        assert_eq!(st.usage.unwrap().completion_tokens, Some(2));
        st = StreamState::new(t0);
        st.on_event(b"{oops", at(1), &mut gaps, &mut text, false);
        assert!(st.bad);
    }
}

//! OpenAI-compatible test fixture server for kvx-bench's end-to-end tests and throughput checks.
//!
//! Tokenizer-free: a token is a whitespace-separated word of the prompt (chat messages' text
//! joined by spaces). It keeps a real prefix cache over blocks of `block_size` words (chained
//! block hashes, FIFO eviction) and reports hits as `usage.prompt_tokens_details.cached_tokens`.
//! Timing is a simple model: first token after `ttft + per_uncached_token * uncached words`,
//! then one word per `itl`. With all delays zero it is a zero-latency endpoint.
//! Not a model server: it generates the word `tok` over and over.

#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Fixture behaviour.
#[derive(Debug, Clone)]
pub struct FixtureConfig {
    /// Model name served.
    pub model: String,
    /// Words per prefix-cache block.
    pub block_size: usize,
    /// Blocks kept in the cache.
    pub cache_blocks: usize,
    /// Fixed part of the time to first token.
    pub ttft: Duration,
    /// Extra time to first token per uncached prompt word.
    pub per_uncached_token: Duration,
    /// Time between output tokens.
    pub itl: Duration,
    /// Answer every Nth request with 503.
    pub fail_every: Option<u64>,
    /// Shed every request: 429 with `Retry-After` of this many seconds.
    pub shed_retry_after: Option<u64>,
    /// Close each connection at its Nth POST instead of answering it, as a server that caps
    /// the requests of a kept-alive connection does when the client reuses it once more.
    pub close_at: Option<u64>,
    /// Close connections with a reset (`SO_LINGER` 0) instead of an orderly shutdown, as a
    /// server does that closes a socket holding a request it has not read.
    pub reset: bool,
    /// Report usage only when the request asks for it (`stream_options.include_usage`).
    pub usage_only_when_asked: bool,
}

impl Default for FixtureConfig {
    fn default() -> Self {
        Self {
            model: "fixture-model".into(),
            block_size: 16,
            cache_blocks: 1 << 20,
            ttft: Duration::ZERO,
            per_uncached_token: Duration::ZERO,
            itl: Duration::ZERO,
            fail_every: None,
            shed_retry_after: None,
            close_at: None,
            reset: false,
            usage_only_when_asked: true,
        }
    }
}

/// What the fixture saw, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// Prompt words.
    pub prompt_tokens: usize,
    /// Words served from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Default)]
struct PrefixCache {
    set: HashSet<u64>,
    order: VecDeque<u64>,
}

#[derive(Debug)]
struct State {
    cfg: FixtureConfig,
    cache: Mutex<PrefixCache>,
    log: Mutex<Vec<Seen>>,
    requests: AtomicU64,
    connections: AtomicU64,
}

impl State {
    /// Looks the prompt's blocks up, then stores them; returns the cached word count.
    fn prefix_lookup_and_store(&self, words: &[&str]) -> usize {
        let bs = self.cfg.block_size.max(1);
        let mut hashes = Vec::with_capacity(words.len() / bs);
        let mut parent = 0u64;
        for block in words.chunks_exact(bs) {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            hashes.push(parent);
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let hits = hashes.iter().take_while(|h| cache.set.contains(h)).count();
        for &h in &hashes[hits..] {
            if cache.set.insert(h) {
                cache.order.push_back(h);
            }
        }
        while cache.order.len() > self.cfg.cache_blocks {
            if let Some(old) = cache.order.pop_front() {
                cache.set.remove(&old);
            }
        }
        hits * bs
    }
}

/// A running fixture; stops when dropped.
#[derive(Debug)]
pub struct Fixture {
    /// Where it listens.
    pub addr: SocketAddr,
    state: Arc<State>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Fixture {
    /// Starts the fixture on 127.0.0.1 (a free port) on its own thread and runtime.
    pub fn start(cfg: FixtureConfig) -> Self {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        std_listener.set_nonblocking(true).expect("nonblocking listener");
        let addr = std_listener.local_addr().expect("local addr");
        let state = Arc::new(State {
            cfg,
            cache: Mutex::new(PrefixCache::default()),
            log: Mutex::new(Vec::new()),
            requests: AtomicU64::new(0),
            connections: AtomicU64::new(0),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("fixture runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).expect("tokio listener");
                tokio::select! {
                    _ = serve(listener, st) => {}
                    _ = stop_rx => {}
                }
            });
        });
        Self { addr, state, stop: Some(stop_tx), thread: Some(thread) }
    }

    /// Base URL, e.g. `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// Completion requests in arrival order.
    pub fn log(&self) -> Vec<Seen> {
        self.state.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves connections on `listener` forever.
pub async fn serve_forever(listener: TcpListener, cfg: FixtureConfig) {
    let state = Arc::new(State {
        cfg,
        cache: Mutex::new(PrefixCache::default()),
        log: Mutex::new(Vec::new()),
        requests: AtomicU64::new(0),
        connections: AtomicU64::new(0),
    });
    serve(listener, state).await;
}

async fn serve(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        if state.cfg.reset {
            let _ = stream.set_zero_linger();
        }
        state.connections.fetch_add(1, Ordering::Relaxed);
        let state = state.clone();
        tokio::spawn(async move {
            let posts = Arc::new(AtomicU64::new(0));
            let svc = service_fn(move |req| handle(state.clone(), posts.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// The injected failure of [`FixtureConfig::close_at`].
#[derive(Debug)]
pub struct Closed;

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection closed by the fixture")
    }
}

impl std::error::Error for Closed {}

/// A response body fed by a channel (streamed responses with delays).
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<BoxBody> {
    let mut resp = Response::new(Full::new(body.into()).boxed_unsync());
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

fn prompt_text(v: &Value) -> String {
    if let Some(p) = v.get("prompt").and_then(Value::as_str) {
        return p.to_string();
    }
    let mut out = String::new();
    for m in v.get("messages").and_then(Value::as_array).into_iter().flatten() {
        if let Some(c) = m.get("content").and_then(Value::as_str) {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(c);
        }
    }
    out
}

async fn handle(
    state: Arc<State>,
    posts: Arc<AtomicU64>,
    req: Request<Incoming>,
) -> Result<Response<BoxBody>, Closed> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models") => {
            let body = json!({"object": "list", "data": [{"id": state.cfg.model, "object": "model", "owned_by": "fixture"}]});
            return Ok(full(StatusCode::OK, "application/json", body.to_string()));
        }
        (&Method::GET, "/health") => return Ok(full(StatusCode::OK, "text/plain", "ok")),
        (&Method::POST, "/v1/chat/completions" | "/v1/completions") => {}
        _ => {
            return Ok(full(
                StatusCode::NOT_FOUND,
                "application/json",
                r#"{"error":{"message":"not found"}}"#,
            ));
        }
    }
    let chat = path.ends_with("/chat/completions");
    let n = state.requests.fetch_add(1, Ordering::Relaxed) + 1;
    let on_connection = posts.fetch_add(1, Ordering::Relaxed) + 1;
    if state.cfg.close_at == Some(on_connection) {
        // A service error makes hyper drop the connection without a response.
        return Err(Closed);
    }
    let body = match Limited::new(req.into_body(), 64 << 20).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(full(
                StatusCode::BAD_REQUEST,
                "application/json",
                r#"{"error":{"message":"body"}}"#,
            ));
        }
    };
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return Ok(full(
            StatusCode::BAD_REQUEST,
            "application/json",
            r#"{"error":{"message":"json"}}"#,
        ));
    };
    if let Some(secs) = state.cfg.shed_retry_after {
        let mut resp = full(
            StatusCode::TOO_MANY_REQUESTS,
            "application/json",
            r#"{"error":{"message":"overloaded"}}"#,
        );
        resp.headers_mut().insert(hyper::header::RETRY_AFTER, secs.into());
        return Ok(resp);
    }
    if state.cfg.fail_every.is_some_and(|k| k > 0 && n.is_multiple_of(k)) {
        return Ok(full(
            StatusCode::SERVICE_UNAVAILABLE,
            "application/json",
            r#"{"error":{"message":"injected"}}"#,
        ));
    }
    let text = prompt_text(&v);
    let words: Vec<&str> = text.split_whitespace().collect();
    let cached = state.prefix_lookup_and_store(&words);
    state
        .log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Seen { prompt_tokens: words.len(), cached_tokens: cached });
    let max_tokens = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, 1 << 20);
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = !state.cfg.usage_only_when_asked
        || !stream
        || v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let usage = json!({
        "prompt_tokens": words.len(),
        "completion_tokens": max_tokens,
        "total_tokens": words.len() as u64 + max_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    let uncached = (words.len() - cached) as u32;
    let ttft = state.cfg.ttft + state.cfg.per_uncached_token * uncached;
    let model = state.cfg.model.clone();
    let id = format!("fx-{n}");
    if !stream {
        if !ttft.is_zero() || !state.cfg.itl.is_zero() {
            tokio::time::sleep(ttft + state.cfg.itl * (max_tokens as u32).saturating_sub(1)).await;
        }
        let out: Vec<&str> = (0..max_tokens).map(|_| "tok").collect();
        let out = out.join(" ");
        let body = if chat {
            json!({"id": id, "object": "chat.completion", "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": "length"}], "usage": usage})
        } else {
            json!({"id": id, "object": "text_completion", "model": model, "choices": [{"index": 0, "text": out, "finish_reason": "length"}], "usage": usage})
        };
        return Ok(full(StatusCode::OK, "application/json", body.to_string()));
    }
    let chunk = |content: Option<&str>, finish: bool| -> String {
        let finish_reason = if finish { json!("length") } else { Value::Null };
        let v = if chat {
            let delta = match content {
                Some(c) => json!({"content": c}),
                None => json!({"role": "assistant", "content": ""}),
            };
            json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
        } else {
            json!({"id": id, "object": "text_completion", "created": 0, "model": model, "choices": [{"index": 0, "text": content.unwrap_or(""), "finish_reason": finish_reason}]})
        };
        format!("data: {v}\n\n")
    };
    let role = chat.then(|| chunk(None, false));
    let tokens: Vec<String> = (0..max_tokens)
        .map(|i| chunk(Some(if i == 0 { "tok" } else { " tok" }), i + 1 == max_tokens))
        .collect();
    let mut tail = Vec::with_capacity(2);
    if include_usage {
        let u = json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [], "usage": usage});
        tail.push(format!("data: {u}\n\n"));
    }
    tail.push("data: [DONE]\n\n".to_string());
    let sse = |body: BoxBody| {
        let mut resp = Response::new(body);
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        resp
    };
    if ttft.is_zero() && state.cfg.itl.is_zero() {
        let all: String = role.into_iter().chain(tokens).chain(tail).collect();
        return Ok(sse(Full::new(Bytes::from(all)).boxed_unsync()));
    }
    let (tx, rx) = mpsc::channel(4);
    let itl = state.cfg.itl;
    tokio::spawn(async move {
        // The role chunk (chat) leaves at once, the first token after the TTFT, then one token
        // per ITL.
        if let Some(role) = role
            && tx.send(Bytes::from(role)).await.is_err()
        {
            return;
        }
        tokio::time::sleep(ttft).await;
        for (i, ev) in tokens.into_iter().chain(tail).enumerate() {
            if i > 0 && i < max_tokens as usize {
                tokio::time::sleep(itl).await;
            }
            if tx.send(Bytes::from(ev)).await.is_err() {
                return;
            }
        }
    });
    Ok(sse(ChannelBody { rx }.boxed_unsync()))
}

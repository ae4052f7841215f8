//! The HTTP server: routes, authentication (API keys for inference, admin keys for
//! `/metrics` and `/status.json`), the status page at `/`, body limits, admission (the
//! server's bound, the key's limits, then the admission queue's), the request path from a JSON body to engine
//! requests and back (whole responses or SSE streams), cancellation when a client goes away,
//! deadlines, bounds on what a stream leaves unread, graceful shutdown, read timeouts for slow
//! clients, and the handle that reloads keys and
//! certificate.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvx_proto::plane::WorkerRole;
use kvx_proto::{FinishReason, GenerateRequest, Output, RequestId, TokenId, Usage};
use serde_json::json;
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::admission::{Admission, AdmissionConfig, Refused, Ticket};
use crate::conn;
use crate::dispatch::{Dispatcher, ModelInfo, WorkerState};
use crate::error::{ApiError, IngressError};
use crate::fanout::{self, UsageSum};
use crate::keys::{Access, ApiKeys, Grant, KeyPermit};
use crate::metrics::Metrics;
use crate::openai::{
    ChatRequest, CompletionRequest, DetokenizeRequest, Params, PromptSpec, TokenizeRequest, parse,
    timeout_of,
};
use crate::relay::{self, Cut, StreamState};
use crate::render::{Api, Choice, ChunkWriter, LogprobAcc, response};
use crate::status::{self, Live};
use crate::tls::{Tls, TlsListener};
use crate::tools::{self, StreamSplit, ToolMode};

/// Server settings.
#[derive(Debug, Clone)]
pub struct IngressConfig {
    /// Where to listen (port 0 = any free port; see [`Server::local_addr`]).
    pub addr: SocketAddr,
    /// Accepted API keys (`Authorization: Bearer KEY`), with their limits, and the admin keys
    /// `/metrics` asks for while one is in force; none = no authentication.
    pub keys: ApiKeys,
    /// Serve HTTPS with this certificate (plain HTTP without).
    pub tls: Option<Tls>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// On shutdown, how long running requests may take to finish before they are cancelled.
    pub shutdown_grace: Duration,
    /// Requests served at once at most (429 above).
    pub max_inflight: usize,
    /// A client must send each request's headers within this, or the connection is closed.
    pub header_read_timeout: Duration,
    /// A request's body must arrive within this after its headers (408 otherwise).
    pub body_read_timeout: Duration,
    /// A connection whose client acknowledges nothing or keeps its receive window shut for
    /// this long while output waits for it is closed (its requests cancelled).
    pub send_timeout: Duration,
    /// The admission queue's bounds.
    pub admission: AdmissionConfig,
    /// Bytes of a stream's output that may wait for a client that does not read; past them
    /// the request is cancelled.
    pub stream_buffer_bytes: usize,
}

impl Default for IngressConfig {
    fn default() -> Self {
        IngressConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            keys: ApiKeys::none(),
            tls: None,
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(30),
            max_inflight: 4096,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(30),
            admission: AdmissionConfig::default(),
            stream_buffer_bytes: 256 << 10,
        }
    }
}

/// Bodies at least this large are preprocessed off the I/O threads.
const BLOCKING_PREPROCESS_BYTES: usize = 32 << 10;
/// SSE messages written per body frame at most (only those already waiting are coalesced).
const MAX_MESSAGES_PER_FRAME: usize = 64;

struct Shared {
    cfg: IngressConfig,
    model: ModelInfo,
    dispatcher: Arc<dyn Dispatcher>,
    metrics: Metrics,
    live: Live,
    next_id: AtomicU64,
    inflight: AtomicUsize,
    active: Mutex<HashSet<RequestId>>,
    draining: AtomicBool,
    admission: Arc<Admission>,
    idle: Notify,
    models_json: Bytes,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("cfg", &self.cfg).field("model", &self.model.name).finish()
    }
}

impl Shared {
    fn model_card(&self) -> serde_json::Value {
        json!({
            "id": self.model.name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "kvx",
            "max_model_len": self.model.context_length,
        })
    }
}

/// A bound server, ready to run.
#[derive(Debug)]
pub struct Server {
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Requests that were running when shutdown began.
    pub running_at_signal: usize,
    /// Requests cancelled at the deadline.
    pub cancelled: usize,
}

impl Server {
    /// Binds the listening socket.
    pub async fn bind(
        cfg: IngressConfig,
        model: ModelInfo,
        dispatcher: Arc<dyn Dispatcher>,
    ) -> Result<Server, IngressError> {
        let listener = tokio::net::TcpListener::bind(cfg.addr)
            .await
            .map_err(|source| IngressError::Bind { addr: cfg.addr, source })?;
        // Ids start at a random point so that restarts do not reuse them.
        let base = RandomState::new().hash_one(std::process::id()) >> 1;
        let admission = Admission::new(cfg.admission);
        let mut shared = Shared {
            admission,
            cfg,
            model,
            dispatcher,
            metrics: Metrics::new(),
            live: Live::new(),
            next_id: AtomicU64::new(base),
            inflight: AtomicUsize::new(0),
            active: Mutex::new(HashSet::new()),
            draining: AtomicBool::new(false),
            idle: Notify::new(),
            models_json: Bytes::new(),
        };
        let list = json!({"object": "list", "data": [shared.model_card()]});
        shared.models_json = Bytes::from(serde_json::to_vec(&list).unwrap_or_default());
        Ok(Server { listener, shared: Arc::new(shared) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, IngressError> {
        Ok(self.listener.local_addr()?)
    }

    /// `https` with TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.shared.cfg.tls.is_some() { "https" } else { "http" }
    }

    /// A handle that reloads the API keys file and the certificate while the server runs.
    pub fn handle(&self) -> ServerHandle {
        ServerHandle { keys: self.shared.cfg.keys.clone(), tls: self.shared.cfg.tls.clone() }
    }

    /// Serves until `shutdown` completes; then stops accepting, lets running requests finish
    /// for the configured grace period, cancels what is left and returns.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<ShutdownReport, IngressError> {
        let shared = self.shared.clone();
        let app = router(shared.clone());
        let (sig_tx, sig_rx) = tokio::sync::oneshot::channel::<()>();
        let sh = shared.clone();
        let graceful = async move {
            shutdown.await;
            sh.draining.store(true, Ordering::SeqCst);
            let _ = sig_tx.send(());
        };
        if shared.cfg.admission.running_floor > 0 {
            tokio::spawn(follow_knees(Arc::downgrade(&shared)));
        }
        let header_timeout = shared.cfg.header_read_timeout;
        let send_timeout = shared.cfg.send_timeout;
        let mut serve = match shared.cfg.tls.clone() {
            None => {
                let listener = self.listener.tap_io(move |tcp| conn::tune(tcp, send_timeout));
                tokio::spawn(conn::serve(listener, app, header_timeout, graceful))
            }
            Some(tls) => {
                let listener = TlsListener::new(self.listener, tls, send_timeout);
                tokio::spawn(conn::serve(listener, app, header_timeout, graceful))
            }
        };
        tokio::select! {
            r = &mut serve => {
                return match r {
                    Ok(()) => Ok(ShutdownReport { running_at_signal: 0, cancelled: 0 }),
                    Err(e) => Err(IngressError::Serve(std::io::Error::other(e.to_string()))),
                };
            }
            _ = sig_rx => {}
        }
        let running_at_signal = shared.inflight.load(Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + shared.cfg.shutdown_grace;
        wait_idle(&shared, deadline).await;
        let mut cancelled = 0;
        if shared.inflight.load(Ordering::SeqCst) > 0 {
            let ids: Vec<RequestId> =
                shared.active.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
            cancelled = ids.len();
            for id in ids {
                shared.dispatcher.cancel(id);
            }
            wait_idle(&shared, tokio::time::Instant::now() + Duration::from_secs(2)).await;
        }
        // Connections still open (idle keep-alive ones are closed by the graceful shutdown)
        // get a moment to flush, then the server is dropped.
        if tokio::time::timeout(Duration::from_secs(1), &mut serve).await.is_err() {
            serve.abort();
        }
        Ok(ShutdownReport { running_at_signal, cancelled })
    }
}

/// Reloads what a running server reads from files (see [`Server::handle`]); cheap to clone.
#[derive(Debug, Clone)]
pub struct ServerHandle {
    keys: ApiKeys,
    tls: Option<Tls>,
}

/// What [`ServerHandle::reload`] did. Each part is applied on its own; a part that failed
/// keeps what was in force.
#[derive(Debug)]
pub struct Reloaded {
    /// The keys file's key count now in force, or why the old keys stay; `None` without a
    /// keys file.
    pub keys: Option<Result<usize, IngressError>>,
    /// Whether the certificate was replaced, or why the old one stays; `None` without TLS.
    pub tls: Option<Result<(), IngressError>>,
}

impl ServerHandle {
    /// Re-reads the API keys file (a revoked key is refused from now on, requests already
    /// admitted run on) and the certificate (new connections get it). Reads files: call it
    /// where blocking is fine.
    pub fn reload(&self) -> Reloaded {
        Reloaded { keys: self.keys.reload().transpose(), tls: self.tls.as_ref().map(Tls::reload) }
    }

    /// The keys file, if there is one.
    pub fn keys_file(&self) -> Option<&std::path::Path> {
        self.keys.file()
    }

    /// The certificate file, with TLS.
    pub fn cert_file(&self) -> Option<&std::path::Path> {
        self.tls.as_ref().map(Tls::cert_path)
    }
}

async fn wait_idle(shared: &Shared, deadline: tokio::time::Instant) {
    loop {
        let notified = shared.idle.notified();
        if shared.inflight.load(Ordering::SeqCst) == 0 {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return;
        }
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/health", get(health))
        .route("/live", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/", get(status_page))
        .route("/status.json", get(status_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

async fn not_found(uri: Uri) -> Response {
    ApiError::no_route(uri.path()).into_response()
}

async fn method_not_allowed(method: Method) -> Response {
    let _ = method;
    ApiError::method_not_allowed().into_response()
}

fn json_response(status: StatusCode, body: impl Into<Body>) -> Response {
    let mut r = Response::new(body.into());
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

async fn health() -> Response {
    json_response(StatusCode::OK, "{\"status\":\"ok\"}")
}

async fn ready(State(s): State<Arc<Shared>>) -> Response {
    if s.draining.load(Ordering::Relaxed) {
        json_response(StatusCode::SERVICE_UNAVAILABLE, "{\"status\":\"shutting down\"}")
    } else if s.dispatcher.ready() {
        json_response(StatusCode::OK, "{\"status\":\"ready\"}")
    } else {
        json_response(StatusCode::SERVICE_UNAVAILABLE, "{\"status\":\"not ready\"}")
    }
}

async fn metrics(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize_admin(&s, &headers) {
        return e.into_response();
    }
    s.metrics.admission_queued.set(s.admission.queued() as i64);
    s.metrics.admission_wait.set(s.admission.estimated_wait(Instant::now(), 1, 1).as_secs_f64());
    s.metrics.admission_bound.set(s.admission.running_bound() as i64);
    let text = s.metrics.render(&s.dispatcher.workers(), &s.dispatcher.router_metrics());
    let mut r = Response::new(Body::from(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

/// The status page: static (the data comes from `/status.json`), open, and allowed nothing
/// but itself and same-origin fetches.
async fn status_page() -> Response {
    let mut r = Response::new(Body::from(status::PAGE));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
             frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    r
}

/// The status page's data: the fleet, totals and the last minutes' latency (admin keys only
/// while one is in force, as `/metrics`).
async fn status_json(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize_admin(&s, &headers) {
        return e.into_response();
    }
    let io = status::Counters {
        input_tokens: s.metrics.input_tokens.get(),
        output_tokens: s.metrics.output_tokens.get(),
        inflight: s.metrics.inflight.get(),
    };
    let snap = s.live.snapshot(&s.model.name, &s.dispatcher.workers(), io);
    match serde_json::to_vec(&snap) {
        Ok(body) => {
            let mut r = json_response(StatusCode::OK, body);
            r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            r
        }
        Err(e) => ApiError::internal(format!("encoding the status: {e}")).into_response(),
    }
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    match authorize(&s, &headers) {
        Err(e) => e.into_response(),
        Ok(a) if a.grant.allows(&s.model.name) => {
            json_response(StatusCode::OK, s.models_json.clone())
        }
        Ok(_) => json_response(StatusCode::OK, "{\"object\":\"list\",\"data\":[]}"),
    }
}

async fn model(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    match authorize(&s, &headers) {
        Err(e) => return e.into_response(),
        Ok(a) if id != s.model.name || !a.grant.allows(&id) => {
            return ApiError::model_not_found(&id).into_response();
        }
        Ok(_) => {}
    }
    json_response(StatusCode::OK, serde_json::to_vec(&s.model_card()).unwrap_or_default())
}

async fn chat(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    generate(s, Api::Chat, headers, body).await
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    generate(s, Api::Completions, headers, body).await
}

/// `POST /tokenize`: the token ids the engine would see for a prompt, or for messages through
/// the chat template (`count`, `max_model_len`, `tokens`, and `token_strs` when asked).
async fn tokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    match tokenize_inner(&s, &headers, body).await {
        Ok(v) => json_response(StatusCode::OK, v.to_string()),
        Err(e) => e.into_response(),
    }
}

async fn tokenize_inner(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<serde_json::Value, ApiError> {
    let access = authorize(s, headers)?;
    let body = read_body(s, headers, body).await?;
    let r: TokenizeRequest = parse(&body)?;
    check_model(s, r.model.as_deref(), &access.grant)?;
    let tok = &s.model.tokenizer;
    let bad = |e: kvx_tokenizer::TokenizerError, p| {
        ApiError::bad_request(format!("tokenizing: {e}"), Some(p))
    };
    let tokens = match (&r.prompt, &r.messages) {
        (Some(text), None) => {
            if r.add_special_tokens.unwrap_or(true) {
                tok.encode_prompt(text).map_err(|e| bad(e, "prompt"))?
            } else {
                tok.encode(text, true).map_err(|e| bad(e, "prompt"))?
            }
        }
        (None, Some(_)) => {
            // Rendered exactly as a chat completion renders the same messages.
            let chat: ChatRequest = parse(&body)?;
            let text = chat.render(tok)?;
            if r.add_special_tokens.unwrap_or(false) {
                tok.encode_prompt(&text).map_err(|e| bad(e, "messages"))?
            } else {
                tok.encode(&text, true).map_err(|e| bad(e, "messages"))?
            }
        }
        _ => {
            return Err(ApiError::bad_request("give exactly one of `prompt` and `messages`", None));
        }
    };
    let mut v = serde_json::json!({
        "count": tokens.len(),
        "max_model_len": s.model.context_length,
        "tokens": tokens,
    });
    if r.return_token_strs.unwrap_or(false) {
        let strs: Vec<String> = tokens
            .iter()
            .map(|&t| String::from_utf8_lossy(tok.token_to_piece(t).unwrap_or(&[])).into_owned())
            .collect();
        v["token_strs"] = serde_json::json!(strs);
    }
    Ok(v)
}

/// `POST /detokenize`: the text of token ids (special tokens rendered), as `prompt`.
async fn detokenize(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let access = authorize(&s, &headers)?;
        let body = read_body(&s, &headers, body).await?;
        let r: DetokenizeRequest = parse(&body)?;
        check_model(&s, r.model.as_deref(), &access.grant)?;
        let text = s
            .model
            .tokenizer
            .decode(&r.tokens, false)
            .map_err(|e| ApiError::bad_request(format!("detokenizing: {e}"), Some("tokens")))?;
        Ok::<_, ApiError>(serde_json::json!({ "prompt": text }))
    };
    match run.await {
        Ok(v) => json_response(StatusCode::OK, v.to_string()),
        Err(e) => e.into_response(),
    }
}

/// `GET /tokenizer_info`: the tokenizer's special tokens, limits and chat template, in vLLM's
/// shape (clients that tokenize through `/tokenize` read it first).
async fn tokenizer_info(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return e.into_response();
    }
    let tok = &s.model.tokenizer;
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).map(str::to_owned);
    let v = json!({
        "tokenizer_class": "kvx",
        "description": tok.description(),
        "bos_token": text(tok.bos_id()),
        "eos_token": text(tok.eos_id()),
        "pad_token": null,
        "add_bos_token": tok.add_bos(),
        "add_eos_token": tok.add_eos(),
        "vocab_size": tok.vocab_size(),
        "model_max_length": s.model.context_length,
        "chat_template": tok.chat_template().map(|t| t.source()),
    });
    json_response(StatusCode::OK, v.to_string())
}

/// The key of `Authorization: Bearer KEY` (or of a bare `Authorization: KEY`).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let v = headers.get(header::AUTHORIZATION)?.as_bytes();
    Some(if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") { &v[7..] } else { v })
}

/// What the request's key may do (everything, with no limit, without keys).
fn authorize(s: &Shared, headers: &HeaderMap) -> Result<Access, ApiError> {
    if !s.cfg.keys.required() {
        return Ok(Access::open());
    }
    let Some(key) = bearer(headers) else {
        return Err(ApiError::unauthorized(
            "missing API key: send it as `Authorization: Bearer KEY`",
        ));
    };
    s.cfg.keys.check(key).ok_or_else(|| ApiError::unauthorized("incorrect API key"))
}

/// The admin endpoints (`/metrics`, `/status.json`): while an admin key is in force, only an
/// admin key (401 without an accepted key, 403 with a key that is not an admin key);
/// otherwise open.
fn authorize_admin(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let keys = &s.cfg.keys;
    if !keys.admin_required() {
        return Ok(());
    }
    let Some(key) = bearer(headers) else {
        return Err(ApiError::unauthorized(
            "missing admin key: send it as `Authorization: Bearer KEY`",
        ));
    };
    match keys.check(key) {
        None => Err(ApiError::unauthorized("incorrect API key")),
        Some(a) if !a.admin => Err(ApiError::forbidden("this endpoint needs an admin key")),
        Some(_) => Ok(()),
    }
}

async fn read_body(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = s.cfg.max_body_bytes;
    if let Some(n) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && n > limit as u64
    {
        return Err(ApiError::too_large(limit));
    }
    let body = Limited::new(body, limit).collect();
    let Ok(collected) = tokio::time::timeout(s.cfg.body_read_timeout, body).await else {
        return Err(ApiError::request_timeout(format!(
            "the request body did not arrive within {} s",
            s.cfg.body_read_timeout.as_secs_f64()
        )));
    };
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(ApiError::too_large(limit)),
        Err(e) => Err(ApiError::bad_request(format!("reading the request body: {e}"), None)),
    }
}

/// A parsed request, tokenized and ready for the engine.
struct Prepared {
    params: Params,
    prompts: Vec<Vec<TokenId>>,
    stream: bool,
    include_usage: bool,
    /// Choices per prompt (`n`).
    n: usize,
    /// With `echo`, each prompt's text (a choice's text starts with it).
    echo: Option<Vec<Arc<str>>>,
    /// `echo` with `max_tokens: 0` (and no `logprobs`): the prompts are the whole answer, no
    /// engine request.
    echo_only: bool,
    /// `echo` with `logprobs` and `max_tokens: 0`: the prompts are scored, nothing is
    /// generated (a prompt may then fill the context).
    score_only: bool,
    /// A chat request's tools (calls are parsed out of the answers).
    tools: Option<Arc<ToolMode>>,
    /// The `timeout` field.
    timeout: Option<f64>,
}

fn prepare(s: &Shared, api: Api, body: &[u8], grant: &Grant) -> Result<Prepared, ApiError> {
    let tok = &s.model.tokenizer;
    let mut echo = None;
    let mut tool_mode = None;
    let (mut common, prompts) = match api {
        Api::Chat => {
            let r: ChatRequest = parse(body)?;
            let mut c = r.common()?;
            check_model(s, c.model.as_deref(), grant)?;
            let (tools, choice) = tools::parse(r.tools.as_ref(), r.tool_choice.as_ref())?;
            if let Some(schema) = tools::forced_schema(&tools, &choice) {
                if c.constraint.is_some() {
                    return Err(ApiError::bad_request(
                        "tool_choice forces a call: give no response_format or guided_* with it",
                        Some("tool_choice"),
                    ));
                }
                crate::openai::check_constraint_len(schema.len(), "tools")?;
                c.constraint = Some(kvx_proto::Constraint::JsonSchema(schema));
            }
            tool_mode = ToolMode::new(tools, &choice).map(Arc::new);
            let text = r.render(tok)?;
            let ids = tok
                .encode_prompt(&text)
                .map_err(|e| ApiError::bad_request(format!("tokenizing: {e}"), Some("messages")))?;
            (c, vec![ids])
        }
        Api::Completions => {
            let r: CompletionRequest = parse(body)?;
            let c = r.common()?;
            check_model(s, c.model.as_deref(), grant)?;
            let prompts = r.prompts(tok)?;
            if r.echo.unwrap_or(false) {
                echo = Some(echo_texts(&r.prompt, &prompts, tok)?);
            }
            (c, prompts)
        }
    };
    // `echo` with `max_tokens: 0` asks for nothing generated (the other fields are still
    // checked); with `logprobs` too it asks for the prompt's scores alone.
    let nothing = echo.is_some() && common.max_tokens == Some(0);
    let (echo_only, score_only) = (nothing && common.logprobs.is_none(), nothing);
    if nothing {
        common.max_tokens = None;
    }
    let mut params = common.params()?;
    if echo.is_some() {
        params.prompt_logprobs = params.logprobs;
    }
    let score_only = score_only && !echo_only;
    Ok(Prepared {
        params,
        prompts,
        stream: common.stream,
        include_usage: common.include_usage,
        n: common.n.unwrap_or(1).max(1) as usize,
        echo,
        echo_only,
        score_only,
        tools: tool_mode,
        timeout: common.timeout,
    })
}

/// The text `echo` starts each choice with: a text prompt as given, token ids decoded (special
/// tokens rendered).
fn echo_texts(
    spec: &PromptSpec,
    prompts: &[Vec<TokenId>],
    tok: &kvx_tokenizer::Tokenizer,
) -> Result<Vec<Arc<str>>, ApiError> {
    match spec {
        PromptSpec::Text(t) => Ok(vec![Arc::from(t.as_str())]),
        PromptSpec::Texts(v) => Ok(v.iter().map(|t| Arc::from(t.as_str())).collect()),
        PromptSpec::Tokens(_) | PromptSpec::TokenLists(_) => prompts
            .iter()
            .map(|p| {
                tok.decode(p, false).map(Arc::from).map_err(|e| {
                    ApiError::bad_request(format!("decoding the prompt: {e}"), Some("prompt"))
                })
            })
            .collect(),
    }
}

/// The request's model must be the served one (no `model` means it), and the key may use it.
fn check_model(s: &Shared, model: Option<&str>, grant: &Grant) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.model.name => Err(ApiError::model_not_found(m)),
        _ if !grant.allows(&s.model.name) => {
            Err(ApiError::model_not_found(model.unwrap_or(&s.model.name)))
        }
        _ => Ok(()),
    }
}

/// One request's place in ingress: counts it in flight (and, once admitted by its key's
/// limits, running for its key, until it ends) and, if dropped before the response ended
/// (the client went away), cancels its engine requests. A request of `n` choices counts `n`
/// against the server's in-flight bound and its key's concurrency.
struct Guard {
    shared: Arc<Shared>,
    ids: Vec<RequestId>,
    key: Option<KeyPermit>,
    /// Its place past the admission queue.
    ticket: Option<Ticket>,
    done: bool,
    /// What it counts in `Shared::inflight`.
    weight: usize,
}

impl Guard {
    /// Admits a request that counts `weight` (its choices per prompt) against the server's
    /// bound; one larger than the bound runs only alone.
    fn admit(shared: &Arc<Shared>, weight: usize) -> Result<Guard, ApiError> {
        if shared.draining.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let weight = weight.max(1);
        let n = shared.inflight.fetch_add(weight, Ordering::SeqCst);
        let g = Guard {
            shared: shared.clone(),
            ids: Vec::new(),
            key: None,
            ticket: None,
            done: false,
            weight,
        };
        shared.metrics.inflight.inc();
        let max = shared.cfg.max_inflight;
        if n >= max || (n > 0 && n.saturating_add(weight) > max) {
            return Err(ApiError::overloaded(format!("too many requests in flight ({max})")));
        }
        Ok(g)
    }

    fn submit(&mut self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, ApiError> {
        let id = req.id;
        let rx = self.shared.dispatcher.submit(req)?;
        self.ids.push(id);
        self.shared.active.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
        Ok(rx)
    }

    /// Admits the request by its key's limits (prompt tokens counted now, once; `requests`
    /// engine requests counted as running).
    fn admit_key(
        &mut self,
        access: &Access,
        prompt_tokens: u64,
        requests: usize,
    ) -> Result<(), ApiError> {
        let requests = u32::try_from(requests).unwrap_or(u32::MAX);
        match access.admit_n(prompt_tokens, requests, Instant::now()) {
            Ok(p) => {
                self.key = Some(p);
                Ok(())
            }
            Err(r) => {
                self.shared.metrics.rate_limited(r.limit.as_str());
                Err(ApiError::rate_limited(r.message(), r.retry_after_secs()))
            }
        }
    }

    /// Waits in the admission queue (until `deadline` at most); refusals are counted and
    /// answered 429 with `Retry-After` (408 at the deadline).
    async fn admit_queue(
        &mut self,
        tokens: usize,
        deadline: Option<Instant>,
    ) -> Result<(), ApiError> {
        let s = &self.shared;
        match s.admission.enter(self.weight, tokens, deadline).await {
            // A request that waited through the start of a shutdown does not start.
            Ok(_) if s.draining.load(Ordering::Relaxed) => {
                Err(ApiError::unavailable("the server is shutting down"))
            }
            Ok(t) => {
                self.ticket = Some(t);
                Ok(())
            }
            Err(r) => {
                s.metrics.admission_refused(r.reason());
                let secs = |d: Duration| d.as_secs_f64().ceil().clamp(1.0, 3600.0) as u32;
                Err(match r {
                    Refused::QueueFull { retry_after } => ApiError::queue_refused(
                        format!(
                            "overloaded: the admission queue is full ({} requests waiting)",
                            s.admission.config().max_queue
                        ),
                        secs(retry_after),
                    ),
                    Refused::TooLong { wait } => ApiError::queue_refused(
                        format!(
                            "overloaded: a new request would wait about {:.1} s to start (the \
                             bound is {:.1} s, or the request's timeout is shorter)",
                            wait.as_secs_f64(),
                            s.admission.wait_bound(Instant::now()).as_secs_f64()
                        ),
                        secs(wait),
                    ),
                    Refused::Deadline => {
                        ApiError::deadline("the request's timeout passed while it waited to start")
                    }
                })
            }
        }
    }

    /// One of its engine requests produced its first output.
    fn started(&mut self) {
        if let Some(t) = &mut self.ticket {
            t.started();
        }
    }

    /// `n` completion tokens produced (counted against the key's tokens per minute).
    fn produced(&self, n: usize) {
        if let Some(k) = &self.key {
            k.produced(n as u64, Instant::now());
        }
    }

    /// Cancels every engine request it started (idempotent; those already ended ignore it).
    fn cancel_all(&self) {
        for &id in &self.ids {
            self.shared.dispatcher.cancel(id);
        }
    }

    /// The response failed on the server's side: the other engine requests are cancelled
    /// (not a disconnect) and the request no longer runs for its key.
    fn abort(&mut self) {
        self.cancel_all();
        self.finish();
    }

    /// The response ended (or failed) on the server's side: nothing to cancel, and the
    /// request no longer runs for its key.
    fn finish(&mut self) {
        self.done = true;
        self.key = None;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &self.shared;
        if !self.ids.is_empty() {
            let mut active = s.active.lock().unwrap_or_else(|p| p.into_inner());
            for id in &self.ids {
                active.remove(id);
            }
        }
        if !self.done {
            for &id in &self.ids {
                s.dispatcher.cancel(id);
            }
            if !self.ids.is_empty() {
                s.metrics.disconnects.inc();
            }
        }
        s.metrics.inflight.dec();
        if s.inflight.fetch_sub(self.weight, Ordering::SeqCst) == self.weight {
            s.idle.notify_waiters();
        }
    }
}

async fn generate(s: Arc<Shared>, api: Api, headers: HeaderMap, body: Body) -> Response {
    let arrival = Instant::now();
    match start(&s, api, &headers, body, arrival).await {
        Ok(r) => r,
        Err(e) => {
            s.metrics.request(api.label(), e.status.as_u16());
            e.into_response()
        }
    }
}

fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

fn response_id(api: Api, first: RequestId) -> String {
    match api {
        Api::Chat => format!("chatcmpl-{first}"),
        Api::Completions => format!("cmpl-{first}"),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn start(
    s: &Arc<Shared>,
    api: Api,
    headers: &HeaderMap,
    body: Body,
    arrival: Instant,
) -> Result<Response, ApiError> {
    let access = authorize(s, headers)?;
    let body = read_body(s, headers, body).await?;
    let prep = if body.len() >= BLOCKING_PREPROCESS_BYTES {
        let sh = s.clone();
        let grant = access.grant.clone();
        tokio::task::spawn_blocking(move || prepare(&sh, api, &body, &grant))
            .await
            .map_err(|e| ApiError::internal(format!("preprocessing: {e}")))??
    } else {
        prepare(s, api, &body, &access.grant)?
    };
    let n = prep.n;
    let timeout = timeout_of(prep.timeout, headers.get("x-request-timeout").map(|v| v.as_bytes()))?;
    let deadline = timeout.map(|t| arrival + t);
    // Every engine request counts against the server's bound and the key's concurrency.
    let weight = n.saturating_mul(prep.prompts.len().max(1));
    let mut guard = Guard::admit(s, weight)?;
    let prompt_tokens: usize = prep.prompts.iter().map(Vec::len).sum();
    if prep.echo_only {
        guard.admit_key(&access, prompt_tokens as u64, weight)?;
        return Ok(echo_only(s, api, guard, prep, arrival));
    }
    if !s.dispatcher.ready() {
        guard.finish();
        return Err(ApiError::unavailable("no worker is ready"));
    }
    guard.admit_key(&access, prompt_tokens as u64, weight)?;
    // A prompt is prefilled once and its other choices fork from it, unless its positions
    // are scored (then each choice computes it).
    let prefilled = match prep.params.prompt_logprobs {
        Some(_) => prompt_tokens.saturating_mul(n),
        None => prompt_tokens,
    };
    guard.admit_queue(prefilled, deadline).await?;
    let Prepared { params, prompts, stream, include_usage, echo, tools, score_only, .. } = prep;
    // A scored prompt's answer lists its tokens.
    let scored: Option<Vec<Arc<[TokenId]>>> =
        params.prompt_logprobs.map(|_| prompts.iter().map(|p| Arc::from(p.as_slice())).collect());
    let random = RandomState::new().hash_one(s.next_id.load(Ordering::Relaxed));
    let seeds = fanout::seeds(params.sampling.seed, n, random);
    // One engine request per choice, in index order (prompt-major).
    let mut reqs: Vec<Option<GenerateRequest>> = Vec::with_capacity(prompts.len() * n);
    for mut p in prompts {
        let mut leader = RequestId(0);
        for (j, &seed) in seeds.iter().enumerate() {
            let id = RequestId(s.next_id.fetch_add(1, Ordering::Relaxed));
            let prompt = if j + 1 == n { std::mem::take(&mut p) } else { p.clone() };
            let mut r = if score_only {
                params.score_request(id, prompt, s.model.context_length)?
            } else {
                params.request(id, prompt, s.model.context_length)?
            };
            r.sampling.seed = seed;
            // The first choice computes the prompt, the others start from it (a scored
            // prompt is scored by each).
            if n > 1 && params.prompt_logprobs.is_none() {
                r.fork = Some(if j == 0 {
                    leader = id;
                    kvx_proto::Fork::Leader { followers: (n - 1) as u32 }
                } else {
                    kvx_proto::Fork::Follower { leader }
                });
            }
            reqs.push(Some(r));
        }
    }
    let first_id = reqs.first().and_then(Option::as_ref).map_or(RequestId(0), |r| r.id);
    let mut slots: Vec<Option<Sub>> = (0..reqs.len()).map(|_| None).collect();
    // Each prompt is computed once: its first choice goes first, the others once that one's
    // first token came (its prompt's full blocks are in the prefix cache by then, so they
    // compute only the last partial block). Every choice's first message is awaited so
    // that errors the engine finds at admission (queue full, invalid parameters) still get
    // their HTTP status.
    for leaders in [true, false] {
        let mut started = Vec::new();
        for (k, slot) in reqs.iter_mut().enumerate() {
            let (prompt, j) = fanout::split_index(k, n);
            if (j == 0) != leaders {
                continue;
            }
            let Some(r) = slot.take() else { continue };
            let id = r.id;
            match guard.submit(r) {
                Ok(rx) => {
                    let echo = echo.as_ref().and_then(|e| e.get(prompt)).cloned();
                    let mut sub = Sub::new(id, rx, k, j, echo);
                    sub.scored = scored.as_ref().and_then(|v| v.get(prompt)).cloned();
                    sub.score_only = score_only;
                    slots[k] = Some(sub);
                    started.push(k);
                }
                Err(e) => {
                    guard.abort();
                    return Err(e);
                }
            }
        }
        for k in started {
            let Some(sub) = slots.get_mut(k).and_then(Option::as_mut) else { continue };
            let first = match deadline {
                None => sub.first().await,
                Some(d) => tokio::time::timeout_at(d.into(), sub.first())
                    .await
                    .unwrap_or_else(|_| Err(ApiError::deadline(TIMED_OUT))),
            };
            if let Err(e) = first {
                guard.abort();
                return Err(e);
            }
            guard.started();
        }
    }
    let Some(mut subs) = slots.into_iter().collect::<Option<Vec<Sub>>>() else {
        guard.abort();
        return Err(ApiError::internal("a choice was not started"));
    };
    let created = unix_now();
    let id = response_id(api, first_id);
    let want_logprobs = params.logprobs.map(|n| n as usize);
    let ctx =
        Ctx { shared: s.clone(), api, arrival, logprobs: want_logprobs, tools, id: id.clone() };
    if stream {
        let writer = ChunkWriter::new(api, &id, created, &s.model.name);
        let metrics = s.clone();
        let state = StreamState::new(
            s.cfg.stream_buffer_bytes,
            subs.len(),
            guard.ticket.take(),
            Box::new(move |c| metrics.metrics.stream_cut(cut_label(c))),
        );
        // A choice that already ended (its end came with its first message) is counted now.
        for sub in &subs {
            if matches!(sub.pending, Some(Output::Finished { .. } | Output::Error { .. })) {
                state.choice_ended();
            }
        }
        for sub in &mut subs {
            // A closed placeholder while the engine's receiver moves into the relay.
            #[allow(clippy::disallowed_methods)]
            let rx = std::mem::replace(&mut sub.rx, tokio::sync::mpsc::unbounded_channel().1);
            sub.rx = relay::spawn(sub.id, rx, state.clone(), deadline, s.dispatcher.clone());
        }
        let body = SseBody {
            stream: state,
            ctx,
            guard,
            writer,
            subs,
            include_usage,
            total: UsageSum::default(),
            ended: false,
        };
        return Ok(sse_response(Body::new(body)));
    }
    let mut choices = Vec::with_capacity(subs.len());
    let mut total = UsageSum::default();
    for sub in &mut subs {
        let mut text = sub.echo.as_deref().map(str::to_owned).unwrap_or_default();
        let mut lp = LogprobAcc::default();
        loop {
            let msg = match sub.pending.take() {
                Some(m) => Some(m),
                None => match deadline {
                    None => sub.rx.recv().await,
                    Some(d) => match tokio::time::timeout_at(d.into(), sub.rx.recv()).await {
                        Ok(m) => m,
                        Err(_) => {
                            guard.abort();
                            return Err(ApiError::deadline(TIMED_OUT));
                        }
                    },
                },
            };
            match msg {
                Some(Output::PromptLogprobs { start, logprobs }) => {
                    sub.prompt_scores(start, logprobs);
                }
                Some(Output::Delta(d)) => {
                    ctx.on_tokens(sub, d.tokens.len());
                    guard.produced(d.tokens.len());
                    ctx.add_prompt_logprobs(sub, &mut lp);
                    if !sub.score_only {
                        text.push_str(&d.text);
                        ctx.add_logprobs(&mut lp, &d.tokens, &d.logprobs);
                    }
                }
                Some(Output::Finished { reason, usage }) => {
                    ctx.add_prompt_logprobs(sub, &mut lp);
                    let (reason, usage) = sub.finished(reason, usage);
                    ctx.on_finish(sub.choice, reason, &usage);
                    total.add(sub.choice, &usage);
                    let logprobs = want_logprobs.map(|_| lp.take(api));
                    let (text, tool_calls) = ctx.calls_of(sub.index, text);
                    choices.push(Choice { text, finish: reason, logprobs, tool_calls });
                    break;
                }
                Some(Output::Error { class, message }) => {
                    guard.abort();
                    return Err(ApiError::from_class(class, message));
                }
                // The planes keep KV notes to themselves; one that got here says nothing.
                Some(Output::Kv(_)) => {}
                None => {
                    guard.abort();
                    return Err(ApiError::internal("the worker stopped before the request ended"));
                }
            }
        }
    }
    guard.finish();
    s.metrics.e2e.observe(arrival.elapsed().as_secs_f64());
    s.metrics.request(api.label(), 200);
    s.live.served();
    let body = response(api, &id, created, &s.model.name, choices, total.total());
    Ok(json_response(StatusCode::OK, body))
}

/// `echo` with `max_tokens: 0`: each choice is its prompt's text, ended by length, with no
/// engine request.
fn echo_only(
    s: &Arc<Shared>,
    api: Api,
    mut guard: Guard,
    prep: Prepared,
    arrival: Instant,
) -> Response {
    let n = prep.n;
    let texts = prep.echo.unwrap_or_default();
    let mut total = UsageSum::default();
    for p in &prep.prompts {
        total.add_prompt(p.len());
    }
    let count = prep.prompts.len().saturating_mul(n);
    let text = |k: usize| texts.get(fanout::split_index(k, n).0).map_or("", |t| t);
    let id = response_id(api, RequestId(s.next_id.fetch_add(1, Ordering::Relaxed)));
    let created = unix_now();
    guard.finish();
    s.metrics.e2e.observe(arrival.elapsed().as_secs_f64());
    s.metrics.request(api.label(), 200);
    s.live.served();
    if prep.stream {
        let w = ChunkWriter::new(api, &id, created, &s.model.name);
        let mut buf = BytesMut::new();
        for k in 0..count {
            w.role(&mut buf, k);
            w.delta(&mut buf, k, text(k), None);
            w.finish(&mut buf, k, FinishReason::Length);
        }
        if prep.include_usage {
            w.usage(&mut buf, total.total());
        }
        w.done(&mut buf);
        return sse_response(Body::from(buf.freeze()));
    }
    let choices = (0..count)
        .map(|k| Choice {
            text: text(k).to_owned(),
            finish: FinishReason::Length,
            logprobs: None,
            tool_calls: None,
        })
        .collect();
    json_response(
        StatusCode::OK,
        response(api, &id, created, &s.model.name, choices, total.total()),
    )
}

/// What a request that ran past its deadline is told.
const TIMED_OUT: &str = "the request's timeout passed before it ended; it was cancelled";

fn cut_label(c: Cut) -> &'static str {
    match c {
        Cut::Unread => "unread",
        Cut::Deadline => "deadline",
    }
}

/// One choice's output stream.
struct Sub {
    /// Its engine request.
    id: RequestId,
    rx: UnboundedReceiver<Output>,
    pending: Option<Output>,
    last: Option<Instant>,
    started: bool,
    done: bool,
    /// Its OpenAI `index`.
    index: usize,
    /// Its place among its prompt's choices (0: the one that computed the prompt).
    choice: usize,
    /// The prompt text it starts with (`echo`).
    echo: Option<Arc<str>>,
    /// Its streamed text split into content and tool calls (chat with tools).
    split: StreamSplit,
    /// A scored prompt's tokens (`echo` with `logprobs`): the answer's log-probabilities
    /// start with them.
    scored: Option<Arc<[TokenId]>>,
    /// The scores of prompt tokens 1.. received so far.
    prompt_lp: Vec<kvx_proto::Logprob>,
    /// Whether the prompt's tokens went into the answer (later scores are ignored).
    prompt_done: bool,
    /// The generated token is not part of the answer (`max_tokens: 0`).
    score_only: bool,
}

impl Sub {
    fn new(
        id: RequestId,
        rx: UnboundedReceiver<Output>,
        index: usize,
        choice: usize,
        echo: Option<Arc<str>>,
    ) -> Self {
        Sub {
            id,
            rx,
            pending: None,
            last: None,
            started: false,
            done: false,
            index,
            choice,
            echo,
            split: StreamSplit::default(),
            scored: None,
            prompt_lp: Vec::new(),
            prompt_done: false,
            score_only: false,
        }
    }

    /// Scores of prompt tokens `start..`; those of a placement that started over replace
    /// the earlier ones from `start` on.
    fn prompt_scores(&mut self, start: u32, logprobs: Vec<kvx_proto::Logprob>) {
        let Some(p) = &self.scored else { return };
        if self.prompt_done {
            return;
        }
        let keep = (start as usize).saturating_sub(1).min(self.prompt_lp.len());
        self.prompt_lp.truncate(keep);
        self.prompt_lp.extend(logprobs);
        self.prompt_lp.truncate(p.len().saturating_sub(1));
    }

    /// The end as the client sees it: a request for no generated tokens ended by length,
    /// having generated none.
    fn finished(&self, reason: FinishReason, usage: Usage) -> (FinishReason, Usage) {
        if self.score_only && reason != FinishReason::Cancelled {
            (FinishReason::Length, Usage { completion_tokens: 0, ..usage })
        } else {
            (reason, usage)
        }
    }

    /// Waits for the first message that says something (its prompt's scores, its first
    /// token, its end or its error), kept in `pending`; an error is returned as the HTTP error it maps to.
    async fn first(&mut self) -> Result<(), ApiError> {
        loop {
            match self.rx.recv().await {
                // The planes keep KV notes to themselves; one that got here says nothing.
                Some(Output::Kv(_)) => {}
                Some(Output::Error { class, message }) => {
                    return Err(ApiError::from_class(class, message));
                }
                Some(o) => {
                    self.pending = Some(o);
                    return Ok(());
                }
                None => return Err(ApiError::unavailable("the worker went away")),
            }
        }
    }
}

/// What a request's output handling needs.
struct Ctx {
    shared: Arc<Shared>,
    api: Api,
    arrival: Instant,
    logprobs: Option<usize>,
    /// A chat request's tools.
    tools: Option<Arc<ToolMode>>,
    /// The response's id (tool calls' ids derive from it).
    id: String,
}

impl Ctx {
    /// A whole answer of choice `index` split into its content and its tool calls (`None`
    /// when it called none).
    fn calls_of(&self, index: usize, text: String) -> (String, Option<serde_json::Value>) {
        let Some(mode) = &self.tools else { return (text, None) };
        let (content, calls) = mode.split(&text);
        if calls.is_empty() {
            return (text, None);
        }
        let json = tools::calls_json(&calls, &format!("{}_{index}", self.id));
        (content.unwrap_or_default(), Some(json))
    }

    fn on_tokens(&self, sub: &mut Sub, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let m = &self.shared.metrics;
        match sub.last {
            // The time to first token is the prompt's: its other choices start later by
            // design (after the first one's prefill).
            None if sub.choice > 0 => {}
            None => {
                let d = now - self.arrival;
                m.ttft.observe(d.as_secs_f64());
                self.shared.live.ttft(d, n);
            }
            Some(t) => {
                let d = now - t;
                m.itl.observe(d.as_secs_f64());
                self.shared.live.itl(d, n);
            }
        }
        sub.last = Some(now);
    }

    /// Choice `choice` of its prompt ended: its prompt's tokens are counted with its first
    /// choice only.
    fn on_finish(&self, choice: usize, reason: FinishReason, usage: &Usage) {
        let m = &self.shared.metrics;
        if choice == 0 {
            m.input_tokens.inc_by(u64::from(usage.prompt_tokens));
            m.cached_tokens.inc_by(u64::from(usage.cached_tokens));
        }
        m.output_tokens.inc_by(u64::from(usage.completion_tokens));
        m.finished(reason.as_str());
    }

    /// Puts a scored prompt's tokens and their scores (the first has none) into `acc`, once.
    fn add_prompt_logprobs(&self, sub: &mut Sub, acc: &mut LogprobAcc) {
        let Some(p) = sub.scored.as_ref().filter(|_| !sub.prompt_done) else { return };
        sub.prompt_done = true;
        let tok = &self.shared.model.tokenizer;
        let n = self.logprobs.unwrap_or(0);
        for (i, &t) in p.iter().enumerate() {
            match i.checked_sub(1).and_then(|k| sub.prompt_lp.get(k)) {
                Some(lp) => acc.push(self.api, tok, t, lp, n),
                None => acc.push_unscored(self.api, tok, t),
            }
        }
        sub.prompt_lp = Vec::new();
    }

    fn add_logprobs(&self, acc: &mut LogprobAcc, tokens: &[u32], lps: &[kvx_proto::Logprob]) {
        if let Some(n) = self.logprobs {
            let tok = &self.shared.model.tokenizer;
            for (t, lp) in tokens.iter().zip(lps) {
                acc.push(self.api, tok, *t, lp, n);
            }
        }
    }
}

/// A streamed response: SSE events written as the engine's outputs arrive.
struct SseBody {
    /// Its relays' state (bytes waiting, and why it was cut).
    stream: Arc<StreamState>,
    ctx: Ctx,
    guard: Guard,
    writer: ChunkWriter,
    subs: Vec<Sub>,
    include_usage: bool,
    total: UsageSum,
    ended: bool,
}

impl SseBody {
    /// Writes one output of choice `i`.
    fn write(&mut self, buf: &mut BytesMut, i: usize, out: Output) {
        let Some(sub) = self.subs.get_mut(i) else { return };
        if let Output::PromptLogprobs { start, logprobs } = out {
            // They go out with the echoed prompt, before the first token.
            sub.prompt_scores(start, logprobs);
            return;
        }
        if !sub.started {
            sub.started = true;
            self.writer.role(buf, sub.index);
            if let Some(e) = sub.echo.clone() {
                let lp = sub.scored.is_some().then(|| {
                    let mut acc = LogprobAcc::default();
                    self.ctx.add_prompt_logprobs(sub, &mut acc);
                    acc.take(self.ctx.api)
                });
                self.writer.delta(buf, sub.index, &e, lp.as_ref());
            }
        }
        match out {
            Output::Delta(d) if sub.score_only => {
                self.ctx.on_tokens(sub, d.tokens.len());
                self.guard.produced(d.tokens.len());
            }
            Output::Delta(d) => {
                self.ctx.on_tokens(sub, d.tokens.len());
                self.guard.produced(d.tokens.len());
                let lp = if self.ctx.logprobs.is_some() {
                    let mut acc = LogprobAcc::default();
                    self.ctx.add_logprobs(&mut acc, &d.tokens, &d.logprobs);
                    (!acc.is_empty()).then(|| acc.take(self.ctx.api))
                } else {
                    None
                };
                let text = match &self.ctx.tools {
                    Some(mode) => std::borrow::Cow::Owned(sub.split.push(mode, &d.text)),
                    None => std::borrow::Cow::Borrowed(d.text.as_str()),
                };
                if !text.is_empty() || lp.is_some() {
                    self.writer.delta(buf, sub.index, &text, lp.as_ref());
                }
            }
            Output::Finished { reason, usage } => {
                sub.done = true;
                let (reason, usage) = sub.finished(reason, usage);
                self.ctx.on_finish(sub.choice, reason, &usage);
                self.total.add(sub.choice, &usage);
                let Some(mode) = &self.ctx.tools else {
                    self.writer.finish(buf, sub.index, reason);
                    return;
                };
                let (rest, calls) = std::mem::take(&mut sub.split).finish(mode);
                if let Some(r) = rest.filter(|r| !r.is_empty()) {
                    self.writer.delta(buf, sub.index, &r, None);
                }
                if calls.is_empty() {
                    self.writer.finish(buf, sub.index, reason);
                } else {
                    let id = format!("{}_{}", self.ctx.id, sub.index);
                    self.writer.tool_calls(buf, sub.index, &tools::calls_json(&calls, &id));
                    self.writer.finish_tool_calls(buf, sub.index);
                }
            }
            Output::Error { class, message } => {
                self.writer.error(buf, &ApiError::from_class(class, message).json());
                self.fail();
            }
            Output::Kv(_) | Output::PromptLogprobs { .. } => {}
        }
    }

    /// One choice failed: the stream ends (after the error already written), and the other
    /// choices' engine requests are cancelled.
    fn fail(&mut self) {
        self.guard.cancel_all();
        for s in &mut self.subs {
            s.done = true;
            s.pending = None;
        }
    }
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let mut buf = BytesMut::with_capacity(512);
        let mut written = 0;
        for i in 0..this.subs.len() {
            if this.subs[i].done {
                continue;
            }
            // Messages that write nothing (prompt scores, held until the first token) do not
            // count against the frame's bound: they must not end a poll with nothing written
            // and no waker registered.
            if let Some(o) = this.subs[i].pending.take() {
                let before = buf.len();
                this.write(&mut buf, i, o);
                written += usize::from(buf.len() > before);
            }
            while !this.subs[i].done && written < MAX_MESSAGES_PER_FRAME {
                match this.subs[i].rx.poll_recv(cx) {
                    Poll::Ready(Some(o)) => {
                        this.stream.taken(&o);
                        let before = buf.len();
                        this.write(&mut buf, i, o);
                        written += usize::from(buf.len() > before);
                    }
                    Poll::Ready(None) => {
                        let e = match this.stream.cut() {
                            Some(Cut::Deadline) => ApiError::deadline(TIMED_OUT),
                            Some(Cut::Unread) => ApiError::client_too_slow(format!(
                                "the client left more than {} bytes of the stream unread; the \
                                 request was cancelled",
                                this.ctx.shared.cfg.stream_buffer_bytes
                            )),
                            None => {
                                ApiError::internal("the worker stopped before the request ended")
                            }
                        };
                        this.writer.error(&mut buf, &e.json());
                        this.fail();
                    }
                    Poll::Pending => break,
                }
            }
        }
        if this.subs.iter().all(|s| s.done) {
            if this.include_usage {
                this.writer.usage(&mut buf, this.total.total());
            }
            this.writer.done(&mut buf);
            this.ended = true;
            this.guard.finish();
            let m = &this.ctx.shared.metrics;
            m.e2e.observe(this.ctx.arrival.elapsed().as_secs_f64());
            m.request(this.ctx.api.label(), 200);
            this.ctx.shared.live.served();
        }
        if buf.is_empty() {
            if this.ended { Poll::Ready(None) } else { Poll::Pending }
        } else {
            Poll::Ready(Some(Ok(Frame::data(buf.freeze()))))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

/// How often the running bound follows the engines' batch knees.
const KNEE_INTERVAL: Duration = Duration::from_secs(1);

/// Every [`KNEE_INTERVAL`], while the server lives, sets the admission's running bound to the
/// decoding workers' batch knees ([`knee_sum`]).
async fn follow_knees(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(KNEE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(s) = shared.upgrade() else { return };
        if let Some(n) = knee_sum(&s.dispatcher.workers()) {
            s.admission.set_running_bound(n);
        }
    }
}

/// The sum of the live decoding (and aggregated) workers' batch knees, their sequence slots
/// where a knee is not known yet; workers that report neither (not reported yet, or built
/// before knees) are left out. `None` without any that reports.
pub(crate) fn knee_sum(workers: &[WorkerState]) -> Option<usize> {
    let mut sum = None;
    for w in workers.iter().filter(|w| w.alive && w.role != WorkerRole::Prefill) {
        let l = &w.metrics.load;
        let k = if l.batch_knee > 0 { l.batch_knee } else { l.seq_slots };
        if k > 0 {
            sum = Some(sum.unwrap_or(0) + k as usize);
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use kvx_proto::{LoadReport, WorkerMetrics};

    use super::*;

    #[test]
    fn the_running_bound_is_the_decoding_workers_knees() {
        let w = |id, role, alive, seq_slots, batch_knee| WorkerState {
            id,
            alive,
            role,
            metrics: WorkerMetrics {
                load: LoadReport { worker_id: id, seq_slots, batch_knee, ..Default::default() },
                ..Default::default()
            },
        };
        let (p, d, g) = (WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Agg);
        // Knees where known, slots where not; prefill workers and dead ones do not count.
        let ws = [w(0, p, true, 64, 9), w(1, d, true, 64, 18), w(2, d, true, 64, 0)];
        assert_eq!(knee_sum(&ws), Some(82));
        assert_eq!(knee_sum(&[w(1, g, true, 64, 20), w(2, g, false, 64, 20)]), Some(20));
        // One that reports neither is left out; nothing to follow when none decodes or
        // reports.
        assert_eq!(knee_sum(&[w(1, d, true, 64, 18), w(2, d, true, 0, 0)]), Some(18));
        assert_eq!(knee_sum(&[w(0, p, true, 64, 9)]), None);
        assert_eq!(knee_sum(&[w(2, d, true, 0, 0)]), None);
    }
}

//! A small etcd v3 client over etcd's own HTTP/JSON gateway (`/v3/...`, part of every etcd
//! since 3.3): leases (grant, keep-alive, revoke), puts, prefix ranges and prefix watches.
//! Keys and values travel base64-encoded, 64-bit numbers as strings, as the gateway has them.
//!
//! (The gRPC client crates generate their code with `protoc` at build time, which a fresh
//! machine does not have; the gateway needs nothing but HTTP.)

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::tls::{EtcdConnector, describe, tls_failure};
use crate::{DiscoveryError, EtcdConfig, EtcdCredentials};

/// Largest response body read (a range of the whole namespace included).
const MAX_BODY: usize = 64 << 20;

/// An etcd cluster, reached through any of its endpoints (tried in turn).
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    client: Client<EtcdConnector, Full<Bytes>>,
    next: AtomicUsize,
    timeout: Duration,
    /// The user and password calls authenticate as, if any.
    user: Option<Login>,
    /// Whether a client certificate is configured (for naming TLS refusals).
    client_cert: bool,
}

/// A user, its password and the token etcd granted last (none yet, or forgotten).
struct Login {
    name: String,
    password: String,
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login").field("name", &self.name).finish_non_exhaustive()
    }
}

impl Login {
    fn token(&self) -> Option<String> {
        self.token.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set_token(&self, t: Option<String>) {
        *self.token.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = t;
    }
}

/// One change a watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was written.
    Put {
        /// The key.
        key: String,
        /// Its value.
        value: Vec<u8>,
    },
    /// A key was deleted (or its lease expired).
    Delete {
        /// The key.
        key: String,
    },
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

fn unb64(v: &Value) -> Result<Vec<u8>, DiscoveryError> {
    let s = v.as_str().unwrap_or_default();
    B64.decode(s).map_err(|e| DiscoveryError::Protocol(format!("bad base64 from etcd: {e}")))
}

fn key_of(v: &Value) -> Result<String, DiscoveryError> {
    String::from_utf8(unb64(v)?)
        .map_err(|_| DiscoveryError::Protocol("a key that is not UTF-8".into()))
}

/// A 64-bit number the gateway sends as a string (or omits when zero).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The end of the range of keys starting with `prefix`.
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The error message of a gateway answer: `{"error": "...", "message": "..."}` for a call,
/// `{"error": {"message": "..."}}` inside a stream; empty when there is none.
fn error_message(v: &Value) -> String {
    let e = &v["error"];
    v["message"]
        .as_str()
        .or(e.as_str())
        .or(e["message"].as_str())
        .map(str::to_string)
        .unwrap_or_else(|| if e.is_null() { String::new() } else { e.to_string() })
}

/// Whether etcd refused a call for its token (expired, unknown after a restart, issued
/// before the users or roles changed, or missing), which a fresh token cures.
fn needs_new_token(msg: &str) -> bool {
    ["invalid auth token", "revision of auth store is old", "user name is empty"]
        .iter()
        .any(|m| msg.contains(m))
}

/// `e` and its causes, for a person.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

impl Etcd {
    /// A client of the cluster at `endpoints` (`http://host:port`, at least one), without
    /// credentials.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Self, DiscoveryError> {
        Self::with_credentials(endpoints, timeout, &EtcdCredentials::default())
    }

    /// A client of the cluster `cfg` names, with its credentials.
    pub fn from_config(cfg: &EtcdConfig) -> Result<Self, DiscoveryError> {
        Self::with_credentials(&cfg.endpoints, cfg.timeout, &cfg.credentials)
    }

    /// A client of the cluster at `endpoints` (all `http://host:port`, or all
    /// `https://host:port` with `creds.ca`), presenting `creds`.
    pub fn with_credentials(
        endpoints: &[String],
        timeout: Duration,
        creds: &EtcdCredentials,
    ) -> Result<Self, DiscoveryError> {
        let config = |s: &str| Err(DiscoveryError::Config(s.into()));
        let endpoints: Vec<String> =
            endpoints.iter().map(|e| e.trim_end_matches('/').to_string()).collect();
        let https = endpoints.iter().filter(|e| e.starts_with("https://")).count();
        let http = endpoints.iter().filter(|e| e.starts_with("http://")).count();
        if endpoints.is_empty() || https + http != endpoints.len() {
            return config("etcd endpoints must be http://host:port or https://host:port URLs");
        }
        if https > 0 && http > 0 {
            return config("etcd endpoints are all https:// or all http://, not a mix");
        }
        let tls = match (&creds.ca, https > 0) {
            (Some(ca), true) => Some(crate::tls::client_config(ca, creds.client_cert.as_ref())?),
            (None, true) => {
                return config(
                    "https:// etcd endpoints need --etcd-ca PEM (the CA that signed etcd's \
                     certificate)",
                );
            }
            (_, false) if creds.ca.is_some() || creds.client_cert.is_some() => {
                return config("--etcd-ca, --etcd-cert and --etcd-key need https:// endpoints");
            }
            (_, false) => None,
        };
        let user = match &creds.user {
            Some((name, _)) if name.is_empty() => return config("an empty etcd user name"),
            Some((_, password)) if password.is_empty() => return config("an empty etcd password"),
            Some((name, password)) => Some(Login {
                name: name.clone(),
                password: password.clone(),
                token: Mutex::new(None),
            }),
            None => None,
        };
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(timeout));
        http.set_nodelay(true);
        http.enforce_http(false);
        let client =
            Client::builder(TokioExecutor::new()).build(EtcdConnector::new(http, tls.clone()));
        Ok(Etcd {
            endpoints,
            client,
            next: AtomicUsize::new(0),
            timeout,
            user,
            client_cert: creds.client_cert.is_some(),
        })
    }

    fn request(
        &self,
        endpoint: &str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<hyper::Request<Full<Bytes>>, DiscoveryError> {
        let mut r = hyper::Request::new(Full::new(Bytes::from(body.to_string())));
        *r.method_mut() = hyper::Method::POST;
        *r.uri_mut() = format!("{endpoint}{path}").parse().unwrap_or_default();
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        if let Some(t) = token {
            let v = hyper::header::HeaderValue::from_str(t)
                .map_err(|_| DiscoveryError::Protocol("etcd granted an unusable token".into()))?;
            r.headers_mut().insert(hyper::header::AUTHORIZATION, v);
        }
        Ok(r)
    }

    /// What a failed exchange with `endpoint` means: TLS refusals named, the rest "away".
    fn failure(&self, endpoint: &str, e: &(dyn std::error::Error + 'static)) -> DiscoveryError {
        match tls_failure(e) {
            Some(t) => {
                DiscoveryError::Tls(format!("{endpoint}: {}", describe(&t, self.client_cert)))
            }
            None => DiscoveryError::Unavailable(format!("{endpoint}: {}", chain(e))),
        }
    }

    /// Sends `body` to `path` on the first endpoint that answers; its status and JSON.
    async fn post(
        &self,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<(StatusCode, Value), DiscoveryError> {
        let n = self.endpoints.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut last = DiscoveryError::Unavailable("no endpoint tried".into());
        for i in 0..n {
            let at = (start + i) % n;
            let ep = &self.endpoints[at];
            let req = self.request(ep, path, body, token)?;
            let res = tokio::time::timeout(self.timeout, async {
                let resp = self.client.request(req).await.map_err(|e| self.failure(ep, &e))?;
                let status = resp.status();
                let bytes = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
                    .collect()
                    .await
                    .map_err(|e| self.failure(ep, &*e))?
                    .to_bytes();
                Ok::<_, DiscoveryError>((status, bytes))
            })
            .await;
            match res {
                Ok(Ok((status, bytes))) => {
                    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
                        DiscoveryError::Protocol(format!(
                            "{ep} answered {path} with {status} and no JSON ({e}): is it etcd?"
                        ))
                    })?;
                    self.next.store(at, Ordering::Relaxed);
                    return Ok((status, v));
                }
                // A certificate refused by one member is refused by all.
                Ok(Err(e @ DiscoveryError::Tls(_))) => return Err(e),
                Ok(Err(e)) => last = e,
                Err(_) => last = DiscoveryError::Unavailable(format!("{ep}: timed out")),
            }
        }
        Err(last)
    }

    /// What etcd's refusal of `path` (`status`, `msg`) means.
    fn refusal(&self, path: &str, status: StatusCode, msg: &str) -> DiscoveryError {
        if self.user.is_none() && msg.contains("user name is empty") {
            return DiscoveryError::Auth(format!(
                "etcd requires a user: give --etcd-user and --etcd-password-file ({msg})"
            ));
        }
        if status == StatusCode::UNAUTHORIZED
            || needs_new_token(msg)
            || msg.contains("permission denied")
        {
            let who = self.user.as_ref().map_or("no user", |u| u.name.as_str());
            return DiscoveryError::Auth(format!("{path} as {who:?}: {msg}"));
        }
        DiscoveryError::Refused(format!("{path}: {status} {msg}"))
    }

    /// Asks etcd for a fresh token for the configured user (none without a user).
    pub async fn authenticate(&self) -> Result<Option<String>, DiscoveryError> {
        let Some(login) = &self.user else { return Ok(None) };
        login.set_token(None);
        let body = json!({ "name": login.name, "password": login.password });
        let (status, v) = self.post("/v3/auth/authenticate", &body, None).await?;
        let msg = error_message(&v);
        if !status.is_success() || !msg.is_empty() {
            return Err(DiscoveryError::Auth(format!(
                "etcd refused user {:?}: {msg} ({status})",
                login.name
            )));
        }
        match v["token"].as_str().filter(|t| !t.is_empty()) {
            Some(t) => {
                login.set_token(Some(t.to_string()));
                tracing::debug!(user = %login.name, "authenticated with etcd");
                Ok(Some(t.to_string()))
            }
            None => Err(DiscoveryError::Auth(format!(
                "etcd granted user {:?} no token: is authentication enabled in etcd?",
                login.name
            ))),
        }
    }

    /// The token to send: the last one granted, or a fresh one.
    async fn token(&self) -> Result<Option<String>, DiscoveryError> {
        match self.user.as_ref().map(Login::token) {
            Some(Some(t)) => Ok(Some(t)),
            Some(None) => self.authenticate().await,
            None => Ok(None),
        }
    }

    /// Sends `body` to `path`; the answer's JSON. A token etcd no longer accepts is
    /// replaced (once per call) and the call sent again.
    async fn call(&self, path: &str, body: Value) -> Result<Value, DiscoveryError> {
        let mut token = self.token().await?;
        let mut renewed = false;
        loop {
            let (status, v) = self.post(path, &body, token.as_deref()).await?;
            let msg = error_message(&v);
            if status.is_success() && v.get("error").is_none() {
                return Ok(v);
            }
            if self.user.is_some() && !renewed && needs_new_token(&msg) {
                tracing::info!(path, "etcd refused the auth token ({msg}); authenticating again");
                renewed = true;
                token = self.authenticate().await?;
                continue;
            }
            return Err(self.refusal(path, status, &msg));
        }
    }

    /// Checks that etcd answers and accepts these credentials: authenticates (with a user)
    /// and reads the keys under `prefix` (a count only). An error that is not
    /// [transient](DiscoveryError::is_transient) will not go away by trying again.
    pub async fn check(&self, prefix: &str) -> Result<(), DiscoveryError> {
        self.authenticate().await?;
        let body = json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "count_only": true,
        });
        self.call("/v3/kv/range", body).await.map(|_| ())
    }

    /// [`Etcd::check`] for `cfg`, from synchronous code (inside a runtime or not: it runs
    /// on a thread of its own), before anything starts. `Ok(None)`: etcd accepts the
    /// credentials; `Ok(Some(e))`: etcd does not answer yet, a transient error that
    /// discovery's own retries will outlast; `Err`: etcd refuses them (or the settings are
    /// wrong), which trying again will not mend.
    pub fn check_at_start(cfg: &EtcdConfig) -> Result<Option<DiscoveryError>, DiscoveryError> {
        let cfg = cfg.clone();
        let verdict = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| DiscoveryError::Protocol(format!("starting a runtime: {e}")))?;
            rt.block_on(async { Etcd::from_config(&cfg)?.check(&cfg.workers_prefix()).await })
        })
        .join()
        .map_err(|_| DiscoveryError::Protocol("the etcd check panicked".into()))?;
        match verdict {
            Ok(()) => Ok(None),
            Err(e) if e.is_transient() => Ok(Some(e)),
            Err(e) => Err(e),
        }
    }

    /// A lease of `ttl` seconds; its id.
    pub async fn grant(&self, ttl: u64) -> Result<i64, DiscoveryError> {
        let v = self.call("/v3/lease/grant", json!({ "TTL": ttl })).await?;
        match int(&v["ID"]) {
            0 => Err(DiscoveryError::Protocol("lease grant without an id".into())),
            id => Ok(id),
        }
    }

    /// Renews a lease; its remaining TTL (0: the lease no longer exists).
    pub async fn keepalive(&self, lease: i64) -> Result<i64, DiscoveryError> {
        let v = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        Ok(int(&v["result"]["TTL"]))
    }

    /// Ends a lease and deletes its keys.
    pub async fn revoke(&self, lease: i64) -> Result<(), DiscoveryError> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(|_| ())
    }

    /// Writes `key` = `value`, bound to `lease` (0: none).
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), DiscoveryError> {
        let mut body = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        self.call("/v3/kv/put", body).await.map(|_| ())
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) -> Result<(), DiscoveryError> {
        self.call("/v3/kv/deleterange", json!({ "key": b64(key.as_bytes()) })).await.map(|_| ())
    }

    /// Every key under `prefix` with its value, and the store's revision.
    pub async fn range(
        &self,
        prefix: &str,
    ) -> Result<(i64, Vec<(String, Vec<u8>)>), DiscoveryError> {
        let body = json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)) });
        let v = self.call("/v3/kv/range", body).await?;
        let rev = int(&v["header"]["revision"]);
        let mut out = Vec::new();
        for kv in v["kvs"].as_array().map(Vec::as_slice).unwrap_or_default() {
            out.push((key_of(&kv["key"])?, unb64(&kv["value"])?));
        }
        Ok((rev, out))
    }

    /// Watches the keys under `prefix` from revision `from` on, once etcd has created the
    /// watch (a watch refused for its token is asked for again with a fresh one).
    pub async fn watch(&self, prefix: &str, from: i64) -> Result<Watch, DiscoveryError> {
        let body = json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": from.to_string(),
        }});
        let mut token = self.token().await?;
        let mut renewed = false;
        loop {
            let mut w = self.open_watch(&body, token.as_deref()).await?;
            let created = tokio::time::timeout(self.timeout, w.created())
                .await
                .map_err(|_| DiscoveryError::Unavailable("etcd created no watch".into()))??;
            let reason = match created {
                Ok(()) => return Ok(w),
                Err(reason) => reason,
            };
            if self.user.is_some() && !renewed && needs_new_token(&reason) {
                tracing::info!(
                    "etcd refused the watch's auth token ({reason}); authenticating again"
                );
                renewed = true;
                token = self.authenticate().await?;
                continue;
            }
            return Err(self.refusal("/v3/watch", StatusCode::OK, &reason));
        }
    }

    /// Sends a watch's create request to the first endpoint that answers.
    async fn open_watch(&self, body: &Value, token: Option<&str>) -> Result<Watch, DiscoveryError> {
        let n = self.endpoints.len();
        let mut last = DiscoveryError::Unavailable("no endpoint tried".into());
        for i in 0..n {
            let ep = &self.endpoints[(self.next.load(Ordering::Relaxed) + i) % n];
            let req = self.request(ep, "/v3/watch", body, token)?;
            match tokio::time::timeout(self.timeout, self.client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    return Ok(Watch { body: resp.into_body(), buf: Vec::new(), pending: None });
                }
                Ok(Ok(resp)) => {
                    last = DiscoveryError::Refused(format!("watch: {}", resp.status()));
                }
                Ok(Err(e)) => match self.failure(ep, &e) {
                    e @ DiscoveryError::Tls(_) => return Err(e),
                    e => last = e,
                },
                Err(_) => last = DiscoveryError::Unavailable(format!("{ep}: timed out")),
            }
        }
        Err(last)
    }
}

/// A watch's stream of changes.
#[derive(Debug)]
pub struct Watch {
    body: Incoming,
    buf: Vec<u8>,
    /// Changes that came with the creation message, not yet handed out.
    pending: Option<Vec<WatchEvent>>,
}

impl Watch {
    /// The next batch of changes (possibly empty, for progress messages); an error when the
    /// stream ends or breaks.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>, DiscoveryError> {
        if let Some(batch) = self.pending.take() {
            return Ok(batch);
        }
        let v = self.message().await?;
        events(&v)
    }

    /// Waits for etcd's answer to the create request: `Ok(Err(reason))` when etcd refused
    /// the watch.
    async fn created(&mut self) -> Result<Result<(), String>, DiscoveryError> {
        let v = self.message().await?;
        let r = &v["result"];
        if v.get("error").is_some() {
            return Ok(Err(error_message(&v)));
        }
        if r["canceled"].as_bool() == Some(true) {
            let reason = r["cancel_reason"].as_str().unwrap_or("the watch was cancelled");
            return Ok(Err(reason.to_string()));
        }
        let batch = events(&v)?;
        if !batch.is_empty() {
            self.pending = Some(batch);
        }
        Ok(Ok(()))
    }

    /// The next complete JSON message of the stream.
    async fn message(&mut self) -> Result<Value, DiscoveryError> {
        loop {
            let mut it = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
            match it.next() {
                Some(Ok(v)) => {
                    let used = it.byte_offset();
                    self.buf.drain(..used);
                    return Ok(v);
                }
                Some(Err(e)) if !e.is_eof() => {
                    return Err(DiscoveryError::Protocol(format!("watch message: {e}")));
                }
                _ => {}
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        if self.buf.len() + data.len() > MAX_BODY {
                            return Err(DiscoveryError::Protocol(
                                "a watch message too large".into(),
                            ));
                        }
                        self.buf.extend_from_slice(data);
                    }
                }
                Some(Err(e)) => {
                    return Err(DiscoveryError::Unavailable(format!("watch: {}", chain(&e))));
                }
                None => return Err(DiscoveryError::Unavailable("the watch ended".into())),
            }
        }
    }
}

/// The changes one watch message reports; an error for a broken or cancelled watch.
fn events(v: &Value) -> Result<Vec<WatchEvent>, DiscoveryError> {
    if v.get("error").is_some() {
        return Err(DiscoveryError::Unavailable(format!("watch: {}", error_message(v))));
    }
    let r = &v["result"];
    if r["canceled"].as_bool() == Some(true) {
        let reason = r["cancel_reason"].as_str().unwrap_or_default();
        return Err(DiscoveryError::Unavailable(format!("the watch was cancelled {reason}")));
    }
    let mut out = Vec::new();
    for ev in r["events"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let key = key_of(&ev["kv"]["key"])?;
        if ev["type"].as_str() == Some("DELETE") {
            out.push(WatchEvent::Delete { key });
        } else {
            out.push(WatchEvent::Put { key, value: unb64(&ev["kv"]["value"])? });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_every_key_that_starts_with_it() {
        assert_eq!(prefix_end("/kvx/a/"), b"/kvx/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn gateway_numbers_come_as_strings_or_numbers() {
        assert_eq!(int(&json!("7587899294616949253")), 7_587_899_294_616_949_253);
        assert_eq!(int(&json!(5)), 5);
        assert_eq!(int(&Value::Null), 0);
    }

    #[test]
    fn refusals_that_a_fresh_token_cures_are_told_apart() {
        let refused = json!({ "error": "etcdserver: invalid auth token", "code": 16 });
        assert!(needs_new_token(&error_message(&refused)));
        let streamed = json!({ "error": { "message": "etcdserver: user name is empty" } });
        assert!(needs_new_token(&error_message(&streamed)));
        let wrong =
            json!({ "message": "etcdserver: authentication failed, invalid user ID or password" });
        assert!(!needs_new_token(&error_message(&wrong)));
        assert_eq!(error_message(&json!({ "result": {} })), "");
    }

    /// A stand-in for etcd's gateway with authentication on: it grants tokens `t1`, `t2`...
    /// for user `u` with password `pw`, accepts only the last one granted, and forgets it
    /// when told to (a token that expired).
    struct Gateway {
        token: Mutex<String>,
        grants: AtomicUsize,
    }

    impl Gateway {
        fn forget(&self) {
            self.token.lock().map(|mut t| t.clear()).ok();
        }

        fn answer(&self, path: &str, auth: &str, body: &Value) -> (u16, Vec<Value>) {
            let valid = self.token.lock().map(|t| !t.is_empty() && *t == auth).unwrap_or(false);
            let invalid = json!({ "error": "etcdserver: invalid auth token", "code": 16 });
            match path {
                "/v3/auth/authenticate" if body["name"] == "u" && body["password"] == "pw" => {
                    let n = self.grants.fetch_add(1, Ordering::SeqCst) + 1;
                    let t = format!("t{n}");
                    self.token.lock().map(|mut g| *g = t.clone()).ok();
                    (200, vec![json!({ "token": t })])
                }
                "/v3/auth/authenticate" => (
                    400,
                    vec![json!({
                        "error": "etcdserver: authentication failed, invalid user ID or password",
                        "code": 3
                    })],
                ),
                "/v3/kv/range" if valid => (200, vec![json!({ "header": { "revision": "7" } })]),
                "/v3/watch" if valid => {
                    let ev =
                        json!({ "type": "PUT", "kv": { "key": b64(b"/p/1"), "value": b64(b"x") } });
                    let created = json!({ "result": { "created": true } });
                    (200, vec![created, json!({ "result": { "events": [ev] } })])
                }
                "/v3/watch" => {
                    let reason =
                        "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token";
                    let r = json!({ "result": { "created": true, "canceled": true, "cancel_reason": reason } });
                    (200, vec![r])
                }
                _ => (401, vec![invalid]),
            }
        }
    }

    /// Serves one HTTP/1.1 request on `s` (then closes it).
    async fn serve_one(gw: &Gateway, mut s: tokio::net::TcpStream) -> std::io::Result<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = Vec::new();
        let head_end = loop {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let path = head.split(' ').nth(1).unwrap_or_default().to_string();
        let header = |name: &str| {
            head.lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let len: usize = header("content-length").parse().unwrap_or(0);
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let body: Value = serde_json::from_slice(&buf[head_end..]).unwrap_or(Value::Null);
        let (status, msgs) = gw.answer(&path, &header("authorization"), &body);
        let text: String = msgs.iter().map(|m| format!("{m}\n")).collect();
        let resp = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{text}"
        );
        s.write_all(resp.as_bytes()).await?;
        s.shutdown().await
    }

    #[tokio::test]
    async fn a_token_etcd_no_longer_accepts_is_replaced_for_calls_and_watches() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let gw = std::sync::Arc::new(Gateway {
            token: Mutex::new(String::new()),
            grants: AtomicUsize::new(0),
        });
        let served = gw.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let gw = served.clone();
                tokio::spawn(async move { serve_one(&gw, s).await });
            }
        });
        let creds = |pw: &str| EtcdCredentials {
            user: Some(("u".to_string(), pw.to_string())),
            ..EtcdCredentials::default()
        };
        let eps = [format!("http://{addr}")];
        let etcd =
            Etcd::with_credentials(&eps, Duration::from_secs(2), &creds("pw")).expect("client");
        etcd.check("/p/").await.expect("the right password is accepted");
        assert_eq!(etcd.range("/p/").await.expect("range").0, 7);
        let grants = gw.grants.load(Ordering::SeqCst);

        // The token expires: the next call authenticates again and goes through.
        gw.forget();
        assert_eq!(etcd.range("/p/").await.expect("range after expiry").0, 7);
        assert_eq!(gw.grants.load(Ordering::SeqCst), grants + 1);

        // So does a watch that etcd cancels for its token.
        gw.forget();
        let mut w = etcd.watch("/p/", 8).await.expect("watch after expiry");
        assert_eq!(gw.grants.load(Ordering::SeqCst), grants + 2);
        let put = WatchEvent::Put { key: "/p/1".into(), value: b"x".to_vec() };
        assert_eq!(w.next().await.expect("events"), vec![put]);

        // A wrong password is an authentication error, not "etcd away".
        let wrong =
            Etcd::with_credentials(&eps, Duration::from_secs(2), &creds("nope")).expect("client");
        let e = wrong.check("/p/").await.expect_err("a wrong password is refused");
        assert!(matches!(e, DiscoveryError::Auth(_)) && !e.is_transient(), "{e}");
        assert!(e.to_string().contains("authentication failed"), "{e}");
    }

    #[test]
    fn bad_endpoints_are_refused() {
        assert!(Etcd::new(&[], Duration::from_secs(1)).is_err());
        assert!(Etcd::new(&["127.0.0.1:2379".into()], Duration::from_secs(1)).is_err());
        // https:// needs a CA; a CA or client certificate needs https://; no mixing.
        let https = ["https://127.0.0.1:2379".to_string()];
        let t = Duration::from_secs(1);
        assert!(Etcd::new(&https, t).is_err());
        let ca = EtcdCredentials { ca: Some("ca.pem".into()), ..EtcdCredentials::default() };
        assert!(Etcd::with_credentials(&["http://127.0.0.1:2379".into()], t, &ca).is_err());
        let mixed = [https[0].clone(), "http://127.0.0.1:2380".to_string()];
        assert!(Etcd::with_credentials(&mixed, t, &ca).is_err());
        let missing = Etcd::with_credentials(&https, t, &ca).expect_err("no such CA file");
        assert!(missing.to_string().contains("--etcd-ca"), "{missing}");
    }
}

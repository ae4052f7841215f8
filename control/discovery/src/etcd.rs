//! A small etcd v3 client over etcd's own HTTP/JSON gateway (`/v3/...`, part of every etcd
//! since 3.3): leases (grant, keep-alive, revoke), puts, prefix ranges and prefix watches.
//! Keys and values travel base64-encoded, 64-bit numbers as strings, as the gateway has them.
//!
//! (The gRPC client crates generate their code with `protoc` at build time, which a fresh
//! machine does not have; the gateway needs nothing but HTTP.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::DiscoveryError;

/// Largest response body read (a range of the whole namespace included).
const MAX_BODY: usize = 64 << 20;

/// An etcd cluster, reached through any of its endpoints (tried in turn).
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    client: Client<HttpConnector, Full<Bytes>>,
    next: AtomicUsize,
    timeout: Duration,
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

impl Etcd {
    /// A client of the cluster at `endpoints` (`http://host:port`, at least one).
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Self, DiscoveryError> {
        let endpoints: Vec<String> =
            endpoints.iter().map(|e| e.trim_end_matches('/').to_string()).collect();
        if endpoints.is_empty() || endpoints.iter().any(|e| !e.starts_with("http://")) {
            return Err(DiscoveryError::Config(
                "etcd endpoints must be http://host:port URLs (at least one)".into(),
            ));
        }
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(timeout));
        http.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(http);
        Ok(Etcd { endpoints, client, next: AtomicUsize::new(0), timeout })
    }

    fn request(&self, endpoint: &str, path: &str, body: &Value) -> hyper::Request<Full<Bytes>> {
        let mut r = hyper::Request::new(Full::new(Bytes::from(body.to_string())));
        *r.method_mut() = hyper::Method::POST;
        *r.uri_mut() = format!("{endpoint}{path}").parse().unwrap_or_default();
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        r
    }

    /// Sends `body` to `path` on the first endpoint that answers; the response's JSON.
    async fn call(&self, path: &str, body: Value) -> Result<Value, DiscoveryError> {
        let n = self.endpoints.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut last = DiscoveryError::Unavailable("no endpoint tried".into());
        for i in 0..n {
            let at = (start + i) % n;
            let ep = &self.endpoints[at];
            let req = self.request(ep, path, &body);
            let res = tokio::time::timeout(self.timeout, async {
                let resp = self.client.request(req).await?;
                let status = resp.status();
                let bytes = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
                    .collect()
                    .await
                    .map_err(|e| DiscoveryError::Unavailable(format!("reading: {e}")))?
                    .to_bytes();
                Ok::<_, DiscoveryError>((status, bytes))
            })
            .await;
            match res {
                Ok(Ok((status, bytes))) => {
                    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
                        DiscoveryError::Protocol(format!("etcd answered {path} with bad JSON: {e}"))
                    })?;
                    if !status.is_success() {
                        let msg = v["message"].as_str().or(v["error"].as_str()).unwrap_or("");
                        return Err(DiscoveryError::Refused(format!("{path}: {status} {msg}")));
                    }
                    self.next.store(at, Ordering::Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = DiscoveryError::Unavailable(format!("{ep}: timed out")),
            }
        }
        Err(last)
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

    /// Watches the keys under `prefix` from revision `from` on.
    pub async fn watch(&self, prefix: &str, from: i64) -> Result<Watch, DiscoveryError> {
        let body = json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": from.to_string(),
        }});
        let n = self.endpoints.len();
        let mut last = DiscoveryError::Unavailable("no endpoint tried".into());
        for i in 0..n {
            let ep = &self.endpoints[(self.next.load(Ordering::Relaxed) + i) % n];
            let req = self.request(ep, "/v3/watch", &body);
            match tokio::time::timeout(self.timeout, self.client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    return Ok(Watch { body: resp.into_body(), buf: Vec::new() });
                }
                Ok(Ok(resp)) => {
                    last = DiscoveryError::Refused(format!("watch: {}", resp.status()));
                }
                Ok(Err(e)) => last = e.into(),
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
}

impl Watch {
    /// The next batch of changes (possibly empty, for progress messages); an error when the
    /// stream ends or breaks.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>, DiscoveryError> {
        loop {
            if let Some(batch) = self.parse()? {
                return Ok(batch);
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
                Some(Err(e)) => return Err(DiscoveryError::Unavailable(format!("watch: {e}"))),
                None => return Err(DiscoveryError::Unavailable("the watch ended".into())),
            }
        }
    }

    /// One complete JSON message from the buffer, as events.
    fn parse(&mut self) -> Result<Option<Vec<WatchEvent>>, DiscoveryError> {
        let mut it = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
        let v = match it.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) if e.is_eof() => return Ok(None),
            Some(Err(e)) => return Err(DiscoveryError::Protocol(format!("watch message: {e}"))),
            None => return Ok(None),
        };
        let used = it.byte_offset();
        self.buf.drain(..used);
        if let Some(err) = v.get("error") {
            return Err(DiscoveryError::Unavailable(format!("watch: {err}")));
        }
        let r = &v["result"];
        if r["canceled"].as_bool() == Some(true) {
            return Err(DiscoveryError::Unavailable("the watch was cancelled".into()));
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
        Ok(Some(out))
    }
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
    fn bad_endpoints_are_refused() {
        assert!(Etcd::new(&[], Duration::from_secs(1)).is_err());
        assert!(Etcd::new(&["127.0.0.1:2379".into()], Duration::from_secs(1)).is_err());
    }
}

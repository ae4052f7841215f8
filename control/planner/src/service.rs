//! `kvx planner` as a process: every interval it reads the frontend's metrics over HTTP —
//! its `/metrics`, or a Prometheus server's `/federate` of the `kvx_*` series it scrapes from
//! the frontends (summed over them) — ticks the [`Driver`], writes each decision as one JSON
//! line (stdout and, when asked, a file), and serves its own metrics at `/metrics`.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;

use crate::driver::Driver;

/// Why the planner stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A socket or file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// An address is not `host:port` or `http://host:port`.
    #[error("address {0:?}: give host:port or http://host:port")]
    Address(String),
}

/// Where the frontends' metrics are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A frontend's `/metrics` (`http://host:port`).
    Frontend(String),
    /// A Prometheus server (`http://host:port`) that scrapes the frontends: its
    /// `/federate` endpoint, for the series `selector` picks (the `kvx_*` series of one job,
    /// say), each the sum over the frontends. The values are those of the last scrape.
    Prometheus {
        /// The server.
        url: String,
        /// A series selector.
        selector: String,
    },
}

/// The selector `kvx planner --prometheus-url` uses by default: every `kvx_*` series.
pub const DEFAULT_SELECTOR: &str = "{__name__=~\"kvx_.+\"}";

impl Source {
    /// The server's `host:port` and the path read.
    fn target(&self) -> Result<(String, String), ServiceError> {
        let (url, path) = match self {
            Source::Frontend(u) => (u, "/metrics".to_string()),
            Source::Prometheus { url, selector } => {
                let q = percent_encoding::utf8_percent_encode(
                    selector,
                    percent_encoding::NON_ALPHANUMERIC,
                );
                (url, format!("/federate?match%5B%5D={q}"))
            }
        };
        let authority = url.trim_start_matches("http://").trim_end_matches('/').to_string();
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(ServiceError::Address(url.clone()));
        }
        Ok((authority, path))
    }
}

/// The process's settings.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Where the metrics are read.
    pub source: Source,
    /// A bearer token sent with each read (a frontend's admin key).
    pub bearer: Option<String>,
    /// Seconds between ticks.
    pub interval: Duration,
    /// Where the planner's own `/metrics` listens.
    pub metrics_listen: SocketAddr,
    /// A file that gets every decision as a JSON line.
    pub decisions: Option<PathBuf>,
    /// Stop after this many decisions.
    pub ticks: Option<u64>,
}

/// `path` of `authority`, at most 16 MiB of it.
async fn fetch(authority: &str, path: &str, bearer: Option<&str>) -> Result<String, String> {
    let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = hyper::Request::get(path).header(hyper::header::HOST, authority);
    if let Some(t) = bearer {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status()));
    }
    let body =
        Limited::new(resp.into_body(), 16 << 20).collect().await.map_err(|e| e.to_string())?;
    String::from_utf8(body.to_bytes().to_vec()).map_err(|_| "not UTF-8".to_string())
}

/// Runs until `shutdown` completes or `ticks` decisions were made; `listening` is told the
/// metrics address once bound. The driver (and with it a local connector's workers) is
/// dropped on return.
pub async fn run(
    mut driver: Driver,
    cfg: ServiceConfig,
    shutdown: impl std::future::Future<Output = ()>,
    listening: impl FnOnce(SocketAddr),
) -> Result<(), ServiceError> {
    let (authority, path) = cfg.source.target()?;
    let io = |what: &str| {
        let what = what.to_string();
        move |source| ServiceError::Io { what, source }
    };
    let listener = tokio::net::TcpListener::bind(cfg.metrics_listen)
        .await
        .map_err(io("binding the metrics address"))?;
    listening(listener.local_addr().map_err(io("reading the metrics address"))?);
    let text = Arc::new(Mutex::new(String::new()));
    let shared = text.clone();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let t = shared.lock().map(|t| t.clone()).unwrap_or_default();
            async move { ([(hyper::header::CONTENT_TYPE, "text/plain; version=0.0.4")], t) }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut log = match &cfg.decisions {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(io(&format!("opening {}", p.display())))?,
        ),
        None => None,
    };
    tokio::pin!(shutdown);
    let mut timer = tokio::time::interval(cfg.interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut made = 0u64;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = timer.tick() => {}
        }
        // A frontend that does not answer within an interval is a failed tick, not a stall.
        let fetched = tokio::select! {
            _ = &mut shutdown => break,
            r = tokio::time::timeout(cfg.interval, fetch(&authority, &path, cfg.bearer.as_deref())) => r,
        };
        let result = match fetched {
            Ok(Ok(t)) => driver.tick(&t).map_err(|e| e.to_string()),
            Ok(Err(e)) => Err(format!("reading http://{authority}{path}: {e}")),
            Err(_) => Err(format!("http://{authority}{path} did not answer within the interval")),
        };
        match result {
            Ok(Some(d)) => {
                made += 1;
                let line = serde_json::to_string(&d).unwrap_or_default();
                println!("{line}");
                if let Some(f) = log.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                tracing::info!(
                    decision = d.id,
                    prefill = d.target.prefill,
                    decode = d.target.decode,
                    "{}",
                    d.reason
                );
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "planner tick failed; the pools stay as they are"),
        }
        if let Ok(mut t) = text.lock() {
            *t = driver.encode_metrics();
        }
        if cfg.ticks.is_some_and(|n| made >= n) {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_name_a_server_and_a_path() {
        let f = Source::Frontend("http://127.0.0.1:8000/".into());
        assert_eq!(f.target().unwrap(), ("127.0.0.1:8000".into(), "/metrics".into()));
        let p =
            Source::Prometheus { url: "127.0.0.1:9090".into(), selector: DEFAULT_SELECTOR.into() };
        assert_eq!(
            p.target().unwrap().1,
            "/federate?match%5B%5D=%7B%5F%5Fname%5F%5F%3D%7E%22kvx%5F%2E%2B%22%7D"
        );
        assert!(Source::Frontend("http://host/metrics".into()).target().is_err());
        assert!(Source::Frontend("nowhere".into()).target().is_err());
    }
}

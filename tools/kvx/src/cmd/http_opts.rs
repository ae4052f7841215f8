//! HTTP flags shared by the commands that serve the OpenAI API (`serve`, `frontend`), the one
//! place that turns them into an [`IngressConfig`] (reading the TLS and API key files, with the
//! admin keys) and the
//! HTTP runtime, and the helpers every serving command uses (the served model name, the
//! shutdown signal, reloading on SIGHUP).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvx_ingress::{AdmissionConfig, ApiKeys, IngressConfig, RunningBound, ServerHandle, Tls};

use kvx_worker::knee::FLOOR_PER_ENGINE;
use kvx_worker::store::{CATALOGUE, DEFAULT};

#[derive(Debug, Clone, Args)]
pub(crate) struct HttpOpts {
    /// Address to listen on for HTTP.
    #[arg(long, env = "KVX_HOST", default_value = "127.0.0.1")]
    pub(crate) host: IpAddr,
    /// HTTP port (0 = any free port; the bound address is printed).
    #[arg(long, env = "KVX_PORT", default_value_t = 8000)]
    pub(crate) port: u16,
    /// Model name clients use (default: the model's catalogue name or file stem); remote
    /// workers must register with the same.
    #[arg(long, env = "KVX_SERVED_MODEL_NAME")]
    pub(crate) served_model_name: Option<String>,
    /// Accepted API key (repeatable; `KVX_API_KEYS` takes a comma-separated list). Without
    /// keys no authentication is asked for.
    #[arg(long = "api-key", env = "KVX_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub(crate) api_keys: Vec<String>,
    /// Also accepted: the keys in FILE, one a line, each optionally followed by the models it
    /// may use (comma-separated, `*` for all; other models answer 404) and by fields:
    /// `concurrency=N` (requests at once), `rpm=N` (requests a minute), `tpm=N` (tokens a
    /// minute), all answering 429 with Retry-After above, and `admin` (may read /metrics);
    /// `#` starts a comment. Re-read on SIGHUP. With a file, a key is always asked for.
    #[arg(long, env = "KVX_API_KEYS_FILE", value_name = "FILE")]
    pub(crate) api_keys_file: Option<PathBuf>,
    /// Admin key (repeatable; `KVX_ADMIN_KEY` takes a comma-separated list): while one is set
    /// (here or as an `admin` line of the keys file), /metrics and /status.json answer only
    /// admin keys (401 without a key, 403 with another); otherwise they are open. An admin key
    /// given here does not grant inference. /health, /live, /ready and the status page's HTML
    /// at / stay open.
    #[arg(
        long = "admin-key",
        env = "KVX_ADMIN_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub(crate) admin_keys: Vec<String>,
    /// Serve HTTPS with this certificate chain (PEM, leaf first; needs --tls-key). Re-read
    /// with the key on SIGHUP: new connections get the new certificate.
    #[arg(long, env = "KVX_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "KVX_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Largest request body in bytes (413 above).
    #[arg(long, env = "KVX_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub(crate) max_body_bytes: usize,
    /// Seconds running requests get to finish after SIGTERM before they are cancelled.
    #[arg(long, env = "KVX_SHUTDOWN_GRACE", default_value_t = 30.0)]
    pub(crate) shutdown_grace: f64,
    /// Requests served at once at most (429 above).
    #[arg(long, env = "KVX_MAX_INFLIGHT", default_value_t = 4096)]
    pub(crate) max_inflight: usize,
    /// Seconds a client has to send each request's headers before its connection is closed
    /// (slow-header clients cannot hold connections).
    #[arg(long, env = "KVX_HEADER_READ_TIMEOUT", default_value_t = 10.0)]
    pub(crate) header_read_timeout: f64,
    /// Seconds a request's body has to arrive after its headers (408 otherwise).
    #[arg(long, env = "KVX_BODY_READ_TIMEOUT", default_value_t = 30.0)]
    pub(crate) body_read_timeout: f64,
    /// Seconds a client may keep its receive window shut (it stopped reading) or leave sent
    /// bytes unacknowledged while output waits for it; then the connection is closed and its
    /// requests cancelled (TCP_USER_TIMEOUT).
    #[arg(long, env = "KVX_SEND_TIMEOUT", default_value_t = 30.0)]
    pub(crate) send_timeout: f64,
    /// Engine requests running at once at most; more wait in the admission queue in arrival
    /// order (0 = the engines' sequence slots with `serve`, no bound with `frontend`;
    /// `knee` = the decoding workers' batch knees, the fewest sequences (at least 4 each) that
    /// give 90% of the decode throughput of all their slots, measured as they run; their
    /// slots until known).
    #[arg(long, env = "KVX_MAX_RUNNING", default_value = "0")]
    pub(crate) max_running: RunningBound,
    /// Prompt tokens of engine requests admitted that have not produced their first output
    /// (waiting in the engines or being prefilled) at most; more wait in the admission queue
    /// (0 = no bound; e.g. the engines' step token budgets, 512 per shard by default).
    #[arg(long, env = "KVX_MAX_STARTING_TOKENS", default_value_t = 0)]
    pub(crate) max_starting_tokens: usize,
    /// Engine requests waiting to start at most (429 with Retry-After above).
    #[arg(long, env = "KVX_MAX_QUEUE", default_value_t = 1024)]
    pub(crate) max_queue: usize,
    /// Longest wait for a slot, in seconds, a new request is admitted with (estimated from the
    /// requests ahead of it and how long slots are held; with a running or starting bound
    /// only); longer ones get 429 with Retry-After at once, so admitted requests keep their
    /// latency. Default: the recent mean time admitted requests took to start (between 0.25
    /// and 2; 2 before one is known), so a request waits about as long as its start takes.
    #[arg(long, env = "KVX_MAX_QUEUE_WAIT")]
    pub(crate) max_queue_wait: Option<f64>,
    /// Bytes of a stream's output that may wait in the server for a client that stopped
    /// reading (beyond the client's receive window and 16 KiB unsent in the kernel); past them
    /// the request is cancelled (its KV blocks freed).
    #[arg(long, env = "KVX_STREAM_BUFFER_BYTES", default_value_t = 256 << 10)]
    pub(crate) stream_buffer_bytes: usize,
    /// HTTP threads (default: one per core).
    #[arg(long, env = "KVX_HTTP_THREADS")]
    pub(crate) http_threads: Option<usize>,
}

impl HttpOpts {
    /// The ingress configuration (checks the flags, reads the TLS and API key files).
    pub(crate) fn ingress(&self) -> Result<IngressConfig> {
        if !(self.shutdown_grace.is_finite() && self.shutdown_grace >= 0.0) {
            bail!("--shutdown-grace must be a non-negative number of seconds");
        }
        for (flag, v) in [
            ("--header-read-timeout", self.header_read_timeout),
            ("--body-read-timeout", self.body_read_timeout),
            ("--send-timeout", self.send_timeout),
            ("--max-queue-wait", self.max_queue_wait.unwrap_or(1.0)),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1e9) {
                bail!("{flag} must be a positive number of seconds");
            }
        }
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(Tls::load(cert, key)?),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key go together"),
        };
        let mut admission = AdmissionConfig {
            max_running: 0,
            running_floor: 0,
            max_starting_tokens: self.max_starting_tokens,
            max_queue: self.max_queue.max(1),
            max_wait: self.max_queue_wait.map(Duration::from_secs_f64),
        };
        // In front of workers; `serve` applies it again with its engines' slots.
        self.max_running.apply(&mut admission, None, FLOOR_PER_ENGINE);
        Ok(IngressConfig {
            addr: SocketAddr::new(self.host, self.port),
            keys: ApiKeys::new(&self.api_keys, &self.admin_keys, self.api_keys_file.as_deref())?,
            tls,
            max_body_bytes: self.max_body_bytes,
            shutdown_grace: Duration::from_secs_f64(self.shutdown_grace),
            max_inflight: self.max_inflight.max(1),
            header_read_timeout: Duration::from_secs_f64(self.header_read_timeout),
            body_read_timeout: Duration::from_secs_f64(self.body_read_timeout),
            send_timeout: Duration::from_secs_f64(self.send_timeout),
            admission,
            stream_buffer_bytes: self.stream_buffer_bytes.max(4096),
        })
    }

    /// The name clients use for the model given as `spec` (`--model`).
    pub(crate) fn model_name(&self, spec: Option<&str>) -> String {
        self.served_model_name.clone().unwrap_or_else(|| served_name(spec))
    }

    /// The HTTP runtime: `--http-threads` threads, or one per core of `cores`.
    pub(crate) fn runtime(
        &self,
        cores: usize,
        thread_name: &str,
    ) -> Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.http_threads.unwrap_or(cores).max(1))
            .thread_name(thread_name)
            .enable_all()
            .build()
            .context("starting the HTTP runtime")
    }
}

/// The name clients use for the model given as `spec`: the catalogue name, or a GGUF path's
/// catalogue name or file stem; the default model's name when absent.
pub(crate) fn served_name(spec: Option<&str>) -> String {
    let Some(spec) = spec else { return DEFAULT.name.to_string() };
    if CATALOGUE.iter().any(|k| k.name == spec) {
        return spec.to_string();
    }
    let path = std::path::Path::new(spec);
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or_default();
    match CATALOGUE.iter().find(|k| k.file == file) {
        Some(k) => k.name.to_string(),
        None => path.file_stem().and_then(|s| s.to_str()).unwrap_or("model").to_string(),
    }
}

/// Unix seconds now (a served model's `created`).
pub(crate) fn created_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// With a keys file or TLS, re-reads them on every SIGHUP (off the runtime's threads) and says
/// on stderr what was reloaded, or why the old keys or certificate stay. Call it inside the
/// HTTP runtime before the server announces itself. Without either, SIGHUP keeps its default.
pub(crate) fn reload_on_hangup(handle: ServerHandle) {
    use tokio::signal::unix::{SignalKind, signal};
    if handle.keys_file().is_none() && handle.cert_file().is_none() {
        return;
    }
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            say(format_args!("kvx: warning: cannot watch SIGHUP, so nothing will reload: {e}"));
            return;
        }
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            let h = handle.clone();
            let Ok(done) = tokio::task::spawn_blocking(move || h.reload()).await else {
                say(format_args!("kvx: error: the reload on SIGHUP did not finish"));
                continue;
            };
            match (done.keys, handle.keys_file()) {
                (Some(Ok(n)), Some(f)) => {
                    say(format_args!("kvx: reloaded {n} API key(s) from {}", f.display()))
                }
                (Some(Err(e)), _) => {
                    say(format_args!("kvx: error: keeping the API keys in force: {e}"))
                }
                _ => {}
            }
            match (done.tls, handle.cert_file()) {
                (Some(Ok(())), Some(f)) => {
                    say(format_args!("kvx: reloaded the TLS certificate from {}", f.display()))
                }
                (Some(Err(e)), _) => {
                    say(format_args!("kvx: error: keeping the TLS certificate in force: {e}"))
                }
                _ => {}
            }
        }
    });
}

/// A line on stderr; a stderr that is gone (a closed terminal) is no reason to stop serving.
fn say(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Completes on SIGTERM or Ctrl-C.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut t) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = t.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

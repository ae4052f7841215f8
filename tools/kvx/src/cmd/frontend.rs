//! `kvx frontend`: the OpenAI-compatible HTTP server and the router over remote workers —
//! `kvx worker` processes that join it (or that it dials, given `--workers`).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvx_ingress::{Dispatcher, IngressConfig, ModelInfo, Server};
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::LlamaConfig;
use kvx_tokenizer::Tokenizer;

use super::Runtime;
use super::router_opts::RouterOpts;
use super::worker::{PlaneOpts, served_name, shutdown_signal};
use crate::remote::{RemoteConfig, RemotePlane};

#[derive(Debug, Args)]
pub(crate) struct FrontendArgs {
    /// Address to listen on for HTTP.
    #[arg(long, env = "KVX_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port (0 = any free port; the bound address is printed).
    #[arg(long, env = "KVX_PORT", default_value_t = 8000)]
    port: u16,
    /// Address workers join at (`kvx worker --frontend ADDR`); port 0 = any free port.
    #[arg(long, env = "KVX_WORKER_LISTEN", default_value = "127.0.0.1:7100")]
    worker_listen: SocketAddr,
    /// Worker processes to dial instead of (or besides) waiting for them to join: a comma list
    /// of `kvx worker --listen` addresses.
    #[arg(long, env = "KVX_WORKERS", value_delimiter = ',')]
    workers: Vec<String>,
    /// Model whose tokenizer and chat template the frontend uses: a catalogue name or a GGUF
    /// path (default model when absent). Only the metadata is read.
    #[arg(long, env = "KVX_MODEL")]
    model: Option<String>,
    /// Model name clients use; workers must register with the same (default: the model's
    /// catalogue name or file stem).
    #[arg(long, env = "KVX_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Tokens per KV block (workers must use the same).
    #[arg(long, env = "KVX_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// Accepted API key (repeatable; `KVX_API_KEYS` takes a comma-separated list).
    #[arg(long = "api-key", env = "KVX_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    api_keys: Vec<String>,
    /// Largest request body in bytes (413 above).
    #[arg(long, env = "KVX_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds running requests get to finish after SIGTERM before they are cancelled.
    #[arg(long, env = "KVX_SHUTDOWN_GRACE", default_value_t = 30.0)]
    shutdown_grace: f64,
    /// Requests served at once at most (429 above).
    #[arg(long, env = "KVX_MAX_INFLIGHT", default_value_t = 4096)]
    max_inflight: usize,
    /// HTTP threads (default: one per core).
    #[arg(long, env = "KVX_HTTP_THREADS")]
    http_threads: Option<usize>,
    /// Placements of one request at most: when its worker refuses it or disappears before the
    /// first token, it is placed again on another worker until this many tries.
    #[arg(long, env = "KVX_MAX_ATTEMPTS", default_value_t = 3)]
    max_attempts: u32,
    #[command(flatten)]
    router: RouterOpts,
    #[command(flatten)]
    plane: PlaneOpts,
}

pub(crate) fn run(args: FrontendArgs, rt: &Runtime) -> Result<()> {
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a non-negative number of seconds");
    }
    let router = args.router.config(args.block_size)?;
    let path = rt.store.resolve(args.model.as_deref())?;
    let name = args.served_model_name.clone().unwrap_or_else(|| served_name(args.model.as_deref()));
    let tokenizer = Arc::new(
        Tokenizer::from_gguf_path(&path)
            .with_context(|| format!("loading the tokenizer of {}", path.display()))?,
    );
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let context_length =
        LlamaConfig::from_gguf(&file).context("reading the model's configuration")?.context_length;
    drop(file);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let model = ModelInfo { name: name.clone(), context_length, tokenizer, created };
    let cfg = IngressConfig {
        addr: SocketAddr::new(args.host, args.port),
        api_keys: args.api_keys.iter().filter(|k| !k.is_empty()).cloned().collect(),
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        max_inflight: args.max_inflight.max(1),
    };
    let remote = RemoteConfig {
        model: name.clone(),
        heartbeat: args.plane.heartbeat(),
        heartbeat_timeout: args.plane.heartbeat_timeout(),
        max_attempts: args.max_attempts.max(1),
        ..RemoteConfig::default()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.http_threads.unwrap_or(cores).max(1))
        .thread_name("kvx-frontend")
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let mode = args.router.router_mode;
    let report = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.worker_listen)
            .await
            .with_context(|| format!("listening for workers on {}", args.worker_listen))?;
        let worker_addr = listener.local_addr()?;
        let plane = RemotePlane::start(remote, router, listener)?;
        for w in &args.workers {
            plane.dial(w.clone());
        }
        let dispatcher: Arc<dyn Dispatcher> = plane;
        let server = Server::bind(cfg, model, dispatcher).await?;
        let addr = server.local_addr()?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "kvx: frontend for {name}, router mode {mode:?}\nworkers join at {worker_addr}\nlistening on http://{addr}",
        );
        let _ = out.flush();
        drop(out);
        anyhow::Ok(server.run(shutdown_signal()).await?)
    })?;
    eprintln!(
        "kvx: shut down ({} request(s) running at the signal, {} cancelled at the deadline)",
        report.running_at_signal, report.cancelled
    );
    runtime.shutdown_timeout(Duration::from_millis(500));
    Ok(())
}

//! `kvx frontend`: the OpenAI-compatible HTTP server and the router over remote workers —
//! `kvx worker` processes that join it (or that it dials, given `--workers`).

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kvx_ingress::{Dispatcher, ModelInfo, Server};
use kvx_planes::{RemotePlane, RemotePlaneConfig};
use kvx_worker::ModelMeta;

use super::Runtime;
use super::cluster_opts::{ClusterOpts, warn_if_open};
use super::discovery_opts::DiscoveryOpts;
use super::http_opts::{HttpOpts, created_now, reload_on_hangup, shutdown_signal};
use super::router_opts::{DisaggOpts, RouterOpts};
use super::worker::PlaneOpts;

#[derive(Debug, Args)]
pub(crate) struct FrontendArgs {
    #[command(flatten)]
    http: HttpOpts,
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
    /// Tokens per KV block (workers must use the same).
    #[arg(long, env = "KVX_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// Placements of one request at most: when its worker refuses it or disappears before the
    /// first token, it is placed again on another worker until this many tries.
    #[arg(long, env = "KVX_MAX_ATTEMPTS", default_value_t = 3)]
    max_attempts: u32,
    /// Migrations of one request at most: when its worker dies or goes silent mid-stream, it
    /// continues on another worker with the tokens its client has (0: it ends with an error).
    #[arg(long, env = "KVX_MIGRATION_LIMIT", default_value_t = 3)]
    migration_limit: u32,
    #[command(flatten)]
    router: RouterOpts,
    #[command(flatten)]
    disagg: DisaggOpts,
    #[command(flatten)]
    discovery: DiscoveryOpts,
    #[command(flatten)]
    plane: PlaneOpts,
    #[command(flatten)]
    cluster: ClusterOpts,
}

pub(crate) fn run(args: FrontendArgs, rt: &Runtime) -> Result<()> {
    let cfg = args.http.ingress()?;
    let router = args.router.config(args.block_size)?;
    let path = rt.store.resolve(args.model.as_deref())?;
    let name = args.http.model_name(args.model.as_deref());
    let meta = ModelMeta::read(&path)?;
    let model = ModelInfo {
        name: name.clone(),
        context_length: meta.config.context_length,
        tokenizer: meta.tokenizer,
        created: created_now(),
    };
    let remote = RemotePlaneConfig {
        model: name.clone(),
        heartbeat: args.plane.heartbeat(),
        heartbeat_timeout: args.plane.heartbeat_timeout(),
        max_attempts: args.max_attempts.max(1),
        migration_limit: args.migration_limit,
        auth: args.cluster.auth()?,
        ..RemotePlaneConfig::default()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = args.http.runtime(cores, "kvx-frontend")?;
    let mode = args.router.router_mode;
    let report = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.worker_listen)
            .await
            .with_context(|| format!("listening for workers on {}", args.worker_listen))?;
        let worker_addr = listener.local_addr()?;
        warn_if_open(&remote.auth, worker_addr, "the worker plane");
        let plane = RemotePlane::with_disagg(remote, router, args.disagg.config(), listener)?;
        for w in &args.workers {
            plane.dial(w.clone());
        }
        if let Some((etcd, cfg)) = args.discovery.etcd()? {
            plane.follow(kvx_discovery::watch_fleet(etcd, &cfg));
        }
        let dispatcher: Arc<dyn Dispatcher> = plane;
        let server = Server::bind(cfg, model, dispatcher).await?;
        reload_on_hangup(server.handle());
        let scheme = server.scheme();
        let addr = server.local_addr()?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "kvx: frontend for {name}, router mode {mode:?}\nworkers join at {worker_addr}\nlistening on {scheme}://{addr}",
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

//! `kvx worker`: engine shards served to a frontend over the TCP request and event planes —
//! the model on the CPU kernels, or mock engines (the real scheduler and KV blocks with a
//! timing model; tokenizer-free, so hundreds fit in one process).

use std::hash::{BuildHasher, RandomState};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvx_proto::plane::WorkerRole;
use kvx_worker::remote::{Link, Phase};
use kvx_worker::{EngineKind, MockerSetup, RemoteConfig};

use super::Runtime;
use super::cluster_opts::{ClusterOpts, warn_if_open};
use super::discovery_opts::{DiscoveryOpts, records};
use super::engine::EngineOpts;
use super::http_opts::{served_name, shutdown_signal};
use super::router_opts::DisaggOpts;

/// What computes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum WorkerEngine {
    /// The model on kvx's CPU kernels.
    Model,
    /// Mock engines: the real scheduler and KV blocks with Dynamo's mocker timing model, no
    /// tokenizer and a tiny vocabulary (the frontend tokenizes; outputs carry ` t<id>` text).
    Mocker,
}

/// A worker's role on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RoleArg {
    /// Prefill and decode.
    Agg,
    /// Prompts only.
    Prefill,
    /// Decode, with prompts' KV from prefill workers.
    Decode,
}

/// Heartbeat flags, shared by `frontend` and `worker`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PlaneOpts {
    /// Heartbeat period between frontend and workers, milliseconds.
    #[arg(long, env = "KVX_HEARTBEAT_MS", default_value_t = 1000)]
    heartbeat_ms: u64,
    /// A peer silent this long (milliseconds) is dead.
    #[arg(long, env = "KVX_HEARTBEAT_TIMEOUT_MS", default_value_t = 5000)]
    heartbeat_timeout_ms: u64,
}

impl PlaneOpts {
    pub(crate) fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms.max(1))
    }

    pub(crate) fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat_timeout_ms.max(self.heartbeat_ms.max(1) * 2))
    }
}

#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// The frontend's worker address to join (`kvx frontend --worker-listen`).
    #[arg(
        long,
        env = "KVX_FRONTEND",
        required_unless_present = "listen",
        conflicts_with = "listen"
    )]
    frontend: Option<String>,
    /// Wait for a frontend to dial this address instead (`kvx frontend --workers`); port 0 =
    /// any free port (the bound address is printed).
    #[arg(long, env = "KVX_WORKER_ADDR")]
    listen: Option<SocketAddr>,
    /// What computes tokens.
    #[arg(long, value_enum, env = "KVX_ENGINE", default_value = "model")]
    engine: WorkerEngine,
    /// This worker's part in disaggregated serving: `agg` (prefill and decode), `prefill`
    /// (prompts only; their KV goes to decode workers) or `decode`.
    #[arg(long, value_enum, env = "KVX_ROLE", default_value = "agg")]
    role: RoleArg,
    /// Address the KV transfer agent of prefill and decode workers listens on, for peers on
    /// other hosts (same-host peers use shared memory).
    #[arg(long, env = "KVX_KV_LISTEN", default_value = "127.0.0.1:0")]
    kv_listen: SocketAddr,
    #[command(flatten)]
    disagg: DisaggOpts,
    /// Engines (workers) this process hosts.
    #[arg(long, visible_alias = "mock-workers", env = "KVX_SHARDS", default_value_t = 1)]
    shards: usize,
    /// Kernel threads per engine (model engine).
    #[arg(long, env = "KVX_THREADS_PER_SHARD", default_value_t = 1)]
    threads_per_shard: usize,
    /// Keep each engine's steps on its own cores: by default an engine with nothing to do
    /// lends its core to the others' steps.
    #[arg(long, env = "KVX_NO_LEND_CORES", value_parser = clap::builder::FalseyValueParser::new())]
    no_lend_cores: bool,
    /// Worker id of the first engine (the others follow); default: random.
    #[arg(long, env = "KVX_WORKER_ID")]
    worker_id: Option<u64>,
    /// Model name to register with (default: the model's catalogue name or file stem).
    #[arg(long, env = "KVX_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Mocker: simulated step times are divided by this.
    #[arg(long, env = "KVX_SPEEDUP_RATIO", default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Mocker: KV blocks per engine.
    #[arg(long, env = "KVX_MOCKER_BLOCKS", default_value_t = 16384)]
    mocker_blocks: usize,
    /// Mocker: vocabulary of the generated token ids.
    #[arg(long, env = "KVX_MOCKER_VOCAB", default_value_t = 64)]
    mocker_vocab: usize,
    /// Mocker: longest prompt + output.
    #[arg(long, env = "KVX_MOCKER_MAX_MODEL_LEN", default_value_t = 8192)]
    mocker_max_model_len: usize,
    /// Seconds running requests get to finish when the worker stops (SIGTERM: it leaves
    /// discovery, takes nothing new, finishes what runs; what is left then migrates).
    #[arg(long, env = "KVX_SHUTDOWN_GRACE", default_value_t = 5.0)]
    shutdown_grace: f64,
    /// The address frontends dial, published in discovery (default: the `--listen`
    /// address as bound).
    #[arg(long, env = "KVX_ADVERTISE")]
    advertise: Option<String>,
    #[command(flatten)]
    discovery: DiscoveryOpts,
    #[command(flatten)]
    plane: PlaneOpts,
    #[command(flatten)]
    cluster: ClusterOpts,
    #[command(flatten)]
    opts: EngineOpts,
}

/// A random first worker id with room for 65 536 engines after it.
fn random_base() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let h = RandomState::new().hash_one((std::process::id(), nanos));
    (h >> 17) << 16 | 1
}

pub(crate) fn run(args: WorkerArgs, rt: &Runtime) -> Result<()> {
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a non-negative number of seconds");
    }
    let name =
        args.served_model_name.clone().unwrap_or_else(|| served_name(args.opts.model.as_deref()));
    let mocker = args.engine == WorkerEngine::Mocker;
    let kind = if mocker { EngineKind::Mocker } else { EngineKind::Model };
    // Mock engines here are tokenizer-free: the model file is not read at all.
    let mut setup = args.opts.setup(rt, kind, !mocker)?;
    setup.engines = args.shards.max(1);
    setup.threads_per_engine = args.threads_per_shard.max(1);
    setup.first_worker_id = args.worker_id.unwrap_or_else(random_base);
    setup.pin = true;
    setup.lend_cores = !args.no_lend_cores;
    setup.prefault_kv = true;
    let role = match args.role {
        RoleArg::Agg => WorkerRole::Agg,
        RoleArg::Prefill => WorkerRole::Prefill,
        RoleArg::Decode => WorkerRole::Decode,
    };
    setup.roles = vec![role; setup.engines];
    setup.kv_link = args.disagg.link(Some(args.kv_listen));
    setup.mocker = MockerSetup {
        speedup: args.speedup_ratio,
        blocks: Some(args.mocker_blocks),
        vocab: Some(args.mocker_vocab),
        max_model_len: Some(args.mocker_max_model_len),
    };
    let (n, first) = (setup.engines, setup.first_worker_id);
    let etcd = args.discovery.etcd()?;
    if etcd.is_some() && args.listen.is_none() {
        bail!("--discovery etcd needs --listen ADDR (the address frontends dial)");
    }
    let prepared = setup.prepare()?;
    let fingerprint = prepared.model_label();
    let started = prepared.start()?;
    let cfg = RemoteConfig {
        model: name.clone(),
        arith: prepared.arith_label(),
        block_size: prepared.block_size(),
        heartbeat: args.plane.heartbeat(),
        heartbeat_timeout: args.plane.heartbeat_timeout(),
        synthetic_text: mocker,
        auth: args.cluster.auth()?,
        ..RemoteConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(Phase::Serving);
    let (frontend, listen) = (args.frontend.clone(), args.listen);
    let grace = Duration::from_secs_f64(args.shutdown_grace);
    let block_size = prepared.block_size();
    let (hosted, result) = runtime.block_on(async move {
        let mut endpoint = String::new();
        let link = match (frontend, listen) {
            (_, Some(addr)) => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listening on {addr}"))?;
                let bound = l.local_addr()?;
                warn_if_open(&cfg.auth, bound, "the worker's plane listener");
                endpoint = args.advertise.clone().unwrap_or_else(|| bound.to_string());
                say(&format!("listening for a frontend at {bound}"));
                Link::Listen(l)
            }
            (Some(f), None) => Link::Connect(f),
            (None, None) => bail!("give --frontend ADDR or --listen ADDR"),
        };
        let registrar = match etcd {
            Some((client, cfg)) => {
                if endpoint.is_empty() {
                    bail!("--discovery etcd publishes where frontends dial: give --listen ADDR");
                }
                if endpoint.starts_with("0.0.0.0") || endpoint.starts_with("[::]") {
                    bail!("listening on every address: give --advertise HOST:PORT for discovery");
                }
                let recs = records(&started.shards, &endpoint, &name, &fingerprint, block_size);
                let mut r = kvx_discovery::Registrar::start(client, &cfg, recs);
                if !r.wait_registered(Duration::from_secs(10)).await {
                    eprintln!("kvx: not registered in etcd yet; serving, and still trying");
                }
                Some(r)
            }
            None => None,
        };
        say(&format!(
            "kvx: worker serving {name} with {n} {} engine(s) ({} role), worker ids {first}..={}",
            kind.name(),
            role.name(),
            first + n as u64 - 1,
        ));
        tokio::spawn(async move {
            shutdown_signal().await;
            // Drain: out of discovery first, then nothing new, then what runs finishes.
            if let Some(r) = registrar {
                r.withdraw().await;
            }
            let _ = phase_tx.send(Phase::Draining);
            tokio::time::sleep(grace).await;
            let _ = phase_tx.send(Phase::Stopping);
        });
        anyhow::Ok(kvx_worker::remote::serve(cfg, started, link, phase_rx).await)
    })?;
    for h in &hosted {
        h.shard.begin_shutdown(grace);
    }
    for h in hosted {
        h.shard.shutdown(grace);
    }
    result.map_err(|e| anyhow::anyhow!("{e}"))
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

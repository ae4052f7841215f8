//! `kvx worker`: engine shards served to a frontend over the TCP request and event planes —
//! the model on the CPU kernels, or mock engines (the real scheduler and KV blocks with a
//! timing model; tokenizer-free, so hundreds fit in one process).

use std::hash::{BuildHasher, RandomState};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvx_engine::mocker::{MockBackend, MockConfig};
use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, EngineError};
use kvx_worker::remote::Link;
use kvx_worker::{Hosted, RemoteConfig, ShardConfig, ShardEvent};

use super::Runtime;
use super::engine::EngineOpts;
use super::http_opts::{served_name, shutdown_signal};

/// What computes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum WorkerEngine {
    /// The model on kvx's CPU kernels.
    Model,
    /// Mock engines: the real scheduler and KV blocks with Dynamo's mocker timing model, no
    /// tokenizer and a tiny vocabulary (the frontend tokenizes; outputs carry ` t<id>` text).
    Mocker,
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
    /// Engines (workers) this process hosts.
    #[arg(long, visible_alias = "mock-workers", env = "KVX_SHARDS", default_value_t = 1)]
    shards: usize,
    /// Kernel threads per engine (model engine).
    #[arg(long, env = "KVX_THREADS_PER_SHARD", default_value_t = 1)]
    threads_per_shard: usize,
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
    /// Seconds running requests get to finish when the worker stops.
    #[arg(long, env = "KVX_SHUTDOWN_GRACE", default_value_t = 5.0)]
    shutdown_grace: f64,
    #[command(flatten)]
    plane: PlaneOpts,
    #[command(flatten)]
    opts: EngineOpts,
}

/// A random first worker id with room for 65 536 engines after it.
fn random_base() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let h = RandomState::new().hash_one((std::process::id(), nanos));
    (h >> 17) << 16 | 1
}

fn sched(opts: &EngineOpts, max_model_len: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: opts.block_size.max(1),
        max_num_seqs: opts.max_num_seqs.max(1),
        max_batched_tokens: opts.max_batched_tokens.max(1),
        max_waiting: opts.max_waiting,
        chunked_prefill: !opts.no_chunked_prefill,
        max_model_len,
        prefix_caching: !opts.no_prefix_caching,
    }
}

pub(crate) fn run(args: WorkerArgs, rt: &Runtime) -> Result<()> {
    if !(args.speedup_ratio.is_finite() && args.speedup_ratio > 0.0) {
        bail!("--speedup-ratio must be a positive number");
    }
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a non-negative number of seconds");
    }
    let n = args.shards.max(1);
    let base = args.worker_id.unwrap_or_else(random_base);
    let name =
        args.served_model_name.clone().unwrap_or_else(|| served_name(args.opts.model.as_deref()));
    // Shard events of every engine on one bounded channel; the planes relay them.
    let (ev_tx, ev_rx) = std::sync::mpsc::sync_channel::<ShardEvent>(1 << 16);
    let mut hosted = Vec::with_capacity(n);
    let synthetic_text;
    match args.engine {
        WorkerEngine::Mocker => {
            synthetic_text = true;
            let sched = sched(&args.opts, args.mocker_max_model_len.max(1));
            let mock = MockConfig {
                n_vocab: args.mocker_vocab.max(2),
                n_blocks: args.mocker_blocks.max(1),
                speedup: args.speedup_ratio,
                avoid: Vec::new(),
            };
            for i in 0..n {
                let worker_id = base + i as u64;
                let (sched2, mock2) = (sched.clone(), mock.clone());
                let make = move || {
                    let ec = EngineConfig { sched: sched2, worker_id };
                    Ok(Engine::new(ec, Box::new(MockBackend::new(mock2)), None))
                };
                let shard = spawn(i, None, make, &ev_tx)?;
                hosted.push(Hosted {
                    worker_id,
                    kv_blocks: mock.n_blocks as u32,
                    max_num_seqs: sched.max_num_seqs as u32,
                    shard,
                });
            }
        }
        WorkerEngine::Model => {
            synthetic_text = false;
            let loaded = args.opts.load(rt)?;
            let kernels = rt.kernels()?;
            let blocks = args.opts.kv_blocks(&loaded.model, n);
            let tps = args.threads_per_shard.max(1);
            let cores: Vec<usize> = core_affinity::get_core_ids()
                .map(|v| v.into_iter().map(|c| c.id).collect())
                .unwrap_or_default();
            let pin = n * tps <= cores.len();
            for i in 0..n {
                let worker_id = base + i as u64;
                let mine: Vec<usize> = if pin {
                    cores.iter().skip(i * tps).take(tps).copied().collect()
                } else {
                    Vec::new()
                };
                let core = mine.first().copied();
                let make = args.opts.shard_engine(&loaded, kernels, tps, mine, n, worker_id);
                let shard = spawn(i, core, make, &ev_tx)?;
                hosted.push(Hosted {
                    worker_id,
                    kv_blocks: blocks as u32,
                    max_num_seqs: args.opts.max_num_seqs as u32,
                    shard,
                });
            }
        }
    }
    drop(ev_tx);
    let cfg = RemoteConfig {
        model: name.clone(),
        block_size: args.opts.block_size.max(1) as u32,
        heartbeat: args.plane.heartbeat(),
        heartbeat_timeout: args.plane.heartbeat_timeout(),
        synthetic_text,
        ..RemoteConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let frontend = args.frontend.clone();
    let listen = args.listen;
    let first = hosted.first().map_or(base, |h| h.worker_id);
    let (hosted, result) = runtime.block_on(async move {
        let link = match (frontend, listen) {
            (_, Some(addr)) => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listening on {addr}"))?;
                let bound = l.local_addr()?;
                say(&format!("listening for a frontend at {bound}"));
                Link::Listen(l)
            }
            (Some(f), None) => Link::Connect(f),
            (None, None) => bail!("give --frontend ADDR or --listen ADDR"),
        };
        say(&format!(
            "kvx: worker serving {name} with {n} {} engine(s), worker ids {first}..={}",
            match args.engine {
                WorkerEngine::Model => "model",
                WorkerEngine::Mocker => "mocker",
            },
            first + n as u64 - 1,
        ));
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        anyhow::Ok(kvx_worker::remote::serve(cfg, hosted, ev_rx, link, stop_rx).await)
    })?;
    let grace = Duration::from_secs_f64(args.shutdown_grace);
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

fn spawn(
    index: usize,
    core: Option<usize>,
    make: impl FnOnce() -> Result<Engine, EngineError> + Send + 'static,
    events: &std::sync::mpsc::SyncSender<ShardEvent>,
) -> Result<kvx_worker::ShardHandle> {
    kvx_worker::spawn(ShardConfig { index, core, inbox_capacity: 4096 }, make, Some(events.clone()))
        .map_err(|e| anyhow::anyhow!("starting engine {index}: {e}"))
}

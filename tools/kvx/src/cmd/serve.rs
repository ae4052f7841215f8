//! `kvx serve`: the OpenAI-compatible HTTP server over local engine shards (the model on the
//! CPU kernels, or the mocker's timing model), with graceful shutdown on SIGTERM / Ctrl-C.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvx_engine::mocker::{MockBackend, MockConfig};
use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, EngineError};
use kvx_ingress::{Dispatcher, ModelInfo, Server};
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{KvCache, LlamaConfig};
use kvx_tokenizer::Tokenizer;
use kvx_worker::{ShardConfig, ShardEvent, ShardHandle};

use super::Runtime;
use super::engine::{EngineOpts, Loaded};
use super::http_opts::{HttpOpts, shutdown_signal};
use super::router_opts::RouterOpts;
use crate::plane::LocalPlane;

/// What computes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum EngineKind {
    /// The model on kvx's CPU kernels.
    Model,
    /// The mocker: the real scheduler and KV blocks with a timing model instead of kernels
    /// (only the model's tokenizer and metadata are read).
    Mocker,
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    http: HttpOpts,
    #[command(flatten)]
    router: RouterOpts,
    /// Engine shards (default: one per core).
    #[arg(long, env = "KVX_SHARDS")]
    shards: Option<usize>,
    /// Kernel threads per shard (default 1, or --threads).
    #[arg(long, env = "KVX_THREADS_PER_SHARD")]
    threads_per_shard: Option<usize>,
    /// What computes tokens.
    #[arg(long, value_enum, env = "KVX_ENGINE", default_value = "model")]
    engine: EngineKind,
    /// Mocker: simulated step times are divided by this (large = near-zero latency).
    #[arg(long, env = "KVX_SPEEDUP_RATIO", default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Mocker: KV blocks per shard (default: as the model would have).
    #[arg(long, env = "KVX_MOCKER_BLOCKS")]
    mocker_blocks: Option<usize>,
    /// Mocker: generated token ids are drawn below this (0 = the model's whole vocabulary).
    /// The engine samples over this many logits per token, so a small value (e.g. 1024)
    /// keeps the mocker's per-token cost near zero for load tests of everything around it.
    #[arg(long, env = "KVX_MOCKER_VOCAB", default_value_t = 0)]
    mocker_vocab: usize,
    #[command(flatten)]
    opts: EngineOpts,
}

/// The CPUs this process may run on, in order.
fn allowed_cores() -> Vec<usize> {
    core_affinity::get_core_ids().map(|v| v.into_iter().map(|c| c.id).collect()).unwrap_or_default()
}

fn sched_config(opts: &EngineOpts, context_length: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: opts.block_size.max(1),
        max_num_seqs: opts.max_num_seqs.max(1),
        max_batched_tokens: opts.max_batched_tokens.max(1),
        max_waiting: opts.max_waiting,
        chunked_prefill: !opts.no_chunked_prefill,
        max_model_len: context_length,
        prefix_caching: !opts.no_prefix_caching,
    }
}

/// The longest prompt + output one engine takes.
fn context_limit(sched: &SchedulerConfig, blocks: usize) -> usize {
    let mut limit = sched.max_model_len.min(blocks * sched.block_size);
    if !sched.chunked_prefill {
        limit = limit.min(sched.max_batched_tokens);
    }
    limit
}

struct Shards {
    handles: Vec<ShardHandle>,
    context: usize,
    block_size: usize,
    tokenizer: Arc<Tokenizer>,
}

/// Events of every shard for the router, bounded (a full channel drops KV events; the
/// router sees the gap and asks for a snapshot).
fn event_channel() -> (SyncSender<ShardEvent>, Receiver<ShardEvent>) {
    sync_channel(1 << 16)
}

/// Shard `i` is worker `i + 1` (the plane's numbering).
fn worker_id(i: usize) -> u64 {
    i as u64 + 1
}

fn start_mocker(
    args: &ServeArgs,
    path: &Path,
    n: usize,
    cores: &[usize],
    events: &SyncSender<ShardEvent>,
) -> Result<Shards> {
    let tokenizer = Arc::new(
        Tokenizer::from_gguf_path(path)
            .with_context(|| format!("loading the tokenizer of {}", path.display()))?,
    );
    let file = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let cfg = LlamaConfig::from_gguf(&file).context("reading the model's configuration")?;
    let sched = sched_config(&args.opts, cfg.context_length);
    let blocks = args.mocker_blocks.unwrap_or_else(|| {
        let bytes = args.opts.kv_cache_bytes.unwrap_or((1u64 << 30) / n.max(1) as u64);
        let max_useful = cfg.context_length.max(1).div_ceil(sched.block_size) * sched.max_num_seqs;
        KvCache::blocks_for_budget(&cfg, sched.block_size, bytes).clamp(1, max_useful.max(1))
    });
    let mock = MockConfig {
        // Metadata may omit the vocabulary size; the tokenizer has it.
        n_vocab: {
            let full = cfg.n_vocab.max(tokenizer.vocab_size()).max(1);
            if args.mocker_vocab == 0 { full } else { args.mocker_vocab.min(full) }
        },
        n_blocks: blocks.max(1),
        speedup: args.speedup_ratio,
        avoid: tokenizer.eog_ids().to_vec(),
    };
    let mut handles = Vec::with_capacity(n);
    for i in 0..n {
        let (sched, mock, tok) = (sched.clone(), mock.clone(), tokenizer.clone());
        let make = move || {
            let ec = EngineConfig { sched, worker_id: worker_id(i) };
            Ok(Engine::new(ec, Box::new(MockBackend::new(mock)), Some(tok)))
        };
        handles.push(spawn_shard(i, cores.get(i).copied(), make, events)?);
    }
    Ok(Shards {
        handles,
        context: context_limit(&sched, blocks),
        block_size: sched.block_size,
        tokenizer,
    })
}

fn start_model(
    args: &ServeArgs,
    rt: &Runtime,
    n: usize,
    tps: usize,
    cores: &[usize],
    events: &SyncSender<ShardEvent>,
) -> Result<Shards> {
    let loaded: Loaded = args.opts.load(rt)?;
    let kernels = rt.kernels()?;
    let sched = args.opts.sched(&loaded.model);
    let blocks = args.opts.kv_blocks(&loaded.model, n);
    let mut handles = Vec::with_capacity(n);
    for i in 0..n {
        // Shard i runs on its core; its kernel threads on the next ones.
        let mut mine: Vec<usize> = cores.iter().skip(i * tps).take(tps).copied().collect();
        if mine.len() != tps {
            mine.clear();
        }
        let core = mine.first().copied();
        let make = args.opts.shard_engine(&loaded, kernels, tps, mine, n, worker_id(i));
        handles.push(spawn_shard(i, core, make, events)?);
    }
    Ok(Shards {
        handles,
        context: context_limit(&sched, blocks),
        block_size: sched.block_size,
        tokenizer: loaded.tokenizer,
    })
}

fn spawn_shard(
    index: usize,
    core: Option<usize>,
    make: impl FnOnce() -> Result<Engine, EngineError> + Send + 'static,
    events: &SyncSender<ShardEvent>,
) -> Result<ShardHandle> {
    let cfg = ShardConfig { index, core, inbox_capacity: 4096 };
    kvx_worker::spawn(cfg, make, Some(events.clone()))
        .map_err(|e| anyhow::anyhow!("starting shard {index}: {e}"))
}

pub(crate) fn run(args: ServeArgs, rt: &Runtime) -> Result<()> {
    if !(args.speedup_ratio.is_finite() && args.speedup_ratio > 0.0) {
        bail!("--speedup-ratio must be a positive number");
    }
    let cfg = args.http.ingress()?;
    let t0 = Instant::now();
    let path = rt.store.resolve(args.opts.model.as_deref())?;
    let name = args.http.model_name(args.opts.model.as_deref());
    let cores = allowed_cores();
    let n_cores = cores.len().max(1);
    let n = args.shards.unwrap_or(n_cores).max(1);
    let tps = args.threads_per_shard.or(args.opts.threads).unwrap_or(1).max(1);
    // Pin only when every shard (and its kernel threads) gets cores of its own.
    let pin: Vec<usize> = if n * tps <= n_cores { cores.clone() } else { Vec::new() };
    let (ev_tx, ev_rx) = event_channel();
    let shards = match args.engine {
        EngineKind::Mocker => start_mocker(&args, &path, n, &pin, &ev_tx)?,
        EngineKind::Model => start_model(&args, rt, n, tps, &pin, &ev_tx)?,
    };
    drop(ev_tx);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let model = ModelInfo {
        name: name.clone(),
        context_length: shards.context,
        tokenizer: shards.tokenizer.clone(),
        created,
    };
    let router = args.router.config(shards.block_size)?;
    let plane = Arc::new(LocalPlane::new(shards.handles, router, ev_rx)?);
    let dispatcher: Arc<dyn Dispatcher> = plane.clone();
    let keyed = !cfg.api_keys.is_empty();
    let grace = cfg.shutdown_grace;
    let runtime = args.http.runtime(n_cores, "kvx-http")?;
    let report = runtime.block_on(async move {
        let server = Server::bind(cfg, model, dispatcher).await?;
        let addr = server.local_addr()?;
        let mut out = std::io::stdout().lock();
        let auth = if keyed { " -H 'Authorization: Bearer YOUR_KEY'" } else { "" };
        let _ = writeln!(
            out,
            "kvx: serving {name} ({} engine, {n} shard(s), context {}) in {:.1} s\ntry:\n  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{{\"model\":\"{name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'\nlistening on http://{addr}",
            match args.engine {
                EngineKind::Model => "model",
                EngineKind::Mocker => "mocker",
            },
            shards.context,
            t0.elapsed().as_secs_f64(),
        );
        let _ = out.flush();
        drop(out);
        server.run(shutdown_signal()).await
    })?;
    eprintln!(
        "kvx: shut down ({} request(s) running at the signal, {} cancelled at the deadline)",
        report.running_at_signal, report.cancelled
    );
    runtime.shutdown_timeout(Duration::from_millis(500));
    // Whatever still runs has had its grace period in ingress.
    let _ = grace;
    plane.shutdown(Duration::ZERO);
    Ok(())
}

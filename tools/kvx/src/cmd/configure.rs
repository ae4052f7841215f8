//! `kvx configure`: writes a deployment's `KVX_*` settings for this host (flags and wiring;
//! the decisions and the file writing live in kvx-planner's `configure`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;

use kvx_planner::configure::{HostShape, Layout, Request, plan, write_settings};

#[derive(Debug, Args)]
pub(crate) struct ConfigureArgs {
    /// The process the settings are for: serve (one process), host (a frontend and
    /// --workers worker processes on this host, as deploy/systemd runs them), frontend, or a
    /// worker role (agg, prefill, decode).
    #[arg(long, default_value = "serve")]
    layout: String,
    /// Worker processes on this host (with --layout host): the cores are split over them.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Output format: `env` (a systemd EnvironmentFile) or `helm` (the chart's `config:` values).
    #[arg(long, default_value = "env")]
    format: String,
    /// Write here instead of stdout (created with mode 0640).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Address the HTTP API will listen on.
    #[arg(long = "listen-host", default_value = "127.0.0.1")]
    listen_host: String,
    /// HTTP port.
    #[arg(long = "listen-port", default_value_t = 8000)]
    listen_port: u16,
    /// kvx's home on the deployed host (the model store; the units' CacheDirectory).
    #[arg(long = "home-dir", default_value = "/var/cache/kvx")]
    home_dir: PathBuf,
    /// The deployed host's state directory (the units' StateDirectory): the disk KV tier
    /// goes in `<state-dir>/kv`.
    #[arg(long = "state-dir", default_value = "/var/lib/kvx")]
    state_dir: PathBuf,
    /// The model (catalogue name or GGUF path; default: the default model).
    #[arg(long = "serve-model")]
    model: Option<String>,
    /// Directory of the disk KV tier (default: `<state-dir>/kv`; `none` for no disk tier).
    #[arg(long = "kv-disk-dir")]
    kv_disk: Option<String>,
    /// No host-memory KV tier.
    #[arg(long)]
    no_kv_host: bool,
    /// etcd endpoints for discovery across hosts (comma-separated URLs).
    #[arg(long)]
    etcd: Option<String>,
    /// For a worker without discovery: the frontend's worker-plane address.
    #[arg(long = "frontend-addr")]
    frontend: Option<String>,
}

pub(crate) fn run(a: ConfigureArgs) -> Result<()> {
    let Some(layout) = Layout::parse(&a.layout) else {
        bail!("unknown --layout {:?} (serve, host, frontend, agg, prefill, decode)", a.layout);
    };
    let layout = layout.with_workers(a.workers);
    let kv_disk = match a.kv_disk.as_deref() {
        Some("none") => None,
        Some(d) => Some(PathBuf::from(d)),
        None => Some(a.state_dir.join("kv")),
    };
    let req = Request {
        layout,
        host: a.listen_host,
        port: a.listen_port,
        home: a.home_dir,
        model: a.model,
        kv_disk,
        kv_host: !a.no_kv_host,
        etcd: a.etcd,
        frontend: a.frontend,
    };
    let settings = plan(HostShape::read()?, &req)?;
    let text = match a.format.as_str() {
        "env" => settings.to_env(),
        "helm" => settings.to_helm(),
        f => bail!("unknown --format {f:?} (env, helm)"),
    };
    match a.out {
        None => print!("{text}"),
        Some(path) => {
            write_settings(&path, &text).with_context(|| format!("writing {}", path.display()))?
        }
    }
    Ok(())
}

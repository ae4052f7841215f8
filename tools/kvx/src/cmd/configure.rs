//! `kvx configure`: writes a deployment's `KVX_*` settings for this host; with `--profile`,
//! the best layout of the profiled workers for a workload and targets (flags and wiring; the
//! decisions, the layout search and the file writing live in kvx-planner).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;

use kvx_planner::configure::{HostShape, Layout, Request, plan, write_settings};
use kvx_planner::layouts::{WorkerKind, Workload, search};
use kvx_proto::profile::Profile;

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
    /// Worker profiles (`kvx profile`; repeat for several worker shapes): search the layouts
    /// they allow, print the predictions to stderr and write the best one's settings.
    #[arg(long)]
    profile: Vec<PathBuf>,
    /// Prompt tokens per request (layout search).
    #[arg(long, default_value_t = 2000.0)]
    isl: f64,
    /// Output tokens per request (layout search).
    #[arg(long, default_value_t = 200.0)]
    osl: f64,
    /// TTFT p90 target, milliseconds (layout search).
    #[arg(long, default_value_t = 500.0)]
    ttft: f64,
    /// ITL p90 target, milliseconds (layout search).
    #[arg(long, default_value_t = 50.0)]
    itl: f64,
    /// Gigabytes per second a prompt's KV moves at from a prefill to a decode worker (layout
    /// search; the mock engines' model of loopback TCP is 4; `kvx bench xfer` measures a link).
    #[arg(long, default_value_t = 4.0)]
    kv_gbps: f64,
    /// Cores per host the layouts may use (default: this host's).
    #[arg(long)]
    cores: Option<u32>,
    /// Hosts (layout search).
    #[arg(long, default_value_t = 1)]
    hosts: u32,
    /// Layouts listed in the report.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Also write every layout's predictions here (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
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
    let host = HostShape::read()?;
    let mut settings = plan(host, &req)?;
    if !a.profile.is_empty() {
        if layout != Layout::Serve {
            bail!("--profile writes a layout for one `kvx serve`: use it with --layout serve");
        }
        let mut kinds = Vec::new();
        for path in &a.profile {
            let p = Profile::read(path)?;
            let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
            kinds.push(WorkerKind::new(path.display().to_string(), p)?);
        }
        let w = Workload {
            isl: a.isl,
            osl: a.osl,
            ttft_ms: a.ttft,
            itl_ms: a.itl,
            link_bytes_per_s: a.kv_gbps * 1e9,
        };
        let cores = a.cores.unwrap_or(host.cores as u32);
        let found = search(kinds, w, cores, a.hosts)?;
        eprint!("{}", found.report(a.top));
        if let Some(path) = &a.json {
            std::fs::write(path, found.to_json().to_string())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        let Some(best) = found.best() else { bail!("no layout meets the targets") };
        settings.apply_layout(found.settings(best)?);
    }
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

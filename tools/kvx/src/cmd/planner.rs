//! `kvx planner`: flags and wiring of the SLA planner process (kvx-planner's driver and
//! service): a profile, targets, pool bounds, a predictor and a connector (local, virtual or
//! Kubernetes).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvx_planner::connector::{Connector, LocalConnector, VirtualConnector};
use kvx_planner::driver::Driver;
use kvx_planner::kubernetes::{KubernetesConnector, KubernetesTarget, WorkloadKind};
use kvx_planner::load::LoadConfig;
use kvx_planner::plan::{Bounds, Planner, PlannerConfig, Replicas, Targets};
use kvx_planner::predict::PredictorKind;
use kvx_planner::service::{DEFAULT_SELECTOR, ServiceConfig, Source, run as serve};
use kvx_proto::profile::Profile;

use super::http_opts::shutdown_signal;

/// Where decisions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ConnectorArg {
    /// `kvx worker` processes on this host, started and drained by the planner.
    Local,
    /// A decision file for an outside system, acknowledged through another file.
    Virtual,
    /// Two Deployments (or StatefulSets) scaled through the Kubernetes API server.
    Kubernetes,
}

/// The kind of the Kubernetes workloads scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum KindArg {
    /// apps/v1 Deployments.
    Deployment,
    /// apps/v1 StatefulSets.
    Statefulset,
}

#[derive(Debug, Args)]
pub(crate) struct PlannerArgs {
    /// The frontend whose /metrics the planner reads (`http://host:port`).
    #[arg(
        long,
        env = "KVX_PLANNER_FRONTEND",
        required_unless_present = "prometheus_url",
        conflicts_with = "prometheus_url"
    )]
    frontend: Option<String>,
    /// The frontend's admin key, when /metrics needs one (`KVX_ADMIN_KEY`: the first of a
    /// comma-separated list).
    #[arg(long, env = "KVX_ADMIN_KEY", value_delimiter = ',', hide_env_values = true)]
    admin_key: Vec<String>,
    /// Instead of one frontend: a Prometheus server that scrapes the frontends
    /// (`http://host:port`); the planner reads their series through its /federate endpoint,
    /// summed over the frontends.
    #[arg(long, env = "KVX_PLANNER_PROMETHEUS_URL")]
    prometheus_url: Option<String>,
    /// With --prometheus-url: the series selector federated (name a job or a deployment's
    /// labels when the server scrapes more than one).
    #[arg(long, env = "KVX_PLANNER_PROMETHEUS_SELECTOR", default_value = DEFAULT_SELECTOR)]
    prometheus_selector: String,
    /// The worker profile (`kvx profile --out`): throughput-based sizing. Without one the
    /// planner sizes the pools from the workers' step times alone (load-based).
    #[arg(long, env = "KVX_PLANNER_PROFILE")]
    profile: Option<PathBuf>,
    /// Load-based sizing beside the profile's (the profile's is the floor); on without a
    /// profile.
    #[arg(long, env = "KVX_PLANNER_LOAD_BASED")]
    load_based: bool,
    /// Load-based: a pool shrinks only when every worker's estimate with one worker fewer is
    /// under the target × this.
    #[arg(long, env = "KVX_PLANNER_LOAD_SENSITIVITY", default_value_t = 0.8)]
    load_sensitivity: f64,
    /// Load-based: intervals of steps each step-time fit is made from.
    #[arg(long, env = "KVX_PLANNER_LOAD_WINDOW", default_value_t = 8)]
    load_window: usize,
    /// Load-based: the workers' batched-token budget (prompts are computed in such chunks).
    #[arg(long, env = "KVX_MAX_BATCHED_TOKENS", default_value_t = 512)]
    max_batched_tokens: usize,
    /// TTFT target, 90th percentile, milliseconds.
    #[arg(long, env = "KVX_PLANNER_TTFT_MS", default_value_t = 500.0)]
    ttft: f64,
    /// ITL target, 90th percentile, milliseconds.
    #[arg(long, env = "KVX_PLANNER_ITL_MS", default_value_t = 50.0)]
    itl: f64,
    /// Seconds between decisions.
    #[arg(long, env = "KVX_PLANNER_INTERVAL", default_value_t = 60.0)]
    planner_interval: f64,
    /// constant, moving-average[:WINDOW], holt[:ALPHA:BETA] or kalman[:Q].
    #[arg(long, env = "KVX_PLANNER_PREDICTOR", default_value = "holt")]
    predictor: PredictorKind,
    /// Fewest prefill workers.
    #[arg(long, env = "KVX_PLANNER_MIN_PREFILL", default_value_t = 1)]
    min_prefill: u32,
    /// Most prefill workers.
    #[arg(long, env = "KVX_PLANNER_MAX_PREFILL", default_value_t = 8)]
    max_prefill: u32,
    /// Fewest decode workers.
    #[arg(long, env = "KVX_PLANNER_MIN_DECODE", default_value_t = 1)]
    min_decode: u32,
    /// Most decode workers.
    #[arg(long, env = "KVX_PLANNER_MAX_DECODE", default_value_t = 8)]
    max_decode: u32,
    /// Seconds after a pool's change before it may shrink.
    #[arg(long, env = "KVX_PLANNER_COOLDOWN", default_value_t = 120.0)]
    cooldown: f64,
    /// Intervals past the last observation the pools are sized for (1.5: the end of the next
    /// interval; the trend predictors extend their slope that far).
    #[arg(long, env = "KVX_PLANNER_LOOKAHEAD", default_value_t = 1.5)]
    lookahead: f64,
    /// Where decisions go.
    #[arg(long, value_enum, env = "KVX_PLANNER_CONNECTOR", default_value = "local")]
    connector: ConnectorArg,
    /// Local: the arguments of every worker after `kvx worker` (split on spaces; the planner
    /// adds `--role`), e.g. "--frontend 127.0.0.1:7100 --engine mocker".
    #[arg(long, env = "KVX_PLANNER_WORKER_ARGS", allow_hyphen_values = true)]
    worker_args: Option<String>,
    /// Local: a directory for the workers' logs.
    #[arg(long, env = "KVX_PLANNER_WORKER_LOGS")]
    worker_logs: Option<PathBuf>,
    /// Virtual: the decision file written.
    #[arg(long, env = "KVX_PLANNER_DECISION_FILE")]
    decision_file: Option<PathBuf>,
    /// Virtual: the acknowledgement file read (`{"scaled_decision_id": N}`).
    #[arg(long, env = "KVX_PLANNER_ACK_FILE")]
    ack_file: Option<PathBuf>,
    /// Kubernetes: the prefill pool's workload.
    #[arg(long, env = "KVX_PLANNER_K8S_PREFILL")]
    k8s_prefill: Option<String>,
    /// Kubernetes: the decode pool's workload.
    #[arg(long, env = "KVX_PLANNER_K8S_DECODE")]
    k8s_decode: Option<String>,
    /// Kubernetes: the workloads' kind.
    #[arg(long, value_enum, env = "KVX_PLANNER_K8S_KIND", default_value = "deployment")]
    k8s_kind: KindArg,
    /// Kubernetes: the workloads' namespace (default: the credentials' own).
    #[arg(long, env = "KVX_PLANNER_K8S_NAMESPACE")]
    k8s_namespace: Option<String>,
    /// Kubernetes: a kubeconfig file (default: in-cluster credentials, else $KUBECONFIG or
    /// ~/.kube/config).
    #[arg(long, env = "KVX_PLANNER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Where the planner's /metrics listens.
    #[arg(long, env = "KVX_PLANNER_METRICS", default_value = "127.0.0.1:0")]
    metrics_listen: SocketAddr,
    /// Also append every decision (JSON lines) to this file.
    #[arg(long, env = "KVX_PLANNER_DECISIONS")]
    decisions: Option<PathBuf>,
    /// Stop after this many decisions.
    #[arg(long)]
    ticks: Option<u64>,
}

pub(crate) fn run(args: PlannerArgs) -> Result<()> {
    let profile = args.profile.as_deref().map(Profile::read).transpose()?;
    let secs = |v: f64, name: &str| -> Result<Duration> {
        if !(v.is_finite() && v > 0.0) {
            bail!("--{name} must be a positive number of seconds");
        }
        Ok(Duration::from_secs_f64(v))
    };
    let cfg = PlannerConfig {
        interval: secs(args.planner_interval, "planner-interval")?,
        targets: Targets { ttft_ms: args.ttft, itl_ms: args.itl },
        prefill: Bounds { min: args.min_prefill, max: args.max_prefill },
        decode: Bounds { min: args.min_decode, max: args.max_decode },
        predictor: args.predictor,
        cooldown: secs(args.cooldown.max(1e-3), "cooldown")?,
        lookahead: args.lookahead,
        load: (args.load_based || profile.is_none()).then_some(LoadConfig {
            sensitivity: args.load_sensitivity,
            window: args.load_window,
            chunk_tokens: args.max_batched_tokens as f64,
        }),
        ..PlannerConfig::default()
    };
    let planner = Planner::new(cfg.clone(), profile)?;
    let connector: Box<dyn Connector> = match args.connector {
        ConnectorArg::Local => {
            let Some(wa) = &args.worker_args else {
                bail!("--connector local needs --worker-args")
            };
            let exe = std::env::current_exe().context("finding this executable")?;
            Box::new(LocalConnector::kvx_workers(exe, wa, args.worker_logs.clone())?)
        }
        ConnectorArg::Virtual => {
            let (Some(d), Some(a)) = (&args.decision_file, &args.ack_file) else {
                bail!("--connector virtual needs --decision-file and --ack-file")
            };
            Box::new(VirtualConnector::new(
                d,
                a,
                Replicas { prefill: args.min_prefill, decode: args.min_decode },
            ))
        }
        ConnectorArg::Kubernetes => {
            let (Some(p), Some(d)) = (&args.k8s_prefill, &args.k8s_decode) else {
                bail!("--connector kubernetes needs --k8s-prefill and --k8s-decode")
            };
            let target = KubernetesTarget {
                kind: match args.k8s_kind {
                    KindArg::Deployment => WorkloadKind::Deployment,
                    KindArg::Statefulset => WorkloadKind::StatefulSet,
                },
                namespace: args.k8s_namespace.clone(),
                prefill: p.clone(),
                decode: d.clone(),
                kubeconfig: args.kubeconfig.clone(),
            };
            Box::new(KubernetesConnector::connect(target, Duration::from_secs(30))?)
        }
    };
    let service = ServiceConfig {
        source: match (&args.frontend, &args.prometheus_url) {
            (Some(f), _) => Source::Frontend(f.clone()),
            (None, Some(url)) => {
                Source::Prometheus { url: url.clone(), selector: args.prometheus_selector.clone() }
            }
            (None, None) => bail!("give --frontend or --prometheus-url"),
        },
        bearer: args.admin_key.first().filter(|_| args.frontend.is_some()).cloned(),
        interval: cfg.interval,
        metrics_listen: args.metrics_listen,
        decisions: args.decisions.clone(),
        ticks: args.ticks,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve(Driver::new(planner, connector), service, shutdown_signal(), |a| {
        println!("planner metrics on http://{a}/metrics");
    }))?;
    Ok(())
}

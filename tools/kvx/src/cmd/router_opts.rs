//! Router and disaggregation flags shared by the commands that route requests (`serve`,
//! `frontend`) and run engines (`worker`), and the one place that turns them into a
//! [`RouterConfig`], a [`DisaggConfig`] and the KV link's settings.

use std::time::Duration;

use anyhow::Result;
use clap::{Args, ValueEnum};
use kvx_planes::DisaggConfig;
use kvx_router::{RouterConfig, RoutingMode, TierCredits};
use kvx_worker::kvlink::KvLinkConfig;

/// How the router places requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RouterMode {
    /// KV-aware: the worker with the lowest cost (uncached prompt blocks plus load).
    Kv,
    /// Each worker in turn.
    RoundRobin,
    /// A worker at random.
    Random,
    /// The worker with the fewest active KV blocks.
    LeastLoaded,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct RouterOpts {
    /// How requests are placed on workers.
    #[arg(long, value_enum, env = "KVX_ROUTER_MODE", default_value = "kv")]
    pub(crate) router_mode: RouterMode,
    /// KV mode: weight of a prompt block still to compute against a block in use. Above 1
    /// (Dynamo's default) a cached prefix keeps its requests on one worker rather than being
    /// copied to a slightly less loaded one, which leaves room in every worker's cache for
    /// more distinct prefixes (bench/scripts/router_prefix.sh measures the effect).
    #[arg(long, env = "KVX_ROUTER_OVERLAP_WEIGHT", default_value_t = 4.0)]
    pub(crate) router_overlap_weight: f64,
    /// KV mode: softmax temperature over normalized costs (0 = always the lowest cost).
    #[arg(long, env = "KVX_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub(crate) router_temperature: f64,
    /// Seed of the router's random choices (ties, softmax, random mode).
    #[arg(long, env = "KVX_ROUTER_SEED")]
    pub(crate) router_seed: Option<u64>,
    /// KV mode: what a prompt block a worker holds in host memory (G2) is worth, as a share
    /// of one in its pool: 1 − its load time / its compute time.
    #[arg(long, env = "KVX_ROUTER_HOST_CREDIT", default_value_t = TierCredits::default().host)]
    pub(crate) router_host_credit: f64,
    /// KV mode: the same for a block on the worker's disk (G3).
    #[arg(long, env = "KVX_ROUTER_DISK_CREDIT", default_value_t = TierCredits::default().disk)]
    pub(crate) router_disk_credit: f64,
}

impl RouterOpts {
    /// The router configuration for workers with `block_size`-token KV blocks.
    pub(crate) fn config(&self, block_size: usize) -> Result<RouterConfig> {
        let mut cfg = RouterConfig {
            block_size,
            mode: match self.router_mode {
                RouterMode::Kv => RoutingMode::Kv,
                RouterMode::RoundRobin => RoutingMode::RoundRobin,
                RouterMode::Random => RoutingMode::Random,
                RouterMode::LeastLoaded => RoutingMode::LeastLoaded,
            },
            overlap_weight: self.router_overlap_weight,
            temperature: self.router_temperature,
            tier_credit: TierCredits {
                host: self.router_host_credit,
                disk: self.router_disk_credit,
                ..TierCredits::default()
            },
            ..RouterConfig::default()
        };
        if let Some(seed) = self.router_seed {
            cfg.seed = seed;
        }
        cfg.validate().map_err(|e| anyhow::anyhow!("router flags: {e}"))?;
        Ok(cfg)
    }
}

/// Disaggregated prefill and decode.
#[derive(Debug, Clone, Args)]
pub(crate) struct DisaggOpts {
    /// Prefill on a prefill worker only when the prompt the decode worker lacks has at least
    /// this many tokens (shorter ones are computed by the decode worker).
    #[arg(long, env = "KVX_DISAGG_MIN_TOKENS", default_value_t = 256)]
    pub(crate) disagg_min_tokens: usize,
    /// ... and the prefill workers queue fewer prompt tokens than this.
    #[arg(long, env = "KVX_DISAGG_MAX_PREFILL_QUEUE", default_value_t = 16_384)]
    pub(crate) disagg_max_prefill_queue: usize,
    /// Milliseconds a prompt's KV transfer may take; then the decode worker computes it.
    #[arg(long, env = "KVX_KV_TRANSFER_TIMEOUT_MS", default_value_t = 10_000)]
    pub(crate) kv_transfer_timeout_ms: u64,
    /// Milliseconds a prefill worker may take to compute a prompt before the decode worker
    /// computes it instead (a dead prefill worker is noticed at once).
    #[arg(long, env = "KVX_PREFILL_TIMEOUT_MS", default_value_t = 300_000)]
    pub(crate) prefill_timeout_ms: u64,
}

impl DisaggOpts {
    /// The frontend side.
    pub(crate) fn config(&self) -> DisaggConfig {
        DisaggConfig {
            min_tokens: self.disagg_min_tokens,
            max_prefill_queue: self.disagg_max_prefill_queue,
            transfer_timeout: self.timeout(),
            prefill_timeout: Duration::from_millis(self.prefill_timeout_ms.max(1)),
            ..DisaggConfig::default()
        }
    }

    /// The workers' KV link (`tcp`: the agent's address for peers on other hosts).
    pub(crate) fn link(&self, tcp: Option<std::net::SocketAddr>) -> KvLinkConfig {
        KvLinkConfig { tcp_listen: tcp, timeout: self.timeout(), ..KvLinkConfig::default() }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.kv_transfer_timeout_ms.max(1))
    }
}

//! Router flags shared by the commands that route requests (`serve`, `frontend`), and the one
//! place that turns them into a [`RouterConfig`].

use anyhow::Result;
use clap::{Args, ValueEnum};
use kvx_router::{RouterConfig, RoutingMode};

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
            ..RouterConfig::default()
        };
        if let Some(seed) = self.router_seed {
            cfg.seed = seed;
        }
        cfg.validate().map_err(|e| anyhow::anyhow!("router flags: {e}"))?;
        Ok(cfg)
    }
}

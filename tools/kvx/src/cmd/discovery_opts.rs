//! Discovery flags shared by `frontend` and `worker`, turned into an etcd client and its
//! settings, and the worker records a worker process publishes.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvx_discovery::{Etcd, EtcdConfig, WorkerRecord};
use kvx_worker::Hosted;

/// How workers are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum DiscoveryKind {
    /// No service: workers dial the frontend, or the frontend dials `--workers`.
    Embedded,
    /// Worker records under leases in etcd, watched by frontends.
    Etcd,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct DiscoveryOpts {
    /// How workers are found.
    #[arg(long, value_enum, env = "KVX_DISCOVERY", default_value = "embedded")]
    discovery: DiscoveryKind,
    /// etcd members (`http://host:port`), comma-separated.
    #[arg(
        long,
        env = "KVX_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    etcd_endpoints: Vec<String>,
    /// The fleet's namespace: keys live under `/kvx/NAMESPACE/`.
    #[arg(long, env = "KVX_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Seconds a worker's records outlive its last keep-alive.
    #[arg(long, env = "KVX_LEASE_TTL", default_value_t = 10)]
    lease_ttl: u64,
}

impl DiscoveryOpts {
    /// The etcd client and settings, with `--discovery etcd`.
    pub(crate) fn etcd(&self) -> Result<Option<(Arc<Etcd>, EtcdConfig)>> {
        if self.discovery != DiscoveryKind::Etcd {
            return Ok(None);
        }
        let cfg = EtcdConfig {
            endpoints: self.etcd_endpoints.clone(),
            namespace: self.namespace.clone(),
            ttl: Duration::from_secs(self.lease_ttl.max(1)),
            timeout: Duration::from_secs(2),
        };
        let etcd = Etcd::new(&cfg.endpoints, cfg.timeout).context("--etcd-endpoints")?;
        Ok(Some((Arc::new(etcd), cfg)))
    }
}

/// The records of a worker process's engines, served at `endpoint`.
pub(crate) fn records(
    hosted: &[Hosted],
    endpoint: &str,
    model: &str,
    fingerprint: &str,
    block_size: usize,
) -> Vec<WorkerRecord> {
    hosted
        .iter()
        .map(|h| WorkerRecord {
            worker_id: h.worker_id,
            endpoint: endpoint.to_string(),
            role: h.role,
            model: model.to_string(),
            fingerprint: fingerprint.to_string(),
            block_size,
            kv_blocks: h.kv_blocks,
            // Without the agent's key: etcd readers are not all cluster members; peers get
            // the key only inside `Register` frames on an admitted plane connection.
            kv_agent: h
                .kv_peer
                .as_ref()
                .and_then(|p| kvx_xfer::AgentMetadata::decode(&p.agent).ok())
                .map(|m| m.without_key().encode())
                .unwrap_or_default(),
        })
        .collect()
}

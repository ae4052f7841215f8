//! Discovery flags shared by `frontend` and `worker`, turned into an etcd client and its
//! settings (with etcd's credentials, checked before anything starts), and the worker
//! records a worker process publishes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kvx_discovery::{Etcd, EtcdConfig, EtcdCredentials, WorkerRecord};
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
    /// etcd members (`http://host:port`, or `https://host:port` with `--etcd-ca`),
    /// comma-separated.
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
    /// The CA (PEM) that signed etcd's server certificate: needed for `https://` endpoints.
    #[arg(long, env = "KVX_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// A client certificate chain (PEM) for etcd's `--client-cert-auth`, with `--etcd-key`.
    #[arg(long, env = "KVX_ETCD_CERT", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "KVX_ETCD_KEY", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// An etcd user (etcd with authentication enabled), with `--etcd-password-file`.
    #[arg(long, env = "KVX_ETCD_USER")]
    etcd_user: Option<String>,
    /// A file holding the etcd user's password (one line); or `KVX_ETCD_PASSWORD` holds it.
    #[arg(long, env = "KVX_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// The etcd user's password itself (prefer the file: flags show in `ps`).
    #[arg(
        long,
        env = "KVX_ETCD_PASSWORD",
        hide = true,
        hide_env_values = true,
        conflicts_with = "etcd_password_file"
    )]
    etcd_password: Option<String>,
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
            credentials: self.credentials()?,
        };
        let etcd = Etcd::from_config(&cfg).context("etcd discovery")?;
        check(&cfg)?;
        Ok(Some((Arc::new(etcd), cfg)))
    }

    fn credentials(&self) -> Result<EtcdCredentials> {
        let password = match (&self.etcd_password_file, &self.etcd_password) {
            (Some(f), _) => {
                let p = std::fs::read_to_string(f)
                    .with_context(|| format!("reading --etcd-password-file {}", f.display()))?;
                Some(p.trim_end_matches(['\r', '\n']).to_string())
            }
            (None, Some(p)) => Some(p.clone()),
            (None, None) => None,
        };
        let user = match (&self.etcd_user, password) {
            (Some(u), Some(p)) => Some((u.clone(), p)),
            (Some(_), None) => {
                bail!("--etcd-user needs --etcd-password-file (or KVX_ETCD_PASSWORD)")
            }
            (None, Some(_)) => bail!("an etcd password without --etcd-user"),
            (None, None) => None,
        };
        let client_cert = self.etcd_cert.clone().zip(self.etcd_key.clone());
        Ok(EtcdCredentials { ca: self.etcd_ca.clone(), client_cert, user })
    }
}

/// A wrong password, a CA that did not sign etcd's certificate or a client certificate etcd
/// refuses stops the process now; an etcd that does not answer yet does not (discovery keeps
/// trying, as it does when etcd goes away later).
fn check(cfg: &EtcdConfig) -> Result<()> {
    if let Some(e) = Etcd::check_at_start(cfg).context("etcd discovery")? {
        eprintln!("kvx: etcd does not answer yet ({e}); starting, and still trying");
    }
    Ok(())
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

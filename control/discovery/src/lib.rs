//! kvx-discovery: who is alive. Worker processes publish a [`WorkerRecord`] per engine under
//! `/kvx/<namespace>/workers/<id>` in etcd, bound to a lease they keep alive while healthy
//! ([`Registrar`]); frontends list and watch the prefix ([`watch_fleet`]) and dial the
//! endpoints that appear, dropping those whose keys expire.
//!
//! Without etcd ("embedded" discovery, the default) workers are found as before: in-process
//! shards, workers that dial the frontend, or a static list the frontend dials.
//!
//! An etcd that goes away changes nothing that runs: a watcher keeps its last view of the
//! fleet and reconciles it (list, then watch) once etcd answers again; a registrar keeps
//! trying and registers again under a new lease if its old one expired.
//!
//! etcd may ask for credentials ([`EtcdCredentials`]): TLS to `https://` endpoints with a
//! client certificate, or a user and password (a token that is fetched again when etcd
//! forgets it). Credentials etcd refuses are an error at start ([`Etcd::check`]), not a
//! retry loop.

#![forbid(unsafe_code)]

pub mod etcd;
mod tls;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvx_proto::WorkerId;
use kvx_proto::plane::WorkerRole;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

pub use etcd::Etcd;

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// Settings that cannot work.
    #[error("discovery configuration: {0}")]
    Config(String),
    /// No etcd endpoint answered.
    #[error("etcd unavailable: {0}")]
    Unavailable(String),
    /// etcd answered with an error.
    #[error("etcd refused: {0}")]
    Refused(String),
    /// etcd answered something unreadable.
    #[error("etcd protocol: {0}")]
    Protocol(String),
    /// etcd refused who we are: a wrong user or password, no user where etcd wants one, or
    /// a permission the user lacks.
    #[error("etcd authentication: {0}")]
    Auth(String),
    /// TLS with etcd failed: its certificate is not trusted, or ours is missing or refused.
    #[error("etcd TLS: {0}")]
    Tls(String),
}

impl DiscoveryError {
    /// Whether trying again later may help (etcd away), rather than different settings or
    /// credentials.
    pub fn is_transient(&self) -> bool {
        matches!(self, DiscoveryError::Unavailable(_))
    }
}

/// What a worker engine publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Its worker id.
    pub worker_id: WorkerId,
    /// Where its process serves frontends (`host:port`, the worker plane).
    pub endpoint: String,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
    /// The served model's name.
    pub model: String,
    /// What identifies the model's weights and arithmetic (`file:size:arith`).
    pub fingerprint: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks of its pool.
    pub kv_blocks: usize,
    /// Its KV transfer agent's metadata (kvx-xfer, encoded), when it moves KV.
    #[serde(default)]
    pub kv_agent: Vec<u8>,
}

/// Settings of etcd discovery.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `http://host:port` (or, with [`EtcdCredentials::ca`], `https://host:port`) of the
    /// cluster's members.
    pub endpoints: Vec<String>,
    /// Keys live under `/kvx/<namespace>/`.
    pub namespace: String,
    /// Lease TTL of a worker's records.
    pub ttl: Duration,
    /// Timeout of one call.
    pub timeout: Duration,
    /// How kvx proves who it is to etcd, and checks etcd's certificate.
    pub credentials: EtcdCredentials,
}

/// Credentials for etcd (all optional).
#[derive(Clone, Default)]
pub struct EtcdCredentials {
    /// The CA (PEM) that signed etcd's server certificate; needed for `https://` endpoints.
    pub ca: Option<PathBuf>,
    /// A client certificate chain and its key (PEM), for etcd's `--client-cert-auth`.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// A user and password: calls carry the token etcd grants for them.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("ca", &self.ca)
            .field("client_cert", &self.client_cert)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish_non_exhaustive()
    }
}

impl EtcdConfig {
    /// The prefix of worker records.
    pub fn workers_prefix(&self) -> String {
        format!("/kvx/{}/workers/", self.namespace)
    }
}

/// Backoff between attempts while etcd is away.
fn backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// Keeps a worker process's records in etcd under one lease while it lives.
#[derive(Debug)]
pub struct Registrar {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    registered: watch::Receiver<bool>,
}

impl Registrar {
    /// Publishes `records` (inside a tokio runtime) and keeps them alive.
    pub fn start(etcd: Arc<Etcd>, cfg: &EtcdConfig, records: Vec<WorkerRecord>) -> Registrar {
        let (stop, stop_rx) = watch::channel(false);
        let (reg_tx, registered) = watch::channel(false);
        let prefix = cfg.workers_prefix();
        let ttl = cfg.ttl.as_secs().max(1);
        let task = tokio::spawn(keep_registered(etcd, prefix, ttl, records, stop_rx, reg_tx));
        Registrar { stop, task, registered }
    }

    /// Waits until the records are in etcd (or `limit` passes); whether they are.
    pub async fn wait_registered(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.registered.wait_for(|r| *r)).await.is_ok_and(|r| r.is_ok())
    }

    /// Takes the records out of etcd (revokes the lease) and stops keeping them.
    pub async fn withdraw(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn keep_registered(
    etcd: Arc<Etcd>,
    prefix: String,
    ttl: u64,
    records: Vec<WorkerRecord>,
    mut stop: watch::Receiver<bool>,
    registered: watch::Sender<bool>,
) {
    let mut lease = 0i64;
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = tokio::time::sleep(wait) => {}
        }
        if lease == 0 {
            match register(&etcd, &prefix, ttl, &records).await {
                Ok(l) => {
                    tracing::info!(lease = l, workers = records.len(), "registered in etcd");
                    lease = l;
                    let _ = registered.send(true);
                    wait = Duration::from_secs(ttl) / 3;
                }
                Err(e) => {
                    wait = backoff(wait);
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot register in etcd");
                }
            }
            continue;
        }
        match etcd.keepalive(lease).await {
            Ok(t) if t > 0 => wait = Duration::from_secs(ttl) / 3,
            Ok(_) => {
                tracing::warn!(lease, "the etcd lease expired; registering again");
                let _ = registered.send(false);
                lease = 0;
                wait = Duration::ZERO;
            }
            Err(e) => {
                wait = backoff(wait.min(Duration::from_secs(1)));
                tracing::warn!(error = %e, "etcd keep-alive failed; retrying");
            }
        }
    }
    if lease != 0 {
        if let Err(e) = etcd.revoke(lease).await {
            tracing::warn!(error = %e, "revoking the etcd lease");
        }
        for r in &records {
            let _ = etcd.delete(&format!("{prefix}{}", r.worker_id)).await;
        }
    }
}

async fn register(
    etcd: &Etcd,
    prefix: &str,
    ttl: u64,
    records: &[WorkerRecord],
) -> Result<i64, DiscoveryError> {
    let lease = etcd.grant(ttl).await?;
    for r in records {
        let value = serde_json::to_vec(r).map_err(|e| DiscoveryError::Protocol(e.to_string()))?;
        etcd.put(&format!("{prefix}{}", r.worker_id), &value, lease).await?;
    }
    Ok(lease)
}

/// A change of the fleet a frontend sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FleetChange {
    /// A worker appeared (or its record changed).
    Up(WorkerRecord),
    /// A worker's record is gone (withdrawn, or its lease expired).
    Down(WorkerId),
}

/// Watches the worker records of `cfg`'s namespace (inside a tokio runtime): every record
/// there now and every change after, on a bounded channel. While etcd is away nothing
/// changes; when it answers again the view is reconciled with a fresh listing.
pub fn watch_fleet(etcd: Arc<Etcd>, cfg: &EtcdConfig) -> mpsc::Receiver<FleetChange> {
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(follow(etcd, cfg.workers_prefix(), tx));
    rx
}

async fn follow(etcd: Arc<Etcd>, prefix: String, tx: mpsc::Sender<FleetChange>) {
    let mut known: HashMap<String, WorkerRecord> = HashMap::new();
    let mut wait = Duration::ZERO;
    let parse = |v: &[u8]| serde_json::from_slice::<WorkerRecord>(v).ok();
    loop {
        tokio::time::sleep(wait).await;
        if tx.is_closed() {
            return;
        }
        let (rev, kvs) = match etcd.range(&prefix).await {
            Ok(x) => x,
            Err(e) => {
                wait = backoff(wait);
                tracing::warn!(error = %e, "cannot list workers in etcd; keeping the last view");
                continue;
            }
        };
        // Reconcile: what vanished while we were not watching goes, what is new comes.
        let now: HashMap<String, WorkerRecord> =
            kvs.iter().filter_map(|(k, v)| Some((k.clone(), parse(v)?))).collect();
        for (k, r) in &known {
            if !now.contains_key(k) && tx.send(FleetChange::Down(r.worker_id)).await.is_err() {
                return;
            }
        }
        for (k, r) in &now {
            if known.get(k) != Some(r) && tx.send(FleetChange::Up(r.clone())).await.is_err() {
                return;
            }
        }
        known = now;
        let mut w = match etcd.watch(&prefix, rev + 1).await {
            Ok(w) => w,
            Err(e) => {
                wait = backoff(wait);
                tracing::warn!(error = %e, "cannot watch workers in etcd");
                continue;
            }
        };
        loop {
            match w.next().await {
                Ok(events) => {
                    for ev in events {
                        let change = match ev {
                            etcd::WatchEvent::Put { key, value } => match parse(&value) {
                                Some(r) => {
                                    known.insert(key, r.clone());
                                    FleetChange::Up(r)
                                }
                                None => continue,
                            },
                            etcd::WatchEvent::Delete { key } => match known.remove(&key) {
                                Some(r) => FleetChange::Down(r.worker_id),
                                None => continue,
                            },
                        };
                        if tx.send(change).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the etcd watch broke; listing again");
                    wait = Duration::from_millis(100);
                    break;
                }
            }
        }
    }
}

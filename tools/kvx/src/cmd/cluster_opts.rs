//! Cluster membership flags shared by `frontend` and `worker`: mutual TLS with a cluster CA
//! or a shared token, resolved once into the planes' [`ClusterAuth`].

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use kvx_trust::ClusterAuth;

#[derive(Debug, Clone, Args)]
pub(crate) struct ClusterOpts {
    /// The cluster CA (PEM): with `--cluster-cert` and `--cluster-key`, every frontend ↔
    /// worker connection is mutual TLS, each side checking the other's certificate against
    /// it (the dialled side's certificate must also name the host dialled).
    #[arg(long, env = "KVX_CLUSTER_CA", requires_all = ["cluster_cert", "cluster_key"])]
    cluster_ca: Option<PathBuf>,
    /// This member's certificate chain (PEM), signed by the cluster CA.
    #[arg(long, env = "KVX_CLUSTER_CERT", requires = "cluster_ca")]
    cluster_cert: Option<PathBuf>,
    /// This member's private key (PEM).
    #[arg(long, env = "KVX_CLUSTER_KEY", requires = "cluster_ca")]
    cluster_key: Option<PathBuf>,
    /// A file holding the shared cluster token (at least 16 bytes): every plane connection
    /// proves it holds the token before anything else is read (not encrypted: for one host
    /// or a trusted network; use the CA flags across hosts).
    #[arg(long, env = "KVX_CLUSTER_TOKEN_FILE", conflicts_with = "cluster_ca")]
    cluster_token_file: Option<PathBuf>,
    /// The cluster token itself (prefer the file: flags show in `ps`).
    #[arg(
        long,
        env = "KVX_CLUSTER_TOKEN",
        hide_env_values = true,
        conflicts_with_all = ["cluster_ca", "cluster_token_file"]
    )]
    cluster_token: Option<String>,
}

impl ClusterOpts {
    /// The membership check the planes enforce.
    pub(crate) fn auth(&self) -> Result<ClusterAuth> {
        Ok(match (&self.cluster_ca, &self.cluster_cert, &self.cluster_key) {
            (Some(ca), Some(cert), Some(key)) => ClusterAuth::mtls(ca, cert, key)?,
            (Some(_), _, _) => bail!("--cluster-ca needs --cluster-cert and --cluster-key"),
            _ => match (&self.cluster_token_file, &self.cluster_token) {
                (Some(f), _) => ClusterAuth::token_file(f)?,
                (None, Some(t)) => ClusterAuth::token(t.as_bytes())?,
                (None, None) => ClusterAuth::Open,
            },
        })
    }
}

/// Warns when a plane listens beyond loopback with no membership check.
pub(crate) fn warn_if_open(auth: &ClusterAuth, addr: SocketAddr, what: &str) {
    if auth.is_open() && !addr.ip().is_loopback() {
        eprintln!(
            "kvx: warning: {what} on {addr} accepts any peer: start every member with \
             --cluster-ca/--cluster-cert/--cluster-key or --cluster-token-file"
        );
    }
}

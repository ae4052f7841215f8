//! Who may talk to whom: TLS material for the HTTP API and cluster membership on the worker
//! planes — mutual TLS with a cluster CA, or a shared token proved by a challenge-response
//! handshake — checked before a single frame of a connection is read.

pub mod cluster;
pub mod pem;

pub use cluster::{ClusterAuth, HandshakeError, PlaneStream, RefusalLog};

use std::path::{Path, PathBuf};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// A PEM file that cannot be read or holds nothing usable.
    #[error("{path}: {why}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Settings that do not fit together.
    #[error("{0}")]
    Config(String),
    /// rustls refused the material or the peer.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

impl TrustError {
    fn pem(path: &Path, e: impl std::fmt::Display) -> TrustError {
        TrustError::Pem { path: path.into(), why: e.to_string() }
    }
}

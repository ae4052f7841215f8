//! kvx-kvbm: the KV block manager — the tiers below an engine's block pool (G1): host
//! memory (G2) and local disk (G3), the policy that moves blocks between them, and the
//! onboarding of a prompt's prefix from them.
//!
//! * [`pool`] — one tier's slots (dedup by sequence hash, pins, LRU); pure bookkeeping.
//! * [`disk`] — the disk tier's file: slot headers (block identity, layout fingerprint,
//!   checksum), the scan that rebuilds the tier after a restart.
//! * [`tiers`] — [`Tiers`], a shard's tiers and their policy, called by the shard between
//!   steps; the bytes move on a mover thread through the process's kvx-xfer agent
//!   (shared-memory copies, `O_DIRECT` io_uring file reads and writes), never in a step.

#![forbid(unsafe_code)]

pub mod disk;
mod mover;
pub mod pool;
pub mod tiers;

pub use mover::PoolLayout;
pub use tiers::{Action, DiskConfig, TierConfig, TierEvent, Tiers};

/// Why tiers could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum KvbmError {
    /// Settings that cannot work.
    #[error("{0}")]
    Config(String),
    /// The disk tier's file.
    #[error(transparent)]
    Disk(#[from] disk::DiskError),
    /// The transfer agent refused a region or a remote.
    #[error("KV tiers: {0}")]
    Xfer(#[from] kvx_xfer::XferError),
}

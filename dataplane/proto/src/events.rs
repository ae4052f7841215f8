//! KV events: what a worker tells the router about the blocks it holds.
//!
//! Every worker numbers its events with a monotonic `event_id`; a consumer that sees a gap
//! has lost events and resyncs that worker (asks for a snapshot of its blocks).

use serde::{Deserialize, Serialize};

use crate::WorkerId;
use crate::hashing::{LocalBlockHash, SequenceHash};

/// Where a block is stored; cheaper tiers are worth less to the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StorageTier {
    /// G1: the engine's own KV pool (device or, on CPU, the shard's memory).
    Device,
    /// G2: host memory of the KV manager.
    Host,
    /// G3: local disk.
    Disk,
    /// G4: a remote store.
    Remote,
}

/// One stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// Sequence hash (identifies the block and its prefix).
    pub seq_hash: SequenceHash,
    /// Local hash (the block's own tokens).
    pub local_hash: LocalBlockHash,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventData {
    /// Consecutive blocks of one sequence were stored after `parent` (`None`: from the root).
    Stored {
        /// Sequence hash of the block before the first stored one.
        parent: Option<SequenceHash>,
        /// The blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed {
        /// Their sequence hashes.
        seq_hashes: Vec<SequenceHash>,
    },
    /// Every block of the tier was dropped.
    Cleared,
}

/// One KV event of one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// The worker.
    pub worker_id: WorkerId,
    /// Monotonic per worker, starting at 1.
    pub event_id: u64,
    /// The tier the blocks are in.
    pub tier: StorageTier,
    /// What happened.
    pub data: KvEventData,
}

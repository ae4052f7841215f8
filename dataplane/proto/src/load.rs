//! Load reports: a worker's state at a step boundary, for routing and planning.

use serde::{Deserialize, Serialize};

use crate::WorkerId;

/// A worker's load, sent at step boundaries (at most every few milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LoadReport {
    /// The worker.
    pub worker_id: WorkerId,
    /// Sequences being computed.
    pub active_seqs: u32,
    /// Requests waiting for admission.
    pub waiting: u32,
    /// KV blocks in use by active sequences.
    pub active_blocks: u32,
    /// Free blocks (idle cached blocks count as free).
    pub free_blocks: u32,
    /// All blocks.
    pub total_blocks: u32,
    /// Prompt tokens admitted but not yet prefilled.
    pub queued_prefill_tokens: u32,
    /// Duration of the last step, milliseconds.
    pub step_ms: f32,
}

impl LoadReport {
    /// Fraction of the KV pool in use.
    pub fn kv_usage(&self) -> f32 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.active_blocks as f32 / self.total_blocks as f32
        }
    }
}

/// A worker's counters since it started, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct WorkerMetrics {
    /// Current load.
    pub load: LoadReport,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Requests finished.
    pub finished: u64,
    /// Steps run.
    pub steps: u64,
    /// The KV tiers below the engine's pool (all zero without tiers).
    #[serde(default)]
    pub tiers: TierMetrics,
}

/// Counters of a worker's KV tiers below its engine's pool: G2 (host memory) and G3 (disk).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TierMetrics {
    /// Blocks held in host memory.
    pub host_blocks: u64,
    /// Blocks host memory can hold.
    pub host_capacity: u64,
    /// Blocks held on disk.
    pub disk_blocks: u64,
    /// Blocks the disk tier can hold.
    pub disk_capacity: u64,
    /// Blocks copied from the engine's pool to host memory.
    pub offloaded_host: u64,
    /// Blocks written to disk (from the pool, or from host memory with a reuse filter).
    pub offloaded_disk: u64,
    /// Registered blocks not copied down because copies lagged too far behind.
    pub offload_skipped: u64,
    /// Blocks loaded into the engine's pool from host memory.
    pub onboarded_host: u64,
    /// Blocks loaded into the engine's pool from disk.
    pub onboarded_disk: u64,
    /// Prompt blocks looked up below the engine's pool.
    pub lookups: u64,
    /// Of which found in host memory.
    pub hits_host: u64,
    /// Of which found on disk only.
    pub hits_disk: u64,
    /// Bytes copied from the pool to host memory.
    pub offload_host_bytes: u64,
    /// Seconds those copies took.
    pub offload_host_seconds: f64,
    /// Bytes written to disk (headers included).
    pub offload_disk_bytes: u64,
    /// Seconds those writes took (checksums included).
    pub offload_disk_seconds: f64,
    /// Bytes of loads from host memory into the pool.
    pub onboard_host_bytes: u64,
    /// Seconds those loads took.
    pub onboard_host_seconds: f64,
    /// Bytes loaded from disk into the pool (read into staging memory, checked, copied).
    pub onboard_disk_bytes: u64,
    /// Seconds those loads took.
    pub onboard_disk_seconds: f64,
    /// Blocks whose bytes failed their checksum (dropped, computed instead).
    pub checksum_failures: u64,
    /// Failed writes to the disk tier.
    pub disk_errors: u64,
    /// Whether offload to disk stopped after a failure (the disk is full or failing).
    pub disk_stopped: bool,
}

impl WorkerMetrics {
    /// Cached prompt tokens over prompt tokens.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

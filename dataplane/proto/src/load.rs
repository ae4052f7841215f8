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

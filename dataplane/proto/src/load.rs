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

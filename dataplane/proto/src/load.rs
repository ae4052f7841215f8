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
    /// Sequences it computes at once at most (0: not reported).
    #[serde(default)]
    pub seq_slots: u32,
    /// The fewest sequences decoding at once that give nearly the decode throughput of all
    /// its slots, from its own step times (0: not known yet).
    #[serde(default)]
    pub batch_knee: u32,
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
    /// Sums over the worker's steps of what a step did and how long it took.
    #[serde(default)]
    pub step: StepSums,
}

/// Sums over a worker's steps, since it started, of each step's prompt tokens `x1`, the
/// context its decoded sequences attended `x2` (tokens), its wall time `y` (seconds) and the
/// prompt tokens queued at its start `q`: the sufficient statistics of a least-squares fit
/// `y = a + b·x1 + c·x2` over any run of steps (the difference of two reads), and, with `qy`
/// (queued tokens × seconds), the time-weighted prefill queue. No step is kept.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StepSums {
    /// Steps.
    pub n: f64,
    /// Σ x1.
    pub x1: f64,
    /// Σ x2.
    pub x2: f64,
    /// Σ y.
    pub y: f64,
    /// Σ x1².
    pub x1x1: f64,
    /// Σ x1·x2.
    pub x1x2: f64,
    /// Σ x2².
    pub x2x2: f64,
    /// Σ x1·y.
    pub x1y: f64,
    /// Σ x2·y.
    pub x2y: f64,
    /// Σ y².
    pub yy: f64,
    /// Σ q·y.
    pub qy: f64,
}

impl StepSums {
    /// The names of the sums, in [`StepSums::values`] order.
    pub const NAMES: [&'static str; 11] =
        ["n", "x1", "x2", "y", "x1x1", "x1x2", "x2x2", "x1y", "x2y", "yy", "qy"];

    /// Counts a step of `prefill` prompt tokens and `decode_context` attended decode tokens
    /// that took `secs`, with `queued` prompt tokens waiting at its start.
    pub fn add(&mut self, prefill: f64, decode_context: f64, secs: f64, queued: f64) {
        let (x1, x2, y) = (prefill, decode_context, secs);
        self.n += 1.0;
        self.x1 += x1;
        self.x2 += x2;
        self.y += y;
        self.x1x1 += x1 * x1;
        self.x1x2 += x1 * x2;
        self.x2x2 += x2 * x2;
        self.x1y += x1 * y;
        self.x2y += x2 * y;
        self.yy += y * y;
        self.qy += queued * y;
    }

    /// The sums as an array, in [`StepSums::NAMES`] order.
    pub fn values(&self) -> [f64; 11] {
        [
            self.n, self.x1, self.x2, self.y, self.x1x1, self.x1x2, self.x2x2, self.x1y, self.x2y,
            self.yy, self.qy,
        ]
    }

    /// Sets the sum called `name`; false for an unknown name.
    pub fn set(&mut self, name: &str, v: f64) -> bool {
        let slot = match name {
            "n" => &mut self.n,
            "x1" => &mut self.x1,
            "x2" => &mut self.x2,
            "y" => &mut self.y,
            "x1x1" => &mut self.x1x1,
            "x1x2" => &mut self.x1x2,
            "x2x2" => &mut self.x2x2,
            "x1y" => &mut self.x1y,
            "x2y" => &mut self.x2y,
            "yy" => &mut self.yy,
            "qy" => &mut self.qy,
            _ => return false,
        };
        *slot = v;
        true
    }

    /// The steps between `earlier` and `self` (a worker that restarted — any sum went down:
    /// they only grow — counts from zero).
    pub fn since(&self, earlier: &StepSums) -> StepSums {
        let (a, b) = (self.values(), earlier.values());
        if a.iter().zip(&b).any(|(now, then)| now < then) {
            return *self;
        }
        Self::from_values(std::array::from_fn(|i| a[i] - b[i]))
    }

    /// The steps of both.
    pub fn plus(&self, other: &StepSums) -> StepSums {
        let (a, b) = (self.values(), other.values());
        Self::from_values(std::array::from_fn(|i| a[i] + b[i]))
    }

    /// The sums from an array in [`StepSums::NAMES`] order.
    pub fn from_values(v: [f64; 11]) -> StepSums {
        let [n, x1, x2, y, x1x1, x1x2, x2x2, x1y, x2y, yy, qy] = v;
        StepSums { n, x1, x2, y, x1x1, x1x2, x2x2, x1y, x2y, yy, qy }
    }
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

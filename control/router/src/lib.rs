//! kvx-router: the KV-aware router (radix index, active-sequence tracker, selection); pure, no I/O.
//!
//! Three parts, composed by [`Router`]:
//!
//! * [`KvIndex`] — a radix tree over block hashes fed by [`kvx_proto::KvEvent`]s: which worker
//!   holds which prefix, in which storage tier. Prefix matching walks a request's local block
//!   hashes from the root and returns each worker's overlap ([`OverlapScores`]). Lost,
//!   duplicated and reordered events are detected per worker ([`ApplyResult`]) and repaired
//!   by a snapshot ([`KvIndex::resync`]).
//! * [`ActiveSequences`] — the predicted load of each worker from the requests this router sent
//!   it: unique KV blocks of running sequences (shared prefixes counted once) and prompt tokens
//!   still waiting for prefill.
//! * selection — the cost `overlap_weight · prefill_blocks + decode_blocks` per worker, argmin
//!   or softmax with a temperature, and the simple modes (round-robin, random, least-loaded).
//!
//! Nothing here does I/O, spawns threads or reads a clock: callers pass `now` and feed events.

#![forbid(unsafe_code)]

mod error;
mod fast_map;
pub mod index;
pub mod metrics;
pub mod router;
pub mod select;
mod table;
pub mod tracker;

pub use error::{ConfigError, RouteError};
pub use index::{
    ApplyResult, IndexConfig, IndexCounters, IndexStats, KvIndex, Overlap, OverlapScores,
    ResyncReport, SnapshotBlock, TIER_ORDER, TIERS, tier_index,
};
pub use metrics::{LATENCY_BOUNDS_US, LatencyHistogram, RouterMetrics};
pub use router::{
    Decision, LoadMetric, PotentialLoad, RequestBlocks, Router, RouterConfig, RoutingMode,
    TierCredits,
};
pub use select::{pick_min, pick_softmax};
pub use tracker::{ActiveSequences, TrackError, WorkerLoad};

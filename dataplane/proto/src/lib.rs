//! kvx-proto: plain data shared by every kvx crate — ids, token-block hashing, KV events, load
//! reports, workers' performance profiles, the request plane's messages, the worker planes' frame kinds and their versioned
//! wire frames. No I/O, no async.

#![forbid(unsafe_code)]

pub mod events;
pub mod hashing;
pub mod load;
pub mod plane;
pub mod profile;
pub mod request;
pub mod wire;

pub use events::{KvEvent, KvEventData, StorageTier, StoredBlock};
pub use hashing::{BlockHasher, LocalBlockHash, SequenceHash, XXH3_SEED};
pub use load::{LoadReport, StepSums, TierMetrics, WorkerMetrics};
pub use request::{
    Constraint, ErrorClass, FinishReason, Fork, GenerateRequest, KvDest, KvNote, KvRole,
    KvTransfer, Logprob, Output, OutputDelta, RequestId, SamplingOptions, StopConditions,
    TopLogprob, Usage,
};

/// A worker (one engine shard) in the cluster.
pub type WorkerId = u64;

/// A token id.
pub type TokenId = u32;

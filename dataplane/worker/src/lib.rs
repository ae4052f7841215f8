//! kvx-worker: the shard executor — one pinned OS thread per shard, each owning an engine
//! (scheduler, block pool, KV cache, kernel thread pool) and a bounded inbox. Shards of one
//! process share the read-only model weights (one mmap). [`setup`] turns one resolved
//! configuration into a process's engines; [`remote`] serves a process's shards to a
//! frontend over the TCP request and event planes; [`store`] finds and pulls model files;
//! [`profile`] measures an engine for the SLA planner.

#![forbid(unsafe_code)]

pub use kvx_engine::eval;
pub use kvx_engine::knee;

pub mod kvlink;
pub mod profile;
pub mod remote;
pub mod setup;
pub mod shard;
pub mod store;

pub use kvx_kernels::model::Arith;
pub use remote::{Hosted, RemoteConfig, RemoteError};
pub use setup::{
    EngineKind, EngineLimits, EngineSetup, MockerSetup, ModelMeta, Prepared, SetupError, Started,
    TierSetup,
};
pub use shard::{
    Command, OutputSender, ShardConfig, ShardEvent, ShardHandle, ShardStatus, SubmitError,
    output_channel, pin_current, spawn,
};

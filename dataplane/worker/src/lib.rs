//! kvx-worker: the shard executor — one pinned OS thread per shard, each owning an engine
//! (scheduler, block pool, KV cache, kernel thread pool) and a bounded inbox. Shards of one
//! process share the read-only model weights (one mmap). [`remote`] serves a process's shards
//! to a frontend over the TCP request and event planes.

#![forbid(unsafe_code)]

pub mod remote;
pub mod shard;

pub use remote::{Hosted, RemoteConfig, RemoteError};
pub use shard::{
    Command, OutputSender, ShardConfig, ShardEvent, ShardHandle, ShardStatus, SubmitError,
    pin_current, spawn,
};

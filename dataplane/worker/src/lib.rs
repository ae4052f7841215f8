//! kvx-worker: the shard executor (one pinned thread per shard composing engine, kvbm and xfer).

#![forbid(unsafe_code)]

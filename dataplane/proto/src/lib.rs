//! kvx-proto: plain data shared by every kvx crate (ids, token-block hashing, KV events, load reports, wire frames).

#![forbid(unsafe_code)]

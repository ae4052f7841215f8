//! kvx-discovery: who is alive (embedded, static file, etcd).

#![forbid(unsafe_code)]

//! kvx-router: the KV-aware router (radix index, active-sequence tracker, selection); pure, no I/O.

#![forbid(unsafe_code)]

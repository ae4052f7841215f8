//! kvx-e2e: shared helpers for end-to-end tests that run the real binary.

#![forbid(unsafe_code)]

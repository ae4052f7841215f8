//! kvx-bench: a load generator for OpenAI-compatible endpoints, and micro-benchmarks.

#![forbid(unsafe_code)]

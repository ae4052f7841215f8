//! kvx-bench: a load generator for OpenAI-compatible endpoints, and micro-benchmarks.
//!
//! Build a [`BenchConfig`] (endpoint, workload, tokenizer, load, bounds), call [`run`], and
//! render the [`Report`] (JSON schema in `bench/SCHEMA.md`): [`summary_table`] for terminals,
//! [`render_html`] for a self-contained page, [`compare_table`] for two reports side by side.
//!
//! Workloads ([`WorkloadConfig`]): synthetic lengths, shared prefixes, multi-turn sessions,
//! Mooncake trace replay, prompt files, and a mixed workload of decode streams disturbed by
//! periodic long prompts (reported per class). Load ([`LoadConfig`]): closed loop at a
//! concurrency, Poisson arrivals at a rate, or a trace's timestamps; a list of values is a
//! sweep. The mixed workload brings its own load ([`LoadConfig::Mixed`]).

#![forbid(unsafe_code)]

mod client;
mod corpus;
mod dist;
mod error;
mod metrics;
mod prompt;
pub mod report;
mod request;
mod runner;
pub mod sse;
mod tokenizer;
mod workload;

pub use client::{Client, ErrorClass, Outcome, Scratch, resolve_uris};
pub use corpus::{WORDS, corpus_text};
pub use dist::LengthDist;
pub use error::BenchError;
pub use metrics::MAX_RECORDS;
pub use prompt::{Prompt, PromptSynth};
pub use report::{
    ClassReport, Report, RequestRecord, RunReport, SCHEMA, Slo, Stats, compare_table, render_html,
    summary_table,
};
pub use request::{Api, BodyBuilder, EndpointConfig, Role};
pub use runner::{BenchConfig, LoadConfig, OutputCount, run, run_async};
pub use tokenizer::{ModelTokenizer, TokenCodec, TokenizerSpec, WordCodec};
pub use workload::{
    Conversation, Dataset, MOONCAKE_BLOCK_TOKENS, MixedSource, RequestClass, TraceEntry, Turn,
    WorkloadConfig, read_prompts, read_trace,
};

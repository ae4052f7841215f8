//! Helpers of the planes' tests: requests, mock engine shards, collecting a request's
//! outputs, and waiting for a condition.

#![allow(dead_code)]
#![allow(clippy::disallowed_methods)] // synchronous test helpers poll with sleeps

use std::time::{Duration, Instant};

use kvx_proto::{
    ErrorClass, FinishReason, GenerateRequest, KvNote, Output, RequestId, SamplingOptions,
    StopConditions,
};
use kvx_worker::{EngineSetup, Started};
use tokio::sync::mpsc::UnboundedReceiver;

/// Tokens per KV block in every test.
pub const BS: usize = 16;

/// A greedy request of `len` prompt tokens derived from `seed`, generating `max_tokens`.
pub fn request(id: u64, seed: u32, len: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(id),
        prompt: (0..len).map(|t| 1 + (t * 7 + seed) % 60).collect(),
        sampling: SamplingOptions { temperature: 0.0, ..Default::default() },
        stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
        logprobs: None,
        salt: None,
        kv: Default::default(),
        resume: Vec::new(),
        constraint: None,
        prompt_logprobs: None,
        fork: None,
    }
}

/// `n` tokenizer-free mock engines numbered from `first`; `speedup` divides the mocker's
/// step times (1.0: a decode step takes a few milliseconds).
pub fn mock_shards(n: usize, first: u64, speedup: f64) -> Started {
    let mut s = EngineSetup::tokenizer_free_mocker(n, 256, 64, 4096, speedup);
    s.first_worker_id = first;
    s.limits.block_size = BS;
    s.prepare().expect("prepare").start().expect("start")
}

/// Mock engines with these roles (in order), numbered from `first`, with a modelled KV link.
pub fn mock_roles(roles: &[kvx_proto::plane::WorkerRole], first: u64, speedup: f64) -> Started {
    let mut s = EngineSetup::tokenizer_free_mocker(roles.len(), 256, 64, 4096, speedup);
    s.first_worker_id = first;
    s.limits.block_size = BS;
    s.roles = roles.to_vec();
    s.prepare().expect("prepare").start().expect("start")
}

/// How a request ended, with the tokens it streamed.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// Finished normally.
    Finished(FinishReason),
    /// Failed.
    Error(ErrorClass, String),
    /// The channel closed with no final output.
    Closed,
    /// A prefill-only request's KV was sent.
    KvSent,
}

/// Reads a request's outputs to the end (at most `limit`): the tokens and how it ended.
pub async fn collect(rx: &mut UnboundedReceiver<Output>, limit: Duration) -> (Vec<u32>, End) {
    let mut tokens = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Err(_) => panic!("no end within {limit:?} ({} tokens so far)", tokens.len()),
            Ok(None) => return (tokens, End::Closed),
            Ok(Some(Output::Delta(d))) => tokens.extend(d.tokens),
            Ok(Some(Output::Finished { reason, .. })) => return (tokens, End::Finished(reason)),
            Ok(Some(Output::Error { class, message })) => {
                return (tokens, End::Error(class, message));
            }
            Ok(Some(Output::Kv(KvNote::Sent(_)))) => return (tokens, End::KvSent),
            Ok(Some(Output::Kv(_) | Output::PromptLogprobs { .. })) => {}
        }
    }
}

/// Blocking form of [`collect`] for tests without a runtime.
pub fn collect_blocking(rx: &mut UnboundedReceiver<Output>, limit: Duration) -> (Vec<u32>, End) {
    let mut tokens = Vec::new();
    let deadline = Instant::now() + limit;
    loop {
        assert!(Instant::now() < deadline, "no end within {limit:?}");
        match rx.try_recv() {
            Ok(Output::Delta(d)) => tokens.extend(d.tokens),
            Ok(Output::Finished { reason, .. }) => return (tokens, End::Finished(reason)),
            Ok(Output::Error { class, message }) => return (tokens, End::Error(class, message)),
            Ok(Output::Kv(KvNote::Sent(_))) => return (tokens, End::KvSent),
            Ok(Output::Kv(_) | Output::PromptLogprobs { .. }) => {}
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                return (tokens, End::Closed);
            }
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Polls `cond` until it holds (panics with `what` after ten seconds).
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Async form of [`wait_until`].
pub async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

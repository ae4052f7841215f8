//! What ingress needs from the serving side: somewhere to send a tokenized request and get
//! its outputs back. In one process this is the local shards behind the router; across
//! processes it is the request plane to remote workers. Ingress never sees engines.

use std::sync::Arc;

use kvx_proto::plane::WorkerRole;
use kvx_proto::{GenerateRequest, Output, RequestId, WorkerId, WorkerMetrics};
use kvx_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

/// Why a request could not be dispatched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// Every worker's queue is full (HTTP 429).
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// No worker can take requests (HTTP 503).
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// The served model, as ingress presents and preprocesses for it.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The name clients use (`model` field, `/v1/models`).
    pub name: String,
    /// Longest prompt + output.
    pub context_length: usize,
    /// Tokenizer and chat template.
    pub tokenizer: Arc<Tokenizer>,
    /// Unix seconds the model was loaded (reported as `created`).
    pub created: u64,
}

/// Per-worker state for `/metrics` and `/ready`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerState {
    /// Worker id.
    pub id: WorkerId,
    /// Whether it is alive.
    pub alive: bool,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
    /// Its counters and load.
    pub metrics: WorkerMetrics,
}

/// The serving side as ingress sees it.
pub trait Dispatcher: Send + Sync + 'static {
    /// Starts a request; its outputs (deltas, then `Finished` or `Error`) arrive on the
    /// returned channel. Dropping the receiver cancels the request.
    fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Output>, DispatchError>;
    /// Cancels a request (idempotent).
    fn cancel(&self, id: RequestId);
    /// Whether requests can be served now (model loaded, at least one worker up).
    fn ready(&self) -> bool;
    /// Every worker's state.
    fn workers(&self) -> Vec<WorkerState>;
    /// Router counters as (name, value) pairs for `/metrics` (e.g. decisions, hit rate).
    fn router_metrics(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

//! kvx-ingress: the OpenAI-compatible HTTP/SSE front door — preprocessing (chat templates,
//! tokenization), admission, auth, streaming, metrics, and the only place that renders
//! errors as HTTP statuses.

#![forbid(unsafe_code)]

pub mod dispatch;

pub use dispatch::{DispatchError, Dispatcher, ModelInfo, WorkerState};

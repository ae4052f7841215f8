//! kvx-ingress: the OpenAI-compatible HTTP/SSE front door — preprocessing (chat templates,
//! tokenization), admission, auth, streaming, metrics, and the only place that renders
//! errors as HTTP statuses.
//!
//! [`Server::bind`] takes a plain [`IngressConfig`], the served [`ModelInfo`] and a
//! [`Dispatcher`] (the serving side); [`Server::run`] serves until a shutdown future fires.

#![forbid(unsafe_code)]

pub mod dispatch;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod render;
pub mod server;
mod tier_metrics;

pub use dispatch::{DispatchError, Dispatcher, ModelInfo, WorkerState};
pub use error::{ApiError, IngressError};
pub use server::{IngressConfig, Server, ShutdownReport};

//! kvx-ingress: the OpenAI-compatible HTTP/SSE front door — preprocessing (chat templates,
//! tokenization), admission, auth, streaming, metrics, the live status page, and the only
//! place that renders errors as HTTP statuses.
//!
//! [`Server::bind`] takes an [`IngressConfig`] (with the API keys and the TLS certificate
//! already read), the served [`ModelInfo`] and a [`Dispatcher`] (the serving side);
//! [`Server::run`] serves until a shutdown future fires, and [`ServerHandle::reload`] re-reads
//! the keys file (models, limits and admin keys per key) and the certificate meanwhile.

#![forbid(unsafe_code)]

pub mod admission;
mod conn;
pub mod dispatch;
pub mod error;
pub mod fanout;
pub mod keys;
pub mod metrics;
pub mod openai;
pub mod relay;
pub mod render;
pub mod server;
pub mod status;
mod tier_metrics;
pub mod tls;
pub mod tools;

pub use admission::{AdmissionConfig, Refused, RunningBound};
pub use dispatch::{DispatchError, Dispatcher, ModelInfo, WorkerState};
pub use error::{ApiError, IngressError};
pub use keys::{Access, ApiKeys, Grant, Limits};
pub use server::{IngressConfig, Reloaded, Server, ServerHandle, ShutdownReport};
pub use tls::Tls;

//! kvx-planes: the serving planes — the KV-aware router joined to engine shards, as one
//! [`Dispatcher`](kvx_ingress::Dispatcher) that ingress sends tokenized requests to.
//!
//! * [`LocalPlane`]: this process's shards (`kvx serve`); their events reach the router
//!   through one feed thread.
//! * [`RemotePlane`]: shards in worker processes or on other hosts (`kvx frontend`), one
//!   TCP session per worker process ([`kvx_proto::plane`] has the messages; the worker side
//!   is [`kvx_worker::remote`]).
//! * [`feed`]: what both do with what workers report — KV events (a gap asks for a
//!   snapshot), snapshots, loads, expiry — and the router's counters for `/metrics`.
//! * [`disagg`]: disaggregated prefill and decode — the decision per request, and the relay
//!   that runs a request's prefill leg and decode leg.
//!
//! A request that has not produced a token moves when its worker refuses it or disappears;
//! one that has ends with a clear `Unavailable` error.

#![forbid(unsafe_code)]

pub mod disagg;
pub mod feed;
pub mod local;
pub mod remote;

pub use disagg::{DisaggConfig, DisaggCounters};
pub use local::LocalPlane;
pub use remote::{RemotePlane, RemotePlaneConfig};

/// Why a plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    /// The router refused its configuration.
    #[error("router configuration: {0}")]
    Router(#[from] kvx_router::ConfigError),
    /// The KV transfer link refused the plane's peers.
    #[error("KV transfer link: {0}")]
    Kv(String),
    /// A plane thread could not start.
    #[error("starting the {what} thread: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

//! Typed errors of the router.

use kvx_proto::{RequestId, WorkerId};
use thiserror::Error;

/// A configuration the router cannot work with.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    /// `block_size` is zero.
    #[error("block size must be at least 1")]
    BlockSize,
    /// A weight, credit or temperature is negative, not finite, or out of its range.
    #[error("{name} must be finite and within [{min}, {max}], got {value}")]
    OutOfRange {
        /// The field.
        name: &'static str,
        /// Its value.
        value: f64,
        /// Smallest allowed.
        min: f64,
        /// Largest allowed.
        max: f64,
    },
}

/// Why a request could not be routed or tracked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RouteError {
    /// No worker is registered.
    #[error("no worker available")]
    NoWorkers,
    /// The worker is not registered with this router.
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerId),
    /// The request is already tracked.
    #[error("request {0} is already tracked")]
    DuplicateRequest(RequestId),
    /// The tracker holds its maximum number of requests.
    #[error("too many requests in flight (limit {limit})")]
    TooManyRequests {
        /// The limit.
        limit: usize,
    },
}

//! kvx-engine: the serving engine (sans-IO scheduler, block pool and prefix cache, sampler,
//! model runner).

#![forbid(unsafe_code)]

pub mod generate;
pub mod sampler;

use kvx_kernels::model::ModelError;

/// Errors of the engine, classified for the request path.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as asked (bad parameters, too long).
    #[error("{0}")]
    BadRequest(String),
    /// The model failed to load or to run a step.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A bug or resource failure inside the engine.
    #[error("internal error: {0}")]
    Internal(String),
}

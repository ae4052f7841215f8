//! kvx-engine: the serving engine (sans-IO scheduler, block pool and prefix cache, sampler,
//! output processing, model runner).

#![forbid(unsafe_code)]

pub mod block_pool;
pub mod constraint;
pub mod engine;
pub mod eval;
pub mod knee;
pub mod mocker;
pub mod output;
pub mod reference;
pub mod sampler;
pub mod scheduler;

use kvx_kernels::model::ModelError;
use kvx_proto::ErrorClass;

pub use engine::{
    Admission, Backend, Engine, EngineConfig, EngineStats, ModelBackend, PromptScore, SeqEvent,
    StepOutput,
};
pub use reference::ReferenceBackend;
pub use scheduler::LowerTiers;

/// Errors of the engine, classified for the request path.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as asked (bad parameters, too long).
    #[error("{0}")]
    BadRequest(String),
    /// Queues are full.
    #[error("{0}")]
    Overloaded(String),
    /// The model failed to load or to run a step.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A bug or resource failure inside the engine.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    /// The request-plane error class.
    pub fn class(&self) -> ErrorClass {
        match self {
            EngineError::BadRequest(_) => ErrorClass::BadRequest,
            EngineError::Overloaded(_) => ErrorClass::Overloaded,
            EngineError::Model(_) | EngineError::Internal(_) => ErrorClass::Internal,
        }
    }
}

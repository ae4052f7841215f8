//! The llama-family model: configuration from GGUF metadata, weights borrowed from the
//! memory-mapped file, a paged f16 KV cache, and the batched forward pass.

mod config;
mod forward;
mod kv;
mod weights;

pub use config::{LlamaConfig, RopeKind};
pub use forward::{Logits, Scratch, SeqChunk};
pub use kv::{KvCache, KvLayout, KvMemory};
pub use weights::{LayerWeights, LlamaModel, MatRef};

pub use crate::ops::AttnMode;

use crate::KernelError;

/// Errors from loading a model or running a step.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be read or queried.
    #[error(transparent)]
    Gguf(#[from] kvx_gguf::GgufError),
    /// A feature of the model that kvx does not implement.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Inconsistent hyper-parameters or tensor shapes.
    #[error("invalid model: {0}")]
    Config(String),
    /// A tensor the architecture needs is absent.
    #[error("invalid model: tensor {0} is missing")]
    MissingTensor(String),
    /// A step the engine asked for that does not fit the model or buffers.
    #[error("bad batch: {0}")]
    Batch(String),
    /// A kernel refused its operands.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

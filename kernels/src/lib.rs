//! kvx-kernels: numbers only (quantized formats, CPU kernels, the llama-family forward pass);
//! no I/O, no async.
//!
//! * [`quant`], [`quant_k`]: ggml block layouts and their scalar codecs.
//! * [`cpu`]: the kernel table for the CPU's best instruction set, chosen once at run time,
//!   with [`cpu::reference`] as the scalar twin of every fast kernel.
//! * [`ops`]: matrix products, rope and paged attention built on the table.
//! * [`greedy`]: greedy output heads screened by fast products, settled by exact ones.
//! * [`par`]: the fork-join pool that runs an op on a shard's threads.
//! * [`model`]: the llama-family forward pass over a batch and a paged KV cache.

pub mod cpu;
pub mod greedy;
pub mod model;
pub mod ops;
pub mod par;
pub mod quant;
pub mod quant_k;

pub use kvx_gguf as gguf;

/// Errors from kernels and model loading.
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A tensor type without kernels here.
    #[error("tensor type {0} is not supported by kvx kernels")]
    UnsupportedType(gguf::GgmlType),
    /// Operands whose sizes do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(&'static str),
    /// A codec error.
    #[error(transparent)]
    Quant(#[from] quant::QuantError),
}

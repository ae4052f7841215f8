//! The llama-family model: configuration from GGUF metadata, weights borrowed from the
//! memory-mapped file, a paged f16 KV cache, and the batched forward pass; and the reference
//! arithmetic (f32 weights and activations, f64 sums, an f32 cache) that the others are
//! measured against.

mod config;
mod forward;
mod kv;
mod reference;
mod weights;

pub use config::{LlamaConfig, RopeKind};
pub use forward::{Logits, Scratch, SeqChunk};
pub use kv::{KvCache, KvLayout, KvMemory};
pub use reference::{RefKv, RefRounding, RefRoundingError, RefScratch, RoundTo};
pub use weights::{LayerWeights, LlamaModel, MatRef};

pub use crate::ops::AttnMode;

use crate::KernelError;
use crate::cpu::lanes::LaneMath;

/// The arithmetic a model engine computes in. The discriminants are part of the KV cache's
/// fingerprint (blocks kept on disk across restarts): never renumber them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Arith {
    /// ggml's association everywhere (activations quantized per weight type, f16 cache,
    /// f16-rounded queries and attention probabilities): llama.cpp's logits bit for bit.
    #[default]
    Exact = 0,
    /// The quantized products rounded once per block and row ([`LaneMath::Fast`]) where the
    /// CPU has row-lane kernels, and attention in f32 queries and probabilities
    /// ([`crate::ops::attention_group`]) where it has a kernel for it; otherwise as
    /// `Exact`.
    Fast = 1,
    /// As `Fast`, with the K and V products' input quantized in two parts in the first half
    /// of the layers ([`LlamaModel::splits_kv`]): those products (6 % of a layer's
    /// multiply-adds) cost twice there, and the quantization of their input — most of what
    /// the Q/K/V products' input adds to `Exact`'s distance to `Reference` — nearly leaves
    /// it. This arithmetic once split the Q/K/V products of every layer (16 % more
    /// multiply-adds; 29 % nearer the reference than `Exact`), then the K/V products of
    /// every layer (6 %; 23 % nearer); half the layers (3 %) keep it nearer than `Exact`:
    /// kernels/PERF.md. [`Arith::label`], which the KV fingerprint takes in too, tells the
    /// three apart: the Q/K/V split cached other rows than the K/V one in every layer past
    /// the first, and the first-half split caches other rows than the every-layer one from
    /// the middle layer on.
    Split = 3,
    /// The model's own math on its quantized weights ([`LlamaModel::forward_reference`]):
    /// the base the others are measured against; slow.
    Reference = 2,
}

impl Arith {
    /// The name in labels that tell engines' bits apart across builds (the fleet's arithmetic
    /// label, the model label of discovery and profiles): [`Arith::name`], but
    /// `split-kv-half` for `Split`, whose split moved from every layer's Q/K/V products
    /// (`split`) to every layer's K/V ones (`split-kv`) and then to the first half of the
    /// layers' (an engine of an earlier build computes other rows under the same name).
    pub fn label(self) -> &'static str {
        match self {
            Arith::Split => "split-kv-half",
            other => other.name(),
        }
    }

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Arith::Exact => "exact",
            Arith::Fast => "fast",
            Arith::Split => "split",
            Arith::Reference => "reference",
        }
    }

    /// Every arithmetic.
    pub const ALL: [Arith; 4] = [Arith::Exact, Arith::Fast, Arith::Split, Arith::Reference];

    /// The arithmetic of `name` ([`Arith::name`]).
    pub fn from_name(name: &str) -> Option<Arith> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The row-lane products the weights are repacked for (`None`: the reference
    /// arithmetic reads the weights as the file holds them).
    pub fn lane_math(self) -> Option<LaneMath> {
        match self {
            Arith::Exact => Some(LaneMath::Exact),
            Arith::Fast | Arith::Split => Some(LaneMath::Fast),
            Arith::Reference => None,
        }
    }

    /// Whether the K and V products of the first half of the layers take their input in two
    /// parts ([`LlamaModel::split_kv`], [`LlamaModel::splits_kv`]).
    pub fn split_kv(self) -> bool {
        self == Arith::Split
    }

    /// Whether attention runs in the free association ([`LlamaModel::free_attention`]).
    pub fn free_attention(self) -> bool {
        matches!(self, Arith::Fast | Arith::Split)
    }
}

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

#[cfg(test)]
mod tests {
    use super::Arith;

    #[test]
    fn arithmetic_names_round_trip() {
        for a in Arith::ALL {
            assert_eq!(Arith::from_name(a.name()), Some(a));
        }
        assert_eq!(Arith::from_name("fast-math"), None);
    }

    #[test]
    fn labels_are_distinct_and_tell_the_split_from_the_earlier_ones() {
        let labels = Arith::ALL.map(Arith::label);
        for (i, l) in labels.iter().enumerate() {
            assert!(!labels[..i].contains(l), "{l}");
        }
        // Earlier builds labelled their Q/K/V split `split` and their every-layer K/V split
        // `split-kv`: neither label may match.
        assert_eq!(Arith::Split.label(), "split-kv-half");
        assert!(Arith::ALL.iter().all(|a| a.label() != "split" && a.label() != "split-kv"));
    }
}

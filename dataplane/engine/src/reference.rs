//! [`ReferenceBackend`]: the model in the reference arithmetic (f32 weights and activations,
//! f64 sums, an f32 KV cache) behind the engine's [`Backend`] trait, so an engine — and
//! `kvx eval` — runs it as it runs the fast kernels.

use std::sync::Arc;

use kvx_kernels::model::{LlamaModel, RefKv, RefRounding, RefScratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

use crate::{Backend, EngineError};

/// The real model in the reference arithmetic.
pub struct ReferenceBackend {
    model: Arc<LlamaModel>,
    pool: ThreadPool,
    kv: RefKv,
    scratch: RefScratch,
    round: RefRounding,
}

impl std::fmt::Debug for ReferenceBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceBackend")
            .field("kv", &self.kv)
            .field("threads", &self.pool.n_threads())
            .field("round", &self.round)
            .finish()
    }
}

impl ReferenceBackend {
    /// A backend with `n_blocks` KV blocks of `block_size` tokens, steps of up to
    /// `max_tokens` tokens, contexts up to `max_ctx`, on `pool`.
    pub fn new(
        model: Arc<LlamaModel>,
        pool: ThreadPool,
        n_blocks: usize,
        block_size: usize,
        max_tokens: usize,
        max_ctx: usize,
    ) -> Result<Self, EngineError> {
        let kv = RefKv::new(&model.cfg, n_blocks, block_size)?;
        let scratch = RefScratch::new(&model, max_tokens, max_ctx, pool.max_threads());
        Ok(ReferenceBackend { model, pool, kv, scratch, round: RefRounding::default() })
    }

    /// The same backend with `round`'s roundings added to the reference arithmetic (what a
    /// would-be arithmetic's number formats alone cost; `kvx eval perplexity
    /// --reference-rounding`).
    pub fn with_rounding(mut self, round: RefRounding) -> Self {
        self.round = round;
        self
    }
}

impl Backend for ReferenceBackend {
    fn forward(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), EngineError> {
        let Self { model, pool, kv, scratch, round } = self;
        pool.borrowing(|| model.forward_reference(pool, chunks, kv, scratch, *round, logits))?;
        Ok(())
    }

    fn n_vocab(&self) -> usize {
        self.model.cfg.n_vocab
    }

    fn n_blocks(&self) -> usize {
        self.kv.n_blocks()
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), EngineError> {
        Ok(self.kv.copy_block(src as usize, dst as usize)?)
    }

    fn pool(&self) -> Option<&ThreadPool> {
        Some(&self.pool)
    }
}

//! Single-sequence generation: one prompt, prefilled then decoded token by token on the
//! calling thread's kernel pool. The batched engine builds on the same model calls; this
//! path serves `kvx generate` for one prompt and is the reference the batched engine is
//! compared against.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_kernels::cpu::Kernels;
use kvx_kernels::model::{AttnMode, KvCache, LlamaModel, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;

use crate::EngineError;
use crate::sampler::{Sampler, SamplerState, SamplingParams};

/// Tokens llama.cpp evaluates per prompt batch (llama-cpp-python's default `n_batch`).
pub const PROMPT_BATCH: usize = 512;

/// The attention arithmetic of prompt token `i` of a `len`-token prompt: llama.cpp runs the
/// prompt in batches of [`PROMPT_BATCH`] and a batch of one token takes the single-token path.
pub fn prompt_mode(len: usize, i: usize) -> AttnMode {
    let batch_start = i - i % PROMPT_BATCH;
    let batch_len = (len - batch_start).min(PROMPT_BATCH);
    if batch_len >= 2 { AttnMode::Prefill } else { AttnMode::Decode }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token was sampled (it is included in the output).
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The callback asked to stop.
    Cancelled,
}

/// The outcome of [`Generator::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// Time to evaluate the prompt and sample the first token.
    pub prefill: Duration,
    /// Time for the remaining tokens.
    pub decode: Duration,
}

/// Runs one sequence at a time over a KV cache sized for `max_ctx` positions.
#[derive(Debug)]
pub struct Generator {
    model: Arc<LlamaModel>,
    kernels: &'static Kernels,
    pool: ThreadPool,
    kv: KvCache,
    scratch: Scratch,
    logits: Vec<f32>,
    sampler: Sampler,
    table: Vec<u32>,
    max_ctx: usize,
}

const BLOCK: usize = 16;

impl Generator {
    /// A generator for contexts of up to `max_ctx` positions on `n_threads` threads.
    pub fn new(
        model: Arc<LlamaModel>,
        kernels: &'static Kernels,
        n_threads: usize,
        max_ctx: usize,
    ) -> Result<Self, EngineError> {
        let max_ctx = max_ctx.clamp(1, model.cfg.context_length.max(1));
        let n_blocks = max_ctx.div_ceil(BLOCK);
        let kv = KvCache::new(&model.cfg, n_blocks, BLOCK)?;
        let pool = ThreadPool::new(n_threads)
            .map_err(|e| EngineError::Internal(format!("thread pool: {e}")))?;
        let scratch = Scratch::new(&model, PROMPT_BATCH, n_blocks * BLOCK, pool.n_threads());
        let n_vocab = model.cfg.n_vocab;
        Ok(Generator {
            kernels,
            pool,
            kv,
            scratch,
            logits: vec![0.0; n_vocab],
            sampler: Sampler::new(n_vocab),
            table: (0..n_blocks as u32).collect(),
            max_ctx: n_blocks * BLOCK,
            model,
        })
    }

    /// The longest prompt + output this generator holds.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Generates up to `max_tokens` tokens after `prompt`. `is_eog` marks end-of-generation
    /// tokens; `on_token` sees each token as it is sampled and may stop generation.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &SamplingParams,
        max_tokens: usize,
        is_eog: impl Fn(u32) -> bool,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        params.validate().map_err(EngineError::BadRequest)?;
        if prompt.is_empty() {
            return Err(EngineError::BadRequest("the prompt has no tokens".into()));
        }
        if prompt.len() + max_tokens > self.max_ctx {
            return Err(EngineError::BadRequest(format!(
                "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context of {} tokens",
                prompt.len(),
                self.max_ctx
            )));
        }
        let start = Instant::now();
        let mut state = SamplerState::new(params, rand::random());
        let mut pos = 0;
        // Prefill in llama.cpp-sized batches; a batch's mode is that of its tokens.
        while pos < prompt.len() {
            let end = (pos + PROMPT_BATCH).min(prompt.len());
            let chunk = SeqChunk {
                tokens: &prompt[pos..end],
                start_pos: pos,
                block_table: &self.table,
                logits: end == prompt.len(),
                mode: prompt_mode(prompt.len(), pos),
            };
            self.model.forward(
                self.kernels,
                &self.pool,
                &[chunk],
                &mut self.kv,
                &mut self.scratch,
                &mut self.logits,
            )?;
            pos = end;
        }
        let mut out = Vec::with_capacity(max_tokens);
        let mut first = None;
        let mut finish = Finish::Length;
        while out.len() < max_tokens {
            self.sampler.apply_penalties(params, &mut self.logits, prompt, &out);
            let tok = self.sampler.sample(params, &mut state, &self.logits).token;
            out.push(tok);
            first.get_or_insert_with(Instant::now);
            if on_token(tok).is_break() {
                finish = Finish::Cancelled;
                break;
            }
            if is_eog(tok) {
                finish = Finish::Stop;
                break;
            }
            if out.len() == max_tokens {
                break;
            }
            let chunk = SeqChunk {
                tokens: std::slice::from_ref(&tok),
                start_pos: pos,
                block_table: &self.table,
                logits: true,
                mode: AttnMode::Decode,
            };
            self.model.forward(
                self.kernels,
                &self.pool,
                &[chunk],
                &mut self.kv,
                &mut self.scratch,
                &mut self.logits,
            )?;
            pos += 1;
        }
        let first = first.unwrap_or_else(Instant::now);
        Ok(Generation { tokens: out, finish, prefill: first - start, decode: first.elapsed() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_modes_follow_llama_cpp_batches() {
        assert_eq!(prompt_mode(1, 0), AttnMode::Decode);
        assert_eq!(prompt_mode(2, 0), AttnMode::Prefill);
        assert_eq!(prompt_mode(2, 1), AttnMode::Prefill);
        assert_eq!(prompt_mode(513, 511), AttnMode::Prefill);
        assert_eq!(prompt_mode(513, 512), AttnMode::Decode);
        assert_eq!(prompt_mode(514, 513), AttnMode::Prefill);
    }
}

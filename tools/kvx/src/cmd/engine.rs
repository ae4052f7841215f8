//! Engine flags shared by the commands that run the model (`generate`, `serve`, `worker`),
//! and the one place that turns them into a model, tokenizer and engine.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use clap::builder::FalseyValueParser;
use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Engine, EngineConfig, EngineError, ModelBackend};
use kvx_kernels::cpu::Kernels;
use kvx_kernels::cpu::lanes::LaneMath;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{KvCache, LlamaModel};
use kvx_kernels::par::ThreadPool;
use kvx_tokenizer::Tokenizer;

use super::Runtime;

#[derive(Debug, Clone, Args)]
pub(crate) struct EngineOpts {
    /// Model: a catalogue name or a path to a GGUF file (default model when absent).
    #[arg(long, env = "KVX_MODEL")]
    pub(crate) model: Option<String>,
    /// Kernel threads per engine (default: all cores for one engine).
    #[arg(long, env = "KVX_THREADS")]
    pub(crate) threads: Option<usize>,
    /// KV cache memory per engine, in bytes (default: a quarter of RAM, at most 4 GiB,
    /// shared between engines).
    #[arg(long, env = "KVX_KV_CACHE_BYTES")]
    pub(crate) kv_cache_bytes: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, env = "KVX_BLOCK_SIZE", default_value_t = 16)]
    pub(crate) block_size: usize,
    /// Sequences per step at most.
    #[arg(long, env = "KVX_MAX_NUM_SEQS", default_value_t = 64)]
    pub(crate) max_num_seqs: usize,
    /// Tokens per step at most (prefill chunks and decode tokens together).
    #[arg(long, env = "KVX_MAX_BATCHED_TOKENS", default_value_t = 512)]
    pub(crate) max_batched_tokens: usize,
    /// Requests waiting for admission at most (more are refused).
    #[arg(long, env = "KVX_MAX_WAITING", default_value_t = 1024)]
    pub(crate) max_waiting: usize,
    /// Compute whole prompts in one step instead of chunking them.
    #[arg(long, env = "KVX_NO_CHUNKED_PREFILL", value_parser = FalseyValueParser::new())]
    pub(crate) no_chunked_prefill: bool,
    /// Do not reuse KV blocks across requests.
    #[arg(long, env = "KVX_NO_PREFIX_CACHING", value_parser = FalseyValueParser::new())]
    pub(crate) no_prefix_caching: bool,
    /// Compute quantized matrix products with one rounding per block and row instead of
    /// ggml's association: about twice the arithmetic rate on AVX-512, but logits then
    /// differ from llama.cpp's in rounding, which a quantized model amplifies, so greedy
    /// tokens can diverge from llama.cpp's.
    #[arg(long, env = "KVX_FAST_MATH", value_parser = FalseyValueParser::new())]
    pub(crate) fast_math: bool,
}

/// A loaded model with its tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    #[allow(dead_code)]
    pub(crate) path: PathBuf,
    pub(crate) model: Arc<LlamaModel>,
    pub(crate) tokenizer: Arc<Tokenizer>,
}

impl EngineOpts {
    /// Resolves and loads the model (pulling the default one on first use).
    pub(crate) fn load(&self, rt: &Runtime) -> Result<Loaded> {
        let path = rt.store.resolve(self.model.as_deref())?;
        let tokenizer = Tokenizer::from_gguf_path(&path)
            .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
        let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let mut model = LlamaModel::load(Arc::new(file))
            .with_context(|| format!("loading {}", path.display()))?;
        let math = if self.fast_math { LaneMath::Fast } else { LaneMath::Exact };
        let bytes = model
            .repack(rt.kernels()?, math)
            .with_context(|| format!("repacking {}", path.display()))?;
        tracing::debug!(bytes, ?math, "weights repacked into row-lane tiles");
        Ok(Loaded { path, model: Arc::new(model), tokenizer: Arc::new(tokenizer) })
    }

    /// KV blocks for one of `engines` engines.
    pub(crate) fn kv_blocks(&self, model: &LlamaModel, engines: usize) -> usize {
        let bytes =
            self.kv_cache_bytes.unwrap_or_else(|| default_kv_bytes() / engines.max(1) as u64);
        let max_useful =
            model.cfg.context_length.max(1).div_ceil(self.block_size) * self.max_num_seqs.max(1);
        KvCache::blocks_for_budget(&model.cfg, self.block_size, bytes).clamp(1, max_useful.max(1))
    }

    /// The scheduler limits.
    pub(crate) fn sched(&self, model: &LlamaModel) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size.max(1),
            max_num_seqs: self.max_num_seqs.max(1),
            max_batched_tokens: self.max_batched_tokens.max(1),
            max_waiting: self.max_waiting,
            chunked_prefill: !self.no_chunked_prefill,
            max_model_len: model.cfg.context_length,
            prefix_caching: !self.no_prefix_caching,
        }
    }

    /// An engine over the model on its own kernel pool.
    pub(crate) fn engine(
        &self,
        loaded: &Loaded,
        kernels: &'static Kernels,
        pool: ThreadPool,
        engines: usize,
        worker_id: u64,
    ) -> Result<Engine> {
        let sched = self.sched(&loaded.model);
        let blocks = self.kv_blocks(&loaded.model, engines);
        let max_ctx = sched.max_model_len.min(blocks * sched.block_size);
        let backend = ModelBackend::new(
            loaded.model.clone(),
            kernels,
            pool,
            blocks,
            sched.block_size,
            sched.max_batched_tokens,
            max_ctx,
        )?;
        Ok(Engine::new(
            EngineConfig { sched, worker_id },
            Box::new(backend),
            Some(loaded.tokenizer.clone()),
        ))
    }
}

impl EngineOpts {
    /// The constructor of one shard's engine, run on the shard's own thread: a kernel pool of
    /// `threads` threads (pinned to `cores`, thread `i` to `cores[i]`, unless `cores` is empty)
    /// and the engine over it.
    pub(crate) fn shard_engine(
        &self,
        loaded: &Loaded,
        kernels: &'static Kernels,
        threads: usize,
        cores: Vec<usize>,
        engines: usize,
        worker_id: u64,
    ) -> impl FnOnce() -> Result<Engine, EngineError> + Send + 'static {
        let (opts, loaded) = (self.clone(), loaded.clone());
        move || {
            let internal = |e: anyhow::Error| EngineError::Internal(format!("{e:#}"));
            let pool = if cores.is_empty() {
                ThreadPool::new(threads).context("starting kernel threads")
            } else {
                pinned_pool(threads, cores)
            }
            .map_err(internal)?;
            opts.engine(&loaded, kernels, pool, engines, worker_id).map_err(internal)
        }
    }
}

fn default_kv_bytes() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        })
        .map_or(8 << 30, |kb| kb * 1024);
    (total / 4).min(4 << 30)
}

/// Threads for each of `engines` engines on `cores` cores.
pub(crate) fn threads_per_engine(opts: &EngineOpts, cores: usize, engines: usize) -> usize {
    opts.threads.unwrap_or((cores / engines.max(1)).max(1))
}

/// Builds a kernel pool whose threads are pinned to `cores` (thread `i` to `cores[i]`).
pub(crate) fn pinned_pool(n: usize, cores: Vec<usize>) -> Result<ThreadPool> {
    ThreadPool::with_start_hook(n, move |i| {
        if let Some(&c) = cores.get(i) {
            kvx_worker::pin_current(c);
        }
    })
    .context("starting kernel threads")
}

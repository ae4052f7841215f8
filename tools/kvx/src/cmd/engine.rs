//! Engine flags shared by the commands that run engines (`generate`, `serve`, `worker`,
//! `bench engine`), turned into the one resolved [`EngineSetup`] they all use.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use clap::builder::FalseyValueParser;
use kvx_worker::{Arith, EngineKind, EngineLimits, EngineSetup, TierSetup};

use super::Runtime;

/// `--arith`: `auto` (`None`: the model's preferred arithmetic on this CPU) or an
/// arithmetic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ArithArg(Option<Arith>);

fn parse_arith(s: &str) -> Result<ArithArg, String> {
    if s == "auto" {
        return Ok(ArithArg(None));
    }
    Arith::from_name(s)
        .map(|a| ArithArg(Some(a)))
        .ok_or_else(|| format!("{s:?} is not one of auto, exact, fast, split, reference"))
}

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
    /// The arithmetic: `auto` (the fastest one no farther from the model's own math than
    /// `exact`, on this CPU and model: `split` where the CPU's `fast` products pay for its
    /// doubled K/V products in half the layers, else `exact`; kernels/PERF.md), `exact`
    /// (ggml's association: llama.cpp's logits bit for bit), `fast`
    /// (quantized products rounded once per block and row, attention in f32 queries and
    /// probabilities: faster where the multiply pipes bind; as near the reference as
    /// `exact`), `split` (`fast` with the K/V products' input quantized in two parts in the
    /// first half of the layers: nearer the reference than `exact`) or `reference` (the
    /// model's own math on its quantized weights: f32 activations and cache, f64 sums; slow,
    /// the base that `kvx eval perplexity --kl-divergence` measures the others against).
    #[arg(long, env = "KVX_ARITH", value_parser = parse_arith, default_value = "auto")]
    pub(crate) arith: ArithArg,
    /// `--arith exact`, over any `--arith` or `KVX_ARITH`: llama.cpp's tokens, for parity work
    /// (a flag of the command line only: a service sets `KVX_ARITH=exact`).
    #[arg(long)]
    pub(crate) exact: bool,
    /// `--arith fast`, over any `--arith` or `KVX_ARITH`.
    #[arg(long, env = "KVX_FAST_MATH", value_parser = FalseyValueParser::new())]
    pub(crate) fast_math: bool,
    /// Host memory per engine for KV blocks below its pool (tier G2), in bytes: every block
    /// the pool registers is copied there, and a prompt found there is loaded, not computed.
    #[arg(long, env = "KVX_KV_HOST_BYTES")]
    pub(crate) kv_host_bytes: Option<u64>,
    /// A directory for the disk tier (G3, kept across restarts; with `--kv-host-bytes`, or
    /// 64 MiB of host memory to load through).
    #[arg(long, env = "KVX_KV_DISK")]
    pub(crate) kv_disk: Option<PathBuf>,
    /// Bytes of the disk tier per engine.
    #[arg(long, env = "KVX_KV_DISK_BYTES", default_value_t = 16 << 30)]
    pub(crate) kv_disk_bytes: u64,
    /// Reuses a block needs before it is written to disk (0: every block).
    #[arg(long, env = "KVX_KV_DISK_MIN_HITS", default_value_t = 0)]
    pub(crate) kv_disk_min_hits: u32,
}

impl EngineOpts {
    /// The resolved setup of `kind` engines (the model file resolved, and pulled on first
    /// use, unless a tokenizer-free mocker is asked for with `model_needed` false).
    pub(crate) fn setup(
        &self,
        rt: &Runtime,
        kind: EngineKind,
        model_needed: bool,
    ) -> Result<EngineSetup> {
        let model =
            if model_needed { Some(rt.store.resolve(self.model.as_deref())?) } else { None };
        let mut s = EngineSetup::new(kind, model, rt.kernels()?);
        s.arith = match (self.exact, self.fast_math) {
            (true, true) => bail!("--exact and --fast-math ask for two arithmetics: give one"),
            (true, _) => Some(Arith::Exact),
            (_, true) => Some(Arith::Fast),
            _ => self.arith.0,
        };
        s.kv_cache_bytes = self.kv_cache_bytes;
        s.limits = EngineLimits {
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_waiting: self.max_waiting,
            chunked_prefill: !self.no_chunked_prefill,
            prefix_caching: !self.no_prefix_caching,
        };
        s.tiers = (self.kv_host_bytes.is_some() || self.kv_disk.is_some()).then(|| TierSetup {
            host_bytes: self.kv_host_bytes.unwrap_or(64 << 20),
            disk: self.kv_disk.clone().map(|d| (d, self.kv_disk_bytes)),
            disk_min_hits: self.kv_disk_min_hits,
        });
        // One engine on the command line gets every core unless told otherwise.
        s.threads_per_engine = self.threads.unwrap_or(rt.cores).max(1);
        Ok(s)
    }
}

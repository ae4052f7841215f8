//! One resolved configuration of a process's engines, and the one place that turns it into
//! engines: model and tokenizer loading, KV sizing, scheduler limits, shard threads and their
//! cores. `kvx serve`, `kvx worker`, `kvx generate` and `kvx bench engine` fill an
//! [`EngineSetup`] from their flags and call [`EngineSetup::prepare`]; `kvx frontend`
//! reads only [`ModelMeta`].
//!
//! Every value has one type from the flag to its use: the KV block size is a `usize` in the
//! flag, here, in the scheduler, in the router and on the request plane's `Register`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Duration;

use kvx_engine::mocker::{MockBackend, MockConfig};
use kvx_engine::scheduler::SchedulerConfig;
use kvx_engine::{Backend, Engine, EngineConfig, EngineError, ModelBackend, ReferenceBackend};
use kvx_kernels::cpu::Kernels;
use kvx_kernels::gguf::GgufFile;
use kvx_kernels::model::{
    Arith, KvCache, KvLayout, KvMemory, LlamaConfig, LlamaModel, RefRounding,
};
use kvx_kernels::par::{CoreLease, ThreadPool};
use kvx_proto::WorkerId;
use kvx_proto::plane::WorkerRole;
use kvx_tokenizer::Tokenizer;

use crate::kvlink::{KvLink, KvLinkConfig};
use crate::remote::Hosted;
use crate::shard::{self, ShardConfig, ShardEvent};
use kvx_kvbm::{DiskConfig, PoolLayout, TierConfig, Tiers};

/// Shard events of a process queued at most (a full queue drops KV events; the router sees
/// the id gap and asks for a snapshot).
pub const EVENT_QUEUE: usize = 1 << 16;

/// Other shards' cores a shard's kernel pool may borrow at most ([`EngineSetup::lend_cores`]):
/// a guest thread each, parked while its core is not lent. A lone stream's decode reads the
/// weights once per token from memory the cores share, so more cores give it less and less
/// (measured here on two cores only: kernels/PERF.md).
pub const LEND_GUESTS: usize = 3;

/// What computes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// The model on kvx's CPU kernels.
    Model,
    /// The mocker: the real scheduler and KV blocks with a timing model instead of kernels.
    Mocker,
}

impl EngineKind {
    /// The name printed in banners.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Model => "model",
            EngineKind::Mocker => "mocker",
        }
    }
}

/// Scheduler limits of every engine (the model's context length joins them at
/// [`EngineSetup::prepare`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Sequences per step at most.
    pub max_num_seqs: usize,
    /// Tokens per step at most (prefill chunks and decode tokens together).
    pub max_batched_tokens: usize,
    /// Requests waiting for admission at most.
    pub max_waiting: usize,
    /// Split long prompts across steps.
    pub chunked_prefill: bool,
    /// Reuse KV blocks across requests.
    pub prefix_caching: bool,
}

impl Default for EngineLimits {
    fn default() -> Self {
        let s = SchedulerConfig::default();
        EngineLimits {
            block_size: s.block_size,
            max_num_seqs: s.max_num_seqs,
            max_batched_tokens: s.max_batched_tokens,
            max_waiting: s.max_waiting,
            chunked_prefill: s.chunked_prefill,
            prefix_caching: s.prefix_caching,
        }
    }
}

impl EngineLimits {
    fn sched(&self, max_model_len: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_waiting: self.max_waiting,
            chunked_prefill: self.chunked_prefill,
            max_model_len,
            prefix_caching: self.prefix_caching,
        }
    }
}

/// Settings of mock engines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockerSetup {
    /// Simulated step times are divided by this.
    pub speedup: f64,
    /// KV blocks per engine (default: what the KV budget gives the model's shape).
    pub blocks: Option<usize>,
    /// Generated token ids are drawn below this (default: the model's whole vocabulary).
    pub vocab: Option<usize>,
    /// Longest prompt + output (default: the model's context length).
    pub max_model_len: Option<usize>,
}

impl Default for MockerSetup {
    fn default() -> Self {
        MockerSetup { speedup: 1.0, blocks: None, vocab: None, max_model_len: None }
    }
}

/// KV tiers below each model engine's pool (`kvx_kvbm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierSetup {
    /// Host memory per engine, in bytes.
    pub host_bytes: u64,
    /// The disk tier: a directory (each engine its own file, `w<worker id>.blocks`) and
    /// bytes per engine.
    pub disk: Option<(PathBuf, u64)>,
    /// Reuses a block needs before it is written to disk (0: every block).
    pub disk_min_hits: u32,
}

/// The resolved configuration of a process's engines.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    /// What computes tokens.
    pub kind: EngineKind,
    /// The GGUF file: the weights of model engines; the tokenizer and metadata of mock
    /// engines (`None`: tokenizer-free mock engines, whose sizes must all be given).
    pub model: Option<PathBuf>,
    /// The kernel table (the `--simd` choice or the best level).
    pub kernels: &'static Kernels,
    /// The arithmetic model engines compute in; `None`: the model's preferred one on these
    /// kernels ([`LlamaModel::preferred_arith`]), chosen once the model is loaded — the
    /// [`Prepared`] setup holds the choice.
    pub arith: Option<Arith>,
    /// Scheduler limits.
    pub limits: EngineLimits,
    /// KV cache bytes per engine (default: a quarter of RAM, at most 4 GiB, split between
    /// the engines; 1 GiB split between them for mock engines).
    pub kv_cache_bytes: Option<u64>,
    /// Engines (shards) in this process.
    pub engines: usize,
    /// Kernel threads per engine.
    pub threads_per_engine: usize,
    /// Worker id of the first engine; the others follow.
    pub first_worker_id: WorkerId,
    /// Pin each shard thread (and its kernel threads) to cores of its own, when there are
    /// enough for all of them.
    pub pin: bool,
    /// With pinned model shards: a shard with nothing to do lends its core to the others'
    /// steps (each shard's kernel pool holds a guest thread on up to [`LEND_GUESTS`] other
    /// shards' cores; `kvx_kernels::par`), so a lone request runs on the idle cores too.
    pub lend_cores: bool,
    /// Commands queued per shard at most.
    pub inbox_capacity: usize,
    /// Mock engines' settings.
    pub mocker: MockerSetup,
    /// Each engine's part in disaggregated serving, in order (missing ones: aggregated).
    pub roles: Vec<WorkerRole>,
    /// The KV transfer link of prefill and decode engines.
    pub kv_link: KvLinkConfig,
    /// KV tiers below each engine's pool (model engines only).
    pub tiers: Option<TierSetup>,
    /// Make each model engine's KV cache resident at start (servers: memory flat from the
    /// start, no page faults in steps) instead of as blocks are first used (tools, tests).
    pub prefault_kv: bool,
    /// Roundings added to the reference arithmetic (only with `arith` =
    /// [`Arith::Reference`]; `kvx eval perplexity --reference-rounding`).
    pub reference_rounding: RefRounding,
}

/// Why engines could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A value that cannot work.
    #[error("{0}")]
    Invalid(String),
    /// The model file failed to open or load.
    #[error("{what} {}: {source}", path.display())]
    Model {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An engine or its shard could not start.
    #[error("starting engine {index}: {source}")]
    Engine {
        /// The engine's index in this process.
        index: usize,
        /// Why.
        #[source]
        source: EngineError,
    },
}

fn model_err(
    what: &'static str,
    path: &Path,
    e: impl std::error::Error + Send + Sync + 'static,
) -> SetupError {
    SetupError::Model { what, path: path.to_path_buf(), source: Box::new(e) }
}

/// What a frontend (or a mock engine) reads of a model: its tokenizer and shape, not its
/// weights.
#[derive(Debug, Clone)]
pub struct ModelMeta {
    /// Tokenizer and chat template.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's shape.
    pub config: LlamaConfig,
}

impl ModelMeta {
    /// Reads the tokenizer and configuration of the GGUF file at `path`.
    pub fn read(path: &Path) -> Result<ModelMeta, SetupError> {
        let tokenizer = Tokenizer::from_gguf_path(path)
            .map_err(|e| model_err("loading the tokenizer of", path, e))?;
        let file = GgufFile::open(path).map_err(|e| model_err("opening", path, e))?;
        let config = LlamaConfig::from_gguf(&file)
            .map_err(|e| model_err("reading the configuration of", path, e))?;
        Ok(ModelMeta { tokenizer: Arc::new(tokenizer), config })
    }

    /// Vocabulary size (metadata may omit it; the tokenizer has it).
    pub fn n_vocab(&self) -> usize {
        self.config.n_vocab.max(self.tokenizer.vocab_size()).max(1)
    }
}

/// The shared state of the engines: the loaded model or the mocker's settings (with the KV
/// bytes per token of the model it stands for, for modelled transfers).
#[derive(Debug, Clone)]
enum Backing {
    Model(Arc<LlamaModel>),
    Mocker(MockConfig, usize),
}

/// KV bytes per token of a tokenizer-free mock engine: SmolLM2-135M's (30 layers × 3 KV
/// heads × 64 dimensions × keys and values × f16).
const MOCK_KV_BYTES_PER_TOKEN: usize = 23_040;

/// A setup whose model is loaded and whose sizes are known: engines can be made from it.
#[derive(Debug, Clone)]
pub struct Prepared {
    setup: EngineSetup,
    backing: Backing,
    tokenizer: Option<Arc<Tokenizer>>,
    sched: SchedulerConfig,
    kv_blocks: usize,
    /// What KV blocks kept on disk must have been computed with (model, kernels, layout).
    kv_fingerprint: u64,
}

/// A process's engines running on their shard threads.
#[derive(Debug)]
pub struct Started {
    /// The shards, in worker id order.
    pub shards: Vec<Hosted>,
    /// Their [`ShardEvent`]s, on one bounded channel.
    pub events: Receiver<ShardEvent>,
    /// The KV transfer link of its prefill and decode engines (the plane tells it where
    /// decode engines' caches are).
    pub kv: Option<Arc<KvLink>>,
}

impl EngineSetup {
    /// Defaults for `engines` engines of `kind` on `kernels`.
    pub fn new(kind: EngineKind, model: Option<PathBuf>, kernels: &'static Kernels) -> Self {
        EngineSetup {
            kind,
            model,
            kernels,
            arith: None,
            limits: EngineLimits::default(),
            kv_cache_bytes: None,
            engines: 1,
            threads_per_engine: 1,
            first_worker_id: 1,
            pin: false,
            lend_cores: false,
            inbox_capacity: 4096,
            mocker: MockerSetup::default(),
            roles: Vec::new(),
            kv_link: KvLinkConfig::default(),
            tiers: None,
            prefault_kv: false,
            reference_rounding: RefRounding::default(),
        }
    }

    /// The role of engine `i`.
    pub fn role(&self, i: usize) -> WorkerRole {
        self.roles.get(i).copied().unwrap_or_default()
    }

    /// The engines that decode: every engine, or only the decode engines when some engines
    /// prefill for others.
    fn decoding_engines(&self) -> usize {
        let decoders = (0..self.engines).filter(|&i| self.role(i) == WorkerRole::Decode).count();
        if decoders > 0 { decoders } else { self.engines }
    }

    /// Sequences the engines that decode can run at once.
    pub fn sequence_slots(&self) -> usize {
        self.decoding_engines() * self.limits.max_num_seqs.max(1)
    }

    /// The least running bound that follows the decoding engines' batch knees:
    /// [`kvx_engine::knee::FLOOR_PER_ENGINE`] each (at most their slots).
    pub fn knee_floor(&self) -> usize {
        self.decoding_engines()
            * kvx_engine::knee::FLOOR_PER_ENGINE.min(self.limits.max_num_seqs.max(1))
    }

    /// Whether any engine takes part in disaggregated serving.
    pub fn disaggregated(&self) -> bool {
        (0..self.engines).any(|i| self.role(i) != WorkerRole::Agg)
    }

    /// The arithmetic model engines really compute in: `fast` is `exact` where the kernel
    /// level has no row-lane products. For a setup whose arithmetic is still to be chosen
    /// (`arith` `None`, before [`EngineSetup::prepare`]), `exact`; a [`Prepared`] setup's is
    /// the chosen one.
    pub fn effective_arith(&self) -> Arith {
        match self.arith.unwrap_or(Arith::Exact) {
            Arith::Fast if self.kernels.lanes.is_none() => Arith::Exact,
            a => a,
        }
    }

    /// `engines` tokenizer-free mock engines of `blocks` KV blocks each, drawing tokens below
    /// `vocab`, taking `max_model_len` tokens per sequence, with time divided by `speedup`
    /// (fleets of workers for tests and load generation; no model file is read).
    pub fn tokenizer_free_mocker(
        engines: usize,
        blocks: usize,
        vocab: usize,
        max_model_len: usize,
        speedup: f64,
    ) -> Self {
        let mut s = EngineSetup::new(EngineKind::Mocker, None, kvx_kernels::cpu::kernels());
        s.engines = engines;
        s.mocker = MockerSetup {
            speedup,
            blocks: Some(blocks),
            vocab: Some(vocab),
            max_model_len: Some(max_model_len),
        };
        s
    }

    /// Checks the values that no engine could run with.
    pub fn validate(&self) -> Result<(), SetupError> {
        let l = &self.limits;
        let bad = |what: &str| Err(SetupError::Invalid(what.to_string()));
        if l.block_size == 0 {
            return bad("--block-size must be at least 1");
        }
        if l.max_num_seqs == 0 {
            return bad("--max-num-seqs must be at least 1");
        }
        if l.max_batched_tokens == 0 {
            return bad("--max-batched-tokens must be at least 1");
        }
        if self.engines == 0 {
            return bad("at least one engine (shard) is needed");
        }
        if self.threads_per_engine == 0 {
            return bad("at least one kernel thread per engine is needed");
        }
        if !(self.mocker.speedup.is_finite() && self.mocker.speedup > 0.0) {
            return bad("--speedup-ratio must be a positive number");
        }
        if self.kv_cache_bytes == Some(0) {
            return bad("--kv-cache-bytes must be positive");
        }
        if self.roles.len() > self.engines {
            return bad("more roles than engines");
        }
        if !self.reference_rounding.is_none() && self.arith != Some(Arith::Reference) {
            return bad("reference roundings need the reference arithmetic (--arith reference)");
        }
        if self.arith == Some(Arith::Reference) && (self.tiers.is_some() || self.disaggregated()) {
            return bad(
                "the reference arithmetic keeps an f32 KV cache of its own: no KV tiers and no \
                 prefill/decode roles",
            );
        }
        if let Some(t) = &self.tiers {
            if self.kind != EngineKind::Model {
                return bad("KV tiers (--kv-host-bytes, --kv-disk) need model engines");
            }
            if !l.prefix_caching {
                return bad("KV tiers need prefix caching");
            }
            if t.host_bytes == 0 {
                return bad("--kv-host-bytes must be positive (the disk tier loads through it)");
            }
            if t.disk.as_ref().is_some_and(|(_, b)| *b == 0) {
                return bad("--kv-disk-bytes must be positive");
            }
        }
        match (self.kind, &self.model) {
            (EngineKind::Model, None) => bad("model engines need a model file"),
            (EngineKind::Mocker, None)
                if self.mocker.blocks.is_none()
                    || self.mocker.vocab.is_none()
                    || self.mocker.max_model_len.is_none() =>
            {
                bad("mock engines without a model need their KV blocks, vocabulary and context")
            }
            _ => Ok(()),
        }
    }

    /// Loads the model (weights repacked for the kernels) or the mocker's metadata, and
    /// sizes the KV pool of each engine.
    pub fn prepare(&self) -> Result<Prepared, SetupError> {
        self.validate()?;
        let mut resolved = self.clone();
        let (backing, tokenizer, sched, kv_blocks, kv_fingerprint) = match (self.kind, &self.model)
        {
            (EngineKind::Model, Some(path)) => {
                let tokenizer = Tokenizer::from_gguf_path(path)
                    .map_err(|e| model_err("loading the tokenizer of", path, e))?;
                let file = GgufFile::open(path).map_err(|e| model_err("opening", path, e))?;
                let mut model =
                    LlamaModel::load(Arc::new(file)).map_err(|e| model_err("loading", path, e))?;
                let arith = self.arith.unwrap_or_else(|| model.preferred_arith(self.kernels));
                resolved.arith = Some(arith);
                tracing::info!(arith = arith.name(), "arithmetic");
                if let Some(math) = arith.lane_math() {
                    let bytes = model
                        .repack(self.kernels, math)
                        .map_err(|e| model_err("repacking", path, e))?;
                    tracing::debug!(bytes, ?math, "weights repacked into row-lane tiles");
                }
                model.split_kv = arith.split_kv();
                model.free_attention = arith.free_attention()
                    && kvx_kernels::ops::attention_free_covers(self.kernels, model.cfg.head_dim);
                if model.split_kv && !model.can_split_kv() {
                    return Err(SetupError::Invalid(format!(
                        "--arith split: the Q/K/V products of {} do not share one activation \
                         type that kvx can dequantize",
                        path.display()
                    )));
                }
                let sched = self.limits.sched(model.cfg.context_length);
                let budget =
                    self.kv_cache_bytes.unwrap_or_else(|| default_kv_bytes() / self.engines as u64);
                // The reference arithmetic caches f32, twice the bytes of the f16 cache.
                let budget = if arith == Arith::Reference { budget / 2 } else { budget };
                let blocks = self.blocks_for(&model.cfg, budget, sched.max_model_len);
                let arith = resolved.effective_arith();
                let fp = self.kv_fingerprint(path, &model.cfg, arith, model.free_attention)?;
                (Backing::Model(Arc::new(model)), Some(Arc::new(tokenizer)), sched, blocks, fp)
            }
            (EngineKind::Model, None) => unreachable_model()?,
            (EngineKind::Mocker, path) => {
                let meta = path.as_deref().map(ModelMeta::read).transpose()?;
                let m = &self.mocker;
                let max_model_len = match (m.max_model_len, &meta) {
                    (Some(n), _) => n,
                    (None, Some(meta)) => meta.config.context_length,
                    (None, None) => unreachable_model()?,
                };
                let sched = self.limits.sched(max_model_len.max(1));
                let blocks = match (m.blocks, &meta) {
                    (Some(b), _) => b,
                    (None, Some(meta)) => {
                        let budget =
                            self.kv_cache_bytes.unwrap_or((1u64 << 30) / self.engines as u64);
                        self.blocks_for(&meta.config, budget, max_model_len)
                    }
                    (None, None) => unreachable_model()?,
                };
                let n_vocab = match (&meta, m.vocab) {
                    (Some(meta), Some(v)) => v.min(meta.n_vocab()),
                    (Some(meta), None) => meta.n_vocab(),
                    (None, Some(v)) => v,
                    (None, None) => unreachable_model()?,
                };
                let per_token = meta
                    .as_ref()
                    .map_or(MOCK_KV_BYTES_PER_TOKEN, |m| m.config.kv_bytes_per_token());
                let tokenizer = meta.map(|m| m.tokenizer);
                let mock = MockConfig {
                    n_vocab: n_vocab.max(2),
                    n_blocks: blocks.max(1),
                    speedup: m.speedup,
                    avoid: tokenizer.as_ref().map(|t| t.eog_ids().to_vec()).unwrap_or_default(),
                };
                (Backing::Mocker(mock, per_token), tokenizer, sched, blocks.max(1), 0)
            }
        };
        Ok(Prepared { setup: resolved, backing, tokenizer, sched, kv_blocks, kv_fingerprint })
    }

    /// A fingerprint of what a KV block's bytes depend on: the model file (its size and
    /// its first and last MiB, which hold the metadata and tensor table and the last
    /// weights), the kernels' instruction set and the arithmetic `arith` they compute in
    /// (with `free_attention`, whether its attention is the free kernel's; with its
    /// [`Arith::label`] where that differs from its name: the bits changed under the same
    /// name), and the cache layout.
    fn kv_fingerprint(
        &self,
        path: &Path,
        cfg: &LlamaConfig,
        arith: Arith,
        free_attention: bool,
    ) -> Result<u64, SetupError> {
        use std::io::{Read, Seek, SeekFrom};
        let read = || -> std::io::Result<Vec<u8>> {
            let mut f = std::fs::File::open(path)?;
            let len = f.metadata()?.len();
            let mut buf = Vec::with_capacity(2 << 20);
            buf.extend_from_slice(&len.to_le_bytes());
            (&mut f).take(1 << 20).read_to_end(&mut buf)?;
            f.seek(SeekFrom::Start(len.saturating_sub(1 << 20)))?;
            f.take(1 << 20).read_to_end(&mut buf)?;
            Ok(buf)
        };
        let mut buf = read().map_err(|e| model_err("reading", path, e))?;
        let shape =
            [self.limits.block_size, cfg.n_layer, cfg.n_head_kv, cfg.head_dim, arith as usize];
        for v in shape {
            buf.extend_from_slice(&(v as u64).to_le_bytes());
        }
        buf.extend_from_slice(self.kernels.level.name().as_bytes());
        if free_attention {
            // Blocks an earlier build computed with ggml's attention in this arithmetic are
            // not these bits.
            buf.extend_from_slice(b"free attention");
        }
        if arith.label() != arith.name() {
            // Blocks an earlier build computed under the same name are not these bits.
            buf.extend_from_slice(arith.label().as_bytes());
        }
        Ok(xxhash_rust::xxh3::xxh3_64(&buf))
    }

    /// KV blocks a budget of `bytes` buys for `cfg`, at most what `max_num_seqs` sequences
    /// of the whole context could use.
    fn blocks_for(&self, cfg: &LlamaConfig, bytes: u64, context: usize) -> usize {
        let bs = self.limits.block_size;
        let max_useful = context.max(1).div_ceil(bs) * self.limits.max_num_seqs;
        KvCache::blocks_for_budget(cfg, bs, bytes).clamp(1, max_useful.max(1))
    }
}

fn unreachable_model<T>() -> Result<T, SetupError> {
    Err(SetupError::Invalid("the engine setup needs a model file".into()))
}

impl Prepared {
    /// The setup this was prepared from.
    pub fn setup(&self) -> &EngineSetup {
        &self.setup
    }

    /// The model's tokenizer (`None` for tokenizer-free mock engines).
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The loaded model (`None` for mock engines).
    pub fn model(&self) -> Option<&Arc<LlamaModel>> {
        match &self.backing {
            Backing::Model(m) => Some(m),
            Backing::Mocker(..) => None,
        }
    }

    /// Scheduler limits of each engine.
    pub fn sched(&self) -> &SchedulerConfig {
        &self.sched
    }

    /// KV blocks of each engine's pool.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.sched.block_size
    }

    /// The longest prompt + output one engine takes.
    pub fn context_limit(&self) -> usize {
        let s = &self.sched;
        let mut limit = s.max_model_len.min(self.kv_blocks * s.block_size);
        if !s.chunked_prefill {
            limit = limit.min(s.max_batched_tokens);
        }
        limit
    }

    /// The arithmetic and kernel level the engines compute in, as a worker registers it with
    /// its frontend (`split-kv-half/avx512`, `split-kv-half/avx512/free-attention`; empty for
    /// mock engines):
    /// `split` without row-lane kernels computes otherwise than with them, and with the free
    /// attention kernel otherwise than an earlier build without it (the KV blocks a prefill
    /// worker lends must be the decode worker's bits).
    pub fn arith_label(&self) -> String {
        match &self.backing {
            Backing::Mocker(..) => String::new(),
            Backing::Model(m) => format!(
                "{}/{}{}",
                self.setup.effective_arith().label(),
                self.setup.kernels.level,
                if m.free_attention { "/free-attention" } else { "" }
            ),
        }
    }

    /// The model's name as discovery and profiles record it: its file name, size and the
    /// arithmetic its engines compute in (profiles of different arithmetics do not mix), or
    /// `mocker` for mock engines without a model.
    pub fn model_label(&self) -> String {
        match &self.setup.model {
            Some(p) => {
                let len = std::fs::metadata(p).map_or(0, |m| m.len());
                let name = p.file_name().and_then(|f| f.to_str()).unwrap_or("model");
                format!("{name}:{len}:{}", self.setup.effective_arith().label())
            }
            None => "mocker".to_string(),
        }
    }

    /// One engine on the calling thread, with its own (unpinned) kernel threads.
    pub fn engine(&self, worker_id: WorkerId) -> Result<Engine, SetupError> {
        if self.setup.tiers.is_some() {
            return Err(SetupError::Invalid(
                "KV tiers (--kv-host-bytes, --kv-disk) run behind shards: `kvx serve` and \
                 `kvx worker`"
                    .into(),
            ));
        }
        self.make(worker_id, Vec::new(), Vec::new(), None)
            .map_err(|source| SetupError::Engine { index: 0, source })
    }

    /// Bytes of KV one token takes (keys and values, all layers; what a disaggregated
    /// transfer moves per prompt token), 0 when the layout cannot be had.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_layout().map_or(0, |l| (2 * l.block_bytes / self.sched.block_size.max(1)) as u64)
    }

    /// The layout of one engine's KV cache as a transfer sees it (modelled for mock engines:
    /// only the block size in bytes matters to them).
    fn kv_layout(&self) -> Result<KvLayout, EngineError> {
        match &self.backing {
            Backing::Model(m) => {
                Ok(KvCache::layout(&m.cfg, self.kv_blocks, self.sched.block_size)?)
            }
            Backing::Mocker(_, per_token) => {
                let block_bytes = per_token * self.sched.block_size / 2;
                Ok(KvLayout {
                    bytes: 2 * block_bytes * self.kv_blocks,
                    k_offset: 0,
                    v_offset: block_bytes * self.kv_blocks,
                    block_bytes,
                })
            }
        }
    }

    /// The backend of one engine: the mocker, or the model in the setup's arithmetic, its
    /// kernel threads pinned to `cores` when given (its own, then one per guest), with a
    /// guest thread for each lease in `guests` (the cores of other shards it may borrow),
    /// its cache in `kv_memory` when given.
    fn make_backend(
        &self,
        cores: Vec<usize>,
        guests: Vec<CoreLease>,
        kv_memory: Option<Box<dyn KvMemory>>,
    ) -> Result<Box<dyn Backend>, EngineError> {
        let model = match &self.backing {
            Backing::Mocker(mock, _) => return Ok(Box::new(MockBackend::new(mock.clone()))),
            Backing::Model(model) => model,
        };
        let threads = self.setup.threads_per_engine;
        let pool = if cores.is_empty() {
            ThreadPool::new(threads)
        } else {
            ThreadPool::with_guests(threads, guests, move |i| {
                if let Some(&c) = cores.get(i) {
                    shard::pin_current(c);
                }
            })
        }
        .map_err(|e| EngineError::Internal(format!("starting kernel threads: {e}")))?;
        let max_ctx = self.sched.max_model_len.min(self.kv_blocks * self.sched.block_size);
        let (m, k, bs) = (model.clone(), self.setup.kernels, self.sched.block_size);
        let (t, n) = (self.sched.max_batched_tokens, self.kv_blocks);
        Ok(match kv_memory {
            None if self.setup.arith == Some(Arith::Reference) => {
                let b = ReferenceBackend::new(m, pool, n, bs, t, max_ctx)?;
                Box::new(b.with_rounding(self.setup.reference_rounding))
            }
            None => {
                let mut b = ModelBackend::new(m, k, pool, n, bs, t, max_ctx)?;
                if self.setup.prefault_kv {
                    b.prefault_kv();
                }
                Box::new(b)
            }
            Some(_) if self.setup.arith == Some(Arith::Reference) => {
                return Err(EngineError::Internal(
                    "the reference arithmetic keeps its own f32 cache; it cannot use lent memory"
                        .into(),
                ));
            }
            Some(mem) => {
                let mut b = ModelBackend::with_kv_memory(m, k, pool, n, bs, t, max_ctx, mem)?;
                if self.setup.prefault_kv {
                    b.prefault_kv();
                }
                Box::new(b)
            }
        })
    }

    /// One engine's backend on its own, for work that drives the model step by step without
    /// a scheduler (`kvx eval perplexity`).
    pub fn backend(&self) -> Result<Box<dyn Backend>, SetupError> {
        self.make_backend(Vec::new(), Vec::new(), None)
            .map_err(|source| SetupError::Engine { index: 0, source })
    }

    fn make(
        &self,
        worker_id: WorkerId,
        cores: Vec<usize>,
        guests: Vec<CoreLease>,
        kv_memory: Option<Box<dyn KvMemory>>,
    ) -> Result<Engine, EngineError> {
        let cfg = EngineConfig { sched: self.sched.clone(), worker_id };
        let quarantine = self.setup.kv_link.timeout + Duration::from_secs(5);
        let backend = self.make_backend(cores, guests, kv_memory)?;
        let engine = Engine::new(cfg, backend, self.tokenizer.clone());
        Ok(engine.with_kv_quarantine(quarantine))
    }

    /// Starts every engine on its shard thread: shard `i` is worker `first_worker_id + i`;
    /// when pinned, it runs on its own core and its kernel threads on the next ones, and
    /// with [`EngineSetup::lend_cores`] its kernel pool has a guest on the first core of up
    /// to [`LEND_GUESTS`] other shards (the next ones, in turn), which those shards lend while
    /// idle. Prefill and decode engines get their KV cache in a region of the process's
    /// transfer agent.
    pub fn start(&self) -> Result<Started, SetupError> {
        let (tx, events): (SyncSender<ShardEvent>, _) = sync_channel(EVENT_QUEUE);
        let s = &self.setup;
        let link_err = |e: crate::kvlink::KvLinkError| SetupError::Invalid(e.to_string());
        let model_tiers = matches!(self.backing, Backing::Model(_)) && s.tiers.is_some();
        let kv = if s.disaggregated() || model_tiers {
            let link = match self.backing {
                Backing::Model(_) => {
                    let name = format!("kvx-{}-{}", std::process::id(), s.first_worker_id);
                    KvLink::with_agent(&name, s.kv_link.clone()).map_err(link_err)?
                }
                Backing::Mocker(..) => KvLink::modelled(s.kv_link.clone()),
            };
            Some(Arc::new(link))
        } else {
            None
        };
        let tps = s.threads_per_engine;
        let cores = if s.pin { allowed_cores() } else { Vec::new() };
        let pin = s.pin && s.engines * tps <= cores.len();
        let lend = pin && s.lend_cores && matches!(self.backing, Backing::Model(_));
        let leases: Vec<CoreLease> = (0..s.engines).map(|_| CoreLease::new()).collect();
        let mut shards = Vec::with_capacity(s.engines);
        for i in 0..s.engines {
            let worker_id = s.first_worker_id + i as u64;
            let mut mine: Vec<usize> = if pin {
                cores.iter().skip(i * tps).take(tps).copied().collect()
            } else {
                Vec::new()
            };
            // Guests on the next shards' first cores, each with that shard's lease.
            let lenders: Vec<usize> = if lend {
                (1..s.engines).map(|d| (i + d) % s.engines).take(LEND_GUESTS).collect()
            } else {
                Vec::new()
            };
            let (guest_cores, guests): (Vec<usize>, Vec<CoreLease>) = lenders
                .iter()
                .filter_map(|&j| Some((*cores.get(j * tps)?, leases.get(j)?.clone())))
                .unzip();
            mine.extend(guest_cores);
            let core = mine.first().copied();
            let role = s.role(i);
            let engine_err = |source| SetupError::Engine { index: i, source };
            // The engine's cache lives in the agent's memory when a peer writes into it or
            // the tiers copy out of it.
            let lent = role != WorkerRole::Agg || model_tiers;
            let (mem, link) = match &kv {
                Some(link) if lent => {
                    let layout = self.kv_layout().map_err(engine_err)?;
                    let mem = link.region_for(worker_id, layout).map_err(link_err)?;
                    let moves_kv = role != WorkerRole::Agg;
                    (mem, moves_kv.then(|| link.clone()))
                }
                _ => (None, None),
            };
            let tiers = match (&kv, &s.tiers) {
                (Some(link), Some(t)) if model_tiers => Some(self.start_tiers(link, worker_id, t)?),
                _ => None,
            };
            let kv_peer = link.as_ref().and_then(|l| l.peer(worker_id));
            let me = self.clone();
            let make = move || me.make(worker_id, mine, guests, mem);
            let cfg = ShardConfig {
                index: i,
                core,
                inbox_capacity: s.inbox_capacity,
                kv: link,
                tiers,
                lease: lend.then(|| leases[i].clone()),
            };
            let shard = shard::spawn(cfg, make, Some(tx.clone())).map_err(engine_err)?;
            shards.push(Hosted {
                worker_id,
                kv_blocks: self.kv_blocks,
                max_num_seqs: self.sched.max_num_seqs,
                role,
                kv_peer,
                shard,
            });
        }
        Ok(Started { shards, events, kv })
    }
}

impl Prepared {
    /// The tiers of worker `w`, whose cache is in `link`'s agent.
    fn start_tiers(&self, link: &KvLink, w: WorkerId, t: &TierSetup) -> Result<Tiers, SetupError> {
        let invalid = |e: &dyn std::fmt::Display| SetupError::Invalid(format!("KV tiers: {e}"));
        let agent = link.agent().ok_or_else(|| invalid(&"no transfer agent"))?;
        let (region, layout) = link.region_of(w).ok_or_else(|| invalid(&"no KV region"))?;
        let pool = PoolLayout {
            region,
            k_offset: layout.k_offset as u64,
            v_offset: layout.v_offset as u64,
            block_bytes: layout.block_bytes as u64,
            blocks: self.kv_blocks as u64,
        };
        let cfg = TierConfig {
            host_bytes: t.host_bytes,
            disk: t.disk.as_ref().map(|(dir, bytes)| DiskConfig {
                dir: dir.clone(),
                file: format!("w{w}.blocks"),
                bytes: *bytes,
                min_hits: t.disk_min_hits,
            }),
            timeout: self.setup.kv_link.timeout,
        };
        Tiers::start(agent.clone(), pool, &cfg, self.kv_fingerprint).map_err(|e| invalid(&e))
    }
}

/// The CPUs this process may run on, in order.
pub fn allowed_cores() -> Vec<usize> {
    core_affinity::get_core_ids().map(|v| v.into_iter().map(|c| c.id).collect()).unwrap_or_default()
}

/// A quarter of the machine's memory, at most 4 GiB.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn mocker() -> EngineSetup {
        EngineSetup::tokenizer_free_mocker(1, 64, 32, 512, 1000.0)
    }

    #[test]
    fn tokenizer_free_mock_engines_need_their_sizes() {
        let mut s = mocker();
        assert!(s.validate().is_ok());
        s.mocker.vocab = None;
        assert!(matches!(s.validate(), Err(SetupError::Invalid(_))));
    }

    #[test]
    fn sequence_slots_are_the_decoding_engines_slots() {
        let mut s = mocker();
        s.engines = 3;
        s.limits.max_num_seqs = 8;
        assert_eq!(s.sequence_slots(), 24);
        assert_eq!(s.knee_floor(), 12);
        s.roles = vec![WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
        assert_eq!(s.sequence_slots(), 16);
        assert_eq!(s.knee_floor(), 8);
        // The floor is at most an engine's slots.
        s.limits.max_num_seqs = 2;
        assert_eq!(s.knee_floor(), 4);
    }

    #[test]
    fn bad_limits_are_refused_before_anything_loads() {
        for f in [
            (|s: &mut EngineSetup| s.limits.block_size = 0) as fn(&mut EngineSetup),
            |s| s.limits.max_num_seqs = 0,
            |s| s.engines = 0,
            |s| s.mocker.speedup = f64::NAN,
            |s| s.kv_cache_bytes = Some(0),
        ] {
            let mut s = mocker();
            f(&mut s);
            assert!(matches!(s.prepare(), Err(SetupError::Invalid(_))));
        }
        let s = EngineSetup::new(EngineKind::Model, None, kvx_kernels::cpu::kernels());
        assert!(matches!(s.prepare(), Err(SetupError::Invalid(_))));
    }

    #[test]
    fn kv_tiers_that_cannot_work_are_refused() {
        let tiers = TierSetup { host_bytes: 1 << 20, disk: None, disk_min_hits: 0 };
        let mut s = mocker();
        s.tiers = Some(tiers.clone());
        assert!(matches!(s.validate(), Err(SetupError::Invalid(m)) if m.contains("model engines")));
        let mut s =
            EngineSetup::new(EngineKind::Model, Some("m.gguf".into()), kvx_kernels::cpu::kernels());
        s.tiers = Some(TierSetup { host_bytes: 0, ..tiers.clone() });
        assert!(matches!(s.validate(), Err(SetupError::Invalid(_))));
        s.tiers = Some(TierSetup { disk: Some(("/tmp".into(), 0)), ..tiers.clone() });
        assert!(matches!(s.validate(), Err(SetupError::Invalid(_))));
        s.tiers = Some(tiers);
        s.limits.prefix_caching = false;
        assert!(
            matches!(s.validate(), Err(SetupError::Invalid(m)) if m.contains("prefix caching"))
        );
    }

    #[test]
    fn the_reference_arithmetic_refuses_tiers_and_roles_and_alone_takes_roundings() {
        let model = || {
            let mut s = EngineSetup::new(
                EngineKind::Model,
                Some("m.gguf".into()),
                kvx_kernels::cpu::kernels(),
            );
            s.arith = Some(Arith::Reference);
            s
        };
        assert!(model().validate().is_ok());
        let mut s = model();
        s.tiers = Some(TierSetup { host_bytes: 1 << 20, disk: None, disk_min_hits: 0 });
        assert!(matches!(s.validate(), Err(SetupError::Invalid(m)) if m.contains("reference")));
        let mut s = model();
        s.engines = 2;
        s.roles = vec![WorkerRole::Prefill, WorkerRole::Decode];
        assert!(matches!(s.validate(), Err(SetupError::Invalid(m)) if m.contains("reference")));
        // Roundings added to the reference arithmetic: with it only.
        let mut s = model();
        s.reference_rounding = "kv=f16".parse().expect("spec");
        assert!(s.validate().is_ok());
        for arith in [None, Some(Arith::Exact), Some(Arith::Fast), Some(Arith::Split)] {
            s.arith = arith;
            assert!(
                matches!(s.validate(), Err(SetupError::Invalid(m)) if m.contains("--arith reference"))
            );
        }
        // `fast` is `exact` where the level has no row-lane kernels.
        let mut s = model();
        s.arith = Some(Arith::Fast);
        let scalar = kvx_kernels::cpu::Kernels::for_level(kvx_kernels::cpu::SimdLevel::Scalar);
        s.kernels = Box::leak(Box::new(scalar.expect("scalar level")));
        assert_eq!(s.effective_arith(), Arith::Exact);
    }

    #[test]
    fn the_kv_fingerprint_follows_the_arithmetic_and_its_attention() {
        let dir = std::env::temp_dir().join(format!("kvx-fingerprint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("m.gguf");
        std::fs::write(&path, vec![7u8; 4096]).expect("file");
        let cfg = LlamaConfig {
            arch: "llama".into(),
            n_vocab: 32,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_ff: 128,
            rope_dims: 16,
            rope_base: 10000.0,
            rope_kind: kvx_kernels::model::RopeKind::Norm,
            norm_eps: 1e-5,
            context_length: 512,
        };
        let k = kvx_kernels::cpu::kernels();
        let with = |arith, free| {
            let s = EngineSetup::new(EngineKind::Model, Some(path.clone()), k);
            s.kv_fingerprint(&path, &cfg, arith, free).expect("fingerprint")
        };
        let all: Vec<u64> = Arith::ALL.iter().map(|&a| with(a, false)).collect();
        for (i, a) in all.iter().enumerate() {
            assert_eq!(*a, with(Arith::ALL[i], false), "stable");
            assert!(all[..i].iter().all(|b| b != a), "{:?} shares a fingerprint", Arith::ALL[i]);
        }
        // Blocks computed with ggml's attention and with the free one are other bits.
        for a in [Arith::Fast, Arith::Split] {
            assert_ne!(with(a, true), with(a, false), "{a:?}");
        }
        // Which heads the free kernel takes (elsewhere the free arithmetics attend as ggml).
        let covers = |hd| kvx_kernels::ops::attention_free_covers(k, hd);
        assert_eq!(covers(64), k.attn_free.is_some());
        assert_eq!(covers(128), k.attn_free.is_some());
        assert!(!covers(40) && !covers(512) && !covers(0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn started_shards_are_numbered_from_the_first_worker_id() {
        let mut s = mocker();
        s.engines = 3;
        s.first_worker_id = 40;
        let p = s.prepare().expect("prepare");
        assert_eq!(p.kv_blocks(), 64);
        assert_eq!(p.context_limit(), 512);
        let started = p.start().expect("start");
        let ids: Vec<_> = started.shards.iter().map(|h| h.worker_id).collect();
        assert_eq!(ids, [40, 41, 42]);
        assert!(started.shards.iter().all(|h| h.shard.is_alive() && h.kv_blocks == 64));
    }

    #[test]
    fn the_context_is_bounded_by_the_pool_and_by_whole_prompts() {
        let mut s = mocker();
        s.mocker.blocks = Some(8);
        let p = s.prepare().expect("prepare");
        assert_eq!(p.context_limit(), 8 * 16);
        let mut s = mocker();
        s.limits.chunked_prefill = false;
        s.limits.max_batched_tokens = 100;
        assert_eq!(s.prepare().expect("prepare").context_limit(), 100);
    }
}

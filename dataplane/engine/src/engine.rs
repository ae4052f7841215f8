//! The engine: one step loop over the scheduler, a backend (the model, or a timing model),
//! the sampler and per-request output processing.
//!
//! `step` = schedule → forward → commit → sample each sequence that produced logits →
//! stop checks → outputs. In steady state (sequences decoding, no arrivals or finishes) a
//! step allocates nothing: every buffer is sized at construction or at a request's admission.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvx_kernels::cpu::Kernels;
use kvx_kernels::model::{KvCache, KvMemory, LlamaModel, Logits, Scratch, SeqChunk};
use kvx_kernels::par::ThreadPool;
use kvx_proto::KvRole;
use kvx_proto::hashing::seed_for;
use kvx_proto::{
    FinishReason, GenerateRequest, LoadReport, RequestId, StepSums, TopLogprob, Usage, WorkerId,
};
use kvx_tokenizer::Tokenizer;

use crate::EngineError;
use crate::block_pool::BlockEvent;
use crate::constraint::{ConstraintEnv, SeqConstraint};
use crate::output::OutputState;
use crate::sampler::{Sampler, SamplerState, SamplingParams};
use crate::scheduler::{
    AddError, LowerTiers, SCORE_ROWS, Scheduler, SchedulerConfig, SchedulerOutput, SeqId, SeqStatus,
};

/// What computes a step: fills the rows of logits the chunks want (`logits`: one for a chunk
/// that ends its sequence, one per token for a scored chunk, [`SeqChunk::logits`]), in order.
pub trait Backend: Send {
    /// Runs the step.
    fn forward(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), EngineError>;
    /// Vocabulary size (logits per row).
    fn n_vocab(&self) -> usize;
    /// KV blocks the backend holds.
    fn n_blocks(&self) -> usize;
    /// Copies the KV of block `src` onto block `dst` (a forked sequence's partial block).
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), EngineError>;
    /// Threads the engine may run its own parallel work on between steps (the grammar
    /// masks of a batch), if any.
    fn pool(&self) -> Option<&ThreadPool> {
        None
    }
    /// Prompt token ids must be below this (the embedding table's rows; a backend that
    /// computes nothing from token ids may accept any).
    fn prompt_vocab(&self) -> usize {
        self.n_vocab()
    }
}

/// The real model on the CPU kernels.
pub struct ModelBackend {
    model: Arc<LlamaModel>,
    kernels: &'static Kernels,
    pool: ThreadPool,
    kv: KvCache,
    scratch: Scratch,
}

impl std::fmt::Debug for ModelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBackend")
            .field("kv", &self.kv)
            .field("threads", &self.pool.n_threads())
            .finish()
    }
}

impl ModelBackend {
    /// A backend with `n_blocks` KV blocks of `block_size` tokens, steps of up to
    /// `max_tokens` tokens, contexts up to `max_ctx`, on `pool`.
    pub fn new(
        model: Arc<LlamaModel>,
        kernels: &'static Kernels,
        pool: ThreadPool,
        n_blocks: usize,
        block_size: usize,
        max_tokens: usize,
        max_ctx: usize,
    ) -> Result<Self, EngineError> {
        let kv = KvCache::new(&model.cfg, n_blocks, block_size)?;
        Ok(Self::over(model, kernels, pool, kv, max_tokens, max_ctx))
    }

    /// Makes the whole KV cache resident now (see [`KvCache::prefault`]).
    pub fn prefault_kv(&mut self) -> usize {
        self.kv.prefault()
    }

    /// As [`ModelBackend::new`], with the KV cache in memory its owner lends (a transfer
    /// agent's region, which peers write prompts' KV into), laid out as
    /// [`KvCache::layout`] says.
    #[allow(clippy::too_many_arguments)]
    pub fn with_kv_memory(
        model: Arc<LlamaModel>,
        kernels: &'static Kernels,
        pool: ThreadPool,
        n_blocks: usize,
        block_size: usize,
        max_tokens: usize,
        max_ctx: usize,
        mem: Box<dyn KvMemory>,
    ) -> Result<Self, EngineError> {
        let kv = KvCache::with_memory(&model.cfg, n_blocks, block_size, mem)?;
        Ok(Self::over(model, kernels, pool, kv, max_tokens, max_ctx))
    }

    fn over(
        model: Arc<LlamaModel>,
        kernels: &'static Kernels,
        pool: ThreadPool,
        kv: KvCache,
        max_tokens: usize,
        max_ctx: usize,
    ) -> Self {
        let scratch = Scratch::new(&model, max_tokens, max_ctx, pool.max_threads());
        ModelBackend { model, kernels, pool, kv, scratch }
    }
}

impl Backend for ModelBackend {
    fn forward(&mut self, chunks: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<(), EngineError> {
        // The step runs on the cores idle shards lend now too (`kvx_kernels::par`); a share's
        // bits do not depend on the thread that computes it.
        let Self { model, kernels, pool, kv, scratch } = self;
        pool.borrowing(|| model.forward(kernels, pool, chunks, kv, scratch, logits))?;
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

/// One request's news in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqEvent {
    /// The request.
    pub id: RequestId,
    /// The sampled token, if the request produced one this step.
    pub token: Option<u32>,
    /// Its log-probability.
    pub logprob: f32,
    /// Alternatives in [`StepOutput::top`].
    pub top: Range<usize>,
    /// Released text in [`StepOutput::text`].
    pub text: Range<usize>,
    /// Set when the request ended.
    pub finish: Option<FinishReason>,
    /// Token counts (final when `finish` is set).
    pub usage: Usage,
    /// A prefill-only request's prompt is computed: its blocks ([`Engine::blocks_of`]) are
    /// held until [`Engine::release`].
    pub prefilled: bool,
    /// Scores of its prompt tokens `prompt_start..` in [`StepOutput::prompt`] (a scored
    /// prompt, [`GenerateRequest::prompt_logprobs`]); such an event has no token.
    pub prompt: Range<usize>,
    /// Index of the prompt token `prompt` starts at.
    pub prompt_start: u32,
}

impl SeqEvent {
    /// An event of `id` with its usage and nothing else (no token, text or end).
    fn bare(id: RequestId, usage: Usage) -> Self {
        SeqEvent {
            id,
            token: None,
            logprob: 0.0,
            top: 0..0,
            text: 0..0,
            finish: None,
            usage,
            prefilled: false,
            prompt: 0..0,
            prompt_start: 0,
        }
    }
}

/// A sequence's token counts with `completion` tokens generated.
fn usage_of(seq: &crate::scheduler::Sequence, completion: usize) -> Usage {
    Usage {
        prompt_tokens: seq.prompt_len as u32,
        completion_tokens: completion as u32,
        cached_tokens: seq.cached_prompt as u32,
        kv_transfer_us: 0,
    }
}

/// A prompt token's score in a step's output.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScore {
    /// Its log-probability given the tokens before it.
    pub logprob: f32,
    /// The most likely tokens there, in [`StepOutput::top`].
    pub top: Range<usize>,
}

/// How [`Engine::add`] took a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Queued for admission.
    Queued,
    /// Reserved for KV from a prefill engine ([`KvRole::AwaitKv`]): the prompt's block
    /// `first_block` on (those before are cached here) goes into `blocks`.
    Reserved {
        /// Index of the first block to receive.
        first_block: usize,
        /// The blocks.
        blocks: Vec<u32>,
    },
    /// Asked to await KV but queued to be computed here: no room to reserve blocks now.
    NotReserved,
}

/// The outputs of one step (buffers reused across steps).
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Per request with news.
    pub events: Vec<SeqEvent>,
    /// Text arena.
    pub text: String,
    /// Logprob alternatives arena.
    pub top: Vec<TopLogprob>,
    /// Prompt scores arena.
    pub prompt: Vec<PromptScore>,
    /// Tokens computed in the step (prefill and decode).
    pub num_tokens: usize,
}

impl StepOutput {
    fn clear(&mut self) {
        self.events.clear();
        self.text.clear();
        self.top.clear();
        self.prompt.clear();
        self.num_tokens = 0;
    }

    /// The text of an event.
    pub fn text_of(&self, e: &SeqEvent) -> &str {
        &self.text[e.text.clone()]
    }
}

/// Engine counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Prompt (and recomputed) tokens computed.
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Requests finished (any reason).
    pub finished: u64,
    /// Sums over the steps of their prompt tokens, decode context and wall time (the
    /// planner's step-time regression).
    pub step: StepSums,
}

struct SeqState {
    id: RequestId,
    params: SamplingParams,
    sampler: SamplerState,
    output: OutputState,
    logprobs: Option<u32>,
    arrival: Instant,
    counted_admission: bool,
    /// The grammar its output follows (structured outputs).
    constraint: Option<Box<SeqConstraint>>,
    /// Alternatives per scored prompt token (`None`: the prompt is not scored).
    prompt_logprobs: Option<u32>,
    /// The next prompt token to score (token 0 has no score).
    next_score: usize,
    /// Followers to expect (a fork leader that has not drawn its first token yet).
    followers: u32,
}

/// A fork leader's prompt, kept for its followers while it runs.
struct ForkSource {
    sid: SeqId,
    /// The logits its first token was drawn from (before penalties and masks).
    row: Arc<[f32]>,
    /// Followers still to come.
    left: u32,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Scheduler limits.
    pub sched: SchedulerConfig,
    /// This engine's worker id (in KV events and load reports).
    pub worker_id: WorkerId,
}

/// The engine.
pub struct Engine {
    cfg: EngineConfig,
    sched: Scheduler,
    backend: Box<dyn Backend>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// Structured outputs' vocabulary side, built at the first constrained request.
    constraints: Option<Arc<ConstraintEnv>>,
    sampler: Sampler,
    states: Vec<Option<SeqState>>,
    by_id: HashMap<RequestId, SeqId>,
    logits: Vec<f32>,
    plan: SchedulerOutput,
    out: StepOutput,
    chunk_buf: Vec<SeqChunk<'static>>,
    top_buf: Vec<(u32, f32)>,
    cancelled: Vec<(RequestId, Usage)>,
    /// Fork leaders whose followers may still come, by the leader's id.
    forks: HashMap<RequestId, ForkSource>,
    /// Forked sequences whose first token is drawn in the next step, from these logits.
    pending_forks: Vec<(SeqId, Arc<[f32]>)>,
    /// A forked sequence's logits, penalized and masked in place.
    fork_row: Vec<f32>,
    stats: EngineStats,
    last_step_ms: f32,
    /// Decode-only steps' time against their batch (the batch knee).
    knee: crate::knee::KneeFit,
    /// The last knee a trusted fit gave (0: none yet). Kept while the fit lapses: a bound at
    /// the knee makes every batch about the knee, and the spread a fit needs fades.
    last_knee: u32,
    seed_counter: u64,
    /// Start of the engine's clock for quarantined blocks.
    epoch: Instant,
    /// How long blocks a transfer could still write stay out of use.
    kv_quarantine: std::time::Duration,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("cfg", &self.cfg).field("stats", &self.stats).finish()
    }
}

impl Engine {
    /// An engine over `backend`; `tokenizer` enables text, stop strings and end-of-generation
    /// tokens (a tokenizer-free engine streams token ids only).
    pub fn new(
        cfg: EngineConfig,
        backend: Box<dyn Backend>,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Self {
        let n_vocab = backend.n_vocab();
        let slots = cfg.sched.max_num_seqs + cfg.sched.max_waiting;
        let sched = Scheduler::new(cfg.sched.clone(), backend.n_blocks());
        Engine {
            logits: vec![0.0; (cfg.sched.max_num_seqs + SCORE_ROWS) * n_vocab],
            sampler: Sampler::new(n_vocab),
            states: (0..slots).map(|_| None).collect(),
            by_id: HashMap::with_capacity(slots),
            plan: SchedulerOutput { chunks: Vec::with_capacity(2 * slots), ..Default::default() },
            out: StepOutput {
                events: Vec::with_capacity(2 * slots),
                text: String::with_capacity(64 * slots + 4096),
                top: Vec::with_capacity(20 * (cfg.sched.max_num_seqs + SCORE_ROWS)),
                prompt: Vec::with_capacity(SCORE_ROWS),
                num_tokens: 0,
            },
            chunk_buf: Vec::with_capacity(2 * slots),
            top_buf: Vec::with_capacity(32),
            cancelled: Vec::with_capacity(slots),
            forks: HashMap::new(),
            pending_forks: Vec::with_capacity(cfg.sched.max_num_seqs),
            fork_row: vec![0.0; n_vocab],
            stats: EngineStats::default(),
            last_step_ms: 0.0,
            knee: crate::knee::KneeFit::default(),
            last_knee: 0,
            seed_counter: 0x9e37_79b9_7f4a_7c15,
            epoch: Instant::now(),
            kv_quarantine: std::time::Duration::from_secs(60),
            sched,
            backend,
            tokenizer,
            constraints: None,
            cfg,
        }
    }

    /// Settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Blocks reserved for KV that did not arrive (or whose request was cancelled) stay out
    /// of use this long, so that a late write lands in no other request's blocks (at least
    /// the prefill side's transfer timeout; 60 s by default).
    pub fn with_kv_quarantine(mut self, d: std::time::Duration) -> Self {
        self.kv_quarantine = d;
        self
    }

    fn clock_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// The scheduler (read-only).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Whether any request is queued or running (or a cancellation is still to report).
    pub fn has_work(&self) -> bool {
        self.sched.has_work() || !self.cancelled.is_empty()
    }

    /// The load report of this engine.
    pub fn load(&self) -> LoadReport {
        let pool = self.sched.pool();
        LoadReport {
            worker_id: self.cfg.worker_id,
            active_seqs: self.sched.running().len() as u32,
            waiting: self.sched.num_waiting() as u32,
            active_blocks: pool.active() as u32,
            free_blocks: pool.available() as u32,
            total_blocks: pool.capacity() as u32,
            queued_prefill_tokens: self.sched.queued_prefill_tokens() as u32,
            step_ms: self.last_step_ms,
            seq_slots: self.cfg.sched.max_num_seqs as u32,
            batch_knee: self.last_knee,
        }
    }

    /// Hands recorded KV block events to `f` and forgets them.
    pub fn drain_block_events(&mut self, f: impl FnMut(BlockEvent)) {
        self.sched.pool_mut().drain_events(f);
    }

    /// The first `tokens` of a request whose blocks [`Engine::step_with`] sent to load are
    /// loaded (fewer than asked when a load failed part-way): it computes the rest of its
    /// prompt, and the loaded tokens count as cached. False if it was not loading.
    pub fn onboarded(&mut self, id: RequestId, tokens: usize) -> bool {
        self.by_id.get(&id).is_some_and(|&sid| self.sched.kv_arrived_upto(sid, tokens))
    }

    /// Pins a registered block so that its content stays while something reads it (a copy
    /// to a lower tier); false if it is not registered.
    pub fn pin_block(&mut self, b: u32) -> bool {
        self.sched.pool_mut().pin(b)
    }

    /// The sequence hash block `b` is registered under, if any.
    pub fn block_hash(&self, b: u32) -> Option<kvx_proto::SequenceHash> {
        self.sched.pool().hash_of(b)
    }

    /// Drops a pin taken by [`Engine::pin_block`].
    pub fn unpin_block(&mut self, b: u32) {
        self.sched.pool_mut().unpin(b);
    }

    /// Queues a request (or, for [`KvRole::AwaitKv`], reserves its blocks).
    pub fn add(&mut self, req: &GenerateRequest) -> Result<Admission, EngineError> {
        if self.by_id.contains_key(&req.id) {
            return Err(EngineError::BadRequest(format!(
                "request id {} is already in use",
                req.id
            )));
        }
        let s = &req.sampling;
        let params = SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: s.top_p,
            min_p: s.min_p,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
        };
        params.validate().map_err(EngineError::BadRequest)?;
        let prefill_only = matches!(req.kv, KvRole::PrefillTo(_));
        // A scored prompt may ask for nothing generated: it ends once its prompt is scored.
        let score_only = req.stop.max_tokens == 0 && req.prompt_logprobs.is_some();
        if req.stop.max_tokens == 0 && !prefill_only && !score_only {
            return Err(EngineError::BadRequest("max_tokens must be at least 1".into()));
        }
        if !req.stop.stop.is_empty() && self.tokenizer.is_none() {
            return Err(EngineError::BadRequest(
                "stop strings need a tokenizer; this engine has none".into(),
            ));
        }
        if req.logprobs.is_some_and(|n| n > 20) || req.prompt_logprobs.is_some_and(|n| n > 20) {
            return Err(EngineError::BadRequest("top_logprobs must be at most 20".into()));
        }
        // A scored prompt is computed here, whole (a prefill engine's part scores nothing).
        let prompt_logprobs = req.prompt_logprobs.filter(|_| !prefill_only);
        let mut constraint = match &req.constraint {
            Some(c) if !prefill_only => Some(Box::new(self.compile(c)?)),
            _ => None,
        };
        let vocab = self.backend.prompt_vocab();
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadRequest(format!(
                "prompt token {t} is outside the vocabulary of {vocab}"
            )));
        }
        let seed = seed_for(req.salt.as_deref(), None);
        let class = |e: AddError| match e {
            AddError::QueueFull(_) => EngineError::Overloaded(e.to_string()),
            _ => EngineError::BadRequest(e.to_string()),
        };
        let now = self.clock_ms();
        self.sched.release_quarantine(now);
        let max_tokens = req.stop.max_tokens as usize;
        if !req.resume.is_empty() && req.resume.len() >= max_tokens {
            return Err(EngineError::BadRequest(format!(
                "a resumed request with {} generated tokens has none of its {max_tokens} left",
                req.resume.len()
            )));
        }
        if let Some(&t) = req.resume.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadRequest(format!(
                "resumed token {t} is outside the vocabulary of {vocab}"
            )));
        }
        let (sid, admission) = match &req.kv {
            KvRole::Local if !req.resume.is_empty() => (
                self.sched.add_resumed(req.id, &req.prompt, &req.resume, max_tokens, seed),
                Admission::Queued,
            ),
            KvRole::Local => {
                (self.sched.add(req.id, &req.prompt, max_tokens, seed), Admission::Queued)
            }
            KvRole::PrefillTo(_) => {
                (self.sched.add_prefill_only(req.id, &req.prompt, seed), Admission::Queued)
            }
            KvRole::AwaitKv if prompt_logprobs.is_some() => {
                (self.sched.add(req.id, &req.prompt, max_tokens, seed), Admission::NotReserved)
            }
            KvRole::AwaitKv => match self.sched.reserve(req.id, &req.prompt, max_tokens, seed) {
                Ok(Some(sid)) => {
                    let (first_block, blocks) = self.sched.reserved(sid).unwrap_or((0, &[]));
                    (Ok(sid), Admission::Reserved { first_block, blocks: blocks.to_vec() })
                }
                Ok(None) => {
                    (self.sched.add(req.id, &req.prompt, max_tokens, seed), Admission::NotReserved)
                }
                Err(e) => (Err(e), Admission::Queued),
            },
        };
        let sid = sid.map_err(class)?;
        if prompt_logprobs.is_some() && !self.sched.score_prompt(sid) {
            self.sched.remove(sid);
            return Err(EngineError::Internal("a scored prompt could not be queued".into()));
        }
        self.seed_counter =
            self.seed_counter.wrapping_mul(6364136223846793005).wrapping_add(req.id.0 | 1);
        let mut output = OutputState::new(req.stop.clone());
        if output.replay(&req.resume, self.tokenizer.as_deref()).is_some() {
            self.sched.remove(sid);
            return Err(EngineError::BadRequest(
                "the resumed tokens already end the request".into(),
            ));
        }
        if let Some(c) = constraint.as_mut()
            && let Err(e) = c.replay(&req.resume)
        {
            self.sched.remove(sid);
            return Err(EngineError::BadRequest(format!("resumed tokens: {e}")));
        }
        self.states[sid] = Some(SeqState {
            id: req.id,
            sampler: SamplerState::new(&params, self.seed_counter),
            params,
            output,
            logprobs: req.logprobs,
            arrival: Instant::now(),
            counted_admission: false,
            constraint,
            prompt_logprobs,
            next_score: 1,
            // A resumed leader's next logits follow its resumed tokens, not its prompt.
            followers: match req.fork {
                Some(kvx_proto::Fork::Leader { followers })
                    if prompt_logprobs.is_none() && req.resume.is_empty() =>
                {
                    followers
                }
                _ => 0,
            },
        });
        self.by_id.insert(req.id, sid);
        if let (Some(kvx_proto::Fork::Follower { leader }), KvRole::Local) = (req.fork, &req.kv)
            && req.resume.is_empty()
        {
            self.fork(sid, leader)?;
        }
        Ok(admission)
    }

    /// Starts a queued follower from its leader's computed prompt, if the leader runs here
    /// and has drawn its first token; otherwise it stays queued, to be computed.
    fn fork(&mut self, sid: SeqId, leader: RequestId) -> Result<(), EngineError> {
        let Some(src) = self.forks.get_mut(&leader) else { return Ok(()) };
        let lsid = src.sid;
        let row = src.row.clone();
        src.left = src.left.saturating_sub(1);
        if src.left == 0 {
            self.forks.remove(&leader);
        }
        if self.by_id.get(&leader) != Some(&lsid) {
            return Ok(());
        }
        let Some(copy) = self.sched.fork_from(sid, lsid) else { return Ok(()) };
        if let Some((from, to)) = copy
            && let Err(e) = self.backend.copy_block(from, to)
        {
            // The sequence holds its blocks now: take it out whole.
            let id = self.states[sid].take().map(|s| s.id);
            if let Some(id) = id {
                self.by_id.remove(&id);
            }
            self.sched.remove(sid);
            return Err(e);
        }
        self.pending_forks.push((sid, row));
        Ok(())
    }

    /// Compiles a request's constraint (a client error when the grammar is bad or the engine
    /// has no tokenizer); the vocabulary side is built at the first one.
    fn compile(&mut self, c: &kvx_proto::Constraint) -> Result<SeqConstraint, EngineError> {
        let env = match &self.constraints {
            Some(env) => env.clone(),
            None => {
                let Some(tok) = &self.tokenizer else {
                    return Err(EngineError::BadRequest(
                        "structured outputs need a tokenizer; this engine has none".into(),
                    ));
                };
                let env = ConstraintEnv::shared(tok, self.backend.n_vocab())
                    .map_err(EngineError::BadRequest)?;
                self.constraints = Some(env.clone());
                env
            }
        };
        env.compile(c).map_err(|e| EngineError::BadRequest(format!("constraint: {e}")))
    }

    /// Returns to the pool the quarantined blocks whose time is up (steps and admissions do
    /// it too; an idle engine's owner calls this so that they do not wait for the next
    /// request).
    pub fn release_expired(&mut self) {
        let now = self.clock_ms();
        self.sched.release_quarantine(now);
    }

    /// The KV of a reserved request arrived: it runs from its last prompt token. False if it
    /// was not awaiting KV.
    pub fn kv_arrived(&mut self, id: RequestId) -> bool {
        self.by_id.get(&id).is_some_and(|&sid| self.sched.kv_arrived(sid))
    }

    /// The KV of a reserved request will not come: its prompt is computed here. The blocks
    /// it had lent stay out of use for the quarantine time. False if it was not awaiting KV.
    pub fn kv_failed(&mut self, id: RequestId) -> bool {
        let until = self.clock_ms() + self.kv_quarantine.as_millis() as u64;
        self.by_id.get(&id).is_some_and(|&sid| self.sched.kv_failed(sid, until))
    }

    /// The block table of a request (a prefill-only request's KV, once prefilled).
    pub fn blocks_of(&self, id: RequestId) -> Option<&[u32]> {
        let sid = *self.by_id.get(&id)?;
        self.sched.seq(sid).map(|s| s.blocks.as_slice())
    }

    /// Forgets a prefilled request and releases its blocks (they stay in the prefix cache).
    /// False if it is not a prefilled request.
    pub fn release(&mut self, id: RequestId) -> bool {
        let Some(&sid) = self.by_id.get(&id) else { return false };
        if self.sched.seq(sid).is_none_or(|s| s.status != SeqStatus::Prefilled) {
            return false;
        }
        self.by_id.remove(&id);
        self.sched.remove(sid);
        self.states[sid] = None;
        self.stats.finished += 1;
        true
    }

    /// Reports the prefill-only sequences the scheduler parked.
    fn report_prefilled(&mut self) {
        while let Some(sid) = self.sched.pop_prefilled() {
            let (Some(st), Some(seq)) = (self.states[sid].as_mut(), self.sched.seq(sid)) else {
                continue;
            };
            if !st.counted_admission {
                st.counted_admission = true;
                self.stats.prompt_tokens += seq.prompt_len as u64;
                self.stats.cached_tokens += seq.cached_prompt as u64;
            }
            self.out
                .events
                .push(SeqEvent { prefilled: true, ..SeqEvent::bare(st.id, usage_of(seq, 0)) });
        }
    }

    /// Cancels a request: its blocks return to the pool now; the next step reports it
    /// finished with [`FinishReason::Cancelled`]. False if the request is unknown.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let Some(sid) = self.by_id.remove(&id) else { return false };
        self.pending_forks.retain(|(s, _)| *s != sid);
        let until = self.clock_ms() + self.kv_quarantine.as_millis() as u64;
        let seq = self.sched.cancel(sid, until);
        let st = self.states[sid].take();
        let usage = Usage {
            prompt_tokens: seq.as_ref().map_or(0, |s| s.prompt_len as u32),
            completion_tokens: st.as_ref().map_or(0, |s| s.output.generated() as u32),
            cached_tokens: seq.as_ref().map_or(0, |s| s.cached_prompt as u32),
            kv_transfer_us: 0,
        };
        self.cancelled.push((id, usage));
        true
    }

    /// Runs one step and returns its outputs.
    pub fn step(&mut self) -> Result<&StepOutput, EngineError> {
        self.step_with(None)
    }

    /// Runs one step in which the sequences admitted from the queue load the prompt blocks
    /// `lower` holds (they wait, parked, until [`Engine::onboarded`]); returns its outputs.
    pub fn step_with(
        &mut self,
        lower: Option<&mut dyn LowerTiers>,
    ) -> Result<&StepOutput, EngineError> {
        let t0 = Instant::now();
        let queued = self.sched.queued_prefill_tokens();
        self.out.clear();
        for (id, usage) in self.cancelled.drain(..) {
            let finish = Some(FinishReason::Cancelled);
            self.out.events.push(SeqEvent { finish, ..SeqEvent::bare(id, usage) });
            self.stats.finished += 1;
        }
        let now = self.clock_ms();
        self.sched.release_quarantine(now);
        self.sched.schedule_with(&mut self.plan, lower);
        self.stats.preemptions += self.plan.preempted.len() as u64;
        if self.plan.chunks.is_empty() && self.pending_forks.is_empty() {
            self.report_prefilled();
            return Ok(&self.out);
        }
        self.stats.steps += 1;
        self.stats.prefill_tokens += self.plan.num_prefill_tokens as u64;
        self.out.num_tokens = self.plan.num_tokens;

        // Forward pass over borrowed token slices and block tables.
        let mut chunks = recycle(std::mem::take(&mut self.chunk_buf));
        // The context the step's decoded tokens attend.
        let mut decode_context = 0usize;
        let mut decoded = 0usize;
        for c in &self.plan.chunks {
            if let Some(seq) = self.sched.seq(c.seq) {
                if c.len == 1 && c.start >= seq.prompt_len {
                    decode_context += c.start + 1;
                    decoded += 1;
                }
                // A greedy request that reads nothing but its token needs only the first
                // maximum of its logits (the model may then screen the head). A constrained
                // one reads the best token its grammar allows, which need not be that
                // maximum: it takes the exact head, so its tokens never depend on the batch.
                let greedy_only = self.states[c.seq].as_ref().is_some_and(|st| {
                    st.params.temperature == 0.0
                        && !st.params.has_penalties()
                        && st.logprobs.is_none()
                        && st.constraint.is_none()
                });
                chunks.push(SeqChunk {
                    tokens: &seq.tokens[c.start..c.start + c.len],
                    start_pos: c.start,
                    block_table: &seq.blocks,
                    logits: match (c.all, c.logits, greedy_only) {
                        (true, _, _) => Logits::All,
                        (false, false, _) => Logits::Skip,
                        (false, true, true) => Logits::Argmax,
                        (false, true, false) => Logits::Full,
                    },
                    mode: c.mode,
                });
            }
        }
        let result = if chunks.is_empty() {
            Ok(()) // forked sequences' first tokens alone
        } else {
            self.backend.forward(&chunks, &mut self.logits)
        };
        self.chunk_buf = recycle(chunks);
        result?;
        self.sched.commit(&self.plan);
        self.report_prefilled();

        self.prepare_masks();

        // Sample every sequence that produced logits.
        let n_vocab = self.backend.n_vocab();
        // A handle of its own (no allocation), so that `self` stays free to borrow.
        let tokenizer = self.tokenizer.clone();
        let tok = tokenizer.as_deref();
        let n_forks = self.pending_forks.len();
        let mut row_index = 0;
        for k in 0..n_forks + self.plan.chunks.len() {
            let (sid, row) = if k < n_forks {
                // A forked sequence's first token, drawn from its leader's logits.
                let (sid, src) = &self.pending_forks[k];
                self.fork_row.copy_from_slice(src);
                (*sid, &mut self.fork_row[..])
            } else {
                let c = self.plan.chunks[k - n_forks];
                let first_row = row_index;
                row_index += c.rows();
                if c.all {
                    self.score_prompt(&c, first_row);
                }
                if !c.logits {
                    continue;
                }
                let last = row_index - 1;
                (c.seq, &mut self.logits[last * n_vocab..(last + 1) * n_vocab])
            };
            let (Some(st), Some(seq)) = (self.states[sid].as_mut(), self.sched.seq(sid)) else {
                continue;
            };
            if seq.max_len == seq.prompt_len {
                // A scored prompt that asked for nothing generated: it ends here.
                if !st.counted_admission {
                    st.counted_admission = true;
                    self.stats.prompt_tokens += seq.prompt_len as u64;
                    self.stats.cached_tokens += seq.cached_prompt as u64;
                }
                let id = st.id;
                let finish = Some(FinishReason::Length);
                self.out.events.push(SeqEvent { finish, ..SeqEvent::bare(id, usage_of(seq, 0)) });
                self.by_id.remove(&id);
                self.sched.remove(sid);
                self.states[sid] = None;
                self.stats.finished += 1;
                continue;
            }
            if st.followers > 0 {
                // A fork leader's first token: its followers start from these logits.
                let src = ForkSource { sid, row: Arc::from(&*row), left: st.followers };
                self.forks.insert(st.id, src);
                st.followers = 0;
            }
            if !st.counted_admission {
                st.counted_admission = true;
                self.stats.prompt_tokens += seq.prompt_len as u64;
                self.stats.cached_tokens += seq.cached_prompt as u64;
            }
            if let Some(cs) = st.constraint.as_mut()
                && !cs.mask(row)
            {
                // Nothing the grammar allows (it failed): the request ends here.
                let text_start = self.out.text.len();
                st.output.flush(tok, &mut self.out.text);
                let id = st.id;
                self.out.events.push(SeqEvent {
                    text: text_start..self.out.text.len(),
                    finish: Some(FinishReason::Stop),
                    ..SeqEvent::bare(id, usage_of(seq, st.output.generated()))
                });
                self.by_id.remove(&id);
                self.sched.remove(sid);
                self.states[sid] = None;
                self.stats.finished += 1;
                continue;
            }
            self.sampler.apply_penalties(
                &st.params,
                row,
                &seq.tokens[..seq.prompt_len],
                seq.output(),
            );
            let s = self.sampler.sample(&st.params, &mut st.sampler, row, st.logprobs.is_some());
            let top_start = self.out.top.len();
            if let Some(n) = st.logprobs.filter(|&n| n > 0) {
                self.sampler.top_logprobs(row, n as usize, &mut self.top_buf);
                self.out.top.extend(
                    self.top_buf.iter().map(|&(token, logprob)| TopLogprob { token, logprob }),
                );
            }
            self.sched.append_token(sid, s.token);
            self.stats.generated_tokens += 1;
            let text_start = self.out.text.len();
            let mut finish = st.output.on_token(s.token, tok, &mut self.out.text);
            // A complete grammar ends the request (only end-of-generation could follow).
            if finish != Some(FinishReason::Stop)
                && let Some(cs) = st.constraint.as_mut()
                && cs.advance(s.token)
            {
                if finish.is_none() {
                    st.output.flush(tok, &mut self.out.text);
                }
                finish = Some(FinishReason::Stop);
            }
            let Some(seq) = self.sched.seq(sid) else { continue };
            let id = st.id;
            self.out.events.push(SeqEvent {
                token: Some(s.token),
                logprob: s.logprob,
                top: top_start..self.out.top.len(),
                text: text_start..self.out.text.len(),
                finish,
                ..SeqEvent::bare(id, usage_of(seq, st.output.generated()))
            });
            if finish.is_some() {
                self.by_id.remove(&id);
                self.sched.remove(sid);
                self.states[sid] = None;
                self.stats.finished += 1;
            }
        }
        self.pending_forks.clear();
        if !self.forks.is_empty() {
            // Leaders that ended take their prompts with them.
            let by_id = &self.by_id;
            self.forks.retain(|id, f| by_id.get(id) == Some(&f.sid));
        }
        let secs = t0.elapsed().as_secs_f64();
        self.last_step_ms = (secs * 1e3) as f32;
        if self.plan.num_prefill_tokens == 0 {
            self.knee.add(decoded, secs);
            if self.stats.steps.is_multiple_of(64)
                && let Some(k) = self.knee.knee(self.cfg.sched.max_num_seqs)
            {
                self.last_knee = k as u32;
            }
        }
        self.stats.step.add(
            self.plan.num_prefill_tokens as f64,
            decode_context as f64,
            secs,
            queued as f64,
        );
        Ok(&self.out)
    }

    /// Computes the grammar masks of the constrained sequences that draw a token in this
    /// step, in parallel over the backend's threads (each mask is one sequence's work; the
    /// unconstrained path does nothing here).
    fn prepare_masks(&mut self) {
        let Some(pool) = self.backend.pool().filter(|p| p.n_threads() > 1) else { return };
        let sampling = self
            .plan
            .chunks
            .iter()
            .filter(|c| c.logits)
            .map(|c| c.seq)
            .chain(self.pending_forks.iter().map(|&(s, _)| s));
        let mut wanted = 0;
        for sid in sampling.clone() {
            wanted +=
                usize::from(self.states[sid].as_ref().is_some_and(|s| s.constraint.is_some()));
        }
        if wanted < 2 {
            return; // one mask: computed where it is applied
        }
        let mut mine: Vec<std::sync::Mutex<&mut SeqConstraint>> = Vec::with_capacity(wanted);
        for (sid, st) in self.states.iter_mut().enumerate() {
            if let Some(cs) = st.as_mut().and_then(|s| s.constraint.as_deref_mut())
                && sampling.clone().any(|s| s == sid)
            {
                mine.push(std::sync::Mutex::new(cs));
            }
        }
        let n = mine.len();
        pool.run(&|i, nt| {
            for j in kvx_kernels::par::split_range(n, i, nt, 1) {
                if let Ok(mut cs) = mine[j].lock() {
                    cs.prepare();
                }
            }
        });
    }

    /// Scores the prompt tokens that the rows of a scored chunk (from row `first_row` on)
    /// predict and that were not scored before (a preempted prompt is computed again), as
    /// one event.
    fn score_prompt(&mut self, c: &crate::scheduler::Chunk, first_row: usize) {
        let n_vocab = self.backend.n_vocab();
        let (Some(st), Some(seq)) = (self.states[c.seq].as_mut(), self.sched.seq(c.seq)) else {
            return;
        };
        let Some(n) = st.prompt_logprobs else { return };
        let start = st.next_score;
        let prompt_start = self.out.prompt.len();
        for j in 0..c.len {
            // The row of position p predicts token p + 1.
            let next = c.start + j + 1;
            if next != st.next_score || next >= seq.prompt_len {
                continue;
            }
            let r = first_row + j;
            let row = &self.logits[r * n_vocab..(r + 1) * n_vocab];
            let logprob = self.sampler.score(row, seq.tokens[next], n as usize, &mut self.top_buf);
            let top_start = self.out.top.len();
            self.out
                .top
                .extend(self.top_buf.iter().map(|&(token, logprob)| TopLogprob { token, logprob }));
            self.out.prompt.push(PromptScore { logprob, top: top_start..self.out.top.len() });
            st.next_score += 1;
        }
        if self.out.prompt.len() == prompt_start {
            return;
        }
        self.out.events.push(SeqEvent {
            prompt: prompt_start..self.out.prompt.len(),
            prompt_start: start as u32,
            ..SeqEvent::bare(st.id, usage_of(seq, 0))
        });
    }

    /// Time since a request arrived (for queue-time metrics).
    pub fn age(&self, id: RequestId) -> Option<std::time::Duration> {
        let sid = *self.by_id.get(&id)?;
        self.states[sid].as_ref().map(|s| s.arrival.elapsed())
    }
}

/// Reuses a chunk vector's allocation under a new lifetime (the vector is emptied first;
/// the in-place `collect` keeps the buffer).
fn recycle<'a, 'b>(mut v: Vec<SeqChunk<'a>>) -> Vec<SeqChunk<'b>> {
    v.clear();
    v.into_iter().map(|_| -> SeqChunk<'b> { unreachable!("the vector is empty") }).collect()
}

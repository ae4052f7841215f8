//! The sans-IO scheduler: continuous batching over the block pool.
//!
//! Each step [`Scheduler::schedule`] picks the work of one forward pass under a token budget:
//! first every running sequence (a decode token, or the next chunk of its prompt), then
//! waiting requests in arrival order (FCFS) with their uncached prompt tokens, chunked when
//! the budget is smaller than the prompt. New requests reuse every full block whose sequence
//! hash is already cached, and a request whose next uncached prompt block is being computed
//! in this very step by another sequence (a shared system prompt in a burst of requests)
//! waits one step for it instead of computing it again. When blocks run out, the most
//! recently admitted running sequence is preempted: its blocks are released (registered ones
//! stay cached, so the recompute is mostly prefix hits) and it goes back to the front of the
//! queue.
//!
//! Disaggregated serving adds two kinds of sequence that wait outside the queues (*parked*):
//! on a decode engine, a sequence [`reserve`](Scheduler::reserve)d with blocks for its whole
//! prompt that waits for a prefill engine to write their KV ([`kv_arrived`]
//! (Scheduler::kv_arrived) then runs it from its last prompt token; [`kv_failed`]
//! (Scheduler::kv_failed) computes it here instead); on a prefill engine, a
//! [`SeqKind::PrefillOnly`] sequence whose prompt (but its last token) is computed, holding
//! its blocks until the transfer is done and the engine removes it.
//!
//! KV tiers below the pool use the same parking: a sequence admitted from the queue whose
//! next blocks after its prefix match lie in host memory or on disk ([`LowerTiers`]) gets
//! pool blocks for them, is parked while they load, and runs from the end of what arrived
//! ([`kv_arrived_upto`](Scheduler::kv_arrived_upto)); loaded tokens count as cached.
//!
//! The scheduler knows nothing about models, threads or sockets: the engine calls
//! `schedule`, runs the forward pass, then `commit` and `append_token`. After construction it
//! allocates only when a request arrives (its token and block vectors, sized for its whole
//! life).

use std::collections::VecDeque;

use kvx_kernels::model::AttnMode;
use kvx_proto::hashing::BlockHasher;
use kvx_proto::{LocalBlockHash, RequestId, SequenceHash};

use crate::block_pool::{BlockId, BlockPool};

/// Index of a sequence in the scheduler.
pub type SeqId = usize;

/// KV tiers below the pool (host memory, disk), as admission sees them: a sequence admitted
/// from the queue whose prompt continues, after the blocks the pool holds, in blocks a tier
/// holds gets pool blocks for them and waits while they are loaded, instead of computing
/// them.
pub trait LowerTiers {
    /// How many of `below` (a sequence's next blocks after those the pool holds, in order)
    /// the tiers hold, from the first. Changes nothing: a sequence that waits for room is
    /// asked again at each step.
    fn probe(&mut self, below: &[(LocalBlockHash, SequenceHash)]) -> usize;
    /// Sequence `id` was admitted (once per admission): it reuses `in_pool` from the pool,
    /// `below` (the blocks after them) were looked up below, and the first `into.len()` of
    /// `below` load into the pool blocks `into`, whose first is the sequence's block
    /// `first` (none load when `into` is empty). The owner reports the end of a load with
    /// [`Scheduler::kv_arrived_upto`] (through the engine).
    fn admitted(
        &mut self,
        id: RequestId,
        in_pool: &[(LocalBlockHash, SequenceHash)],
        below: &[(LocalBlockHash, SequenceHash)],
        first: usize,
        into: &[BlockId],
    );
}

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Sequences in one step at most.
    pub max_num_seqs: usize,
    /// Tokens in one step at most (decode tokens and prefill chunks together).
    pub max_batched_tokens: usize,
    /// Requests waiting for admission at most; more are refused.
    pub max_waiting: usize,
    /// Split prompts longer than the remaining budget across steps.
    pub chunked_prefill: bool,
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
    /// Reuse cached blocks across requests.
    pub prefix_caching: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_size: 16,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_waiting: 1024,
            chunked_prefill: true,
            max_model_len: 8192,
            prefix_caching: true,
        }
    }
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued (new, or preempted).
    Waiting,
    /// Admitted: holds blocks and is scheduled every step.
    Running,
    /// Parked with blocks for its prompt, waiting for their KV from elsewhere.
    AwaitingKv,
    /// A prefill-only sequence whose prompt is computed: parked, holding its blocks.
    Prefilled,
}

/// What a sequence is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqKind {
    /// Compute the prompt, then generate.
    Generate,
    /// Compute the prompt but its last token, then stop (its KV goes to a decode engine).
    PrefillOnly,
}

/// The scheduler's state of one request.
#[derive(Debug)]
pub struct Sequence {
    /// Request id.
    pub id: RequestId,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Prompt length plus the output limit.
    pub max_len: usize,
    /// Block table.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV is in the cache.
    pub computed: usize,
    /// Prompt tokens served by the prefix cache at the first admission (or loaded from a
    /// lower KV tier).
    pub cached_prompt: usize,
    /// Tokens whose KV a parked sequence awaits (it runs from there once they arrive).
    await_end: usize,
    /// Whether tokens loaded from a lower tier count as cached (at its first admission).
    loaded_count_cached: bool,
    /// Whether the KV it awaits comes from a lower tier (not from a prefill engine).
    tier_load: bool,
    /// Times preempted.
    pub preemptions: u32,
    /// Queue state.
    pub status: SeqStatus,
    /// What it is for.
    pub kind: SeqKind,
    /// Its prompt is scored ([`Scheduler::score_prompt`]): every prompt token produces
    /// logits, so it is computed whole (no prefix-cache hits) in chunks of at most
    /// [`SCORE_ROWS`] tokens.
    pub score_prompt: bool,
    hasher: BlockHasher,
    hashes: Vec<(LocalBlockHash, SequenceHash)>,
    registered: usize,
    admitted_once: bool,
}

impl Sequence {
    /// Generated tokens so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// The tokens this sequence computes: all of them, or for a prefill-only sequence the
    /// prompt but its last token (which the decode engine computes for its logits).
    pub fn target(&self) -> usize {
        match self.kind {
            SeqKind::Generate => self.tokens.len(),
            SeqKind::PrefillOnly => self.prompt_len - 1,
        }
    }
}

/// Work of one sequence in a step: tokens `start..start + len` in one attention mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The sequence.
    pub seq: SeqId,
    /// First token position.
    pub start: usize,
    /// Tokens.
    pub len: usize,
    /// llama.cpp's attention path for these tokens.
    pub mode: AttnMode,
    /// Whether the chunk ends at the sequence's last token (its logits are sampled).
    pub logits: bool,
    /// Whether every token of the chunk produces logits (a scored prompt's chunk).
    pub all: bool,
}

impl Chunk {
    /// Rows of logits the chunk produces.
    pub fn rows(&self) -> usize {
        if self.all { self.len } else { usize::from(self.logits) }
    }
}

/// Rows of logits the chunks of scored prompts produce in one step, at most (they bound the
/// chunks of such prompts; the engine's logits buffer holds this many rows beside one per
/// sequence).
pub const SCORE_ROWS: usize = 64;

/// One step's plan (reused across steps).
#[derive(Debug, Default)]
pub struct SchedulerOutput {
    /// Chunks in forward order.
    pub chunks: Vec<Chunk>,
    /// Sequences preempted in this step.
    pub preempted: Vec<SeqId>,
    /// Tokens scheduled.
    pub num_tokens: usize,
    /// Of which prompt (or recomputed) tokens.
    pub num_prefill_tokens: usize,
}

impl SchedulerOutput {
    fn clear(&mut self) {
        self.chunks.clear();
        self.preempted.clear();
        self.num_tokens = 0;
        self.num_prefill_tokens = 0;
    }
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    /// The waiting queue is full.
    #[error("the waiting queue is full ({0} requests)")]
    QueueFull(usize),
    /// Prompt plus output exceed what the engine holds.
    #[error(
        "prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// An empty prompt.
    #[error("the prompt has no tokens")]
    Empty,
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    seqs: Vec<Option<Sequence>>,
    free_slots: Vec<SeqId>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    /// Sequences awaiting KV or holding a finished prefill.
    parked: Vec<SeqId>,
    /// Prefill-only sequences parked by the last commit (the engine reports them).
    prefilled: Vec<SeqId>,
    /// Blocks a transfer may still write, with the time they may be used again.
    quarantine: Vec<(u64, Vec<BlockId>)>,
    new_waiting: usize,
    /// Sequence hashes of the prompt blocks this step completes (capacity reserved: a step
    /// completes at most `max_batched_tokens / block_size + max_num_seqs` blocks).
    in_flight: Vec<SequenceHash>,
}

impl Scheduler {
    /// A scheduler over `n_blocks` KV blocks.
    pub fn new(cfg: SchedulerConfig, n_blocks: usize) -> Self {
        let slots = cfg.max_num_seqs + cfg.max_waiting;
        Scheduler {
            pool: BlockPool::new(n_blocks),
            seqs: (0..slots).map(|_| None).collect(),
            free_slots: (0..slots).rev().collect(),
            waiting: VecDeque::with_capacity(slots),
            running: Vec::with_capacity(cfg.max_num_seqs),
            parked: Vec::with_capacity(slots),
            prefilled: Vec::with_capacity(slots),
            quarantine: Vec::new(),
            new_waiting: 0,
            in_flight: Vec::with_capacity(
                cfg.max_batched_tokens / cfg.block_size.max(1) + cfg.max_num_seqs,
            ),
            cfg,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The block pool (to drain events).
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// A sequence.
    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(id).and_then(Option::as_ref)
    }

    /// Running sequences.
    pub fn running(&self) -> &[SeqId] {
        &self.running
    }

    /// Waiting requests.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether anything is queued or running (parked sequences wait for others).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Sequences parked: awaiting KV, or holding a finished prefill.
    pub fn parked(&self) -> &[SeqId] {
        &self.parked
    }

    /// Prompt tokens admitted or waiting that are not computed yet.
    pub fn queued_prefill_tokens(&self) -> usize {
        self.waiting
            .iter()
            .chain(&self.running)
            .filter_map(|&s| self.seq(s))
            .map(|s| s.target().saturating_sub(s.computed + 1))
            .sum()
    }

    /// Queues a request. `seed` is its block-hash seed (salt).
    pub fn add(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_tokens: usize,
        seed: u64,
    ) -> Result<SeqId, AddError> {
        let sid = self.new_sequence(id, prompt, max_tokens, seed, SeqKind::Generate)?;
        self.waiting.push_back(sid);
        self.new_waiting += 1;
        Ok(sid)
    }

    /// Queues a request that continues after `generated`, tokens it produced on another
    /// worker: the prompt and those tokens are computed (the prompt's in their prompt modes,
    /// the generated ones each in the single-token mode), then generation goes on;
    /// `max_tokens` counts the generated ones.
    pub fn add_resumed(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        generated: &[u32],
        max_tokens: usize,
        seed: u64,
    ) -> Result<SeqId, AddError> {
        let sid = self.new_sequence(id, prompt, max_tokens, seed, SeqKind::Generate)?;
        for &t in generated {
            self.append_token(sid, t);
        }
        self.waiting.push_back(sid);
        self.new_waiting += 1;
        Ok(sid)
    }

    /// Queues a prefill-only request: its prompt but the last token is computed, then it is
    /// parked with its blocks ([`Scheduler::take_prefilled`] names it) until removed.
    pub fn add_prefill_only(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        seed: u64,
    ) -> Result<SeqId, AddError> {
        let sid = self.new_sequence(id, prompt, 0, seed, SeqKind::PrefillOnly)?;
        self.waiting.push_back(sid);
        self.new_waiting += 1;
        Ok(sid)
    }

    /// Marks a queued, never admitted generating sequence as scoring its prompt (see
    /// [`Sequence::score_prompt`]); false if it is not one.
    pub fn score_prompt(&mut self, sid: SeqId) -> bool {
        match self.seqs.get_mut(sid).and_then(Option::as_mut) {
            Some(seq)
                if seq.kind == SeqKind::Generate
                    && seq.status == SeqStatus::Waiting
                    && !seq.admitted_once =>
            {
                seq.score_prompt = true;
                true
            }
            _ => false,
        }
    }

    /// Starts a queued, never admitted sequence from `leader`'s computed prompt (the same
    /// tokens and salt): it takes the leader's full prompt blocks from the prefix cache and a
    /// new block for the partial last one, whose content the caller copies from the
    /// returned `(leader's block, new block)`. It is then running with its prompt computed
    /// (no chunk is planned for it until a token is appended). `None`, with nothing changed,
    /// when that cannot be done (no prefix caching, the leader's prompt is not computed or
    /// differs, no room).
    pub fn fork_from(&mut self, sid: SeqId, leader: SeqId) -> Option<Option<(BlockId, BlockId)>> {
        if !self.cfg.prefix_caching || sid == leader || self.running.len() >= self.cfg.max_num_seqs
        {
            return None;
        }
        let bs = self.cfg.block_size;
        let (l, f) = (self.seq(leader)?, self.seq(sid)?);
        let n = f.prompt_len;
        let full = n / bs;
        if f.status != SeqStatus::Waiting
            || f.admitted_once
            || f.kind != SeqKind::Generate
            || f.score_prompt
            || f.tokens.len() != n
            || l.status != SeqStatus::Running
            || l.computed < n
            || l.tokens.len() < n
            || l.tokens[..n] != f.tokens[..]
            || l.hashes.get(..full) != f.hashes.get(..full)
        {
            return None;
        }
        let src = (n % bs != 0).then(|| l.blocks.get(full).copied()).flatten();
        if n % bs != 0 && src.is_none() {
            return None;
        }
        let hashes: Vec<SequenceHash> = f.hashes[..full].iter().map(|&(_, h)| h).collect();
        let mut blocks = Vec::with_capacity(f.max_len.div_ceil(bs));
        for h in hashes {
            match self.pool.acquire_cached(h) {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        let dst = if blocks.len() == full && src.is_some() { self.pool.allocate() } else { None };
        if blocks.len() < full || (src.is_some() && dst.is_none()) {
            for &b in blocks.iter().rev() {
                self.pool.release(b);
            }
            return None;
        }
        blocks.extend(dst);
        let seq = self.seqs[sid].as_mut()?;
        seq.blocks = blocks;
        seq.computed = n;
        seq.registered = full;
        self.waiting.retain(|&s| s != sid);
        self.admit(sid);
        self.running.push(sid);
        Some(src.zip(dst))
    }

    /// Reserves blocks for the whole prompt of a request at once, reusing cached ones, and
    /// parks it until its KV arrives. `Ok(None)`: no room now (too many sequences, or not
    /// enough free blocks) — nothing is kept, and the caller may [`add`](Self::add) it.
    pub fn reserve(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_tokens: usize,
        seed: u64,
    ) -> Result<Option<SeqId>, AddError> {
        if self.running.len() + self.awaiting() >= self.cfg.max_num_seqs {
            return Ok(None);
        }
        let sid = self.new_sequence(id, prompt, max_tokens, seed, SeqKind::Generate)?;
        self.match_prefix(sid);
        if !self.grow_blocks(sid, prompt.len()) {
            self.unmatch(sid);
            self.seqs[sid] = None;
            self.free_slots.push(sid);
            return Ok(None);
        }
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.status = SeqStatus::AwaitingKv;
            seq.admitted_once = true;
            seq.cached_prompt = seq.computed.min(seq.prompt_len);
            seq.await_end = prompt.len() - 1;
        }
        self.parked.push(sid);
        Ok(Some(sid))
    }

    /// Sequences parked awaiting KV.
    fn awaiting(&self) -> usize {
        self.parked.iter().filter(|&&s| self.status(s) == Some(SeqStatus::AwaitingKv)).count()
    }

    /// The blocks of a parked sequence that its KV goes into: the index of the first one in
    /// its block table (those before are cached here) and the blocks from there up to what
    /// it awaits (for a reservation, the prompt but its last token; empty when the cache had
    /// all of them).
    pub fn reserved(&self, sid: SeqId) -> Option<(usize, &[BlockId])> {
        let seq = self.seq(sid).filter(|s| s.status == SeqStatus::AwaitingKv)?;
        let bs = self.cfg.block_size;
        let first = seq.computed / bs;
        let end = seq.await_end.div_ceil(bs).max(first).min(seq.blocks.len());
        Some((first, &seq.blocks[first..end]))
    }

    /// The KV of a reserved sequence's prompt (all but its last token) is in its blocks: it
    /// runs from its last prompt token on. False if it was not awaiting KV from a prefill
    /// engine.
    pub fn kv_arrived(&mut self, sid: SeqId) -> bool {
        let Some(seq) = self.seq(sid).filter(|s| !s.tier_load) else { return false };
        let end = seq.await_end;
        self.arrive(sid, end, false)
    }

    /// The KV of the first `tokens` of a sequence that [`schedule_with`](Self::schedule_with)
    /// sent to load from a lower tier arrived (whole blocks; fewer than asked when a load
    /// failed part-way): it runs from there, and at its first admission those tokens count
    /// as cached. The blocks past them stay its own and are computed. False if it was not
    /// awaiting KV from a lower tier.
    pub fn kv_arrived_upto(&mut self, sid: SeqId, tokens: usize) -> bool {
        let bs = self.cfg.block_size.max(1);
        let Some(seq) = self.seq(sid).filter(|s| s.tier_load) else { return false };
        let (end, cached) = (tokens.min(seq.await_end) / bs * bs, seq.loaded_count_cached);
        self.arrive(sid, end, cached)
    }

    fn arrive(&mut self, sid: SeqId, end: usize, cached: bool) -> bool {
        if self.status(sid) != Some(SeqStatus::AwaitingKv) {
            return false;
        }
        self.parked.retain(|&s| s != sid);
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.computed = seq.computed.max(end);
            if cached {
                seq.cached_prompt = seq.computed.min(seq.prompt_len);
            }
            seq.status = SeqStatus::Running;
            seq.tier_load = false;
        }
        self.running.push(sid);
        self.register_full(sid);
        true
    }

    /// The KV of a reserved sequence will not come: it is computed here instead, from the
    /// front of the queue. Its blocks past the cached prefix, which a late transfer could
    /// still write, stay out of use until [`release_quarantine`](Self::release_quarantine)
    /// is called with a time at or after `until` (the caller's clock: the scheduler has
    /// none). False if it was not awaiting KV from a prefill engine.
    pub fn kv_failed(&mut self, sid: SeqId, until: u64) -> bool {
        if self.seq(sid).is_none_or(|s| s.tier_load) || !self.quarantine_lent(sid, until) {
            return false;
        }
        self.parked.retain(|&s| s != sid);
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.status = SeqStatus::Waiting;
        }
        self.unmatch(sid);
        self.waiting.push_front(sid);
        true
    }

    /// Removes a sequence as [`remove`](Self::remove) does, keeping the blocks of a reserved
    /// one that a transfer could still write out of use until `until`.
    pub fn cancel(&mut self, sid: SeqId, until: u64) -> Option<Sequence> {
        self.quarantine_lent(sid, until);
        self.remove(sid)
    }

    /// Moves the not-yet-arrived blocks of an awaiting sequence to the quarantine.
    fn quarantine_lent(&mut self, sid: SeqId, until: u64) -> bool {
        let Some(first) = self.reserved(sid).map(|(f, _)| f) else { return false };
        let Some(seq) = self.seqs[sid].as_mut() else { return false };
        let lent = seq.blocks.split_off(first);
        if !lent.is_empty() {
            self.quarantine.push((until, lent));
        }
        true
    }

    /// Frees quarantined blocks whose time has come (`now` on the caller's clock).
    pub fn release_quarantine(&mut self, now: u64) {
        let mut i = 0;
        while i < self.quarantine.len() {
            if self.quarantine[i].0 <= now {
                let (_, blocks) = self.quarantine.swap_remove(i);
                for &b in blocks.iter().rev() {
                    self.pool.release(b);
                }
            } else {
                i += 1;
            }
        }
    }

    /// Blocks kept out of use after a failed or cancelled transfer.
    pub fn quarantined_blocks(&self) -> usize {
        self.quarantine.iter().map(|(_, b)| b.len()).sum()
    }

    /// A prefill-only sequence that the last schedule or commit parked, computed.
    pub fn pop_prefilled(&mut self) -> Option<SeqId> {
        self.prefilled.pop()
    }

    fn status(&self, sid: SeqId) -> Option<SeqStatus> {
        self.seq(sid).map(|s| s.status)
    }

    /// A new sequence in a free slot (in no queue yet).
    fn new_sequence(
        &mut self,
        id: RequestId,
        prompt: &[u32],
        max_tokens: usize,
        seed: u64,
        kind: SeqKind,
    ) -> Result<SeqId, AddError> {
        if prompt.is_empty() {
            return Err(AddError::Empty);
        }
        let mut limit = self.cfg.max_model_len.min(self.pool.capacity() * self.cfg.block_size);
        if !self.cfg.chunked_prefill {
            // Without chunking a whole prompt (and any recompute) must fit one step.
            limit = limit.min(self.cfg.max_batched_tokens);
        }
        if prompt.len() + max_tokens > limit {
            return Err(AddError::TooLong { prompt: prompt.len(), max_tokens, limit });
        }
        if self.new_waiting >= self.cfg.max_waiting {
            return Err(AddError::QueueFull(self.cfg.max_waiting));
        }
        let Some(slot) = self.free_slots.pop() else {
            return Err(AddError::QueueFull(self.cfg.max_waiting));
        };
        if kind == SeqKind::PrefillOnly && prompt.len() < 2 {
            self.free_slots.push(slot);
            return Err(AddError::Empty);
        }
        let max_len = prompt.len() + max_tokens;
        let bs = self.cfg.block_size;
        let mut tokens = Vec::with_capacity(max_len);
        tokens.extend_from_slice(prompt);
        let mut hasher = BlockHasher::new(bs, seed);
        let mut hashes = Vec::with_capacity(max_len / bs + 1);
        hashes.extend(prompt.iter().filter_map(|&t| hasher.push(t)));
        self.seqs[slot] = Some(Sequence {
            id,
            tokens,
            prompt_len: prompt.len(),
            max_len,
            blocks: Vec::with_capacity(max_len.div_ceil(bs)),
            computed: 0,
            cached_prompt: 0,
            await_end: 0,
            loaded_count_cached: false,
            tier_load: false,
            preemptions: 0,
            status: SeqStatus::Waiting,
            kind,
            score_prompt: false,
            hasher,
            hashes,
            registered: 0,
            admitted_once: false,
        });
        Ok(slot)
    }

    /// Plans the next step into `out`.
    pub fn schedule(&mut self, out: &mut SchedulerOutput) {
        self.schedule_with(out, None);
    }

    /// Plans the next step into `out`, loading from `lower` the prompt blocks it holds of the
    /// sequences admitted from the queue (they wait, parked, while their blocks load).
    pub fn schedule_with(
        &mut self,
        out: &mut SchedulerOutput,
        mut lower: Option<&mut (dyn LowerTiers + '_)>,
    ) {
        out.clear();
        self.in_flight.clear();
        let mut budget = self.cfg.max_batched_tokens;
        let mut score_rows = SCORE_ROWS;
        let mut preempted_any = false;

        // Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() {
            let sid = self.running[i];
            let Some(seq) = self.seqs[sid].as_ref() else {
                i += 1;
                continue;
            };
            let remaining = seq.target() - seq.computed;
            if remaining == 0 || budget == 0 {
                i += 1;
                continue;
            }
            let n = if seq.score_prompt && seq.computed < seq.prompt_len {
                remaining.min(budget).min(score_rows)
            } else if self.cfg.chunked_prefill {
                remaining.min(budget)
            } else if remaining <= budget {
                remaining
            } else {
                0
            };
            if n == 0 {
                i += 1;
                continue;
            }
            if seq.score_prompt && seq.computed < seq.prompt_len {
                score_rows -= n;
            }
            let end = seq.computed + n;
            // Make room, preempting the newest running sequences if needed.
            let mut self_preempted = false;
            while !self.grow_blocks(sid, end) {
                let victim = *self.running.last().unwrap_or(&sid);
                self.preempt(victim, out);
                preempted_any = true;
                if victim == sid {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                continue; // `running` shrank; the element at `i` is the next one
            }
            self.emit_chunks(sid, end, out);
            self.note_in_flight(sid, end);
            budget -= n;
            i += 1;
        }

        // Waiting requests, in order, unless this step had to preempt. One whose next
        // uncached prompt block another sequence completes in this step stays queued (in
        // its place) for one step, after which that block is a prefix-cache hit.
        let mut at = 0;
        while !preempted_any && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&sid) = self.waiting.get(at) else { break };
            self.match_prefix(sid);
            let Some(seq) = self.seqs[sid].as_ref() else {
                self.waiting.remove(at);
                continue;
            };
            if self.waits_for_in_flight(seq) {
                self.unmatch(sid);
                at += 1;
                continue;
            }
            match lower.as_deref_mut().and_then(|l| self.onboard(sid, l)) {
                Some(true) => {
                    self.waiting.remove(at);
                    continue;
                }
                Some(false) => {
                    // Not enough free blocks to load into yet: it waits in its place.
                    self.unmatch(sid);
                    break;
                }
                None => {}
            }
            let Some(seq) = self.seqs[sid].as_ref() else { break };
            let remaining = seq.target() - seq.computed;
            if remaining == 0 {
                // A prefill-only prompt the cache holds whole: done at once.
                self.waiting.remove(at);
                self.admit(sid);
                self.tell_admitted(sid, lower.as_deref_mut());
                self.park_prefilled(sid);
                continue;
            }
            let scoring = seq.score_prompt && seq.computed < seq.prompt_len;
            let n = if scoring {
                remaining.min(budget).min(score_rows)
            } else if self.cfg.chunked_prefill {
                remaining.min(budget)
            } else {
                remaining
            };
            if n > budget || n == 0 {
                break;
            }
            if scoring {
                score_rows -= n;
            }
            let end = seq.computed + n;
            if !self.grow_blocks(sid, end) {
                self.unmatch(sid);
                break;
            }
            self.waiting.remove(at);
            self.admit(sid);
            self.tell_admitted(sid, lower.as_deref_mut());
            self.running.push(sid);
            self.emit_chunks(sid, end, out);
            self.note_in_flight(sid, end);
            budget -= n;
        }
    }

    /// The blocks of a sequence a lower tier could load: after its prefix match (the blocks
    /// whose KV it holds, before it computes anything), up to the last full block before the
    /// last token it computes (at least one token is computed, for its logits).
    fn below(&self, seq: &Sequence) -> std::ops::Range<usize> {
        let bs = self.cfg.block_size;
        let max = (seq.target().max(1) - 1).min(seq.tokens.len() - 1) / bs;
        let k = (seq.computed / bs).min(seq.hashes.len());
        k..max.min(seq.hashes.len()).max(k)
    }

    /// Tells `lower` that a sequence admitted to be computed reuses its prefix match.
    fn tell_admitted(&self, sid: SeqId, lower: Option<&mut (dyn LowerTiers + '_)>) {
        let (Some(l), Some(seq)) = (lower, self.seq(sid)) else { return };
        let below = self.below(seq);
        l.admitted(seq.id, &seq.hashes[..below.start], &seq.hashes[below], 0, &[]);
    }

    /// Loads the blocks after a sequence's prefix match that `lower` holds: `None` when it
    /// holds none (compute as usual), `Some(false)` when the pool has no room for them now
    /// or the step has no room for another sequence, `Some(true)` when the sequence is
    /// parked with blocks for them and their load started.
    fn onboard(&mut self, sid: SeqId, lower: &mut (dyn LowerTiers + '_)) -> Option<bool> {
        if !self.cfg.prefix_caching {
            return None;
        }
        let bs = self.cfg.block_size;
        let seq = self.seqs[sid].as_ref().filter(|s| !s.score_prompt)?;
        let below = self.below(seq);
        let k = below.start;
        let n = lower.probe(&seq.hashes[below.clone()]).min(below.len());
        if n == 0 {
            return None;
        }
        let first_admission = !seq.admitted_once;
        if self.running.len() + self.awaiting() >= self.cfg.max_num_seqs
            || !self.grow_blocks(sid, (k + n) * bs)
        {
            return Some(false);
        }
        self.admit(sid);
        let seq = self.seqs[sid].as_mut()?;
        seq.status = SeqStatus::AwaitingKv;
        seq.await_end = (k + n) * bs;
        seq.loaded_count_cached = first_admission;
        seq.tier_load = true;
        let (in_pool, below) = (&seq.hashes[..k], &seq.hashes[below]);
        lower.admitted(seq.id, in_pool, below, k, &seq.blocks[k..k + n]);
        self.parked.push(sid);
        Some(true)
    }

    /// Marks a sequence leaving the queue as admitted.
    fn admit(&mut self, sid: SeqId) {
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.status = SeqStatus::Running;
            if !seq.admitted_once {
                seq.admitted_once = true;
                seq.cached_prompt = seq.computed.min(seq.prompt_len);
                self.new_waiting -= 1;
            }
        }
    }

    /// Parks a prefill-only sequence whose prompt is computed.
    fn park_prefilled(&mut self, sid: SeqId) {
        self.running.retain(|&s| s != sid);
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.status = SeqStatus::Prefilled;
        }
        self.parked.push(sid);
        self.prefilled.push(sid);
    }

    /// Records the prompt blocks of `sid` that its chunk up to `end` completes.
    fn note_in_flight(&mut self, sid: SeqId, end: usize) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs[sid].as_ref() else { return };
        for &(_, h) in seq.hashes.iter().take(end / bs).skip(seq.computed / bs) {
            if self.in_flight.len() == self.in_flight.capacity() {
                break;
            }
            self.in_flight.push(h);
        }
    }

    /// Whether the first prompt block `seq` would compute (after its prefix match) is one
    /// that another sequence completes in this step.
    fn waits_for_in_flight(&self, seq: &Sequence) -> bool {
        let bs = self.cfg.block_size;
        let k = seq.computed / bs;
        // The last prompt token is always computed (for its logits): only blocks before it.
        k < (seq.tokens.len() - 1) / bs
            && seq.kind == SeqKind::Generate
            && seq.hashes.get(k).is_some_and(|&(_, h)| self.in_flight.contains(&h))
    }

    /// Splits `computed..end` of `sid` into chunks of one attention mode each.
    fn emit_chunks(&self, sid: SeqId, end: usize, out: &mut SchedulerOutput) {
        let Some(seq) = self.seqs[sid].as_ref() else { return };
        let mut pos = seq.computed;
        while pos < end {
            let mode = token_mode(seq.prompt_len, pos);
            let mut stop = pos + 1;
            while stop < end && token_mode(seq.prompt_len, stop) == mode {
                stop += 1;
            }
            out.chunks.push(Chunk {
                seq: sid,
                start: pos,
                len: stop - pos,
                mode,
                logits: stop == seq.tokens.len(),
                all: seq.score_prompt && pos < seq.prompt_len,
            });
            let prefill = seq.prompt_len.max(seq.tokens.len() - 1);
            out.num_prefill_tokens += stop.min(prefill).saturating_sub(pos.min(prefill));
            out.num_tokens += stop - pos;
            pos = stop;
        }
    }

    /// Ensures `sid` has blocks for positions `..end`; false if the pool is exhausted
    /// (blocks obtained so far are kept).
    fn grow_blocks(&mut self, sid: SeqId, end: usize) -> bool {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs[sid].as_mut() else { return false };
        while seq.blocks.len() * bs < end {
            match self.pool.allocate() {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Reuses cached blocks for the start of a (re)admitted sequence.
    fn match_prefix(&mut self, sid: SeqId) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs[sid].as_mut() else { return };
        if !seq.blocks.is_empty() || seq.computed > 0 || seq.score_prompt {
            return;
        }
        // At least one token must be computed to get logits.
        let max_blocks = (seq.tokens.len() - 1) / bs;
        for &(_, h) in seq.hashes.iter().take(max_blocks) {
            match self.pool.acquire_cached(h) {
                Some(b) => seq.blocks.push(b),
                None => break,
            }
        }
        seq.computed = seq.blocks.len() * bs;
        seq.registered = seq.blocks.len();
    }

    /// Undoes a prefix match (and any blocks) of a sequence that could not be admitted.
    fn unmatch(&mut self, sid: SeqId) {
        let Some(seq) = self.seqs[sid].as_mut() else { return };
        for &b in seq.blocks.iter().rev() {
            self.pool.release(b);
        }
        seq.blocks.clear();
        seq.computed = 0;
        seq.registered = 0;
    }

    fn preempt(&mut self, sid: SeqId, out: &mut SchedulerOutput) {
        self.running.retain(|&s| s != sid);
        out.chunks.retain(|c| c.seq != sid);
        self.unmatch(sid);
        if let Some(seq) = self.seqs[sid].as_mut() {
            seq.status = SeqStatus::Waiting;
            seq.preemptions += 1;
        }
        self.waiting.push_front(sid);
        out.preempted.push(sid);
    }

    /// Records that the step of `out` ran: advances computed counts and registers blocks
    /// that became full and computed.
    pub fn commit(&mut self, out: &SchedulerOutput) {
        for c in &out.chunks {
            if let Some(seq) = self.seqs[c.seq].as_mut() {
                seq.computed = seq.computed.max(c.start + c.len);
            }
        }
        for c in &out.chunks {
            self.register_full(c.seq);
            if self.seq(c.seq).is_some_and(|s| {
                s.kind == SeqKind::PrefillOnly
                    && s.status == SeqStatus::Running
                    && s.computed >= s.target()
            }) {
                self.park_prefilled(c.seq);
            }
        }
    }

    fn register_full(&mut self, sid: SeqId) {
        if !self.cfg.prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs[sid].as_mut() else { return };
        let full = (seq.computed / bs).min(seq.hashes.len()).min(seq.blocks.len());
        while seq.registered < full {
            let i = seq.registered;
            let parent = if i == 0 { None } else { Some(seq.hashes[i - 1].1) };
            let (local, h) = seq.hashes[i];
            self.pool.register(seq.blocks[i], h, local, parent);
            seq.registered += 1;
        }
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, sid: SeqId, token: u32) {
        if let Some(seq) = self.seqs[sid].as_mut() {
            debug_assert!(seq.tokens.len() < seq.max_len);
            seq.tokens.push(token);
            if let Some(h) = seq.hasher.push(token) {
                seq.hashes.push(h);
            }
        }
    }

    /// Removes a sequence (finished or cancelled) and returns its blocks; works in any state.
    pub fn remove(&mut self, sid: SeqId) -> Option<Sequence> {
        let seq = self.seqs.get_mut(sid)?.take()?;
        if let Some(p) = self.running.iter().position(|&s| s == sid) {
            self.running.remove(p);
        }
        if let Some(p) = self.parked.iter().position(|&s| s == sid) {
            self.parked.remove(p);
        }
        self.prefilled.retain(|&s| s != sid);
        if let Some(p) = self.waiting.iter().position(|&s| s == sid) {
            self.waiting.remove(p);
            if !seq.admitted_once {
                self.new_waiting -= 1;
            }
        }
        for &b in seq.blocks.iter().rev() {
            self.pool.release(b);
        }
        self.free_slots.push(sid);
        Some(seq)
    }

    /// Checks the bookkeeping (tests): every held block is referenced exactly as often as
    /// sequences hold it, queues and slots agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs: Vec<u32> =
            (0..self.pool.capacity()).map(|b| self.pool.pins(b as BlockId)).collect();
        for (_, blocks) in &self.quarantine {
            for &b in blocks {
                refs[b as usize] += 1;
            }
        }
        for seq in self.seqs.iter().flatten() {
            for &b in &seq.blocks {
                refs[b as usize] += 1;
            }
            if seq.computed > seq.tokens.len()
                || seq.blocks.len() * self.cfg.block_size < seq.computed
            {
                return Err(format!(
                    "sequence {:?} computed {} of {} with {} blocks",
                    seq.id,
                    seq.computed,
                    seq.tokens.len(),
                    seq.blocks.len()
                ));
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            if self.pool.refcount(b as u32) != r {
                return Err(format!(
                    "block {b}: refcount {} but held {r} times",
                    self.pool.refcount(b as u32)
                ));
            }
        }
        let live = self.seqs.iter().filter(|s| s.is_some()).count();
        if live != self.running.len() + self.waiting.len() + self.parked.len() {
            return Err(format!(
                "{live} sequences but {} running + {} waiting + {} parked",
                self.running.len(),
                self.waiting.len(),
                self.parked.len()
            ));
        }
        if live + self.free_slots.len() != self.seqs.len() {
            return Err("slot accounting is off".into());
        }
        Ok(())
    }
}

/// Tokens llama.cpp evaluates per prompt batch (llama-cpp-python's default `n_batch`).
pub const PROMPT_BATCH: usize = 512;

/// The attention arithmetic of prompt token `i` of a `len`-token prompt: llama.cpp runs the
/// prompt in batches of [`PROMPT_BATCH`] and a batch of one token takes the single-token path.
pub fn prompt_mode(len: usize, i: usize) -> AttnMode {
    let batch_start = i - i % PROMPT_BATCH;
    let batch_len = (len - batch_start).min(PROMPT_BATCH);
    if batch_len >= 2 { AttnMode::Prefill } else { AttnMode::Decode }
}

/// The attention path of token `pos` of a sequence with a `prompt_len`-token prompt:
/// prompt tokens follow llama.cpp's prompt batches, generated tokens its single-token steps.
pub fn token_mode(prompt_len: usize, pos: usize) -> AttnMode {
    if pos < prompt_len { prompt_mode(prompt_len, pos) } else { AttnMode::Decode }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(budget: usize, seqs: usize) -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            max_num_seqs: seqs,
            max_batched_tokens: budget,
            max_waiting: 8,
            ..Default::default()
        }
    }

    /// Runs one step as the engine would, sampling token `7` for each logits chunk.
    fn step(s: &mut Scheduler, out: &mut SchedulerOutput) {
        s.schedule(out);
        s.commit(out);
        for c in out.chunks.clone() {
            if c.logits {
                s.append_token(c.seq, 7);
            }
        }
    }

    #[test]
    fn prompt_modes_follow_llama_cpp_batches() {
        assert_eq!(prompt_mode(1, 0), AttnMode::Decode);
        assert_eq!(prompt_mode(2, 0), AttnMode::Prefill);
        assert_eq!(prompt_mode(2, 1), AttnMode::Prefill);
        assert_eq!(prompt_mode(513, 511), AttnMode::Prefill);
        assert_eq!(prompt_mode(513, 512), AttnMode::Decode);
        assert_eq!(prompt_mode(514, 513), AttnMode::Prefill);
        assert_eq!(token_mode(3, 3), AttnMode::Decode);
    }

    #[test]
    fn a_prefill_only_sequence_computes_all_but_the_last_prompt_token_then_parks() {
        let mut s = Scheduler::new(cfg(8, 4), 16);
        let a = s.add_prefill_only(RequestId(1), &[3; 18], 0).unwrap();
        let mut out = SchedulerOutput::default();
        let mut computed = 0;
        for _ in 0..4 {
            step(&mut s, &mut out);
            assert!(out.chunks.iter().all(|c| !c.logits), "a prefill-only step samples nothing");
            computed += out.num_tokens;
        }
        assert_eq!(computed, 17);
        assert_eq!((s.pop_prefilled(), s.pop_prefilled()), (Some(a), None));
        let seq = s.seq(a).unwrap();
        assert_eq!((seq.status, seq.computed, seq.blocks.len()), (SeqStatus::Prefilled, 17, 5));
        assert!(!s.has_work());
        s.check_invariants().unwrap();
        s.remove(a);
        assert_eq!(s.pool().active(), 0);
        s.check_invariants().unwrap();
        // One more with the same prompt is a prefix hit, parked without computing anything
        // but its last partial block.
        let b = s.add_prefill_only(RequestId(2), &[3; 18], 0).unwrap();
        step(&mut s, &mut out);
        assert_eq!((out.num_tokens, s.seq(b).unwrap().cached_prompt), (1, 16));
        assert!(s.add_prefill_only(RequestId(3), &[3], 0).is_err(), "one token: nothing to send");
    }

    #[test]
    fn a_reserved_sequence_waits_for_its_kv_then_runs_from_its_last_prompt_token() {
        let mut s = Scheduler::new(cfg(64, 4), 16);
        // Cache the first two blocks.
        let p: Vec<u32> = (0..14).collect();
        let warm = s.add(RequestId(1), &p[..9], 1, 0).unwrap();
        let mut out = SchedulerOutput::default();
        step(&mut s, &mut out);
        s.remove(warm);
        let r = s.reserve(RequestId(2), &p, 3, 0).unwrap().unwrap();
        let (first, dest) = s.reserved(r).unwrap();
        // Blocks 0 and 1 are cached; the prompt but its last token (13 tokens) ends in block 3.
        assert_eq!((first, dest.len()), (2, 2));
        assert_eq!(s.seq(r).unwrap().blocks.len(), 4);
        step(&mut s, &mut out);
        assert!(out.chunks.is_empty(), "an awaiting sequence is not scheduled");
        s.check_invariants().unwrap();
        assert!(s.kv_arrived(r));
        step(&mut s, &mut out);
        assert_eq!(
            out.chunks,
            vec![Chunk {
                seq: r,
                start: 13,
                len: 1,
                mode: AttnMode::Prefill,
                logits: true,
                all: false
            }]
        );
        assert!(s.pool().contains(s.seq(r).unwrap().hashes[2].1), "arrived blocks are cached");
        step(&mut s, &mut out);
        step(&mut s, &mut out);
        assert_eq!(s.seq(r).unwrap().output().len(), 3);
        s.check_invariants().unwrap();
    }

    /// A lower tier holding the blocks whose sequence hashes it was given.
    #[derive(Default)]
    struct Tier {
        held: Vec<SequenceHash>,
        loads: Vec<(RequestId, usize, usize, Vec<BlockId>)>,
        reused: usize,
    }

    impl LowerTiers for Tier {
        fn probe(&mut self, below: &[(LocalBlockHash, SequenceHash)]) -> usize {
            below.iter().take_while(|(_, h)| self.held.contains(h)).count()
        }
        fn admitted(
            &mut self,
            id: RequestId,
            in_pool: &[(LocalBlockHash, SequenceHash)],
            _below: &[(LocalBlockHash, SequenceHash)],
            first: usize,
            into: &[BlockId],
        ) {
            self.reused += in_pool.len();
            if !into.is_empty() {
                self.loads.push((id, first, into.len(), into.to_vec()));
            }
        }
    }

    fn hashes(tokens: &[u32], bs: usize) -> Vec<SequenceHash> {
        let mut h = BlockHasher::new(bs, 0);
        tokens.iter().filter_map(|&t| h.push(t)).map(|(_, s)| s).collect()
    }

    #[test]
    fn a_prefix_a_lower_tier_holds_is_loaded_counts_as_cached_and_the_rest_is_computed() {
        let mut s = Scheduler::new(cfg(64, 4), 16);
        let mut out = SchedulerOutput::default();
        // The pool caches the first block (4 tokens).
        let p: Vec<u32> = (0..22).collect();
        let warm = s.add(RequestId(1), &p[..5], 1, 0).unwrap();
        step(&mut s, &mut out);
        s.remove(warm);
        // The tier holds blocks 1..4, not block 4 (the last full one before token 21).
        let h = hashes(&p, 4);
        let mut tier = Tier { held: vec![h[1], h[2], h[3]], ..Tier::default() };
        let r = s.add(RequestId(2), &p, 2, 0).unwrap();
        s.schedule_with(&mut out, Some(&mut tier));
        assert!(out.chunks.is_empty(), "a loading sequence is not scheduled");
        assert_eq!(tier.reused, 1);
        assert_eq!(tier.loads.len(), 1);
        let (id, first, n, into) = tier.loads[0].clone();
        assert_eq!((id, first, n), (RequestId(2), 1, 3));
        assert_eq!(&s.seq(r).unwrap().blocks[1..4], &into[..]);
        s.check_invariants().unwrap();
        // Two of the three arrived (the third failed its checksum): it runs from token 12.
        assert!(s.kv_arrived_upto(r, 12));
        assert_eq!(s.seq(r).unwrap().cached_prompt, 12, "loaded tokens count as cached");
        step(&mut s, &mut out);
        assert_eq!(out.chunks.iter().map(|c| (c.start, c.len)).collect::<Vec<_>>(), vec![(12, 10)]);
        assert!(!s.kv_arrived_upto(r, 16), "not awaiting any more");
        s.check_invariants().unwrap();
        // A tier load is not a reservation: a prefill engine's word does not end it.
        let p2: Vec<u32> = (100..122).collect();
        let q = s.add(RequestId(5), &p2, 2, 0).unwrap();
        s.remove(r);
        let mut tier = Tier { held: hashes(&p2, 4)[..5].to_vec(), ..Tier::default() };
        s.schedule_with(&mut out, Some(&mut tier));
        assert_eq!(tier.loads.len(), 1);
        assert!(!s.kv_arrived(q) && !s.kv_failed(q, 0), "not a reservation");
        assert!(s.kv_arrived_upto(q, 20));
        s.check_invariants().unwrap();
        // A sequence the tier holds nothing of is computed whole; the tier hears of it.
        let mut s2 = Scheduler::new(cfg(64, 4), 16);
        let mut tier = Tier::default();
        s2.add(RequestId(7), &p, 2, 0).unwrap();
        s2.schedule_with(&mut out, Some(&mut tier));
        assert_eq!(out.chunks.iter().map(|c| c.len).sum::<usize>(), 22);
        assert!(tier.loads.is_empty());
        s2.check_invariants().unwrap();
        // Without room for the blocks to load into, the sequence waits in the queue.
        let mut small = Scheduler::new(cfg(64, 4), 8);
        small.add(RequestId(3), &[9; 22], 2, 0).unwrap();
        step(&mut small, &mut out); // 6 of the 8 blocks in use
        let mut tier = Tier { held: h[..5].to_vec(), ..Tier::default() };
        let q = small.add(RequestId(4), &p, 2, 0).unwrap();
        small.schedule_with(&mut out, Some(&mut tier));
        assert!(tier.loads.is_empty() && small.seq(q).unwrap().status == SeqStatus::Waiting);
        assert_eq!(small.pool().available(), 2, "what it took is back");
        small.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_transfer_computes_here_and_quarantines_the_lent_blocks() {
        let mut s = Scheduler::new(cfg(64, 4), 8);
        let r = s.reserve(RequestId(1), &[5; 20], 2, 0).unwrap().unwrap();
        assert_eq!(s.reserved(r).unwrap().1.len(), 5);
        assert!(s.kv_failed(r, 100));
        assert_eq!(s.quarantined_blocks(), 5);
        s.check_invariants().unwrap();
        // Three blocks are left: the 20-token prompt needs five, so it waits for them.
        let mut out = SchedulerOutput::default();
        step(&mut s, &mut out);
        assert!(out.chunks.is_empty());
        s.release_quarantine(99);
        assert_eq!(s.quarantined_blocks(), 5, "not before its time");
        s.release_quarantine(100);
        assert_eq!(s.quarantined_blocks(), 0);
        step(&mut s, &mut out);
        assert_eq!(out.num_tokens, 20, "computed here, whole");
        s.check_invariants().unwrap();
        // Cancelling an awaiting sequence quarantines its lent blocks too.
        let q = s.reserve(RequestId(2), &[6; 9], 2, 0).unwrap().unwrap();
        assert_eq!(s.reserved(q).unwrap().1.len(), 2);
        assert!(s.cancel(q, 5).is_some());
        assert_eq!(s.quarantined_blocks(), 3, "every block past the cached prefix");
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_reservation_without_room_keeps_nothing() {
        let mut s = Scheduler::new(cfg(64, 2), 8);
        assert!(s.reserve(RequestId(1), &[1; 12], 2, 0).unwrap().is_some());
        assert!(s.reserve(RequestId(2), &[2; 30], 2, 0).unwrap().is_none(), "8 blocks needed");
        assert_eq!(s.pool().active(), 3);
        assert!(s.reserve(RequestId(3), &[3; 4], 2, 0).unwrap().is_some());
        assert!(s.reserve(RequestId(4), &[4; 4], 2, 0).unwrap().is_none(), "max_num_seqs");
        s.check_invariants().unwrap();
    }

    #[test]
    fn chunked_prefill_then_decode() {
        let mut s = Scheduler::new(cfg(8, 4), 16);
        let a = s.add(RequestId(1), &[1; 20], 4, 0).unwrap();
        let mut out = SchedulerOutput::default();
        step(&mut s, &mut out);
        assert_eq!(
            out.chunks,
            vec![Chunk {
                seq: a,
                start: 0,
                len: 8,
                mode: AttnMode::Prefill,
                logits: false,
                all: false
            }]
        );
        step(&mut s, &mut out);
        step(&mut s, &mut out);
        assert_eq!(out.chunks[0].start + out.chunks[0].len, 20);
        assert!(out.chunks[0].logits);
        step(&mut s, &mut out);
        assert_eq!(
            out.chunks,
            vec![Chunk {
                seq: a,
                start: 20,
                len: 1,
                mode: AttnMode::Decode,
                logits: true,
                all: false
            }]
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let mut s = Scheduler::new(cfg(64, 4), 32);
        let prefix: Vec<u32> = (0..16).collect();
        let mut p1 = prefix.clone();
        p1.extend([100, 101]);
        let mut p2 = prefix.clone();
        p2.extend([200, 201, 202]);
        let a = s.add(RequestId(1), &p1, 2, 0).unwrap();
        let mut out = SchedulerOutput::default();
        step(&mut s, &mut out);
        assert_eq!(out.num_tokens, 18);
        let b = s.add(RequestId(2), &p2, 2, 0).unwrap();
        step(&mut s, &mut out);
        let chunk_b = out.chunks.iter().find(|c| c.seq == b).unwrap();
        assert_eq!((chunk_b.start, chunk_b.len), (16, 3), "only the new tokens are computed");
        assert_eq!(s.seq(b).unwrap().cached_prompt, 16);
        assert_eq!(s.seq(a).unwrap().blocks[..4], s.seq(b).unwrap().blocks[..4]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_burst_sharing_a_prefix_computes_it_once() {
        // Three requests arrive together: two share an 8-token (two-block) prefix, the
        // third shares nothing. The first and the third run at once; the second waits one
        // step and then finds the shared blocks cached.
        let mut s = Scheduler::new(cfg(64, 4), 32);
        let prefix: Vec<u32> = (0..8).collect();
        let p1: Vec<u32> = prefix.iter().copied().chain([100, 101]).collect();
        let p2: Vec<u32> = prefix.iter().copied().chain([200, 201, 202]).collect();
        let a = s.add(RequestId(1), &p1, 2, 0).unwrap();
        let b = s.add(RequestId(2), &p2, 2, 0).unwrap();
        let c = s.add(RequestId(3), &[50, 51, 52, 53, 54], 2, 0).unwrap();
        let mut out = SchedulerOutput::default();
        step(&mut s, &mut out);
        let seqs: Vec<SeqId> = out.chunks.iter().map(|ch| ch.seq).collect();
        assert_eq!(seqs, vec![a, c], "the sharer waits while its prefix is computed");
        assert_eq!(s.num_waiting(), 1);
        step(&mut s, &mut out);
        let chunk_b = out.chunks.iter().find(|ch| ch.seq == b).unwrap();
        assert_eq!((chunk_b.start, chunk_b.len), (8, 3), "only the new tokens are computed");
        assert_eq!(s.seq(b).unwrap().cached_prompt, 8);
        assert_eq!(s.seq(a).unwrap().blocks[..2], s.seq(b).unwrap().blocks[..2]);
        s.check_invariants().unwrap();

        // A prompt that is all shared prefix but its last block still computes that block
        // itself only when nothing else does; a one-block prompt never waits.
        let mut s = Scheduler::new(cfg(64, 4), 32);
        let d = s.add(RequestId(4), &[9, 9, 9, 9, 1], 2, 0).unwrap();
        let e = s.add(RequestId(5), &[9, 9, 9, 9], 2, 0).unwrap();
        step(&mut s, &mut out);
        let seqs: Vec<SeqId> = out.chunks.iter().map(|ch| ch.seq).collect();
        assert_eq!(seqs, vec![d, e]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn exhausted_blocks_preempt_the_newest_and_it_recomputes() {
        // 6 blocks of 4 tokens; two sequences of 8-token prompts growing to 16 tokens.
        let mut s = Scheduler::new(cfg(64, 4), 6);
        let a = s.add(RequestId(1), &[1; 8], 8, 0).unwrap();
        let b = s.add(RequestId(2), &[2; 8], 8, 0).unwrap();
        let mut out = SchedulerOutput::default();
        let mut preempted = false;
        for _ in 0..20 {
            step(&mut s, &mut out);
            preempted |= out.preempted.contains(&b);
            s.check_invariants().unwrap();
            for sid in [a, b] {
                if s.seq(sid).is_some_and(|q| q.tokens.len() == q.max_len) {
                    s.remove(sid);
                }
            }
            if !s.has_work() {
                break;
            }
        }
        assert!(preempted, "the newer sequence was preempted");
        assert!(!s.has_work(), "both finished");
        assert_eq!(s.pool().active(), 0);
    }

    #[test]
    fn queue_bounds_and_lengths_are_enforced() {
        let mut s = Scheduler::new(cfg(64, 1), 4);
        assert_eq!(s.add(RequestId(0), &[], 1, 0), Err(AddError::Empty));
        assert!(matches!(
            s.add(RequestId(0), &[1; 10], 10, 0),
            Err(AddError::TooLong { limit: 16, .. })
        ));
        for i in 0..8 {
            s.add(RequestId(i), &[1], 1, 0).unwrap();
        }
        assert_eq!(s.add(RequestId(9), &[1], 1, 0), Err(AddError::QueueFull(8)));
    }

    #[test]
    fn recompute_after_preemption_keeps_generated_tokens_in_decode_mode() {
        let mut s = Scheduler::new(cfg(64, 2), 8);
        let a = s.add(RequestId(1), &[3; 5], 6, 0).unwrap();
        let mut out = SchedulerOutput::default();
        for _ in 0..3 {
            step(&mut s, &mut out);
        }
        // Force a preemption of `a` and readmit it.
        s.preempt(a, &mut out);
        s.schedule(&mut out);
        let modes: Vec<(usize, usize, AttnMode)> =
            out.chunks.iter().map(|c| (c.start, c.len, c.mode)).collect();
        // Block 0 (4 prompt tokens) is a prefix-cache hit; the rest is recomputed.
        assert_eq!(modes, vec![(4, 1, AttnMode::Prefill), (5, 3, AttnMode::Decode)]);
        assert!(out.chunks[1].logits);
    }
}

//! The router: a worker set, the KV index, the active-sequence tracker and the selection
//! policy behind one type.
//!
//! # Cost (KV mode)
//!
//! For a request of `B = ⌈tokens / block_size⌉` blocks and each worker `w` (all in blocks):
//!
//! ```text
//! credit(w)         = Σ_tier tier_credit[tier] · overlap_blocks(w, tier)
//! prefill_blocks(w) = max(B − credit(w), 0) + active_prefill_tokens(w) / block_size
//! decode_blocks(w)  = active_blocks(w) + (B − blocks of the request already active on w)
//! room_penalty(w)   = B if w's free blocks cannot hold the request's blocks not active on w,
//!                     else 0
//! cost(w)           = overlap_weight · (prefill_blocks(w) + room_penalty(w)) + decode_blocks(w)
//! ```
//!
//! The room penalty (with [`RouterConfig::room_penalty`], and only for workers that have sent a
//! load report, which carries the pool size) says that a request which would wait for blocks
//! on a full worker costs at least as much as computing its whole prompt on one with room: a
//! cached prefix keeps its requests on one worker only while that worker can take them.
//!
//! With the default credits (device 1, host 0.9, disk 0.7, remote 0) and weight 1 this is
//! Dynamo's documented `overlap_score_weight · prefill_blocks + decode_blocks`, with per-tier
//! credits (kvx's defaults, measured: see [`TierCredits`]). Active load is the router's own prediction ([`ActiveSequences`]) or, when
//! [`RouterConfig::use_load_reports`] is set, the larger of that and the worker's last
//! [`LoadReport`] (which also sees other routers' traffic and output blocks).
//!
//! Temperature 0 picks the cheapest worker (uniform tie-break); a positive temperature samples
//! from a softmax over min-max-normalized costs (see [`crate::select`]).

use std::time::Duration;

use kvx_proto::hashing::seed_for;
use kvx_proto::{
    BlockHasher, KvEvent, LoadReport, LocalBlockHash, RequestId, SequenceHash, WorkerId,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{ConfigError, RouteError};
use crate::index::{
    ApplyResult, IndexConfig, IndexStats, KvIndex, OverlapScores, ResyncReport, SnapshotBlock,
    TIERS,
};
use crate::metrics::RouterMetrics;
use crate::select::{pick_min, pick_softmax};
use crate::tracker::{ActiveSequences, TrackError, WorkerLoad};

/// How the router picks a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoutingMode {
    /// KV-aware: lowest cost (or softmax over costs).
    #[default]
    Kv,
    /// Each worker in turn (by worker id).
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// The least loaded worker by [`RouterConfig::least_loaded_by`]; ties at random.
    LeastLoaded,
}

/// The load measure of [`RoutingMode::LeastLoaded`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadMetric {
    /// Active KV blocks.
    #[default]
    ActiveBlocks,
    /// Requests in flight.
    ActiveRequests,
}

/// What a cached block in each tier is worth, as a fraction of recomputing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierCredits {
    /// G1, the engine's own pool.
    pub device: f64,
    /// G2, host memory.
    pub host: f64,
    /// G3, local disk.
    pub disk: f64,
    /// G4, a remote store.
    pub remote: f64,
}

impl Default for TierCredits {
    /// A block's credit is what loading it saves: 1 − load time / compute time. Measured on
    /// the CPU engine (kvbm's metrics, SmolLM2-135M, 2 vCPU, bench/TIERS.md): a 16-token
    /// block computes in ~38 ms and loads from host memory in ~0.03 ms, from disk in ~0.2 ms
    /// — 0.99+ both; the defaults keep a margin for faster engines and slower disks.
    fn default() -> Self {
        TierCredits { device: 1.0, host: 0.9, disk: 0.7, remote: 0.0 }
    }
}

impl TierCredits {
    /// The credits in [`crate::TIER_ORDER`].
    pub fn as_array(&self) -> [f64; TIERS] {
        [self.device, self.host, self.disk, self.remote]
    }
}

/// The router's configuration (plain data; the binary fills it from flags).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// Tokens per KV block (as the workers use).
    pub block_size: usize,
    /// Selection mode.
    pub mode: RoutingMode,
    /// Weight of prefill blocks against decode blocks in the cost (≥ 0).
    pub overlap_weight: f64,
    /// Overlap credit per tier (each in [0, 1]).
    pub tier_credit: TierCredits,
    /// Softmax temperature over normalized costs; 0 = argmin (≥ 0).
    pub temperature: f64,
    /// The measure of least-loaded mode.
    pub least_loaded_by: LoadMetric,
    /// Count a worker's reported load when it exceeds the predicted one.
    pub use_load_reports: bool,
    /// Add the room penalty (see the module docs) for a worker whose free KV blocks (its
    /// reported pool size less its active blocks) cannot hold the request's new blocks.
    pub room_penalty: bool,
    /// Requests older than this are freed by [`Router::expire`].
    pub request_ttl: Duration,
    /// Most requests tracked at once.
    pub max_requests: usize,
    /// Index limits.
    pub index: IndexConfig,
    /// Seed of the router's random choices (tie-breaks, softmax, random mode).
    pub seed: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            block_size: 16,
            mode: RoutingMode::Kv,
            overlap_weight: 1.0,
            tier_credit: TierCredits::default(),
            temperature: 0.0,
            least_loaded_by: LoadMetric::ActiveBlocks,
            use_load_reports: true,
            room_penalty: true,
            request_ttl: Duration::from_secs(300),
            max_requests: 1 << 20,
            index: IndexConfig::default(),
            seed: 0x6b76_785f_726f_7574,
        }
    }
}

impl RouterConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::BlockSize);
        }
        let check = |name, value: f64, min, max| {
            if value.is_finite() && value >= min && value <= max {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange { name, value, min, max })
            }
        };
        check("overlap_weight", self.overlap_weight, 0.0, 1e6)?;
        check("temperature", self.temperature, 0.0, 1e6)?;
        let c = &self.tier_credit;
        check("tier_credit.device", c.device, 0.0, 1.0)?;
        check("tier_credit.host", c.host, 0.0, 1.0)?;
        check("tier_credit.disk", c.disk, 0.0, 1.0)?;
        check("tier_credit.remote", c.remote, 0.0, 1.0)
    }
}

/// A request's blocks: its token count and the local and sequence hashes of its full blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestBlocks {
    tokens: u64,
    locals: Vec<LocalBlockHash>,
    seqs: Vec<SequenceHash>,
}

impl RequestBlocks {
    /// Hashes `tokens` in blocks of `block_size` with `seed` (see [`seed_for`]).
    pub fn from_tokens(tokens: &[u32], block_size: usize, seed: u64) -> Self {
        let hashes = BlockHasher::hash_all(block_size, seed, tokens);
        Self::from_hashes(tokens.len() as u64, &hashes)
    }

    /// From precomputed hashes of the full blocks of a prompt of `tokens` tokens.
    pub fn from_hashes(tokens: u64, hashes: &[(LocalBlockHash, SequenceHash)]) -> Self {
        RequestBlocks {
            tokens,
            locals: hashes.iter().map(|h| h.0).collect(),
            seqs: hashes.iter().map(|h| h.1).collect(),
        }
    }

    /// Prompt tokens.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Local hashes of the full blocks.
    pub fn locals(&self) -> &[LocalBlockHash] {
        &self.locals
    }

    /// Sequence hashes of the full blocks.
    pub fn seqs(&self) -> &[SequenceHash] {
        &self.seqs
    }

    /// Blocks the prompt occupies, the partial last one included.
    pub fn total_blocks(&self, block_size: usize) -> u64 {
        self.tokens.div_ceil(block_size.max(1) as u64).max(self.seqs.len() as u64)
    }
}

/// The router's choice for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Leading blocks of the request cached on it (any tier).
    pub overlap_blocks: u32,
    /// Those blocks by best tier, in [`crate::TIER_ORDER`].
    pub overlap_by_tier: [u32; TIERS],
    /// Its KV cost (computed in every mode, for comparison).
    pub cost: f64,
    /// Prompt tokens it must compute: tokens − cached blocks · block size.
    pub prefill_tokens: u64,
}

/// The terms of one worker's cost for a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PotentialLoad {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks of the request cached on it.
    pub overlap_blocks: u32,
    /// Those blocks by best tier.
    pub overlap_by_tier: [u32; TIERS],
    /// Prefill blocks (after the overlap credit, plus active prefill and the room penalty).
    pub prefill_blocks: f64,
    /// Decode blocks (active plus the request's new ones).
    pub decode_blocks: f64,
    /// Active KV blocks (predicted, or reported if larger and enabled).
    pub active_blocks: u64,
    /// Requests in flight.
    pub active_requests: u64,
    /// `overlap_weight · prefill_blocks + decode_blocks`.
    pub cost: f64,
}

#[derive(Debug, Clone)]
struct WorkerEntry {
    id: WorkerId,
    slot: u32,
    report: Option<LoadReport>,
}

/// The KV-aware router. Single-threaded and pure: callers serialize access and pass time.
#[derive(Debug)]
pub struct Router {
    cfg: RouterConfig,
    credits: [f64; TIERS],
    index: KvIndex,
    tracker: ActiveSequences,
    /// Sorted by id.
    workers: Vec<WorkerEntry>,
    rng: ChaCha8Rng,
    rr_next: usize,
    metrics: RouterMetrics,
    scores: OverlapScores,
    loads: Vec<PotentialLoad>,
    costs: Vec<f64>,
}

impl Router {
    /// A router without workers.
    pub fn new(cfg: RouterConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Router {
            credits: cfg.tier_credit.as_array(),
            index: KvIndex::new(cfg.index.clone()),
            tracker: ActiveSequences::new(cfg.max_requests),
            workers: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            rr_next: 0,
            metrics: RouterMetrics::default(),
            scores: OverlapScores::new(),
            loads: Vec::new(),
            costs: Vec::new(),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Adds a worker (its events are expected from id 1; a running worker's first event then
    /// shows a gap and asks for a resync). Returns false if it was there.
    pub fn add_worker(&mut self, worker: WorkerId) -> bool {
        let Err(pos) = self.workers.binary_search_by_key(&worker, |w| w.id) else {
            return false;
        };
        self.index.add_worker(worker);
        let slot = self.index.slot_of(worker).unwrap_or(u32::MAX);
        self.workers.insert(pos, WorkerEntry { id: worker, slot, report: None });
        true
    }

    /// Removes a worker with its index state and its tracked requests, which are returned
    /// (sorted) so the caller can fail or migrate them. `None` if it was not there.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Option<Vec<RequestId>> {
        let pos = self.workers.binary_search_by_key(&worker, |w| w.id).ok()?;
        self.workers.remove(pos);
        self.index.remove_worker(worker);
        Some(self.tracker.remove_worker(worker))
    }

    /// Registered workers, by id.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().map(|w| w.id)
    }

    /// The request's blocks, hashed with this router's block size and the seed for `salt`
    /// and `lora` (see [`seed_for`]).
    pub fn request_blocks(
        &self,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> RequestBlocks {
        RequestBlocks::from_tokens(tokens, self.cfg.block_size, seed_for(salt, lora))
    }

    /// Applies a KV event from a registered worker.
    pub fn apply_event(&mut self, ev: &KvEvent) -> ApplyResult {
        if self.workers.binary_search_by_key(&ev.worker_id, |w| w.id).is_err() {
            self.metrics.events_unknown_worker += 1;
            return ApplyResult::UnknownWorker { worker: ev.worker_id };
        }
        self.index.apply(ev)
    }

    /// Replaces a registered worker's index state by a snapshot (see [`KvIndex::resync`]).
    pub fn resync(
        &mut self,
        worker: WorkerId,
        last_event_id: u64,
        blocks: &[SnapshotBlock],
    ) -> Result<ResyncReport, RouteError> {
        if self.workers.binary_search_by_key(&worker, |w| w.id).is_err() {
            return Err(RouteError::UnknownWorker(worker));
        }
        Ok(self.index.resync(worker, last_event_id, blocks))
    }

    /// Records a worker's load report. Returns false for an unregistered worker.
    pub fn apply_load(&mut self, report: &LoadReport) -> bool {
        match self.workers.binary_search_by_key(&report.worker_id, |w| w.id) {
            Ok(i) => {
                self.workers[i].report = Some(*report);
                self.metrics.load_reports += 1;
                true
            }
            Err(_) => false,
        }
    }

    /// Fills `self.loads` with every worker's cost terms for `req`.
    fn score(&mut self, req: &RequestBlocks) {
        self.index.find_matches(req.locals(), &mut self.scores);
        let bs = self.cfg.block_size as f64;
        let blocks = req.total_blocks(self.cfg.block_size) as f64;
        self.loads.clear();
        for w in &self.workers {
            let ov = self.scores.by_slot(w.slot);
            let (overlap_blocks, overlap_by_tier) =
                ov.map_or((0, [0; TIERS]), |o| (o.blocks, o.by_tier));
            let credit = ov.map_or(0.0, |o| o.credit(&self.credits));
            let mut load = self.tracker.load(w.id);
            if self.cfg.use_load_reports
                && let Some(r) = &w.report
            {
                load.active_blocks = load.active_blocks.max(r.active_blocks as u64);
                load.prefill_tokens = load.prefill_tokens.max(r.queued_prefill_tokens as u64);
                load.requests = load.requests.max(r.active_seqs as u64 + r.waiting as u64);
            }
            let active_overlap = if load.active_blocks > 0 {
                self.tracker.active_overlap(w.id, req.seqs()) as f64
            } else {
                0.0
            };
            let new_blocks = (blocks - active_overlap).max(0.0);
            let mut prefill_blocks = (blocks - credit).max(0.0) + load.prefill_tokens as f64 / bs;
            if self.cfg.room_penalty
                && let Some(r) = w.report.filter(|r| r.total_blocks > 0)
            {
                // Idle cached blocks count as free, and taking them uses that room up too;
                // only blocks already active on the worker need none.
                let free = (r.total_blocks as f64 - load.active_blocks as f64).max(0.0);
                if new_blocks > free {
                    prefill_blocks += blocks;
                }
            }
            let decode_blocks = load.active_blocks as f64 + new_blocks;
            self.loads.push(PotentialLoad {
                worker: w.id,
                overlap_blocks,
                overlap_by_tier,
                prefill_blocks,
                decode_blocks,
                active_blocks: load.active_blocks,
                active_requests: load.requests,
                cost: self.cfg.overlap_weight * prefill_blocks + decode_blocks,
            });
        }
    }

    /// Every worker's cost terms for `req` (by worker id), as the KV mode sees them.
    pub fn potential_loads(&mut self, req: &RequestBlocks) -> Vec<PotentialLoad> {
        self.score(req);
        self.loads.clone()
    }

    /// Chooses a worker for `req` by the configured mode. Changes only the random state, the
    /// round-robin position and the metrics; call [`add_request`](Self::add_request) (or use
    /// [`route`](Self::route)) to account for the request.
    pub fn select(&mut self, req: &RequestBlocks) -> Result<Decision, RouteError> {
        if self.workers.is_empty() {
            return Err(RouteError::NoWorkers);
        }
        self.score(req);
        let n = self.loads.len();
        let i = match self.cfg.mode {
            RoutingMode::Kv => {
                self.costs.clear();
                self.costs.extend(self.loads.iter().map(|l| l.cost));
                pick_softmax(&self.costs, self.cfg.temperature, &mut self.rng)
            }
            RoutingMode::RoundRobin => {
                let i = self.rr_next % n;
                self.rr_next = i + 1;
                Some(i)
            }
            RoutingMode::Random => Some(self.rng.random_range(0..n)),
            RoutingMode::LeastLoaded => {
                self.costs.clear();
                let by = self.cfg.least_loaded_by;
                self.costs.extend(self.loads.iter().map(|l| match by {
                    LoadMetric::ActiveBlocks => l.active_blocks as f64,
                    LoadMetric::ActiveRequests => l.active_requests as f64,
                }));
                pick_min(&self.costs, &mut self.rng)
            }
        };
        let Some(chosen) = i.and_then(|i| self.loads.get(i)).copied() else {
            return Err(RouteError::NoWorkers);
        };
        let cached = chosen.overlap_blocks as u64;
        let m = &mut self.metrics;
        m.decisions += 1;
        m.requested_blocks += req.seqs().len() as u64;
        m.cached_blocks += cached;
        for (a, &b) in m.cached_blocks_by_tier.iter_mut().zip(&chosen.overlap_by_tier) {
            *a += b as u64;
        }
        Ok(Decision {
            worker: chosen.worker,
            overlap_blocks: chosen.overlap_blocks,
            overlap_by_tier: chosen.overlap_by_tier,
            cost: chosen.cost,
            prefill_tokens: req.tokens().saturating_sub(cached * self.cfg.block_size as u64),
        })
    }

    /// Starts tracking `request` on `worker`, with `overlap_blocks` of it cached there (its
    /// uncached tokens count as prefill load until [`mark_prefill_done`](Self::mark_prefill_done)).
    pub fn add_request(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        req: &RequestBlocks,
        overlap_blocks: u32,
        now: Duration,
    ) -> Result<(), RouteError> {
        if self.workers.binary_search_by_key(&worker, |w| w.id).is_err() {
            return Err(RouteError::UnknownWorker(worker));
        }
        let bs = self.cfg.block_size as u64;
        let prefill = req.tokens().saturating_sub(overlap_blocks as u64 * bs);
        let total = req.total_blocks(self.cfg.block_size);
        self.tracker.add(request, worker, req.seqs(), total, prefill, now).map_err(|e| match e {
            TrackError::Duplicate(id) => RouteError::DuplicateRequest(id),
            TrackError::Full(limit) => RouteError::TooManyRequests { limit },
        })
    }

    /// [`select`](Self::select) then [`add_request`](Self::add_request).
    pub fn route(
        &mut self,
        request: RequestId,
        req: &RequestBlocks,
        now: Duration,
    ) -> Result<Decision, RouteError> {
        if self.tracker.worker_of(request).is_some() {
            return Err(RouteError::DuplicateRequest(request));
        }
        let d = self.select(req)?;
        self.add_request(request, d.worker, req, d.overlap_blocks, now)?;
        Ok(d)
    }

    /// The request produced its first token. Returns false for an unknown request.
    pub fn mark_prefill_done(&mut self, request: RequestId) -> bool {
        self.tracker.mark_prefill_done(request)
    }

    /// The request ended. Returns its worker (`None` if unknown; freeing twice is harmless).
    pub fn free(&mut self, request: RequestId) -> Option<WorkerId> {
        self.tracker.free(request)
    }

    /// Frees requests older than the configured time-to-live; returns them, sorted.
    pub fn expire(&mut self, now: Duration) -> Vec<RequestId> {
        let old = self.tracker.expire(now, self.cfg.request_ttl);
        self.metrics.expired_requests += old.len() as u64;
        old
    }

    /// A worker's predicted load (`None` if not registered).
    pub fn load(&self, worker: WorkerId) -> Option<WorkerLoad> {
        self.workers.binary_search_by_key(&worker, |w| w.id).ok().map(|_| self.tracker.load(worker))
    }

    /// Records how long one decision took (measured by the caller).
    pub fn record_decision_latency(&mut self, d: Duration) {
        self.metrics.decision_latency.record(d);
    }

    /// Decision counters.
    pub fn metrics(&self) -> &RouterMetrics {
        &self.metrics
    }

    /// The KV index (read-only).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Sizes of the KV index.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }

    /// The active-sequence tracker (read-only).
    pub fn tracker(&self) -> &ActiveSequences {
        &self.tracker
    }

    /// Registered workers that lost events and need a snapshot.
    pub fn workers_needing_resync(&self) -> Vec<WorkerId> {
        self.index.workers_needing_resync()
    }
}

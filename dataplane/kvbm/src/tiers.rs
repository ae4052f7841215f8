//! A shard's tiers below its engine's pool (G1): host memory (G2) and local disk (G3), with
//! the policy that moves blocks between them. The shard's thread owns a [`Tiers`] and calls
//! it between steps; the bytes move on the mover thread, so no call here waits for a copy.
//!
//! Policy:
//! * **Offload: write-through.** Every block the pool registers is copied to host memory
//!   right away (the shard pins it in the pool until the copy is done); leaving the pool
//!   later then costs nothing. Blocks already below are not copied again (deduplication by
//!   sequence hash in every tier).
//! * **Disk, write-through too** (`min_hits` 0, the default): every registered block is also
//!   written to disk, from the pool (through the mover's staging memory), so a small host
//!   tier never holds back what reaches disk. With `min_hits` > 0 a block goes to disk from
//!   host memory once it has been reused that many times (Dynamo's filter, to spare SSDs).
//!   A failed write stops offload to disk (one warning, a metric); what is on disk stays
//!   readable.
//! * **LRU** within each tier; a request's reuse of a block (in any tier) makes it recent.
//! * **Onboarding.** When the engine admits a request, its prompt blocks after those in the
//!   pool are looked up below ([`Tiers::probe`]); for the leading run found (in host memory,
//!   else on disk) the engine gives pool blocks and [`Tiers::load`] copies it in (disk blocks
//!   through the mover's staging memory, their checksums checked on the way); the engine
//!   runs the request from the end of what arrived ([`Action::Loaded`]). A disk block whose
//!   bytes fail their checksum is dropped and ends the loaded prefix.
//!
//! Every change of what a tier holds is a [`TierEvent`] for the router.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use kvx_proto::{LocalBlockHash, RequestId, SequenceHash, StorageTier, StoredBlock, TierMetrics};
use kvx_xfer::Agent;

use crate::KvbmError;
use crate::disk::{self, DiskFile, DiskLayout, HEADER_BYTES, Header};
use crate::mover::{
    Done, Geometry, Job, LoadItem, MAX_PERSIST, Mover, PersistSrc, PoolLayout, STAGING_BLOCKS,
};
use crate::pool::{BlockMeta, SlotPool, SlotState};

/// Jobs queued to the mover at most (more offloads are skipped; loads are computed).
const JOB_QUEUE: usize = 64;

/// Pool blocks pinned for copies at most, whatever the pool's size.
const MIN_PIN_LIMIT: usize = 256;

/// Settings of a shard's tiers.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Bytes of host memory (G2).
    pub host_bytes: u64,
    /// The disk tier (G3), if any.
    pub disk: Option<DiskConfig>,
    /// A copy not done after this long fails.
    pub timeout: Duration,
}

/// Settings of a disk tier.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directory of the tier's files.
    pub dir: PathBuf,
    /// This shard's file name in it.
    pub file: String,
    /// Bytes of the file.
    pub bytes: u64,
    /// Reuses a block needs before it is written to disk (0: every block).
    pub min_hits: u32,
}

/// What the tiers tell the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierEvent {
    /// A tier holds a block now.
    Stored {
        /// The tier.
        tier: StorageTier,
        /// The block before it.
        parent: Option<SequenceHash>,
        /// The block.
        block: StoredBlock,
    },
    /// A tier dropped a block.
    Removed {
        /// The tier.
        tier: StorageTier,
        /// The block.
        seq_hash: SequenceHash,
    },
}

/// What the shard must do after [`Tiers::poll`] or [`Tiers::flush`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Drop the pin on this pool block (its copy is done, or was not made).
    Unpin(u32),
    /// A request's load ended: its first `blocks` reserved blocks hold their KV.
    Loaded {
        /// The request.
        id: RequestId,
        /// Leading reserved blocks loaded.
        blocks: usize,
    },
}

/// Where a looked-up block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    Host(u32),
    Disk(u32),
}

/// A job in flight.
#[derive(Debug)]
enum Pending {
    Offload(Vec<(u32, u32)>),
    Persist(Vec<(PersistSrc, u32)>),
    Load { id: RequestId, srcs: Vec<Src> },
}

/// A shard's tiers.
pub struct Tiers {
    host: SlotPool,
    disk: Option<SlotPool>,
    min_hits: u32,
    disk_stopped: bool,
    fingerprint: u64,
    block_bytes: u64,
    stamp: u64,
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    next_job: u64,
    pending: HashMap<u64, Pending>,
    offers: Vec<(u32, u32)>,
    persists: Vec<(PersistSrc, u32, Header)>,
    /// Copies in flight (or queued) that read each pinned pool block.
    pool_uses: HashMap<u32, u32>,
    /// Pool blocks pinned for copies at most (half the pool, or [`MIN_PIN_LIMIT`]: at least
    /// what a few steps register, so that only copies lagging behind hit it).
    pin_limit: usize,
    events: Vec<TierEvent>,
    stats: TierMetrics,
    _disk_file: Option<DiskFile>,
}

impl std::fmt::Debug for Tiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiers").field("stats", &self.stats).finish()
    }
}

impl Tiers {
    /// Sets up the tiers of a pool laid out as `pool` in `agent`'s memory: host memory and
    /// the disk file are registered with the agent (peers can read them), the disk file is
    /// scanned for the blocks of `fingerprint` a previous run left (reported as events, so
    /// the router learns them at once), and the mover thread starts.
    pub fn start(
        agent: Arc<Agent>,
        pool: PoolLayout,
        cfg: &TierConfig,
        fingerprint: u64,
    ) -> Result<Tiers, KvbmError> {
        let pad = disk::align_up(pool.block_bytes);
        let host_slots = (cfg.host_bytes / (2 * pad).max(1)) as usize;
        if host_slots == 0 {
            return Err(KvbmError::Config(format!(
                "the host tier must hold at least one block of {} bytes",
                2 * pad
            )));
        }
        let host = agent.alloc_mem(host_slots as u64 * 2 * pad)?;
        let headers = agent.alloc_mem(STAGING_BLOCKS as u64 * HEADER_BYTES)?;
        // Pages are touched as loads from disk use them.
        let staging = agent.alloc_mem(STAGING_BLOCKS as u64 * 2 * pad)?;
        let mut stamp = 1;
        let mut events = Vec::new();
        let (disk, disk_geo, disk_file) = match &cfg.disk {
            None => (None, None, None),
            Some(d) => {
                let layout = DiskLayout::new(pool.block_bytes, d.bytes);
                if layout.slots == 0 {
                    return Err(KvbmError::Config(format!(
                        "the disk tier must hold at least one block of {} bytes",
                        layout.stride()
                    )));
                }
                let file = disk::open(&d.dir, &d.file, &layout)?;
                let found = disk::scan(&file, &layout, fingerprint)?;
                if found.foreign + found.torn > 0 {
                    tracing::info!(
                        foreign = found.foreign,
                        torn = found.torn,
                        "disk KV tier: dropped blocks of another model or layout, and torn ones"
                    );
                }
                stamp = found.blocks.iter().map(|(_, h)| h.stamp).max().unwrap_or(0) + 1;
                let blocks: Vec<(u32, BlockMeta)> =
                    found.blocks.iter().map(|(s, h)| (*s, h.meta())).collect();
                let slots = SlotPool::with_blocks(layout.slots as usize, blocks);
                let ready = slots.ready_blocks().into_iter().map(|(_, m)| (StorageTier::Disk, m));
                for (tier, parent, block) in parents_first(ready.collect()) {
                    events.push(TierEvent::Stored { tier, parent, block });
                }
                let region = agent.register_file(&file.path, 0, layout.file_bytes())?;
                (Some(slots), Some((region, layout)), Some(file))
            }
        };
        let geo = Geometry { pool, host, disk: disk_geo, headers, staging };
        let mover = Mover::new(agent, geo, cfg.timeout)?;
        let (jobs_tx, jobs_rx) = sync_channel(JOB_QUEUE);
        let (done_tx, done_rx) = sync_channel(JOB_QUEUE + 1);
        let thread = std::thread::Builder::new()
            .name("kvx-kvbm".into())
            .spawn(move || mover.run(jobs_rx, done_tx))
            .map_err(|e| KvbmError::Config(format!("starting the KV mover thread: {e}")))?;
        let mut t = Tiers {
            host: SlotPool::new(host_slots),
            min_hits: cfg.disk.as_ref().map_or(0, |d| d.min_hits),
            disk_stopped: false,
            fingerprint,
            block_bytes: pool.block_bytes,
            stamp,
            jobs: Some(jobs_tx),
            done: done_rx,
            thread: Some(thread),
            next_job: 1,
            pending: HashMap::new(),
            offers: Vec::new(),
            persists: Vec::new(),
            pool_uses: HashMap::new(),
            pin_limit: (pool.blocks as usize / 2).max(MIN_PIN_LIMIT),
            events,
            stats: TierMetrics::default(),
            _disk_file: disk_file,
            disk,
        };
        t.refresh_sizes();
        Ok(t)
    }

    /// The pool registered block `block` as `seq_hash`: it is copied to host memory unless
    /// that holds it, and written to disk (from the pool) unless that holds it or waits for
    /// reuses first. True when the shard must pin the block until [`Action::Unpin`].
    pub fn offer(
        &mut self,
        block: u32,
        seq_hash: SequenceHash,
        local_hash: LocalBlockHash,
        parent: Option<SequenceHash>,
    ) -> bool {
        if self.pool_uses.len() >= self.pin_limit {
            // Copies lag far behind (a slow disk): the block is not copied down.
            self.stats.offload_skipped += 1;
            return false;
        }
        let meta = BlockMeta { seq_hash, local_hash, parent, checksum: 0, hits: 0 };
        let mut uses = 0;
        if self.host.find(seq_hash).is_none()
            && let Some((slot, evicted)) = self.host.claim(meta)
        {
            self.evicted(StorageTier::Host, evicted);
            self.offers.push((block, slot));
            uses += 1;
        }
        if self.min_hits == 0 && self.queue_persist(PersistSrc::Pool(block), meta) {
            uses += 1;
        }
        if uses > 0 {
            *self.pool_uses.entry(block).or_insert(0) += uses;
        }
        uses > 0
    }

    /// Takes back an offer not yet flushed (the shard could not pin the block).
    pub fn withdraw(&mut self, block: u32) {
        if let Some(i) = self.offers.iter().position(|&(b, _)| b == block) {
            let (_, slot) = self.offers.swap_remove(i);
            self.host.filled(slot, false);
        }
        if let Some(i) = self.persists.iter().position(|p| p.0 == PersistSrc::Pool(block)) {
            let (_, d, _) = self.persists.swap_remove(i);
            if let Some(disk) = self.disk.as_mut() {
                disk.filled(d, false);
            }
        }
        self.pool_uses.remove(&block);
    }

    /// One copy that read pool block `b` is over: the pin goes with the last one.
    fn release_pool(&mut self, b: u32, out: &mut Vec<Action>) {
        if let Some(n) = self.pool_uses.get_mut(&b) {
            *n -= 1;
            if *n == 0 {
                self.pool_uses.remove(&b);
                out.push(Action::Unpin(b));
            }
        }
    }

    /// Sends the offloads and disk writes gathered since the last flush to the mover.
    pub fn flush(&mut self, out: &mut Vec<Action>) {
        if !self.offers.is_empty() {
            let pairs = std::mem::take(&mut self.offers);
            let id = self.next_job;
            if self.send(Job::Offload { id, pairs: pairs.clone() }) {
                self.pending.insert(id, Pending::Offload(pairs));
            } else {
                for (b, s) in pairs {
                    self.host.filled(s, false);
                    self.release_pool(b, out);
                }
            }
        }
        while !self.persists.is_empty() {
            let n = self.persists.len().min(MAX_PERSIST);
            let items: Vec<(PersistSrc, u32, Header)> = self.persists.drain(..n).collect();
            let slots: Vec<(PersistSrc, u32)> = items.iter().map(|&(s, d, _)| (s, d)).collect();
            let id = self.next_job;
            if self.send(Job::Persist { id, items }) {
                self.pending.insert(id, Pending::Persist(slots));
            } else {
                for (src, d) in slots {
                    self.persisted(src, out);
                    if let Some(disk) = self.disk.as_mut() {
                        disk.filled(d, false);
                    }
                }
            }
        }
    }

    /// How many of `below` (a prompt's blocks after those the engine's pool holds, in
    /// order) a tier holds, from the first. Changes nothing.
    pub fn probe(&self, below: impl IntoIterator<Item = SequenceHash>) -> usize {
        let held = |h| {
            self.host.find_ready(h).is_some()
                || self.disk.as_ref().is_some_and(|d| d.find_ready(h).is_some())
        };
        below.into_iter().take_while(|&h| held(h)).count()
    }

    /// A prompt was admitted: `in_pool` are the hashes of its blocks the engine's pool holds
    /// (reused: where a tier holds them too they count as hits and become recent), `below`
    /// those of the blocks after them, looked up here (counted). Call once per admission.
    pub fn admitted(
        &mut self,
        in_pool: impl IntoIterator<Item = SequenceHash>,
        below: impl IntoIterator<Item = SequenceHash>,
    ) {
        for h in in_pool {
            if let Some(s) = self.host.find_ready(h) {
                self.hit_host(s);
            }
        }
        for h in below {
            self.stats.lookups += 1;
            if let Some(s) = self.host.find_ready(h) {
                self.stats.hits_host += 1;
                self.hit_host(s);
            } else if let Some((d, s)) =
                self.disk.as_mut().and_then(|d| d.find_ready(h).map(|s| (d, s)))
            {
                self.stats.hits_disk += 1;
                d.touch(s);
            } else {
                break;
            }
        }
    }

    /// Loads the blocks `hashes` (a prompt's, in order, as [`Tiers::probe`] found them) into
    /// the pool blocks `into` for request `id` (after [`Tiers::admitted`] counted them);
    /// [`Action::Loaded`] tells how many arrived, from [`Tiers::poll`] (at once, with 0,
    /// when nothing can be loaded).
    pub fn load(
        &mut self,
        id: RequestId,
        hashes: impl IntoIterator<Item = SequenceHash>,
        into: &[u32],
        out: &mut Vec<Action>,
    ) {
        let mut srcs = Vec::with_capacity(into.len());
        let mut items = Vec::with_capacity(into.len());
        for (h, &block) in hashes.into_iter().zip(into) {
            if let Some(s) = self.host.find_ready(h) {
                self.host.pin(s);
                srcs.push(Src::Host(s));
                items.push(LoadItem::Host { slot: s, into: block });
            } else if let Some((d, sum)) = self.disk.as_mut().and_then(|p| {
                let d = p.find_ready(h)?;
                p.pin(d);
                Some((d, p.meta(d)?.checksum))
            }) {
                srcs.push(Src::Disk(d));
                items.push(LoadItem::Disk { slot: d, sum, into: block });
            } else {
                // A block no tier holds ends the prefix: nothing after it is loaded.
                break;
            }
        }
        let job = self.next_job;
        if items.is_empty() || !self.send(Job::Load { id: job, items }) {
            self.end_load(id, &srcs, &[], 0, out);
            return;
        }
        self.pending.insert(job, Pending::Load { id, srcs });
    }

    /// Takes the mover's finished jobs: events, metrics, and what the shard must do.
    pub fn poll(&mut self, out: &mut Vec<Action>) {
        loop {
            let d = match self.done.try_recv() {
                Ok(d) => d,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.fail_all(out);
                    break;
                }
            };
            self.finish(d, out);
        }
        self.flush(out);
        self.refresh_sizes();
    }

    /// Whether copies are in flight (the shard then polls often).
    pub fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Hands the tier events to `f` in order and forgets them.
    pub fn drain_events(&mut self, mut f: impl FnMut(TierEvent)) {
        for e in self.events.drain(..) {
            f(e);
        }
    }

    /// Every block the tiers hold, `(tier, parent, block)`, a parent held in either tier
    /// before its children.
    pub fn snapshot(&self) -> Vec<(StorageTier, Option<SequenceHash>, StoredBlock)> {
        let mut all: Vec<(StorageTier, BlockMeta)> =
            self.host.ready_blocks().into_iter().map(|(_, m)| (StorageTier::Host, m)).collect();
        if let Some(d) = &self.disk {
            all.extend(d.ready_blocks().into_iter().map(|(_, m)| (StorageTier::Disk, m)));
        }
        parents_first(all)
    }

    /// Counters and sizes.
    pub fn metrics(&self) -> TierMetrics {
        self.stats
    }

    fn send(&mut self, job: Job) -> bool {
        let Some(tx) = &self.jobs else { return false };
        match tx.try_send(job) {
            Ok(()) => {
                self.next_job += 1;
                true
            }
            Err(TrySendError::Full(_)) => false,
            Err(TrySendError::Disconnected(_)) => {
                self.jobs = None;
                false
            }
        }
    }

    fn unpin(&mut self, src: Src) {
        match src {
            Src::Host(s) => self.host.unpin(s),
            Src::Disk(s) => {
                if let Some(d) = self.disk.as_mut() {
                    d.unpin(s);
                }
            }
        }
    }

    fn evicted(&mut self, tier: StorageTier, m: Option<BlockMeta>) {
        if let Some(m) = m {
            self.events.push(TierEvent::Removed { tier, seq_hash: m.seq_hash });
        }
    }

    /// A reuse of the block in host slot `s`; it goes to disk once reused often enough.
    fn hit_host(&mut self, s: u32) {
        let hits = self.host.touch(s);
        if self.min_hits > 0
            && hits >= self.min_hits
            && self.host.state(s) == SlotState::Ready
            && let Some(meta) = self.host.meta(s).copied()
            && self.queue_persist(PersistSrc::Host(s), meta)
        {
            self.host.pin(s);
        }
    }

    /// Queues a write of block `meta` to disk from `src` unless the disk holds it (or its
    /// offload stopped); true when queued (the caller pins the source).
    fn queue_persist(&mut self, src: PersistSrc, meta: BlockMeta) -> bool {
        if self.disk_stopped {
            return false;
        }
        let Some(disk) = self.disk.as_mut() else { return false };
        if disk.find(meta.seq_hash).is_some() {
            return false;
        }
        let Some((d, evicted)) = disk.claim(BlockMeta { hits: 0, ..meta }) else { return false };
        self.evicted(StorageTier::Disk, evicted);
        let header = Header {
            fingerprint: self.fingerprint,
            seq_hash: meta.seq_hash,
            local_hash: meta.local_hash,
            parent: meta.parent,
            data_len: 2 * self.block_bytes,
            checksum: 0,
            stamp: self.stamp,
        };
        self.stamp += 1;
        self.persists.push((src, d, header));
        true
    }

    /// A write to disk from `src` is over: its pin goes.
    fn persisted(&mut self, src: PersistSrc, out: &mut Vec<Action>) {
        match src {
            PersistSrc::Pool(b) => self.release_pool(b, out),
            PersistSrc::Host(s) => self.host.unpin(s),
        }
    }

    fn finish(&mut self, d: Done, out: &mut Vec<Action>) {
        match d {
            Done::Offload { id, ok, bytes, secs } => {
                let Some(Pending::Offload(pairs)) = self.pending.remove(&id) else { return };
                self.stats.offload_host_bytes += bytes;
                self.stats.offload_host_seconds += secs;
                for (b, s) in pairs {
                    self.release_pool(b, out);
                    self.host.filled(s, ok);
                    if ok {
                        self.stats.offloaded_host += 1;
                        self.stored(StorageTier::Host, s);
                    }
                }
            }
            Done::Persist { id, results, bytes, secs } => {
                let Some(Pending::Persist(slots)) = self.pending.remove(&id) else { return };
                self.stats.offload_disk_bytes += bytes;
                self.stats.offload_disk_seconds += secs;
                let missing = || Err("no answer from the mover".to_string());
                let results = results.into_iter().chain(std::iter::repeat_with(missing));
                for ((src, d), r) in slots.into_iter().zip(results) {
                    self.persisted(src, out);
                    let Some(disk) = self.disk.as_mut() else { continue };
                    match r {
                        Ok(sum) => {
                            disk.set_checksum(d, sum);
                            disk.filled(d, true);
                            self.stats.offloaded_disk += 1;
                            self.stored_disk(d);
                        }
                        Err(e) => {
                            disk.filled(d, false);
                            self.stats.disk_errors += 1;
                            if !self.disk_stopped {
                                self.disk_stopped = true;
                                self.stats.disk_stopped = true;
                                tracing::warn!(
                                    error = %e,
                                    "writing KV blocks to disk failed: offload to disk stops \
                                     (blocks on disk stay readable; serving goes on)"
                                );
                            }
                        }
                    }
                }
            }
            Done::Load { id, checked, loaded, disk, host } => {
                let Some(Pending::Load { id: req, srcs }) = self.pending.remove(&id) else {
                    return;
                };
                self.stats.onboard_disk_bytes += disk.0;
                self.stats.onboard_disk_seconds += disk.1;
                self.stats.onboard_host_bytes += host.0;
                self.stats.onboard_host_seconds += host.1;
                self.end_load(req, &srcs, &checked, loaded, out);
            }
        }
    }

    /// Ends a load: disk blocks whose bytes failed their checksum are dropped, pins go, and
    /// the shard learns how much arrived. `checked` says per disk block, in order, whether
    /// its bytes matched (`None`: not read).
    fn end_load(
        &mut self,
        id: RequestId,
        srcs: &[Src],
        checked: &[Option<bool>],
        loaded: usize,
        out: &mut Vec<Action>,
    ) {
        let mut checks = checked.iter();
        for (i, &src) in srcs.iter().enumerate() {
            match src {
                Src::Host(s) => {
                    self.host.unpin(s);
                    if i < loaded {
                        self.stats.onboarded_host += 1;
                    }
                }
                Src::Disk(d) => {
                    self.unpin(src);
                    if i < loaded {
                        self.stats.onboarded_disk += 1;
                    }
                    if checks.next() == Some(&Some(false)) {
                        self.stats.checksum_failures += 1;
                        if let Some(m) = self.disk.as_mut().and_then(|p| p.drop_slot(d)) {
                            tracing::warn!(
                                block = m.seq_hash.0,
                                "a KV block on disk failed its checksum: it is computed again"
                            );
                            self.events.push(TierEvent::Removed {
                                tier: StorageTier::Disk,
                                seq_hash: m.seq_hash,
                            });
                        }
                    }
                }
            }
        }
        out.push(Action::Loaded { id, blocks: loaded });
    }

    fn stored(&mut self, tier: StorageTier, s: u32) {
        if let Some(m) = self.host.meta(s) {
            let block = StoredBlock { seq_hash: m.seq_hash, local_hash: m.local_hash };
            self.events.push(TierEvent::Stored { tier, parent: m.parent, block });
        }
    }

    fn stored_disk(&mut self, d: u32) {
        if let Some(m) = self.disk.as_ref().and_then(|p| p.meta(d)) {
            let block = StoredBlock { seq_hash: m.seq_hash, local_hash: m.local_hash };
            self.events.push(TierEvent::Stored {
                tier: StorageTier::Disk,
                parent: m.parent,
                block,
            });
        }
    }

    /// The mover is gone: every job fails (pins dropped, loads end with nothing).
    fn fail_all(&mut self, out: &mut Vec<Action>) {
        self.jobs = None;
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            let d = match &self.pending[&id] {
                Pending::Offload(_) => Done::Offload { id, ok: false, bytes: 0, secs: 0.0 },
                Pending::Persist(s) => Done::Persist {
                    id,
                    results: s.iter().map(|_| Err("the KV mover stopped".into())).collect(),
                    bytes: 0,
                    secs: 0.0,
                },
                Pending::Load { .. } => Done::Load {
                    id,
                    checked: Vec::new(),
                    loaded: 0,
                    disk: (0, 0.0),
                    host: (0, 0.0),
                },
            };
            self.finish(d, out);
        }
    }

    fn refresh_sizes(&mut self) {
        self.stats.host_blocks = self.host.ready() as u64;
        self.stats.host_capacity = self.host.capacity() as u64;
        self.stats.disk_blocks = self.disk.as_ref().map_or(0, |d| d.ready() as u64);
        self.stats.disk_capacity = self.disk.as_ref().map_or(0, |d| d.capacity() as u64);
    }

    /// Checks the slot tables (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.host.check_invariants()?;
        if let Some(d) = &self.disk {
            d.check_invariants()?;
        }
        Ok(())
    }
}

impl Drop for Tiers {
    fn drop(&mut self) {
        // The mover finishes the jobs queued (writes to disk among them) and ends when its
        // queue closes; its answers are taken meanwhile, so that it never waits to send one.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            while !t.is_finished() {
                while self.done.try_recv().is_ok() {}
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = t.join();
        }
    }
}

/// Blocks (with their tier) ordered so that a parent held in the list comes before its
/// children: `(tier, parent, block)`.
fn parents_first<T: Copy>(
    blocks: Vec<(T, BlockMeta)>,
) -> Vec<(T, Option<SequenceHash>, StoredBlock)> {
    let by_hash: HashMap<SequenceHash, Option<SequenceHash>> =
        blocks.iter().map(|(_, m)| (m.seq_hash, m.parent)).collect();
    let depth = |mut p: Option<SequenceHash>| {
        let mut d = 0usize;
        while let Some(h) = p {
            match by_hash.get(&h) {
                Some(&next) if d <= by_hash.len() => {
                    d += 1;
                    p = next;
                }
                _ => break,
            }
        }
        d
    };
    let mut v: Vec<(usize, T, Option<SequenceHash>, StoredBlock)> = blocks
        .iter()
        .map(|&(t, m)| {
            let block = StoredBlock { seq_hash: m.seq_hash, local_hash: m.local_hash };
            (depth(m.parent), t, m.parent, block)
        })
        .collect();
    v.sort_by_key(|&(d, ..)| d);
    v.into_iter().map(|(_, t, p, b)| (t, p, b)).collect()
}

//! The global KV index: a radix tree over block hashes recording which workers hold which
//! prefixes, and in which storage tier, fed by KV events.
//!
//! # Layout
//!
//! Nodes live in one arena (`Vec<Node>`, freed slots reused), addressed by `u32`. A node is
//! one block *position in a prefix*: the root's children are keyed by the first block's
//! [`LocalBlockHash`], their children by the second's, and so on, so a path from the root
//! spells a token prefix. A node keeps one child inline (a chain's next block is found
//! without hashing); its other children sit in one flat hash table of the whole tree keyed by
//! `(parent node, local hash)`: no per-node child containers, no per-node allocation.
//!
//! Which workers hold a node is a bitset over dense worker *slots*, one per tier. The first
//! 64 slots' bits live inside the node (one 64-byte cache line per node); slots beyond 64 use
//! a flat side vector with `words − 1` more words per tier per node, grown when more workers
//! register, so any number of workers works and 64 or fewer cost nothing extra. Prefix
//! matching intersects these bitsets down the path.
//!
//! Each worker has a flat table `sequence hash → (node, tiers)`, which finds the parent of a
//! stored chain and the node of a removed block in O(1) (the engine's sequence hash is an
//! opaque name; matching uses local hashes only). Both tables are `table.rs`'s
//! open-addressing tables: one cache line per lookup in the common case.
//!
//! # Rules
//!
//! * **Event order.** Events of a worker carry `event_id` 1, 2, 3, …. The next expected id is
//!   applied ([`ApplyResult::Applied`]). An id at or below the last one is ignored
//!   ([`ApplyResult::Stale`]). A higher id means events were lost: the event is still applied
//!   (best effort) and the worker is marked as needing a resync ([`ApplyResult::Gap`]) until
//!   [`KvIndex::resync`] replaces its state. Id 1 once events were applied means the worker
//!   restarted: its state is dropped before the event is applied ([`ApplyResult::Restarted`]).
//!   Should it have been a stray duplicate instead, either nothing else had been applied (and
//!   the same state is rebuilt) or the next real event shows up as a gap.
//! * **Unknown parent.** A `Stored` whose parent this worker does not hold (lost, evicted or
//!   never stored) cannot be placed: its blocks are ignored ([`ApplyResult::UnknownParent`]).
//!   The engine cannot reuse such blocks either until the parent returns.
//! * **Idempotence.** Storing a block the worker already holds in that tier changes nothing;
//!   storing it in another tier adds the tier. Removing a block (or tier) the worker does not
//!   hold changes nothing.
//! * **Names and collisions.** A node is named by the sequence hash it was first stored
//!   under. A store that reaches a node under a different name, or names a hash this worker
//!   already holds at another node, is inconsistent (a hash collision or a misbehaving
//!   engine): that block is not recorded (counted in [`IndexCounters::collisions`]); later
//!   blocks of the same event still descend through the node.
//! * **Prefix semantics.** A worker matches `d` blocks of a request when it holds each of the
//!   first `d` blocks' nodes in some tier: a hole ends the match, as it does in the engine's
//!   own prefix cache. Each matched block counts once, in its best tier
//!   (Device > Host > Disk > Remote).
//! * **Garbage collection.** A node nobody holds and without children is freed, and so are
//!   its ancestors that become the same. A held node's unheld ancestors stay (they are needed
//!   to reach it again once the ancestor is stored anew).
//! * **Bounds.** A worker holds at most [`IndexConfig::max_blocks_per_worker`] blocks; further
//!   stores are dropped ([`ApplyResult::CapacityExhausted`]).

use kvx_proto::{
    KvEvent, KvEventData, LocalBlockHash, SequenceHash, StorageTier, StoredBlock, WorkerId,
};

use crate::fast_map::{self, FastMap};
use crate::table::{Slot, Table, mix};

/// Number of storage tiers.
pub const TIERS: usize = 4;

/// The tiers from most to least valuable; [`tier_index`] gives a tier's position here.
pub const TIER_ORDER: [StorageTier; TIERS] =
    [StorageTier::Device, StorageTier::Host, StorageTier::Disk, StorageTier::Remote];

/// Position of a tier in [`TIER_ORDER`] (and in every per-tier array of this crate).
pub fn tier_index(t: StorageTier) -> usize {
    match t {
        StorageTier::Device => 0,
        StorageTier::Host => 1,
        StorageTier::Disk => 2,
        StorageTier::Remote => 3,
    }
}

const ROOT: u32 = 0;
/// Largest arena size (indices are `u32`).
const MAX_NODES: usize = u32::MAX as usize - 1;

/// Limits of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most blocks (sequence hashes, any tiers) recorded per worker.
    pub max_blocks_per_worker: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig { max_blocks_per_worker: 1 << 22 }
    }
}

/// What [`KvIndex::apply`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyResult {
    /// The expected next event; applied.
    Applied,
    /// Events `expected..got` were lost. This one was applied; the worker needs a resync.
    Gap {
        /// The worker.
        worker: WorkerId,
        /// The id that was expected.
        expected: u64,
        /// The id that came.
        got: u64,
    },
    /// An old or duplicate event (`got <= last`); ignored.
    Stale {
        /// The worker.
        worker: WorkerId,
        /// The last applied id.
        last: u64,
        /// The id that came.
        got: u64,
    },
    /// Event id 1 after later ones: the worker restarted. Its old state was dropped and the
    /// event applied.
    Restarted {
        /// The worker.
        worker: WorkerId,
    },
    /// In order, but a `Stored` named a parent this worker does not hold: nothing stored.
    UnknownParent {
        /// The worker.
        worker: WorkerId,
        /// The missing parent.
        parent: SequenceHash,
    },
    /// In order, but the worker is at its block limit: some blocks were not stored.
    CapacityExhausted {
        /// The worker.
        worker: WorkerId,
    },
    /// The worker is not registered with the router; ignored (never returned by the index).
    UnknownWorker {
        /// The worker.
        worker: WorkerId,
    },
}

impl ApplyResult {
    /// Whether the worker's state is now known to be incomplete and should be resynced.
    pub fn needs_resync(&self) -> bool {
        matches!(self, ApplyResult::Gap { .. })
    }
}

/// One block of a worker snapshot, for [`KvIndex::resync`]. Parents come before children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotBlock {
    /// The tier it is stored in.
    pub tier: StorageTier,
    /// The previous block's sequence hash (`None`: the first block of a sequence).
    pub parent: Option<SequenceHash>,
    /// The block.
    pub block: StoredBlock,
}

/// What a resync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResyncReport {
    /// Snapshot blocks recorded.
    pub stored: usize,
    /// Snapshot blocks not recorded (unknown parent, collision, capacity).
    pub skipped: usize,
}

/// Counters of everything the index has seen (monotonic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexCounters {
    /// Events applied (in order, after a gap, or after a restart).
    pub events_applied: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Stale events ignored.
    pub stale: u64,
    /// Restarts detected.
    pub restarts: u64,
    /// `Stored` events whose parent was unknown.
    pub unknown_parent: u64,
    /// Blocks not stored because a worker was at its limit (or the arena was full).
    pub capacity_drops: u64,
    /// Blocks stored again in a tier that already held them.
    pub duplicate_stores: u64,
    /// Blocks not stored because their names were inconsistent.
    pub collisions: u64,
    /// Removals of blocks (or tiers) the worker did not hold.
    pub unknown_removals: u64,
    /// Resyncs performed.
    pub resyncs: u64,
}

/// Sizes of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Tree nodes, root excluded.
    pub nodes: usize,
    /// Registered workers.
    pub workers: usize,
    /// Blocks recorded, summed over workers (a block held by two workers counts twice).
    pub blocks: u64,
    /// Estimated heap bytes of the index (capacities of its tables).
    pub memory_bytes: usize,
}

/// One worker's match against a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlap {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks of the request the worker holds (any tier).
    pub blocks: u32,
    /// Those blocks by their best tier, in [`TIER_ORDER`]; sums to `blocks`.
    pub by_tier: [u32; TIERS],
}

impl Overlap {
    /// `Σ credit[t] · by_tier[t]`: the matched blocks weighted by what a hit in each tier saves.
    pub fn credit(&self, credit: &[f64; TIERS]) -> f64 {
        self.by_tier.iter().zip(credit).map(|(&n, &c)| n as f64 * c).sum()
    }
}

/// Per-worker overlaps of one request, filled by [`KvIndex::find_matches`]. Reusable: keep one
/// and pass it again to avoid allocation.
#[derive(Debug, Clone, Default)]
pub struct OverlapScores {
    entries: Vec<Overlap>,
    entry_slots: Vec<u32>,
    /// Slot → entry index + 1 (0: no overlap).
    by_slot: Vec<u32>,
    cand: Vec<u64>,
}

impl OverlapScores {
    /// Empty scores.
    pub fn new() -> Self {
        Self::default()
    }

    /// Workers with at least one matched block, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Overlap> {
        self.entries.iter()
    }

    /// Number of workers with at least one matched block.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker matched.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The overlap of `worker` (linear in the number of matching workers).
    pub fn get(&self, worker: WorkerId) -> Option<&Overlap> {
        self.entries.iter().find(|o| o.worker == worker)
    }

    /// The largest overlap of any worker.
    pub fn max_blocks(&self) -> u32 {
        self.entries.iter().map(|o| o.blocks).max().unwrap_or(0)
    }

    /// The overlap of the worker in `slot`, in O(1).
    pub(crate) fn by_slot(&self, slot: u32) -> Option<&Overlap> {
        match self.by_slot.get(slot as usize) {
            Some(&i) if i > 0 => self.entries.get(i as usize - 1),
            _ => None,
        }
    }

    fn reset(&mut self, words: usize) {
        for &s in &self.entry_slots {
            if let Some(x) = self.by_slot.get_mut(s as usize) {
                *x = 0;
            }
        }
        self.entries.clear();
        self.entry_slots.clear();
        if self.by_slot.len() < words * 64 {
            self.by_slot.resize(words * 64, 0);
        }
        self.cand.clear();
        self.cand.resize(words, 0);
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut Overlap> {
        match self.by_slot.get(slot as usize) {
            Some(&i) if i > 0 => self.entries.get_mut(i as usize - 1),
            _ => None,
        }
    }
}

/// A tree node: one cache line holding the bitsets of worker slots 0..64 per tier beside the
/// node's links, so a walk or an update touches one line per node.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Node {
    /// Bits of slots 0..64, per tier.
    bits: [u64; TIERS],
    local: u64,
    /// The sequence hash the node was first stored under (its name).
    seq: u64,
    parent: u32,
    children: u32,
    /// Workers holding the node in at least one tier.
    holders: u32,
    /// One child kept here rather than in the edge table (0: none). A chain's next node is
    /// found without a hash lookup; other children are in the edge table.
    first: u32,
}

/// A tree edge: `(parent, local hash) → child`. The root is never a child, so child 0 marks
/// an empty slot.
#[derive(Debug, Clone, Copy)]
struct Edge {
    local: u64,
    parent: u32,
    child: u32,
}

impl Slot for Edge {
    type Key = (u32, u64);
    const EMPTY: Self = Edge { local: 0, parent: 0, child: ROOT };
    fn is_empty(&self) -> bool {
        self.child == ROOT
    }
    fn key(&self) -> (u32, u64) {
        (self.parent, self.local)
    }
    fn hash(&(parent, local): &(u32, u64)) -> u64 {
        mix(local ^ (parent as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
    }
}

/// A worker's hold on one node: the block's sequence hash, its node and a bitmask of tiers.
/// The root is never held, so node 0 marks an empty slot.
#[derive(Debug, Clone, Copy)]
struct Held {
    seq: u64,
    node: u32,
    tiers: u8,
}

impl Slot for Held {
    type Key = u64;
    const EMPTY: Self = Held { seq: 0, node: ROOT, tiers: 0 };
    fn is_empty(&self) -> bool {
        self.node == ROOT
    }
    fn key(&self) -> u64 {
        self.seq
    }
    fn hash(seq: &u64) -> u64 {
        mix(*seq)
    }
}

#[derive(Debug)]
struct WorkerState {
    id: WorkerId,
    lookup: Table<Held>,
    last_event: u64,
    needs_resync: bool,
    by_tier: [u64; TIERS],
}

impl WorkerState {
    fn new(id: WorkerId) -> Self {
        WorkerState {
            id,
            lookup: Table::new(),
            last_event: 0,
            needs_resync: false,
            by_tier: [0; TIERS],
        }
    }
}

/// The arena, the worker bitsets and the edges.
#[derive(Debug)]
struct Tree {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// 64-bit words per tier per node (the first one inline in the node).
    words: usize,
    /// Words 1.. of every node: `[node][tier][word − 1]`; empty while `words == 1`.
    ext: Vec<u64>,
    edges: Table<Edge>,
}

impl Tree {
    fn new() -> Self {
        let root = Node {
            bits: [0; TIERS],
            local: 0,
            seq: 0,
            parent: ROOT,
            children: 0,
            holders: 0,
            first: ROOT,
        };
        Tree {
            nodes: vec![root],
            free_nodes: Vec::new(),
            words: 1,
            ext: Vec::new(),
            edges: Table::new(),
        }
    }

    fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len() - 1
    }

    /// Index in `ext` of word `k ≥ 1` of `node`'s `tier` bitset.
    #[inline]
    fn ext_index(&self, node: u32, tier: usize, k: usize) -> usize {
        (node as usize * TIERS + tier) * (self.words - 1) + k - 1
    }

    /// Word `k` of `node`'s bitsets, per tier.
    #[inline]
    fn words_of(&self, node: u32, k: usize) -> [u64; TIERS] {
        if k == 0 {
            self.nodes[node as usize].bits
        } else {
            std::array::from_fn(|t| self.ext[self.ext_index(node, t, k)])
        }
    }

    #[inline]
    fn word_mut(&mut self, node: u32, tier: usize, slot: u32) -> &mut u64 {
        let k = slot as usize / 64;
        if k == 0 {
            &mut self.nodes[node as usize].bits[tier]
        } else {
            let i = self.ext_index(node, tier, k);
            &mut self.ext[i]
        }
    }

    fn set_bit(&mut self, node: u32, tier: usize, slot: u32) {
        *self.word_mut(node, tier, slot) |= 1u64 << (slot % 64);
    }

    fn clear_bit(&mut self, node: u32, tier: usize, slot: u32) {
        *self.word_mut(node, tier, slot) &= !(1u64 << (slot % 64));
    }

    fn bit(&self, node: u32, tier: usize, slot: u32) -> bool {
        self.words_of(node, slot as usize / 64)[tier] & (1u64 << (slot % 64)) != 0
    }

    /// Makes room for slot numbers below `64 · words`.
    fn grow_words(&mut self, words: usize) {
        if words <= self.words {
            return;
        }
        let (old, new) = (self.words - 1, words - 1);
        let mut ext = vec![0u64; self.nodes.len() * TIERS * new];
        if old > 0 {
            for (row, chunk) in self.ext.chunks_exact(old).enumerate() {
                ext[row * new..row * new + old].copy_from_slice(chunk);
            }
        }
        self.ext = ext;
        self.words = words;
    }

    #[inline]
    fn child(&self, parent: u32, local: u64) -> Option<u32> {
        let p = &self.nodes[parent as usize];
        if p.first != ROOT && self.nodes[p.first as usize].local == local {
            return Some(p.first);
        }
        if p.children > (p.first != ROOT) as u32 {
            self.edges.get(&(parent, local)).map(|e| e.child)
        } else {
            None
        }
    }

    /// The child of `parent` for `local`, created (named `seq`) if absent. `None` when the
    /// arena is full.
    fn child_or_insert(&mut self, parent: u32, local: u64, seq: u64) -> Option<u32> {
        if let Some(c) = self.child(parent, local) {
            return Some(c);
        }
        let node =
            Node { bits: [0; TIERS], local, seq, parent, children: 0, holders: 0, first: ROOT };
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                if self.nodes.len() >= MAX_NODES {
                    return None;
                }
                self.nodes.push(node);
                self.ext.resize(self.nodes.len() * TIERS * (self.words - 1), 0);
                (self.nodes.len() - 1) as u32
            }
        };
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        if p.first == ROOT {
            p.first = id;
        } else {
            self.edges.insert(Edge { local, parent, child: id });
        }
        Some(id)
    }

    /// Frees `node` and then its ancestors while they are unheld leaves.
    fn prune(&mut self, mut node: u32) {
        while node != ROOT {
            let n = self.nodes[node as usize];
            if n.holders > 0 || n.children > 0 {
                return;
            }
            self.free_nodes.push(node);
            let p = &mut self.nodes[n.parent as usize];
            p.children -= 1;
            if p.first == node {
                p.first = ROOT;
            } else {
                self.edges.remove(&(n.parent, n.local));
            }
            node = n.parent;
        }
    }

    /// Drops every tier `slot` holds in `held` (the node may be freed).
    fn release(&mut self, slot: u32, held: Held) {
        for t in 0..TIERS {
            if held.tiers & (1 << t) != 0 {
                self.clear_bit(held.node, t, slot);
            }
        }
        let n = &mut self.nodes[held.node as usize];
        n.holders -= 1;
        self.prune(held.node);
    }
}

/// The radix index over all workers' KV blocks. See the module documentation for the rules.
#[derive(Debug)]
pub struct KvIndex {
    cfg: IndexConfig,
    tree: Tree,
    slots: FastMap<WorkerId, u32>,
    workers: Vec<Option<WorkerState>>,
    counters: IndexCounters,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

/// How a store of one chain ended.
enum StoreEnd {
    Done,
    UnknownParent(SequenceHash),
    Capacity,
}

impl KvIndex {
    /// An empty index.
    pub fn new(cfg: IndexConfig) -> Self {
        KvIndex {
            cfg,
            tree: Tree::new(),
            slots: fast_map::with_capacity(0),
            workers: Vec::new(),
            counters: IndexCounters::default(),
        }
    }

    /// Registers `worker` (expecting event id 1 next). Returns false if it was registered.
    /// [`apply`](Self::apply) registers unknown workers by itself.
    pub fn add_worker(&mut self, worker: WorkerId) -> bool {
        if self.slots.contains_key(&worker) {
            return false;
        }
        self.slot_or_insert(worker);
        true
    }

    /// Drops a worker and everything it holds. Returns false if it was not registered.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(slot) = self.slots.remove(&worker) else {
            return false;
        };
        if let Some(mut ws) = self.workers.get_mut(slot as usize).and_then(Option::take) {
            for held in ws.lookup.take_all() {
                self.tree.release(slot, held);
            }
        }
        true
    }

    /// Whether `worker` is registered.
    pub fn contains_worker(&self, worker: WorkerId) -> bool {
        self.slots.contains_key(&worker)
    }

    /// Registered workers, in slot order.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().flatten().map(|w| w.id)
    }

    /// The dense slot of a registered worker.
    pub(crate) fn slot_of(&self, worker: WorkerId) -> Option<u32> {
        self.slots.get(&worker).copied()
    }

    fn slot_or_insert(&mut self, worker: WorkerId) -> u32 {
        if let Some(&s) = self.slots.get(&worker) {
            return s;
        }
        let slot = match self.workers.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.workers.push(None);
                self.workers.len() - 1
            }
        };
        self.workers[slot] = Some(WorkerState::new(worker));
        self.tree.grow_words(slot / 64 + 1);
        self.slots.insert(worker, slot as u32);
        slot as u32
    }

    /// Applies one event. See the module documentation for the ordering rules.
    pub fn apply(&mut self, ev: &KvEvent) -> ApplyResult {
        let worker = ev.worker_id;
        let slot = self.slot_or_insert(worker);
        let Some(ws) = self.workers[slot as usize].as_mut() else {
            return ApplyResult::UnknownWorker { worker };
        };
        let expected = ws.last_event.saturating_add(1);
        let mut result = ApplyResult::Applied;
        if ev.event_id == expected {
        } else if ev.event_id == 1 && ws.last_event >= 1 {
            self.counters.restarts += 1;
            self.clear_worker(slot);
            result = ApplyResult::Restarted { worker };
        } else if ev.event_id <= ws.last_event {
            self.counters.stale += 1;
            return ApplyResult::Stale { worker, last: ws.last_event, got: ev.event_id };
        } else {
            self.counters.gaps += 1;
            ws.needs_resync = true;
            result = ApplyResult::Gap { worker, expected, got: ev.event_id };
        }
        if let Some(ws) = self.workers[slot as usize].as_mut() {
            ws.last_event = ev.event_id;
        }
        self.counters.events_applied += 1;
        let t = tier_index(ev.tier);
        let end = match &ev.data {
            KvEventData::Stored { parent, blocks } => self.store(slot, t, *parent, blocks),
            KvEventData::Removed { seq_hashes } => {
                self.remove(slot, t, seq_hashes);
                StoreEnd::Done
            }
            KvEventData::Cleared => {
                self.clear_tier(slot, t);
                StoreEnd::Done
            }
        };
        match (result, end) {
            (ApplyResult::Applied, StoreEnd::UnknownParent(parent)) => {
                ApplyResult::UnknownParent { worker, parent }
            }
            (ApplyResult::Applied, StoreEnd::Capacity) => ApplyResult::CapacityExhausted { worker },
            (r, _) => r,
        }
    }

    /// Replaces `worker`'s whole state by a snapshot (blocks listed parents first) taken
    /// after its event `last_event_id`; clears its resync flag. Registers unknown workers.
    pub fn resync(
        &mut self,
        worker: WorkerId,
        last_event_id: u64,
        blocks: &[SnapshotBlock],
    ) -> ResyncReport {
        let slot = self.slot_or_insert(worker);
        self.clear_worker(slot);
        self.counters.resyncs += 1;
        let mut report = ResyncReport::default();
        for b in blocks {
            let before = self.worker_total(slot);
            let _ = self.store(slot, tier_index(b.tier), b.parent, std::slice::from_ref(&b.block));
            if self.worker_total(slot) > before {
                report.stored += 1;
            } else {
                report.skipped += 1;
            }
        }
        if let Some(ws) = self.workers[slot as usize].as_mut() {
            ws.last_event = last_event_id;
            ws.needs_resync = false;
        }
        report
    }

    fn worker_total(&self, slot: u32) -> u64 {
        self.workers[slot as usize].as_ref().map_or(0, |w| w.by_tier.iter().sum())
    }

    /// Whether events of `worker` were lost since its last resync.
    pub fn needs_resync(&self, worker: WorkerId) -> bool {
        self.slot_of(worker)
            .and_then(|s| self.workers[s as usize].as_ref())
            .is_some_and(|w| w.needs_resync)
    }

    /// Workers whose events were lost since their last resync.
    pub fn workers_needing_resync(&self) -> Vec<WorkerId> {
        self.workers.iter().flatten().filter(|w| w.needs_resync).map(|w| w.id).collect()
    }

    /// The last event id applied for `worker`.
    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.slot_of(worker).and_then(|s| self.workers[s as usize].as_ref()).map(|w| w.last_event)
    }

    /// Blocks `worker` holds, per tier in [`TIER_ORDER`].
    pub fn worker_blocks(&self, worker: WorkerId) -> Option<[u64; TIERS]> {
        self.slot_of(worker).and_then(|s| self.workers[s as usize].as_ref()).map(|w| w.by_tier)
    }

    /// Whether `worker` holds the block named `seq` in `tier`.
    pub fn holds(&self, worker: WorkerId, seq: SequenceHash, tier: StorageTier) -> bool {
        let Some(ws) = self.slot_of(worker).and_then(|s| self.workers[s as usize].as_ref()) else {
            return false;
        };
        ws.lookup.get(&seq.0).is_some_and(|h| h.tiers & (1 << tier_index(tier)) != 0)
    }

    /// Event counters.
    pub fn counters(&self) -> &IndexCounters {
        &self.counters
    }

    /// Sizes and estimated memory.
    pub fn stats(&self) -> IndexStats {
        use std::mem::size_of;
        let lookups: usize =
            self.workers.iter().flatten().map(|w| w.lookup.capacity() * size_of::<Held>()).sum();
        let memory_bytes = self.tree.nodes.capacity() * size_of::<Node>()
            + self.tree.ext.capacity() * 8
            + self.tree.free_nodes.capacity() * 4
            + self.tree.edges.capacity() * size_of::<Edge>()
            + self.slots.capacity() * (size_of::<(WorkerId, u32)>() + 1)
            + self.workers.capacity() * size_of::<Option<WorkerState>>()
            + lookups;
        IndexStats {
            nodes: self.tree.live_nodes(),
            workers: self.slots.len(),
            blocks: self.workers.iter().flatten().map(|w| w.by_tier.iter().sum::<u64>()).sum(),
            memory_bytes,
        }
    }

    /// Fills `out` with every worker's overlap with a request whose blocks have these local
    /// hashes. O(blocks matched · words) plus O(workers) for the result.
    pub fn find_matches(&self, locals: &[LocalBlockHash], out: &mut OverlapScores) {
        let w = self.tree.words;
        out.reset(w);
        let mut node = ROOT;
        let mut matched = 0u32;
        for (i, lh) in locals.iter().enumerate() {
            let Some(child) = self.tree.child(node, lh.0) else {
                break;
            };
            let depth = i as u32;
            let mut alive = false;
            for k in 0..w {
                let [dev, host, disk, remote] = self.tree.words_of(child, k);
                let any = dev | host | disk | remote;
                let prev = out.cand[k];
                let now = if i == 0 { any } else { prev & any };
                if i == 0 {
                    let mut bits = now;
                    while bits != 0 {
                        let slot = (k * 64) as u32 + bits.trailing_zeros();
                        bits &= bits - 1;
                        let worker = self.workers[slot as usize].as_ref().map_or(0, |x| x.id);
                        out.entries.push(Overlap { worker, blocks: 0, by_tier: [0; TIERS] });
                        out.entry_slots.push(slot);
                        out.by_slot[slot as usize] = out.entries.len() as u32;
                    }
                } else {
                    let mut dropped = prev & !now;
                    while dropped != 0 {
                        let slot = (k * 64) as u32 + dropped.trailing_zeros();
                        dropped &= dropped - 1;
                        if let Some(e) = out.entry_mut(slot) {
                            e.blocks = depth;
                        }
                    }
                }
                // Blocks whose best tier is below Device (rare): count them per worker.
                let lower = [
                    now & host & !dev,
                    now & disk & !(dev | host),
                    now & remote & !(dev | host | disk),
                ];
                for (t, mut bits) in lower.into_iter().enumerate() {
                    while bits != 0 {
                        let slot = (k * 64) as u32 + bits.trailing_zeros();
                        bits &= bits - 1;
                        if let Some(e) = out.entry_mut(slot) {
                            e.by_tier[t + 1] += 1;
                        }
                    }
                }
                out.cand[k] = now;
                alive |= now != 0;
            }
            if !alive {
                break;
            }
            matched = depth + 1;
            node = child;
        }
        for k in 0..w {
            let mut bits = out.cand[k];
            while bits != 0 {
                let slot = (k * 64) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                if let Some(e) = out.entry_mut(slot) {
                    e.blocks = matched;
                }
            }
        }
        for e in &mut out.entries {
            let lower: u32 = e.by_tier[1..].iter().sum();
            e.by_tier[0] = e.blocks.saturating_sub(lower);
        }
    }

    /// Drops everything `slot` holds but keeps it registered.
    fn clear_worker(&mut self, slot: u32) {
        let Some(ws) = self.workers[slot as usize].as_mut() else {
            return;
        };
        for held in ws.lookup.take_all() {
            self.tree.release(slot, held);
        }
        ws.by_tier = [0; TIERS];
    }

    fn store(
        &mut self,
        slot: u32,
        tier: usize,
        parent: Option<SequenceHash>,
        blocks: &[StoredBlock],
    ) -> StoreEnd {
        let max = self.cfg.max_blocks_per_worker;
        let Some(ws) = self.workers[slot as usize].as_mut() else {
            return StoreEnd::Done;
        };
        // The blocks' table slots are independent of the chain walk below: touching them
        // first lets the processor fetch them in parallel rather than one miss per block.
        ws.lookup.touch(blocks.iter().map(|b| b.seq_hash.0).chain(parent.map(|p| p.0)));
        let mut cur = match parent {
            None => ROOT,
            Some(p) => match ws.lookup.get(&p.0) {
                Some(h) => h.node,
                None => {
                    self.counters.unknown_parent += 1;
                    return StoreEnd::UnknownParent(p);
                }
            },
        };
        let bit = 1u8 << tier;
        let mut end = StoreEnd::Done;
        for b in blocks {
            let seq = b.seq_hash.0;
            let held = ws.lookup.get(&seq).copied();
            if held.is_none() && ws.lookup.len() >= max {
                self.counters.capacity_drops += 1;
                end = StoreEnd::Capacity;
                break;
            }
            let Some(child) = self.tree.child_or_insert(cur, b.local_hash.0, seq) else {
                self.counters.capacity_drops += 1;
                end = StoreEnd::Capacity;
                break;
            };
            let named = self.tree.nodes[child as usize].seq == seq;
            match held {
                _ if !named => self.counters.collisions += 1,
                Some(h) if h.node != child => self.counters.collisions += 1,
                Some(h) if h.tiers & bit != 0 => self.counters.duplicate_stores += 1,
                Some(h) => {
                    ws.lookup.insert(Held { seq, node: child, tiers: h.tiers | bit });
                    self.tree.set_bit(child, tier, slot);
                    ws.by_tier[tier] += 1;
                }
                None => {
                    ws.lookup.insert(Held { seq, node: child, tiers: bit });
                    self.tree.set_bit(child, tier, slot);
                    self.tree.nodes[child as usize].holders += 1;
                    ws.by_tier[tier] += 1;
                }
            }
            cur = child;
        }
        // A node created for a block that was then not recorded would be an unheld leaf.
        self.tree.prune(cur);
        end
    }

    fn remove(&mut self, slot: u32, tier: usize, seqs: &[SequenceHash]) {
        let Some(ws) = self.workers[slot as usize].as_mut() else {
            return;
        };
        let bit = 1u8 << tier;
        for s in seqs {
            let Some(h) = ws.lookup.get_mut(&s.0) else {
                self.counters.unknown_removals += 1;
                continue;
            };
            if h.tiers & bit == 0 {
                self.counters.unknown_removals += 1;
                continue;
            }
            h.tiers &= !bit;
            ws.by_tier[tier] -= 1;
            let held = *h;
            self.tree.clear_bit(held.node, tier, slot);
            if held.tiers == 0 {
                ws.lookup.remove(&s.0);
                self.tree.nodes[held.node as usize].holders -= 1;
                self.tree.prune(held.node);
            }
        }
    }

    fn clear_tier(&mut self, slot: u32, tier: usize) {
        let Some(ws) = self.workers[slot as usize].as_mut() else {
            return;
        };
        let bit = 1u8 << tier;
        let tree = &mut self.tree;
        ws.lookup.retain(|h| {
            if h.tiers & bit == 0 {
                return true;
            }
            h.tiers &= !bit;
            tree.clear_bit(h.node, tier, slot);
            if h.tiers != 0 {
                return true;
            }
            tree.nodes[h.node as usize].holders -= 1;
            tree.prune(h.node);
            false
        });
        ws.by_tier[tier] = 0;
    }

    /// Checks every structural invariant (for tests): tables agree with the bitsets, counts
    /// agree with contents, every live non-root node is held or has children, freed nodes are
    /// clear, edges and parents agree.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let t = &self.tree;
        let n = t.nodes.len();
        let mut free = vec![false; n];
        for &f in &t.free_nodes {
            if f == ROOT || f as usize >= n || free[f as usize] {
                return Err(format!("bad free node {f}"));
            }
            free[f as usize] = true;
        }
        if t.ext.len() != n * TIERS * (t.words - 1) {
            return Err("ext length".into());
        }
        let mut holders = vec![0u32; n];
        let mut children = vec![0u32; n];
        let mut bits = 0u64;
        for (slot, ws) in self.workers.iter().enumerate() {
            let Some(ws) = ws else { continue };
            if self.slots.get(&ws.id) != Some(&(slot as u32)) {
                return Err(format!("slot table disagrees for worker {}", ws.id));
            }
            let mut by_tier = [0u64; TIERS];
            for h in ws.lookup.iter() {
                let seq = h.seq;
                let node = h.node as usize;
                if node == 0 || node >= n || free[node] {
                    return Err(format!("worker {} holds dead node {node}", ws.id));
                }
                if h.tiers == 0 || h.tiers >> TIERS != 0 {
                    return Err(format!("bad tier mask {}", h.tiers));
                }
                if t.nodes[node].seq != seq {
                    return Err(format!("node {node} named {} held as {seq}", t.nodes[node].seq));
                }
                holders[node] += 1;
                for (tier, c) in by_tier.iter_mut().enumerate() {
                    let has = h.tiers & (1 << tier) != 0;
                    if has != t.bit(h.node, tier, slot as u32) {
                        return Err(format!("bit of node {node} tier {tier} slot {slot}"));
                    }
                    *c += has as u64;
                }
            }
            if by_tier != ws.by_tier {
                return Err(format!("worker {} counts {:?} != {:?}", ws.id, ws.by_tier, by_tier));
            }
            bits += by_tier.iter().sum::<u64>();
        }
        if self.slots.len() != self.workers.iter().flatten().count() {
            return Err("slot table size".into());
        }
        let set_bits: u64 =
            t.nodes.iter().flat_map(|n| n.bits).map(|w| w.count_ones() as u64).sum::<u64>()
                + t.ext.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        if set_bits != bits {
            return Err(format!("{set_bits} bits set, {bits} held"));
        }
        let firsts = t.nodes.iter().enumerate().filter(|&(i, node)| !free[i] && node.first != ROOT);
        let firsts: Vec<Edge> = firsts
            .map(|(i, node)| Edge {
                local: t.nodes[node.first as usize].local,
                parent: i as u32,
                child: node.first,
            })
            .collect();
        for &Edge { local, parent, child } in t.edges.iter().chain(&firsts) {
            let c = child as usize;
            if c == 0 || c >= n || free[c] || free[parent as usize] {
                return Err(format!("edge to dead node {c}"));
            }
            if t.nodes[c].parent != parent || t.nodes[c].local != local {
                return Err(format!("edge {parent}->{c} disagrees with the node"));
            }
            children[parent as usize] += 1;
        }
        for i in 1..n {
            if free[i] {
                continue;
            }
            let node = &t.nodes[i];
            if node.holders != holders[i] || node.children != children[i] {
                return Err(format!("node {i} counts {node:?}"));
            }
            if node.holders == 0 && node.children == 0 {
                return Err(format!("node {i} is an unheld leaf"));
            }
            if t.child(node.parent, node.local) != Some(i as u32) {
                return Err(format!("node {i} unreachable from its parent"));
            }
        }
        if t.nodes[0].children != children[0] {
            return Err("root child count".into());
        }
        if t.edges.len() + firsts.len() != t.live_nodes() {
            return Err(format!("{} edges for {} nodes", t.edges.len(), t.live_nodes()));
        }
        if let Some(e) = t.edges.iter().find(|e| t.nodes[e.parent as usize].first == e.child) {
            return Err(format!("edge {}->{} both inline and in the table", e.parent, e.child));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvx_proto::hashing::sequence_hash;
    use kvx_proto::{KvEvent, KvEventData, XXH3_SEED};

    use super::*;

    /// Blocks for a path of local hashes, with chained sequence hashes.
    fn chain(locals: &[u64]) -> Vec<StoredBlock> {
        let mut parent = None;
        locals
            .iter()
            .map(|&l| {
                let seq = sequence_hash(parent, LocalBlockHash(l), XXH3_SEED);
                parent = Some(seq);
                StoredBlock { seq_hash: seq, local_hash: LocalBlockHash(l) }
            })
            .collect()
    }

    fn ev(worker: WorkerId, id: u64, tier: StorageTier, data: KvEventData) -> KvEvent {
        KvEvent { worker_id: worker, event_id: id, tier, data }
    }

    fn stored(
        worker: WorkerId,
        id: u64,
        parent: Option<SequenceHash>,
        b: &[StoredBlock],
    ) -> KvEvent {
        ev(worker, id, StorageTier::Device, KvEventData::Stored { parent, blocks: b.to_vec() })
    }

    fn removed(worker: WorkerId, id: u64, b: &[StoredBlock]) -> KvEvent {
        let seq_hashes = b.iter().map(|b| b.seq_hash).collect();
        ev(worker, id, StorageTier::Device, KvEventData::Removed { seq_hashes })
    }

    fn locals(b: &[StoredBlock]) -> Vec<LocalBlockHash> {
        b.iter().map(|b| b.local_hash).collect()
    }

    fn overlaps(ix: &KvIndex, q: &[LocalBlockHash]) -> Vec<(WorkerId, u32)> {
        let mut out = OverlapScores::new();
        ix.find_matches(q, &mut out);
        let mut v: Vec<_> = out.iter().map(|o| (o.worker, o.blocks)).collect();
        v.sort();
        v
    }

    #[test]
    fn store_and_match_prefixes() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3, 4]);
        let b = chain(&[1, 2, 9]);
        assert_eq!(ix.apply(&stored(7, 1, None, &a)), ApplyResult::Applied);
        assert_eq!(ix.apply(&stored(8, 1, None, &b)), ApplyResult::Applied);
        ix.check_invariants().unwrap();
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(7, 4), (8, 2)]);
        assert_eq!(overlaps(&ix, &locals(&b)), vec![(7, 2), (8, 3)]);
        assert_eq!(overlaps(&ix, &locals(&chain(&[5]))), vec![]);
        assert_eq!(overlaps(&ix, &[]), vec![]);
        assert_eq!(ix.stats().nodes, 5, "shared prefix nodes are shared");
        assert_eq!(ix.stats().blocks, 7);
    }

    #[test]
    fn stored_with_parent_extends_the_chain() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3, 4]);
        ix.apply(&stored(1, 1, None, &a[..2]));
        assert_eq!(ix.apply(&stored(1, 2, Some(a[1].seq_hash), &a[2..])), ApplyResult::Applied);
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 4)]);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn unknown_parent_is_ignored_and_reported() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        let r = ix.apply(&stored(1, 1, Some(a[1].seq_hash), &a[2..]));
        assert_eq!(r, ApplyResult::UnknownParent { worker: 1, parent: a[1].seq_hash });
        assert_eq!(ix.stats().nodes, 0);
        assert_eq!(ix.counters().unknown_parent, 1);
        // Another worker's copy of the parent does not count: the lookup is per worker.
        ix.apply(&stored(2, 1, None, &a[..2]));
        let r = ix.apply(&stored(1, 2, Some(a[1].seq_hash), &a[2..]));
        assert!(matches!(r, ApplyResult::UnknownParent { .. }));
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(2, 2)]);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_stores_are_idempotent() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2]);
        ix.apply(&stored(1, 1, None, &a));
        ix.apply(&stored(1, 2, None, &a));
        ix.apply(&stored(1, 3, Some(a[0].seq_hash), &a[1..]));
        assert_eq!(ix.worker_blocks(1), Some([2, 0, 0, 0]));
        assert_eq!(ix.counters().duplicate_stores, 3);
        assert_eq!(ix.stats().nodes, 2);
        ix.apply(&removed(1, 4, &a[1..]));
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 1)], "one removal undoes the store");
        ix.check_invariants().unwrap();
    }

    #[test]
    fn removal_frees_leaves_and_keeps_held_descendants_reachable() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        ix.apply(&stored(1, 1, None, &a));
        // Evicting the middle block (LRU order) leaves the last one held but unmatched.
        ix.apply(&removed(1, 2, &a[1..2]));
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 1)]);
        assert_eq!(ix.stats().nodes, 3, "the unheld middle node stays: it has a child");
        ix.check_invariants().unwrap();
        // Storing it again restores the full match.
        ix.apply(&stored(1, 3, Some(a[0].seq_hash), &a[1..2]));
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 3)]);
        ix.apply(&removed(1, 4, &a));
        assert_eq!(ix.stats().nodes, 0, "everything freed");
        assert_eq!(ix.worker_blocks(1), Some([0; TIERS]));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn removing_unknown_blocks_changes_nothing() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2]);
        ix.apply(&stored(1, 1, None, &a[..1]));
        ix.apply(&removed(1, 2, &a[1..]));
        let host_removal =
            ev(1, 3, StorageTier::Host, KvEventData::Removed { seq_hashes: vec![a[0].seq_hash] });
        ix.apply(&host_removal);
        assert_eq!(ix.counters().unknown_removals, 2);
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 1)]);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn tiers_count_at_their_best() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3, 4]);
        let host = |id, b: &[StoredBlock], parent| {
            ev(1, id, StorageTier::Host, KvEventData::Stored { parent, blocks: b.to_vec() })
        };
        ix.apply(&host(1, &a, None));
        ix.apply(&stored(1, 2, None, &a[..2]));
        let disk =
            ev(1, 3, StorageTier::Disk, KvEventData::Stored { parent: None, blocks: a.clone() });
        ix.apply(&disk);
        let mut out = OverlapScores::new();
        ix.find_matches(&locals(&a), &mut out);
        let o = out.get(1).copied().unwrap();
        assert_eq!(o.blocks, 4);
        assert_eq!(o.by_tier, [2, 2, 0, 0]);
        assert_eq!(o.credit(&[1.0, 0.75, 0.25, 0.0]), 3.5);
        assert_eq!(ix.worker_blocks(1), Some([2, 4, 4, 0]));
        // Clearing the device tier leaves host copies.
        ix.apply(&ev(1, 4, StorageTier::Device, KvEventData::Cleared));
        ix.find_matches(&locals(&a), &mut out);
        assert_eq!(out.get(1).unwrap().by_tier, [0, 4, 0, 0]);
        ix.apply(&ev(1, 5, StorageTier::Host, KvEventData::Cleared));
        ix.find_matches(&locals(&a), &mut out);
        assert_eq!(out.get(1).unwrap().by_tier, [0, 0, 4, 0]);
        ix.apply(&ev(1, 6, StorageTier::Disk, KvEventData::Cleared));
        assert!(overlaps(&ix, &locals(&a)).is_empty());
        assert_eq!(ix.stats().nodes, 0);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn event_order_gap_stale_restart() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        assert_eq!(ix.apply(&stored(1, 1, None, &a[..1])), ApplyResult::Applied);
        assert_eq!(ix.apply(&stored(1, 2, None, &a[..1])), ApplyResult::Applied);
        assert_eq!(
            ix.apply(&stored(1, 2, None, &a[..1])),
            ApplyResult::Stale { worker: 1, last: 2, got: 2 }
        );
        let r = ix.apply(&stored(1, 4, Some(a[0].seq_hash), &a[1..2]));
        assert_eq!(r, ApplyResult::Gap { worker: 1, expected: 3, got: 4 });
        assert!(r.needs_resync());
        assert!(ix.needs_resync(1));
        assert_eq!(ix.workers_needing_resync(), vec![1]);
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 2)], "applied best effort");
        assert!(matches!(ix.apply(&stored(1, 3, None, &a[..1])), ApplyResult::Stale { .. }));
        assert_eq!(ix.last_event_id(1), Some(4));
        // A restart drops the old state.
        assert_eq!(ix.apply(&stored(1, 1, None, &a[..1])), ApplyResult::Restarted { worker: 1 });
        assert_eq!(ix.worker_blocks(1), Some([1, 0, 0, 0]));
        assert_eq!(ix.counters().gaps, 1);
        assert_eq!(ix.counters().stale, 2);
        assert_eq!(ix.counters().restarts, 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn first_event_of_a_running_worker_is_a_gap() {
        let mut ix = KvIndex::default();
        assert!(ix.add_worker(3));
        assert!(!ix.add_worker(3));
        let r = ix.apply(&stored(3, 17, None, &chain(&[1])));
        assert_eq!(r, ApplyResult::Gap { worker: 3, expected: 1, got: 17 });
        // Event id 0 is never valid.
        assert!(matches!(ix.apply(&stored(4, 0, None, &chain(&[1]))), ApplyResult::Stale { .. }));
    }

    #[test]
    fn resync_replaces_state_and_clears_the_flag() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        let b = chain(&[7, 8]);
        ix.apply(&stored(1, 5, None, &a));
        assert!(ix.needs_resync(1));
        let snap: Vec<SnapshotBlock> = b
            .iter()
            .enumerate()
            .map(|(i, blk)| SnapshotBlock {
                tier: StorageTier::Device,
                parent: if i == 0 { None } else { Some(b[i - 1].seq_hash) },
                block: *blk,
            })
            .chain(std::iter::once(SnapshotBlock {
                tier: StorageTier::Device,
                parent: Some(SequenceHash(12345)),
                block: a[2],
            }))
            .collect();
        let r = ix.resync(1, 40, &snap);
        assert_eq!(r, ResyncReport { stored: 2, skipped: 1 });
        assert!(!ix.needs_resync(1));
        assert!(overlaps(&ix, &locals(&a)).is_empty());
        assert_eq!(overlaps(&ix, &locals(&b)), vec![(1, 2)]);
        assert_eq!(ix.apply(&stored(1, 41, None, &a[..1])), ApplyResult::Applied);
        assert_eq!(ix.counters().resyncs, 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn remove_worker_drops_its_blocks_only() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        ix.apply(&stored(1, 1, None, &a));
        ix.apply(&stored(2, 1, None, &a[..2]));
        assert!(ix.remove_worker(1));
        assert!(!ix.remove_worker(1));
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(2, 2)]);
        assert_eq!(ix.stats().nodes, 2);
        ix.check_invariants().unwrap();
        assert!(ix.remove_worker(2));
        assert_eq!(
            ix.stats(),
            IndexStats { memory_bytes: ix.stats().memory_bytes, ..Default::default() }
        );
    }

    #[test]
    fn name_collisions_do_not_corrupt() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2]);
        ix.apply(&stored(1, 1, None, &a));
        // Worker 2 reaches the same path under other names: not recorded, still descends.
        let odd = vec![
            StoredBlock { seq_hash: SequenceHash(99), local_hash: LocalBlockHash(1) },
            StoredBlock { seq_hash: a[1].seq_hash, local_hash: LocalBlockHash(2) },
        ];
        ix.apply(&stored(2, 1, None, &odd));
        assert_eq!(ix.counters().collisions, 1);
        assert!(ix.holds(2, a[1].seq_hash, StorageTier::Device));
        // Worker 1 names a hash it holds at another node: the first placement wins.
        let moved = vec![StoredBlock { seq_hash: a[1].seq_hash, local_hash: LocalBlockHash(5) }];
        ix.apply(&stored(1, 2, None, &moved));
        assert_eq!(ix.counters().collisions, 2);
        assert_eq!(overlaps(&ix, &locals(&a)), vec![(1, 2)]);
        assert_eq!(ix.stats().nodes, 2, "the empty node created for the rejected block is freed");
        ix.check_invariants().unwrap();
    }

    #[test]
    fn capacity_is_bounded_per_worker() {
        let mut ix = KvIndex::new(IndexConfig { max_blocks_per_worker: 2 });
        let a = chain(&[1, 2, 3]);
        assert_eq!(ix.apply(&stored(1, 1, None, &a)), ApplyResult::CapacityExhausted { worker: 1 });
        assert_eq!(ix.worker_blocks(1), Some([2, 0, 0, 0]));
        // Adding a tier to a held block is not a new block.
        let host = ev(
            1,
            2,
            StorageTier::Host,
            KvEventData::Stored { parent: None, blocks: a[..2].to_vec() },
        );
        assert_eq!(ix.apply(&host), ApplyResult::Applied);
        assert_eq!(ix.counters().capacity_drops, 1);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn more_than_64_workers() {
        let mut ix = KvIndex::default();
        let a = chain(&[1, 2, 3]);
        for w in 0..200u64 {
            let n = (w % 3 + 1) as usize;
            ix.apply(&stored(w, 1, None, &a[..n]));
        }
        ix.check_invariants().unwrap();
        let got = overlaps(&ix, &locals(&a));
        assert_eq!(got.len(), 200);
        for (w, d) in got {
            assert_eq!(d as u64, w % 3 + 1);
        }
        for w in (0..200u64).step_by(2) {
            ix.remove_worker(w);
        }
        ix.check_invariants().unwrap();
        assert_eq!(overlaps(&ix, &locals(&a)).len(), 100);
        // A new worker reuses a free slot.
        ix.apply(&stored(1000, 1, None, &a));
        assert_eq!(overlaps(&ix, &locals(&a)).iter().filter(|x| x.1 == 3).count(), 34);
        ix.check_invariants().unwrap();
    }
}

//! The radix index against a naive model (per worker: a map from sequence hash to the block's
//! full prefix and tiers) under random stores, removals, clears, lost, repeated and restarted
//! event streams, resyncs and worker removals; plus a garbage-event run that checks only the
//! index's structural invariants.

use std::collections::{BTreeMap, HashMap};

use kvx_proto::hashing::sequence_hash;
use kvx_proto::{
    KvEvent, KvEventData, LocalBlockHash, SequenceHash, StorageTier, StoredBlock, WorkerId,
    XXH3_SEED,
};
use kvx_router::{
    ApplyResult, IndexConfig, KvIndex, OverlapScores, SnapshotBlock, TIER_ORDER, TIERS, tier_index,
};
use proptest::prelude::*;

const ALPHABET: u64 = 3;
const MAX_LEN: usize = 4;
const WORKERS: u64 = 4;

fn seq_of(path: &[u64]) -> SequenceHash {
    let mut parent = None;
    for &l in path {
        parent = Some(sequence_hash(parent, LocalBlockHash(l), XXH3_SEED));
    }
    parent.unwrap_or(SequenceHash(0))
}

fn blocks_of(prefix: &[u64], tail: &[u64]) -> Vec<StoredBlock> {
    let mut path = prefix.to_vec();
    tail.iter()
        .map(|&l| {
            path.push(l);
            StoredBlock { seq_hash: seq_of(&path), local_hash: LocalBlockHash(l) }
        })
        .collect()
}

#[derive(Debug, Default, Clone)]
struct WorkerModel {
    last: u64,
    needs_resync: bool,
    /// seq → (path, tier mask).
    blocks: HashMap<u64, (Vec<u64>, u8)>,
}

#[derive(Debug, Default)]
struct Model {
    workers: BTreeMap<WorkerId, WorkerModel>,
}

impl Model {
    fn store(w: &mut WorkerModel, tier: usize, parent: Option<SequenceHash>, b: &[StoredBlock]) {
        let mut path = match parent {
            None => Vec::new(),
            Some(p) => match w.blocks.get(&p.0) {
                Some((path, _)) => path.clone(),
                None => return,
            },
        };
        for blk in b {
            path.push(blk.local_hash.0);
            let e = w.blocks.entry(blk.seq_hash.0).or_insert_with(|| (path.clone(), 0));
            e.1 |= 1 << tier;
        }
    }

    fn apply(&mut self, ev: &KvEvent) {
        let w = self.workers.entry(ev.worker_id).or_default();
        if ev.event_id == w.last + 1 {
        } else if ev.event_id == 1 && w.last >= 1 {
            w.blocks.clear();
        } else if ev.event_id <= w.last {
            return;
        } else {
            w.needs_resync = true;
        }
        w.last = ev.event_id;
        let t = tier_index(ev.tier);
        match &ev.data {
            KvEventData::Stored { parent, blocks } => Self::store(w, t, *parent, blocks),
            KvEventData::Removed { seq_hashes } => {
                for s in seq_hashes {
                    if let Some(e) = w.blocks.get_mut(&s.0) {
                        e.1 &= !(1 << t);
                        if e.1 == 0 {
                            w.blocks.remove(&s.0);
                        }
                    }
                }
            }
            KvEventData::Cleared => {
                w.blocks.retain(|_, e| {
                    e.1 &= !(1 << t);
                    e.1 != 0
                });
            }
        }
    }

    fn resync(&mut self, worker: WorkerId, last: u64, snap: &[SnapshotBlock]) {
        let w = self.workers.entry(worker).or_default();
        w.blocks.clear();
        for b in snap {
            Self::store(w, tier_index(b.tier), b.parent, std::slice::from_ref(&b.block));
        }
        w.last = last;
        w.needs_resync = false;
    }

    /// (depth, blocks by best tier) of every worker with a match.
    fn matches(&self, q: &[u64]) -> BTreeMap<WorkerId, (u32, [u32; TIERS])> {
        let mut out = BTreeMap::new();
        for (&id, w) in &self.workers {
            let mut by_tier = [0u32; TIERS];
            let mut d = 0;
            for i in 1..=q.len() {
                let Some((path, tiers)) = w.blocks.get(&seq_of(&q[..i]).0) else { break };
                assert_eq!(path.as_slice(), &q[..i]);
                by_tier[tiers.trailing_zeros() as usize] += 1;
                d = i as u32;
            }
            if d > 0 {
                out.insert(id, (d, by_tier));
            }
        }
        out
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Store `tail` below `prefix` (parent = prefix's last block, or the root).
    Store {
        worker: WorkerId,
        tier: usize,
        prefix: Vec<u64>,
        tail: Vec<u64>,
        fate: Fate,
    },
    /// Remove the blocks named by these paths.
    Remove {
        worker: WorkerId,
        tier: usize,
        paths: Vec<Vec<u64>>,
        fate: Fate,
    },
    Clear {
        worker: WorkerId,
        tier: usize,
        fate: Fate,
    },
    /// The worker restarts: its next event carries id 1.
    Restart {
        worker: WorkerId,
    },
    /// Resync from the model's current view of the worker, plus extra stores.
    Resync {
        worker: WorkerId,
        extra: Vec<Vec<u64>>,
    },
    RemoveWorker {
        worker: WorkerId,
    },
}

/// What happens to an event on its way.
#[derive(Debug, Clone, Copy)]
enum Fate {
    Delivered,
    Lost,
    /// Delivered, then delivered again.
    Repeated,
}

fn path() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..ALPHABET, 0..=MAX_LEN)
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![8 => Just(Fate::Delivered), 1 => Just(Fate::Lost), 1 => Just(Fate::Repeated)]
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    let t = prop_oneof![4 => Just(0usize), 1 => Just(1usize), 1 => Just(2usize), 1 => Just(3usize)];
    prop_oneof![
        10 => (w.clone(), t.clone(), path(), path(), fate()).prop_map(
            |(worker, tier, mut prefix, tail, fate)| {
                prefix.truncate(MAX_LEN - tail.len().min(MAX_LEN));
                Op::Store { worker, tier, prefix, tail, fate }
            }
        ),
        5 => (w.clone(), t.clone(), prop::collection::vec(path(), 1..4), fate())
            .prop_map(|(worker, tier, paths, fate)| Op::Remove { worker, tier, paths, fate }),
        1 => (w.clone(), t, fate()).prop_map(|(worker, tier, fate)| Op::Clear { worker, tier, fate }),
        1 => w.clone().prop_map(|worker| Op::Restart { worker }),
        1 => (w.clone(), prop::collection::vec(path(), 0..3))
            .prop_map(|(worker, extra)| Op::Resync { worker, extra }),
        1 => w.prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

fn all_queries() -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    let n = ALPHABET.pow(MAX_LEN as u32);
    for mut i in 0..n {
        let mut q = Vec::with_capacity(MAX_LEN);
        for _ in 0..MAX_LEN {
            q.push(i % ALPHABET);
            i /= ALPHABET;
        }
        out.push(q);
    }
    out
}

/// The stream of one worker as the worker numbers it.
#[derive(Default)]
struct Sender {
    next: HashMap<WorkerId, u64>,
}

impl Sender {
    fn emit(&mut self, worker: WorkerId, tier: usize, data: KvEventData) -> KvEvent {
        let id = self.next.entry(worker).or_insert(1);
        let ev = KvEvent { worker_id: worker, event_id: *id, tier: TIER_ORDER[tier], data };
        *id += 1;
        ev
    }
}

fn deliver(ix: &mut KvIndex, model: &mut Model, ev: &KvEvent, fate: Fate) {
    match fate {
        Fate::Lost => {}
        Fate::Delivered | Fate::Repeated => {
            let r = ix.apply(ev);
            model.apply(ev);
            if let Fate::Repeated = fate {
                let again = ix.apply(ev);
                model.apply(ev);
                // A repeat is stale, or a restart's first event rebuilt the same state.
                assert!(
                    matches!(again, ApplyResult::Stale { .. } | ApplyResult::Restarted { .. }),
                    "{again:?} after {r:?}"
                );
            }
        }
    }
}

fn compare(ix: &KvIndex, model: &Model, queries: &[Vec<u64>], out: &mut OverlapScores) {
    ix.check_invariants().unwrap();
    for q in queries {
        let locals: Vec<LocalBlockHash> = q.iter().map(|&l| LocalBlockHash(l)).collect();
        ix.find_matches(&locals, out);
        let got: BTreeMap<WorkerId, (u32, [u32; TIERS])> =
            out.iter().map(|o| (o.worker, (o.blocks, o.by_tier))).collect();
        assert_eq!(got, model.matches(q), "query {q:?}");
    }
    for (&id, w) in &model.workers {
        assert_eq!(ix.needs_resync(id), w.needs_resync, "worker {id}");
        assert_eq!(ix.last_event_id(id), Some(w.last), "worker {id}");
        let mut by_tier = [0u64; TIERS];
        for (_, tiers) in w.blocks.values() {
            for (t, c) in by_tier.iter_mut().enumerate() {
                *c += (tiers >> t & 1) as u64;
            }
        }
        assert_eq!(ix.worker_blocks(id), Some(by_tier), "worker {id}");
    }
    assert_eq!(ix.stats().workers, model.workers.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_the_naive_model(ops in prop::collection::vec(op(), 1..60)) {
        let queries = all_queries();
        let mut ix = KvIndex::new(IndexConfig::default());
        let mut model = Model::default();
        let mut tx = Sender::default();
        let mut out = OverlapScores::new();
        for op in ops {
            match op {
                Op::Store { worker, tier, prefix, tail, fate } => {
                    let parent = (!prefix.is_empty()).then(|| seq_of(&prefix));
                    let blocks = blocks_of(&prefix, &tail);
                    let ev = tx.emit(worker, tier, KvEventData::Stored { parent, blocks });
                    deliver(&mut ix, &mut model, &ev, fate);
                }
                Op::Remove { worker, tier, paths, fate } => {
                    let seq_hashes = paths.iter().filter(|p| !p.is_empty()).map(|p| seq_of(p)).collect();
                    let ev = tx.emit(worker, tier, KvEventData::Removed { seq_hashes });
                    deliver(&mut ix, &mut model, &ev, fate);
                }
                Op::Clear { worker, tier, fate } => {
                    let ev = tx.emit(worker, tier, KvEventData::Cleared);
                    deliver(&mut ix, &mut model, &ev, fate);
                }
                Op::Restart { worker } => {
                    tx.next.insert(worker, 1);
                }
                Op::Resync { worker, extra } => {
                    // The worker's true state is unknown here; the snapshot is the model's
                    // view plus some paths, parents first (sorted by length).
                    let mut snap: Vec<(Vec<u64>, usize)> = model
                        .workers
                        .get(&worker)
                        .map(|w| {
                            w.blocks
                                .values()
                                .flat_map(|(p, tiers)| {
                                    (0..TIERS).filter(move |t| tiers >> t & 1 == 1).map(move |t| (p.clone(), t))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    for p in extra.into_iter().filter(|p| !p.is_empty()) {
                        for i in 1..=p.len() {
                            snap.push((p[..i].to_vec(), 0));
                        }
                    }
                    snap.sort();
                    snap.sort_by_key(|(p, _)| p.len());
                    let snap: Vec<SnapshotBlock> = snap
                        .iter()
                        .map(|(p, t)| SnapshotBlock {
                            tier: TIER_ORDER[*t],
                            parent: (p.len() > 1).then(|| seq_of(&p[..p.len() - 1])),
                            block: StoredBlock {
                                seq_hash: seq_of(p),
                                local_hash: LocalBlockHash(p[p.len() - 1]),
                            },
                        })
                        .collect();
                    let last = tx.next.get(&worker).copied().unwrap_or(1) - 1;
                    ix.resync(worker, last, &snap);
                    model.resync(worker, last, &snap);
                }
                Op::RemoveWorker { worker } => {
                    let had = model.workers.remove(&worker).is_some();
                    prop_assert_eq!(ix.remove_worker(worker), had);
                    tx.next.remove(&worker);
                }
            }
            compare(&ix, &model, &queries, &mut out);
        }
        prop_assert_eq!(ix.counters().collisions, 0);
        for w in 0..WORKERS {
            ix.remove_worker(w);
        }
        ix.check_invariants().unwrap();
        prop_assert_eq!(ix.stats().nodes, 0);
        prop_assert_eq!(ix.stats().blocks, 0);
    }

    /// Events with arbitrary hashes and parents (collisions, cycles of names, unknown parents,
    /// out-of-order ids) never break the index's invariants, and removing every worker empties it.
    #[test]
    fn garbage_events_keep_invariants(
        evs in prop::collection::vec(
            (0..3u64, 0..6u64, 0..4usize, 0..3u8, prop::option::of(0..6u64),
             prop::collection::vec((0..6u64, 0..3u64), 0..5)),
            1..80,
        ),
        cap in 1usize..8,
    ) {
        let mut ix = KvIndex::new(IndexConfig { max_blocks_per_worker: cap });
        let mut out = OverlapScores::new();
        for (worker, id, tier, kind, parent, blocks) in evs {
            let data = match kind {
                0 => KvEventData::Stored {
                    parent: parent.map(SequenceHash),
                    blocks: blocks
                        .iter()
                        .map(|&(s, l)| StoredBlock { seq_hash: SequenceHash(s), local_hash: LocalBlockHash(l) })
                        .collect(),
                },
                1 => KvEventData::Removed { seq_hashes: blocks.iter().map(|&(s, _)| SequenceHash(s)).collect() },
                _ => KvEventData::Cleared,
            };
            ix.apply(&KvEvent { worker_id: worker, event_id: id, tier: TIER_ORDER[tier], data });
            ix.check_invariants().map_err(TestCaseError::fail)?;
            for q in [[0u64, 1, 2], [1, 1, 1], [2, 0, 1]] {
                let locals: Vec<LocalBlockHash> = q.iter().map(|&l| LocalBlockHash(l)).collect();
                ix.find_matches(&locals, &mut out);
                for o in out.iter() {
                    prop_assert!(o.blocks as usize <= q.len());
                    prop_assert_eq!(o.by_tier.iter().sum::<u32>(), o.blocks);
                }
            }
        }
        for w in 0..3 {
            prop_assert!(ix.worker_blocks(w).is_none_or(|b| b.iter().all(|&n| n <= cap as u64)));
            ix.remove_worker(w);
        }
        ix.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(ix.stats().nodes, 0);
    }
}

#[test]
fn stored_tiers_are_distinct_types() {
    // The per-tier arrays follow TIER_ORDER.
    for (i, t) in TIER_ORDER.iter().enumerate() {
        assert_eq!(tier_index(*t), i);
    }
    assert_eq!(TIER_ORDER[0], StorageTier::Device);
}

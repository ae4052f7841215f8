//! A synthetic cluster KV workload for the router benchmarks, and a naive index to compare
//! against.
//!
//! `workers` workers each end up holding `blocks_per_worker` blocks (64 × 16 384 ≈ 1 M, the
//! mocker's default pool per worker). Their content is conversations: one of 512 shared
//! prefixes ("system prompts", 4–32 blocks, popular ones more often) followed by a private
//! suffix of 8–64 blocks. Workers report them as `Stored` events of `chunk` blocks each (1 is
//! decode-like, larger is prefill-like), either worker after worker or interleaved round-robin
//! across workers (as a router hears a busy cluster). Churn events evict a random
//! conversation's suffix and store a new one, at steady state. Requests continue a stored conversation (70%), start a new one
//! on a popular prefix (20%) or share nothing (10%).

#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use foldhash::{HashMap as FastMap, HashSet as FastSet};
use kvx_proto::hashing::sequence_hash;
use kvx_proto::{
    KvEvent, KvEventData, LocalBlockHash, RequestId, SequenceHash, StorageTier, StoredBlock,
    WorkerId, XXH3_SEED,
};
use kvx_router::{RequestBlocks, Router, RouterConfig};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const BLOCK_SIZE: u64 = 16;
const PREFIXES: usize = 512;

/// One conversation held by one worker: its full block path.
#[derive(Debug, Clone)]
pub struct Conv {
    pub worker: WorkerId,
    pub prefix_len: usize,
    pub blocks: Vec<StoredBlock>,
}

#[derive(Debug)]
pub struct Workload {
    pub workers: u64,
    pub blocks: u64,
    /// Initial fill, in per-worker order.
    pub events: Vec<KvEvent>,
    /// Steady-state evict + store events, after `events`.
    pub churn: Vec<KvEvent>,
    pub convs: Vec<Conv>,
    prefixes: Vec<Vec<StoredBlock>>,
    rng: ChaCha8Rng,
}

fn extend(path: &[StoredBlock], n: usize, rng: &mut ChaCha8Rng) -> Vec<StoredBlock> {
    let mut parent = path.last().map(|b| b.seq_hash);
    (0..n)
        .map(|_| {
            let local_hash = LocalBlockHash(rng.random());
            let seq_hash = sequence_hash(parent, local_hash, XXH3_SEED);
            parent = Some(seq_hash);
            StoredBlock { seq_hash, local_hash }
        })
        .collect()
}

fn round_robin(streams: Vec<Vec<KvEvent>>) -> Vec<KvEvent> {
    let mut its: Vec<_> = streams.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        out.extend(its.iter_mut().filter_map(Iterator::next));
        if out.len() == before {
            return out;
        }
    }
}

fn popular(rng: &mut ChaCha8Rng) -> usize {
    let u: f64 = rng.random();
    ((u * u * u) * PREFIXES as f64) as usize % PREFIXES
}

struct Emitter {
    next: HashMap<WorkerId, u64>,
    chunk: usize,
}

impl Emitter {
    fn id(&mut self, w: WorkerId) -> u64 {
        let n = self.next.entry(w).or_insert(1);
        *n += 1;
        *n - 1
    }

    fn stored(&mut self, out: &mut Vec<KvEvent>, w: WorkerId, path: &[StoredBlock], from: usize) {
        let mut i = from;
        while i < path.len() {
            let end = (i + self.chunk).min(path.len());
            let parent = (i > 0).then(|| path[i - 1].seq_hash);
            let data = KvEventData::Stored { parent, blocks: path[i..end].to_vec() };
            let event_id = self.id(w);
            out.push(KvEvent { worker_id: w, event_id, tier: StorageTier::Device, data });
            i = end;
        }
    }

    fn removed(&mut self, out: &mut Vec<KvEvent>, w: WorkerId, blocks: &[StoredBlock]) {
        // Evicted leaf first, as an LRU over a chain would.
        let seqs: Vec<SequenceHash> = blocks.iter().rev().map(|b| b.seq_hash).collect();
        for c in seqs.chunks(self.chunk) {
            let data = KvEventData::Removed { seq_hashes: c.to_vec() };
            let event_id = self.id(w);
            out.push(KvEvent { worker_id: w, event_id, tier: StorageTier::Device, data });
        }
    }
}

impl Workload {
    /// Builds the fill for `workers` × `blocks_per_worker` blocks and `churn_convs` churn
    /// conversations, in events of `chunk` blocks.
    pub fn build(
        workers: u64,
        blocks_per_worker: u64,
        chunk: usize,
        churn_convs: usize,
        interleave: bool,
        seed: u64,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prefixes: Vec<Vec<StoredBlock>> = (0..PREFIXES)
            .map(|_| {
                let n = rng.random_range(4..=32);
                extend(&[], n, &mut rng)
            })
            .collect();
        let mut em = Emitter { next: HashMap::new(), chunk: chunk.max(1) };
        let mut per_worker = Vec::new();
        let mut convs = Vec::new();
        for w in 0..workers {
            let mut events = Vec::new();
            let mut held = 0u64;
            let mut has_prefix: FastSet<usize> = FastSet::default();
            while held < blocks_per_worker {
                let p = popular(&mut rng);
                let prefix = &prefixes[p];
                let mut from = prefix.len();
                if has_prefix.insert(p) {
                    from = 0;
                    held += prefix.len() as u64;
                }
                let want = rng.random_range(8..=64u64);
                let n = want.min(blocks_per_worker.saturating_sub(held)) as usize;
                let mut path = prefix.clone();
                path.extend(extend(prefix, n, &mut rng));
                held += n as u64;
                em.stored(&mut events, w, &path, from);
                convs.push(Conv { worker: w, prefix_len: prefix.len(), blocks: path });
            }
            per_worker.push(events);
        }
        let events = if interleave { round_robin(per_worker) } else { per_worker.concat() };
        let blocks = workers * blocks_per_worker;
        let mut order: Vec<usize> = (0..convs.len()).collect();
        order.shuffle(&mut rng);
        let mut churn = Vec::new();
        for &i in order.iter().take(churn_convs) {
            let c = &mut convs[i];
            em.removed(&mut churn, c.worker, &c.blocks[c.prefix_len..]);
            let n = c.blocks.len() - c.prefix_len;
            c.blocks.truncate(c.prefix_len);
            let fresh = extend(&c.blocks, n, &mut rng);
            c.blocks.extend(fresh);
            em.stored(&mut churn, c.worker, &c.blocks, c.prefix_len);
        }
        Workload { workers, blocks, events, churn, convs, prefixes, rng }
    }

    /// `n` requests: 70% continue a conversation (+8 new blocks), 20% start one on a popular
    /// prefix (+32), 10% share nothing (32 blocks).
    pub fn requests(&mut self, n: usize) -> Vec<RequestBlocks> {
        (0..n)
            .map(|_| {
                let x: f64 = self.rng.random();
                let path = if x < 0.7 {
                    let c = &self.convs[self.rng.random_range(0..self.convs.len())];
                    let mut p = c.blocks.clone();
                    p.extend(extend(&c.blocks, 8, &mut self.rng));
                    p
                } else if x < 0.9 {
                    let pre = self.prefixes[popular(&mut self.rng)].clone();
                    let mut p = pre.clone();
                    p.extend(extend(&pre, 32, &mut self.rng));
                    p
                } else {
                    extend(&[], 32, &mut self.rng)
                };
                let hashes: Vec<(LocalBlockHash, SequenceHash)> =
                    path.iter().map(|b| (b.local_hash, b.seq_hash)).collect();
                RequestBlocks::from_hashes(path.len() as u64 * BLOCK_SIZE, &hashes)
            })
            .collect()
    }
}

/// A default router and the naive peer, both fed every event of `wl`, with `in_flight`
/// requests of `wl` routed (every other one past its prefill when `half_prefilled`).
pub fn loaded(wl: &mut Workload, in_flight: usize, half_prefilled: bool) -> (Router, NaiveIndex) {
    let mut router = Router::new(RouterConfig::default()).expect("default config is valid");
    let mut naive = NaiveIndex::default();
    for w in 0..wl.workers {
        router.add_worker(w);
    }
    for ev in &wl.events {
        router.apply_event(ev);
        naive.apply(ev);
    }
    for (i, r) in wl.requests(in_flight).iter().enumerate() {
        let _ = router.route(RequestId(i as u64), r, Duration::ZERO);
        if half_prefilled && i % 2 == 0 {
            router.mark_prefill_done(RequestId(i as u64));
        }
    }
    (router, naive)
}

/// The peer: per worker a hash set (same fast hasher) of the sequence hashes it holds; a match scans each
/// worker's set along the request until the first miss.
#[derive(Debug, Default)]
pub struct NaiveIndex {
    workers: FastMap<WorkerId, FastSet<u64>>,
}

impl NaiveIndex {
    pub fn apply(&mut self, ev: &KvEvent) {
        let w = self.workers.entry(ev.worker_id).or_default();
        match &ev.data {
            KvEventData::Stored { blocks, .. } => {
                for b in blocks {
                    w.insert(b.seq_hash.0);
                }
            }
            KvEventData::Removed { seq_hashes } => {
                for s in seq_hashes {
                    w.remove(&s.0);
                }
            }
            KvEventData::Cleared => w.clear(),
        }
    }

    pub fn find_matches(&self, seqs: &[SequenceHash], out: &mut Vec<(WorkerId, u32)>) {
        out.clear();
        for (&id, set) in &self.workers {
            let d = seqs.iter().take_while(|s| set.contains(&s.0)).count();
            if d > 0 {
                out.push((id, d as u32));
            }
        }
    }
}

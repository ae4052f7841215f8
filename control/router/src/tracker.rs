//! The active-sequence tracker: each worker's predicted load from the requests routed to it.
//!
//! * **Blocks.** A request brings the sequence hashes of its full prompt blocks plus its
//!   unhashed blocks (the partial last block; `total_blocks − hashes`). Hashed blocks are
//!   reference counted per worker, so a prefix shared by several running requests counts once;
//!   unhashed blocks are the request's own. `active_blocks = unique hashed + unhashed`.
//! * **Prefill.** The request's uncached prompt tokens are charged to the worker until its first
//!   token ([`ActiveSequences::mark_prefill_done`]) or its end.
//! * **Release.** [`ActiveSequences::free`] returns everything; [`ActiveSequences::expire`] frees
//!   requests older than a time-to-live (lost `free`s). Time is passed in by the caller.
//!
//! The worker's active hashes are *prefix closed* when requests carry whole chains of
//! sequence hashes (a block's hash names its whole prefix, so a request holding block `i`
//! holds `0..i`). [`ActiveSequences::active_overlap`] relies on this to binary-search how many
//! leading blocks of a new request are already active; [`ActiveSequences::active_overlap_linear`]
//! is the reference twin.

use std::time::Duration;

use kvx_proto::{RequestId, SequenceHash, WorkerId};
use thiserror::Error;

use crate::fast_map::{self, FastMap};

/// Why a request could not be tracked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TrackError {
    /// The request is already tracked.
    #[error("request {0} is already tracked")]
    Duplicate(RequestId),
    /// The tracker is full.
    #[error("too many tracked requests (limit {0})")]
    Full(usize),
}

/// A worker's predicted load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Unique KV blocks of its running requests.
    pub active_blocks: u64,
    /// Prompt tokens routed to it and not yet prefilled.
    pub prefill_tokens: u64,
    /// Requests in flight.
    pub requests: u64,
}

#[derive(Debug, Default)]
struct WorkerActive {
    blocks: FastMap<u64, u32>,
    unhashed: u64,
    prefill_tokens: u64,
    requests: u64,
}

#[derive(Debug)]
struct ActiveRequest {
    worker: WorkerId,
    hashes: Box<[u64]>,
    unhashed: u64,
    /// Charged prefill tokens; 0 once prefill is done.
    prefill_tokens: u64,
    started: Duration,
}

/// Tracks the requests in flight on every worker.
#[derive(Debug)]
pub struct ActiveSequences {
    max_requests: usize,
    workers: FastMap<WorkerId, WorkerActive>,
    requests: FastMap<RequestId, ActiveRequest>,
}

impl ActiveSequences {
    /// A tracker holding at most `max_requests` requests.
    pub fn new(max_requests: usize) -> Self {
        ActiveSequences {
            max_requests,
            workers: fast_map::with_capacity(0),
            requests: fast_map::with_capacity(0),
        }
    }

    /// Starts tracking `request` on `worker`: `hashes` are the sequence hashes of its full
    /// prompt blocks, `total_blocks` its block count including unhashed ones (counts below
    /// `hashes.len()` are raised to it), `prefill_tokens` the prompt tokens it must compute.
    pub fn add(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        hashes: &[SequenceHash],
        total_blocks: u64,
        prefill_tokens: u64,
        now: Duration,
    ) -> Result<(), TrackError> {
        if self.requests.contains_key(&request) {
            return Err(TrackError::Duplicate(request));
        }
        if self.requests.len() >= self.max_requests {
            return Err(TrackError::Full(self.max_requests));
        }
        let w = self.workers.entry(worker).or_default();
        for h in hashes {
            *w.blocks.entry(h.0).or_insert(0) += 1;
        }
        let unhashed = total_blocks.saturating_sub(hashes.len() as u64);
        w.unhashed += unhashed;
        w.prefill_tokens += prefill_tokens;
        w.requests += 1;
        let hashes = hashes.iter().map(|h| h.0).collect();
        self.requests.insert(
            request,
            ActiveRequest { worker, hashes, unhashed, prefill_tokens, started: now },
        );
        Ok(())
    }

    /// The request produced its first token: its prompt tokens stop counting as prefill
    /// load. Returns false for an unknown request.
    pub fn mark_prefill_done(&mut self, request: RequestId) -> bool {
        let Some(r) = self.requests.get_mut(&request) else {
            return false;
        };
        if r.prefill_tokens > 0
            && let Some(w) = self.workers.get_mut(&r.worker)
        {
            w.prefill_tokens -= r.prefill_tokens;
        }
        r.prefill_tokens = 0;
        true
    }

    /// The request ended: its blocks and tokens are released. Returns its worker, or `None`
    /// for an unknown request (freeing twice is harmless).
    pub fn free(&mut self, request: RequestId) -> Option<WorkerId> {
        let r = self.requests.remove(&request)?;
        let Some(w) = self.workers.get_mut(&r.worker) else {
            return Some(r.worker);
        };
        for h in r.hashes.iter() {
            if let Some(c) = w.blocks.get_mut(h) {
                *c -= 1;
                if *c == 0 {
                    w.blocks.remove(h);
                }
            }
        }
        w.unhashed -= r.unhashed;
        w.prefill_tokens -= r.prefill_tokens;
        w.requests -= 1;
        Some(r.worker)
    }

    /// Frees every request started more than `ttl` before `now`; returns them, sorted.
    pub fn expire(&mut self, now: Duration, ttl: Duration) -> Vec<RequestId> {
        let mut old: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| now.saturating_sub(r.started) > ttl)
            .map(|(&id, _)| id)
            .collect();
        old.sort();
        for &id in &old {
            self.free(id);
        }
        old
    }

    /// Frees every request of `worker` and forgets it; returns those requests, sorted.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> =
            self.requests.iter().filter(|(_, r)| r.worker == worker).map(|(&id, _)| id).collect();
        ids.sort();
        for &id in &ids {
            self.free(id);
        }
        self.workers.remove(&worker);
        ids
    }

    /// The predicted load of `worker` (zero if it has nothing in flight).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.workers.get(&worker).map_or(WorkerLoad::default(), |w| WorkerLoad {
            active_blocks: w.blocks.len() as u64 + w.unhashed,
            prefill_tokens: w.prefill_tokens,
            requests: w.requests,
        })
    }

    /// The worker a request is tracked on.
    pub fn worker_of(&self, request: RequestId) -> Option<WorkerId> {
        self.requests.get(&request).map(|r| r.worker)
    }

    /// Requests tracked.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// How many leading blocks of `hashes` are already active on `worker` (binary search;
    /// exact when the worker's active hashes are prefix closed, see the module docs).
    pub fn active_overlap(&self, worker: WorkerId, hashes: &[SequenceHash]) -> u64 {
        let Some(w) = self.workers.get(&worker) else {
            return 0;
        };
        let present = |i: usize| w.blocks.contains_key(&hashes[i].0);
        if hashes.is_empty() || !present(0) {
            return 0;
        }
        // Invariant: present(lo - 1), and hi == len or !present(hi).
        let (mut lo, mut hi) = (1usize, hashes.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if present(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo as u64
    }

    /// Reference twin of [`active_overlap`](Self::active_overlap): a linear scan for the first
    /// block not active on the worker.
    pub fn active_overlap_linear(&self, worker: WorkerId, hashes: &[SequenceHash]) -> u64 {
        let Some(w) = self.workers.get(&worker) else {
            return 0;
        };
        hashes.iter().take_while(|h| w.blocks.contains_key(&h.0)).count() as u64
    }

    /// Recomputes every worker's counts from the requests and compares (for tests).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expect: FastMap<WorkerId, (FastMap<u64, u32>, u64, u64, u64)> =
            fast_map::with_capacity(0);
        for r in self.requests.values() {
            let e = expect.entry(r.worker).or_default();
            for h in r.hashes.iter() {
                *e.0.entry(*h).or_insert(0) += 1;
            }
            e.1 += r.unhashed;
            e.2 += r.prefill_tokens;
            e.3 += 1;
        }
        for (id, w) in &self.workers {
            let empty = Default::default();
            let e = expect.get(id).unwrap_or(&empty);
            if w.blocks != e.0 || (w.unhashed, w.prefill_tokens, w.requests) != (e.1, e.2, e.3) {
                return Err(format!("worker {id} disagrees with its requests"));
            }
        }
        if let Some(id) = expect.keys().find(|id| !self.workers.contains_key(id)) {
            return Err(format!("requests on untracked worker {id}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvx_proto::hashing::sequence_hash;
    use kvx_proto::{LocalBlockHash, XXH3_SEED};
    use proptest::prelude::*;

    use super::*;

    fn chain(locals: &[u64]) -> Vec<SequenceHash> {
        let mut parent = None;
        locals
            .iter()
            .map(|&l| {
                let s = sequence_hash(parent, LocalBlockHash(l), XXH3_SEED);
                parent = Some(s);
                s
            })
            .collect()
    }

    const T0: Duration = Duration::ZERO;

    #[test]
    fn shared_prefixes_count_once() {
        let mut t = ActiveSequences::new(100);
        let a = chain(&[1, 2, 3]);
        let b = chain(&[1, 2, 4, 5]);
        t.add(RequestId(1), 9, &a, 4, 50, T0).unwrap();
        t.add(RequestId(2), 9, &b, 4, 30, T0).unwrap();
        assert_eq!(t.load(9), WorkerLoad { active_blocks: 5 + 1, prefill_tokens: 80, requests: 2 });
        assert!(t.mark_prefill_done(RequestId(1)));
        assert!(t.mark_prefill_done(RequestId(1)), "twice is harmless");
        assert_eq!(t.load(9).prefill_tokens, 30);
        assert_eq!(t.free(RequestId(1)), Some(9));
        assert_eq!(t.load(9), WorkerLoad { active_blocks: 4, prefill_tokens: 30, requests: 1 });
        assert_eq!(t.free(RequestId(1)), None);
        assert_eq!(t.free(RequestId(2)), Some(9));
        assert_eq!(t.load(9), WorkerLoad::default());
        assert!(t.is_empty());
        t.check_invariants().unwrap();
    }

    #[test]
    fn duplicates_and_limits() {
        let mut t = ActiveSequences::new(1);
        t.add(RequestId(1), 1, &[], 0, 0, T0).unwrap();
        assert_eq!(t.add(RequestId(1), 2, &[], 0, 0, T0), Err(TrackError::Duplicate(RequestId(1))));
        assert_eq!(t.add(RequestId(2), 2, &[], 0, 0, T0), Err(TrackError::Full(1)));
        assert_eq!(t.worker_of(RequestId(1)), Some(1));
        assert!(!t.mark_prefill_done(RequestId(5)));
    }

    #[test]
    fn expiry_by_age() {
        let mut t = ActiveSequences::new(10);
        let s = Duration::from_secs;
        t.add(RequestId(1), 1, &chain(&[1]), 1, 10, s(0)).unwrap();
        t.add(RequestId(2), 1, &chain(&[2]), 1, 10, s(100)).unwrap();
        t.add(RequestId(3), 2, &chain(&[3]), 1, 10, s(200)).unwrap();
        assert_eq!(t.expire(s(300), s(300)), vec![]);
        assert_eq!(t.expire(s(401), s(300)), vec![RequestId(1), RequestId(2)]);
        assert_eq!(t.load(1), WorkerLoad::default());
        assert_eq!(t.load(2).requests, 1);
        // A clock that goes backwards expires nothing.
        assert_eq!(t.expire(s(0), s(1)), vec![]);
        t.check_invariants().unwrap();
    }

    #[test]
    fn remove_worker_frees_its_requests() {
        let mut t = ActiveSequences::new(10);
        t.add(RequestId(1), 1, &chain(&[1]), 1, 10, T0).unwrap();
        t.add(RequestId(2), 2, &chain(&[1]), 1, 10, T0).unwrap();
        t.add(RequestId(3), 1, &chain(&[1]), 1, 10, T0).unwrap();
        assert_eq!(t.remove_worker(1), vec![RequestId(1), RequestId(3)]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.load(1), WorkerLoad::default());
        t.check_invariants().unwrap();
    }

    #[test]
    fn active_overlap_finds_the_active_prefix() {
        let mut t = ActiveSequences::new(10);
        let a = chain(&[1, 2, 3, 4, 5, 6, 7]);
        t.add(RequestId(1), 1, &a[..5], 5, 0, T0).unwrap();
        assert_eq!(t.active_overlap(1, &a), 5);
        assert_eq!(t.active_overlap(1, &a[..3]), 3);
        assert_eq!(t.active_overlap(1, &chain(&[9])), 0);
        assert_eq!(t.active_overlap(1, &[]), 0);
        assert_eq!(t.active_overlap(2, &a), 0);
    }

    proptest! {
        /// Random add / prefill-done / free / expire sequences: counts agree with the requests,
        /// never underflow, and everything returns to zero at the end.
        #[test]
        fn tracker_returns_to_zero(ops in prop::collection::vec(
            (0u8..4, 0u64..24, 0u64..4, prop::collection::vec(0u64..6, 0..8), 0u64..200),
            0..200,
        )) {
            let mut t = ActiveSequences::new(16);
            let mut now = Duration::ZERO;
            for (op, req, worker, locals, tokens) in ops {
                now += Duration::from_secs(1);
                let id = RequestId(req);
                match op {
                    0 => {
                        let hashes = chain(&locals);
                        let r = t.add(id, worker, &hashes, hashes.len() as u64 + tokens % 2, tokens, now);
                        if r.is_ok() {
                            prop_assert_eq!(t.worker_of(id), Some(worker));
                        }
                    }
                    1 => { t.mark_prefill_done(id); }
                    2 => { t.free(id); }
                    _ => { t.expire(now, Duration::from_secs(20)); }
                }
                t.check_invariants().map_err(TestCaseError::fail)?;
            }
            let ids: Vec<RequestId> = (0..24).map(RequestId).collect();
            for id in ids {
                t.free(id);
            }
            prop_assert!(t.is_empty());
            for w in 0..4 {
                prop_assert_eq!(t.load(w), WorkerLoad::default());
            }
        }

        /// The binary search agrees with the linear scan on prefix-closed active sets.
        #[test]
        fn active_overlap_parity(
            reqs in prop::collection::vec(prop::collection::vec(0u64..3, 0..12), 0..6),
            query in prop::collection::vec(0u64..3, 0..16),
        ) {
            let mut t = ActiveSequences::new(100);
            for (i, r) in reqs.iter().enumerate() {
                let h = chain(r);
                t.add(RequestId(i as u64), 1, &h, h.len() as u64, 0, T0).unwrap();
            }
            let q = chain(&query);
            prop_assert_eq!(t.active_overlap(1, &q), t.active_overlap_linear(1, &q));
        }
    }
}

//! The KV block pool: fixed-size blocks allocated once, reference counted, with a prefix cache
//! keyed by sequence hash and an LRU of cached-but-idle blocks.
//!
//! Block states:
//! * **free** — no content; on the free stack.
//! * **active** — `refcount > 0`; used by one or more running sequences (shared prefixes).
//! * **cached** — `refcount == 0` but registered under a sequence hash: its content can be
//!   reused by a later request; it sits in the LRU and is evicted (oldest first) only when
//!   the free stack is empty.
//!
//! A registered block may also be *pinned* by the engine's owner while something outside
//! the engine reads it (a copy to a lower KV tier): a pin is a reference like a sequence's,
//! counted apart so that the bookkeeping can tell them from each other.
//!
//! Every registration and eviction is recorded as a KV event record; the owner drains them.
//! Nothing here allocates after construction except the event buffer growing past its
//! reserved capacity.

use std::collections::HashMap;

use kvx_proto::{LocalBlockHash, SequenceHash};

/// Index of a block in the pool (and in the KV cache).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// One KV event, flat (the owner groups them into `kvx_proto::KvEvent`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockEvent {
    /// A block was registered (its content is reusable).
    Stored {
        /// The block (its content stays as it is while it is registered).
        block: BlockId,
        /// Sequence hash of the block.
        seq_hash: SequenceHash,
        /// Local hash.
        local_hash: LocalBlockHash,
        /// Sequence hash of the previous block, `None` for the first block.
        parent: Option<SequenceHash>,
    },
    /// A cached block was evicted.
    Removed {
        /// Its sequence hash.
        seq_hash: SequenceHash,
    },
}

/// Counters of the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks looked up in the prefix cache.
    pub queries: u64,
    /// Lookups that found a block.
    pub hits: u64,
    /// Cached blocks evicted.
    pub evictions: u64,
}

/// The pool.
#[derive(Debug)]
pub struct BlockPool {
    refcnt: Vec<u32>,
    hash: Vec<Option<SequenceHash>>,
    local: Vec<LocalBlockHash>,
    parent: Vec<Option<SequenceHash>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    free: Vec<BlockId>,
    /// Pins per block (included in `refcnt`).
    pins: Vec<u32>,
    cache: HashMap<SequenceHash, BlockId>,
    events: Vec<BlockEvent>,
    stats: PoolStats,
}

impl BlockPool {
    /// A pool of `n` blocks, all free.
    pub fn new(n: usize) -> Self {
        let n = n.min(NIL as usize - 1);
        BlockPool {
            refcnt: vec![0; n],
            hash: vec![None; n],
            local: vec![LocalBlockHash(0); n],
            parent: vec![None; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            free: (0..n as u32).rev().collect(),
            pins: vec![0; n],
            cache: HashMap::with_capacity(n),
            events: Vec::with_capacity(2 * n + 64),
            stats: PoolStats::default(),
        }
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.refcnt.len()
    }

    /// Blocks that an allocation can obtain (free plus evictable cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    /// Blocks held by running sequences.
    pub fn active(&self) -> usize {
        self.capacity() - self.available()
    }

    /// Cached idle blocks.
    pub fn cached_idle(&self) -> usize {
        self.lru_len
    }

    /// Prefix-cache counters.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Takes an empty block (evicting the least recently used cached block if no block is
    /// free). The block's refcount is 1.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.lru_pop_front()?;
                if let Some(h) = self.hash[b as usize].take() {
                    self.cache.remove(&h);
                    self.events.push(BlockEvent::Removed { seq_hash: h });
                    self.stats.evictions += 1;
                }
                b
            }
        };
        debug_assert_eq!(self.refcnt[b as usize], 0);
        self.refcnt[b as usize] = 1;
        Some(b)
    }

    /// Takes a reference to the cached block with sequence hash `h`, if any.
    pub fn acquire_cached(&mut self, h: SequenceHash) -> Option<BlockId> {
        self.stats.queries += 1;
        let b = *self.cache.get(&h)?;
        self.stats.hits += 1;
        if self.refcnt[b as usize] == 0 {
            self.lru_remove(b);
        }
        self.refcnt[b as usize] += 1;
        Some(b)
    }

    /// Whether a block with sequence hash `h` is cached (does not count as a query).
    pub fn contains(&self, h: SequenceHash) -> bool {
        self.cache.contains_key(&h)
    }

    /// Registers block `b` (held by the caller, full and computed) under `seq_hash`.
    /// Returns false when another block already holds that hash (the block then stays
    /// unregistered and returns to the free stack when released).
    pub fn register(
        &mut self,
        b: BlockId,
        seq_hash: SequenceHash,
        local_hash: LocalBlockHash,
        parent: Option<SequenceHash>,
    ) -> bool {
        debug_assert!(self.refcnt[b as usize] > 0);
        if self.hash[b as usize].is_some() || self.cache.contains_key(&seq_hash) {
            return false;
        }
        self.cache.insert(seq_hash, b);
        self.hash[b as usize] = Some(seq_hash);
        self.local[b as usize] = local_hash;
        self.parent[b as usize] = parent;
        self.events.push(BlockEvent::Stored { block: b, seq_hash, local_hash, parent });
        true
    }

    /// Pins a registered block (active or cached) so that it keeps its content until
    /// [`unpin`](Self::unpin): false for a block that is not registered (its content may
    /// change) or out of range.
    pub fn pin(&mut self, b: BlockId) -> bool {
        let i = b as usize;
        if i >= self.capacity() || self.hash[i].is_none() {
            return false;
        }
        if self.refcnt[i] == 0 {
            self.lru_remove(b);
        }
        self.refcnt[i] += 1;
        self.pins[i] += 1;
        true
    }

    /// Drops a pin taken by [`pin`](Self::pin) (a block without pins is left alone).
    pub fn unpin(&mut self, b: BlockId) {
        let i = b as usize;
        if i < self.capacity() && self.pins[i] > 0 {
            self.pins[i] -= 1;
            self.release(b);
        }
    }

    /// Pins held on `b`.
    pub fn pins(&self, b: BlockId) -> u32 {
        self.pins.get(b as usize).copied().unwrap_or(0)
    }

    /// The sequence hash a block is registered under.
    pub fn hash_of(&self, b: BlockId) -> Option<SequenceHash> {
        self.hash.get(b as usize).copied().flatten()
    }

    /// Drops one reference to `b`. A block nobody holds becomes cached (if registered) or free.
    pub fn release(&mut self, b: BlockId) {
        let rc = &mut self.refcnt[b as usize];
        debug_assert!(*rc > 0, "double release of block {b}");
        if *rc == 0 {
            return;
        }
        *rc -= 1;
        if *rc == 0 {
            if self.hash[b as usize].is_some() {
                self.lru_push_back(b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// The reference count of `b`.
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refcnt[b as usize]
    }

    /// Drops every cached idle block (events record each removal).
    pub fn clear_cache(&mut self) {
        while let Some(b) = self.lru_pop_front() {
            if let Some(h) = self.hash[b as usize].take() {
                self.cache.remove(&h);
                self.events.push(BlockEvent::Removed { seq_hash: h });
            }
            self.free.push(b);
        }
    }

    /// Hands the recorded events to `f` in order and forgets them.
    pub fn drain_events(&mut self, mut f: impl FnMut(BlockEvent)) {
        for e in self.events.drain(..) {
            f(e);
        }
    }

    /// Every registered block as (parent, sequence hash, local hash), parents before their
    /// children (for a resync snapshot).
    pub fn snapshot(&self) -> Vec<(Option<SequenceHash>, SequenceHash, LocalBlockHash)> {
        let mut out: Vec<_> = self
            .cache
            .values()
            .map(|&b| (self.parent[b as usize], self.hash[b as usize], self.local[b as usize]))
            .filter_map(|(p, h, l)| Some((p, h?, l)))
            .collect();
        // Order by chain depth so that every parent precedes its children.
        let depth_of = |mut h: Option<SequenceHash>| {
            let mut d = 0usize;
            while let Some(x) = h {
                d += 1;
                h = self.cache.get(&x).and_then(|&b| self.parent[b as usize]);
                if d > self.capacity() {
                    break;
                }
            }
            d
        };
        out.sort_by_cached_key(|&(p, _, _)| depth_of(p));
        out
    }

    fn lru_push_back(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.lru_tail;
        self.next[i] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = b;
        } else {
            self.next[self.lru_tail as usize] = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.lru_head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.lru_len -= 1;
    }

    fn lru_pop_front(&mut self) -> Option<BlockId> {
        let b = self.lru_head;
        if b == NIL {
            return None;
        }
        self.lru_remove(b);
        Some(b)
    }

    /// Checks every internal invariant (tests and debug builds).
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.capacity();
        let mut in_free = vec![false; n];
        for &b in &self.free {
            if in_free[b as usize] {
                return Err(format!("block {b} twice on the free stack"));
            }
            in_free[b as usize] = true;
            if self.refcnt[b as usize] != 0 || self.hash[b as usize].is_some() {
                return Err(format!("free block {b} is referenced or registered"));
            }
        }
        let mut in_lru = vec![false; n];
        let mut cur = self.lru_head;
        let mut count = 0;
        while cur != NIL {
            let i = cur as usize;
            if in_lru[i] || in_free[i] {
                return Err(format!("block {cur} in the LRU twice or also free"));
            }
            in_lru[i] = true;
            if self.refcnt[i] != 0 || self.hash[i].is_none() {
                return Err(format!("LRU block {cur} is referenced or unregistered"));
            }
            count += 1;
            cur = self.next[i];
        }
        if count != self.lru_len {
            return Err(format!("LRU length {} but {count} linked", self.lru_len));
        }
        for i in 0..n {
            if self.refcnt[i] == 0 && !in_free[i] && !in_lru[i] {
                return Err(format!("block {i} is unreferenced but neither free nor cached"));
            }
            if let Some(h) = self.hash[i]
                && self.cache.get(&h) != Some(&(i as u32))
            {
                return Err(format!("block {i} registered but not in the cache map"));
            }
        }
        if self.cache.len() != self.hash.iter().filter(|h| h.is_some()).count() {
            return Err("cache map and registrations disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u64) -> SequenceHash {
        SequenceHash(v)
    }

    #[test]
    fn registered_blocks_are_reused_then_evicted_lru_first() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, h(1), LocalBlockHash(1), None));
        assert!(p.register(b, h(2), LocalBlockHash(2), Some(h(1))));
        p.release(a);
        p.release(b);
        assert_eq!(p.available(), 3);
        assert_eq!(p.cached_idle(), 2);
        // Reuse by hash.
        assert_eq!(p.acquire_cached(h(1)), Some(a));
        assert_eq!(p.cached_idle(), 1);
        p.release(a);
        // Fill: the free block first, then the LRU head (b, older than a now).
        let c = p.allocate().unwrap();
        assert!(c != a && c != b);
        let d = p.allocate().unwrap();
        assert_eq!(d, b);
        assert!(!p.contains(h(2)));
        let mut ev = Vec::new();
        p.drain_events(|e| ev.push(e));
        assert!(matches!(ev[0], BlockEvent::Stored { block, .. } if block == a));
        assert_eq!(ev.last(), Some(&BlockEvent::Removed { seq_hash: h(2) }));
        assert_eq!(ev.iter().filter(|e| matches!(e, BlockEvent::Stored { .. })).count(), 2);
        p.check_invariants().unwrap();
        assert_eq!(p.stats(), PoolStats { queries: 1, hits: 1, evictions: 1 });
    }

    #[test]
    fn duplicate_registration_is_refused_and_the_copy_is_freed() {
        let mut p = BlockPool::new(2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, h(7), LocalBlockHash(7), None));
        assert!(!p.register(b, h(7), LocalBlockHash(7), None));
        p.release(b);
        assert_eq!(p.cached_idle(), 0);
        p.release(a);
        assert_eq!(p.cached_idle(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn shared_blocks_need_every_release() {
        let mut p = BlockPool::new(1);
        let a = p.allocate().unwrap();
        p.register(a, h(1), LocalBlockHash(1), None);
        assert_eq!(p.acquire_cached(h(1)), Some(a));
        assert_eq!(p.refcount(a), 2);
        p.release(a);
        assert_eq!(p.allocate(), None, "still held once");
        p.release(a);
        assert_eq!(p.allocate(), Some(a), "evicted once idle");
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_pinned_block_keeps_its_content_until_unpinned() {
        let mut p = BlockPool::new(2);
        let a = p.allocate().unwrap();
        assert!(!p.pin(a), "an unregistered block cannot be pinned");
        p.register(a, h(1), LocalBlockHash(1), None);
        p.release(a);
        assert!(p.pin(a), "a cached idle block can");
        assert_eq!((p.refcount(a), p.pins(a), p.cached_idle()), (1, 1, 0));
        let b = p.allocate().unwrap();
        assert_ne!(b, a);
        assert_eq!(p.allocate(), None, "the pinned block is not evicted");
        p.unpin(a);
        p.unpin(a); // no pin left: nothing happens
        assert_eq!((p.refcount(a), p.cached_idle()), (0, 1));
        p.check_invariants().unwrap();
        assert_eq!(p.allocate(), Some(a));
    }
}

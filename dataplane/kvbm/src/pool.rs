//! One tier's slots: a fixed table of block-sized slots, deduplicated by sequence hash, with
//! an LRU of the ready ones that nobody pins. Pure bookkeeping: which slot holds which
//! block and in what state; the bytes are moved by the mover.
//!
//! Slot states:
//! * **free** — on the free stack;
//! * **filling** — claimed for a block whose copy is in flight (found by its hash, so that a
//!   block is never copied down twice, but not readable);
//! * **ready** — holds the block; in the LRU unless pinned (a copy out of it is in flight),
//!   evicted oldest first when a claim finds no free slot.

use std::collections::HashMap;

use kvx_proto::{LocalBlockHash, SequenceHash};

const NIL: u32 = u32::MAX;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMeta {
    /// The block's sequence hash.
    pub seq_hash: SequenceHash,
    /// Its local hash.
    pub local_hash: LocalBlockHash,
    /// The sequence hash of the block before it.
    pub parent: Option<SequenceHash>,
    /// Checksum of its bytes (disk tier; 0 where none is kept).
    pub checksum: u64,
    /// Requests that reused it.
    pub hits: u32,
}

/// State of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Empty.
    Free,
    /// A copy into it is in flight.
    Filling,
    /// Holds its block.
    Ready,
}

/// The slots of one tier.
#[derive(Debug)]
pub struct SlotPool {
    state: Vec<SlotState>,
    meta: Vec<Option<BlockMeta>>,
    pins: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    lru_len: usize,
    free: Vec<u32>,
    map: HashMap<SequenceHash, u32>,
    filling: usize,
}

impl SlotPool {
    /// `n` free slots.
    pub fn new(n: usize) -> Self {
        let n = n.min(NIL as usize - 1);
        SlotPool {
            state: vec![SlotState::Free; n],
            meta: vec![None; n],
            pins: vec![0; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            lru_len: 0,
            free: (0..n as u32).rev().collect(),
            map: HashMap::with_capacity(n),
            filling: 0,
        }
    }

    /// Slots in the tier.
    pub fn capacity(&self) -> usize {
        self.state.len()
    }

    /// Slots holding a block.
    pub fn ready(&self) -> usize {
        self.map.len() - self.filling
    }

    /// The slot of block `h` in any state but free.
    pub fn find(&self, h: SequenceHash) -> Option<u32> {
        self.map.get(&h).copied()
    }

    /// The slot holding block `h`, if it is ready.
    pub fn find_ready(&self, h: SequenceHash) -> Option<u32> {
        self.find(h).filter(|&s| self.state[s as usize] == SlotState::Ready)
    }

    /// A slot's state.
    pub fn state(&self, s: u32) -> SlotState {
        self.state.get(s as usize).copied().unwrap_or(SlotState::Free)
    }

    /// What a (filling or ready) slot holds.
    pub fn meta(&self, s: u32) -> Option<&BlockMeta> {
        self.meta.get(s as usize).and_then(Option::as_ref)
    }

    /// Sets the checksum of a slot's block.
    pub fn set_checksum(&mut self, s: u32, checksum: u64) {
        if let Some(Some(m)) = self.meta.get_mut(s as usize) {
            m.checksum = checksum;
        }
    }

    /// Claims a slot for `meta`'s block (which must not be here yet): a free one, or the
    /// least recently used ready one, whose block is returned as evicted. `None` when every
    /// slot is filling or pinned.
    pub fn claim(&mut self, meta: BlockMeta) -> Option<(u32, Option<BlockMeta>)> {
        debug_assert!(!self.map.contains_key(&meta.seq_hash));
        let (s, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let s = self.head;
                if s == NIL {
                    return None;
                }
                self.lru_remove(s);
                let old = self.meta[s as usize].take();
                if let Some(m) = &old {
                    self.map.remove(&m.seq_hash);
                }
                (s, old)
            }
        };
        self.state[s as usize] = SlotState::Filling;
        self.filling += 1;
        self.meta[s as usize] = Some(meta);
        self.map.insert(meta.seq_hash, s);
        Some((s, evicted))
    }

    /// The copy into a filling slot ended: it is ready (most recently used), or free again.
    pub fn filled(&mut self, s: u32, ok: bool) {
        let i = s as usize;
        if self.state.get(i) != Some(&SlotState::Filling) {
            return;
        }
        if ok {
            self.filling -= 1;
            self.state[i] = SlotState::Ready;
            if self.pins[i] == 0 {
                self.lru_push_back(s);
            }
        } else {
            self.release(s);
        }
    }

    /// `n` slots holding `blocks` (found at start-up), given least recently used first;
    /// entries out of range or repeating a slot or a block are skipped.
    pub fn with_blocks(n: usize, blocks: impl IntoIterator<Item = (u32, BlockMeta)>) -> Self {
        let mut p = SlotPool::new(n);
        p.free.clear();
        for (s, meta) in blocks {
            let i = s as usize;
            if i >= p.capacity() || p.meta[i].is_some() || p.map.contains_key(&meta.seq_hash) {
                continue;
            }
            p.state[i] = SlotState::Ready;
            p.meta[i] = Some(meta);
            p.map.insert(meta.seq_hash, s);
            p.lru_push_back(s);
        }
        p.free = (0..p.capacity() as u32).rev().filter(|&s| p.meta[s as usize].is_none()).collect();
        p
    }

    /// Pins a ready slot (a copy out of it is in flight): it is not evicted.
    pub fn pin(&mut self, s: u32) {
        let i = s as usize;
        if i >= self.capacity() || self.state[i] != SlotState::Ready {
            return;
        }
        if self.pins[i] == 0 {
            self.lru_remove(s);
        }
        self.pins[i] += 1;
    }

    /// Drops a pin.
    pub fn unpin(&mut self, s: u32) {
        let i = s as usize;
        if i >= self.capacity() || self.pins[i] == 0 {
            return;
        }
        self.pins[i] -= 1;
        if self.pins[i] == 0 && self.state[i] == SlotState::Ready {
            self.lru_push_back(s);
        }
    }

    /// A request reused the block in slot `s`: it becomes the most recently used and counts
    /// one more hit; returns the hits.
    pub fn touch(&mut self, s: u32) -> u32 {
        let i = s as usize;
        let Some(Some(m)) = self.meta.get_mut(i) else { return 0 };
        m.hits = m.hits.saturating_add(1);
        let hits = m.hits;
        if self.state[i] == SlotState::Ready && self.pins[i] == 0 {
            self.lru_remove(s);
            self.lru_push_back(s);
        }
        hits
    }

    /// Drops the block of an unpinned slot (a failed checksum); returns what it held.
    pub fn drop_slot(&mut self, s: u32) -> Option<BlockMeta> {
        let i = s as usize;
        if i >= self.capacity() || self.pins[i] > 0 || self.state[i] == SlotState::Free {
            return None;
        }
        let m = self.meta[i];
        self.release(s);
        m
    }

    /// Every ready block, least recently used first.
    pub fn ready_blocks(&self) -> Vec<(u32, BlockMeta)> {
        let mut out: Vec<(u32, BlockMeta)> = Vec::with_capacity(self.map.len());
        let mut s = self.head;
        while s != NIL {
            if let Some(m) = self.meta[s as usize] {
                out.push((s, m));
            }
            s = self.next[s as usize];
        }
        // Pinned ready slots are outside the LRU.
        for (i, st) in self.state.iter().enumerate() {
            if *st == SlotState::Ready
                && self.pins[i] > 0
                && let Some(m) = self.meta[i]
            {
                out.push((i as u32, m));
            }
        }
        out
    }

    fn release(&mut self, s: u32) {
        let i = s as usize;
        match self.state[i] {
            SlotState::Ready if self.pins[i] == 0 => self.lru_remove(s),
            SlotState::Filling => self.filling -= 1,
            _ => {}
        }
        if let Some(m) = self.meta[i].take() {
            self.map.remove(&m.seq_hash);
        }
        self.state[i] = SlotState::Free;
        self.free.push(s);
    }

    fn lru_push_back(&mut self, s: u32) {
        let i = s as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, s: u32) {
        let i = s as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.lru_len -= 1;
    }

    /// Checks the bookkeeping (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.capacity();
        let mut in_lru = vec![false; n];
        let (mut s, mut count) = (self.head, 0);
        while s != NIL {
            let i = s as usize;
            if in_lru[i] || self.state[i] != SlotState::Ready || self.pins[i] != 0 {
                return Err(format!("slot {s} in the LRU twice, not ready, or pinned"));
            }
            in_lru[i] = true;
            count += 1;
            s = self.next[i];
        }
        if count != self.lru_len {
            return Err(format!("LRU length {} but {count} linked", self.lru_len));
        }
        for (i, &st) in self.state.iter().enumerate() {
            let listed = self.free.contains(&(i as u32));
            match st {
                SlotState::Free if !listed || self.meta[i].is_some() => {
                    return Err(format!("free slot {i} not on the free stack or holding a block"));
                }
                SlotState::Ready if self.pins[i] == 0 && !in_lru[i] => {
                    return Err(format!("unpinned ready slot {i} outside the LRU"));
                }
                SlotState::Filling | SlotState::Ready => {
                    let Some(m) = self.meta[i] else {
                        return Err(format!("slot {i} in use without a block"));
                    };
                    if listed || self.map.get(&m.seq_hash) != Some(&(i as u32)) {
                        return Err(format!("slot {i} free-listed or missing from the map"));
                    }
                }
                _ => {}
            }
        }
        let filling = self.state.iter().filter(|&&s| s == SlotState::Filling).count();
        if filling != self.filling {
            return Err(format!("{filling} slots filling but {} counted", self.filling));
        }
        if self.map.len() + self.free.len() != n {
            return Err("map and free stack do not cover the slots".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(h: u64) -> BlockMeta {
        BlockMeta {
            seq_hash: SequenceHash(h),
            local_hash: LocalBlockHash(h),
            parent: None,
            checksum: 0,
            hits: 0,
        }
    }

    #[test]
    fn claims_fill_then_evict_the_least_recently_used_unpinned_block() {
        let mut p = SlotPool::new(2);
        let (a, e) = p.claim(m(1)).unwrap();
        assert!(e.is_none());
        assert_eq!(p.find_ready(SequenceHash(1)), None, "filling is not readable");
        assert_eq!(p.find(SequenceHash(1)), Some(a));
        p.filled(a, true);
        let (b, _) = p.claim(m(2)).unwrap();
        p.filled(b, true);
        assert_eq!(p.ready(), 2);
        p.touch(a); // a is now the most recent
        let (c, e) = p.claim(m(3)).unwrap();
        assert_eq!((c, e.map(|x| x.seq_hash)), (b, Some(SequenceHash(2))));
        p.check_invariants().unwrap();
        // Pinned and filling slots are not evicted.
        p.pin(a);
        assert!(p.claim(m(4)).is_none());
        p.unpin(a);
        assert_eq!(p.claim(m(4)).map(|(s, _)| s), Some(a));
        p.filled(c, false);
        assert_eq!(p.find(SequenceHash(3)), None, "a failed fill frees its slot");
        p.check_invariants().unwrap();
    }

    #[test]
    fn restored_and_dropped_blocks_keep_the_books_straight() {
        let mut p = SlotPool::with_blocks(3, [(2, m(7)), (2, m(8)), (1, m(7)), (9, m(9))]);
        p.check_invariants().unwrap();
        assert_eq!(p.ready(), 1, "a repeated slot or block, or one out of range, is skipped");
        assert_eq!(p.find_ready(SequenceHash(7)), Some(2));
        assert_eq!(p.touch(2), 1);
        p.pin(2);
        assert!(p.drop_slot(2).is_none(), "a pinned block stays");
        p.unpin(2);
        assert_eq!(p.drop_slot(2).map(|x| x.hits), Some(1));
        p.check_invariants().unwrap();
        assert_eq!(p.ready(), 0);
        let order: Vec<u32> = {
            for h in [1, 2, 3] {
                let (s, _) = p.claim(m(h)).unwrap();
                p.filled(s, true);
            }
            p.touch(p.find(SequenceHash(1)).unwrap());
            p.ready_blocks().iter().map(|(_, b)| b.seq_hash.0 as u32).collect()
        };
        assert_eq!(order, vec![2, 3, 1]);
        p.check_invariants().unwrap();
    }
}

//! A flat open-addressing hash table for the index's hot maps (tree edges, per-worker block
//! tables): 16-byte slots holding key and value together, linear probing, backward-shift
//! deletion (no tombstones), load factor at most 5/8.
//!
//! A lookup in a general-purpose Swiss table touches a control-byte group and then the slot,
//! two cache misses in a table larger than the cache; here the key sits in the slot, so a
//! lookup usually costs one. Keys are block hashes (already uniform) or small integers mixed
//! with them; the slot index comes from the top bits of a multiplicative mix. The
//! `std::collections::HashMap` is its reference twin in the parity tests below.

/// A slot type: a key and a value packed together, with a reserved all-zero empty state.
pub(crate) trait Slot: Copy {
    /// What slots are looked up by.
    type Key: Copy + PartialEq;
    /// The empty slot.
    const EMPTY: Self;
    /// Whether this is the empty slot.
    fn is_empty(&self) -> bool;
    /// The slot's key.
    fn key(&self) -> Self::Key;
    /// A well-mixed 64-bit hash of a key (the table uses its top bits).
    fn hash(key: &Self::Key) -> u64;
}

/// Finalizer of a 64-bit key: top bits depend on every key bit.
#[inline]
pub(crate) fn mix(k: u64) -> u64 {
    let x = (k ^ (k >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// The table.
#[derive(Debug, Clone)]
pub(crate) struct Table<S: Slot> {
    slots: Vec<S>,
    len: usize,
    /// `64 − log2(slots.len())`.
    shift: u32,
}

const MIN_SLOTS: usize = 8;

impl<S: Slot> Default for Table<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Slot> Table<S> {
    pub(crate) fn new() -> Self {
        Table { slots: vec![S::EMPTY; MIN_SLOTS], len: 0, shift: 64 - MIN_SLOTS.trailing_zeros() }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn home(&self, key: &S::Key) -> usize {
        (S::hash(key) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The position of `key`'s slot, or of the empty slot ending its probe.
    #[inline]
    fn find(&self, key: &S::Key) -> (usize, bool) {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.is_empty() {
                return (i, false);
            }
            if s.key() == *key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: &S::Key) -> Option<&S> {
        match self.find(key) {
            (i, true) => Some(&self.slots[i]),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: &S::Key) -> Option<&mut S> {
        match self.find(key) {
            (i, true) => Some(&mut self.slots[i]),
            _ => None,
        }
    }

    /// Loads the home slot of each key (a software prefetch: independent loads overlap, so
    /// a later lookup of these keys finds its line in cache).
    #[inline]
    pub(crate) fn touch(&self, keys: impl Iterator<Item = S::Key>) {
        let mut acc = false;
        for k in keys {
            acc ^= self.slots[self.home(&k)].is_empty();
        }
        std::hint::black_box(acc);
    }

    /// Inserts or replaces the slot with `slot`'s key (which must not be empty).
    pub(crate) fn insert(&mut self, slot: S) {
        debug_assert!(!slot.is_empty());
        if (self.len + 1) * 8 > self.slots.len() * 5 {
            self.grow();
        }
        let (i, found) = self.find(&slot.key());
        self.slots[i] = slot;
        if !found {
            self.len += 1;
        }
    }

    /// Removes and returns the slot with `key`.
    pub(crate) fn remove(&mut self, key: &S::Key) -> Option<S> {
        let (mut i, found) = self.find(key);
        if !found {
            return None;
        }
        let out = self.slots[i];
        let mask = self.mask();
        // Backward shift: move later members of the cluster into the hole when their home
        // position allows it, so every probe sequence stays unbroken.
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.is_empty() {
                break;
            }
            let home = self.home(&s.key());
            // `s` may move to `i` when `home` is not cyclically within (i, j].
            let within = if i <= j { i < home && home <= j } else { i < home || home <= j };
            if !within {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = S::EMPTY;
        self.len -= 1;
        Some(out)
    }

    fn grow(&mut self) {
        let n = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, vec![S::EMPTY; n]);
        self.shift -= 1;
        let mask = self.mask();
        for s in old.into_iter().filter(|s| !s.is_empty()) {
            let mut i = self.home(&s.key());
            while !self.slots[i].is_empty() {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    /// Every slot, in table order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &S> {
        self.slots.iter().filter(|s| !s.is_empty())
    }

    /// Empties the table (keeping no memory) and returns its slots.
    pub(crate) fn take_all(&mut self) -> impl Iterator<Item = S> + use<S> {
        let old = std::mem::take(self);
        old.slots.into_iter().filter(|s| !s.is_empty())
    }

    /// Keeps the slots for which `f` returns true (`f` may change them, not their keys).
    pub(crate) fn retain(&mut self, mut f: impl FnMut(&mut S) -> bool) {
        let mut kept = Table::new();
        for mut s in self.take_all() {
            if f(&mut s) {
                kept.insert(s);
            }
        }
        *self = kept;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Kv {
        k: u64,
        v: u32,
    }

    impl Slot for Kv {
        type Key = u64;
        const EMPTY: Self = Kv { k: 0, v: 0 };
        fn is_empty(&self) -> bool {
            self.v == 0
        }
        fn key(&self) -> u64 {
            self.k
        }
        fn hash(key: &u64) -> u64 {
            // A weak hash on purpose: long clusters exercise the probing and the shifts.
            mix(key % 5)
        }
    }

    proptest! {
        /// Inserts, replacements, removals, lookups and retains agree with `HashMap`.
        #[test]
        fn parity_with_hashmap(ops in prop::collection::vec((0u8..4, 0u64..40, 1u32..1000), 0..400)) {
            let mut t: Table<Kv> = Table::new();
            let mut m: HashMap<u64, u32> = HashMap::new();
            for (op, k, v) in ops {
                match op {
                    0 | 1 => {
                        t.insert(Kv { k, v });
                        m.insert(k, v);
                    }
                    2 => prop_assert_eq!(t.remove(&k).map(|s| s.v), m.remove(&k)),
                    _ => {
                        t.retain(|s| s.v % 7 != k as u32 % 7);
                        m.retain(|_, v| *v % 7 != k as u32 % 7);
                    }
                }
                prop_assert_eq!(t.len(), m.len());
                for q in 0..40 {
                    prop_assert_eq!(t.get(&q).map(|s| s.v), m.get(&q).copied());
                }
                prop_assert!(t.len() * 8 <= t.capacity() * 5);
            }
            let mut all: Vec<(u64, u32)> = t.iter().map(|s| (s.k, s.v)).collect();
            all.sort();
            let mut want: Vec<(u64, u32)> = m.into_iter().collect();
            want.sort();
            prop_assert_eq!(&all, &want);
            let taken: usize = t.take_all().count();
            prop_assert_eq!(taken, want.len());
            prop_assert_eq!(t.len(), 0);
        }
    }

    #[test]
    fn get_mut_changes_values() {
        let mut t: Table<Kv> = Table::new();
        for k in 0..100 {
            t.insert(Kv { k, v: 1 });
        }
        if let Some(s) = t.get_mut(&50) {
            s.v = 9;
        }
        assert_eq!(t.get(&50).map(|s| s.v), Some(9));
        assert_eq!(t.get(&100), None);
        assert_eq!(t.len(), 100);
    }
}

//! Hash maps with a fast, fixed-seed hasher for the router's integer keys (block hashes,
//! node indices, worker and request ids).

use std::collections::HashMap;

use foldhash::fast::FixedState;

/// A `HashMap` keyed through foldhash's fast hasher (fixed seed: deterministic layouts).
pub(crate) type FastMap<K, V> = HashMap<K, V, FixedState>;

/// An empty [`FastMap`] with room for `n` entries.
pub(crate) fn with_capacity<K, V>(n: usize) -> FastMap<K, V> {
    HashMap::with_capacity_and_hasher(n, FixedState::default())
}

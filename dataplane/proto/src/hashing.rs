//! Token-block hashing: the one implementation engine, router and kvbm all call.
//!
//! A sequence is cut into full blocks of `block_size` tokens. A block's *local hash* is
//! XXH3-64 of its token ids as u32 little-endian bytes; its *sequence hash* chains the parent's
//! sequence hash with the local hash: `seq[0] = local[0]`,
//! `seq[i] = XXH3-64(le(seq[i-1]) ‖ le(local[i]))`. The seed is 1337, plus the salt's
//! contribution when a tenant or adapter isolates its cache (Dynamo's scheme, so events and
//! traces of Dynamo-compatible engines hash alike). Only full blocks are hashed.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The base seed of every block hash.
pub const XXH3_SEED: u64 = 1337;

/// Hash of one block's tokens, independent of what precedes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block together with its whole prefix: equal sequence hashes mean equal
/// token prefixes (up to hash collisions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u64);

/// The seed for a salt (tenant, cache namespace) and an adapter name; empty strings count
/// as absent, so the default seed is [`XXH3_SEED`].
pub fn seed_for(salt: Option<&str>, lora: Option<&str>) -> u64 {
    let mut seed = XXH3_SEED;
    if let Some(l) = lora.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0));
    }
    if let Some(s) = salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(s.as_bytes(), 1));
    }
    seed
}

/// The local hash of one block of tokens.
pub fn local_hash(tokens: &[u32], seed: u64) -> LocalBlockHash {
    let mut buf = [0u8; 4 * 64];
    if tokens.len() <= 64 {
        for (c, t) in buf.chunks_exact_mut(4).zip(tokens) {
            c.copy_from_slice(&t.to_le_bytes());
        }
        return LocalBlockHash(xxh3_64_with_seed(&buf[..4 * tokens.len()], seed));
    }
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
}

/// The sequence hash of a block given its parent's.
pub fn sequence_hash(
    parent: Option<SequenceHash>,
    local: LocalBlockHash,
    seed: u64,
) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(p) => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&p.0.to_le_bytes());
            b[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&b, seed))
        }
    }
}

/// Hashes a token sequence block by block, incrementally: feed tokens as they arrive
/// (prompt, then generated tokens) and collect each block's hashes when it fills.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
    pending: Vec<u32>,
    last: Option<SequenceHash>,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens (at least 1) and a seed from [`seed_for`].
    pub fn new(block_size: usize, seed: u64) -> Self {
        let block_size = block_size.max(1);
        BlockHasher { block_size, seed, pending: Vec::with_capacity(block_size), last: None }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The sequence hash of the last full block, if any.
    pub fn last(&self) -> Option<SequenceHash> {
        self.last
    }

    /// Adds one token; returns the block's hashes when it completes one.
    pub fn push(&mut self, token: u32) -> Option<(LocalBlockHash, SequenceHash)> {
        self.pending.push(token);
        if self.pending.len() < self.block_size {
            return None;
        }
        let local = local_hash(&self.pending, self.seed);
        let seq = sequence_hash(self.last, local, self.seed);
        self.pending.clear();
        self.last = Some(seq);
        Some((local, seq))
    }

    /// The hashes of every full block of `tokens` (a one-shot helper).
    pub fn hash_all(
        block_size: usize,
        seed: u64,
        tokens: &[u32],
    ) -> Vec<(LocalBlockHash, SequenceHash)> {
        let mut h = BlockHasher::new(block_size, seed);
        tokens.iter().filter_map(|&t| h.push(t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_matches_the_definition() {
        let toks: Vec<u32> = (0..40).collect();
        let hs = BlockHasher::hash_all(16, XXH3_SEED, &toks);
        assert_eq!(hs.len(), 2, "only full blocks are hashed");
        let l0 = xxh3_64_with_seed(
            &toks[..16].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<_>>(),
            1337,
        );
        assert_eq!(hs[0].0, LocalBlockHash(l0));
        assert_eq!(hs[0].1, SequenceHash(l0));
        let l1 = xxh3_64_with_seed(
            &toks[16..32].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<_>>(),
            1337,
        );
        let mut b = l0.to_le_bytes().to_vec();
        b.extend_from_slice(&l1.to_le_bytes());
        assert_eq!(hs[1].1, SequenceHash(xxh3_64_with_seed(&b, 1337)));
    }

    #[test]
    fn equal_prefixes_hash_equal_and_salt_separates() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let ha = BlockHasher::hash_all(16, XXH3_SEED, &a);
        let hb = BlockHasher::hash_all(16, XXH3_SEED, &b);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2].1, hb[2].1);
        assert_ne!(ha[3].1, hb[3].1, "a changed block changes every later sequence hash");
        assert_eq!(ha[3].0, hb[3].0, "local hashes do not depend on the prefix");
        let salted = BlockHasher::hash_all(16, seed_for(Some("tenant-a"), None), &a);
        assert_ne!(salted[0].1, ha[0].1);
        assert_eq!(seed_for(Some(""), Some("")), XXH3_SEED);
    }

    #[test]
    fn long_blocks_hash_like_short_ones() {
        let toks: Vec<u32> = (0..200).collect();
        let bytes: Vec<u8> = toks[..100].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(local_hash(&toks[..100], 7), LocalBlockHash(xxh3_64_with_seed(&bytes, 7)));
    }
}

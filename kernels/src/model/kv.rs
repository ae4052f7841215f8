//! The paged KV cache: fixed-size blocks of token slots, allocated once.
//!
//! Layout: `[block][layer][kv_head][slot][head_dim]` in f16, for keys and values
//! separately: one head's keys within a block are contiguous for the attention dot
//! products, and a block's layers lie together, so the blocks in use (the pool hands out
//! low ids first) occupy one compact region and a block is copied in one piece. Which block
//! holds which positions of a sequence is the caller's business
//! (block tables); this type only stores and serves rows.

use half::f16;

use super::{LlamaConfig, ModelError};
use crate::ops::PagedHead;

/// Keys and values of every layer for `n_blocks` blocks of `block_size` tokens.
pub struct KvCache {
    n_layer: usize,
    n_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Elements of one block in one layer (keys or values).
    per_layer: usize,
    /// Keys of every block, block after block (one allocation: see [`KvCache::new`]).
    k: Vec<f16>,
    /// Values, as `k`.
    v: Vec<f16>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("n_layer", &self.n_layer)
            .field("n_blocks", &self.n_blocks)
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl KvCache {
    /// Allocates the cache (zeroed; pages are touched on first write).
    pub fn new(cfg: &LlamaConfig, n_blocks: usize, block_size: usize) -> Result<Self, ModelError> {
        if n_blocks == 0 || block_size == 0 {
            return Err(ModelError::Config(
                "the KV cache needs at least one block of one slot".into(),
            ));
        }
        let per_layer = block_size
            .checked_mul(cfg.kv_dim())
            .ok_or_else(|| ModelError::Config("KV cache size overflows".into()))?;
        let total = per_layer
            .checked_mul(cfg.n_layer)
            .and_then(|v| v.checked_mul(n_blocks))
            .ok_or_else(|| ModelError::Config("KV cache size overflows".into()))?;
        // Allocated as zeroed memory (`u16` zeros take the allocator's zeroed path, which
        // `f16` does not), so the pages stay untouched until blocks are first written: no
        // start-up pass over the whole budget, and resident memory grows with use. Not on
        // huge pages: a first write would then zero 2 MiB at once inside a step (measured
        // at 3.3 % of a 16-request `kvx generate`, against 0.5 % with 4 KiB pages) for no
        // measurable gain in attention.
        let alloc = || bytemuck::allocation::cast_vec::<u16, f16>(vec![0u16; total]);
        Ok(KvCache {
            n_layer: cfg.n_layer,
            n_blocks,
            block_size,
            n_kv_heads: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            per_layer,
            k: alloc(),
            v: alloc(),
        })
    }

    /// Blocks `n_blocks` of `cfg` would take, for a memory budget in bytes.
    pub fn blocks_for_budget(cfg: &LlamaConfig, block_size: usize, bytes: u64) -> usize {
        let per_block = (cfg.kv_bytes_per_token() * block_size.max(1)) as u64;
        (bytes / per_block.max(1)) as usize
    }

    /// Blocks in the cache.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        2 * self.n_layer * self.n_blocks * self.block_size * self.n_kv_heads * self.head_dim * 2
    }

    /// Stores the keys and values of one token (`k`, `v`: `n_kv_heads * head_dim` floats).
    pub(crate) fn write(
        &mut self,
        layer: usize,
        block: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
        to_f16: fn(&[f32], &mut [f16]),
    ) {
        let hd = self.head_dim;
        let base = (block * self.n_layer + layer) * self.per_layer;
        for h in 0..self.n_kv_heads {
            let at = base + (h * self.block_size + slot) * hd;
            to_f16(&k[h * hd..(h + 1) * hd], &mut self.k[at..at + hd]);
            to_f16(&v[h * hd..(h + 1) * hd], &mut self.v[at..at + hd]);
        }
    }

    /// Key and value views of one KV head of a sequence in `layer`.
    pub(crate) fn heads<'a>(
        &'a self,
        layer: usize,
        kv_head: usize,
        block_table: &'a [u32],
    ) -> (PagedHead<'a>, PagedHead<'a>) {
        let mk = |data: &'a [f16]| PagedHead {
            data,
            block_table,
            block_size: self.block_size,
            block_stride: self.n_layer * self.per_layer,
            head_dim: self.head_dim,
            kv_head,
        };
        let at = layer * self.per_layer;
        (mk(&self.k[at..]), mk(&self.v[at..]))
    }

    /// Bytes of one block in one layer (keys or values).
    pub fn block_bytes_per_layer(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim * 2
    }

    /// Copies block `src` onto block `dst` in every layer (copy-on-write of shared prefixes).
    pub fn copy_block(&mut self, src: usize, dst: usize) -> Result<(), ModelError> {
        if src >= self.n_blocks || dst >= self.n_blocks {
            return Err(ModelError::Config("block id out of range".into()));
        }
        let n = self.n_layer * self.per_layer;
        self.k.copy_within(src * n..(src + 1) * n, dst * n);
        self.v.copy_within(src * n..(src + 1) * n, dst * n);
        Ok(())
    }
}

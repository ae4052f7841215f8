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

/// Elements (f16) in 64 bytes: the alignment of the cache's data.
const ALIGN: usize = 32;

/// Keys and values of every layer for `n_blocks` blocks of `block_size` tokens.
pub struct KvCache {
    n_layer: usize,
    n_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Elements of one block in one layer (keys or values).
    per_layer: usize,
    /// Keys of every block, block after block (one allocation: see [`KvCache::new`]),
    /// starting `k_at` elements in, on a 64-byte boundary: rows (128 bytes for
    /// 64-dimensional heads) then fill whole cache lines and no vector load of a row splits
    /// across two.
    k: Vec<f16>,
    /// Values, as `k` (from `v_at`).
    v: Vec<f16>,
    k_at: usize,
    v_at: usize,
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
        let alloc = || {
            // 32 elements more, so that the data can start on a 64-byte boundary.
            let v = bytemuck::allocation::cast_vec::<u16, f16>(vec![0u16; total + ALIGN]);
            let at = v.as_ptr().align_offset(ALIGN * 2).min(ALIGN);
            (v, at)
        };
        let ((k, k_at), (v, v_at)) = (alloc(), alloc());
        Ok(KvCache {
            n_layer: cfg.n_layer,
            n_blocks,
            block_size,
            n_kv_heads: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            per_layer,
            k,
            v,
            k_at,
            v_at,
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
            let (ka, va) = (self.k_at + at, self.v_at + at);
            to_f16(&k[h * hd..(h + 1) * hd], &mut self.k[ka..ka + hd]);
            to_f16(&v[h * hd..(h + 1) * hd], &mut self.v[va..va + hd]);
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
        (mk(&self.k[self.k_at + at..]), mk(&self.v[self.v_at + at..]))
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
        let (k, v) = (self.k_at, self.v_at);
        self.k.copy_within(k + src * n..k + (src + 1) * n, k + dst * n);
        self.v.copy_within(v + src * n..v + (src + 1) * n, v + dst * n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeKind;

    #[test]
    fn rows_start_on_cache_lines_and_keep_their_values() {
        let cfg = LlamaConfig {
            arch: "llama".into(),
            n_vocab: 32,
            n_embd: 128,
            n_layer: 3,
            n_head: 2,
            n_head_kv: 2,
            head_dim: 64,
            n_ff: 256,
            rope_dims: 64,
            rope_base: 10000.0,
            rope_kind: RopeKind::Norm,
            norm_eps: 1e-5,
            context_length: 64,
        };
        let to_f16 = |x: &[f32], out: &mut [f16]| {
            for (o, &x) in out.iter_mut().zip(x) {
                *o = f16::from_f32(x);
            }
        };
        // Several caches, so that some allocation does not happen to be aligned already.
        for n_blocks in 1..6 {
            let mut kv = KvCache::new(&cfg, n_blocks, 16).unwrap();
            let row = |i: f32| -> Vec<f32> { (0..128).map(|j| i + j as f32).collect() };
            for b in 0..n_blocks {
                kv.write(2, b, 5, &row(b as f32), &row(100.0 + b as f32), to_f16);
            }
            if n_blocks > 1 {
                kv.copy_block(0, n_blocks - 1).unwrap();
            }
            let table: Vec<u32> = (0..n_blocks as u32).collect();
            for h in 0..2 {
                let (keys, values) = kv.heads(2, h, &table);
                for p in [0, 5, 16 * n_blocks - 1] {
                    let (k, v) = (keys.row(p).unwrap(), values.row(p).unwrap());
                    assert_eq!(k.as_ptr().align_offset(64), 0, "{n_blocks} blocks, position {p}");
                    assert_eq!(v.as_ptr().align_offset(64), 0, "{n_blocks} blocks, position {p}");
                }
                for b in 0..n_blocks {
                    let src = if b == n_blocks - 1 && n_blocks > 1 { 0 } else { b } as f32;
                    let (k, v) = (keys.row(b * 16 + 5).unwrap(), values.row(b * 16 + 5).unwrap());
                    assert_eq!(k[0].to_f32(), src + (h * 64) as f32);
                    assert_eq!(v[1].to_f32(), 100.0 + src + (h * 64 + 1) as f32);
                }
            }
        }
    }
}

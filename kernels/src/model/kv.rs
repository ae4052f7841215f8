//! The paged KV cache: fixed-size blocks of token slots, allocated once.
//!
//! Layout: `[block][layer][kv_head][slot][head_dim]` in f16, for keys and values
//! separately: one head's keys within a block are contiguous for the attention dot
//! products, and a block's layers lie together, so the blocks in use (the pool hands out
//! low ids first) occupy one compact region and a block is copied in one piece. Which block
//! holds which positions of a sequence is the caller's business
//! (block tables); this type only stores and serves rows.

use std::ptr::NonNull;

use half::f16;

use super::{LlamaConfig, ModelError};
use crate::ops::PagedHead;

/// Elements (f16) in 64 bytes: the alignment of the cache's data.
const ALIGN: usize = 32;

/// Memory lent to a [`KvCache`] by its owner — a transfer agent's registered region, so that
/// a peer can write blocks straight into the cache (disaggregated prefill).
///
/// # Safety
///
/// An implementor promises that [`as_ptr`](Self::as_ptr) points to [`len`](Self::len) bytes
/// aligned to 64, readable and writable for as long as the value lives (the cache owns it
/// and drops it last), and that nothing but the cache and the writers it lends blocks to
/// touches them: a writer (a transfer peer) writes only into the blocks lent to it, and the
/// cache's user reads none of those until the writer has finished and said so.
pub unsafe trait KvMemory: Send + Sync {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Bytes available.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a cache's bytes are, in [`KvCache::with_memory`]'s memory: keys of every block
/// from `k_offset`, values from `v_offset`, `block_bytes` of each per block, block after
/// block (`[layer][kv_head][slot][dim]` inside a block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Bytes the memory must hold.
    pub bytes: usize,
    /// Where the keys start.
    pub k_offset: usize,
    /// Where the values start (64-byte aligned).
    pub v_offset: usize,
    /// Bytes of one block's keys (and of its values).
    pub block_bytes: usize,
}

impl KvLayout {
    /// The byte ranges `(offset, len)` of blocks `first..first + n` (keys, then values): two
    /// spans, since consecutive blocks lie together.
    pub fn spans(&self, first: usize, n: usize) -> [(usize, usize); 2] {
        let len = n * self.block_bytes;
        [
            (self.k_offset + first * self.block_bytes, len),
            (self.v_offset + first * self.block_bytes, len),
        ]
    }
}

/// The memory behind a cache.
enum Storage {
    /// Two zeroed allocations of its own (padded for alignment).
    Owned { _k: Vec<f16>, _v: Vec<f16> },
    /// Memory its owner lent it.
    Lent(#[allow(dead_code)] Box<dyn KvMemory>),
}

/// Keys and values of every layer for `n_blocks` blocks of `block_size` tokens.
pub struct KvCache {
    n_layer: usize,
    n_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Elements of one block in one layer (keys or values).
    per_layer: usize,
    /// Elements of the keys (and of the values): `n_blocks` blocks, block after block.
    elems: usize,
    /// Keys of every block, on a 64-byte boundary: rows (128 bytes for 64-dimensional
    /// heads) then fill whole cache lines and no vector load of a row splits across two.
    k: NonNull<f16>,
    /// Values, as `k`.
    v: NonNull<f16>,
    /// What `k` and `v` point into; dropped with the cache.
    _storage: Storage,
}

// SAFETY: the cache is the only user of the memory `k` and `v` point to (its own
// allocations, or lent memory whose contract, `KvMemory`, excludes any other user but the
// writers of lent blocks, which the cache's user does not read meanwhile); shared access
// only reads, and writes take `&mut self`, as for the `Vec`s it used to hold.
unsafe impl Send for KvCache {}
// SAFETY: as for `Send`: `&KvCache` only reads.
unsafe impl Sync for KvCache {}

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
        let (per_layer, total) = Self::sizes(cfg, n_blocks, block_size)?;
        // Allocated as zeroed memory (`u16` zeros take the allocator's zeroed path, which
        // `f16` does not), so the pages stay untouched until blocks are first written: no
        // start-up pass over the whole budget, and resident memory grows with use. On huge
        // pages where the system grants them: a decode step reads its sequences' rows from
        // blocks scattered over the cache (a step of 8 sequences at 200 positions touches
        // ~9,000 pages of 4 KiB, more than the second-level TLB holds); with 2 MiB pages its
        // attention took 4.0 instead of 4.6 ms (kernels/PERF.md). The price is a first
        // write that zeroes 2 MiB at once inside a step, once per page for the life of the
        // cache; where fresh memory zeroes slowly (~0.3 GB/s on the KVM guest of
        // kernels/PERF.md) a fresh process pays it visibly: +1 s of system time over a 13 s
        // serving run there (which still came out faster), +0.3 s and +80 ms of TTFT on a 2 s
        // 16-request `kvx generate`. Under the THP `defrag` setting `madvise` such a fault may
        // also compact memory.
        let alloc = || {
            // 32 elements more, so that the data can start on a 64-byte boundary.
            let mut v = bytemuck::allocation::cast_vec::<u16, f16>(vec![0u16; total + ALIGN]);
            crate::cpu::advise_huge_pages(v.as_ptr().cast(), std::mem::size_of_val(&v[..]));
            let at = v.as_ptr().align_offset(ALIGN * 2).min(ALIGN);
            let p = NonNull::from(&mut v[at..]).cast::<f16>();
            (v, p)
        };
        let ((kv, k), (vv, v)) = (alloc(), alloc());
        Ok(Self::build(
            cfg,
            n_blocks,
            block_size,
            per_layer,
            total,
            k,
            v,
            Storage::Owned { _k: kv, _v: vv },
        ))
    }

    /// Where the cache's bytes go in lent memory (see [`KvCache::with_memory`]).
    pub fn layout(
        cfg: &LlamaConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> Result<KvLayout, ModelError> {
        let (_, total) = Self::sizes(cfg, n_blocks, block_size)?;
        let half = (total * 2).next_multiple_of(ALIGN * 2);
        Ok(KvLayout {
            bytes: 2 * half,
            k_offset: 0,
            v_offset: half,
            block_bytes: total / n_blocks * 2,
        })
    }

    /// A cache in memory its owner lends it (laid out as [`KvCache::layout`] says; fresh
    /// memory from `mmap` reads as zeros, and any bits are valid f16 values).
    pub fn with_memory(
        cfg: &LlamaConfig,
        n_blocks: usize,
        block_size: usize,
        mem: Box<dyn KvMemory>,
    ) -> Result<Self, ModelError> {
        let (per_layer, total) = Self::sizes(cfg, n_blocks, block_size)?;
        let layout = Self::layout(cfg, n_blocks, block_size)?;
        let base = mem.as_ptr();
        if mem.len() < layout.bytes || base.is_null() || base.align_offset(ALIGN * 2) != 0 {
            return Err(ModelError::Config(format!(
                "lent KV memory of {} bytes at {base:p} cannot hold {} bytes on 64-byte lines",
                mem.len(),
                layout.bytes
            )));
        }
        let at = |off: usize| {
            // SAFETY: `off` is within the `layout.bytes <= mem.len()` bytes at `base`.
            let p = unsafe { base.add(off) };
            NonNull::new(p.cast::<f16>()).ok_or_else(|| ModelError::Config("null KV memory".into()))
        };
        let (k, v) = (at(layout.k_offset)?, at(layout.v_offset)?);
        Ok(Self::build(cfg, n_blocks, block_size, per_layer, total, k, v, Storage::Lent(mem)))
    }

    /// Elements of one block in one layer, and of all keys (or values).
    fn sizes(
        cfg: &LlamaConfig,
        n_blocks: usize,
        block_size: usize,
    ) -> Result<(usize, usize), ModelError> {
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
            .filter(|t| t.checked_mul(4).is_some())
            .ok_or_else(|| ModelError::Config("KV cache size overflows".into()))?;
        Ok((per_layer, total))
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: &LlamaConfig,
        n_blocks: usize,
        block_size: usize,
        per_layer: usize,
        elems: usize,
        k: NonNull<f16>,
        v: NonNull<f16>,
        storage: Storage,
    ) -> Self {
        KvCache {
            n_layer: cfg.n_layer,
            n_blocks,
            block_size,
            n_kv_heads: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            per_layer,
            elems,
            k,
            v,
            _storage: storage,
        }
    }

    /// Keys of every block.
    fn keys(&self) -> &[f16] {
        // SAFETY: `k` points to `elems` f16 values the cache owns or was lent (see the type's
        // `Send` impl); shared borrows of `self` only read them.
        unsafe { std::slice::from_raw_parts(self.k.as_ptr(), self.elems) }
    }

    /// Values of every block.
    fn values(&self) -> &[f16] {
        // SAFETY: as in `keys`.
        unsafe { std::slice::from_raw_parts(self.v.as_ptr(), self.elems) }
    }

    /// Keys and values, writable.
    fn keys_values_mut(&mut self) -> (&mut [f16], &mut [f16]) {
        // SAFETY: as in `keys`, and `&mut self` excludes every other borrow; keys and values
        // are disjoint (two allocations, or two ranges `layout` places apart).
        let k = unsafe { std::slice::from_raw_parts_mut(self.k.as_ptr(), self.elems) };
        // SAFETY: as for `k`; the values do not overlap the keys.
        let v = unsafe { std::slice::from_raw_parts_mut(self.v.as_ptr(), self.elems) };
        (k, v)
    }

    /// Touches every page of the cache now, so that it is resident from the start: a server's
    /// memory then stays flat as the prefix cache fills its budget, and no step ever waits on
    /// a first-touch page fault. Returns the bytes touched.
    pub fn prefault(&mut self) -> usize {
        const PAGE_ELEMS: usize = 4096 / std::mem::size_of::<f16>();
        let (k, v) = self.keys_values_mut();
        let mut bytes = 0;
        for s in [k, v] {
            for i in (0..s.len()).step_by(PAGE_ELEMS) {
                // The value is unchanged; `black_box` keeps the store (and its fault).
                s[i] = std::hint::black_box(s[i]);
            }
            bytes += std::mem::size_of_val(s);
        }
        bytes
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
        let (n_kv_heads, block_size) = (self.n_kv_heads, self.block_size);
        let (keys, values) = self.keys_values_mut();
        for h in 0..n_kv_heads {
            let at = base + (h * block_size + slot) * hd;
            to_f16(&k[h * hd..(h + 1) * hd], &mut keys[at..at + hd]);
            to_f16(&v[h * hd..(h + 1) * hd], &mut values[at..at + hd]);
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
        (mk(&self.keys()[at..]), mk(&self.values()[at..]))
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
        let (keys, values) = self.keys_values_mut();
        keys.copy_within(src * n..(src + 1) * n, dst * n);
        values.copy_within(src * n..(src + 1) * n, dst * n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeKind;

    /// Lent memory for the tests: a 64-byte aligned heap buffer.
    struct Heap(Vec<u8>, usize, usize);

    // SAFETY: the buffer lives as long as the value, the offset keeps 64-byte alignment,
    // and nothing else touches it.
    unsafe impl KvMemory for Heap {
        fn as_ptr(&self) -> *mut u8 {
            self.0[self.1..].as_ptr().cast_mut()
        }
        fn len(&self) -> usize {
            self.2
        }
    }

    fn heap(bytes: usize) -> Heap {
        let v = vec![0u8; bytes + 64];
        let at = v.as_ptr().align_offset(64);
        Heap(v, at, bytes)
    }

    #[test]
    fn a_cache_in_lent_memory_puts_each_block_where_the_layout_says() {
        let cfg = config();
        let (nb, bs) = (5, 16);
        let layout = KvCache::layout(&cfg, nb, bs).unwrap();
        assert_eq!(layout.block_bytes, 3 * 128 * bs * 2, "layers × kv_dim × slots × f16");
        assert!(KvCache::with_memory(&cfg, nb, bs, Box::new(heap(layout.bytes - 1))).is_err());
        let mem = heap(layout.bytes);
        let base = mem.as_ptr() as usize;
        let mut kv = KvCache::with_memory(&cfg, nb, bs, Box::new(mem)).unwrap();
        let row: Vec<f32> = (0..128).map(|j| j as f32 + 1.0).collect();
        kv.write(1, 3, 2, &row, &row, to_f16);
        let table = [3u32];
        let (keys, values) = kv.heads(1, 0, &table);
        let (k, v) = (keys.row(2).unwrap(), values.row(2).unwrap());
        assert_eq!(k[5].to_f32(), 6.0);
        // The row lies inside block 3's key and value spans.
        let [(ko, kl), (vo, vl)] = layout.spans(3, 1);
        let (kp, vp) = (k.as_ptr() as usize - base, v.as_ptr() as usize - base);
        assert!(kp >= ko && kp + 128 <= ko + kl, "{kp} not in {ko}+{kl}");
        assert!(vp >= vo && vp + 128 <= vo + vl, "{vp} not in {vo}+{vl}");
        let [(k2, l2), _] = layout.spans(2, 2);
        assert_eq!((k2 + l2, l2), (ko + kl, 2 * kl), "consecutive blocks lie together");
    }

    fn to_f16(x: &[f32], out: &mut [f16]) {
        for (o, &x) in out.iter_mut().zip(x) {
            *o = f16::from_f32(x);
        }
    }

    fn config() -> LlamaConfig {
        LlamaConfig {
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
        }
    }

    #[test]
    fn prefaulting_touches_every_byte_and_changes_none() {
        let cfg = config();
        let mut kv = KvCache::new(&cfg, 40, 16).unwrap();
        {
            let (k, v) = kv.keys_values_mut();
            for (i, x) in k.iter_mut().chain(v.iter_mut()).enumerate() {
                *x = f16::from_f32((i % 251) as f32);
            }
        }
        let before: Vec<f16> = kv.keys().iter().chain(kv.values()).copied().collect();
        assert_eq!(kv.prefault(), 2 * kv.elems * std::mem::size_of::<f16>());
        let after: Vec<f16> = kv.keys().iter().chain(kv.values()).copied().collect();
        assert!(before == after, "prefaulting changed the cache");
    }

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

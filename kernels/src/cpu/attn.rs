//! The operands of attention over a paged f16 KV cache: the cache rows of one KV head
//! ([`PagedHead`], [`NextRows`]), ggml's code path ([`AttnMode`]), and what
//! [`crate::ops::attention`] hands a level's fused kernel ([`AttnHeadJob`], [`AttnHeadFn`],
//! [`AttnScratch`]). Defined in `cpu` because the fused kernels (`arch/x86_64/attn.rs`) read
//! them; re-exported from [`crate::ops`].

use half::f16;

/// One sequence's keys or values for one KV head, spread over fixed-size blocks.
///
/// `data` starts at block 0 of a layer's cache; block `b` of the layer starts
/// `b * block_stride` elements in and holds `[kv_head][slot][head_dim]` (a cache of one
/// layer has `block_stride = n_kv_heads * block_size * head_dim`; [`crate::model::KvCache`]
/// keeps a block's layers together, so its stride spans every layer).
#[derive(Debug, Clone, Copy)]
pub struct PagedHead<'a> {
    /// The cache from the layer's part of block 0 on (see the type's docs).
    pub data: &'a [f16],
    /// Blocks of the sequence, in position order.
    pub block_table: &'a [u32],
    /// Token slots per block.
    pub block_size: usize,
    /// Elements from the start of one block to the next.
    pub block_stride: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Which KV head.
    pub kv_head: usize,
}

impl<'a> PagedHead<'a> {
    /// Where this head's rows of cache block `block` start in `data` (the block's
    /// `block_size` rows of `head_dim` follow one another).
    #[inline]
    pub fn block_start(&self, block: u32) -> usize {
        block as usize * self.block_stride + self.kv_head * self.block_size * self.head_dim
    }

    /// Asks for the rows of positions `lo..hi` to be fetched into L2 (a hint; rows outside
    /// the cache are skipped).
    pub fn prefetch_range(&self, lo: usize, hi: usize) {
        if self.block_size == 0 {
            return;
        }
        let mut p = lo;
        while p < hi {
            let Some(&block) = self.block_table.get(p / self.block_size) else { break };
            let slot = p % self.block_size;
            let rows = (hi - p).min(self.block_size - slot);
            let start = self.block_start(block) + slot * self.head_dim;
            if let Some(run) = self.data.get(start..start + rows * self.head_dim) {
                super::prefetch_l2(bytemuck::cast_slice(run));
            }
            p += rows;
        }
    }

    /// The row of position `p`, or `None` if the block table or cache is too short.
    #[inline]
    pub fn row(&self, p: usize) -> Option<&'a [f16]> {
        let block = *self.block_table.get(p / self.block_size)?;
        let start = self.block_start(block) + (p % self.block_size) * self.head_dim;
        self.data.get(start..start + self.head_dim)
    }
}

/// The cache rows of the (token, KV head) a thread attends to next. Decode attention reads
/// each sequence's rows once, from blocks scattered over memory: the fused kernel fetches
/// these into L2 a share at a time while it computes the current unit (all at once, the
/// requests fill the core's miss buffers and stall it).
#[derive(Debug, Clone, Copy)]
pub struct NextRows<'a> {
    /// Keys of the next unit's KV head.
    pub keys: PagedHead<'a>,
    /// Values of the next unit's KV head.
    pub values: PagedHead<'a>,
    /// Positions it attends to.
    pub n_pos: usize,
}

impl NextRows<'_> {
    /// Asks for share `i` of `parts` of the rows (positions `i·n/parts..(i+1)·n/parts`).
    pub fn prefetch_part(&self, i: usize, parts: usize) {
        let parts = parts.max(1);
        let (lo, hi) = (i * self.n_pos / parts, (i + 1) * self.n_pos / parts);
        self.keys.prefetch_range(lo, hi);
        self.values.prefetch_range(lo, hi);
    }
}

/// Which of ggml's two attention code paths a token's arithmetic follows: multi-token
/// prompt batches (tinyBLAS matrix products) or single-token steps (`vec_dot_f16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnMode {
    /// A token of a prompt evaluated together with at least one other prompt token.
    Prefill,
    /// A token evaluated alone (generated tokens, one-token prompts).
    Decode,
}

/// Per-thread working memory of [`attention`](crate::ops::attention).
#[derive(Debug, Clone)]
pub struct AttnScratch {
    pub(crate) q16: Vec<f16>,
    pub(crate) scores: Vec<f32>,
    pub(crate) probs: Vec<f16>,
    pub(crate) classes: Vec<f32>,
    pub(crate) wide: Vec<f64>,
    /// Row offsets of positions (fused kernels).
    pub(crate) offs: Vec<usize>,
    /// Register-sized scratch of the fused kernels (their queries and score accumulators:
    /// [`REG_SCRATCH`] of 64 bytes, zeroed once here instead of per call).
    pub(crate) regs: Vec<Reg64>,
    /// 16 key rows in f32 (a tile's chunk of keys, converted once for all its tokens).
    pub(crate) keys32: Vec<Reg64>,
}

/// 64 bytes aligned as a 512-bit register: scratch that the x86 kernels view as registers.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
pub(crate) struct Reg64(pub(crate) [f32; 16]);

/// Registers of [`AttnScratch::regs`]: 16 score accumulators and [`MAX_FUSED_HEAD`] / 16
/// query chunks per head of a group of [`MAX_ATTN_GROUP`].
pub(crate) const REG_SCRATCH: usize = MAX_ATTN_GROUP * (16 + MAX_FUSED_HEAD / 16);

/// The operands of one query head's attention, as [`attention`](crate::ops::attention)
/// hands them to the level's fused kernels ([`Kernels::attn_head`](super::Kernels::attn_head),
/// [`Kernels::attn_free`](super::Kernels::attn_free)).
#[derive(Debug, Clone, Copy)]
pub struct AttnHeadJob<'a> {
    /// Which of ggml's code paths the arithmetic follows (`attn_head`); for `attn_free`
    /// only whether the rows are read once (decode) or again (prompt).
    pub mode: AttnMode,
    /// The query heads (`heads × head_dim` f32; `attn_head` rounds them to f16).
    pub q: &'a [f32],
    /// Query heads sharing these keys and values (at most 4).
    pub heads: usize,
    /// Keys of the head's KV head.
    pub keys: &'a PagedHead<'a>,
    /// Values of the head's KV head.
    pub values: &'a PagedHead<'a>,
    /// Positions attended to (`0..n_pos`).
    pub n_pos: usize,
    /// Score scale (`1/sqrt(head_dim)`).
    pub scale: f32,
    /// The level's softmax.
    pub softmax: fn(&mut [f32], f32),
    /// Rows to fetch for the caller's next unit while this one computes (a hint).
    pub next: Option<&'a NextRows<'a>>,
}

/// A level's fused attention of a group of query heads sharing one KV head (`out`:
/// `heads × head_dim`): returns `false`, having written nothing to `out`, when it does not
/// cover the operands' shapes (the caller then takes the generic path, which also reports
/// malformed operands).
pub type AttnHeadFn = fn(&AttnHeadJob<'_>, &mut AttnScratch, &mut [f32]) -> bool;

/// Consecutive prompt tokens whose attention [`AttnTileFn`] computes together, at most.
pub const ATTN_TILE: usize = 4;

/// The head size (elements) the tile kernels take.
pub(crate) const TILE_HEAD: usize = 64;

/// The operands of a tile of consecutive prompt tokens of one sequence, each with the same
/// query heads of one KV head, in the free association: token `j` attends to `n0 + j`
/// positions. The kernel converts each key row once for the tile, each value row once per
/// set of (token, head) pairs.
#[derive(Debug, Clone, Copy)]
pub struct AttnTileJob<'a> {
    /// Each token's query heads (`heads × head_dim` f32); the first `tokens` are used.
    pub q: [&'a [f32]; ATTN_TILE],
    /// Tokens in the tile (1 to [`ATTN_TILE`]).
    pub tokens: usize,
    /// Query heads per token sharing these keys and values (at most [`MAX_ATTN_GROUP`]).
    pub heads: usize,
    /// Keys of the head's KV head.
    pub keys: &'a PagedHead<'a>,
    /// Values of the head's KV head.
    pub values: &'a PagedHead<'a>,
    /// Positions the first token attends to (`0..n0`; token `j`, `0..n0 + j`).
    pub n0: usize,
    /// Score scale (`1/sqrt(head_dim)`).
    pub scale: f32,
    /// The level's softmax ([`crate::ops::attention_tile_free`] sets it).
    pub softmax: fn(&mut [f32], f32),
}

/// A level's free-association attention of a tile of prompt tokens (`out[j]`: token `j`'s
/// `heads × head_dim` outputs): each token's outputs have the bits [`AttnHeadFn`] (the level's
/// `attn_free`) gives it alone. Returns `false` when it does not cover the operands' shapes
/// (the caller then attends token by token, overwriting `out`).
pub type AttnTileFn = fn(&AttnTileJob<'_>, &mut AttnScratch, &mut [&mut [f32]]) -> bool;

impl AttnScratch {
    /// Buffers for heads of `head_dim` over up to `max_ctx` positions (the scores of a tile's
    /// [`ATTN_TILE`] tokens of [`MAX_ATTN_GROUP`] heads each: 64 KiB per 1,024 positions).
    pub fn new(head_dim: usize, max_ctx: usize) -> Self {
        AttnScratch {
            q16: vec![f16::ZERO; head_dim],
            scores: vec![0.0; ATTN_TILE * MAX_ATTN_GROUP * max_ctx.max(1)],
            probs: vec![f16::ZERO; max_ctx.max(1)],
            classes: vec![0.0; MAX_ATTN_GROUP * 64 * head_dim],
            wide: vec![0.0; head_dim],
            offs: vec![0; max_ctx.max(1)],
            regs: vec![Reg64::default(); REG_SCRATCH],
            keys32: vec![Reg64::default(); 16 * (TILE_HEAD / 16)],
        }
    }
}

/// Query heads per KV head that [`attention_group`](crate::ops::attention_group) computes
/// together at most; scratch is sized for it.
pub const MAX_ATTN_GROUP: usize = 4;

/// The widest head (elements) the fused attention kernels take (the free one any multiple
/// of 16 up to it; ggml's multiples of 64, or of 16 for prompt tokens).
pub const MAX_FUSED_HEAD: usize = 256;

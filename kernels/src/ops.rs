//! Tensor operations built from the dispatched kernels: quantized matrix × vector/matrix,
//! activation quantization, rotary embedding and attention over a paged f16 KV cache.
//!
//! These functions allocate nothing; callers own all buffers (scratch is sized once).
//!
//! The rope functions and the attention operand types are defined in [`crate::cpu`], beside
//! the SIMD kernels that share them, and re-exported here.

pub use crate::cpu::attn::{
    ATTN_TILE, AttnHeadFn, AttnHeadJob, AttnMode, AttnScratch, AttnTileFn, AttnTileJob,
    MAX_ATTN_GROUP, NextRows, PagedHead,
};
pub use crate::cpu::rope::{rope_cache, rope_neox, rope_norm};

use bytemuck::Pod;
use half::f16;

use crate::KernelError;
use crate::cpu::Kernels;
use crate::cpu::disjoint::{Disjoint, DisjointOut};
use crate::cpu::exact::SumShape;
use crate::cpu::gemm::{Acts, GemmJob, Line};
use crate::cpu::lanes::{
    LANE_ROWS, LaneAct, LaneJob, LaneMatrix, TILE_MIN_TOKENS, tile_record_lines,
};
use crate::par::{ThreadPool, split_range};
use crate::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, GgmlType, cast_blocks};
use crate::quant_k::{BlockQ4K, BlockQ6K, BlockQ8K};

/// A read-only weight matrix of `rows` × `cols` in a ggml type, rows contiguous (ggml's
/// `ne0 = cols`, `ne1 = rows`), usually borrowed straight from a memory-mapped GGUF file.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    ty: GgmlType,
    act_ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
    lanes: Option<&'a LaneMatrix>,
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` elements of `ty`, aligned for
    /// its blocks, and that kvx has kernels for `ty`.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let act_ty = quant::vec_dot_type(ty).ok_or(KernelError::UnsupportedType(ty))?;
        if !quant::is_supported_weight(ty) {
            return Err(KernelError::UnsupportedType(ty));
        }
        let row_bytes = ty
            .row_size(cols as u64)
            .ok_or(KernelError::Shape("row length is not a whole number of blocks"))?
            as usize;
        if row_bytes.checked_mul(rows) != Some(data.len()) {
            return Err(KernelError::Shape("matrix data size does not match its shape"));
        }
        if data.as_ptr().align_offset(block_align(ty)) != 0 {
            return Err(KernelError::Shape("matrix data is not aligned for its block type"));
        }
        Ok(QMatrix { ty, act_ty, rows, cols, row_bytes, data, lanes: None })
    }

    /// The same matrix with its row-lane copy (`lanes` must be `data` repacked), which
    /// [`matmul`] uses wherever the kernel table has a row-lane kernel.
    pub fn with_lanes(mut self, lanes: &'a LaneMatrix) -> Result<Self, KernelError> {
        if (lanes.ty(), lanes.rows(), lanes.cols()) != (self.ty, self.rows, self.cols) {
            return Err(KernelError::Shape("row-lane copy does not match the matrix"));
        }
        self.lanes = Some(lanes);
        Ok(self)
    }

    /// Whether `k` computes products with this matrix in the row-lane arithmetic.
    pub fn uses_lanes(&self, k: &Kernels) -> bool {
        self.lanes.is_some() && k.lanes.is_some()
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// The type activations must be quantized to (see [`quantize_activations`]).
    pub fn act_ty(&self) -> GgmlType {
        self.act_ty
    }
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// Dequantizes row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if r >= self.rows || out.len() != self.cols {
            return Err(KernelError::Shape("row index or output length out of range"));
        }
        quant::dequantize_row(self.ty, self.row(r), out).map_err(KernelError::Quant)
    }
}

fn block_align(ty: GgmlType) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::Q8_K => 4,
        _ => 2,
    }
}

/// Bytes needed to hold `n_rows` activation rows of `cols` elements quantized for `act_ty`.
pub fn activation_bytes(act_ty: GgmlType, cols: usize, n_rows: usize) -> Option<usize> {
    Some(act_ty.row_size(cols as u64)? as usize * n_rows)
}

/// Quantizes `n_rows` rows of `cols` floats (`x.len() == n_rows * cols`) into `out` in the
/// activation type `act_ty`; returns the used prefix of `out`.
pub fn quantize_activations<'o>(
    k: &Kernels,
    act_ty: GgmlType,
    x: &[f32],
    cols: usize,
    out: &'o mut [u8],
) -> Result<&'o [u8], KernelError> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::Shape("activation length is not a multiple of cols"));
    }
    let n_rows = x.len() / cols;
    let row =
        act_ty.row_size(cols as u64).ok_or(KernelError::Shape("cols not whole blocks"))? as usize;
    let need = row * n_rows;
    if out.len() < need || out.as_ptr().align_offset(4) != 0 {
        return Err(KernelError::Shape("activation buffer too small or misaligned"));
    }
    let out = &mut out[..need];
    let bad = KernelError::Shape("activation buffer misaligned");
    // Rows are whole blocks and lie one after another, so the rows' blocks are one run of
    // blocks, each quantized on its own: one call for all of them gives every row's bytes
    // (and lets a kernel that quantizes several blocks together run across rows).
    match act_ty {
        GgmlType::Q8_0 => (k.quantize_q8_0)(x, quant::cast_blocks_mut(out).ok_or(bad)?),
        GgmlType::Q8_1 => (k.quantize_q8_1)(x, quant::cast_blocks_mut(out).ok_or(bad)?),
        GgmlType::Q8_K => (k.quantize_q8_k)(x, quant::cast_blocks_mut(out).ok_or(bad)?),
        GgmlType::F16 => (k.f32_to_f16)(x, quant::cast_blocks_mut(out).ok_or(bad)?),
        GgmlType::BF16 => (k.f32_to_bf16)(x, quant::cast_blocks_mut(out).ok_or(bad)?),
        GgmlType::F32 => out.copy_from_slice(bytemuck::cast_slice(x)),
        other => return Err(KernelError::UnsupportedType(other)),
    }
    Ok(out)
}

/// `out[t][r] = W[r] · x[t]` for `t < n_tok`, `r < w.rows()`: `xq` holds `n_tok` activation
/// rows already quantized for `w.act_ty()`, `out` is `n_tok × w.rows()` row-major.
///
/// Every output has the bits of the level's dot product of row `r` and token `t` (for
/// `Q4_0`/`Q4_1`/`Q8_0` at the SIMD levels computed by the row-lane kernels of
/// [`crate::cpu::lanes`] when `w` carries a row-lane copy and the level has them, else by the
/// tiled kernels of [`crate::cpu::gemm`]); the one exception is a copy repacked for
/// [`crate::cpu::lanes::LaneMath::Fast`], whose outputs follow that arithmetic instead. Rows
/// are split across the pool's threads; each weight row is read once per chunk of tokens.
///
/// The packed activations live in a per-thread [`MatmulScratch`] that grows to the largest
/// call and is then reused (no allocation in steady state); [`matmul_with`] takes the
/// scratch from the caller instead.
pub fn matmul(
    k: &Kernels,
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    xq: &[u8],
    n_tok: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => matmul_with(k, pool, w, xq, n_tok, out, &mut s),
        // Only reachable by re-entering `matmul` from inside a kernel, which nothing does.
        Err(_) => matmul_with(k, pool, w, xq, n_tok, out, &mut MatmulScratch::new()),
    })
}

thread_local! {
    /// The scratch of [`matmul`] and [`matmul_many`] on this thread.
    static SCRATCH: std::cell::RefCell<MatmulScratch> =
        const { std::cell::RefCell::new(MatmulScratch::new()) };
}

/// `xq` as the activation blocks of `act_ty`.
fn typed_acts(act_ty: GgmlType, xq: &[u8]) -> Result<Acts<'_>, KernelError> {
    let bad = KernelError::Shape("activation buffer misaligned");
    match act_ty {
        GgmlType::Q8_0 => Ok(Acts::Q8_0(cast_blocks(xq).ok_or(bad)?)),
        GgmlType::Q8_1 => Ok(Acts::Q8_1(cast_blocks(xq).ok_or(bad)?)),
        other => Err(KernelError::UnsupportedType(other)),
    }
}

/// Working memory of [`matmul_with`]: the activations repacked for the matrix kernels.
#[derive(Default)]
pub struct MatmulScratch {
    lines: Vec<Line>,
    acts: Vec<LaneAct>,
}

impl std::fmt::Debug for MatmulScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bytes = self.lines.len() * 64 + self.acts.len() * size_of::<LaneAct>();
        f.debug_struct("MatmulScratch").field("bytes", &bytes).finish()
    }
}

impl MatmulScratch {
    /// An empty scratch; [`matmul_with`] grows it on first use.
    pub const fn new() -> Self {
        MatmulScratch { lines: Vec::new(), acts: Vec::new() }
    }

    /// A scratch big enough for products of `w` with up to `max_tok` tokens at level `k`,
    /// so that no call allocates.
    pub fn for_matrix(k: &Kernels, w: &QMatrix<'_>, max_tok: usize) -> Self {
        let mut s = Self::new();
        s.reserve(k, w, max_tok);
        s
    }

    /// Grows the scratch (if needed) for products of `w` with up to `max_tok` tokens; a
    /// scratch reserved for every matrix of a model and the step size serves them all.
    pub fn reserve(&mut self, k: &Kernels, w: &QMatrix<'_>, max_tok: usize) {
        if w.uses_lanes(k) {
            let nb = w.cols / w.ty.block_size();
            let need = max_tok * nb;
            if self.acts.len() < need {
                self.acts.resize(need, LaneAct::default());
            }
            // The tile records, where products of this many tokens run on tiles (the most
            // lines any token count up to `max_tok` takes).
            let tiles =
                k.lanes.zip(w.lanes).is_some_and(|(l, lw)| l.wants_tiles(lw.math(), max_tok));
            if tiles {
                let lines = (TILE_MIN_TOKENS..=max_tok).map(|n| tile_record_lines(n, nb)).max();
                self.grow(lines.unwrap_or(0));
            }
        } else if let Some(g) = k.gemm.for_type(w.ty) {
            let nb = w.cols / w.ty.block_size();
            let need = (1..=max_tok.min(2)).chain([max_tok]).map(|n| (g.lines)(n, nb)).max();
            self.grow(need.unwrap_or(0));
        }
    }

    fn grow(&mut self, lines: usize) {
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; 64]));
        }
    }
}

/// [`matmul`] with caller-owned scratch: allocates only when `scratch` is smaller than this
/// call needs (see [`MatmulScratch::reserve`]).
pub fn matmul_with(
    k: &Kernels,
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    xq: &[u8],
    n_tok: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) -> Result<(), KernelError> {
    let act_row = w.act_ty.row_size(w.cols as u64).unwrap_or(0) as usize;
    if xq.len() != act_row * n_tok || out.len() != n_tok * w.rows {
        return Err(KernelError::Shape("matmul operand sizes do not match"));
    }
    if n_tok == 0 {
        return Ok(());
    }
    let out = DisjointOut::new(out);
    if let (Some(lw), Some(lk)) = (w.lanes, k.lanes) {
        let nb = lw.nb();
        let need = n_tok * nb;
        if scratch.acts.len() < need {
            scratch.acts.resize(need, LaneAct::default());
        }
        let packed = &mut scratch.acts[..need];
        if !pack_lanes(pool, lk.pack, w.ty, typed_acts(w.act_ty, xq)?, n_tok, nb, packed) {
            return Err(KernelError::Shape("matmul activations do not fit the kernel"));
        }
        let tiles = lk.wants_tiles(lw.math(), n_tok).then(|| {
            crate::cpu::lanes::tile_records(packed, n_tok, nb, &mut scratch.lines);
            &scratch.lines[..]
        });
        let job = LaneJob { w: lw, acts: packed, n_tok, out: &out, tiles };
        let run = |i: usize, n: usize| {
            // Thread `i` writes only the rows of its own `split_range`.
            (lk.run)(&job, split_range(w.rows, i, n, LANE_ROWS));
        };
        pool.run(&run);
        return Ok(());
    }
    if let Some(g) = k.gemm.for_type(w.ty) {
        let acts = typed_acts(w.act_ty, xq)?;
        let nb = w.cols / w.ty.block_size();
        let lines = (g.lines)(n_tok, nb);
        scratch.grow(lines);
        let packed = &mut scratch.lines[..lines];
        if !(g.pack)(acts, n_tok, nb, packed) {
            return Err(KernelError::Shape("matmul activations do not fit the kernel"));
        }
        let job = GemmJob {
            w: w.data,
            row_bytes: w.row_bytes,
            nb,
            n_tok,
            packed,
            out: &out,
            stride: w.rows,
        };
        let run = |i: usize, n: usize| {
            // Thread `i` writes only the rows of its own `split_range`.
            (g.run)(&job, split_range(w.rows, i, n, g.row_align));
        };
        pool.run(&run);
        return Ok(());
    }
    let job = |i: usize, n: usize| {
        // Thread `i` writes only the rows of its own `split_range`.
        let rows = split_range(w.rows, i, n, 4);
        matmul_rows(k, w, xq, n_tok, rows, &out);
    };
    pool.run(&job);
    Ok(())
}

/// `N` products with one input: `outs[m] = ws[m] · xq` for every token, as [`matmul`] would
/// compute each (the same bits). Where every matrix has a row-lane copy the level can use,
/// the activations are packed once and all products run in one dispatch of the pool
/// (each thread takes its share of every matrix); otherwise one [`matmul`] after another.
/// `xq` is quantized for `ws[0].act_ty()`, which every matrix must share.
pub fn matmul_many<const N: usize>(
    k: &Kernels,
    pool: &ThreadPool,
    ws: [&QMatrix<'_>; N],
    xq: &[u8],
    n_tok: usize,
    outs: [&mut [f32]; N],
) -> Result<(), KernelError> {
    let Some(first) = ws.first() else { return Ok(()) };
    if ws.iter().any(|w| w.act_ty != first.act_ty || w.cols != first.cols) {
        return Err(KernelError::Shape("matmul_many needs matrices of one input type and width"));
    }
    let lk = match k.lanes {
        Some(lk) if ws.iter().all(|w| w.lanes.is_some() && w.ty == first.ty) => lk,
        _ => {
            for (w, out) in ws.into_iter().zip(outs) {
                matmul(k, pool, w, xq, n_tok, out)?;
            }
            return Ok(());
        }
    };
    let act_row = first.act_ty.row_size(first.cols as u64).unwrap_or(0) as usize;
    if xq.len() != act_row * n_tok || ws.iter().zip(&outs).any(|(w, o)| o.len() != n_tok * w.rows) {
        return Err(KernelError::Shape("matmul operand sizes do not match"));
    }
    if n_tok == 0 {
        return Ok(());
    }
    let acts = typed_acts(first.act_ty, xq)?;
    SCRATCH.with(|s| {
        let mut s = s.try_borrow_mut().map_err(|_| KernelError::Shape("matmul_many re-entered"))?;
        let MatmulScratch { lines: tile_lines, acts: act_buf } = &mut *s;
        let nb = first.cols / first.ty.block_size();
        let need = n_tok * nb;
        if act_buf.len() < need {
            act_buf.resize(need, LaneAct::default());
        }
        let packed = &mut act_buf[..need];
        if !pack_lanes(pool, lk.pack, first.ty, acts, n_tok, nb, packed) {
            return Err(KernelError::Shape("matmul activations do not fit the kernel"));
        }
        let outs = outs.map(DisjointOut::new);
        // Tile records once for every matrix that runs on tiles.
        let tiles = ws.iter().any(|w| w.lanes.is_some_and(|lw| lk.wants_tiles(lw.math(), n_tok)));
        if tiles {
            crate::cpu::lanes::tile_records(packed, n_tok, nb, tile_lines);
        }
        let lines = &tile_lines[..];
        let jobs: [Option<LaneJob<'_>>; N] = std::array::from_fn(|m| {
            ws[m].lanes.map(|lw| LaneJob {
                w: lw,
                acts: packed,
                n_tok,
                out: &outs[m],
                tiles: lk.wants_tiles(lw.math(), n_tok).then_some(lines),
            })
        });
        let run = |i: usize, n: usize| {
            // Thread `i` writes only the rows of its own `split_range` of each matrix.
            for (job, w) in jobs.iter().zip(&ws) {
                if let Some(job) = job {
                    (lk.run)(job, split_range(w.rows, i, n, LANE_ROWS));
                }
            }
        };
        pool.run(&run);
        Ok(())
    })
}

/// Tokens from which the row-lane activation records are packed by every thread of the
/// pool (one extra dispatch) instead of by the caller alone.
const PARALLEL_PACK_TOKENS: usize = 64;

/// The level's row-lane `pack` with the tokens split over the pool for large steps.
fn pack_lanes(
    pool: &ThreadPool,
    pack: crate::cpu::lanes::PackFn,
    ty: GgmlType,
    acts: Acts<'_>,
    n_tok: usize,
    nb: usize,
    dst: &mut [LaneAct],
) -> bool {
    if n_tok < PARALLEL_PACK_TOKENS || pool.n_threads() == 1 || dst.len() != n_tok * nb {
        return pack(ty, acts, n_tok, nb, dst);
    }
    let ok = std::sync::atomic::AtomicBool::new(true);
    let out = Disjoint::new(dst);
    let job = |i: usize, n: usize| {
        // Thread `i` writes only the records of its own tokens.
        let r = split_range(n_tok, i, n, 1);
        let done = acts
            .blocks(r.start * nb, r.len() * nb)
            .is_some_and(|a| pack(ty, a, r.len(), nb, out.range(r.start * nb, r.len() * nb)));
        if !done {
            ok.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    };
    pool.run(&job);
    ok.load(std::sync::atomic::Ordering::Relaxed)
}

/// The serial kernel of [`matmul`] over a range of rows.
fn matmul_rows(
    k: &Kernels,
    w: &QMatrix<'_>,
    xq: &[u8],
    n_tok: usize,
    rows: std::ops::Range<usize>,
    out: &DisjointOut,
) {
    match w.ty {
        GgmlType::Q4_0 => {
            rows_typed::<BlockQ4_0, BlockQ8_0>(k.dot_q4_0_q8_0, w, xq, n_tok, rows, out)
        }
        GgmlType::Q4_1 => {
            rows_typed::<BlockQ4_1, BlockQ8_1>(k.dot_q4_1_q8_1, w, xq, n_tok, rows, out)
        }
        GgmlType::Q8_0 => {
            rows_typed::<BlockQ8_0, BlockQ8_0>(k.dot_q8_0_q8_0, w, xq, n_tok, rows, out)
        }
        GgmlType::Q4_K => {
            rows_typed::<BlockQ4K, BlockQ8K>(k.dot_q4_k_q8_k, w, xq, n_tok, rows, out)
        }
        GgmlType::Q6_K => {
            rows_typed::<BlockQ6K, BlockQ8K>(k.dot_q6_k_q8_k, w, xq, n_tok, rows, out)
        }
        GgmlType::F16 => rows_typed::<f16, f16>(k.dot_f16, w, xq, n_tok, rows, out),
        GgmlType::BF16 => rows_typed::<u16, u16>(k.dot_bf16, w, xq, n_tok, rows, out),
        GgmlType::F32 => rows_typed::<f32, f32>(k.dot_f32, w, xq, n_tok, rows, out),
        // `QMatrix::new` admits only the types above.
        _ => {}
    }
}

#[inline]
fn rows_typed<W: Pod, A: Pod>(
    dot: fn(&[W], &[A]) -> f32,
    w: &QMatrix<'_>,
    xq: &[u8],
    n_tok: usize,
    rows: std::ops::Range<usize>,
    out: &DisjointOut,
) {
    // Alignment and sizes were validated by `QMatrix::new` and `matmul`; a failed cast
    // leaves the output untouched rather than panicking.
    let Some(acts) = cast_blocks::<A>(xq) else { return };
    let per_tok = acts.len() / n_tok;
    const TILE: usize = 4;
    let mut r = rows.start;
    while r < rows.end {
        let r_end = (r + TILE).min(rows.end);
        for t in 0..n_tok {
            let a = &acts[t * per_tok..(t + 1) * per_tok];
            for rr in r..r_end {
                let Some(wr) = cast_blocks::<W>(w.row(rr)) else { return };
                out.set(t * w.rows + rr, dot(wr, a));
            }
        }
        r = r_end;
    }
}

/// Causal attention of one query head over positions `0..n_pos` of a paged cache, with
/// ggml's precision and association: the query is rounded to f16 before `q·k`, the softmax
/// runs in f32 with an f64 sum, the probabilities are rounded to f16 before weighting `v`,
/// and both matrix products associate as ggml's code path for `mode` does at this level.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    k: &Kernels,
    mode: AttnMode,
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
    sc: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_attention(q, keys, values, n_pos, sc, out)?;
    if let Some(fused) = k.attn_head {
        let job = AttnHeadJob {
            mode,
            q,
            heads: 1,
            keys,
            values,
            n_pos,
            scale,
            softmax: k.softmax,
            next: None,
        };
        if fused(&job, sc, out) {
            return Ok(());
        }
    }
    attention_generic(k, mode, q, keys, values, n_pos, scale, sc, out)
}

/// [`attention_group`] in the free association for a tile of consecutive prompt tokens of
/// one sequence (token `j` of `job.tokens` attends to `job.n0 + j` positions; `out[j]` gets
/// its `heads × head_dim` outputs), each token's bits those [`attention_group`] gives it
/// alone (with the level's softmax, whatever `job` names): `true` when the level's tile
/// kernel ([`Kernels::attn_free_tile`]) covered it, `false` when the caller must attend
/// token by token (overwriting whatever the kernel may have left in `out`).
pub fn attention_tile_free(
    k: &Kernels,
    job: &AttnTileJob<'_>,
    sc: &mut AttnScratch,
    out: &mut [&mut [f32]],
) -> bool {
    let job = AttnTileJob { softmax: k.softmax, ..*job };
    k.attn_free.is_some() && k.attn_free_tile.is_some_and(|tile| tile(&job, sc, out))
}

/// [`attention`] of `heads` query heads that share one KV head (`q`: `heads × head_dim`,
/// `out`: `heads × v_head_dim`, head after head); the fused kernels load each key and value
/// once for the group.
///
/// In ggml's association (`free` false) each head's output has the bits [`attention`] gives
/// it alone. In the free association of the non-exact arithmetics (`free`:
/// [`crate::model::Arith::Fast`], [`crate::model::Arith::Split`]) — nearer the model's own
/// math than ggml's, which rounds the query and the probabilities to f16, and one association
/// for prompt and decode tokens (`mode` only says whether the rows are read once, for
/// prefetching) — each head's output has the bits [`attention_free_twin`] gives it, by the
/// level's fused kernel ([`Kernels::attn_free`]); where the level has none for these shapes
/// ([`attention_free_covers`]), it is ggml's.
#[allow(clippy::too_many_arguments)]
pub fn attention_group(
    k: &Kernels,
    free: bool,
    mode: AttnMode,
    q: &[f32],
    heads: usize,
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
    next: Option<&NextRows<'_>>,
    sc: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (hd, vd) = (keys.head_dim, values.head_dim);
    if heads == 0 || q.len() != heads * hd || out.len() != heads * vd {
        return Err(KernelError::Shape("attention group operand sizes do not match"));
    }
    let fused = [free.then_some(k.attn_free).flatten(), k.attn_head];
    if heads <= MAX_ATTN_GROUP {
        let softmax = k.softmax;
        let job = AttnHeadJob { mode, q, heads, keys, values, n_pos, scale, softmax, next };
        for kernel in fused.into_iter().flatten() {
            if kernel(&job, sc, out) {
                return Ok(());
            }
        }
    }
    if let Some(next) = next {
        next.prefetch_part(0, 1);
    }
    for (q, out) in q.chunks_exact(hd).zip(out.chunks_exact_mut(vd)) {
        attention(k, mode, q, keys, values, n_pos, scale, sc, out)?;
    }
    Ok(())
}

/// Whether [`attention_group`] computes heads of `head_dim` in the free association
/// on `k` (the level has the kernel and it takes the size); elsewhere it is ggml's.
pub fn attention_free_covers(k: &Kernels, head_dim: usize) -> bool {
    k.attn_free.is_some()
        && head_dim.is_multiple_of(16)
        && (16..=crate::cpu::attn::MAX_FUSED_HEAD).contains(&head_dim)
}

/// One query head's attention in the free association, the definition of
/// [`Kernels::attn_free`]'s bits: each score is `q · k` over 16 lanes (element `i` in lane
/// `i % 16`, one fused multiply-add each in order from zero, the lanes then added as
/// `_mm512_reduce_add_ps` adds them: `a[i] = v[i] + v[i + 8]`, `b[i] = a[i] + a[i + 4]`,
/// `(b0 + b2) + (b1 + b3)`), the level's softmax of the scores times `scale`, and each output
/// dimension one fused multiply-add per position in order from zero (the level's
/// `axpy_f16`). Queries and probabilities stay f32.
#[allow(clippy::too_many_arguments)]
pub fn attention_free_twin(
    k: &Kernels,
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
    sc: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_attention(q, keys, values, n_pos, sc, out)?;
    let missing = KernelError::Shape("block table shorter than the sequence");
    let scores = &mut sc.scores[..n_pos];
    for (p, s) in scores.iter_mut().enumerate() {
        *s = dot_lanes16(q, keys.row(p).ok_or(missing)?);
    }
    (k.softmax)(scores, scale);
    out.fill(0.0);
    for (p, &w) in scores.iter().enumerate() {
        (k.axpy_f16)(w, values.row(p).ok_or(missing)?, out);
    }
    Ok(())
}

/// `q · k` in 16 lanes, as [`attention_free_twin`] defines it.
fn dot_lanes16(q: &[f32], k: &[f16]) -> f32 {
    let mut v = [0.0f32; 16];
    for (i, (a, b)) in q.iter().zip(k).enumerate() {
        v[i % 16] = a.mul_add(b.to_f32(), v[i % 16]);
    }
    let a: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

/// The operand sizes [`attention`] and [`attention_generic`] need.
fn check_attention(
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    sc: &AttnScratch,
    out: &[f32],
) -> Result<(), KernelError> {
    let hd = keys.head_dim;
    if q.len() != hd
        || out.len() != values.head_dim
        || sc.q16.len() < hd
        || sc.scores.len() < n_pos
        || sc.probs.len() < n_pos
        || sc.classes.len() < 64 * values.head_dim
        || n_pos == 0
    {
        return Err(KernelError::Shape("attention operand sizes do not match"));
    }
    Ok(())
}

/// [`attention`] without the level's fused kernel: the association twin that the fused
/// kernels are tested against.
#[allow(clippy::too_many_arguments)]
pub fn attention_generic(
    k: &Kernels,
    mode: AttnMode,
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
    sc: &mut AttnScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_attention(q, keys, values, n_pos, sc, out)?;
    let hd = keys.head_dim;
    let missing = KernelError::Shape("block table shorter than the sequence");
    let (dot, vshape) = match mode {
        AttnMode::Prefill if values.head_dim.is_multiple_of(4) => (k.dot_f16_gemm, k.attn.prefill),
        AttnMode::Prefill => (k.dot_f16_gemm, k.attn.decode),
        AttnMode::Decode => (k.dot_f16, k.attn.decode),
    };
    (k.f32_to_f16)(q, &mut sc.q16[..hd]);
    let scores = &mut sc.scores[..n_pos];
    for (p, s) in scores.iter_mut().enumerate() {
        *s = dot(&sc.q16[..hd], keys.row(p).ok_or(missing)?);
    }
    (k.softmax)(scores, scale);
    let probs = &mut sc.probs[..n_pos];
    (k.f32_to_f16)(scores, probs);
    let vd = values.head_dim;
    match vshape {
        SumShape::SeqF64 => {
            let wide = &mut sc.wide[..vd];
            wide.fill(0.0);
            for (p, w) in probs.iter().enumerate() {
                let w = w.to_f32();
                for (a, v) in wide.iter_mut().zip(values.row(p).ok_or(missing)?) {
                    *a += f64::from(w * v.to_f32());
                }
            }
            for (o, a) in out.iter_mut().zip(wide.iter()) {
                *o = *a as f32;
            }
        }
        shape @ SumShape::Lanes { .. } => {
            let step = shape.step();
            let classes = &mut sc.classes[..step * vd];
            classes.fill(0.0);
            for (p, w) in probs.iter().enumerate() {
                let c = p % step;
                (k.axpy_f16)(
                    w.to_f32(),
                    values.row(p).ok_or(missing)?,
                    &mut classes[c * vd..(c + 1) * vd],
                );
            }
            let mut lanes = [0.0f32; 64];
            for (d, o) in out.iter_mut().enumerate() {
                for (c, l) in lanes[..step].iter_mut().enumerate() {
                    *l = classes[c * vd + d];
                }
                *o = shape.finish(&lanes[..step], 0.0);
            }
        }
    }
    Ok(())
}

/// Reference twin of [`attention`]: plain f64 arithmetic on the same f16 data.
pub fn attention_reference(
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let err = KernelError::Shape("block table shorter than the sequence");
    let mut s = Vec::with_capacity(n_pos);
    for p in 0..n_pos {
        let kr = keys.row(p).ok_or(err)?;
        let d: f64 = q.iter().zip(kr).map(|(&a, b)| f64::from(a) * f64::from(b.to_f32())).sum();
        s.push(d * f64::from(scale));
    }
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = s.iter().map(|v| (v - max).exp()).sum();
    let mut acc = vec![0.0f64; out.len()];
    for (p, v) in s.iter().enumerate() {
        let w = (v - max).exp() / sum;
        let vr = values.row(p).ok_or(err)?;
        for (a, x) in acc.iter_mut().zip(vr) {
            *a += w * f64::from(x.to_f32());
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a as f32;
    }
    Ok(())
}

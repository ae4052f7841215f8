//! Weights repacked at load into row-lane tiles, and the matrix products over them, for
//! `Q4_0`, `Q4_1` and `Q8_0` weights where the CPU has a kernel for it.
//!
//! **Why.** The tiled kernels of [`super::gemm`] hold one ggml-shaped 8-lane accumulator per
//! (row, token) in half a register and multiply the scales `d_w · d_a` once per block, row
//! *and token pair*. Here one 512-bit register holds the same quantity for 16 weight rows
//! (lane `i` is row `i`), so the scale product is one multiply per block for 16 rows, and
//! the integer parts of 16 rows come from one `vpdpbusd` with the activation's 4 bytes
//! broadcast.
//!
//! **Arithmetic**, two kinds ([`LaneMath`]):
//! * `Exact`: ggml's association, bit for bit the level's dot products (and therefore
//!   llama.cpp's tokens): per row, 8 accumulators, accumulator `l` fed block after block by
//!   `fma(d_w · d_a, f32(i_l), acc_l)` with `i_l` the exact integer sum of the 4 products of
//!   quants `4l..4l + 4`; then ggml's horizontal sum `((a0+a4) + (a2+a6)) + ((a1+a5) +
//!   (a3+a7))`, then `+ summs` for `Q4_1` (`summs` adds the exact products `m_w · s_a` block
//!   after block). Per 512 multiply-accumulates: 8 `vpdpbusd`, 8 FMAs, 1 multiply (the
//!   tiled kernels: 8, 8 and 8).
//! * `Fast`: one exact integer per block and row and one FMA per block and row:
//!   `acc = fma(f32(i), d_w · d_a, acc)`, then `acc = fma(m_w, s_a, acc)` for `Q4_1`
//!   (written out in [`dot_reference`]); 8 `vpdpbusd`, 2–3 FMAs and 1 multiply per 512.
//!   Differences from `Exact` are rounding-level per product, but a quantized model
//!   amplifies them (activation quants flip), so its greedy tokens drift from llama.cpp's
//!   at points that are not near-ties; it is an explicit choice.
//!
//! In both, no sum crosses rows or tokens, so every output has the same bits whatever the
//! batch, the tile or the thread split: batch invariance holds by construction.
//!
//! **AMX.** Where the CPU has AMX-INT8 tiles and the OS grants them
//! ([`super::tiles_granted`]), `Fast` products of [`TILE_MIN_TOKENS`] or more tokens run on
//! them ([`Lanes::wants_tiles`]), from the same weight records and activations laid out once
//! per product in groups of up to 16 tokens ([`tile_records`]): the same bits, each block's
//! exact integers from one tile product instead of 8 `vpdpbusd` a token.
//!
//! **Layout.** Rows in tiles of [`LANE_ROWS`]; per tile, block after block, one record:
//! `Q4_x`: four 64-byte vectors whose lane `i` holds row `i`'s nibble bytes `4j..4j + 4`
//! (low nibbles: elements `4j..4j + 4`; high: `16 + 4j..`), then the 16 rows' `d` (f16), then
//! (`Q4_1`) their `m`: 320 bytes, the same size as the 16 blocks it came from. `Q8_0`: eight
//! vectors of the bytes `4j..4j + 4` offset by 128 (unsigned, for `vpdpbusd`), then `d`,
//! padded to 576 bytes. A tile's records are one sequential stream.

use std::ops::Range;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::disjoint::DisjointOut;
use super::gemm::{Acts, Line};
use crate::KernelError;
use crate::quant::{BlockQ8_0, BlockQ8_1, GgmlType, cast_blocks};

/// Rows per tile: the lanes of one 512-bit register of f32.
pub const LANE_ROWS: usize = 16;

/// Which arithmetic a [`LaneMatrix`]'s products use (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneMath {
    /// ggml's association at the level (bit-identical to the level's dot products, and so
    /// to llama.cpp built for it): per row, 8 f32 lanes each fed by 4-product integer sums,
    /// one fused multiply-add per lane and block, ggml's horizontal sum.
    Exact,
    /// One exact integer per block and row, one fused multiply-add per block and row: more
    /// than twice the throughput, results within rounding of `Exact`'s.
    Fast,
}

/// A weight matrix repacked into row-lane tiles (module docs), 64-byte aligned, in an
/// allocation it may share with other matrices ([`LaneArena`]); clones share it.
#[derive(Clone)]
pub struct LaneMatrix {
    math: LaneMath,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    nb: usize,
    store: Arc<Vec<Line>>,
    /// Where this matrix's records lie in `store`.
    lines: Range<usize>,
}

/// Row-lane matrices built into one allocation, advised onto transparent huge pages before
/// it is first touched: a decode step streams every matrix once, and on 4 KiB pages the
/// streams pay a TLB miss and a hardware-prefetch restart every 64 lines (a model's
/// matrices are mostly well under 2 MiB each, so separate allocations would not get huge
/// pages). Sized up front ([`LaneMatrix::lines_for`]), filled matrix by matrix.
pub struct LaneArena {
    store: Vec<Line>,
    parts: Vec<(LaneMath, GgmlType, usize, usize, Range<usize>)>,
}

impl std::fmt::Debug for LaneArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneArena")
            .field("lines", &self.store.len())
            .field("matrices", &self.parts.len())
            .finish()
    }
}

impl LaneArena {
    /// An arena of `lines` zeroed lines.
    pub fn with_lines(lines: usize) -> LaneArena {
        let mut store: Vec<Line> = Vec::with_capacity(lines);
        let spare = store.spare_capacity_mut();
        super::advise_huge_pages(spare.as_ptr().cast(), std::mem::size_of_val(spare));
        store.resize(lines, Line([0; 64]));
        LaneArena { store, parts: Vec::new() }
    }

    /// Repacks the next matrix (arguments as [`LaneMatrix::repack`]) into the arena.
    pub fn push(
        &mut self,
        math: LaneMath,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        src: &[u8],
    ) -> Result<(), KernelError> {
        let n = LaneMatrix::lines_for(ty, rows, cols, src.len())?;
        let start = self.parts.last().map_or(0, |p| p.4.end);
        let dst = self
            .store
            .get_mut(start..start + n)
            .ok_or(KernelError::Shape("the arena was sized for fewer lines"))?;
        fill(ty, rows, cols, src, dst);
        self.parts.push((math, ty, rows, cols, start..start + n));
        Ok(())
    }

    /// The matrices, in the order they were pushed.
    pub fn finish(self) -> Vec<LaneMatrix> {
        let store = Arc::new(self.store);
        self.parts
            .into_iter()
            .map(|(math, ty, rows, cols, lines)| LaneMatrix {
                math,
                ty,
                rows,
                cols,
                nb: cols / ty.block_size(),
                store: store.clone(),
                lines,
            })
            .collect()
    }
}

impl std::fmt::Debug for LaneMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// 64-byte lines per (tile, block) record of weights of type `ty`.
pub(crate) const fn rec_lines(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 9,
        _ => 5,
    }
}

/// Offset of the 16 `d` values inside a record (the `m` values follow them).
pub(crate) const fn d_offset(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 512,
        _ => 256,
    }
}

impl LaneMatrix {
    /// Whether `ty` has a row-lane layout.
    pub fn supports(ty: GgmlType) -> bool {
        matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
    }

    /// Lines of records that `rows` × `cols` weights of `ty` take, after checking the shape
    /// and that `src_len` bytes hold them.
    pub fn lines_for(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        src_len: usize,
    ) -> Result<usize, KernelError> {
        if !Self::supports(ty) {
            return Err(KernelError::UnsupportedType(ty));
        }
        if rows == 0 || !rows.is_multiple_of(LANE_ROWS) {
            return Err(KernelError::Shape("row-lane tiles need a multiple of 16 rows"));
        }
        let bs = ty.block_size();
        if cols == 0 || !cols.is_multiple_of(bs) {
            return Err(KernelError::Shape("row length is not a whole number of blocks"));
        }
        let nb = cols / bs;
        if rows.checked_mul(nb * ty.type_size()) != Some(src_len) {
            return Err(KernelError::Shape("matrix data size does not match its shape"));
        }
        Ok(rows / LANE_ROWS * nb * rec_lines(ty))
    }

    /// Repacks `rows` × `cols` weights of `ty` in ggml's layout (`src`, rows contiguous),
    /// for products in `math`, into an allocation of its own. `rows` must be a multiple of
    /// [`LANE_ROWS`].
    pub fn repack(
        math: LaneMath,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        src: &[u8],
    ) -> Result<LaneMatrix, KernelError> {
        let mut arena = LaneArena::with_lines(Self::lines_for(ty, rows, cols, src.len())?);
        arena.push(math, ty, rows, cols, src)?;
        arena.finish().pop().ok_or(KernelError::Shape("no matrix"))
    }

    /// The arithmetic of products with this matrix.
    pub fn math(&self) -> LaneMath {
        self.math
    }

    /// The same records (shared, not copied) for products in `math`: the layout does not
    /// depend on the arithmetic.
    pub fn with_math(&self, math: LaneMath) -> LaneMatrix {
        LaneMatrix { math, ..self.clone() }
    }

    /// Element type of the original weights.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Blocks per row.
    pub(crate) fn nb(&self) -> usize {
        self.nb
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lines.len() * size_of::<Line>()
    }
    /// The records of row tile `tile` (`nb` records of [`rec_lines`] lines).
    pub(crate) fn tile(&self, tile: usize) -> &[Line] {
        let n = self.nb * rec_lines(self.ty);
        &self.store[self.lines.clone()][tile * n..(tile + 1) * n]
    }
}

/// Writes the records of `src` (shape checked by [`LaneMatrix::lines_for`]) into `dst`.
fn fill(ty: GgmlType, rows: usize, cols: usize, src: &[u8], dst: &mut [Line]) {
    let (nb, bb, lpr) = (cols / ty.block_size(), ty.type_size(), rec_lines(ty));
    debug_assert_eq!(dst.len(), rows / LANE_ROWS * nb * lpr);
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
    let (qs_at, nq) = match ty {
        GgmlType::Q4_1 => (4, 4),
        GgmlType::Q4_0 => (2, 4),
        _ => (2, 8),
    };
    let d_at = d_offset(ty);
    for (ri, row) in src.chunks_exact(nb * bb).enumerate() {
        let (tile, i) = (ri / LANE_ROWS, ri % LANE_ROWS);
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let rec = &mut bytes[(tile * nb + b) * lpr * 64..][..lpr * 64];
            for j in 0..nq {
                let dst = &mut rec[64 * j + 4 * i..64 * j + 4 * i + 4];
                dst.copy_from_slice(&blk[qs_at + 4 * j..qs_at + 4 * j + 4]);
                if ty == GgmlType::Q8_0 {
                    dst.iter_mut().for_each(|q| *q ^= 0x80);
                }
            }
            rec[d_at + 2 * i..d_at + 2 * i + 2].copy_from_slice(&blk[0..2]);
            if ty == GgmlType::Q4_1 {
                rec[d_at + 32 + 2 * i..d_at + 32 + 2 * i + 2].copy_from_slice(&blk[2..4]);
            }
        }
    }
}

/// One token's activation block as the row-lane kernels read it.
#[derive(Clone, Copy, Pod, Zeroable, Default)]
#[repr(C)]
pub(crate) struct LaneAct {
    /// The 32 quants.
    pub(crate) qs: [i8; 32],
    /// The scale.
    pub(crate) d: f32,
    /// `Q8_1`: `s` (for `Q4_1` weights); otherwise 0.
    pub(crate) s: f32,
    /// The integer the unsigned weight bytes' dot product of quants `4l..4l + 4` starts
    /// from: `-c · Σ qs[4l..4l + 4]` with `c = 8` (`Q4_0`), `128` (`Q8_0`, bytes offset by
    /// 128), `0` (`Q4_1`).
    pub(crate) corr: [i32; 8],
    /// The sum of `corr` (the whole block's start).
    pub(crate) corr_sum: i32,
}

/// The row-lane matrix kernel of one level.
#[derive(Clone, Copy, Debug)]
pub struct Lanes {
    /// Computes the outputs of `rows` (whole tiles) for every token.
    pub(crate) run: fn(&LaneJob<'_>, Range<usize>),
    /// Packs activations into records: the same records as [`pack`], its scalar twin.
    pub(crate) pack: PackFn,
    /// Whether `run` computes `Fast` products of several tokens on AMX tiles (the same
    /// bits: [`dot_reference`]) from the job's tile records.
    pub(crate) tiles: bool,
}

impl Lanes {
    /// Whether a product in `math` of `n_tok` tokens runs on tiles, and so wants its
    /// activations as tile records too ([`LaneJob::tiles`]).
    pub(crate) fn wants_tiles(&self, math: LaneMath, n_tok: usize) -> bool {
        self.tiles && math == LaneMath::Fast && n_tok >= TILE_MIN_TOKENS
    }
}

/// Signature of [`pack`] and its SIMD twins.
pub(crate) type PackFn = fn(GgmlType, Acts<'_>, usize, usize, &mut [LaneAct]) -> bool;

/// One call's operands, shared by the threads of the pool.
pub(crate) struct LaneJob<'a> {
    pub(crate) w: &'a LaneMatrix,
    /// `n_tok × nb` records, token-major.
    pub(crate) acts: &'a [LaneAct],
    pub(crate) n_tok: usize,
    /// `n_tok × rows` outputs, token-major.
    pub(crate) out: &'a DisjointOut,
    /// The same activations as tile records ([`tile_records`]) where the table runs this
    /// product on tiles ([`Lanes::wants_tiles`]).
    pub(crate) tiles: Option<&'a [Line]>,
}

/// Tokens from which a `Fast` product runs on AMX tiles: below it the AVX-512 kernel's
/// per-token `vpdpbusd` cost less than a tile product and the unpacking of its weights.
pub(crate) const TILE_MIN_TOKENS: usize = 16;
/// Tokens per tile group: the rows of an A and a C tile.
pub(crate) const TILE_GROUP: usize = 16;
/// Tokens per tile chunk, at most: a chunk's records stay in L2 while every row tile of a
/// thread's share runs over them.
pub(crate) const TILE_CHUNK: usize = 64;
/// Lines of a (group, block) tile record: the group's 16 rows of 32 activation quants (an A
/// tile at a 32-byte stride), then 16 `d` (f32), 16 `s` (f32) and 16 `corr_sum` (i32).
pub(crate) const TILE_REC_LINES: usize = 11;
/// Byte offset of the 16 `d` (f32) in a tile record.
pub(crate) const TILE_D: usize = 512;
/// Byte offset of the 16 `s` (f32) in a tile record.
pub(crate) const TILE_S: usize = 576;
/// Byte offset of the 16 `corr_sum` (i32) in a tile record.
pub(crate) const TILE_CORR: usize = 640;

/// The chunks of a tile product of `n_tok` tokens, split evenly (130: 43, 43, 44), each as
/// (first token, tokens, groups); its groups split it evenly too (43: 14, 14, 15).
pub(crate) fn tile_chunks(n_tok: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let chunks = n_tok.div_ceil(TILE_CHUNK);
    (0..chunks).map(move |c| {
        let (c0, c1) = (c * n_tok / chunks, (c + 1) * n_tok / chunks);
        (c0, c1 - c0, (c1 - c0).div_ceil(TILE_GROUP))
    })
}

/// Lines of the tile records of `n_tok` tokens of `nb` blocks ([`tile_records`]).
pub(crate) fn tile_record_lines(n_tok: usize, nb: usize) -> usize {
    tile_chunks(n_tok).map(|(_, _, g)| g).sum::<usize>() * nb * TILE_REC_LINES
}

/// Lays out `n_tok × nb` activation records (token-major) as tile records: chunk after
/// chunk ([`tile_chunks`]), group after group, block after block, [`TILE_REC_LINES`] lines
/// each; a group's rows past its tokens keep what `dst` held (a tile product computes them,
/// nothing reads them).
pub(crate) fn tile_records(acts: &[LaneAct], n_tok: usize, nb: usize, dst: &mut Vec<Line>) {
    let need = tile_record_lines(n_tok, nb);
    if dst.len() < need {
        dst.resize(need, Line([0; 64]));
    }
    let mut recs = dst.chunks_exact_mut(nb * TILE_REC_LINES);
    for (c0, m, groups) in tile_chunks(n_tok) {
        for g in 0..groups {
            let (t0, t1) = (c0 + g * m / groups, c0 + (g + 1) * m / groups);
            let Some(group) = recs.next() else { return };
            for (b, rec) in group.chunks_exact_mut(TILE_REC_LINES).enumerate() {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(rec);
                let (qs, rest) = bytes.split_at_mut(TILE_D);
                let (d, rest) = rest.split_at_mut(TILE_S - TILE_D);
                let (s, corr) = rest.split_at_mut(TILE_CORR - TILE_S);
                for (i, t) in (t0..t1).enumerate() {
                    let a = &acts[t * nb + b];
                    qs[32 * i..32 * i + 32].copy_from_slice(bytemuck::cast_slice(&a.qs));
                    d[4 * i..4 * i + 4].copy_from_slice(&a.d.to_ne_bytes());
                    s[4 * i..4 * i + 4].copy_from_slice(&a.s.to_ne_bytes());
                    corr[4 * i..4 * i + 4].copy_from_slice(&a.corr_sum.to_ne_bytes());
                }
            }
        }
    }
}

impl LaneJob<'_> {
    /// Asserts what every kernel's raw reads rely on.
    pub(crate) fn check(&self, rows: &Range<usize>) {
        let w = self.w;
        assert!(rows.start <= rows.end && rows.end <= w.rows, "rows out of range");
        assert!(
            rows.start.is_multiple_of(LANE_ROWS) && rows.end.is_multiple_of(LANE_ROWS),
            "rows not in tiles"
        );
        assert_eq!(self.acts.len(), self.n_tok * w.nb, "activation records");
        assert_eq!(w.lines.len(), w.rows / LANE_ROWS * w.nb * rec_lines(w.ty), "weight records");
        assert!(w.lines.end <= w.store.len(), "weight records");
    }
}

/// The kernel of `level`, if it has one (with AMX tiles where `tiles` and they are granted:
/// asking is left out without `tiles`).
pub(crate) fn table(level: super::SimdLevel, tiles: bool) -> Option<Lanes> {
    match level {
        #[cfg(target_arch = "x86_64")]
        super::SimdLevel::Avx512 if tiles && super::tiles_granted() => {
            Some(super::arch::x86_64::lanes::avx512_tiles())
        }
        #[cfg(target_arch = "x86_64")]
        super::SimdLevel::Avx512 => Some(super::arch::x86_64::lanes::avx512()),
        _ => None,
    }
}

/// Repacks `n_tok` tokens of quantized activations (`Q8_0` blocks for `Q4_0`/`Q8_0` weights,
/// `Q8_1` for `Q4_1`) into `dst` (`n_tok × nb` long). Returns `false` on a type or size
/// mismatch. The scalar twin of every level's [`Lanes::pack`] (tested against it).
#[cfg_attr(
    not(test),
    expect(dead_code, reason = "the reference the SIMD packs are tested against")
)]
pub(crate) fn pack(
    ty: GgmlType,
    acts: Acts<'_>,
    n_tok: usize,
    nb: usize,
    dst: &mut [LaneAct],
) -> bool {
    let n = n_tok * nb;
    if dst.len() != n {
        return false;
    }
    let rec = |qs: [i8; 32], d: f16, s: f32, c: i32| {
        let mut corr = [0i32; 8];
        if c != 0 {
            for (l, q) in corr.iter_mut().zip(qs.chunks_exact(4)) {
                *l = -c * q.iter().map(|&q| i32::from(q)).sum::<i32>();
            }
        }
        LaneAct { qs, d: d.to_f32(), s, corr, corr_sum: corr.iter().sum() }
    };
    match (ty, acts) {
        (GgmlType::Q4_1, Acts::Q8_1(a)) if a.len() >= n => {
            for (r, a) in dst.iter_mut().zip(a) {
                *r = rec(a.qs, a.d, a.s.to_f32(), 0);
            }
        }
        (GgmlType::Q4_0 | GgmlType::Q8_0, Acts::Q8_0(a)) if a.len() >= n => {
            let c = if ty == GgmlType::Q4_0 { 8 } else { 128 };
            for (r, a) in dst.iter_mut().zip(a) {
                *r = rec(a.qs, a.d, 0.0, c);
            }
        }
        _ => return false,
    }
    true
}

/// The [`LaneMath::Fast`] arithmetic (module docs) for one row of `ty` in ggml's layout (`row`) and one
/// token's activations in its vec-dot type (`acts`): the scalar twin every kernel is tested
/// against. `None` if the types or lengths do not fit.
pub fn dot_reference(ty: GgmlType, row: &[u8], acts: &[u8]) -> Option<f32> {
    let bb = ty.type_size();
    if !LaneMatrix::supports(ty) || !row.len().is_multiple_of(bb) {
        return None;
    }
    let nb = row.len() / bb;
    let f = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut acc = 0.0f32;
    match ty {
        GgmlType::Q4_1 => {
            let a: &[BlockQ8_1] = cast_blocks(acts)?;
            if a.len() != nb {
                return None;
            }
            for (w, a) in row.chunks_exact(bb).zip(a) {
                let i = nibble_dot(&w[4..20], &a.qs, 0);
                acc = (i as f32).mul_add(f(w, 0) * a.d.to_f32(), acc);
                acc = f(w, 2).mul_add(a.s.to_f32(), acc);
            }
        }
        GgmlType::Q4_0 | GgmlType::Q8_0 => {
            let a: &[BlockQ8_0] = cast_blocks(acts)?;
            if a.len() != nb {
                return None;
            }
            for (w, a) in row.chunks_exact(bb).zip(a) {
                let i = if ty == GgmlType::Q4_0 {
                    nibble_dot(&w[2..18], &a.qs, 8)
                } else {
                    w[2..34]
                        .iter()
                        .zip(&a.qs)
                        .map(|(&q, &y)| i32::from(q as i8) * i32::from(y))
                        .sum()
                };
                acc = (i as f32).mul_add(f(w, 0) * a.d.to_f32(), acc);
            }
        }
        _ => return None,
    }
    Some(acc)
}

/// `Σ (nibble − off) · y` over a block's 32 elements (element `j` in the low nibble of byte
/// `j`, element `j + 16` in the high one).
fn nibble_dot(qs: &[u8], y: &[i8; 32], off: i32) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &q)| {
            (i32::from(q & 15) - off) * i32::from(y[j])
                + (i32::from(q >> 4) - off) * i32::from(y[j + 16])
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::SimdLevel;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// A random finite f16 (normal, subnormal or zero, either sign).
    fn finite_f16(rng: &mut StdRng) -> f16 {
        loop {
            let h = f16::from_bits(rng.random());
            if h.is_finite() {
                return h;
            }
        }
    }

    #[test]
    fn tile_chunks_cover_every_token_once_in_groups_that_fit_a_tile() {
        for n in 1..=700 {
            let mut next = 0;
            let mut lines = 0;
            for (c0, m, groups) in tile_chunks(n) {
                assert_eq!(c0, next, "{n} tokens: chunks are contiguous");
                assert!((1..=TILE_CHUNK).contains(&m), "{n} tokens: a chunk of {m}");
                // The tiles are configured for the largest group, which a tile holds.
                assert!(m.div_ceil(groups) <= TILE_GROUP, "{n} tokens: {m} in {groups} groups");
                for g in 0..groups {
                    let size = (g + 1) * m / groups - g * m / groups;
                    assert!((1..=TILE_GROUP).contains(&size), "{n} tokens: a group of {size}");
                }
                next += m;
                lines += groups * 3 * TILE_REC_LINES;
            }
            assert_eq!(next, n);
            assert_eq!(tile_record_lines(n, 3), lines);
        }
    }

    #[test]
    fn simd_pack_matches_the_scalar_records() {
        let Some(lk) = table(SimdLevel::detect(), false) else {
            eprintln!("no row-lane kernel on this CPU: nothing to compare");
            return;
        };
        let mut rng = StdRng::seed_from_u64(11);
        for (n_tok, nb) in [(1, 1), (3, 18), (16, 48), (5, 7)] {
            let n = n_tok * nb;
            let q8_1: Vec<BlockQ8_1> = (0..n)
                .map(|_| BlockQ8_1 {
                    d: finite_f16(&mut rng),
                    s: finite_f16(&mut rng),
                    qs: std::array::from_fn(|_| rng.random_range(-127..=127)),
                })
                .collect();
            let q8_0: Vec<BlockQ8_0> = (0..n)
                .map(|_| BlockQ8_0 {
                    d: finite_f16(&mut rng),
                    qs: std::array::from_fn(|_| rng.random_range(-127..=127)),
                })
                .collect();
            for (ty, acts) in [
                (GgmlType::Q4_1, Acts::Q8_1(&q8_1)),
                (GgmlType::Q4_0, Acts::Q8_0(&q8_0)),
                (GgmlType::Q8_0, Acts::Q8_0(&q8_0)),
            ] {
                let mut want = vec![LaneAct::default(); n];
                let mut got = vec![LaneAct::default(); n];
                assert!(pack(ty, acts, n_tok, nb, &mut want));
                assert!((lk.pack)(ty, acts, n_tok, nb, &mut got));
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    let (w, g) = (bytemuck::bytes_of(w), bytemuck::bytes_of(g));
                    assert_eq!(w, g, "{ty:?}, {n_tok} × {nb}: record {i}");
                }
                // Mismatched types and sizes are refused, as by the scalar twin.
                let other = match acts {
                    Acts::Q8_1(_) => Acts::Q8_0(&q8_0),
                    Acts::Q8_0(_) => Acts::Q8_1(&q8_1),
                };
                assert!(!(lk.pack)(ty, other, n_tok, nb, &mut got));
                assert!(!(lk.pack)(ty, acts, n_tok, nb, &mut got[..n - 1]));
            }
        }
    }
}

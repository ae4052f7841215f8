//! Quantized matrix products over tiles of rows and tokens, bit-identical to the per-row dot
//! products of the same level (the kernels behind [`crate::ops::matmul`]).
//!
//! `ops::matmul` used to compute every (row, token) output with one call of the level's dot
//! product, so a step of 64 tokens cost 64 one-token steps. The kernels here compute a tile
//! of rows × tokens at once: each weight block is loaded and unpacked once per tile, the
//! activations are repacked once per call into the layout the inner loop streams, and the
//! accumulators of different (row, token) pairs are independent, which removes the latency
//! chain of a single dot product.
//!
//! **Arithmetic.** Every output keeps the association of the level's per-row dot product
//! (ggml's: 8 f32 lanes, lane `l` fed by the integer sum of bytes `4l..4l + 4` of a block,
//! one fused multiply-add per block with the exact f32 product `d_w * d_a`, blocks in order,
//! ggml's horizontal sum, then `+ summs` for `Q4_1`, where `summs` adds the exact products
//! `m * s` block after block). A 512-bit register holds two independent 8-lane accumulators
//! (two tokens of one row, or two rows of one token); nothing is ever added across them
//! before each one's own horizontal sum. Integer parts may be formed differently from the
//! dot product (e.g. `Σ(w + 128)·y − 128·Σy` instead of sign tricks) as long as they are
//! the same exact integers; they are, for every activation block the quantizers produce
//! (quants in `-127..=127`).
//!
//! **Layouts.** Packed activations live in caller-owned scratch ([`Line`]s of 64 bytes).
//! [`PairRec`]: the AVX-512 layout for two or more tokens; tokens in tiles of 8, per tile and
//! block the 32 quants of tokens `2p` and `2p + 1` side by side (one 64-byte load feeds both
//! halves of a `vpdpbusd`), their scales spread over the matching 8 lanes, and per-token
//! `s` (`Q8_1`) or integer corrections (`Q8_0` activations). [`DecRec`]: the AVX-512 layout
//! for one token (decode), quants duplicated into both halves so that each half can take a
//! different weight row. [`QuadRec`]: the AVX2 layout, tokens in tiles of 4.
//!
//! The scalar level has no entries: [`crate::ops::matmul`] falls back to the per-row dot
//! products, which are the reference twin of these kernels.

use std::ops::Range;

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::SimdLevel;
use super::disjoint::DisjointOut;
use crate::quant::{BlockQ8_0, BlockQ8_1, GgmlType};

/// 64 bytes aligned to 64: the unit of packed-activation scratch.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// Quantized activations as `matmul` receives them: `n_tok` rows of `nb` blocks.
#[derive(Clone, Copy)]
pub(crate) enum Acts<'a> {
    /// For `Q4_0` and `Q8_0` weights.
    Q8_0(&'a [BlockQ8_0]),
    /// For `Q4_1` weights.
    Q8_1(&'a [BlockQ8_1]),
}

impl<'a> Acts<'a> {
    /// Blocks `start..start + len`, if they exist.
    pub(crate) fn blocks(self, start: usize, len: usize) -> Option<Acts<'a>> {
        let end = start.checked_add(len)?;
        Some(match self {
            Acts::Q8_0(a) => Acts::Q8_0(a.get(start..end)?),
            Acts::Q8_1(a) => Acts::Q8_1(a.get(start..end)?),
        })
    }
}

/// One call's operands, shared by the threads of the pool.
pub(crate) struct GemmJob<'a> {
    /// The whole weight matrix (`rows * row_bytes` bytes).
    pub(crate) w: &'a [u8],
    /// Bytes per weight row (`nb` blocks).
    pub(crate) row_bytes: usize,
    /// Blocks per row.
    pub(crate) nb: usize,
    /// Tokens.
    pub(crate) n_tok: usize,
    /// The activations as the kernel's `pack` left them.
    pub(crate) packed: &'a [Line],
    /// `n_tok × stride` outputs, token-major.
    pub(crate) out: &'a DisjointOut,
    /// Outputs per token (the matrix's row count).
    pub(crate) stride: usize,
}

/// The matrix kernel of one weight type at one level.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmKernel {
    /// Scratch lines `pack` needs for `n_tok` tokens of `nb` blocks.
    pub(crate) lines: fn(usize, usize) -> usize,
    /// Repacks the activations (`n_tok`, `nb`) into the scratch (exactly `lines` long).
    /// Returns `false` (and leaves the scratch unspecified) if `acts` is not the kernel's
    /// activation type or too short.
    pub(crate) pack: fn(Acts<'_>, usize, usize, &mut [Line]) -> bool,
    /// Computes the outputs of `rows` for every token. Panics (before writing anything) on
    /// operands that do not fit together; `ops::matmul` validates them first.
    pub(crate) run: fn(&GemmJob<'_>, Range<usize>),
    /// Thread shares of rows start at multiples of this (the row tile).
    pub(crate) row_align: usize,
}

/// The matrix-product kernels of one level, by weight type. Types without an entry (and the
/// scalar level) go through the per-row dot products.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub(crate) q4_0: Option<GemmKernel>,
    pub(crate) q4_1: Option<GemmKernel>,
    pub(crate) q8_0: Option<GemmKernel>,
}

impl Gemm {
    /// No matrix kernels: every product goes through the per-row dot products.
    pub const NONE: Gemm = Gemm { q4_0: None, q4_1: None, q8_0: None };

    /// The kernel for weights of type `ty`, if this level has one.
    pub(crate) fn for_type(&self, ty: GgmlType) -> Option<&GemmKernel> {
        match ty {
            GgmlType::Q4_0 => self.q4_0.as_ref(),
            GgmlType::Q4_1 => self.q4_1.as_ref(),
            GgmlType::Q8_0 => self.q8_0.as_ref(),
            _ => None,
        }
    }

    /// Whether weights of type `ty` have a matrix kernel at this level.
    pub fn has(&self, ty: GgmlType) -> bool {
        self.for_type(ty).is_some()
    }
}

/// The table for `level`. Only [`super::Kernels::for_level`] calls this, after checking that
/// the CPU supports `level` (which is what makes the x86 entries sound).
pub(crate) fn table(level: SimdLevel) -> Gemm {
    match level {
        SimdLevel::Scalar => Gemm::NONE,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => super::arch::x86_64::gemm::avx2_table(),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => super::arch::x86_64::gemm::avx512_table(),
        #[cfg(not(target_arch = "x86_64"))]
        _ => Gemm::NONE,
    }
}

// ---------------------------------------------------------------------------------------------
// Packed layouts.
// ---------------------------------------------------------------------------------------------

/// Tokens per [`PairRec`] tile.
pub(crate) const PAIR_TILE: usize = 8;
/// Tokens per [`QuadRec`] tile.
pub(crate) const QUAD_TILE: usize = 4;

/// AVX-512, two or more tokens: one block of a tile of 8 tokens (4 pairs). A pair's two
/// tokens take the two 256-bit halves of a register.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
pub(crate) struct PairRec {
    /// Pair `p`: the 32 quants of token `2p`, then those of token `2p + 1`.
    pub(crate) qs: [[i8; 64]; 4],
    /// Pair `p`: the scale of token `2p` in lanes 0..8, of token `2p + 1` in lanes 8..16.
    pub(crate) d: [[f32; 16]; 4],
    /// `Q8_0` activations, pair `p`: lanes 0..8 hold `-c · Σ` of token `2p`'s quants
    /// `4l..4l + 4` (lane `l`), lanes 8..16 the same for token `2p + 1`; `c` turns `Σ u·y`
    /// (`u` the unsigned weight byte) into the signed product (`Q8_0`: 128, `Q4_0`: 8).
    pub(crate) corr: [[i32; 16]; 4],
    /// `Q8_1` activations: token `t`'s `s` in lane `t`.
    pub(crate) s: [f32; 8],
    _pad: [f32; 8],
}

/// AVX-512, one token: one block.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
pub(crate) struct DecRec {
    /// The 32 quants, twice.
    pub(crate) qs: [i8; 64],
    /// As [`PairRec::corr`] for the one token, in both halves.
    pub(crate) corr: [i32; 16],
    /// `[d, s]` eight times (`s = 0` for `Q8_0` activations).
    pub(crate) ds: [f32; 16],
}

/// AVX2: one block of a tile of 4 tokens.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
pub(crate) struct QuadRec {
    /// Token `t`'s 32 quants.
    pub(crate) qs: [[i8; 32]; 4],
    /// Token `t`'s scale in lane `t`.
    pub(crate) d: [f32; 8],
    /// Token `t`'s `s` (`Q8_1`) in lane `t`.
    pub(crate) s: [f32; 8],
}

const fn lines_of<R>(n: usize) -> usize {
    n * (size_of::<R>() / size_of::<Line>())
}

/// Scratch lines of the AVX-512 layouts.
pub(crate) fn lines_512(n_tok: usize, nb: usize) -> usize {
    if n_tok == 1 {
        lines_of::<DecRec>(nb)
    } else {
        lines_of::<PairRec>(n_tok.div_ceil(PAIR_TILE) * nb)
    }
}

/// Scratch lines of the AVX2 layout.
pub(crate) fn lines_avx2(n_tok: usize, nb: usize) -> usize {
    lines_of::<QuadRec>(n_tok.div_ceil(QUAD_TILE) * nb)
}

/// An activation block's fields, for both activation types.
trait ActBlock: Pod {
    fn d(&self) -> f16;
    fn s(&self) -> f16;
    fn qs(&self) -> &[i8; 32];
}

impl ActBlock for BlockQ8_0 {
    fn d(&self) -> f16 {
        self.d
    }
    fn s(&self) -> f16 {
        f16::ZERO
    }
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
}

impl ActBlock for BlockQ8_1 {
    fn d(&self) -> f16 {
        self.d
    }
    fn s(&self) -> f16 {
        self.s
    }
    fn qs(&self) -> &[i8; 32] {
        &self.qs
    }
}

/// The 8 lane corrections `-c · Σ qs[4l..4l + 4]` of one activation block.
fn corrections(qs: &[i8; 32], c: i32) -> [i32; 8] {
    std::array::from_fn(|l| -c * qs[4 * l..4 * l + 4].iter().map(|&q| i32::from(q)).sum::<i32>())
}

/// The typed records of `dst`, which must be exactly `n` records long.
fn records<R: Pod>(dst: &mut [Line], n: usize) -> Option<&mut [R]> {
    let recs: &mut [R] = bytemuck::try_cast_slice_mut(dst).ok()?;
    (recs.len() == n).then_some(recs)
}

/// Checks `acts` against the expected type and size.
fn typed<A: ActBlock>(acts: &[A], n_tok: usize, nb: usize) -> Option<&[A]> {
    acts.get(..n_tok.checked_mul(nb)?)
}

fn pack_pairs<A: ActBlock>(acts: &[A], n_tok: usize, nb: usize, c: i32, dst: &mut [Line]) -> bool {
    let Some(acts) = typed(acts, n_tok, nb) else { return false };
    let tiles = n_tok.div_ceil(PAIR_TILE);
    let Some(recs) = records::<PairRec>(dst, tiles * nb) else { return false };
    for (i, rec) in recs.iter_mut().enumerate() {
        let (tile, b) = (i / nb, i % nb);
        *rec = PairRec::zeroed();
        for slot in 0..PAIR_TILE {
            let t = tile * PAIR_TILE + slot;
            if t >= n_tok {
                break;
            }
            let a = &acts[t * nb + b];
            let (p, h) = (slot / 2, slot % 2);
            for (q, &v) in rec.qs[p][32 * h..32 * h + 32].iter_mut().zip(a.qs()) {
                *q = v;
            }
            let lanes = 8 * h..8 * h + 8;
            rec.d[p][lanes.clone()].fill(a.d().to_f32());
            if c != 0 {
                // (`Q8_1` activations need none: the record was zeroed.)
                rec.corr[p][lanes].copy_from_slice(&corrections(a.qs(), c));
            }
            rec.s[slot] = a.s().to_f32();
        }
    }
    true
}

fn pack_dec<A: ActBlock>(acts: &[A], nb: usize, c: i32, dst: &mut [Line]) -> bool {
    let Some(acts) = typed(acts, 1, nb) else { return false };
    let Some(recs) = records::<DecRec>(dst, nb) else { return false };
    for (rec, a) in recs.iter_mut().zip(acts) {
        for (h, q) in rec.qs.chunks_exact_mut(32).enumerate() {
            q.copy_from_slice(bytemuck::cast_slice(a.qs()));
            rec.corr[h * 8..h * 8 + 8].copy_from_slice(&corrections(a.qs(), c));
        }
        let (d, s) = (a.d().to_f32(), a.s().to_f32());
        for ds in rec.ds.chunks_exact_mut(2) {
            ds[0] = d;
            ds[1] = s;
        }
    }
    true
}

fn pack_quads<A: ActBlock>(acts: &[A], n_tok: usize, nb: usize, dst: &mut [Line]) -> bool {
    let Some(acts) = typed(acts, n_tok, nb) else { return false };
    let tiles = n_tok.div_ceil(QUAD_TILE);
    let Some(recs) = records::<QuadRec>(dst, tiles * nb) else { return false };
    for (i, rec) in recs.iter_mut().enumerate() {
        let (tile, b) = (i / nb, i % nb);
        *rec = QuadRec::zeroed();
        for slot in 0..QUAD_TILE {
            let t = tile * QUAD_TILE + slot;
            if t >= n_tok {
                break;
            }
            let a = &acts[t * nb + b];
            rec.qs[slot] = *a.qs();
            rec.d[slot] = a.d().to_f32();
            rec.s[slot] = a.s().to_f32();
        }
    }
    true
}

/// AVX-512 packing for `Q4_1` weights (`Q8_1` activations, no corrections).
pub(crate) fn pack_512_q8_1(acts: Acts<'_>, n_tok: usize, nb: usize, dst: &mut [Line]) -> bool {
    let Acts::Q8_1(a) = acts else { return false };
    if n_tok == 1 { pack_dec(a, nb, 0, dst) } else { pack_pairs(a, n_tok, nb, 0, dst) }
}

/// AVX-512 packing for `Q8_0` (`C = 128`) or `Q4_0` (`C = 8`) weights.
pub(crate) fn pack_512_q8_0<const C: i32>(
    acts: Acts<'_>,
    n_tok: usize,
    nb: usize,
    dst: &mut [Line],
) -> bool {
    let Acts::Q8_0(a) = acts else { return false };
    if n_tok == 1 { pack_dec(a, nb, C, dst) } else { pack_pairs(a, n_tok, nb, C, dst) }
}

/// AVX2 packing (either activation type).
pub(crate) fn pack_avx2(acts: Acts<'_>, n_tok: usize, nb: usize, dst: &mut [Line]) -> bool {
    match acts {
        Acts::Q8_0(a) => pack_quads(a, n_tok, nb, dst),
        Acts::Q8_1(a) => pack_quads(a, n_tok, nb, dst),
    }
}

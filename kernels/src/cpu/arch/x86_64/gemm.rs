//! x86 matrix kernels of [`crate::cpu::gemm`]: AVX-512 VNNI and AVX2, for `Q4_0`, `Q4_1` and
//! `Q8_0` weights.
//!
//! AVX-512, two or more tokens: tiles of 4 rows × up to 8 tokens; one 512-bit accumulator
//! per (row, pair of tokens), its halves the 8-lane accumulators of the two tokens. Each
//! weight block is loaded, unpacked and broadcast to both halves once per tile and row;
//! each `vpdpbusd` computes the lane sums of two tokens. The outputs are reduced 16 at a
//! time by shuffles that add exactly the pairs ggml's `hsum_float_8` adds.
//!
//! Per (row, token pair, block) the inner loop is `vpdpbusd`, `vcvtdq2ps`, the scale vector
//! `d_w * [d_a(t0) ×8, d_a(t1) ×8]` (one multiply) and the fused multiply-add. On Zen 4 the
//! multiply pipes bound it at about 3 cycles; the alternatives measured no better: the two
//! tokens interleaved lane by lane with the scale pair as one 64-bit broadcast of products
//! computed ahead (equal), or the scale vector blended from two broadcast products (slower).
//!
//! AVX-512, one token: tiles of 8 rows; one 512-bit accumulator per pair of rows, the
//! activation block duplicated into both halves. The 8 rows' `[d, m]` fields come in with
//! one gather, their products with `[d_a, s]` with one multiply.
//!
//! AVX2: tiles of 2 rows × up to 4 tokens (4 rows × 1 token for decode), one 256-bit
//! accumulator per (row, token), the integer parts formed exactly as the AVX2 dot products
//! form them (`vpmaddubsw` saturates, so the same operands must go in).
//!
//! # Safety
//! Every `imp_*` function requires the CPU features of its `target_feature` attribute. They
//! are reachable only through the safe wrappers in [`avx512_table`] and [`avx2_table`],
//! which [`crate::cpu::gemm::table`] installs only into the table of a level
//! [`crate::cpu::Kernels::for_level`] found this CPU to support. Weight reads go through raw
//! pointers to blocks `b < nb` of rows `< stride`, after [`check_job`] asserted that the
//! weight slice holds `stride` rows of `nb` blocks; packed records are typed slices.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::hsum_f32x8;
use crate::cpu::disjoint::DisjointOut;
use crate::cpu::gemm::{DecRec, Gemm, GemmJob, GemmKernel, PAIR_TILE, PairRec, QUAD_TILE, QuadRec};
use crate::cpu::gemm::{lines_512, lines_avx2, pack_512_q8_0, pack_512_q8_1, pack_avx2};

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

const fn qs_offset(kind: u8) -> usize {
    if kind == Q4_1 { 4 } else { 2 }
}

macro_rules! wrapper {
    ($name:ident => $imp:ident :: <$kind:ident>) => {
        fn $name(job: &GemmJob<'_>, rows: Range<usize>) {
            // SAFETY: installed only into the table of a level this CPU supports, which has
            // the features of `$imp` (module docs).
            unsafe { $imp::<$kind>(job, rows) }
        }
    };
}

wrapper!(run_512_q4_0 => imp_run_512::<Q4_0>);
wrapper!(run_512_q4_1 => imp_run_512::<Q4_1>);
wrapper!(run_512_q8_0 => imp_run_512::<Q8_0>);
wrapper!(run_avx2_q4_0 => imp_run_avx2::<Q4_0>);
wrapper!(run_avx2_q4_1 => imp_run_avx2::<Q4_1>);
wrapper!(run_avx2_q8_0 => imp_run_avx2::<Q8_0>);

/// The AVX-512 entries (the level's features were detected by the caller).
pub(crate) fn avx512_table() -> Gemm {
    let entry = |pack, run| Some(GemmKernel { lines: lines_512, pack, run, row_align: 8 });
    Gemm {
        q4_0: entry(pack_512_q8_0::<8>, run_512_q4_0),
        q4_1: entry(pack_512_q8_1, run_512_q4_1),
        q8_0: entry(pack_512_q8_0::<128>, run_512_q8_0),
    }
}

/// The AVX2 entries (the level's features were detected by the caller).
pub(crate) fn avx2_table() -> Gemm {
    let entry = |run| Some(GemmKernel { lines: lines_avx2, pack: pack_avx2, run, row_align: 4 });
    Gemm { q4_0: entry(run_avx2_q4_0), q4_1: entry(run_avx2_q4_1), q8_0: entry(run_avx2_q8_0) }
}

/// Asserts that `job` holds `stride` rows of `nb` blocks of `kind`, that `rows` lies inside
/// them, and that the outputs exist; every raw weight read relies on this.
fn check_job(job: &GemmJob<'_>, rows: &Range<usize>, kind: u8) {
    assert_eq!(job.row_bytes, job.nb * block_bytes(kind), "row size of the weight type");
    assert_eq!(job.stride.checked_mul(job.row_bytes), Some(job.w.len()), "weight size");
    assert!(rows.start <= rows.end && rows.end <= job.stride, "rows out of range");
    // Gather offsets within a tile of 8 rows are i32.
    assert!(job.row_bytes < (i32::MAX as usize) / 8, "rows too long");
}

/// Where a tile's outputs go: rows `r0..r0 + nr` of tokens `t0..t0 + nt`.
struct Dst<'a> {
    out: &'a DisjointOut,
    stride: usize,
    r0: usize,
    nr: usize,
    t0: usize,
    nt: usize,
}

/// Pointers to the rows of a tile starting at `r0` with `nr` real rows; the missing rows
/// repeat the last real one (their outputs are computed and dropped).
fn row_ptrs<const N: usize>(job: &GemmJob<'_>, r0: usize, nr: usize) -> [*const u8; N] {
    std::array::from_fn(|i| job.w.as_ptr().wrapping_add((r0 + i.min(nr - 1)) * job.row_bytes))
}

/// Reads the f16 bits at `p`.
///
/// # Safety
/// `p..p + 2` must be readable.
#[inline]
unsafe fn read_u16(p: *const u8) -> u16 {
    // SAFETY: the caller guarantees 2 readable bytes.
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// Asks for the cache lines of `w[start..start + len]` (clipped to `w`) to be fetched into
/// L2. The kernels walk several rows side by side, a pattern the hardware prefetchers do
/// not follow, so each tile fetches a later tile's rows while it computes.
///
/// Callers prefetch consecutive spans, so a line a span only partly covers is fetched by
/// the span after it; `len` is a compile-time constant in every caller, so the loop unrolls.
#[inline(always)]
fn prefetch(w: &[u8], start: usize, len: usize) {
    let last = w.len().saturating_sub(1);
    for i in 0..len.div_ceil(64) {
        let at = (start + 64 * i).min(last);
        // SAFETY: a prefetch never faults and has no architectural effect; the address is
        // inside `w` (or `w` is empty and nothing is touched).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(w.as_ptr().wrapping_add(at).cast()) };
    }
}

/// Tiles ahead that the one-token kernels prefetch.
const PREFETCH_TILES: usize = 2;

/// Row tiles (of 4 rows) ahead that the AVX-512 many-token kernel prefetches: with few
/// tokens it streams weights from memory (`Q8_0` 49152 × 576 at 4 tokens: 1 tile ahead
/// 1.27× the dot products, 2 tiles 1.5–2.5×, 4 tiles 1.7×, the steadiest).
const PREFETCH_ROW_TILES: usize = 4;

// ---------------------------------------------------------------------------------------------
// AVX-512.
// ---------------------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_i8x64(a: &[i8; 64]) -> __m512i {
    // SAFETY: `a` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_i32x16(a: &[i32; 16]) -> __m512i {
    // SAFETY: `a` is 64 readable bytes.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_f32x16(a: &[f32; 16]) -> __m512 {
    // SAFETY: `a` is 16 readable floats.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_f32x8(a: &[f32; 8]) -> __m256 {
    // SAFETY: `a` is 8 readable floats.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

/// Stores the first `dst.len()` (at most 4) lanes of `v`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn store_f32x4_prefix(dst: &mut [f32], v: __m128) {
    let mask = ((1u32 << dst.len().min(4)) - 1) as __mmask8;
    // SAFETY: the mask covers only lanes that exist in `dst`.
    unsafe { _mm_mask_storeu_ps(dst.as_mut_ptr(), mask, v) }
}

/// Stores the first `dst.len()` (at most 8) lanes of `v`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn store_f32x8_prefix(dst: &mut [f32], v: __m256) {
    let mask = ((1u32 << dst.len().min(8)) - 1) as __mmask8;
    // SAFETY: the mask covers only lanes that exist in `dst`.
    unsafe { _mm256_mask_storeu_ps(dst.as_mut_ptr(), mask, v) }
}

/// `[q, q, q, q]` (16 nibble bytes in each 128-bit lane) to the nibbles as bytes, low
/// nibbles in lanes 0 and 2, high nibbles in lanes 1 and 3: a block's 32 quants in element
/// order in each 256-bit half.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn nibbles_x2(v: __m512i) -> __m512i {
    // Words of 128-bit lanes 1 and 3 shift right by 4.
    let v = _mm512_mask_srli_epi16::<4>(v, 0xff00_ff00, v);
    _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
}

/// One weight block's 32 quants as the unsigned operand of `vpdpbusd`, in both halves:
/// nibbles for `Q4_0`/`Q4_1`, `q + 128` for `Q8_0`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn weights_x2<const KIND: u8>(blk: *const u8) -> __m512i {
    let q = blk.wrapping_add(qs_offset(KIND));
    if KIND == Q8_0 {
        // SAFETY: the block's 32 quants (`blk` is a whole block inside the weights).
        let v = unsafe { _mm256_loadu_si256(q.cast()) };
        _mm512_xor_si512(_mm512_broadcast_i64x4(v), _mm512_set1_epi8(-128))
    } else {
        // SAFETY: the block's 16 nibble bytes.
        let v = unsafe { _mm_loadu_si128(q.cast()) };
        nibbles_x2(_mm512_broadcast_i32x4(v))
    }
}

/// Two weight blocks (of two rows) as the unsigned operand of `vpdpbusd`: `b0`'s quants in
/// the low half, `b1`'s in the high half.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn weights_rows2<const KIND: u8>(b0: *const u8, b1: *const u8) -> __m512i {
    let (q0, q1) = (b0.wrapping_add(qs_offset(KIND)), b1.wrapping_add(qs_offset(KIND)));
    if KIND == Q8_0 {
        // SAFETY: block `b0`'s 32 quants.
        let lo = unsafe { _mm256_loadu_si256(q0.cast()) };
        // SAFETY: block `b1`'s 32 quants.
        let hi = unsafe { _mm256_loadu_si256(q1.cast()) };
        let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_xor_si512(v, _mm512_set1_epi8(-128))
    } else {
        // SAFETY: block `b0`'s 16 nibble bytes.
        let lo = unsafe { _mm_loadu_si128(q0.cast()) };
        // SAFETY: block `b1`'s 16 nibble bytes.
        let hi = unsafe { _mm_loadu_si128(q1.cast()) };
        nibbles_x2(_mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(lo), 0xff00, hi))
    }
}

/// First step of ggml's `hsum_float_8` on the four 8-lane accumulators in `a` and `b`:
/// 128-bit lane `k` of the result holds `v[i] + v[i + 4]` of accumulator `k`
/// (a's low, a's high, b's low, b's high half).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn hsum_step1(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xdd>(a, b))
}

/// Second step, per 128-bit lane: `[s0 + s2, s1 + s3]` of `a`'s lane, then of `b`'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn hsum_step2(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xee>(a, b))
}

/// Last step, per 128-bit lane: `t0 + t1` of the two pairs in `a`'s lane, then in `b`'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn hsum_step3(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x88>(a, b), _mm512_shuffle_ps::<0xdd>(a, b))
}

/// 128-bit lane `k` of `v`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn quarter(v: __m512, k: usize) -> __m128 {
    match k {
        0 => _mm512_extractf32x4_ps::<0>(v),
        1 => _mm512_extractf32x4_ps::<1>(v),
        2 => _mm512_extractf32x4_ps::<2>(v),
        _ => _mm512_extractf32x4_ps::<3>(v),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_run_512<const KIND: u8>(job: &GemmJob<'_>, rows: Range<usize>) {
    check_job(job, &rows, KIND);
    if job.n_tok == 1 { decode_512::<KIND>(job, rows) } else { batch_512::<KIND>(job, rows) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn batch_512<const KIND: u8>(job: &GemmJob<'_>, rows: Range<usize>) {
    let nb = job.nb;
    let tiles = job.n_tok.div_ceil(PAIR_TILE);
    let recs: &[PairRec] = bytemuck::cast_slice(job.packed);
    assert!(recs.len() >= tiles * nb, "packed activations too short");
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = (rows.end - r0).min(4);
        let rp = row_ptrs::<4>(job, r0, nr);
        // A later row tile's weights, fetched during the first token tile.
        let ahead = (r0 + 4 * PREFETCH_ROW_TILES) * job.row_bytes;
        for tile in 0..tiles {
            let t0 = tile * PAIR_TILE;
            let nt = (job.n_tok - t0).min(PAIR_TILE);
            let tr = &recs[tile * nb..(tile + 1) * nb];
            let dst = Dst { out: job.out, stride: job.stride, r0, nr, t0, nt };
            let ahead = (tile == 0).then_some((job.w, ahead));
            match nt.div_ceil(2) {
                1 => tile_512::<KIND, 1>(&rp, tr, &dst, ahead),
                2 => tile_512::<KIND, 2>(&rp, tr, &dst, ahead),
                3 => tile_512::<KIND, 3>(&rp, tr, &dst, ahead),
                _ => tile_512::<KIND, 4>(&rp, tr, &dst, ahead),
            }
        }
        r0 += nr;
    }
}

/// 4 rows × `2P` tokens over all blocks (`recs`, one per block); prefetches the 4 rows of
/// weights at `ahead` (bytes of `w` from an offset) on the way.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn tile_512<const KIND: u8, const P: usize>(
    rp: &[*const u8; 4],
    recs: &[PairRec],
    dst: &Dst<'_>,
    ahead: Option<(&[u8], usize)>,
) {
    let bs = block_bytes(KIND);
    let mut acc = [[_mm512_setzero_ps(); P]; 4];
    let mut summs = [_mm256_setzero_ps(); 4];
    for (b, rec) in recs.iter().enumerate() {
        let off = b * bs;
        if let Some((w, at)) = ahead {
            prefetch(w, at + 4 * off, 4 * bs);
        }
        for ((&row, acc), summs) in rp.iter().zip(acc.iter_mut()).zip(summs.iter_mut()) {
            let blk = row.wrapping_add(off);
            // SAFETY: `blk` is block `b < nb` of a row inside the weights (`check_job`).
            let dw = _mm512_cvtph_ps(_mm256_set1_epi16(unsafe { read_u16(blk) } as i16));
            let wq = weights_x2::<KIND>(blk);
            if KIND == Q4_1 {
                // SAFETY: as above; `m` follows `d` in a `Q4_1` block.
                let m = unsafe { read_u16(blk.wrapping_add(2)) };
                let m = _mm256_cvtph_ps(_mm_set1_epi16(m as i16));
                // m * s is exact in f32, so this is ggml's `summs += m * s`, token by token.
                *summs = _mm256_fmadd_ps(m, load_f32x8(&rec.s), *summs);
            }
            for (p, acc) in acc.iter_mut().enumerate() {
                let init =
                    if KIND == Q4_1 { _mm512_setzero_si512() } else { load_i32x16(&rec.corr[p]) };
                let isum = _mm512_dpbusd_epi32(init, wq, load_i8x64(&rec.qs[p]));
                let d = _mm512_mul_ps(dw, load_f32x16(&rec.d[p]));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
    }
    finish_pairs::<P>(&acc, &summs, KIND == Q4_1, dst);
}

/// Horizontal sums (plus `summs`) of a 4-row tile's accumulators, stored token by token.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn finish_pairs<const P: usize>(
    acc: &[[__m512; P]; 4],
    summs: &[__m256; 4],
    with_summs: bool,
    dst: &Dst<'_>,
) {
    let s01 = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(summs[0]), summs[1]);
    let s23 = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(summs[2]), summs[3]);
    for q in 0..P.div_ceil(2) {
        let mut step1 = [_mm512_setzero_ps(); 4];
        for (s, row) in step1.iter_mut().zip(acc) {
            let hi = if 2 * q + 1 < P { row[2 * q + 1] } else { _mm512_setzero_ps() };
            *s = hsum_step1(row[2 * q], hi);
        }
        // 128-bit lane k: rows 0..4 of token 4q + k.
        let mut r = hsum_step3(hsum_step2(step1[0], step1[1]), hsum_step2(step1[2], step1[3]));
        if with_summs {
            // Lane 4k + j takes row j's summs of token 4q + k.
            let idx: [i32; 16] = std::array::from_fn(|l| {
                let (k, j) = (l / 4, l % 4);
                ((j / 2) * 16 + (j % 2) * 8 + 4 * q + k) as i32
            });
            // SAFETY: `idx` is 16 readable i32.
            let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
            r = _mm512_add_ps(r, _mm512_permutex2var_ps(s01, idx, s23));
        }
        for k in 0..4 {
            let slot = 4 * q + k;
            if slot < dst.nt {
                let o = dst.out.range((dst.t0 + slot) * dst.stride + dst.r0, dst.nr);
                store_f32x4_prefix(o, quarter(r, k));
            }
        }
    }
}

/// One token: tiles of 8 rows, one 512-bit accumulator per pair of rows (row `2j` in the
/// low half, `2j + 1` in the high half), the activation block in both halves.
///
/// Tiles of 8 rows stream weights from memory better than 16 (measured on Zen 4 against
/// the row-by-row dot products, 147456 × 576: 8 rows 1.2–1.3× the dot products' rate,
/// 16 rows 1.0×); prefetching 2 tiles ahead into L2 beat L1 and 1, 3, 4, 6 or 8 tiles.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn decode_512<const KIND: u8>(job: &GemmJob<'_>, rows: Range<usize>) {
    let nb = job.nb;
    let bs = block_bytes(KIND);
    let recs: &[DecRec] = bytemuck::cast_slice(job.packed);
    assert!(recs.len() >= nb, "packed activations too short");
    let recs = &recs[..nb];
    // Lanes 0..8 take row 2j's `d * d_a`, lanes 8..16 row 2j + 1's.
    let pick: [__m512i; 4] = std::array::from_fn(|j| {
        let (a, b) = (4 * j as i32, 4 * j as i32 + 2);
        _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
    });
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = (rows.end - r0).min(8);
        let rp = row_ptrs::<8>(job, r0, nr);
        let offs: [i32; 8] = std::array::from_fn(|i| (i.min(nr - 1) * job.row_bytes) as i32);
        // SAFETY: `offs` is 8 readable i32.
        let vindex = unsafe { _mm256_loadu_si256(offs.as_ptr().cast()) };
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut summs = _mm512_setzero_ps();
        let ahead = (r0 + 8 * PREFETCH_TILES) * job.row_bytes;
        for (b, rec) in recs.iter().enumerate() {
            let off = b * bs;
            prefetch(job.w, ahead + 8 * off, 8 * bs);
            let act = load_i8x64(&rec.qs);
            let init = if KIND == Q4_1 { _mm512_setzero_si512() } else { load_i32x16(&rec.corr) };
            // The first 4 bytes of block b of each row: `[d, m]` for `Q4_1`, `d` and two
            // quants otherwise (whose lanes are never used).
            // SAFETY: `rp[0] + off + offs[i]` is block b of row i of the tile, inside the
            // weights, and every block has at least 4 bytes.
            let dm = unsafe { _mm256_i32gather_epi32::<1>(rp[0].wrapping_add(off).cast(), vindex) };
            // Lane 2i: row i's `d * d_a` (exact); lane 2i + 1: row i's `m * s` (exact).
            let prod = _mm512_mul_ps(_mm512_cvtph_ps(dm), load_f32x16(&rec.ds));
            if KIND == Q4_1 {
                summs = _mm512_add_ps(summs, prod);
            }
            for (j, a) in acc.iter_mut().enumerate() {
                let (b0, b1) = (rp[2 * j].wrapping_add(off), rp[2 * j + 1].wrapping_add(off));
                let isum = _mm512_dpbusd_epi32(init, weights_rows2::<KIND>(b0, b1), act);
                let scale = _mm512_permutexvar_ps(pick[j], prod);
                *a = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), *a);
            }
        }
        // 128-bit lane k of r: [row k, row 4 + k, row k, row 4 + k].
        let t = hsum_step2(hsum_step1(acc[0], acc[1]), hsum_step1(acc[2], acc[3]));
        let r = hsum_step3(t, t);
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut v = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r));
        if KIND == Q4_1 {
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
            v = _mm256_add_ps(v, _mm512_castps512_ps256(_mm512_permutexvar_ps(odd, summs)));
        }
        store_f32x8_prefix(job.out.range(r0, nr), v);
        r0 += nr;
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2.
// ---------------------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_i8x32(a: &[i8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f32x4(a: &[f32; 8]) -> __m128 {
    // SAFETY: `a` has at least 4 readable floats.
    unsafe { _mm_loadu_ps(a.as_ptr()) }
}

/// One weight block's 32 quants as the AVX2 dot product forms them: nibbles (`Q4_1`),
/// nibbles − 8 (`Q4_0`) or the quants (`Q8_0`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn weights_avx2<const KIND: u8>(blk: *const u8) -> __m256i {
    let q = blk.wrapping_add(qs_offset(KIND));
    if KIND == Q8_0 {
        // SAFETY: the block's 32 quants.
        return unsafe { _mm256_loadu_si256(q.cast()) };
    }
    // SAFETY: the block's 16 nibble bytes.
    let v = unsafe { _mm_loadu_si128(q.cast()) };
    let n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), _mm256_set1_epi8(0x0f));
    if KIND == Q4_0 { _mm256_sub_epi8(n, _mm256_set1_epi8(8)) } else { n }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_run_avx2<const KIND: u8>(job: &GemmJob<'_>, rows: Range<usize>) {
    check_job(job, &rows, KIND);
    let nb = job.nb;
    let tiles = job.n_tok.div_ceil(QUAD_TILE);
    let recs: &[QuadRec] = bytemuck::cast_slice(job.packed);
    assert!(recs.len() >= tiles * nb, "packed activations too short");
    let mut r0 = rows.start;
    if job.n_tok == 1 {
        let recs = &recs[..nb];
        while r0 < rows.end {
            let nr = (rows.end - r0).min(4);
            let dst = Dst { out: job.out, stride: job.stride, r0, nr, t0: 0, nt: 1 };
            let ahead = Some((job.w, (r0 + 4 * PREFETCH_TILES) * job.row_bytes));
            tile_avx2::<KIND, 4, 1>(&row_ptrs::<4>(job, r0, nr), recs, &dst, ahead);
            r0 += nr;
        }
        return;
    }
    while r0 < rows.end {
        let nr = (rows.end - r0).min(2);
        let rp = row_ptrs::<2>(job, r0, nr);
        for tile in 0..tiles {
            let t0 = tile * QUAD_TILE;
            let nt = (job.n_tok - t0).min(QUAD_TILE);
            let tr = &recs[tile * nb..(tile + 1) * nb];
            let dst = Dst { out: job.out, stride: job.stride, r0, nr, t0, nt };
            let ahead = if tile == 0 { Some((job.w, (r0 + 8) * job.row_bytes)) } else { None };
            match nt {
                1 => tile_avx2::<KIND, 2, 1>(&rp, tr, &dst, ahead),
                2 => tile_avx2::<KIND, 2, 2>(&rp, tr, &dst, ahead),
                3 => tile_avx2::<KIND, 2, 3>(&rp, tr, &dst, ahead),
                _ => tile_avx2::<KIND, 2, 4>(&rp, tr, &dst, ahead),
            }
        }
        r0 += nr;
    }
}

/// `R` rows × `T` tokens over all blocks (`recs`, one per block); prefetches `R` rows of
/// weights at `ahead` on the way.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile_avx2<const KIND: u8, const R: usize, const T: usize>(
    rp: &[*const u8; R],
    recs: &[QuadRec],
    dst: &Dst<'_>,
    ahead: Option<(&[u8], usize)>,
) {
    let bs = block_bytes(KIND);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = [_mm_setzero_ps(); R];
    for (b, rec) in recs.iter().enumerate() {
        let off = b * bs;
        if let Some((w, at)) = ahead {
            prefetch(w, at + R * off, R * bs);
        }
        for ((&row, acc), summs) in rp.iter().zip(acc.iter_mut()).zip(summs.iter_mut()) {
            let blk = row.wrapping_add(off);
            // SAFETY: `blk` is block `b < nb` of a row inside the weights (`check_job`).
            let dw = _mm256_cvtph_ps(_mm_set1_epi16(unsafe { read_u16(blk) } as i16));
            let w = weights_avx2::<KIND>(blk);
            // Signed weights go through ggml's sign trick, as in the dot products.
            let aw = if KIND == Q4_1 { w } else { _mm256_sign_epi8(w, w) };
            if KIND == Q4_1 {
                // SAFETY: as above; `m` follows `d` in a `Q4_1` block.
                let m = unsafe { read_u16(blk.wrapping_add(2)) };
                let m = _mm_cvtph_ps(_mm_set1_epi16(m as i16));
                *summs = _mm_fmadd_ps(m, load_f32x4(&rec.s), *summs);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = load_i8x32(&rec.qs[t]);
                let y = if KIND == Q4_1 { y } else { _mm256_sign_epi8(y, w) };
                let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, y), ones));
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(rec.d[t]));
                *acc = _mm256_fmadd_ps(d, q, *acc);
            }
        }
    }
    for (i, (acc, summs)) in acc.iter().zip(&summs).enumerate().take(dst.nr) {
        let mut s = [0.0f32; 4];
        // SAFETY: `s` is 4 writable floats.
        unsafe { _mm_storeu_ps(s.as_mut_ptr(), *summs) };
        for (t, a) in acc.iter().enumerate().take(dst.nt) {
            let mut v = hsum_f32x8(*a);
            if KIND == Q4_1 {
                v += s[t];
            }
            dst.out.set((dst.t0 + t) * dst.stride + dst.r0 + i, v);
        }
    }
}

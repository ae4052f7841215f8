//! The AVX-512 VNNI kernels of [`crate::cpu::lanes`]: 16 rows per register, lane `i` row `i`.
//!
//! Per (tile, block) the record's weight vectors are loaded and (nibbles) unpacked once for a
//! group of tokens; per token the block's integer parts of all 16 rows come from 8
//! `vpdpbusd` with the activation's 4-byte groups broadcast, and the scale products from one
//! multiply with a broadcast. `Exact` keeps ggml's 8 accumulators per (tile, token) (groups of
//! [`EXACT_GROUP`] tokens: 9 registers each); `Fast` one (groups of [`FAST_GROUP`]). Chunks
//! of at most [`CHUNK`] tokens are the outer loop, row tiles the next: a tile's records are
//! read from memory once per chunk and reused from L1 by every group of the chunk. Chunks
//! and groups are split evenly (130 tokens: chunks of 43, 43 and 44, groups of 14 or 15),
//! so that no short chunk or group pays a whole pass over the records for a few tokens.
//!
//! # Safety
//! `imp_run` requires the CPU features of its `target_feature` attribute; it is reachable
//! only through [`avx512`]'s safe wrapper, which [`crate::cpu::lanes::table`] installs only
//! into the table of a level [`crate::cpu::Kernels::for_level`] found this CPU to support.
//! Record reads go through raw pointers into a tile's records (`LaneMatrix::tile`), whose
//! length [`LaneJob::check`] asserted. The `Fast` kernel takes its per-token operands through
//! one-instruction `asm!` blocks (`vpdpbusd`, `vmulps`, `vfmadd231ps` with a broadcast
//! memory operand at a constant offset into the activation record it is given), each
//! reading only 4 bytes of that record: the intrinsics compute the same values, but LLVM
//! broadcasts them from registers.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::cpu::gemm::Acts;
use crate::cpu::lanes::{LANE_ROWS, LaneAct, LaneJob, LaneMath, Lanes, d_offset, rec_lines};
use crate::quant::{BlockQ8_0, BlockQ8_1, GgmlType};

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Tokens per group of the `Fast` kernel: 16 accumulators, 8 unpacked weight vectors and
/// the scales nearly fit the 32 registers (LLVM keeps a few accumulators on the stack). A
/// record is unpacked once for up to 16 tokens instead of 8: the nibble split is ~2 of a
/// token's ~15 vector operations a block at 8 (kernels/PERF.md: a 130-token prompt step
/// 105.2 → 100.2 ms, 16 tokens from DRAM +10 %).
const FAST_GROUP: usize = 16;
/// Tokens per group of the `Exact` kernel: 2 × 9 accumulators and the 8 weight vectors.
const EXACT_GROUP: usize = 2;
/// Tokens per chunk, at most (chunks are split evenly): each row tile runs all groups of a
/// chunk while its records (at most 48 blocks × 576 bytes) stay in L1, and the chunk's
/// activation records (64 × 48 × 76 bytes at most for this model family) in L2; a decode
/// step's weights stream from memory once.
const CHUNK: usize = 64;
/// Row tiles ahead whose records a tile's first group prefetches.
const PREFETCH_TILES: usize = 2;

/// Asks for record `b` of row tile `tile` to be fetched into L2.
#[inline(always)]
fn prefetch_record(job: &LaneJob<'_>, tile: Option<usize>, b: usize, lpr: usize) {
    if let Some(tile) = tile {
        let recs = &job.w.tile(tile)[b * lpr..(b + 1) * lpr];
        for line in recs {
            // SAFETY: a prefetch never faults and has no architectural effect; the address
            // is a line of the weights.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.0.as_ptr().cast()) };
        }
    }
}

const fn kind_ty(kind: u8) -> GgmlType {
    match kind {
        Q4_0 => GgmlType::Q4_0,
        Q4_1 => GgmlType::Q4_1,
        _ => GgmlType::Q8_0,
    }
}

macro_rules! wrapper {
    ($name:ident => $kind:ident, $exact:literal) => {
        fn $name(job: &LaneJob<'_>, rows: Range<usize>) {
            // SAFETY: installed only into the table of a level this CPU supports, which has
            // the features of `imp_run` (module docs).
            unsafe { imp_run::<$kind, $exact>(job, rows) }
        }
    };
}

wrapper!(exact_q4_0 => Q4_0, true);
wrapper!(exact_q4_1 => Q4_1, true);
wrapper!(exact_q8_0 => Q8_0, true);
wrapper!(fast_q4_0 => Q4_0, false);
wrapper!(fast_q4_1 => Q4_1, false);
wrapper!(fast_q8_0 => Q8_0, false);

pub(super) fn run(job: &LaneJob<'_>, rows: Range<usize>) {
    match (job.w.ty(), job.w.math()) {
        (GgmlType::Q4_0, LaneMath::Exact) => exact_q4_0(job, rows),
        (GgmlType::Q4_1, LaneMath::Exact) => exact_q4_1(job, rows),
        (GgmlType::Q8_0, LaneMath::Exact) => exact_q8_0(job, rows),
        (GgmlType::Q4_0, LaneMath::Fast) => fast_q4_0(job, rows),
        (GgmlType::Q4_1, LaneMath::Fast) => fast_q4_1(job, rows),
        (GgmlType::Q8_0, LaneMath::Fast) => fast_q8_0(job, rows),
        // `LaneMatrix::repack` admits only the types above.
        _ => {}
    }
}

/// The AVX-512 entry (the level's features were detected by the caller).
pub(crate) fn avx512() -> Lanes {
    Lanes { run, pack, tiles: false }
}

/// The AVX-512 entry with the `Fast` products of several tokens on AMX tiles
/// ([`super::tiles`]); only where [`super::tiles::request_tiles`] succeeded.
pub(crate) fn avx512_tiles() -> Lanes {
    Lanes { run: super::tiles::run, pack, tiles: true }
}

/// [`crate::cpu::lanes::pack`] with the scales converted by `vcvtph2ps` and the `Q8_0`
/// corrections summed by `vpdpbusd` (the same records, bit for bit).
fn pack(ty: GgmlType, acts: Acts<'_>, n_tok: usize, nb: usize, dst: &mut [LaneAct]) -> bool {
    let n = n_tok * nb;
    if dst.len() != n {
        return false;
    }
    match (ty, acts) {
        (GgmlType::Q4_1, Acts::Q8_1(a)) if a.len() >= n => {
            // SAFETY: reachable only from the table of a level this CPU supports (module docs).
            unsafe { imp_pack_q8_1(&a[..n], dst) }
        }
        (GgmlType::Q4_0, Acts::Q8_0(a)) if a.len() >= n => {
            // SAFETY: as above.
            unsafe { imp_pack_q8_0::<8>(&a[..n], dst) }
        }
        (GgmlType::Q8_0, Acts::Q8_0(a)) if a.len() >= n => {
            // SAFETY: as above.
            unsafe { imp_pack_q8_0::<128>(&a[..n], dst) }
        }
        _ => return false,
    }
    true
}

/// Both f16 halves of `bits` (low first) as f32.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn f16_pair(bits: u32) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_pack_q8_1(src: &[BlockQ8_1], dst: &mut [LaneAct]) {
    for (r, a) in dst.iter_mut().zip(src) {
        let (d, s) = f16_pair(u32::from(a.d.to_bits()) | u32::from(a.s.to_bits()) << 16);
        *r = LaneAct { qs: a.qs, d, s, corr: [0; 8], corr_sum: 0 };
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_pack_q8_0<const C: i32>(src: &[BlockQ8_0], dst: &mut [LaneAct]) {
    let ones = _mm256_set1_epi8(1);
    let neg_c = _mm256_set1_epi32(-C);
    for (r, a) in dst.iter_mut().zip(src) {
        // SAFETY: `qs` is 32 readable bytes.
        let q = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
        // Per 4-byte group: 1·q0 + 1·q1 + 1·q2 + 1·q3 (unsigned ones, signed quants).
        let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q);
        let corr = _mm256_mullo_epi32(sums, neg_c);
        let mut c = [0i32; 8];
        // SAFETY: `c` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(c.as_mut_ptr().cast(), corr) };
        let (d, _) = f16_pair(u32::from(a.d.to_bits()));
        *r = LaneAct { qs: a.qs, d, s: 0.0, corr: c, corr_sum: c.iter().sum() };
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_run<const KIND: u8, const EXACT: bool>(job: &LaneJob<'_>, rows: Range<usize>) {
    job.check(&rows);
    let tiles = rows.start / LANE_ROWS..rows.end / LANE_ROWS;
    // Chunks, and a chunk's groups, as even as they can be: 130 tokens are chunks of 43, 43
    // and 44 tokens in groups of 14 or 15, not 64, 64 and 2 (a last chunk of 2 tokens reads
    // every record again for two tokens' work, and a group of 2 unpacks a record for 2).
    let n = job.n_tok;
    let group = if EXACT { EXACT_GROUP } else { FAST_GROUP };
    let chunks = n.div_ceil(CHUNK);
    let mut c0 = 0;
    for c in 0..chunks {
        let c1 = (c + 1) * n / chunks;
        let groups = (c1 - c0).div_ceil(group);
        for tile in tiles.clone() {
            let mut t0 = c0;
            // The first group of the chunk fetches a later tile's records (the stream
            // prefetcher alone leaves the loads of a fresh tile exposed).
            let mut ahead = (tile + PREFETCH_TILES < tiles.end).then_some(tile + PREFETCH_TILES);
            for k in 0..groups {
                let g = c0 + (k + 1) * (c1 - c0) / groups - t0;
                debug_assert!((1..=group).contains(&g), "a group of {g} tokens");
                let pf = ahead.take();
                match (EXACT, g) {
                    (true, 1) => exact::<KIND, 1>(job, tile, t0, pf),
                    (true, _) => exact::<KIND, 2>(job, tile, t0, pf),
                    (false, 1) => fast::<KIND, 1>(job, tile, t0, pf),
                    (false, 2) => fast::<KIND, 2>(job, tile, t0, pf),
                    (false, 3) => fast::<KIND, 3>(job, tile, t0, pf),
                    (false, 4) => fast::<KIND, 4>(job, tile, t0, pf),
                    (false, 5) => fast::<KIND, 5>(job, tile, t0, pf),
                    (false, 6) => fast::<KIND, 6>(job, tile, t0, pf),
                    (false, 7) => fast::<KIND, 7>(job, tile, t0, pf),
                    (false, 8) => fast::<KIND, 8>(job, tile, t0, pf),
                    (false, 9) => fast::<KIND, 9>(job, tile, t0, pf),
                    (false, 10) => fast::<KIND, 10>(job, tile, t0, pf),
                    (false, 11) => fast::<KIND, 11>(job, tile, t0, pf),
                    (false, 12) => fast::<KIND, 12>(job, tile, t0, pf),
                    (false, 13) => fast::<KIND, 13>(job, tile, t0, pf),
                    (false, 14) => fast::<KIND, 14>(job, tile, t0, pf),
                    (false, 15) => fast::<KIND, 15>(job, tile, t0, pf),
                    (false, _) => fast::<KIND, 16>(job, tile, t0, pf),
                }
                t0 += g;
            }
        }
        c0 = c1;
    }
}

/// One record's weights: the 8 vectors of unsigned quants (vector `l` pairs with the
/// activation quants `4l..4l + 4` for every type: `Q8_0` bytes `4l..`; nibbles: the low
/// halves of vectors 0..4, the high halves of the same bytes as vectors 4..8), the 16 rows'
/// `d` and (`Q4_1`) `m`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn record<const KIND: u8>(rec: *const u8) -> ([__m512i; 8], __m512, __m512) {
    let ty = kind_ty(KIND);
    // SAFETY: (callers) `rec` is a whole record inside a tile: `rec_lines(ty)` lines; the
    // scales are 32 bytes at `d_offset`, the minimums 32 more (`Q4_1`, inside the record).
    let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(rec.wrapping_add(d_offset(ty)).cast()) });
    let mw = if KIND == Q4_1 {
        // SAFETY: as above.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(rec.wrapping_add(d_offset(ty) + 32).cast()) })
    } else {
        _mm512_setzero_ps()
    };
    let mut wv = [_mm512_setzero_si512(); 8];
    if KIND == Q8_0 {
        for (j, w) in wv.iter_mut().enumerate() {
            // SAFETY: vector `j < 8` of the record's quants.
            *w = unsafe { _mm512_loadu_si512(rec.wrapping_add(64 * j).cast()) };
        }
    } else {
        let low = _mm512_set1_epi8(0x0f);
        for j in 0..4 {
            // SAFETY: vector `j < 4` of the record's nibbles.
            let v = unsafe { _mm512_loadu_si512(rec.wrapping_add(64 * j).cast()) };
            wv[j] = _mm512_and_si512(v, low);
            wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
        }
    }
    (wv, dw, mw)
}

/// The 4-byte group `j` of a token's quants, as the broadcast operand of `vpdpbusd`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn act4(a: &LaneAct, j: usize) -> __m512i {
    let q = &a.qs[4 * j..4 * j + 4];
    _mm512_set1_epi32(i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]))
}

/// Stores token `t`'s 16 outputs of row tile `tile`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn store(job: &LaneJob<'_>, t: usize, tile: usize, v: __m512) {
    let dst = job.out.range(t * job.w.rows() + tile * LANE_ROWS, LANE_ROWS);
    // SAFETY: `dst` is 16 writable floats.
    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) };
}

/// The activations of tokens `t0..t0 + T`, the start of row tile `tile`'s records and the
/// lines per record.
#[inline(always)]
fn tile_view<'a, const KIND: u8, const T: usize>(
    job: &LaneJob<'a>,
    tile: usize,
    t0: usize,
) -> ([&'a [LaneAct]; T], *const u8, usize) {
    let nb = job.w.nb();
    let lpr = rec_lines(kind_ty(KIND));
    let recs = job.w.tile(tile);
    debug_assert_eq!(recs.len(), nb * lpr);
    let acts = std::array::from_fn(|t| &job.acts[(t0 + t) * nb..][..nb]);
    (acts, recs.as_ptr().cast(), lpr)
}

/// `Fast`: tokens `t0..t0 + T` of row tile `tile`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn fast<const KIND: u8, const T: usize>(
    job: &LaneJob<'_>,
    tile: usize,
    t0: usize,
    ahead: Option<usize>,
) {
    const { assert!(T <= 16, "the tokens are written out for groups of at most 16") };
    let (acts, base, lpr) = tile_view::<KIND, T>(job, tile, t0);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..job.w.nb() {
        prefetch_record(job, ahead, b, lpr);
        let (wv, dw, mw) = record::<KIND>(base.wrapping_add(b * lpr * 64));
        // The tokens written out one by one (`T` is a constant: the tests fold away), so
        // that the accumulators stay in registers (at 16 tokens LLVM keeps a few on the
        // stack): left as a loop, LLVM kept even the `Q4_1` kernel's eight there (a load
        // and a store per token and block).
        macro_rules! token {
            ($t:literal) => {
                if let (Some(acc), Some(a)) = (acc.get_mut($t), acts.get($t)) {
                    fast_token::<KIND>(acc, &a[b], &wv, dw, mw, T >= 4);
                }
            };
        }
        sixteen!(token);
    }
    for (t, acc) in acc.iter().enumerate() {
        store(job, t0 + t, tile, *acc);
    }
}

/// `v · a.d`, `a.d` broadcast by the load (no shuffle uop).
#[target_feature(enable = "avx512f")]
#[inline]
fn mul_d(v: __m512, a: &LaneAct) -> __m512 {
    let r: __m512;
    // SAFETY: reads the 4 bytes of `a.d`, inside `a`.
    unsafe {
        std::arch::asm!("vmulps {r}, {v}, dword ptr [{p} + {o}]{{1to16}}", r = lateout(zmm_reg) r,
            v = in(zmm_reg) v, p = in(reg) a, o = const std::mem::offset_of!(LaneAct, d),
            // Not `preserves_flags`: the product sets MXCSR's exception flags, as the
            // intrinsic's would.
            options(pure, readonly, nostack))
    };
    r
}

/// `acc + m · a.s` in one rounding, `a.s` broadcast by the load.
#[target_feature(enable = "avx512f")]
#[inline]
fn fmadd_s(mut acc: __m512, m: __m512, a: &LaneAct) -> __m512 {
    // SAFETY: reads the 4 bytes of `a.s`, inside `a`.
    unsafe {
        std::arch::asm!("vfmadd231ps {acc}, {m}, dword ptr [{p} + {o}]{{1to16}}",
            acc = inout(zmm_reg) acc, m = in(zmm_reg) m, p = in(reg) a,
            o = const std::mem::offset_of!(LaneAct, s),
            // Not `preserves_flags`: MXCSR's exception flags, as above.
            options(pure, readonly, nostack))
    };
    acc
}

/// `vpdpbusd` of `w` (unsigned) with the activation's 4-byte group `J` (signed) broadcast by
/// the load.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
fn dpbusd_group<const J: usize>(mut acc: __m512i, w: __m512i, a: &LaneAct) -> __m512i {
    const { assert!(J < 8, "a block has 8 groups of 4 quants") };
    // SAFETY: reads quants `4J..4J + 4` of `a.qs`, inside `a`.
    unsafe {
        std::arch::asm!("vpdpbusd {acc}, {w}, dword ptr [{p} + {o}]{{1to16}}",
            acc = inout(zmm_reg) acc, w = in(zmm_reg) w, p = in(reg) a,
            o = const std::mem::offset_of!(LaneAct, qs) + 4 * J,
            options(pure, readonly, nostack, preserves_flags))
    };
    acc
}

/// One token's block of a `Fast` product: `acc += f32(i) · (d_w · d_a)` with `i` the exact
/// integer dot product, then `acc += m_w · s_a` for `Q4_1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn fast_token<const KIND: u8>(
    acc: &mut __m512,
    a: &LaneAct,
    wv: &[__m512i; 8],
    dw: __m512,
    mw: __m512,
    one_chain: bool,
) {
    // Exact integers: any order of these additions gives the same sum, so the chain is
    // split in two for latency when the group has few tokens to interleave (`one_chain`
    // otherwise). The operands that are the same for all 16 rows (the 4-byte
    // groups, `d_a`, `s_a`) are broadcast by the loads of the instructions that use them:
    // written as intrinsics, LLVM merges neighbouring fields into one wider load and then
    // broadcasts from a register, a shuffle uop each on the port the products need (the
    // kernel ran at ~183 instead of ~203 GMAC/s, 8 tokens, weights in L1/L2, this Xeon).
    // The offsets are constants of the instructions, so no address is computed per group.
    // `Q4_1` starts from zero: its correction is 0.
    let mut i0 = if KIND == Q4_1 { _mm512_setzero_si512() } else { _mm512_set1_epi32(a.corr_sum) };
    // The eight groups into chains `x` (0..4) and `y` (4..8), interleaved; one chain when
    // both name the same register.
    macro_rules! chains {
        ($x:ident, $y:ident) => {
            $x = dpbusd_group::<0>($x, wv[0], a);
            $y = dpbusd_group::<4>($y, wv[4], a);
            $x = dpbusd_group::<1>($x, wv[1], a);
            $y = dpbusd_group::<5>($y, wv[5], a);
            $x = dpbusd_group::<2>($x, wv[2], a);
            $y = dpbusd_group::<6>($y, wv[6], a);
            $x = dpbusd_group::<3>($x, wv[3], a);
            $y = dpbusd_group::<7>($y, wv[7], a);
        };
    }
    let i = if one_chain {
        // A group of several tokens has their chains to interleave: one chain a token saves
        // the add that joins two.
        chains!(i0, i0);
        i0
    } else {
        let mut i1 = _mm512_setzero_si512();
        chains!(i0, i1);
        _mm512_add_epi32(i0, i1)
    };
    let d = mul_d(dw, a);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), d, *acc);
    if KIND == Q4_1 {
        *acc = fmadd_s(*acc, mw, a);
    }
}

/// `Exact`: tokens `t0..t0 + T` of row tile `tile`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn exact<const KIND: u8, const T: usize>(
    job: &LaneJob<'_>,
    tile: usize,
    t0: usize,
    ahead: Option<usize>,
) {
    let (acts, base, lpr) = tile_view::<KIND, T>(job, tile, t0);
    let mut acc = [[_mm512_setzero_ps(); 8]; T];
    let mut summs = [_mm512_setzero_ps(); T];
    for b in 0..job.w.nb() {
        prefetch_record(job, ahead, b, lpr);
        let (wv, dw, mw) = record::<KIND>(base.wrapping_add(b * lpr * 64));
        for ((acc, summs), a) in acc.iter_mut().zip(summs.iter_mut()).zip(&acts) {
            let a = &a[b];
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(a.d));
            for (l, acc) in acc.iter_mut().enumerate() {
                let init = if KIND == Q4_1 {
                    _mm512_setzero_si512()
                } else {
                    _mm512_set1_epi32(a.corr[l])
                };
                let i = _mm512_dpbusd_epi32(init, wv[l], act4(a, l));
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(i), *acc);
            }
            if KIND == Q4_1 {
                // `m_w · s_a` is exact in f32: this is ggml's `summs += m * s`.
                *summs = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), *summs);
            }
        }
    }
    for (t, (a, summs)) in acc.iter().zip(&summs).enumerate() {
        // ggml's `hsum_float_8`, lane by lane: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
        let q0 = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
        let q1 = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
        let mut r = _mm512_add_ps(q0, q1);
        if KIND == Q4_1 {
            r = _mm512_add_ps(r, *summs);
        }
        store(job, t0 + t, tile, r);
    }
}

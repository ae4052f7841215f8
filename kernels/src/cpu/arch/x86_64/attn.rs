//! AVX-512 attention of one query head over a paged f16 cache: the same bits as the generic
//! path of [`crate::ops::attention`] at the AVX-512 level, without a call per position.
//!
//! The generic path calls the level's f16 dot product once per key (whose horizontal sum
//! goes through memory) and `axpy_f16` once per value row into per-class partial sums in
//! memory. Here:
//!
//! * **Scores**, 16 keys at a time: the query (rounded to f16) is loaded once, each key
//!   gets the fused multiply-adds of the level's dot product (one 16-lane accumulator for
//!   tinyBLAS's shape, four for `vec_dot_f16`'s), and the 16 accumulators are reduced
//!   together by shuffles that add exactly the pairs `_mm512_reduce_add_ps` adds
//!   (`v[i] + v[i + 8]`, then `+4`, then `(b0 + b2) + (b1 + b3)`).
//! * **Weighted values**: class `c` (positions `p ≡ c` mod the shape's step) is accumulated
//!   in registers over its positions in order, which is the order the generic path adds
//!   them in; the classes are then combined by vertical adds in the shape's tree. For
//!   `vec_dot_f16`'s shape (decode) each class joins the tree in registers as soon as it is
//!   complete, 16 output dimensions at a time; tinyBLAS's 16 classes go through scratch.
//! * **The next unit's rows** (decode): the caller names them, and the score loop asks for
//!   a share per 16 keys, so that the fetches overlap this unit's arithmetic without filling
//!   the miss buffers at once.
//!
//! The softmax and both f16 roundings are the level's kernels, unchanged.
//!
//! [`attn_free_512`] is the same work in the free association of the non-exact arithmetics
//! ([`crate::ops::attention_free_twin`] defines its bits): f32 queries and probabilities,
//! one 16-lane accumulator per score, and the weighted values summed row by row in order
//! with every accumulator in registers — the value rows are read once, in order, instead
//! of once per class and 16 dimensions.
//!
//! [`attn_free_tile_512`] is [`attn_free_512`] for up to [`ATTN_TILE`] consecutive prompt
//! tokens of one sequence (64-element heads): each 16 keys are converted to f32 once for the
//! tile, and each value row once per set of up to six (token, head) pairs; every token keeps
//! the bits the one-token kernel gives it.
//!
//! # Safety
//! [`imp_attn_head_512`], [`imp_attn_free_512`] and [`imp_attn_free_tile_512`] require
//! AVX-512 F/BW/DQ/VL; they are
//! reachable only through the safe wrappers installed by [`super::exact::patch_avx512`]
//! into a table whose level was detected on this CPU. Every load reads from a slice whose length was checked.

use std::arch::x86_64::*;

use half::f16;

use super::exact::{load_h16, load16, store16};
use crate::cpu::attn::{
    ATTN_TILE, AttnHeadJob, AttnMode, AttnScratch, AttnTileJob, MAX_ATTN_GROUP, PagedHead, Reg64,
    TILE_HEAD,
};

/// The safe entry installed in the AVX-512 table.
pub(crate) fn attn_head_512(job: &AttnHeadJob<'_>, sc: &mut AttnScratch, out: &mut [f32]) -> bool {
    // SAFETY: installed only into the table of a detected AVX-512 level (module docs).
    unsafe { imp_attn_head_512(job, sc, out) }
}

/// Widest head these kernels handle (elements).
const MAX_HEAD: usize = crate::cpu::attn::MAX_FUSED_HEAD;

/// Most query heads one call handles (the query heads of one KV head).
const MAX_GROUP: usize = MAX_ATTN_GROUP;

/// `x` rounded to f16 and back (nearest even), 16 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn round_f16(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// `_mm512_reduce_add_ps` of each of 16 registers, as 16 lanes in register order: lane `k`
/// is `(b0 + b2) + (b1 + b3)` of register `k`, with `a[i] = v[i] + v[i + 8]` and
/// `b[i] = a[i] + a[i + 4]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn reduce16(v: &[__m512; 16]) -> __m512 {
    reduce16_by::<ADD_PS>(v)
}

/// [`reduce16_by`]'s operation: the sum of floats (in `reduce16`'s association).
pub(super) const ADD_PS: u8 = 0;
/// [`reduce16_by`]'s operation: the maximum of floats.
pub(super) const MAX_PS: u8 = 1;
/// [`reduce16_by`]'s operation: the wrapping sum of 32-bit integers (bit patterns).
pub(super) const ADD_EPI32: u8 = 2;

/// The `OP` reduction of each of 16 registers, as 16 lanes: lane `k` reduces register `k`,
/// by the tree of `_mm512_reduce_add_ps` (pairs of 256-bit halves, then of 128-bit
/// quarters, then `(b0 + b2) + (b1 + b3)`) for 16 registers at once.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
pub(super) fn reduce16_by<const OP: u8>(v: &[__m512; 16]) -> __m512 {
    let op = |a: __m512, b: __m512| match OP {
        ADD_PS => _mm512_add_ps(a, b),
        MAX_PS => _mm512_max_ps(a, b),
        _ => _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b))),
    };
    // [a of register 2k (8 lanes), a of register 2k + 1].
    let s: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (v[2 * k], v[2 * k + 1]);
        op(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xee>(x, y))
    });
    // 128-bit lane j: b of register 4m + j.
    let u: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (s[2 * m], s[2 * m + 1]);
        op(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xdd>(x, y))
    });
    // Per 128-bit lane j: [b0 + b2, b1 + b3] of register j (of u[0] or u[2]'s group), then of
    // register 4 + j.
    let w: [__m512; 2] = std::array::from_fn(|m| {
        let (x, y) = (u[2 * m], u[2 * m + 1]);
        op(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xee>(x, y))
    });
    // Lane 4j + i: register 4i + j.
    let r = op(_mm512_shuffle_ps::<0x88>(w[0], w[1]), _mm512_shuffle_ps::<0xdd>(w[0], w[1]));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, r)
}

/// `_mm512_reduce_add_ps` of 16 lane vectors at once: `v[c]` holds lane `c` of 16 sums.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn reduce_vertical(v: &[__m512; 16]) -> __m512 {
    let a: [__m512; 8] = std::array::from_fn(|i| _mm512_add_ps(v[i], v[i + 8]));
    let b: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 4]));
    _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3]))
}

/// The 16-lane accumulators of up to 16 keys (rows at `offs`) against the query chunks of
/// `G` heads (`acc[g][i]`: head `g`, key `i`): tinyBLAS's one accumulator (`GEMM`) or
/// `vec_dot_f16`'s four added as it adds them. Each key is loaded and converted once for
/// the group; `NQ` (the head size / 16) is a constant so that the chains interleave.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn keys16<const NQ: usize, const GEMM: bool, const G: usize>(
    qa: &[[__m512; MAX_HEAD / 16]; MAX_GROUP],
    keys: &[f16],
    offs: &[usize],
    acc: &mut [[__m512; 16]; MAX_GROUP],
) {
    for (i, &o) in offs.iter().enumerate().take(16) {
        let key = &keys[o..o + 16 * NQ];
        let kv: [__m512; NQ] = std::array::from_fn(|j| load_h16(&key[16 * j..]));
        for (g, qa) in qa.iter().enumerate().take(G) {
            acc[g][i] = if GEMM {
                let mut r = _mm512_setzero_ps();
                for (q, k) in qa.iter().zip(&kv) {
                    r = _mm512_fmadd_ps(*q, *k, r);
                }
                r
            } else {
                let mut r = [_mm512_setzero_ps(); 4];
                for (j, (q, k)) in qa.iter().zip(&kv).enumerate() {
                    r[j % 4] = _mm512_fmadd_ps(*q, *k, r[j % 4]);
                }
                _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]))
            };
        }
    }
}

/// [`keys16`] for any head size (a multiple of 16; of 64 without `gemm`) and group.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn keys16_any(
    qa: &[[__m512; MAX_HEAD / 16]; MAX_GROUP],
    g_n: usize,
    nq: usize,
    keys: &[f16],
    offs: &[usize],
    gemm: bool,
    acc: &mut [[__m512; 16]; MAX_GROUP],
) {
    let hd = 16 * nq;
    for (g, qa) in qa.iter().enumerate().take(g_n) {
        let qv = &qa[..nq];
        for (i, &o) in offs.iter().enumerate().take(16) {
            let key = &keys[o..o + hd];
            acc[g][i] = if gemm {
                let mut r = _mm512_setzero_ps();
                for (j, q) in qv.iter().enumerate() {
                    r = _mm512_fmadd_ps(*q, load_h16(&key[16 * j..]), r);
                }
                r
            } else {
                let mut r = [_mm512_setzero_ps(); 4];
                for (j, q) in qv.iter().enumerate() {
                    r[j % 4] = _mm512_fmadd_ps(*q, load_h16(&key[16 * j..]), r[j % 4]);
                }
                _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]))
            };
        }
    }
}

/// Dimensions `d0..d0 + 16 W` of every class's weighted sum of value rows: class `c`
/// (`0..step`) adds `w[p] * v[p]` for `p = c, c + step, ...` in order, each lane with one
/// fused multiply-add per position (as `axpy_f16` does); written to `classes[c * vd + d0..]`.
/// For `G` heads at once: head `g`'s weights are `w[g * n..]`, its classes
/// `classes[g * step * vd..]`; each value row is loaded once for all of them.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn pv_classes<const W: usize, const G: usize>(
    w: &[f32],
    n: usize,
    values: &[f16],
    offs: &[usize],
    d0: usize,
    step: usize,
    vd: usize,
    classes: &mut [f32],
) {
    let n = n.min(offs.len());
    if w.len() < G * n || classes.len() < G * step * vd {
        return;
    }
    for c in 0..step {
        let mut acc = [[_mm512_setzero_ps(); W]; G];
        let mut p = c;
        while p < n {
            let o = offs[p] + d0;
            let v = &values[o..o + 16 * W];
            let vv: [__m512; W] = std::array::from_fn(|k| load_h16(&v[16 * k..]));
            for (g, acc) in acc.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(w[g * n + p]);
                for (a, v) in acc.iter_mut().zip(&vv) {
                    *a = _mm512_fmadd_ps(wv, *v, *a);
                }
            }
            p += step;
        }
        for (g, acc) in acc.iter().enumerate() {
            let class = &mut classes[(g * step + c) * vd..(g * step + c + 1) * vd];
            for (k, a) in acc.iter().enumerate() {
                store16(&mut class[d0 + 16 * k..], *a);
            }
        }
    }
}

/// Whether a value row starts where the key row of the same position does (the same
/// blocks, block geometry, KV head and cache size): the key offsets serve the values too.
fn rows_share_offsets(keys: &PagedHead<'_>, values: &PagedHead<'_>) -> bool {
    keys.head_dim == values.head_dim
        && std::ptr::eq(keys.block_table, values.block_table)
        && keys.block_size == values.block_size
        && keys.block_stride == values.block_stride
        && keys.kv_head == values.kv_head
        && keys.data.len() == values.data.len()
}

/// The first `dst.len()` (at most 16) lanes of `v` into `dst`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn store_first(dst: &mut [f32], v: __m512) {
    if dst.len() == 16 {
        store16(dst, v);
    } else {
        let mut buf = [0.0f32; 16];
        store16(&mut buf, v);
        let m = dst.len().min(16);
        dst[..m].copy_from_slice(&buf[..m]);
    }
}

/// Asks for the cache lines of the rows of `len` halves at `offs` in `data` (rows outside
/// `data` are skipped). Rows that follow one another (a block's, the usual case) are asked
/// for as one run: a prefetch a line and a pointer step, nothing per row.
#[inline(always)]
fn prefetch_rows<const HINT: i32>(data: &[f16], offs: &[usize], len: usize) {
    let Some(&first) = offs.first() else { return };
    let one_run = offs.windows(2).all(|w| w[1] == w[0] + len);
    let runs = if one_run { std::slice::from_ref(&first) } else { offs };
    let run_len = if one_run { offs.len() * len } else { len };
    for &o in runs {
        let Some(run) = data.get(o..o + run_len) else { continue };
        let bytes = 2 * run.len();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults and has no architectural effect; the address is
            // inside `data`.
            unsafe { _mm_prefetch::<HINT>(run.as_ptr().cast::<u8>().wrapping_add(off).cast()) };
        }
    }
}

/// The start of each position's row in `head.data` (`offs.len()` positions); `false` if a
/// block is missing or a row lies outside the data.
fn row_offsets(head: &PagedHead<'_>, offs: &mut [usize]) -> bool {
    let (bs, hd) = (head.block_size, head.head_dim);
    if bs == 0 {
        return false;
    }
    let mut p = 0;
    for &block in head.block_table {
        if p >= offs.len() {
            break;
        }
        let start = head.block_start(block);
        let rows = (offs.len() - p).min(bs);
        if start + rows * hd > head.data.len() {
            return false;
        }
        for (slot, o) in offs[p..p + rows].iter_mut().enumerate() {
            *o = start + slot * hd;
        }
        p += rows;
    }
    p == offs.len()
}

/// What both fused kernels need of a job: head sizes that are multiples of 16 up to
/// [`MAX_HEAD`], a group of 1 to [`MAX_GROUP`] heads, operands and output of the group's
/// sizes, and scratch for its scores and row offsets.
fn operands_fit(job: &AttnHeadJob<'_>, sc: &AttnScratch, out: &[f32]) -> bool {
    let (n, gn) = (job.n_pos, job.heads);
    let (hd, vd) = (job.keys.head_dim, job.values.head_dim);
    let size = |d: usize| d.is_multiple_of(16) && (16..=MAX_HEAD).contains(&d);
    size(hd)
        && size(vd)
        && (1..=MAX_GROUP).contains(&gn)
        && job.q.len() == gn * hd
        && out.len() == gn * vd
        && n > 0
        && sc.scores.len() >= gn * n
        && sc.offs.len() >= n
}

/// The job's queries, rounded to f16 when `round` (ggml's), into `qa` (heads past the
/// job's and chunks past its head size keep what they held).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn queries(job: &AttnHeadJob<'_>, round: bool, qa: &mut [[__m512; MAX_HEAD / 16]; MAX_GROUP]) {
    let hd = job.keys.head_dim;
    for (g, qv) in qa.iter_mut().enumerate().take(job.heads) {
        for (i, q) in qv.iter_mut().take(hd / 16).enumerate() {
            let v = load16(&job.q[g * hd + 16 * i..]);
            *q = if round { round_f16(v) } else { v };
        }
    }
}

/// A group's 16-key score accumulators.
type ScoreRegs = [[__m512; 16]; MAX_GROUP];
/// A group's query chunks.
type QueryRegs = [[__m512; MAX_HEAD / 16]; MAX_GROUP];
/// A tile's 16 keys in f32.
type KeyRegs = [[__m512; TILE_HEAD / 16]; 16];

/// The register scratch of `regs` as the score accumulators and the queries.
fn reg_views(regs: &mut [Reg64]) -> Option<(&mut ScoreRegs, &mut QueryRegs)> {
    const ACC: usize = 16 * MAX_GROUP;
    const QA: usize = MAX_HEAD / 16 * MAX_GROUP;
    let regs = regs.get_mut(..ACC + QA)?;
    let (acc, qa) = regs.split_at_mut(ACC);
    // SAFETY: `Reg64` is 64 bytes aligned to 64, as `__m512` is, and every bit pattern is a
    // valid `__m512`; `acc` holds exactly `16 · MAX_GROUP` of them, the array's size.
    let acc = unsafe { &mut *acc.as_mut_ptr().cast::<ScoreRegs>() };
    // SAFETY: as above; `qa` holds exactly `MAX_HEAD / 16 · MAX_GROUP`, and does not overlap
    // `acc`.
    let qa = unsafe { &mut *qa.as_mut_ptr().cast::<QueryRegs>() };
    Some((acc, qa))
}

/// The key scratch of `regs` as a tile's 16 keys in f32.
fn key_view(regs: &mut [Reg64]) -> Option<&mut KeyRegs> {
    let regs = regs.get_mut(..16 * (TILE_HEAD / 16))?;
    // SAFETY: `Reg64` is 64 bytes aligned to 64, as `__m512` is, and every bit pattern is a
    // valid `__m512`; `regs` holds exactly the array's registers.
    Some(unsafe { &mut *regs.as_mut_ptr().cast::<KeyRegs>() })
}

/// The scores of a job's `heads` queries (loaded into the scratch first, rounded to f16 when
/// `round`) against its keys, 16 keys at a time, each key loaded once for the group:
/// tinyBLAS's one accumulator (`gemm`) or `vec_dot_f16`'s four and its `+ 0.0`, into
/// `sc.scores` (head after head);
/// then `sc.offs` holds where each position's value row starts. A decode token fetches its
/// next 16 keys into L1 and each chunk's values into L2 as it goes, and the caller's next
/// unit a share per chunk. `false` when a row lies outside the cache.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn scores_and_value_rows(
    job: &AttnHeadJob<'_>,
    round: bool,
    gemm: bool,
    sc: &mut AttnScratch,
) -> bool {
    let Some((acc, qa)) = reg_views(&mut sc.regs) else { return false };
    queries(job, round, qa);
    let qa = &*qa;
    let (keys, values, n, gn) = (job.keys, job.values, job.n_pos, job.heads);
    let (hd, vd) = (keys.head_dim, values.head_dim);
    // Where each position's rows start (validated once, no division per row).
    let offs = &mut sc.offs[..n];
    if !row_offsets(keys, offs) {
        return false;
    }
    let same_layout = rows_share_offsets(keys, values);
    let decode = job.mode == AttnMode::Decode;
    let scores = &mut sc.scores[..gn * n];
    let mut p0 = 0;
    let parts = n.div_ceil(16);
    while p0 < n {
        let m = (n - p0).min(16);
        // The caller's next unit, a share per chunk of keys.
        if let Some(next) = job.next {
            next.prefetch_part(p0 / 16, parts);
        }
        let ko = &offs[p0..p0 + m];
        // A decode step reads each sequence's rows once, from scattered blocks in memory:
        // fetch the next 16 keys into L1 and this chunk's values into L2 while the scores
        // are computed. Prompt tokens re-read rows that are already cached; there it only
        // costs.
        if decode {
            let next = &offs[(p0 + 16).min(n)..(p0 + 32).min(n)];
            prefetch_rows::<_MM_HINT_T0>(keys.data, next, hd);
            if same_layout {
                prefetch_rows::<_MM_HINT_T1>(values.data, ko, vd);
            }
        }
        let a = &mut *acc;
        match (hd, gemm, gn) {
            (64, true, 1) => keys16::<4, true, 1>(qa, keys.data, ko, a),
            (64, true, 2) => keys16::<4, true, 2>(qa, keys.data, ko, a),
            (64, true, 3) => keys16::<4, true, 3>(qa, keys.data, ko, a),
            (64, true, _) => keys16::<4, true, 4>(qa, keys.data, ko, a),
            (64, false, 1) => keys16::<4, false, 1>(qa, keys.data, ko, a),
            (64, false, 2) => keys16::<4, false, 2>(qa, keys.data, ko, a),
            (64, false, 3) => keys16::<4, false, 3>(qa, keys.data, ko, a),
            (64, false, _) => keys16::<4, false, 4>(qa, keys.data, ko, a),
            (128, true, 1) => keys16::<8, true, 1>(qa, keys.data, ko, a),
            (128, true, 2) => keys16::<8, true, 2>(qa, keys.data, ko, a),
            (128, false, 1) => keys16::<8, false, 1>(qa, keys.data, ko, a),
            _ => keys16_any(qa, gn, hd / 16, keys.data, ko, gemm, a),
        }
        for (g, acc) in acc.iter().enumerate().take(gn) {
            // Keys past `m` hold stale sums; their lanes are dropped below.
            let mut s = reduce16(acc);
            if !gemm {
                // `vec_dot_f16` ends with `(f64(sum) + 0.0) as f32`, which turns -0 into +0.
                s = _mm512_add_ps(s, _mm512_setzero_ps());
            }
            let dst = &mut scores[g * n + p0..g * n + p0 + m];
            store_first(dst, s);
        }
        p0 += m;
    }
    same_layout || row_offsets(values, offs)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_attn_head_512(job: &AttnHeadJob<'_>, sc: &mut AttnScratch, out: &mut [f32]) -> bool {
    let (keys, values, n, gn) = (job.keys, job.values, job.n_pos, job.heads);
    let (hd, vd) = (keys.head_dim, values.head_dim);
    let prefill = job.mode == AttnMode::Prefill;
    // The scores: tinyBLAS's one accumulator when ggml's gemm path takes the product (the
    // length a multiple of 16), else `vec_dot_f16`'s four, here only without a tail.
    let gemm_scores = prefill && hd.is_multiple_of(16);
    // The weighted values: step 16 (tinyBLAS) or 64 (`vec_dot_f16`'s 4 × 16 lanes).
    let step = if prefill && vd.is_multiple_of(4) { 16 } else { 64 };
    if !operands_fit(job, sc, out)
        || (!gemm_scores && !hd.is_multiple_of(64))
        || sc.classes.len() < gn * step * vd
    {
        return false;
    }
    // The queries rounded to f16, in registers (or close by).
    if !scores_and_value_rows(job, true, gemm_scores, sc) {
        return false;
    }
    let (scores, offs) = (&mut sc.scores[..gn * n], &sc.offs[..n]);

    for head in scores.chunks_exact_mut(n) {
        (job.softmax)(head, job.scale);
        // The probabilities as f16 values, kept in f32.
        let mut chunks = head.chunks_exact_mut(16);
        for c in &mut chunks {
            store16(c, round_f16(load16(c)));
        }
        for v in chunks.into_remainder() {
            *v = f16::from_f32(*v).to_f32();
        }
    }

    let values = &values.data;
    if step == 64 && offs.len() >= n {
        // `vec_dot_f16`'s shape: 16 output dimensions at a time, each class summed in
        // registers and combined into the shape's tree as soon as it is complete (nothing
        // goes through memory).
        let pv = match gn {
            1 => pv_tree::<1>,
            2 => pv_tree::<2>,
            3 => pv_tree::<3>,
            _ => pv_tree::<4>,
        };
        for d0 in (0..vd).step_by(16) {
            pv(scores, n, values, offs, d0, vd, out);
        }
        return true;
    }

    // Per class, its positions in order, accumulated in registers, 64 dimensions at a time,
    // each value row loaded once for the group.
    let classes = &mut sc.classes[..gn * step * vd];
    for d0 in (0..vd).step_by(64) {
        let pv = match ((vd - d0) / 16, gn) {
            (1, _) => pv_classes_any::<1>,
            (2, _) => pv_classes_any::<2>,
            (3, _) => pv_classes_any::<3>,
            (_, 1) => pv_classes::<4, 1>,
            (_, 2) => pv_classes::<4, 2>,
            (_, 3) => pv_classes::<4, 3>,
            _ => pv_classes::<4, 4>,
        };
        pv(scores, n, values, offs, d0, step, vd, classes);
    }
    let nd = vd / 16;

    // The classes combined as the shape's registers are, 16 output dimensions at a time.
    for (g, out) in out.chunks_exact_mut(vd).enumerate() {
        let classes = &classes[g * step * vd..(g + 1) * step * vd];
        for k in 0..nd {
            let lane = |c: usize| load16(&classes[c * vd + 16 * k..]);
            let lanes: [__m512; 16] = std::array::from_fn(lane);
            // `SumShape::finish` ends with `(f64(sum) + 0.0) as f32`: -0 becomes +0.
            let r = _mm512_add_ps(reduce_vertical(&lanes), _mm512_setzero_ps());
            store16(&mut out[16 * k..], r);
        }
    }
    true
}

/// Lane-wise sums of `G` heads' registers.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn add_g<const G: usize>(a: [__m512; G], b: [__m512; G]) -> [__m512; G] {
    std::array::from_fn(|g| _mm512_add_ps(a[g], b[g]))
}

/// Dimensions `d0..d0 + 16` of `vec_dot_f16`-shaped weighted values of `G` heads: class `c`
/// (positions `p ≡ c` mod 64, in order, one fused multiply-add each) is summed in
/// registers, and the 64 classes are added in the shape's tree (its 4 registers of 16
/// lanes: `(r0 + r2) + (r1 + r3)` per lane, then `_mm512_reduce_add_ps`'s pairs, which for
/// 16 lanes at once are the vertical adds of [`reduce_vertical`]), so that class `l` of
/// lane tree position `l` meets its partners as soon as they are complete. Head `g`'s
/// weights are `w[g * n..]`, its output `out[g * vd + d0..]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn pv_tree<const G: usize>(
    w: &[f32],
    n: usize,
    values: &[f16],
    offs: &[usize],
    d0: usize,
    vd: usize,
    out: &mut [f32],
) {
    if w.len() < G * n || offs.len() < n || out.len() < G * vd || d0 + 16 > vd {
        return;
    }
    let class = |c: usize| -> [__m512; G] {
        let mut acc = [_mm512_setzero_ps(); G];
        let mut p = c;
        while p < n {
            let v = load_h16(&values[offs[p] + d0..]);
            for (g, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(w[g * n + p]), v, *a);
            }
            p += 64;
        }
        acc
    };
    // Register `l` of the 16 the shape's four registers fold into.
    let lane =
        |l: usize| add_g(add_g(class(l), class(32 + l)), add_g(class(16 + l), class(48 + l)));
    let a = |i: usize| add_g(lane(i), lane(i + 8));
    let b = |i: usize| add_g(a(i), a(i + 4));
    let r = add_g(add_g(b(0), b(2)), add_g(b(1), b(3)));
    for (g, r) in r.iter().enumerate() {
        // `SumShape::finish` ends with `(f64(sum) + 0.0) as f32`: -0 becomes +0.
        store16(&mut out[g * vd + d0..], _mm512_add_ps(*r, _mm512_setzero_ps()));
    }
}

/// [`pv_classes`] for groups of any size up to [`MAX_GROUP`] (head by head).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
fn pv_classes_any<const W: usize>(
    w: &[f32],
    n: usize,
    values: &[f16],
    offs: &[usize],
    d0: usize,
    step: usize,
    vd: usize,
    classes: &mut [f32],
) {
    for (w, classes) in w.chunks_exact(n.max(1)).zip(classes.chunks_exact_mut(step * vd)) {
        pv_classes::<W, 1>(w, n, values, offs, d0, step, vd, classes);
    }
}

/// The safe entry of the free-association kernel installed in the AVX-512 table
/// ([`crate::cpu::Kernels::attn_free`]).
pub(crate) fn attn_free_512(job: &AttnHeadJob<'_>, sc: &mut AttnScratch, out: &mut [f32]) -> bool {
    // SAFETY: installed only into the table of a detected AVX-512 level (module docs).
    unsafe { imp_attn_free_512(job, sc, out) }
}

/// Attention of a group of query heads in the free association of
/// [`crate::ops::attention_free_twin`], with its bits: f32 queries; each score one 16-lane
/// accumulator of fused multiply-adds over the head's 16-element chunks, reduced as
/// `_mm512_reduce_add_ps` reduces (by [`reduce16`], 16 keys at once); the level's softmax;
/// each output dimension one fused multiply-add per position, in position order, from
/// zero. Value rows are read once, in order, for every head and dimension of the group
/// (64 dimensions per pass), with the accumulators in registers.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_attn_free_512(job: &AttnHeadJob<'_>, sc: &mut AttnScratch, out: &mut [f32]) -> bool {
    let (values, n, gn) = (job.values, job.n_pos, job.heads);
    let vd = values.head_dim;
    if !operands_fit(job, sc, out) {
        return false;
    }
    if !scores_and_value_rows(job, false, true, sc) {
        return false;
    }
    let scores = &mut sc.scores[..gn * n];
    for head in scores.chunks_exact_mut(n) {
        (job.softmax)(head, job.scale);
    }
    let offs = &sc.offs[..n];
    for d0 in (0..vd).step_by(64) {
        let pv = match ((vd - d0) / 16, gn) {
            (1, _) => pv_rows_any::<1>,
            (2, _) => pv_rows_any::<2>,
            (3, _) => pv_rows_any::<3>,
            (_, 1) => pv_rows::<4, 1>,
            (_, 2) => pv_rows::<4, 2>,
            (_, 3) => pv_rows::<4, 3>,
            _ => pv_rows::<4, 4>,
        };
        pv(scores, n, values.data, offs, d0, vd, out);
    }
    true
}

/// Dimensions `d0..d0 + 16 W` of `G` heads' weighted values: `out[g * vd + d] = Σ_p
/// w[g * n + p] · v_p[d]`, one fused multiply-add per position in order from zero, every
/// value row loaded once for the group.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn pv_rows<const W: usize, const G: usize>(
    w: &[f32],
    n: usize,
    values: &[f16],
    offs: &[usize],
    d0: usize,
    vd: usize,
    out: &mut [f32],
) {
    if w.len() < G * n || offs.len() < n || out.len() < G * vd || d0 + 16 * W > vd {
        return;
    }
    let mut acc = [[_mm512_setzero_ps(); W]; G];
    for (p, &o) in offs.iter().enumerate().take(n) {
        let v = &values[o + d0..o + d0 + 16 * W];
        let vv: [__m512; W] = std::array::from_fn(|k| load_h16(&v[16 * k..]));
        for (g, acc) in acc.iter_mut().enumerate() {
            let wv = _mm512_set1_ps(w[g * n + p]);
            for (a, v) in acc.iter_mut().zip(&vv) {
                *a = _mm512_fmadd_ps(wv, *v, *a);
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (k, a) in acc.iter().enumerate() {
            store16(&mut out[g * vd + d0 + 16 * k..], *a);
        }
    }
}

/// [`pv_rows`] for groups of any size up to [`MAX_GROUP`] (head by head).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn pv_rows_any<const W: usize>(
    w: &[f32],
    n: usize,
    values: &[f16],
    offs: &[usize],
    d0: usize,
    vd: usize,
    out: &mut [f32],
) {
    for (w, out) in w.chunks_exact(n.max(1)).zip(out.chunks_exact_mut(vd)) {
        pv_rows::<W, 1>(w, n, values, offs, d0, vd, out);
    }
}

/// The safe entry of the tile kernel installed in the AVX-512 table
/// ([`crate::cpu::Kernels::attn_free_tile`]).
pub(crate) fn attn_free_tile_512(
    job: &AttnTileJob<'_>,
    sc: &mut AttnScratch,
    out: &mut [&mut [f32]],
) -> bool {
    // SAFETY: installed only into the table of a detected AVX-512 level (module docs).
    unsafe { imp_attn_free_tile_512(job, sc, out) }
}

/// [`imp_attn_free_512`] of a tile of consecutive prompt tokens (64-element heads): each 16
/// keys are converted to f32 once for the tile and each value row once per set of up to six
/// (token, head) pairs, and every (token, head) then does exactly what the one-token kernel does —
/// the same fused multiply-adds from zero, the same [`reduce16`], the level's softmax over
/// its own positions, and its weighted values one position after another from zero.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_attn_free_tile_512(
    job: &AttnTileJob<'_>,
    sc: &mut AttnScratch,
    out: &mut [&mut [f32]],
) -> bool {
    const HD: usize = TILE_HEAD;
    let (keys, values, gn, tn, n0) = (job.keys, job.values, job.heads, job.tokens, job.n0);
    if keys.head_dim != HD
        || values.head_dim != HD
        || !(1..=MAX_GROUP).contains(&gn)
        || !(1..=ATTN_TILE).contains(&tn)
        || n0 == 0
        || out.len() < tn
        || (0..tn).any(|j| job.q[j].len() != gn * HD || out[j].len() != gn * HD)
    {
        return false;
    }
    // Positions of the last token; virtual heads (token, head), token-major.
    let (n, nv) = (n0 + tn - 1, tn * gn);
    if sc.scores.len() < nv * n || sc.offs.len() < n {
        return false;
    }
    if !row_offsets(keys, &mut sc.offs[..n]) {
        return false;
    }
    let Some(kf) = key_view(&mut sc.keys32) else { return false };
    let (offs, scores) = (&sc.offs[..n], &mut sc.scores[..nv * n]);
    let mut p0 = 0;
    while p0 < n {
        let m = (n - p0).min(16);
        for (i, &o) in offs[p0..p0 + m].iter().enumerate() {
            let key = &keys.data[o..o + HD];
            kf[i] = std::array::from_fn(|c| load_h16(&key[16 * c..]));
        }
        for j in 0..tn {
            let nj = n0 + j;
            if p0 >= nj {
                continue;
            }
            let mj = (nj - p0).min(16);
            for g in 0..gn {
                let qv = &job.q[j][g * HD..(g + 1) * HD];
                let q: [__m512; HD / 16] = std::array::from_fn(|c| load16(&qv[16 * c..]));
                // `keys16::<4, true, _>`'s accumulators: one chain from zero over the chunks
                // per key (keys past `mj` stay zero; their lanes are dropped below).
                let mut acc = [_mm512_setzero_ps(); 16];
                if mj == 16 {
                    for (a, k) in acc.iter_mut().zip(kf.iter()) {
                        *a = chain4(&q, k);
                    }
                } else {
                    for (a, k) in acc.iter_mut().zip(kf.iter()).take(mj) {
                        *a = chain4(&q, k);
                    }
                }
                let s = reduce16(&acc);
                let v = j * gn + g;
                let dst = &mut scores[v * n + p0..v * n + p0 + mj];
                store_first(dst, s);
            }
        }
        p0 += m;
    }
    for v in 0..nv {
        let nj = n0 + v / gn;
        (job.softmax)(&mut scores[v * n..v * n + nj], job.scale);
    }
    let same_layout = rows_share_offsets(keys, values);
    if !same_layout && !row_offsets(values, &mut sc.offs[..n]) {
        return false;
    }
    let (offs, scores) = (&sc.offs[..n], &sc.scores[..nv * n]);
    // Sets of up to 6 virtual heads (24 accumulators beside the 4 value registers).
    let mut v0 = 0;
    while v0 < nv {
        let vs = (nv - v0).min(6);
        let pv = match vs {
            1 => pv_tile::<1>,
            2 => pv_tile::<2>,
            3 => pv_tile::<3>,
            4 => pv_tile::<4>,
            5 => pv_tile::<5>,
            _ => pv_tile::<6>,
        };
        if !pv(scores, n, n0, gn, v0, values.data, offs, out) {
            return false;
        }
        v0 += vs;
    }
    true
}

/// A 64-element value row in f32 (written as a function: as closures in [`pv_tile`], LLVM
/// left this and its neighbour out of line, a call per row).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn value_row(r: &[f16]) -> [__m512; TILE_HEAD / 16] {
    std::array::from_fn(|c| load_h16(&r[16 * c..]))
}

/// `Σ q[c] · k[c]` as one chain of fused multiply-adds from zero, `c` in order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn chain4(q: &[__m512; 4], k: &[__m512; 4]) -> __m512 {
    let mut r = _mm512_setzero_ps();
    for (q, k) in q.iter().zip(k) {
        r = _mm512_fmadd_ps(*q, *k, r);
    }
    r
}

/// The weighted values of virtual heads `v0..v0 + NV` (token `v / gn`, head `v % gn`;
/// weights `w[v * n..]`; 64 dimensions): [`pv_rows`]'s fused multiply-adds, one per position
/// of the token's own `n0 + v / gn`, in order from zero; each value row converted once for
/// the set. `false`, having written nothing, if the operands do not have the set's sizes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
fn pv_tile<const NV: usize>(
    w: &[f32],
    n: usize,
    n0: usize,
    gn: usize,
    v0: usize,
    values: &[f16],
    offs: &[usize],
    out: &mut [&mut [f32]],
) -> bool {
    let last = (v0 + NV).div_ceil(gn.max(1));
    let fits =
        out.len() >= last && out[v0 / gn.max(1)..last].iter().all(|o| o.len() >= gn * TILE_HEAD);
    if w.len() < (v0 + NV) * n || offs.len() < n || gn == 0 || !fits || n0 > n {
        return false;
    }
    let own: [usize; NV] = std::array::from_fn(|k| (n0 + (v0 + k) / gn).min(n));
    let mut acc = [[_mm512_setzero_ps(); TILE_HEAD / 16]; NV];
    // Positions every head of the set attends to, then the later tokens' own.
    for p in 0..own[0] {
        let vv = value_row(&values[offs[p]..offs[p] + TILE_HEAD]);
        for (k, acc) in acc.iter_mut().enumerate() {
            let wv = _mm512_set1_ps(w[(v0 + k) * n + p]);
            for (a, v) in acc.iter_mut().zip(&vv) {
                *a = _mm512_fmadd_ps(wv, *v, *a);
            }
        }
    }
    for p in own[0]..own[NV - 1] {
        let vv = value_row(&values[offs[p]..offs[p] + TILE_HEAD]);
        for (k, acc) in acc.iter_mut().enumerate() {
            if p < own[k] {
                let wv = _mm512_set1_ps(w[(v0 + k) * n + p]);
                for (a, v) in acc.iter_mut().zip(&vv) {
                    *a = _mm512_fmadd_ps(wv, *v, *a);
                }
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        let (j, g) = ((v0 + k) / gn, (v0 + k) % gn);
        for (c, a) in acc.iter().enumerate() {
            store16(&mut out[j][g * TILE_HEAD + 16 * c..], *a);
        }
    }
    true
}

//! AVX-512 (F/BW/DQ/VL) + VNNI kernels: integer dot products with `vpdpbusd`/`vpdpwssd`,
//! 16-lane float ops with masked tails, and (when the CPU has AVX512_BF16) `vdpbf16ps` for
//! bf16 dot products.
//!
//! The quantized dot products keep ggml's 8-lane association (one 256-bit accumulator,
//! blocks in order; VNNI only in the exact integer part), so they equal ggml's x86
//! `vec_dot` bit for bit (`tests/ggml_order.rs`). Variants that put two blocks of one row in
//! a 512-bit register were measured (48 blocks, Zen 4): not faster for `Q4_0`/`Q4_1`/`Q8_0`
//! once the scale conversion stopped chaining blocks, ~10% faster for `Q6_K`, and they change
//! the rounding. The 512-bit width pays where each half carries an independent dot product
//! (two rows or two tokens per register), which is a matrix-kernel concern.
//!
//! # Safety
//! Every `imp_*` function requires the features listed in its `target_feature` attribute.
//! They are only reachable through safe wrappers stored in the table built by [`kernels`],
//! which [`crate::cpu::Kernels::for_level`] calls only after
//! [`crate::cpu::SimdLevel::Avx512`] (which implies AVX2) was detected; the bf16 kernel is
//! put in the table only when `avx512bf16` is detected as well. Full-width loads and stores
//! go through fixed-size arrays; tails use masked loads and stores, which touch only the
//! lanes whose mask bit is set (lanes that exist in the slice).

use std::arch::x86_64::*;

use super::attn::{ADD_EPI32, MAX_PS, reduce16_by};
use super::avx2::{
    self, expc, f16_pair, f16_x8, hsum_f32x4, hsum_f32x8, load_i8x16, load_i8x32, load_u8x16,
    load_u8x32, pairs, q4k_mins_dot_bsums, q4k_scales, q6k_offset_correction, scale_product_x8,
    word_splat_mask,
};
use crate::cpu::{Kernels, SimdLevel};
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use crate::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};

macro_rules! safe_wrapper {
    ($name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: this wrapper is only stored in the AVX-512 table, which is built only
            // after the AVX-512 and VNNI features were detected (see the module docs).
            unsafe { $imp($($arg),*) }
        }
    };
}

safe_wrapper!(quantize_q8_1 => imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]));
safe_wrapper!(quantize_q8_k => imp_quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]));
safe_wrapper!(dot_q4_0_q8_0 => imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_1_q8_1 => imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
safe_wrapper!(dot_q8_0_q8_0 => imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_k_q8_k => imp_dot_q4_k_q8_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32);
safe_wrapper!(dot_q6_k_q8_k => imp_dot_q6_k_q8_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32);
safe_wrapper!(f32_to_bf16 => imp_f32_to_bf16(x: &[f32], out: &mut [u16]));
safe_wrapper!(rmsnorm => imp_rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]));
safe_wrapper!(softmax => imp_softmax(x: &mut [f32], scale: f32));
safe_wrapper!(swiglu => imp_swiglu(gate: &[f32], up: &[f32], out: &mut [f32]));

fn dot_bf16(x: &[u16], y: &[u16]) -> f32 {
    // SAFETY: stored in the table only when avx512bf16 was detected on top of the AVX-512
    // level (see `kernels`).
    unsafe { imp_dot_bf16(x, y) }
}

/// The AVX-512 table: the AVX2 table with the AVX-512 kernels swapped in. The bf16 dot
/// product uses `vdpbf16ps` where the CPU has AVX512_BF16 and stays on AVX2 otherwise.
pub(crate) fn kernels() -> Kernels {
    let base = avx2::kernels();
    Kernels {
        level: SimdLevel::Avx512,
        quantize_q8_1,
        quantize_q8_k,
        dot_q4_0_q8_0,
        dot_q4_1_q8_1,
        dot_q8_0_q8_0,
        dot_q4_k_q8_k,
        dot_q6_k_q8_k,
        dot_bf16: if std::is_x86_feature_detected!("avx512bf16") {
            dot_bf16
        } else {
            base.dot_bf16
        },
        f32_to_bf16,
        rmsnorm,
        softmax,
        swiglu,
        ..base
    }
}

// ---------------------------------------------------------------------------------------------
// Loads, stores and masks.
// ---------------------------------------------------------------------------------------------

/// The mask of the first `n` of 16 lanes (all 16 when `n >= 16`).
#[inline]
fn mask16(n: usize) -> __mmask16 {
    if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
}

/// Loads 16 floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_f32x16(a: &[f32; 16]) -> __m512 {
    // SAFETY: `a` is 16 readable floats.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

/// Stores 16 floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn store_f32x16(a: &mut [f32; 16], v: __m512) {
    // SAFETY: `a` is 16 writable floats.
    unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) }
}

/// Loads the first `min(a.len(), 16)` floats of `a`; the other lanes take `fill`'s.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn load_f32_tail(a: &[f32], fill: __m512) -> __m512 {
    // SAFETY: the mask covers only lanes that exist in `a`; masked-off lanes are not read.
    unsafe { _mm512_mask_loadu_ps(fill, mask16(a.len()), a.as_ptr()) }
}

/// Stores the first `min(a.len(), 16)` lanes of `v` into `a`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn store_f32_tail(a: &mut [f32], v: __m512) {
    // SAFETY: the mask covers only lanes that exist in `a`; masked-off lanes are not written.
    unsafe { _mm512_mask_storeu_ps(a.as_mut_ptr(), mask16(a.len()), v) }
}

// ---------------------------------------------------------------------------------------------
// Activation quantizer.
// ---------------------------------------------------------------------------------------------

/// Blocks of 32 floats quantized together by [`imp_quantize_q8_1`]: one lane each.
const Q8_1_GROUP: usize = 16;

/// f32 to `Q8_1`, bit-identical to the AVX2 kernel (and so to [`crate::quant::quantize_q8_1`]
/// wherever that one is): 16 blocks at a time, with what is per block (the largest
/// magnitude, the scales, the quants' sum) computed for all 16 at once, lane `b` for block
/// `b`, by [`reduce16_by`]; the AVX2 kernel chains one block's maximum, division and
/// horizontal sum after another. Maxima of magnitudes and integer sums do not depend on
/// the order; the divisions, products, roundings (to nearest even) and f16 conversions are
/// the same IEEE operations lane by lane. A group with a NaN (where the AVX2 kernel's
/// maximum depends on the order) or a scale whose inverse overflows (which the scalar
/// codec handles) goes to the AVX2 kernel, as do the blocks past the last whole group.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    let (groups, _) = x.as_chunks::<{ 32 * Q8_1_GROUP }>();
    let (outs, _) = out.as_chunks_mut::<Q8_1_GROUP>();
    let mut done = 0;
    for (x, out) in groups.iter().zip(outs.iter_mut()) {
        if !quantize_q8_1_group(x, out) {
            avx2::imp_quantize_q8_1(x, out);
        }
        done += Q8_1_GROUP;
    }
    if done < out.len() {
        avx2::imp_quantize_q8_1(&x[(32 * done).min(x.len())..], &mut out[done..]);
    }
}

/// One group of [`imp_quantize_q8_1`]; `false` (nothing written) if it has a NaN or a scale
/// whose inverse is not finite.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn quantize_q8_1_group(x: &[f32; 32 * Q8_1_GROUP], out: &mut [BlockQ8_1; Q8_1_GROUP]) -> bool {
    let (v, _) = x.as_chunks::<16>();
    let sign = _mm512_set1_ps(-0.0);
    let mut nan: __mmask16 = 0;
    let m: [__m512; 16] = std::array::from_fn(|b| {
        let (lo, hi) = (load_f32x16(&v[2 * b]), load_f32x16(&v[2 * b + 1]));
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(lo, hi);
        _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi))
    });
    if nan != 0 {
        return false;
    }
    let amax = reduce16_by::<MAX_PS>(&m);
    let zero = _mm512_setzero_ps();
    let d = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
    let id = _mm512_maskz_div_ps(
        _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(amax, zero),
        _mm512_set1_ps(127.0),
        amax,
    );
    // ±inf: the scalar codec's case.
    if _mm512_fpclass_ps_mask::<0x18>(id) != 0 {
        return false;
    }
    let mut ids = [0.0f32; 16];
    store_f32x16(&mut ids, id);
    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let sums: [__m512; 16] = std::array::from_fn(|b| {
        let s = _mm512_set1_ps(ids[b]);
        let (lo, hi) = (load_f32x16(&v[2 * b]), load_f32x16(&v[2 * b + 1]));
        let qlo = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(lo, s));
        let qhi = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(hi, s));
        // Signed saturation to bytes, as the AVX2 kernel's two packs give.
        let (q0, q1) = (_mm512_cvtsepi32_epi8(qlo), _mm512_cvtsepi32_epi8(qhi));
        let (h0, h1) = out[b].qs.split_at_mut(16);
        // SAFETY: `h0` is 16 writable bytes.
        unsafe { _mm_storeu_si128(h0.as_mut_ptr().cast(), q0) };
        // SAFETY: `h1` is 16 writable bytes.
        unsafe { _mm_storeu_si128(h1.as_mut_ptr().cast(), q1) };
        _mm512_castsi512_ps(_mm512_add_epi32(qlo, qhi))
    });
    let sum = _mm512_castps_si512(reduce16_by::<ADD_EPI32>(&sums));
    let s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum));
    let (d16, s16) = (_mm512_cvtps_ph::<RNE>(d), _mm512_cvtps_ph::<RNE>(s));
    let mut dh = [0u16; 16];
    let mut sh = [0u16; 16];
    // SAFETY: `dh` is 16 writable halves (32 bytes).
    unsafe { _mm256_storeu_si256(dh.as_mut_ptr().cast(), d16) };
    // SAFETY: `sh` is 16 writable halves (32 bytes).
    unsafe { _mm256_storeu_si256(sh.as_mut_ptr().cast(), s16) };
    for ((o, d), s) in out.iter_mut().zip(dh).zip(sh) {
        o.d = half::f16::from_bits(d);
        o.s = half::f16::from_bits(s);
    }
    true
}

/// f32 to `Q8_K`, bit-identical to [`quant_k::quantize_q8_k`]: one 16-float register per
/// 16-quant group, so each group's sum is one horizontal add.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    let (xs, _) = x.as_chunks::<QK_K>();
    for (b, x) in out.iter_mut().zip(xs) {
        let (v, _) = x.as_chunks::<16>();
        let mut m = _mm512_setzero_ps();
        for v in v {
            m = _mm512_max_ps(m, _mm512_abs_ps(load_f32x16(v)));
        }
        let amax = _mm512_reduce_max_ps(m);
        if amax == 0.0 {
            b.d = 0.0;
            b.qs = [0; QK_K];
            b.bsums = [0; 16];
            continue;
        }
        // The signed value of the first element of largest magnitude, as the scalar scan
        // finds it.
        let am = _mm512_set1_ps(amax);
        let mut max = amax;
        for v in v {
            let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(load_f32x16(v)), am);
            if hit != 0 {
                max = v[hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        if !iscale.is_finite() {
            // A block of subnormals: leave the saturating casts to the scalar codec.
            quant_k::quantize_q8_k(x, std::slice::from_mut(b));
            continue;
        }
        let mul = _mm512_set1_ps(iscale);
        let top = _mm512_set1_epi32(127);
        let (qs, _) = b.qs.as_chunks_mut::<16>();
        for ((q, v), s) in qs.iter_mut().zip(v).zip(b.bsums.iter_mut()) {
            const R: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let i = _mm512_cvt_roundps_epi32::<R>(_mm512_mul_ps(load_f32x16(v), mul));
            let i = _mm512_min_epi32(i, top);
            // Every lane is within -127..=127, so truncating to bytes is exact.
            let bytes = _mm512_cvtepi32_epi8(i);
            // SAFETY: `q` is 16 writable bytes.
            unsafe { _mm_storeu_si128(q.as_mut_ptr().cast(), bytes) };
            *s = _mm512_reduce_add_epi32(i) as i16;
        }
        b.d = 1.0 / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized dot products.
// ---------------------------------------------------------------------------------------------

/// Sum of products of unsigned bytes `ax` with signed bytes `sy`, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn dot_us8(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy))
}

/// Sum of products of signed bytes, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn dot_i8(x: __m256i, y: __m256i) -> __m256 {
    dot_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in pairs(x, y) {
        let d = scale_product_x8(x.d, y.d);
        let qx = _mm256_sub_epi8(avx2::nibbles_32(&x.qs), _mm256_set1_epi8(8));
        acc = _mm256_fmadd_ps(d, dot_i8(qx, load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    // The sum of m * s, in lane 0.
    let mut summs = _mm_setzero_ps();
    for (x, y) in pairs(x, y) {
        // [d_x * d_y, m * s]
        let p = _mm_mul_ps(f16_pair(x.d, x.m), f16_pair(y.d, y.s));
        summs = _mm_add_ss(summs, _mm_movehdup_ps(p));
        let d = _mm256_broadcastss_ps(p);
        acc = _mm256_fmadd_ps(d, dot_us8(avx2::nibbles_32(&x.qs), load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc) + _mm_cvtss_f32(summs)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in pairs(x, y) {
        let d = scale_product_x8(x.d, y.d);
        acc = _mm256_fmadd_ps(d, dot_i8(load_i8x32(&x.qs), load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_dot_q4_k_q8_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (x, y) in pairs(x, y) {
        let (d, dmin) = q4k_scales(x, y);
        // 8 scales then 8 mins, widened to i16.
        let sm = _mm256_cvtepu8_epi16(load_u8x16(&quant_k::unpack_scales_mins_k4(&x.scales)));
        let prod = q4k_mins_dot_bsums(_mm256_extracti128_si256::<1>(sm), &y.bsums);
        acc_m = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(prod), acc_m);

        let scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        let (q4, _) = x.qs.as_chunks::<32>();
        let (q8, _) = y.qs.as_chunks::<32>();
        let mut sumi = _mm256_setzero_si256();
        for (c, (q4, q8)) in q4.iter().zip(q8.chunks_exact(2)).enumerate() {
            // Chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
            let scale_l = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(word_splat_mask(2 * c)));
            let scale_h =
                _mm256_shuffle_epi8(scales, _mm256_set1_epi16(word_splat_mask(2 * c + 1)));
            let bits = load_u8x32(q4);
            let q4l = _mm256_and_si256(bits, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let pl = _mm256_maddubs_epi16(q4l, load_i8x32(&q8[0]));
            let ph = _mm256_maddubs_epi16(q4h, load_i8x32(&q8[1]));
            // vpdpwssd = the AVX2 kernel's madd + add, lane for lane.
            sumi = _mm256_dpwssd_epi32(sumi, scale_l, pl);
            sumi = _mm256_dpwssd_epi32(sumi, scale_h, ph);
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_f32x8(acc) + hsum_f32x4(acc_m)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_dot_q6_k_q8_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in pairs(x, y) {
        let d = _mm256_mul_ps(_mm256_set1_ps(y.d), f16_x8(x.d));
        let scales = load_i8x16(&x.scales);
        let correction = q6k_offset_correction(_mm256_cvtepi8_epi16(scales), &y.bsums);
        let (ql, _) = x.ql.as_chunks::<32>();
        let (qh, _) = x.qh.as_chunks::<32>();
        let (q8, _) = y.qs.as_chunks::<32>();
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            let q6 = avx2::q6k_half(&ql[2 * h..2 * h + 2], &qh[h]);
            for (k, q6) in q6.into_iter().enumerate() {
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                    scales,
                    avx2::q6k_scale_pick(8 * h + 2 * k),
                ));
                let p = _mm256_maddubs_epi16(q6, load_i8x32(&q8[4 * h + k]));
                sumi = _mm256_dpwssd_epi32(sumi, sc, p);
            }
        }
        sumi = _mm256_sub_epi32(sumi, correction);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_f32x8(acc)
}

// ---------------------------------------------------------------------------------------------
// bf16.
// ---------------------------------------------------------------------------------------------

/// bf16 · bf16 with `vdpbf16ps` (pairs of exact bf16 products added into f32 lanes), shaped
/// like ggml's AVX512_BF16 `vec_dot_bf16`: two accumulators over 64-element steps, each
/// reduced and added in f64, the remaining elements' products added in f64.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")]
fn imp_dot_bf16(x: &[u16], y: &[u16]) -> f32 {
    let n = x.len().min(y.len());
    let (xs, xt) = x[..n].as_chunks::<64>();
    let (ys, yt) = y[..n].as_chunks::<64>();
    let mut acc = [_mm512_setzero_ps(); 2];
    for (xv, yv) in xs.iter().zip(ys) {
        for (a, (xh, yh)) in
            acc.iter_mut().zip(xv.as_chunks::<32>().0.iter().zip(yv.as_chunks::<32>().0))
        {
            // SAFETY: `xh` and `yh` are 64 readable bytes each.
            let p = unsafe { _mm512_loadu_si512(xh.as_ptr().cast()) };
            // SAFETY: as above.
            let q = unsafe { _mm512_loadu_si512(yh.as_ptr().cast()) };
            *a = _mm512_dpbf16_ps(*a, as_bh(p), as_bh(q));
        }
    }
    let mut sum = f64::from(_mm512_reduce_add_ps(acc[0]));
    sum += f64::from(_mm512_reduce_add_ps(acc[1]));
    for (&a, &b) in xt.iter().zip(yt) {
        sum += f64::from(quant_k::bf16_to_f32(a) * quant_k::bf16_to_f32(b));
    }
    sum as f32
}

/// 32 bf16 bit patterns as the bf16 vector type.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")]
#[inline]
fn as_bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain SIMD values; every bit pattern is valid for either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Rounds 16 floats to bf16 bit patterns (nearest even; NaN stays a quiet NaN) in the low
/// 16 bits of each i32 lane: [`quant_k::f32_to_bf16`] on every lane.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn f32x16_to_bf16_lanes(v: __m512) -> __m512i {
    let u = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(u), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(u, bias));
    let abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(u), _mm512_set1_epi32(64));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_f32_to_bf16(x: &[f32], out: &mut [u16]) {
    let n = x.len().min(out.len());
    let (xs, xt) = x[..n].as_chunks::<16>();
    let (os, ot) = out[..n].as_chunks_mut::<16>();
    for (xv, o) in xs.iter().zip(os.iter_mut()) {
        let h = _mm512_cvtepi32_epi16(f32x16_to_bf16_lanes(load_f32x16(xv)));
        // SAFETY: `o` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), h) };
    }
    if !xt.is_empty() {
        let v = f32x16_to_bf16_lanes(load_f32_tail(xt, _mm512_setzero_ps()));
        // SAFETY: the mask covers only elements that exist in `ot` (as long as `xt`).
        unsafe { _mm512_mask_cvtepi32_storeu_epi16(ot.as_mut_ptr().cast(), mask16(ot.len()), v) };
    }
}

// ---------------------------------------------------------------------------------------------
// exp, and the element-wise ops built on it.
// ---------------------------------------------------------------------------------------------

/// e^x on 16 lanes: the algorithm of [`avx2::exp_f32x8`], with `vscalefps` doing the
/// 2^n scaling (which handles the subnormal range itself).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn exp_f32x16(x: __m512) -> __m512 {
    use expc::*;
    let set = _mm512_set1_ps;
    let shifter = set(SHIFTER);
    let z = _mm512_fmadd_ps(x, set(LOG2E), shifter);
    let n = _mm512_sub_ps(z, shifter);
    let b = _mm512_fnmadd_ps(n, set(LN2_LO), _mm512_fnmadd_ps(n, set(LN2_HI), x));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(set(C5), b, set(C4)),
            u,
            _mm512_fmadd_ps(set(C3), b, set(C2)),
        ),
        u,
        _mm512_fmadd_ps(set(C1), b, set(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    // Beyond |n| > 192 the reduction itself is meaningless (x is ±inf or huge): the answer
    // is +inf or 0.
    let huge = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), set(192.0));
    if huge == 0 {
        return res;
    }
    let neg = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(neg, set(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(huge, res, alt)
}

/// silu(x) = x / (1 + e^-x) on 16 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn silu_f32x16(x: __m512) -> __m512 {
    let e = exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e))
}

/// Adds 16 floats to two f64x8 accumulators (exactly: every f32 is an f64).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
fn add_f32x16_to_f64(acc: &mut [__m512d; 2], v: __m512) {
    acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(v)));
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len().min(w.len()).min(out.len());
    // Squares in f32 (as the reference), summed in f64 lanes.
    let (xs, xt) = x[..n].as_chunks::<16>();
    let mut acc = [_mm512_setzero_pd(); 2];
    for v in xs {
        let v = load_f32x16(v);
        add_f32x16_to_f64(&mut acc, _mm512_mul_ps(v, v));
    }
    let t = load_f32_tail(xt, _mm512_setzero_ps());
    add_f32x16_to_f64(&mut acc, _mm512_mul_ps(t, t));
    let sum = _mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1]));
    let mean = (sum / n as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    let sv = _mm512_set1_ps(scale);
    let (ws, wt) = w[..n].as_chunks::<16>();
    let (os, ot) = out[..n].as_chunks_mut::<16>();
    for ((xv, wv), o) in xs.iter().zip(ws).zip(os.iter_mut()) {
        store_f32x16(o, _mm512_mul_ps(_mm512_mul_ps(load_f32x16(xv), sv), load_f32x16(wv)));
    }
    let wv = load_f32_tail(wt, _mm512_setzero_ps());
    store_f32_tail(ot, _mm512_mul_ps(_mm512_mul_ps(t, sv), wv));
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_softmax(x: &mut [f32], scale: f32) {
    let sv = _mm512_set1_ps(scale);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let (xs, xt) = x.as_chunks_mut::<16>();
    let mut mv = ninf;
    for v in xs.iter_mut() {
        let s = _mm512_mul_ps(load_f32x16(v), sv);
        store_f32x16(v, s);
        mv = _mm512_max_ps(mv, s);
    }
    // Tail lanes past the end hold -inf: they do not change the max and their exp is 0.
    let t = _mm512_mask_mul_ps(ninf, mask16(xt.len()), load_f32_tail(xt, ninf), sv);
    mv = _mm512_max_ps(mv, t);
    let maxv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    let mut acc = [_mm512_setzero_pd(); 2];
    for v in xs.iter_mut() {
        let e = exp_f32x16(_mm512_sub_ps(load_f32x16(v), maxv));
        store_f32x16(v, e);
        add_f32x16_to_f64(&mut acc, e);
    }
    let et = exp_f32x16(_mm512_sub_ps(t, maxv));
    add_f32x16_to_f64(&mut acc, et);
    let sum = _mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1]));
    let iv = _mm512_set1_ps((1.0 / sum) as f32);
    for v in xs.iter_mut() {
        store_f32x16(v, _mm512_mul_ps(load_f32x16(v), iv));
    }
    store_f32_tail(xt, _mm512_mul_ps(et, iv));
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = gate.len().min(up.len()).min(out.len());
    let (gs, gt) = gate[..n].as_chunks::<16>();
    let (us, ut) = up[..n].as_chunks::<16>();
    let (os, ot) = out[..n].as_chunks_mut::<16>();
    for ((g, u), o) in gs.iter().zip(us).zip(os.iter_mut()) {
        store_f32x16(o, _mm512_mul_ps(silu_f32x16(load_f32x16(g)), load_f32x16(u)));
    }
    let zero = _mm512_setzero_ps();
    let g = load_f32_tail(gt, zero);
    store_f32_tail(ot, _mm512_mul_ps(silu_f32x16(g), load_f32_tail(ut, zero)));
}

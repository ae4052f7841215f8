//! AVX2 + FMA + F16C kernels.
//!
//! # Safety
//! Every `imp_*` function requires the `avx2`, `fma` and `f16c` CPU features. They are only
//! reachable through the safe wrappers in [`kernels`]'s table, and that table is only built
//! by [`crate::cpu::Kernels::for_level`] after [`crate::cpu::SimdLevel::Avx2`] was detected.
//! Loads use unaligned intrinsics on pointers derived from slices whose lengths are checked
//! (or are fixed-size block fields), so no access leaves its slice.

use std::arch::x86_64::*;

use half::f16;

use crate::cpu::{Kernels, SimdLevel, reference};
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

/// Wraps a `#[target_feature]` function into a safe function for the level's table.
macro_rules! safe_wrapper {
    ($name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: this wrapper is only stored in the AVX2 table, which is built only
            // after the avx2/fma/f16c features were detected (see the module docs).
            unsafe { $imp($($arg),*) }
        }
    };
}

safe_wrapper!(quantize_q8_0 => imp_quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]));
safe_wrapper!(quantize_q8_1 => imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]));
safe_wrapper!(dot_q4_0_q8_0 => imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_1_q8_1 => imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
safe_wrapper!(dot_q8_0_q8_0 => imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_f16 => imp_dot_f16(x: &[f16], y: &[f16]) -> f32);
safe_wrapper!(dot_f32 => imp_dot_f32(x: &[f32], y: &[f32]) -> f32);
safe_wrapper!(f32_to_f16 => imp_f32_to_f16(x: &[f32], out: &mut [f16]));
safe_wrapper!(f16_to_f32 => imp_f16_to_f32(x: &[f16], out: &mut [f32]));
safe_wrapper!(axpy_f16 => imp_axpy_f16(a: f32, x: &[f16], y: &mut [f32]));

/// The AVX2 table. Only [`crate::cpu::Kernels::for_level`] may call this.
pub(crate) fn kernels() -> Kernels {
    Kernels {
        level: SimdLevel::Avx2,
        quantize_q8_0,
        quantize_q8_1,
        dot_q4_0_q8_0,
        dot_q4_1_q8_1,
        dot_q8_0_q8_0,
        dot_f16,
        dot_f32,
        f32_to_f16,
        f16_to_f32,
        axpy_f16,
        ..reference::KERNELS
    }
}

/// Horizontal sum of 8 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum_f32x8(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sum of 8 i32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum_i32x8(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// Unpacks 16 bytes of nibbles into 32 bytes: low nibbles first, then high nibbles.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn nibbles_32(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes.
    let tmp = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let bytes = _mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp);
    _mm256_and_si256(bytes, _mm256_set1_epi8(0x0f))
}

/// Loads 32 signed bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_i8x32(qs: &[i8; 32]) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

/// Sum of products of unsigned bytes `ax` with signed bytes `sy`, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_us8_pairs_float(ax: __m256i, sy: __m256i) -> __m256 {
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)))
}

/// Sum of products of signed bytes, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_sum_i8_pairs_float(x: __m256i, y: __m256i) -> __m256 {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    mul_sum_us8_pairs_float(ax, sy)
}

/// Quantizes 32 floats to signed bytes with ggml's scheme; returns (d, bytes, sum of quants).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quantize_block_32(x: &[f32]) -> (f32, __m256i, i32) {
    debug_assert!(x.len() >= 32);
    // SAFETY: the callers pass chunks of exactly 32 floats.
    let (v0, v1, v2, v3) = unsafe {
        let p = x.as_ptr();
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24)))
    };
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_andnot_ps(sign, v0);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v1));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v2));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v3));
    let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    let amax = _mm_cvtss_f32(m4);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mul = _mm256_set1_ps(id);
    const R: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let i0 = _mm256_cvtps_epi32(_mm256_round_ps::<R>(_mm256_mul_ps(v0, mul)));
    let i1 = _mm256_cvtps_epi32(_mm256_round_ps::<R>(_mm256_mul_ps(v1, mul)));
    let i2 = _mm256_cvtps_epi32(_mm256_round_ps::<R>(_mm256_mul_ps(v2, mul)));
    let i3 = _mm256_cvtps_epi32(_mm256_round_ps::<R>(_mm256_mul_ps(v3, mul)));
    let sum = hsum_i32x8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    let a = _mm256_packs_epi32(i0, i1);
    let b = _mm256_packs_epi32(i2, i3);
    let packed = _mm256_packs_epi16(a, b);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    (d, _mm256_permutevar8x32_epi32(packed, perm), sum)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let (d, q, _) = quantize_block_32(x);
        b.d = f16::from_f32(d);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let (d, q, sum) = quantize_block_32(x);
        b.d = f16::from_f32(d);
        b.s = f16::from_f32(d * sum as f32);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        let qx = _mm256_sub_epi8(nibbles_32(&x.qs), _mm256_set1_epi8(8));
        let q = mul_sum_i8_pairs_float(qx, load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        summs += x.m.to_f32() * y.s.to_f32();
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        let q = mul_sum_us8_pairs_float(nibbles_32(&x.qs), load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc) + summs
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        let q = mul_sum_i8_pairs_float(load_i8x32(&x.qs), load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc)
}

/// Loads 8 halves as floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f16x8(x: &[f16]) -> __m256 {
    debug_assert!(x.len() >= 8);
    // SAFETY: callers pass at least 8 halves; f16 is a transparent u16.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(x.as_ptr().cast()) })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            *a = _mm256_fmadd_ps(load_f16x8(&x[o..]), load_f16x8(&y[o..]), *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(load_f16x8(&x[i..]), load_f16x8(&y[i..]), acc[0]);
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum_f32x8(v);
    for j in i..n {
        sum += x[j].to_f32() * y[j].to_f32();
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * k;
            // SAFETY: o + 8 <= n for both slices.
            let (a0, b0) = unsafe { (_mm256_loadu_ps(x.as_ptr().add(o)), _mm256_loadu_ps(y.as_ptr().add(o))) };
            *a = _mm256_fmadd_ps(a0, b0, *a);
        }
        i += 32;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum_f32x8(v);
    for j in i..n {
        sum += x[j] * y[j];
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_f32_to_f16(x: &[f32], out: &mut [f16]) {
    let n = x.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n for both slices; f16 is a transparent u16.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), h);
        }
        i += 8;
    }
    for j in i..n {
        out[j] = f16::from_f32(x[j]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_f16_to_f32(x: &[f16], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        let v = load_f16x8(&x[i..]);
        // SAFETY: i + 8 <= n.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), v) };
        i += 8;
    }
    for j in i..n {
        out[j] = x[j].to_f32();
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let xv = load_f16x8(&x[i..]);
        // SAFETY: i + 8 <= n.
        unsafe {
            let p = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(p)));
        }
        i += 8;
    }
    for j in i..n {
        y[j] += a * x[j].to_f32();
    }
}

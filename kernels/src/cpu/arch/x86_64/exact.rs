//! x86 SIMD implementations of the ggml-exact kernels (see [`crate::cpu::exact`]).
//!
//! # Safety
//! Each `imp_*` function requires the CPU features of its `target_feature` attribute. They
//! are reachable only through the safe wrappers installed by [`patch_avx2`] and
//! [`patch_avx512`], which [`crate::cpu::Kernels::for_level`] calls only for a table whose level
//! was detected on this CPU (AVX-512 implies the AVX2 features here). Loads and stores use
//! unaligned intrinsics on pointers derived from slices with checked lengths.

use std::arch::x86_64::*;

use half::f16;

use crate::cpu::exact::Reduce;
#[cfg(test)]
use crate::cpu::exact::shapes;
use crate::cpu::{Kernels, SimdLevel};

macro_rules! wrapper {
    ($feat:literal, $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: installed only into tables of a detected level that has these
            // features (module docs).
            unsafe { $imp($($arg),*) }
        }
    };
}

wrapper!("avx2", dot_f16_decode_avx2 => imp_dot_f16_decode_avx2(x: &[f16], y: &[f16]) -> f32);
wrapper!("avx2", dot_f16_gemm_avx2 => imp_dot_f16_gemm_avx2(x: &[f16], y: &[f16]) -> f32);
wrapper!("avx2", softmax_avx2 => imp_softmax_avx2(x: &mut [f32], scale: f32));
wrapper!("avx2", swiglu_avx2 => imp_swiglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]));
wrapper!("avx2", fma_f16_avx2 => imp_fma_f16_avx2(a: f32, x: &[f16], y: &mut [f32]));
wrapper!("avx2", rmsnorm_rows_avx2 => imp_rmsnorm_rows_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]));
wrapper!("avx512", dot_f16_decode_512 => imp_dot_f16_decode_512(x: &[f16], y: &[f16]) -> f32);
wrapper!("avx512", dot_f16_gemm_512 => imp_dot_f16_gemm_512(x: &[f16], y: &[f16]) -> f32);
wrapper!("avx512", softmax_512 => imp_softmax_512(x: &mut [f32], scale: f32));
wrapper!("avx512", swiglu_512 => imp_swiglu_512(g: &[f32], u: &[f32], out: &mut [f32]));

pub(crate) fn patch_avx2(k: &mut Kernels) {
    debug_assert_eq!(k.level, SimdLevel::Avx2);
    k.dot_f16 = dot_f16_decode_avx2;
    k.dot_f16_gemm = dot_f16_gemm_avx2;
    k.softmax = softmax_avx2;
    k.swiglu = swiglu_avx2;
    k.axpy_f16 = fma_f16_avx2;
    k.rmsnorm_rows = rmsnorm_rows_avx2;
}

pub(crate) fn patch_avx512(k: &mut Kernels) {
    debug_assert_eq!(k.level, SimdLevel::Avx512);
    k.dot_f16 = dot_f16_decode_512;
    k.dot_f16_gemm = dot_f16_gemm_512;
    k.softmax = softmax_512;
    k.swiglu = swiglu_512;
    k.axpy_f16 = fma_f16_avx2;
    k.rmsnorm_rows = rmsnorm_rows_avx2;
    k.attn_head = Some(super::attn::attn_head_512);
    k.attn_free = Some(super::attn::attn_free_512);
    k.attn_free_tile = Some(super::attn::attn_free_tile_512);
}

/// ggml's `rms_norm` of each `w.len()`-long row of `x` into the same row of `out`, with
/// [`crate::cpu::reference::rmsnorm`]'s bits row by row: eight rows at a time, each row's
/// squares (rounded to f32) added in order to an f64 lane of its own. Per 8 columns the 8
/// rows' squares are transposed (8 × 8) so that column `j` of all 8 rows is one vector, and
/// the 8 columns join their lanes' sums one after another — the reference's additions in
/// the reference's order, 8 rows per instruction instead of one. Rows past the last group
/// of 8 take the reference.
#[target_feature(enable = "avx2,fma,f16c")]
fn imp_rmsnorm_rows_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    const R: usize = 8;
    let d = w.len();
    let n = x.len().min(out.len());
    if d == 0 || n < d {
        return;
    }
    let groups = n / (d * R);
    let main = d - d % 8;
    for g in 0..groups {
        let xg = &x[g * d * R..(g + 1) * d * R];
        // Lanes 0..4 of `lo` and of `hi`: rows 0..4 and 4..8.
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for i in (0..main).step_by(8) {
            let sq: [__m256; R] = std::array::from_fn(|r| {
                let v = load8(&xg[r * d + i..r * d + i + 8]);
                _mm256_mul_ps(v, v)
            });
            for c in transpose8(sq) {
                lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
                hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(c)));
            }
        }
        let mut sums = [0.0f64; R];
        let (s0, s1) = sums.split_at_mut(4);
        // SAFETY: `s0` holds 4 f64.
        unsafe { _mm256_storeu_pd(s0.as_mut_ptr(), lo) };
        // SAFETY: `s1` holds 4 f64.
        unsafe { _mm256_storeu_pd(s1.as_mut_ptr(), hi) };
        for (r, sum) in sums.iter_mut().enumerate() {
            for &v in &xg[r * d + main..(r + 1) * d] {
                *sum += f64::from(v * v);
            }
            let row = r * d..(r + 1) * d;
            rms_scale(&xg[row.clone()], w, eps, *sum, &mut out[g * d * R..][row]);
        }
    }
    let done = groups * d * R;
    for (xr, or) in x[done..n].chunks_exact(d).zip(out[done..n].chunks_exact_mut(d)) {
        crate::cpu::reference::rmsnorm(xr, w, eps, or);
    }
}

/// The second half of [`crate::cpu::reference::rmsnorm`] (its bits), 8 columns at a time:
/// `out = (x · scale) · w`, `scale = 1 / sqrt(f32(sum / len) + eps)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn rms_scale(x: &[f32], w: &[f32], eps: f32, sum: f64, out: &mut [f32]) {
    let n = x.len().min(w.len()).min(out.len());
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    let sv = _mm256_set1_ps(scale);
    let main = n - n % 8;
    for i in (0..main).step_by(8) {
        let v = _mm256_mul_ps(_mm256_mul_ps(load8(&x[i..i + 8]), sv), load8(&w[i..i + 8]));
        store8(&mut out[i..i + 8], v);
    }
    for ((o, &v), &w) in out[main..n].iter_mut().zip(&x[main..n]).zip(&w[main..n]) {
        *o = (v * scale) * w;
    }
}

/// The 8 × 8 transpose: lane `r` of result `j` is lane `j` of `v[r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
    let t: [__m256; 8] = std::array::from_fn(|k| {
        let (a, b) = (v[2 * (k / 2)], v[2 * (k / 2) + 1]);
        if k % 2 == 0 { _mm256_unpacklo_ps(a, b) } else { _mm256_unpackhi_ps(a, b) }
    });
    // t[0] = r0r1 lanes (0,1 | 4,5), t[1] = r0r1 (2,3 | 6,7), t[2], t[3]: rows 2, 3; ...
    let u: [__m256; 8] = std::array::from_fn(|k| {
        let base = 4 * (k / 4);
        let (a, b) = (t[base + (k % 2)], t[base + 2 + (k % 2)]);
        if (k / 2) % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xee>(a, b)
        }
    });
    // u[0]: rows 0..4, columns 0 | 4; u[2]: columns 1 | 5; u[1]: 2 | 6; u[3]: 3 | 7 (u[4..]
    // the same for rows 4..8).
    let col = [0usize, 2, 1, 3];
    std::array::from_fn(|j| {
        let (a, b) = (u[col[j % 4]], u[4 + col[j % 4]]);
        if j < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        }
    })
}

fn f32_bits(b: u32) -> f32 {
    f32::from_bits(b)
}

// ---------------------------------------------------------------------------------------
// AVX2 (ggml built with AVX2 + FMA + F16C)

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_h8(x: &[f16]) -> __m256 {
    debug_assert!(x.len() >= 8);
    // SAFETY: at least 8 halves are readable (callers step within bounds).
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(x.as_ptr().cast()) })
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load8(x: &[f32]) -> __m256 {
    assert!(x.len() >= 8);
    // SAFETY: 8 floats are readable (checked above).
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store8(x: &mut [f32], v: __m256) {
    assert!(x.len() >= 8);
    // SAFETY: 8 floats are writable (checked above).
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), v) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lanes8(v: __m256) -> [f32; 8] {
    let mut a = [0.0f32; 8];
    // SAFETY: `a` has 8 floats.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
    a
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f16_decode_avx2(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let main = n - n % 32;
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < main {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *a = _mm256_fmadd_ps(load_h8(&x[o..]), load_h8(&y[o..]), *a);
        }
        i += 32;
    }
    let r0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let r = Reduce::YmmHadd.apply(&lanes8(r0));
    let mut rest = 0.0f64;
    for j in main..n {
        rest += f64::from(x[j].to_f32() * y[j].to_f32());
    }
    (f64::from(r) + rest) as f32
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f16_gemm_avx2(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    if !n.is_multiple_of(8) {
        return imp_dot_f16_decode_avx2(x, y);
    }
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        acc = _mm256_fmadd_ps(load_h8(&x[i..]), load_h8(&y[i..]), acc);
        i += 8;
    }
    Reduce::YmmMovehl.apply(&lanes8(acc))
}

/// ggml's AVX2 `ggml_v_expf`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn v_expf_avx2(x: __m256) -> __m256 {
    let r = _mm256_set1_ps(f32_bits(0x4b40_0000));
    let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32_bits(0x3fb8_aa3b)), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(
        n,
        _mm256_set1_ps(f32_bits(0x35bf_be8e)),
        _mm256_fnmadd_ps(n, _mm256_set1_ps(f32_bits(0x3f31_7200)), x),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
    let absn = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let c = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(absn, _mm256_set1_ps(126.0)));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32_bits(0x3c07_2010)),
                b,
                _mm256_set1_ps(f32_bits(0x3d2b_9f17)),
            ),
            u,
            _mm256_fmadd_ps(
                _mm256_set1_ps(f32_bits(0x3e2a_af33)),
                b,
                _mm256_set1_ps(f32_bits(0x3eff_fedb)),
            ),
        ),
        u,
        _mm256_mul_ps(_mm256_set1_ps(f32_bits(0x3f7f_fff6)), b),
    );
    if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let d = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(absn, _mm256_set1_ps(192.0)));
    _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            _mm256_castsi256_ps(d),
            _mm256_or_ps(
                _mm256_and_ps(
                    _mm256_castsi256_ps(c),
                    _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1),
                ),
                _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_softmax_avx2(x: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for v in x.iter_mut() {
        *v *= scale;
        if *v > max {
            max = *v;
        }
    }
    let mut sum = 0.0f64;
    let vmax = _mm256_set1_ps(max);
    for chunk in x.chunks_mut(8) {
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..chunk.len()].copy_from_slice(chunk);
        // SAFETY: `buf` holds 8 floats.
        let v = unsafe { _mm256_loadu_ps(buf.as_ptr()) };
        let mut e = lanes8(v_expf_avx2(_mm256_sub_ps(v, vmax)));
        // Lanes past the row stand for ggml's masked (-inf) entries: exactly zero.
        e[chunk.len()..].fill(0.0);
        chunk.copy_from_slice(&e[..chunk.len()]);
        let t: [f32; 4] = std::array::from_fn(|i| e[i + 4] + e[i]);
        sum += f64::from((t[0] + t[2]) + (t[1] + t[3]));
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_swiglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = g.len().min(u.len()).min(out.len());
    let main = n - n % 8;
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i < main {
        let x = load8(&g[i..i + 8]);
        let silu = _mm256_div_ps(
            x,
            _mm256_add_ps(one, v_expf_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x))),
        );
        store8(&mut out[i..i + 8], _mm256_mul_ps(silu, load8(&u[i..i + 8])));
        i += 8;
    }
    for j in main..n {
        out[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_fma_f16_avx2(a: f32, x: &[f16], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let xv = load_h8(&x[i..]);
        let yv = load8(&y[i..i + 8]);
        store8(&mut y[i..i + 8], _mm256_fmadd_ps(av, xv, yv));
        i += 8;
    }
    for j in i..n {
        y[j] = a.mul_add(x[j].to_f32(), y[j]);
    }
}

// ---------------------------------------------------------------------------------------
// AVX-512 (ggml built with -march=native on an AVX-512 CPU)

/// 16 halves of `x` widened to f32 (also used by the attention kernel).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
pub(super) fn load_h16(x: &[f16]) -> __m512 {
    assert!(x.len() >= 16);
    // SAFETY: 16 halves are readable (checked above).
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(x.as_ptr().cast()) })
}

/// The first 16 floats of `x`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
pub(super) fn load16(x: &[f32]) -> __m512 {
    assert!(x.len() >= 16);
    // SAFETY: 16 floats are readable (checked above).
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

/// Stores 16 floats at the start of `x`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
pub(super) fn store16(x: &mut [f32], v: __m512) {
    assert!(x.len() >= 16);
    // SAFETY: 16 floats are writable (checked above).
    unsafe { _mm512_storeu_ps(x.as_mut_ptr(), v) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn lanes16(v: __m512) -> [f32; 16] {
    let mut a = [0.0f32; 16];
    // SAFETY: `a` has 16 floats.
    unsafe { _mm512_storeu_ps(a.as_mut_ptr(), v) };
    a
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_dot_f16_decode_512(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let main = n - n % 64;
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i < main {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = i + 16 * j;
            *a = _mm512_fmadd_ps(load_h16(&x[o..]), load_h16(&y[o..]), *a);
        }
        i += 64;
    }
    let r0 = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    let r = Reduce::Zmm.apply(&lanes16(r0));
    let mut rest = 0.0f64;
    for j in main..n {
        rest += f64::from(x[j].to_f32() * y[j].to_f32());
    }
    (f64::from(r) + rest) as f32
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_dot_f16_gemm_512(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    if !n.is_multiple_of(16) {
        return imp_dot_f16_decode_512(x, y);
    }
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        acc = _mm512_fmadd_ps(load_h16(&x[i..]), load_h16(&y[i..]), acc);
        i += 16;
    }
    Reduce::Zmm.apply(&lanes16(acc))
}

/// ggml's AVX-512 `ggml_v_expf`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn v_expf_512(x: __m512) -> __m512 {
    let r = _mm512_set1_ps(f32_bits(0x4b40_0000));
    let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32_bits(0x3fb8_aa3b)), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(
        n,
        _mm512_set1_ps(f32_bits(0x35bf_be8e)),
        _mm512_fnmadd_ps(n, _mm512_set1_ps(f32_bits(0x3f31_7200)), x),
    );
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_set1_ps(f32_bits(0x3c07_2010)),
                b,
                _mm512_set1_ps(f32_bits(0x3d2b_9f17)),
            ),
            u,
            _mm512_fmadd_ps(
                _mm512_set1_ps(f32_bits(0x3e2a_af33)),
                b,
                _mm512_set1_ps(f32_bits(0x3eff_fedb)),
            ),
        ),
        u,
        _mm512_fmadd_ps(_mm512_set1_ps(f32_bits(0x3f7f_fff6)), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if d == 0 {
        return res;
    }
    let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, _mm512_setzero_ps());
    let alt = _mm512_mask_blend_ps(le, _mm512_set1_ps(f32::INFINITY), _mm512_setzero_ps());
    _mm512_mask_blend_ps(d, res, alt)
}

/// `_mm512_reduce_add_ps` as GCC lowers it (the order [`Reduce::Zmm`] writes out): halves
/// added 16 → 8 → 4, then `(v0 + v2) + (v1 + v3)`, in registers.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn reduce_add_zmm(v: __m512) -> f32 {
    let a = _mm256_add_ps(_mm512_extractf32x8_ps::<1>(v), _mm512_castps512_ps256(v));
    let b = _mm_add_ps(_mm256_extractf128_ps::<1>(a), _mm256_castps256_ps128(a));
    // [b0 + b2, b1 + b3, ..], then lane 0 + lane 1.
    let c = _mm_add_ps(b, _mm_shuffle_ps::<0b01_00_11_10>(b, b));
    let d = _mm_add_ps(c, _mm_shuffle_ps::<0b10_11_00_01>(c, c));
    _mm_cvtss_f32(d)
}

/// ggml's soft_max row at this level: scores scaled, their maximum, `exp(x - max)` by
/// ggml's vectorized `expf` 16 at a time, each register's `_mm512_reduce_add_ps` added to
/// an f64 sum in order, then one product with `1 / sum`. The scaling, the maximum and the
/// normalization run 16 lanes at a time (the maximum is order-independent; a zero maximum,
/// whose sign could depend on the order, is taken from the in-order scan).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_softmax_512(x: &mut [f32], scale: f32) {
    let n = x.len();
    let main = n - n % 16;
    // The partial last register: its lanes past the row are masked off in every pass (left
    // out of the maximum, their exponentials set to exactly zero).
    let tail = (n - main) as u32;
    let mask: __mmask16 = ((1u32 << tail) - 1) as u16;
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let vs = _mm512_set1_ps(scale);
    // `_mm512_max_ps(v, m)` keeps `m` when `v` is NaN or both are zeros, as `v > m` does.
    let mut vmax = ninf;
    for c in x[..main].chunks_exact_mut(16) {
        let v = _mm512_mul_ps(load16(c), vs);
        store16(c, v);
        vmax = _mm512_max_ps(v, vmax);
    }
    let rest = &mut x[main..];
    if tail > 0 {
        // SAFETY: the mask covers the `tail` floats of `rest` only.
        let v = _mm512_mul_ps(unsafe { _mm512_mask_loadu_ps(ninf, mask, rest.as_ptr()) }, vs);
        // SAFETY: as above.
        unsafe { _mm512_mask_storeu_ps(rest.as_mut_ptr(), mask, v) };
        vmax = _mm512_mask_max_ps(vmax, mask, v, vmax);
    }
    let mut max = f32::NEG_INFINITY;
    for &m in lanes16(vmax).iter() {
        if m > max {
            max = m;
        }
    }
    if max == 0.0 {
        // Which zero is the first maximum depends on the order: the in-order scan decides.
        max = f32::NEG_INFINITY;
        for &v in x.iter() {
            if v > max {
                max = v;
            }
        }
    }
    let mut sum = 0.0f64;
    let vmax = _mm512_set1_ps(max);
    for c in x[..main].chunks_exact_mut(16) {
        let e = v_expf_512(_mm512_sub_ps(load16(c), vmax));
        store16(c, e);
        sum += f64::from(reduce_add_zmm(e));
    }
    let rest = &mut x[main..];
    if tail > 0 {
        // SAFETY: the mask covers the `tail` floats of `rest` only.
        let v = unsafe { _mm512_mask_loadu_ps(ninf, mask, rest.as_ptr()) };
        // Lanes past the row stand for ggml's masked (-inf) entries: exactly zero.
        let e = _mm512_maskz_mov_ps(mask, v_expf_512(_mm512_sub_ps(v, vmax)));
        // SAFETY: as above.
        unsafe { _mm512_mask_storeu_ps(rest.as_mut_ptr(), mask, e) };
        sum += f64::from(reduce_add_zmm(e));
    }
    let inv = (1.0 / sum) as f32;
    let vinv = _mm512_set1_ps(inv);
    for c in x[..main].chunks_exact_mut(16) {
        store16(c, _mm512_mul_ps(load16(c), vinv));
    }
    let rest = &mut x[main..];
    if tail > 0 {
        let zero = _mm512_setzero_ps();
        // SAFETY: the mask covers the `tail` floats of `rest` only.
        let v = _mm512_mul_ps(unsafe { _mm512_mask_loadu_ps(zero, mask, rest.as_ptr()) }, vinv);
        // SAFETY: as above.
        unsafe { _mm512_mask_storeu_ps(rest.as_mut_ptr(), mask, v) };
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_swiglu_512(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = g.len().min(u.len()).min(out.len());
    let main = n - n % 16;
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < main {
        let x = load16(&g[i..i + 16]);
        let silu =
            _mm512_div_ps(x, _mm512_add_ps(one, v_expf_512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        store16(&mut out[i..i + 16], _mm512_mul_ps(silu, load16(&u[i..i + 16])));
        i += 16;
    }
    for j in main..n {
        out[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-at-a-time form of [`imp_softmax_512`] (its previous body): the twin the
    /// vectorized scan and normalization are checked against, bit for bit.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
    fn softmax_512_twin(x: &mut [f32], scale: f32) {
        let mut max = f32::NEG_INFINITY;
        for v in x.iter_mut() {
            *v *= scale;
            if *v > max {
                max = *v;
            }
        }
        let mut sum = 0.0f64;
        let vmax = _mm512_set1_ps(max);
        for chunk in x.chunks_mut(16) {
            let mut buf = [f32::NEG_INFINITY; 16];
            buf[..chunk.len()].copy_from_slice(chunk);
            let mut e = lanes16(v_expf_512(_mm512_sub_ps(load16(&buf), vmax)));
            e[chunk.len()..].fill(0.0);
            chunk.copy_from_slice(&e[..chunk.len()]);
            sum += f64::from(Reduce::Zmm.apply(&e));
        }
        let inv = (1.0 / sum) as f32;
        for v in x.iter_mut() {
            *v *= inv;
        }
    }

    #[test]
    fn softmax_512_equals_its_row_at_a_time_twin_bit_for_bit() {
        if !SimdLevel::Avx512.is_supported() {
            return;
        }
        let mut seed = 7u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / 16777216.0 - 0.5
        };
        for n in (1..=70).chain([95, 96, 97, 200, 257, 512]) {
            for (spread, scale) in [(1.0f32, 0.125f32), (30.0, 1.0), (1e3, 0.7), (1.0, -2.0)] {
                for case in 0..4 {
                    let x: Vec<f32> = (0..n)
                        .map(|i| match case {
                            // Masked entries; zeros of both signs as the maximum.
                            1 if i % 5 == 2 => f32::NEG_INFINITY,
                            2 => [0.0, -0.0, -1.0][i % 3],
                            3 if i % 7 == 0 => -0.0,
                            3 => -rnd().abs() * spread,
                            _ => rnd() * spread,
                        })
                        .collect();
                    let (mut a, mut b) = (x.clone(), x.clone());
                    // SAFETY: AVX-512 checked above.
                    unsafe { imp_softmax_512(&mut a, scale) };
                    // SAFETY: as above.
                    unsafe { softmax_512_twin(&mut b, scale) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "n={n} spread={spread} scale={scale} case {case}"
                    );
                }
            }
        }
    }

    fn halves(n: usize, seed: u32) -> Vec<f16> {
        (0..n)
            .map(|i| {
                f16::from_f32(
                    (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0,
                )
            })
            .collect()
    }

    #[test]
    fn simd_dots_equal_their_shape_emulation_bit_for_bit() {
        for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
            let Some(k) = Kernels::for_level(level) else { continue };
            let s = shapes(level);
            for n in [8usize, 16, 48, 64, 96, 128, 200, 256] {
                let (x, y) = (halves(n, 1), halves(n, 7));
                assert_eq!(
                    (k.dot_f16)(&x, &y).to_bits(),
                    s.decode.dot(&x, &y).to_bits(),
                    "{level} decode n={n}"
                );
                let want = if n % s.prefill.step() == 0 {
                    s.prefill.dot(&x, &y)
                } else {
                    s.decode.dot(&x, &y)
                };
                assert_eq!(
                    (k.dot_f16_gemm)(&x, &y).to_bits(),
                    want.to_bits(),
                    "{level} gemm n={n}"
                );
            }
        }
    }

    #[test]
    fn vector_exp_is_accurate() {
        for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
            let Some(k) = Kernels::for_level(level) else { continue };
            let mut x: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) / 7.0).collect();
            let want: Vec<f64> = {
                let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                // The kernel subtracts the max in f32, so the reference does too.
                let e: Vec<f64> = x.iter().map(|&v| f64::from(v - m).exp()).collect();
                let s: f64 = e.iter().sum();
                e.iter().map(|v| v / s).collect()
            };
            (k.softmax)(&mut x, 1.0);
            for (a, b) in x.iter().zip(&want) {
                assert!((f64::from(*a) - b).abs() <= 1e-6 * b + 1e-30, "{level}: {a} vs {b}");
            }
        }
    }
}

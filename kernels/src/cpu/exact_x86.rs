//! x86 SIMD implementations of the ggml-exact kernels (see [`super::exact`]).
//!
//! # Safety
//! Each `imp_*` function requires the CPU features of its `target_feature` attribute. They
//! are reachable only through the safe wrappers installed by [`patch_avx2`] and
//! [`patch_avx512`], which [`super::Kernels::for_level`] calls only for a table whose level
//! was detected on this CPU (AVX-512 implies the AVX2 features here). Loads and stores use
//! unaligned intrinsics on pointers derived from slices with checked lengths.

use std::arch::x86_64::*;

use half::f16;

use super::Kernels;
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};
use super::exact::Reduce;
#[cfg(test)]
use super::exact::shapes;
use super::SimdLevel;

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
wrapper!("avx2", quantize_q8_0_avx2 => imp_quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]));
wrapper!("avx2", quantize_q8_1_avx2 => imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]));
wrapper!("avx2", dot_q4_0_q8_0_avx2 => imp_dot_q4_0_q8_0_avx2(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
wrapper!("avx2", dot_q4_1_q8_1_avx2 => imp_dot_q4_1_q8_1_avx2(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
wrapper!("avx2", dot_q8_0_q8_0_avx2 => imp_dot_q8_0_q8_0_avx2(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);
wrapper!("vnni", dot_q4_0_q8_0_vnni => imp_dot_q4_0_q8_0_vnni(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
wrapper!("vnni", dot_q4_1_q8_1_vnni => imp_dot_q4_1_q8_1_vnni(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
wrapper!("vnni", dot_q8_0_q8_0_vnni => imp_dot_q8_0_q8_0_vnni(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);
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
    k.quantize_q8_0 = quantize_q8_0_avx2;
    k.quantize_q8_1 = quantize_q8_1_avx2;
    k.dot_q4_0_q8_0 = dot_q4_0_q8_0_avx2;
    k.dot_q4_1_q8_1 = dot_q4_1_q8_1_avx2;
    k.dot_q8_0_q8_0 = dot_q8_0_q8_0_avx2;
}

pub(crate) fn patch_avx512(k: &mut Kernels) {
    debug_assert_eq!(k.level, SimdLevel::Avx512);
    k.dot_f16 = dot_f16_decode_512;
    k.dot_f16_gemm = dot_f16_gemm_512;
    k.softmax = softmax_512;
    k.swiglu = swiglu_512;
    k.axpy_f16 = fma_f16_avx2;
    k.quantize_q8_0 = quantize_q8_0_avx2;
    k.quantize_q8_1 = quantize_q8_1_avx2;
    k.dot_q4_0_q8_0 = dot_q4_0_q8_0_vnni;
    k.dot_q4_1_q8_1 = dot_q4_1_q8_1_vnni;
    k.dot_q8_0_q8_0 = dot_q8_0_q8_0_vnni;
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
    if n % 8 != 0 {
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
            _mm256_fmadd_ps(_mm256_set1_ps(f32_bits(0x3c07_2010)), b, _mm256_set1_ps(f32_bits(0x3d2b_9f17))),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(f32_bits(0x3e2a_af33)), b, _mm256_set1_ps(f32_bits(0x3eff_fedb))),
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
                _mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
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
        let e = lanes8(v_expf_avx2(_mm256_sub_ps(v, vmax)));
        let mut e = e;
        // Lanes past the row stand for ggml's masked (-inf) entries: exactly zero.
        for l in chunk.len()..8 {
            e[l] = 0.0;
        }
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
        // SAFETY: i + 8 <= main <= every slice's length.
        unsafe {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let silu = _mm256_div_ps(x, _mm256_add_ps(one, v_expf_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
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
        // SAFETY: i + 8 <= n.
        unsafe {
            let p = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(p)));
        }
        i += 8;
    }
    for j in i..n {
        y[j] = a.mul_add(x[j].to_f32(), y[j]);
    }
}

// Quantized dot products: ggml's x86 `vec_dot_*` keep 8 f32 lanes, each fed by the integer
// sum of 4 consecutive byte products of a block (`maddubs`+`madd`, or `vpdpbusd` when ggml
// is built with AVX-512 VNNI: the same integers), scaled and accumulated with one FMA per
// block, then reduced with `hsum_float_8` (the movehl tree).

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn nibbles32(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes.
    let tmp = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp), _mm256_set1_epi8(0x0f))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bytes32(qs: &[i8; 32]) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn us8_avx2(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1)))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
fn us8_vnni(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum8(v: __m256) -> f32 {
    Reduce::YmmMovehl.apply(&lanes8(v))
}

macro_rules! qdots {
    ($feat:literal, $us8:ident, $q40:ident, $q41:ident, $q80:ident) => {
        #[target_feature(enable = $feat)]
        fn $q40(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            for (x, y) in x.iter().zip(y) {
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = _mm256_sub_epi8(nibbles32(&x.qs), _mm256_set1_epi8(8));
                let qy = bytes32(&y.qs);
                let q = $us8(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
                acc = _mm256_fmadd_ps(d, q, acc);
            }
            hsum8(acc)
        }

        #[target_feature(enable = $feat)]
        fn $q41(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0.0f32;
            for (x, y) in x.iter().zip(y) {
                // ggml's C `summs += m * s` is contracted to an FMA by GCC.
                summs = x.m.to_f32().mul_add(y.s.to_f32(), summs);
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                acc = _mm256_fmadd_ps(d, $us8(nibbles32(&x.qs), bytes32(&y.qs)), acc);
            }
            hsum8(acc) + summs
        }

        #[target_feature(enable = $feat)]
        fn $q80(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            for (x, y) in x.iter().zip(y) {
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let (qx, qy) = (bytes32(&x.qs), bytes32(&y.qs));
                let q = $us8(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
                acc = _mm256_fmadd_ps(d, q, acc);
            }
            hsum8(acc)
        }
    };
}

qdots!("avx2,fma,f16c", us8_avx2, imp_dot_q4_0_q8_0_avx2, imp_dot_q4_1_q8_1_avx2, imp_dot_q8_0_q8_0_avx2);
qdots!(
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    us8_vnni,
    imp_dot_q4_0_q8_0_vnni,
    imp_dot_q4_1_q8_1_vnni,
    imp_dot_q8_0_q8_0_vnni
);

/// ggml's AVX2 block quantizer: (d, 32 quants, sum of quants); `id = 127 / amax`,
/// round half to even.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quantize32(x: &[f32]) -> (f32, __m256i, i32) {
    debug_assert!(x.len() >= 32);
    // SAFETY: callers pass chunks of exactly 32 floats.
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
    let s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<0b01>(s2)));
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    let q = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    (d, q, sum)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let (d, q, _) = quantize32(x);
        b.d = f16::from_f32(d);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let (d, q, sum) = quantize32(x);
        b.d = f16::from_f32(d);
        b.s = f16::from_f32(d * sum as f32);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

// ---------------------------------------------------------------------------------------
// AVX-512 (ggml built with -march=native on an AVX-512 CPU)

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
#[inline]
fn load_h16(x: &[f16]) -> __m512 {
    debug_assert!(x.len() >= 16);
    // SAFETY: at least 16 halves are readable (callers step within bounds).
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(x.as_ptr().cast()) })
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
    if n % 16 != 0 {
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
            _mm512_fmadd_ps(_mm512_set1_ps(f32_bits(0x3c07_2010)), b, _mm512_set1_ps(f32_bits(0x3d2b_9f17))),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(f32_bits(0x3e2a_af33)), b, _mm512_set1_ps(f32_bits(0x3eff_fedb))),
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

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_softmax_512(x: &mut [f32], scale: f32) {
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
        // SAFETY: `buf` holds 16 floats.
        let v = unsafe { _mm512_loadu_ps(buf.as_ptr()) };
        let mut e = lanes16(v_expf_512(_mm512_sub_ps(v, vmax)));
        // Lanes past the row stand for ggml's masked (-inf) entries: exactly zero.
        for l in chunk.len()..16 {
            e[l] = 0.0;
        }
        chunk.copy_from_slice(&e[..chunk.len()]);
        sum += f64::from(Reduce::Zmm.apply(&e));
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512dq,avx512bw,avx512vl")]
fn imp_swiglu_512(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = g.len().min(u.len()).min(out.len());
    let main = n - n % 16;
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < main {
        // SAFETY: i + 16 <= main <= every slice's length.
        unsafe {
            let x = _mm512_loadu_ps(g.as_ptr().add(i));
            let silu = _mm512_div_ps(x, _mm512_add_ps(one, v_expf_512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(silu, _mm512_loadu_ps(u.as_ptr().add(i))));
        }
        i += 16;
    }
    for j in main..n {
        out[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn halves(n: usize, seed: u32) -> Vec<f16> {
        (0..n).map(|i| f16::from_f32(((i as u32 * 2654435761 ^ seed) % 2001) as f32 / 1000.0 - 1.0)).collect()
    }

    #[test]
    fn simd_dots_equal_their_shape_emulation_bit_for_bit() {
        for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
            let Some(k) = Kernels::for_level(level) else { continue };
            let s = shapes(level);
            for n in [8usize, 16, 48, 64, 96, 128, 200, 256] {
                let (x, y) = (halves(n, 1), halves(n, 7));
                assert_eq!((k.dot_f16)(&x, &y).to_bits(), s.decode.dot(&x, &y).to_bits(), "{level} decode n={n}");
                let want = if n % s.prefill.step() == 0 { s.prefill.dot(&x, &y) } else { s.decode.dot(&x, &y) };
                assert_eq!((k.dot_f16_gemm)(&x, &y).to_bits(), want.to_bits(), "{level} gemm n={n}");
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
                let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) - f64::from(m)).exp()).collect();
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

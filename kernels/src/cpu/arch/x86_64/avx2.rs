//! AVX2 + FMA + F16C kernels.
//!
//! # Safety
//! Every `imp_*` function requires the `avx2`, `fma` and `f16c` CPU features. They are only
//! reachable through the safe wrappers in [`kernels`]'s table, and that table is only built
//! by [`crate::cpu::Kernels::for_level`] after [`crate::cpu::SimdLevel::Avx2`] was detected.
//! Loads and stores go through pointers derived from fixed-size arrays (block fields or
//! `as_chunks` pieces) or from slices whose lengths are checked right before, so no access
//! leaves its slice.
//!
//! Numerics follow ggml's x86 code: integer sums inside a block, one f32 fused multiply-add
//! per block and lane, a horizontal sum at the end. The quantizers and conversions are
//! bit-identical to the scalar reference; dot products, norms and softmax differ from it
//! only in the order of f32 additions (and `exp`, see [`exp_f32x8`]).

use std::arch::x86_64::*;

use half::f16;

use crate::cpu::{Kernels, SimdLevel};
use crate::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use crate::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};

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
safe_wrapper!(quantize_q8_k => imp_quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]));
safe_wrapper!(dot_q4_0_q8_0 => imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_1_q8_1 => imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
safe_wrapper!(dot_q8_0_q8_0 => imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_k_q8_k => imp_dot_q4_k_q8_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32);
safe_wrapper!(dot_q6_k_q8_k => imp_dot_q6_k_q8_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32);
safe_wrapper!(dot_f16 => imp_dot_f16(x: &[f16], y: &[f16]) -> f32);
safe_wrapper!(dot_bf16 => imp_dot_bf16(x: &[u16], y: &[u16]) -> f32);
safe_wrapper!(dot_f32 => imp_dot_f32(x: &[f32], y: &[f32]) -> f32);
safe_wrapper!(f32_to_f16 => imp_f32_to_f16(x: &[f32], out: &mut [f16]));
safe_wrapper!(f32_to_bf16 => imp_f32_to_bf16(x: &[f32], out: &mut [u16]));
safe_wrapper!(f16_to_f32 => imp_f16_to_f32(x: &[f16], out: &mut [f32]));
safe_wrapper!(axpy_f16 => imp_axpy_f16(a: f32, x: &[f16], y: &mut [f32]));
safe_wrapper!(rmsnorm => imp_rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]));
safe_wrapper!(softmax => imp_softmax(x: &mut [f32], scale: f32));
safe_wrapper!(swiglu => imp_swiglu(gate: &[f32], up: &[f32], out: &mut [f32]));
safe_wrapper!(rope_norm => imp_rope_norm(x: &mut [f32], cache: &[f32], n_dims: usize));
safe_wrapper!(rope_neox => imp_rope_neox(x: &mut [f32], cache: &[f32], n_dims: usize));

/// The scalar rope with its fused multiply-adds as instructions (the same bits; without the
/// `fma` feature each one is a library call).
#[target_feature(enable = "avx2,fma,f16c")]
fn imp_rope_norm(x: &mut [f32], cache: &[f32], n_dims: usize) {
    crate::cpu::rope::rope_norm_inline(x, cache, n_dims);
}

/// NeoX rope, as [`imp_rope_norm`].
#[target_feature(enable = "avx2,fma,f16c")]
fn imp_rope_neox(x: &mut [f32], cache: &[f32], n_dims: usize) {
    crate::cpu::rope::rope_neox_inline(x, cache, n_dims);
}

/// The AVX2 table. Only [`crate::cpu::Kernels::for_level`] (and the AVX-512 table, which
/// implies AVX2) may call this.
pub(crate) fn kernels() -> Kernels {
    Kernels {
        level: SimdLevel::Avx2,
        quantize_q8_0,
        quantize_q8_1,
        quantize_q8_k,
        dot_q4_0_q8_0,
        dot_q4_1_q8_1,
        dot_q8_0_q8_0,
        dot_q4_k_q8_k,
        dot_q6_k_q8_k,
        dot_f16,
        dot_f16_gemm: dot_f16,
        attn: crate::cpu::exact::shapes(SimdLevel::Avx2),
        dot_bf16,
        dot_f32,
        f32_to_f16,
        f32_to_bf16,
        f16_to_f32,
        axpy_f16,
        rmsnorm,
        rmsnorm_rows: crate::cpu::reference::rmsnorm_rows,
        softmax,
        swiglu,
        rope_norm,
        rope_neox,
        attn_head: None,
        attn_free: None,
        attn_free_tile: None,
        gemm: crate::cpu::gemm::Gemm::NONE,
        lanes: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Loads, stores and horizontal reductions.
// ---------------------------------------------------------------------------------------------

/// An f16 converted and broadcast to 8 lanes. Converting from a broadcast writes whole
/// registers: a scalar conversion lets the compiler merge into a register's stale upper
/// lanes, a false dependency that chains every block of a dot product to the previous one.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn f16_x8(h: f16) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(h.to_bits() as i16))
}

/// `a * b` of two f16 scales, in all 8 lanes: ggml's per-block `d` of a dot product.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn scale_product_x8(a: f16, b: f16) -> __m256 {
    _mm256_mul_ps(f16_x8(a), f16_x8(b))
}

/// Two adjacent f16 block fields (`[d, m]`, `[d, s]`, `[d, dmin]`) as f32 lanes 0 and 1.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn f16_pair(a: f16, b: f16) -> __m128 {
    let bits = u32::from(a.to_bits()) | (u32::from(b.to_bits()) << 16);
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// Iterates `x` and `y` pairwise up to the shorter length, by index (cheaper than `zip`
/// in these kernels, where it compiled to out-of-line length checks).
#[inline]
pub(crate) fn pairs<'a, A, B>(x: &'a [A], y: &'a [B]) -> impl Iterator<Item = (&'a A, &'a B)> {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &y[..n]);
    (0..n).map(move |i| (&x[i], &y[i]))
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

/// Horizontal sum of 4 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum_f32x4(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sum of 4 doubles.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum_f64x4(v: __m256d) -> f64 {
    let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
    _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)))
}

/// Horizontal maximum of 8 floats (NaN-free input).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax_f32x8(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
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
    let tmp = load_u8x16(qs);
    let bytes = _mm256_set_m128i(_mm_srli_epi16::<4>(tmp), tmp);
    _mm256_and_si256(bytes, _mm256_set1_epi8(0x0f))
}

/// Loads 16 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_u8x16(a: &[u8; 16]) -> __m128i {
    // SAFETY: `a` is 16 readable bytes.
    unsafe { _mm_loadu_si128(a.as_ptr().cast()) }
}

/// Loads 16 signed bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_i8x16(a: &[i8; 16]) -> __m128i {
    // SAFETY: `a` is 16 readable bytes.
    unsafe { _mm_loadu_si128(a.as_ptr().cast()) }
}

/// Loads 32 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_u8x32(a: &[u8; 32]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// Loads 32 signed bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_i8x32(qs: &[i8; 32]) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

/// Loads 16 i16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn load_i16x16(a: &[i16; 16]) -> __m256i {
    // SAFETY: `a` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// Loads 8 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f32x8(a: &[f32; 8]) -> __m256 {
    // SAFETY: `a` is 8 readable floats.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

/// Stores 8 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store_f32x8(a: &mut [f32; 8], v: __m256) {
    // SAFETY: `a` is 8 writable floats.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) }
}

/// Loads 8 halves as floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f16x8(a: &[f16; 8]) -> __m256 {
    // SAFETY: `a` is 16 readable bytes; f16 is a transparent u16.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(a.as_ptr().cast()) })
}

/// Loads 8 bf16 bit patterns as floats (exact: a bf16 is the top half of an f32).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_bf16x8(a: &[u16; 8]) -> __m256 {
    // SAFETY: `a` is 16 readable bytes.
    let h = unsafe { _mm_loadu_si128(a.as_ptr().cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

// ---------------------------------------------------------------------------------------------
// Activation quantizers.
// ---------------------------------------------------------------------------------------------

/// Quantizes 32 floats to signed bytes with ggml's scheme; returns (d, bytes, sum of quants),
/// or `None` when `127 / amax` overflows (a block of subnormals), which the caller leaves to
/// the scalar codec so that even that case stays bit-identical.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quantize_block_32(x: &[f32; 32]) -> Option<(f32, __m256i, i32)> {
    let (v, _) = x.as_chunks::<8>();
    let (v0, v1, v2, v3) =
        (load_f32x8(&v[0]), load_f32x8(&v[1]), load_f32x8(&v[2]), load_f32x8(&v[3]));
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_andnot_ps(sign, v0);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v1));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v2));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v3));
    let amax = hmax_f32x8(m);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    if !id.is_finite() {
        return None;
    }
    let mul = _mm256_set1_ps(id);
    let i0 = round_to_i32(_mm256_mul_ps(v0, mul));
    let i1 = round_to_i32(_mm256_mul_ps(v1, mul));
    let i2 = round_to_i32(_mm256_mul_ps(v2, mul));
    let i3 = round_to_i32(_mm256_mul_ps(v3, mul));
    let sum = hsum_i32x8(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    Some((d, pack_i32x32_to_i8(i0, i1, i2, i3), sum))
}

/// Rounds half to even (ggml's `nearest_int`, and what the scalar codecs do) and converts.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn round_to_i32(v: __m256) -> __m256i {
    const R: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_cvtps_epi32(_mm256_round_ps::<R>(v))
}

/// Packs 4 × 8 i32 (each in -128..=127) into 32 bytes in order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn pack_i32x32_to_i8(i0: __m256i, i1: __m256i, i2: __m256i, i3: __m256i) -> __m256i {
    // The packs work per 128-bit lane; the permute puts the 4-byte groups back in order.
    let a = _mm256_packs_epi32(i0, i1);
    let b = _mm256_packs_epi32(i2, i3);
    let packed = _mm256_packs_epi16(a, b);
    _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    let (xs, _) = x.as_chunks::<32>();
    for (b, x) in out.iter_mut().zip(xs) {
        let Some((d, q, _)) = quantize_block_32(x) else {
            quant::quantize_q8_0(x, std::slice::from_mut(b));
            continue;
        };
        b.d = f16::from_f32(d);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn imp_quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    let (xs, _) = x.as_chunks::<32>();
    for (b, x) in out.iter_mut().zip(xs) {
        let Some((d, q, sum)) = quantize_block_32(x) else {
            quant::quantize_q8_1(x, std::slice::from_mut(b));
            continue;
        };
        b.d = f16::from_f32(d);
        b.s = f16::from_f32(d * sum as f32);
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), q) };
    }
}

/// Sums of the 8 i32 lanes of each of 8 vectors: lane `g` of the result is `sum(v[g])`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn transpose_hsum_i32x8(v: &[__m256i; 8]) -> __m256i {
    // hadd pairs lanes within each 128-bit half; after three rounds lane g of each half holds
    // that half's sum for vector g (in the order 0..4 / 4..8 across the two results).
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    let lo = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
    let hi = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
    _mm256_add_epi32(lo, hi)
}

/// f32 to `Q8_K`, bit-identical to [`quant_k::quantize_q8_k`].
#[target_feature(enable = "avx2,fma,f16c")]
fn imp_quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    let (xs, _) = x.as_chunks::<{ QK_K }>();
    let sign = _mm256_set1_ps(-0.0);
    for (b, x) in out.iter_mut().zip(xs) {
        let (v, _) = x.as_chunks::<8>();
        let mut m = _mm256_setzero_ps();
        for v in v {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load_f32x8(v)));
        }
        let amax = hmax_f32x8(m);
        if amax == 0.0 {
            b.d = 0.0;
            b.qs = [0; QK_K];
            b.bsums = [0; 16];
            continue;
        }
        // The signed value of the first element of largest magnitude, as the scalar scan
        // finds it (the sign decides which end of the range maps to -127).
        let am = _mm256_set1_ps(amax);
        let mut max = amax;
        for v in v {
            let abs = _mm256_andnot_ps(sign, load_f32x8(v));
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs, am));
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
        let mul = _mm256_set1_ps(iscale);
        let top = _mm256_set1_epi32(127);
        let (qs, _) = b.qs.as_chunks_mut::<32>();
        // parts[g]: 8 lanes adding up to the sum of group g (16 quants).
        let mut parts = [_mm256_setzero_si256(); 16];
        for ((q, v), parts) in qs.iter_mut().zip(v.chunks_exact(4)).zip(parts.chunks_exact_mut(2)) {
            let i: [__m256i; 4] = std::array::from_fn(|k| {
                _mm256_min_epi32(round_to_i32(_mm256_mul_ps(load_f32x8(&v[k]), mul)), top)
            });
            let packed = pack_i32x32_to_i8(i[0], i[1], i[2], i[3]);
            // SAFETY: `q` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), packed) };
            parts[0] = _mm256_add_epi32(i[0], i[1]);
            parts[1] = _mm256_add_epi32(i[2], i[3]);
        }
        let (p, _) = parts.as_chunks::<8>();
        let lo = transpose_hsum_i32x8(&p[0]);
        let hi = transpose_hsum_i32x8(&p[1]);
        // Sums are within ±16·127, so the saturating pack is exact.
        let bs = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(lo, hi));
        // SAFETY: `b.bsums` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.bsums.as_mut_ptr().cast(), bs) };
        b.d = 1.0 / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized dot products.
// ---------------------------------------------------------------------------------------------

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

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in pairs(x, y) {
        let d = scale_product_x8(x.d, y.d);
        let qx = _mm256_sub_epi8(nibbles_32(&x.qs), _mm256_set1_epi8(8));
        let q = mul_sum_i8_pairs_float(qx, load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    // The sum of m * s, in lane 0 (the other lanes are never read).
    let mut summs = _mm_setzero_ps();
    for (x, y) in pairs(x, y) {
        // [d_x * d_y, m * s]
        let p = _mm_mul_ps(f16_pair(x.d, x.m), f16_pair(y.d, y.s));
        summs = _mm_add_ss(summs, _mm_movehdup_ps(p));
        let d = _mm256_broadcastss_ps(p);
        let q = mul_sum_us8_pairs_float(nibbles_32(&x.qs), load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc) + _mm_cvtss_f32(summs)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in pairs(x, y) {
        let d = scale_product_x8(x.d, y.d);
        let q = mul_sum_i8_pairs_float(load_i8x32(&x.qs), load_i8x32(&y.qs));
        acc = _mm256_fmadd_ps(d, q, acc);
    }
    hsum_f32x8(acc)
}

/// A byte-shuffle mask that repeats 16-bit word `k` of a 128-bit lane in every word.
#[inline]
pub(crate) const fn word_splat_mask(k: usize) -> i16 {
    (((2 * k + 1) << 8) | (2 * k)) as i16
}

/// A `Q4_K` block's `y.d * d` (8 lanes) and `-y.d * dmin` (4 lanes), as ggml forms them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q4k_scales(x: &BlockQ4K, y: &BlockQ8K) -> (__m256, __m128) {
    let p = _mm_mul_ps(f16_pair(x.d, x.dmin), _mm_set1_ps(y.d));
    let d = _mm256_broadcastss_ps(p);
    let dmin = _mm_xor_ps(_mm_movehdup_ps(p), _mm_set1_ps(-0.0));
    (d, _mm_shuffle_ps::<0>(dmin, dmin))
}

/// The block's mins · the activations' per-sub-block sums, as 4 i32 lanes to be added up:
/// `sum_j min_j * (bsums[2j] + bsums[2j + 1])`. `mins` holds the 8 mins as i16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q4k_mins_dot_bsums(mins: __m128i, bsums: &[i16; 16]) -> __m128i {
    let bs = load_i16x16(bsums);
    let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
    _mm_madd_epi16(mins, pairs)
}

#[target_feature(enable = "avx2,fma,f16c")]
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
            let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, load_i8x32(&q8[0])));
            let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, load_i8x32(&q8[1])));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_f32x8(acc) + hsum_f32x4(acc_m)
}

/// The 6-bit quants (0..64, unsigned) of one 128-element half of a `Q6_K` block, as four
/// vectors of 32 elements in element order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q6k_half(ql: &[[u8; 32]], qh: &[u8; 32]) -> [__m256i; 4] {
    let m15 = _mm256_set1_epi8(15);
    let (b1, b2, bh) = (load_u8x32(&ql[0]), load_u8x32(&ql[1]), load_u8x32(qh));
    // The two high bits of element l + 32k sit at bits 2k..2k+2 of qh[l]; move them to 4..6.
    let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(bh, _mm256_set1_epi8(0x03)));
    let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(0x0c)));
    let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(0x30));
    let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(0xc0u8 as i8)));
    [
        _mm256_or_si256(_mm256_and_si256(b1, m15), h0),
        _mm256_or_si256(_mm256_and_si256(b2, m15), h1),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b1), m15), h2),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b2), m15), h3),
    ]
}

/// A byte-shuffle mask selecting scale `g` eight times, then scale `g + 1` eight times.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q6k_scale_pick(g: usize) -> __m128i {
    const REP: u64 = 0x0101_0101_0101_0101;
    _mm_set_epi64x((REP * (g as u64 + 1)) as i64, (REP * g as u64) as i64)
}

/// `32 * sum_g scale_g * bsum_g` as 8 i32 lanes to be added up: the correction for storing
/// `Q6_K` quants with a +32 offset.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn q6k_offset_correction(scales16: __m256i, bsums: &[i16; 16]) -> __m256i {
    _mm256_slli_epi32::<5>(_mm256_madd_epi16(load_i16x16(bsums), scales16))
}

#[target_feature(enable = "avx2,fma,f16c")]
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
            let q6 = q6k_half(&ql[2 * h..2 * h + 2], &qh[h]);
            for (k, q6) in q6.into_iter().enumerate() {
                // 32 elements = groups g and g + 1 of 16, each with its own scale.
                let sc = _mm_shuffle_epi8(scales, q6k_scale_pick(8 * h + 2 * k));
                let sc = _mm256_cvtepi8_epi16(sc);
                let p = _mm256_maddubs_epi16(q6, load_i8x32(&q8[4 * h + k]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
            }
        }
        sumi = _mm256_sub_epi32(sumi, correction);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_f32x8(acc)
}

// ---------------------------------------------------------------------------------------------
// Float dot products and conversions.
// ---------------------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let (xc, _) = x[..n].as_chunks::<32>();
    let (yc, _) = y[..n].as_chunks::<32>();
    let mut acc = [_mm256_setzero_ps(); 4];
    for (xc, yc) in xc.iter().zip(yc) {
        let (xs, _) = xc.as_chunks::<8>();
        let (ys, _) = yc.as_chunks::<8>();
        for (a, (xv, yv)) in acc.iter_mut().zip(xs.iter().zip(ys)) {
            *a = _mm256_fmadd_ps(load_f16x8(xv), load_f16x8(yv), *a);
        }
    }
    let mut i = xc.len() * 32;
    let (xs, _) = x[i..n].as_chunks::<8>();
    let (ys, _) = y[i..n].as_chunks::<8>();
    for (xv, yv) in xs.iter().zip(ys) {
        acc[0] = _mm256_fmadd_ps(load_f16x8(xv), load_f16x8(yv), acc[0]);
    }
    i += xs.len() * 8;
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum_f32x8(v);
    for (a, b) in x[i..n].iter().zip(&y[i..n]) {
        sum += a.to_f32() * b.to_f32();
    }
    sum
}

/// bf16 · bf16 shaped like ggml's AVX2 `vec_dot_bf16`: four accumulators over 32-element
/// steps, combined as `(a0 + a2) + (a1 + a3)`, reduced, and the remaining elements'
/// products added in f64.
#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_bf16(x: &[u16], y: &[u16]) -> f32 {
    let n = x.len().min(y.len());
    let (xc, xt) = x[..n].as_chunks::<32>();
    let (yc, yt) = y[..n].as_chunks::<32>();
    let mut acc = [_mm256_setzero_ps(); 4];
    for (xc, yc) in xc.iter().zip(yc) {
        let (xs, _) = xc.as_chunks::<8>();
        let (ys, _) = yc.as_chunks::<8>();
        for (a, (xv, yv)) in acc.iter_mut().zip(xs.iter().zip(ys)) {
            *a = _mm256_fmadd_ps(load_bf16x8(xv), load_bf16x8(yv), *a);
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let mut sum = f64::from(hsum_f32x8(v));
    for (&a, &b) in xt.iter().zip(yt) {
        sum += f64::from(quant_k::bf16_to_f32(a) * quant_k::bf16_to_f32(b));
    }
    sum as f32
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let (xc, _) = x[..n].as_chunks::<32>();
    let (yc, _) = y[..n].as_chunks::<32>();
    let mut acc = [_mm256_setzero_ps(); 4];
    for (xc, yc) in xc.iter().zip(yc) {
        let (xs, _) = xc.as_chunks::<8>();
        let (ys, _) = yc.as_chunks::<8>();
        for (a, (xv, yv)) in acc.iter_mut().zip(xs.iter().zip(ys)) {
            *a = _mm256_fmadd_ps(load_f32x8(xv), load_f32x8(yv), *a);
        }
    }
    let i = xc.len() * 32;
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum_f32x8(v);
    for (a, b) in x[i..n].iter().zip(&y[i..n]) {
        sum += a * b;
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_f32_to_f16(x: &[f32], out: &mut [f16]) {
    let n = x.len().min(out.len());
    let (xs, _) = x[..n].as_chunks::<8>();
    let (os, _) = out[..n].as_chunks_mut::<8>();
    for (xv, o) in xs.iter().zip(os.iter_mut()) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(load_f32x8(xv));
        // SAFETY: `o` is 16 writable bytes; f16 is a transparent u16.
        unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), h) };
    }
    let i = xs.len() * 8;
    for (o, &v) in out[i..n].iter_mut().zip(&x[i..n]) {
        *o = f16::from_f32(v);
    }
}

/// Rounds 8 floats to bf16 bit patterns (nearest even; NaN stays a quiet NaN), in the low
/// 16 bits of each i32 lane — [`quant_k::f32_to_bf16`] on every lane.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f32x8_to_bf16_lanes(v: __m256) -> __m256i {
    let u = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(u), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        u,
        _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
    ));
    let abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fff_ffff));
    let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(u), _mm256_set1_epi32(64));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_f32_to_bf16(x: &[f32], out: &mut [u16]) {
    let n = x.len().min(out.len());
    let (xs, _) = x[..n].as_chunks::<16>();
    let (os, _) = out[..n].as_chunks_mut::<16>();
    for (xv, o) in xs.iter().zip(os.iter_mut()) {
        let (xv, _) = xv.as_chunks::<8>();
        let a = f32x8_to_bf16_lanes(load_f32x8(&xv[0]));
        let b = f32x8_to_bf16_lanes(load_f32x8(&xv[1]));
        // Lanes hold 0..=0xffff, so the unsigned saturating pack is exact; it interleaves
        // the 128-bit halves, which the 64-bit permute undoes.
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
        // SAFETY: `o` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), packed) };
    }
    let i = xs.len() * 16;
    for (o, &v) in out[i..n].iter_mut().zip(&x[i..n]) {
        *o = quant_k::f32_to_bf16(v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_f16_to_f32(x: &[f16], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let (xs, _) = x[..n].as_chunks::<8>();
    let (os, _) = out[..n].as_chunks_mut::<8>();
    for (xv, o) in xs.iter().zip(os.iter_mut()) {
        store_f32x8(o, load_f16x8(xv));
    }
    let i = xs.len() * 8;
    for (o, v) in out[i..n].iter_mut().zip(&x[i..n]) {
        *o = v.to_f32();
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(a);
    let (xs, _) = x[..n].as_chunks::<8>();
    let (ys, _) = y[..n].as_chunks_mut::<8>();
    for (xv, yv) in xs.iter().zip(ys.iter_mut()) {
        let r = _mm256_fmadd_ps(av, load_f16x8(xv), load_f32x8(yv));
        store_f32x8(yv, r);
    }
    let i = xs.len() * 8;
    for (y, x) in y[i..n].iter_mut().zip(&x[i..n]) {
        *y += a * x.to_f32();
    }
}

// ---------------------------------------------------------------------------------------------
// exp, and the element-wise ops built on it.
// ---------------------------------------------------------------------------------------------

/// Constants of the exp approximation (see [`exp_f32x8`]).
pub(crate) mod expc {
    /// 1.5 · 2^23: adding it rounds a float below 2^22 to an integer in the low mantissa bits.
    pub const SHIFTER: f32 = f32::from_bits(0x4b40_0000);
    /// log2(e).
    pub const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
    /// ln(2) split in a high part (exact in a product with a small integer) and a low part.
    pub const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    /// See [`LN2_HI`].
    pub const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    /// Minimax coefficients of e^b - 1 on |b| <= ln(2)/2, degree 1..=5.
    pub const C1: f32 = f32::from_bits(0x3f7f_fff6);
    /// See [`C1`].
    pub const C2: f32 = f32::from_bits(0x3eff_fedb);
    /// See [`C1`].
    pub const C3: f32 = f32::from_bits(0x3e2a_af33);
    /// See [`C1`].
    pub const C4: f32 = f32::from_bits(0x3d2b_9f17);
    /// See [`C1`].
    pub const C5: f32 = f32::from_bits(0x3c07_2010);
}

/// e^x on 8 lanes, within about 1.5 ulp of the true value (the algorithm ggml uses, from
/// Arm's optimized-routines): x = n·ln2 + b with integer n and |b| <= ln2/2, then
/// e^x = 2^n · (1 + p(b)) with a degree-5 polynomial p. Overflows to +inf above ~88.7,
/// underflows through the subnormals to 0 below ~-103.9; NaN stays NaN.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn exp_f32x8(x: __m256) -> __m256 {
    use expc::*;
    let set = _mm256_set1_ps;
    let shifter = set(SHIFTER);
    let z = _mm256_fmadd_ps(x, set(LOG2E), shifter);
    let n = _mm256_sub_ps(z, shifter);
    let b = _mm256_fnmadd_ps(n, set(LN2_LO), _mm256_fnmadd_ps(n, set(LN2_HI), x));
    // n sits in the low mantissa bits of z; shifting it into the exponent field and adding
    // the bits of 1.0 gives 2^n when n is a normal exponent.
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(set(1.0))));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(set(C5), b, set(C4)),
            u,
            _mm256_fmadd_ps(set(C3), b, set(C2)),
        ),
        u,
        _mm256_mul_ps(set(C1), b),
    );
    let abs_n = _mm256_andnot_ps(set(-0.0), n);
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, set(126.0));
    if _mm256_movemask_ps(big) == 0 {
        return _mm256_fmadd_ps(k, j, k);
    }
    // |n| > 126: 2^n is not a normal float. Split it as s1 · s2 with s1 = 2^127 (n > 0) or
    // 2^-125 (n <= 0) so both factors are normal; beyond |n| > 192 the result is s1², which
    // is +inf or 0.
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let huge = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, set(192.0));
    let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    let normal = _mm256_fmadd_ps(k, j, k);
    let r = _mm256_blendv_ps(normal, scaled, big);
    _mm256_blendv_ps(r, _mm256_mul_ps(s1, s1), huge)
}

/// silu(x) = x / (1 + e^-x) on 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn silu_f32x8(x: __m256) -> __m256 {
    let e = exp_f32x8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
}

/// Adds 8 floats to two f64x4 accumulators (exactly: every f32 is an f64).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn add_f32x8_to_f64(acc: &mut [__m256d; 2], v: __m256) {
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)));
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len().min(w.len()).min(out.len());
    let x = &x[..n];
    // Squares in f32 (as the reference), summed in f64 lanes.
    let (xs, xt) = x.as_chunks::<8>();
    let mut acc = [_mm256_setzero_pd(); 2];
    for v in xs {
        let v = load_f32x8(v);
        add_f32x8_to_f64(&mut acc, _mm256_mul_ps(v, v));
    }
    let mut sum = hsum_f64x4(_mm256_add_pd(acc[0], acc[1]));
    for &v in xt {
        sum += f64::from(v * v);
    }
    let mean = (sum / n as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    let sv = _mm256_set1_ps(scale);
    let (ws, _) = w[..n].as_chunks::<8>();
    let (os, _) = out[..n].as_chunks_mut::<8>();
    for ((xv, wv), o) in xs.iter().zip(ws).zip(os.iter_mut()) {
        store_f32x8(o, _mm256_mul_ps(_mm256_mul_ps(load_f32x8(xv), sv), load_f32x8(wv)));
    }
    let i = xs.len() * 8;
    for ((o, &v), &w) in out[i..n].iter_mut().zip(&x[i..]).zip(&w[i..n]) {
        *o = (v * scale) * w;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_softmax(x: &mut [f32], scale: f32) {
    let sv = _mm256_set1_ps(scale);
    let (xs, xt) = x.as_chunks_mut::<8>();
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    for v in xs.iter_mut() {
        let s = _mm256_mul_ps(load_f32x8(v), sv);
        store_f32x8(v, s);
        mv = _mm256_max_ps(mv, s);
    }
    let mut max = hmax_f32x8(mv);
    for v in xt.iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let maxv = _mm256_set1_ps(max);
    let mut acc = [_mm256_setzero_pd(); 2];
    for v in xs.iter_mut() {
        let e = exp_f32x8(_mm256_sub_ps(load_f32x8(v), maxv));
        store_f32x8(v, e);
        add_f32x8_to_f64(&mut acc, e);
    }
    if !xt.is_empty() {
        // The tail goes through the same exp, padded with -inf (whose exp is 0).
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..xt.len()].copy_from_slice(xt);
        let e = exp_f32x8(_mm256_sub_ps(load_f32x8(&buf), maxv));
        store_f32x8(&mut buf, e);
        add_f32x8_to_f64(&mut acc, e);
        xt.copy_from_slice(&buf[..xt.len()]);
    }
    let sum = hsum_f64x4(_mm256_add_pd(acc[0], acc[1]));
    let inv = (1.0 / sum) as f32;
    let iv = _mm256_set1_ps(inv);
    for v in xs.iter_mut() {
        store_f32x8(v, _mm256_mul_ps(load_f32x8(v), iv));
    }
    for v in xt.iter_mut() {
        *v *= inv;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn imp_swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = gate.len().min(up.len()).min(out.len());
    let (gs, gt) = gate[..n].as_chunks::<8>();
    let (us, ut) = up[..n].as_chunks::<8>();
    let (os, ot) = out[..n].as_chunks_mut::<8>();
    for ((g, u), o) in gs.iter().zip(us).zip(os.iter_mut()) {
        store_f32x8(o, _mm256_mul_ps(silu_f32x8(load_f32x8(g)), load_f32x8(u)));
    }
    if !gt.is_empty() {
        let (mut g, mut u) = ([0.0f32; 8], [0.0f32; 8]);
        g[..gt.len()].copy_from_slice(gt);
        u[..ut.len()].copy_from_slice(ut);
        let mut o = [0.0f32; 8];
        store_f32x8(&mut o, _mm256_mul_ps(silu_f32x8(load_f32x8(&g)), load_f32x8(&u)));
        ot.copy_from_slice(&o[..ot.len()]);
    }
}

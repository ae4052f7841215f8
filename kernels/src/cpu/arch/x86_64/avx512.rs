//! AVX-512 (F/BW/DQ/VL) + VNNI kernels: integer dot products with `vpdpbusd`.
//!
//! # Safety
//! Every `imp_*` function requires the features listed in its `target_feature` attribute.
//! They are only reachable through safe wrappers stored in the table built by [`kernels`],
//! which [`crate::cpu::Kernels::for_level`] calls only after
//! [`crate::cpu::SimdLevel::Avx512`] (which implies AVX2) was detected.

use std::arch::x86_64::*;

use super::avx2::{hsum_f32x8, load_i8x32, nibbles_32};
use crate::cpu::{Kernels, SimdLevel};
use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

macro_rules! safe_wrapper {
    ($name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: this wrapper is only stored in the AVX-512 table, which is built only
            // after the AVX-512 and VNNI features were detected (see the module docs).
            unsafe { $imp($($arg),*) }
        }
    };
}

safe_wrapper!(dot_q4_0_q8_0 => imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32);
safe_wrapper!(dot_q4_1_q8_1 => imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32);
safe_wrapper!(dot_q8_0_q8_0 => imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32);

/// The AVX-512 table: the AVX2 table with the VNNI kernels swapped in.
pub(crate) fn kernels() -> Kernels {
    Kernels {
        level: SimdLevel::Avx512,
        dot_q4_0_q8_0,
        dot_q4_1_q8_1,
        dot_q8_0_q8_0,
        ..super::avx2::kernels()
    }
}

/// Sum of products of unsigned bytes `ax` with signed bytes `sy`, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn dot_us8(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy))
}

/// Sum of products of signed bytes, as 8 f32 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn dot_i8(x: __m256i, y: __m256i) -> __m256 {
    dot_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn imp_dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        let qx = _mm256_sub_epi8(nibbles_32(&x.qs), _mm256_set1_epi8(8));
        acc = _mm256_fmadd_ps(d, dot_i8(qx, load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn imp_dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        summs += x.m.to_f32() * y.s.to_f32();
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        acc = _mm256_fmadd_ps(d, dot_us8(nibbles_32(&x.qs), load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc) + summs
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn imp_dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (x, y) in x.iter().zip(y) {
        let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
        acc = _mm256_fmadd_ps(d, dot_i8(load_i8x32(&x.qs), load_i8x32(&y.qs)), acc);
    }
    hsum_f32x8(acc)
}

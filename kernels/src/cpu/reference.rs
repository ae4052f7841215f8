//! Scalar reference kernels: the portable path on every CPU and the oracle that every SIMD
//! kernel is tested against. Written for clarity, following ggml's arithmetic (integer sums
//! inside a block, f32 scale products) so results track llama.cpp.

use half::f16;

use super::{Kernels, SimdLevel};
use crate::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};
use crate::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};

/// The scalar kernel table.
pub const KERNELS: Kernels = Kernels {
    level: SimdLevel::Scalar,
    quantize_q8_0: quant::quantize_q8_0,
    quantize_q8_1: quant::quantize_q8_1,
    quantize_q8_k: quant_k::quantize_q8_k,
    dot_q4_0_q8_0,
    dot_q4_1_q8_1,
    dot_q8_0_q8_0,
    dot_q4_k_q8_k,
    dot_q6_k_q8_k,
    dot_f16,
    dot_f16_gemm: dot_f16,
    attn: super::exact::AttnShapes {
        decode: super::exact::SumShape::SeqF64,
        prefill: super::exact::SumShape::SeqF64,
    },
    dot_bf16,
    dot_f32,
    f32_to_f16,
    f32_to_bf16,
    f16_to_f32,
    axpy_f16,
    rmsnorm,
    rmsnorm_rows,
    softmax,
    swiglu,
    rope_norm: super::rope::rope_norm,
    rope_neox: super::rope::rope_neox,
    attn_head: None,
    attn_free: None,
    attn_free_tile: None,
    gemm: super::gemm::Gemm::NONE,
    lanes: None,
};

fn isum(a: impl Iterator<Item = i32>) -> i32 {
    a.sum()
}

/// `Q4_0` · `Q8_0`.
pub fn dot_q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let s = isum((0..16).map(|j| {
            (i32::from(x.qs[j] & 0x0f) - 8) * i32::from(y.qs[j])
                + (i32::from(x.qs[j] >> 4) - 8) * i32::from(y.qs[j + 16])
        }));
        sum += s as f32 * x.d.to_f32() * y.d.to_f32();
    }
    sum
}

/// `Q4_1` · `Q8_1`.
pub fn dot_q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let s = isum((0..16).map(|j| {
            i32::from(x.qs[j] & 0x0f) * i32::from(y.qs[j])
                + i32::from(x.qs[j] >> 4) * i32::from(y.qs[j + 16])
        }));
        sum += x.d.to_f32() * y.d.to_f32() * s as f32 + x.m.to_f32() * y.s.to_f32();
    }
    sum
}

/// `Q8_0` · `Q8_0`.
pub fn dot_q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let s = isum(x.qs.iter().zip(&y.qs).map(|(&a, &b)| i32::from(a) * i32::from(b)));
        sum += s as f32 * (x.d.to_f32() * y.d.to_f32());
    }
    sum
}

/// `Q4_K` · `Q8_K`.
pub fn dot_q4_k_q8_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let mut sumi = 0i32;
        let mut mins = 0i32;
        for chunk in 0..4 {
            let q4 = &x.qs[32 * chunk..32 * chunk + 32];
            for (half, shift) in [(0usize, 0u8), (1, 4)] {
                let sub = 2 * chunk + half;
                let (sc, m) = quant_k::scale_min_k4(sub, &x.scales);
                let q8 = &y.qs[32 * sub..32 * sub + 32];
                let s = isum(
                    q4.iter().zip(q8).map(|(&a, &b)| i32::from((a >> shift) & 0x0f) * i32::from(b)),
                );
                sumi += i32::from(sc) * s;
                mins +=
                    i32::from(m) * (i32::from(y.bsums[2 * sub]) + i32::from(y.bsums[2 * sub + 1]));
            }
        }
        sum += x.d.to_f32() * y.d * sumi as f32 - x.dmin.to_f32() * y.d * mins as f32;
    }
    sum
}

/// `Q6_K` · `Q8_K`.
pub fn dot_q6_k_q8_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut sum = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        let q = quant_k::q6_k_values(x);
        let mut sumi = 0i32;
        for (j, (q6, q8)) in q.chunks_exact(16).zip(y.qs.chunks_exact(16)).enumerate() {
            let s = isum(q6.iter().zip(q8).map(|(&a, &b)| i32::from(a) * i32::from(b)));
            sumi += i32::from(x.scales[j]) * s;
        }
        sum += x.d.to_f32() * y.d * sumi as f32;
    }
    sum
}

/// f16 · f16 in f32.
pub fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a.to_f32() * b.to_f32()).sum()
}

/// bf16 · bf16 in f32.
pub fn dot_bf16(x: &[u16], y: &[u16]) -> f32 {
    x.iter().zip(y).map(|(&a, &b)| quant_k::bf16_to_f32(a) * quant_k::bf16_to_f32(b)).sum()
}

/// f32 · f32.
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

/// f32 → f16.
pub fn f32_to_f16(x: &[f32], out: &mut [f16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f16::from_f32(v);
    }
}

/// f32 → bf16.
pub fn f32_to_bf16(x: &[f32], out: &mut [u16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = quant_k::f32_to_bf16(v);
    }
}

/// f16 → f32.
pub fn f16_to_f32(x: &[f16], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.to_f32();
    }
}

/// `y = fma(a, x, y)`, one rounding per element.
pub fn axpy_f16(a: f32, x: &[f16], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x.to_f32(), *y);
    }
}

/// RMS norm times weight, as ggml computes it: sum of squares in f64, scale in f32.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    rms_scale(x, w, eps, sum, out);
}

/// `out = x · w / sqrt(sum / len + eps)`, the second half of [`rmsnorm`].
#[inline]
fn rms_scale(x: &[f32], w: &[f32], eps: f32, sum: f64, out: &mut [f32]) {
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * w;
    }
}

/// [`rmsnorm`] of each `w.len()`-long row of `x` into the same row of `out`, with the same
/// bits row by row: the sums of squares of eight rows advance together (each still in
/// order), so their f64 additions overlap instead of waiting on one another.
pub fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    const R: usize = 8;
    let d = w.len();
    if d == 0 {
        return;
    }
    let mut xs = x.chunks_exact(d * R);
    let mut os = out.chunks_exact_mut(d * R);
    for (xg, og) in (&mut xs).zip(&mut os) {
        let mut sum = [0.0f64; R];
        for i in 0..d {
            for (r, s) in sum.iter_mut().enumerate() {
                let v = xg[r * d + i];
                *s += f64::from(v * v);
            }
        }
        for ((xr, or), s) in xg.chunks_exact(d).zip(og.chunks_exact_mut(d)).zip(sum) {
            rms_scale(xr, w, eps, s, or);
        }
    }
    for (xr, or) in xs.remainder().chunks_exact(d).zip(os.into_remainder().chunks_exact_mut(d)) {
        rmsnorm(xr, w, eps, or);
    }
}

/// In-place softmax of `x * scale`, with the sum in f64 as ggml does.
pub fn softmax(x: &mut [f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    for v in x.iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `out = silu(gate) * up`, silu(x) = x / (1 + e^-x).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

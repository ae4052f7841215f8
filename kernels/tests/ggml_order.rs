//! The SIMD quantized dot products reproduce the floating-point association of ggml's x86
//! `vec_dot` kernels bit for bit (the AVX2 code in ggml-cpu's x86 `quants.c`, which ggml's
//! AVX-512 builds use too, with VNNI only in the exact integer part): 8 f32 lanes, one fused
//! multiply-add per block and lane with the block's integer lane sums, blocks in order, then
//! ggml's horizontal sum `(v0+v4 + v2+v6) + (v1+v5 + v3+v7)`.
//!
//! Each emulation below is written from that description in scalar code; the tables of every
//! SIMD level must give the same bits on random blocks.

mod common;

use common::*;
use half::f16;
use kvx_kernels::cpu::{Kernels, SimdLevel};
use kvx_kernels::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};
use kvx_kernels::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};

fn simd_levels() -> Vec<Kernels> {
    levels().into_iter().filter(|k| k.level != SimdLevel::Scalar).collect()
}

fn f(h: f16) -> f32 {
    h.to_f32()
}

/// ggml's `hsum_float_8`: high half plus low half, then `movehl` and `movehdup` adds.
fn hsum8(v: &[f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| v[i + 4] + v[i]);
    hsum4(&s)
}

/// The last two steps of [`hsum8`] on 4 lanes.
fn hsum4(s: &[f32; 4]) -> f32 {
    (s[0] + s[2]) + (s[1] + s[3])
}

/// The 8 i32 lanes of a 32-byte integer dot product: lane `l` sums bytes `4l..4l + 4`.
fn lanes(x: impl Fn(usize) -> i32, y: impl Fn(usize) -> i32) -> [i32; 8] {
    std::array::from_fn(|l| (4 * l..4 * l + 4).map(|b| x(b) * y(b)).sum())
}

/// One block's fused multiply-add into the 8 accumulator lanes.
fn accumulate(acc: &mut [f32; 8], d: f32, lanes: &[i32; 8]) {
    for (a, &s) in acc.iter_mut().zip(lanes) {
        *a = d.mul_add(s as f32, *a);
    }
}

/// Byte `b` of a 32-element nibble block: low nibbles are elements 0..16, high 16..32.
fn nibble(qs: &[u8; 16], b: usize) -> i32 {
    i32::from(if b < 16 { qs[b] & 15 } else { qs[b - 16] >> 4 })
}

fn ggml_q4_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in x.iter().zip(y) {
        let l = lanes(|b| nibble(&x.qs, b) - 8, |b| i32::from(y.qs[b]));
        accumulate(&mut acc, f(x.d) * f(y.d), &l);
    }
    hsum8(&acc)
}

fn ggml_q4_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (x, y) in x.iter().zip(y) {
        summs += f(x.m) * f(y.s);
        let l = lanes(|b| nibble(&x.qs, b), |b| i32::from(y.qs[b]));
        accumulate(&mut acc, f(x.d) * f(y.d), &l);
    }
    hsum8(&acc) + summs
}

fn ggml_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in x.iter().zip(y) {
        let l = lanes(|b| i32::from(x.qs[b]), |b| i32::from(y.qs[b]));
        accumulate(&mut acc, f(x.d) * f(y.d), &l);
    }
    hsum8(&acc)
}

fn ggml_q4_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    for (x, y) in x.iter().zip(y) {
        let d = y.d * f(x.d);
        let dmin = -y.d * f(x.dmin);
        let sm = quant_k::unpack_scales_mins_k4(&x.scales);
        // Mins times pair sums of the activations' group sums, in 4 lanes of 2 sub-blocks.
        let q8s: [i32; 8] =
            std::array::from_fn(|j| i32::from(y.bsums[2 * j]) + i32::from(y.bsums[2 * j + 1]));
        for (i, a) in acc_m.iter_mut().enumerate() {
            let prod =
                i32::from(sm[8 + 2 * i]) * q8s[2 * i] + i32::from(sm[9 + 2 * i]) * q8s[2 * i + 1];
            *a = dmin.mul_add(prod as f32, *a);
        }
        // Chunk c: low nibbles against activations 64c.., high nibbles against 64c + 32..,
        // each scaled by its sub-block's scale, lanes summed over the 4 chunks.
        let mut sumi = [0i32; 8];
        for c in 0..4 {
            let q = &x.qs[32 * c..32 * c + 32];
            let lo = lanes(|b| i32::from(q[b] & 15), |b| i32::from(y.qs[64 * c + b]));
            let hi = lanes(|b| i32::from(q[b] >> 4), |b| i32::from(y.qs[64 * c + 32 + b]));
            for l in 0..8 {
                sumi[l] += i32::from(sm[2 * c]) * lo[l] + i32::from(sm[2 * c + 1]) * hi[l];
            }
        }
        accumulate(&mut acc, d, &sumi);
    }
    hsum8(&acc) + hsum4(&acc_m)
}

fn ggml_q6_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in x.iter().zip(y) {
        let d = y.d * f(x.d);
        // Quants stored with a +32 offset; the offset comes back out through the group sums.
        let u: Vec<i32> = quant_k::q6_k_values(x).iter().map(|&q| i32::from(q) + 32).collect();
        let sc = |g: usize| i32::from(x.scales[g]);
        let mut sumi = [0i32; 8];
        for v in 0..8 {
            // 32 elements: i32 lanes 0..4 are group 2v, lanes 4..8 group 2v + 1.
            let base = 32 * v;
            let l = lanes(|b| u[base + b], |b| i32::from(y.qs[base + b]));
            for (lane, (s, p)) in sumi.iter_mut().zip(l).enumerate() {
                *s += sc(2 * v + lane / 4) * p;
            }
        }
        for (l, s) in sumi.iter_mut().enumerate() {
            let corr = i32::from(y.bsums[2 * l]) * sc(2 * l)
                + i32::from(y.bsums[2 * l + 1]) * sc(2 * l + 1);
            *s -= 32 * corr;
        }
        accumulate(&mut acc, d, &sumi);
    }
    hsum8(&acc)
}

fn assert_bits(got: f32, want: f32, what: &str, level: SimdLevel) {
    assert_eq!(
        got.to_bits(),
        want.to_bits(),
        "{what} at {level}: {got} vs ggml's association {want}"
    );
}

#[test]
fn block_dots_follow_ggml_association_bit_for_bit() {
    let mut rng = rng(51);
    for k in simd_levels() {
        for nb in [1usize, 2, 5, 18, 48, 49] {
            for zero_every in [0usize, 4] {
                let what = |t: &str| format!("{t} nb={nb}");
                let y0 = rand_q8_0(&mut rng, nb, zero_every);
                let x = rand_q4_0(&mut rng, nb, zero_every);
                assert_bits((k.dot_q4_0_q8_0)(&x, &y0), ggml_q4_0(&x, &y0), &what("q4_0"), k.level);
                let x = rand_q8_0(&mut rng, nb, zero_every);
                assert_bits((k.dot_q8_0_q8_0)(&x, &y0), ggml_q8_0(&x, &y0), &what("q8_0"), k.level);
                let y1 = rand_q8_1(&mut rng, nb, zero_every);
                let x = rand_q4_1(&mut rng, nb, zero_every);
                assert_bits((k.dot_q4_1_q8_1)(&x, &y1), ggml_q4_1(&x, &y1), &what("q4_1"), k.level);
            }
        }
    }
}

#[test]
fn k_quant_dots_follow_ggml_association_bit_for_bit() {
    let mut rng = rng(52);
    for k in simd_levels() {
        for nb in [1usize, 2, 3, 6, 7] {
            for zero_every in [0usize, 3] {
                let what = |t: &str| format!("{t} nb={nb}");
                let y = rand_q8k(&mut rng, nb, zero_every);
                let x = rand_q4k(&mut rng, nb, zero_every);
                assert_bits((k.dot_q4_k_q8_k)(&x, &y), ggml_q4_k(&x, &y), &what("q4_k"), k.level);
                let x = rand_q6k(&mut rng, nb, zero_every);
                assert_bits((k.dot_q6_k_q8_k)(&x, &y), ggml_q6_k(&x, &y), &what("q6_k"), k.level);
            }
        }
    }
}

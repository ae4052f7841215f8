//! Shared helpers of the kernel integration tests: the kernel tables to test, random inputs
//! and random (valid) quantized blocks.

#![allow(dead_code)]

use bytemuck::Zeroable;
use half::f16;
use kvx_kernels::cpu::{Kernels, SimdLevel};
use kvx_kernels::gguf::GgmlType;
use kvx_kernels::ops::{self, QMatrix};
use kvx_kernels::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K, cast_blocks};
use kvx_kernels::quant_k;
use kvx_kernels::quant_k::{BlockQ4K, BlockQ6K, BlockQ8K};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The kernel table of every level this CPU supports, scalar first. Fails if the detected
/// level is missing, so a broken detection cannot quietly reduce the tests to scalar only.
pub fn levels() -> Vec<Kernels> {
    let ks: Vec<Kernels> = SimdLevel::ALL.iter().filter_map(|&l| Kernels::for_level(l)).collect();
    assert_eq!(ks[0].level, SimdLevel::Scalar);
    assert!(ks.iter().any(|k| k.level == SimdLevel::detect()));
    ks
}

/// A seeded generator, one per test so tests do not depend on each other's draws.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Activation-like values: mostly in ±2, some exact zeros, some outliers up to ±40.
pub fn randv(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 37 {
            0 => 0.0,
            1 => rng.random_range(-40.0f32..40.0),
            _ => rng.random_range(-2.0f32..2.0),
        })
        .collect()
}

/// Values of magnitude around `scale`, random sign.
pub fn rand_scaled(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0) * scale).collect()
}

/// A positive f16 scale of magnitude `lo..hi`.
pub fn rand_d(rng: &mut StdRng, lo: f32, hi: f32) -> f16 {
    f16::from_f32(rng.random_range(lo..hi))
}

/// A signed quant in -127..=127 (the range every ggml quantizer produces).
pub fn rand_q8(rng: &mut StdRng) -> i8 {
    rng.random_range(-127i8..=127)
}

/// Random `Q4_0` blocks (every nibble pattern), `zero_every`-th block all zero.
pub fn rand_q4_0(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ4_0> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ4_0::zeroed();
            }
            BlockQ4_0 { d: rand_d(rng, 1e-3, 0.5), qs: rng.random() }
        })
        .collect()
}

/// Random `Q4_1` blocks with signed minimums.
pub fn rand_q4_1(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ4_1> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ4_1::zeroed();
            }
            BlockQ4_1 {
                d: rand_d(rng, 1e-3, 0.5),
                m: f16::from_f32(rng.random_range(-2.0f32..2.0)),
                qs: rng.random(),
            }
        })
        .collect()
}

/// Random `Q8_0` blocks.
pub fn rand_q8_0(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ8_0> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ8_0::zeroed();
            }
            BlockQ8_0 { d: rand_d(rng, 1e-3, 0.5), qs: std::array::from_fn(|_| rand_q8(rng)) }
        })
        .collect()
}

/// Random `Q8_1` blocks with a consistent `s = d * sum(qs)`.
pub fn rand_q8_1(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ8_1> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ8_1::zeroed();
            }
            let d = rand_d(rng, 1e-3, 0.5);
            let qs: [i8; 32] = std::array::from_fn(|_| rand_q8(rng));
            let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
            BlockQ8_1 { d, s: f16::from_f32(d.to_f32() * sum as f32), qs }
        })
        .collect()
}

/// Random `Q4_K` blocks: every scale/min bit pattern and nibble.
pub fn rand_q4k(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ4K> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ4K::zeroed();
            }
            BlockQ4K {
                d: rand_d(rng, 1e-4, 0.05),
                dmin: rand_d(rng, 1e-4, 0.05),
                scales: rng.random(),
                qs: std::array::from_fn(|_| rng.random()),
            }
        })
        .collect()
}

/// Random `Q6_K` blocks: every quant and signed scale.
pub fn rand_q6k(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ6K> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ6K::zeroed();
            }
            BlockQ6K {
                ql: std::array::from_fn(|_| rng.random()),
                qh: std::array::from_fn(|_| rng.random()),
                scales: rng.random(),
                d: rand_d(rng, 1e-4, 0.05),
            }
        })
        .collect()
}

/// Random `Q8_K` blocks with consistent group sums (as the quantizer writes them).
pub fn rand_q8k(rng: &mut StdRng, nb: usize, zero_every: usize) -> Vec<BlockQ8K> {
    (0..nb)
        .map(|i| {
            if zero_every > 0 && i % zero_every == zero_every - 1 {
                return BlockQ8K::zeroed();
            }
            let qs: [i8; QK_K] = std::array::from_fn(|_| rand_q8(rng));
            let mut bsums = [0i16; 16];
            for (s, g) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
                *s = g.iter().map(|&q| i16::from(q)).sum();
            }
            BlockQ8K { d: rng.random_range(1e-3f32..0.1), qs, bsums }
        })
        .collect()
}

/// Bytes in a `u32` buffer, so they are aligned for every block type.
pub struct Aligned {
    words: Vec<u32>,
    len: usize,
}

impl Aligned {
    pub fn from_pod<T: bytemuck::Pod>(v: &[T]) -> Aligned {
        let raw: &[u8] = bytemuck::cast_slice(v);
        let mut words = vec![0u32; raw.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..raw.len()].copy_from_slice(raw);
        Aligned { words, len: raw.len() }
    }

    pub fn zeroed(len: usize) -> Aligned {
        Aligned { words: vec![0; len.div_ceil(4)], len }
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// Random weights of `ty`: every quant pattern (including `-128` in `Q8_0`), negative and
/// zero scales, all-zero blocks.
pub fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Aligned {
    let n = rows * cols;
    match ty {
        GgmlType::Q4_0 => {
            let mut b = rand_q4_0(rng, n / 32, 7);
            for (i, b) in b.iter_mut().enumerate().filter(|(i, _)| i % 5 == 1) {
                b.d = -b.d * f16::from_f32(i as f32 % 3.0);
            }
            Aligned::from_pod(&b)
        }
        GgmlType::Q4_1 => Aligned::from_pod(&rand_q4_1(rng, n / 32, 7)),
        GgmlType::Q8_0 => {
            let mut b = rand_q8_0(rng, n / 32, 7);
            for (i, b) in b.iter_mut().enumerate() {
                if i % 3 == 0 {
                    b.qs[i % 32] = -128;
                    b.qs[(i + 5) % 32] = -128;
                }
                if i % 4 == 1 {
                    b.d = -b.d;
                }
            }
            Aligned::from_pod(&b)
        }
        GgmlType::Q4_K => Aligned::from_pod(&rand_q4k(rng, n / QK_K, 5)),
        GgmlType::Q6_K => Aligned::from_pod(&rand_q6k(rng, n / QK_K, 5)),
        GgmlType::F16 => {
            Aligned::from_pod(&randv(rng, n).into_iter().map(f16::from_f32).collect::<Vec<_>>())
        }
        GgmlType::BF16 => Aligned::from_pod(
            &randv(rng, n).into_iter().map(quant_k::f32_to_bf16).collect::<Vec<_>>(),
        ),
        _ => Aligned::from_pod(&randv(rng, n)),
    }
}

/// `n_tok` activation rows quantized for `m`, some of them all zero, some with outliers.
pub fn activations(rng: &mut StdRng, k: &Kernels, m: &QMatrix<'_>, n_tok: usize) -> Aligned {
    let cols = m.cols();
    let mut x = randv(rng, n_tok * cols);
    for (t, row) in x.chunks_exact_mut(cols).enumerate() {
        match t % 11 {
            3 => row.fill(0.0),
            7 => row.iter_mut().for_each(|v| *v *= 1e3),
            _ => {}
        }
    }
    let mut act = Aligned::zeroed(ops::activation_bytes(m.act_ty(), cols, n_tok).unwrap());
    ops::quantize_activations(k, m.act_ty(), &x, cols, act.bytes_mut()).unwrap();
    act
}

/// The level's dot product of weight row `w` and activation row `a` (raw bytes of `ty` and
/// its activation type).
pub fn dot(k: &Kernels, ty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
    fn c<B: bytemuck::Pod>(b: &[u8]) -> &[B] {
        cast_blocks(b).unwrap()
    }
    match ty {
        GgmlType::Q4_0 => (k.dot_q4_0_q8_0)(c::<BlockQ4_0>(w), c::<BlockQ8_0>(a)),
        GgmlType::Q4_1 => (k.dot_q4_1_q8_1)(c::<BlockQ4_1>(w), c::<BlockQ8_1>(a)),
        GgmlType::Q8_0 => (k.dot_q8_0_q8_0)(c::<BlockQ8_0>(w), c::<BlockQ8_0>(a)),
        GgmlType::Q4_K => (k.dot_q4_k_q8_k)(c::<BlockQ4K>(w), c::<BlockQ8K>(a)),
        GgmlType::Q6_K => (k.dot_q6_k_q8_k)(c::<BlockQ6K>(w), c::<BlockQ8K>(a)),
        GgmlType::F16 => (k.dot_f16)(c::<f16>(w), c::<f16>(a)),
        GgmlType::BF16 => (k.dot_bf16)(c::<u16>(w), c::<u16>(a)),
        _ => (k.dot_f32)(c::<f32>(w), c::<f32>(a)),
    }
}

//! Parity of every kernel table (each SIMD level this CPU supports) with the scalar
//! reference twins, on random inputs and edge cases.
//!
//! Quantizers and conversions must be bit-identical to the reference. Dot products are
//! checked against the exact (f64) value of the same quantized data, within the worst-case
//! f32 rounding of the kernel's summation order, and element-wise ops against the reference
//! within a few ulps (their `exp` differs from libm's by up to ~2 ulp).

mod common;

use bytemuck::Zeroable;
use common::*;
use half::f16;
use kvx_kernels::cpu::{Kernels, SimdLevel, reference};
use kvx_kernels::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use kvx_kernels::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};
use rand::Rng;

const EPS: f64 = f32::EPSILON as f64;

/// Every slot of the table, named: adding a slot without adding it here fails to compile,
/// which is the reminder to give it a parity test below.
#[test]
fn every_table_slot_has_a_parity_test() {
    for k in levels() {
        let Kernels {
            level: _,
            quantize_q8_0: _,  // activation_quantizers_*
            quantize_q8_1: _,  // activation_quantizers_*
            quantize_q8_k: _,  // activation_quantizers_*, q8_k_*
            dot_q4_0_q8_0: _,  // quantized_dots_*
            dot_q4_1_q8_1: _,  // quantized_dots_*
            dot_q8_0_q8_0: _,  // quantized_dots_*
            dot_q4_k_q8_k: _,  // quantized_dots_*
            dot_q6_k_q8_k: _,  // quantized_dots_*
            dot_f16: _,        // float_dots_*
            dot_f16_gemm: _,   // float_dots_*
            attn: _,           // data (the association of the f16 dots), not a kernel
            dot_bf16: _,       // float_dots_*
            dot_f32: _,        // float_dots_*
            f32_to_f16: _,     // conversions_*
            f32_to_bf16: _,    // conversions_*
            f16_to_f32: _,     // conversions_*
            axpy_f16: _,       // axpy_*
            rmsnorm: _,        // rmsnorm_*
            rmsnorm_rows: _,   // rmsnorm_*
            softmax: _,        // softmax_*
            swiglu: _,         // swiglu_*, silu_*
            rope_norm: _,      // rope_*
            rope_neox: _,      // rope_*
            attn_head: _,      // tests/ops.rs fused_attention_*
            attn_free: _,      // tests/ops.rs free_attention_*
            attn_free_tile: _, // tests/ops.rs free_attention_tiles_*
            gemm: _,           // tests/matmul_exact.rs
            lanes: _,          // tests/matmul_lanes.rs
        } = k;
    }
}

// ---------------------------------------------------------------------------------------------
// Activation quantizers: bit-identical.
// ---------------------------------------------------------------------------------------------

fn check_q8_0(k: &Kernels, x: &[f32], what: &str) {
    let nb = x.len() / 32;
    let mut a = vec![BlockQ8_0::zeroed(); nb];
    let mut b = a.clone();
    (k.quantize_q8_0)(x, &mut a);
    quant::quantize_q8_0(x, &mut b);
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            (a.d.to_bits(), a.qs),
            (b.d.to_bits(), b.qs),
            "q8_0 {what} block {i} at {}",
            k.level
        );
    }
}

fn check_q8_1(k: &Kernels, x: &[f32], what: &str) {
    let nb = x.len() / 32;
    let mut a = vec![BlockQ8_1::zeroed(); nb];
    let mut b = a.clone();
    (k.quantize_q8_1)(x, &mut a);
    quant::quantize_q8_1(x, &mut b);
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            (a.d.to_bits(), a.s.to_bits(), a.qs),
            (b.d.to_bits(), b.s.to_bits(), b.qs),
            "q8_1 {what} block {i} at {}",
            k.level
        );
    }
}

fn check_q8_k(k: &Kernels, x: &[f32], what: &str) {
    let nb = x.len() / QK_K;
    // Start from garbage so a kernel that skips a field is caught.
    let junk = BlockQ8K { d: 7.0, qs: [5; QK_K], bsums: [9; 16] };
    let mut a = vec![junk; nb];
    let mut b = vec![BlockQ8K::zeroed(); nb];
    (k.quantize_q8_k)(x, &mut a);
    quant_k::quantize_q8_k(x, &mut b);
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            (a.d.to_bits(), a.qs, a.bsums),
            (b.d.to_bits(), b.qs, b.bsums),
            "q8_k {what} block {i} at {}",
            k.level
        );
    }
}

fn check_all_quantizers(k: &Kernels, x: &[f32], what: &str) {
    check_q8_0(k, &x[..x.len() / 32 * 32], what);
    check_q8_1(k, &x[..x.len() / 32 * 32], what);
    check_q8_k(k, &x[..x.len() / QK_K * QK_K], what);
}

#[test]
fn activation_quantizers_match_reference_exactly_on_random_rows() {
    let mut rng = rng(11);
    for k in levels() {
        for nb in [1usize, 2, 3, 5, 18, 48] {
            let x = randv(&mut rng, nb * QK_K);
            check_all_quantizers(&k, &x, &format!("random n={}", x.len()));
            for (scale, name) in
                [(1e-30f32, "tiny"), (1e-4, "small"), (3e4, "large"), (1e6, "huge")]
            {
                let x = rand_scaled(&mut rng, nb * QK_K, scale);
                check_all_quantizers(&k, &x, name);
            }
        }
    }
}

#[test]
fn activation_quantizers_match_reference_exactly_on_edge_cases() {
    let mut rng = rng(12);
    for k in levels() {
        // All zeros, and a zero block between non-zero ones.
        check_all_quantizers(&k, &vec![0.0; 2 * QK_K], "all zero");
        let mut x = randv(&mut rng, 3 * QK_K);
        x[QK_K..2 * QK_K].fill(0.0);
        x[32..64].fill(0.0);
        check_all_quantizers(&k, &x, "zero block");
        // -0.0 everywhere and a single non-zero value.
        let mut x = vec![-0.0f32; QK_K];
        check_all_quantizers(&k, &x, "negative zeros");
        x[77] = -3.0;
        check_all_quantizers(&k, &x, "one value");
        // Subnormals among tiny normal values (127 / amax stays finite).
        let x: Vec<f32> = (0..QK_K)
            .map(|i| match i % 5 {
                0 => 2e-36,
                1 => -f32::from_bits(1 + i as u32 * 997),
                _ => f32::from_bits(7 * i as u32),
            })
            .collect();
        check_all_quantizers(&k, &x, "subnormals");
        // A block of subnormals only, where 127 / amax overflows: the scalar codec saturates.
        // (ggml's AVX2 Q8_0/Q8_1 quantizer, which the ggml-exact tables reproduce, does not
        // handle this case, so only Q8_K is held to it.)
        let x: Vec<f32> = (0..QK_K)
            .map(|i| f32::from_bits(1 + i as u32 * 997) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        check_q8_k(&k, &x, "all subnormal");
        // The first element of largest magnitude decides the sign of the Q8_K scale.
        for (a, b) in [(5.0f32, -5.0f32), (-5.0, 5.0)] {
            let mut x = rand_scaled(&mut rng, QK_K, 1.0);
            x[10] = a;
            x[200] = b;
            check_all_quantizers(&k, &x, "tied extremes");
        }
    }
}

#[test]
fn activation_quantizers_round_ties_to_even() {
    // With amax = 127 (Q8_0/Q8_1) or a leading -127 (Q8_K) the scale is exactly 1, so every
    // k + 0.5 is a tie; the reference rounds half to even, as ggml's nearest_int does.
    let mut x: Vec<f32> = (0..QK_K).map(|i| ((i % 253) as f32 - 126.0) + 0.5).collect();
    for b in x.chunks_exact_mut(32) {
        b[0] = -127.0;
    }
    let mut want = BlockQ8K::zeroed();
    quant_k::quantize_q8_k(&x, std::slice::from_mut(&mut want));
    assert_eq!(want.d, 1.0);
    let ties = [
        (126, 0.5, 0),
        (127, 1.5, 2),
        (129, 3.5, 4),
        (125, -0.5, 0),
        (124, -1.5, -2),
        (123, -2.5, -2),
    ];
    for (i, v, q) in ties {
        assert_eq!((x[i], want.qs[i]), (v, q), "{v} rounds to {q}");
    }
    for k in levels() {
        check_all_quantizers(&k, &x, "ties");
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized dot products: against the exact value of the same quantized data.
// ---------------------------------------------------------------------------------------------

/// Exact value and magnitude (sum of the absolute values of every term the kernel adds,
/// per block and part) of a quantized dot product.
struct Exact {
    value: f64,
    magnitude: f64,
}

fn f(h: f16) -> f64 {
    f64::from(h.to_f32())
}

fn exact_q4_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> Exact {
    let (mut value, mut magnitude) = (0.0, 0.0);
    for (x, y) in x.iter().zip(y) {
        let (mut s, mut a) = (0i64, 0i64);
        for j in 0..16 {
            let (lo, hi) = (i64::from(x.qs[j] & 15) - 8, i64::from(x.qs[j] >> 4) - 8);
            let (ylo, yhi) = (i64::from(y.qs[j]), i64::from(y.qs[j + 16]));
            s += lo * ylo + hi * yhi;
            a += (lo * ylo).abs() + (hi * yhi).abs();
        }
        value += f(x.d) * f(y.d) * s as f64;
        magnitude += (f(x.d) * f(y.d)).abs() * a as f64;
    }
    Exact { value, magnitude }
}

fn exact_q4_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> Exact {
    let (mut value, mut magnitude) = (0.0, 0.0);
    for (x, y) in x.iter().zip(y) {
        let (mut s, mut a) = (0i64, 0i64);
        for j in 0..16 {
            let (lo, hi) = (i64::from(x.qs[j] & 15), i64::from(x.qs[j] >> 4));
            let (ylo, yhi) = (i64::from(y.qs[j]), i64::from(y.qs[j + 16]));
            s += lo * ylo + hi * yhi;
            a += (lo * ylo).abs() + (hi * yhi).abs();
        }
        value += f(x.d) * f(y.d) * s as f64 + f(x.m) * f(y.s);
        magnitude += (f(x.d) * f(y.d)).abs() * a as f64 + (f(x.m) * f(y.s)).abs();
    }
    Exact { value, magnitude }
}

fn exact_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> Exact {
    let (mut value, mut magnitude) = (0.0, 0.0);
    for (x, y) in x.iter().zip(y) {
        let s: i64 = x.qs.iter().zip(&y.qs).map(|(&a, &b)| i64::from(a) * i64::from(b)).sum();
        let a: i64 =
            x.qs.iter().zip(&y.qs).map(|(&a, &b)| (i64::from(a) * i64::from(b)).abs()).sum();
        value += f(x.d) * f(y.d) * s as f64;
        magnitude += (f(x.d) * f(y.d)).abs() * a as f64;
    }
    Exact { value, magnitude }
}

fn exact_q4_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> Exact {
    let (mut value, mut magnitude) = (0.0, 0.0);
    for (x, y) in x.iter().zip(y) {
        let (mut s, mut a, mut mins, mut amins) = (0i64, 0i64, 0i64, 0i64);
        for sub in 0..8 {
            let (sc, m) = quant_k::scale_min_k4(sub, &x.scales);
            let chunk = &x.qs[32 * (sub / 2)..32 * (sub / 2) + 32];
            for (l, &c) in chunk.iter().enumerate() {
                let q = i64::from(if sub % 2 == 0 { c & 15 } else { c >> 4 });
                let p = i64::from(sc) * q * i64::from(y.qs[32 * sub + l]);
                s += p;
                a += p.abs();
            }
            let bs = i64::from(y.bsums[2 * sub]) + i64::from(y.bsums[2 * sub + 1]);
            mins += i64::from(m) * bs;
            amins += (i64::from(m) * bs).abs();
        }
        let dy = f64::from(y.d);
        value += dy * (f(x.d) * s as f64 - f(x.dmin) * mins as f64);
        magnitude += dy.abs() * (f(x.d).abs() * a as f64 + f(x.dmin).abs() * amins as f64);
    }
    Exact { value, magnitude }
}

fn exact_q6_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> Exact {
    let (mut value, mut magnitude) = (0.0, 0.0);
    for (x, y) in x.iter().zip(y) {
        let q = quant_k::q6_k_values(x);
        let (mut s, mut a) = (0i64, 0i64);
        for (i, &qi) in q.iter().enumerate() {
            let (sc, q8) = (i64::from(x.scales[i / 16]), i64::from(y.qs[i]));
            s += sc * i64::from(qi) * q8;
            // The SIMD kernels (as ggml's) use the quants stored +32 and take the offset back
            // out through the group sums, in other lanes: up to 64 more steps per element.
            a += (sc * i64::from(qi) * q8).abs() + 64 * (sc * q8).abs();
        }
        value += f64::from(y.d) * f(x.d) * s as f64;
        magnitude += (f64::from(y.d) * f(x.d)).abs() * a as f64;
    }
    Exact { value, magnitude }
}

/// |got - exact| within the worst-case rounding of summing `terms` block terms in f32
/// (each term itself rounded a few times), plus one for every level's horizontal sums.
fn assert_dot(got: f32, e: &Exact, terms: usize, what: &str, level: SimdLevel) {
    let bound = (terms as f64 + 8.0) * 2.0 * EPS * e.magnitude + f64::from(f32::MIN_POSITIVE);
    let err = (f64::from(got) - e.value).abs();
    assert!(
        err <= bound,
        "{what} at {level}: got {got}, exact {}, error {err:e} > {bound:e}",
        e.value
    );
}

#[test]
fn quantized_dots_match_exact_value_on_random_blocks() {
    let mut rng = rng(21);
    for k in levels() {
        for nb in [1usize, 2, 3, 7, 18, 48, 49] {
            for zero_every in [0usize, 3] {
                let what = |t: &str| format!("{t} nb={nb} zero_every={zero_every}");
                let y0 = rand_q8_0(&mut rng, nb, zero_every);
                let x = rand_q4_0(&mut rng, nb, zero_every);
                assert_dot(
                    (k.dot_q4_0_q8_0)(&x, &y0),
                    &exact_q4_0(&x, &y0),
                    nb,
                    &what("q4_0"),
                    k.level,
                );
                let x = rand_q8_0(&mut rng, nb, zero_every);
                assert_dot(
                    (k.dot_q8_0_q8_0)(&x, &y0),
                    &exact_q8_0(&x, &y0),
                    nb,
                    &what("q8_0"),
                    k.level,
                );
                let y1 = rand_q8_1(&mut rng, nb, zero_every);
                let x = rand_q4_1(&mut rng, nb, zero_every);
                assert_dot(
                    (k.dot_q4_1_q8_1)(&x, &y1),
                    &exact_q4_1(&x, &y1),
                    nb,
                    &what("q4_1"),
                    k.level,
                );
            }
        }
        for nb in [1usize, 2, 3, 6, 7] {
            for zero_every in [0usize, 2] {
                let what = |t: &str| format!("{t} nb={nb} zero_every={zero_every}");
                let y = rand_q8k(&mut rng, nb, zero_every);
                let x = rand_q4k(&mut rng, nb, zero_every);
                assert_dot(
                    (k.dot_q4_k_q8_k)(&x, &y),
                    &exact_q4_k(&x, &y),
                    nb,
                    &what("q4_k"),
                    k.level,
                );
                let x = rand_q6k(&mut rng, nb, zero_every);
                assert_dot(
                    (k.dot_q6_k_q8_k)(&x, &y),
                    &exact_q6_k(&x, &y),
                    nb,
                    &what("q6_k"),
                    k.level,
                );
            }
        }
    }
}

#[test]
fn quantized_dots_match_exact_value_on_quantized_floats() {
    // Realistic blocks: weights from the weight quantizers, activations from the table's own
    // quantizer (bit-identical to the reference, checked above).
    let mut rng = rng(22);
    for k in levels() {
        for n in [QK_K, 1536, 3 * QK_K] {
            let w = randv(&mut rng, n);
            let x = randv(&mut rng, n);
            let nb = n / 32;
            let mut w40 = vec![BlockQ4_0::zeroed(); nb];
            quant::weights::quantize_q4_0(&w, &mut w40);
            let mut w41 = vec![BlockQ4_1::zeroed(); nb];
            quant::weights::quantize_q4_1(&w, &mut w41);
            let mut w80 = vec![BlockQ8_0::zeroed(); nb];
            quant::weights::quantize_q8_0(&w, &mut w80);
            let mut x80 = vec![BlockQ8_0::zeroed(); nb];
            (k.quantize_q8_0)(&x, &mut x80);
            let mut x81 = vec![BlockQ8_1::zeroed(); nb];
            (k.quantize_q8_1)(&x, &mut x81);
            assert_dot((k.dot_q4_0_q8_0)(&w40, &x80), &exact_q4_0(&w40, &x80), nb, "q4_0", k.level);
            assert_dot((k.dot_q4_1_q8_1)(&w41, &x81), &exact_q4_1(&w41, &x81), nb, "q4_1", k.level);
            assert_dot((k.dot_q8_0_q8_0)(&w80, &x80), &exact_q8_0(&w80, &x80), nb, "q8_0", k.level);

            let nbk = n / QK_K;
            let mut w4 = vec![BlockQ4K::zeroed(); nbk];
            quant_k::weights::quantize_q4_k(&w, &mut w4);
            let mut w6 = vec![BlockQ6K::zeroed(); nbk];
            quant_k::weights::quantize_q6_k(&w, &mut w6);
            let mut x8 = vec![BlockQ8K::zeroed(); nbk];
            (k.quantize_q8_k)(&x, &mut x8);
            assert_dot((k.dot_q4_k_q8_k)(&w4, &x8), &exact_q4_k(&w4, &x8), nbk, "q4_k", k.level);
            assert_dot((k.dot_q6_k_q8_k)(&w6, &x8), &exact_q6_k(&w6, &x8), nbk, "q6_k", k.level);
        }
    }
}

#[test]
fn quantized_dots_handle_extreme_blocks() {
    let mut rng = rng(23);
    for k in levels() {
        // Largest quants everywhere, with the largest f16 scales that keep f32 finite.
        let nb = 9;
        let mut x = rand_q8_0(&mut rng, nb, 0);
        let mut y = rand_q8_0(&mut rng, nb, 0);
        for (i, (x, y)) in x.iter_mut().zip(&mut y).enumerate() {
            x.qs = [if i % 2 == 0 { 127 } else { -127 }; 32];
            y.qs = [-127; 32];
            x.d = f16::from_f32(6e4);
            y.d = f16::from_f32(6e4);
        }
        assert_dot((k.dot_q8_0_q8_0)(&x, &y), &exact_q8_0(&x, &y), nb, "q8_0 extreme", k.level);
        let mut w = rand_q4_1(&mut rng, nb, 0);
        let mut a = rand_q8_1(&mut rng, nb, 0);
        for (w, a) in w.iter_mut().zip(&mut a) {
            w.qs = [0xff; 16];
            a.qs = [127; 32];
            a.s = f16::from_f32(a.d.to_f32() * 127.0 * 32.0);
        }
        assert_dot((k.dot_q4_1_q8_1)(&w, &a), &exact_q4_1(&w, &a), nb, "q4_1 extreme", k.level);
        // All-ones bit patterns in every K-quant field; smallest and largest activations.
        let mut x4 = rand_q4k(&mut rng, 3, 0);
        let mut x6 = rand_q6k(&mut rng, 3, 0);
        let mut y8 = rand_q8k(&mut rng, 3, 0);
        for ((x4, x6), y8) in x4.iter_mut().zip(&mut x6).zip(&mut y8) {
            x4.scales = [0xff; 12];
            x4.qs = [0xff; 128];
            x6.ql = [0xff; 128];
            x6.qh = [0xff; 64];
            x6.scales = [-128; 16];
            y8.qs = [-127; QK_K];
            y8.bsums = [-127 * 16; 16];
        }
        assert_dot((k.dot_q4_k_q8_k)(&x4, &y8), &exact_q4_k(&x4, &y8), 3, "q4_k extreme", k.level);
        assert_dot((k.dot_q6_k_q8_k)(&x6, &y8), &exact_q6_k(&x6, &y8), 3, "q6_k extreme", k.level);
        // Empty rows.
        assert_eq!((k.dot_q4_k_q8_k)(&[], &[]), 0.0);
        assert_eq!((k.dot_q8_0_q8_0)(&[], &[]), 0.0);
    }
}

#[test]
fn reference_quantized_dots_agree_with_dequantized_float_math() {
    // The reference kernels against dequantize-then-multiply in f64, which ties the integer
    // formulas above to the codecs' meaning of each block.
    let mut rng = rng(24);
    let n = 1536;
    let w = randv(&mut rng, n);
    let x = randv(&mut rng, n);
    let nb = n / 32;
    let dot64 = |a: &[f32], b: &[f32]| -> (f64, f64) {
        let v = a.iter().zip(b).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
        let m = a.iter().zip(b).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
        (v, m)
    };
    let (mut wd, mut xd) = (vec![0.0; n], vec![0.0; n]);

    let mut w40 = vec![BlockQ4_0::zeroed(); nb];
    quant::weights::quantize_q4_0(&w, &mut w40);
    let mut x80 = vec![BlockQ8_0::zeroed(); nb];
    quant::quantize_q8_0(&x, &mut x80);
    quant::dequantize_q4_0(&w40, &mut wd);
    quant::dequantize_q8_0(&x80, &mut xd);
    let (v, m) = dot64(&wd, &xd);
    let got = f64::from(reference::dot_q4_0_q8_0(&w40, &x80));
    assert!((got - v).abs() <= 1e-5 * m, "q4_0: {got} vs {v}");

    let mut w41 = vec![BlockQ4_1::zeroed(); nb];
    quant::weights::quantize_q4_1(&w, &mut w41);
    let mut x81 = vec![BlockQ8_1::zeroed(); nb];
    quant::quantize_q8_1(&x, &mut x81);
    quant::dequantize_q4_1(&w41, &mut wd);
    quant::dequantize_q8_1(&x81, &mut xd);
    let (v, m) = dot64(&wd, &xd);
    let got = f64::from(reference::dot_q4_1_q8_1(&w41, &x81));
    // The min term uses s = d * sum(q) rounded to f16: up to 2^-11 of each |m * s|.
    let s_err: f64 = w41.iter().zip(&x81).map(|(w, x)| (f(w.m) * f(x.s)).abs() / 2048.0).sum();
    assert!((got - v).abs() <= 1e-5 * m + s_err, "q4_1: {got} vs {v}");

    let nbk = n / QK_K;
    let mut x8 = vec![BlockQ8K::zeroed(); nbk];
    quant_k::quantize_q8_k(&x, &mut x8);
    quant_k::dequantize_q8_k(&x8, &mut xd);
    let mut w6 = vec![BlockQ6K::zeroed(); nbk];
    quant_k::weights::quantize_q6_k(&w, &mut w6);
    quant_k::dequantize_q6_k(&w6, &mut wd);
    let (v, m) = dot64(&wd, &xd);
    let got = f64::from(reference::dot_q6_k_q8_k(&w6, &x8));
    assert!((got - v).abs() <= 1e-5 * m, "q6_k: {got} vs {v}");
    let mut w4 = vec![BlockQ4K::zeroed(); nbk];
    quant_k::weights::quantize_q4_k(&w, &mut w4);
    quant_k::dequantize_q4_k(&w4, &mut wd);
    let (v, m) = dot64(&wd, &xd);
    let got = f64::from(reference::dot_q4_k_q8_k(&w4, &x8));
    assert!((got - v).abs() <= 1e-5 * m, "q4_k: {got} vs {v}");
}

// ---------------------------------------------------------------------------------------------
// Float dot products, conversions, axpy.
// ---------------------------------------------------------------------------------------------

/// Lengths around every vector width and unroll factor, and the model's sizes.
const FLOAT_LENS: [usize; 20] =
    [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 576, 1000, 1536];

/// The longest chain of f32 additions a level's dot product may use for `n` terms.
fn chain(level: SimdLevel, n: usize) -> f64 {
    match level {
        SimdLevel::Scalar => n as f64 + 2.0,
        _ => n as f64 / 8.0 + 16.0,
    }
}

fn assert_float_dot(got: f32, a: &[f32], b: &[f32], level: SimdLevel, what: &str) {
    let exact: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let mag: f64 = a.iter().zip(b).map(|(&x, &y)| (f64::from(x) * f64::from(y)).abs()).sum();
    let bound = chain(level, a.len()) * EPS * mag + 1e-37;
    let err = (f64::from(got) - exact).abs();
    assert!(err <= bound, "{what} n={} at {level}: {got} vs {exact}, {err:e} > {bound:e}", a.len());
}

#[test]
fn float_dots_match_exact_value() {
    let mut rng = rng(31);
    for k in levels() {
        for &n in &FLOAT_LENS {
            for scale in [1.0f32, 1e-15, 1e15] {
                let a: Vec<f32> = randv(&mut rng, n).iter().map(|v| v * scale).collect();
                let b = randv(&mut rng, n);
                let ab: Vec<u16> = a.iter().map(|&v| quant_k::f32_to_bf16(v)).collect();
                let bb: Vec<u16> = b.iter().map(|&v| quant_k::f32_to_bf16(v)).collect();

                assert_float_dot((k.dot_f32)(&a, &b), &a, &b, k.level, "dot_f32");
                let af: Vec<f32> = ab.iter().map(|&v| quant_k::bf16_to_f32(v)).collect();
                let bf: Vec<f32> = bb.iter().map(|&v| quant_k::bf16_to_f32(v)).collect();
                assert_float_dot((k.dot_bf16)(&ab, &bb), &af, &bf, k.level, "dot_bf16");
                if scale == 1.0 {
                    // f16 has no room for the other magnitudes.
                    let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
                    let bh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
                    let af: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
                    let bf: Vec<f32> = bh.iter().map(|v| v.to_f32()).collect();
                    assert_float_dot((k.dot_f16)(&ah, &bh), &af, &bf, k.level, "dot_f16");
                    let got = (k.dot_f16_gemm)(&ah, &bh);
                    assert_float_dot(got, &af, &bf, k.level, "dot_f16_gemm");
                }
            }
        }
    }
}

/// Values that stress conversions: signed zeros, subnormals, rounding ties, the edges of
/// the f16 range, infinities and NaNs (conversions must carry them too).
fn conversion_specials() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::MAX,
        f32::MIN,
        65504.0,
        65520.0,
        -65520.0,
        6.0e-8,
        2.9e-8,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xff80_0001),
        f32::from_bits(0x7fff_ffff),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
    ];
    let n = v.len();
    v.extend_from_within(..n);
    v
}

#[test]
fn conversions_match_reference_exactly() {
    let mut rng = rng(32);
    let specials = conversion_specials();
    for k in levels() {
        let mut inputs: Vec<Vec<f32>> = FLOAT_LENS.iter().map(|&n| randv(&mut rng, n)).collect();
        inputs.extend(FLOAT_LENS.iter().map(|&n| rand_scaled(&mut rng, n, 1e5)));
        inputs.extend(FLOAT_LENS.iter().map(|&n| rand_scaled(&mut rng, n, 1e-6)));
        for start in 0..specials.len() / 2 {
            inputs.push(specials[start..].to_vec());
        }
        // Random bit patterns cover every exponent, NaNs included.
        inputs.push((0..1000).map(|_| f32::from_bits(rng.random())).collect());
        for x in &inputs {
            let n = x.len();
            let mut got = vec![f16::ZERO; n];
            let mut want = vec![f16::ONE; n];
            (k.f32_to_f16)(x, &mut got);
            reference::f32_to_f16(x, &mut want);
            let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "f32_to_f16 n={n} at {}", k.level);

            let mut back = vec![1.0f32; n];
            let mut back_ref = vec![0.0f32; n];
            (k.f16_to_f32)(&got, &mut back);
            reference::f16_to_f32(&got, &mut back_ref);
            let fbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(fbits(&back), fbits(&back_ref), "f16_to_f32 n={n} at {}", k.level);

            let mut got = vec![0u16; n];
            let mut want = vec![1u16; n];
            (k.f32_to_bf16)(x, &mut got);
            reference::f32_to_bf16(x, &mut want);
            assert_eq!(got, want, "f32_to_bf16 n={n} at {}", k.level);
        }
        // Every f16 bit pattern converts exactly.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut got = vec![0.0f32; all.len()];
        (k.f16_to_f32)(&all, &mut got);
        for (h, g) in all.iter().zip(&got) {
            assert_eq!(
                g.to_bits(),
                h.to_f32().to_bits(),
                "f16_to_f32 of {:#x} at {}",
                h.to_bits(),
                k.level
            );
        }
        // Outputs longer than inputs are left alone past the input's end.
        let mut out = vec![f16::from_f32(9.0); 20];
        (k.f32_to_f16)(&[1.0; 11], &mut out);
        assert!(out[11..].iter().all(|&h| h == f16::from_f32(9.0)), "f32_to_f16 wrote past n");
        let mut out = vec![9u16; 40];
        (k.f32_to_bf16)(&[1.0; 19], &mut out);
        assert!(out[19..].iter().all(|&h| h == 9), "f32_to_bf16 wrote past n at {}", k.level);
    }
}

#[test]
fn axpy_matches_exact_value() {
    let mut rng = rng(33);
    for k in levels() {
        for &n in &FLOAT_LENS {
            for a in [0.37f32, -1e-3, 250.0, 0.0] {
                let x: Vec<f16> = randv(&mut rng, n).iter().map(|&v| f16::from_f32(v)).collect();
                let y0 = randv(&mut rng, n);
                let mut y = y0.clone();
                (k.axpy_f16)(a, &x, &mut y);
                for i in 0..n {
                    let ax = f64::from(a) * f64::from(x[i].to_f32());
                    let exact = f64::from(y0[i]) + ax;
                    // One rounding of the product and one of the sum (or one, fused).
                    let bound = EPS * (f64::from(y0[i]).abs() + ax.abs());
                    let err = (f64::from(y[i]) - exact).abs();
                    assert!(err <= bound, "axpy n={n} i={i} at {}: {} vs {exact}", k.level, y[i]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise ops.
// ---------------------------------------------------------------------------------------------

/// |a - b| within `ulps` relative ulps of `b`, or both below `floor`.
fn close_ulps(a: f32, b: f32, ulps: f64, floor: f64) -> bool {
    let (a, b) = (f64::from(a), f64::from(b));
    (a - b).abs() <= ulps * EPS * b.abs() + floor
}

#[test]
fn rmsnorm_matches_reference() {
    let mut rng = rng(41);
    for k in levels() {
        for &n in FLOAT_LENS.iter().filter(|&&n| n > 0) {
            for scale in [1.0f32, 1e-3, 1e3, 1e15] {
                let x: Vec<f32> = randv(&mut rng, n).iter().map(|v| v * scale).collect();
                let w = randv(&mut rng, n);
                let mut a = vec![0.0; n];
                let mut b = vec![1.0; n];
                (k.rmsnorm)(&x, &w, 1e-5, &mut a);
                reference::rmsnorm(&x, &w, 1e-5, &mut b);
                // The f64 sum of squares may round differently in another order: the scale
                // then differs by at most an ulp, and each output by at most two.
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        close_ulps(*p, *q, 2.0, 0.0),
                        "rmsnorm n={n} i={i} at {}: {p} vs {q}",
                        k.level
                    );
                }
            }
        }
        // All zeros: the output is exactly zero (eps keeps the scale finite).
        let mut a = vec![1.0; 33];
        (k.rmsnorm)(&[0.0; 33], &[1.0; 33], 1e-6, &mut a);
        assert!(a.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn rmsnorm_rows_match_rmsnorm_row_by_row() {
    let mut rng = rng(43);
    for k in levels() {
        for d in [1, 7, 64, 100, 576] {
            for rows in [1, 3, 8, 9, 16, 21] {
                // Magnitudes over 2^±24 too, so that the order of the f64 additions shows.
                let wide = rows % 2 == 1;
                let x: Vec<f32> =
                    randv(&mut rng, rows * d)
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            if wide {
                                v * (2.0f32).powi((i * 7 % 49) as i32 - 24)
                            } else {
                                v * 37.0
                            }
                        })
                        .collect();
                let w = randv(&mut rng, d);
                let mut a = vec![0.0; rows * d];
                (k.rmsnorm_rows)(&x, &w, 1e-5, &mut a);
                for r in 0..rows {
                    let mut b = vec![1.0; d];
                    (k.rmsnorm)(&x[r * d..(r + 1) * d], &w, 1e-5, &mut b);
                    let got: Vec<u32> = a[r * d..(r + 1) * d].iter().map(|v| v.to_bits()).collect();
                    let want: Vec<u32> = b.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "d={d} rows={rows} row {r} at {}", k.level);
                }
            }
        }
    }
    // A row whose f32 result depends on the order of its f64 additions: in order, each
    // 2^-54 is lost against 1 + 2^-24 (half an f64 step is 2^-53), whose mean is an f32 tie
    // (rounded to even, down); summed first, the 510 small squares tip it up.
    let d = 512;
    let mut row = vec![2.0f32.powi(-27); d];
    row[0] = 1.0;
    row[1] = 2.0f32.powi(-12);
    let x: Vec<f32> = (0..8).flat_map(|_| row.iter().copied()).collect();
    let w = vec![1.0; d];
    for k in levels() {
        let mut a = vec![0.0; 8 * d];
        (k.rmsnorm_rows)(&x, &w, 0.0, &mut a);
        let mut b = vec![0.0; d];
        (k.rmsnorm)(&row, &w, 0.0, &mut b);
        assert_eq!(a[..d], b[..], "the order of the squares' sum at {}", k.level);
        let mut rev = row.clone();
        rev.reverse();
        let mut c = vec![0.0; d];
        (k.rmsnorm)(&rev, &w, 0.0, &mut c);
        assert_ne!(b[0].to_bits(), c[d - 1].to_bits(), "the case shows the order");
    }
}

#[test]
fn softmax_matches_reference() {
    let mut rng = rng(42);
    for k in levels() {
        for &n in FLOAT_LENS.iter().filter(|&&n| n > 0) {
            for (spread, scale) in
                [(1.0f32, 0.125f32), (1.0, 1.0), (40.0, 1.0), (1e3, 1.0), (1.0, -2.0)]
            {
                let x: Vec<f32> = randv(&mut rng, n).iter().map(|v| v * spread).collect();
                let mut a = x.clone();
                let mut b = x.clone();
                (k.softmax)(&mut a, scale);
                reference::softmax(&mut b, scale);
                // exp within ~2 ulp of libm's, then one normalizing product.
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        close_ulps(*p, *q, 8.0, 1e-38),
                        "softmax n={n} spread={spread} i={i} at {}: {p} vs {q}",
                        k.level
                    );
                }
                let sum: f64 = a.iter().map(|&v| f64::from(v)).sum();
                assert!((sum - 1.0).abs() < 1e-5, "softmax sums to {sum}");
            }
        }
        // Masked entries (-inf) get probability zero; all-equal inputs are uniform.
        let mut x = vec![0.5f32, f32::NEG_INFINITY, 0.25, f32::NEG_INFINITY, 1.0];
        (k.softmax)(&mut x, 1.0);
        assert_eq!((x[1], x[3]), (0.0, 0.0));
        let mut x = vec![3.0f32; 37];
        (k.softmax)(&mut x, 0.7);
        assert!(x.iter().all(|&v| close_ulps(v, 1.0 / 37.0, 4.0, 0.0)));
    }
}

#[test]
fn swiglu_matches_reference() {
    let mut rng = rng(43);
    for k in levels() {
        for &n in &FLOAT_LENS {
            for spread in [1.0f32, 10.0, 100.0] {
                let g: Vec<f32> = randv(&mut rng, n).iter().map(|v| v * spread).collect();
                let u = randv(&mut rng, n);
                let mut a = vec![0.0; n];
                let mut b = vec![1.0; n];
                (k.swiglu)(&g, &u, &mut a);
                reference::swiglu(&g, &u, &mut b);
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        close_ulps(*p, *q, 8.0, 1e-30),
                        "swiglu n={n} i={i} g={} at {}: {p} vs {q}",
                        g[i],
                        k.level
                    );
                }
            }
        }
    }
}

#[test]
fn rope_matches_reference_bit_for_bit() {
    let mut rng = rng(44);
    for k in levels() {
        for n_dims in [2usize, 32, 64, 128] {
            for pos in [0u32, 1, 77, 4095] {
                let mut cache = vec![0.0; n_dims];
                kvx_kernels::ops::rope_cache(pos, n_dims, 10000.0, None, &mut cache);
                let x = randv(&mut rng, n_dims);
                for neox in [false, true] {
                    let (mut a, mut b) = (x.clone(), x.clone());
                    if neox {
                        (k.rope_neox)(&mut a, &cache, n_dims);
                        kvx_kernels::ops::rope_neox(&mut b, &cache, n_dims);
                    } else {
                        (k.rope_norm)(&mut a, &cache, n_dims);
                        kvx_kernels::ops::rope_norm(&mut b, &cache, n_dims);
                    }
                    assert!(
                        a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "rope neox={neox} n_dims={n_dims} pos={pos} at {}",
                        k.level
                    );
                }
            }
        }
    }
}

#[test]
fn silu_is_accurate_across_the_exp_range() {
    // swiglu with up = 1 is silu; sweep the gate through the whole range of exp, including
    // the overflow (-x > 88.7) and deep-underflow (-x < -103) regions and the special-case
    // scaling path (|x| > 126 ln 2).
    let mut g: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.06).collect();
    g.extend([-88.0, -88.7, -88.75, -89.0, -104.0, -120.0, -1e4, -3e38, 87.0, 88.7, 104.0, 3e38]);
    g.extend([-0.0, 0.0, 1e-30, -1e-30, f32::MIN_POSITIVE]);
    let up = vec![1.0f32; g.len()];
    for k in levels() {
        let mut out = vec![0.0; g.len()];
        (k.swiglu)(&g, &up, &mut out);
        for (&x, &y) in g.iter().zip(&out) {
            let exact = f64::from(x) / (1.0 + (-f64::from(x)).exp());
            assert!(
                (f64::from(y) - exact).abs() <= 4.0 * EPS * exact.abs() + 1e-36,
                "silu({x}) at {}: {y} vs {exact}",
                k.level
            );
        }
    }
}

//! Parity of every kernel table (each SIMD level this CPU supports) with the scalar
//! reference twins, on random inputs.

use bytemuck::Zeroable;
use half::f16;
use kvx_kernels::cpu::{Kernels, SimdLevel, reference};
use kvx_kernels::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use kvx_kernels::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn levels() -> Vec<Kernels> {
    let ks: Vec<Kernels> = SimdLevel::ALL.iter().filter_map(|&l| Kernels::for_level(l)).collect();
    assert!(!ks.is_empty() && ks[0].level == SimdLevel::Scalar);
    ks
}

fn randv(rng: &mut StdRng, n: usize) -> Vec<f32> {
    // Mixed magnitudes, with some exact zeros and outliers as real activations have.
    (0..n)
        .map(|i| match i % 37 {
            0 => 0.0,
            1 => rng.random_range(-40.0f32..40.0),
            _ => rng.random_range(-2.0f32..2.0),
        })
        .collect()
}

/// |a - b| within `rel` of the magnitude sum (the scale of the dot product's terms).
fn close(a: f32, b: f32, scale: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * scale.max(1e-6)
}

const LENS: [usize; 4] = [32, 64, 576, 1536];

#[test]
fn activation_quantizers_match_reference_exactly() {
    let mut rng = StdRng::seed_from_u64(11);
    for k in levels() {
        for &n in &LENS {
            let x = randv(&mut rng, n);
            let mut a = vec![BlockQ8_0::zeroed(); n / 32];
            let mut b = a.clone();
            (k.quantize_q8_0)(&x, &mut a);
            quant::quantize_q8_0(&x, &mut b);
            for (a, b) in a.iter().zip(&b) {
                assert_eq!((a.d.to_bits(), a.qs), (b.d.to_bits(), b.qs), "q8_0 at {}", k.level);
            }
            let mut a = vec![BlockQ8_1::zeroed(); n / 32];
            let mut b = a.clone();
            (k.quantize_q8_1)(&x, &mut a);
            quant::quantize_q8_1(&x, &mut b);
            for (a, b) in a.iter().zip(&b) {
                assert_eq!(
                    (a.d.to_bits(), a.s.to_bits(), a.qs),
                    (b.d.to_bits(), b.s.to_bits(), b.qs),
                    "q8_1 at {}",
                    k.level
                );
            }
        }
        let x = randv(&mut rng, QK_K * 3);
        let mut a = vec![BlockQ8K::zeroed(); 3];
        let mut b = a.clone();
        (k.quantize_q8_k)(&x, &mut a);
        quant_k::quantize_q8_k(&x, &mut b);
        for (a, b) in a.iter().zip(&b) {
            assert_eq!((a.d.to_bits(), a.qs, a.bsums), (b.d.to_bits(), b.qs, b.bsums), "q8_k at {}", k.level);
        }
    }
}

#[test]
fn quantized_dot_products_match_reference() {
    let mut rng = StdRng::seed_from_u64(12);
    for k in levels() {
        for &n in &LENS {
            let w = randv(&mut rng, n);
            let x = randv(&mut rng, n);
            let scale: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let nb = n / 32;

            let mut w40 = vec![BlockQ4_0::zeroed(); nb];
            quant::weights::quantize_q4_0(&w, &mut w40);
            let mut w41 = vec![BlockQ4_1::zeroed(); nb];
            quant::weights::quantize_q4_1(&w, &mut w41);
            let mut w80 = vec![BlockQ8_0::zeroed(); nb];
            quant::weights::quantize_q8_0(&w, &mut w80);
            let mut x80 = vec![BlockQ8_0::zeroed(); nb];
            quant::quantize_q8_0(&x, &mut x80);
            let mut x81 = vec![BlockQ8_1::zeroed(); nb];
            quant::quantize_q8_1(&x, &mut x81);

            let pairs = [
                ("q4_0", (k.dot_q4_0_q8_0)(&w40, &x80), reference::dot_q4_0_q8_0(&w40, &x80)),
                ("q4_1", (k.dot_q4_1_q8_1)(&w41, &x81), reference::dot_q4_1_q8_1(&w41, &x81)),
                ("q8_0", (k.dot_q8_0_q8_0)(&w80, &x80), reference::dot_q8_0_q8_0(&w80, &x80)),
            ];
            for (name, got, want) in pairs {
                assert!(close(got, want, scale, 1e-5), "{name} n={n} at {}: {got} vs {want}", k.level);
            }
        }
        for nb in [1usize, 2, 6] {
            let n = nb * QK_K;
            let w = randv(&mut rng, n);
            let x = randv(&mut rng, n);
            let scale: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let mut w4 = vec![BlockQ4K::zeroed(); nb];
            quant_k::weights::quantize_q4_k(&w, &mut w4);
            let mut w6 = vec![BlockQ6K::zeroed(); nb];
            quant_k::weights::quantize_q6_k(&w, &mut w6);
            let mut x8 = vec![BlockQ8K::zeroed(); nb];
            quant_k::quantize_q8_k(&x, &mut x8);
            let got = (k.dot_q4_k_q8_k)(&w4, &x8);
            let want = reference::dot_q4_k_q8_k(&w4, &x8);
            assert!(close(got, want, scale, 1e-5), "q4_k at {}: {got} vs {want}", k.level);
            let got = (k.dot_q6_k_q8_k)(&w6, &x8);
            let want = reference::dot_q6_k_q8_k(&w6, &x8);
            assert!(close(got, want, scale, 1e-5), "q6_k at {}: {got} vs {want}", k.level);
        }
    }
}

#[test]
fn quantized_dots_agree_with_dequantized_float_math() {
    // The reference dot products themselves against dequantize-then-multiply in f64.
    let mut rng = StdRng::seed_from_u64(13);
    let n = 1536;
    let w = randv(&mut rng, n);
    let x = randv(&mut rng, n);
    let nb = n / 32;
    let mut w41 = vec![BlockQ4_1::zeroed(); nb];
    quant::weights::quantize_q4_1(&w, &mut w41);
    let mut x81 = vec![BlockQ8_1::zeroed(); nb];
    quant::quantize_q8_1(&x, &mut x81);
    let mut wd = vec![0.0; n];
    let mut xd = vec![0.0; n];
    quant::dequantize_q4_1(&w41, &mut wd);
    quant::dequantize_q8_1(&x81, &mut xd);
    let exact: f64 = wd.iter().zip(&xd).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
    let scale: f32 = wd.iter().zip(&xd).map(|(a, b)| (a * b).abs()).sum();
    let got = reference::dot_q4_1_q8_1(&w41, &x81);
    // The min term uses s = d * sum(q) rounded to f16, hence the looser bound.
    assert!(close(got, exact as f32, scale, 2e-3), "{got} vs {exact}");

    let nbk = n / QK_K;
    let mut w6 = vec![BlockQ6K::zeroed(); nbk];
    quant_k::weights::quantize_q6_k(&w, &mut w6);
    let mut x8 = vec![BlockQ8K::zeroed(); nbk];
    quant_k::quantize_q8_k(&x, &mut x8);
    quant_k::dequantize_q6_k(&w6, &mut wd);
    quant_k::dequantize_q8_k(&x8, &mut xd);
    let exact: f64 = wd.iter().zip(&xd).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
    let got = reference::dot_q6_k_q8_k(&w6, &x8);
    assert!(close(got, exact as f32, scale, 1e-5), "{got} vs {exact}");
    let mut w4 = vec![BlockQ4K::zeroed(); nbk];
    quant_k::weights::quantize_q4_k(&w, &mut w4);
    quant_k::dequantize_q4_k(&w4, &mut wd);
    let exact: f64 = wd.iter().zip(&xd).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
    let got = reference::dot_q4_k_q8_k(&w4, &x8);
    assert!(close(got, exact as f32, scale, 1e-5), "{got} vs {exact}");
}

#[test]
fn float_kernels_match_reference() {
    let mut rng = StdRng::seed_from_u64(14);
    for k in levels() {
        for n in [1usize, 7, 8, 31, 64, 65, 576, 1000] {
            let a = randv(&mut rng, n);
            let b = randv(&mut rng, n);
            let scale: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();

            let mut ah = vec![f16::ZERO; n];
            let mut bh = vec![f16::ZERO; n];
            (k.f32_to_f16)(&a, &mut ah);
            reference::f32_to_f16(&b, &mut bh);
            let mut ah_ref = vec![f16::ZERO; n];
            reference::f32_to_f16(&a, &mut ah_ref);
            assert_eq!(ah, ah_ref, "f32_to_f16 at {}", k.level);
            let mut back = vec![0.0; n];
            (k.f16_to_f32)(&ah, &mut back);
            for (x, y) in back.iter().zip(&ah) {
                assert_eq!(*x, y.to_f32());
            }

            let got = (k.dot_f16)(&ah, &bh);
            let want = reference::dot_f16(&ah, &bh);
            assert!(close(got, want, scale, 1e-5), "dot_f16 n={n} at {}", k.level);
            let got = (k.dot_f32)(&a, &b);
            let want = reference::dot_f32(&a, &b);
            assert!(close(got, want, scale, 1e-5), "dot_f32 n={n} at {}", k.level);

            let mut ab = vec![0u16; n];
            let mut bb = vec![0u16; n];
            (k.f32_to_bf16)(&a, &mut ab);
            reference::f32_to_bf16(&b, &mut bb);
            let mut ab_ref = vec![0u16; n];
            reference::f32_to_bf16(&a, &mut ab_ref);
            assert_eq!(ab, ab_ref, "f32_to_bf16 at {}", k.level);
            let got = (k.dot_bf16)(&ab, &bb);
            let want = reference::dot_bf16(&ab, &bb);
            assert!(close(got, want, scale, 1e-5), "dot_bf16 n={n} at {}", k.level);

            let mut y1 = b.clone();
            let mut y2 = b.clone();
            (k.axpy_f16)(0.37, &ah, &mut y1);
            reference::axpy_f16(0.37, &ah, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "axpy at {}", k.level);
            }
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let mut rng = StdRng::seed_from_u64(15);
    for k in levels() {
        for n in [1usize, 9, 64, 576, 1536] {
            let x = randv(&mut rng, n);
            let w = randv(&mut rng, n);
            let mut a = vec![0.0; n];
            let mut b = vec![0.0; n];
            (k.rmsnorm)(&x, &w, 1e-5, &mut a);
            reference::rmsnorm(&x, &w, 1e-5, &mut b);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "rmsnorm at {}", k.level);
            }

            let mut a = x.clone();
            let mut b = x.clone();
            (k.softmax)(&mut a, 0.125);
            reference::softmax(&mut b, 0.125);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-6 + 1e-5 * q, "softmax at {}", k.level);
            }
            assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-4);

            let g = randv(&mut rng, n);
            let mut a = vec![0.0; n];
            let mut b = vec![0.0; n];
            (k.swiglu)(&g, &x, &mut a);
            reference::swiglu(&g, &x, &mut b);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "swiglu at {}", k.level);
            }
        }
    }
}

#[test]
fn reference_softmax_and_rmsnorm_match_definitions() {
    let x = [1.0f32, 2.0, 3.0, -1.0];
    let mut s = x;
    reference::softmax(&mut s, 0.5);
    let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) * 0.5).exp()).collect();
    let z: f64 = e.iter().sum();
    for (a, b) in s.iter().zip(&e) {
        assert!((f64::from(*a) - b / z).abs() < 1e-7);
    }
    let mut o = [0.0f32; 4];
    reference::rmsnorm(&x, &[1.0, 2.0, 1.0, 1.0], 0.0, &mut o);
    let rms = ((1.0 + 4.0 + 9.0 + 1.0) / 4.0f64).sqrt();
    assert!((f64::from(o[1]) - 2.0 * 2.0 / rms).abs() < 1e-6);
    let mut o = [0.0f32; 1];
    reference::swiglu(&[1.0], &[3.0], &mut o);
    assert!((f64::from(o[0]) - 3.0 / (1.0 + (-1.0f64).exp())).abs() < 1e-6);
}

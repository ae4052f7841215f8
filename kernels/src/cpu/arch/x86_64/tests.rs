//! Parity of the arch tables as this module builds them, before `cpu::exact` swaps some slots
//! for its ggml-pinned kernels: without these tests the swapped-out kernels here would go
//! untested (the integration tests see only the final tables); and the CPU identification
//! that chooses the default arithmetic.

use bytemuck::Zeroable;
use half::f16;
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::cpu::{Kernels, SimdLevel, reference};
use crate::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use crate::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};

/// The raw AVX2 and AVX-512 tables this CPU supports.
fn raw_tables() -> Vec<Kernels> {
    let mut t = vec![];
    if SimdLevel::Avx2.is_supported() {
        t.push(super::avx2::kernels());
    }
    if SimdLevel::Avx512.is_supported() {
        t.push(super::avx512::kernels());
    }
    t
}

fn randv(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 37 {
            0 => 0.0,
            1 => rng.random_range(-40.0f32..40.0),
            _ => rng.random_range(-2.0f32..2.0),
        })
        .collect()
}

/// Inputs the scalar codec answers differently (NaN; infinities, which the AVX2 kernel turns
/// into NaN products): the AVX-512 `Q8_1` kernel gives the AVX2 kernel's bytes, at the
/// first and last element of a group's first and second block, inside a later group, and
/// in the blocks past the last whole group.
#[test]
fn q8_1_matches_the_avx2_kernel_on_nan_and_infinity() {
    if !SimdLevel::Avx512.is_supported() {
        return;
    }
    let (k2, k5) = (super::avx2::kernels(), super::avx512::kernels());
    let mut rng = StdRng::seed_from_u64(72);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 31, 32, 200, 511, 600] {
            let mut x = randv(&mut rng, 3 * QK_K);
            x[at] = bad;
            let nb = x.len() / 32;
            let (mut a, mut b) = (vec![BlockQ8_1::zeroed(); nb], vec![BlockQ8_1::zeroed(); nb]);
            (k5.quantize_q8_1)(&x, &mut a);
            (k2.quantize_q8_1)(&x, &mut b);
            assert!(
                bytemuck::cast_slice::<_, u8>(&a) == bytemuck::cast_slice::<_, u8>(&b),
                "{bad} at {at}"
            );
        }
    }
}

#[test]
fn raw_quantizers_are_bit_identical_to_the_scalar_codecs() {
    let mut rng = StdRng::seed_from_u64(71);
    let mut inputs: Vec<Vec<f32>> = (1..=6).map(|nb| randv(&mut rng, nb * QK_K)).collect();
    // All-subnormal blocks (127 / amax overflows) and ties at scale 1, over two lengths: the
    // AVX-512 `Q8_1` kernel quantizes 16 blocks (512 floats) together.
    for n in [QK_K, 2 * QK_K] {
        inputs.push((0..n).map(|i| f32::from_bits(1 + 997 * i as u32)).collect());
        inputs.push(
            (0..n).map(|i| if i % 32 == 0 { -127.0 } else { (i % 200) as f32 - 99.5 }).collect(),
        );
    }
    // One subnormal block among normal ones: its group is quantized the AVX2 way.
    let mut one = randv(&mut rng, 2 * QK_K);
    one[64..96].iter_mut().enumerate().for_each(|(i, v)| *v = f32::from_bits(1 + i as u32));
    inputs.push(one);
    // A block of zeros and one of negative zeros inside a group (scale 0, inverse 0).
    let mut zeros = randv(&mut rng, 2 * QK_K);
    zeros[32..64].fill(0.0);
    zeros[320..352].fill(-0.0);
    inputs.push(zeros);
    for k in raw_tables() {
        for x in &inputs {
            let nb = x.len() / 32;
            let (mut a, mut b) = (vec![BlockQ8_0::zeroed(); nb], vec![BlockQ8_0::zeroed(); nb]);
            (k.quantize_q8_0)(x, &mut a);
            quant::quantize_q8_0(x, &mut b);
            assert!(
                bytemuck::cast_slice::<_, u8>(&a) == bytemuck::cast_slice::<_, u8>(&b),
                "q8_0 at {}",
                k.level
            );
            let (mut a, mut b) = (vec![BlockQ8_1::zeroed(); nb], vec![BlockQ8_1::zeroed(); nb]);
            (k.quantize_q8_1)(x, &mut a);
            quant::quantize_q8_1(x, &mut b);
            assert!(
                bytemuck::cast_slice::<_, u8>(&a) == bytemuck::cast_slice::<_, u8>(&b),
                "q8_1 at {}",
                k.level
            );
            let nk = x.len() / QK_K;
            let (mut a, mut b) = (vec![BlockQ8K::zeroed(); nk], vec![BlockQ8K::zeroed(); nk]);
            (k.quantize_q8_k)(x, &mut a);
            quant_k::quantize_q8_k(x, &mut b);
            assert!(
                bytemuck::cast_slice::<_, u8>(&a) == bytemuck::cast_slice::<_, u8>(&b),
                "q8_k at {}",
                k.level
            );
        }
    }
}

#[test]
fn raw_dots_agree_across_levels_and_with_the_reference() {
    let mut rng = StdRng::seed_from_u64(72);
    let tables = raw_tables();
    for n in [QK_K, 1536, 3 * QK_K] {
        let (w, x) = (randv(&mut rng, n), randv(&mut rng, n));
        let nb = n / 32;
        let mut w40 = vec![BlockQ4_0::zeroed(); nb];
        quant::weights::quantize_q4_0(&w, &mut w40);
        let mut w41 = vec![BlockQ4_1::zeroed(); nb];
        quant::weights::quantize_q4_1(&w, &mut w41);
        let mut w80 = vec![BlockQ8_0::zeroed(); nb];
        quant::weights::quantize_q8_0(&w, &mut w80);
        let mut w4 = vec![BlockQ4K::zeroed(); n / QK_K];
        quant_k::weights::quantize_q4_k(&w, &mut w4);
        let mut w6 = vec![BlockQ6K::zeroed(); n / QK_K];
        quant_k::weights::quantize_q6_k(&w, &mut w6);
        let mut x80 = vec![BlockQ8_0::zeroed(); nb];
        quant::quantize_q8_0(&x, &mut x80);
        let mut x81 = vec![BlockQ8_1::zeroed(); nb];
        quant::quantize_q8_1(&x, &mut x81);
        let mut x8 = vec![BlockQ8K::zeroed(); n / QK_K];
        quant_k::quantize_q8_k(&x, &mut x8);
        // Scale of the terms: |w| · |x| plus the offsets the kernels add and remove again.
        let scale: f32 =
            w.iter().zip(&x).map(|(a, b)| (a.abs() + 2.0) * b.abs()).sum::<f32>() * 64.0;
        let results = |k: &Kernels| {
            [
                (k.dot_q4_0_q8_0)(&w40, &x80),
                (k.dot_q4_1_q8_1)(&w41, &x81),
                (k.dot_q8_0_q8_0)(&w80, &x80),
                (k.dot_q4_k_q8_k)(&w4, &x8),
                (k.dot_q6_k_q8_k)(&w6, &x8),
            ]
        };
        let want = results(&reference::KERNELS);
        let mut first: Option<[f32; 5]> = None;
        for k in &tables {
            let got = results(k);
            for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                assert!((g - r).abs() <= 1e-5 * scale, "dot {i} n={n} at {}: {g} vs {r}", k.level);
            }
            // VNNI changes only the exact integer part: same bits at both levels.
            if let Some(f) = first {
                let bits = |v: [f32; 5]| v.map(f32::to_bits);
                assert_eq!(bits(got), bits(f), "levels disagree at n={n}");
            }
            first = Some(got);
        }
    }
}

#[test]
fn raw_elementwise_ops_match_reference() {
    let mut rng = StdRng::seed_from_u64(73);
    let close = |a: f32, b: f32, ulps: f32, floor: f32| {
        (a - b).abs() <= ulps * f32::EPSILON * b.abs() + floor
    };
    for k in raw_tables() {
        for n in [1usize, 7, 8, 9, 15, 16, 17, 33, 300, 576, 1000, 1536] {
            let x = randv(&mut rng, n);
            let w = randv(&mut rng, n);
            let (mut a, mut b) = (vec![0.0; n], vec![1.0; n]);
            (k.rmsnorm)(&x, &w, 1e-5, &mut a);
            reference::rmsnorm(&x, &w, 1e-5, &mut b);
            assert!(
                a.iter().zip(&b).all(|(p, q)| close(*p, *q, 2.0, 0.0)),
                "rmsnorm n={n} at {}",
                k.level
            );

            for spread in [1.0f32, 40.0] {
                let s: Vec<f32> = x.iter().map(|v| v * spread).collect();
                let (mut a, mut b) = (s.clone(), s.clone());
                (k.softmax)(&mut a, 0.125);
                reference::softmax(&mut b, 0.125);
                assert!(
                    a.iter().zip(&b).all(|(p, q)| close(*p, *q, 8.0, 1e-38)),
                    "softmax n={n} at {}",
                    k.level
                );

                let (mut a, mut b) = (vec![0.0; n], vec![1.0; n]);
                (k.swiglu)(&s, &w, &mut a);
                reference::swiglu(&s, &w, &mut b);
                assert!(
                    a.iter().zip(&b).all(|(p, q)| close(*p, *q, 8.0, 1e-30)),
                    "swiglu n={n} at {}",
                    k.level
                );
            }

            let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let (mut a, mut b) = (w.clone(), w.clone());
            (k.axpy_f16)(0.3, &h, &mut a);
            reference::axpy_f16(0.3, &h, &mut b);
            assert!(
                a.iter()
                    .zip(&b)
                    .all(|(p, q)| (p - q).abs() <= 2.0 * f32::EPSILON * (q.abs() + 1.0))
            );
            let hw: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let (got, want) = ((k.dot_f16)(&h, &hw), reference::dot_f16(&h, &hw));
            let mag: f32 = h.iter().zip(&hw).map(|(a, b)| (a.to_f32() * b.to_f32()).abs()).sum();
            assert!(
                (got - want).abs() <= (n as f32 + 16.0) * f32::EPSILON * mag + 1e-30,
                "dot_f16 at {}",
                k.level
            );
        }
    }
}

#[test]
fn amd_families_from_cpuid_signatures() {
    use super::amd_family_1ah_or_later_of as zen5;
    let amd = [0x6874_7541, 0x6974_6e65, 0x444d_4163];
    let intel = [0x756e_6547, 0x4965_6e69, 0x6c65_746e]; // "GenuineIntel"
    assert!(zen5(amd, 0x00B0_0F21)); // EPYC 9005 (Zen 5): family 0Fh + 0Bh
    assert!(zen5(amd, 0x00B4_0F40)); // Ryzen 9000 (Zen 5)
    assert!(!zen5(amd, 0x00A1_0F11)); // EPYC 9004 (Zen 4): family 19h
    assert!(!zen5(amd, 0x0083_0F10)); // EPYC 7002 (Zen 2): family 17h
    assert!(!zen5(intel, 0x0008_06F8)); // Xeon (Sapphire Rapids): family 6
    assert!(!zen5(intel, 0x00B0_0F21)); // the vendor decides, not the bits alone
}

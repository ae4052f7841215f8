//! K-quant block layouts (`Q4_K`, `Q6_K`, and the activation format `Q8_K`), bit-exact with
//! ggml, and their scalar codecs.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::quant::{GgmlType, QK_K, QuantError, cast_blocks};

/// `Q4_K`: 256 weights in 8 sub-blocks of 32, 4-bit quants, 6-bit sub-block scales and mins.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale for the scales.
    pub d: f16,
    /// Super-block scale for the mins.
    pub dmin: f16,
    /// 8 scales and 8 mins, 6 bits each, packed.
    pub scales: [u8; 12],
    /// Nibbles: for each 64-element chunk, 32 bytes with elements `l` (low) and `l + 32` (high).
    pub qs: [u8; 128],
}

/// `Q6_K`: 256 weights in 16 sub-blocks of 16, 6-bit quants, 8-bit signed scales.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants.
    pub ql: [u8; 128],
    /// High 2 bits of the quants.
    pub qh: [u8; 64],
    /// Sub-block scales.
    pub scales: [i8; 16],
    /// Super-block scale.
    pub d: f16,
}

/// `Q8_K`: 256 activations as signed bytes with an f32 scale and per-16 partial sums.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quants.
    pub qs: [i8; 256],
    /// Sums of each group of 16 quants.
    pub bsums: [i16; 16],
}

/// Whether [`dequantize_row`] handles `ty`.
pub(crate) fn dequantize_supported(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::BF16)
}

/// Dequantizes a row of a K-quant (or bf16) type; lengths were checked by the caller.
pub(crate) fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let bad = QuantError::BadLength { ty, what: "misaligned" };
    match ty {
        GgmlType::Q4_K => dequantize_q4_k(cast_blocks(src).ok_or(bad)?, out),
        GgmlType::Q6_K => dequantize_q6_k(cast_blocks(src).ok_or(bad)?, out),
        GgmlType::Q8_K => dequantize_q8_k(cast_blocks(src).ok_or(bad)?, out),
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

/// bf16 bit pattern to f32 (exact).
pub fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

/// f32 to bf16 bit pattern, round to nearest even (NaN stays NaN), as ggml does.
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// The 6-bit scale and min of sub-block `j` of a `Q4_K` block.
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// All eight 6-bit scales and eight 6-bit mins of a `Q4_K` block at once:
/// `[scale 0..8, min 0..8]`, the same values as [`scale_min_k4`] gives one at a time.
///
/// Works on the three little-endian words of `q` with masks, which is how the SIMD dot
/// products unpack a block's scales before widening them to 16-bit lanes.
pub fn unpack_scales_mins_k4(q: &[u8; 12]) -> [u8; 16] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    // Scales 0..4 and mins 0..4 are the low 6 bits of bytes 0..4 and 4..8. Scales 4..8 take
    // their low 4 bits from the low nibbles of bytes 8..12 and their top 2 bits from the top
    // of bytes 0..4; mins 4..8 take the high nibbles of bytes 8..12 and the top of bytes 4..8.
    let scales_lo = w0 & LOW6;
    let mins_lo = w1 & LOW6;
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
    let mut out = [0u8; 16];
    for (dst, word) in out.chunks_exact_mut(4).zip([scales_lo, scales_hi, mins_lo, mins_hi]) {
        dst.copy_from_slice(&word.to_le_bytes());
    }
    out
}

/// Scalar reference: `Q4_K` blocks to f32.
pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (chunk, (q, y)) in b.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc, m) = scale_min_k4(2 * chunk, &b.scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            for l in 0..32 {
                y[l] = d1 * f32::from(q[l] & 0x0f) - m1;
                y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
            }
        }
    }
}

/// The signed 6-bit quants of a `Q6_K` block, in element order.
pub fn q6_k_values(b: &BlockQ6K) -> [i8; QK_K] {
    let mut v = [0i8; QK_K];
    for half in 0..2 {
        let ql = &b.ql[64 * half..64 * half + 64];
        let qh = &b.qh[32 * half..32 * half + 32];
        let y = &mut v[128 * half..128 * half + 128];
        for l in 0..32 {
            y[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    v
}

/// Scalar reference: `Q6_K` blocks to f32.
pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let q = q6_k_values(b);
        for (i, (y, &q)) in y.iter_mut().zip(&q).enumerate() {
            *y = d * f32::from(b.scales[i / 16]) * f32::from(q);
        }
    }
}

/// Scalar reference: f32 to `Q8_K` (ggml's `quantize_row_q8_K_ref`).
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            b.d = 0.0;
            b.qs = [0; QK_K];
            b.bsums = [0; 16];
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        b.d = 1.0 / iscale;
    }
}

/// Scalar reference: `Q8_K` blocks to f32.
pub fn dequantize_q8_k(blocks: &[BlockQ8K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = b.d * f32::from(q);
        }
    }
}

/// Scalar reference quantizers for K-quant weights (tests and tools).
pub mod weights {
    use super::*;

    /// f32 to `Q4_K` with a simple min/max fit per sub-block (not ggml's search, but a valid
    /// encoding whose dequantization is what the dot products must agree with).
    pub fn quantize_q4_k(x: &[f32], out: &mut [BlockQ4K]) {
        for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
            let mut scales = [0.0f32; 8];
            let mut mins = [0.0f32; 8];
            for (j, sub) in x.chunks_exact(32).enumerate() {
                let lo = sub.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
                let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                scales[j] = (hi - lo) / 15.0;
                mins[j] = -lo;
            }
            let max_scale = scales.iter().copied().fold(0.0f32, f32::max);
            let max_min = mins.iter().copied().fold(0.0f32, f32::max);
            let d = max_scale / 63.0;
            let dmin = max_min / 63.0;
            b.d = f16::from_f32(d);
            b.dmin = f16::from_f32(dmin);
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            let mut ls = [0u8; 8];
            let mut lm = [0u8; 8];
            for j in 0..8 {
                ls[j] = if d > 0.0 { (scales[j] / d).round().clamp(0.0, 63.0) as u8 } else { 0 };
                lm[j] =
                    if dmin > 0.0 { (mins[j] / dmin).round().clamp(0.0, 63.0) as u8 } else { 0 };
            }
            b.scales = [0; 12];
            for j in 0..8 {
                if j < 4 {
                    b.scales[j] = ls[j];
                    b.scales[j + 4] = lm[j];
                } else {
                    b.scales[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
                    b.scales[j - 4] |= (ls[j] >> 4) << 6;
                    b.scales[j] |= (lm[j] >> 4) << 6;
                }
            }
            let mut q = [0u8; QK_K];
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &b.scales);
                let dd = d * f32::from(sc);
                let mm = dmin * f32::from(m);
                for l in 0..32 {
                    let v = x[32 * j + l];
                    q[32 * j + l] =
                        if dd > 0.0 { ((v + mm) / dd).round().clamp(0.0, 15.0) as u8 } else { 0 };
                }
            }
            for chunk in 0..4 {
                for l in 0..32 {
                    b.qs[32 * chunk + l] = q[64 * chunk + l] | (q[64 * chunk + 32 + l] << 4);
                }
            }
        }
    }

    /// f32 to `Q6_K` with one scale per 16 elements.
    pub fn quantize_q6_k(x: &[f32], out: &mut [BlockQ6K]) {
        for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
            let mut sub = [0.0f32; 16];
            for (j, s) in x.chunks_exact(16).enumerate() {
                sub[j] = s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0;
            }
            let max_scale = sub.iter().copied().fold(0.0f32, f32::max);
            let d = max_scale / 127.0;
            b.d = f16::from_f32(d);
            let d = b.d.to_f32();
            let mut q = [0i8; QK_K];
            for j in 0..16 {
                let sc = if d > 0.0 { (sub[j] / d).round().clamp(-128.0, 127.0) as i8 } else { 0 };
                b.scales[j] = sc;
                let step = d * f32::from(sc);
                for l in 0..16 {
                    let v = x[16 * j + l];
                    q[16 * j + l] =
                        if step != 0.0 { (v / step).round().clamp(-32.0, 31.0) as i8 } else { 0 };
                }
            }
            b.ql = [0; 128];
            b.qh = [0; 64];
            for half in 0..2 {
                for l in 0..32 {
                    let at = |k: usize| (q[128 * half + l + k] + 32) as u8;
                    let (q1, q2, q3, q4) = (at(0), at(32), at(64), at(96));
                    b.ql[64 * half + l] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
                    b.ql[64 * half + l + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
                    b.qh[32 * half + l] =
                        (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(size_of::<BlockQ4K>(), GgmlType::Q4_K.type_size());
        assert_eq!(size_of::<BlockQ6K>(), GgmlType::Q6_K.type_size());
        assert_eq!(size_of::<BlockQ8K>(), GgmlType::Q8_K.type_size());
    }

    #[test]
    fn k_quants_round_trip_closely() {
        let mut rng = StdRng::seed_from_u64(7);
        let x: Vec<f32> = (0..QK_K * 4).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut y = vec![0.0; x.len()];

        let mut q4 = vec![BlockQ4K::zeroed(); 4];
        weights::quantize_q4_k(&x, &mut q4);
        dequantize_q4_k(&q4, &mut y);
        let err4 = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(err4 < 0.12, "q4_k max error {err4}");

        let mut q6 = vec![BlockQ6K::zeroed(); 4];
        weights::quantize_q6_k(&x, &mut q6);
        dequantize_q6_k(&q6, &mut y);
        let err6 = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(err6 < 0.04, "q6_k max error {err6}");

        let mut q8 = vec![BlockQ8K::zeroed(); 4];
        quantize_q8_k(&x, &mut q8);
        dequantize_q8_k(&q8, &mut y);
        let err8 = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(err8 < 0.01, "q8_k max error {err8}");
        // The row dequantizer (the split K/V products') gives the same values.
        let mut z = vec![0.0; y.len()];
        crate::quant::dequantize_row(GgmlType::Q8_K, bytemuck::cast_slice(&q8), &mut z).unwrap();
        assert_eq!(y, z);
        for b in &q8 {
            for (s, q) in b.bsums.iter().zip(b.qs.chunks(16)) {
                assert_eq!(i32::from(*s), q.iter().map(|&v| i32::from(v)).sum::<i32>());
            }
        }
    }

    #[test]
    fn unpacked_scales_match_one_at_a_time_decoding() {
        let mut rng = StdRng::seed_from_u64(8);
        for _ in 0..1000 {
            let q: [u8; 12] = rng.random();
            let all = unpack_scales_mins_k4(&q);
            for j in 0..8 {
                assert_eq!((all[j], all[8 + j]), scale_min_k4(j, &q), "sub-block {j} of {q:?}");
            }
        }
    }

    #[test]
    fn bf16_conversion_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }
}

//! Quantized block layouts (bit-exact with ggml) and their scalar codecs.
//!
//! Weights stay in these layouts in memory (usually straight from the memory-mapped GGUF
//! file). Activations are quantized once per matrix multiplication into the "vec-dot type"
//! of the weight format ([`vec_dot_type`]), exactly as ggml does, so that integer dot
//! products can be used and results track llama.cpp closely.
//!
//! Rounding: ggml's x86 SIMD quantizers round half to even (`_mm256_round_ps` with
//! `_MM_ROUND_NEAREST`); the scalar codecs here do the same so every SIMD level produces
//! identical blocks.

use bytemuck::{Pod, Zeroable};
use half::f16;

pub use kvx_gguf::{GgmlType, QK_K};

/// Elements per block of the 32-element formats.
pub const QK32: usize = 32;

/// `Q4_0`: 32 weights as 4-bit unsigned nibbles with one scale; value = d * (q - 8).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Nibbles: element `j` in the low nibble of byte `j`, element `j + 16` in the high one.
    pub qs: [u8; 16],
}

/// `Q4_1`: 32 weights as 4-bit unsigned nibbles with scale and minimum; value = d * q + m.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum.
    pub m: f16,
    /// Nibbles, laid out as in [`BlockQ4_0`].
    pub qs: [u8; 16],
}

/// `Q8_0`: 32 values as signed bytes with one scale; value = d * q.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Quants.
    pub qs: [i8; 32],
}

/// `Q8_1`: like [`BlockQ8_0`] plus `s = d * sum(qs)`, the activation format for `Q4_1`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f16,
    /// `d * sum(qs)`.
    pub s: f16,
    /// Quants.
    pub qs: [i8; 32],
}

/// The type activations are quantized to before a dot product with weights of type `ty`
/// (ggml's `vec_dot_type`), or `None` when kvx has no dot product for `ty`.
pub fn vec_dot_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 | Q8_0 => Q8_0,
        Q4_1 => Q8_1,
        Q4_K | Q6_K => Q8_K,
        F16 => F16,
        BF16 => BF16,
        F32 => F32,
        _ => return None,
    })
}

/// Whether kvx can use tensors of type `ty` as matrix weights or embeddings.
pub fn is_supported_weight(ty: GgmlType) -> bool {
    vec_dot_type(ty).is_some() && dequantize_supported(ty)
}

fn dequantize_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q8_0 | F16 | F32) || crate::quant_k::dequantize_supported(ty)
}

/// Reinterprets raw bytes as blocks. `None` if the length is not a whole number of blocks
/// or the bytes are not aligned for `B`.
pub fn cast_blocks<B: Pod>(bytes: &[u8]) -> Option<&[B]> {
    bytemuck::try_cast_slice(bytes).ok()
}

/// Mutable variant of [`cast_blocks`].
pub fn cast_blocks_mut<B: Pod>(bytes: &mut [u8]) -> Option<&mut [B]> {
    bytemuck::try_cast_slice_mut(bytes).ok()
}

/// Errors from the codecs (lengths that do not fit the format).
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    /// The type has no codec in kvx.
    #[error("tensor type {0} is not supported")]
    Unsupported(GgmlType),
    /// A row length that is not a whole number of blocks, or buffers of the wrong size.
    #[error("bad length for {ty}: {what}")]
    BadLength {
        /// The format.
        ty: GgmlType,
        /// What did not fit.
        what: &'static str,
    },
}

/// Dequantizes one row of `n = out.len()` elements of type `ty` stored in `src`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let bad = |what| QuantError::BadLength { ty, what };
    let n = out.len() as u64;
    if ty.row_size(n) != Some(src.len() as u64) {
        return Err(bad("source bytes do not match the row length"));
    }
    use GgmlType::*;
    match ty {
        F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Q4_0 => dequantize_q4_0(cast_blocks(src).ok_or(bad("misaligned"))?, out),
        Q4_1 => dequantize_q4_1(cast_blocks(src).ok_or(bad("misaligned"))?, out),
        Q8_0 => dequantize_q8_0(cast_blocks(src).ok_or(bad("misaligned"))?, out),
        Q8_1 => dequantize_q8_1(cast_blocks(src).ok_or(bad("misaligned"))?, out),
        other => return crate::quant_k::dequantize_row(other, src, out),
    }
    Ok(())
}

/// Scalar reference: `Q4_0` blocks to f32.
pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d.to_f32();
        for j in 0..16 {
            o[j] = (i32::from(b.qs[j] & 0x0f) - 8) as f32 * d;
            o[j + 16] = (i32::from(b.qs[j] >> 4) - 8) as f32 * d;
        }
    }
}

/// Scalar reference: `Q4_1` blocks to f32.
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for j in 0..16 {
            o[j] = f32::from(b.qs[j] & 0x0f) * d + m;
            o[j + 16] = f32::from(b.qs[j] >> 4) * d + m;
        }
    }
}

/// Scalar reference: `Q8_0` blocks to f32.
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d.to_f32();
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// Scalar reference: `Q8_1` blocks to f32.
pub fn dequantize_q8_1(blocks: &[BlockQ8_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK32)) {
        let d = b.d.to_f32();
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// max |x| of a block, and the scale pair (d, 1/d) ggml derives from it.
fn q8_scales(x: &[f32]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (d, id)
}

/// Scalar reference: f32 to `Q8_0` (activation quantizer for `Q4_0`/`Q8_0` weights).
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK32)) {
        let (d, id) = q8_scales(x);
        b.d = f16::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i8;
        }
    }
}

/// Scalar reference: f32 to `Q8_1` (activation quantizer for `Q4_1` weights).
pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK32)) {
        let (d, id) = q8_scales(x);
        b.d = f16::from_f32(d);
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            let r = (v * id).round_ties_even() as i8;
            *q = r;
            sum += i32::from(r);
        }
        b.s = f16::from_f32(d * sum as f32);
    }
}

/// Scalar reference quantizers for weights (used by tests and tools to build models).
pub mod weights {
    use super::*;

    /// f32 to `Q4_0` (ggml's reference quantizer).
    pub fn quantize_q4_0(x: &[f32], out: &mut [BlockQ4_0]) {
        for (b, x) in out.iter_mut().zip(x.chunks_exact(QK32)) {
            // The value with the largest magnitude, keeping its sign.
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in x {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b.d = f16::from_f32(d);
            for j in 0..16 {
                let x0 = ((x[j] * id + 8.5) as i32).min(15) as u8;
                let x1 = ((x[j + 16] * id + 8.5) as i32).min(15) as u8;
                b.qs[j] = x0 | (x1 << 4);
            }
        }
    }

    /// f32 to `Q4_1` (ggml's reference quantizer).
    pub fn quantize_q4_1(x: &[f32], out: &mut [BlockQ4_1]) {
        for (b, x) in out.iter_mut().zip(x.chunks_exact(QK32)) {
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b.d = f16::from_f32(d);
            b.m = f16::from_f32(min);
            for j in 0..16 {
                let x0 = (((x[j] - min) * id + 0.5) as i32).min(15) as u8;
                let x1 = (((x[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                b.qs[j] = x0 | (x1 << 4);
            }
        }
    }

    /// f32 to `Q8_0`, rounding half away from zero as ggml's reference quantizer does.
    pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
        for (b, x) in out.iter_mut().zip(x.chunks_exact(QK32)) {
            let (d, _) = q8_scales(x);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            b.d = f16::from_f32(d);
            for (q, &v) in b.qs.iter_mut().zip(x) {
                *q = (v * id).round() as i8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn randv(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0) * scale).collect()
    }

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(size_of::<BlockQ4_0>(), GgmlType::Q4_0.type_size());
        assert_eq!(size_of::<BlockQ4_1>(), GgmlType::Q4_1.type_size());
        assert_eq!(size_of::<BlockQ8_0>(), GgmlType::Q8_0.type_size());
        assert_eq!(size_of::<BlockQ8_1>(), GgmlType::Q8_1.type_size());
    }

    #[test]
    fn q8_round_trip_error_is_within_half_a_step() {
        let mut rng = StdRng::seed_from_u64(1);
        let x = randv(&mut rng, 32 * 64, 3.0);
        let mut q = vec![BlockQ8_1::zeroed(); 64];
        quantize_q8_1(&x, &mut q);
        let mut y = vec![0.0; x.len()];
        dequantize_q8_1(&q, &mut y);
        for (blk, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = q[blk].d.to_f32();
            let sum: i32 = q[blk].qs.iter().map(|&v| i32::from(v)).sum();
            let s = q[blk].s.to_f32();
            assert!((s - d * sum as f32).abs() <= 1e-3 * (d * sum as f32).abs() + 1e-6);
            for (a, b) in xs.iter().zip(ys) {
                // d is stored as f16, so allow its rounding on top of half a step.
                assert!((a - b).abs() <= 0.5 * d + 2e-3 * a.abs(), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn q4_1_weights_round_trip() {
        let mut rng = StdRng::seed_from_u64(2);
        let x = randv(&mut rng, 32 * 16, 0.5);
        let mut q = vec![BlockQ4_1::zeroed(); 16];
        weights::quantize_q4_1(&x, &mut q);
        let mut y = vec![0.0; x.len()];
        dequantize_q4_1(&q, &mut y);
        for (blk, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = q[blk].d.to_f32();
            for (a, b) in xs.iter().zip(ys) {
                assert!((a - b).abs() <= 0.5 * d + 1e-3, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let x = [0.0f32; 32];
        let mut q = [BlockQ8_0::zeroed(); 1];
        quantize_q8_0(&x, &mut q);
        assert_eq!(q[0].d.to_f32(), 0.0);
        assert!(q[0].qs.iter().all(|&v| v == 0));
    }

    #[test]
    fn dequantize_row_checks_lengths() {
        let src = vec![0u8; 20];
        let mut out = vec![0.0; 31];
        assert!(dequantize_row(GgmlType::Q4_1, &src, &mut out).is_err());
        let mut out = vec![0.0; 32];
        assert!(dequantize_row(GgmlType::Q4_1, &src, &mut out).is_ok());
        assert!(matches!(
            dequantize_row(GgmlType::IQ2_XXS, &[0u8; 66], &mut vec![0.0; 256]),
            Err(QuantError::Unsupported(_))
        ));
    }
}

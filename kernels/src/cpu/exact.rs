//! Kernels whose rounding matches ggml's CPU backend bit for bit at each level.
//!
//! A quantized model is numerically chaotic: a one-ulp difference in an attention sum can
//! flip an int8 rounding a few layers later and change the argmax. To produce exactly the
//! tokens llama.cpp produces on the same CPU, the float operations whose association ggml
//! fixes are reproduced here with the same association:
//!
//! * `f16` dot products in two shapes: ggml's `vec_dot_f16` (used for single-token steps)
//!   and llamafile's tinyBLAS (used by multi-token prompt batches);
//! * the softmax (ggml's vectorized `expf`, per-vector sums accumulated in f64);
//! * SwiGLU (ggml's vectorized `silu`).
//!
//! At [`SimdLevel::Avx512`] the shapes are those of ggml built with AVX-512, at
//! [`SimdLevel::Avx2`] those of ggml built with AVX2+FMA+F16C, and at
//! [`SimdLevel::Scalar`] those of ggml's generic C code.
//!
//! [`SimdLevel::Avx512`]: super::SimdLevel::Avx512
//! [`SimdLevel::Avx2`]: super::SimdLevel::Avx2
//! [`SimdLevel::Scalar`]: super::SimdLevel::Scalar

use half::f16;

use super::{Kernels, SimdLevel};

/// How a level's f16 dot product associates its additions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumShape {
    /// Products rounded to f32, summed in order in f64 (ggml's generic code).
    SeqF64,
    /// `accs` registers of `lanes` f32 lanes, fused multiply-adds: element `i` of each
    /// `lanes * accs` step goes to register `(i / lanes) % accs`, lane `i % lanes`; the
    /// registers are then added pairwise and the lanes reduced by `reduce`. Elements past
    /// the last whole step are added in f64 afterwards.
    Lanes {
        /// f32 lanes per register.
        lanes: usize,
        /// Accumulator registers.
        accs: usize,
        /// Horizontal reduction of the final register.
        reduce: Reduce,
    },
}

/// Horizontal reductions of one register, as the compilers lower ggml's idioms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// `_mm512_reduce_add_ps`: halves added 16→8→4, then `(v0+v2) + (v1+v3)`.
    Zmm,
    /// ggml's AVX reduce: 8→4, then `hadd` twice: `(v0+v1) + (v2+v3)`.
    YmmHadd,
    /// tinyBLAS's AVX `hsum`: 8→4, then `movehl`/`movehdup`: `(v0+v2) + (v1+v3)`.
    YmmMovehl,
}

impl Reduce {
    /// Reduces the first 16 (`Zmm`) or 8 (`Ymm*`) lanes of `v`.
    pub fn apply(self, v: &[f32]) -> f32 {
        match self {
            Reduce::Zmm => {
                let a: [f32; 8] = std::array::from_fn(|i| v[i + 8] + v[i]);
                let b: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
                (b[0] + b[2]) + (b[1] + b[3])
            }
            Reduce::YmmHadd => {
                let b: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
                (b[0] + b[1]) + (b[2] + b[3])
            }
            Reduce::YmmMovehl => {
                let b: [f32; 4] = std::array::from_fn(|i| v[i + 4] + v[i]);
                (b[0] + b[2]) + (b[1] + b[3])
            }
        }
    }
}

impl SumShape {
    /// Elements per step (`lanes * accs`), 1 for [`SumShape::SeqF64`].
    pub fn step(self) -> usize {
        match self {
            SumShape::SeqF64 => 1,
            SumShape::Lanes { lanes, accs, .. } => lanes * accs,
        }
    }

    /// Finishes a sum from per-class partial sums (`class = i % step` for elements of
    /// whole steps) plus the f64 sum of the remaining elements' rounded products.
    pub fn finish(self, classes: &[f32], rest: f64) -> f32 {
        match self {
            SumShape::SeqF64 => (f64::from(classes.first().copied().unwrap_or(0.0)) + rest) as f32,
            SumShape::Lanes { lanes, accs, reduce } => {
                let mut regs = [[0.0f32; 16]; 4];
                for a in 0..accs {
                    regs[a][..lanes].copy_from_slice(&classes[a * lanes..(a + 1) * lanes]);
                }
                let mut n = accs;
                while n > 1 {
                    let half = n / 2;
                    let (lo, hi) = regs.split_at_mut(half);
                    for (a, b) in lo.iter_mut().zip(hi.iter()) {
                        for (x, y) in a[..lanes].iter_mut().zip(&b[..lanes]) {
                            *x += y;
                        }
                    }
                    n = half;
                }
                let r = reduce.apply(&regs[0][..lanes]);
                (f64::from(r) + rest) as f32
            }
        }
    }

    /// The dot product of `x` and `y` with this shape (the scalar emulation; the levels'
    /// table functions compute the same bits faster).
    pub fn dot(self, x: &[f16], y: &[f16]) -> f32 {
        let n = x.len().min(y.len());
        match self {
            SumShape::SeqF64 => {
                let mut s = 0.0f64;
                for (a, b) in x[..n].iter().zip(&y[..n]) {
                    s += f64::from(a.to_f32() * b.to_f32());
                }
                s as f32
            }
            SumShape::Lanes { lanes, accs, .. } => {
                let step = lanes * accs;
                let main = n - n % step;
                let mut classes = [0.0f32; 64];
                for (i, (a, b)) in x[..main].iter().zip(&y[..main]).enumerate() {
                    let c = &mut classes[i % step];
                    *c = a.to_f32().mul_add(b.to_f32(), *c);
                }
                let mut rest = 0.0f64;
                for (a, b) in x[main..n].iter().zip(&y[main..n]) {
                    rest += f64::from(a.to_f32() * b.to_f32());
                }
                self.finish(&classes[..step], rest)
            }
        }
    }
}

/// The shapes of the two attention matrix products at a level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShapes {
    /// Single-token steps (ggml `vec_dot_f16`).
    pub decode: SumShape,
    /// Multi-token prompt batches (tinyBLAS), used when the reduced length is a multiple
    /// of its step; otherwise ggml falls back to `decode`.
    pub prefill: SumShape,
}

/// The shapes for `level`.
pub fn shapes(level: SimdLevel) -> AttnShapes {
    match level {
        SimdLevel::Scalar => AttnShapes { decode: SumShape::SeqF64, prefill: SumShape::SeqF64 },
        SimdLevel::Avx2 => AttnShapes {
            decode: SumShape::Lanes { lanes: 8, accs: 4, reduce: Reduce::YmmHadd },
            prefill: SumShape::Lanes { lanes: 8, accs: 1, reduce: Reduce::YmmMovehl },
        },
        SimdLevel::Avx512 => AttnShapes {
            decode: SumShape::Lanes { lanes: 16, accs: 4, reduce: Reduce::Zmm },
            prefill: SumShape::Lanes { lanes: 16, accs: 1, reduce: Reduce::Zmm },
        },
    }
}

/// Scalar ggml-generic softmax: `x = softmax(x * scale)` with `expf` and an f64 sum.
pub fn softmax_generic(x: &mut [f32], scale: f32) {
    super::reference::softmax(x, scale)
}

/// Installs the ggml-exact kernels into a level's table.
pub(crate) fn patch(k: &mut Kernels) {
    k.attn = shapes(k.level);
    // ggml's rms_norm is plain C at every level: squares summed in order in f64 (the x86
    // levels below put eight rows in the lanes of one f64 vector, the same additions).
    k.rmsnorm = super::reference::rmsnorm;
    k.rmsnorm_rows = super::reference::rmsnorm_rows;
    match k.level {
        SimdLevel::Scalar => {
            k.dot_f16 = dot_f16_generic;
            k.dot_f16_gemm = dot_f16_generic;
            k.softmax = softmax_generic;
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => super::arch::x86_64::exact::patch_avx2(k),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => super::arch::x86_64::exact::patch_avx512(k),
        #[cfg(not(target_arch = "x86_64"))]
        _ => {}
    }
}

fn dot_f16_generic(x: &[f16], y: &[f16]) -> f32 {
    SumShape::SeqF64.dot(x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_follow_their_trees() {
        // Values chosen so that association changes the f32 result.
        let v: Vec<f32> = (0..16).map(|i| if i % 2 == 0 { 1e8 } else { 1.0 + i as f32 }).collect();
        let zmm = Reduce::Zmm.apply(&v);
        let a: Vec<f32> = (0..8).map(|i| v[i] + v[i + 8]).collect();
        let b: Vec<f32> = (0..4).map(|i| a[i] + a[i + 4]).collect();
        assert_eq!(zmm, (b[0] + b[2]) + (b[1] + b[3]));
        let y = &v[..8];
        let t: Vec<f32> = (0..4).map(|i| y[i] + y[i + 4]).collect();
        assert_eq!(Reduce::YmmHadd.apply(y), (t[0] + t[1]) + (t[2] + t[3]));
        assert_eq!(Reduce::YmmMovehl.apply(y), (t[0] + t[2]) + (t[1] + t[3]));
    }

    #[test]
    fn lane_shape_dot_is_close_to_exact() {
        let x: Vec<f16> = (0..100).map(|i| f16::from_f32((i as f32 * 0.37).sin())).collect();
        let y: Vec<f16> = (0..100).map(|i| f16::from_f32((i as f32 * 0.11).cos())).collect();
        let exact: f64 =
            x.iter().zip(&y).map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32())).sum();
        for level in SimdLevel::ALL {
            let s = shapes(level);
            for shape in [s.decode, s.prefill] {
                let got = shape.dot(&x, &y);
                assert!((f64::from(got) - exact).abs() < 1e-4, "{shape:?}: {got} vs {exact}");
            }
        }
    }
}

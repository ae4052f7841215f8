//! Greedy output heads: a fast product screens the vocabulary, the exact product decides.
//!
//! A greedy request only ever looks at the first maximum of its logits. The exact products
//! ([`LaneMath::Exact`], ggml's association) cost twice the arithmetic of the
//! [`LaneMath::Fast`] ones over the same records, and both are within a rounding bound of the
//! true product. So a greedy row is computed fast, every row that could be the exact first
//! maximum is recomputed exactly (with the level's dot product, the bits the exact kernel
//! gives), and the others keep their fast values, which all lie below that maximum. The row's
//! first maximum is then the exact logits' first maximum, token for token; its other values
//! are not llama.cpp's, so requests that read them (log-probabilities, penalties, sampling)
//! take the exact head.
//!
//! **The bound.** For row `r` and one token, with per-block scales `s_b = d_w · d_a` and
//! integer products `q_w · q_a` (plus `m_w · s_a` per block for `Q4_1`), both arithmetics
//! sum the same `A = Σ_b |s_b| Σ_j |q_w q_a| + Σ_b |m_w s_a|` worth of terms in f32 chains of
//! at most `2·nb + 4` roundings (`nb` blocks; ggml's 8-lane chains and tree, or `Fast`'s two
//! fused multiply-adds per block), so each is within `γ_n · A` (`γ_n = n·u / (1 − n·u)`,
//! `u = 2⁻²⁴`) of the true value and the two within twice that of each other. `A` is bounded
//! per matrix and token as `q_max · D · Σ_b |d_a| Σ_j |q_a| + M · Σ_b |s_a|`, `D` and `M` the
//! largest `|d_w|` and `|m_w|` of the matrix. If `F` is the fast row and `B` the bound on
//! `|F − E|`, the exact first maximum `e` has `E_e ≥ max F − B`, hence `F_e ≥ max F − 2B`:
//! every row below that threshold is out.

use half::f16;

use crate::KernelError;
use crate::cpu::Kernels;
use crate::cpu::lanes::{LANE_ROWS, LaneMath, LaneMatrix, d_offset, rec_lines};
use crate::ops::QMatrix;
use crate::quant::{BlockQ8_0, BlockQ8_1, GgmlType, cast_blocks};

/// Screened rows beyond this many fall back to the exact product of every row (only
/// non-finite or degenerate activations get there: a normal row screens a handful).
const MAX_CANDIDATES: usize = 1024;

/// A matrix's fast copy and the magnitudes its screening bound needs.
#[derive(Debug, Clone)]
pub struct HeadScreen {
    fast: LaneMatrix,
    /// Largest `|d_w|` of the matrix.
    d_max: f64,
    /// Largest `|m_w|` (`Q4_1`), else 0.
    m_max: f64,
}

impl HeadScreen {
    /// The screen of a matrix from its row-lane copy (the scales are read from its records;
    /// the copy's own arithmetic does not matter). `None` if a scale is not finite.
    pub fn new(lanes: &LaneMatrix) -> Option<HeadScreen> {
        let ty = lanes.ty();
        let at = d_offset(ty);
        let (mut d_max, mut m_max) = (0.0f32, 0.0f32);
        for tile in 0..lanes.rows() / LANE_ROWS {
            let recs: &[u8] = bytemuck::cast_slice(lanes.tile(tile));
            for rec in recs.chunks_exact(rec_lines(ty) * 64) {
                let f = |i: usize| f16::from_le_bytes([rec[i], rec[i + 1]]).to_f32().abs();
                for i in 0..LANE_ROWS {
                    d_max = d_max.max(f(at + 2 * i));
                    if ty == GgmlType::Q4_1 {
                        m_max = m_max.max(f(at + 32 + 2 * i));
                    }
                }
            }
        }
        if !(d_max.is_finite() && m_max.is_finite()) {
            return None;
        }
        Some(HeadScreen {
            fast: lanes.with_math(LaneMath::Fast),
            d_max: f64::from(d_max),
            m_max: f64::from(m_max),
        })
    }

    /// The fast copy to compute the screened rows with.
    pub fn fast(&self) -> &LaneMatrix {
        &self.fast
    }

    /// The bound on `|fast − exact|` of any row of the matrix for the token `xq` (one row of
    /// activations in the matrix's activation type), or `None` if it is not finite.
    fn bound(&self, ty: GgmlType, xq: &[u8]) -> Option<f64> {
        let (q_max, c, s, nb) = match ty {
            GgmlType::Q4_1 => {
                let a: &[BlockQ8_1] = cast_blocks(xq)?;
                let c: f64 = a.iter().map(|b| f64::from(b.d.to_f32().abs()) * abs_sum(&b.qs)).sum();
                let s: f64 = a.iter().map(|b| f64::from(b.s.to_f32().abs())).sum();
                (15.0, c, s, a.len())
            }
            GgmlType::Q4_0 | GgmlType::Q8_0 => {
                let a: &[BlockQ8_0] = cast_blocks(xq)?;
                let c: f64 = a.iter().map(|b| f64::from(b.d.to_f32().abs()) * abs_sum(&b.qs)).sum();
                (if ty == GgmlType::Q4_0 { 8.0 } else { 128.0 }, c, 0.0, a.len())
            }
            _ => return None,
        };
        let a = q_max * self.d_max * c + self.m_max * s;
        let n = (2 * nb + 8) as f64;
        let u = f64::from(f32::EPSILON) / 2.0;
        let gamma = n * u / (1.0 - n * u);
        // Twice (both arithmetics), a margin for this computation's own rounding, and the
        // absolute error subnormal results could add.
        let b = 2.0 * gamma * a * 1.01 + n * f64::from(f32::from_bits(1)) * 4.0;
        b.is_finite().then_some(b)
    }
}

fn abs_sum(qs: &[i8; 32]) -> f64 {
    qs.iter().map(|&q| i32::from(q).unsigned_abs()).sum::<u32>() as f64
}

/// Turns `logits`, one token's products with `w` computed in `screen`'s fast arithmetic, into
/// a row whose first maximum is the first maximum of the exact products (module docs): every
/// row that could be it is recomputed with the level's dot product of `w`'s row and `xq`
/// (that token's activations). Returns how many rows were recomputed.
pub fn settle_argmax(
    k: &Kernels,
    w: &QMatrix<'_>,
    screen: &HeadScreen,
    xq: &[u8],
    logits: &mut [f32],
) -> Result<usize, KernelError> {
    if logits.len() != w.rows() {
        return Err(KernelError::Shape("one logit per row"));
    }
    if w.act_ty().row_size(w.cols() as u64) != Some(xq.len() as u64) {
        return Err(KernelError::Shape("activations do not fit the matrix"));
    }
    let max = max_of(logits);
    // Twice the bound, plus a margin for the threshold's own rounding.
    let slack =
        screen.bound(w.ty(), xq).map(|b| 2.0 * b + f64::from(max).abs() * f64::from(f32::EPSILON));
    settle(k, w, xq, logits, max, slack)
}

/// [`settle_argmax`] given the row's maximum and how far below it the exact first maximum's
/// fast value may lie (`None`: not finite, every row is computed exactly).
fn settle(
    k: &Kernels,
    w: &QMatrix<'_>,
    xq: &[u8],
    logits: &mut [f32],
    max: f32,
    slack: Option<f64>,
) -> Result<usize, KernelError> {
    let exact = |r: usize| exact_dot(k, w, r, xq);
    let threshold = match slack {
        Some(slack) if max.is_finite() && slack.is_finite() => {
            // Rounded down.
            let t = f64::from(max) - slack;
            let tf = t as f32;
            if f64::from(tf) > t { tf.next_down() } else { tf }
        }
        _ => f32::NAN,
    };
    let mut n = 0;
    if !threshold.is_nan() {
        // Whole lanes of 16 at a time (the compiler vectorizes the test); the few lanes
        // holding a candidate are walked. NaN fast values are candidates too.
        let hit = |l: f32| l.is_nan() || l >= threshold;
        'scan: for (c, chunk) in logits.chunks_mut(LANES).enumerate() {
            if !chunk.iter().fold(false, |any, &l| any | hit(l)) {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if hit(*l) {
                    n += 1;
                    if n > MAX_CANDIDATES {
                        break 'scan;
                    }
                    *l = exact(c * LANES + i)?;
                }
            }
        }
    }
    if threshold.is_nan() || n > MAX_CANDIDATES {
        for (r, l) in logits.iter_mut().enumerate() {
            *l = exact(r)?;
        }
        return Ok(w.rows());
    }
    Ok(n)
}

/// Lanes of the vectorized scans.
const LANES: usize = 16;

/// The largest value (NaNs ignored; `-inf` if there is none).
fn max_of(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            *m = if l > *m { l } else { *m };
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m })
}

/// The level's dot product of row `r` of `w` and the activations `xq`.
fn exact_dot(k: &Kernels, w: &QMatrix<'_>, r: usize, xq: &[u8]) -> Result<f32, KernelError> {
    let bad = KernelError::Shape("activations do not fit the matrix");
    let row = w.row(r);
    match w.ty() {
        GgmlType::Q4_0 => {
            Ok((k.dot_q4_0_q8_0)(cast_blocks(row).ok_or(bad)?, cast_blocks(xq).ok_or(bad)?))
        }
        GgmlType::Q4_1 => {
            Ok((k.dot_q4_1_q8_1)(cast_blocks(row).ok_or(bad)?, cast_blocks(xq).ok_or(bad)?))
        }
        GgmlType::Q8_0 => {
            Ok((k.dot_q8_0_q8_0)(cast_blocks(row).ok_or(bad)?, cast_blocks(xq).ok_or(bad)?))
        }
        other => Err(KernelError::UnsupportedType(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{activation_bytes, matmul, quantize_activations};
    use crate::par::ThreadPool;
    use crate::quant::{BlockQ4_0, BlockQ4_1};
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// The first maximum (index and bits), NaNs never winning, as greedy sampling takes it.
    fn first_max(v: &[f32]) -> (usize, u32) {
        let mut best = (0, f32::NEG_INFINITY);
        for (i, &x) in v.iter().enumerate() {
            if x > best.1 {
                best = (i, x);
            }
        }
        (best.0, best.1.to_bits())
    }

    fn kernels() -> Option<&'static Kernels> {
        let k = crate::cpu::kernels();
        if k.lanes.is_none() {
            eprintln!("no row-lane kernel on this CPU: nothing to screen");
            return None;
        }
        Some(k)
    }

    /// Random weights of `ty` in ggml's layout: scales of either sign, all quants.
    fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u16> {
        let nb = rows * cols / 32;
        let d = |rng: &mut StdRng| f16::from_f32(rng.random_range(-0.02f32..0.02));
        let bytes: Vec<u8> = match ty {
            GgmlType::Q4_0 => bytemuck::cast_slice(
                &(0..nb)
                    .map(|_| BlockQ4_0 { d: d(rng), qs: std::array::from_fn(|_| rng.random()) })
                    .collect::<Vec<_>>(),
            )
            .to_vec(),
            GgmlType::Q4_1 => bytemuck::cast_slice(
                &(0..nb)
                    .map(|_| BlockQ4_1 {
                        d: d(rng),
                        m: d(rng),
                        qs: std::array::from_fn(|_| rng.random()),
                    })
                    .collect::<Vec<_>>(),
            )
            .to_vec(),
            _ => bytemuck::cast_slice(
                &(0..nb)
                    .map(|_| BlockQ8_0 {
                        d: d(rng),
                        qs: std::array::from_fn(|_| rng.random_range(-127..=127)),
                    })
                    .collect::<Vec<_>>(),
            )
            .to_vec(),
        };
        bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
    }

    /// Builds the head `rows` × `x.len()` of `ty` in `raw` (row-lane copy, screen), quantizes
    /// one token `x` for it and hands `f` the head, its screen, the token's activations and
    /// the exact products.
    fn with_head<R>(
        k: &Kernels,
        pool: &ThreadPool,
        ty: GgmlType,
        rows: usize,
        raw: &[u16],
        x: &[f32],
        f: impl FnOnce(&QMatrix<'_>, &HeadScreen, &[u8], Vec<f32>) -> R,
    ) -> R {
        let cols = x.len();
        let bytes: &[u8] = bytemuck::cast_slice(raw);
        let lanes = LaneMatrix::repack(LaneMath::Exact, ty, rows, cols, bytes).unwrap();
        let w = QMatrix::new(ty, rows, cols, bytes).unwrap().with_lanes(&lanes).unwrap();
        let screen = HeadScreen::new(&lanes).unwrap();
        let mut act = vec![0u32; activation_bytes(w.act_ty(), cols, 1).unwrap().div_ceil(4)];
        let xq = quantize_activations(k, w.act_ty(), x, cols, bytemuck::cast_slice_mut(&mut act))
            .unwrap();
        let mut exact = vec![0.0; rows];
        matmul(k, pool, &w, xq, 1, &mut exact).unwrap();
        f(&w, &screen, xq, exact)
    }

    /// One token's products with the head of `with_head` exactly and screened-then-settled;
    /// returns (exact, settled, rows recomputed, the first maximum that settling only the rows
    /// at the fast maximum would give).
    fn products(
        k: &Kernels,
        pool: &ThreadPool,
        ty: GgmlType,
        rows: usize,
        raw: &[u16],
        x: &[f32],
    ) -> (Vec<f32>, Vec<f32>, usize, (usize, u32)) {
        with_head(k, pool, ty, rows, raw, x, |w, screen, xq, exact| {
            let fw = w.with_lanes(screen.fast()).unwrap();
            let mut fast = vec![0.0; rows];
            matmul(k, pool, &fw, xq, 1, &mut fast).unwrap();
            let mut settled = fast.clone();
            let n = settle_argmax(k, w, screen, xq, &mut settled).unwrap();
            let max = first_max(&fast).1;
            settle(k, w, xq, &mut fast, f32::from_bits(max), Some(0.0)).unwrap();
            (exact, settled, n, first_max(&fast))
        })
    }

    #[test]
    fn screened_rows_pick_the_exact_first_maximum() {
        let Some(k) = kernels() else { return };
        let pool = ThreadPool::new(2).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let (rows, cols) = (256, 576);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for trial in 0..12 {
                let mut raw = weights(&mut rng, ty, rows, cols);
                // Exact ties: a later row equal to an earlier one (the first must win).
                let rb = raw.len() / rows;
                let (a, b) = (rng.random_range(0..rows / 2), rng.random_range(rows / 2..rows));
                raw.copy_within(a * rb..(a + 1) * rb, b * rb);
                let x: Vec<f32> = (0..cols)
                    .map(|i| match (trial % 4, i % 41) {
                        (3, _) => 0.0,
                        (_, 0) => rng.random_range(-40.0..40.0),
                        (2, _) => rng.random_range(-2e3..2e3),
                        _ => rng.random_range(-2.0..2.0),
                    })
                    .collect();
                let (exact, settled, n, _) = products(k, &pool, ty, rows, &raw, &x);
                assert!(n >= 1, "{ty:?} trial {trial}: the maximum itself is recomputed");
                assert_eq!(first_max(&settled), first_max(&exact), "{ty:?} trial {trial}");
                for (r, (s, e)) in settled.iter().zip(&exact).enumerate() {
                    // Every value is the exact one or below the exact maximum.
                    assert!(
                        s.to_bits() == e.to_bits() || *s < f32::from_bits(first_max(&exact).1),
                        "{ty:?} trial {trial} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_screen_settles_ties_that_fast_products_break_the_wrong_way() {
        let Some(k) = kernels() else { return };
        let pool = ThreadPool::new(1).unwrap();
        let mut rng = StdRng::seed_from_u64(6);
        let (rows, cols, nb) = (16, 4096, 128);
        let mut unslacked_wrong = 0;
        for trial in 0..300 {
            // Every activation block has the same scale (amax 1 at its first element), every
            // weight block the same `d`: moving one unit of a product between two blocks then
            // keeps the true value and changes only the roundings.
            let x: Vec<f32> = (0..cols)
                .map(|i| if i % 32 == 0 { 1.0 } else { rng.random_range(-1.0f32..1.0) })
                .collect();
            let xq: Vec<i8> = x.iter().map(|v| (v * 127.0).round() as i8).collect();
            let d = f16::from_f32(0.01);
            let mut blocks: Vec<BlockQ8_0> = (0..rows * nb)
                .map(|_| BlockQ8_0 { d, qs: std::array::from_fn(|_| rng.random_range(-1..=1)) })
                .collect();
            // Row 3 follows the activations in its first half and opposes them in its second
            // (the largest product, after a cancellation that makes the running sums much
            // larger than the result, and so their roundings); row 9 is row 3 with one unit
            // moved from block b1 to block b2 at positions with equal activations.
            let half: i32 = xq
                .iter()
                .enumerate()
                .map(|(i, &q)| {
                    let q = i32::from(q.clamp(-100, 100));
                    if i < cols / 2 { q * q } else { -q * q }
                })
                .sum();
            let sign = if half >= 0 { 1 } else { -1 };
            for b in 0..nb {
                for j in 0..32 {
                    let q = xq[b * 32 + j].clamp(-100, 100);
                    blocks[3 * nb + b].qs[j] = if (b < nb / 2) == (sign > 0) { q } else { -q };
                }
            }
            let pair = (0..400).find_map(|_| {
                let (b1, b2) = (rng.random_range(0..nb), rng.random_range(0..nb));
                let (j1, j2) = (rng.random_range(1..32), rng.random_range(1..32));
                (b1 != b2 && xq[b1 * 32 + j1] == xq[b2 * 32 + j2] && xq[b1 * 32 + j1] != 0)
                    .then_some((b1 * 32 + j1, b2 * 32 + j2))
            });
            let Some((p1, p2)) = pair else { continue };
            for b in 0..nb {
                blocks[9 * nb + b] = blocks[3 * nb + b];
            }
            blocks[9 * nb + p1 / 32].qs[p1 % 32] += 1;
            blocks[9 * nb + p2 / 32].qs[p2 % 32] -= 1;
            let raw: Vec<u16> =
                bytemuck::cast_slice::<u8, u16>(bytemuck::cast_slice(&blocks)).to_vec();
            let (exact, settled, _, unslacked) = products(k, &pool, GgmlType::Q8_0, rows, &raw, &x);
            assert_eq!(first_max(&settled), first_max(&exact), "trial {trial}");
            if unslacked != first_max(&exact) {
                unslacked_wrong += 1;
            }
        }
        // Settling only the rows at the fast maximum would have picked another token in some
        // trials: the bound is what makes these right.
        assert!(unslacked_wrong > 0, "no trial needed the bound");
    }

    #[test]
    fn rows_without_a_finite_maximum_are_computed_exactly() {
        let Some(k) = kernels() else { return };
        let pool = ThreadPool::new(1).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, cols) = (32, 64);
        let raw = weights(&mut rng, GgmlType::Q8_0, rows, cols);
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        with_head(k, &pool, GgmlType::Q8_0, rows, &raw, &x, |w, screen, xq, exact| {
            let mut row = vec![f32::NAN; rows];
            assert_eq!(settle_argmax(k, w, screen, xq, &mut row).unwrap(), rows);
            assert_eq!(
                row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                exact.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            // Every row ties for the maximum: every row is recomputed.
            let mut flat = vec![1.0; rows];
            assert_eq!(settle(k, w, xq, &mut flat, 1.0, Some(0.0)).unwrap(), rows);
            // Mismatched operands are refused.
            assert!(settle_argmax(k, w, screen, &xq[1..], &mut row).is_err());
            assert!(settle_argmax(k, w, screen, xq, &mut row[1..]).is_err());
        });
    }
}

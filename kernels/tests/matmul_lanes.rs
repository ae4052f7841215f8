//! The row-lane matrix kernels (`cpu::lanes`) against their scalar twins: for `Q4_0`, `Q4_1`
//! and `Q8_0`, every level with the kernels, token counts 1..=70, several shapes and thread
//! counts, output `(t, r)` has exactly the bits of the level's dot product `dot(W[r], x[t])`
//! (`Exact`) or of `lanes::dot_reference(W[r], x[t])` (`Fast`); the bits of one token's
//! outputs do not depend on the tokens batched with it; and the `Fast` arithmetic stays
//! within rounding of the exact (f64) product.

mod common;

use common::*;
use kvx_kernels::cpu::Kernels;
use kvx_kernels::cpu::lanes::{self, LaneMath, LaneMatrix};
use kvx_kernels::gguf::GgmlType;
use kvx_kernels::ops::{self, MatmulScratch, QMatrix};
use kvx_kernels::par::ThreadPool;
use kvx_kernels::quant;

const TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

/// The levels with a row-lane kernel (none is a failure on a CPU that has AVX-512 VNNI),
/// each also without AMX tiles where it has them (both kernels are tested where both run).
fn lane_levels() -> Vec<Kernels> {
    let ks: Vec<Kernels> = levels().into_iter().filter(|k| k.lanes.is_some()).collect();
    if kvx_kernels::cpu::SimdLevel::Avx512.is_supported() {
        assert!(!ks.is_empty(), "the AVX-512 table has no row-lane kernel");
    }
    let tiles = ks.iter().any(Kernels::uses_tiles);
    assert_eq!(tiles, kvx_kernels::cpu::tiles_granted(), "tiles granted but not in the table");
    eprintln!("AMX tiles: {}", if tiles { "tested" } else { "not granted on this machine" });
    let plain = ks.iter().filter(|k| k.uses_tiles()).map(|k| k.without_tiles());
    ks.iter().copied().chain(plain).collect()
}

/// Asserts that `out` (`n_tok × rows`) holds exactly the twin's dot products: the level's
/// (`Exact`) or the row-lane reference (`Fast`).
fn assert_lanes(
    k: &Kernels,
    math: LaneMath,
    m: &QMatrix<'_>,
    xq: &[u8],
    n_tok: usize,
    out: &[f32],
    what: &str,
) {
    let a_row = xq.len() / n_tok;
    for t in 0..n_tok {
        let a = &xq[t * a_row..(t + 1) * a_row];
        for r in 0..m.rows() {
            let want = match math {
                LaneMath::Exact => dot(k, m.ty(), m.row(r), a),
                LaneMath::Fast => lanes::dot_reference(m.ty(), m.row(r), a).unwrap(),
            };
            let got = out[t * m.rows() + r];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{what}: {} {math:?} token {t} row {r}: {got} vs twin {want}",
                m.ty()
            );
        }
    }
}

#[test]
fn lanes_equal_the_reference_for_every_shape_token_and_thread_count() {
    let mut rng = rng(91);
    let pools: Vec<ThreadPool> = [1, 2, 3].iter().map(|&n| ThreadPool::new(n).unwrap()).collect();
    for (k, math) in
        lane_levels().into_iter().flat_map(|k| [(k, LaneMath::Exact), (k, LaneMath::Fast)])
    {
        for ty in TYPES {
            for &(rows, cols) in &[(16, 32), (32, 96), (48, 576), (192, 576), (64, 1536)] {
                let w = weights(&mut rng, ty, rows, cols);
                let lm = LaneMatrix::repack(math, ty, rows, cols, w.bytes()).unwrap();
                let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap().with_lanes(&lm).unwrap();
                assert!(m.uses_lanes(&k));
                let mut scratch = MatmulScratch::new();
                for n_tok in (1..=12).chain([15, 16, 17, 23, 40, 64, 70, 130]) {
                    let act = activations(&mut rng, &k, &m, n_tok);
                    let pool = &pools[(n_tok + rows) % pools.len()];
                    let mut out = vec![f32::NAN; n_tok * rows];
                    ops::matmul_with(&k, pool, &m, act.bytes(), n_tok, &mut out, &mut scratch)
                        .unwrap();
                    let what =
                        format!("{rows}x{cols}, {n_tok} tokens, {} threads", pool.n_threads());
                    assert_lanes(&k, math, &m, act.bytes(), n_tok, &out, &what);
                }
            }
        }
    }
}

#[test]
fn a_token_gets_the_same_bits_alone_and_in_any_batch() {
    let mut rng = rng(92);
    let pool = ThreadPool::new(2).unwrap();
    for (k, math) in
        lane_levels().into_iter().flat_map(|k| [(k, LaneMath::Exact), (k, LaneMath::Fast)])
    {
        for ty in TYPES {
            let (rows, cols) = (64, 576);
            let w = weights(&mut rng, ty, rows, cols);
            let lm = LaneMatrix::repack(math, ty, rows, cols, w.bytes()).unwrap();
            let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap().with_lanes(&lm).unwrap();
            let n_tok = 13;
            let act = activations(&mut rng, &k, &m, n_tok);
            let a_row = act.bytes().len() / n_tok;
            let mut all = vec![0.0; n_tok * rows];
            ops::matmul(&k, &pool, &m, act.bytes(), n_tok, &mut all).unwrap();
            for t in 0..n_tok {
                let mut one = vec![0.0; rows];
                ops::matmul(&k, &pool, &m, &act.bytes()[t * a_row..(t + 1) * a_row], 1, &mut one)
                    .unwrap();
                let batched = &all[t * rows..(t + 1) * rows];
                assert!(
                    one.iter().zip(batched).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} {math:?}: token {t} differs alone and batched"
                );
            }
        }
    }
}

#[test]
fn the_reference_is_the_product_up_to_rounding() {
    let mut rng = rng(93);
    let k = &levels()[0];
    for ty in TYPES {
        let (rows, cols) = (16, 576);
        let w = weights(&mut rng, ty, rows, cols);
        let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap();
        let act = activations(&mut rng, k, &m, 1);
        let mut wf = vec![0.0; cols];
        let mut af = vec![0.0; cols];
        // `Q8_1` is `Q8_0` plus the sum: the values are `d · q` for both.
        // ggml's `Q4_1` product takes the activation sum as the rounded f16 `s`: that part of
        // the difference from the exact product is the format's, so `sums` carries it.
        let (blocks, sums): (Vec<(f32, [i8; 32])>, Vec<f64>) = match m.act_ty() {
            GgmlType::Q8_1 => quant::cast_blocks::<quant::BlockQ8_1>(act.bytes())
                .unwrap()
                .iter()
                .map(|b| {
                    let exact: f64 =
                        b.qs.iter().map(|&q| f64::from(b.d.to_f32()) * f64::from(q)).sum();
                    ((b.d.to_f32(), b.qs), f64::from(b.s.to_f32()) - exact)
                })
                .unzip(),
            _ => quant::cast_blocks::<quant::BlockQ8_0>(act.bytes())
                .unwrap()
                .iter()
                .map(|b| ((b.d.to_f32(), b.qs), 0.0))
                .unzip(),
        };
        for (v, (d, qs)) in af.chunks_exact_mut(32).zip(&blocks) {
            v.iter_mut().zip(qs).for_each(|(v, &q)| *v = d * f32::from(q));
        }
        for r in 0..rows {
            m.dequantize_row(r, &mut wf).unwrap();
            let mut exact: f64 =
                wf.iter().zip(&af).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            if ty == GgmlType::Q4_1 {
                for (blk, ds) in m.row(r).chunks_exact(20).zip(&sums) {
                    exact += f64::from(half::f16::from_le_bytes([blk[2], blk[3]]).to_f32()) * ds;
                }
            }
            let mag: f64 =
                wf.iter().zip(&af).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
            let got = f64::from(lanes::dot_reference(ty, m.row(r), act.bytes()).unwrap());
            assert!(
                (got - exact).abs() <= 1e-5 * mag + 1e-6,
                "{ty} row {r}: {got} vs exact {exact} (magnitude {mag})"
            );
        }
    }
}

#[test]
fn repack_rejects_what_it_cannot_tile() {
    let mut rng = rng(94);
    let w = weights(&mut rng, GgmlType::Q4_1, 17, 64);
    assert!(LaneMatrix::repack(LaneMath::Exact, GgmlType::Q4_1, 17, 64, w.bytes()).is_err());
    let w16 = &w.bytes()[..16 * 2 * 20];
    assert!(
        LaneMatrix::repack(LaneMath::Exact, GgmlType::Q4_1, 16, 64, &w16[..w16.len() - 1]).is_err()
    );
    assert!(LaneMatrix::repack(LaneMath::Exact, GgmlType::Q4_K, 16, 256, w16).is_err());
    let lm = LaneMatrix::repack(LaneMath::Exact, GgmlType::Q4_1, 16, 64, w16).unwrap();
    let other = QMatrix::new(GgmlType::Q4_1, 8, 128, w16).unwrap();
    assert!(other.with_lanes(&lm).is_err());
}

#[test]
fn many_products_with_one_input_equal_one_product_each() {
    let mut rng = rng(95);
    let pool = ThreadPool::new(2).unwrap();
    for k in levels() {
        for repacked in [false, true] {
            let shapes = [(48, 576), (16, 576), (32, 576)];
            let ws: Vec<_> =
                shapes.iter().map(|&(r, c)| weights(&mut rng, GgmlType::Q4_1, r, c)).collect();
            let lms: Vec<_> = shapes
                .iter()
                .zip(&ws)
                .map(|(&(r, c), w)| {
                    LaneMatrix::repack(LaneMath::Exact, GgmlType::Q4_1, r, c, w.bytes()).unwrap()
                })
                .collect();
            let ms: Vec<QMatrix<'_>> = shapes
                .iter()
                .zip(&ws)
                .zip(&lms)
                .map(|((&(r, c), w), lm)| {
                    let m = QMatrix::new(GgmlType::Q4_1, r, c, w.bytes()).unwrap();
                    if repacked { m.with_lanes(lm).unwrap() } else { m }
                })
                .collect();
            for n_tok in [1usize, 5, 17, 66] {
                let act = activations(&mut rng, &k, &ms[0], n_tok);
                let mut one: Vec<Vec<f32>> =
                    shapes.iter().map(|&(r, _)| vec![0.0; r * n_tok]).collect();
                for (m, o) in ms.iter().zip(one.iter_mut()) {
                    ops::matmul(&k, &pool, m, act.bytes(), n_tok, o).unwrap();
                }
                let mut many: Vec<Vec<f32>> =
                    shapes.iter().map(|&(r, _)| vec![f32::NAN; r * n_tok]).collect();
                let [a, b, c] = &mut many[..] else { unreachable!() };
                ops::matmul_many(
                    &k,
                    &pool,
                    [&ms[0], &ms[1], &ms[2]],
                    act.bytes(),
                    n_tok,
                    [a, b, c],
                )
                .unwrap();
                for (x, y) in one.iter().zip(&many) {
                    assert!(
                        x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} repacked={repacked} {n_tok} tokens",
                        k.level
                    );
                }
            }
        }
    }
}

/// Matrices repacked together into one arena (as a model's are) each multiply exactly as
/// the same matrix repacked alone; an arena sized too small refuses the matrix that does
/// not fit, and a shape that does not match its data is refused before anything is written.
#[test]
fn matrices_sharing_an_arena_multiply_as_they_do_alone() {
    let mut rng = rng(94);
    let pool = ThreadPool::new(2).unwrap();
    for k in lane_levels() {
        let shapes =
            [(GgmlType::Q4_1, 192, 576), (GgmlType::Q8_0, 64, 96), (GgmlType::Q4_0, 48, 1536)];
        let ws: Vec<_> = shapes.iter().map(|&(ty, r, c)| weights(&mut rng, ty, r, c)).collect();
        let lines: usize = shapes
            .iter()
            .zip(&ws)
            .map(|(&(ty, r, c), w)| LaneMatrix::lines_for(ty, r, c, w.bytes().len()).unwrap())
            .sum();
        let mut arena = lanes::LaneArena::with_lines(lines);
        for (&(ty, r, c), w) in shapes.iter().zip(&ws) {
            arena.push(LaneMath::Exact, ty, r, c, w.bytes()).unwrap();
        }
        let shared = arena.finish();
        assert_eq!(shared.len(), shapes.len());
        for ((&(ty, rows, cols), w), lm) in shapes.iter().zip(&ws).zip(&shared) {
            let alone = LaneMatrix::repack(LaneMath::Exact, ty, rows, cols, w.bytes()).unwrap();
            assert_eq!(lm.bytes(), alone.bytes());
            let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap();
            let act = activations(&mut rng, &k, &m, 5);
            let mut got = vec![f32::NAN; 5 * rows];
            let mut want = vec![f32::NAN; 5 * rows];
            ops::matmul(&k, &pool, &m.with_lanes(lm).unwrap(), act.bytes(), 5, &mut got).unwrap();
            ops::matmul(&k, &pool, &m.with_lanes(&alone).unwrap(), act.bytes(), 5, &mut want)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{ty} {rows}x{cols} in a shared arena");
            assert_lanes(&k, LaneMath::Exact, &m, act.bytes(), 5, &got, "shared arena");
        }
        // Too small for the second matrix.
        let (ty, r, c) = shapes[0];
        let n = LaneMatrix::lines_for(ty, r, c, ws[0].bytes().len()).unwrap();
        let mut small = lanes::LaneArena::with_lines(n + 1);
        small.push(LaneMath::Exact, ty, r, c, ws[0].bytes()).unwrap();
        assert!(small.push(LaneMath::Exact, ty, r, c, ws[0].bytes()).is_err());
        assert_eq!(small.finish().len(), 1);
        // A shape that does not match the bytes.
        let mut arena = lanes::LaneArena::with_lines(n);
        assert!(arena.push(LaneMath::Exact, ty, r + 16, c, ws[0].bytes()).is_err());
    }
}

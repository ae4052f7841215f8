//! `ops::matmul` is bit-identical to the level's per-row dot products: for every weight type,
//! level, thread count and token count (1..=80, odd counts, partial tiles of rows and
//! tokens), output `(t, r)` has exactly the bits of `dot(W[r], x[t])` from the same table.
//! The dot products are themselves pinned to ggml's association (`ggml_order.rs`), so this
//! is what keeps the tiled matrix kernels llama.cpp-exact.

mod common;

use common::*;
use kvx_kernels::cpu::Kernels;
use kvx_kernels::gguf::GgmlType;
use kvx_kernels::ops::{self, MatmulScratch, QMatrix};
use kvx_kernels::par::ThreadPool;
use kvx_kernels::quant::QK_K;
use rand::Rng;

/// Asserts that `out` (`n_tok × rows`) holds exactly the per-row dot products.
fn assert_exact(k: &Kernels, m: &QMatrix<'_>, xq: &[u8], n_tok: usize, out: &[f32], what: &str) {
    let a_row = xq.len() / n_tok;
    for t in 0..n_tok {
        let a = &xq[t * a_row..(t + 1) * a_row];
        for r in 0..m.rows() {
            let want = dot(k, m.ty(), m.row(r), a);
            let got = out[t * m.rows() + r];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{what}: {} at {}, token {t} row {r}: {got} vs dot {want}",
                m.ty(),
                k.level
            );
        }
    }
}

const TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn pools() -> Vec<ThreadPool> {
    [1, 2, 3].iter().map(|&n| ThreadPool::new(n).unwrap()).collect()
}

#[test]
fn matmul_equals_the_dot_products_for_every_token_count() {
    let mut rng = rng(81);
    let pools = pools();
    for ty in TYPES {
        let (rows, cols) = if ty.block_size() == QK_K { (21, 512) } else { (21, 96) };
        let w = weights(&mut rng, ty, rows, cols);
        let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap();
        for k in levels() {
            let mut scratch = MatmulScratch::new();
            for n_tok in 1..=80 {
                let act = activations(&mut rng, &k, &m, n_tok);
                let pool = &pools[n_tok % pools.len()];
                let mut out = vec![f32::NAN; n_tok * rows];
                ops::matmul_with(&k, pool, &m, act.bytes(), n_tok, &mut out, &mut scratch).unwrap();
                assert_exact(&k, &m, act.bytes(), n_tok, &out, &format!("{n_tok} tokens"));
            }
        }
    }
}

#[test]
fn matmul_equals_the_dot_products_for_every_shape_and_thread_count() {
    let mut rng = rng(82);
    let pools = pools();
    for ty in TYPES {
        let shapes: &[(usize, usize)] = if ty.block_size() == QK_K {
            &[(1, 256), (9, 256), (33, 768)]
        } else {
            &[(1, 32), (2, 64), (5, 32), (7, 288), (8, 576), (17, 160), (64, 576), (67, 1536)]
        };
        for &(rows, cols) in shapes {
            let w = weights(&mut rng, ty, rows, cols);
            let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap();
            for k in levels() {
                for n_tok in [1usize, 2, 3, 5, 8, 9, 16, 17, 33] {
                    let act = activations(&mut rng, &k, &m, n_tok);
                    for pool in &pools {
                        let mut out = vec![f32::NAN; n_tok * rows];
                        ops::matmul(&k, pool, &m, act.bytes(), n_tok, &mut out).unwrap();
                        let what =
                            format!("{rows}x{cols}, {n_tok} tokens, {} threads", pool.n_threads());
                        assert_exact(&k, &m, act.bytes(), n_tok, &out, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn a_reserved_scratch_is_reused_across_sizes() {
    let mut rng = rng(83);
    let pool = ThreadPool::new(2).unwrap();
    for k in levels() {
        let w = weights(&mut rng, GgmlType::Q4_1, 40, 576);
        let m = QMatrix::new(GgmlType::Q4_1, 40, 576, w.bytes()).unwrap();
        let mut scratch = MatmulScratch::for_matrix(&k, &m, 64);
        let before = format!("{scratch:?}");
        // Large, small, one token, large again: always exact, never grown past the reserve.
        for n_tok in [64usize, 3, 1, 2, 64, 17] {
            let act = activations(&mut rng, &k, &m, n_tok);
            let mut out = vec![f32::NAN; n_tok * 40];
            ops::matmul_with(&k, &pool, &m, act.bytes(), n_tok, &mut out, &mut scratch).unwrap();
            assert_exact(&k, &m, act.bytes(), n_tok, &out, "reused scratch");
        }
        assert_eq!(format!("{scratch:?}"), before, "the reserved scratch grew");
    }
}

#[test]
fn zero_scales_and_extreme_activations_stay_exact() {
    let mut rng = rng(84);
    let pool = ThreadPool::new(1).unwrap();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (13, 128);
        let mut w = weights(&mut rng, ty, rows, cols);
        // Every third row all zero bytes (zero scales, zero quants).
        let row_bytes = w.bytes().len() / rows;
        for r in (0..rows).step_by(3) {
            w.bytes_mut()[r * row_bytes..(r + 1) * row_bytes].fill(0);
        }
        let m = QMatrix::new(ty, rows, cols, w.bytes()).unwrap();
        for k in levels() {
            for n_tok in [1usize, 2, 7, 12] {
                let cols = m.cols();
                // Activations at ±127 quants: the largest integer lane sums.
                let x: Vec<f32> = (0..n_tok * cols)
                    .map(|i| if rng.random::<bool>() { 5.0 } else { -5.0 } * (1 + i % 3) as f32)
                    .collect();
                let mut act =
                    Aligned::zeroed(ops::activation_bytes(m.act_ty(), cols, n_tok).unwrap());
                ops::quantize_activations(&k, m.act_ty(), &x, cols, act.bytes_mut()).unwrap();
                let mut out = vec![f32::NAN; n_tok * rows];
                ops::matmul(&k, &pool, &m, act.bytes(), n_tok, &mut out).unwrap();
                assert_exact(&k, &m, act.bytes(), n_tok, &out, "extremes");
            }
        }
    }
}

#[test]
fn gemm_covers_the_default_model_types_at_simd_levels() {
    for k in levels() {
        let simd = k.level != kvx_kernels::cpu::SimdLevel::Scalar;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            assert_eq!(k.gemm.has(ty), simd, "{ty} at {}", k.level);
        }
    }
}

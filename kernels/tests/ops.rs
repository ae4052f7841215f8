//! Parity of the tensor ops with direct f64 formulas, at every kernel level this CPU
//! supports: `matmul` against a naive matrix product of the dequantized weights and the
//! dequantized quantized activations, paged `attention` against `attention_reference`,
//! rope against the rotation written out in f64, and `quantize_activations` against the
//! scalar codecs row by row.
//!
//! Tolerances are derived from the rounding each op is allowed (f32 sums, f16 roundings of
//! the attention query and probabilities, f32 angles), not tuned to the results.

mod common;

use bytemuck::Zeroable;
use common::*;
use half::f16;
use kvx_kernels::KernelError;
use kvx_kernels::cpu::Kernels;
use kvx_kernels::gguf::GgmlType;
use kvx_kernels::ops::{self, AttnMode, AttnScratch, PagedHead, QMatrix};
use kvx_kernels::par::ThreadPool;
use kvx_kernels::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use kvx_kernels::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const EPS: f64 = f32::EPSILON as f64;

/// A weight matrix in `ty`, with what the error bound needs: per element, the magnitude of
/// the offset the kernels add and take back out (`|m|` for `Q4_1`, `|dmin · min|` for
/// `Q4_K`, 64 quant steps for `Q6_K`), and per block the `|m|` that multiplies the
/// activations' rounded `s` (`Q4_1`).
struct Weights {
    data: Aligned,
    offset: Vec<f64>,
    q4_1_m: Vec<f64>,
}

fn make_weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Weights {
    let w = randv(rng, rows * cols);
    let n = rows * cols;
    let mut offset = vec![0.0; n];
    let mut q4_1_m = vec![];
    let data = match ty {
        GgmlType::Q4_0 => {
            let mut b = vec![BlockQ4_0::zeroed(); n / 32];
            quant::weights::quantize_q4_0(&w, &mut b);
            Aligned::from_pod(&b)
        }
        GgmlType::Q4_1 => {
            let mut b = vec![BlockQ4_1::zeroed(); n / 32];
            quant::weights::quantize_q4_1(&w, &mut b);
            for (i, b) in b.iter().enumerate() {
                let m = f64::from(b.m.to_f32()).abs();
                offset[32 * i..32 * i + 32].fill(m);
                q4_1_m.push(m);
            }
            Aligned::from_pod(&b)
        }
        GgmlType::Q8_0 => {
            let mut b = vec![BlockQ8_0::zeroed(); n / 32];
            quant::weights::quantize_q8_0(&w, &mut b);
            Aligned::from_pod(&b)
        }
        GgmlType::Q4_K => {
            let mut b = vec![BlockQ4K::zeroed(); n / QK_K];
            quant_k::weights::quantize_q4_k(&w, &mut b);
            for (i, b) in b.iter().enumerate() {
                for sub in 0..8 {
                    let (_, m) = quant_k::scale_min_k4(sub, &b.scales);
                    let o = (f64::from(b.dmin.to_f32()) * f64::from(m)).abs();
                    offset[QK_K * i + 32 * sub..QK_K * i + 32 * sub + 32].fill(o);
                }
            }
            Aligned::from_pod(&b)
        }
        GgmlType::Q6_K => {
            let mut b = vec![BlockQ6K::zeroed(); n / QK_K];
            quant_k::weights::quantize_q6_k(&w, &mut b);
            // The quants are stored +32 and the SIMD kernels (as ggml's) take the offset back
            // out through the activations' group sums, in other lanes: their f32 rounding
            // scales with 64 quant steps per element, not with the weight.
            for (i, b) in b.iter().enumerate() {
                for (g, &sc) in b.scales.iter().enumerate() {
                    let o = 64.0 * (f64::from(b.d.to_f32()) * f64::from(sc)).abs();
                    offset[QK_K * i + 16 * g..QK_K * i + 16 * g + 16].fill(o);
                }
            }
            Aligned::from_pod(&b)
        }
        GgmlType::F16 => {
            Aligned::from_pod(&w.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())
        }
        GgmlType::BF16 => {
            Aligned::from_pod(&w.iter().map(|&v| quant_k::f32_to_bf16(v)).collect::<Vec<_>>())
        }
        _ => Aligned::from_pod(&w),
    };
    Weights { data, offset, q4_1_m }
}

/// Dequantizes `n_rows` activation rows of `cols` elements stored in `act_ty`.
fn dequantize_activations(act_ty: GgmlType, xq: &[u8], cols: usize, n_rows: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; cols * n_rows];
    let row = act_ty.row_size(cols as u64).unwrap() as usize;
    for (src, dst) in xq.chunks_exact(row).zip(out.chunks_exact_mut(cols)) {
        match act_ty {
            GgmlType::Q8_0 => quant::dequantize_q8_0(bytemuck::cast_slice(src), dst),
            GgmlType::Q8_1 => quant::dequantize_q8_1(bytemuck::cast_slice(src), dst),
            GgmlType::Q8_K => quant_k::dequantize_q8_k(bytemuck::cast_slice(src), dst),
            other => quant::dequantize_row(other, src, dst).unwrap(),
        }
    }
    out
}

/// `s` of every `Q8_1` activation block and `d * sum(q)`, for the bound of the `Q4_1` min term.
fn q8_1_s_error(xq: &[u8]) -> Vec<f64> {
    let blocks: &[BlockQ8_1] = bytemuck::cast_slice(xq);
    blocks
        .iter()
        .map(|b| {
            let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
            let exact = f64::from(b.d.to_f32()) * f64::from(sum);
            // f16 rounding of s: half an ulp relative, or an absolute step among subnormals.
            (f64::from(b.s.to_f32()) - exact).abs().max(exact.abs() / 2048.0 + 6e-8)
        })
        .collect()
}

const WEIGHT_TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

#[test]
fn matmul_matches_naive_f64_product_for_every_weight_type() {
    let mut rng = rng(61);
    let pools: Vec<ThreadPool> = [1, 2, 3].iter().map(|&n| ThreadPool::new(n).unwrap()).collect();
    for ty in WEIGHT_TYPES {
        let k_quant = ty.block_size() == QK_K;
        let shapes: &[(usize, usize)] = if k_quant {
            &[(1, 256), (13, 256), (64, 512), (33, 768)]
        } else {
            &[(1, 32), (5, 64), (13, 256), (64, 576), (33, 768)]
        };
        for &(rows, cols) in shapes {
            let w = make_weights(&mut rng, ty, rows, cols);
            let m = QMatrix::new(ty, rows, cols, w.data.bytes()).unwrap();
            let mut wd = vec![0.0f32; rows * cols];
            for (r, dst) in wd.chunks_exact_mut(cols).enumerate() {
                m.dequantize_row(r, dst).unwrap();
            }
            for n_tok in [1usize, 3, 16] {
                let x = randv(&mut rng, n_tok * cols);
                for k in levels() {
                    let act_len = ops::activation_bytes(m.act_ty(), cols, n_tok).unwrap();
                    let mut act = Aligned::zeroed(act_len);
                    let xq = ops::quantize_activations(&k, m.act_ty(), &x, cols, act.bytes_mut())
                        .unwrap()
                        .to_vec();
                    let xd = dequantize_activations(m.act_ty(), &xq, cols, n_tok);
                    let s_err = if ty == GgmlType::Q4_1 { q8_1_s_error(&xq) } else { vec![] };
                    for pool in &pools {
                        let mut out = vec![f32::NAN; n_tok * rows];
                        ops::matmul(&k, pool, &m, &xq, n_tok, &mut out).unwrap();
                        check_matmul(ty, &k, pool, rows, cols, n_tok, &wd, &xd, &w, &s_err, &out);
                    }
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_matmul(
    ty: GgmlType,
    k: &Kernels,
    pool: &ThreadPool,
    rows: usize,
    cols: usize,
    n_tok: usize,
    wd: &[f32],
    xd: &[f32],
    w: &Weights,
    s_err: &[f64],
    out: &[f32],
) {
    // Quantized rows add one f32 term per block; float rows one per element (worst case).
    let chain = if ty.block_size() > 1 { cols / ty.block_size() } else { cols } as f64 + 16.0;
    for t in 0..n_tok {
        let x = &xd[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let wr = &wd[r * cols..(r + 1) * cols];
            let off = &w.offset[r * cols..(r + 1) * cols];
            let mut exact = 0.0f64;
            let mut mag = 0.0f64;
            for i in 0..cols {
                let (a, b) = (f64::from(wr[i]), f64::from(x[i]));
                exact += a * b;
                mag += (a.abs() + off[i]) * b.abs();
            }
            let mut bound = chain * 4.0 * EPS * mag + 1e-30;
            if ty == GgmlType::Q4_1 {
                let nb = cols / 32;
                for b in 0..nb {
                    bound += w.q4_1_m[r * nb + b] * s_err[t * nb + b];
                }
            }
            let got = f64::from(out[t * rows + r]);
            assert!(
                (got - exact).abs() <= bound,
                "{ty} {rows}x{cols} n_tok={n_tok} pool={} at {}: out[{t}][{r}] = {got}, naive {exact}, bound {bound:e}",
                pool.n_threads(),
                k.level
            );
        }
    }
}

#[test]
fn matmul_rejects_mismatched_operands() {
    let k = levels().pop().unwrap();
    let pool = ThreadPool::new(2).unwrap();
    let w = Aligned::from_pod(&vec![BlockQ8_0::zeroed(); 4 * 2]);
    let m = QMatrix::new(GgmlType::Q8_0, 4, 64, w.bytes()).unwrap();
    let xq = vec![0u8; 2 * 34];
    let mut out = vec![0.0; 4];
    assert!(ops::matmul(&k, &pool, &m, &xq, 1, &mut out).is_ok());
    assert!(matches!(
        ops::matmul(&k, &pool, &m, &xq[..67], 1, &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        ops::matmul(&k, &pool, &m, &xq, 1, &mut out[..3]),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(ops::matmul(&k, &pool, &m, &xq, 2, &mut out), Err(KernelError::Shape(_))));
    assert!(ops::matmul(&k, &pool, &m, &[], 0, &mut []).is_ok());
    // Matrices whose bytes do not fit their shape, or types without kernels.
    assert!(QMatrix::new(GgmlType::Q8_0, 5, 64, w.bytes()).is_err());
    assert!(QMatrix::new(GgmlType::Q8_0, 4, 48, w.bytes()).is_err());
    assert!(QMatrix::new(GgmlType::Q4_K, 1, 64, w.bytes()).is_err());
    assert!(matches!(
        QMatrix::new(GgmlType::Q5_0, 4, 64, &w.bytes()[..4 * 2 * 22]),
        Err(KernelError::UnsupportedType(GgmlType::Q5_0))
    ));
}

// ---------------------------------------------------------------------------------------------
// quantize_activations
// ---------------------------------------------------------------------------------------------

/// One row in `act_ty` by the scalar codecs.
fn reference_row(act_ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let n = x.len();
    match act_ty {
        GgmlType::Q8_0 => {
            let mut b = vec![BlockQ8_0::zeroed(); n / 32];
            quant::quantize_q8_0(x, &mut b);
            bytemuck::cast_slice(&b).to_vec()
        }
        GgmlType::Q8_1 => {
            let mut b = vec![BlockQ8_1::zeroed(); n / 32];
            quant::quantize_q8_1(x, &mut b);
            bytemuck::cast_slice(&b).to_vec()
        }
        GgmlType::Q8_K => {
            let mut b = vec![BlockQ8K::zeroed(); n / QK_K];
            quant_k::quantize_q8_k(x, &mut b);
            bytemuck::cast_slice(&b).to_vec()
        }
        GgmlType::F16 => x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        GgmlType::BF16 => x.iter().flat_map(|&v| quant_k::f32_to_bf16(v).to_le_bytes()).collect(),
        _ => x.iter().flat_map(|&v| v.to_le_bytes()).collect(),
    }
}

#[test]
fn quantize_activations_matches_the_scalar_codecs_row_by_row() {
    let mut rng = rng(62);
    let act_types = [
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q8_K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ];
    for k in levels() {
        for act_ty in act_types {
            for (cols, n_rows) in [(256usize, 1usize), (256, 3), (512, 2), (1536, 4)] {
                let x = randv(&mut rng, cols * n_rows);
                let need = ops::activation_bytes(act_ty, cols, n_rows).unwrap();
                // A larger buffer than needed: only the returned prefix is the activations.
                let mut buf = Aligned::zeroed(need + 64);
                let got = ops::quantize_activations(&k, act_ty, &x, cols, buf.bytes_mut()).unwrap();
                assert_eq!(got.len(), need);
                let want: Vec<u8> =
                    x.chunks_exact(cols).flat_map(|r| reference_row(act_ty, r)).collect();
                assert!(
                    got == want.as_slice(),
                    "{act_ty} cols={cols} rows={n_rows} at {}",
                    k.level
                );
            }
        }
    }
}

#[test]
fn quantize_activations_rejects_bad_shapes() {
    let k = levels().pop().unwrap();
    let x = vec![0.5f32; 512];
    let mut buf = Aligned::zeroed(4096);
    let shape = |r: Result<&[u8], KernelError>| matches!(r, Err(KernelError::Shape(_)));
    assert!(shape(ops::quantize_activations(&k, GgmlType::Q8_0, &x, 0, buf.bytes_mut())));
    assert!(shape(ops::quantize_activations(&k, GgmlType::Q8_0, &x, 300, buf.bytes_mut())));
    assert!(shape(ops::quantize_activations(&k, GgmlType::Q8_0, &x[..48], 48, buf.bytes_mut())));
    assert!(shape(ops::quantize_activations(
        &k,
        GgmlType::Q8_K,
        &x,
        512,
        &mut buf.bytes_mut()[..500]
    )));
    assert!(shape(ops::quantize_activations(
        &k,
        GgmlType::Q8_0,
        &x,
        256,
        &mut buf.bytes_mut()[1..]
    )));
    assert!(matches!(
        ops::quantize_activations(&k, GgmlType::Q4_0, &x, 256, buf.bytes_mut()),
        Err(KernelError::UnsupportedType(GgmlType::Q4_0))
    ));
}

// ---------------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------------

#[test]
fn rope_matches_the_rotation_in_f64() {
    let mut rng = rng(63);
    let head_dim = 64;
    for n_dims in [64usize, 32] {
        for base in [10_000.0f32, 100_000.0] {
            for with_factors in [false, true] {
                let factors: Vec<f32> =
                    (0..n_dims / 2).map(|_| rng.random_range(1.0f32..8.0)).collect();
                let ff = with_factors.then_some(factors.as_slice());
                for pos in [0u32, 1, 7, 300, 4095, 32767] {
                    let mut cache = vec![0.0f32; n_dims];
                    ops::rope_cache(pos, n_dims, base, ff, &mut cache);
                    let x = randv(&mut rng, head_dim);
                    for neox in [false, true] {
                        let mut y = x.clone();
                        if neox {
                            ops::rope_neox(&mut y, &cache, n_dims);
                        } else {
                            ops::rope_norm(&mut y, &cache, n_dims);
                        }
                        for i in 0..n_dims / 2 {
                            // θ_i = pos · base^(-2i / n_dims) / factor_i.
                            let f = ff.map_or(1.0, |f| f64::from(f[i]));
                            let theta = f64::from(pos)
                                * f64::from(base).powf(-2.0 * i as f64 / n_dims as f64)
                                / f;
                            let (a, b) =
                                if neox { (i, i + n_dims / 2) } else { (2 * i, 2 * i + 1) };
                            let (x0, x1) = (f64::from(x[a]), f64::from(x[b]));
                            let want0 = x0 * theta.cos() - x1 * theta.sin();
                            let want1 = x0 * theta.sin() + x1 * theta.cos();
                            // ggml builds θ by i products with an f32 base^(-2/n): about
                            // (3i + 4) ε relative, plus the f32 cos/sin and products.
                            let dtheta = (3.0 * i as f64 + 4.0) * EPS * theta;
                            let bound = (x0.abs() + x1.abs()) * (dtheta + 4.0 * EPS);
                            for (got, want) in [(y[a], want0), (y[b], want1)] {
                                assert!(
                                    (f64::from(got) - want).abs() <= bound,
                                    "rope neox={neox} n_dims={n_dims} base={base} pos={pos} i={i}: {got} vs {want}"
                                );
                            }
                        }
                        // Dimensions past n_dims are not rotated.
                        assert_eq!(&y[n_dims..], &x[n_dims..]);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------------------------

/// A layer's paged cache `[block][kv_head][slot][head_dim]` with random contents, and a
/// random block table for a sequence of `n_pos` positions.
struct Cache {
    keys: Vec<f16>,
    values: Vec<f16>,
    table: Vec<u32>,
}

impl Cache {
    /// The keys and values of KV head `kv_head` of `n_kv`, `hd` wide, in blocks of
    /// `block_size` slots.
    fn heads(
        &self,
        block_size: usize,
        n_kv: usize,
        hd: usize,
        kv_head: usize,
    ) -> (PagedHead<'_>, PagedHead<'_>) {
        let head = |data| PagedHead {
            data,
            block_table: &self.table,
            block_size,
            block_stride: n_kv * block_size * hd,
            head_dim: hd,
            kv_head,
        };
        (head(&self.keys[..]), head(&self.values[..]))
    }
}

fn make_cache(rng: &mut StdRng, n_pos: usize, block_size: usize, n_kv: usize, hd: usize) -> Cache {
    let used = n_pos.div_ceil(block_size);
    let n_blocks = used + 3;
    let len = n_blocks * n_kv * block_size * hd;
    let keys = randv(rng, len).iter().map(|&v| f16::from_f32(v)).collect();
    let values = randv(rng, len).iter().map(|&v| f16::from_f32(v)).collect();
    let mut all: Vec<u32> = (0..n_blocks as u32).collect();
    all.shuffle(rng);
    Cache { keys, values, table: all[..used].to_vec() }
}

#[test]
fn paged_attention_matches_reference() {
    let mut rng = rng(64);
    let (n_heads, n_kv, hd) = (6usize, 2usize, 64usize);
    let scale = 1.0 / (hd as f32).sqrt();
    for k in levels() {
        for block_size in [1usize, 16, 32] {
            for n_pos in [1usize, 2, 15, 16, 17, 33, 100, 300] {
                let c = make_cache(&mut rng, n_pos, block_size, n_kv, hd);
                let mut sc = AttnScratch::new(hd, 300);
                for h in 0..n_heads {
                    // Grouped-query attention: query head h reads KV head h / (n_heads / n_kv).
                    let kv_head = h / (n_heads / n_kv);
                    let head = |data| PagedHead {
                        data,
                        block_table: &c.table,
                        block_size,
                        block_stride: n_kv * block_size * hd,
                        head_dim: hd,
                        kv_head,
                    };
                    let (keys, values) = (head(&c.keys[..]), head(&c.values[..]));
                    let q: Vec<f32> = randv(&mut rng, hd).iter().map(|v| v * 1.5).collect();
                    let mut want = vec![0.0f32; hd];
                    ops::attention_reference(&q, &keys, &values, n_pos, scale, &mut want).unwrap();
                    let bound = attention_bound(&q, &keys, &values, n_pos, scale);
                    for mode in [AttnMode::Decode, AttnMode::Prefill] {
                        let mut got = vec![f32::NAN; hd];
                        ops::attention(
                            &k, mode, &q, &keys, &values, n_pos, scale, &mut sc, &mut got,
                        )
                        .unwrap();
                        for d in 0..hd {
                            assert!(
                                (f64::from(got[d]) - f64::from(want[d])).abs() <= bound[d],
                                "attention {mode:?} at {} bs={block_size} n_pos={n_pos} head={h} d={d}: {} vs {} (bound {:e})",
                                k.level,
                                got[d],
                                want[d],
                                bound[d]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The fused one-head kernels ([`Kernels::attn_head`]) against the generic path they replace,
/// bit for bit: both modes, head sizes with and without the fused shapes, block sizes that
/// do and do not divide the steps, lengths around multiples of 16 and 64, grouped heads,
/// queries that produce large, tiny and negative-zero scores.
#[test]
fn fused_attention_is_bit_identical_to_the_generic_path() {
    let mut rng = rng(65);
    let mut fused_runs = 0;
    for k in levels() {
        let Some(fused) = k.attn_head else { continue };
        for hd in [32usize, 64, 128, 80] {
            let scale = 1.0 / (hd as f32).sqrt();
            for block_size in [1usize, 7, 16, 32] {
                for n_pos in [1usize, 2, 15, 16, 17, 63, 64, 65, 100, 257] {
                    let n_kv = 2;
                    let c = make_cache(&mut rng, n_pos, block_size, n_kv, hd);
                    let mut sc = AttnScratch::new(hd, 300);
                    let mut sc2 = AttnScratch::new(hd, 300);
                    for h in 0..4 {
                        let (keys, values) = c.heads(block_size, n_kv, hd, h / 2);
                        let q: Vec<f32> = match h {
                            // A zero query: every score is a (signed) zero.
                            0 => vec![0.0; hd],
                            1 => randv(&mut rng, hd).iter().map(|v| v * 8.0).collect(),
                            2 => randv(&mut rng, hd).iter().map(|v| v * 1e-3).collect(),
                            _ => randv(&mut rng, hd),
                        };
                        for mode in [AttnMode::Decode, AttnMode::Prefill] {
                            let mut want = vec![f32::NAN; hd];
                            ops::attention_generic(
                                &k, mode, &q, &keys, &values, n_pos, scale, &mut sc, &mut want,
                            )
                            .unwrap();
                            let mut got = vec![f32::NAN; hd];
                            let job = ops::AttnHeadJob {
                                mode,
                                q: &q,
                                heads: 1,
                                keys: &keys,
                                values: &values,
                                n_pos,
                                scale,
                                softmax: k.softmax,
                                next: None,
                            };
                            if !fused(&job, &mut sc2, &mut got) {
                                // Shapes the kernel leaves to the generic path: 64-multiples
                                // are always covered, 16-multiples in prefill.
                                let covered =
                                    hd % 64 == 0 || (mode == AttnMode::Prefill && hd % 16 == 0);
                                assert!(!covered, "{} {mode:?} hd={hd} not fused", k.level);
                                assert!(got.iter().all(|v| v.is_nan()), "wrote nothing");
                                continue;
                            }
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{} {mode:?} hd={hd} bs={block_size} n_pos={n_pos} head={h}",
                                k.level
                            );
                            fused_runs += 1;
                        }
                    }
                }
            }
        }
    }
    if kvx_kernels::cpu::SimdLevel::detect() == kvx_kernels::cpu::SimdLevel::Avx512 {
        assert!(fused_runs > 0, "the AVX-512 table has a fused attention kernel");
    }
}

/// `attention_group` (the fused kernel with each key and value loaded once for the group's
/// heads) gives every head exactly the bits of `attention_generic` for that head alone.
#[test]
fn grouped_attention_is_bit_identical_per_head() {
    let mut rng = rng(66);
    for k in levels() {
        for hd in [64usize, 128, 32] {
            let scale = 1.0 / (hd as f32).sqrt();
            for block_size in [7usize, 16] {
                for n_pos in [1usize, 17, 64, 100, 257] {
                    let c = make_cache(&mut rng, n_pos, block_size, 2, hd);
                    let mut sc = AttnScratch::new(hd, 300);
                    let mut sc2 = AttnScratch::new(hd, 300);
                    let (keys, values) = c.heads(block_size, 2, hd, 1);
                    for heads in 1..=5 {
                        let q = randv(&mut rng, heads * hd);
                        for mode in [AttnMode::Decode, AttnMode::Prefill] {
                            // With the next unit's rows to fetch (this one's, shifted; rows
                            // past the cache are skipped): a hint, without effect on results.
                            let next = ops::NextRows { keys, values, n_pos: n_pos + 40 };
                            let (kv, at) = ((&keys, &values), (n_pos, scale));
                            let got =
                                group(&k, false, mode, &q, heads, kv, at, Some(&next), &mut sc);
                            for (g, (qh, got)) in
                                q.chunks_exact(hd).zip(got.chunks_exact(hd)).enumerate()
                            {
                                let mut want = vec![f32::NAN; hd];
                                ops::attention_generic(
                                    &k, mode, qh, &keys, &values, n_pos, scale, &mut sc2, &mut want,
                                )
                                .unwrap();
                                let bits =
                                    |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                                assert_eq!(
                                    bits(got),
                                    bits(&want),
                                    "{} {mode:?} hd={hd} bs={block_size} n_pos={n_pos} {heads} heads, head {g}",
                                    k.level
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `ops::attention_group`'s output for `heads` query heads against `kv` (keys, values) at
/// `at` (positions, scale).
#[allow(clippy::too_many_arguments)]
fn group(
    k: &Kernels,
    free: bool,
    mode: AttnMode,
    q: &[f32],
    heads: usize,
    kv: (&PagedHead<'_>, &PagedHead<'_>),
    at: (usize, f32),
    next: Option<&ops::NextRows<'_>>,
    sc: &mut AttnScratch,
) -> Vec<f32> {
    let (keys, values) = kv;
    let mut out = vec![f32::NAN; heads * values.head_dim];
    ops::attention_group(k, free, mode, q, heads, keys, values, at.0, at.1, next, sc, &mut out)
        .unwrap();
    out
}

/// Tiles of a prompt's consecutive tokens ([`ops::attention_tile_free`]): every token of a
/// tile of 1 to [`ops::ATTN_TILE`] tokens gets the bits the free kernel gives it alone, for 1
/// to 4 heads, block sizes that do and do not divide 16, first tokens on both sides of the
/// 16-key chunks, scratch reused from call to call, and values laid out as the keys are or
/// not (another KV head's rows); head sizes the tile kernel does not take write nothing.
#[test]
fn free_attention_tiles_give_each_token_its_own_bits() {
    let mut rng = rng(71);
    let mut tiled = 0;
    for k in levels() {
        for hd in [64usize, 32] {
            let scale = 1.0 / (hd as f32).sqrt();
            for block_size in [1usize, 7, 16] {
                for n0 in [1usize, 2, 14, 15, 16, 17, 31, 64, 100, 253] {
                    let c = make_cache(&mut rng, n0 + ops::ATTN_TILE, block_size, 2, hd);
                    let mut sc = AttnScratch::new(hd, 300);
                    let mut sc2 = AttnScratch::new(hd, 300);
                    let (keys, same) = c.heads(block_size, 2, hd, 1);
                    let (_, apart) = c.heads(block_size, 2, hd, 0);
                    for (heads, values) in (1..=4).flat_map(|h| [(h, same), (h, apart)]) {
                        for tokens in 1..=ops::ATTN_TILE {
                            let qs: Vec<Vec<f32>> = (0..ops::ATTN_TILE)
                                .map(|j| {
                                    randv(&mut rng, heads * hd)
                                        .iter()
                                        .map(|v| v * (1 + j) as f32)
                                        .collect()
                                })
                                .collect();
                            let job = ops::AttnTileJob {
                                q: std::array::from_fn(|j| &qs[j][..]),
                                tokens,
                                heads,
                                keys: &keys,
                                values: &values,
                                n0,
                                scale,
                                softmax: k.softmax,
                            };
                            let mut outs = vec![vec![f32::NAN; heads * hd]; tokens];
                            let mut views: Vec<&mut [f32]> =
                                outs.iter_mut().map(|o| &mut o[..]).collect();
                            if !ops::attention_tile_free(&k, &job, &mut sc, &mut views) {
                                assert!(
                                    outs.iter().flatten().all(|v| v.is_nan()),
                                    "nothing written"
                                );
                                continue;
                            }
                            tiled += 1;
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            for (j, got) in outs.iter().enumerate() {
                                let at = (n0 + j, scale);
                                let want = group(
                                    &k,
                                    true,
                                    AttnMode::Prefill,
                                    &qs[j],
                                    heads,
                                    (&keys, &values),
                                    at,
                                    None,
                                    &mut sc2,
                                );
                                assert_eq!(
                                    bits(got),
                                    bits(&want),
                                    "{} hd={hd} bs={block_size} n0={n0} {heads} heads, token {j} of {tokens}",
                                    k.level
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    if Kernels::for_level(kvx_kernels::cpu::SimdLevel::Avx512)
        .is_some_and(|k| k.attn_free_tile.is_some())
    {
        assert!(tiled > 0, "the tile kernel ran");
    }
}

/// The free association ([`ops::attention_group`] with `free`, the non-exact arithmetics): the
/// level's fused kernel gives every head of a group the bits of [`ops::attention_free_twin`]
/// for that head alone, in both modes (one association for prompts and decode), over head
/// sizes the kernel covers and does not, block sizes that do and do not divide 16, lengths
/// around multiples of 16, with the next unit's rows named; and the twin itself is nearer the
/// exact f64 attention than ggml's association is allowed to be (no f16 roundings).
#[test]
fn free_attention_is_bit_identical_to_its_twin_and_near_the_exact_math() {
    let mut rng = rng(67);
    let mut fused_runs = 0;
    for k in levels() {
        for hd in [16usize, 64, 128, 80, 256, 40] {
            let scale = 1.0 / (hd as f32).sqrt();
            for block_size in [1usize, 7, 16] {
                for n_pos in [1usize, 2, 15, 16, 17, 64, 100, 257] {
                    let c = make_cache(&mut rng, n_pos, block_size, 2, hd);
                    let mut sc = AttnScratch::new(hd, 300);
                    let mut sc2 = AttnScratch::new(hd, 300);
                    let (keys, values) = c.heads(block_size, 2, hd, 1);
                    for heads in 1..=4 {
                        let q: Vec<f32> = match heads {
                            2 => randv(&mut rng, heads * hd).iter().map(|v| v * 8.0).collect(),
                            _ => randv(&mut rng, heads * hd),
                        };
                        let next = ops::NextRows { keys, values, n_pos: n_pos + 40 };
                        let mut by_mode = Vec::new();
                        let (kv, at) = ((&keys, &values), (n_pos, scale));
                        for mode in [AttnMode::Decode, AttnMode::Prefill] {
                            by_mode.push(group(
                                &k,
                                true,
                                mode,
                                &q,
                                heads,
                                kv,
                                at,
                                Some(&next),
                                &mut sc,
                            ));
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        // Where the level has no kernel for the shape: ggml's association.
                        let fused = k.attn_free.is_some() && hd % 16 == 0;
                        if !fused {
                            for (mode, got) in
                                [AttnMode::Decode, AttnMode::Prefill].iter().zip(&by_mode)
                            {
                                let want =
                                    group(&k, false, *mode, &q, heads, kv, at, None, &mut sc2);
                                assert_eq!(bits(got), bits(&want), "{} hd={hd}", k.level);
                            }
                        } else {
                            assert_eq!(bits(&by_mode[0]), bits(&by_mode[1]), "{} hd={hd}", k.level);
                        }
                        for (g, (qh, got)) in
                            q.chunks_exact(hd).zip(by_mode[0].chunks_exact(hd)).enumerate()
                        {
                            let mut want = vec![f32::NAN; hd];
                            ops::attention_free_twin(
                                &k, qh, &keys, &values, n_pos, scale, &mut sc2, &mut want,
                            )
                            .unwrap();
                            if fused {
                                assert_eq!(
                                    bits(got),
                                    bits(&want),
                                    "{} hd={hd} bs={block_size} n_pos={n_pos} {heads} heads, head {g}",
                                    k.level
                                );
                                fused_runs += 1;
                            }
                            let mut exact = vec![0.0f32; hd];
                            ops::attention_reference(qh, &keys, &values, n_pos, scale, &mut exact)
                                .unwrap();
                            let bound = free_attention_bound(qh, &keys, &values, n_pos, scale);
                            for d in 0..hd {
                                let err = (f64::from(want[d]) - f64::from(exact[d])).abs();
                                assert!(
                                    err <= bound[d],
                                    "{} hd={hd} n_pos={n_pos} d={d}: {} vs {} (bound {:e})",
                                    k.level,
                                    want[d],
                                    exact[d],
                                    bound[d]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    if kvx_kernels::cpu::SimdLevel::detect() == kvx_kernels::cpu::SimdLevel::Avx512 {
        assert!(fused_runs > 0, "the AVX-512 table has a free attention kernel");
    }
}

/// The free kernel when the values do not share the keys' layout (another head size, block
/// table and cache): the same bits as the twin, head by head.
#[test]
fn free_attention_with_values_laid_out_apart_matches_its_twin() {
    let mut rng = rng(68);
    for k in levels() {
        // (64, 40): values the free kernel does not take, so the group is ggml's.
        for (hd, vd) in [(64usize, 32usize), (64, 64), (32, 80), (64, 40)] {
            let scale = 1.0 / (hd as f32).sqrt();
            for n_pos in [1usize, 16, 33, 200] {
                let kc = make_cache(&mut rng, n_pos, 16, 2, hd);
                let vc = make_cache(&mut rng, n_pos, 16, 2, vd);
                let keys = PagedHead {
                    data: &kc.keys,
                    block_table: &kc.table,
                    block_size: 16,
                    block_stride: 2 * 16 * hd,
                    head_dim: hd,
                    kv_head: 1,
                };
                let values = PagedHead {
                    data: &vc.values,
                    block_table: &vc.table,
                    block_size: 16,
                    block_stride: 2 * 16 * vd,
                    head_dim: vd,
                    kv_head: 0,
                };
                let heads = 3;
                let q = randv(&mut rng, heads * hd);
                let (mut sc, mut sc2) =
                    (AttnScratch::new(hd.max(vd), 300), AttnScratch::new(hd.max(vd), 300));
                let (kv, at) = ((&keys, &values), (n_pos, scale));
                let got = group(&k, true, AttnMode::Decode, &q, heads, kv, at, None, &mut sc);
                for (g, (qh, got)) in q.chunks_exact(hd).zip(got.chunks_exact(vd)).enumerate() {
                    let mut want = vec![f32::NAN; vd];
                    if ops::attention_free_covers(&k, hd) && vd % 16 == 0 {
                        ops::attention_free_twin(
                            &k, qh, &keys, &values, n_pos, scale, &mut sc2, &mut want,
                        )
                        .unwrap();
                    } else {
                        ops::attention(
                            &k,
                            AttnMode::Decode,
                            qh,
                            &keys,
                            &values,
                            n_pos,
                            scale,
                            &mut sc2,
                            &mut want,
                        )
                        .unwrap();
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(&want),
                        "{} hd={hd} vd={vd} n_pos={n_pos} head {g}",
                        k.level
                    );
                }
            }
        }
    }
}

/// [`attention_bound`] without ggml's f16 roundings (of the query and the probabilities):
/// the f32 scores' sums, the softmax's `exp` and normalization (a few ulps), and the f32
/// weighted sums.
fn free_attention_bound(
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
) -> Vec<f64> {
    let scale = f64::from(scale);
    let mut s = vec![0.0f64; n_pos];
    let mut ds_max = 0.0f64;
    for (p, s) in s.iter_mut().enumerate() {
        let kr = keys.row(p).unwrap();
        let (mut dot, mut mag) = (0.0, 0.0);
        for (&a, b) in q.iter().zip(kr) {
            let b = f64::from(b.to_f32());
            dot += f64::from(a) * b;
            mag += f64::from(a).abs() * b.abs();
        }
        *s = dot * scale;
        ds_max = ds_max.max(scale * (q.len() as f64 + 16.0) * EPS * mag);
    }
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
    let rel = (2.0 * ds_max).exp_m1() + (n_pos as f64 + 64.0) * EPS;
    let mut bound = vec![0.0f64; values.head_dim];
    for (p, v) in s.iter().enumerate() {
        let prob = (v - max).exp() / z;
        for (b, x) in bound.iter_mut().zip(values.row(p).unwrap()) {
            *b += (rel * prob + 1e-30) * f64::from(x.to_f32()).abs();
        }
    }
    bound
}

/// Per output dimension, how far the kernel may be from the exact f64 attention: the query
/// is rounded to f16 before `q·k` (changing each score by at most `scale · Σ|Δq||k|`, which
/// moves each probability by a factor within `e^{±2 max Δs}`), the probabilities are rounded
/// to f16 (half an ulp, or an absolute 2^-25 among f16 subnormals), and the sums run in f32.
fn attention_bound(
    q: &[f32],
    keys: &PagedHead<'_>,
    values: &PagedHead<'_>,
    n_pos: usize,
    scale: f32,
) -> Vec<f64> {
    let q16: Vec<f64> = q.iter().map(|&v| f64::from(f16::from_f32(v).to_f32())).collect();
    let scale = f64::from(scale);
    let mut s = vec![0.0f64; n_pos];
    let mut ds_max = 0.0f64;
    for (p, s) in s.iter_mut().enumerate() {
        let kr = keys.row(p).unwrap();
        let (mut dot, mut dq, mut mag) = (0.0, 0.0, 0.0);
        for ((&a, &a16), b) in q.iter().zip(&q16).zip(kr) {
            let b = f64::from(b.to_f32());
            dot += f64::from(a) * b;
            dq += (f64::from(a) - a16).abs() * b.abs();
            mag += a16.abs() * b.abs();
        }
        *s = dot * scale;
        ds_max = ds_max.max(scale * (dq + (q.len() as f64 + 16.0) * EPS * mag));
    }
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
    let rel = (2.0 * ds_max).exp_m1() + 1.0 / 2048.0 + (n_pos as f64 + 32.0) * EPS;
    let mut bound = vec![0.0f64; values.head_dim];
    for (p, v) in s.iter().enumerate() {
        let prob = (v - max).exp() / z;
        for (b, x) in bound.iter_mut().zip(values.row(p).unwrap()) {
            let x = f64::from(x.to_f32()).abs();
            *b += (rel * prob + 2f64.powi(-25)) * x;
        }
    }
    bound
}

#[test]
fn attention_reports_short_block_tables_and_bad_shapes() {
    let mut rng = rng(65);
    let (n_kv, hd, bs) = (1usize, 32usize, 16usize);
    let c = make_cache(&mut rng, 40, bs, n_kv, hd);
    let head = |data, table| PagedHead {
        data,
        block_table: table,
        block_size: bs,
        block_stride: n_kv * bs * hd,
        head_dim: hd,
        kv_head: 0,
    };
    let short = &c.table[..2];
    let (keys, values) = (head(&c.keys[..], short), head(&c.values[..], short));
    let q = vec![0.1f32; hd];
    let mut sc = AttnScratch::new(hd, 64);
    let mut out = vec![0.0f32; hd];
    for k in levels() {
        // 2 blocks of 16 hold 32 positions; 40 do not fit.
        assert!(
            ops::attention(&k, AttnMode::Decode, &q, &keys, &values, 32, 0.1, &mut sc, &mut out)
                .is_ok()
        );
        let r =
            ops::attention(&k, AttnMode::Decode, &q, &keys, &values, 40, 0.1, &mut sc, &mut out);
        assert!(matches!(r, Err(KernelError::Shape(_))));
        let r = ops::attention(
            &k,
            AttnMode::Decode,
            &q[..hd - 1],
            &keys,
            &values,
            8,
            0.1,
            &mut sc,
            &mut out,
        );
        assert!(matches!(r, Err(KernelError::Shape(_))));
        let r = ops::attention(&k, AttnMode::Decode, &q, &keys, &values, 0, 0.1, &mut sc, &mut out);
        assert!(matches!(r, Err(KernelError::Shape(_))));
        let mut small = AttnScratch::new(hd, 8);
        let r =
            ops::attention(&k, AttnMode::Decode, &q, &keys, &values, 32, 0.1, &mut small, &mut out);
        assert!(matches!(r, Err(KernelError::Shape(_))));
    }
}

//! Criterion micro-benchmarks of the CPU kernels at every level this CPU supports: the dot
//! products and element-wise ops at the default model's row lengths, and `ops::matmul` at its
//! matrix shapes (SmolLM2-135M: hidden 576, FFN 1536, vocabulary 49152).
//!
//! Each benchmark id is `<level>/<size>`, so one run compares scalar, AVX2 and AVX-512 side
//! by side. Throughput is reported in bytes of weights (plus activations) streamed for the
//! dot products, floating-point operations ("elem/s" = FLOP/s) for the matmuls, and elements
//! for element-wise ops.
//!
//! `cargo bench -p kvx-kernels --bench kernels -- <filter>` runs a subset, e.g. `dot/`,
//! `matmul/q8_0`, `avx512`.

use std::hint::black_box;
use std::time::Duration;

use bytemuck::Zeroable;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvx_kernels::cpu::gemm::Gemm;
use kvx_kernels::cpu::{Kernels, SimdLevel};
use kvx_kernels::gguf::GgmlType;
use kvx_kernels::ops::{self, QMatrix};
use kvx_kernels::par::ThreadPool;
use kvx_kernels::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK_K};
use kvx_kernels::quant_k::{self, BlockQ4K, BlockQ6K, BlockQ8K};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn levels() -> Vec<Kernels> {
    SimdLevel::ALL.iter().filter_map(|&l| Kernels::for_level(l)).collect()
}

fn floats(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn d16(rng: &mut StdRng) -> f16 {
    f16::from_f32(rng.random_range(1e-3f32..0.1))
}

fn q8(rng: &mut StdRng) -> i8 {
    rng.random_range(-127i8..=127)
}

/// Random valid weight blocks of `ty` for `n` elements, as bytes (aligned for the blocks).
struct Weights {
    bytes: Vec<u32>,
    len: usize,
}

impl Weights {
    fn new(rng: &mut StdRng, ty: GgmlType, n: usize) -> Weights {
        fn pack<B: bytemuck::Pod>(blocks: Vec<B>) -> Weights {
            let raw: &[u8] = bytemuck::cast_slice(&blocks);
            let mut bytes = vec![0u32; raw.len().div_ceil(4)];
            bytemuck::cast_slice_mut::<u32, u8>(&mut bytes)[..raw.len()].copy_from_slice(raw);
            Weights { bytes, len: raw.len() }
        }
        match ty {
            GgmlType::Q4_0 => {
                pack((0..n / 32).map(|_| BlockQ4_0 { d: d16(rng), qs: rng.random() }).collect())
            }
            GgmlType::Q4_1 => pack(
                (0..n / 32)
                    .map(|_| BlockQ4_1 { d: d16(rng), m: d16(rng), qs: rng.random() })
                    .collect(),
            ),
            GgmlType::Q8_0 => pack(
                (0..n / 32)
                    .map(|_| BlockQ8_0 { d: d16(rng), qs: std::array::from_fn(|_| q8(rng)) })
                    .collect(),
            ),
            GgmlType::Q4_K => pack(
                (0..n / QK_K)
                    .map(|_| BlockQ4K {
                        d: d16(rng),
                        dmin: d16(rng),
                        scales: rng.random(),
                        qs: std::array::from_fn(|_| rng.random()),
                    })
                    .collect(),
            ),
            GgmlType::Q6_K => pack(
                (0..n / QK_K)
                    .map(|_| BlockQ6K {
                        ql: std::array::from_fn(|_| rng.random()),
                        qh: std::array::from_fn(|_| rng.random()),
                        scales: rng.random(),
                        d: d16(rng),
                    })
                    .collect(),
            ),
            GgmlType::F16 => pack(floats(rng, n).into_iter().map(f16::from_f32).collect()),
            GgmlType::BF16 => pack(floats(rng, n).into_iter().map(quant_k::f32_to_bf16).collect()),
            _ => pack(floats(rng, n)),
        }
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.bytes)[..self.len]
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
}

fn bench_quantized_dots(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    for n in [576usize, 1536] {
        let nb = n / 32;
        let x40: Vec<BlockQ4_0> =
            (0..nb).map(|_| BlockQ4_0 { d: d16(&mut rng), qs: rng.random() }).collect();
        let x41: Vec<BlockQ4_1> = (0..nb)
            .map(|_| BlockQ4_1 { d: d16(&mut rng), m: d16(&mut rng), qs: rng.random() })
            .collect();
        let x80: Vec<BlockQ8_0> = (0..nb)
            .map(|_| BlockQ8_0 { d: d16(&mut rng), qs: std::array::from_fn(|_| q8(&mut rng)) })
            .collect();
        let a = floats(&mut rng, n);
        let mut y80 = vec![BlockQ8_0::zeroed(); nb];
        kvx_kernels::quant::quantize_q8_0(&a, &mut y80);
        let mut y81 = vec![BlockQ8_1::zeroed(); nb];
        kvx_kernels::quant::quantize_q8_1(&a, &mut y81);
        let row =
            |blocks: usize, w: usize, act: usize| Throughput::Bytes((blocks * (w + act)) as u64);

        let mut g = c.benchmark_group("dot/q4_0_q8_0");
        g.throughput(row(nb, 18, 34));
        for k in levels() {
            g.bench_function(BenchmarkId::new(k.level.name(), n), |b| {
                b.iter(|| (k.dot_q4_0_q8_0)(black_box(&x40), black_box(&y80)))
            });
        }
        g.finish();
        let mut g = c.benchmark_group("dot/q4_1_q8_1");
        g.throughput(row(nb, 20, 36));
        for k in levels() {
            g.bench_function(BenchmarkId::new(k.level.name(), n), |b| {
                b.iter(|| (k.dot_q4_1_q8_1)(black_box(&x41), black_box(&y81)))
            });
        }
        g.finish();
        let mut g = c.benchmark_group("dot/q8_0_q8_0");
        g.throughput(row(nb, 34, 34));
        for k in levels() {
            g.bench_function(BenchmarkId::new(k.level.name(), n), |b| {
                b.iter(|| (k.dot_q8_0_q8_0)(black_box(&x80), black_box(&y80)))
            });
        }
        g.finish();
    }
    let n = 1536;
    let nb = n / QK_K;
    let a = floats(&mut rng, n);
    let mut y8 = vec![BlockQ8K::zeroed(); nb];
    quant_k::quantize_q8_k(&a, &mut y8);
    let w4 = Weights::new(&mut rng, GgmlType::Q4_K, n);
    let w6 = Weights::new(&mut rng, GgmlType::Q6_K, n);
    let x4: &[BlockQ4K] = bytemuck::cast_slice(w4.bytes());
    let x6: &[BlockQ6K] = bytemuck::cast_slice(w6.bytes());
    let mut g = c.benchmark_group("dot/q4_k_q8_k");
    g.throughput(Throughput::Bytes((nb * (144 + 292)) as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |b| {
            b.iter(|| (k.dot_q4_k_q8_k)(black_box(x4), black_box(&y8)))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("dot/q6_k_q8_k");
    g.throughput(Throughput::Bytes((nb * (210 + 292)) as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |b| {
            b.iter(|| (k.dot_q6_k_q8_k)(black_box(x6), black_box(&y8)))
        });
    }
    g.finish();
}

fn bench_float_kernels(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let n = 1536;
    let a = floats(&mut rng, n);
    let b = floats(&mut rng, n);
    let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
    let bh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
    let ab: Vec<u16> = a.iter().map(|&v| quant_k::f32_to_bf16(v)).collect();
    let bb: Vec<u16> = b.iter().map(|&v| quant_k::f32_to_bf16(v)).collect();

    let mut g = c.benchmark_group("dot/f16");
    g.throughput(Throughput::Bytes((4 * n) as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.dot_f16)(black_box(&ah), black_box(&bh)))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("dot/bf16");
    g.throughput(Throughput::Bytes((4 * n) as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.dot_bf16)(black_box(&ab), black_box(&bb)))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("dot/f32");
    g.throughput(Throughput::Bytes((8 * n) as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.dot_f32)(black_box(&a), black_box(&b)))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("convert/f32_to_bf16");
    g.throughput(Throughput::Elements(n as u64));
    let mut out16 = vec![0u16; n];
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.f32_to_bf16)(black_box(&a), black_box(&mut out16)))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("quantize/q8_k");
    g.throughput(Throughput::Elements(n as u64));
    let mut q8k = vec![BlockQ8K::zeroed(); n / QK_K];
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.quantize_q8_k)(black_box(&a), black_box(&mut q8k)))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("quantize/q8_1");
    g.throughput(Throughput::Elements(n as u64));
    let mut q81 = vec![BlockQ8_1::zeroed(); n / 32];
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.quantize_q8_1)(black_box(&a), black_box(&mut q81)))
        });
    }
    g.finish();

    let w = floats(&mut rng, 576);
    let mut out = vec![0.0f32; n];
    let mut g = c.benchmark_group("elementwise/rmsnorm");
    g.throughput(Throughput::Elements(576));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), 576), |bn| {
            bn.iter(|| {
                (k.rmsnorm)(black_box(&a[..576]), black_box(&w), 1e-5, black_box(&mut out[..576]))
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("elementwise/swiglu");
    g.throughput(Throughput::Elements(n as u64));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), n), |bn| {
            bn.iter(|| (k.swiglu)(black_box(&a), black_box(&b), black_box(&mut out)))
        });
    }
    g.finish();
    let mut g = c.benchmark_group("elementwise/softmax");
    let scores = floats(&mut rng, 300);
    let mut buf = scores.clone();
    g.throughput(Throughput::Elements(300));
    for k in levels() {
        g.bench_function(BenchmarkId::new(k.level.name(), 300), |bn| {
            bn.iter(|| {
                buf.copy_from_slice(&scores);
                (k.softmax)(black_box(&mut buf), 0.125)
            })
        });
    }
    g.finish();
}

/// `rows × cols` weights of `ty` times `n_tok` activation rows on `threads` threads, for each
/// named kernel table. Throughput is in elements = floating-point operations
/// (2 · rows · cols · n_tok), so criterion's "elem/s" reads as FLOP/s.
#[allow(clippy::too_many_arguments)]
fn bench_matmul_shape(
    c: &mut Criterion,
    rng: &mut StdRng,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tok: usize,
    threads: usize,
    tables: &[(String, Kernels)],
) {
    let w = Weights::new(rng, ty, rows * cols);
    let Ok(m) = QMatrix::new(ty, rows, cols, w.bytes()) else {
        return;
    };
    let x = floats(rng, n_tok * cols);
    let act_bytes = ops::activation_bytes(m.act_ty(), cols, n_tok).unwrap_or(0);
    let mut act = vec![0u32; act_bytes.div_ceil(4)];
    let mut out = vec![0.0f32; rows * n_tok];
    let Ok(pool) = ThreadPool::new(threads) else {
        return;
    };
    let name = format!("matmul/{}/{rows}x{cols}/t{n_tok}/p{threads}", ty.name().to_lowercase());
    let mut g = c.benchmark_group(name);
    if rows * cols * n_tok >= 1 << 28 {
        g.sample_size(10);
    }
    g.throughput(Throughput::Elements((2 * rows * cols * n_tok) as u64));
    for (label, k) in tables {
        let Ok(xq) =
            ops::quantize_activations(k, m.act_ty(), &x, cols, bytemuck::cast_slice_mut(&mut act))
        else {
            continue;
        };
        let xq = xq.to_vec();
        let mut scratch = ops::MatmulScratch::for_matrix(k, &m, n_tok);
        g.bench_function(BenchmarkId::new(label, format!("{rows}x{cols}")), |b| {
            b.iter(|| {
                ops::matmul_with(
                    k,
                    &pool,
                    black_box(&m),
                    black_box(&xq),
                    n_tok,
                    black_box(&mut out),
                    &mut scratch,
                )
            })
        });
    }
    g.finish();
}

/// Each level's table under its name, and for the SIMD levels the same table without its
/// matrix kernels as `<level>-dots` (every output one call of the dot product: the peer the
/// tiled kernels are measured against).
fn matmul_tables(with_scalar: bool, with_dots: bool) -> Vec<(String, Kernels)> {
    let mut t = vec![];
    for k in levels() {
        if k.level == SimdLevel::Scalar {
            if with_scalar {
                t.push((k.level.name().to_string(), k));
            }
            continue;
        }
        t.push((k.level.name().to_string(), k));
        if with_dots {
            let mut dots = k;
            dots.gemm = Gemm::NONE;
            t.push((format!("{}-dots", k.level.name()), dots));
        }
    }
    t
}

fn bench_matmul(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(3);
    let all = matmul_tables(true, false);
    // The layer shapes (rows = outputs): q/o projections, FFN gate/up, FFN down.
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
        for (rows, cols) in [(576, 576), (1536, 576), (576, 1536)] {
            bench_matmul_shape(c, &mut rng, ty, rows, cols, 1, 1, &all);
        }
    }
    // K-quants need rows of whole 256-element super-blocks: only the FFN down projection.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        bench_matmul_shape(c, &mut rng, ty, 576, 1536, 1, 1, &all);
        bench_matmul_shape(c, &mut rng, ty, 576, 1536, 16, 1, &all);
    }
    // The default model's matrices (Q4_1 layers, Q8_0 output head) from one decode token
    // to a prefill batch, one and two threads, tiled kernels against the dot products.
    let simd = matmul_tables(false, true);
    let shapes = [
        (GgmlType::Q4_1, 576, 576),
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
    ];
    for (ty, rows, cols) in shapes {
        for n_tok in [1, 4, 16, 64] {
            for threads in [1, 2] {
                bench_matmul_shape(c, &mut rng, ty, rows, cols, n_tok, threads, &simd);
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_quantized_dots, bench_float_kernels, bench_matmul
}
criterion_main!(benches);

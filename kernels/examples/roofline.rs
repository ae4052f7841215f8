//! This CPU's roofline numbers for kernels/PERF.md: memory read bandwidth (1 and N threads),
//! peak int8 `vpdpbusd` and f32 FMA rates per core (AVX-512 and AVX2 register widths), and
//! two access patterns of a decode step: one thread's rate over rows scattered in runs of
//! 2 KiB (one head's rows of a 16-token cache block) to 128 KiB, and whether a stream of the
//! default model's size (a 96 MiB stream; the model's weights and head are 96 MB) keeps its
//! place in the last-level cache when a shard's cache rows (37 MB: 8 sequences × 200
//! positions) are read between its passes.
//!
//! `cargo run --release -p kvx-kernels --example roofline [THREADS]`

use std::hint::black_box;
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    // Bandwidth: sum a buffer far larger than the last-level cache.
    let words: usize = (256 << 20) / 8; // 256 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    for n in [1, threads] {
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                std::thread::scope(|s| {
                    for part in buf.chunks(words.div_ceil(n)) {
                        s.spawn(move || black_box(sum(part)));
                    }
                });
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        println!("read bandwidth, {n} thread(s): {:.1} GB/s", (words * 8) as f64 / best / 1e9);
    }
    // A 24 MiB buffer (inside L3 when the machine is otherwise idle).
    let l3 = &buf[..(24 << 20) / 8];
    let best = (0..20)
        .map(|_| {
            let t = Instant::now();
            black_box(sum(l3));
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    println!(
        "read bandwidth, 1 thread, 24 MiB (L3): {:.1} GB/s",
        (l3.len() * 8) as f64 / best / 1e9
    );
    scattered(&buf);
    weights_beside_rows(&buf);
    #[cfg(target_arch = "x86_64")]
    peak::run();
}

/// Bytes of cache rows a decode step of one shard reads: 8 sequences × 200 positions ×
/// 23,040 bytes (30 layers × 3 KV heads × 64 dimensions × keys and values × f16).
const ROWS_BYTES: usize = 8 * 200 * 23_040;

/// Where the runs of [`ROWS_BYTES`] in `run`-byte pieces lie in `buf` (a fixed scatter).
fn run_starts(buf: &[u64], run: usize) -> Vec<usize> {
    let (words, slots) = (run / 8, buf.len() * 8 / run);
    (0..ROWS_BYTES / run).map(|i| (i * 7919 + 13) % slots * words).collect()
}

/// Sums the runs of `run` bytes at `starts` in `buf`.
fn sum_runs(buf: &[u64], starts: &[usize], run: usize) -> u64 {
    starts.iter().fold(0, |a, &s| a.wrapping_add(sum(&buf[s..s + run / 8])))
}

/// One thread's read rate over [`ROWS_BYTES`] in runs of 2 KiB to 128 KiB at scattered
/// places of a buffer far larger than the last-level cache, each pass after reading 512 MiB
/// of other memory twice (so that the runs come from DRAM).
fn scattered(buf: &[u64]) {
    let evict: Vec<u64> = (0..(512u64 << 20) / 8).collect();
    for run in [2 << 10, 8 << 10, 32 << 10, 128 << 10] {
        let starts = run_starts(&buf[..buf.len() / 2], run);
        let best = (0..5)
            .map(|_| {
                black_box(sum(&evict));
                black_box(sum(&evict));
                let t = Instant::now();
                black_box(sum_runs(buf, &starts, run));
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        println!(
            "read bandwidth, 1 thread, {} MiB in scattered runs of {} KiB: {:.1} GB/s",
            ROWS_BYTES >> 20,
            run >> 10,
            ROWS_BYTES as f64 / best / 1e9
        );
    }
}

/// A 96 MiB stream (about the default model's 96 MB of weights and head) read again and
/// again, alone and with [`ROWS_BYTES`] of scattered 2 KiB runs (the cache rows of a shard's
/// decode step) read between its passes: how fast the stream comes (from the last-level
/// cache, or from DRAM once the rows have pushed it out).
fn weights_beside_rows(buf: &[u64]) {
    let weights = &buf[..(96 << 20) / 8];
    let rows = &buf[weights.len()..];
    let run = 2 << 10;
    let starts = run_starts(rows, run);
    for with_rows in [false, true] {
        let (mut w, mut r) = (0.0f64, 0.0f64);
        for pass in 0..12 {
            let t = Instant::now();
            black_box(sum(weights));
            let tw = t.elapsed().as_secs_f64();
            let t = Instant::now();
            if with_rows {
                black_box(sum_runs(rows, &starts, run));
            }
            // The first passes fill the cache.
            if pass >= 2 {
                w += tw;
                r += t.elapsed().as_secs_f64();
            }
        }
        let label = if with_rows { "with the rows between passes" } else { "alone" };
        print!(
            "96 MiB weight stream, 1 thread, {label}: {:.1} GB/s",
            10.0 * (96 << 20) as f64 / w / 1e9
        );
        if with_rows {
            print!("; the rows {:.1} GB/s", 10.0 * ROWS_BYTES as f64 / r / 1e9);
        }
        println!();
    }
}

fn sum(x: &[u64]) -> u64 {
    // Eight independent chains so the adds never limit the loads.
    let mut acc = [0u64; 8];
    for c in x.chunks_exact(8) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*v);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    const ITERS: usize = 20_000_000;

    pub fn run() {
        let ghz = clock_ghz();
        println!("core clock (dependent FMAs, 4-cycle latency): {ghz:.2} GHz");
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512f") {
            // SAFETY: the features were detected above.
            let s = time(|| unsafe { vnni512() });
            // 64 byte products (128 int ops) per instruction, 12 instructions per iteration.
            let ops = 12.0 * 128.0 * ITERS as f64;
            println!(
                "vpdpbusd zmm: {:.0} Gop/s/core ({:.2} per cycle)",
                ops / s / 1e9,
                ops / s / 1e9 / ghz / 128.0
            );
            // SAFETY: as above.
            let s = time(|| unsafe { fma512() });
            let flops = 12.0 * 32.0 * ITERS as f64;
            println!(
                "vfmadd zmm: {:.0} GFLOP/s/core ({:.2} per cycle)",
                flops / s / 1e9,
                flops / s / 1e9 / ghz / 32.0
            );
            // SAFETY: as above.
            let s = time(|| unsafe { mix512() });
            // Per iteration 4 × (vpdpbusd, cvtdq2ps, mulps, fmadd): the quantized inner loop.
            let s256 = {
                // SAFETY: as above.
                time(|| unsafe { mix256() })
            };
            println!(
                "dpbusd+cvt+fma(bcast) ymm: {:.2} cycles per group",
                s256 * ghz * 1e9 / (8.0 * ITERS as f64)
            );
            println!(
                "dpbusd+cvt+mul+fma zmm: {:.2} cycles per group",
                s * ghz * 1e9 / (4.0 * ITERS as f64)
            );
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected above.
            let s = time(|| unsafe { fma256() });
            let flops = 12.0 * 16.0 * ITERS as f64;
            println!(
                "vfmadd ymm: {:.0} GFLOP/s/core ({:.2} per cycle)",
                flops / s / 1e9,
                flops / s / 1e9 / ghz / 16.0
            );
        }
    }

    fn time(f: impl Fn() -> f32) -> f64 {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                black_box(f());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// The core clock from one chain of dependent f32 FMAs (4 cycles each on Zen 4 and on
    /// Intel cores since Skylake).
    fn clock_ghz() -> f64 {
        if !is_x86_feature_detected!("fma") {
            return f64::NAN;
        }
        let t = Instant::now();
        // SAFETY: the feature was detected above.
        black_box(unsafe { fma_chain() });
        4.0 * ITERS as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    #[target_feature(enable = "fma")]
    fn fma_chain() -> f32 {
        let (a, b) = (_mm_set1_ps(0.999_999), _mm_set1_ps(1e-7));
        let mut x = _mm_set1_ps(1.0);
        for _ in 0..ITERS {
            x = _mm_fmadd_ps(x, a, b);
        }
        _mm_cvtss_f32(x)
    }

    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    fn vnni512() -> f32 {
        let a = _mm512_set1_epi8(3);
        let b = _mm512_set1_epi8(5);
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        let s = acc.iter().fold(_mm512_setzero_si512(), |s, x| _mm512_add_epi32(s, *x));
        _mm512_reduce_add_epi32(s) as f32
    }

    #[target_feature(enable = "avx512f")]
    fn fma512() -> f32 {
        let a = _mm512_set1_ps(1.000_001);
        let b = _mm512_set1_ps(0.999_999);
        let mut acc = [_mm512_setzero_ps(); 12];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let s = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    fn mix512() -> f32 {
        let a = _mm512_set1_epi8(3);
        let b = _mm512_set1_epi8(5);
        let d0 = _mm512_set1_ps(0.5);
        let mut dw = _mm512_set1_ps(1.0);
        let mut acc = [_mm512_setzero_ps(); 4];
        for _ in 0..ITERS {
            dw = black_box(dw);
            for x in acc.iter_mut() {
                let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
                let d = _mm512_mul_ps(dw, d0);
                *x = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(i), *x);
            }
        }
        let s = acc.iter().fold(_mm512_setzero_ps(), |s, x| _mm512_add_ps(s, *x));
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx512f,avx512vnni,avx512bw,avx512vl")]
    fn mix256() -> f32 {
        let b = _mm256_set1_epi8(5);
        let scales = [0.5f32; 8];
        let quants = [[3u8; 32]; 8];
        let mut acc = [_mm256_setzero_ps(); 8];
        for _ in 0..ITERS {
            let sc = black_box(&scales);
            let qs = black_box(&quants);
            for (k, x) in acc.iter_mut().enumerate() {
                // SAFETY: 32 readable bytes.
                let a = unsafe { _mm256_loadu_si256(qs[k].as_ptr().cast()) };
                let i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
                *x = _mm256_fmadd_ps(_mm256_set1_ps(sc[k]), _mm256_cvtepi32_ps(i), *x);
            }
        }
        let mut out = [0.0f32; 8];
        let s = acc.iter().fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, *x));
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
        out.iter().sum()
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma256() -> f32 {
        let a = _mm256_set1_ps(1.000_001);
        let b = _mm256_set1_ps(0.999_999);
        let mut acc = [_mm256_setzero_ps(); 12];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut out = [0.0f32; 8];
        let s = acc.iter().fold(_mm256_setzero_ps(), |s, x| _mm256_add_ps(s, *x));
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
        out.iter().sum()
    }
}

//! What products in bf16 on AMX tiles would cost on this CPU, for kernels/PERF.md: a `Q4_1`
//! weight matrix of the model's FFN shape (1,536 × 576), dequantized block by block into
//! `tdpbf16ps`'s pair layout (`bf16(fma(d, q, m))`, 16 rows × 32 columns a tile) and
//! multiplied with `T` tokens' bf16 activations, f32 accumulators in C tiles, one thread,
//! the matrix hot in L2. Per `T`: the whole product, the dequantization alone and the tile
//! work alone (from a matrix dequantized once), as GMAC/s of useful multiply-adds
//! (`T × 1,536 × 576`; a last partial token tile is computed whole, so the figure is a floor).
//! Before timing, some outputs are checked against the same weights dequantized and rounded
//! one by one (so the pair layout is the instruction's). The weights' nibbles are taken as
//! a load-time repacking would lay them out (a byte per row holds a pair's two quants), and
//! a weight is `bf16(fma(d, q, m))`; an arithmetic would fix its own dequantization (the
//! reference's is `q · d + m`, two roundings), at the same cost. Compare `RATES=1
//! MATH=fast profile MODEL 1 T` (the int8 `Fast` products, "hot").
//!
//! `cargo run --release -p kvx-kernels --example bf16tiles`

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    // CPUID leaf 7: EDX bit 22 is AMX-BF16 (the tile state itself is asked for by
    // `tiles_granted`, which covers every tile instruction).
    // SAFETY: CPUID exists on every x86-64 CPU; `tiles_granted` is false where leaf 7 is absent.
    #[allow(unused_unsafe)]
    let amx_bf16 = unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx & (1 << 22) != 0;
    if !kvx_kernels::cpu::tiles_granted()
        || !amx_bf16
        || !std::arch::is_x86_feature_detected!("avx512bf16")
    {
        println!("no AMX tiles or no AVX512-BF16 on this machine (or the OS did not grant them)");
        return;
    }
    const R: usize = 1536;
    const K: usize = 576;
    let nb = K / 32;
    // Records: per 16-row group and block, 16 lines of 16 bytes (pair j: byte n = q[n][2j] |
    // q[n][2j+1] << 4), then the 16 rows' d and m as f32.
    let mut seed = 0x9e37_79b9_u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    let groups = R / 16;
    let mut quants = vec![Line([0; 64]); groups * nb * 4];
    for l in quants.iter_mut() {
        for b in l.0.iter_mut() {
            *b = next() as u8;
        }
    }
    let mut scales = vec![[0f32; 32]; groups * nb];
    for s in scales.iter_mut() {
        for (i, v) in s.iter_mut().enumerate() {
            let r = (next() % 1000) as f32 / 1000.0;
            *v = if i < 16 { 0.001 + 0.01 * r } else { -0.08 * r };
        }
    }
    // One 32-row strip's B tiles (2 groups × `nb` blocks × 16 lines: 36 KiB), dequantized
    // again for every strip, as a kernel would.
    let mut strip_b = vec![Line([0; 64]); 2 * nb * 16];
    println!("T      whole GMAC/s   dequant only GMAC/s   tiles only GMAC/s");
    for t in [1usize, 8, 16, 32, 64, 130] {
        let tiles_t = t.div_ceil(16);
        // Activations: token `t`, column `k` = 1 + ((t + k) mod 7) / 8, exact in bf16.
        let act = |t: usize, k: usize| 1.0 + ((t + k) % 7) as f32 / 8.0;
        let mut a = vec![Line([0; 64]); tiles_t * 16 * nb];
        for (i, line) in a.iter_mut().enumerate() {
            let (tile, blk, row) = (i / (16 * nb), i / 16 % nb, i % 16);
            for e in 0..32 {
                let v = half::bf16::from_f32(act(tile * 16 + row, blk * 32 + e)).to_bits();
                line.0[2 * e..2 * e + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        let mut c = vec![Line([0; 64]); tiles_t * 16 * (R / 16)];
        // The layouts checked once: some outputs against the same weights dequantized and
        // rounded one by one, summed in f64.
        // SAFETY: the buffers are sized for `groups`, `nb` and `tiles_t` as `product` needs;
        // AMX-BF16 and AVX512-BF16 were checked above, and `tiles_granted` implies the
        // AVX-512 level (F, BW) `product` is compiled for.
        unsafe { product(0, &quants, &scales, &mut strip_b, &a, &mut c, groups, nb, tiles_t) };
        for (tok, row) in [(0, 0), (t - 1, R - 1), (t / 2, 777)] {
            let (g, n) = (row / 16, row % 16);
            let mut want = 0f64;
            for k in 0..K {
                let (blk, j) = (k / 32, k % 32 / 2);
                let rec = g * nb + blk;
                let byte = quants[rec * 4 + j / 4].0[16 * (j % 4) + n];
                let q = if k % 2 == 0 { byte & 15 } else { byte >> 4 };
                let (d, m) = (scales[rec][n], scales[rec][16 + n]);
                let w = half::bf16::from_f32(d.mul_add(f32::from(q), m)).to_f32();
                want += f64::from(w) * f64::from(act(tok, k));
            }
            let line = &c[((tok / 16) * groups + g) * 16 + tok % 16].0;
            let got = f32::from_le_bytes(line[4 * n..4 * n + 4].try_into().expect("4 bytes"));
            let err = (f64::from(got) - want).abs() / want.abs().max(1e-3);
            assert!(err < 1e-4, "token {tok}, row {row}: tiles {got}, one by one {want}");
        }
        let macs = (t * R * K) as f64;
        let reps = (2e9 / macs).ceil() as usize;
        let mut rates = [0f64; 3];
        for (mode, rate) in rates.iter_mut().enumerate() {
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..reps {
                    // SAFETY: buffers sized for `groups`, `nb` and `tiles_t` as `product` needs;
                    // AMX-BF16 and AVX512-BF16 checked above.
                    unsafe {
                        product(
                            mode,
                            &quants,
                            &scales,
                            &mut strip_b,
                            &a,
                            &mut c,
                            groups,
                            nb,
                            tiles_t,
                        )
                    };
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            *rate = macs * reps as f64 / best / 1e9;
        }
        println!("{t:<6} {:>12.0} {:>20.0} {:>20.0}", rates[0], rates[1], rates[2]);
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("AMX is an x86-64 extension");
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Palette 1: C tiles 0–3 (16 × 64 bytes), A tiles 4, 5 and B tiles 6, 7 (16 × 64).
#[cfg(target_arch = "x86_64")]
fn config() -> Line {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        c[48 + t] = 16;
    }
    Line(c)
}

/// Mode 0: per 32-row strip, dequantize its blocks into `strip_b`, then the tile products of
/// every token tile; mode 1: the dequantization only; mode 2: the tile products only (from
/// `strip_b` as it is, for every strip).
///
/// # Safety
/// AMX-BF16 granted, AVX512-BF16 present; `quants` holds `groups · nb · 4` lines, `scales`
/// `groups · nb`, `strip_b` `2 · nb · 16`, `a` `tiles_t · 16 · nb`, `c` `tiles_t · 16 ·
/// groups`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    mode: usize,
    quants: &[Line],
    scales: &[[f32; 32]],
    strip_b: &mut [Line],
    a: &[Line],
    c: &mut [Line],
    groups: usize,
    nb: usize,
    tiles_t: usize,
) {
    use std::arch::asm;
    use std::arch::x86_64::*;
    // SAFETY: a valid palette-1 configuration; the caller checked the tiles.
    unsafe { asm!("ldtilecfg [{c}]", c = in(reg) config().0.as_ptr()) };
    let interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    let low = _mm512_set1_epi32(15);
    for strip in 0..groups / 2 {
        if mode != 2 {
            for g in 2 * strip..2 * strip + 2 {
                for blk in 0..nb {
                    let rec = g * nb + blk;
                    // SAFETY: the record's first 16 scales.
                    let d = unsafe { _mm512_loadu_ps(scales[rec].as_ptr()) };
                    // SAFETY: its last 16.
                    let m = unsafe { _mm512_loadu_ps(scales[rec][16..].as_ptr()) };
                    let q = &quants[rec * 4..rec * 4 + 4];
                    for j in 0..16 {
                        let bytes = q[j / 4].0.as_ptr().wrapping_add(16 * (j % 4));
                        // SAFETY: 16 bytes inside the record's line.
                        let x = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(bytes.cast()) });
                        let lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, low));
                        let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(x));
                        let wl = _mm512_fmadd_ps(d, lo, m);
                        let wh = _mm512_fmadd_ps(d, hi, m);
                        let bh = _mm512_cvtne2ps_pbh(wh, wl);
                        // SAFETY: 32 bf16 are 64 bytes, any bit pattern an integer vector.
                        let packed: __m512i = unsafe { std::mem::transmute(bh) };
                        let pairs = _mm512_permutexvar_epi16(interleave, packed);
                        let dst = &mut strip_b[((g % 2) * nb + blk) * 16 + j];
                        // SAFETY: a 64-byte aligned line.
                        unsafe { _mm512_store_si512(dst.0.as_mut_ptr().cast(), pairs) };
                    }
                }
            }
        }
        if mode == 1 {
            continue;
        }
        let (g0, g1) = (2 * strip, 2 * strip + 1);
        let mut tt = 0;
        while tt < tiles_t {
            let two = tt + 1 < tiles_t;
            // SAFETY: tiles zeroed, loaded from lines inside `a` and `strip_b`, stored into `c`.
            unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3") };
            for blk in 0..nb {
                let a0 = a[(tt * nb + blk) * 16..].as_ptr();
                let a1 = a[((tt + usize::from(two)) * nb + blk) * 16..].as_ptr();
                let b0 = strip_b[blk * 16..].as_ptr();
                let b1 = strip_b[(nb + blk) * 16..].as_ptr();
                // SAFETY: 16 lines at each pointer.
                unsafe {
                    asm!(
                        "tileloadd tmm4, [{a0} + {s}*1]",
                        "tileloadd tmm6, [{b0} + {s}*1]",
                        "tileloadd tmm7, [{b1} + {s}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        a0 = in(reg) a0, b0 = in(reg) b0, b1 = in(reg) b1, s = in(reg) 64usize,
                        options(nostack),
                    )
                };
                if two {
                    // SAFETY: 16 lines at `a1`; the B tiles were loaded above.
                    unsafe {
                        asm!(
                            "tileloadd tmm5, [{a1} + {s}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a1 = in(reg) a1, s = in(reg) 64usize, options(nostack),
                        )
                    };
                }
            }
            let base = c.as_mut_ptr().cast::<u8>();
            let out = |tile: usize, g: usize| base.wrapping_add((tile * groups + g) * 16 * 64);
            // SAFETY: 16 lines at each destination, inside `c`.
            unsafe {
                asm!(
                    "tilestored [{c0} + {s}*1], tmm0",
                    "tilestored [{c1} + {s}*1], tmm1",
                    c0 = in(reg) out(tt, g0), c1 = in(reg) out(tt, g1), s = in(reg) 64usize,
                    options(nostack),
                )
            };
            if two {
                // SAFETY: as above, the next token tile's.
                unsafe {
                    asm!(
                        "tilestored [{c2} + {s}*1], tmm2",
                        "tilestored [{c3} + {s}*1], tmm3",
                        c2 = in(reg) out(tt + 1, g0), c3 = in(reg) out(tt + 1, g1),
                        s = in(reg) 64usize, options(nostack),
                    )
                };
            }
            tt += 2;
        }
    }
    // SAFETY: releases the tile state.
    unsafe { asm!("tilerelease") };
}

//! Whether AMX tile work and AVX-512 vector work overlap on this CPU, for kernels/PERF.md:
//! the time per block of the tile kernel's two halves (`cpu::arch::x86_64::tiles`) alone and
//! together. "tiles": a block's tile product as the kernel issues it (A and B loads, zero,
//! `tdpbsud`, store) of 16 tokens × 16 rows × 32; "scaling": the `Q4_1` `Fast` scaling of
//! 16 tokens' integers (a load, a conversion, a multiply and two fused multiply-adds each;
//! the kernel takes its two scalars by broadcast loads, here broadcasts of loaded scalars)
//! from a buffer the tiles do not write; "both": the two in one loop. Where they overlap, "both"
//! costs about the larger of the two; where they do not, their sum.
//!
//! `cargo run --release -p kvx-kernels --example amx`

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    if !kvx_kernels::cpu::tiles_granted() {
        println!("no AMX tiles on this machine (or the OS did not grant them)");
        return;
    }
    let a = vec![Line([1; 64]); 18 * 11];
    let b = vec![Line([2; 64]); 18 * 8];
    let mut c = vec![Line([0; 64]); 64];
    let other = vec![Line([3; 64]); 64];
    // SAFETY: a valid palette-1 configuration (`config`); the tiles were granted above.
    unsafe { std::arch::asm!("ldtilecfg [{c}]", c = in(reg) config().0.as_ptr()) };
    for (name, tiles, scale) in
        [("tiles", true, false), ("scaling", false, true), ("both", true, true)]
    {
        let reps = 100_000;
        let mut best = f64::INFINITY;
        let mut sink = 0.0;
        for _ in 0..3 {
            let t = Instant::now();
            // SAFETY: the buffers hold every line the loop reads and writes (`run`).
            sink += unsafe { run(tiles, scale, &a, &b, &mut c, &other, reps) };
            best = best.min(t.elapsed().as_secs_f64());
        }
        let ns = best * 1e9 / (reps * 18) as f64;
        println!("{name:8} {ns:6.2} ns a block ({:.0} GMAC/s)  [{sink:e}]", 8192.0 / ns);
    }
    // SAFETY: releases the tile state.
    unsafe { std::arch::asm!("tilerelease") };
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("AMX is an x86-64 extension");
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Palette 1: C tiles 0–3 (16 × 64 bytes), A tiles 4, 5 (16 × 32), B tiles 6, 7 (8 × 64).
#[cfg(target_arch = "x86_64")]
fn config() -> Line {
    let mut c = [0u8; 64];
    c[0] = 1;
    for (t, rows, colsb) in [
        (0, 16, 64u16),
        (1, 16, 64),
        (2, 16, 64),
        (3, 16, 64),
        (4, 16, 32),
        (5, 16, 32),
        (6, 8, 64),
        (7, 8, 64),
    ] {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
        c[48 + t] = rows;
    }
    Line(c)
}

/// `reps` passes over 18 blocks; returns a sum of the accumulators.
///
/// # Safety
/// Tiles configured by [`config`]; `a` holds 18 × 11 lines, `b` 18 × 8, `c` and `other` 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run(
    tiles: bool,
    scale: bool,
    a: &[Line],
    b: &[Line],
    c: &mut [Line],
    other: &[Line],
    reps: usize,
) -> f32 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 16];
    let (dw, mw) = (_mm512_set1_ps(1.0001), _mm512_set1_ps(0.5));
    let cp = c.as_mut_ptr().cast::<u8>();
    for _ in 0..reps {
        for blk in 0..18 {
            if tiles {
                let (ap, bp) = (a[blk * 11..].as_ptr(), b[blk * 8..].as_ptr());
                let out = cp.wrapping_add((blk % 4) * 1024);
                macro_rules! block {
                    ($c:literal, $a:literal, $b:literal) => {
                        // SAFETY: 16 rows of 32 bytes at `ap`, 8 lines at `bp`, 16 lines at
                        // `out` (the function's contract).
                        unsafe {
                            asm!(
                                concat!("tileloadd tmm", $a, ", [{a} + {s}*1]"),
                                concat!("tileloadd tmm", $b, ", [{b} + {l}*1]"),
                                concat!("tilezero tmm", $c),
                                concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
                                concat!("tilestored [{c} + {l}*1], tmm", $c),
                                a = in(reg) ap, s = in(reg) 32usize, b = in(reg) bp,
                                l = in(reg) 64usize, c = in(reg) out, options(nostack),
                            )
                        }
                    };
                }
                match blk % 4 {
                    0 => block!("0", "4", "6"),
                    1 => block!("1", "5", "7"),
                    2 => block!("2", "4", "6"),
                    _ => block!("3", "5", "7"),
                }
            }
            if scale {
                let src = &other[(blk % 4) * 16..];
                let rec = &a[blk * 11..];
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: line `t` of `src` is 64 aligned bytes.
                    let i = unsafe { _mm512_load_si512(src[t].0.as_ptr().cast()) };
                    let base = rec.as_ptr().cast::<u8>();
                    // SAFETY: offsets 512..640 of a block's 11 lines, inside `a`.
                    let f =
                        |off: usize| unsafe { base.wrapping_add(off + 4 * t).cast::<f32>().read() };
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(f(512)));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), d, *acc);
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(f(576)), *acc);
                }
            }
        }
    }
    acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

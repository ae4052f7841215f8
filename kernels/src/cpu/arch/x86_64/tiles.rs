//! The row-lane `Fast` products ([`crate::cpu::lanes::LaneMath::Fast`]) on AMX tiles, where
//! the CPU has AMX-INT8 and the OS grants the tile state ([`request_tiles`]).
//!
//! **Same bits as the AVX-512 kernel.** `Fast` needs, per (block, row, token), the exact
//! integer dot product of the block's 32 quants, then `acc = fma(f32(i), d_w · d_a, acc)` and
//! (`Q4_1`) `acc = fma(m_w, s_a, acc)`. One `tdpbsud` forms the exact integers of a whole
//! block for up to 16 tokens × 16 rows (16 × 16 × 32 multiply-adds in ~16 cycles, where the
//! AVX-512 kernel spends 8 `vpdpbusd` a token); what is left is the per-block scaling, 3–4
//! vector operations a token and tile. The integers are exact in any order, and the scaling
//! is the AVX-512 kernel's instruction for instruction, so every output has the bits of
//! [`crate::cpu::lanes::dot_reference`] and batch invariance still holds.
//!
//! **Tiles.** Per block: A (a group's tokens × 32 signed activation quants, from the job's
//! tile records, [`crate::cpu::lanes::tile_records`], 32-byte rows), B (8 rows × 64 bytes:
//! row `j` holds, for each of the 16 weight rows, its unsigned quants `4j..4j + 4`: for
//! `Q4_x` the low and high nibbles of the record's four vectors, unpacked with the f32 scales
//! once per tile and chunk into a thread's buffer; for `Q8_0` the record's eight vectors as
//! they are, bytes offset by 128), C (tokens × 16 int32), stored and scaled. The record's
//! `corr_sum` (`Q4_0`: −8 · Σ q, `Q8_0`: −128 · Σ q) is added to the stored integers, which
//! is exact as the AVX-512 kernel's start from it is. Tile products run [`LAG`] blocks ahead of the scaling, four C tiles in
//! turn (tile registers are not renamed: a C tile is zeroed again only after its store).
//!
//! **What it gains.** On the Xeon this was measured on (family 6 model 167, under KVM), tile
//! instructions and vector instructions do not overlap (the `amx` example): a block's tile
//! work alone takes 10.8–11.3 ns, a scaling of 16 tokens alone 13.9–14.1, both in one loop
//! 26.2–27.4, the sum. So the products of 16 or more tokens run ~1.2× the AVX-512 kernel's
//! rate, not the ~3× its instruction count would allow; below
//! [`crate::cpu::lanes::TILE_MIN_TOKENS`] the nibble unpacking and the tile work cost more
//! than they save. kernels/PERF.md has the figures.
//!
//! **Configuration.** A tile configuration fixes the token rows; loading one costs ~50–80 ns
//! here, so a call configures once per chunk whose largest group differs from the last (a
//! smaller group's extra row is a stale row of its record, whose C row is never read), not
//! per tile, and releases the tiles when it returns.
//!
//! # Safety
//! `imp_run` requires AVX-512 VNNI and granted AMX-INT8 tiles; it is reachable only through
//! [`run`], which [`crate::cpu::lanes::table`] installs only where both were found
//! ([`request_tiles`]). Tile loads read at most 16 rows × 32 bytes of a group's tile record
//! (whose length `imp_run` asserts) and 8 lines of a weight record or of the unpacked
//! buffer; tile stores write the configured rows (at most 16 lines) into a set of a 4 KiB
//! stack buffer, and the scaling reads only lines a store wrote. The tiles are released on
//! every way out of `imp_run`, a panic included ([`Release`]).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use crate::cpu::gemm::Line;
use crate::cpu::lanes::{
    LANE_ROWS, LaneJob, TILE_CORR, TILE_D, TILE_GROUP, TILE_REC_LINES, TILE_S, d_offset, rec_lines,
    tile_chunks, tile_record_lines,
};
use crate::quant::GgmlType;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Tokens per group, at most: the rows of an A and a C tile.
const GROUP: usize = TILE_GROUP;
/// Row tiles ahead whose records a tile's first group prefetches.
const PREFETCH_TILES: usize = 2;

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`) where CPUID reports AMX-TILE and AMX-INT8: true where tile
/// instructions may run in this process from now on. Some hypervisors advertise AMX but do
/// not pass it through; the kernel then refuses the request and this is false.
pub(crate) fn request_tiles() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 reports it.
    #[allow(unused_unsafe)]
    let max = unsafe { std::arch::x86_64::__cpuid(0) }.eax;
    if max < 7 {
        return false;
    }
    // SAFETY: as above.
    #[allow(unused_unsafe)]
    let edx = unsafe { __cpuid_count(7, 0) }.edx;
    let (amx_tile, amx_int8) = (edx >> 24 & 1 == 1, edx >> 25 & 1 == 1);
    if !(amx_tile && amx_int8) {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: the request changes only which state components this process may use; it
        // reads and writes no memory of ours.
        let r =
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// Releases this thread's tile state when dropped (the registers become zero, the
/// configuration cleared): made before the first configuration, so that a panic leaves no
/// tile in use.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        // SAFETY: `tilerelease` needs only the granted tile state (a `Release` exists only in
        // `imp_run`, reachable only where it was granted); after it no tile is in use.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// A tile configuration (palette 1): C tiles 0–3 (`rows` × 64 bytes), A tiles 4 and 5
/// (`rows` × 32 bytes), B tiles 6 and 7 (8 × 64 bytes).
#[repr(C, align(64))]
struct TileCfg([u8; 64]);

impl TileCfg {
    fn new(rows: usize) -> TileCfg {
        debug_assert!((1..=GROUP).contains(&rows));
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut set = |t: usize, rows: usize, colsb: u16| {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows as u8;
        };
        for t in 0..4 {
            set(t, rows, 64);
        }
        set(4, rows, 32);
        set(5, rows, 32);
        set(6, 8, 64);
        set(7, 8, 64);
        TileCfg(c)
    }
}

thread_local! {
    /// A row tile's unpacked `Q4_x` weights: [`UNPACKED_LINES`] lines a block.
    static UNPACKED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// The entry installed in the lane table where tiles were granted: products with tile
/// records ([`LaneJob::tiles`]) on tiles, the rest on the AVX-512 kernel.
pub(crate) fn run(job: &LaneJob<'_>, rows: Range<usize>) {
    let Some(recs) = job.tiles else {
        return super::lanes::run(job, rows);
    };
    UNPACKED.with_borrow_mut(|unpacked| match job.w.ty() {
        // SAFETY: installed only where AVX-512 VNNI was detected and the tiles granted
        // (module docs).
        GgmlType::Q4_0 => unsafe { imp_run::<Q4_0>(job, rows, recs, unpacked) },
        // SAFETY: as above.
        GgmlType::Q4_1 => unsafe { imp_run::<Q4_1>(job, rows, recs, unpacked) },
        // SAFETY: as above.
        GgmlType::Q8_0 => unsafe { imp_run::<Q8_0>(job, rows, recs, unpacked) },
        // `LaneMatrix::repack` admits only the types above.
        _ => {}
    });
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn imp_run<const KIND: u8>(
    job: &LaneJob<'_>,
    rows: Range<usize>,
    acts: &[Line],
    unpacked: &mut Vec<Line>,
) {
    job.check(&rows);
    let tiles = rows.start / LANE_ROWS..rows.end / LANE_ROWS;
    let nb = job.w.nb();
    assert!(acts.len() >= tile_record_lines(job.n_tok, nb), "tile records");
    if tiles.is_empty() {
        return;
    }
    if KIND != Q8_0 && unpacked.len() < nb * UNPACKED_LINES {
        unpacked.resize(nb * UNPACKED_LINES, Line([0; 64]));
    }
    debug_assert_eq!(job.w.math(), crate::cpu::lanes::LaneMath::Fast, "tiles compute `Fast`");
    let lpr = rec_lines(job.w.ty());
    let _release = Release;
    let mut configured = 0;
    let mut first_group = 0;
    for (c0, m, groups) in tile_chunks(job.n_tok) {
        // The tiles are configured for the chunk's largest group; a smaller group's extra
        // A row is a stale row of its record, whose C row is never read.
        let rows = m.div_ceil(groups);
        if rows != configured {
            let cfg = TileCfg::new(rows);
            // SAFETY: the configuration is a valid palette-1 layout (64 bytes, aligned).
            unsafe {
                asm!("ldtilecfg [{c}]", c = in(reg) cfg.0.as_ptr(), options(nostack, readonly))
            };
            configured = rows;
        }
        let bound = |g: usize| c0 + g * m / groups;
        for tile in tiles.clone() {
            let ahead =
                (tile + PREFETCH_TILES < tiles.end).then(|| job.w.tile(tile + PREFETCH_TILES));
            let recs = job.w.tile(tile);
            let (b_base, b_stride): (*const u8, usize) = if KIND == Q8_0 {
                (recs.as_ptr().cast(), lpr * 64)
            } else {
                unpack(recs, job.w.ty(), &mut unpacked[..nb * UNPACKED_LINES]);
                (unpacked.as_ptr().cast(), UNPACKED_LINES * 64)
            };
            for g in 0..groups {
                let (t0, size) = (bound(g), bound(g + 1) - bound(g));
                let ops = Group {
                    recs: recs.as_ptr().cast(),
                    lpr,
                    b_base,
                    b_stride,
                    acts: acts[(first_group + g) * nb * TILE_REC_LINES..].as_ptr().cast(),
                    nb,
                    ahead: if g == 0 { ahead.map(|a| a.as_ptr().cast()) } else { None },
                };
                macro_rules! go {
                    ($($t:literal)*) => {
                        match size {
                            // SAFETY: configured for `rows` ≥ `size` rows; `ops` points into
                            // this tile's records, its B tiles and group `g`'s tile records
                            // (asserted above).
                            $($t => unsafe { group::<KIND, $t>(&ops, job, tile, t0) },)*
                            _ => unreachable!("groups have 1..=16 tokens"),
                        }
                    };
                }
                go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
            }
        }
        first_group += groups;
    }
}

/// Lines of a block's unpacked `Q4_x` weights: the 8 lines of its B tile, then its 16 rows'
/// `d` and `m` as f32.
const UNPACKED_LINES: usize = 10;

/// Unpacks a row tile's `Q4_x` records into B tiles and f32 scales ([`UNPACKED_LINES`] a
/// block): block `b`'s first 8 lines are the low nibbles of the record's vectors 0..4, then
/// their high nibbles; then its `d`, then its `m` (`Q4_1`; `Q4_0`'s record has no `m`, and the
/// line takes the bytes after its `d`, which nothing reads).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
fn unpack(recs: &[Line], ty: GgmlType, dst: &mut [Line]) {
    let low = _mm512_set1_epi8(0x0f);
    for (rec, out) in recs.chunks_exact(rec_lines(ty)).zip(dst.chunks_exact_mut(UNPACKED_LINES)) {
        for j in 0..4 {
            // SAFETY: line `j < 4` of the record is 64 readable bytes.
            let v = unsafe { _mm512_loadu_si512(rec[j].0.as_ptr().cast()) };
            let (l, h) =
                (_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
            // SAFETY: `out` holds `UNPACKED_LINES` lines of 64 writable bytes.
            unsafe { _mm512_storeu_si512(out[j].0.as_mut_ptr().cast(), l) };
            // SAFETY: as above.
            unsafe { _mm512_storeu_si512(out[4 + j].0.as_mut_ptr().cast(), h) };
        }
        let at = d_offset(ty);
        let bytes: &[u8] = bytemuck::cast_slice(rec);
        // The record's 16 `d` and 16 `m` (f16), 64 bytes from `d_offset`, as f32 in lines 8
        // and 9.
        for (half, line) in [(0, 8), (32, 9)] {
            let src = &bytes[at + half..at + half + 32];
            // SAFETY: `src` is 32 readable bytes.
            let v = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(src.as_ptr().cast()) });
            // SAFETY: line `line` of `out` is 64 writable bytes.
            unsafe { _mm512_storeu_ps(out[line].0.as_mut_ptr().cast(), v) };
        }
    }
}

/// One group's operands: the row tile's weight records (`lpr` lines each, `nb` of them), its
/// B tiles (block `b` at `b_base + b · b_stride`), the group's activation records
/// ([`TILE_REC_LINES`] lines a block), and a later tile's records to prefetch.
struct Group {
    recs: *const u8,
    lpr: usize,
    b_base: *const u8,
    b_stride: usize,
    acts: *const u8,
    nb: usize,
    ahead: Option<*const u8>,
}

/// Blocks whose tile products run ahead of the block being scaled.
const LAG: usize = 3;
/// C tiles in memory: the one being scaled and those ahead of it.
const SETS: usize = LAG + 1;

/// [`SETS`] × 16 lines of C tiles as stored.
#[repr(C, align(64))]
struct CBuf([[i32; 16]; SETS * GROUP]);

/// One block's tile product in tile set `P` (C `tmmP` ← A `tmm(4 + P % 2)` · B `tmm(6 + P %
/// 2)`), stored at `cp` (16 lines). Four C tiles rotate: a C tile is zeroed again only
/// after its store, and the registers are not renamed.
///
/// # Safety
/// `a` must have the configured rows of 32 readable bytes at stride 32, `b` 8 readable lines
/// of 64 bytes at stride 64, `cp` 16 writable lines; the tiles configured ([`TileCfg`]).
#[inline(always)]
unsafe fn tile_block(p: usize, a: *const u8, b: *const u8, cp: *mut u8) {
    macro_rules! block {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tileloadd tmm", $a, ", [{a} + {s}*1]"),
                concat!("tileloadd tmm", $b, ", [{b} + {l}*1]"),
                concat!("tilezero tmm", $c),
                concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
                concat!("tilestored [{c} + {l}*1], tmm", $c),
                a = in(reg) a, s = in(reg) 32usize, b = in(reg) b, l = in(reg) 64usize,
                c = in(reg) cp, options(nostack),
            )
        };
    }
    match p % 4 {
        // SAFETY: (callers) as the function's contract.
        0 => unsafe { block!("0", "4", "6") },
        // SAFETY: as above.
        1 => unsafe { block!("1", "5", "7") },
        // SAFETY: as above.
        2 => unsafe { block!("2", "4", "6") },
        // SAFETY: as above.
        _ => unsafe { block!("3", "5", "7") },
    }
}

/// `v · x`, `x` the f32 at `p + OFF` broadcast by the load.
///
/// # Safety
/// `p + OFF` must be 4 readable bytes (of a tile record, in the callers).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn mul_at<const OFF: usize>(v: __m512, p: *const u8) -> __m512 {
    let r: __m512;
    // SAFETY: (callers) `p + OFF` is 4 readable bytes.
    unsafe {
        asm!("vmulps {r}, {v}, dword ptr [{p} + {o}]{{1to16}}", r = lateout(zmm_reg) r,
            v = in(zmm_reg) v, p = in(reg) p, o = const OFF,
            // Not `preserves_flags`: MXCSR's exception flags, as the intrinsic's would.
            options(pure, readonly, nostack))
    };
    r
}

/// `acc + m · x` in one rounding, `x` the f32 at `p + OFF` broadcast by the load.
///
/// # Safety
/// As [`mul_at`].
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fmadd_at<const OFF: usize>(mut acc: __m512, m: __m512, p: *const u8) -> __m512 {
    // SAFETY: as [`mul_at`].
    unsafe {
        asm!("vfmadd231ps {acc}, {m}, dword ptr [{p} + {o}]{{1to16}}",
            acc = inout(zmm_reg) acc, m = in(zmm_reg) m, p = in(reg) p, o = const OFF,
            options(pure, readonly, nostack))
    };
    acc
}

/// `v + x` (i32 lanes), `x` the i32 at `p + OFF` broadcast by the load.
///
/// # Safety
/// As [`mul_at`].
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn add_at<const OFF: usize>(v: __m512i, p: *const u8) -> __m512i {
    let r: __m512i;
    // SAFETY: as [`mul_at`].
    unsafe {
        asm!("vpaddd {r}, {v}, dword ptr [{p} + {o}]{{1to16}}", r = lateout(zmm_reg) r,
            v = in(zmm_reg) v, p = in(reg) p, o = const OFF,
            options(pure, readonly, nostack, preserves_flags))
    };
    r
}

/// The `T` tokens `t0..` of one group over row tile `tile`: their 16 outputs each.
///
/// # Safety
/// The tiles configured for at least `T` rows; `g`'s pointers as [`Group`] describes them:
/// `g.nb` tile records from `g.acts`, B tiles of `g.nb` blocks from `g.b_base`, `g.nb`
/// weight records from `g.recs`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")]
#[inline]
unsafe fn group<const KIND: u8, const T: usize>(
    g: &Group,
    job: &LaneJob<'_>,
    tile: usize,
    t0: usize,
) {
    let ty = kind_ty(KIND);
    let mut c = std::mem::MaybeUninit::<CBuf>::uninit();
    // Written by the tile stores and read by the scaling, both through this pointer; every
    // line is stored before it is read.
    let cp: *mut u8 = c.as_mut_ptr().cast();
    let set = |b: usize| cp.wrapping_add((b % SETS) * GROUP * 64);
    let mut acc = [_mm512_setzero_ps(); T];
    let act = |b: usize| g.acts.wrapping_add(b * TILE_REC_LINES * 64);
    let bt = |b: usize| g.b_base.wrapping_add(b * g.b_stride);
    // The first blocks' tile products, `LAG` ahead of the scaling.
    for b in 0..LAG.min(g.nb) {
        // SAFETY: block `b`'s A rows and B lines (callers: `Group`), a set of `c`.
        unsafe { tile_block(b, act(b), bt(b), set(b)) };
    }
    for b in 0..g.nb {
        if let Some(ahead) = g.ahead {
            for l in 0..g.lpr {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add((b * g.lpr + l) * 64).cast());
            }
        }
        // A later block's tile product first, into another set, while this one scales.
        let n = b + LAG;
        if n < g.nb {
            // SAFETY: as above.
            unsafe { tile_block(n, act(n), bt(n), set(n)) };
        }
        let (dw, mw) = if KIND == Q8_0 {
            let rec = g.recs.wrapping_add(b * g.lpr * 64);
            // SAFETY: the scales are 32 bytes at `d_offset`, inside the record.
            let d = unsafe { _mm256_loadu_si256(rec.wrapping_add(d_offset(ty)).cast()) };
            (_mm512_cvtph_ps(d), _mm512_setzero_ps())
        } else {
            let u = bt(b);
            // SAFETY: line 8 of the block's unpacked lines, its `d` as f32.
            let d = unsafe { _mm512_loadu_ps(u.wrapping_add(512).cast()) };
            // SAFETY: line 9, its `m`.
            let m = unsafe { _mm512_loadu_ps(u.wrapping_add(576).cast()) };
            (d, m)
        };
        let lines = set(b);
        let a = act(b);
        macro_rules! token {
            ($t:literal) => {
                if $t < T {
                    // SAFETY: line `$t` of this block's set of `c` (64 aligned bytes) holds
                    // token `$t`'s 16 integers.
                    let mut i = unsafe { _mm512_load_si512(lines.add($t * 64).cast()) };
                    if KIND != Q4_1 {
                        // SAFETY: `a` is this block's tile record (`TILE_REC_LINES` lines);
                        // token `$t`'s `corr_sum` lies inside it.
                        i = unsafe { add_at::<{ TILE_CORR + 4 * $t }>(i, a) };
                    }
                    // SAFETY: as above, its `d`.
                    let d = unsafe { mul_at::<{ TILE_D + 4 * $t }>(dw, a) };
                    acc[$t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), d, acc[$t]);
                    if KIND == Q4_1 {
                        // SAFETY: as above, its `s`.
                        acc[$t] = unsafe { fmadd_at::<{ TILE_S + 4 * $t }>(acc[$t], mw, a) };
                    }
                }
            };
        }
        sixteen!(token);
    }
    for (t, acc) in acc.iter().enumerate() {
        let dst = job.out.range((t0 + t) * job.w.rows() + tile * LANE_ROWS, LANE_ROWS);
        // SAFETY: `dst` is 16 writable floats.
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), *acc) };
    }
}

const fn kind_ty(kind: u8) -> GgmlType {
    match kind {
        Q4_0 => GgmlType::Q4_0,
        Q4_1 => GgmlType::Q4_1,
        _ => GgmlType::Q8_0,
    }
}

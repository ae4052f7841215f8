//! CPU kernel dispatch: the instruction-set level is detected once and a table of kernel
//! function pointers is built for it; callers hold `&'static Kernels` and never re-check.
//!
//! Layout: the modules beside `arch/` are portable (tables, dispatch, layouts and scalar
//! code); all SIMD code lives in `arch/`, one folder per architecture, compiled only for it
//! (outside it, only [`prefetch_l2`]'s cache hint names an x86 instruction).
//!
//! * [`reference`](mod@reference): the scalar twins (the portable path and the oracle every
//!   SIMD kernel is tested against).
//! * [`exact`]: the kernels whose rounding matches ggml's at each level, their scalar forms
//!   and the slots they take in each level's table.
//! * [`gemm`]: the tiled matrix products' table, job and packed activation layouts.
//! * [`lanes`]: row-lane weight matrices, their repacking and the row-lane kernels' table.
//! * `rope`: [`crate::ops::rope_cache`] and the scalar rotations of both modes, whose bodies
//!   the SIMD levels' rope entries inline.
//! * `attn`: the operands of paged attention ([`crate::ops::PagedHead`],
//!   [`crate::ops::AttnHeadJob`], [`crate::ops::AttnScratch`], …), which `ops` validates and
//!   the fused kernels read.
//! * `disjoint`: the output buffer that the threads of one pool run write at disjoint rows.
//! * `arch/x86_64/`: `avx2` and `avx512` (each level's table), `exact`, `attn`, `gemm` and
//!   `lanes` (the x86 forms of the modules above and the fused attention kernel).
//!
//! `rope`, `attn` and `disjoint` are crate-internal; their public items are re-exported from
//! [`crate::ops`]. No module under `cpu` imports `ops`, `greedy` or `model`: those build on
//! `cpu`, not the other way round.
//!
//! A table for a level is only ever built after the CPU has been seen to support it, which
//! is what makes the safe wrappers around `#[target_feature]` functions sound.

pub(crate) mod attn;
pub(crate) mod disjoint;
pub mod exact;
pub mod gemm;
pub mod lanes;
pub mod reference;
pub(crate) mod rope;

#[cfg(target_arch = "x86_64")]
pub(crate) mod arch;

use std::sync::OnceLock;

use half::f16;

use crate::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};
use crate::quant_k::{BlockQ4K, BlockQ6K, BlockQ8K};

/// An instruction-set level with its own kernel table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable scalar code (always available).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/DQ/VL + VNNI (plus everything in `Avx2`).
    Avx512,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The name used on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// Parses [`SimdLevel::name`].
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name() == s)
    }

    /// Whether this CPU can run kernels of this level.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.is_supported()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best level this CPU supports.
    pub fn detect() -> SimdLevel {
        Self::ALL.into_iter().rev().find(|l| l.is_supported()).unwrap_or(SimdLevel::Scalar)
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernel table for one [`SimdLevel`].
///
/// Slices passed to the dot products must have equal block counts; the kernels check this
/// with `debug_assert!` only, because callers (matmul) validate shapes once per matrix.
#[derive(Debug, Clone, Copy)]
pub struct Kernels {
    /// The level this table was built for.
    pub level: SimdLevel,
    /// f32 → `Q8_0` activations.
    pub quantize_q8_0: fn(&[f32], &mut [BlockQ8_0]),
    /// f32 → `Q8_1` activations.
    pub quantize_q8_1: fn(&[f32], &mut [BlockQ8_1]),
    /// f32 → `Q8_K` activations.
    pub quantize_q8_k: fn(&[f32], &mut [BlockQ8K]),
    /// `Q4_0` · `Q8_0`.
    pub dot_q4_0_q8_0: fn(&[BlockQ4_0], &[BlockQ8_0]) -> f32,
    /// `Q4_1` · `Q8_1`.
    pub dot_q4_1_q8_1: fn(&[BlockQ4_1], &[BlockQ8_1]) -> f32,
    /// `Q8_0` · `Q8_0`.
    pub dot_q8_0_q8_0: fn(&[BlockQ8_0], &[BlockQ8_0]) -> f32,
    /// `Q4_K` · `Q8_K`.
    pub dot_q4_k_q8_k: fn(&[BlockQ4K], &[BlockQ8K]) -> f32,
    /// `Q6_K` · `Q8_K`.
    pub dot_q6_k_q8_k: fn(&[BlockQ6K], &[BlockQ8K]) -> f32,
    /// f16 · f16 with the association of ggml's `vec_dot_f16` at this level.
    pub dot_f16: fn(&[f16], &[f16]) -> f32,
    /// f16 · f16 with the association of llamafile's tinyBLAS at this level (ggml's
    /// multi-token f16 matrix products); falls back to `dot_f16` where tinyBLAS would.
    pub dot_f16_gemm: fn(&[f16], &[f16]) -> f32,
    /// How `dot_f16` / `dot_f16_gemm` associate, for sums computed outside them.
    pub attn: exact::AttnShapes,
    /// bf16 · bf16 (raw `u16` bit patterns), accumulated in f32.
    pub dot_bf16: fn(&[u16], &[u16]) -> f32,
    /// f32 · f32.
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// f32 → f16, round to nearest even.
    pub f32_to_f16: fn(&[f32], &mut [f16]),
    /// f32 → bf16 bit patterns, round to nearest even.
    pub f32_to_bf16: fn(&[f32], &mut [u16]),
    /// f16 → f32.
    pub f16_to_f32: fn(&[f16], &mut [f32]),
    /// `y = fma(a, x, y)` elementwise with `x` in f16 (one rounding per element).
    pub axpy_f16: fn(f32, &[f16], &mut [f32]),
    /// `out = x / rms(x) * w` (ggml's `rms_norm` followed by `mul`).
    pub rmsnorm: fn(&[f32], &[f32], f32, &mut [f32]),
    /// [`Kernels::rmsnorm`] of every `w.len()`-long row of `x` into the same row of `out`
    /// (the same bits as row by row).
    pub rmsnorm_rows: fn(&[f32], &[f32], f32, &mut [f32]),
    /// In-place `x = softmax(x * scale)`; returns nothing, `x` must be non-empty.
    pub softmax: fn(&mut [f32], f32),
    /// `out = silu(gate) * up`.
    pub swiglu: fn(&[f32], &[f32], &mut [f32]),
    /// Rope in normal mode with a position's `[cos, sin]` table ([`crate::ops::rope_norm`]).
    pub rope_norm: fn(&mut [f32], &[f32], usize),
    /// Rope in NeoX mode ([`crate::ops::rope_neox`]).
    pub rope_neox: fn(&mut [f32], &[f32], usize),
    /// One query head's whole attention (scores, softmax, weighted values) with the bits of
    /// the generic path built from the entries above ([`crate::ops::attention_generic`]);
    /// `None` where the level has no fused kernel.
    pub attn_head: Option<attn::AttnHeadFn>,
    /// The query heads of one KV head in the free association of the non-exact arithmetics,
    /// with the bits of [`crate::ops::attention_free_twin`]; `None` where the level has no
    /// such kernel (the free arithmetics then attend in ggml's association).
    pub attn_free: Option<attn::AttnHeadFn>,
    /// [`Kernels::attn_free`] of a tile of consecutive prompt tokens, each key row converted
    /// once for the tile, each token's bits those `attn_free` gives it; `None` where the level
    /// has no such kernel.
    pub attn_free_tile: Option<attn::AttnTileFn>,
    /// Matrix products over tiles of rows × tokens, bit-identical to the dot products above
    /// (used by [`crate::ops::matmul`]; types without an entry use the dot products).
    pub gemm: gemm::Gemm,
    /// The matrix product over row-lane weights ([`lanes`]), where this level has one; used
    /// for every matrix a model repacked (see [`crate::model::LlamaModel::repack`]).
    pub lanes: Option<lanes::Lanes>,
}

impl Kernels {
    /// The table for `level`, or `None` if this CPU does not support it; with AMX tiles where
    /// they are granted ([`tiles_granted`]).
    pub fn for_level(level: SimdLevel) -> Option<Kernels> {
        Self::for_level_with(level, true)
    }

    /// [`Kernels::for_level`], with AMX tiles only where `tiles` (without, the OS is not
    /// asked for the tile state at all).
    pub fn for_level_with(level: SimdLevel, tiles: bool) -> Option<Kernels> {
        if !level.is_supported() {
            return None;
        }
        let mut k = match level {
            SimdLevel::Scalar => reference::KERNELS,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => arch::x86_64::avx2::kernels(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => arch::x86_64::avx512::kernels(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => return None,
        };
        exact::patch(&mut k);
        k.gemm = gemm::table(level);
        k.lanes = lanes::table(level, tiles);
        Some(k)
    }

    /// Whether this CPU's row-lane `Fast` products ([`lanes::LaneMath::Fast`]) run markedly
    /// faster than its `Exact` ones — by more than the 3 % of the multiply-adds that `split`
    /// computes twice (6 % of a layer's, in half the layers: [`crate::model::Arith::Split`]).
    /// False where the level has no row-lane kernels, and on AMD's family 1Ah (Zen 5) and
    /// later, whose full-width 512-bit FMA pipes run `Exact`'s extra multiply-adds at no
    /// cost (measured there, `fast` over `exact`: prompts 0.97×, one stream's decode 1.00×,
    /// 16 streams 1.04×; on an Intel Xeon with AVX-512 VNNI 1.31×, 1.04×, 1.32×; on AMD
    /// Zen 4, 1.6× on the products, 1.3× serving). kernels/PERF.md has the tables.
    pub fn fast_lanes_pay(&self) -> bool {
        if self.lanes.is_none() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        return !arch::x86_64::amd_family_1ah_or_later();
        #[cfg(not(target_arch = "x86_64"))]
        return true;
    }
}

impl Kernels {
    /// Whether the row-lane `Fast` products of several tokens run on AMX tiles
    /// ([`tiles_granted`]).
    pub fn uses_tiles(&self) -> bool {
        self.lanes.is_some_and(|l| l.tiles)
    }

    /// The level's name, with `+amx` where [`Kernels::uses_tiles`] (for reports: tiles
    /// change speed, never bits, so fingerprints of computed bits use the level alone).
    pub fn label(&self) -> String {
        if self.uses_tiles() {
            format!("{}+amx", self.level.name())
        } else {
            self.level.name().to_string()
        }
    }

    /// The same table with the row-lane products on the level's vector kernel alone (no AMX
    /// tiles), for comparison and for `--no-amx`.
    pub fn without_tiles(mut self) -> Kernels {
        #[cfg(target_arch = "x86_64")]
        if self.uses_tiles() {
            self.lanes = Some(arch::x86_64::lanes::avx512());
        }
        self
    }
}

/// Whether this CPU has AMX-INT8 tiles and the OS granted this process their state (asked
/// once, on first call; Linux only). Some hypervisors advertise AMX without passing it
/// through: the OS then refuses and this is false.
pub fn tiles_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        return SimdLevel::Avx512.is_supported() && arch::x86_64::tiles::request_tiles();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    })
}

/// Asks for every cache line of `data` to be fetched into L2; a hint without effect on
/// results (nothing on other architectures).
pub fn prefetch_l2(data: &[u8]) {
    // A plain stride over the lines (`chunks(64)` computes every chunk's length: several
    // instructions a line, on a path that asks for a decode step's cache rows).
    #[cfg(target_arch = "x86_64")]
    for off in (0..data.len()).step_by(64) {
        // SAFETY: a prefetch never faults and has no architectural effect; the address is
        // inside `data`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                data.as_ptr().wrapping_add(off).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Asks the OS to back the 2 MiB-aligned interior of the `len` bytes at `start` with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)`, for systems whose THP setting is
/// `madvise`). Call it on memory of one's own allocation before its pages are first
/// touched. A hint without effect on contents; refusals are ignored.
pub(crate) fn advise_huge_pages(start: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (lo, hi) =
            ((start as usize).next_multiple_of(HUGE), (start as usize + len) / HUGE * HUGE);
        if hi > lo {
            // SAFETY: MADV_HUGEPAGE changes how pages are backed, never what they hold, and
            // the call reads or writes no memory of ours; a range that is not mapped makes
            // it fail, which is ignored.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}

static ACTIVE: OnceLock<Kernels> = OnceLock::new();

/// The process-wide kernel table: the best level this CPU supports, unless
/// [`select`] chose another before first use.
pub fn kernels() -> &'static Kernels {
    ACTIVE.get_or_init(|| Kernels::for_level(SimdLevel::detect()).unwrap_or(reference::KERNELS))
}

/// Errors from [`select`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectError {
    /// The CPU lacks the instructions of the requested level.
    #[error("this CPU does not support the {0} kernels")]
    Unsupported(SimdLevel),
    /// The table was already fixed (by an earlier call or first use).
    #[error("kernel level already fixed to {0}")]
    AlreadySet(SimdLevel),
    /// The table was already fixed at this level, with AMX tiles (`true`) or without.
    #[error("kernel table already fixed, AMX tiles {}", if *.0 { "on" } else { "off" })]
    TilesAlreadySet(bool),
}

/// Fixes the process-wide kernel level. Must run before the first [`kernels`] call.
pub fn select(level: SimdLevel) -> Result<&'static Kernels, SelectError> {
    select_table(Kernels::for_level(level).ok_or(SelectError::Unsupported(level))?)
}

/// Fixes the process-wide kernel table (a [`Kernels::for_level`], perhaps
/// [`Kernels::without_tiles`]). Must run before the first [`kernels`] call.
pub fn select_table(table: Kernels) -> Result<&'static Kernels, SelectError> {
    let level = table.level;
    let mut fresh = false;
    let k = ACTIVE.get_or_init(|| {
        fresh = true;
        table
    });
    if !fresh && k.level != level {
        return Err(SelectError::AlreadySet(k.level));
    }
    if !fresh && k.uses_tiles() != table.uses_tiles() {
        return Err(SelectError::TilesAlreadySet(k.uses_tiles()));
    }
    Ok(k)
}

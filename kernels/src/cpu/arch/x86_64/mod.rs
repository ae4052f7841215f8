//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 with VNNI.
//!
//! * [`avx2`], [`avx512`]: each level's kernel table (quantizers, dot products, conversions,
//!   norms, rope) as it is built before [`crate::cpu::exact`] swaps in its ggml-pinned slots.
//! * [`exact`]: those ggml-pinned slots (f16 dot products in both of ggml's shapes, softmax,
//!   SwiGLU, `axpy_f16`) for both levels.
//! * [`attn`]: the fused AVX-512 attention of the query heads of one KV head, in ggml's
//!   association ([`crate::cpu::Kernels::attn_head`]) and in the free one
//!   ([`crate::cpu::Kernels::attn_free`]).
//! * [`gemm`]: the tiled matrix kernels of [`crate::cpu::gemm`], AVX2 and AVX-512 VNNI.
//! * [`lanes`]: the AVX-512 VNNI row-lane matrix kernel of [`crate::cpu::lanes`].
//! * [`tiles`]: its `Fast` products on AMX tiles, where the CPU and the OS allow them.

/// `$m!(0); … $m!(15);`: a kernel's 16 tokens written out one by one, each under a constant
/// test (`$t < T`) that folds away, so that LLVM keeps their accumulators in registers (left
/// as a loop over `0..T`, it kept even eight of them on the stack).
macro_rules! sixteen {
    ($m:ident) => {
        $m!(0);
        $m!(1);
        $m!(2);
        $m!(3);
        $m!(4);
        $m!(5);
        $m!(6);
        $m!(7);
        $m!(8);
        $m!(9);
        $m!(10);
        $m!(11);
        $m!(12);
        $m!(13);
        $m!(14);
        $m!(15);
    };
}

pub(crate) mod attn;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod exact;
pub(crate) mod gemm;
pub(crate) mod lanes;
pub(crate) mod tiles;

#[cfg(test)]
mod tests;

/// Whether the CPU is AMD's and of family 1Ah or later (Zen 5 on), from CPUID leaves 0 and
/// 1 ([`amd_family_1ah_or_later_of`]).
#[allow(unused_unsafe)] // `__cpuid` is safe in recent Rust, unsafe in the declared minimum
pub(crate) fn amd_family_1ah_or_later() -> bool {
    use std::arch::x86_64::__cpuid;
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 0 is always valid, and leaf 1 is read
    // only where leaf 0 reports it.
    let l0 = unsafe { __cpuid(0) };
    // SAFETY: as above.
    let eax1 = if l0.eax >= 1 { unsafe { __cpuid(1) }.eax } else { 0 };
    amd_family_1ah_or_later_of([l0.ebx, l0.edx, l0.ecx], eax1)
}

/// [`amd_family_1ah_or_later`] from leaf 0's vendor registers (EBX, EDX, ECX) and leaf 1's
/// EAX: the family is the base family, plus the extended family where the base is 0Fh, as
/// both vendors define it.
pub(crate) fn amd_family_1ah_or_later_of(vendor: [u32; 3], eax1: u32) -> bool {
    // "AuthenticAMD" as leaf 0 spells it.
    let amd = vendor == [0x6874_7541, 0x6974_6e65, 0x444d_4163];
    let base = (eax1 >> 8) & 0xf;
    let family = if base == 0xf { base + ((eax1 >> 20) & 0xff) } else { base };
    amd && family >= 0x1a
}

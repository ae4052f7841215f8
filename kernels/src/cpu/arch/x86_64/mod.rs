//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 with VNNI.
//!
//! * [`avx2`], [`avx512`]: each level's kernel table (quantizers, dot products, conversions,
//!   norms, rope) as it is built before [`crate::cpu::exact`] swaps in its ggml-pinned slots.
//! * [`exact`]: those ggml-pinned slots (f16 dot products in both of ggml's shapes, softmax,
//!   SwiGLU, `axpy_f16`) for both levels.
//! * [`attn`]: the fused AVX-512 attention of the query heads of one KV head
//!   ([`crate::cpu::Kernels::attn_head`]).
//! * [`gemm`]: the tiled matrix kernels of [`crate::cpu::gemm`], AVX2 and AVX-512 VNNI.
//! * [`lanes`]: the AVX-512 VNNI row-lane matrix kernel of [`crate::cpu::lanes`].

pub(crate) mod attn;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod exact;
pub(crate) mod gemm;
pub(crate) mod lanes;

#[cfg(test)]
mod tests;

//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 with VNNI.

pub(crate) mod avx2;
pub(crate) mod avx512;

#[cfg(test)]
mod tests;

//! Instruction-set specific kernels, one folder per architecture.

pub(crate) mod x86_64;

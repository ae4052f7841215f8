//! GGUF model files: a memory-mapped reader of the header, metadata and tensor table.

mod types;

pub use types::{GgmlType, QK_K};

//! GGUF model files: a memory-mapped reader of the header, metadata and tensor table, and a
//! writer for building files.
//!
//! [`GgufFile::open`] maps a file and validates all of it up front: every metadata value, the
//! tensor table, the alignment, and that each tensor's data lies inside the file, aligned,
//! without overlapping another. Afterwards nothing it hands out can point outside the file.
//! Corrupt input gives a [`GgufError`], never a panic or an allocation larger than the file.
//!
//! [`GgufWriter`] builds files (tests and synthetic models).

mod error;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{DEFAULT_ALIGNMENT, GgufFile, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, TensorInfo};
pub use types::{GgmlType, QK_K};
pub use value::{MetaArray, MetaValue, MetaValueType};
pub use writer::GgufWriter;

//! The errors of reading, querying and writing GGUF files.

use std::path::PathBuf;

/// Everything that can go wrong reading, querying or writing a GGUF file.
///
/// Offsets in messages are byte offsets from the start of the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, mapped or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A version other than 2 or 3.
    #[error("{}", version_message(*version))]
    UnsupportedVersion {
        /// The version field as read (little-endian).
        version: u32,
    },
    /// The file ends inside a structure.
    #[error("truncated file: {what} at byte {offset} needs {needed} bytes, only {available} left")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Where.
        offset: usize,
        /// Bytes needed.
        needed: u64,
        /// Bytes left in the file.
        available: usize,
    },
    /// A count or length that cannot fit in the rest of the file.
    #[error(
        "corrupt {what} count {count} at byte {offset}: {count} entries of at least \
         {min_size} bytes cannot fit in the {available} bytes left"
    )]
    CountTooLarge {
        /// What was being counted.
        what: &'static str,
        /// Where the count was read.
        offset: usize,
        /// The count read.
        count: u64,
        /// Fewest bytes one entry takes.
        min_size: usize,
        /// Bytes left in the file.
        available: usize,
    },
    /// A string that is not UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// What was being read.
        what: &'static str,
        /// Where the string bytes start.
        offset: usize,
    },
    /// A metadata value type id the format does not define.
    #[error("metadata key {key:?}: unknown value type id {type_id}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The id read.
        type_id: u32,
    },
    /// Arrays nested deeper than [`crate::MAX_ARRAY_DEPTH`].
    #[error("metadata key {key:?}: arrays nested deeper than {max}")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The limit.
        max: usize,
    },
    /// The same metadata key twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    /// `general.alignment` is not a non-zero power of two stored as u32.
    #[error("general.alignment must be a u32 power of two, found {0}")]
    BadAlignment(String),
    /// A tensor with more than four dimensions.
    #[error("tensor {name:?}: {n_dims} dimensions, at most 4 are supported")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Dimensions declared.
        n_dims: u32,
    },
    /// A tensor dimension above `i64::MAX`.
    #[error("tensor {name:?}: dimension {index} has invalid length {value}")]
    BadDim {
        /// The tensor.
        name: String,
        /// Which dimension.
        index: usize,
        /// Its length.
        value: u64,
    },
    /// A tensor whose element count or byte size does not fit in 64 bits.
    #[error("tensor {name:?}: shape {dims:?} overflows")]
    ShapeOverflow {
        /// The tensor.
        name: String,
        /// Its dimensions.
        dims: Vec<u64>,
    },
    /// A tensor type id ggml does not define.
    #[error("tensor {name:?}: unknown ggml type id {id}")]
    UnknownTensorType {
        /// The tensor.
        name: String,
        /// The id read.
        id: u32,
    },
    /// Rows that are not a whole number of quantisation blocks.
    #[error("tensor {name:?}: row length {row} is not a multiple of the {ty} block size {block}")]
    PartialBlock {
        /// The tensor.
        name: String,
        /// Elements per row.
        row: u64,
        /// The type.
        ty: crate::GgmlType,
        /// Its block size.
        block: usize,
    },
    /// The same tensor name twice.
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    /// A data offset that is not a multiple of the alignment.
    #[error("tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// The tensor.
        name: String,
        /// Offset from the data section start.
        offset: u64,
        /// The file alignment.
        alignment: u64,
    },
    /// Tensor data that does not lie inside the file.
    #[error(
        "tensor {name:?}: data at bytes {start}..{end} lies outside the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        /// The tensor.
        name: String,
        /// Absolute start (saturated on overflow).
        start: u64,
        /// Absolute end (saturated on overflow).
        end: u64,
        /// File length.
        file_len: usize,
    },
    /// Two tensors whose data overlap.
    #[error("tensors {first:?} and {second:?} overlap")]
    TensorOverlap {
        /// The tensor starting first.
        first: String,
        /// The one starting inside it.
        second: String,
    },
    /// A metadata key that is not present.
    #[error("metadata key {0:?} not found")]
    MissingKey(String),
    /// A metadata key holding a value of another type.
    #[error("metadata key {key:?} holds {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the getter wanted.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// An integer that does not fit the requested type.
    #[error("metadata key {key:?}: value {value} does not fit in {target}")]
    OutOfRange {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// The requested type.
        target: &'static str,
    },
    /// A tensor that is not present.
    #[error("tensor {0:?} not found")]
    MissingTensor(String),
    /// The writer was given tensor data whose length does not match its shape and type.
    #[error("tensor {name:?}: {actual} bytes of data given, shape and type need {expected}")]
    TensorSizeMismatch {
        /// The tensor.
        name: String,
        /// Bytes the shape needs.
        expected: u64,
        /// Bytes given.
        actual: usize,
    },
    /// Writing the built file failed.
    #[error("writing GGUF data failed: {0}")]
    Write(#[source] std::io::Error),
    /// The writer was asked for a version it does not write.
    #[error("cannot write GGUF version {0}: only versions 2 and 3")]
    UnwritableVersion(u32),
}

fn version_message(version: u32) -> String {
    match version {
        1 => "GGUF version 1 is not supported: convert the file to version 3 with a recent \
              llama.cpp (only versions 2 and 3 are read)"
            .to_owned(),
        v if v != 0 && v & 0xFFFF == 0 => format!(
            "GGUF version field {v:#x} looks byte-swapped: big-endian GGUF files are not supported"
        ),
        v => format!("unsupported GGUF version {v} (only versions 2 and 3 are read)"),
    }
}

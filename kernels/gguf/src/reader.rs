//! Parsing and validating a GGUF file: header, metadata, tensor table, data section.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;

use crate::error::GgufError;
use crate::types::GgmlType;
use crate::value::{MetaArray, MetaValue, MetaValueType};

/// The alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// The deepest nesting of arrays inside arrays that the reader accepts.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// Fewest bytes one tensor-table entry takes: name length, dimension count, type, offset.
const MIN_TENSOR_INFO_SIZE: usize = 8 + 4 + 4 + 8;

/// Fewest bytes one metadata entry takes: key length, value type, a one-byte value.
const MIN_KV_SIZE: usize = 8 + 4 + 1;

/// One entry of the tensor table.
///
/// The public fields describe the tensor; where its bytes are is kept privately, fixed when
/// the file was opened and checked against the file then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first as in ggml: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    n_elements: u64,
    size_bytes: u64,
    range: Range<usize>,
}

impl TensorInfo {
    /// Number of elements (1 for a tensor with no dimensions, as in ggml).
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Bytes of data.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Row length (`dims[0]`, or 1 for a tensor with no dimensions).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (the product of all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// Where the file bytes live: a read-only memory map, or an owned 64-byte-aligned copy.
enum Backing {
    Mmap(memmap2::Mmap),
    Owned { chunks: Vec<Align64>, len: usize },
}

/// 64 bytes aligned to 64, the unit of owned storage so tensor data keeps its alignment.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Align64([u8; 64]);

impl Backing {
    fn owned(bytes: &[u8]) -> Self {
        let mut chunks = vec![Align64([0; 64]); bytes.len().div_ceil(64)];
        for (chunk, src) in chunks.iter_mut().zip(bytes.chunks(64)) {
            chunk.0[..src.len()].copy_from_slice(src);
        }
        Backing::Owned { chunks, len: bytes.len() }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned { chunks, len } => {
                debug_assert!(*len <= chunks.len() * 64);
                // SAFETY: `Align64` is `repr(C)` around `[u8; 64]`, so `chunks` is
                // `chunks.len() * 64` initialised, contiguous bytes; `len` never exceeds that
                // (set together in `owned`), and the slice borrows `chunks` immutably.
                unsafe { std::slice::from_raw_parts(chunks.as_ptr().cast::<u8>(), *len) }
            }
        }
    }
}

/// A parsed GGUF file (version 2 or 3): metadata in file order, the tensor table and the
/// tensor data, all validated when the file is opened.
pub struct GgufFile {
    backing: Backing,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("len", &self.bytes().len())
            .field("mmap", &matches!(self.backing, Backing::Mmap(_)))
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    ///
    /// The file must not be modified or truncated while the returned value is alive (the
    /// usual condition of memory-mapped model loading).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let backing = if len == 0 {
            // Mapping an empty file fails on some systems; parse it from memory instead, which
            // reports the truncation.
            Backing::owned(&[])
        } else {
            // SAFETY: the map is read-only and private to this value. Its contents stay valid
            // as long as no other process truncates or rewrites the file while it is mapped,
            // which `open` documents as a condition of use; every access goes through
            // bounds-checked slices of the map.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
            Backing::Mmap(map)
        };
        Self::parse(backing)
    }

    /// Lets the operating system drop the pages of bytes `range` from this process's resident
    /// memory (`madvise(MADV_DONTNEED)`): for data that was copied elsewhere and will be
    /// read rarely if ever. The bytes stay readable and unchanged (a later read maps them
    /// again from the page cache). A no-op for files held in memory, and best effort: an
    /// out-of-range request or a refusal by the OS changes nothing.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let Backing::Mmap(m) = &self.backing
            && range.start < range.end
            && range.end <= m.len()
        {
            // SAFETY: the map is a read-only shared mapping of a file, so `MADV_DONTNEED`
            // only drops page-table entries: no data is discarded (nothing was written) and
            // every later read faults the same file contents back in; references into the
            // map stay valid. The range lies inside the map (checked above).
            let _ = unsafe {
                m.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.end - range.start,
                )
            };
        }
    }

    /// Parses a file held in memory (tests, fuzzing, files built with [`crate::GgufWriter`]).
    ///
    /// The bytes are copied into 64-byte-aligned storage so tensor data is as aligned as it
    /// would be in a memory map.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Backing::owned(&bytes))
    }

    fn parse(backing: Backing) -> Result<Self, GgufError> {
        let parsed = parse_bytes(backing.bytes())?;
        Ok(GgufFile {
            backing,
            version: parsed.version,
            metadata: parsed.metadata,
            key_index: parsed.key_index,
            tensors: parsed.tensors,
            tensor_index: parsed.tensor_index,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    /// All bytes of the file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data (from `general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section from the start of the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// Metadata key/value pairs in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The value of metadata `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of a tensor of this file.
    ///
    /// The byte range was checked against the file when it was opened. Given a
    /// [`TensorInfo`] of another file whose range does not fit this one, it returns an empty
    /// slice rather than reading out of bounds.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        self.bytes().get(info.range.clone()).unwrap_or(&[])
    }

    /// The data of the tensor called `name`.
    pub fn tensor_data_by_name(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        Ok(self.tensor_data(info))
    }

    // ----- typed getters -----

    fn integer(&self, key: &str, expected: &'static str) -> Result<i128, GgufError> {
        let v = self.require(key)?;
        v.as_integer().ok_or_else(|| wrong_type(key, expected, v))
    }

    /// An unsigned 32-bit value; any integer type whose value fits is accepted.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.integer(key, "an integer")?;
        u32::try_from(v).map_err(|_| out_of_range(key, v, "u32"))
    }

    /// An unsigned 64-bit value; any integer type whose value fits is accepted.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.integer(key, "an integer")?;
        u64::try_from(v).map_err(|_| out_of_range(key, v, "u64"))
    }

    /// A signed 32-bit value; any integer type whose value fits is accepted.
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        let v = self.integer(key, "an integer")?;
        i32::try_from(v).map_err(|_| out_of_range(key, v, "i32"))
    }

    /// A signed 64-bit value; any integer type whose value fits is accepted.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        let v = self.integer(key, "an integer")?;
        i64::try_from(v).map_err(|_| out_of_range(key, v, "i64"))
    }

    /// A float; f32 as stored, f64 rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        match *v {
            MetaValue::F32(x) => Ok(x),
            MetaValue::F64(x) => Ok(x as f32),
            _ => Err(wrong_type(key, "a float", v)),
        }
    }

    /// A float; f32 widened, f64 as stored.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_float().ok_or_else(|| wrong_type(key, "a float", v))
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| wrong_type(key, "a bool", v))
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, "a string", v))
    }

    /// An array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| wrong_type(key, "an array", v))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(MetaArray::as_strings)
            .ok_or_else(|| wrong_type(key, "an array of string", v))
    }

    /// An array of integers as i32: borrowed when stored as i32, otherwise widened (or
    /// narrowed when every value fits).
    pub fn get_i32_array(&self, key: &str) -> Result<Cow<'_, [i32]>, GgufError> {
        let v = self.require(key)?;
        let arr = v.as_array().ok_or_else(|| wrong_type(key, "an array of integers", v))?;
        if let MetaArray::I32(x) = arr {
            return Ok(Cow::Borrowed(x));
        }
        let mut out = Vec::with_capacity(arr.len());
        for i in 0..arr.len() {
            let x = arr.integer_at(i).ok_or_else(|| wrong_type(key, "an array of integers", v))?;
            out.push(i32::try_from(x).map_err(|_| out_of_range(key, x, "i32"))?);
        }
        Ok(Cow::Owned(out))
    }

    /// An array of numbers as f32: borrowed when stored as f32, otherwise converted (f64
    /// rounded, integers converted as by `as`).
    pub fn get_f32_array(&self, key: &str) -> Result<Cow<'_, [f32]>, GgufError> {
        let v = self.require(key)?;
        let arr = v.as_array().ok_or_else(|| wrong_type(key, "an array of numbers", v))?;
        Ok(match arr {
            MetaArray::F32(x) => Cow::Borrowed(x),
            MetaArray::F64(x) => Cow::Owned(x.iter().map(|&f| f as f32).collect()),
            _ => {
                let mut out = Vec::with_capacity(arr.len());
                for i in 0..arr.len() {
                    let x = arr
                        .integer_at(i)
                        .ok_or_else(|| wrong_type(key, "an array of numbers", v))?;
                    out.push(x as f32);
                }
                Cow::Owned(out)
            }
        })
    }

    /// Like [`GgufFile::get_u32`], but `Ok(None)` when the key is absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.opt(key, Self::get_u32)
    }

    /// Like [`GgufFile::get_bool`], but `Ok(None)` when the key is absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.opt(key, Self::get_bool)
    }

    /// Like [`GgufFile::get_str`], but `Ok(None)` when the key is absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.get_str(key).map(Some)
    }

    fn opt<T>(
        &self,
        key: &str,
        f: impl FnOnce(&Self, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        f(self, key).map(Some)
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &MetaValue) -> GgufError {
    GgufError::WrongType { key: key.to_owned(), expected, found: found.type_description() }
}

fn out_of_range(key: &str, value: i128, target: &'static str) -> GgufError {
    GgufError::OutOfRange { key: key.to_owned(), value: value.to_string(), target }
}

// ----- parsing -----

struct Parsed {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: usize,
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let truncated = || GgufError::Truncated {
            what,
            offset: self.pos,
            needed: n,
            available: self.remaining(),
        };
        let n_usize = usize::try_from(n).map_err(|_| truncated())?;
        if n_usize > self.remaining() {
            return Err(truncated());
        }
        let out = &self.buf[self.pos..self.pos + n_usize];
        self.pos += n_usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 { what, offset: start })
    }

    /// Reads a count of entries that each take at least `min_size` bytes, and checks they
    /// can fit in the rest of the file before anyone allocates for them.
    fn count(&mut self, min_size: usize, what: &'static str) -> Result<usize, GgufError> {
        let offset = self.pos;
        let count = self.u64(what)?;
        let available = self.remaining();
        let fits = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(min_size))
            .is_some_and(|bytes| bytes <= available);
        if !fits {
            return Err(GgufError::CountTooLarge { what, offset, count, min_size, available });
        }
        Ok(count as usize)
    }
}

fn parse_bytes(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let n_tensors = c.u64("tensor count")?;
    let kv_count_offset = c.pos;
    let n_kv = c.count(MIN_KV_SIZE, "metadata entry")?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let type_id = c.u32("metadata value type")?;
        let ty = MetaValueType::from_id(type_id)
            .ok_or_else(|| GgufError::UnknownValueType { key: key.clone(), type_id })?;
        let value = read_value(&mut c, ty, &key)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(MetaValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(MetaValue::U32(a)) => return Err(GgufError::BadAlignment(a.to_string())),
        Some(other) => return Err(GgufError::BadAlignment(other.type_description())),
    };

    // The tensor count is checked once the metadata is read, against the bytes left then.
    let n_tensors = {
        let available = c.remaining();
        match usize::try_from(n_tensors) {
            Ok(n) if n.checked_mul(MIN_TENSOR_INFO_SIZE).is_some_and(|b| b <= available) => n,
            _ => {
                return Err(GgufError::CountTooLarge {
                    what: "tensor",
                    offset: kv_count_offset - 8,
                    count: n_tensors,
                    min_size: MIN_TENSOR_INFO_SIZE,
                    available,
                });
            }
        }
    };

    struct RawTensor {
        name: String,
        dims: Vec<u64>,
        ggml_type: GgmlType,
        offset: u64,
        n_elements: u64,
        size_bytes: u64,
    }
    let mut raw = Vec::with_capacity(n_tensors);
    let mut tensor_index = HashMap::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims { name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for index in 0..n_dims as usize {
            let d = c.u64("tensor dimension")?;
            if d > i64::MAX as u64 {
                return Err(GgufError::BadDim { name, index, value: d });
            }
            dims.push(d);
        }
        let type_id = c.u32("tensor type")?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), id: type_id })?;
        let offset = c.u64("tensor data offset")?;

        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| GgufError::ShapeOverflow { name: name.clone(), dims: dims.clone() })?;
        let row = dims.first().copied().unwrap_or(1);
        let block = ggml_type.block_size();
        if row % block as u64 != 0 {
            return Err(GgufError::PartialBlock { name, row, ty: ggml_type, block });
        }
        let size_bytes = (n_elements / block as u64)
            .checked_mul(ggml_type.type_size() as u64)
            .ok_or_else(|| GgufError::ShapeOverflow { name: name.clone(), dims: dims.clone() })?;
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor { name, offset, alignment });
        }
        if tensor_index.insert(name.clone(), raw.len()).is_some() {
            return Err(GgufError::DuplicateTensor(name));
        }
        raw.push(RawTensor { name, dims, ggml_type, offset, n_elements, size_bytes });
    }

    let header_end = c.pos;
    let data_offset = align_up(header_end as u64, alignment)
        .filter(|&d| n_tensors == 0 || d <= buf.len() as u64)
        .ok_or(GgufError::Truncated {
            what: "padding before the tensor data",
            offset: header_end,
            needed: alignment,
            available: buf.len() - header_end,
        })?;

    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.size_bytes));
        let range = match (start, end) {
            (Some(s), Some(e)) if e <= buf.len() as u64 => s as usize..e as usize,
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len: buf.len(),
                });
            }
        };
        tensors.push(TensorInfo {
            name: t.name,
            dims: t.dims,
            ggml_type: t.ggml_type,
            offset: t.offset,
            n_elements: t.n_elements,
            size_bytes: t.size_bytes,
            range,
        });
    }

    let mut by_start: Vec<&TensorInfo> = tensors.iter().filter(|t| !t.range.is_empty()).collect();
    by_start.sort_by_key(|t| t.range.start);
    for pair in by_start.windows(2) {
        if pair[1].range.start < pair[0].range.end {
            return Err(GgufError::TensorOverlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }

    Ok(Parsed {
        version,
        metadata,
        key_index,
        tensors,
        tensor_index,
        alignment,
        data_offset: data_offset as usize,
    })
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_add(alignment - 1).map(|v| v / alignment * alignment)
}

fn read_value(c: &mut Cursor<'_>, ty: MetaValueType, key: &str) -> Result<MetaValue, GgufError> {
    Ok(match ty {
        MetaValueType::U8 => MetaValue::U8(u8::from_le_bytes(c.array("u8 value")?)),
        MetaValueType::I8 => MetaValue::I8(i8::from_le_bytes(c.array("i8 value")?)),
        MetaValueType::U16 => MetaValue::U16(u16::from_le_bytes(c.array("u16 value")?)),
        MetaValueType::I16 => MetaValue::I16(i16::from_le_bytes(c.array("i16 value")?)),
        MetaValueType::U32 => MetaValue::U32(u32::from_le_bytes(c.array("u32 value")?)),
        MetaValueType::I32 => MetaValue::I32(i32::from_le_bytes(c.array("i32 value")?)),
        MetaValueType::F32 => MetaValue::F32(f32::from_le_bytes(c.array("f32 value")?)),
        MetaValueType::Bool => MetaValue::Bool(c.array::<1>("bool value")?[0] != 0),
        MetaValueType::String => MetaValue::String(c.string("string value")?),
        MetaValueType::Array => MetaValue::Array(read_array(c, key, 1)?),
        MetaValueType::U64 => MetaValue::U64(u64::from_le_bytes(c.array("u64 value")?)),
        MetaValueType::I64 => MetaValue::I64(i64::from_le_bytes(c.array("i64 value")?)),
        MetaValueType::F64 => MetaValue::F64(f64::from_le_bytes(c.array("f64 value")?)),
    })
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<MetaArray, GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep { key: key.to_owned(), max: MAX_ARRAY_DEPTH });
    }
    let type_id = c.u32("array element type")?;
    let ty = MetaValueType::from_id(type_id)
        .ok_or_else(|| GgufError::UnknownValueType { key: key.to_owned(), type_id })?;
    let n = c.count(ty.min_encoded_size(), "array element")?;

    fn fixed<T, const N: usize>(
        c: &mut Cursor<'_>,
        n: usize,
        conv: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        // `count` has checked that n * N bytes are there.
        let bytes = c.take((n * N) as u64, "array data")?;
        Ok(bytes
            .chunks_exact(N)
            .map(|ch| {
                let mut a = [0u8; N];
                a.copy_from_slice(ch);
                conv(a)
            })
            .collect())
    }

    Ok(match ty {
        MetaValueType::U8 => MetaArray::U8(c.take(n as u64, "array data")?.to_vec()),
        MetaValueType::I8 => MetaArray::I8(fixed(c, n, i8::from_le_bytes)?),
        MetaValueType::U16 => MetaArray::U16(fixed(c, n, u16::from_le_bytes)?),
        MetaValueType::I16 => MetaArray::I16(fixed(c, n, i16::from_le_bytes)?),
        MetaValueType::U32 => MetaArray::U32(fixed(c, n, u32::from_le_bytes)?),
        MetaValueType::I32 => MetaArray::I32(fixed(c, n, i32::from_le_bytes)?),
        MetaValueType::F32 => MetaArray::F32(fixed(c, n, f32::from_le_bytes)?),
        MetaValueType::Bool => MetaArray::Bool(fixed(c, n, |[b]: [u8; 1]| b != 0)?),
        MetaValueType::U64 => MetaArray::U64(fixed(c, n, u64::from_le_bytes)?),
        MetaValueType::I64 => MetaArray::I64(fixed(c, n, i64::from_le_bytes)?),
        MetaValueType::F64 => MetaArray::F64(fixed(c, n, f64::from_le_bytes)?),
        MetaValueType::String => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(c.string("array string")?);
            }
            MetaArray::String(v)
        }
        MetaValueType::Array => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            MetaArray::Array(v)
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<super::GgufFile>();
    }
}

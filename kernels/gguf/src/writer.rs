//! Building GGUF files: metadata and tensors in, valid GGUF bytes out (tests, synthetic models).

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use crate::error::GgufError;
use crate::reader::{DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};
use crate::types::GgmlType;
use crate::value::{MetaArray, MetaValue};

/// Builds a GGUF file from metadata and tensors.
///
/// Tensors are laid out in the order added, each at an offset that is a multiple of the
/// alignment, exactly as ggml writes them. The alignment is taken from a
/// `general.alignment` u32 entry when one is added (default 32).
///
/// ```
/// use kvx_gguf::{GgmlType, GgufFile, GgufWriter};
/// let mut w = GgufWriter::new();
/// w.metadata("general.architecture", "llama");
/// w.tensor("x", &[4], GgmlType::F32, [0u8; 16].to_vec());
/// let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
/// assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
/// assert_eq!(f.tensor("x").unwrap().dims, vec![4]);
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> Self {
        GgufWriter { version: 3, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the format version written (2 or 3; they share one layout).
    pub fn version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets `general.alignment` (replacing any earlier value).
    pub fn alignment(&mut self, alignment: u32) -> &mut Self {
        self.set_metadata("general.alignment", alignment)
    }

    /// Appends a metadata entry. Adding a key twice is reported by [`GgufWriter::to_bytes`].
    pub fn metadata(&mut self, key: impl Into<String>, value: impl Into<MetaValue>) -> &mut Self {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Sets a metadata entry, replacing the value in place when the key is already there.
    pub fn set_metadata(&mut self, key: &str, value: impl Into<MetaValue>) -> &mut Self {
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
        self
    }

    /// Removes a metadata entry if present.
    pub fn remove_metadata(&mut self, key: &str) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self
    }

    /// Appends a tensor. `dims` are innermost first (`dims[0]` is the row length); `data`
    /// must be exactly the bytes the shape and type need (checked by `to_bytes`).
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        self
    }

    fn alignment_value(&self) -> Result<u64, GgufError> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
            Some((_, MetaValue::U32(a))) => Err(GgufError::BadAlignment(a.to_string())),
            Some((_, other)) => Err(GgufError::BadAlignment(other.type_description())),
        }
    }

    /// Checks everything the reader checks and returns the tensor sizes.
    fn validate(&self) -> Result<Vec<u64>, GgufError> {
        if self.version != 2 && self.version != 3 {
            return Err(GgufError::UnwritableVersion(self.version));
        }
        let mut keys = HashSet::new();
        for (k, v) in &self.metadata {
            if !keys.insert(k.as_str()) {
                return Err(GgufError::DuplicateKey(k.clone()));
            }
            if let MetaValue::Array(a) = v {
                check_depth(a, k, 1)?;
            }
        }
        self.alignment_value()?;
        let mut names = HashSet::new();
        let mut sizes = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                return Err(GgufError::DuplicateTensor(t.name.clone()));
            }
            if t.dims.len() > MAX_DIMS {
                return Err(GgufError::TooManyDims {
                    name: t.name.clone(),
                    n_dims: t.dims.len() as u32,
                });
            }
            let overflow =
                || GgufError::ShapeOverflow { name: t.name.clone(), dims: t.dims.clone() };
            let n = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(overflow)?;
            let row = t.dims.first().copied().unwrap_or(1);
            let block = t.ggml_type.block_size();
            if row % block as u64 != 0 {
                return Err(GgufError::PartialBlock {
                    name: t.name.clone(),
                    row,
                    ty: t.ggml_type,
                    block,
                });
            }
            let size = (n / block as u64)
                .checked_mul(t.ggml_type.type_size() as u64)
                .ok_or_else(overflow)?;
            if size != t.data.len() as u64 {
                return Err(GgufError::TensorSizeMismatch {
                    name: t.name.clone(),
                    expected: size,
                    actual: t.data.len(),
                });
            }
            sizes.push(size);
        }
        Ok(sizes)
    }

    /// The complete file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let sizes = self.validate()?;
        let alignment = self.alignment_value()? as usize;
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        for (t, &size) in self.tensors.iter().zip(&sizes) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += size.next_multiple_of(alignment as u64);
        }
        if !self.tensors.is_empty() {
            out.resize(out.len().next_multiple_of(alignment), 0);
        }
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().next_multiple_of(alignment), 0);
        }
        Ok(out)
    }

    /// Writes the file to `w`.
    pub fn write_to(&self, mut w: impl Write) -> Result<(), GgufError> {
        let bytes = self.to_bytes()?;
        w.write_all(&bytes).map_err(GgufError::Write)
    }

    /// Writes the file to `path`.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes)
            .map_err(|source| GgufError::Io { path: path.to_owned(), source })
    }
}

fn check_depth(a: &MetaArray, key: &str, depth: usize) -> Result<(), GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep { key: key.to_owned(), max: MAX_ARRAY_DEPTH });
    }
    if let MetaArray::Array(inner) = a {
        for i in inner {
            check_depth(i, key, depth + 1)?;
        }
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(a) => put_array(out, a),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => each!(v),
        MetaArray::U16(v) => each!(v),
        MetaArray::I16(v) => each!(v),
        MetaArray::U32(v) => each!(v),
        MetaArray::I32(v) => each!(v),
        MetaArray::F32(v) => each!(v),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => {
            for s in v {
                put_str(out, s);
            }
        }
        MetaArray::Array(v) => {
            for inner in v {
                put_array(out, inner);
            }
        }
        MetaArray::U64(v) => each!(v),
        MetaArray::I64(v) => each!(v),
        MetaArray::F64(v) => each!(v),
    }
}

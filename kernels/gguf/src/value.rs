//! GGUF metadata values: the thirteen value types, scalars and (possibly nested) typed arrays.

use std::fmt;

/// The type tag of a GGUF metadata value, numbered as in the file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)]
pub enum MetaValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl MetaValueType {
    /// The type with file id `id`, if the format defines it.
    pub fn from_id(id: u32) -> Option<Self> {
        use MetaValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The file id of this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes in a file: its fixed size for scalars,
    /// the length prefix for strings, element type plus count for arrays.
    pub(crate) fn min_encoded_size(self) -> usize {
        use MetaValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// The name used in error messages and in gguf-py (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        use MetaValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for MetaValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array. Elements are stored unboxed by type; arrays of arrays nest.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetaArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    /// The type tag of this value.
    pub fn value_type(&self) -> MetaValueType {
        match self {
            MetaValue::U8(_) => MetaValueType::U8,
            MetaValue::I8(_) => MetaValueType::I8,
            MetaValue::U16(_) => MetaValueType::U16,
            MetaValue::I16(_) => MetaValueType::I16,
            MetaValue::U32(_) => MetaValueType::U32,
            MetaValue::I32(_) => MetaValueType::I32,
            MetaValue::F32(_) => MetaValueType::F32,
            MetaValue::Bool(_) => MetaValueType::Bool,
            MetaValue::String(_) => MetaValueType::String,
            MetaValue::Array(_) => MetaValueType::Array,
            MetaValue::U64(_) => MetaValueType::U64,
            MetaValue::I64(_) => MetaValueType::I64,
            MetaValue::F64(_) => MetaValueType::F64,
        }
    }

    /// A short description of the type for error messages, e.g. `u32` or `array of string`.
    pub fn type_description(&self) -> String {
        match self {
            MetaValue::Array(a) => format!("array of {}", a.elem_type()),
            other => other.value_type().name().to_owned(),
        }
    }

    /// The value as an `i128` when it is an integer of any width.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as `f64` when it is a float (f32 widens exactly).
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, when this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The flag, when this is a bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The array, when this is an array value.
    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl MetaArray {
    /// The type of the elements.
    pub fn elem_type(&self) -> MetaValueType {
        match self {
            MetaArray::U8(_) => MetaValueType::U8,
            MetaArray::I8(_) => MetaValueType::I8,
            MetaArray::U16(_) => MetaValueType::U16,
            MetaArray::I16(_) => MetaValueType::I16,
            MetaArray::U32(_) => MetaValueType::U32,
            MetaArray::I32(_) => MetaValueType::I32,
            MetaArray::F32(_) => MetaValueType::F32,
            MetaArray::Bool(_) => MetaValueType::Bool,
            MetaArray::String(_) => MetaValueType::String,
            MetaArray::Array(_) => MetaValueType::Array,
            MetaArray::U64(_) => MetaValueType::U64,
            MetaArray::I64(_) => MetaValueType::I64,
            MetaArray::F64(_) => MetaValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as an integer, when the elements are integers.
    pub fn integer_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            MetaArray::U8(v) => (*v.get(i)?).into(),
            MetaArray::I8(v) => (*v.get(i)?).into(),
            MetaArray::U16(v) => (*v.get(i)?).into(),
            MetaArray::I16(v) => (*v.get(i)?).into(),
            MetaArray::U32(v) => (*v.get(i)?).into(),
            MetaArray::I32(v) => (*v.get(i)?).into(),
            MetaArray::U64(v) => (*v.get(i)?).into(),
            MetaArray::I64(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }

    /// The strings, when this is an array of strings.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            MetaArray::String(v) => Some(v),
            _ => None,
        }
    }
}

macro_rules! impl_from {
    ($($t:ty => $variant:ident),* $(,)?) => {
        $(
            impl From<$t> for MetaValue {
                fn from(v: $t) -> Self {
                    MetaValue::$variant(v)
                }
            }
            impl From<Vec<$t>> for MetaArray {
                fn from(v: Vec<$t>) -> Self {
                    MetaArray::$variant(v)
                }
            }
            impl From<Vec<$t>> for MetaValue {
                fn from(v: Vec<$t>) -> Self {
                    MetaValue::Array(MetaArray::$variant(v))
                }
            }
        )*
    };
}

impl_from!(
    u8 => U8,
    i8 => I8,
    u16 => U16,
    i16 => I16,
    u32 => U32,
    i32 => I32,
    f32 => F32,
    bool => Bool,
    String => String,
    u64 => U64,
    i64 => I64,
    f64 => F64,
);

impl From<&str> for MetaValue {
    fn from(v: &str) -> Self {
        MetaValue::String(v.to_owned())
    }
}

impl From<Vec<&str>> for MetaValue {
    fn from(v: Vec<&str>) -> Self {
        MetaValue::Array(MetaArray::String(v.into_iter().map(str::to_owned).collect()))
    }
}

impl From<MetaArray> for MetaValue {
    fn from(v: MetaArray) -> Self {
        MetaValue::Array(v)
    }
}

impl From<Vec<MetaArray>> for MetaValue {
    fn from(v: Vec<MetaArray>) -> Self {
        MetaValue::Array(MetaArray::Array(v))
    }
}

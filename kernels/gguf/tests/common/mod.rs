//! Shared helpers for the GGUF tests: a sample file, a raw byte encoder for hand-made (and
//! deliberately broken) headers, and a walker that touches everything a parsed file exposes.

#![allow(dead_code)]

use kvx_gguf::{GgmlType, GgufFile, GgufWriter, MetaArray, MetaValue};

/// A small file exercising every metadata type, nested arrays and several tensor types.
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama")
        .metadata("t.u8", 7u8)
        .metadata("t.i8", -7i8)
        .metadata("t.u16", 700u16)
        .metadata("t.i16", -700i16)
        .metadata("t.u32", 70_000u32)
        .metadata("t.i32", -70_000i32)
        .metadata("t.f32", 1.5f32)
        .metadata("t.bool", true)
        .metadata("t.string", "héllo wörld")
        .metadata("t.u64", u64::MAX)
        .metadata("t.i64", i64::MIN)
        .metadata("t.f64", -2.25f64)
        .metadata("t.arr.str", vec!["a", "", "ü"])
        .metadata("t.arr.i32", vec![1i32, -2, 3])
        .metadata("t.arr.f32", vec![0.5f32, -1.0])
        .metadata("t.arr.bool", vec![true, false])
        .metadata("t.arr.u8", vec![1u8, 2, 3])
        .metadata(
            "t.arr.nested",
            vec![MetaArray::from(vec![1u16, 2]), MetaArray::String(vec!["x".into()])],
        )
        .metadata("t.arr.empty", MetaArray::F64(vec![]));
    w.tensor("a.f32", &[4, 2], GgmlType::F32, (0..32u8).collect())
        .tensor("b.q4_1", &[32], GgmlType::Q4_1, vec![0xAB; 20])
        .tensor("c.q8_0", &[64, 1, 1, 2], GgmlType::Q8_0, vec![0x5A; 4 * 34])
        .tensor("d.scalar", &[], GgmlType::F16, vec![1, 2])
        .tensor("e.empty", &[0, 3], GgmlType::F32, vec![]);
    w
}

/// Reads every metadata value and every tensor's data, and checks the data slices lie inside
/// the file bytes.
pub fn walk(f: &GgufFile) -> usize {
    let mut acc = f.version() as usize + f.alignment() as usize;
    for (k, v) in f.metadata() {
        acc += k.len();
        acc += walk_value(v);
        // Typed getters must not panic whatever the type.
        let _ = f.get_u32(k);
        let _ = f.get_i64(k);
        let _ = f.get_f32(k);
        let _ = f.get_bool(k);
        let _ = f.get_str(k);
        let _ = f.get_str_array(k);
        let _ = f.get_i32_array(k);
        let _ = f.get_f32_array(k);
    }
    let file = f.bytes().as_ptr_range();
    for t in f.tensors() {
        let data = f.tensor_data(t);
        assert_eq!(data.len() as u64, t.size_bytes(), "{}", t.name);
        if !data.is_empty() {
            let r = data.as_ptr_range();
            assert!(file.start <= r.start && r.end <= file.end);
        }
        acc += data.iter().map(|&b| b as usize).sum::<usize>();
        acc += t.n_elements() as usize;
        assert!(f.tensor(&t.name).is_some());
    }
    acc
}

fn walk_value(v: &MetaValue) -> usize {
    match v {
        MetaValue::String(s) => s.len(),
        MetaValue::Array(a) => walk_array(a),
        other => other.as_integer().map(|_| 1).unwrap_or(2),
    }
}

fn walk_array(a: &MetaArray) -> usize {
    match a {
        MetaArray::Array(v) => v.iter().map(walk_array).sum::<usize>() + 1,
        MetaArray::String(v) => v.iter().map(String::len).sum(),
        other => other.len(),
    }
}

/// A raw GGUF byte encoder with no validation, for hand-made headers.
#[derive(Default)]
pub struct Raw {
    pub buf: Vec<u8>,
}

impl Raw {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw::default();
        r.buf.extend_from_slice(b"GGUF");
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
        self
    }
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.str(key).u32(8).str(v)
    }
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    pub fn pad(&mut self, align: usize) -> &mut Self {
        self.buf.resize(self.buf.len().next_multiple_of(align), 0);
        self
    }
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf.resize(self.buf.len() + n, 0);
        self
    }
    pub fn bytes(&self) -> Vec<u8> {
        self.buf.clone()
    }
}

//! Writer → reader round trips, typed getters, and the writer's own validation.

mod common;

use common::sample_writer;
use kvx_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaArray, MetaValue, MetaValueType};
use proptest::prelude::*;

#[test]
fn sample_round_trips_exactly() {
    let w = sample_writer();
    let bytes = w.to_bytes().unwrap();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.bytes(), &bytes[..]);

    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys[0], "general.architecture");
    assert_eq!(keys.len(), 20);
    assert_eq!(f.get("t.u64"), Some(&MetaValue::U64(u64::MAX)));
    assert_eq!(f.get("t.i64"), Some(&MetaValue::I64(i64::MIN)));
    assert_eq!(f.get("t.f64"), Some(&MetaValue::F64(-2.25)));
    assert_eq!(f.get("t.string").and_then(MetaValue::as_str), Some("héllo wörld"));
    let nested = f.get_array("t.arr.nested").unwrap();
    assert_eq!(nested.elem_type(), MetaValueType::Array);
    assert_eq!(
        nested,
        &MetaArray::Array(vec![MetaArray::U16(vec![1, 2]), MetaArray::String(vec!["x".into()])])
    );
    assert!(f.get_array("t.arr.empty").unwrap().is_empty());

    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a.f32", "b.q4_1", "c.q8_0", "d.scalar", "e.empty"]);
    let a = f.tensor("a.f32").unwrap();
    assert_eq!(a.dims, vec![4, 2]);
    assert_eq!(a.n_elements(), 8);
    assert_eq!(a.row_len(), 4);
    assert_eq!(a.n_rows(), 2);
    assert_eq!(f.tensor_data(a), &(0..32u8).collect::<Vec<_>>()[..]);
    let b = f.tensor("b.q4_1").unwrap();
    assert_eq!((b.ggml_type, b.size_bytes(), b.offset), (GgmlType::Q4_1, 20, 32));
    assert_eq!(f.tensor_data(b), &[0xAB; 20][..]);
    let c = f.tensor("c.q8_0").unwrap();
    assert_eq!((c.n_elements(), c.size_bytes(), c.offset), (128, 136, 64));
    let d = f.tensor("d.scalar").unwrap();
    assert_eq!((d.n_elements(), d.size_bytes()), (1, 2));
    assert_eq!(f.tensor_data_by_name("d.scalar").unwrap(), &[1, 2]);
    let e = f.tensor("e.empty").unwrap();
    assert_eq!((e.n_elements(), f.tensor_data(e).len()), (0, 0));
    assert!(matches!(f.tensor_data_by_name("nope"), Err(GgufError::MissingTensor(_))));

    // Owned storage keeps tensor data aligned like a memory map would.
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).as_ptr() as usize % 32, 0, "{}", t.name);
    }
    // Writing what was read gives the same bytes.
    let mut again = GgufWriter::new();
    for (k, v) in f.metadata() {
        again.metadata(k.clone(), v.clone());
    }
    for t in f.tensors() {
        again.tensor(t.name.clone(), &t.dims, t.ggml_type, f.tensor_data(t).to_vec());
    }
    assert_eq!(again.to_bytes().unwrap(), bytes);
}

#[test]
fn version_2_and_larger_alignment() {
    let mut w = sample_writer();
    w.version(2).alignment(128);
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.alignment(), 128);
    assert_eq!(f.data_offset() % 128, 0);
    for t in f.tensors() {
        assert_eq!(t.offset % 128, 0);
    }
    assert_eq!(f.tensor("c.q8_0").unwrap().offset, 256);
}

#[test]
fn file_without_tensors() {
    let mut w = GgufWriter::new();
    w.metadata("k", "v");
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert!(f.tensors().is_empty());
    assert_eq!(f.get_str("k").unwrap(), "v");
    let empty = GgufFile::from_bytes(GgufWriter::new().to_bytes().unwrap()).unwrap();
    assert!(empty.metadata().is_empty());
}

#[test]
fn open_maps_a_file() {
    let dir = std::env::temp_dir().join(format!("kvx-gguf-open-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sample.gguf");
    sample_writer().write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors().len(), 5);
    assert_eq!(f.tensor_data_by_name("b.q4_1").unwrap(), &[0xAB; 20][..]);
    assert!(format!("{f:?}").contains("mmap: true"));
    // Released pages read back unchanged; out-of-range or empty requests change nothing.
    let before = f.bytes().to_vec();
    f.release(0..f.bytes().len());
    f.release(5..5);
    f.release(0..f.bytes().len() + 1);
    assert_eq!(f.bytes(), &before[..]);
    assert_eq!(f.tensor_data_by_name("b.q4_1").unwrap(), &[0xAB; 20][..]);
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(GgufFile::open(&empty), Err(GgufError::Truncated { .. })));
    let missing = GgufFile::open(dir.join("missing.gguf")).unwrap_err();
    assert!(matches!(missing, GgufError::Io { .. }));
    assert!(missing.to_string().contains("missing.gguf"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn typed_getters_widen_and_report_clearly() {
    let f = GgufFile::from_bytes(sample_writer().to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), 7);
    assert_eq!(f.get_u32("t.u16").unwrap(), 700);
    assert_eq!(f.get_u32("t.u32").unwrap(), 70_000);
    assert_eq!(f.get_i32("t.i16").unwrap(), -700);
    assert_eq!(f.get_i64("t.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_f32("t.f32").unwrap(), 1.5);
    assert_eq!(f.get_f32("t.f64").unwrap(), -2.25);
    assert_eq!(f.get_f64("t.f32").unwrap(), 1.5);
    assert!(f.get_bool("t.bool").unwrap());
    assert_eq!(f.get_str_array("t.arr.str").unwrap(), ["a", "", "ü"]);
    assert_eq!(&*f.get_i32_array("t.arr.i32").unwrap(), &[1, -2, 3]);
    assert_eq!(&*f.get_i32_array("t.arr.u8").unwrap(), &[1, 2, 3]);
    assert_eq!(&*f.get_f32_array("t.arr.f32").unwrap(), &[0.5, -1.0]);
    assert_eq!(&*f.get_f32_array("t.arr.i32").unwrap(), &[1.0, -2.0, 3.0]);
    assert_eq!(f.get_u32_opt("absent").unwrap(), None);
    assert_eq!(f.get_u32_opt("t.u8").unwrap(), Some(7));
    assert_eq!(f.get_bool_opt("t.bool").unwrap(), Some(true));
    assert_eq!(f.get_str_opt("t.string").unwrap(), Some("héllo wörld"));
    assert!(f.get_str_opt("t.u8").is_err());

    let e = f.get_u32("t.i8").unwrap_err();
    assert!(matches!(e, GgufError::OutOfRange { .. }));
    assert_eq!(e.to_string(), r#"metadata key "t.i8": value -7 does not fit in u32"#);
    let e = f.get_u32("t.u64").unwrap_err();
    assert!(matches!(e, GgufError::OutOfRange { .. }));
    let e = f.get_str("t.u32").unwrap_err();
    assert_eq!(e.to_string(), r#"metadata key "t.u32" holds u32, expected a string"#);
    let e = f.get_str_array("t.arr.i32").unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"metadata key "t.arr.i32" holds array of i32, expected an array of string"#
    );
    let e = f.get_u32("nope").unwrap_err();
    assert_eq!(e.to_string(), r#"metadata key "nope" not found"#);
    assert!(matches!(f.get_i32_array("t.arr.str"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_bool("t.u8"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_f32("t.u8"), Err(GgufError::WrongType { .. })));
}

#[test]
fn writer_rejects_what_the_reader_would() {
    let mut w = GgufWriter::new();
    w.metadata("a", 1u32).metadata("a", 2u32);
    assert!(matches!(w.to_bytes(), Err(GgufError::DuplicateKey(k)) if k == "a"));

    let mut w = GgufWriter::new();
    w.tensor("t", &[4], GgmlType::F32, vec![0; 16]).tensor("t", &[4], GgmlType::F32, vec![0; 16]);
    assert!(matches!(w.to_bytes(), Err(GgufError::DuplicateTensor(_))));

    let mut w = GgufWriter::new();
    w.tensor("t", &[4], GgmlType::F32, vec![0; 15]);
    assert!(matches!(
        w.to_bytes(),
        Err(GgufError::TensorSizeMismatch { expected: 16, actual: 15, .. })
    ));

    let mut w = GgufWriter::new();
    w.tensor("t", &[16], GgmlType::Q4_0, vec![0; 9]);
    assert!(matches!(w.to_bytes(), Err(GgufError::PartialBlock { block: 32, .. })));

    let mut w = GgufWriter::new();
    w.tensor("t", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]);
    assert!(matches!(w.to_bytes(), Err(GgufError::TooManyDims { n_dims: 5, .. })));

    let mut w = GgufWriter::new();
    w.tensor("t", &[u64::MAX, 2], GgmlType::F32, vec![]);
    assert!(matches!(w.to_bytes(), Err(GgufError::ShapeOverflow { .. })));

    let mut w = GgufWriter::new();
    w.alignment(48);
    assert!(matches!(w.to_bytes(), Err(GgufError::BadAlignment(_))));
    let mut w = GgufWriter::new();
    w.metadata("general.alignment", 32u64);
    assert!(matches!(w.to_bytes(), Err(GgufError::BadAlignment(_))));

    let mut w = GgufWriter::new();
    w.version(1);
    assert!(matches!(w.to_bytes(), Err(GgufError::UnwritableVersion(1))));

    let mut deep = MetaArray::U8(vec![1]);
    for _ in 0..kvx_gguf::MAX_ARRAY_DEPTH {
        deep = MetaArray::Array(vec![deep]);
    }
    let mut w = GgufWriter::new();
    w.metadata("deep", deep);
    assert!(matches!(w.to_bytes(), Err(GgufError::NestingTooDeep { .. })));
}

#[test]
fn set_and_remove_metadata_keep_order() {
    let mut w = GgufWriter::new();
    w.metadata("a", 1u32).metadata("b", 2u32).metadata("c", 3u32);
    w.set_metadata("b", "two").remove_metadata("a").set_metadata("d", 4u8);
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let kv: Vec<(&str, &MetaValue)> = f.metadata().iter().map(|(k, v)| (k.as_str(), v)).collect();
    assert_eq!(
        kv,
        [
            ("b", &MetaValue::String("two".into())),
            ("c", &MetaValue::U32(3)),
            ("d", &MetaValue::U8(4))
        ]
    );
}

fn arb_scalar() -> impl Strategy<Value = MetaValue> {
    prop_oneof![
        any::<u8>().prop_map(MetaValue::U8),
        any::<i8>().prop_map(MetaValue::I8),
        any::<u16>().prop_map(MetaValue::U16),
        any::<i16>().prop_map(MetaValue::I16),
        any::<u32>().prop_map(MetaValue::U32),
        any::<i32>().prop_map(MetaValue::I32),
        any::<u64>().prop_map(MetaValue::U64),
        any::<i64>().prop_map(MetaValue::I64),
        // Bit patterns, so NaNs with payloads round-trip too (compared bitwise below).
        any::<u32>().prop_map(|b| MetaValue::F32(f32::from_bits(b))),
        any::<u64>().prop_map(|b| MetaValue::F64(f64::from_bits(b))),
        any::<bool>().prop_map(MetaValue::Bool),
        ".{0,12}".prop_map(MetaValue::String),
    ]
}

fn arb_array() -> impl Strategy<Value = MetaArray> {
    let leaf = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..8).prop_map(MetaArray::U8),
        prop::collection::vec(any::<i16>(), 0..8).prop_map(MetaArray::I16),
        prop::collection::vec(any::<i32>(), 0..8).prop_map(MetaArray::I32),
        prop::collection::vec(any::<u64>(), 0..8).prop_map(MetaArray::U64),
        prop::collection::vec(any::<bool>(), 0..8).prop_map(MetaArray::Bool),
        prop::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..8).prop_map(MetaArray::F32),
        prop::collection::vec(".{0,6}", 0..6).prop_map(MetaArray::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(MetaArray::Array)
    })
}

fn bits_eq(a: &MetaValue, b: &MetaValue) -> bool {
    match (a, b) {
        (MetaValue::F32(x), MetaValue::F32(y)) => x.to_bits() == y.to_bits(),
        (MetaValue::F64(x), MetaValue::F64(y)) => x.to_bits() == y.to_bits(),
        (MetaValue::Array(x), MetaValue::Array(y)) => array_bits_eq(x, y),
        _ => a == b,
    }
}

fn array_bits_eq(a: &MetaArray, b: &MetaArray) -> bool {
    match (a, b) {
        (MetaArray::F32(x), MetaArray::F32(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        }
        (MetaArray::Array(x), MetaArray::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| array_bits_eq(p, q))
        }
        _ => a == b,
    }
}

proptest! {
    #[test]
    fn random_files_round_trip(
        values in prop::collection::vec(prop_oneof![arb_scalar(), arb_array().prop_map(MetaValue::Array)], 0..10),
        tensors in prop::collection::vec((1u64..4, 1u64..3, 0usize..3), 0..5),
        align_pow in 0u32..8,
        v2 in any::<bool>(),
    ) {
        let mut w = GgufWriter::new();
        w.version(if v2 { 2 } else { 3 }).alignment(1 << align_pow);
        for (i, v) in values.iter().enumerate() {
            w.metadata(format!("k{i}"), v.clone());
        }
        let types = [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_K];
        let mut expected = Vec::new();
        for (i, &(blocks, rows, ti)) in tensors.iter().enumerate() {
            let ty = types[ti];
            let row = blocks * ty.block_size() as u64;
            let size = (ty.row_size(row).unwrap() * rows) as usize;
            let data: Vec<u8> = (0..size).map(|j| (i * 31 + j) as u8).collect();
            w.tensor(format!("t{i}"), &[row, rows], ty, data.clone());
            expected.push(data);
        }
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        prop_assert_eq!(f.metadata().len(), values.len() + 1);
        for (i, v) in values.iter().enumerate() {
            let key = format!("k{i}");
            prop_assert!(bits_eq(f.get(&key).unwrap(), v), "key {}", key);
        }
        for (i, data) in expected.iter().enumerate() {
            let t = f.tensor(&format!("t{i}")).unwrap();
            prop_assert_eq!(f.tensor_data(t), &data[..]);
            prop_assert_eq!(t.offset % f.alignment(), 0);
        }
        common::walk(&f);
    }
}

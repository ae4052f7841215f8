//! Fuzz target: parse arbitrary bytes as GGUF and walk everything a successful parse exposes.

#![no_main]

use kvx_gguf::{GgufFile, MetaArray, MetaValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let mut acc = 0usize;
    for (k, v) in f.metadata() {
        acc = acc.wrapping_add(k.len()).wrapping_add(walk(v));
        let _ = f.get_u32(k);
        let _ = f.get_f32(k);
        let _ = f.get_str_array(k);
        let _ = f.get_i32_array(k);
        let _ = f.get_f32_array(k);
    }
    let file = f.bytes().as_ptr_range();
    for t in f.tensors() {
        let d = f.tensor_data(t);
        assert_eq!(d.len() as u64, t.size_bytes());
        if !d.is_empty() {
            let r = d.as_ptr_range();
            assert!(file.start <= r.start && r.end <= file.end);
            assert_eq!(t.offset % f.alignment(), 0);
        }
        acc = acc.wrapping_add(d.iter().map(|&b| b as usize).sum::<usize>());
    }
    std::hint::black_box(acc);
});

fn walk(v: &MetaValue) -> usize {
    match v {
        MetaValue::String(s) => s.len(),
        MetaValue::Array(a) => walk_array(a),
        _ => 1,
    }
}

fn walk_array(a: &MetaArray) -> usize {
    match a {
        MetaArray::Array(v) => v.iter().map(walk_array).sum::<usize>() + 1,
        MetaArray::String(v) => v.iter().map(String::len).sum(),
        other => other.len(),
    }
}

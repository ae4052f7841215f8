//! Corrupt input: truncation at every offset, random byte flips, absurd counts and lengths,
//! bad alignment, misplaced tensors. Each must give a typed error, never a panic.

mod common;

use common::{Raw, sample_writer, walk};
use kvx_gguf::{GgufError, GgufFile, GgufWriter};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes)
}

#[test]
fn truncation_at_every_offset() {
    let bytes = sample_writer().to_bytes().unwrap();
    let full = parse(bytes.clone()).unwrap();
    // The file stays valid as long as the last tensor's data is complete; the padding after
    // it is optional.
    let data_end = full
        .tensors()
        .iter()
        .map(|t| full.data_offset() as u64 + t.offset + t.size_bytes())
        .max()
        .unwrap() as usize;
    for len in 0..bytes.len() {
        let r = parse(bytes[..len].to_vec());
        if len < data_end {
            let e = r.err().unwrap_or_else(|| panic!("prefix of {len} bytes parsed"));
            assert!(
                matches!(
                    e,
                    GgufError::Truncated { .. }
                        | GgufError::CountTooLarge { .. }
                        | GgufError::TensorOutOfBounds { .. }
                ),
                "prefix {len}: {e}"
            );
        } else {
            walk(&r.unwrap());
        }
    }
}

#[test]
fn random_byte_flips_never_panic() {
    let bytes = sample_writer().to_bytes().unwrap();
    let mut rng = StdRng::seed_from_u64(0x6767_7566);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..20_000 {
        let mut b = bytes.clone();
        for _ in 0..rng.random_range(1..=4) {
            let i = rng.random_range(0..b.len());
            match rng.random_range(0..3) {
                0 => b[i] ^= 1 << rng.random_range(0..8),
                1 => b[i] = rng.random(),
                _ => b[i] = [0x00, 0xFF, 0x7F, 0x80][rng.random_range(0..4)],
            }
        }
        match parse(b) {
            Ok(f) => {
                walk(&f);
                ok += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err += 1;
            }
        }
    }
    // Both outcomes must actually occur, or the test is not exercising anything.
    assert!(ok > 100 && err > 100, "ok {ok} err {err}");
}

/// A long mutation run (insertions, deletions, splices, integer overwrites). Run with
/// `cargo test -p kvx-gguf --release -- --ignored` for a deeper search than the default test.
#[test]
#[ignore = "long; the fuzz target covers the same ground"]
fn long_randomized_mutation() {
    mutate_many(2_000_000, 0xF022);
}

#[test]
fn randomized_mutation() {
    mutate_many(30_000, 0xB0B);
}

fn mutate_many(iterations: usize, seed: u64) {
    let seeds = [
        sample_writer().to_bytes().unwrap(),
        {
            let mut w = sample_writer();
            w.version(2).alignment(64);
            w.to_bytes().unwrap()
        },
        GgufWriter::new().to_bytes().unwrap(),
    ];
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..iterations {
        let mut b = seeds[rng.random_range(0..seeds.len())].clone();
        for _ in 0..rng.random_range(1..=3) {
            if b.is_empty() {
                break;
            }
            let i = rng.random_range(0..b.len());
            match rng.random_range(0..6) {
                0 => b[i] = rng.random(),
                1 => {
                    b.remove(i);
                }
                2 => b.insert(i, rng.random()),
                3 => {
                    // Overwrite an 8-byte little-endian integer with an interesting value.
                    let v: u64 = [0, 1, 4, 63, 64, 255, u32::MAX as u64, i64::MAX as u64, u64::MAX]
                        [rng.random_range(0..9)];
                    let end = (i + 8).min(b.len());
                    let n = end - i;
                    b[i..end].copy_from_slice(&v.to_le_bytes()[..n]);
                }
                4 => b.truncate(i),
                _ => {
                    let j = rng.random_range(0..b.len());
                    let n = rng.random_range(0..16).min(b.len() - i.max(j));
                    b.copy_within(j..j + n, i);
                }
            }
        }
        if let Ok(f) = parse(b) {
            walk(&f);
        }
    }
}

#[test]
fn bad_magic_and_versions() {
    let mut b = sample_writer().to_bytes().unwrap();
    b[0] = b'X';
    assert!(matches!(parse(b), Err(GgufError::BadMagic { found }) if &found == b"XGUF"));

    let v1 = Raw::header(1, 0, 0).bytes();
    let e = parse(v1).unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedVersion { version: 1 }));
    assert!(e.to_string().contains("version 1 is not supported"), "{e}");

    let swapped = Raw::header(3u32.swap_bytes(), 0, 0).bytes();
    let e = parse(swapped).unwrap_err();
    assert!(e.to_string().contains("big-endian"), "{e}");

    for v in [0, 4, 99] {
        assert!(matches!(
            parse(Raw::header(v, 0, 0).bytes()),
            Err(GgufError::UnsupportedVersion { version }) if version == v
        ));
    }
    assert!(parse(Raw::header(2, 0, 0).bytes()).is_ok());
    assert!(parse(Raw::header(3, 0, 0).bytes()).is_ok());
    assert!(matches!(parse(b"GGU".to_vec()), Err(GgufError::Truncated { .. })));
}

#[test]
fn absurd_counts_fail_before_allocating() {
    for n_kv in [u64::MAX, u64::MAX / 13, 1 << 40, 2] {
        let e = parse(Raw::header(3, 0, n_kv).bytes()).unwrap_err();
        assert!(matches!(e, GgufError::CountTooLarge { what: "metadata entry", .. }), "{e}");
    }
    for n_t in [u64::MAX, 1 << 50, 1] {
        let e = parse(Raw::header(3, n_t, 0).bytes()).unwrap_err();
        assert!(matches!(e, GgufError::CountTooLarge { what: "tensor", .. }), "{e}");
    }
    // A string length far beyond the file.
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).zeros(16);
    assert!(matches!(parse(r.bytes()), Err(GgufError::Truncated { what: "metadata key", .. })));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(1 << 62).zeros(16);
    assert!(matches!(parse(r.bytes()), Err(GgufError::Truncated { what: "string value", .. })));
    // Array counts: elements of every size must fit.
    for (elem_type, count) in [(0u32, 1u64 << 60), (12, 3), (8, 3), (9, 2), (4, u64::MAX)] {
        let mut r = Raw::header(3, 0, 1);
        r.str("k").u32(9).u32(elem_type).u64(count).zeros(17);
        let e = parse(r.bytes()).unwrap_err();
        assert!(matches!(e, GgufError::CountTooLarge { what: "array element", .. }), "{e}");
    }
    // Nesting beyond the limit.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9);
    for _ in 0..100 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    let e = parse(r.bytes()).unwrap_err();
    assert!(matches!(e, GgufError::NestingTooDeep { .. }), "{e}");
}

#[test]
fn bad_metadata() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert!(matches!(parse(r.bytes()), Err(GgufError::UnknownValueType { type_id: 13, .. })));

    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(77).u64(0);
    assert!(matches!(parse(r.bytes()), Err(GgufError::UnknownValueType { type_id: 77, .. })));

    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(parse(r.bytes()), Err(GgufError::DuplicateKey(k)) if k == "k"));

    let mut r = Raw::header(3, 0, 1);
    r.u64(2).zeros(0);
    r.buf.extend_from_slice(&[0xC3, 0x28]);
    r.u32(4).u32(0);
    assert!(matches!(parse(r.bytes()), Err(GgufError::InvalidUtf8 { what: "metadata key", .. })));
}

#[test]
fn bad_alignment() {
    for a in [0u32, 3, 48, 1 << 31 | 1] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert!(matches!(parse(r.bytes()), Err(GgufError::BadAlignment(_))), "{a}");
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(10).u64(32);
    assert!(matches!(parse(r.bytes()), Err(GgufError::BadAlignment(s)) if s == "u64"));

    // A tensor offset that is not a multiple of the alignment.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[4], 0, 8).pad(32).zeros(64);
    assert!(matches!(parse(r.bytes()), Err(GgufError::MisalignedTensor { offset: 8, .. })));
    // The same offset is fine with alignment 8.
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 8).tensor("t", &[4], 0, 8).pad(8).zeros(64);
    assert!(parse(r.bytes()).is_ok());
}

#[test]
fn bad_tensor_table() {
    type Check = fn(&GgufError) -> bool;
    let cases: Vec<(Vec<u8>, Check)> = vec![
        // five dimensions
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1, 1, 1, 1, 1], 0, 0).pad(32).zeros(32);
                r.bytes()
            },
            |e| matches!(e, GgufError::TooManyDims { n_dims: 5, .. }),
        ),
        // a dimension above i64::MAX
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 63], 0, 0).pad(32);
                r.bytes()
            },
            |e| matches!(e, GgufError::BadDim { .. }),
        ),
        // element count overflow
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 32, 1 << 32], 0, 0).pad(32);
                r.bytes()
            },
            |e| matches!(e, GgufError::ShapeOverflow { .. }),
        ),
        // byte size overflow (elements fit in i64, bytes do not fit in u64)
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 62], 28, 0).pad(32);
                r.bytes()
            },
            |e| matches!(e, GgufError::ShapeOverflow { .. }),
        ),
        // unknown / retired type ids
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[32], 4, 0).pad(32).zeros(32);
                r.bytes()
            },
            |e| matches!(e, GgufError::UnknownTensorType { id: 4, .. }),
        ),
        // row not a whole number of blocks
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[100, 2], 12, 0).pad(32).zeros(512);
                r.bytes()
            },
            |e| matches!(e, GgufError::PartialBlock { row: 100, block: 256, .. }),
        ),
        // duplicate names
        (
            {
                let mut r = Raw::header(3, 2, 0);
                r.tensor("t", &[4], 0, 0).tensor("t", &[4], 0, 32).pad(32).zeros(64);
                r.bytes()
            },
            |e| matches!(e, GgufError::DuplicateTensor(_)),
        ),
        // data beyond the end of the file
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[16], 0, 0).pad(32).zeros(63);
                r.bytes()
            },
            |e| matches!(e, GgufError::TensorOutOfBounds { .. }),
        ),
        // offset so large that start + size overflows
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[16], 0, u64::MAX - 31).pad(32).zeros(64);
                r.bytes()
            },
            |e| matches!(e, GgufError::TensorOutOfBounds { .. }),
        ),
        // overlapping tensors
        (
            {
                let mut r = Raw::header(3, 2, 0);
                r.tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32).pad(32).zeros(128);
                r.bytes()
            },
            |e| matches!(e, GgufError::TensorOverlap { first, second } if first == "a" && second == "b"),
        ),
        // the same range twice
        (
            {
                let mut r = Raw::header(3, 2, 0);
                r.tensor("a", &[8], 0, 32).tensor("b", &[8], 0, 32).pad(32).zeros(128);
                r.bytes()
            },
            |e| matches!(e, GgufError::TensorOverlap { .. }),
        ),
        // header ends where the padded data section would start past the end of the file
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[0], 0, 0);
                r.bytes()
            },
            |e| matches!(e, GgufError::Truncated { .. }),
        ),
    ];
    for (i, (bytes, check)) in cases.into_iter().enumerate() {
        let e = parse(bytes).err().unwrap_or_else(|| panic!("case {i} parsed"));
        assert!(check(&e), "case {i}: {e}");
    }
}

#[test]
fn tensors_in_any_order_and_zero_sized_tensors_anywhere_are_fine() {
    // ggml writes tensors contiguously in table order; the reader only requires that they are
    // aligned, inside the file and disjoint.
    let mut r = Raw::header(3, 3, 0);
    r.tensor("late", &[8], 0, 32).tensor("early", &[8], 0, 0).tensor("empty", &[0], 0, 0);
    r.pad(32).zeros(64);
    let f = parse(r.bytes()).unwrap();
    assert_eq!(f.tensor("late").unwrap().offset, 32);
    assert_eq!(f.tensor_data(f.tensor("empty").unwrap()).len(), 0);
}

#[test]
fn tensor_info_from_another_file_cannot_read_out_of_bounds() {
    let big = parse(sample_writer().to_bytes().unwrap()).unwrap();
    let mut w = GgufWriter::new();
    w.tensor("x", &[1], kvx_gguf::GgmlType::F32, vec![0; 4]);
    let small = parse(w.to_bytes().unwrap()).unwrap();
    for t in big.tensors() {
        let data = small.tensor_data(t);
        assert!(data.len() as u64 == t.size_bytes() || data.is_empty());
    }
}

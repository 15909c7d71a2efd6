//! The GGUF container: metadata of every type, alignment, tensor placement, versions, and
//! hostile headers.

use nibble_core::Error;
use nibble_formats::gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};

fn open(bytes: &[u8]) -> Result<GgufFile, Error> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.gguf");
    std::fs::write(&p, bytes).unwrap();
    GgufFile::open(&p)
}

fn sample(alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.meta("general.alignment", MetaValue::U32(a));
    }
    w.meta("a.u8", MetaValue::U8(7))
        .meta("a.i8", MetaValue::I8(-7))
        .meta("a.u16", MetaValue::U16(65535))
        .meta("a.i16", MetaValue::I16(-300))
        .meta("a.u32", MetaValue::U32(4_000_000_000))
        .meta("a.i32", MetaValue::I32(-5))
        .meta("a.u64", MetaValue::U64(1 << 40))
        .meta("a.i64", MetaValue::I64(-(1 << 40)))
        .meta("a.f32", MetaValue::F32(1.5))
        .meta("a.f64", MetaValue::F64(-2.25))
        .meta("a.bool", MetaValue::Bool(true))
        .meta("a.str", MetaValue::String("héllo".into()))
        .meta(
            "a.arr",
            MetaValue::Array(vec![
                MetaValue::String("x".into()),
                MetaValue::String("yz".into()),
            ]),
        );
    let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.tensor("t.f32", &[2, 3], GgmlType::F32, f32s);
    w.tensor("t.q8", &[1, 32], GgmlType::Q8_0, vec![0u8; 34]);
    w
}

#[test]
fn metadata_and_tensors_round_trip() {
    for alignment in [None, Some(64), Some(256)] {
        let f = open(&sample(alignment).to_bytes()).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.alignment, alignment.unwrap_or(32) as usize);
        assert_eq!(f.metadata("a.i16"), Some(&MetaValue::I16(-300)));
        assert_eq!(f.get_u64("a.u64").unwrap(), 1 << 40);
        assert_eq!(f.get_f64("a.f64").unwrap(), -2.25);
        assert_eq!(f.get_str("a.str").unwrap(), "héllo");
        assert_eq!(f.get_str_array("a.arr").unwrap(), vec!["x", "yz"]);
        assert_eq!(f.metadata("a.bool").and_then(|v| v.as_bool()), Some(true));
        let t = f.tensor("t.f32").unwrap();
        assert_eq!(t.shape(), vec![2, 3]);
        assert_eq!(t.dims, vec![3, 2], "ggml order is innermost first");
        assert_eq!(t.start % f.alignment, 0);
        let vals: Vec<f32> = f
            .tensor_bytes(t)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let q = f.tensor("t.q8").unwrap();
        assert_eq!(
            (q.ty, q.len, q.start % f.alignment),
            (GgmlType::Q8_0, 34, 0)
        );
        // Typed getters name the key when the type is wrong or the key is absent.
        assert!(f.get_str("a.u8").unwrap_err().to_string().contains("a.u8"));
        assert!(
            f.get_u64("missing.key")
                .unwrap_err()
                .to_string()
                .contains("missing.key")
        );
    }
}

#[test]
fn version_2_is_read_and_version_1_refused() {
    let mut bytes = sample(None).to_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(open(&bytes).unwrap().version, 2);
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let e = open(&bytes).unwrap_err();
    assert!(e.to_string().contains("GGUF version 1"), "{e}");
}

#[test]
fn absurd_counts_fail_fast_without_allocating() {
    let mut bytes = sample(None).to_bytes();
    // Tensor count: 2^62.
    bytes[8..16].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = open(&bytes).unwrap_err();
    assert!(matches!(e, Error::CorruptFile { .. }), "{e}");
    let mut bytes = sample(None).to_bytes();
    // First key's length: 2^60 bytes.
    bytes[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(
        open(&bytes).unwrap_err(),
        Error::CorruptFile { .. }
    ));
}

#[test]
fn bad_alignment_is_refused() {
    let e = open(&sample(Some(48)).to_bytes()).unwrap_err();
    assert!(e.to_string().contains("general.alignment"), "{e}");
}

#[test]
fn tensor_past_end_says_truncated() {
    let bytes = sample(None).to_bytes();
    let e = open(&bytes[..bytes.len() - 10]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
}

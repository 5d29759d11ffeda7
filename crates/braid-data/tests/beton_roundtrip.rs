//! braid → braid round trips of `.beton` files: fixed schemas with every
//! field type, samples that move to a fresh page, and property tests on
//! random schemas and values (every value read back bit-exact).

use std::path::PathBuf;

use braid_data::beton::dtype::ALL;
use braid_data::beton::{Beton, DType, FieldType, FieldValue, ImageMode, Value, Writer};
use proptest::prelude::*;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-beton-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// What a written value reads back as, compared field by field.
fn assert_reads_back(v: &Value, w: &FieldValue) {
    match (v, w) {
        (Value::Int(a), FieldValue::Int(b)) => assert_eq!(a, b),
        (Value::Float(a), FieldValue::Float(b)) => assert_eq!(a.to_bits(), b.to_bits()),
        (Value::Bytes(a), FieldValue::Bytes(b)) => assert_eq!(a, &b.as_slice()),
        (Value::Json(a), FieldValue::Json(b)) => assert_eq!(*a, b.as_bytes()),
        (Value::Array { data, .. }, FieldValue::Array(b)) => assert_eq!(data, &b.as_slice()),
        (Value::Tokens { .. }, FieldValue::Tokens(t)) => assert_eq!(&v.tokens().unwrap(), t),
        (
            Value::Image(i),
            FieldValue::Image {
                mode,
                width,
                height,
                data,
            },
        ) => {
            assert_eq!((i.mode, i.width, i.height), (*mode, *width, *height));
            assert_eq!(i.data, data.as_slice());
        }
        (v, w) => panic!("read {v:?} for written {w:?}"),
    }
}

fn write_and_check(
    name: &str,
    fields: &[(String, FieldType)],
    samples: &[Vec<FieldValue>],
    page: u64,
) -> Beton {
    let path = temp(name);
    let mut w = Writer::create(&path, fields, samples.len() as u64, page).unwrap();
    for s in samples {
        w.push(s).unwrap();
    }
    let written = w.finish().unwrap();
    assert_eq!(written.bytes, std::fs::metadata(&path).unwrap().len());
    let b = Beton::open(&path).unwrap();
    assert_eq!(b.len(), samples.len());
    assert_eq!(b.index().page_size(), page);
    for (s, values) in samples.iter().enumerate() {
        for (f, want) in values.iter().enumerate() {
            assert_reads_back(&b.value(s, f).unwrap(), want);
        }
        // All of a sample's payloads on one page, as FFCV keeps them.
        let pages: Vec<u64> = b.index().pages_of(s).collect();
        assert!(
            pages.windows(2).all(|p| p[0] == p[1]),
            "sample {s}: {pages:?}"
        );
    }
    std::fs::remove_file(&path).unwrap();
    b
}

#[test]
fn every_field_type_round_trips() {
    let fields = vec![
        ("label".to_string(), FieldType::Int),
        ("score".to_string(), FieldType::Float),
        (
            "mat".to_string(),
            FieldType::NdArray {
                dtype: DType::F32,
                shape: vec![3, 4],
            },
        ),
        ("blob".to_string(), FieldType::Bytes),
        ("meta".to_string(), FieldType::Json),
        ("image".to_string(), FieldType::RgbImage),
        (
            "tokens".to_string(),
            FieldType::Tokens {
                dtype: DType::U16,
                window: 9,
                vocab: 50257,
            },
        ),
    ];
    let samples: Vec<Vec<FieldValue>> = (0..50)
        .map(|i| {
            let mat: Vec<u8> = (0..12)
                .flat_map(|k| (i as f32 * 0.5 + k as f32).to_le_bytes())
                .collect();
            let (w, h) = (3 + i % 5, 2 + i % 3);
            vec![
                FieldValue::Int(i as i64 - 25),
                FieldValue::Float(i as f64 / 7.0),
                FieldValue::Array(mat),
                FieldValue::Bytes(vec![i as u8; i]),
                FieldValue::Json(format!(r#"{{"id": {i}, "tags": ["a", "b"]}}"#)),
                if i % 2 == 0 {
                    FieldValue::Image {
                        mode: ImageMode::Raw,
                        width: w as u16,
                        height: h as u16,
                        data: (0..w * h * 3).map(|k| (k * 7 + i) as u8).collect(),
                    }
                } else {
                    FieldValue::Image {
                        mode: ImageMode::Jpeg,
                        width: 640,
                        height: 480,
                        data: vec![0xff, 0xd8, i as u8, 0xff, 0xd9],
                    }
                },
                FieldValue::Tokens((0..9).map(|k| (i * 100 + k) as u32).collect()),
            ]
        })
        .collect();
    let b = write_and_check("all.beton", &fields, &samples, 1 << 21);
    let j = b.value(3, 4).unwrap().to_json().unwrap();
    assert_eq!(j, serde_json::json!({"id": 3, "tags": ["a", "b"]}));
    assert_eq!(b.index().fields[6].ty.name(), "tokens <u2 [9]");
}

#[test]
fn a_sample_that_does_not_fit_starts_again_on_a_fresh_page() {
    // Pages of 4 KiB; each sample 1.5 KiB in two payloads: the third's
    // second payload does not fit, so it moves whole to page 1.
    let fields = vec![
        ("a".to_string(), FieldType::Bytes),
        ("b".to_string(), FieldType::Bytes),
    ];
    let samples: Vec<Vec<FieldValue>> = (0..7)
        .map(|i| {
            vec![
                FieldValue::Bytes(vec![i as u8 + 1; 1000]),
                FieldValue::Bytes(vec![i as u8 + 100; 500]),
            ]
        })
        .collect();
    let b = write_and_check("pages.beton", &fields, &samples, 4096);
    let pages: Vec<u64> = (0..7)
        .map(|s| b.index().pages_of(s).next().unwrap())
        .collect();
    let first = pages[0];
    assert_eq!(
        pages.iter().map(|p| p - first).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2, 2, 3]
    );
    // FFCV leaves the abandoned first payload of sample 2 on page 0.
    assert_eq!(b.index().allocations.len(), 14);
}

#[test]
fn a_sample_larger_than_a_page_and_bad_values_are_refused() {
    let path = temp("refused.beton");
    let fields = vec![("a".to_string(), FieldType::Bytes)];
    let mut w = Writer::create(&path, &fields, 2, 4096).unwrap();
    let e = w.push(&[FieldValue::Bytes(vec![0; 5000])]).unwrap_err();
    assert!(e.contains("larger page size"), "{e}");
    let e = w.push(&[FieldValue::Int(3)]).unwrap_err();
    assert!(e.contains("another type"), "{e}");
    let e = w.finish().unwrap_err();
    assert!(e.contains("0 of 2 samples"), "{e}");
    assert!(!path.exists(), "an unfinished file must not appear");
    assert!(Writer::create(&path, &fields, 1, 3000)
        .unwrap_err()
        .contains("power of two"));
    let long = vec![("a_very_long_field_name".to_string(), FieldType::Int)];
    assert!(Writer::create(&path, &long, 1, 4096)
        .unwrap_err()
        .contains("1 to 16"));
    let scalar = vec![(
        "x".to_string(),
        FieldType::NdArray {
            dtype: DType::F32,
            shape: vec![],
        },
    )];
    assert!(Writer::create(&path, &scalar, 1, 4096)
        .unwrap_err()
        .contains("0-d"));
    // Nothing left behind in the directory by the refused writers.
    let dir = path.parent().unwrap();
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("refused"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// One random field type and a generator of its values.
fn field_type() -> impl Strategy<Value = FieldType> {
    prop_oneof![
        Just(FieldType::Int),
        Just(FieldType::Float),
        Just(FieldType::Bytes),
        Just(FieldType::Json),
        Just(FieldType::RgbImage),
        (0..ALL.len(), prop::collection::vec(1u64..4, 1..4)).prop_map(|(d, shape)| {
            FieldType::NdArray {
                dtype: ALL[d],
                shape,
            }
        }),
        (any::<bool>(), 2u64..20).prop_map(|(wide, window)| FieldType::Tokens {
            dtype: if wide { DType::U32 } else { DType::U16 },
            window,
            vocab: 1000,
        }),
    ]
}

fn value_of(ty: &FieldType, seed: u64) -> FieldValue {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match ty {
        FieldType::Int => FieldValue::Int(next() as i64),
        FieldType::Float => FieldValue::Float(f64::from_bits(next())),
        FieldType::Bytes => FieldValue::Bytes((0..next() % 300).map(|_| next() as u8).collect()),
        FieldType::Json => FieldValue::Json(format!("[{}, \"x{}\"]", next() % 1000, next() % 7)),
        FieldType::RgbImage => {
            let (w, h) = (1 + next() % 20, 1 + next() % 20);
            if next() % 2 == 0 {
                FieldValue::Image {
                    mode: ImageMode::Raw,
                    width: w as u16,
                    height: h as u16,
                    data: (0..w * h * 3).map(|_| next() as u8).collect(),
                }
            } else {
                FieldValue::Image {
                    mode: ImageMode::Jpeg,
                    width: w as u16,
                    height: h as u16,
                    data: (0..1 + next() % 200).map(|_| next() as u8).collect(),
                }
            }
        }
        FieldType::Tokens { dtype, window, .. } => FieldValue::Tokens(
            (0..*window)
                .map(|_| (next() % if dtype.size() == 2 { 65536 } else { 1 << 32 }) as u32)
                .collect(),
        ),
        t => FieldValue::Array(
            (0..t.array_bytes().unwrap())
                .map(|_| next() as u8)
                .collect(),
        ),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_schemas_round_trip_bit_exact(
        types in prop::collection::vec(field_type(), 1..6),
        samples in 0usize..40,
        page_log in 12u32..15,
        seed in any::<u64>(),
    ) {
        let fields: Vec<(String, FieldType)> = types
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("f{i}"), t.clone()))
            .collect();
        let values: Vec<Vec<FieldValue>> = (0..samples)
            .map(|s| types.iter().enumerate().map(|(f, t)| value_of(t, seed ^ (s * 131 + f) as u64)).collect())
            .collect();
        let name = format!("prop-{seed}.beton");
        let b = write_and_check(&name, &fields, &values, 1 << page_log);
        // The JSON form of every value exists (what `braid data inspect` prints).
        for s in 0..b.len() {
            for f in 0..fields.len() {
                prop_assert!(b.value(s, f).unwrap().to_json().is_ok());
            }
        }
    }
}

//! Interop with the real `ffcv` package: the fixtures in
//! `tests/fixtures/ffcv/` were written by ffcv 1.0.2
//! (`make_fixtures.py` beside them) together with the values ffcv reads
//! from them. braid must read every value equal, and — given those values
//! — write the same bytes ffcv wrote (files from one writer process).

mod common;
use common::ffcv_fixture;

use std::path::Path;

use braid_data::beton::{Beton, FieldValue, Value, Writer};
use serde_json::Value as Json;

fn check_reads_equal(name: &str) -> Beton {
    let b = Beton::open(&ffcv_fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let text =
        std::fs::read_to_string(ffcv_fixture(&name.replace(".beton", ".expected.json"))).unwrap();
    let want: Json = serde_json::from_str(&text).unwrap();
    let got = b.to_json(b.len()).unwrap();
    for key in ["num_samples", "page_size", "fields"] {
        assert_eq!(got[key], want[key], "{name}: {key}");
    }
    let (g, w) = (
        got["samples"].as_array().unwrap(),
        want["samples"].as_array().unwrap(),
    );
    assert_eq!(g.len(), w.len());
    for (s, (g, w)) in g.iter().zip(w).enumerate() {
        assert_eq!(g, w, "{name}: sample {s}");
    }
    b
}

/// Writes `b`'s values again with braid, into `out`.
fn rewrite(b: &Beton, out: &Path) {
    let idx = b.index();
    let fields: Vec<(String, _)> = idx
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.ty.clone()))
        .collect();
    let mut w = Writer::create(out, &fields, b.len() as u64, idx.page_size()).unwrap();
    for s in 0..b.len() {
        let values: Vec<FieldValue> = (0..fields.len())
            .map(|f| match b.value(s, f).unwrap() {
                Value::Int(v) => FieldValue::Int(v),
                Value::Float(v) => FieldValue::Float(v),
                Value::Bytes(v) => FieldValue::Bytes(v.to_vec()),
                Value::Json(t) => FieldValue::Json(String::from_utf8(t.to_vec()).unwrap()),
                Value::Array { data, .. } => FieldValue::Array(data.to_vec()),
                Value::Tokens { .. } => unreachable!("no token fields in ffcv's files"),
                Value::Image(i) => FieldValue::Image {
                    mode: i.mode,
                    width: i.width,
                    height: i.height,
                    data: i.data.to_vec(),
                },
            })
            .collect();
        w.push(&values).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn ffcv_files_read_equal_and_braid_writes_them_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("braid-ffcv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["scalars.beton", "arrays.beton", "images.beton"] {
        let b = check_reads_equal(name);
        let out = dir.join(name);
        rewrite(&b, &out);
        let (ours, theirs) = (
            std::fs::read(&out).unwrap(),
            std::fs::read(ffcv_fixture(name)).unwrap(),
        );
        assert_eq!(ours.len(), theirs.len(), "{name}: file length");
        if let Some(at) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("{name}: braid's file differs from ffcv's first at byte {at}");
        }
        std::fs::remove_file(&out).unwrap();
    }
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn a_file_of_many_pages_from_two_ffcv_workers_reads_equal() {
    let b = check_reads_equal("pages.beton");
    let pages: std::collections::BTreeSet<u64> = (0..b.len())
        .flat_map(|s| b.index().pages_of(s).collect::<Vec<_>>())
        .collect();
    assert!(pages.len() >= 5, "{} pages", pages.len());
    assert_eq!(b.index().page_size(), 2 << 20);
    // Two workers filled pages side by side: sample order is not page order.
    let first: Vec<u64> = (0..b.len())
        .map(|s| b.index().pages_of(s).next().unwrap())
        .collect();
    assert!(first.windows(2).any(|w| w[1] < w[0]), "{first:?}");
}

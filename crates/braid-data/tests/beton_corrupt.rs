//! Corrupt, truncated and foreign `.beton` files: each of the kinds below
//! gets an error naming the offset and what was expected — no panic, and
//! no allocation larger than the file could justify (a counting
//! allocator watches every one) — and a bounded fuzz run of random
//! mutations of a valid file holds to the same. A damaged JPEG payload
//! reads (it is only bytes) but gets an error naming its sample when it
//! is decoded.

mod common;
use common::ffcv_fixture;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use braid_data::beton::{Beton, DType, FieldType, FieldValue, ImageMode, Value, Writer};
use braid_data::{jpeg, sheet};

/// The largest single allocation since the last reset.
static LARGEST: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: every call goes straight to the system allocator; the counter
// only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc` above with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LARGEST.fetch_max(n, Ordering::Relaxed);
        // SAFETY: as for `dealloc`; `n` is the caller's new size.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The tests take turns: the counter is global.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-beton-bad-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A valid file: int, ndarray, bytes, json and image fields, 4 KiB pages.
fn valid() -> Vec<u8> {
    let path = dir().join("valid.beton");
    let fields = vec![
        ("label".to_string(), FieldType::Int),
        (
            "arr".to_string(),
            FieldType::NdArray {
                dtype: DType::F32,
                shape: vec![4],
            },
        ),
        ("blob".to_string(), FieldType::Bytes),
        ("meta".to_string(), FieldType::Json),
        ("image".to_string(), FieldType::RgbImage),
    ];
    let mut w = Writer::create(&path, &fields, 40, 4096).unwrap();
    for i in 0..40u8 {
        w.push(&[
            FieldValue::Int(i as i64),
            FieldValue::Array(vec![i; 16]),
            FieldValue::Bytes(vec![i; 1 + i as usize * 10]),
            FieldValue::Json(format!("{{\"i\": {i}}}")),
            FieldValue::Image {
                mode: ImageMode::Raw,
                width: 4,
                height: 3,
                data: vec![i; 36],
            },
        ])
        .unwrap();
    }
    w.finish().unwrap();
    let b = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    b
}

const META: usize = 24 + 5 * 1041;
// Metadata struct: label 0..8, arr ptr 8..16, blob 16..32, meta 32..48,
// image 48..61, padded to 64.
const STRIDE: usize = 64;

fn put(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn table_at(b: &[u8]) -> usize {
    u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize
}

/// Opens `bytes` (written to a file) and reads every value in JSON form;
/// the first error, if any. Panics are failures of the test.
fn open_and_read(path: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(path, bytes).unwrap();
    let b = Beton::open(path)?;
    for s in 0..b.len() {
        for f in 0..b.index().fields.len() {
            b.value(s, f)?.to_json()?;
        }
    }
    Ok(())
}

/// A damaged file's error names `expect`, and nothing allocated more
/// than twice the good file's `good` bytes (plus 64 KiB) on the way.
fn assert_refused(what: &str, e: &str, expect: &str, good: usize, len: usize) {
    assert!(
        e.contains(expect),
        "{what}: expected an error with {expect:?}, got: {e}"
    );
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest <= 2 * good + (1 << 16),
        "{what}: an allocation of {largest} bytes for a file of {len}"
    );
}

#[test]
fn twenty_kinds_of_damage_get_clear_errors() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let good = valid();
    let path = dir().join("damaged.beton");
    assert_eq!(open_and_read(&path, &good), Ok(()));
    let at = table_at(&good);
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "empty file",
            Box::new(|b| b.clear()),
            "before the 24 bytes of its header",
        ),
        ("cut in the header", Box::new(|b| b.truncate(10)), "header"),
        (
            "another format",
            Box::new(|b| b[0..4].copy_from_slice(b"PK\x03\x04")),
            "format version",
        ),
        ("version 1", Box::new(|b| b[0] = 1), "expected 2"),
        (
            "no fields",
            Box::new(|b| b[2..4].copy_from_slice(&0u16.to_le_bytes())),
            "no fields",
        ),
        (
            "page size not a power of two",
            Box::new(|b| b[4..8].copy_from_slice(&5000u32.to_le_bytes())),
            "page size 5000",
        ),
        (
            "page size 0",
            Box::new(|b| b[4..8].copy_from_slice(&0u32.to_le_bytes())),
            "page size 0",
        ),
        (
            "more fields than the file holds",
            Box::new(|b| b[2..4].copy_from_slice(&60000u16.to_le_bytes())),
            "field table",
        ),
        (
            "unknown field type",
            Box::new(|b| b[24] = 9),
            "unknown field type id 9",
        ),
        (
            "custom field type",
            Box::new(|b| b[24] = 255),
            "custom field",
        ),
        ("unnamed field", Box::new(|b| b[25] = 0), "no ASCII name"),
        (
            "two fields of one name",
            Box::new(|b| b[24 + 1041 + 1..24 + 1041 + 6].copy_from_slice(b"label")),
            "two fields are named 'label'",
        ),
        (
            "array type description too long",
            Box::new(|b| put(b, 24 + 1041 + 17 + 256, 5000)),
            "type description is 5000 bytes",
        ),
        (
            "array type not JSON",
            Box::new(|b| b[24 + 1041 + 17 + 264] = b'{'),
            "not JSON",
        ),
        (
            "array of strings",
            Box::new(|b| {
                b[24 + 1041 + 17 + 264 + 7..24 + 1041 + 17 + 264 + 10].copy_from_slice(b"U10")
            }),
            "unsupported NDArray element type",
        ),
        (
            "array with a zero dimension in the middle",
            Box::new(|b| {
                put(b, 24 + 1041 + 17, 0);
                put(b, 24 + 1041 + 17 + 8, 4);
            }),
            "zero dimension",
        ),
        (
            "2^60 samples",
            Box::new(|b| put(b, 8, 1 << 60)),
            "cannot fit",
        ),
        (
            "allocation table past the end",
            Box::new(|b| {
                let n = b.len() as u64;
                put(b, 16, n + 24)
            }),
            "allocation table is said to start",
        ),
        (
            "allocation table inside the metadata",
            Box::new(|b| put(b, 16, (META + 10) as u64)),
            "end of the metadata",
        ),
        (
            "truncated allocation table",
            Box::new(|b| {
                let n = b.len();
                b.truncate(n - 5)
            }),
            "not a multiple",
        ),
        (
            "truncated data region",
            Box::new(move |b| {
                b.drain(at - 4096..at);
                put(b, 16, (at - 4096) as u64)
            }),
            "outside the data region",
        ),
        (
            "allocation of a sample that does not exist",
            Box::new(move |b| put(b, at, 999)),
            "belongs to sample 999",
        ),
        (
            "allocation crossing a page",
            Box::new(move |b| {
                put(b, at + 8, 12288 - 2);
                put(b, at + 16, 16)
            }),
            "crosses a page",
        ),
        (
            "payload pointer not allocated",
            Box::new(|b| put(b, META + 8, 12345)),
            "not in the allocation table",
        ),
        (
            "payload of another sample",
            Box::new(|b| {
                let p = u64::from_le_bytes(
                    b[META + STRIDE + 8..META + STRIDE + 16].try_into().unwrap(),
                );
                put(b, META + 8, p)
            }),
            "belongs to sample 1",
        ),
        (
            "bytes size disagrees",
            Box::new(|b| put(b, META + 24, 77)),
            "the metadata says 77 bytes",
        ),
        (
            "image mode 7",
            Box::new(|b| b[META + 48] = 7),
            "image mode 7",
        ),
        (
            "raw image of the wrong size",
            Box::new(|b| b[META + 49] = 5),
            "a raw 5x3 image needs 45 bytes",
        ),
        (
            "JSON payload not JSON",
            Box::new(|b| {
                let p = u64::from_le_bytes(b[META + 32..META + 40].try_into().unwrap()) as usize;
                b[p] = b'}'
            }),
            "not JSON",
        ),
    ];
    assert!(cases.len() >= 20);
    for (what, damage, expect) in &cases {
        let mut b = good.clone();
        damage(&mut b);
        LARGEST.store(0, Ordering::Relaxed);
        let e = match open_and_read(&path, &b) {
            Ok(()) => panic!("{what}: read without an error"),
            Err(e) => e,
        };
        assert_refused(what, &e, expect, good.len(), b.len());
    }
}

#[test]
fn random_mutations_never_panic_or_over_allocate() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let good = valid();
    let path = dir().join("fuzzed.beton");
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let start = Instant::now();
    let (mut tries, mut refused) = (0, 0);
    // Bounded in cases and in time, deterministic in what it tries.
    while tries < 3000 && start.elapsed() < Duration::from_secs(20) {
        let mut b = good.clone();
        match next() % 4 {
            0 => b.truncate((next() % b.len() as u64) as usize),
            1 => {
                for _ in 0..1 + next() % 8 {
                    let i = (next() % b.len() as u64) as usize;
                    b[i] = next() as u8;
                }
            }
            2 => {
                // A wild u64 where the format keeps its sizes and pointers.
                let spots = [
                    8,
                    16,
                    META + 8,
                    META + 16,
                    META + 24,
                    table_at(&good),
                    table_at(&good) + 8,
                    table_at(&good) + 16,
                ];
                let i = spots[(next() % spots.len() as u64) as usize];
                if i + 8 <= b.len() {
                    put(&mut b, i, next() >> (next() % 64));
                }
            }
            _ => {
                let i = (next() % b.len() as u64) as usize;
                b.insert(i, next() as u8);
            }
        }
        LARGEST.store(0, Ordering::Relaxed);
        if open_and_read(&path, &b).is_err() {
            refused += 1;
        }
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            largest <= 2 * good.len() + (1 << 16),
            "try {tries}: an allocation of {largest} bytes"
        );
        tries += 1;
    }
    assert!(tries >= 200, "only {tries} mutations in the time allowed");
    assert!(
        refused > tries / 4,
        "{refused} of {tries} damaged files refused"
    );
}

#[test]
fn damaged_jpeg_payloads_read_but_do_not_decode() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    match jpeg::info(&[]) {
        Err(e) if e.contains("built without libjpeg-turbo") => {
            eprintln!("skipped: {e}");
            return;
        }
        _ => {}
    }
    // ffcv's file: field 'jpg' holds every sample as JPEG.
    let good = std::fs::read(ffcv_fixture("images.beton")).unwrap();
    let b = Beton::open(&ffcv_fixture("images.beton")).unwrap();
    let f = b.index().field("jpg").unwrap();
    let e = b.index().extent(0, f).unwrap();
    let jpg = b.payload(e);
    assert!(jpeg::decode(jpg).is_ok());
    let (p, n) = (e.ptr as usize, e.size as usize);
    // Where the entropy-coded data starts: after the SOS segment.
    let sos = jpg.windows(2).position(|w| w == [0xff, 0xda]).unwrap();
    let scan = p + sos + 2 + u16::from_be_bytes([jpg[sos + 2], jpg[sos + 3]]) as usize;
    assert!(
        scan + 16 < p + n - 2,
        "sample 0's scan is {} bytes",
        p + n - scan
    );
    // The allocation table entry's size field, to truncate the payload.
    let a = b
        .index()
        .allocations
        .iter()
        .position(|a| (a.sample_id, a.ptr, a.size) == (0, e.ptr, e.size))
        .unwrap();
    let size_at = table_at(&good) + a * 24 + 16;
    drop(b);
    let path = dir().join("damaged-jpeg.beton");
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "JPEG start marker overwritten",
            Box::new(move |b| b[p..p + 2].fill(0)),
            "Not a JPEG file",
        ),
        (
            "markers in the JPEG's scan data",
            Box::new(move |b| {
                for i in (scan + 4..scan + 16).step_by(2) {
                    b[i..i + 2].copy_from_slice(&[0xff, 0xd9]);
                }
            }),
            "Corrupt JPEG data",
        ),
        (
            "JPEG cut in half",
            Box::new(move |b| put(b, size_at, n as u64 / 2)),
            "Premature end of JPEG file",
        ),
        (
            "JPEG without its end marker",
            Box::new(move |b| put(b, size_at, n as u64 - 2)),
            "Premature end of JPEG file",
        ),
    ];
    for (what, damage, expect) in &cases {
        let mut bytes = good.clone();
        damage(&mut bytes);
        LARGEST.store(0, Ordering::Relaxed);
        // Reading is fine: a JPEG payload is only bytes until decoded.
        assert_eq!(open_and_read(&path, &bytes), Ok(()), "{what}");
        let b = Beton::open(&path).unwrap();
        let Value::Image(img) = b.value(0, f).unwrap() else {
            panic!("{what}: not an image");
        };
        assert_eq!(img.mode, ImageMode::Jpeg);
        let e = match jpeg::decode(img.data) {
            Ok(_) => panic!("{what}: decoded without an error"),
            Err(e) => e,
        };
        assert_refused(what, &e, expect, good.len(), bytes.len());
        // A contact sheet of the field names the damaged sample.
        let opts = sheet::SheetOptions {
            field: Some("jpg"),
            count: 4,
            columns: 8,
        };
        let e = sheet::build(&b, &opts).unwrap_err();
        assert!(
            e.contains("sample 0, field 'jpg'") && e.contains(expect),
            "{what}: {e}"
        );
        // The other fields' images of sample 0 are intact.
        let raw = sheet::SheetOptions {
            field: Some("raw"),
            ..opts
        };
        assert!(sheet::build(&b, &raw).is_ok());
    }
}

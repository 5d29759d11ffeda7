//! Writes `.beton` files with braid's writer for the real `ffcv` package to
//! read (`scripts/ffcv/check_braid_files.py` runs this, then compares what
//! ffcv reads with `braid data inspect --json --samples all`):
//!
//! - `every_type.beton`: int, float (with nan and inf), bytes, JSON,
//!   NDArrays of every dtype, a torch tensor, raw images of one size (so
//!   FFCV's simple image decoder takes them) and token windows; 64 KiB pages;
//! - `small_pages.beton`: variable-size payloads over many 4 KiB pages;
//! - `default_pages.beton`: 8 MiB pages (FFCV's default).
//!
//! Usage: `cargo run -p braid-data --example interop_files -- OUT_DIR`

use std::path::Path;

use braid_data::beton::dtype::ALL;
use braid_data::beton::{DType, FieldType, FieldValue, ImageMode, Writer};

/// A small deterministic generator (xorshift).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Random elements of `dtype`: finite floats (and some nan/inf), any bits
/// for integers, 0/1 for bools.
fn elements(g: &mut Gen, dtype: DType, n: usize, specials: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let x = (g.next() % 20_000) as f64 / 100.0 - 100.0;
        let x = match (specials, i) {
            (true, 0) => f64::NAN,
            (true, 1) => f64::NEG_INFINITY,
            _ => x,
        };
        match dtype {
            DType::Bool => out.push((g.next() % 2) as u8),
            DType::F16 => out.extend(half::f16::from_f64(x).to_le_bytes()),
            DType::F32 => out.extend((x as f32).to_le_bytes()),
            DType::F64 => out.extend(x.to_le_bytes()),
            DType::C64 => {
                out.extend((x as f32).to_le_bytes());
                out.extend((-x as f32).to_le_bytes());
            }
            DType::C128 => {
                out.extend(x.to_le_bytes());
                out.extend((x * 0.5).to_le_bytes());
            }
            t => out.extend(g.bytes(t.size())),
        }
    }
    out
}

fn every_type(dir: &Path) -> Result<(), String> {
    let mut fields = vec![
        ("label".to_string(), FieldType::Int),
        ("score".to_string(), FieldType::Float),
        ("blob".to_string(), FieldType::Bytes),
        ("meta".to_string(), FieldType::Json),
        ("image".to_string(), FieldType::RgbImage),
        (
            "tokens".to_string(),
            FieldType::Tokens {
                dtype: DType::U16,
                window: 17,
                vocab: 50257,
            },
        ),
        (
            "tensor".to_string(),
            FieldType::TorchTensor {
                dtype: DType::F32,
                shape: vec![2, 3],
            },
        ),
    ];
    for (i, t) in ALL.iter().enumerate() {
        let shape = match i % 3 {
            0 => vec![5],
            1 => vec![2, 3],
            _ => vec![2, 1, 2],
        };
        let name = format!("a{}", t.descr().trim_start_matches(['<', '|']));
        fields.push((name, FieldType::NdArray { dtype: *t, shape }));
    }
    let n = 64;
    let mut w = Writer::create(&dir.join("every_type.beton"), &fields, n, 1 << 16)?;
    let mut g = Gen(0x5eed);
    for s in 0..n {
        let mut v = vec![
            FieldValue::Int(g.next() as i64),
            FieldValue::Float(match s {
                0 => f64::NAN,
                1 => f64::INFINITY,
                2 => -0.0,
                _ => (g.next() as f64) / 3.0e15 - 3000.0,
            }),
            {
                let len = (g.next() % 100) as usize;
                FieldValue::Bytes(g.bytes(len))
            },
            FieldValue::Json(format!(
                r#"{{"id": {s}, "text": "sample \u00e9 {s}", "list": [1.5, null, false, {}]}}"#,
                g.next() % 1000
            )),
            FieldValue::Image {
                mode: ImageMode::Raw,
                width: 16,
                height: 12,
                data: g.bytes(16 * 12 * 3),
            },
            FieldValue::Tokens((0..17).map(|_| (g.next() % 50257) as u32).collect()),
            FieldValue::Array(elements(&mut g, DType::F32, 6, false)),
        ];
        for (_, t) in &fields[7..] {
            if let FieldType::NdArray { dtype, shape } = t {
                let count = shape.iter().product::<u64>() as usize;
                v.push(FieldValue::Array(elements(&mut g, *dtype, count, s == 0)));
            }
        }
        w.push(&v)?;
    }
    w.finish()?;
    Ok(())
}

fn pages(dir: &Path, name: &str, page: u64, n: u64, max: u64) -> Result<(), String> {
    let fields = vec![
        ("id".to_string(), FieldType::Int),
        ("payload".to_string(), FieldType::Bytes),
        ("picture".to_string(), FieldType::RgbImage),
    ];
    let mut w = Writer::create(&dir.join(name), &fields, n, page)?;
    let mut g = Gen(0xbeef + page);
    for s in 0..n {
        let (wd, ht) = (1 + g.next() % 20, 1 + g.next() % 20);
        let len = (g.next() % max) as usize;
        w.push(&[
            FieldValue::Int(s as i64),
            FieldValue::Bytes(g.bytes(len)),
            FieldValue::Image {
                mode: ImageMode::Raw,
                width: wd as u16,
                height: ht as u16,
                data: g.bytes((wd * ht * 3) as usize),
            },
        ])?;
    }
    let written = w.finish()?;
    println!(
        "{name}: {} samples on {} pages",
        written.samples, written.pages
    );
    Ok(())
}

fn main() -> Result<(), String> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: interop_files OUT_DIR")?;
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    every_type(dir)?;
    pages(dir, "small_pages.beton", 4096, 300, 3000)?;
    pages(dir, "default_pages.beton", 8 << 20, 50, 100_000)?;
    Ok(())
}

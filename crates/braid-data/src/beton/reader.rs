//! Reading samples of a `.beton` file through the OS page cache: the
//! index in memory, the data region memory-mapped (shared by every
//! process on the node that maps the same file).

use std::path::Path;

use memmap2::Mmap;
use serde_json::Value as Json;

use super::field::FieldType;
use super::index::{Extent, ImageMode, Index};
use super::layout::{u16_at, u64_at};
use super::value::{Image, Value};

/// An open `.beton` file.
pub struct Beton {
    index: Index,
    map: Mmap,
}

impl Beton {
    /// Opens `path`, checks its index and maps it.
    pub fn open(path: &Path) -> Result<Beton, String> {
        let (index, file) = Index::open(path)?;
        Beton::from_index(index, &file)
    }

    /// Maps `file`, whose checked index is `index` (from [`Index::open`]).
    pub(crate) fn from_index(index: Index, file: &std::fs::File) -> Result<Beton, String> {
        let path = &index.path;
        // SAFETY: the mapping is read-only and private to this value;
        // braid never writes a file it has open for reading, and a file
        // truncated by another program under a live mapping is outside
        // what any mmap reader (FFCV's included) can defend. (The index
        // refused files shorter than a header, so the mapping is not
        // empty.)
        let map = unsafe { Mmap::map(file) }.map_err(|e| format!("cannot map {path:?}: {e}"))?;
        Ok(Beton { index, map })
    }

    /// The file's index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Samples in the file.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the file has no samples.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The bytes of a payload.
    pub fn payload(&self, e: Extent) -> &[u8] {
        if e.size == 0 {
            return &[];
        }
        &self.map[e.ptr as usize..(e.ptr + e.size) as usize]
    }

    /// Sample `s`'s value of field `f`.
    pub fn value(&self, s: usize, f: usize) -> Result<Value<'_>, String> {
        self.check(s, f)?;
        let payload = self
            .index
            .extent(s, f)
            .map(|e| self.payload(e))
            .unwrap_or(&[]);
        Ok(self.index.value_with(s, f, payload))
    }

    /// The file and its first `samples` samples as one JSON object, the
    /// form `braid data inspect --json` prints: `{"num_samples",
    /// "page_size", "fields": {name: type}, "samples": [{field: value}]}`.
    pub fn to_json(&self, samples: usize) -> Result<Json, String> {
        let idx = &self.index;
        let fields: serde_json::Map<String, Json> = idx
            .fields
            .iter()
            .map(|f| (f.name.clone(), Json::from(f.ty.name())))
            .collect();
        let rows = (0..samples.min(self.len()))
            .map(|s| {
                let mut row = serde_json::Map::new();
                for (f, field) in idx.fields.iter().enumerate() {
                    let v = self.value(s, f)?.to_json().map_err(|e| {
                        format!("{}: sample {s}, field '{}': {e}", idx.path, field.name)
                    })?;
                    row.insert(field.name.clone(), v);
                }
                Ok(Json::Object(row))
            })
            .collect::<Result<Vec<Json>, String>>()?;
        Ok(serde_json::json!({
            "num_samples": self.len(),
            "page_size": idx.page_size(),
            "fields": fields,
            "samples": rows,
        }))
    }

    fn check(&self, s: usize, f: usize) -> Result<(), String> {
        if s >= self.len() || f >= self.index.fields.len() {
            return Err(format!(
                "{}: sample {s}, field {f} asked for; it has {} samples and {} fields",
                self.index.path,
                self.len(),
                self.index.fields.len()
            ));
        }
        Ok(())
    }
}

impl Index {
    /// Sample `s`'s value of field `f`, given its payload's bytes (from a
    /// mapping or a page read into memory). `s` and `f` in bounds.
    pub fn value_with<'a>(&'a self, s: usize, f: usize, payload: &'a [u8]) -> Value<'a> {
        let m = self.meta(s, f);
        match &self.fields[f].ty {
            FieldType::Int => Value::Int(u64_at(m, 0) as i64),
            FieldType::Float => Value::Float(f64::from_bits(u64_at(m, 0))),
            FieldType::Bytes => Value::Bytes(payload),
            FieldType::Json => {
                let end = payload
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(payload.len());
                Value::Json(&payload[..end])
            }
            FieldType::NdArray { dtype, shape } | FieldType::TorchTensor { dtype, shape } => {
                Value::Array {
                    dtype: *dtype,
                    shape,
                    data: payload,
                }
            }
            FieldType::Tokens { dtype, .. } => Value::Tokens {
                dtype: *dtype,
                data: payload,
            },
            FieldType::RgbImage => Value::Image(Image {
                mode: if m[0] == 0 {
                    ImageMode::Jpeg
                } else {
                    ImageMode::Raw
                },
                width: u16_at(m, 1),
                height: u16_at(m, 3),
                data: payload,
            }),
        }
    }
}

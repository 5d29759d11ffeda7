//! Writing a `.beton` file exactly as FFCV's `DatasetWriter` lays it out
//! with one worker: samples in order, each sample's payloads on one page
//! (a sample that does not fit in what is left of a page starts again on
//! a fresh one, leaving the bytes it had written behind, as FFCV does),
//! whole pages written, the allocation table after the last page, the
//! header last. Given the same values, braid and FFCV write the same
//! bytes.
//!
//! The file appears atomically: it is written under a temporary name in
//! the same directory, synced, and renamed over the target by
//! [`Writer::finish`]; a writer dropped before that removes it.

use std::borrow::Cow;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::field::{check_name, struct_layout, FieldType};
use super::index::ImageMode;
use super::layout::{
    align_to_page, metadata_start, Allocation, Header, FIELD_DESC_SIZE, MAX_PAGE_SIZE,
    MIN_PAGE_SIZE, NAME_SIZE, VERSION,
};

/// A value to write into a field.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    /// For an int field.
    Int(i64),
    /// For a float field.
    Float(f64),
    /// For a bytes field.
    Bytes(Vec<u8>),
    /// For a JSON field: JSON text (FFCV's writer stores
    /// `json.dumps(value)`; any JSON text reads back as the same value).
    Json(String),
    /// For an array field: its little-endian elements, row-major.
    Array(Vec<u8>),
    /// For an image field: an already encoded image.
    Image {
        /// JPEG or raw.
        mode: ImageMode,
        /// Pixels across.
        width: u16,
        /// Pixels down.
        height: u16,
        /// JPEG bytes, or height × width × 3 RGB bytes.
        data: Vec<u8>,
    },
    /// For a token field.
    Tokens(Vec<u32>),
}

/// What a finished file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Samples.
    pub samples: u64,
    /// Pages of the data region.
    pub pages: u64,
    /// Bytes of the file.
    pub bytes: u64,
}

/// A `.beton` file being written.
pub struct Writer {
    target: PathBuf,
    temp: PathBuf,
    file: Option<File>,
    types: Vec<FieldType>,
    names: Vec<String>,
    offsets: Vec<usize>,
    stride: usize,
    page_size: u64,
    num_samples: u64,
    next: u64,
    meta: Vec<u8>,
    data_start: u64,
    page: Vec<u8>,
    /// The page being filled (-1: none yet).
    my_page: i64,
    page_offset: u64,
    allocations: Vec<Allocation>,
}

impl Writer {
    /// Starts `path` with `fields` (name, type), `num_samples` samples and
    /// pages of `page_size` bytes (a power of two, 4 KiB to 2 GiB; FFCV's
    /// own writer insists on at least 2 MiB).
    pub fn create(
        path: &Path,
        fields: &[(String, FieldType)],
        num_samples: u64,
        page_size: u64,
    ) -> Result<Writer, String> {
        if fields.is_empty() || fields.len() > u16::MAX as usize {
            return Err(format!(
                "a .beton file needs 1 to {} fields, not {}",
                u16::MAX,
                fields.len()
            ));
        }
        if !page_size.is_power_of_two() || !(MIN_PAGE_SIZE..MAX_PAGE_SIZE).contains(&page_size) {
            return Err(format!(
                "page size {page_size}: use a power of two from {MIN_PAGE_SIZE} to {} (FFCV's default is 8 MiB)",
                MAX_PAGE_SIZE / 2
            ));
        }
        for (i, (name, ty)) in fields.iter().enumerate() {
            check_name(name)?;
            ty.validate().map_err(|e| format!("field '{name}': {e}"))?;
            if fields[..i].iter().any(|(n, _)| n == name) {
                return Err(format!("two fields are named '{name}'"));
            }
        }
        let types: Vec<FieldType> = fields.iter().map(|f| f.1.clone()).collect();
        let (offsets, stride) = struct_layout(&types);
        let meta_len = num_samples
            .checked_mul(stride as u64)
            .filter(|&l| l < 1 << 46)
            .ok_or_else(|| format!("{num_samples} samples are too many for one file"))?;
        let meta_end = metadata_start(fields.len()) + meta_len;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = path
            .file_name()
            .ok_or_else(|| format!("{}: not a file name", path.display()))?
            .to_string_lossy()
            .to_string();
        // Unique per writer, so two writers of one process never share it.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = dir.join(format!(".{file_name}.tmp-{}-{n}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)
            .map_err(|e| format!("cannot create {}: {e}", temp.display()))?;
        let mut w = Writer {
            target: path.to_path_buf(),
            temp,
            file: Some(file),
            types,
            names: fields.iter().map(|f| f.0.clone()).collect(),
            offsets,
            stride,
            page_size,
            num_samples,
            next: 0,
            meta: Vec::new(),
            data_start: align_to_page(meta_end, page_size),
            page: Vec::new(),
            my_page: -1,
            page_offset: 0,
            allocations: Vec::new(),
        };
        w.meta = vec![0u8; meta_len as usize];
        w.write_head(0)?;
        Ok(w)
    }

    /// The header (with the allocation table at `alloc_table_ptr`) and the
    /// field table.
    fn write_head(&mut self, alloc_table_ptr: u64) -> Result<(), String> {
        let header = Header {
            version: VERSION,
            num_fields: self.types.len() as u16,
            page_size: self.page_size as u32,
            num_samples: self.num_samples,
            alloc_table_ptr,
        };
        let mut head = header.encode().to_vec();
        for (name, ty) in self.names.iter().zip(&self.types) {
            let mut d = vec![0u8; FIELD_DESC_SIZE];
            d[0] = ty.type_id();
            d[1..1 + name.len()].copy_from_slice(name.as_bytes());
            d[1 + NAME_SIZE..].copy_from_slice(&ty.encode_args());
            head.extend_from_slice(&d);
        }
        self.write_at(&head, 0)
    }

    fn write_at(&self, bytes: &[u8], at: u64) -> Result<(), String> {
        self.file
            .as_ref()
            .expect("open until finished")
            .write_all_at(bytes, at)
            .map_err(|e| format!("writing {}: {e}", self.temp.display()))
    }

    /// Appends the next sample: one value per field, in field order.
    pub fn push(&mut self, values: &[FieldValue]) -> Result<(), String> {
        let s = self.next;
        if s == self.num_samples {
            return Err(format!(
                "{}: all {} samples are written already",
                self.target.display(),
                self.num_samples
            ));
        }
        if values.len() != self.types.len() {
            return Err(format!(
                "sample {s} has {} values for {} fields",
                values.len(),
                self.types.len()
            ));
        }
        let payloads: Vec<Option<Cow<[u8]>>> = values
            .iter()
            .enumerate()
            .map(|(f, v)| self.encode(s, f, v))
            .collect::<Result<_, _>>()?;
        for attempt in 0..2 {
            let mark = self.allocations.len();
            let mut restarted = false;
            for (f, payload) in payloads.iter().enumerate() {
                let meta_at = s as usize * self.stride + self.offsets[f];
                let Some(bytes) = payload else {
                    let v = match &values[f] {
                        FieldValue::Int(v) => *v as u64,
                        FieldValue::Float(v) => v.to_bits(),
                        _ => unreachable!("scalar fields have no payload"),
                    };
                    self.meta[meta_at..meta_at + 8].copy_from_slice(&v.to_le_bytes());
                    continue;
                };
                let Some(ptr) = self.malloc(s, bytes.len() as u64, mark)? else {
                    restarted = true;
                    break;
                };
                let at = (ptr - self.page_base()) as usize;
                if !bytes.is_empty() {
                    self.page[at..at + bytes.len()].copy_from_slice(bytes);
                }
                let m = &mut self.meta[meta_at..];
                match &values[f] {
                    FieldValue::Image {
                        mode,
                        width,
                        height,
                        ..
                    } => {
                        m[0] = mode.code();
                        m[1..3].copy_from_slice(&width.to_le_bytes());
                        m[3..5].copy_from_slice(&height.to_le_bytes());
                        m[5..13].copy_from_slice(&ptr.to_le_bytes());
                    }
                    FieldValue::Bytes(_) | FieldValue::Json(_) => {
                        m[0..8].copy_from_slice(&ptr.to_le_bytes());
                        m[8..16].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
                    }
                    _ => m[0..8].copy_from_slice(&ptr.to_le_bytes()),
                }
            }
            if !restarted {
                self.next += 1;
                return Ok(());
            }
            if attempt == 1 {
                let need: usize = payloads.iter().flatten().map(|p| p.len()).sum();
                return Err(format!(
                    "sample {s} needs {need} bytes, more than one page of {} bytes holds: use a larger page size",
                    self.page_size
                ));
            }
        }
        unreachable!("the second attempt returns")
    }

    /// The payload bytes of value `v` for field `f` (`None`: a scalar),
    /// borrowed where the value already holds them.
    fn encode<'v>(
        &self,
        s: u64,
        f: usize,
        v: &'v FieldValue,
    ) -> Result<Option<Cow<'v, [u8]>>, String> {
        let ty = &self.types[f];
        let wrong = || {
            format!(
                "sample {s}, field '{}' ({}): got a value of another type",
                self.names[f],
                ty.name()
            )
        };
        let p = match (ty, v) {
            (FieldType::Int, FieldValue::Int(_)) | (FieldType::Float, FieldValue::Float(_)) => {
                return Ok(None)
            }
            (FieldType::Bytes, FieldValue::Bytes(b)) => Cow::Borrowed(b.as_slice()),
            (FieldType::Json, FieldValue::Json(text)) => {
                serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| {
                    format!("sample {s}, field '{}': not JSON ({e})", self.names[f])
                })?;
                if text.contains('\0') {
                    return Err(format!(
                        "sample {s}, field '{}': JSON text with a NUL byte",
                        self.names[f]
                    ));
                }
                let mut b = text.as_bytes().to_vec();
                b.push(0);
                Cow::Owned(b)
            }
            (FieldType::NdArray { .. } | FieldType::TorchTensor { .. }, FieldValue::Array(b)) => {
                let want = ty.array_bytes().expect("array");
                if b.len() as u64 != want {
                    return Err(format!(
                        "sample {s}, field '{}' ({}): {} bytes given, {want} expected",
                        self.names[f],
                        ty.name(),
                        b.len()
                    ));
                }
                Cow::Borrowed(b.as_slice())
            }
            (FieldType::Tokens { dtype, window, .. }, FieldValue::Tokens(t)) => {
                if t.len() as u64 != *window {
                    return Err(format!(
                        "sample {s}, field '{}': {} tokens given, the window holds {window}",
                        self.names[f],
                        t.len()
                    ));
                }
                if dtype.size() == 2 {
                    if let Some(big) = t.iter().find(|&&x| x > u16::MAX as u32) {
                        return Err(format!(
                            "sample {s}, field '{}': token {big} does not fit a u16 field (write it with u32 tokens)",
                            self.names[f]
                        ));
                    }
                    Cow::Owned(t.iter().flat_map(|&x| (x as u16).to_le_bytes()).collect())
                } else {
                    Cow::Owned(t.iter().flat_map(|&x| x.to_le_bytes()).collect())
                }
            }
            (
                FieldType::RgbImage,
                FieldValue::Image {
                    mode,
                    width,
                    height,
                    data,
                },
            ) => {
                let raw = *width as usize * *height as usize * 3;
                let ok = *width > 0
                    && *height > 0
                    && match mode {
                        ImageMode::Raw => data.len() == raw,
                        ImageMode::Jpeg => !data.is_empty(),
                    };
                if !ok {
                    return Err(format!(
                        "sample {s}, field '{}': a {width}x{height} {} image with {} bytes",
                        self.names[f],
                        mode.name(),
                        data.len()
                    ));
                }
                Cow::Borrowed(data.as_slice())
            }
            _ => return Err(wrong()),
        };
        if p.len() as u64 > self.page_size {
            return Err(format!(
                "sample {s}, field '{}': {} bytes do not fit in a page of {} bytes: use a larger page size",
                self.names[f],
                p.len(),
                self.page_size
            ));
        }
        Ok(Some(p))
    }

    fn page_base(&self) -> u64 {
        (self.data_start as i64 + self.my_page * self.page_size as i64) as u64
    }

    /// FFCV's `MemoryAllocator.malloc`: room for `size` bytes of sample
    /// `s` (whose allocations since `mark` are on the current page).
    /// `None`: the sample had to move to a fresh page; start it again.
    fn malloc(&mut self, s: u64, size: u64, mark: usize) -> Result<Option<u64>, String> {
        let left = if self.my_page < 0 {
            0
        } else {
            self.page_size - self.page_offset
        };
        if size > left {
            self.flush_page()?;
            self.my_page += 1;
            self.page_offset = 0;
            if self.page.is_empty() {
                self.page = vec![0u8; self.page_size as usize];
            } else {
                self.page.fill(0);
            }
            if self.allocations.len() > mark {
                self.allocations.truncate(mark);
                return Ok(None);
            }
        }
        let ptr = self.page_base() + self.page_offset;
        self.page_offset += size;
        self.allocations.push(Allocation {
            sample_id: s,
            ptr,
            size,
        });
        Ok(Some(ptr))
    }

    fn flush_page(&mut self) -> Result<(), String> {
        if self.my_page < 0 {
            return Ok(());
        }
        self.write_at(&self.page, self.page_base())
    }

    /// Samples written so far.
    pub fn written(&self) -> u64 {
        self.next
    }

    /// Writes the last page, the metadata, the allocation table and the
    /// header; syncs; renames the file into place.
    pub fn finish(mut self) -> Result<Written, String> {
        if self.next != self.num_samples {
            return Err(format!(
                "{}: {} of {} samples written",
                self.target.display(),
                self.next,
                self.num_samples
            ));
        }
        self.flush_page()?;
        let pages = (self.my_page + 1) as u64;
        self.write_at(&self.meta, metadata_start(self.types.len()))?;
        let end = if pages > 0 {
            self.data_start + pages * self.page_size
        } else {
            metadata_start(self.types.len()) + self.meta.len() as u64
        };
        let table: Vec<u8> = self.allocations.iter().flat_map(|a| a.encode()).collect();
        self.write_at(&table, end)?;
        self.write_head(end)?;
        let file = self.file.take().expect("open until finished");
        file.sync_all()
            .map_err(|e| format!("syncing {}: {e}", self.temp.display()))?;
        drop(file);
        std::fs::rename(&self.temp, &self.target).map_err(|e| {
            format!(
                "renaming {} to {}: {e}",
                self.temp.display(),
                self.target.display()
            )
        })?;
        if let Some(dir) = self.target.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The rename is durable once the directory is synced.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(Written {
            samples: self.num_samples,
            pages,
            bytes: end + table.len() as u64,
        })
    }
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("target", &self.target)
            .field("written", &self.next)
            .field("samples", &self.num_samples)
            .finish()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

//! Opening a `.beton` file: its header, field table, per-sample metadata
//! and allocation table, read into memory and checked before anything is
//! trusted. Every size the file states is checked against the file's
//! length before a buffer is allocated for it, and every payload pointer
//! a sample holds must be an allocation of that sample inside one page of
//! the data region, so that readers and loaders can index without
//! further checks. Errors name the file offset and what was expected.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::field::{check_name, struct_layout, FieldType};
use super::layout::{
    align_to_page, metadata_start, u16_at, u64_at, Allocation, Header, ALLOC_ENTRY_SIZE, ARGS_SIZE,
    FIELD_DESC_SIZE, HEADER_SIZE, MAX_PAGE_SIZE, MIN_PAGE_SIZE, NAME_SIZE, VERSION,
};

/// One field of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// Its name.
    pub name: String,
    /// What it holds.
    pub ty: FieldType,
    /// Its offset in each sample's metadata.
    pub(crate) offset: usize,
    /// Its slot among the fields with payloads (`usize::MAX`: none).
    pub(crate) slot: usize,
}

/// Where one payload lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Its first byte in the file.
    pub ptr: u64,
    /// Its length.
    pub size: u64,
}

/// How an image is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageMode {
    /// JPEG bytes (FFCV's mode 0).
    Jpeg,
    /// Height × width × 3 RGB bytes (mode 1).
    Raw,
}

impl ImageMode {
    /// The mode byte in the metadata.
    pub fn code(self) -> u8 {
        match self {
            ImageMode::Jpeg => 0,
            ImageMode::Raw => 1,
        }
    }

    /// The name `braid data inspect --json` gives it.
    pub fn name(self) -> &'static str {
        match self {
            ImageMode::Jpeg => "jpg",
            ImageMode::Raw => "raw",
        }
    }
}

/// A file's index: everything but the payloads.
#[derive(Debug)]
pub struct Index {
    /// The file (for messages).
    pub path: String,
    /// Its header.
    pub header: Header,
    /// Its fields, in file order.
    pub fields: Vec<Field>,
    /// Its length in bytes.
    pub file_len: u64,
    /// Where the data region starts (the first page after the metadata).
    pub data_start: u64,
    /// The allocation table, in file order.
    pub allocations: Vec<Allocation>,
    meta: Vec<u8>,
    stride: usize,
    payload_fields: usize,
    /// Each sample's payloads, `payload_fields` per sample.
    extents: Vec<Extent>,
}

/// Reads (offset, length, what it is) of the file, bounds-checked.
type ReadAt<'a> = dyn Fn(u64, u64, &str) -> Result<Vec<u8>, String> + 'a;

/// A format error: the file, the offset and what was wrong there.
pub(crate) fn bad(path: &str, offset: u64, what: impl std::fmt::Display) -> String {
    format!("{path}: not a valid .beton file: at byte {offset}: {what}")
}

impl Index {
    /// Opens and checks `path`.
    pub fn open(path: &Path) -> Result<(Index, File), String> {
        let file = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let file_len = file
            .metadata()
            .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
            .len();
        let name = path.display().to_string();
        let read = |offset: u64, len: u64, what: &str| -> Result<Vec<u8>, String> {
            if offset.checked_add(len).is_none_or(|end| end > file_len) {
                return Err(bad(
                    &name,
                    offset,
                    format!(
                        "the file ends at byte {file_len}, before the {len} bytes of its {what}"
                    ),
                ));
            }
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, offset)
                .map_err(|e| format!("{name}: reading its {what} at byte {offset}: {e}"))?;
            Ok(buf)
        };
        let head: [u8; HEADER_SIZE] = read(0, HEADER_SIZE as u64, "header")?
            .try_into()
            .expect("header bytes");
        let header = Header::decode(&head);
        let fields_len = header.num_fields as u64 * FIELD_DESC_SIZE as u64;
        let fields_bytes = read(HEADER_SIZE as u64, fields_len, "field table").map_err(|e| {
            // A foreign file most often fails here or at the version.
            if header.version != VERSION {
                version_error(&name, header.version)
            } else {
                e
            }
        })?;
        let index = Index::parse(&name, header, &fields_bytes, file_len, &|o, l, w| {
            read(o, l, w)
        })?;
        Ok((index, file))
    }

    /// Checks the header and parses the rest through `read` (offset,
    /// length, what): the field table is `fields_bytes`.
    fn parse(
        name: &str,
        header: Header,
        fields_bytes: &[u8],
        file_len: u64,
        read: &ReadAt,
    ) -> Result<Index, String> {
        if header.version != VERSION {
            return Err(version_error(name, header.version));
        }
        if header.num_fields == 0 {
            return Err(bad(name, 2, "the header says the file has no fields"));
        }
        let page = header.page_size as u64;
        if !page.is_power_of_two() || !(MIN_PAGE_SIZE..MAX_PAGE_SIZE).contains(&page) {
            return Err(bad(
                name,
                4,
                format!(
                    "page size {page}: expected a power of two from {MIN_PAGE_SIZE} to {}",
                    MAX_PAGE_SIZE / 2
                ),
            ));
        }
        let fields = parse_fields(name, fields_bytes)?;
        let types: Vec<FieldType> = fields.iter().map(|f| f.ty.clone()).collect();
        let (offsets, stride) = struct_layout(&types);
        let mut payload_fields = 0;
        let fields: Vec<Field> = fields
            .into_iter()
            .zip(offsets)
            .map(|(mut f, o)| {
                f.offset = o;
                if f.ty.has_payload() {
                    f.slot = payload_fields;
                    payload_fields += 1;
                }
                f
            })
            .collect();

        let meta_start = metadata_start(fields.len());
        let n = header.num_samples;
        let meta_len = n
            .checked_mul(stride as u64)
            .filter(|&l| l <= file_len)
            .ok_or_else(|| {
                bad(
                    name,
                    8,
                    format!(
                        "{n} samples of {stride} metadata bytes cannot fit in a file of {file_len} bytes"
                    ),
                )
            })?;
        let meta_end = meta_start + meta_len;
        let at = header.alloc_table_ptr;
        if at < meta_end || at > file_len {
            return Err(bad(
                name,
                16,
                format!(
                    "the allocation table is said to start at byte {at}; expected a byte from {meta_end} (the end of the metadata) to {file_len} (the end of the file)"
                ),
            ));
        }
        if (file_len - at) % ALLOC_ENTRY_SIZE as u64 != 0 {
            return Err(bad(
                name,
                at,
                format!(
                    "the allocation table runs from byte {at} to the end of the file ({file_len}), {} bytes, not a multiple of its {ALLOC_ENTRY_SIZE}-byte entries (a truncated file?)",
                    file_len - at
                ),
            ));
        }
        let meta = read(meta_start, meta_len, "metadata")?;
        let table = read(at, file_len - at, "allocation table")?;
        let allocations: Vec<Allocation> = table
            .chunks_exact(ALLOC_ENTRY_SIZE)
            .map(Allocation::decode)
            .collect();
        let data_start = align_to_page(meta_end, page);
        let mut index = Index {
            path: name.to_string(),
            header,
            fields,
            file_len,
            data_start,
            allocations,
            meta,
            stride,
            payload_fields,
            extents: Vec::new(),
        };
        index.check_allocations()?;
        index.resolve_payloads()?;
        Ok(index)
    }

    /// Every allocation names a sample of the file and lies inside one
    /// page of the data region.
    fn check_allocations(&self) -> Result<(), String> {
        let page = self.page_size();
        let at = self.header.alloc_table_ptr;
        for (i, a) in self.allocations.iter().enumerate() {
            let offset = at + (i * ALLOC_ENTRY_SIZE) as u64;
            if a.sample_id >= self.header.num_samples {
                return Err(bad(
                    &self.path,
                    offset,
                    format!(
                        "allocation {i} belongs to sample {}, but the file has {} samples",
                        a.sample_id, self.header.num_samples
                    ),
                ));
            }
            if a.size == 0 {
                continue;
            }
            let end = a.ptr.checked_add(a.size);
            let inside = a.ptr >= self.data_start && end.is_some_and(|e| e <= at);
            if !inside {
                return Err(bad(
                    &self.path,
                    offset,
                    format!(
                        "allocation {i} ({} bytes at byte {}) lies outside the data region (bytes {} to {at})",
                        a.size, a.ptr, self.data_start
                    ),
                ));
            }
            if a.ptr / page != (a.ptr + a.size - 1) / page {
                return Err(bad(
                    &self.path,
                    offset,
                    format!(
                        "allocation {i} ({} bytes at byte {}) crosses a page boundary (pages of {page} bytes)",
                        a.size, a.ptr
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Finds every sample's payloads in the allocation table.
    fn resolve_payloads(&mut self) -> Result<(), String> {
        let mut by_ptr: Vec<(u64, u64, u64)> = self
            .allocations
            .iter()
            .map(|a| (a.ptr, a.sample_id, a.size))
            .collect();
        by_ptr.sort_unstable();
        let n = self.header.num_samples as usize;
        let mut extents = Vec::with_capacity(n * self.payload_fields);
        let meta_start = metadata_start(self.fields.len());
        for s in 0..n {
            for f in self.fields.iter().filter(|f| f.ty.has_payload()) {
                let m = &self.meta[s * self.stride + f.offset..];
                let m_offset = meta_start + (s * self.stride + f.offset) as u64;
                let here = |what: String| {
                    bad(
                        &self.path,
                        m_offset,
                        format!("sample {s}, field '{}': {what}", f.name),
                    )
                };
                let ptr = match f.ty {
                    FieldType::RgbImage => u64_at(m, 5),
                    _ => u64_at(m, 0),
                };
                let lo = by_ptr.partition_point(|e| e.0 < ptr);
                let hits = by_ptr[lo..].iter().take_while(|e| e.0 == ptr);
                // An empty payload shares its pointer with the next one, so
                // a pointer may have two allocations of one sample: take the
                // size the metadata expects, else the larger.
                let expected = match &f.ty {
                    FieldType::Bytes | FieldType::Json => Some(u64_at(m, 8)),
                    FieldType::RgbImage if m[0] == 1 => {
                        Some(u16_at(m, 1) as u64 * u16_at(m, 3) as u64 * 3)
                    }
                    FieldType::RgbImage => None,
                    t => t.array_bytes(),
                };
                let mine = hits.clone().filter(|e| e.1 == s as u64);
                let found = mine
                    .clone()
                    .find(|e| Some(e.2) == expected)
                    .or_else(|| mine.max_by_key(|e| e.2));
                let Some(&(_, _, size)) = found else {
                    return Err(match hits.clone().next() {
                        Some(e) => here(format!(
                            "its payload at byte {ptr} belongs to sample {} in the allocation table",
                            e.1
                        )),
                        None => here(format!(
                            "its payload pointer {ptr} is not in the allocation table"
                        )),
                    });
                };
                match &f.ty {
                    FieldType::Bytes | FieldType::Json => {
                        let said = u64_at(m, 8);
                        if said != size {
                            return Err(here(format!(
                                "the metadata says {said} bytes, the allocation table {size}"
                            )));
                        }
                        if f.ty == FieldType::Json && size == 0 {
                            return Err(here(
                                "an empty JSON payload (expected text and a NUL)".into(),
                            ));
                        }
                    }
                    FieldType::RgbImage => {
                        let (mode, w, h) = (m[0], u16_at(m, 1) as u64, u16_at(m, 3) as u64);
                        match mode {
                            0 if size == 0 => return Err(here("an empty JPEG payload".into())),
                            0 => {}
                            1 if size != w * h * 3 => {
                                return Err(here(format!(
                                    "a raw {w}x{h} image needs {} bytes, its payload has {size}",
                                    w * h * 3
                                )))
                            }
                            1 => {}
                            other => {
                                return Err(here(format!(
                                    "image mode {other}; expected 0 (jpg) or 1 (raw)"
                                )))
                            }
                        }
                        if w == 0 || h == 0 {
                            return Err(here(format!("an image of {w}x{h} pixels")));
                        }
                    }
                    t => {
                        let want = t.array_bytes().expect("array field");
                        if size != want {
                            return Err(here(format!(
                                "an array of {} needs {want} bytes, its payload has {size}",
                                t.name()
                            )));
                        }
                    }
                }
                extents.push(Extent { ptr, size });
            }
        }
        self.extents = extents;
        Ok(())
    }

    /// Samples in the file.
    pub fn len(&self) -> usize {
        self.header.num_samples as usize
    }

    /// Whether the file has no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.header.page_size as u64
    }

    /// Pages in the data region.
    pub fn pages(&self) -> u64 {
        self.header
            .alloc_table_ptr
            .saturating_sub(self.data_start)
            .div_ceil(self.page_size())
    }

    /// The field called `name`.
    pub fn field(&self, name: &str) -> Result<usize, String> {
        self.fields
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
                format!(
                    "{} has no field '{name}'; its fields: {}",
                    self.path,
                    names.join(", ")
                )
            })
    }

    /// Sample `s`'s metadata for field `f` (in bounds by the caller).
    pub(crate) fn meta(&self, s: usize, f: usize) -> &[u8] {
        let at = s * self.stride + self.fields[f].offset;
        &self.meta[at..at + self.fields[f].ty.meta_layout().size]
    }

    /// Where sample `s`'s payload of field `f` lies (`None`: a scalar
    /// field).
    pub fn extent(&self, s: usize, f: usize) -> Option<Extent> {
        let slot = self.fields[f].slot;
        (slot != usize::MAX).then(|| self.extents[s * self.payload_fields + slot])
    }

    /// The pages sample `s`'s payloads lie on (FFCV keeps them on one).
    pub fn pages_of(&self, s: usize) -> impl Iterator<Item = u64> + '_ {
        let k = self.payload_fields;
        self.extents[s * k..(s + 1) * k]
            .iter()
            .filter(|e| e.size > 0)
            .map(|e| e.ptr / self.page_size())
    }
}

fn version_error(name: &str, version: u16) -> String {
    bad(
        name,
        0,
        format!(
            "format version {version}; expected {VERSION} (FFCV 1.0's .beton; is this a .beton file?)"
        ),
    )
}

fn parse_fields(name: &str, bytes: &[u8]) -> Result<Vec<Field>, String> {
    let mut fields: Vec<Field> = Vec::new();
    for (i, d) in bytes.chunks_exact(FIELD_DESC_SIZE).enumerate() {
        let at = (HEADER_SIZE + i * FIELD_DESC_SIZE) as u64;
        let raw = &d[1..1 + NAME_SIZE];
        let end = raw.iter().position(|&b| b == 0).unwrap_or(NAME_SIZE);
        let field_name = std::str::from_utf8(&raw[..end])
            .ok()
            .filter(|n| check_name(n).is_ok())
            .ok_or_else(|| {
                bad(
                    name,
                    at + 1,
                    format!("field {i} has no ASCII name ({:?})", &raw[..end]),
                )
            })?
            .to_string();
        if fields.iter().any(|f| f.name == field_name) {
            return Err(bad(
                name,
                at + 1,
                format!("two fields are named '{field_name}'"),
            ));
        }
        let ty = FieldType::decode(d[0], &d[1 + NAME_SIZE..1 + NAME_SIZE + ARGS_SIZE])
            .map_err(|e| bad(name, at, format!("field '{field_name}': {e}")))?;
        fields.push(Field {
            name: field_name,
            ty,
            offset: 0,
            slot: usize::MAX,
        });
    }
    Ok(fields)
}

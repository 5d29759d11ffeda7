//! The files of a sharded checkpoint: safetensors written piece by piece
//! with a CRC-32 of every tensor in the header metadata, headers read
//! without trusting any length, and the names that tie pieces to tensors.
//!
//! A *piece* is a run of elements of one named tensor. A whole tensor is
//! stored under its own name and shape (so a data-parallel checkpoint's
//! weight files are ordinary Hugging Face shards); part of one, as a ZeRO
//! rank holds it, is stored flat under `name[start:end]` (element offsets
//! inside the tensor). A tensor-parallel rank holds slices of one
//! dimension of a tensor (its [`Place`]); its pieces are runs of that
//! local tensor, stored under `name@DIM:START+LEN,...[start:end]` — the
//! cut written into the key, so that any reader finds where each element
//! sits in the whole tensor.

use crate::Result;
use braid_model::place::Place;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::Path;

/// Metadata key prefix of a tensor's checksum (`braid.crc32.<key>`: the
/// CRC-32 of its stored bytes, 8 hex digits).
pub const CRC_PREFIX: &str = "braid.crc32.";

/// Largest safetensors header braid reads (the format's own limit).
const MAX_HEADER: u64 = 100 << 20;

/// A cut of a tensor: the dimension and the slices of it a rank holds
/// (see [`Place`]); the whole tensor's shape comes from the manifest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cut {
    /// The dimension cut.
    pub dim: usize,
    /// Its slices held, in the local tensor's order: (first, length).
    pub slices: Vec<(usize, usize)>,
}

impl Cut {
    /// The cut of `place` (`None`: whole).
    pub fn of(place: &Place) -> Option<Cut> {
        (!place.is_whole()).then(|| Cut {
            dim: place.dim,
            slices: place.slices.clone(),
        })
    }

    /// The place it makes in a tensor of the whole `shape`, checked.
    pub fn place(&self, shape: &[usize]) -> Result<Place> {
        let p = Place {
            full: shape.to_vec(),
            dim: self.dim,
            slices: self.slices.clone(),
        };
        p.check()?;
        Ok(p)
    }
}

/// One stored run of a tensor's elements.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PieceName {
    /// The tensor.
    pub tensor: String,
    /// Its elements stored here (offsets inside the tensor as the writer
    /// held it: the whole tensor, or its cut).
    pub start: usize,
    /// One past the last.
    pub end: usize,
    /// The writer's cut of the tensor (tensor parallelism); none: whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
}

impl PieceName {
    /// The key it is stored under: the tensor's name when whole
    /// (`numel` elements, no cut), else `name[start:end]`, or with a cut
    /// `name@DIM:FIRST+LEN,...[start:end]`.
    pub fn key(&self, numel: usize) -> String {
        let (s, e) = (self.start, self.end);
        match &self.cut {
            None if s == 0 && e == numel => self.tensor.clone(),
            None => format!("{}[{s}:{e}]", self.tensor),
            Some(c) => {
                let slices: Vec<String> =
                    c.slices.iter().map(|(a, l)| format!("{a}+{l}")).collect();
                format!("{}@{}:{}[{s}:{e}]", self.tensor, c.dim, slices.join(","))
            }
        }
    }

    /// The piece a key names (a bare name: the whole tensor of `numel`
    /// elements, looked up by the caller).
    pub fn parse(key: &str, numel_of: impl Fn(&str) -> Option<usize>) -> Result<PieceName> {
        let bad = |what: &str| format!("tensor key {key:?}: {what}");
        if let Some(open) = key.rfind('[') {
            if let Some(body) = key[open + 1..].strip_suffix(']') {
                let (a, b) = body
                    .split_once(':')
                    .ok_or_else(|| bad("expected name[start:end]"))?;
                let (start, end) = match (a.parse::<usize>(), b.parse::<usize>()) {
                    (Ok(start), Ok(end)) if start < end => (start, end),
                    _ => return Err(bad("bad element range")),
                };
                let name = &key[..open];
                let (tensor, cut) = match name.split_once('@') {
                    None => (name, None),
                    Some((tensor, cut)) => {
                        (tensor, Some(parse_cut(cut).ok_or_else(|| bad("bad cut"))?))
                    }
                };
                return Ok(PieceName {
                    tensor: tensor.to_string(),
                    start,
                    end,
                    cut,
                });
            }
        }
        let numel = numel_of(key).ok_or_else(|| format!("tensor {key:?} is not in the model"))?;
        Ok(PieceName {
            tensor: key.to_string(),
            start: 0,
            end: numel,
            cut: None,
        })
    }
}

/// `DIM:FIRST+LEN,...` of a piece key.
fn parse_cut(s: &str) -> Option<Cut> {
    let (dim, slices) = s.split_once(':')?;
    let slices = slices
        .split(',')
        .map(|p| {
            let (a, l) = p.split_once('+')?;
            Some((a.parse().ok()?, l.parse().ok()?))
        })
        .collect::<Option<Vec<(usize, usize)>>>()?;
    Some(Cut {
        dim: dim.parse().ok()?,
        slices,
    })
}

/// A tensor to write: its key, shape and f32 values.
pub struct Entry<'a> {
    /// Stored under this name.
    pub key: String,
    /// Its shape (the element count is the values').
    pub shape: Vec<usize>,
    /// Its values.
    pub values: &'a [f32],
}

/// The CRC-32 of `values`' little-endian bytes.
pub fn crc_of(values: &[f32]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(le_bytes(values));
    h.finalize()
}

/// `values` as little-endian bytes (the machines braid runs on are
/// little-endian; a big-endian build refuses to compile this).
fn le_bytes(values: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("checkpoints are written as little-endian bytes");
    bytemuck::cast_slice(values)
}

/// Writes `entries` as one f32 safetensors file at `path` (created, or
/// truncated), with `meta` and each tensor's checksum in the header, and
/// flushes it to the disk (`fsync`) before returning.
pub fn write_safetensors(
    path: &Path,
    entries: &[Entry<'_>],
    meta: &[(String, String)],
) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut metadata: BTreeMap<String, String> = meta.iter().cloned().collect();
    let mut at = 0usize;
    for e in entries {
        let numel: usize = e.shape.iter().product();
        if numel != e.values.len() {
            return Err(format!(
                "{}: tensor {}: shape {:?} but {} values",
                path.display(),
                e.key,
                e.shape,
                e.values.len()
            ));
        }
        let bytes = 4 * e.values.len();
        header.insert(
            e.key.clone(),
            serde_json::json!({"dtype": "F32", "shape": e.shape, "data_offsets": [at, at + bytes]}),
        );
        metadata.insert(
            format!("{CRC_PREFIX}{}", e.key),
            format!("{:08x}", crc_of(e.values)),
        );
        at += bytes;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::to_value(metadata).expect("strings"),
    );
    let mut text = serde_json::to_string(&header).expect("json");
    // The data starts at a multiple of 8 bytes.
    while (text.len() + 8) % 8 != 0 {
        text.push(' ');
    }
    let io = |e: std::io::Error| format!("{}: could not be written: {e}", path.display());
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(text.as_bytes()).map_err(io)?;
    for e in entries {
        w.write_all(le_bytes(e.values)).map_err(io)?;
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

/// A stored tensor as its header describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes, from the start of the data section.
    pub bytes: Range<u64>,
    /// Its checksum, if the header carries one.
    pub crc: Option<u32>,
}

/// A safetensors file's header: its f32 tensors and string metadata.
#[derive(Debug, Clone)]
pub struct Header {
    /// The tensors by key.
    pub tensors: BTreeMap<String, Stored>,
    /// The `__metadata__` strings.
    pub metadata: BTreeMap<String, String>,
    /// Where the data section starts in the file.
    pub data_start: u64,
}

/// Reads the header of the safetensors file `path`, checking every
/// tensor's bytes against its shape and the file's length.
pub fn read_header(path: &Path) -> Result<Header> {
    let show = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| format!("{show}: could not be read: {e}"))?;
    let file_len = f
        .metadata()
        .map_err(|e| format!("{show}: could not be read: {e}"))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        format!("{show}: truncated: shorter than a safetensors header ({file_len} bytes)")
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(format!(
            "{show}: corrupt: a header of {n} bytes in a file of {file_len} (truncated or not safetensors)"
        ));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text)
        .map_err(|e| format!("{show}: could not be read: {e}"))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)
        .map_err(|e| format!("{show}: corrupt header (not JSON: {e})"))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (key, v) in json {
        if key == "__metadata__" {
            let m: BTreeMap<String, String> = serde_json::from_value(v)
                .map_err(|e| format!("{show}: corrupt header metadata: {e}"))?;
            metadata = m;
            continue;
        }
        let bad = |why: &str| format!("{show}: tensor {key:?}: {why}");
        let dtype = v.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        if dtype != "F32" {
            return Err(bad(&format!("dtype {dtype:?}, checkpoints store F32")));
        }
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .ok_or_else(|| bad("no shape"))?;
        let offsets: [u64; 2] = v
            .get("data_offsets")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .ok_or_else(|| bad("no data_offsets"))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad("shape overflows"))?;
        if offsets[0] > offsets[1] || offsets[1] - offsets[0] != 4 * numel {
            return Err(bad(&format!(
                "data_offsets {offsets:?} do not hold shape {shape:?} in F32"
            )));
        }
        if offsets[1] > data_len {
            return Err(bad(&format!(
                "its bytes end at {} but the file holds {data_len} after the header (truncated)",
                offsets[1]
            )));
        }
        tensors.insert(
            key,
            Stored {
                shape,
                bytes: offsets[0]..offsets[1],
                crc: None,
            },
        );
    }
    for (key, t) in tensors.iter_mut() {
        if let Some(hex) = metadata.get(&format!("{CRC_PREFIX}{key}")) {
            t.crc = Some(
                u32::from_str_radix(hex, 16)
                    .map_err(|_| format!("{show}: tensor {key:?}: bad checksum {hex:?}"))?,
            );
        }
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

/// Reads tensor `key` of `header` (of the file `path`) and checks it
/// against its checksum.
pub fn read_tensor(path: &Path, header: &Header, key: &str) -> Result<Vec<f32>> {
    let show = path.display();
    let t = header
        .tensors
        .get(key)
        .ok_or_else(|| format!("{show}: tensor {key:?} is missing"))?;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{show}: could not be read: {e}"))?;
    f.seek(SeekFrom::Start(header.data_start + t.bytes.start))
        .map_err(|e| format!("{show}: could not be read: {e}"))?;
    let mut values = vec![0f32; ((t.bytes.end - t.bytes.start) / 4) as usize];
    f.read_exact(bytemuck::cast_slice_mut(&mut values))
        .map_err(|e| format!("{show}: tensor {key:?}: could not be read (truncated?): {e}"))?;
    if let Some(want) = t.crc {
        let got = crc_of(&values);
        if got != want {
            return Err(format!(
                "{show}: tensor {key:?} is corrupt: its checksum is {got:08x}, the header says {want:08x}"
            ));
        }
    }
    Ok(values)
}

/// Flushes the directory `dir` to the disk (so a rename inside it
/// survives a crash).
pub fn sync_dir(dir: &Path) -> Result<()> {
    braid_core::atomic_file::sync_dir(dir)
        .map_err(|e| format!("{}: could not be flushed: {e}", dir.display()))
}

/// Writes `text` to `path` atomically: a temporary file beside it,
/// flushed, then renamed over it ([`braid_core::atomic_file`]).
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    braid_core::atomic_file::write(path, text.as_bytes())
        .map_err(|e| format!("{}: could not be written: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("braid-ckpt-format-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn pieces_round_trip_and_a_flipped_byte_is_named() {
        let d = dir("flip");
        let path = d.join("x.safetensors");
        let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let b = vec![3.0f32, -1.0];
        let entries = [
            Entry {
                key: "w".into(),
                shape: vec![3, 4],
                values: &a,
            },
            Entry {
                key: "bias[2:4]".into(),
                shape: vec![2],
                values: &b,
            },
        ];
        write_safetensors(&path, &entries, &[("k".into(), "v".into())]).unwrap();
        let h = read_header(&path).unwrap();
        assert_eq!(h.metadata["k"], "v");
        assert_eq!(read_tensor(&path, &h, "w").unwrap(), a);
        assert_eq!(read_tensor(&path, &h, "bias[2:4]").unwrap(), b);
        // The file is a safetensors file other readers accept.
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().shape(), &[3, 4]);
        // One flipped bit in the data: named with the tensor.
        let mut bytes = bytes;
        let at = h.data_start as usize + 5;
        bytes[at] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_tensor(&path, &h, "w").unwrap_err();
        assert!(
            err.contains("\"w\" is corrupt") && err.contains("x.safetensors"),
            "{err}"
        );
        // Truncated: the header check names it.
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        std::fs::write(&path, b"abc").unwrap();
        assert!(read_header(&path).unwrap_err().contains("truncated"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn piece_keys_name_whole_tensors_plainly() {
        let p = PieceName {
            tensor: "h.0.mlp.c_fc.weight".into(),
            start: 0,
            end: 10,
            cut: None,
        };
        assert_eq!(p.key(10), "h.0.mlp.c_fc.weight");
        assert_eq!(p.key(20), "h.0.mlp.c_fc.weight[0:10]");
        let numel = |n: &str| (n == "a").then_some(7);
        assert_eq!(PieceName::parse("a", numel).unwrap().end, 7);
        assert_eq!(
            PieceName::parse("a[2:5]", numel).unwrap(),
            PieceName {
                tensor: "a".into(),
                start: 2,
                end: 5,
                cut: None,
            }
        );
        assert!(PieceName::parse("b", numel).is_err());
        assert!(PieceName::parse("a[5:2]", numel).is_err());
        // A tensor-parallel rank's piece carries its cut in the key.
        let cut = PieceName {
            tensor: "h.0.attn.c_attn.weight".into(),
            start: 0,
            end: 96,
            cut: Some(Cut {
                dim: 1,
                slices: vec![(0, 4), (16, 4), (32, 4)],
            }),
        };
        let key = cut.key(96);
        assert_eq!(key, "h.0.attn.c_attn.weight@1:0+4,16+4,32+4[0:96]");
        assert_eq!(PieceName::parse(&key, numel).unwrap(), cut);
        assert!(PieceName::parse("a@1:0+x[0:4]", numel).is_err());
    }
}

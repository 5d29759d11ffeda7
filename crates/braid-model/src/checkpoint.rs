//! Saving and loading parameters as safetensors, by their Hugging Face
//! GPT-2 names. braid's files carry the model configuration in the header
//! metadata (`braid.config`); a Hugging Face GPT-2 file (no such entry) has
//! its configuration read from the tensor shapes (head width 64, as every
//! GPT-2 size uses). f32, bf16 and f16 tensors load; every problem names
//! the file and the tensor.
//!
//! braid writes a CRC-32 of every tensor's stored bytes into the header
//! metadata (`braid.crc32.<name>`, 8 lowercase hex digits, the convention
//! of braid's sharded checkpoints) and loading checks every tensor that has
//! one, so a flipped bit is refused rather than loaded. Files without these
//! entries (Hugging Face's, older braid files) load unverified.

use crate::config::GptConfig;
use crate::layout::Layout;
use crate::params::Params;
use braid_core::DType;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Metadata key holding the model configuration as JSON.
pub const CONFIG_KEY: &str = "braid.config";

/// Metadata key prefix of a tensor's checksum (`braid.crc32.<name>`: the
/// CRC-32 of its stored little-endian bytes, whatever the dtype, as 8
/// lowercase hex digits). The same convention as braid's sharded
/// checkpoints.
pub const CRC_PREFIX: &str = "braid.crc32.";

/// The CRC-32 of a tensor's stored bytes.
fn crc_of(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// A checksum entry's value: exactly 8 lowercase hex digits (as written;
/// anything else means the header was damaged, so any change to a stored
/// value is refused).
fn parse_crc(hex: &str) -> Option<u32> {
    if hex.len() != 8 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u32::from_str_radix(hex, 16).ok()
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file or its header is unusable.
    #[error("{path}: not a usable safetensors checkpoint: {why}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A tensor is missing or does not fit the model.
    #[error("{path}: tensor {tensor:?}: {why}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        why: String,
    },
}

/// What loading found besides the parameters.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Tensors in the file that are not parameters of the model (Hugging
    /// Face's attention-mask buffers are skipped silently).
    pub ignored: Vec<String>,
    /// Whether the configuration came from the tensor shapes.
    pub inferred_config: bool,
    /// The header's string metadata (e.g. `braid.tokenizer`).
    pub metadata: HashMap<String, String>,
}

/// Writes `params` to `path` as f32 safetensors, with each tensor's
/// checksum in the header (written to a temporary file first, flushed to
/// the disk, then renamed and the directory flushed, so a crash never
/// leaves half a checkpoint under `path`).
pub fn save(params: &Params, path: &Path) -> Result<(), CheckpointError> {
    save_with(params, path, &[])
}

/// [`save`] with extra string metadata in the header.
pub fn save_with(
    params: &Params,
    path: &Path,
    extra: &[(&str, &str)],
) -> Result<(), CheckpointError> {
    save_as(params, path, DType::F32, extra)
}

/// [`save_with`] storing the tensors as `dtype` (f32, or bf16 for half the
/// size; loading converts back to f32).
pub fn save_as(
    params: &Params,
    path: &Path,
    dtype: DType,
    extra: &[(&str, &str)],
) -> Result<(), CheckpointError> {
    let layout = &params.layout;
    let format_err = |why: String| CheckpointError::Format {
        path: path.into(),
        why,
    };
    let st_dtype = match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        other => {
            return Err(format_err(format!(
                "checkpoints store f32 or bf16, not {other}"
            )))
        }
    };
    let mut bytes = Vec::with_capacity(layout.params.len());
    for p in &layout.params {
        let t = params
            .tensor(&p.name)
            .to_dtype(dtype)
            .map_err(|e| format_err(e.to_string()))?;
        bytes.push(t.to_le_bytes());
    }
    let mut views = Vec::with_capacity(layout.params.len());
    for (p, b) in layout.params.iter().zip(&bytes) {
        let view =
            TensorView::new(st_dtype, p.shape.clone(), b).map_err(|e| format_err(e.to_string()))?;
        views.push((p.name.clone(), view));
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    for (k, v) in extra {
        meta.insert(k.to_string(), v.to_string());
    }
    meta.insert(
        CONFIG_KEY.to_string(),
        serde_json::to_string(&layout.config).expect("config serialises"),
    );
    for (p, b) in layout.params.iter().zip(&bytes) {
        meta.insert(
            format!("{CRC_PREFIX}{}", p.name),
            format!("{:08x}", crc_of(b)),
        );
    }
    let tmp = path.with_extension("safetensors.tmp");
    let written = safetensors::tensor::serialize_to_file(views, &Some(meta), &tmp)
        .map_err(|e| CheckpointError::Format {
            path: tmp.clone(),
            why: e.to_string(),
        })
        .and_then(|()| {
            // The header in a fixed order, then the file's bytes flushed to
            // the disk before it takes the final name: a rename may reach
            // the disk before the data does.
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&tmp)
                .and_then(|mut f| {
                    canonical_header(&mut f)?;
                    f.sync_all()
                })
                .map_err(|source| CheckpointError::Io {
                    path: tmp.clone(),
                    source,
                })
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| CheckpointError::Io {
                path: path.into(),
                source,
            })
        });
    if written.is_err() {
        // Best effort: the error being returned is the one that matters.
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    sync_parent(path)
}

/// Rewrites the JSON header of the safetensors file `f` in place with its
/// keys sorted (the same bytes, ordered; padded with spaces to its length),
/// so that the same model always gives the same file: the safetensors
/// crate writes the metadata in a hash map's order, which changes from run
/// to run.
fn canonical_header(f: &mut std::fs::File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut len = [0u8; 8];
    f.seek(SeekFrom::Start(0))?;
    f.read_exact(&mut len)?;
    let n = usize::try_from(u64::from_le_bytes(len)).map_err(|e| bad(e.to_string()))?;
    let mut header = vec![0u8; n];
    f.read_exact(&mut header)?;
    // serde_json's maps are sorted by key.
    let value: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let mut sorted = serde_json::to_vec(&value).map_err(|e| bad(e.to_string()))?;
    if sorted.len() > n {
        return Err(bad(format!(
            "the sorted header takes {} bytes, the written one {n}",
            sorted.len()
        )));
    }
    sorted.resize(n, b' ');
    f.seek(SeekFrom::Start(8))?;
    f.write_all(&sorted)
}

/// Flushes the directory holding `path` to the disk, so the rename that
/// gave the file its name survives a crash.
fn sync_parent(path: &Path) -> Result<(), CheckpointError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    sync_dir(dir).map_err(|source| CheckpointError::Io {
        path: dir.into(),
        source,
    })
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Directories cannot be opened as files here; the rename is as durable
/// as the platform makes it.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Checks tensor `name` of the file `path` against its checksum in
/// `metadata`, if it has one.
fn verify(
    path: &Path,
    name: &str,
    view: &TensorView<'_>,
    metadata: &HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let Some(hex) = metadata.get(&format!("{CRC_PREFIX}{name}")) else {
        return Ok(());
    };
    let tensor_err = |why: String| CheckpointError::Tensor {
        path: path.into(),
        tensor: name.to_string(),
        why,
    };
    let want = parse_crc(hex).ok_or_else(|| {
        tensor_err(format!(
            "malformed checksum {hex:?} in the header (expected 8 lowercase hex digits)"
        ))
    })?;
    let got = crc_of(view.data());
    if got != want {
        return Err(tensor_err(format!(
            "corrupt: its checksum is {got:08x}, the header says {want:08x}"
        )));
    }
    Ok(())
}

/// The bytes of the file at `path`, mapped read-only (no copy in the
/// process's memory: loading a model holds its parameters once, not
/// twice); `None` for an empty file.
fn map_file(path: &Path) -> Result<Option<memmap2::Mmap>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() == 0 {
        return Ok(None);
    }
    // SAFETY: the mapping is read-only and private to this call; braid
    // never writes a checkpoint it is reading (saves go to a temporary
    // file renamed into place), and a file truncated under a live mapping
    // by another program is outside what any mmap reader can defend.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok(Some(map))
}

/// The model configuration of the checkpoint at `path` (from its header:
/// `braid.config`, or the shapes of a Hugging Face file), without reading
/// its tensors: what a run checks its memory for before loading.
pub fn config_of(path: &Path) -> Result<GptConfig, CheckpointError> {
    Ok(header_of(path)?.0)
}

/// [`config_of`] and the header's string metadata (`braid.tokenizer`,
/// ...), still without reading a tensor.
pub fn header_of(path: &Path) -> Result<(GptConfig, HashMap<String, String>), CheckpointError> {
    let map = map_file(path)?;
    let buf: &[u8] = map.as_deref().unwrap_or(&[]);
    let format = |why: String| CheckpointError::Format {
        path: path.into(),
        why,
    };
    let meta = read_header(buf).map_err(format)?;
    let config = config_in(&meta, buf).map_err(format)?.0;
    Ok((config, meta.metadata().clone().unwrap_or_default()))
}

/// The safetensors header of `buf`, or why the file is not one, in words
/// (the library's names, such as `HeaderTooLarge`, say what failed inside
/// it, not that the file is something else).
fn read_header(buf: &[u8]) -> Result<safetensors::tensor::Metadata, String> {
    use safetensors::SafeTensorError as E;
    let not_model = "is it a model written by `braid train --save` or a Hugging Face \
                     model.safetensors?";
    SafeTensors::read_metadata(buf)
        .map(|(_, m)| m)
        .map_err(|e| match e {
            E::HeaderTooSmall | E::HeaderTooLarge | E::InvalidHeaderLength => {
                let declared = buf
                    .get(..8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                format!(
                    "not a safetensors file: {}, and the file holds {} bytes ({not_model})",
                    match declared {
                        Some(n) => format!("its first 8 bytes give a header of {n} bytes"),
                        None => "it is shorter than the 8-byte header length".into(),
                    },
                    buf.len()
                )
            }
            E::InvalidHeader | E::InvalidHeaderStart | E::InvalidHeaderDeserialization => {
                format!("not a safetensors file: its header is not the JSON one ({not_model})")
            }
            other => format!("a damaged safetensors file: {other:?}"),
        })
}

/// The configuration a file's header names (`braid.config`), or else its
/// tensors' shapes (a Hugging Face file: the second value is then true),
/// validated.
fn config_in(
    meta: &safetensors::tensor::Metadata,
    buf: &[u8],
) -> Result<(GptConfig, bool), String> {
    let (config, inferred) = match meta.metadata().as_ref().and_then(|m| m.get(CONFIG_KEY)) {
        Some(json) => (
            serde_json::from_str::<GptConfig>(json)
                .map_err(|e| format!("bad {CONFIG_KEY} metadata: {e}"))?,
            false,
        ),
        None => {
            let st = SafeTensors::deserialize(buf).map_err(|e| format!("{e:?}"))?;
            (infer_config(&st)?, true)
        }
    };
    config
        .validate()
        .map_err(|e| format!("configuration {config:?}: {e}"))?;
    Ok((config, inferred))
}

/// Reads a checkpoint written by [`save`] or a Hugging Face GPT-2
/// `model.safetensors`.
pub fn load(path: &Path) -> Result<(Params, LoadReport), CheckpointError> {
    load_as(path, Layout::new)
}

/// [`load`] into the layout `layout` makes for the file's configuration
/// (tensors are placed by name: a padded layout, as ZeRO trains on, is
/// filled directly rather than copied into afterwards).
pub fn load_as(
    path: &Path,
    layout: impl FnOnce(&GptConfig) -> Layout,
) -> Result<(Params, LoadReport), CheckpointError> {
    let map = map_file(path)?;
    let buf: &[u8] = map.as_deref().unwrap_or(&[]);
    let format = |why: String| CheckpointError::Format {
        path: path.into(),
        why,
    };
    let meta = read_header(buf).map_err(format)?;
    let st = SafeTensors::deserialize(buf).map_err(|e| format(format!("{e:?}")))?;
    let mut report = LoadReport {
        metadata: meta.metadata().clone().unwrap_or_default(),
        ..Default::default()
    };
    // A checksum entry naming no tensor of the file: the header itself is
    // damaged (a flipped byte in an entry's name would otherwise leave its
    // tensor unverified).
    let mut orphans: Vec<&str> = report
        .metadata
        .keys()
        .filter_map(|k| k.strip_prefix(CRC_PREFIX))
        .filter(|name| st.tensor(name).is_err())
        .collect();
    orphans.sort_unstable();
    if let Some(name) = orphans.first() {
        return Err(format(format!(
            "the header has a checksum for tensor {name:?}, which the file does not hold"
        )));
    }
    // Every checksummed tensor is verified, parameters or not, before
    // anything is read from the file's data.
    let mut names = st.names();
    names.sort_unstable();
    for name in names {
        let view = st.tensor(name).map_err(|e| format(format!("{e:?}")))?;
        verify(path, name, &view, &report.metadata)?;
    }
    let (config, inferred) = config_in(&meta, buf).map_err(format)?;
    report.inferred_config = inferred;
    let layout = Arc::new(layout(&config));
    if layout.config != config {
        return Err(format(format!(
            "laid out as {:?}, but the file holds {config:?}",
            layout.config
        )));
    }
    let mut params = Params::zeros(layout.clone());
    for p in &layout.params {
        let tensor_err = |why: String| CheckpointError::Tensor {
            path: path.into(),
            tensor: p.name.clone(),
            why,
        };
        let t = st
            .tensor(&p.name)
            .map_err(|_| tensor_err("missing from the file".into()))?;
        if t.shape() != p.shape.as_slice() {
            return Err(tensor_err(format!(
                "shape {:?} in the file, the model needs {:?}",
                t.shape(),
                p.shape
            )));
        }
        let dst = &mut params.data[p.range()];
        let src = t.data();
        match t.dtype() {
            Dtype::F32 => {
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::BF16 => {
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            other => {
                return Err(tensor_err(format!(
                    "dtype {other:?} is not f32, bf16 or f16"
                )))
            }
        }
        if dst.iter().any(|x| !x.is_finite()) {
            return Err(tensor_err("holds NaN or infinite values".into()));
        }
    }
    for name in st.names() {
        let hf_buffer = name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
        if layout.get(name).is_none() && !hf_buffer {
            report.ignored.push(name.clone());
        }
    }
    report.ignored.sort();
    Ok((params, report))
}

/// A GPT-2 configuration from a checkpoint's shapes.
fn infer_config(st: &SafeTensors) -> Result<GptConfig, String> {
    let shape = |n: &str| {
        st.tensor(n).map(|t| t.shape().to_vec()).map_err(|_| {
            format!("no {CONFIG_KEY} metadata and no {n:?} tensor to infer the model from")
        })
    };
    let wte = shape("wte.weight")?;
    let wpe = shape("wpe.weight")?;
    if wte.len() != 2 || wpe.len() != 2 || wte[1] != wpe[1] {
        return Err(format!(
            "embedding shapes {wte:?} and {wpe:?} do not fit a GPT model"
        ));
    }
    let n_layer = (0..)
        .take_while(|i| st.tensor(&format!("h.{i}.ln_1.weight")).is_ok())
        .count();
    let n_embd = wte[1];
    Ok(GptConfig {
        n_layer,
        n_head: (n_embd / 64).max(1),
        n_embd,
        vocab_size: wte[0],
        context: wpe[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("braid-ckpt-{}-{name}", std::process::id()))
    }

    #[test]
    fn save_then_load_gives_the_same_parameters_and_config() {
        let cfg = GptConfig::parse("L2-H2-C32-V100-T16").unwrap();
        let p = Params::init_gpt2(Arc::new(Layout::new(&cfg)), 3);
        let path = tmp("roundtrip.safetensors");
        save(&p, &path).unwrap();
        let (q, report) = load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(q, p);
        assert!(!report.inferred_config && report.ignored.is_empty());
        // bf16 checkpoints: half the size, values rounded.
        let path = tmp("bf16.safetensors");
        save_as(&p, &path, DType::BF16, &[("braid.tokenizer", "bytes")]).unwrap();
        let (r, report) = load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(report.metadata["braid.tokenizer"], "bytes");
        for (a, b) in p.data.iter().zip(&r.data) {
            assert!((a - b).abs() <= a.abs() / 128.0 + 1e-30);
        }
    }

    fn small_params() -> Params {
        let cfg = GptConfig::parse("L2-H2-C32-V100-T16").unwrap();
        Params::init_gpt2(Arc::new(Layout::new(&cfg)), 3)
    }

    /// The header JSON of a safetensors file and where its data starts.
    fn header_of(buf: &[u8]) -> (serde_json::Value, usize) {
        let n = u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize;
        (serde_json::from_slice(&buf[8..8 + n]).unwrap(), 8 + n)
    }

    /// The stored tensors of a file, in data order: (name, byte range in
    /// the file).
    fn data_order(buf: &[u8]) -> Vec<(String, std::ops::Range<usize>)> {
        let (header, start) = header_of(buf);
        let mut v: Vec<_> = header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, t)| {
                let o = &t["data_offsets"];
                let (a, b) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
                (k.clone(), start + a as usize..start + b as usize)
            })
            .collect();
        v.sort_by_key(|(_, r)| r.start);
        v
    }

    /// Saves `p` as `dtype`, then checks that one flipped bit at the start,
    /// the middle and the end of the first, a middle and the last tensor's
    /// bytes is refused, naming that tensor and the file.
    fn flipped_bits_are_refused(dtype: DType, name: &str) {
        let p = small_params();
        let path = tmp(name);
        save_as(&p, &path, dtype, &[]).unwrap();
        let good = std::fs::read(&path).unwrap();
        let order = data_order(&good);
        assert_eq!(order.len(), p.layout.params.len());
        let picks = [&order[0], &order[order.len() / 2], &order[order.len() - 1]];
        for (tensor, range) in picks {
            for (at, bit) in [
                (range.start, 0u8),
                ((range.start + range.end) / 2, 3),
                (range.end - 1, 6),
            ] {
                let mut bad = good.clone();
                bad[at] ^= 1 << bit;
                std::fs::write(&path, &bad).unwrap();
                let e = load(&path).unwrap_err();
                match &e {
                    CheckpointError::Tensor {
                        path: p,
                        tensor: t,
                        why,
                    } => {
                        assert_eq!(p, &path);
                        assert_eq!(t, tensor);
                        assert!(why.starts_with("corrupt: its checksum is "), "{why}");
                        assert!(why.contains(", the header says "), "{why}");
                    }
                    other => panic!("byte {at} bit {bit} of {tensor}: {other}"),
                }
                let msg = e.to_string();
                assert!(msg.contains(name) && msg.contains(tensor.as_str()), "{msg}");
            }
        }
        // The untouched file still loads.
        std::fs::write(&path, &good).unwrap();
        load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn saved_files_carry_a_checksum_of_every_tensor() {
        let p = small_params();
        for (dtype, name) in [
            (DType::F32, "crc-f32.safetensors"),
            (DType::BF16, "crc-bf16.safetensors"),
        ] {
            let path = tmp(name);
            save_as(&p, &path, dtype, &[("braid.tokenizer", "bytes")]).unwrap();
            assert!(!path.with_extension("safetensors.tmp").exists());
            let buf = std::fs::read(&path).unwrap();
            let (header, _) = header_of(&buf);
            let meta = header["__metadata__"].as_object().unwrap();
            for (tensor, range) in data_order(&buf) {
                let hex = meta[&format!("{CRC_PREFIX}{tensor}")].as_str().unwrap();
                assert_eq!(hex, format!("{:08x}", crc32fast::hash(&buf[range])));
            }
            let crcs = meta.keys().filter(|k| k.starts_with(CRC_PREFIX)).count();
            assert_eq!(crcs, p.layout.params.len());
            let (q, report) = load(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert_eq!(report.metadata["braid.tokenizer"], "bytes");
            if dtype == DType::F32 {
                assert_eq!(q, p);
            }
        }
    }

    #[test]
    fn the_same_model_always_gives_the_same_file() {
        // Many metadata keys (a checksum per tensor): a hash map's order
        // would differ between the two writes.
        let p = small_params();
        let (a, b) = (tmp("same-a.safetensors"), tmp("same-b.safetensors"));
        for path in [&a, &b] {
            save_as(&p, path, DType::F32, &[("braid.tokenizer", "bytes")]).unwrap();
        }
        let (x, y) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let (q, _) = load(&a).unwrap();
        std::fs::remove_file(&a).unwrap();
        std::fs::remove_file(&b).unwrap();
        assert!(x == y, "two saves of one model differ");
        assert_eq!(q, p);
    }

    #[test]
    fn a_flipped_bit_in_f32_tensor_data_is_refused() {
        flipped_bits_are_refused(DType::F32, "flip-f32.safetensors");
    }

    #[test]
    fn a_flipped_bit_in_bf16_tensor_data_is_refused() {
        flipped_bits_are_refused(DType::BF16, "flip-bf16.safetensors");
    }

    #[test]
    fn files_without_checksums_load_unverified() {
        let p = small_params();
        let bytes: Vec<Vec<u8>> = p
            .layout
            .params
            .iter()
            .map(|s| p.tensor(&s.name).to_le_bytes())
            .collect();
        let views: Vec<_> = p
            .layout
            .params
            .iter()
            .zip(&bytes)
            .map(|(s, b)| {
                (
                    s.name.clone(),
                    TensorView::new(Dtype::F32, s.shape.clone(), b).unwrap(),
                )
            })
            .collect();
        let meta = HashMap::from([(
            CONFIG_KEY.to_string(),
            serde_json::to_string(&p.layout.config).unwrap(),
        )]);
        let path = tmp("no-crc.safetensors");
        safetensors::tensor::serialize_to_file(views, &Some(meta), &path).unwrap();
        let (q, report) = load(&path).unwrap();
        assert_eq!(q, p);
        assert!(!report.inferred_config);
        // Unverified: a flipped bit goes unnoticed, as before.
        let mut buf = std::fs::read(&path).unwrap();
        let (_, range) = data_order(&buf)[0].clone();
        buf[range.start] ^= 1;
        std::fs::write(&path, &buf).unwrap();
        let (r, _) = load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_ne!(r, p);
    }

    #[test]
    fn a_damaged_checksum_in_the_header_is_refused() {
        let p = small_params();
        let path = tmp("bad-crc.safetensors");
        save(&p, &path).unwrap();
        let good = std::fs::read(&path).unwrap();
        let (header, start) = header_of(&good);
        let tensor = &p.layout.params[p.layout.params.len() / 2].name;
        let key = format!("{CRC_PREFIX}{tensor}");
        let hex = header["__metadata__"][&key].as_str().unwrap();
        let needle = format!("\"{key}\":\"{hex}\"");
        let at = 8
            + std::str::from_utf8(&good[8..start])
                .unwrap()
                .find(&needle)
                .unwrap()
            + key.len()
            + 4;
        assert_eq!(&good[at..at + 8], hex.as_bytes());
        // Every single-bit flip of every digit: a different value, a
        // malformed one, or a header that no longer parses; never accepted.
        for i in 0..8 {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[at + i] ^= 1 << bit;
                std::fs::write(&path, &bad).unwrap();
                let e = load(&path).unwrap_err();
                let msg = e.to_string();
                assert!(msg.contains("bad-crc.safetensors"), "{msg}");
                if let CheckpointError::Tensor { tensor: t, why, .. } = &e {
                    assert_eq!(t, tensor, "{msg}");
                    assert!(why.contains("checksum"), "{msg}");
                }
            }
        }
        // A malformed value names the tensor.
        let mut bad = good.clone();
        bad[at] = b'g';
        std::fs::write(&path, &bad).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(
            e.contains(tensor.as_str()) && e.contains("malformed checksum"),
            "{e}"
        );
        // A damaged entry name would leave its tensor unchecked: refused.
        let mut bad = good.clone();
        bad[at - 4] ^= 1; // the last letter of the entry's tensor name
        std::fs::write(&path, &bad).unwrap();
        let e = load(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("does not hold"), "{e}");
    }

    #[test]
    fn corrupt_and_mismatched_files_are_named() {
        let path = tmp("corrupt.safetensors");
        std::fs::write(&path, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("not a usable safetensors"), "{e}");
        // A Hugging Face style file (no config metadata) with a wrong shape.
        let wte = vec![0u8; 10 * 64 * 4];
        let wpe = vec![0u8; 8 * 64 * 4];
        let ln = vec![0u8; 32 * 4];
        let views = vec![
            (
                "wte.weight",
                TensorView::new(Dtype::F32, vec![10, 64], &wte).unwrap(),
            ),
            (
                "wpe.weight",
                TensorView::new(Dtype::F32, vec![8, 64], &wpe).unwrap(),
            ),
            (
                "h.0.ln_1.weight",
                TensorView::new(Dtype::F32, vec![32], &ln).unwrap(),
            ),
        ];
        safetensors::tensor::serialize_to_file(views, &None, &path).unwrap();
        let e = load(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(
            e.contains("h.0.ln_1.weight") && e.contains("[32]") && e.contains("[64]"),
            "{e}"
        );
        let e = load(&tmp("missing.safetensors")).unwrap_err().to_string();
        assert!(e.contains("missing.safetensors"), "{e}");
    }
}

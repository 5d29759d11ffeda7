//! Saving and loading parameters as safetensors, by their Hugging Face
//! GPT-2 names. braid's files carry the model configuration in the header
//! metadata (`braid.config`); a Hugging Face GPT-2 file (no such entry) has
//! its configuration read from the tensor shapes (head width 64, as every
//! GPT-2 size uses). f32, bf16 and f16 tensors load; every problem names
//! the file and the tensor.

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

/// Writes `params` to `path` as f32 safetensors (written to a temporary
/// file first, then renamed, so a crash never leaves half a checkpoint).
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
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::tensor::serialize_to_file(views, &Some(meta), &tmp).map_err(|e| {
        CheckpointError::Format {
            path: tmp.clone(),
            why: e.to_string(),
        }
    })?;
    std::fs::rename(&tmp, path).map_err(|source| CheckpointError::Io {
        path: path.into(),
        source,
    })
}

/// Reads a checkpoint written by [`save`] or a Hugging Face GPT-2
/// `model.safetensors`.
pub fn load(path: &Path) -> Result<(Params, LoadReport), CheckpointError> {
    let buf = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.into(),
        source,
    })?;
    let format = |why: String| CheckpointError::Format {
        path: path.into(),
        why,
    };
    let (_, meta) = SafeTensors::read_metadata(&buf).map_err(|e| format(format!("{e:?}")))?;
    let st = SafeTensors::deserialize(&buf).map_err(|e| format(format!("{e:?}")))?;
    let mut report = LoadReport {
        metadata: meta.metadata().clone().unwrap_or_default(),
        ..Default::default()
    };
    let config = match meta.metadata().as_ref().and_then(|m| m.get(CONFIG_KEY)) {
        Some(json) => serde_json::from_str::<GptConfig>(json)
            .map_err(|e| format(format!("bad {CONFIG_KEY} metadata: {e}")))?,
        None => {
            report.inferred_config = true;
            infer_config(&st).map_err(format)?
        }
    };
    config
        .validate()
        .map_err(|e| format(format!("configuration {config:?}: {e}")))?;
    let layout = Arc::new(Layout::new(&config));
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

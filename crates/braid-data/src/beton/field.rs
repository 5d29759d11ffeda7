//! The field types of a `.beton` file (FFCV's `ffcv/fields/`): their type
//! ids, the arguments their descriptors carry, and the metadata each
//! sample keeps for them. braid's own token windows are an NDArray field
//! (1-D, u16 or u32) whose arguments carry a braid tag after numpy's type
//! description, so FFCV reads them as ordinary arrays.

use super::dtype::DType;
use super::layout::{u64_at, ARGS_SIZE, NAME_SIZE};

/// FFCV's type id of a float field.
pub const TYPE_FLOAT: u8 = 0;
/// … an int field.
pub const TYPE_INT: u8 = 1;
/// … an RGB image field.
pub const TYPE_RGB_IMAGE: u8 = 2;
/// … a bytes field.
pub const TYPE_BYTES: u8 = 3;
/// … an NDArray field.
pub const TYPE_NDARRAY: u8 = 4;
/// … a JSON field.
pub const TYPE_JSON: u8 = 5;
/// … a torch tensor field (an NDArray field written from torch tensors).
pub const TYPE_TORCH_TENSOR: u8 = 6;
/// … a custom field (FFCV needs the reader's `custom_handlers` for it).
pub const TYPE_CUSTOM: u8 = 255;

/// Bytes of NDArray arguments before numpy's type description: the shape
/// (32 × u64) and the description's length (u64).
const NDARRAY_ARGS_HEADER: usize = 32 * 8 + 8;
/// The most dimensions an NDArray field has (numpy's limit).
pub const MAX_DIMS: usize = 32;
/// Where braid's token tag sits in an NDArray field's arguments (past any
/// type description numpy writes for a plain type).
const TOKENS_TAG_AT: usize = 512;
/// The tag itself; the vocabulary size (u64) follows it.
const TOKENS_TAG: &[u8; 16] = b"braid:tokens:v1\0";

/// What a field holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldType {
    /// One f64 per sample.
    Float,
    /// One i64 per sample.
    Int,
    /// An RGB image per sample, raw pixels or JPEG.
    RgbImage,
    /// Variable-length bytes.
    Bytes,
    /// A fixed-shape array.
    NdArray {
        /// Element type.
        dtype: DType,
        /// Shape (no zero dimension, at least one dimension).
        shape: Vec<u64>,
    },
    /// A JSON value (stored as its text and a NUL).
    Json,
    /// FFCV's torch tensor field: an NDArray under another type id.
    TorchTensor {
        /// Element type.
        dtype: DType,
        /// Shape.
        shape: Vec<u64>,
    },
    /// braid's GPT token windows: `window` tokens (a training window's
    /// inputs and the token after them) per sample.
    Tokens {
        /// u16 or u32.
        dtype: DType,
        /// Tokens per sample.
        window: u64,
        /// The tokenizer's vocabulary size (0: not recorded).
        vocab: u64,
    },
}

/// How a field's per-sample metadata is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    /// Bytes.
    pub size: usize,
    /// Alignment in the sample's metadata struct.
    pub align: usize,
}

impl FieldType {
    /// The type id in the field's descriptor.
    pub fn type_id(&self) -> u8 {
        match self {
            FieldType::Float => TYPE_FLOAT,
            FieldType::Int => TYPE_INT,
            FieldType::RgbImage => TYPE_RGB_IMAGE,
            FieldType::Bytes => TYPE_BYTES,
            FieldType::NdArray { .. } | FieldType::Tokens { .. } => TYPE_NDARRAY,
            FieldType::Json => TYPE_JSON,
            FieldType::TorchTensor { .. } => TYPE_TORCH_TENSOR,
        }
    }

    /// The per-sample metadata: numpy's scalars align to their size; the
    /// bytes and image records are packed numpy structs (alignment 1).
    pub fn meta_layout(&self) -> MetaLayout {
        match self {
            FieldType::Float | FieldType::Int => MetaLayout { size: 8, align: 8 },
            FieldType::NdArray { .. }
            | FieldType::TorchTensor { .. }
            | FieldType::Tokens { .. } => MetaLayout { size: 8, align: 8 },
            // mode u8, width u16, height u16, data_ptr u64
            FieldType::RgbImage => MetaLayout { size: 13, align: 1 },
            // ptr u64, size u64
            FieldType::Bytes | FieldType::Json => MetaLayout { size: 16, align: 1 },
        }
    }

    /// Whether each sample's value lives in the data region.
    pub fn has_payload(&self) -> bool {
        !matches!(self, FieldType::Float | FieldType::Int)
    }

    /// The fixed payload size of array fields (elements × element size).
    pub fn array_bytes(&self) -> Option<u64> {
        match self {
            FieldType::NdArray { dtype, shape } | FieldType::TorchTensor { dtype, shape } => {
                Some(shape.iter().product::<u64>() * dtype.size() as u64)
            }
            FieldType::Tokens { dtype, window, .. } => Some(window * dtype.size() as u64),
            _ => None,
        }
    }

    /// A short name: `int`, `float`, `bytes`, `json`, `rgb_image`,
    /// `ndarray <f4 [3, 4]`, `torch_tensor <f4 [3]`, `tokens <u2 [1025]`.
    pub fn name(&self) -> String {
        let arr = |kind: &str, d: &DType, s: &[u64]| {
            let dims: Vec<String> = s.iter().map(|x| x.to_string()).collect();
            format!("{kind} {} [{}]", d.descr(), dims.join(", "))
        };
        match self {
            FieldType::Float => "float".into(),
            FieldType::Int => "int".into(),
            FieldType::RgbImage => "rgb_image".into(),
            FieldType::Bytes => "bytes".into(),
            FieldType::Json => "json".into(),
            FieldType::NdArray { dtype, shape } => arr("ndarray", dtype, shape),
            FieldType::TorchTensor { dtype, shape } => arr("torch_tensor", dtype, shape),
            FieldType::Tokens { dtype, window, .. } => arr("tokens", dtype, &[*window]),
        }
    }

    /// Checks a type a writer is asked for: shapes FFCV can read back.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            FieldType::NdArray { shape, .. } | FieldType::TorchTensor { shape, .. } => {
                check_shape(shape)
            }
            FieldType::Tokens { dtype, window, .. } => {
                if !matches!(dtype, DType::U16 | DType::U32) {
                    return Err(format!(
                        "a token field holds u16 or u32 tokens, not {}",
                        dtype.descr()
                    ));
                }
                if *window < 2 {
                    return Err(format!(
                        "a token window needs at least 2 tokens (an input and its target), not {window}"
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The descriptor's 1024 argument bytes.
    pub fn encode_args(&self) -> Vec<u8> {
        let mut args = vec![0u8; ARGS_SIZE];
        let (dtype, shape) = match self {
            FieldType::NdArray { dtype, shape } | FieldType::TorchTensor { dtype, shape } => {
                (*dtype, shape.clone())
            }
            FieldType::Tokens { dtype, window, .. } => (*dtype, vec![*window]),
            _ => return args,
        };
        for (i, d) in shape.iter().enumerate() {
            args[i * 8..i * 8 + 8].copy_from_slice(&d.to_le_bytes());
        }
        // Python's `json.dumps(dtype.descr)`.
        let descr = format!("[[\"\", \"{}\"]]", dtype.descr());
        args[256..264].copy_from_slice(&(descr.len() as u64).to_le_bytes());
        args[NDARRAY_ARGS_HEADER..NDARRAY_ARGS_HEADER + descr.len()]
            .copy_from_slice(descr.as_bytes());
        if let FieldType::Tokens { vocab, .. } = self {
            args[TOKENS_TAG_AT..TOKENS_TAG_AT + 16].copy_from_slice(TOKENS_TAG);
            args[TOKENS_TAG_AT + 16..TOKENS_TAG_AT + 24].copy_from_slice(&vocab.to_le_bytes());
        }
        args
    }

    /// The field type of a descriptor's type id and arguments.
    pub fn decode(type_id: u8, args: &[u8]) -> Result<FieldType, String> {
        debug_assert_eq!(args.len(), ARGS_SIZE);
        Ok(match type_id {
            TYPE_FLOAT => FieldType::Float,
            TYPE_INT => FieldType::Int,
            TYPE_RGB_IMAGE => FieldType::RgbImage,
            TYPE_BYTES => FieldType::Bytes,
            TYPE_JSON => FieldType::Json,
            TYPE_NDARRAY | TYPE_TORCH_TENSOR => {
                let (dtype, shape) = decode_array_args(args)?;
                if type_id == TYPE_TORCH_TENSOR {
                    FieldType::TorchTensor { dtype, shape }
                } else if &args[TOKENS_TAG_AT..TOKENS_TAG_AT + 16] == TOKENS_TAG {
                    if shape.len() != 1 {
                        return Err(format!(
                            "a braid token field must be 1-D, but its shape is {shape:?}"
                        ));
                    }
                    let t = FieldType::Tokens {
                        dtype,
                        window: shape[0],
                        vocab: u64_at(args, TOKENS_TAG_AT + 16),
                    };
                    t.validate()?;
                    t
                } else {
                    FieldType::NdArray { dtype, shape }
                }
            }
            TYPE_CUSTOM => {
                return Err(
                    "type id 255 (a custom field, which needs FFCV's custom_handlers): \
                     braid reads only FFCV's built-in field types"
                        .into(),
                )
            }
            other => {
                return Err(format!(
                    "unknown field type id {other} (FFCV 1.0 knows 0-6 and 255)"
                ))
            }
        })
    }
}

/// Shape and element type from NDArray arguments.
fn decode_array_args(args: &[u8]) -> Result<(DType, Vec<u64>), String> {
    let mut shape: Vec<u64> = (0..MAX_DIMS).map(|i| u64_at(args, i * 8)).collect();
    // FFCV drops trailing zeros; a zero before a non-zero dimension is a
    // shape with no elements.
    while shape.last() == Some(&0) {
        shape.pop();
    }
    check_shape(&shape)?;
    let len = u64_at(args, 256);
    let room = (ARGS_SIZE - NDARRAY_ARGS_HEADER) as u64;
    if len == 0 || len > room {
        return Err(format!(
            "the array's type description is {len} bytes long; expected 1 to {room}"
        ));
    }
    let text = &args[NDARRAY_ARGS_HEADER..NDARRAY_ARGS_HEADER + len as usize];
    let text = std::str::from_utf8(text)
        .map_err(|_| "the array's type description is not text".to_string())?;
    let descr: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| format!("the array's type description {text:?} is not JSON ({e})"))?;
    // numpy's `dtype.descr` of a plain type: [["", "<f4"]].
    let t = descr
        .as_array()
        .filter(|a| a.len() == 1)
        .and_then(|a| a[0].as_array())
        .filter(|p| p.len() == 2)
        .and_then(|p| p[1].as_str())
        .ok_or_else(|| {
            format!("the array's type description {text:?} is not a plain numpy type ([[\"\", \"<f4\"]] and the like)")
        })?;
    Ok((DType::parse(t)?, shape))
}

fn check_shape(shape: &[u64]) -> Result<(), String> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(format!(
            "an array field needs 1 to {MAX_DIMS} dimensions (FFCV cannot read a 0-d array), not {}",
            shape.len()
        ));
    }
    if shape.contains(&0) {
        return Err(format!("the array shape {shape:?} has a zero dimension"));
    }
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n < 1 << 40)
        .ok_or_else(|| format!("the array shape {shape:?} holds too many elements"))?;
    Ok(())
}

/// Checks a field name: ASCII, 1 to 16 bytes, no NUL (FFCV stores 16
/// bytes and cuts longer names silently; braid refuses them).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_SIZE || !name.is_ascii() || name.contains('\0') {
        return Err(format!(
            "field name {name:?}: names are 1 to {NAME_SIZE} ASCII characters without NUL"
        ));
    }
    Ok(())
}

/// Field offsets in one sample's metadata struct and its size (numpy's
/// `align=True`: each field at a multiple of its alignment, the whole
/// struct a multiple of the largest).
pub fn struct_layout(types: &[FieldType]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(types.len());
    let (mut at, mut max_align) = (0usize, 1usize);
    for t in types {
        let m = t.meta_layout();
        at = at.div_ceil(m.align) * m.align;
        offsets.push(at);
        at += m.size;
        max_align = max_align.max(m.align);
    }
    (offsets, at.div_ceil(max_align) * max_align)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_arguments_round_trip_as_numpy_writes_them() {
        let t = FieldType::NdArray {
            dtype: DType::F32,
            shape: vec![3, 4],
        };
        let args = t.encode_args();
        assert_eq!(&args[264..264 + 13], b"[[\"\", \"<f4\"]]");
        assert_eq!(FieldType::decode(TYPE_NDARRAY, &args).unwrap(), t);
        let tok = FieldType::Tokens {
            dtype: DType::U16,
            window: 1025,
            vocab: 50257,
        };
        assert_eq!(FieldType::decode(4, &tok.encode_args()).unwrap(), tok);
        assert!(FieldType::decode(7, &args).unwrap_err().contains("unknown"));
        let mut bad = args.clone();
        bad[256] = 200;
        assert!(FieldType::decode(4, &bad).is_err());
    }

    #[test]
    fn metadata_structs_align_like_numpy() {
        // image (13, packed) then int (8, aligned): 0, 16; 24 in all.
        let (o, s) = struct_layout(&[FieldType::RgbImage, FieldType::Int]);
        assert_eq!((o, s), (vec![0, 16], 24));
        let (o, s) = struct_layout(&[FieldType::Int, FieldType::RgbImage]);
        assert_eq!((o, s), (vec![0, 8], 24));
        let (o, s) = struct_layout(&[FieldType::Bytes, FieldType::RgbImage]);
        assert_eq!((o, s), (vec![0, 16], 29));
    }
}

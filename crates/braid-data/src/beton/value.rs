//! One sample's value of one field, as read (borrowing the payload) and
//! as `braid data inspect --json` prints it.

use serde_json::Value as Json;
use sha2::{Digest, Sha256};

use super::dtype::{float_json, DType};
use super::index::ImageMode;

/// A field's value in one sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    /// An int field.
    Int(i64),
    /// A float field.
    Float(f64),
    /// A bytes field.
    Bytes(&'a [u8]),
    /// A JSON field: its text (up to the NUL FFCV ends it with).
    Json(&'a [u8]),
    /// An NDArray or torch tensor field: little-endian elements.
    Array {
        /// Element type.
        dtype: DType,
        /// Shape.
        shape: &'a [u64],
        /// `product(shape) × dtype.size()` bytes.
        data: &'a [u8],
    },
    /// An image.
    Image(Image<'a>),
    /// braid's token window: little-endian u16 or u32 tokens.
    Tokens {
        /// u16 or u32.
        dtype: DType,
        /// The tokens' bytes.
        data: &'a [u8],
    },
}

/// A stored image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Image<'a> {
    /// JPEG or raw.
    pub mode: ImageMode,
    /// Pixels across.
    pub width: u16,
    /// Pixels down.
    pub height: u16,
    /// The payload: JPEG bytes, or height × width × 3 RGB bytes.
    pub data: &'a [u8],
}

impl Value<'_> {
    /// The value as JSON: numbers as numbers, arrays as nested lists,
    /// bytes as a hex string, JSON as itself, images as `{"mode",
    /// "height", "width", "sha256"}` (of the stored payload), tokens as a
    /// list.
    pub fn to_json(&self) -> Result<Json, String> {
        Ok(match self {
            Value::Int(v) => Json::from(*v),
            Value::Float(v) => float_json(*v),
            Value::Bytes(b) => Json::from(hex(b)),
            Value::Json(text) => {
                let s = std::str::from_utf8(text)
                    .map_err(|e| format!("a JSON field's payload is not UTF-8 ({e})"))?;
                serde_json::from_str(s)
                    .map_err(|e| format!("a JSON field's payload is not JSON ({e})"))?
            }
            Value::Array { dtype, shape, data } => nested(*dtype, shape, data, &mut 0),
            Value::Image(img) => serde_json::json!({
                "mode": img.mode.name(),
                "height": img.height,
                "width": img.width,
                "sha256": hex(&Sha256::digest(img.data)),
            }),
            Value::Tokens { dtype, data } => Json::Array(
                (0..data.len() / dtype.size())
                    .map(|i| dtype.element_json(data, i))
                    .collect(),
            ),
        })
    }

    /// Tokens of a token window (or a 1-D integer array) as u32s.
    pub fn tokens(&self) -> Option<Vec<u32>> {
        let (dtype, data) = match self {
            Value::Tokens { dtype, data } => (*dtype, *data),
            Value::Array { dtype, shape, data } if shape.len() == 1 => (*dtype, *data),
            _ => return None,
        };
        match dtype {
            DType::U16 => Some(
                data.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                    .collect(),
            ),
            DType::U32 => Some(
                data.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            _ => None,
        }
    }
}

fn nested(dtype: DType, shape: &[u64], data: &[u8], at: &mut usize) -> Json {
    match shape.split_first() {
        None => {
            let v = dtype.element_json(data, *at);
            *at += 1;
            v
        }
        Some((&n, rest)) => Json::Array((0..n).map(|_| nested(dtype, rest, data, at)).collect()),
    }
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_print_as_the_inspect_schema_says() {
        let data: Vec<u8> = [1i16, 2, 3, 4, 5, 6]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let v = Value::Array {
            dtype: DType::I16,
            shape: &[2, 3],
            data: &data,
        };
        assert_eq!(
            v.to_json().unwrap(),
            serde_json::json!([[1, 2, 3], [4, 5, 6]])
        );
        assert_eq!(
            Value::Bytes(&[0, 255]).to_json().unwrap(),
            Json::from("00ff")
        );
        assert_eq!(
            Value::Json(br#"{"a": [1]}"#).to_json().unwrap(),
            serde_json::json!({"a": [1]})
        );
        let img = Value::Image(Image {
            mode: ImageMode::Raw,
            width: 1,
            height: 1,
            data: b"abc",
        });
        let j = img.to_json().unwrap();
        assert_eq!(
            j["sha256"],
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(j["mode"], "raw");
    }
}

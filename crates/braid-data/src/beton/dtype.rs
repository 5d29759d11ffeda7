//! The element types an NDArray field may hold, named as numpy names them
//! in the field's arguments (`json.dumps(dtype.descr)`, e.g.
//! `[["", "<f4"]]`). Every fixed-size numeric numpy type is here; numpy's
//! structured, string and object types are refused with a clear error.

use serde_json::Value as Json;

/// An NDArray element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `|b1`
    Bool,
    /// `|i1`
    I8,
    /// `<i2`
    I16,
    /// `<i4`
    I32,
    /// `<i8`
    I64,
    /// `|u1`
    U8,
    /// `<u2`
    U16,
    /// `<u4`
    U32,
    /// `<u8`
    U64,
    /// `<f2`
    F16,
    /// `<f4`
    F32,
    /// `<f8`
    F64,
    /// `<c8`: two f32s.
    C64,
    /// `<c16`: two f64s.
    C128,
}

/// Every type, for tests and error messages.
pub const ALL: [DType; 14] = [
    DType::Bool,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::C64,
    DType::C128,
];

impl DType {
    /// numpy's type string (`dtype.str`), little-endian.
    pub fn descr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::I8 => "|i1",
            DType::I16 => "<i2",
            DType::I32 => "<i4",
            DType::I64 => "<i8",
            DType::U8 => "|u1",
            DType::U16 => "<u2",
            DType::U32 => "<u4",
            DType::U64 => "<u8",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::F64 => "<f8",
            DType::C64 => "<c8",
            DType::C128 => "<c16",
        }
    }

    /// The type of a numpy type string (`<f4`, `float32`, `u2`, …).
    pub fn parse(s: &str) -> Result<DType, String> {
        let bare = s.trim_start_matches(['<', '|', '=']);
        let t = match bare {
            "b1" | "bool" | "?" => DType::Bool,
            "i1" | "int8" => DType::I8,
            "i2" | "int16" => DType::I16,
            "i4" | "int32" => DType::I32,
            "i8" | "int64" => DType::I64,
            "u1" | "uint8" => DType::U8,
            "u2" | "uint16" => DType::U16,
            "u4" | "uint32" => DType::U32,
            "u8" | "uint64" => DType::U64,
            "f2" | "float16" => DType::F16,
            "f4" | "float32" => DType::F32,
            "f8" | "float64" => DType::F64,
            "c8" | "complex64" => DType::C64,
            "c16" | "complex128" => DType::C128,
            _ => {
                let names: Vec<&str> = ALL.iter().map(|t| t.descr()).collect();
                let why = if s.starts_with('>') {
                    " (big-endian arrays are not part of the format)"
                } else {
                    ""
                };
                return Err(format!(
                    "unsupported NDArray element type {s:?}{why}: braid reads {}",
                    names.join(", ")
                ));
            }
        };
        Ok(t)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// Element `i` of `bytes` as a JSON value: integers as integers,
    /// floats as numbers (`"nan"`, `"inf"`, `"-inf"` as strings, which JSON
    /// cannot hold), bools as booleans, complex numbers as `[re, im]`.
    pub fn element_json(self, bytes: &[u8], i: usize) -> Json {
        let at = &bytes[i * self.size()..(i + 1) * self.size()];
        let le = |n: usize| -> [u8; 8] {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&at[..n]);
            b
        };
        match self {
            DType::Bool => Json::Bool(at[0] != 0),
            DType::I8 => (at[0] as i8).into(),
            DType::I16 => i16::from_le_bytes([at[0], at[1]]).into(),
            DType::I32 => i32::from_le_bytes(le(4)[..4].try_into().unwrap()).into(),
            DType::I64 => i64::from_le_bytes(le(8)).into(),
            DType::U8 => at[0].into(),
            DType::U16 => u16::from_le_bytes([at[0], at[1]]).into(),
            DType::U32 => u32::from_le_bytes(le(4)[..4].try_into().unwrap()).into(),
            DType::U64 => u64::from_le_bytes(le(8)).into(),
            DType::F16 => float_json(half::f16::from_le_bytes([at[0], at[1]]).to_f64()),
            DType::F32 => float_json(f32::from_le_bytes(at[..4].try_into().unwrap()) as f64),
            DType::F64 => float_json(f64::from_le_bytes(le(8))),
            DType::C64 => Json::Array(vec![
                float_json(f32::from_le_bytes(at[..4].try_into().unwrap()) as f64),
                float_json(f32::from_le_bytes(at[4..8].try_into().unwrap()) as f64),
            ]),
            DType::C128 => Json::Array(vec![
                float_json(f64::from_le_bytes(at[..8].try_into().unwrap())),
                float_json(f64::from_le_bytes(at[8..16].try_into().unwrap())),
            ]),
        }
    }
}

/// A float as JSON: a number, or `"nan"`, `"inf"`, `"-inf"`.
pub fn float_json(x: f64) -> Json {
    if x.is_nan() {
        Json::from("nan")
    } else if x.is_infinite() {
        Json::from(if x > 0.0 { "inf" } else { "-inf" })
    } else {
        Json::from(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_parses_from_its_descr_and_numpy_name() {
        for t in ALL {
            assert_eq!(DType::parse(t.descr()).unwrap(), t);
        }
        assert_eq!(DType::parse("float32").unwrap(), DType::F32);
        let e = DType::parse(">f4").unwrap_err();
        assert!(e.contains("big-endian"), "{e}");
        assert!(DType::parse("<U10").unwrap_err().contains("unsupported"));
    }

    #[test]
    fn elements_become_json() {
        let b = (-2.5f32).to_le_bytes();
        assert_eq!(DType::F32.element_json(&b, 0), Json::from(-2.5));
        assert_eq!(
            DType::F64.element_json(&f64::NAN.to_le_bytes(), 0),
            Json::from("nan")
        );
        assert_eq!(DType::I16.element_json(&[0xff, 0xff], 0), Json::from(-1));
        assert_eq!(DType::Bool.element_json(&[0, 1], 1), Json::Bool(true));
    }
}

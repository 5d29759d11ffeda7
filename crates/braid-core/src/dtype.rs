//! Element types braid moves and reduces: [`DType`] names them at run time,
//! [`Element`] ties a Rust type to its `DType`.

use std::fmt;

/// The element types of braid's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Short name as used on the command line (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Parses a name (also accepts nccl-tests' `float`, `half`, `double`, `int`).
    pub fn parse(s: &str) -> Result<DType, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "u8" | "uint8" | "byte" => DType::U8,
            _ => {
                return Err(format!(
                    "unknown dtype {s:?}: expected one of f32 f64 f16 bf16 i32 i64 u8"
                ))
            }
        })
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Stable small integer for wire formats.
    pub fn code(self) -> u8 {
        DType::ALL.iter().position(|d| *d == self).expect("listed") as u8
    }

    /// Inverse of [`code`](Self::code).
    pub fn from_code(c: u8) -> Option<DType> {
        DType::ALL.get(c as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that braid can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The run-time name of this type.
    const DTYPE: DType;
    /// Converts from f64 (for tests, references and benchmarks).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $d:expr, $from:expr, $to:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}

element!(f32, DType::F32, |v: f64| v as f32, |x: f32| x as f64);
element!(f64, DType::F64, |v: f64| v, |x: f64| x);
element!(
    half::f16,
    DType::F16,
    half::f16::from_f64,
    |x: half::f16| x.to_f64()
);
element!(
    half::bf16,
    DType::BF16,
    half::bf16::from_f64,
    |x: half::bf16| x.to_f64()
);
element!(i32, DType::I32, |v: f64| v as i32, |x: i32| x as f64);
element!(i64, DType::I64, |v: f64| v as i64, |x: i64| x as f64);
element!(u8, DType::U8, |v: f64| v as u8, |x: u8| x as f64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_roundtrip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::parse("float").unwrap(), DType::F32);
        assert!(DType::parse("f8").is_err());
    }
}

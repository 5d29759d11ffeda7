//! [`Precision`]: the arithmetic of the GPU engine, f32, bf16 or FP8.

use crate::Result;

/// Arithmetic of the GPU engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere (matches the CPU engine).
    F32,
    /// bf16 products and activations, f32 master weights and state.
    Bf16,
    /// As bf16, with the linear layers' products in FP8 (e4m3 inputs and
    /// weights, e5m2 output gradients, each scaled by its own amax; a GPU
    /// of compute capability 8.9 or later).
    Fp8,
}

impl Precision {
    /// `f32`, `bf16` or `fp8`.
    pub fn parse(s: &str) -> Result<Precision> {
        match s {
            "f32" | "fp32" => Ok(Precision::F32),
            "bf16" | "mixed" => Ok(Precision::Bf16),
            "fp8" | "float8" => Ok(Precision::Fp8),
            other => Err(format!("--precision {other:?}: expected f32, bf16 or fp8")),
        }
    }

    /// Whether it runs the mixed-precision engine (bf16 activations, f32
    /// master weights): bf16 and FP8.
    pub fn mixed(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp8)
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Precision;

    /// Each spelling, the mixed engine's two, and a clear refusal.
    #[test]
    fn precisions_parse_and_say_which_engine() {
        for (s, p) in [
            ("f32", Precision::F32),
            ("bf16", Precision::Bf16),
            ("mixed", Precision::Bf16),
            ("fp8", Precision::Fp8),
            ("float8", Precision::Fp8),
        ] {
            assert_eq!(Precision::parse(s), Ok(p), "{s}");
            assert_eq!(Precision::parse(p.name()), Ok(p));
        }
        assert!(Precision::Bf16.mixed() && Precision::Fp8.mixed() && !Precision::F32.mixed());
        let e = Precision::parse("fp4").unwrap_err();
        assert!(e.contains("fp4") && e.contains("fp8"), "{e}");
    }
}

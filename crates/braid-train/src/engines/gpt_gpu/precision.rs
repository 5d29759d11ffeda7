//! [`Precision`]: the arithmetic of the GPU engine, f32 or bf16.

use crate::Result;

/// Arithmetic of the GPU engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere (matches the CPU engine).
    F32,
    /// bf16 products and activations, f32 master weights and state.
    Bf16,
}

impl Precision {
    /// `f32` or `bf16`.
    pub fn parse(s: &str) -> Result<Precision> {
        match s {
            "f32" | "fp32" => Ok(Precision::F32),
            "bf16" | "mixed" => Ok(Precision::Bf16),
            other => Err(format!("--precision {other:?}: expected f32 or bf16")),
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

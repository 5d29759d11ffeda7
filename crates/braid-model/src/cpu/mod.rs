//! CPU kernels of the model, generic over f32 (training) and f64 (the
//! finite-difference checks): linear layers through `gemm`, LayerNorm,
//! GELU, causal attention, the fused classifier, embeddings. Parallel
//! across cores with rayon; every sum has a fixed order, so a run repeats
//! bit for bit.

pub mod attention;
pub mod classifier;
pub mod embed;
pub mod gelu;
pub mod matmul;
pub mod norm;
pub mod real;

#[cfg(test)]
mod gradcheck;

pub use real::Real;

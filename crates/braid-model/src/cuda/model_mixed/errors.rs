//! The errors of the passes that find a buffer missing: no bf16
//! weights, no activations, no deferred weight gradients.

use braid_cuda::CudaError;

pub(super) fn no_weights() -> CudaError {
    CudaError::Invalid("no bf16 weights: pass the bf16 copy or build the model to stream".into())
}

pub(super) fn no_acts() -> CudaError {
    CudaError::Invalid("a layer has neither its own activations nor checkpointing's".into())
}

/// A layer that does not defer its weight gradients.
pub(super) fn not_deferred(l: usize) -> CudaError {
    CudaError::Invalid(format!("layer {l} does not defer its weight gradients"))
}

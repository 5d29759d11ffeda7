//! [`CudaError`]: why a GPU call failed, naming the call and the library's
//! own error name and text.

/// A failed CUDA driver or NCCL call, or GPU support missing on this machine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver, NCCL or NVRTC cannot be used here (the reason).
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA driver call returned an error.
    #[error("CUDA call {call} failed: {name} ({text})")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The error's name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description.
        text: String,
    },
    /// An NCCL call returned an error.
    #[error("NCCL call {call} failed: {name} ({text})")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// The result's name, e.g. `ncclRemoteError`.
        name: &'static str,
        /// `ncclGetLastError`/`ncclGetErrorString` text.
        text: String,
    },
    /// The caller asked for something impossible (wrong sizes, devices).
    #[error("{0}")]
    Invalid(String),
    /// A wait ran out of time or was abandoned (what, and why).
    #[error("{0}")]
    Timeout(String),
    /// A collective of a model's tensor-parallel group failed (what, and
    /// why).
    #[error("tensor parallelism: {0}")]
    Group(String),
}

/// Result of GPU-layer calls.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Converts a driver error from cudarc's `result` layer into a
/// [`CudaError`] naming `call`.
pub(crate) fn driver(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("CUresult {:?}", e.0));
        let text = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver { call, name, text }
    }
}

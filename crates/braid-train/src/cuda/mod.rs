//! GPU kernels of the gradient-communication hooks (`hooks.cu`, compiled
//! by NVRTC at run time): half-precision packing for the bf16/fp16 hooks,
//! and PowerSGD's error feedback and orthogonalisation.

pub mod check;
mod hooks;

pub use hooks::{HookKernels, SOURCES};

use braid_cuda::Result;

/// Compiles every source of this crate to PTX for `arch` (no GPU needed):
/// each source's name and PTX size.
pub fn compile_all(arch: &str) -> Result<Vec<(String, usize)>> {
    braid_cuda::nvrtc::compile_sources(&SOURCES, arch)
}

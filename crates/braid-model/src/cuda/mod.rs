//! The GPU engine: CUDA C kernels compiled by NVRTC at run time for the
//! GPU found, cached on disk, each one checked against its CPU
//! counterpart ([`check`], [`check_mixed`]); the f32 model ([`model`]) and
//! the bf16 mixed-precision model ([`model_mixed`]) built from them, and
//! the f32 decoder over a paged KV cache for serving ([`decode`]).
//!
//! [`SOURCES`] lists every kernel source; [`Kernels`] loads them on a
//! device and launches them on device buffers.

pub mod attention;
pub mod batch;
pub mod check;
pub mod check_mixed;
pub mod decode;
pub mod f32_params;
pub mod flash;
pub mod fp8;
pub mod gpu_model;
mod held;
mod kernels;
pub mod mixed;
pub mod mixed_attention;
pub mod model;
pub mod model_mixed;
pub mod profile;
pub mod rates;
mod sources;

pub use kernels::{token_buckets, Kernels, PagedKv, PagedShape, VocabRows};
pub use sources::SOURCES;

use braid_cuda::Result;

/// Compiles every source to PTX for `arch` (e.g. `compute_90`) without a
/// GPU — what CI checks where NVRTC can be installed.
pub fn compile_all(arch: &str) -> Result<Vec<(String, usize)>> {
    braid_cuda::nvrtc::compile_sources(&SOURCES, arch)
}

/// Compiles the Hopper attention kernels (`flash_wgmma.cu` appended to
/// `flash.cu`) to PTX for their architecture ([`flash::HOPPER_ARCH`]), no
/// GPU needed: the PTX's size.
pub fn compile_hopper() -> Result<usize> {
    let src = flash::hopper_source("");
    braid_cuda::nvrtc::compile_ptx(flash::HOPPER_SOURCE.0, &src, flash::HOPPER_ARCH)
        .map(|p| p.len())
}

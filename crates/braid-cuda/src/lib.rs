//! braid's GPU layer. Nothing here links against NVIDIA libraries at build
//! time: they are opened at run time, so the same binary runs on machines
//! with and without GPUs, and a missing library becomes one clear message.
//!
//! - [`driver`]: devices, streams, events and CUDA graphs (CUDA driver API
//!   through cudarc's dynamically loaded `result` layer).
//! - [`memory`]: typed device buffers and pinned host buffers; [`pool`]:
//!   the caching allocator and device-memory counters; [`window`]: the
//!   part of a flat buffer an engine may still write.
//! - [`blas`]: cuBLAS products (f32, bf16); [`nvrtc`]: run-time kernels.
//! - [`nccl`]: a thin run-time binding of NCCL; [`ipc`]: device memory
//!   shared between processes, raw copies and stream-side flags.
//! - [`nvml`]: a thin run-time binding of the NVML calls braid needs.
//! - [`topo`]: the GPUs of this host and the links between them (what
//!   `braid topo` prints); [`bandwidth`] measures copies between them.

pub mod bandwidth;
pub mod blas;
pub mod blaslt;
pub mod driver;
pub mod error;
pub mod ipc;
pub mod memory;
pub mod nccl;
pub mod nvml;
pub mod nvrtc;
pub mod pool;
pub mod topo;
pub mod window;

pub use driver::{device_count, CapturedGraph, Device, Event, Graph, Stream};
pub use error::{CudaError, Result};
pub use memory::{DeviceBuffer, DeviceMem, DeviceView, DeviceViewMut, PinnedBuffer};
pub use pool::DevicePool;
pub use window::DeviceWindow;

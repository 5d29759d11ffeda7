//! braid's GPU layer. Nothing here links against NVIDIA libraries at build
//! time: they are opened at run time, so the same binary runs on machines
//! with and without GPUs, and a missing library becomes one clear message.
//!
//! - [`nvml`]: a thin run-time binding of the NVML calls braid needs.
//! - [`topo`]: the GPUs of this host and the links between them (what
//!   `braid topo` prints).

pub mod nvml;
pub mod topo;

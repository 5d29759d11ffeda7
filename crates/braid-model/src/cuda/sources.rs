//! [`SOURCES`]: the GPU engine's kernel sources (CUDA C), by name.

/// Every kernel source: (name, CUDA C).
pub const SOURCES: [(&str, &str); 3] = [
    ("kernels", include_str!("kernels.cu")),
    ("mixed", include_str!("mixed.cu")),
    ("flash", include_str!("flash.cu")),
];

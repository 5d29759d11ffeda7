//! [`SOURCES`]: the GPU engine's kernel sources (CUDA C), by name.

/// Every kernel source: (name, CUDA C). The two with kernels that may be
/// launched overlapping the one ahead begin with `overlap.cu`'s helpers.
pub const SOURCES: [(&str, &str); 3] = [
    (
        "kernels",
        concat!(include_str!("overlap.cu"), include_str!("kernels.cu")),
    ),
    (
        "mixed",
        concat!(include_str!("overlap.cu"), include_str!("mixed.cu")),
    ),
    ("flash", include_str!("flash.cu")),
];

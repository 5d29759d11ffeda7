//! [`SOURCES`]: the GPU engine's kernel sources (CUDA C), by name.

/// Every kernel source: (name, CUDA C). The model's two begin with what
/// they share: `warps.cu` (the warp's width and reductions), `overlap.cu`
/// (the helpers of kernels launched overlapping the one ahead) and `kv.cu`
/// (the KV cache's element); `fp8.cu`, the FP8 casts, begins with
/// `warps.cu` too.
pub const SOURCES: [(&str, &str); 4] = [
    (
        "kernels",
        concat!(
            include_str!("warps.cu"),
            include_str!("overlap.cu"),
            include_str!("kv.cu"),
            include_str!("kernels.cu")
        ),
    ),
    (
        "mixed",
        concat!(
            include_str!("warps.cu"),
            include_str!("overlap.cu"),
            include_str!("kv.cu"),
            include_str!("mixed.cu")
        ),
    ),
    ("flash", include_str!("flash.cu")),
    (
        "fp8",
        concat!(include_str!("warps.cu"), include_str!("fp8.cu")),
    ),
];

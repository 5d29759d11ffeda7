// Put first in kernels.cu's and mixed.cu's sources by sources.rs.
//
// A warp's width and its reductions, shared by both: a fixed butterfly
// (xor shuffles, halving distances), so every lane gets the same result in
// the same order on every run.
#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

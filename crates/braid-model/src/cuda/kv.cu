// Put before kernels.cu and mixed.cu by sources.rs (the cache is written
// by kernels.cu's kv_write and by mixed.cu's QKV product alike).
//
// The KV cache's element: f32, or bf16 held in a 16-bit word (widened
// exactly; narrowed to the nearest, ties to even, as the host's
// half::bf16::from_f32 does for every finite value).
__device__ __forceinline__ float kv_load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const unsigned short* p, long i) {
    return __uint_as_float((unsigned)p[i] << 16);
}
__device__ __forceinline__ void kv_store(float* p, long i, float x) { p[i] = x; }
__device__ __forceinline__ void kv_store(unsigned short* p, long i, float x) {
    unsigned u = __float_as_uint(x);
    p[i] = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

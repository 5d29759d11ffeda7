// braid's gradient-communication kernels, compiled at run time by NVRTC:
// the casts of the bf16/fp16 hooks and the small passes of PowerSGD.
// Half types are handled as their bits (no CUDA headers): bf16 narrowing
// rounds to nearest even; fp16 goes through the cvt instructions.

typedef unsigned short u16;

__device__ __forceinline__ u16 to_bf16_bits(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float from_bf16_bits(u16 x) { return __uint_as_float(((unsigned)x) << 16); }

__device__ __forceinline__ u16 to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float from_f16_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// out[i] = half(x[i] * scale); kind 0: bf16, 1: fp16.
extern "C" __global__ void pack_half(u16* out, const float* x, long n, float scale, int kind) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = x[i] * scale;
        out[i] = kind == 0 ? to_bf16_bits(v) : to_f16_bits(v);
    }
}

// x[i] = float(h[i]) * scale.
extern "C" __global__ void unpack_half(float* x, const u16* h, long n, float scale, int kind) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = kind == 0 ? from_bf16_bits(h[i]) : from_f16_bits(h[i]);
        x[i] = v * scale;
    }
}

// x[i] += y[i].
extern "C" __global__ void add_into(float* x, const float* y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// x[i] += y[i] + y[stride + i] + ... (`parts` of them, added to x one
// after another in that order: the same rounding as `parts` add_into
// passes, in one pass over memory).
extern "C" __global__ void add_parts_into(float* x, const float* y, long n, long stride, int parts) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = x[i];
        for (int k = 0; k < parts; k++) v += y[k * stride + i];
        x[i] = v;
    }
}

// e[i] = before[i] - x[i] * scale (PowerSGD's error feedback).
extern "C" __global__ void residual_error(float* e, const float* before, const float* x, long n, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        e[i] = before[i] - x[i] * scale;
}

// Gram-Schmidt on the `cols` columns of the row-major `rows × cols` matrix
// `m` (one block, 1024 threads): each column is normalised (plus `eps`),
// then removed from the columns after it. Sums run in a fixed order.
extern "C" __global__ void orthogonalize(float* m, long rows, int cols, float eps) {
    __shared__ float part[1024];
    int t = threadIdx.x;
    for (int i = 0; i < cols; i++) {
        float s = 0.f;
        for (long r = t; r < rows; r += blockDim.x) {
            float v = m[r * cols + i];
            s += v * v;
        }
        part[t] = s;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w /= 2) {
            if (t < w) part[t] += part[t + w];
            __syncthreads();
        }
        float inv = 1.f / (sqrtf(part[0]) + eps);
        __syncthreads();
        for (long r = t; r < rows; r += blockDim.x) m[r * cols + i] *= inv;
        __syncthreads();
        for (int j = i + 1; j < cols; j++) {
            float d = 0.f;
            for (long r = t; r < rows; r += blockDim.x) d += m[r * cols + i] * m[r * cols + j];
            part[t] = d;
            __syncthreads();
            for (int w = blockDim.x / 2; w > 0; w /= 2) {
                if (t < w) part[t] += part[t + w];
                __syncthreads();
            }
            float dot = part[0];
            __syncthreads();
            for (long r = t; r < rows; r += blockDim.x) m[r * cols + j] -= dot * m[r * cols + i];
            __syncthreads();
        }
    }
}

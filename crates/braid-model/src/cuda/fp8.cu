// FP8 (e4m3 and e5m2, OCP's formats) casts for the scaled products of
// `--precision fp8`, compiled at run time by NVRTC: each tensor's largest
// magnitude (amax), then the tensor multiplied by FMT_MAX / amax and
// rounded to the format, to nearest even, saturating at its largest
// finite value, as it is or transposed. The product is then told amax /
// FMT_MAX (the dequantising scale) for each operand.
//
// (WARP and warp_max come first, from warps.cu.)

typedef unsigned short bf16;

__device__ __forceinline__ float fp8_in(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float fp8_in(float x) { return x; }

// The formats' largest finite values.
#define E4M3_MAX 448.f
#define E5M2_MAX 57344.f

// Rounds |a| (finite, not NaN) to a format of `mant` mantissa bits and
// exponent bias `bias` in software: the code without its sign, saturated at
// `max_code`. The hardware's conversion (sm_89 and later) gives the same
// codes; this one is for older GPUs.
__device__ __forceinline__ unsigned fp8_soft(float a, int mant, int bias, unsigned max_code) {
    if (a == 0.f) return 0;
    int e;
    frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1)
    e -= 1;         // a = 1.x * 2^e
    int emin = 1 - bias;
    if (e < emin) e = emin;  // subnormal: fixed spacing 2^(emin - mant)
    float q = rintf(ldexpf(a, mant - e));  // to nearest even
    unsigned code;
    if (q >= (float)(2 << mant)) {  // rounded up into the next binade
        q *= 0.5f;
        e += 1;
    }
    if (q < (float)(1 << mant))
        code = (unsigned)q;  // subnormal (exponent field 0)
    else
        code = ((unsigned)(e + bias) << mant) | ((unsigned)q - (1u << mant));
    return code > max_code ? max_code : code;
}

// One value scaled into format `fmt` (0: e4m3, 1: e5m2): its byte.
__device__ __forceinline__ unsigned char fp8_one(float x, int fmt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    if (fmt == 0)
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(x));
    else
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(x));
    return (unsigned char)(pair & 0xff);
#else
    unsigned sign = __float_as_uint(x) >> 31 << 7;
    if (x != x) return fmt == 0 ? 0x7f : 0x7f;  // NaN
    float a = fabsf(x);
    unsigned code = fmt == 0 ? fp8_soft(fminf(a, 1e30f), 3, 7, 0x7e)
                             : fp8_soft(fminf(a, 1e30f), 2, 15, 0x7b);
    return (unsigned char)(sign | code);
#endif
}

// The multiplier into the format from the tensor's amax (IEEE division, as
// the host's reference computes it).
__device__ __forceinline__ float fp8_scale_of(float amax, int fmt) {
    return __fdiv_rn(fmt == 0 ? E4M3_MAX : E5M2_MAX, fmaxf(amax, 1e-12f));
}
__device__ __forceinline__ float fp8_scale(const float* amax, int fmt) {
    return fp8_scale_of(*amax, fmt);
}

// The block's largest |value| (each thread's `m`) into amax[0]: over the
// warps through shared memory, then one atomic per block (blocks of up to
// 1024 threads, in any shape).
__device__ __forceinline__ void fp8_block_amax(float m, float* amax) {
    __shared__ float part[32];
    int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int threads = blockDim.x * blockDim.y * blockDim.z;
    m = warp_max(m);
    int lane = t % WARP, w = t / WARP;
    if (lane == 0) part[w] = m;
    __syncthreads();
    if (w == 0) {
        m = lane < threads / WARP ? part[lane] : 0.f;
        m = warp_max(m);
        if (lane == 0) atomicMax((int*)amax, __float_as_int(m));
    }
}

// Four consecutive values from x + i (i a multiple of 4, x + i aligned
// to four elements).
__device__ __forceinline__ void fp8_in4(const bf16* x, long i, float* v) {
    uint2 u = *reinterpret_cast<const uint2*>(x + i);
    v[0] = __uint_as_float(u.x << 16);
    v[1] = __uint_as_float(u.x & 0xffff0000u);
    v[2] = __uint_as_float(u.y << 16);
    v[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ void fp8_in4(const float* x, long i, float* v) {
    float4 u = *reinterpret_cast<const float4*>(x + i);
    v[0] = u.x;
    v[1] = u.y;
    v[2] = u.z;
    v[3] = u.w;
}

// amax[0] = max(amax[0], |x|) over n values (amax zeroed first); with
// vec, four at a time (n a multiple of 4, x aligned to four elements).
// The maximum of non-negative floats is that of their bits as integers,
// in any order, so the result does not depend on the blocks' timing.
template <typename T>
__device__ void fp8_amax(float* amax, const T* x, long n, int vec) {
    float m = 0.f;
    long stride = (long)gridDim.x * blockDim.x, first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (vec) {
        for (long i = first; i < n / 4; i += stride) {
            float v[4];
            fp8_in4(x, 4 * i, v);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        }
    } else {
        for (long i = first; i < n; i += stride) m = fmaxf(m, fabsf(fp8_in(x[i])));
    }
    fp8_block_amax(m, amax);
}

// out[i] = x[i] * scale in format fmt; block 0's first thread writes the
// dequantising scale (1 / scale) to deq. With vec, four values a thread
// (n a multiple of 4, x aligned to four elements, out to four bytes).
// With `seen` (delayed scaling) the cast also measures the tensor's own
// amax into seen[0] for the next time.
template <typename T>
__device__ void fp8_cast_by(unsigned char* out, float* deq, const T* x, float s, long n, int fmt,
                            int vec, float* seen) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *deq = __fdiv_rn(1.f, s);
    long stride = (long)gridDim.x * blockDim.x, first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    float m = 0.f;
    if (vec) {
        for (long i = first; i < n / 4; i += stride) {
            float v[4];
            fp8_in4(x, 4 * i, v);
            unsigned b = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                b |= (unsigned)fp8_one(__fmul_rn(v[e], s), fmt) << (8 * e);
                m = fmaxf(m, fabsf(v[e]));
            }
            reinterpret_cast<unsigned*>(out)[i] = b;
        }
    } else {
        for (long i = first; i < n; i += stride) {
            float v = fp8_in(x[i]);
            out[i] = fp8_one(__fmul_rn(v, s), fmt);
            m = fmaxf(m, fabsf(v));
        }
    }
    if (seen) fp8_block_amax(m, seen);
}


// Eight consecutive values from x + i (i a multiple of 8, x + i aligned
// to eight elements).
__device__ __forceinline__ void fp8_in8(const bf16* x, long i, float* v) {
    uint4 u = *reinterpret_cast<const uint4*>(x + i);
    unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        v[2 * e] = __uint_as_float(w[e] << 16);
        v[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
    }
}
__device__ __forceinline__ void fp8_in8(const float* x, long i, float* v) {
    fp8_in4(x, i, v);
    fp8_in4(x, i + 4, v + 4);
}

// The same, transposed: x is rows x cols (row-major), out cols x rows.
// Blocks of 32 x 8 threads move 32 x 32 tiles through shared memory, a
// value a thread at a time (any shape, any alignment).
template <typename T>
__device__ void fp8_cast_t_narrow(unsigned char* out, const T* x, float s, int rows, int cols,
                                  int fmt, float& m) {
    __shared__ unsigned char tile[32][33];
    int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int dy = threadIdx.y; dy < 32; dy += 8) {
        int r = r0 + dy, c = c0 + threadIdx.x;
        if (r < rows && c < cols) {
            float v = fp8_in(x[(long)r * cols + c]);
            tile[dy][threadIdx.x] = fp8_one(__fmul_rn(v, s), fmt);
            m = fmaxf(m, fabsf(v));
        }
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < 32; dy += 8) {
        int c = c0 + dy, r = r0 + threadIdx.x;
        if (r < rows && c < cols) out[(long)c * rows + r] = tile[threadIdx.x][dy];
    }
}

// The same over 64 x 64 tiles, blocks of 256 threads: eight values a load
// (a warp reads four rows' 64 values), sixteen bytes a store (a thread
// writes 16 rows of one output row). Needs cols a multiple of 8, rows of
// 16, x aligned to eight elements and out to 16 bytes. With `out_s` (8
// bytes aligned) the codes as stored go there too: both layouts from one
// read.
template <typename T>
__device__ void fp8_cast_t_wide(unsigned char* out, unsigned char* out_s, const T* x, float s,
                                int rows, int cols, int fmt, float& m) {
    // Rows of 72 bytes: a thread's eight codes go in as one aligned uint2.
    __shared__ __align__(16) unsigned char tile[64][72];
    int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64, t = threadIdx.x, g = t % 8;
    for (int dr = t / 8; dr < 64; dr += 32) {
        int r = r0 + dr, c = c0 + 8 * g;
        if (r < rows && c < cols) {
            float v[8];
            fp8_in8(x, (long)r * cols + c, v);
            unsigned b[2] = {0u, 0u};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                b[e / 4] |= (unsigned)fp8_one(__fmul_rn(v[e], s), fmt) << (8 * (e % 4));
                m = fmaxf(m, fabsf(v[e]));
            }
            *reinterpret_cast<uint2*>(&tile[dr][8 * g]) = make_uint2(b[0], b[1]);
            if (out_s) *reinterpret_cast<uint2*>(out_s + (long)r * cols + c) = make_uint2(b[0], b[1]);
        }
    }
    __syncthreads();
    // A warp reads 32 neighbouring bytes of a tile row at a time.
    int dc = t % 64, q = t / 64, c = c0 + dc, r = r0 + 16 * q;
    if (c < cols && r < rows) {
        unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; i++) w[i / 4] |= (unsigned)tile[16 * q + i][dc] << (8 * (i % 4));
        *reinterpret_cast<uint4*>(out + (long)c * rows + r) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Transposed by either tiling (`wide`: fp8_cast_t_wide's, else
// fp8_cast_t_narrow's; the same codes); block (0, 0) writes deq, and with
// `seen` the tensor's own amax is measured. `both` (wide only, else null):
// the codes as stored into both.out and the scale into both.deq as well.
struct Fp8Both {
    unsigned char* out;
    float* deq;
};
template <typename T>
__device__ void fp8_cast_t_by(unsigned char* out, float* deq, const T* x, float s, int rows,
                              int cols, int fmt, float* seen, int wide, Fp8Both both) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
        *deq = __fdiv_rn(1.f, s);
        if (both.deq) *both.deq = __fdiv_rn(1.f, s);
    }
    float m = 0.f;
    if (wide)
        fp8_cast_t_wide(out, both.out, x, s, rows, cols, fmt, m);
    else
        fp8_cast_t_narrow(out, x, s, rows, cols, fmt, m);
    if (seen) fp8_block_amax(m, seen);
}


// ---- the kernels ---------------------------------------------------------
// Delayed scaling (`BRAID_FP8_SCALING=delayed`): the scale from the amax this tensor had the last time (`hist`, with a
// margin of 2: a binade of headroom, which costs e4m3 and e5m2 no
// precision above their subnormals), the tensor's own amax measured into
// `seen` in the same pass: one read where the dynamic recipe reads twice.
// Then the recast: where the tensor outgrew the margin (seen > 2 hist, so
// values were clipped), the whole cast again with the scale from `seen`,
// the dynamic recipe's exactly; every block decides alike. Block 0 keeps
// `seen` in `next` for the next time.
#define FP8_MARGIN 2.f
// Every cast kernel of one source type (bf16 `_bf`, f32 `_f32`): the
// dynamic recipe's amax and casts (scaled by `amax`, measured first), then
// delayed scaling's casts and recasts.
#define FP8_CASTS(SUF, T)                                                                          \
    extern "C" __global__ void fp8_amax_##SUF(float* amax, const T* x, long n, int vec) {         \
        fp8_amax(amax, x, n, vec);                                                                \
    }                                                                                             \
    extern "C" __global__ void fp8_cast_##SUF(unsigned char* out, float* deq, const T* x,         \
                                              const float* amax, long n, int fmt, int vec) {      \
        fp8_cast_by(out, deq, x, fp8_scale(amax, fmt), n, fmt, vec, (float*)0);                   \
    }                                                                                             \
    extern "C" __global__ void fp8_cast_t_##SUF(unsigned char* out, float* deq, const T* x,       \
                                                const float* amax, int rows, int cols, int fmt,   \
                                                int wide, unsigned char* both_out,               \
                                                float* both_deq) {                                \
        fp8_cast_t_by(out, deq, x, fp8_scale(amax, fmt), rows, cols, fmt, (float*)0, wide,        \
                      Fp8Both{both_out, both_deq});                                               \
    }                                                                                             \
    extern "C" __global__ void fp8_cast_delayed_##SUF(unsigned char* out, float* deq, const T* x, \
                                                      const float* hist, float* seen, long n,     \
                                                      int fmt, int vec) {                         \
        fp8_cast_by(out, deq, x, fp8_scale_of(FP8_MARGIN * *hist, fmt), n, fmt, vec, seen);      \
    }                                                                                             \
    extern "C" __global__ void fp8_recast_##SUF(unsigned char* out, float* deq, const T* x,       \
                                                const float* hist, const float* seen,             \
                                                float* next, long n, int fmt, int vec) {          \
        float m = *seen;                                                                          \
        if (blockIdx.x == 0 && threadIdx.x == 0) *next = m;                                       \
        if (m > FP8_MARGIN * *hist) fp8_cast_by(out, deq, x, fp8_scale_of(m, fmt), n, fmt, vec,   \
                                                (float*)0);                                      \
    }                                                                                             \
    extern "C" __global__ void fp8_cast_t_delayed_##SUF(unsigned char* out, float* deq,           \
                                                        const T* x, const float* hist,            \
                                                        float* seen, int rows, int cols,          \
                                                        int fmt, int wide,                        \
                                                        unsigned char* both_out,                  \
                                                        float* both_deq) {                        \
        fp8_cast_t_by(out, deq, x, fp8_scale_of(FP8_MARGIN * *hist, fmt), rows, cols, fmt, seen,  \
                      wide, Fp8Both{both_out, both_deq});                                         \
    }                                                                                             \
    extern "C" __global__ void fp8_recast_t_##SUF(unsigned char* out, float* deq, const T* x,     \
                                                  const float* hist, const float* seen,           \
                                                  float* next, int rows, int cols, int fmt,       \
                                                  int wide, unsigned char* both_out,             \
                                                  float* both_deq) {                              \
        float m = *seen;                                                                          \
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0)           \
            *next = m;                                                                            \
        if (m > FP8_MARGIN * *hist)                                                               \
            fp8_cast_t_by(out, deq, x, fp8_scale_of(m, fmt), rows, cols, fmt, (float*)0, wide,    \
                          Fp8Both{both_out, both_deq});                                           \
    }
FP8_CASTS(bf, bf16)
FP8_CASTS(f32, float)

// An f32 bias as bf16 (to nearest even), for the FP8 products with an f32
// result: cuBLASLt's FP8 kernels take their bias in bf16 there.
extern "C" __global__ void fp8_bias_bf16(bf16* out, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned u = __float_as_uint(x[i]);
        // NaN stays NaN; others round to nearest even on the dropped half.
        out[i] = (x[i] != x[i]) ? (bf16)0x7fc0 : (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

// braid's mixed-precision model kernels, compiled at run time by NVRTC:
// activations in bfloat16, arithmetic and accumulation in f32, parameters
// read from the f32 master copy, the residual stream kept in f32.
// bf16 values are handled as their bits (no CUDA headers needed): widening
// is a shift, narrowing rounds to nearest even. Reductions use a fixed
// order (per-block partial sums, then a sum over blocks in block order),
// so runs repeat bit for bit.

// (WARP and warp_sum come first, from warps.cu.)

typedef unsigned short bf16;
#define GELU_S 0.7978845608028654f

__device__ __forceinline__ float wide(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float wide(float x) { return x; }
__device__ __forceinline__ bf16 narrow(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.f + tanhf(GELU_S * (x + 0.044715f * x * x * x)));
}

// ---- LayerNorm ------------------------------------------------------------
// Four LayerNorm outputs as packed bf16: norm * w + b, with norm = (x -
// mean) * rstd already formed. The vectorised forward kernels and the
// backward's recomputation all go through here, so they agree bit for bit.
__device__ __forceinline__ uint2 ln_pack4(const float* nv, const float* wv, float4 bb) {
    unsigned lo2 = narrow(nv[0] * wv[0] + bb.x) | ((unsigned)narrow(nv[1] * wv[1] + bb.y) << 16);
    unsigned hi2 = narrow(nv[2] * wv[2] + bb.z) | ((unsigned)narrow(nv[3] * wv[3] + bb.w) << 16);
    return make_uint2(lo2, hi2);
}

// Column group k of a row's output from its four inputs `xv`.
__device__ __forceinline__ uint2 ln_out4(const float* xv, float m, float rs, const float* w,
                                         const float* b, int k) {
    float4 ww = ((const float4*)w)[k];
    float nv[4], wv[4] = {ww.x, ww.y, ww.z, ww.w};
    for (int e = 0; e < 4; e++) nv[e] = (xv[e] - m) * rs;
    return ln_pack4(nv, wv, ((const float4*)b)[k]);
}

// One warp per row: out (bf16) = (x - mean) * rstd * w + b, x in f32.
extern "C" __global__ void ln_forward_bf(bf16* out, float* mean, float* rstd, const float* inp,
                                         const float* w, const float* b, int N, int C) {
    overlap_release();
    overlap_wait();
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* x = inp + (long)row * C;
    if (C % 128 == 0 && C <= 1024) {
        // Widths of 128 * G (G <= 8): the row is read once, as float4s
        // kept in registers, and written as groups of 4 bf16 values.
        int G = C / 128;
        float xv[8][4];
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j < G) {
                float4 t = ((const float4*)x)[lane + WARP * j];
                xv[j][0] = t.x; xv[j][1] = t.y; xv[j][2] = t.z; xv[j][3] = t.w;
                s += (t.x + t.y) + (t.z + t.w);
            }
        }
        float m = warp_sum(s) / C, v = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < G)
                for (int e = 0; e < 4; e++) v += (xv[j][e] - m) * (xv[j][e] - m);
        float rs = rsqrtf(warp_sum(v) / C + 1e-5f);
        uint2* o = (uint2*)(out + (long)row * C);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j < G) {
                int k = lane + WARP * j;
                o[k] = ln_out4(xv[j], m, rs, w, b, k);
            }
        }
        if (lane == 0) { mean[row] = m; rstd[row] = rs; }
        return;
    }
    float s = 0.f;
    for (int i = lane; i < C; i += WARP) s += x[i];
    float m = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane; i < C; i += WARP) { float d = x[i] - m; v += d * d; }
    float rs = rsqrtf(warp_sum(v) / C + 1e-5f);
    bf16* o = out + (long)row * C;
    for (int i = lane; i < C; i += WARP) o[i] = narrow((x[i] - m) * rs * w[i] + b[i]);
    if (lane == 0) { mean[row] = m; rstd[row] = rs; }
}

// LayerNorm backward, one warp per row: dres += dx (f32) and dres_bf gets
// the updated value in bf16. The parameter gradients come from
// `ln_param_partial_bf` + `sum_partials`.
// Every LayerNorm backward also writes, when `lnout` is not null, the
// forward output recomputed from the kept statistics, `norm * w + bias`
// in the forward kernels' exact arithmetic (bit for bit the same values):
// the model then keeps no LayerNorm outputs for the weight gradients.
extern "C" __global__ void ln_backward_bf(float* dres, bf16* dres_bf, bf16* lnout,
                                          const bf16* dout, const float* inp, const float* w,
                                          const float* bias, const float* mean,
                                          const float* rstd, int N, int C) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* x = inp + (long)row * C;
    const bf16* dy = dout + (long)row * C;
    float m = mean[row], rs = rstd[row];
    float a = 0.f, b = 0.f;
    for (int i = lane; i < C; i += WARP) {
        float dn = w[i] * wide(dy[i]);
        a += dn;
        b += dn * (x[i] - m) * rs;
    }
    a = warp_sum(a) / C;
    b = warp_sum(b) / C;
    float* d = dres + (long)row * C;
    bf16* dbf = dres_bf + (long)row * C;
    for (int i = lane; i < C; i += WARP) {
        float norm = (x[i] - m) * rs;
        float v = d[i] + (w[i] * wide(dy[i]) - a - norm * b) * rs;
        d[i] = v;
        dbf[i] = narrow(v);
        if (lnout) lnout[(long)row * C + i] = narrow(norm * w[i] + bias[i]);
    }
}

// LayerNorm backward fused with the column sums it feeds, for widths of
// 128 * G (G = 4, 6, 8): one block of 4 warps per chunk of `rpb` rows.
// The warps work in pairs, pair p taking rows p, p + 2, ... of the chunk
// in order; within a pair each warp owns half of the row's float4 column
// groups, and the row's two sums are combined through shared memory
// (halves added in order). dres += dx (f32), dres_bf = its bf16 copy, and
// partial[chunk] = (sum norm*dy | sum dy | sum of the updated dres), the
// last being the bias gradient of the projection that adds into this
// residual stream below. Splitting rows over two warps halves the
// per-thread column sums, so more warps fit per SM. Runs repeat bit for
// bit: every sum has a fixed order.
// Column group k of a row at `off`: normalised input, output gradient and
// LayerNorm weight, 4 values each.
__device__ __forceinline__ void load_row4(const float* inp, const bf16* dout, const float* w,
                                          long off, int k, float m, float rs, float* nv,
                                          float* gv, float* wv) {
    float4 ww = ((const float4*)w)[k];
    wv[0] = ww.x; wv[1] = ww.y; wv[2] = ww.z; wv[3] = ww.w;
    float4 xx = ((const float4*)(inp + off))[k];
    uint2 d = ((const uint2*)(dout + off))[k];
    nv[0] = (xx.x - m) * rs; nv[1] = (xx.y - m) * rs;
    nv[2] = (xx.z - m) * rs; nv[3] = (xx.w - m) * rs;
    gv[0] = __uint_as_float(d.x << 16); gv[1] = __uint_as_float(d.x & 0xffff0000u);
    gv[2] = __uint_as_float(d.y << 16); gv[3] = __uint_as_float(d.y & 0xffff0000u);
}

// Column group k of the recomputed LayerNorm output (ln_pack4).
__device__ __forceinline__ void store_ln4(bf16* lnout, const float* bias, long off, int k,
                                          const float* nv, const float* wv) {
    ((uint2*)(lnout + off))[k] = ln_pack4(nv, wv, ((const float4*)bias)[k]);
}

template <int G>
__device__ void ln_backward_fused(float* dres, bf16* dres_bf, bf16* lnout, const bf16* dout,
                                  const float* inp, const float* w, const float* bias,
                                  const float* mean, const float* rstd, int N, float* partial,
                                  int rpb) {
    constexpr int C = 128 * G, H = G / 2;
    __shared__ float red[3 * C];
    __shared__ float sums[2][2][2][2];  // [parity][pair][half][a, b]
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int pair = warp / 2, half = warp % 2;
    float aw[H][4], ab[H][4], ar[H][4];
#pragma unroll
    for (int j = 0; j < H; j++)
        for (int e = 0; e < 4; e++) aw[j][e] = ab[j][e] = ar[j][e] = 0.f;
    int start = blockIdx.x * rpb, end = min(start + rpb, N);
    int iters = (end - start + 1) / 2;
    for (int it = 0; it < iters; it++) {
        int row = start + 2 * it + pair;
        bool ok = row < end;
        long off = (long)row * C;
        float m = ok ? mean[row] : 0.f, rs = ok ? rstd[row] : 0.f;
        float a = 0.f, b = 0.f;
        if (ok) {
#pragma unroll
            for (int j = 0; j < H; j++) {
                int k = lane + WARP * (half * H + j);
                float nv[4], gv[4], wv[4];
                load_row4(inp, dout, w, off, k, m, rs, nv, gv, wv);
                for (int e = 0; e < 4; e++) {
                    float dn = wv[e] * gv[e];
                    a += dn;
                    b += dn * nv[e];
                }
            }
        }
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) {
            sums[it & 1][pair][half][0] = a;
            sums[it & 1][pair][half][1] = b;
        }
        __syncthreads();
        if (!ok) continue;
        a = (sums[it & 1][pair][0][0] + sums[it & 1][pair][1][0]) / C;
        b = (sums[it & 1][pair][0][1] + sums[it & 1][pair][1][1]) / C;
        float4* d = (float4*)(dres + off);
        uint2* dbf = (uint2*)(dres_bf + off);
#pragma unroll
        for (int j = 0; j < H; j++) {
            int k = lane + WARP * (half * H + j);
            float nv[4], gv[4], wv[4];
            load_row4(inp, dout, w, off, k, m, rs, nv, gv, wv);
            float4 o = d[k];
            float v[4] = {o.x, o.y, o.z, o.w};
            for (int e = 0; e < 4; e++) {
                v[e] += (wv[e] * gv[e] - a - nv[e] * b) * rs;
                aw[j][e] += nv[e] * gv[e];
                ab[j][e] += gv[e];
                ar[j][e] += v[e];
            }
            d[k] = make_float4(v[0], v[1], v[2], v[3]);
            dbf[k] = make_uint2(narrow(v[0]) | ((unsigned)narrow(v[1]) << 16),
                                narrow(v[2]) | ((unsigned)narrow(v[3]) << 16));
            if (lnout) store_ln4(lnout, bias, off, k, nv, wv);
        }
    }
    // Each column has one owner warp per pair: pair 0 writes, pair 1 adds.
    for (int p = 0; p < 2; p++) {
        if (pair == p) {
#pragma unroll
            for (int j = 0; j < H; j++) {
                for (int e = 0; e < 4; e++) {
                    int col = (lane + WARP * (half * H + j)) * 4 + e;
                    red[col] = (p ? red[col] : 0.f) + aw[j][e];
                    red[C + col] = (p ? red[C + col] : 0.f) + ab[j][e];
                    red[2 * C + col] = (p ? red[2 * C + col] : 0.f) + ar[j][e];
                }
            }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < 3 * C; i += blockDim.x) partial[(long)blockIdx.x * 3 * C + i] = red[i];
}

#define LN_FUSED(G)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) ln_backward_fused_##G(                     \
        float* dres, bf16* dres_bf, bf16* lnout, const bf16* dout, const float* inp,             \
        const float* w, const float* bias, const float* mean, const float* rstd, int N,          \
        float* partial, int rpb) {                                                               \
        ln_backward_fused<G>(dres, dres_bf, lnout, dout, inp, w, bias, mean, rstd, N, partial,   \
                             rpb);                                                               \
    }
LN_FUSED(4)
LN_FUSED(6)
LN_FUSED(8)

// ---- LayerNorm at wide rows (C = 1280 ... 5120) -------------------------
// One block of T threads per row: thread t owns the float4 column groups
// t, t + T, ... (J of them; where T does not divide C / 4 the last group
// is partial), holds the row's values in registers between the passes,
// and the row's sums are combined over the warps through shared memory in
// warp order (fixed, so runs repeat bit for bit).

// Sum of `v` over the block, in warp order; `red` holds one value per warp.
template <int NW>
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if (threadIdx.x % WARP == 0) red[threadIdx.x / WARP] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) s += red[i];
    return s;
}

// Forward: out (bf16) = (x - mean) * rstd * w + b, one row per block.
template <int C, int T>
__device__ void ln_forward_wide(bf16* out, float* mean, float* rstd, const float* inp,
                                const float* w, const float* b) {
    constexpr int K = C / 4, J = (K + T - 1) / T, NW = T / WARP;
    __shared__ float red[2][NW];
    overlap_release();
    overlap_wait();
    int row = blockIdx.x, tid = threadIdx.x;
    const float4* x = (const float4*)(inp + (long)row * C);
    float xv[J][4];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        int k = tid + T * j;
        if (K % T == 0 || k < K) {
            float4 t = x[k];
            xv[j][0] = t.x; xv[j][1] = t.y; xv[j][2] = t.z; xv[j][3] = t.w;
            s += (t.x + t.y) + (t.z + t.w);
        }
    }
    float m = block_sum<NW>(s, red[0]) / C, v = 0.f;
#pragma unroll
    for (int j = 0; j < J; j++)
        if (K % T == 0 || tid + T * j < K)
            for (int e = 0; e < 4; e++) v += (xv[j][e] - m) * (xv[j][e] - m);
    float rs = rsqrtf(block_sum<NW>(v, red[1]) / C + 1e-5f);
    uint2* o = (uint2*)(out + (long)row * C);
#pragma unroll
    for (int j = 0; j < J; j++) {
        int k = tid + T * j;
        if (K % T == 0 || k < K) o[k] = ln_out4(xv[j], m, rs, w, b, k);
    }
    if (tid == 0) { mean[row] = m; rstd[row] = rs; }
}

// Backward fused with its column sums, rows [blockIdx.x * rpb, + rpb) one
// after another: dres += dx (f32), dres_bf = its bf16 copy, lnout (when
// not null) = the recomputed forward output, and partial[block] =
// (sum norm*dy | sum dy | sum of the updated dres), as ln_backward_fused.
// Every column has one owner thread, so the block's column sums need no
// shared memory; the two row sums pass through `red` (double-buffered by
// row parity, one barrier per row).
template <int C, int T>
__device__ void ln_backward_wide(float* dres, bf16* dres_bf, bf16* lnout, const bf16* dout,
                                 const float* inp, const float* w, const float* bias,
                                 const float* mean, const float* rstd, int N, float* partial,
                                 int rpb) {
    constexpr int K = C / 4, J = (K + T - 1) / T, NW = T / WARP;
    __shared__ float red[2][NW][2];
    int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    float aw[J][4], ab[J][4], ar[J][4];
#pragma unroll
    for (int j = 0; j < J; j++)
        for (int e = 0; e < 4; e++) aw[j][e] = ab[j][e] = ar[j][e] = 0.f;
    int start = blockIdx.x * rpb, end = min(start + rpb, N);
    for (int row = start; row < end; row++) {
        int par = (row - start) & 1;
        long off = (long)row * C;
        float m = mean[row], rs = rstd[row];
        float nv[J][4], gv[J][4];
        float4 dv[J];
        float4* d = (float4*)(dres + off);
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            int k = tid + T * j;
            if (K % T == 0 || k < K) {
                float wv[4];
                dv[j] = d[k];  // read with the row, not after its barrier
                load_row4(inp, dout, w, off, k, m, rs, nv[j], gv[j], wv);
                for (int e = 0; e < 4; e++) {
                    float dn = wv[e] * gv[j][e];
                    a += dn;
                    b += dn * nv[j][e];
                }
            }
        }
        a = warp_sum(a);
        b = warp_sum(b);
        if (lane == 0) {
            red[par][warp][0] = a;
            red[par][warp][1] = b;
        }
        __syncthreads();
        a = 0.f;
        b = 0.f;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            a += red[par][i][0];
            b += red[par][i][1];
        }
        a /= C;
        b /= C;
        uint2* dbf = (uint2*)(dres_bf + off);
#pragma unroll
        for (int j = 0; j < J; j++) {
            int k = tid + T * j;
            if (K % T == 0 || k < K) {
                float4 ww = ((const float4*)w)[k];
                float wv[4] = {ww.x, ww.y, ww.z, ww.w};
                float v[4] = {dv[j].x, dv[j].y, dv[j].z, dv[j].w};
                for (int e = 0; e < 4; e++) {
                    v[e] += (wv[e] * gv[j][e] - a - nv[j][e] * b) * rs;
                    aw[j][e] += nv[j][e] * gv[j][e];
                    ab[j][e] += gv[j][e];
                    ar[j][e] += v[e];
                }
                d[k] = make_float4(v[0], v[1], v[2], v[3]);
                dbf[k] = make_uint2(narrow(v[0]) | ((unsigned)narrow(v[1]) << 16),
                                    narrow(v[2]) | ((unsigned)narrow(v[3]) << 16));
                if (lnout) store_ln4(lnout, bias, off, k, nv[j], wv);
            }
        }
    }
    float* out = partial + (long)blockIdx.x * 3 * C;
#pragma unroll
    for (int j = 0; j < J; j++) {
        int k = tid + T * j;
        if (K % T == 0 || k < K) {
            ((float4*)out)[k] = make_float4(aw[j][0], aw[j][1], aw[j][2], aw[j][3]);
            ((float4*)(out + C))[k] = make_float4(ab[j][0], ab[j][1], ab[j][2], ab[j][3]);
            ((float4*)(out + 2 * C))[k] = make_float4(ar[j][0], ar[j][1], ar[j][2], ar[j][3]);
        }
    }
}

#define LN_WIDE(C, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(T) ln_forward_##C(                              \
        bf16* out, float* mean, float* rstd, const float* inp, const float* w, const float* b) { \
        ln_forward_wide<C, T>(out, mean, rstd, inp, w, b);                                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(T) ln_backward_##C(                             \
        float* dres, bf16* dres_bf, bf16* lnout, const bf16* dout, const float* inp,             \
        const float* w, const float* bias, const float* mean, const float* rstd, int N,          \
        float* partial, int rpb) {                                                               \
        ln_backward_wide<C, T>(dres, dres_bf, lnout, dout, inp, w, bias, mean, rstd, N, partial, \
                               rpb);                                                             \
    }
// (width, threads per row): the threads divide the row's float4 groups
// into at most 5 per thread where they can (1600's 400 groups take 4 per
// thread over 128 threads, the last for 16 of them). Keep in step with
// LN_WIDE in mixed.rs.
LN_WIDE(1280, 64)
LN_WIDE(1600, 128)
LN_WIDE(2048, 128)
LN_WIDE(2560, 128)
LN_WIDE(4096, 256)
LN_WIDE(5120, 256)

// Column partial sums over the row chunk blockIdx.y (rpb rows): a block of
// 32 columns x 8 row lanes, each lane summing every 8th row in order, then
// the 8 lanes in order. LayerNorm: partial[chunk] = (sum norm*dy | sum dy).
extern "C" __global__ void ln_param_partial_bf(float* partial, const bf16* dout, const float* inp,
                                               const float* mean, const float* rstd, int N, int C,
                                               int rpb) {
    __shared__ float sw[8][33], sb[8][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    int start = blockIdx.y * rpb, end = min(start + rpb, N);
    float aw = 0.f, ab = 0.f;
    if (col < C) {
        for (int r = start + threadIdx.y; r < end; r += 8) {
            float g = wide(dout[(long)r * C + col]);
            aw += (inp[(long)r * C + col] - mean[r]) * rstd[r] * g;
            ab += g;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float tw = 0.f, tb = 0.f;
        for (int k = 0; k < 8; k++) { tw += sw[k][threadIdx.x]; tb += sb[k][threadIdx.x]; }
        partial[(long)blockIdx.y * 2 * C + col] = tw;
        partial[(long)blockIdx.y * 2 * C + C + col] = tb;
    }
}

// Bias: partial[chunk] = column sums of dout over the chunk (as above).
template <typename T>
__device__ void bias_partial(float* partial, const T* dout, int N, int C, int rpb) {
    __shared__ float sh[8][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    int start = blockIdx.y * rpb, end = min(start + rpb, N);
    float a = 0.f;
    if (col < C)
        for (int r = start + threadIdx.y; r < end; r += 8) a += wide(dout[(long)r * C + col]);
    sh[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += sh[k][threadIdx.x];
        partial[(long)blockIdx.y * C + col] = t;
    }
}
extern "C" __global__ void bias_partial_f32(float* partial, const float* dout, int N, int C, int rpb) {
    bias_partial(partial, dout, N, C, rpb);
}
extern "C" __global__ void bias_partial_bf(float* partial, const bf16* dout, int N, int C, int rpb) {
    bias_partial(partial, dout, N, C, rpb);
}

// Sums `blocks` partial rows of `stride * C` columns, the first `parts *
// C` of each: columns [0, C) go to d0, [C, 2C) to d1, [2C, 3C) to d2 (each
// skipped when null). The rows' width is the kernel's that wrote them (the
// fused LayerNorm backward always writes 3 parts), whatever is summed. A
// block of 32 columns x 8 row lanes, lane y summing partial rows y, y + 8,
// ... in order, then the 8 lanes in order (hundreds of partial rows, as
// the wide LayerNorm backward leaves, are then read by 8 times the
// threads).
extern "C" __global__ void sum_partials(float* d0, float* d1, float* d2, const float* partial,
                                        int blocks, int C, int parts, int stride) {
    __shared__ float sh[8][33];
    int i = blockIdx.x * 32 + threadIdx.x;
    int K = C * parts;
    long row = (long)C * stride;
    float s = 0.f;
    if (i < K)
        for (int b = threadIdx.y; b < blocks; b += 8) s += partial[(long)b * row + i];
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0 || i >= K) return;
    float* dst[3] = {d0, d1, d2};
    float* d = dst[i / C];
    if (!d) return;
    float t = 0.f;
    for (int k = 0; k < 8; k++) t += sh[k][threadIdx.x];
    d[i % C] += t;
}

// ---- elementwise ------------------------------------------------------------
// residual_bias and bias_gelu_bf index in 32 bits (a 64-bit `% C` per
// element is slow on the GPU): their launchers split larger buffers into
// row chunks of fewer than 2^31 elements. to_bf16 and adamw_multi, which
// take whole parameter buffers, index in 64 bits.

// out (f32) = x + bias (broadcast over rows): the residual a projection adds to.
extern "C" __global__ void residual_bias(float* out, const float* x, const float* bias, int total, int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = x[i] + bias[i % C];
}

// out (f32) = x + bias (broadcast over rows) + part (bf16): a row-split
// product summed over the tensor group in bf16, then the residual and bias
// in f32, added in that order.
extern "C" __global__ void residual_bias_add_bf(float* out, const float* x, const float* bias,
                                                const bf16* part, int total, int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = (x[i] + bias[i % C]) + wide(part[i]);
}

// Zeroes `count` runs of g, run r being g[runs[2r] .. runs[2r] + runs[2r+1]):
// a block per run, its threads striding over it (one launch where a memset
// per run would each cost the host a call).
extern "C" __global__ void zero_runs(float* g, const long* runs, int count) {
    int r = blockIdx.x;
    if (r >= count) return;
    long at = runs[2 * r], len = runs[2 * r + 1];
    for (long i = threadIdx.x; i < len; i += blockDim.x) g[at + i] = 0.f;
}

// Two bf16 values as one 32-bit word.
__device__ __forceinline__ float lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ unsigned pack(float a, float b) {
    return (unsigned)narrow(a) | ((unsigned)narrow(b) << 16);
}

// pre += bias (rounded to bf16, kept for the backward pass); out = gelu(pre).
// Two elements per thread (C even).
extern "C" __global__ void bias_gelu_bf(unsigned* pre, unsigned* out, const float* bias, int total, int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * i >= total) return;
    int c = (2 * i) % C;
    unsigned v = pre[i];
    unsigned p = pack(lo(v) + bias[c], hi(v) + bias[c + 1]);
    pre[i] = p;
    out[i] = pack(gelu(lo(p)), gelu(hi(p)));
}

// GELU through s = sigmoid(2 u) = (1 + tanh u) / 2, u = GELU_S (x +
// 0.044715 x^3): gelu(x) = x s and gelu'(x) = s + 2 x s (1 - s) u'. One
// exponential and one reciprocal (fast, ~1e-7 relative) instead of tanhf's
// branches: the GELU backward kernel is bound by its arithmetic.
__device__ __forceinline__ float gelu_sig(float x) {
    float u = GELU_S * (x + 0.044715f * x * x * x);
    return __fdividef(1.f, 1.f + __expf(-2.f * u));
}
__device__ __forceinline__ float gelu_grad_sig(float x, float s) {
    return s + 2.f * x * s * (1.f - s) * GELU_S * (1.f + 3.f * 0.044715f * x * x);
}

// f32 -> bf16 copy.
extern "C" __global__ void to_bf16(bf16* out, const float* x, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = narrow(x[i]);
}

// ---- attention ----------------------------------------------------------------
// Eight bf16 values as one 16-byte word.
struct __align__(16) bf8 { unsigned w[4]; };
__device__ __forceinline__ void unpack8(const bf8& v, float* f) {
    for (int k = 0; k < 4; k++) { f[2 * k] = lo(v.w[k]); f[2 * k + 1] = hi(v.w[k]); }
}
__device__ __forceinline__ bf8 pack8(const float* f) {
    bf8 v;
    for (int k = 0; k < 4; k++) v.w[k] = pack(f[2 * k], f[2 * k + 1]);
    return v;
}

// The permutes move groups of 8 consecutive head elements (HS % 8 == 0):
// thread i handles elements [8i, 8i + 8) of the [B, NH, T, HS] side.
__device__ __forceinline__ void head_index(int i8, int T, int NH, int HS, int& b, int& h, int& t, int& d) {
    int per = HS / 8;
    d = (i8 % per) * 8; int r = i8 / per;
    t = r % T; r /= T;
    h = r % NH; b = r / NH;
}

// qkv [B, T, 3, NH, HS] (+ bias [3C]) -> q, k, v each [B, NH, T, HS]
extern "C" __global__ void permute_qkv_bf(bf8* q, bf8* k, bf8* v, const bf16* qkv,
                                          const float* bias, int B, int T, int NH, int HS) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)B * NH * T * HS / 8) return;
    int b, h, t, d;
    head_index(i, T, NH, HS, b, h, t, d);
    int C = NH * HS, c = h * HS + d;
    const bf8* src = (const bf8*)(qkv + ((long)b * T + t) * 3 * C + c);
    bf8* dst[3] = {q, k, v};
    for (int part = 0; part < 3; part++) {
        float f[8];
        unpack8(src[part * C / 8], f);
        for (int e = 0; e < 8; e++) f[e] += bias[part * C + c + e];
        dst[part][i] = pack8(f);
    }
}

// y [B, NH, T, HS] -> out [B, T, NH*HS]
extern "C" __global__ void unpermute_bf(bf16* out, const bf8* y, int B, int T, int NH, int HS) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)B * NH * T * HS / 8) return;
    int b, h, t, d;
    head_index(i, T, NH, HS, b, h, t, d);
    *(bf8*)(out + ((long)b * T + t) * NH * HS + h * HS + d) = y[i];
}

// dout [B, T, NH*HS] -> dy [B, NH, T, HS]
extern "C" __global__ void permute_grad_bf(bf8* dy, const bf16* dout, int B, int T, int NH, int HS) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)B * NH * T * HS / 8) return;
    int b, h, t, d;
    head_index(i, T, NH, HS, b, h, t, d);
    dy[i] = *(const bf8*)(dout + ((long)b * T + t) * NH * HS + h * HS + d);
}

// dqkv [B, T, 3C] = (dq, dk, dv) each [B, NH, T, HS]
extern "C" __global__ void unpermute_qkv_grad_bf(bf16* dqkv, const bf8* dq, const bf8* dk,
                                                 const bf8* dv, int B, int T, int NH, int HS) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)B * NH * T * HS / 8) return;
    int b, h, t, d;
    head_index(i, T, NH, HS, b, h, t, d);
    int C = NH * HS;
    bf8* dst = (bf8*)(dqkv + ((long)b * T + t) * 3 * C + h * HS + d);
    dst[0] = dq[i];
    dst[C / 8] = dk[i];
    dst[2 * C / 8] = dv[i];
}

// att[row, :] = softmax(scale * preatt[row, :t+1]) in bf16, zeros after;
// one warp per row of T (row % T is the query position; T % 8 == 0), each
// lane taking 8 consecutive columns at a time, one pass for the running
// max and sum.
extern "C" __global__ void softmax_causal_forward_bf(bf16* att, const bf16* preatt, int rows, int T,
                                                     float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    const bf8* x = (const bf8*)(preatt + (long)row * T);
    bf8* y = (bf8*)(att + (long)row * T);
    float mx = -3.0e38f, s = 0.f;
    for (int j8 = lane; j8 * 8 <= t; j8 += WARP) {
        float f[8];
        unpack8(x[j8], f);
        for (int e = 0; e < 8 && j8 * 8 + e <= t; e++) {
            float z = f[e] * scale;
            if (z > mx) { s *= __expf(mx - z); mx = z; }
            s += __expf(z - mx);
        }
    }
    for (int o = WARP / 2; o > 0; o /= 2) {
        float m2 = __shfl_xor_sync(0xffffffff, mx, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        float m = fmaxf(mx, m2);
        s = s * __expf(mx - m) + s2 * __expf(m2 - m);
        mx = m;
    }
    float inv = 1.f / s;
    for (int j8 = lane; j8 * 8 < T; j8 += WARP) {
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (j8 * 8 <= t) {
            unpack8(x[j8], f);
            for (int e = 0; e < 8; e++) f[e] = j8 * 8 + e <= t ? __expf(f[e] * scale - mx) * inv : 0.f;
        }
        y[j8] = pack8(f);
    }
}

// dpreatt[row, j] = scale * att[j] * (datt[j] - sum_k att[k] datt[k]) for
// j <= t (bf16), zeros after; laid out as the forward kernel.
extern "C" __global__ void softmax_causal_backward_bf(bf16* dpreatt, const bf16* datt, const bf16* att,
                                                      int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    const bf8* a = (const bf8*)(att + (long)row * T);
    const bf8* da = (const bf8*)(datt + (long)row * T);
    float dot = 0.f;
    for (int j8 = lane; j8 * 8 <= t; j8 += WARP) {
        float fa[8], fd[8];
        unpack8(a[j8], fa);
        unpack8(da[j8], fd);
        for (int e = 0; e < 8; e++) dot += j8 * 8 + e <= t ? fa[e] * fd[e] : 0.f;
    }
    dot = warp_sum(dot);
    bf8* d = (bf8*)(dpreatt + (long)row * T);
    for (int j8 = lane; j8 * 8 < T; j8 += WARP) {
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (j8 * 8 <= t) {
            float fa[8], fd[8];
            unpack8(a[j8], fa);
            unpack8(da[j8], fd);
            for (int e = 0; e < 8; e++) f[e] = j8 * 8 + e <= t ? scale * fa[e] * (fd[e] - dot) : 0.f;
        }
        d[j8] = pack8(f);
    }
}

// ---- classifier -----------------------------------------------------------------
// In place, one warp per row of V logits (row stride ld, a multiple of 8;
// lanes take 8 consecutive columns at a time): loss[row] = -log
// softmax[target], the row becomes scale * (softmax - onehot) in bf16
// when scale != 0 (target >= V: no loss, zero gradient); the padding
// columns [V, ld) get a zero gradient. One pass for the running max and
// sum, one for the gradient.
extern "C" __global__ void softmax_cross_entropy_bf(bf16* logits, float* losses,
                                                    const unsigned* targets, int N, int V, int ld,
                                                    float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    bf16* l = logits + (long)row * ld;
    bf8* l8 = (bf8*)l;
    float mx = -3.0e38f, s = 0.f;
    for (int j8 = lane; j8 * 8 < V; j8 += WARP) {
        float f[8];
        unpack8(l8[j8], f);
        // One rescale per 8 values (padding past V reads as -inf).
        float m8 = -3.0e38f;
        for (int e = 0; e < 8; e++) {
            if (j8 * 8 + e >= V) f[e] = -3.0e38f;
            m8 = fmaxf(m8, f[e]);
        }
        if (m8 > mx) { s *= __expf(mx - m8); mx = m8; }
        for (int e = 0; e < 8; e++) s += __expf(f[e] - mx);
    }
    for (int o = WARP / 2; o > 0; o /= 2) {
        float m2 = __shfl_xor_sync(0xffffffff, mx, o), s2 = __shfl_xor_sync(0xffffffff, s, o);
        float m = fmaxf(mx, m2);
        s = s * __expf(mx - m) + s2 * __expf(m2 - m);
        mx = m;
    }
    unsigned t = targets[row];
    if (lane == 0) losses[row] = t < (unsigned)V ? -(wide(l[t]) - mx - logf(s)) : 0.f;
    __syncwarp();
    if (scale != 0.f) {
        float inv = 1.f / s;
        for (int j8 = lane; j8 * 8 < ld; j8 += WARP) {
            float f[8];
            unpack8(l8[j8], f);
            for (int e = 0; e < 8; e++) {
                int i = j8 * 8 + e;
                float g = t < (unsigned)V && i < V ? __expf(f[e] - mx) * inv * scale : 0.f;
                if ((unsigned)i == t) g -= scale;
                f[e] = g;
            }
            l8[j8] = pack8(f);
        }
    }
}

// The same with a block of CE_T threads per row and the row held in
// registers between its passes (`BRAID_CE=rows`): the logits read once and
// written once, where the warp per row above reads them twice. Thread t
// owns the 8-value chunks t, t + CE_T, ... (at most CE_J: rows of ld up to
// 8 * CE_J * CE_T values; ld a multiple of 8). The row's maximum and sum
// combine over the warps in warp order (runs repeat bit for bit); the sum
// adds in another order than the warp kernel's, so the bits differ from it.
#define CE_T 1024
#define CE_J 8
extern "C" __global__ void __launch_bounds__(CE_T) softmax_cross_entropy_rows_bf(
    bf16* logits, float* losses, const unsigned* targets, int N, int V, int ld, float scale) {
    constexpr int NW = CE_T / WARP;
    __shared__ float red[2][NW];
    int row = blockIdx.x, tid = threadIdx.x, lane = tid % WARP, w = tid / WARP;
    if (row >= N) return;
    bf8* l8 = (bf8*)(logits + (long)row * ld);
    int chunks = ld / 8;
    bf8 v[CE_J];
    float mx = -3.0e38f;
#pragma unroll
    for (int j = 0; j < CE_J; j++) {
        int c = tid + CE_T * j;
        if (c < chunks) {
            v[j] = l8[c];
            float f[8];
            unpack8(v[j], f);
            for (int e = 0; e < 8; e++)
                if (c * 8 + e < V) mx = fmaxf(mx, f[e]);
        }
    }
    mx = warp_max(mx);
    if (lane == 0) red[0][w] = mx;
    __syncthreads();
    mx = -3.0e38f;
#pragma unroll
    for (int i = 0; i < NW; i++) mx = fmaxf(mx, red[0][i]);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < CE_J; j++) {
        int c = tid + CE_T * j;
        if (c < chunks) {
            float f[8];
            unpack8(v[j], f);
            for (int e = 0; e < 8; e++)
                if (c * 8 + e < V) s += __expf(f[e] - mx);
        }
    }
    s = warp_sum(s);
    if (lane == 0) red[1][w] = s;
    __syncthreads();
    s = 0.f;
#pragma unroll
    for (int i = 0; i < NW; i++) s += red[1][i];
    unsigned t = targets[row];
    bool counted = t < (unsigned)V;
    if (!counted && tid == 0) losses[row] = 0.f;
    float inv = 1.f / s;
#pragma unroll
    for (int j = 0; j < CE_J; j++) {
        int c = tid + CE_T * j;
        if (c >= chunks) continue;
        float f[8];
        unpack8(v[j], f);
        // The target's owner writes the loss from its own copy.
        if (counted && (t >> 3) == (unsigned)c) losses[row] = -(f[t & 7] - mx - logf(s));
        if (scale != 0.f) {
            for (int e = 0; e < 8; e++) {
                int i = c * 8 + e;
                float g = counted && i < V ? __expf(f[e] - mx) * inv * scale : 0.f;
                if ((unsigned)i == t) g -= scale;
                f[e] = g;
            }
            l8[c] = pack8(f);
        }
    }
}

// ---- tensor parallelism: this rank's rows of the vocabulary ----------------------------
// bf16 logits, rows of ld (>= V) values; targets are whole-vocabulary ids,
// this rank holds rows v0 .. v0 + V. One warp per row, as the kernel above.

// mx[row] = the maximum of this rank's V logits.
extern "C" __global__ void vocab_row_max_bf(const bf16* logits, float* mx, int N, int V, int ld) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const bf16* l = logits + (long)row * ld;
    float m = -3.0e38f;
    for (int i = lane; i < V; i += WARP) m = fmaxf(m, wide(l[i]));
    for (int o = WARP / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (lane == 0) mx[row] = m;
}

// After the group's maxima: sums[row] = this rank's sum of exp(l - mx),
// sums[N + row] = its target's l - mx where it holds the target, else 0.
extern "C" __global__ void vocab_row_sums_bf(const bf16* logits, const float* mx, float* sums,
                                             const unsigned* targets, int N, int V, int ld, int v0) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const bf16* l = logits + (long)row * ld;
    float m = mx[row], s = 0.f;
    for (int i = lane; i < V; i += WARP) s += __expf(wide(l[i]) - m);
    s = warp_sum(s);
    if (lane == 0) {
        unsigned k = targets[row] - (unsigned)v0;
        sums[row] = s;
        sums[N + row] = k < (unsigned)V ? wide(l[k]) - m : 0.f;
    }
}

// After the group's sums: loss[row] = log(sum) - (l[t] - mx) over the whole
// vocabulary; with scale != 0 this rank's logits become scale * (softmax -
// onehot), the padding past V zero (target 0xffffffff: no loss, zero
// gradient).
extern "C" __global__ void vocab_softmax_ce_bf(bf16* logits, float* losses, const float* mx,
                                               const float* sums, const unsigned* targets, int N,
                                               int V, int ld, int v0, float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    bf16* l = logits + (long)row * ld;
    unsigned t = targets[row];
    bool counted = t != 0xffffffffu;
    float s = sums[row], m = mx[row];
    if (lane == 0) losses[row] = counted ? logf(s) - sums[N + row] : 0.f;
    __syncwarp();
    if (scale != 0.f) {
        float inv = 1.f / s;
        unsigned k = t - (unsigned)v0;
        for (int i = lane; i < ld; i += WARP) {
            float g = counted && i < V ? __expf(wide(l[i]) - m) * inv * scale : 0.f;
            if (counted && (unsigned)i == k) g -= scale;
            l[i] = narrow(g);
        }
    }
}

// ---- optimizer ----------------------------------------------------------------------
// AdamW over the whole flat parameter buffer in one launch: segment k
// covers [seg_end[k-1], seg_end[k]) with decay seg_wd[k]; the gradient is
// multiplied by gscale (clipping); pb (if not null) gets the bf16 copy.
// One element's update (both kernels below).
__device__ __forceinline__ void adamw_one(float& p, float& m, float& v, float g, float wd, float lr,
                                          float beta1, float beta2, float bc1, float bc2, float eps) {
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    p -= lr * ((m / bc1) / (sqrtf(v / bc2) + eps) + wd * p);
}
// The segment (weight-decay range) element i falls in: the first whose
// end is past i, by bisection over the `nseg` ends.
__device__ __forceinline__ int segment_of(const long* seg_end, int nseg, long i) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (seg_end[mid] > i) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Element i of the flat buffers, in place (and its bf16 copy when pb).
__device__ __forceinline__ void adamw_at(float* p, bf16* pb, const float* g, float* m, float* v, long i,
                                         float wd, float lr, float beta1, float beta2, float bc1,
                                         float bc2, float eps, float gscale) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_one(pi, mi, vi, g[i] * gscale, wd, lr, beta1, beta2, bc1, bc2, eps);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (pb) pb[i] = narrow(pi);
}

extern "C" __global__ void adamw_multi(float* p, bf16* pb, const float* g, float* m, float* v, long n,
                                       const long* seg_end, const float* seg_wd, int nseg, float lr,
                                       float beta1, float beta2, float bc1, float bc2, float eps,
                                       float gscale) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    adamw_at(p, pb, g, m, v, i, seg_wd[segment_of(seg_end, nseg, i)], lr, beta1, beta2, bc1, bc2, eps,
             gscale);
}

// The same update, four elements per thread through 16-byte loads and
// stores (the launcher takes it when every buffer is 16-byte aligned, the
// bf16 copy 8-byte): one segment search per four elements, then a step to
// the next segment where one ends inside them. The scalar kernel moved
// 2.56 TB/s on an H200 (30 bytes per parameter, 31 ms at 2.65B).
extern "C" __global__ void adamw_multi4(float* p, bf16* pb, const float* g, float* m, float* v, long n,
                                        const long* seg_end, const float* seg_wd, int nseg, float lr,
                                        float beta1, float beta2, float bc1, float bc2, float eps,
                                        float gscale) {
    long i0 = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= n) return;
    int lo = segment_of(seg_end, nseg, i0);
    if (i0 + 4 <= n) {
        float4 P = *(const float4*)(p + i0), G = *(const float4*)(g + i0);
        float4 M = *(const float4*)(m + i0), V = *(const float4*)(v + i0);
        float pp[4] = {P.x, P.y, P.z, P.w}, gg[4] = {G.x, G.y, G.z, G.w};
        float mm[4] = {M.x, M.y, M.z, M.w}, vv[4] = {V.x, V.y, V.z, V.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            while (seg_end[lo] <= i0 + e) lo++;
            adamw_one(pp[e], mm[e], vv[e], gg[e] * gscale, seg_wd[lo], lr, beta1, beta2, bc1, bc2, eps);
        }
        *(float4*)(p + i0) = make_float4(pp[0], pp[1], pp[2], pp[3]);
        *(float4*)(m + i0) = make_float4(mm[0], mm[1], mm[2], mm[3]);
        *(float4*)(v + i0) = make_float4(vv[0], vv[1], vv[2], vv[3]);
        if (pb) {
            unsigned lo2 = narrow(pp[0]) | ((unsigned)narrow(pp[1]) << 16);
            unsigned hi2 = narrow(pp[2]) | ((unsigned)narrow(pp[3]) << 16);
            *(uint2*)(pb + i0) = make_uint2(lo2, hi2);
        }
        return;
    }
    for (long i = i0; i < n; i++) {
        while (seg_end[lo] <= i) lo++;
        adamw_at(p, pb, g, m, v, i, seg_wd[lo], lr, beta1, beta2, bc1, bc2, eps, gscale);
    }
}

// bias_partial_bf with 8 columns per thread (one 16-byte word; C % 8 ==
// 0): blocks of 32 x 8 threads cover 256 columns, and each column is
// summed over the same rows in the same order, so the partials are the
// same bits.
extern "C" __global__ void bias_partial_bf8(float* __restrict__ partial, const bf8* __restrict__ dout,
                                           int N, int C, int rpb) {
    __shared__ float sh[8][256];
    int tx = threadIdx.x, ty = threadIdx.y;
    int col = blockIdx.x * 256 + tx * 8;
    int start = blockIdx.y * rpb, end = min(start + rpb, N);
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (col < C)
        for (int r = start + ty; r < end; r += 8) {
            float f[8];
            unpack8(dout[((long)r * C + col) / 8], f);
            for (int e = 0; e < 8; e++) a[e] += f[e];
        }
    for (int e = 0; e < 8; e++) sh[ty][tx * 8 + e] = a[e];
    __syncthreads();
    if (ty != 0 || col >= C) return;
    for (int e = 0; e < 8; e++) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += sh[k][tx * 8 + e];
        partial[(long)blockIdx.y * C + col + e] = t;
    }
}

// ---- MLP backward -----------------------------------------------------------
// out (when not null) = gelu(pre), recomputed for the output projection's
// weight gradient instead of kept from the forward pass (the pre-activation
// is read here anyway, so this costs one write); and
// dx (bf16, in place) = dx * gelu'(pre), fused with the column sums of the
// result (the MLP's bias gradient, over the bf16 values the products use):
// grid (ceil(C / 256), row chunks of rpb), blocks of 8 row lanes x 32
// threads, each thread 8 columns (one 16-byte word), each row lane taking
// every 8th row of the chunk in order; partial[chunk][col] sums the 8
// lanes in order.
// `out` may be `pre` itself (the GELU written over the pre-activation it
// came from, read here for the last time): each element is read before the
// thread writes it, so neither is `__restrict__`.
extern "C" __global__ void gelu_backward_bias_bf(bf8* __restrict__ dx, const bf8* pre,
                                                 float* __restrict__ partial, bf8* out,
                                                 int N, int C, int rpb) {
    __shared__ float red[8][256];
    int tc = threadIdx.x % 32, rl = threadIdx.x / 32;
    int col = blockIdx.x * 256 + tc * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int end = min((blockIdx.y + 1) * rpb, N);
    // One row's 8 values: the GELU (when kept), dx * gelu', and the sum.
    auto row = [&](long i, bf8 dv, bf8 pv) {
        float g[8], x[8], s[8];
        unpack8(dv, g);
        unpack8(pv, x);
        for (int e = 0; e < 8; e++) s[e] = gelu_sig(x[e]);
        if (out) {
            float y[8];
            for (int e = 0; e < 8; e++) y[e] = x[e] * s[e];
            out[i] = pack8(y);
        }
        for (int e = 0; e < 8; e++) g[e] *= gelu_grad_sig(x[e], s[e]);
        bf8 o = pack8(g);
        dx[i] = o;
        unpack8(o, g);
        for (int e = 0; e < 8; e++) acc[e] += g[e];
    };
    if (col < C) {
        // Two rows per step (both loads in flight first), in row order.
        int r = blockIdx.y * rpb + rl;
        for (; r + 8 < end; r += 16) {
            long i = ((long)r * C + col) / 8, j = ((long)(r + 8) * C + col) / 8;
            bf8 d0 = dx[i], p0 = pre[i], d1 = dx[j], p1 = pre[j];
            row(i, d0, p0);
            row(j, d1, p1);
        }
        if (r < end) {
            long i = ((long)r * C + col) / 8;
            row(i, dx[i], pre[i]);
        }
    }
    for (int e = 0; e < 8; e++) red[rl][tc * 8 + e] = acc[e];
    __syncthreads();
    int c = blockIdx.x * 256 + threadIdx.x;
    if (threadIdx.x < 256 && c < C) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += red[k][threadIdx.x];
        partial[(long)blockIdx.y * C + c] = t;
    }
}

// ---- skinny products (decode steps of few rows) ---------------------------
// y[m, n] = x[m, :] . W[:, n] + bias[n] for M <= R rows (R, the kernel's
// instance, 1, 2, 4 or 8): x bf16 [M, K], W bf16 [K, N] row-major (the
// weights' bf16 copy), bias f32 [N]; N and K multiples of 8, x and W
// 16-byte aligned (the caller checks). Block (b, s) of SK_WARPS warps takes
// the tile of CL * 8 columns b and the rows s * Ks .. (s + 1) * Ks of W (S
// splits of K): lane (cl, kl) holds columns c0 .. c0 + 8 (one 16-byte load
// of a weight row) and takes the rows kl + (WARP / CL) * (w + SK_WARPS * i)
// of its split, SK_UNROLL of them (and their x elements) loaded before any
// is used, rows past the split or M predicated to zero rather than
// branched around. A block's sums are reduced in a fixed order (the lanes
// of a column by shuffles, the warps in order through shared memory); with
// S > 1 each split's sums go to partials[s][M][N], and the tile's last
// block to finish (its counter, reset after) adds the splits in order
// 0 .. S-1. So a row's result depends on neither the other rows nor the
// timing. Epilogue (mode) 0: out = y (f32); 1: out = y + res (f32); 2:
// outb = bf16(gelu(y)).
#define SK_ROWS 8
#define SK_WARPS 8
#define SK_UNROLL 8

__device__ __forceinline__ void skinny_store(float* out, bf16* outb, const float* res, int mode,
                                             long at, float y) {
    if (mode == 2) {
        outb[at] = narrow(gelu(y));
    } else {
        out[at] = mode == 1 ? y + res[at] : y;
    }
}

template <int R>
__device__ void skinny_body(float* out, bf16* outb, const float* res, const bf16* x,
                            const bf16* W, const float* bias, int M, int N, int K, int CL,
                            int mode, float* partials, unsigned* counters, int S, int Ks) {
    __shared__ float part[SK_WARPS][R][64];
    __shared__ bool last;
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int cl = lane % CL, kl = lane / CL, KL = WARP / CL, TN = CL * 8;
    int c0 = blockIdx.x * TN + cl * 8;
    int kbeg = blockIdx.y * Ks, kend = min(K, kbeg + Ks);
    bool in = c0 < N;
    float acc[R][8];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[r][e] = 0.f;
    int kstep = KL * SK_WARPS;
    // Launched overlapping the kernel ahead: this block's weights (which
    // nothing writes) on their way into L2 while that kernel finishes,
    // the lanes at both ends of a row's 128 bytes each asking for their
    // line (a row of the tile may straddle two).
    if (in && (cl == 0 || cl == CL - 1))
        for (int k = kbeg + kl + KL * w; k < kend; k += kstep)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(W + (long)k * N + c0));
    overlap_wait();
    overlap_release();
    for (int k0 = kbeg + kl + KL * w; k0 < kend; k0 += SK_UNROLL * kstep) {
        uint4 wv[SK_UNROLL];
        float xv[SK_UNROLL][R];
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
            int k = k0 + u * kstep;
            bool ok = in && k < kend;
            wv[u] = ok ? *reinterpret_cast<const uint4*>(W + (long)k * N + c0)
                       : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < R; r++) xv[u][r] = ok && r < M ? wide(x[(long)r * K + k]) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SK_UNROLL; u++) {
            unsigned ws[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float a = lo(ws[q]), b = hi(ws[q]);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    acc[r][2 * q] += xv[u][r] * a;
                    acc[r][2 * q + 1] += xv[u][r] * b;
                }
            }
        }
    }
    // The lanes of a column group (every lane takes part).
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float v = acc[r][e];
            for (int o = CL; o < WARP; o *= 2) v += __shfl_xor_sync(0xffffffff, v, o);
            acc[r][e] = v;
        }
    if (kl == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int e = 0; e < 8; e++) part[w][r][cl * 8 + e] = acc[r][e];
    }
    __syncthreads();
    if (S == 1) {
        for (int t = threadIdx.x; t < M * TN; t += blockDim.x) {
            int r = t / TN, j = t % TN, col = blockIdx.x * TN + j;
            if (col >= N) continue;
            float y = 0.f;
            for (int q = 0; q < SK_WARPS; q++) y += part[q][r][j];
            skinny_store(out, outb, res, mode, (long)r * N + col, y + bias[col]);
        }
        return;
    }
    // This split's sums out, then the tile's last block adds the splits.
    for (int t = threadIdx.x; t < M * TN; t += blockDim.x) {
        int r = t / TN, j = t % TN, col = blockIdx.x * TN + j;
        if (col >= N) continue;
        float y = 0.f;
        for (int q = 0; q < SK_WARPS; q++) y += part[q][r][j];
        partials[((long)blockIdx.y * M + r) * N + col] = y;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)(S - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x; t < M * TN; t += blockDim.x) {
        int r = t / TN, j = t % TN, col = blockIdx.x * TN + j;
        if (col >= N) continue;
        float y = 0.f;
        for (int q = 0; q < S; q++) y += __ldcg(&partials[((long)q * M + r) * N + col]);
        skinny_store(out, outb, res, mode, (long)r * N + col, y + bias[col]);
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next product
}

#define SKINNY(R)                                                                               \
    extern "C" __global__ void skinny_gemm_bf_##R(                                              \
        float* out, bf16* outb, const float* res, const bf16* x, const bf16* W,                 \
        const float* bias, int M, int N, int K, int CL, int mode, float* partials,              \
        unsigned* counters, int S, int Ks) {                                                    \
        skinny_body<R>(out, outb, res, x, W, bias, M, N, K, CL, mode, partials, counters, S,    \
                       Ks);                                                                     \
    }
SKINNY(1)
SKINNY(2)
SKINNY(4)
SKINNY(8)

// ---- products of few rows against weights stored output by output --------
// y[m, n] = x[m, :] . W[n, :] (+ bias[n]) for M <= R rows (R, the
// instance: 1, 2, 4 or 8): x bf16 [M, K], W bf16 [N, K] row-major (the
// decoder's transposed copy of a layer's weights, or the tied embedding for
// the logits), K a multiple of 8, x and W 16-byte aligned (the caller
// checks). A block of NT_WARPS warps takes groups of outputs in turn
// (blockIdx.x, then every gridDim.x-th: one each where the grid covers
// them): KW warps (a power of two) split K, NT_WARPS / KW split the
// group's outputs, each warp taking NT_OUT outputs of its slice of K;
// lane l takes the slice's elements 8 l + 8 WARP i (one 16-byte load of a
// weight row, and of each x row, per i), two i at a time. A warp's lanes
// are summed by a fixed butterfly and the KW warps of an output in order
// through shared memory, so a row's result depends on neither the other
// rows nor the timing. Before waiting for the kernel ahead (overlapped
// launches) the block asks for its weights into L2 as `how` says.
// Epilogue (mode) 0: out = y + bias; 1: out = y + bias + res; 2: outb =
// bf16(gelu(y + bias)); 3: as 0, and the keys and values (outputs C to 3C
// of a QKV product) into the paged cache too (NtCache); bias null: no bias.
#define NT_WARPS 8
#define NT_OUT 2

// How an NT product starts (the kernels' last argument, bits; 0 the
// default): NT_RELEASE_FIRST lets the kernel behind start before this one
// waits (else after); NT_BULK_PREFETCH asks for the weights into L2 by the
// copy engine, a few requests a group (else a request a 128-byte line);
// NT_NO_PREFETCH asks for nothing ahead. None changes a sum.
#define NT_RELEASE_FIRST 1
#define NT_BULK_PREFETCH 2
#define NT_NO_PREFETCH 4

// Asks for the block's weight rows into L2 (before waiting for the kernel
// ahead: nothing writes them): those of every group of outputs it takes.
__device__ __forceinline__ void nt_prefetch(const bf16* W, int N, int K, int KW, int how) {
    if (how & NT_NO_PREFETCH) return;
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int per_block = NT_OUT * (NT_WARPS / KW), groups = (N + per_block - 1) / per_block;
    if (how & NT_BULK_PREFETCH) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // A group's weight rows are contiguous: a piece of them a warp,
        // each a multiple of 16 bytes (K is a multiple of 8).
        if (lane != 0) return;
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            long first = (long)g * per_block, rows = min((long)per_block, (long)N - first);
            long bytes = rows * K * 2, piece = (bytes / NT_WARPS + 15) / 16 * 16;
            long from = w * piece, len = min(piece, bytes - from);
            if (len > 0)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                                 reinterpret_cast<const char*>(W + first * K) + from),
                             "r"((unsigned)len)
                             : "memory");
        }
#endif
        return;
    }
    int Ks = (K / KW + 7) / 8 * 8;
    int kbeg = (w % KW) * Ks, kend = min(K, kbeg + Ks);
    for (int g = blockIdx.x; g < groups; g += gridDim.x) {
        int n0 = (g * (NT_WARPS / KW) + w / KW) * NT_OUT;
#pragma unroll
        for (int o = 0; o < NT_OUT; o++)
            if (n0 + o < N)
                for (int k = kbeg + 64 * lane; k < kend; k += 64 * WARP)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(W + (long)(n0 + o) * K + k));
    }
}

// The start of an NT product, as `how` says: the prefetch, the wait for
// the kernel ahead, the release of the kernel behind.
__device__ __forceinline__ void nt_start(const bf16* W, int N, int K, int KW, int how) {
    if (how & NT_RELEASE_FIRST) overlap_release();
    nt_prefetch(W, N, K, KW, how);
    overlap_wait();
    if (!(how & NT_RELEASE_FIRST)) overlap_release();
}

// Where the QKV product's epilogue (mode 3) also writes each row's key and
// value: the paged cache's keys k and values v (bf16 when bf16 is set,
// else f32), row r's slot slots[r]; by kv.cu's kv_store, as kv_write.
struct NtCache {
    void* k;
    void* v;
    const int* slots;
    int bf16;
};

// y, the output n of row r of a QKV product of N = 3C outputs (q, k, v),
// into the cache where it is a key's or a value's.
__device__ __forceinline__ void nt_cache_store(NtCache c, int r, int n, int N, float y) {
    int C = N / 3;
    if (n < C) return;
    long at = (long)c.slots[r] * C + n % C;
    void* to = n < 2 * C ? c.k : c.v;
    if (c.bf16)
        kv_store((unsigned short*)to, at, y);
    else
        kv_store((float*)to, at, y);
}

// One group of outputs: NT_WARPS / KW warps of NT_OUT outputs.
template <int R>
__device__ void nt_group(int g, float* out, bf16* outb, const float* res, const bf16* x,
                         const bf16* W, const float* bias, int M, int N, int K, int KW,
                         int mode, NtCache cache) {
    __shared__ float part[NT_WARPS][R][NT_OUT];
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int kw = w % KW, nw = w / KW;
    int n0 = (g * (NT_WARPS / KW) + nw) * NT_OUT;
    int Ks = (K / KW + 7) / 8 * 8;
    int kbeg = kw * Ks, kend = min(K, kbeg + Ks);
    float acc[NT_OUT][R];
#pragma unroll
    for (int o = 0; o < NT_OUT; o++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[o][r] = 0.f;
    for (int k0 = kbeg + 8 * lane; k0 < kend; k0 += 2 * 8 * WARP) {
        uint4 wv[2][NT_OUT];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int k = k0 + u * 8 * WARP;
#pragma unroll
            for (int o = 0; o < NT_OUT; o++)
                wv[u][o] = k < kend && n0 + o < N
                               ? *reinterpret_cast<const uint4*>(W + (long)(n0 + o) * K + k)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int k = k0 + u * 8 * WARP;
            if (k >= kend) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= M) break;
                uint4 xr = *reinterpret_cast<const uint4*>(x + (long)r * K + k);
                unsigned xs[4] = {xr.x, xr.y, xr.z, xr.w};
#pragma unroll
                for (int o = 0; o < NT_OUT; o++) {
                    unsigned ws[4] = {wv[u][o].x, wv[u][o].y, wv[u][o].z, wv[u][o].w};
                    float a = acc[o][r];
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        a += lo(xs[q]) * lo(ws[q]);
                        a += hi(xs[q]) * hi(ws[q]);
                    }
                    acc[o][r] = a;
                }
            }
        }
    }
#pragma unroll
    for (int o = 0; o < NT_OUT; o++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = warp_sum(acc[o][r]);
            if (lane == 0) part[w][r][o] = v;
        }
    __syncthreads();
    // One thread per (output warp, row, output): the KW slices in order.
    int t = threadIdx.x, per = R * NT_OUT;
    if (t >= (NT_WARPS / KW) * per) return;
    int nw2 = t / per, r = (t % per) / NT_OUT, o = t % NT_OUT;
    int n = (g * (NT_WARPS / KW) + nw2) * NT_OUT + o;
    if (r >= M || n >= N) return;
    float y = 0.f;
    for (int q = 0; q < KW; q++) y += part[nw2 * KW + q][r][o];
    if (bias) y += bias[n];
    skinny_store(out, outb, res, mode, (long)r * N + n, y);
    if (mode == 3) nt_cache_store(cache, r, n, N, y);
}

// The product and its epilogue (after the wait); x may be in shared memory.
// Block b takes the groups of outputs b, b + gridDim.x, ... (one group per
// block where the grid covers them), each whole before the next.
template <int R>
__device__ void nt_main(float* out, bf16* outb, const float* res, const bf16* x, const bf16* W,
                        const float* bias, int M, int N, int K, int KW, int mode, NtCache cache) {
    int per_block = NT_OUT * (NT_WARPS / KW), groups = (N + per_block - 1) / per_block;
    for (int g = blockIdx.x; g < groups; g += gridDim.x) {
        nt_group<R>(g, out, outb, res, x, W, bias, M, N, K, KW, mode, cache);
        __syncthreads();  // part read by every thread before the next group
    }
}

// xf[i], read through L2 where CG says (rows other blocks of the grid
// wrote), else as any load.
template <bool CG>
__device__ __forceinline__ float ln_in(const float* xf, long i) {
    return CG ? __ldcg(xf + i) : xf[i];
}

// LayerNorm(xf) of M rows of K (scale lw, shift lb, epsilon 1e-5) into
// bf16 xs (shared or global memory), every thread of the block taking
// part: two passes over a row (its mean, then the squares about it, each
// summed by thread in order, then over the warps in order), as
// ln_forward's do, the rows going through each pass together (two barriers
// whatever M is). CG: xf read through L2 (nt_tail_ln's).
template <int R, bool CG = false>
__device__ void nt_ln_rows(const float* xf, const float* lw, const float* lb, bf16* xs, int M,
                           int K) {
    __shared__ float red[2][R][NT_WARPS];
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    float mean[R], rs[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = 0.f;
        if (r < M)
            for (int k = threadIdx.x; k < K; k += blockDim.x) s += ln_in<CG>(xf, (long)r * K + k);
        s = warp_sum(s);
        if (lane == 0) red[0][r][w] = s;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < NT_WARPS; i++) s += red[0][r][i];
        mean[r] = s / K;
        float v = 0.f;
        if (r < M)
            for (int k = threadIdx.x; k < K; k += blockDim.x) {
                float d = ln_in<CG>(xf, (long)r * K + k) - mean[r];
                v += d * d;
            }
        v = warp_sum(v);
        if (lane == 0) red[1][r][w] = v;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < NT_WARPS; i++) v += red[1][r][i];
        rs[r] = rsqrtf(v / K + 1e-5f);
        if (r < M)
            for (int k = threadIdx.x; k < K; k += blockDim.x)
                xs[(long)r * K + k] =
                    narrow((ln_in<CG>(xf, (long)r * K + k) - mean[r]) * rs[r] * lw[k] + lb[k]);
    }
    __syncthreads();
}

// The LayerNorm the next product reads, done by this product's grid
// (nt_tail_ln): a counter zero between products (the last block resets
// it), the LayerNorm's scale and shift, and its bf16 output. counter null:
// none.
struct NtTail {
    unsigned* counter;
    const float* lw;
    const float* lb;
    bf16* out;
};

// After an f32 product (modes 0 and 1): the grid's last block to finish
// normalises the product's M rows of N (every block's outputs, read
// through L2) into t.out, so the LayerNorm after it needs no kernel of
// its own. Each block makes its outputs visible before it counts itself
// done (as the skinny kernel's splits do); the kernel behind waits for
// the whole grid, tail included.
template <int R>
__device__ void nt_tail_ln(const float* y, int M, int N, NtTail t) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(t.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    nt_ln_rows<R, true>(y, t.lw, t.lb, t.out, M, N);
    if (threadIdx.x == 0) *t.counter = 0;  // ready for the next product
}

template <int R>
__device__ void nt_body(float* out, bf16* outb, const float* res, const bf16* x, const bf16* W,
                        const float* bias, int M, int N, int K, int KW, int mode, int how,
                        NtCache cache, NtTail tail) {
    nt_start(W, N, K, KW, how);
    nt_main<R>(out, outb, res, x, W, bias, M, N, K, KW, mode, cache);
    if (tail.counter) nt_tail_ln<R>(out, M, N, tail);
}

// The same product of the LayerNorm of f32 rows: every block normalises
// the M rows of xf itself (nt_ln_rows, into M * K bf16 of dynamic shared
// memory), then multiplies them: the LayerNorm's own kernel and its
// launch saved.
template <int R>
__device__ void nt_ln_body(float* out, bf16* outb, const float* res, const float* xf,
                           const float* lw, const float* lb, const bf16* W, const float* bias,
                           int M, int N, int K, int KW, int mode, int how, NtCache cache,
                           NtTail tail) {
    extern __shared__ bf16 xs[];
    nt_start(W, N, K, KW, how);
    nt_ln_rows<R>(xf, lw, lb, xs, M, K);
    nt_main<R>(out, outb, res, xs, W, bias, M, N, K, KW, mode, cache);
    if (tail.counter) nt_tail_ln<R>(out, M, N, tail);
}

#define NT_PRODUCT(R)                                                                           \
    extern "C" __global__ void nt_gemm_bf_##R(float* out, bf16* outb, const float* res,         \
                                              const bf16* x, const bf16* W, const float* bias,  \
                                              int M, int N, int K, int KW, int mode, int how,   \
                                              void* kc, void* vc, const int* slots, int kvb,    \
                                              unsigned* tc, const float* tlw, const float* tlb, \
                                              bf16* tout) {                                     \
        nt_body<R>(out, outb, res, x, W, bias, M, N, K, KW, mode, how,                          \
                   NtCache{kc, vc, slots, kvb}, NtTail{tc, tlw, tlb, tout});                    \
    }
NT_PRODUCT(1)
NT_PRODUCT(2)
NT_PRODUCT(4)
NT_PRODUCT(8)

#define NT_LN_PRODUCT(R)                                                                        \
    extern "C" __global__ void nt_ln_gemm_bf_##R(                                               \
        float* out, bf16* outb, const float* res, const float* xf, const float* lw,             \
        const float* lb, const bf16* W, const float* bias, int M, int N, int K, int KW,         \
        int mode, int how, void* kc, void* vc, const int* slots, int kvb, unsigned* tc,         \
        const float* tlw, const float* tlb, bf16* tout) {                                       \
        nt_ln_body<R>(out, outb, res, xf, lw, lb, W, bias, M, N, K, KW, mode, how,              \
                      NtCache{kc, vc, slots, kvb}, NtTail{tc, tlw, tlb, tout});                 \
    }
NT_LN_PRODUCT(1)
NT_LN_PRODUCT(2)
NT_LN_PRODUCT(4)
NT_LN_PRODUCT(8)

// ---- a layer's MLP half in one kernel (few rows) --------------------------
// The attention's projection with the residual, LayerNorm 2, the MLP's
// first product with its GELU and its second with the residual, as one
// kernel whose blocks meet at two grid-wide barriers instead of four
// kernels that each wait for the one ahead. Every block asks for its share
// of the next product's weights into L2 before it arrives at a barrier,
// so the weights stream while the slowest block finishes. The sums are
// the NT products' (nt_group: the same groups of outputs, each whole in
// one block) and the LayerNorm nt_ln_rows', so the results do not depend
// on the grid.
//
// The grid must be resident at once (one block a multiprocessor at most:
// the launcher's rule), and `bar` two counters that are zero at launch;
// the last block out sets them to zero again. A barrier that waits far
// longer than any step traps, so a grid that cannot all be resident is an
// error, not a hang.

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Waits until `want` arrivals (gridDim.x a barrier) are counted in bar[0].
__device__ void grid_barrier(unsigned* bar, unsigned want) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&bar[0], 1u);
        long spins = 0;
        while (load_acquire(&bar[0]) < want) {
            __nanosleep(64);
            if (++spins > (1L << 26)) asm volatile("trap;");
        }
        __threadfence();
    }
    __syncthreads();
}

// The last block out sets both counters to zero for the next launch.
__device__ void grid_leave(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&bar[1], 1u) == gridDim.x - 1) {
            atomicExch(&bar[0], 0u);
            atomicExch(&bar[1], 0u);
        }
    }
}

// att bf16 [M, C] (the attention's output), x f32 [M, C] (the residual
// stream in); x2 f32 [M, C] = att . Wp + bp + x; h bf16 [M, F] =
// gelu(LayerNorm(x2) . Wf + bf); out f32 [M, C] = h . Wo + bo + x2.
// Weights [out, in]; kw the products' splits of K (nt_split's).
template <int R>
__device__ void nt_mlp_body(float* x2, bf16* h, float* out, const bf16* att, const float* x,
                            const bf16* Wp, const float* bp, const float* lw, const float* lb,
                            const bf16* Wf, const float* bf, const bf16* Wo, const float* bo,
                            unsigned* bar, int M, int C, int F, int kwp, int kwf, int kwo) {
    extern __shared__ bf16 xs[];
    NtCache none = {nullptr, nullptr, nullptr, 0};
    nt_start(Wp, C, C, kwp, NT_RELEASE_FIRST | NT_BULK_PREFETCH);
    nt_main<R>(x2, nullptr, x, att, Wp, bp, M, C, C, kwp, 1, none);
    nt_prefetch(Wf, F, C, kwf, NT_BULK_PREFETCH);
    grid_barrier(bar, gridDim.x);
    nt_ln_rows<R>(x2, lw, lb, xs, M, C);
    nt_main<R>(nullptr, h, nullptr, xs, Wf, bf, M, F, C, kwf, 2, none);
    nt_prefetch(Wo, C, F, kwo, NT_BULK_PREFETCH);
    grid_barrier(bar, 2 * gridDim.x);
    nt_main<R>(out, nullptr, x2, h, Wo, bo, M, C, F, kwo, 1, none);
    grid_leave(bar);
}

#define NT_MLP(R)                                                                               \
    extern "C" __global__ void nt_mlp_bf_##R(                                                   \
        float* x2, bf16* h, float* out, const bf16* att, const float* x, const bf16* Wp,        \
        const float* bp, const float* lw, const float* lb, const bf16* Wf, const float* bf,     \
        const bf16* Wo, const float* bo, unsigned* bar, int M, int C, int F, int kwp, int kwf,  \
        int kwo) {                                                                              \
        nt_mlp_body<R>(x2, h, out, att, x, Wp, bp, lw, lb, Wf, bf, Wo, bo, bar, M, C, F, kwp,   \
                       kwf, kwo);                                                               \
    }
NT_MLP(1)
NT_MLP(2)
NT_MLP(4)
NT_MLP(8)

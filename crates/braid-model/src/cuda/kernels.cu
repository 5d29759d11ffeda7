// braid's model kernels (f32), compiled at run time by NVRTC.
// Each mirrors a CPU kernel in src/cpu and is checked against it.
// Reductions are deterministic (fixed order per output, no atomics), so a
// GPU run repeats bit for bit too.

// (WARP, warp_sum and warp_max come first, from warps.cu.)

// out[n, c] = wte[tokens[n], c] + wpe[n % T, c]
extern "C" __global__ void encoder_forward(float* out, const unsigned* tokens, const float* wte,
                                           const float* wpe, int N, int T, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    out[i] = wte[(long)tokens[n] * C + c] + wpe[(long)(n % T) * C + c];
}

// dwpe[t, c] += sum_b dout[b*T + t, c]   (one thread per (t, c); fixed order)
extern "C" __global__ void encoder_backward_wpe(float* dwpe, const float* dout, int N, int T, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)T * C) return;
    int t = i / C, c = i % C;
    float s = 0.f;
    for (int n = t; n < N; n += T) s += dout[(long)n * C + c];
    dwpe[i] += s;
}

// dwte[v, c] += sum over positions n with tokens[n] == v of dout[n, c].
// `order` lists positions sorted by token (stable) and `starts[v]..starts[v+1]`
// its range for token v: one thread per (v, c) sums in position order.
extern "C" __global__ void encoder_backward_wte(float* dwte, const float* dout, const int* order,
                                                const int* starts, int V, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)V * C) return;
    int v = i / C, c = i % C;
    int a = starts[v], b = starts[v + 1];
    if (a == b) return;
    float s = 0.f;
    for (int k = a; k < b; k++) s += dout[(long)order[k] * C + c];
    dwte[i] += s;
}

// One warp per row: out = (x - mean) * rstd * w + b.
extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                             const float* w, const float* b, int N, int C) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* x = inp + (long)row * C;
    float s = 0.f;
    for (int i = lane; i < C; i += WARP) s += x[i];
    float m = warp_sum(s) / C;
    float v = 0.f;
    for (int i = lane; i < C; i += WARP) { float d = x[i] - m; v += d * d; }
    float rs = rsqrtf(warp_sum(v) / C + 1e-5f);
    float* o = out + (long)row * C;
    for (int i = lane; i < C; i += WARP) o[i] = (x[i] - m) * rs * w[i] + b[i];
    if (lane == 0) { mean[row] = m; rstd[row] = rs; }
}

// dinp += per-row LayerNorm backward (one warp per row).
extern "C" __global__ void layernorm_backward_inp(float* dinp, const float* dout, const float* inp,
                                                  const float* w, const float* mean, const float* rstd,
                                                  int N, int C) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* x = inp + (long)row * C;
    const float* dy = dout + (long)row * C;
    float m = mean[row], rs = rstd[row];
    float a = 0.f, b = 0.f;
    for (int i = lane; i < C; i += WARP) {
        float dn = w[i] * dy[i];
        a += dn;
        b += dn * (x[i] - m) * rs;
    }
    a = warp_sum(a) / C;
    b = warp_sum(b) / C;
    float* d = dinp + (long)row * C;
    for (int i = lane; i < C; i += WARP) {
        float norm = (x[i] - m) * rs;
        d[i] += (w[i] * dy[i] - a - norm * b) * rs;
    }
}

// dw[c] += sum_n norm[n,c] * dout[n,c]; db[c] += sum_n dout[n,c]
// (one thread per column, rows in order).
extern "C" __global__ void layernorm_backward_params(float* dw, float* db, const float* dout,
                                                     const float* inp, const float* mean,
                                                     const float* rstd, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sw = 0.f, sb = 0.f;
    for (int n = 0; n < N; n++) {
        float dy = dout[(long)n * C + c];
        sw += (inp[(long)n * C + c] - mean[n]) * rstd[n] * dy;
        sb += dy;
    }
    dw[c] += sw;
    db[c] += sb;
}

#define GELU_S 0.7978845608028654f

extern "C" __global__ void gelu_forward(float* out, const float* inp, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = inp[i];
    out[i] = 0.5f * x * (1.f + tanhf(GELU_S * (x + 0.044715f * x * x * x)));
}

extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = inp[i];
    float th = tanhf(GELU_S * (x + 0.044715f * x * x * x));
    float sech2 = 1.f - th * th;
    float local = 0.5f * (1.f + th) + x * 0.5f * sech2 * GELU_S * (1.f + 3.f * 0.044715f * x * x);
    dinp[i] += local * dout[i];
}

// out = a + b
extern "C" __global__ void residual_forward(float* out, const float* a, const float* b, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// In place, one warp per row of V logits: loss[row] = -log softmax[target];
// logits become scale * (softmax - onehot) when scale != 0 (target ==
// 0xffffffff: no loss, zero gradient).
extern "C" __global__ void softmax_cross_entropy(float* logits, float* losses, const unsigned* targets,
                                                 int N, int V, float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    float* l = logits + (long)row * V;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int i = lane; i < V; i += WARP) mx = fmaxf(mx, l[i]);
    mx = warp_max(mx);
    float s = 0.f;
    for (int i = lane; i < V; i += WARP) s += expf(l[i] - mx);
    s = warp_sum(s);
    unsigned t = targets[row];
    if (lane == 0) losses[row] = t < (unsigned)V ? -(l[t] - mx - logf(s)) : 0.f;
    __syncwarp();
    if (scale != 0.f) {
        float inv = 1.f / s;
        for (int i = lane; i < V; i += WARP) {
            float g = t < (unsigned)V ? expf(l[i] - mx) * inv * scale : 0.f;
            if ((unsigned)i == t) g -= scale;
            l[i] = g;
        }
    }
}

// ---- tensor parallelism: this rank's rows of the vocabulary -------------
// (tokens and targets are whole-vocabulary ids; the rank holds rows
// v0 .. v0 + V.)

// out[n, c] = (v0 <= tokens[n] < v0 + V ? wte[tokens[n] - v0, c] : 0)
//           + (with_wpe ? wpe[n % T, c] : 0): this rank's share, summed over
// the group afterwards (one rank adds the position embedding).
extern "C" __global__ void encoder_forward_part(float* out, const unsigned* tokens, const float* wte,
                                                const float* wpe, int N, int T, int C, int v0, int V,
                                                int with_wpe) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    unsigned k = tokens[n] - (unsigned)v0;
    float x = k < (unsigned)V ? wte[(long)k * C + c] : 0.f;
    if (with_wpe) x += wpe[(long)(n % T) * C + c];
    out[i] = x;
}

// One warp per row of this rank's V logits: mx[row] = their maximum.
extern "C" __global__ void vocab_row_max(const float* logits, float* mx, int N, int V) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* l = logits + (long)row * V;
    float m = __int_as_float(0xff800000);  // -inf
    for (int i = lane; i < V; i += WARP) m = fmaxf(m, l[i]);
    m = warp_max(m);
    if (lane == 0) mx[row] = m;
}

// One warp per row, after the group's maximum mx: sums[row] = this rank's
// sum of exp(l - mx); sums[N + row] = its target's l - mx where this rank
// holds the target, else 0 (both summed over the group afterwards).
extern "C" __global__ void vocab_row_sums(const float* logits, const float* mx, float* sums,
                                          const unsigned* targets, int N, int V, int v0) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    const float* l = logits + (long)row * V;
    float m = mx[row];
    float s = 0.f;
    for (int i = lane; i < V; i += WARP) s += expf(l[i] - m);
    s = warp_sum(s);
    if (lane == 0) {
        unsigned k = targets[row] - (unsigned)v0;
        sums[row] = s;
        sums[N + row] = k < (unsigned)V ? l[k] - m : 0.f;
    }
}

// One warp per row, after the group's sums: loss[row] = log(sum) - (l[t] -
// mx) over the whole vocabulary; with scale != 0 the logits become scale *
// (softmax - onehot) in this rank's rows (target 0xffffffff: no loss, zero
// gradient).
extern "C" __global__ void vocab_softmax_ce(float* logits, float* losses, const float* mx,
                                            const float* sums, const unsigned* targets, int N,
                                            int V, int v0, float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= N) return;
    float* l = logits + (long)row * V;
    unsigned t = targets[row];
    bool counted = t != 0xffffffffu;
    float s = sums[row], m = mx[row];
    if (lane == 0) losses[row] = counted ? logf(s) - sums[N + row] : 0.f;
    __syncwarp();
    if (scale != 0.f) {
        float inv = 1.f / s;
        unsigned k = t - (unsigned)v0;
        for (int i = lane; i < V; i += WARP) {
            float g = counted ? expf(l[i] - m) * inv * scale : 0.f;
            if (counted && (unsigned)i == k) g -= scale;
            l[i] = g;
        }
    }
}

// ---- attention ---------------------------------------------------------
// qkv [B, T, 3, NH, HS] -> q, k, v each [B, NH, T, HS]
extern "C" __global__ void permute_qkv(float* q, float* k, float* v, const float* qkv,
                                       int B, int T, int NH, int HS) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)B * NH * T * HS;
    if (i >= total) return;
    int d = i % HS; long r = i / HS;
    int t = r % T; r /= T;
    int h = r % NH; int b = r / NH;
    int C = NH * HS;
    long src = ((long)b * T + t) * 3 * C + h * HS + d;
    q[i] = qkv[src];
    k[i] = qkv[src + C];
    v[i] = qkv[src + 2 * C];
}

// y [B, NH, T, HS] -> out [B, T, NH*HS]
extern "C" __global__ void unpermute(float* out, const float* y, int B, int T, int NH, int HS) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)B * NH * T * HS;
    if (i >= total) return;
    int d = i % HS; long r = i / HS;
    int t = r % T; r /= T;
    int h = r % NH; int b = r / NH;
    out[((long)b * T + t) * NH * HS + h * HS + d] = y[i];
}

// dout [B, T, NH*HS] -> dy [B, NH, T, HS]
extern "C" __global__ void permute_grad(float* dy, const float* dout, int B, int T, int NH, int HS) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)B * NH * T * HS;
    if (i >= total) return;
    int d = i % HS; long r = i / HS;
    int t = r % T; r /= T;
    int h = r % NH; int b = r / NH;
    dy[i] = dout[((long)b * T + t) * NH * HS + h * HS + d];
}

// dqkv [B, T, 3C] += (dq, dk, dv) each [B, NH, T, HS]
extern "C" __global__ void unpermute_qkv_grad(float* dqkv, const float* dq, const float* dk,
                                              const float* dv, int B, int T, int NH, int HS) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)B * NH * T * HS;
    if (i >= total) return;
    int d = i % HS; long r = i / HS;
    int t = r % T; r /= T;
    int h = r % NH; int b = r / NH;
    int C = NH * HS;
    long dst = ((long)b * T + t) * 3 * C + h * HS + d;
    dqkv[dst] += dq[i];
    dqkv[dst + C] += dk[i];
    dqkv[dst + 2 * C] += dv[i];
}

// att[row, :] = softmax(scale * preatt[row, :t+1]), zeros after; one warp
// per row of T, rows = B*NH*T (row % T is the query position).
extern "C" __global__ void softmax_causal_forward(float* att, const float* preatt, int rows, int T,
                                                  float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    const float* x = preatt + (long)row * T;
    float* y = att + (long)row * T;
    float mx = __int_as_float(0xff800000);
    for (int j = lane; j <= t; j += WARP) mx = fmaxf(mx, x[j] * scale);
    mx = warp_max(mx);
    float s = 0.f;
    for (int j = lane; j <= t; j += WARP) s += expf(x[j] * scale - mx);
    s = warp_sum(s);
    float inv = 1.f / s;
    for (int j = lane; j < T; j += WARP) y[j] = j <= t ? expf(x[j] * scale - mx) * inv : 0.f;
}

// dpreatt[row, j] = scale * att[j] * (datt[j] - sum_k att[k] datt[k]) for j <= t.
extern "C" __global__ void softmax_causal_backward(float* dpreatt, const float* datt, const float* att,
                                                   int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int t = row % T;
    const float* a = att + (long)row * T;
    const float* da = datt + (long)row * T;
    float dot = 0.f;
    for (int j = lane; j <= t; j += WARP) dot += a[j] * da[j];
    dot = warp_sum(dot);
    float* d = dpreatt + (long)row * T;
    for (int j = lane; j < T; j += WARP) d[j] = j <= t ? scale * a[j] * (da[j] - dot) : 0.f;
}

// out[n, c] += bias[c]
extern "C" __global__ void add_bias(float* out, const float* bias, long N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N * C) out[i] += bias[i % C];
}

// dbias[c] += sum_n dout[n, c] (one thread per column, rows in order)
extern "C" __global__ void bias_backward(float* dbias, const float* dout, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int n = 0; n < N; n++) s += dout[(long)n * C + c];
    dbias[c] += s;
}

// ---- optimizer helpers --------------------------------------------------
// partial[block] = sum of squares of x[block*chunk .. (block+1)*chunk),
// each thread striding in a fixed order, then a fixed tree in shared
// memory (deterministic).
extern "C" __global__ void sumsq_partial(float* partial, const float* x, long n, long chunk) {
    __shared__ float sh[256];
    long start = (long)blockIdx.x * chunk;
    long end = start + chunk < n ? start + chunk : n;
    float s = 0.f;
    for (long i = start + threadIdx.x; i < end; i += blockDim.x) s += x[i] * x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
        if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// ---- decoding with a paged KV cache (serving) ----------------------------
// A step's rows are tokens of many sequences, each at its own position;
// a layer's keys (and values) are [blocks * BS, C]: position o of block b
// is slot b * BS + o. A row's table is tabs[tab_off[r] ..], the block ids
// of its sequence in order (position p in block tabs[tab_off[r] + p / BS]).

// out[n, c] = wte[tokens[n], c] + wpe[pos[n], c]
extern "C" __global__ void decode_embed(float* out, const int* tokens, const int* pos,
                                        const float* wte, const float* wpe, int N, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    out[i] = wte[(long)tokens[n] * C + c] + wpe[(long)pos[n] * C + c];
}

// (kv_load and kv_store, the KV cache's element, come first, from kv.cu.)

// Each row's key and value (qkv [N, 3C]: q, k, v) into its slot:
// kc[slots[n], c] = qkv[n, C + c]; vc[slots[n], c] = qkv[n, 2C + c].
template <typename KV>
__device__ void kv_write_body(KV* kc, KV* vc, const float* qkv, const int* slots, int N, int C) {
    overlap_release();
    overlap_wait();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C) return;
    int n = i / C, c = i % C;
    long at = (long)slots[n] * C + c;
    const float* row = qkv + (long)n * 3 * C;
    kv_store(kc, at, row[C + c]);
    kv_store(vc, at, row[2 * C + c]);
}

extern "C" __global__ void kv_write(float* kc, float* vc, const float* qkv, const int* slots,
                                    int N, int C) {
    kv_write_body(kc, vc, qkv, slots, N, C);
}

// The same into a bf16 cache.
extern "C" __global__ void kv_write_bf16(unsigned short* kc, unsigned short* vc, const float* qkv,
                                         const int* slots, int N, int C) {
    kv_write_body(kc, vc, qkv, slots, N, C);
}

// The block's maximum (sum) of v, in every thread; red holds a float per
// warp. blockDim.x is a multiple of WARP, at most WARP * WARP; every
// thread of the block calls it.
__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();  // the last reduction's reads of red are done
    if (lane == 0) red[w] = v;
    __syncthreads();
    return warp_max(lane < nw ? red[lane] : __int_as_float(0xff800000));
}

__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? red[lane] : 0.f);
}

// One block per (row, head) (grid N x NH), blockDim.x >= HS, a multiple of
// WARP; dynamic shared memory (blockDim.x + WARP + HS) floats. Row r's
// query (qkv[r, h*HS ..]) attends to its sequence's positions 0..=pos[r],
// read through its table: score = q . k * scale, softmax, out[r, h*HS + d]
// = sum_j softmax_j v_j[d]. The positions go in tiles of blockDim.x (one
// thread per position for the scores), with an online softmax: the
// running maximum m and sum l, and thread d's accumulator rescaled by
// exp(m_old - m_new) at each tile.
template <typename KV>
__device__ void paged_attention_block_body(float* out, const float* qkv, const KV* kc, const KV* vc,
                                           const int* pos, const int* tab_off, const int* tabs,
                                           int NH, int HS, int BS, float scale) {
    extern __shared__ float sh[];
    float* wt = sh;                    // blockDim.x: the tile's weights
    float* red = sh + blockDim.x;      // WARP: reductions
    float* q = red + WARP;             // HS: the query
    int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int C = NH * HS;
    int P = pos[r] + 1;
    const int* tab = tabs + tab_off[r];
    for (int d = tid; d < HS; d += blockDim.x) q[d] = qkv[(long)r * 3 * C + h * HS + d];
    __syncthreads();
    float m = __int_as_float(0xff800000), l = 0.f, acc = 0.f;
    for (int j0 = 0; j0 < P; j0 += blockDim.x) {
        int j = j0 + tid;
        float s = __int_as_float(0xff800000);
        if (j < P) {
            long k = ((long)tab[j / BS] * BS + j % BS) * C + h * HS;
            float dot = 0.f;
            for (int e = 0; e < HS; e++) dot += q[e] * kv_load(kc, k + e);
            s = dot * scale;
        }
        float mn = fmaxf(m, block_max(s, red));  // finite: the tile has a position
        float p = j < P ? expf(s - mn) : 0.f;
        float corr = expf(m - mn);  // 0 at the first tile (m = -inf)
        l = l * corr + block_sum(p, red);
        wt[tid] = p;
        __syncthreads();
        if (tid < HS) {
            acc *= corr;
            int cnt = min((int)blockDim.x, P - j0);
            for (int t = 0; t < cnt; t++) {
                int jj = j0 + t;
                long v = ((long)tab[jj / BS] * BS + jj % BS) * C + h * HS;
                acc += wt[t] * kv_load(vc, v + tid);
            }
        }
        m = mn;
        __syncthreads();  // wt is read before the next tile writes it
    }
    if (tid < HS) out[(long)r * C + h * HS + tid] = acc / l;
}

extern "C" __global__ void paged_attention_decode(float* out, const float* qkv, const float* kc,
                                                  const float* vc, const int* pos,
                                                  const int* tab_off, const int* tabs, int NH,
                                                  int HS, int BS, float scale) {
    paged_attention_block_body(out, qkv, kc, vc, pos, tab_off, tabs, NH, HS, BS, scale);
}

// The same over a bf16 cache.
extern "C" __global__ void paged_attention_decode_bf16(float* out, const float* qkv,
                                                       const unsigned short* kc,
                                                       const unsigned short* vc, const int* pos,
                                                       const int* tab_off, const int* tabs, int NH,
                                                       int HS, int BS, float scale) {
    paged_attention_block_body(out, qkv, kc, vc, pos, tab_off, tabs, NH, HS, BS, scale);
}

// The decode attention in warps (the default; BRAID_DECODE_ATTENTION=block
// runs paged_attention_decode above): one block per (row, head) (grid
// N x NH) of DEC_WARPS warps, HS at most 4 * WARP. Lane t holds the query's
// (scaled) and the accumulator's elements t, t + WARP, ...; warp w takes
// positions w * DEC_KEYS.. in steps of DEC_WARPS * DEC_KEYS, DEC_KEYS at a
// time (their keys and values loaded together, each row of a page read
// whole by the warp), with its own online softmax; the warps' maxima, sums
// and accumulators are merged at the end.
#define DEC_WARPS 8
#define DEC_KEYS 4
template <typename KV>
__device__ void paged_attention_warps_body(float* out, const float* qkv, const KV* kc, const KV* vc,
                                           const int* pos, const int* tab_off, const int* tabs,
                                           int NH, int HS, int BS, float scale) {
    __shared__ float sm[DEC_WARPS], sl[DEC_WARPS], sacc[DEC_WARPS][4 * WARP];
    int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int C = NH * HS, P = pos[r] + 1;
    const int* tab = tabs + tab_off[r];
    const float* q = qkv + (long)r * 3 * C + h * HS;
    float qv[4], acc[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int d = lane + i * WARP;
        qv[i] = d < HS ? q[d] * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = __int_as_float(0xff800000), l = 0.f;
    for (int j0 = w * DEC_KEYS; j0 < P; j0 += DEC_WARPS * DEC_KEYS) {
        float s[DEC_KEYS], vv[DEC_KEYS][4];
#pragma unroll
        for (int u = 0; u < DEC_KEYS; u++) {
            int j = j0 + u;
            float dot = 0.f;
            if (j < P) {
                long base = ((long)tab[j / BS] * BS + j % BS) * C + h * HS;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int d = lane + i * WARP;
                    bool in = d < HS;
                    dot += in ? qv[i] * kv_load(kc, base + d) : 0.f;
                    vv[u][i] = in ? kv_load(vc, base + d) : 0.f;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) vv[u][i] = 0.f;
            }
            s[u] = j < P ? warp_sum(dot) : __int_as_float(0xff800000);
        }
        float mn = m;
#pragma unroll
        for (int u = 0; u < DEC_KEYS; u++) mn = fmaxf(mn, s[u]);
        float corr = expf(m - mn);  // 0 at the first keys (m = -inf)
        l *= corr;
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i] *= corr;
#pragma unroll
        for (int u = 0; u < DEC_KEYS; u++) {
            float p = expf(s[u] - mn);  // 0 past P
            l += p;
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] += p * vv[u][i];
        }
        m = mn;
    }
    if (lane == 0) {
        sm[w] = m;
        sl[w] = l;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) sacc[w][lane + i * WARP] = acc[i];
    __syncthreads();
    // Warp 0 merges: warps without positions (P < their first) hold
    // m = -inf and add nothing.
    if (w == 0) {
        float M = __int_as_float(0xff800000);
        for (int x = 0; x < DEC_WARPS; x++) M = fmaxf(M, sm[x]);
        float L = 0.f, f[DEC_WARPS];
        for (int x = 0; x < DEC_WARPS; x++) {
            f[x] = expf(sm[x] - M);
            L += sl[x] * f[x];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int d = lane + i * WARP;
            if (d >= HS) continue;
            float o = 0.f;
            for (int x = 0; x < DEC_WARPS; x++) o += sacc[x][d] * f[x];
            out[(long)r * C + h * HS + d] = o / L;
        }
    }
}

extern "C" __global__ void paged_attention_decode_warps(float* out, const float* qkv,
                                                        const float* kc, const float* vc,
                                                        const int* pos, const int* tab_off,
                                                        const int* tabs, int NH, int HS, int BS,
                                                        float scale) {
    paged_attention_warps_body(out, qkv, kc, vc, pos, tab_off, tabs, NH, HS, BS, scale);
}

// The same over a bf16 cache.
extern "C" __global__ void paged_attention_decode_warps_bf16(float* out, const float* qkv,
                                                             const unsigned short* kc,
                                                             const unsigned short* vc,
                                                             const int* pos, const int* tab_off,
                                                             const int* tabs, int NH, int HS,
                                                             int BS, float scale) {
    paged_attention_warps_body(out, qkv, kc, vc, pos, tab_off, tabs, NH, HS, BS, scale);
}

// The decode attention a page row at a time (the default where it
// applies: the kernels' caller checks the shapes and alignments): one
// block per (row, head) (grid N x NH) of NW warps. Every lane loads 16
// bytes of a key and the same 16 bytes of its value: E elements (4 in
// f32, 8 in bf16), so LK = HS / E lanes hold one position (a power of two
// up to WARP) and a warp G = WARP / LK positions per load. The positions
// are dealt to PG_PARTS virtual warps whatever NW is: virtual warp v takes
// PG_LOADS * G positions at a time, the loads all issued before any is
// used, in steps of PG_PARTS * PG_LOADS * G, and real warp w runs the
// virtual warps w, w + NW, ... one after another. Each group of LK lanes
// of a virtual warp keeps the online softmax of its own positions (its
// maximum, sum and E elements of the accumulator); the block's groups are
// merged through shared memory at the end in a fixed order. So every
// instance (NW = 4, 8 or 16) computes the same sums in the same order:
// the host may pick the instance by the step's rows (16 warps for a few
// rows, whose blocks alone cannot fill the GPU) and a row's result still
// does not depend on what else its step holds. out is written in f32 and,
// when outb is not null, narrowed to bf16 too (the next product's input).
#define PG_LOADS 4
#define PG_PARTS 16

__device__ __forceinline__ unsigned short bf16_narrow(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;  // NaN stays NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 16 bytes of a key or value, widened to f32.
__device__ __forceinline__ void widen16(uint4 v, float (&x)[4]) {
    x[0] = __uint_as_float(v.x);
    x[1] = __uint_as_float(v.y);
    x[2] = __uint_as_float(v.z);
    x[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void widen16(uint4 v, float (&x)[8]) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        x[2 * k] = __uint_as_float(w[k] << 16);
        x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

template <typename KV, int E, int NW>
__device__ void paged_attention_pages_body(float* out, unsigned short* outb, const float* qkv,
                                           const KV* kc, const KV* vc, const int* pos,
                                           const int* tab_off, const int* tabs, int NH, int HS,
                                           int BS, float scale) {
    // A group's state: its maximum, sum and accumulator (HS elements per
    // group of a virtual warp: PG_PARTS * WARP * E floats in all), and the
    // weight of each group's state in the merge.
    __shared__ float sm[PG_PARTS * WARP], sl[PG_PARTS * WARP], sw[PG_PARTS * WARP];
    __shared__ float sacc[PG_PARTS * WARP * E];
    const float NEG = __int_as_float(0xff800000);
    overlap_release();
    overlap_wait();
    int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int C = NH * HS, P = pos[r] + 1;
    int LK = HS / E, G = WARP / LK, g = lane / LK, e0 = (lane % LK) * E;
    const int* tab = tabs + tab_off[r];
    const float* q = qkv + (long)r * 3 * C + h * HS + e0;
    float qv[E];
#pragma unroll
    for (int i = 0; i < E; i++) qv[i] = q[i] * scale;
    int per = PG_LOADS * G;
    for (int v = w; v < PG_PARTS; v += NW) {
        float acc[E];
#pragma unroll
        for (int i = 0; i < E; i++) acc[i] = 0.f;
        float m = NEG, l = 0.f;
        for (int jb = v * per; jb < P; jb += PG_PARTS * per) {
            long off[PG_LOADS];
#pragma unroll
            for (int u = 0; u < PG_LOADS; u++) {
                int j = jb + u * G + g;
                off[u] = j < P ? ((long)tab[j / BS] * BS + j % BS) * C + h * HS + e0 : -1;
            }
            uint4 kr[PG_LOADS], vr[PG_LOADS];
#pragma unroll
            for (int u = 0; u < PG_LOADS; u++) {
                if (off[u] >= 0) {
                    kr[u] = *reinterpret_cast<const uint4*>(kc + off[u]);
                    vr[u] = *reinterpret_cast<const uint4*>(vc + off[u]);
                } else {
                    kr[u] = make_uint4(0, 0, 0, 0);
                    vr[u] = make_uint4(0, 0, 0, 0);
                }
            }
            float s[PG_LOADS];
#pragma unroll
            for (int u = 0; u < PG_LOADS; u++) {
                float x[E];
                widen16(kr[u], x);
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < E; i++) dot += qv[i] * x[i];
                // The LK lanes of a position (every lane takes part).
                for (int o = LK / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
                s[u] = off[u] >= 0 ? dot : NEG;
            }
            float mn = m;
#pragma unroll
            for (int u = 0; u < PG_LOADS; u++) mn = fmaxf(mn, s[u]);
            if (mn == NEG) continue;  // no position of this group yet
            float corr = expf(m - mn);  // 0 at the group's first positions
            l *= corr;
#pragma unroll
            for (int i = 0; i < E; i++) acc[i] *= corr;
#pragma unroll
            for (int u = 0; u < PG_LOADS; u++) {
                float p = expf(s[u] - mn);  // 0 past P
                float x[E];
                widen16(vr[u], x);
                l += p;
#pragma unroll
                for (int i = 0; i < E; i++) acc[i] += p * x[i];
            }
            m = mn;
        }
        int part = v * G + g;
        if (lane % LK == 0) {
            sm[part] = m;
            sl[part] = l;
        }
#pragma unroll
        for (int i = 0; i < E; i++) sacc[part * HS + e0 + i] = acc[i];
    }
    __syncthreads();
    // Every part's state merged per element in part order (parts without
    // positions hold m = -inf and weigh 0; position 0 is always some
    // part's).
    int parts = PG_PARTS * G;
    float M = NEG;
    for (int x = 0; x < parts; x++) M = fmaxf(M, sm[x]);
    for (int x = threadIdx.x; x < parts; x += blockDim.x) sw[x] = expf(sm[x] - M);
    __syncthreads();
    float L = 0.f;
    for (int x = 0; x < parts; x++) L += sl[x] * sw[x];
    for (int d = threadIdx.x; d < HS; d += blockDim.x) {
        float o = 0.f;
        for (int x = 0; x < parts; x++) o += sacc[x * HS + d] * sw[x];
        o /= L;
        long at = (long)r * C + h * HS + d;
        out[at] = o;
        if (outb) outb[at] = bf16_narrow(o);
    }
}

#define PAGES(NW)                                                                               \
    extern "C" __global__ void paged_attention_decode_pages_##NW(                               \
        float* out, unsigned short* outb, const float* qkv, const float* kc, const float* vc,   \
        const int* pos, const int* tab_off, const int* tabs, int NH, int HS, int BS,            \
        float scale) {                                                                          \
        paged_attention_pages_body<float, 4, NW>(out, outb, qkv, kc, vc, pos, tab_off, tabs,    \
                                                 NH, HS, BS, scale);                            \
    }                                                                                           \
    extern "C" __global__ void paged_attention_decode_pages_bf16_##NW(                          \
        float* out, unsigned short* outb, const float* qkv, const unsigned short* kc,           \
        const unsigned short* vc, const int* pos, const int* tab_off, const int* tabs, int NH,  \
        int HS, int BS, float scale) {                                                          \
        paged_attention_pages_body<unsigned short, 8, NW>(out, outb, qkv, kc, vc, pos, tab_off, \
                                                          tabs, NH, HS, BS, scale);             \
    }
PAGES(4)
PAGES(8)
PAGES(16)

// The warp's largest (best, bi) in every lane: the larger value, the lower
// index on a tie.
__device__ void warp_argmax(float& best, int& bi) {
    for (int o = WARP / 2; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffff, best, o);
        int oi = __shfl_xor_sync(0xffffffff, bi, o);
        if (ov > best || (ov == best && oi < bi)) {
            best = ov;
            bi = oi;
        }
    }
}

// One block per row of logits, rows LD apart (blockDim.x a multiple of
// WARP, at most WARP * WARP): the row's greedy choice among its first V.
// token[r] = the index of its largest logit (the lowest on a tie, as the
// host's argmax; 0 when none is above -inf), logprob[r] = its log-softmax
// over those V, -log(sum_i exp(x_i - max)).
extern "C" __global__ void logits_pick(int* token, float* logprob, const float* logits, int LD,
                                       int V) {
    __shared__ float red[WARP];
    __shared__ int redi[WARP];
    __shared__ float top;
    __shared__ int topi;
    const float* x = logits + (long)blockIdx.x * LD;
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    float best = __int_as_float(0xff800000);
    int bi = V;  // none yet
    // Each thread's indices rise: its first maximum is kept.
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = x[i];
        if (v > best) {
            best = v;
            bi = i;
        }
    }
    warp_argmax(best, bi);
    if (lane == 0) {
        red[w] = best;
        redi[w] = bi;
    }
    __syncthreads();
    if (w == 0) {
        best = lane < nw ? red[lane] : __int_as_float(0xff800000);
        bi = lane < nw ? redi[lane] : V;
        warp_argmax(best, bi);
        if (lane == 0) {
            top = best;
            topi = bi < V ? bi : 0;
        }
    }
    __syncthreads();
    float m = top, sum = 0.f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) sum += expf(x[i] - m);
    sum = block_sum(sum, red);
    if (threadIdx.x == 0) {
        token[blockIdx.x] = topi;
        logprob[blockIdx.x] = -logf(sum);
    }
}

// out[m, c] = inp[rows[m], c]: the rows that want logits, gathered.
extern "C" __global__ void gather_rows(float* out, const float* inp, const int* rows, int M, int C) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)M * C) return;
    int m = i / C, c = i % C;
    out[i] = inp[(long)rows[m] * C + c];
}

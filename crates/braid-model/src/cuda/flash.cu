// braid's fused causal attention for the mixed-precision engine (needs
// sm_80 or newer: bf16 tensor-core `mma.sync`, `ldmatrix`, `cp.async`),
// compiled at run time by NVRTC.
//
// Flash-attention style: the T x T scores never reach device memory. Each
// block owns 64 rows of one (batch, head); its four warps own 16 rows
// each. Q, K and V are read straight from the `qkv [B, T, 3C]` activation
// (bias already added) and the results written straight into
// `out [B, T, C]` / `dqkv [B, T, 3C]`, so no permutes are needed.
//
// forward:  O = softmax(Q K^T * scale, causal) V, with the row's
//           log-sum-exp (base 2, scaled) kept for the backward pass.
// backward: D = rowsum(dO * O), then two kernels: one per key block for
//           dK and dV, recomputing the probabilities from the log-sum-exp,
//           and one per query block for dQ. The dQ kernel either reads the
//           score gradients dS the first one stored (bf16 tiles, the
//           lower triangle only: one product per tile instead of three),
//           or, where that scratch is not wanted, recomputes them. No
//           atomics: every output element is written by one thread in a
//           fixed order, so runs repeat bit for bit, and both dQ kernels
//           give the same bits.
//
// Tiles move global -> shared memory with cp.async, double-buffered: the
// next key (or query) block loads while the current one is multiplied.
// Shared-memory rows are padded by 8 values so that fragment loads and
// ldmatrix hit distinct banks.

typedef unsigned short bf16;
#define BLK 64            // rows per block and keys (or queries) per tile
#define THREADS 128       // four warps of 16 rows
#define PAD 8
#define SUB 32            // the backward kernels' sub-tiles (BLK / SUB per tile)
#define NEG_INF (-__int_as_float(0x7f800000))

// Where a block works: its (batch, head) `bh` and its rank `y` among the
// head's ny row blocks (rank 0 the longest walk). By default the grid is
// (B*NH, ny), so every head's rank 0 goes out before any head's rank 1.
// With FLASH_GROUP_HEADS = G > 0 (a define ahead of the source) the grid
// is one-dimensional, B*NH*ny blocks going out G heads at a time (the
// group's ranks in order, each over its G heads), so that the tiles a
// head's blocks share are read again while they are still in L2.
#ifndef FLASH_GROUP_HEADS
#define FLASH_GROUP_HEADS 0
#endif
struct Place {
    int bh, y;
};
__device__ __forceinline__ Place block_place(int ny) {
#if FLASH_GROUP_HEADS > 0
    int per = ny * FLASH_GROUP_HEADS;
    int g = blockIdx.x / per, r = blockIdx.x % per;
    int n = min(FLASH_GROUP_HEADS, (int)(gridDim.x / ny) - g * FLASH_GROUP_HEADS);
    return {g * FLASH_GROUP_HEADS + r % n, r / n};
#else
    return {(int)blockIdx.x, (int)blockIdx.y};
#endif
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Two f32 -> packed bf16x2 (round to nearest even); `lo` in the low half.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float lo_f(unsigned x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f(unsigned x) { return __uint_as_float(x & 0xffff0000u); }

// c (16x8, f32) += a (16x16, bf16, row-major fragment) * b (16x8, bf16).
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices from shared memory (one row address per lane).
__device__ __forceinline__ void ldsm4(unsigned* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Four transposed 8x8 matrices from shared memory (one row address per lane).
__device__ __forceinline__ void ldsm4t(unsigned* r, const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ unsigned ld32(const bf16* p) { return *(const unsigned*)p; }

// Rows [row0, row0 + BLK) of one head's slice (`src` points at row 0,
// rows `stride` apart) into a padded shared tile; rows past T read as 0.
template <int HS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int row0, int T, long stride) {
    constexpr int CH = HS / 8;
    for (int i = threadIdx.x; i < BLK * CH; i += THREADS) {
        int r = i / CH, c = i % CH, row = row0 + r;
        bool ok = row < T;
        cp16(dst + r * (HS + PAD) + c * 8, ok ? src + row * stride + c * 8 : src, ok);
    }
}

// Starts loading key block `kb` of K and V into the other stage (when
// `more`), then waits until the current stage has landed and syncs.
template <int HS>
__device__ __forceinline__ void next_kv(bf16* sk, bf16* sv, const bf16* k, const bf16* v, int kb,
                                        bool more, int T, long stride) {
    if (more) {
        load_tile<HS>(sk, k, kb * BLK, T, stride);
        load_tile<HS>(sv, v, kb * BLK, T, stride);
        cp_commit();
        cp_wait<1>();
    } else {
        cp_wait<0>();
    }
    __syncthreads();
}

// A-operand fragments of this warp's 16 rows (16 x HS) of a shared tile.
template <int HS>
__device__ __forceinline__ void load_a(unsigned (*f)[4], const bf16* tile, int warp, int lane) {
    constexpr int LD = HS + PAD;
    int g = lane >> 2, t = lane & 3;
    const bf16* p = tile + (warp * 16 + g) * LD + 2 * t;
    for (int ks = 0; ks < HS / 16; ks++) {
        f[ks][0] = ld32(p + ks * 16);
        f[ks][1] = ld32(p + 8 * LD + ks * 16);
        f[ks][2] = ld32(p + ks * 16 + 8);
        f[ks][3] = ld32(p + 8 * LD + ks * 16 + 8);
    }
}

// s (16 x N) = a (16 x HS) * tile^T, tile holding N rows of HS. The B
// fragments of two 8-row column tiles come from one ldmatrix (matrix q of
// the four: rows 8 (nt + q / 2) .. +8, columns 16 ks + 8 (q % 2) .. +8),
// the same values in the same order as loading them pair by pair.
template <int HS, int N = BLK>
__device__ __forceinline__ void mul_bt(float (*s)[4], const unsigned (*a)[4], const bf16* tile,
                                       int lane) {
    constexpr int LD = HS + PAD;
    int q = lane >> 3, r = lane & 7;
    const bf16* base = tile + ((q >> 1) * 8 + r) * LD + (q & 1) * 8;
    for (int nt = 0; nt < N / 8; nt += 2) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        s[nt + 1][0] = s[nt + 1][1] = s[nt + 1][2] = s[nt + 1][3] = 0.f;
        for (int ks = 0; ks < HS / 16; ks++) {
            unsigned b[4];
            ldsm4(b, base + nt * 8 * LD + ks * 16);
            mma(s[nt], a[ks], b[0], b[1]);
            mma(s[nt + 1], a[ks], b[2], b[3]);
        }
    }
}

// s (16 x N) = a (16 x HS: rows [16 warp, +16) of the shared tile `at`)
// * tile^T; the A fragments come by ldmatrix, once per k-step.
template <int HS, int N = BLK>
__device__ __forceinline__ void mul_bt_s(float (*s)[4], const bf16* at, const bf16* tile, int warp,
                                         int lane) {
    constexpr int LD = HS + PAD;
    int q = lane >> 3, r = lane & 7;
    const bf16* base = tile + ((q >> 1) * 8 + r) * LD + (q & 1) * 8;
    const bf16* abase = at + (warp * 16 + (q & 1) * 8 + r) * LD + (q >> 1) * 8;
    for (int nt = 0; nt < N / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    for (int ks = 0; ks < HS / 16; ks++) {
        unsigned a[4];
        ldsm4(a, abase + ks * 16);
        for (int nt = 0; nt < N / 8; nt += 2) {
            unsigned b[4];
            ldsm4(b, base + nt * 8 * LD + ks * 16);
            mma(s[nt], a, b[0], b[1]);
            mma(s[nt + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x HS) += p (16 x N, packed bf16 A fragments) * tile (N x HS).
template <int HS, int N = BLK>
__device__ __forceinline__ void mul_acc(float (*acc)[4], const unsigned (*p)[4], const bf16* tile,
                                        int lane) {
    constexpr int LD = HS + PAD;
    const bf16* base = tile + (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
    for (int kk = 0; kk < N / 16; kk++) {
        for (int nt = 0; nt < HS / 8; nt += 2) {
            unsigned b[4];
            ldsm4t(b, base + kk * 16 * LD + nt * 8);
            mma(acc[nt], p[kk], b[0], b[1]);
            mma(acc[nt + 1], p[kk], b[2], b[3]);
        }
    }
}

// C fragments of a 16 x N f32 tile -> A fragments (bf16) for the next product.
template <int N = BLK>
__device__ __forceinline__ void to_a(unsigned (*a)[4], const float (*s)[4]) {
    for (int kk = 0; kk < N / 16; kk++) {
        a[kk][0] = pack2(s[2 * kk][0], s[2 * kk][1]);
        a[kk][1] = pack2(s[2 * kk][2], s[2 * kk][3]);
        a[kk][2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[kk][3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// Writes this warp's 16 x HS accumulator (times `mul`) as bf16 rows
// [row0 + 16 warp, +16) below T, rows `stride` apart.
template <int HS>
__device__ __forceinline__ void store_rows(bf16* dst, const float (*acc)[4], float mul0, float mul1,
                                           int row0, int T, long stride, int warp, int lane) {
    int g = lane >> 2, t = lane & 3;
    int r0 = row0 + warp * 16 + g, r1 = r0 + 8;
    for (int nt = 0; nt < HS / 8; nt++) {
        int col = nt * 8 + 2 * t;
        if (r0 < T) *(unsigned*)(dst + r0 * stride + col) = pack2(acc[nt][0] * mul0, acc[nt][1] * mul0);
        if (r1 < T) *(unsigned*)(dst + r1 * stride + col) = pack2(acc[nt][2] * mul1, acc[nt][3] * mul1);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffff, v, 1);
    return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// Scores s (16 x 64, this thread's C fragments) of keys after the row
// (row0 for elements 0, 1; row1 for 2, 3) set to -inf; `key0` is the key
// of element 0 of column tile 0 (the tile's first key + 2 t).
__device__ __forceinline__ void mask_past_rows(float (*s)[4], int key0, int row0, int row1) {
    for (int nt = 0; nt < BLK / 8; nt++) {
        int key = key0 + nt * 8;
        if (key > row0) s[nt][0] = NEG_INF;
        if (key + 1 > row0) s[nt][1] = NEG_INF;
        if (key > row1) s[nt][2] = NEG_INF;
        if (key + 1 > row1) s[nt][3] = NEG_INF;
    }
}

// One key tile's step of the online softmax for this thread's two rows:
// the running maxima m (of the scaled scores, log2 units) and sums l move
// on, the accumulator o (NT column tiles) is rescaled, and the scores
// become probabilities (exp2(s * sl2 - max)). Maxima are of the raw
// scores (scaling by sl2 > 0 keeps the order, and rounds the maximum
// exactly as it would the scaled one). Each row needs a finite score in
// the tile.
//
// In two halves where the output is still being accumulated while the
// scores are taken (the pipelined Hopper forward): softmax_scores (the new
// maxima, the sums, the probabilities; the output's factors returned in
// c0, c1) and rescale_rows (the output times them). The same arithmetic as
// the whole: o's products and l's are independent of each other.
__device__ __forceinline__ void softmax_scores(float (*s)[4], float& m0, float& m1, float& l0,
                                               float& l1, float sl2, float& c0, float& c1) {
    float mx0 = NEG_INF, mx1 = NEG_INF;
    for (int nt = 0; nt < BLK / 8; nt++) {
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    float n0 = fmaxf(m0, quad_max(mx0) * sl2), n1 = fmaxf(m1, quad_max(mx1) * sl2);
    c0 = exp2f(m0 - n0);
    c1 = exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    l0 *= c0;
    l1 *= c1;
    for (int nt = 0; nt < BLK / 8; nt++) {
        s[nt][0] = exp2f(fmaf(s[nt][0], sl2, -n0));
        s[nt][1] = exp2f(fmaf(s[nt][1], sl2, -n0));
        s[nt][2] = exp2f(fmaf(s[nt][2], sl2, -n1));
        s[nt][3] = exp2f(fmaf(s[nt][3], sl2, -n1));
        l0 += s[nt][0] + s[nt][1];
        l1 += s[nt][2] + s[nt][3];
    }
}

template <int NT>
__device__ __forceinline__ void rescale_rows(float (*o)[4], float c0, float c1) {
    for (int nt = 0; nt < NT; nt++) {
        o[nt][0] *= c0;
        o[nt][1] *= c0;
        o[nt][2] *= c1;
        o[nt][3] *= c1;
    }
}

template <int NT>
__device__ __forceinline__ void softmax_tile(float (*s)[4], float (*o)[4], float& m0, float& m1,
                                             float& l0, float& l1, float sl2) {
    float c0, c1;
    softmax_scores(s, m0, m1, l0, l1, sl2, c0, c1);
    rescale_rows<NT>(o, c0, c1);
}

// The end of a forward pass for this thread's two rows of the head at
// `out` (row0 = first + 16 warp + g, row1 = row0 + 8; `first` the first
// row of the warp's 64): the running sums totalled over the quad, the
// output normalised and stored, the log-sum-exp kept in `L` (the head's).
template <int HS>
__device__ __forceinline__ void finish_rows(bf16* out, float* L, const float (*o)[4], float m0,
                                            float m1, float l0, float l1, int first, int T, int C,
                                            int warp, int lane) {
    int row0 = first + warp * 16 + (lane >> 2), row1 = row0 + 8;
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    store_rows<HS>(out, o, 1.f / l0, 1.f / l1, first, T, C, warp, lane);
    if ((lane & 3) == 0) {
        if (row0 < T) L[row0] = m0 + __log2f(l0);
        if (row1 < T) L[row1] = m1 + __log2f(l1);
    }
}

// ---- forward --------------------------------------------------------------
// B*NH*ceil(T/64) blocks (block_place); lse [B*NH, T] in log2 units of the
// scaled scores.
template <int HS>
__device__ void flash_forward(bf16 (*sm)[2][BLK * (HS + PAD)], bf16* out, float* lse,
                              const bf16* qkv, int T, int NH, float sl2) {
    constexpr int NT = HS / 8;
    // sm: [stage][K, V]; Q parks in stage 1.
    // Longest row blocks first (block_place).
    int nqb = (T + BLK - 1) / BLK;
    Place at = block_place(nqb);
    int qb = nqb - 1 - at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    int q0 = qb * BLK;

    load_tile<HS>(sm[1][0], q, q0, T, stride);
    load_tile<HS>(sm[0][0], k, 0, T, stride);
    load_tile<HS>(sm[0][1], v, 0, T, stride);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    unsigned qf[HS / 16][4];
    load_a<HS>(qf, sm[1][0], warp, lane);
    __syncthreads();

    float o[NT][4];
    for (int nt = 0; nt < NT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    for (int j = 0; j <= qb; j++) {
        int cur = j & 1;
        next_kv<HS>(sm[cur ^ 1][0], sm[cur ^ 1][1], k, v, j + 1, j < qb, T, stride);
        float s[BLK / 8][4];
        mul_bt<HS>(s, qf, sm[cur][0], lane);
        // Only the diagonal tile (j == qb) has keys past some of its rows;
        // the others skip the mask.
        if (j == qb) mask_past_rows(s, j * BLK + 2 * t, row0, row1);
        // Key j*64 <= every row of this block, so each row has a finite score.
        softmax_tile<NT>(s, o, m0, m1, l0, l1, sl2);
        unsigned pf[BLK / 16][4];
        to_a(pf, s);
        mul_acc<HS>(o, pf, sm[cur][1], lane);
        __syncthreads();
    }
    finish_rows<HS>(out + (long)b * T * C + h * HS, lse + (long)bh * T, o, m0, m1, l0, l1, q0, T, C,
                    warp, lane);
}

// ---- backward ---------------------------------------------------------------
// dsum [B*NH, T] = rowsum(dout * out) per head: one block per row of
// [B, T, C]; a thread per 8 values, then each head's partials summed in
// order by one thread (DSUM_PARTS values per pass).
#define DSUM_PARTS 2048
template <int HS>
__device__ void flash_dsum(float* dsum, const bf16* dout, const bf16* out, int T, int NH) {
    constexpr int CH = HS / 8, HPS = DSUM_PARTS / CH;
    __shared__ float part[HPS * CH];
    long row = blockIdx.x;
    int b = (int)(row / T), tt = (int)(row % T);
    const uint4* d = (const uint4*)(dout + row * NH * HS);
    const uint4* o = (const uint4*)(out + row * NH * HS);
    for (int h0 = 0; h0 < NH; h0 += HPS) {
        int nh = min(HPS, NH - h0);
        for (int i = threadIdx.x; i < nh * CH; i += blockDim.x) {
            uint4 x = d[h0 * CH + i], y = o[h0 * CH + i];
            part[i] = lo_f(x.x) * lo_f(y.x) + hi_f(x.x) * hi_f(y.x) + lo_f(x.y) * lo_f(y.y) +
                      hi_f(x.y) * hi_f(y.y) + lo_f(x.z) * lo_f(y.z) + hi_f(x.z) * hi_f(y.z) +
                      lo_f(x.w) * lo_f(y.w) + hi_f(x.w) * hi_f(y.w);
        }
        __syncthreads();
        for (int h = threadIdx.x; h < nh; h += blockDim.x) {
            float acc = 0.f;
            for (int c = 0; c < CH; c++) acc += part[h * CH + c];
            dsum[((long)b * NH + h0 + h) * T + tt] = acc;
        }
        __syncthreads();
    }
}

// First element of the dS tile (query block qb, key block kb <= qb) of
// head bh: each head's lower triangle of 64 x 64 tiles, row-major by
// query block.
__device__ __forceinline__ long score_tile(int bh, int nb, int qb, int kb) {
    return ((long)bh * ((long)nb * (nb + 1) / 2) + (long)qb * (qb + 1) / 2 + kb) * BLK * BLK;
}

// The dS tiles of head bh: heads below `split` in `dS`, the others in
// `dS2` (the scratch may be two pieces of memory idle at the time); null
// where `dS` is (nothing stored).
__device__ __forceinline__ bf16* score_head(bf16* dS, bf16* dS2, int split, int bh, int nb) {
    if (!dS) return nullptr;
    return bh < split ? dS + score_tile(bh, nb, 0, 0) : dS2 + score_tile(bh - split, nb, 0, 0);
}

// The lse and row sum of query rows [row0, row0 + 64) of one head into
// `sl` and `sd`, by the block's threads 0..63; rows past T get lse = +inf
// (their probabilities are 0) and sum 0.
__device__ __forceinline__ void stage_rows(float* sl, float* sd, const float* L, const float* D,
                                           int row0, int T) {
    if (threadIdx.x < BLK) {
        int row = row0 + threadIdx.x;
        sl[threadIdx.x] = row < T ? L[row] : -NEG_INF;
        sd[threadIdx.x] = row < T ? D[row] : 0.f;
    }
}

// One column tile of a thread's transposed scores, in place: P^T =
// exp2(S^T * sl2 - lse) in `p` and dS^T = P^T (dP^T - D) in `dp`, for its
// keys key0 (elements 0, 1) and key1 (2, 3) and the queries qrow and
// qrow + 1 (their lse la, lb and row sums da, db); on the diagonal tile
// (`diag`) queries before a key get probability 0.
__device__ __forceinline__ void transposed_grads(float* p, float* dp, float sl2, float la, float lb,
                                                 float da, float db, bool diag, int qrow, int key0,
                                                 int key1) {
    p[0] = exp2f(fmaf(p[0], sl2, -la));
    p[1] = exp2f(fmaf(p[1], sl2, -lb));
    p[2] = exp2f(fmaf(p[2], sl2, -la));
    p[3] = exp2f(fmaf(p[3], sl2, -lb));
    if (diag) {
        if (qrow < key0) p[0] = 0.f;
        if (qrow + 1 < key0) p[1] = 0.f;
        if (qrow < key1) p[2] = 0.f;
        if (qrow + 1 < key1) p[3] = 0.f;
    }
    dp[0] = p[0] * (dp[0] - da);
    dp[1] = p[1] * (dp[1] - db);
    dp[2] = p[2] * (dp[2] - da);
    dp[3] = p[3] * (dp[3] - db);
}

// One column tile of a thread's scores, in place: P = exp2(S * sl2 - lse)
// in `p` and dS = P (dP - D) in `dp`, for its rows row0 (elements 0, 1:
// lse la, row sum da) and row1 (2, 3: lb, db) and the keys key and
// key + 1; on the diagonal tile (`diag`) keys past a row get 0.
__device__ __forceinline__ void row_grads(float* p, float* dp, float sl2, float la, float lb, float da,
                                          float db, bool diag, int key, int row0, int row1) {
    p[0] = exp2f(fmaf(p[0], sl2, -la));
    p[1] = exp2f(fmaf(p[1], sl2, -la));
    p[2] = exp2f(fmaf(p[2], sl2, -lb));
    p[3] = exp2f(fmaf(p[3], sl2, -lb));
    if (diag) {
        if (key > row0) p[0] = 0.f;
        if (key + 1 > row0) p[1] = 0.f;
        if (key > row1) p[2] = 0.f;
        if (key + 1 > row1) p[3] = 0.f;
    }
    dp[0] = p[0] * (dp[0] - da);
    dp[1] = p[1] * (dp[1] - da);
    dp[2] = p[2] * (dp[2] - db);
    dp[3] = p[3] * (dp[3] - db);
}

// dK, dV for key block kb of head bh (the grid is described at the entry
// points below). The block keeps its 64 keys' K and V in shared memory;
// each warp owns 16 keys and walks the query blocks at or after its own
// (causal), recomputing P^T = exp2(K Q^T * sl2 - lse). With `dS`, it also
// stores each tile's dS^T for the dQ kernel (`dS`: this head's tiles). `sm`, `sL`, `sD` are the
// block's shared tiles.
template <int HS>
__device__ void flash_dkdv(int kb, int bh, bf16 (*sm)[2][BLK * (HS + PAD)], float (*sL)[BLK],
                           float (*sD)[BLK], bf16* dqkv, const bf16* qkv, const bf16* dout,
                           const float* lse,
                           const float* dsum, int T, int NH, float sl2, float scale, bf16* dS) {
    constexpr int LD = HS + PAD, NT = HS / 8;
    // sm: [stage][Q, dO], then [K, V] in sm[2]. Reading K and V's
    // fragments from shared memory, not holding them, saves the registers
    // of a third block per SM at head size 80 (measured on an H200).
    int nb = (T + BLK - 1) / BLK;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    const bf16* dO = dout + (long)b * T * C + h * HS;
    const float* L = lse + (long)bh * T;
    const float* D = dsum + (long)bh * T;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    int k0 = kb * BLK;

    load_tile<HS>(sm[2][0], k, k0, T, stride);
    load_tile<HS>(sm[2][1], v, k0, T, stride);
    cp_commit();

    auto stage = [&](int st, int qb) {
        load_tile<HS>(sm[st][0], q, qb * BLK, T, stride);
        load_tile<HS>(sm[st][1], dO, qb * BLK, T, C);
        stage_rows(sL[st], sD[st], L, D, qb * BLK, T);
        cp_commit();
    };
    float dk[NT][4], dv[NT][4];
    for (int nt = 0; nt < NT; nt++)
        for (int e = 0; e < 4; e++) dk[nt][e] = dv[nt][e] = 0.f;
    int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
    stage(0, kb);
    for (int qb = kb; qb < nb; qb++) {
        int cur = (qb - kb) & 1;
        if (qb + 1 < nb) {
            stage(cur ^ 1, qb + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        // The 64 queries in two halves of 32: half the registers for the
        // probabilities, so more blocks fit per SM.
        for (int half = 0; half < BLK / SUB; half++) {
            const bf16 *sq = sm[cur][0] + half * SUB * LD, *sdo = sm[cur][1] + half * SUB * LD;
            float p[SUB / 8][4], dp[SUB / 8][4];
            mul_bt_s<HS, SUB>(p, sm[2][0], sq, warp, lane);   // S^T: keys x queries
            mul_bt_s<HS, SUB>(dp, sm[2][1], sdo, warp, lane); // dP^T = V dO^T
            for (int nt = 0; nt < SUB / 8; nt++) {
                int c = half * SUB + nt * 8 + 2 * t;
                // qb == kb: the diagonal tile, queries before some keys.
                transposed_grads(p[nt], dp[nt], sl2, sL[cur][c], sL[cur][c + 1], sD[cur][c],
                                 sD[cur][c + 1], qb == kb, qb * BLK + c, key0, key1);
            }
            unsigned af[SUB / 16][4];
            to_a<SUB>(af, p);
            mul_acc<HS, SUB>(dv, af, sdo, lane);
            to_a<SUB>(af, dp);
            if (dS) {
                // dS^T (bf16) into tile (qb, kb) of this head: rows are
                // keys, and each thread's 8 values of a row go out as one
                // 16-byte word (slot 8 t + e holds query 8 (e / 2) + 2 t +
                // e % 2 of this half; the dQ kernel maps slots back).
                uint4* tile = (uint4*)(dS + score_tile(0, nb, qb, kb));
                int kr = warp * 16 + g, slot = (half * SUB + t * 8) / 8;
                tile[kr * (BLK / 8) + slot] = make_uint4(af[0][0], af[0][2], af[1][0], af[1][2]);
                tile[(kr + 8) * (BLK / 8) + slot] = make_uint4(af[0][1], af[0][3], af[1][1], af[1][3]);
            }
            mul_acc<HS, SUB>(dk, af, sq, lane);
        }
        __syncthreads();
    }
    bf16* base = dqkv + (long)b * T * stride + h * HS;
    store_rows<HS>(base + C, dk, scale, scale, k0, T, stride, warp, lane);
    store_rows<HS>(base + 2 * C, dv, 1.f, 1.f, k0, T, stride, warp, lane);
}

// dQ for query block qb of head bh, walking key blocks 0..qb, recomputing
// P = exp2(Q K^T * sl2 - lse) and dP = dO V^T.
template <int HS>
__device__ void flash_dq(int qb, int bh, bf16 (*sm)[2][BLK * (HS + PAD)], bf16* dqkv,
                         const bf16* qkv, const bf16* dout, const float* lse,
                         const float* dsum, int T, int NH, float sl2, float scale) {
    constexpr int LD = HS + PAD, NT = HS / 8;
    // sm: [stage][K, V]; Q, dO park in stage 1 first.
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    const bf16* dO = dout + (long)b * T * C + h * HS;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    int q0 = qb * BLK;
    int row0 = q0 + warp * 16 + g, row1 = row0 + 8;

    load_tile<HS>(sm[1][0], q, q0, T, stride);
    load_tile<HS>(sm[1][1], dO, q0, T, C);
    load_tile<HS>(sm[0][0], k, 0, T, stride);
    load_tile<HS>(sm[0][1], v, 0, T, stride);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    unsigned qf[HS / 16][4], df[HS / 16][4];
    load_a<HS>(qf, sm[1][0], warp, lane);
    load_a<HS>(df, sm[1][1], warp, lane);
    const float* L = lse + (long)bh * T;
    const float* D = dsum + (long)bh * T;
    float la = row0 < T ? L[row0] : -NEG_INF, lb = row1 < T ? L[row1] : -NEG_INF;
    float da = row0 < T ? D[row0] : 0.f, db = row1 < T ? D[row1] : 0.f;
    __syncthreads();

    float dq[NT][4];
    for (int nt = 0; nt < NT; nt++) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
    for (int j = 0; j <= qb; j++) {
        int cur = j & 1;
        next_kv<HS>(sm[cur ^ 1][0], sm[cur ^ 1][1], k, v, j + 1, j < qb, T, stride);
        // The 64 keys in two halves of 32 (see flash_dkdv).
        for (int half = 0; half < BLK / SUB; half++) {
            const bf16 *sk = sm[cur][0] + half * SUB * LD, *sv = sm[cur][1] + half * SUB * LD;
            float p[SUB / 8][4], dp[SUB / 8][4];
            mul_bt<HS, SUB>(p, qf, sk, lane);
            mul_bt<HS, SUB>(dp, df, sv, lane);
            for (int nt = 0; nt < SUB / 8; nt++) {
                // j == qb: the diagonal tile, keys past some rows.
                int key = j * BLK + half * SUB + nt * 8 + 2 * t;
                row_grads(p[nt], dp[nt], sl2, la, lb, da, db, j == qb, key, row0, row1);
            }
            unsigned af[SUB / 16][4];
            to_a<SUB>(af, dp);
            mul_acc<HS, SUB>(dq, af, sk, lane);
        }
        __syncthreads();
    }
    store_rows<HS>(dqkv + (long)b * T * stride + h * HS, dq, scale, scale, q0, T, stride, warp, lane);
}

// Writes a dQ accumulator whose rows are query slots of the stored dS
// tiles (times `scale`, as bf16) to the query rows of tile `q0`, rows
// `stride` apart: row s of the tile is slot s, query 32 (s / 32) +
// 8 (e / 2) + 2 t' + e % 2 with t' = (s % 32) / 8, e = s % 8.
template <int HS>
__device__ __forceinline__ void store_query_slots(bf16* dst, const float (*dq)[4], float scale, int q0,
                                                  int T, long stride, int warp, int lane) {
    int g = lane >> 2, t = lane & 3;
    auto query = [](int s) {
        int u = s % 32, tt = u / 8, e = u % 8;
        return (s / 32) * 32 + (e / 2) * 8 + 2 * tt + (e % 2);
    };
    int r0 = q0 + query(warp * 16 + g), r1 = q0 + query(warp * 16 + g + 8);
    for (int nt = 0; nt < HS / 8; nt++) {
        int col = nt * 8 + 2 * t;
        if (r0 < T) *(unsigned*)(dst + r0 * stride + col) = pack2(dq[nt][0] * scale, dq[nt][1] * scale);
        if (r1 < T) *(unsigned*)(dst + r1 * stride + col) = pack2(dq[nt][2] * scale, dq[nt][3] * scale);
    }
}

// dQ for query block qb of head bh from the dS tiles the dK/dV kernel
// stored: dQ = sum over key blocks j <= qb of dS(qb, j) K_j, K and dS
// tiles double-buffered in `sK` and `sS` (`dS`: this head's tiles).
template <int HS>
__device__ void flash_dq_ds(int qb, int bh, bf16 (*sK)[BLK * (HS + PAD)], bf16 (*sS)[BLK * (BLK + PAD)],
                            bf16* dqkv, const bf16* qkv, const bf16* dS, int T, int NH, float scale) {
    constexpr int LD = HS + PAD, NT = HS / 8, LS = BLK + PAD;
    int nb = (T + BLK - 1) / BLK;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* k = qkv + (long)b * T * stride + h * HS + C;
    const bf16* ds = dS + score_tile(0, nb, qb, 0);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto stage = [&](int st, int j) {
        load_tile<HS>(sK[st], k, j * BLK, T, stride);
        for (int i = threadIdx.x; i < BLK * BLK / 8; i += THREADS) {
            int r = i / (BLK / 8), c = i % (BLK / 8);
            cp16(sS[st] + r * LS + c * 8, ds + (long)j * BLK * BLK + r * BLK + c * 8, true);
        }
        cp_commit();
    };
    float dq[NT][4];
    for (int nt = 0; nt < NT; nt++) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
    // Lane offsets of the ldmatrix row addresses: B (K, k = keys) as in
    // mul_acc; A (dS, stored keys x queries) transposed, matrix q4 =
    // (queries +8 (q4 % 2), keys +8 (q4 / 2)).
    int q4 = lane >> 3, r = lane & 7;
    int boff = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
    int aoff = ((q4 >> 1) * 8 + r) * LS + warp * 16 + (q4 & 1) * 8;
    stage(0, 0);
    for (int j = 0; j <= qb; j++) {
        int cur = j & 1;
        if (j < qb) {
            stage(cur ^ 1, j + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const bf16* kt = sK[cur] + boff;
        for (int kk = 0; kk < BLK / 16; kk++) {
            unsigned a[4];
            ldsm4t(a, sS[cur] + aoff + kk * 16 * LS);
            for (int nt = 0; nt < NT; nt += 2) {
                unsigned bb[4];
                ldsm4t(bb, kt + kk * 16 * LD + nt * 8);
                mma(dq[nt], a, bb[0], bb[1]);
                mma(dq[nt + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads();
    }
    store_query_slots<HS>(dqkv + (long)b * T * stride + h * HS, dq, scale, qb * BLK, T, stride, warp,
                          lane);
}

// Shared memory is dynamic (head sizes above 64 need more than the
// 48 KiB a static allocation may take): the launcher passes
// `flash_smem_bytes` of the entry, and raises the kernel's limit.
// Two stages of two padded 64-row tiles.
template <int HS>
__device__ __forceinline__ bf16 (*tiles())[2][BLK * (HS + PAD)] {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    return (bf16 (*)[2][BLK * (HS + PAD)])flash_smem;
}

template <int HS>
__device__ void flash_forward_entry(bf16* out, float* lse, const bf16* qkv, int T, int NH, float sl2) {
    flash_forward<HS>(tiles<HS>(), out, lse, qkv, T, NH, sl2);
}

// The backward kernels' blocks are placed by block_place, rank 0 the
// longest walk. dK/dV
// keeps three pairs of tiles, then the rows' lse and dsum; dQ from stored
// dS keeps two K tiles, then two dS tiles.
template <int HS>
__device__ void flash_dkdv_entry(bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse,
                                 const float* dsum, int T, int NH, float sl2, float scale, bf16* dS,
                                 bf16* dS2, int split) {
    bf16 (*sm)[2][BLK * (HS + PAD)] = tiles<HS>();
    float(*sL)[BLK] = (float(*)[BLK])(sm + 3);
    float(*sD)[BLK] = sL + 2;
    int nb = (T + BLK - 1) / BLK;
    Place at = block_place(nb);
    bf16* head = score_head(dS, dS2, split, at.bh, nb);
    flash_dkdv<HS>(at.y, at.bh, sm, sL, sD, dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale, head);
}

template <int HS>
__device__ void flash_dq_entry(bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse,
                               const float* dsum, int T, int NH, float sl2, float scale) {
    int nb = (T + BLK - 1) / BLK;
    Place at = block_place(nb);
    flash_dq<HS>(nb - 1 - at.y, at.bh, tiles<HS>(), dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale);
}

template <int HS>
__device__ void flash_dq_ds_entry(bf16* dqkv, const bf16* qkv, bf16* dS, bf16* dS2, int split, int T,
                                  int NH, float scale) {
    int nb = (T + BLK - 1) / BLK;
    bf16 (*sK)[BLK * (HS + PAD)] = tiles<HS>()[0];
    bf16 (*sS)[BLK * (BLK + PAD)] = (bf16 (*)[BLK * (BLK + PAD)])(sK + 2);
    Place at = block_place(nb);
    const bf16* head = score_head(dS, dS2, split, at.bh, nb);
    flash_dq_ds<HS>(nb - 1 - at.y, at.bh, sK, sS, dqkv, qkv, head, T, NH, scale);
}

// Entry points per head size, with the blocks per SM the register
// budget is planned for (forward, dK/dV, dQ recomputing dS): wider heads
// hold wider accumulators and fragments per thread, so fewer blocks. dQ
// from stored dS holds only its accumulator: 4 blocks. Measured on an
// H200 (attention backward per layer, B 8 x 1024, head size 80 / 64 /
// 128): dK/dV reading K and V from shared memory at 3 / 3 / 2 blocks,
// 0.48 -> 0.44 / 0.28 -> 0.28 / 0.92 -> 0.85 ms; storing dS costs it
// 0.05 ms and takes dQ from 0.32 to 0.17 ms at head size 80 (backward
// 0.86 -> 0.69 ms in all, with the coalesced row sums).
// `dS` null: dK/dV stores nothing. Heads `split` and up keep their dS
// tiles in `dS2` (from its start), the others in `dS`.
#define FLASH_ENTRIES(HS, FWD_BLOCKS, DKDV_BLOCKS, DQ_BLOCKS)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, FWD_BLOCKS) flash_forward_##HS(        \
        bf16* out, float* lse, const bf16* qkv, int T, int NH, float sl2) {                      \
        flash_forward_entry<HS>(out, lse, qkv, T, NH, sl2);                                      \
    }                                                                                            \
    extern "C" __global__ void flash_dsum_##HS(float* dsum, const bf16* dout, const bf16* out,   \
                                               int T, int NH) {                                  \
        flash_dsum<HS>(dsum, dout, out, T, NH);                                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, DKDV_BLOCKS) flash_dkdv_##HS(          \
        bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* dsum,      \
        int T, int NH, float sl2, float scale, bf16* dS, bf16* dS2, int split) {                 \
        flash_dkdv_entry<HS>(dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale, dS, dS2, split);     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, DQ_BLOCKS) flash_dq_##HS(              \
        bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* dsum,      \
        int T, int NH, float sl2, float scale) {                                                 \
        flash_dq_entry<HS>(dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale);                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, 4) flash_dq_ds_##HS(                   \
        bf16* dqkv, const bf16* qkv, bf16* dS, bf16* dS2, int split, int T, int NH, float scale) { \
        flash_dq_ds_entry<HS>(dqkv, qkv, dS, dS2, split, T, NH, scale);                          \
    }

FLASH_ENTRIES(16, 4, 3, 3)
FLASH_ENTRIES(32, 4, 3, 3)
FLASH_ENTRIES(64, 4, 3, 3)
FLASH_ENTRIES(80, 3, 3, 3)
FLASH_ENTRIES(96, 2, 2, 2)
// Head size 128's blocks per SM may come from the loader
// (`BRAID_FLASH128_BLOCKS`), for measuring: 2, 2, 2 otherwise.
#ifndef FLASH128_FWD
#define FLASH128_FWD 2
#endif
#ifndef FLASH128_DKDV
#define FLASH128_DKDV 2
#endif
#ifndef FLASH128_DQ
#define FLASH128_DQ 2
#endif
FLASH_ENTRIES(128, FLASH128_FWD, FLASH128_DKDV, FLASH128_DQ)

// dst [N, 3C] (bf16) = src + bias [3C] (f32), 8 values per thread (may be in place).
extern "C" __global__ void add_bias_bf(bf16* dst, const bf16* src, const float* bias, int N, int C3) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)N * C3 / 8) return;
    int c = (int)((i * 8) % C3);
    uint4 u = ((const uint4*)src)[i];
    unsigned* w = (unsigned*)&u;
    for (int e = 0; e < 4; e++)
        w[e] = pack2(lo_f(w[e]) + bias[c + 2 * e], hi_f(w[e]) + bias[c + 2 * e + 1]);
    ((uint4*)dst)[i] = u;
}

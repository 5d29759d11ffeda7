// braid's fused causal attention, forward and backward passes, on
// Hopper's warpgroup products (`wgmma`, sm_90a). Appended to flash.cu's source (whose helpers
// it uses: cp16, the online softmax, the fragment packing, the row
// stores) and compiled for compute_90a, so this file is only built for
// GPUs of compute capability 9.0.
//
// Each warpgroup of 128 threads owns 64 query rows of one (batch, head);
// a block is two of them sharing the streamed tiles (the forward kernel
// also comes with one a block, `BRAID_FLASH_FORWARD=wgmma` against
// `wgmma2`). Key and value tiles of 64 rows
// move global -> shared memory with cp.async, double-buffered, in the
// 128-byte-swizzled layout `wgmma` reads: per tile, HS / 64 column atoms
// of 64 rows x 128 bytes, the 16-byte chunk c of row r stored at chunk
// c ^ (r % 8). Q stays in registers as the A operand (read once from
// global memory), so the scores S = Q K^T (64 x 64 per warpgroup, K as a
// K-major B operand) and the output O += P V (P from the scores'
// registers, V as a transposed, N-major B operand, one product per 64
// head values) never leave the registers. The accumulators have mma.sync's layout per warp (warp w of
// the warpgroup holds rows 16 w .. 16 w + 15), so the softmax, the masking
// and the stores are flash.cu's.
//
// Each product is issued, committed and waited for before its registers
// are read: other warpgroups on the SM, not one warpgroup's pipeline, keep
// the tensor cores busy while one runs its softmax.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_THREADS 256    // two warpgroups
#define WG_ROWS 128       // query rows per block (64 per warpgroup)
#define WG_KEYS 64        // keys per tile

// A shared-memory matrix descriptor of the swizzled tiles at `p`: 128-byte
// swizzle, groups of 8 rows 1024 bytes apart (the stride byte offset);
// the leading byte offset, the distance between column atoms, is unused
// (each product's operand is one atom wide) and set to 16.
__device__ __forceinline__ unsigned long long wg_desc(const void* p) {
    unsigned long long a = smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// Byte offset in a swizzled tile of a K-major operand's k-step `ks` (16
// head values: 32 bytes into the current column atom of 64).
__device__ __forceinline__ int kmajor_step(int ks) {
    return (ks >> 2) * (WG_KEYS * 128) + (ks & 3) * 32;
}

// ... of an N-major operand's k-step `kk` (16 rows, 2048 bytes) in column
// atom `at` (64 head values).
__device__ __forceinline__ int nmajor_step(int kk, int at) {
    return at * (WG_KEYS * 128) + kk * 16 * 128;
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Waits for every committed group of products but the newest.
__device__ __forceinline__ void wg_wait_all_but_newest() {
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Shared memory written by cp.async (the generic proxy) made visible to
// wgmma's reads (the async proxy).
__device__ __forceinline__ void wg_smem_visible() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins registers a product reads or writes asynchronously to this point
// of the program, so the compiler neither reads them early nor reuses
// them while the product runs.
template <int N>
__device__ __forceinline__ void wg_pin(float (*d)[4]) {
    for (int j = 0; j < N; j++)
        for (int i = 0; i < 4; i++) asm volatile("" : "+f"(d[j][i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_pin_a(unsigned (*a)[4]) {
    for (int j = 0; j < N; j++)
        for (int i = 0; i < 4; i++) asm volatile("" : "+r"(a[j][i])::"memory");
}

// The products, m64n64k16 (64 x 64 per warpgroup) with B by descriptor,
// transposed where TB is 1 (an N-major B); `acc` 0 overwrites d. A comes
// from 4 registers (mma.sync's A fragment of the warp's 16 rows: `_rs`)
// or by descriptor (transposed where TA is 1: `_ss`). Inline PTX names
// each of the 32 accumulator registers: WG_D lists them as operands,
// WG_D_NAMES as the instruction's first argument.
#define WG_D(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),\
    "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),\
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),\
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),\
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),\
    "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),\
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),\
    "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WG_D_NAMES \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

template <int TB>
__device__ __forceinline__ void wg_n64_rs(float (*d)[4], const unsigned* a, unsigned long long b,
                                          int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D_NAMES
                 ", {%32, %33, %34, %35}, %37, p, 1, 1, %38;\n}\n"
                 : WG_D(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(acc), "l"(b), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void wg_n64_ss(float (*d)[4], unsigned long long a, unsigned long long b,
                                          int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %32, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D_NAMES
                 ", %33, %34, p, 1, 1, %35, %36;\n}\n"
                 : WG_D(d)
                 : "r"(acc), "l"(a), "l"(b), "n"(TA), "n"(TB));
}

// d (64 x 64) = A B^T over the head: A and B K-major swizzled tiles of 64
// rows x HS (scores of a warpgroup's rows against a tile's keys, or their
// transpose).
template <int HS>
__device__ __forceinline__ void wg_scores(float (*d)[4], const unsigned char* a,
                                          const unsigned char* b) {
    for (int ks = 0; ks < HS / 16; ks++)
        wg_n64_ss<0, 0>(d, wg_desc(a + kmajor_step(ks)), wg_desc(b + kmajor_step(ks)), ks);
}

// d (64 x HS) += a (64 x 64 in registers: 4 k-steps of A fragments) * B,
// an N-major swizzled tile of 64 rows x HS; one product per column atom.
template <int HS>
__device__ __forceinline__ void wg_accumulate(float (*d)[4], const unsigned (*a)[4],
                                              const unsigned char* b) {
    for (int kk = 0; kk < WG_KEYS / 16; kk++)
        for (int at = 0; at < HS / 64; at++)
            wg_n64_rs<1>(d + 8 * at, a[kk], wg_desc(b + nmajor_step(kk, at)), 1);
}

// wg_accumulate issued alone and waited for: d and a are the program's
// again when it returns.
template <int HS>
__device__ __forceinline__ void wg_accumulate_now(float (*d)[4], unsigned (*a)[4],
                                                  const unsigned char* b) {
    wg_fence();
    wg_accumulate<HS>(d, a, b);
    wg_commit();
    wg_wait();
    wg_pin<HS / 8>(d);
    wg_pin_a<WG_KEYS / 16>(a);
}

// Key rows [row0, row0 + 64) of one head's K or V slice (`src` at row 0,
// rows `stride` apart) into a swizzled tile, by the block's NTH threads;
// rows past T read as 0.
template <int HS, int NTH = WG_THREADS>
__device__ __forceinline__ void wg_load_tile(unsigned char* dst, const bf16* src, int row0, int T,
                                             long stride) {
    constexpr int CH = HS / 8;
    for (int i = threadIdx.x; i < WG_KEYS * CH; i += NTH) {
        int r = i / CH, c = i % CH, row = row0 + r;
        bool ok = row < T;
        unsigned char* d = dst + (c >> 3) * (WG_KEYS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        cp16(d, ok ? src + row * stride + c * 8 : src, ok);
    }
}

// Key tile j's stage of `kv` (two stages of a K and a V tile), once it
// has landed and every thread and the products can read it; starts
// loading tile j + 1 into the other stage first, where there is one.
template <int HS, int NTH = WG_THREADS>
__device__ __forceinline__ unsigned char* wg_next_kv(unsigned char* kv, const bf16* k, const bf16* v,
                                                     int j, int tiles, int T, long stride) {
    constexpr int TILE_B = WG_KEYS * HS * 2;
    if (j + 1 < tiles) {
        unsigned char* next = kv + ((j + 1) & 1) * 2 * TILE_B;
        wg_load_tile<HS, NTH>(next, k, (j + 1) * WG_KEYS, T, stride);
        wg_load_tile<HS, NTH>(next + TILE_B, v, (j + 1) * WG_KEYS, T, stride);
        cp_commit();
        cp_wait<1>();
    } else {
        cp_wait<0>();
    }
    wg_smem_visible();
    __syncthreads();
    return kv + (j & 1) * 2 * TILE_B;
}

// A warp's rows row0 and row1 (= row0 + 8) of Q (the head's slice at `q`,
// rows `stride` apart) as A fragments over the head (rows past T as 0).
template <int HS>
__device__ __forceinline__ void wg_load_q(unsigned (*qf)[4], const bf16* q, int row0, int row1,
                                          int t, int T, long stride) {
    for (int ks = 0; ks < HS / 16; ks++) {
        const bf16* p = q + ks * 16 + 2 * t;
        qf[ks][0] = row0 < T ? ld32(p + row0 * stride) : 0u;
        qf[ks][1] = row1 < T ? ld32(p + row1 * stride) : 0u;
        qf[ks][2] = row0 < T ? ld32(p + row0 * stride + 8) : 0u;
        qf[ks][3] = row1 < T ? ld32(p + row1 * stride + 8) : 0u;
    }
}

// G warpgroups a block (64 G query rows, sharing the key and value
// tiles; with G = 1 the blocks on an SM run unsynchronised, so one's
// products can overlap another's softmax). grid (B*NH, ceil(T/64G)), the
// longest row blocks first; `smraw` holds two stages of (K, V) tiles,
// 64 x HS each, from its first 1024-byte boundary. lse as flash_forward's.
template <int HS, int G>
__device__ void flash_forward_wg(unsigned char* smraw, bf16* out, float* lse, const bf16* qkv, int T,
                                 int NH, float sl2) {
    constexpr int NT = HS / 8, TILE_B = WG_KEYS * HS * 2, NTH = 128 * G, ROWS = 64 * G;
    unsigned char* sm = smraw + ((1024 - (smem_addr(smraw) & 1023)) & 1023);
    int nqb = (T + ROWS - 1) / ROWS;
    Place at = block_place(nqb);
    int qb = nqb - 1 - at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int g = lane >> 2, t = lane & 3;
    int q0 = qb * ROWS + wg * 64;  // this warpgroup's first row
    int mine = q0 / WG_KEYS;       // its diagonal key tile
    int tiles = min(G * qb + G, (T + WG_KEYS - 1) / WG_KEYS);
    bool rows = q0 < T;  // the last block's second warpgroup may have none

    wg_load_tile<HS, NTH>(sm, k, 0, T, stride);
    wg_load_tile<HS, NTH>(sm + TILE_B, v, 0, T, stride);
    cp_commit();

    int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    unsigned qf[HS / 16][4];
    wg_load_q<HS>(qf, q, row0, row1, t, T, stride);

    float o[NT][4];
    for (int nt = 0; nt < NT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    for (int j = 0; j < tiles; j++) {
        unsigned char* kt = wg_next_kv<HS, NTH>(sm, k, v, j, tiles, T, stride);
        if (rows && j <= mine) {
            float s[WG_KEYS / 8][4];
            wg_fence();
            for (int ks = 0; ks < HS / 16; ks++)
                wg_n64_rs<0>(s, qf[ks], wg_desc(kt + kmajor_step(ks)), ks);
            wg_commit();
            wg_wait();
            wg_pin<WG_KEYS / 8>(s);
            wg_pin_a<HS / 16>(qf);
            // Only the diagonal tile has keys past some of its rows; key
            // j * 64 <= every row, so each row has a finite score.
            if (j == mine) mask_past_rows(s, j * WG_KEYS + 2 * t, row0, row1);
            softmax_tile<NT>(s, o, m0, m1, l0, l1, sl2);
            unsigned pf[WG_KEYS / 16][4];
            to_a(pf, s);
            wg_accumulate_now<HS>(o, pf, kt + TILE_B);  // O += P V
        }
        __syncthreads();
    }
    if (rows)
        finish_rows<HS>(out + (long)b * T * C + h * HS, lse + (long)bh * T, o, m0, m1, l0, l1, q0, T,
                        C, warp, lane);
}

// The forward pass pipelined within each warpgroup (FlashAttention-3's
// intra-warpgroup overlap; `BRAID_FLASH_FORWARD=wgmma2p`): two warpgroups
// a block as flash_forward_wg<HS, 2>, four stages of (K, V) tiles. At key
// tile j a warpgroup issues the scores of tile j + 1 and, while the tensor
// cores take them, runs the softmax of tile j's; then waits for tile
// j - 1's P V (issued one tile back), rescales its output and issues
// tile j's P V, and waits only for the next scores. So the softmax and
// the rescale run under products instead of between them. Tile j + 2
// loads into the stage tile j - 2 left (its P V waited for in the
// previous tile's step, by every warpgroup before the barrier). The same
// arithmetic in the same order as flash_forward_wg: the same bits.
template <int HS>
__device__ void flash_forward_wgp(unsigned char* smraw, bf16* out, float* lse, const bf16* qkv,
                                  int T, int NH, float sl2) {
    constexpr int G = 2, NT = HS / 8, TILE_B = WG_KEYS * HS * 2, NTH = 128 * G, ROWS = 64 * G;
    constexpr int STAGES = 4;
    unsigned char* sm = smraw + ((1024 - (smem_addr(smraw) & 1023)) & 1023);
    int nqb = (T + ROWS - 1) / ROWS;
    Place at = block_place(nqb);
    int qb = nqb - 1 - at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int g = lane >> 2, t = lane & 3;
    int q0 = qb * ROWS + wg * 64;
    int mine = q0 / WG_KEYS;
    int tiles = min(G * qb + G, (T + WG_KEYS - 1) / WG_KEYS);
    bool rows = q0 < T;
    // Tile j's stage; every load is its own cp.async group (an empty one
    // past the last tile), so "all but the newest group" is tile j + 1.
    auto stage = [&](int j) { return sm + (j % STAGES) * 2 * TILE_B; };
    auto load = [&](int j) {
        if (j < tiles) {
            wg_load_tile<HS, NTH>(stage(j), k, j * WG_KEYS, T, stride);
            wg_load_tile<HS, NTH>(stage(j) + TILE_B, v, j * WG_KEYS, T, stride);
        }
        cp_commit();
    };
    load(0);
    load(1);

    int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    unsigned qf[HS / 16][4];
    wg_load_q<HS>(qf, q, row0, row1, t, T, stride);
    float o[NT][4];
    for (int nt = 0; nt < NT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float s[WG_KEYS / 8][4], sn[WG_KEYS / 8][4];
    unsigned pf[WG_KEYS / 16][4];
    // Tile 0 landed; its scores.
    cp_wait<1>();
    wg_smem_visible();
    __syncthreads();
    if (rows) {
        wg_fence();
        for (int ks = 0; ks < HS / 16; ks++)
            wg_n64_rs<0>(s, qf[ks], wg_desc(stage(0) + kmajor_step(ks)), ks);
        wg_commit();
        wg_wait();
        wg_pin<WG_KEYS / 8>(s);
        wg_pin_a<HS / 16>(qf);
    }
    bool pending = false;  // a P V issued and not yet waited for
    for (int j = 0; j < tiles; j++) {
        // Tile j + 1 resident for every thread; tile j + 2 loads into the
        // stage of tile j - 2, whose P V every warpgroup waited for in
        // step j - 1, before this barrier.
        __syncthreads();
        load(j + 2);
        cp_wait<2>();
        wg_smem_visible();
        __syncthreads();
        bool act = rows && j <= mine, next = rows && j + 1 <= mine && j + 1 < tiles;
        if (next) {
            wg_fence();
            for (int ks = 0; ks < HS / 16; ks++)
                wg_n64_rs<0>(sn, qf[ks], wg_desc(stage(j + 1) + kmajor_step(ks)), ks);
            wg_commit();
        }
        if (act) {
            if (j == mine) mask_past_rows(s, j * WG_KEYS + 2 * t, row0, row1);
            float c0, c1;
            softmax_scores(s, m0, m1, l0, l1, sl2, c0, c1);
            if (pending) {
                // Tile j - 1's P V, older than the scores just issued.
                if (next) {
                    wg_wait_all_but_newest();
                } else {
                    wg_wait();
                }
                wg_pin<NT>(o);
                wg_pin_a<WG_KEYS / 16>(pf);
            }
            to_a(pf, s);
            rescale_rows<NT>(o, c0, c1);
            wg_fence();
            wg_accumulate<HS>(o, pf, stage(j) + TILE_B);  // O += P V
            wg_commit();
            pending = true;
        }
        if (next) {
            // The next scores (this tile's P V may still run).
            if (act) {
                wg_wait_all_but_newest();
            } else {
                wg_wait();
            }
            wg_pin<WG_KEYS / 8>(sn);
            wg_pin_a<HS / 16>(qf);
            for (int i = 0; i < WG_KEYS / 8; i++)
                for (int e = 0; e < 4; e++) s[i][e] = sn[i][e];
        } else if (pending) {
            wg_wait();
            wg_pin<NT>(o);
            wg_pin_a<WG_KEYS / 16>(pf);
            pending = false;
        }
    }
    if (rows)
        finish_rows<HS>(out + (long)b * T * C + h * HS, lse + (long)bh * T, o, m0, m1, l0, l1, q0, T,
                        C, warp, lane);
}

// ---- backward: dK and dV -------------------------------------------------
// The keys are the rows: per 64-row query tile, S^T = K Q^T and
// dP^T = V dO^T take K and V (this warpgroup's 64 keys) and Q and dO by
// descriptor, all K-major; P^T = exp2(S^T * sl2 - lse) and dS^T = P^T o
// (dP^T - D) stay in registers and feed dV += P^T dO and dK += dS^T Q as
// A operands, Q and dO now read N-major (the same swizzled tiles). With
// `dS` the kernel also stores each tile's dS^T for flash_dq_ds, in the
// slots flash_dkdv uses.
//
// grid (B*NH, ceil(T/128)), rank y = 0 the longest walk; each warpgroup
// owns 64 keys (the block 128) and walks the query tiles at or after its
// own. Shared memory from its first 1024-byte boundary: the block's K
// tiles and V tiles (two of 64 keys each), two stages of (Q, dO) tiles,
// then two stages of the query rows' lse and dsum.
template <int HS>
__device__ void flash_dkdv_wg(unsigned char* smraw, bf16* dqkv, const bf16* qkv, const bf16* dout,
                              const float* lse, const float* dsum, int T, int NH, float sl2,
                              float scale, bf16* dS) {
    constexpr int NT = HS / 8, TILE_B = WG_KEYS * HS * 2;
    unsigned char* sm = smraw + ((1024 - (smem_addr(smraw) & 1023)) & 1023);
    unsigned char *sk = sm, *sv = sm + 2 * TILE_B, *sqd = sm + 4 * TILE_B;
    float* sLD = (float*)(sm + 8 * TILE_B);  // [stage][lse x 64, dsum x 64]
    int nqt = (T + WG_KEYS - 1) / WG_KEYS;
    Place at = block_place((T + WG_ROWS - 1) / WG_ROWS);
    int kb = at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    const bf16* dO = dout + (long)b * T * C + h * HS;
    const float* L = lse + (long)bh * T;
    const float* D = dsum + (long)bh * T;
    int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int g = lane >> 2, t = lane & 3;
    int k0 = kb * WG_ROWS + wg * WG_KEYS;  // this warpgroup's first key
    int mine = k0 / WG_KEYS;               // its diagonal query tile
    int first = 2 * kb;                    // the block's first query tile
    bool keys = k0 < T;  // the last block's second warpgroup may have none

    for (int w = 0; w < 2; w++) {
        wg_load_tile<HS>(sk + w * TILE_B, k, kb * WG_ROWS + w * WG_KEYS, T, stride);
        wg_load_tile<HS>(sv + w * TILE_B, v, kb * WG_ROWS + w * WG_KEYS, T, stride);
    }
    auto stage = [&](int st, int qt) {
        unsigned char* d = sqd + st * 2 * TILE_B;
        wg_load_tile<HS>(d, q, qt * WG_KEYS, T, stride);
        wg_load_tile<HS>(d + TILE_B, dO, qt * WG_KEYS, T, C);
        stage_rows(sLD + st * 128, sLD + st * 128 + WG_KEYS, L, D, qt * WG_KEYS, T);
        cp_commit();
    };
    float dk[NT][4], dv[NT][4];
    for (int nt = 0; nt < NT; nt++)
        for (int e = 0; e < 4; e++) dk[nt][e] = dv[nt][e] = 0.f;
    int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
    stage(0, first);
    for (int qt = first; qt < nqt; qt++) {
        int cur = (qt - first) & 1;
        if (qt + 1 < nqt) {
            stage(cur ^ 1, qt + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        wg_smem_visible();
        __syncthreads();
        if (keys && qt >= mine) {
            unsigned char *tq = sqd + cur * 2 * TILE_B, *tdo = tq + TILE_B;
            unsigned char *tk = sk + wg * TILE_B, *tv = sv + wg * TILE_B;
            const float *sL = sLD + cur * 128, *sD = sL + WG_KEYS;
            float p[WG_KEYS / 8][4], dp[WG_KEYS / 8][4];
            wg_fence();
            wg_scores<HS>(p, tk, tq);    // S^T = K Q^T
            wg_scores<HS>(dp, tv, tdo);  // dP^T = V dO^T
            wg_commit();
            wg_wait();
            wg_pin<WG_KEYS / 8>(p);
            wg_pin<WG_KEYS / 8>(dp);
            for (int nt = 0; nt < WG_KEYS / 8; nt++) {
                int c = nt * 8 + 2 * t;
                transposed_grads(p[nt], dp[nt], sl2, sL[c], sL[c + 1], sD[c], sD[c + 1], qt == mine,
                                 qt * WG_KEYS + c, key0, key1);
            }
            unsigned pa[WG_KEYS / 16][4], sa[WG_KEYS / 16][4];
            to_a(pa, p);
            to_a(sa, dp);
            if (dS) {
                // dS^T (bf16) into tile (qt, mine), as flash_dkdv stores
                // it: per half of 32 queries, each thread's 8 values of a
                // row as one 16-byte word in slot 4 half + t.
                uint4* tile = (uint4*)(dS + score_tile(0, nqt, qt, mine));
                int kr = warp * 16 + g;
                for (int hf = 0; hf < 2; hf++) {
                    int slot = hf * 4 + t;
                    const unsigned *a0 = sa[2 * hf], *a1 = sa[2 * hf + 1];
                    tile[kr * (WG_KEYS / 8) + slot] = make_uint4(a0[0], a0[2], a1[0], a1[2]);
                    tile[(kr + 8) * (WG_KEYS / 8) + slot] = make_uint4(a0[1], a0[3], a1[1], a1[3]);
                }
            }
            wg_fence();
            wg_accumulate<HS>(dv, pa, tdo);  // dV += P^T dO
            wg_accumulate<HS>(dk, sa, tq);   // dK += dS^T Q
            wg_commit();
            wg_wait();
            wg_pin<NT>(dk);
            wg_pin<NT>(dv);
            wg_pin_a<WG_KEYS / 16>(pa);
            wg_pin_a<WG_KEYS / 16>(sa);
        }
        __syncthreads();
    }
    if (!keys) return;
    bf16* base = dqkv + (long)b * T * stride + h * HS;
    store_rows<HS>(base + C, dk, scale, scale, k0, T, stride, warp, lane);
    store_rows<HS>(base + 2 * C, dv, 1.f, 1.f, k0, T, stride, warp, lane);
}

// ---- backward: dQ, recomputing the score gradients -----------------------
// dQ = dS K (times the scale) for 64 query rows per warpgroup (the block
// 128, the longest walks first), recomputing per key tile S = Q K^T and
// dP = dO V^T (Q and dO of this warpgroup's rows, K and V: all by
// descriptor, K-major), P and dS = P (dP - D) in registers as flash_dq
// does, then dQ += dS K with K read N-major. Shared memory from its first
// 1024-byte boundary: the two warpgroups' Q and dO tiles, then two stages
// of the K and V tiles.
template <int HS>
__device__ void flash_dq_wg(unsigned char* smraw, bf16* dqkv, const bf16* qkv, const bf16* dout,
                            const float* lse, const float* dsum, int T, int NH, float sl2,
                            float scale) {
    constexpr int NT = HS / 8, TILE_B = WG_KEYS * HS * 2;
    unsigned char* sm = smraw + ((1024 - (smem_addr(smraw) & 1023)) & 1023);
    unsigned char *sqd = sm, *skv = sm + 4 * TILE_B;
    int nqt = (T + WG_KEYS - 1) / WG_KEYS, nblk = (T + WG_ROWS - 1) / WG_ROWS;
    Place at = block_place(nblk);
    int qblk = nblk - 1 - at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* q = qkv + (long)b * T * stride + h * HS;
    const bf16 *k = q + C, *v = q + 2 * C;
    const bf16* dO = dout + (long)b * T * C + h * HS;
    int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int g = lane >> 2, t = lane & 3;
    int q0 = qblk * WG_ROWS + wg * WG_KEYS;  // this warpgroup's first row
    int mine = q0 / WG_KEYS;                 // its diagonal key tile
    int tiles = min(2 * qblk + 2, nqt);
    bool rows = q0 < T;  // the last block's second warpgroup may have none

    for (int w = 0; w < 2; w++) {
        unsigned char* d = sqd + w * 2 * TILE_B;
        wg_load_tile<HS>(d, q, qblk * WG_ROWS + w * WG_KEYS, T, stride);
        wg_load_tile<HS>(d + TILE_B, dO, qblk * WG_ROWS + w * WG_KEYS, T, C);
    }
    wg_load_tile<HS>(skv, k, 0, T, stride);
    wg_load_tile<HS>(skv + TILE_B, v, 0, T, stride);
    cp_commit();
    int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    const float* L = lse + (long)bh * T;
    const float* D = dsum + (long)bh * T;
    float la = row0 < T ? L[row0] : -NEG_INF, lb = row1 < T ? L[row1] : -NEG_INF;
    float da = row0 < T ? D[row0] : 0.f, db = row1 < T ? D[row1] : 0.f;

    float dq[NT][4];
    for (int nt = 0; nt < NT; nt++) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
    for (int j = 0; j < tiles; j++) {
        unsigned char* kt = wg_next_kv<HS>(skv, k, v, j, tiles, T, stride);
        if (rows && j <= mine) {
            unsigned char *tq = sqd + wg * 2 * TILE_B, *tdo = tq + TILE_B, *vt = kt + TILE_B;
            float p[WG_KEYS / 8][4], dp[WG_KEYS / 8][4];
            wg_fence();
            wg_scores<HS>(p, tq, kt);    // S = Q K^T
            wg_scores<HS>(dp, tdo, vt);  // dP = dO V^T
            wg_commit();
            wg_wait();
            wg_pin<WG_KEYS / 8>(p);
            wg_pin<WG_KEYS / 8>(dp);
            for (int nt = 0; nt < WG_KEYS / 8; nt++)
                row_grads(p[nt], dp[nt], sl2, la, lb, da, db, j == mine, j * WG_KEYS + nt * 8 + 2 * t,
                          row0, row1);
            unsigned sa[WG_KEYS / 16][4];
            to_a(sa, dp);
            wg_accumulate_now<HS>(dq, sa, kt);  // dQ += dS K
        }
        __syncthreads();
    }
    if (rows)
        store_rows<HS>(dqkv + (long)b * T * stride + h * HS, dq, scale, scale, q0, T, stride, warp,
                       lane);
}

// ---- backward: dQ from the stored score gradients ------------------------
// dQ = dS K (times the scale) for 64 query rows per warpgroup (the block
// 128, the longest walks first), over the key tiles up to its own: A is
// the tile of dS^T flash_dkdv(_wg) stored (keys x query slots, 128 bytes a
// key: read transposed, M-major), B the K tile read N-major. The
// accumulator's rows are query slots, mapped back to queries at the
// store as flash_dq_ds maps them. Shared memory from its first 1024-byte
// boundary: two stages of a K tile and the two warpgroups' dS tiles.
template <int HS>
__device__ void flash_dq_ds_wg(unsigned char* smraw, bf16* dqkv, const bf16* qkv, const bf16* dS,
                               int T, int NH, float scale) {
    constexpr int NT = HS / 8, TILE_B = WG_KEYS * HS * 2, S_B = WG_KEYS * WG_KEYS * 2;
    constexpr int STAGE_B = TILE_B + 2 * S_B;
    unsigned char* sm = smraw + ((1024 - (smem_addr(smraw) & 1023)) & 1023);
    int nqt = (T + WG_KEYS - 1) / WG_KEYS, nblk = (T + WG_ROWS - 1) / WG_ROWS;
    Place at = block_place(nblk);
    int qblk = nblk - 1 - at.y, bh = at.bh;
    int b = bh / NH, h = bh % NH, C = NH * HS;
    long stride = 3L * C;
    const bf16* k = qkv + (long)b * T * stride + h * HS + C;
    int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int qt = 2 * qblk + wg;  // this warpgroup's query tile
    bool rows = qt < nqt;    // the last block's second warpgroup may have none
    int last = min(2 * qblk + 1, nqt - 1);
    auto stage = [&](int st, int j) {
        unsigned char* d = sm + st * STAGE_B;
        wg_load_tile<HS>(d, k, j * WG_KEYS, T, stride);
        for (int w = 0; w < 2; w++) {
            int qw = 2 * qblk + w;
            if (qw < nqt && j <= qw)
                wg_load_tile<WG_KEYS>(d + TILE_B + w * S_B, dS + score_tile(0, nqt, qw, j), 0,
                                      WG_KEYS, WG_KEYS);
        }
        cp_commit();
    };
    float dq[NT][4];
    for (int nt = 0; nt < NT; nt++) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
    stage(0, 0);
    for (int j = 0; j <= last; j++) {
        int cur = j & 1;
        if (j < last) {
            stage(cur ^ 1, j + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        wg_smem_visible();
        __syncthreads();
        if (rows && j <= qt) {
            unsigned char *kt = sm + cur * STAGE_B, *st = kt + TILE_B + wg * S_B;
            wg_fence();
            // 16 keys a step (2048 bytes into both tiles); one product per
            // column atom of 64 head values.
            for (int kk = 0; kk < WG_KEYS / 16; kk++)
                for (int at = 0; at < HS / 64; at++)
                    wg_n64_ss<1, 1>(dq + 8 * at, wg_desc(st + nmajor_step(kk, 0)),
                                    wg_desc(kt + nmajor_step(kk, at)), 1);
            wg_commit();
            wg_wait();
            wg_pin<NT>(dq);
        }
        __syncthreads();
    }
    if (rows)
        store_query_slots<HS>(dqkv + (long)b * T * stride + h * HS, dq, scale, qt * WG_KEYS, T, stride,
                              warp, lane);
}

// Entry points of the forward pass: `_HS` one warpgroup a block,
// `_HS_2` two; head size 64 at four (two) blocks per SM, 128 at two (one):
// its output accumulator alone is 64 registers a thread.
#define FLASH_FORWARD_WG(HS, G, SUFFIX, BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(128 * G, BLOCKS) flash_forward_wg_##HS##SUFFIX( \
        bf16* out, float* lse, const bf16* qkv, int T, int NH, float sl2) {                       \
        extern __shared__ unsigned char wg_smem[];                                                \
        flash_forward_wg<HS, G>(wg_smem, out, lse, qkv, T, NH, sl2);                             \
    }
FLASH_FORWARD_WG(64, 1, , 4)
FLASH_FORWARD_WG(128, 1, , 2)
FLASH_FORWARD_WG(64, 2, _2, 2)
FLASH_FORWARD_WG(128, 2, _2, 1)
// The pipelined forward (`_HS_2p`): one block per SM at either head size
// (two score tiles and the output in registers).
#define FLASH_FORWARD_WGP(HS)                                                                     \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_forward_wg_##HS##_2p(      \
        bf16* out, float* lse, const bf16* qkv, int T, int NH, float sl2) {                       \
        extern __shared__ unsigned char wg_smem[];                                                \
        flash_forward_wgp<HS>(wg_smem, out, lse, qkv, T, NH, sl2);                               \
    }
FLASH_FORWARD_WGP(64)
FLASH_FORWARD_WGP(128)
// dK/dV: one block per SM at either head size (its two accumulators).
#define FLASH_DKDV_WG(HS)                                                                         \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_dkdv_wg_##HS(              \
        bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* dsum,      \
        int T, int NH, float sl2, float scale, bf16* dS, bf16* dS2, int split) {                 \
        extern __shared__ unsigned char wg_smem[];                                               \
        int bh = block_place((T + WG_ROWS - 1) / WG_ROWS).bh;                                   \
        bf16* head = score_head(dS, dS2, split, bh, (T + WG_KEYS - 1) / WG_KEYS);               \
        flash_dkdv_wg<HS>(wg_smem, dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale, head);         \
    }
FLASH_DKDV_WG(64)
FLASH_DKDV_WG(128)
// dQ from stored dS: two blocks per SM (its accumulator alone).
#define FLASH_DQ_DS_WG(HS)                                                                        \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 2) flash_dq_ds_wg_##HS(             \
        bf16* dqkv, const bf16* qkv, bf16* dS, bf16* dS2, int split, int T, int NH, float scale) { \
        extern __shared__ unsigned char wg_smem[];                                               \
        int bh = block_place((T + WG_ROWS - 1) / WG_ROWS).bh;                                   \
        const bf16* head = score_head(dS, dS2, split, bh, (T + WG_KEYS - 1) / WG_KEYS);         \
        flash_dq_ds_wg<HS>(wg_smem, dqkv, qkv, head, T, NH, scale);                              \
    }
FLASH_DQ_DS_WG(64)
FLASH_DQ_DS_WG(128)
// dQ recomputing dS: one block per SM.
#define FLASH_DQ_WG(HS)                                                                           \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_dq_wg_##HS(                \
        bf16* dqkv, const bf16* qkv, const bf16* dout, const float* lse, const float* dsum,      \
        int T, int NH, float sl2, float scale) {                                                 \
        extern __shared__ unsigned char wg_smem[];                                               \
        flash_dq_wg<HS>(wg_smem, dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale);                 \
    }
FLASH_DQ_WG(64)
FLASH_DQ_WG(128)
#endif

// Times braid's fused attention kernels (crates/braid-model/src/cuda/flash.cu)
// at the shapes of GPT-2 1558M, the 2.65B model and a head size of 128
// (B 8, T 1024), with the dQ kernel reading stored score gradients and
// recomputing them, and prints a hash of dqkv so that the two (and kernel
// variants) can be compared bit for bit. Built and run by run.sh on a GPU
// machine with nvcc; braid itself compiles flash.cu with NVRTC.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../crates/braid-model/src/cuda/flash.cu"

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);               \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static unsigned short to_bf16(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return u >> 16;
}

// Median of `reps` timed runs of f, in ms.
template <typename F>
static float time_ms(F f, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ts;
    for (int r = 0; r < reps; r++) {
        cudaEventRecord(a);
        f();
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}

typedef void (*Fwd)(bf16*, float*, const bf16*, int, int, float);
typedef void (*Dsum)(float*, const bf16*, const bf16*, int, int);
typedef void (*Dkdv)(bf16*, const bf16*, const bf16*, const float*, const float*, int, int, float, float, bf16*, bf16*, int);
typedef void (*Dq)(bf16*, const bf16*, const bf16*, const float*, const float*, int, int, float, float);
typedef void (*DqStored)(bf16*, const bf16*, bf16*, bf16*, int, int, int, float);

template <int HS>
static void run(int B, int NH, int T, Fwd fwd, Dsum dsum_k, Dkdv dkdv, Dq dq, DqStored dqs) {
    int C = NH * HS, nb = (T + 63) / 64;
    long n3 = (long)B * T * 3 * C, n1 = (long)B * T * C, nl = (long)B * NH * T;
    long nds = (long)B * NH * nb * (nb + 1) / 2 * 64 * 64;
    std::vector<unsigned short> h(n3), hd(n1);
    srand(1);
    for (auto& x : h) x = to_bf16((rand() / (float)RAND_MAX - 0.5f) * 2.f);
    for (auto& x : hd) x = to_bf16((rand() / (float)RAND_MAX - 0.5f) * 0.1f);
    bf16 *qkv, *dqkv, *out, *dout, *ds;
    float *lse, *dsum;
    CK(cudaMalloc(&qkv, n3 * 2));
    CK(cudaMalloc(&dqkv, n3 * 2));
    CK(cudaMalloc(&out, n1 * 2));
    CK(cudaMalloc(&dout, n1 * 2));
    CK(cudaMalloc(&ds, nds * 2));
    CK(cudaMalloc(&lse, nl * 4));
    CK(cudaMalloc(&dsum, nl * 4));
    CK(cudaMemcpy(qkv, h.data(), n3 * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, hd.data(), n1 * 2, cudaMemcpyHostToDevice));
    float scale = 1.f / sqrtf((float)HS), sl2 = 1.4426950408889634f * scale;
    dim3 grid(B * NH, nb);
    int tile = 64 * (HS + 8) * 2;
    int fwd_b = 4 * tile, dkdv_b = 6 * tile + 2 * 2 * 64 * 4, dqs_b = 2 * tile + 2 * 64 * 72 * 2;
    CK(cudaFuncSetAttribute(fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, fwd_b));
    CK(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_b));
    CK(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, fwd_b));
    CK(cudaFuncSetAttribute(dqs, cudaFuncAttributeMaxDynamicSharedMemorySize, dqs_b));
    auto F = [&] { fwd<<<grid, 128, fwd_b>>>(out, lse, qkv, T, NH, sl2); };
    auto S = [&] { dsum_k<<<B * T, 128>>>(dsum, dout, out, T, NH); };
    auto K = [&](bf16* d) { dkdv<<<grid, 128, dkdv_b>>>(dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale, d, d, B * NH); };
    auto Q = [&] { dq<<<grid, 128, fwd_b>>>(dqkv, qkv, dout, lse, dsum, T, NH, sl2, scale); };
    auto QS = [&] { dqs<<<grid, 128, dqs_b>>>(dqkv, qkv, ds, ds, B * NH, T, NH, scale); };
    auto hash = [&] {
        std::vector<unsigned short> g(n3);
        CK(cudaMemcpy(g.data(), dqkv, n3 * 2, cudaMemcpyDeviceToHost));
        unsigned long long x = 1469598103934665603ull;
        for (auto v : g) x = (x ^ v) * 1099511628211ull;
        return x;
    };
    F();
    S();
    K(nullptr);
    Q();
    CK(cudaDeviceSynchronize());
    unsigned long long h_re = hash();
    K(ds);
    QS();
    CK(cudaDeviceSynchronize());
    unsigned long long h_st = hash();
    double fl = 4.0 * B * NH * (double)T * T * HS / 2;  // causal forward FLOPs
    float tf = time_ms(F, 21), ts = time_ms(S, 21);
    float tk = time_ms([&] { K(nullptr); }, 21), tq = time_ms(Q, 21);
    float tks = time_ms([&] { K(ds); }, 21), tqs = time_ms(QS, 21);
    printf("B%d H%d T%d hs%d | fwd %.3f ms (%.0f TFLOP/s) | dsum %.3f\n", B, NH, T, HS, tf, fl / tf / 1e9, ts);
    printf("  recomputed dS: dK/dV %.3f + dQ %.3f -> backward %.3f ms (%.0f TFLOP/s) hash %016llx\n", tk, tq,
           ts + tk + tq, 2.5 * fl / (ts + tk + tq) / 1e9, h_re);
    printf("  stored dS:     dK/dV %.3f + dQ %.3f -> backward %.3f ms (%.0f TFLOP/s) hash %016llx %s\n", tks,
           tqs, ts + tks + tqs, 2.5 * fl / (ts + tks + tqs) / 1e9, h_st, h_st == h_re ? "(same bits)" : "(BITS DIFFER)");
    cudaFree(qkv); cudaFree(dqkv); cudaFree(out); cudaFree(dout); cudaFree(ds); cudaFree(lse); cudaFree(dsum);
}

int main() {
    run<64>(8, 25, 1024, flash_forward_64, flash_dsum_64, flash_dkdv_64, flash_dq_64, flash_dq_ds_64);
    run<80>(8, 32, 1024, flash_forward_80, flash_dsum_80, flash_dkdv_80, flash_dq_80, flash_dq_ds_80);
    run<128>(8, 40, 1024, flash_forward_128, flash_dsum_128, flash_dkdv_128, flash_dq_128, flash_dq_ds_128);
    run<80>(2, 4, 1000, flash_forward_80, flash_dsum_80, flash_dkdv_80, flash_dq_80, flash_dq_ds_80);
    return 0;
}

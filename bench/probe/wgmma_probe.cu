// Checks the W8A8 wgmma kernel (crates/nibble-cuda/kernels/qgemm.cu, w8a8_wgmma_impl) against a
// CPU integer reference, with both readings of the shared-memory descriptor's byte offsets, and
// times it against the mma.sync tiled kernel on one shape. Weights are packed here the way
// crates/nibble-cuda/src/pack.rs packs INT8 (m16n8k32 A fragments, K permuted per chunk).
// On the GPU machine: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a
//   -o /tmp/wgmma_probe bench/probe/wgmma_probe.cu && /tmp/wgmma_probe
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "../../crates/nibble-cuda/kernels/common.cuh"
#include "../../crates/nibble-cuda/kernels/qgemm.cu"

template <bool LBO_K>
__global__ void __launch_bounds__(QG_THREADS, 2) probe(const uint4* codes, const float* sw, const signed char* x,
                                                      const float* sx, float* y, int M, int N, int K, int tiles,
                                                      int chunks) {
    w8a8_wgmma_impl<float, LBO_K>(codes, sw, x, (long)K, sx, y, (long)N, M, N, K, tiles, chunks);
}
__global__ void __launch_bounds__(QG_THREADS, 2) tiled(const uint4* codes, const float* sw, const signed char* x,
                                                      const float* sx, float* y, int M, int N, int K, int tiles,
                                                      int chunks) {
    w8a8_tiled_impl(codes, sw, x, (long)K, sx, y, (long)N, M, N, K, tiles, chunks);
}

// Logical channel of k-slot `k` (0..31) of step `s` in a chunk (pack.rs: lane t's B fragments are
// channels t*16 .. t*16+15).
static int perm(int s, int k) { return 16 * ((k % 16) / 4) + 8 * s + 4 * (k / 16) + k % 4; }

int main(int argc, char** argv) {
    const int M = argc > 1 ? atoi(argv[1]) : 200, N = argc > 2 ? atoi(argv[2]) : 272, K = argc > 3 ? atoi(argv[3]) : 320;
    const int tiles = (N + 15) / 16, chunks = (K + 63) / 64;
    std::vector<signed char> w((size_t)N * K), xh((size_t)M * K);
    srand(7);
    for (auto& v : w) v = (signed char)(rand() % 255 - 127);
    for (auto& v : xh) v = (signed char)(rand() % 255 - 127);
    std::vector<signed char> packed((size_t)tiles * chunks * 32 * 32, 0);
    for (int tile = 0; tile < tiles; ++tile)
        for (int c = 0; c < chunks; ++c)
            for (int lane = 0; lane < 32; ++lane)
                for (int s = 0; s < 2; ++s)
                    for (int r = 0; r < 4; ++r)
                        for (int i = 0; i < 4; ++i) {
                            const int g = lane / 4, t = lane % 4;
                            const int n = tile * 16 + g + 8 * (r & 1), kslot = 4 * t + i + 16 * (r >> 1);
                            const int k = c * 64 + perm(s, kslot);
                            packed[((((size_t)tile * chunks + c) * 32 + lane) * 2 + s) * 16 + r * 4 + i] =
                                n < N && k < K ? w[(size_t)n * K + k] : 0;
                        }
    std::vector<float> ones(N > M ? N : M, 1.0f);
    uint4* codes; float *sw, *sx, *y; signed char* x;
    cudaMalloc(&codes, packed.size()); cudaMalloc(&sw, N * 4); cudaMalloc(&sx, M * 4);
    cudaMalloc(&y, (size_t)M * N * 4); cudaMalloc(&x, xh.size());
    cudaMemcpy(codes, packed.data(), packed.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(x, xh.data(), xh.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(sw, ones.data(), N * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(sx, ones.data(), M * 4, cudaMemcpyHostToDevice);
    std::vector<float> want((size_t)M * N);
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            long acc = 0;
            for (int k = 0; k < K; ++k) acc += (long)xh[(size_t)m * K + k] * w[(size_t)n * K + k];
            want[(size_t)m * N + n] = (float)acc;
        }
    const int smem = 4 * (8192 + 128 * 64);
    const dim3 grid(tiles / 8 + (tiles % 8 != 0), (M + 127) / 128);
    std::vector<float> got((size_t)M * N);
    for (int variant = 0; variant < 3; ++variant) {
        auto k = variant == 0 ? probe<true> : variant == 1 ? probe<false> : tiled;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaMemset(y, 0xff, (size_t)M * N * 4);
        k<<<grid, QG_THREADS, smem>>>(codes, sw, x, sx, y, M, N, K, tiles, chunks);
        cudaError_t e = cudaDeviceSynchronize();
        cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost);
        long bad = 0, first = -1;
        for (size_t i = 0; i < got.size(); ++i)
            if (got[i] != want[i]) { if (first < 0) first = (long)i; ++bad; }
        printf("%s %dx%dx%d: %ld of %zu wrong (%s)", variant == 0 ? "wgmma, LBO along K" : variant == 1 ? "wgmma, LBO along N" : "mma.sync tiled", M, N, K, bad, got.size(), cudaGetErrorString(e));
        if (first >= 0) printf("  first at m %ld n %ld: %g vs %g", first / N, first % N, got[first], want[first]);
        printf("\n");
    }
    // Timing on a Llama-3-8B layer, M = 4096 (values unchecked).
    const int TM = 4096, TN = 28672, TK = 4096, tt = TN / 16, tc = TK / 64;
    uint4* big; signed char* bx; float *by, *bs;
    cudaMalloc(&big, (size_t)TN * TK); cudaMalloc(&bx, (size_t)TM * TK); cudaMalloc(&by, (size_t)TM * TN * 4);
    cudaMalloc(&bs, (size_t)TN * 4); cudaMemset(big, 1, (size_t)TN * TK); cudaMemset(bx, 1, (size_t)TM * TK);
    cudaMemset(bs, 0, (size_t)TN * 4);
    for (int variant = 0; variant < 2; ++variant) {
        auto k = variant == 0 ? probe<true> : tiled;
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        const dim3 g(tt / 8, TM / 128);
        for (int r = 0; r < 2; ++r) k<<<g, QG_THREADS, smem>>>(big, bs, bx, bs, by, TM, TN, TK, tt, tc);
        cudaEventRecord(a);
        for (int r = 0; r < 5; ++r) k<<<g, QG_THREADS, smem>>>(big, bs, bx, bs, by, TM, TN, TK, tt, tc);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b);
        printf("%s %dx%dx%d: %.3f ms, %.0f TOPS (%s)\n", variant == 0 ? "wgmma" : "mma.sync tiled", TM, TN, TK, ms / 5,
               2.0 * TM * TN * TK / (ms / 5 * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
    }
    return 0;
}

// A W8A8 GEMM on wgmma (sm_90a), not yet in the product: checked against a CPU integer reference
// with both readings of the shared-memory descriptor's byte offsets and with / without wgmmas
// overlapping the next chunk, and timed against nibble's mma.sync tiled kernel
// (crates/nibble-cuda/kernels/qgemm.cu) on a Llama-3-8B layer.
//
// Design: the CTA tile and pipeline of w8a8_tiled (128 weight rows x 128 tokens x 64 K, 4
// cp.async stages, the same packed weights), but the two warpgroups each issue
// wgmma.m64n128k32.s32.s8.s8 with the weights as the A operand straight from the packed fragments
// in registers (a wgmma A fragment per warp is the mma.sync m16n8k32 A fragment pack.rs derives)
// and the tokens as B from shared memory in the no-swizzle K-major core-matrix layout (8 tokens x
// 16 bytes per 128-byte core matrix; core matrices 128 bytes apart along K, 512 along tokens). The
// packer's K permutation (lane t's channels t*16 .. t*16+15) is undone while staging: channel word
// L of a chunk goes to word 4 * (L % 4) + L / 4 of the token's row (4-byte cp.async).
// Found on an H200 (BENCHMARKS.md): bit-exact with LBO along K; 413 TOPS serialized and 444 with
// OVERLAP against 466 for the mma.sync kernel at 4096x28672x4096; OVERLAP gave wrong sums on
// 1024x28672x4096 in the integrated tests (A registers rewritten under an in-flight wgmma, likely). Weights are packed here the way
// crates/nibble-cuda/src/pack.rs packs INT8 (m16n8k32 A fragments, K permuted per chunk).
// Checks: probe M N K (default 200 272 320); the 1024 28672 4096 case is the one OVERLAP failed.
// On the GPU machine: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a
//   -o /tmp/wgmma_probe bench/probe/wgmma_probe.cu && /tmp/wgmma_probe
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "../../crates/nibble-cuda/kernels/common.cuh"
#include "../../crates/nibble-cuda/kernels/qgemm.cu"

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

#define WG_CM_K 128  // bytes between core matrices along K
#define WG_CM_N 512  // bytes between 8-token core-matrix groups

__device__ __forceinline__ unsigned long long wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr >> 4) & 0x3fff) |
           ((unsigned long long)((lbo >> 4) & 0x3fff) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fff) << 32);
}

// d += A (64 weight rows x 32 K, fragments in registers) x B (32 K x 128 tokens, descriptor).
__device__ __forceinline__ void wgmma_s8_m64n128k32(int (&d)[16][4], const u32 (&a)[4],
                                                    unsigned long long desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3]), "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3]), "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3]), "+r"(d[10][0]), "+r"(d[10][1]), "+r"(d[10][2]), "+r"(d[10][3]), "+r"(d[11][0]), "+r"(d[11][1]), "+r"(d[11][2]), "+r"(d[11][3]), "+r"(d[12][0]), "+r"(d[12][1]), "+r"(d[12][2]), "+r"(d[12][3]), "+r"(d[13][0]), "+r"(d[13][1]), "+r"(d[13][2]), "+r"(d[13][3]), "+r"(d[14][0]), "+r"(d[14][1]), "+r"(d[14][2]), "+r"(d[14][3]), "+r"(d[15][0]), "+r"(d[15][1]), "+r"(d[15][2]), "+r"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// Keeps the compiler from touching the accumulators while a wgmma may still write them.
__device__ __forceinline__ void wgmma_fence_operands(int (&d)[16][4]) {
        asm volatile("" : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3])::"memory");
        asm volatile("" : "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3])::"memory");
        asm volatile("" : "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3])::"memory");
        asm volatile("" : "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3])::"memory");
        asm volatile("" : "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3])::"memory");
        asm volatile("" : "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3])::"memory");
        asm volatile("" : "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3])::"memory");
        asm volatile("" : "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])::"memory");
        asm volatile("" : "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3])::"memory");
        asm volatile("" : "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3])::"memory");
        asm volatile("" : "+r"(d[10][0]), "+r"(d[10][1]), "+r"(d[10][2]), "+r"(d[10][3])::"memory");
        asm volatile("" : "+r"(d[11][0]), "+r"(d[11][1]), "+r"(d[11][2]), "+r"(d[11][3])::"memory");
        asm volatile("" : "+r"(d[12][0]), "+r"(d[12][1]), "+r"(d[12][2]), "+r"(d[12][3])::"memory");
        asm volatile("" : "+r"(d[13][0]), "+r"(d[13][1]), "+r"(d[13][2]), "+r"(d[13][3])::"memory");
        asm volatile("" : "+r"(d[14][0]), "+r"(d[14][1]), "+r"(d[14][2]), "+r"(d[14][3])::"memory");
        asm volatile("" : "+r"(d[15][0]), "+r"(d[15][1]), "+r"(d[15][2]), "+r"(d[15][3])::"memory");
}

// LBO_ALONG_K: the descriptor's leading byte offset is the K stride of core matrices (else the
// token stride). OVERLAP: a chunk's wgmmas stay in flight through the next chunk's barrier
// (wait_group 1), else each chunk waits for its own (wait_group 0).
template <class OUT, bool LBO_ALONG_K = true, bool OVERLAP = false>
__device__ void w8a8_wgmma_impl(const uint4* __restrict__ codes, const float* __restrict__ sw,
                                const signed char* __restrict__ x, long ldx,
                                const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M,
                                int N, int K, int tiles, int chunks) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int tile0 = blockIdx.x * 8, m0 = blockIdx.y * 128;

    auto load = [&](int c) {
        unsigned char* st = smem + (c % TILED_STAGES) * W8T_STAGE;
#pragma unroll
        for (int i = tid; i < 8 * 64; i += QG_THREADS) {
            const int tl = i >> 6;
            const bool ok = tile0 + tl < tiles;
            cp_async16(st + W8T_CODES + i * 16,
                       codes + ((long)(ok ? tile0 + tl : 0) * chunks + c) * 64 + (i & 63), ok);
        }
        // 128 tokens x 16 words of 4 channels.
#pragma unroll 4
        for (int i = tid; i < 128 * 16; i += QG_THREADS) {
            const int n = i >> 4, word = i & 15, m = m0 + n, k = c * 64 + word * 4;
            const bool ok = m < M && k < K;
            const int pos = 4 * (word % 4) + word / 4;  // word's place in the token's 64 bytes
            cp_async4(st + W8T_X + (n >> 3) * WG_CM_N + (pos >> 2) * WG_CM_K + (n & 7) * 16 + (pos & 3) * 4,
                      x + (ok ? (long)m * ldx + k : 0), ok);
        }
    };

    int acc[16][4] = {};
    wgmma_fence_operands(acc);
    const u32 lbo = LBO_ALONG_K ? WG_CM_K : WG_CM_N, sbo = LBO_ALONG_K ? WG_CM_N : WG_CM_K;
    // Loads run TILED_STAGES - 2 chunks ahead, so with OVERLAP the slot a load refills was last
    // read two chunks ago, whose wgmmas every warpgroup has retired before that barrier.
#pragma unroll
    for (int s = 0; s < TILED_STAGES - 2; ++s) {
        if (s < chunks) load(s);
        cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<TILED_STAGES - 3>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (c + TILED_STAGES - 2 < chunks) load(c + TILED_STAGES - 2);
        cp_async_commit();
        const unsigned char* st = smem + (c % TILED_STAGES) * W8T_STAGE;
        const uint4* src = reinterpret_cast<const uint4*>(st + W8T_CODES) + (warp * 32 + lane) * 2;
        const uint4 w0 = src[0], w1 = src[1];
        const u32 a0[4] = {w0.x, w0.y, w0.z, w0.w}, a1[4] = {w1.x, w1.y, w1.z, w1.w};
        const u32 xb = smem_addr(st + W8T_X);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        wgmma_s8_m64n128k32(acc, a0, wgmma_desc(xb, lbo, sbo));
        wgmma_s8_m64n128k32(acc, a1, wgmma_desc(xb + 2 * WG_CM_K, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (OVERLAP)
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        else
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wgmma_fence_operands(acc);
    cp_async_wait<0>();
    // Warp w holds rows 16w .. 16w + 15 of the CTA's 128 (its warpgroup's 64, in warp order).
    store_tile<16>(acc, (tile0 + warp) * 16, m0, M, N, y, ldy, W8Epilogue{sx, sw});
}


template <bool LBO_K, bool OVERLAP>
__global__ void __launch_bounds__(QG_THREADS, 2) probe(const uint4* codes, const float* sw, const signed char* x,
                                                      const float* sx, float* y, int M, int N, int K, int tiles,
                                                      int chunks) {
    w8a8_wgmma_impl<float, LBO_K, OVERLAP>(codes, sw, x, (long)K, sx, y, (long)N, M, N, K, tiles, chunks);
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
    const char* names[] = {"wgmma, LBO along K", "wgmma, LBO along N", "wgmma, LBO along K, overlapped", "mma.sync tiled"};
    for (int variant = 0; variant < 4; ++variant) {
        auto k = variant == 0 ? probe<true, false> : variant == 1 ? probe<false, false> : variant == 2 ? probe<true, true> : tiled;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaMemset(y, 0xff, (size_t)M * N * 4);
        k<<<grid, QG_THREADS, smem>>>(codes, sw, x, sx, y, M, N, K, tiles, chunks);
        cudaError_t e = cudaDeviceSynchronize();
        cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost);
        long bad = 0, first = -1;
        for (size_t i = 0; i < got.size(); ++i)
            if (got[i] != want[i]) { if (first < 0) first = (long)i; ++bad; }
        printf("%s %dx%dx%d: %ld of %zu wrong (%s)", names[variant], M, N, K, bad, got.size(), cudaGetErrorString(e));
        if (first >= 0) printf("  first at m %ld n %ld: %g vs %g", first / N, first % N, got[first], want[first]);
        printf("\n");
    }
    // Timing on a Llama-3-8B layer, M = 4096 (values unchecked).
    const int TM = 4096, TN = 28672, TK = 4096, tt = TN / 16, tc = TK / 64;
    uint4* big; signed char* bx; float *by, *bs;
    cudaMalloc(&big, (size_t)TN * TK); cudaMalloc(&bx, (size_t)TM * TK); cudaMalloc(&by, (size_t)TM * TN * 4);
    cudaMalloc(&bs, (size_t)TN * 4); cudaMemset(big, 1, (size_t)TN * TK); cudaMemset(bx, 1, (size_t)TM * TK);
    cudaMemset(bs, 0, (size_t)TN * 4);
    for (int variant = 0; variant < 3; ++variant) {
        auto k = variant == 0 ? probe<true, false> : variant == 1 ? probe<true, true> : tiled;
        cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
        const dim3 g(tt / 8, TM / 128);
        for (int r = 0; r < 2; ++r) k<<<g, QG_THREADS, smem>>>(big, bs, bx, bs, by, TM, TN, TK, tt, tc);
        cudaEventRecord(a);
        for (int r = 0; r < 5; ++r) k<<<g, QG_THREADS, smem>>>(big, bs, bx, bs, by, TM, TN, TK, tt, tc);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b);
        printf("%s %dx%dx%d: %.3f ms, %.0f TOPS (%s)\n", variant == 0 ? "wgmma" : variant == 1 ? "wgmma, overlapped" : "mma.sync tiled", TM, TN, TK, ms / 5,
               2.0 * TM * TN * TK / (ms / 5 * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
    }
    return 0;
}

// Checks and times the wgmma tier (crates/nibble-cuda/kernels/qgemm_wgmma.cu) against the
// mma.sync tiled kernels on the same random packed weights (W8A8 must match bit for bit, W4A16
// up to f32 summation order) and against cuBLAS BF16 on the same shapes. The Rust GPU tests check
// both tiers against the CPU reference; this probe is for iterating on the kernel with nvcc.
// On the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgq bench/probe/wgmma_gemm_probe.cu -lcuda -lcublas && /tmp/wgq
#include <cuda.h>
#ifndef PROBE_NO_CUBLAS  // (a compile check where cuBLAS headers are missing)
#include <cublas_v2.h>
#else
typedef void* cublasHandle_t;
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "../../crates/nibble-cuda/kernels/common.cuh"
#include "../../crates/nibble-cuda/kernels/qgemm.cu"
#include "../../crates/nibble-cuda/kernels/qgemm_wgmma.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

// The weights' descriptor: [tiles][rows][row_bytes] as u32 words, boxes of 8 tiles x box_rows.
static TmaMap weight_map(const void* p, int tiles, int rows, int row_bytes, int box_rows) {
    TmaMap m;
    cuuint64_t dims[3] = {(cuuint64_t)row_bytes / 4, (cuuint64_t)rows, (cuuint64_t)tiles};
    cuuint64_t strides[2] = {(cuuint64_t)row_bytes, (cuuint64_t)rows * row_bytes};
    cuuint32_t box[3] = {(cuuint32_t)row_bytes / 4, (cuuint32_t)box_rows, 8}, es[3] = {1, 1, 1};
    CUresult r = cuTensorMapEncodeTiled((CUtensorMap*)&m, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, (void*)p, dims, strides, box,
                                        es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("weight tensor map: %d\n", (int)r); exit(1); }
    return m;
}

static TmaMap make_map(const void* x, int M, int K, int elem, int box_rows = 256) {
    TmaMap m;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M}, strides[1] = {(cuuint64_t)K * elem};
    cuuint32_t box[2] = {(cuuint32_t)(128 / elem), (cuuint32_t)box_rows}, es[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled((CUtensorMap*)&m, elem == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16,
                                        2, (void*)x, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("tensor map: %d\n", (int)r); exit(1); }
    return m;
}

__global__ void __launch_bounds__(QG_THREADS, 2) tiled8(const uint4* codes, const float* sw, const signed char* x,
                                                       const float* sx, float* y, int M, int N, int K, int tiles, int chunks) {
    w8a8_tiled_impl(codes, sw, x, (long)K, sx, y, (long)N, M, N, K, tiles, chunks);
}
__global__ void __launch_bounds__(QG_THREADS, 2) tiled4(const uint4* codes, const uint2* params, const __half* x,
                                                       float* y, int M, int N, int K, int tiles, int chunks, int groups, int gl) {
    w4a16_tiled_impl<__half, float>(codes, params, x, (long)K, y, (long)N, M, N, K, tiles, chunks, groups, gl);
}

static const int W8_SMEM = WgqW8<256>::STAGES * WgqW8<256>::STAGE + 1024 + 64;
static const int W8_SMEM128 = WgqW8<128>::STAGES * WgqW8<128>::STAGE + 1024 + 16 * WgqW8<128>::STAGES;
static const int W4_SMEM128 = WgqW4<__half, 128>::STAGES * WgqW4<__half, 128>::STAGE + 1024 + 16 * WgqW4<__half, 128>::STAGES;
static const int W4_SMEM = WgqW4<__half, 256>::STAGES * WgqW4<__half, 256>::STAGE + 1024 + 80;

struct Run { float ms; long bad; double maxrel; };

template <class L> static float time_it(int reps, L&& launch) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    launch(); launch();
    cudaEventRecord(a);
    for (int r = 0; r < reps; ++r) launch();
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    CK(cudaGetLastError());
    return ms / reps;
}

// Outputs in `got` (device) that differ from `want` (device): bit for bit, or by more than 1e-3
// relative (f32 summation order).
static long count_off(const float* got, const float* want, size_t n, bool exact) {
    std::vector<float> a(n), b(n);
    cudaMemcpy(a.data(), got, n * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), want, n * 4, cudaMemcpyDeviceToHost);
    long bad = 0;
    for (size_t i = 0; i < n; ++i)
        bad += exact ? memcmp(&a[i], &b[i], 4) != 0 : !(fabs((double)a[i] - b[i]) <= 1e-3 * (1 + fabs((double)b[i])));
    return bad;
}

static int sms = 132;  // persistent grid: at most one CTA per SM (set in main)
static unsigned rnd_state = 12345;
static unsigned rnd() { rnd_state = rnd_state * 1664525u + 1013904223u; return rnd_state >> 8; }

// One shape: W8A8 and W4A16 (group 128 and 32), wgmma vs tiled, plus cuBLAS BF16.
static void shape(int M, int N, int K, bool time_only, cublasHandle_t h) {
    const int tiles = (N + 15) / 16, chunks = (K + 63) / 64;
    const double flops = 2.0 * M * N * K;
    // --- W8A8
    {
        std::vector<unsigned char> codes((size_t)tiles * chunks * 1024), xq((size_t)M * K);
        for (auto& v : codes) v = rnd();
        for (auto& v : xq) v = rnd();
        std::vector<float> sw(tiles * 16), sx(M);
        for (auto& v : sw) v = 1.0f + (rnd() % 100) * 1e-3f;
        for (auto& v : sx) v = 1e-3f * (1 + rnd() % 7);
        uint4* dc; signed char* dx; float *dsw, *dsx, *y1, *y2;
        CK(cudaMalloc(&dc, codes.size())); CK(cudaMalloc(&dx, xq.size()));
        CK(cudaMalloc(&dsw, sw.size() * 4)); CK(cudaMalloc(&dsx, M * 4));
        CK(cudaMalloc(&y1, (size_t)M * N * 4)); CK(cudaMalloc(&y2, (size_t)M * N * 4));
        cudaMemcpy(dc, codes.data(), codes.size(), cudaMemcpyHostToDevice);
        cudaMemcpy(dx, xq.data(), xq.size(), cudaMemcpyHostToDevice);
        cudaMemcpy(dsw, sw.data(), sw.size() * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dsx, sx.data(), M * 4, cudaMemcpyHostToDevice);
        TmaMap map = make_map(dx, M, K, 1), wmap = weight_map(dc, tiles, chunks, 1024, 2);
        const int nb = (tiles + 7) / 8, mb = (M + 255) / 256;
        cudaFuncSetAttribute(w8a8_wgmma_f32, cudaFuncAttributeMaxDynamicSharedMemorySize, W8_SMEM);
        cudaFuncSetAttribute(tiled8, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * (8192 + 128 * 64));
        auto wg = [&] { w8a8_wgmma_f32<<<std::min(nb * mb, sms), WGQ_THREADS, W8_SMEM>>>(map, wmap, dsw, dsx, y1, N, M, N, tiles, chunks, 1, nullptr, nullptr); };
        auto ti = [&] { tiled8<<<dim3(nb, (M + 127) / 128), QG_THREADS, 4 * (8192 + 128 * 64)>>>(dc, dsw, dx, dsx, y2, M, N, K, tiles, chunks); };
        long bad = -1;
        if (!time_only) {
            cudaMemset(y1, 0xff, (size_t)M * N * 4); cudaMemset(y2, 0xfe, (size_t)M * N * 4);
            wg(); ti(); CK(cudaDeviceSynchronize());
            std::vector<float> a((size_t)M * N), b((size_t)M * N);
            cudaMemcpy(a.data(), y1, a.size() * 4, cudaMemcpyDeviceToHost);
            cudaMemcpy(b.data(), y2, b.size() * 4, cudaMemcpyDeviceToHost);
            bad = 0; long first = -1;
            for (size_t i = 0; i < a.size(); ++i) if (memcmp(&a[i], &b[i], 4)) { if (first < 0) first = i; ++bad; }
            printf("w8a8 %dx%dx%d: %ld of %zu differ from tiled", M, N, K, bad, a.size());
            if (first >= 0) printf(" (first m %ld n %ld: %g vs %g)", first / N, first % N, a[first], b[first]);
            printf("\n");
        }
        const int reps = flops > 1e11 ? 10 : 50;
        cudaFuncSetAttribute(w8a8_wgmma_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W8_SMEM);
        auto wgh = [&] { w8a8_wgmma_f16<<<std::min(nb * mb, sms), WGQ_THREADS, W8_SMEM>>>(map, wmap, dsw, dsx, (__half*)y1, N, M, N, tiles, chunks, 1, nullptr, nullptr); };
        float t1 = time_it(reps, wg), t2 = time_it(reps, ti), t3 = time_it(reps, wgh);
        printf("w8a8 %dx%dx%d: wgmma %.1f us (%.0f TOPS), f16 out %.1f us (%.0f TOPS), tiled %.1f us (%.0f TOPS)\n", M, N, K, t1 * 1e3,
               flops / t1 / 1e9, t3 * 1e3, flops / t3 / 1e9, t2 * 1e3, flops / t2 / 1e9);
        {  // 128-token tiles
            TmaMap m128 = make_map(dx, M, K, 1, 128);
            cudaFuncSetAttribute(w8a8_wgmma128_f32, cudaFuncAttributeMaxDynamicSharedMemorySize, W8_SMEM128);
            cudaFuncSetAttribute(w8a8_wgmma128_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W8_SMEM128);
            const int t128 = std::min(nb * ((M + 127) / 128), sms);
            auto w1 = [&] { w8a8_wgmma128_f32<<<t128, WGQ_THREADS, W8_SMEM128>>>(m128, wmap, dsw, dsx, y1, N, M, N, tiles, chunks, 1, nullptr, nullptr); };
            auto w1h = [&] { w8a8_wgmma128_f16<<<t128, WGQ_THREADS, W8_SMEM128>>>(m128, wmap, dsw, dsx, (__half*)y1, N, M, N, tiles, chunks, 1, nullptr, nullptr); };
            if (!time_only) {
                cudaMemset(y1, 0xff, (size_t)M * N * 4);
                w1(); CK(cudaDeviceSynchronize());
                printf("w8a8 128-token %dx%dx%d: %ld of %zu differ from tiled\n", M, N, K,
                       count_off(y1, y2, (size_t)M * N, true), (size_t)M * N);
            }
            const int reps = flops > 1e11 ? 10 : 50;
            float t = time_it(reps, w1h);
            printf("w8a8 128-token %dx%dx%d: f16 out %.1f us (%.0f TOPS)\n", M, N, K, t * 1e3, flops / t / 1e9);
        }
        cudaFree(dc); cudaFree(dx); cudaFree(dsw); cudaFree(dsx); cudaFree(y1); cudaFree(y2);
    }
    // --- W4A16, f16 activations
    for (int gl : {128, 32}) {
        if (time_only && gl == 32) break;
        const int groups = (64 * chunks + gl - 1) / gl;
        std::vector<unsigned> codes((size_t)tiles * chunks * 128);
        for (auto& v : codes) v = rnd() ^ (rnd() << 16);
        std::vector<__half> params((size_t)tiles * groups * 16 * 2), xh((size_t)M * K);
        for (size_t i = 0; i < params.size(); i += 2) {
            params[i] = __float2half(0.01f + (rnd() % 100) * 1e-4f);
            params[i + 1] = __float2half(1024.0f + rnd() % 16);
        }
        for (auto& v : xh) v = __float2half(((int)(rnd() % 2001) - 1000) * 1e-3f);
        uint4* dc; uint2* dp; __half* dx; float *y1, *y2;
        CK(cudaMalloc(&dc, codes.size() * 4)); CK(cudaMalloc(&dp, params.size() * 2));
        CK(cudaMalloc(&dx, xh.size() * 2));
        CK(cudaMalloc(&y1, (size_t)M * N * 4)); CK(cudaMalloc(&y2, (size_t)M * N * 4));
        cudaMemcpy(dc, codes.data(), codes.size() * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(dp, params.data(), params.size() * 2, cudaMemcpyHostToDevice);
        cudaMemcpy(dx, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice);
        TmaMap map = make_map(dx, M, K, 2), wmap = weight_map(dc, tiles, chunks, 512, 1),
               pmap = weight_map(dp, tiles, groups, 64, gl % 64 == 0 ? 1 : 2);
        const int nb = (tiles + 7) / 8, mb = (M + 255) / 256;
        const int tsmem = 4 * (5120 + 128 * 144);
        cudaFuncSetAttribute(w4a16_wgmma_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W4_SMEM);
        cudaFuncSetAttribute(tiled4, cudaFuncAttributeMaxDynamicSharedMemorySize, tsmem);
        auto wg = [&] { w4a16_wgmma_f16<<<std::min(nb * mb, sms), WGQ_THREADS, W4_SMEM>>>(map, wmap, pmap, y1, N, M, N, tiles, chunks, groups, gl, 1, nullptr, nullptr); };
        auto ti = [&] { tiled4<<<dim3(nb, (M + 127) / 128), QG_THREADS, tsmem>>>(dc, dp, dx, y2, M, N, K, tiles, chunks, groups, gl); };
        if (!time_only) {
            cudaMemset(y1, 0xff, (size_t)M * N * 4); cudaMemset(y2, 0xfe, (size_t)M * N * 4);
            wg(); ti(); CK(cudaDeviceSynchronize());
            std::vector<float> a((size_t)M * N), b((size_t)M * N);
            cudaMemcpy(a.data(), y1, a.size() * 4, cudaMemcpyDeviceToHost);
            cudaMemcpy(b.data(), y2, b.size() * 4, cudaMemcpyDeviceToHost);
            long bad = 0, first = -1; double worst = 0;
            for (size_t i = 0; i < a.size(); ++i) {
                const double d = fabs((double)a[i] - b[i]), tol = 1e-3 * (1 + fabs((double)b[i]));
                if (!(d <= tol)) { if (first < 0) first = i; ++bad; }
                if (d / (1 + fabs((double)b[i])) > worst) worst = d / (1 + fabs((double)b[i]));
            }
            printf("w4a16 g%d %dx%dx%d: %ld of %zu off tiled (worst rel %.2e)", gl, M, N, K, bad, a.size(), worst);
            if (first >= 0) printf(" (first m %ld n %ld: %g vs %g)", first / N, first % N, a[first], b[first]);
            printf("\n");
        }
        const int reps = flops > 1e11 ? 10 : 50;
        cudaFuncSetAttribute(w4a16_wgmma_h_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W4_SMEM);
        auto wgh = [&] { w4a16_wgmma_h_f16<<<std::min(nb * mb, sms), WGQ_THREADS, W4_SMEM>>>(map, wmap, pmap, (__half*)y1, N, M, N, tiles, chunks, groups, gl, 1, nullptr, nullptr); };
        float t1 = time_it(reps, wg), t2 = time_it(reps, ti), t3 = time_it(reps, wgh);
        printf("w4a16 g%d %dx%dx%d: wgmma %.1f us (%.0f TFLOPS), f16 out %.1f us (%.0f TFLOPS), tiled %.1f us (%.0f TFLOPS)\n", gl, M, N, K,
               t1 * 1e3, flops / t1 / 1e9, t3 * 1e3, flops / t3 / 1e9, t2 * 1e3, flops / t2 / 1e9);
        {  // 128-token tiles
            TmaMap m128 = make_map(dx, M, K, 2, 128);
            cudaFuncSetAttribute(w4a16_wgmma128_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W4_SMEM128);
            cudaFuncSetAttribute(w4a16_wgmma128_h_f16, cudaFuncAttributeMaxDynamicSharedMemorySize, W4_SMEM128);
            const int t128 = std::min(nb * ((M + 127) / 128), sms);
            auto w1 = [&] { w4a16_wgmma128_f16<<<t128, WGQ_THREADS, W4_SMEM128>>>(m128, wmap, pmap, y1, N, M, N, tiles, chunks, groups, gl, 1, nullptr, nullptr); };
            auto w1h = [&] { w4a16_wgmma128_h_f16<<<t128, WGQ_THREADS, W4_SMEM128>>>(m128, wmap, pmap, (__half*)y1, N, M, N, tiles, chunks, groups, gl, 1, nullptr, nullptr); };
            if (!time_only) {
                cudaMemset(y1, 0xff, (size_t)M * N * 4);
                w1(); CK(cudaDeviceSynchronize());
                printf("w4a16 128-token g%d %dx%dx%d: %ld of %zu off tiled\n", gl, M, N, K,
                       count_off(y1, y2, (size_t)M * N, false), (size_t)M * N);
            }
            const int reps = flops > 1e11 ? 10 : 50;
            float t = time_it(reps, w1h);
            printf("w4a16 128-token g%d %dx%dx%d: f16 out %.1f us (%.0f TFLOPS)\n", gl, M, N, K, t * 1e3, flops / t / 1e9);
        }
        cudaFree(dc); cudaFree(dp); cudaFree(dx); cudaFree(y1); cudaFree(y2);
    }
#ifndef PROBE_NO_CUBLAS
    // --- cuBLAS BF16, y = x W^T
    {
        __nv_bfloat16 *a, *b, *c;
        CK(cudaMalloc(&a, (size_t)M * K * 2)); CK(cudaMalloc(&b, (size_t)N * K * 2)); CK(cudaMalloc(&c, (size_t)M * N * 2));
        cudaMemset(a, 0, (size_t)M * K * 2); cudaMemset(b, 0, (size_t)N * K * 2);
        const float one = 1, zero = 0;
        auto run = [&] {
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, K, a, CUDA_R_16BF, K, &zero, c,
                         CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        };
        float t = time_it(flops > 1e11 ? 10 : 50, run);
        printf("cublas bf16 %dx%dx%d: %.1f us (%.0f TFLOPS)\n", M, N, K, t * 1e3, flops / t / 1e9);
        cudaFree(a); cudaFree(b); cudaFree(c);
    }
#endif
}

int main(int argc, char** argv) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cublasHandle_t h = nullptr;
#ifndef PROBE_NO_CUBLAS
    cublasCreate(&h);
#endif
    if (argc == 4) {  // one shape, timed only: wgmma_gemm_probe M N K
        shape(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), true, h);
        return 0;
    }
    // Odd shapes: M not a multiple of 256, N not of 128, odd chunk counts; then the bench shapes.
    shape(300, 272, 320, false, h);
    shape(1, 4096, 4096, false, h);
    shape(513, 1040, 1088, false, h);
    shape(1024, 28672, 4096, false, h);
    shape(4096, 4096, 14336, false, h);
    shape(1024, 6144, 4096, false, h);
    shape(4096, 28672, 4096, true, h);
    shape(8192, 6144, 4096, true, h);
    return 0;
}

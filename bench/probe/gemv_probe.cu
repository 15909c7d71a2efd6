// Where does the Hopper stream gemv (crates/nibble-cuda/kernels/qgemm.cu) lose bandwidth? Times
// the real kernel on one layer shape (W4A16 g128, bf16, M = 1) as built, without its math (stage
// reads kept), and with the stage geometry given by -D SK_STAGES / SK_STAGE_CODES /
// SK_STAGE_PARAMS / PROBE_U. Run from the repo root on the GPU machine: bench/probe/gemv_probe.sh
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <vector>
#include "../../crates/nibble-cuda/kernels/common.cuh"
#include "../../crates/nibble-cuda/kernels/qgemm.cu"
#ifndef PROBE_U
#define PROBE_U 4
#endif

// The W4 stage policy with the dequantize-and-multiply replaced by a fold of the words.
template <class T, int U> struct NoMath : StreamW4<T, U> {
    template <int TT, int CH> __device__ void mma(const typename StreamW4<T, U>::Regs& r, int u,
                                          const typename StreamW4<T, U>::Xv (&)[TT], float (&acc)[CH][TT][4]) const {
        acc[0][0][0] += __uint_as_float((r.w[u].x ^ r.w[u].y ^ r.w[u].z ^ r.w[u].w ^ r.p[u].x) & 0x3fffffffu);
    }
};

// The math, with activations made up in registers instead of loaded.
template <class T, int U> struct NoXLoads : StreamW4<T, U> {
    template <bool XS>
    __device__ void load_x(const T*, long, int m, int, int, int c, typename StreamW4<T, U>::Xv& xv) const {
        xv.v[0] = make_uint4(m + c, m, c, 0x3c00);
        xv.v[1] = make_uint4(c, m + c, 0x3c00, m);
    }
};
// The activation loads, folded without math.
template <class T, int U> struct XOnly : StreamW4<T, U> {
    template <int TT, int CH> __device__ void mma(const typename StreamW4<T, U>::Regs& r, int u,
                                                  const typename StreamW4<T, U>::Xv (&xv)[TT], float (&acc)[CH][TT][4]) const {
        acc[0][0][0] += __uint_as_float((r.w[u].x ^ r.p[u].x ^ xv[0].v[0].x ^ xv[0].v[1].y) & 0x3fffffffu);
    }
};

// The math without the group-parameter copies (parameters made up in registers).
template <class T, int U, class Base = StreamW4<T, U>> struct NoParams : Base {
    __device__ void issue(u32 dst, u32 bar, int tile, int c, int n) const {
        mbar_expect_tx(bar, n * 512);
        bulk_load(dst, this->codes + ((long)tile * this->chunks + c) * 32, n * 512, bar);
    }
    __device__ void read(const unsigned char* st, int, int n, typename StreamW4<T, U>::Regs& r) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (u >= n) break;
            r.w[u] = *reinterpret_cast<const uint4*>(st + u * 512 + lane * 16);
            r.p[u] = make_uint2(0x43003c00u ^ u, 0x43003c00u);
        }
    }
};

template <int MATH>
__global__ void __launch_bounds__(SK_WARPS * 32, 1) probe(const uint4* codes, const uint2* params, const __nv_bfloat16* x,
                                               float* y, float* partial, int* counters, int M, int N, int K,
                                               int tiles, int chunks, int groups, int per_cta, int max_pieces) {
    using T = __nv_bfloat16;
    if constexpr (MATH == 5)
        stream_gemv<1, true>(NoParams<T, PROBE_U, NoMath<T, PROBE_U>>{{{codes, params, chunks, groups, 128, 7}}}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else if constexpr (MATH == 6)
        stream_gemv<1, true>(NoParams<T, PROBE_U>{{codes, params, chunks, groups, 128, 7}}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else if constexpr (MATH == 4)
        stream_gemv<1, false>(StreamW4<T, PROBE_U>{codes, params, chunks, groups, 128, 7}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else if constexpr (MATH == 1)
        stream_gemv<1, true>(StreamW4<T, PROBE_U>{codes, params, chunks, groups, 128, 7}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else if constexpr (MATH == 2)
        stream_gemv<1, true>(NoXLoads<T, PROBE_U>{{codes, params, chunks, groups, 128, 7}}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else if constexpr (MATH == 3)
        stream_gemv<1, true>(XOnly<T, PROBE_U>{{codes, params, chunks, groups, 128, 7}}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else
        stream_gemv<1, true>(NoMath<T, PROBE_U>{{codes, params, chunks, groups, 128, 7}}, x, (long)K, y, (long)N,
                       partial, counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
}

int main(int argc, char** argv) {
    const int N = argc > 1 ? atoi(argv[1]) : 28672, K = argc > 2 ? atoi(argv[2]) : 4096, M = 1;
    const int tiles = N / 16, chunks = K / 64, groups = K / 128, sms = 132;
    const long units = (long)((tiles + SK_WARPS - 1) / SK_WARPS) * chunks;
    const int per_cta = (int)((units + sms - 1) / sms), ctas = (int)((units + per_cta - 1) / per_cta);
    const int max_pieces = (chunks + per_cta - 1) / per_cta + 1;
    const size_t code_bytes = (size_t)tiles * chunks * 512, param_bytes = (size_t)tiles * groups * 64;
    std::vector<unsigned> hc(code_bytes / 4);
    for (size_t i = 0; i < hc.size(); ++i) hc[i] = (unsigned)(i * 2654435761u);
    std::vector<unsigned> hp(param_bytes / 4, 0x43003c00u);  // (scale 1/..., magic + zero) pairs
    uint4 *codes; uint2 *params; __nv_bfloat16* x; float *y, *partial; int* counters;
    cudaMalloc(&codes, code_bytes); cudaMalloc(&params, param_bytes);
    cudaMalloc(&x, K * 2); cudaMalloc(&y, (size_t)N * 4);
    cudaMalloc(&partial, (size_t)tiles * max_pieces * 16 * 4); cudaMalloc(&counters, 65536 * 4);
    cudaMemset(counters, 0, 65536 * 4); cudaMemset(x, 0, K * 2);
    cudaMemcpy(codes, hc.data(), code_bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(params, hp.data(), param_bytes, cudaMemcpyHostToDevice);
    const int smem = SK_X + M * (K * 2 + 16);
    const char* names[] = {"no math", "math, x smem", "no x", "x only", "math, x global", "no math/params", "math, no params"};
    for (int math = 0; math < 7; ++math) {
        auto k = math == 0 ? probe<0> : math == 1 ? probe<1> : math == 2 ? probe<2> : math == 3 ? probe<3> : math == 4 ? probe<4> : math == 5 ? probe<5> : probe<6>;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        int per_sm = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem);
        for (int r = 0; r < 3; ++r)
            k<<<ctas, SK_WARPS * 32, smem>>>(codes, params, x, y, partial, counters, M, N, K, tiles, chunks, groups, per_cta, max_pieces);
        cudaEvent_t a, b;
        cudaEventCreate(&a); cudaEventCreate(&b);
        cudaEventRecord(a);
        for (int r = 0; r < 50; ++r)
            k<<<ctas, SK_WARPS * 32, smem>>>(codes, params, x, y, partial, counters, M, N, K, tiles, chunks, groups, per_cta, max_pieces);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        const double us = ms / 50 * 1e3;
        printf("%dx%d stages %d codes %d U %d %-16s ctas %d (%d/SM): %6.1f us  %.2f TB/s  %s\n", N, K, SK_STAGES,
               SK_STAGE_CODES, PROBE_U, names[math], ctas, per_sm, us,
               (code_bytes + param_bytes) / us / 1e6, cudaGetErrorString(cudaGetLastError()));
    }
    return 0;
}

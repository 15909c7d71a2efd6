// Where does decode-size W4A16 lose HBM bandwidth, and which persistent gemv geometry wins?
// Times, per call inside a CUDA graph of 20 calls (as gpu_bench does), on the Llama-3-8B layer
// shapes at M = 1, 4, 16 (bf16, group 128):
//   read      a plain persistent read of the same bytes (codes + params), no math: the floor;
//   gemv      the mma.sync gemv as dispatched today (qgemm.cu, split-K plan of qlinear.rs);
//   dec ...   kernels/qgemv.cu's persistent gemv (lean: as shipped; none: its loads only; W8 2/SM:
//             8-warp CTAs, two per SM; as g64: a scale span per chunk, timing only), and with
//             programmatic dependent launch (pdl: the next call's weight loads start while this
//             one ends);
//   ring ...  the same math with each warp's batches streamed by bulk copies into its own
//             shared-memory ring R - 1 batches ahead (R3 to R5), against the register double
//             buffer: no faster, and slower the deeper the ring (dec9-ring.txt).
// Every dec variant with math is checked against the gemv's output.
// Build here (no GPU needed, nvcc only):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o stage/probe/dec_probe bench/probe/dec_probe.cu
// then run stage/probe/dec_probe on the GPU machine (carry stage/probe).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define DEC_NO_ENTRIES
#include "../../crates/nibble-cuda/kernels/common.cuh"
#include "../../crates/nibble-cuda/kernels/qgemm.cu"
#include "../../crates/nibble-cuda/kernels/qgemv.cu"

template <class Tt, int GC> struct NoMath : DecW4<Tt, GC> {
    template <int TT>
    __device__ __forceinline__ void mma(const typename DecW4<Tt, GC>::Regs& r, int u, const uint4 (&xv)[TT][2],
                                        float (&G)[2][TT][4]) const {
        G[0][0][0] += __uint_as_float((r.w[u].x ^ r.w[u].y ^ r.w[u].z ^ r.w[u].w ^ xv[0][0].x) & 0x3fffffffu);
    }
};

// MATH 0: loads only; 1: the kernel as shipped. GC chunks per scale span (group 128: 2).
template <class T, int MATH, int TT, int GC, int DW, int MINB>
__global__ void __launch_bounds__(DW * 32, MINB)
    dec_probe(const uint4* codes, const uint2* params, const T* x, float* y, float* partial, int* counters, int M,
              int N, int K, int tiles, int chunks, int groups, int per_cta, int max_pieces) {
    if constexpr (MATH == 0)
        dec_gemv<TT, DW>(NoMath<T, GC>{{codes, params, chunks, groups, 1}}, x, (long)K, y, (long)N, partial,
                         counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
    else
        dec_gemv<TT, DW>(DecW4<T, GC>{codes, params, chunks, groups, 1}, x, (long)K, y, (long)N, partial,
                         counters, M, N, K, tiles, chunks, per_cta, max_pieces, W4Epilogue{});
}

// Ring: each warp streams its batches with bulk copies (one lane issues a batch's 2 KB of codes
// and its parameter rows into the warp's own shared-memory ring slot, completing on the slot's
// mbarrier) R - 1 batches ahead, and reads its fragments back with ld.shared: more bytes in
// flight than the registers hold, at one issue per batch.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
template <class T, int GC, int R, int TT, int DW>
__device__ void dec_ring(const uint4* codes, const uint2* params, const T* x, float* y, float* partial,
                         int* counters, int M, int N, int K, int tiles, int chunks, int groups, int per_cta,
                         int max_pieces) {
    using F = DecW4<T, GC>;
    const F f{codes, params, chunks, groups, 1};
    constexpr int U = F::U, SLOT = U * 512 + 256;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int units = (tiles + DW - 1) / DW * chunks;
    const int u0 = blockIdx.x * per_cta, u1 = min(units, u0 + per_cta);
    struct Cursor {
        int u, c, slot, b;
    };
    auto valid = [&](const Cursor& q) { return q.u < u1 && q.b * DW + warp < tiles; };
    auto advance = [&](Cursor& q, int win) {
        q.u += U;
        q.c += U;
        q.slot = q.slot + U == win ? 0 : q.slot + U;
        if (q.c == chunks) {
            q.c = 0;
            ++q.b;
        }
    };
    extern __shared__ __align__(16) unsigned char xs[];
    const int c0 = u0 % chunks, win = min(chunks, per_cta);
    const int stride = gemv_x_stride(win, 2);
    constexpr int MP = TT * 8;
    float* xsum = reinterpret_cast<float*>(xs + M * stride);
    const int ring_off = ((M * stride + win / GC * MP * 4) + 127) / 128 * 128;
    const u32 ring = smem_addr(xs) + ring_off + warp * R * SLOT;
    const u32 bars = smem_addr(xs) + ring_off + DW * R * SLOT + warp * R * 8;
    const unsigned char* ring_p = xs + ring_off + warp * R * SLOT;
    if (lane == 0) {
        for (int r = 0; r < R; ++r) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bars + 8 * r));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    // Batch i (of this warp) lives in slot i % R.
    auto issue = [&](const Cursor& q, int i) {
        if (lane != 0) return;
        const int tile = q.b * DW + warp, r = i % R;
        const int g0 = q.c >> f.chunk_shift, g1 = (q.c + (F::SPANS - 1) * GC) >> f.chunk_shift;
        const u32 pbytes = (g1 - g0 + 1) * 64;
        mbar_expect_tx(bars + 8 * r, U * 512 + pbytes);
        bulk_g2s(ring + r * SLOT, codes + ((long)tile * chunks + q.c) * 32, U * 512, bars + 8 * r);
        bulk_g2s(ring + r * SLOT + U * 512, params + ((long)tile * groups + g0) * 8, pbytes, bars + 8 * r);
    };
    Cursor q{u0, c0, 0, u0 / chunks}, qi = q;
    int issued = 0;
    for (; issued < R - 1 && valid(qi); ++issued) {
        issue(qi, issued);
        advance(qi, win);
    }
    grid_dependents_launch();
    grid_dependency_wait();
    dec_stage_x<TT, DW, GC, true>(xs, x, (long)K, M, K, chunks, c0, win);
    float acc[TT][4] = {};
    const unsigned char* xrow[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) xrow[tt] = xs + min(tt * 8 + g, M - 1) * stride;
    for (int i = 0; valid(q); ++i) {
        if (valid(qi)) {
            issue(qi, issued++);
            advance(qi, win);
        }
        const int r = i % R;
        mbar_wait(bars + 8 * r, (i / R) & 1);
        typename F::Regs cur;
        const unsigned char* sp = ring_p + r * SLOT;
#pragma unroll
        for (int u = 0; u < U; ++u) cur.w[u] = *reinterpret_cast<const uint4*>(sp + u * 512 + lane * 16);
        const int g0 = q.c >> f.chunk_shift;
#pragma unroll
        for (int s = 0; s < F::SPANS; ++s)
            cur.p[s] = *reinterpret_cast<const uint2*>(sp + U * 512 + (((q.c + s * GC) >> f.chunk_shift) - g0) * 64 + g * 8);
        __syncwarp();  // the slot is free for the batch issued next
#pragma unroll
        for (int s = 0; s < F::SPANS; ++s) {
            float G[2][TT][4] = {};
#pragma unroll
            for (int uu = 0; uu < GC; ++uu) {
                uint4 xv[TT][2];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) f.load_x(xrow[tt] + (q.slot + s * GC + uu) * 128, xv[tt]);
                f.template mma<TT>(cur, s * GC + uu, xv, G);
            }
            float S[TT][2];
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const float2 v = *reinterpret_cast<const float2*>(xsum + (q.slot / GC + s) * MP + tt * 8 + 2 * t);
                S[tt][0] = v.x;
                S[tt][1] = v.y;
            }
            f.flush(cur, s, G, S, acc);
        }
        Cursor nq = q;
        advance(nq, win);
        if (nq.c == 0 || nq.u == u1)
            dec_finish<TT>(acc, q.b * DW + warp, q.b, chunks, per_cta, max_pieces, M, N, partial, counters, y, (long)N,
                           W4Epilogue{});
        q = nq;
    }
}
template <class T, int GC, int R, int TT, int DW>
__global__ void __launch_bounds__(DW * 32, 1)
    ring_probe(const uint4* codes, const uint2* params, const T* x, float* y, float* partial, int* counters, int M,
               int N, int K, int tiles, int chunks, int groups, int per_cta, int max_pieces) {
    dec_ring<T, GC, R, TT, DW>(codes, params, x, y, partial, counters, M, N, K, tiles, chunks, groups, per_cta,
                               max_pieces);
}

// The floor: each warp reads its contiguous share of `bytes` with U 16-byte loads per lane in
// flight; ROLLED keeps the outer loop rolled (exactly U loads in flight), else the compiler
// unrolls it and hoists more.
template <int U, bool ROLLED>
__global__ void __launch_bounds__(512, 1) read_probe(const uint4* src, long per_warp16, u32* sink) {
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint4* p = src + gw * per_warp16 + (threadIdx.x & 31);
    u32 acc = 0;
#pragma unroll(ROLLED ? 1 : 4)
    for (long i = 0; i < per_warp16 / 32; i += U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = i + u < per_warp16 / 32 ? ld_stream(p + (i + u) * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
// The gemv's pattern: CTA b (grid-stride over row blocks of 16 tiles), warp w reads tile 16b + w
// whole, U chunks of 512 B per lane at a time (rolled).
template <int U>
__global__ void __launch_bounds__(512, 1) read_tiles(const uint4* src, int tiles, int chunks, u32* sink) {
    const int warp = threadIdx.x >> 5;
    u32 acc = 0;
    for (int b = blockIdx.x; b * 16 < tiles; b += gridDim.x) {
        const uint4* p = src + (long)(b * 16 + warp) * chunks * 32 + (threadIdx.x & 31);
#pragma unroll 1
        for (int c = 0; c < chunks; c += U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = c + u < chunks ? ld_stream(p + (c + u) * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <class T> static unsigned short bits_of(float f) {
    const T h = (T)f;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Per-call microseconds of `launch` (which enqueues one call on the stream) in a graph of 20 calls.
template <class L> float graph_time(cudaStream_t s, L launch) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    for (int i = 0; i < 20; ++i) launch();
    cudaStreamEndCapture(s, &g);
    if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) return -1;
    cudaGraphLaunch(ge, s);
    cudaStreamSynchronize(s);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> t;
    for (int r = 0; r < 10; ++r) {
        cudaEventRecord(a, s);
        cudaGraphLaunch(ge, s);
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        t.push_back(ms * 1e3f / 20);
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return median(t);
}

template <class T> struct Layer {
    int N, K, M;
    int tiles, chunks, groups;
    uint4* codes;
    uint2* params;
    T* x;
    float *y, *yref, *partial;
    int* counters;
    double bytes;
};

static std::vector<float> host_y;
static std::vector<float> ref_y;

template <class T, class Kern>
void run_dec(const char* name, Kern k, int dw, int per_sm, bool pdl, Layer<T>& L, cudaStream_t s, int sms,
             bool check, int U, bool g64, int ring = 0) {
    const long units = (long)((L.tiles + dw - 1) / dw) * L.chunks;
    const int ctas_want = per_sm * sms;
    // whole: every CTA takes `whole` row blocks (no tile is split; SMs left unbalanced).
    int per_cta = (int)((units + ctas_want - 1) / ctas_want);
    per_cta = (per_cta + U - 1) / U * U;
    const int ctas = (int)((units + per_cta - 1) / per_cta);
    const int max_pieces = (L.chunks + per_cta - 1) / per_cta + 1;
    const int win = std::min(per_cta, L.chunks);
    int smem = L.M * (win * 128 + 16) + win * ((L.M + 7) / 8 * 8) * 4;
    if (ring) smem = (smem + 127) / 128 * 128 + dw * ring * (4 * 512 + 256 + 8);
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int occ = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, dw * 32, smem);
    auto launch = [&]() {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(ctas);
        cfg.blockDim = dim3(dw * 32);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
        // g64: the kernel reads a parameter pair per chunk (timing only: the data has groups of 128).
        cudaLaunchKernelEx(&cfg, k, (const uint4*)L.codes, (const uint2*)L.params, (const T*)L.x, L.y, L.partial,
                           L.counters, L.M, L.N, L.K, L.tiles, L.chunks, g64 ? L.chunks : L.groups, per_cta,
                           max_pieces);
    };
    cudaMemset(L.y, 0xff, (size_t)L.M * L.N * 4);  // poisoned
    launch();
    cudaError_t e = cudaStreamSynchronize(s);
    double err = 0, scale = 0;
    if (check) {
        host_y.resize((size_t)L.M * L.N);
        cudaMemcpy(host_y.data(), L.y, host_y.size() * 4, cudaMemcpyDeviceToHost);
        for (size_t i = 0; i < host_y.size(); ++i) {
            scale = std::max(scale, (double)fabsf(ref_y[i]));
            const double d = fabs((double)host_y[i] - ref_y[i]);
            err = std::max(err, std::isnan(d) ? 1e30 : d);
        }
    }
    const float us = graph_time(s, launch);
    printf("  %-34s occ %d ctas %4d  %7.2f us  %5.2f TB/s  %3.0f%% of 4.22", name, occ, ctas, us, L.bytes / us / 1e6,
           L.bytes / us / 1e6 / 4.22 * 100);
    if (check) printf("  max err %.2e of %.2e", err, scale);
    printf("  %s\n", cudaGetErrorString(e != cudaSuccess ? e : cudaGetLastError()));
}

// Every shape and token count for activations of type T (f16 and bf16 decode differently).
template <class T> void probe_dtype(int sms, cudaStream_t s, int* counters, u32* sink) {
    const bool f16 = W4Math<T>::NIBBLE_AT_4;
    printf("== %s\n", f16 ? "f16" : "bf16");
    const int shapes[4][2] = {{28672, 4096}, {4096, 14336}, {6144, 4096}, {4096, 4096}};
    const int ms[3] = {1, 4, 16};
    for (auto& sh : shapes) {
        Layer<T> L{};
        L.N = sh[0];
        L.K = sh[1];
        L.tiles = L.N / 16;
        L.chunks = L.K / 64;
        L.groups = L.K / 128;
        const size_t code_bytes = (size_t)L.tiles * L.chunks * 512, param_bytes = (size_t)L.tiles * L.groups * 64;
        L.bytes = (double)(code_bytes + param_bytes);
        std::vector<u32> hc(code_bytes / 4);
        unsigned st = 12345;
        for (auto& v : hc) v = (st = st * 1664525u + 1013904223u);
        // (scale, 128 + zero) bf16 pairs: scale in [2^-8, 2^-7), zero 0..15.
        std::vector<u32> hp(param_bytes / 4);
        for (auto& v : hp) {
            st = st * 1664525u + 1013904223u;
            const float sc = ldexpf(1.f + (st >> 24) / 256.f, -8), z = W4Math<T>::MAGIC_F + ((st >> 8) & 15);
            v = bits_of<T>(sc) | ((u32)bits_of<T>(z) << 16);
        }
        std::vector<unsigned short> hx((size_t)16 * L.K);
        for (auto& v : hx) {
            st = st * 1664525u + 1013904223u;
            v = bits_of<T>(((st >> 8) / 16777216.f) * 2.f - 1.f);
        }
        cudaMalloc(&L.codes, code_bytes);
        cudaMalloc(&L.params, 2 * param_bytes);  // room for a parameter pair per chunk (g64 timing)
        cudaMalloc(&L.x, hx.size() * 2);
        cudaMalloc(&L.y, (size_t)16 * L.N * 4);
        cudaMalloc(&L.partial, (size_t)L.tiles * (L.chunks + 2) * 16 * 16 * 4);  // the most pieces a tile can have
        cudaMemcpy(L.codes, hc.data(), code_bytes, cudaMemcpyHostToDevice);
        cudaMemcpy(L.params, hp.data(), param_bytes, cudaMemcpyHostToDevice);
        cudaMemcpy(L.x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
        printf("%d x %d  (%.1f MB codes + params)\n", L.N, L.K, L.bytes / 1e6);
        {
            const int warps = sms * 16;
            const long per_warp16 = (long)(code_bytes / 16) / warps / 32 * 32;
            for (int v = 0; v < 6; ++v) {
                auto k = v == 0 ? read_probe<4, false> : v == 1 ? read_probe<4, true> : v == 2 ? read_probe<8, true> : read_probe<16, true>;
                const char* names[] = {"read U=4 (unrolled)", "read rolled U=4", "read rolled U=8", "read rolled U=16",
                                       "read tiles U=4", "read tiles U=8"};
                const float us = v < 4 ? graph_time(s, [&]() { k<<<sms, 512, 0, s>>>(L.codes, per_warp16, sink); })
                                       : graph_time(s, [&]() {
                                             (v == 4 ? read_tiles<4> : read_tiles<8>)<<<sms, 512, 0, s>>>(
                                                 L.codes, L.tiles, L.chunks, sink);
                                         });
                const double b = v < 4 ? (double)per_warp16 * 16 * warps : (double)code_bytes;
                printf("  %-37s %7.2f us  %5.2f TB/s  %3.0f%% of 4.22\n", names[v], us, b / us / 1e6,
                       b / us / 1e6 / 4.22 * 100);
            }
        }
        for (int M : ms) {
            L.M = M;
            printf(" M = %d\n", M);
            // The mma.sync gemv as qlinear::plan_gemv launches it.
            const int blocks = (L.tiles + 7) / 8;
            const int want = std::min(16, std::max(1, (2 * sms + blocks - 1) / blocks));
            const int fit = std::max(1, (int)((48 * 1024 / M - 128) / 128));
            const int cps = std::min(fit, std::max(std::min(2, L.chunks), (L.chunks + want - 1) / want));
            const int splits = (L.chunks + cps - 1) / cps;
            const int smem = M * (cps * 128 + 16);
            using GemvFn = void (*)(const uint4*, const uint2*, const T*, long, float*, long, float*, int*, int, int,
                                    int, int, int, int, int, int, int);
            const GemvFn gk = f16 ? (M <= 8 ? (GemvFn)w4a16_gemv1_f16 : (GemvFn)w4a16_gemv2_f16)
                                  : (M <= 8 ? (GemvFn)w4a16_gemv1_bf16 : (GemvFn)w4a16_gemv2_bf16);
            cudaMemset(L.y, 0xff, (size_t)M * L.N * 4);
            gk<<<dim3(blocks, splits), 256, smem, s>>>(L.codes, L.params, L.x, L.K, L.y, L.N, L.partial, counters, M,
                                                      L.N, L.K, L.tiles, L.chunks, L.groups, 128, 7, cps);
            cudaStreamSynchronize(s);
            ref_y.resize((size_t)M * L.N);
            cudaMemcpy(ref_y.data(), L.y, ref_y.size() * 4, cudaMemcpyDeviceToHost);
            const float us = graph_time(s, [&]() {
                gk<<<dim3(blocks, splits), 256, smem, s>>>(L.codes, L.params, L.x, L.K, L.y, L.N, L.partial, counters,
                                                          M, L.N, L.K, L.tiles, L.chunks, L.groups, 128, 7, cps);
            });
            printf("  %-34s       ctas %4d  %7.2f us  %5.2f TB/s  %3.0f%% of 4.22\n", "gemv (mma.sync, today)",
                   blocks * splits, us, L.bytes / us / 1e6, L.bytes / us / 1e6 / 4.22 * 100);
            L.counters = counters;
#define DEC(MATH, TT, GC, DW, MINB, PER_SM, PDL, NAME) \
    run_dec(NAME, dec_probe<T, MATH, TT, GC, DW, MINB>, DW, PER_SM, PDL, L, s, sms, MATH == 1 && GC == 2, 4, GC == 1)
#define RING(R, TT, PDL, NAME) \
    run_dec(NAME, ring_probe<T, 2, R, TT, 16>, 16, 1, PDL, L, s, sms, true, 4, false, R)
            if (M <= 8) {
                RING(3, 1, false, "ring R3 W16");
                RING(4, 1, false, "ring R4 W16");
                RING(5, 1, false, "ring R5 W16");
                RING(4, 1, true, "ring R4 W16 pdl");
                DEC(0, 1, 2, 16, 1, 1, false, "dec none  W16");
                DEC(1, 1, 2, 16, 1, 1, false, "dec lean  W16 g128");
                DEC(1, 1, 1, 16, 1, 1, false, "dec lean  W16 g128 as g64");
                DEC(1, 1, 2, 8, 2, 2, false, "dec lean  W8 2/SM");
                DEC(1, 1, 2, 16, 1, 1, true, "dec lean  W16 pdl");
            } else {
                RING(2, 2, false, "ring R2 W16");
                RING(3, 2, true, "ring R3 W16 pdl");
                DEC(1, 2, 2, 16, 1, 1, false, "dec lean  W16 g128");
                DEC(1, 2, 1, 16, 1, 1, false, "dec lean  W16 g128 as g64");
                DEC(1, 2, 2, 16, 1, 1, true, "dec lean  W16 pdl");
            }
        }
        cudaFree(L.codes);
        cudaFree(L.params);
        cudaFree(L.x);
        cudaFree(L.y);
        cudaFree(L.partial);
    }
}

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const int sms = prop.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    int* counters;
    cudaMalloc(&counters, 1 << 20);
    cudaMemset(counters, 0, 1 << 20);
    u32* sink;
    cudaMalloc(&sink, 4);
    probe_dtype<__nv_bfloat16>(sms, s, counters, sink);
    probe_dtype<__half>(sms, s, counters, sink);
    return 0;
}

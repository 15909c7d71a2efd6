// Which way of streaming weights reaches HBM bandwidth on Hopper? A probe for the decode gemv
// (kernels/qgemm.cu, stream tier): every warp streams its own contiguous run of a large buffer
// (as a gemv warp streams its packed tile) and folds it into a checksum, no math.
//   bulk<REQ, STAGES, WARPS>: lane 0 keeps STAGES cp.async.bulk copies of REQ bytes in flight
//     into the warp's shared-memory ring, each completing on its own mbarrier;
//   ldg<U, WARPS>: every lane keeps U 16-byte ld.global.nc loads in flight (registers).
// Build and run on the GPU machine:  nvcc -O3 -gencode=arch=compute_90a,code=sm_90a
//   -o /tmp/probe bench/probe/stream_probe.cu && /tmp/probe
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
typedef unsigned int u32;

__device__ __forceinline__ u32 saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar)); }
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void mbar_spin(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Each warp: bytes [w * per_warp, (w + 1) * per_warp) of src.
// SPIN: wait with test_wait (a pure spin) instead of try_wait; PARTS: bulk copies per stage.
template <int REQ, int STAGES, int WARPS, bool SPIN = false, int PARTS = 1>
__global__ void __launch_bounds__(WARPS * 32) bulk(const uint4* src, long per_warp, u32* sink) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long gw = (long)blockIdx.x * WARPS + warp;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(src) + gw * per_warp;
    unsigned char* ring = smem + warp * STAGES * REQ;
    const u32 bars = saddr(smem + WARPS * STAGES * REQ) + warp * STAGES * 8;
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    const int n = (int)(per_warp / REQ);
    if (lane == 0)
        for (int s = 0; s < STAGES && s < n; ++s) {
            mbar_expect_tx(bars + 8 * s, REQ);
            for (int q = 0; q < PARTS; ++q)
                bulk_load(saddr(ring + s * REQ + q * (REQ / PARTS)), base + (long)s * REQ + q * (REQ / PARTS), REQ / PARTS, bars + 8 * s);
        }
    u32 acc = 0;
    for (int i = 0; i < n; ++i) {
        const int slot = i % STAGES;
        if (SPIN) mbar_spin(bars + 8 * slot, (i / STAGES) & 1);
        else mbar_wait(bars + 8 * slot, (i / STAGES) & 1);
        for (int o = lane * 16; o < REQ; o += 512) {
            const uint4 v = *reinterpret_cast<const uint4*>(ring + slot * REQ + o);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0 && i + STAGES < n) {
            mbar_expect_tx(bars + 8 * slot, REQ);
            for (int q = 0; q < PARTS; ++q)
                bulk_load(saddr(ring + slot * REQ + q * (REQ / PARTS)), base + (long)(i + STAGES) * REQ + q * (REQ / PARTS), REQ / PARTS, bars + 8 * slot);
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <int U, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) ldg(const uint4* src, long per_warp, u32* sink) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long gw = (long)blockIdx.x * WARPS + warp;
    const uint4* p = src + gw * (per_warp / 16) + lane;
    const int n = (int)(per_warp / 512);
    u32 acc = 0;
    for (int i = 0; i < n; i += U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + (long)(i + u) * 32));
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

template <class K>
void time_it(const char* name, K kernel, int warps, int smem, const uint4* buf, long bytes, u32* sink, int sms) {
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, smem);
    if (per_sm > 2) per_sm = 2;  // as the gemv runs: two CTAs of 8 warps per SM at most
    const long ctas = (long)per_sm * sms, per_warp = bytes / (ctas * warps) / 2048 * 2048;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int r = 0; r < 3; ++r) kernel<<<ctas, warps * 32, smem>>>(buf, per_warp, sink);
    cudaEventRecord(a);
    const int reps = 20;
    for (int r = 0; r < reps; ++r) kernel<<<ctas, warps * 32, smem>>>(buf, per_warp, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    const double moved = (double)per_warp * ctas * warps;
    printf("%-28s ctas/SM %d  %.2f TB/s  (%s)\n", name, per_sm, moved / (ms / reps * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
}

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    const long bytes = argc > 1 ? atol(argv[1]) << 20 : 1L << 30;  // MiB per launch
    uint4* buf;
    u32* sink;
    cudaMalloc(&buf, bytes);
    cudaMalloc(&sink, 4);
    cudaMemset(buf, 1, bytes);
    const int sms = prop.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB, %ld MiB streamed per launch\n", prop.name, sms, prop.l2CacheSize >> 20, bytes >> 20);
    time_it("memcpy-like ldg U=8 W=8", ldg<8, 8>, 8, 0, buf, bytes, sink, sms);
    time_it("ldg U=4 W=8", ldg<4, 8>, 8, 0, buf, bytes, sink, sms);
    time_it("ldg U=8 W=4", ldg<8, 4>, 4, 0, buf, bytes, sink, sms);
    time_it("ldg U=16 W=8", ldg<16, 8>, 8, 0, buf, bytes, sink, sms);
#define B(REQ, ST, W) time_it("bulk " #REQ " x" #ST " W=" #W, bulk<REQ, ST, W>, W, W * ST * REQ + W * ST * 8, buf, bytes, sink, sms)
    B(2048, 4, 8);
    B(2048, 8, 8);
    B(4096, 4, 8);
    B(8192, 4, 4);
    B(8192, 2, 8);
    B(16384, 4, 2);
    B(16384, 3, 4);
    B(32768, 3, 2);
    B(1024, 8, 8);
    B(2048, 4, 4);
    B(2048, 6, 8);
    B(1024, 8, 8);
    B(1024, 6, 8);
    B(1024, 4, 8);
    B(2560, 4, 8);
    B(1280, 8, 8);
#define BX(REQ, ST, W, SPIN, PARTS) time_it("bulk " #REQ " x" #ST " W=" #W " spin" #SPIN " parts" #PARTS, bulk<REQ, ST, W, SPIN, PARTS>, W, W * ST * REQ + W * ST * 8, buf, bytes, sink, sms)
    BX(2048, 4, 8, true, 1);
    BX(1024, 8, 8, true, 1);
    BX(2048, 8, 8, false, 2);
    BX(1024, 8, 8, false, 2);
    BX(2048, 4, 8, false, 2);
    return 0;
}

// Hopper (sm_90a) building blocks shared by the wgmma kernels (qgemm_wgmma.cu, prefill_wgmma.cu):
// mbarriers, TMA tensor copies, shared-memory matrix descriptors and the wgmma group fences.
// PTX ISA §9.7.9.15 (mbarrier), §9.7.9.25 (cp.async.bulk.tensor), §9.7.15 (wgmma).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (host pass: bench/probe)

// A CUtensorMap, passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};

__device__ __forceinline__ void mbar_init_count(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Box (k0, row0) of `map` into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int k0, int row0, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(k0), "r"(row0), "r"(bar)
        : "memory");
}

// Box (c0, c1, c2) of a 3-D `map` (a weight tensor: bytes of a chunk, chunk or group, tile).
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// Shared-memory matrix descriptor in the 128-byte swizzle layout: rows of 128 bytes, 8-row atoms
// of 1024 bytes (SBO). A K-major operand ignores `lbo` and advances its start by 32 bytes per
// wgmma K step; an MN-major one finds its next 64 columns `lbo` bytes on.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo = 16) {
    return (u64)((addr & 0x3ffff) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Box (c0, c1, c2, c3) of a 4-D `map` (the paged KV cache: channel, slot in block, head, block).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of wgmma accumulators across a fence or wait.
template <int J> __device__ __forceinline__ void fence_acc(int (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) asm volatile("" : "+r"(d[j][0]), "+r"(d[j][1]), "+r"(d[j][2]), "+r"(d[j][3])::"memory");
}
template <int J> __device__ __forceinline__ void fence_acc(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

#endif  // sm_90a

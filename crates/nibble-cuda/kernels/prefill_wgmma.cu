// Causal prefill attention, wgmma tier (sm_90a): FlashAttention-3 (Shah et al., 2024) §3.1
// (warp specialization: a TMA producer warp and two consumer warpgroups on mbarriers) and §3.2
// (intra-warpgroup overlap: the softmax of key tile j runs while P V of tile j - 1 is on the
// tensor cores), over nibble's paged KV cache. It serves whole prompts and chunked prefill alike.
//
// Work: one CTA per (query head, query tile of up to 128 rows of one sequence); grid.x walks the
// heads, grid.y a host-built tile list sorted longest first (causal tiles differ in work).
// Consumer warpgroup w owns rows 64w .. 64w + 63 (a warpgroup whose rows are all past the tile's
// end exits at once); the producer is one thread of the third warpgroup.
// Layout: Q (converted from f32 to the cache's 16-bit type by the consumers), K and V tiles of 128
// keys are stored as panels of 64 channels, 128-byte rows, 128-byte swizzled: Q and K are the
// K-major operands of S = Q K^T (wgmma m64n128k16, both from shared memory), V the N-major B
// operand of O += P V (transposed read; LBO = one panel, SBO = 8 rows), P the register A operand:
// the S accumulator layout is the A fragment layout, so P never touches shared memory.
// Pipeline: FaSmem::STAGES stages (3 at head_dim 128, 4 at 64) of (K, V), each with a full barrier for K and one for V (so S can
// start before V lands) and an empty barrier the consumer warps release once P V retired. The
// producer fills a stage with 16-token TMA boxes (a KV block of one head is a [16][HD] run of the
// cache: boxes of 64 channels x 16 slots), block ids read from the sequence's table; blocks past
// the tile's last position are fetched at block index `num_blocks`, outside the tensor, which TMA
// fills with zeros.
// Causality: key position kp joins query position qp when kp <= qp; only tiles that cross a
// warp's first position are masked. Rows past the tile compute and are not stored.
// Sliding window (window > 0): kp also needs qp - kp < window. Key tiles before the window of
// the CTA's first query are neither loaded nor computed (tile j below is the (j0 + j)-th of the
// sequence); a tile that reaches below a warp's last window is masked. In a masked tile the
// masked keys get probability 0 explicitly: a row can meet a tile with none of its keys before
// its first one (m still -1e30), where exp2((s - m) * scale) would be exp2 of the rounding error
// of -1e30 * scale, anything from 0 to inf.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define FA_THREADS 384  // two consumer warpgroups, then the producer warpgroup
#define FA_M 128        // query rows per CTA
#define FA_N 128        // keys per tile
#define FA_BLOCK 16     // tokens per KV block (attention.rs KV_BLOCK)
// Registers after setmaxnreg (as qgemm_wgmma.cu): 40 + 2 x 232 per lane of each SM sub-partition.
#define FA_PRODUCER_REGS 40
#define FA_CONSUMER_REGS 232

// S (64 rows x 128 keys) = A x B, both from shared memory (K-major), D zeroed unless scale_d.
// O (64 rows x 128 or 64 channels) += A (registers) x B (shared memory, N-major).
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], u64 da, u64 db, int scale_d, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[16][4], const u32* a, u64 db, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[8][4], const u32* a, u64 db, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], u64 da, u64 db, int scale_d, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[16][4], const u32* a, u64 db, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[8][4], const u32* a, u64 db, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}


template <int HD> struct FaSmem {
    // Stages of (K, V): as many as fit next to Q in 227 KB (attention.rs wgmma_prefill_smem).
    static constexpr int STAGES = HD == 128 ? 3 : 4;
    static constexpr int PANELS = HD / 64;
    static constexpr int PANEL_Q = FA_M * 128, PANEL_KV = FA_N * 128;  // bytes of a 64-channel panel
    static constexpr int Q_BYTES = PANELS * PANEL_Q, KV_BYTES = PANELS * PANEL_KV;
    static constexpr int BARS = Q_BYTES + 2 * STAGES * KV_BYTES;  // offset of the barriers
    static constexpr int BYTES = BARS + 3 * STAGES * 8 + 1024;    // + alignment slack
};

template <class T, int HD>
__device__ void prefill_wgmma_impl(const TmaMap* kmap, const TmaMap* vmap, const float* __restrict__ q,
                                   const int* __restrict__ block_tables, const PrefillTile* __restrict__ tiles,
                                   T* __restrict__ out, int num_kv_heads, int group, int max_blocks,
                                   int num_blocks, float scale_log2, long ldq, int window) {
    using L = FaSmem<HD>;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    const u32 raw = smem_addr(fa_smem), pad = (1024 - (raw & 1023)) & 1023;
    unsigned char* smem = fa_smem + pad;  // swizzle atoms are 1024-byte aligned
    const u32 base = raw + pad;
    auto kst = [&](int s) { return base + L::Q_BYTES + s * L::KV_BYTES; };
    auto vst = [&](int s) { return base + L::Q_BYTES + (L::STAGES + s) * L::KV_BYTES; };
    auto full_k = [&](int s) { return base + L::BARS + 8 * s; };
    auto full_v = [&](int s) { return base + L::BARS + 8 * (L::STAGES + s); };
    auto empty = [&](int s) { return base + L::BARS + 8 * (2 * L::STAGES + s); };

    const PrefillTile tile = tiles[blockIdx.y];
    const int h = blockIdx.x, kvh = h / group, num_heads = num_kv_heads * group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int last = tile.pos0 + tile.rows - 1;  // the tile's last query position
    const int j0 = window > 0 ? max(0, tile.pos0 - window + 1) / FA_N : 0;  // first key tile
    const int n = last / FA_N + 1 - j0;          // key tiles read
    const int consumer_warps = tile.rows > 64 ? 8 : 4;

    if (threadIdx.x == 0) {
        for (int s = 0; s < L::STAGES; ++s) {
            mbar_init_count(full_k(s), 1);
            mbar_init_count(full_v(s), 1);
            mbar_init_count(empty(s), consumer_warps);  // lane 0 of each working consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp >= 8) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(FA_PRODUCER_REGS));
        if (warp != 8 || lane != 0) return;
        const int* table = block_tables + (long)tile.seq * max_blocks;
        // Block ids of key tile j, read a tile ahead so their latency hides behind the wait.
        int blk[FA_N / FA_BLOCK], next[FA_N / FA_BLOCK];
        auto read_ids = [&](int j) {
#pragma unroll
            for (int b = 0; b < FA_N / FA_BLOCK; ++b) {
                const int p = (j0 + j) * FA_N + b * FA_BLOCK;
                next[b] = p <= last ? table[p / FA_BLOCK] : num_blocks;
            }
        };
        read_ids(0);
        for (int j = 0; j < n; ++j) {
            const int s = j % L::STAGES;
#pragma unroll
            for (int b = 0; b < FA_N / FA_BLOCK; ++b) blk[b] = next[b];
            if (j + 1 < n) read_ids(j + 1);
            if (j >= L::STAGES) mbar_wait(empty(s), (j / L::STAGES + 1) & 1);
            mbar_expect_tx(full_k(s), L::KV_BYTES);
#pragma unroll
            for (int b = 0; b < FA_N / FA_BLOCK; ++b)
#pragma unroll
                for (int c = 0; c < L::PANELS; ++c)
                    tma_load_4d(kst(s) + c * L::PANEL_KV + b * FA_BLOCK * 128, kmap, c * 64, 0, kvh, blk[b], full_k(s));
            mbar_expect_tx(full_v(s), L::KV_BYTES);
#pragma unroll
            for (int b = 0; b < FA_N / FA_BLOCK; ++b)
#pragma unroll
                for (int c = 0; c < L::PANELS; ++c)
                    tma_load_4d(vst(s) + c * L::PANEL_KV + b * FA_BLOCK * 128, vmap, c * 64, 0, kvh, blk[b], full_v(s));
        }
        return;
    }
    if (warp >= consumer_warps) return;  // a warpgroup with no rows of this tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(FA_CONSUMER_REGS));

    // This warpgroup's 64 rows of Q -> shared memory, in the swizzled panel layout.
    const int wg = warp >> 2, row0 = wg * 64;
    for (int i = threadIdx.x & 127; i < 64 * HD / 8; i += 128) {
        const int r = row0 + i / (HD / 8), c = (i % (HD / 8)) * 8;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (r < tile.rows) {
            const float4* src = reinterpret_cast<const float4*>(q + (long)(tile.row0 + r) * ldq + h * HD + c);
            a = src[0];
            b = src[1];
        }
        uint4 v;
        v.x = pack2(a.x, a.y, (T*)nullptr);
        v.y = pack2(a.z, a.w, (T*)nullptr);
        v.z = pack2(b.x, b.y, (T*)nullptr);
        v.w = pack2(b.z, b.w, (T*)nullptr);
        const int chunk = (c & 63) >> 3;
        *reinterpret_cast<uint4*>(smem + (c >> 6) * L::PANEL_Q + r * 128 + ((chunk ^ (r & 7)) << 4)) = v;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma reads
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");

    const int g = lane >> 2, t = lane & 3;
    const int wpos = tile.pos0 + row0 + (warp & 3) * 16;  // this warp's first query position
    const int qp0 = wpos + g, qp1 = qp0 + 8;
    const u32 qbase = base + row0 * 128;
    float s[FA_N / 8][4], o[HD / 8][4];
    u32 p[FA_N / 16][4];
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f}, corr[2];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    auto qk = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
            wgmma_ss(s, sw128_desc(qbase + (kk >> 2) * L::PANEL_Q + (kk & 3) * 32),
                     sw128_desc(kst(st) + (kk >> 2) * L::PANEL_KV + (kk & 3) * 32), kk > 0, (T*)nullptr);
    };
    auto pv = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < FA_N / 16; ++kk) wgmma_rs_nmajor(o, p[kk], sw128_desc(vst(st) + kk * 16 * 128, L::PANEL_KV), (T*)nullptr);
    };
    // Mask S of key tile j, fold its maxima into m (raw scores), and replace S by
    // exp2((S - m) * scale_log2), one FFMA and one ex2 each; corr rescales what was summed before,
    // l takes this thread's share of the row sums (the quad adds them at the end).
    auto probs = [&](int j) {
        const int kv0 = (j0 + j) * FA_N;
        const bool below = window > 0 && kv0 + window <= wpos + 15;
        const bool masked = kv0 + FA_N - 1 > wpos || below;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < FA_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (masked) {
                    const int kp = kv0 + i * 8 + 2 * t + (e & 1), qp = e < 2 ? qp0 : qp1;
                    if (kp > qp || (below && qp - kp >= window)) s[i][e] = NEG_BIG;
                }
                mx[e >> 1] = fmaxf(mx[e >> 1], s[i][e]);
            }
        float rs[2] = {0.f, 0.f}, bias[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            corr[r] = fast_exp2((m[r] - mx[r]) * scale_log2);
            m[r] = mx[r];
            bias[r] = -mx[r] * scale_log2;
        }
#pragma unroll
        for (int i = 0; i < FA_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = fast_exp2(fmaf(s[i][e], scale_log2, bias[e >> 1]));
                if (masked && s[i][e] == NEG_BIG) v = 0.f;
                s[i][e] = v;
                rs[e >> 1] += v;
            }
        l[0] = l[0] * corr[0] + rs[0];
        l[1] = l[1] * corr[1] + rs[1];
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < FA_N / 16; ++kk) {
            p[kk][0] = pack2(s[2 * kk][0], s[2 * kk][1], (T*)nullptr);
            p[kk][1] = pack2(s[2 * kk][2], s[2 * kk][3], (T*)nullptr);
            p[kk][2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], (T*)nullptr);
            p[kk][3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], (T*)nullptr);
        }
    };

    // Ping-pong (FlashAttention-3 §3.1): the two warpgroups take turns to issue their GEMMs, so
    // one's softmax runs while the other's GEMMs hold the tensor cores. Warpgroup w waits on
    // named barrier 3 + w, which the other one's 128 threads arrive at once they have issued;
    // warpgroup 1 lets warpgroup 0 go first, and skips its last arrival, which nobody awaits.
    const bool pingpong = consumer_warps == 8;
    int turn = 0;  // GEMM issues so far (n + 1 in all)
    auto my_turn = [&]() {
        if (pingpong) asm volatile("bar.sync %0, 256;\n" ::"r"(3 + wg) : "memory");
    };
    auto pass_turn = [&]() {
        ++turn;
        if (pingpong && !(wg == 1 && turn == n + 1)) asm volatile("bar.arrive %0, 256;\n" ::"r"(4 - wg) : "memory");
    };
    if (pingpong && wg == 1) asm volatile("bar.arrive 3, 256;\n" ::: "memory");

    mbar_wait(full_k(0), 0);
    my_turn();
    wgmma_fence();
    qk(0);
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    fence_acc(s);
    probs(0);
    pack_p();
    for (int j = 1; j < n; ++j) {
        const int st = j % L::STAGES, prev = (j - 1) % L::STAGES;
        mbar_wait(full_k(st), (j / L::STAGES) & 1);
        mbar_wait(full_v(prev), ((j - 1) / L::STAGES) & 1);
        my_turn();
        wgmma_fence();
        qk(st);
        wgmma_commit();
        pv(prev);
        wgmma_commit();
        pass_turn();
        wgmma_wait<1>();  // S of tile j is in; P V of tile j - 1 may still run
        fence_acc(s);
        probs(j);
        wgmma_wait<0>();
        fence_acc(o);
        if (lane == 0) mbar_arrive(empty(prev));
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[0];
            o[i][2] *= corr[1];
            o[i][3] *= corr[1];
        }
        pack_p();
    }
    mbar_wait(full_v((n - 1) % L::STAGES), ((n - 1) / L::STAGES) & 1);
    my_turn();
    wgmma_fence();
    pv((n - 1) % L::STAGES);
    wgmma_commit();
    pass_turn();
    wgmma_wait<0>();
    fence_acc(o);

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const float inv0 = 1.0f / l[0], inv1 = 1.0f / l[1];
    const int ra = row0 + (warp & 3) * 16 + g, rb = ra + 8;
    T* dst_a = out + (long)(tile.row0 + ra) * num_heads * HD + h * HD + 2 * t;
    T* dst_b = out + (long)(tile.row0 + rb) * num_heads * HD + h * HD + 2 * t;
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
        if (ra < tile.rows) *reinterpret_cast<u32*>(dst_a + i * 8) = pack2(o[i][0] * inv0, o[i][1] * inv0, (T*)nullptr);
        if (rb < tile.rows) *reinterpret_cast<u32*>(dst_b + i * 8) = pack2(o[i][2] * inv1, o[i][3] * inv1, (T*)nullptr);
    }
}

#define NIBBLE_PREFILL_WGMMA(SUFFIX, T, HD)                                                               \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) prefill_wgmma_##SUFFIX##_hd##HD(           \
        const __grid_constant__ TmaMap kmap, const __grid_constant__ TmaMap vmap, const float* q,         \
        const int* block_tables, const PrefillTile* tiles, T* out, int num_kv_heads, int group,           \
        int max_blocks, int num_blocks, float scale_log2, long ldq, int window) {                         \
        prefill_wgmma_impl<T, HD>(&kmap, &vmap, q, block_tables, tiles, out, num_kv_heads, group,         \
                                  max_blocks, num_blocks, scale_log2, ldq, window);                       \
    }
#define NIBBLE_PREFILL_WGMMA_ALL(SUFFIX, T) \
    NIBBLE_PREFILL_WGMMA(SUFFIX, T, 64)     \
    NIBBLE_PREFILL_WGMMA(SUFFIX, T, 128)
NIBBLE_BOTH_DTYPES(NIBBLE_PREFILL_WGMMA_ALL)

#endif  // sm_90a

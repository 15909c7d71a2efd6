// Causal prefill attention on tensor cores (FlashAttention-2 forward) over the paged KV cache.
//
// Work: one CTA per (query tile of up to 64 rows of one sequence, query head); grid.x walks a
// host-built tile list, grid.y the heads. 4 warps, each owning 16 query rows. The loop runs over
// 64-key tiles of the sequence's context up to the tile's last query position; keys and values
// of a tile are gathered from the paged cache (kv_pages.cuh: a 16-bit pool's
// [blocks][kv_heads][block_size][HD], or quantized pages dequantized on the way; positions past
// the context zero-filled) into shared memory, rows padded by 8 elements so fragment loads hit 32
// distinct banks.
// Math: mma.sync m16n8k16 with bf16/f16 operands and f32 accumulators. S = Q K^T takes Q as A
// fragments held in registers for the whole loop and K rows straight from shared memory as B
// fragments; the online softmax (base 2, scale folded into log2e) works on the S accumulators,
// which are re-packed in place as the A fragments of P V (the m16n8 C layout is the m16k16 A
// layout), and V's B fragments come from ldmatrix.trans.
// Causality: key position kp joins query position qp when kp <= qp, and with a sliding window
// (window > 0) when also qp - kp < window; key tiles before the window of the tile's first query
// are not read. A row whose keys in a tile are all masked adds nothing (softmax_tile gives them
// probability 0). Rows past the tile's length compute and are not stored.

#define PF_M 64
#define PF_N 64

// Tile list entry: the tile's first batch row, its first position, its rows, its sequence.
struct PrefillTile {
    int row0, pos0, rows, seq;
};

// KDEF / VDEF (kv4c, kv2c; docs/design/kv-channel-gpu.md): the keys / values of a block being
// filled wait in the residual (`rk`, `rv`, f32, `res_tables`), and, as on the CPU, a query reads
// its own block raw and every earlier block quantized. A key tile that meets the query tile's
// blocks then runs twice: once from the pages with the query's own block masked out, once with
// only that block, its deferred sides gathered from the residual. The online softmax takes the
// two passes as it takes two tiles.
template <class T, int HD, int KK, int VK, bool KDEF = false, bool VDEF = false>
__device__ void prefill_impl(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                             const unsigned char* __restrict__ vc, const int* __restrict__ block_tables,
                             const PrefillTile* __restrict__ tiles, T* __restrict__ out,
                             int num_kv_heads, int group, int max_blocks, int block_size,
                             float scale_log2, long ldq, int window, const float* __restrict__ rk = nullptr,
                             const float* __restrict__ rv = nullptr,
                             const int* __restrict__ res_tables = nullptr) {
    constexpr bool DEFERRED = KDEF || VDEF;
    constexpr int LD = HD + 8;  // padded row, in elements
    __shared__ __align__(16) T ks[PF_N * LD];
    __shared__ __align__(16) T vs[PF_N * LD];
    const PrefillTile tile = tiles[blockIdx.x];
    const int h = blockIdx.y, kvh = h / group;
    const int num_heads = num_kv_heads * group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int* table = block_tables + (long)tile.seq * max_blocks;

    // Q tile -> shared (through ks), then A fragments into registers.
    for (int i = threadIdx.x; i < PF_M * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        const float v = r < tile.rows ? q[(long)(tile.row0 + r) * ldq + h * HD + d] : 0.f;
        ks[r * LD + d] = from_f32<T>(v);
    }
    __syncthreads();
    u32 qf[HD / 16][4];
    const int r0 = warp * 16 + g;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int c = kk * 16 + 2 * t;
        qf[kk][0] = *reinterpret_cast<const u32*>(&ks[r0 * LD + c]);
        qf[kk][1] = *reinterpret_cast<const u32*>(&ks[(r0 + 8) * LD + c]);
        qf[kk][2] = *reinterpret_cast<const u32*>(&ks[r0 * LD + c + 8]);
        qf[kk][3] = *reinterpret_cast<const u32*>(&ks[(r0 + 8) * LD + c + 8]);
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
    const int qp0 = tile.pos0 + r0, qp1 = qp0 + 8;  // positions of this thread's two rows
    const int last = tile.pos0 + tile.rows - 1;     // the tile's last query position

    const int kv_first = window > 0 ? max(0, tile.pos0 - window + 1) / PF_N * PF_N : 0;
    // Deferred pools: where the query tile's first block starts (tiles past it meet its blocks).
    const int own_first = tile.pos0 / KV_BS * KV_BS;
    const int* rtable = DEFERRED ? res_tables + (long)tile.seq * max_blocks : nullptr;
    // own: 0 for every key tile (with a deferred pool, the query's own block masked out), 1 for
    // the second pass over a tile that meets the query tile's blocks (only the own block).
    auto pass = [&](int kv0, int own) {
        __syncthreads();  // the previous tile (or Q) is no longer read
        if (KDEF && own)
            gather_residual<T, HD, PF_N>(ks, rk, rtable, kv0, last, kvh, num_kv_heads);
        else
            PageSide<T, HD, KK>::template gather<PF_N>(ks, kc, table, kv0, last, kvh, num_kv_heads, block_size);
        if (VDEF && own)
            gather_residual<T, HD, PF_N>(vs, rv, rtable, kv0, last, kvh, num_kv_heads);
        else
            PageSide<T, HD, VK>::template gather<PF_N>(vs, vc, table, kv0, last, kvh, num_kv_heads, block_size);
        __syncthreads();
        // S = Q K^T for this warp's 16 rows and 64 keys.
        float s[PF_N / 8][4];
#pragma unroll
        for (int n = 0; n < PF_N / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                const T* kr = &ks[(n * 8 + g) * LD + kk * 16 + 2 * t];
                mma16816<T>(s[n], qf[kk], *reinterpret_cast<const u32*>(kr),
                            *reinterpret_cast<const u32*>(kr + 8));
            }
        }
        // Causal mask (rows g: c0, c1; g + 8: c2, c3), online softmax, then O += P V.
#pragma unroll
        for (int n = 0; n < PF_N / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kp = kv0 + n * 8 + 2 * t + (e & 1);
                const int qp = e < 2 ? qp0 : qp1;
                bool in = kp <= qp && (window <= 0 || qp - kp < window);
                if constexpr (DEFERRED) in &= (kp / KV_BS == qp / KV_BS) == (own != 0);
                s[n][e] = in ? s[n][e] * scale_log2 : NEG_BIG;
            }
        }
        softmax_tile(s, m, l, o);
#pragma unroll
        for (int kk = 0; kk < PF_N / 16; ++kk) pv_tile<T, HD, LD>(o, s[2 * kk], s[2 * kk + 1], &vs[kk * 16 * LD], lane);
    };
    for (int kv0 = kv_first; kv0 <= last; kv0 += PF_N) {
        pass(kv0, 0);
        if constexpr (DEFERRED) {
            if (kv0 + PF_N > own_first) pass(kv0, 1);
        }
    }
    // Normalize and store this warp's rows that belong to the tile.
    const float inv0 = 1.0f / l[0], inv1 = 1.0f / l[1];
    const int ra = warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        const int d = n * 8 + 2 * t;
        if (ra < tile.rows) {
            T* dst = out + (long)(tile.row0 + ra) * num_heads * HD + h * HD + d;
            dst[0] = from_f32<T>(o[n][0] * inv0);
            dst[1] = from_f32<T>(o[n][1] * inv0);
        }
        if (rb < tile.rows) {
            T* dst = out + (long)(tile.row0 + rb) * num_heads * HD + h * HD + d;
            dst[0] = from_f32<T>(o[n][2] * inv1);
            dst[1] = from_f32<T>(o[n][3] * inv1);
        }
    }
}

// Entry points: `prefill_attn_*` over a 16-bit pool (this module); `kvq_prefill_*` over the
// pool format the kv_quant module is compiled for (kv_quant.cu).
#define NIBBLE_PREFILL_ENTRY(NAME, T, HD, KK, VK)                                                \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                      \
        const float* q, const unsigned char* kc, const unsigned char* vc,                       \
        const int* block_tables, const PrefillTile* tiles, T* out, int num_kv_heads, int group, \
        int max_blocks, int block_size, float scale_log2, long ldq, int window) {                \
        prefill_impl<T, HD, KK, VK>(q, kc, vc, block_tables, tiles, out, num_kv_heads, group,   \
                                    max_blocks, block_size, scale_log2, ldq, window);            \
    }

// A deferred pool's (kv_quant.cu): the residual's rows and tables after `window`.
#define NIBBLE_PREFILL_DEFERRED_ENTRY(NAME, T, HD, KK, VK, KDEF, VDEF)                           \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                      \
        const float* q, const unsigned char* kc, const unsigned char* vc,                       \
        const int* block_tables, const PrefillTile* tiles, T* out, int num_kv_heads, int group, \
        int max_blocks, int block_size, float scale_log2, long ldq, int window, const float* rk, \
        const float* rv, const int* res_tables) {                                               \
        prefill_impl<T, HD, KK, VK, KDEF, VDEF>(q, kc, vc, block_tables, tiles, out, num_kv_heads, \
                                                group, max_blocks, block_size, scale_log2, ldq,  \
                                                window, rk, rv, res_tables);                     \
    }

#ifndef NIBBLE_KVQ_MODULE
#define NIBBLE_PREFILL(SUFFIX, T, HD) \
    NIBBLE_PREFILL_ENTRY(prefill_attn_##SUFFIX##_hd##HD, T, HD, PAGE_F16, PAGE_F16)
#define NIBBLE_PREFILL_ALL(SUFFIX, T) \
    NIBBLE_PREFILL(SUFFIX, T, 64)     \
    NIBBLE_PREFILL(SUFFIX, T, 128)
NIBBLE_BOTH_DTYPES(NIBBLE_PREFILL_ALL)
#endif

// Attention over a quantized KV pool (KV8, KV4, KV FP8 and K/V mixes such as k8v4 or k16v4).
// This module is compiled once per pool format, on the pool's creation (src/context.rs
// `kv_kernels`): NIBBLE_KVQ_T is the model dtype, NIBBLE_KVQ_K and NIBBLE_KVQ_V the keys' and
// values' page kinds (kv_pages.cuh), so a format costs its own dozen kernels and nothing more.
// The kernels are the 16-bit pool's (decode_mma.cu, prefill.cu) instantiated with quantized
// pages: the decode kernel streams raw pages and dequantizes each stage in shared memory before
// its tensor-core tiles read it (BitDecoding Sec. 4's dequantize-then-MMA, with the GQA group as
// the MMA rows); the prefill kernel dequantizes while it gathers a key tile. Appends quantize
// (kv_pages.cuh `append`): fused into the decode kernel, or `kvq_append` for prompt tokens.
//
// kvq_append: grid (tokens, kv heads), 2 warps: warp 0 writes the key, warp 1 the value.
// kvq_fill_random: grid (pages * 16 slots), 2 warps: benchmark fills, random values quantized.

#ifndef NIBBLE_KVQ_T
#define NIBBLE_KVQ_T __nv_bfloat16
#define NIBBLE_KVQ_K PAGE_U8
#define NIBBLE_KVQ_V PAGE_U4
#endif
typedef NIBBLE_KVQ_T KvqT;

#define KVQ_DECODE(HD, G) \
    NIBBLE_DECODE_ENTRY(kvq_decode_hd##HD##_g##G, KvqT, HD, G, NIBBLE_KVQ_K, NIBBLE_KVQ_V)
#define KVQ_HEAD(HD)                                                                  \
    KVQ_DECODE(HD, 1)                                                                 \
    KVQ_DECODE(HD, 2)                                                                 \
    KVQ_DECODE(HD, 4)                                                                 \
    KVQ_DECODE(HD, 8)                                                                 \
    NIBBLE_PREFILL_ENTRY(kvq_prefill_hd##HD, KvqT, HD, NIBBLE_KVQ_K, NIBBLE_KVQ_V)   \
    extern "C" __global__ void __launch_bounds__(64) kvq_append_hd##HD(                     \
        const float* k, const float* v, unsigned char* kc, unsigned char* vc,               \
        const int* block_tables, const int* tok_seq, const int* tok_pos, int max_blocks,    \
        int num_kv_heads, long ldk, long ldv) {                                             \
        kvq_append_impl<HD>(k, v, kc, vc, block_tables, tok_seq, tok_pos, max_blocks,       \
                            num_kv_heads, ldk, ldv);                                        \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(64) kvq_fill_random_hd##HD(                \
        unsigned char* kc, unsigned char* vc, int seed) {                                   \
        kvq_fill_random_impl<HD>(kc, vc, seed);                                             \
    }

template <int HD>
__device__ void kvq_append_impl(const float* __restrict__ k, const float* __restrict__ v,
                                unsigned char* __restrict__ kc, unsigned char* __restrict__ vc,
                                const int* __restrict__ block_tables, const int* __restrict__ tok_seq,
                                const int* __restrict__ tok_pos, int max_blocks, int num_kv_heads,
                                long ldk, long ldv) {
    using KS = PageSide<KvqT, HD, NIBBLE_KVQ_K>;
    using VS = PageSide<KvqT, HD, NIBBLE_KVQ_V>;
    grid_dependency_enter();
    const long t = blockIdx.x;
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const int p = tok_pos[t];
    const long page = (long)block_tables[(long)tok_seq[t] * max_blocks + p / KV_BS] * num_kv_heads + h;
    if (threadIdx.x < 32)
        KS::append(kc + page * KS::PAGE, k + t * ldk + h * HD, p % KV_BS, lane);
    else
        VS::append(vc + page * VS::PAGE, v + t * ldv + h * HD, p % KV_BS, lane);
}

// Slot `blockIdx.x % 16` of page `blockIdx.x / 16` of a layer: uniform values in [-1, 1),
// quantized as an append would.
template <int HD>
__device__ void kvq_fill_random_impl(unsigned char* kc, unsigned char* vc, int seed) {
    using KS = PageSide<KvqT, HD, NIBBLE_KVQ_K>;
    using VS = PageSide<KvqT, HD, NIBBLE_KVQ_V>;
    const long page = blockIdx.x / KV_BS;
    const int slot = blockIdx.x % KV_BS, lane = threadIdx.x & 31, side = threadIdx.x >> 5;
    float x[KS::E];
#pragma unroll
    for (int j = 0; j < KS::E; ++j) x[j] = hash_unit((long)blockIdx.x * HD + lane * KS::E + j, seed + side);
    if (side == 0)
        KS::append_row(kc + page * KS::PAGE, x, slot, lane);
    else
        VS::append_row(vc + page * VS::PAGE, x, slot, lane);
}

KVQ_HEAD(64)
KVQ_HEAD(128)

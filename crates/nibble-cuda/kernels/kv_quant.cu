// Attention over a quantized KV pool (KV8, KV4, KV FP8, the channel-wise KV4C and KV2C, and K/V
// mixes such as k8v4, k16v4 or k8v4c).
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

// A side that waits for its block to fill (docs/design/kv-channel-gpu.md): channel-wise keys,
// and values when NIBBLE_KVQ_VDEFER is 1 (kv4c, kv2c). Such a pool appends into the residual and
// packs full blocks (kvq_append_residual, kvq_pack) instead of kvq_append.
#ifndef NIBBLE_KVQ_VDEFER
#define NIBBLE_KVQ_VDEFER 0
#endif
#define KVQ_KDEFER (NIBBLE_KVQ_K == PAGE_C4 || NIBBLE_KVQ_K == PAGE_C2)
#define KVQ_DEFERRED (KVQ_KDEFER || NIBBLE_KVQ_VDEFER)

// Decode kernels by format:
// - both sides quantized per token in 8 or 4 bits as they are written, and kv4c / kv2c (channel
//   keys and per-token values, both packed when their block fills; kv2c at head_dim 128): the
//   register-direct kernel below (decode_kvq_impl), the channel-wise ones reading the query's
//   own block raw from the residual;
// - a 16-bit side, 2-bit values of another mix, or one side deferred alone (k8v4c, k4cv8):
//   decode_mma.cu's kernel with a dequantizing page policy, a deferred side's own block from the
//   residual.
#if NIBBLE_KVQ_K != PAGE_F16 && NIBBLE_KVQ_V != PAGE_F16 && !KVQ_DEFERRED && NIBBLE_KVQ_V != PAGE_U2
#define KVQ_DECODE(HD, G)                                                                        \
    extern "C" __global__ void __launch_bounds__(64) kvq_decode_hd##HD##_g##G(                    \
        const float* q, unsigned char* kc, unsigned char* vc, const int* block_tables,          \
        const int* tok_seq, const int* tok_pos, float* part, int num_kv_heads, int group,       \
        int max_blocks, int chunk, float scale_log2, long ldq, const float* knew,               \
        const float* vnew, long ldk, long ldv, int window, const float2* rope_cs,             \
        int rope_interleaved) {                                                                 \
        decode_kvq_impl<HD, G, NIBBLE_KVQ_K, NIBBLE_KVQ_V>(                                     \
            q, kc, vc, block_tables, tok_seq, tok_pos, part, num_kv_heads, group, max_blocks,   \
            chunk, scale_log2, ldq, knew, vnew, ldk, ldv, window, nullptr, nullptr, nullptr,    \
            DecodeRope{rope_cs, rope_interleaved});                                             \
    }
#elif KVQ_DEFERRED
// kv2c's two-block step takes 138 registers unbounded (7 CTAs an SM) and 128 without spilling
// when held to 8 CTAs; kv4c's one-block step fits 128 unbounded and spills when held.
#if NIBBLE_KVQ_K == PAGE_C2
#define KVQ_DEFERRED_BOUNDS __launch_bounds__(64, 8)
#else
#define KVQ_DEFERRED_BOUNDS __launch_bounds__(64)
#endif
// A deferred side: kvq_decode_deferred picks the kernel (kv4c and kv2c register-direct, other
// mixes the generic decode), the query's own block read from the residual. The step's rows were
// appended before (kvq_append_residual, kvq_pack): knew and vnew are null.
#define KVQ_DECODE(HD, G)                                                                        \
    extern "C" __global__ void KVQ_DEFERRED_BOUNDS kvq_decode_hd##HD##_g##G(                      \
        const float* q, unsigned char* kc, unsigned char* vc, const int* block_tables,          \
        const int* tok_seq, const int* tok_pos, float* part, int num_kv_heads, int group,       \
        int max_blocks, int chunk, float scale_log2, long ldq, const float* knew,               \
        const float* vnew, long ldk, long ldv, int window, const float* rk, const float* rv,    \
        const int* res_tables) {                                                                \
        kvq_decode_deferred<HD, G>(q, kc, vc, block_tables, tok_seq, tok_pos, part, num_kv_heads, \
                                   group, max_blocks, chunk, scale_log2, ldq, knew, vnew, ldk,  \
                                   ldv, window, rk, rv, res_tables);                            \
    }
#else
#define KVQ_DECODE(HD, G) \
    NIBBLE_DECODE_ENTRY(kvq_decode_hd##HD##_g##G, KvqT, HD, G, NIBBLE_KVQ_K, NIBBLE_KVQ_V)
#endif
#if KVQ_DEFERRED
#define KVQ_PREFILL(HD)                                                                      \
    NIBBLE_PREFILL_DEFERRED_ENTRY(kvq_prefill_hd##HD, KvqT, HD, NIBBLE_KVQ_K, NIBBLE_KVQ_V,  \
                                  KVQ_KDEFER, NIBBLE_KVQ_VDEFER)
#define KVQ_WRITERS(HD)                                                                      \
    extern "C" __global__ void __launch_bounds__(64) kvq_append_residual_hd##HD(             \
        const float* k, const float* v, unsigned char* kc, unsigned char* vc, float* rk,     \
        float* rv, const int* block_tables, const int* res_tables, const int* tok_seq,       \
        const int* tok_pos, int max_blocks, int num_kv_heads, long ldk, long ldv) {          \
        kvq_append_residual_impl<HD>(k, v, kc, vc, rk, rv, block_tables, res_tables, tok_seq, \
                                     tok_pos, max_blocks, num_kv_heads, ldk, ldv);           \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(64) kvq_pack_hd##HD(                        \
        unsigned char* kc, unsigned char* vc, const float* rk, const float* rv,              \
        const int* block_tables, const int* res_tables, const int* tok_seq,                  \
        const int* tok_pos, int max_blocks, int num_kv_heads) {                              \
        kvq_pack_impl<HD>(kc, vc, rk, rv, block_tables, res_tables, tok_seq, tok_pos,        \
                          max_blocks, num_kv_heads);                                         \
    }
#else
#define KVQ_PREFILL(HD) NIBBLE_PREFILL_ENTRY(kvq_prefill_hd##HD, KvqT, HD, NIBBLE_KVQ_K, NIBBLE_KVQ_V)
#define KVQ_WRITERS(HD)                                                                      \
    extern "C" __global__ void __launch_bounds__(64) kvq_append_hd##HD(                     \
        const float* k, const float* v, unsigned char* kc, unsigned char* vc,               \
        const int* block_tables, const int* tok_seq, const int* tok_pos, int max_blocks,    \
        int num_kv_heads, long ldk, long ldv) {                                             \
        kvq_append_impl<HD>(k, v, kc, vc, block_tables, tok_seq, tok_pos, max_blocks,       \
                            num_kv_heads, ldk, ldv);                                        \
    }
#endif
#define KVQ_HEAD(HD)                                                                  \
    KVQ_DECODE(HD, 1)                                                                 \
    KVQ_DECODE(HD, 2)                                                                 \
    KVQ_DECODE(HD, 4)                                                                 \
    KVQ_DECODE(HD, 8)                                                                 \
    KVQ_PREFILL(HD)                                                                   \
    KVQ_WRITERS(HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(64) kvq_fill_random_hd##HD(          \
        unsigned char* kc, unsigned char* vc, int seed) {                             \
        kvq_fill_random_impl<HD>(kc, vc, seed);                                       \
    }


// ---------------------------------------------------------------------------------------------
// Decode over two quantized sides, codes straight from the staged pages into f16 MMA fragments
// (BitDecoding Sec. 4.2-4.3: no dequantized tile). Grid, block, split-K partials, fused append
// and the cp.async page stream are decode_mma.cu's (2, 3 or 6 stages deep here, by page size;
// pages of 4- and 2-bit sides go two blocks a step, decode_kvq_impl's NB).
//
// Tokens are the MMA rows (BitDecoding's query transformation, turned around): S^T = K Q^T is a
// 16-token x 8-head tile, O^T += V^T P^T a 16-dim x 8-head tile, so a GQA group of up to 8 heads
// costs HD/16 MMAs for each of S and O per 16-token block, half what 16 padded query rows
// would. P^T's B fragments are the S^T accumulators transposed in registers (movmatrix).
//
// Layout induction without touching the pages: a dot product is order-free, so each lane's K
// fragments take the head dims whose codes sit together in a row (lane t: dims
// [t * HD/4, (t + 1) * HD/4), a 16- or 32-byte run) and Q is staged with the same permutation of
// its dims; for V^T, lane g's rows are dims [g * HD/8, (g + 1) * HD/8) (one vector load per
// token), and the output rows are un-permuted when the warps merge.
// Codes become f16 with one PRMT or LOP3 per pair: 0x6400 | M q is the f16 1024 + M q, exact,
// with M = 1 for 8-bit codes, 16 for 4-bit and 64 for 2-bit ones (KeyFrags::MULT: the codes are
// moved up within the mantissa by multiplies, on the FMA pipe, instead of down by shifts, on the
// ALU, which bounded this kernel: 65% busy for kv2c on an H200). The scales and zeros never touch
// the codes: S = (s / M) (Q.(1024 + M c) - 1024 sum(Q)) + z sum(Q) per token for KV8/KV4 keys,
// s (Q.e4m3) for FP8 keys; for values P' = P s per token multiplies the codes, sum(P z - 1024 P' / M)
// per row is carried beside O (rescaled with it), and O / M + that is the output.
// Channel-wise keys (BitDecoding Sec. 4.3's channel scales folded into the query): per block,
// Q' = Q s per channel in each lane's B fragments, and S = (Q'.(1024 + M c) - 1024 sum(Q')) / M
// + Q.z as three MMAs a k-tile, the second and third with A rows of -1024 and of the channel
// zeros (the first two in one accumulator, the third in another), so no lane reduces anything. 2-bit codes pair dims (n, n + 8) of a 16-code word, as 4-bit ones pair
// (n, n + 4) of an 8-code word (KeyFrags::pos / dim).
// Q and P are f16 operands here whichever the model dtype (Q is clamped to the f16 range).

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ u32 lop_or_mask(u32 x, u32 mask, u32 bits) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "r"(mask), "r"(bits));  // (x & mask) | bits
    return d;
}
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 x) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(x & 0xffffu), __NV_E4M3);
    return (u32)h.x | ((u32)h.y << 16);
}

// N 32-bit words from 4-byte-aligned shared memory, in the widest loads the count allows.
template <int N>
__device__ __forceinline__ void load_words(const unsigned char* p, u32 (&w)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(p + 4 * i);
            w[i] = v.x, w[i + 1] = v.y, w[i + 2] = v.z, w[i + 3] = v.w;
        }
    } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const uint2 v = *reinterpret_cast<const uint2*>(p + 4 * i);
            w[i] = v.x, w[i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
    }
}

// Keys: lane t's codes of one row are KW words; k-tile kk's B fragment (dims at positions 2t,
// 2t+1 | 2t+8, 2t+9) comes from them. pos(d): where natural dim d of Q goes in the staged row.
template <int HD, int KIND>
struct KeyFrags {
    static constexpr int BITS = PageCodec<KIND>::BITS;
    static constexpr int KW = HD / 4 * BITS / 32;  // words per lane per row
    // What the fragments' codes are multiplied by: 4- and 2-bit codes land in the top bits of
    // their f16 mantissa's low byte (1024 + 16 c, 1024 + 64 c), moved there by multiplies (the
    // FMA pipe) rather than right shifts (the ALU, this kernel's busiest pipe); a word's upper
    // byte pairs take one shift.
    static constexpr int MULT = BITS == 4 ? 16 : BITS == 2 ? 64 : 1;
    // Per-token 4-bit keys take each byte's low nibble where it lies (1024 + c, no multiply) and
    // its high one as 1024 + 16 c; the query's columns facing high nibbles are staged as Q / 16
    // (the b1 fragments, qf[kk][2]), so the score needs no division by MULT (SCORE_DIV).
    static constexpr bool SPLIT = KIND == PAGE_U4;
    static constexpr int SCORE_DIV = SPLIT ? 1 : MULT;
    __device__ static __forceinline__ void frag(const u32 (&w)[KW], int kk, u32& b0, u32& b1) {
        if constexpr (KIND == PAGE_U8) {
            b0 = prmt(w[kk], 0x64646464u, 0x4140);  // [c0, 0x64, c1, 0x64]
            b1 = prmt(w[kk], 0x64646464u, 0x4342);
        } else if constexpr (KIND == PAGE_FP8) {
            b0 = e4m3x2_f16x2(w[kk]);
            b1 = e4m3x2_f16x2(w[kk] >> 16);
        } else if constexpr (BITS == 2) {  // PAGE_C2: word kk / 4 holds 16 codes; pairs (n, n + 8)
            // k-tile kk's codes sit at bits 4 (kk & 3) + {0, 1} (b0) and + {2, 3} (b1), and 16 up.
            const u32 x = (kk & 2) ? w[kk >> 2] >> 8 : w[kk >> 2];
            b0 = lop_or_mask(x * ((kk & 1) ? 4u : 64u), 0x00C000C0u, 0x64006400u);
            b1 = lop_or_mask((kk & 1) ? x : x * 16u, 0x00C000C0u, 0x64006400u);
        } else {  // PAGE_U4, PAGE_C4: word kk / 2 holds nibbles n0..n7; pairs (n0, n4), (n1, n5), ...
            const u32 x = (kk & 1) ? w[kk >> 1] >> 8 : w[kk >> 1];
            b0 = SPLIT ? lop_or_mask(x, 0x000F000Fu, 0x64006400u) : lop_or_mask(x * 16u, 0x00F000F0u, 0x64006400u);
            b1 = lop_or_mask(x, 0x00F000F0u, 0x64006400u);
        }
    }
    // The staged column of natural dim d (the inverse of frag's choice of dims).
    __device__ static __forceinline__ int pos(int d) {
        const int t = d / (HD / 4), r = d % (HD / 4);
        int kk, e;
        if constexpr (BITS == 4) {  // PAGE_U4, and PAGE_C4's code runs (the same nibble order)
            const int n = r % 8;
            kk = 2 * (r / 8) + ((n & 3) >> 1);
            e = ((n & 1) << 1) | (n >> 2);
        } else if constexpr (BITS == 2) {
            const int n = r % 16;
            kk = 4 * (r / 16) + ((n & 7) >> 1);
            e = ((n & 1) << 1) | (n >> 3);
        } else {
            kk = r / 4;
            e = r % 4;
        }
        return kk * 16 + 2 * t + (e & 1) + 8 * (e >> 1);
    }
    // The dim of lane t's run (0 .. HD/4) that k-tile kk's fragment element e takes (0, 1: b0's
    // halves; 2, 3: b1's): pos's inverse, for 4- and 2-bit codes.
    __device__ static __forceinline__ constexpr int dim(int kk, int e) {
        static_assert(BITS == 4 || BITS == 2, "dim() serves the channel-wise kinds");
        return BITS == 4 ? 8 * (kk >> 1) + 2 * (kk & 1) + (e >> 1) + 4 * (e & 1)
                         : 16 * (kk >> 2) + 2 * (kk & 3) + (e >> 1) + 8 * (e & 1);
    }
};

// Values: lane g's codes of one row (dims [g * HD/8, (g + 1) * HD/8)) are VW words; n-tile n's
// B fragment pairs tokens (a, b) and (c, d) of the lane's four rows.
template <int HD, int KIND>
struct ValueFrags {
    static constexpr int BITS = PageCodec<KIND>::BITS;
    static constexpr int VW = HD / 8 * BITS / 32 > 0 ? HD / 8 * BITS / 32 : 1;
    // As KeyFrags::MULT: 4- and 2-bit codes become 1024 + 16 c and 1024 + 64 c; but 4-bit ones
    // keep a byte's low nibble where it lies (1024 + c). Even n are low nibbles, and the rows of
    // output m-tile i are dims 2i (row g) and 2i + 1 (row g + 8): O's rows g carry M_LO times
    // the codes, rows g + 8 M_HI times.
    static constexpr int MULT = BITS == 4 ? 16 : BITS == 2 ? 64 : 1;
    static constexpr int M_LO = BITS == 4 ? 1 : MULT, M_HI = MULT;
    __device__ static __forceinline__ u32 pair(const u32 (&a)[VW], const u32 (&b)[VW], int n) {
        static_assert(KIND != PAGE_U2 || HD == 128, "2-bit values: a lane's 16 dims are one word");
        if constexpr (KIND == PAGE_U2) {
            // Dim n is bits 2n of the word: its byte from each row, its codes moved up to bits 6, 7.
            const int j = n >> 2;
            const u32 x = prmt(a[0], b[0], j | j << 4 | (4 + j) << 8 | (4 + j) << 12);
            return lop_or_mask(x * (64u >> (2 * (n & 3))), 0x00C000C0u, 0x64006400u);
        } else if constexpr (KIND == PAGE_U4) {
            const int byte = n >> 1, j = byte & 3;
            const u32 x = prmt(a[byte >> 2], b[byte >> 2], j | j << 4 | (4 + j) << 8 | (4 + j) << 12);
            return (n & 1) ? lop_or_mask(x, 0x00F000F0u, 0x64006400u) : lop_or_mask(x, 0x000F000Fu, 0x64006400u);
        } else {
            const int j = n & 3;
            if constexpr (KIND == PAGE_FP8) {
                return e4m3x2_f16x2(prmt(a[n >> 2], b[n >> 2], j | (4 + j) << 4));
            } else {
                return lop_or_mask(prmt(a[n >> 2], b[n >> 2], j | j << 4 | (4 + j) << 8 | (4 + j) << 12),
                                   0x00FF00FFu, 0x64006400u);
            }
        }
    }
};

// CHUNKS 16-byte chunks from global `src` to shared `dst`, this lane's share: chunk lane + 32 j
// at byte 512 j of both (the caller adds 16 lane to each).
template <int CHUNKS>
__device__ __forceinline__ void copy_chunks(u32 dst, const unsigned char* src, int lane) {
#pragma unroll
    for (int j = 0; j < (CHUNKS + 31) / 32; ++j)
        if (j < CHUNKS / 32 || lane + 32 * j < CHUNKS)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 512 * j), "l"(src + 512 * j));
}

template <bool B> struct BoolTag { static constexpr bool value = B; };

// (s, z) of slot `slot` of a staged page's parameters (z = 0 for fp8).
template <int KIND>
__device__ __forceinline__ float2 slot_param(const unsigned char* params, int slot) {
    if constexpr (KIND == PAGE_FP8) {
        return make_float2(__half2float(*reinterpret_cast<const __half*>(params + 2 * slot)), 0.f);
    } else {
        return __half22float2(*reinterpret_cast<const __half2*>(params + 4 * slot));
    }
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

// A value over the 8 lanes that share this lane's t (lanes t, t + 4, ..., t + 28).
__device__ __forceinline__ float column_max(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 hmul2_u32(u32 a, u32 b) {
    const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const u32*>(&r);
}
__device__ __forceinline__ u32 half2_bits(float lo, float hi) { return pack2(lo, hi, (__half*)nullptr); }

// How far (log2 units) a score may pass the reference max before kvq_softmax rescales: P <= 4
// keeps P s inside f16's range (a 4-bit code's scale is at most 2 * 65504 / 15).
#define RESCALE_SLACK 2.f

// decode_kvq_impl's online softmax over NB 16-token blocks. s[j]: block j's scores in log2 units
// (tokens g, g + 8 by heads 2t, 2t + 1), masked to NEG_BIG where !valid. P' = P s_v per token
// (`vp`: the value rows' (scale, zero)), rounded to f16 as the operand holds it, becomes the
// B fragments pt of O^T += V^T P'^T; ZERO (biased value codes 1024 + M c with zero points): the
// rows' sums P z (pz) and P' (ps), from which the end takes the zero points' term and the bias
// (decode_kvq_impl's merge: O / M + pz - (1024 / M) ps, M by row, ValueFrags::M_LO / M_HI).
// The reference max m moves only when a score passes it by more than RESCALE_SLACK (the whole
// warp moves together), so most blocks skip the rescale of O, l, pz and ps (FlashAttention-4's
// conditional rescaling); P then stays at most 2^RESCALE_SLACK. l, pz and ps stay per lane (this
// lane's tokens of the column): the caller sums them over the column once, after its last block
// (kvq_column_sums). SUMS (ZERO's default): pz and ps are rescaled (the own block's step adds
// nothing to them but keeps them in scale).
template <int HD, int NB, bool ZERO, bool SUMS = ZERO>
__device__ __forceinline__ void kvq_softmax(float (&s)[NB][4], const bool (&valid)[NB][2],
                                            const float2 (&vp)[NB][2], float (&m)[2], float (&l)[2],
                                            float (&pz)[2], float (&ps)[2], float (&o)[HD / 16][4],
                                            u32 (&pt)[NB][2]) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e & 1] = fmaxf(mx[e & 1], s[j][e]);
    bool grow = false;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        mx[c] = column_max(mx[c]);
        grow |= mx[c] > m[c] + RESCALE_SLACK;
    }
    if (__any_sync(0xffffffffu, grow)) {
        float corr[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            corr[c] = fast_exp2(m[c] - mx[c]);
            m[c] = mx[c];
            l[c] *= corr[c];
            if (ZERO || SUMS) pz[c] *= corr[c], ps[c] *= corr[c];
        }
#pragma unroll
        for (int i = 0; i < HD / 16; ++i) {
            o[i][0] *= corr[0], o[i][1] *= corr[1];
            o[i][2] *= corr[0], o[i][3] *= corr[1];
        }
    }
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float pr[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float x = s[j][r * 2 + c];
                const float p = x > -1e29f ? fast_exp2(x - m[c]) : 0.f;
                l[c] += p;
                pr[c] = valid[j][r] ? __half2float(__float2half_rn(p * vp[j][r].x)) : 0.f;
                if (ZERO && valid[j][r]) pz[c] = fmaf(p, vp[j][r].y, pz[c]), ps[c] += pr[c];
            }
            pt[j][r] = transpose8x8(pack2(pr[0], pr[1], (__half*)nullptr));
        }
}

// kvq_softmax's per-lane l, pz and ps summed over each column's 8 lanes, after the last block.
__device__ __forceinline__ void kvq_column_sums(float (&l)[2], float (&pz)[2], float (&ps)[2]) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        l[c] = column_sum(l[c]);
        pz[c] = column_sum(pz[c]);
        ps[c] = column_sum(ps[c]);
    }
}

// decode_kvq_impl's step over the query's own block of a deferred pool, read raw from the
// residual (rows `at` .. of rk / rv, f32, [16][HD]), in the loop's layouts: K's A fragments in
// the staged dim order of 4-bit codes (KeyFrags::pos), V^T's from lane g's dims, P times M_HI
// and rows g (dims 2i) times M_LO / M_HI (the output rows are divided by M_LO and M_HI), no zero
// term. Rows at or past `end` are zeros (a residual row past the context may hold anything). One
// warp.
template <int HD, class KF, int M_LO, int M_HI>
__device__ __forceinline__ void own_block_tile(const u32 (&qf)[HD / 16][4], float (&o)[HD / 16][4], float (&m)[2],
                                               float (&l)[2], float (&pz)[2], float (&ps)[2], const float* __restrict__ rk,
                                               const float* __restrict__ rv, long at, int p0, int end, int lo,
                                               float scale_log2, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int rows = end - p0;
    float s[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    {
        // Rows g and g + 8, lane t's run of dims in the staged order of the codes (KF::dim).
        const float* k0 = rk + at + (long)g * HD + t * (HD / 4);
        const float* k1 = rk + at + (long)(g + 8) * HD + t * (HD / 4);
        const bool r0 = g < rows, r1 = g + 8 < rows;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            float x0[4], x1[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                x0[e] = r0 ? k0[KF::dim(kk, e)] : 0.f;
                x1[e] = r1 ? k1[KF::dim(kk, e)] : 0.f;
            }
            const u32 a[4] = {half2_bits(x0[0], x0[1]), half2_bits(x1[0], x1[1]), half2_bits(x0[2], x0[3]),
                              half2_bits(x1[2], x1[3])};
            mma16816<__half>(s[0], a, qf[kk][0], qf[kk][2]);
        }
    }
    bool valid[1][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int p = p0 + g + 8 * r;
        valid[0][r] = p < end && p >= lo;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] = valid[0][e >> 1] ? s[0][e] * scale_log2 : NEG_BIG;
    // Raw values: P times M_HI and rows g times M_LO / M_HI (ValueFrags), no bias to cancel
    // (the packed blocks' pz and ps still rescale).
    const float2 raw[1][2] = {{make_float2(M_HI, 0.f), make_float2(M_HI, 0.f)}};
    u32 pt[1][2];
    kvq_softmax<HD, 1, false, true>(s, valid, raw, m, l, pz, ps, o, pt);
    // O^T += V^T P^T: tile i's rows g, g + 8 are dims g * HD/8 + 2i, + 2i + 1; k the tokens 2t,
    // 2t + 1 | 2t + 8, 2t + 9.
    const int tok[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
    const float* vr[4];
    bool vin[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        vr[k] = rv + at + (long)tok[k] * HD + g * (HD / 8);
        vin[k] = tok[k] < rows;
    }
#pragma unroll
    for (int i = 0; i < HD / 16; ++i) {
        float2 f[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            f[k] = vin[k] ? *reinterpret_cast<const float2*>(vr[k] + 2 * i) : make_float2(0.f, 0.f);
        constexpr float LO = (float)M_LO / M_HI;  // a power of two: exact but for f16 subnormals
        const u32 a[4] = {half2_bits(f[0].x * LO, f[1].x * LO), half2_bits(f[0].y, f[1].y),
                          half2_bits(f[2].x * LO, f[3].x * LO), half2_bits(f[2].y, f[3].y)};
        mma16816<__half>(o[i], a, pt[0][0], pt[0][1]);
    }
}

// DEF: both sides wait in the residual until their block fills (kv4c: channel-wise keys, values
// per token packed with them). The query's own block is then read raw from the residual rows
// `rk` / `rv` (f32), as the CPU reads it, after the loop over the packed blocks (own_block_tile).
template <int HD, int G, int KK, int VK, bool DEF = false>
__device__ void decode_kvq_impl(const float* __restrict__ q, unsigned char* __restrict__ kc,
                                unsigned char* __restrict__ vc, const int* __restrict__ block_tables,
                                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                float* __restrict__ part, int num_kv_heads, int group, int max_blocks,
                                int chunk, float scale_log2, long ldq, const float* __restrict__ knew,
                                const float* __restrict__ vnew, long ldk, long ldv, int window,
                                const float* __restrict__ rk = nullptr, const float* __restrict__ rv = nullptr,
                                const int* __restrict__ res_tables = nullptr, DecodeRope rope = {}) {
    using KS = PageSide<__half, HD, KK>;
    using VS = PageSide<__half, HD, VK>;
    using KF = KeyFrags<HD, KK>;
    using VF = ValueFrags<HD, VK>;
    constexpr int LD = HD + 8;
    constexpr int WARPS = DM_WARPS;
    // Stages per warp: enough bytes in flight for HBM's latency with pages as small as KV4's.
    // Small pages (4- and 2-bit sides) go NB = 2 blocks a step: one softmax step (its shuffles,
    // vote and rescale) and one stage wait for 32 tokens, and two independent score chains.
    // Their six stages hold three steps; the last step's two also hold the staged Q until the
    // loop's first refill (16 rows of HD + 8 halves: exactly two kv4 stages at head_dim 128).
    constexpr int PAIR = KS::PAGE + VS::PAGE;
    constexpr int NB = PAIR <= 2304 && KK != PAGE_FP8 && VK != PAGE_FP8 ? 2 : 1;
    constexpr int STAGES = NB == 2 ? 6 : PAIR <= 3328 ? 3 : 2;
    constexpr int STAGES_BYTES = WARPS * STAGES * PAIR;
    constexpr bool Q_IN_STAGES = NB == 2 && DM_BS * LD * 2 <= NB * PAIR;
    constexpr int Q_BYTES = Q_IN_STAGES ? 0 : WARPS * DM_BS * LD * 2;
    constexpr int MERGE_BYTES = WARPS * G * (HD + 2) * 4;
    constexpr int SMEM = STAGES_BYTES + Q_BYTES > MERGE_BYTES ? STAGES_BYTES + Q_BYTES : MERGE_BYTES;
    // Channel-wise keys (kv4c): per block and channel (s, z) in the page's tail. S = (Q'.(1024 +
    // M c) - 1024 sum(Q')) / M + Q.z with Q' = Q s per channel (BitDecoding's channel scales
    // folded into the query): three MMAs a k-tile, the last two with constant and z rows as A, so
    // no lane sums anything.
    constexpr bool KCH = KS::CHANNEL;
    static_assert(!KCH || DEF, "register-direct channel keys: deferred with the values");
    static_assert(!DEF || VK == PAGE_U4 || VK == PAGE_U2, "deferred values: 4- or 2-bit per token");
    // A step's second block may lie past the split, its stage not loaded: it is masked, and its
    // stale or uninitialized integer codes decode to finite values that P = 0 cancels. FP8 codes
    // could decode to NaN (0 * NaN), so FP8 sides keep one block a step.
    static_assert(NB == 1 || (VK != PAGE_FP8 && KK != PAGE_FP8), "two blocks a step: integer codes only");
    constexpr bool K_ZERO = KK != PAGE_FP8 && !KCH, V_ZERO = VK != PAGE_FP8;
    grid_dependency_enter();
    __shared__ __align__(16) unsigned char smem[SMEM];
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    unsigned char* mine = smem + warp * STAGES * PAIR;  // stage i: K page, then V page
    __half* kq = reinterpret_cast<__half*>(Q_IN_STAGES ? mine + (STAGES - NB) * PAIR
                                                       : smem + STAGES_BYTES + warp * DM_BS * LD * 2);
    DecodeSplit ds;
    if (!decode_split<HD, KS, VS>(ds, tok_pos, block_tables, tok_seq, max_blocks, chunk, window, kc, vc,
                                  num_kv_heads, knew, vnew, ldk, ldv, rope))
        return;
    const int start = ds.start, end = ds.end, lo = ds.lo;
    const int* table = ds.table;
    // A deferred pool's own block (the query's last, pages not written yet) is not streamed: the
    // loop ends before it, and the warp whose turn it would be reads it from the residual. Splits
    // start on block boundaries (the host's chunks are multiples of 64 positions,
    // attention::plan_split), so the own block lies whole in the split that ends at the context.
    const int ctx = tok_pos[token] + 1;
    const bool own = DEF && end == ctx;
    const int own_b = (ctx - 1) / DM_BS;
    const int loop_end = own ? own_b * DM_BS : end;
    // Block b's pages into stage st, or an empty group past the chunk: one group per call.
    // Channel keys' parameters: lane t reads the 16-byte chunks [CPT t, CPT (t + 1)) of the
    // page's tail, 128 t bytes apart at head_dim 128, so the four t of a quarter-warp would meet
    // in one bank group (a 4-way conflict on every parameter load). Chunk m of lane t's run is
    // staged at CPT t + (m ^ t) instead: the four land in four bank groups.
    constexpr int CPT = HD / 16;  // parameter chunks per lane's run of HD / 4 channels
    auto param_chunk = [&](int tt, int mm) { return DM_BS * KS::CB + 16 * (CPT * tt + (mm ^ tt)); };
    // A per-token page is copied whole, this lane taking its 16-byte chunks lane, lane + 32, ...
    // from bases fixed for the loop: only the block table's entry changes from block to block.
    const unsigned char* kfirst = kc + (long)kvh * KS::PAGE + 16 * lane;
    const unsigned char* vfirst = vc + (long)kvh * VS::PAGE + 16 * lane;
    const long kstride = (long)num_kv_heads * KS::PAGE, vstride = (long)num_kv_heads * VS::PAGE;
    const u32 stage_first = smem_addr(mine) + 16 * lane;
    auto issue = [&](int b, int st) {
        if (b * DM_BS < loop_end) {
            const long entry = table[b];
            if constexpr (KCH) {
                unsigned char* dst = mine + st * PAIR;
                const unsigned char* src = kc + (entry * num_kv_heads + kvh) * KS::PAGE;
                constexpr int CODE_CHUNKS = DM_BS * KS::CB / 16;
#pragma unroll
                for (int i = lane; i < KS::PAGE / 16; i += 32) {
                    const int c = i - CODE_CHUNKS;
                    const int at = c < 0 ? 16 * i : param_chunk(c / CPT, c % CPT);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst + at)),
                                 "l"(src + 16 * i));
                }
            } else {
                copy_chunks<KS::PAGE / 16>(stage_first + st * PAIR, kfirst + entry * kstride, lane);
            }
            copy_chunks<VS::PAGE / 16>(stage_first + st * PAIR + KS::PAGE, vfirst + entry * vstride, lane);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    const int first = max(start, lo) / DM_BS + warp;
#pragma unroll
    for (int i = 0; i < STAGES - NB; ++i) issue(first + i * WARPS, i);

    // Q^T's B fragments (head g; dims permuted as the key fragments take them): qf[kk][0] and
    // qf[kk][2]. This lane's two heads are 2t and 2t + 1; their sums of the staged Q.
    u32 qf[HD / 16][4];
    stage_q<__half, HD, G>(q + (long)token * ldq + (long)kvh * group * HD, group, kq, lane, qf,
                           [](int d) { return KF::pos(d); }, rope, token);
    // Split 4-bit keys (KeyFrags::SPLIT): the columns facing high nibbles hold Q / 16, exact but
    // for queries under 2^-10 (f16 subnormals, 2^-25 apart).
    if constexpr (KF::SPLIT) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) qf[kk][2] = hmul2_u32(qf[kk][2], 0x2C002C00u);
    }
    // sum(Q) for the zeros' term, and the sum of the fragments' Q (qbias) for the bias' term.
    float qsum[2] = {0.f, 0.f}, qbias[2] = {0.f, 0.f};
    if (K_ZERO) {
        float mine_sum = 0.f, mine_bias = 0.f;  // head g's row, a quarter per lane of the quad
        const __half* row = kq + g * LD + t * (HD / 4);
#pragma unroll
        for (int i = 0; i < HD / 4; ++i) {
            mine_sum += __half2float(row[i]);
            const bool high = KF::SPLIT && (t * (HD / 4) + i) % 16 >= 8;
            mine_bias += __half2float(high ? __hmul(row[i], __float2half(0.0625f)) : row[i]);
        }
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            mine_sum += __shfl_xor_sync(0xffffffffu, mine_sum, o);
            mine_bias += __shfl_xor_sync(0xffffffffu, mine_bias, o);
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            qsum[c] = __shfl_sync(0xffffffffu, mine_sum, (2 * t + c) * 4);
            qbias[c] = KF::SPLIT ? __shfl_sync(0xffffffffu, mine_bias, (2 * t + c) * 4) : qsum[c];
        }
    }
    // O^T: m-tile m's rows g and g + 8 are dims g * HD/8 + 2m and + 2m + 1; columns heads 2t, 2t+1.
    float o[HD / 16][4];
#pragma unroll
    for (int i = 0; i < HD / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f}, pz[2] = {0.f, 0.f}, ps[2] = {0.f, 0.f};
    __syncwarp();

    // Block b's scores in log2 units, its pages staged at kp (masked where !valid), and its
    // value parameters.
    auto scores = [&](auto all, int b, const unsigned char* kp, float (&s)[4], bool (&valid)[2], float2 (&vp_)[2]) {
        // S^T = K Q^T: rows are the block's tokens g and g + 8; two accumulators halve the chain.
        float s2[4] = {0.f, 0.f, 0.f, 0.f};
        {
            u32 w0[KF::KW], w1[KF::KW];
            load_words(kp + g * KS::CB + t * (KS::CB / 4), w0);
            load_words(kp + (g + 8) * KS::CB + t * (KS::CB / 4), w1);
            s[0] = s[1] = s[2] = s[3] = 0.f;
            if constexpr (KCH) {
                // Lane t's dims [t * HD/4, (t + 1) * HD/4), GROUP at a time (the dims of
                // GROUP / 4 k-tiles: KeyFrags::dim), their (s, z) pairs 16-byte words of the
                // page's tail.
                constexpr int GROUP = KF::BITS == 4 ? 8 : 16;
#pragma unroll
                for (int gi = 0; gi < HD / 4 / GROUP; ++gi) {
                    // GROUP pairs are GROUP / 4 chunks of the run, staged swizzled (param_chunk).
                    u32 pw[GROUP];
#pragma unroll
                    for (int ch = 0; ch < GROUP / 4; ++ch) {
                        const uint4 v = *reinterpret_cast<const uint4*>(kp + param_chunk(t, gi * (GROUP / 4) + ch));
                        pw[4 * ch] = v.x, pw[4 * ch + 1] = v.y, pw[4 * ch + 2] = v.z, pw[4 * ch + 3] = v.w;
                    }
#pragma unroll
                    for (int h = 0; h < GROUP / 4; ++h) {
                        const int kk = gi * (GROUP / 4) + h;
                        const int d0 = KF::dim(kk, 0) - GROUP * gi, d1 = KF::dim(kk, 1) - GROUP * gi;
                        const int d2 = KF::dim(kk, 2) - GROUP * gi, d3 = KF::dim(kk, 3) - GROUP * gi;
                        const u32 s01 = prmt(pw[d0], pw[d1], 0x5410), s23 = prmt(pw[d2], pw[d3], 0x5410);
                        const u32 z01 = prmt(pw[d0], pw[d1], 0x7632), z23 = prmt(pw[d2], pw[d3], 0x7632);
                        // Q' in f16: |Q s| past 65504 (|Q| times a channel's range past ~1e6
                        // for 4-bit keys) would give an infinite Q' and a NaN score, dropped by
                        // the softmax; keys and queries that large are far outside any model's.
                        const u32 q0 = hmul2_u32(qf[kk][0], s01), q1 = hmul2_u32(qf[kk][2], s23);
                        u32 a[4];
                        KF::frag(w0, kk, a[0], a[2]);
                        KF::frag(w1, kk, a[1], a[3]);
                        mma16816<__half>(s, a, q0, q1);
                        // The bias -1024 sum(Q') split between the two chains: -1024 in the
                        // codes' accumulator on odd k-tiles, -1024 / M (-64 or -16, exact) in the
                        // zeros' one (not divided by M at the end) on even ones, 12 MMAs a chain
                        // at head_dim 128 instead of 16 and 8 (kv4c 1.02x to 1.03x on an H200).
                        if (kk & 1) {
                            const u32 bias[4] = {0xE400E400u, 0xE400E400u, 0xE400E400u, 0xE400E400u};
                            mma16816<__half>(s, bias, q0, q1);
                        } else {
                            constexpr u32 B = KF::MULT == 16 ? 0xD400D400u : 0xCC00CC00u;
                            const u32 bias[4] = {B, B, B, B};
                            mma16816<__half>(s2, bias, q0, q1);
                        }
                        const u32 zr[4] = {z01, z01, z23, z23};
                        mma16816<__half>(s2, zr, qf[kk][0], qf[kk][2]);
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < HD / 16; ++kk) {
                    u32 a[4];
                    KF::frag(w0, kk, a[0], a[2]);
                    KF::frag(w1, kk, a[1], a[3]);
                    mma16816<__half>((kk & 1) ? s2 : s, a, qf[kk][0], qf[kk][2]);
                }
            }
        }
        // s[r * 2 + c]: token g + 8r, head 2t + c. A step's blocks past loop_end are masked (the
        // own block of a deferred pool is read from the residual after the loop).
        float2 kp_[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            kp_[r] = KCH ? make_float2(1.f, 0.f) : slot_param<KK>(kp + DM_BS * KS::CB, g + 8 * r);
            vp_[r] = slot_param<VK>(kp + KS::PAGE + DM_BS * VS::CB, g + 8 * r);
            const int p = b * DM_BS + g + 8 * r;
            valid[r] = decltype(all)::value || (p < loop_end && p >= lo);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1, c = e & 1;
            // Channel keys: s / M + s2 is Q'.c + Q.z (the bias split between s at -1024 and s2
            // at -1024 / M).
            float x = KCH ? fmaf(s[e], 1.f / KF::MULT, s2[e]) : s[e] + s2[e];
            x = K_ZERO ? kp_[r].x * (1.f / KF::SCORE_DIV) * (x - 1024.f * qbias[c]) + kp_[r].y * qsum[c]
                       : KCH ? x : kp_[r].x * x;
            s[e] = valid[r] ? x * scale_log2 : NEG_BIG;
        }
    };
    // O^T += V^T P^T for the block whose value page is staged at vp: A from the value rows of
    // tokens 2t, 2t+1 (k 0-7) and 2t+8, 2t+9.
    auto values = [&](const unsigned char* vp, const u32 (&pt)[2]) {
        u32 va[VF::VW], vb[VF::VW], vcw[VF::VW], vd[VF::VW];
        const int voff = g * (VS::CB / 8);
        load_words(vp + (2 * t) * VS::CB + voff, va);
        load_words(vp + (2 * t + 1) * VS::CB + voff, vb);
        load_words(vp + (2 * t + 8) * VS::CB + voff, vcw);
        load_words(vp + (2 * t + 9) * VS::CB + voff, vd);
#pragma unroll
        for (int i = 0; i < HD / 16; ++i) {
            const u32 a[4] = {VF::pair(va, vb, 2 * i), VF::pair(va, vb, 2 * i + 1), VF::pair(vcw, vd, 2 * i),
                              VF::pair(vcw, vd, 2 * i + 1)};
            mma16816<__half>(o[i], a, pt[0], pt[1]);
        }
    };
    int stage = 0;  // the step's first block's stage; its j-th block's is stage + j (mod STAGES)
    auto wrap = [](int x) { return x >= STAGES ? x - STAGES : x; };  // x < 2 STAGES: no division
    auto step = [&](auto all, int b) {
        float s[NB][4];
        bool valid[NB][2];
        float2 vp_[NB][2];
#pragma unroll
        for (int j = 0; j < NB; ++j)
            scores(all, b + j * WARPS, mine + wrap(stage + j) * PAIR, s[j], valid[j], vp_[j]);
        u32 pt[NB][2];
        kvq_softmax<HD, NB, V_ZERO>(s, valid, vp_, m, l, pz, ps, o, pt);
#pragma unroll
        for (int j = 0; j < NB; ++j) values(mine + wrap(stage + j) * PAIR + KS::PAGE, pt[j]);
    };
    for (int b = first; b * DM_BS < loop_end; b += NB * WARPS) {
        // The step STAGES / NB - 1 ahead streams in while this one is computed, into the stages
        // the previous step read (for NB = 2 the first refill also ends the staged Q's life).
#pragma unroll
        for (int j = 0; j < NB; ++j) issue(b + (STAGES - NB + j) * WARPS, wrap(stage + STAGES - NB + j));
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - NB));
        __syncwarp();
        // A step whose blocks lie wholly inside [lo, loop_end) takes a copy of the body with no
        // masks (valid a constant): about 30 fewer instructions for two kv4 blocks, for twice the
        // loop's code. On an H100 (1e84f4c, BENCHMARKS.md issue 19): kv2c 1.02x, the others level.
        if (b * DM_BS >= lo && (b + (NB - 1) * WARPS + 1) * DM_BS <= loop_end)
            step(BoolTag<true>(), b);
        else
            step(BoolTag<false>(), b);
        __syncwarp();  // these stages are read before they are refilled
        stage = wrap(stage + NB);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if constexpr (DEF) {
        if (own && warp == (own_b - max(start, lo) / DM_BS) % WARPS)
            own_block_tile<HD, KF, VF::M_LO, VF::M_HI>(qf, o, m, l, pz, ps, rk, rv,
                               residual_row<HD>(res_tables, tok_seq[token], own_b * DM_BS, max_blocks, kvh,
                                                num_kv_heads),
                               own_b * DM_BS, end, lo, scale_log2, lane);
    }
    kvq_column_sums(l, pz, ps);
    // Stash this warp's heads 2t, 2t+1 (rows of O^T are dims), then merge the warps.
    float* merge = reinterpret_cast<float*>(smem);
    __syncthreads();
#define MERGE(w, hg, d) merge[((w) * G + (hg)) * (HD + 2) + (d)]
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int h = 2 * t + c;
        if (h < group) {
            // The bias of the value codes, 1024 P' a token, out of each row's M times the codes.
            const float zlo = fmaf(-1024.f / VF::M_LO, ps[c], pz[c]), zhi = fmaf(-1024.f / VF::M_HI, ps[c], pz[c]);
#pragma unroll
            for (int i = 0; i < HD / 16; ++i) {
                const int d = g * (HD / 8) + 2 * i;
                MERGE(warp, h, d) = fmaf(o[i][c], 1.f / VF::M_LO, zlo);
                MERGE(warp, h, d + 1) = fmaf(o[i][2 + c], 1.f / VF::M_HI, zhi);
            }
            if (g == 0) {
                MERGE(warp, h, HD) = m[c];
                MERGE(warp, h, HD + 1) = l[c];
            }
        }
    }
#undef MERGE
    combine_partials<HD, G, WARPS>(merge, group,
                                   part + ((long)((long)token * num_kv_heads + kvh) * splits + split) * G * (HD + 2));
}

#if KVQ_DEFERRED
// Both sides deferred, channel-wise keys with per-token values of the same width (kv4c; kv2c at
// head_dim 128, where a lane's 2-bit value dims fill a word): the register-direct kernel;
// anything else the generic one. A template, so that the kind a head size does not take is never
// instantiated.
template <int HD, int G>
__device__ __forceinline__ void kvq_decode_deferred(const float* q, unsigned char* kc, unsigned char* vc,
                                                    const int* block_tables, const int* tok_seq, const int* tok_pos,
                                                    float* part, int num_kv_heads, int group, int max_blocks,
                                                    int chunk, float scale_log2, long ldq, const float* knew,
                                                    const float* vnew, long ldk, long ldv, int window,
                                                    const float* rk, const float* rv, const int* res_tables) {
    constexpr bool DIRECT = NIBBLE_KVQ_VDEFER && ((NIBBLE_KVQ_K == PAGE_C4 && NIBBLE_KVQ_V == PAGE_U4) ||
                                                  (NIBBLE_KVQ_K == PAGE_C2 && NIBBLE_KVQ_V == PAGE_U2 && HD == 128));
    if constexpr (DIRECT) {
        decode_kvq_impl<HD, G, NIBBLE_KVQ_K, NIBBLE_KVQ_V, true>(q, kc, vc, block_tables, tok_seq, tok_pos, part,
                                                                num_kv_heads, group, max_blocks, chunk,
                                                                scale_log2, ldq, knew, vnew, ldk, ldv, window,
                                                                rk, rv, res_tables);
    } else {
        decode_mma_impl<KvqT, HD, G, PageSide<KvqT, HD, NIBBLE_KVQ_K>, PageSide<KvqT, HD, NIBBLE_KVQ_V>, KVQ_KDEFER,
                        NIBBLE_KVQ_VDEFER>(q, kc, vc, block_tables, tok_seq, tok_pos, part, num_kv_heads, group,
                                           max_blocks, chunk, scale_log2, ldq, knew, vnew, ldk, ldv, window, rk,
                                           rv, res_tables);
    }
}
#endif

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

#if KVQ_DEFERRED
// Grid (tokens, kv heads), 2 warps: warp 0 the key, warp 1 the value. A deferred side's raw row
// goes to the residual; a side quantized as written is appended to its page as kvq_append does.
template <int HD>
__device__ void kvq_append_residual_impl(const float* __restrict__ k, const float* __restrict__ v,
                                         unsigned char* __restrict__ kc, unsigned char* __restrict__ vc,
                                         float* __restrict__ rk, float* __restrict__ rv,
                                         const int* __restrict__ block_tables, const int* __restrict__ res_tables,
                                         const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                         int max_blocks, int num_kv_heads, long ldk, long ldv) {
    using KS = PageSide<KvqT, HD, NIBBLE_KVQ_K>;
    using VS = PageSide<KvqT, HD, NIBBLE_KVQ_V>;
    grid_dependency_enter();
    const long t = blockIdx.x;
    const int h = blockIdx.y, lane = threadIdx.x & 31, side = threadIdx.x >> 5;
    const int p = tok_pos[t], seq = tok_seq[t];
    const long page = (long)block_tables[(long)seq * max_blocks + p / KV_BS] * num_kv_heads + h;
    const float* x = side == 0 ? k + t * ldk + h * HD : v + t * ldv + h * HD;
    const bool deferred = side == 0 ? KVQ_KDEFER : NIBBLE_KVQ_VDEFER;
    if (deferred) {
        float* dst = (side == 0 ? rk : rv) + residual_row<HD>(res_tables, seq, p, max_blocks, h, num_kv_heads);
        for (int d = lane; d < HD; d += 32) dst[d] = x[d];
        // A block restarted at slot 0 clears its deferred page: until kvq_pack writes it,
        // attention may read it under a zero probability (prefill's first pass over a query's
        // own block), and a previous owner's bytes could be NaN (0 * NaN is NaN); zeros read
        // back as zeros.
        if (p % KV_BS == 0) {
            const int bytes = side == 0 ? KS::PAGE : VS::PAGE;
            uint4* pg = reinterpret_cast<uint4*>((side == 0 ? kc + page * KS::PAGE : vc + page * VS::PAGE));
            for (int i = lane; i < bytes / 16; i += 32) pg[i] = make_uint4(0, 0, 0, 0);
        }
    } else if (side == 0) {
        if constexpr (!KVQ_KDEFER) KS::append(kc + page * KS::PAGE, x, p % KV_BS, lane);
    } else {
        if constexpr (!NIBBLE_KVQ_VDEFER) VS::append(vc + page * VS::PAGE, x, p % KV_BS, lane);
    }
}

// Grid (tokens, kv heads), 2 warps, after kvq_append_residual: the CTA of a block's last slot
// packs the block's deferred sides from the residual (warp 0 the keys, channel-wise; warp 1 the
// values, row by row); every other CTA returns. Uniform over decode steps, so graphs hold it.
template <int HD>
__device__ void kvq_pack_impl(unsigned char* __restrict__ kc, unsigned char* __restrict__ vc,
                              const float* __restrict__ rk, const float* __restrict__ rv,
                              const int* __restrict__ block_tables, const int* __restrict__ res_tables,
                              const int* __restrict__ tok_seq, const int* __restrict__ tok_pos, int max_blocks,
                              int num_kv_heads) {
    using KS = PageSide<KvqT, HD, NIBBLE_KVQ_K>;
    using VS = PageSide<KvqT, HD, NIBBLE_KVQ_V>;
    grid_dependency_enter();
    const long t = blockIdx.x;
    const int h = blockIdx.y, lane = threadIdx.x & 31, side = threadIdx.x >> 5;
    const int p = tok_pos[t], seq = tok_seq[t];
    if (p % KV_BS != KV_BS - 1) return;
    const long page = (long)block_tables[(long)seq * max_blocks + p / KV_BS] * num_kv_heads + h;
    const long first = residual_row<HD>(res_tables, seq, p - (KV_BS - 1), max_blocks, h, num_kv_heads);
    if (side == 0) {
        if constexpr (KVQ_KDEFER) {
            const float* rows = rk + first;
            KS::pack_block(kc + page * KS::PAGE, [&](int r, int d) { return rows[r * HD + d]; }, lane);
        }
    } else {
        if constexpr (NIBBLE_KVQ_VDEFER) {
#pragma unroll 1
            for (int r = 0; r < KV_BS; ++r) VS::append(vc + page * VS::PAGE, rv + first + r * HD, r, lane);
        }
    }
}
#endif

// Slot `blockIdx.x % 16` of page `blockIdx.x / 16` of a layer: uniform values in [-1, 1),
// quantized as an append would (channel-wise keys: the slot-15 CTA packs the page's block).
template <int HD>
__device__ void kvq_fill_random_impl(unsigned char* kc, unsigned char* vc, int seed) {
    using KS = PageSide<KvqT, HD, NIBBLE_KVQ_K>;
    using VS = PageSide<KvqT, HD, NIBBLE_KVQ_V>;
    const long page = blockIdx.x / KV_BS;
    const int slot = blockIdx.x % KV_BS, lane = threadIdx.x & 31, side = threadIdx.x >> 5;
    float x[KS::E];
#pragma unroll
    for (int j = 0; j < KS::E; ++j) x[j] = hash_unit((long)blockIdx.x * HD + lane * KS::E + j, seed + side);
    if (side == 0) {
        if constexpr (KS::CHANNEL) {
            if (slot == KV_BS - 1)
                KS::pack_block(
                    kc + page * KS::PAGE,
                    [&](int r, int d) { return hash_unit((page * KV_BS + r) * HD + d, seed); }, lane);
        } else {
            KS::append_row(kc + page * KS::PAGE, x, slot, lane);
        }
    } else {
        VS::append_row(vc + page * VS::PAGE, x, slot, lane);
    }
}

KVQ_HEAD(64)
KVQ_HEAD(128)

// Decode attention on tensor cores for grouped-query attention: the G query heads that share a
// KV head are the rows of one m16n8k16 tile (padded to 16), so each 16-token KV block costs 32 MMA
// instructions per warp instead of G * 2 * HD multiply-adds per token on CUDA cores, and the
// kernel stays bound by HBM.
//
// Grid: (query tokens, kv heads, context splits), as the CUDA-core kernel (attention.cu), whose
// partial layout and reduction it shares. Block: 2 warps; each warp takes whole 16-token blocks
// of the split's chunk in turn: it streams the block's K and V pages of its head (kv_pages.cuh:
// [blocks][kv_heads] pages, a 16-bit page being [16][HD]) with 16-byte cp.async into its own
// shared stages, two deep so the next block loads while this one is computed; a 16-bit page lands
// in its tile (rows padded by 8 elements) directly, a quantized one (KV8, KV4, KV FP8: BitDecoding
// Sec. 4, TurboMind's quantized KV) is dequantized into the tile just before use. Then
// S = Q K^T (Q's A fragments kept in registers), an online
// softmax in base 2, and O += P V with P re-packed from the S accumulators and V's B fragments
// from ldmatrix.trans. Warps merge through shared memory and write (m, l, acc) per head. The
// CTA whose split holds the step's position first writes the step's key and value into the cache
// (the KV append, fused; quantized as it is written: warp 0 the key, warp 1 the value). A sliding window (window > 0) starts the block walk at the window's
// first position and masks the keys before it in that block; a split wholly before the window
// writes the empty state, as attention.cu's. With a DecodeRope, q and the step's key arrive
// unrotated and are rotated here as they are read (q as it is staged, the key before its
// append), from the pass's angle table: the layer's rope kernel is not launched.

#define DM_BS KV_BS
#define DM_WARPS 2

// Q's values in range of T: an f16 operand saturates instead of overflowing to infinity.
template <class T> __device__ __forceinline__ float in_range(float x) { return x; }
template <> __device__ __forceinline__ float in_range<__half>(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }

// RoPE left to the decode attention (attention.rs): the pass's angles (rope_angles, [token][HD /
// 2] of (cos, sin)) and the pairing; cs null when q and k come rotated.
struct DecodeRope {
    const float2* cs;
    int interleaved;
};

// Rotates a lane's 4 consecutive dims d0 .. d0 + 3 of one head (d0 = a multiple of 4) by the
// token's angles `cs`. Half-split pairs are HD / 2 dims apart, in the lane `lane ^ (HD / 8)` when
// a warp's 32 lanes hold 128 dims in order (stage_q): every lane of the warp takes part.
template <int HD>
__device__ __forceinline__ float4 rope_q4(float4 v, int d0, const float2* cs, int interleaved) {
    constexpr int HALF = HD / 2;
    if (interleaved) {
        const float2 a = rope_pair(v.x, v.y, cs[d0 / 2]), b = rope_pair(v.z, v.w, cs[d0 / 2 + 1]);
        return make_float4(a.x, a.y, b.x, b.y);
    }
    float4 p;
    p.x = __shfl_xor_sync(0xffffffffu, v.x, HD / 8);
    p.y = __shfl_xor_sync(0xffffffffu, v.y, HD / 8);
    p.z = __shfl_xor_sync(0xffffffffu, v.z, HD / 8);
    p.w = __shfl_xor_sync(0xffffffffu, v.w, HD / 8);
    const bool first = d0 < HALF;
    const int i = d0 % HALF;
    return make_float4(rope_one(v.x, p.x, cs[i], first), rope_one(v.y, p.y, cs[i + 1], first),
                       rope_one(v.z, p.z, cs[i + 2], first), rope_one(v.w, p.w, cs[i + 3], first));
}

// The GQA group's Q rows (group * HD consecutive floats at `qg`, then zero rows up to 16)
// converted to T into `kq` ([16][HD + 8]), natural dim d at column pos(d), then read as the A
// fragments `qf` of 16 x HD. A kernel that permutes the head dimension of its K fragments (a
// reduction is order-free) stages Q with the same permutation. Each lane's loads (4 floats
// apiece) are all issued before any is stored: one round trip instead of one per element.
template <class T, int HD, int G, class Pos>
__device__ __forceinline__ void stage_q(const float* qg, int group, T* kq, int lane, u32 (&qf)[HD / 16][4],
                                        Pos pos, DecodeRope rope = {}, int token = 0) {
    constexpr int LD = HD + 8;
    constexpr int QV = (G * HD / 4 + 31) / 32;
    const bool aligned = ((reinterpret_cast<unsigned long long>(qg) & 15) == 0);
    float4 qv[QV];
#pragma unroll
    for (int j = 0; j < QV; ++j) {
        const int i = (lane + 32 * j) * 4;
        qv[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < group * HD)
            qv[j] = aligned ? *reinterpret_cast<const float4*>(qg + i)
                            : make_float4(qg[i], qg[i + 1], qg[i + 2], qg[i + 3]);
    }
    if (rope.cs != nullptr) {
        static_assert(128 % HD == 0, "a warp's 128 dims are whole heads");
        const float2* cs = rope.cs + (long)token * (HD / 2);
#pragma unroll
        for (int j = 0; j < QV; ++j) qv[j] = rope_q4<HD>(qv[j], ((lane + 32 * j) * 4) % HD, cs, rope.interleaved);
    }
#pragma unroll
    for (int j = 0; j < QV; ++j) {
        const int i = (lane + 32 * j) * 4;
        if (i < group * HD) {
            T* row = &kq[(i / HD) * LD];
            const int d = i % HD;
            row[pos(d)] = from_f32<T>(in_range<T>(qv[j].x));
            row[pos(d + 1)] = from_f32<T>(in_range<T>(qv[j].y));
            row[pos(d + 2)] = from_f32<T>(in_range<T>(qv[j].z));
            row[pos(d + 3)] = from_f32<T>(in_range<T>(qv[j].w));
        }
    }
    // Rows past the group: zeros, 8 elements (16 bytes; LD * 2 is a multiple of 16) at a time.
    for (int i = group * (HD / 8) + lane; i < 16 * (HD / 8); i += 32)
        *reinterpret_cast<uint4*>(&kq[(i / (HD / 8)) * LD + (i % (HD / 8)) * 8]) = make_uint4(0, 0, 0, 0);
    __syncwarp();
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int c = kk * 16 + 2 * t;
        qf[kk][0] = *reinterpret_cast<const u32*>(&kq[g * LD + c]);
        qf[kk][1] = *reinterpret_cast<const u32*>(&kq[(g + 8) * LD + c]);
        qf[kk][2] = *reinterpret_cast<const u32*>(&kq[g * LD + c + 8]);
        qf[kk][3] = *reinterpret_cast<const u32*>(&kq[(g + 8) * LD + c + 8]);
    }
}

// The warps' stashed states (MERGE layout) merged per head
// into the split's partials. Starts with a barrier; all threads of the CTA.
template <int HD, int G, int WARPS>
__device__ __forceinline__ void combine_partials(const float* merge, int group, float* out) {
#define MERGE(w, hg, d) merge[((w) * G + (hg)) * (HD + 2) + (d)]
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * (HD + 2); idx += blockDim.x) {
        const int hg = idx / (HD + 2), d = idx % (HD + 2);
        float mx = NEG_BIG;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, MERGE(w, hg, HD));
        float v = 0.f;
        if (d == HD) {
            v = mx * 0.69314718056f;
        } else {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) v += MERGE(w, hg, d) * exp2f(MERGE(w, hg, HD) - mx);
        }
        out[hg * (HD + 2) + d] = v;
    }
#undef MERGE
}

// Merges the warps' running states (o, m, l of rows g and g + 8; rows g < group are heads) per
// head through `merge` (WARPS * G * (HD + 2) floats of shared memory) and writes the split's
// partials (m converted from base 2 to base e for the reduction). Output column c of n-tile n
// holds natural dim dim(n, c). All threads of the CTA.
template <int HD, int G, int WARPS, class Dim>
__device__ __forceinline__ void write_partials(float* merge, const float (&o)[HD / 8][4], const float (&m)[2],
                                               const float (&l)[2], int group, float* out, Dim dim) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    __syncthreads();
#define MERGE(w, hg, d) merge[((w) * G + (hg)) * (HD + 2) + (d)]
    if (g < group) {
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            MERGE(warp, g, dim(n, 2 * t)) = o[n][0];
            MERGE(warp, g, dim(n, 2 * t + 1)) = o[n][1];
        }
        if (t == 0) {
            MERGE(warp, g, HD) = m[0];
            MERGE(warp, g, HD + 1) = l[0];
        }
    }
    combine_partials<HD, G, WARPS>(merge, group, out);
#undef MERGE
}

// The positions a decode CTA reads (grid: token, kv head, split): [start, end) of the split's
// chunk, none before `lo` (a sliding window's first position), through its sequence's block
// table; false for a split wholly past the context. The CTA whose split holds the step's position
// first appends the step's key (warp 0) and value (warp 1) to their pages, quantizing them if
// the pages are (one launch fewer per layer than a separate append); it reads them back later.
// (Unless knew is null: a pool with a deferred side appends in kernels of its own.)
struct DecodeSplit {
    int start, end, lo;
    const int* table;
};
template <int HD, class KS, class VS>
__device__ __forceinline__ bool decode_split(DecodeSplit& d, const int* tok_pos, const int* block_tables,
                                             const int* tok_seq, int max_blocks, int chunk, int window,
                                             unsigned char* kc, unsigned char* vc, int num_kv_heads,
                                             const float* knew, const float* vnew, long ldk, long ldv,
                                             DecodeRope rope = {}) {
    const int token = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ctx = tok_pos[token] + 1;
    d.start = blockIdx.z * chunk;
    if (d.start >= ctx) return false;
    d.end = min(ctx, d.start + chunk);
    d.lo = window > 0 ? max(0, ctx - window) : 0;
    d.table = block_tables + (long)tok_seq[token] * max_blocks;
    // A pool with a deferred side (kv4c, kv2c) has appended the step's rows already
    // (kvq_append_residual, kvq_pack) and passes none.
    if (d.end == ctx && knew != nullptr) {
        const int p = ctx - 1;
        const long page = (long)d.table[p / KV_BS] * num_kv_heads + kvh;
        if constexpr (!KS::CHANNEL) {
            if (warp == 0) {
                // Lane l holds dims E l .. E l + E - 1: a half-split partner is 16 lanes away.
                constexpr int E = KS::E;
                const float* x = knew + (long)token * ldk + kvh * HD;
                float v[E];
#pragma unroll
                for (int j = 0; j < E; ++j) v[j] = x[lane * E + j];
                if (rope.cs != nullptr) {
                    const float2* cs = rope.cs + (long)token * (HD / 2);
                    if (rope.interleaved) {
#pragma unroll
                        for (int j = 0; j < E; j += 2) {
                            const float2 r = rope_pair(v[j], v[j + 1], cs[(lane * E + j) / 2]);
                            v[j] = r.x;
                            v[j + 1] = r.y;
                        }
                    } else {
                        const bool first = lane < 16;
#pragma unroll
                        for (int j = 0; j < E; ++j) {
                            const float partner = __shfl_xor_sync(0xffffffffu, v[j], 16);
                            v[j] = rope_one(v[j], partner, cs[(lane * E + j) % (HD / 2)], first);
                        }
                    }
                }
                KS::append_row(kc + page * KS::PAGE, v, p % KV_BS, lane);
            }
        }
        if (warp == 1) VS::append(vc + page * VS::PAGE, vnew + (long)token * ldv + kvh * HD, p % KV_BS, lane);
        __threadfence_block();
        __syncthreads();
    }
    return true;
}

// KDEF / VDEF: the keys / values wait in the residual until their block fills (kv4c, kv2c; the
// pages of the query's own block are not written yet): that block's deferred sides are read from
// the residual rows `rk` / `rv` (f32, kv_pages.cuh `residual_row`) instead of their pages, as the
// CPU reads a query's own block raw.
template <class T, int HD, int G, class KS, class VS, bool KDEF = false, bool VDEF = false>
__device__ void decode_mma_impl(const float* __restrict__ q, unsigned char* __restrict__ kc,
                                unsigned char* __restrict__ vc, const int* __restrict__ block_tables,
                                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                float* __restrict__ part, int num_kv_heads, int group,
                                int max_blocks, int chunk, float scale_log2, long ldq,
                                const float* __restrict__ knew, const float* __restrict__ vnew,
                                long ldk, long ldv, int window, const float* __restrict__ rk = nullptr,
                                const float* __restrict__ rv = nullptr,
                                const int* __restrict__ res_tables = nullptr, DecodeRope rope = {}) {
    static_assert(!(KDEF && KS::FLOAT) && !(VDEF && VS::FLOAT), "a deferred side is a quantized one");
    grid_dependency_enter();
    constexpr int LD = HD + 8;
    constexpr int WARPS = DM_WARPS;
    // Per warp: STAGES stages of K and of V, then (quantized sides) the tiles they dequantize
    // into. Two stages of 16-bit pages (4 KiB a side at HD 128) keep enough bytes in flight. Two
    // quantized sides streaming 3 or 4 deep measured no faster (kv4c, kv2c: 0.97x to 1.05x;
    // k8v4c 0.90x, H100, bench/results/kv-20261126-h100/stages-ab): dequantizing into the tiles
    // bounds them, not the bytes in flight.
    constexpr int KST = KS::STAGE, VST = VS::STAGE;
    constexpr int TILES = KS::TILE + VS::TILE;
    constexpr int STAGES = 2;
    constexpr int WARP_BYTES = STAGES * (KST + VST) + TILES;
    constexpr int MERGE_BYTES = WARPS * G * (HD + 2) * 4;
    constexpr int SMEM = WARPS * WARP_BYTES > MERGE_BYTES ? WARPS * WARP_BYTES : MERGE_BYTES;
    static_assert(KS::FLOAT || KS::TILE >= DM_BS * LD * (int)sizeof(T), "Q staging fits the K tile");
    __shared__ __align__(16) unsigned char smem[SMEM];
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    unsigned char* mine = smem + warp * WARP_BYTES;
    auto kst = [&](int st) { return mine + st * KST; };
    auto vst = [&](int st) { return mine + STAGES * KST + st * VST; };
    T* ktile = reinterpret_cast<T*>(mine + STAGES * (KST + VST));
    T* vtile = reinterpret_cast<T*>(mine + STAGES * (KST + VST) + KS::TILE);
    DecodeSplit ds;
    if (!decode_split<HD, KS, VS>(ds, tok_pos, block_tables, tok_seq, max_blocks, chunk, window, kc, vc,
                                  num_kv_heads, knew, vnew, ldk, ldv, rope))
        return;  // attn_reduce reads only the splits that hold context
    const int start = ds.start, end = ds.end, lo = ds.lo;
    const int* table = ds.table;
    auto kpage = [&](int b) { return kc + ((long)table[b] * num_kv_heads + kvh) * KS::PAGE; };
    auto vpage = [&](int b) { return vc + ((long)table[b] * num_kv_heads + kvh) * VS::PAGE; };
    // Q staging: the K tile, or stage 1 of a 16-bit K (two stages: the first block goes to
    // stage 0).
    T* kq = KS::FLOAT ? reinterpret_cast<T*>(kst(1)) : ktile;
    static_assert(STAGES == 2 || !KS::FLOAT, "Q staged in stage 1 is overwritten by a deeper prologue");

    // Block b's K and V pages into stage st, its slots before `end` read; an empty group past
    // the chunk, so that every iteration commits one.
    auto issue = [&](int b, int st) {
        if (b * DM_BS < end) {
            const int rows = min(DM_BS, end - b * DM_BS);
            KS::issue(kst(st), kpage(b), rows, lane);
            VS::issue(vst(st), vpage(b), rows, lane);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    // The first STAGES - 1 blocks stream in while Q is staged into A fragments.
    int stage = 0;
    const int first = max(start, lo) / DM_BS + warp;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(first + i * WARPS, i);
    u32 qf[HD / 16][4];
    stage_q<T, HD, G>(q + (long)token * ldq + (long)kvh * group * HD, group, kq, lane, qf,
                      [](int d) { return d; }, rope, token);
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_BIG, NEG_BIG}, l[2] = {0.f, 0.f};

    __syncwarp();  // Q's fragments are read: stage 1 may be refilled
    for (int b = first; b * DM_BS < end; b += WARPS) {
        // The block STAGES - 1 ahead streams in while this one is computed.
        issue(b + (STAGES - 1) * WARPS, stage == 0 ? STAGES - 1 : stage - 1);
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
        __syncwarp();
        const int rows = min(DM_BS, end - b * DM_BS);
        const T* kw;
        const T* vw;
        if constexpr (KDEF || VDEF) {
            // The query's own block: the last of a split that ends at the context.
            const int ctx = tok_pos[token] + 1;
            const bool own = end == ctx && b == (ctx - 1) / DM_BS;
            const long at = own ? residual_row<HD>(res_tables, tok_seq[token], b * DM_BS, max_blocks, kvh,
                                                   num_kv_heads)
                                : 0;
            kw = own && KDEF ? residual_tile<T, HD>(ktile, rk + at, rows, lane) : KS::ready(kst(stage), ktile, rows, lane);
            vw = own && VDEF ? residual_tile<T, HD>(vtile, rv + at, rows, lane) : VS::ready(vst(stage), vtile, rows, lane);
        } else {
            kw = KS::ready(kst(stage), ktile, rows, lane);
            vw = VS::ready(vst(stage), vtile, rows, lane);
        }
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                const T* kr = &kw[(n * 8 + g) * LD + kk * 16 + 2 * t];
                mma16816<T>(s[n], qf[kk], *reinterpret_cast<const u32*>(kr),
                            *reinterpret_cast<const u32*>(kr + 8));
            }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int p = b * DM_BS + n * 8 + 2 * t + (e & 1);
                s[n][e] = p < end && p >= lo ? s[n][e] * scale_log2 : NEG_BIG;
            }
        }
        softmax_tile(s, m, l, o);
        pv_tile<T, HD, LD>(o, s[0], s[1], vw, lane);
        __syncwarp();  // this stage is read before the next iteration refills it
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::);  // no copy may land in the merge area

    write_partials<HD, G, WARPS>(reinterpret_cast<float*>(smem), o, m, l, group,
                                 part + ((long)((long)token * num_kv_heads + kvh) * splits + split) * G * (HD + 2),
                                 [](int n, int c) { return n * 8 + c; });
}

// Entry points: `decode_mma_*` over a 16-bit pool (this module); `kvq_decode_*` over the pool
// format the kv_quant module is compiled for (kv_quant.cu).
#define NIBBLE_DECODE_ENTRY(NAME, T, HD, G, KK, VK)                                              \
    extern "C" __global__ void __launch_bounds__(64) NAME(                                       \
        const float* q, unsigned char* kc, unsigned char* vc, const int* block_tables,          \
        const int* tok_seq, const int* tok_pos, float* part, int num_kv_heads, int group,       \
        int max_blocks, int chunk, float scale_log2, long ldq, const float* knew,               \
        const float* vnew, long ldk, long ldv, int window, const float2* rope_cs,             \
        int rope_interleaved) {                                                                 \
        decode_mma_impl<T, HD, G, PageSide<T, HD, KK>, PageSide<T, HD, VK>>(q, kc, vc, block_tables, tok_seq, tok_pos, part,      \
                                          num_kv_heads, group, max_blocks, chunk, scale_log2,   \
                                          ldq, knew, vnew, ldk, ldv, window, nullptr, nullptr,  \
                                          nullptr, DecodeRope{rope_cs, rope_interleaved});      \
    }

#ifndef NIBBLE_KVQ_MODULE
#define NIBBLE_DECODE_MMA(SUFFIX, T, HD, G)                                                \
    NIBBLE_DECODE_ENTRY(decode_mma_##SUFFIX##_hd##HD##_g##G, T, HD, G, PAGE_F16, PAGE_F16)
#define NIBBLE_DECODE_MMA_G(SUFFIX, T, HD) \
    NIBBLE_DECODE_MMA(SUFFIX, T, HD, 2)    \
    NIBBLE_DECODE_MMA(SUFFIX, T, HD, 4)    \
    NIBBLE_DECODE_MMA(SUFFIX, T, HD, 8)
#define NIBBLE_DECODE_MMA_ALL(SUFFIX, T) \
    NIBBLE_DECODE_MMA_G(SUFFIX, T, 64)   \
    NIBBLE_DECODE_MMA_G(SUFFIX, T, 128)
NIBBLE_BOTH_DTYPES(NIBBLE_DECODE_MMA_ALL)
#endif

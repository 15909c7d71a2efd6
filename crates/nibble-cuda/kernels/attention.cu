// Paged attention for any query token over its sequence's KV cache, split along the context
// (flash-decoding / split-K), then a reduction over the splits. Used for decode steps and, until
// the tensor-core prefill kernel takes over, for prefill tokens too (each token reads its own
// causal prefix; the sequence's KV stays in L2 for short contexts).
//
// Grid: (query tokens, kv heads, context splits); block: WARPS warps. One CTA reads its kv head's
// keys and values for one chunk of the context once and serves every query head of the GQA group
// (group <= G), so KV bytes are read once per token rather than once per query head.
// Work split inside a CTA: a token's HD-wide row is read by LPT = HD/8 lanes with one 16-byte load
// each (K and V), so a warp covers TPW = 32/LPT tokens per step, and U steps are issued before any
// use, keeping 2*U 16-byte loads per lane in flight (the kernel is HBM-bound: ~2 FMAs per byte).
// Softmax is online (running max m, sum l, unnormalized acc) per lane group; lane groups merge by
// shuffles, warps through shared memory, and splits in `attn_reduce`.
//
// KV layout (per layer, separately for K and V), in the model dtype: block-major, then kv head,
// then the block's slots, then HD: [blocks][kv_heads][block_size][HD]. Position p of a sequence is
// slot p % block_size of block block_table[seq][p / block_size], so one CTA's reads are runs of
// block_size * HD * 2 contiguous bytes (4 KB for 16-token blocks at HD 128). -1e30 stands for
// -inf so that merging two empty states gives exp(0) * 0 instead of NaN.
//
// Partials: part[((token * kv_heads + kvh) * splits + split) * G + gi] holds (m, l, acc[HD]).
// Sliding window (window > 0): a query at position p reads positions p - window + 1 ..= p only;
// blocks wholly before that are not read, and a split wholly before it writes the empty state
// (m = -1e30, l = 0, acc = 0), which the reduction weighs by exp(-1e30 - M) = 0.


struct Partial {
    float m, l;
};

template <class T, int HD, int G, int WARPS, int U, int BS>
__device__ void paged_attn_impl(const float* __restrict__ q, const T* __restrict__ kc,
                                const T* __restrict__ vc, const int* __restrict__ block_tables,
                                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                                float* __restrict__ part, int num_kv_heads, int group,
                                int max_blocks, int block_size, int chunk, float scale, long ldq,
                                int window) {
    grid_dependency_enter();
    constexpr int LPT = HD / 8;
    constexpr int TPW = 32 / LPT;
    const int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % LPT, tslot = lane / LPT;
    const int ctx = tok_pos[token] + 1;
    const int start = split * chunk;
    if (start >= ctx) return;  // attn_reduce reads only the splits that hold context
    const int end = min(ctx, start + chunk);
    const int lo = window > 0 ? max(0, ctx - window) : 0;  // the first position read
    const int* table = block_tables + (long)tok_seq[token] * max_blocks;

    float qr[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = kvh * group + g;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            qr[g][i] = g < group ? q[(long)token * ldq + h * HD + sub * 8 + i] * scale : 0.f;
    }
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_BIG;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }

    // Warps take whole 16-token blocks: one block-table read per block, and a block's rows of
    // this head are one contiguous BS * HD run, read in U-step batches of TPW tokens.
    constexpr int STEPS = BS / TPW;
    for (int b = max(start, lo) / BS + warp; b * BS < end; b += WARPS) {
        const long base = ((long)table[b] * num_kv_heads + kvh) * BS * HD + sub * 8;
#pragma unroll
        for (int s0 = 0; s0 < STEPS; s0 += U) {
        Vec8 kv[U], vv[U];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int slot = (s0 + u) * TPW + tslot;
            valid[u] = s0 + u < STEPS && b * BS + slot < end && b * BS + slot >= lo;
            if (valid[u]) {
                kv[u] = *reinterpret_cast<const Vec8*>(kc + base + slot * HD);
                vv[u] = *reinterpret_cast<const Vec8*>(vc + base + slot * HD);
            } else {
                // Zeros, not garbage: a skipped token's value still meets a zero weight.
#pragma unroll
                for (int j = 0; j < 8; ++j) kv[u].h[j] = vv[u].h[j] = 0;
            }
        }
        // Scores of the U tokens first, then one softmax rescale for all of them.
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            unpack8<T>(kv[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(qr[g][i], kf[i], s);
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                sc[u][g] = valid[u] ? s : NEG_BIG;
            }
        }
        float vf[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u) unpack8<T>(vv[u], vf[u]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= group) break;
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][g]);
            const float corr = __expf(m[g] - mx);
            float p[U], psum = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                p[u] = valid[u] ? __expf(sc[u][g] - mx) : 0.f;
                psum += p[u];
            }
            l[g] = l[g] * corr + psum;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float a = acc[g][i] * corr;
#pragma unroll
                for (int u = 0; u < U; ++u) a = fmaf(p[u], vf[u][i], a);
                acc[g][i] = a;
            }
            m[g] = mx;
        }
        }
    }

    // Merge the TPW lane groups of the warp (same dims, different tokens).
#pragma unroll
    for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float a = __expf(m[g] - mn), b = __expf(mo - mn);
            l[g] = l[g] * a + lo * b;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                acc[g][i] = acc[g][i] * a + ao * b;
            }
            m[g] = mn;
        }
    }

    // Merge the warps through shared memory and write this split's partial state.
    __shared__ float sm[WARPS][G][HD + 2];
    if (tslot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (sub == 0) {
                sm[warp][g][HD] = m[g];
                sm[warp][g][HD + 1] = l[g];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) sm[warp][g][sub * 8 + i] = acc[g][i];
        }
    }
    __syncthreads();
    float* out = part + ((long)((long)token * num_kv_heads + kvh) * splits + split) * G * (HD + 2);
    for (int idx = threadIdx.x; idx < group * (HD + 2); idx += blockDim.x) {
        const int g = idx / (HD + 2), d = idx % (HD + 2);
        float mx = NEG_BIG;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm[w][g][HD]);
        float v = 0.f;
        if (d == HD) {
            v = mx;
        } else {
            const int src = d == HD + 1 ? HD + 1 : d;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) v += sm[w][g][src] * __expf(sm[w][g][HD] - mx);
        }
        out[g * (HD + 2) + d] = v;
    }
}

// out[token, h*HD + d] = sum over valid splits of acc * exp(m - M) / sum of l * exp(m - M).
// One CTA per (token, head): the split weights are computed once, in parallel, into shared
// memory; then each thread sums its dimension over the splits with independent loads.
#define MAX_SPLITS 512
template <class T, int HD, int G>
__device__ void attn_reduce_impl(const float* __restrict__ part, const int* __restrict__ tok_pos,
                                 T* __restrict__ out, int num_kv_heads, int group, int splits,
                                 int chunk) {
    grid_dependency_enter();
    __shared__ float w[MAX_SPLITS];
    __shared__ float scratch[32];
    const int token = blockIdx.x, h = blockIdx.y;
    const int kvh = h / group, g = h % group;
    const int used = (tok_pos[token] + chunk) / chunk;  // splits holding context: ceil((pos+1)/chunk)
    const long stride = (long)G * (HD + 2);
    const float* base = part + ((long)token * num_kv_heads + kvh) * splits * stride + g * (HD + 2);
    float mx = NEG_BIG;
    for (int s = threadIdx.x; s < used; s += blockDim.x) mx = fmaxf(mx, base[s * stride + HD]);
    // Block max: shuffles within warps, then across warps through shared memory.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = NEG_BIG;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) mx = fmaxf(mx, scratch[i]);
    __syncthreads();
    float lsum = 0.f;
    for (int s = threadIdx.x; s < used; s += blockDim.x) {
        const float ws = __expf(base[s * stride + HD] - mx);
        w[s] = ws;
        lsum += ws * base[s * stride + HD + 1];
    }
    lsum = block_sum(lsum, scratch);
    __syncthreads();
    const float inv = 1.0f / lsum;
    const int num_heads = num_kv_heads * group;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int s = 0;
        for (; s + 4 <= used; s += 4) {
            a0 = fmaf(base[(s + 0) * stride + d], w[s + 0], a0);
            a1 = fmaf(base[(s + 1) * stride + d], w[s + 1], a1);
            a2 = fmaf(base[(s + 2) * stride + d], w[s + 2], a2);
            a3 = fmaf(base[(s + 3) * stride + d], w[s + 3], a3);
        }
        for (; s < used; ++s) a0 = fmaf(base[s * stride + d], w[s], a0);
        out[(long)token * num_heads * HD + h * HD + d] = from_f32<T>((a0 + a1 + a2 + a3) * inv);
    }
}

#define NIBBLE_ATTN(SUFFIX, T, HD, G)                                                              \
    extern "C" __global__ void __launch_bounds__(128) paged_attn_##SUFFIX##_hd##HD##_g##G(       \
        const float* q, const T* kc, const T* vc, const int* block_tables, const int* tok_seq,   \
        const int* tok_pos, float* part, int num_kv_heads, int group, int max_blocks,            \
        int block_size, int chunk, float scale, long ldq, int window) {                          \
        /* Eight heads' accumulators leave registers for only two tokens in flight. */             \
        paged_attn_impl<T, HD, G, 4, (G >= 8 ? 2 : 4), 16>(q, kc, vc, block_tables, tok_seq, tok_pos, part,          \
                                        num_kv_heads, group, max_blocks, block_size, chunk,      \
                                        scale, ldq, window);                                     \
    }                                                                                            \
    extern "C" __global__ void attn_reduce_##SUFFIX##_hd##HD##_g##G(                              \
        const float* part, const int* tok_pos, T* out, int num_kv_heads, int group, int splits,  \
        int chunk) {                                                                             \
        attn_reduce_impl<T, HD, G>(part, tok_pos, out, num_kv_heads, group, splits, chunk);      \
    }

#define NIBBLE_ATTN_GROUPS(SUFFIX, T, HD) \
    NIBBLE_ATTN(SUFFIX, T, HD, 1)         \
    NIBBLE_ATTN(SUFFIX, T, HD, 2)         \
    NIBBLE_ATTN(SUFFIX, T, HD, 4)         \
    NIBBLE_ATTN(SUFFIX, T, HD, 8)

#define NIBBLE_ATTN_ALL(SUFFIX, T)      \
    NIBBLE_ATTN_GROUPS(SUFFIX, T, 16)   \
    NIBBLE_ATTN_GROUPS(SUFFIX, T, 32)   \
    NIBBLE_ATTN_GROUPS(SUFFIX, T, 64)   \
    NIBBLE_ATTN_GROUPS(SUFFIX, T, 128)  \
    NIBBLE_ATTN_GROUPS(SUFFIX, T, 256)

NIBBLE_BOTH_DTYPES(NIBBLE_ATTN_ALL)

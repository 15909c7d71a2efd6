// Decode gemv, persistent (sm_80 and later; programmatic dependent launch from sm_90):
// y[m][n] = sum_k x[m][k] * w[n][k] for up to 32 tokens, W4A16 and W8A8, on the packed weights
// of qgemm.cu (same fragments, same operand roles: weight rows on the MMA's M side).
//
// Work (stream-K): the units (row block b of DW 16-row tiles, 64-channel chunk c), b-major, are cut
// into equal contiguous ranges, one per CTA, with a fixed number of CTAs per SM: every SM streams
// the same weight bytes whatever the layer's shape, in one wave. Warp w computes tile b*DW + w of
// each of its CTA's units, so the CTA's warps read the same activation chunks at about the same
// time (L1 hits) and each warp reads one contiguous run of its tile's fragments.
// Pipeline: registers. Each lane holds U chunks' 16-byte weight fragments (ld.global.nc, L1
// no-allocate) and, while it multiplies them, the next U are in flight; the first loads go out
// before anything else the kernel does (and, with programmatic dependent launch, before the
// previous kernel has finished: the weights do not depend on it; activations and outputs wait).
// Math: W4A16 applies group scales after the MMA (QServe §5): a k16 step multiplies the codes as
// lop3 leaves them, magic + q, into G, so a weight costs one lop3 and no arithmetic; at the
// group's end each output adds s * (G - (magic + z) * S) in f32, where S is the sum of the
// group's activations, made once per CTA while staging them (instead of a second MMA per step:
// the mma.sync pipe, not the ALU, is what bounds this kernel on Hopper).
// Groups must be whole chunks (64 channels or a multiple); smaller groups take the mma.sync gemv.
// Split-K by pieces: a row block cut between CTAs leaves a warp a partial tile; its partial sums
// go to `partial` and the last warp to arrive (a counter per tile) adds the pieces in CTA order,
// so results are deterministic. TurboMind §4.1 (packed fragments), QServe §5 (scales after MMA).

__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <class T> __device__ __forceinline__ float dec_half_lo(u32 v);
template <> __device__ __forceinline__ float dec_half_lo<__half>(u32 v) {
    return __half2float(__ushort_as_half((unsigned short)v));
}
template <> __device__ __forceinline__ float dec_half_lo<__nv_bfloat16>(u32 v) { return __uint_as_float(v << 16); }

// The sum of eight 16-bit values, in f32.
template <class T> __device__ __forceinline__ float sum8(uint4 v);
template <> __device__ __forceinline__ float sum8<__nv_bfloat16>(uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) s += __uint_as_float(w[i] << 16) + __uint_as_float(w[i] & 0xffff0000u);
    return s;
}
template <> __device__ __forceinline__ float sum8<__half>(uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        s += f.x + f.y;
    }
    return s;
}

// W4A16 units: a tile's chunk is 512 B of codes (16 B per lane) and the (scale, magic + zero)
// pairs of its group, rows g and g + 8 (8 B per lane).
template <class T, int U_> struct DecW4 {
    using X = T;
    using Acc = float;
    static constexpr int U = U_;
    static constexpr bool ZERO_POINTS = true;  // flush needs the activation sums
    struct Regs {
        uint4 w[U];
        uint2 p[U];
    };
    const uint4* codes;
    const uint2* params;
    int chunks, groups, group_len, group_shift;

    // Chunks c .. c + U - 1 of the tile into registers (L1-bypassing code loads; the parameter
    // rows, shared by the chunks of a group, through L1).
    __device__ __forceinline__ void fetch(int tile, int c, Regs& r) const {
        const int lane = threadIdx.x & 31;
        const uint4* wp = codes + ((long)tile * chunks + c) * 32 + lane;
        const uint2* pp = params + (long)tile * groups * 8 + (lane >> 2);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            r.w[u] = ld_stream(wp + u * 32);
            r.p[u] = __ldg(pp + (long)group_of((c + u) * 64, group_len, group_shift) * 8);
        }
    }
    // Lane (g, t)'s B fragments of a staged chunk for token m: channels t*16 .. +15 of the chunk.
    __device__ __forceinline__ void load_x(const unsigned char* row, int m, int M, uint4 (&v)[2]) const {
        const uint4* src = reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 32);
        v[0] = m < M ? src[0] : make_uint4(0, 0, 0, 0);
        v[1] = m < M ? src[1] : make_uint4(0, 0, 0, 0);
    }
    // Chunk u's codes times the activations into G (alternate k16 steps into two chains).
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][2], float (&G)[2][TT][4]) const {
        const u32 words[4] = {r.w[u].x, r.w[u].y, r.w[u].z, r.w[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 a[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) a[q] = lop3_and_or(words[j] >> (4 * q), 0x000f000fu, W4Math<T>::MAGIC);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const uint4& v = xv[tt][j >> 1];
                mma16816<T>(G[j & 1][tt], a, (j & 1) ? v.z : v.x, (j & 1) ? v.w : v.y);
            }
        }
    }
    // group_len is a power of two (group_shift >= 0) or a multiple of 64 that is not.
    __device__ __forceinline__ bool group_ends(int c) const {
        return group_shift >= 0 ? (((c + 1) << 6) & (group_len - 1)) == 0 : ((c + 1) * 64) % group_len == 0;
    }
    // acc += s * (G - (magic + z) * S) for rows g (C fragment elements 0, 1) and g + 8 (2, 3),
    // S the activation sums of tokens 2t, 2t + 1 over the chunks in G; G and S back to zero.
    template <int TT>
    __device__ __forceinline__ void flush(const Regs& r, int u, float (&G)[2][TT][4], float (&S)[TT][2],
                                          float (&acc)[TT][4]) const {
        const float s0 = dec_half_lo<T>(r.p[u].x), s1 = dec_half_lo<T>(r.p[u].y);
        const float z0 = dec_half_lo<T>(r.p[u].x >> 16), z1 = dec_half_lo<T>(r.p[u].y >> 16);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sum = fmaf(-(e < 2 ? z0 : z1), S[tt][e & 1], G[0][tt][e] + G[1][tt][e]);
                acc[tt][e] = fmaf(e < 2 ? s0 : s1, sum, acc[tt][e]);
                G[0][tt][e] = G[1][tt][e] = 0.f;
            }
            S[tt][0] = S[tt][1] = 0.f;
        }
    }
};

// W8A8 units: a tile's chunk is 1024 B of INT8 codes (32 B per lane); scales are per row and
// token, applied in the epilogue.
template <int U_> struct DecW8 {
    using X = signed char;
    using Acc = int;
    static constexpr int U = U_;
    static constexpr bool ZERO_POINTS = false;
    struct Regs {
        uint4 w[U][2];
    };
    const uint4* codes;
    int chunks;

    __device__ __forceinline__ void fetch(int tile, int c, Regs& r) const {
        const uint4* wp = codes + ((long)tile * chunks + c) * 64 + (threadIdx.x & 31) * 2;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            r.w[u][0] = ld_stream(wp + u * 64);
            r.w[u][1] = ld_stream(wp + u * 64 + 1);
        }
    }
    __device__ __forceinline__ void load_x(const unsigned char* row, int m, int M, uint4 (&v)[1]) const {
        v[0] = m < M ? *reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 16) : make_uint4(0, 0, 0, 0);
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][1], int (&G)[2][TT][4]) const {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 a[4] = {r.w[u][j].x, r.w[u][j].y, r.w[u][j].z, r.w[u][j].w};
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
                mma_s8(G[j][tt], a, j ? xv[tt][0].z : xv[tt][0].x, j ? xv[tt][0].w : xv[tt][0].y);
        }
    }
    __device__ __forceinline__ bool group_ends(int) const { return false; }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, int (&G)[2][TT][4], float (&)[TT][2],
                                          int (&acc)[TT][4]) const {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[tt][e] += G[0][tt][e] + G[1][tt][e];
                G[0][tt][e] = G[1][tt][e] = 0;
            }
    }
};

// Orders this thread's partial-sum stores before its counter update, and the last arriver's
// counter read before its partial-sum loads (a cheaper fence than __threadfence's fence.sc).
__device__ __forceinline__ void release_fence() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// Ends a warp's piece of tile `tile` (row block b): a whole tile's sums go straight to y; a
// partial one is written to its slot and the last of the tile's pieces adds them in CTA order.
template <int TT, class A, class OUT, class EPI>
__device__ __forceinline__ void dec_finish(A (&acc)[TT][4], int tile, int b, int chunks, int per_cta,
                                           int max_pieces, int M, int N, A* partial, int* counters,
                                           OUT* y, long ldy, const EPI& epi) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long first = (long)b * chunks / per_cta, last = ((long)(b + 1) * chunks - 1) / per_cta;
    const int pieces = (int)(last - first + 1);
    if (pieces == 1) {
        store_tile<TT>(acc, tile * 16, 0, M, N, y, ldy, epi);
    } else {
        A* mine = partial + ((long)tile * max_pieces + (blockIdx.x - first)) * M * 16;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = g + 8 * (e >> 1), m = tt * 8 + 2 * t + (e & 1);
                if (m < M) mine[m * 16 + r] = acc[tt][e];
            }
        release_fence();
        __syncwarp();
        int done = 0;
        if (lane == 0) {
            done = atomicAdd(&counters[tile], 1) == pieces - 1;
            if (done) counters[tile] = 0;
        }
        if (__shfl_sync(0xffffffffu, done, 0)) {
            release_fence();
            const A* base = partial + (long)tile * max_pieces * M * 16;
            for (int i = lane; i < M * 16; i += 32) {
                const int m = i >> 4, n = tile * 16 + (i & 15);
                A s = 0;
                for (int p = 0; p < pieces; ++p) s += __ldcg(base + (long)p * M * 16 + i);
                if (n < N) y[(long)m * ldy + n] = to_out(epi(s, m, n), (OUT*)nullptr);
            }
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] = 0;
}

template <int TT, int DW, class F, class OUT, class EPI>
__device__ __forceinline__ void dec_gemv(const F& f, const typename F::X* __restrict__ x, long ldx,
                                         OUT* __restrict__ y, long ldy, typename F::Acc* __restrict__ partial,
                                         int* __restrict__ counters, int M, int N, int K, int tiles, int chunks,
                                         int per_cta, int max_pieces, const EPI& epi) {
    constexpr int U = F::U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int units = (tiles + DW - 1) / DW * chunks;
    const int u0 = blockIdx.x * per_cta, u1 = min(units, u0 + per_cta);
    // A position in the CTA's units: unit u is chunk c of row block b. `chunks` and `per_cta` are
    // multiples of U (the host's plan), so every batch is U whole chunks of one tile and the
    // steady state has no per-chunk conditions: on Hopper this kernel is bound by instruction
    // issue long before the ALU or the tensor pipe, and every instruction per chunk counts.
    struct Cursor {
        int u, b, c;
    };
    // Skips row blocks whose tile for this warp is past the last tile (only the last block).
    auto settle = [&](Cursor& q) -> bool {
        while (q.u < u1 && q.b * DW + warp >= tiles) {
            q.u += chunks - q.c;
            q.c = 0;
            ++q.b;
        }
        return q.u < u1;
    };
    auto advance = [&](Cursor& q) {
        q.u += U;
        q.c += U;
        if (q.c == chunks) {
            q.c = 0;
            ++q.b;
        }
    };
    Cursor q{u0, u0 / chunks, u0 % chunks};
    bool more = settle(q);
    typename F::Regs ra, rb;
    if (more) f.fetch(q.b * DW + warp, q.c, ra);
    grid_dependents_launch();
    grid_dependency_wait();

    // The activations of the CTA's chunk window (chunks c0 .. c0 + win - 1, cyclically) go to
    // shared memory, zero past K, while the first weights are on their way: read from global
    // memory inside the loop, they would queue behind the streamed weight loads (the L1 returns
    // loads in order), stalling every batch on a full memory round trip.
    extern __shared__ __align__(16) unsigned char xs[];
    constexpr int XB = (int)sizeof(typename F::X);
    const int c0 = u0 % chunks, win = min(chunks, per_cta);
    const int stride = gemv_x_stride(win, XB);
    {
        const int segs = win * 64 * XB / 16;
        for (int i = threadIdx.x; i < M * segs; i += blockDim.x) {
            const int row = i / segs, seg = i % segs, slot = seg * 16 / (64 * XB);
            const int c = c0 + slot < chunks ? c0 + slot : c0 + slot - chunks;
            const int k = c * 64 + (seg * 16 / XB) % 64;
            const bool ok = k < K;
            cp_async16(xs + row * stride + seg * 16, x + (ok ? (long)row * ldx + k : 0), ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    // W4A16's activation sums per staged chunk, [slot][token] (0 past M); 8 lanes per sum.
    constexpr int MP = TT * 8;
    float* xsum = reinterpret_cast<float*>(xs + M * stride);
    if constexpr (F::ZERO_POINTS) {
        for (int base = warp * 4; base < win * MP; base += DW * 4) {
            const int i = base + (lane >> 3), slot = i / MP, m = i % MP;
            float v = 0.f;
            if (i < win * MP && m < M)
                v = sum8<typename F::X>(*reinterpret_cast<const uint4*>(xs + m * stride + slot * 128 + (lane & 7) * 16));
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            if (i < win * MP && (lane & 7) == 0) xsum[i] = v;
        }
        __syncthreads();
    }

    constexpr int XV = XB == 2 ? 2 : 1;
    typename F::Acc G[2][TT][4] = {}, acc[TT][4] = {};
    float S[TT][2] = {};
    const unsigned char* xrow[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) xrow[tt] = xs + min(tt * 8 + g, M - 1) * stride;
    // One batch: the next one's loads go out, then this one is multiplied. Two calls per loop
    // trip with the register sets swapped, so no registers are copied between batches.
    auto step = [&](typename F::Regs& cur, typename F::Regs& nxt) -> bool {
        Cursor nq = q;
        advance(nq);
        const bool nmore = settle(nq);
        if (nmore) f.fetch(nq.b * DW + warp, nq.c, nxt);
        const int slot0 = q.c >= c0 ? q.c - c0 : q.c + chunks - c0;
        const bool piece_ends = q.c + U == chunks || q.u + U == u1;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            uint4 xv[TT][XV];
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) f.load_x(xrow[tt] + (slot0 + u) * 64 * XB, tt * 8 + g, M, xv[tt]);
            f.template mma<TT>(cur, u, xv, G);
            if constexpr (F::ZERO_POINTS) {
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) {
                    const float2 v = *reinterpret_cast<const float2*>(xsum + (slot0 + u) * MP + tt * 8 + 2 * t);
                    S[tt][0] += v.x;
                    S[tt][1] += v.y;
                }
            }
            if (f.group_ends(q.c + u) || (u == U - 1 && piece_ends)) f.flush(cur, u, G, S, acc);
        }
        if (piece_ends)
            dec_finish<TT>(acc, q.b * DW + warp, q.b, chunks, per_cta, max_pieces, M, N, partial, counters, y,
                           ldy, epi);
        q = nq;
        return nmore;
    };
    while (more && step(ra, rb)) more = step(rb, ra);
}

// Entry points: dec1 / dec2 = 8 / 16 tokens, `_h` writes the model dtype instead of f32. The
// Hopper tier only (measured there; the mma.sync gemv serves earlier GPUs).
#if !defined(DEC_NO_ENTRIES) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
#define DEC_WARPS 16
#define W4A16_DEC_ENTRY(NAME, T, TT, U, OUT)                                                           \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const uint2* params, const T* x, long ldx, OUT* y, long ldy, float* partial, \
        int* counters, int M, int N, int K, int tiles, int chunks, int groups, int group_len,          \
        int group_shift, int per_cta, int max_pieces) {                                                \
        dec_gemv<TT, DEC_WARPS>(DecW4<T, U>{codes, params, chunks, groups, group_len, group_shift}, x,  \
                                ldx, y, ldy, partial, counters, M, N, K, tiles, chunks, per_cta,          \
                                max_pieces, W4Epilogue{});                                             \
    }
#define NIBBLE_W4A16_DEC(SUFFIX, T)                        \
    W4A16_DEC_ENTRY(w4a16_dec1_##SUFFIX, T, 1, 4, float)   \
    W4A16_DEC_ENTRY(w4a16_dec2_##SUFFIX, T, 2, 4, float)   \
    W4A16_DEC_ENTRY(w4a16_dec1_h_##SUFFIX, T, 1, 4, T)     \
    W4A16_DEC_ENTRY(w4a16_dec2_h_##SUFFIX, T, 2, 4, T)
NIBBLE_BOTH_DTYPES(NIBBLE_W4A16_DEC)

#define W8A8_DEC_ENTRY(NAME, TT, U, OUT)                                                               \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const float* sw, const signed char* x, long ldx, const float* sx, OUT* y,  \
        long ldy, int* partial, int* counters, int M, int N, int K, int tiles, int chunks, int per_cta, \
        int max_pieces) {                                                                              \
        dec_gemv<TT, DEC_WARPS>(DecW8<U>{codes, chunks}, x, ldx, y, ldy, partial, counters, M, N, K,   \
                                tiles, chunks, per_cta, max_pieces, W8Epilogue{sx, sw});               \
    }
#define NIBBLE_W8A8_DEC(SUFFIX, OUT)                \
    W8A8_DEC_ENTRY(w8a8_dec1_##SUFFIX, 1, 4, OUT)   \
    W8A8_DEC_ENTRY(w8a8_dec2_##SUFFIX, 2, 4, OUT)
NIBBLE_W8A8_DEC(f32, float)
NIBBLE_W8A8_DEC(bf16, __nv_bfloat16)
NIBBLE_W8A8_DEC(f16, __half)
#endif

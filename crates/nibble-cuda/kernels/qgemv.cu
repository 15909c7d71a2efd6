// Decode gemv, persistent, Hopper tier (sm_90 and later, programmatic dependent launch):
// y[m][n] = sum_k x[m][k] * w[n][k] for up to 16 tokens (W8A16) or 32 (W4A16, in four token
// tiles past 16, and W8A8, W4A8, FP8), on the
// packed weights of qgemm.cu (same fragments, same operand roles: weight rows on the MMA's M
// side); W4A8 widens its 4-bit codes to W8A8's INT8 fragments in registers (QServe §5,
// LiquidGEMM §4), W8A16 its INT8 codes to exact 16-bit values (w8_pair).
//
// Work (stream-K): the units (row block b of DW 16-row tiles, 64-channel chunk c), b-major, are cut
// into equal contiguous ranges, one per CTA, with a fixed number of CTAs per SM: every SM streams
// the same weight bytes whatever the layer's shape, in one wave. Warp w computes tile b*DW + w of
// each of its CTA's units, so the CTA's warps read the same activation chunks at about the same
// time (L1 hits) and each warp reads one contiguous run of its tile's fragments.
// Pipeline: registers. Each lane holds U = 4 chunks' 16-byte weight fragments (ld.global.nc, L1
// no-allocate) and, while it multiplies them, the next U are in flight; the first loads go out
// before anything else the kernel does (and, with programmatic dependent launch, before the
// previous kernel has finished: the weights do not depend on it; activations and outputs wait).
// The loop is bound by instruction issue, so a batch has no per-chunk conditions, loads at
// constant offsets from one pointer per tile, and reads activations without predicates.
// Math: W4A16 applies group scales after the MMA (QServe §5): a k16 step multiplies the codes as
// lop3 leaves them, magic + q, into G, so a weight costs one lop3 and no arithmetic (with f16,
// whose mantissa holds a nibble at bits 4-7, rows g + 8 skip the shift too and read magic + 16 q);
// at the end of each span of GC chunks (GC = 1 for groups of 64, else 2) each output adds
// s * (G - (magic + z) * S) in f32, where S is the span's activation sum, made once per CTA while
// staging the activations (instead of a second MMA per step).
// Groups must be 64 channels, a power of two past it, or a whole row; others take the mma.sync
// gemv.
// Split-K by pieces: a row block cut between CTAs leaves a warp a partial tile; its partial sums
// go to `partial` and the last warp to arrive (a counter per tile) adds the pieces in CTA order,
// so results are deterministic. TurboMind §4.1 (packed fragments), QServe §5 (scales after MMA).
// Normed entries (`w4a16_dec1_norm_*`, one token): the CTA norms its window from
// the f32 residual row itself (RowNorm, dec_stage_normed) in place of the RMSNorm kernel before
// it (Backend::norm_linear).

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

// 16 and 8 bytes of shared memory at a shared-window address: the lean loop (dec_gemv_lean)
// reads its activation window through 32-bit shared addresses it only offsets; through a
// generic pointer into `xs` the compiler rebuilds the window's base and the lane's row address
// in every batch.
__device__ __forceinline__ uint4 lds128(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ float2 lds64f(u32 a) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
    return v;
}

// v, kept in a register: the compiler would otherwise re-derive a loop-invariant value from the
// kernel parameters in every batch of the lean loop.
__device__ __forceinline__ int dec_pin(int v) {
    asm("" : "+r"(v));
    return v;
}

// Chunks of 64 channels per register batch: the next batch's loads are in flight while this one
// is multiplied (qlinear::DECODE_BATCH).
#define DEC_U 4

// W4A16 units: a tile's chunk is 512 B of codes (16 B per lane) and the (scale, magic + zero)
// pairs of its group, rows g and g + 8 (8 B per lane). Scales apply once per span of GC chunks
// (GC = 1 for groups of 64, 2 for groups of 128 or a larger power of two), so a span's group is
// known without a test and a batch has no per-chunk conditions.
template <class T, int GC_> struct DecW4 {
    using X = T;
    using Acc = float;
    static constexpr int U = DEC_U, GC = GC_, SPANS = U / GC;
    static constexpr bool ZERO_POINTS = true;  // flush needs the activation sums
    struct Regs {
        uint4 w[U];
        uint2 p[SPANS];
    };
    // A tile's first code fragment and group-parameter pair for this lane.
    struct Tile {
        const uint4* w;
        const uint2* p;
    };
    const uint4* codes;
    const uint2* params;
    int chunks, groups, chunk_shift;  // chunk_shift: log2 of the chunks per group

    __device__ __forceinline__ Tile tile_at(int tile) const {
        const int lane = threadIdx.x & 31;
        return {codes + (long)tile * chunks * 32 + lane, params + (long)tile * groups * 8 + (lane >> 2)};
    }
    // Chunks c .. c + U - 1 into registers (L1-bypassing code loads; the parameter rows, shared
    // by the chunks of a group, through L1).
    __device__ __forceinline__ void fetch(const Tile& t, int c, Regs& r) const {
        const uint4* wp = t.w + c * 32;
#pragma unroll
        for (int u = 0; u < U; ++u) r.w[u] = ld_stream(wp + u * 32);
#pragma unroll
        for (int s = 0; s < SPANS; ++s) r.p[s] = __ldg(t.p + (GC == 1 ? c + s : (c + s * GC) >> chunk_shift) * 8);
    }
    // Lane (g, t)'s B fragments of a staged chunk: channels t*16 .. +15 of the chunk.
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[2]) const {
        const uint4* src = reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 32);
        v[0] = src[0];
        v[1] = src[1];
    }
    // The lean loop's (dec_gemv_lean) units. With groups of 64 a tile's addresses are linear in
    // the chunk, so the loop may count chunks from any origin (org). With spans of two chunks, c
    // is a multiple of U, so span s of chunks c .. c + U - 1 lies in group
    // (c >> chunk_shift) + (s * GC >> chunk_shift): the second term is the tile's (a pointer per
    // span), and c counts from 0.
    static constexpr bool RELATIVE = GC == 1;
    struct TileL {
        const uint4* w;
        const uint2* p[GC == 1 ? 1 : SPANS];
    };
    __device__ __forceinline__ TileL tile_lean(int tile, int org) const {
        const int lane = threadIdx.x & 31;
        TileL t;
        t.w = codes + ((long)tile * chunks + org) * 32 + lane;
        const uint2* p = params + (long)tile * groups * 8 + (lane >> 2);
        if constexpr (GC == 1) {
            t.p[0] = p + org * 8;
        } else {
#pragma unroll
            for (int s = 0; s < SPANS; ++s) t.p[s] = p + ((s * GC) >> chunk_shift) * 8;
        }
        return t;
    }
    // (long) indices: one wide multiply-add an address, not a shift and one.
    __device__ __forceinline__ void fetch(const TileL& t, int c, Regs& r) const {
        const uint4* wp = t.w + (long)c * 32;
#pragma unroll
        for (int u = 0; u < U; ++u) r.w[u] = ld_stream(wp + u * 32);
#pragma unroll
        for (int s = 0; s < SPANS; ++s)
            r.p[s] = GC == 1 ? __ldg(t.p[0] + (long)(c + s) * 8) : __ldg(t.p[s] + (long)(c >> chunk_shift) * 8);
    }
    __device__ __forceinline__ void pin() { chunk_shift = dec_pin(chunk_shift); }
    // `a`: the shared address of the lane's bytes of a staged chunk (its row's plus XL * t).
    static constexpr int XL = 32;
    __device__ __forceinline__ void load_x(u32 a, uint4 (&v)[2]) const {
        v[0] = lds128(a);
        v[1] = lds128(a + 16);
    }
    // Chunk u's codes times the activations into G (alternate k16 steps into two chains). With
    // f16, rows g + 8 (the odd registers) take their nibbles where they lie, as magic + 16 q: one
    // shift per word instead of three, and flush rescales those rows.
    static constexpr bool X16 = W4Math<T>::NIBBLE_AT_4;
    // One k16 step's A fragment from its code word, as magic + q (rows g + 8 with f16: magic + 16 q).
    __device__ __forceinline__ void widen(u32 word, u32 (&a)[4]) const {
        if constexpr (X16) {
            const u32 hi = word >> 8;
            a[0] = lop3_and_or(word, 0x000f000fu, W4Math<T>::MAGIC);
            a[1] = lop3_and_or(word, 0x00f000f0u, W4Math<T>::MAGIC);
            a[2] = lop3_and_or(hi, 0x000f000fu, W4Math<T>::MAGIC);
            a[3] = lop3_and_or(hi, 0x00f000f0u, W4Math<T>::MAGIC);
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) a[q] = lop3_and_or(word >> (4 * q), 0x000f000fu, W4Math<T>::MAGIC);
        }
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][2], float (&G)[2][TT][4]) const {
        const u32 words[4] = {r.w[u].x, r.w[u].y, r.w[u].z, r.w[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 a[4];
            widen(words[j], a);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const uint4& v = xv[tt][j >> 1];
                mma16816<T>(G[j & 1][tt], a, (j & 1) ? v.z : v.x, (j & 1) ? v.w : v.y);
            }
        }
    }
    // The same for wide batches (TT >= 4, the grouped experts' 17 to 32 rows): each token tile's
    // activations are read from the staged rows just before their MMAs, half a chunk at a time,
    // so only one 16-byte vector of them is live (registers, not ILP, bound these variants).
    template <int TT>
    __device__ __forceinline__ void mma_rows(const Regs& r, int u, const unsigned char* const (&xrow)[TT], int off,
                                             float (&G)[2][TT][4]) const {
        const u32 words[4] = {r.w[u].x, r.w[u].y, r.w[u].z, r.w[u].w};
        const int lane_off = off + (threadIdx.x & 3) * 32;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 a0[4], a1[4];
            widen(words[2 * h], a0);
            widen(words[2 * h + 1], a1);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const uint4 v = *reinterpret_cast<const uint4*>(xrow[tt] + lane_off + h * 16);
                mma16816<T>(G[0][tt], a0, v.x, v.y);
                mma16816<T>(G[1][tt], a1, v.z, v.w);
            }
        }
    }
    // acc += s * (G - (magic + z) * S) for rows g (C fragment elements 0, 1) and g + 8 (2, 3),
    // S the activation sums of tokens 2t, 2t + 1 over span s's chunks. Rows read as magic + 16 q
    // take s / 16 and magic + 16 z = 16 (magic + z) - 15 magic (both exact in f32).
    template <int TT>
    __device__ __forceinline__ void flush(const Regs& r, int s, const float (&G)[2][TT][4], const float (&S)[TT][2],
                                          float (&acc)[TT][4]) const {
        const float s0 = dec_half_lo<T>(r.p[s].x), z0 = dec_half_lo<T>(r.p[s].x >> 16);
        float s1 = dec_half_lo<T>(r.p[s].y), z1 = dec_half_lo<T>(r.p[s].y >> 16);
        if constexpr (X16) {
            s1 *= 0.0625f;
            z1 = fmaf(16.f, z1, -15.f * W4Math<T>::MAGIC_F);
        }
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sum = fmaf(-(e < 2 ? z0 : z1), S[tt][e & 1], G[0][tt][e] + G[1][tt][e]);
                acc[tt][e] = fmaf(e < 2 ? s0 : s1, sum, acc[tt][e]);
            }
    }
};

// acc += the sum of the two MMA chains: the flush of the units whose scales apply in the epilogue.
template <int TT, class A>
__device__ __forceinline__ void add_chains(const A (&G)[2][TT][4], A (&acc)[TT][4]) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] += G[0][tt][e] + G[1][tt][e];
}

// The stream of 8-bit weight fragments: a tile's chunk is 1024 B of codes (32 B per lane); scales
// are per row (and token), applied in the epilogue, so a batch is one span.
struct W8Stream {
    static constexpr int U = DEC_U, GC = DEC_U, SPANS = 1;
    static constexpr bool ZERO_POINTS = false;
    struct Regs {
        uint4 w[U][2];
    };
    struct Tile {
        const uint4* w;
    };
    const uint4* codes;
    int chunks;

    __device__ __forceinline__ Tile tile_at(int tile) const {
        return {codes + (long)tile * chunks * 64 + (threadIdx.x & 31) * 2};
    }
    __device__ __forceinline__ void fetch(const Tile& t, int c, Regs& r) const {
        const uint4* wp = t.w + c * 64;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            r.w[u][0] = ld_stream(wp + u * 64);
            r.w[u][1] = ld_stream(wp + u * 64 + 1);
        }
    }
    // The lean loop's (dec_gemv_lean): addresses linear in the chunk, from any origin org.
    static constexpr bool RELATIVE = true;
    using TileL = Tile;
    __device__ __forceinline__ TileL tile_lean(int tile, int org) const {
        return {codes + ((long)tile * chunks + org) * 64 + (threadIdx.x & 31) * 2};
    }
    __device__ __forceinline__ void pin() {}
};

// W8A8 units: INT8 fragments of two k32 steps per chunk, INT8 activations.
struct DecW8 : W8Stream {
    using X = signed char;
    using Acc = int;
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[1]) const {
        v[0] = *reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 16);
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
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const int (&G)[2][TT][4], const float (&)[TT][2],
                                          int (&acc)[TT][4]) const {
        add_chains<TT>(G, acc);
    }
    // Wide batches (TT >= 4): TT independent accumulator chains already, so no second chain, and
    // each token tile's activations are read just before their MMAs (registers, not ILP, bound
    // these variants).
    template <int TT>
    __device__ __forceinline__ void mma_direct(const Regs& r, int u, const unsigned char* const (&xrow)[TT], int off,
                                               int (&acc)[TT][4]) const {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            uint4 v[1];
            load_x(xrow[tt] + off, v);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const u32 a[4] = {r.w[u][j].x, r.w[u][j].y, r.w[u][j].z, r.w[u][j].w};
                mma_s8(acc[tt], a, j ? v[0].z : v[0].x, j ? v[0].w : v[0].y);
            }
        }
    }
};

// W8A16 units: INT8 codes in W4A16's k16 register order (a lane's 32 B are, per k16 step, a word
// of row g and one of row g + 8: pack::w8a16_slot), made exact 16-bit values in registers
// (w8_step) and multiplied with the staged 16-bit activations as W4A16's are. The row scale
// applies in the epilogue, so the flush only adds the chains.
template <class T> struct DecW8A16 : W8Stream {
    using X = T;
    using Acc = float;
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[2]) const {
        const uint4* src = reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 32);
        v[0] = src[0];
        v[1] = src[1];
    }
    static constexpr int XL = 32;  // the lean loop's: a = the lane's bytes, its row's plus XL * t
    __device__ __forceinline__ void load_x(u32 a, uint4 (&v)[2]) const {
        v[0] = lds128(a);
        v[1] = lds128(a + 16);
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][2], float (&G)[2][TT][4]) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4& w = r.w[u][j >> 1];
            u32 a[4];
            w8_step<T>((j & 1) ? w.z : w.x, (j & 1) ? w.w : w.y, a);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const uint4& v = xv[tt][j >> 1];
                mma16816<T>(G[j & 1][tt], a, (j & 1) ? v.z : v.x, (j & 1) ? v.w : v.y);
            }
        }
    }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const float (&G)[2][TT][4], const float (&)[TT][2],
                                          float (&acc)[TT][4]) const {
        add_chains<TT>(G, acc);
    }
};

// W4A8 units: a tile's chunk is 512 B of 4-bit codes (16 B per lane) that widen in registers to
// exactly DecW8's INT8 fragments (W4A8Affine), and the parameter pairs (rows g and g + 8, 8 B per
// lane, through L1: the chunks of a group share them) of the groups its two k32 steps lie in:
// one group for groups of 64 and up, two for groups of 32 (K in natural order, pack::KOrder).
// TWO_GROUPS (groups of 32) has entries of its own (`*_g32`, qlinear::w4a8_decode_kernel), so the
// common loop neither holds nor issues anything for a second pair: tested inside the loop, the
// second pair cost 1% to 4% at one token on an H100, and in one kernel beside the common loop
// (branching once) its registers still cost the common one 1% to 2%.
// Scales are per row and token as for W8A8: a batch is one span.
template <bool TWO_GROUPS> struct DecW4A8 {
    using X = signed char;
    using Acc = int;
    static constexpr int U = DEC_U, GC = DEC_U, SPANS = 1;
    static constexpr bool ZERO_POINTS = false;
    struct Regs {
        uint4 w[U];
        uint2 p[U];                      // the group of the chunk's first k32 step
        uint2 p1[TWO_GROUPS ? U : 1];    // its second step's
    };
    struct Tile {
        const uint4* w;
        const uint2* p;
    };
    const uint4* codes;
    const uint2* params;
    int chunks, groups, group_shift;  // group_shift 30: one group per row

    __device__ __forceinline__ Tile tile_at(int tile) const {
        const int lane = threadIdx.x & 31;
        return {codes + (long)tile * chunks * 32 + lane, params + (long)tile * groups * 8 + (lane >> 2)};
    }
    __device__ __forceinline__ void fetch(const Tile& t, int c, Regs& r) const {
#pragma unroll
        for (int u = 0; u < U; ++u) r.w[u] = ld_stream(t.w + (c + u) * 32);
#pragma unroll
        for (int u = 0; u < U; ++u) r.p[u] = __ldg(t.p + (((c + u) * 64) >> group_shift) * 8);
        if constexpr (TWO_GROUPS)
#pragma unroll
            for (int u = 0; u < U; ++u) r.p1[u] = __ldg(t.p + ((c + u) * 2 + 1) * 8);
    }
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[1]) const {
        v[0] = *reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 16);
    }
    // Chunk u's INT8 A registers of its two k32 steps, as DecW8's packing holds them.
    __device__ __forceinline__ void widen(const Regs& r, int u, u32 (&a)[2][4]) const {
        W4A8Affine row0(r.p[u].x), row8(r.p[u].y);
        row0.widen(r.w[u].x, a[0][0], a[0][2]);
        row8.widen(r.w[u].y, a[0][1], a[0][3]);
        if constexpr (TWO_GROUPS) {
            row0 = W4A8Affine(r.p1[u].x);
            row8 = W4A8Affine(r.p1[u].y);
        }
        row0.widen(r.w[u].z, a[1][0], a[1][2]);
        row8.widen(r.w[u].w, a[1][1], a[1][3]);
    }
    template <int TT>
    __device__ __forceinline__ void mma_direct(const Regs& r, int u, const unsigned char* const (&xrow)[TT], int off,
                                               int (&acc)[TT][4]) const {
        u32 a[2][4];
        widen(r, u, a);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            uint4 v[1];
            load_x(xrow[tt] + off, v);
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_s8(acc[tt], a[j], j ? v[0].z : v[0].x, j ? v[0].w : v[0].y);
        }
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][1], int (&G)[2][TT][4]) const {
        u32 a[2][4];
        widen(r, u, a);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
                mma_s8(G[j][tt], a[j], j ? xv[tt][0].z : xv[tt][0].x, j ? xv[tt][0].w : xv[tt][0].y);
    }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const int (&G)[2][TT][4], const float (&)[TT][2],
                                          int (&acc)[TT][4]) const {
        add_chains<TT>(G, acc);
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
                                           OUT* y, long ldy, const EPI& epi, int cta) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long first = (long)b * chunks / per_cta, last = ((long)(b + 1) * chunks - 1) / per_cta;
    const int pieces = (int)(last - first + 1);
    if (pieces == 1) {
        store_tile<TT>(acc, tile * 16, 0, M, N, y, ldy, epi);
    } else {
        A* mine = partial + ((long)tile * max_pieces + (cta - first)) * M * 16;
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
            if constexpr (IsSwiGlu<EPI>::value) {  // a gate row's sum and its up partner's
                for (int i = lane; i < M * 8; i += 32) {
                    const int m = i >> 3, r = i & 7, n = tile * 16 + r;
                    A sg = 0, su = 0;
                    for (int p = 0; p < pieces; ++p) {
                        sg += __ldcg(base + (long)p * M * 16 + m * 16 + r);
                        su += __ldcg(base + (long)p * M * 16 + m * 16 + r + 8);
                    }
                    if (n < N) y[(long)m * ldy + tile * 8 + r] = to_out(epi(sg, su, m, n), (OUT*)nullptr);
                }
            } else {
                for (int i = lane; i < M * 16; i += 32) {
                    const int m = i >> 4, n = tile * 16 + (i & 15);
                    A s = 0;
                    for (int p = 0; p < pieces; ++p) s += __ldcg(base + (long)p * M * 16 + i);
                    if (n < N) y[(long)m * ldy + n] = to_out(epi(s, m, n), (OUT*)nullptr);
                }
            }
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] = 0;
}

// The RMSNorm a one-token gemv takes over (Backend::norm_linear): its input row is
// res + delta (delta may be null), normed by weight `nw` as elementwise.cu's rms_norm does, and
// CTA 0 writes res + delta to `res_out` (another buffer: every CTA reads `res`). The dense gemv
// (gemv_dense.cu) and the normed decode gemv entries below take it.
struct RowNorm {
    const float* res;
    const float* delta;
    const float* nw;
    float* res_out;
    float eps;
};

// dec_stage_x's window for one token normed on the way in (RowNorm): the whole row's sum of
// squares, then the window's channels as X(v * (1 / sqrt(mean(v^2) + eps)) * nw),
// rms_norm_impl's arithmetic with the sum of squares in another order (as the dense gemv's
// NORM), zero past K. It runs between the grid wait and the first MMA, so every load it needs
// goes out at once: the window's first DEC_NORM_WV values a thread norms and its float4s of the
// row (DEC_NORM_RV at a time), before the first is used. Loaded a value at a time (the row in a
// plain strided loop), a one-token W4A16 decode step ran 4% slower than with the norm kernel
// before the gemv (H200, bench/results/normed-decode-20261128-h200/call1).
#define DEC_NORM_WV 8
#define DEC_NORM_RV 4
template <class X>
__device__ __forceinline__ void dec_stage_normed(unsigned char* xs, int K, int chunks, int c0, int win,
                                                 const RowNorm& norm) {
    __shared__ float scratch[32];
    const int n = win * 64, n4 = K >> 2, step = blockDim.x;
    auto channel = [&](int i) {  // window slot i's channel (cyclic from chunk c0)
        const int slot = i >> 6;
        return (c0 + slot < chunks ? c0 + slot : c0 + slot - chunks) * 64 + (i & 63);
    };
    float wv[DEC_NORM_WV], wn[DEC_NORM_WV];
#pragma unroll
    for (int j = 0; j < DEC_NORM_WV; ++j) {
        const int i = threadIdx.x + j * step, k = channel(i);
        const bool ok = i < n && k < K;
        wv[j] = ok ? norm.res[k] : 0.f;
        wn[j] = ok ? norm.nw[k] : 0.f;
        if (ok && norm.delta) wv[j] += norm.delta[k];
    }
    const bool write_res = blockIdx.x == 0 && norm.delta;
    float ss = 0.f;
    for (int base = threadIdx.x; base < n4; base += DEC_NORM_RV * step) {
        float4 a[DEC_NORM_RV], d[DEC_NORM_RV];
#pragma unroll
        for (int j = 0; j < DEC_NORM_RV; ++j) {
            const int u = base + j * step;
            if (u < n4) {
                a[j] = ld4(norm.res + 4 * u);
                if (norm.delta) d[j] = ld4(norm.delta + 4 * u);
            }
        }
#pragma unroll
        for (int j = 0; j < DEC_NORM_RV; ++j) {
            const int u = base + j * step;
            if (u < n4) {
                if (norm.delta) a[j] = make_float4(a[j].x + d[j].x, a[j].y + d[j].y, a[j].z + d[j].z, a[j].w + d[j].w);
                if (write_res) st4(norm.res_out + 4 * u, a[j]);
                ss = fmaf(a[j].x, a[j].x, ss);
                ss = fmaf(a[j].y, a[j].y, ss);
                ss = fmaf(a[j].z, a[j].z, ss);
                ss = fmaf(a[j].w, a[j].w, ss);
            }
        }
    }
    const float scale = 1.0f / sqrtf(block_sum(ss, scratch) / (float)K + norm.eps);
    X* row = reinterpret_cast<X*>(xs);
#pragma unroll
    for (int j = 0; j < DEC_NORM_WV; ++j) {
        const int i = threadIdx.x + j * step;
        if (i < n) row[i] = from_f32<X>(wv[j] * scale * wn[j]);
    }
    // Windows past DEC_NORM_WV values a thread (K past 4096 at 512 threads) read the rest now.
    for (int i = threadIdx.x + DEC_NORM_WV * step; i < n; i += step) {
        const int k = channel(i);
        float v = 0.f;
        if (k < K) v = (norm.delta ? norm.res[k] + norm.delta[k] : norm.res[k]) * scale * norm.nw[k];
        row[i] = from_f32<X>(v);
    }
}

// Stages the activations of a CTA's chunk window (chunks c0 .. c0 + win - 1 of `chunks`,
// cyclically; zero past K) in shared memory, rows `stride` bytes apart (returned), and, with
// SUMS, their sums per span of GC chunks after them, [span][token] (0 past M). Read from global
// memory inside the loop, the activations would queue behind the streamed weight loads (the L1
// returns loads in order), stalling every batch on a full memory round trip. c0 and the window
// are multiples of the batch, so spans never straddle a wrap. NORM: one token (M = 1) normed on
// the way in from `norm` (dec_stage_normed) instead of read from x.
template <int TT, int DW, int GC, bool SUMS, bool NORM, class X>
__device__ __forceinline__ int dec_stage_x(unsigned char* xs, const X* x, long ldx, int M, int K, int chunks,
                                           int c0, int win, const RowNorm& norm) {
    constexpr int XB = (int)sizeof(X), MP = TT * 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = gemv_x_stride(win, XB);
    constexpr int SEGS = 4 * XB;  // 16-byte segments a chunk
    const int segs = win * SEGS;
    if constexpr (NORM) {
        static_assert(XB == 2, "the normed window is 16-bit activations");
        dec_stage_normed<X>(xs, K, chunks, c0, win, norm);
    } else {
        for (int i = threadIdx.x; i < M * segs; i += blockDim.x) {
            const int row = i / segs, seg = i % segs, slot = seg / SEGS;
            const int c = c0 + slot < chunks ? c0 + slot : c0 + slot - chunks;
            const int k = c * 64 + (seg % SEGS) * 16 / XB;
            const bool ok = k < K;
            stage_x16(xs + row * stride + slot * SEGS * 16, seg % SEGS, x + (ok ? (long)row * ldx + k : 0), ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (SUMS) {
        float* xsum = reinterpret_cast<float*>(xs + M * stride);
        const int n = win / GC * MP;
        for (int base = warp * 4; base < n; base += DW * 4) {
            const int i = base + (lane >> 3), span = i / MP, m = i % MP;
            float v = 0.f;
            if (i < n && m < M)
#pragma unroll
                for (int cc = 0; cc < GC; ++cc)
                    v += sum8<X>(*reinterpret_cast<const uint4*>(xs + m * stride + (span * GC + cc) * 64 * XB +
                                                                 (lane & 7) * 16));
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            if (i < n && (lane & 7) == 0) xsum[i] = v;
        }
        __syncthreads();
    }
    return stride;
}

// The decode gemv's lean loop, for the variants with registers to spare (the entries pick it):
// the same units, batches, MMAs, flushes and finishes as dec_gemv's loop below, in the same
// order (so the same results), with the per-batch bookkeeping cut to what a batch needs. On
// Hopper the kernel is bound by instruction issue, and dec_gemv's batch spends a fifth of its
// instructions on the cursor, the tile-end test and addresses the compiler re-derives from the
// thread index and the kernel parameters every batch. Here a tile's addresses (weights, staged
// activations, span sums) stay in registers and a batch adds its chunk times a constant, and
// all but a piece's last batch take a path that only fetches, multiplies and advances. W4A16 at
// 8 tokens (ptxas 13.0, sm_90a): 189 instructions a batch of four chunks instead of 237 (bf16),
// 162 instead of 210 (f16). It holds a few more registers, which the variants at the
// 128-register cap (wide token tiles, the grouped experts) cannot spare: ptxas spills there.
template <int TT, int DW, bool NORM, class F, class OUT, class EPI>
__device__ __forceinline__ void dec_gemv_lean(const F& fin, const typename F::X* __restrict__ x, long ldx,
                                              OUT* __restrict__ y, long ldy, typename F::Acc* __restrict__ partial,
                                              int* __restrict__ counters, int M, int N, int K, int tiles, int chunks,
                                              int per_cta, int max_pieces, const EPI& epi, int cta,
                                              const RowNorm& norm) {
    static_assert(TT < 4, "wide token tiles multiply as dec_gemv's mma_direct / mma_rows do");
    constexpr int U = F::U, GC = F::GC;
    F f = fin;
    f.pin();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int units = (tiles + DW - 1) / DW * chunks;
    const int u0 = cta * per_cta, u1 = min(units, u0 + per_cta);
    // A warp's piece of tile b * DW + warp ends at chunk min(chunks, u1 - b * chunks) (the tile's
    // end or the CTA's). A batch is at `pos`, its chunk less `org`, and its piece ends at `end`;
    // where a tile's addresses are linear in the chunk (F::RELATIVE), org is the piece's end, so
    // end is 0, not a register; else org is 0.
    constexpr bool REL = F::RELATIVE;
    int b = u0 / chunks;
    const int c_first = u0 % chunks, e_first = min(chunks, u1 - b * chunks);
    int org = REL ? e_first : 0, pos = c_first - org, end = e_first - org;
    bool more = u0 < u1 && b * DW + warp < tiles;
    typename F::TileL tile;
    typename F::Regs ra, rb;
    if (more) {
        tile = f.tile_lean(b * DW + warp, org);
        f.fetch(tile, pos, ra);
    }
    grid_dependents_launch();
    grid_dependency_wait();

    // The CTA's activation window. A window of a whole row (per_cta >= chunks) starts at chunk 0,
    // so chunk c's slot is c in every tile; a shorter one starts at the CTA's first chunk and
    // spans at most two tiles, so the slot is c - c0 in the first and c + chunks - c0 in the
    // second. Either way a tile's slots are c plus a constant: no wrap inside a tile.
    extern __shared__ __align__(16) unsigned char xs[];
    constexpr int XB = (int)sizeof(typename F::X);
    constexpr int MP = TT * 8;
    const int win = min(chunks, per_cta), c0 = win < chunks ? c_first : 0;
    const int stride = dec_stage_x<TT, DW, GC, F::ZERO_POINTS, NORM>(xs, x, ldx, M, K, chunks, c0, win, norm);

    constexpr int XV = XB == 2 ? 2 : 1;
    typename F::Acc acc[TT][4] = {};
    // The shared addresses of the lane's activations and span sums at pos 0 of this tile (rows
    // past M read row M - 1, as in dec_gemv).
    u32 xa[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
        xa[tt] = smem_addr(xs + min(tt * 8 + g, M - 1) * stride + t * F::XL + (org - c0) * 64 * XB);
    u32 sa = smem_addr(xs + M * stride + (2 * t + (org - c0) / GC * MP) * 4);
    // Multiplies the batch at pos (register set `cur`) into acc.
    auto mult = [&](const typename F::Regs& cur) {
#pragma unroll
        for (int s = 0; s < F::SPANS; ++s) {
            typename F::Acc G[2][TT][4] = {};
#pragma unroll
            for (int uu = 0; uu < GC; ++uu) {
                const int off = (pos + s * GC + uu) * 64 * XB;
                uint4 xv[TT][XV];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) f.load_x(xa[tt] + off, xv[tt]);
                f.template mma<TT>(cur, s * GC + uu, xv, G);
            }
            float S[TT][2] = {};
            if constexpr (F::ZERO_POINTS) {
                // pos is a multiple of U, so of GC: the span's sums are at pos / GC + s.
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) {
                    const float2 v = lds64f(sa + (pos * (MP / GC) + s * MP + tt * 8) * 4);
                    S[tt][0] = v.x;
                    S[tt][1] = v.y;
                }
            }
            f.flush(cur, s, G, S, acc);
        }
    };
    // Two batches a loop trip with the register sets swapped, as in dec_gemv. All but the last
    // batch of a piece take `step`; the last one (`last`, a separate copy, so the common path has
    // no condition but the one that picks it) fetches the next tile's first batch, if any, and
    // finishes the piece.
    auto step = [&](const typename F::Regs& cur, typename F::Regs& nxt) {
        f.fetch(tile, pos + U, nxt);
        mult(cur);
        pos += U;
    };
    auto last = [&](const typename F::Regs& cur, typename F::Regs& nxt) -> bool {
        const bool nmore = (b + 1) * chunks < u1 && (b + 1) * DW + warp < tiles;
        const int e = min(chunks, u1 - (b + 1) * chunks), norg = REL ? e : 0;
        if (nmore) {
            tile = f.tile_lean((b + 1) * DW + warp, norg);
            f.fetch(tile, -norg, nxt);
        }
        mult(cur);
        dec_finish<TT>(acc, b * DW + warp, b, chunks, per_cta, max_pieces, M, N, partial, counters, y, ldy, epi, cta);
        // The next tile's slots: c plus chunks - c0 (the second tile of a window shorter than a
        // row) or c (a whole row's).
        const int shift = norg - org + (win < chunks ? chunks : 0);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) xa[tt] += shift * 64 * XB;
        sa += shift / GC * MP * 4;
        ++b;
        org = norg;
        pos = -norg;
        end = e - norg;
        return nmore;
    };
    if (more)
        for (;;) {
            if (pos + U != end)
                step(ra, rb);
            else if (!last(ra, rb))
                break;
            if (pos + U != end)
                step(rb, ra);
            else if (!last(rb, ra))
                break;
        }
}

// LEAN: run dec_gemv_lean instead (the same results; the entries choose). NORM: one token normed
// on the way in from `norm` (dec_stage_x), x unused.
template <int TT, int DW, bool LEAN = false, bool NORM = false, class F, class OUT, class EPI>
__device__ __forceinline__ void dec_gemv(const F& f, const typename F::X* __restrict__ x, long ldx,
                                         OUT* __restrict__ y, long ldy, typename F::Acc* __restrict__ partial,
                                         int* __restrict__ counters, int M, int N, int K, int tiles, int chunks,
                                         int per_cta, int max_pieces, const EPI& epi, int cta,
                                         const RowNorm& norm = RowNorm{}) {
    if constexpr (LEAN) {
        dec_gemv_lean<TT, DW, NORM>(f, x, ldx, y, ldy, partial, counters, M, N, K, tiles, chunks, per_cta,
                                    max_pieces, epi, cta, norm);
        return;
    }
    constexpr int U = F::U, GC = F::GC;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int units = (tiles + DW - 1) / DW * chunks;
    const int u0 = cta * per_cta, u1 = min(units, u0 + per_cta);
    // A position in the CTA's units: unit u is chunk c of row block b, activation window slot
    // `slot`. `chunks` and `per_cta` are multiples of U (the host's plan), so every batch is U
    // whole chunks of one tile, spans and groups line up with batches, and the steady state has no
    // per-chunk conditions: on Hopper this kernel is bound by instruction issue long before the
    // ALU or the tensor pipe, and every instruction per chunk counts. Only the last row block
    // has tiles past the end, so a warp stops at its first one.
    struct Cursor {
        int u, c, slot, b;
        typename F::Tile tile;
    };
    Cursor q{u0, u0 % chunks, 0, u0 / chunks, {}};
    bool more = q.u < u1 && q.b * DW + warp < tiles;
    typename F::Regs ra, rb;
    if (more) {
        q.tile = f.tile_at(q.b * DW + warp);
        f.fetch(q.tile, q.c, ra);
    }
    grid_dependents_launch();
    grid_dependency_wait();

    // The CTA's activation window, staged while the first weights are on their way.
    extern __shared__ __align__(16) unsigned char xs[];
    constexpr int XB = (int)sizeof(typename F::X);
    constexpr int MP = TT * 8;
    const int c0 = q.c, win = min(chunks, per_cta);
    const int stride = dec_stage_x<TT, DW, GC, F::ZERO_POINTS, NORM>(xs, x, ldx, M, K, chunks, c0, win, norm);
    const float* xsum = reinterpret_cast<const float*>(xs + M * stride);

    constexpr int XV = XB == 2 ? 2 : 1;
    typename F::Acc acc[TT][4] = {};
    // Token rows past M read row M - 1: their outputs are never stored, and an MMA column only
    // feeds its own outputs, so no load needs a predicate.
    const unsigned char* xrow[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) xrow[tt] = xs + min(tt * 8 + g, M - 1) * stride;
    // One batch: the next one's loads go out, then this one is multiplied. Two calls per loop
    // trip with the register sets swapped, so no registers are copied between batches.
    auto step = [&](typename F::Regs& cur, typename F::Regs& nxt) -> bool {
        Cursor nq = q;
        nq.u += U;
        nq.c += U;
        nq.slot = nq.slot + U == win ? 0 : nq.slot + U;
        const bool tile_ends = nq.c == chunks;
        if (tile_ends) {
            nq.c = 0;
            ++nq.b;
        }
        const bool nmore = nq.u < u1 && nq.b * DW + warp < tiles;
        if (nmore) {
            if (tile_ends) nq.tile = f.tile_at(nq.b * DW + warp);
            f.fetch(nq.tile, nq.c, nxt);
        }
        if constexpr (TT >= 4 && !F::ZERO_POINTS) {  // 8-bit-activation families: no spans to flush
#pragma unroll
            for (int uu = 0; uu < U; ++uu) f.template mma_direct<TT>(cur, uu, xrow, (q.slot + uu) * 64 * XB, acc);
        } else {
#pragma unroll
            for (int s = 0; s < F::SPANS; ++s) {
                typename F::Acc G[2][TT][4] = {};
#pragma unroll
                for (int uu = 0; uu < GC; ++uu) {
                    const int off = (q.slot + s * GC + uu) * 64 * XB;
                    if constexpr (TT >= 4) {  // W4A16 at 17 to 32 tokens (or rows an expert)
                        f.template mma_rows<TT>(cur, s * GC + uu, xrow, off, G);
                    } else {
                        uint4 xv[TT][XV];
#pragma unroll
                        for (int tt = 0; tt < TT; ++tt) f.load_x(xrow[tt] + off, xv[tt]);
                        f.template mma<TT>(cur, s * GC + uu, xv, G);
                    }
                }
                float S[TT][2] = {};
                if constexpr (F::ZERO_POINTS) {
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt) {
                        const float2 v =
                            *reinterpret_cast<const float2*>(xsum + (q.slot / GC + s) * MP + tt * 8 + 2 * t);
                        S[tt][0] = v.x;
                        S[tt][1] = v.y;
                    }
                }
                f.flush(cur, s, G, S, acc);
            }
        }
        if (tile_ends || nq.u == u1)
            dec_finish<TT>(acc, q.b * DW + warp, q.b, chunks, per_cta, max_pieces, M, N, partial, counters, y,
                           ldy, epi, cta);
        q = nq;
        return nmore;
    };
    while (more && step(ra, rb)) more = step(rb, ra);
}

// Entry points: dec1 / dec2 / dec4 = 8 / 16 / 32 tokens (dec4: W4A16 and the INT8 families),
// `_h` writes the model dtype instead of f32. The
// Hopper tier only (measured there; the mma.sync gemv serves earlier GPUs).
#if !defined(DEC_NO_ENTRIES) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
#define DEC_WARPS 16
// dec_gemv_lean for up to 16 tokens (TT <= 2), but W4A16 f16 with groups of 64 at 16 tokens:
// there ptxas (CUDA 13.0) spills 24 bytes with the lean loop against 8 with dec_gemv's. Four token
// tiles (32 tokens) keep dec_gemv's loop, whose mma_rows reads one tile's activations at a time.
#define W4A16_DEC_ENTRY(NAME, T, TT, GC, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const uint2* params, const T* x, long ldx, OUT* y, long ldy, float* partial, \
        int* counters, int M, int N, int K, int tiles, int chunks, int groups, int group_len,          \
        int group_shift, int per_cta, int max_pieces) {                                                \
        const int chunk_shift = groups == 1 ? 30 : group_shift - 6;                                    \
        constexpr bool lean = TT < 4 && (TT == 1 || GC == 2 || !W4Math<T>::NIBBLE_AT_4);              \
        dec_gemv<TT, DEC_WARPS, lean>(DecW4<T, GC>{codes, params, chunks, groups, chunk_shift}, x, ldx, y, \
                                      ldy, partial, counters, M, N, K, tiles, chunks, per_cta,          \
                                      max_pieces, W4Epilogue{}, blockIdx.x);                            \
    }
// Groups of 128 channels or a larger power of two, or one group per row; `_g64` groups of 64.
#define NIBBLE_W4A16_DEC(SUFFIX, T)                            \
    W4A16_DEC_ENTRY(w4a16_dec1_##SUFFIX, T, 1, 2, float)       \
    W4A16_DEC_ENTRY(w4a16_dec2_##SUFFIX, T, 2, 2, float)       \
    W4A16_DEC_ENTRY(w4a16_dec1_h_##SUFFIX, T, 1, 2, T)         \
    W4A16_DEC_ENTRY(w4a16_dec2_h_##SUFFIX, T, 2, 2, T)         \
    W4A16_DEC_ENTRY(w4a16_dec1_g64_##SUFFIX, T, 1, 1, float)   \
    W4A16_DEC_ENTRY(w4a16_dec2_g64_##SUFFIX, T, 2, 1, float)   \
    W4A16_DEC_ENTRY(w4a16_dec1_h_g64_##SUFFIX, T, 1, 1, T)     \
    W4A16_DEC_ENTRY(w4a16_dec2_h_g64_##SUFFIX, T, 2, 1, T)     \
    W4A16_DEC_ENTRY(w4a16_dec4_##SUFFIX, T, 4, 2, float)       \
    W4A16_DEC_ENTRY(w4a16_dec4_h_##SUFFIX, T, 4, 2, T)         \
    W4A16_DEC_ENTRY(w4a16_dec4_g64_##SUFFIX, T, 4, 1, float)   \
    W4A16_DEC_ENTRY(w4a16_dec4_h_g64_##SUFFIX, T, 4, 1, T)
NIBBLE_BOTH_DTYPES(NIBBLE_W4A16_DEC)

// One token with the RMSNorm before the layer taken over (Backend::norm_linear, qlinear::
// NormedDecode): the activations are normed from the f32 residual row on the way into the
// window, f32 outputs.
#define W4A16_DEC_NORM_ENTRY(NAME, T, GC)                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const uint2* params, const float* res, const float* delta, const float* nw, \
        float* res_out, float eps, float* y, long ldy, float* partial, int* counters, int M, int N,      \
        int K, int tiles, int chunks, int groups, int group_len, int group_shift, int per_cta,          \
        int max_pieces) {                                                                              \
        const int chunk_shift = groups == 1 ? 30 : group_shift - 6;                                    \
        dec_gemv<1, DEC_WARPS, true, true>(DecW4<T, GC>{codes, params, chunks, groups, chunk_shift},     \
                                           (const T*)nullptr, 0, y, ldy, partial, counters, M, N, K,     \
                                           tiles, chunks, per_cta, max_pieces, W4Epilogue{}, blockIdx.x, \
                                           RowNorm{res, delta, nw, res_out, eps});                       \
    }
#define NIBBLE_W4A16_DEC_NORM(SUFFIX, T)                    \
    W4A16_DEC_NORM_ENTRY(w4a16_dec1_norm_##SUFFIX, T, 2)    \
    W4A16_DEC_NORM_ENTRY(w4a16_dec1_norm_g64_##SUFFIX, T, 1)
NIBBLE_BOTH_DTYPES(NIBBLE_W4A16_DEC_NORM)

// W8A8 and W4A8 keep dec_gemv's loop: with the lean one (A/B on an H200 and an H100, 2026-11-26,
// BENCHMARKS' W8A16 section) W4A8 took 3% to 7% longer on the two large layers at 1 to 16 tokens
// and W8A8 ran level (to 6% slower on 6144x4096 at 16 tokens); W8A16 gained up to 1.11x.
// WRAP: plain_epilogue or swiglu_epilogue, as for W4A8 below.
#define W8A8_DEC_ENTRY(NAME, TT, OUT, WRAP)                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const float* sw, const signed char* x, long ldx, const float* sx, OUT* y,  \
        long ldy, int* partial, int* counters, int M, int N, int K, int tiles, int chunks, int per_cta, \
        int max_pieces) {                                                                              \
        dec_gemv<TT, DEC_WARPS, false>(DecW8{{codes, chunks}}, x, ldx, y, ldy, partial, counters, M, N,    \
                                         K, tiles, chunks, per_cta, max_pieces, WRAP(W8Epilogue{sx, sw}), \
                                         blockIdx.x);                                                   \
    }
// dec4: 32 tokens, the INT8 families only (8-token-tile batches measured slower than the 64-token
// wgmma tiles on an H200: 46 against 28 µs on 6144x4096 W4A8 at M = 64).
#define NIBBLE_W8A8_DEC(SUFFIX, OUT, WRAP)                \
    W8A8_DEC_ENTRY(w8a8_dec1_##SUFFIX, 1, OUT, WRAP)   \
    W8A8_DEC_ENTRY(w8a8_dec2_##SUFFIX, 2, OUT, WRAP)   \
    W8A8_DEC_ENTRY(w8a8_dec4_##SUFFIX, 4, OUT, WRAP)
NIBBLE_W8A8_DEC(f32, float, plain_epilogue)
NIBBLE_W8A8_DEC(bf16, __nv_bfloat16, plain_epilogue)
NIBBLE_W8A8_DEC(f16, __half, plain_epilogue)
NIBBLE_W8A8_DEC(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)
NIBBLE_W8A8_DEC(swiglu_f16, __half, swiglu_epilogue)

#define W8A16_DEC_ENTRY(NAME, T, TT, OUT)                                                           \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const float* sw, const T* x, long ldx, OUT* y, long ldy, float* partial,   \
        int* counters, int M, int N, int K, int tiles, int chunks, int per_cta, int max_pieces) {      \
        dec_gemv<TT, DEC_WARPS, true>(DecW8A16<T>{{codes, chunks}}, x, ldx, y, ldy, partial, counters, M, \
                                      N, K, tiles, chunks, per_cta, max_pieces, RowScaleEpilogue{sw},   \
                                      blockIdx.x);                                                      \
    }
#define NIBBLE_W8A16_DEC(SUFFIX, T)                      \
    W8A16_DEC_ENTRY(w8a16_dec1_##SUFFIX, T, 1, float)    \
    W8A16_DEC_ENTRY(w8a16_dec2_##SUFFIX, T, 2, float)    \
    W8A16_DEC_ENTRY(w8a16_dec1_h_##SUFFIX, T, 1, T)      \
    W8A16_DEC_ENTRY(w8a16_dec2_h_##SUFFIX, T, 2, T)
NIBBLE_BOTH_DTYPES(NIBBLE_W8A16_DEC)

// WRAP: plain_epilogue, or swiglu_epilogue for a gate/up pair packed interleaved (qgemm.cu,
// SwiGluEpilogue), which writes silu(gate) * up in the model dtype.
#define W4A8_DEC_ENTRY(NAME, TT, OUT, WRAP, TWO)                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const uint2* params, const float* sw, const signed char* x, long ldx,     \
        const float* sx, OUT* y, long ldy, int* partial, int* counters, int M, int N, int K, int tiles, \
        int chunks, int groups, int group_shift, int per_cta, int max_pieces) {                       \
        dec_gemv<TT, DEC_WARPS, false>(DecW4A8<TWO>{codes, params, chunks, groups, group_shift}, x, ldx, \
                                         y, ldy, partial, counters, M, N, K, tiles, chunks, per_cta,    \
                                         max_pieces, WRAP(W8Epilogue{sx, sw}), blockIdx.x);            \
    }
#define NIBBLE_W4A8_DEC(SUFFIX, OUT, WRAP)                           \
    W4A8_DEC_ENTRY(w4a8_dec1_##SUFFIX, 1, OUT, WRAP, false)       \
    W4A8_DEC_ENTRY(w4a8_dec2_##SUFFIX, 2, OUT, WRAP, false)       \
    W4A8_DEC_ENTRY(w4a8_dec4_##SUFFIX, 4, OUT, WRAP, false)       \
    W4A8_DEC_ENTRY(w4a8_dec1_g32_##SUFFIX, 1, OUT, WRAP, true)    \
    W4A8_DEC_ENTRY(w4a8_dec2_g32_##SUFFIX, 2, OUT, WRAP, true)    \
    W4A8_DEC_ENTRY(w4a8_dec4_g32_##SUFFIX, 4, OUT, WRAP, true)
NIBBLE_W4A8_DEC(f32, float, plain_epilogue)
NIBBLE_W4A8_DEC(bf16, __nv_bfloat16, plain_epilogue)
NIBBLE_W4A8_DEC(f16, __half, plain_epilogue)
NIBBLE_W4A8_DEC(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)
NIBBLE_W4A8_DEC(swiglu_f16, __half, swiglu_epilogue)
#endif

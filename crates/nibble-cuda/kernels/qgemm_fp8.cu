// FP8 W8A8 GEMMs: e4m3 weights per output channel, e4m3 activations per token, the f32 scales in
// the epilogue (nibble_precision::reference, "FP8 x FP8"; W8Epilogue). Weights are plain row-major
// e4m3 rows (pack.rs, PackedFp8: rows padded to 16, K to 64).
//
// Decode gemv (DecFp8, up to 32 tokens): qgemv.cu's persistent stream-K kernel, its mma.sync
// m16n8k32 e4m3 fragments read straight from the rows: lane (g, t) streams 16 bytes of rows g and
// g + 8 at channel 16t of each 64-channel chunk, the channels it also reads of the staged
// activations, so k32 step j multiplies words 2j, 2j + 1 of both (pack::fp8_fragment_channel).
//
// wgmma tier (WgqFp8, 128- or 64-token tiles, sm_90a): qgemm_wgmma.cu's warp-specialized pipeline
// (a TMA producer warpgroup, two consumer warpgroups of 64 weight rows each) with BOTH operands in
// shared memory: the producer's TMA copies a 128-row x 128-byte weight box per stage, 128-byte
// swizzled like the token tile, and each consumer issues four m64nTOKk32 e4m3 wgmmas from two SW128
// K-major descriptors. No weight bytes pass through registers and nothing is shuffled.
//
// Accumulation: Hopper's FP8 tensor cores add the products inside an MMA with fewer bits than f32
// (about 14, DeepSeek-V3 §3.3.2), so long sums would drift from the reference's f32 sum. Both
// kernels promote: every 128 products go into a zeroed f32 fragment that is then added to the f32
// accumulator on the CUDA cores, as cuBLAS does without fast accumulation (`torch._scaled_mm`'s
// default). Each wgmma consumer waits for its stage's wgmmas and adds their fragment at once
// (RETIRE_AT_ONCE). (Until 2026-11-27 the consumers alternated two fragments, adding the last stage's while the next
// one's wgmmas ran; reading a fragment with wgmmas in flight made ptxas serialize every wgmma,
// C7514, each waiting for the one before; with the wait first, 0.72x -> 0.85x of
// `torch._scaled_mm` at M >= 1024 on an H100.) Both consumers still wait on the same stage and
// retire together; taking turns to issue instead (FlashAttention-3's ping-pong) measured 0.95x at
// M >= 1024 on an H100 and was removed (BENCHMARKS.md, issue 18). Accumulator plus fragment is
// TOK registers a thread:
// 128-token tiles at most (256 would leave no registers for the rest).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // (host pass: bench/probe)

__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Decode units over row-major rows: a tile's chunk is 16 B of rows g and g + 8 per lane (1 KB per
// tile, as W8A8's packed chunk). A chain G[j] takes k32 step j of a batch's four chunks (128
// products) before flush adds it to acc; the wide batches promote each chunk's 64.
struct DecFp8 {
    using X = unsigned char;
    using Acc = float;
    static constexpr int U = DEC_U, GC = DEC_U, SPANS = 1;
    static constexpr bool ZERO_POINTS = false;
    struct Regs {
        uint4 w[U][2];  // [chunk][row g, row g + 8]
    };
    struct Tile {
        const uint4* w;  // row g's bytes 16t.. of chunk 0
    };
    const uint4* codes;
    int chunks;  // rows are chunks * 64 bytes: 4 * chunks uint4

    __device__ __forceinline__ Tile tile_at(int tile) const {
        const int lane = threadIdx.x & 31;
        return {codes + ((long)tile * 16 + (lane >> 2)) * chunks * 4 + (lane & 3)};
    }
    __device__ __forceinline__ void fetch(const Tile& t, int c, Regs& r) const {
        const uint4* wp = t.w + c * 4;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            r.w[u][0] = ld_stream(wp + u * 4);
            r.w[u][1] = ld_stream(wp + u * 4 + (long)8 * chunks * 4);
        }
    }
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[1]) const {
        v[0] = *reinterpret_cast<const uint4*>(row + (threadIdx.x & 3) * 16);
    }
    // k32 step j of chunk u: rows g, g + 8 words 2j (a0, a1) and 2j + 1 (a2, a3).
    __device__ __forceinline__ static void frag(const Regs& r, int u, int j, u32 (&a)[4]) {
        const uint4 lo = r.w[u][0], hi = r.w[u][1];
        a[0] = j ? lo.z : lo.x;
        a[1] = j ? hi.z : hi.x;
        a[2] = j ? lo.w : lo.y;
        a[3] = j ? hi.w : hi.y;
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][1], float (&G)[2][TT][4]) const {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            u32 a[4];
            frag(r, u, j, a);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
                mma_e4m3(G[j][tt], a, j ? xv[tt][0].z : xv[tt][0].x, j ? xv[tt][0].w : xv[tt][0].y);
        }
    }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const float (&G)[2][TT][4], const float (&)[TT][2],
                                          float (&acc)[TT][4]) const {
        add_chains<TT>(G, acc);
    }
    template <int TT>
    __device__ __forceinline__ void mma_direct(const Regs& r, int u, const unsigned char* const (&xrow)[TT], int off,
                                               float (&acc)[TT][4]) const {
        u32 a[2][4];
        frag(r, u, 0, a[0]);
        frag(r, u, 1, a[1]);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            uint4 v[1];
            load_x(xrow[tt] + off, v);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_e4m3(d, a[0], v[0].x, v[0].y);
            mma_e4m3(d, a[1], v[0].z, v[0].w);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[tt][e] += d[e];
        }
    }
};

#if !defined(DEC_NO_ENTRIES)
// WRAP: plain_epilogue, or swiglu_epilogue for a gate/up pair packed interleaved (qgemm.cu,
// SwiGluEpilogue), which writes silu(gate) * up in the model dtype.
#define FP8_DEC_ENTRY(NAME, TT, OUT, WRAP)                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const float* sw, const unsigned char* x, long ldx, const float* sx, OUT* y, \
        long ldy, float* partial, int* counters, int M, int N, int K, int tiles, int chunks, int per_cta, \
        int max_pieces) {                                                                              \
        dec_gemv<TT, DEC_WARPS>(DecFp8{codes, chunks}, x, ldx, y, ldy, partial, counters, M, N, K,     \
                                tiles, chunks, per_cta, max_pieces, WRAP(W8Epilogue{sx, sw}), blockIdx.x); \
    }
#define NIBBLE_FP8_DEC(SUFFIX, OUT, WRAP)              \
    FP8_DEC_ENTRY(fp8_dec1_##SUFFIX, 1, OUT, WRAP)   \
    FP8_DEC_ENTRY(fp8_dec2_##SUFFIX, 2, OUT, WRAP)   \
    FP8_DEC_ENTRY(fp8_dec4_##SUFFIX, 4, OUT, WRAP)
NIBBLE_FP8_DEC(f32, float, plain_epilogue)
NIBBLE_FP8_DEC(bf16, __nv_bfloat16, plain_epilogue)
NIBBLE_FP8_DEC(f16, __half, plain_epilogue)
NIBBLE_FP8_DEC(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)
NIBBLE_FP8_DEC(swiglu_f16, __half, swiglu_epilogue)
#endif
#endif  // sm_90

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the wgmma tier (sm_90a)
// d (64 rows x N tokens, f32) = A (64 weight rows x 32 K, descriptor) x B (descriptor)
// + (SCALE_D ? d : 0).
template <int SCALE_D> __device__ __forceinline__ void wgmma_e4m3(float (&d)[16][4], u64 adesc, u64 bdesc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(adesc), "l"(bdesc), "n"(SCALE_D));
}
template <int SCALE_D> __device__ __forceinline__ void wgmma_e4m3(float (&d)[8][4], u64 adesc, u64 bdesc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(adesc), "l"(bdesc), "n"(SCALE_D));
}

// A stage is 128 K: the token tile (TOK rows x 128 B) then the weight box (128 rows x 128 B), both
// 128-byte swizzled; consumer warpgroup w reads weight rows 64w .. 64w + 63.
template <int TOK> struct WgqFp8 {
    static constexpr int STAGES = TOK == 128 ? 6 : 8;
    static constexpr int X_BYTES = TOK * 128;
    static constexpr int STAGE = X_BYTES + 128 * 128;
    static constexpr int K_PER_STAGE = 128;
    static constexpr bool RETIRE_AT_ONCE = true;  // (wgmma_gemm's RetiresAtOnce)
    static constexpr bool LAUNCH_EARLY = TOK == 64;  // (wgmma_gemm's LaunchesEarly)
    using Acc = float;
    using Regs = float[TOK / 8][4];  // a stage's promotion fragment
    const TmaMap* codes;             // [rows][chunks * 64 B], boxes of 128 rows x 128 B
    int tiles, chunks;

    __device__ int stages() const { return (chunks + 1) / 2; }
    __device__ u32 weight_bytes() const { return 128 * 128; }  // TMA counts zero-filled bytes too
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const { tma_load_2d(w, codes, c * 128, tile0 * 16, bar); }
    __device__ void load_a(const unsigned char*, int, Regs&) const {}
    // Into `t` from zero; a stage missing its second chunk still issues four wgmmas (TMA
    // zero-fills codes and tokens past K).
    __device__ void mma(float (&)[TOK / 8][4], Regs& t, u32 xs, int) const {
        const u32 ws = xs + X_BYTES + (threadIdx.x >> 7) * 64 * 128;
        wgmma_e4m3<0>(t, sw128_desc(ws), sw128_desc(xs));
#pragma unroll
        for (int j = 1; j < 4; ++j) wgmma_e4m3<1>(t, sw128_desc(ws + 32 * j), sw128_desc(xs + 32 * j));
    }
    // The retired stage's fragment into the accumulator.
    __device__ void retire(float (&acc)[TOK / 8][4], Regs& t) const {
        fence_acc(t);
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] += t[j][e];
    }
};

// SPLITS: whether the entry compiles the split path; `fp8_wgmma128w_*` are the 128-token tiles
// without it, for layers with a tile an SM or more (qlinear::launch_wgmma), where the split path
// only costs (1 to 3% on the 8-bit 128-token kernels, BENCHMARKS.md).
#define FP8_WGMMA_ENTRY(NAME, TOK, SPLITS, OUT, WRAP)                                                 \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const float* __restrict__ sw, const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M, \
        int N, int tiles, int chunks, int splits, float* __restrict__ partial, int* __restrict__ counters) { \
        wgmma_gemm<TOK, SPLITS>(&xmap, WgqFp8<TOK>{&wmap, tiles, chunks}, y, ldy, M, N, splits, partial, \
                                counters, WRAP(W8Epilogue{sx, sw}));                                  \
    }
#define FP8_WGMMA(OUTNAME, OUT, WRAP)                                   \
    FP8_WGMMA_ENTRY(fp8_wgmma128_##OUTNAME, 128, true, OUT, WRAP)      \
    FP8_WGMMA_ENTRY(fp8_wgmma128w_##OUTNAME, 128, false, OUT, WRAP)    \
    FP8_WGMMA_ENTRY(fp8_wgmma64_##OUTNAME, 64, true, OUT, WRAP)
FP8_WGMMA(f32, float, plain_epilogue)
FP8_WGMMA(f16, __half, plain_epilogue)
FP8_WGMMA(bf16, __nv_bfloat16, plain_epilogue)
FP8_WGMMA(swiglu_f16, __half, swiglu_epilogue)
FP8_WGMMA(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)

#endif  // sm_90a

// FP8 W8A8 GEMMs (e4m3 weights per output channel, e4m3 activations per token, f32 scales applied
// in the epilogue: nibble_precision::reference, "FP8 x FP8"), on the W8A8 machinery: the same
// packed fragments (pack.rs packs e4m3 bit patterns where W8A8 packs INT8), the same persistent
// decode gemv (qgemv.cu, up to 32 tokens) and the same warp-specialized wgmma pipeline
// (qgemm_wgmma.cu: TMA producer warpgroup, two consumer warpgroups with the weights as the register
// A operand, tokens the SW128 K-major shared-memory B operand). Only the MMA and the accumulation
// differ.
//
// Accumulation: Hopper's FP8 tensor cores add products inside an MMA with fewer bits than f32
// (about 14, DeepSeek-V3 §3.3.2), so long sums would drift from the reference's f32 sum. Both
// kernels promote: every 128 products go into a zeroed f32 fragment (one stage's four k32 wgmmas,
// or a decode batch's chain of four k32 mma.sync steps) that is then added to the f32 accumulator on
// the CUDA cores, the way cuBLAS does without fast accumulation (`torch._scaled_mm`'s default).
// Promotion doubles the accumulator registers, so the wgmma tiles are 128 or 64 tokens (a 256-token
// tile's 128 + 128 f32 registers do not fit a consumer's 232), and a consumer waits for its own
// stage's wgmmas before it adds them; the other consumer warpgroup keeps the tensor cores busy.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // (host pass: bench/probe)

__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Decode units as DecW8's (1024 B of e4m3 codes per tile and chunk, 32 B per lane). A chain G[j]
// takes the k32 steps j of a batch's four chunks (128 products) before flush adds it to acc.
struct DecFp8 : DecW8 {
    using X = unsigned char;
    using Acc = float;
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][1], float (&G)[2][TT][4]) const {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 a[4] = {r.w[u][j].x, r.w[u][j].y, r.w[u][j].z, r.w[u][j].w};
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
                mma_e4m3(G[j][tt], a, j ? xv[tt][0].z : xv[tt][0].x, j ? xv[tt][0].w : xv[tt][0].y);
        }
    }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const float (&G)[2][TT][4], const float (&)[TT][2],
                                          float (&acc)[TT][4]) const {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[tt][e] += G[0][tt][e] + G[1][tt][e];
    }
    // Wide batches: a chunk's two k32 steps (64 products) into a zeroed fragment per token tile.
    template <int TT>
    __device__ __forceinline__ void mma_direct(const Regs& r, int u, const unsigned char* const (&xrow)[TT], int off,
                                               float (&acc)[TT][4]) const {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            uint4 v[1];
            load_x(xrow[tt] + off, v);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const u32 a[4] = {r.w[u][j].x, r.w[u][j].y, r.w[u][j].z, r.w[u][j].w};
                mma_e4m3(d, a, j ? v[0].z : v[0].x, j ? v[0].w : v[0].y);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[tt][e] += d[e];
        }
    }
};

#if !defined(DEC_NO_ENTRIES)
#define FP8_DEC_ENTRY(NAME, TT, OUT)                                                                \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(                             \
        const uint4* codes, const float* sw, const unsigned char* x, long ldx, const float* sx, OUT* y, \
        long ldy, float* partial, int* counters, int M, int N, int K, int tiles, int chunks, int per_cta, \
        int max_pieces) {                                                                              \
        dec_gemv<TT, DEC_WARPS>(DecFp8{{codes, chunks}}, x, ldx, y, ldy, partial, counters, M, N, K,   \
                                tiles, chunks, per_cta, max_pieces, W8Epilogue{sx, sw});               \
    }
#define NIBBLE_FP8_DEC(SUFFIX, OUT)              \
    FP8_DEC_ENTRY(fp8_dec1_##SUFFIX, 1, OUT)   \
    FP8_DEC_ENTRY(fp8_dec2_##SUFFIX, 2, OUT)   \
    FP8_DEC_ENTRY(fp8_dec4_##SUFFIX, 4, OUT)
NIBBLE_FP8_DEC(f32, float)
NIBBLE_FP8_DEC(bf16, __nv_bfloat16)
NIBBLE_FP8_DEC(f16, __half)
#endif
#endif  // sm_90

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the wgmma tier (sm_90a)
// d (64 rows x N tokens, f32) = A (this warp's 16 rows x 32 K of e4m3, registers) x B (descriptor)
// + (SCALE_D ? d : 0).
template <int SCALE_D> __device__ __forceinline__ void wgmma_e4m3(float (&d)[16][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SCALE_D));
}
template <int SCALE_D> __device__ __forceinline__ void wgmma_e4m3(float (&d)[8][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SCALE_D));
}

// A stage as WgqW8's (128 K: two packed chunks per weight tile, four k32 wgmmas), promoted: the
// stage's wgmmas fill a zeroed fragment, which is added to the accumulator once they retire.
template <int TOK> struct WgqFp8 : WgqW8<TOK> {
    static_assert(TOK <= 128, "a 256-token tile's promotion fragment does not fit the registers");
    using Acc = float;
    __device__ void mma(float (&acc)[TOK / 8][4], const u32 (&a)[WgqW8<TOK>::A_REGS], u32 xs, int) const {
        float t[TOK / 8][4];
        wgmma_e4m3<0>(t, a, sw128_desc(xs));
#pragma unroll
        for (int j = 1; j < 4; ++j) wgmma_e4m3<1>(t, a + 4 * j, sw128_desc(xs + 32 * j));
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(t);
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] += t[j][e];
    }
};

#define FP8_WGMMA_ENTRY(NAME, TOK, OUT)                                                               \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const float* __restrict__ sw, const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M, \
        int N, int tiles, int chunks, int splits, float* __restrict__ partial, int* __restrict__ counters) { \
        wgmma_gemm<TOK, TOK == 64>(&xmap, WgqFp8<TOK>{{&wmap, tiles, chunks}}, y, ldy, M, N, splits, partial, \
                                   counters, W8Epilogue{sx, sw});                                     \
    }
#define FP8_WGMMA(OUTNAME, OUT)                            \
    FP8_WGMMA_ENTRY(fp8_wgmma128_##OUTNAME, 128, OUT)     \
    FP8_WGMMA_ENTRY(fp8_wgmma64_##OUTNAME, 64, OUT)
FP8_WGMMA(f32, float)
FP8_WGMMA(f16, __half)
FP8_WGMMA(bf16, __nv_bfloat16)

#endif  // sm_90a

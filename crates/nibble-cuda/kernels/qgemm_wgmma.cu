// Quantized GEMMs, wgmma tier (sm_90a: Hopper): the large-M kernels of W4A16, W8A16, W8A8 and W4A8, for
// the same packed weights as the mma.sync tier and the decode gemv (qgemm.cu, src/pack.rs). TurboMind §4 (packed
// fragments, dequantization in registers) and QServe §4-5 (INT8 GEMM, fused scales) taken from
// mma.sync to wgmma with TMA and warp specialization.
//
// Tiling: persistent CTAs (at most one per SM) walk output tiles of 128 weight rows x TOK tokens
// (256, or 128 for few tokens, or 64 for batches of 17 to 64; the 64- and 128-token tiles also
// split K across SMs when a layer has fewer tiles than SMs). Two consumer warpgroups own 64 rows
// each and issue
// wgmma.m64nTOK (k32 for INT8, k16 for f16/bf16) over all the tile's tokens; warp w's 16 rows are
// packed tile tile0 + w. A third warpgroup is the producer (one thread of it issues the copies).
//
// Pipeline: F::STAGES shared-memory stages on full/empty mbarrier pairs. The producer waits for a
// stage to be empty, then fills it with TMA tensor copies: the tokens' tile (TOK rows x 128 bytes
// of K a box; W4A16's 128-channel stages take two), 128-byte swizzled (the layout wgmma reads with
// a SW128 K-major descriptor), and the 8 weight tiles' packed bytes for that K (and the 4-bit
// formats' group parameters), one box each; it runs on
// into the next tile while the consumers store this one. Consumers wait for the stage, load and
// convert their A fragments from it into one of two register sets, issue the stage's wgmmas and keep them in flight while the next stage is
// converted into the other set (wait_group 1); a stage goes back to the producer once its wgmmas
// retire. The loop runs two stages per iteration with no condition inside: ptxas serializes
// register-A wgmmas (C7513) when it cannot see which registers an in-flight wgmma still reads.
//
// Operands: weights are the register A operand (a wgmma A fragment per warp is the mma.sync
// m16n8k{16,32} A fragment pack.rs derives), tokens the shared-memory B operand in natural K
// order, as TMA loads them. The INT8 fragments (W8A8, W4A8, COMET) are packed in that order
// (pack::KOrder::Natural) and go to wgmma as loaded. The 16-bit ones (W4A16, W8A16) permute K
// within each 64-channel chunk so the decode kernels read activations as 16-byte vectors (lane t
// holds channels 16t .. 16t+15), so each quad of lanes transposes them back (two shuffles per
// value pair, quad_transpose). W4A16 dequantizes first, exactly as the mma.sync tier:
// (magic + q - (magic + z)) * s with one rounding, so results match it bit for bit up to f32
// summation order.
// Epilogue: from the accumulators through a warp's 512 bytes of shared memory into 16-byte
// stores (store_tile_staged), with the scales (W8A8, W4A8, FP8, W8A16) and SwiGLU fused.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (host pass: bench/probe)

#define WGQ_THREADS 384                 // two consumer warpgroups and a producer warpgroup
// Token blocks a column of tiles walks before the next weights. At M = 8192 on an H200, 8 against
// 16: 28672x4096 W8A8 1535 against 1611 µs, W4A16 3073 against 3156; 4096x14336 1-2% (fewer
// tokens live in L2; bench/probe/wgmma_raster_probe.sh). M = 1024 does not change.
#ifndef WGQ_RASTER  // (overridable only by bench/probe)
#define WGQ_RASTER 8
#endif
// Registers per thread after setmaxnreg: each SM sub-partition (16384 registers) holds one warp of
// each warpgroup, 40 + 2 x 232 <= 512 per lane. 168 for all (the launch bound) would serialize
// the consumers' wgmmas (ptxas C7512).
#define WGQ_PRODUCER_REGS 40
#define WGQ_CONSUMER_REGS 232

// Lanes t = 0..3 of a quad hold rows of a 4x4 matrix v (v[j] = lane t's column j); afterwards
// lane t holds column t: v[j] = lane j's old v[t]. Two butterfly rounds of two shuffles.
__device__ __forceinline__ void quad_transpose(u32& v0, u32& v1, u32& v2, u32& v3) {
    const bool b0 = threadIdx.x & 1, b1 = threadIdx.x & 2;
    u32 s0 = b0 ? v0 : v1, s1 = b0 ? v2 : v3;
    s0 = __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    if (b0) { v0 = s0; v2 = s1; } else { v1 = s0; v3 = s1; }
    u32 u0 = b1 ? v0 : v2, u1 = b1 ? v1 : v3;
    u0 = __shfl_xor_sync(0xffffffffu, u0, 2);
    u1 = __shfl_xor_sync(0xffffffffu, u1, 2);
    if (b1) { v0 = u0; v1 = u1; } else { v2 = u0; v3 = u1; }
}

// A chunk's 16-bit A registers in the packer's mma.sync order (src[j] = k16 step j's registers:
// lane t's channels 16t + 4j + 2q of rows g + 8h in register 2q + h) transposed per quad into
// the natural K order wgmma reads: a[4J + 2Q + h] must hold channels 16J + 8Q + 2t, which lane J
// held in step 2Q + t / 2, register 2 (t % 2) + h.
__device__ __forceinline__ void k16_regs_to_k_order(u32 (&src)[4][4], u32 (&a)[16]) {
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 x0 = src[2 * q][h], x1 = src[2 * q][2 + h], x2 = src[2 * q + 1][h], x3 = src[2 * q + 1][2 + h];
            quad_transpose(x0, x1, x2, x3);
            a[2 * q + h] = x0;
            a[4 + 2 * q + h] = x1;
            a[8 + 2 * q + h] = x2;
            a[12 + 2 * q + h] = x3;
        }
}

// wgmma with A from registers, one overload per token count (N = 256, 128, 64) and A/B type; the
// accumulator array's extent picks the shape.
// d (64 rows x 256 tokens, i32) += A (this warp's 16 rows x 32 K in registers) x B (descriptor).
__device__ __forceinline__ void wgmma_s8(int (&d)[32][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3]), "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3]), "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3]), "+r"(d[10][0]), "+r"(d[10][1]), "+r"(d[10][2]), "+r"(d[10][3]), "+r"(d[11][0]), "+r"(d[11][1]), "+r"(d[11][2]), "+r"(d[11][3]), "+r"(d[12][0]), "+r"(d[12][1]), "+r"(d[12][2]), "+r"(d[12][3]), "+r"(d[13][0]), "+r"(d[13][1]), "+r"(d[13][2]), "+r"(d[13][3]), "+r"(d[14][0]), "+r"(d[14][1]), "+r"(d[14][2]), "+r"(d[14][3]), "+r"(d[15][0]), "+r"(d[15][1]), "+r"(d[15][2]), "+r"(d[15][3]), "+r"(d[16][0]), "+r"(d[16][1]), "+r"(d[16][2]), "+r"(d[16][3]), "+r"(d[17][0]), "+r"(d[17][1]), "+r"(d[17][2]), "+r"(d[17][3]), "+r"(d[18][0]), "+r"(d[18][1]), "+r"(d[18][2]), "+r"(d[18][3]), "+r"(d[19][0]), "+r"(d[19][1]), "+r"(d[19][2]), "+r"(d[19][3]), "+r"(d[20][0]), "+r"(d[20][1]), "+r"(d[20][2]), "+r"(d[20][3]), "+r"(d[21][0]), "+r"(d[21][1]), "+r"(d[21][2]), "+r"(d[21][3]), "+r"(d[22][0]), "+r"(d[22][1]), "+r"(d[22][2]), "+r"(d[22][3]), "+r"(d[23][0]), "+r"(d[23][1]), "+r"(d[23][2]), "+r"(d[23][3]), "+r"(d[24][0]), "+r"(d[24][1]), "+r"(d[24][2]), "+r"(d[24][3]), "+r"(d[25][0]), "+r"(d[25][1]), "+r"(d[25][2]), "+r"(d[25][3]), "+r"(d[26][0]), "+r"(d[26][1]), "+r"(d[26][2]), "+r"(d[26][3]), "+r"(d[27][0]), "+r"(d[27][1]), "+r"(d[27][2]), "+r"(d[27][3]), "+r"(d[28][0]), "+r"(d[28][1]), "+r"(d[28][2]), "+r"(d[28][3]), "+r"(d[29][0]), "+r"(d[29][1]), "+r"(d[29][2]), "+r"(d[29][3]), "+r"(d[30][0]), "+r"(d[30][1]), "+r"(d[30][2]), "+r"(d[30][3]), "+r"(d[31][0]), "+r"(d[31][1]), "+r"(d[31][2]), "+r"(d[31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[32][4], const u32* a, u64 desc, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[32][4], const u32* a, u64 desc, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
// d (64 rows x 128 tokens, i32) += A (this warp's 16 rows x 32 K in registers) x B (descriptor).
__device__ __forceinline__ void wgmma_s8(int (&d)[16][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3]), "+r"(d[8][0]), "+r"(d[8][1]), "+r"(d[8][2]), "+r"(d[8][3]), "+r"(d[9][0]), "+r"(d[9][1]), "+r"(d[9][2]), "+r"(d[9][3]), "+r"(d[10][0]), "+r"(d[10][1]), "+r"(d[10][2]), "+r"(d[10][3]), "+r"(d[11][0]), "+r"(d[11][1]), "+r"(d[11][2]), "+r"(d[11][3]), "+r"(d[12][0]), "+r"(d[12][1]), "+r"(d[12][2]), "+r"(d[12][3]), "+r"(d[13][0]), "+r"(d[13][1]), "+r"(d[13][2]), "+r"(d[13][3]), "+r"(d[14][0]), "+r"(d[14][1]), "+r"(d[14][2]), "+r"(d[14][3]), "+r"(d[15][0]), "+r"(d[15][1]), "+r"(d[15][2]), "+r"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[16][4], const u32* a, u64 desc, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[16][4], const u32* a, u64 desc, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
// d (64 rows x 64 tokens) += A x B: the shapes for up to 64 tokens (decode batches).
__device__ __forceinline__ void wgmma_s8(int (&d)[8][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[8][4], const u32* a, u64 desc, __half*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
__device__ __forceinline__ void wgmma_16(float (&d)[8][4], const u32* a, u64 desc, __nv_bfloat16*) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
}
// W8A8: a stage is 128 K, two packed chunks (2 x 1 KB per weight tile), four k32 wgmmas.
template <int TOK> struct WgqW8 {
    static constexpr int STAGES = TOK == 256 ? 4 : TOK == 128 ? 6 : 8;
    static constexpr bool LAUNCH_EARLY = TOK == 64;  // (wgmma_gemm's LaunchesEarly)
    static constexpr int X_BYTES = TOK * 128;  // a stage's token tile: TOK rows of 128 B
    static constexpr int STAGE = X_BYTES + 8 * 2048;
    static constexpr int K_PER_STAGE = 128;  // TMA box width, in elements
    static constexpr int A_REGS = 16;
    using Acc = int;
    using Regs = u32[A_REGS];  // a stage's A fragments
    __device__ void retire(Acc (&)[TOK / 8][4], Regs&) const {}
    const TmaMap* codes;  // [tiles][chunks][1024 B], boxes of 8 tiles x 2 chunks
    int tiles, chunks;

    __device__ int stages() const { return (chunks + 1) / 2; }
    __device__ u32 weight_bytes() const { return 8 * 2048; }  // TMA counts zero-filled bytes too
    // Chunks 2c, 2c + 1 of tiles tile0 .. tile0 + 7, as [tile][2 KB].
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const { tma_load_3d(w, codes, 0, 2 * c, tile0, bar); }
    // a[4 * (2 * ch + s) + r]: register r of k32 step s of chunk ch, already wgmma's A fragment
    // for the stage's channels 64 ch + 32 s .. (natural K order).
    __device__ void load_a(const unsigned char* w, int, u32 (&a)[A_REGS]) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const uint4* src = reinterpret_cast<const uint4*>(w + warp * 2048);
#pragma unroll
        for (int ch = 0; ch < 2; ++ch)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const uint4 v = src[ch * 64 + lane * 2 + s];
                u32* r = a + 4 * (2 * ch + s);
                r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
            }
    }
    __device__ void mma(int (&acc)[TOK / 8][4], const u32 (&a)[A_REGS], u32 xs, int) const {
        // A stage missing its second chunk (odd chunk count) still issues four wgmmas, keeping
        // them out of divergent code: TMA zero-fills codes and tokens past K.
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_s8(acc, a + 4 * j, sw128_desc(xs + 32 * j));
    }
};

// W4A16: a stage is two 64-channel chunks (one at 256 tokens, whose 128 accumulators leave no
// registers for a second A set): 512 B of codes a chunk and the 64-byte parameter rows of the
// groups the stage spans, per weight tile, and eight (four) k16 wgmmas. A stage costs about the
// same whatever its work (0.6 us at 64 tokens, H100), so 128 channels a stage halve W4A16's count
// (as the 8-bit families' already are). Codes and parameters each come in one TMA copy for the 8
// tiles: with a copy per tile the producer's 17 copies a stage bounded the kernel (474 against 672
// TFLOPS without the parameter copies, bench/probe/wgmma_w4_probe.sh); the tokens come as one
// 64-channel SW128 box per chunk.
template <class T, int TOK> struct WgqW4 {
    static constexpr int CPS = TOK == 256 ? 1 : 2;  // chunks a stage
    static constexpr int STAGES = TOK == 256 ? 5 : TOK == 128 ? 5 : 8;
    static constexpr int CODES = 8 * 512 * CPS;
    static constexpr int X_BYTES = TOK * 128 * CPS;
    static constexpr int STAGE = X_BYTES + CODES + 8 * 128 * CPS;  // up to 2 CPS parameter rows a tile
    static constexpr int K_PER_STAGE = 64 * CPS;
    static constexpr int A_REGS = 16 * CPS;
    using Acc = float;
    using Regs = u32[A_REGS];  // a stage's A fragments
    __device__ void retire(Acc (&)[TOK / 8][4], Regs&) const {}
    const TmaMap* codes;   // [tiles][chunks][512 B], boxes of 8 tiles x CPS chunks
    const TmaMap* params;  // [tiles][groups][64 B], boxes of 8 tiles x span() groups
    int tiles, chunks, groups, group_len;

    __device__ int stages() const { return (chunks + CPS - 1) / CPS; }
    __device__ int first_group(int c) const { return c * K_PER_STAGE / group_len; }
    // Groups a stage's parameter box covers (qlinear::w4a16_span): one when groups are whole
    // stages, all of them when they divide a stage, else as many as a stage can touch (at most
    // 3 of groups of 80 in 128 channels; the last may be past the last group: zero-filled,
    // unread).
    __device__ int span() const {
        return group_len % K_PER_STAGE == 0   ? 1
               : K_PER_STAGE % group_len == 0 ? K_PER_STAGE / group_len
                                              : K_PER_STAGE / group_len + 2;
    }
    __device__ u32 weight_bytes() const { return CODES + 8 * span() * 64; }
    // As [tile][CPS x 512 B] codes, then [tile][span() x 64 B] parameters.
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const {
        tma_load_3d(w, codes, 0, CPS * c, tile0, bar);
        tma_load_3d(w + CODES, params, 0, first_group(c), tile0, bar);
    }
    // Dequantized as the mma.sync tier does, then transposed per quad into natural K order;
    // chunk ch's registers are a[16 ch ..].
    __device__ void load_a(const unsigned char* w, int c, u32 (&a)[A_REGS]) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int ch = 0; ch < CPS; ++ch) {
            const uint4 v = *reinterpret_cast<const uint4*>(w + (warp * CPS + ch) * 512 + lane * 16);
            const int gl = ((c * CPS + ch) * 64 + t * 16) / group_len - first_group(c);
            const uint2 p = *reinterpret_cast<const uint2*>(w + CODES + (warp * span() + gl) * 64 + g * 8);
            u32 src[4][4];
            dequant_step<T>(v.x, p, src[0]);
            dequant_step<T>(v.y, p, src[1]);
            dequant_step<T>(v.z, p, src[2]);
            dequant_step<T>(v.w, p, src[3]);
            k16_regs_to_k_order(src, *reinterpret_cast<u32(*)[16]>(a + 16 * ch));
        }
    }
    // k16 step j reads chunk j / 4's token box (TOK rows of 128 B), 32 B in.
    __device__ void mma(float (&acc)[TOK / 8][4], const u32 (&a)[A_REGS], u32 xs, int) const {
#pragma unroll
        for (int j = 0; j < 4 * CPS; ++j)
            wgmma_16(acc, a + 4 * j, sw128_desc(xs + (j >> 2) * TOK * 128 + 32 * (j & 3)), (T*)nullptr);
    }
};

// W8A16: a stage is two 64-channel chunks below 256 tokens, one at 256 (1 KB of INT8 codes per
// weight tile and chunk, in the decode gemv's k16 order), four k16 wgmmas a chunk. Consumers make the codes exact 16-bit values in registers
// (w8_step) straight into the A operand and transpose quads into natural K order as W4A16 does;
// the row scale applies in the epilogue. Twice W4A16's weight bytes a stage and no group
// parameters.
template <class T, int TOK> struct WgqW8A16 {
    static constexpr int CPS = TOK == 256 ? 1 : 2;  // chunks a stage, as WgqW4
    static constexpr int STAGES = TOK == 256 ? 5 : TOK == 128 ? 4 : 6;
    static constexpr int CODES = 8 * 1024 * CPS;
    static constexpr int X_BYTES = TOK * 128 * CPS;
    static constexpr int STAGE = X_BYTES + CODES;
    static constexpr int K_PER_STAGE = 64 * CPS;
    static constexpr int A_REGS = 16 * CPS;
    using Acc = float;
    using Regs = u32[A_REGS];
    __device__ void retire(Acc (&)[TOK / 8][4], Regs&) const {}
    const TmaMap* codes;  // [tiles][chunks][1024 B], boxes of 8 tiles x CPS chunks
    int tiles, chunks;

    __device__ int stages() const { return (chunks + CPS - 1) / CPS; }
    __device__ u32 weight_bytes() const { return CODES; }
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const { tma_load_3d(w, codes, 0, CPS * c, tile0, bar); }
    // Lane words (2j + h) hold step j's four channels of row g + 8h (pack::w8a16_slot); chunk
    // ch's registers are a[16 ch ..].
    __device__ void load_a(const unsigned char* w, int, u32 (&a)[A_REGS]) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
        for (int ch = 0; ch < CPS; ++ch) {
            const uint4* src = reinterpret_cast<const uint4*>(w + (warp * CPS + ch) * 1024 + lane * 32);
            const uint4 v0 = src[0], v1 = src[1];
            u32 steps[4][4];
            w8_step<T>(v0.x, v0.y, steps[0]);
            w8_step<T>(v0.z, v0.w, steps[1]);
            w8_step<T>(v1.x, v1.y, steps[2]);
            w8_step<T>(v1.z, v1.w, steps[3]);
            k16_regs_to_k_order(steps, *reinterpret_cast<u32(*)[16]>(a + 16 * ch));
        }
    }
    // k16 step j reads chunk j / 4's token box (TOK rows of 128 B), 32 B in.
    __device__ void mma(float (&acc)[TOK / 8][4], const u32 (&a)[A_REGS], u32 xs, int) const {
#pragma unroll
        for (int j = 0; j < 4 * CPS; ++j)
            wgmma_16(acc, a + 4 * j, sw128_desc(xs + (j >> 2) * TOK * 128 + 32 * (j & 3)), (T*)nullptr);
    }
};

// W4A8 (QoQ, LiquidQuant, INT4 per channel; QServe §5, LiquidGEMM §4-5): a stage is 128 K as for
// W8A8, but the weights arrive as 4-bit codes (two 512-B chunks per weight tile, half W8A8's
// bytes) with the group parameter rows the stage's 128 channels touch (`span` of them, one per
// row for groups of 128 and up). Consumers widen the codes to W8A8's INT8 fragments in registers
// (W4A8Affine: an IMAD and an XOR per four weights) straight into the wgmma A operand, so the
// widened weights never go through shared memory (LiquidGEMM's implicit pipeline: the TMA
// producer warpgroup streams codes while the consumer warpgroups widen and multiply). As W8A8's,
// the codes are in natural K order, so the widened registers are wgmma's A fragments as they
// are; each k32 step reads the parameters of its group (a chunk's two steps differ for groups of
// 32). The epilogue is W8A8's per-row and per-token scales. On Hopper the gain over W8A8 is
// bytes, not math: the tensor cores run INT8.
template <int TOK> struct WgqW4A8 {
    static constexpr int STAGES = TOK == 256 ? 5 : TOK == 128 ? 8 : 12;
    static constexpr int X_BYTES = TOK * 128;
    static constexpr int CODES = 8 * 1024;
    static constexpr int STAGE = X_BYTES + CODES + 8 * 4 * 64;
    static constexpr int K_PER_STAGE = 128;
    static constexpr int A_REGS = 16;
    using Acc = int;
    using Regs = u32[A_REGS];  // a stage's A fragments
    __device__ void retire(Acc (&)[TOK / 8][4], Regs&) const {}
    const TmaMap* codes;   // [tiles][chunks][512 B], boxes of 8 tiles x 2 chunks
    const TmaMap* params;  // [tiles][groups][64 B], boxes of 8 tiles x span groups
    int tiles, chunks, groups, group_shift, span;

    __device__ int stages() const { return (chunks + 1) / 2; }
    __device__ int first_group(int c) const { return (c * 128) >> group_shift; }
    __device__ u32 weight_bytes() const { return CODES + 8 * span * 64; }
    // As [tile][1 KB] codes, then [tile][span x 64 B] parameters.
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const {
        tma_load_3d(w, codes, 0, 2 * c, tile0, bar);
        tma_load_3d(w + CODES, params, 0, first_group(c), tile0, bar);
    }
    // Chunk ch's four words widen to a[8 ch ..] in W8A8's register order (word 2s + h: register h
    // of k32 step s in its low nibbles, register 2 + h in its high ones), step s with the
    // parameters of its group.
    __device__ void load_a(const unsigned char* w, int c, u32 (&a)[A_REGS]) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
        const int g0 = first_group(c);
#pragma unroll
        for (int ch = 0; ch < 2; ++ch) {
            const uint4 v = *reinterpret_cast<const uint4*>(w + warp * 1024 + ch * 512 + lane * 16);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int gi = ((c * 128 + ch * 64 + s * 32) >> group_shift) - g0;
                const uint2 p = *reinterpret_cast<const uint2*>(w + CODES + (warp * span + gi) * 64 + g * 8);
                const W4A8Affine row0(p.x), row8(p.y);
                u32* r = a + 4 * (2 * ch + s);
                row0.widen(s ? v.z : v.x, r[0], r[2]);
                row8.widen(s ? v.w : v.y, r[1], r[3]);
            }
        }
    }
    __device__ void mma(int (&acc)[TOK / 8][4], const u32 (&a)[A_REGS], u32 xs, int) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_s8(acc, a + 4 * j, sw128_desc(xs + 32 * j));
    }
};

// TRAIT<F>::value: F's optional flag F::MEMBER, false where F does not declare it (the families
// opt in to wgmma_gemm's variations one member each).
#define WGMMA_OPTIONAL_FLAG(TRAIT, MEMBER)                                                             \
    template <class F, class = void> struct TRAIT {                                                    \
        static constexpr bool value = false;                                                           \
    };                                                                                                 \
    template <class F> struct TRAIT<F, decltype(void(F::MEMBER))> {                                    \
        static constexpr bool value = F::MEMBER;                                                       \
    };

// Whether F adds a stage's wgmma results into its accumulators as soon as they are done
// (F::RETIRE_AT_ONCE: FP8's promotion), rather than one stage later, overlapped with the next
// stage's wgmmas. Reading a fragment while any wgmma is in flight made ptxas serialize every wgmma
// of the FP8 kernels (C7514: each waited for the last before issuing); with the wait first, a
// stage's four wgmmas run back to back (CUTLASS's FP8 accumulation does the same). The two
// consumers then promote at the same time. Letting them take turns instead (FlashAttention-3's
// ping-pong, named barriers handing the issue from one warpgroup to the other) measured 0.95x at
// M >= 1024 on an H100, 0.87x on 4096x14336 at 8192 (BENCHMARKS.md, issue 18): removed.
WGMMA_OPTIONAL_FLAG(RetiresAtOnce, RETIRE_AT_ONCE)

// Whether F's kernels take programmatic dependent launch (F::LAUNCH_EARLY; their names are in
// compile::GRID_WAITING_KERNELS): the first stages' weight copies go out before the grid wait, and
// the next kernel is scheduled at once. Measured with every wgmma entry on it (H200, BENCHMARKS.md
// issue 18, "What a launch costs"): W8A8's and FP8's 64-token tiles 1.03x to 1.15x faster back to
// back, which keeps them on it; W4A8, W4A16 and W8A16 at 64 tokens and every family at 256 0.94x
// to 1.04x, and the W4A8 ShareGPT throughput level (0.99x).
WGMMA_OPTIONAL_FLAG(LaunchesEarly, LAUNCH_EARLY)

// Whether F stages per-token data of its own with each stage (F::STAGES_TOKENS: COMET's block
// scales of the tile's tokens), which its issue_tokens copies, knowing the tile's first token.
WGMMA_OPTIONAL_FLAG(StagesTokens, STAGES_TOKENS)

// The wgmma tiers' epilogue: a warp's outputs go through 512 bytes of shared memory a round (16
// tokens of its 16 rows in 16-bit outputs, 8 in f32, 32 of SwiGLU's 8 columns), so each lane
// stores 16 contiguous bytes of one token where store_tile stores 2 (an eighth of the store
// instructions, and a token's outputs in one 32-byte sector). With the scales loaded ahead of the
// stores (EPI::Tile) it took FP8 4096x4096 at M = 1024 from 37.3 to 31.5 us on an H100, where no
// epilogue at all (WGQ_EPI_OFF) took 29.0 (BENCHMARKS.md, "The wgmma epilogue"). The buffer's
// 16-byte chunks are XOR-swizzled by their 128-byte line, so neither the fragment writes nor the
// vector reads conflict on banks. Same outputs as store_tile, bit for bit.
template <int TT, class A, class OUT, class EPI>
__device__ __forceinline__ void store_tile_staged(const A (&acc)[TT][4], int row0, int tok0, int M, int N,
                                                  OUT* y, long ldy, const EPI& epi, uint4* buf) {
    constexpr bool SWIGLU = IsSwiGlu<EPI>::value;
    constexpr int R = SWIGLU ? 8 : 16;        // outputs a token: the warp's rows, or SwiGLU's columns
    constexpr int EPC = 16 / sizeof(OUT);     // outputs a 16-byte chunk
    constexpr int C = R / EPC;                // chunks a token
    constexpr int LT = 8 / C;                 // tokens a 128-byte line
    constexpr int TPR = 32 / C / 8;           // token blocks a round (32 chunks)
    constexpr int CH = TT < 16 ? TT : 16;
    static_assert(CH % TPR == 0, "rounds split a chunk of token blocks");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int col0 = SWIGLU ? row0 >> 1 : row0, cols = SWIGLU ? N >> 1 : N;
    const bool vec = (reinterpret_cast<size_t>(y) & 15) == 0 && (ldy * sizeof(OUT)) % 16 == 0;
    // Token r's chunk k sits at 16-byte slot `slot(r, k)` of the round's 32.
    auto slot = [](int r, int k) {
        const int line = r / LT, c = (r % LT) * C + k;
        return line * 8 + (c ^ (C == 4 ? (line & 3) << 1 : C == 2 ? line & 1 : 0));
    };
    OUT* b = reinterpret_cast<OUT*>(buf);
    typename EPI::template Tile<CH> at(epi, row0 + g, N);
#pragma unroll
    for (int c0 = 0; c0 < TT; c0 += CH) {
        at.tokens(epi, tok0 + 8 * c0 + 2 * t, M);
#pragma unroll
        for (int r0 = 0; r0 < CH; r0 += TPR) {
#pragma unroll
            for (int tl = 0; tl < TPR; ++tl)
#pragma unroll
                for (int e = 0; e < (SWIGLU ? 2 : 4); ++e) {
                    const int r = tl * 8 + 2 * t + (e & 1), col = g + 8 * (e >> 1);
                    float v;
                    if constexpr (SWIGLU)
                        v = at(acc[c0 + r0 + tl][e], acc[c0 + r0 + tl][e + 2], r0 + tl, e);
                    else
                        v = at(acc[c0 + r0 + tl][e], r0 + tl, e);
                    b[slot(r, col / EPC) * EPC + col % EPC] = to_out(v, (OUT*)nullptr);
                }
            __syncwarp();
            const int r = lane / C, k = lane % C;
            const uint4 v = buf[slot(r, k)];
            const int m = tok0 + (c0 + r0) * 8 + r, n = col0 + k * EPC;
            if (m < M) {
                OUT* dst = y + (long)m * ldy + n;
                if (vec && n + EPC <= cols) {
                    *reinterpret_cast<uint4*>(dst) = v;
                } else {
                    const OUT* vs = reinterpret_cast<const OUT*>(&v);
#pragma unroll
                    for (int i = 0; i < EPC; ++i)
                        if (n + i < cols) dst[i] = vs[i];
                }
            }
            __syncwarp();  // the buffer is read before the next round writes it
        }
    }
}

// A CTA computes output tiles of 128 weight rows (8 packed tiles) x TOK tokens, tokens read
// through `xmap`; the grid is at most one CTA per SM and each walks tiles blockIdx.x, + gridDim.x,
// .. in an order that takes WGQ_RASTER token blocks per weight block, so the tiles in flight
// share weights and tokens in L2. With fewer tiles than SMs (small layers at few tokens) each
// tile's K is cut into `splits` ranges, units of work of their own: a unit's consumers write
// their accumulators to `partial` (each thread its own registers' slots) and the last unit of a
// tile to arrive (a counter per tile, left zeroed) adds the ranges in order and stores the tile,
// so results are deterministic.
// SPLITS compiles the split path (the 64- and 128-token entries: with it, the 256-token W8A8
// kernel ran about 20% slower at M = 1024 on an H200, splits or not).
template <int TOK, bool SPLITS, class F, class OUT, class EPI>
__device__ void wgmma_gemm(const TmaMap* xmap, const F& f, OUT* __restrict__ y, long ldy, int M, int N,
                           int split_arg, typename F::Acc* __restrict__ partial, int* __restrict__ counters,
                           const EPI& epi) {
    constexpr int S = F::STAGES;
    const int splits = SPLITS ? split_arg : 1;
    extern __shared__ __align__(16) unsigned char wgq_smem[];
    __shared__ uint4 epi_buf[8][32];  // each consumer warp's epilogue round (store_tile_staged)
    const u32 raw = smem_addr(wgq_smem), pad = (1024 - (raw & 1023)) & 1023;
    unsigned char* smem = wgq_smem + pad;  // 128-byte swizzle atoms are 1024-byte aligned
    const u32 base = raw + pad, bars = base + S * F::STAGE;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (S + s); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // Persistent CTAs walk the units; unit u is K range u % splits of tile u / splits, tile t
    // weight rows tile0 * 16 .. and tokens m0 ..
    const int nb = (f.tiles + 7) / 8, mb = (M + TOK - 1) / TOK, total = nb * mb * splits;
    const int n = f.stages();
    auto place = [&](int u, int& tile0, int& m0, int& c0, int& c1) {
        const int t = u / splits, k = u % splits;
        const int per_group = WGQ_RASTER * nb;
        const int first = t / per_group * WGQ_RASTER, gsz = min(WGQ_RASTER, mb - first);
        tile0 = (t % per_group) / gsz * 8;
        m0 = (first + (t % per_group) % gsz) * TOK;
        c0 = k * n / splits;
        c1 = (k + 1) * n / splits;
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init_count(full(s), 1);
            mbar_init_count(empty(s), 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // Programmatic dependent launch (LaunchesEarly): the next kernel may be scheduled from here on
    // (its CTAs take SMs this grid leaves idle and wait on this grid), and this one may have
    // started while the previous kernel runs: nothing below reads what that kernel writes (the
    // tokens, their scales, the split-K slots) or writes anything before grid_dependency_wait.
    // Only the weights, which nothing writes, go out before it.
    constexpr bool EARLY = LaunchesEarly<F>::value;
    if constexpr (EARLY) grid_dependents_launch();

    // Stage g (counted across this CTA's units) uses slot g % S in phase g / S.
    if (warp >= 8) {  // the producer warpgroup: one warp issues the copies, running ahead into
                      // the next unit while the consumers store this one
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WGQ_PRODUCER_REGS));
        if (warp != 8 || lane != 0) return;
        // The first unit's first stages: their barriers armed and their weights on the way
        // while the previous kernel finishes.
        int early = 0;
        if (EARLY && blockIdx.x < total) {
            int tile0, m0, c0, c1;
            place(blockIdx.x, tile0, m0, c0, c1);
            early = min(S, c1 - c0);
            for (int i = 0; i < early; ++i) {
                mbar_expect_tx(full(i), F::X_BYTES + f.weight_bytes());
                f.issue(base + i * F::STAGE + F::X_BYTES, full(i), tile0, c0 + i);
            }
        }
        if constexpr (EARLY) grid_dependency_wait();
        int g = 0;
        for (int u = blockIdx.x; u < total; u += gridDim.x) {
            int tile0, m0, c0, c1;
            place(u, tile0, m0, c0, c1);
            for (int c = c0; c < c1; ++c, ++g) {
                const int s = g % S;
                if (g >= early) {
                    if (g >= S) mbar_wait(empty(s), (g / S + 1) & 1);
                    mbar_expect_tx(full(s), F::X_BYTES + f.weight_bytes());
                }
                // The stage's tokens as boxes of TOK rows x 128 bytes (W4A16's 128 channels: two).
                constexpr int X_BOXES = F::X_BYTES / (TOK * 128);
#pragma unroll
                for (int b = 0; b < X_BOXES; ++b)
                    tma_load_2d(base + s * F::STAGE + b * TOK * 128, xmap,
                                c * F::K_PER_STAGE + b * (F::K_PER_STAGE / X_BOXES), m0, full(s));
                if (g >= early) f.issue(base + s * F::STAGE + F::X_BYTES, full(s), tile0, c);
                if constexpr (StagesTokens<F>::value)
                    f.issue_tokens(base + s * F::STAGE + F::X_BYTES, full(s), m0, c);
            }
        }
        return;
    }
    if constexpr (EARLY) grid_dependency_wait();  // the consumers read token scales, write outputs

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WGQ_CONSUMER_REGS));
    typename F::Acc acc[TOK / 8][4];
    typename F::Regs a0, a1;
    int g = 0;  // this unit's first stage
    for (int u = blockIdx.x; u < total; u += gridDim.x) {
        int tile0, m0, c0, c1;
        place(u, tile0, m0, c0, c1);
        const int len = c1 - c0;
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
        fence_acc(acc);
        // `cur` holds this stage's registers (A fragments, or FP8's promotion fragment), `prev`
        // the last stage's, whose wgmmas have retired once wait_group 1 returns.
        auto step = [&](int i, typename F::Regs& cur, typename F::Regs& prev) {
            const int s = (g + i) % S;
            mbar_wait(full(s), ((g + i) / S) & 1);
            f.load_a(smem + s * F::STAGE + F::X_BYTES, c0 + i, cur);
            wgmma_fence();
            f.mma(acc, cur, base + s * F::STAGE, c0 + i);
            wgmma_commit();
            if constexpr (RetiresAtOnce<F>::value) {
                wgmma_wait<0>();
                f.retire(acc, cur);
                if (lane == 0) mbar_arrive(empty(s));
            } else {
                wgmma_wait<1>();
                if (i > 0) {
                    f.retire(acc, prev);
                    if (lane == 0) mbar_arrive(empty((g + i - 1) % S));
                }
            }
        };
        if constexpr (RetiresAtOnce<F>::value) {
            // One fragment: each stage's is added before the next stage's wgmmas start.
            for (int i = 0; i < len; ++i) step(i, a0, a0);
        } else {
            for (int i = 0; i + 1 < len; i += 2) {
                step(i, a0, a1);
                step(i + 1, a1, a0);
            }
            if (len & 1) step(len - 1, a0, a1);
            wgmma_wait<0>();
            if (len & 1)  // (two calls: a selected reference would put the registers in memory)
                f.retire(acc, a0);
            else
                f.retire(acc, a1);
            if (lane == 0) mbar_arrive(empty((g + len - 1) % S));
        }
        g += len;
        fence_acc(acc);
        // One store_tile call site: a second copy of the epilogue (splits == 1 apart) made the
        // 128-token 8-bit kernels 10 to 17% slower at one split on an H100.
        if (splits > 1) {  // (never without SPLITS: splits is 1 then)
            __shared__ int last_arrival;
            // [tile][split][register][consumer thread]: every thread keeps its own slots, so the
            // last arriver adds the splits in its own registers' layout.
            constexpr int VALS = TOK / 8 * 4, CT = 256;
            const int t = u / splits, tid = threadIdx.x;
            typename F::Acc* mine = partial + ((long)u * VALS) * CT + tid;
#pragma unroll
            for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * CT] = acc[j][e];
            asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
            asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the consumer warpgroups only
            if (tid == 0) {
                const int done = atomicAdd(&counters[t], 1) == splits - 1;
                if (done) counters[t] = 0;
                last_arrival = done;
            }
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
            if (!last_arrival) continue;
            asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
            // Splits in order (the same f32 sums whichever unit arrives last); a split's values
            // are loaded together, one L2 round trip a split. With the split loop innermost,
            // ptxas issued each value's loads as a chain of their own, 32 round trips in a row at
            // TOK = 64: W4A16 4096x4096 at M = 64 in 4 splits took 25.7 us against 16.0 now
            // (H100).
            const typename F::Acc* first = partial + ((long)t * splits * VALS) * CT + tid;
#pragma unroll
            for (int j = 0; j < TOK / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
            for (int k = 0; k < splits; ++k) {
                const typename F::Acc* split = first + (long)k * VALS * CT;
                typename F::Acc part[TOK / 8][4];
#pragma unroll
                for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) part[j][e] = __ldcg(split + (j * 4 + e) * CT);
#pragma unroll
                for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[j][e] += part[j][e];
            }
        }
#ifdef WGQ_EPI_OFF  // probe (wrong results): the tile's cost without its epilogue
        store_tile<TOK / 8>(acc, (tile0 + warp) * 16, m0, M, N, y, ldy, epi);
#else
        store_tile_staged<TOK / 8>(acc, (tile0 + warp) * 16, m0, M, N, y, ldy, epi, epi_buf[warp]);
#endif
    }
}

// Entry points: `wgmma` takes 256 tokens per tile, `wgmma128` 128 (where a second block of 256
// would be mostly padding: qlinear::wgmma_tokens), `wgmma64` 64 (batches past the decode gemv).
// WRAP: plain_epilogue, or swiglu_epilogue for a gate/up pair packed interleaved (qgemm.cu,
// SwiGluEpilogue), which writes silu(gate) * up in the model dtype.
#define W8A8_WGMMA_ENTRY(NAME, TOK, OUT, WRAP)                                                        \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const float* __restrict__ sw, const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M, \
        int N, int tiles, int chunks, int splits, int* __restrict__ partial, int* __restrict__ counters) { \
        wgmma_gemm<TOK, TOK <= 128>(&xmap, WgqW8<TOK>{&wmap, tiles, chunks}, y, ldy, M, N, splits, partial, \
                                   counters, WRAP(W8Epilogue{sx, sw}));                               \
    }
#define W8A8_WGMMA(OUTNAME, OUT, WRAP)                            \
    W8A8_WGMMA_ENTRY(w8a8_wgmma_##OUTNAME, 256, OUT, WRAP)        \
    W8A8_WGMMA_ENTRY(w8a8_wgmma128_##OUTNAME, 128, OUT, WRAP)     \
    W8A8_WGMMA_ENTRY(w8a8_wgmma64_##OUTNAME, 64, OUT, WRAP)
W8A8_WGMMA(f32, float, plain_epilogue)
W8A8_WGMMA(f16, __half, plain_epilogue)
W8A8_WGMMA(bf16, __nv_bfloat16, plain_epilogue)
W8A8_WGMMA(swiglu_f16, __half, swiglu_epilogue)
W8A8_WGMMA(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)

#define W4A16_WGMMA_ENTRY(NAME, TOK, T, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const __grid_constant__ TmaMap pmap, OUT* __restrict__ y, long ldy, int M, int N, int tiles,  \
        int chunks, int groups, int group_len, int splits, float* __restrict__ partial,               \
        int* __restrict__ counters) {                                                                 \
        wgmma_gemm<TOK, TOK <= 128>(&xmap, WgqW4<T, TOK>{&wmap, &pmap, tiles, chunks, groups, group_len}, \
                                   y, ldy, M, N, splits, partial, counters, W4Epilogue{});            \
    }
#define W4A16_WGMMA(SFX, T)                                            \
    W4A16_WGMMA_ENTRY(w4a16_wgmma_##SFX, 256, T, float)                \
    W4A16_WGMMA_ENTRY(w4a16_wgmma_h_##SFX, 256, T, T)                  \
    W4A16_WGMMA_ENTRY(w4a16_wgmma128_##SFX, 128, T, float)             \
    W4A16_WGMMA_ENTRY(w4a16_wgmma128_h_##SFX, 128, T, T)               \
    W4A16_WGMMA_ENTRY(w4a16_wgmma64_##SFX, 64, T, float)               \
    W4A16_WGMMA_ENTRY(w4a16_wgmma64_h_##SFX, 64, T, T)
W4A16_WGMMA(f16, __half)
W4A16_WGMMA(bf16, __nv_bfloat16)

#define W8A16_WGMMA_ENTRY(NAME, TOK, T, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const float* __restrict__ sw, OUT* __restrict__ y, long ldy, int M, int N, int tiles, int chunks, \
        int splits, float* __restrict__ partial, int* __restrict__ counters) {                        \
        wgmma_gemm<TOK, TOK <= 128>(&xmap, WgqW8A16<T, TOK>{&wmap, tiles, chunks}, y, ldy, M, N, splits, \
                                   partial, counters, RowScaleEpilogue{sw});                          \
    }
#define W8A16_WGMMA(SFX, T)                                            \
    W8A16_WGMMA_ENTRY(w8a16_wgmma_##SFX, 256, T, float)                \
    W8A16_WGMMA_ENTRY(w8a16_wgmma_h_##SFX, 256, T, T)                  \
    W8A16_WGMMA_ENTRY(w8a16_wgmma128_##SFX, 128, T, float)             \
    W8A16_WGMMA_ENTRY(w8a16_wgmma128_h_##SFX, 128, T, T)               \
    W8A16_WGMMA_ENTRY(w8a16_wgmma64_##SFX, 64, T, float)               \
    W8A16_WGMMA_ENTRY(w8a16_wgmma64_h_##SFX, 64, T, T)
W8A16_WGMMA(f16, __half)
W8A16_WGMMA(bf16, __nv_bfloat16)

// WRAP: plain_epilogue, or swiglu_epilogue for a gate/up pair packed interleaved (qgemm.cu,
// SwiGluEpilogue), which writes silu(gate) * up in the model dtype.
#define W4A8_WGMMA_ENTRY(NAME, TOK, OUT, WRAP)                                                        \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const __grid_constant__ TmaMap pmap, const float* __restrict__ sw, const float* __restrict__ sx, \
        OUT* __restrict__ y, long ldy, int M, int N, int tiles, int chunks, int groups, int group_shift, \
        int span, int splits, int* __restrict__ partial, int* __restrict__ counters) {                \
        wgmma_gemm<TOK, TOK <= 128>(&xmap, WgqW4A8<TOK>{&wmap, &pmap, tiles, chunks, groups, group_shift, span}, \
                                   y, ldy, M, N, splits, partial, counters, WRAP(W8Epilogue{sx, sw})); \
    }
#define W4A8_WGMMA(OUTNAME, OUT, WRAP)                            \
    W4A8_WGMMA_ENTRY(w4a8_wgmma_##OUTNAME, 256, OUT, WRAP)        \
    W4A8_WGMMA_ENTRY(w4a8_wgmma128_##OUTNAME, 128, OUT, WRAP)     \
    W4A8_WGMMA_ENTRY(w4a8_wgmma64_##OUTNAME, 64, OUT, WRAP)
W4A8_WGMMA(f32, float, plain_epilogue)
W4A8_WGMMA(f16, __half, plain_epilogue)
W4A8_WGMMA(bf16, __nv_bfloat16, plain_epilogue)
W4A8_WGMMA(swiglu_f16, __half, swiglu_epilogue)
W4A8_WGMMA(swiglu_bf16, __nv_bfloat16, swiglu_epilogue)

// COMET W4A4A8 (FMPQ, COMET §3-4) past the decode gemv, on W4A8's pipeline. Hopper has no 4-bit
// tensor-core math, so both operands run as INT8: the activations are comet_quantize's INT8
// codes (an INT4 block's within [-7, 7]), TMA-loaded as W8A8's tokens, and the weights are the
// checkpoint's nibbles repacked at load into W4A8's fragments with one byte-affine parameter a
// row and group, scale 1 and offset 128 - z, so W4A8Affine widens them to q - z exactly (src/comet.rs,
// `pack_wgmma`). COMET's gain on Hopper is bytes, not math (comet.cu's header).
// A stage is one block of 128 channels (groups of 128 only: one block per stage). The block's
// dot products go to an i32 fragment of their own, and once its wgmmas retire each output adds
// f32(fragment) * (s_w,b * s_x,b) to its f32 accumulator with one fma (RETIRE_AT_ONCE), block
// after block: the reference's bits, as comet_gemm. So K is never split. The producer stages
// each block's scales next to its codes: the 128 rows' s_w,b (a [groups][rows] copy made at
// load) and the TOK tokens' s_x,b (the quantizer writes [blocks][tokens] for this kernel).
// Registers at 128 tokens, within a consumer's WGQ_CONSUMER_REGS: the f32 accumulator and the i32
// fragment are 64 each, the A fragments 16, the stage's token scales 32.
// Layout of a stage after the tokens: codes (8 KB), the group parameters (8 tiles x 64 B), the
// rows' scales (512 B), the tokens' scales (TOK x 4 B), padded to 1 KB for the next stage's
// swizzled tokens.
template <int TOK> struct WgqComet {
    static constexpr int STAGES = TOK == 128 ? 8 : 12;  // (src/comet.rs wgmma_smem sizes them)
    static constexpr int X_BYTES = TOK * 128;
    static constexpr int CODES = 8 * 1024;
    static constexpr int PARAMS = 8 * 64;
    static constexpr int SW_AT = CODES + PARAMS;   // after the tokens
    static constexpr int SX_AT = SW_AT + 128 * 4;
    static constexpr int STAGE = (X_BYTES + SX_AT + TOK * 4 + 1023) / 1024 * 1024;
    static constexpr int K_PER_STAGE = 128;
    static constexpr bool RETIRE_AT_ONCE = true;  // (wgmma_gemm's RetiresAtOnce)
    static constexpr bool STAGES_TOKENS = true;   // (wgmma_gemm's StagesTokens)
    using Acc = float;
    struct Regs {
        u32 a[16];              // the block's A fragments (W4A8's)
        int t[TOK / 8][4];      // the block's i32 dot products
        float sw[2];            // s_w,b of rows g and g + 8
        float2 sx[TOK / 8];     // s_x,b of tokens 8j + 2t, 8j + 2t + 1
    };
    WgqW4A8<TOK> w4;    // codes, parameters, tiles, chunks, groups (group_shift 7, span 1)
    const TmaMap* sw;   // [groups][tiles * 16] f32, boxes of 128 rows x 1 group
    const TmaMap* sx;   // [blocks][M rounded up to 4] f32, boxes of TOK tokens x 1 block
    int tiles;          // (w4's, which wgmma_gemm reads here)

    __device__ int stages() const { return w4.stages(); }
    // Everything a stage holds past the tokens, the token scales included: the full barrier's
    // expected bytes (wgmma_gemm adds X_BYTES).
    __device__ u32 weight_bytes() const { return CODES + PARAMS + 128 * 4 + TOK * 4; }
    __device__ void issue(u32 w, u32 bar, int tile0, int c) const {
        w4.issue(w, bar, tile0, c);
        tma_load_2d(w + SW_AT, sw, tile0 * 16, c, bar);
    }
    __device__ void issue_tokens(u32 w, u32 bar, int m0, int c) const { tma_load_2d(w + SX_AT, sx, m0, c, bar); }
    // Widens the block's codes (W4A8's load_a), zeroes its fragment, and reads its scales, all
    // before the block's wgmmas are issued.
    __device__ void load_a(const unsigned char* w, int c, Regs& r) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        w4.load_a(w, c, r.a);
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j) r.t[j][0] = r.t[j][1] = r.t[j][2] = r.t[j][3] = 0;
        const float* sw_rows = reinterpret_cast<const float*>(w + SW_AT);
        r.sw[0] = sw_rows[warp * 16 + g];
        r.sw[1] = sw_rows[warp * 16 + g + 8];
        const float2* sx_toks = reinterpret_cast<const float2*>(w + SX_AT);
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j) r.sx[j] = sx_toks[4 * j + t];
    }
    __device__ void mma(float (&)[TOK / 8][4], Regs& r, u32 xs, int) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_s8(r.t, r.a + 4 * j, sw128_desc(xs + 32 * j));
    }
    // The retired block into the accumulator: c0, c1 row g at tokens 2t, 2t + 1; c2, c3 row g + 8.
    __device__ void retire(float (&acc)[TOK / 8][4], Regs& r) const {
        fence_acc(r.t);
#pragma unroll
        for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sx = (e & 1) ? r.sx[j].y : r.sx[j].x;
                acc[j][e] = fmaf((float)r.t[j][e], r.sw[e >> 1] * sx, acc[j][e]);
            }
    }
};

// Tiles of 128 tokens, or 64 for 33 to 64; no split K (it would reorder the block sum).
#define COMET_WGMMA_ENTRY(NAME, TOK, OUT)                                                              \
    extern "C" __global__ void __launch_bounds__(WGQ_THREADS, 1) NAME(                                 \
        const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,                    \
        const __grid_constant__ TmaMap pmap, const __grid_constant__ TmaMap swmap,                   \
        const __grid_constant__ TmaMap sxmap, OUT* __restrict__ y, long ldy, int M, int N, int tiles, \
        int chunks, int groups) {                                                                    \
        wgmma_gemm<TOK, false>(&xmap,                                                                \
                               WgqComet<TOK>{WgqW4A8<TOK>{&wmap, &pmap, tiles, chunks, groups, 7, 1}, \
                                             &swmap, &sxmap, tiles},                                 \
                               y, ldy, M, N, 1, (float*)nullptr, (int*)nullptr, W4Epilogue{});       \
    }
#define COMET_WGMMA(OUTNAME, OUT)                           \
    COMET_WGMMA_ENTRY(comet_wgmma128_##OUTNAME, 128, OUT)   \
    COMET_WGMMA_ENTRY(comet_wgmma64_##OUTNAME, 64, OUT)
COMET_WGMMA(f32, float)
COMET_WGMMA(f16, __half)
COMET_WGMMA(bf16, __nv_bfloat16)

#endif  // sm_90a

// COMET W4A4A8 (FMPQ, COMET §3-4): INT4 weights in groups, activations in channel blocks of the
// group size, the leading `int8_blocks` blocks INT8 and the rest INT4, one scale per token and
// block. The arithmetic is nibble_precision::reference's COMET rule: per block an exact i32 dot
// p_b, then y = fma(f32(p_b), s_w,b * s_x,b, y) over the blocks in order from 0.
//
// Hopper has no 4-bit tensor-core math (mma.sync s4 about 45 TOPS against about 1,290 for s8 on
// an H100), so both halves widen to INT8 before the tensor cores: the quantizer writes every
// block's codes as INT8 bytes (an INT4 block's within [-7, 7]) and the GEMM widens the weights'
// nibbles to q - z in registers. What COMET could still win on Hopper is activation bytes (half
// for the INT4 blocks), which only matter where the GEMM is bound by them; these kernels store
// them at 8 bits. The tiled GEMM measured 2.4x to 11x slower than W4A8 on an H100 (BENCHMARKS.md,
// issue 18); comet_gemv (below), the decode path built after that, is 1.0x to 5.9x faster and the
// default for decode batches (comet::gemv_takes). Past it, comet_wgmma (qgemm_wgmma.cu, groups
// of 128, by default; NIBBLE_COMET_WGMMA=0 turns it off) runs the same arithmetic on W4A8's wgmma
// pipeline, 1.5x to 5.3x faster than the tiled GEMM on an H200; the tiled GEMM is left for other
// group sizes and GPUs without sm_90a.
//
// comet_quantize_*: one CTA per token row, a warp per block (blocks of 32 to 128 channels: one to
// four values a lane), the block's max by shuffles; codes [M][K] INT8, the scale of token m and
// block b f32 at sx[m * sx_row + b * sx_block] ([M][blocks] for the kernels here, [blocks][M
// rounded up] for comet_wgmma in qgemm_wgmma.cu).
//
// comet_gemm_*: mma.sync m16n8k32 s8 tiles. A CTA is 4 warps over 64 weight rows x 32 tokens
// (a warp: 16 rows x four 8-token tiles). Each k32 step of a block, lane (g, t) reads channels
// 8t .. 8t + 7 of the step: the 4 code bytes of rows g and g + 8 (8 nibbles each, widened to two
// registers of q - z with the row's group zero) and 8 activation bytes of its token of each
// tile; registers 0 / 2 (row g) and 1 / 3 (row g + 8) take channels 8t .. 8t + 3 / 8t + 4 ..
// 8t + 7, the B registers the same channels of the token: the k32 step's K order is permuted
// alike on both sides, and an integer dot does not depend on the order. The step's products go
// to an i32 fragment zeroed at each block; at the block's end each output adds
// f32(fragment) * (s_w,b * s_x,b) to its f32 accumulator with one fma, in block order: the
// reference's bits. No split K (it would reorder the block sum). Weights are read as the
// checkpoint's rows (nibbles, low first; packing: comet.rs), through L1, not staged.

// One value's code of a block with this scale (quantize_int: ties to even, clamped to qmax).
__device__ __forceinline__ signed char comet_code(float v, float scale, float qmax) {
    return (signed char)fminf(fmaxf(rintf(v / scale), -qmax), qmax);
}

template <class IN>
__device__ void comet_quantize_impl(const IN* __restrict__ x, long ldx, signed char* __restrict__ q,
                                    float* __restrict__ sx, long sx_row, long sx_block, int cols, int block,
                                    int int8_blocks) {
    const long row = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int blocks = cols / block, per_lane = block >> 5;  // 1 to 4 (blocks of 32 to 128)
    for (int b = warp; b < blocks; b += warps) {
        float v[4];
        float amax = 0.f;
        bool finite = true;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < per_lane) {
                v[i] = to_f32(x[row * ldx + (long)b * block + i * 32 + lane]);
                finite &= isfinite(v[i]);
                amax = fmaxf(amax, fabsf(v[i]));
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        finite = __all_sync(0xffffffffu, finite);
        const float qmax = b < int8_blocks ? 127.f : 7.f;
        const float scale = finite ? amax / qmax : __int_as_float(0x7fc00000);
        const bool on = finite && scale != 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < per_lane)
                q[row * cols + (long)b * block + i * 32 + lane] = on ? comet_code(v[i], scale, qmax) : (signed char)0;
        if (lane == 0) sx[row * sx_row + b * sx_block] = scale;
    }
}

#define COMET_QUANTIZE(SUFFIX, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(1024) comet_quantize_##SUFFIX(                     \
        const T* x, long ldx, signed char* q, float* sx, long sx_row, long sx_block, int cols,      \
        int block, int int8_blocks) {                                                               \
        comet_quantize_impl<T>(x, ldx, q, sx, sx_row, sx_block, cols, block, int8_blocks);            \
    }
COMET_QUANTIZE(f32, float)
COMET_QUANTIZE(bf16, __nv_bfloat16)
COMET_QUANTIZE(f16, __half)

__device__ __forceinline__ void comet_mma(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Eight nibbles (channels k .. k + 7, low nibble first) minus the zero `z`, as INT8 bytes:
// `lo` channels k .. k + 3, `hi` k + 4 .. k + 7 (q - z in [-15, 15]: the byte-wise wrap of
// __vsub4 is its two's complement).
__device__ __forceinline__ void comet_widen(u32 w, u32 z, u32& lo, u32& hi) {
    const u32 even = w & 0x0f0f0f0fu, odd = (w >> 4) & 0x0f0f0f0fu;  // channels k, k+2, .. / k+1, ..
    const u32 zz = z * 0x01010101u;
    lo = __vsub4(__byte_perm(even, odd, 0x5140), zz);
    hi = __vsub4(__byte_perm(even, odd, 0x7362), zz);
}

// What lane (g, t) of a warp reads: the code words of rows g and g + 8 of the warp's 16 from
// row0 (channel 8t of each k32 step) and the codes of token g of each 8-token tile from m0.
// Rows and tokens past the edges read row / token 0 (and are never stored).
template <int TT> struct CometLane {
    int ra, rb;
    const unsigned char *wa, *wb;
    const signed char* xt[TT];
    __device__ CometLane(const unsigned char* codes, const signed char* x, int row0, int m0, int M, int N,
                         int K, int lane) {
        const int g = lane >> 2, t = lane & 3;
        ra = row0 + g < N ? row0 + g : 0;
        rb = row0 + g + 8 < N ? row0 + g + 8 : 0;
        wa = codes + (long)ra * (K / 2) + 4 * t;
        wb = codes + (long)rb * (K / 2) + 4 * t;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            const int m = m0 + tt * 8 + g;
            xt[tt] = x + (long)(m < M ? m : 0) * K + 8 * t;
        }
    }
};

#define COMET_TT 4                  // 8-token tiles a warp
#define COMET_TOKENS (COMET_TT * 8)  // tokens a CTA
#define COMET_ROWS 64                // weight rows a CTA (4 warps of 16)

// codes [N][K / 2] (a row's nibbles), zeros [N][groups] u8, sw [N][groups] f32 (the f16 group
// scales); x [M][K] INT8 codes, sx [M][groups] f32; y [M][N] (row stride ldy).
template <class OUT>
__device__ void comet_gemm_impl(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ zeros,
                                const float* __restrict__ sw, const signed char* __restrict__ x,
                                const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M, int N,
                                int K, int block) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * COMET_ROWS + warp * 16, m0 = blockIdx.y * COMET_TOKENS;
    const int blocks = K / block, steps = block >> 5;
    const CometLane<COMET_TT> L(codes, x, row0, m0, M, N, K, lane);
    const int ra = L.ra, rb = L.rb;
    const unsigned char *wa = L.wa, *wb = L.wb;
    const signed char* const* xt = L.xt;
    float acc[COMET_TT][4] = {};
    for (int b = 0; b < blocks; ++b) {
        int frag[COMET_TT][4] = {};
        const u32 za = zeros[(long)ra * blocks + b], zb = zeros[(long)rb * blocks + b];
        for (int s = 0; s < steps; ++s) {
            const int k = b * block + s * 32;  // the step's first channel
            u32 a[4];
            comet_widen(*reinterpret_cast<const u32*>(wa + k / 2), za, a[0], a[2]);
            comet_widen(*reinterpret_cast<const u32*>(wb + k / 2), zb, a[1], a[3]);
#pragma unroll
            for (int tt = 0; tt < COMET_TT; ++tt) {
                const uint2 v = *reinterpret_cast<const uint2*>(xt[tt] + k);
                comet_mma(frag[tt], a, v.x, v.y);
            }
        }
        // The block's sums into the accumulators: one f32 product of the two scales, one fma.
        const float swa = sw[(long)ra * blocks + b], swb = sw[(long)rb * blocks + b];
#pragma unroll
        for (int tt = 0; tt < COMET_TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = min(m0 + tt * 8 + 2 * t + (e & 1), M - 1);
                const float c = (e < 2 ? swa : swb) * sx[(long)m * blocks + b];
                acc[tt][e] = fmaf((float)frag[tt][e], c, acc[tt][e]);
            }
    }
#pragma unroll
    for (int tt = 0; tt < COMET_TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = row0 + g + 8 * (e >> 1), m = m0 + tt * 8 + 2 * t + (e & 1);
            if (n < N && m < M) y[(long)m * ldy + n] = from_f32<OUT>(acc[tt][e]);
        }
}

// comet_gemv<TT>_*: the same per-block arithmetic for decode batches (up to 32 tokens), with the
// K range spread over a CTA's warps so that a layer's weights stream from many CTAs at once (the
// tiled kernel gives a 4096-row layer 64 CTAs, each walking all of K: 163 us for 4096x14336 at one
// token on an H100, where its 31 MB of weights take about 11). A CTA is 8 warps over 16 weight
// rows x 8 TT tokens. A round covers 16 consecutive blocks, two a warp (blocks b0 + w and
// b0 + 8 + w): a warp requests both blocks' weight and activation words first (all the round's
// weight bytes in flight at once) while the CTA stages the round's scales in shared memory, then
// forms each block's exact i32 fragment with comet_gemm's lane recipe and parks it in shared
// memory at the block's slot. After a barrier each thread folds its own
// outputs over the round's slots in block order, fma(f32(p_b), s_w,b * s_x,b, y): the reference's
// bits, as the tiled kernel. Fragment index (tt * 4 + e) * 32 + lane names an output, for the
// parking warp and the folding thread alike.
#define COMET_GEMV_SLOTS 16  // blocks a round: two for each of the 8 warps

template <int TT, class OUT>
__device__ void comet_gemv_impl(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ zeros,
                                const float* __restrict__ sw, const signed char* __restrict__ x,
                                const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M, int N,
                                int K, int block) {
    __shared__ int part[COMET_GEMV_SLOTS][TT * 4][32];
    __shared__ float swr[16][COMET_GEMV_SLOTS];      // the round's weight scales by row, slot
    __shared__ float sxr[TT * 8][COMET_GEMV_SLOTS];  // and activation scales by token, slot
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * 16, m0 = blockIdx.y * (TT * 8);
    const int blocks = K / block, steps = block >> 5;
    const CometLane<TT> L(codes, x, row0, m0, M, N, K, lane);
    const int ra = L.ra, rb = L.rb;
    const unsigned char *wa = L.wa, *wb = L.wb;
    const signed char* const* xt = L.xt;
    constexpr int OUTS = TT * 128, OWN = (OUTS + 255) / 256;  // outputs a CTA / a thread folds
    float acc[OWN];
#pragma unroll
    for (int i = 0; i < OWN; ++i) acc[i] = 0.f;
    for (int b0 = 0; b0 < blocks; b0 += COMET_GEMV_SLOTS) {
        // The round's weight words, zeros and activation words of both slots, all requested
        // before the first mma (a slot past the last block reads the last block again and parks
        // nothing; a step past a block's last re-reads its first).
        u32 w[2][2][4], z[2][2];
        uint2 v[2][4][TT];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int b = min(b0 + warp + 8 * j, blocks - 1);
            z[j][0] = zeros[(long)ra * blocks + b];
            z[j][1] = zeros[(long)rb * blocks + b];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const int k = b * block + (s < steps ? s : 0) * 32;
                w[j][0][s] = *reinterpret_cast<const u32*>(wa + k / 2);
                w[j][1][s] = *reinterpret_cast<const u32*>(wb + k / 2);
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) v[j][s][tt] = *reinterpret_cast<const uint2*>(xt[tt] + k);
            }
        }
        // The round's scales into shared memory, so the fold reads no global memory: rows past N
        // take row 0's, tokens past M token M - 1's (as the tiled kernel; never stored).
        for (int i = threadIdx.x; i < (16 + TT * 8) * COMET_GEMV_SLOTS; i += 256) {
            const int r = i / COMET_GEMV_SLOTS, sl = i % COMET_GEMV_SLOTS;
            const int b = min(b0 + sl, blocks - 1);
            if (r < 16)
                swr[r][sl] = sw[(long)(row0 + r < N ? row0 + r : 0) * blocks + b];
            else
                sxr[r - 16][sl] = sx[(long)min(m0 + r - 16, M - 1) * blocks + b];
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (b0 + warp + 8 * j >= blocks) continue;  // (warp-uniform)
            // Steps past the block's last multiply zero weights (branch-free, so the loads above
            // stay ahead of the mmas).
            int frag[TT][4] = {};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 a[4];
                comet_widen(w[j][0][s], z[j][0], a[0], a[2]);
                comet_widen(w[j][1][s], z[j][1], a[1], a[3]);
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = s < steps ? a[i] : 0u;
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) comet_mma(frag[tt], a, v[j][s][tt].x, v[j][s][tt].y);
            }
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[warp + 8 * j][tt * 4 + e][lane] = frag[tt][e];
        }
        __syncthreads();
        const int used = min(COMET_GEMV_SLOTS, blocks - b0);
#pragma unroll
        for (int i = 0; i < OWN; ++i) {
            const int o = threadIdx.x + 256 * i;
            if (o < OUTS) {
                const int ol = o & 31, e = (o >> 5) & 3, tt = o >> 7;
                const float* srow = swr[(ol >> 2) + 8 * (e >> 1)];
                const float* stok = sxr[tt * 8 + 2 * (ol & 3) + (e & 1)];
                for (int sl = 0; sl < used; ++sl)
                    acc[i] = fmaf((float)part[sl][tt * 4 + e][ol], srow[sl] * stok[sl], acc[i]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < OWN; ++i) {
        const int o = threadIdx.x + 256 * i;
        if (o < OUTS) {
            const int ol = o & 31, e = (o >> 5) & 3, tt = o >> 7;
            const int n = row0 + (ol >> 2) + 8 * (e >> 1), m = m0 + tt * 8 + 2 * (ol & 3) + (e & 1);
            if (n < N && m < M) y[(long)m * ldy + n] = from_f32<OUT>(acc[i]);
        }
    }
}

#define COMET_GEMV(TT, SUFFIX, OUT)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) comet_gemv##TT##_##SUFFIX(                    \
        const unsigned char* codes, const unsigned char* zeros, const float* sw, const signed char* x, \
        const float* sx, OUT* y, long ldy, int M, int N, int K, int block) {                        \
        comet_gemv_impl<TT, OUT>(codes, zeros, sw, x, sx, y, ldy, M, N, K, block);                    \
    }
#define COMET_GEMVS(SUFFIX, OUT) COMET_GEMV(1, SUFFIX, OUT) COMET_GEMV(2, SUFFIX, OUT) COMET_GEMV(4, SUFFIX, OUT)
COMET_GEMVS(f32, float)
COMET_GEMVS(bf16, __nv_bfloat16)
COMET_GEMVS(f16, __half)

#define COMET_GEMM(SUFFIX, OUT)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) comet_gemm_##SUFFIX(                          \
        const unsigned char* codes, const unsigned char* zeros, const float* sw, const signed char* x, \
        const float* sx, OUT* y, long ldy, int M, int N, int K, int block) {                        \
        comet_gemm_impl<OUT>(codes, zeros, sw, x, sx, y, ldy, M, N, K, block);                        \
    }
COMET_GEMM(f32, float)
COMET_GEMM(bf16, __nv_bfloat16)
COMET_GEMM(f16, __half)

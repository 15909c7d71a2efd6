// Quantized GEMMs, mma.sync tier (sm_80 and later): y[m][n] = sum_k x[m][k] * w[n][k].
//   W4A16 (TurboMind §3-4.1): UINT4 weights with per-group f16 scale and integer zero, f16/bf16
//         activations, f32 accumulation; weights dequantized in registers right before the MMA.
//   W8A8  (QServe §4, S1): INT8 per-token activations x INT8 per-channel weights on INT8 tensor
//         cores, i32 accumulation, y = f32(acc) * (sx[m] * sw[n]) in the epilogue (bit-exact with
//         nibble_precision::reference).
//   W8A16 (the Hopper tier only: qgemv.cu, qgemm_wgmma.cu): INT8 per-channel weights made exact
//         16-bit values in registers (w8_pair: two lop3 and a subtraction per pair), 16-bit
//         activations, f32 accumulation, y = acc * sw[n] in the epilogue; the W4A16 machinery
//         with 8-bit codes (pack::w8a16_slot).
//
// Operand roles (swap-AB): weight rows are the MMA's M side (16-row tiles), tokens its N side
// (8-token tiles): a decode step of 1 token leaves 7/8 of an m16n8 MMA idle instead of 15/16,
// and the weights, the bytes that matter, stream through the A fragments.
//
// Data layout: weights are packed offline (src/pack.rs, derived from the PTX fragment layout) as
// [tile][chunk of 64 K][lane] fragments: 16 B per lane per chunk for INT4 (one u32 per k16 step),
// 32 B for INT8 (two k32 steps). For the 16-bit activations, K is permuted within a chunk so
// that lane t's B fragments are the 16 consecutive channels t*16 .. t*16+15, read as plain
// 16-byte vectors. INT8 fragments keep K in natural order (the wgmma tier's, pack::KOrder), so
// INT8 activations are staged with each chunk's 4-byte words transposed (stage_x16): lane t's
// 16-byte vector is again its B registers of both k32 steps. A warp's weight fetch for a chunk
// is 512 (1024) contiguous bytes. INT4 group parameters
// are (scale, magic + zero) 16-bit pairs, [tile][group][g][row g | row g+8], 8 B per lane.
//
// INT4 -> 16-bit conversion: lop3 ((w >> 4r) & 0x000f000f) | magic puts nibbles r and r+4 into
// a half2 as magic + q (magic 1024 for f16, 128 for bf16), then (x - (magic + z)) * s: one exact
// subtraction and one rounding, the dequantized reference's value.
//
// Two kernels per format:
//   *_gemv{1,2,4,8} (M <= 8, 16, 32, 64: decode and small batches): the CTA's slice of the
//     activations is staged in shared memory once; each warp owns one 16-row tile over that K range and streams its weights with
//     L1-bypassing 16-byte loads, software-pipelined in registers (the next U chunks load while
//     the current U are dequantized and multiplied); CTAs split K (grid.y) and the last CTA of a
//     row block sums the f32 (i32 for W8A8) partials in split order, so results are
//     deterministic (CUDA-graph replay is bit-identical).
//   *_tiled (larger M): CTA tile 128 weight rows x 128 tokens x 64 K, 8 warps as 4 (rows) x 2
//     (tokens), a 4-stage cp.async pipeline (stage c+3 streams in while stage c is dequantized
//     and multiplied), weights read from shared memory with one 16-byte load per lane per chunk.
//     Activation rows are padded (f16: 144 B) or not (INT8: 64 B) so B-fragment loads are free
//     of bank conflicts.
//   w4a16_grouped{1,2,4,8} (mixture-of-experts layers, W4A16 past the grouped decode gemv of
//     qgemv_grouped.cu): the W4A16 gemv over a
//     table of items on grid.z, each item one expert's weights over up to 64 consecutive rows of
//     the input gathered in expert order; the routed experts of a layer in one launch.
// The Hopper tier is compiled into the same module: the persistent decode gemv (qgemv.cu) for up
// to 16 tokens and the wgmma kernels (qgemm_wgmma.cu) for large M; BENCHMARKS.md has where these
// kernels stand against cuBLAS.

#define QG_WARPS 8
#define QG_THREADS (QG_WARPS * 32)
#define TILED_STAGES 4


// 16 (8) bytes global -> shared; when `valid` is false the destination is zero-filled instead.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

// INT8 activations (signed char) always meet INT8 fragments in natural K order (pack.rs,
// KOrder::Natural); 16-bit and FP8 (unsigned char) ones meet fragments that read them in order.
template <class X> struct StagesWordTransposed { static constexpr bool value = false; };
template <> struct StagesWordTransposed<signed char> { static constexpr bool value = true; };

// Segment `seg` (16 bytes) of an activation chunk (64 channels) into shared memory at `chunk`,
// cp.async, zero-filled when `valid` is false. INT8 chunks are staged as a 4x4 transpose of
// their words (staged word 4t + w is the chunk's word 4w + t, pack::s8_staged_channel): lane t's
// 16-byte vector then holds channels 4t, 16 + 4t, 32 + 4t and 48 + 4t onwards, its B registers of
// the chunk's two k32 steps. Four 4-byte copies a segment: the decode kernels stage a CTA's
// window once, and the mma.sync tiles are the tier for GPUs without wgmma.
template <class X>
__device__ __forceinline__ void stage_x16(unsigned char* chunk, int seg, const X* src, bool valid) {
    if constexpr (StagesWordTransposed<X>::value) {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
#pragma unroll
        for (int t = 0; t < 4; ++t) cp_async4(chunk + 16 * t + 4 * seg, s + 4 * t, valid);
    } else {
        cp_async16(chunk + 16 * seg, src, valid);
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// A streamed weight load: read once, so keep it out of L1.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 mask, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return r;
}

template <class T> struct W4Math;
template <> struct W4Math<__half> {
    static constexpr u32 MAGIC = 0x64006400u;  // 1024.0 in both halves
    // Ten mantissa bits: a nibble at bits 4-7 under the magic reads as magic + 16 q.
    static constexpr bool NIBBLE_AT_4 = true;
    static constexpr float MAGIC_F = 1024.f;
    static __device__ __forceinline__ u32 sub(u32 x, u32 y) {
        __half2 r = __hsub2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&y));
        return *reinterpret_cast<u32*>(&r);
    }
    static __device__ __forceinline__ u32 sub_mul(u32 x, u32 z, u32 s) {
        __half2 r = __hmul2(__hsub2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&z)),
                            *reinterpret_cast<__half2*>(&s));
        return *reinterpret_cast<u32*>(&r);
    }
};
template <> struct W4Math<__nv_bfloat16> {
    static constexpr u32 MAGIC = 0x43004300u;  // 128.0 in both halves
    static constexpr bool NIBBLE_AT_4 = false;  // seven mantissa bits: bit 7 is the exponent's
    static constexpr float MAGIC_F = 128.f;
    static __device__ __forceinline__ u32 sub(u32 x, u32 y) {
        __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&x), *reinterpret_cast<__nv_bfloat162*>(&y));
        return *reinterpret_cast<u32*>(&r);
    }
    static __device__ __forceinline__ u32 sub_mul(u32 x, u32 z, u32 s) {
        __nv_bfloat162 r = __hmul2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&x),
                                           *reinterpret_cast<__nv_bfloat162*>(&z)),
                                   *reinterpret_cast<__nv_bfloat162*>(&s));
        return *reinterpret_cast<u32*>(&r);
    }
};

// The four A registers of one k16 step from its INT4 word; `p` holds (scale, magic + zero) of
// rows g (p.x) and g + 8 (p.y). Register r is rows g / g+8 for even / odd r (pack.rs).
template <class T> __device__ __forceinline__ void dequant_step(u32 word, uint2 p, u32 (&a)[4]) {
    const u32 s0 = __byte_perm(p.x, 0, 0x1010), z0 = __byte_perm(p.x, 0, 0x3232);
    const u32 s1 = __byte_perm(p.y, 0, 0x1010), z1 = __byte_perm(p.y, 0, 0x3232);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const u32 x = lop3_and_or(word >> (4 * r), 0x000f000fu, W4Math<T>::MAGIC);
        a[r] = W4Math<T>::sub_mul(x, (r & 1) ? z1 : z0, (r & 1) ? s1 : s0);
    }
}

// W8A16: one A register (two 16-bit values, exactly q) from INT8 codes at bytes 0 and 2 of
// `word` (pack::w8a16_slot puts a register's pair there): the low seven bits under the magic
// read as magic + (q & 127), the sign bit under it as magic + 128 * sign, and their difference,
// exact in either dtype, is the two's-complement value q = (q & 127) - 128 * sign.
template <class T> __device__ __forceinline__ u32 w8_pair(u32 word) {
    const u32 low = lop3_and_or(word, 0x007f007fu, W4Math<T>::MAGIC);
    const u32 sign = lop3_and_or(word, 0x00800080u, W4Math<T>::MAGIC);
    return W4Math<T>::sub(low, sign);
}

// The four A registers of one k16 step from its two W8A16 words (rows g and g + 8): register
// 2q + h holds channels 2q, 2q + 1 of the step's four for row g + 8h.
template <class T> __device__ __forceinline__ void w8_step(u32 row0, u32 row8, u32 (&a)[4]) {
    a[0] = w8_pair<T>(row0);
    a[1] = w8_pair<T>(row8);
    a[2] = w8_pair<T>(row0 >> 8);
    a[3] = w8_pair<T>(row8 >> 8);
}

__device__ __forceinline__ void mma_s8(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float to_out(float v, float*) { return v; }
__device__ __forceinline__ __half to_out(float v, __half*) { return __float2half_rn(v); }
__device__ __forceinline__ __nv_bfloat16 to_out(float v, __nv_bfloat16*) { return __float2bfloat16_rn(v); }

// The epilogue's view of one output: W4A16 outputs its f32 sum, W8A8 scales its i32 sum.
// Each epilogue also has a Tile<CH>: the scales of one thread's outputs in a store_tile, loaded
// ahead of the stores: its rows' (n0 and n0 + 8) once, then its tokens' (m0 + 8 tt and
// m0 + 8 tt + 1, tt < CH) a chunk of CH token blocks at a time (`tokens`). Loaded per output
// instead, every load waited behind the last store (nothing tells ptxas the scales are not y),
// one L1 round trip an output in a row: 128 of the epilogue's 202 stall samples in ncu
// (bench/results/wgmma-profile-20261126-h100) and about 4 us a 128 x 128 FP8 tile against
// torch._scaled_mm's (docs/design/hopper-gemm-next.md). e is the PTX C fragment's index: row
// n0 + 8 (e >> 1), token m0 + 8 tt + (e & 1).
struct W4Epilogue {
    __device__ __forceinline__ float operator()(float v, int, int) const { return v; }
    template <int CH> struct Tile {
        __device__ __forceinline__ Tile(const W4Epilogue&, int, int) {}
        __device__ __forceinline__ void tokens(const W4Epilogue&, int, int) {}
        __device__ __forceinline__ float operator()(float v, int, int) const { return v; }
    };
};
// W4A8: a packed word's eight 4-bit codes widened to two registers of INT8 (its low nibbles,
// then its high ones) by a group's byte-affine parameters `p` = scale | offset << 16 (offset an
// i16): per register one IMAD and one XOR for four values, (q * s + offset) ^ 0x80 per byte with
// no carry between bytes (LiquidGEMM §4; QoQ's (q - z) * s is offset = 128 - z * s, QServe §5's
// subtraction after multiplication folded into the addend). nibble_precision::byte_affine_word
// is the reference; pack.rs checks at load that every group is exact.
struct W4A8Affine {
    u32 s, off;
    __device__ __forceinline__ explicit W4A8Affine(u32 p) : s(p & 0xffffu), off((u32)((int)p >> 16) * 0x01010101u) {}
    __device__ __forceinline__ void widen(u32 w, u32& lo, u32& hi) const {
#ifdef W4A8_NO_WIDEN  // probe (wrong results): the widening's issue slots, bounded
        lo = w;
        hi = w >> 4;
#else
        lo = ((w & 0x0f0f0f0fu) * s + off) ^ 0x80808080u;
        hi = (((w >> 4) & 0x0f0f0f0fu) * s + off) ^ 0x80808080u;
#endif
    }
};

// W8A16: f32 sums of the exact INT8 codes times 16-bit activations, times the row's scale.
struct RowScaleEpilogue {
    const float* sw;
    __device__ __forceinline__ float operator()(float v, int, int n) const { return v * sw[n]; }
    template <int CH> struct Tile {
        float w[2];
        __device__ __forceinline__ Tile(const RowScaleEpilogue& epi, int n0, int N) {
            w[0] = epi.sw[min(n0, N - 1)];
            w[1] = epi.sw[min(n0 + 8, N - 1)];
        }
        __device__ __forceinline__ void tokens(const RowScaleEpilogue&, int, int) {}
        __device__ __forceinline__ float operator()(float v, int, int e) const { return v * w[e >> 1]; }
    };
};

struct W8Epilogue {
    const float* sx;
    const float* sw;
    // i32 sums (INT8) or f32 sums (FP8): the sum times one f32 product of the two scales.
    template <class A> __device__ __forceinline__ float operator()(A v, int m, int n) const {
        return (float)v * (sx[m] * sw[n]);
    }
    template <int CH> struct Tile {
        float w[2], x[CH][2];
        __device__ __forceinline__ Tile(const W8Epilogue& epi, int n0, int N) {
            w[0] = epi.sw[min(n0, N - 1)];
            w[1] = epi.sw[min(n0 + 8, N - 1)];
        }
        __device__ __forceinline__ void tokens(const W8Epilogue& epi, int m0, int M) {
#pragma unroll
            for (int tt = 0; tt < CH; ++tt) {
                x[tt][0] = epi.sx[min(m0 + tt * 8, M - 1)];
                x[tt][1] = epi.sx[min(m0 + tt * 8 + 1, M - 1)];
            }
        }
        template <class A> __device__ __forceinline__ float operator()(A v, int tt, int e) const {
            return (float)v * (x[tt][e & 1] * w[e >> 1]);
        }
    };
};

// SwiGLU in the epilogue: the weight is a gate/up pair packed with its rows interleaved in runs
// of 8 (rows 16j .. 16j + 7 are gate channels 8j .., rows 16j + 8 .. the up channels 8j ..;
// qlinear::swiglu_rows), so the thread that holds row g of a 16-row tile holds its up partner,
// row g + 8, too. It writes silu(gate) * up, each side the f32 value `inner` gives (what the
// plain GEMM would store), to column 8j + g of an [M, N / 2] output in the model dtype: the bits
// of the plain GEMM followed by the SiLU-gate kernel, without the f32 round trip of both halves
// (docs/design/decode-step-256.md).
template <class EPI> struct SwiGluEpilogue {
    EPI inner;
    template <class A> __device__ __forceinline__ float operator()(A gate, A up, int m, int n) const {
        return SiluMul{}(inner(gate, m, n), inner(up, m, n + 8));
    }
    // Gate row n0 (e = 0, 1) and its up partner n0 + 8 (e + 2): the inner tile's two rows.
    template <int CH> struct Tile {
        typename EPI::template Tile<CH> in;
        __device__ __forceinline__ Tile(const SwiGluEpilogue& epi, int n0, int N) : in(epi.inner, n0, N) {}
        __device__ __forceinline__ void tokens(const SwiGluEpilogue& epi, int m0, int M) { in.tokens(epi.inner, m0, M); }
        template <class A> __device__ __forceinline__ float operator()(A gate, A up, int tt, int e) const {
            return SiluMul{}(in(gate, tt, e), in(up, tt, e + 2));
        }
    };
};
template <class EPI> struct IsSwiGlu { static constexpr bool value = false; };
template <class EPI> struct IsSwiGlu<SwiGluEpilogue<EPI>> { static constexpr bool value = true; };
// The entry macros' epilogue wrappers: an epilogue as it is, or as SwiGLU's inner one.
template <class EPI> __device__ __forceinline__ EPI plain_epilogue(EPI e) { return e; }
template <class EPI> __device__ __forceinline__ SwiGluEpilogue<EPI> swiglu_epilogue(EPI e) { return {e}; }

// Stores a warp's 16-row x (TT * 8)-token accumulator tile: c0, c1 are row g at tokens 2t, 2t+1,
// c2, c3 row g + 8 (PTX C fragment); with a SwiGLU epilogue, the product of the two rows. The
// scales are loaded ahead of the stores (EPI::Tile), in chunks of 16 token blocks (32 registers),
// so a 256-token tile does not hold its 64 token scales beside its 128 accumulators at once. The
// wgmma tier stores through store_tile_staged instead (qgemm_wgmma.cu).
template <int TT, class A, class OUT, class EPI>
__device__ __forceinline__ void store_tile(const A (&acc)[TT][4], int row0, int tok0, int M, int N,
                                           OUT* y, long ldy, const EPI& epi) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#ifdef WGQ_EPI_OFF  // probe (wrong results): the tile's cost without its epilogue
    A sum = 0;
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) sum += acc[tt][0] + acc[tt][1] + acc[tt][2] + acc[tt][3];
    if (sum == (A)123457) y[lane] = to_out(0.f, (OUT*)nullptr);  // keeps the sums; never true in the bench
    return;
#endif
    constexpr int CH = TT < 16 ? TT : 16;
    typename EPI::template Tile<CH> at(epi, row0 + g, N);
#pragma unroll
    for (int c = 0; c < TT; c += CH) {
        at.tokens(epi, tok0 + 8 * c + 2 * t, M);
#pragma unroll
        for (int tt = 0; tt < CH; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = row0 + g + 8 * (e >> 1), m = tok0 + (c + tt) * 8 + 2 * t + (e & 1);
                if constexpr (IsSwiGlu<EPI>::value) {
                    // The value pinned before the bounds check, so only the store is conditional:
                    // with the SiLU inside the check, ptxas made each output a branch of its own
                    // (SASS of c37a6c6), about 6 us a 256-token tile. Gate rows n < N have their
                    // up partner n + 8 < N (N a multiple of 16).
                    if (e < 2) {
                        float v = at(acc[c + tt][e], acc[c + tt][e + 2], tt, e);
                        asm volatile("" : "+f"(v));  // computed here, not sunk into the store's branch
                        if (n < N && m < M) y[(long)m * ldy + (row0 >> 1) + g] = to_out(v, (OUT*)nullptr);
                    }
                } else {
                    if (n < N && m < M) y[(long)m * ldy + n] = to_out(at(acc[c + tt][e], tt, e), (OUT*)nullptr);
                }
            }
    }
}

// Split-K for the gemv kernels: every CTA writes its partial sums; the last CTA of a row block
// to arrive (a counter per row block, reset by that CTA for the next launch) adds them in split
// order and writes y. Returns after the non-last CTAs are done.
template <int TT, class A, class OUT, class EPI>
__device__ __forceinline__ void split_k_finish(const A (&acc)[TT][4], int tile, int M, int N,
                                               int npad, A* partial, int* counters, OUT* y, long ldy,
                                               const EPI& epi) {
    static_assert(!IsSwiGlu<EPI>::value, "the mma.sync tiers have no SwiGLU entries");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int splits = gridDim.y;
    if (splits == 1) {
        store_tile<TT>(acc, tile * 16, 0, M, N, y, ldy, epi);
        return;
    }
    A* mine = partial + (long)blockIdx.y * M * npad;
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = tile * 16 + g + 8 * (e >> 1), m = tt * 8 + 2 * t + (e & 1);
            if (n < npad && m < M) mine[(long)m * npad + n] = acc[tt][e];
        }
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1) == splits - 1;
        if (last) counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int rows = QG_WARPS * 16, n0 = blockIdx.x * rows;
    for (int i = threadIdx.x; i < rows * M; i += blockDim.x) {
        const int m = i / rows, n = n0 + i % rows;
        if (n >= N) continue;
        A s = 0;
        for (int sp = 0; sp < splits; ++sp) s += __ldcg(partial + ((long)sp * M + m) * npad + n);
        y[(long)m * ldy + n] = to_out(epi(s, m, n), (OUT*)nullptr);
    }
}

// ---------------------------------------------------------------------------------------------
// W4A16

// Row stride (bytes) of the gemv kernels' activation slice in shared memory: a quarter-warp's
// 16-byte B loads (tokens g, g+1 at lanes' offsets t*32 (f16) or t*16 (INT8)) then hit 32
// distinct banks.
__device__ __forceinline__ int gemv_x_stride(int cps, int elem_bytes) {
    return elem_bytes == 2 ? cps * 128 + 16 : ((cps * 64 + 127) / 128) * 128 + 64;
}

// Stages tokens 0..M-1, channels [c0*64, c1*64) of x into shared memory (zero past K).
template <class X>
__device__ __forceinline__ void gemv_stage_x(unsigned char* xs, int stride, const X* x, long ldx,
                                             int M, int K, int c0, int c1) {
    constexpr int SEGS = 4 * (int)sizeof(X);  // 16-byte segments a chunk
    const int segs = (c1 - c0) * SEGS;
    for (int i = threadIdx.x; i < M * segs; i += blockDim.x) {
        const int row = i / segs, seg = i % segs;
        const int k = c0 * 64 + seg * 16 / (int)sizeof(X);
        const bool ok = k < K;
        stage_x16(xs + row * stride + seg / SEGS * SEGS * 16, seg % SEGS, x + (ok ? (long)row * ldx + k : 0), ok);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

__device__ __forceinline__ int group_of(int k, int group_len, int group_shift) {
    return group_shift >= 0 ? k >> group_shift : k / group_len;
}

// Decode-size W4A16: the CTA's activation slice sits in shared memory; each warp streams its
// tile's weights for chunks [c0, c1) U chunks at a time, loading group i+1 into registers while
// group i is dequantized and multiplied.
template <class T, int TT, int U, class OUT>
__device__ void w4a16_gemv_impl(const uint4* __restrict__ codes, const uint2* __restrict__ params,
                                const T* __restrict__ x, long ldx, OUT* __restrict__ y, long ldy,
                                float* __restrict__ partial, int* __restrict__ counters, int M,
                                int N, int K, int tiles, int chunks, int groups, int group_len,
                                int group_shift, int chunks_per_split) {
    extern __shared__ __align__(16) unsigned char xs[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * QG_WARPS + warp;
    const int c0 = blockIdx.y * chunks_per_split, c1 = min(chunks, c0 + chunks_per_split);
    const int stride = gemv_x_stride(chunks_per_split, 2);
    gemv_stage_x(xs, stride, x, ldx, M, K, c0, c1);
    float acc[TT][4] = {};
    if (tile < tiles) {
        const uint4* wp = codes + (long)tile * chunks * 32 + lane;
        const uint2* pp = params + (long)tile * groups * 8 + g;
        uint4 w[U];
        uint2 p[U];
        auto fetch = [&](int c, uint4 (&wv)[U], uint2 (&pv)[U]) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cc = min(c + u, c1 - 1);
                wv[u] = ld_stream(wp + (long)cc * 32);
                pv[u] = __ldg(pp + (long)group_of(cc * 64 + t * 16, group_len, group_shift) * 8);
            }
        };
        fetch(c0, w, p);
        for (int c = c0; c < c1; c += U) {
            uint4 wn[U];
            uint2 pn[U];
            if (c + U < c1) fetch(c + U, wn, pn);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (c + u >= c1) break;
                const u32 words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
                uint4 xv[TT][2];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) {
                    const int m = tt * 8 + g;
                    const uint4* src = reinterpret_cast<const uint4*>(
                        xs + min(m, M - 1) * stride + (c + u - c0) * 128 + t * 32);
                    xv[tt][0] = m < M ? src[0] : make_uint4(0, 0, 0, 0);
                    xv[tt][1] = m < M ? src[1] : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 a[4];
                    dequant_step<T>(words[j], p[u], a);
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt) {
                        const uint4& v = xv[tt][j >> 1];
                        mma16816<T>(acc[tt], a, (j & 1) ? v.z : v.x, (j & 1) ? v.w : v.y);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                w[u] = wn[u];
                p[u] = pn[u];
            }
        }
    }
    split_k_finish<TT>(acc, tile, M, N, tiles * 16, partial, counters, y, ldy, W4Epilogue{});
}

// The tiled kernels' main loop: TILED_STAGES - 1 chunks in flight (cp.async groups); chunk c
// is computed while chunks c+1 .. c+3 stream in, and chunk c+3 is issued into the slot chunk c-1
// used, which every thread has finished with once it passes the barrier.
template <class Load, class Compute>
__device__ __forceinline__ void pipelined_chunks(int chunks, Load&& load, Compute&& compute) {
#pragma unroll
    for (int s = 0; s < TILED_STAGES - 1; ++s) {
        if (s < chunks) load(s);
        cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<TILED_STAGES - 2>();
        __syncthreads();
        if (c + TILED_STAGES - 1 < chunks) load(c + TILED_STAGES - 1);
        cp_async_commit();
        compute(c);
    }
    cp_async_wait<0>();
}

// Shared-memory stage of the tiled W4A16 kernel.
#define W4T_CODES 0                      // 8 tiles x 32 lanes x 16 B
#define W4T_PARAMS 4096                  // 8 tiles x 2 groups x 8 x 8 B
#define W4T_X 5120                       // 128 tokens x 144 B (64 channels + 16 B pad)
#define W4T_XLD 144
#define W4T_STAGE (W4T_X + 128 * W4T_XLD)

template <class T, class OUT>
__device__ void w4a16_tiled_impl(const uint4* __restrict__ codes, const uint2* __restrict__ params,
                                 const T* __restrict__ x, long ldx, OUT* __restrict__ y, long ldy,
                                 int M, int N, int K, int tiles, int chunks, int groups,
                                 int group_len) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wn = warp & 3, wm = warp >> 2;
    const int tile0 = blockIdx.x * 8, m0 = blockIdx.y * 128;

    auto load = [&](int c) {
        unsigned char* st = smem + (c % TILED_STAGES) * W4T_STAGE;
        {
            const int tl = tid >> 5;
            const bool ok = tile0 + tl < tiles;
            cp_async16(st + W4T_CODES + tid * 16,
                       codes + ((long)(ok ? tile0 + tl : 0) * chunks + c) * 32 + (tid & 31), ok);
        }
        if (tid < 128) {
            const int tl = tid >> 4, gi = (tid >> 3) & 1, gg = tid & 7;
            const int grp = c * 64 / group_len + gi;
            const bool ok = tile0 + tl < tiles && grp < groups;
            cp_async8(st + W4T_PARAMS + tid * 8,
                      params + (ok ? ((long)(tile0 + tl) * groups + grp) * 8 + gg : 0), ok);
        }
#pragma unroll
        for (int i = tid; i < 128 * 8; i += QG_THREADS) {
            const int row = i >> 3, seg = i & 7, m = m0 + row, k = c * 64 + seg * 8;
            const bool ok = m < M && k < K;
            cp_async16(st + W4T_X + row * W4T_XLD + seg * 16, x + (ok ? (long)m * ldx + k : 0), ok);
        }
    };

    float acc[2][8][4] = {};
    pipelined_chunks(chunks, load, [&](int c) {
        const unsigned char* st = smem + (c % TILED_STAGES) * W4T_STAGE;
        const int gl = (c * 64 + t * 16) / group_len - c * 64 / group_len;
        uint4 w[2];
        uint2 p[2];
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const int tl = wn * 2 + a;
            w[a] = *reinterpret_cast<const uint4*>(st + W4T_CODES + (tl * 32 + lane) * 16);
            p[a] = *reinterpret_cast<const uint2*>(st + W4T_PARAMS + ((tl * 2 + gl) * 8 + g) * 8);
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
            u32 af[2][2][4];
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                dequant_step<T>(jj ? w[a].z : w[a].x, p[a], af[a][0]);
                dequant_step<T>(jj ? w[a].w : w[a].y, p[a], af[a][1]);
            }
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const uint4 v = *reinterpret_cast<const uint4*>(
                    st + W4T_X + (wm * 64 + b * 8 + g) * W4T_XLD + t * 32 + jj * 16);
#pragma unroll
                for (int a = 0; a < 2; ++a) {
                    mma16816<T>(acc[a][b], af[a][0], v.x, v.y);
                    mma16816<T>(acc[a][b], af[a][1], v.z, v.w);
                }
            }
        }
    });
#pragma unroll
    for (int a = 0; a < 2; ++a)
        store_tile<8>(acc[a], (tile0 + wn * 2 + a) * 16, m0 + wm * 64, M, N, y, ldy, W4Epilogue{});
}

// Entry points: gemv{1,2,4,8} = 8, 16, 32, 64-token variants; `_h` writes the model dtype instead of f32.
// U (chunks per pipelined group): 8 for one token tile (on an H200, 28672x4096 at M = 1 took
// 28 us against 34 us with 4: the decode kernel is bound by loads in flight), else 4 or 2.
#define W4A16_GEMV_ENTRY(NAME, T, TT, U, OUT)                                                      \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) NAME(                               \
        const uint4* codes, const uint2* params, const T* x, long ldx, OUT* y, long ldy,            \
        float* partial, int* counters, int M, int N, int K, int tiles, int chunks, int groups,     \
        int group_len, int group_shift, int cps) {                                                  \
        w4a16_gemv_impl<T, TT, U>(codes, params, x, ldx, y, ldy, partial, counters, M, N, K, tiles, \
                                  chunks, groups, group_len, group_shift, cps);                     \
    }
#define W4A16_TILED_ENTRY(NAME, T, OUT)                                                            \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) NAME(                               \
        const uint4* codes, const uint2* params, const T* x, long ldx, OUT* y, long ldy, int M,     \
        int N, int K, int tiles, int chunks, int groups, int group_len) {                           \
        w4a16_tiled_impl<T>(codes, params, x, ldx, y, ldy, M, N, K, tiles, chunks, groups,          \
                            group_len);                                                             \
    }
#define NIBBLE_W4A16(SUFFIX, T)                                   \
    W4A16_GEMV_ENTRY(w4a16_gemv1_##SUFFIX, T, 1, 8, float)        \
    W4A16_GEMV_ENTRY(w4a16_gemv2_##SUFFIX, T, 2, 4, float)        \
    W4A16_GEMV_ENTRY(w4a16_gemv4_##SUFFIX, T, 4, 2, float)        \
    W4A16_GEMV_ENTRY(w4a16_gemv8_##SUFFIX, T, 8, 1, float)        \
    W4A16_GEMV_ENTRY(w4a16_gemv1_h_##SUFFIX, T, 1, 8, T)          \
    W4A16_GEMV_ENTRY(w4a16_gemv2_h_##SUFFIX, T, 2, 4, T)          \
    W4A16_GEMV_ENTRY(w4a16_gemv4_h_##SUFFIX, T, 4, 2, T)          \
    W4A16_GEMV_ENTRY(w4a16_gemv8_h_##SUFFIX, T, 8, 1, T)          \
    W4A16_TILED_ENTRY(w4a16_tiled_##SUFFIX, T, float)             \
    W4A16_TILED_ENTRY(w4a16_tiled_h_##SUFFIX, T, T)
NIBBLE_BOTH_DTYPES(NIBBLE_W4A16)

// Grouped W4A16 gemv, for the experts of a mixture-of-experts layer (one launch for all of them):
// grid.z walks a table of items, each one expert's packed weights (same geometry for every
// expert of a layer) over a run of at most 8 * TT consecutive rows of the input, which the host
// gathered in expert order; the output rows are the same rows of y. An item is the gemv above
// with its own weights, rows, split-K partial slots (`gridDim.y * max_m * tiles * 16` floats)
// and arrival counters (`gridDim.x`): its arithmetic, though the K splits are planned for the
// whole launch, not for one expert alone. Only the experts
// that are routed to have items: the others' weights are never read. Twice the gemv's chunks in
// flight (U) for 2 and 4 token tiles: the grouped launch is many CTAs, each bound by its loads.
// One item of a grouped launch (grouped::GroupedItem): the grouped decode gemv
// (qgemv_grouped.cu) reads the same table.
struct GroupedItem {
    const void* codes;    // packed codes, or the 16-bit weight rows
    const void* params;   // W4A16 / W4A8 group parameters
    const float* scales;  // W8A8 / W8A16 / W4A8 / FP8 per-row weight scales
    long long row;        // first row of the gathered input and of the output
    int m;                // rows
    int pad;
};
static_assert(sizeof(GroupedItem) == 40, "grouped::GroupedItem");
#define W4A16_GROUPED_ENTRY(NAME, T, TT, U)                                                            \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) NAME(                                   \
        const GroupedItem* items, const T* x, long ldx, float* y, long ldy, float* partial,           \
        int* counters, int max_m, int N, int K, int tiles, int chunks, int groups, int group_len,       \
        int group_shift, int cps) {                                                                     \
        const GroupedItem it = items[blockIdx.z];                                                     \
        w4a16_gemv_impl<T, TT, U>((const uint4*)it.codes, (const uint2*)it.params, x + it.row * ldx, ldx, y + it.row * ldy, ldy,    \
                                  partial + (long)blockIdx.z * gridDim.y * max_m * tiles * 16,          \
                                  counters + (long)blockIdx.z * gridDim.x, it.m, N, K, tiles, chunks,    \
                                  groups, group_len, group_shift, cps);                                 \
    }
#define NIBBLE_W4A16_GROUPED(SUFFIX, T)                     \
    W4A16_GROUPED_ENTRY(w4a16_grouped1_##SUFFIX, T, 1, 8)   \
    W4A16_GROUPED_ENTRY(w4a16_grouped2_##SUFFIX, T, 2, 8)   \
    W4A16_GROUPED_ENTRY(w4a16_grouped4_##SUFFIX, T, 4, 4)   \
    W4A16_GROUPED_ENTRY(w4a16_grouped8_##SUFFIX, T, 8, 1)
NIBBLE_BOTH_DTYPES(NIBBLE_W4A16_GROUPED)

// ---------------------------------------------------------------------------------------------
// W8A8

template <int TT, int U, class OUT>
__device__ void w8a8_gemv_impl(const uint4* __restrict__ codes, const float* __restrict__ sw,
                               const signed char* __restrict__ x, long ldx,
                               const float* __restrict__ sx, OUT* __restrict__ y, long ldy,
                               int* __restrict__ partial, int* __restrict__ counters, int M, int N,
                               int K, int tiles, int chunks, int chunks_per_split) {
    extern __shared__ __align__(16) unsigned char xs[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * QG_WARPS + warp;
    const int c0 = blockIdx.y * chunks_per_split, c1 = min(chunks, c0 + chunks_per_split);
    const int stride = gemv_x_stride(chunks_per_split, 1);
    gemv_stage_x(xs, stride, x, ldx, M, K, c0, c1);
    int acc[TT][4] = {};
    if (tile < tiles) {
        const uint4* wp = codes + (long)tile * chunks * 64 + lane * 2;
        uint4 w[U][2];
        auto fetch = [&](int c, uint4 (&wv)[U][2]) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cc = min(c + u, c1 - 1);
                wv[u][0] = ld_stream(wp + (long)cc * 64);
                wv[u][1] = ld_stream(wp + (long)cc * 64 + 1);
            }
        };
        fetch(c0, w);
        for (int c = c0; c < c1; c += U) {
            uint4 wn[U][2];
            if (c + U < c1) fetch(c + U, wn);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (c + u >= c1) break;
                uint4 xv[TT];
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) {
                    const int m = tt * 8 + g;
                    xv[tt] = m < M ? *reinterpret_cast<const uint4*>(
                                         xs + min(m, M - 1) * stride + (c + u - c0) * 64 + t * 16)
                                   : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const u32 a[4] = {w[u][j].x, w[u][j].y, w[u][j].z, w[u][j].w};
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt)
                        mma_s8(acc[tt], a, j ? xv[tt].z : xv[tt].x, j ? xv[tt].w : xv[tt].y);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                w[u][0] = wn[u][0];
                w[u][1] = wn[u][1];
            }
        }
    }
    split_k_finish<TT>(acc, tile, M, N, tiles * 16, partial, counters, y, ldy, W8Epilogue{sx, sw});
}

#define W8T_CODES 0      // 8 tiles x 32 lanes x 32 B
#define W8T_X 8192       // 128 tokens x 64 B (word-transposed): conflict-free for 16-byte B loads as is
#define W8T_STAGE (W8T_X + 128 * 64)

template <class OUT>
__device__ void w8a8_tiled_impl(const uint4* __restrict__ codes, const float* __restrict__ sw,
                                const signed char* __restrict__ x, long ldx,
                                const float* __restrict__ sx, OUT* __restrict__ y, long ldy, int M,
                                int N, int K, int tiles, int chunks) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wn = warp & 3, wm = warp >> 2;
    const int tile0 = blockIdx.x * 8, m0 = blockIdx.y * 128;

    auto load = [&](int c) {
        unsigned char* st = smem + (c % TILED_STAGES) * W8T_STAGE;
#pragma unroll
        for (int i = tid; i < 8 * 64; i += QG_THREADS) {
            const int tl = i >> 6;
            const bool ok = tile0 + tl < tiles;
            cp_async16(st + W8T_CODES + i * 16,
                       codes + ((long)(ok ? tile0 + tl : 0) * chunks + c) * 64 + (i & 63), ok);
        }
#pragma unroll
        for (int i = tid; i < 128 * 4; i += QG_THREADS) {
            const int row = i >> 2, seg = i & 3, m = m0 + row, k = c * 64 + seg * 16;
            const bool ok = m < M && k < K;
            stage_x16(st + W8T_X + row * 64, seg, x + (ok ? (long)m * ldx + k : 0), ok);
        }
    };

    int acc[2][8][4] = {};
    pipelined_chunks(chunks, load, [&](int c) {
        const unsigned char* st = smem + (c % TILED_STAGES) * W8T_STAGE;
        uint4 w[2][2];
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const uint4* src = reinterpret_cast<const uint4*>(st + W8T_CODES) + ((wn * 2 + a) * 32 + lane) * 2;
            w[a][0] = src[0];
            w[a][1] = src[1];
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const uint4 v = *reinterpret_cast<const uint4*>(st + W8T_X + (wm * 64 + b * 8 + g) * 64 + t * 16);
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const u32 a0[4] = {w[a][0].x, w[a][0].y, w[a][0].z, w[a][0].w};
                const u32 a1[4] = {w[a][1].x, w[a][1].y, w[a][1].z, w[a][1].w};
                mma_s8(acc[a][b], a0, v.x, v.y);
                mma_s8(acc[a][b], a1, v.z, v.w);
            }
        }
    });
#pragma unroll
    for (int a = 0; a < 2; ++a)
        store_tile<8>(acc[a], (tile0 + wn * 2 + a) * 16, m0 + wm * 64, M, N, y, ldy, W8Epilogue{sx, sw});
}

#define W8A8_GEMV_ENTRY(NAME, TT, U, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) NAME(                               \
        const uint4* codes, const float* sw, const signed char* x, long ldx, const float* sx,      \
        OUT* y, long ldy, int* partial, int* counters, int M, int N, int K, int tiles, int chunks, \
        int cps) {                                                                                  \
        w8a8_gemv_impl<TT, U>(codes, sw, x, ldx, sx, y, ldy, partial, counters, M, N, K, tiles,     \
                              chunks, cps);                                                         \
    }
#define NIBBLE_W8A8_OUT(SUFFIX, OUT)                                                              \
    W8A8_GEMV_ENTRY(w8a8_gemv1_##SUFFIX, 1, 4, OUT)                                                \
    W8A8_GEMV_ENTRY(w8a8_gemv2_##SUFFIX, 2, 4, OUT)                                                \
    W8A8_GEMV_ENTRY(w8a8_gemv4_##SUFFIX, 4, 2, OUT)                                                \
    W8A8_GEMV_ENTRY(w8a8_gemv8_##SUFFIX, 8, 1, OUT)                                                \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) w8a8_tiled_##SUFFIX(                \
        const uint4* codes, const float* sw, const signed char* x, long ldx, const float* sx,      \
        OUT* y, long ldy, int M, int N, int K, int tiles, int chunks) {                             \
        w8a8_tiled_impl(codes, sw, x, ldx, sx, y, ldy, M, N, K, tiles, chunks);                    \
    }
NIBBLE_W8A8_OUT(f32, float)
NIBBLE_W8A8_OUT(bf16, __nv_bfloat16)
NIBBLE_W8A8_OUT(f16, __half)


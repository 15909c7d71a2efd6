// KV pages: how the attention kernels write and read one block of one KV head in each side format
// of the GPU pool (src/kv.rs `PageFormat`, whose `kernel_code` is the KIND here). A side is the
// model dtype (PAGE_F16: [16 slots][HD] elements) or a self-describing page of per-token records
// (nibble_precision::kv, "Pages"): the 16 slots' code runs of CB bytes, token-major, then their
// parameters, PB bytes each (f16 scale, f16 zero; f16 scale for fp8). Every page is a multiple of
// 16 bytes, so it streams with 16-byte cp.async pieces.
//
// Writing (BitDecoding's quantize-on-append, TurboMind's per-token per-head asymmetric KV8/KV4):
// one warp quantizes one head's row, HD / 32 consecutive elements per lane, with the CPU
// reference's arithmetic (min-max in f32, scale and zero rounded to f16, IEEE division, halves
// away from zero for unsigned codes; e4m3 rounded to nearest even, saturated). A row with a
// non-finite value or one past the f16 range gets NaN parameters (the CPU refuses such a row; a
// GPU check would cost a sync per layer). Attention does not propagate it as a 16-bit cache's NaN
// would: the MMA decodes' softmax drops a NaN score (fmaxf ignores it, its probability is 0), so
// such a key's tokens (a channel-wise key's whole block) are left out of that head's attention.
//
// Reading: 16 code bytes at a time become 16 (8-bit) or 32 (4-bit) values x = fma(q, s, z) or
// e4m3(q) * s in f32, exactly the reference's, then rounded to T into a tile of the layout the
// 16-bit kernels read ([rows][HD + 8], padded so fragment loads hit distinct banks). The decode
// kernel streams raw pages with cp.async and dequantizes the stage it is about to use; the prefill
// kernel dequantizes while it gathers a key tile.

#define PAGE_F16 0
#define PAGE_U8 1
#define PAGE_U4 2
#define PAGE_FP8 3
#define PAGE_U2 4  // the values of kv2c: per token, as U8 / U4
#define PAGE_C4 5  // channel-wise keys (kv4c): the block's 16 code runs, then HD (scale, zero) pairs
#define PAGE_C2 6  // the same with 2-bit codes (kv2c)
#define KV_BS 16  // tokens per KV block

// BITS: code bits; PB: parameter bytes per slot; CHANNEL: one (scale, zero) per channel of the
// block (nibble_precision::kv `ChannelKeys`) instead of one per slot, written by pack_block.
template <int KIND> struct PageCodec;
template <> struct PageCodec<PAGE_F16> { static constexpr int BITS = 16, PB = 0; static constexpr bool CHANNEL = false; };
template <> struct PageCodec<PAGE_U8> { static constexpr int BITS = 8, PB = 4; static constexpr bool CHANNEL = false; };
template <> struct PageCodec<PAGE_U4> { static constexpr int BITS = 4, PB = 4; static constexpr bool CHANNEL = false; };
template <> struct PageCodec<PAGE_FP8> { static constexpr int BITS = 8, PB = 2; static constexpr bool CHANNEL = false; };
template <> struct PageCodec<PAGE_U2> { static constexpr int BITS = 2, PB = 4; static constexpr bool CHANNEL = false; };
template <> struct PageCodec<PAGE_C4> { static constexpr int BITS = 4, PB = 0; static constexpr bool CHANNEL = true; };
template <> struct PageCodec<PAGE_C2> { static constexpr int BITS = 2, PB = 0; static constexpr bool CHANNEL = true; };

__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// An unsigned code as f32 without a conversion instruction: 2^23 + q, minus 2^23.
__device__ __forceinline__ float code_f32(u32 q) { return __uint_as_float(0x4B000000u | q) - 8388608.f; }

// The residual of a layer's deferred side (docs/design/kv-channel-gpu.md): [slots][kv_heads][16]
// [HD] f32; the slot of a block from the call's residual tables (src/kv_residual.rs), which name
// one for every block the call touches. Returns the offset of position `pos`'s row.
template <int HD>
__device__ __forceinline__ long residual_row(const int* res_tables, int seq, int pos, int max_blocks, int h,
                                             int num_kv_heads) {
    const long slot = res_tables[(long)seq * max_blocks + pos / KV_BS];
    return ((slot * num_kv_heads + h) * KV_BS + pos % KV_BS) * HD;
}

// A block's first `rows` residual rows (f32, `src`) rounded to T into `tile` ([16][HD + 8]), the
// rest zeros: the tile a page's `ready` would give. One warp; the tile is readable on return.
template <class T, int HD>
__device__ __forceinline__ const T* residual_tile(T* tile, const float* src, int rows, int lane) {
    constexpr int LD = HD + 8;
    for (int i = lane; i < KV_BS * HD / 4; i += 32) {
        const int r = i / (HD / 4), c = (i % (HD / 4)) * 4;
        const float4 v = r < rows ? *reinterpret_cast<const float4*>(src + r * HD + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<uint2*>(tile + r * LD + c) = make_uint2(pack2(v.x, v.y, (T*)nullptr), pack2(v.z, v.w, (T*)nullptr));
    }
    __syncwarp();
    return tile;
}

// Prefill: positions kv0 .. kv0 + N - 1 of a sequence from the residual (f32) into `tile`
// ([N][HD + 8]), as PageSide::gather does from pages: positions past `last`, or in a block the
// call does not touch (no residual slot), as zeros. `rtable`: the sequence's residual table. All
// threads of the CTA.
template <class T, int HD, int N>
__device__ __forceinline__ void gather_residual(T* tile, const float* res, const int* rtable, int kv0, int last,
                                                int kvh, int heads) {
    constexpr int LD = HD + 8;
    for (int i = threadIdx.x; i < N * HD / 4; i += blockDim.x) {
        const int r = i / (HD / 4), c = (i % (HD / 4)) * 4;
        const int p = kv0 + r;
        const int slot = p <= last ? rtable[p / KV_BS] : -1;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (slot >= 0)
            v = *reinterpret_cast<const float4*>(res + (((long)slot * heads + kvh) * KV_BS + p % KV_BS) * HD + c);
        *reinterpret_cast<uint2*>(tile + r * LD + c) = make_uint2(pack2(v.x, v.y, (T*)nullptr), pack2(v.z, v.w, (T*)nullptr));
    }
}

template <class T, int HD, int KIND>
struct PageSide {
    static constexpr bool FLOAT = KIND == PAGE_F16;
    static constexpr int BITS = PageCodec<KIND>::BITS;
    static constexpr int LD = HD + 8;                   // tile row stride, elements
    static constexpr int CB = HD * BITS / 8;            // bytes of one slot's codes (or elements)
    static constexpr int PB = PageCodec<KIND>::PB;      // bytes of one slot's parameters
    static constexpr bool CHANNEL = PageCodec<KIND>::CHANNEL;
    static constexpr int PAGE = KV_BS * (CB + PB) + (CHANNEL ? 4 * HD : 0);  // bytes of one page
    static constexpr int EPC = 128 / BITS;              // elements in 16 bytes of codes
    static constexpr int CPR = CB / 16;                 // 16-byte chunks per slot
    static constexpr float MAXC = (float)((1 << (BITS == 16 ? 1 : BITS)) - 1);
    // Decode staging per warp and stage: a 16-bit page lands in its tile directly.
    static constexpr int STAGE = FLOAT ? KV_BS * LD * (int)sizeof(T) : PAGE;
    static constexpr int TILE = FLOAT ? 0 : KV_BS * LD * (int)sizeof(T);
    static_assert(PAGE % 16 == 0 && (FLOAT || CB % 16 == 0), "pages stream in 16-byte pieces");

    // 16 code bytes of one slot, its parameters (s, z), into EPC values at dst (16-byte aligned).
    __device__ static __forceinline__ void dequant16(uint4 c, float s, float z, T* dst) {
        const u32 w[4] = {c.x, c.y, c.z, c.w};
        if constexpr (KIND == PAGE_U8) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = fmaf(code_f32((w[i] >> (8 * j)) & 255u), s, z);
                *reinterpret_cast<uint2*>(dst + 4 * i) =
                    make_uint2(pack2(v[0], v[1], (T*)nullptr), pack2(v[2], v[3], (T*)nullptr));
            }
        } else if constexpr (KIND == PAGE_U4) {
            // Element 8i + n is nibble n of word i (element 2j is byte j's low nibble).
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v[8];
#pragma unroll
                for (int n = 0; n < 8; ++n) v[n] = fmaf(code_f32((w[i] >> (4 * n)) & 15u), s, z);
                *reinterpret_cast<uint4*>(dst + 8 * i) =
                    make_uint4(pack2(v[0], v[1], (T*)nullptr), pack2(v[2], v[3], (T*)nullptr),
                               pack2(v[4], v[5], (T*)nullptr), pack2(v[6], v[7], (T*)nullptr));
            }
        } else if constexpr (BITS == 2) {
            // Element 16i + n is bits 2n..2n+1 of word i (element 4j + k: byte j's bits 2k).
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float v[8];
#pragma unroll
                    for (int n = 0; n < 8; ++n) v[n] = fmaf(code_f32((w[i] >> (2 * (8 * h + n))) & 3u), s, z);
                    *reinterpret_cast<uint4*>(dst + 16 * i + 8 * h) =
                        make_uint4(pack2(v[0], v[1], (T*)nullptr), pack2(v[2], v[3], (T*)nullptr),
                                   pack2(v[4], v[5], (T*)nullptr), pack2(v[6], v[7], (T*)nullptr));
                }
            }
        } else if constexpr (KIND == PAGE_FP8) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v[4];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(
                        (__nv_fp8x2_storage_t)((w[i] >> (16 * j)) & 0xffffu), __NV_E4M3));
                    const float2 f = __half22float2(h);
                    v[2 * j] = f.x * s;
                    v[2 * j + 1] = f.y * s;
                }
                *reinterpret_cast<uint2*>(dst + 4 * i) =
                    make_uint2(pack2(v[0], v[1], (T*)nullptr), pack2(v[2], v[3], (T*)nullptr));
            }
        }
    }

    // CHANNEL pages: 16 code bytes of one slot, channels d0 .. d0 + EPC - 1, each with its own
    // (s, z) from the page's channel parameters `cp`, into EPC values at dst.
    __device__ static __forceinline__ void dequant16_channels(uint4 c, const unsigned char* cp, int d0, T* dst) {
        const u32 w[4] = {c.x, c.y, c.z, c.w};
        constexpr int PER_WORD = 32 / BITS;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int n0 = 0; n0 < PER_WORD; n0 += 8) {
                // The 8 channels' (s, z) pairs: two 16-byte loads (d is a multiple of 8).
                const int d = d0 + i * PER_WORD + n0;
                const uint4 pa = *reinterpret_cast<const uint4*>(cp + 4 * d);
                const uint4 pb = *reinterpret_cast<const uint4*>(cp + 4 * d + 16);
                const u32 pw[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
                float v[8];
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&pw[n]));
                    v[n] = fmaf(code_f32((w[i] >> (BITS * (n0 + n))) & ((1u << BITS) - 1)), sz.x, sz.y);
                }
                *reinterpret_cast<uint4*>(dst + i * PER_WORD + n0) =
                    make_uint4(pack2(v[0], v[1], (T*)nullptr), pack2(v[2], v[3], (T*)nullptr),
                               pack2(v[4], v[5], (T*)nullptr), pack2(v[6], v[7], (T*)nullptr));
            }
        }
    }

    // Slot `slot`'s (s, z) from the page's parameter area.
    __device__ static __forceinline__ float2 params(const unsigned char* page, int slot) {
        const unsigned char* p = page + KV_BS * CB + slot * PB;
        if constexpr (KIND == PAGE_FP8) {
            return make_float2(__half2float(*reinterpret_cast<const __half*>(p)), 0.f);
        } else {
            return __half22float2(*reinterpret_cast<const __half2*>(p));
        }
    }

    // Elements of a row each lane holds when it writes one.
    static constexpr int E = HD / 32;

    // One slot's codes `q` (this lane's elements lane * E .. lane * E + E - 1) into `codes`, the
    // slot's code run: 2-bit pairs of lanes share a byte, the even lane's in the low nibble.
    __device__ static __forceinline__ void store_codes(unsigned char* codes, const u32 (&q)[E], int lane) {
        if constexpr (BITS == 8) {
            if constexpr (E == 4)
                *reinterpret_cast<u32*>(codes + lane * 4) = q[0] | q[1] << 8 | q[2] << 16 | q[3] << 24;
            else
                *reinterpret_cast<unsigned short*>(codes + lane * 2) = (unsigned short)(q[0] | q[1] << 8);
        } else if constexpr (BITS == 4) {
            if constexpr (E == 4)
                *reinterpret_cast<unsigned short*>(codes + lane * 2) =
                    (unsigned short)(q[0] | q[1] << 4 | q[2] << 8 | q[3] << 12);
            else
                codes[lane] = (unsigned char)(q[0] | q[1] << 4);
        } else {
            if constexpr (E == 4) {
                codes[lane] = (unsigned char)(q[0] | q[1] << 2 | q[2] << 4 | q[3] << 6);
            } else {
                const u32 mine = q[0] | q[1] << 2;
                const u32 odd = __shfl_down_sync(0xffffffffu, mine, 1);
                if ((lane & 1) == 0) codes[lane >> 1] = (unsigned char)(mine | odd << 4);
            }
        }
    }

    // Quantizes one head's row x[0..HD) (f32, global) into slot `slot` of `page`: one warp.
    __device__ static __forceinline__ void append(unsigned char* page, const float* x, int slot,
                                                  int lane) {
        float v[E];
#pragma unroll
        for (int j = 0; j < E; ++j) v[j] = x[lane * E + j];
        append_row(page, v, slot, lane);
    }

    // append() of a row held in registers: this lane's elements lane * E .. lane * E + E - 1.
    __device__ static __forceinline__ void append_row(unsigned char* page, const float (&v)[E], int slot,
                                                      int lane) {
        static_assert(E == 2 || E == 4, "a lane holds 2 or 4 elements");
        static_assert(!CHANNEL, "channel-wise keys are written a whole block at a time (pack_block)");
        if constexpr (FLOAT) {
            T* dst = reinterpret_cast<T*>(page) + slot * HD + lane * E;
#pragma unroll
            for (int j = 0; j < E; ++j) dst[j] = from_f32<T>(v[j]);
            return;
        } else {
            bool ok = true;
#pragma unroll
            for (int j = 0; j < E; ++j) ok &= fabsf(v[j]) <= 65504.f;  // false for NaN too
            ok = __all_sync(0xffffffffu, ok);
            const __half nan = __ushort_as_half((unsigned short)0x7e00);
            u32 q[E];
            __half sh, zh = __float2half_rn(0.f);
            if constexpr (KIND == PAGE_FP8) {
                float amax = 0.f;
#pragma unroll
                for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(v[j]));
                amax = warp_reduce(amax, MaxOp{});
                sh = ok ? __float2half_rn(__fdiv_rn(amax, 448.f)) : nan;
                const float s = __half2float(sh);
#pragma unroll
                for (int j = 0; j < E; ++j)
                    q[j] = ok && s != 0.f
                               ? (u32)__nv_cvt_float_to_fp8(fminf(fmaxf(__fdiv_rn(v[j], s), -448.f), 448.f),
                                                            __NV_SATFINITE, __NV_E4M3)
                               : 0u;
            } else {
                float lo = v[0], hi = v[0];
#pragma unroll
                for (int j = 1; j < E; ++j) {
                    lo = fminf(lo, v[j]);
                    hi = fmaxf(hi, v[j]);
                }
                lo = warp_min(lo);
                hi = warp_reduce(hi, MaxOp{});
                sh = ok ? __float2half_rn(__fdiv_rn(hi - lo, MAXC)) : nan;
                zh = ok ? __float2half_rn(lo) : nan;
                const float s = __half2float(sh), z = __half2float(zh);
#pragma unroll
                for (int j = 0; j < E; ++j)
                    q[j] = ok && s != 0.f ? (u32)fminf(fmaxf(roundf(__fdiv_rn(v[j] - z, s)), 0.f), MAXC) : 0u;
            }
            store_codes(page + slot * CB, q, lane);
            if (lane == 0) {
                unsigned char* p = page + KV_BS * CB + slot * PB;
                if constexpr (KIND == PAGE_FP8)
                    *reinterpret_cast<__half*>(p) = sh;
                else
                    *reinterpret_cast<__half2*>(p) = __halves2half2(sh, zh);
            }
        }
    }

    // CHANNEL pages: quantizes a whole block, x(r, d) for its 16 slots r (f32: the residual's
    // rows), into `page`: per channel d, min-max over the 16 rows with the CPU reference's
    // arithmetic (`ChannelKeys::quantize`), then the codes token-major. One warp; lane l takes
    // channels l * E .. l * E + E - 1. A channel with a non-finite value or one past the f16
    // range gets NaN parameters (the CPU refuses such a block).
    // `x(r, d)`: slot r's channel d.
    template <class X>
    __device__ static __forceinline__ void pack_block(unsigned char* page, const X& x_at, int lane) {
        static_assert(CHANNEL, "per-token pages are written a row at a time (append)");
        static_assert(E == 2 || E == 4, "a lane holds 2 or 4 channels");
        const __half nan = __ushort_as_half((unsigned short)0x7e00);
        float s[E], z[E];
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const int d = lane * E + j;
            float lo = x_at(0, d), hi = lo;
            bool ok = fabsf(lo) <= 65504.f;
#pragma unroll
            for (int r = 1; r < KV_BS; ++r) {
                const float x = x_at(r, d);
                lo = fminf(lo, x);
                hi = fmaxf(hi, x);
                ok &= fabsf(x) <= 65504.f;  // false for NaN too
            }
            const __half sh = ok ? __float2half_rn(__fdiv_rn(hi - lo, MAXC)) : nan;
            const __half zh = ok ? __float2half_rn(lo) : nan;
            *reinterpret_cast<__half2*>(page + KV_BS * CB + 4 * d) = __halves2half2(sh, zh);
            s[j] = __half2float(sh);
            z[j] = __half2float(zh);
        }
#pragma unroll
        for (int r = 0; r < KV_BS; ++r) {
            u32 q[E];
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const float x = x_at(r, lane * E + j);
                q[j] = s[j] == s[j] && s[j] != 0.f ? (u32)fminf(fmaxf(roundf(__fdiv_rn(x - z[j], s[j])), 0.f), MAXC)
                                                   : 0u;
            }
            store_codes(page + r * CB, q, lane);
        }
    }

    // Decode: starts streaming `page` (its first `rows` slots are read) into `stage` (one warp).
    __device__ static __forceinline__ void issue(unsigned char* stage, const unsigned char* page,
                                                 int rows, int lane) {
        if constexpr (FLOAT) {
            T* dst = reinterpret_cast<T*>(stage);
            const T* src = reinterpret_cast<const T*>(page);
#pragma unroll
            for (int i = lane; i < KV_BS * HD / 8; i += 32) {
                const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
                if (r < rows) {
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(&dst[r * LD + c])),
                                 "l"(src + r * HD + c));
                } else {
                    // Zeros, not stale bytes: a masked slot still meets a zero probability.
                    *reinterpret_cast<uint4*>(&dst[r * LD + c]) = make_uint4(0, 0, 0, 0);
                }
            }
        } else {
#pragma unroll
            for (int i = lane; i < PAGE / 16; i += 32)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(stage + 16 * i)),
                             "l"(page + 16 * i));
        }
    }

    // Decode: the tile of a stage whose stream has landed (a quantized page is dequantized into
    // `tile`, its slots past `rows` as zeros). One warp; the tile is readable on return.
    __device__ static __forceinline__ const T* ready(const unsigned char* stage, T* tile, int rows,
                                                     int lane) {
        if constexpr (FLOAT) {
            return reinterpret_cast<const T*>(stage);
        } else {
#pragma unroll
            for (int i = lane; i < KV_BS * CPR; i += 32) {
                const int r = i / CPR, cc = i % CPR;
                T* dst = tile + r * LD + cc * EPC;
                if (r < rows) {
                    if constexpr (CHANNEL) {
                        dequant16_channels(*reinterpret_cast<const uint4*>(stage + 16 * i), stage + KV_BS * CB,
                                           cc * EPC, dst);
                    } else {
                        const float2 sz = params(stage, r);
                        dequant16(*reinterpret_cast<const uint4*>(stage + 16 * i), sz.x, sz.y, dst);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < EPC; e += 8) *reinterpret_cast<uint4*>(dst + e) = make_uint4(0, 0, 0, 0);
                }
            }
            __syncwarp();
            return tile;
        }
    }

    // Prefill: the keys (or values) of positions kv0 .. kv0 + N - 1 of a sequence into `tile`
    // ([N][LD]), positions past `last` as zeros; `side` is the layer's pages, `block_size` the
    // 16-bit pool's block (quantized pages hold KV_BS slots). All threads of the CTA.
    template <int N>
    __device__ static __forceinline__ void gather(T* tile, const unsigned char* side, const int* table,
                                                  int kv0, int last, int kvh, int heads,
                                                  int block_size) {
        if constexpr (FLOAT) {
            const T* src = reinterpret_cast<const T*>(side);
            for (int i = threadIdx.x; i < N * HD / 8; i += blockDim.x) {
                const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
                const int p = kv0 + r;
                Vec8 x;
                if (p <= last) {
                    const long blk = table[p / block_size];
                    x = *reinterpret_cast<const Vec8*>(src + ((blk * heads + kvh) * block_size + p % block_size) * HD + c);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) x.h[j] = 0;
                }
                *reinterpret_cast<Vec8*>(&tile[r * LD + c]) = x;
            }
        } else {
            for (int i = threadIdx.x; i < N * CPR; i += blockDim.x) {
                const int r = i / CPR, cc = i % CPR;
                const int p = kv0 + r;
                T* dst = tile + r * LD + cc * EPC;
                if (p <= last) {
                    const unsigned char* page = side + ((long)table[p / KV_BS] * heads + kvh) * PAGE;
                    const uint4 c = *reinterpret_cast<const uint4*>(page + (p % KV_BS) * CB + 16 * cc);
                    if constexpr (CHANNEL) {
                        dequant16_channels(c, page + KV_BS * CB, cc * EPC, dst);
                    } else {
                        const float2 sz = params(page, p % KV_BS);
                        dequant16(c, sz.x, sz.y, dst);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < EPC; e += 8) *reinterpret_cast<uint4*>(dst + e) = make_uint4(0, 0, 0, 0);
                }
            }
        }
    }
};

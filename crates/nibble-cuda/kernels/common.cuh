// Shared by every nibble kernel source (prepended by the Rust side, so NVRTC needs no include
// path for it). Activations between ops are f32 (the residual stream, GEMM outputs) or the model's
// 16-bit dtype `T` (GEMM inputs, the KV cache); these helpers convert between them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// SwiGLU's `silu(g) * u`, shared by the SiLU-gate row kernels and the quantized GEMMs' SwiGLU
// epilogue (qgemm.cu), which must agree bit for bit: the explicitly rounded add and multiply keep
// --fmad from contracting either differently. The division is the hardware's (rcp.approx: 2 ulp
// of f32 against the CPU's g / (1 + exp(-g)) * u, far inside the 16-bit output's rounding; 0
// instead of about 1e-37 where g is below -87 and 1 + exp(-g) passes 2^126): the
// IEEE division's slow-path call made every output of the epilogue a branch of its own, each
// waiting on its scale's load (SASS of c37a6c6; 74.5 against 62.1 us for the 256-token gate/up
// GEMM on an H100).
struct SiluMul {
    __device__ __forceinline__ float operator()(float g, float u) const {
        return __fmul_rn(__fdividef(g, __fadd_rn(1.0f, expf(-g))), u);
    }
};

// Warp and block reductions with any associative `op`; every thread gets the result. A block has
// up to 1024 threads and `scratch` 32 values; warps past blockDim.x contribute `idle`, the
// operation's identity.
struct SumOp {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {  // on floats fmaxf: a NaN loses to any number
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
    __device__ __forceinline__ u64 operator()(u64 a, u64 b) const { return b > a ? b : a; }
};
template <class T, class Op> __device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
template <class T, class Op> __device__ __forceinline__ T block_reduce(T v, T* scratch, T idle, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    return warp_reduce(lane < warps ? scratch[lane] : idle, op);
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce(v, scratch, 0.f, SumOp{}); }

// Programmatic dependent launch (sm_90 and later; no-ops before). A kernel named in
// compile::GRID_WAITING_KERNELS is launched while its predecessor still runs and must call
// grid_dependency_wait() before it touches memory (weights excepted: nothing writes them).
// grid_dependents_launch() lets the next such kernel be scheduled early; its own wait still
// holds it until this grid has finished.
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

// Issued first by the small kernels of a decode step: wait for the previous kernel, then let the
// next one be scheduled.
__device__ __forceinline__ void grid_dependency_enter() {
    grid_dependency_wait();
    grid_dependents_launch();
}

// RoPE of one pair: x0 at angle index i and x1 its partner (dim i + head_dim / 2, or 2i + 1
// when interleaved), by cs = (cos, sin) of position * inv_freq[i]: the CPU's rope_row, rounded as
// it rounds (no contraction into FMAs), so the rope kernel and a decode attention that rotates
// as it reads (DecodeRope) give the same bits.
__device__ __forceinline__ float2 rope_pair(float x0, float x1, float2 cs) {
    return make_float2(__fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y)),
                       __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x)));
}
// One element of a pair: `self` with its partner's value, `first` whether it is the pair's x0.
__device__ __forceinline__ float rope_one(float self, float partner, float2 cs, bool first) {
    return first ? rope_pair(self, partner, cs).x : rope_pair(partner, self, cs).y;
}

// Row ops run one block per row, thread t owning elements t, t + blockDim.x, ... . They walk the
// row in pages of ROW_PAGE elements per thread, issuing every load of a page before using any:
// one memory round trip per page. A plain strided loop pays one per element, because each
// iteration's store may alias the next iteration's load; at batch 1 that made a 4096-wide
// RMSNorm take 5.6 us and a 14336-wide SiLU-gate with INT8 codes 16 us.
#define ROW_PAGE 4
template <class Load, class Use>
__device__ __forceinline__ void row_pages(int n, Load load, Use use) {
    for (int p = threadIdx.x; p < n; p += ROW_PAGE * blockDim.x) {
        decltype(load(0)) v[ROW_PAGE];
#pragma unroll
        for (int k = 0; k < ROW_PAGE; ++k) {
            const int c = p + k * blockDim.x;
            if (c < n) v[k] = load(c);
        }
#pragma unroll
        for (int k = 0; k < ROW_PAGE; ++k) {
            const int c = p + k * blockDim.x;
            if (c < n) use(c, v[k]);
        }
    }
}

// Eight 16-bit values moved as one 16-byte access.
// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

struct __align__(16) Vec8 { unsigned short h[8]; };

template <class T> __device__ __forceinline__ void unpack8(const Vec8& v, float* out) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        T x;
        *reinterpret_cast<unsigned short*>(&x) = v.h[i];
        out[i] = to_f32(x);
    }
}

// Instantiates `name##_bf16` and `name##_f16` entry points from a template kernel body; the
// Rust side picks one by the model's dtype.
#define NIBBLE_BOTH_DTYPES(INSTANTIATE) \
    INSTANTIATE(bf16, __nv_bfloat16)    \
    INSTANTIATE(f16, __half)

// -1e30 stands for -inf in softmax states, so that merging two empty states gives exp(0) * 0
// instead of NaN.
#define NEG_BIG (-1e30f)

// 2^x in one MUFU.EX2 (flushing subnormals), without exp2f's range fix-ups around it.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Tensor-core helpers (sm_80 and later): a pair of floats as one 16-bit pair, and
// mma.sync m16n8k16 with f32 accumulation. Fragment layouts (PTX ISA, "mma.m16n8k16"): with
// g = lane / 4 and t = lane % 4, A holds rows g and g + 8 at columns 2t, 2t + 1 (and + 8), B
// columns g at rows 2t, 2t + 1 (and + 8), C rows g and g + 8 at columns 2t, 2t + 1.
__device__ __forceinline__ u32 pack2(float lo, float hi, __nv_bfloat16*) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}
__device__ __forceinline__ u32 pack2(float lo, float hi, __half*) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

template <class T> __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// One step of the online softmax over a tile of S accumulators (NT m16n8 tiles: this thread's
// rows g and g + 8), already scaled to base 2 with masked entries at NEG_BIG: replaces s by the
// tile's unnormalized probabilities, updates the running max m and sum l of both rows, and
// rescales the output accumulators o (OT m16n8 tiles) to the new max.
template <int NT, int OT>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                             float (&o)[OT][4]) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    }
    float corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        corr[i] = exp2f(m[i] - mx[i]);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = s[n][e] > -1e29f ? exp2f(s[n][e] - mx[e >> 1]) : 0.f;
            s[n][e] = p;
            rs[e >> 1] += p;
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
        rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
        l[i] = l[i] * corr[i] + rs[i];
        m[i] = mx[i];
    }
#pragma unroll
    for (int n = 0; n < OT; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
}

// O += P V over 16 keys: P's A fragments are the probabilities of S tiles s0 and s1 (the m16n8
// C layout is the m16k16 A layout), V's B fragments come by ldmatrix.trans from the 16 rows at
// `v` (row stride LD elements) in shared memory.
template <class T, int HD, int LD>
__device__ __forceinline__ void pv_tile(float (&o)[HD / 8][4], const float (&s0)[4],
                                        const float (&s1)[4], const T* v, int lane) {
    u32 pa[4];
    pa[0] = pack2(s0[0], s0[1], (T*)nullptr);
    pa[1] = pack2(s0[2], s0[3], (T*)nullptr);
    pa[2] = pack2(s1[0], s1[1], (T*)nullptr);
    pa[3] = pack2(s1[2], s1[3], (T*)nullptr);
    const T* vrow = v + (lane & 15) * LD;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        u32 b0, b1;
        const unsigned addr = (unsigned)__cvta_generic_to_shared(vrow + n * 8);
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(b0), "=r"(b1)
                     : "r"(addr));
        mma16816<T>(o[n], pa, b0, b1);
    }
}

// Per-token INT8 activation quantization (nibble_precision::act::quantize_int8, bit for bit):
// scale = max|x| / 127, code = round-half-even(x / scale) clamped to +-127; a row with a
// non-finite value gets codes 0 and scale NaN, an all-zero row codes 0 and scale 0. One block per
// row. The fused variants (QServe S1) quantize the 16-bit values the RMSNorm / SiLU-gate kernel
// has just written, so fused and standalone paths give identical codes.

__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce(v, scratch, -__int_as_float(0x7f800000), MaxOp{});
}

// A thread's running max |x| over its values of a row, and whether they were all finite: its
// share of the row's activation scale (quantize_row).
struct AbsMax {
    float m = 0.f;
    bool finite = true;
    __device__ __forceinline__ void add(float v) {
        finite &= isfinite(v);
        m = fmaxf(m, fabsf(v));
    }
};

// The 8-bit activation codes of a GEMM input, per token (nibble_precision::act): INT8 codes
// rint(x / s) within +-127 for s = max|x| / 127; FP8 e4m3 codes of x / s, rounded to nearest even
// and saturated, for s = max|x| / 448 (the float8 crate's from_f32 on the CPU).
struct NoCodes {  // a row op without 8-bit codes
    using Code = unsigned char;
    static constexpr bool ON = false;
    static constexpr float QMAX = 1.0f;
    __device__ __forceinline__ static Code code(float) { return 0; }
};
struct Int8Codes {
    static constexpr bool ON = true;
    using Code = signed char;
    static constexpr float QMAX = 127.0f;
    __device__ __forceinline__ static Code code(float v) { return (Code)fminf(fmaxf(rintf(v), -127.f), 127.f); }
};
struct Fp8Codes {
    static constexpr bool ON = true;
    using Code = unsigned char;
    static constexpr float QMAX = 448.0f;
    __device__ __forceinline__ static Code code(float v) { return (Code)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
};

// The register path of the row ops: a row of up to ROW_VECS x 4 x blockDim.x values is read once
// with 16-byte loads into registers (thread t owns the float4s t, t + blockDim.x, ...) and every
// later pass (normalize, quantize) works from them. The paged loop above waits one memory round
// trip per page and re-reads its output to quantize it: at 256 rows (a decode step of 256
// sequences, H200) a 4096-wide RMSNorm with INT8 codes took 9.7 us and a 14336-wide SiLU-gate
// with INT8 codes 19.4 us, two to three times their bytes' time. The path is chosen by the row's
// width and its pointers' alignment only (arena tensors are 16-byte aligned), never by the batch,
// so a row's values are the same alone or batched.
// The host sizes these CTAs to match (context.rs, row_regs_block; a test checks ROW_REGS_VALUES).
#define ROW_VECS 4
__device__ __forceinline__ bool row_vec_fits(int cols) {
    return (cols & 3) == 0 && cols <= ROW_VECS * 4 * (int)blockDim.x;
}
__device__ __forceinline__ bool aligned16(const void* p, long ld) {
    return ((unsigned long long)p & 15) == 0 && (ld & 3) == 0;
}
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// A thread's float4s t, t + blockDim.x, ... below n4 of `a` into va and, unless `b` is null, of
// `b` into vb: every load issued before any is used.
__device__ __forceinline__ void load_regs(const float* __restrict__ a, const float* __restrict__ b, int n4,
                                          float4 (&va)[ROW_VECS], float4 (&vb)[ROW_VECS]) {
#pragma unroll
    for (int i = 0; i < ROW_VECS; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < n4) {
            va[i] = ld4(a + 4 * u);
            if (b) vb[i] = ld4(b + 4 * u);
        }
    }
}
template <class T> struct alignas(4 * sizeof(T)) Pack4 { T v[4]; };
// Whether `p` may be read or written as Pack4s (rows of a multiple of 4 keep that row to row).
template <class T> __device__ __forceinline__ bool aligned_pack4(const T* p) {
    return ((unsigned long long)p & (4 * sizeof(T) - 1)) == 0;
}
// Four 16-bit (or f32) values of a row as one access; returns them as stored (rounded to T).
template <class T> __device__ __forceinline__ float4 store_rounded4(T* p, float4 v) {
    Pack4<T> o;
    o.v[0] = from_f32<T>(v.x);
    o.v[1] = from_f32<T>(v.y);
    o.v[2] = from_f32<T>(v.z);
    o.v[3] = from_f32<T>(v.w);
    *reinterpret_cast<Pack4<T>*>(p) = o;
    return make_float4(to_f32(o.v[0]), to_f32(o.v[1]), to_f32(o.v[2]), to_f32(o.v[3]));
}
template <class T> __device__ __forceinline__ float4 load4(const T* p) {
    const Pack4<T> o = *reinterpret_cast<const Pack4<T>*>(p);
    return make_float4(to_f32(o.v[0]), to_f32(o.v[1]), to_f32(o.v[2]), to_f32(o.v[3]));
}
__device__ __forceinline__ void add_abs(AbsMax& am, float4 v) {
    am.add(v.x);
    am.add(v.y);
    am.add(v.z);
    am.add(v.w);
}

// Quantizes row `row` of `src` (already written by this block, or any input) to codes `C`,
// `local` being this thread's share of max|x| (NaN/Inf propagate as a non-finite flag: codes 0,
// scale NaN, as the reference).
// A row's scale for codes `C` from every thread's AbsMax share (the whole block calls it):
// max|x| / QMAX, NaN when a value is not finite; `on` is false where codes are 0 (that, or 0).
template <class C> struct RowScale {
    float scale;
    bool on;
    __device__ __forceinline__ explicit RowScale(AbsMax local) {
        __shared__ float scratch[32];
        const float amax = block_max(local.finite ? local.m : __int_as_float(0x7f800000), scratch);
        const bool finite = amax <= 3.4028235e38f;
        scale = finite ? amax / C::QMAX : __int_as_float(0x7fc00000);
        on = finite && scale != 0.f;
    }
    __device__ __forceinline__ typename C::Code code(float v) const {
        return on ? C::code(v / scale) : (typename C::Code)0;
    }
};

template <class C, class IN>
__device__ __forceinline__ void quantize_row(const IN* src, long ld, typename C::Code* q, long ldq,
                                             float* sx, int cols, AbsMax local) {
    const long row = blockIdx.x;
    const RowScale<C> rs(local);
    row_pages(
        cols, [&](int c) { return to_f32(src[row * ld + c]); },
        [&](int c, float v) { q[row * ldq + c] = rs.code(v); });
    if (threadIdx.x == 0) sx[row] = rs.scale;
}

// quantize_row for a row held by the register path: `v` are the values as stored (16-bit rounded),
// the same codes and scale as quantize_row gives reading them back.
template <class C>
__device__ __forceinline__ void quantize_regs(const float4 (&v)[ROW_VECS], int cols, typename C::Code* q,
                                              long ldq, float* sx, AbsMax local) {
    const long row = blockIdx.x;
    const RowScale<C> rs(local);
    const int n4 = cols >> 2;
#pragma unroll
    for (int i = 0; i < ROW_VECS; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < n4) {
            const Pack4<typename C::Code> c{{rs.code(v[i].x), rs.code(v[i].y), rs.code(v[i].z), rs.code(v[i].w)}};
            *reinterpret_cast<Pack4<typename C::Code>*>(q + row * ldq + 4 * u) = c;
        }
    }
    if (threadIdx.x == 0) sx[row] = rs.scale;
}

// A uniform value in [-1, 1) from an element index and a seed (benchmarks fill KV caches and
// activations with it: never time on zeros).
__device__ __forceinline__ float hash_unit(long i, int seed) {
    u64 x = (u64)i * 0x9E3779B97F4A7C15ull ^ ((u64)(unsigned)seed << 32 | 0x5bd1e995u);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (float)(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

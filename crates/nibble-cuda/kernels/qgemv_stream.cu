// W4A16 decode gemv fed by TMA bulk copies, Hopper (sm_90a): y[m][n] = sum_k x[m][k] * w[n][k]
// for 1 to 4 tokens, on the packed W4A16 weights of qgemm.cu (pack.rs: the same fragments and
// group parameters the decode gemv of qgemv.cu reads).
//
// Why: qgemv.cu's decode gemv streams its weights through registers (ld.global.nc, two register
// sets in flight) and reaches 60 to 69% of HBM bandwidth at one token on the large layers; the
// 16-bit dense gemv (gemv_dense.cu) showed that one large bulk copy a stage into a deep
// shared-memory ring streams at 81 to 87% (BENCHMARKS.md, issue 24). This kernel is that stream
// with W4A16's arithmetic (issue 18's W4A16 goal: 85% at M = 1).
//
// Tiling: the packed codes are tile-major (16 weight rows a tile, then 64-channel chunks of 512
// bytes), so the `tile x chunk` units in order are one contiguous run of memory, and so are the
// group parameters (64 bytes a tile's group). The units are cut into equal contiguous ranges, one
// per SM (a multiple of 4 units, so 4 consecutive units always share a tile); a CTA streams its
// range in stages of 64 units (32 KB of codes and the parameters of the groups they touch).
// Within a stage, consumer warp w takes units 4w .. 4w + 3: one batch of qgemv.cu's DecW4
// (same fragments in shared memory instead of registers, same MMAs and span flushes).
// Pipeline: TMA (LiquidGEMM §5's producer warp). Warp 16's first lane issues two 1-D bulk copies a
// stage (codes, parameters; L2 evict-first) into a ring of up to 5 slots, completing on the
// slot's `full` mbarrier; consumers free a slot on its `empty` barrier. The producer starts
// before griddepcontrol.wait (nothing writes the weights), so under programmatic dependent launch
// the ring fills while the previous kernel finishes.
// Layout in shared memory: the ring (codes, then parameters), the activations (M rows of K,
// rows K * 2 + 16 bytes apart), their sums per scale span (QServe §5: scales and zero points
// applied after the MMA), and the partial sums per (CTA-local tile, warp, row, token).
// Reduction: a warp adds its units of a tile in registers; after the stream, each tile is the
// sum of its 16 warp partials in warp order, and a tile cut between CTAs is summed by the last
// CTA to arrive in CTA order (qgemv.cu's split slots and counters): deterministic, and a token's
// output does not depend on the other tokens of the call.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define TS_WARPS 16
#define TS_UNITS 64                    // units a stage
#define TS_STAGE (TS_UNITS * 512)      // code bytes a stage
#define TS_PSLOT (TS_UNITS * 64)       // parameter bytes a stage, at most (one group a unit)
#define TS_MAX_SLOTS 5

template <class T, int GC, class OUT>
__device__ __forceinline__ void w4_stream_gemv(const uint4* __restrict__ codes, const uint2* __restrict__ params,
                                               const T* __restrict__ x, long ldx, OUT* __restrict__ y, long ldy,
                                               float* __restrict__ partial, int* __restrict__ counters, int M, int N,
                                               int K, int tiles, int chunks, int groups, int chunk_shift,
                                               int per_cta, int max_pieces, int ring_bytes) {
    using F = DecW4<T, GC>;
    constexpr int U = F::U, SPANS = F::SPANS;
    extern __shared__ __align__(128) unsigned char ts_smem[];
    __shared__ __align__(8) u64 full[TS_MAX_SLOTS], empty[TS_MAX_SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int cta = blockIdx.x;
    const long units = (long)tiles * chunks;
    const long u0 = (long)cta * per_cta, u1 = min(units, u0 + per_cta);
    const int stages = (int)((u1 - u0 + TS_UNITS - 1) / TS_UNITS);
    const int slots = min(ring_bytes / (TS_STAGE + TS_PSLOT), TS_MAX_SLOTS);
    // The group a unit's parameters are in, counted over the whole weight (tile-major).
    auto group_of = [&](long u) -> long { return u / chunks * groups + ((u % chunks) >> chunk_shift); };
    unsigned char* pring = ts_smem + slots * TS_STAGE;
    if (threadIdx.x == 0) {
        for (int s = 0; s < slots; ++s) {
            mbar_init_count(smem_addr(&full[s]), 1);
            mbar_init_count(smem_addr(&empty[s]), TS_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == TS_WARPS) {
        if (lane == 0) {
            const u64 policy = evict_first_policy();
            const unsigned char* cbytes = reinterpret_cast<const unsigned char*>(codes);
            const unsigned char* pbytes = reinterpret_cast<const unsigned char*>(params);
            for (int s = 0; s < stages; ++s) {
                const int slot = s % slots, round = s / slots;
                if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                const long ua = u0 + (long)s * TS_UNITS, ub = min(u1, ua + TS_UNITS);
                const long ga = group_of(ua), gb = group_of(ub - 1);
                const u32 code_size = (u32)(ub - ua) * 512, param_size = (u32)(gb - ga + 1) * 64;
                const u32 bar = smem_addr(&full[slot]);
                mbar_expect_tx(bar, code_size + param_size);
                bulk_load_evict(smem_addr(ts_smem + slot * TS_STAGE), cbytes + ua * 512, code_size, bar, policy);
                bulk_load_evict(smem_addr(pring + slot * TS_PSLOT), pbytes + ga * 64, param_size, bar, policy);
            }
        }
        return;
    }

    grid_dependency_wait();
    const long t_first = u0 / chunks;
    const int local_tiles = (int)((u1 - 1) / chunks - t_first + 1);
    const int xstride = K * 2 + 16;
    unsigned char* xs = ts_smem + slots * (TS_STAGE + TS_PSLOT);
    float* xsum = reinterpret_cast<float*>(xs + M * xstride);
    const int spans = chunks / GC;
    float* part = xsum + spans * 8;
    {
        const int vecs = K / 8;
        for (int i = threadIdx.x; i < M * vecs; i += TS_WARPS * 32) {
            const int row = i / vecs, col = i - row * vecs;
            *reinterpret_cast<uint4*>(xs + row * xstride + col * 16) =
                reinterpret_cast<const uint4*>(x + row * ldx)[col];
        }
        for (int i = threadIdx.x; i < spans * 8; i += TS_WARPS * 32) xsum[i] = 0.f;
        for (int i = threadIdx.x; i < local_tiles * TS_WARPS * 16 * M; i += TS_WARPS * 32) part[i] = 0.f;
        asm volatile("bar.sync 1, %0;\n" ::"n"(TS_WARPS * 32) : "memory");
        // The activation sums of each token over each span of GC chunks (for the zero points).
        for (int i = warp; i < spans * M; i += TS_WARPS) {
            const int span = i / M, m = i - span * M;
            float v = 0.f;
            if (lane < GC * 8) v = sum8<T>(*reinterpret_cast<const uint4*>(xs + m * xstride + span * GC * 128 + lane * 16));
            v = warp_sum(v);
            if (lane == 0) xsum[span * 8 + m] = v;
        }
        asm volatile("bar.sync 1, %0;\n" ::"n"(TS_WARPS * 32) : "memory");
    }

    const F f{codes, params, chunks, groups, chunk_shift};
    // Token rows past M read row M - 1: their outputs are never stored.
    const unsigned char* xrow = xs + min(lane >> 2, M - 1) * xstride;
    float acc[1][4] = {};
    int cur = -1;  // the local tile acc holds
    auto keep = [&](int lt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = (lane >> 2) + 8 * (e >> 1), m = 2 * t + (e & 1);
            if (m < M) part[((lt * TS_WARPS + warp) * 16 + row) * M + m] = acc[0][e];
            acc[0][e] = 0.f;
        }
    };
    for (int s = 0; s < stages; ++s) {
        const int slot = s % slots, round = s / slots;
        const long ua = u0 + (long)s * TS_UNITS, u = ua + U * warp;
        mbar_wait(smem_addr(&full[slot]), round & 1);
        if (u < min(u1, ua + TS_UNITS)) {
            const long tile = u / chunks;
            const int c = (int)(u - tile * chunks), lt = (int)(tile - t_first);
            if (lt != cur) {
                if (cur >= 0) keep(cur);
                cur = lt;
            }
            typename F::Regs r;
            const unsigned char* cw = ts_smem + slot * TS_STAGE + U * warp * 512 + lane * 16;
#pragma unroll
            for (int uu = 0; uu < U; ++uu) r.w[uu] = *reinterpret_cast<const uint4*>(cw + uu * 512);
            const long ga = group_of(ua);
            const unsigned char* pw = pring + slot * TS_PSLOT + (lane >> 2) * 8;
#pragma unroll
            for (int sp = 0; sp < SPANS; ++sp)
                r.p[sp] = *reinterpret_cast<const uint2*>(pw + (group_of(u + sp * GC) - ga) * 64);
#pragma unroll
            for (int sp = 0; sp < SPANS; ++sp) {
                float G[2][1][4] = {};
#pragma unroll
                for (int uu = 0; uu < GC; ++uu) {
                    uint4 xv[1][2];
                    f.load_x(xrow + (c + sp * GC + uu) * 128, xv[0]);
                    f.template mma<1>(r, sp * GC + uu, xv, G);
                }
                const float2 sv = *reinterpret_cast<const float2*>(xsum + (c / GC + sp) * 8 + 2 * t);
                const float S[1][2] = {{sv.x, sv.y}};
                f.flush(r, sp, G, S, acc);
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
    }
    if (cur >= 0) keep(cur);
    grid_dependents_launch();
    asm volatile("bar.sync 1, %0;\n" ::"n"(TS_WARPS * 32) : "memory");

    // Each local tile: its warps' partials in warp order; whole tiles go out, a tile cut between
    // CTAs goes to its slot and the last CTA to arrive adds the slots in CTA order.
    for (int lt = warp; lt < local_tiles; lt += TS_WARPS) {
        const long tile = t_first + lt;
        const long first = tile * chunks / per_cta, last = ((tile + 1) * chunks - 1) / per_cta;
        const int pieces = (int)(last - first + 1);
        float* base = partial + tile * max_pieces * M * 16;
        for (int i = lane; i < 16 * M; i += 32) {
            const int row = i / M, m = i - row * M;
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < TS_WARPS; ++w) v += part[((lt * TS_WARPS + w) * 16 + row) * M + m];
            const long n = tile * 16 + row;
            if (pieces == 1) {
                if (n < N) y[(long)m * ldy + n] = to_out(v, (OUT*)nullptr);
            } else {
                base[(cta - first) * M * 16 + m * 16 + row] = v;
            }
        }
        if (pieces > 1) {
            release_fence();
            __syncwarp();
            int done = 0;
            if (lane == 0) {
                done = atomicAdd(&counters[tile], 1) == pieces - 1;
                if (done) counters[tile] = 0;
            }
            if (__shfl_sync(0xffffffffu, done, 0)) {
                release_fence();
                for (int i = lane; i < M * 16; i += 32) {
                    const int m = i >> 4;
                    const long n = tile * 16 + (i & 15);
                    float v = 0.f;
                    for (int p = 0; p < pieces; ++p) v += __ldcg(base + (long)p * M * 16 + i);
                    if (n < N) y[(long)m * ldy + n] = to_out(v, (OUT*)nullptr);
                }
            }
        }
    }
}

#define W4A16_TDEC_ENTRY(NAME, T, GC, OUT)                                                                      \
    extern "C" __global__ void __launch_bounds__((TS_WARPS + 1) * 32, 1) NAME(                                   \
        const uint4* codes, const uint2* params, const T* x, long ldx, OUT* y, long ldy, float* partial,           \
        int* counters, int M, int N, int K, int tiles, int chunks, int groups, int group_len, int group_shift,    \
        int per_cta, int max_pieces, int ring_bytes) {                                                           \
        const int chunk_shift = groups == 1 ? 30 : group_shift - 6;                                              \
        w4_stream_gemv<T, GC, OUT>(codes, params, x, ldx, y, ldy, partial, counters, M, N, K, tiles, chunks,    \
                                   groups, chunk_shift, per_cta, max_pieces, ring_bytes);                        \
    }
// Groups of 128 channels or a larger power of two, or one group per row; `_g64` groups of 64;
// `_h` writes the model dtype instead of f32.
#define NIBBLE_W4A16_TDEC(SUFFIX, T)                          \
    W4A16_TDEC_ENTRY(w4a16_tdec_##SUFFIX, T, 2, float)        \
    W4A16_TDEC_ENTRY(w4a16_tdec_h_##SUFFIX, T, 2, T)          \
    W4A16_TDEC_ENTRY(w4a16_tdec_g64_##SUFFIX, T, 1, float)    \
    W4A16_TDEC_ENTRY(w4a16_tdec_h_g64_##SUFFIX, T, 1, T)
NIBBLE_W4A16_TDEC(bf16, __nv_bfloat16)
NIBBLE_W4A16_TDEC(f16, __half)

#endif  // sm_90a

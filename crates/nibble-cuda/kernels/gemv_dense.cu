// Dense 16-bit decode gemv, Hopper (sm_90a): y[m][n] = sum_k x[m][k] * w[n][k] in f32 for 1 to
// 4 tokens, on the weights as they are loaded (row-major [N, K] bf16 or f16; no packing).
//
// Why: at decode sizes a layer is a weight stream, and cuBLAS's kernels spend 4 to 7 µs a call
// over the copy time of the bytes (split-K reduction kernels, ramp-up): on one tensor-parallel
// rank's half layers that is a third of the step (BENCHMARKS.md, issue 24).
//
// Tiling: one CTA per SM owns a contiguous range of weight rows (the ranges differ by at most a
// row), which is one contiguous run of memory, cut into stages of STAGE bytes (16 or 32 KB).
// Within a stage, consumer warp w takes the w-th sixteenth: 1 or 2 KB of 512-byte segments (256
// channels of one row; K is a multiple of 256).
// Pipeline: TMA (LiquidGEMM §5's producer warp; TurboMind §4's stream). Warp 16's first lane
// copies each stage into a ring of shared memory with one 1-D bulk copy (cp.async.bulk,
// L2 evict-first: nothing reads the weights again in this step), completing on the slot's `full`
// mbarrier; the consumers free the slot on its `empty` barrier. One large copy a stage keeps the
// TMA unit's issue cost off the rate, and the ring (up to 160 KB an SM) keeps enough bytes in
// flight for HBM's latency under a full stream without spending registers. The producer starts
// before griddepcontrol.wait: nothing writes the weights, so under programmatic dependent launch
// the ring fills while the previous kernel finishes; the consumers wait, then stage the
// activations in shared memory.
// Layout: shared memory holds the ring, the activations (M x K) and the partial sums (rows x 16
// warps x M). Lane l takes channels 8l .. 8l + 7 of a segment: 16-byte shared-memory reads.
// Arithmetic: a lane sums its products of a row in f32 (two chains within a segment); where it
// leaves a row, the warp sums its lanes with a fixed butterfly into the (row, warp) partial; after
// all stages, a row is the sum of its 16 partials in warp order. No atomics: results are
// deterministic, and a token's output does not depend on the other tokens of the call.
//
// Peer sum (two tensor-parallel ranks on GPUs with peer access; docs/tensor-parallel.md "The
// peer sum"): a row-parallel layer's one-token gemv also stores its rows into the other rank's
// receive slot over NVLink, then counts them (a system-scope release add of its row count on the
// peer's arrivals, and an add on its own). The consumer, the next block's normed gemv,
// waits until the peer's arrivals reach its own (each rank adds the same rows in the same order
// of layers), then norms res + (own + peer) - the bits NCCL's two-rank sum gives - while its
// weight ring fills. That takes the all-reduce's kernel off the step. peer_sum_settle finishes a
// sum whose consumer is anything else; peer_sum_rows sums a whole multi-token output the same
// way (push, count, wait, add) in place of NCCL's all-reduce.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define DG_WARPS 16
#define DG_MAX_SLOTS 10

__device__ __forceinline__ void dg_bulk_load(u32 dst, const void* src, u32 bytes, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}

template <class T> __device__ __forceinline__ void dg_unpack(uint4 v, float (&f)[8]);
template <> __device__ __forceinline__ void dg_unpack<__nv_bfloat16>(uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void dg_unpack<__half>(uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

// A peer sum's counters: `arrivals`, rows the peer has stored into this rank's slots, and `own`,
// rows this rank's gemvs have pushed; `abort` (host memory mapped into every GPU) turns 1 when the
// tensor-parallel group is aborted, so a wait for a rank that failed ends.
struct DgPeer {
    float* peer_y;          // producer: the peer's receive slot for this row
    u64* peer_arrivals;     // producer: the peer's arrival counter
    u64* arrivals;          // this rank's arrival counter
    u64* own;               // this rank's pushed rows
    const float* peer_part; // consumer: this rank's receive slot, the peer's row
    const volatile unsigned* abort;
};

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Thread 0 waits until the peer has pushed as many rows as this rank (its own gemv, the previous
// kernel, has finished: the caller waited on the grid dependency); then the `threads` threads of
// named barrier `bar` go on. Past ten minutes without the peer (and without an abort) it traps:
// the rank's next call reports a CUDA error instead of hanging.
__device__ __forceinline__ void peer_wait(const DgPeer& p, int bar, int threads) {
    if (threadIdx.x == 0) {
        const u64 want = *reinterpret_cast<const volatile u64*>(p.own);
        u64 t0;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
        for (unsigned spin = 1; ld_acquire_sys(p.arrivals) < want; ++spin) {
            if ((spin & 255) == 0) {
                if (*p.abort) break;
                u64 t;
                asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
                if (t - t0 > 600ull * 1000000000ull) __trap();
            }
        }
    }
    asm volatile("bar.sync %0, %1;\n" ::"r"(bar), "r"(threads) : "memory");
}

// The RMSNorm the gemv can take over (NORM) is qgemv.cu's RowNorm: its input is then the model's
// f32 residual row.

// SEGS: segments a warp takes of a stage (stage bytes = 16 * SEGS * 512).
// PEER: 0 none, DG_PUSH the producer of a peer sum, DG_WAIT its consumer (NORM with a delta).
#define DG_PUSH 1
#define DG_WAIT 2
// The normed row's input at channel i: res + delta, where a peer sum's delta is own + peer (the
// sum of two floats is the same bits whichever rank adds it).
template <int PEER>
__device__ __forceinline__ float dg_norm_input(const RowNorm& norm, const DgPeer& peer, int i) {
    if constexpr (PEER == DG_WAIT) return norm.res[i] + (norm.delta[i] + __ldcg(peer.peer_part + i));
    return norm.delta ? norm.res[i] + norm.delta[i] : norm.res[i];
}

// SWIGLU: `w` is a SwiGLU layer's gate rows [0, n) stacked on its up rows [n, 2n); a CTA takes
// gate rows r0 .. r1 and their up partners, streamed as one run (the gate part, then the up part;
// a stage that straddles the two is two bulk copies), and writes hy[r] = T(silu(gate) * up) with
// elementwise.cu's SiluMul on the f32 sums, what the gemv and then the SiLU-gate kernel give.
template <class T, int M, int SEGS, bool NORM = false, int PEER = 0, bool SWIGLU = false>
__device__ __forceinline__ void dense_gemv(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ y,
                                           int n, int k, int ring_bytes, RowNorm norm = {}, DgPeer peer = {},
                                           T* __restrict__ hy = nullptr) {
    constexpr int STAGE = DG_WARPS * SEGS * 512;
    extern __shared__ __align__(128) unsigned char dg_smem[];
    __shared__ __align__(8) u64 full[DG_MAX_SLOTS], empty[DG_MAX_SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (int)((long)blockIdx.x * n / gridDim.x), r1 = (int)((long)(blockIdx.x + 1) * n / gridDim.x);
    const int spr = k >> 8;  // segments a row
    const int rows = SWIGLU ? 2 * (r1 - r0) : r1 - r0;  // rows of this CTA's run
    const long run = (long)(r1 - r0) * k * 2;            // bytes of its gate part
    const long bytes = (long)rows * k * 2;
    const int stages = (int)((bytes + STAGE - 1) / STAGE);
    const int slots = min(ring_bytes / STAGE, DG_MAX_SLOTS);
    if (threadIdx.x == 0) {
        for (int s = 0; s < slots; ++s) {
            mbar_init_count(smem_addr(&full[s]), 1);
            mbar_init_count(smem_addr(&empty[s]), DG_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // The next kernel may be scheduled now: its CTAs take each SM as this grid's CTA there ends
    // (or beside it, where they fit), instead of after this grid's slowest CTA has streamed
    // (its own wait still holds it until this grid has finished). Measured on two H100s: batch-1
    // decode 1.2% (one GPU) and 2.1% (two ranks) faster than launching them after the stream.
    grid_dependents_launch();

    if (warp == DG_WARPS) {
        if (lane == 0) {
            u64 policy;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
            const unsigned char* src = reinterpret_cast<const unsigned char*>(w + (long)r0 * k);
            const unsigned char* up = reinterpret_cast<const unsigned char*>(w + ((long)n + r0) * k);
            const u32 ring = smem_addr(dg_smem);
            for (int s = 0; s < stages; ++s) {
                const int slot = s % slots, round = s / slots;
                if (round > 0) mbar_wait(smem_addr(&empty[slot]), (round - 1) & 1);
                const long at = (long)s * STAGE;
                const u32 size = (u32)min((long)STAGE, bytes - at);
                const u32 bar = smem_addr(&full[slot]);
                mbar_expect_tx(bar, size);
                if constexpr (SWIGLU) {
                    // The run's bytes [at, at + size): gate rows up to `run`, their up rows after.
                    const u32 lo = (u32)max(0L, min((long)size, run - at));
                    if (lo > 0) dg_bulk_load(ring + slot * STAGE, src + at, lo, bar, policy);
                    if (lo < size)
                        dg_bulk_load(ring + slot * STAGE + lo, up + (at + lo - run), size - lo, bar, policy);
                } else {
                    dg_bulk_load(ring + slot * STAGE, src + at, size, bar, policy);
                }
            }
        }
        return;
    }

    grid_dependency_wait();
    T* xs = reinterpret_cast<T*>(dg_smem + ring_bytes);
    float* partial = reinterpret_cast<float*>(dg_smem + ring_bytes + M * k * 2);
    if constexpr (PEER == DG_WAIT) peer_wait(peer, 1, DG_WARPS * 32);
    if constexpr (NORM) {
        // One row (M = 1): x = T((res + delta) * (1 / sqrt(mean((res + delta)^2) + eps)) * nw),
        // rms_norm_impl's arithmetic; the sum of squares in another order (16 warps).
        __shared__ float red[DG_WARPS];
        float ss = 0.f;
        for (int i = threadIdx.x; i < k; i += DG_WARPS * 32) {
            const float v = dg_norm_input<PEER>(norm, peer, i);
            ss = fmaf(v, v, ss);
        }
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        for (int i = threadIdx.x; i < rows * DG_WARPS * M; i += DG_WARPS * 32) partial[i] = 0.f;
        asm volatile("bar.sync 1, %0;\n" ::"n"(DG_WARPS * 32) : "memory");
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < DG_WARPS; ++i) total += red[i];
        const float scale = 1.0f / sqrtf(total / (float)k + norm.eps);
        for (int i = threadIdx.x; i < k; i += DG_WARPS * 32) {
            const float v = dg_norm_input<PEER>(norm, peer, i);
            xs[i] = from_f32<T>(v * scale * norm.nw[i]);
            if (blockIdx.x == 0 && norm.delta) norm.res_out[i] = v;
        }
        asm volatile("bar.sync 1, %0;\n" ::"n"(DG_WARPS * 32) : "memory");
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(x);
        uint4* dst = reinterpret_cast<uint4*>(xs);
        for (int i = threadIdx.x; i < M * k / 8; i += DG_WARPS * 32) dst[i] = src[i];
        for (int i = threadIdx.x; i < rows * DG_WARPS * M; i += DG_WARPS * 32) partial[i] = 0.f;
        asm volatile("bar.sync 1, %0;\n" ::"n"(DG_WARPS * 32) : "memory");
    }

    const int segs = rows * spr;
    float acc[M][2];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = 0.f;
    int cur = -1;  // the row acc holds
    for (int s = 0; s < stages; ++s) {
        const int slot = s % slots, round = s / slots;
        const int q0 = s * (STAGE / 512) + warp * SEGS;
        mbar_wait(smem_addr(&full[slot]), round & 1);
        if (q0 < segs) {
            int row = q0 / spr, col = q0 - row * spr;
            const unsigned char* at = dg_smem + slot * STAGE + warp * SEGS * 512 + lane * 16;
#pragma unroll
            for (int j = 0; j < SEGS; ++j) {
                if (q0 + j < segs) {
                    if (row != cur) {
                        if (cur >= 0) {
#pragma unroll
                            for (int m = 0; m < M; ++m) {
                                const float v = warp_sum(acc[m][0] + acc[m][1]);
                                if (lane == 0) partial[(cur * DG_WARPS + warp) * M + m] = v;
                                acc[m][0] = acc[m][1] = 0.f;
                            }
                        }
                        cur = row;
                    }
                    float wf[8];
                    dg_unpack<T>(*reinterpret_cast<const uint4*>(at + j * 512), wf);
                    const T* xc = xs + col * 256 + lane * 8;
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float xf[8];
                        dg_unpack<T>(*reinterpret_cast<const uint4*>(xc + m * k), xf);
                        float p0 = wf[0] * xf[0], p1 = wf[1] * xf[1];
#pragma unroll
                        for (int i = 2; i < 8; i += 2) {
                            p0 = fmaf(wf[i], xf[i], p0);
                            p1 = fmaf(wf[i + 1], xf[i + 1], p1);
                        }
                        acc[m][j & 1] += p0 + p1;
                    }
                    if (++col == spr) {
                        col = 0;
                        ++row;
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
    }
    if (cur >= 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float v = warp_sum(acc[m][0] + acc[m][1]);
            if (lane == 0) partial[(cur * DG_WARPS + warp) * M + m] = v;
        }
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(DG_WARPS * 32) : "memory");
    if constexpr (SWIGLU) {
        for (int r = threadIdx.x; r < r1 - r0; r += DG_WARPS * 32) {
            float g = 0.f, u = 0.f;
#pragma unroll
            for (int ww = 0; ww < DG_WARPS; ++ww) {
                g += partial[r * DG_WARPS + ww];
                u += partial[(r + r1 - r0) * DG_WARPS + ww];
            }
            hy[r0 + r] = from_f32<T>(SiluMul{}(g, u));
        }
        return;
    }
    for (int i = threadIdx.x; i < (r1 - r0) * M; i += DG_WARPS * 32) {
        const int r = i / M, m = i - r * M;
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < DG_WARPS; ++ww) v += partial[(r * DG_WARPS + ww) * M + m];
        y[(long)m * n + r0 + r] = v;
        if constexpr (PEER == DG_PUSH) peer.peer_y[(long)m * n + r0 + r] = v;
    }
    if constexpr (PEER == DG_PUSH) {
        // Every row stored (this CTA's threads, named barrier 1), then counted at system scope.
        asm volatile("bar.sync 1, %0;\n" ::"n"(DG_WARPS * 32) : "memory");
        if (threadIdx.x == 0) {
            // A release add at system scope: the barrier puts the CTA's row stores before this
            // thread's add in causality order, and release makes them visible to the peer first.
            // (A sequentially consistent fence then a plain add did the same, 1.3% slower a
            // batch-1 step on two H100s.)
            asm volatile("red.release.sys.global.add.u64 [%0], %1;\n" ::"l"(peer.peer_arrivals),
                         "l"((u64)(r1 - r0))
                         : "memory");
            atomicAdd(peer.own, (u64)(r1 - r0));
        }
    }
}

#define DG_ENTRY(T, SFX, M, SEGS, KB)                                                                            \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv##M##_s##KB##_##SFX(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ y, int n, \
                                      int k, int ring_bytes) {                                                 \
        dense_gemv<T, M, SEGS>(w, x, y, n, k, ring_bytes);                                                     \
    }
#define DG_ENTRIES(T, SFX)        \
    DG_ENTRY(T, SFX, 1, 2, 16)    \
    DG_ENTRY(T, SFX, 2, 2, 16)    \
    DG_ENTRY(T, SFX, 3, 2, 16)    \
    DG_ENTRY(T, SFX, 4, 2, 16)    \
    DG_ENTRY(T, SFX, 1, 4, 32)    \
    DG_ENTRY(T, SFX, 2, 4, 32)    \
    DG_ENTRY(T, SFX, 3, 4, 32)    \
    DG_ENTRY(T, SFX, 4, 4, 32)
DG_ENTRIES(__nv_bfloat16, bf16)
DG_ENTRIES(__half, f16)

// One token with the RMSNorm before the layer taken over (Backend::norm_linear).
#define DG_NORM_ENTRY(T, SFX)                                                                                   \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv_norm1_s32_##SFX(const T* __restrict__ w, const float* res, const float* delta, const float* nw, \
                                   float* res_out, float* __restrict__ y, int n, int k, int ring_bytes, float eps) { \
        dense_gemv<T, 1, 4, true>(w, nullptr, y, n, k, ring_bytes, RowNorm{res, delta, nw, res_out, eps});      \
    }
DG_NORM_ENTRY(__nv_bfloat16, bf16)
DG_NORM_ENTRY(__half, f16)

// A peer sum's producer: one token, the rows also pushed to the peer's receive slot.
#define DG_PUSH_ENTRY(T, SFX)                                                                                   \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv1_push_s32_##SFX(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ y, int n, \
                                   int k, int ring_bytes, float* peer_y, u64* peer_arrivals, u64* own) {         \
        dense_gemv<T, 1, 4, false, DG_PUSH>(w, x, y, n, k, ring_bytes, RowNorm{},                                 \
                                            DgPeer{peer_y, peer_arrivals, nullptr, own, nullptr, nullptr});      \
    }
DG_PUSH_ENTRY(__nv_bfloat16, bf16)
DG_PUSH_ENTRY(__half, f16)

// A peer sum's consumer: the normed gemv of res + (delta + the peer's row), once it has arrived.
#define DG_PEER_NORM_ENTRY(T, SFX)                                                                              \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv_norm1_peer_s32_##SFX(const T* __restrict__ w, const float* res, const float* delta,          \
                                        const float* peer_part, const float* nw, float* res_out,               \
                                        float* __restrict__ y, int n, int k, int ring_bytes, float eps,        \
                                        u64* arrivals, u64* own, const unsigned* abort) {                      \
        dense_gemv<T, 1, 4, true, DG_WAIT>(w, nullptr, y, n, k, ring_bytes, RowNorm{res, delta, nw, res_out, eps}, \
                                           DgPeer{nullptr, nullptr, arrivals, own, peer_part, abort});         \
    }
DG_PEER_NORM_ENTRY(__nv_bfloat16, bf16)
DG_PEER_NORM_ENTRY(__half, f16)

// A SwiGLU layer's gate/up with the norm before it taken over, alone or as a peer sum's consumer:
// out (model dtype) = silu(gate) * up of the normed row.
#define DG_SWIGLU_ENTRIES(T, SFX)                                                                               \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv_norm1_swiglu_s32_##SFX(const T* __restrict__ w, const float* res, const float* delta,        \
                                          const float* nw, float* res_out, T* __restrict__ out, int n, int k,  \
                                          int ring_bytes, float eps) {                                         \
        dense_gemv<T, 1, 4, true, 0, true>(w, nullptr, nullptr, n, k, ring_bytes,                              \
                                           RowNorm{res, delta, nw, res_out, eps}, DgPeer{}, out);               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__((DG_WARPS + 1) * 32, 1)                                       \
        dense_gemv_norm1_peer_swiglu_s32_##SFX(const T* __restrict__ w, const float* res, const float* delta,   \
                                               const float* peer_part, const float* nw, float* res_out,        \
                                               T* __restrict__ out, int n, int k, int ring_bytes, float eps,   \
                                               u64* arrivals, u64* own, const unsigned* abort) {               \
        dense_gemv<T, 1, 4, true, DG_WAIT, true>(w, nullptr, nullptr, n, k, ring_bytes,                        \
                                                 RowNorm{res, delta, nw, res_out, eps},                         \
                                                 DgPeer{nullptr, nullptr, arrivals, own, peer_part, abort}, out); \
    }
DG_SWIGLU_ENTRIES(__nv_bfloat16, bf16)
DG_SWIGLU_ENTRIES(__half, f16)

// A peer sum whose consumer is not a normed gemv: y = y + the peer's row, once it has arrived
// (one CTA; a row of the residual stream).
extern "C" __global__ void __launch_bounds__(1024) peer_sum_settle(float* y, const float* peer_part, int n,
                                                                 u64* arrivals, u64* own,
                                                                 const unsigned* abort) {
    grid_dependency_wait();
    const DgPeer p{nullptr, nullptr, arrivals, own, peer_part, abort};
    peer_wait(p, 0, blockDim.x);
    grid_dependents_launch();
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = y[i] + __ldcg(peer_part + i);
}

// A peer sum of a whole output, any number of rows (what cuBLAS or a quantized GEMM wrote: the
// multi-token steps, where NCCL's all-reduce spent 10 to 34 us a sum): in place, y = y + the
// peer's y. Each CTA stores its share of y into the peer's receive slot, counts it there with a
// release add, then waits until the peer's whole output has arrived and adds it. Every CTA waits
// for every peer CTA, so the grid is at most one CTA an SM (all resident). `own` moves on by the
// output's size once every CTA has read it (`done` counts the CTAs; the last one resets it), so
// both ranks keep counting alike.
// Wire formats: f32, the bits of NCCL's two-rank sum; or BF16 (half the NVLink bytes, as vLLM's
// and TensorRT-LLM's 16-bit all-reduces), each rank's addend rounded to bf16 before the f32 add,
// its own as well as the peer's, so both ranks still hold the same bits.
template <bool BF16>
__device__ __forceinline__ void peer_sum_rows_impl(float* y, void* peer_y, const void* recv, long long n4,
                                                   u64* peer_arrivals, u64* arrivals, u64* own, unsigned* done,
                                                   const unsigned* abort) {
    grid_dependency_wait();
    __shared__ u64 target;
    const long long per = (n4 + gridDim.x - 1) / gridDim.x;
    const long long b = (long long)blockIdx.x * per;
    const long long e = b + per < n4 ? b + per : n4;
    float4* y4 = reinterpret_cast<float4*>(y);
    // A float4 of y as its wire format: 16 bytes of f32, or 8 of bf16.
    auto round4 = [](float4 v) {
        return make_float4(__bfloat162float(__float2bfloat16_rn(v.x)), __bfloat162float(__float2bfloat16_rn(v.y)),
                           __bfloat162float(__float2bfloat16_rn(v.z)), __bfloat162float(__float2bfloat16_rn(v.w)));
    };
    if (threadIdx.x == 0) target = *reinterpret_cast<const volatile u64*>(own) + (u64)n4;
    for (long long i = b + threadIdx.x; i < e; i += blockDim.x) {
        const float4 v = y4[i];
        if constexpr (BF16) {
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
            uint2 w;
            w.x = *reinterpret_cast<const u32*>(&lo);
            w.y = *reinterpret_cast<const u32*>(&hi);
            reinterpret_cast<uint2*>(peer_y)[i] = w;
        } else {
            reinterpret_cast<float4*>(peer_y)[i] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (e > b)
            asm volatile("red.release.sys.global.add.u64 [%0], %1;\n" ::"l"(peer_arrivals), "l"((u64)(e - b))
                         : "memory");
        // Each CTA's read of `own` comes before its count (the fence); the last CTA's fence
        // after its count orders every CTA's read before its move of `own` (fence to fence
        // through the counts on `done`).
        __threadfence();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            __threadfence();
            *done = 0;
            atomicAdd(own, (u64)n4);
        }
        u64 t0;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
        for (unsigned spin = 1; ld_acquire_sys(arrivals) < target; ++spin) {
            if ((spin & 255) == 0) {
                if (*reinterpret_cast<const volatile unsigned*>(abort)) break;
                u64 t;
                asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
                if (t - t0 > 600ull * 1000000000ull) __trap();
            }
        }
    }
    __syncthreads();
    grid_dependents_launch();
    for (long long i = b + threadIdx.x; i < e; i += blockDim.x) {
        float4 a = y4[i], p;
        if constexpr (BF16) {
            const uint2 w = __ldcg(reinterpret_cast<const uint2*>(recv) + i);
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
            p = make_float4(lo.x, lo.y, hi.x, hi.y);
            a = round4(a);
        } else {
            p = __ldcg(reinterpret_cast<const float4*>(recv) + i);
        }
        y4[i] = make_float4(a.x + p.x, a.y + p.y, a.z + p.z, a.w + p.w);
    }
}

extern "C" __global__ void __launch_bounds__(1024) peer_sum_rows(float* y, float* peer_y, const float* recv,
                                                               long long n4, u64* peer_arrivals, u64* arrivals,
                                                               u64* own, unsigned* done, const unsigned* abort) {
    peer_sum_rows_impl<false>(y, peer_y, recv, n4, peer_arrivals, arrivals, own, done, abort);
}
extern "C" __global__ void __launch_bounds__(1024) peer_sum_rows_bf16(float* y, void* peer_y, const void* recv,
                                                                    long long n4, u64* peer_arrivals, u64* arrivals,
                                                                    u64* own, unsigned* done, const unsigned* abort) {
    peer_sum_rows_impl<true>(y, peer_y, recv, n4, peer_arrivals, arrivals, own, done, abort);
}

#endif  // sm_90a

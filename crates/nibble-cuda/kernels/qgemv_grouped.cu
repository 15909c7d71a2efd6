// Grouped decode gemv, Hopper tier: the experts of a mixture-of-experts layer in one launch, each
// routed expert's rows through the persistent decode gemv of qgemv.cu (TurboMind §3-4.1 packing,
// QServe §5 scales after the MMA) for W4A16, W8A8, W4A8, FP8 and 16-bit (BF16 / F16) weights.
//
// Work: a table of items, each one expert's weights over a run of consecutive rows of the input,
// which the host gathered in expert order (the outputs go to the same rows). Every item has the
// same geometry (one layer), so the grid is `items x ctas_per_item` CTAs and CTA c of item i runs
// the stream-K slice c of that item's `row block x chunk` units: each CTA stages one item's
// activations only, and the host picks `per_cta` so the launch fills whole waves of SMs
// (grouped::plan). Only routed experts have items; no other expert's bytes are read.
// Split-K partial slots and arrival counters are the item's own (`max_pieces x max_m x 16` floats
// a tile, one counter a tile), so items never meet.
//
// 16-bit weights are plain row-major [N][K] (the model's dense layout, no packing): lane (g, t)
// reads bytes t*16 and 64 + t*16 of a 128-byte chunk row for rows g and g + 8 (a quad reads two
// whole 64-byte runs), so it holds channels t*8 .. t*8+7 and 32+t*8 .. 32+t*8+7; k16 step j takes
// word j of each half as the A fragment's two k pairs, and the staged activations are read the
// same way. A 16-row chunk is 2 KB (64 B a lane), so two chunks a batch keep the register budget.
// Rows past N read row N - 1 (never stored).

template <class T> struct DecB16 {
    using X = T;
    using Acc = float;
    static constexpr int U = 2, GC = 2, SPANS = 1;
    static constexpr bool ZERO_POINTS = false;
    struct Regs {
        uint4 w[U][4];  // row g channels t*8.., 32+t*8..; row g + 8 the same
    };
    struct Tile {
        const uint4* r0;
        const uint4* r8;
    };
    const T* w;
    int n, k;

    __device__ __forceinline__ Tile tile_at(int tile) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const long r0 = min(tile * 16 + g, n - 1), r8 = min(tile * 16 + g + 8, n - 1);
        return {reinterpret_cast<const uint4*>(w + r0 * k) + t, reinterpret_cast<const uint4*>(w + r8 * k) + t};
    }
    __device__ __forceinline__ void fetch(const Tile& t, int c, Regs& r) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            r.w[u][0] = ld_stream(t.r0 + (c + u) * 8);
            r.w[u][1] = ld_stream(t.r0 + (c + u) * 8 + 4);
            r.w[u][2] = ld_stream(t.r8 + (c + u) * 8);
            r.w[u][3] = ld_stream(t.r8 + (c + u) * 8 + 4);
        }
    }
    __device__ __forceinline__ void load_x(const unsigned char* row, uint4 (&v)[2]) const {
        const int t = threadIdx.x & 3;
        v[0] = *reinterpret_cast<const uint4*>(row + t * 16);
        v[1] = *reinterpret_cast<const uint4*>(row + 64 + t * 16);
    }
    __device__ __forceinline__ static u32 word(const uint4& v, int j) {
        return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
    }
    template <int TT>
    __device__ __forceinline__ void mma(const Regs& r, int u, const uint4 (&xv)[TT][2], float (&G)[2][TT][4]) const {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 a[4] = {word(r.w[u][0], j), word(r.w[u][2], j), word(r.w[u][1], j), word(r.w[u][3], j)};
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) mma16816<T>(G[j & 1][tt], a, word(xv[tt][0], j), word(xv[tt][1], j));
        }
    }
    template <int TT>
    __device__ __forceinline__ void flush(const Regs&, int, const float (&G)[2][TT][4], const float (&)[TT][2],
                                          float (&acc)[TT][4]) const {
        add_chains<TT>(G, acc);
    }
};

// (GroupedItem, the table's entry, is in qgemm.cu: the mma.sync grouped gemv reads it too.)

#if !defined(DEC_NO_ENTRIES) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
// Item `blockIdx.x / ctas_per_item`'s slice `blockIdx.x % ctas_per_item` of the decode gemv, its
// input and output `row` rows in, its partial slots and counters its own. `make(item)` builds
// the item's unit reader and epilogue. LEAN: dec_gemv's lean loop (qgemv.cu, `dec_gemv_lean`).
template <int TT, bool LEAN = false, class X, class Acc, class Make>
__device__ __forceinline__ void dec_grouped(const GroupedItem* items, int ctas_per_item, const X* x, long ldx,
                                            float* y, long ldy, Acc* partial, int* counters, int max_m, int N,
                                            int K, int tiles, int chunks, int per_cta, int max_pieces,
                                            const Make& make) {
    const int item = blockIdx.x / ctas_per_item, cta = blockIdx.x % ctas_per_item;
    if (cta * per_cta >= (tiles + DEC_WARPS - 1) / DEC_WARPS * chunks) return;
    const GroupedItem it = items[item];
    const auto fe = make(it);
    dec_gemv<TT, DEC_WARPS, LEAN>(fe.first, x + it.row * ldx, ldx, y + it.row * ldy, ldy,
                            partial + (long)item * tiles * max_pieces * max_m * 16, counters + (long)item * tiles,
                            it.m, N, K, tiles, chunks, per_cta, max_pieces, fe.second, cta);
}

template <class F, class E> struct UnitsAnd {
    F first;
    E second;
};

#define GDEC_PARAMS(X, ACC)                                                                             \
    const GroupedItem *items, int ctas_per_item, const X *x, long ldx, const float *sx, float *y, long ldy, \
        ACC *partial, int *counters, int max_m, int N, int K, int tiles, int chunks, int groups,          \
        int group_shift, int per_cta, int max_pieces
#define GDEC_ARGS items, ctas_per_item, x, ldx, y, ldy, partial, counters, max_m, N, K, tiles, chunks, per_cta, max_pieces

// W4A16: `groups` groups of 2^group_shift channels a row (GC 2), `_g64` groups of 64 (GC 1). The
// lean loop for two token tiles where the dense entries (qgemv.cu) take it: on an H200 it took a
// Mixtral layer's 64-token experts (16 rows each) from 283 to 250 µs, but one tile's 8 to 32
// tokens from 204-224 to 208-232 µs (`bench/results/moe-lean-20261126/`).
#define W4A16_GDEC_ENTRY(NAME, T, TT, GC)                                                                 \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(T, float)) {         \
        const int chunk_shift = groups == 1 ? 30 : group_shift - 6;                                       \
        constexpr bool lean = TT == 2 && (GC == 2 || !W4Math<T>::NIBBLE_AT_4);                           \
        dec_grouped<TT, lean>(GDEC_ARGS, [&](const GroupedItem& it) {                                     \
            return UnitsAnd<DecW4<T, GC>, W4Epilogue>{                                                    \
                {(const uint4*)it.codes, (const uint2*)it.params, chunks, groups, chunk_shift}, {}};       \
        });                                                                                               \
    }
#define B16_GDEC_ENTRY(NAME, T, TT)                                                                       \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(T, float)) {         \
        dec_grouped<TT>(GDEC_ARGS, [&](const GroupedItem& it) {                                           \
            return UnitsAnd<DecB16<T>, W4Epilogue>{{(const T*)it.codes, N, K}, {}};                       \
        });                                                                                               \
    }
#define W8A16_GDEC_ENTRY(NAME, T, TT)                                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(T, float)) {         \
        dec_grouped<TT>(GDEC_ARGS, [&](const GroupedItem& it) {                                           \
            return UnitsAnd<DecW8A16<T>, RowScaleEpilogue>{{{(const uint4*)it.codes, chunks}}, {it.scales}}; \
        });                                                                                               \
    }
#define NIBBLE_16BIT_GDEC(SUFFIX, T)                          \
    W8A16_GDEC_ENTRY(w8a16_gdec1_##SUFFIX, T, 1)              \
    W8A16_GDEC_ENTRY(w8a16_gdec2_##SUFFIX, T, 2)              \
    W4A16_GDEC_ENTRY(w4a16_gdec1_##SUFFIX, T, 1, 2)           \
    W4A16_GDEC_ENTRY(w4a16_gdec2_##SUFFIX, T, 2, 2)           \
    W4A16_GDEC_ENTRY(w4a16_gdec1_g64_##SUFFIX, T, 1, 1)       \
    W4A16_GDEC_ENTRY(w4a16_gdec2_g64_##SUFFIX, T, 2, 1)       \
    W4A16_GDEC_ENTRY(w4a16_gdec4_##SUFFIX, T, 4, 2)           \
    W4A16_GDEC_ENTRY(w4a16_gdec4_g64_##SUFFIX, T, 4, 1)       \
    B16_GDEC_ENTRY(b16_gdec1_##SUFFIX, T, 1)                  \
    B16_GDEC_ENTRY(b16_gdec2_##SUFFIX, T, 2)
NIBBLE_BOTH_DTYPES(NIBBLE_16BIT_GDEC)

// The 8-bit-activation families: `x` the gathered rows' codes, `sx` their per-row scales.
#define W8A8_GDEC_ENTRY(NAME, TT)                                                                         \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(signed char, int)) { \
        dec_grouped<TT>(GDEC_ARGS, [&](const GroupedItem& it) {                                           \
            return UnitsAnd<DecW8, W8Epilogue>{{(const uint4*)it.codes, chunks}, {sx + it.row, it.scales}}; \
        });                                                                                               \
    }
// W4A8: `_g32` for groups of 32 (DecW4A8's two parameter pairs a chunk), as the dense entries.
#define W4A8_GDEC_ENTRY(NAME, TT, TWO)                                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(signed char, int)) { \
        dec_grouped<TT>(GDEC_ARGS, [&](const GroupedItem& it) {                                           \
            return UnitsAnd<DecW4A8<TWO>, W8Epilogue>{                                                    \
                {(const uint4*)it.codes, (const uint2*)it.params, chunks, groups, group_shift},            \
                {sx + it.row, it.scales}};                                                                \
        });                                                                                               \
    }
#define FP8_GDEC_ENTRY(NAME, TT)                                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, 1) NAME(GDEC_PARAMS(unsigned char, float)) { \
        dec_grouped<TT>(GDEC_ARGS, [&](const GroupedItem& it) {                                           \
            return UnitsAnd<DecFp8, W8Epilogue>{{(const uint4*)it.codes, chunks}, {sx + it.row, it.scales}}; \
        });                                                                                               \
    }
W8A8_GDEC_ENTRY(w8a8_gdec1, 1)
W8A8_GDEC_ENTRY(w8a8_gdec2, 2)
W8A8_GDEC_ENTRY(w8a8_gdec4, 4)
W4A8_GDEC_ENTRY(w4a8_gdec1, 1, false)
W4A8_GDEC_ENTRY(w4a8_gdec2, 2, false)
W4A8_GDEC_ENTRY(w4a8_gdec4, 4, false)
W4A8_GDEC_ENTRY(w4a8_gdec1_g32, 1, true)
W4A8_GDEC_ENTRY(w4a8_gdec2_g32, 2, true)
W4A8_GDEC_ENTRY(w4a8_gdec4_g32, 4, true)
FP8_GDEC_ENTRY(fp8_gdec1, 1)
FP8_GDEC_ENTRY(fp8_gdec2, 2)
FP8_GDEC_ENTRY(fp8_gdec4, 4)
#endif

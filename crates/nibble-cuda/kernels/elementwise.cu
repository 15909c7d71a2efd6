// Row-wise and elementwise ops of the transformer block: embedding lookup, RMSNorm (fused with
// the residual add), per-head QK norm, rotary embedding, SiLU-gate, residual add, row gather,
// f32 -> 16-bit casts, and the paged KV-cache append.
//
// Layout: activations are row-major [tokens, features]; the residual stream, GEMM outputs, q/k/v
// and the gate/up products are f32, everything a GEMM reads is the model dtype T. One block per
// row for the reductions and the gated activations, a flat grid-stride loop for the other
// elementwise ops. Row ops hold rows of up to 16K values in registers, read once with 16-byte
// loads (the register path, common.cuh), and walk wider or unaligned rows in pages (row_pages)
// so that a thread's loads are in flight together. Nothing here is compute-bound; each op moves its bytes
// once. The arithmetic follows nibble-cpu's ops.rs (rms: 1/sqrt(mean(x^2)+eps), RoPE angles in
// f64) so the CPU backend is a tight reference.

// Row kernels take up to 1024 threads (norm_block), two blocks per SM for many-row (prefill)
// launches: registers are capped to 32 (those with the register path below: 64).
#define ROW_KERNEL __launch_bounds__(1024, 2)
// Row kernels with the register path (common.cuh, ROW_VECS): a thread holds up to 32 floats of
// its rows, which needs more than 32 registers.
#define ROW_REGS_KERNEL __launch_bounds__(1024, 1)

template <class T>
__device__ void embed_impl(const T* __restrict__ table, const int* __restrict__ ids,
                           float* __restrict__ out, int h) {
    grid_dependency_enter();
    const long row = blockIdx.x;
    const T* src = table + (long)ids[row] * h;
    for (int c = threadIdx.x; c < h; c += blockDim.x) out[row * h + c] = to_f32(src[c]);
}

// x += delta (when delta is not null), then out = T(x * 1/sqrt(mean(x^2) + eps) * w). Returns
// this thread's AbsMax of its outputs, for the fused INT8 codes.
template <class T>
__device__ AbsMax rms_norm_impl(float* __restrict__ x, const float* __restrict__ delta,
                                const float* __restrict__ w, T* __restrict__ out, int h,
                                float eps) {
    grid_dependency_enter();
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    float* xr = x + row * h;
    const float* dr = delta + row * h;
    float ss = 0.f;
    row_pages(
        h, [&](int c) { return delta ? xr[c] + dr[c] : xr[c]; },
        [&](int c, float v) {
            if (delta) xr[c] = v;
            ss = fmaf(v, v, ss);
        });
    const float total = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(total / (float)h + eps);
    AbsMax am;
    row_pages(
        h, [&](int c) { return make_float2(xr[c], w[c]); },
        [&](int c, float2 v) {
            const T o = from_f32<T>(v.x * scale * v.y);
            out[row * h + c] = o;
            am.add(to_f32(o));
        });
    return am;
}

// rms_norm_impl on the register path (rms_norm_row checked that the row fits): `o` gets the
// output row as stored. The same arithmetic but for the order of the sum of squares.
template <class T>
__device__ __forceinline__ AbsMax rms_norm_regs(float* __restrict__ x, const float* __restrict__ delta,
                                                const float* __restrict__ w, T* __restrict__ out, int h,
                                                float eps, float4 (&o)[ROW_VECS]) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    float* xr = x + row * h;
    const float* dr = delta + row * h;
    const int n4 = h >> 2;
    float4 d[ROW_VECS];
    load_regs(xr, delta ? dr : nullptr, n4, o, d);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < ROW_VECS; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < n4) {
            if (delta) {
                o[i] = make_float4(o[i].x + d[i].x, o[i].y + d[i].y, o[i].z + d[i].z, o[i].w + d[i].w);
                st4(xr + 4 * u, o[i]);
            }
            ss = fmaf(o[i].x, o[i].x, ss);
            ss = fmaf(o[i].y, o[i].y, ss);
            ss = fmaf(o[i].z, o[i].z, ss);
            ss = fmaf(o[i].w, o[i].w, ss);
            d[i] = ld4(w + 4 * u);  // the weights' loads overlap the block's sum
        }
    }
    const float total = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(total / (float)h + eps);
    AbsMax am;
#pragma unroll
    for (int i = 0; i < ROW_VECS; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < n4) {
            o[i] = store_rounded4(out + row * h + 4 * u,
                                  make_float4(o[i].x * scale * d[i].x, o[i].y * scale * d[i].y,
                                              o[i].z * scale * d[i].z, o[i].w * scale * d[i].w));
            add_abs(am, o[i]);
        }
    }
    return am;
}

// A row of RMSNorm (rms_norm_impl), then its codes `C` unless C is NoCodes: on the register path
// where the row fits it, else on the paged one.
template <class T, class C>
__device__ __forceinline__ void rms_norm_row(float* x, const float* delta, const float* w, T* out, int h,
                                             float eps, typename C::Code* q, float* sx) {
    const bool regs = row_vec_fits(h) && aligned16(x, h) && (!delta || aligned16(delta, h)) &&
                      aligned16(w, 0) && aligned_pack4(out) && aligned_pack4(q);
    if (regs) {
        grid_dependency_enter();
        float4 o[ROW_VECS];
        const AbsMax am = rms_norm_regs<T>(x, delta, w, out, h, eps, o);
        if (C::ON) quantize_regs<C>(o, h, q, h, sx, am);
    } else {
        const AbsMax am = rms_norm_impl<T>(x, delta, w, out, h, eps);
        if (C::ON) quantize_row<C>(out, h, q, h, sx, h, am);
    }
}

// One page of a gated activation's row: `act(gate) * up` for the float4s t, t + blockDim.x, ...
// below n4 (at most ROW_VECS each), stored to `out` and returned as stored in `o`.
template <class T, class ACT>
__device__ __forceinline__ void gated_regs(const float* __restrict__ gate, const float* __restrict__ up,
                                           T* __restrict__ out, int n4, float4 (&o)[ROW_VECS], AbsMax& am,
                                           ACT act) {
    float4 u4[ROW_VECS];
    load_regs(gate, up, n4, o, u4);
#pragma unroll
    for (int i = 0; i < ROW_VECS; ++i) {
        const int u = threadIdx.x + i * blockDim.x;
        if (u < n4) {
            o[i] = store_rounded4(out + 4 * u, make_float4(act(o[i].x, u4[i].x), act(o[i].y, u4[i].y),
                                                           act(o[i].z, u4[i].z), act(o[i].w, u4[i].w)));
            add_abs(am, o[i]);
        }
    }
}

// Gemma's GeGLU: PyTorch's gelu(approximate="tanh") of gate, times up (the CPU's gelu_tanh).
struct GeluTanhMul {
    __device__ __forceinline__ float operator()(float g, float u) const {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(inner)) * u;
    }
};

// `act(gate) * up` for rows blockIdx.x, + gridDim.x, ... (gate and up may be column slices of one
// fused GEMM output, row strides ldg and ldu); out is [rows, cols] of T. Register-path pages
// where the rows are aligned, else the paged loop; no 64-bit division per element.
template <class T, class ACT>
__device__ __forceinline__ void gated_rows(const float* gate, const float* up, T* out, long n, int cols,
                                           long ldg, long ldu, ACT act) {
    grid_dependency_enter();  // silu_mul_ is one of compile::GRID_WAITING_KERNELS
    const long rows = n / cols;
    const bool vec = (cols & 3) == 0 && aligned16(gate, ldg) && aligned16(up, ldu) &&
                     aligned_pack4(out);
    const int page = ROW_VECS * 4 * blockDim.x;
    for (long r = blockIdx.x; r < rows; r += gridDim.x) {
        if (vec) {
            for (int c0 = 0; c0 < cols; c0 += page) {
                float4 o[ROW_VECS];
                AbsMax unused;
                gated_regs<T>(gate + r * ldg + c0, up + r * ldu + c0, out + r * cols + c0,
                              min(page, cols - c0) >> 2, o, unused, act);
            }
        } else {
            row_pages(
                cols, [&](int c) { return make_float2(gate[r * ldg + c], up[r * ldu + c]); },
                [&](int c, float2 gu) { out[r * cols + c] = from_f32<T>(act(gu.x, gu.y)); });
        }
    }
}

#define NIBBLE_ROW_KERNELS(SUFFIX, T)                                                            \
    extern "C" __global__ void ROW_KERNEL embed_##SUFFIX(const T* table, const int* ids, float* out, int h) { \
        embed_impl<T>(table, ids, out, h);                                                       \
    }                                                                                            \
    extern "C" __global__ void ROW_REGS_KERNEL rms_norm_##SUFFIX(float* x, const float* delta, const float* w, \
                                                 T* out, int h, float eps) {                     \
        rms_norm_row<T, NoCodes>(x, delta, w, out, h, eps, nullptr, nullptr);                   \
    }                                                                                            \
    /* gate and up may be column slices of one fused GEMM output (row strides ldg, ldu). */    \
    extern "C" __global__ void ROW_REGS_KERNEL silu_mul_##SUFFIX(const float* gate, const float* up, T* out, \
                                                 long n, int cols, long ldg, long ldu) {         \
        gated_rows<T>(gate, up, out, n, cols, ldg, ldu, SiluMul{});                              \
    }                                                                                            \
    extern "C" __global__ void ROW_REGS_KERNEL gelu_tanh_mul_##SUFFIX(const float* gate, const float* up, \
                                                 T* out, long n, int cols, long ldg, long ldu) { \
        gated_rows<T>(gate, up, out, n, cols, ldg, ldu, GeluTanhMul{});                          \
    }                                                                                            \
    extern "C" __global__ void cast_##SUFFIX(const float* x, T* out, long n) {                    \
        for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;                        \
             i += (long)gridDim.x * blockDim.x)                                                  \
            out[i] = from_f32<T>(x[i]);                                                          \
    }                                                                                            \
    /* Writes each token's k and v rows (f32, [tokens, kv_row]) into the cache: position p of   \
       sequence s is offset p % block_size of block table[s][p / block_size], and a block holds \
       [kv_heads][block_size][head_dim], so one head's rows of a block are contiguous. */       \
    extern "C" __global__ void kv_append_##SUFFIX(const float* k, const float* v, T* kc, T* vc,   \
                                                  const int* block_tables, const int* tok_seq,   \
                                                  const int* tok_pos, int max_blocks,            \
                                                  int block_size, int kv_row, int head_dim,      \
                                                  long ldk, long ldv) {                          \
        grid_dependency_enter();                                                                 \
        const long t = blockIdx.x;                                                               \
        const int p = tok_pos[t];                                                                \
        const long blk = block_tables[(long)tok_seq[t] * max_blocks + p / block_size];           \
        const int off = p % block_size, heads = kv_row / head_dim;                               \
        for (int c = threadIdx.x; c < kv_row; c += blockDim.x) {                                 \
            const int h = c / head_dim, d = c % head_dim;                                        \
            const long dst = ((blk * heads + h) * block_size + off) * head_dim + d;              \
            kc[dst] = from_f32<T>(k[t * ldk + c]);                                               \
            vc[dst] = from_f32<T>(v[t * ldv + c]);                                               \
        }                                                                                        \
    }

NIBBLE_BOTH_DTYPES(NIBBLE_ROW_KERNELS)

#define NIBBLE_FILL_RANDOM(SUFFIX, T)                                                           \
    extern "C" __global__ void fill_random_##SUFFIX(T* x, long n, int seed) {                   \
        for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;                       \
             i += (long)gridDim.x * blockDim.x)                                                 \
            x[i] = from_f32<T>(hash_unit(i, seed));                                             \
    }
NIBBLE_BOTH_DTYPES(NIBBLE_FILL_RANDOM)
NIBBLE_FILL_RANDOM(f32, float)

// RMS-normalizes every head_dim slice in place (Qwen3's QK norm): one warp per head; rows are
// ld apart (a column slice of a fused projection).
extern "C" __global__ void head_rms_norm(float* x, const float* w, int head_dim, int row_heads,
                                         long ld, long heads, float eps) {
    const long head = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (head >= heads) return;
    float* xh = x + (head / row_heads) * ld + (head % row_heads) * head_dim;
    float ss = 0.f;
    for (int c = lane; c < head_dim; c += 32) ss = fmaf(xh[c], xh[c], ss);
    const float scale = 1.0f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
    for (int c = lane; c < head_dim; c += 32) xh[c] = xh[c] * scale * w[c];
}

// A forward pass's RoPE angles: cs[row][i] = (cos, sin) of positions[row] * inv_freq[i], for
// i < half, in f64 as on the CPU (positions reach 1e5 and beyond). Once a pass per frequency
// table: every layer's rope, and the decode attention that rotates as it reads, use them
// (double sincos is a long routine).
extern "C" __global__ void rope_angles(const int* positions, const float* inv_freq, float2* cs, int half,
                                       long n) {
    grid_dependency_enter();
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < n; idx += (long)gridDim.x * blockDim.x) {
        const long row = idx / half;
        const int i = (int)(idx - row * half);
        double s, c;
        sincos((double)positions[row] * (double)inv_freq[i], &s, &c);
        cs[idx] = make_float2((float)c, (float)s);
    }
}

// Rotates each head of row `blockIdx.x` by its angles cs[row] (rope_angles). `interleaved` pairs
// (2i, 2i+1), otherwise (i, i + head_dim/2). blockIdx.y = 1 rotates the second tensor (x2,
// cols2, ld2) of a rope_qk call, with the same angles: q and k in one launch.
extern "C" __global__ void ROW_KERNEL rope(float* x, const float2* cs, int cols, long ld, int head_dim,
                                           int interleaved, float* x2, int cols2, long ld2) {
    grid_dependency_enter();
    if (blockIdx.y == 1) {
        x = x2;
        cols = cols2;
        ld = ld2;
    }
    const long row = blockIdx.x;
    const int half = head_dim >> 1;
    float* xr = x + row * ld;
    const float2* angles = cs + row * half;
    // Whole heads only, like the CPU: a trailing partial head is left as it is.
    const int pairs = (cols / head_dim) * half;
    auto at = [&](int idx, bool second) {
        const int head = idx / half, i = idx % half;
        return head * head_dim + (interleaved ? 2 * i + second : i + (second ? half : 0));
    };
    row_pages(
        pairs, [&](int idx) { return make_float2(xr[at(idx, false)], xr[at(idx, true)]); },
        [&](int idx, float2 v) {
            const float2 r = rope_pair(v.x, v.y, angles[idx % half]);
            xr[at(idx, false)] = r.x;
            xr[at(idx, true)] = r.y;
        });
}

extern "C" __global__ void add_f32(float* x, const float* d, long n) {
    grid_dependency_enter();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] += d[i];
}

// RMSNorm of a block's output that stays in the f32 residual stream (Gemma's post-attention and
// post-feed-forward norms): rms_norm_impl writing f32.
extern "C" __global__ void ROW_REGS_KERNEL rms_norm_f32(float* x, const float* w, float* out, int h,
                                                        float eps) {
    rms_norm_row<float, NoCodes>(x, nullptr, w, out, h, eps, nullptr, nullptr);
}

// x may be a column slice of a fused GEMM output (q of q/k/v): rows of `cols` at stride `ld`.
extern "C" __global__ void scale_f32(float* x, long n, int cols, long ld, float factor) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[(i / cols) * ld + i % cols] *= factor;
}

template <class E>
__device__ void gather_rows_impl(const E* x, const int* rows, E* out, int cols) {
    grid_dependency_enter();
    const long r = blockIdx.x;
    const E* src = x + (long)rows[r] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] = src[c];
}
extern "C" __global__ void ROW_KERNEL gather_rows(const float* x, const int* rows, float* out, int cols) {
    gather_rows_impl(x, rows, out, cols);
}
// 16-bit rows (a mixture-of-experts layer gathers its normed input, in the model dtype).
extern "C" __global__ void ROW_KERNEL gather_rows_b16(const unsigned short* x, const int* rows, unsigned short* out,
                                                      int cols) {
    gather_rows_impl(x, rows, out, cols);
}


// A mixture-of-experts layer's weighted sum: out[r] = sum over r's entries offsets[r]..offsets[r+1]
// of scales[i] * srcs[i][:], one fma each from 0 in entry order. The host lists a row's entries in
// the order of the parts (experts by index, then the shared expert), as the CPU backend adds them,
// so the sums are the CPU's bit for bit given the same expert outputs.
extern "C" __global__ void ROW_KERNEL moe_combine(const long long* srcs, const float* scales, const int* offsets,
                                                  float* out, int cols) {
    grid_dependency_enter();
    const long r = blockIdx.x;
    const int first = offsets[r], end = offsets[r + 1];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float acc = 0.f;
        for (int i = first; i < end; ++i) acc = fmaf(scales[i], reinterpret_cast<const float*>(srcs[i])[c], acc);
        out[r * cols + c] = acc;
    }
}

// A step queued before the previous one's tokens reached the host: row pairs[2i] of the batch
// takes the token the previous step sampled for spec pairs[2i + 1] (`sampled` holds one record
// of `stride` ints per spec, the token first). Runs after the metadata upload, before the
// embedding reads the tokens.
extern "C" __global__ void feed_tokens(int* tokens, const int* sampled, int stride, const int* pairs, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        tokens[pairs[2 * i]] = sampled[(long)pairs[2 * i + 1] * stride];
}

// out[r, c] += bias[c] (QKV biases of Qwen2).
extern "C" __global__ void add_bias(float* out, const float* bias, int cols, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] += bias[i % cols];
}

// Standalone and fused (QServe S1) per-token 8-bit quantization of a GEMM input, INT8 (`i8`, `q8`)
// or FP8 e4m3 (`f8`); see quantize_row in common.cuh.
template <class C, class IN>
__device__ void quantize_act_impl(const IN* __restrict__ x, long ldx, typename C::Code* __restrict__ q,
                                  long ldq, float* __restrict__ sx, int cols) {
    grid_dependency_enter();
    const long row = blockIdx.x;
    AbsMax am;
    if (row_vec_fits(cols) && aligned_pack4(x) && (ldx & 3) == 0 && aligned_pack4(q) && (ldq & 3) == 0) {
        const int n4 = cols >> 2;
        float4 v[ROW_VECS];
#pragma unroll
        for (int i = 0; i < ROW_VECS; ++i) {
            const int u = threadIdx.x + i * blockDim.x;
            if (u < n4) v[i] = load4(x + row * ldx + 4 * u);
        }
#pragma unroll
        for (int i = 0; i < ROW_VECS; ++i)
            if (threadIdx.x + i * blockDim.x < n4) add_abs(am, v[i]);
        quantize_regs<C>(v, cols, q, ldq, sx, am);
        return;
    }
    row_pages(
        cols, [&](int c) { return to_f32(x[row * ldx + c]); }, [&](int, float v) { am.add(v); });
    quantize_row<C>(x, ldx, q, ldq, sx, cols, am);
}

#define NIBBLE_ACT8_F32(NAME, C)                                                                    \
    extern "C" __global__ void ROW_REGS_KERNEL NAME(const float* x, long ldx, C::Code* q, long ldq, float* sx, int cols) { \
        quantize_act_impl<C>(x, ldx, q, ldq, sx, cols);                                             \
    }
NIBBLE_ACT8_F32(quantize_i8_f32, Int8Codes)
NIBBLE_ACT8_F32(quantize_f8_f32, Fp8Codes)

#define NIBBLE_ACT8_FUSED(SUFFIX, T, QNAME, TAG, C)                                                 \
    extern "C" __global__ void ROW_REGS_KERNEL QNAME##_##SUFFIX(const T* x, long ldx, C::Code* q, long ldq, \
                                                    float* sx, int cols) {                         \
        quantize_act_impl<C>(x, ldx, q, ldq, sx, cols);                                             \
    }                                                                                               \
    /* rms_norm_##SUFFIX, then the codes of its output row. */                                      \
    extern "C" __global__ void ROW_REGS_KERNEL rms_norm_##TAG##_##SUFFIX(float* x, const float* delta, const float* w, \
                                                    T* out, int h, float eps, C::Code* q, float* sx) { \
        rms_norm_row<T, C>(x, delta, w, out, h, eps, q, sx);                                        \
    }                                                                                               \
    /* One block per row: out = T(silu(gate) * up), then its codes. */                             \
    extern "C" __global__ void ROW_REGS_KERNEL silu_mul_##TAG##_##SUFFIX(const float* gate, const float* up, T* out, \
                                                    int cols, long ldg, long ldu, C::Code* q, float* sx) { \
        grid_dependency_enter();                                                                    \
        const long r = blockIdx.x;                                                                  \
        if (row_vec_fits(cols) && aligned16(gate, ldg) && aligned16(up, ldu) &&                      \
            aligned_pack4(out) && aligned_pack4(q)) {                                               \
            float4 o[ROW_VECS];                                                                     \
            AbsMax am;                                                                              \
            gated_regs<T>(gate + r * ldg, up + r * ldu, out + r * cols, cols >> 2, o, am, SiluMul{}); \
            quantize_regs<C>(o, cols, q, cols, sx, am);                                             \
            return;                                                                                 \
        }                                                                                           \
        AbsMax am;                                                                                  \
        row_pages(                                                                                  \
            cols, [&](int c) { return make_float2(gate[r * ldg + c], up[r * ldu + c]); },            \
            [&](int c, float2 gu) {                                                                 \
                const T o = from_f32<T>(SiluMul{}(gu.x, gu.y));                                     \
                out[r * cols + c] = o;                                                              \
                am.add(to_f32(o));                                                                  \
            });                                                                                     \
        quantize_row<C>(out, cols, q, cols, sx, cols, am);                                          \
    }
#define NIBBLE_Q8_FUSED(SUFFIX, T) NIBBLE_ACT8_FUSED(SUFFIX, T, quantize_i8, q8, Int8Codes)
#define NIBBLE_F8_FUSED(SUFFIX, T) NIBBLE_ACT8_FUSED(SUFFIX, T, quantize_f8, f8, Fp8Codes)
NIBBLE_BOTH_DTYPES(NIBBLE_Q8_FUSED)
NIBBLE_BOTH_DTYPES(NIBBLE_F8_FUSED)

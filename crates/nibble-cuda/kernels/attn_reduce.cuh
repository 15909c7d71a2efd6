// The split reduction of decode attention (attention.cu's and decode_mma.cu's partials):
// out[token, h*HD + d] = sum over valid splits of acc * exp(m - M) / sum of l * exp(m - M).
// One CTA of any width per (token, head): the split weights are computed once, in parallel,
// into shared memory; then each thread sums its dimension over the splits with independent
// loads. Partials are read through L2 (__ldcg): the fused reduction (reduce_if_last) reads what
// other CTAs of its own grid wrote.
//
// Partials: part[((token * kv_heads + kvh) * splits + split) * G + gi] holds (m, l, acc[HD]).
#ifndef NIBBLE_ATTN_REDUCE
#define NIBBLE_ATTN_REDUCE
#define MAX_SPLITS 512
template <class T, int HD, int G>
__device__ void attn_reduce_head(const float* part, const int* tok_pos, T* out, int num_kv_heads,
                                 int group, int splits, int chunk, int token, int h) {
    __shared__ float w[MAX_SPLITS];
    __shared__ float scratch[32];
    const int kvh = h / group, g = h % group;
    const int used = (tok_pos[token] + chunk) / chunk;  // splits holding context: ceil((pos+1)/chunk)
    const long stride = (long)G * (HD + 2);
    const float* base = part + ((long)token * num_kv_heads + kvh) * splits * stride + g * (HD + 2);
    float mx = NEG_BIG;
    for (int s = threadIdx.x; s < used; s += blockDim.x) mx = fmaxf(mx, __ldcg(base + s * stride + HD));
    // Block max: shuffles within warps, then across warps through shared memory.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = NEG_BIG;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) mx = fmaxf(mx, scratch[i]);
    __syncthreads();
    float lsum = 0.f;
    for (int s = threadIdx.x; s < used; s += blockDim.x) {
        const float ws = __expf(__ldcg(base + s * stride + HD) - mx);
        w[s] = ws;
        lsum += ws * __ldcg(base + s * stride + HD + 1);
    }
    lsum = block_sum(lsum, scratch);
    __syncthreads();
    const float inv = 1.0f / lsum;
    const int num_heads = num_kv_heads * group;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int s = 0;
        for (; s + 4 <= used; s += 4) {
            a0 = fmaf(__ldcg(base + (s + 0) * stride + d), w[s + 0], a0);
            a1 = fmaf(__ldcg(base + (s + 1) * stride + d), w[s + 1], a1);
            a2 = fmaf(__ldcg(base + (s + 2) * stride + d), w[s + 2], a2);
            a3 = fmaf(__ldcg(base + (s + 3) * stride + d), w[s + 3], a3);
        }
        for (; s < used; ++s) a0 = fmaf(__ldcg(base + s * stride + d), w[s], a0);
        out[(long)token * num_heads * HD + h * HD + d] = from_f32<T>((a0 + a1 + a2 + a3) * inv);
    }
}

// A decode split kernel's end, with its split reduction fused in: every CTA that wrote partials
// for its (token, kv head) takes a ticket, and the last of the `used` ones (the splits that
// hold context: those that passed decode_split) reduces the group's heads into `out` and resets
// the counter for the next launch or graph replay. One launch fewer per layer than a separate
// attn_reduce, with the same arithmetic per head.
template <class T, int HD, int G>
__device__ void reduce_if_last(const float* part, const int* tok_pos, T* out, int* counters,
                               int num_kv_heads, int group, int chunk) {
    __shared__ int last;
    const int token = blockIdx.x, kvh = blockIdx.y;
    __threadfence();  // this CTA's partials, before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        const int used = (tok_pos[token] + chunk) / chunk;
        int* c = counters + (long)token * num_kv_heads + kvh;
        last = atomicAdd(c, 1) == used - 1;
        if (last) atomicExch(c, 0);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other splits' partials, after their tickets
    for (int g = 0; g < group; ++g) {
        attn_reduce_head<T, HD, G>(part, tok_pos, out, num_kv_heads, group, gridDim.z, chunk,
                                   token, kvh * group + g);
        __syncthreads();  // the split weights in shared memory are the next head's
    }
}
#endif

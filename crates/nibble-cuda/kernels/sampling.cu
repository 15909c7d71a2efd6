// Token sampling on the device, after the head GEMM: one 1024-thread CTA per sampled row of the
// f32 logits [rows, vocab]; only the chosen ids (and the log-probabilities a request asked for)
// go back to the host.
//
// The arithmetic is nibble_model::sampling's, bit for bit, so a seeded request draws the same
// token on the GPU as on the CPU:
//   * rank keys: (order-preserving bits of the scaled logit) << 32 | ~id, all distinct; top-k and
//     top-p are thresholds on them, found by a radix select (8 passes of 8 bits from the most
//     significant, 256 bins of count, mass and largest key; a bin holding one key ends it);
//   * probabilities from exp_det (IEEE-rounded multiplies and adds only: the __f*_rn intrinsics
//     keep NVRTC's --fmad from fusing them) and masses p * 2^32 truncated, summed as integers, so
//     sums are exact in any order;
//   * the draw: splitmix64 of (seed, draw index), scaled to the kept mass with a 64x64 high
//     multiply, and found in id order by a block scan of per-thread ranges.
// Passes over a row (greedy 1; sampling up to 4 plus two selects) re-read the logits, which a
// 128k vocabulary keeps in L2. The repetition penalty marks the history in a per-row bitset first.
// A logit goes through, in nibble_model::sampling's order: the row's allowed-token mask
// (structured outputs: a token outside it is -inf), the repetition penalty, then the row's
// additive delta (logit_bias and presence/frequency penalties, one f32 per token computed on the
// host, sorted by id: a second bitset says which tokens have one, and a binary search finds it).
// Log-probabilities come from the raw logits: a float log-sum-exp (equal to the CPU's to
// rounding) and the top n (n <= SAMPLE_TOP) by rank key, exact.

#define SAMPLE_THREADS 1024
#define SAMPLE_TOP 20
#define SAMPLE_INF __int_as_float(0x7f800000)

struct SampleRow {
    u64 seed;
    u64 draw;
    int row;
    int top_k;
    int hist_off;
    int hist_len;
    float temperature;
    float top_p;
    float min_p;
    float penalty;
    int logprobs;  // -1: none
    int mask_off;  // word offset of the row's allowed-token mask; -1: every token allowed
    int delta_off;  // the row's (id, delta) entries in delta_ids / delta_vals
    int delta_len;
};

struct SampleOut {
    int token;
    float logprob;
    int n;
    int pad;
    int ids[SAMPLE_TOP];
    float lps[SAMPLE_TOP];
};

__device__ __forceinline__ u64 rank_key(float s, u32 id) {
    const u32 b = __float_as_uint(s);
    const u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(~id);
}

__device__ __forceinline__ u32 key_id(u64 key) { return ~(u32)key; }

__device__ __forceinline__ float exp_det(float x) {
    if (!(x >= -87.f)) return 0.f;
    const float n = floorf(__fadd_rn(__fmul_rn(x, 1.44269504088896340736f), 0.5f));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.693145751953125f)),
                              __fmul_rn(n, 1.428606765330187e-6f));
    float p = 1.f / 720.f;
    p = __fadd_rn(__fmul_rn(p, r), 1.f / 120.f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f / 24.f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f / 6.f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f);
    p = __fadd_rn(__fmul_rn(p, r), 1.f);
    const float scale = __uint_as_float((u32)((int)n + 127) << 23);
    return __fmul_rn(p, scale);
}

__device__ __forceinline__ u64 mass_of(float p) { return (u64)__fmul_rn(p, 4294967296.f); }

__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct SelectSmem {
    u64 mass[256];
    u64 top[256];
    u32 count[256];
    u64 prefix;
    u64 need;
    u64 result;
    int done;
};

// The largest key K with weight(keys >= K among those `item` yields) >= need, over the row's
// items; 0 when the whole row weighs less. `item(i, &key, &weight)` says whether i takes part.
template <class Item>
__device__ u64 radix_select(int vocab, u64 need, SelectSmem& sm, Item item) {
    u64 prefix = 0, mask = 0;
    if (threadIdx.x == 0) {
        sm.need = need;
        sm.done = 0;
    }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            sm.mass[d] = 0;
            sm.top[d] = 0;
            sm.count[d] = 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            u64 key, w;
            if (!item(i, key, w) || (key & mask) != prefix) continue;
            const int d = (int)(key >> shift) & 255;
            atomicAdd(&sm.mass[d], w);
            atomicAdd(&sm.count[d], 1u);
            atomicMax(&sm.top[d], key);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 acc = 0;
            int chosen = -1;
            for (int d = 255; d >= 0; --d) {
                if (sm.count[d] && acc + sm.mass[d] >= sm.need) {
                    chosen = d;
                    break;
                }
                acc += sm.mass[d];
            }
            if (chosen < 0) {
                sm.result = 0;
                sm.done = 1;
            } else {
                sm.need -= acc;
                sm.prefix = prefix | ((u64)chosen << shift);
                if (sm.count[chosen] == 1 || shift == 0) {
                    sm.result = sm.top[chosen];
                    sm.done = 1;
                }
            }
        }
        __syncthreads();
        if (sm.done) break;
        prefix = sm.prefix;
        mask |= (u64)255 << shift;
    }
    const u64 r = sm.result;
    __syncthreads();
    return r;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* __restrict__ logits, int vocab, long ld, const SampleRow* __restrict__ rows,
                const u32* __restrict__ history, u32* __restrict__ bitsets, const u32* __restrict__ masks,
                const u32* __restrict__ delta_ids, const float* __restrict__ delta_vals,
                SampleOut* __restrict__ out) {
    __shared__ SelectSmem sm;
    __shared__ u64 red[32];
    __shared__ float redf[32];
    __shared__ int top_count;
    __shared__ u64 top_keys[SAMPLE_TOP];
    const SampleRow P = rows[blockIdx.x];
    const float* l = logits + (long)P.row * ld;
    const int tid = threadIdx.x;
    const int words = (vocab + 31) >> 5;

    const u32* bits = nullptr;
    if (P.penalty != 1.f && P.hist_len > 0) {
        u32* b = bitsets + (long)blockIdx.x * 2 * words;
        for (int w = tid; w < words; w += blockDim.x) b[w] = 0;
        __syncthreads();
        for (int h = tid; h < P.hist_len; h += blockDim.x) {
            const u32 t = history[P.hist_off + h];
            if (t < (u32)vocab) atomicOr(&b[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
        bits = b;
    }
    const u32* dbits = nullptr;
    if (P.delta_len > 0) {
        u32* b = bitsets + (long)blockIdx.x * 2 * words + words;
        for (int w = tid; w < words; w += blockDim.x) b[w] = 0;
        __syncthreads();
        for (int h = tid; h < P.delta_len; h += blockDim.x) {
            const u32 t = delta_ids[P.delta_off + h];
            if (t < (u32)vocab) atomicOr(&b[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
        dbits = b;
    }
    const u32* allowed = P.mask_off >= 0 ? masks + P.mask_off : nullptr;
    const float pen = P.penalty;
    auto value = [&](int i) {
        if (allowed && !((allowed[i >> 5] >> (i & 31)) & 1u)) return -SAMPLE_INF;
        float x = l[i];
        if (bits && ((bits[i >> 5] >> (i & 31)) & 1u)) x = x > 0.f ? __fdiv_rn(x, pen) : __fmul_rn(x, pen);
        if (dbits && ((dbits[i >> 5] >> (i & 31)) & 1u)) {
            int lo = P.delta_off, hi = P.delta_off + P.delta_len - 1;
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (delta_ids[mid] < (u32)i) lo = mid + 1; else hi = mid;
            }
            x = __fadd_rn(x, delta_vals[lo]);
        }
        return x;
    };
    // Greedy: the largest penalized logit, lowest id on ties (rank keys of the logits).
    auto argmax = [&]() {
        u64 best = 0;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float v = value(i);
            if (v > -SAMPLE_INF) {
                // -0 + 0 = +0: the CPU's strict `>` does not order the two zeros.
                const u64 k = rank_key(__fadd_rn(v, 0.f), (u32)i);
                best = k > best ? k : best;
            }
        }
        best = block_reduce(best, red, (u64)0, MaxOp{});
        return best ? key_id(best) : 0u;
    };

    u32 token;
    const float T = P.temperature;
    if (T == 0.f) {
        token = argmax();
    } else {
        auto scaled = [&](int i, float& s) {
            const float v = value(i);
            s = __fdiv_rn(v, T);
            return v > -SAMPLE_INF;
        };
        u64 top = 0, count = 0;
        for (int i = tid; i < vocab; i += blockDim.x) {
            float s;
            if (scaled(i, s)) {
                const u64 k = rank_key(s, (u32)i);
                top = k > top ? k : top;
                ++count;
            }
        }
        top = block_reduce(top, red, (u64)0, MaxOp{});
        count = block_reduce(count, red, (u64)0, SumOp{});
        if (count == 0) {
            token = 0;
        } else {
            u64 k_top = 0;
            if (P.top_k > 0 && (u64)P.top_k < count) {
                k_top = radix_select(vocab, (u64)P.top_k, sm, [&](int i, u64& key, u64& w) {
                    float s;
                    if (!scaled(i, s)) return false;
                    key = rank_key(s, (u32)i);
                    w = 1;
                    return true;
                });
            }
            const u32 top_id = key_id(top);
            const float top_s = __fdiv_rn(value(top_id), T);
            if (top_s == SAMPLE_INF) {
                token = top_id;
            } else if (top_s == -SAMPLE_INF) {
                token = argmax();
            } else {
                // Kept by top-k (A); min-p drops some (B); p and its mass for token i.
                auto in_a = [&](int i, u64& key, float& p) {
                    float s;
                    if (!scaled(i, s)) return false;
                    key = rank_key(s, (u32)i);
                    if (key < k_top) return false;
                    p = exp_det(__fsub_rn(s, top_s));
                    return true;
                };
                auto in_b = [&](int i, u64& key, u64& w) {
                    float p;
                    if (!in_a(i, key, p)) return false;
                    if (P.min_p > 0.f && p < P.min_p) return false;
                    w = mass_of(p);
                    return true;
                };
                u64 k_p = 0;
                if (P.top_p < 1.f) {
                    u64 total = 0;
                    for (int i = tid; i < vocab; i += blockDim.x) {
                        u64 key;
                        float p;
                        if (in_a(i, key, p)) total += mass_of(p);
                    }
                    total = block_reduce(total, red, (u64)0, SumOp{});
                    u64 target = (u64)__dmul_rn((double)total, (double)P.top_p);
                    target = target > 1 ? target : 1;
                    k_p = radix_select(vocab, target, sm, in_b);
                }
                // The draw: thread t sums its contiguous range of ids, a block scan places the
                // ranges, and the one holding the point walks it.
                const int span = (vocab + blockDim.x - 1) / blockDim.x;
                const int lo = min(vocab, tid * span), hi = min(vocab, lo + span);
                u64 mine = 0;
                for (int i = lo; i < hi; ++i) {
                    u64 key, w;
                    if (in_b(i, key, w) && key >= k_p) mine += w;
                }
                // Exclusive scan over the block: warp scans, then the warps' totals.
                const int lane = tid & 31, warp = tid >> 5;
                u64 incl = mine;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const u64 v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                __syncthreads();
                if (lane == 31) red[warp] = incl;
                __syncthreads();
                if (warp == 0) {
                    u64 w = red[lane], wi = w;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        const u64 v = __shfl_up_sync(0xffffffffu, wi, o);
                        if (lane >= o) wi += v;
                    }
                    red[lane] = wi - w;  // exclusive prefix of the warps
                    if (lane == 31) sm.need = wi;  // the kept mass
                }
                __syncthreads();
                const u64 before = red[warp] + incl - mine;
                const u64 kept = sm.need;
                const u64 u = splitmix(P.seed ^ splitmix(P.draw)) >> 11;
                const u64 r = __umul64hi(u << 11, kept);
                if (tid == 0) sm.result = 0xFFFFFFFFull;
                __syncthreads();
                if (mine > 0 && r >= before && r < before + mine) {
                    u64 cum = before;
                    for (int i = lo; i < hi; ++i) {
                        u64 key, w;
                        if (in_b(i, key, w) && key >= k_p) {
                            cum += w;
                            if (r < cum) {
                                sm.result = (u64)i;
                                break;
                            }
                        }
                    }
                }
                __syncthreads();
                token = sm.result == 0xFFFFFFFFull ? top_id : (u32)sm.result;
                __syncthreads();
            }
        }
    }

    SampleOut* o = out + blockIdx.x;
    if (P.logprobs >= 0) {
        float mx = -SAMPLE_INF;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float x = l[i];
            if (x == x) mx = fmaxf(mx, x);
        }
        mx = block_max(mx, redf);
        float sum = 0.f;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float x = l[i];
            if (x == x) sum += expf(x - mx);
        }
        const float lse = mx + logf(block_sum(sum, redf));
        const int n = min(P.logprobs, SAMPLE_TOP);
        if (tid == 0) top_count = 0;
        u64 k_n = 0;
        if (n > 0) {
            k_n = radix_select(vocab, (u64)n, sm, [&](int i, u64& key, u64& w) {
                const float x = l[i];
                if (x != x) return false;
                key = rank_key(x, (u32)i);
                w = 1;
                return true;
            });
            for (int i = tid; i < vocab; i += blockDim.x) {
                const float x = l[i];
                if (x != x) continue;
                const u64 key = rank_key(x, (u32)i);
                if (key >= k_n) {
                    const int slot = atomicAdd(&top_count, 1);
                    if (slot < SAMPLE_TOP) top_keys[slot] = key;
                }
            }
        }
        __syncthreads();
        if (tid == 0) {
            const int m = n > 0 ? min(top_count, n) : 0;
            for (int a = 1; a < m; ++a) {  // insertion sort, largest key first
                const u64 k = top_keys[a];
                int b = a - 1;
                while (b >= 0 && top_keys[b] < k) {
                    top_keys[b + 1] = top_keys[b];
                    --b;
                }
                top_keys[b + 1] = k;
            }
            for (int a = 0; a < m; ++a) {
                const u32 id = key_id(top_keys[a]);
                o->ids[a] = (int)id;
                o->lps[a] = l[id] - lse;
            }
            o->n = m;
            o->logprob = l[token] - lse;
        }
    } else if (tid == 0) {
        o->n = 0;
        o->logprob = 0.f;
    }
    if (tid == 0) o->token = (int)token;
}

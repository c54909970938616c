// sample.cuh — one token drawn from one row of bf16 logits on the GPU, with the order, rounding and tie rules of
// assembler/ref/sampling.py (transformers' order: temperature, then top-k, then top-p; then one draw u by
// ascending id). The host supplies u (its seeded generator's next draw), so a run replays exactly.
//
// The row is cut into QMK_SAMPLE_BLOCKS slices of QMK_SAMPLE_THREADS x QMK_SAMPLE_PER elements; each thread keeps
// its QMK_SAMPLE_PER scores in registers. The blocks are co-resident (cooperative launch) and meet at a grid
// barrier between passes; every block repeats the small decisions (max, histogram scans) on the same global data,
// so no decision needs a second barrier. Results never depend on timing:
//   - selections are radix descents over order-preserving 32-bit keys (8-bit digits) with integer histograms;
//   - probability masses are fixed-point integers p·2^62 (exact, order-free sums);
//   - the softmax denominators are fp64 sums in a fixed order (per thread, per block tree, blocks in index order).
// Rounding points, as the reference: s = f32(l) / f32(T); e = f32(exp(f64(f32(s - m)))); S = f32(Σ e);
// p = f32(e / S); a top-p cumulative is compared as f32(Σ p) <= f32(1 - top_p). The reference sums in fp64 in
// another order, so an f32 result can differ only where the fp64 sum lies within one fp64 ulp of an f32
// rounding boundary; the draw then differs only where u·Σp lies that close to a cumulative boundary
// (docs/sampling.md).
#pragma once

#include "common.cuh"

#ifndef QMK_SAMPLE_THREADS
#define QMK_SAMPLE_THREADS 256
#endif
#ifndef QMK_SAMPLE_PER
#define QMK_SAMPLE_PER 8
#endif
#define QMK_SAMPLE_SLICE (QMK_SAMPLE_THREADS * QMK_SAMPLE_PER)
#define QMK_SAMPLE_WARPS (QMK_SAMPLE_THREADS / 32)
#define QMK_SAMPLE_MAX_BLOCKS 256
#define QMK_SAMPLE_INF __int_as_float(0x7f800000)  // +inf (NVRTC has no INFINITY)
#define QMK_SAMPLE_FIX_ONE 4611686018427387904ull  // 2^62: probability 1 as a fixed-point integer
// Workspace (qmk_u64 words, zeroed by the host before each launch): the barrier counter, two counters, per-block
// partials, and the histograms of each radix pass (each pass its own, so no pass clears what another still reads).
#define QMK_SAMPLE_WS_BARRIER 0
#define QMK_SAMPLE_WS_HIGH 1                                           // int: the highest id at the top score
#define QMK_SAMPLE_WS_KEPT 2                                           // the number of ids the filters left
#define QMK_SAMPLE_WS_MAX 8                                            // [blocks] float bits
#define QMK_SAMPLE_WS_S1 (QMK_SAMPLE_WS_MAX + QMK_SAMPLE_MAX_BLOCKS)     // [blocks] fp64 bits
#define QMK_SAMPLE_WS_S2 (QMK_SAMPLE_WS_S1 + QMK_SAMPLE_MAX_BLOCKS)      // [blocks] fp64 bits
#define QMK_SAMPLE_WS_MASS (QMK_SAMPLE_WS_S2 + QMK_SAMPLE_MAX_BLOCKS)    // [blocks] fixed-point mass
#define QMK_SAMPLE_WS_HIST (QMK_SAMPLE_WS_MASS + QMK_SAMPLE_MAX_BLOCKS)  // histograms, 256 words per slab:
#define QMK_SAMPLE_HIST_TOPK 0      // slabs 0..3: top-k key digits (counts)
#define QMK_SAMPLE_HIST_TOPP 4      // slabs 4..7: top-p key digits (masses)
#define QMK_SAMPLE_HIST_ID_HI 8     // slabs 8..11: top-p tie ids, bits 17..8 (1024 bins)
#define QMK_SAMPLE_HIST_ID_LO 12    // slab 12: top-p tie ids, bits 7..0
#define QMK_SAMPLE_WS_WORDS (QMK_SAMPLE_WS_HIST + 13 * 256)

// Order-preserving key of an fp32 score: a < b (as floats) <=> key(a) < key(b); -0 and +0 share one key (they
// compare equal), -inf has the smallest key of any score.
__device__ __forceinline__ qmk_u32 qmk_score_key(float f) {
    qmk_u32 u = (f == 0.0f) ? 0u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ qmk_u64 qmk_fix_prob(float p) {  // p in [0, 1] -> floor(p · 2^62) (exact scaling)
    return __float2ull_rz(p * 4.611686018427387904e18f);
}

__device__ __forceinline__ float qmk_fix_to_f32(qmk_u64 c) {  // f32 of the cumulative c / 2^62
    return (float)((double)c * 2.168404344971008868e-19);
}

template <typename T>
__device__ __forceinline__ T qmk_warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float qmk_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Grid barrier number `k` (1, 2, ...) of this launch over a zeroed counter; every block calls it uniformly.
__device__ __forceinline__ void qmk_sample_grid_sync(qmk_u64* ws, unsigned k) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* ctr = reinterpret_cast<unsigned*>(ws + QMK_SAMPLE_WS_BARRIER);
        __threadfence();
        atomicAdd(ctr, 1u);
        const unsigned target = k * gridDim.x;
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(ctr) : "memory");
        } while (seen < target);
        __threadfence();
    }
    __syncthreads();
}

// Add w to hist[bin] (bin < 0: nothing). Warp-uniform call: a warp whose lanes share one bin adds once.
__device__ __forceinline__ void qmk_hist_add(qmk_u64* hist, int bin, qmk_u64 w) {
    const int b0 = __shfl_sync(0xffffffffu, bin, 0);
    if (__all_sync(0xffffffffu, bin == b0)) {
        const qmk_u64 s = qmk_warp_sum<qmk_u64>(bin >= 0 ? w : 0ull);
        if ((threadIdx.x & 31) == 0 && b0 >= 0 && s) atomicAdd(hist + b0, s);
    } else if (bin >= 0 && w) {
        atomicAdd(hist + bin, w);
    }
}

// Block-wide reductions through `red` (QMK_SAMPLE_WARPS words of shared memory), the result in every thread.
__device__ __forceinline__ float qmk_block_max(float v, float* red) {
    v = qmk_warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < QMK_SAMPLE_WARPS; ++w) r = fmaxf(r, red[w]);
    __syncthreads();
    return r;
}

template <typename T>
__device__ __forceinline__ T qmk_block_sum(T v, T* red) {  // fixed order: lanes by shuffle tree, warps in order
    v = qmk_warp_sum<T>(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = red[0];
    for (int w = 1; w < QMK_SAMPLE_WARPS; ++w) r += red[w];
    __syncthreads();
    return r;
}

// Block-parallel search over n <= 4·THREADS histogram bins (global, complete after a grid barrier), read in
// ascending bin order or, with `desc`, descending. Returns the first position r of that order whose inclusive
// cumulative c = base + Σ_{positions <= r} satisfies crossed(c), and sets excl = base + Σ_{positions < r}; returns
// n (excl = base + the total) when no position does. Every thread gets the same answer.
template <class Crossed>
__device__ __forceinline__ int qmk_first_crossing(const qmk_u64* hist, int n, bool desc, qmk_u64 base,
                                                  Crossed crossed, qmk_u64& excl, qmk_u64* sh_u, int* sh_i) {
    const int tid = threadIdx.x;
    qmk_u64 v[4], sum = 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = 4 * tid + a;
        v[a] = r < n ? *(volatile const qmk_u64*)(hist + (desc ? n - 1 - r : r)) : 0ull;
        sum += v[a];
    }
    qmk_u64 incl = sum;  // inclusive scan of the thread sums, in thread order
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const qmk_u64 t = __shfl_up_sync(0xffffffffu, incl, o);
        if ((tid & 31) >= o) incl += t;
    }
    if ((tid & 31) == 31) sh_u[tid >> 5] = incl;
    if (tid == 0) sh_i[0] = n;
    __syncthreads();
    qmk_u64 c = base + incl - sum;
    for (int w = 0; w < (tid >> 5); ++w) c += sh_u[w];
    int hit = n;
    qmk_u64 before = 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = 4 * tid + a;
        if (hit == n && r < n && crossed(c + v[a])) { hit = r; before = c; }
        c += v[a];
    }
    if (hit < n) atomicMin(sh_i, hit);
    __syncthreads();
    const int first = sh_i[0];
    if (hit == first && hit < n) sh_u[QMK_SAMPLE_WARPS] = before;
    if (first == n && tid == QMK_SAMPLE_THREADS - 1) sh_u[QMK_SAMPLE_WARPS] = c;  // the last thread's c = total
    __syncthreads();
    excl = sh_u[QMK_SAMPLE_WARPS];
    __syncthreads();
    return first;
}

// The kernel body (grid: blocks of QMK_SAMPLE_THREADS covering V in slices of QMK_SAMPLE_SLICE, all co-resident).
// lg [V] bf16 logits of one row; ids >= n_valid count as -inf (padding rows). temp: the fp32 temperature, applied
// when scale != 0; top_k: 0 = off; top_p_thr = f32(1 - top_p), applied when use_top_p; u in [0, 1). ws: the
// zeroed workspace (QMK_SAMPLE_WS_WORDS words). out (set to -1 by the host): out[0] = the chosen id, out[1] = the
// number of ids the filters left with nonzero probability, out[2] = 1 when the top-p cumulative of the whole row
// rounds to <= thr and only the highest-ranked id is kept (the reference's "always keep the last").
__device__ __forceinline__ void qmk_sample_row(const qmk_u16* __restrict__ lg, int V, int n_valid, float temp,
                                               int scale, int top_k, float top_p_thr, int use_top_p, double u,
                                               qmk_u64* ws, int* out) {
    __shared__ float red_f[QMK_SAMPLE_WARPS];
    __shared__ double red_d[QMK_SAMPLE_WARPS];
    __shared__ qmk_u64 red_u[QMK_SAMPLE_WARPS + 1];
    __shared__ int red_i[1];
    __shared__ qmk_u64 row_mass[QMK_SAMPLE_PER];
    const int tid = threadIdx.x, nb = gridDim.x;
    const int first = blockIdx.x * QMK_SAMPLE_SLICE + tid;  // element j of this thread: first + j·THREADS
    unsigned bar = 0;

    float s[QMK_SAMPLE_PER];
    qmk_u32 key[QMK_SAMPLE_PER];
    float m = -QMK_SAMPLE_INF;
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
        const int i = first + j * QMK_SAMPLE_THREADS;
        float x = -QMK_SAMPLE_INF;
        if (i < n_valid) {
            x = qmk_bf2f(lg[i]);
            if (scale) x = __fdiv_rn(x, temp);
        }
        s[j] = x;
        key[j] = i < V ? qmk_score_key(x) : 0u;  // past the row: below every score, never counted as one
        m = fmaxf(m, x);
    }
    // ---- the row's highest score (every kept set holds it: top-k and top-p both keep the highest score)
    m = qmk_block_max(m, red_f);
    if (tid == 0) ws[QMK_SAMPLE_WS_MAX + blockIdx.x] = __float_as_uint(m);
    qmk_sample_grid_sync(ws, ++bar);
    m = -QMK_SAMPLE_INF;
    for (int b = 0; b < nb; ++b) m = fmaxf(m, __uint_as_float((qmk_u32)ws[QMK_SAMPLE_WS_MAX + b]));
    const bool m_inf = m == QMK_SAMPLE_INF;  // an overflowed score: the +inf scores share the mass equally

    // ---- top-k: keep every score >= the k-th largest (ties at the threshold keep more than k)
    qmk_u32 kth = 0;
    if (top_k > 0 && top_k < V) {
        qmk_u32 prefix = 0, mask = 0;
        qmk_u64 kk = (qmk_u64)top_k;  // rank still to find inside the current prefix, counted from the top
        for (int pass = 0; pass < 4; ++pass) {
            const int shift = 24 - 8 * pass;
            qmk_u64* hist = ws + QMK_SAMPLE_WS_HIST + (QMK_SAMPLE_HIST_TOPK + pass) * 256;
#pragma unroll
            for (int j = 0; j < QMK_SAMPLE_PER; ++j)
                qmk_hist_add(hist, (key[j] & mask) == prefix ? (int)((key[j] >> shift) & 255u) : -1, 1ull);
            qmk_sample_grid_sync(ws, ++bar);
            qmk_u64 above = 0;
            const qmk_u64 want = kk;
            int r = qmk_first_crossing(hist, 256, true, 0ull, [want](qmk_u64 c) { return c >= want; }, above,
                                       red_u, red_i);
            if (r == 256) r = 255;  // cannot happen: the prefix holds at least kk keys
            kk -= above;
            prefix |= (qmk_u32)(255 - r) << shift;
            mask |= 255u << shift;
        }
        kth = prefix;
    }

    // ---- e = exp(s - m) over the kept set, S1 = its sum
    float e[QMK_SAMPLE_PER];
    double acc = 0.0;
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
        float v = 0.0f;
        if (key[j] >= kth) {
            if (m_inf) v = (s[j] == QMK_SAMPLE_INF) ? 1.0f : 0.0f;
            else v = (float)exp((double)(s[j] - m));
            if (v < 1.17549435e-38f) v = 0.0f;  // a subnormal e (s - m < -87.3) is 0, as -ftz makes it anyway
        }
        e[j] = v;
        acc += (double)v;
    }
    acc = qmk_block_sum<double>(acc, red_d);
    if (tid == 0) ws[QMK_SAMPLE_WS_S1 + blockIdx.x] = (qmk_u64)__double_as_longlong(acc);
    qmk_sample_grid_sync(ws, ++bar);
    double tot = 0.0;
    for (int b = 0; b < nb; ++b) tot += __longlong_as_double((long long)ws[QMK_SAMPLE_WS_S1 + b]);
    const float S1 = (float)tot;

    // ---- top-p: in ascending (score, id) order, remove the prefix whose f32 cumulative is <= thr
    int fallback = 0;
    if (use_top_p) {
        qmk_u64 q[QMK_SAMPLE_PER];
#pragma unroll
        for (int j = 0; j < QMK_SAMPLE_PER; ++j) q[j] = qmk_fix_prob(__fdiv_rn(e[j], S1));
        const float thr = top_p_thr;
        auto crossed = [thr](qmk_u64 c) { return qmk_fix_to_f32(c) > thr; };
        qmk_u32 prefix = 0, mask = 0, bid = 0;  // kept: key > prefix, or key == prefix and id >= bid
        qmk_u64 base = 0;                       // mass strictly before the current prefix in the order
        bool none = false;
        for (int pass = 0; pass < 4 && !none; ++pass) {  // the boundary score's key, digit by digit
            const int shift = 24 - 8 * pass;
            qmk_u64* hist = ws + QMK_SAMPLE_WS_HIST + (QMK_SAMPLE_HIST_TOPP + pass) * 256;
#pragma unroll
            for (int j = 0; j < QMK_SAMPLE_PER; ++j)
                qmk_hist_add(hist, (key[j] & mask) == prefix ? (int)((key[j] >> shift) & 255u) : -1, q[j]);
            qmk_sample_grid_sync(ws, ++bar);
            const int d = qmk_first_crossing(hist, 256, false, base, crossed, base, red_u, red_i);
            none = d == 256;
            prefix |= (qmk_u32)(d & 255) << shift;
            mask |= 255u << shift;
        }
        for (int pass = 0; pass < 2 && !none; ++pass) {  // among ties at that score, the first kept id (ids < 2^18)
            const int shift = pass == 0 ? 8 : 0, nbins = pass == 0 ? 1024 : 256;
            qmk_u64* hist = ws + QMK_SAMPLE_WS_HIST +
                            (pass == 0 ? QMK_SAMPLE_HIST_ID_HI : QMK_SAMPLE_HIST_ID_LO) * 256;
            const qmk_u32 idmask = pass == 0 ? 0u : ~255u;
#pragma unroll
            for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
                const qmk_u32 i = (qmk_u32)(first + j * QMK_SAMPLE_THREADS);
                const bool tie = key[j] == prefix && (i & idmask) == bid;
                qmk_hist_add(hist, tie ? (int)((i >> shift) & (qmk_u32)(nbins - 1)) : -1, q[j]);
            }
            qmk_sample_grid_sync(ws, ++bar);
            const int d = qmk_first_crossing(hist, nbins, false, base, crossed, base, red_u, red_i);
            none = d == nbins;
            bid |= (qmk_u32)(d & (nbins - 1)) << shift;
        }
        if (none) {  // the whole row's cumulative rounds to <= thr: keep only the last (top score, highest id)
            fallback = 1;
            const qmk_u32 km = qmk_score_key(m);
            int best = -1;
#pragma unroll
            for (int j = 0; j < QMK_SAMPLE_PER; ++j)
                if (key[j] == km) best = max(best, first + j * QMK_SAMPLE_THREADS);
            if (best >= 0) atomicMax(reinterpret_cast<int*>(ws + QMK_SAMPLE_WS_HIGH), best);
            qmk_sample_grid_sync(ws, ++bar);
            prefix = km;
            bid = (qmk_u32)*(volatile int*)(ws + QMK_SAMPLE_WS_HIGH);
        }
#pragma unroll
        for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
            const qmk_u32 i = (qmk_u32)(first + j * QMK_SAMPLE_THREADS);
            if (!(key[j] > prefix || (key[j] == prefix && i >= bid))) e[j] = 0.0f;
        }
    }

    // ---- the final softmax over the kept set and the draw: the first id whose cumulative mass exceeds u·Σ
    acc = 0.0;
    unsigned kept = 0;
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
        acc += (double)e[j];
        kept += e[j] > 0.0f;
    }
    acc = qmk_block_sum<double>(acc, red_d);
    kept = qmk_warp_sum<unsigned>(kept);
    if ((tid & 31) == 0 && kept) atomicAdd(reinterpret_cast<unsigned*>(ws + QMK_SAMPLE_WS_KEPT), kept);
    if (tid == 0) ws[QMK_SAMPLE_WS_S2 + blockIdx.x] = (qmk_u64)__double_as_longlong(acc);
    qmk_sample_grid_sync(ws, ++bar);
    tot = 0.0;
    for (int b = 0; b < nb; ++b) tot += __longlong_as_double((long long)ws[QMK_SAMPLE_WS_S2 + b]);
    const float S2 = (float)tot;
    qmk_u64 q[QMK_SAMPLE_PER];
    qmk_u64 mine = 0;
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
        q[j] = qmk_fix_prob(__fdiv_rn(e[j], S2));
        mine += q[j];
    }
    const qmk_u64 block_mass = qmk_block_sum<qmk_u64>(mine, red_u);
    if (tid == 0) ws[QMK_SAMPLE_WS_MASS + blockIdx.x] = block_mass;
    qmk_sample_grid_sync(ws, ++bar);
    qmk_u64 pre = 0, total = 0;
    for (int b = 0; b < nb; ++b) {
        const qmk_u64 w = *(volatile qmk_u64*)(ws + QMK_SAMPLE_WS_MASS + b);
        if (b < (int)blockIdx.x) pre += w;
        total += w;
    }
    const qmk_u64 ufix = (qmk_u64)(u * 18446744073709551616.0);  // u · 2^64, exact (u has 53 significant bits)
    const qmk_u64 target = __umul64hi(ufix, total);               // floor(u · total); the draw: first c > target
    if (pre > target || pre + block_mass <= target) return;       // the crossing lies in another block
    // this block's ids in ascending order: row j holds ids block_first + j·THREADS + (0 .. THREADS - 1)
    if (tid < QMK_SAMPLE_PER) row_mass[tid] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j) {
        const qmk_u64 r = qmk_warp_sum<qmk_u64>(q[j]);
        if ((tid & 31) == 0 && r) atomicAdd(row_mass + j, r);
    }
    __syncthreads();
    int jr = 0;
    for (; jr < QMK_SAMPLE_PER - 1; ++jr) {
        if (pre + row_mass[jr] > target) break;
        pre += row_mass[jr];
    }
    qmk_u64 v = 0;
#pragma unroll
    for (int j = 0; j < QMK_SAMPLE_PER; ++j)
        if (j == jr) v = q[j];
    qmk_u64 incl = v;  // inclusive scan of row jr over the threads (= ascending id order)
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const qmk_u64 t = __shfl_up_sync(0xffffffffu, incl, o);
        if ((tid & 31) >= o) incl += t;
    }
    if ((tid & 31) == 31) red_u[tid >> 5] = incl;
    __syncthreads();
    qmk_u64 before = pre + incl - v;
    for (int w = 0; w < (tid >> 5); ++w) before += red_u[w];
    if (v > 0 && before <= target && before + v > target) {
        out[0] = first + jr * QMK_SAMPLE_THREADS;
        out[1] = (int)*(volatile unsigned*)(ws + QMK_SAMPLE_WS_KEPT);
        out[2] = fallback;
    }
}

// lm_head.cuh — the vocabulary projection fused with greedy argmax and top-k candidates (article Part 3.8).
//
// Each block owns QMK_LMH_ROWS = 16 · QMK_LMH_WARPS consecutive vocabulary rows (one 16-row tile per warp,
// bf16 weights, split 1: the tile is the whole projection, INTERFACES §2 with S = 1). Logits are rounded to bf16
// first (the reference computes them in bf16), then turned into 64-bit keys that order by (logit desc, id asc):
// the maximum key is the argmax with the lowest id on ties. Per block and activation row: the best key and,
// optionally, the block's top QMK_TOPK keys (bitonic sort in shared memory). qmk_lm_head_merge picks the
// global best and the global top QMK_TOPK from those: the global top-k lies inside the top-k lists of the k
// blocks whose best keys rank highest (any other block has k better keys elsewhere).
#pragma once
#include "gemv.cuh"

#ifndef QMK_TOPK
#define QMK_TOPK 32  // candidates kept; QMK_TOPK² must be a power of two ≤ 1024 (one merge block)
#endif
#ifndef QMK_VALID_VOCAB
#define QMK_VALID_VOCAB QMK_VOCAB  // ids past it are padding rows (discrete.build.config_defines sets it)
#endif
#define QMK_LMH_WARPS 8  // 256-thread blocks, 128 rows each: ~1,940 blocks, scheduled dynamically
#ifndef QMK_LMH_MIN_BLOCKS
#define QMK_LMH_MIN_BLOCKS 4
#endif
#define QMK_LMH_THREADS (32 * QMK_LMH_WARPS)
#define QMK_LMH_ROWS (QMK_ROW_TILE * QMK_LMH_WARPS)

static_assert(QMK_TOPK * QMK_TOPK <= 1024 && (QMK_TOPK & (QMK_TOPK - 1)) == 0, "QMK_TOPK: power of two, ≤ 32");
static_assert(QMK_TOPK <= QMK_LMH_ROWS, "QMK_TOPK exceeds the rows of one lm_head block");

// Key of a bf16 logit at vocabulary id: high word orders like the value (-0 counted as +0), low word = ~id.
__device__ __forceinline__ qmk_u64 qmk_logit_key(qmk_u16 h, int id) {
    if (h == 0x8000u) h = 0;
    const qmk_u32 o = (h & 0x8000u) ? (~(qmk_u32)h & 0xFFFFu) : ((qmk_u32)h | 0x8000u);
    return ((qmk_u64)o << 32) | (qmk_u64)(0xFFFFFFFFu - (qmk_u32)id);
}
__device__ __forceinline__ int qmk_key_id(qmk_u64 k) { return (int)(0xFFFFFFFFu - (qmk_u32)k); }
__device__ __forceinline__ qmk_u16 qmk_key_logit(qmk_u64 k) {
    const qmk_u32 o = (qmk_u32)(k >> 32);
    return (qmk_u16)((o & 0x8000u) ? (o & 0x7FFFu) : (~o & 0xFFFFu));
}

// Descending bitonic sort of `rows` independent arrays s[r][0..n) (n a power of two) by NT threads.
template <int NT>
__device__ __forceinline__ void qmk_bitonic_desc(qmk_u64* s, int rows, int n) {
    const int half = n >> 1;
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int p = threadIdx.x; p < rows * half; p += NT) {
                const int r = p / half, q = p - r * half;
                const int i = 2 * j * (q / j) + (q % j), l = i + j;
                qmk_u64* a = s + (size_t)r * n;
                const qmk_u64 x = a[i], y = a[l];
                if (((i & k) == 0) ? (x < y) : (x > y)) { a[i] = y; a[l] = x; }
            }
            __syncthreads();
        }
    }
}

// One block (QMK_LMH_THREADS threads): rows [blk·QMK_LMH_ROWS, +QMK_LMH_ROWS) of W [V, K] bf16, x [M, K] bf16.
// best [M, nblk] keys; cand [M, nblk, QMK_TOPK] keys (when TOPK); logits [M, V] bf16 when non-null (debug).
template <bool TOPK>
__device__ __forceinline__ void qmk_lm_head_block(const qmk_u16* W, const qmk_u16* x, int M, int K, int V, int blk,
                                                  int nblk, qmk_u64* best, qmk_u64* cand, qmk_u16* logits) {
    __shared__ qmk_u64 sk[QMK_MAX_ROWS][QMK_LMH_ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int row0 = blk * QMK_LMH_ROWS + QMK_ROW_TILE * warp;
    float acc[4];
    qmk_gemv_tile<QMK_W_BF16>(acc, W, nullptr, x, M, K, row0, 0, K / QMK_KBLK);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int m = 2 * c + j;
        if (m < M) {
            const qmk_u16 h0 = qmk_f2bf(acc[j]), h1 = qmk_f2bf(acc[2 + j]);
            // padding rows (ids >= QMK_VALID_VOCAB) get key 0, below every real logit: never chosen
            sk[m][QMK_ROW_TILE * warp + g] = row0 + g < QMK_VALID_VOCAB ? qmk_logit_key(h0, row0 + g) : 0ull;
            sk[m][QMK_ROW_TILE * warp + g + 8] =
                row0 + g + 8 < QMK_VALID_VOCAB ? qmk_logit_key(h1, row0 + g + 8) : 0ull;
            if (logits) {
                logits[(size_t)m * V + row0 + g] = h0;
                logits[(size_t)m * V + row0 + g + 8] = h1;
            }
        }
    }
    __syncthreads();
    if (TOPK) {
        qmk_bitonic_desc<QMK_LMH_THREADS>(&sk[0][0], M, QMK_LMH_ROWS);
        for (int p = threadIdx.x; p < M * QMK_TOPK; p += QMK_LMH_THREADS) {
            const int m = p / QMK_TOPK, i = p - m * QMK_TOPK;
            cand[((size_t)m * nblk + blk) * QMK_TOPK + i] = sk[m][i];
        }
        if (threadIdx.x < M) best[(size_t)threadIdx.x * nblk + blk] = sk[threadIdx.x][0];
    } else if (warp < M) {  // warp m reduces row m's keys
        qmk_u64 k = 0;
        for (int i = lane; i < QMK_LMH_ROWS; i += 32) k = sk[warp][i] > k ? sk[warp][i] : k;
        for (int o = 16; o > 0; o >>= 1) {
            const qmk_u64 t = __shfl_xor_sync(0xFFFFFFFFu, k, o);
            k = t > k ? t : k;
        }
        if (lane == 0) best[(size_t)warp * nblk + blk] = k;
    }
}

__host__ __device__ constexpr int qmk_next_pow2(int v) { return v <= 1 ? 1 : 2 * qmk_next_pow2((v + 1) / 2); }
#define QMK_LMH_MERGE_THREADS 1024

// One block of QMK_LMH_MERGE_THREADS per activation row m: global best (and top-k) from the block results.
// NP = next power of two ≥ nblk. ids [M] int32, vals [M] bf16, cand_out [M, QMK_TOPK] keys (when TOPK).
template <bool TOPK, int NP>
__device__ __forceinline__ void qmk_lm_head_merge(const qmk_u64* best, const qmk_u64* cand, int nblk, int m,
                                                  int* ids, qmk_u16* vals, qmk_u64* cand_out) {
    __shared__ qmk_u64 s[TOPK ? (NP > QMK_TOPK * QMK_TOPK ? NP : QMK_TOPK * QMK_TOPK) : 32];
    const int tid = threadIdx.x;
    if constexpr (!TOPK) {
        qmk_u64 k = 0;
        for (int i = tid; i < nblk; i += QMK_LMH_MERGE_THREADS) k = best[(size_t)m * nblk + i] > k ? best[(size_t)m * nblk + i] : k;
        for (int o = 16; o > 0; o >>= 1) {
            const qmk_u64 t = __shfl_xor_sync(0xFFFFFFFFu, k, o);
            k = t > k ? t : k;
        }
        if ((tid & 31) == 0) s[tid >> 5] = k;
        __syncthreads();
        if (tid < 32) {
            k = s[tid];
            for (int o = 16; o > 0; o >>= 1) {
                const qmk_u64 t = __shfl_xor_sync(0xFFFFFFFFu, k, o);
                k = t > k ? t : k;
            }
            if (tid == 0) { ids[m] = qmk_key_id(k); vals[m] = qmk_key_logit(k); }
        }
    } else {
        for (int i = tid; i < NP; i += QMK_LMH_MERGE_THREADS) s[i] = i < nblk ? best[(size_t)m * nblk + i] : 0ull;
        __syncthreads();
        qmk_bitonic_desc<QMK_LMH_MERGE_THREADS>(s, 1, NP);
        int b = -1;  // this thread's candidate: candidate j of the (i)-th best block, tid = i·TOPK + j
        if (tid < QMK_TOPK * QMK_TOPK) b = qmk_key_id(s[tid / QMK_TOPK]) / QMK_LMH_ROWS;
        if (tid == 0) { ids[m] = qmk_key_id(s[0]); vals[m] = qmk_key_logit(s[0]); }
        __syncthreads();
        if (tid < QMK_TOPK * QMK_TOPK) s[tid] = cand[((size_t)m * nblk + b) * QMK_TOPK + (tid % QMK_TOPK)];
        __syncthreads();
        qmk_bitonic_desc<QMK_LMH_MERGE_THREADS>(s, 1, QMK_TOPK * QMK_TOPK);
        if (tid < QMK_TOPK) cand_out[(size_t)m * QMK_TOPK + tid] = s[tid];
    }
}

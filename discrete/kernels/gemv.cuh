// gemv.cuh — fp8 block-scaled (and bf16) GEMV on tensor cores, split-K partials and the fixed-order reduce
// with fused epilogues (docs/INTERFACES.md §2; article Parts 4.1, 4.3, 4.4, 3.7).
//
//   y[m, n] = Σ_k W[n, k] · x[m, k],  W [N, K] e4m3 + bf16 scale [ceil(N/128), K/128] (or bf16, scale 1),
//   x [M, K] bf16 (M ≤ 8 rows, independent), partials P [S, M, N] fp32.
//
// One warp owns a 16-row tile for the K-blocks of one split. Per 128-wide K-block it runs 8 mma.m16n8k16:
// A = 16 weight rows × 16 reduction slots (widened e4m3 → bf16 in registers), B = the activation rows in B's
// 8 columns (column m = row m of x; columns ≥ M are zero, so row m's result never depends on M). The 128
// reduction slots are a fixed permutation of the block's columns chosen so that every lane loads 16
// physically consecutive bytes straight from the checkpoint's row-major order, and each 16-byte load
// instruction of the warp covers whole 64-byte row segments (lane c = lane % 4, step t = 0..7):
//   fp8  slots of step t, lane c ↔ columns 64·(t/4) + 16c + 4·(t%4) + {0,1,2,3}
//   bf16 slots of step t, lane c ↔ columns 32·(t/2) +  8c + 4·(t%2) + {0,1,2,3}
// The activation is read with the same permutation. Per K-block the tensor-core sum d (fp32, internal order
// fixed by the hardware) is folded in as acc = fp32(acc + fp32(scale · d)) in block order, no FMA.
//
// Work unit for both paths: a warp task = (16-row tile, split), numbered t = tile · S + split. A slice is a
// task range [task_start, task_end) (one per SM, balanced to ±1 task by the partition: all of an SM's tasks
// run at once, one per warp, so every SM finishes together); warp w takes tasks task_start + w + i·NWARPS.
// Nothing here reads gridDim or blockDim.
#pragma once
#include "common.cuh"

#ifndef QMK_GEMV_WARPS
#define QMK_GEMV_WARPS 28       // fp8 kernel: one 896-thread block per SM (72 registers); 27B needs ≤ 28 tasks per SM
#endif
#ifndef QMK_GEMV_BF16_WARPS
#define QMK_GEMV_BF16_WARPS 24  // bf16 kernel: 768 threads (its K-block is 4 KB per warp: more registers)
#endif
#define QMK_KBLK 128
#define QMK_ROW_TILE 16
#define QMK_MAX_ROWS 8

enum { QMK_W_FP8 = 0, QMK_W_BF16 = 1 };
enum { QMK_EPI_STORE = 0, QMK_EPI_RESIDUAL = 1, QMK_EPI_SWIGLU = 2 };

struct QmkGemvSlice { int task_start, task_end, pad0, pad1; };  // host: int32 [n, 4]

__device__ __forceinline__ qmk_u32 qmk_u4c(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

#ifndef QMK_GEMV_STAGES
#define QMK_GEMV_STAGES 2  // pipeline units (2 KB of weights per warp each) in flight per warp
#endif

// Pipeline unit: 16 rows × 128 bytes of weights per warp = 4 × 16-byte loads per lane (one fp8 K-block, or
// half a bf16 K-block). Unit u of a tile covers K-block u / UPK, half u % UPK.
template <int WK> struct QmkGemvTraits;
template <> struct QmkGemvTraits<QMK_W_FP8> {
    static constexpr int ESIZE = 1, UPK = 1;
    __device__ static __forceinline__ int xoff(int i, int c) { return 64 * (i >> 1) + 16 * c + 8 * (i & 1); }
};
template <> struct QmkGemvTraits<QMK_W_BF16> {
    static constexpr int ESIZE = 2, UPK = 2;
    __device__ static __forceinline__ int xoff(int i, int c) { return 32 * i + 8 * c; }
};

// Weight chunk j of lane c sits at byte 64·j + 16·c of the row's K-block (both kinds). A unit holds chunks
// 2h, 2h+1 of rows g (w[0], w[1]) and g+8 (w[2], w[3]), h = the half (always 0 for fp8).
template <int WK>
__device__ __forceinline__ void qmk_gemv_load_unit(uint4 (&w)[4], const qmk_u8* rowg, size_t row8, int u, int c) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK;
    const int kb = u / UPK, h = u - kb * UPK;
    const qmk_u8* p = rowg + (size_t)kb * QMK_KBLK * QmkGemvTraits<WK>::ESIZE + 128 * h + 16 * c;
    w[0] = qmk_ld_stream16(p);
    w[1] = qmk_ld_stream16(p + 64);
    w[2] = qmk_ld_stream16(p + row8);
    w[3] = qmk_ld_stream16(p + row8 + 64);
}

// The mma steps of one unit into d (fp8: steps 0..7; bf16 half h: steps 4h..4h+3).
template <int WK>
__device__ __forceinline__ void qmk_gemv_unit_mma(float (&d)[4], const uint4 (&w)[4], const qmk_u16* xrow,
                                                  bool xvalid, int u, int c) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK, NX = 4 / UPK;
    const int kb = u / UPK, h = u - kb * UPK;
    uint4 xv[NX];
#pragma unroll
    for (int i = 0; i < NX; ++i)
        xv[i] = xvalid ? qmk_ld16(xrow + kb * QMK_KBLK + QmkGemvTraits<WK>::xoff(NX * h + i, c)) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int t = 0; t < 8 / UPK; ++t) {  // t: step within the unit
        qmk_u32 a0, a1, a2, a3;
        if (WK == QMK_W_FP8) {
            qmk_e4m3x4_to_bf16(qmk_u4c(w[t >> 2], t & 3), a0, a2);
            qmk_e4m3x4_to_bf16(qmk_u4c(w[2 + (t >> 2)], t & 3), a1, a3);
        } else {
            a0 = qmk_u4c(w[t >> 1], 2 * (t & 1));
            a2 = qmk_u4c(w[t >> 1], 2 * (t & 1) + 1);
            a1 = qmk_u4c(w[2 + (t >> 1)], 2 * (t & 1));
            a3 = qmk_u4c(w[2 + (t >> 1)], 2 * (t & 1) + 1);
        }
        qmk_mma_bf16_16816(d, a0, a1, a2, a3, qmk_u4c(xv[t >> 1], 2 * (t & 1)), qmk_u4c(xv[t >> 1], 2 * (t & 1) + 1));
    }
}

// One warp: 16-row tile at row0 over K-blocks [kb0, kb1) of a [N, K] weight. Returns the fp32 accumulator
// fragment: acc[0], acc[1] = rows row0+g, activation rows 2c, 2c+1; acc[2], acc[3] = rows row0+g+8 (g = lane/4).
// QMK_GEMV_STAGES units are loaded ahead (a register ring); per K-block d starts at 0 and is folded into acc.
template <int WK>
__device__ __forceinline__ void qmk_gemv_tile(float (&acc)[4], const void* W, const qmk_u16* scale, const qmk_u16* x,
                                              int M, int K, int row0, int kb0, int kb1) {
    constexpr int D = QMK_GEMV_STAGES, UPK = QmkGemvTraits<WK>::UPK;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t rowbytes = (size_t)K * QmkGemvTraits<WK>::ESIZE;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(row0 + g) * rowbytes;
    const size_t row8 = 8 * rowbytes;
    const qmk_u16* srow = WK == QMK_W_FP8 ? scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK) : scale;
    const bool xvalid = g < M;
    const qmk_u16* xrow = x + (size_t)(xvalid ? g : 0) * K;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    const int u0 = kb0 * UPK, u1 = kb1 * UPK;
    uint4 w[D][4];
    float sc[D];
#pragma unroll
    for (int i = 0; i < D - 1; ++i) {
        if (u0 + i < u1) {
            qmk_gemv_load_unit<WK>(w[i], rowg, row8, u0 + i, c);
            sc[i] = WK == QMK_W_FP8 ? qmk_bf2f(qmk_ld_nc_u16(srow + u0 + i)) : 1.f;
        }
    }
    float d[4];
    for (int ub = u0; ub < u1; ub += D) {
#pragma unroll
        for (int i = 0; i < D; ++i) {
            const int u = ub + i;
            if (u >= u1) break;
            const int un = u + D - 1;
            if (un < u1) {
                qmk_gemv_load_unit<WK>(w[(i + D - 1) % D], rowg, row8, un, c);
                sc[(i + D - 1) % D] = WK == QMK_W_FP8 ? qmk_bf2f(qmk_ld_nc_u16(srow + un)) : 1.f;
            }
            if (UPK == 1 || (u & 1) == 0) d[0] = d[1] = d[2] = d[3] = 0.f;
            qmk_gemv_unit_mma<WK>(d, w[i], xrow, xvalid, u, c);
            if (UPK == 1 || (u & 1) == 1) {
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc[i], d[j]));
            }
        }
    }
}

// Store a tile's fragment as partials P[split, m, n] (fp32 [S, M, N]) for m < M.
__device__ __forceinline__ void qmk_gemv_store_partial(const float (&acc)[4], float* P, int M, int N, int split,
                                                       int row0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int m = 2 * c + j;
        if (m < M) {
            float* p = P + ((size_t)split * M + m) * N + row0 + g;
            p[0] = acc[j];
            p[8] = acc[2 + j];
        }
    }
}

// A whole slice on one block of 32·NWARPS threads: tasks round-robin over the warps, partials out.
template <int WK, int NWARPS>
__device__ __forceinline__ void qmk_gemv_slice(const void* W, const qmk_u16* scale, const qmk_u16* x, int M, int N,
                                               int K, int S, QmkGemvSlice sl, float* P) {
    const int warp = threadIdx.x >> 5;
    const int per = (K / QMK_KBLK) / S;
    for (int t = sl.task_start + warp; t < sl.task_end; t += NWARPS) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        float acc[4];
        qmk_gemv_tile<WK>(acc, W, scale, x, M, K, row0, split * per, (split + 1) * per);
        qmk_gemv_store_partial(acc, P, M, N, split, row0);
    }
}

// Fixed-order split-K reduce of output (m, n): y = P[0]; y = fp32(y + P[s]) for s = 1..S-1.
__device__ __forceinline__ float qmk_gemv_reduce_at(const float* P, int S, int M, int N, int m, int n) {
    float y = P[(size_t)m * N + n];
    for (int s = 1; s < S; ++s) y = __fadd_rn(y, P[((size_t)s * M + m) * N + n]);
    return y;
}

// Epilogue of output (m, n) (INTERFACES §2). store: bf16(y); residual: bf16(f32(bf16(y)) + f32(r[m, n]));
// swiglu (N = 2F rows, gate row n, up row F + n, n < F): bf16(f32(bf16(silu(f32(bf16(g))))) · f32(bf16(u))).
__device__ __forceinline__ qmk_u16 qmk_gemv_epilogue(int epi, const float* P, int S, int M, int N, int m, int n,
                                                     const qmk_u16* resid) {
    if (epi == QMK_EPI_SWIGLU) {
        const int F = N >> 1;
        const float g = qmk_round_bf16(qmk_gemv_reduce_at(P, S, M, N, m, n));
        const float u = qmk_round_bf16(qmk_gemv_reduce_at(P, S, M, N, m, F + n));
        return qmk_f2bf(__fmul_rn(qmk_round_bf16(qmk_silu(g)), u));
    }
    const float y = qmk_gemv_reduce_at(P, S, M, N, m, n);
    if (epi == QMK_EPI_RESIDUAL) return qmk_f2bf(__fadd_rn(qmk_round_bf16(y), qmk_bf2f(resid[(size_t)m * N + n])));
    return qmk_f2bf(y);
}

// gemm.cuh — fp8 block-scaled projection GEMM for prefill (M ≥ 16 activation rows) on tensor cores, with the
// GEMV family's epilogues (store, residual, swiglu), bit-identical per row to the decode GEMV (gemv.cuh) at the
// same split-K factor S (docs/kernels-gemm.md).
//
//   Y[m, n] = Σ_k W[n, k] · X[m, k],  W [N, K] e4m3 (checkpoint layout) + bf16 scale [N/128, K/128],
//   X [M, K] bf16 row-major, Y [M, Nout] bf16 (Nout = N, or N/2 for swiglu).
//
// One block of 32·(BN/WN)·(BM/WM) threads computes a BN (weight rows) × BM (activation rows) tile: warp (wn, wm)
// owns BN-rows wn·WN.. (NI = WN/16 sub-tiles of 16 rows) × BM-rows wm·WM.. (NJ = WM/8 sub-tiles of 8 columns).
// Per 128-wide K-block kb every (16-row, 8-column) sub-tile runs the GEMV's 8 mma.m16n8k16 steps with the GEMV's
// k-slot permutation (A = widened weight rows, B = activation rows as columns; step t, lane c ↔ columns
// 64·(t/4) + 16c + 4·(t%4) + {0,1,2,3} of the K-block), from d = 0, and folds d in block order as
// acc = fp32(acc + fp32(scale · d)), no FMA: qmk_gemv_tile's sum for each (n, m). Split-K is reproduced in
// place: at the end of each split's K-blocks acc is added to the running total, total = fp32(total + acc)
// (the GEMV reduce's order; the total lives in shared memory, one slot per thread and register), and acc
// restarts from 0. An mma output column depends only on its own B column, so the position of row m among
// the 8 columns (here 8j + 2c + e, in the GEMV m) does not change its bits.
//
// Shared memory per stage (one K-block): W tile BN rows × 128 B, X tile BM rows × 256 B, both with the
// 16-byte chunk index XOR-swizzled by the row's parity (W: chunk ^ 4·(row & 1), X: chunk ^ (row & 1)), so the
// cp.async writes (8 lanes = one row's 128 B) and the lds.128 reads (8 lanes = rows 2q, 2q+1 at 4 chunks each)
// are free of bank conflicts. STAGES K-blocks are in flight (cp.async groups, one barrier per K-block).
// swiglu: tile tn covers output features o0 = tn·BN/2 .. o0 + BN/2; warp wn's first NI/2 sub-tiles hold gate
// rows o0 + wn·WN/2 + 16i.., its last NI/2 the matching up rows F + (same), so one thread holds g and u of an
// output. Activation rows ≥ M read row M-1 (never stored). Nothing here reads gridDim.
#pragma once
#include "gemv.cuh"

#define QMK_GEMM_STAGES 3  // K-blocks in flight: 3 × 48 KB, + 64 KB of split-K totals, fit 227 KB

template <int BN_, int BM_, int WN_, int WM_, int STAGES_>
struct QmkGemmTile {
    static constexpr int BN = BN_, BM = BM_, WN = WN_, WM = WM_, STAGES = STAGES_;
    static constexpr int WARPS_N = BN / WN, WARPS = WARPS_N * (BM / WM), THREADS = 32 * WARPS;
    static constexpr int NI = WN / 16, NJ = WM / 8;
    static constexpr int W_BYTES = BN * QMK_KBLK, X_BYTES = BM * QMK_KBLK * 2, STAGE_BYTES = W_BYTES + X_BYTES;
    static constexpr int ACC = NI * NJ * 4;                     // fp32 accumulators per thread
    static constexpr int TOTAL_BYTES = ACC * THREADS * 4;       // split-K totals (only when S > 1)
    static constexpr int OUT_PITCH = BN + 8;                    // staged output row, bf16 elements (272 B)
    static_assert(BN % WN == 0 && BM % WM == 0 && WN % 32 == 0 && WM % 8 == 0, "tile shape");
    static_assert((BN * 8) % THREADS == 0 && (BM * 16) % THREADS == 0, "stage copy split over threads");
    static_assert(BM * OUT_PITCH * 2 <= STAGES * STAGE_BYTES, "staged output fits the stages");
};

// Weight row held by tile row r (0..BN-1) of tile column tn.
template <class T, int EPI>
__device__ __forceinline__ int qmk_gemm_wrow(int tn, int r, int F) {
    if (EPI != QMK_EPI_SWIGLU) return tn * T::BN + r;
    const int w = r / T::WN, q = r - w * T::WN, half = T::WN / 2;
    const int feat = tn * (T::BN / 2) + w * half + (q < half ? q : q - half);
    return q < half ? feat : F + feat;
}

// Start the copies of K-block kb into stage st (one cp.async group, committed by the caller).
template <class T, int EPI>
__device__ __forceinline__ void qmk_gemm_issue(qmk_u32 st, const qmk_u8* W, const qmk_u16* X, int M, int K, int F,
                                               int tn, int m0, int kb) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < T::BN * 8 / T::THREADS; ++i) {  // W: 8 chunks of 16 B per row
        const int q = tid + i * T::THREADS, r = q >> 3, ch = q & 7;
        const qmk_u8* src = W + (size_t)qmk_gemm_wrow<T, EPI>(tn, r, F) * K + kb * QMK_KBLK + 16 * ch;
        qmk_cp_async16(st + r * QMK_KBLK + 16 * (ch ^ ((r & 1) << 2)), src);
    }
#pragma unroll
    for (int i = 0; i < T::BM * 16 / T::THREADS; ++i) {  // X: 16 chunks of 16 B per row
        const int q = tid + i * T::THREADS, r = q >> 4, ch = q & 15;
        const int m = m0 + r < M ? m0 + r : M - 1;
        const qmk_u16* src = X + (size_t)m * K + kb * QMK_KBLK + 8 * ch;
        qmk_cp_async16(st + T::W_BYTES + r * 2 * QMK_KBLK + 16 * (ch ^ (r & 1)), src);
    }
}

// d[i][j] = the 8 mma steps of K-block (stage) at smem (generic pointer), from d = 0.
template <class T>
__device__ __forceinline__ void qmk_gemm_kblock(float (&d)[T::NI][T::NJ][4], const qmk_u8* stage, int wn, int wm) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < T::NI; ++i)
#pragma unroll
        for (int j = 0; j < T::NJ; ++j) d[i][j][0] = d[i][j][1] = d[i][j][2] = d[i][j][3] = 0.f;
    const qmk_u8* ws = stage + (wn * T::WN + g) * QMK_KBLK;
    const qmk_u8* xs = stage + T::W_BYTES + (wm * T::WM + g) * 2 * QMK_KBLK;
    const int wsw = (g & 1) << 2, xsw = g & 1;  // swizzles of rows g (+ 8, + 16i: same parity)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // steps 4h .. 4h+3: weight chunk 4h + c of rows g and g + 8
        uint4 a[T::NI][2];
#pragma unroll
        for (int i = 0; i < T::NI; ++i) {
            const qmk_u8* p = ws + 16 * i * QMK_KBLK + 16 * ((4 * h + c) ^ wsw);
            a[i][0] = *reinterpret_cast<const uint4*>(p);
            a[i][1] = *reinterpret_cast<const uint4*>(p + 8 * QMK_KBLK);
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // steps 4h + 2p, 4h + 2p + 1: activation chunk 8h + 2c + p of row g
            uint4 b[T::NJ];
#pragma unroll
            for (int j = 0; j < T::NJ; ++j)
                b[j] = *reinterpret_cast<const uint4*>(xs + 8 * j * 2 * QMK_KBLK + 16 * ((8 * h + 2 * c + p) ^ xsw));
#pragma unroll
            for (int tt = 0; tt < 2; ++tt) {
                const int wd = 2 * p + tt;  // word of the weight chunk: step t = 4h + wd
#pragma unroll
                for (int i = 0; i < T::NI; ++i) {
                    qmk_u32 a0, a1, a2, a3;
                    qmk_e4m3x4_to_bf16(qmk_u4c(a[i][0], wd), a0, a2);
                    qmk_e4m3x4_to_bf16(qmk_u4c(a[i][1], wd), a1, a3);
#pragma unroll
                    for (int j = 0; j < T::NJ; ++j)
                        qmk_mma_bf16_16816(d[i][j], a0, a1, a2, a3, qmk_u4c(b[j], 2 * tt), qmk_u4c(b[j], 2 * tt + 1));
                }
            }
        }
    }
}

// One BN × BM output tile (tn, tm): the K loop, the split-K totals and the epilogue.
// per: K-blocks per split (K/128 when S = 1; S = K/128 gives the same bits and is passed as S = 1).
// out [M, Nout] bf16; resid [M, N] bf16 (residual only; may alias out). smem: dynamic shared memory,
// STAGES · STAGE_BYTES (+ TOTAL_BYTES when per < K/128), 128-byte aligned.
template <class T, int EPI>
__device__ __forceinline__ void qmk_gemm_tile(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale,
                                              const qmk_u16* X, int M, int N, int K, int per, const qmk_u16* resid,
                                              qmk_u16* out, int tn, int tm, qmk_u8* smem) {
    constexpr int NI = T::NI, NJ = T::NJ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int wn = warp % T::WARPS_N, wm = warp / T::WARPS_N;
    const int nkb = K / QMK_KBLK, m0 = tm * T::BM, F = N >> 1;
    const qmk_u32 sbase = (qmk_u32)__cvta_generic_to_shared(smem);
    float* totals = reinterpret_cast<float*>(smem + T::STAGES * T::STAGE_BYTES) + tid;  // [ACC][THREADS]
    const qmk_u16* srow[NI];  // scale row of each 16-row sub-tile (all 16 rows share one 128-row block)
#pragma unroll
    for (int i = 0; i < NI; ++i)
        srow[i] = scale + (size_t)(qmk_gemm_wrow<T, EPI>(tn, wn * T::WN + 16 * i, F) / QMK_KBLK) * nkb;

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < nkb) qmk_gemm_issue<T, EPI>(sbase + s * T::STAGE_BYTES, W, X, M, K, F, tn, m0, s);
        qmk_cp_async_commit();
    }
    float acc[NI][NJ][4], d[NI][NJ][4];
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    int left = per;  // K-blocks left in the current split
    for (int kb = 0; kb < nkb; ++kb) {
        qmk_cp_async_wait(T::STAGES - 2);  // this thread's copies of K-block kb have landed ...
        __syncthreads();                    // ... and everyone's; and everyone is done with K-block kb - 1
        const int kn = kb + T::STAGES - 1;  // refill the stage K-block kb - 1 used
        if (kn < nkb) qmk_gemm_issue<T, EPI>(sbase + (kn % T::STAGES) * T::STAGE_BYTES, W, X, M, K, F, tn, m0, kn);
        qmk_cp_async_commit();
        float sc[NI];
#pragma unroll
        for (int i = 0; i < NI; ++i) sc[i] = qmk_bf2f(__ldg(srow[i] + kb));
        qmk_gemm_kblock<T>(d, smem + (kb % T::STAGES) * T::STAGE_BYTES, wn, wm);
#pragma unroll
        for (int i = 0; i < NI; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = __fadd_rn(acc[i][j][e], __fmul_rn(sc[i], d[i][j][e]));
        if (--left == 0 && kb + 1 < nkb) {  // end of a split (not the last): total = fp32(total + acc)
            const bool first = kb + 1 == per;
#pragma unroll
            for (int i = 0; i < NI; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float* t = totals + ((i * NJ + j) * 4 + e) * T::THREADS;
                        *t = first ? acc[i][j][e] : __fadd_rn(*t, acc[i][j][e]);
                        acc[i][j][e] = 0.f;
                    }
            left = per;
        }
    }
    if (per < nkb) {  // the last split: y = fp32(total + acc)
#pragma unroll
        for (int i = 0; i < NI; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[i][j][e] = __fadd_rn(totals[((i * NJ + j) * 4 + e) * T::THREADS], acc[i][j][e]);
    }

    // Epilogue: stage bf16 results as [BM][OUT_PITCH] in the (drained) stage memory, then coalesced 16-byte
    // stores of rows m < M. store: bf16(y); residual: bf16(f32(bf16(y)) + f32(r)); swiglu:
    // bf16(f32(bf16(silu(f32(bf16(g))))) · f32(bf16(u))) — qmk_gemv_epilogue's operations.
    qmk_cp_async_wait(0);
    __syncthreads();
    qmk_u16* stg = reinterpret_cast<qmk_u16*>(smem);
    constexpr int IO = EPI == QMK_EPI_SWIGLU ? NI / 2 : NI;  // output sub-tiles per warp
    constexpr int WO = EPI == QMK_EPI_SWIGLU ? T::WN / 2 : T::WN, BO = EPI == QMK_EPI_SWIGLU ? T::BN / 2 : T::BN;
#pragma unroll
    for (int i = 0; i < IO; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = wn * WO + 16 * i + g + 8 * (e >> 1), m = wm * T::WM + 8 * j + 2 * c + (e & 1);
                qmk_u16 v;
                if (EPI == QMK_EPI_SWIGLU) {
                    const float gv = qmk_round_bf16(acc[i][j][e]), uv = qmk_round_bf16(acc[i + NI / 2][j][e]);
                    v = qmk_f2bf(__fmul_rn(qmk_round_bf16(qmk_silu(gv)), uv));
                } else {
                    v = qmk_f2bf(acc[i][j][e]);
                }
                stg[m * T::OUT_PITCH + n] = v;
            }
    __syncthreads();
    const int nout = EPI == QMK_EPI_SWIGLU ? F : N, n0 = tn * BO;
    for (int q = tid; q < T::BM * (BO / 8); q += T::THREADS) {
        const int m = q / (BO / 8), ch = q - m * (BO / 8);
        if (m0 + m >= M) break;  // rows are in order: the rest are past M too
        uint4 v = *reinterpret_cast<const uint4*>(stg + m * T::OUT_PITCH + 8 * ch);
        qmk_u16* dst = out + (size_t)(m0 + m) * nout + n0 + 8 * ch;
        if (EPI == QMK_EPI_RESIDUAL) {
            const uint4 r = *reinterpret_cast<const uint4*>(resid + (size_t)(m0 + m) * N + n0 + 8 * ch);
            qmk_u32* vw = reinterpret_cast<qmk_u32*>(&v);
            const qmk_u32* rw = reinterpret_cast<const qmk_u32*>(&r);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const qmk_u16 lo = qmk_gemv_residual(qmk_bf2f((qmk_u16)(vw[k] & 0xFFFFu)), (qmk_u16)(rw[k] & 0xFFFFu));
                const qmk_u16 hi = qmk_gemv_residual(qmk_bf2f((qmk_u16)(vw[k] >> 16)), (qmk_u16)(rw[k] >> 16));
                vw[k] = (qmk_u32)lo | ((qmk_u32)hi << 16);
            }
        }
        *reinterpret_cast<uint4*>(dst) = v;
    }
}

// Tile order of block b: activation-row tiles fastest, so the blocks resident at once share their weight tiles
// (and stream the activation from L2). m_tiles = ceil(M / BM).
template <class T, int EPI>
__device__ __forceinline__ void qmk_gemm_block(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale,
                                               const qmk_u16* X, int M, int N, int K, int per, const qmk_u16* resid,
                                               qmk_u16* out, int b) {
    extern __shared__ __align__(128) qmk_u8 qmk_gemm_smem[];
    const int mt = (M + T::BM - 1) / T::BM;
    qmk_gemm_tile<T, EPI>(W, scale, X, M, N, K, per, resid, out, b / mt, b % mt, qmk_gemm_smem);
}

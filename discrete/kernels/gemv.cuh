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

#define QMK_GEMV_WARPS 28       // fp8 kernel: one 896-thread block per SM (72 registers); 27B needs ≤ 28 tasks per SM
#define QMK_GEMV_BF16_WARPS 24  // bf16 kernel: 768 threads (its K-block is 4 KB per warp: more registers)
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

// The activation chunks of unit u for lane c. QMK_GEMV_X_MASK = 0 (default): every lane loads its row
// min(g, M-1) (the caller's xrow), so B's columns ≥ M repeat row M-1; an mma output column depends only on its
// own B column, so columns < M are the same bits either way and the columns ≥ M are never stored. No branch and
// no masking in the hot loop (measured: the widening already loads the ALU pipe, and masking or branching cost
// 2-4 points on gate|up; a mask of rows ≥ M, measured and rejected, is in docs/kernels-gemv.md "Tried and
// rejected"). 2: the load skipped for rows ≥ M (a per-lane branch; xvalid = g < M matters only
// there).
#ifndef QMK_GEMV_X_MASK
#define QMK_GEMV_X_MASK 0
#endif
template <int WK>
__device__ __forceinline__ void qmk_gemv_load_x(uint4 (&xv)[4 / QmkGemvTraits<WK>::UPK], const qmk_u16* xrow,
                                                bool xvalid, int u, int c) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK, NX = 4 / UPK;
    const int kb = u / UPK, h = u - kb * UPK;
#pragma unroll
    for (int i = 0; i < NX; ++i) {
        const qmk_u16* p = xrow + kb * QMK_KBLK + QmkGemvTraits<WK>::xoff(NX * h + i, c);
#if QMK_GEMV_X_MASK == 2
        xv[i] = xvalid ? qmk_ld16(p) : make_uint4(0, 0, 0, 0);
#else
        xv[i] = qmk_ld16(p);
#endif
    }
}

// Row of x that lane row g reads (see qmk_gemv_load_x): g, or M-1 for g ≥ M (QMK_GEMV_X_MASK 0), or 0 (2).
__device__ __forceinline__ int qmk_gemv_xrow(int g, int M) {
#if QMK_GEMV_X_MASK == 0
    return g < M ? g : M - 1;
#else
    return g < M ? g : 0;
#endif
}

// The mma steps of one unit into d (fp8: steps 0..7; bf16 half h: steps 4h..4h+3), activation chunks given.
template <int WK>
__device__ __forceinline__ void qmk_gemv_unit_mma_x(float (&d)[4], const uint4 (&w)[4],
                                                    const uint4 (&xv)[4 / QmkGemvTraits<WK>::UPK]) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK;
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

// Both of the above (the register-ring tile).
template <int WK>
__device__ __forceinline__ void qmk_gemv_unit_mma(float (&d)[4], const uint4 (&w)[4], const qmk_u16* xrow,
                                                  bool xvalid, int u, int c) {
    uint4 xv[4 / QmkGemvTraits<WK>::UPK];
    qmk_gemv_load_x<WK>(xv, xrow, xvalid, u, c);
    qmk_gemv_unit_mma_x<WK>(d, w, xv);
}

// One warp: 16-row tile at row0 over K-blocks [kb0, kb1) of a [N, K] weight. Returns the fp32 accumulator
// fragment: acc[0], acc[1] = rows row0+g, activation rows 2c, 2c+1; acc[2], acc[3] = rows row0+g+8 (g = lane/4).
// QMK_GEMV_STAGES units are loaded ahead (a register ring); per K-block d starts at 0 and is folded into acc.
// MC > 0: the row count as a compile-time constant (M is then ignored; measured: the M = 1 build streams 3-5
// points faster, docs/kernels-gemv.md "Where the GEMV time goes"); same bits as MC = 0 with M = MC.
template <int WK, int MC = 0>
__device__ __forceinline__ void qmk_gemv_tile(float (&acc)[4], const void* W, const qmk_u16* scale, const qmk_u16* x,
                                              int M_, int K, int row0, int kb0, int kb1) {
    const int M = MC > 0 ? MC : M_;
    constexpr int D = QMK_GEMV_STAGES, UPK = QmkGemvTraits<WK>::UPK;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t rowbytes = (size_t)K * QmkGemvTraits<WK>::ESIZE;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(row0 + g) * rowbytes;
    const size_t row8 = 8 * rowbytes;
    const qmk_u16* srow = WK == QMK_W_FP8 ? scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK) : scale;
    const bool xvalid = g < M;
    const qmk_u16* xrow = x + (size_t)qmk_gemv_xrow(g, M) * K;
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

// Fixed-order split-K reduce of output (m, n): y = P[0]; y = fp32(y + P[s]) for s = 1..S-1. CG: read P at L2
// (ld.global.cg), for partials other warps wrote in the same launch (L1 is not coherent).
template <bool CG = false>
__device__ __forceinline__ float qmk_gemv_reduce_at(const float* P, int S, int M, int N, int m, int n) {
    float y = CG ? __ldcg(P + (size_t)m * N + n) : P[(size_t)m * N + n];
#pragma unroll 8  // lets the S loads issue together (a fused tail otherwise waits S serial L2 round trips);
    for (int s = 1; s < S; ++s) {  // the adds keep split order, so the bits do not change
        const float* p = P + ((size_t)s * M + m) * N + n;
        y = __fadd_rn(y, CG ? __ldcg(p) : *p);
    }
    return y;
}

// The same reduce in two parts, for a caller that loads several outputs' partials before adding any (S = SC fixed
// at compile time): the SC partials of output (m, n) at L2, then their sum in split order (qmk_gemv_reduce_at's).
template <int SC>
__device__ __forceinline__ void qmk_gemv_load_splits(const float* P, int M, int N, int m, int n, float (&v)[SC]) {
#pragma unroll
    for (int s = 0; s < SC; ++s) v[s] = __ldcg(P + ((size_t)s * M + m) * N + n);
}
template <int SC>
__device__ __forceinline__ float qmk_gemv_sum_splits(const float (&v)[SC]) {
    float y = v[0];
#pragma unroll
    for (int s = 1; s < SC; ++s) y = __fadd_rn(y, v[s]);
    return y;
}

// residual epilogue of a reduced output y with residual r: bf16(f32(bf16(y)) + f32(r))
__device__ __forceinline__ qmk_u16 qmk_gemv_residual(float y, qmk_u16 r) {
    return qmk_f2bf(__fadd_rn(qmk_round_bf16(y), qmk_bf2f(r)));
}

// Epilogue of output (m, n) (INTERFACES §2). store: bf16(y); residual: bf16(f32(bf16(y)) + f32(r[m, n]));
// swiglu (N = 2F rows, gate row n, up row F + n, n < F): bf16(f32(bf16(silu(f32(bf16(g))))) · f32(bf16(u))).
template <bool CG = false>
__device__ __forceinline__ qmk_u16 qmk_gemv_epilogue(int epi, const float* P, int S, int M, int N, int m, int n,
                                                     const qmk_u16* resid) {
    if (epi == QMK_EPI_SWIGLU) {
        const int F = N >> 1;
        const float g = qmk_round_bf16(qmk_gemv_reduce_at<CG>(P, S, M, N, m, n));
        const float u = qmk_round_bf16(qmk_gemv_reduce_at<CG>(P, S, M, N, m, F + n));
        return qmk_f2bf(__fmul_rn(qmk_round_bf16(qmk_silu(g)), u));
    }
    const float y = qmk_gemv_reduce_at<CG>(P, S, M, N, m, n);
    if (epi == QMK_EPI_RESIDUAL) return qmk_gemv_residual(y, resid[(size_t)m * N + n]);
    return qmk_f2bf(y);
}

// ---------------------------------------------------------------- shared-memory ring (discrete GEMV kernels)
// Same tile, same mma steps, same fold as qmk_gemv_tile (bit-identical results), but the weight units travel
// by cp.async (16 B per lane, L2 → shared, no registers held while in flight) into a per-warp ring of R
// slots, so R units (R · 2 KB) per warp are in flight instead of the register ring's 2. Each lane reads back
// only the 64 bytes it copied itself (slot byte 512·j + 16·lane: conflict-free), so the ring needs no barrier,
// only cp.async.wait_group. R is chosen per launch by the host (discrete/gemv.py: as deep as 227 KB of shared
// memory allows for the warps a slice needs, at most QMK_GEMV_RING_MAX). Built only with QMK_GEMV_RING_MAX ≥ 2.
#define QMK_GEMV_UNIT_BYTES 2048  // one unit per warp: 32 lanes × 4 chunks × 16 B
#ifndef QMK_GEMV_RING_MAX
// deepest ring (2..8, what qmk_cp_async_wait supports); 0 (default): the register-ring tile qmk_gemv_tile, which
// measured faster on the H200 (docs/kernels-gemv.md "Tried and rejected": the ring lost 5-10 points on tasks of
// ≤ 10 units)
#define QMK_GEMV_RING_MAX 0
#endif
#define QMK_GEMV_CP_OP "cp.async.cg.shared.global.L2::256B"  // the ring's cp.async, 256-byte L2 prefetch hint

// 16 bytes global → shared (shared-window address), bypassing L1.
__device__ __forceinline__ void qmk_cp_async16(qmk_u32 dst, const void* src) {
    asm volatile(QMK_GEMV_CP_OP " [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void qmk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most n (0..7, warp-uniform) of this thread's cp.async groups are pending.
__device__ __forceinline__ void qmk_cp_async_wait(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

__device__ __forceinline__ uint4 qmk_lds16(qmk_u32 a) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a) : "memory");
    return r;
}

// Start the copy of unit u (the four chunks qmk_gemv_load_unit reads) into the slot at dst (this lane's bytes).
template <int WK>
__device__ __forceinline__ void qmk_gemv_issue_unit(qmk_u32 dst, const qmk_u8* rowg, size_t row8, int u, int c) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK;
    const int kb = u / UPK, h = u - kb * UPK;
    const qmk_u8* p = rowg + (size_t)kb * QMK_KBLK * QmkGemvTraits<WK>::ESIZE + 128 * h + 16 * c;
    qmk_cp_async16(dst, p);
    qmk_cp_async16(dst + 512, p + 64);
    qmk_cp_async16(dst + 1024, p + row8);
    qmk_cp_async16(dst + 1536, p + row8 + 64);
}

// The ring's prologue: start the copies of the tile's first R-1 units into slots 0..R-2 (one cp.async group
// each, empty past the end). It reads only the weights, never the activation, so the megakernel issues it
// before waiting for the GEMV's input (article Part 6: weight streaming overlaps the dependency wait).
template <int WK>
__device__ __forceinline__ void qmk_gemv_ring_prologue(const void* W, int K, int row0, int kb0, int kb1, qmk_u32 ring,
                                                       int R) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t rowbytes = (size_t)K * QmkGemvTraits<WK>::ESIZE;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(row0 + g) * rowbytes;
    const int u0 = kb0 * UPK, u1 = kb1 * UPK;
    for (int i = 0; i < R - 1; ++i) {
        if (u0 + i < u1) qmk_gemv_issue_unit<WK>(ring + 16 * lane + i * QMK_GEMV_UNIT_BYTES, rowg, 8 * rowbytes, u0 + i, c);
        qmk_cp_async_commit();
    }
}

// qmk_gemv_tile with the weight units in a ring of R (2..8) slots at shared address ring (this warp's
// R · 2 KB, 16-byte aligned). One cp.async group is committed per unit (empty past the end), so waiting for
// ≤ R-1 pending groups means unit u has landed. Results are bit-identical to qmk_gemv_tile. issued: the
// caller already ran qmk_gemv_ring_prologue for this tile (same arguments; nothing else of this thread in
// flight). (A variant that tracked the issued count to decouple the prefetch depth from the steady-state lead
// measured 0.5-1 ms/token slower in the megakernel: docs/megakernel.md "Tried and rejected".)
template <int WK, int MC = 0>  // MC: as qmk_gemv_tile
__device__ __forceinline__ void qmk_gemv_tile_ring(float (&acc)[4], const void* W, const qmk_u16* scale,
                                                   const qmk_u16* x, int M_, int K, int row0, int kb0, int kb1,
                                                   qmk_u32 ring, int R, bool issued = false) {
    const int M = MC > 0 ? MC : M_;
    constexpr int UPK = QmkGemvTraits<WK>::UPK;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t rowbytes = (size_t)K * QmkGemvTraits<WK>::ESIZE;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(row0 + g) * rowbytes;
    const size_t row8 = 8 * rowbytes;
    const qmk_u16* srow = WK == QMK_W_FP8 ? scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK) : scale;
    const bool xvalid = g < M;
    const qmk_u16* xrow = x + (size_t)qmk_gemv_xrow(g, M) * K;
    const qmk_u32 mine = ring + 16 * lane;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    const int u0 = kb0 * UPK, u1 = kb1 * UPK;
    if (!issued) qmk_gemv_ring_prologue<WK>(W, K, row0, kb0, kb1, ring, R);
    float d[4];
    int slot = 0, slot_next = R - 1;  // ring slots of units u and u + R - 1
    for (int u = u0; u < u1; ++u) {
        // refill the slot unit u-1 used: its ld.shared results fed mma instructions already issued
        if (u + R - 1 < u1) qmk_gemv_issue_unit<WK>(mine + slot_next * QMK_GEMV_UNIT_BYTES, rowg, row8, u + R - 1, c);
        qmk_cp_async_commit();
        const float sc = WK == QMK_W_FP8 ? qmk_bf2f(__ldg(srow + u)) : 1.f;  // fp8: unit u = K-block u
        uint4 xv[4 / UPK];
        qmk_gemv_load_x<WK>(xv, xrow, xvalid, u, c);  // L1/L2 hits, issued before the wait
        qmk_cp_async_wait(R - 1);
        uint4 w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = qmk_lds16(mine + slot * QMK_GEMV_UNIT_BYTES + 512 * j);
        if (UPK == 1 || (u & 1) == 0) d[0] = d[1] = d[2] = d[3] = 0.f;
        qmk_gemv_unit_mma_x<WK>(d, w, xv);
        if (UPK == 1 || (u & 1) == 1) {
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc, d[j]));
        }
        slot = slot + 1 == R ? 0 : slot + 1;
        slot_next = slot_next + 1 == R ? 0 : slot_next + 1;
    }
}

// Fused split-K reduce + epilogue (the discrete kernels' epi ≥ 0 mode). After its partial is stored, the warp
// counts itself in on its output tile's counter; the last of the tile's S warps (swiglu: 2S, gate and up
// tiles) reads the S partials back at L2 and writes the tile's outputs with qmk_gemv_epilogue — the same
// fixed split order and rounding as gemv_reduce, so the outputs are bit-identical. The last warp resets the
// counter to 0 for the next launch. counters: uint32 [output tiles], zero before the first launch.
// out [M, Nout] bf16 (Nout = N, or N/2 for swiglu); resid [M, N] bf16 or null, may alias out.
__device__ __forceinline__ void qmk_gemv_finish_tile(const float* P, int S, int M, int N, int epi, int tile, unsigned int* counters,
                          const qmk_u16* resid, qmk_u16* out) {
    const int lane = threadIdx.x & 31;
    const int nt = (epi == QMK_EPI_SWIGLU ? N >> 1 : N) / QMK_ROW_TILE;  // output tiles
    const int o = tile < nt ? tile : tile - nt;                           // swiglu: up tile F/16 + o → o
    const unsigned int target = (epi == QMK_EPI_SWIGLU ? 2u : 1u) * (unsigned int)S;
    __syncwarp();  // the warp's partial stores happen before lane 0's release below (as qmk::block_bump)
    unsigned int old = 0;
    if (lane == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // release: the stores above, before the count
        old = atomicAdd(counters + o, 1u);
        if (old == target - 1) asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire: the others' partials
    }
    old = __shfl_sync(0xFFFFFFFFu, old, 0);
    if (old != target - 1) return;
    __syncwarp();  // every lane's reads below come after lane 0's acquire
    if (lane == 0) counters[o] = 0u;  // every arrival of this launch is in; the next launch starts from 0
    const int nout = nt * QMK_ROW_TILE;
    for (int i = lane; i < QMK_ROW_TILE * M; i += 32) {
        const int m = i / QMK_ROW_TILE, n = o * QMK_ROW_TILE + (i - m * QMK_ROW_TILE);
        out[(size_t)m * nout + n] = qmk_gemv_epilogue<true>(epi, P, S, M, N, m, n, resid);
    }
}

// A whole slice on one block of 32·NWARPS threads, as qmk_gemv_slice, with the shared-memory ring (R ≥ 2;
// R = 0: the register-ring tile) and, for epi ≥ 0, the fused reduce + epilogue. Dynamic shared memory:
// min(NWARPS, tasks in the slice) · R · 2 KB (warp w's ring at offset w · R · 2 KB).
// MC > 0 (the *_m1 kernels): M = MC at compile time. RG: the tile, 1 = the shared-memory ring (R ≥ 2), 0 = the
// register-ring tile, -1 = by QMK_GEMV_RING_MAX (the general kernels).
template <int WK, int NWARPS, int MC = 0, int RG = -1>
__device__ __forceinline__ void qmk_gemv_slice_ring(const void* W, const qmk_u16* scale, const qmk_u16* x, int M_,
                                                    int N, int K, int S, QmkGemvSlice sl, float* P, int R, int epi,
                                                    const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    const int M = MC > 0 ? MC : M_;
    extern __shared__ __align__(16) qmk_u8 qmk_gemv_ring_smem[];
    const int warp = threadIdx.x >> 5;
    const int per = (K / QMK_KBLK) / S;
    const qmk_u32 ring = (qmk_u32)__cvta_generic_to_shared(qmk_gemv_ring_smem) + warp * R * QMK_GEMV_UNIT_BYTES;
    for (int t = sl.task_start + warp; t < sl.task_end; t += NWARPS) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        float acc[4];
        if (RG == 1 || (RG < 0 && QMK_GEMV_RING_MAX >= 2))
            qmk_gemv_tile_ring<WK, MC>(acc, W, scale, x, M, K, row0, split * per, (split + 1) * per, ring, R);
        else
            qmk_gemv_tile<WK, MC>(acc, W, scale, x, M, K, row0, split * per, (split + 1) * per);
        qmk_gemv_store_partial(acc, P, M, N, split, row0);
        if (epi >= 0) qmk_gemv_finish_tile(P, S, M, N, epi, tile, counters, resid, out);
    }
}

// ---------------------------------------------------------------- TMA weight ring (M = 1 kernels)
// Same tasks, same tile math and fold as qmk_gemv_tile (bit-identical partials), but the weights reach shared
// memory by TMA: each warp streams its tasks (t = task_start + warp + i·NA, NA ≤ the block's warps) through a
// ring of R stages, one stage = one 2D tensor-map box of 16 rows × 128·KPB bytes (KPB K-blocks of one tile,
// straight from the row-major weight; the map is built on the host, discrete/gemv.py), its completion tracked
// by one mbarrier per stage. Lane 0 issues the boxes R − 1 ahead, continuously across the warp's tasks, so no
// register holds bytes in flight and a warp's next task starts streaming while its current one computes. A box
// may run past its task's K range (KPB = 2 and an odd per-split K-block count): those bytes are not read.
// Measured on the H200 (docs/kernels-gemv.md "Kernels and the launch rule"): +3-5 points of bandwidth over
// the *_m1 ring on the long-task shapes, R = 2 fastest at every warp count (deeper: slower, as the cp.async ring).
// Shared memory per warp: R · (16 · 128 · KPB + 8) bytes (stages, then the R mbarriers), 128-byte aligned base.
__device__ __forceinline__ void qmk_mbar_init(qmk_u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Arrive once and expect `bytes` more transaction bytes in the current phase.
__device__ __forceinline__ void qmk_mbar_expect_tx(qmk_u32 bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Whether the phase with the given parity has completed (acquire at CTA scope: the TMA's bytes are visible).
__device__ __forceinline__ bool qmk_mbar_try_wait(qmk_u32 bar, qmk_u32 parity) {
    qmk_u32 ok;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
// 2D tensor-map copy global → shared: box at (c0 = innermost element, c1 = row), completion counted on bar.
// tmap: generic address of a CUtensorMap in global memory (written before the launch).
__device__ __forceinline__ void qmk_tma_load_2d(qmk_u32 dst, const void* tmap, int c0, int c1, qmk_u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

template <int KPB>
struct QmkGemvTma {
    static constexpr int PITCH = QMK_KBLK * KPB, STAGE = QMK_ROW_TILE * PITCH;  // bytes
    const void* tmap;
    qmk_u32 base, bars;           // this warp's stages and mbarriers (shared-window addresses)
    int R, S, per, nbox, stride, t_end;
    int it, ib, islot;            // issue cursor: task, box within it, ring slot
    int cslot;                    // consume cursor: ring slot
    qmk_u32 parity;               // bit i: the phase slot i completes next

    // Start of every launch (lane-uniform per warp): this warp's ring at smem + warp · R · STAGE (barriers after
    // all NA warps' stages), lane 0 initialises its R barriers, then the first R − 1 boxes are issued. Touches
    // only the weights (safe before a PDL wait). Warps ≥ na get no tasks.
    __device__ __forceinline__ void begin(const void* tmap_, qmk_u32 smem, int na, int R_, int K, int S_,
                                          QmkGemvSlice sl) {
        const int warp = threadIdx.x >> 5;
        tmap = tmap_;
        R = R_;
        S = S_;
        per = (K / QMK_KBLK) / S;
        nbox = (per + KPB - 1) / KPB;
        stride = na;
        it = sl.task_start + warp;
        t_end = warp < na ? sl.task_end : it;
        ib = islot = cslot = 0;
        parity = 0u;
        base = smem + warp * R * STAGE;
        bars = smem + na * R * STAGE + warp * R * 8;
        if (warp < na && (threadIdx.x & 31) == 0) {
            for (int i = 0; i < R; ++i) qmk_mbar_init(bars + 8 * i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
        for (int i = 0; i < R - 1; ++i) issue();
    }
    // Issue the next box of the warp's stream (nothing past its last task).
    __device__ __forceinline__ void issue() {
        if (it >= t_end) return;
        const int tile = it / S, split = it - tile * S;
        if ((threadIdx.x & 31) == 0) {
            qmk_mbar_expect_tx(bars + 8 * islot, STAGE);
            qmk_tma_load_2d(base + islot * STAGE, tmap, (split * per + ib * KPB) * QMK_KBLK, tile * QMK_ROW_TILE,
                            bars + 8 * islot);
        }
        islot = islot + 1 == R ? 0 : islot + 1;
        if (++ib == nbox) {
            ib = 0;
            it += stride;
        }
    }
};

// One task (16-row tile at row0, K-blocks [kb0, kb1)) from the TMA ring: the accumulator fragment as
// qmk_gemv_tile. Consumes the task's boxes in the ring's order (the caller walks its tasks in the issue order).
template <int KPB, int MC>
__device__ __forceinline__ void qmk_gemv_tile_tma(float (&acc)[4], QmkGemvTma<KPB>& q, const qmk_u16* scale,
                                                  const qmk_u16* x, int M_, int K, int row0, int kb0, int kb1) {
    constexpr int PITCH = QmkGemvTma<KPB>::PITCH, STAGE = QmkGemvTma<KPB>::STAGE;
    const int M = MC > 0 ? MC : M_;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const qmk_u16* srow = scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK);
    const bool xvalid = g < M;
    const qmk_u16* xrow = x + (size_t)qmk_gemv_xrow(g, M) * K;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    for (int kb = kb0; kb < kb1; kb += KPB) {
        __syncwarp();  // the slot refilled now was read by every lane (its mma.sync ran) before lane 0 reissues it
        q.issue();
        const qmk_u32 st = q.base + q.cslot * STAGE;
        const qmk_u32 bar = q.bars + 8 * q.cslot, par = (q.parity >> q.cslot) & 1u;
        q.parity ^= 1u << q.cslot;
        q.cslot = q.cslot + 1 == q.R ? 0 : q.cslot + 1;
        uint4 xv[KPB][4];  // every K-block's activation and scale issued before the wait (measured: loading the
        float sc[KPB];     // second block's after it cost 9 points on gate|up); past kb1: a repeat, unused
#pragma unroll
        for (int kk = 0; kk < KPB; ++kk) {
            const int k = kb + kk < kb1 ? kb + kk : kb1 - 1;
            qmk_gemv_load_x<QMK_W_FP8>(xv[kk], xrow, xvalid, k, c);
            sc[kk] = qmk_bf2f(__ldg(srow + k));
        }
        while (!qmk_mbar_try_wait(bar, par)) {
        }
#pragma unroll
        for (int kk = 0; kk < KPB; ++kk) {
            if (kk > 0 && kb + kk >= kb1) break;
            const qmk_u32 p = st + g * PITCH + kk * QMK_KBLK + 16 * c;
            uint4 w[4];
            w[0] = qmk_lds16(p);
            w[1] = qmk_lds16(p + 64);
            w[2] = qmk_lds16(p + 8 * PITCH);
            w[3] = qmk_lds16(p + 8 * PITCH + 64);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            qmk_gemv_unit_mma_x<QMK_W_FP8>(d, w, xv[kk]);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc[kk], d[j]));
        }
    }
}

// A whole slice with the TMA ring (after q.begin): the warp's tasks in issue order, partials out and, for
// epi ≥ 0, the fused reduce + epilogue (as qmk_gemv_slice_ring).
template <int KPB, int MC>
__device__ __forceinline__ void qmk_gemv_slice_tma(QmkGemvTma<KPB>& q, const qmk_u16* scale, const qmk_u16* x, int M_,
                                                   int N, int K, int S, QmkGemvSlice sl, float* P, int epi,
                                                   const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    const int M = MC > 0 ? MC : M_;
    const int per = (K / QMK_KBLK) / S;
    for (int t = sl.task_start + (int)(threadIdx.x >> 5); t < q.t_end; t += q.stride) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        float acc[4];
        qmk_gemv_tile_tma<KPB, MC>(acc, q, scale, x, M, K, row0, split * per, (split + 1) * per);
        qmk_gemv_store_partial(acc, P, M, N, split, row0);
        if (epi >= 0) qmk_gemv_finish_tile(P, S, M, N, epi, tile, counters, resid, out);
    }
}

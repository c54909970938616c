// gemv.cu — thin __global__ wrappers over gemv.cuh: one block per slice (grid = slices, one per SM), split-K
// partials through the shared-memory weight ring, optionally with the fused reduce + epilogue; and the
// standalone reduce + epilogue. PDL (discrete/launch.py, pdl.cuh): each wrapper lets its successor be scheduled
// and waits for its predecessor before touching x, P, out, resid or counters; the partial kernels first prefetch
// into L2 the first QMK_PDL_PREFETCH_UNITS weight units of each warp's first task (weights never depend on an
// earlier kernel), so that a kernel launched early streams weights while its predecessor drains.
#include "gemv.cuh"
#include "pdl.cuh"

#ifndef QMK_PDL_PREFETCH_UNITS
#define QMK_PDL_PREFETCH_UNITS 2  // weight units (2 KB per warp each) prefetched into L2 before the wait; 0 = none
#endif

// L2 prefetch of units u0 .. u0 + QMK_PDL_PREFETCH_UNITS - 1 (clamped to the task) of warp w's first task of
// slice sl: the lines qmk_gemv_load_unit reads (rows g and g + 8, 128 B each); lane (g, c) takes units u0 + c,
// u0 + c + 4, ... Touches only W and scale. Changes no result (a prefetch has no register output).
template <int WK>
__device__ __forceinline__ void qmk_gemv_pdl_prefetch(const void* W, const qmk_u16* scale, int K, int S,
                                                      QmkGemvSlice sl) {
#if QMK_PDL_PREFETCH_UNITS > 0
    constexpr int UPK = QmkGemvTraits<WK>::UPK, ES = QmkGemvTraits<WK>::ESIZE;
    const int t = sl.task_start + (int)(threadIdx.x >> 5);
    if (t >= sl.task_end) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tile = t / S, split = t - tile * S, per = (K / QMK_KBLK) / S;
    const int u0 = split * per * UPK, u1 = u0 + per * UPK;
    const int uend = u0 + QMK_PDL_PREFETCH_UNITS < u1 ? u0 + QMK_PDL_PREFETCH_UNITS : u1;
    const size_t rowbytes = (size_t)K * ES;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(tile * QMK_ROW_TILE + g) * rowbytes;
    for (int u = u0 + c; u < uend; u += 4) {
        const int kb = u / UPK, h = u - kb * UPK;
        const qmk_u8* p = rowg + (size_t)kb * QMK_KBLK * ES + 128 * h;
        qmk_prefetch_l2(p);
        qmk_prefetch_l2(p + 8 * rowbytes);
    }
    if (WK == QMK_W_FP8 && lane == 0)
        qmk_prefetch_l2(scale + (size_t)(tile * QMK_ROW_TILE / QMK_KBLK) * (K / QMK_KBLK) + u0);
#endif
}

// W [N, K] e4m3, scale [ceil(N/128), K/128] bf16, x [M, K] bf16, slices [grid] task ranges → P [S, M, N] fp32.
// ring: shared-memory ring depth R (2..8; 0 = register ring), dynamic shared memory min(warps, tasks per
// slice) · R · 2 KB. epi < 0: partials only; epi ≥ 0 (QMK_EPI_*): also the fused fixed-order reduce into
// out [M, Nout] bf16 (resid [M, N] or null, may alias out; counters uint32 [Nout/16], zero between launches).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_partial(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                 int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                 const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_FP8>(W, scale, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    qmk_gemv_slice_ring<QMK_W_FP8, QMK_GEMV_WARPS>(W, scale, x, M, N, K, S, slices[blockIdx.x], P, ring, epi, resid,
                                                   out, counters);
}

// W [N, K] bf16 (scale 1), otherwise as above.
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_BF16_WARPS, 1)
gemv_bf16_partial(const qmk_u16* __restrict__ W, const qmk_u16* x, int M, int N, int K, int S,
                  const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                  qmk_u16* out, unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_BF16>(W, nullptr, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    qmk_gemv_slice_ring<QMK_W_BF16, QMK_GEMV_BF16_WARPS>(W, nullptr, x, M, N, K, S, slices[blockIdx.x], P, ring, epi,
                                                         resid, out, counters);
}

// P [S, M, N] fp32 → out [M, Nout] bf16 (Nout = N, or N/2 for swiglu); resid [M, N] bf16 or null.
// out may alias resid (each element is read before it is written by the same thread).
extern "C" __global__ void __launch_bounds__(256)
gemv_reduce(const float* __restrict__ P, int S, int M, int N, int epi, const qmk_u16* resid, qmk_u16* out) {
    qmk_pdl_enter();
    const int nout = epi == QMK_EPI_SWIGLU ? N / 2 : N;
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= M * nout) return;
    const int m = i / nout, n = i - m * nout;
    out[i] = qmk_gemv_epilogue(epi, P, S, M, N, m, n, resid);
}

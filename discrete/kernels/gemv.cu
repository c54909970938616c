// gemv.cu — thin __global__ wrappers over gemv.cuh: one block per slice (grid = slices, one per SM), split-K
// partials through the shared-memory weight ring, optionally with the fused reduce + epilogue; and the
// standalone reduce + epilogue.
#include "gemv.cuh"

// W [N, K] e4m3, scale [ceil(N/128), K/128] bf16, x [M, K] bf16, slices [grid] task ranges → P [S, M, N] fp32.
// ring: shared-memory ring depth R (2..8; 0 = register ring), dynamic shared memory min(warps, tasks per
// slice) · R · 2 KB. epi < 0: partials only; epi ≥ 0 (QMK_EPI_*): also the fused fixed-order reduce into
// out [M, Nout] bf16 (resid [M, N] or null, may alias out; counters uint32 [Nout/16], zero between launches).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_partial(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                 int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                 const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    qmk_gemv_slice_ring<QMK_W_FP8, QMK_GEMV_WARPS>(W, scale, x, M, N, K, S, slices[blockIdx.x], P, ring, epi, resid,
                                                   out, counters);
}

// W [N, K] bf16 (scale 1), otherwise as above.
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_BF16_WARPS, 1)
gemv_bf16_partial(const qmk_u16* __restrict__ W, const qmk_u16* x, int M, int N, int K, int S,
                  const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                  qmk_u16* out, unsigned int* counters) {
    qmk_gemv_slice_ring<QMK_W_BF16, QMK_GEMV_BF16_WARPS>(W, nullptr, x, M, N, K, S, slices[blockIdx.x], P, ring, epi,
                                                         resid, out, counters);
}

// P [S, M, N] fp32 → out [M, Nout] bf16 (Nout = N, or N/2 for swiglu); resid [M, N] bf16 or null.
// out may alias resid (each element is read before it is written by the same thread).
extern "C" __global__ void __launch_bounds__(256)
gemv_reduce(const float* __restrict__ P, int S, int M, int N, int epi, const qmk_u16* resid, qmk_u16* out) {
    const int nout = epi == QMK_EPI_SWIGLU ? N / 2 : N;
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= M * nout) return;
    const int m = i / nout, n = i - m * nout;
    out[i] = qmk_gemv_epilogue(epi, P, S, M, N, m, n, resid);
}

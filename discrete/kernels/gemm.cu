// gemm.cu — thin __global__ wrappers over gemm.cuh: one block per BN × BM output tile (grid = N/BN (swiglu:
// 2F/BN) × ceil(M/BM) tiles, activation-row tiles fastest), one kernel per epilogue. PDL (discrete/launch.py,
// pdl.cuh): each wrapper lets its successor be scheduled, then waits for its predecessor before any load.
// Arguments: W [N, K] e4m3, scale [N/128, K/128] bf16, X [M, K] bf16, per = K-blocks per split-K split,
// resid [M, N] bf16 or null (residual; may alias out), out [M, Nout] bf16.
// qmk: arch sm_90 sm_90a
#include "gemm.cuh"
#include "pdl.cuh"

typedef QmkGemmTile<128, 128, 32, 64, QMK_GEMM_STAGES> QmkGemmT;  // BN, BM, WN, WM: 8 warps as 4 (n) × 2 (m)

// qmk: hot
extern "C" __global__ void __launch_bounds__(QmkGemmT::THREADS, 1)
gemm_fp8_store(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* X, int M, int N,
               int K, int per, const qmk_u16* resid, qmk_u16* out) {
    qmk_pdl_enter();
    qmk_gemm_block<QmkGemmT, QMK_EPI_STORE>(W, scale, X, M, N, K, per, resid, out, blockIdx.x);
}
// qmk: hot
extern "C" __global__ void __launch_bounds__(QmkGemmT::THREADS, 1)
gemm_fp8_residual(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* X, int M, int N,
                  int K, int per, const qmk_u16* resid, qmk_u16* out) {
    qmk_pdl_enter();
    qmk_gemm_block<QmkGemmT, QMK_EPI_RESIDUAL>(W, scale, X, M, N, K, per, resid, out, blockIdx.x);
}
// qmk: hot
extern "C" __global__ void __launch_bounds__(QmkGemmT::THREADS, 1)
gemm_fp8_swiglu(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* X, int M, int N,
                int K, int per, const qmk_u16* resid, qmk_u16* out) {
    qmk_pdl_enter();
    qmk_gemm_block<QmkGemmT, QMK_EPI_SWIGLU>(W, scale, X, M, N, K, per, resid, out, blockIdx.x);
}

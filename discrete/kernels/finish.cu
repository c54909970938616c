// finish.cu — the small glue kernels of the discrete decode step (discrete/step.py): the RMSNorm that the
// megakernel runs as a GEMV prologue, the segmented split-K reduce of a fused projection (q|k|v, qkv|z) into
// its per-segment output buffers, and the finish kernel that advances the control block so that one captured
// CUDA graph replays unchanged for every token (article Part 6.2).
//
// The control block's layout is the generated struct of control.h (from discrete.control.CONTROL_DTYPE, the
// one source of the layout); its update is finish.cuh, shared with the megakernel.
// qmk: defines discrete.step:compile_defines
#include "gemv.cuh"
#include "norm.cuh"
#include "finish.cuh"
#include "pdl.cuh"

#define QMK_NORM_THREADS 256

// (1+w) RMSNorm of M rows: x, y [M, n] bf16 (row stride n), w [n] bf16. grid 1, block QMK_NORM_THREADS.
// Same rounding points as assembler/ref/ops.py rmsnorm (norm.cuh); a row's result does not depend on M.
extern "C" __global__ void __launch_bounds__(QMK_NORM_THREADS)
qmk_rmsnorm_rows(const mx_u16* __restrict__ x, const mx_u16* __restrict__ w, mx_u16* __restrict__ y, int M, int n) {
    __shared__ double red[QMK_NORM_THREADS / 32];
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    mx_rmsnorm_rows<QMK_NORM_THREADS>(x, n, w, y, n, M, n, red);
}

// The same RMSNorm with one block per row (prefill, M up to thousands of rows): x, y [M, n], grid M. A row's result
// does not depend on M, so every row has the bits of qmk_rmsnorm_rows (and of the GEMV's fused norm prologue).
extern "C" __global__ void __launch_bounds__(QMK_NORM_THREADS)
qmk_rmsnorm_rows_grid(const mx_u16* __restrict__ x, const mx_u16* __restrict__ w, mx_u16* __restrict__ y, int n) {
    __shared__ double red[QMK_NORM_THREADS / 32];
    const size_t r = blockIdx.x;
    mx_rmsnorm_rows<QMK_NORM_THREADS>(x + r * n, n, w, y + r * n, n, 1, n, red);
}

// Fixed-order reduce (store epilogue) of P [S, M, N] fp32 — the partials of a row-fused projection — into up to
// three outputs: columns [c0_s, c0_s + n_s) go to out_s [M, n_s] bf16 (n_s = 0: unused). grid ceil(M·N/256).
extern "C" __global__ void __launch_bounds__(256)
qmk_reduce_segments(const float* __restrict__ P, int S, int M, int N, int c1, int c2, qmk_u16* out0, qmk_u16* out1,
                    qmk_u16* out2) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= M * N) return;
    const int m = i / N, n = i - m * N;
    const qmk_u16 v = qmk_gemv_epilogue(QMK_EPI_STORE, P, S, M, N, m, n, nullptr);
    if (n < c1) out0[(size_t)m * c1 + n] = v;
    else if (n < c2) out1[(size_t)m * (c2 - c1) + (n - c1)] = v;
    else out2[(size_t)m * (N - c2) + (n - c2)] = v;
}

// End of a step of M rows (qmk_finish_step, finish.cuh): step += 1; pos += M; out_token = ids[M-1] (argmax of the last
// row); tokens[0] = out_token (the next step's input; teacher-forced / verify rows are written by the host
// before the next replay); stop = 1 when out_token is an eos id or pos reaches max_pos (never cleared here).
extern "C" __global__ void __launch_bounds__(32)
qmk_finish(unsigned int* __restrict__ ctrl, const int* __restrict__ ids, int M) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    if (threadIdx.x == 0) qmk_finish_step(reinterpret_cast<QmkControl*>(ctrl), ids, M);
}

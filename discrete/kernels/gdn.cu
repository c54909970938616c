// gdn.cu — discrete-path wrapper: one block per GDN value head (gdn.cuh). Launch: grid QMK_GDN_NV,
// block MX_GDN_THREADS, static shared memory MxGdnSmem. pos is read from device memory (graph-friendly).
#include "gdn.cuh"
#include "pdl.cuh"

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_GDN_THREADS, 1)
qmk_gdn_decode(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z, const mx_u16* __restrict__ hn,
               const mx_u16* __restrict__ w_a, const mx_u16* __restrict__ w_b, const mx_u16* __restrict__ a_log,
               const mx_u16* __restrict__ dt_bias, const mx_u16* __restrict__ conv_w,
               const mx_u16* __restrict__ norm_w, mx_u16* __restrict__ ring, float* __restrict__ state,
               mx_u16* __restrict__ out, const int* __restrict__ pos_ptr, int M) {
    __shared__ MxGdnSmem sm;
    qmk_pdl_launch_dependents();
    MxGdnPre pre;  // the head's weights: loads issued before the wait (pdl.cuh's rule: weights only)
    mx_gdn_prefetch(w_a, w_b, a_log, dt_bias, conv_w, norm_w, blockIdx.x, pre);
    qmk_pdl_wait();
    mx_gdn_step_head_pre<MX_GDN_CPW>(qkv, z, hn, ring, state, out, *pos_ptr, M, blockIdx.x, pre, sm);
}

// Prefill of T rows at positions pos..pos+T-1 (host-side pos: prefill is launched eagerly): the decode step's
// function over row tiles of QMK_MAX_ROWS, in order, the head's state kept in the block (global memory written and
// re-read by the same threads). Row tile t reads the conv inputs of earlier rows of this launch from qkv, those
// before pos from the ring, and writes nothing to the ring; run qmk_gdn_ring_fill after it. Every row gets the bits
// of the decode step's (the same device function, the same operation order). Grid QMK_GDN_NV, block MX_GDN_THREADS.
extern "C" __global__ void __launch_bounds__(MX_GDN_THREADS, 1)
qmk_gdn_prefill(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z, const mx_u16* __restrict__ hn,
                const mx_u16* __restrict__ w_a, const mx_u16* __restrict__ w_b, const mx_u16* __restrict__ a_log,
                const mx_u16* __restrict__ dt_bias, const mx_u16* __restrict__ conv_w,
                const mx_u16* __restrict__ norm_w, mx_u16* __restrict__ ring, float* __restrict__ state,
                mx_u16* __restrict__ out, int pos, int T) {
    __shared__ MxGdnSmem sm;
    for (int t0 = 0; t0 < T; t0 += QMK_MAX_ROWS) {
        MxGdnPre pre;  // reloaded per tile (cache hits): kept live across the loop it would spill
        mx_gdn_prefetch(w_a, w_b, a_log, dt_bias, conv_w, norm_w, blockIdx.x, pre);
        const int M = T - t0 < QMK_MAX_ROWS ? T - t0 : QMK_MAX_ROWS;
        mx_gdn_step_head_pre<2>(qkv + (size_t)t0 * QMK_GDN_CONV_DIM, z + (size_t)t0 * QMK_GDN_VALUE_DIM,
                                         hn + (size_t)t0 * QMK_HIDDEN, ring, state,
                                         out + (size_t)t0 * QMK_GDN_VALUE_DIM, pos + t0, M, blockIdx.x, pre, sm,
                                         nullptr, t0, false);
        __syncthreads();  // the next tile rewrites the shared staging the last phase of this one reads
    }
}

// The conv ring as the decode steps of positions pos..pos+T-1 leave it: the input row of position p in slot
// p % QMK_CONV_RING, for the last min(T, QMK_CONV_RING) positions (older slots keep their contents, as in decode).
// qkv [T, CONV_DIM] bf16. Grid (min(T, QMK_CONV_RING)), block 256.
extern "C" __global__ void __launch_bounds__(256)
qmk_gdn_ring_fill(const mx_u16* __restrict__ qkv, mx_u16* __restrict__ ring, int pos, int T) {
    const int n = T < QMK_CONV_RING ? T : QMK_CONV_RING;
    const int r = T - n + blockIdx.x;  // row of this block
    const mx_u16* src = qkv + (size_t)r * QMK_GDN_CONV_DIM;
    mx_u16* dst = ring + (size_t)((pos + r) % QMK_CONV_RING) * QMK_GDN_CONV_DIM;
    for (int c = threadIdx.x; c < QMK_GDN_CONV_DIM; c += 256) dst[c] = src[c];
}

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
    MX_GDN_STAMP(0);
    qmk_pdl_launch_dependents();
    MxGdnPre pre;  // the head's weights: loads issued before the wait (pdl.cuh's rule: weights only)
    mx_gdn_prefetch(w_a, w_b, a_log, dt_bias, conv_w, norm_w, blockIdx.x, pre);
    qmk_pdl_wait();
    MX_GDN_STAMP(1);
    mx_gdn_step_head_pre<MX_GDN_CPW>(qkv, z, hn, ring, state, out, *pos_ptr, M, blockIdx.x, pre, sm);
}

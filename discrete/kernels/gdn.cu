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

// Prefill of T rows at positions pos..pos+T-1 (host-side pos: prefill is launched eagerly): the decode step's three
// phases (gdn.cuh) in three kernels, on row tiles of QMK_MAX_ROWS, so that only the recurrence runs row after row:
//   qmk_gdn_prefill_in     grid (tiles, NV), block MX_GDN_THREADS: phase A of tile z for head j, all tiles at once.
//                          Tile z reads the conv inputs of earlier rows of this launch from qkv, those before pos from
//                          the ring, and writes nothing to the ring (run qmk_gdn_ring_fill after). Its shared-memory
//                          result (qk, v, ab, decay, beta | zs) -> rows[z][j] (MX_GDN_ROWS_F4 float4).
//   qmk_gdn_prefill_recur  grid (NV, MX_GDN_SPLIT), block MX_GDN_RTHREADS: phase B over the tiles in order for
//                          MX_GDN_RCPW state columns per warp, the state in registers throughout; o_raw [T, VALUE_DIM]
//                          fp32 (bf16 values) gets S^T q.
//   qmk_gdn_prefill_out    grid (tiles, NV), block 256: phase C of tile z for head j -> out [T, VALUE_DIM] bf16.
// Every value passes through global memory unchanged between the phases, and a state column's arithmetic does not
// depend on the warp or block that runs it, so every row gets the bits of the decode step's.
// qk, v, ab, decay, beta: the float fields MxGdnSmem starts with (no padding), in float4
#define MX_GDN_IN_F4 (QMK_MAX_ROWS * (2 * QMK_GDN_DK + QMK_GDN_DV + 2 * MX_GDN_NKB + 2) / 4)
#define MX_GDN_ZS_F4 ((QMK_MAX_ROWS + 1) * 32)                    // zs: silu(z) per row, the norm weights
#define MX_GDN_ROWS_F4 (MX_GDN_IN_F4 + MX_GDN_ZS_F4)
#define MX_GDN_SPLIT 4                                            // recurrence blocks per value head
#define MX_GDN_RTHREADS 256
#define MX_GDN_RCPW (QMK_GDN_DV / (MX_GDN_SPLIT * (MX_GDN_RTHREADS / 32)))  // state columns per recurrence warp
static_assert(QMK_MAX_ROWS * (2 * QMK_GDN_DK + QMK_GDN_DV + 2 * MX_GDN_NKB + 2) % 4 == 0 &&
              sizeof(MxGdnSmem) == 16 * MX_GDN_IN_F4 + sizeof(float) * QMK_MAX_ROWS * QMK_GDN_DV + 16 * MX_GDN_ZS_F4,
              "gdn.cu: MxGdnSmem is expected as qk, v, ab, decay, beta (the phase-A region), o, zs, unpadded");
static_assert(QMK_GDN_DV % (MX_GDN_SPLIT * (MX_GDN_RTHREADS / 32)) == 0, "gdn.cu: recurrence column split");
// Read by discrete/prefill.py (RawModule.get_global): the sizes its scratch and launches need.
extern "C" __constant__ int qmk_gdn_prefill_geometry[3] = {MX_GDN_ROWS_F4, MX_GDN_SPLIT, MX_GDN_RTHREADS};

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_GDN_THREADS, 1)
qmk_gdn_prefill_in(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z, const mx_u16* __restrict__ hn,
                   const mx_u16* __restrict__ w_a, const mx_u16* __restrict__ w_b, const mx_u16* __restrict__ a_log,
                   const mx_u16* __restrict__ dt_bias, const mx_u16* __restrict__ conv_w,
                   const mx_u16* __restrict__ norm_w, mx_u16* __restrict__ ring, float4* __restrict__ rows, int pos,
                   int T) {
    __shared__ MxGdnSmem sm;
    const int t0 = blockIdx.x * QMK_MAX_ROWS, j = blockIdx.y;
    const int M = T - t0 < QMK_MAX_ROWS ? T - t0 : QMK_MAX_ROWS;
    MxGdnPre pre;
    mx_gdn_prefetch(w_a, w_b, a_log, dt_bias, conv_w, norm_w, j, pre);
    mx_gdn_rows_in<2, QMK_MAX_ROWS, 0>(qkv + (size_t)t0 * QMK_GDN_CONV_DIM, z + (size_t)t0 * QMK_GDN_VALUE_DIM,
                                       hn + (size_t)t0 * QMK_HIDDEN, ring, nullptr, nullptr, pos + t0, M, j, pre, sm,
                                       t0, false, threadIdx.x, threadIdx.x & 31, threadIdx.x >> 5,
                                       j / QMK_GDN_HEAD_GROUP, (j % QMK_GDN_HEAD_GROUP) == 0);
    float4* dst = rows + ((size_t)blockIdx.x * QMK_GDN_NV + j) * MX_GDN_ROWS_F4;
    const float4* a = reinterpret_cast<const float4*>(&sm);
    for (int e = threadIdx.x; e < MX_GDN_IN_F4; e += MX_GDN_THREADS) dst[e] = a[e];
    for (int e = threadIdx.x; e < MX_GDN_ZS_F4; e += MX_GDN_THREADS) dst[MX_GDN_IN_F4 + e] = (&sm.zs[0][0])[e];
}

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_GDN_RTHREADS, 1)
qmk_gdn_prefill_recur(const float4* __restrict__ rows, float* __restrict__ state, float* __restrict__ o_raw, int T) {
    __shared__ MxGdnSmem sm;
    const int j = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col0 = (blockIdx.y * (MX_GDN_RTHREADS / 32) + warp) * MX_GDN_RCPW;
    float4 S[MX_GDN_RCPW];
    float* st = state + ((size_t)j * QMK_GDN_DV + col0) * QMK_GDN_DK + lane * 4;
#pragma unroll
    for (int c = 0; c < MX_GDN_RCPW; ++c) S[c] = *reinterpret_cast<const float4*>(st + c * QMK_GDN_DK);
    float4* a = reinterpret_cast<float4*>(&sm);
    for (int t0 = 0; t0 < T; t0 += QMK_MAX_ROWS) {
        const int M = T - t0 < QMK_MAX_ROWS ? T - t0 : QMK_MAX_ROWS;
        const float4* src = rows + ((size_t)(t0 / QMK_MAX_ROWS) * QMK_GDN_NV + j) * MX_GDN_ROWS_F4;
        __syncthreads();  // the previous tile's readers are done with sm
        for (int e = threadIdx.x; e < MX_GDN_IN_F4; e += MX_GDN_RTHREADS) a[e] = src[e];
        __syncthreads();
        float* o = o_raw + (size_t)t0 * QMK_GDN_VALUE_DIM + (size_t)j * QMK_GDN_DV;
        mx_gdn_rows_recur<MX_GDN_RCPW, MX_GDN_RCPW, false>(S, sm, M, col0, lane, o, QMK_GDN_VALUE_DIM);
    }
#pragma unroll
    for (int c = 0; c < MX_GDN_RCPW; ++c) *reinterpret_cast<float4*>(st + c * QMK_GDN_DK) = S[c];
}

// qmk: hot
extern "C" __global__ void __launch_bounds__(256)
qmk_gdn_prefill_out(const float4* __restrict__ rows, const float* __restrict__ o_raw, mx_u16* __restrict__ out,
                    int T) {
    __shared__ MxGdnSmem sm;
    const int t0 = blockIdx.x * QMK_MAX_ROWS, j = blockIdx.y;
    const int M = T - t0 < QMK_MAX_ROWS ? T - t0 : QMK_MAX_ROWS;
    const float4* src = rows + ((size_t)blockIdx.x * QMK_GDN_NV + j) * MX_GDN_ROWS_F4 + MX_GDN_IN_F4;
    for (int e = threadIdx.x; e < MX_GDN_ZS_F4; e += 256) (&sm.zs[0][0])[e] = src[e];
    for (int e = threadIdx.x; e < M * QMK_GDN_DV; e += 256)
        sm.o[e / QMK_GDN_DV][e % QMK_GDN_DV] =
            o_raw[(size_t)(t0 + e / QMK_GDN_DV) * QMK_GDN_VALUE_DIM + (size_t)j * QMK_GDN_DV + e % QMK_GDN_DV];
    __syncthreads();
    mx_gdn_rows_out(sm, out + (size_t)t0 * QMK_GDN_VALUE_DIM, M, j, threadIdx.x & 31, threadIdx.x >> 5);
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

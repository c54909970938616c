// attention.cu — discrete-path wrappers for the four attention stages (attention.cuh).
// Launches (pos read from device memory, so a captured graph replays unchanged):
//   qmk_attn_prep    grid (M, NQ + NKV), block 32
//   qmk_attn_scores  grid (P, NKV), block MX_ATT_SC_THREADS
//   qmk_attn_values  grid (P, NKV), block MX_ATT_THREADS
//   qmk_attn_reduce  grid (M, NQ), block HD
// Prefill (discrete/prefill.py) launches prep and reduce over all rows of a chunk (both index rows relative to
// the pointers and take position pos + row) and the two stages between them over many 8-row tiles at once:
//   qmk_attn_scores_rows / qmk_attn_values_rows  grid (P, NKV, tiles): tile z = rows 8z .. 8z+7 of the pointers,
//   at position *pos_ptr + 8z, the same device function with the same per-tile operands as a decode pass of
//   those 8 rows (scratch row-major [rows, ...], so tile z's slices start at row 8z), hence the same bits.
#include "attention.cuh"
#include "pdl.cuh"

extern "C" __global__ void __launch_bounds__(32)
qmk_attn_prep(const mx_u16* __restrict__ qg, const mx_u16* __restrict__ k, const mx_u16* __restrict__ v,
              const mx_u16* __restrict__ q_norm_w, const mx_u16* __restrict__ k_norm_w,
              const float* __restrict__ inv_freq, const int* __restrict__ page_table, long long page_stride,
              mx_u16* __restrict__ kv, mx_u16* __restrict__ q_out, const int* __restrict__ pos_ptr) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    mx_attn_prep(qg, k, v, q_norm_w, k_norm_w, inv_freq, page_table, page_stride, kv, q_out, *pos_ptr,
                 blockIdx.x, blockIdx.y);
}

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_ATT_SC_THREADS, 1)
qmk_attn_scores(const mx_u16* __restrict__ q, const mx_u16* __restrict__ kv, const int* __restrict__ page_table,
                long long page_stride, mx_u16* __restrict__ scores, int cap, float* __restrict__ stats_m,
                float* __restrict__ stats_l, const int* __restrict__ pos_ptr, int M) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    mx_attn_scores_t<MX_ATT_SC_THREADS, true>(q, kv, page_table, page_stride, scores, cap, stats_m, stats_l, *pos_ptr,
                                              M, blockIdx.x, blockIdx.y);
}

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_ATT_THREADS, 1)
qmk_attn_values(const mx_u16* __restrict__ kv, const int* __restrict__ page_table, long long page_stride,
                const mx_u16* __restrict__ scores, int cap, const float* __restrict__ stats_m,
                const float* __restrict__ stats_l, float* __restrict__ partial, const int* __restrict__ pos_ptr,
                int M) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    __shared__ MxAttnValSmemWide sm;
    mx_attn_values(kv, page_table, page_stride, scores, cap, stats_m, stats_l, partial, *pos_ptr, M, blockIdx.x,
                   blockIdx.y, sm);
}

extern "C" __global__ void __launch_bounds__(MX_HD)
qmk_attn_reduce(const float* __restrict__ partial, const mx_u16* __restrict__ qg, mx_u16* __restrict__ out,
                const int* __restrict__ pos_ptr) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    mx_attn_reduce(partial, qg, out, *pos_ptr, blockIdx.x, blockIdx.y);
}

// Tile z of a rows-long batch: rows 8z .. min(8z + 8, rows) - 1 of every row-major operand.
__device__ __forceinline__ int mx_tile_rows(int rows, int z) { return min(QMK_MAX_ROWS, rows - z * QMK_MAX_ROWS); }

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_ATT_SC_THREADS, 1)
qmk_attn_scores_rows(const mx_u16* __restrict__ q, const mx_u16* __restrict__ kv, const int* __restrict__ page_table,
                     long long page_stride, mx_u16* __restrict__ scores, int cap, float* __restrict__ stats_m,
                     float* __restrict__ stats_l, const int* __restrict__ pos_ptr, int rows) {
    const size_t r0 = (size_t)blockIdx.z * QMK_MAX_ROWS;
    const size_t st = r0 * QMK_N_Q_HEADS * QMK_ATTN_PARTS;
    mx_attn_scores_t<MX_ATT_SC_THREADS, true>(q + r0 * QMK_N_Q_HEADS * MX_HD, kv, page_table, page_stride,
                                              scores + r0 * QMK_N_Q_HEADS * (size_t)cap, cap, stats_m + st,
                                              stats_l + st, *pos_ptr + (int)r0, mx_tile_rows(rows, blockIdx.z),
                                              blockIdx.x, blockIdx.y);
}

// qmk: hot
extern "C" __global__ void __launch_bounds__(MX_ATT_THREADS, 1)
qmk_attn_values_rows(const mx_u16* __restrict__ kv, const int* __restrict__ page_table, long long page_stride,
                     const mx_u16* __restrict__ scores, int cap, const float* __restrict__ stats_m,
                     const float* __restrict__ stats_l, float* __restrict__ partial, const int* __restrict__ pos_ptr,
                     int rows) {
    __shared__ MxAttnValSmemWide sm;
    const size_t r0 = (size_t)blockIdx.z * QMK_MAX_ROWS;
    const size_t st = r0 * QMK_N_Q_HEADS * QMK_ATTN_PARTS;
    mx_attn_values(kv, page_table, page_stride, scores + r0 * QMK_N_Q_HEADS * (size_t)cap, cap, stats_m + st,
                   stats_l + st, partial + st * MX_HD, *pos_ptr + (int)r0, mx_tile_rows(rows, blockIdx.z), blockIdx.x,
                   blockIdx.y, sm);
}

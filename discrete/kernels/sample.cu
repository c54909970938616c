// sample.cu — the __global__ wrapper over sample.cuh: one token drawn on the GPU from one row of bf16 logits
// (discrete/sampling.py launches it cooperatively, after the step that wrote the logits).
#include "sample.cuh"

extern "C" __global__ void __launch_bounds__(QMK_SAMPLE_THREADS)
qmk_sample(const qmk_u16* __restrict__ lg, int V, int n_valid, float temp, int scale, int top_k, float top_p_thr,
           int use_top_p, double u, qmk_u64* ws, int* out) {
    qmk_sample_row(lg, V, n_valid, temp, scale, top_k, top_p_thr, use_top_p, u, ws, out);
}

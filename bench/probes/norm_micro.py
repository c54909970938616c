"""Clock the block-wide RMSNorm pieces of norm.cuh alone (session 8 probe): why does mx_block_sumsq over 5,120
bf16 take 4.5-7.7 k cycles inside the megakernel's GDN step (bench/probes/run12/)? One 512-thread block per SM
(132 blocks, like the megakernel), each timing REPS back-to-back calls with clock64 on thread 0; variants:
``sumsq`` (norm.cuh as is), ``sumsq_f32`` (the same loop accumulating in fp32: not our numerics, a cost probe),
``rows`` (mx_rmsnorm_rows into shared memory), ``loads`` (the loads + an integer xor only), ``rows_elementwise``
(mx_rmsnorm_rows as it was before session 8: element by element, x read twice).
``python3 -m bench.probes.norm_micro [--out DIR]`` (device). Prints cycles per call (median over blocks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SRC = r'''
#define QMK_RMS_EPS 1e-6f
#include "norm.cuh"
#define NT 512
#define N 5120
__device__ __forceinline__ double f32_sumsq(const mx_u16* __restrict__ x, int n, double* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += NT) { const float d = mx_bf2f(x[i]); s = __fmaf_rn(d, d, s); }
    s = mx_warp_sum(s);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    double t = red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) t = __dadd_rn(t, red[w]);
    return t;
}
template <int NT_>
__device__ void rows_elementwise(const mx_u16* __restrict__ x, const mx_u16* __restrict__ w, mx_u16* __restrict__ y,
                                 int n, double* red) {  // norm.cuh's mx_rmsnorm_rows before session 8, one row
    const float rstd = mx_block_rstd<NT_>(x, n, red);
    for (int i = threadIdx.x; i < n; i += NT_) y[i] = mx_norm1pw(x[i], rstd, w[i]);
}
__device__ __forceinline__ double loads_only(const mx_u16* __restrict__ x, int n, double* red) {
    unsigned s = 0;
    for (int i = threadIdx.x; i < n; i += NT) s ^= x[i];
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    return red[0];
}
extern "C" __global__ void __launch_bounds__(NT, 1) probe(const mx_u16* x, const mx_u16* w, long long* out,
                                                           double* sink, int reps, int variant) {
    __shared__ double red[NT / 32];
    __shared__ mx_u16 y[N];
    const mx_u16* xb = x + (size_t)blockIdx.x * N;
    double acc = 0;
    __syncthreads();
    const long long t0 = clock64();
    for (int r = 0; r < reps; ++r) {
        const mx_u16* xr = xb + (size_t)(r & 1) * 132 * N;  // alternate two rows: hot in L1 after the first pass
        if (variant == 0) acc += mx_block_sumsq<NT>(xr, N, red);
        else if (variant == 1) acc += f32_sumsq(xr, N, red);
        else if (variant == 2) { mx_rmsnorm_rows<NT>(xr, N, w, y, N, 1, N, red); __syncthreads(); acc += y[r]; }
        else if (variant == 3) acc += loads_only(xr, N, red);
        else { rows_elementwise<NT>(xr, w, y, N, red); __syncthreads(); acc += y[r]; }
    }
    const long long t1 = clock64();
    if (threadIdx.x == 0) { out[blockIdx.x] = t1 - t0; sink[blockIdx.x] = acc; }
}
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=64)
    a = ap.parse_args(argv)
    import cupy as cp
    import numpy as np
    kdir = Path(__file__).resolve().parents[2] / "discrete" / "kernels"
    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-I{kdir}", "-lineinfo"))
    k = mod.get_function("probe")
    rng = np.random.default_rng(0)
    x = cp.asarray((rng.standard_normal(2 * 132 * 5120).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    w = cp.asarray((rng.standard_normal(5120).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    out = cp.zeros(132, cp.int64)
    sink = cp.zeros(132, cp.float64)
    res = {}
    for v, name in enumerate(("sumsq", "sumsq_f32", "rows", "loads", "rows_elementwise")):
        for reps in (1, a.reps):
            k((132,), (512,), (x, w, out, sink, np.int32(reps), np.int32(v)))
            cp.cuda.Device().synchronize()
            res[f"{name}_reps{reps}"] = float(np.median(out.get())) / reps
    print(json.dumps(res, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "norm_micro.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

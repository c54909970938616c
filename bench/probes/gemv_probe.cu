// gemv_probe.cu — diagnostic kernels for the GEMV bandwidth ceiling (issue 5; docs/kernels-gemv.md "run 6").
// Not used by the engine. Included after discrete/kernels/gemv.cuh (the production device functions).
//
//   probe_stream      contiguous read, one chunk per block, D 16-byte loads in flight per lane (the ceiling of a
//                     launch of this size, launch + ramp + tail included)
//   probe_tile_read   the GEMV's exact access pattern (16-row tiles, 4 chunks per lane per K-block) with no
//                     tensor-core work, D units in flight per warp: does the pattern or the arithmetic limit?
//   probe_gemv_timed  the production register-ring GEMV (qmk_gemv_tile) with %globaltimer stamps per warp
//                     (start, end): is the launch's time set by stragglers?
//   probe_gemv_dyn    the production tile, tasks taken from a global ticket (dynamic), warps reset the ticket
//                     at the end: bit-identical partials, different order of work
#include "gemv.cuh"

__device__ __forceinline__ qmk_u64 probe_clock() {
    qmk_u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

template <int D>
__device__ __forceinline__ void probe_stream_body(const qmk_u8* base, size_t nbytes, unsigned* sink) {
    const size_t per = (nbytes / gridDim.x) & ~(size_t)15;
    const size_t s = (size_t)blockIdx.x * per, e = blockIdx.x + 1 == gridDim.x ? nbytes : s + per;
    const size_t step = (size_t)blockDim.x * 16;
    unsigned acc = 0;
    size_t off = s + (size_t)threadIdx.x * 16;
    for (; off + (D - 1) * step < e; off += D * step) {
        uint4 v[D];
#pragma unroll
        for (int j = 0; j < D; ++j) v[j] = qmk_ld_stream16(base + off + j * step);
#pragma unroll
        for (int j = 0; j < D; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; off < e; off += step) {
        uint4 v = qmk_ld_stream16(base + off);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; practically never stores
}

extern "C" __global__ void __launch_bounds__(1024, 1) probe_stream4(const qmk_u8* base, size_t nbytes, unsigned* sink) {
    probe_stream_body<4>(base, nbytes, sink);
}
extern "C" __global__ void __launch_bounds__(1024, 1) probe_stream8(const qmk_u8* base, size_t nbytes, unsigned* sink) {
    probe_stream_body<8>(base, nbytes, sink);
}

// The GEMV access pattern, XOR instead of mma. Unit = one K-block of a 16-row tile (4 × 16 B per lane).
template <int D>
__device__ __forceinline__ void probe_tile_body(const qmk_u8* W, int K, int S, const QmkGemvSlice* slices,
                                                unsigned* sink) {
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int per = (K / QMK_KBLK) / S;
    unsigned acc = 0;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S;
        const qmk_u8* rowg = W + (size_t)(tile * 16 + g) * K;
        const size_t row8 = 8 * (size_t)K;
        const int u0 = split * per, u1 = u0 + per;
        uint4 w[D][4];
#pragma unroll
        for (int i = 0; i < D - 1; ++i)
            if (u0 + i < u1) qmk_gemv_load_unit<QMK_W_FP8>(w[i], rowg, row8, u0 + i, c);
        for (int ub = u0; ub < u1; ub += D) {
#pragma unroll
            for (int i = 0; i < D; ++i) {
                const int u = ub + i;
                if (u >= u1) break;
                if (u + D - 1 < u1) qmk_gemv_load_unit<QMK_W_FP8>(w[(i + D - 1) % D], rowg, row8, u + D - 1, c);
#pragma unroll
                for (int j = 0; j < 4; ++j) acc ^= w[i][j].x ^ w[i][j].y ^ w[i][j].z ^ w[i][j].w;
            }
        }
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(896, 1) probe_tile_read2(const qmk_u8* W, int K, int S,
                                                                       const QmkGemvSlice* slices, unsigned* sink) {
    probe_tile_body<2>(W, K, S, slices, sink);
}
extern "C" __global__ void __launch_bounds__(768, 1) probe_tile_read4(const qmk_u8* W, int K, int S,
                                                                       const QmkGemvSlice* slices, unsigned* sink) {
    probe_tile_body<4>(W, K, S, slices, sink);
}

// Production tile, timed per warp: stamps[2·(block·NW + warp) + {0, 1}] = globaltimer at start / end (0: idle).
extern "C" __global__ void __launch_bounds__(896, 1) probe_gemv_timed(const qmk_u8* W, const qmk_u16* scale,
                                                                       const qmk_u16* x, int M, int N, int K, int S,
                                                                       const QmkGemvSlice* slices, float* P,
                                                                       qmk_u64* stamps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const qmk_u64 t0 = probe_clock();
    qmk_gemv_slice<QMK_W_FP8, 28>(W, scale, x, M, N, K, S, slices[blockIdx.x], P);
    const qmk_u64 t1 = probe_clock();
    if (lane == 0) {
        stamps[2 * (blockIdx.x * 28 + warp)] = t0;
        stamps[2 * (blockIdx.x * 28 + warp) + 1] = t1;
    }
}

// Dynamic tasks: each warp takes task numbers from ticket[0]; the last warp out resets ticket[0..1] to 0.
// total_warps = gridDim.x · warps per block.
template <int WK>
__device__ __forceinline__ void probe_dyn_body(const void* W, const qmk_u16* scale, const qmk_u16* x, int M, int N,
                                               int K, int S, int T, float* P, unsigned* ticket) {
    const int lane = threadIdx.x & 31;
    const int per = (K / QMK_KBLK) / S;
    const unsigned total_warps = gridDim.x * (blockDim.x >> 5);
    for (;;) {
        int t = 0;
        if (lane == 0) t = (int)atomicAdd(ticket, 1u);
        t = __shfl_sync(0xFFFFFFFFu, t, 0);
        if (t >= T) break;
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        float acc[4];
        qmk_gemv_tile<WK>(acc, W, scale, x, M, K, row0, split * per, (split + 1) * per);
        qmk_gemv_store_partial(acc, P, M, N, split, row0);
    }
    if (lane == 0) {
        if (atomicAdd(ticket + 1, 1u) == total_warps - 1) {  // every warp has drawn past T: reset for next launch
            ticket[0] = 0u;
            ticket[1] = 0u;
        }
    }
}

extern "C" __global__ void __launch_bounds__(896, 1) probe_gemv_dyn(const qmk_u8* W, const qmk_u16* scale,
                                                                     const qmk_u16* x, int M, int N, int K, int S,
                                                                     int T, float* P, unsigned* ticket) {
    probe_dyn_body<QMK_W_FP8>(W, scale, x, M, N, K, S, T, P, ticket);
}
extern "C" __global__ void __launch_bounds__(512, 2) probe_gemv_dyn512(const qmk_u8* W, const qmk_u16* scale,
                                                                        const qmk_u16* x, int M, int N, int K, int S,
                                                                        int T, float* P, unsigned* ticket) {
    probe_dyn_body<QMK_W_FP8>(W, scale, x, M, N, K, S, T, P, ticket);
}

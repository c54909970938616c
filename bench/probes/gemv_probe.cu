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
#include "gemv.cu"  // the production kernels too (session 4: launched directly by --ring)

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

// ---------------------------------------------------------------- session 4: per-row run length
// Is the tile's DRAM efficiency set by how many contiguous bytes of a row are requested together? A warp owns a
// 16-row task (the production partition); a batch covers RUN contiguous bytes of each of the 16 rows, and each
// warp load instruction covers 512 contiguous bytes (512/RUN rows × RUN bytes; RUN ≥ 512: one row). D batches
// in flight per warp. probe_run_reg: loads into registers (rolling); probe_run_cp: cp.async into a per-warp
// shared-memory ring (D slots of 16·RUN bytes; each lane reads back its own chunks). XOR instead of mma.
template <int RUN>
__device__ __forceinline__ const qmk_u8* probe_run_addr(const qmk_u8* tile, int K, int kbyte, int i, int lane) {
    constexpr int CPR = RUN / 16;  // 16-byte chunks per row per batch
    const int f = i * 32 + lane, r = f / CPR, q = f - r * CPR;
    return tile + (size_t)r * K + kbyte + 16 * q;
}

template <int RUN, int D>
__device__ __forceinline__ void probe_run_reg_body(const qmk_u8* W, int K, int S, const QmkGemvSlice* slices,
                                                   unsigned* sink) {
    constexpr int NL = RUN / 32;  // loads per lane per batch (16 rows × RUN bytes / 512)
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int span = K / S;  // bytes per row per task
    unsigned acc = 0;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S;
        const qmk_u8* base = W + (size_t)tile * 16 * K;
        const int k0 = split * span, nb = (span + RUN - 1) / RUN;
        uint4 w[D][NL];
#pragma unroll
        for (int b = 0; b < D - 1; ++b)
            if (b < nb)
#pragma unroll
                for (int i = 0; i < NL; ++i) w[b][i] = qmk_ld_stream16(probe_run_addr<RUN>(base, K, k0 + b * RUN, i, lane));
        for (int bb = 0; bb < nb; bb += D) {
#pragma unroll
            for (int j = 0; j < D; ++j) {
                const int b = bb + j;
                if (b >= nb) break;
                if (b + D - 1 < nb)
#pragma unroll
                    for (int i = 0; i < NL; ++i)
                        w[(j + D - 1) % D][i] = qmk_ld_stream16(probe_run_addr<RUN>(base, K, k0 + (b + D - 1) * RUN, i, lane));
#pragma unroll
                for (int i = 0; i < NL; ++i) acc ^= w[j][i].x ^ w[j][i].y ^ w[j][i].z ^ w[j][i].w;
            }
        }
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

template <int RUN, int D>
__device__ __forceinline__ void probe_run_cp_body(const qmk_u8* W, int K, int S, const QmkGemvSlice* slices,
                                                  unsigned* sink) {
    constexpr int NL = RUN / 32, SLOT = 16 * RUN;
    extern __shared__ __align__(16) qmk_u8 probe_smem[];
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    const qmk_u32 ring = (qmk_u32)__cvta_generic_to_shared(probe_smem) + warp * D * SLOT + 16 * lane;
    const int span = K / S;
    unsigned acc = 0;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S;
        const qmk_u8* base = W + (size_t)tile * 16 * K;
        const int k0 = split * span, nb = (span + RUN - 1) / RUN;
        for (int b = 0; b < D - 1; ++b) {
            if (b < nb)
#pragma unroll
                for (int i = 0; i < NL; ++i) qmk_cp_async16(ring + b * SLOT + 512 * i, probe_run_addr<RUN>(base, K, k0 + b * RUN, i, lane));
            qmk_cp_async_commit();
        }
        for (int b = 0; b < nb; ++b) {
            if (b + D - 1 < nb)
#pragma unroll
                for (int i = 0; i < NL; ++i)
                    qmk_cp_async16(ring + ((b + D - 1) % D) * SLOT + 512 * i,
                                   probe_run_addr<RUN>(base, K, k0 + (b + D - 1) * RUN, i, lane));
            qmk_cp_async_commit();
            qmk_cp_async_wait(D - 1);
#pragma unroll
            for (int i = 0; i < NL; ++i) {
                const uint4 v = qmk_lds16(ring + (b % D) * SLOT + 512 * i);
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
        }
        qmk_cp_async_wait(0);
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

#define PROBE_RUN_REG(RUN, D, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(T, 1) probe_run_reg_##RUN##_##D##_##T(                             \
        const qmk_u8* W, int K, int S, const QmkGemvSlice* slices, unsigned* sink) {                               \
        probe_run_reg_body<RUN, D>(W, K, S, slices, sink);                                                         \
    }
#define PROBE_RUN_CP(RUN, D)                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024, 1) probe_run_cp_##RUN##_##D(                                 \
        const qmk_u8* W, int K, int S, const QmkGemvSlice* slices, unsigned* sink) {                               \
        probe_run_cp_body<RUN, D>(W, K, S, slices, sink);                                                          \
    }
PROBE_RUN_REG(128, 2, 896)
PROBE_RUN_REG(128, 4, 512)
PROBE_RUN_REG(256, 2, 512)
PROBE_RUN_REG(128, 8, 384)
PROBE_RUN_REG(512, 2, 384)
PROBE_RUN_CP(128, 2)
PROBE_RUN_CP(128, 4)
PROBE_RUN_CP(128, 6)
PROBE_RUN_CP(256, 2)
PROBE_RUN_CP(256, 3)
PROBE_RUN_CP(512, 2)
PROBE_RUN_CP(1024, 1)
PROBE_RUN_CP(512, 1)

// ---------------------------------------------------------------- session 4: where the ring tile's time goes
// probe_ring_F: qmk_gemv_tile_ring's loop (R slots per warp, one unit = one fp8 K-block of 16 rows) with knobs:
//   F & 1  activation (M = 1) staged in shared memory once per block instead of ld.global per unit
//   F & 2  no e4m3 → bf16 widening (the raw words go to the mma: wrong values, same data flow)
//   F & 4  no mma (XOR of the widened words instead)
//   F & 8  mma as a non-volatile asm (the compiler may move it across the ring's volatile loads)
//   F & 16 activation loaded only by lanes g < M = 1, zeros elsewhere (as qmk_gemv_tile_ring does for M = 1)
// Partials out as qmk_gemv_store_partial (values only meaningful for F = 0 / 1 / 8 / 9).
__device__ __forceinline__ void probe_mma_nv(float (&d)[4], qmk_u32 a0, qmk_u32 a1, qmk_u32 a2, qmk_u32 a3,
                                             qmk_u32 b0, qmk_u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int F>
__device__ __forceinline__ void probe_ring_body(const qmk_u8* W, const qmk_u16* scale, const qmk_u16* x, int N, int K,
                                                int S, const QmkGemvSlice* slices, float* P, int R) {
    extern __shared__ __align__(16) qmk_u8 probe_smem[];
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const qmk_u32 ring = (qmk_u32)__cvta_generic_to_shared(probe_smem) + warp * R * QMK_GEMV_UNIT_BYTES;
    const qmk_u32 mine = ring + 16 * lane;
    const qmk_u32 xs = (qmk_u32)__cvta_generic_to_shared(probe_smem) + nw * R * QMK_GEMV_UNIT_BYTES;
    if (F & 1) {
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
            const uint4 v = qmk_ld16(x + 8 * i);
            asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(xs + 16 * i), "r"(v.x), "r"(v.y), "r"(v.z),
                         "r"(v.w) : "memory");
        }
        __syncthreads();
    }
    const int per = (K / QMK_KBLK) / S;
    const size_t row8 = 8 * (size_t)K;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        const qmk_u8* rowg = W + (size_t)(row0 + g) * K;
        const qmk_u16* srow = scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK);
        const int u0 = split * per, u1 = u0 + per;
        float acc[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
        for (int i = 0; i < R - 1; ++i) {
            if (u0 + i < u1) qmk_gemv_issue_unit<QMK_W_FP8>(mine + i * QMK_GEMV_UNIT_BYTES, rowg, row8, u0 + i, c);
            qmk_cp_async_commit();
        }
        int slot = 0, slot_next = R - 1;
        for (int u = u0; u < u1; ++u) {
            if (u + R - 1 < u1) qmk_gemv_issue_unit<QMK_W_FP8>(mine + slot_next * QMK_GEMV_UNIT_BYTES, rowg, row8, u + R - 1, c);
            qmk_cp_async_commit();
            const float sc = qmk_bf2f(__ldg(srow + u));
            uint4 xv[4];
            if (F & 1) {
#pragma unroll
                for (int i = 0; i < 4; ++i) xv[i] = qmk_lds16(xs + 2 * (u * QMK_KBLK + QmkGemvTraits<QMK_W_FP8>::xoff(i, c)));
            } else {
                qmk_gemv_load_x<QMK_W_FP8>(xv, x, (F & 16) ? g < 1 : true, u, c);
            }
            qmk_cp_async_wait(R - 1);
            uint4 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = qmk_lds16(mine + slot * QMK_GEMV_UNIT_BYTES + 512 * j);
            d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
            for (int s = 0; s < 8; ++s) {
                qmk_u32 a0, a1, a2, a3;
                if (F & 2) {
                    a0 = qmk_u4c(w[s >> 2], s & 3); a2 = a0 ^ 0x5555u;
                    a1 = qmk_u4c(w[2 + (s >> 2)], s & 3); a3 = a1 ^ 0x5555u;
                } else {
                    qmk_e4m3x4_to_bf16(qmk_u4c(w[s >> 2], s & 3), a0, a2);
                    qmk_e4m3x4_to_bf16(qmk_u4c(w[2 + (s >> 2)], s & 3), a1, a3);
                }
                const qmk_u32 b0 = qmk_u4c(xv[s >> 1], 2 * (s & 1)), b1 = qmk_u4c(xv[s >> 1], 2 * (s & 1) + 1);
                if (F & 4) {
                    d[0] = __int_as_float(__float_as_int(d[0]) ^ a0 ^ b0);
                    d[1] = __int_as_float(__float_as_int(d[1]) ^ a1 ^ b1);
                    d[2] = __int_as_float(__float_as_int(d[2]) ^ a2);
                    d[3] = __int_as_float(__float_as_int(d[3]) ^ a3);
                } else if (F & 8) {
                    probe_mma_nv(d, a0, a1, a2, a3, b0, b1);
                } else {
                    qmk_mma_bf16_16816(d, a0, a1, a2, a3, b0, b1);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc, d[j]));
            slot = slot + 1 == R ? 0 : slot + 1;
            slot_next = slot_next + 1 == R ? 0 : slot_next + 1;
        }
        qmk_gemv_store_partial(acc, P, 1, N, split, row0);
    }
}

#define PROBE_RING(F)                                                                                              \
    extern "C" __global__ void __launch_bounds__(896, 1) probe_ring_##F(const qmk_u8* W, const qmk_u16* scale,     \
                                                                         const qmk_u16* x, int N, int K, int S,    \
                                                                         const QmkGemvSlice* slices, float* P,     \
                                                                         int R) {                                  \
        probe_ring_body<F>(W, scale, x, N, K, S, slices, P, R);                                                   \
    }
PROBE_RING(0)
PROBE_RING(1)
PROBE_RING(2)
PROBE_RING(4)
PROBE_RING(8)
PROBE_RING(9)
PROBE_RING(3)
PROBE_RING(6)
PROBE_RING(16)

// The production ring tile (qmk_gemv_tile_ring, unchanged) in a task loop striding by the launched warp count:
// launched with 32 · min(28, tasks) threads this is the probe_ring_F setting, with 896 the discrete kernel's.
// probe_prod_ring: M = 1 built in (MC = 1; before session 4's change: a literal 1 argument), probe_prod_ring_m: M
// as a run-time argument (as the production kernel had it).
template <int MC>
__device__ __forceinline__ void probe_prod_ring_body(const qmk_u8* W, const qmk_u16* scale, const qmk_u16* x, int M,
                                                     int N, int K, int S, const QmkGemvSlice* slices, float* P,
                                                     int R) {
    extern __shared__ __align__(16) qmk_u8 probe_smem[];
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = (K / QMK_KBLK) / S;
    const qmk_u32 ring = (qmk_u32)__cvta_generic_to_shared(probe_smem) + warp * R * QMK_GEMV_UNIT_BYTES;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        float acc[4];
        qmk_gemv_tile_ring<QMK_W_FP8, MC>(acc, W, scale, x, M, K, row0, split * per, (split + 1) * per, ring, R);
        qmk_gemv_store_partial(acc, P, MC > 0 ? MC : M, N, split, row0);
    }
}
extern "C" __global__ void __launch_bounds__(896, 1) probe_prod_ring(const qmk_u8* W, const qmk_u16* scale,
                                                                    const qmk_u16* x, int N, int K, int S,
                                                                    const QmkGemvSlice* slices, float* P, int R) {
    probe_prod_ring_body<1>(W, scale, x, 1, N, K, S, slices, P, R);
}
extern "C" __global__ void __launch_bounds__(896, 1) probe_prod_ring_m(const qmk_u8* W, const qmk_u16* scale,
                                                                      const qmk_u16* x, int M, int N, int K, int S,
                                                                      const QmkGemvSlice* slices, float* P, int R) {
    probe_prod_ring_body<0>(W, scale, x, M, N, K, S, slices, P, R);
}

// gemv.cu — thin __global__ wrappers over gemv.cuh: one block per slice (grid = slices, one per SM), split-K
// partials through the shared-memory weight ring, optionally with the fused reduce + epilogue; and the
// standalone reduce + epilogue. PDL (discrete/launch.py, pdl.cuh): each wrapper lets its successor be scheduled
// and waits for its predecessor before touching x, P, out, resid or counters; the partial kernels first prefetch
// into L2 the first QMK_PDL_PREFETCH_UNITS weight units of each warp's first task (weights never depend on an
// earlier kernel), so that a kernel launched early streams weights while its predecessor drains. The *_norm_partial
// forms first compute the (1+w) RMSNorm of x into shared memory (the standalone norm kernel fused away, issue 5).
#include "gemv.cuh"
#include "norm.cuh"
#include "pdl.cuh"

#define QMK_PDL_PREFETCH_UNITS 2  // weight units (2 KB per warp each) prefetched into L2 before the wait

// L2 prefetch of units u0 .. u0 + QMK_PDL_PREFETCH_UNITS - 1 (clamped to the task) of warp w's first task of
// slice sl: the lines qmk_gemv_load_unit reads (rows g and g + 8, 128 B each); lane (g, c) takes units u0 + c,
// u0 + c + 4, ... Touches only W and scale. Changes no result (a prefetch has no register output).
template <int WK>
__device__ __forceinline__ void qmk_gemv_pdl_prefetch(const void* W, const qmk_u16* scale, int K, int S,
                                                      QmkGemvSlice sl) {
    constexpr int UPK = QmkGemvTraits<WK>::UPK, ES = QmkGemvTraits<WK>::ESIZE;
    const int t = sl.task_start + (int)(threadIdx.x >> 5);
    if (t >= sl.task_end) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tile = t / S, split = t - tile * S, per = (K / QMK_KBLK) / S;
    const int u0 = split * per * UPK, u1 = u0 + per * UPK;
    const int uend = u0 + QMK_PDL_PREFETCH_UNITS < u1 ? u0 + QMK_PDL_PREFETCH_UNITS : u1;
    const size_t rowbytes = (size_t)K * ES;
    const qmk_u8* rowg = (const qmk_u8*)W + (size_t)(tile * QMK_ROW_TILE + g) * rowbytes;
    for (int u = u0 + c; u < uend; u += 4) {
        const int kb = u / UPK, h = u - kb * UPK;
        const qmk_u8* p = rowg + (size_t)kb * QMK_KBLK * ES + 128 * h;
        qmk_prefetch_l2(p);
        qmk_prefetch_l2(p + 8 * rowbytes);
    }
    if (WK == QMK_W_FP8 && lane == 0)
        qmk_prefetch_l2(scale + (size_t)(tile * QMK_ROW_TILE / QMK_KBLK) * (K / QMK_KBLK) + u0);
}

// W [N, K] e4m3, scale [ceil(N/128), K/128] bf16, x [M, K] bf16, slices [grid] task ranges → P [S, M, N] fp32.
// ring: shared-memory ring depth R (2..8; 0 = register ring), dynamic shared memory min(warps, tasks per
// slice) · R · 2 KB. epi < 0: partials only; epi ≥ 0 (QMK_EPI_*): also the fused fixed-order reduce into
// out [M, Nout] bf16 (resid [M, N] or null, may alias out; counters uint32 [Nout/16], zero between launches).
template <int MC, int RG>
__device__ __forceinline__ void gemv_fp8_partial_body(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale,
                                                      const qmk_u16* x, int M, int N, int K, int S,
                                                      const QmkGemvSlice* __restrict__ slices, float* P, int ring,
                                                      int epi, const qmk_u16* resid, qmk_u16* out,
                                                      unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_FP8>(W, scale, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    qmk_gemv_slice_ring<QMK_W_FP8, QMK_GEMV_WARPS, MC, RG>(W, scale, x, M, N, K, S, slices[blockIdx.x], P, ring,
                                                           epi, resid, out, counters);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_partial(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                 int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                 const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    gemv_fp8_partial_body<0, -1>(W, scale, x, M, N, K, S, slices, P, ring, epi, resid, out, counters);
}
// The M = 1 build of gemv_fp8_partial (same arguments, M must be 1; ring ≥ 2 always: the shared-memory ring).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_partial_m1(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                    int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                    const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    gemv_fp8_partial_body<1, 1>(W, scale, x, M, N, K, S, slices, P, ring, epi, resid, out, counters);
}
// The M = 1 build with the register-ring tile (ring must be 0; no dynamic shared memory).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_partial_m1r(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                     int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                     const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    gemv_fp8_partial_body<1, 0>(W, scale, x, M, N, K, S, slices, P, ring, epi, resid, out, counters);
}

// The M = 1 builds fed by the TMA ring (gemv.cuh QmkGemvTma; KPB = 1 or 2 K-blocks per box): arguments of
// gemv_fp8_partial plus tmap (a CUtensorMap of W in global memory, box 16 rows × 128·KPB bytes) and na (warps
// that take tasks, ≤ QMK_GEMV_TMA_WARPS); ring = R stages per warp; W itself is not read (the map addresses it).
// Blocks of 32 · QMK_GEMV_TMA_WARPS threads: the kernels serve slices of ≤ 20 tasks, and the smaller block leaves
// each thread more registers (measured: +1-2 points against the same loop in 896-thread blocks).
// Dynamic shared memory: na · R · (2048 · KPB + 8) + 128 bytes. The first R − 1 boxes per warp are issued before
// the PDL wait (weights only), so a kernel launched early fills its ring while its predecessor drains.
#define QMK_GEMV_TMA_WARPS 20  // discrete/gemv.py TMA_WARPS
__device__ __forceinline__ qmk_u32 qmk_gemv_tma_smem_base(const void* dyn) {
    return ((qmk_u32)__cvta_generic_to_shared(dyn) + 127u) & ~127u;
}
template <int KPB>
__device__ __forceinline__ void gemv_fp8_partial_tma_body(const qmk_u16* __restrict__ scale, const qmk_u16* x, int M,
                                                          int N, int K, int S, const QmkGemvSlice* __restrict__ slices,
                                                          float* P, int ring, int epi, const qmk_u16* resid,
                                                          qmk_u16* out, unsigned int* counters, const void* tmap,
                                                          int na) {
    extern __shared__ __align__(16) qmk_u8 qmk_gemv_ring_smem[];
    qmk_pdl_launch_dependents();
    QmkGemvTma<KPB> q;
    q.begin(tmap, qmk_gemv_tma_smem_base(qmk_gemv_ring_smem), na, ring, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    qmk_gemv_slice_tma<KPB, 1>(q, scale, x, M, N, K, S, slices[blockIdx.x], P, epi, resid, out, counters);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_TMA_WARPS, 1)
gemv_fp8_partial_m1t1(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                      int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                      const qmk_u16* resid, qmk_u16* out, unsigned int* counters, const void* tmap, int na) {
    gemv_fp8_partial_tma_body<1>(scale, x, M, N, K, S, slices, P, ring, epi, resid, out, counters, tmap, na);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_TMA_WARPS, 1)
gemv_fp8_partial_m1t2(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, int M, int N,
                      int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                      const qmk_u16* resid, qmk_u16* out, unsigned int* counters, const void* tmap, int na) {
    gemv_fp8_partial_tma_body<2>(scale, x, M, N, K, S, slices, P, ring, epi, resid, out, counters, tmap, na);
}

// W [N, K] bf16 (scale 1), otherwise as above.
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_BF16_WARPS, 1)
gemv_bf16_partial(const qmk_u16* __restrict__ W, const qmk_u16* x, int M, int N, int K, int S,
                  const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                  qmk_u16* out, unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_BF16>(W, nullptr, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    qmk_gemv_slice_ring<QMK_W_BF16, QMK_GEMV_BF16_WARPS>(W, nullptr, x, M, N, K, S, slices[blockIdx.x], P, ring, epi,
                                                         resid, out, counters);
}

// RMSNorm prologue of the *_norm_partial kernels: the block normalises x [M, K] with the (1+w) weight nw into
// xs [M, K] (shared memory) with mx_rmsnorm_rows — the device function of the standalone qmk_rmsnorm_rows kernel
// (finish.cu) and of the megakernel's GEMV prologue, so the same bits — and block 0 also stores the rows to
// xn_out [M, K] (null: no store), the buffer the step's other readers use (GDN in_proj_a/b, snapshots).
// Reads x: call after qmk_pdl_wait(). Contains __syncthreads(): every thread of the block calls it.
template <int NWARPS>
__device__ __forceinline__ void qmk_gemv_norm_prologue(const qmk_u16* x, const qmk_u16* __restrict__ nw,
                                                       qmk_u16* xn_out, int M, int K, qmk_u16* xs, double* red) {
    mx_rmsnorm_rows<32 * NWARPS>(x, K, nw, xs, K, M, K, red);
    __syncthreads();  // xs complete before any warp's GEMV (or block 0's copy) reads it
    if (blockIdx.x == 0 && xn_out != nullptr) {
        const uint4* src = reinterpret_cast<const uint4*>(xs);
        uint4* dst = reinterpret_cast<uint4*>(xn_out);
        for (int i = threadIdx.x; i < M * K / 8; i += 32 * NWARPS) dst[i] = src[i];
    }
}

// gemv_fp8_partial on RMSNorm(x; nw) instead of x: x [M, K] bf16 (un-normed), nw [K] bf16 (the (1+w) weight),
// xn_out [M, K] bf16 or null (block 0 stores the normed rows there). Dynamic shared memory: xs_off bytes of
// weight ring (0 for the register-ring build), then xs [M, K] bf16 at byte xs_off (16-byte aligned).
template <int MC, int RG>
__device__ __forceinline__ void gemv_fp8_norm_partial_body(
    const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x, const qmk_u16* __restrict__ nw,
    qmk_u16* xn_out, int xs_off, int M, int N, int K, int S, const QmkGemvSlice* __restrict__ slices, float* P,
    int ring, int epi, const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_FP8>(W, scale, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    __shared__ double red[QMK_GEMV_WARPS];
    extern __shared__ __align__(16) qmk_u8 qmk_gemv_norm_smem[];
    qmk_u16* xs = reinterpret_cast<qmk_u16*>(qmk_gemv_norm_smem + xs_off);
    qmk_gemv_norm_prologue<QMK_GEMV_WARPS>(x, nw, xn_out, M, K, xs, red);
    qmk_gemv_slice_ring<QMK_W_FP8, QMK_GEMV_WARPS, MC, RG>(W, scale, xs, M, N, K, S, slices[blockIdx.x], P, ring,
                                                           epi, resid, out, counters);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_norm_partial(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x,
                      const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off, int M, int N, int K, int S,
                      const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                      qmk_u16* out, unsigned int* counters) {
    gemv_fp8_norm_partial_body<0, -1>(W, scale, x, nw, xn_out, xs_off, M, N, K, S, slices, P, ring, epi, resid, out,
                                      counters);
}
// The M = 1 build of gemv_fp8_norm_partial (as gemv_fp8_partial_m1).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_norm_partial_m1(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x,
                         const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off, int M, int N, int K, int S,
                         const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                         qmk_u16* out, unsigned int* counters) {
    gemv_fp8_norm_partial_body<1, 1>(W, scale, x, nw, xn_out, xs_off, M, N, K, S, slices, P, ring, epi, resid, out,
                                     counters);
}
// The M = 1 build of gemv_fp8_norm_partial with the register-ring tile (as gemv_fp8_partial_m1r).
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_WARPS, 1)
gemv_fp8_norm_partial_m1r(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x,
                          const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off, int M, int N, int K, int S,
                          const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi, const qmk_u16* resid,
                          qmk_u16* out, unsigned int* counters) {
    gemv_fp8_norm_partial_body<1, 0>(W, scale, x, nw, xn_out, xs_off, M, N, K, S, slices, P, ring, epi, resid, out,
                                     counters);
}

// The M = 1 TMA builds of gemv_fp8_norm_partial (as gemv_fp8_partial_m1t*; xs at byte xs_off of the dynamic
// shared memory, after the TMA ring).
template <int KPB>
__device__ __forceinline__ void gemv_fp8_norm_partial_tma_body(
    const qmk_u16* __restrict__ scale, const qmk_u16* x, const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off,
    int M, int N, int K, int S, const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
    const qmk_u16* resid, qmk_u16* out, unsigned int* counters, const void* tmap, int na) {
    extern __shared__ __align__(16) qmk_u8 qmk_gemv_norm_smem[];
    qmk_pdl_launch_dependents();
    QmkGemvTma<KPB> q;
    q.begin(tmap, qmk_gemv_tma_smem_base(qmk_gemv_norm_smem), na, ring, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    __shared__ double red[QMK_GEMV_TMA_WARPS];
    qmk_u16* xs = reinterpret_cast<qmk_u16*>(qmk_gemv_norm_smem + xs_off);
    qmk_gemv_norm_prologue<QMK_GEMV_TMA_WARPS>(x, nw, xn_out, M, K, xs, red);
    qmk_gemv_slice_tma<KPB, 1>(q, scale, xs, M, N, K, S, slices[blockIdx.x], P, epi, resid, out, counters);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_TMA_WARPS, 1)
gemv_fp8_norm_partial_m1t1(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x,
                           const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off, int M, int N, int K, int S,
                           const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                           const qmk_u16* resid, qmk_u16* out, unsigned int* counters, const void* tmap, int na) {
    gemv_fp8_norm_partial_tma_body<1>(scale, x, nw, xn_out, xs_off, M, N, K, S, slices, P, ring, epi, resid, out,
                                      counters, tmap, na);
}
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_TMA_WARPS, 1)
gemv_fp8_norm_partial_m1t2(const qmk_u8* __restrict__ W, const qmk_u16* __restrict__ scale, const qmk_u16* x,
                           const qmk_u16* __restrict__ nw, qmk_u16* xn_out, int xs_off, int M, int N, int K, int S,
                           const QmkGemvSlice* __restrict__ slices, float* P, int ring, int epi,
                           const qmk_u16* resid, qmk_u16* out, unsigned int* counters, const void* tmap, int na) {
    gemv_fp8_norm_partial_tma_body<2>(scale, x, nw, xn_out, xs_off, M, N, K, S, slices, P, ring, epi, resid, out,
                                      counters, tmap, na);
}

// gemv_bf16_partial on RMSNorm(x; nw), arguments and shared memory as gemv_fp8_norm_partial.
extern "C" __global__ void __launch_bounds__(32 * QMK_GEMV_BF16_WARPS, 1)
gemv_bf16_norm_partial(const qmk_u16* __restrict__ W, const qmk_u16* x, const qmk_u16* __restrict__ nw,
                       qmk_u16* xn_out, int xs_off, int M, int N, int K, int S, const QmkGemvSlice* __restrict__ slices,
                       float* P, int ring, int epi, const qmk_u16* resid, qmk_u16* out, unsigned int* counters) {
    qmk_pdl_launch_dependents();
    qmk_gemv_pdl_prefetch<QMK_W_BF16>(W, nullptr, K, S, slices[blockIdx.x]);
    qmk_pdl_wait();
    __shared__ double red[QMK_GEMV_BF16_WARPS];
    extern __shared__ __align__(16) qmk_u8 qmk_gemv_norm_smem[];
    qmk_u16* xs = reinterpret_cast<qmk_u16*>(qmk_gemv_norm_smem + xs_off);
    qmk_gemv_norm_prologue<QMK_GEMV_BF16_WARPS>(x, nw, xn_out, M, K, xs, red);
    qmk_gemv_slice_ring<QMK_W_BF16, QMK_GEMV_BF16_WARPS>(W, nullptr, xs, M, N, K, S, slices[blockIdx.x], P, ring, epi,
                                                         resid, out, counters);
}

// P [S, M, N] fp32 → out [M, Nout] bf16 (Nout = N, or N/2 for swiglu); resid [M, N] bf16 or null.
// out may alias resid (each element is read before it is written by the same thread).
extern "C" __global__ void __launch_bounds__(256)
gemv_reduce(const float* __restrict__ P, int S, int M, int N, int epi, const qmk_u16* resid, qmk_u16* out) {
    qmk_pdl_enter();
    const int nout = epi == QMK_EPI_SWIGLU ? N / 2 : N;
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= M * nout) return;
    const int m = i / nout, n = i - m * nout;
    out[i] = qmk_gemv_epilogue(epi, P, S, M, N, m, n, resid);
}

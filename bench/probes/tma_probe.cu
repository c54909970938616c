// tma_probe.cu — session 5 probe kernels: the production TMA-fed GEMV (gemv.cuh QmkGemvTma,
// qmk_gemv_slice_tma) launched with any warp count, box width (KPB K-blocks) and ring depth R, partials only,
// M = 1. Not used by the engine. Included after discrete/kernels/gemv.cu. (The first run of session 5 timed a
// stand-alone draft of the same loop; its figures are in bench/probes/run9/tma_probe_draft.json.)
template <int KPB>
__device__ __forceinline__ void tp_body(const void* tmap, const qmk_u16* scale, const qmk_u16* x, int N, int K, int S,
                                        const QmkGemvSlice* slices, float* P, int R) {
    extern __shared__ __align__(16) qmk_u8 tp_smem[];
    QmkGemvTma<KPB> q;
    q.begin(tmap, qmk_gemv_tma_smem_base(tp_smem), blockDim.x >> 5, R, K, S, slices[blockIdx.x]);
    qmk_gemv_slice_tma<KPB, 1>(q, scale, x, 1, N, K, S, slices[blockIdx.x], P, -1, nullptr, nullptr, nullptr);
}
#define TP_KERNEL(KPB, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(T, 1) probe_tma_##KPB(                                            \
        const void* tmap, const qmk_u16* scale, const qmk_u16* x, int N, int K, int S, const QmkGemvSlice* slices, \
        float* P, int R) {                                                                                         \
        tp_body<KPB>(tmap, scale, x, N, K, S, slices, P, R);                                                       \
    }
TP_KERNEL(1, 896)
TP_KERNEL(2, 640)

// The stand-alone draft of the same loop that ran first in session 5 (bench/probes/run9/tma_probe_draft.json), kept
// to find why its 2-K-block boxes measured faster than the production loop's (gate|up 80 vs 70 %).
template <int KPB>
__device__ __forceinline__ void td_body(const void* tmap, const qmk_u16* scale, const qmk_u16* x, int N, int K, int S,
                                        const QmkGemvSlice* slices, float* P, int R) {
    extern __shared__ __align__(16) qmk_u8 td_smem[];
    constexpr int PITCH = QMK_KBLK * KPB, SB = QMK_ROW_TILE * PITCH;
    const QmkGemvSlice sl = slices[blockIdx.x];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int per = (K / QMK_KBLK) / S, nbox = (per + KPB - 1) / KPB;
    const qmk_u32 base = qmk_gemv_tma_smem_base(td_smem) + warp * R * SB;
    const qmk_u32 bars = qmk_gemv_tma_smem_base(td_smem) + nw * R * SB + warp * R * 8;
    if (lane == 0) {
        for (int i = 0; i < R; ++i) qmk_mbar_init(bars + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    int it = sl.task_start + warp, ib = 0, islot = 0;
    auto issue = [&]() {
        if (it >= sl.task_end) return;
        const int tile = it / S, split = it - tile * S;
        const int kb = split * per + ib * KPB;
        if (lane == 0) {
            qmk_mbar_expect_tx(bars + 8 * islot, SB);
            qmk_tma_load_2d(base + islot * SB, tmap, kb * QMK_KBLK, tile * QMK_ROW_TILE, bars + 8 * islot);
        }
        islot = islot + 1 == R ? 0 : islot + 1;
        if (++ib == nbox) {
            ib = 0;
            it += nw;
        }
    };
    for (int i = 0; i < R - 1; ++i) issue();
    int cslot = 0;
    qmk_u32 parity = 0;
    for (int t = sl.task_start + warp; t < sl.task_end; t += nw) {
        const int tile = t / S, split = t - tile * S, row0 = tile * QMK_ROW_TILE;
        const int kb0 = split * per, kb1 = kb0 + per;
        const qmk_u16* srow = scale + (size_t)(row0 / QMK_KBLK) * (K / QMK_KBLK);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int b = 0; b < nbox; ++b) {
            __syncwarp();
            issue();
            const qmk_u32 st = base + cslot * SB;
            uint4 xv[KPB][4];
            float sc[KPB];
#pragma unroll
            for (int kk = 0; kk < KPB; ++kk) {
                const int kb = min(kb0 + b * KPB + kk, kb1 - 1);
                qmk_gemv_load_x<QMK_W_FP8>(xv[kk], x, true, kb, c);
                sc[kk] = qmk_bf2f(__ldg(srow + kb));
            }
            while (!qmk_mbar_try_wait(bars + 8 * cslot, (parity >> cslot) & 1u)) {
            }
            parity ^= 1u << cslot;
#pragma unroll
            for (int kk = 0; kk < KPB; ++kk) {
                if (KPB > 1 && kb0 + b * KPB + kk >= kb1) break;
                const qmk_u32 p = st + g * PITCH + kk * QMK_KBLK + 16 * c;
                uint4 w[4];
                w[0] = qmk_lds16(p);
                w[1] = qmk_lds16(p + 64);
                w[2] = qmk_lds16(p + 8 * PITCH);
                w[3] = qmk_lds16(p + 8 * PITCH + 64);
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                qmk_gemv_unit_mma_x<QMK_W_FP8>(d, w, xv[kk]);
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(sc[kk], d[j]));
            }
            cslot = cslot + 1 == R ? 0 : cslot + 1;
        }
        qmk_gemv_store_partial(acc, P, 1, N, split, row0);
    }
}
extern "C" __global__ void __launch_bounds__(896, 1) probe_draft_1(const void* tmap, const qmk_u16* scale,
        const qmk_u16* x, int N, int K, int S, const QmkGemvSlice* slices, float* P, int R) {
    td_body<1>(tmap, scale, x, N, K, S, slices, P, R);
}
extern "C" __global__ void __launch_bounds__(640, 1) probe_draft_2(const void* tmap, const qmk_u16* scale,
        const qmk_u16* x, int N, int K, int S, const QmkGemvSlice* slices, float* P, int R) {
    td_body<2>(tmap, scale, x, N, K, S, slices, P, R);
}

// tma_probe.cu — session 5 probe kernels: the production TMA-fed GEMV (gemv.cuh QmkGemvTma,
// qmk_gemv_slice_tma) launched with any warp count, box width (KPB K-blocks) and ring depth R, partials only,
// M = 1. Not used by the engine. Included after discrete/kernels/gemv.cu. (The first run of session 5 timed a
// stand-alone draft of the same loop, bench/probes/run9/tma_probe_draft.json; the draft, probe_draft_*, is in
// this file at commit 949b992, where bench/probes/run9/tma_probe_prod_vs_draft.json measured both: same speed.)
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


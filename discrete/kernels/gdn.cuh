// gdn.cuh — Gated DeltaNet decode step for one value head, M <= QMK_MAX_ROWS rows (article Part 3.6;
// spec §3.4; HF modeling_qwen3_5 Qwen3_5GatedDeltaNet + torch_recurrent_gated_delta_rule, transformers 5.x).
//
// Fuses: conv ring update, depthwise 4-tap conv + SiLU, l2norm of q and k (fp32), q / sqrt(d_k),
// in_proj_a/b (bf16 dot products from the normed hidden vector), beta = sigmoid(b), g, the fp32 delta-rule
// recurrence over the M rows with the head's state held in registers, the gated RMSNorm with z.
//
// Work unit: one block of MX_GDN_THREADS threads per value head j (key head j / QMK_GDN_HEAD_GROUP).
// The gated norm needs all d_v outputs of a head, so a head is not split across blocks (docs/kernels-mixers.md).
//
// Layouts (element counts; bf16 as uint16 bits):
//   state  [NV, DV, DK] fp32: value column v of head j is a contiguous run of DK keys. Warp w owns columns
//          [w*CPW, (w+1)*CPW); lane l owns keys [4l, 4l+4) of each: both products S^T k and S^T q are
//          warp-local xor-butterfly sums. Reference layout [NV, DK, DV] = transpose (discrete/gdn.py).
//   ring   [QMK_CONV_RING, CONV_DIM] bf16: the conv input of position p sits in slot p % QMK_CONV_RING.
//          Step at positions pos..pos+M-1 reads slots of pos-3..pos-1 (p < 0 reads 0) and writes pos..pos+M-1;
//          QMK_CONV_RING >= QMK_MAX_ROWS + 3 keeps reads and writes of one launch on distinct slots, so the
//          blocks that share a key head need no ordering. q/k channels are written by the first value head
//          of each key-head group only.
// Rounding points (HF, as assembler/ref/gdn.py writes them): conv sum -> fp32 -> bf16 -> silu -> bf16; a, b ->
// bf16; beta = bf16(sigmoid(b)); g = fp32(-fp32(exp(A_log)) * fp32(softplus(fp32(a + dt_bias)))); decay =
// fp32(exp g); S = fp32(S*decay); kv = fp32(S^T k); delta = fp32(fp32(v - kv) * beta); S = fp32(S + fp32(k*delta));
// o = bf16(S^T q); gated norm as norm.cuh. Sums and transcendentals run in float64 and are rounded to fp32 once,
// like the reference, so results are independent of the reduction order.
#pragma once
#include "norm.cuh"

// Passed by discrete/gdn.py (extra_defines); the fallbacks repeat the same rules for the offline compile check.
#ifndef QMK_MAX_ROWS
#define QMK_MAX_ROWS 8                                 // assembler.numerics.MAX_ROWS
#endif
#ifndef QMK_CONV_RING
#define QMK_CONV_RING 16                               // power of two >= QMK_MAX_ROWS + 3
#endif
#ifndef QMK_GDN_QDIV
#define QMK_GDN_QDIV __fsqrt_rn((float)QMK_GDN_DK)    // fp32(sqrt(d_k)): the recurrent rule divides by it
#endif

#define MX_GDN_THREADS 512
#define MX_GDN_WARPS (MX_GDN_THREADS / 32)
#define MX_GDN_CPW (QMK_GDN_DV / MX_GDN_WARPS)     // value columns per warp
#define MX_GDN_CH (2 * QMK_GDN_DK + QMK_GDN_DV)      // conv channels one head reads
#define MX_GDN_NKB (QMK_HIDDEN / 128)                 // K blocks of in_proj_a/b
#define MX_GDN_AB_BATCH 8                             // a/b warp tasks with loads in flight together

static_assert(QMK_GDN_DK == 128 && QMK_GDN_DV == 128, "gdn.cuh: lanes own 4 of 128 keys");
static_assert(QMK_GDN_DV % MX_GDN_WARPS == 0, "gdn.cuh: value columns must split evenly over warps");
static_assert(QMK_HIDDEN % 128 == 0, "gdn.cuh: hidden must be a multiple of 128");
static_assert(QMK_CONV_K == 4, "gdn.cuh: 4-tap conv");
static_assert(QMK_CONV_RING >= QMK_MAX_ROWS + QMK_CONV_K - 1, "gdn.cuh: ring too short for M rows");
static_assert(2 * QMK_MAX_ROWS <= MX_GDN_WARPS, "gdn.cuh: one warp per (row, q|k) l2norm task");

// Σ over the warp's 128 keys of s·k: fp32 products are exact in float64, summed in float64, rounded once
__device__ __forceinline__ float mx_dot4_warp(const float4& s, const float4& k) {
    double d = (double)s.x * (double)k.x;
    d = __fma_rn((double)s.y, (double)k.y, d);
    d = __fma_rn((double)s.z, (double)k.z, d);
    d = __fma_rn((double)s.w, (double)k.w, d);
    return (float)mx_warp_sum_d(d);
}

struct MxGdnSmem {
    float qk[QMK_MAX_ROWS][2][QMK_GDN_DK];    // conv+silu q, k (bf16 values), then l2-normed in place
    float v[QMK_MAX_ROWS][QMK_GDN_DV];        // conv+silu v (bf16 values)
    float ab[QMK_MAX_ROWS][2][MX_GDN_NKB];    // per-K-block dot products of in_proj_a (0) and in_proj_b (1)
    float decay[QMK_MAX_ROWS], beta[QMK_MAX_ROWS];
    float o[QMK_MAX_ROWS][QMK_GDN_DV];        // core output, bf16 values
};

// softplus in float64 with torch's threshold 20, rounded to fp32 (reference gdn_gates)
__device__ __forceinline__ float mx_softplus(float x) { const double d = x; return d > 20.0 ? x : (float)log1p(exp(d)); }

// Args: qkv [M, CONV_DIM] (in_proj_qkv output, pre-conv), z [M, VALUE_DIM], hn [M, HIDDEN] (normed hidden),
// w_a/w_b [NV, HIDDEN], a_log/dt_bias [NV], conv_w [CONV_DIM, 4], norm_w [DV] (all bf16); ring, state as
// above; out [M, VALUE_DIM] bf16; pos = position of row 0. Call from all threads of a MX_GDN_THREADS block.
__device__ void mx_gdn_step_head(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z,
                                 const mx_u16* __restrict__ hn, const mx_u16* __restrict__ w_a,
                                 const mx_u16* __restrict__ w_b, const mx_u16* __restrict__ a_log,
                                 const mx_u16* __restrict__ dt_bias, const mx_u16* __restrict__ conv_w,
                                 const mx_u16* __restrict__ norm_w, mx_u16* __restrict__ ring,
                                 float* __restrict__ state, mx_u16* __restrict__ out, int pos, int M, int j,
                                 MxGdnSmem& sm) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hk = j / QMK_GDN_HEAD_GROUP;
    const bool writes_qk = (j % QMK_GDN_HEAD_GROUP) == 0;

    // issue the state loads first: they are the bytes this kernel is about
    float4 S[MX_GDN_CPW];
    float* st = state + ((size_t)j * QMK_GDN_DV + warp * MX_GDN_CPW) * QMK_GDN_DK + lane * 4;
#pragma unroll
    for (int c = 0; c < MX_GDN_CPW; ++c) S[c] = *reinterpret_cast<const float4*>(st + c * QMK_GDN_DK);

    // A1: conv ring + 4-tap conv + silu for the head's q, k, v channels, all rows
    for (int t = tid; t < M * MX_GDN_CH; t += MX_GDN_THREADS) {
        const int i = t / MX_GDN_CH, c = t % MX_GDN_CH;
        const int ch = c < QMK_GDN_DK ? hk * QMK_GDN_DK + c
                     : c < 2 * QMK_GDN_DK ? QMK_GDN_KEY_DIM + hk * QMK_GDN_DK + (c - QMK_GDN_DK)
                     : 2 * QMK_GDN_KEY_DIM + j * QMK_GDN_DV + (c - 2 * QMK_GDN_DK);
        double acc = 0.0;  // products of bf16 are exact in float64: the 4-term sum is order-free
#pragma unroll
        for (int tap = 0; tap < 4; ++tap) {
            const int p = pos + i - 3 + tap;  // input position of this tap
            mx_u16 x = 0;
            if (p >= pos) x = qkv[(size_t)(p - pos) * QMK_GDN_CONV_DIM + ch];
            else if (p >= 0) x = ring[(size_t)(p % QMK_CONV_RING) * QMK_GDN_CONV_DIM + ch];
            acc = __fma_rn((double)mx_bf2f(conv_w[ch * 4 + tap]), (double)mx_bf2f(x), acc);
        }
        const float y = mx_round_bf(mx_silu(mx_round_bf((float)acc)));
        if (c < 2 * QMK_GDN_DK) sm.qk[i][c / QMK_GDN_DK][c % QMK_GDN_DK] = y;
        else sm.v[i][c - 2 * QMK_GDN_DK] = y;
        if (c >= 2 * QMK_GDN_DK || writes_qk)
            ring[(size_t)((pos + i) % QMK_CONV_RING) * QMK_GDN_CONV_DIM + ch] = qkv[(size_t)i * QMK_GDN_CONV_DIM + ch];
    }
    // A2: in_proj_a / in_proj_b rows j: per 128-column block a float64 dot (warp task). A warp issues the loads
    // of up to MX_GDN_AB_BATCH tasks before reducing any, so their latencies overlap.
    {
        const int T = M * 2 * MX_GDN_NKB;
        for (int t0 = warp; t0 < T; t0 += MX_GDN_AB_BATCH * MX_GDN_WARPS) {
            uint2 wv[MX_GDN_AB_BATCH], xv[MX_GDN_AB_BATCH];
#pragma unroll
            for (int u = 0; u < MX_GDN_AB_BATCH; ++u) {
                const int t = t0 + u * MX_GDN_WARPS;
                if (t < T) {
                    const int i = t / (2 * MX_GDN_NKB), which = (t / MX_GDN_NKB) & 1, kb = t % MX_GDN_NKB;
                    wv[u] = *reinterpret_cast<const uint2*>((which ? w_b : w_a) + (size_t)j * QMK_HIDDEN + kb * 128 + lane * 4);
                    xv[u] = *reinterpret_cast<const uint2*>(hn + (size_t)i * QMK_HIDDEN + kb * 128 + lane * 4);
                }
            }
#pragma unroll
            for (int u = 0; u < MX_GDN_AB_BATCH; ++u) {
                const int t = t0 + u * MX_GDN_WARPS;  // uniform over the warp: the shuffles below stay converged
                if (t < T) {
                    const int i = t / (2 * MX_GDN_NKB), which = (t / MX_GDN_NKB) & 1, kb = t % MX_GDN_NKB;
                    const mx_u16* w = reinterpret_cast<const mx_u16*>(&wv[u]);
                    const mx_u16* x = reinterpret_cast<const mx_u16*>(&xv[u]);
                    double s = 0.0;  // the GEMV block dot: exact products summed in float64, rounded once
#pragma unroll
                    for (int e = 0; e < 4; ++e) s = __fma_rn((double)mx_bf2f(w[e]), (double)mx_bf2f(x[e]), s);
                    s = mx_warp_sum_d(s);
                    if (lane == 0) sm.ab[i][which][kb] = (float)s;
                }
            }
        }
    }
    __syncthreads();
    // A3: l2norm of q, k (fp32, HF v5: after the cast), q / sqrt(d_k); gates
    if (warp < 2 * M) {
        const int i = warp >> 1, which = warp & 1;
        float x[4];
        double s = 0.0;
#pragma unroll
        for (int e = 0; e < 4; ++e) { x[e] = sm.qk[i][which][lane * 4 + e]; s = __fma_rn((double)x[e], (double)x[e], s); }
        const float inv = mx_rsqrt_rn(__fadd_rn((float)mx_warp_sum_d(s), 1e-6f));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float y = __fmul_rn(x[e], inv);
            if (which == 0) y = __fdiv_rn(y, QMK_GDN_QDIV);
            sm.qk[i][which][lane * 4 + e] = y;
        }
    }
    if (warp == MX_GDN_WARPS - 1 && lane < M) {  // last warp (after its l2norm task, if it has one)
        const int i = lane;
        float a = 0.0f, b = 0.0f;
        for (int kb = 0; kb < MX_GDN_NKB; ++kb) { a = __fadd_rn(a, sm.ab[i][0][kb]); b = __fadd_rn(b, sm.ab[i][1][kb]); }
        a = mx_round_bf(a);
        b = mx_round_bf(b);
        sm.beta[i] = mx_round_bf(mx_sigmoid(b));
        const float A = -(float)exp((double)mx_bf2f(a_log[j]));
        const float g = __fmul_rn(A, mx_softplus(__fadd_rn(a, mx_bf2f(dt_bias[j]))));
        sm.decay[i] = (float)exp((double)g);
    }
    __syncthreads();
    // B: the recurrence, row by row, state in registers
    for (int i = 0; i < M; ++i) {
        const float4 k = *reinterpret_cast<const float4*>(&sm.qk[i][1][lane * 4]);
        const float4 q = *reinterpret_cast<const float4*>(&sm.qk[i][0][lane * 4]);
        const float dec = sm.decay[i], bt = sm.beta[i];
#pragma unroll
        for (int c = 0; c < MX_GDN_CPW; ++c) {
            float4& s = S[c];
            s.x = __fmul_rn(s.x, dec); s.y = __fmul_rn(s.y, dec); s.z = __fmul_rn(s.z, dec); s.w = __fmul_rn(s.w, dec);
            const float kv = mx_dot4_warp(s, k);
            const int col = warp * MX_GDN_CPW + c;
            const float d = __fmul_rn(__fsub_rn(sm.v[i][col], kv), bt);
            s.x = __fadd_rn(s.x, __fmul_rn(k.x, d)); s.y = __fadd_rn(s.y, __fmul_rn(k.y, d));
            s.z = __fadd_rn(s.z, __fmul_rn(k.z, d)); s.w = __fadd_rn(s.w, __fmul_rn(k.w, d));
            const float o = mx_dot4_warp(s, q);
            if (lane == 0) sm.o[i][col] = mx_round_bf(o);
        }
    }
#pragma unroll
    for (int c = 0; c < MX_GDN_CPW; ++c) *reinterpret_cast<float4*>(st + c * QMK_GDN_DK) = S[c];
    __syncthreads();
    // C: gated RMSNorm with z, one warp per row
    if (warp < M) {
        const int i = warp;
        const size_t base = (size_t)i * QMK_GDN_VALUE_DIM + (size_t)j * QMK_GDN_DV + lane * 4;
        float x[4], zz[4];
        mx_u16 y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) { x[e] = sm.o[i][lane * 4 + e]; zz[e] = mx_bf2f(z[base + e]); }
        mx_head_norm_gated<4>(x, zz, norm_w, y);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[base + e] = y[e];
    }
}

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

static_assert(QMK_GDN_DK == 128 && QMK_GDN_DV == 128, "gdn.cuh: lanes own 4 of 128 keys");
static_assert(QMK_GDN_DV % MX_GDN_WARPS == 0, "gdn.cuh: value columns must split evenly over warps");
static_assert(QMK_HIDDEN % 128 == 0, "gdn.cuh: hidden must be a multiple of 128");
static_assert(QMK_CONV_K == 4, "gdn.cuh: 4-tap conv");
static_assert(QMK_CONV_RING >= QMK_MAX_ROWS + QMK_CONV_K - 1, "gdn.cuh: ring too short for M rows");
static_assert(2 * QMK_MAX_ROWS <= MX_GDN_WARPS, "gdn.cuh: one warp per (row, q|k) l2norm task");

// This lane's part of Σ over the warp's 128 keys of s·k: fp32 products are exact in float64, summed in float64;
// the warp sum (mx_warp_sum_d[_n]) then rounds once to fp32
__device__ __forceinline__ double mx_dot4_lane(const float4& s, const float4& k) {
    double d = (double)s.x * (double)k.x;
    d = __fma_rn((double)s.y, (double)k.y, d);
    d = __fma_rn((double)s.z, (double)k.z, d);
    d = __fma_rn((double)s.w, (double)k.w, d);
    return d;
}

struct MxGdnSmem {
    float qk[QMK_MAX_ROWS][2][QMK_GDN_DK];    // conv+silu q, k (bf16 values), then l2-normed in place
    float v[QMK_MAX_ROWS][QMK_GDN_DV];        // conv+silu v (bf16 values)
    float ab[QMK_MAX_ROWS][2][MX_GDN_NKB];    // per-K-block dot products of in_proj_a (0) and in_proj_b (1)
    float decay[QMK_MAX_ROWS], beta[QMK_MAX_ROWS];
    float o[QMK_MAX_ROWS][QMK_GDN_DV];        // core output, bf16 values
    float4 zs[QMK_MAX_ROWS + 1][32];          // silu(z) of each row (lane's 4 dims), then the norm weights
};

// softplus in float64 with torch's threshold 20, rounded to fp32 (reference gdn_gates)
__device__ __forceinline__ float mx_softplus(float x) { const double d = x; return d > 20.0 ? x : (float)log1p(exp(d)); }

// The weights of value head j a step reads, loaded into registers before its inputs exist: the discrete wrapper
// issues this before its PDL wait (the loads fly while the predecessor drains), the megakernel right before the
// step. Per thread: the 4 conv taps of channel tid (tid < MX_GDN_CH); in_proj_a/b lane chunks of the warp's
// K-blocks kb = warp + MX_GDN_WARPS·u; the norm weights of the lane's 4 value dims; A_log, dt_bias of the head.
#define MX_GDN_KBPW ((MX_GDN_NKB + MX_GDN_WARPS - 1) / MX_GDN_WARPS)  // a/b K-blocks per warp
struct MxGdnPre {
    uint2 cw;                      // conv_w[ch, 0..3]
    uint2 wab[2][MX_GDN_KBPW];     // [a | b][u]: 4 bf16 of row j at columns kb·128 + 4·lane
    uint2 nw;                      // norm_w[4·lane .. 4·lane + 3]
    mx_u16 alog, dtb;
};

static_assert(MX_GDN_CH <= MX_GDN_THREADS, "gdn.cuh: one thread per conv channel");

// w_a/w_b [NV, HIDDEN], a_log/dt_bias [NV], conv_w [CONV_DIM, 4], norm_w [DV] (bf16). Weights only: safe before
// a PDL wait.
__device__ __forceinline__ void mx_gdn_prefetch(const mx_u16* __restrict__ w_a, const mx_u16* __restrict__ w_b,
                                                const mx_u16* __restrict__ a_log, const mx_u16* __restrict__ dt_bias,
                                                const mx_u16* __restrict__ conv_w, const mx_u16* __restrict__ norm_w,
                                                int j, MxGdnPre& pre) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hk = j / QMK_GDN_HEAD_GROUP, c = tid < MX_GDN_CH ? tid : 0;
    const int ch = c < QMK_GDN_DK ? hk * QMK_GDN_DK + c
                 : c < 2 * QMK_GDN_DK ? QMK_GDN_KEY_DIM + hk * QMK_GDN_DK + (c - QMK_GDN_DK)
                 : 2 * QMK_GDN_KEY_DIM + j * QMK_GDN_DV + (c - 2 * QMK_GDN_DK);
    pre.cw = *reinterpret_cast<const uint2*>(conv_w + (size_t)ch * 4);
#pragma unroll
    for (int u = 0; u < MX_GDN_KBPW; ++u) {
        const int kb = warp + MX_GDN_WARPS * u;
        const size_t o = (size_t)j * QMK_HIDDEN + (kb < MX_GDN_NKB ? kb : 0) * 128 + lane * 4;
        pre.wab[0][u] = *reinterpret_cast<const uint2*>(w_a + o);
        pre.wab[1][u] = *reinterpret_cast<const uint2*>(w_b + o);
    }
    pre.nw = *reinterpret_cast<const uint2*>(norm_w + lane * 4);
    pre.alog = a_log[j];
    pre.dtb = dt_bias[j];
}

__device__ __forceinline__ float mx_u2_bf(const uint2& v, int e) {  // element e (0..3) of 4 packed bf16
    const unsigned w = e < 2 ? v.x : v.y;
    return mx_bf2f((mx_u16)((e & 1) ? (w >> 16) : (w & 0xffffu)));
}

// Phase A of a step (every thread of a MX_GDN_THREADS block): the conv inputs, the 4-tap conv + SiLU (the ring gets
// this launch's inputs unless ring_write is false), in_proj_a|b, l2norm of q and k, the gates, silu(z) and the norm
// weights, into sm (qk, v, decay, beta, zs); ends with the block synchronised; first it loads the NSC state columns of
// this warp, S[c] = the float4 at sr + c·DK (the step's: issued with the other input loads). Arguments: see
// mx_gdn_step_head_pre below;
// tid, lane, warp: threadIdx.x, its lane and warp (the caller's: recomputed here they change the decode kernel's code);
// hk, writes_qk: the key head of j and whether j is the first value head of its group.
template <int CH, int MR, int NSC>
__device__ __forceinline__ void mx_gdn_rows_in(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z,
                                               const mx_u16* __restrict__ hn, mx_u16* __restrict__ ring,
                                               const float* __restrict__ sr, float4* S, int pos, int M, int j,
                                               const MxGdnPre& pre, MxGdnSmem& sm, int hist, bool ring_write,
                                               int tid, int lane, int warp, int hk, bool writes_qk) {
    // every input load is issued up front: the state (the bytes this kernel is about), the conv window, z
#pragma unroll
    for (int c = 0; c < NSC; ++c) S[c] = *reinterpret_cast<const float4*>(sr + c * QMK_GDN_DK);
    const int c = tid;  // conv channel of this thread (c < MX_GDN_CH)
    const int ch = c < QMK_GDN_DK ? hk * QMK_GDN_DK + c
                 : c < 2 * QMK_GDN_DK ? QMK_GDN_KEY_DIM + hk * QMK_GDN_DK + (c - QMK_GDN_DK)
                 : 2 * QMK_GDN_KEY_DIM + j * QMK_GDN_DV + (c - 2 * QMK_GDN_DK);
    mx_u16 xin[MR + 3];  // conv inputs of positions pos-3 .. pos+M-1 (0 before position 0); M <= MR
    if (c < MX_GDN_CH) {
#pragma unroll
        for (int t = 0; t < 3; ++t) {
            const int p = pos - 3 + t;
            xin[t] = p >= pos - hist ? qkv[(ptrdiff_t)(p - pos) * QMK_GDN_CONV_DIM + ch]
                   : p >= 0 ? ring[(size_t)(p % QMK_CONV_RING) * QMK_GDN_CONV_DIM + ch] : (mx_u16)0;
        }
#pragma unroll
        for (int i = 0; i < MR; ++i) xin[3 + i] = i < M ? qkv[(size_t)i * QMK_GDN_CONV_DIM + ch] : (mx_u16)0;
    }
    const int zrow = MX_GDN_WARPS - 1 - warp;  // the gate z of row zrow (< M): the last warps, which have the fewest a/b blocks
    uint2 zv = make_uint2(0u, 0u);
    if (zrow < M) zv = *reinterpret_cast<const uint2*>(z + (size_t)zrow * QMK_GDN_VALUE_DIM + (size_t)j * QMK_GDN_DV + lane * 4);
    float A = 0.0f;  // -fp32(exp(A_log)) (the decay lanes need it; computed while the loads fly)
    if (warp == MX_GDN_WARPS - 1) A = -(float)exp((double)mx_bf2f(pre.alog));

    // A1: 4-tap conv + silu of channel c for every row; the ring gets this launch's inputs
    if (c < MX_GDN_CH) {
        double wt[4];
#pragma unroll
        for (int tap = 0; tap < 4; ++tap) wt[tap] = (double)mx_u2_bf(pre.cw, tap);
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            if (i >= M) break;
            double acc = 0.0;  // products of bf16 are exact in float64: the 4-term sum is order-free
#pragma unroll
            for (int tap = 0; tap < 4; ++tap) acc = __fma_rn(wt[tap], (double)mx_bf2f(xin[i + tap]), acc);
            const float y = mx_round_bf(mx_silu(mx_round_bf((float)acc)));
            if (c < 2 * QMK_GDN_DK) sm.qk[i][c / QMK_GDN_DK][c % QMK_GDN_DK] = y;
            else sm.v[i][c - 2 * QMK_GDN_DK] = y;
            if (ring_write && (c >= 2 * QMK_GDN_DK || writes_qk)) ring[(size_t)((pos + i) % QMK_CONV_RING) * QMK_GDN_CONV_DIM + ch] = xin[3 + i];
        }
    }
    // A2: in_proj_a / in_proj_b rows j: per 128-column block a float64 dot (the warp's K-blocks, weights in
    // registers); a row's activation chunks are loaded together, its 2·KBPW warp sums run interleaved
    for (int i = 0; i < M; ++i) {
        uint2 xv[MX_GDN_KBPW];
#pragma unroll
        for (int u = 0; u < MX_GDN_KBPW; ++u) {
            const int kb = warp + MX_GDN_WARPS * u;
            xv[u] = *reinterpret_cast<const uint2*>(hn + (size_t)i * QMK_HIDDEN + (kb < MX_GDN_NKB ? kb : 0) * 128 + lane * 4);
        }
        constexpr int NS = CH > 1 ? 2 * MX_GDN_KBPW : 1;  // warp sums interleaved at once
#pragma unroll
        for (int v0 = 0; v0 < 2 * MX_GDN_KBPW; v0 += NS) {
            double s[NS];  // value v = 2u + which: the GEMV block dot, exact products summed in float64, rounded once
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                const int u = (v0 + n) >> 1, which = (v0 + n) & 1;
                double d = 0.0;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    d = __fma_rn((double)mx_u2_bf(pre.wab[which][u], e), (double)mx_u2_bf(xv[u], e), d);
                s[n] = d;
            }
            mx_warp_sum_d_n<NS>(s);
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                const int u = (v0 + n) >> 1, which = (v0 + n) & 1, kb = warp + MX_GDN_WARPS * u;
                if (lane == 0 && kb < MX_GDN_NKB) sm.ab[i][which][kb] = (float)s[n];
            }
        }
    }
    if (zrow < M) {  // silu of the gate, off the tail; parked in shared memory with the norm weights
        float4 f;
        f.x = mx_silu(mx_u2_bf(zv, 0)); f.y = mx_silu(mx_u2_bf(zv, 1)); f.z = mx_silu(mx_u2_bf(zv, 2)); f.w = mx_silu(mx_u2_bf(zv, 3));
        sm.zs[zrow][lane] = f;
    }
    if (warp == 0) {
        float4 f;
        f.x = mx_u2_bf(pre.nw, 0); f.y = mx_u2_bf(pre.nw, 1); f.z = mx_u2_bf(pre.nw, 2); f.w = mx_u2_bf(pre.nw, 3);
        sm.zs[QMK_MAX_ROWS][lane] = f;
    }
    __syncthreads();
    // A3: l2norm of q, k (fp32, HF v5: after the cast), q / sqrt(d_k); gates: decay on the last warp, beta on the
    // one before (both after their l2norm task, if any), in parallel
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
    if (warp >= MX_GDN_WARPS - 2 && lane < M) {
        const int i = lane, which = warp == MX_GDN_WARPS - 1 ? 0 : 1;  // 0: a -> decay, 1: b -> beta
        float a = 0.0f;
        for (int kb = 0; kb < MX_GDN_NKB; ++kb) a = __fadd_rn(a, sm.ab[i][which][kb]);
        a = mx_round_bf(a);
        if (which == 1) {
            sm.beta[i] = mx_round_bf(mx_sigmoid(a));
        } else {
            const float g = __fmul_rn(A, mx_softplus(__fadd_rn(a, mx_bf2f(pre.dtb))));
            sm.decay[i] = (float)exp((double)g);
        }
    }
    __syncthreads();
}

// Phase B: the recurrence over the M rows for NC state columns col0 .. col0+NC-1 of the head, held by this warp in S
// (lane l: keys 4l .. 4l+3 of each; S read and left in registers); lane 0 writes the bf16 value of column col's
// S^T q of row i to sm.o[i][col] (TO_SM: the step) or og[i * og_stride + col] (prefill). Inputs from sm (qk, v,
// decay, beta) as phase A leaves them. A column's result depends on nothing but its own state and the row inputs:
// any split of the columns over warps and blocks gives the same bits.
template <int NC, int CH, bool TO_SM>
__device__ __forceinline__ void mx_gdn_rows_recur(float4 (&S)[NC], MxGdnSmem& sm, int M, int col0, int lane,
                                                  float* __restrict__ og = nullptr, int og_stride = 0) {
    static_assert(NC % CH == 0, "gdn.cuh: CH must divide the columns per warp");
    // B: the recurrence, row by row, state in registers. The warp's NC columns are independent: CH of them at a
    // time run their S^T k sums interleaved, then their S^T q sums (per column: mx_dot4_lane, then the xor
    // butterfly, whatever CH is: same bits)
    for (int i = 0; i < M; ++i) {
        const float4 k = *reinterpret_cast<const float4*>(&sm.qk[i][1][lane * 4]);
        const float4 q = *reinterpret_cast<const float4*>(&sm.qk[i][0][lane * 4]);
        const float dec = sm.decay[i], bt = sm.beta[i];
#pragma unroll
        for (int c0 = 0; c0 < NC; c0 += CH) {
            double t[CH];
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                float4& s = S[c0 + c];
                s.x = __fmul_rn(s.x, dec); s.y = __fmul_rn(s.y, dec); s.z = __fmul_rn(s.z, dec); s.w = __fmul_rn(s.w, dec);
                t[c] = mx_dot4_lane(s, k);
            }
            mx_warp_sum_d_n<CH>(t);
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                float4& s = S[c0 + c];
                const int col = col0 + c0 + c;
                const float d = __fmul_rn(__fsub_rn(sm.v[i][col], (float)t[c]), bt);
                s.x = __fadd_rn(s.x, __fmul_rn(k.x, d)); s.y = __fadd_rn(s.y, __fmul_rn(k.y, d));
                s.z = __fadd_rn(s.z, __fmul_rn(k.z, d)); s.w = __fadd_rn(s.w, __fmul_rn(k.w, d));
                t[c] = mx_dot4_lane(s, q);
            }
            mx_warp_sum_d_n<CH>(t);
            if (lane == 0) {
#pragma unroll
                for (int c = 0; c < CH; ++c) {
                    if (TO_SM) sm.o[i][col0 + c0 + c] = mx_round_bf((float)t[c]);
                    else og[(size_t)i * og_stride + col0 + c0 + c] = mx_round_bf((float)t[c]);
                }
            }
        }
    }
}

// Phase C: the gated RMSNorm with z of each row (warp i < M: row i), from sm (o, zs) into out [M, VALUE_DIM].
__device__ __forceinline__ void mx_gdn_rows_out(const MxGdnSmem& sm, mx_u16* __restrict__ out, int M, int j, int lane,
                                                int warp) {
    if (warp < M) {
        const int i = warp;
        const size_t base = (size_t)i * QMK_GDN_VALUE_DIM + (size_t)j * QMK_GDN_DV + lane * 4;
        const float4 zr = sm.zs[i][lane], wr = sm.zs[QMK_MAX_ROWS][lane];
        const float sz[4] = {zr.x, zr.y, zr.z, zr.w}, wn[4] = {wr.x, wr.y, wr.z, wr.w};
        float x[4];
        mx_u16 y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = sm.o[i][lane * 4 + e];
        mx_head_norm_gated_w<4>(x, sz, wn, y);
        uint2 yv;
        yv.x = (unsigned)y[0] | ((unsigned)y[1] << 16);
        yv.y = (unsigned)y[2] | ((unsigned)y[3] << 16);
        *reinterpret_cast<uint2*>(out + base) = yv;
    }
}

// Args: qkv [M, CONV_DIM] (in_proj_qkv output, pre-conv), z [M, VALUE_DIM], hn [M, HIDDEN] (normed hidden);
// ring, state as above; out [M, VALUE_DIM] bf16; pos = position of row 0; pre = mx_gdn_prefetch of head j;
// state_in: null, or a copy of head j's state [DV, DK] fp32 (the megakernel's, in shared memory, copied before its
// dependency wait: the state depends only on the previous step) to read instead of `state`, which is still the one
// written back. Same values, same bits.
// CH: state columns whose warp sums run interleaved (the discrete kernel: all MX_GDN_CPW; the megakernel, short of
// registers: 1); the bits do not depend on it.
// hist, ring_write (prefill, qmk_gdn_prefill_in): the conv inputs of positions pos-hist .. pos-1 are read from the
// rows of qkv before row 0 (qkv[-hist*CONV_DIM ..]) instead of the ring, and ring_write = false leaves the ring
// untouched (the prefill kernel's blocks run their row tiles unordered; qmk_gdn_ring_fill writes the ring after
// the launch). The defaults (0, true) are the decode step. Same values, same bits. Call from all threads of a
// MX_GDN_THREADS block. The step is phases A (mx_gdn_rows_in), B (mx_gdn_rows_recur over the warp's columns) and
// C (mx_gdn_rows_out); prefill runs the same three in separate kernels (gdn.cu).
template <int CH, int MR = QMK_MAX_ROWS>
__device__ __forceinline__ void mx_gdn_step_head_pre(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z,
                                     const mx_u16* __restrict__ hn, mx_u16* __restrict__ ring,
                                     float* __restrict__ state, mx_u16* __restrict__ out, int pos, int M, int j,
                                     const MxGdnPre& pre, MxGdnSmem& sm,
                                     const float* __restrict__ state_in = nullptr, int hist = 0,
                                     bool ring_write = true) {
    static_assert(MX_GDN_CPW % CH == 0, "gdn.cuh: CH must divide the columns per warp");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hk = j / QMK_GDN_HEAD_GROUP;
    const bool writes_qk = (j % QMK_GDN_HEAD_GROUP) == 0;
    float4 S[MX_GDN_CPW];
    float* st = state + ((size_t)j * QMK_GDN_DV + warp * MX_GDN_CPW) * QMK_GDN_DK + lane * 4;
    const float* sr = state_in ? state_in + (warp * MX_GDN_CPW) * QMK_GDN_DK + lane * 4 : st;
    mx_gdn_rows_in<CH, MR, MX_GDN_CPW>(qkv, z, hn, ring, sr, S, pos, M, j, pre, sm, hist, ring_write, tid, lane, warp,
                                       hk, writes_qk);
    mx_gdn_rows_recur<MX_GDN_CPW, CH, true>(S, sm, M, warp * MX_GDN_CPW, lane);
#pragma unroll
    for (int c = 0; c < MX_GDN_CPW; ++c) *reinterpret_cast<float4*>(st + c * QMK_GDN_DK) = S[c];
    __syncthreads();
    mx_gdn_rows_out(sm, out, M, j, lane, warp);
}

// The whole step of value head j (prefetch, then the step, one column's sums at a time): the megakernel's form.
// Weights as mx_gdn_prefetch, the rest as above; MR: the most rows the caller runs (its M = 1 build: 1, so the conv
// inputs fit in registers).
template <int MR = QMK_MAX_ROWS>
__device__ __forceinline__ void mx_gdn_step_head(const mx_u16* __restrict__ qkv, const mx_u16* __restrict__ z,
                                                 const mx_u16* __restrict__ hn, const mx_u16* __restrict__ w_a,
                                                 const mx_u16* __restrict__ w_b, const mx_u16* __restrict__ a_log,
                                                 const mx_u16* __restrict__ dt_bias, const mx_u16* __restrict__ conv_w,
                                                 const mx_u16* __restrict__ norm_w, mx_u16* __restrict__ ring,
                                                 float* __restrict__ state, mx_u16* __restrict__ out, int pos, int M,
                                                 int j, MxGdnSmem& sm, const float* __restrict__ state_in = nullptr) {
    MxGdnPre pre;
    mx_gdn_prefetch(w_a, w_b, a_log, dt_bias, conv_w, norm_w, j, pre);
    mx_gdn_step_head_pre<1, MR>(qkv, z, hn, ring, state, out, pos, M, j, pre, sm, state_in);
}

// attention.cuh — gated full-attention decode over a paged KV cache, M <= QMK_MAX_ROWS rows
// (article Part 3.5; spec §3.3; HF Qwen3_5Attention + eager_attention_forward, transformers 5.x).
//
// Four stages (device functions; attention.cu wraps each as one kernel):
//   prep    per (row, head), one warp: q|gate split, q/k (1+w) RMSNorm, partial RoPE (bf16 math as HF),
//           K/V append into the page of position pos+row; q -> q_out [M, NQ, HD] bf16
//   scores  per (partition p, kv head h), 16 warps: s = bf16(bf16(q.k) * 1/sqrt(hd)) for the group's query
//           heads -> scores [M, NQ, cap] bf16; per-partition stats m = max s, l = sum exp(s - m)
//   values  per (p, h): global (M, L) merged over partitions in partition order; p_j = bf16(exp(s_j - M) / L);
//           partial o_p = fp32(sum p_j v_j in float64) -> partial [M, NQ, P, HD] fp32
//   reduce  per (row, q head): o = bf16(fp32 sum of o_p in partition order); out = bf16(o * bf16(sigmoid(gate)))
// Rounding points are those of assembler/ref/attention.py (float64 sums and exp, rounded to fp32 once).
//
// Row i (position pos+i) sees keys [0, pos+i] and uses the partitions of its own context L = pos+i+1
// (numerics.attn_partition_range): every sum runs over keys of that row's ranges in an order fixed by the
// absolute key index (stats: lane = j % 32; values: group = j % NG, ascending j, groups combined in order),
// so a row's result does not depend on M or on the other rows.
//
// Paged KV (one layer): element (page, kv, h, t, d) at kv + page*page_stride + ((kv*NKV + h)*PAGE + t)*HD + d,
// kv = 0 for K (after norm + RoPE), 1 for V; key position j lives in page page_table[j / PAGE], slot j % PAGE.
#pragma once
#include "norm.cuh"

// Numerics choices, passed by discrete/attention.py (extra_defines); the fallbacks below repeat the same rules
// so that the offline compile check (config defines only) builds the same code.
#ifndef QMK_PAGE
#define QMK_PAGE 256                                   // KV page, tokens (DESIGN: 256-token pages)
#endif
#ifndef QMK_MAX_ROWS
#define QMK_MAX_ROWS 8                                 // assembler.numerics.MAX_ROWS
#endif
#ifndef QMK_ATTN_PARTS
#define QMK_ATTN_PARTS (132 / QMK_N_KV_HEADS)          // assembler.numerics.attn_partitions
#endif
#ifndef QMK_ATTN_SCALE
#define QMK_ATTN_SCALE (1.0f / __fsqrt_rn((float)QMK_HEAD_DIM))  // fp32(head_dim^-0.5)
#endif

#define MX_HD QMK_HEAD_DIM
#define MX_G QMK_GQA_GROUP
#define MX_ATT_THREADS 512
#define MX_ATT_WARPS (MX_ATT_THREADS / 32)
#define MX_NG (MX_ATT_THREADS / (MX_HD / 2))   // key groups in the value pass (each thread owns 2 dims)
#define MX_TILE 256                            // keys per p tile in the value pass
#define MX_RB 2                                // rows per register chunk in the value pass
#define MX_KB 4                                // keys per warp round in the score pass (loads in flight)
#define MX_KB_HOIST 8                          // the same, discrete score kernel (queries in registers)
#define MX_ATT_SC_THREADS 256                  // discrete score kernel: 8 warps, up to 255 registers
#define MX_VB 8                                // keys per thread round in the value pass (loads in flight)

static_assert(MX_HD == 256, "attention.cuh: a lane owns 8 of 256 head dims");
static_assert(QMK_ROTARY_DIM == 64, "attention.cuh: RoPE partner lane = lane ^ 4 and one angle per lane assume 64 rotary dims");
static_assert(MX_ATT_THREADS % (MX_HD / 2) == 0, "attention.cuh: value pass thread split");

struct MxRange { int lo, hi; };

// fp32(exp(x)) computed in float64 (the reference's rounding)
__device__ __forceinline__ float mx_exp_f(float x) { return (float)exp((double)x); }

// keys of partition p for a context of L keys (assembler.numerics.attn_partition_range)
__device__ __forceinline__ MxRange mx_part_range(int L, int p) {
    const int c = (L + QMK_ATTN_PARTS - 1) / QMK_ATTN_PARTS;
    MxRange r;
    r.lo = min(p * c, L);
    r.hi = min((p + 1) * c, L);
    return r;
}

__device__ __forceinline__ size_t mx_kv_off(const int* __restrict__ page_table, long long page_stride, int kv,
                                            int h, int j) {
    return (size_t)page_table[j / QMK_PAGE] * page_stride +
           ((size_t)(kv * QMK_N_KV_HEADS + h) * QMK_PAGE + (j % QMK_PAGE)) * MX_HD;
}

// ---------------------------------------------------------------- prep: one warp per (row i, head hh)
// hh < NQ: query head; else kv head hh - NQ. qg [M, 2*NQ*HD], k/v [M, NKV*HD] bf16; inv_freq [ROT/2] fp32.
__device__ void mx_attn_prep(const mx_u16* __restrict__ qg, const mx_u16* __restrict__ kin,
                             const mx_u16* __restrict__ vin, const mx_u16* __restrict__ q_norm_w,
                             const mx_u16* __restrict__ k_norm_w, const float* __restrict__ inv_freq,
                             const int* __restrict__ page_table, long long page_stride, mx_u16* __restrict__ kv,
                             mx_u16* __restrict__ q_out, int pos, int i, int hh) {
    const int lane = threadIdx.x & 31;
    const bool isq = hh < QMK_N_Q_HEADS;
    const int h = isq ? hh : hh - QMK_N_Q_HEADS;
    const mx_u16* src = isq ? qg + (size_t)i * 2 * QMK_N_Q_HEADS * MX_HD + (size_t)h * 2 * MX_HD
                            : kin + (size_t)i * QMK_N_KV_HEADS * MX_HD + (size_t)h * MX_HD;
    const uint4 raw = *reinterpret_cast<const uint4*>(src + lane * 8);
    const mx_u16* rv = reinterpret_cast<const mx_u16*>(&raw);
    float x[8];
    mx_u16 y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = mx_bf2f(rv[e]);
    mx_head_norm1pw<8>(x, isq ? q_norm_w : k_norm_w, y);
    // partial RoPE on dims [0, ROT): d pairs with d +- ROT/2, held by lane ^ 4. The ROT/2 = 32 angles of position
    // p are computed once each, lane f taking frequency f (float64 cos / sin in parallel rather than 8 in a row
    // per lane), and fetched by the lanes that own the dims (same values, same rounding).
    const int p = pos + i;
    const float ang = __fmul_rn((float)p, inv_freq[lane]);
    const float cf = mx_round_bf((float)cos((double)ang)), sf = mx_round_bf((float)sin((double)ang));
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float part = mx_bf2f((mx_u16)__shfl_xor_sync(0xffffffffu, (unsigned)y[e], 4));
        const int d = lane * 8 + e;
        const float c = __shfl_sync(0xffffffffu, cf, d % (QMK_ROTARY_DIM / 2));
        const float s = __shfl_sync(0xffffffffu, sf, d % (QMK_ROTARY_DIM / 2));
        if (d < QMK_ROTARY_DIM) {
            const float rot = d < QMK_ROTARY_DIM / 2 ? -part : part;
            const float a = mx_round_bf(__fmul_rn(mx_bf2f(y[e]), c)), b = mx_round_bf(__fmul_rn(rot, s));
            y[e] = mx_f2bf(__fadd_rn(a, b));
        }
    }
    uint4 o;
    mx_u16* ov = reinterpret_cast<mx_u16*>(&o);
#pragma unroll
    for (int e = 0; e < 8; ++e) ov[e] = y[e];
    if (isq) {
        *reinterpret_cast<uint4*>(q_out + ((size_t)i * QMK_N_Q_HEADS + h) * MX_HD + lane * 8) = o;
    } else {
        *reinterpret_cast<uint4*>(kv + mx_kv_off(page_table, page_stride, 0, h, p) + lane * 8) = o;
        *reinterpret_cast<uint4*>(kv + mx_kv_off(page_table, page_stride, 1, h, p) + lane * 8) =
            *reinterpret_cast<const uint4*>(vin + (size_t)i * QMK_N_KV_HEADS * MX_HD + (size_t)h * MX_HD + lane * 8);
    }
}

// ---------------------------------------------------------------- scores + per-partition stats
// Block (p, h), NT threads. scores [M, NQ, cap] bf16; stats_m/stats_l [M, NQ, P] fp32.
// Every score is s = bf16(bf16(fp32(Σ_d q_d·k_d)) · scale): lane l holds dims 8l..8l+7, its 8 exact products are
// summed in float64 in dim order, the warp's lanes by mx_warp_sum_d's butterfly (HOIST: the G heads' butterflies of
// a key interleaved, same adds in the same order), rounded once. HOIST (the discrete kernel, 256 threads, registers to spare):
// a row's queries are widened to float64 once and held in registers, rows outer, keys inner; otherwise (the
// megakernel's 128-register budget) keys outer, rows inner, queries widened per key. Same bits either way.
template <int NT, bool HOIST>
__device__ __forceinline__ void mx_attn_scores_t(const mx_u16* __restrict__ q_in, const mx_u16* __restrict__ kv,
                                                 const int* __restrict__ page_table, long long page_stride,
                                                 mx_u16* __restrict__ scores, int cap, float* __restrict__ stats_m,
                                                 float* __restrict__ stats_l, int pos, int M, int p, int h) {
    constexpr int NW = NT / 32, KB = HOIST ? MX_KB_HOIST : MX_KB;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto store = [&](const double (&t)[MX_G], int i, int j) {  // lane g < G stores head g's score of key j, row i
        double v = t[0];
#pragma unroll
        for (int g = 1; g < MX_G; ++g) v = lane == g ? t[g] : v;  // selects, no branch
        if (lane < MX_G)
            scores[((size_t)i * QMK_N_Q_HEADS + h * MX_G + lane) * cap + j] =
                mx_f2bf(__fmul_rn(mx_round_bf((float)v), QMK_ATTN_SCALE));
    };
    if (HOIST) {
        for (int i = 0; i < M; ++i) {
            const MxRange r = mx_part_range(pos + i + 1, p);
            if (r.lo >= r.hi) continue;
            double qd[MX_G][8];
#pragma unroll
            for (int g = 0; g < MX_G; ++g) {
                const uint4 qr = *reinterpret_cast<const uint4*>(q_in + ((size_t)i * QMK_N_Q_HEADS + h * MX_G + g) * MX_HD + lane * 8);
                const mx_u16* qp = reinterpret_cast<const mx_u16*>(&qr);
#pragma unroll
                for (int e = 0; e < 8; ++e) qd[g][e] = (double)mx_bf2f(qp[e]);
            }
            for (int jb = r.lo + warp; jb < r.hi; jb += KB * NW) {
                uint4 kr[KB];
#pragma unroll
                for (int u = 0; u < KB; ++u) {
                    const int j = jb + u * NW;
                    if (j < r.hi) kr[u] = *reinterpret_cast<const uint4*>(kv + mx_kv_off(page_table, page_stride, 0, h, j) + lane * 8);
                }
#pragma unroll
                for (int u = 0; u < KB; ++u) {
                    const int j = jb + u * NW;
                    if (j >= r.hi) break;
                    const mx_u16* kp = reinterpret_cast<const mx_u16*>(&kr[u]);
                    double kd[8], t[MX_G];
#pragma unroll
                    for (int e = 0; e < 8; ++e) kd[e] = (double)mx_bf2f(kp[e]);
#pragma unroll
                    for (int g = 0; g < MX_G; ++g) {
                        double sd = 0.0;
#pragma unroll
                        for (int e = 0; e < 8; ++e) sd = __fma_rn(qd[g][e], kd[e], sd);
                        t[g] = sd;
                    }
                    mx_warp_sum_d_n<MX_G>(t);
                    store(t, i, j);
                }
            }
        }
    } else {
        int lo = 0x7fffffff, hi = 0;
        for (int i = 0; i < M; ++i) {
            const MxRange r = mx_part_range(pos + i + 1, p);
            if (r.lo < r.hi) { lo = min(lo, r.lo); hi = max(hi, r.hi); }
        }
        if (lo >= hi) lo = hi = 0;  // no keys here: keep lo + warp from overflowing
        // each warp takes KB keys per round (lo+warp, lo+warp+NW, ...), loads them all, then scores them
        for (int jb = lo + warp; jb < hi; jb += KB * NW) {
            uint4 kr[KB];
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                const int j = jb + u * NW;
                if (j < hi) kr[u] = *reinterpret_cast<const uint4*>(kv + mx_kv_off(page_table, page_stride, 0, h, j) + lane * 8);
            }
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                const int j = jb + u * NW;
                if (j >= hi) break;
                const mx_u16* kp = reinterpret_cast<const mx_u16*>(&kr[u]);
                float kf[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) kf[e] = mx_bf2f(kp[e]);
                for (int i = 0; i < M; ++i) {
                    const MxRange r = mx_part_range(pos + i + 1, p);
                    if (j < r.lo || j >= r.hi) continue;
                    double t[MX_G];
#pragma unroll
                    for (int g = 0; g < MX_G; ++g) {
                        const uint4 qr = *reinterpret_cast<const uint4*>(q_in + ((size_t)i * QMK_N_Q_HEADS + h * MX_G + g) * MX_HD + lane * 8);
                        const mx_u16* qp = reinterpret_cast<const mx_u16*>(&qr);
                        double sd = 0.0;
#pragma unroll
                        for (int e = 0; e < 8; ++e) sd = __fma_rn((double)mx_bf2f(qp[e]), (double)kf[e], sd);
                        t[g] = mx_warp_sum_d(sd);  // one head at a time (registers)
                    }
                    store(t, i, j);
                }
            }
        }
    }
    __syncthreads();  // the block's score writes are visible to its own threads after the barrier
    for (int t = warp; t < M * MX_G; t += NW) {
        const int i = t / MX_G, qh = h * MX_G + t % MX_G;
        const MxRange r = mx_part_range(pos + i + 1, p);
        const mx_u16* sr = scores + ((size_t)i * QMK_N_Q_HEADS + qh) * cap;
        const int j0 = r.lo + ((lane - r.lo) % 32 + 32) % 32;  // first j >= lo with j % 32 == lane
        float m = __int_as_float(0xff800000);
#pragma unroll 8
        for (int j = j0; j < r.hi; j += 32) m = fmaxf(m, mx_bf2f(sr[j]));
        m = mx_warp_max(m);
        double l = 0.0;
#pragma unroll 8
        for (int j = j0; j < r.hi; j += 32) l = __dadd_rn(l, (double)mx_exp_f(__fsub_rn(mx_bf2f(sr[j]), m)));
        l = mx_warp_sum_d(l);
        if (lane == 0) {
            const size_t o = ((size_t)i * QMK_N_Q_HEADS + qh) * QMK_ATTN_PARTS + p;
            stats_m[o] = m;
            stats_l[o] = (float)l;
        }
    }
}

// The megakernel's form (MX_ATT_THREADS threads, queries widened per key).
__device__ void mx_attn_scores(const mx_u16* __restrict__ q_in, const mx_u16* __restrict__ kv,
                               const int* __restrict__ page_table, long long page_stride,
                               mx_u16* __restrict__ scores, int cap, float* __restrict__ stats_m,
                               float* __restrict__ stats_l, int pos, int M, int p, int h) {
    mx_attn_scores_t<MX_ATT_THREADS, false>(q_in, kv, page_table, page_stride, scores, cap, stats_m, stats_l, pos, M,
                                            p, h);
}

// ---------------------------------------------------------------- values: p_j under global (M, L), p.V
// PT: how the tile of p_j (bf16 values) is held: double (the discrete kernel: widened once per tile, 24 KB) or
// mx_u16 (the megakernel: 6 KB, widened at each use; its shared memory is also its L1's). Same values either way.
template <typename PT>
struct MxAttnValSmemT {
    float gmax[QMK_MAX_ROWS][MX_G], gsum[QMK_MAX_ROWS][MX_G];
    double red[MX_G][MX_HD];                   // key-group combine of the float64 partial sums
    PT pt[MX_RB][MX_G][MX_TILE];
};
typedef MxAttnValSmemT<mx_u16> MxAttnValSmem;      // the megakernel's
typedef MxAttnValSmemT<double> MxAttnValSmemWide;  // the discrete kernel's
__device__ __forceinline__ void mx_pt_put(double& d, float pv) { d = (double)mx_round_bf(pv); }
__device__ __forceinline__ void mx_pt_put(mx_u16& d, float pv) { d = mx_f2bf(pv); }
__device__ __forceinline__ double mx_pt_get(double d) { return d; }
__device__ __forceinline__ double mx_pt_get(mx_u16 d) { return (double)mx_bf2f(d); }

// Block (p, h). partial [M, NQ, P, HD] fp32 (written for the non-empty partitions of each row only).
template <typename PT>
__device__ void mx_attn_values(const mx_u16* __restrict__ kv, const int* __restrict__ page_table,
                               long long page_stride, const mx_u16* __restrict__ scores, int cap,
                               const float* __restrict__ stats_m, const float* __restrict__ stats_l,
                               float* __restrict__ partial, int pos, int M, int p, int h, MxAttnValSmemT<PT>& sm) {
    const int tid = threadIdx.x;
    // merge the partition stats: one warp per (row, query head), lane l holding partitions l, l + 32, ... (loads
    // and float64 exps in parallel); M = their max (exact in any order); L = fp32 sum in partition order, from 0
    {
        constexpr int PL = (QMK_ATTN_PARTS + 31) / 32;
        const int lane = tid & 31;
        for (int t = tid >> 5; t < M * MX_G; t += MX_ATT_WARPS) {
            const int i = t / MX_G, g = t % MX_G, qh = h * MX_G + g;
            const int L = pos + i + 1, c = (L + QMK_ATTN_PARTS - 1) / QMK_ATTN_PARTS;  // partition q has keys iff q·c < L
            const size_t b = ((size_t)i * QMK_N_Q_HEADS + qh) * QMK_ATTN_PARTS;
            float pm[PL], pl[PL];
            float gm = __int_as_float(0xff800000);
#pragma unroll
            for (int u = 0; u < PL; ++u) {
                const int q = lane + 32 * u;
                pm[u] = pl[u] = 0.0f;
                if (q < QMK_ATTN_PARTS && q * c < L) {
                    pm[u] = stats_m[b + q];
                    pl[u] = stats_l[b + q];
                    gm = fmaxf(gm, pm[u]);
                }
            }
            gm = mx_warp_max(gm);
#pragma unroll
            for (int u = 0; u < PL; ++u) pl[u] = __fmul_rn(pl[u], mx_exp_f(__fsub_rn(pm[u], gm)));
            float gl = 0.0f;
#pragma unroll
            for (int q = 0; q < QMK_ATTN_PARTS; ++q) {
                const float term = __shfl_sync(0xffffffffu, pl[q / 32], q % 32);
                if (q * c < L) gl = __fadd_rn(gl, term);
            }
            if (lane == 0) {
                sm.gmax[i][g] = gm;
                sm.gsum[i][g] = gl;
            }
        }
    }
    const int grp = tid / (MX_HD / 2), d2 = (tid % (MX_HD / 2)) * 2;
    for (int r0 = 0; r0 < M; r0 += MX_RB) {
        const int nr = min(MX_RB, M - r0);
        int lo = 0x7fffffff, hi = 0;
        MxRange rr[MX_RB];
#pragma unroll
        for (int a = 0; a < MX_RB; ++a) {
            rr[a] = a < nr ? mx_part_range(pos + r0 + a + 1, p) : MxRange{0, 0};
            if (rr[a].lo < rr[a].hi) { lo = min(lo, rr[a].lo); hi = max(hi, rr[a].hi); }
        }
        if (lo >= hi) lo = hi = 0;
        double acc[MX_RB][MX_G][2];  // exact bf16 products summed in float64 (order-free), per key group
#pragma unroll
        for (int a = 0; a < MX_RB; ++a)
#pragma unroll
            for (int g = 0; g < MX_G; ++g) acc[a][g][0] = acc[a][g][1] = 0.0;
        for (int t0 = lo; t0 < hi; t0 += MX_TILE) {
            __syncthreads();  // gmax/gsum ready (first pass); previous tile consumed
#pragma unroll
            for (int t = tid; t < MX_RB * MX_G * MX_TILE; t += MX_ATT_THREADS) {  // constant trip count
                const int a = t / (MX_G * MX_TILE), g = (t / MX_TILE) % MX_G, jj = t % MX_TILE, j = t0 + jj;
                float pv = 0.0f;
                const MxRange ra = mx_part_range(pos + r0 + a + 1, p);  // not rr[a]: runtime index
                if (a < nr && j >= ra.lo && j < ra.hi) {
                    const int i = r0 + a, qh = h * MX_G + g;
                    const float s = mx_bf2f(scores[((size_t)i * QMK_N_Q_HEADS + qh) * cap + j]);
                    pv = __fdiv_rn(mx_exp_f(__fsub_rn(s, sm.gmax[i][g])), sm.gsum[i][g]);
                }
                mx_pt_put(sm.pt[a][g][jj], pv);
            }
            __syncthreads();
            const int tend = min(t0 + MX_TILE, hi);
            // keys j = jfirst, jfirst + NG, ... ascending; MX_VB of them loaded before any is accumulated
            for (int jb = t0 + ((grp - t0) % MX_NG + MX_NG) % MX_NG; jb < tend; jb += MX_VB * MX_NG) {
                unsigned vv[MX_VB];
#pragma unroll
                for (int u = 0; u < MX_VB; ++u) {
                    const int j = jb + u * MX_NG;
                    if (j < tend) vv[u] = *reinterpret_cast<const unsigned*>(kv + mx_kv_off(page_table, page_stride, 1, h, j) + d2);
                }
#pragma unroll
                for (int u = 0; u < MX_VB; ++u) {
                    const int j = jb + u * MX_NG;
                    if (j >= tend) break;
                    const double v0 = mx_bf2f((mx_u16)(vv[u] & 0xffffu)), v1 = mx_bf2f((mx_u16)(vv[u] >> 16));
#pragma unroll
                    for (int a = 0; a < MX_RB; ++a) {
                        if (j < rr[a].lo || j >= rr[a].hi) continue;
#pragma unroll
                        for (int g = 0; g < MX_G; ++g) {
                            const double pv = mx_pt_get(sm.pt[a][g][j - t0]);
                            acc[a][g][0] = __fma_rn(pv, v0, acc[a][g][0]);
                            acc[a][g][1] = __fma_rn(pv, v1, acc[a][g][1]);
                        }
                    }
                }
            }
        }
        // combine the key groups in group order (float64), round once to fp32 per partition
#pragma unroll
        for (int a = 0; a < MX_RB; ++a) {
            for (int src = 1; src < MX_NG; ++src) {
                __syncthreads();
                if (grp == src)
#pragma unroll
                    for (int g = 0; g < MX_G; ++g) { sm.red[g][d2] = acc[a][g][0]; sm.red[g][d2 + 1] = acc[a][g][1]; }
                __syncthreads();
                if (grp == 0)
#pragma unroll
                    for (int g = 0; g < MX_G; ++g) {
                        acc[a][g][0] = __dadd_rn(acc[a][g][0], sm.red[g][d2]);
                        acc[a][g][1] = __dadd_rn(acc[a][g][1], sm.red[g][d2 + 1]);
                    }
            }
            if (grp == 0 && rr[a].lo < rr[a].hi) {
#pragma unroll
                for (int g = 0; g < MX_G; ++g) {
                    const int i = r0 + a, qh = h * MX_G + g;
                    float* dst = partial + (((size_t)i * QMK_N_Q_HEADS + qh) * QMK_ATTN_PARTS + p) * MX_HD + d2;
                    *reinterpret_cast<float2*>(dst) = make_float2((float)acc[a][g][0], (float)acc[a][g][1]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------- reduce + sigmoid gate: block (i, qh), HD threads
__device__ void mx_attn_reduce(const float* __restrict__ partial, const mx_u16* __restrict__ qg,
                               mx_u16* __restrict__ out, int pos, int i, int qh) {
    const int d = threadIdx.x;
    const int L = pos + i + 1;
    const float* src = partial + ((size_t)i * QMK_N_Q_HEADS + qh) * QMK_ATTN_PARTS * MX_HD + d;
    const int c = (L + QMK_ATTN_PARTS - 1) / QMK_ATTN_PARTS;  // partition q has keys iff q·c < L
    float acc = 0.0f;  // o = fp32(o + o_p) in partition order, from 0 (reference attn_decode_group)
#pragma unroll
    for (int q0 = 0; q0 < QMK_ATTN_PARTS; q0 += 8) {
        float v[8];  // 8 partitions' values loaded before any is added (empty ones: in bounds, never used)
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (q0 + u < QMK_ATTN_PARTS) v[u] = src[(size_t)(q0 + u) * MX_HD];
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (q0 + u < QMK_ATTN_PARTS && (q0 + u) * c < L) acc = __fadd_rn(acc, v[u]);
    }
    const float o = mx_round_bf(acc);
    const float gt = mx_bf2f(qg[(size_t)i * 2 * QMK_N_Q_HEADS * MX_HD + (size_t)qh * 2 * MX_HD + MX_HD + d]);
    out[((size_t)i * QMK_N_Q_HEADS + qh) * MX_HD + d] = mx_f2bf(__fmul_rn(o, mx_round_bf(mx_sigmoid(gt))));
}

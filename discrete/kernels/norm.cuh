// norm.cuh — the three RMSNorm forms of Qwen3.5 as device functions (article Part 3.3; spec §3.1), with the
// rounding points of the reference ops (assembler/ref/ops.py rmsnorm, rmsnorm_gated):
//
//   rstd         var = fp32(Σx² / n) with the sum in float64; rstd = fp32(1 / sqrt(fp64(fp32(var + eps))))
//   (1+w) form   y = bf16( fp32(f32(x) * rstd) * fp32(1 + f32(w)) )   (HF Qwen3_5RMSNorm; w zero-centred)
//   per-head     the same math over one head_dim-wide q/k head, one warp per head
//   gated        n = bf16(f32(x) * rstd); wn = bf16(f32(w) * f32(n)) (plain w);
//                y = bf16(f32(wn) * silu(f32(z)))   (HF Qwen3_5RMSNormGated, norm before gate; silu in
//                float64 rounded to fp32, as the reference's silu64)
//
// Squares of bf16 values are exact in float64 and their sum is exact for any realistic dynamic range, so the
// float64 sum makes the statistic independent of the reduction order (and equal to the reference's). The order
// is fixed anyway: each thread sums i = tid, tid+NT, ... ascending; xor butterfly in the warp (offsets 16..1,
// every lane ends with the same bits); warp totals added in warp order.
// Self-contained: no includes; bf16 values are carried as their uint16 bit patterns.
#pragma once

#ifndef QMK_RMS_EPS
#error "norm.cuh: QMK_RMS_EPS must be defined (discrete.build.translation_unit defines it)"
#endif

typedef unsigned short mx_u16;  // a bf16 bit pattern
typedef unsigned int mx_u32;

// ---------------------------------------------------------------- bf16 bit helpers (distinct names from
// common.cuh so both headers can be included in one translation unit)
__device__ __forceinline__ float mx_bf2f(mx_u16 b) { return __uint_as_float(((mx_u32)b) << 16); }

// float -> bf16, round to nearest even; NaN stays NaN (quiet bit set).
__device__ __forceinline__ mx_u16 mx_f2bf(float f) {
    mx_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (mx_u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (mx_u16)(u >> 16);
}

__device__ __forceinline__ float mx_round_bf(float f) { return mx_bf2f(mx_f2bf(f)); }

// fp32(1/sqrt(x)) computed in float64: one rounding, as the reference ops
__device__ __forceinline__ float mx_rsqrt_rn(float x) { return (float)(1.0 / sqrt((double)x)); }

// silu / sigmoid in float64, rounded to fp32 (reference silu64 / sigmoid64)
__device__ __forceinline__ float mx_silu(float x) { const double d = x; return (float)(d / (1.0 + exp(-d))); }
__device__ __forceinline__ float mx_sigmoid(float x) { return (float)(1.0 / (1.0 + exp(-(double)x))); }

// xor-butterfly warp sum: every lane returns the same bits (fp add is commutative)
__device__ __forceinline__ float mx_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double mx_warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// N independent xor-butterfly sums run interleaved (their latencies overlap); each value sees exactly the adds of
// mx_warp_sum_d, in the same order, so the bits are the same.
template <int N>
__device__ __forceinline__ void mx_warp_sum_d_n(double (&v)[N]) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int n = 0; n < N; ++n) v[n] = __dadd_rn(v[n], __shfl_xor_sync(0xffffffffu, v[n], o));
    }
}

__device__ __forceinline__ float mx_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// rstd from a float64 sum of squares over n elements: var = fp32(ss / n); fp32(1/sqrt(var + eps))
__device__ __forceinline__ float mx_rstd(double ss, int n) {
    return mx_rsqrt_rn(__fadd_rn((float)(ss / (double)n), QMK_RMS_EPS));
}

// ---------------------------------------------------------------- (1+w) form, block-wide
// Block sum of one double per thread (NT a multiple of 32, <= 1024): xor butterfly in each warp, warp totals
// added in warp order through red (shared scratch of NT/32 doubles). Every thread returns the same bits.
// Contains __syncthreads(): call from all threads of the block.
template <int NT>
__device__ __forceinline__ double mx_block_sum_d(double s, double* red) {
    s = mx_warp_sum_d(s);
    __syncthreads();  // red may still be read by a previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    double t = red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) t = __dadd_rn(t, red[w]);
    return t;
}

// Sum of squares of bf16 x[0..n) over a block of NT threads, element by element (any n, any alignment).
// Every thread returns the same bits. Contains __syncthreads(): call from all threads of the block.
template <int NT>
__device__ __forceinline__ double mx_block_sumsq(const mx_u16* __restrict__ x, int n, double* red) {
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += NT) {
        const double v = mx_bf2f(x[i]);
        s = __fma_rn(v, v, s);  // v*v is exact: fma == mul + add
    }
    return mx_block_sum_d<NT>(s, red);
}

// rstd of one row (block-wide)
template <int NT>
__device__ __forceinline__ float mx_block_rstd(const mx_u16* __restrict__ x, int n, double* red) {
    return mx_rstd(mx_block_sumsq<NT>(x, n, red), n);
}

// one element of the (1+w) form, given rstd
__device__ __forceinline__ mx_u16 mx_norm1pw(mx_u16 x, float rstd, mx_u16 w) {
    return mx_f2bf(__fmul_rn(__fmul_rn(mx_bf2f(x), rstd), __fadd_rn(1.0f, mx_bf2f(w))));
}

// 16-byte chunks of a row that each thread of the block-wide norm keeps in registers between its two passes
#define MX_NORM_CH 2

// sum of squares of the 8 bf16 of a 16-byte chunk into s, ascending
__device__ __forceinline__ double mx_sumsq8(uint4 v, double s) {
    const mx_u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const double lo = mx_bf2f((mx_u16)(u[k] & 0xffffu)), hi = mx_bf2f((mx_u16)(u[k] >> 16));
        s = __fma_rn(lo, lo, s);
        s = __fma_rn(hi, hi, s);
    }
    return s;
}

// (1+w) form of the 8 elements of a chunk
__device__ __forceinline__ uint4 mx_norm1pw8(uint4 x, float rstd, uint4 w) {
    const mx_u32 a[4] = {x.x, x.y, x.z, x.w}, b[4] = {w.x, w.y, w.z, w.w};
    mx_u32 o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        o[k] = (mx_u32)mx_norm1pw((mx_u16)(a[k] & 0xffffu), rstd, (mx_u16)(b[k] & 0xffffu)) |
               ((mx_u32)mx_norm1pw((mx_u16)(a[k] >> 16), rstd, (mx_u16)(b[k] >> 16)) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Whole (1+w) RMSNorm of M independent rows: x, y [M, n] bf16 with row strides ldx, ldy; w [n] bf16.
// One block does all rows (rows are independent; result per row does not depend on M).
// Rows of n ≤ 8·NT·MX_NORM_CH elements with 16-byte aligned rows go in chunks, because the norm is latency-bound
// (the element-wise two passes took 4.2 k cycles on an idle H200 and 12.5 k inside the megakernel, where every
// in-projection / gate|up GEMV and GDN step starts with one; docs/kernels-mixers.md "RMSNorm"): each thread loads its 16-byte
// chunks of x and w at once, keeps them in registers for the second pass, and stores 16 bytes; other rows go
// element by element (one load per element, x read twice). The statistic is
// the float64 sum of exact squares, so the order change (chunks instead of strided elements) does not move it
// (header comment); every caller of one shape still uses one NT, so the two paths agree to the bit regardless.
template <int NT>
__device__ void mx_rmsnorm_rows(const mx_u16* __restrict__ x, int ldx, const mx_u16* __restrict__ w,
                                mx_u16* __restrict__ y, int ldy, int M, int n, double* red) {
    const int nc = n >> 3;
    const bool vec = (n & 7) == 0 && (ldx & 7) == 0 && (ldy & 7) == 0 && nc <= MX_NORM_CH * NT &&
                     ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w) |
                       reinterpret_cast<unsigned long long>(y)) & 15) == 0;
    for (int m = 0; m < M; ++m) {
        const mx_u16* xr = x + (size_t)m * ldx;
        mx_u16* yr = y + (size_t)m * ldy;
        if (vec) {
            uint4 xv[MX_NORM_CH], wv[MX_NORM_CH];
#pragma unroll
            for (int c = 0; c < MX_NORM_CH; ++c) {
                const int i = threadIdx.x + c * NT;
                if (i < nc) {
                    xv[c] = reinterpret_cast<const uint4*>(xr)[i];
                    wv[c] = reinterpret_cast<const uint4*>(w)[i];
                }
            }
            double s = 0.0;
#pragma unroll
            for (int c = 0; c < MX_NORM_CH; ++c)
                if (threadIdx.x + c * NT < nc) s = mx_sumsq8(xv[c], s);
            const float rstd = mx_rstd(mx_block_sum_d<NT>(s, red), n);
#pragma unroll
            for (int c = 0; c < MX_NORM_CH; ++c) {
                const int i = threadIdx.x + c * NT;
                if (i < nc) reinterpret_cast<uint4*>(yr)[i] = mx_norm1pw8(xv[c], rstd, wv[c]);
            }
        } else {
            const float rstd = mx_block_rstd<NT>(xr, n, red);
            for (int i = threadIdx.x; i < n; i += NT) yr[i] = mx_norm1pw(xr[i], rstd, w[i]);
        }
    }
}

// ---------------------------------------------------------------- per-head (1+w) form, one warp
// A head of 32*PER elements; lane l holds elements [l*PER, (l+1)*PER) in v (fp32 of the bf16 inputs).
// Sum (float64) ascending inside the lane, then the xor butterfly. Writes the bf16 results into out.
template <int PER>
__device__ __forceinline__ void mx_head_norm1pw(const float (&v)[PER], const mx_u16* __restrict__ w,
                                                mx_u16 (&out)[PER]) {
    const int lane = threadIdx.x & 31;
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < PER; ++i) s = __fma_rn((double)v[i], (double)v[i], s);
    const float rstd = mx_rstd(mx_warp_sum_d(s), 32 * PER);
#pragma unroll
    for (int i = 0; i < PER; ++i)
        out[i] = mx_f2bf(__fmul_rn(__fmul_rn(v[i], rstd), __fadd_rn(1.0f, mx_bf2f(w[lane * PER + i]))));
}

// ---------------------------------------------------------------- gated form (GDN output), one warp
// One value head of 32*PER elements: x (bf16 core output, as fp32), sz = mx_silu of the bf16 gate z (fp32), the
// plain weights w of the lane's elements (bf16 values as fp32); lane l owns elements [l*PER, (l+1)*PER). Same sum
// order as above.
template <int PER>
__device__ __forceinline__ void mx_head_norm_gated_w(const float (&x)[PER], const float (&sz)[PER],
                                                     const float (&w)[PER], mx_u16 (&out)[PER]) {
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < PER; ++i) s = __fma_rn((double)x[i], (double)x[i], s);
    const float rstd = mx_rstd(mx_warp_sum_d(s), 32 * PER);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const float n = mx_round_bf(__fmul_rn(x[i], rstd));
        const float wn = mx_round_bf(__fmul_rn(w[i], n));
        out[i] = mx_f2bf(__fmul_rn(wn, sz[i]));
    }
}

// The same with the weights read from w [32*PER] bf16 (lane l's at l*PER ..).
template <int PER>
__device__ __forceinline__ void mx_head_norm_gated(const float (&x)[PER], const float (&z)[PER],
                                                   const mx_u16* __restrict__ w, mx_u16 (&out)[PER]) {
    const int lane = threadIdx.x & 31;
    float wv[PER], sz[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        wv[i] = mx_bf2f(w[lane * PER + i]);
        sz[i] = mx_silu(z[i]);
    }
    mx_head_norm_gated_w<PER>(x, sz, wv, out);
}

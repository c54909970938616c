// common.cuh — bit helpers, tensor-core mma wrapper, 16-byte loads and activations shared by every kernel
// (discrete path and megakernel). Self-contained: no includes, so NVRTC and `nvcc -arch=sm_90` compile it
// without a GPU. bf16 values travel as uint16 bit patterns (no cuda_bf16.h). Names carry a `qmk_` prefix so
// other headers with their own helpers can share a translation unit.
#pragma once

typedef unsigned char qmk_u8;
typedef unsigned short qmk_u16;   // one bf16 bit pattern
typedef unsigned int qmk_u32;     // two bf16 (low half = lower index) or four e4m3 (byte 0 = lowest index)
typedef unsigned long long qmk_u64;

// ---------------------------------------------------------------- bf16 <-> fp32
__device__ __forceinline__ float qmk_bf2f(qmk_u16 h) { return __uint_as_float(((qmk_u32)h) << 16); }

// fp32 -> bf16, round to nearest even (hardware cvt; NaN stays NaN).
__device__ __forceinline__ qmk_u16 qmk_f2bf(float f) {
    qmk_u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// fp32 -> bf16 -> fp32 (the value after a bf16 store).
__device__ __forceinline__ float qmk_round_bf16(float f) { return qmk_bf2f(qmk_f2bf(f)); }

// ---------------------------------------------------------------- e4m3 -> bf16 (exact)
// The e4m3 bits s.eeee.mmm are placed into bf16 as s.0000eeee.mmm0000 (two lanes at once, integer ops), which
// is the e4m3 value times 2^-120 for normals and subnormals alike; one exact bf16x2 multiply by 2^120 (0x7B80)
// restores it (power of two, no overflow: |v| <= 480 · 2^-120 · 2^120). Every finite e4m3 value is a bf16.
// The two e4m3 NaN codes (0x7F, 0xFF) come out as ±480, not NaN: checkpoints never hold them (max 448).
__device__ __forceinline__ qmk_u32 qmk_e4m3x2_placed_to_bf16x2(qmk_u32 a) {  // a = [0, b0, 0, b1] (bytes)
    qmk_u32 t = (a & 0x80008000u) | ((a >> 4) & 0x07F007F0u);
    qmk_u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(t), "r"(0x7B807B80u));
    return r;
}

// Four e4m3 in one word (byte i = element i) -> bf16x2 (elements 0,1) and bf16x2 (elements 2,3).
__device__ __forceinline__ void qmk_e4m3x4_to_bf16(qmk_u32 w, qmk_u32& lo, qmk_u32& hi) {
    lo = qmk_e4m3x2_placed_to_bf16x2(__byte_perm(w, 0u, 0x1404));
    hi = qmk_e4m3x2_placed_to_bf16x2(__byte_perm(w, 0u, 0x3424));
}

// ---------------------------------------------------------------- tensor cores
// d += A(16x16 bf16, row) · B(16x8 bf16, col), fp32 accumulate. Fragment layout (PTX ISA, m16n8k16):
// lane = 4·g + c; a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][8+2c..], a3 = A[g+8][8+2c..];
// b0 = B[2c..2c+1][g], b1 = B[8+2c..8+2c+1][g]; d0,d1 = D[g][2c, 2c+1], d2,d3 = D[g+8][2c, 2c+1].
__device__ __forceinline__ void qmk_mma_bf16_16816(float (&d)[4], qmk_u32 a0, qmk_u32 a1, qmk_u32 a2, qmk_u32 a3,
                                                   qmk_u32 b0, qmk_u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- loads
// Streamed weights: read once per step, never reused by this SM; keep them out of L1. QMK_LD_L2_PREFETCH
// (0, 128 or 256) adds an L2 prefetch-size hint: the L2 fetches that many bytes around the address.
#ifndef QMK_LD_L2_PREFETCH
#define QMK_LD_L2_PREFETCH 0
#endif
#if QMK_LD_L2_PREFETCH == 256
#define QMK_LD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::256B.v4.u32"
#elif QMK_LD_L2_PREFETCH == 128
#define QMK_LD_STREAM_OP "ld.global.nc.L1::no_allocate.L2::128B.v4.u32"
#else
#define QMK_LD_STREAM_OP "ld.global.nc.L1::no_allocate.v4.u32"
#endif
__device__ __forceinline__ uint4 qmk_ld_stream16(const void* p) {
    uint4 r;
    asm(QMK_LD_STREAM_OP " {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Read-only data reused by the block (scales): non-coherent path, cached in L1.
__device__ __forceinline__ qmk_u16 qmk_ld_nc_u16(const qmk_u16* p) {
    qmk_u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// Activations: an ordinary (coherent, generic) 16-byte load, so the pointer may be global or shared memory
// and may have been written earlier in the same (mega)kernel.
__device__ __forceinline__ uint4 qmk_ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// ---------------------------------------------------------------- activations (fp32, IEEE division)
// CuPy's NVRTC path compiles with -ftz=true (cupy/cuda/compiler.py), so results below 2^-126 flush to zero,
// and expf(88.8) overflows. For x < -80 e^x is therefore taken as e^(x+64) · e^-64, with silu's factor x applied
// before the e^-64 scaling so that silu stays exact down to x ≈ -92.5 (where the true value leaves fp32's
// normal range); the float64 reference keeps denormals, the GPU gives ±0 below that.
#define QMK_EXP_M64 1.60381089e-28f  // e^-64
__device__ __forceinline__ float qmk_sigmoid(float x) {
    if (x >= 0.f) return 1.0f / (1.0f + expf(-x));
    if (x < -80.f) return __fmul_rn(expf(x + 64.f), QMK_EXP_M64);  // 1 + e^x == 1 in fp32 here
    const float e = expf(x);
    return e / (1.0f + e);
}
__device__ __forceinline__ float qmk_silu(float x) {
    if (x >= 0.f) return x / (1.0f + expf(-x));
    if (x < -80.f) return __fmul_rn(__fmul_rn(x, expf(x + 64.f)), QMK_EXP_M64);
    return __fmul_rn(x, qmk_sigmoid(x));
}

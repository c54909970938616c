// Counter-based hash generator for synthetic weights: the CUDA twin of loader/hashgen.py.
// Same bits as the NumPy side: exact integer ops, correctly rounded fp32 + - * / (explicit _rn intrinsics on
// the device so nothing is contracted into an FMA), RNE casts to bf16 and e4m3 with saturation before.
// Functions are __host__ __device__ and include nothing, so a host C++ compiler builds them too (the CPU
// test compiles this header with g++ and compares it with NumPy).
#pragma once

#ifdef __CUDACC__
#define QMK_HD __host__ __device__ __forceinline__
#else
#define QMK_HD inline
#include <cstring>
#endif

typedef unsigned long long qmk_u64;
typedef unsigned int qmk_u32;

#define QMK_HASH_GOLDEN 0x9E3779B97F4A7C15ull
#define QMK_HASH_NORMAL 0
#define QMK_HASH_UNIFORM 1
#define QMK_HASH_LOG_UNIFORM 2
#define QMK_HASH_BLOCK 128

QMK_HD qmk_u32 qmk_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    qmk_u32 u; memcpy(&u, &f, 4); return u;
#endif
}

QMK_HD float qmk_u2f(qmk_u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f; memcpy(&f, &u, 4); return f;
#endif
}

// correctly rounded fp32 ops; host x86-64 SSE arithmetic is IEEE and gcc does not contract without FMA
QMK_HD float qmk_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
QMK_HD float qmk_add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
QMK_HD float qmk_sub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
QMK_HD float qmk_div(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

// splitmix64 finaliser (Vigna, splitmix64.c)
QMK_HD qmk_u64 qmk_mix64(qmk_u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

QMK_HD qmk_u64 qmk_hash_at(qmk_u64 key, qmk_u64 idx) { return qmk_mix64(key + (idx + 1ull) * QMK_HASH_GOLDEN); }

// ln(x) for positive normal x: x = 2^e·m, m folded into (0.707, 1.414], 2·atanh series in t = (m-1)/(m+1)
QMK_HD float qmk_log_f32(float x) {
    qmk_u32 bits = qmk_f2u(x);
    int e = (int)(bits >> 23) - 127;
    float m = qmk_u2f((bits & 0x7FFFFFu) | 0x3F800000u);
    if (m > 0x1.6a09e6p+0f) { m = qmk_mul(m, 0.5f); e += 1; }
    float t = qmk_div(qmk_sub(m, 1.0f), qmk_add(m, 1.0f));
    float t2 = qmk_mul(t, t);
    float p = 0x1.c71c72p-4f;                      // 1/9
    p = qmk_add(qmk_mul(p, t2), 0x1.24924ap-3f);   // 1/7
    p = qmk_add(qmk_mul(p, t2), 0x1.99999ap-3f);   // 1/5
    p = qmk_add(qmk_mul(p, t2), 0x1.555556p-2f);   // 1/3
    p = qmk_add(qmk_mul(p, t2), 1.0f);
    float r = qmk_mul(qmk_mul(t, p), 2.0f);
    return qmk_add(qmk_mul((float)e, 0x1.62e43p-1f), r);  // e·ln2 + r
}

// fp32 value of element idx of the tensor with `key` (kinds as in loader/hashgen.py)
QMK_HD float qmk_hash_value(qmk_u64 key, int kind, float a, float b, qmk_u64 idx) {
    qmk_u64 h = qmk_hash_at(key, idx);
    if (kind == QMK_HASH_NORMAL) {
        long long c = (long long)((h & 0xFFFFull) + ((h >> 16) & 0xFFFFull) + ((h >> 32) & 0xFFFFull) + (h >> 48));
        return qmk_add(qmk_mul((float)(c - 2 * 65535), a), b);  // |c| < 2^18: exact in fp32
    }
    float u = qmk_mul((float)(qmk_u32)(h >> 40), 0x1p-24f);
    float x = qmk_add(qmk_mul(u, a), b);
    return kind == QMK_HASH_LOG_UNIFORM ? qmk_log_f32(x) : x;
}

// fp32 -> bf16 bits, round to nearest even (finite inputs)
QMK_HD unsigned short qmk_f32_to_bf16(float f) {
    qmk_u32 u = qmk_f2u(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

QMK_HD float qmk_bf16_to_f32(unsigned short h) { return qmk_u2f(((qmk_u32)h) << 16); }

// fp32 -> e4m3fn bits, round to nearest even, saturating to ±448 (the clamp comes first, as on the NumPy side)
QMK_HD unsigned char qmk_f32_to_e4m3(float f) {
    qmk_u32 sign = (qmk_f2u(f) >> 24) & 0x80u;
    float a = qmk_u2f(qmk_f2u(f) & 0x7FFFFFFFu);
    if (a > 448.0f) a = 448.0f;
    qmk_u32 code;
    if (a < 0x1p-6f) {
        // subnormal range: code = rne(a·2^9) in [0, 8]; 8 is the smallest normal's code
        float r = qmk_sub(qmk_add(qmk_mul(a, 512.0f), 0x1p23f), 0x1p23f);
        code = (qmk_u32)r;
    } else {
        qmk_u32 u = qmk_f2u(a);
        u += 0x7FFFFu + ((u >> 20) & 1u);  // round the fp32 mantissa to 3 bits
        code = ((((u >> 23) - 127u + 7u) << 3) | ((u >> 20) & 7u));
    }
    return (unsigned char)(sign | code);
}

// fp8 quantisation of one value given its block's bf16 scale (s = 0 only for an all-zero block)
QMK_HD unsigned char qmk_quantize_e4m3(float w, unsigned short scale_bf16) {
    float s = qmk_bf16_to_f32(scale_bf16);
    if (s == 0.0f) return 0;
    float q = qmk_div(w, s);
    q = q > 448.0f ? 448.0f : (q < -448.0f ? -448.0f : q);
    return qmk_f32_to_e4m3(q);
}

// bf16 bits of a block scale from the block's amax
QMK_HD unsigned short qmk_block_scale(float amax) { return qmk_f32_to_bf16(qmk_div(amax, 448.0f)); }

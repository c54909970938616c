// Kernels that materialise synthetic weights directly in device memory (launched by discrete/synthetic_gpu.py).
// Same bits as loader/hashgen.py + loader/synthetic.py for the same (seed, tensor name, recipe).
#include "hashgen.cuh"

// out[i] = value(start + i) as fp32, i < n. Grid-stride; any launch shape.
extern "C" __global__ void qmk_hash_fill_f32(float* __restrict__ out, qmk_u64 n, qmk_u64 start, qmk_u64 key,
                                             int kind, float a, float b) {
    qmk_u64 stride = (qmk_u64)gridDim.x * blockDim.x;
    for (qmk_u64 i = (qmk_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = qmk_hash_value(key, kind, a, b, start + i);
}

// out[i] = bf16(value(i)) as raw bits, i < n. Grid-stride; any launch shape.
extern "C" __global__ void qmk_hash_fill_bf16(unsigned short* __restrict__ out, qmk_u64 n, qmk_u64 key, int kind,
                                              float a, float b) {
    qmk_u64 stride = (qmk_u64)gridDim.x * blockDim.x;
    for (qmk_u64 i = (qmk_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = qmk_f32_to_bf16(qmk_hash_value(key, kind, a, b, i));
}

#define QMK_HASH_FP8_THREADS 256

// One block per 128x128 weight block: q [rows, cols] e4m3 bits, scale [ceil(rows/128), ceil(cols/128)] bf16
// bits. grid = (ceil(cols/128), ceil(rows/128)), block = QMK_HASH_FP8_THREADS. Values are generated twice
// (amax pass, quantise pass) rather than held in registers; max is order-independent, so it is exact.
extern "C" __global__ void __launch_bounds__(QMK_HASH_FP8_THREADS)
qmk_hash_fill_fp8(unsigned char* __restrict__ q, unsigned short* __restrict__ scale, int rows, int cols, qmk_u64 key,
                  int kind, float a, float b) {
    __shared__ float red[QMK_HASH_FP8_THREADS];
    __shared__ unsigned short s_bits;
    const int r0 = blockIdx.y * QMK_HASH_BLOCK, c0 = blockIdx.x * QMK_HASH_BLOCK;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < QMK_HASH_BLOCK * QMK_HASH_BLOCK; i += QMK_HASH_FP8_THREADS) {
        int r = r0 + i / QMK_HASH_BLOCK, c = c0 + i % QMK_HASH_BLOCK;
        if (r < rows && c < cols)
            amax = fmaxf(amax, fabsf(qmk_hash_value(key, kind, a, b, (qmk_u64)r * cols + c)));
    }
    red[threadIdx.x] = amax;
    __syncthreads();
    for (int w = QMK_HASH_FP8_THREADS / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        s_bits = qmk_block_scale(red[0]);
        scale[(qmk_u64)blockIdx.y * gridDim.x + blockIdx.x] = s_bits;
    }
    __syncthreads();
    const unsigned short s = s_bits;
    for (int i = threadIdx.x; i < QMK_HASH_BLOCK * QMK_HASH_BLOCK; i += QMK_HASH_FP8_THREADS) {
        int r = r0 + i / QMK_HASH_BLOCK, c = c0 + i % QMK_HASH_BLOCK;
        if (r < rows && c < cols) {
            qmk_u64 idx = (qmk_u64)r * cols + c;
            q[idx] = qmk_quantize_e4m3(qmk_hash_value(key, kind, a, b, idx), s);
        }
    }
}

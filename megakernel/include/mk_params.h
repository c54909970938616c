// mk_params.h — the tables the megakernel reads besides the instruction words (megakernel/runner.py builds
// them; its NumPy dtypes are the one source of the layout and pass their offsets as QMK_MKP_* defines, which
// the static_asserts below check at compile time).
#pragma once
#include <cuda/std/cstdint>
#include "control.h"  // discrete/kernels (on the include path)

// One weight-table entry (assembler Program.weights): a projection segment or a norm vector on the device.
struct MkWeight {
  uint64_t ptr;     // fp8 bits [rows, cols] (uint8) or bf16 bits (uint16)
  uint64_t scale;   // bf16 block scales [rows/128, cols/128], or 0 for bf16 weights
  int32_t rows, cols, fp8, pad;
};

// Per-layer tensors that the program's instruction words do not name (GDN_STEP / ATTN read them by layer).
// GDN: t0 in_proj_a [n_v, H], t1 in_proj_b [n_v, H], t2 A_log [n_v], t3 dt_bias [n_v], t4 conv1d [conv_dim, 4],
// t5 norm [d_v]. Attention: t0 q_norm [hd], t1 k_norm [hd]. All bf16 bits.
struct MkLayer {
  uint64_t t[8];
};

// Launch parameters (one struct in device memory; the kernel takes its address).
struct MkParams {
  uint64_t prog;        // const int32 [num_sms, max_len, QMK_ISA_WORDS]
  uint64_t lens;        // const int32 [num_sms]: instructions each SM runs per step (stop-after knob)
  uint64_t counters;    // uint32 [n_counters], monotonic, start at `seed`
  uint64_t bufs;        // uint64 [n_buffers]: device address of each program buffer (state: per layer)
  uint64_t weights;     // MkWeight [n_weights]
  uint64_t layers;      // MkLayer [n_layers]
  uint64_t embed;       // bf16 [V, H]
  uint64_t ctrl;        // QmkControl (device memory, shared with the discrete step)
  uint64_t page_table;  // int32 [max_pages] of the session
  uint64_t inv_freq;    // fp32 [rotary_dim / 2]
  uint64_t host;        // mapped host uint32 [4]: go, quit, steps done, out token (persistent mode)
  uint64_t mirror;      // device uint32 [4]: unused, quit mirror, error code, error detail
  uint64_t timing;      // uint64 [num_sms, max_len, 3] globaltimer stamps (QMK_MK_TIMING builds), or 0
  uint64_t keys;        // uint64 [num_sms, 2]: per SM the head's best logit key and its step (isa.py ARGMAX_KEYS)
  int64_t page_stride;  // elements between pages of the KV pool
  int32_t max_len, att_cap, n_steps, persistent;  // att_cap: key capacity of the attention scores scratch
  uint32_t seed, step_base;  // counter seed; steps this program completed before the launch
  int32_t delay_op, delay_ns;  // debug: instructions of op `delay_op` sleep `delay_ns` before running
};

#ifdef QMK_MKP_SIZE
static_assert(sizeof(MkParams) == QMK_MKP_SIZE, "MkParams size differs from megakernel/runner.py PARAMS_DTYPE");
#ifndef __CUDACC_RTC__  // NVRTC cannot evaluate offsetof in a constant expression; nvcc checks these
static_assert(__builtin_offsetof(MkParams, page_stride) == QMK_MKP_OFF_PAGE_STRIDE, "MkParams layout");
static_assert(__builtin_offsetof(MkParams, seed) == QMK_MKP_OFF_SEED, "MkParams layout");
static_assert(__builtin_offsetof(MkParams, delay_ns) == QMK_MKP_OFF_DELAY_NS, "MkParams layout");
#endif
static_assert(sizeof(MkWeight) == QMK_MKW_SIZE && sizeof(MkLayer) == QMK_MKL_SIZE, "MkWeight/MkLayer size");
#endif

// Error codes the kernel leaves in mirror[2] before trapping (runner.py ERRORS names them).
#define MK_ERR_OPCODE 1
#define MK_ERR_PROLOGUE 2
#define MK_ERR_ROWS 3
#define MK_ERR_FUSED 4
#define MK_ERR_M1 5  // a GEMV or GDN step of M != 1 rows in a module built for M = 1 (QMK_MK_M1)
#define MK_ERR_LOCAL 6  // a LOCAL_REDUCE GEMV with more splits than warps, or an epilogue other than store

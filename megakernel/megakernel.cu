// megakernel.cu — the persistent cooperative megakernel (article Part 6; DESIGN.md): one block per SM executes
// its instruction list from the assembler (assembler/scheduler.py) for one or many decode steps. Dependencies are
// monotonic counters in global memory (sync.cuh): an instruction waits until counter ≥ seed + step·expected +
// offset for each of its waits, runs, then releases its own counter. Every opcode calls THE SAME device functions
// as the discrete kernels on the same slices (gemv.cuh, norm.cuh, gdn.cuh, attention.cuh, lm_head.cuh keys), so
// results are bit-identical to the discrete path; what differs is only who runs which slice and when.
//
// Block size = MX_GDN_THREADS = MX_ATT_THREADS (the block-level GDN / attention functions assume it); GEMV work is
// per warp (a 16-row tile), so its results do not depend on the warp count.
// Dynamic shared memory: [normed x: MAX_ROWS × HIDDEN bf16 | MkSmemTail | GEMV weight rings]; mk_layout reports
// the size.
// The instructions' device functions are in include/, one part per family, included below in this order:
// mk_gemv.cuh (GEMV, GEMV_REDUCE), mk_head.cuh (EMBED, ARGMAX + finish), mk_gdn.cuh (GDN_STEP), mk_attn.cuh
// (the four attention stages); this file keeps the shared layout, the counter waits and the instruction loop.
// qmk: defines megakernel.runner:compile_defines
#include "lm_head.cuh"
#include "gdn.cuh"
#include "attention.cuh"
#include "../../megakernel/include/isa.h"
#include "../../megakernel/include/mk_params.h"
#include "finish.cuh"
#include "../../megakernel/include/sync.cuh"

#ifndef QMK_VALID_VOCAB
#define QMK_VALID_VOCAB QMK_VOCAB  // ids past it are padding rows (discrete.build.config_defines sets it)
#endif
#define MK_THREADS MX_GDN_THREADS
#define MK_WARPS (MK_THREADS / 32)
#define MK_EP_ROWS (QMK_ROW_TILE * MK_WARPS)  // output rows per epilogue round of a split-1 GEMV
static_assert(MX_ATT_THREADS == MK_THREADS, "megakernel: GDN and attention device functions need one block size");
static_assert(MX_HD <= MK_THREADS, "megakernel: the attention reduce uses one thread per head dim");
static_assert(QMK_ISA_WORDS <= MK_THREADS, "megakernel: one thread per instruction word");

struct MkSmemTail {
  union {
    MxGdnSmem gdn;
    MxAttnValSmem att;
    float ep[QMK_MAX_ROWS][2 * MK_EP_ROWS];  // split-1 GEMV tile results: gate (or only) | up
    qmk_u64 keys[MK_WARPS];                  // argmax: per-warp best key
  } u;
  double red[MK_WARPS];                      // RMSNorm block reduction
  unsigned long long best_key;               // the head's best logit key over its rounds (ARGMAX_KEYS)
  int words[QMK_ISA_WORDS];                  // the current instruction
  int xn_tag[4];                             // what xn holds: RMSNorm of (step, norm weight, input buffer, M)
  int flag;                                  // persistent loop: broadcast of "run the next step"
};
#define MK_XN_BYTES (QMK_MAX_ROWS * QMK_HIDDEN * 2)
#ifndef QMK_MK_M1
#define QMK_MK_M1 0  // 1: GEMV tiles built for M = 1 rows (mk_tile)
#endif
#ifndef QMK_MK_RING
#define QMK_MK_RING 0  // GEMV weight ring slots per warp (gemv.cuh qmk_gemv_tile_ring); 0: register-ring tile
#endif
#ifndef QMK_MK_FUSE_REDUCE
// build the fused split-K reduce into mk_gemv (only the fuse_reduce program needs it: the branch alone cost the
// other program 0.57 ms/token, measured, docs/megakernel.md "Compile-time builds")
#define QMK_MK_FUSE_REDUCE 1
#endif
#ifndef QMK_MK_PREFETCH
#define QMK_MK_PREFETCH 0  // 1: a GEMV issues its first RING - 1 ring units per warp before waiting for its input
#endif
#if QMK_MK_PREFETCH && QMK_MK_RING < 2
#error "QMK_MK_PREFETCH needs the shared-memory weight ring (QMK_MK_RING >= 2)"
#endif
#define MK_RING_OFF ((MK_XN_BYTES + sizeof(MkSmemTail) + 127) / 128 * 128)
#define MK_SMEM_BYTES (MK_RING_OFF + MK_WARPS * QMK_MK_RING * QMK_GEMV_UNIT_BYTES)
#ifdef QMK_MK_SMEM_LIMIT
static_assert(MK_SMEM_BYTES <= QMK_MK_SMEM_LIMIT, "megakernel: shared memory layout exceeds the per-block limit");
#endif

__device__ __forceinline__ void mk_fail(const MkParams& P, int code, int detail) {
  uint32_t* mirror = reinterpret_cast<uint32_t*>(P.mirror);
  atomicExch(mirror + 2, (uint32_t)code);
  atomicExch(mirror + 3, (uint32_t)detail);
  __threadfence_system();
  __trap();
}

template <class T> __device__ __forceinline__ T* mk_buf(const MkParams& P, int id) {
  return reinterpret_cast<T*>(reinterpret_cast<const uint64_t*>(P.bufs)[id]);
}

__device__ __forceinline__ int mk_pos(const MkParams& P) {
  return (int)qmk::ld_relaxed_gpu(&reinterpret_cast<QmkControl*>(P.ctrl)->pos);
}

#include "../../megakernel/include/mk_gemv.cuh"

#include "../../megakernel/include/mk_head.cuh"

#include "../../megakernel/include/mk_gdn.cuh"

#include "../../megakernel/include/mk_attn.cuh"

#ifndef QMK_MK_POLL_ACQUIRE
#define QMK_MK_POLL_ACQUIRE 1  // 1: poll counters with acquire loads; 0: relaxed polls, then one acquire (measured slower)
#endif
#ifndef QMK_MK_SPIN_NS
#define QMK_MK_SPIN_NS 0  // __nanosleep between polls of a counter (0: none; 32 measured within noise)
#endif
#if QMK_MK_SPIN_NS > 0
#define MK_SPIN_PAUSE() __nanosleep(QMK_MK_SPIN_NS)
#else
#define MK_SPIN_PAUSE() do { } while (0)
#endif

// Thread 0 spins until every wait of the instruction is met (acquire polls, or relaxed polls then one acquire);
// the barrier after it orders the whole block's later reads (sync.cuh block_wait, for several counters at once).
__device__ __forceinline__ void mk_wait_all(const MkParams& P, const int* w, uint32_t step) {
  if (threadIdx.x == 0) {
    const uint32_t* ctr = reinterpret_cast<const uint32_t*>(P.counters);
    for (int k = 0; k < w[QMK_F_NWAITS]; ++k) {
      const int* t = w + QMK_ISA_WAITS_OFFSET + 3 * k;
      const uint32_t target = P.seed + step * (uint32_t)t[1] + (uint32_t)t[2];
#if QMK_MK_POLL_ACQUIRE
      // every poll an acquire: the load that sees the target is the acquire (no extra L2 round trip after it)
      while (!qmk::reached(qmk::ld_acquire_gpu(ctr + t[0]), target)) { MK_SPIN_PAUSE(); }
#else
      while (!qmk::reached(qmk::ld_relaxed_gpu(ctr + t[0]), target)) { MK_SPIN_PAUSE(); }
      (void)qmk::ld_acquire_gpu(ctr + t[0]);
#endif
    }
    if (w[QMK_F_OP] == P.delay_op) {  // debug: make this op slow, so a missing wait on it shows
      const uint64_t t0 = qmk::globaltimer_ns();
      while (qmk::globaltimer_ns() - t0 < (uint64_t)P.delay_ns) { __nanosleep(1000); }
    }
  }
  __syncthreads();
}

// Persistent mode: wait for the host to release step `n` (1-based in this launch). Block 0's thread 0 is the
// one reader of mapped host memory; it mirrors the go count into the control block's `go` field (and a quit
// request into mirror[1]) for the grid (article Part 6.3). Returns false when the host asked to quit.
__device__ bool mk_wait_go(const MkParams& P, uint32_t n, MkSmemTail& sm) {
  if (threadIdx.x == 0) {
    uint32_t* mirror = reinterpret_cast<uint32_t*>(P.mirror);
    uint32_t* go_dev = &reinterpret_cast<QmkControl*>(P.ctrl)->go;
    int run = -1;
    while (run < 0) {
      if (blockIdx.x == 0) {
        const volatile uint32_t* host = reinterpret_cast<const volatile uint32_t*>(P.host);
        const uint32_t go = qmk::ld_acquire_sys(host);
        if (qmk::reached(go, n)) { qmk::st_release_gpu(go_dev, go); run = 1; }
        else if (qmk::ld_acquire_sys(host + 1)) { qmk::st_release_gpu(mirror + 1, 1u); run = 0; }
      } else {
        if (qmk::reached(qmk::ld_relaxed_gpu(go_dev), n)) { (void)qmk::ld_acquire_gpu(go_dev); run = 1; }
        else if (qmk::ld_relaxed_gpu(mirror + 1)) run = 0;
      }
      if (run < 0) __nanosleep(64);
    }
    sm.flag = run;
  }
  __syncthreads();
  return sm.flag != 0;
}

#ifndef QMK_MK_XN_REUSE
#define QMK_MK_XN_REUSE 1  // 1: a GDN step reuses the normed hidden row its SM's in-projection left in xn
#endif
// The xn tag: after an instruction that leaves RMSNorm(x; w) of M rows in xn (a GEMV's rmsnorm / reduce_rmsnorm
// prologue, a GDN step's own norm), thread 0 records (step, w, x, M); the next instruction's first barrier
// publishes it. Norm weights and SSA buffers are distinct per layer, so the tag names the values.
__device__ __forceinline__ void mk_xn_tag(MkSmemTail& sm, const int* w, uint32_t step) {
  const int op = w[QMK_F_OPCODE], pro = w[QMK_F_SUB] & 15;
  int x = -1;
  if (op == QMK_OP_GEMV && (pro == QMK_PRO_RMSNORM || pro == QMK_PRO_REDUCE_RMSNORM)) x = w[QMK_F_BUF0];
  else if (op == QMK_OP_GDN_STEP) x = w[QMK_F_BUF2];
  else return;  // no other instruction writes xn
  sm.xn_tag[0] = (int)step; sm.xn_tag[1] = w[QMK_F_W1]; sm.xn_tag[2] = x; sm.xn_tag[3] = w[QMK_F_M];
}
__device__ __forceinline__ bool mk_xn_holds(const MkSmemTail& sm, const int* w, uint32_t step) {
  return QMK_MK_XN_REUSE && sm.xn_tag[0] == (int)step && sm.xn_tag[1] == w[QMK_F_W1] &&
         sm.xn_tag[2] == w[QMK_F_BUF2] && sm.xn_tag[3] == w[QMK_F_M];
}

// grid = num_sms (cooperative, 1 block per SM), block MK_THREADS, dynamic shared memory MK_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) mk_main(const MkParams* __restrict__ params) {
  extern __shared__ __align__(16) unsigned char mk_smem[];
  qmk_u16* xn = reinterpret_cast<qmk_u16*>(mk_smem);
  MkSmemTail& sm = *reinterpret_cast<MkSmemTail*>(mk_smem + MK_XN_BYTES);
  const qmk_u32 ring = (qmk_u32)__cvta_generic_to_shared(mk_smem) + MK_RING_OFF +
                       (threadIdx.x >> 5) * QMK_MK_RING * QMK_GEMV_UNIT_BYTES;  // this warp's GEMV weight ring
  const MkParams& P = *params;
  const int sm_id = blockIdx.x, len = reinterpret_cast<const int*>(P.lens)[sm_id];
  const int* prog = reinterpret_cast<const int*>(P.prog) + (size_t)sm_id * P.max_len * QMK_ISA_WORDS;
  if (threadIdx.x == 0) sm.xn_tag[0] = sm.xn_tag[1] = sm.xn_tag[2] = sm.xn_tag[3] = -1;  // xn holds nothing yet
#ifdef QMK_MK_TIMING
  uint64_t* timing = reinterpret_cast<uint64_t*>(P.timing);
#endif
  for (int ls = 0; P.persistent || ls < P.n_steps; ++ls) {
    if (P.persistent && !mk_wait_go(P, (uint32_t)ls + 1u, sm)) break;
    const uint32_t step = P.step_base + (uint32_t)ls + 1u;
    int next = threadIdx.x < QMK_ISA_WORDS && len > 0 ? prog[threadIdx.x] : 0;
    for (int j = 0; j < len; ++j) {
#ifdef QMK_MK_TIMING
      uint64_t t0 = 0;
      if (threadIdx.x == 0) t0 = qmk::globaltimer_ns();
#endif
      if (threadIdx.x < QMK_ISA_WORDS) sm.words[threadIdx.x] = next;
      __syncthreads();
      // prefetch the next instruction's words while this one runs
      if (threadIdx.x < QMK_ISA_WORDS && j + 1 < len) next = prog[(size_t)(j + 1) * QMK_ISA_WORDS + threadIdx.x];
      const int* w = sm.words;
      const bool issued = w[QMK_F_OPCODE] == QMK_OP_GEMV && mk_gemv_prefetch(P, w, ring);
      const bool staged = w[QMK_F_OPCODE] == QMK_OP_GDN_STEP && mk_gdn_prefetch_state(P, w, ring);
      mk_wait_all(P, w, step);
#ifdef QMK_MK_TIMING
      uint64_t t1 = 0;
      if (threadIdx.x == 0) t1 = qmk::globaltimer_ns();
#endif
      switch (w[QMK_F_OPCODE]) {
        case QMK_OP_NOP: break;
        case QMK_OP_EMBED: mk_embed(P, w); break;
        case QMK_OP_GEMV: mk_gemv(P, w, xn, sm, ring, issued, step); break;
        case QMK_OP_GEMV_REDUCE: mk_gemv_reduce(P, w); break;
        case QMK_OP_GDN_STEP:
          mk_gdn(P, w, xn, sm, mk_xn_holds(sm, w, step), staged,
                 reinterpret_cast<const float*>(mk_smem + MK_RING_OFF));
          break;
        case QMK_OP_ATTN_PREP: mk_attn_prep(P, w); break;
        case QMK_OP_ATTN_SCORES: mk_attn_scores(P, w); break;
        case QMK_OP_ATTN_VALUES: mk_attn_values(P, w, sm); break;
        case QMK_OP_ATTN_REDUCE: mk_attn_reduce(P, w); break;
        case QMK_OP_ARGMAX: mk_argmax(P, w, sm, step); break;
        default: if (threadIdx.x == 0) mk_fail(P, MK_ERR_OPCODE, w[QMK_F_OPCODE]);
      }
      if (threadIdx.x == 0) mk_xn_tag(sm, w, step);  // read by the next instruction after its first barrier
      const int bump = w[QMK_F_BUMP], by = w[QMK_F_BUMP_BY];
      if (bump >= 0 && by > 0) qmk::block_bump(reinterpret_cast<uint32_t*>(P.counters) + bump, (uint32_t)by);
      else __syncthreads();
#ifdef QMK_MK_TIMING
      if (threadIdx.x == 0 && timing) {
        uint64_t* slot = timing + ((size_t)sm_id * P.max_len + j) * 3;
        slot[0] = t0; slot[1] = t1; slot[2] = qmk::globaltimer_ns();
      }
#endif
    }
  }
}

// Layout probe: sizes the runner checks against its NumPy dtypes, and the dynamic shared memory to request.
extern "C" __global__ void mk_layout(long long* out) {
  if (threadIdx.x == 0) {
    out[0] = (long long)MK_SMEM_BYTES;
    out[1] = sizeof(MkParams);
    out[2] = sizeof(MkWeight);
    out[3] = sizeof(MkLayer);
    out[4] = MK_THREADS;
    out[5] = QMK_MK_RING;
  }
}

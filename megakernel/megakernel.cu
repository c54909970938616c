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

// The (1+w) RMSNorm of M hidden rows into shared memory (norm.cuh), one call site for the GEMV prologue and the
// GDN step. Not inlined: inlined twice, its 16-byte chunk registers moved the register allocation of the whole
// kernel (spill stores inside the GEMV loop, 312 → 548 B).
// x, y [M, n] (row stride n).
__device__ __noinline__ void mk_rmsnorm(const mx_u16* x, const mx_u16* nw, mx_u16* y, int M, int n, double* red) {
  mx_rmsnorm_rows<MK_THREADS>(x, n, nw, y, n, M, n, red);
}

// The input x [M, K] of a reduce_rmsnorm GEMV (isa.py) into xs (shared memory): the deferred residual GEMV's
// fixed-order split-K reduce + residual epilogue — gemv.cuh's functions, so the same bits as GEMV_REDUCE. For the
// usual split counts (S fixed at compile time) each thread loads MK_REBUILD_BATCH outputs' partials and residuals
// before adding any, so they are in flight together (one element after another, each waits an L2 round trip);
// other S: qmk_gemv_epilogue per element. Not inlined, as mk_rmsnorm. Batch 4: at 5 the M = 1 build spilled more
// (312 / 508 → 332 / 568 B).
#define MK_REBUILD_BATCH 4
template <int SC>
__device__ __forceinline__ void mk_rebuild_rows(const float* part, const qmk_u16* resid, qmk_u16* xs, int M, int K) {
  const int n = M * K;
  for (int base = threadIdx.x; base < n; base += MK_REBUILD_BATCH * MK_THREADS) {
    float v[MK_REBUILD_BATCH][SC];
    qmk_u16 r[MK_REBUILD_BATCH];
#pragma unroll
    for (int b = 0; b < MK_REBUILD_BATCH; ++b) {
      const int i = base + b * MK_THREADS < n ? base + b * MK_THREADS : 0;  // past the end: element 0, not stored
      const int m = i / K;
      qmk_gemv_load_splits<SC>(part, M, K, m, i - m * K, v[b]);
      r[b] = resid[i];
    }
#pragma unroll
    for (int b = 0; b < MK_REBUILD_BATCH; ++b)
      if (base + b * MK_THREADS < n) xs[base + b * MK_THREADS] = qmk_gemv_residual(qmk_gemv_sum_splits<SC>(v[b]), r[b]);
  }
}

__device__ __noinline__ void mk_rebuild_input(const float* part, int S, const qmk_u16* resid, qmk_u16* xs, int M,
                                              int K) {
  switch (S) {  // the 27B's out / o / down: 8; tiny's GDN out / down: 6 (so the GPU tests run this path too)
    case 4: mk_rebuild_rows<4>(part, resid, xs, M, K); return;
    case 6: mk_rebuild_rows<6>(part, resid, xs, M, K); return;
    case 8: mk_rebuild_rows<8>(part, resid, xs, M, K); return;
  }
  for (int i = threadIdx.x; i < M * K; i += MK_THREADS) {
    const int m = i / K;
    xs[i] = qmk_gemv_epilogue<true>(QMK_EPI_RESIDUAL, part, S, M, K, m, i - m * K, resid);  // L2 reads
  }
}

// One 16-row tile of weight W (fp8 block-scaled or bf16) over K-blocks [kb0, kb1): the shared gemv.cuh tile
// (with QMK_MK_RING ≥ 2 its cp.async shared-memory ring variant, bit-identical; this warp's ring at `ring`;
// issued: mk_gemv_prefetch already started this tile's first units).
// QMK_MK_M1 = 1 (the runner's build for 1-row programs): the tile is built for M = 1 (gemv.cuh MC; measured
// faster in the discrete kernels and here), and mk_gemv refuses an instruction of M != 1 (error 5).
__device__ __forceinline__ void mk_tile(float (&acc)[4], const MkWeight& W, const qmk_u16* x, int M, int row0,
                                        int kb0, int kb1, qmk_u32 ring, bool issued = false) {
#if QMK_MK_RING >= 2
  if (W.fp8)
    qmk_gemv_tile_ring<QMK_W_FP8, QMK_MK_M1>(acc, (const void*)W.ptr, (const qmk_u16*)W.scale, x, M, W.cols, row0,
                                             kb0, kb1, ring, QMK_MK_RING, issued);
  else
    qmk_gemv_tile_ring<QMK_W_BF16, QMK_MK_M1>(acc, (const void*)W.ptr, nullptr, x, M, W.cols, row0, kb0, kb1, ring,
                                              QMK_MK_RING, issued);
#else
  (void)ring; (void)issued;
  if (W.fp8)
    qmk_gemv_tile<QMK_W_FP8>(acc, (const void*)W.ptr, (const qmk_u16*)W.scale, x, M, W.cols, row0, kb0, kb1);
  else
    qmk_gemv_tile<QMK_W_BF16>(acc, (const void*)W.ptr, nullptr, x, M, W.cols, row0, kb0, kb1);
#endif
}

// The first tile this warp's mk_gemv runs (row0 = r0 + 16·warp; K-blocks of split s, or all of them for S = 1):
// its first QMK_MK_RING - 1 weight units into the warp's ring, before the instruction's waits (weights never
// depend on them). Returns whether it issued (this warp has a tile); mk_gemv then skips that tile's prologue.
__device__ __forceinline__ bool mk_gemv_prefetch(const MkParams& P, const int* w, qmk_u32 ring) {
#if QMK_MK_PREFETCH
  const int warp = threadIdx.x >> 5, r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END];
  const int S = w[QMK_F_NSPLIT];
  int t = warp, sp = w[QMK_F_SPLIT];
  if (S > 1 && (w[QMK_F_SUB] & QMK_SUB_LOCAL_REDUCE)) {  // mk_gemv_local's first round: task (tile warp / S, split warp % S)
    if (S > MK_WARPS || warp >= (MK_WARPS / S) * S) return false;
    t = warp / S;
    sp = warp % S;
  }
  if (t >= (r1 - r0) / QMK_ROW_TILE) return false;
  const MkWeight W = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W0]];
  const int per = (W.cols / QMK_KBLK) / S, kb0 = sp * per, row0 = r0 + t * QMK_ROW_TILE;
  if (W.fp8) qmk_gemv_ring_prologue<QMK_W_FP8>((const void*)W.ptr, W.cols, row0, kb0, kb0 + per, ring, QMK_MK_RING);
  else qmk_gemv_ring_prologue<QMK_W_BF16>((const void*)W.ptr, W.cols, row0, kb0, kb0 + per, ring, QMK_MK_RING);
  return true;
#else
  (void)P; (void)w; (void)ring;
  return false;
#endif
}

#ifndef QMK_MK_KEYS
#define QMK_MK_KEYS 1  // 1: the head keeps per-SM best keys and the ARGMAX reads those (isa.py ARGMAX_KEYS)
#endif
#define MK_KEYS QMK_MK_KEYS
// ARGMAX_KEYS: this SM's slot of P.keys (uint64 [num_sms][2]: best key, step) takes the block's best key b of the
// logits this instruction wrote (combined with an earlier one of the same step, should the SM run two). Thread 0
// writes it before the instruction's bump (its release orders the slot for the ARGMAX's acquire).
__device__ __forceinline__ void mk_keys_publish(const MkParams& P, qmk_u64 b, uint32_t step) {
  if (threadIdx.x == 0) {
    qmk_u64* slot = reinterpret_cast<qmk_u64*>(P.keys) + 2 * blockIdx.x;
    if ((uint32_t)slot[1] == step) b = slot[0] > b ? slot[0] : b;
    slot[0] = b;
    slot[1] = step;
  }
}

// GEMV: rows [r0, r1) of weight w0 (for swiglu: gate rows r0.. and up rows F+r0.. of the fused [2F, K] weight),
// split `split` of `nsplit`, on x = buf0 (or its RMSNorm with weight w1, computed into shared memory; buf5 ≥ 0:
// that input is also stored there, [M, K]).
// nsplit > 1: fp32 partials into buf3 [S, M, rows(w0)]; with sub & QMK_SUB_FUSE_REDUCE the warp then counts the
// tile in on its arrival counter (uint32 [rows(w0) / 16] right after the partials, runner-owned) and the last of
// the tile's S (swiglu: 2S) arrivals reduces it into buf1 (gemv.cuh qmk_gemv_finish_tile: partials at L2, fixed
// split order, the same epilogue as GEMV_REDUCE; it resets the counter for the next step). Memory order: the
// partial stores → __syncwarp + fence.acq_rel.gpu + atomicAdd (release); the last arriver's fence (acquire)
// → its reads; the block's bump after the instruction releases the tile outputs to the consumers.
// nsplit == 1: the epilogue straight into buf1.
// issued: mk_gemv_prefetch started this warp's first tile.
__device__ void mk_gemv(const MkParams& P, const int* w, qmk_u16* xn, MkSmemTail& sm, qmk_u32 ring, bool issued,
                        uint32_t step) {
  const int sub = w[QMK_F_SUB], pro = sub & 15, epi = (sub >> 4) & 15;
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END];
  const int s = w[QMK_F_SPLIT], S = w[QMK_F_NSPLIT];
  const MkWeight W = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W0]];
  const int K = W.cols, N = W.rows, warp = threadIdx.x >> 5;
  const qmk_u16* x = mk_buf<const qmk_u16>(P, w[QMK_F_BUF0]);
  if (pro == QMK_PRO_RMSNORM) {
    const MkWeight nw = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W1]];
    mk_rmsnorm(x, (const mx_u16*)nw.ptr, xn, M, K, sm.red);
    __syncthreads();
    x = xn;
  } else if (pro == QMK_PRO_REDUCE_RMSNORM) {
    // the input is a deferred split-K residual GEMV's output (isa.py): rebuilt here from its S partials (buf4) and
    // residual (buf2) with GEMV_REDUCE's epilogue (same function, same split order: same bits), columns
    // [aux0, aux1) stored to buf0 for its later readers, then normalised in place
    const MkWeight nw = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W1]];
    const float* part = mk_buf<const float>(P, w[QMK_F_BUF4]);
    const qmk_u16* resid = mk_buf<const qmk_u16>(P, w[QMK_F_BUF2]);
    mk_rebuild_input(part, (sub >> QMK_SUB_SRC_SPLIT_SHIFT) & 255, resid, xn, M, K);
    __syncthreads();
    qmk_u16* xo = mk_buf<qmk_u16>(P, w[QMK_F_BUF0]);
    const int a0 = w[QMK_F_AUX0], na = w[QMK_F_AUX1] - a0;
    for (int i = threadIdx.x; i < M * na; i += MK_THREADS) {
      const int m = i / na, k = a0 + (i - m * na);
      xo[(size_t)m * K + k] = xn[m * K + k];
    }
    // in place (x and y are __restrict__ in mx_rmsnorm_rows): each element is read and written by one thread, the
    // writes after the block sum's barriers
    mk_rmsnorm(xn, (const mx_u16*)nw.ptr, xn, M, K, sm.red);
    __syncthreads();
    x = xn;
  } else if (pro != QMK_PRO_NONE) {
    if (threadIdx.x == 0) mk_fail(P, MK_ERR_PROLOGUE, pro);
  }
  if (w[QMK_F_BUF5] >= 0) {  // one slice of the head also publishes its (normalised) input: the final hidden
    uint4* dst = mk_buf<uint4>(P, w[QMK_F_BUF5]);
    const uint4* src = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < M * K / 8; i += MK_THREADS) dst[i] = src[i];
  }
  if (QMK_MK_M1 && M != 1 && threadIdx.x == 0) mk_fail(P, MK_ERR_M1, M);
  const int F = N >> 1, per = (K / QMK_KBLK) / S, kb0 = s * per, kb1 = kb0 + per;
  const int tiles = (r1 - r0) / QMK_ROW_TILE;
  if (S > 1) {
    // LOCAL_REDUCE (isa.py): all S splits of rows [r0, r1) here, in rounds of MK_WARPS / S tiles — warp w computes
    // split w % S of tile w / S (that split's K range, as a split instruction would), the fp32 partials go to
    // shared memory ([S, M, round tiles · 16], qmk_gemv_store_partial's layout) and the block applies gemv.cuh's
    // epilogue in fixed split order: the bits of GEMV partials + GEMV_REDUCE. Store epilogue only (the
    // scheduler's local_candidate). Otherwise split s of the rows: one tile per warp per round, partials to buf3.
    const bool local = (sub & QMK_SUB_LOCAL_REDUCE) != 0;
    if (local && (S > MK_WARPS || epi != QMK_EPI_STORE) && threadIdx.x == 0) mk_fail(P, MK_ERR_LOCAL, S);
    const int tpr = local ? MK_WARPS / S : MK_WARPS, NL = tpr * QMK_ROW_TILE;
    float* part = local ? &sm.u.ep[0][0] : mk_buf<float>(P, w[QMK_F_BUF3]);  // local: S · M · NL ≤ 16 · 8 · 16 floats
#if QMK_MK_FUSE_REDUCE
    const bool fused = (sub & QMK_SUB_FUSE_REDUCE) != 0;
#else
    constexpr bool fused = false;  // the fused tail compiled out (runner: fuse_reduce=False builds)
    if ((sub & QMK_SUB_FUSE_REDUCE) != 0 && threadIdx.x == 0) mk_fail(P, MK_ERR_FUSED, w[QMK_F_OP]);
#endif
    unsigned int* arrive = reinterpret_cast<unsigned int*>(part + (size_t)S * M * N);  // [N / 16], after the partials
    qmk_u16* out = fused || local ? mk_buf<qmk_u16>(P, w[QMK_F_BUF1]) : nullptr;
    const qmk_u16* resid = fused && epi == QMK_EPI_RESIDUAL ? mk_buf<const qmk_u16>(P, w[QMK_F_BUF2]) : nullptr;
    for (int base = 0; base < tiles; base += tpr) {
      const int t = base + (local ? warp / S : warp), sp = local ? warp % S : s;
      if ((!local || warp < tpr * S) && t < tiles) {
        const int row0 = r0 + t * QMK_ROW_TILE, pk0 = sp * per;
        float acc[4];
        mk_tile(acc, W, x, M, row0, pk0, pk0 + per, ring, issued && base == 0);
        qmk_gemv_store_partial(acc, part, M, local ? NL : N, sp, local ? (warp / S) * QMK_ROW_TILE : row0);
        if (fused) qmk_gemv_finish_tile(part, S, M, N, epi, row0 / QMK_ROW_TILE, arrive, resid, out);
        if (epi == QMK_EPI_SWIGLU) {
          mk_tile(acc, W, x, M, F + row0, kb0, kb1, ring);
          qmk_gemv_store_partial(acc, part, M, N, s, F + row0);
          if (fused) qmk_gemv_finish_tile(part, S, M, N, epi, (F + row0) / QMK_ROW_TILE, arrive, resid, out);
        }
      }
      if (local) {
        __syncthreads();
        const int nrow = min(tpr, tiles - base) * QMK_ROW_TILE, n0 = r0 + base * QMK_ROW_TILE;
        for (int i = threadIdx.x; i < M * nrow; i += MK_THREADS) {
          const int m = i / nrow, nl = i - m * nrow;
          out[(size_t)m * N + n0 + nl] = qmk_gemv_epilogue(QMK_EPI_STORE, part, S, M, NL, m, nl, nullptr);
        }
        __syncthreads();
      }
    }
    return;
  }
  // split 1: rounds of one tile per warp into shared memory, then gemv.cuh's epilogue on them (S = 1, as the
  // discrete reduce sees a one-split partial buffer)
  qmk_u16* out = mk_buf<qmk_u16>(P, w[QMK_F_BUF1]);
  const qmk_u16* resid = epi == QMK_EPI_RESIDUAL ? mk_buf<const qmk_u16>(P, w[QMK_F_BUF2]) : nullptr;
  const int nout = epi == QMK_EPI_SWIGLU ? F : N;
  float* ep = &sm.u.ep[0][0];
  // the head of a 1-row step also keeps its best logit key (sm.best_key; mk_keys_publish), decided from the words
  // in each round so that nothing stays live across the tiles (the GEMV loop is at the register cap)
  if (threadIdx.x == 0) sm.best_key = 0;  // read after the rounds' barriers
  for (int base = 0; base < tiles; base += MK_WARPS) {
    const int t = base + warp;
    if (t < tiles) {
      const int row0 = r0 + t * QMK_ROW_TILE;
      float acc[4];
      mk_tile(acc, W, x, M, row0, 0, K / QMK_KBLK, ring, issued && base == 0);
      qmk_gemv_store_partial(acc, ep, M, 2 * MK_EP_ROWS, 0, warp * QMK_ROW_TILE);
      if (epi == QMK_EPI_SWIGLU) {
        mk_tile(acc, W, x, M, F + row0, 0, K / QMK_KBLK, ring);
        qmk_gemv_store_partial(acc, ep, M, 2 * MK_EP_ROWS, 0, MK_EP_ROWS + warp * QMK_ROW_TILE);
      }
    }
    __syncthreads();
    const int nrow = min(MK_WARPS, tiles - base) * QMK_ROW_TILE, n0 = r0 + base * QMK_ROW_TILE;
    const bool keys = MK_KEYS && (w[QMK_F_SUB] & QMK_SUB_ARGMAX_KEYS) && w[QMK_F_M] == 1;
    qmk_u64 best = 0;
    for (int i = threadIdx.x; i < M * nrow; i += MK_THREADS) {
      const int m = i / nrow, nl = i - m * nrow;
      // per row m: P = that row's [gate | up] run, N' = 2·MK_EP_ROWS (so F' = MK_EP_ROWS), residual row m at n0
      const qmk_u16* rr = resid ? resid + (size_t)m * N + n0 : nullptr;
      const qmk_u16 y = qmk_gemv_epilogue(epi, ep + (size_t)m * 2 * MK_EP_ROWS, 1, 1, 2 * MK_EP_ROWS, 0, nl, rr);
      out[(size_t)m * nout + n0 + nl] = y;
      if (keys && n0 + nl < QMK_VALID_VOCAB) {  // padding ids never compete (as mk_argmax's scan)
        const qmk_u64 k = qmk_logit_key(y, n0 + nl);
        best = k > best ? k : best;
      }
    }
    if (keys) {
      for (int o = 16; o > 0; o >>= 1) {
        const qmk_u64 t = __shfl_xor_sync(0xFFFFFFFFu, best, o);
        best = t > best ? t : best;
      }
      if ((threadIdx.x & 31) == 0 && best) atomicMax(&sm.best_key, (unsigned long long)best);
    }
    __syncthreads();
  }
  if (MK_KEYS && (w[QMK_F_SUB] & QMK_SUB_ARGMAX_KEYS) && w[QMK_F_M] == 1) mk_keys_publish(P, sm.best_key, step);
}

// GEMV_REDUCE: the discrete gemv_reduce body over outputs (m, n), n in [r0, r1): fixed split order + epilogue.
__device__ void mk_gemv_reduce(const MkParams& P, const int* w) {
  const int epi = (w[QMK_F_SUB] >> 4) & 15, M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END];
  const int S = w[QMK_F_NSPLIT];
  const int N = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W0]].rows;
  const int nout = epi == QMK_EPI_SWIGLU ? N / 2 : N, nr = r1 - r0;
  const float* part = mk_buf<const float>(P, w[QMK_F_BUF3]);
  const qmk_u16* resid = epi == QMK_EPI_RESIDUAL ? mk_buf<const qmk_u16>(P, w[QMK_F_BUF2]) : nullptr;
  qmk_u16* out = mk_buf<qmk_u16>(P, w[QMK_F_BUF1]);
  for (int i = threadIdx.x; i < M * nr; i += MK_THREADS) {
    const int m = i / nr, n = r0 + (i - m * nr);
    out[(size_t)m * nout + n] = qmk_gemv_epilogue<true>(epi, part, S, M, N, m, n, resid);  // L2 reads
  }
}

// EMBED: exact row copy of the embedding table for each row's token (an id outside [0, V) gives a NaN row, as
// discrete/kernels/embed.cu).
__device__ void mk_embed(const MkParams& P, const int* w) {
  const int M = w[QMK_F_M];
  const int* ids = mk_buf<const int>(P, w[QMK_F_BUF0]);
  qmk_u16* out = mk_buf<qmk_u16>(P, w[QMK_F_BUF1]);
  const qmk_u16* table = reinterpret_cast<const qmk_u16*>(P.embed);
  const int n16 = QMK_HIDDEN / 8;
  for (int m = 0; m < M; ++m) {
    const int id = (int)qmk::ld_relaxed_gpu(reinterpret_cast<const uint32_t*>(ids) + m);  // host- or finish-written
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)m * QMK_HIDDEN);
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)(id < 0 || id >= QMK_VOCAB ? 0 : id) * QMK_HIDDEN);
    for (int i = threadIdx.x; i < n16; i += MK_THREADS)
      dst[i] = (id < 0 || id >= QMK_VOCAB) ? make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u) : src[i];
  }
}

// ARGMAX: per row the maximum lm_head key (lm_head.cuh: logit desc, id asc) over the non-padding logits of buf0
// [M, V] (ids < QMK_VALID_VOCAB, as lm_head.cuh) → buf1 [M];
// then the control-block finish (finish.cuh) and, in persistent mode, the token to mapped host memory.
#ifndef QMK_MK_ARGMAX_VEC
#define QMK_MK_ARGMAX_VEC 1  // 1: 16-byte logit loads, MK_ARGMAX_BATCH in flight per thread; 0: one u16 per load
#endif
#define MK_ARGMAX_BATCH 4
__device__ void mk_argmax(const MkParams& P, const int* w, MkSmemTail& sm, uint32_t step) {
  const int M = w[QMK_F_M], lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const qmk_u16* logits = mk_buf<const qmk_u16>(P, w[QMK_F_BUF0]);
  int* ids = mk_buf<int>(P, w[QMK_F_BUF1]);
  const bool keys = MK_KEYS && (w[QMK_F_SUB] & QMK_SUB_ARGMAX_KEYS) && M == 1;  // the head's per-SM best keys
  for (int m = 0; m < M; ++m) {
    // max of the keys (logit desc, id asc): one key per id, so the order of the scan never changes the result
    qmk_u64 k = 0;
    const qmk_u16* row = logits + (size_t)m * QMK_VOCAB;
    if (keys) {
      // this step's slots (an SM without a head instruction this step left an older step in its slot)
      const ulonglong2* slots = reinterpret_cast<const ulonglong2*>(P.keys);
      for (int i = threadIdx.x; i < (int)gridDim.x; i += MK_THREADS) {
        const ulonglong2 e = __ldcg(slots + i);  // L2: other SMs wrote them
        if ((uint32_t)e.y == step) k = e.x > k ? e.x : k;
      }
    } else
#if QMK_MK_ARGMAX_VEC
    if (QMK_VOCAB % 8 == 0 && (reinterpret_cast<size_t>(row) & 15) == 0) {
      // one thread ran the scan alone, one 2-byte L2 round trip after another: 108 µs per step on the 27B
      // (timing build); here each thread keeps MK_ARGMAX_BATCH 16-byte loads in flight
      const uint4* r16 = reinterpret_cast<const uint4*>(row);
      const int n16 = (QMK_VALID_VOCAB + 7) / 8;  // chunks holding a valid id; ids ≥ QMK_VALID_VOCAB are skipped
      for (int base = threadIdx.x; base < n16; base += MK_ARGMAX_BATCH * MK_THREADS) {
        uint4 v[MK_ARGMAX_BATCH];
#pragma unroll
        for (int b = 0; b < MK_ARGMAX_BATCH; ++b) {
          const int c = base + b * MK_THREADS;
          v[b] = c < n16 ? __ldcg(r16 + c) : make_uint4(0u, 0u, 0u, 0u);  // L2: other SMs wrote them
        }
#pragma unroll
        for (int b = 0; b < MK_ARGMAX_BATCH; ++b) {
          const int c = base + b * MK_THREADS;
          if (c >= n16) continue;
          const qmk_u32 u[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int id = 8 * c + e;
            const qmk_u64 key = id < QMK_VALID_VOCAB ? qmk_logit_key((qmk_u16)(u[e >> 1] >> (16 * (e & 1))), id) : 0ull;
            k = key > k ? key : k;
          }
        }
      }
    } else
#endif
    for (int i = threadIdx.x; i < QMK_VALID_VOCAB; i += MK_THREADS) {  // padding ids are never chosen
      const qmk_u64 c = qmk_logit_key(row[i], i);
      k = c > k ? c : k;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const qmk_u64 t = __shfl_xor_sync(0xFFFFFFFFu, k, o);
      k = t > k ? t : k;
    }
    if (lane == 0) sm.u.keys[warp] = k;
    __syncthreads();
    if (threadIdx.x == 0) {
      qmk_u64 b = sm.u.keys[0];
      for (int i = 1; i < MK_WARPS; ++i) b = sm.u.keys[i] > b ? sm.u.keys[i] : b;
      ids[m] = qmk_key_id(b);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    QmkControl* c = reinterpret_cast<QmkControl*>(P.ctrl);
    qmk_finish_step(c, ids, M);
    if (P.persistent) {
      volatile uint32_t* host = reinterpret_cast<volatile uint32_t*>(P.host);
      qmk::st_release_sys(host + 3, (uint32_t)ids[M - 1]);
      qmk::st_release_sys(host + 2, c->step);
    }
  }
}

// GDN_STEP: key heads [r0, r1) of layer `layer` (value heads part `split` of `nsplit`); hn = RMSNorm(buf2) in
// shared memory, then gdn.cuh per value head.
#ifndef QMK_MK_GDN_MR
#define QMK_MK_GDN_MR 0  // rows the GDN step's registers are sized for; 0: 1 in the M = 1 build, else QMK_MAX_ROWS
#endif
#define MK_GDN_MR (QMK_MK_GDN_MR > 0 ? QMK_MK_GDN_MR : (QMK_MK_M1 ? 1 : QMK_MAX_ROWS))
#ifndef QMK_MK_GDN_STATE_PREFETCH
// 1: a GDN step copies its first value head's state to shared memory before its wait. Measured slower (3
// interleaved rounds: 11.91-11.96 ms/token on vs 11.79-11.80 off, docs/megakernel.md), so off by default.
#define QMK_MK_GDN_STATE_PREFETCH 0
#endif
#define MK_GDN_STATE_BYTES (QMK_GDN_DV * QMK_GDN_DK * 4)
#define MK_GDN_PREFETCH (QMK_MK_GDN_STATE_PREFETCH && MK_WARPS * QMK_MK_RING * QMK_GEMV_UNIT_BYTES >= MK_GDN_STATE_BYTES)
// The value heads [j0, j1) of a GDN_STEP (part split of nsplit of key heads [r0, r1); asm_regions._gdn_part).
__device__ __forceinline__ void mk_gdn_heads(const int* w, int& j0, int& j1) {
  const int r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END];
  const int nv = (r1 - r0) * QMK_GDN_HEAD_GROUP, sp = w[QMK_F_SPLIT], ns = w[QMK_F_NSPLIT];
  j0 = r0 * QMK_GDN_HEAD_GROUP + sp * nv / ns;
  j1 = r0 * QMK_GDN_HEAD_GROUP + (sp + 1) * nv / ns;
}
// Before the instruction's waits: the recurrent state of its first value head [DV, DK] fp32 into the (idle) GEMV
// ring region, by cp.async; each thread copies exactly the 16-byte pieces it reads back in the step, so its own
// cp.async.wait_all orders them (no barrier). The state was last written by this layer's GDN step of the previous
// step, which every instruction of this step is ordered after (the step edge: embed waits on the previous argmax).
// Returns whether it copied.
__device__ __forceinline__ bool mk_gdn_prefetch_state(const MkParams& P, const int* w, qmk_u32 ring) {
#if MK_GDN_PREFETCH
  int j0, j1;
  mk_gdn_heads(w, j0, j1);
  if (j1 <= j0) return false;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* st = mk_buf<const float>(P, w[QMK_F_BUF5]) + ((size_t)j0 * QMK_GDN_DV + warp * MX_GDN_CPW) * QMK_GDN_DK + lane * 4;
  const qmk_u32 dst = ring - (threadIdx.x >> 5) * QMK_MK_RING * QMK_GEMV_UNIT_BYTES +  // the region's start
                      ((warp * MX_GDN_CPW) * QMK_GDN_DK + lane * 4) * 4;
#pragma unroll
  for (int c = 0; c < MX_GDN_CPW; ++c) qmk_cp_async16(dst + c * QMK_GDN_DK * 4, st + c * QMK_GDN_DK);
  qmk_cp_async_commit();
  return true;
#else
  (void)P; (void)w; (void)ring;
  return false;
#endif
}

// normed: hn already holds RMSNorm(buf2; w1) of this step (mk_xn_holds), computed by this SM's in-projection
// prologue with the same function on the same values, so the same bits; the norm is skipped.
// staged: mk_gdn_prefetch_state copied the first value head's state to st_smem (generic address of the region).
__device__ void mk_gdn(const MkParams& P, const int* w, qmk_u16* hn, MkSmemTail& sm, bool normed, bool staged,
                       const float* st_smem) {
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END];
  const MkLayer L = reinterpret_cast<const MkLayer*>(P.layers)[w[QMK_F_LAYER]];
  const MkWeight nw = reinterpret_cast<const MkWeight*>(P.weights)[w[QMK_F_W1]];
  if (QMK_MK_M1 && M != 1 && threadIdx.x == 0) mk_fail(P, MK_ERR_M1, M);  // the M = 1 build holds one row
  if (!normed) {
    mk_rmsnorm(mk_buf<const mx_u16>(P, w[QMK_F_BUF2]), (const mx_u16*)nw.ptr, hn, M, QMK_HIDDEN, sm.red);
    __syncthreads();
  }
  const int pos = mk_pos(P);
  // value heads of key heads [r0, r1); split / nsplit (runner.split_gdn) hand a part of them to this instruction
  int j0, j1;
  mk_gdn_heads(w, j0, j1);
  (void)r0; (void)r1;
  if (staged) asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's own pieces of the state copy
  for (int j = j0; j < j1; ++j) {
    mx_gdn_step_head<MK_GDN_MR>(mk_buf<const mx_u16>(P, w[QMK_F_BUF0]), mk_buf<const mx_u16>(P, w[QMK_F_BUF1]), hn,
                     (const mx_u16*)L.t[0], (const mx_u16*)L.t[1], (const mx_u16*)L.t[2], (const mx_u16*)L.t[3],
                     (const mx_u16*)L.t[4], (const mx_u16*)L.t[5], mk_buf<mx_u16>(P, w[QMK_F_BUF4]),
                     mk_buf<float>(P, w[QMK_F_BUF5]), mk_buf<mx_u16>(P, w[QMK_F_BUF3]), pos, M, j, sm.u.gdn,
                     staged && j == j0 ? st_smem : nullptr);
    __syncthreads();
  }
}

// Attention: attention.cuh's four stages as four instructions (the discrete launches' blocks; scratch buffers from
// the buffer table: roped q, scores [M, NQ, att_cap], stats max / sum [M, NQ, P], partials [M, NQ, P, HD]).
// ATTN_PREP: KV heads [r0, r1): one warp task per (row, query head of the group | the KV head) → q, KV append.
__device__ void mk_attn_prep(const MkParams& P, const int* w) {
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END], warp = threadIdx.x >> 5;
  const MkLayer L = reinterpret_cast<const MkLayer*>(P.layers)[w[QMK_F_LAYER]];
  const int per = MX_G + 1, pos = mk_pos(P);
  for (int t = warp; t < M * (r1 - r0) * per; t += MK_WARPS) {
    const int i = t / ((r1 - r0) * per), r = t - i * (r1 - r0) * per, h = r0 + r / per, e = r % per;
    mx_attn_prep(mk_buf<const mx_u16>(P, w[QMK_F_BUF0]), mk_buf<const mx_u16>(P, w[QMK_F_BUF1]),
                 mk_buf<const mx_u16>(P, w[QMK_F_BUF2]), (const mx_u16*)L.t[0], (const mx_u16*)L.t[1],
                 (const float*)P.inv_freq, reinterpret_cast<const int*>(P.page_table), P.page_stride,
                 mk_buf<mx_u16>(P, w[QMK_F_BUF4]), mk_buf<mx_u16>(P, w[QMK_F_BUF3]), pos, i,
                 e < MX_G ? h * MX_G + e : QMK_N_Q_HEADS + h);
  }
}

// ATTN_SCORES: split-KV units [r0, r1) (u = h·P + p, one head): scores + per-partition stats, partition order.
__device__ void mk_attn_scores(const MkParams& P, const int* w) {
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END], pos = mk_pos(P);
  for (int u = r0; u < r1; ++u) {
    mx_attn_scores(mk_buf<const mx_u16>(P, w[QMK_F_BUF0]), mk_buf<const mx_u16>(P, w[QMK_F_BUF4]),
                   reinterpret_cast<const int*>(P.page_table), P.page_stride, mk_buf<mx_u16>(P, w[QMK_F_BUF1]),
                   P.att_cap, mk_buf<float>(P, w[QMK_F_BUF2]), mk_buf<float>(P, w[QMK_F_BUF3]), pos, M,
                   u % QMK_ATTN_PARTS, u / QMK_ATTN_PARTS);
    __syncthreads();
  }
}

// ATTN_VALUES: units [r0, r1): the head's stats merged over all partitions, p_j under them, partial o_p.
__device__ void mk_attn_values(const MkParams& P, const int* w, MkSmemTail& sm) {
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END], pos = mk_pos(P);
  for (int u = r0; u < r1; ++u) {
    mx_attn_values(mk_buf<const mx_u16>(P, w[QMK_F_BUF5]), reinterpret_cast<const int*>(P.page_table),
                   P.page_stride, mk_buf<const mx_u16>(P, w[QMK_F_BUF0]), P.att_cap,
                   mk_buf<const float>(P, w[QMK_F_BUF1]), mk_buf<const float>(P, w[QMK_F_BUF2]),
                   mk_buf<float>(P, w[QMK_F_BUF3]), pos, M, u % QMK_ATTN_PARTS, u / QMK_ATTN_PARTS, sm.u.att);
    __syncthreads();
  }
}

// ATTN_REDUCE: query heads [r0, r1): partials in partition order, sigmoid gate → o (one thread per head dim,
// as the discrete reduce block).
__device__ void mk_attn_reduce(const MkParams& P, const int* w) {
  const int M = w[QMK_F_M], r0 = w[QMK_F_ROW_START], r1 = w[QMK_F_ROW_END], pos = mk_pos(P);
  const int n = r1 - r0;
  if (threadIdx.x < MX_HD)
    for (int t = 0; t < M * n; ++t)
      mx_attn_reduce(mk_buf<const float>(P, w[QMK_F_BUF1]), mk_buf<const mx_u16>(P, w[QMK_F_BUF0]),
                     mk_buf<mx_u16>(P, w[QMK_F_BUF3]), pos, t / n, r0 + t % n);
}

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

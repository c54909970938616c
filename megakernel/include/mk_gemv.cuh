// mk_gemv.cuh — the GEMV family of the megakernel: GEMV (the RMSNorm and deferred-reduce prologues, the
// tile, the weight-ring prefetch, the split-K store, the fused reduce tail, the epilogues, the head's
// argmax keys) and GEMV_REDUCE.
// A part of megakernel/megakernel.cu, included once by it where it stands in the translation unit; not
// standalone (it uses the includes, macros, MkSmemTail and helpers defined above that #include).

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

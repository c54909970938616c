// mk_head.cuh — the token ends of the megakernel: EMBED, and ARGMAX with the finish stage and the
// persistent mode's hand-off to the host.
// A part of megakernel/megakernel.cu, included once by it where it stands in the translation unit; not
// standalone (it uses the includes, macros, MkSmemTail and helpers defined above that #include).

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

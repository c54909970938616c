// mk_gdn.cuh — GDN_STEP of the megakernel: the Gated DeltaNet step per value head, with its state prefetch.
// A part of megakernel/megakernel.cu, included once by it where it stands in the translation unit; not
// standalone (it uses the includes, macros, MkSmemTail and helpers defined above that #include).

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

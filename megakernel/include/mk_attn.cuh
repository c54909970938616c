// mk_attn.cuh — the megakernel's four attention instructions: ATTN_PREP, ATTN_SCORES, ATTN_VALUES,
// ATTN_REDUCE.
// A part of megakernel/megakernel.cu, included once by it where it stands in the translation unit; not
// standalone (it uses the includes, macros, MkSmemTail and helpers defined above that #include).

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

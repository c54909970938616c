// finish.cuh — end of a decode step of M rows as one device function (one thread): the control-block update,
// shared by the discrete finish kernel (finish.cu, qmk_finish) and the megakernel's ARGMAX instruction. step += 1; pos += M; out_token = ids[M-1]; tokens[0] =
// out_token; stop = 1 on an eos id or when pos reaches max_pos (never cleared here).
#pragma once
#include "control.h"

__device__ __forceinline__ void qmk_finish_step(QmkControl* c, const int* ids, int M) {
  const int tok = ids[M - 1];
  const unsigned int pos = c->pos + (unsigned int)M;
  c->step += 1u;
  c->pos = pos;
  c->out_token = tok;
  c->tokens[0] = tok;
  bool stop = pos >= c->max_pos;
  const unsigned int ne = c->n_eos;
  for (unsigned int e = 0; e < ne && e < sizeof(c->eos) / sizeof(c->eos[0]); ++e) stop |= c->eos[e] == tok;
  if (stop) c->stop = 1u;
}

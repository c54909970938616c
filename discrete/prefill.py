"""GPU prefill of a prompt chunk: the decode step's math over thousands of rows at once, bit-identical per row to
the M ≤ 8-row decode passes (docs/step.md, "Prefill").

Per layer, for a chunk of C rows at positions pos … pos+C−1 (one launch each unless noted):

=============  ==========================================================================================
norm           ``qmk_rmsnorm_rows_grid`` (one block per row; the bits of the decode step's fused norm)
in_proj        :class:`discrete.gemm.Gemm` (store) on the fused in-projection, at the decode op's split-K
               factor, then its column segments copied out (qkv | z, or q·gate | k | v)
GDN            the decode step's three phases in three kernels over row tiles of 8: ``qmk_gdn_prefill_in``
               (conv, in_proj_a|b, l2 norms, gates: every tile and head at once), ``qmk_gdn_prefill_recur``
               (the recurrence, tile after tile, state columns split over 4 blocks per head, state in
               registers), ``qmk_gdn_prefill_out`` (gated norm, every tile at once); then
               ``qmk_gdn_ring_fill`` leaves the conv ring as decode would
attention      the decode attention stages over the chunk's 8-row tiles: prep (q/k norm, RoPE, K/V into the
               paged cache) over all C rows, then scores, values (``qmk_attn_*_rows``: many tiles per launch,
               grid z = tile) and reduce per group of ``att_rows`` rows (the scratch of a group: its rows'
               scores at the context capacity and the partition partials, ≤ ``ATT_SCRATCH_BYTES``)
out_proj       Gemm (residual)
post norm      ``qmk_rmsnorm_rows_grid``
MLP            Gemm (swiglu) on gate|up, Gemm (residual) on down
=============  ==========================================================================================

The GEMM equals the GEMV bit for bit at the same split (docs/kernels-gemm.md); the GDN and attention rows run
the decode kernels' device functions in the same order; so the residual stream, the GDN recurrent state and conv
ring, and the KV pages after a chunk are exactly what eager decode passes over the same ids leave, and a prompt
split into any chunks gives the same bits as one pass (no anchoring of a chunk grid is needed). The lm_head is
not run here: the caller runs the prompt's last id as a decode step (``DecodeStep.replay`` / ``run_eager``),
which gives the logits, the device argmax and the control-block update of that row.

Scratch for ``chunk`` rows is allocated at construction (start-up); a call allocates nothing.
"""
from __future__ import annotations

import numpy as np

from assembler.numerics import MAX_ROWS, attn_partitions
from discrete.attention import SCORE_THREADS, THREADS as ATT_THREADS, module as attn_module
from discrete.build import load_module
from discrete.gdn import CONV_RING, module as gdn_module
from discrete.device_state import control_defines
from discrete.gemm import Gemm
from loader.config import FIRST_PADDING_ID

DEFAULT_CHUNK = 2048  # rows per prefill launch sequence (GEMM M); scratch ≈ 0.35 GB at the 27B's shapes
ATT_SCRATCH_BYTES = 512 << 20  # attention scratch of one group of tiles (scores at capacity + partials)


class Prefill:
    """Chunked GPU prefill bound to a :class:`discrete.step.DecodeStep`: its weights and ops, and its
    :class:`discrete.device_state.DeviceState` (GDN state, conv rings, KV session, stream, position).

    ``chunk``: rows per pass (a multiple of 8, ≥ 8); larger chunks run the projection GEMMs at larger M.
    ``att_rows``: rows per attention launch group (a multiple of 8; None: as many as ``ATT_SCRATCH_BYTES`` holds
    at the step's context capacity, at most ``chunk``); any value gives the same bits (tests use small ones).
    ``run(ids)`` processes int ids at the step's position and advances it (host and control block) by len(ids).
    Raises ValueError for an empty prompt, ids outside [0, FIRST_PADDING_ID) or past the step's capacity."""

    def __init__(self, dstep, chunk: int = DEFAULT_CHUNK, att_rows: int | None = None):
        import cupy as cp
        chunk = int(chunk)
        if chunk < MAX_ROWS or chunk % MAX_ROWS:
            raise ValueError(f"Prefill: chunk={chunk}; expected a positive multiple of {MAX_ROWS}")
        if att_rows is not None and (int(att_rows) < MAX_ROWS or int(att_rows) % MAX_ROWS):
            raise ValueError(f"Prefill: att_rows={att_rows}; expected a positive multiple of {MAX_ROWS}")
        self.d, self.st, self.chunk = dstep, dstep.state, chunk
        cfg, W, g = dstep.cfg, dstep.w, dstep.state.graph
        self.cfg = cfg
        H = cfg.hidden_size
        fin = load_module(cfg, ("finish.cu",), control_defines())
        self._k_norm = fin.get_function("qmk_rmsnorm_rows_grid")
        gm = gdn_module(cfg)
        self._k_gdn_in, self._k_gdn_recur, self._k_gdn_out, self._k_ring = (
            gm.get_function(n) for n in ("qmk_gdn_prefill_in", "qmk_gdn_prefill_recur", "qmk_gdn_prefill_out",
                                         "qmk_gdn_ring_fill"))
        geo = np.empty(3, np.int32)  # float4 per (tile, head) of phase-A results, recurrence blocks per head, threads
        cp.cuda.runtime.memcpy(geo.ctypes.data, gm.get_global("qmk_gdn_prefill_geometry").ptr, geo.nbytes,
                               cp.cuda.runtime.memcpyDeviceToHost)
        self._gdn_rows_f4, self._gdn_split, self._gdn_rthreads = (int(x) for x in geo)
        self.gemm = []
        n_in = 0
        for i, L in enumerate(W.layers):
            ops = {}
            for key, name in (("in", "in"), ("out", "out"), ("gate_up", "gateup"), ("down", "down")):
                seg = g.op(f"L{i}.{name}").segments[0]
                epi = "store" if key == "in" else seg.epilogue
                ops[key] = Gemm(cfg, L[key].w, L[key].scale, epilogue=epi, split=seg.split, name=f"L{i}.{key}.gemm")
            n_in = max(n_in, ops["in"].plan.N)
            self.gemm.append(ops)
        F = W.layers[0]["gate_up"].w.shape[0] // 2
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C = chunk
        u16 = cp.uint16
        self.ids = cp.zeros(C, cp.int32)
        self.x, self.xn, self.xm = (cp.empty((C, H), u16) for _ in range(3))
        self.y = cp.empty(C * n_in, u16)                                      # flat: viewed [C', N] per layer
        self.qkv = cp.empty((C, cfg.gdn_conv_dim), u16)
        self.z = cp.empty((C, cfg.gdn_value_dim), u16)
        self.qg = cp.empty((C, 2 * nq * hd), u16)
        self.k = cp.empty((C, nkv * hd), u16)
        self.v = cp.empty((C, nkv * hd), u16)
        self.o = cp.empty(C * max(cfg.gdn_value_dim, nq * hd), u16)          # flat: the mixer's output [C', n]
        self.act = cp.empty((C, F), u16)
        self.tile_pos = cp.zeros(C // MAX_ROWS, cp.int32)  # position of row 0 of each 8-row attention tile
        scratch = [self.ids, self.x, self.xn, self.xm, self.y, self.qkv, self.z, self.qg, self.k, self.v, self.o,
                   self.act, self.tile_pos]
        if any("gdn" in ops for ops in dstep.layer_ops):
            nv = cfg.linear_num_value_heads
            self.gdn_rows = cp.empty((C // MAX_ROWS, nv, self._gdn_rows_f4, 4), cp.float32)  # phase A per tile, head
            self.gdn_o = cp.empty((C, cfg.gdn_value_dim), cp.float32)                       # S^T q per row
            scratch += [self.gdn_rows, self.gdn_o]
        attn = [ops["attn"] for ops in dstep.layer_ops if "attn" in ops]
        self.att_rows = 0
        if attn:
            cap, P = attn[0].capacity, attn_partitions(cfg)
            per_row = nq * cap * 2 + 2 * nq * P * 4 + nq * P * hd * 4
            R = int(att_rows) if att_rows is not None else ATT_SCRATCH_BYTES // per_row // MAX_ROWS * MAX_ROWS
            self.att_rows = R = max(MAX_ROWS, min(C, R))
            self.att_q = cp.empty((C, nq, hd), u16)                  # roped queries of the chunk
            self.att_scores = cp.empty((R, nq, cap), u16)            # bf16 scores of one group
            self.att_m, self.att_l = (cp.empty((R, nq, P), cp.float32) for _ in range(2))
            self.att_partial = cp.empty((R, nq, P, hd), cp.float32)
            am = attn_module(cfg)
            self._k_att_scores = am.get_function("qmk_attn_scores_rows")
            self._k_att_values = am.get_function("qmk_attn_values_rows")
            scratch += [self.att_q, self.att_scores, self.att_m, self.att_l, self.att_partial]
        self._scratch = scratch
        self.nbytes = sum(a.nbytes for a in scratch)

    def poison(self) -> None:
        """Fill the scratch with NaN bit patterns (tests: a row read before it is written shows up)."""
        with self.st.stream:
            for a in (self.x, self.xn, self.xm, self.y, self.qkv, self.z, self.qg, self.k, self.v, self.o, self.act):
                a.fill(0x7FC1)
            for a in ("gdn_rows", "gdn_o"):
                if hasattr(self, a):
                    getattr(self, a).fill(np.nan)
            if self.att_rows:
                self.att_q.fill(0x7FC1)
                self.att_scores.fill(0x7FC1)
                for a in (self.att_m, self.att_l, self.att_partial):
                    a.fill(np.nan)

    def run(self, ids, profile: dict | None = None) -> None:
        """Prefill ``ids`` (int sequence, ≥ 1) at the step's position, in passes of ``chunk`` rows; enqueued on
        the step's stream (no host synchronisation except the position table's copy). ``profile``: a dict to
        which the GPU milliseconds between CUDA events around each category (embed, norm, gemm, split, gdn_in,
        gdn_recur, gdn_out, attn_prep, attn_scores, attn_values, attn_reduce) are added (benchmarks; it
        synchronises at the end of each chunk)."""
        st = self.st
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size < 1:
            raise ValueError("Prefill.run: no ids")
        if ids.min() < 0 or ids.max() >= FIRST_PADDING_ID:
            raise ValueError(f"Prefill.run: token ids must lie in [0, {FIRST_PADDING_ID})")
        if st.pos + ids.size > st.capacity:
            raise ValueError(f"Prefill.run: positions {st.pos}..{st.pos + ids.size - 1} exceed capacity {st.capacity}")
        for s in range(0, ids.size, self.chunk):
            self._chunk(ids[s:s + self.chunk], profile)

    def _chunk(self, ids: np.ndarray, profile: dict | None) -> None:
        import cupy as cp
        d, st, cfg, W = self.d, self.st, self.cfg, self.d.w
        marks: list = []

        def mark(cat: str) -> None:  # the span from this event to the next one belongs to ``cat``
            if profile is not None:
                e = cp.cuda.Event()
                e.record(st.stream)
                marks.append((cat, e))

        C, pos, H = int(ids.size), int(st.pos), cfg.hidden_size
        i32 = np.int32
        x, xn, xm = self.x[:C], self.xn[:C], self.xm[:C]
        with st.stream:
            self.ids[:C].set(ids.astype(np.int32), stream=st.stream)
            ntile = -(-C // MAX_ROWS)
            self.tile_pos[:ntile].set((pos + MAX_ROWS * np.arange(ntile)).astype(np.int32), stream=st.stream)
            mark("embed")
            d.embed._fn((C,), (256,), (d.embed.table, self.ids, i32(d.embed.H), i32(d.embed.V), x))
            for i, (L, ops, g) in enumerate(zip(W.layers, d.layer_ops, self.gemm)):
                mark("norm")
                self._k_norm((C,), (256,), (x, L["in_norm"], xn, i32(H)))
                mark("gemm")
                y = self.y[:C * g["in"].plan.N].reshape(C, -1)
                g["in"](xn, y)
                c1, c2 = ops["in_cuts"]
                n_o = cfg.gdn_value_dim if "gdn" in ops else cfg.num_attention_heads * cfg.head_dim
                o = self.o[:C * n_o].reshape(C, n_o)
                mark("split")
                if "gdn" in ops:
                    qkv, z = self.qkv[:C], self.z[:C]
                    qkv[...] = y[:, :c1]
                    z[...] = y[:, c1:c2]
                    mark("gdn_in")
                    w_a, w_b, a_log, dt_bias, conv_w, norm_w = ops["gdn"].w
                    nv, ntile = cfg.linear_num_value_heads, -(-C // MAX_ROWS)
                    self._k_gdn_in((ntile, nv), (512,), (qkv, z, xn, w_a, w_b, a_log, dt_bias, conv_w, norm_w,
                                                         st.ring[i], self.gdn_rows, i32(pos), i32(C)))
                    mark("gdn_recur")
                    self._k_gdn_recur((nv, self._gdn_split), (self._gdn_rthreads,),
                                      (self.gdn_rows, st.rec[i], self.gdn_o, i32(C)))
                    mark("gdn_out")
                    self._k_gdn_out((ntile, nv), (256,), (self.gdn_rows, self.gdn_o, o, i32(C)))
                    self._k_ring((min(C, CONV_RING),), (256,), (qkv, st.ring[i], i32(pos), i32(C)))
                else:
                    qg, k, v = self.qg[:C], self.k[:C], self.v[:C]
                    qg[...] = y[:, :c1]
                    k[...] = y[:, c1:c2]
                    v[...] = y[:, c2:]
                    self._attention(ops, qg, k, v, o, C, mark)
                mark("gemm")
                g["out"](o, xm, residual=x)
                mark("norm")
                self._k_norm((C,), (256,), (xm, L["post_norm"], xn, i32(H)))
                mark("gemm")
                g["gate_up"](xn, self.act[:C])
                g["down"](self.act[:C], x, residual=xm)
            mark("end")
        if profile is not None:
            marks[-1][1].synchronize()
            for (cat, a), (_, b) in zip(marks, marks[1:]):
                profile[cat] = profile.get(cat, 0.0) + cp.cuda.get_elapsed_time(a, b)
        st.advance(C)

    def _attention(self, ops, qg, k, v, o, C: int, mark) -> None:
        """The decode attention stages over the chunk's 8-row tiles (tile t at positions pos+8t…): prep over all
        C rows (K/V of every row into the cache first: a tile reads only keys at or before its own rows), then per
        group of ``att_rows`` rows scores and values with grid z = tile (``qmk_attn_*_rows``: the decode device
        functions on the tile's slices) and reduce. The operands were checked once, so launches pass raw pointers."""
        st, a, cfg = self.st, ops["attn"], self.cfg
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        u64, i32 = np.uint64, np.int32
        base, ps, cap = u64(st.kv.layer_base(ops["attn_layer"])), np.int64(st.kv.page_stride), i32(a.capacity)
        tbl = st.sess.table
        p_qg, p_o, p_pos = qg.data.ptr, o.data.ptr, self.tile_pos.data.ptr
        b_qg, b_o, b_q = 2 * qg.shape[1], 2 * o.shape[1], 2 * nq * hd  # row bytes
        mark("attn_prep")
        a.k_prep.raw((C, nq + nkv), (32,), (qg, k, v, a.q_norm_w, a.k_norm_w, a.inv_freq, tbl, ps, base, self.att_q,
                                           self.tile_pos))
        scores, sm, sl, part = self.att_scores, self.att_m, self.att_l, self.att_partial
        for r0 in range(0, C, self.att_rows):
            R = min(self.att_rows, C - r0)
            grid = (a.parts, nkv, -(-R // MAX_ROWS))
            pq, pp, n = u64(self.att_q.data.ptr + r0 * b_q), u64(p_pos + 4 * (r0 // MAX_ROWS)), i32(R)
            mark("attn_scores")
            self._k_att_scores(grid, (SCORE_THREADS,), (pq, base, tbl, ps, scores, cap, sm, sl, pp, n))
            mark("attn_values")
            self._k_att_values(grid, (ATT_THREADS,), (base, tbl, ps, scores, cap, sm, sl, part, pp, n))
            mark("attn_reduce")
            a.k_reduce.raw((R, nq), (hd,), (part, u64(p_qg + r0 * b_qg), u64(p_o + r0 * b_o), pp))

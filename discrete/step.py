"""The whole decode step on the GPU as discrete kernels, replayable as ONE captured CUDA graph (article Parts
3.9, 6.2, 6.5; DESIGN.md "Data flow of one decode step").

Per step of M ≤ 8 rows (positions pos..pos+M−1, read on the device from the control block):
  embed(tokens) → per layer [rmsnorm → fused in-projection (split-K partials, segmented reduce into q|k|v or
  qkv|z) → GDN step or 4-stage attention → out-projection + residual → rmsnorm → gate|up + SwiGLU → down +
  residual] → rmsnorm → lm_head + argmax → finish (control block: step += 1, pos += M, tokens[0] = argmax).
Every op is the ``assembler/graph.py`` op with the graph's split-K; GEMV blocks cut the tasks with
``discrete.partition.gemv_slices`` (results depend on split-K only, never on the slicing). The megakernel runs
each RMSNorm as a GEMV prologue; so does this step with ``fuse_norm`` (default): the input norm and the
post-attention norm run inside the in-projection and gate|up launches (every block normalises x into shared
memory with the standalone kernel's device function, block 0 stores ``xn.{i}`` / ``xn.{i}.post`` for the other
readers), so the bits and every buffer equal the ``fuse_norm=False`` form (a separate 1-block norm kernel).
The final norm stays a separate kernel (the lm_head has its own kernel, ~1,940 blocks).

Everything is allocated in the constructor: weights (given); the session's device memory and control block as
one :class:`discrete.device_state.DeviceState` (``self.state``: one activation arena with every activation buffer
of ``verify_graph(cfg, 8)`` plus the normed inputs, one split-K scratch, GDN state + conv rings, paged KV with all
pages of ``capacity`` reserved, control block, logits only with ``debug_logits``), which the megakernel and the
prefill bind too; then the ops' own scratch (lm_head buffers, attention scratch).

``pdl`` (Programmatic Dependent Launch, ``discrete/launch.py``): the kernels of the chosen launch categories go
through ``cuLaunchKernelEx`` with programmatic stream serialization, so each may be scheduled while its
predecessor drains (GEMVs prefetch their first weight units into L2, then wait). Every wrapper waits for its
predecessor before touching activations or state, so the bits do not depend on ``pdl``.
"""
from __future__ import annotations

import copy

import ml_dtypes
import numpy as np

from assembler.numerics import MAX_ROWS
from discrete.attention import AttnDecode
from discrete.build import load_module
from discrete.device_state import POISON, DeviceState, control_defines
from discrete.gdn import GdnDecode, ring_to_ref, state_to_ref
from discrete.gemv import NULL, Gemv
from discrete.launch import kernels
from discrete.lm_head import Embed, LmHead
from loader.config import FULL, ModelConfig

__all__ = ["CATEGORIES", "GEMV_CATEGORIES", "POISON", "DecodeStep", "DeviceState", "compile_defines",
           "control_defines", "pdl_categories"]
CATEGORIES = ("embed", "norm", "in_proj", "gdn", "attn", "out_proj", "mlp", "lm_head", "finish")
GEMV_CATEGORIES = ("in_proj", "out_proj", "mlp")


def pdl_categories(pdl) -> frozenset[str]:
    """Launch categories to run with PDL: ``False`` none, ``True`` all, or an iterable of names from CATEGORIES
    (``"gemv"`` stands for GEMV_CATEGORIES). Raises ValueError on an unknown name."""
    if pdl is True:
        return frozenset(CATEGORIES)
    if pdl is False or pdl is None:
        return frozenset()
    if isinstance(pdl, str):
        pdl = (pdl,)
    out = set()
    for c in pdl:
        if c == "gemv":
            out.update(GEMV_CATEGORIES)
        elif c in CATEGORIES:
            out.add(c)
        else:
            raise ValueError(f"DecodeStep: pdl category {c!r} not one of {CATEGORIES + ('gemv',)}")
    return frozenset(out)


def compile_defines(cfg: ModelConfig) -> dict[str, int]:
    """Extra defines of finish.cu for the offline compile check (``// qmk: defines`` marker)."""
    return control_defines()


class DecodeStep:
    """One session's decode step on the device.

    cfg: ModelConfig; weights: ``discrete.weights_gpu.WeightsGPU`` of the same config; capacity: tokens the
    session may hold (KV pages reserved at start-up); m_rows: rows of the captured step (1 = decode, ≤ 8 =
    verify); debug_logits: also keep the bf16 logits [M, V] (for tests); pdl: launch with Programmatic Dependent
    Launch — True (default: every kernel; measured faster, docs/step.md "Programmatic Dependent Launch"), False, or
    launch categories (:func:`pdl_categories`); the results are bit-identical either way. fuse_norm: run the
    input and post-attention RMSNorms as the prologue of the in-projection / gate|up launches (default) instead of
    as separate kernels; bit-identical either way (with fuse_norm the "norm" category holds only the final norm).
    gemv_defines: ``defines`` of every ``discrete.gemv.Gemv`` (kernel choices for benchmarks, e.g.
    ``{"QMK_GEMV_TMA_KPB": 2}``; the results do not depend on them). Raises ValueError on bad arguments."""

    def __init__(self, cfg: ModelConfig, weights, capacity: int, m_rows: int = 1, *, debug_logits: bool = False,
                 pdl=True, fuse_norm: bool = True, gemv_defines: dict | None = None):
        import cupy as cp
        if weights.cfg != cfg:
            raise ValueError("DecodeStep: weights were built for another config")
        if not 1 <= m_rows <= MAX_ROWS:
            raise ValueError(f"DecodeStep: m_rows={m_rows}; expected 1..{MAX_ROWS}")
        if capacity < 1 or capacity > cfg.max_position_embeddings:
            raise ValueError(f"DecodeStep: capacity={capacity}; expected 1..{cfg.max_position_embeddings}")
        self.cfg, self.w, self.m = cfg, weights, int(m_rows)
        self.debug_logits = debug_logits
        self.pdl = pdl_categories(pdl)
        self.fuse_norm = bool(fuse_norm)
        self.gemv_defines = dict(gemv_defines or {})  # kernel choices of every Gemv (benchmarks; same bits)
        self.state = DeviceState(cfg, capacity, debug_logits=debug_logits)  # the session's memory, allocated first
        self._build_ops()
        self._graph = None
        self.state.last_m = self.m
        self.reset()
        cp.cuda.Device().synchronize()

    # ------------------------------------------------------------------ the session's memory (DeviceState)
    # Read-only aliases of ``self.state``'s buffers, kept because tests, benchmarks and tools read them from the
    # step in many places; the megakernel, the prefill and the executors use ``state`` itself.
    stream = property(lambda self: self.state.stream, doc="The session's CUDA stream (DeviceState.stream).")
    graph = property(lambda self: self.state.graph, doc="verify_graph(cfg, MAX_ROWS): the buffers' sizes.")
    capacity = property(lambda self: self.state.capacity, doc="Tokens the session may hold.")
    arena = property(lambda self: self.state.arena, doc="uint8 [n]: the activation arena (DeviceState.arena).")
    buf = property(lambda self: self.state.buf, doc="Arena views by buffer name (DeviceState.buf).")
    partials = property(lambda self: self.state.partials, doc="fp32 [n]: the split-K scratch.")
    rec = property(lambda self: self.state.rec, doc="GDN layer → fp32 [n_v, d_v, d_k] recurrent state.")
    ring = property(lambda self: self.state.ring, doc="GDN layer → uint16 [CONV_RING, conv_dim] conv ring.")
    kv = property(lambda self: self.state.kv, doc="The PagedKVCache of the full-attention layers.")
    sess = property(lambda self: self.state.sess, doc="The session's KVSession (page table).")
    ctrl = property(lambda self: self.state.ctrl, doc="uint32 [24]: the control block.")
    pos_dev = property(lambda self: self.state.pos_dev, doc="int32 [1] (device): the control block's pos.")
    tokens_dev = property(lambda self: self.state.tokens_dev, doc="int32 [MAX_ROWS] (device): the rows' input ids.")
    pos = property(lambda self: self.state.pos, doc="Host copy of the position of the next step's row 0.")
    last_m = property(lambda self: self.state.last_m, doc="Rows of the last step launched.")

    @property
    def weights(self):
        """The ``discrete.weights_gpu.WeightsGPU`` the step runs (also ``w``)."""
        return self.w

    @property
    def next_ids(self):
        """int32 [MAX_ROWS] (device): the lm_head's argmax of each row of the last step (the head op's buffer)."""
        return self.head_bufs["ids"]

    @property
    def attention(self):
        """The first full-attention layer's ``AttnDecode`` (its q / score / stats / partial scratch is shared by
        every attention layer, which run one after another on the stream), or None without attention layers."""
        for ops in self.layer_ops:
            if "attn" in ops:
                return ops["attn"]
        return None

    def _build_ops(self) -> None:
        cfg, W, g = self.cfg, self.w, self.graph
        on = self.pdl.__contains__
        fin = load_module(cfg, ("finish.cu",), control_defines())
        (self._k_norm,), (self._k_seg,), (self._k_finish,) = (
            kernels(fin, (n,), on(c)) for n, c in (("qmk_rmsnorm_rows", "norm"), ("qmk_reduce_segments", "in_proj"),
                                                   ("qmk_finish", "finish")))
        self.embed = Embed(cfg, W.embed, pdl=on("embed"))
        self.head = LmHead(cfg, W.lm_head, pdl=on("lm_head"))
        self.head_bufs = self.head.buffers(MAX_ROWS)
        self.layer_ops = []
        attn_base = None
        cat = {"in": "in_proj", "out": "out_proj", "gate_up": "mlp", "down": "mlp"}
        for i, L in enumerate(W.layers):
            ops = {}
            for key, op in (("in", g.op(f"L{i}.in")), ("out", g.op(f"L{i}.out")), ("gate_up", g.op(f"L{i}.gateup")),
                            ("down", g.op(f"L{i}.down"))):
                seg = op.segments[0]
                p = L[key]
                epi = "store" if key == "in" else seg.epilogue
                nw = {"in": L["in_norm"], "gate_up": L["post_norm"]}.get(key) if self.fuse_norm else None
                ops[key] = Gemv(cfg, p.w, p.scale, epilogue=epi, split=seg.split, name=f"L{i}.{key}",
                                pdl=on(cat[key]), norm_weight=nw, defines=self.gemv_defines or None)
                if key == "in":
                    ops["in_cuts"] = (p.rows[1], p.rows[2] if len(p.rows) > 3 else p.rows[-1])
            if cfg.layer_types[i] == FULL:
                if attn_base is None:
                    attn_base = AttnDecode(cfg, L["q_norm"], L["k_norm"], self.capacity, pdl=on("attn"))
                    ops["attn"] = attn_base
                else:  # share the score / partial scratch (layers run one after another on one stream)
                    a = copy.copy(attn_base)
                    a.q_norm_w, a.k_norm_w = L["q_norm"], L["k_norm"]
                    ops["attn"] = a
                ops["attn_layer"] = cfg.full_layers.index(i)
            else:
                ops["gdn"] = GdnDecode(cfg, L["a"], L["b"], L["A_log"], L["dt_bias"], L["conv_w"], L["norm"],
                                       pdl=on("gdn"))
            self.layer_ops.append(ops)

    # ------------------------------------------------------------------ launches
    def launches(self, M: int) -> list[tuple[str, object]]:
        """The step for M rows as (category, closure) pairs in launch order; each closure enqueues its kernels on
        the current stream and allocates nothing. Categories: embed, norm, in_proj, gdn, attn, out_proj, mlp,
        lm_head, finish (benchmarks time the graph without one category)."""
        cfg, B, H = self.cfg, self.buf, self.cfg.hidden_size
        i32 = np.int32
        out = [("embed", lambda: self.embed(self.tokens_dev[:M], B["x.0"][:M]))]

        def norm(x, w, y):
            return lambda: self._k_norm((1,), (256,), (x, w, y, i32(M), i32(H)))

        for i, (L, ops) in enumerate(zip(self.w.layers, self.layer_ops)):
            x, xn, xm, xp = B[f"x.{i}"], B[f"xn.{i}"], B[f"x.{i}.mid"], B[f"xn.{i}.post"]
            nxt = B[f"x.{i + 1}"]
            fuse = self.fuse_norm
            if not fuse:
                out.append(("norm", norm(x, L["in_norm"], xn)))
            gin, (c1, c2) = ops["in"], ops["in_cuts"]
            if "gdn" in ops:
                o, outs = B[f"o.{i}"], (B[f"qkv.{i}"], B[f"z.{i}"], None)
            else:
                o, outs = B[f"o.{i}"], (B[f"qg.{i}"], B[f"k.{i}"], B[f"v.{i}"])

            def in_proj(gin=gin, x=x, xn=xn, outs=outs, c1=c1, c2=c2, fuse=fuse):
                # fused: RMSNorm(x) in the partial kernel's prologue, block 0 stores it to xn (GDN reads it)
                P = gin.partial(x[:M], self.partials, normed=xn[:M]) if fuse else gin.partial(xn[:M], self.partials)
                tot = M * gin.N
                self._k_seg(((tot + 255) // 256,), (256,), (P, i32(gin.split), i32(M), i32(gin.N), i32(c1), i32(c2),
                                                          outs[0], outs[1], NULL if outs[2] is None else outs[2]))
            out.append(("in_proj", in_proj))
            if "gdn" in ops:
                out.append(("gdn", lambda ops=ops, i=i, o=o, xn=xn: ops["gdn"](
                    B[f"qkv.{i}"], B[f"z.{i}"], xn, self.ring[i], self.rec[i], o, self.pos_dev, M)))
            else:
                out.append(("attn", lambda ops=ops, i=i, o=o: ops["attn"](
                    B[f"qg.{i}"], B[f"k.{i}"], B[f"v.{i}"], self.kv, self.sess, ops["attn_layer"], o, self.pos_dev, M)))
            out.append(("out_proj", lambda g=ops["out"], o=o, x=x, xm=xm:
                        g(o[:M], xm[:M], self.partials, residual=x[:M])))
            if fuse:
                out.append(("mlp", lambda g=ops["gate_up"], xm=xm, xp=xp, a=B[f"act.{i}"]:
                            g(xm[:M], a[:M], self.partials, normed=xp[:M])))
            else:
                out.append(("norm", norm(xm, L["post_norm"], xp)))
                out.append(("mlp", lambda g=ops["gate_up"], xp=xp, a=B[f"act.{i}"]: g(xp[:M], a[:M], self.partials)))
            out.append(("mlp", lambda g=ops["down"], a=B[f"act.{i}"], xm=xm, nxt=nxt:
                        g(a[:M], nxt[:M], self.partials, residual=xm[:M])))
        xL = B[f"x.{cfg.num_hidden_layers}"]
        out.append(("norm", norm(xL, self.w.final_norm, B["hn"])))
        lg = B["logits"][:M] if self.debug_logits else None
        out.append(("lm_head", lambda: self.head(B["hn"][:M], self.head_bufs, logits=lg)))
        out.append(("finish", lambda: self._k_finish((1,), (32,), (self.ctrl, self.head_bufs["ids"], i32(M)))))
        return out

    @staticmethod
    def kernels_per_launch(category: str) -> int:
        """Kernels one closure of ``category`` enqueues (launch inventory)."""
        return {"embed": 1, "norm": 1, "in_proj": 2, "gdn": 1, "attn": 4, "out_proj": 2, "mlp": 2, "lm_head": 2,
                "finish": 1}[category]

    def _enqueue(self, M: int, skip: tuple[str, ...] = ()) -> None:
        for cat, f in self.launches(M):
            if cat not in skip:
                f()

    # ------------------------------------------------------------------ public API
    def reset(self, pos: int = 0, tokens=(0,), max_pos: int | None = None, clear_state: bool = True) -> None:
        """Start a session at ``pos`` with input ``tokens`` (control block rewritten, ``m_rows`` = this step's;
        GDN state and conv rings zeroed unless ``clear_state=False``; KV is not cleared: positions ≥ pos are
        rewritten before read). ``max_pos`` defaults to the capacity. :meth:`DeviceState.reset`."""
        self.state.reset(pos, tokens, max_pos, clear_state, m_rows=self.m)

    def write_control(self, c: np.ndarray) -> None:
        """Overwrite the control block (a CONTROL_DTYPE scalar, e.g. edited from :meth:`control`), in stream order."""
        self.state.write_control(c)

    def advance(self, n: int) -> None:
        """Move the position by ``n`` ≥ 0 rows processed outside the step (:meth:`DeviceState.advance`)."""
        self.state.advance(n)

    def poison(self) -> None:
        """Fill every activation buffer (and the split-K scratch) with NaN, so a read of anything not written in
        the next step shows up (tests)."""
        self.state.poison()

    def run_eager(self, tokens=None) -> None:
        """Launch one step kernel by kernel (no graph). ``tokens``: the input ids of the rows (1..8; M = their
        count), written into the control block first; None: M = m_rows, tokens already in the control block."""
        st = self.state
        M = self.m if tokens is None else st.set_tokens(tokens)
        st.check_room(M)
        with st.stream:
            self._enqueue(M)
        st.note_steps(1, M)

    def capture(self) -> None:
        """Capture the m_rows step into one CUDA graph (replayed unchanged for every token)."""
        with self.stream:
            self.stream.begin_capture()
            try:
                self._enqueue(self.m)
            finally:
                self._graph = self.stream.end_capture()

    def capture_without(self, skip: tuple[str, ...]):
        """A graph of the m_rows step with the categories in ``skip`` left out (timing only; wrong results)."""
        with self.stream:
            self.stream.begin_capture()
            try:
                self._enqueue(self.m, skip)
            finally:
                g = self.stream.end_capture()
        return g

    def replay(self, tokens=None) -> None:
        """Replay the captured graph once (teacher forcing: ``tokens``, exactly m_rows ids, are written first)."""
        if self._graph is None:
            raise RuntimeError("DecodeStep.replay: call capture() first")
        st = self.state
        if tokens is not None and st.set_tokens(tokens) != self.m:
            raise ValueError(f"DecodeStep.replay: the graph runs {self.m} rows; got {len(tokens)} tokens")
        st.check_room(self.m)
        self._graph.launch(st.stream)
        st.note_steps(1, self.m)

    def read_token(self) -> int:
        """Wait for the stream; the argmax of the last row of the last step (the next input token)."""
        return self.state.read_token()

    def control(self) -> np.ndarray:
        """Host copy of the control block (CONTROL_DTYPE scalar)."""
        return self.state.control()

    def prefill(self, ids, rows: int = MAX_ROWS) -> int:
        """Process a prompt as eager passes of ``rows`` ≤ 8 rows (the verify form; slow but correct for any length
        up to the capacity). Returns the greedy next token (argmax of the last prompt row)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if not 1 <= rows <= MAX_ROWS or ids.size < 1:
            raise ValueError(f"DecodeStep.prefill: rows={rows} (1..{MAX_ROWS}), {ids.size} ids (≥ 1)")
        for s in range(0, ids.size, rows):
            self.run_eager(ids[s:s + rows])
        return self.read_token()

    def buffer(self, name: str, M: int | None = None) -> np.ndarray:
        """Host copy of an arena buffer (``x.3``, ``xn.3``, ``qkv.0``, ``hn``, ``logits``, …) as bf16 [M, …]
        (M defaults to the rows of the last step)."""
        return self.state.buffer(name, M)

    def snapshot(self, M: int | None = None) -> dict:
        """Host copies in the reference's layouts (docs/INTERFACES.md §3 ModelState): ``pos``; ``hidden`` [M, H]
        (final-normed) and ``logits`` [M, V] (debug only) as bf16; ``ids`` [M]; ``conv``/``rec`` per GDN layer
        ([conv_dim, 3] bf16, [n_v, d_k, d_v] fp32); ``k``/``v`` per attention layer ([pos, n_kv, hd] bf16)."""
        M = self.last_m if M is None else M
        self.stream.synchronize()
        bf = ml_dtypes.bfloat16
        snap = {"pos": self.pos, "hidden": self.buffer("hn", M), "ids": self.next_ids[:M].get(),
                "conv": {i: ring_to_ref(r.get(), self.pos).view(bf) for i, r in self.ring.items()},
                "rec": {i: state_to_ref(s.get()) for i, s in self.rec.items()}, "k": {}, "v": {}}
        if self.debug_logits:
            snap["logits"] = self.buffer("logits", M)
        if self.pos > 0:
            for j, i in enumerate(self.cfg.full_layers):
                k, v = self.kv.gather(self.sess, j, self.pos)
                snap["k"][i], snap["v"][i] = k.view(bf), v.view(bf)
        return snap

"""The device memory of one decode session and its control block (DESIGN.md "Nothing allocates after start-up"),
shared by every path that runs the session's steps: the discrete step (``discrete.step.DecodeStep``), its chunked
prefill (``discrete.prefill.Prefill``), the megakernel (``megakernel.runner.Megakernel``) and the executors'
snapshots (``host.executors``). Each path binds these buffers by pointer, so all of them read and write the same
activations, state, KV pages and control block, and may alternate within one session.

Owned here, allocated once in this order (sizes from ``verify_graph(cfg, MAX_ROWS)``: every step of 1..8 rows uses
row prefixes):

=============  ==============================================================================================
``stream``     the session's CUDA stream (non-blocking); every launch and copy of the session is ordered on it
``arena``      uint8 [n]: one allocation holding every activation buffer, each in a 256-byte aligned slot
``buf``        name → view into ``arena``: the graph's ``act`` buffers (bf16 bits as uint16, ids as int32,
               [MAX_ROWS, …]; ``logits`` [MAX_ROWS, V] only with ``debug_logits``), the normed inputs
               ``xn.{i}`` / ``xn.{i}.post`` [MAX_ROWS, H] and the final-normed hidden ``hn`` [MAX_ROWS, H]
``partials``   fp32 [n]: the split-K scratch shared by all projections (launches are ordered on the stream)
``rec``        GDN layer → fp32 [n_v, d_v, d_k]: the recurrent state
``ring``       GDN layer → uint16 [CONV_RING, conv_dim]: the conv ring (bf16 bits)
``kv``         ``discrete.kv_cache.PagedKVCache``: the page pool of all full-attention layers, pages of 256
               tokens, enough for ``capacity``
``sess``       the session's ``KVSession`` (page table int32 [pages]), all pages of ``capacity`` reserved
``ctrl``       uint32 [24]: the control block (``discrete.control.CONTROL_DTYPE``); ``pos_dev`` (int32 [1]) and
               ``tokens_dev`` (int32 [MAX_ROWS], the rows' input ids) are views of its fields
=============  ==============================================================================================

The host keeps ``pos`` (the position of the next step's row 0) and ``last_m`` (rows of the last step launched) in
step with the device: the path that launches a step calls :meth:`DeviceState.note_steps` (the device's finish
stage advances its own copy), and :meth:`advance` moves both copies for rows processed outside the step.
"""
from __future__ import annotations

import numpy as np

from assembler.graph import verify_graph
from assembler.numerics import MAX_ROWS
from discrete.control import CONTROL_DTYPE, MAX_EOS, new_control
from discrete.gdn import CONV_RING
from discrete.kv_cache import PagedKVCache
from loader.config import FIRST_PADDING_ID, ModelConfig

POISON = 0x7FC1  # a bf16 NaN pattern for activation buffers (tests)


def control_defines() -> dict[str, int]:
    """Word offsets (uint32) of the control block fields for finish.cu, from CONTROL_DTYPE."""
    f = CONTROL_DTYPE.fields
    w = {k: f[k][1] // 4 for k in CONTROL_DTYPE.names}
    return {"QMK_CTRL_STEP": w["step"], "QMK_CTRL_POS": w["pos"], "QMK_CTRL_STOP": w["stop"],
            "QMK_CTRL_MAX_POS": w["max_pos"], "QMK_CTRL_N_EOS": w["n_eos"], "QMK_CTRL_EOS": w["eos"],
            "QMK_CTRL_TOKENS": w["tokens"], "QMK_CTRL_OUT": w["out_token"], "QMK_CTRL_MAX_EOS": MAX_EOS}


class DeviceState:
    """Device memory and control block of one session (the table in the module docstring).

    cfg: ModelConfig; capacity: tokens the session may hold (1..max_position_embeddings; KV pages for all of
    them are reserved here); debug_logits: also allocate the bf16 logits [MAX_ROWS, V] in the arena. The control
    block starts zeroed (``pos`` 0); the step that owns the session writes it with :meth:`reset`. Raises
    ValueError on a bad capacity."""

    def __init__(self, cfg: ModelConfig, capacity: int, *, debug_logits: bool = False):
        import cupy as cp
        if capacity < 1 or capacity > cfg.max_position_embeddings:
            raise ValueError(f"DeviceState: capacity={capacity}; expected 1..{cfg.max_position_embeddings}")
        self.cfg, self.capacity, self.debug_logits = cfg, int(capacity), bool(debug_logits)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = verify_graph(cfg, MAX_ROWS)     # buffer sizes for up to 8 rows; steps use row prefixes
        self._alloc()
        self.ctrl = cp.zeros(CONTROL_DTYPE.itemsize // 4, cp.uint32)
        self._ctrl_i = self.ctrl.view(cp.int32)
        wd = control_defines()
        self.pos_dev = self._ctrl_i[wd["QMK_CTRL_POS"]:wd["QMK_CTRL_POS"] + 1]
        self.tokens_dev = self._ctrl_i[wd["QMK_CTRL_TOKENS"]:wd["QMK_CTRL_TOKENS"] + MAX_ROWS]
        self._out_word = wd["QMK_CTRL_OUT"]
        self.pos = 0      # host copy of the control block's pos
        self.last_m = 1   # rows of the last step launched (the default of buffer / snapshot)

    def _alloc(self) -> None:
        import cupy as cp
        cfg, g = self.cfg, self.graph
        H = cfg.hidden_size
        specs = {}
        for b in g.buffers.values():
            if b.kind == "act" and (b.name != "logits" or self.debug_logits):
                specs[b.name] = (b.shape, np.uint16 if b.dtype == "bf16" else np.int32)
        for i in range(cfg.num_hidden_layers):  # normed inputs (the megakernel's GEMV prologue)
            specs[f"xn.{i}"] = ((MAX_ROWS, H), np.uint16)
            specs[f"xn.{i}.post"] = ((MAX_ROWS, H), np.uint16)
        specs["hn"] = ((MAX_ROWS, H), np.uint16)
        offs, n = {}, 0
        for name, (shape, dt) in specs.items():
            offs[name] = n
            n += -(-(int(np.prod(shape)) * np.dtype(dt).itemsize) // 256) * 256  # 256-byte aligned slots
        self.arena = cp.empty(n, cp.uint8)
        self.buf = {name: self.arena[offs[name]:offs[name] + int(np.prod(s)) * np.dtype(dt).itemsize].view(dt).reshape(s)
                    for name, (s, dt) in specs.items()}
        # one split-K scratch shared by all projections (launches are ordered on one stream)
        pmax = 0
        for op in g.ops:
            for s in op.segments:
                rows = 2 * s.n_out if s.epilogue == "swiglu" else s.n_out
                pmax = max(pmax, s.split * MAX_ROWS * rows)
        fused = [op for op in g.ops if op.kind == "gemv" and len(op.segments) > 1]
        for op in fused:
            pmax = max(pmax, op.segments[0].split * MAX_ROWS * sum(s.n_out for s in op.segments))
        self.partials = cp.empty(pmax, cp.float32)
        # state: GDN recurrent [n_v, d_v, d_k] fp32 + conv ring; paged KV
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.rec = {i: cp.zeros((nv, dv, dk), cp.float32) for i in cfg.linear_layers}
        self.ring = {i: cp.zeros((CONV_RING, cfg.gdn_conv_dim), cp.uint16) for i in cfg.linear_layers}
        self.kv = PagedKVCache(cfg, -(-self.capacity // 256))
        self.sess = self.kv.session(self.capacity)
        self.sess.reserve(self.capacity)

    # ------------------------------------------------------------------ inputs and position
    def set_tokens(self, tokens) -> int:
        """Write the rows' input ids (1..MAX_ROWS ints in [0, FIRST_PADDING_ID)) into the control block's tokens,
        in stream order; returns their count (the rows of the next step). Raises ValueError otherwise."""
        t = np.asarray(tokens, np.int32).reshape(-1)
        if not 1 <= t.size <= MAX_ROWS:
            raise ValueError(f"DecodeStep: expected 1..{MAX_ROWS} tokens, got {t.size}")
        if t.min() < 0 or t.max() >= FIRST_PADDING_ID:
            raise ValueError(f"DecodeStep: token ids must lie in [0, {FIRST_PADDING_ID}), got {t.tolist()}")
        self.tokens_dev[:t.size].set(t, stream=self.stream)
        return int(t.size)

    def check_room(self, rows: int, who: str = "DecodeStep") -> None:
        """Raise ValueError (naming ``who``) when ``rows`` more positions from ``pos`` exceed the capacity."""
        if self.pos + rows > self.capacity:
            raise ValueError(f"{who}: positions {self.pos}..{self.pos + rows - 1} exceed capacity {self.capacity}")

    def note_steps(self, n: int, m: int) -> None:
        """Record on the host that ``n`` steps of ``m`` rows were launched (the device's finish stage advances its
        own control block): ``pos`` += n·m, ``last_m`` = m."""
        self.pos += int(n) * int(m)
        self.last_m = int(m)

    def advance(self, n: int) -> None:
        """Move the position by ``n`` ≥ 0 rows processed outside the step (``discrete.prefill.Prefill``): the host
        copy and the control block's ``pos`` (in stream order; nothing else in the block changes)."""
        n = int(n)
        if n < 0 or self.pos + n > self.capacity:
            raise ValueError(f"DecodeStep.advance: {self.pos} + {n} outside 0..capacity {self.capacity}")
        self.pos += n
        with self.stream:
            self.pos_dev.fill(np.int32(self.pos))

    # ------------------------------------------------------------------ control block
    def reset(self, pos: int = 0, tokens=(0,), max_pos: int | None = None, clear_state: bool = True,
              m_rows: int = 1) -> None:
        """Start a session at ``pos`` with input ``tokens`` and ``m_rows`` rows per step (control block rewritten;
        GDN state and conv rings zeroed unless ``clear_state=False``; KV is not cleared: positions ≥ pos are
        rewritten before read). ``max_pos`` defaults to the capacity. Raises ValueError outside the capacity."""
        max_pos = self.capacity if max_pos is None else int(max_pos)
        if not 0 <= pos <= self.capacity or not 0 < max_pos <= self.capacity:
            raise ValueError(f"DecodeStep.reset: pos={pos}, max_pos={max_pos}; capacity {self.capacity}")
        c = new_control(pos, list(tokens), max_pos, tuple(self.cfg.eos_token_ids)[:MAX_EOS])
        c["m_rows"] = m_rows
        self.write_control(c)
        with self.stream:
            if clear_state:
                for a in (*self.rec.values(), *self.ring.values()):
                    a.fill(0)

    def write_control(self, c: np.ndarray) -> None:
        """Overwrite the control block (a CONTROL_DTYPE scalar, e.g. edited from :meth:`control`), in stream order;
        the host ``pos`` follows it. Raises ValueError on another dtype."""
        if c.dtype != CONTROL_DTYPE:
            raise ValueError(f"DecodeStep.write_control: expected dtype CONTROL_DTYPE, got {c.dtype}")
        self.ctrl.set(np.frombuffer(c.tobytes(), np.uint32), stream=self.stream)
        self.pos = int(c["pos"])

    def control(self) -> np.ndarray:
        """Host copy of the control block (CONTROL_DTYPE scalar), after the stream drains."""
        self.stream.synchronize()
        return np.frombuffer(self.ctrl.get().tobytes(), CONTROL_DTYPE).copy()[0]

    def ctrl_words(self, field: str):
        """uint32 view (device) of the control block's words of ``field`` (a CONTROL_DTYPE name, e.g. ``go``)."""
        sub, off = CONTROL_DTYPE.fields[field][:2]
        return self.ctrl[off // 4:(off + sub.itemsize) // 4]

    def read_token(self) -> int:
        """Wait for the stream; the control block's ``out_token`` (argmax of the last row of the last step)."""
        self.stream.synchronize()
        o = self._out_word
        return int(self._ctrl_i[o:o + 1].get()[0])

    # ------------------------------------------------------------------ tests and inspection
    def poison(self) -> None:
        """Fill every activation buffer (and the split-K scratch) with NaN, so a read of anything not written in
        the next step shows up (tests)."""
        with self.stream:
            self.arena.view(np.uint16).fill(POISON)
            self.partials.fill(np.nan)

    def buffer(self, name: str, M: int | None = None) -> np.ndarray:
        """Host copy of an arena buffer (``x.3``, ``xn.3``, ``qkv.0``, ``hn``, ``logits``, …) as bf16 [M, …]
        (int32 buffers as int32; M defaults to ``last_m``). Raises KeyError for a name not in ``buf``."""
        import ml_dtypes
        self.stream.synchronize()
        a = self.buf[name][: (self.last_m if M is None else M)].get()
        return a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a

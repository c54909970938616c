"""Host side of the megakernel (``megakernel/megakernel.cu``): the runner's default program and build choices, and
the :class:`Megakernel`, which builds the program for the SM count with the assembler (``megakernel/program.py``),
uploads the program / counter / buffer / weight tables (device pointers taken from a ``discrete.step.DecodeStep``'s
weights and ops and its ``discrete.device_state.DeviceState``, so both paths read and write the same activations,
state, KV pages and control block), compiles the module (``megakernel/build.py``), checks occupancy (exactly one
block per SM), launches cooperatively, drives the persistent mode, and reports errors and deadlocks
(``megakernel/diagnose.py``). The names of those modules that other code imports from here are re-exported; cache
warming is ``megakernel/warm.py``.
Knobs (STYLE.md habit 9): ``layer_limit`` (program of the first L layers + head), ``stop_after`` (run only the
instructions of stages ≤ N: every wait points at an earlier stage, so the prefix is deadlock-free; one step),
``nop`` (every opcode replaced by NOP, waits and bumps kept: the dependency machinery's own floor), ``timing``
(a ``QMK_MK_TIMING`` build writing globaltimer stamps per instruction; see ``megakernel/timings.py``),
``delay_op`` (debug: the instructions of one op sleep first, so a removed wait on it shows), ``gdn_split``
(each GDN_STEP's value heads spread over that many SMs: :func:`split_gdn`; default: the head group, one value head
per instruction), ``fuse_reduce`` (default ``DEFAULT_FUSE`` = False: separate GEMV_REDUCE
instructions, assembler/scheduler.py; True: the split-K reduce inside the GEMV instructions, the last arriving
warp of a tile reduces it), ``defines`` (extra ``QMK_*`` build knobs, e.g. ``QMK_MK_RING``; results never depend
on them).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from assembler.numerics import MAX_ROWS
from assembler.options import PROGRAM
from loader.config import FULL, ModelConfig
from megakernel.build import (COUNTER_SEED, LAYER_DTYPE, MK_DIR, PARAMS_DTYPE, PREFETCH, RING_MAX, SMEM_LIMIT,
                              SOURCE, WEIGHT_DTYPE, kernel_defines, load, ring_slots)
from megakernel.diagnose import ERRORS, compare_steps, raise_on_error, short_counters
from megakernel.program import assemble, program_words, split_gdn, stage_lengths

__all__ = ["COUNTER_SEED", "DEFAULT_DEFER", "DEFAULT_FUSE", "DEFAULT_LOCAL", "ERRORS", "LAYER_DTYPE", "MK_DIR",
           "PARAMS_DTYPE", "PREFETCH", "RING_MAX", "SMEM_LIMIT", "SOURCE", "WEIGHT_DTYPE", "Megakernel",
           "build_program", "compare_steps", "compile_defines", "mk_defines", "program_words", "ring_slots",
           "split_gdn", "stage_lengths"]

# the default program's form: assembler/options.py PROGRAM (why each is what it is: its docstring)
DEFAULT_FUSE = PROGRAM.fuse_reduce  # GEMV_REDUCE instructions (the fused tail measured slower)
DEFAULT_DEFER = PROGRAM.defer_reduce  # residual split-K reduces in the consumers' prologues, 1-row programs only
DEFAULT_LOCAL = PROGRAM.local_reduce  # split-K in-projections reduced on their own instructions


def compile_defines(cfg: ModelConfig) -> list[dict]:
    """The builds the offline compile check (``// qmk: defines``) verifies: the decode build (M = 1 tiles), the
    M-row build, and the fused-reduce tail built in. The ``QMK_MK_TIMING`` build is left out to keep CI short
    (checked by hand: ``compile_check`` with ``mk_defines(cfg, timing=True)``)."""
    return [mk_defines(cfg, fuse_reduce=f, m1=m1) for f, m1 in ((False, True), (False, False), (True, False))]


def mk_defines(cfg: ModelConfig, timing: bool = False, extra: dict | None = None,
               fuse_reduce: bool = DEFAULT_FUSE, m1: bool = False) -> dict:
    """Extra ``QMK_*`` defines of megakernel.cu for a build (``megakernel.build.kernel_defines``), with the
    runner's defaults (``fuse_reduce`` = DEFAULT_FUSE, the default program's choice). Results never depend on
    them."""
    return kernel_defines(cfg, timing=timing, extra=extra, fuse_reduce=fuse_reduce, m1=m1)


def build_program(cfg: ModelConfig, m: int, num_sms: int, layer_limit: int | None = None,
                  fuse_reduce: bool = DEFAULT_FUSE, defer_reduce: bool | None = None,
                  local_reduce: bool = DEFAULT_LOCAL):
    """The assembled program of ``verify_graph(cfg, m, layer_limit, defer_reduce)`` for ``num_sms`` SMs (cached per
    process by ``megakernel.program.assemble``: the 27B schedule takes seconds; callers never modify it).
    ``defer_reduce`` None: DEFAULT_DEFER for m = 1, False for more rows; ``local_reduce``: the scheduler's
    (in-projections reduced on their instructions)."""
    if defer_reduce is None:
        defer_reduce = DEFAULT_DEFER and m == 1
    return assemble(cfg, m, num_sms, layer_limit, fuse_reduce, defer_reduce, local_reduce)


build_program.cache_clear = assemble.cache_clear  # the cache is assemble's (tools clear it around graph knobs)


def _load(cfg: ModelConfig, timing: bool, extra: dict | None = None, fuse_reduce: bool = DEFAULT_FUSE,
          m1: bool = False):
    """The cooperative megakernel module of these build knobs (``megakernel.build.load``)."""
    return load(cfg, mk_defines(cfg, timing, extra, fuse_reduce, m1))


class Megakernel:
    """The megakernel bound to one ``DecodeStep``: its weights, its ops' scratch (attention, argmax ids) and its
    ``DeviceState`` (``self.state``: arena, recurrent state, KV pages, control block, stream, position).

    ``num_sms``: blocks (default: the device's SM count); ``m_rows``: rows per step (default the step's m);
    ``layer_limit``, ``stop_after``, ``nop``, ``timing``, ``drop_wait``, ``delay_op``/``delay_ns``: see the
    module docstring; ``defer_reduce``: the program with residual split-K reduces in the consumers' prologues
    (None: ``DEFAULT_DEFER`` for 1-row steps, off for more rows; False: GEMV_REDUCE instructions for them);
    ``local_reduce``: split-K in-projections reduced on their own instructions (scheduler
    ``local_reduce``; default DEFAULT_LOCAL). Raises ValueError on bad arguments and RuntimeError when the device cannot hold exactly
    one block per SM (or when the kernel reports an error)."""

    def __init__(self, decode_step, num_sms: int | None = None, *, m_rows: int | None = None,
                 layer_limit: int | None = None, stop_after: int | None = None, nop: bool = False,
                 timing: bool = False, drop_wait=None, delay_op: int = -1, delay_ns: int = 0,
                 gdn_split: int | None = None, defines: dict | None = None, fuse_reduce: bool = DEFAULT_FUSE,
                 defer_reduce: bool | None = None, local_reduce: bool = DEFAULT_LOCAL):
        import cupy as cp
        self.ds, self.state, self.cfg = decode_step, decode_step.state, decode_step.cfg
        cfg = self.cfg
        dev = cp.cuda.Device()
        self.num_sms = int(num_sms or dev.attributes["MultiProcessorCount"])
        self.m = int(m_rows or decode_step.m)
        if not 1 <= self.m <= MAX_ROWS:
            raise ValueError(f"Megakernel: m_rows={self.m}; expected 1..{MAX_ROWS}")
        self.fuse_reduce = bool(fuse_reduce)
        self.defer_reduce = bool(DEFAULT_DEFER and self.m == 1) if defer_reduce is None else bool(defer_reduce)
        self.local_reduce = bool(local_reduce)
        self.program = build_program(cfg, self.m, self.num_sms, layer_limit, self.fuse_reduce, self.defer_reduce,
                                     self.local_reduce)
        if gdn_split is None:  # default: every value head its own GDN_STEP (measured faster on the 27B)
            gdn_split = PROGRAM.gdn_parts(cfg)
        if gdn_split > 1:
            self.program = split_gdn(self.program, gdn_split)
        words = program_words(self.program, nop, drop_wait)
        self.max_len = words.shape[1]
        self.lens = stage_lengths(self.program, stop_after)
        self.stop_after, self.timing = stop_after, timing
        self._keep = []  # device arrays the tables point into
        self._arrive = []  # the fused-reduce tile arrival counters behind each partial buffer (views of its allocation)
        self.d_prog = cp.asarray(words)
        self.d_lens = cp.asarray(self.lens)
        self.counters = cp.full(len(self.program.counters), COUNTER_SEED, cp.uint32)
        self.d_bufs = cp.asarray(self._buffer_table())
        self.d_weights = cp.asarray(self._weight_table().view(np.uint8))
        self.d_layers = cp.asarray(self._layer_table().view(np.uint8))
        self.mirror = cp.zeros(4, cp.uint32)
        self.d_timing = cp.zeros((self.num_sms, self.max_len, 3), cp.uint64) if timing else None
        # the head's per-SM best keys for the ARGMAX (isa.py ARGMAX_KEYS): [key, step] per SM; step 0 never runs
        self.d_keys = cp.zeros((self.num_sms, 2), cp.uint64)
        self._host_ptr = cp.cuda.runtime.hostAlloc(16, cp.cuda.runtime.hostAllocMapped)
        self.host = (ctypes.c_uint32 * 4).from_address(self._host_ptr)
        self.steps_done = 0
        self.persistent_stream = None
        # module, layout probe, occupancy
        mod = _load(cfg, timing, defines, self.fuse_reduce, self.m == 1)
        self.kernel = mod.get_function("mk_main")
        probe = cp.zeros(8, cp.int64)
        mod.get_function("mk_layout")((1,), (32,), (probe,))
        lay = probe.get()
        if (lay[1], lay[2], lay[3]) != (PARAMS_DTYPE.itemsize, WEIGHT_DTYPE.itemsize, LAYER_DTYPE.itemsize):
            raise RuntimeError(f"Megakernel: struct sizes differ between CUDA {lay[1:4].tolist()} and runner.py")
        self.smem, self.threads = int(lay[0]), int(lay[4])
        self.kernel.max_dynamic_shared_size_bytes = self.smem
        from cupy_backends.cuda.api import driver
        occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.kernel.kernel.ptr, self.threads, self.smem)
        if occ > 1:  # a cooperative grid may then stack 2 blocks on one SM: ask for enough shared memory to forbid it
            self.smem = max(self.smem, dev.attributes["MaxSharedMemoryPerMultiprocessor"] // 2 + 1024)
            self.kernel.max_dynamic_shared_size_bytes = self.smem
            occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.kernel.kernel.ptr, self.threads, self.smem)
        if occ != 1:
            raise RuntimeError(f"Megakernel: {occ} blocks of mk_main per SM ({self.threads} threads, {self.smem} B "
                               "shared); the megakernel needs exactly 1")
        self.occupancy = int(occ)
        self.params = np.zeros((), PARAMS_DTYPE)
        self._fill_params(delay_op, delay_ns)
        dev.synchronize()  # the tables and counters were filled on the default stream; launches use the step's

    # ------------------------------------------------------------------ tables
    def _attn(self):
        return self.ds.attention

    def _buffer_table(self) -> np.ndarray:
        """uint64 [n_buffers]: the DecodeStep's arena views for activations, its control-block tokens / argmax
        ids for io, its per-layer state; our own allocations for split-K partials (and logits when the step
        keeps none). A partial buffer [S, M, N] fp32 is followed by its fused-reduce tile arrival counters,
        uint32 [N / 16] (isa.py FUSE_REDUCE), zeroed here once: every step's last arrival of a tile resets its
        counter, so they are 0 again at every step boundary (and across launches)."""
        import cupy as cp
        ds, st, cfg = self.ds, self.state, self.cfg
        out = np.zeros(len(self.program.buffers), np.uint64)
        for i, b in enumerate(self.program.buffers):
            if b.kind == "act":
                a = st.buf.get(b.name)
                if a is None:  # e.g. logits without debug_logits
                    a = cp.empty((MAX_ROWS,) + b.shape[1:], cp.uint16 if b.dtype == "bf16" else cp.int32)
                    self._keep.append(a)
                if tuple(a.shape[1:]) != tuple(b.shape[1:]):
                    raise ValueError(f"Megakernel: DecodeStep buffer {b.name} is {a.shape}, program needs [*, {b.shape[1:]}]")
                out[i] = a.data.ptr
            elif b.kind == "scratch":  # attention stage intermediates: the discrete path's scratch, one for all layers
                att = self._attn()
                a = {"attq": att.q, "atts": att.scores, "attm": att.stats_m, "attl": att.stats_l,
                     "attp": att.partial}[b.name.split(".")[0]]
                per_row = int(np.prod([d or att.capacity for d in b.shape[1:]]))  # a 0 extent is the capacity
                if a.shape[0] < self.m or a.size // a.shape[0] != per_row:
                    raise ValueError(f"Megakernel: attention scratch for {b.name} is {a.shape}, program needs "
                                     f"[{self.m}, {b.shape[1:]}]")
                out[i] = a.data.ptr
            elif b.kind == "partial":
                n = int(np.prod(b.shape))
                raw = cp.zeros(4 * (n + b.shape[-1] // 16), cp.uint8)  # [partials | arrival counters]
                a = raw[:4 * n].view(cp.float32).reshape(b.shape)
                a.fill(np.nan)
                self._keep.append(a)        # poison() refills the partials only, never the counters
                self._arrive.append(raw[4 * n:].view(cp.uint32))
                out[i] = a.data.ptr
            elif b.name == "tokens":
                out[i] = st.tokens_dev.data.ptr
            elif b.name == "next":
                out[i] = ds.next_ids.data.ptr
            elif b.name == "hidden.out":  # the head's normalised input: the step's final-normed hidden
                out[i] = st.buf["hn"].data.ptr
            elif b.kind == "io":  # an io buffer this runner does not know: our own, so the program still runs
                a = cp.empty((MAX_ROWS,) + b.shape[1:], cp.uint16 if b.dtype == "bf16" else cp.int32)
                self._keep.append(a)
                out[i] = a.data.ptr
            elif b.kind == "state":
                kind, layer = b.name.split(".")
                layer = int(layer)
                if kind == "conv":
                    out[i] = st.ring[layer].data.ptr
                elif kind == "rec":
                    out[i] = st.rec[layer].data.ptr
                else:  # kcache / vcache: the layer's base in the page pool (K and V addressed from it)
                    out[i] = st.kv.layer_base(cfg.full_layers.index(layer))
            else:
                raise ValueError(f"Megakernel: no device buffer for program buffer {b.name} ({b.kind})")
        return out

    def _weight_table(self) -> np.ndarray:
        """WEIGHT_DTYPE [n_weights]: segment views into the fused projections of WeightsGPU, and norm vectors."""
        W, cfg = self.ds.weights, self.cfg
        vecs = {"model.norm.weight": W.final_norm, "lm_head.weight": W.lm_head}
        projs = []
        for i, L in enumerate(W.layers):
            vecs[f"model.layers.{i}.input_layernorm.weight"] = L["in_norm"]
            vecs[f"model.layers.{i}.post_attention_layernorm.weight"] = L["post_norm"]
            projs += [v for v in L.values() if hasattr(v, "parts")]
        t = np.zeros(len(self.program.weights), WEIGHT_DTYPE)
        for wid, names in enumerate(self.program.weights):
            if len(names) == 1 and names[0] in vecs:
                a = vecs[names[0]]
                rows, cols = (a.shape[0], a.shape[1]) if a.ndim == 2 else (1, a.shape[0])
                t[wid] = (a.data.ptr, 0, rows, cols, 0, 0)
                continue
            for p in projs:
                if names[0] in p.parts:
                    a = p.parts.index(names[0])
                    if tuple(p.parts[a:a + len(names)]) != tuple(names):
                        raise ValueError(f"Megakernel: weight {names} is not a contiguous run of fused {p.parts}")
                    r0, r1 = p.rows[a], p.rows[a + len(names)]
                    K = int(p.w.shape[1])
                    fp8 = p.scale is not None
                    ptr = p.w.data.ptr + r0 * K * p.w.itemsize
                    sc = p.scale.data.ptr + (r0 // 128) * (K // 128) * 2 if fp8 else 0
                    t[wid] = (ptr, sc, r1 - r0, K, int(fp8), 0)
                    break
            else:
                raise ValueError(f"Megakernel: weight {names} not found in the DecodeStep's WeightsGPU")
        return t

    def _layer_table(self) -> np.ndarray:
        W = self.ds.weights
        t = np.zeros(len(W.layers), LAYER_DTYPE)
        for i, L in enumerate(W.layers):
            keys = ("q_norm", "k_norm") if self.cfg.layer_types[i] == FULL else ("a", "b", "A_log", "dt_bias", "conv_w", "norm")
            for k, name in enumerate(keys):
                t["t"][i, k] = L[name].data.ptr
        return t

    def _fill_params(self, delay_op: int, delay_ns: int) -> None:
        import cupy as cp
        st, p = self.state, self.params
        att = self._attn()
        p["prog"], p["lens"], p["counters"] = self.d_prog.data.ptr, self.d_lens.data.ptr, self.counters.data.ptr
        p["bufs"], p["weights"], p["layers"] = self.d_bufs.data.ptr, self.d_weights.data.ptr, self.d_layers.data.ptr
        p["embed"], p["ctrl"] = self.ds.weights.embed.data.ptr, st.ctrl.data.ptr
        if att is not None:
            p["inv_freq"], p["att_cap"] = att.inv_freq.data.ptr, att.capacity
        p["page_table"], p["page_stride"] = st.sess.table.data.ptr, st.kv.page_stride
        p["host"], p["mirror"] = self._host_ptr, self.mirror.data.ptr
        p["timing"] = 0 if self.d_timing is None else self.d_timing.data.ptr
        p["keys"] = self.d_keys.data.ptr
        p["max_len"], p["seed"], p["delay_op"], p["delay_ns"] = self.max_len, COUNTER_SEED, delay_op, delay_ns
        self.d_params = cp.zeros(PARAMS_DTYPE.itemsize, cp.uint8)

    # ------------------------------------------------------------------ launches
    def _launch(self, n_steps: int, persistent: bool, stream) -> None:
        import cupy as cp
        p = self.params
        p["n_steps"], p["persistent"], p["step_base"] = n_steps, int(persistent), self.steps_done
        self.d_params.set(np.frombuffer(p.tobytes(), np.uint8), stream=stream)
        with stream:  # CuPy launches cooperatively (module built with cooperative=True)
            self.kernel((self.num_sms,), (self.threads,), (self.d_params,), shared_mem=self.smem)

    def _advance(self, n: int) -> None:
        self.steps_done += n
        self.state.note_steps(n, self.m)

    def step(self, tokens=None) -> None:
        """One step (one launch) on the DecodeStep's stream. ``tokens``: the rows' input ids (exactly m_rows),
        written into the control block first; None: the control block's tokens (greedy continuation)."""
        self.run_steps(1, tokens)

    def run_steps(self, n: int, tokens=None) -> None:
        """``n`` consecutive greedy steps in ONE launch (the finish stage feeds each argmax back as row 0's
        token). Raises ValueError on n < 1, wrong token count or a step past the capacity."""
        if n < 1:
            raise ValueError(f"Megakernel.run_steps: n={n} must be ≥ 1")
        if self.stop_after is not None and n > 1:
            raise ValueError("Megakernel.run_steps: stop_after runs a single step (the next embed waits on the argmax)")
        st = self.state
        if tokens is not None and st.set_tokens(tokens) != self.m:
            raise ValueError(f"Megakernel: the program runs {self.m} rows; got {len(tokens)} tokens")
        if st.pos + n * self.m > st.capacity:
            raise ValueError(f"Megakernel: {n} steps of {self.m} rows from {st.pos} exceed capacity {st.capacity}")
        self._launch(n, False, st.stream)
        self._advance(n if self.stop_after is None else 0)

    def check(self, timeout_s: float = 20.0) -> None:
        """Wait (polling, at most ``timeout_s``) for the DecodeStep's stream; raise RuntimeError naming the
        first stuck counters on a timeout (a deadlock) or when the kernel recorded an error."""
        import cupy as cp
        ev = cp.cuda.Event()
        ev.record(self.state.stream)
        t0 = time.perf_counter()
        while not ev.done:
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"megakernel did not finish within {timeout_s} s; {self.diagnose()}")
            time.sleep(1e-4)
        raise_on_error(self.mirror.get())

    def diagnose(self, step: int | None = None) -> str:
        """Counters below their target for step ``step`` (default: the last step launched), read on a side
        stream (works while the grid is still running)."""
        import cupy as cp
        s = cp.cuda.Stream(non_blocking=True)
        host = np.empty(self.counters.shape, np.uint32)
        self.counters.get(stream=s, out=host)
        s.synchronize()
        return short_counters(self.program.counters, host, self.steps_done if step is None else step)

    def arrivals_pending(self) -> int:
        """Nonzero fused-reduce tile arrival counters (0 at every step boundary: each tile's last arrival resets its
        counter; tests check it)."""
        self.state.stream.synchronize()
        return int(sum(int((a != 0).sum()) for a in self._arrive))

    def counter_values(self) -> np.ndarray:
        """Counters minus the seed (bumps received since construction), int64 [n_counters]."""
        return (self.counters.get().astype(np.int64) - COUNTER_SEED) % 2**32

    def poison(self) -> None:
        """NaN-fill the megakernel's own scratch (split-K partials, own logits) on the step's stream."""
        with self.state.stream:
            for a in self._keep:
                if a.dtype == np.float32:
                    a.fill(np.nan)
                else:
                    a.fill(0x7FC1)

    # ------------------------------------------------------------------ persistent mode (article Part 6.3)
    def start_persistent(self) -> None:
        """Launch the grid once; it then waits on mapped host memory for each :meth:`release`."""
        import cupy as cp
        if self.persistent_stream is not None:
            raise RuntimeError("Megakernel: persistent mode already running")
        self.host[0] = self.host[1] = self.host[2] = 0
        self.host[3] = 0xFFFFFFFF
        self.state.stream.synchronize()
        self.mirror.fill(0)
        self.state.ctrl_words("go").fill(0)  # the grid's mirror of the host's go count (counts from 0 per launch)
        cp.cuda.Device().synchronize()
        self._released = 0
        self._ctrl0 = int(self.state.control()["step"])
        self.persistent_stream = cp.cuda.Stream(non_blocking=True)
        self._launch(0, True, self.persistent_stream)

    def release(self, n: int = 1) -> None:
        """Let the resident grid run ``n`` more greedy steps."""
        if self.state.pos + n * self.m > self.state.capacity:
            raise ValueError(f"Megakernel.release: {n} more steps exceed capacity {self.state.capacity}")
        self._released += n
        self.host[0] = self._released
        self._advance(n)

    def wait_token(self, timeout_s: float = 30.0) -> int:
        """Spin on mapped memory until every released step finished; returns the last step's token.
        Raises TimeoutError."""
        t0 = time.perf_counter()
        target = self._ctrl0 + self._released  # the finish stage publishes the control block's step count
        while True:
            done = self.host[2]
            if done >= target:
                return int(ctypes.c_int32(self.host[3]).value)
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"megakernel persistent: control step {done} < {target} after {timeout_s} s")

    def stop_persistent(self) -> None:
        """Ask the grid to exit at its next step boundary and wait for it."""
        if self.persistent_stream is None:
            return
        self.host[1] = 1
        self.persistent_stream.synchronize()
        self.persistent_stream = None
        raise_on_error(self.mirror.get())

    def __del__(self):
        try:
            import cupy as cp
            if self.persistent_stream is not None:
                self.stop_persistent()
            cp.cuda.runtime.freeHost(self._host_ptr)
        except Exception:
            pass


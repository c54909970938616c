"""Host side of the megakernel (``megakernel/megakernel.cu``): builds the program for the SM count with the
assembler, uploads the program / counter / buffer / weight tables (device pointers taken from a
``discrete.step.DecodeStep``, so both paths read and write the same activations, state, KV pages and control
block), checks occupancy (exactly one block per SM), launches cooperatively, and drives the persistent mode.

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
import functools
import hashlib
import sys
from pathlib import Path

import numpy as np

from assembler.graph import verify_graph
from assembler.isa import WORDS, Opcode
from assembler.numerics import MAX_ROWS
from assembler.options import PROGRAM
from assembler.scheduler import schedule
from loader.config import FULL, ModelConfig

MK_DIR = Path(__file__).resolve().parent
SOURCE = MK_DIR / "megakernel.cu"
COUNTER_SEED = 0xFFFFFF00  # counters start near the uint32 wrap: the wait arithmetic must be wrap-safe
SMEM_LIMIT = 232448  # dynamic shared memory per block on sm_90 (227 KB)
RING_MAX = 3         # GEMV ring slots per warp at most (gemv.cuh supports ≤ 8; 6 measured 2 ms slower)
# the default program's form: assembler/options.py PROGRAM (why each is what it is: its docstring)
DEFAULT_FUSE = PROGRAM.fuse_reduce  # GEMV_REDUCE instructions (the fused tail measured slower)
DEFAULT_DEFER = PROGRAM.defer_reduce  # residual split-K reduces in the consumers' prologues, 1-row programs only
DEFAULT_LOCAL = PROGRAM.local_reduce  # split-K in-projections reduced on their own instructions
PREFETCH = 1         # QMK_MK_PREFETCH: a GEMV issues its first RING - 1 ring units before waiting for its input
ERRORS = {1: "unknown opcode", 2: "unsupported GEMV prologue (MTP concat, or an unknown one)",
          3: "bad row range",
          4: "fused split-K reduce in the program, but the module was built without it",
          5: "a GEMV or GDN step of M != 1 rows, but the module was built for M = 1",
          6: "a local-reduce GEMV with more splits than the block has warps, or not a store epilogue"}

_P = [(n, "<u8") for n in ("prog", "lens", "counters", "bufs", "weights", "layers", "embed", "ctrl", "page_table",
                           "inv_freq", "host", "mirror", "timing", "keys")]
PARAMS_DTYPE = np.dtype(_P + [("page_stride", "<i8"), ("max_len", "<i4"), ("att_cap", "<i4"), ("n_steps", "<i4"),
                              ("persistent", "<i4"), ("seed", "<u4"), ("step_base", "<u4"), ("delay_op", "<i4"),
                              ("delay_ns", "<i4")], align=True)
WEIGHT_DTYPE = np.dtype([("ptr", "<u8"), ("scale", "<u8"), ("rows", "<i4"), ("cols", "<i4"), ("fp8", "<i4"),
                         ("pad", "<i4")], align=True)
LAYER_DTYPE = np.dtype([("t", "<u8", (8,))])


def _mk_sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(MK_DIR.rglob("*.cu*")) + sorted((MK_DIR / "include").glob("*.h")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def compile_defines(cfg: ModelConfig) -> list[dict]:
    """The builds the offline compile check (``// qmk: defines``) verifies: the decode build (M = 1 tiles), the
    M-row build, and the fused-reduce tail built in. The ``QMK_MK_TIMING`` build is left out to keep CI short
    (checked by hand: ``compile_check`` with ``mk_defines(cfg, timing=True)``)."""
    return [mk_defines(cfg, fuse_reduce=f, m1=m1) for f, m1 in ((False, True), (False, False), (True, False))]


def mk_defines(cfg: ModelConfig, timing: bool = False, extra: dict | None = None,
               fuse_reduce: bool = DEFAULT_FUSE, m1: bool = False) -> dict:
    """Extra ``QMK_*`` defines of megakernel.cu: the numerics macros of gdn.cuh / attention.cuh (from their
    launchers, so both paths compile the same code), the MkParams layout offsets (checked by static_assert),
    and a hash of the megakernel sources (so an edited header never reuses a stale cached module). Build
    knobs that never change a result: ``fuse_reduce`` (whether the fused split-K tail is compiled into the
    GEMV instruction; a program that uses it needs it), ``m1`` (tiles built for M = 1; a program of more rows
    traps with error 5), ring depth and GEMV prefetch (``extra`` overrides)."""
    from discrete import attention, gdn
    d = {**gdn.extra_defines(cfg), **attention.extra_defines(cfg)}
    d.update({"QMK_MKP_SIZE": PARAMS_DTYPE.itemsize, "QMK_MKP_OFF_PAGE_STRIDE": PARAMS_DTYPE.fields["page_stride"][1],
              "QMK_MKP_OFF_SEED": PARAMS_DTYPE.fields["seed"][1], "QMK_MKP_OFF_DELAY_NS": PARAMS_DTYPE.fields["delay_ns"][1],
              "QMK_MKW_SIZE": WEIGHT_DTYPE.itemsize, "QMK_MKL_SIZE": LAYER_DTYPE.itemsize,
              "QMK_MK_SRC": "0x" + _mk_sources_hash()})
    d["QMK_MK_SMEM_LIMIT"] = SMEM_LIMIT
    d["QMK_MK_RING"] = ring_slots(cfg)
    d["QMK_MK_FUSE_REDUCE"] = int(bool(fuse_reduce))
    d["QMK_MK_PREFETCH"] = PREFETCH
    d["QMK_MK_M1"] = int(bool(m1))  # GEMV tiles built for M = 1 (1-row programs; measured faster)
    if timing:
        d["QMK_MK_TIMING"] = 1
    d.update(extra or {})  # build knobs (e.g. QMK_MK_RING); results never depend on them
    if d.get("QMK_MK_RING", 0) < 2:
        d["QMK_MK_PREFETCH"] = 0  # the prefetch fills the shared-memory ring
    return d


def ring_slots(cfg: ModelConfig) -> int:
    """GEMV weight-ring slots per warp (2 KB each, 16 warps), at most RING_MAX, that fit beside the normed-input
    buffer and the union scratch in SMEM_LIMIT (an upper estimate of the scratch, the GDN's silu(z) rows included;
    the kernel static_asserts the total)."""
    nkb = cfg.hidden_size // 128
    gdn = 2 * MAX_ROWS * 128 * 4 * 2 + MAX_ROWS * 2 * nkb * 4 + 64 + MAX_ROWS * 128 * 4 + (MAX_ROWS + 1) * 32 * 16
    att = MAX_ROWS * cfg.gqa_group * 4 * 2 + cfg.gqa_group * cfg.head_dim * 8 + 2 * cfg.gqa_group * 256 * 2
    base = MAX_ROWS * cfg.hidden_size * 2 + max(gdn, att, MAX_ROWS * 2 * 256 * 4) + 1024
    return int(min(RING_MAX, max(0, (SMEM_LIMIT - base) // (16 * 2048))))


@functools.lru_cache(maxsize=16)
def build_program(cfg: ModelConfig, m: int, num_sms: int, layer_limit: int | None = None,
                  fuse_reduce: bool = DEFAULT_FUSE, defer_reduce: bool | None = None,
                  local_reduce: bool = DEFAULT_LOCAL):
    """The assembled program of ``verify_graph(cfg, m, layer_limit, defer_reduce)`` for ``num_sms`` SMs (cached per
    process: the 27B schedule takes seconds; callers never modify it). ``defer_reduce`` None: DEFAULT_DEFER for
    m = 1, False for more rows; ``local_reduce``: the scheduler's (in-projections reduced on their instructions)."""
    if defer_reduce is None:
        defer_reduce = DEFAULT_DEFER and m == 1
    return schedule(verify_graph(cfg, m, layer_limit, defer_reduce), num_sms, fuse_reduce,
                    local_reduce=local_reduce)


def _cover_waits(prog, ins) -> tuple:
    """Waits that order every read of a GDN_STEP instruction without help from its SM's program order: the
    final counter(s) of the in-projection (its one group, or the groups of its key heads) and of the op that
    wrote its input x (buf2). (The scheduler's own waits may rely on producers placed earlier on the same SM.)"""
    names = {c.name: i for i, c in enumerate(prog.counters)}
    g = prog.graph
    layer = ins.layer
    groups = len(g.op(f"L{layer}.in").groups)  # one group (graph default) or one per key head
    want = [names[f"L{layer}.in.out{h if groups > 1 else 0}"] for h in range(ins.row_start, ins.row_end)]
    want = list(dict.fromkeys(want))
    xname = prog.buffers[ins.buf2].name
    prod = next(oi for oi, op in enumerate(g.ops) if xname in op.writes)
    want += [i for i, c in enumerate(prog.counters) if c.op == prod and c.stage == "out"]
    want = list(dict.fromkeys(want))  # deferred reduces (graph.defer_reduces): x's producer is the in-projection
    if len(want) > 4:
        raise ValueError(f"split_gdn: a GDN part would need {len(want)} waits")
    return tuple((c, prog.counters[c].expected, 0) for c in want)


def split_gdn(prog, parts: int):
    """A copy of ``prog`` where every GDN_STEP instruction becomes ``parts`` instructions over disjoint value-head
    parts (its ``split`` / ``nsplit`` fields; the kernel's GDN_STEP honours them), the extra ones on the least
    loaded SMs, each inserted in stage order (so every wait still points at an earlier stage: deadlock-free);
    the op's counter then expects ``parts`` × as many bumps. The value heads of one key head are independent
    (discrete/kernels/gdn.cuh runs them as separate blocks), so results are unchanged; only the time on the
    critical path shrinks. A performance knob of the runner until the scheduler partitions GDN this way."""
    import dataclasses
    from assembler.program import Counter, Program
    grp = prog.graph.cfg.gdn_head_group
    entries = [[(prog.stage_of[(s, j)], j, ins, prog.item_bytes[s][j]) for j, ins in enumerate(lst)]
               for s, lst in enumerate(prog.sm_lists)]
    load = np.array([sum(b) for b in prog.item_bytes], np.float64)
    factor: dict[int, int] = {}
    for s, lst in enumerate(prog.sm_lists):
        for j, ins in enumerate(lst):
            if ins.opcode != Opcode.GDN_STEP:
                continue
            k = min(parts, (ins.row_end - ins.row_start) * grp)
            if factor.setdefault(ins.bump, k) != k:
                raise ValueError(f"split_gdn: instructions of counter {ins.bump} cover different head counts")
            st, nb = prog.stage_of[(s, j)], prog.item_bytes[s][j] // k
            entries[s][j] = (st, j, dataclasses.replace(ins, split=0, nsplit=k), nb)
            busy = {t for t in range(prog.num_sms) if any(e[0] == st for e in entries[t])}
            cw = _cover_waits(prog, ins)
            for p in range(1, k):
                free = [t for t in np.argsort(load, kind="stable") if t not in busy]
                t = int(free[0] if free else np.argmin(load))
                busy.add(t)
                load[t] += nb
                entries[t].append((st, 1 << 30, dataclasses.replace(ins, split=p, nsplit=k, waits=cw, nwaits=len(cw)), nb))
    counters = [Counter(c.name, c.op, c.stage, c.group, c.expected * factor.get(i, 1))
                for i, c in enumerate(prog.counters)]
    lists, item_bytes, stage_of = [], [], {}
    for s, ent in enumerate(entries):
        ent = sorted(ent, key=lambda e: (e[0], e[1]))
        out = []
        for j, (st, _, ins, nb) in enumerate(ent):
            w = tuple((c, e * factor.get(c, 1), o * factor.get(c, 1)) for c, e, o in ins.waits)
            out.append(dataclasses.replace(ins, waits=w))
            stage_of[(s, j)] = st
        lists.append(out)
        item_bytes.append([e[3] for e in ent])
    new = Program(prog.graph, prog.num_sms, lists, counters, prog.weights, prog.weight_segment, item_bytes,
                  prog.buffers, prog.buffer_id)
    new.stage_of = stage_of
    return new


def program_words(prog, nop: bool = False, drop_wait: tuple[int, int, int] | None = None) -> np.ndarray:
    """int32 [num_sms, max_len, WORDS]. ``nop``: opcodes zeroed (waits, bumps kept). ``drop_wait`` = (sm, index,
    k): remove wait k of that instruction (tests: a missing dependency must show)."""
    w = prog.words().copy()
    if nop:
        w[:, :, 0] = int(Opcode.NOP)
    if drop_wait is not None:
        from assembler.isa import WAITS_OFFSET, FIELDS
        s, j, k = drop_wait
        nw = FIELDS.index("nwaits")
        n = int(w[s, j, nw])
        if not 0 <= k < n:
            raise ValueError(f"program_words: instruction ({s}, {j}) has {n} waits; cannot drop wait {k}")
        trip = w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * n].reshape(n, 3)
        trip = np.delete(trip, k, axis=0)
        w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * n] = 0
        w[s, j, WAITS_OFFSET:WAITS_OFFSET + 3 * (n - 1)] = trip.reshape(-1)
        w[s, j, nw] = n - 1
    return w


def stage_lengths(prog, stop_after: int | None) -> np.ndarray:
    """Instructions per SM to run: all, or those of stages ≤ stop_after (a prefix of each SM's list)."""
    out = np.zeros(prog.num_sms, np.int32)
    for s, lst in enumerate(prog.sm_lists):
        out[s] = len(lst) if stop_after is None else sum(1 for j in range(len(lst)) if prog.stage_of[(s, j)] <= stop_after)
    return out


def _load(cfg: ModelConfig, timing: bool, extra: dict | None = None, fuse_reduce: bool = DEFAULT_FUSE,
          m1: bool = False):
    """The cooperative megakernel module (discrete.build.load_module). The generated isa.h / control.h include
    <cuda/std/cstdint>; should this NVRTC not find it on its own, compile once more with CuPy's bundled CCCL
    include directories added (same source text, so the same code)."""
    from discrete.build import load_module
    try:
        mod = load_module(cfg, [str(SOURCE)], mk_defines(cfg, timing, extra, fuse_reduce, m1), cooperative=True)
        mod.compile()
        return mod
    except Exception as e:
        if "cuda/std" not in str(e):
            raise
        import cupy
        from cupy._core.core import _get_cccl_include_options
        from discrete.build import nvrtc_options, translation_unit
        print(f"megakernel: NVRTC did not find <cuda/std/...>; retrying with CuPy's CCCL includes", file=sys.stderr)
        code = translation_unit(cfg, [str(SOURCE)], mk_defines(cfg, timing, extra, fuse_reduce, m1))
        mod = cupy.RawModule(code=code, options=nvrtc_options() + tuple(_get_cccl_include_options()),
                             backend="nvrtc", enable_cooperative_groups=True)
        mod.compile()
        return mod


class Megakernel:
    """The megakernel bound to one ``DecodeStep`` (its weights, arena, state, KV pages and control block).

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
        self.ds, self.cfg = decode_step, decode_step.cfg
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
        for ops in self.ds.layer_ops:
            if "attn" in ops:
                return ops["attn"]
        return None

    def _buffer_table(self) -> np.ndarray:
        """uint64 [n_buffers]: the DecodeStep's arena views for activations, its control-block tokens / argmax
        ids for io, its per-layer state; our own allocations for split-K partials (and logits when the step
        keeps none). A partial buffer [S, M, N] fp32 is followed by its fused-reduce tile arrival counters,
        uint32 [N / 16] (isa.py FUSE_REDUCE), zeroed here once: every step's last arrival of a tile resets its
        counter, so they are 0 again at every step boundary (and across launches)."""
        import cupy as cp
        ds, cfg = self.ds, self.cfg
        out = np.zeros(len(self.program.buffers), np.uint64)
        for i, b in enumerate(self.program.buffers):
            if b.kind == "act":
                a = ds.buf.get(b.name)
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
                out[i] = ds.tokens_dev.data.ptr
            elif b.name == "next":
                out[i] = ds.head_bufs["ids"].data.ptr
            elif b.name == "hidden.out":  # the head's normalised input: the step's final-normed hidden
                out[i] = ds.buf["hn"].data.ptr
            elif b.kind == "io":  # an io buffer this runner does not know: our own, so the program still runs
                a = cp.empty((MAX_ROWS,) + b.shape[1:], cp.uint16 if b.dtype == "bf16" else cp.int32)
                self._keep.append(a)
                out[i] = a.data.ptr
            elif b.kind == "state":
                kind, layer = b.name.split(".")
                layer = int(layer)
                if kind == "conv":
                    out[i] = ds.ring[layer].data.ptr
                elif kind == "rec":
                    out[i] = ds.rec[layer].data.ptr
                else:  # kcache / vcache: the layer's base in the page pool (K and V addressed from it)
                    out[i] = ds.kv.layer_base(cfg.full_layers.index(layer))
            else:
                raise ValueError(f"Megakernel: no device buffer for program buffer {b.name} ({b.kind})")
        return out

    def _weight_table(self) -> np.ndarray:
        """WEIGHT_DTYPE [n_weights]: segment views into the fused projections of WeightsGPU, and norm vectors."""
        W, cfg = self.ds.w, self.cfg
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
        W = self.ds.w
        t = np.zeros(len(W.layers), LAYER_DTYPE)
        for i, L in enumerate(W.layers):
            keys = ("q_norm", "k_norm") if self.cfg.layer_types[i] == FULL else ("a", "b", "A_log", "dt_bias", "conv_w", "norm")
            for k, name in enumerate(keys):
                t["t"][i, k] = L[name].data.ptr
        return t

    def _fill_params(self, delay_op: int, delay_ns: int) -> None:
        import cupy as cp
        ds, p = self.ds, self.params
        att = self._attn()
        p["prog"], p["lens"], p["counters"] = self.d_prog.data.ptr, self.d_lens.data.ptr, self.counters.data.ptr
        p["bufs"], p["weights"], p["layers"] = self.d_bufs.data.ptr, self.d_weights.data.ptr, self.d_layers.data.ptr
        p["embed"], p["ctrl"] = ds.w.embed.data.ptr, ds.ctrl.data.ptr
        if att is not None:
            p["inv_freq"], p["att_cap"] = att.inv_freq.data.ptr, att.capacity
        p["page_table"], p["page_stride"] = ds.sess.table.data.ptr, ds.kv.page_stride
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
        self.ds.pos += n * self.m
        self.ds.last_m = self.m

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
        if tokens is not None and self.ds._set_tokens(tokens) != self.m:
            raise ValueError(f"Megakernel: the program runs {self.m} rows; got {len(tokens)} tokens")
        if self.ds.pos + n * self.m > self.ds.capacity:
            raise ValueError(f"Megakernel: {n} steps of {self.m} rows from {self.ds.pos} exceed capacity {self.ds.capacity}")
        self._launch(n, False, self.ds.stream)
        self._advance(n if self.stop_after is None else 0)

    def check(self, timeout_s: float = 20.0) -> None:
        """Wait (polling, at most ``timeout_s``) for the DecodeStep's stream; raise RuntimeError naming the
        first stuck counters on a timeout (a deadlock) or when the kernel recorded an error."""
        import time
        import cupy as cp
        ev = cp.cuda.Event()
        ev.record(self.ds.stream)
        t0 = time.perf_counter()
        while not ev.done:
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"megakernel did not finish within {timeout_s} s; {self.diagnose()}")
            time.sleep(1e-4)
        err = self.mirror.get()
        if err[2]:
            raise RuntimeError(f"megakernel error {err[2]} ({ERRORS.get(int(err[2]), '?')}), detail {err[3]}")

    def diagnose(self, step: int | None = None) -> str:
        """Counters below their target for step ``step`` (default: the last step launched), read on a side
        stream (works while the grid is still running)."""
        import cupy as cp
        s = cp.cuda.Stream(non_blocking=True)
        host = np.empty(self.counters.shape, np.uint32)
        self.counters.get(stream=s, out=host)
        s.synchronize()
        step = self.steps_done if step is None else step
        low = [(c.name, int((int(v) - COUNTER_SEED) % 2**32), step * c.expected)
               for c, v in zip(self.program.counters, host) if (int(v) - COUNTER_SEED) % 2**32 < step * c.expected]
        return f"{len(low)} counters short of step {step}: " + ", ".join(f"{n}={v}/{t}" for n, v, t in low[:8])

    def arrivals_pending(self) -> int:
        """Nonzero fused-reduce tile arrival counters (0 at every step boundary: each tile's last arrival resets its
        counter; tests check it)."""
        self.ds.stream.synchronize()
        return int(sum(int((a != 0).sum()) for a in self._arrive))

    def counter_values(self) -> np.ndarray:
        """Counters minus the seed (bumps received since construction), int64 [n_counters]."""
        return (self.counters.get().astype(np.int64) - COUNTER_SEED) % 2**32

    def poison(self) -> None:
        """NaN-fill the megakernel's own scratch (split-K partials, own logits) on the step's stream."""
        with self.ds.stream:
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
        self.ds.stream.synchronize()
        self.mirror.fill(0)
        from discrete.control import CONTROL_DTYPE
        go = CONTROL_DTYPE.fields["go"][1] // 4
        self.ds.ctrl[go:go + 1].fill(0)  # the grid's mirror of the host's go count (counts from 0 per launch)
        cp.cuda.Device().synchronize()
        self._released = 0
        self._ctrl0 = int(self.ds.control()["step"])
        self.persistent_stream = cp.cuda.Stream(non_blocking=True)
        self._launch(0, True, self.persistent_stream)

    def release(self, n: int = 1) -> None:
        """Let the resident grid run ``n`` more greedy steps."""
        if self.ds.pos + n * self.m > self.ds.capacity:
            raise ValueError(f"Megakernel.release: {n} more steps exceed capacity {self.ds.capacity}")
        self._released += n
        self.host[0] = self._released
        self._advance(n)

    def wait_token(self, timeout_s: float = 30.0) -> int:
        """Spin on mapped memory until every released step finished; returns the last step's token.
        Raises TimeoutError."""
        import time
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
        err = self.mirror.get()
        if err[2]:
            raise RuntimeError(f"megakernel error {err[2]} ({ERRORS.get(int(err[2]), '?')}), detail {err[3]}")

    def __del__(self):
        try:
            import cupy as cp
            if self.persistent_stream is not None:
                self.stop_persistent()
            cp.cuda.runtime.freeHost(self._host_ptr)
        except Exception:
            pass


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def compare_steps(a, b, program, m: int):
    """First bit difference between two DecodeSteps over every buffer ``program`` writes, in graph order:
    activations [m rows] (bf16 / int32 bits), argmax ids, GDN recurrent state (fp32 bits) and conv rings, then
    the KV page pools. Returns None, or (buffer, layer or None, flat index, value a, value b, count)."""
    a.stream.synchronize()
    b.stream.synchronize()
    for name, buf in program.graph.buffers.items():
        if buf.kind == "act":
            x, y = a.buf[name][:m].get(), b.buf[name][:m].get()
        elif name == "next":
            x, y = a.head_bufs["ids"][:m].get(), b.head_bufs["ids"][:m].get()
        elif name == "hidden.out":
            x, y = a.buf["hn"][:m].get(), b.buf["hn"][:m].get()
        elif buf.kind == "state" and name.startswith(("rec.", "conv.")):
            i = _layer_of(name)
            x, y = ((a.rec[i].get().view(np.uint32), b.rec[i].get().view(np.uint32)) if name.startswith("rec.")
                    else (a.ring[i].get(), b.ring[i].get()))
        else:
            continue
        d = np.flatnonzero(x.reshape(-1) != y.reshape(-1))
        if d.size:
            return name, _layer_of(name), int(d[0]), int(x.reshape(-1)[d[0]]), int(y.reshape(-1)[d[0]]), int(d.size)
    pa, pb = a.kv.pool.get(), b.kv.pool.get()
    d = np.flatnonzero(pa.reshape(-1) != pb.reshape(-1))
    if d.size:
        idx = np.unravel_index(d[0], pa.shape)  # [page, attn layer, k|v, kv head, slot, dim]
        return "kv_pool", int(program.graph.cfg.full_layers[idx[1]]), int(d[0]), int(pa.reshape(-1)[d[0]]), \
            int(pb.reshape(-1)[d[0]]), int(d.size)
    return None


# ---------------------------------------------------------------------- warm-up of the compile cache
def warm_jobs(preset: str) -> list[tuple]:
    """(preset, sources, defines, cooperative) of every module a decode step + megakernel of ``preset``
    compiles, with the defines their launchers pass (a mismatch only costs a cache miss later)."""
    from discrete import attention, gdn
    from discrete.lm_head import DEFAULT_DEFINES, TOPK
    from discrete.step import control_defines
    from loader.config import preset as get_preset
    cfg = get_preset(preset)
    mk = [(preset, [str(SOURCE)], {"fuse_reduce": f, "timing": t, "m1": m1}, True)
          for f, t, m1 in ((True, False, True), (DEFAULT_FUSE, False, True), (True, False, False),
                           (DEFAULT_FUSE, False, False), (DEFAULT_FUSE, True, True))]
    return mk + [(preset, ["gemv.cu"], None, False), (preset, ["lm_head.cu"], {"QMK_TOPK": TOPK, **DEFAULT_DEFINES}, False),
            (preset, ["embed.cu"], None, False), (preset, ["gdn.cu"], gdn.extra_defines(cfg), False),
            (preset, ["attention.cu"], attention.extra_defines(cfg), False),
            (preset, ["finish.cu"], control_defines(), False), (preset, ["hashgen.cu"], None, False)]


def _warm_one(job) -> str:
    import time
    from discrete.build import load_module
    from loader.config import preset as get_preset
    t = time.perf_counter()
    try:
        if job[3]:  # the megakernel: job[2] = _load's knobs
            _load(get_preset(job[0]), job[2]["timing"], job[2].get("extra"), job[2]["fuse_reduce"],
                  job[2].get("m1", False))
        else:
            load_module(get_preset(job[0]), job[1], job[2]).compile()
        return f"{job[0]} {Path(job[1][0]).name} {job[2] if job[3] else ''} " \
               f"{time.perf_counter() - t:.1f} s"
    except Exception as e:  # report, never stop the others
        return f"{job[0]} {job[1]}: FAILED {type(e).__name__}: {str(e)[:2000]}"


def warm(presets: list[str], workers: int = 16, jobs: list | None = None) -> None:
    """Compile every module of ``presets`` (or the given ``warm_jobs``-style jobs) in parallel processes,
    filling CuPy's on-disk kernel cache."""
    from concurrent.futures import ProcessPoolExecutor
    jobs = jobs if jobs is not None else [j for p in presets for j in warm_jobs(p)]
    with ProcessPoolExecutor(min(workers, len(jobs))) as ex:
        for line in ex.map(_warm_one, jobs):
            print("warm:", line, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--warm":
        warm(sys.argv[2:])
    else:
        print("usage: python3 -m megakernel.runner --warm PRESET [PRESET ...]")
